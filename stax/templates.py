"""§9.8 Matmul templates: the `tl.dot` kernel, grouped numbering (Prop. 9.4), epilogue fusion, split-K.

Layer: back end (GPU), beside the kernel forms: imports the kernel writer (`triton_kernel`: the
printer, the kernel state) and the launch-time facts of templates (`template_tuning`: GROUP_M,
split-K, precision), and `cublas` (can cuBLASLt run this GEMM, with which epilogue).
codegen_triton.py prints its text; triton_heuristics.py takes its
configurations from template_tuning.py, never from here (a warm start needs no printer).

A matmul does not go through the loop IR: lowering leaves it as an `ExternKernel` (§6.1). On the
GPU, `template_applies` says whether it runs as a Triton template instead of the host fallback; the
schedule then opens a 'template' group for it, which the pointwise nodes after it may join (the
§9.8 rule: no reduction, no in-place update of an input, each reads the template's result exactly
at the element it computes). They are printed after the accumulation, before `tl.store`.

Consumes a schedule's 'template' group (the matmul `ExternKernel`, then its epilogue nodes) and the
layouts of the operand buffers (read in place: `w.t()` and slices are strides and an offset).
Produces the kernel text `triton_tem_fused_mm_N` (decorated `@triton_heuristics.template(...)`),
beside it the persistent TMA form `triton_persistent_tma_mm_N` where TMA can read the operands;
with split-K (k ≥ 128·max(m, n)) instead a partials kernel and a second kernel that sums the s
partials in a fixed order and runs the epilogue; and the arguments of each launch. Sizes and strides are constants of the text (static shapes).

float32 operands multiply as `set_float32_matmul_precision` says ("highest": IEEE, like PyTorch's
default; "high"/"medium": TF32); float16/bfloat16 go through the tensor cores; the accumulator
(ACC_TYPE) is float32 always. float8 operands (`stax._scaled_mm`, torch's spelling: e4m3fn or e5m2,
b column-major) go into tl.dot as they are (sm_89+), the sums float32, the scales applied first in
the epilogue (`_scale_lines`).

The epilogue hook (for every template; attention's score_mod is the same mechanism):
    k = TemplateKernel(index, group, sched, shape="[BLOCK_M, BLOCK_N]")
    lines = fuse_epilogue(k, nodes, dims, {buffer: Var})
  `nodes` are pointwise IR nodes over the group's loop ranges; `dims[i]` is the Triton text of the
  block of indices of loop dim i (size-1 dims dropped, as `schedule.loop_ranges`), e.g.
  `rm[:, None]`; the dict holds values already in registers, read by `ops.load` of that buffer
  (the template's result). The lines define x0, x1, ... from `dims`, print each node's `inner_fn`
  with the kernel's `TritonPrinter`, and store each node that leaves the kernel under `xmask`,
  which the template defines (the valid elements of its block). Buffers are `@name@` until
  `finish_template` renames them to in_ptrN / out_ptrN.

Where to look:
  - `template_applies` ......... which matmuls become a template (else the host fallback runs)
  - `TemplateKernel`, `fuse_epilogue`  the epilogue hook above
  - `_MM_BODY` ................. the kernel text, the chapter's GROUP_M lines included
  - `_split_k_sum` ............. split-K's second kernel: Σ of the partials, then the epilogue
  - `_persistent_tma_kernel` ... `triton_persistent_tma_mm` (Hopper): one program per SM, TMA
                                 descriptors; measured against the grouped template (multi_kernel)
  - `mm_template` .............. the entry: the launches (`TemplateLaunch`), scratch buffers
  - `_scaled_mm_applies`, `_scale_lines`  float8 `_scaled_mm`: fp8 operands, the scales' epilogue
  - `mm_extern` ................ cuBLASLt's branch (cublas.py), when installed: its fused epilogue,
                                 or the epilogue as a kernel after it (`_split_k_sum` with s = 1)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from . import cublas
from .autotune import next_pow2
from .dtypes import float32
from .ir import index_vars
from .printer import Var
from .template_tuning import input_precision, split_k_factor
from .schedule import store_index
from .triton_kernel import TritonKernel, TritonPrinter, current_target, pointer_type, texpr
from .wrapper import scalars_in

TEMPLATE_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}
INT32_LIMIT = 2 ** 31
PERSISTENT_MIN_TILES = 1      # × SMs: 128 × 128 output tiles below which the persistent template
                              # cannot pay for its own measuring (every SM busy once at least)


@dataclass
class TemplateLaunch:
    """One kernel of a template group: its name, text, buffers passed and trailing numels."""
    name: str
    source: str
    params: list
    numels: list
    alternative: object = None       # a TemplateLaunch that competes with this one (Alg. 9.1)


# ---- §9.8 The epilogue hook: pointwise nodes printed inside a template ----


class TemplateKernel(TritonKernel):
    """A TritonKernel whose block is the template's (e.g. [BLOCK_M, BLOCK_N]) and whose every
    access is masked by the template's `xmask`; the loop variables are x0, x1, ... ."""

    def __init__(self, name_index, group, sched, shape: str):
        super().__init__(name_index, group, sched)
        self.shape = shape
        self.axes = [None] * (shape.count(",") + 1)   # only their number: [1, 1] constants
        self.always_true = set()
        self.scratch = {}                             # buffers of the template's own: name -> dtype
        self.partial_block = False                    # some block axis is not a loop dim (size 1)

    def dtype_of(self, name):
        return self.scratch[name] if name in self.scratch else super().dtype_of(name)

    def block_shape(self) -> str:
        return self.shape

    def row_shape(self) -> str:
        return self.shape

    def mask_for(self, expr, extra=()) -> str:
        return " & ".join((["xmask"] if expr.free_symbols else []) + list(extra))

    def store(self, node, value, xvars, rvars) -> str:
        """Every store covers the whole block: an offset that misses a block axis (a size-1 M or
        N: dropped from the loops) is broadcast to it, as the value is."""
        expr = self.final(store_index(node, xvars, rvars))
        ptr = self.arg(self.target.get(node.name, node.name))
        offset = texpr(expr)
        if not expr.free_symbols:
            offset = f"tl.full({self.shape}, {offset}, {'tl.int64' if self.index64 else 'tl.int32'})"
        elif self.partial_block:
            offset = f"tl.broadcast_to({offset}, {self.shape})"
        return f"tl.store({ptr} + ({offset}), {value}, xmask)"


