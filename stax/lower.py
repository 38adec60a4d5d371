"""§6 Lowering: from the captured graph to the loop-level IR.

Layer: above ir.py (the IR it builds), tensor.py (dtype promotion on data-less tensors) and
op_table.py (which ops are pointwise, views or fallbacks); below schedule.py. Consumes a
`capture.Graph` (op nodes with output metadata) and produces an `ir.LoweredGraph`: IR buffers in
dependence order. Each graph node first becomes a `Value` (a loader: index -> ops value); views
are index rewrites and pointwise values are inlined into their consumers, so only some values are
*realized* into buffers (graph outputs, inputs of fallback kernels, reductions, values too costly
to recompute, write-backs of mutated inputs).

Where to look:
  - the entry point, step by step ................... `lower(graph, policy)` and `_Lowering`
  - views as index rewrites ......................... `_lower_view` (permute, expand, slice, select, reshape)
  - broadcasting and dtype promotion ................ `_lower_pointwise`, `_half_rule`
  - writes through views (slice/select_scatter) ..... `_lower_scatter`
  - gathers and scatters (index, index_put) ....... lower_index.py; `_Lowering.index_put`
  - reductions .................................... `_lower_reduction`
  - scans (cumsum, cumprod, logcumsumexp) ........... lower_scan.py
  - split reductions (§6.5, Alg. 6.1) ............... `split_reduction`, `_apply_split_policy`
  - var/std read once: deviations in pieces ......... `chunk_deviations`, `_chunked_deviation`
  - fallback kernels (§6.1) ......................... `FALLBACK_OPS`, `strided_view` (inputs in place)
  - the IR itself, its printer, merge_dims .......... ir.py
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import sympy

from .dtypes import bfloat16, bool_, float16, float32, int32, int64
from .ir import (REDUCTION_IDENTITY, ExternKernel, FloorDiv, InputBuffer, Layout, LoweredGraph,
                 ModularIndexing, Pointwise, Reduction, ReinterpretView, Scatter, compute_dtype,
                 IndexCollector, LoadCollector, contiguous_strides, index_vars, ops, reduction_identity, set_handler,
                 output_buffer, simplify_index, with_origin)
from .lower_index import gather_loader, index_position_fn, scatter_in_place
from .lower_scan import lower_scan
from .op_table import OPS
from .tensor import Meta, Tensor, result_type

# ---- §6 Which ops lower how (views of op_table.OPS) ----

# ops the lowering leaves to the eager implementation (§6.1); nonzero/unique have data-dependent sizes
FALLBACK_OPS = {name for name, d in OPS.items() if d.fallback}
_UNARY = {name for name, d in OPS.items() if d.kind == "unary"}
_BINARY = {name for name, d in OPS.items() if d.kind == "binary"}
_FLOAT_ONLY = {name for name, d in OPS.items() if d.float_only}
_VIEWS = {name for name, d in OPS.items() if d.kind == "view"}
_SCANS = {name for name, d in OPS.items() if d.kind == "scan"}


# ---- §6 Values during lowering: a loader (index -> ops value) with a shape and a dtype ----


@dataclass
class Value:
    """What a graph node lowers to before (or instead of) being stored in a buffer."""
    shape: tuple
    dtype: object                   # the node's dtype (half stays half: loads upcast, stores round)
    loader: Callable                # index -> ops value, already in compute_dtype(dtype)
    buffer: str | None = None       # set when the value is stored in a named buffer
    cost: int = 0                   # number of ops in the body (inlining heuristic)
    origins: list = field(default_factory=list)   # graph nodes inlined into this value


def _load_from(name, dtype, layout: Layout):
    def loader(idx):
        v = ops.load(name, layout.index(idx))
        return ops.to_dtype(v, compute_dtype(dtype)) if compute_dtype(dtype) != dtype else v
    return loader


class ScalarOverflowError(RuntimeError, OverflowError):
    """A Python int that does not fit the integer dtype it is computed in. Eager raises
    OverflowError (numpy), PyTorch RuntimeError: this is both, so either `except` catches it."""


def _check_scalar(x, dtype):
    """A Python int operand must fit the integer dtype it is computed in (eager raises; a C++ or
    Triton literal would wrap)."""
    if dtype.is_floating_point or dtype == bool_ or isinstance(x, bool) or not isinstance(x, int):
        return
    bits = dtype.itemsize * 8
    if not -2 ** (bits - 1) <= x < 2 ** (bits - 1):
        raise ScalarOverflowError(f"value cannot be converted to type int{bits}_t without overflow: "
                                  f"the Python int {x} does not fit {dtype.name} (eager raises too). Use "
                                  "a float scalar, or a wider dtype where it fits")


def _scalar_value(x, dtype):
    if isinstance(x, sympy.Expr) and not x.is_Number:   # a size used as a scalar (§10.4)
        return Value((), dtype, lambda idx: ops.index_expr(x, compute_dtype(dtype)))
    _check_scalar(x, compute_dtype(dtype))
    return Value((), dtype, lambda idx: ops.constant(x, compute_dtype(dtype)))


def _check_int_operands(op, args, common):
    """Eager's integer errors that the operands show at compile time: `//` or `%` by a constant
    zero, and an integer to a constant negative power (op_table's _int_div_check, numpy's power)."""
    if common.is_floating_point or len(args) != 2 or isinstance(args[1], Value):
        return
    b = args[1]
    if op in ("floordiv", "remainder") and b == 0:
        raise RuntimeError("ZeroDivisionError")
    if op == "pow" and isinstance(b, int) and b < 0:
        raise ValueError("Integers to negative integer powers are not allowed.")


# ---- §6 Views as index rewriting (never copies) ----


def _reshape_reindex(old_shape, new_shape):
    """Map an index of `new_shape` to an index of `old_shape` with the same row-major position.

    Dimensions are matched in groups whose products agree, so merging or splitting a group gives
    plain affine indices; only genuinely mixed groups need floor-division and modulo.
    """
    old, new = [sympy.sympify(s) for s in old_shape], [sympy.sympify(s) for s in new_shape]
    if any(s == 0 for s in old + new):
        return lambda idx: [sympy.Integer(0)] * len(old)   # no element is ever loaded
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        oi, nj, po, pn = [], [], sympy.Integer(1), sympy.Integer(1)
        if i < len(old):
            oi, po, i = [i], old[i], i + 1
        if j < len(new):
            nj, pn, j = [j], new[j], j + 1
        while po != pn:
            if _grow_old_side(po, pn) and i < len(old):
                oi.append(i); po *= old[i]; i += 1
            elif j < len(new):
                nj.append(j); pn *= new[j]; j += 1
            else:   # symbolic sizes equal only under a guard (s0*s1 == 60): one group of all dims
                groups, oi, nj, i, j = [], list(range(len(old))), list(range(len(new))), len(old), len(new)
                break
        groups.append((oi, nj))

    def reindex(idx):
        out = [sympy.Integer(0)] * len(old)
        for oi, nj in groups:
            flat = sympy.Integer(0)
            for k in nj:
                flat = flat * new[k] + idx[k]
            for k in reversed(oi[1:]):
                out[k] = ModularIndexing(flat, 1, old[k])
                flat = FloorDiv(flat, old[k])
            if oi:
                out[oi[0]] = flat
        return out
    return reindex


def _grow_old_side(po, pn) -> bool:
    """Which side of a reshape group is short: the old one when po < pn. With symbolic sizes
    (§10.3) `po < pn` is decided structurally: the old side is short when its product divides the
    new one's (s0 vs 4*s0*s1) -- both products run over the same elements, so a group always closes."""
    if po.is_Integer and pn.is_Integer:
        return bool(po < pn)
    if sympy.expand(po - pn) == 0:
        return False
    return sympy.fraction(sympy.cancel(pn / po))[1] == 1


