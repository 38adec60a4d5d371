"""§9.8 Convolution as a template: the implicit GEMM `triton_tem_fused_conv_N`.

Layer: back end (GPU), beside templates.py (it imports `autotune` for next_pow2, `template_tuning`
for the split-K bound, `templates` for the dtype spellings and the int32 limit, `triton_kernel` for
the target's SM count). codegen_triton.generate asks `conv_applies`
about each `conv2d` ExternKernel and prints `conv_template`'s text as one more kernel; the launcher
treats it as a "template" kernel (templates.template_configs, template_grid: the same M × N × K
block shapes, groups along program_id(1)).

A convolution is a matmul whose A operand is never stored (the "implicit GEMM"): per group g,
  M = N·OH·OW output pixels, N = C_out / groups output channels, K = C_in / groups · KH · KW taps,
  C[m, n] = Σ_k A[m, k] · B[k, n], A[m, k] = input[img, g·Cg + c, oh·sh - pad_t + kh·dh, ow·sw - pad_l + kw·dw]
and B[k, n] = weight[g·N + n, c, kh, kw]. The K loop turns each block of k into (c, kh, kw) and
each row into (img, oh, ow) by index arithmetic and loads A with a mask for the padding (tested
only on the sides that have padding). Two K loops:
  - taps × channel blocks (C / groups ≥ 16, the common case): each step is one tap (kh, kw) and
    BLOCK_K channels, so the window test is one per row and a channels-last input is read along
    its contiguous channels (Inductor's conv template has the same loop);
  - flat over C·KH·KW (few channels per group: a network's first layer, depthwise), in the
    input's memory order: (c, kh, kw) for NCHW, (kh, kw, c) when channels are innermost. The accumulator is float32
(`tl.dot`, IEEE for float32 operands); the bias is added in the epilogue before the one store.

Split-K (issue 14): where the chapter's 128 x 128 tiles leave SMs idle (ResNet-50's layer4 at batch
32: 52 tiles on 132 SMs) and K is long, the text takes SPLIT_K as a constexpr (`conv_split_max`).
Program (tile, split), split = program_id(2), sums its slice of the K loop's steps (PER from t_lo; SPLIT_K divides them),
stores its float32 partial tile into [SPLIT_K_MAX, groups, M, N] scratch, and arrives at its
tile's counter (`triton_helpers.last_arrival`, as §6.5's one-kernel split); the last to arrive
sums the SPLIT_K partials in split order 0..SPLIT_K-1 (deterministic) and runs the epilogue. One
launch. Whether and how far to split is not a rule (k >= 128·max(m, n) does not hold for a conv):
template_tuning's `_conv_splits` adds SPLIT_K 2, 3, 4 candidates and Alg. 9.1 measures them.

Consumes: a `conv2d` ExternKernel (inputs [x, weight(, bias)] as buffer names or strided views,
params stride / padding / dilation / groups) and the layouts of its operand buffers.
Produces: (kernel name, source, operand buffers, numels [groups, M, N, K], `ConvSplit` or None:
the split's scratch, which the wrapper allocates). Sizes and strides
are constants of the text (static shapes only; otherwise the host fallback runs).

Where to look:
  - `conv_applies` ............ which convolutions become a template
  - `_CONV_BODY` .............. the kernel text
  - `_TAP_LOOP`, `_FLAT_LOOP` . the two K loops; `uses_tap_loop` chooses
  - `_k_split` ................ the flat loop's k → (c, kh, kw) in the input's memory order
  - `_SPLIT_HEAD`, `_SPLIT_EPILOGUE`  split-K: the program's steps; partials, the last one combines
  - `conv_template` ........... the entry
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from .autotune import next_pow2
from .template_tuning import conv_split_max
from .templates import GROUPED_PIDS, INT32_LIMIT, TEMPLATE_DTYPES
from .triton_kernel import current_target

_PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}

# ---- The kernel text ----

_CONV_BODY = """\
M = {M}
N = {N}
K = {K}
# Prop. 9.4: programs numbered in groups of GROUP_M row blocks (rows: output pixels)
""" + GROUPED_PIDS + """\
g = tl.program_id(1){to64}
rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){to64}
rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)){to64}
# row -> (image, oh, ow); the input window of each output pixel starts at (ih0, iw0)
img = rm // {OHOW}
oh = (rm // {OW}) % {OH}
ow = rm % {OW}
ih0 = {ih0}
iw0 = {iw0}
x_row = {x_row}
co = g * N + rn
w_col = {w_col}
acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
{loop}{epilogue}"""

_EPILOGUE = """\
{bias}out_mask = (rm[:, None] < M) & (rn[None, :] < N)
tl.store(out_ptr0 + ({out_index}), acc.to({out_dtype}), out_mask)"""

# split-K (`SPLIT_K` > 1, a measured candidate): program (tile, split) sums its slice of the K loop's steps
_SPLIT_HEAD = """\
# §9.8 split-K: program_id(2) is this program's slice of the K loop's steps, PER of them from t_lo
# (SPLIT_K divides STEPS, so no step is masked, and SPLIT_K = 1 is the unsplit loop)
split = tl.program_id(2){to64} if SPLIT_K > 1 else 0
STEPS: tl.constexpr = {steps}
tl.static_assert(STEPS % SPLIT_K == 0, "SPLIT_K must divide the K loop's steps")
PER: tl.constexpr = STEPS // SPLIT_K
t_lo = split * PER
"""

_SPLIT_EPILOGUE = """\
out_mask = (rm[:, None] < M) & (rn[None, :] < N)
last = True
if SPLIT_K > 1:
    # §9.8 split-K in one launch: each split stores its float32 partial tile; the last of the tile's
    # SPLIT_K programs to arrive at its counter sums the partials in split order 0..SPLIT_K-1 (the
    # same result whatever order they arrived in) and runs the epilogue
    part = {part}
    tl.store(partials_ptr + (split * {gmn} + part), acc, out_mask)
    last = triton_helpers.last_arrival(counts_ptr + (g * grid_m * grid_n + pid), SPLIT_K)
    # (a fresh sum: this program's own partial is stored, so its registers are free for the sum)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if last:
        for z in tl.static_range(SPLIT_K):
            acc += tl.load(partials_ptr + (z * {gmn} + part), mask=out_mask, other=0.0)
if last:
{epilogue}"""


# K as one run of C·KH·KW (few channels per group: the first layer, depthwise)
_FLAT_LOOP = """\
{split}for k0 in range({k_range}, BLOCK_K):
    rk = k0 + tl.arange(0, BLOCK_K){to64}
{k_split}
    ih = ih0[:, None] + {kh_term}
    iw = iw0[:, None] + {kw_term}
    a_mask = (rm[:, None] < M) & (rk[None, :] < K){spatial}
    a = tl.load(in_ptr0 + (x_row[:, None] + {x_k}), mask=a_mask, other=0.0)
    b = tl.load(in_ptr1 + (w_col[None, :] + {w_k}), mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
    acc = tl.dot(a, b, acc{precision}, out_dtype=tl.float32)
"""

# K as taps × blocks of channels: one tap per step, so the window test is per row, not per element
_TAP_LOOP = """\
CB = (CG + BLOCK_K - 1) // BLOCK_K
{split}for t in range({t_range}):
    tap = t // CB
    rc = (t % CB) * BLOCK_K + tl.arange(0, BLOCK_K){to64}
    kh = tap // {KW}
    kw = tap % {KW}
    ih = ih0 + {kh_term}
    iw = iw0 + {kw_term}
    row_ok = (rm < M){spatial}
    a_row = x_row + {a_row}
    a = tl.load(in_ptr0 + (a_row[:, None] + {x_c}), mask=row_ok[:, None] & (rc[None, :] < CG), other=0.0)
    b = tl.load(in_ptr1 + (w_col[None, :] + {w_tap}{w_c}), mask=(rc[:, None] < CG) & (rn[None, :] < N), other=0.0)
    acc = tl.dot(a, b, acc{precision}, out_dtype=tl.float32)
"""

TAP_MIN_CHANNELS = 16     # tl.dot's smallest K block: fewer channels per group waste the tap form


def _spatial_mask(pad: tuple, size_h: int, size_w: int) -> str:
    """The window tests that padding makes necessary: without padding before (after) a side, the
    index never leaves the image on that side (conv_out_size bounds the last window)."""
    (pt, pb), (pl, pr) = pad
    terms = [t for t, need in (("(ih >= 0)", pt), (f"(ih < {size_h})", pb), ("(iw >= 0)", pl),
                               (f"(iw < {size_w})", pr)) if need]
    return "".join(" & " + t for t in terms)


def _mul(var: str, stride: int) -> list:
    """[var · stride] as printed terms (none for stride 0)."""
    return [] if stride == 0 else [var if stride == 1 else f"{var} * {stride}"]


def _sum(terms: list) -> str:
    return " + ".join(terms) or "0"


def _k_split(cg: int, kh: int, kw: int, channels_last: bool) -> list:
    """Lines turning the K positions rk into (c, kh, kw): c fastest for channels-last input,
    kw fastest otherwise. A size-1 part is the constant 0 (no division printed for it)."""
    if channels_last:
        parts = [("c", cg, 1), ("kw", kw, cg), ("kh", kh, cg * kw)]
    else:
        parts = [("kw", kw, 1), ("kh", kh, kw), ("c", cg, kh * kw)]
    total, lines = cg * kh * kw, []
    for name, size, inner in parts:
        if size == 1:
            lines.append(f"{name}_k = rk * 0")
            continue
        q = "rk" if inner == 1 else f"(rk // {inner})"
        lines.append(f"{name}_k = {q}" if inner * size == total else f"{name}_k = {q} % {size}")
    return ["    " + line for line in lines]


# ---- Operands and applicability ----


def _static(layout) -> bool:
    return all(sympy.sympify(v).is_Integer for v in (*layout.shape, *layout.stride, layout.offset))


def _operand(name_or_view, lowered) -> tuple:
    """(buffer name, dtype, layout) of an operand: a buffer, or a strided view of one."""
    if isinstance(name_or_view, str):
        buf = lowered.buffer(name_or_view)
        return buf.name, buf.dtype, buf.layout
    return name_or_view.buffer, lowered.buffer(name_or_view.buffer).dtype, name_or_view.layout


def _gemm_sizes(e, x_shape, w_shape) -> tuple:
    """(groups, M, N, K) of the implicit GEMM."""
    n, c_out, oh, ow = (int(s) for s in e.layout.shape)
    groups = e.params["groups"]
    return groups, n * oh * ow, c_out // groups, int(w_shape[1]) * int(w_shape[2]) * int(w_shape[3])


def conv_applies(e, lowered) -> bool:
    """A float conv2d with static sizes, a non-empty GEMM and at most 65535 groups is a template."""
    if e.op != "conv2d" or e.dtype.name not in TEMPLATE_DTYPES or not _static(e.layout):
        return False
    ops = [_operand(x, lowered) for x in e.inputs]
    if any(dtype is not e.dtype or not _static(layout) for _, dtype, layout in ops):
        return False
    groups, m, n, k = _gemm_sizes(e, ops[0][2].shape, ops[1][2].shape)
    return min(m, n, k) > 0 and groups <= 65535


def _is_big(layouts) -> bool:
    """Does any operand reach past int32 offsets? Then the index arithmetic is int64."""
    return any(int(x.offset) + sum((int(d) - 1) * abs(int(s)) for d, s in zip(x.shape, x.stride)) + 1
               >= INT32_LIMIT for x in layouts)


def uses_tap_loop(cg: int) -> bool:
    """The tap-major K loop when a group has enough channels to fill a K block, else the flat one."""
    return cg >= TAP_MIN_CHANNELS


def _loop(e, x, w, to64: str, split: bool) -> str:
    """The K loop: flat over C·KH·KW, or taps × channel blocks (`uses_tap_loop`); with `split`,
    over the program's slice of its steps only (`_SPLIT_HEAD`)."""
    (_, _, h, wd), (_, cg, kh, kw) = (tuple(int(s) for s in t.shape) for t in (x, w))
    sx, sw_ = ([int(s) for s in t.stride] for t in (x, w))
    dh, dw = e.params["dilation"]
    spatial = _spatial_mask(e.params["padding"], h, wd)
    precision = ', input_precision="ieee"' if e.dtype.name == "float32" else ""
    if uses_tap_loop(cg):
        head = _SPLIT_HEAD.format(to64=to64, steps=f"{kh * kw} * (({cg} + BLOCK_K - 1) // BLOCK_K)") if split else ""
        text = f"CG = {cg}\n" + _TAP_LOOP.format(
            taps=kh * kw, KW=kw, to64=to64, spatial=spatial, precision=precision, split=head,
            t_range="t_lo, t_lo + PER" if split else f"0, {kh * kw} * CB",
            kh_term=_mul("kh", dh)[0], kw_term=_mul("kw", dw)[0],
            a_row=_sum(_mul("ih", sx[2]) + _mul("iw", sx[3])), x_c=_sum(_mul("rc[None, :]", sx[1])),
            w_tap="".join(t + " + " for t in _mul("kh", sw_[2]) + _mul("kw", sw_[3])),
            w_c=_sum(_mul("rc[:, None]", sw_[1])))
        return text
    return _FLAT_LOOP.format(
        to64=to64, spatial=spatial, precision=precision,
        split=_SPLIT_HEAD.format(to64=to64, steps=f"({int(w.shape[1]) * kh * kw} + BLOCK_K - 1) // BLOCK_K") if split else "",
        k_range="t_lo * BLOCK_K, (t_lo + PER) * BLOCK_K" if split else "0, K",
        k_split="\n".join(_k_split(cg, kh, kw, sx[1] == 1 and cg > 1)),
        kh_term=_mul("kh_k[None, :]", dh)[0], kw_term=_mul("kw_k[None, :]", dw)[0],
        x_k=_sum(_mul("c_k[None, :]", sx[1]) + _mul("ih", sx[2]) + _mul("iw", sx[3])),
        w_k=_sum(_mul("c_k[:, None]", sw_[1]) + _mul("kh_k[:, None]", sw_[2]) + _mul("kw_k[:, None]", sw_[3])))


def _body(e, x, w, bias, big: bool, split: bool) -> str:
    """The kernel body: the sizes, strides and parameters of this convolution filled in."""
    cg = int(w.shape[1])
    _, c_out, oh, ow = (int(s) for s in e.layout.shape)
    groups, m, n, k = _gemm_sizes(e, x.shape, w.shape)
    sx, sw_, so = ([int(s) for s in t.stride] for t in (x, w, e.layout))
    (sh, sw), ((pt, _), (pl, _)) = e.params["stride"], e.params["padding"]
    to64 = ".to(tl.int64)" if big else ""
    bias_lines = ""
    if bias is not None:
        b_index = _sum(([str(int(bias.offset))] if int(bias.offset) else []) + _mul("co", int(bias.stride[0])))
        bias_lines = (f"# epilogue: the bias, added to the float32 accumulator\n"
                      f"bias = tl.load(in_ptr2 + ({b_index}), mask=rn < N, other=0.0).to(tl.float32)\n"
                      f"acc = acc + bias[None, :]\n")
    epilogue = _EPILOGUE.format(
        bias=bias_lines, out_dtype=TEMPLATE_DTYPES[e.dtype.name],
        out_index=_sum(_mul("img[:, None]", so[0]) + _mul("co[None, :]", so[1])
                       + _mul("oh[:, None]", so[2]) + _mul("ow[:, None]", so[3])))
    if split:        # partials [SPLIT_K, groups, M, N], float32
        epilogue = _SPLIT_EPILOGUE.format(
            part=_sum(_mul("g", m * n) + _mul("rm[:, None]", n) + ["rn[None, :]"]), gmn=groups * m * n,
            epilogue="\n".join("    " + line for line in epilogue.split("\n") if "out_mask =" not in line))
    return _CONV_BODY.format(
        M=m, N=n, K=k, OHOW=oh * ow, OW=ow, OH=oh, to64=to64,
        ih0=_sum(_mul("oh", sh)) + (f" - {pt}" if pt else ""), iw0=_sum(_mul("ow", sw)) + (f" - {pl}" if pl else ""),
        x_row=_sum(([str(int(x.offset))] if int(x.offset) else []) + _mul("img", sx[0]) + _mul("g", cg * sx[1])),
        w_col=_sum(([str(int(w.offset))] if int(w.offset) else []) + _mul("co", sw_[0])),
        loop=_loop(e, x, w, to64, split), epilogue=epilogue)


# ---- The entry ----


@dataclass
class ConvSplit:
    """A split-capable conv's scratch: float32 partials [SPLIT_K_MAX, groups, M, N] (allocated per
    call) and one int32 counter per output tile of the smallest block (zeroed once, kept: each
    launch leaves them 0, `triton_helpers.last_arrival`)."""
    partials: str
    partials_numel: int
    counts: str
    counts_numel: int


def conv_template(index: int, e, lowered) -> tuple:
    """(kernel name, kernel source, the buffers its launch passes, its numels [groups, M, N, K],
    the split's scratch or None); K is the extent the K loop blocks: C/groups·KH·KW (flat loop)
    or C/groups (tap loop). Where 128 x 128 tiles leave SMs idle (`conv_split_max`), the text
    takes SPLIT_K as a constexpr and Alg. 9.1 measures split candidates beside the unsplit ones."""
    ops = [_operand(v, lowered) for v in e.inputs]
    layouts = [layout for _, _, layout in ops]
    groups, m, n, k = _gemm_sizes(e, layouts[0].shape, layouts[1].shape)
    sm_count = current_target().sm_count
    most = conv_split_max(m, n, k, groups, sm_count)
    big = _is_big(layouts + [e.layout]) or most * groups * m * n >= INT32_LIMIT
    bias = layouts[2] if len(layouts) > 2 else None
    body = _body(e, layouts[0], layouts[1], bias, big, most > 1)
    cg, taps = int(layouts[1].shape[1]), int(layouts[1].shape[2]) * int(layouts[1].shape[3])
    tap_loop = uses_tap_loop(cg)
    k = cg if tap_loop else k      # the blocked K extent: BLOCK_K candidates fit it
    name = f"triton_tem_fused_conv_{index}"
    ptr, numel_type = _PTR[e.dtype.name], "i64" if big else "i32"
    signature = {f"in_ptr{i}": ptr for i in range(len(ops))}
    signature["out_ptr0"] = ptr
    if most > 1:
        signature.update({"partials_ptr": "*fp32", "counts_ptr": "*i32"})
    signature.update({"bnumel": numel_type, "mnumel": numel_type, "nnumel": numel_type, "knumel": numel_type})
    hints = {"b": next_pow2(groups), "m": next_pow2(m), "n": next_pow2(n), "k": next_pow2(k)}
    consts = ["BLOCK_M : tl.constexpr", "BLOCK_N : tl.constexpr", "BLOCK_K : tl.constexpr",
              "GROUP_M : tl.constexpr"] + (["SPLIT_K : tl.constexpr"] if most > 1 else [])
    # (the element size sizes the shared-memory check: bf16's 128 x 256 tiles fit where float32's do not)
    facts = {"conv": 1, **({"itemsize": e.dtype.itemsize} if e.dtype.itemsize != 4 else {})}
    if most > 1:
        facts.update({"SPLIT_K_MAX": most, "K_TAPS": taps if tap_loop else 1, "SM_COUNT": sm_count})
    meta = f", meta={facts!r}"
    params = e.params
    src = (f"# {name}: computes {', '.join(dict.fromkeys(e.origins))} (conv2d stride={params['stride']}, "
           f"padding={params['padding']}, dilation={params['dilation']}, groups={params['groups']}) "
           f"as an implicit GEMM" + (f", split-K up to {most} (measured)" if most > 1 else "") + "\n"
           f"@triton_heuristics.template(size_hints={hints!r}, signature={signature!r}{meta})\n"
           f"@triton.jit\n"
           f"def {name}({', '.join(list(signature) + consts)}):\n"
           + "\n".join("    " + line if line else line for line in body.split("\n")) + "\n")
    split = None
    if most > 1:     # a counter per tile of the smallest block any configuration takes (16 x 16)
        split = ConvSplit(f"{e.name}_partials", most * groups * m * n, f"conv_counts_{index}",
                          groups * -(-m // 16) * -(-n // 16))
    return name, src, [name_ for name_, _, _ in ops], [groups, m, n, k], split
