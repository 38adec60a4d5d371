"""§9.10 Attention, the kernel side: the online triple, its eager form, and the flash templates.

Layer: back end (GPU) and bottom at once: it imports nothing of stax (but template_tuning's
float32 precision setting and attention_mods.py's score_mod plans, which import nothing above
them), so that op_table.py (the
eager `sdpa` op), the launcher (triton_heuristics.py: configurations and grid of the kind
"attention") and the generator (codegen_triton.py) can all read it. The user's API (sdpa,
omni_attention, block masks, the backward) sits at the top, in attention.py.

Consumes: float64/float32 numpy arrays (the triple, the eager op), or an `AttentionSpec`: the
layouts of q, k, v (and of an attention mask or a block mask), the dtype, the scale, causality,
and the printed bodies of a traced `score_mod` / `mask_mod`.
Produces: the kernel text `triton_tem_fused_attention_N`, decorated
`@triton_heuristics.attention(...)`; its launch writes the output and the per-row LSE.

The tiled algorithm of Theorem 9.2: one program per BLOCK_M query rows of one (batch, head) keeps
the online triple (m, ℓ, acc) on chip while it scans K and V in BLOCK_N blocks, so S and P exist
only as BLOCK_M × BLOCK_N tiles. Exponentials run in base 2 (the scores are multiplied by log2 e
once), the LSE is written in base e: LSE = m + log ℓ.

Where to look:
  - `triple_of`, `merge_triples`, `finish_triple` ..... the online triple (m, ℓ, a) and its merge
  - `sdpa_numpy` ........................................ the eager op (float64 inside)
  - `AttentionSpec` ..................................... what one template kernel computes
  - `_kv_step` .......................................... one K/V block: QKᵀ, score_mod, mask, update
  - `mod_plan`, `_mod_prologue`, `_mod_scores` .......... score_mod hoisted / row terms dropped / folded
  - `decode_templates` .................................. BACKEND="TRITON_DECODE": keys split, triples merged
  - `cpp_template` ...................................... the C++ template (BACKEND="CPP", compiled CPU code)
  - `omni_extern_spec`, `ModText` ....................... a graph's `omni_attn` node -> a spec
  - (the backward's kernels: attention_grad.py)
  - `attention_configs`, `attention_grid` ............... candidates and grid (§9.6)
  - `attention_template` ................................ the entry: (name, source)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np

from .attention_mods import ModPlan, plan_score_mod

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
TL_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}
PTR_TYPES = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "bool": "*i1",
             "int32": "*i32", "int64": "*i64"}
INT32_LIMIT = 2 ** 31


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


# ---- §9.10 The online triple (m, ℓ, a) ----


def triple_of(s: np.ndarray, v: np.ndarray) -> tuple:
    """The triple of one segment of keys: m = max s, ℓ = Σ e^(s - m), a = Σ e^(s - m) v.

    `s` is [..., rows, n] (the scores of the segment), `v` [..., n, d]. An empty or fully masked segment
    (all -inf) is the identity of the merge: (-inf, 0, 0)."""
    m = s.max(-1) if s.shape[-1] else np.full(s.shape[:-1], -np.inf)
    shift = np.where(np.isneginf(m), 0.0, m)        # e^(-inf - -inf) is 0 here, not NaN
    p = np.exp(s - shift[..., None])
    return m, p.sum(-1), np.matmul(p, v)


def merge_triples(t1: tuple, t2: tuple) -> tuple:
    """Merge two segments: μ = max(m₁, m₂); ℓ and a both rescale by e^(mᵢ - μ). Associative and
    commutative (the same argument as Prop. 9.1), so attention splits along the keys like a sum."""
    (m1, l1, a1), (m2, l2, a2) = t1, t2
    mu = np.maximum(m1, m2)
    shift = np.where(np.isneginf(mu), 0.0, mu)
    e1, e2 = np.exp(m1 - shift), np.exp(m2 - shift)
    return mu, l1 * e1 + l2 * e2, a1 * e1[..., None] + a2 * e2[..., None]


def finish_triple(t: tuple) -> tuple:
    """(o, LSE) = (a / ℓ, m + log ℓ). A row that saw no key has ℓ = 0: o is NaN, as softmax's."""
    m, l, a = t
    with np.errstate(divide="ignore", invalid="ignore"):
        return a / l[..., None], m + np.log(l)


# ---- §9.10 The eager op ----


