"""§8 The C++ kernel writer: C types and literals, the ops handler that prints C++, a kernel's state.

Layer: back end (CPU), below `codegen_cpp` (which prints the kernel forms, the wrapper and the
module from these pieces). Imports the IR (`ir`), the printer skeleton (`printer`) and the shared
wrapper pieces (`wrapper`); nothing above it.

Consumes IR buffers and a fusion group; produces C++ text: expressions (`CppPrinter`, an `ops`
handler whose values are temporaries `tmpN`), index expressions (`cexpr`), and the loop headers and
merged loop nests (Prop. 6.3) every kernel form starts from. Mirrors `triton_kernel.py` for the GPU.

Where to look:
  - `ctype`, `cliteral`, `CppIndexPrinter`  C types, literals, index expressions (`cexpr`)
  - `CppPrinter` ......................... ops.* -> C++ expressions (NaN-propagating max, half casts)
  - `CppKernel` .......................... a kernel being printed: its buffers, loads, stores, indices
  - `loop_nest` .......................... Prop. 6.3's merged loops (`ir.merge_dims`), named for printing
"""
from __future__ import annotations

import math
import operator
import re

import sympy

from .cache import storage_ctype
from .dtypes import bfloat16, bool_, float16, float32, float64, int64
from .ir import Reduction, Scatter, compute_dtype, indirect_symbol, index_vars, merge_dims, set_handler, simplify_index
from .schedule import all_indices, node_index, store_index
from .printer import IndexPrinter, Printer, Var
from .wrapper import scalars_in


# errors a kernel reports through its error word (checked by the wrapper after the call)
KERNEL_ERRORS = {"floordiv": (1, 'RuntimeError("ZeroDivisionError")'),
                 "remainder": (1, 'RuntimeError("ZeroDivisionError")'),
                 "pow": (2, 'ValueError("Integers to negative integer powers are not allowed.")')}


# ---- §8 C types, literals and index expressions ----

_CTYPE = {"float32": "float", "float64": "double", "float16": "float", "bfloat16": "float",
          "int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
          "bool": "bool"}
_NARROW = ("int8", "uint8", "int16")   # C++ computes these in int: each result is cast back (wraps)


def ctype(dtype) -> str:
    """The C++ type a kernel computes in (half types are computed as float)."""
    return _CTYPE[dtype.name]


def cliteral(value, dtype) -> str:
    if dtype == bool_:
        return "true" if value else "false"
    if not dtype.is_floating_point:
        v = operator.index(int(value))     # the exact int: an int subclass never prints itself
        if v == -2**63:     # the literal 9223372036854775808 does not fit: write INT64_MIN as C++ does
            return "(-9223372036854775807LL - 1)"
        return f"{v}" if abs(v) < 2**31 else f"{v}LL"
    v = float.__float__(float(value))  # the exact float, likewise
    suffix = "" if dtype == float64 else "f"
    if math.isnan(v):
        return "NAN" if suffix else "(double)NAN"
    if math.isinf(v):
        return ("" if v > 0 else "-") + ("INFINITY" if suffix else "(double)INFINITY")
    text = repr(v)
    if "e" not in text and "." not in text:
        text += ".0"
    return text + suffix


class CppIndexPrinter(IndexPrinter):
    """Index expressions as C++ (int64 arithmetic, non-negative operands): sympy's term order."""

    def add(self, e) -> str:
        terms = [self.expr(t) for t in e.as_ordered_terms()]
        out = terms[0]
        for t in terms[1:]:
            out += f" - {t[1:]}" if t.startswith("-") else f" + {t}"
        return out

    def mul(self, e) -> str:
        coeff, rest = e.as_coeff_Mul()
        return f"-{self.mul(rest)}" if coeff == -1 else super().mul(e)

    def modular(self, a, d, m) -> str:
        base = self.expr(a) if d == 1 else f"({self.expr(a)}) / {self.paren(d)}"
        return f"(({base}) % {self.paren(m)})"

    def other(self, e) -> str:
        if isinstance(e, (sympy.Max, sympy.Min)):
            fn = "stax_max" if isinstance(e, sympy.Max) else "stax_min"
            return f"{fn}<int64_t>({', '.join(self.expr(a) for a in e.args)})"
        return super().other(e)


cexpr = CppIndexPrinter().expr


# ---- §8 The ops handler that prints C++ ----


def _template_arg(dtype) -> str:
    """Integer helpers are templates; naming the type keeps `x (int64) op 2 (int)` unambiguous."""
    return "" if dtype.is_floating_point else f"<{ctype(dtype)}>"