def _view_reindex(op, params, in_shape, out_shape):
    if op == "permute":
        dims = params["dims"]
        inv = {d: k for k, d in enumerate(dims)}
        return lambda idx: [idx[inv[d]] for d in range(len(dims))]
    if op == "expand":
        lead = len(out_shape) - len(in_shape)
        return lambda idx: [sympy.Integer(0) if (in_shape[k] == 1 and out_shape[k + lead] != 1)
                            else idx[k + lead] for k in range(len(in_shape))]
    if op == "slice":
        d, start, step = params["dim"], params["start"], params["step"]
        return lambda idx: [start + step * i if k == d else i for k, i in enumerate(idx)]
    if op == "select":
        d, index = params["dim"], params["index"]
        return lambda idx: list(idx[:d]) + [sympy.sympify(index)] + list(idx[d:])
    if op == "reshape":
        return _reshape_reindex(in_shape, out_shape)
    raise NotImplementedError(op)


def _lower_view(node, src: Value) -> Value:
    reindex = _view_reindex(node.op, node.params, src.shape, node.meta.shape)
    return Value(tuple(node.meta.shape), src.dtype, lambda idx: src.loader(reindex(idx)),
                 cost=src.cost)


# ---- §6 Pointwise ops: broadcasting and the §6.2 compute dtype ----


def _broadcast_loader(v: Value, out_shape):
    lead = len(out_shape) - len(v.shape)

    def loader(idx):
        return v.loader([sympy.Integer(0) if (v.shape[k] == 1 and out_shape[k + lead] != 1)
                         else idx[k + lead] for k in range(len(v.shape))])
    return loader


def _operand(x, dtype):
    """A graph input operand as (loader, shape, cost): a Value, or a Python scalar constant."""
    if isinstance(x, Value):
        return x
    return _scalar_value(x, dtype)


def _lower_pointwise(node, args) -> Value:
    op, out_shape, out_dtype = node.op, tuple(node.meta.shape), node.meta.dtype
    if op == "where":
        cond, a, b = args
        common = result_type(*[_as_meta(x) for x in (a, b)])
        cdt = compute_dtype(common)
        ra, rb = _half_rule(a, common), _half_rule(b, common)
        c, a, b = (_operand(cond, bool_), _operand(a, cdt), _operand(b, cdt))
        lc, la, lb = (_broadcast_loader(v, out_shape) for v in (c, a, b))
        body = lambda idx: ops.where(lc(idx), _cast(la(idx), a, cdt, ra), _cast(lb(idx), b, cdt, rb))
        return Value(out_shape, out_dtype, body, cost=1 + c.cost + a.cost + b.cost)
    if op == "to_dtype":
        (a,) = args
        src = _operand(a, out_dtype)
        la = _broadcast_loader(src, out_shape)
        target = node.params["dtype"]
        if target in (float16, bfloat16) and src.dtype != target:
            # a cast the user wrote still rounds (docs/DESIGN.md): round to half, keep computing in float32
            body = lambda idx: ops.to_dtype(ops.to_dtype(la(idx), target), float32)
        else:
            body = lambda idx: ops.to_dtype(la(idx), compute_dtype(target))
        return Value(out_shape, out_dtype, body, cost=1 + src.cost)
    if op == "clone":
        return Value(out_shape, out_dtype, _broadcast_loader(args[0], out_shape), cost=args[0].cost)
    if op == "flip":        # an index rewrite, i -> n - 1 - i along each flipped dim
        src, dims = args[0], node.params["dims"]
        return Value(out_shape, out_dtype, lambda idx: src.loader(
            [out_shape[k] - 1 - i if k in dims else i for k, i in enumerate(idx)]), cost=src.cost)
    # unary and binary: cast every operand to the promoted compute dtype, then apply ops.<op>
    common = result_type(*[_as_meta(x) for x in args])
    if op in _FLOAT_ONLY and not common.is_floating_point:
        common = float32
    cdt = compute_dtype(common)
    _check_int_operands(op, args, common)
    rounds = [_half_rule(x, common) for x in args]
    vals = [_operand(x, cdt) for x in args]
    loaders = [_broadcast_loader(v, out_shape) for v in vals]
    fn = "truediv" if op == "div" else op

    # a scalar on the left (`0.5 * t`, Listing 9.3) is printed after the tensor operand it meets
    order = [1, 0] if len(args) == 2 and not isinstance(args[0], Value) and isinstance(args[1], Value) \
        else list(range(len(args)))

    def body(idx):
        got = {k: _cast(loaders[k](idx), vals[k], cdt, rounds[k]) for k in order}
        return getattr(ops, fn)(*[got[k] for k in range(len(args))])
    return Value(out_shape, out_dtype, body, cost=1 + sum(v.cost for v in vals))


def _half_rule(x, common):
    """Eager's half-precision rule (tensor.py `_run_eager`): when an op's common dtype is
    float16/bfloat16, a *tensor* operand of another dtype (an int tensor, a float32 0-dim tensor)
    is rounded to that half type before computing; Python scalars are not. Returns the dtype to
    round the operand to, or None."""
    if common in (float16, bfloat16) and isinstance(x, Value) and x.dtype != common:
        return common
    return None


def _cast(x, v: Value, cdt, round_to=None):
    """Bring an operand's value to the compute dtype `cdt` (rounding through `round_to` first)."""
    if round_to is not None:
        return ops.to_dtype(ops.to_dtype(x, round_to), compute_dtype(round_to))
    return ops.to_dtype(x, cdt) if compute_dtype(v.dtype) != cdt else x


def _as_meta(x):
    """What result_type needs of an operand: a data-less tensor with its dtype and rank."""
    if isinstance(x, Value):
        return Tensor._proxy(Meta(tuple(x.shape), (), x.dtype), None)
    if isinstance(x, sympy.Expr) and not x.is_Number:     # a size: a Python int; a run-time float
        return 0 if all(s.is_integer for s in x.free_symbols) else 0.0     # argument: a float (§10.4)
    return x


