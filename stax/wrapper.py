"""§7.5, §9.7 The wrapper both back ends print: `call(args)`'s shared pieces.

Layer: back end, lowest code-printing module (imports the IR from `ir` and buffer lifetimes from
`schedule`; codegen_cpp.py and codegen_triton.py build on it).

Consumes a `schedule.Schedule` (its `lowered` graph: inputs, outputs, unbacked sizes) and, per
fusion group, the lines a back end prints to launch it. Produces lines of Python source: the
unpacking and layout checks at the top of `call(args)`, the launches in order with `del` after each
buffer's last use (§7.5 lifetimes), and the `extern_kernel(...)` line of a §6.1 fallback. Each back
end adds its own parts: the C++ wrapper's `launch_prologue()` and `kernels.NAME(ptr(...))`, the
Triton wrapper's `with stax.cuda.device(0):` and `NAME.run(..., stream=raw_stream0)` (Listing 9.6).

Where to look:
  - `wrapper_prologue` ........ unpack and clear `args`, bind the size symbols (§10.3:
                                `size_bindings`), `assert_size_stride` each input
  - `wrapper_launches` ........ each group's lines, then `del` of the buffers it read last (§7.5)
  - `extern_call` ............. a fallback kernel's line and the data-dependent sizes it defines
  - `pyshape`, `pyarg`, `pyparams`  Python literals of shapes, operands and parameters
  - `pyname`, `pysize`, `pylit`, `pydtype`  what every printed value goes through first: a checked
    identifier, a plain int / float / str, never a user object's own __repr__ (no code injection)
"""
from __future__ import annotations

import keyword
import math
import operator
import re

from .dtypes import DTYPES, DType
from .ir import ReinterpretView
from .schedule import dead_after

# ---- Python literals ----
# Everything printed into the wrapper is first made a plain int, float, str or a checked name:
# a value that reached a graph from user code (an `int` subclass as a reshape size, a parameter)
# could otherwise print itself as code (its __repr__/__str__/__format__) and run inside `call`.

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SIZE_FUNCS = {"Add", "Mul", "Pow", "FloorDiv", "ModularIndexing", "Max", "Min", "floor"}


def pyname(name) -> str:
    """A name the wrapper spells (buffer, kernel, size symbol, dtype): an ASCII identifier."""
    text = str.__str__(name) if isinstance(name, str) else None     # exact str, no override run
    if text is None or not (_NAME.match(text) and text.isidentifier()) or keyword.iskeyword(text):
        raise ValueError(f"Stax will not print {name!r} into generated code: not a plain "
                         "identifier (this is a bug in Stax's code generator)")
    return text


def pyint(v) -> str:
    """An integer as a decimal literal: `operator.index` gives the exact int of an int subclass."""
    return repr(operator.index(v))


def pysize(s) -> str:
    """A size, stride or offset: an int, or an index expression over size symbols (checked)."""
    if isinstance(s, int):
        return pyint(s)
    if hasattr(s, "free_symbols") and hasattr(s, "args"):             # a sympy expression
        for node in _preorder(s):
            if node.is_Symbol:
                pyname(node.name)
            elif not (node.is_Rational or type(node).__name__ in _SIZE_FUNCS):
                break
        else:
            from .dynshape import pyexpr          # §10: FloorDiv as //, Max as max(...)
            return pyexpr(s)
    raise TypeError(f"Stax will not print the size {s!r} (type {type(s).__name__}) into generated "
                    "code: sizes must be ints or expressions of size symbols")


def _preorder(e):
    yield e
    for a in e.args:
        yield from _preorder(a)