class CppPrinter(Printer):
    """ops handler: each call appends `auto tmpN = <expr>;` (deduplicated) and returns a Var.

    `kernel` resolves buffer names: a buffer computed earlier in the same loop body (or row)
    is read from its C++ variable, any other through its pointer parameter. Generic ops are
    spelled from the op table's `cpp` field (printer.Printer); the methods here are C++'s own forms.
    """

    LANGUAGE = "cpp"

    def __init__(self, kernel, counter):
        super().__init__()
        self.kernel, self.counter = kernel, counter     # counter: one tmp numbering per kernel

    def new_name(self) -> str:
        self.counter[0] += 1
        return f"tmp{self.counter[0] - 1}"

    def assignment(self, name: str, expr: str) -> str:
        return f"auto {name} = {expr};"

    def emit(self, expr: str, dtype):
        if dtype.name in _NARROW:       # int8 + int8 is an int in C++: wrap to the dtype, as eager does
            expr = f"static_cast<{_CTYPE[dtype.name]}>({expr})"
        return super().emit(expr, dtype)

    def load(self, name, index):
        local = self.kernel.locals.get(name)
        if local is not None:
            return local
        dtype = self.kernel.dtype_of(name)
        ptr = self.kernel.arg(name, read=True)
        expr = f"{ptr}[{self.kernel.index(index)}]"
        if dtype == float16:
            expr = f"stax_f16_to_f32({expr})"
        elif dtype == bfloat16:
            expr = f"stax_bf16_to_f32({expr})"
        return self.emit(expr, dtype)

    def constant(self, value, dtype):
        return Var(cliteral(value, dtype), dtype)

    def index_expr(self, expr, dtype):
        var = self.emit(f"static_cast<{ctype(dtype)}>({self.kernel.index(expr)})", dtype)
        self.kernel.index_of[var.name] = self.kernel.final(expr)
        return var

    def lt(self, a, b):
        var = self.emit(f"({a} < {b})", bool_)
        known = self.kernel.index_of
        if a.name in known and b.name in known:     # a bound check: `masked` may know it holds
            self.kernel.compares[var.name] = (known[a.name], known[b.name])
        return var

    def to_dtype(self, x, dtype):
        if x.dtype == dtype:
            return x
        if dtype == float16:
            return self.emit(f"stax_f16_to_f32(stax_f32_to_f16({x}))", dtype)
        if dtype == bfloat16:
            return self.emit(f"stax_bf16_to_f32(stax_f32_to_bf16({x}))", dtype)
        if dtype == bool_:
            return self.emit(f"({x} != 0)", dtype)
        if x.dtype in (float16, bfloat16) and dtype == float32:
            return Var(x.name, dtype)     # half values are already held as (rounded) floats
        return self.emit(f"static_cast<{ctype(dtype)}>({x})", dtype)

    def where(self, c, a, b):
        return self.emit(f"{c} ? {a} : {b}", a.dtype)

    def indirect_indexing(self, value, size, check=True, wrap_neg=True, where=""):
        """A loaded integer as an index: wrapped when negative, checked against [0, size) (an
        error bit and the failing index for the wrapper's IndexError, cpp_prelude.h)."""
        raw = self.emit(f"static_cast<int64_t>({value})", int64)
        n = self.kernel.index(size)
        v = self.emit(f"({raw} < 0 ? {raw} + {n} : {raw})", int64) if wrap_neg else raw
        if check:
            site = self.kernel.index_site(where)
            v = self.emit(f"stax_check_index({v}, {n}, {raw}, {site})", int64)
        return indirect_symbol(v.name)

    def masked(self, mask, body, other):
        """Run `body` only where `mask` holds (its loads may be out of bounds elsewhere). A bound
        check the kernel has tested for its whole block (`CppKernel.assume`) is not tested again."""
        if self.kernel.compares.get(getattr(mask, "name", None)) in self.kernel.assume:
            return body()
        inner = CppPrinter(self.kernel, self.counter)
        with set_handler(inner):
            result = body()
        lines = "\n".join(f"    {line}" for line in inner.lines)
        return self.emit(f"[&]() -> {ctype(result.dtype)} {{\n    if (!({mask})) return {other};\n"
                          f"{lines}\n    return {result};\n}}()", result.dtype)

    # unary math
    def neg(self, x): return self.emit(f"-{x}", x.dtype)
    def reciprocal(self, x): return self.emit(f"{cliteral(1, x.dtype)} / {x}", x.dtype)
    def isnan(self, x): return self.emit(f"({x} != {x})" if x.dtype.is_floating_point else "false", bool_)

    def isinf(self, x):
        if not x.dtype.is_floating_point:
            return Var("false", bool_)
        return self.emit(f"(({x}) == {cliteral(math.inf, x.dtype)} || ({x}) == {cliteral(-math.inf, x.dtype)})", bool_)

    def sign(self, x):
        """PyTorch's (and eager's) sign: (0 < x) - (x < 0), so sign(NaN) == 0 and sign(-0.0) == +0."""
        t = ctype(x.dtype)
        return self.emit(f"static_cast<{t}>(static_cast<int>({cliteral(0, x.dtype)} < {x}) - "
                          f"static_cast<int>({x} < {cliteral(0, x.dtype)}))", x.dtype)

    def logical_not(self, x): return self.emit(f"!{x}", bool_)
    def bitwise_not(self, x): return self.emit(f"!{x}" if x.dtype == bool_ else f"~{x}", x.dtype)

    def _helper(self, fn, a, b):
        return self.emit(f"{fn}{_template_arg(a.dtype)}({a}, {b})", a.dtype)

    def pow(self, a, b):
        """x ** c for small constant c is multiplication (vectorizes, and exact as in eager)."""
        if a.dtype.is_floating_point and b.name in (cliteral(2, a.dtype), cliteral(3, a.dtype)):
            return self.emit(f"({a} * {a})" if b.name == cliteral(2, a.dtype) else f"({a} * {a} * {a})", a.dtype)
        self._may_fail(a, b, KERNEL_ERRORS["pow"], lambda c: c >= 0)
        return self._helper("stax_pow", a, b)

    def maximum(self, a, b): return self._helper("stax_max", a, b)
    def minimum(self, a, b): return self._helper("stax_min", a, b)

    def floordiv(self, a, b):
        self._may_fail(a, b, KERNEL_ERRORS["floordiv"], lambda c: c != 0)
        return self._helper("stax_floordiv", a, b)

    def remainder(self, a, b):
        self._may_fail(a, b, KERNEL_ERRORS["remainder"], lambda c: c != 0)
        return self._helper("stax_remainder", a, b)

    def _may_fail(self, a, b, error, safe):
        """An integer op whose operand `b` is not a constant known `safe`: the kernel may set an
        error bit (cpp_prelude.h stax_set_error) that the wrapper checks after the launch."""
        if a.dtype.is_floating_point:
            return
        try:
            if safe(int(b.name.rstrip("L"))):
                return
        except ValueError:
            pass
        self.kernel.errors.add(error)