def _expand_heads(k: np.ndarray, heads: int) -> np.ndarray:
    """GQA: each of k's heads serves heads // k.heads query heads (a repeat along dim -3)."""
    if k.ndim < 3 or k.shape[-3] == heads:
        return k
    return np.repeat(k, heads // k.shape[-3], axis=-3)


def attention_scores(q, k, scale=None) -> np.ndarray:
    """S = scale · q kᵀ in float64 (scale defaults to 1/√d)."""
    q = np.asarray(q, np.float64)
    k = _expand_heads(np.asarray(k, np.float64), q.shape[-3] if q.ndim >= 3 else 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return np.matmul(q, np.swapaxes(k, -1, -2)) * scale


def apply_mask(s, attn_mask=None, is_causal=False) -> np.ndarray:
    """A bool mask keeps where True, a float mask adds; causal keeps kv_idx ≤ q_idx (top left)."""
    if is_causal:
        n_q, n_kv = s.shape[-2:]
        s = np.where(np.tril(np.ones((n_q, n_kv), bool)), s, -np.inf)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        s = np.where(attn_mask, s, -np.inf) if attn_mask.dtype == bool else s + attn_mask
    return s


def sdpa_lse_numpy(q, k, v, attn_mask=None, is_causal=False, scale=None) -> tuple:
    """(softmax(S) v, LSE) in float64 through the triple of one segment (every key at once)."""
    s = apply_mask(attention_scores(q, k, scale), attn_mask, is_causal)
    v = _expand_heads(np.asarray(v, np.float64), s.shape[-3] if s.ndim >= 3 else 1)
    return finish_triple(triple_of(s, v))


def sdpa_numpy(q, k, v, *extra, is_causal=False, scale=None, enable_gqa=False, with_lse=False):
    """The eager `sdpa` op (op_table): the output only. `extra` is [attn_mask] [, lse]: with
    `with_lse` the node's last input is its LSE (`attn_lse` of the same inputs, kept for the
    backward); the output does not depend on it."""
    mask = extra[0] if len(extra) > int(with_lse) else None
    with np.errstate(all="ignore"):
        return sdpa_lse_numpy(q, k, v, mask, is_causal, scale)[0]


def attn_lse_numpy(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """The eager `attn_lse` op: the LSE [..., M] (float32) that `sdpa` of the same inputs writes."""
    with np.errstate(all="ignore"):
        return sdpa_lse_numpy(q, k, v, attn_mask, is_causal, scale)[1].astype(np.float32)


# ---- §9.10 What one template kernel computes ----


@dataclass
class Operand:
    """A 4-D strided view: [batch, heads, rows, cols] (size-1 or stride-0 dims broadcast)."""
    shape: tuple
    stride: tuple
    offset: int = 0

    def index(self, b: str, h: str, rows: str, cols: str) -> str:
        terms = [str(self.offset)] if self.offset else []
        for i, (var, size, st) in enumerate(zip((b, h, rows, cols), self.shape, self.stride)):
            if size != 1 and st != 0:
                terms.append(var if st == 1 else f"{var} * {st}")
            elif i >= 2 and var != "0":     # a block's rows and cols: still a block of pointers
                terms.append(f"{var} * 0")
        return " + ".join(terms) or "0"

    def span(self) -> int:
        return self.offset + sum((s - 1) * abs(st) for s, st in zip(self.shape, self.stride)) + 1


@dataclass
class ModBody:
    """A traced score_mod or mask_mod printed as Triton lines: its inputs are the kernel's
    variables `score`, `b`, `h`, `q_idx`, `kv_idx`; `result` names the value it computes."""
    lines: list
    result: str


@dataclass(frozen=True)
class ModText:
    """A traced score_mod or mask_mod as a parameter of a graph's `omni_attn` node: its body as
    each back end's printer wrote it. Its repr (in the graph text, hence the artifact key) is
    that text, so the same traced function gives the same node."""
    triton: ModBody
    cpp: ModBody

    def __repr__(self):
        return "mod{" + "; ".join(self.triton.lines + [self.triton.result, "|"] + self.cpp.lines
                                  + [self.cpp.result]) + "}"


@dataclass
class AttentionSpec:
    q: Operand
    k: Operand
    v: Operand
    out: Operand
    dtype: str                       # float32 | float16 | bfloat16
    scale: float
    is_causal: bool = False
    mask: Operand | None = None      # an attention mask: bool keeps, float adds
    mask_dtype: str = ""
    score_mod: ModBody | None = None
    mask_mod: ModBody | None = None
    sparse: tuple | None = None      # (SPARSE_Q, SPARSE_KV, num-blocks layout, indices layout)
    origins: list = field(default_factory=list)
    # tl.dot's input_precision for float32 operands: set_float32_matmul_precision's when the spec
    # was made ("highest", the default: "ieee"; "high"/"medium": "tf32"); unused for half types
    precision: str = "ieee"

    @property
    def dims(self) -> tuple:
        """(B, H, HK, M, N, D)."""
        (b, h, m, d), (_, hk, n, _) = self.q.shape, self.k.shape
        return b, h, hk, m, n, d

    @property
    def big(self) -> bool:
        return any(x.span() >= INT32_LIMIT for x in (self.q, self.k, self.v, self.out, self.mask) if x)


def _layout(x: Operand | None) -> tuple | None:
    return None if x is None else (x.shape, x.stride, x.offset)


def spec_key(spec: AttentionSpec) -> tuple:
    """Everything the kernel text of `spec` depends on, as a hashable tuple: an eager launch looks
    its kernel up by this instead of printing the text again (printing takes a few hundred µs of
    host time, more than a decode step's kernels)."""
    def body(b): return None if b is None else (tuple(b.lines), b.result)
    sparse = None if spec.sparse is None else (*spec.sparse[:2], *map(_layout, spec.sparse[2:]))
    return (tuple(map(_layout, (spec.q, spec.k, spec.v, spec.out, spec.mask))), spec.dtype, spec.scale,
            spec.is_causal, spec.mask_dtype, body(spec.score_mod), body(spec.mask_mod), sparse,
            tuple(spec.origins), spec.precision, os.environ.get(PLAN_ENV, "1"))


# ---- §9.10 The kernel text ----


def _mod_lines(body: ModBody, into: str) -> list:
    return body.lines + [f"{into} = {body.result}"]


# The running max starts at float32's lowest finite value, not -inf: then m_new is finite after
# any block, even one whose scores are all -inf (masked, or -inf from the data), so 2^(m_i - m_new)
# and 2^(s - m_new) need no guard against -inf - -inf = NaN (a select per row and step that cost
# ~4% at head dim 64 on the H200). A row that sees no key keeps l = 0: o = 0/0 = NaN and
# LSE = -inf, as before. Only -inf lies below it, so no finite score is lost.
M_START = -3.4028234663852886e38

# The largest BLOCK_M / BLOCK_N of any configuration (attention_configs, attention_tuning_space):
# a static sequence length that is a multiple of it is cut into whole blocks by every one.
SEQ_BLOCK_LIMIT = 128


def _whole_blocks(spec: AttentionSpec) -> tuple:
    """(queries, keys): whether every configuration cuts M (N) into whole blocks. Then no load,
    store or score needs the sequence-end mask (a mask that is always true still costs a select
    per score and blocks the vector loads)."""
    _, _, _, m, n, _ = spec.dims
    return m % SEQ_BLOCK_LIMIT == 0, n % SEQ_BLOCK_LIMIT == 0


def _mask_arg(conds: list, other: str = "0.0") -> str:
    """`, mask=..., other=...` of a load from the conditions that can be false, or nothing."""
    conds = [c for c in conds if c]
    return f", mask={' & '.join(conds)}, other={other}" if conds else ""


def _raw_scores(spec: AttentionSpec) -> bool:
    """Whether the online update can take the raw QKᵀ and fold the scale into exp2's argument
    (max(s·x) = s·max(x) for s > 0, and s·x - m is one FMA per score): only when nothing reads
    the scaled score before the update (no additive mask, and no score_mod, or one whose plan
    leaves the score as it is: score + row terms, dropped)."""
    additive = spec.mask is not None and spec.mask_dtype != "bool"
    plan = mod_plan(spec)
    plain = spec.score_mod is None or (plan is not None and plan.folded and not plan.factor and not plan.column)
    return plain and not additive and spec.scale > 0


PLAN_ENV = "STAX_SCORE_MOD_PLAN"     # "0": print score_mod as traced, per score (to compare the two)


def mod_plan(spec: AttentionSpec) -> ModPlan | None:
    """attention_mods' plan of the spec's score_mod (hoisted, row terms dropped, folded), or None
    (no score_mod, one it cannot read, or PLAN_ENV=0: the traced lines run per score). The index
    bounds are the sizes padded by a block (rm and rn run past M and N in the last block)."""
    if spec.score_mod is None or os.environ.get(PLAN_ENV, "1") == "0":
        return None
    b, h, _, m, n, _ = spec.dims
    pad = lambda x: -(-x // SEQ_BLOCK_LIMIT) * SEQ_BLOCK_LIMIT + SEQ_BLOCK_LIMIT      # noqa: E731
    bounds = (("b", 0, b - 1), ("h", 0, h - 1), ("q_idx", 0, pad(m)), ("kv_idx", 0, pad(n)))
    return plan_score_mod(tuple(spec.score_mod.lines), spec.score_mod.result, bounds, float(spec.scale))


def _mod_prologue(spec: AttentionSpec, q0: str, rows: str, q_idx: str = "rm[:, None]") -> list:
    """Before the KV loop: the plan's (b, h) and row lines, once per program, and `row_drop`, the
    dropped row terms as a [rows] vector (natural units), which the LSE gets back."""
    plan = mod_plan(spec)
    if plan is None:
        return []
    lines = ["# " + x for x in plan.notes]
    body = plan.uniform + plan.row
    if any("q0" in x for x in body + plan.col):
        lines.append(f"q0 = {q0}                  # the query block's first row: integer terms are centred on it")
    if plan.row:
        lines.append(f"q_idx = {q_idx}")
    lines += body
    if plan.dropped:
        lines.append(f"row_drop = tl.sum(tl.zeros([{rows}, 1], dtype=tl.float32) + {plan.dropped}, 1)")
    return lines


def _mod_scores(spec: AttentionSpec, plan: ModPlan) -> list:
    """In the KV loop, after qk = QKᵀ: the plan's column lines (once per KV block), then the
    scores in base 2: folded, qk · factor + column (one FMA); else the per-score lines."""
    lines = (["kv_idx = rn[None, :]"] + plan.col) if plan.col else []
    if plan.folded:
        factor = plan.factor or repr(spec.scale * LOG2E)
        if plan.column:
            lines.append(f"qk = qk * {factor} + {plan.column}")
        elif plan.factor:
            lines.append(f"qk = qk * {factor}")
        return lines         # (else the scale folds into the online update: _raw_scores)
    return lines + [f"score = qk * {spec.scale!r}", "q_idx = rm[:, None]", "kv_idx = rn[None, :]",
                    *plan.tile, f"qk = {plan.result} * {LOG2E!r}"]


def _kv_step(spec: AttentionSpec, partial: bool) -> list:
    """One K/V block (rn = its key rows): S = QKᵀ, score_mod, the masks, the online update.

    `partial` says whether this block needs masking beyond the sequence end: the causal mask, the
    attention mask and mask_mod (Figure 9.3: only partial blocks evaluate mask_mod)."""
    prec = f', input_precision="{spec.precision}"' if spec.dtype == "float32" else ""
    d = spec.dims[5]
    whole_m, whole_n = _whole_blocks(spec)
    rd_row, rd_col = _head_dim_mask(d, "rd[:, None]"), _head_dim_mask(d, "rd[None, :]")
    lines = ["rn = start_n + tl.arange(0, BLOCK_N)",
             f"kT = tl.load(in_ptr1 + ({spec.k.index('b', 'hk', 'rn[None, :]', 'rd[:, None]')})"
             f"{_mask_arg(['' if whole_n else '(rn[None, :] < N)', rd_row])})",
             f"qk = tl.dot(q, kT{prec}, out_dtype=tl.float32)"]
    keep = [] if whole_n else ["(rn[None, :] < N)"]
    raw, plan = _raw_scores(spec), mod_plan(spec)
    if plan is not None:
        lines += _mod_scores(spec, plan)
    elif spec.score_mod is not None:
        lines += [f"score = qk * {spec.scale!r}", "q_idx = rm[:, None]", "kv_idx = rn[None, :]"]
        lines += _mod_lines(spec.score_mod, "qk") + [f"qk = qk * {LOG2E!r}"]
    elif not raw:
        lines.append(f"qk = qk * {spec.scale * LOG2E!r}")
    if partial and spec.is_causal:
        keep.append("(rm[:, None] >= rn[None, :])")
    if partial and spec.mask is not None:
        seq = [c for c, whole in (("(rm[:, None] < M)", whole_m), ("(rn[None, :] < N)", whole_n)) if not whole]
        lines.append(f"am = tl.load(in_ptr3 + ({spec.mask.index('b', 'h', 'rm[:, None]', 'rn[None, :]')})"
                     f"{_mask_arg(seq, '0')})")
        if spec.mask_dtype == "bool":
            keep.append("(am != 0)")
        else:
            lines.append(f"qk = qk + am.to(tl.float32) * {LOG2E!r}")
    if partial and spec.mask_mod is not None:
        lines += ["q_idx = rm[:, None]", "kv_idx = rn[None, :]"] + _mod_lines(spec.mask_mod, "mm")
        keep.append("(mm != 0)")
    if keep:
        lines.append(f"qk = tl.where({' & '.join(keep)}, qk, float(\"-inf\"))")
    scaled = f" * {spec.scale * LOG2E!r}" if raw else ""
    lines += ["# the online update: rescale (l, acc) by 2^(m_old - m_new), then add this block"
              + (" (the scale folded into exp2's argument)" if raw else ""),
              f"m_new = tl.maximum(m_i, tl.max(qk, 1){scaled})",
              "alpha = tl.math.exp2(m_i - m_new)",
              f"p = tl.math.exp2(qk{scaled} - m_new[:, None])",
              "l_i = l_i * alpha + tl.sum(p, 1)",
              f"vb = tl.load(in_ptr2 + ({spec.v.index('b', 'hk', 'rn[:, None]', 'rd[None, :]')})"
              f"{_mask_arg(['' if whole_n else '(rn[:, None] < N)', rd_col])})",
              # the dot accumulates into the rescaled acc (no separate [BLOCK_M, D] add)
              f"acc = tl.dot(p.to({TL_DTYPES[spec.dtype]}), vb, acc * alpha[:, None]{prec}, out_dtype=tl.float32)",
              "m_i = m_new"]
    return lines


def _dense_loop(spec: AttentionSpec) -> list:
    """Every K/V block. Causal: the blocks left of the diagonal need no causal mask (each key
    precedes every query of the program), then the diagonal blocks take it; none past them."""
    if not spec.is_causal or spec.mask is not None:
        hi = "tl.minimum(N, (pid_m + 1) * BLOCK_M)" if spec.is_causal else "N"
        return [f"for start_n in range(0, {hi}, BLOCK_N):"] + ["    " + x for x in _kv_step(spec, True)]
    return (["# the blocks left of the diagonal: no causal mask",
             "diagonal = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N",
             "for start_n in range(0, diagonal, BLOCK_N):"] + ["    " + x for x in _kv_step(spec, False)]
            + ["# the diagonal blocks: the causal mask",
               "for start_n in range(diagonal, tl.minimum(N, (pid_m + 1) * BLOCK_M), BLOCK_N):"]
            + ["    " + x for x in _kv_step(spec, True)])


def _sparse_loops(spec: AttentionSpec) -> list:
    """Figure 9.3: the partial blocks of this Q block (with mask_mod), then its full blocks
    (without); empty blocks are never visited. Each listed block is SPARSE_KV keys, scanned in
    BLOCK_N pieces. The next piece's block index is loaded one step ahead: K's address then does
    not wait on a load issued in the same step, so the pipelined K/V loads run ahead (H200, d128
    causal + ALiBi: 377 -> 405 TFLOP/s; bench/RESULTS.md)."""
    sq, skv, nb, ind = spec.sparse
    lines = [f"qb = (pid_m * BLOCK_M) // {sq}", f"per = {skv} // BLOCK_N"]
    for label, nb_ptr, ind_ptr, partial in (("partial", "in_ptr4", "in_ptr5", True),
                                             ("full", "in_ptr6", "in_ptr7", False)):
        # one flat loop over the listed blocks' BLOCK_N pieces (not a loop nest, which measured
        # slower), so that the compiler's software pipelining (num_stages) overlaps the loads
        # across blocks too
        lines += [f"# the {label} blocks of this Q block, each in {skv} // BLOCK_N pieces",
                  f"pieces = tl.load({nb_ptr} + ({nb.index('b', 'h', 'qb', '0')})) * per",
                  f"kv_block = tl.load({ind_ptr} + ({ind.index('b', 'h', 'qb', '0')}), mask=pieces > 0, other=0)",
                  "for it in range(0, pieces):",
                  f"    start_n = kv_block * {skv} + (it % per) * BLOCK_N",
                  f"    kv_block = tl.load({ind_ptr} + ({ind.index('b', 'h', 'qb', '((it + 1) // per)')}), "
                  "mask=it + 1 < pieces, other=0)   # the next piece's"]
        lines += ["    " + x for x in _kv_step(spec, partial)]
    return lines


def _heaviest_first(uneven: bool) -> str:
    """The query block of this program. Under a causal (or block-sparse) mask a query block's work
    grows with its index, and CUDA starts programs in order of program_id(0): counted from the
    last block, the longest programs start first and the grid's last wave is short ones (the
    longest-processing-time-first order FlashAttention-3 schedules causal attention in)."""
    return "pid_m = tl.num_programs(0) - 1 - tl.program_id(0)" if uneven else "pid_m = tl.program_id(0)"


def _body(spec: AttentionSpec) -> list:
    b, h, hk, m, n, d = spec.dims
    whole_m, _ = _whole_blocks(spec)
    rd_col = _head_dim_mask(d, "rd[None, :]")
    out_conds = [c for c in ("" if whole_m else "(rm[:, None] < M)", rd_col) if c]
    store_mask = f", {' & '.join(out_conds)}" if out_conds else ""
    to64 = ".to(tl.int64)" if spec.big else ""
    lines = [f"M = {m}", f"N = {n}", f"D = {d}",
             _heaviest_first(spec.is_causal or spec.sparse is not None),
             f"bh = tl.program_id(1){to64}",
             f"b = bh // {h}", f"h = bh % {h}",
             f"hk = h // {h // hk}" if h != hk else "hk = h",
             f"rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){to64}",
             f"rd = tl.arange(0, {_next_pow2(max(d, 16))})",
             f"q = tl.load(in_ptr0 + ({spec.q.index('b', 'h', 'rm[:, None]', 'rd[None, :]')})"
             f"{_mask_arg(['' if whole_m else '(rm[:, None] < M)', rd_col])})",
             "# the online triple of each query row: running max (base 2), sum, and output",
             f"m_i = tl.full([BLOCK_M], {M_START!r}, tl.float32)",
             "l_i = tl.zeros([BLOCK_M], dtype=tl.float32)",
             f"acc = tl.zeros([BLOCK_M, {_next_pow2(max(d, 16))}], dtype=tl.float32)"]
    lines += _mod_prologue(spec, "pid_m * BLOCK_M", "BLOCK_M")
    lines += _sparse_loops(spec) if spec.sparse else _dense_loop(spec)
    plan = mod_plan(spec)
    drop = plan is not None and plan.dropped
    lines += ["# o = a / l (a row that saw no key gives NaN, as softmax), LSE = (m + log2 l) * ln 2"
              + (" + the dropped row terms" if drop else ""),
              "o = acc / l_i[:, None]" + ("  + (row_drop - row_drop)[:, None]   # (NaN where a dropped term is not finite)"
                                          if drop else ""),
              f"tl.store(out_ptr0 + ({spec.out.index('b', 'h', 'rm[:, None]', 'rd[None, :]')}), "
              f"o.to({TL_DTYPES[spec.dtype]}){store_mask})",
              f"tl.store(out_ptr1 + (bh * M + rm), (m_i + tl.math.log2(l_i)) * {LN2!r}{' + row_drop' if drop else ''}"
              f"{'' if whole_m else ', rm < M'})"]
    return lines


def _full_d(d: int) -> bool:
    """A head dim that is a power of two (>= 16) is exactly the block's `rd` range."""
    return d >= 16 and not d & (d - 1)


def _head_dim_mask(d: int, rd: str) -> str:
    """The head-dim condition of a load or store along `rd`, or "" when it is always true."""
    return "" if _full_d(d) else f"({rd} < D)"


def _full_head_dim(lines: list, d: int) -> list:
    """A head dim that is exactly the block's `rd` range (`_full_d`) has masks that are always
    true, so they are left out (a mask along the contiguous dim blocks vector loads)."""
    if not _full_d(d):
        return lines
    return [x.replace(" & (rd[None, :] < D)", "").replace(" & (rd[:, None] < D)", "") for x in lines]


def _signature(spec: AttentionSpec) -> dict:
    ptr = PTR_TYPES[spec.dtype]
    sig = {"in_ptr0": ptr, "in_ptr1": ptr, "in_ptr2": ptr}
    if spec.mask is not None:
        sig["in_ptr3"] = PTR_TYPES[spec.mask_dtype]
    if spec.sparse:
        sig.update({"in_ptr4": "*i32", "in_ptr5": "*i32", "in_ptr6": "*i32", "in_ptr7": "*i32"})
    sig.update({"out_ptr0": ptr, "out_ptr1": "*fp32"})
    numel = "i64" if spec.big else "i32"
    sig.update({k: numel for k in ("bnumel", "mnumel", "nnumel", "dnumel", "sqnumel", "skvnumel")})
    return sig


def launch_numels(spec: AttentionSpec) -> list:
    """The numel arguments of a launch: B·H, M, N, D and the block mask's block sizes (0: dense);
    the configurations and the grid read them (D and the sparse blocks bound the BLOCK sizes)."""
    b, h, _, m, n, d = spec.dims
    sq, skv = spec.sparse[:2] if spec.sparse else (0, 0)
    return [b * h, m, n, d, sq, skv]


def ieee_table(spec: AttentionSpec, backward: bool = False) -> dict:
    """The decorator's meta of a kernel whose float32 dots are IEEE: which small-tile table of
    `attention_configs` it takes (IEEE dots run on the FMA units, their tiles held in registers)."""
    if spec.dtype != "float32" or spec.precision != "ieee":
        return {}
    return {"ieee": IEEE_BACKWARD if backward else IEEE_FORWARD}


def kernel_source(name: str, comment: str, decorator: str, numels: list, sig: dict, consts: list,
                  body: list, d: int, meta: dict | None = None) -> str:
    """One attention kernel's text: its comment line, the `triton_heuristics` decorator with the
    size hints of its numel arguments (B·H, M, N, D, the block mask's blocks), the signature and
    constexprs (and `meta`: `ieee_table`'s), the body with the head dim padded (`_full_head_dim`)."""
    hints = dict(zip(("b", "m", "n", "d", "sq", "skv"), (_next_pow2(x) if x else 0 for x in numels)))
    extra = f", meta={meta!r}" if meta else ""
    return (f"# {name}: {comment}\n"
            f"@triton_heuristics.{decorator}(size_hints={hints!r}, signature={sig!r}{extra})\n"
            f"@triton.jit\n"
            f"def {name}({', '.join(list(sig) + consts)}):\n"
            + "\n".join("    " + line for line in _full_head_dim(body, d)) + "\n")


def attention_template(index: int, spec: AttentionSpec) -> tuple:
    """(kernel name, kernel source). The launch passes q, k, v [, mask] [, the four block-mask
    arrays], out, lse (float32, [B·H·M]), then `launch_numels(spec)`."""
    name = f"triton_tem_fused_attention_{index}"
    what = ", ".join(dict.fromkeys(spec.origins)) or "attention"
    return name, kernel_source(name, f"computes {what} (flash attention, §9.10)", "attention",
                               launch_numels(spec), _signature(spec),
                               ["BLOCK_M : tl.constexpr", "BLOCK_N : tl.constexpr"], _body(spec), spec.dims[5],
                               ieee_table(spec))


# ---- §9.10 The template from a graph's `sdpa` node (codegen_triton.py) ----


def _ints(values):
    """The values as ints, or None when one is symbolic (a §10 size: no template yet)."""
    try:
        return tuple(int(v) for v in values)
    except TypeError:
        return None


def as_operand(shape, stride, offset=0) -> Operand | None:
    """A layout of rank ≤ 4 as a 4-D Operand (missing leading dims broadcast), else None."""
    shape, stride, offset = _ints(shape), _ints(stride), _ints([offset])
    if shape is None or stride is None or offset is None or len(shape) > 4:
        return None
    pad = 4 - len(shape)
    return Operand((1,) * pad + shape, (0,) * pad + stride, offset[0])


def _extern_operand(x, lowered) -> tuple:
    """(buffer name, dtype name, Operand or None) of an extern kernel's tensor input."""
    if isinstance(x, str):
        buf = lowered.buffer(x)
        return x, buf.dtype.name, as_operand(buf.layout.shape, buf.layout.stride, buf.layout.offset)
    buf = lowered.buffer(x.buffer)
    return x.buffer, buf.dtype.name, as_operand(x.layout.shape, x.layout.stride, x.layout.offset)


def make_spec(q, k, v, out, dtype, scale=None, is_causal=False, mask=None, mask_dtype="",
              origins=()) -> AttentionSpec | None:
    """The spec of a template for these Operands, or None when the template cannot run them
    (shapes it does not cover: the eager op runs instead, never a wrong answer)."""
    if dtype not in TL_DTYPES or None in (q, k, v, out) or (mask_dtype and mask is None):
        return None
    (b, h, m, d), (bk, hk, n, dk) = q.shape, k.shape
    if (dk != d or v.shape != k.shape or out.shape != q.shape or bk not in (1, b) or hk == 0
            or h % hk or d > 256 or b * h > 65535 or b * h == 0 or m == 0):
        return None
    if mask is not None and any(s not in (1, full) for s, full in zip(mask.shape, (b, h, m, n))):
        return None
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    from .template_tuning import input_precision      # (the §9.8 setting: float32 dots follow it)
    return AttentionSpec(q, k, v, out, dtype, scale, bool(is_causal), mask, mask_dtype,
                         origins=list(origins), precision=input_precision())


def _block_operand(shape, stride, offset) -> Operand | None:
    """A block mask's count array [B, H, QB] as 4-D (a trailing dim of 1), its index array as is."""
    if len(shape) == 3:
        shape, stride = tuple(shape) + (1,), tuple(stride) + (1,)
    return as_operand(shape, stride, offset)


def omni_extern_spec(e, lowered, language: str = "triton") -> tuple:
    """(AttentionSpec, the buffers the launch reads) of an `omni_attn` node (attention.py records
    it under stax.compile): q, k, v [, the block mask's four arrays], its mods' bodies printed
    for `language` ('triton' or 'cpp'). The node was recorded only for inputs the template runs."""
    inputs = e.inputs[:-1] if e.params.get("with_lse") else e.inputs     # (the LSE: the launch's output)
    ops = [_extern_operand(x, lowered) for x in inputs]
    for i, layout in enumerate(e.params.get("layouts") or ()):     # (symbolic, guarded equal to these)
        ops[i] = (ops[i][0], ops[i][1], as_operand(*layout))
    names = [o[0] for o in ops]
    out = as_operand(e.layout.shape, e.layout.stride, 0)
    spec = make_spec(ops[0][2], ops[1][2], ops[2][2], out, ops[0][1], e.params["scale"], origins=e.origins)
    if spec is None or ops[0][1] != e.dtype.name:
        raise RuntimeError(f"stax internal error: the omni_attn node {e.name} does not fit the template")
    pick = lambda mod: None if mod is None else getattr(mod, language)      # noqa: E731
    spec.score_mod, spec.mask_mod = pick(e.params["score_mod"]), pick(e.params["mask_mod"])
    if e.params["block"]:
        layouts = [lowered.buffer(x).layout if isinstance(x, str) else x.layout for x in e.inputs[3:5]]
        spec.sparse = (*e.params["block"], *(_block_operand(x.shape, x.stride, x.offset) for x in layouts))
    return spec, names


def extern_spec(e, lowered) -> tuple:
    """(AttentionSpec or None, the names of the buffers the launch reads) of an `sdpa` node."""
    if e.op == "omni_attn":
        return omni_extern_spec(e, lowered)
    inputs = e.inputs[:-1] if e.params.get("with_lse") else e.inputs     # (the LSE: the launch's output)
    if e.op != "sdpa" or not inputs or not all(hasattr(x, "buffer") or isinstance(x, str) for x in inputs):
        return None, []
    ops = [_extern_operand(x, lowered) for x in inputs]
    names, dtypes = [o[0] for o in ops], [o[1] for o in ops]
    if len(set(dtypes[:3])) != 1 or dtypes[0] != e.dtype.name:
        return None, names
    out = as_operand(e.layout.shape, e.layout.stride, 0)
    mask, mask_dtype = (ops[3][2], dtypes[3]) if len(ops) == 4 else (None, "")
    if mask_dtype and mask_dtype not in ("bool",) + tuple(TL_DTYPES):
        return None, names
    spec = make_spec(ops[0][2], ops[1][2], ops[2][2], out, e.dtype.name, e.params.get("scale"),
                     e.params.get("is_causal", False), mask, mask_dtype, e.origins)
    return spec, names


# ---- §9.10 The decode template: very short queries, the keys split (the triple's merge) ----

DECODE_MAX_QUERIES = 64
DECODE_CHUNK_ALIGN = 128        # a split's keys are a multiple of every BLOCK_N candidate


def decode_splits(n: int, programs_wanted: int) -> tuple:
    """(splits, keys per split): enough splits that B·H·splits programs fill the GPU, each split
    at least DECODE_CHUNK_ALIGN keys."""
    chunk = max(DECODE_CHUNK_ALIGN, -(-n // max(1, programs_wanted)))
    chunk = -(-chunk // DECODE_CHUNK_ALIGN) * DECODE_CHUNK_ALIGN
    return -(-n // chunk), chunk


def _decode_split_body(spec: AttentionSpec, splits: int, chunk: int) -> list:
    b, h, hk, m, n, d = spec.dims
    rows, dp = max(16, _next_pow2(m)), _next_pow2(max(d, 16))
    whole_m, rd_col = m == rows, _head_dim_mask(d, "rd[None, :]")
    lines = [f"M = {m}", f"N = {n}", f"D = {d}", "split = tl.program_id(0)", "bh = tl.program_id(1)",
             f"b = bh // {h}", f"h = bh % {h}", f"hk = h // {h // hk}" if h != hk else "hk = h",
             f"rm = tl.arange(0, {rows})", f"rd = tl.arange(0, {dp})",
             f"q = tl.load(in_ptr0 + ({spec.q.index('b', 'h', 'rm[:, None]', 'rd[None, :]')})"
             f"{_mask_arg(['' if whole_m else '(rm[:, None] < M)', rd_col])})",
             f"m_i = tl.full([{rows}], {M_START!r}, tl.float32)",
             f"l_i = tl.zeros([{rows}], dtype=tl.float32)",
             f"acc = tl.zeros([{rows}, {dp}], dtype=tl.float32)"]
    lines += _mod_prologue(spec, "0", str(rows))
    lines += ["# this program's split of the keys: its own triple, merged by the second kernel",
             f"for start_n in range(split * {chunk}, tl.minimum(N, (split + 1) * {chunk}), BLOCK_N):"]
    lines += ["    " + x for x in _kv_step(spec, True)]
    plan = mod_plan(spec)
    drop = plan is not None and plan.dropped
    lines += [f"base = (bh * {splits} + split) * {rows}",
              # (the dropped row terms shift the running max back: the merge and its LSE see the full scores)
              f"tl.store(out_ptr0 + (base + rm), m_i{f' + row_drop * {LOG2E!r}' if drop else ''})", "tl.store(out_ptr1 + (base + rm), l_i)",
              f"tl.store(out_ptr2 + ((base + rm[:, None]) * {dp} + rd[None, :]), acc)"]
    return lines


def _decode_merge_body(spec: AttentionSpec, splits: int) -> list:
    b, h, hk, m, n, d = spec.dims
    rows, dp = max(16, _next_pow2(m)), _next_pow2(max(d, 16))
    return [f"M = {m}", f"D = {d}", "bh = tl.program_id(1)", f"b = bh // {h}", f"h = bh % {h}",
            f"rm = tl.arange(0, {rows})", f"rd = tl.arange(0, {dp})",
            f"mu = tl.full([{rows}], float(\"-inf\"), tl.float32)",
            f"for s in range(0, {splits}):",
            f"    mu = tl.maximum(mu, tl.load(in_ptr0 + ((bh * {splits} + s) * {rows} + rm)))",
            "mu_use = tl.where(mu == float(\"-inf\"), 0.0, mu)",
            f"l_i = tl.zeros([{rows}], dtype=tl.float32)",
            f"acc = tl.zeros([{rows}, {dp}], dtype=tl.float32)",
            "# merge the splits' triples: each rescaled by 2^(m_s - mu)",
            f"for s in range(0, {splits}):",
            f"    base = (bh * {splits} + s) * {rows}",
            "    w = tl.math.exp2(tl.load(in_ptr0 + (base + rm)) - mu_use)",
            "    l_i += tl.load(in_ptr1 + (base + rm)) * w",
            f"    acc += tl.load(in_ptr2 + ((base + rm[:, None]) * {dp} + rd[None, :])) * w[:, None]",
            "o = acc / l_i[:, None]",
            f"tl.store(out_ptr0 + ({spec.out.index('b', 'h', 'rm[:, None]', 'rd[None, :]')}), "
            f"o.to({TL_DTYPES[spec.dtype]}), (rm[:, None] < M) & (rd[None, :] < D))",
            f"tl.store(out_ptr1 + (bh * M + rm), (mu + tl.math.log2(l_i)) * {LN2!r}, rm < M)"]


def decode_templates(spec: AttentionSpec, splits: int, chunk: int) -> list:
    """[(name, source, numels)]: the split kernel (q, k, v [, mask] -> the splits' m, l, acc in
    float32 scratch) and the merge kernel (scratch -> out, lse)."""
    b, h, _, m, _, d = spec.dims
    ptr = PTR_TYPES[spec.dtype]
    numel_sig = {k: "i32" for k in ("bnumel", "mnumel", "nnumel", "dnumel", "sqnumel", "skvnumel")}
    split_sig = {"in_ptr0": ptr, "in_ptr1": ptr, "in_ptr2": ptr}
    if spec.mask is not None:
        split_sig["in_ptr3"] = PTR_TYPES[spec.mask_dtype]
    split_sig.update({"out_ptr0": "*fp32", "out_ptr1": "*fp32", "out_ptr2": "*fp32"})
    merge_sig = {"in_ptr0": "*fp32", "in_ptr1": "*fp32", "in_ptr2": "*fp32", "out_ptr0": ptr, "out_ptr1": "*fp32"}
    out = []
    for kind, body, sig, numels in (
            ("split", _decode_split_body(spec, splits, chunk), split_sig, [b * h, splits, chunk, d, 0, 0]),
            ("merge", _decode_merge_body(spec, splits), merge_sig, [b * h, 1, splits, d, 0, 0])):
        name = f"triton_tem_fused_attention_decode_{kind}"
        src = kernel_source(name, f"decode attention (§9.10), the keys split in {splits}, triples merged",
                            "attention_decode", numels, sig | numel_sig, ["BLOCK_N : tl.constexpr"], body, d)
        out.append((name, src, numels))
    return out


# ---- §9.10 The C++ template (BACKEND="CPP" and compiled CPU code): the same triple, a tile of query rows ----

_CPP_ROW = """
#ifndef STAX_ATTENTION_ROWS
#define STAX_ATTENTION_ROWS
typedef float stax_v8 __attribute__((vector_size(32)));     // 8 rows of a tile, in lanes (AVX: one register)
static inline stax_v8 stax_ld8(const float* p) {{ stax_v8 x; __builtin_memcpy(&x, p, sizeof x); return x; }}
static inline void stax_st8(float* p, stax_v8 x) {{ __builtin_memcpy(p, &x, sizeof x); }}
#endif
extern "C" void {name}(const float* q, const float* k, const float* v, const int32_t* nb,
                       const int32_t* ind, const int32_t* fnb, const int32_t* find, float* out, float* lse) {{
    // {what}: a tile of QT query rows of one (batch, head) keeps its triples (m, l, acc) while it
    // scans the keys in blocks of KB. Scores are kept transposed, sT[key][row], so that the rows
    // are the vector lanes of the QKᵀ dot (4 keys a step) and of the online update
    constexpr int64_t QT = 16, KB = {kblock};
    const int64_t tiles = ({m} + QT - 1) / QT;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t bh = 0; bh < {bh}; ++bh) {{
        for (int64_t t = 0; t < tiles; ++t) {{
            const int64_t b = bh / {h}, h = bh % {h}, hk = h / {groups};
            const int64_t i0 = t * QT, i1 = std::min<int64_t>({m}, i0 + QT), rows = i1 - i0;
            (void)b, (void)hk;
            const float* qt = q + ({q_base});
            const float* kh = k + ({k_base});
            const float* vh = v + ({v_base});
            alignas(64) float m_i[QT], l_i[QT], acc[QT][{d}], sT[KB][QT];
            stax_v8 qT[{d}][2];
            for (int64_t r = 0; r < QT; ++r) {{
                m_i[r] = -INFINITY;
                l_i[r] = 0.0f;
                for (int64_t c = 0; c < {d}; ++c) acc[r][c] = 0.0f;
                for (int64_t c = 0; c < {d}; ++c) qT[c][r / 8][r % 8] = r < rows ? qt[{q_elem}] : 0.0f;
            }}
            auto visit = [&](int64_t lo, int64_t hi, bool partial) {{
                (void)partial;
                for (int64_t j0 = lo; j0 < hi; j0 += KB) {{
                    const int64_t nk = std::min<int64_t>(hi - j0, KB);
                    int64_t jj = 0;
                    for (; jj + 4 <= nk; jj += 4) {{         // S = scale · q kᵀ, 4 keys a step
                        const float *k0 = kh + {k_row0}, *k1 = k0 + {ks}, *k2 = k1 + {ks}, *k3 = k2 + {ks};
                        stax_v8 s0 = {{}}, s1 = {{}}, s2 = {{}}, s3 = {{}}, t0 = {{}}, t1 = {{}}, t2 = {{}}, t3 = {{}};
                        for (int64_t c = 0; c < {d}; ++c) {{
                            const stax_v8 x = qT[c][0], y = qT[c][1];
                            const float a0 = k0[{k_col}], a1 = k1[{k_col}], a2 = k2[{k_col}], a3 = k3[{k_col}];
                            s0 += x * a0, s1 += x * a1, s2 += x * a2, s3 += x * a3;
                            t0 += y * a0, t1 += y * a1, t2 += y * a2, t3 += y * a3;
                        }}
                        stax_st8(sT[jj], s0 * {scale}f), stax_st8(sT[jj] + 8, t0 * {scale}f);
                        stax_st8(sT[jj + 1], s1 * {scale}f), stax_st8(sT[jj + 1] + 8, t1 * {scale}f);
                        stax_st8(sT[jj + 2], s2 * {scale}f), stax_st8(sT[jj + 2] + 8, t2 * {scale}f);
                        stax_st8(sT[jj + 3], s3 * {scale}f), stax_st8(sT[jj + 3] + 8, t3 * {scale}f);
                    }}
                    for (; jj < nk; ++jj) {{
                        const float* k0 = kh + {k_row0};
                        stax_v8 s0 = {{}}, t0 = {{}};
                        for (int64_t c = 0; c < {d}; ++c) s0 += qT[c][0] * k0[{k_col}], t0 += qT[c][1] * k0[{k_col}];
                        stax_st8(sT[jj], s0 * {scale}f), stax_st8(sT[jj] + 8, t0 * {scale}f);
                    }}
{mods}
                    // the online update, rows in lanes: rescale by e^(m_old - m_new), P = e^(S - m_new)
                    float mu[QT], alpha[QT];
                    stax_v8 mx = stax_ld8(m_i), my = stax_ld8(m_i + 8);      // (a NaN score never wins)
                    for (int64_t j = 0; j < nk; ++j) {{
                        const stax_v8 x = stax_ld8(sT[j]), y = stax_ld8(sT[j] + 8);
                        mx = x > mx ? x : mx, my = y > my ? y : my;
                    }}
                    stax_st8(mu, mx), stax_st8(mu + 8, my);
                    for (int64_t r = 0; r < QT; ++r) {{
                        const float m_new = mu[r];
                        mu[r] = m_new == -INFINITY ? 0.0f : m_new;    // nothing kept yet: e^(-inf) is 0
                        alpha[r] = stax_exp(m_i[r] - mu[r]);
                        m_i[r] = m_new;
                        l_i[r] *= alpha[r];
                    }}
                    for (int64_t j = 0; j < nk; ++j)
                        for (int64_t r = 0; r < QT; ++r) {{
                            sT[j][r] = stax_exp(sT[j][r] - mu[r]);
                            l_i[r] += sT[j][r];
                        }}
                    for (int64_t r = 0; r < rows; r += 2) {{    // acc += P v, two rows per V load
                        float* a0 = acc[r];
                        float* a1 = acc[r + 1];
                        for (int64_t c = 0; c < {d}; ++c) a0[c] *= alpha[r], a1[c] *= alpha[r + 1];
                        int64_t j = 0;
                        for (; j + 4 <= nk; j += 4) {{
                            const float *v0 = vh + {v_row0}, *v1 = v0 + {vs}, *v2 = v1 + {vs}, *v3 = v2 + {vs};
                            const float p0 = sT[j][r], p1 = sT[j + 1][r], p2 = sT[j + 2][r], p3 = sT[j + 3][r];
                            const float u0 = sT[j][r + 1], u1 = sT[j + 1][r + 1], u2 = sT[j + 2][r + 1],
                                        u3 = sT[j + 3][r + 1];
                            for (int64_t c = 0; c < {d}; ++c) {{
                                const float x0 = v0[{v_col}], x1 = v1[{v_col}], x2 = v2[{v_col}], x3 = v3[{v_col}];
                                a0[c] += p0 * x0 + p1 * x1 + p2 * x2 + p3 * x3;
                                a1[c] += u0 * x0 + u1 * x1 + u2 * x2 + u3 * x3;
                            }}
                        }}
                        for (; j < nk; ++j) {{
                            const float* v0 = vh + {v_row0};
                            const float p0 = sT[j][r], u0 = sT[j][r + 1];
                            for (int64_t c = 0; c < {d}; ++c) a0[c] += p0 * v0[{v_col}], a1[c] += u0 * v0[{v_col}];
                        }}
                    }}
                }}
            }};
{loops}
            for (int64_t r = 0; r < rows; ++r) {{
                float* oi = out + ({o_base}) + r * {o_row};
                for (int64_t c = 0; c < {d}; ++c) oi[{o_col}] = acc[r][c] / l_i[r];
                if (lse) lse[bh * {m} + i0 + r] = m_i[r] + std::log(l_i[r]);
            }}
        }}
    }}
}}
"""

_CPP_MODS = """                    for (int64_t jj = 0; jj < nk; ++jj) {{     // score_mod and the masks, per score
                        for (int64_t r = 0; r < QT; ++r) {{
                            const int64_t i = i0 + r, j = j0 + jj, q_idx = i, kv_idx = j;
                            (void)i, (void)j, (void)q_idx, (void)kv_idx;
                            float s = sT[jj][r];
{score_mod}
{mask}
                            sT[jj][r] = s;
                        }}
                    }}"""


def contiguous_operand(shape) -> Operand:
    """The Operand of a contiguous 4-D array of this shape."""
    shape, stride, acc = tuple(int(s) for s in shape), [], 1
    for s in reversed(shape):
        stride.insert(0, acc)
        acc *= max(s, 1)
    return Operand(shape, tuple(stride))


def _cpp_mul(var: str, stride: int) -> str:
    return "0" if stride == 0 else var if stride == 1 else f"{var} * {stride}"


def _cpp_base(x: Operand, b: str, h: str, row: str) -> str:
    """The offset of (b, h, row, 0) in a 4-D Operand, as C++ (size-1 dims broadcast)."""
    terms = [str(x.offset)] if x.offset else []
    terms += [_cpp_mul(var, st) for var, size, st in zip((b, h, row), x.shape[:3], x.stride[:3])
              if size != 1 and st != 0]
    return " + ".join(terms) or "0"


def _cpp_block(body, target: str, indent: str) -> str:
    """A mod's printed C++ lines in a scope of their own, its result assigned to `target`."""
    if body is None:
        return ""
    lines = [f"{indent}{{", *(f"{indent}    {x}" for x in body.lines),
             f"{indent}    {target} = {body.result};", f"{indent}}}"]
    return "\n".join(lines)


def _cpp_block_loops(spec: AttentionSpec) -> str:
    """Figure 9.3 on the CPU: the tile's Q block lists its partial blocks (mask_mod) and its full
    ones; `nb`, `ind`, `fnb`, `find` are read through the block mask's Operands."""
    bq, bkv, nb, ind = spec.sparse
    pre, out = "            ", []
    for cnt, idx, part in (("nb", "ind", "true"), ("fnb", "find", "false")):
        row = _cpp_base(nb, "b", "h", f"(i0 / {bq})")
        col = _cpp_base(ind, "b", "h", f"(i0 / {bq})") + " + " + _cpp_mul("u", ind.stride[3])
        out.append(f"{pre}for (int32_t u = 0; u < {cnt}[{row}]; ++u) {{\n"
                   f"{pre}    const int64_t j0 = (int64_t){idx}[{col}] * {bkv};\n"
                   f"{pre}    visit(j0, std::min<int64_t>({spec.dims[4]}, j0 + {bkv}), {part});\n{pre}}}")
    return "\n".join(out)


def cpp_template(spec: AttentionSpec, name: str = "stax_attention_cpu") -> tuple:
    """(C++ text, cffi declaration) of the CPU template for `spec` on float32 q, k, v of any strides
    (their Operands), the output through `spec.out`, the LSE [B·H·M] contiguous (NULL: not written).
    The mods are ModBody lines printed by the C++ printer; with `spec.sparse` the block mask's
    count and index arrays (int32) are read through its two Operands, else those pointers are unused."""
    b, h, hk, m, n, d = spec.dims
    ind = "    " * 7
    mask = ""  # (the per-score lines sit 7 levels deep in _CPP_MODS)
    if spec.is_causal:
        mask += f"{ind}if (j > i) s = -INFINITY;\n"
    if spec.mask_mod is not None:
        mask += f"{ind}if (partial) {{\n{ind}    bool keep = true;\n{_cpp_block(spec.mask_mod, 'keep', ind + '    ')}\n" \
                f"{ind}    if (!keep) s = -INFINITY;\n{ind}}}\n"
    score = ""
    if spec.score_mod is not None:
        score = f"{ind}{{\n{ind}    const float score = s;\n" \
                f"{_cpp_block(spec.score_mod, 's', ind + '    ')}\n{ind}}}"
    if spec.sparse:
        loops = _cpp_block_loops(spec)
    else:
        hi = f"std::min<int64_t>({n}, i1)" if spec.is_causal else str(n)
        loops = f"            visit(0, {hi}, true);"
    q, k, v, o = spec.q, spec.k, spec.v, spec.out
    mods = _CPP_MODS.format(score_mod=score, mask=mask.rstrip("\n")) if score or mask else ""
    text = _CPP_ROW.format(
        name=name, what=", ".join(dict.fromkeys(spec.origins)) or "attention", kblock=64, bh=b * h,
        m=m, d=d, h=h, groups=h // hk, scale=repr(float(spec.scale)), mods=mods, loops=loops,
        q_base=_cpp_base(q, "b", "h", "i0"), q_elem=f"{_cpp_mul('r', q.stride[2])} + {_cpp_mul('c', q.stride[3])}",
        k_base=_cpp_base(k, "b", "hk", "0"), k_row0=_cpp_mul("(j0 + jj)", k.stride[2]), ks=k.stride[2],
        k_col=_cpp_mul("c", k.stride[3]),
        v_base=_cpp_base(v, "b", "hk", "0"), v_row0=_cpp_mul("(j0 + j)", v.stride[2]), vs=v.stride[2],
        v_col=_cpp_mul("c", v.stride[3]),
        o_base=_cpp_base(o, "b", "h", "i0"), o_row=o.stride[2], o_col=_cpp_mul("c", o.stride[3]))
    cdef = (f"void {name}(const float* q, const float* k, const float* v, const int32_t* nb, const int32_t* ind, "
            "const int32_t* fnb, const int32_t* find, float* out, float* lse);")
    return "#include <algorithm>\n#include <cmath>\n" + text, cdef


# ---- §9.6 Launch configurations and the grid ----


def decode_configs() -> list:
    """The split-KV decode kernels: every query row in one block (a literal of the text), so only
    the key block is chosen; no BLOCK_M, so the grid is one program per split."""
    return [{"BLOCK_N": bn, "num_warps": w, "num_stages": st}
            for bn, w, st in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4), (32, 4, 3))]


# Float32 dots in IEEE precision (set_float32_matmul_precision("highest"), the default) run on the
# FMA units with their operand tiles in registers: at head dim 64 every configuration of the
# half-precision tables (attention_configs) spills on sm_90 (bench/attention_sm90.py: stack frames
# of 1.9-31 KB). These smaller tiles, built for sm_90 at head dim 64, have no stack: the forward's
# all five; dK/dV's 32 x 32 (8 warps), 64 x 16 (8 warps), 32 x 16, 16 x 32 (4 warps); dQ's 32 x 32,
# 64 x 16, 32 x 64, 16 x 32 (4 warps). The autotuner never picks a candidate that spills.
IEEE_FORWARD, IEEE_BACKWARD = 1, 2
IEEE_TABLES = {IEEE_FORWARD: ((64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 4, 2), (32, 64, 4, 2), (16, 32, 4, 2)),
               IEEE_BACKWARD: ((32, 32, 8, 2), (64, 16, 8, 2), (32, 16, 4, 2), (16, 32, 4, 2), (32, 32, 4, 2),
                               (64, 16, 4, 2), (32, 64, 4, 2))}


def attention_configs(numels: dict, kind: str = "attention") -> list:
    """Candidates (BLOCK_M, BLOCK_N, warps, stages), clamped to the sizes, BLOCK_M/BLOCK_N at most
    the block mask's blocks; the first is the default. Head dim 128 keeps BLOCK_N at 64 or less
    (the K and V tiles and the accumulator share the registers)."""
    if kind == "attention_decode":
        return decode_configs()
    m, n, d = (int(numels.get(f"{p}numel", 1)) for p in "mnd")
    sq, skv = int(numels.get("sqnumel", 0)), int(numels.get("skvnumel", 0))
    cap_m, cap_n = max(16, _next_pow2(m)), max(16, _next_pow2(n))
    if sq:
        cap_m, cap_n = min(cap_m, sq), min(cap_n, skv)
    wide = d > 64
    if numels.get("ieee"):                   # float32 IEEE dots: small tiles (see IEEE_TABLES)
        table = IEEE_TABLES[numels["ieee"]]
    elif wide:
        table = ((128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 2), (64, 32, 4, 3))
    else:
        table = ((128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3),
                 (128, 64, 8, 4))
    out = []
    for bm, bn, warps, stages in table:
        cfg = {"BLOCK_M": min(bm, cap_m), "BLOCK_N": min(bn, cap_n), "num_warps": warps,
               "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    return out


def attention_tuning_space(start: dict, numels: dict) -> dict:
    """Definition 9.2's Π for mode="max-autotune"; block sizes never pass the block mask's."""
    sq, skv = int(numels.get("sqnumel", 0)) or 128, int(numels.get("skvnumel", 0)) or 128
    if "BLOCK_M" not in start:               # the decode kernels: the key block only
        return {"BLOCK_N": [16, 32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]}
    space = {"BLOCK_M": [b for b in (16, 32, 64, 128) if b <= sq],
             "BLOCK_N": [b for b in (16, 32, 64, 128) if b <= skv],
             "num_warps": [2, 4, 8], "num_stages": [1, 2, 3, 4]}
    for name, value in start.items():
        if value not in space[name]:
            space[name] = sorted(space[name] + [value])
    return space


def attention_grid(numels: dict, cfg: dict) -> tuple:
    """One program per BLOCK_M query rows along program_id(0), one per (batch, head) along (1)."""
    return (-(-int(numels["mnumel"]) // cfg.get("BLOCK_M", 1)), int(numels["bnumel"]), 1)
