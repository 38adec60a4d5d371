"""§9.8 Matmul templates: the plain `tl.dot` kernel, with grouped numbering (Prop. 9.4).

Layer: back end (GPU), beside the kernel writers: imports only `autotune` (next_pow2). The
generator (codegen_triton.py) prints its text; the launcher (triton_heuristics.py) takes its
candidate configurations, grid and max-autotune space from here.

A matmul does not go through the loop IR: lowering leaves it as an `ExternKernel` (§6.1). On the
GPU, `codegen_triton.generate` asks this module whether the matmul can run as a Triton template
instead of the host fallback; if so, it prints the template as one more kernel of the module.

Consumes: an `ExternKernel` for `matmul` (two operands of rank ≥ 2 with equal batch shapes, as
`stax.matmul` hands them over) and the layouts of its operand buffers.
Produces: the kernel text `triton_tem_fused_mm_N`, decorated `@triton_heuristics.template(...)`,
and the arguments of its launch. Sizes and strides are constants of the text (static shapes).

This is the "correct first" template: masked loads, a float32 accumulator, no epilogue fusion,
no split-K, no TMA. float32 operands multiply in IEEE float32 (`input_precision="ieee"`, like
PyTorch's default "highest" matmul precision); float16/bfloat16 go through the tensor cores.

Where to look:
  - `template_applies` ......... which matmuls become a template (else the host fallback runs)
  - `_MM_BODY` ................. the kernel text, the chapter's GROUP_M lines included
  - `template_configs`, `template_grid`  candidate configurations and the grid (§9.6, Def. 9.1)
  - `mm_template` .............. the entry: (name, source, launch arguments)
"""
from __future__ import annotations

import math

import sympy

from .autotune import next_pow2

TEMPLATE_DTYPES = {"float32": "tl.float32", "float16": "tl.float16", "bfloat16": "tl.bfloat16"}
GROUP_M = 8                   # Prop. 9.4: near the optimum 2·√W for W ≈ one program per SM
INT32_LIMIT = 2 ** 31


# ---- §9.6 Launch configurations and the grid ----


def template_configs(numels: dict) -> list:
    """The candidate set: block shapes around the chapter's 128×128×32, clamped to the sizes.

    The first is the heuristic default (what runs unmeasured, e.g. in Triton's interpreter)."""
    m, n, k = (int(numels.get(f"{p}numel", 1)) for p in "mnk")
    cap_m, cap_n, cap_k = (max(16, next_pow2(v)) for v in (m, n, k))
    out = []
    for bm, bn, bk, warps, stages in ((64, 64, 32, 4, 3), (128, 128, 32, 8, 3), (128, 64, 32, 4, 4),
                                      (64, 128, 32, 4, 4), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4),
                                      (32, 32, 32, 4, 2), (16, 64, 64, 4, 3)):
        cfg = {"BLOCK_M": min(bm, cap_m), "BLOCK_N": min(bn, cap_n), "BLOCK_K": min(bk, cap_k),
               "GROUP_M": GROUP_M, "num_warps": warps, "num_stages": stages}
        if cfg not in out:
            out.append(cfg)
    return out


