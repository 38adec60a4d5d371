"""§6 Lowering scans: cumsum, cumprod, logcumsumexp, cummax, cummin as an `ir.Scan` over any dim.

Layer: middle, under lower.py (which calls `lower_scan` for the op_table entries of kind "scan")
and above ir.py (`Scan`, `compute_dtype`). It consumes the lowering Value of the scanned tensor
(anything with `shape`, `dtype`, `loader`, `buffer`, `origins`) and produces an `ir.Scan` buffer
plus the loader its readers use; lower.py wraps that in a Value.

The Scan's body is the input's loader, so pointwise producers are inlined into it (a fused
prologue: `cumsum(x * 2)` reads x once); pointwise consumers of the result join its kernel in
schedule.py when they read it at the element being computed (a fused epilogue). The running value
is kept in the accumulation dtype: int64 for integer and bool inputs of sums and products
(PyTorch's rule, which the node's dtype already holds; cummax/cummin keep the input's), float32 for half types (§6.2), the input's float dtype otherwise.

  - a scan over a dim of size 1 (or of an empty tensor) is its input, converted: a pointwise value;
  - otherwise `Scan(ranges = the other dims, reduction_ranges = [n], dim)` over the output's
    contiguous layout (ir.Scan.full_index names an element).

Where to look: `lower_scan`; the kernels: codegen_cpp `_scan_kernel`, triton_scan.py.
"""
from __future__ import annotations

import sympy

from .ir import Layout, Scan, compute_dtype, contiguous_strides, ops

# ---- §6 A scan node ----


def _as(v, src_dtype, acc):
    return ops.to_dtype(v, acc) if compute_dtype(src_dtype) != acc else v


def lower_scan(node, src, new_name, emit):
    """(loader of the result, its cost, the Scan buffer's name or None) of scan `node` over `src`."""
    shape, out_dtype = tuple(node.meta.shape), node.meta.dtype
    acc = compute_dtype(out_dtype)
    if not shape:
        return (lambda idx: _as(src.loader(idx), src.dtype, acc)), 1 + src.cost, None
    dim = node.params["dim"]
    n = shape[dim]
    if n == 1 or any(s == 0 for s in shape):
        return (lambda idx: _as(src.loader(idx), src.dtype, acc)), 1 + src.cost, None
    kept = [k for k in range(len(shape)) if k != dim]
    layout = Layout(shape, contiguous_strides(shape), sympy.Integer(0))

    def inner_fn(index, rindex):
        full = [None] * len(shape)
        for k, i in zip(kept, index):
            full[k] = i
        full[dim] = rindex[0]
        return _as(src.loader(full), src.dtype, acc)

    name = new_name()
    origins = (src.origins if src.buffer is None else []) + [node.name]
    emit(Scan(name, out_dtype, [shape[k] for k in kept], [n], node.op, inner_fn, acc, layout, origins,
              dim=dim))

    def loader(idx):
        v = ops.load(name, layout.index(idx))
        return ops.to_dtype(v, acc) if acc != out_dtype else v
    return loader, 0, name