def fuse_epilogue(k: TemplateKernel, nodes: list, dims: list, values: dict) -> list:
    """The epilogue's lines (see the module docstring): x0.. = dims, the nodes' bodies, stores
    (a value in `values` that is a node of the group is stored too, when it leaves the kernel)."""
    xvars = index_vars("x", len(dims))
    k.ranges = dict(zip(xvars, k.group.ranges))
    k.locals.update(values)
    p = TritonPrinter(k)
    own = {n.name: n for n in k.group.nodes}
    stores = [k.store(own[name], value, xvars, []) for name, value in values.items()
              if name in own and name not in k.sched.kernel_local]
    for node in nodes:
        value = k.body(node, xvars, [], p)
        k.locals[node.name] = value
        if node.name not in k.sched.kernel_local:
            stores.append(k.store(node, value, xvars, []))
    return [f"{v} = {d}" for v, d in zip(xvars, dims)] + p.lines + stores


def finish_template(k: TemplateKernel, name: str, body: list, signature: dict, consts: list,
                    decorator: str) -> tuple:
    """Rename `@buf@` to in_ptrN / out_ptrN (reads first, in order), print the kernel; returns
    (source, the buffers in parameter order)."""
    ins = [n for n in k.reads if n not in k.writes]
    outs = list(k.writes)
    rename = {**{n: f"in_ptr{i}" for i, n in enumerate(ins)}, **{n: f"out_ptr{i}" for i, n in enumerate(outs)}}
    text = "\n".join(body)
    for n, pname in rename.items():
        text = text.replace(f"@{n}@", pname)
    sig = {rename[n]: pointer_type(k.dtype_of(n)) for n in ins + outs}
    floats = scalars_in(k.lowered, text)           # §10.4: run-time floats an epilogue reads
    sig.update({f: "fp64" for f in floats})
    sig.update(signature)
    origins = ", ".join(dict.fromkeys(k.group.origins))
    src = (f"# {name}: computes {origins}\n"
           f"@triton_heuristics.{decorator[:-1]}, signature={sig!r})\n"
           f"@triton.jit\n"
           f"def {name}({', '.join(list(sig) + consts)}):\n"
           + "\n".join("    " + line if line else line for line in text.split("\n")) + "\n")
    return src, ins + outs + floats