def template_tuning_space(start: dict) -> dict:
    """Definition 9.2's Π for mode="max-autotune" (GROUP_M stays the chapter's 8)."""
    space = {"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [16, 32, 64, 128, 256],
             "BLOCK_K": [16, 32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [2, 3, 4, 5],
             "GROUP_M": [GROUP_M]}
    for name, value in start.items():
        if value not in space[name]:
            space[name] = sorted(space[name] + [value])
    return space


def template_grid(numels: dict, cfg: dict) -> tuple:
    """One program per BLOCK_M × BLOCK_N output block along program_id(0), batches along (1)."""
    def cdiv(a, b):
        return -(-int(a) // b)
    return (cdiv(numels["mnumel"], cfg["BLOCK_M"]) * cdiv(numels["nnumel"], cfg["BLOCK_N"]),
            int(numels["bnumel"]), 1)


# ---- The kernel text ----

_MM_BODY = """\
M = {M}
N = {N}
K = {K}
# Prop. 9.4: programs numbered in groups of GROUP_M row blocks, so that the programs running at
# one time share the row blocks of A and the column blocks of B in L2
pid = tl.program_id(0)
grid_m = (M + BLOCK_M - 1) // BLOCK_M
grid_n = (N + BLOCK_N - 1) // BLOCK_N
width = GROUP_M * grid_n
group_id = pid // width
group_size = min(grid_m - group_id * GROUP_M, GROUP_M)
pid_m = group_id * GROUP_M + (pid % group_size)
pid_n = (pid % width) // group_size
bid = tl.program_id(1){to64}
rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){to64}
rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)){to64}
rk = tl.arange(0, BLOCK_K){to64}
A = in_ptr0 + ({a_index})
B = in_ptr1 + ({b_index})
acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
for k in range(0, K, BLOCK_K):
    a = tl.load(A, mask=(rm[:, None] < M) & (rk[None, :] < K - k), other=0.0)
    b = tl.load(B, mask=(rk[:, None] < K - k) & (rn[None, :] < N), other=0.0)
    acc = tl.dot(a, b, acc{precision}, out_dtype=tl.float32)
    A += {a_step}
    B += {b_step}
C = out_ptr0 + ({c_index})
tl.store(C, acc.to({out_dtype}), (rm[:, None] < M) & (rn[None, :] < N))"""


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


def _batch_offset(batch: tuple, strides: tuple) -> list:
    """The offset terms of batch `bid` (the batch dims flattened, last fastest) in one operand."""
    terms, inner = [], 1
    for size, stride in reversed(list(zip(batch, strides))):
        if size != 1 and stride != 0:
            idx = "bid" if inner == 1 else f"(bid // {inner})"
            idx = idx if inner * size == math.prod(batch) else f"({idx} % {size})"
            terms += _term(idx, stride)
        inner *= size
    return terms[::-1]


def _static(layout) -> bool:
    return all(sympy.sympify(v).is_Integer for v in (*layout.shape, *layout.stride))


def _operand(name_or_view, lowered) -> tuple:
    """(buffer name, dtype, layout) of a matmul operand: a buffer, or a strided view of one."""
    if isinstance(name_or_view, str):
        buf = lowered.buffer(name_or_view)
        return buf.name, buf.dtype, buf.layout
    return name_or_view.buffer, lowered.buffer(name_or_view.buffer).dtype, name_or_view.layout


def template_applies(e, lowered) -> bool:
    """A float matmul with static sizes and at most 65535 batches runs as a template."""
    if e.op != "matmul" or e.dtype.name not in TEMPLATE_DTYPES or not _static(e.layout):
        return False
    for _, dtype, layout in (_operand(x, lowered) for x in e.inputs):
        if not _static(layout) or not sympy.sympify(layout.offset).is_Integer or dtype is not e.dtype:
            return False
    return math.prod(int(s) for s in e.layout.shape[:-2]) <= 65535


def mm_template(index: int, e, lowered) -> tuple:
    """(kernel name, kernel source, the buffers and sizes its launch passes)."""
    (a_name, _, a), (b_name, _, b) = (_operand(x, lowered) for x in e.inputs)
    shape = tuple(int(s) for s in e.layout.shape)
    (m, n), k, batch = shape[-2:], int(a.shape[-1]), shape[:-2]
    sa, sb, sc = ([int(s) for s in x.stride] for x in (a, b, e.layout))
    big = any(int(x.offset) + sum((int(d) - 1) * abs(int(st)) for d, st in zip(x.shape, x.stride)) + 1
              >= INT32_LIMIT for x in (a, b, e.layout))
    body = _MM_BODY.format(
        M=m, N=n, K=k, to64=".to(tl.int64)" if big else "",
        a_index=_index(batch, sa, "rm[:, None]", "rk[None, :]", int(a.offset)),
        b_index=_index(batch, sb, "rk[:, None]", "rn[None, :]", int(b.offset)),
        c_index=_index(batch, sc, "rm[:, None]", "rn[None, :]", 0),
        a_step=" * ".join(_term("BLOCK_K", sa[-1])) or "0", b_step=" * ".join(_term("BLOCK_K", sb[-2])) or "0",
        precision=', input_precision="ieee"' if e.dtype.name == "float32" else "",
        out_dtype=TEMPLATE_DTYPES[e.dtype.name])
    name = f"triton_tem_fused_mm_{index}"
    ptr = "*" + {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[e.dtype.name]
    numel_type = "i64" if big else "i32"
    signature = {"in_ptr0": ptr, "in_ptr1": ptr, "out_ptr0": ptr, "bnumel": numel_type,
                 "mnumel": numel_type, "nnumel": numel_type, "knumel": numel_type}
    hints = {"b": next_pow2(math.prod(batch)), "m": next_pow2(m), "n": next_pow2(n),
             "k": next_pow2(k)}
    consts = ["BLOCK_M : tl.constexpr", "BLOCK_N : tl.constexpr", "BLOCK_K : tl.constexpr",
              "GROUP_M : tl.constexpr"]
    src = (f"# {name}: computes {', '.join(dict.fromkeys(e.origins))}\n"
           f"@triton_heuristics.template(size_hints={hints!r}, signature={signature!r})\n"
           f"@triton.jit\n"
           f"def {name}({', '.join(list(signature) + consts)}):\n"
           + "\n".join("    " + line if line else line for line in body.split("\n")) + "\n")
    return name, src, [a_name, b_name], [math.prod(batch), m, n, k]
