"""§9.10 The attention backward, the kernel side: P recomputed from the LSE, no N x N buffer.

Layer: back end (GPU) and bottom at once, like attention_kernels.py (whose AttentionSpec it
extends; it imports nothing else of stax), so that op_table.py (the eager `attn_bwd` op) and
codegen_triton.py can read it. attention.py (the user's `attention_backward`, and the autograd
formula of `sdpa` / `omni_attn`) sits at the top.

Consumes a `BackwardSpec` (the forward's spec plus the layouts of o and dO, and the traced
∂score_mod/∂score), or float64 numpy arrays (the eager op). Produces the two kernel texts
`triton_tem_fused_attention_bwd_dkdv` / `_dq` (dS = P (dP - delta), delta = rowsum(dO * o)), and
for a graph's `attn_bwd` node (the backward of a compiled training step) its spec and the
packing of dQ, dK, dV in its one output buffer.

Where to look:
  - `grads_from_scores`, `attn_bwd_numpy` .............. the float64 reference; the eager op
  - `BackwardSpec`, `backward_templates` ............... dK/dV over key blocks, dQ over query blocks
  - `bwd_extern_spec`, `packed_offsets` ................ a graph's `attn_bwd` node -> the two launches
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .attention_kernels import (LOG2E, PTR_TYPES, TL_DTYPES, AttentionSpec, ModBody, Operand, _expand_heads,
                                _extern_operand, _next_pow2, apply_mask, ieee_table, kernel_source,
                                attention_scores, make_spec, mod_plan)
from .attention_mods import hoist_mod


# float32 dots as set_float32_matmul_precision says (the forward spec's `precision`: "ieee" by
# default, "tf32" under "high"/"medium"). (A try at "tf32x3" with a backward table of smaller
# blocks, which builds for sm_90 without spills, crashed with an illegal address on the H200 in its
# autotuning of dK/dV (score_mod + block mask, N=33, d=64): not offered.
# Known gap: at head dim 16 in float32 every dK/dV configuration spills, and autotuning raises.)


def _precision(s: AttentionSpec) -> str:
    return f', input_precision="{s.precision}"' if s.dtype == "float32" else ""


# ---- §9.10 The float64 reference (the eager op) ----


def grads_from_scores(s, dmod, do, q, k, v, o, lse, scale=None) -> tuple:
    """dQ, dK, dV from the final scores S' [..., M, N] (mods and masks applied, -inf where a key
    does not count): P = exp(S' - LSE), dS = P (dP - delta) ∂S'/∂S, grouped heads summed."""
    h, hk = q.shape[-3], k.shape[-3]
    p = np.where(np.isneginf(s), 0.0, np.exp(s - lse[..., None]))    # (a row with no key: -inf - -inf)
    kk, vv = (_expand_heads(x.astype(np.float64), h) for x in (k, v))
    delta = (do * o).sum(-1, keepdims=True)
    ds = p * (do @ np.swapaxes(vv, -1, -2) - delta) * (1.0 if dmod is None else dmod)
    ds = np.where(p != 0, ds, 0.0)       # a position that did not count gets no gradient (as the kernels)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dq = ds @ kk * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    dv = np.swapaxes(p, -1, -2) @ do
    fold = lambda x: x.reshape(x.shape[:-3] + (hk, h // hk) + x.shape[-2:]).sum(-3)  # noqa: E731
    return dq, fold(dk), fold(dv)


def packed_offsets(q_shape, k_shape, v_shape) -> tuple:
    """Where dQ, dK, dV start, and the total: an `attn_bwd` node's output is [dQ | dK | dV], flat."""
    nq, nk, nv = (math.prod(s) for s in (q_shape, k_shape, v_shape))
    return 0, nq, nq + nk, nq + nk + nv


def attn_bwd_numpy(do, q, k, v, o, lse, attn_mask=None, is_causal=False, scale=None, score_mod=None,
                   score_grad=None, mask_mod=None):
    """The eager `attn_bwd` op (sdpa's backward in a compiled training step, on the CPU): dQ, dK,
    dV packed flat. (An omni_attn's mods are printed code: only the GPU templates run those.)"""
    if score_mod is not None or mask_mod is not None:
        raise NotImplementedError("stax internal error: an omni_attention backward has no host implementation")
    f64 = [np.asarray(x, np.float64) for x in (do, q, k, v, o, lse)]
    with np.errstate(all="ignore"):
        s = apply_mask(attention_scores(f64[1], f64[2], scale), attn_mask, is_causal)
        grads = grads_from_scores(s, None, *f64, scale)
    return np.concatenate([g.reshape(-1) for g in grads])


# ---- §9.10 The backward: P recomputed from the LSE, no N x N buffer ----


@dataclass
class BackwardSpec:
    """The forward's operands plus o, dO (like q) and the LSE [B·H·M] (float32)."""
    fwd: AttentionSpec
    o: Operand
    do: Operand
    score_grad: ModBody | None = None    # ∂score_mod/∂score, traced through Stax's autograd
    offsets: tuple = (0, 0, 0)           # where dQ, dK, dV start in their buffers (an `attn_bwd` node packs them)


def _off(bs: BackwardSpec, which: int) -> str:
    return f"{bs.offsets[which]} + " if bs.offsets[which] else ""


def _bwd_head(spec: AttentionSpec) -> list:
    b, h, hk, m, n, d = spec.dims
    return [f"M = {m}", f"N = {n}", f"D = {d}", f"rd = tl.arange(0, {_next_pow2(max(d, 16))})"]


def _bwd_mask(s: AttentionSpec, rows: str, cols: str, var: str, indent: str, base2: bool = False) -> tuple:
    """The attention mask in a backward tile: (lines, extra keep term); a float mask adds to `var`
    (times log2 e when the tile's scores are in base 2: a score_mod plan's, `_Planned`)."""
    if s.mask is None:
        return [], ""
    load = (f"{indent}am = tl.load(in_ptr6 + ({s.mask.index('b', 'h', rows, cols)}), "
            f"mask=({rows} < M) & ({cols} < N), other=0)")
    if s.mask_dtype == "bool":
        return [load], " & (am != 0)"
    return [load, f"{indent}{var} = {var} + am.to(tl.float32){f' * {LOG2E!r}' if base2 else ''}"], ""


@dataclass
class _Planned:
    """A backward tile's score_mod through attention_mods' plans (the forward's `mod_plan`, and
    the derivative's hoisting): the scores `var` in base 2 (the LSE too, so P = 2^(S - LSE)),
    the row terms the forward dropped taken out of the LSE instead (the LSE holds them), the
    (b, h) and row lines in `pre` (after the LSE's load), the column and per-score ones in
    `tile` (after the raw QKᵀ). `factor` is ∂score_mod/∂score's product, or ""."""
    pre: list
    tile: list
    factor: str

    @staticmethod
    def make(bs: BackwardSpec, rows: str, cols: str, var: str, q0: str, row_shape: str, axis: int):
        s = bs.fwd
        plan = mod_plan(s)
        dplan = None if plan is None else hoist_mod(tuple(bs.score_grad.lines), bs.score_grad.result)
        if dplan is None:
            return None
        pre = ["# " + x for x in plan.notes]
        body = plan.uniform + plan.row + dplan.uniform + dplan.row
        if any("q0" in x for x in body + plan.col):
            pre.append(f"q0 = {q0}")
        pre += [f"q_idx = {rows}", *body]
        if plan.dropped:
            pre += [f"row_drop = tl.sum(tl.zeros({row_shape}, dtype=tl.float32) + {plan.dropped}, {axis})",
                    f"lse = (lse - row_drop) * {LOG2E!r}      # base 2, without the dropped row terms"]
        else:
            pre.append(f"lse = lse * {LOG2E!r}      # base 2")
        tile = [f"kv_idx = {cols}", *plan.col, *dplan.col]
        reads_score = any(re.search(r"\bscore\b", x) for x in dplan.tile)
        if plan.folded:
            tile += [f"score = {var} * {s.scale!r}"] if reads_score else []
            tile.append(f"{var} = {var} * {plan.factor or repr(s.scale * LOG2E)}"
                        + (f" + {plan.column}" if plan.column else ""))
        else:
            tile += [f"score = {var} * {s.scale!r}", *plan.tile, f"{var} = {plan.result} * {LOG2E!r}"]
        tile += dplan.tile
        return _Planned(pre, tile, "" if dplan.result == "1.0" else f" * {dplan.result}")


def _bwd_mods(bs: BackwardSpec, rows: str, cols: str, var: str, indent: str) -> tuple:
    """score_mod, its derivative and mask_mod in a backward tile of scores `var` (natural units):
    (lines, extra keep term, the factor dS' -> dS). The tile's positions are q_idx = `rows`,
    kv_idx = `cols`; mask_mod is evaluated on every block (the backward visits them all)."""
    s, lines, keep, factor = bs.fwd, [], "", ""
    if s.score_mod is not None or s.mask_mod is not None:
        lines += [f"q_idx = {rows}", f"kv_idx = {cols}"]
    if s.score_mod is not None:
        lines += [f"score = {var}", *s.score_mod.lines, f"smod = {s.score_mod.result}"]
        lines += [*bs.score_grad.lines, f"dsmod = {bs.score_grad.result}", f"{var} = smod"]
        factor = " * dsmod"
    if s.mask_mod is not None:
        lines += [*s.mask_mod.lines, f"mm = {s.mask_mod.result}"]
        keep = " & (mm != 0)"
    return [indent + x for x in lines], keep, factor


def _bwd_tile(bs: BackwardSpec, rows: str, cols: str, var: str, indent: str, planned=None) -> tuple:
    """What a backward tile of scores `var` applies, in order: score_mod and mask_mod
    (`_bwd_mods`, or the `_Planned` lines), then the attention mask (`_bwd_mask`): (lines,
    extra keep term, factor)."""
    if planned is not None:
        mm = bs.fwd.mask_mod
        mod_lines = [indent + x for x in planned.tile + ([f"q_idx = {rows}", *mm.lines, f"mm = {mm.result}"]
                                                        if mm is not None else [])]
        mod_keep, factor = " & (mm != 0)" if mm is not None else "", planned.factor
    else:
        mod_lines, mod_keep, factor = _bwd_mods(bs, rows, cols, var, indent)
    mask_lines, mask_keep = _bwd_mask(bs.fwd, rows, cols, var, indent, planned is not None)
    return mod_lines + mask_lines, mod_keep + mask_keep, factor


def _dkdv_body(bs: BackwardSpec) -> list:
    """One program per BLOCK_M keys of one (batch, key head): for every query head of its group
    and every query block, P^T = exp(S^T - LSE), dV += P^T dO, dS^T = P^T (dP^T - delta),
    dK += dS^T q (delta = rowsum(dO * o), recomputed per block)."""
    s = bs.fwd
    b, h, hk, m, n, d = s.dims
    prec = _precision(s)
    dt = TL_DTYPES[s.dtype]
    lo = "(pid_n * BLOCK_M) // BLOCK_N * BLOCK_N" if s.is_causal else "0"
    keep = "(rm[None, :] < M) & (rn[:, None] < N)" + (" & (rm[None, :] >= rn[:, None])" if s.is_causal else "")
    qi, oi, doi = (x.index("b", "h", "rm[:, None]", "rd[None, :]") for x in (s.q, bs.o, bs.do))
    planned = _Planned.make(bs, "rm[None, :]", "rn[:, None]", "sT", "start_m", "[1, BLOCK_N]", 0)
    mask_lines, mask_keep, factor = _bwd_tile(bs, "rm[None, :]", "rn[:, None]", "sT", " " * 8, planned)
    exp = "tl.exp" if planned is None else "tl.math.exp2"
    return _bwd_head(s) + [
        "pid_n = tl.program_id(0)", "bh = tl.program_id(1)", f"b = bh // {hk}", f"hk = bh % {hk}",
        "# this program's keys are BLOCK_M wide (the grid's axis), the query blocks BLOCK_N",
        "rn = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)",
        f"kb = tl.load(in_ptr1 + ({s.k.index('b', 'hk', 'rn[:, None]', 'rd[None, :]')}), "
        "mask=(rn[:, None] < N) & (rd[None, :] < D), other=0.0)",
        f"vb = tl.load(in_ptr2 + ({s.v.index('b', 'hk', 'rn[:, None]', 'rd[None, :]')}), "
        "mask=(rn[:, None] < N) & (rd[None, :] < D), other=0.0)",
        f"dk = tl.zeros([BLOCK_M, {_next_pow2(max(d, 16))}], dtype=tl.float32)",
        f"dv = tl.zeros([BLOCK_M, {_next_pow2(max(d, 16))}], dtype=tl.float32)",
        f"for g in range(0, {h // hk}):",
        f"    h = hk * {h // hk} + g",
        f"    for start_m in range({lo}, M, BLOCK_N):",
        "        rm = start_m + tl.arange(0, BLOCK_N)",
        "        row = (rm[:, None] < M) & (rd[None, :] < D)",
        f"        qb = tl.load(in_ptr0 + ({qi}), mask=row, other=0.0)",
        f"        ob = tl.load(in_ptr3 + ({oi}), mask=row, other=0.0).to(tl.float32)",
        f"        dob = tl.load(in_ptr4 + ({doi}), mask=row, other=0.0)",
        f"        lse = tl.load(in_ptr5 + ((b * {h} + h) * M + rm), mask=rm < M, other=0.0)",
        *("        " + x for x in (planned.pre if planned else [])),
        "        delta = tl.sum(dob.to(tl.float32) * ob, 1)",
        f"        sT = tl.dot(kb, tl.trans(qb){prec}, out_dtype=tl.float32)" + (f" * {s.scale!r}" if planned is None else ""),
        *mask_lines,
        f"        pT = tl.where({keep}{mask_keep}, {exp}(sT - lse[None, :]), 0.0)",
        f"        dv += tl.dot(pT.to({dt}), dob{prec}, out_dtype=tl.float32)",
        f"        dpT = tl.dot(vb, tl.trans(dob){prec}, out_dtype=tl.float32)",
        f"        dsT = tl.where({keep}{mask_keep}, pT * (dpT - delta[None, :]){factor}, 0.0)",
        f"        dk += tl.dot(dsT.to({dt}), qb{prec}, out_dtype=tl.float32)",
        "out = (rn[:, None] < N) & (rd[None, :] < D)",
        f"tl.store(out_ptr0 + ({_off(bs, 1)}bh * N * D + rn[:, None] * D + rd[None, :]), (dk * {s.scale!r}).to({dt}), out)",
        f"tl.store(out_ptr1 + ({_off(bs, 2)}bh * N * D + rn[:, None] * D + rd[None, :]), dv.to({dt}), out)"]


def _dq_body(bs: BackwardSpec) -> list:
    """One program per BLOCK_M queries: dQ = Σ_blocks dS K, dS = P (dP - delta), P recomputed."""
    s = bs.fwd
    b, h, hk, m, n, d = s.dims
    prec = _precision(s)
    dt = TL_DTYPES[s.dtype]
    hi = "tl.minimum(N, (pid_m + 1) * BLOCK_M)" if s.is_causal else "N"
    keep = "(rm[:, None] < M) & (rn[None, :] < N)" + (" & (rm[:, None] >= rn[None, :])" if s.is_causal else "")
    row = "(rm[:, None] < M) & (rd[None, :] < D)"
    planned = _Planned.make(bs, "rm[:, None]", "rn[None, :]", "sc", "pid_m * BLOCK_M", "[BLOCK_M, 1]", 1)
    mask_lines, mask_keep, factor = _bwd_tile(bs, "rm[:, None]", "rn[None, :]", "sc", " " * 4, planned)
    exp = "tl.exp" if planned is None else "tl.math.exp2"
    return _bwd_head(s) + [
        "pid_m = tl.program_id(0)", "bh = tl.program_id(1)", f"b = bh // {h}", f"h = bh % {h}",
        f"hk = h // {h // hk}",
        "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        f"qb = tl.load(in_ptr0 + ({s.q.index('b', 'h', 'rm[:, None]', 'rd[None, :]')}), mask={row}, other=0.0)",
        f"ob = tl.load(in_ptr3 + ({bs.o.index('b', 'h', 'rm[:, None]', 'rd[None, :]')}), mask={row}, other=0.0)",
        f"dob = tl.load(in_ptr4 + ({bs.do.index('b', 'h', 'rm[:, None]', 'rd[None, :]')}), mask={row}, other=0.0)",
        "lse = tl.load(in_ptr5 + (bh * M + rm), mask=rm < M, other=0.0)",
        *(planned.pre if planned else []),
        "delta = tl.sum(dob.to(tl.float32) * ob.to(tl.float32), 1)",
        f"dq = tl.zeros([BLOCK_M, {_next_pow2(max(d, 16))}], dtype=tl.float32)",
        f"for start_n in range(0, {hi}, BLOCK_N):",
        "    rn = start_n + tl.arange(0, BLOCK_N)",
        "    col = (rn[None, :] < N) & (rd[:, None] < D)",
        f"    kT = tl.load(in_ptr1 + ({s.k.index('b', 'hk', 'rn[None, :]', 'rd[:, None]')}), mask=col, other=0.0)",
        f"    vT = tl.load(in_ptr2 + ({s.v.index('b', 'hk', 'rn[None, :]', 'rd[:, None]')}), mask=col, other=0.0)",
        f"    sc = tl.dot(qb, kT{prec}, out_dtype=tl.float32)" + (f" * {s.scale!r}" if planned is None else ""),
        *mask_lines,
        f"    p = tl.where({keep}{mask_keep}, {exp}(sc - lse[:, None]), 0.0)",
        f"    dp = tl.dot(dob, vT{prec}, out_dtype=tl.float32)",
        f"    ds = tl.where({keep}{mask_keep}, p * (dp - delta[:, None]){factor}, 0.0)",
        f"    dq += tl.dot(ds.to({dt}), tl.trans(kT){prec}, out_dtype=tl.float32)",
        f"tl.store(out_ptr0 + ({_off(bs, 0)}bh * M * D + rm[:, None] * D + rd[None, :]), (dq * {s.scale!r}).to({dt}), {row})"]


def backward_templates(bs: BackwardSpec, index: int | None = None) -> list:
    """[(name, source, numels)] of the two backward kernels: dK and dV over key blocks, then dQ
    over query blocks. Both take q, k, v, o, dO, LSE; dK, dV (and dQ) come out contiguous."""
    s = bs.fwd
    b, h, hk, m, n, d = s.dims
    ptr = PTR_TYPES[s.dtype]
    ins = {f"in_ptr{i}": ptr for i in range(5)} | {"in_ptr5": "*fp32"}
    if s.mask is not None:
        ins["in_ptr6"] = PTR_TYPES[s.mask_dtype]
    out = []
    for kind, body, outs, numels in (("dkdv", _dkdv_body(bs), 2, [b * hk, n, m, d, 0, 0]),
                                     ("dq", _dq_body(bs), 1, [b * h, m, n, d, 0, 0])):
        name = f"triton_tem_fused_attention_bwd_{kind}" + ("" if index is None else f"_{index}")
        sig = ins | {f"out_ptr{i}": ptr for i in range(outs)} | {
            k: "i32" for k in ("bnumel", "mnumel", "nnumel", "dnumel", "sqnumel", "skvnumel")}
        src = kernel_source(name, "the attention backward (§9.10), P = exp(S - LSE) recomputed per block",
                            "attention", numels, sig, ["BLOCK_M : tl.constexpr", "BLOCK_N : tl.constexpr"], body, d,
                            ieee_table(s, backward=True))
        out.append((name, src, numels))
    return out


# ---- §9.10 The template from a graph's `attn_bwd` node (codegen_triton.py) ----


def _contiguous(shape) -> tuple:
    out, acc = [], 1
    for s in reversed(shape):
        out.insert(0, acc)
        acc *= s
    return tuple(out)


def bwd_extern_spec(e, lowered) -> tuple:
    """(BackwardSpec or None, the buffers the two launches read) of an `attn_bwd` node: its inputs
    dO, q, k, v, o, LSE [, attn_mask]; params as the forward's, with the traced mods' Triton bodies."""
    if e.op != "attn_bwd" or not all(hasattr(x, "buffer") or isinstance(x, str) for x in e.inputs):
        return None, []
    ops = [_extern_operand(x, lowered) for x in e.inputs]
    names, dtypes = [o[0] for o in ops], [o[1] for o in ops]
    p = e.params
    mask, mask_dtype = (ops[6][2], dtypes[6]) if len(ops) == 7 else (None, "")
    q = ops[1][2]
    if len(set(dtypes[:5])) != 1 or dtypes[1] != e.dtype.name or dtypes[5] != "float32" \
            or (mask_dtype and mask_dtype not in ("bool",) + tuple(TL_DTYPES)):
        return None, names
    spec = make_spec(q, ops[2][2], ops[3][2], q, e.dtype.name, p.get("scale"), p.get("is_causal", False),
                     mask, mask_dtype, e.origins)
    lse = ops[5][2]                              # read as [B·H·M], contiguous
    if spec is None or ops[4][2] is None or ops[0][2] is None or lse is None \
            or lse.offset or any(st != c for st, c, n in zip(lse.stride, _contiguous(lse.shape), lse.shape) if n > 1):
        return None, names
    pick = lambda mod: None if mod is None else mod.triton      # noqa: E731
    spec.score_mod, spec.mask_mod = pick(p.get("score_mod")), pick(p.get("mask_mod"))
    bs = BackwardSpec(spec, ops[4][2], ops[0][2], pick(p.get("score_grad")),
                      packed_offsets(q.shape, spec.k.shape, spec.v.shape)[:3])
    return bs, names[1:5] + names[:1] + names[5:]          # the kernels take q, k, v, o, dO, LSE [, mask]