# ---- The kernel text ----

# Prop. 9.4's numbering of the programs (pid -> pid_m, pid_n), shared with conv_template's kernel
GROUPED_PIDS = """\
pid = tl.program_id(0)
grid_m = (M + BLOCK_M - 1) // BLOCK_M
grid_n = (N + BLOCK_N - 1) // BLOCK_N
width = GROUP_M * grid_n
group_id = pid // width
group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
pid_m = group_id * GROUP_M + (pid % group_size)
pid_n = (pid % width) // group_size
"""

_MM_BODY = """\
M = {M}
N = {N}
K = {K}
# Prop. 9.4: programs numbered in groups of GROUP_M row blocks, so that the programs running at
# one time share the row blocks of A and the column blocks of B in L2
""" + GROUPED_PIDS + """\
bid = tl.program_id(1){to64}
rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){to64}
rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)){to64}
rk = {rk}{to64}
A = {a_ptr} + ({a_index})
B = {b_ptr} + ({b_index})
acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
for k in range(0, K, {k_step}):
    a = tl.load(A, mask=(rm[:, None] < M) & (rk[None, :] < K - k), other=0.0)
    b = tl.load(B, mask=(rk[:, None] < K - k) & (rn[None, :] < N), other=0.0)
    acc = tl.dot(a, b, acc{precision}, out_dtype=tl.float32)
    A += {a_step}
    B += {b_step}
xmask = (rm[:, None] < M) & (rn[None, :] < N)"""


def _term(var: str, stride: int) -> list:
    return [] if stride == 0 else [var if stride == 1 else f"{var} * {stride}"]


def _index(batch: tuple, strides: list, rows: str, cols: str, offset: int) -> str:
    """One operand's offsets: where its view starts, its batch term, rows × stride + cols × stride."""
    nb = len(batch)
    terms = ([str(offset)] if offset else []) + _batch_offset(batch, strides[:nb])
    block = _term(rows, strides[-2]) + _term(cols, strides[-1])
    if not block:            # both strides 0 (a 1 × 1 view): still a block of pointers, for the mask
        block = [f"{rows} * 0 + {cols} * 0"]
    return " + ".join(terms + block)


def _batch_index(batch: tuple, j: int, flat: str = "bid") -> str:
    """Batch dim j's index from the flattened batch number (last dim fastest)."""
    inner = math.prod(batch[j + 1:])
    idx = flat if inner == 1 else f"({flat} // {inner})"
    return idx if inner * batch[j] == math.prod(batch) else f"({idx} % {batch[j]})"


def _batch_offset(batch: tuple, strides: tuple) -> list:
    """The offset terms of batch `bid` (the batch dims flattened, last fastest) in one operand."""
    return [t for j, (size, stride) in enumerate(zip(batch, strides)) if size != 1
            for t in _term(_batch_index(batch, j), stride)]


def _static(layout) -> bool:
    return all(sympy.sympify(v).is_Integer for v in (*layout.shape, *layout.stride))


def _operand(name_or_view, lowered) -> tuple:
    """(buffer name, dtype, layout) of a matmul operand: a buffer, or a strided view of one."""
    if isinstance(name_or_view, str):
        buf = lowered.buffer(name_or_view)
        return buf.name, buf.dtype, buf.layout
    return name_or_view.buffer, lowered.buffer(name_or_view.buffer).dtype, name_or_view.layout


FLOAT8_OPERANDS = ("float8_e4m3fn", "float8_e5m2")


def _scaled_mm_applies(e, lowered) -> bool:
    """stax._scaled_mm (float8 operands, float32 scales, 2-D) with static layouts, on a GPU whose
    tensor cores multiply float8 (sm_89+; elsewhere the eager product runs, on the host)."""
    ops = [_operand(x, lowered) for x in e.inputs]
    return (current_target().cc >= 89 and all(_static(lay) and sympy.sympify(lay.offset).is_Integer for _, _, lay in ops)
            and all(d.name in FLOAT8_OPERANDS for _, d, _ in ops[:2])
            and all(d is float32 for _, d, _ in ops[2:]) and len(e.layout.shape) == 2)


