"""§6 Lowering indirect indexing: gathers and scatters through loaded integer indices.

Layer: middle, under lower.py (which calls it for the `index` and `index_put` nodes that
stax/indexing.py records) and above ir.py (`ops.indirect_indexing`, `Scatter`) and op_table.py
(the error message). It consumes lowering Values (anything with `shape` and `loader`, an index
-> ops value) and produces loaders and index functions; lower.py wraps them in Values and buffers.

  - A gather `out[rest[:pos], b, rest[pos:]] = x[..., ind_k(b) at dims[k], ...]` is a loader: it
    loads each index tensor at b, turns the value into an index symbol with
    `ops.indirect_indexing` (negatives wrapped, bounds checked) and loads x there, so it fuses
    into its consumers like any pointwise value (`x[idx] * w`, an embedding and its layer_norm).
  - An index tensor that is an `arange` over its own dims (gather's and scatter's other dims,
    `x[arange(n), t]`) stays a plain loop index when §6.8's bounds keep it inside the dim: no load,
    no check.
  - A scatter writes through the same index function (`ir.Scatter.output_indexer`). When it
    updates a graph input in place (`table.index_add_(0, idx, rows)`) and nothing else reads that
    input, `scatter_in_place` lets it write into the input itself, skipping the copy and the
    write-back (two passes over the whole tensor).

Where to look:
  - arange indices as loop indices ........ `_direct_index`
  - the index into x of an output index ... `index_position_fn`
  - the gather loader ..................... `gather_loader`
  - scatters into an input, in place ...... `scatter_in_place`
"""
from __future__ import annotations

import sympy

from .ir import (ExternKernel, LoadCollector, Pointwise, ReinterpretView, Reduction, Scatter,
                 index_bounds, index_vars, ops, set_handler)
from .op_table import TARGET_INDEX_OPS, index_message

# ---- §6 Index tensors at a broadcast index ----


def _broadcast(v, out_shape):
    """v's loader at an index of `out_shape` (v broadcast to it, as lower._broadcast_loader)."""
    lead = len(out_shape) - len(v.shape)

    def loader(idx):
        return v.loader([sympy.Integer(0) if (v.shape[k] == 1 and out_shape[k + lead] != 1)
                         else idx[k + lead] for k in range(len(v.shape))])
    return loader


class _NotDirect(Exception):
    pass


class _IndexExprProbe:
    """ops handler: is an index tensor's body only `index_expr` (an arange, maybe cast)?"""

    def index_expr(self, expr, dtype):
        expr = sympy.sympify(expr)
        if any(not s.is_integer for s in expr.free_symbols):   # a run-time float argument (§10.4)
            raise _NotDirect("index_expr")
        return expr

    def to_dtype(self, x, dtype):
        return x

    def __getattr__(self, name):
        raise _NotDirect(name)


def _direct_index(v, shape, size):
    """An arange index tensor needs no load and no check when §6.8's bounds put it inside
    [0, size): its index expression as a function of the broadcast index, else None."""
    bv = index_vars("b", len(shape))
    try:
        with set_handler(_IndexExprProbe()):
            e = _broadcast(v, shape)(bv)
    except _NotDirect:
        return None
    if not isinstance(e, sympy.Expr):
        return None
    lo, hi = index_bounds(e, dict(zip(bv, shape)))
    if not ((lo >= 0) == sympy.true and (hi < size) == sympy.true):
        return None
    return lambda b: e.subs(dict(zip(bv, b)), simultaneous=True)


def _checked_index(v, shape, size, message, wrap_neg=True):
    load = _broadcast(v, shape)
    return lambda b: ops.indirect_indexing(load(b), size, True, wrap_neg, message)


def broadcast_shape(indices) -> tuple:
    """The shape the index tensors broadcast to (stax/indexing.py checked that they do)."""
    nd = max((len(v.shape) for v in indices), default=0)
    out = [sympy.Integer(1)] * nd
    for v in indices:
        for k, s in enumerate(v.shape):
            if s != 1:
                out[nd - len(v.shape) + k] = s
    return tuple(out)