# ---- §8 A kernel being printed: its buffers, loops and indices ----



def _to_storage(v: str, dtype, computed) -> str:
    """A computed value `v` (of dtype `computed`) spelled in the storage form of `dtype`: half
    types round through the prelude's converters, other dtypes cast when they differ."""
    if dtype == float16:
        return f"stax_f32_to_f16({v})"
    if dtype == bfloat16:
        return f"stax_f32_to_bf16({v})"
    if compute_dtype(dtype) != computed:
        return f"static_cast<{ctype(dtype)}>({v})"
    return v


class CppKernel:
    """The state of one kernel while it prints: buffers read and written (renamed to in_ptrN /
    out_ptrN by `finish`), values computed earlier in the loop body (`locals`), merged loops."""

    def __init__(self, name, group, sched):
        self.name, self.group, self.sched = name, group, sched
        self.lowered = sched.lowered
        self.reads: dict = {}          # buffer -> True (in order)
        self.writes: dict = {}
        self.locals: dict = {}
        self.ranges: dict = {}         # loop var -> size, for index simplification
        self.steps: list = []          # Prop. 6.3 merges, applied to every printed index
        self.counter = [0]
        self.target = {w: i for i, w in sched.lowered.mutations}   # write-back -> input it updates
        self.errors: set = set()       # KERNEL_ERRORS entries this kernel may raise at run time
        self.index_sites: list = []    # messages of its checked indirect indices (site = position)
        self.scatter_index: dict = {}  # ir.Scatter name -> the index it stores at (printed loads)
        self.index_of: dict = {}       # tmp name -> the index expression an index_expr printed
        self.compares: dict = {}       # tmp name -> (a, b) of a printed bound check `a < b`
        self.assume: set = set()       # bound checks (a, b) the code around the body has tested

    def index_site(self, where) -> int:
        """Register an indirect index's error message; the wrapper raises IndexError with it."""
        self.index_sites.append(where or "index {} is out of bounds with size {}")
        messages = tuple(self.index_sites)
        fmt = (f"IndexError({messages!r}[kernels.stax_index_error_info(2)].format("
               "kernels.stax_index_error_info(0), kernels.stax_index_error_info(1)))")
        self.errors = {e for e in self.errors if e[0] != 4} | {(4, fmt)}
        return len(self.index_sites) - 1

    def final(self, expr):
        """An index expression over the printed loops: simplified, merged loops substituted."""
        expr = simplify_index(expr, self.ranges)
        for step in self.steps:
            expr = sympy.expand(expr.subs(step, simultaneous=True))
        return expr

    def index(self, expr) -> str:
        return cexpr(self.final(expr))

    def dtype_of(self, name):
        return self.lowered.buffer(name).dtype

    def arg(self, name, read=False):
        (self.reads if read else self.writes)[name] = True
        return name   # placeholder, renamed to in_ptrN / out_ptrN in finish()

    def printer(self):
        return CppPrinter(self, self.counter)

    def body(self, node, xvars, rvars, printer=None):
        p = printer or self.printer()
        idx, ridx = node_index(node, xvars, rvars)
        with set_handler(p):
            value = node.inner_fn(idx, ridx) if isinstance(node, Reduction) else node.inner_fn(idx)
            if isinstance(node, Scatter):   # where it writes: its loaded indices, checked
                self.scatter_index[node.name] = node.layout.index(node.output_indexer(idx))
        return p, value

    def store(self, node, value, xvars, rvars) -> str:
        if isinstance(node, Scatter):
            return self.scatter_store(node, value)
        index = self.index(store_index(node, xvars, rvars))
        ptr = self.arg(self.target.get(node.name, node.name))
        return f"{ptr}[{index}] = {_to_storage(str(value), node.dtype, value.dtype)};"

    def scatter_store(self, node, value) -> str:
        """target[loaded index] = value, or += (index_add, scatter_add, accumulate=True): the
        kernel's loops run serially, so duplicates add in index order and the last write wins."""
        self.arg(node.target, read=True)    # in_out: the elements it does not write are kept
        ptr, index = self.arg(node.target), self.index(self.scatter_index[node.name])
        dest = f"{ptr}[{index}]"
        v = str(value)
        if node.mode == "atomic_add":
            old = {float16: f"stax_f16_to_f32({dest})", bfloat16: f"stax_bf16_to_f32({dest})"}.get(node.dtype, dest)
            v = f"{old} + {v}"
        return f"{dest} = {_to_storage(v, node.dtype, value.dtype)};"

    def finish(self, loops: list) -> tuple:
        """Rename buffers to in_ptrN/out_ptrN/in_out_ptrN; return (source, cdef, param buffers)."""
        params, rename, n_in, n_out, n_io = [], {}, 0, 0, 0
        for name in list(dict.fromkeys(list(self.reads) + list(self.writes))):
            dtype = self.dtype_of(name)
            if name in self.writes and name in self.reads:
                pname, n_io = f"in_out_ptr{n_io}", n_io + 1
                decl = f"{storage_ctype(dtype)}* {pname}"
            elif name in self.writes:
                pname, n_out = f"out_ptr{n_out}", n_out + 1
                decl = f"{storage_ctype(dtype)}* {pname}"
            else:
                pname, n_in = f"in_ptr{n_in}", n_in + 1
                decl = f"const {storage_ctype(dtype)}* {pname}"
            rename[name] = pname
            params.append((name, decl))
        text = "\n".join(loops)
        for name in sorted(rename, key=len, reverse=True):
            text = _replace_word(text, f"{name}[", f"{rename[name]}[")
        # sizes that are symbols (§10.3: loop bounds, strides and offsets in indices) are parameters
        syms = sorted({s.name for s in _free_symbols(self.group)} | set(_SIZE_SYMBOL.findall(text)), key=str)
        floats = scalars_in(self.lowered, text)        # run-time float arguments (§10.4)
        decls = [d for _, d in params] + [f"int64_t {s}" for s in syms] + [f"double {s}" for s in floats]
        syms = syms + floats
        origins = ", ".join(dict.fromkeys(self.group.origins))
        sig = f'extern "C" void {self.name}({", ".join(decls)})'
        src = f"// {self.name}: computes {origins}\n{sig}\n{{\n{_indent(text)}\n}}\n"
        return src, sig.replace('extern "C" ', "") + ";", [n for n, _ in params], syms