def template_applies(e, lowered) -> bool:
    """A float matmul with static sizes and at most 65535 batches runs as a template, and so does
    a float8 `_scaled_mm` (§9.8: fp8 operands into tl.dot, float32 sums, the scales in the epilogue)."""
    if e.op not in ("matmul", "scaled_mm") or e.dtype.name not in TEMPLATE_DTYPES or not _static(e.layout):
        return False
    if e.op == "scaled_mm":
        return _scaled_mm_applies(e, lowered)
    for _, dtype, layout in (_operand(x, lowered) for x in e.inputs):
        if not _static(layout) or not sympy.sympify(layout.offset).is_Integer or dtype is not e.dtype:
            return False
    return math.prod(int(s) for s in e.layout.shape[:-2]) <= 65535


# ---- §9.8 Precision: TF32 wants K-major operands ----

TF32_COPY_MIN_FLOPS = 2 * 512 ** 3     # below this a copy's launch costs more than it saves


def tf32_operand_strides(node, position: int, layout):
    """lowering's `operand_strides` hook for the GPU: under TF32 (`set_float32_matmul_precision
    ("high")`), Hopper's tensor cores take float32 operands only K-major (A's rows, B's columns
    contiguous); with a row-major B Triton's tl.dot runs about 4x slower (87 against 324 TFLOP/s
    at 4096³ on the H200, bench/RESULTS.md). Such an operand is copied K-major first (one
    transposing pointwise kernel, a few percent of the GEMM); returns its strides, or None to read
    the operand in place (bf16/fp16, IEEE float32, K-major already, small or broadcast operands)."""
    if node.op != "matmul" or node.meta.dtype.name != "float32" or input_precision() != "tf32":
        return None
    shape, stride = layout.shape, layout.stride
    if len(shape) < 2 or not _static(layout) or any(int(st) == 0 for st in stride):
        return None
    k_dim = len(shape) - 1 if position == 0 else len(shape) - 2
    if int(stride[k_dim]) == 1 or int(shape[k_dim]) == 1:
        return None
    if 2 * math.prod(int(d) for d in node.meta.shape) * int(shape[k_dim]) < TF32_COPY_MIN_FLOPS:
        return None
    order = list(range(len(shape) - 2)) + ([len(shape) - 2, len(shape) - 1] if position == 0
                                            else [len(shape) - 1, len(shape) - 2])
    strides, step = [0] * len(shape), 1
    for d in reversed(order):               # innermost last in `order`: K, then the other matrix dim
        strides[d], step = step, step * int(shape[d])
    return tuple(strides)


def _needs_64(*layouts) -> bool:
    return any(int(x.offset) + sum((int(d) - 1) * abs(int(st)) for d, st in zip(x.shape, x.stride)) + 1
               >= INT32_LIMIT for x in layouts)


def _output_dims(shape: tuple, rows: str, cols: str, flat_batch: str = "bid") -> list:
    """The index block of each kept (size ≠ 1) dim of the output, for the epilogue hook."""
    batch = shape[:-2]
    dims = [_batch_index(batch, j, flat_batch) for j in range(len(batch))] + [rows, cols]
    return [d for d, s in zip(dims, shape) if s != 1]


# ---- §9.8 The template and its split-K partner ----


