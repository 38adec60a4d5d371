"""§6 Lowering: from the captured graph to the loop-level IR.

Consumes a `capture.Graph` (op nodes with output metadata) and produces a `LoweredGraph`: a list of
IR buffers in dependence order. Each computed buffer is described *define-by-run*: its body is a
Python function `inner_fn(index)` (pointwise) or `inner_fn(index, rindex)` (reduction) that calls
`ops.load`, `ops.add`, `ops.exp`, ... with sympy index expressions. Nothing is printed here: a code
generator later calls the same `inner_fn` with an `ops` handler that prints C++ or Triton, and the
IR printer calls it with a handler that prints the calls themselves (Listing 6.2's form).

Where to look:
  - `ops` and the handlers' protocol ............. §6 "ops handler" (the virtualized `ops.*` calls)
  - `Pointwise`, `Reduction`, `ExternKernel` ...... the IR node types
  - views as index rewrites ......................... `_lower_view` (permute, expand, slice, select, reshape)
  - broadcasting and dtype promotion ................ `_lower_pointwise`, `_half_rule`
  - writes through views (slice/select_scatter) ..... `_lower_scatter`
  - reductions and their identities ................. `_lower_reduction`, `REDUCTION_IDENTITY`
  - split reductions (§6.5, Alg. 6.1) ............... `split_reduction`
  - fallback kernels (§6.1) ......................... `ExternKernel`, `FALLBACK_OPS`
  - merging contiguous loops (Prop. 6.3) ............ `merge_dims` (both code generators call it)
  - the entry point ................................. `lower(graph, policy)`
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import sympy

T = importlib.import_module(".tensor", __package__)   # the module: `stax.tensor` is the function

# ---- §6 The ops handler: a swappable object that inner_fn bodies call ----


class _Ops:
    """`ops.<name>(...)` forwards to the handler installed by `set_handler`.

    The IR is define-by-run: the same `inner_fn` is run once with an IR-printing handler, once with
    a C++-printing handler, once with a Triton-printing handler, and so on.
    """

    handler = None

    def __getattr__(self, name):
        return getattr(_Ops.handler, name)


ops = _Ops()


class set_handler:
    """Context manager: `with set_handler(h): inner_fn(index)` runs the body against handler `h`."""

    def __init__(self, handler):
        self.handler = handler

    def __enter__(self):
        self.prev, _Ops.handler = _Ops.handler, self.handler
        return self.handler

    def __exit__(self, *exc):
        _Ops.handler = self.prev


# ---- IR data types ----

Expr = sympy.Expr


def index_vars(prefix: str, n: int) -> list[sympy.Symbol]:
    """Loop variables i0, i1, ... (pointwise) or r0_0, r0_1, ... (reduction); all non-negative ints."""
    return [sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True) for k in range(n)]


class FloorDiv(sympy.Function):
    """floor(a / b) in index arithmetic (a >= 0, b > 0); printed as integer division."""
    is_integer = True
    is_nonnegative = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if isinstance(a, sympy.Add) and b.is_Integer:
            # (b*q + r) // b == q + r // b for integer q
            whole = [t for t in a.args if _divisible(t, b)]
            if whole:
                rest = sympy.Add(*[t for t in a.args if not _divisible(t, b)])
                return sympy.Add(*[t / b for t in whole]) + FloorDiv(rest, b)
        if b.is_Integer and _divisible(a, b):
            return a / b
        return None


class ModularIndexing(sympy.Function):
    """(a // d) % m in index arithmetic (a >= 0); printed with integer division and modulo."""
    is_integer = True
    is_nonnegative = True

    @classmethod
    def eval(cls, a, d, m):
        if m == 1 or a == 0:
            return sympy.Integer(0)
        if a.is_Integer and d.is_Integer and m.is_Integer:
            return sympy.Integer((int(a) // int(d)) % int(m))
        if d == 1 and isinstance(a, sympy.Add) and m.is_Integer:
            kept = [t for t in a.args if not _divisible(t, m)]
            if len(kept) < len(a.args):
                return ModularIndexing(sympy.Add(*kept), d, m)
        return None


def _divisible(term, b) -> bool:
    coeff, _ = term.as_coeff_Mul()
    return coeff.is_Integer and b.is_Integer and int(coeff) % int(b) == 0


# ---- §6.8 Interval reasoning over index ranges ----


def index_bounds(expr, ranges: dict):
    """(lo, hi) of an index expression when each loop variable v runs over [0, ranges[v] - 1]."""
    expr = sympy.sympify(expr)
    if expr.is_Number:
        return expr, expr
    if expr.is_Symbol:
        if expr in ranges:
            return sympy.Integer(0), ranges[expr] - 1
        return sympy.Integer(0), sympy.oo
    if isinstance(expr, sympy.Add):
        lo = hi = sympy.Integer(0)
        for t in expr.args:
            a, b = index_bounds(t, ranges)
            lo, hi = lo + a, hi + b
        return lo, hi
    if isinstance(expr, sympy.Mul):
        coeff, rest = expr.as_coeff_Mul()
        if coeff.is_Number and rest is not expr:
            a, b = index_bounds(rest, ranges)
            return (coeff * a, coeff * b) if coeff >= 0 else (coeff * b, coeff * a)
        return -sympy.oo, sympy.oo
    if isinstance(expr, FloorDiv):
        a, b = index_bounds(expr.args[0], ranges)
        return sympy.floor(a / expr.args[1]), sympy.floor(b / expr.args[1])
    if isinstance(expr, ModularIndexing):
        return sympy.Integer(0), expr.args[2] - 1
    return -sympy.oo, sympy.oo


def simplify_index(expr, ranges: dict):
    """Drop floor-divisions and modulos that the loop ranges make trivial (Prop. 6.8's use).

    Example: after a reshape [A*B] -> [A, B] -> [A*B], FloorDiv(B*i0 + i1, B) becomes i0 because
    0 <= i1 < B, and ModularIndexing(i1, 1, B) becomes i1.
    """
    expr = sympy.sympify(expr)

    def visit(e):
        if not e.args:
            return e
        e = e.func(*[visit(a) for a in e.args])
        if isinstance(e, FloorDiv):
            lo, hi = index_bounds(e.args[0], ranges)
            if (lo >= 0) == sympy.true and (hi < e.args[1]) == sympy.true:
                return sympy.Integer(0)
        if isinstance(e, ModularIndexing) and e.args[1] == 1:
            lo, hi = index_bounds(e.args[0], ranges)
            if (lo >= 0) == sympy.true and (hi < e.args[2]) == sympy.true:
                return e.args[0]
        return e
    return sympy.expand(visit(expr))


@dataclass
class Layout:
    """Where a buffer's elements live: element (i0, i1, ...) is at offset + Σ ik·stride[k]."""
    shape: tuple
    stride: tuple
    offset: Expr = sympy.Integer(0)

    def index(self, idx) -> Expr:
        return self.offset + sum((i * s for i, s in zip(idx, self.stride)), sympy.Integer(0))


def contiguous_strides(shape) -> tuple:
    strides, acc = [], sympy.Integer(1)
    for s in reversed(shape):
        strides.append(acc)
        acc = acc * sympy.Max(s, 1) if not isinstance(s, (int, sympy.Integer)) else acc * max(int(s), 1)
    return tuple(reversed(strides))


@dataclass(eq=False)
class InputBuffer:
    """A graph input (or a lifted constant tensor): memory the caller owns."""
    name: str
    dtype: object
    layout: Layout
    origins: list = field(default_factory=list)


@dataclass(eq=False)
class Pointwise:
    """out[index] = inner_fn(index) for every index in `ranges`."""
    name: str
    dtype: object
    ranges: list                    # iteration space (the output shape)
    inner_fn: Callable              # index (list of Expr) -> ops value
    layout: Layout                  # where results are stored (contiguous, or an input's layout when writing back)
    origins: list = field(default_factory=list)   # names of graph nodes computed here


@dataclass(eq=False)
class Reduction:
    """out[index] = reduce_{rindex} inner_fn(index, rindex), with `reduction_type` ∈ REDUCTION_IDENTITY."""
    name: str
    dtype: object                   # dtype of the stored result
    ranges: list                    # kept (output) dimensions
    reduction_ranges: list          # reduced dimensions
    reduction_type: str
    inner_fn: Callable              # (index, rindex) -> ops value (already in the accumulation dtype)
    src_dtype: object               # dtype of the values being reduced (the accumulator's type)
    layout: Layout
    origins: list = field(default_factory=list)


@dataclass(eq=False)
class ExternKernel:
    """§6.1 fallback kernel: an op the compiler does not lower, run by the eager implementation."""
    name: str
    op: str
    inputs: list                    # buffer names (or scalars, or lists of buffer names for 'cat'-like ops)
    params: dict
    dtype: object
    layout: Layout                  # contiguous output; sizes may hold unbacked symbols
    origins: list = field(default_factory=list)


@dataclass(eq=False)
class ReinterpretView:
    """An extern kernel's input read in place: a strided view of a buffer (Inductor's
    ReinterpretView), so that `x @ w.t()` hands the matmul `w` with swapped strides, not a copy."""
    buffer: str
    layout: Layout

    def __repr__(self):
        return f"{self.buffer}.as_strided({self.layout.shape}, {self.layout.stride}, {self.layout.offset})"


@dataclass
class LoweredGraph:
    inputs: list                    # InputBuffer, in call order
    buffers: list                   # Pointwise | Reduction | ExternKernel, in dependence order
    outputs: list                   # buffer name (str) or Python scalar for each graph output
    mutations: list                 # (input name, buffer name): write-backs already folded into buffers
    unbacked: dict                  # symbol -> (extern buffer name, dim) for data-dependent sizes

    def buffer(self, name):
        for b in self.inputs + self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)


# identity of each reduction (§6: a reduction carries its identity; masked lanes are filled with it)
REDUCTION_IDENTITY = {
    "sum": 0, "prod": 1, "amax": float("-inf"), "amin": float("inf"),
    "argmax": float("-inf"), "argmin": float("inf"),
}


def reduction_identity(reduction_type: str, dtype):
    """The identity of a reduction in `dtype`: ±inf has no integer or bool value, so max-like
    reductions over ints start from the type's extreme (bool: False for max, True for min)."""
    ident = REDUCTION_IDENTITY[reduction_type]
    if dtype.is_floating_point or not math.isinf(ident):
        return ident
    if dtype == T.bool_:
        return ident > 0
    bits = 8 * dtype.itemsize - 1
    return 2**bits - 1 if ident > 0 else -2**bits


# ops the lowering leaves to the eager implementation (§6.1); nonzero/unique have data-dependent sizes
FALLBACK_OPS = {"matmul", "cumsum", "nonzero", "unique", "rand", "randn"}

_UNARY = {"neg", "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh",
          "sigmoid", "erf", "relu", "floor", "ceil", "round", "trunc", "sign", "reciprocal",
          "isnan", "isinf", "logical_not", "bitwise_not"}
_BINARY = {"add", "sub", "mul", "div", "floordiv", "remainder", "pow", "maximum", "minimum",
           "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
           "bitwise_and", "bitwise_or", "bitwise_xor"}
_PREDICATES = {"isnan", "isinf", "logical_not", "eq", "ne", "lt", "le", "gt", "ge",
               "logical_and", "logical_or", "logical_xor"}
_FLOAT_ONLY = {"exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tanh", "sigmoid",
               "erf", "reciprocal", "div"}
_VIEWS = {"permute", "expand", "slice", "select", "reshape"}


def compute_dtype(dtype):
    """§6.2: half-precision values are computed in float32."""
    return T.float32 if dtype in (T.float16, T.bfloat16) else dtype


# ---- Values during lowering: a loader (index -> ops value) with a shape and a dtype ----


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


def _scalar_value(x, dtype):
    return Value((), dtype, lambda idx: ops.constant(x, compute_dtype(dtype)))


# ---- Views as index rewriting (never copies) ----


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
            if (po < pn) == sympy.true and i < len(old):
                oi.append(i); po *= old[i]; i += 1
            else:
                nj.append(j); pn *= new[j]; j += 1
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
        return lambda idx: list(idx[:d]) + [sympy.Integer(index)] + list(idx[d:])
    if op == "reshape":
        return _reshape_reindex(in_shape, out_shape)
    raise NotImplementedError(op)


def _lower_view(node, src: Value) -> Value:
    reindex = _view_reindex(node.op, node.params, src.shape, node.meta.shape)
    return Value(tuple(node.meta.shape), src.dtype, lambda idx: src.loader(reindex(idx)),
                 cost=src.cost)


# ---- Pointwise ops: broadcasting and the compute dtype ----


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
        common = T.result_type(*[_as_meta(x) for x in (a, b)])
        cdt = compute_dtype(common)
        ra, rb = _half_rule(a, common), _half_rule(b, common)
        c, a, b = (_operand(cond, T.bool_), _operand(a, cdt), _operand(b, cdt))
        lc, la, lb = (_broadcast_loader(v, out_shape) for v in (c, a, b))
        body = lambda idx: ops.where(lc(idx), _cast(la(idx), a, cdt, ra), _cast(lb(idx), b, cdt, rb))
        return Value(out_shape, out_dtype, body, cost=1 + c.cost + a.cost + b.cost)
    if op == "to_dtype":
        (a,) = args
        src = _operand(a, out_dtype)
        la = _broadcast_loader(src, out_shape)
        target = node.params["dtype"]
        if target in (T.float16, T.bfloat16) and src.dtype != target:
            # a cast the user wrote still rounds (docs/DESIGN.md): round to half, keep computing in float32
            body = lambda idx: ops.to_dtype(ops.to_dtype(la(idx), target), T.float32)
        else:
            body = lambda idx: ops.to_dtype(la(idx), compute_dtype(target))
        return Value(out_shape, out_dtype, body, cost=1 + src.cost)
    if op == "clone":
        return Value(out_shape, out_dtype, _broadcast_loader(args[0], out_shape), cost=args[0].cost)
    # unary and binary: cast every operand to the promoted compute dtype, then apply ops.<op>
    common = T.result_type(*[_as_meta(x) for x in args])
    if op in _FLOAT_ONLY and not common.is_floating_point:
        common = T.float32
    cdt = compute_dtype(common)
    rounds = [_half_rule(x, common) for x in args]
    vals = [_operand(x, cdt) for x in args]
    loaders = [_broadcast_loader(v, out_shape) for v in vals]
    fn = "truediv" if op == "div" else op

    def body(idx):
        return getattr(ops, fn)(*[_cast(l(idx), v, cdt, r) for l, v, r in zip(loaders, vals, rounds)])
    return Value(out_shape, out_dtype, body, cost=1 + sum(v.cost for v in vals))


def _half_rule(x, common):
    """Eager's half-precision rule (tensor.py `_run_eager`): when an op's common dtype is
    float16/bfloat16, a *tensor* operand of another dtype (an int tensor, a float32 0-dim tensor)
    is rounded to that half type before computing; Python scalars are not. Returns the dtype to
    round the operand to, or None."""
    if common in (T.float16, T.bfloat16) and isinstance(x, Value) and x.dtype != common:
        return common
    return None


def _cast(x, v: Value, cdt, round_to=None):
    """Bring an operand's value to the compute dtype `cdt` (rounding through `round_to` first)."""
    if round_to is not None:
        return ops.to_dtype(ops.to_dtype(x, round_to), compute_dtype(round_to))
    return ops.to_dtype(x, cdt) if compute_dtype(v.dtype) != cdt else x


def _as_meta(x):
    """What T.result_type needs of an operand: a data-less tensor with its dtype and rank."""
    if isinstance(x, Value):
        return T.Tensor._proxy(T.Meta(tuple(x.shape), (), x.dtype), None)
    return x


def _lower_factory(node) -> Value:
    p, shape, dtype = node.params, tuple(node.meta.shape), node.meta.dtype
    if node.op == "full":
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
        pos = ops.index_expr(i, T.int64)
        result = ops.constant(0, cdt)
        for k in range(len(parts) - 1, -1, -1):
            inside = ops.ge(pos, ops.index_expr(starts[k], T.int64))
            if k + 1 < len(parts):
                inside = ops.logical_and(inside, ops.lt(pos, ops.index_expr(starts[k + 1], T.int64)))
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

    def const(v):
        return ops.constant(v, T.int64)

    def body(idx):
        i = idx[d]
        pos = ops.index_expr(i, T.int64)
        if node.op == "select_scatter":
            inside = ops.eq(pos, const(p["index"]))
            src_idx = list(idx[:d]) + list(idx[d + 1:])
        else:
            start, end, step = p["start"], p["end"], p["step"]
            inside = ops.logical_and(ops.ge(pos, const(start)), ops.lt(pos, const(end)))
            if step != 1:   # (i - start) % step == 0, written with a non-negative dividend
                phase = ops.index_expr(ModularIndexing(i + (-start) % step, 1, step), T.int64)
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
            return ops.constant(0, T.int64)
        kept_idx = [i for k, i in enumerate(idx) if k not in dims] if keepdim else list(idx)
        full = [sympy.Integer(0)] * len(src.shape)
        for k, i in zip(kept, kept_idx):
            full[k] = i
        v = src.loader(full)
        return _cast(v, src, compute_dtype(out_dtype))
    return Value(tuple(node.meta.shape), out_dtype, body, cost=1 + src.cost)


def split_reduction(red: Reduction, splits: int, new_name) -> list:
    """Alg. 6.1: reduce each row in `splits` pieces (a monoid lets us), then reduce the pieces.

    Returns [first, second]; the first reduction has ranges + [splits] outputs, each reducing a
    contiguous piece of ceil(R / splits) elements of the flattened reduction space (padded with the
    identity beyond R); the second reduces the `splits` partials of each row.
    """
    rnumel = sympy.prod(red.reduction_ranges)
    piece = -(-rnumel // splits)
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
        *x, s = index
        flat = s * piece + rindex[0]
        if piece * splits == rnumel:
            return inner(x, unflatten(flat))
        in_range = ops.lt(ops.index_expr(flat, T.int64), ops.index_expr(rnumel, T.int64))
        return ops.masked(in_range, lambda: inner(x, unflatten(flat)),
                          ops.constant(ident, red.src_dtype))

    name1 = new_name()
    ranges1 = list(red.ranges) + [sympy.Integer(splits)]
    first = Reduction(name1, red.src_dtype, ranges1, [sympy.Integer(piece)], red.reduction_type,
                      first_fn, red.src_dtype, Layout(tuple(ranges1), contiguous_strides(ranges1)),
                      list(red.origins))
    load1 = _load_from(name1, red.src_dtype, first.layout)
    second = Reduction(red.name, red.dtype, list(red.ranges), [sympy.Integer(splits)],
                       red.reduction_type, lambda index, rindex: load1(list(index) + [rindex[0]]),
                       red.src_dtype, red.layout, list(red.origins))
    return [first, second]


# ---- §6 The lowering pass ----


def lower(graph, split_policy=None, inline_limit: int = 64) -> LoweredGraph:
    """Lower every graph node; realize values into buffers where the data flow requires it.

    A pointwise value is inlined into its consumers (it never touches memory) unless it is a graph
    output, an input of a fallback kernel, or too expensive to recompute (`inline_limit` ops).
    `split_policy(numel_out, numel_red) -> splits` is the back end's choice for Alg. 6.1 (1: none).
    """
    buffers, counter = [], [0]
    env: dict = {}          # graph node -> Value (or Python scalar)

    def new_name():
        counter[0] += 1
        return f"buf{counter[0] - 1}"

    def emit(buf):
        buffers.append(buf)

    def dtype_of(name):
        return next(b.dtype for b in inputs + buffers if b.name == name)

    def realize(v: Value) -> Value:
        if v.buffer is not None:
            return v
        name = new_name()
        layout = Layout(tuple(v.shape), contiguous_strides(v.shape))
        emit(Pointwise(name, v.dtype, list(v.shape), v.loader, layout, list(v.origins)))
        return Value(v.shape, v.dtype, _load_from(name, v.dtype, layout), buffer=name)

    inputs = []
    for node in graph.inputs:
        layout = Layout(tuple(node.meta.shape), tuple(node.meta.stride), sympy.Integer(0))
        buf = InputBuffer(node.name, node.meta.dtype, layout, [node.name])
        inputs.append(buf)
        env[node] = Value(tuple(node.meta.shape), node.meta.dtype,
                          _load_from(node.name, node.meta.dtype, layout), buffer=node.name)

    def arg(x):
        if isinstance(x, (list, tuple)):
            return [arg(y) for y in x]
        return env[x] if hasattr(x, "op") else x

    for node in graph.nodes:
        args = [arg(x) for x in node.inputs]
        op = node.op
        if op in _VIEWS:
            v = _lower_view(node, args[0])
        elif op in _UNARY or op in _BINARY or op in ("where", "to_dtype", "clone"):
            v = _lower_pointwise(node, args)
        elif op in ("full", "arange"):
            v = _lower_factory(node)
        elif op == "cat":
            v = _lower_cat(node, args[0])
        elif op in ("slice_scatter", "select_scatter"):
            v = _lower_scatter(node, args[0], args[1])
        elif op in REDUCTION_IDENTITY:
            v = _lower_reduction(node, args[0], new_name, emit)
        elif op in FALLBACK_OPS:
            ins = []
            for a in args:
                if isinstance(a, Value):
                    # a view of a buffer is handed over in place (strides, offset); else stored
                    view = strided_view(a, dtype_of) if a.buffer is None else None
                    ins.append(view if view is not None else realize(a).buffer)
                else:
                    ins.append(a)
            name = new_name()
            layout = Layout(tuple(node.meta.shape), contiguous_strides(node.meta.shape))
            emit(ExternKernel(name, op, ins, dict(node.params), node.meta.dtype, layout, [node.name]))
            v = Value(tuple(node.meta.shape), node.meta.dtype,
                      _load_from(name, node.meta.dtype, layout), buffer=name)
        else:
            raise NotImplementedError(f"Stax cannot lower op '{op}' (node {node.name})")
        if v.buffer is None:
            inlined = [o for a in args for x in (a if isinstance(a, list) else [a])
                       if isinstance(x, Value) and x.buffer is None for o in x.origins]
            v.origins = list(dict.fromkeys(inlined + [node.name]))
            if v.cost > inline_limit:
                v = realize(v)
        env[node] = v

    # outputs: every tensor output is stored in a buffer of its own (inputs and views are copied)
    outputs, seen = [], {}
    for out in graph.outputs:
        if not hasattr(out, "op"):
            outputs.append(out)
            continue
        v = env[out]
        owned = v.buffer is not None and v.buffer not in {b.name for b in inputs} and v.buffer not in seen
        if not owned:
            name = new_name()
            layout = Layout(tuple(v.shape), contiguous_strides(v.shape))
            emit(Pointwise(name, v.dtype, list(v.shape), v.loader, layout, list(v.origins) or [out.name]))
            v = Value(v.shape, v.dtype, None, buffer=name)
        seen[v.buffer] = True
        outputs.append(v.buffer)

    # write-backs of mutated inputs: a pointwise buffer stored straight into the input's memory.
    # A new value that reads a mutated input anywhere but at the very element being written
    # (`x.copy_(x.t())`, `x[1:] = x[:-1]`, or another input's write-back) is first computed into
    # a buffer of its own, before any write-back runs: it must see the inputs' old values.
    mutated = {inp.name for inp, _ in graph.mutations}
    targets = [next(b for b in inputs if b.name == inp.name) for inp, _ in graph.mutations]
    values = [env[new] for _, new in graph.mutations]
    values = [realize(v) if v.buffer is None and _reads_mutated_elsewhere(v, t, mutated) else v
              for v, t in zip(values, targets)]
    mutations = []
    for target, v, (_, new_node) in zip(targets, values, graph.mutations):
        name = new_name()
        emit(Pointwise(name, target.dtype, list(target.layout.shape),
                       _convert_loader(v, target.dtype), target.layout, list(v.origins) or [new_node.name]))
        mutations.append((target.name, name))

    lowered = LoweredGraph(inputs, buffers, outputs, mutations, dict(getattr(graph, "unbacked", {})))
    if split_policy is not None:
        _apply_split_policy(lowered, split_policy, new_name)
    return lowered


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
    index = sympy.expand(sympy.sympify(index))
    strides = [index.coeff(i) for i in idx]
    offset = index.subs({i: 0 for i in idx})
    affine = offset + sum((s * i for s, i in zip(strides, idx)), sympy.Integer(0))
    if any(not sympy.sympify(x).is_Integer for x in (*strides, offset)) or sympy.expand(index - affine) != 0:
        return None
    return ReinterpretView(name, Layout(tuple(v.shape), tuple(strides), offset))


class LoadCollector:
    """An ops handler that only records `ops.load(name, index)` calls (dependences, §7.1)."""

    def __init__(self):
        self.loads = []

    def load(self, name, index):
        self.loads.append((name, index))

    def masked(self, mask, body, other):
        return body()

    def __getattr__(self, name):
        return lambda *args: None


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


def _apply_split_policy(lowered: LoweredGraph, split_policy, new_name):
    out = []
    for buf in lowered.buffers:
        if isinstance(buf, Reduction) and buf.reduction_type in ("sum", "prod", "amax", "amin"):
            splits = split_policy(sympy.prod(buf.ranges), sympy.prod(buf.reduction_ranges))
            if splits > 1:
                out.extend(split_reduction(buf, splits, new_name))
                continue
        out.append(buf)
    lowered.buffers = out


# ---- Printing the IR (STAX_LOGS=ir) ----


class IRPrinter:
    """An ops handler whose values are strings: prints each ops call as `tmpN = ops.name(args)`."""

    def __init__(self):
        self.lines, self.n = [], 0

    def _emit(self, text):
        name = f"tmp{self.n}"
        self.n += 1
        self.lines.append(f"{name} = {text}")
        return name

    def __getattr__(self, name):
        def call(*args):
            return self._emit(f"ops.{name}({', '.join(_fmt(a) for a in args)})")
        return call

    def masked(self, mask, body, other):
        inner = IRPrinter()
        inner.n = self.n + 1
        with set_handler(inner):
            result = body()
        self.n = inner.n
        name = self._emit(f"ops.masked({mask}, <body>, {other})")
        self.lines[-1:-1] = [f"    {line}" for line in inner.lines] + [f"    # masked body returns {result}"]
        return name


def _fmt(a):
    if hasattr(a, "name") and hasattr(a, "itemsize"):
        return f"stax.{a.name}"
    return str(a)


def format_buffer(buf) -> str:
    if isinstance(buf, ExternKernel):
        return f"{buf.name} = ExternKernel({buf.op}, inputs={buf.inputs}, params={buf.params})  # {', '.join(buf.origins)}"
    p = IRPrinter()
    idx = index_vars("i", len(buf.ranges))
    with set_handler(p):
        if isinstance(buf, Pointwise):
            result = buf.inner_fn(idx)
            head = f"{buf.name} = Pointwise(ranges={list(buf.ranges)}, dtype={buf.dtype.name})"
            sig = "def inner_fn(index):"
            unpack = f"    {', '.join(map(str, idx))}{',' if len(idx) == 1 else ''} = index" if idx else ""
        else:
            ridx = index_vars("r0_", len(buf.reduction_ranges))
            result = buf.inner_fn(idx, ridx)
            head = (f"{buf.name} = Reduction({buf.reduction_type}, ranges={list(buf.ranges)}, "
                    f"reduction_ranges={list(buf.reduction_ranges)}, dtype={buf.dtype.name})")
            sig = "def inner_fn(index, rindex):"
            unpack = "\n".join(
                s for s in (f"    {', '.join(map(str, idx))}{',' if len(idx) == 1 else ''} = index" if idx else "",
                            f"    {', '.join(map(str, ridx))}{',' if len(ridx) == 1 else ''} = rindex") if s)
    body = "\n".join(f"    {line}" for line in p.lines)
    parts = [f"{head}  # {', '.join(buf.origins)}", sig]
    if unpack:
        parts.append(unpack)
    parts += [body, f"    return {result}"] if body else [f"    return {result}"]
    return "\n".join(parts)


def format_ir(lowered: LoweredGraph) -> str:
    return "\n\n".join(format_buffer(b) for b in lowered.buffers)


# ---- Prop. 6.3: merging contiguous loop dimensions (used by both code generators) ----


class IndexCollector:
    """ops handler collecting every index expression a body uses (loads and index_expr), with the
    buffer each load reads (None for an index_expr, which touches no memory)."""

    def __init__(self):
        self.exprs, self.names = [], []

    def load(self, name, index):
        self.exprs.append(index)
        self.names.append(name)

    def index_expr(self, expr, dtype):
        self.exprs.append(expr)
        self.names.append(None)

    def masked(self, mask, body, other):
        return body()

    def __getattr__(self, name):
        return lambda *args: None


def merge_dims(sizes, vars_, exprs, ranges):
    """Merge loop dims j, j+1 whenever every index uses them as one (Prop. 6.3).

    Dims j, j+1 merge when each index expression is affine in (v_j, v_{j+1}) with
    coeff(v_j) = size_{j+1}·coeff(v_{j+1}): then c·(size_{j+1}·v_j + v_{j+1}) is c·v for one variable
    v over size_j·size_{j+1}. Returns (sizes, variables, steps): `steps` are substitutions to apply,
    in order, to every (simplified) index expression of the kernel; and the merged expressions.
    """
    sizes, vars_ = list(sizes), list(vars_)
    exprs = [simplify_index(e, ranges) for e in exprs]
    steps = []
    j = len(sizes) - 2
    while j >= 0:
        a, b = vars_[j], vars_[j + 1]
        if all(_mergeable(e, a, b, sizes[j + 1]) for e in exprs):
            step = {a: sympy.Integer(0), b: a}      # a keeps the merged loop's name
            exprs = [sympy.expand(e.subs(step, simultaneous=True)) for e in exprs]
            steps.append(step)
            sizes[j] = sizes[j] * sizes[j + 1]
            del sizes[j + 1], vars_[j + 1]
        j -= 1
    return sizes, vars_, steps, exprs


def _mergeable(e, a, b, size_b) -> bool:
    if not e.has(a) and not e.has(b):
        return True
    for atom in e.atoms(sympy.Function):
        if atom.has(a) or atom.has(b):
            return False
    e = sympy.expand(e)
    ca, cb = e.coeff(a), e.coeff(b)
    if (e - ca * a - cb * b).has(a, b):
        return False                                # not affine in (a, b)
    return sympy.expand(ca - size_b * cb) == 0


# ---- Kernels ----