def _lower_factory(node) -> Value:
    p, shape, dtype = node.params, tuple(node.meta.shape), node.meta.dtype
    if node.op == "full":
        if isinstance(p["value"], sympy.Expr) and not p["value"].is_Number:     # a size (§10.4)
            return Value(shape, dtype, lambda idx: ops.index_expr(p["value"], compute_dtype(dtype)))
        _check_scalar(p["value"], compute_dtype(dtype))
        return Value(shape, dtype, lambda idx: ops.constant(p["value"], compute_dtype(dtype)))
    # arange: value = start + step * i0
    return Value(shape, dtype, lambda idx: ops.index_expr(
        sympy.sympify(p["start"]) + sympy.sympify(p["step"]) * idx[0], compute_dtype(dtype)), cost=1)


def _lower_cat(node, parts: list) -> Value:
    """cat: out[..., i, ...] reads part k where offsets[k] <= i < offsets[k+1] (masked loads)."""
    d, shape = node.params["dim"], tuple(node.meta.shape)
    starts, acc = [], sympy.Integer(0)
    for v in parts:
        starts.append(acc)
        acc = acc + v.shape[d]
    cdt = compute_dtype(node.meta.dtype)

    def body(idx):
        i = idx[d]

        def part(k):
            shifted = list(idx[:d]) + [i - starts[k]] + list(idx[d + 1:])
            return lambda: _cast(parts[k].loader(shifted), parts[k], cdt)
        # each part loads only inside its own range [starts[k], starts[k+1]): a masked load's
        # `other` is computed unconditionally, so no part may be the unmasked fallback of another
        pos = ops.index_expr(i, int64)
        result = ops.constant(0, cdt)
        for k in range(len(parts) - 1, -1, -1):
            inside = ops.ge(pos, ops.index_expr(starts[k], int64))
            if k + 1 < len(parts):
                inside = ops.logical_and(inside, ops.lt(pos, ops.index_expr(starts[k + 1], int64)))
            result = ops.masked(inside, part(k), result)
        return result
    return Value(shape, node.meta.dtype, body, cost=sum(v.cost for v in parts) + len(parts))


def _lower_scatter(node, base: Value, src: Value) -> Value:
    """slice_scatter / select_scatter: `base` with one view of it replaced by `src`.

    This is the functional form of a write through a view (capture.py `_scatter_into`): element
    `idx` comes from `src` where it lies inside the view, else from `base` (a masked load, so the
    out-of-view positions never compute a `src` index).
    """
    p, d = node.params, node.params["dim"]

    def const(v):       # a bound over size symbols (a slice to s0 - 1, §10.4) is an index expression
        return ops.index_expr(v, int64) if getattr(v, "free_symbols", None) else ops.constant(v, int64)

    def body(idx):
        i = idx[d]
        pos = ops.index_expr(i, int64)
        if node.op == "select_scatter":
            inside = ops.eq(pos, const(p["index"]))
            src_idx = list(idx[:d]) + list(idx[d + 1:])
        else:
            start, end, step = p["start"], p["end"], p["step"]
            inside = ops.logical_and(ops.ge(pos, const(start)), ops.lt(pos, const(end)))
            if step != 1:   # (i - start) % step == 0, written with a non-negative dividend
                phase = ops.index_expr(ModularIndexing(i + (-start) % step, 1, step), int64)
                inside = ops.logical_and(inside, ops.eq(phase, const(0)))
            src_idx = list(idx[:d]) + [FloorDiv(i - start, step)] + list(idx[d + 1:])
        return ops.masked(inside, lambda: src.loader(src_idx), base.loader(idx))
    return Value(tuple(node.meta.shape), node.meta.dtype, body, cost=2 + base.cost + src.cost)


# ---- §6.5 Reductions and split reductions ----


def _lower_reduction(node, src: Value, new_name, emit) -> Value:
    dims, keepdim = node.params["dims"], node.params["keepdim"]
    rtype = node.op
    in_shape = src.shape
    kept = [k for k in range(len(in_shape)) if k not in dims]
    ranges = [in_shape[k] for k in kept]
    rranges = [in_shape[k] for k in dims]
    acc_dtype = compute_dtype(src.dtype) if rtype not in ("sum", "prod") else compute_dtype(node.meta.dtype)
    if rtype in ("argmax", "argmin"):
        acc_dtype = compute_dtype(src.dtype)
    loader = src.loader
    if all(s == 1 for s in rranges):
        return _single_element_reduction(node, src, kept)

    def inner_fn(index, rindex):
        full = [None] * len(in_shape)
        for k, i in zip(kept, index):
            full[k] = i
        for k, r in zip(dims, rindex):
            full[k] = r
        v = loader(full)
        return ops.to_dtype(v, acc_dtype) if compute_dtype(src.dtype) != acc_dtype else v

    name = new_name()
    origins = (src.origins if src.buffer is None else []) + [node.name]
    red = Reduction(name, node.meta.dtype, ranges, rranges, rtype, inner_fn, acc_dtype,
                    Layout(tuple(ranges), contiguous_strides(ranges)), origins)
    emit(red)
    out = Value(tuple(ranges), node.meta.dtype,
                _load_from(name, node.meta.dtype, red.layout), buffer=name)
    if keepdim:
        # put the reduced dims back as size-1 dims: a view
        out_shape = tuple(node.meta.shape)
        loader2 = out.loader
        out = Value(out_shape, out.dtype,
                    lambda idx: loader2([i for k, i in enumerate(idx) if k not in dims]),
                    buffer=None)
    return out


def _single_element_reduction(node, src: Value, kept) -> Value:
    """A reduction over one element (size-1 or no reduced dims) is that element: a pointwise value.

    Every back end then sees only reductions with a real loop; argmax/argmin of one element is 0.
    """
    dims, keepdim, out_dtype = node.params["dims"], node.params["keepdim"], node.meta.dtype

    def body(idx):
        if node.op in ("argmax", "argmin"):
            return ops.constant(0, int64)
        kept_idx = [i for k, i in enumerate(idx) if k not in dims] if keepdim else list(idx)
        full = [sympy.Integer(0)] * len(src.shape)
        for k, i in zip(kept, kept_idx):
            full[k] = i
        v = src.loader(full)
        return _cast(v, src, compute_dtype(out_dtype))
    return Value(tuple(node.meta.shape), out_dtype, body, cost=1 + src.cost)