def _mm_kernel(index: int, group, sched, split: int) -> tuple:
    """The tl.dot kernel: its epilogue fused when split == 1, else it stores float32 partials."""
    low, e = sched.lowered, group.nodes[0]
    (a_name, a_dtype, a), (b_name, _, b) = (_operand(x, low) for x in e.inputs[:2])
    shape = tuple(int(s) for s in e.layout.shape)
    (m, n), kk, batch = shape[-2:], int(a.shape[-1]), shape[:-2]
    sa, sb = ([int(s) for s in x.stride] for x in (a, b))
    k = TemplateKernel(index, group, sched, "[BLOCK_M, BLOCK_N]")
    k.index64 = big = _needs_64(a, b, e.layout) or split * math.prod(shape) >= INT32_LIMIT
    a_ptr, b_ptr = k.arg(a_name, read=True), k.arg(b_name, read=True)
    steps = "BLOCK_K" if split == 1 else "BLOCK_K * SPLIT_K"
    body = _MM_BODY.format(
        M=m, N=n, K=kk, to64=".to(tl.int64)" if big else "", a_ptr=a_ptr, b_ptr=b_ptr,
        rk="tl.arange(0, BLOCK_K)" if split == 1 else "(tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K))",
        a_index=_index(batch, sa, "rm[:, None]", "rk[None, :]", int(a.offset)),
        b_index=_index(batch, sb, "rk[:, None]", "rn[None, :]", int(b.offset)), k_step=steps,
        a_step=" * ".join(_term(steps, sa[-1])) or "0", b_step=" * ".join(_term(steps, sb[-2])) or "0",
        precision=f', input_precision="{input_precision()}"' if a_dtype.name == "float32" else "")
    if split == 1:
        acc = Var("acc", e.dtype) if e.dtype.name == "float32" else Var(f"acc.to({TEMPLATE_DTYPES[e.dtype.name]})", e.dtype)
        dims = _output_dims(shape, "rm[:, None]", "rn[None, :]")
        k.partial_block = m == 1 or n == 1
        scales = _scale_lines(k, e, low) if e.op == "scaled_mm" else []
        epilogue = scales + fuse_epilogue(k, group.nodes[1:], dims, {e.name: acc})
    else:     # partials [SPLIT_K, batch, M, N] in float32; the second kernel sums them
        k.writes[f"{e.name}_partials"] = True
        k.scratch[f"{e.name}_partials"] = float32
        epilogue = [f"tl.store(@{e.name}_partials@ + (tl.program_id(2) * {math.prod(shape)} + "
                    f"{_index(batch, [n * m * math.prod(batch[j + 1:]) for j in range(len(batch))] + [n, 1], 'rm[:, None]', 'rn[None, :]', 0)}), acc, xmask)"]
    name = f"triton_tem_fused_mm_{index}"
    numel_type = "i64" if big else "i32"
    hints = {"b": next_pow2(math.prod(batch)), "m": next_pow2(m), "n": next_pow2(n), "k": next_pow2(kk)}
    meta = {"itemsize": a_dtype.itemsize, "tuning_key": _tuning_key(e, a, b, split)}
    if split > 1:
        meta["SPLIT_K"] = split
    consts = [f"{c} : tl.constexpr" for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
              + (("SPLIT_K",) if split > 1 else ())]
    src, params = finish_template(
        k, name, body.split("\n") + epilogue,
        {v: numel_type for v in ("bnumel", "mnumel", "nnumel", "knumel")}, consts,
        f"template(size_hints={hints!r}, meta={meta!r})")
    return TemplateLaunch(name, src, params, [math.prod(batch), m, n, kk])


def _scale_lines(k: TemplateKernel, e, low) -> list:
    """§9.8 _scaled_mm's scales, applied to the float32 sums before anything else of the epilogue:
    one number each (tensor-wise), or a's per row and b's per column (row-wise)."""
    (sa_name, _, sa), (sb_name, _, sb) = (_operand(x, low) for x in e.inputs[2:])
    pa, pb = k.arg(sa_name, read=True), k.arg(sb_name, read=True)
    if math.prod(int(d) for d in sa.shape) == 1:
        return [f"acc = acc * tl.load({pa} + {int(sa.offset)}) * tl.load({pb} + {int(sb.offset)})"]
    ia = " + ".join([str(int(sa.offset))] + _term("rm[:, None]", int(sa.stride[0])))
    ib = " + ".join([str(int(sb.offset))] + _term("rn[None, :]", int(sb.stride[1])))
    return [f"acc = acc * tl.load({pa} + ({ia}), mask=rm[:, None] < M, other=0.0)"
            f" * tl.load({pb} + ({ib}), mask=rn[None, :] < N, other=0.0)"]


