"""The printer skeleton both code generators share: an `ops` handler that prints code.

Layer: the back ends' base, under codegen_cpp.py (§8) and triton_kernel.py (§9); above the IR
(ir.py) and the op table (op_table.py). Chapter: §6's define-by-run idea seen from the other side —
lowering records each op as a call `ops.add(a, b)` inside an `inner_fn`; a code generator calls the
same `inner_fn` with a *printer* installed as `ops`, and every call prints one line of code and
returns the variable that holds its result.

It consumes `ops.*` calls (from `inner_fn` bodies, under `ir.set_handler(printer)`) and produces
lines of code (`printer.lines`) plus `Var`s naming their results. What is the same in C++ and
Triton lives here; a subclass holds only what differs:

  - `LANGUAGE`, the `OpDef` field with this language's spellings ("cpp" or "triton");
  - `new_name()` (where temporaries are numbered) and `assignment(name, expr)` (the line's syntax);
  - methods for the few ops whose form is special in that language (load, constant, pow, ...).

Where to look:
  - the value a printed op returns ......... Var
  - common subexpressions .................. Printer.emit (one line per distinct expression)
  - ops spelled from the table ............. Printer.__getattr__ (unary `fn(x)`, binary `(a op b)`)
  - index expressions (sympy) as text ...... IndexPrinter (C++ and Triton override a few forms)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import sympy

from .dtypes import bool_
from .ir import FloorDiv, ModularIndexing, current_origin
from .op_table import BY_HANDLER

# ---- The value of a printed op ----


@dataclass
class Var:
    """A temporary of the printed kernel (`tmp3`), or a literal, with the dtype it holds."""
    name: str
    dtype: object

    def __str__(self):
        return self.name


# ---- The skeleton ----


_collected = threading.local()


def collect_printers(on: bool) -> list:
    """Start (on=True) or stop keeping every Printer made in this thread; returns those kept so
    far and starts a new list. The report matches them to kernels to map lines to graph nodes."""
    kept = getattr(_collected, "printers", None) or []
    _collected.printers = [] if on else None
    return kept


class Printer:
    """ops handler base: `emit` deduplicates expressions; the op table spells generic ops."""

    LANGUAGE = ""           # the OpDef field holding this printer's spellings: "cpp" or "triton"

    def __init__(self):
        self.lines, self.cse = [], {}
        self.origin_of = {}             # variable name -> graph node it computes (ir.with_origin)
        collecting = getattr(_collected, "printers", None)
        if collecting is not None:      # a report is being made: keep this printer for it
            collecting.append(self)

    def new_name(self) -> str:
        raise NotImplementedError

    def assignment(self, name: str, expr: str) -> str:
        raise NotImplementedError

    def emit(self, expr: str, dtype) -> Var:
        """The variable holding `expr`: a new line the first time, the same variable after (CSE)."""
        if expr in self.cse:
            return self.cse[expr]
        var = Var(self.new_name(), dtype)
        self.lines.append(self.assignment(var.name, expr))
        self.cse[expr] = var
        self.origin_of[var.name] = current_origin()
        return var

    def _logical(self, op, a, b):
        """logical_and/or/xor test each side for nonzero first: the spellings are bitwise in Triton
        (`&` is undefined on floats, `2 & 1` is 0) and `!=` in C++ (`true != 2.0` holds)."""
        a, b = (x if x.dtype == bool_ else self.emit(f"({x} != 0)", bool_) for x in (a, b))
        return self.emit(f"({a} {getattr(BY_HANDLER[op], self.LANGUAGE)} {b})", bool_)

    def logical_and(self, a, b):
        return self._logical("logical_and", a, b)

    def logical_or(self, a, b):
        return self._logical("logical_or", a, b)

    def logical_xor(self, a, b):
        return self._logical("logical_xor", a, b)

    def __getattr__(self, op):
        """`ops.exp(x)` → `fn(x)`, `ops.add(a, b)` → `(a + b)`, spelled from the op table.

        Only reached for names the subclass does not define; an op without a spelling in this
        language (and without a method) is an error that names it."""
        d = BY_HANDLER.get(op)
        spelling = getattr(d, self.LANGUAGE, None) if d is not None else None
        if spelling is None:
            raise AttributeError(f"the {self.LANGUAGE or 'base'} printer has no ops.{op}")
        if d.kind == "unary":
            return lambda x: self.emit(f"{spelling}({x})", x.dtype)
        result = bool_ if d.dtype == "bool" else None
        if spelling[0].isalpha():       # a function (std::atan2, libdevice.fmod): a call
            return lambda a, b: self.emit(f"{spelling}({a}, {b})", result or a.dtype)
        return lambda a, b: self.emit(f"({a} {spelling} {b})", result or a.dtype)


# ---- Index expressions ----


class IndexPrinter:
    """A sympy index expression as text in the kernel's language (`128*x0 + r0_1`).

    Integers, symbols, products and floor division print alike in C++ and Triton; a subclass
    says how sums are ordered and signed, how ModularIndexing reads, and what else it can print."""

    FLOORDIV = "/"

    def expr(self, e) -> str:
        e = sympy.sympify(e)
        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            return e.name
        if isinstance(e, sympy.Add):
            return self.add(e)
        if isinstance(e, sympy.Mul):
            return self.mul(e)
        if isinstance(e, FloorDiv):
            return f"({self.expr(e.args[0])}) {self.FLOORDIV} {self.paren(e.args[1])}"
        if isinstance(e, ModularIndexing):
            return self.modular(*e.args)
        return self.other(e)

    def paren(self, e) -> str:
        s = self.expr(e)
        return s if sympy.sympify(e).is_Atom else f"({s})"

    def mul(self, e) -> str:
        coeff, rest = e.as_coeff_Mul()
        inner = "*".join(self.paren(a) for a in sympy.Mul.make_args(rest))
        return inner if coeff == 1 else f"{int(coeff)}*{inner}"

    def add(self, e) -> str:
        raise NotImplementedError

    def modular(self, a, d, m) -> str:
        raise NotImplementedError

    def other(self, e) -> str:
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:   # s0**2 (§10: a square's size)
            return "*".join([self.paren(e.base)] * int(e.exp))
        raise NotImplementedError(f"cannot print index {e}")
