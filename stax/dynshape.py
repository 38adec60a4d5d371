"""§10.1-10.2 Symbolic shapes: the shape environment, symbolic sizes, shape guards.

Layer: front end (§10), beside capture.py, which uses it; above tensor.py (its `SymInt` is a
`tensor.SymbolicInt`, which the op functions accept as a scalar) and ir.py (FloorDiv, ModularIndexing). Consumes the sizes of a call's inputs (a
hint each); produces symbols `s0, s1, ...`, symbolic size arithmetic, decisions recorded as
guards (Def. 10.2) and, at the end of a capture, the guard function: generated Python that
reads only the metadata of a call's inputs and says whether an artifact holds for them (§10.4).

A symbol stands for one size >= 2 (sizes 0 and 1 are specialized, as PyTorch 2 does: §10.2's
second approach). A decision about symbols is three-valued (§10.3): `ShapeEnv.evaluate` says
True or False when it holds for every value in the symbols' ranges (monotone bounds of a
polynomial, the interval reasoning of §6.8), else None; `ShapeEnv.decide` then takes it on the
hints and records the guard. By Prop. 10.2 (every variable dim >= 2), two sizes broadcast only
when they are equal, so `size != 1` is decided without a guard.

Where to look:
  - `ShapeEnv.create_symbol` ........ one symbol per input dim; equal hints share one (duck sizing)
  - `ShapeEnv.evaluate` / `decide` .. three-valued evaluation over the ranges; guards on the hint
  - `SymInt` ....................... what `x.shape[0]`, `x.size()`, `numel()` return while tracing
  - `ShapeEnv.guard_source` ......... the guard function's text (STAX_LOGS=guards prints it)
  - `ShapeEnv.add_unbacked`, `SymBool`, `ShapeEnv.assume` .. §10.5 data-dependent sizes u0, u1, ...:
    decided only when their constraints settle it (Prop. 10.4), else an error suggesting
    `stax._check(...)`, which adds the constraint and a run-time check
"""
from __future__ import annotations

import os
import traceback

import sympy

from .tensor import SymbolicInt

UNBOUNDED = None      # the upper end of a symbol's default range [2, inf)


class DataDependentError(RuntimeError):
    """§10.5: a decision about a data-dependent size that its known constraints do not settle."""


def _sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, positive=True)


def _expr(x):
    """The sympy expression of an int or a SymInt."""
    return x.expr if isinstance(x, SymInt) else sympy.sympify(x)


def wrap(expr, env):
    """A size as the user sees it while tracing: an int when it is a number, else a SymInt."""
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else SymInt(expr, env)