def pyshape(shape) -> str:
    """A shape or stride as a tuple literal: `(64, 2)`, `(64,)`, `()`, `(s0, 128)`."""
    items = [pysize(s) for s in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def pydtype(dtype) -> str:
    """A dtype by name (the wrapper's globals hold Stax's dtypes): only one of DTYPES."""
    if not isinstance(dtype, DType) or DTYPES.get(dtype.name) is not dtype:
        raise TypeError(f"Stax will not print {dtype!r} into generated code: not a Stax dtype")
    return pyname(dtype.name)


def pylit(v) -> str:
    """A constant as a Python literal: None/bool, int, float, str (exact types, never a subclass's
    own repr), a dtype's name, or a tuple/list/slice of those."""
    if v is None or v is True or v is False:
        return repr(v)
    if isinstance(v, int):
        return pyint(v)
    if isinstance(v, float):
        f = float.__float__(v)                         # the exact float of a float subclass
        return repr(f) if math.isfinite(f) else f"float('{f!r}')"
    if isinstance(v, str):
        return repr(str.__str__(v))
    if isinstance(v, DType):
        return pydtype(v)
    if isinstance(v, (tuple, list)):
        items = [pylit(x) for x in v]
        if isinstance(v, list):
            return "[" + ", ".join(items) + "]"
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(v, slice):
        return f"slice({pylit(v.start)}, {pylit(v.stop)}, {pylit(v.step)})"
    if hasattr(v, "free_symbols"):
        return pysize(v)
    raise TypeError(f"Stax will not print a {type(v).__name__} into generated code "
                    "(constants must be None, bool, int, float, str or a Stax dtype)")


def pyarg(a) -> str:
    """An operand of a fallback kernel: a buffer name, a view of a buffer, a list, a constant."""
    if isinstance(a, list):
        return "[" + ", ".join(pyarg(x) for x in a) + "]"
    if isinstance(a, ReinterpretView):       # a view of a buffer, handed over without a copy
        lay = a.layout
        return (f"reinterpret_tensor({pyname(a.buffer)}, {pyshape(lay.shape)}, {pyshape(lay.stride)}, "
                f"{pysize(lay.offset)})")
    return pyname(a) if isinstance(a, str) else pylit(a)


def pyparams(params) -> str:
    """A fallback's parameters as a dict literal; dtypes by name (the wrapper's globals hold them)."""
    items = [f"{pylit(k)}: {pylit(v)}" for k, v in params.items()]
    return "{" + ", ".join(items) + "}"


# ---- §7.5, §9.7 Wrapper pieces ----


def wrapper_prologue(low, assert_extra: str = "") -> list:
    """`call(args)`'s first lines: unpack and clear the arguments, check each input's layout."""
    names = [pyname(b.name) for b in low.inputs] + [pyname(n) for n in low.scalars]   # floats last (§10.4)
    lines = ["def call(args):"]
    if names:
        lines.append(f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args")
    lines.append("    args.clear()")
    lines += size_bindings(low)
    for b, name in zip(low.inputs, names):
        lines.append(f"    assert_size_stride({name}, {pyshape(b.layout.shape)}, "
                     f"{pyshape(b.layout.stride)}{assert_extra})")
    return lines


def scalars_in(low, text: str) -> list:
    """The run-time float arguments (§10.4) a kernel's text reads: `double` parameters."""
    return [n for n in low.scalars if re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", text)]


def size_bindings(low, indent: str = "    ") -> list:
    """§10.3: each size symbol read from the first input dim it names, on every call
    (`s0 = arg0_1.shape[0]`); the guard function has checked the rest of the layout."""
    lines, bound = [], set()
    for b in low.inputs:
        for d, s in enumerate(b.layout.shape):
            if getattr(s, "is_Symbol", False) and s not in bound and s not in low.unbacked:
                bound.add(s)
                lines.append(f"{indent}{pyname(str(s))} = {pyname(b.name)}.shape[{int(d)}]")
    return lines


def wrapper_launches(sched, calls, indent: str) -> list:
    """Each group's lines in launch order, each followed by `del` of the buffers it was the last
    to read (§7.5). `calls` holds (group index, its lines, the buffers they define)."""
    lines, defined = [], {b.name for b in sched.lowered.inputs}
    for gi, call, new in calls:
        lines += [indent + line for line in call]
        defined |= new
        dead = dead_after(sched, gi, defined)
        if dead:
            lines.append(f"{indent}del {', '.join(pyname(d) for d in dead)}")
            defined -= set(dead)
    return lines


def pyoutputs(low) -> list:
    """`call`'s return values: buffer names, constants, and a whole buffer under another shape
    as `reshaped_output(buf, shape)` (a tensor of its own over the buffer's memory)."""
    return [pyname(o) if isinstance(o, str) else
            f"reshaped_output({pyname(o.buffer)}, {pyshape(o.layout.shape)})" if isinstance(o, ReinterpretView)
            else pylit(o) for o in low.outputs]


def extern_call(e, unbacked: dict, dtype_text: str, checks=()) -> list:
    """§6.1: a fallback kernel's line, the data-dependent sizes (unbacked symbols) it defines, and
    the stax._check relations (§10.5) that become checkable once they are defined."""
    args = ", ".join(pyarg(a) for a in e.inputs)
    lines = [f"{pyname(e.name)} = extern_kernel({pylit(e.op)}, [{args}], {pyparams(e.params)}, {dtype_text})"]
    for sym, (node_name, dim) in unbacked.items():
        if node_name in e.origins:
            lines.append(f"{pyname(sym.name)} = {pyname(e.name)}.shape[{pyint(dim)}]")
    mine = {s for s, (node_name, _) in unbacked.items() if node_name in e.origins}
    for rel in checks:      # each right after the fallback defining its last data-dependent size
        last = max((s for s in rel.free_symbols if s in unbacked), key=lambda s: int(s.name[1:]), default=None)
        if last in mine:
            from .dynshape import pyexpr, relation_text     # (only graphs with checks load sympy)
            what = f"stax._check({relation_text(rel)}) failed: a size computed from the data broke it"
            lines.append(f"if not ({pyexpr(rel)}): raise RuntimeError({what!r})")
    return lines