# ---- §6 The index into x of an output (gather) or update (scatter) index ----


def index_position_fn(node, x_shape, indices):
    """idx (an index of the `index` node's output, or of the values an `index_put` writes) ->
    x's full index: the index symbols at the indexed dims, the other dims of idx elsewhere."""
    dims, pos, op = node.params["dims"], node.params["pos"], node.params["op"]
    bshape = broadcast_shape(indices)
    nb = len(bshape)
    wrap = op not in TARGET_INDEX_OPS          # a negative class target is an error, not wrapped
    fns = [_direct_index(v, bshape, x_shape[d]) or _checked_index(v, bshape, x_shape[d], index_message(op, d), wrap)
           for v, d in zip(indices, dims)]

    def position(idx):
        b = idx[pos:pos + nb]
        symbols = [f(b) for f in fns]
        rest = iter(list(idx[:pos]) + list(idx[pos + nb:]))
        return [symbols[dims.index(d)] if d in dims else next(rest) for d in range(len(x_shape))]
    return position


def gather_loader(node, x, indices):
    """The `index` node's loader: x loaded at the indexed position (a fused gather)."""
    position = index_position_fn(node, x.shape, indices)
    return lambda idx: x.loader(position(idx))


# ---- §6 Scatters into a graph input, in place ----


def _reads_of(buf) -> set:
    if isinstance(buf, ExternKernel):
        return {a.buffer if isinstance(a, ReinterpretView) else a
                for x in buf.inputs for a in (x if isinstance(x, list) else [x]) if isinstance(a, (str, ReinterpretView))}
    c = LoadCollector()
    with set_handler(c):
        if isinstance(buf, Reduction):
            buf.inner_fn(index_vars("i", len(buf.ranges)), index_vars("r", len(buf.reduction_ranges)))
        else:
            buf.inner_fn(index_vars("i", len(buf.ranges)))
    return {name for name, _ in c.loads}


class _CopyProbe:
    """ops handler: is a body `load(name, index)` and nothing else (up to casts)?"""

    def __init__(self):
        self.loads, self.other = [], False

    def load(self, name, index):
        self.loads.append((name, index))
        return "loaded"

    def to_dtype(self, x, dtype):
        return x

    def __getattr__(self, name):
        def op(*args):
            self.other = True
        return op


def _copies_input(copy, target) -> bool:
    """Is `copy` the tensor `target` as it is (each element loaded from where it sits)?"""
    if not isinstance(copy, Pointwise) or isinstance(copy, Scatter) or copy.dtype != target.dtype:
        return False
    idx = index_vars("i", len(copy.ranges))
    probe = _CopyProbe()
    with set_handler(probe):
        out = probe_result = copy.inner_fn(idx)
    del out
    return (not probe.other and probe_result == "loaded" and len(probe.loads) == 1 and
            probe.loads[0][0] == target.name and
            sympy.expand(probe.loads[0][1] - target.layout.index(idx)) == 0)


def scatter_in_place(buffers, target, value_buffer, outputs, later_values) -> bool:
    """Let the scatter that computes an input's new value write into the input itself.

    It may when its copy is the input as it is, nothing else reads the input (no buffer, no other
    write-back's value: they must see the old values) and nothing reads the scatter's result. Then
    the copy goes, the scatter targets the input's memory and layout, and no write-back is needed.
    Returns whether it did.
    """
    by_name = {b.name: b for b in buffers}
    s = by_name.get(value_buffer)
    if not isinstance(s, Scatter) or value_buffer in outputs:
        return False
    copy = by_name.get(s.target)
    if copy is None or not _copies_input(copy, target):
        return False
    for b in buffers:
        if b is not copy and (target.name in _reads_of(b) or (b is not s and value_buffer in _reads_of(b))):
            return False
    for v in later_values:
        c = LoadCollector()
        with set_handler(c):
            v.loader(index_vars("i", len(v.shape)))
        if any(name in (target.name, value_buffer) for name, _ in c.loads):
            return False
    buffers.remove(copy)
    s.target, s.layout = target.name, target.layout
    return True