_SIZE_SYMBOL = re.compile(r"(?<![A-Za-z0-9_])(s[0-9]+)(?![A-Za-z0-9_])")


def _replace_word(text, old, new):
    return re.sub(r"(?<![A-Za-z0-9_])" + re.escape(old), new, text)


def _free_symbols(group) -> set:
    syms = set()
    for s in list(group.ranges) + list(group.reduction_ranges):
        syms |= sympy.sympify(s).free_symbols
    return syms


def _indent(text, n=1):
    pad = "    " * n
    return "\n".join(pad + line if line else line for line in text.split("\n"))


def numel_of(sizes):
    return sympy.sympify(sympy.prod(sizes)) if sizes else sympy.Integer(1)


def for_line(var, size, start=0, step=None):
    inc = f"{var}++" if step is None else f"{var} += {step}"
    return f"for (int64_t {var} = {start}; {var} < {cexpr(size)}; {inc})"


class _BoundChecks:
    """ops handler collecting the bound checks `index_expr(a) < index_expr(b)` of masked bodies
    (a ragged piece's `r0 + 128*x0 < s0`, lower._piece_fn); every other op is ignored."""

    def __init__(self):
        self.found = []

    def index_expr(self, expr, dtype):
        return ("index", sympy.sympify(expr))

    def lt(self, a, b):
        return ("lt", a[1], b[1]) if all(isinstance(x, tuple) and x[0] == "index" for x in (a, b)) else None

    def masked(self, mask, body, other):
        if isinstance(mask, tuple) and mask[0] == "lt":
            self.found.append(mask[1:])
        return body()

    def __getattr__(self, op):
        return lambda *args, **kw: None


