"""§6 The loop-level IR: index expressions, IR nodes, the ops handler, and what reads them.

Layer: above dtypes.py (and sympy), below lower.py, which builds this IR, and schedule.py and the
code generators (codegen_cpp.py, codegen_triton.py, triton_reduction.py), which read it. It imports
nothing else of Stax.

A computed buffer is described *define-by-run*: its body is a Python function `inner_fn(index)`
(Pointwise) or `inner_fn(index, rindex)` (Reduction) that calls `ops.load`, `ops.add`, `ops.exp`,
... with sympy index expressions. Nothing in the IR is text: whoever wants something from a body
installs an ops handler with `set_handler` and runs it. The IR printer (`format_ir`) prints the calls
(Listing 6.2's form); `LoadCollector` and `IndexCollector` only record what a body reads; the code
generators print C++ or Triton. Which `ops.<name>` exist is op_table.OPS (`OpDef.ops_name`), plus
load, constant, index_expr, to_dtype, where, masked and indirect_indexing.

Where to look:
  - `ops`, `set_handler` .................... the virtualized `ops.*` calls and swapping handlers
  - `index_vars`, `FloorDiv`, `ModularIndexing` index expressions (loop variables, //, %)
  - `ops.indirect_indexing`, `indirect_symbol` a loaded integer as an index (gathers, scatters)
  - `index_bounds`, `simplify_index` ........ §6.8 interval reasoning over loop ranges
  - `Layout`, `InputBuffer`, `Pointwise`, `Scatter`, `Reduction`, `Scan`, `ExternKernel`,
    `ReinterpretView`, `LoweredGraph` ........ the IR nodes and the lowered graph
  - `SCAN_COMBINE`, `scan_identity` ......... a scan's combine (cumsum, cumprod, logcumsumexp) and start
  - `reduction_identity`, `compute_dtype` ... a reduction's identity per dtype; §6.2 half compute
  - `LoadCollector`, `IndexCollector` ....... handlers recording loads / every index (§7.1, Prop. 6.3)
  - `format_buffer`, `format_ir` ............ the IR printer (STAX_LOGS=ir)
  - `merge_dims` ............................ Prop. 6.3: merging contiguous loop dimensions
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
import threading
from typing import Callable

import sympy

from .dtypes import bfloat16, bool_, float16, float32

# ---- §6 The ops handler: a swappable object that inner_fn bodies call ----


class _Handler(threading.local):
    """The installed handler, one per thread: threads lowering and printing at once (several
    functions compiled concurrently) each run their own `inner_fn`s against their own handler.
    `origin` is the graph node whose body is running (`with_origin`), so that a printer can say
    which node each line it prints comes from (the report highlights them)."""
    handler = None
    origin = None


_current = _Handler()


class _Ops:
    """`ops.<name>(...)` forwards to the handler installed by `set_handler` (in this thread).

    The IR is define-by-run: the same `inner_fn` is run once with an IR-printing handler, once with
    a C++-printing handler, once with a Triton-printing handler, and so on.
    """

    def __getattr__(self, name):
        return getattr(_current.handler, name)

    def indirect_indexing(self, value, size, check=True, wrap_neg=True, where=""):
        """§6 indirect indexing (Inductor's name): a loaded integer `value` as an index symbol.

        The symbol may appear in any index expression of the body (`ops.load(x, 64*ind + i1)`).
        A code generator binds it to the kernel variable holding the value, wrapped by `size` when
        negative (`wrap_neg`, as eager) and checked against [0, size) (`check`); `where` is the
        error message, with `{}` for the index and the size ("index_select(): index {} is out of
        bounds for dimension 0 with size {}"). A handler
        that only records loads or indices (no method of its own) gets a fresh symbol `indN`:
        an index the loop variables do not determine, so no analysis mistakes it for one."""
        h = _current.handler
        if getattr(type(h), "indirect_indexing", None) is not None:
            return h.indirect_indexing(value, size, check, wrap_neg, where)
        n = h.__dict__.get("_indirect_count", 0)
        h.__dict__["_indirect_count"] = n + 1
        return indirect_symbol(f"ind{n}")


ops = _Ops()


def current_origin():
    """The graph node whose body is being run in this thread (None outside any)."""
    return _current.origin


def with_origin(loader, node_name: str):
    """`loader` that marks the ops it runs as coming from graph node `node_name` (the ops of
    values inlined into it keep their own node: each loader sets and restores the mark)."""
    def load(*index):
        outer, _current.origin = _current.origin, node_name
        try:
            return loader(*index)
        finally:
            _current.origin = outer
    return load


class set_handler:
    """Context manager: `with set_handler(h): inner_fn(index)` runs the body against handler `h`."""

    def __init__(self, handler):
        self.handler = handler

    def __enter__(self):
        self.prev, _current.handler = _current.handler, self.handler
        return self.handler

    def __exit__(self, *exc):
        _current.handler = self.prev


# ---- §6 Index expressions ----

Expr = sympy.Expr


def index_vars(prefix: str, n: int) -> list[sympy.Symbol]:
    """Loop variables i0, i1, ... (pointwise) or r0_0, r0_1, ... (reduction); all non-negative ints."""
    return [sympy.Symbol(f"{prefix}{k}", integer=True, nonnegative=True) for k in range(n)]


def indirect_symbol(name: str) -> sympy.Symbol:
    """An index bound to a loaded value (ops.indirect_indexing): non-negative once wrapped."""
    return sympy.Symbol(name, integer=True, nonnegative=True)


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


def upper_bound(expr, bounds: dict):
    """§10.3: the largest value of a size expression over its symbols' ranges (`bounds`: symbol ->
    upper end), or None when a symbol is unbounded. A polynomial with nonnegative coefficients is
    non-decreasing in each symbol, so the upper ends give its maximum."""
    expr = sympy.expand(sympy.sympify(expr))
    if expr.is_Integer:
        return int(expr)
    if not expr.free_symbols <= set(bounds) or expr.atoms(sympy.Function):
        return None
    try:
        poly = sympy.Poly(expr, *sorted(expr.free_symbols, key=str))
    except sympy.PolynomialError:
        return None
    if any(c < 0 for c in poly.coeffs()):
        return None
    return int(expr.subs(bounds))


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
    return _recombine_digits(sympy.expand(visit(expr)))


def _factor_of(term, cls):
    """(coefficient, the one `cls` factor of `term`), or (None, None)."""
    if isinstance(term, cls):
        return sympy.Integer(1), term
    if isinstance(term, sympy.Mul):
        found = [f for f in term.args if isinstance(f, cls)]
        if len(found) == 1:
            return sympy.Mul(*[f for f in term.args if f is not found[0]]), found[0]
    return None, None


def _recombine_digits(expr):
    """k*(y % m) + k*m*(y // m) = k*y. A reshape unflattens an index into digits and a contiguous
    buffer's strides put them back; with integer sizes the range rule above removes the digits,
    with symbolic ones (§10.3) only this identity does (else every load divides)."""
    while isinstance(expr, sympy.Add):
        terms = list(expr.args)
        hit = None
        for i, t in enumerate(terms):
            k, mod = _factor_of(t, ModularIndexing)
            if mod is None or mod.args[1] != 1:
                continue
            y, m = mod.args[0], mod.args[2]
            for j, u in enumerate(terms):
                c, div = _factor_of(u, FloorDiv)
                if j != i and div is not None and div.args == (y, m) and sympy.expand(c - k * m) == 0:
                    hit = (i, j, k * y)
                    break
            if hit:
                break
        if hit is None:
            return expr
        i, j, merged = hit
        expr = sympy.expand(sympy.Add(*[t for n, t in enumerate(terms) if n not in (i, j)], merged))
    return expr


# ---- §6 The IR nodes ----


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
        # a symbolic size (§10) multiplies in as it is: where it is 0 there is no element to index,
        # so the strides do not matter (and a Max would reach the kernels' index printers)
        acc = acc * s if not isinstance(s, (int, sympy.Integer)) else acc * max(int(s), 1)
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
class Scatter(Pointwise):
    """§6 a write through loaded indices (index_put, scatter, index_add): for every index in
    `ranges`, target[output_indexer(index)] = inner_fn(index) (`mode` "atomic_add": +=).

    `output_indexer(index)` returns the position in `layout` (it may call ops.indirect_indexing,
    so it runs under the code generator's handler, after `inner_fn`). The memory written is the
    buffer `target`, a fresh copy of the tensor written into, computed in an earlier kernel; `name`
    names the result, which readers load (the wrapper binds it to `target`'s memory)."""
    output_indexer: Callable = None
    mode: str | None = None
    target: str = ""


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
    # var's second reduction sum_r (v - c)^2 knows its parts: (v(index, rindex), c(index)), so that
    # lowering can reduce it in pieces read once (lower.chunk_deviations, Chan's combine)
    deviation: tuple | None = None


@dataclass(eq=False)
class Scan(Reduction):
    """§6 an inclusive scan along one dim (Inductor's `ops.scan(dtypes, combine_fn, values)`, with
    Stax's combines named): out[index, r] = combine_{r' <= r} inner_fn(index, r'), `reduction_type`
    ∈ SCAN_COMBINE, `reduction_ranges` the one scanned dim, `ranges` the others in order.

    Unlike a Reduction it stores one value per element: `layout` is the whole output's, and
    `full_index(index, rindex)` puts the scanned dim (`dim`) back among the others to name the
    element. The combine is associative, so any bracketing computes the same prefix (the C++ kernel
    folds in index order, as eager does; Triton's associative_scan folds a tree)."""
    dim: int = 0

    def full_index(self, index, rindex) -> list:
        return list(index[:self.dim]) + list(rindex) + list(index[self.dim:])


# a scan's combine, by op: its identity (a reduction's name: that reduction's) (the running value before the first element; -0.0 for a
# float sum: -0.0 + x is x for every x, so the first element is copied bit for bit)
SCAN_COMBINE = {"cumsum": 0, "cumprod": 1, "logcumsumexp": float("-inf"), "cummax": "amax", "cummin": "amin"}


def scan_identity(scan_type: str, dtype):
    ident = SCAN_COMBINE[scan_type]
    if isinstance(ident, str):           # max / min: the reduction's identity in this dtype
        return reduction_identity(ident, dtype)
    if scan_type == "cumsum" and dtype.is_floating_point:
        return -0.0
    return ident


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


def output_buffer(o):
    """The buffer a lowered graph's output names: its name, the buffer under a ReinterpretView
    (a whole buffer returned under another shape), or None (a Python scalar)."""
    if isinstance(o, str):
        return o
    return o.buffer if isinstance(o, ReinterpretView) else None


@dataclass
class LoweredGraph:
    inputs: list                    # InputBuffer, in call order
    buffers: list                   # Pointwise | Reduction | ExternKernel, in dependence order
    outputs: list                   # buffer name (str), ReinterpretView (a whole buffer reshaped) or scalar
    mutations: list                 # (input name, buffer name): write-backs already folded into buffers
    unbacked: dict                  # symbol -> (extern buffer name, dim) for data-dependent sizes
    checks: list = field(default_factory=list)  # §10.5 stax._check relations over them (run time)
    bounds: dict = field(default_factory=dict)  # size symbol -> the upper end of its range (§10.3)
    hints: dict = field(default_factory=dict)   # size symbol -> the example's size (choices made at it)
    scalars: list = field(default_factory=list)  # run-time float arguments (`double` parameters, §10.4)
    index32: bool = False                       # §10.3: every tensor below 2^31 elements, guarded

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
    if dtype == bool_:
        return ident > 0
    if dtype.kind == "u":
        return 2 ** (8 * dtype.itemsize) - 1 if ident > 0 else 0
    bits = 8 * dtype.itemsize - 1
    return 2**bits - 1 if ident > 0 else -2**bits


def compute_dtype(dtype):
    """§6.2: half-precision values are computed in float32."""
    return float32 if dtype in (float16, bfloat16) else dtype


# ---- §6/§7.1 A handler that only records loads (dependences) ----


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


# ---- §6 Printing the IR (STAX_LOGS=ir, Listing 6.2's form) ----


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

    def indirect_indexing(self, value, size, check=True, wrap_neg=True, where=""):
        name = f"ind{self.n}"
        self.n += 1
        self.lines.append(f"{name} = ops.indirect_indexing({value}, {size})")
        return indirect_symbol(name)

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
            if isinstance(buf, Scatter):    # where it writes: through the indices it loads
                where = buf.layout.index(buf.output_indexer(idx))
                head = (f"{buf.name} = Scatter(ranges={list(buf.ranges)}, dtype={buf.dtype.name}, "
                        f"into={buf.target}[{where}], mode={buf.mode})")
            sig = "def inner_fn(index):"
            unpack = f"    {', '.join(map(str, idx))}{',' if len(idx) == 1 else ''} = index" if idx else ""
        else:
            ridx = index_vars("r0_", len(buf.reduction_ranges))
            result = buf.inner_fn(idx, ridx)
            head = (f"{buf.name} = {type(buf).__name__}({buf.reduction_type}, ranges={list(buf.ranges)}, "
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


# ---- §6 Prop. 6.3: merging contiguous loop dimensions (both code generators use it) ----


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
