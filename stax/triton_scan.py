"""§9.4 Scan kernels for the GPU: cumsum, cumprod, logcumsumexp, cummax, cummin as `tl.associative_scan`.

Layer: back end (GPU), beside triton_reduction.py and above the kernel writer (`triton_kernel`'s
`TritonKernel`, `TritonPrinter`, `setup_axes` / `axis_lines` / `var_lines`); codegen_triton.py calls
it for a schedule group of kind 'scan' (an ir.Scan, then its per-element epilogues).

Consumes a scan group; produces the kernel body's lines, the form and the ReductionHint, which
`triton_kernel.finish` prints as a whole kernel. The block is a reduction's [XBLOCK, R0_BLOCK]:
rows are the other dims (merged, Prop. 6.3), the r0_ axis is the scanned dim, so the launch takes
the reduction kinds' configurations (`persistent_reduction` / `reduction` in triton_heuristics).

  - persistent ('per'), when the dim fits one block (up to PERSISTENT_LIMIT): the row is scanned
    in registers with `triton_helpers.cumsum(v, 1)` (an associative_scan with the op's combine);
  - looped ('red'), otherwise: R0_BLOCK at a time, each block scanned and combined with the running
    value of the blocks before it (`carry`, one per row); the combine is associative, so
    carry ⊕ scan(block) is the prefix. The new carry is the block's last valid column.

The tree order of associative_scan differs from eager's left-to-right fold, so float sums match
eager to rounding (the C++ kernel matches bit for bit). Half types are scanned in float32 (§6.2).

Where to look: `SCAN_FN`, `_scan_form`, `scan_kernel`.
"""
from __future__ import annotations

from .autotune import next_pow2
from .ir import Scan, scan_identity, upper_bound
from .triton_kernel import TritonKernel, TritonPrinter, axis_lines, literal, numel_lines, setup_axes, tl_dtype, var_lines

# ---- §9.4 Scan kernels ----

PERSISTENT_LIMIT = 1024          # a row of up to this many elements is scanned in registers

# the block scan along dim 1 of [XBLOCK, R0_BLOCK], and the combine of a carry with it
SCAN_FN = {op: f"triton_helpers.{op}({{v}}, 1)" for op in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin")}
_CARRY = {"cumsum": "({a} + {v})", "cumprod": "({a} * {v})", "logcumsumexp": "triton_helpers.logaddexp({a}, {v})",
          "cummax": "triton_helpers.maximum({a}, {v})", "cummin": "triton_helpers.minimum({a}, {v})"}


def _scan_form(k) -> tuple:
    """('per', R0_BLOCK) when the scanned dim fits one block, else ('red', None); §10.3: a symbolic
    length is decided against its range's upper end."""
    n = k.raxis.numel
    hi = int(n) if n.is_Integer else upper_bound(n, k.sched.lowered.bounds)
    return ("per", next_pow2(hi)) if hi is not None and hi <= PERSISTENT_LIMIT else ("red", None)


def _scan_step(k, scan, value, p, carry):
    """The scan of this block's values (and, looped, the carry folded in): the running value."""
    b = p.emit(f"tl.broadcast_to({value}, [XBLOCK, R0_BLOCK])", value.dtype)
    s = p.emit(SCAN_FN[scan.reduction_type].format(v=b), scan.src_dtype)
    if carry is None:
        return s
    s = p.emit(_CARRY[scan.reduction_type].format(a=carry, v=s), scan.src_dtype)
    last = "(r0_index == r0_offset + R0_BLOCK - 1) | (r0_index == r0_numel - 1)"
    p.lines.append(f"{carry} = tl.sum(tl.where({last}, {s}, 0), 1)[:, None].to({tl_dtype(scan.src_dtype)})")
    return s


def _scan_nodes(k, xvars, rvars, p, carry) -> None:
    """The group's nodes in order: the Scan's running value, then the epilogues that read it."""
    for n in k.group.nodes:
        value = k.body(n, xvars, rvars, p)
        if isinstance(n, Scan):
            value = _scan_step(k, n, value, p, carry)
            half = n.dtype != n.src_dtype and n.dtype.is_floating_point and n.dtype.itemsize == 2
            k.locals[n.name] = p.to_dtype(value, n.dtype) if half else value   # rounded as stored
        else:
            k.locals[n.name] = value
        if n.name not in k.sched.kernel_local:
            p.lines.append(k.store(n, value, xvars, rvars))


def scan_kernel(k: TritonKernel) -> tuple:
    """A scan group's kernel body: (form 'per' | 'red', lines, ReductionHint)."""
    g = k.group
    k.reduction = True                      # the [XBLOCK, R0_BLOCK] block of a reduction
    xvars, rvars = setup_axes(k, g.ranges, g.reduction_ranges)
    form, r0_block = _scan_form(k)
    if form == "per" and k.raxis.numel.is_Integer and int(k.raxis.numel) == r0_block:
        k.always_true = {"r0_mask"}
    xaxis, raxis = k.axes[0], k.axes[1]
    head = numel_lines([xaxis, raxis])
    if form == "per":
        head.append(f"R0_BLOCK: tl.constexpr = {r0_block}")
    head += ["rnumel = r0_numel", "RBLOCK: tl.constexpr = R0_BLOCK"] + axis_lines(k, xaxis, 0)
    p = TritonPrinter(k)
    scan = g.nodes[0]
    if form == "per":
        head += axis_lines(k, raxis, None, per_block=r0_block) + var_lines(raxis) + var_lines(xaxis)
        _scan_nodes(k, xvars, rvars, p, None)
        return form, head + p.lines, "INNER"
    base = "tl.arange(0, R0_BLOCK)[None, :]" + (".to(tl.int64)" if k.index64 else "")
    head += [f"r0_base = {base}", "rbase = r0_base"] + var_lines(xaxis)
    carry = f"_{k.new_tmp()}"
    ident = literal(scan_identity(scan.reduction_type, scan.src_dtype), scan.src_dtype)
    head.append(f"{carry} = tl.full([XBLOCK, 1], {ident}, {tl_dtype(scan.src_dtype)})")
    _scan_nodes(k, xvars, rvars, p, carry)
    loop = ["for r0_offset in tl.range(0, r0_numel, R0_BLOCK):"]
    loop += ["    " + line for line in axis_lines(k, raxis, None, looped=True) + var_lines(raxis) + p.lines]
    return form, head + loop, "INNER"