def to_sympy(obj):
    """Replace every SymInt inside tuples/lists/dicts by its expression (graph metadata, params)."""
    if isinstance(obj, SymInt):
        return obj.expr
    if isinstance(obj, tuple):
        return tuple(to_sympy(x) for x in obj)
    if isinstance(obj, list):
        return [to_sympy(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_sympy(v) for k, v in obj.items()}
    return obj


# ---- §10.2 The shape environment ----


INDEX32_LIMIT = 2 ** 31             # int32 indices hold every offset below this


class ShapeEnv:
    """Symbols with hints and ranges, the guards recorded while tracing, and where each symbol is
    read at run time (`sources`: symbol -> (input position, dim))."""

    def __init__(self, padding=None):
        self.padding = padding          # "pow2": each symbol's range is its power-of-two bucket
        self.hints: dict = {}           # symbol -> the example's size
        self.ranges: dict = {}          # symbol -> (lo, hi or UNBOUNDED)
        self.sources: dict = {}         # symbol -> (input position, dim): where it is bound
        self.guards: list = []          # sympy relations, each true on the hints (Def. 10.2)
        self.by_hint: dict = {}         # hint -> symbol (duck sizing)
        self.unbacked: dict = {}        # §10.5 data-dependent symbol -> what it counts (no hint)
        self.facts: list = []           # relations stated with stax._check (and u <= N)
        self.replacements: dict = {}    # unbacked symbol -> expression stated equal to it
        self.checks: list = []          # stax._check relations, checked at run time (Prop. 10.4)

    # -- symbols --
    def create_symbol(self, hint: int, source) -> sympy.Expr:
        """A size read from an input: 0 and 1 stay concrete; equal hints share one symbol."""
        if hint < 2:
            return sympy.Integer(hint)
        if hint in self.by_hint:
            return self.by_hint[hint]
        s = _sym(f"s{len(self.hints)}")
        self.hints[s], self.ranges[s], self.sources[s] = hint, self._range_of(hint), source
        self.by_hint[hint] = s
        return s

    def add_unbacked(self, sym, what: str, upper=None):
        """§10.5: a size known only at run time: 0 <= sym (<= upper, an expression, when known)."""
        hi = None
        if upper is not None:
            b = self.bounds(upper)
            hi = int(b[1]) if b is not None and b[1].is_Integer else None
            self.facts.append(sympy.Le(sym, upper))
        self.unbacked[sym], self.ranges[sym] = what, (0, hi)

    def _range_of(self, hint: int) -> tuple:
        """Prop. 10.3 bucketing: with padding "pow2" a size n is served by the artifact of its
        bucket (2^(k-1), 2^k], 2^k = n rounded up to a power of two; the kernels mask (and pad
        reductions with their identity) up to 2^k. Otherwise [2, inf)."""
        if self.padding != "pow2":
            return (2, UNBOUNDED)
        hi = 1 << (hint - 1).bit_length()
        return (max(2, hi // 2 + 1), hi)

    def size_hint(self, expr) -> int:
        e = sympy.sympify(expr).subs(self.hints)
        return int(e)

    # -- §10.3 the index width of the GPU's kernels --
    def index32(self, layouts) -> bool:
        """May Triton kernels compute indices in int32? `layouts`: (shape, stride, offset) of every
        tensor of the graph. True when each one's element count and extent stay below 2^31 on the
        hints: then each such bound the ranges leave open is guarded (Inductor guards the same way),
        and a call past it compiles an int64 version. False when a bound fails on the hints or
        depends on a data-dependent size (the kernels keep int64)."""
        exprs = []
        for shape, stride, offset in layouts:
            shape = [sympy.sympify(v) for v in shape]
            extent = sympy.sympify(offset) + 1
            for size, st in zip(shape, stride):
                st = sympy.sympify(st)
                extent += (size - 1) * (abs(st) if st.is_Integer else st)
            exprs += [sympy.sympify(sympy.prod(shape)), extent]
        rels = []
        for e in exprs:
            if e.free_symbols & set(self.unbacked):
                return False
            rel = sympy.Lt(sympy.expand(e), INDEX32_LIMIT)
            known = self.evaluate(rel)
            if known is False or (known is None and self.size_hint(e) >= INDEX32_LIMIT):
                return False
            if known is None:
                rels.append(rel)
        for rel in dict.fromkeys(rels):
            self.decide(rel)
        return True

    # -- §10.3 three-valued evaluation over the ranges --
    def bounds(self, expr):
        """(lo, hi) of `expr` over the symbols' ranges, or None when it is not a polynomial.
        Symbols are positive, so a monomial grows with each of them: its bounds are its values at
        the ends of the ranges (with the coefficient's sign deciding which end is which)."""
        expr = sympy.expand(sympy.sympify(expr))
        syms = sorted(expr.free_symbols, key=str)
        if not syms:
            return (expr, expr) if expr.is_Number else None
        if any(s not in self.ranges for s in syms) or expr.atoms(sympy.Function):
            return None             # (FloorDiv, ModularIndexing, Max: decided on the hint)
        try:
            poly = sympy.Poly(expr, *syms)
        except sympy.PolynomialError:
            return None
        lo = hi = sympy.Integer(0)
        for powers, coeff in poly.terms():
            low = sympy.Integer(coeff)
            high = sympy.Integer(coeff)
            for s, k in zip(syms, powers):
                a, b = self.ranges[s]
                low *= sympy.Integer(a) ** k
                high *= (sympy.oo if b is UNBOUNDED else sympy.Integer(b)) ** k if k else 1
            if coeff < 0:
                low, high = high, low
            lo, hi = lo + low, hi + high
        return None if sympy.nan in (lo, hi) else (lo, hi)

    def evaluate(self, rel):
        """True / False when `rel` holds / fails for every value in the ranges, else None."""
        rel = sympy.sympify(rel)
        if self.replacements:
            rel = rel.subs(self.replacements)
        if rel in self.facts:
            return True
        if rel not in (sympy.true, sympy.false) and rel.negated in self.facts:
            return False
        if rel in (sympy.true, sympy.false):
            return bool(rel)
        d = sympy.expand(rel.lhs - rel.rhs)
        if d == 0:
            return isinstance(rel, (sympy.Eq, sympy.Le, sympy.Ge))
        b = self.bounds(d)
        if b is None:
            return None
        lo, hi = b
        if isinstance(rel, sympy.Eq):
            return False if (lo > 0 or hi < 0) else None
        if isinstance(rel, sympy.Ne):
            return True if (lo > 0 or hi < 0) else None
        if isinstance(rel, sympy.StrictGreaterThan):
            return True if lo > 0 else False if hi <= 0 else None
        if isinstance(rel, sympy.GreaterThan):
            return True if lo >= 0 else False if hi < 0 else None
        if isinstance(rel, sympy.StrictLessThan):
            return True if hi < 0 else False if lo >= 0 else None
        if isinstance(rel, sympy.LessThan):
            return True if hi <= 0 else False if lo > 0 else None
        return None

    def decide(self, rel) -> bool:
        """A decision the traced code takes: static when the ranges settle it, else on the hints,
        recorded as a guard that holds on them (the path condition)."""
        known = self.evaluate(rel)
        if known is not None:
            return known
        if self.unbacked and rel.free_symbols & set(self.unbacked):
            raise DataDependentError(self.undecidable_message(rel))
        value = bool(rel.subs(self.hints))
        guard = rel if value else rel.negated
        if guard not in self.guards:
            self.guards.append(guard)
        return value

    def specialize(self, expr) -> int:
        """An int was needed (a Python scalar, `range(n)`, an index): the hint, guarded equal."""
        if self.unbacked and sympy.sympify(expr).free_symbols & set(self.unbacked):
            raise DataDependentError(self.undecidable_message(None, expr))
        v = self.size_hint(expr)
        self.decide(sympy.Eq(expr, v))
        return v

    # -- §10.5 Prop. 10.4: no hint, so only what the constraints prove; stax._check adds some --
    def undecidable_message(self, rel, value=None) -> str:
        what = f"`{relation_text(rel)}`" if rel is not None else f"the value of `{pyexpr(value)}`"
        syms = (rel if rel is not None else sympy.sympify(value)).free_symbols & set(self.unbacked)
        known = "; ".join(f"{u} is {self.unbacked[u]}, {self.ranges[u][0]} <= {u}"
                          + (f" <= {self.ranges[u][1]}" if self.ranges[u][1] is not None else "")
                          for u in sorted(syms, key=str))
        hint = f"stax._check({relation_text(rel)})" if rel is not None else "stax._check(...)"
        return (f"cannot decide {what} at {_user_frame()}: it depends on a size computed from the data "
                f"({known}), which has no example value to decide on (§10.5, Prop. 10.4). If it holds "
                f"for every input, state it before this line with {hint} (written with the tensors' "
                "sizes, e.g. stax._check(i.shape[0] == x.shape[0])); it becomes a run-time check")

    def assume(self, rel):
        """`stax._check(rel)`: `rel` holds from here on (a fact; a bound narrows a range, an equality
        replaces the data-dependent symbol) and is checked at run time."""
        known = self.evaluate(rel)
        if known is True:
            return
        if known is False:
            raise RuntimeError(f"stax._check({relation_text(rel)}) fails for every size the program can see")
        self.facts.append(rel)
        self.checks.append(rel)
        bound = linear_bound(rel)
        if bound is not None and bound[0] in self.ranges:
            s, lo, hi = bound
            a, b = self.ranges[s]
            a = a if lo is None else max(a, int(lo))
            b = (hi if b is None else b if hi is None else min(b, int(hi)))
            self.ranges[s] = (a, b)
        elif isinstance(rel, sympy.Eq):
            for u in sorted(rel.free_symbols & set(self.unbacked), key=str):
                sol = sympy.solve(rel, u)
                if len(sol) == 1 and sol[0].is_integer is not False and u not in sol[0].free_symbols:
                    self.replacements[u] = sol[0]
                    break

    # -- §10.4 the guard function --
    def guard_source(self, layouts, name="guard") -> str:
        """`def guard(inputs)`: true when a call's tensors fit this artifact. `layouts` holds,
        per input position, (shape, stride) as expressions (ints where specialized)."""
        lines = [f"def {name}(inputs):"]
        bound = {}
        for s, (pos, dim) in sorted(self.sources.items(), key=lambda kv: str(kv[0])):
            bound[s] = f"inputs[{pos}]._meta.shape[{dim}]"
        for pos, (shape, stride) in enumerate(layouts):
            lines.append(f"    m{pos} = inputs[{pos}]._meta")
            lines.append(f"    if len(m{pos}.shape) != {len(shape)}: return False")
        for s in sorted(self.sources, key=str):
            pos, dim = self.sources[s]
            lo, hi = self.ranges[s]
            lines.append(f"    {s} = m{pos}.shape[{dim}]")
            lines.append(f"    if {s} < {lo}: return False")
            if hi is not UNBOUNDED:
                lines.append(f"    if {s} > {hi}: return False")
        for pos, (shape, stride) in enumerate(layouts):
            for what, items in (("shape", shape), ("stride", stride)):
                for d, e in enumerate(items):
                    e = sympy.sympify(e)
                    if e.is_Symbol and self.sources.get(e) == (pos, d) and what == "shape":
                        continue
                    lines.append(f"    if m{pos}.{what}[{d}] != {pyexpr(e)}: return False")
        for g in self.guards:
            lines.append(f"    if not ({pyexpr(g)}): return False")
        lines.append("    return True")
        return "\n".join(lines) + "\n"


def _user_frame() -> str:
    """The innermost stack frame outside the stax package: where the user's code decided."""
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(here):
            return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"
    return "<unknown>"


REL_OPS = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Gt: ">", sympy.Ge: ">=", sympy.Lt: "<", sympy.Le: "<="}


def relation_text(rel) -> str:
    """`n > 32`, `u0 == s0`: a relation as the user would write it."""
    return f"{pyexpr(rel.lhs)} {REL_OPS[type(rel)]} {pyexpr(rel.rhs)}"


def linear_bound(rel):
    """(symbol, lo, hi) when `rel` is a linear bound (or a value) on one symbol, else None; lo or hi
    is None where the relation leaves that end open (an empty range when lo > hi)."""
    import math
    if not isinstance(rel, (sympy.Eq, sympy.Gt, sympy.Ge, sympy.Lt, sympy.Le)):
        return None
    d = sympy.expand(rel.lhs - rel.rhs)
    if len(d.free_symbols) != 1:
        return None
    (s,) = d.free_symbols
    a, b = d.coeff(s, 1), d.subs(s, 0)
    if not (a.is_Number and b.is_Number and a != 0 and sympy.expand(a * s + b - d) == 0):
        return None
    t = -b / a                                   # the relation is `s R t`, R flipped when a < 0
    kind = type(rel)
    if a < 0:
        kind = {sympy.Gt: sympy.Lt, sympy.Lt: sympy.Gt, sympy.Ge: sympy.Le, sympy.Le: sympy.Ge}.get(kind, kind)
    if kind is sympy.Eq:
        return (s, t, t) if t.is_Integer else (s, 1, 0)
    return {sympy.Gt: (s, math.floor(t) + 1, None), sympy.Ge: (s, math.ceil(t), None),
            sympy.Lt: (s, None, math.ceil(t) - 1), sympy.Le: (s, None, math.floor(t))}[kind]


def pyexpr(e) -> str:
    """A sympy size expression (or relation) as Python text over the symbols' names."""
    from sympy.printing.pycode import PythonCodePrinter

    class _P(PythonCodePrinter):
        def _operand(self, x):          # (`a // 2*s1` would divide by 2, then multiply)
            text = self._print(x)
            return text if text.isidentifier() or text.isdigit() else f"({text})"

        def _print_FloorDiv(self, expr):
            return f"({self._operand(expr.args[0])} // {self._operand(expr.args[1])})"

        def _print_ModularIndexing(self, expr):
            a, d, m = (self._operand(x) for x in expr.args)
            return f"(({a} // {d}) % {m})"

        def _print_floor(self, expr):
            a = expr.args[0]
            n, dd = a.as_numer_denom()
            return f"(({self._print(n)}) // ({self._print(dd)}))"
    return _P().doprint(sympy.sympify(e))


# ---- §10.2 What traced code sees: a size that is an expression ----


class SymBool:
    """§10.5: a comparison of data-dependent sizes that their constraints do not settle. Using it
    as a bool raises DataDependentError; `stax._check(it)` states it (`assume`) instead."""
    __slots__ = ("rel", "env")

    def __init__(self, rel, env: ShapeEnv):
        self.rel, self.env = rel, env

    def __bool__(self):
        raise DataDependentError(self.env.undecidable_message(self.rel))

    def assume(self):
        self.env.assume(self.rel)

    def __repr__(self):
        return relation_text(self.rel)


def _decision(env, rel):
    """A comparison's value: a bool (decided, maybe under a guard), or a SymBool for an undecidable
    decision about data-dependent sizes (an error unless it goes to stax._check)."""
    if env.unbacked and rel.free_symbols & set(env.unbacked) and env.evaluate(rel) is None:
        return SymBool(rel, env)
    return env.decide(rel)


def _cmp(op):
    def method(self, other):
        if not isinstance(other, (int, SymInt)) or isinstance(other, bool):
            if isinstance(other, float):
                return _decision(self.env, op(self.expr, sympy.Float(other)))
            return NotImplemented
        return _decision(self.env, op(self.expr, _expr(other)))
    return method


def _arith(fn, reverse=False):
    def method(self, other):
        if isinstance(other, bool) or not isinstance(other, (int, SymInt)):
            if isinstance(other, float):     # a float result needs a number: specialize
                a, b = float(int(self)), other
                return fn(b, a) if reverse else fn(a, b)
            return NotImplemented
        a, b = self.expr, _expr(other)
        return wrap(fn(b, a) if reverse else fn(a, b), self.env)
    return method


def _floordiv(a, b):
    from .ir import FloorDiv
    q = sympy.cancel(a / b)
    if sympy.fraction(q)[1] == 1 and q.is_integer is not False:
        return q
    return FloorDiv(a, b)


def _mod(a, b):
    from .ir import ModularIndexing
    q = sympy.cancel(a / b)
    if sympy.fraction(q)[1] == 1:
        return sympy.Integer(0)
    return ModularIndexing(a, 1, b)


class SymInt(SymbolicInt):
    """A size while tracing in dynamic mode (PyTorch's SymInt): a sympy expression over the shape
    environment's symbols. Arithmetic stays symbolic; a comparison is a decision (`decide`);
    `int()` / `operator.index()` specialize the size to its hint under a guard."""
    __slots__ = ("expr", "env")

    def __init__(self, expr, env: ShapeEnv):
        self.expr, self.env = expr, env

    __add__, __radd__ = _arith(lambda a, b: a + b), _arith(lambda a, b: a + b, True)
    __sub__, __rsub__ = _arith(lambda a, b: a - b), _arith(lambda a, b: a - b, True)
    __mul__, __rmul__ = _arith(lambda a, b: a * b), _arith(lambda a, b: a * b, True)
    __floordiv__, __rfloordiv__ = _arith(lambda a, b: _floordiv(a, b)), _arith(lambda a, b: _floordiv(a, b), True)
    __mod__, __rmod__ = _arith(lambda a, b: _mod(a, b)), _arith(lambda a, b: _mod(a, b), True)
    __eq__, __ne__ = _cmp(sympy.Eq), _cmp(sympy.Ne)
    __lt__, __le__ = _cmp(sympy.Lt), _cmp(sympy.Le)
    __gt__, __ge__ = _cmp(sympy.Gt), _cmp(sympy.Ge)

    def __truediv__(self, other):
        return int(self) / other

    def __rtruediv__(self, other):
        return other / int(self)

    def __neg__(self):
        return wrap(-self.expr, self.env)

    def __pos__(self):
        return self

    def __abs__(self):
        return self if self >= 0 else -self

    def __bool__(self):
        return bool(self != 0)

    def __int__(self):
        return self.env.specialize(self.expr)

    __index__ = __int__

    def __float__(self):
        return float(int(self))

    # text and powers need the number: specialized (guarded), never the symbol's name
    def __str__(self):
        return str(int(self))

    def __format__(self, spec):
        return format(int(self), spec)

    def __pow__(self, other):
        return int(self) ** other

    def __rpow__(self, other):
        return other ** int(self)

    def __hash__(self):
        return hash(self.expr)

    def __repr__(self):
        return str(self.expr)

    @property
    def hint(self) -> int:
        return self.env.size_hint(self.expr)
