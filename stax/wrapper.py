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
"""
from __future__ import annotations

from .dtypes import DType
from .ir import ReinterpretView
from .schedule import dead_after

# ---- Python literals ----


def pysize(s) -> str:
    """One size as Python: an int, or an expression over the size symbols (§10: `128*s0`)."""
    if isinstance(s, int) or getattr(s, "is_Integer", False) or not hasattr(s, "free_symbols"):
        return str(s)
    from .dynshape import pyexpr
    return pyexpr(s)


def pyshape(shape) -> str:
    """A shape or stride as a tuple literal: `(64, 2)`, `(64,)`, `()`, `(s0, 128)`."""
    items = [pysize(s) for s in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def pyarg(a) -> str:
    """An operand of a fallback kernel: a buffer name, a view of a buffer, a list, a constant."""
    if isinstance(a, list):
        return "[" + ", ".join(pyarg(x) for x in a) + "]"
    if isinstance(a, ReinterpretView):       # a view of a buffer, handed over without a copy
        lay = a.layout
        return f"reinterpret_tensor({a.buffer}, {pyshape(lay.shape)}, {pyshape(lay.stride)}, {lay.offset})"
    return a if isinstance(a, str) else repr(a)


def pyparams(params) -> str:
    """A fallback's parameters as a dict literal; dtypes by name (the wrapper's globals hold them)."""
    items = [f"{k!r}: {v.name if isinstance(v, DType) else repr(v)}" for k, v in params.items()]
    return "{" + ", ".join(items) + "}"


# ---- §7.5, §9.7 Wrapper pieces ----


def wrapper_prologue(low, assert_extra: str = "") -> list:
    """`call(args)`'s first lines: unpack and clear the arguments, check each input's layout."""
    names = [b.name for b in low.inputs]
    lines = ["def call(args):"]
    if names:
        lines.append(f"    {', '.join(names)}{',' if len(names) == 1 else ''} = args")
    lines.append("    args.clear()")
    lines += size_bindings(low)
    for b in low.inputs:
        lines.append(f"    assert_size_stride({b.name}, {pyshape(b.layout.shape)}, "
                     f"{pyshape(b.layout.stride)}{assert_extra})")
    return lines


def size_bindings(low, indent: str = "    ") -> list:
    """§10.3: each size symbol read from the first input dim it names, on every call
    (`s0 = arg0_1.shape[0]`); the guard function has checked the rest of the layout."""
    lines, bound = [], set()
    for b in low.inputs:
        for d, s in enumerate(b.layout.shape):
            if getattr(s, "is_Symbol", False) and s not in bound and s not in low.unbacked:
                bound.add(s)
                lines.append(f"{indent}{s} = {b.name}.shape[{d}]")
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
            lines.append(f"{indent}del {', '.join(dead)}")
            defined -= set(dead)
    return lines


def extern_call(e, unbacked: dict, dtype_text: str) -> list:
    """§6.1: a fallback kernel's line, and the data-dependent sizes (unbacked symbols) it defines."""
    args = ", ".join(pyarg(a) for a in e.inputs)
    lines = [f"{e.name} = extern_kernel({e.op!r}, [{args}], {pyparams(e.params)}, {dtype_text})"]
    for sym, (node_name, dim) in unbacked.items():
        if node_name in e.origins:
            lines.append(f"{sym} = {e.name}.shape[{dim}]")
    return lines