def split_reduction(red: Reduction, splits: int, new_name, outer: bool = False, index_dtype=int64) -> list:
    """Alg. 6.1: reduce each row in `splits` pieces (a monoid lets us), then reduce the pieces.

    Returns [first, second]; the first reduction has ranges + [splits] outputs, each reducing a
    contiguous piece of ceil(R / splits) elements of the flattened reduction space (padded with the
    identity beyond R); the second reduces the `splits` partials of each row. With `outer` (a
    reduction that reads across rows, §9.4's OUTER) the partials are [splits] + ranges instead: the
    output dims stay innermost, so both kernels read and write them contiguously. `index_dtype`
    is the type of the piece's bound check (int32 where every size is known or guarded < 2^31:
    per element, an int64 compare costs a dynamic kernel 20% on a small column sum).
    """
    rnumel = sympy.prod(red.reduction_ranges)
    # ceil(R / splits); for a symbolic R (§10.3) a run-time floor division
    piece = -(-rnumel // splits) if sympy.sympify(rnumel).is_Integer else FloorDiv(rnumel + splits - 1, splits)
    rvars_shape = list(red.reduction_ranges)
    ident = reduction_identity(red.reduction_type, red.src_dtype)

    def unflatten(flat):
        out = []
        for k in range(len(rvars_shape) - 1, -1, -1):
            out.append(ModularIndexing(flat, 1, rvars_shape[k]) if k else flat)
            flat = FloorDiv(flat, rvars_shape[k])
        return list(reversed(out))

    inner = red.inner_fn

    def first_fn(index, rindex):
        s, x = (index[0], index[1:]) if outer else (index[-1], index[:-1])
        flat = s * piece + rindex[0]
        if piece * splits == rnumel:
            return inner(x, unflatten(flat))
        in_range = ops.lt(ops.index_expr(flat, index_dtype), ops.index_expr(rnumel, index_dtype))
        return ops.masked(in_range, lambda: inner(x, unflatten(flat)),
                          ops.constant(ident, red.src_dtype))

    name1 = new_name()
    ranges1 = [sympy.Integer(splits)] + list(red.ranges) if outer else list(red.ranges) + [sympy.Integer(splits)]
    first = Reduction(name1, red.src_dtype, ranges1, [sympy.sympify(piece)], red.reduction_type,
                      first_fn, red.src_dtype, Layout(tuple(ranges1), contiguous_strides(ranges1)),
                      list(red.origins))
    load1 = _load_from(name1, red.src_dtype, first.layout)
    second = Reduction(red.name, red.dtype, list(red.ranges), [sympy.Integer(splits)],
                       red.reduction_type, lambda index, rindex: load1([rindex[0]] + list(index) if outer
                                                                  else list(index) + [rindex[0]]),
                       red.src_dtype, red.layout, list(red.origins))
    return [first, second]


# ---- §6.5 var's deviations in pieces read once (Chan's combine) ----


def _deviation_parts(node, env) -> tuple | None:
    """(v, c) when the sum `node` is var's second pass, sum_r (v - c)^2 with c constant along the
    reduced dims (tensor_ops.var, layer_norm: `dev = x - mean; sum(dev * dev)`), else None."""
    sq = node.inputs[0] if node.inputs else None
    if node.op != "sum" or getattr(sq, "op", None) != "mul" or len(sq.inputs) != 2 or sq.inputs[0] is not sq.inputs[1]:
        return None
    dev = sq.inputs[0]
    if getattr(dev, "op", None) != "sub" or not all(hasattr(a, "op") for a in dev.inputs):
        return None
    v, c = (env[a] for a in dev.inputs)
    dtype, shape, dims = node.meta.dtype, tuple(dev.meta.shape), node.params["dims"]
    if not dtype.is_floating_point or compute_dtype(dtype) is not dtype or not dims:
        return None
    if any(x.dtype is not dtype for x in (v, c)) or sq.meta.dtype is not dtype or dev.meta.dtype is not dtype:
        return None
    lead = len(shape) - len(c.shape)
    if any(k >= lead and c.shape[k - lead] != 1 for k in dims):
        return None                  # c varies along a reduced dim: not a deviation from a row value
    kept = [k for k in range(len(shape)) if k not in dims]
    lv, lc = _broadcast_loader(v, shape), _broadcast_loader(c, shape)

    def full(index, rindex):
        out = [sympy.Integer(0)] * len(shape)
        for k, i in zip(kept, index):
            out[k] = i
        for k, r in zip(dims, rindex):
            out[k] = r
        return out
    return (lambda index, rindex: lv(full(index, rindex)),
            lambda index: lc(full(index, [sympy.Integer(0)] * len(dims))))


class _TreeOps:
    """An ops handler whose values are expression trees (two bodies compare structurally)."""

    def load(self, name, index):
        return ("load", name, sympy.expand(sympy.sympify(index)))

    def masked(self, mask, body, other):
        return ("masked", mask, body(), other)

    def __getattr__(self, op):
        return lambda *args: (op,) + tuple(a.name if hasattr(a, "itemsize") else a for a in args)


def _same_values(red: Reduction, fn_a, fn_b) -> bool:
    """Do two bodies (index, rindex) -> value over red's loops compute the same expression?"""
    xv, rv = index_vars("x", len(red.ranges)), index_vars("r", len(red.reduction_ranges))
    with set_handler(_TreeOps()):
        return fn_a(xv, rv) == fn_b(xv, rv)


def _piece_fn(red: Reduction, inner, splits, rows: int, index_dtype=int64, whole=False):
    """inner(s, x, rindex) over piece s: `rows` slices of the outermost reduced dim, the inner
    reduced dims whole (their loads keep their shape: contiguous runs, SIMD on the CPU);
    (s, x, rindex) -> value, or the identity 0 past the last slice (a mask whenever the pieces
    may not tile the dim: always for a symbolic size, §10.3, unless `whole`: every piece full)."""
    outer_size = red.reduction_ranges[0]

    def fn(s, x, r):
        full = [s * rows + r[0]] + list(r[1:])
        if whole or sympy.sympify(rows * splits - outer_size) == 0:
            return inner(s, x, full)
        in_range = ops.lt(ops.index_expr(full[0], index_dtype), ops.index_expr(outer_size, index_dtype))
        return ops.masked(in_range, lambda: inner(s, x, full), ops.constant(0, red.src_dtype))
    return fn


def _piece_count(n_outer, rows: int) -> tuple:
    """(splits, rows, last): `rows` slices per piece, the last piece's slices. A known size is cut
    evenly (every piece at least one slice); a symbolic one (§10.3) keeps `rows`, chosen at the
    hint, and counts its pieces at run time: ceil(n / rows), the last one ragged (masked; a dim
    reduced alone keeps whole pieces instead, `_chunked_deviation`)."""
    if sympy.sympify(n_outer).is_Integer:
        n_outer = int(n_outer)
        splits = -(-n_outer // rows)
        rows = -(-n_outer // splits)
        splits = -(-n_outer // rows)             # every piece holds at least one slice
        return splits, rows, n_outer - (splits - 1) * rows
    splits = FloorDiv(n_outer + rows - 1, rows)
    return splits, rows, n_outer - (splits - 1) * rows


def _piece_lengths(splits, rows, last, inner, dt, index_dtype) -> tuple:
    """(count(s), per_element(total, s), run_time) of pieces of `rows` slices of `inner` elements,
    the last of `last` slices: piece s's element count as a float, total / that count, and whether
    the last piece's length is known only at run time (§10.3). Then per_element is a select
    between the two lengths' reciprocals and a product, not a division by a run-time value per
    element (the static form divides by a constant: a product too)."""
    def number(e):                   # an element count as a float (symbolic: computed at run time)
        e = sympy.sympify(e)
        return ops.constant(float(e), dt) if e.is_Integer else ops.index_expr(e, dt)

    def is_last(s):
        return ops.lt(ops.index_expr(s, index_dtype), ops.index_expr(splits - 1, index_dtype))

    def count(s):
        if sympy.sympify(last - rows) == 0:
            return number(rows * inner)
        return ops.where(is_last(s), number(rows * inner), number(last * inner))

    run_time = not sympy.sympify(last - rows).is_Integer

    def per_element(total, s):
        if not run_time:
            return ops.truediv(total, count(s))
        full = sympy.sympify(rows * inner)
        whole = ops.constant(1.0 / float(full), dt) if full.is_Integer else ops.reciprocal(number(full))
        return ops.mul(total, ops.where(is_last(s), whole, ops.reciprocal(number(last * inner))))
    return count, per_element, run_time


def _tail_combine(red: Reduction, pieces, rows: int, shift, loads, at, index_dtype) -> tuple:
    """(combine, total_fn) over `pieces` whole pieces of `rows` slices, then the dim's last
    n - rows * pieces slices (fewer than `rows`, counted at run time) as pieces of one element:
    K = v, S = M2 = 0, n = 1, so each adds (v - c)^2 to the deviations and v to the sum. The whole
    pieces' kernel then reads no mask (its static twin's loop), the combine one per element."""
    (v_fn, c_fn), dt = red.deviation, red.src_dtype
    load_s, load_m2 = loads
    zeros = [sympy.Integer(0)] * (len(red.reduction_ranges) - 1)

    def parts(index, s):
        si, first = ops.index_expr(s, index_dtype), ops.index_expr(pieces, index_dtype)
        in_piece, in_tail = ops.lt(si, first), ops.ge(si, first)
        zero = ops.constant(0, dt)
        # slice s of the tail is row s + pieces * (rows - 1); each lane reads one of the two rows
        k = ops.where(in_piece, ops.masked(in_piece, lambda: shift(s, index), zero),
                      ops.masked(in_tail, lambda: v_fn(index, [s + pieces * (rows - 1)] + zeros), zero))
        total = ops.masked(in_piece, lambda: load_s(at(s, index)), zero)
        n = ops.where(in_piece, ops.constant(float(rows), dt), ops.constant(1.0, dt))
        return in_piece, k, total, n

    def combine(index, rindex):
        s = rindex[0]
        in_piece, k, total, n = parts(index, s)
        m2 = ops.masked(in_piece, lambda: load_m2(at(s, index)), ops.constant(0, dt))
        d = ops.add(ops.sub(k, c_fn(index)), ops.truediv(total, ops.constant(float(rows), dt)))
        return ops.add(m2, ops.mul(n, ops.mul(d, d)))

    def total_fn(index, rindex):
        _, k, total, n = parts(index, rindex[0])
        return ops.add(ops.mul(n, k), total)
    return combine, total_fn


def _chunked_deviation(red: Reduction, sums: list, rows: int, new_name, outer: bool, names=None,
                       index_dtype=int64) -> tuple:
    """sum_r (v - c)^2 in pieces of `rows` slices of the outermost reduced dim. Piece s is shifted
    by its first value K_s (the shifted values are small, so their float sums are accurate even
    when the mean is large): its sum S_s = sum (v - K_s) and deviations M2_s = sum (v - K_s -
    S_s/n_s)^2 (two passes over a piece its kernel holds in registers or cache: one read from
    memory); then Chan's combine sum_s M2_s + n_s (K_s - c + S_s/n_s)^2, exact for any c. The sums
    of v in `sums` (the mean's) become sum_s n_s K_s + S_s. `names`: the pieces of another
    deviation reduction of the same v (std and var of one input), reused."""
    v_fn, c_fn = red.deviation
    dt = red.src_dtype
    inner = sympy.sympify(sympy.prod(red.reduction_ranges[1:]))
    splits, rows, last = _piece_count(red.reduction_ranges[0], rows)
    # a symbolic dim reduced alone: whole pieces only, its last n mod rows slices (run-time
    # ragged) left to the combine, one piece of one element each (`_tail_combine`)
    whole = not sympy.sympify(red.reduction_ranges[0]).is_Integer and inner == 1
    if whole:
        splits, last = FloorDiv(red.reduction_ranges[0], rows), rows
    splits = sympy.sympify(splits)
    ranges1 = [splits] + list(red.ranges) if outer else list(red.ranges) + [splits]
    layout1 = Layout(tuple(ranges1), contiguous_strides(ranges1))
    at = (lambda s, x: [s] + list(x)) if outer else (lambda s, x: list(x) + [s])
    sx = (lambda i: (i[0], i[1:])) if outer else (lambda i: (i[-1], i[:-1]))

    count, per_element, run_time = _piece_lengths(splits, rows, last, inner, dt, index_dtype)

    def shift(s, x):
        return v_fn(x, [s * rows] + [sympy.Integer(0)] * (len(red.reduction_ranges) - 1))

    def shifted(s, x, r, k_s=None):
        return ops.sub(v_fn(x, r), shift(s, x) if k_s is None else k_s)
    s_name, m2_name = names or (new_name(), new_name())
    load_s, load_m2 = _load_from(s_name, dt, layout1), _load_from(m2_name, dt, layout1)

    def sum_piece(index, rindex):
        s, x = sx(index)
        k_s = shift(s, x) if run_time else None
        return _piece_fn(red, lambda s_, x_, r_: shifted(s_, x_, r_, k_s), splits, rows, index_dtype,
                         whole)(s, x, rindex)

    def dev_piece(index, rindex):
        s, x = sx(index)
        k_s = shift(s, x) if run_time else None
        mean = per_element(load_s(index), s)

        def sq(s_, x_, r_):
            d = ops.sub(shifted(s_, x_, r_, k_s), mean)
            return ops.mul(d, d)
        return _piece_fn(red, sq, splits, rows, index_dtype, whole)(s, x, rindex)

    ranges_r = [sympy.Integer(rows)] + list(red.reduction_ranges[1:])
    first = [Reduction(name, dt, ranges1, ranges_r, "sum", fn, dt, layout1, list(red.origins))
             for name, fn in ((s_name, sum_piece), (m2_name, dev_piece))]

    def combine(index, rindex):
        s = rindex[0]
        n = count(s)
        d = ops.add(ops.sub(shift(s, index), c_fn(index)), per_element(load_s(at(s, index)), s))
        return ops.add(load_m2(at(s, index)), ops.mul(n, ops.mul(d, d)))

    def total_fn(index, rindex):
        s = rindex[0]
        return ops.add(ops.mul(count(s), shift(s, index)), load_s(at(s, index)))
    rs = [splits]
    if whole:
        combine, total_fn = _tail_combine(red, splits, rows, shift, (load_s, load_m2), at, index_dtype)
        rs = [splits + red.reduction_ranges[0] - rows * splits]
    first = [] if names else first
    total = [Reduction(a.name, a.dtype, list(a.ranges), rs, "sum", total_fn, dt, a.layout, list(a.origins))
             for a in sums]
    return first, total, Reduction(red.name, red.dtype, list(red.ranges), rs, "sum", combine, dt,
                                   red.layout, list(red.origins))


def _at_hints(expr, hints):
    """A size at the example's values (§10.3), or None where a size has no hint."""
    expr = sympy.sympify(expr).subs(hints or {})
    return int(expr) if expr.is_Integer else None


def chunk_deviations(lowered: LoweredGraph, deviation_piece, new_name):
    """Reduce each var deviation reduction longer than the back end's one-read piece
    (`deviation_piece(numel_out, numel_red, outer) -> elements`) in pieces (`_chunked_deviation`);
    its pieces run where the first sum of the same values (the mean's, anywhere in the program) or
    the deviations ran, and those sums read the pieces. Symbolic sizes (§10.3): the piece is
    chosen at the hints, the piece count is a run-time expression and the last piece is masked
    (`_piece_count`), so no guard is needed; a dim reduced alone is cut in whole pieces, its
    last n mod rows slices left to the combine (`_tail_combine`)."""
    bufs, done, made, hints = lowered.buffers, set(), [], lowered.hints
    for red in [b for b in bufs if isinstance(b, Reduction) and b.deviation is not None]:
        out, rnumel = _at_hints(sympy.prod(red.ranges), hints), _at_hints(sympy.prod(red.reduction_ranges), hints)
        inner = _at_hints(sympy.prod(red.reduction_ranges[1:]), hints)
        if out is None or rnumel is None or inner is None:
            continue
        outer = reads_across_rows(red)
        piece = deviation_piece(out, rnumel, outer)
        if not piece or rnumel <= piece or inner >= rnumel // 2:
            continue                 # short enough to read once, or too few slices to cut in pieces
        rows = max(1, piece // inner)
        elements = sympy.sympify(sympy.prod(red.ranges) * sympy.prod(red.reduction_ranges))
        small = lowered.index32 or (elements.is_Integer and int(elements) < 2 ** 31)
        sums = [b for b in bufs if isinstance(b, Reduction) and b.reduction_type == "sum"
                and b.deviation is None and b.ranges == red.ranges and b.reduction_ranges == red.reduction_ranges
                and b.src_dtype == red.src_dtype and _same_values(b, b.inner_fn, red.deviation[0])]
        names = next((names for other, r, names in made if r == rows and other.ranges == red.ranges
                      and other.reduction_ranges == red.reduction_ranges and other.src_dtype == red.src_dtype
                      and _same_values(red, other.deviation[0], red.deviation[0])), None)
        first, total, combined = _chunked_deviation(red, sums, rows, new_name, outer, names,
                                                    int32 if small else int64)
        made.append((red, rows, names or (first[0].name, first[1].name)))
        at = min(bufs.index(b) for b in sums + [red])
        replace = dict(zip(sums, total))
        replace[red] = combined
        bufs[:] = [replace.get(b, b) for b in bufs[:at]] + first + [replace.get(b, b) for b in bufs[at:]]
        done |= {b.name for b in first + [combined]} | {b.name for b in sums}
    return done


# ---- §6 The lowering pass ----


def lower(graph, split_policy=None, inline_limit: int = 64, outer_split_policy=None,
          deviation_piece=None, operand_strides=None) -> LoweredGraph:
    """Lower every graph node; realize values into buffers where the data flow requires it.

    A pointwise value is inlined into its consumers (it never touches memory) unless it is a graph
    output, an input of a fallback kernel, or too expensive to recompute (`inline_limit` ops).
    `split_policy(numel_out, numel_red) -> splits` is the back end's choice for Alg. 6.1 (1: none);
    `outer_split_policy`, when the back end has one, decides instead for reductions that read across
    rows (`reads_across_rows`), whose partials it lays out with the output dims innermost.
    `deviation_piece`, when given, reduces var's deviations in pieces read once (`chunk_deviations`).
    """
    lo = _Lowering(inline_limit)
    lo.operand_strides = operand_strides
    lo.add_inputs(graph)
    for node in graph.nodes:
        lo.add_node(node)
    outputs = lo.store_outputs(graph)
    mutations = lo.write_back_mutations(graph)
    lowered = LoweredGraph(lo.inputs, lo.buffers, outputs, mutations, dict(getattr(graph, "unbacked", {})),
                            list(getattr(graph, "checks", ())), dict(getattr(graph, "bounds", {})),
                            dict(getattr(graph, "hints", {})), list(getattr(graph, "scalars", ())),
                            bool(getattr(graph, "index32", False)))
    if split_policy is not None:
        done = chunk_deviations(lowered, deviation_piece, lo.new_name) if deviation_piece else set()
        _apply_split_policy(lowered, split_policy, lo.new_name, outer_split_policy, done,
                            dict(getattr(graph, "hints", {})))
    return lowered


class _Lowering:
    """One lowering in progress: the buffers emitted so far (named buf0, buf1, ... in emission
    order) and the Value of each graph node. `lower` runs its steps top to bottom."""

    def __init__(self, inline_limit: int):
        self.inline_limit = inline_limit
        self.inputs: list = []          # InputBuffer, in call order
        self.buffers: list = []         # computed buffers, in dependence (= emission) order
        self.env: dict = {}             # graph node -> Value (or Python scalar)
        self.outputs: list = []         # the graph's outputs once stored (store_outputs)
        self.count = 0
        # the back end's say on a fallback's operand: (node, position, layout) -> the strides to
        # copy it to first, or None to hand it over as it is (tf32 matmuls want K-major operands)
        self.operand_strides = None

    def new_name(self) -> str:
        self.count += 1
        return f"buf{self.count - 1}"

    def emit(self, buf):
        self.buffers.append(buf)

    def dtype_of(self, name):
        return next(b.dtype for b in self.inputs + self.buffers if b.name == name)

    def buffer_layout(self, name):
        return next(b.layout for b in self.inputs + self.buffers if b.name == name)

    def realize(self, v: Value, layout: Layout | None = None, origins=()) -> Value:
        """Store a value in a buffer of its own, contiguous or with `layout` (if it is not in one
        already; with `layout`, always, named for `origins` too)."""
        if v.buffer is not None and layout is None:
            return v
        name = self.new_name()
        layout = layout or Layout(tuple(v.shape), contiguous_strides(v.shape))
        self.emit(Pointwise(name, v.dtype, list(v.shape), v.loader, layout, list(v.origins) + list(origins)))
        return Value(v.shape, v.dtype, _load_from(name, v.dtype, layout), buffer=name)

    def arg(self, x):
        if isinstance(x, (list, tuple)):
            return [self.arg(y) for y in x]
        return self.env[x] if hasattr(x, "op") else x

    # step 1: the graph's inputs are buffers the caller owns, read through their own strides
    def add_inputs(self, graph):
        for node in graph.inputs:
            layout = Layout(tuple(node.meta.shape), tuple(node.meta.stride), sympy.Integer(0))
            self.inputs.append(InputBuffer(node.name, node.meta.dtype, layout, [node.name]))
            self.env[node] = Value(tuple(node.meta.shape), node.meta.dtype,
                                   _load_from(node.name, node.meta.dtype, layout), buffer=node.name)

    # step 2: each op node becomes a Value (inlined into its readers unless it is too costly)
    def add_node(self, node):
        args = [self.arg(x) for x in node.inputs]
        op = node.op
        if op in _VIEWS:
            v = _lower_view(node, args[0])
        elif op in _UNARY or op in _BINARY or op in ("where", "to_dtype", "clone", "flip"):
            v = _lower_pointwise(node, args)
        elif op in ("full", "arange"):
            v = _lower_factory(node)
        elif op == "cat":
            v = _lower_cat(node, args[0])
        elif op in ("slice_scatter", "select_scatter"):
            v = _lower_scatter(node, args[0], args[1])
        elif op == "index":             # a gather: a loader through loaded indices (lower_index.py)
            v = Value(tuple(node.meta.shape), node.meta.dtype, gather_loader(node, args[0], args[1:]),
                      cost=1 + sum(a.cost for a in args))
        elif op == "index_put":
            v = self.index_put(node, args[0], args[1], args[2:])
        elif op in REDUCTION_IDENTITY:
            emitted = len(self.buffers)
            v = _lower_reduction(node, args[0], self.new_name, self.emit)
            parts = _deviation_parts(node, self.env) if len(self.buffers) > emitted else None
            if parts is not None:
                self.buffers[-1].deviation = parts
        elif op in _SCANS:              # an ir.Scan, its producers inlined (lower_scan.py)
            loader, cost, name = lower_scan(node, args[0], self.new_name, self.emit)
            v = Value(tuple(node.meta.shape), node.meta.dtype, loader, buffer=name, cost=cost)
        elif op in FALLBACK_OPS:
            v = self.fallback(node, args)
        else:
            raise NotImplementedError(f"Stax cannot lower op '{op}' (node {node.name})")
        if v.buffer is None:
            inlined = [o for a in args for x in (a if isinstance(a, list) else [a])
                       if isinstance(x, Value) and x.buffer is None for o in x.origins]
            v.origins = list(dict.fromkeys(inlined + [node.name]))
            v.loader = with_origin(v.loader, node.name)     # printers tag its lines with the node
            if v.cost > self.inline_limit:
                v = self.realize(v)
        self.env[node] = v

    def index_put(self, node, x: Value, values: Value, indices) -> Value:
        """index_put: a fresh copy of x (a kernel of its own), then an ir.Scatter writing `values`
        into it at the loaded indices (+= with accumulate): two buffers, one memory."""
        copy = self.new_name()
        layout = Layout(tuple(x.shape), contiguous_strides(x.shape))
        self.emit(Pointwise(copy, x.dtype, list(x.shape), x.loader, layout, list(x.origins) + [node.name]))
        name = self.new_name()
        origins = list(values.origins) if values.buffer is None else []
        self.emit(Scatter(name, x.dtype, list(values.shape), values.loader, layout, origins + [node.name],
                          index_position_fn(node, x.shape, indices),
                          "atomic_add" if node.params["accumulate"] else None, copy))
        return Value(tuple(x.shape), x.dtype, _load_from(name, x.dtype, layout), buffer=name)

    def fallback(self, node, args) -> Value:
        """§6.1: an ExternKernel running the eager implementation on stored inputs."""
        ins = []
        for position, a in enumerate(args):
            if isinstance(a, Value):
                # a view of a buffer is handed over in place (strides, offset); else stored
                view = strided_view(a, self.dtype_of) if a.buffer is None else None
                if view is None and a.buffer is None:
                    a = self._view_of_realized(node.inputs[position]) or a
                    view = strided_view(a, self.dtype_of) if a.buffer is None else None
                wanted = None
                if self.operand_strides is not None:
                    layout = (view.layout if view is not None else
                              self.buffer_layout(a.buffer) if a.buffer is not None else Layout(tuple(a.shape), contiguous_strides(a.shape)))
                    wanted = self.operand_strides(node, position, layout)
                if wanted is not None:
                    ins.append(self.realize(a, Layout(tuple(a.shape), tuple(wanted)), [node.name]).buffer)
                elif view is not None:
                    ins.append(view)
                else:
                    a = self.realize(a)
                    if hasattr(node.inputs[position], "op"):    # later readers (a transposed view
                        self.env[node.inputs[position]] = a     # for the weight's gradient) reuse it
                    ins.append(a.buffer)
            else:
                ins.append(a)
        if node.op == "matmul" and len(node.meta.shape) > len(args[1].shape) == 2:
            ins[1] = self._broadcast_operand(ins[1], tuple(node.meta.shape[:-2]))
        name = self.new_name()
        layout = Layout(tuple(node.meta.shape), contiguous_strides(node.meta.shape))
        self.emit(ExternKernel(name, node.op, ins, dict(node.params), node.meta.dtype, layout, [node.name]))
        return Value(tuple(node.meta.shape), node.meta.dtype,
                     _load_from(name, node.meta.dtype, layout), buffer=name)

    def _broadcast_operand(self, x, batch: tuple) -> ReinterpretView:
        """A matmul's 2-D `b` that every batch of `a` shares (the graph keeps it 2-D so that its
        gradient is one product): the kernel reads it as a stride-0 batched view, as an expand."""
        name, lay = (x.buffer, x.layout) if isinstance(x, ReinterpretView) else (x, self.buffer_layout(x))
        return ReinterpretView(name, Layout(batch + tuple(lay.shape), (0,) * len(batch) + tuple(lay.stride),
                                            lay.offset))

    def _whole_buffer_reshape(self, v: Value, taken: set) -> ReinterpretView | None:
        """v as all of one contiguous computed buffer under another contiguous shape (no copy
        needed to return it), else None."""
        view = strided_view(v, self.dtype_of)
        if view is None or view.buffer in taken or sympy.sympify(view.layout.offset) != 0:
            return None
        buf = next((b for b in self.buffers if b.name == view.buffer), None)
        if buf is None or not hasattr(buf, "layout") or tuple(view.layout.stride) != tuple(contiguous_strides(v.shape)) \
                or tuple(buf.layout.stride) != tuple(contiguous_strides(buf.layout.shape)) \
                or sympy.prod(buf.layout.shape) != sympy.prod(v.shape):
            return None
        return view

    def _view_of_realized(self, x) -> Value | None:
        """A fallback's operand that is a reshape or permute of a computed value: the
        value stored in its own shape, and the view read from it in place. Storing the view's
        shape instead would make a buffer that no longer fuses with its producer (a layer_norm's
        rows read as (B*T, C) by a folded matmul: a second pass over the rows)."""
        chain = []                      # (views that keep every element: the value is not bigger)
        while hasattr(x, "op") and x.op in ("reshape", "permute"):
            if chain and (self.env[x].buffer is not None or strided_view(self.env[x], self.dtype_of) is not None):
                break                   # already a view of a stored value (an earlier operand's)
            chain.append(x)
            x = x.inputs[0]
        if not chain or not hasattr(x, "op"):
            return None
        v = self.env[x]
        if v.buffer is None and strided_view(v, self.dtype_of) is None:
            self.env[x] = v = self.realize(v)
        for n in reversed(chain):       # the views read the stored value: a later operand that is
            v = _lower_view(n, v)       # another view of it (the weight gradient's transpose)
            self.env[n] = v             # reads the same buffer instead of computing it again
        return v

    # step 3: every tensor output is stored in a buffer of its own (inputs and views are copied)
    def store_outputs(self, graph) -> list:
        outputs, seen = [], {}
        input_names = {b.name for b in self.inputs}
        for out in graph.outputs:
            if not hasattr(out, "op"):
                outputs.append(out)
                continue
            v = self.env[out]
            owned = v.buffer is not None and v.buffer not in input_names and v.buffer not in seen
            whole = None if owned or v.buffer is not None else self._whole_buffer_reshape(v, input_names | set(seen))
            if whole is not None:            # a folded matmul's (B*T, N) result returned as (B, T, N)
                seen[whole.buffer] = True
                same = tuple(self.buffer_layout(whole.buffer).shape) == tuple(v.shape)
                outputs.append(whole.buffer if same else whole)
                continue
            if not owned:
                name = self.new_name()
                layout = Layout(tuple(v.shape), contiguous_strides(v.shape))
                self.emit(Pointwise(name, v.dtype, list(v.shape), v.loader, layout,
                                    list(v.origins) or [out.name]))
                v = Value(v.shape, v.dtype, None, buffer=name)
            seen[v.buffer] = True
            outputs.append(v.buffer)
        self.outputs = outputs
        return outputs

    # step 4: write-backs of mutated inputs, each a pointwise buffer stored into the input's memory
    def write_back_mutations(self, graph) -> list:
        """A new value that reads a mutated input anywhere but at the very element being written
        (`x.copy_(x.t())`, `x[1:] = x[:-1]`, or another input's write-back) is first computed into
        a buffer of its own, before any write-back runs: it must see the inputs' old values."""
        mutated = {inp.name for inp, _ in graph.mutations}
        targets = [next(b for b in self.inputs if b.name == inp.name) for inp, _ in graph.mutations]
        values = [self.env[new] for _, new in graph.mutations]
        values = [self.realize(v) if v.buffer is None and _reads_mutated_elsewhere(v, t, mutated) else v
                  for v, t in zip(values, targets)]
        mutations, outputs = [], {output_buffer(o) for o in self.outputs}
        for k, (target, v, (_, new_node)) in enumerate(zip(targets, values, graph.mutations)):
            if v.buffer is not None and scatter_in_place(self.buffers, target, v.buffer, outputs, values[k + 1:]):
                mutations.append((target.name, v.buffer))   # the scatter wrote into the input
                continue
            name = self.new_name()
            self.emit(Pointwise(name, target.dtype, list(target.layout.shape),
                                _convert_loader(v, target.dtype), target.layout,
                                list(v.origins) or [new_node.name]))
            mutations.append((target.name, name))
        return mutations


class _ViewProbe:
    """ops handler: does a value's body do nothing but load one buffer? (then it is a view)"""

    def __init__(self):
        self.loads, self.other = [], False

    def load(self, name, index):
        self.loads.append((name, index))
        return self

    def __getattr__(self, name):
        def op(*args):
            self.other = True
        return op


def strided_view(v: Value, dtype_of) -> ReinterpretView | None:
    """v as a strided view of one buffer (its index affine in the loop variables), else None."""
    idx = index_vars("v", len(v.shape))
    probe = _ViewProbe()
    with set_handler(probe):
        out = v.loader(idx)
    if probe.other or out is not probe or len(probe.loads) != 1:
        return None
    name, index = probe.loads[0]
    if dtype_of(name) is not v.dtype:
        return None
    # (a reshape's floor-divisions and modulos that the ranges undo: (2, 3, 5) read as (6, 5))
    index = sympy.expand(simplify_index(index, dict(zip(idx, v.shape))))
    strides = [index.coeff(i) for i in idx]
    offset = index.subs({i: 0 for i in idx})
    affine = offset + sum((s * i for s, i in zip(strides, idx)), sympy.Integer(0))
    if any(not sympy.sympify(x).is_Integer for x in (*strides, offset)) or sympy.expand(index - affine) != 0:
        return None
    return ReinterpretView(name, Layout(tuple(v.shape), tuple(strides), offset))



def _reads_mutated_elsewhere(v: Value, target: InputBuffer, mutated: set) -> bool:
    """Does computing element i of `target`'s new value read a mutated input at any other element
    than i of `target` itself? Then an in-place write-back could overwrite what it still reads."""
    idx = index_vars("i", len(target.layout.shape))
    ranges = dict(zip(idx, target.layout.shape))
    here = target.layout.index(idx)
    c = LoadCollector()
    with set_handler(c):
        v.loader(idx)
    return any(name in mutated and (name != target.name or simplify_index(index - here, ranges) != 0)
               for name, index in c.loads)


def _convert_loader(v: Value, dtype):
    if compute_dtype(v.dtype) == compute_dtype(dtype):
        return v.loader
    return lambda idx: ops.to_dtype(v.loader(idx), compute_dtype(dtype))


def reads_across_rows(red: Reduction) -> bool:
    """§9.4's OUTER direction: no load of the reduction is contiguous along its innermost reduction
    dim, and some load is contiguous along an output dim (a column sum, `amax` over a middle dim)."""
    xv, rv = index_vars("x", len(red.ranges)), index_vars("r", len(red.reduction_ranges))
    c = IndexCollector()
    with set_handler(c):
        red.inner_fn(xv, rv)
    # a reshape's digits recombined first (`simplify_index`): with symbolic sizes (§10.3) a
    # flattened view's index is still divided into digits here
    ranges = dict(zip(xv + rv, list(red.ranges) + list(red.reduction_ranges)))
    exprs = [simplify_index(e, ranges) for e, name in zip(c.exprs, c.names) if name is not None]
    if not rv or not exprs or any(e.coeff(rv[-1]) == 1 for e in exprs):
        return False
    return any(e.coeff(v) == 1 for e in exprs for v in xv)


def _apply_split_policy(lowered: LoweredGraph, split_policy, new_name, outer_split_policy=None, done=(),
                        hints=None):
    """Alg. 6.1 per reduction (those in `done`, var's pieces, are already split). With symbolic
    sizes (§10.3) the split count is chosen at the hints (`hints`: symbol -> the example's size);
    `split_reduction` keeps it correct at every size."""
    out = []
    for buf in lowered.buffers:
        if isinstance(buf, Reduction) and buf.reduction_type in ("sum", "prod", "amax", "amin") \
                and buf.name not in done:
            outer = outer_split_policy is not None and reads_across_rows(buf)
            numel_out, numel_red = sympy.prod(buf.ranges), sympy.prod(buf.reduction_ranges)
            if hints:
                numel_out, numel_red = sympy.sympify(numel_out).subs(hints), sympy.sympify(numel_red).subs(hints)
            splits = (outer_split_policy if outer else split_policy)(numel_out, numel_red)
            if splits > 1:
                total = sympy.sympify(sympy.prod(buf.ranges) * sympy.prod(buf.reduction_ranges))
                small = lowered.index32 or (total.is_Integer and int(total) < 2 ** 31)
                out.extend(split_reduction(buf, splits, new_name, outer=outer,
                                           index_dtype=int32 if small else int64))
                continue
        out.append(buf)
    lowered.buffers = out