def _tuning_key(e, a, b, split: int) -> str:
    """What decides the best blocks of a GEMM: sizes, operand layouts, dtype, precision, split."""
    if e.op == "scaled_mm":
        return (f"scaled_mm {e.dtype.name} out={tuple(e.layout.shape)} a={tuple(a.stride)}+{a.offset} "
                f"b={tuple(b.stride)}+{b.offset} k={a.shape[-1]}")
    return (f"mm {e.dtype.name} out={tuple(e.layout.shape)} a={tuple(a.stride)}+{a.offset} "
            f"b={tuple(b.stride)}+{b.offset} k={a.shape[-1]} split={split} {input_precision()}")


_SUM_HEAD = """\
xnumel = {numel}
xoffset = tl.program_id(0){to64} * XBLOCK
xindex = xoffset + tl.arange(0, XBLOCK)
xmask = xindex < xnumel
# §9.8 split-K: the {split} partial products, summed in a fixed order (deterministic)
acc = tl.load(@{partials}@ + (xindex), xmask)"""


def _split_k_sum(index: int, group, sched, split: int, source: str = "partials") -> TemplateLaunch:
    """Σ over the s partials of [s, batch, M, N], then the group's epilogue (after the sum).
    split == 1: the epilogue alone, after an extern product (`{mm}_acc`, float32, from cuBLASLt)."""
    e = group.nodes[0]
    shape = tuple(int(s) for s in e.layout.shape)
    numel = math.prod(shape)
    k = TemplateKernel(index, group, sched, "[XBLOCK]")
    k.index64 = big = split * numel >= INT32_LIMIT or k.index64
    partials = f"{e.name}_{source}"
    k.reads[partials] = True
    k.scratch[partials] = float32
    lines = _SUM_HEAD.format(numel=numel, to64=".to(tl.int64)" if big else "", split=split,
                             partials=partials).split("\n")
    if split == 1:
        lines[-2] = "# §9.8 the epilogue of the product cuBLASLt wrote (float32), as a kernel of its own"
    lines += [f"for z in range(1, {split}):",
              f"    acc += tl.load(@{partials}@ + (z * {numel} + xindex), xmask)"] if split > 1 else []
    batch, (m, n) = shape[:-2], shape[-2:]
    dims = _output_dims(shape, f"((xindex // {n}) % {m})" if batch else f"(xindex // {n})", f"(xindex % {n})",
                        flat_batch=f"(xindex // {m * n})")
    acc = Var("acc", e.dtype) if e.dtype.name == "float32" else Var(f"acc.to({TEMPLATE_DTYPES[e.dtype.name]})", e.dtype)
    lines += fuse_epilogue(k, group.nodes[1:], dims, {e.name: acc})
    name = f"triton_poi_fused_{index}"
    src, params = finish_template(k, name, lines, {"xnumel": "i64" if big else "i32"},
                                  ["XBLOCK : tl.constexpr"],
                                  f"pointwise(size_hints={{'x': {next_pow2(numel)}}})")
    return TemplateLaunch(name, src, params, [numel])


# ---- §9.8 The persistent TMA template (Hopper) ----

_PERSISTENT_BODY = """\
M = {M}
N = {N}
K = {K}
# §9.8 persistent TMA: one program per SM loops over the output tiles, numbered in groups of
# GROUP_M row blocks (Prop. 9.4); the operands arrive through tensor descriptors (Hopper's TMA),
# which fill the blocks past M, N and K with zeros
grid_m = (M + BLOCK_M - 1) // BLOCK_M
grid_n = (N + BLOCK_N - 1) // BLOCK_N
width = GROUP_M * grid_n
A_desc = {a_desc}
B_desc = {b_desc}
for tile in tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS):
    group_id = tile // width
    group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
    pid_m = group_id * GROUP_M + (tile % group_size)
    pid_n = (tile % width) // group_size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = {a_load}
        b = {b_load}
        acc = tl.dot(a, b, acc{precision}, out_dtype=tl.float32)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    xmask = (rm[:, None] < M) & (rn[None, :] < N)"""