def uniform_bound_checks(k: CppKernel, xvars, rvars, lane, rnest) -> tuple:
    """(checks, condition): the bound checks `a < b` of the group's masked bodies that no lane of
    the SIMD loop over `lane` changes, and the C++ condition under which each holds on every
    iteration of the reduction loops `rnest` (a's largest value there, a affine in them, is below
    b), or ((), None). A block meeting it runs its bodies unmasked: the mask leaves the lane loop."""
    rnames, rsizes = rnest
    found = []
    for node in k.group.nodes:
        c = _BoundChecks()
        idx, ridx = node_index(node, xvars, rvars)
        try:
            with set_handler(c):
                node.inner_fn(idx, ridx) if isinstance(node, Reduction) else node.inner_fn(idx)
        except Exception:            # a body the collector cannot follow: keep every mask
            return (), None
        found += [(k.final(a), k.final(b)) for a, b in c.found]
    checks, conds = [], []
    for a, b in dict.fromkeys(found):
        if lane in a.free_symbols | b.free_symbols or set(rnames) & b.free_symbols:
            continue
        top = a
        for v, size in zip(rnames, rsizes):
            slope = sympy.diff(a, v)
            if slope.free_symbols or not slope.is_number:
                break                # not affine in the loop: its largest value is unknown here
            top = top.subs(v, size - 1 if slope > 0 else 0)
        else:
            checks.append((a, b))
            conds.append(f"{cexpr(sympy.expand(top))} < {cexpr(b)}")
    return tuple(checks), (" && ".join(f"({c})" for c in conds) if conds else None)


def drop_unread_checks(k: CppKernel, lines: list) -> list:
    """`lines` without the bound checks (and their index_expr operands) nothing reads any more:
    those `uniform_bound_checks` tested for the block before it (each a pure `auto tmpN = ...;`)."""
    names = [n for n, pair in k.compares.items() if pair in k.assume] + list(k.index_of)
    text = "\n".join(lines)
    for name in names:
        word = re.compile(rf"\b{name}\b")
        if len(word.findall(text)) == 1:
            text = re.sub(rf"(?m)^[ \t]*auto {name} = [^\n]*;\n?", "", text)
    return text.split("\n")


def loop_nest(k: CppKernel, xsizes, rsizes):
    """Set up the kernel's loop variables: merge dims (Prop. 6.3), name the printed loops.

    The IR bodies are always run with the unmerged variables x0.. / r0..; `k.steps` rewrites their
    indices onto the printed loops. Returns (xvars, rvars, printed x names/sizes, printed r names/sizes).
    """
    xvars, rvars = index_vars("x", len(xsizes)), index_vars("r", len(rsizes))
    k.ranges = {**dict(zip(xvars, xsizes)), **dict(zip(rvars, rsizes))}
    exprs = all_indices(k.group.nodes, xvars, rvars)
    xs, xm, xsteps, exprs = merge_dims(xsizes, xvars, exprs, k.ranges)
    rs, rm, rsteps, _ = merge_dims(rsizes, rvars, exprs, {})
    xnames, rnames = index_vars("x", len(xs)), index_vars("r", len(rs))
    k.steps = xsteps + rsteps + [{**dict(zip(xm, xnames)), **dict(zip(rm, rnames))}]
    return xvars, rvars, (xnames, xs), (rnames, rs)