def _descriptor(ptr: str, layout, size: int, rows: int, cols: int, block: tuple, at: tuple) -> tuple | None:
    """(descriptor, load offsets, ".T" or "") of one [rows, cols] operand read through TMA: row-major as it is, a
    column-major one (`w.t()`) as its [cols, rows] transpose loaded and `.T`-ed; None when TMA
    cannot read it (no unit stride, or a start or row stride not a multiple of 16 bytes)."""
    st, off = [int(x) for x in layout.stride[-2:]], int(layout.offset)
    base = f"{ptr} + {off}" if off else ptr
    if (off * size) % 16:
        return None
    if st[1] == 1 and (st[0] * size) % 16 == 0 and st[0] >= cols:
        return (f"tl.make_tensor_descriptor({base}, shape=[{rows}, {cols}], strides=[{st[0]}, 1], "
                f"block_shape=[{block[0]}, {block[1]}])", "[{}, {}]".format(*at), "")
    if st[0] == 1 and (st[1] * size) % 16 == 0 and st[1] >= rows:
        return (f"tl.make_tensor_descriptor({base}, shape=[{cols}, {rows}], strides=[{st[1]}, 1], "
                f"block_shape=[{block[1]}, {block[0]}])", "[{}, {}]".format(*at[::-1]), ".T")
    return None


def _persistent_tma_kernel(index: int, group, sched) -> TemplateLaunch | None:
    """`triton_persistent_tma_mm`: the same product and epilogue, one program per SM (None when
    an operand cannot be read through TMA, or there are batches)."""
    low, e = sched.lowered, group.nodes[0]
    (a_name, _, a), (b_name, _, b) = (_operand(x, low) for x in e.inputs)
    shape = tuple(int(s) for s in e.layout.shape)
    (m, n), kk = shape[-2:], int(a.shape[-1])
    target = current_target()
    if (math.prod(shape[:-2]) != 1 or _needs_64(a, b, e.layout) or target.cc < 90
            or math.ceil(m / 128) * math.ceil(n / 128) < PERSISTENT_MIN_TILES * target.sm_count):
        return None
    k = TemplateKernel(index, group, sched, "[BLOCK_M, BLOCK_N]")
    a_ptr, b_ptr = k.arg(a_name, read=True), k.arg(b_name, read=True)
    size = e.dtype.itemsize
    ad = _descriptor(a_ptr, a, size, m, kk, ("BLOCK_M", "BLOCK_K"), ("pid_m * BLOCK_M", "k"))
    bd = _descriptor(b_ptr, b, size, kk, n, ("BLOCK_K", "BLOCK_N"), ("k", "pid_n * BLOCK_N"))
    if ad is None or bd is None:
        return None
    body = _PERSISTENT_BODY.format(
        M=m, N=n, K=kk, a_desc=ad[0], b_desc=bd[0], a_load=f"A_desc.load({ad[1]}){ad[2]}",
        b_load=f"B_desc.load({bd[1]}){bd[2]}",
        precision=f', input_precision="{input_precision()}"' if e.dtype.name == "float32" else "")
    acc = Var("acc", e.dtype) if e.dtype.name == "float32" else Var(f"acc.to({TEMPLATE_DTYPES[e.dtype.name]})", e.dtype)
    k.partial_block = m == 1 or n == 1
    epilogue = fuse_epilogue(k, group.nodes[1:], _output_dims(shape, "rm[:, None]", "rn[None, :]"), {e.name: acc})
    name = f"triton_persistent_tma_mm_{index}"
    hints = {"b": 1, "m": next_pow2(m), "n": next_pow2(n), "k": next_pow2(kk)}
    meta = {"itemsize": size, "tuning_key": _tuning_key(e, a, b, 1) + " persistent",
            "NUM_SMS": current_target().sm_count, "tma": True}
    consts = [f"{c} : tl.constexpr" for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_SMS")]
    src, params = finish_template(
        k, name, body.split("\n") + ["    " + line for line in epilogue],
        {v: "i32" for v in ("bnumel", "mnumel", "nnumel", "knumel")}, consts,
        f"template(size_hints={hints!r}, meta={meta!r})")
    return TemplateLaunch(name, src, params, [1, m, n, kk])


def mm_template(index: int, group, sched) -> tuple:
    """A template group's launches, in order, and its scratch buffers ({name: (numel, dtype)}):
    one kernel with the epilogue fused, or under split-K the partials' kernel and their sum."""
    e = group.nodes[0]
    a = _operand(e.inputs[0], sched.lowered)[2]
    shape = tuple(int(s) for s in e.layout.shape)
    (m, n), kk = shape[-2:], int(a.shape[-1])
    split = split_k_factor(m, n, kk, math.prod(shape[:-2]), current_target().sm_count)
    if e.op == "scaled_mm":       # float8: the grouped template alone (no split-K, no TMA form)
        return [_mm_kernel(index, group, sched, 1)], {}
    if split == 1:
        plain = _mm_kernel(index, group, sched, 1)
        plain.alternative = _persistent_tma_kernel(index, group, sched)
        return [plain], {}
    return ([_mm_kernel(index, group, sched, split), _split_k_sum(index + 1, group, sched, split)],
            {f"{e.name}_partials": (split * math.prod(shape), float32)})


# ---- §9.8 The extern candidate: cuBLASLt (cublas.py), when installed ----


@dataclass
class ExternMM:
    """cuBLASLt's branch of a template group: `extern_kernels.mm(a, b, out=..., ...)` writing the
    group's result with a fused epilogue, or float32 into `{mm}_acc` (scratch) followed by the
    epilogue as a Stax kernel (`kernel`)."""
    a: object                        # buffer name or ReinterpretView (read in place)
    b: object
    out: str
    bias: str | None
    epilogue: str
    compute: str
    key: str                         # what decides the winner: the GEMM's tuning key and the epilogue
    scratch: dict                    # {name: (numel, dtype)}
    kernel: TemplateLaunch | None = None


def _plain_operand(x, low) -> cublas.MatrixLayout:
    _, dtype, layout = _operand(x, low)
    return cublas.MatrixLayout(tuple(int(v) for v in layout.shape), tuple(int(v) for v in layout.stride), dtype.name)


def _fused_epilogue(group, sched) -> tuple | None:
    """(epilogue, bias, output node) when cuBLASLt can compute the whole group itself: no epilogue,
    or one node that is relu / gelu(tanh) of the product, with or without a bias along N."""
    e, nodes, low = group.nodes[0], group.nodes[1:], sched.lowered
    if not nodes:
        return "none", None, e
    node = nodes[0]
    if (len(nodes) != 1 or e.name not in sched.kernel_local or node.name in sched.kernel_local
            or type(node).__name__ != "Pointwise" or node.dtype is not e.dtype
            or tuple(node.layout.shape) != tuple(e.layout.shape)
            or tuple(node.layout.stride) != tuple(e.layout.stride) or node.layout.offset != 0):
        return None
    match = cublas.epilogue_of(node, e.name, e.layout, e.dtype.name, lambda n: low.buffer(n).dtype.name)
    return None if match is None else (match[0], match[1], node)


def mm_extern(index: int, group, sched) -> ExternMM | None:
    """cuBLASLt's branch for a template group, or None: the library is not installed, or it
    cannot read these layouts (cublas.plan_matmul says why). `index` names the epilogue kernel."""
    e, low = group.nodes[0], sched.lowered
    if e.op != "matmul" or not cublas.available():
        return None
    a, b = (_plain_operand(x, low) for x in e.inputs)
    shape = tuple(int(s) for s in e.layout.shape)
    fused, compute = _fused_epilogue(group, sched), input_precision()
    a_lay, b_lay = (_operand(x, low)[2] for x in e.inputs)
    key = _tuning_key(e, a_lay, b_lay, 1) + f" epilogue={fused[0] if fused else 'kernel'}"
    try:
        if fused is not None:
            kind, bias, node = fused
            out = cublas.MatrixLayout(shape, tuple(int(s) for s in node.layout.stride), e.dtype.name)
            cublas.plan_matmul(a, b, out, compute, kind, None if bias is None else e.dtype.name)
            return ExternMM(e.inputs[0], e.inputs[1], node.name, bias, kind, compute, key, {})
        acc = f"{e.name}_acc"
        strides = tuple(int(s) for s in e.layout.stride)
        cublas.plan_matmul(a, b, cublas.MatrixLayout(shape, strides, "float32"), compute)
    except cublas.CublasError:
        return None
    kernel = _split_k_sum(index, group, sched, 1, source="acc")
    return ExternMM(e.inputs[0], e.inputs[1], acc, None, "none", compute, key,
                    {acc: (math.prod(shape), float32)}, kernel)
