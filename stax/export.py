"""§10.2 Export with declared ranges; §10.4 symbolic capture on its own (`make_graph`).

Layer: top, beside __init__ (which re-exports `export`, `Dim`, `make_graph`); uses capture.py's
symbolic tracer, dynshape.py's shape environment and the pipeline lower -> schedule -> codegen ->
runtime. Consumes a function, example arguments and, per tensor argument, the dims declared
variable (`{"x": {0: n}}` with `n = Dim("n", min=2, max=4096)`); produces an `ExportedProgram`:
the captured graph printed as the chapter's Example 10.1 (shape reads kept as nodes, run-time
assertions at the end), callable on any sizes its declaration admits.

After capture each guard of Def. 10.2 is adjudicated against the declared ranges (§10.2):
  1. implied by the ranges: dropped (the shape environment decides those without a guard);
  2. a bound on one declared symbol (or its specialization to one value) that part of the range
     violates: `ConstraintViolation`, with Example 10.2's message and a narrower `Dim` to declare;
  3. anything else (`p == q` from broadcasting, Prop. 10.2): a run-time assertion (Example 10.3).
Every symbol stands for sizes >= 2 (Prop. 10.2, as in §10.4); a size 1 fails the input check.

Where to look:
  - `Dim` ........................... a declared symbol: name and range
  - `_adjudicate` ................... the three outcomes above; `_violation_message` (Example 10.2)
  - `_GraphPrinter` ................. the printed graph; its shape-read and assertion lines are
                                      also the text of the run-time check (`ExportedProgram.check`)
  - `ExportedProgram.__call__` ...... input check, assertions, then the compiled kernels
  - `export`, `make_graph` .......... the entry points
"""
from __future__ import annotations

import builtins
import inspect
import sys
import types
from dataclasses import dataclass, field

import sympy

from . import dynshape
from .capture import GraphBreak, Node, capture, input_tensors, unflatten
from .tensor import Tensor

# ---- Data types ----


@dataclass(frozen=True)
class Dim:
    """A dim declared variable: one symbol named `name`, sizes in [min, max] (max None: unbounded).
    The same Dim on two inputs declares their sizes equal."""
    name: str
    min: int = 2
    max: int | None = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"stax.Dim: the name must be an identifier, got {self.name!r}")
        if not isinstance(self.min, int) or self.min < 2:
            raise ValueError(f"stax.Dim('{self.name}', min={self.min!r}): a symbol stands for sizes >= 2 "
                             "(Prop. 10.2: broadcasting is then decided without cases); export the sizes "
                             "0 and 1 separately, with that dim left out of dynamic_shapes")
        if self.max is not None and (not isinstance(self.max, int) or self.max < self.min):
            raise ValueError(f"stax.Dim('{self.name}'): max={self.max!r} must be an int >= min={self.min}")

    def __repr__(self):
        return f"Dim('{self.name}', min={self.min}" + ("" if self.max is None else f", max={self.max}") + ")"

    @property
    def bounded(self) -> bool:
        """A range other than the default [2, inf): printed as `_assert_dim_range`."""
        return self.min != 2 or self.max is not None


class ConstraintViolation(ValueError):
    """Outcome 2 of §10.2: a guard the captured program needs fails for part of a declared range."""


class _DeclaredShapeEnv(dynshape.ShapeEnv):
    """A shape environment whose symbols are the declared Dims (no duck sizing: two Dims with
    equal example sizes stay two symbols, their equality a guard if the program needs it).
    Inside, a Dim is the symbol `sK` the back ends pass to kernels as a size parameter (a user's
    name could clash with a kernel's own variables: `x0`, `xnumel`); `dims` maps it back."""

    def __init__(self, declared: dict):
        super().__init__()
        self.declared = declared            # (input position, dim) -> Dim
        self.dims: dict = {}                # symbol -> Dim
        self.by_name: dict = {}             # Dim name -> symbol

    def create_symbol(self, hint, source):
        dim = self.declared[source]
        if dim.name not in self.by_name:
            s = sympy.Symbol(f"s{len(self.by_name)}", integer=True, positive=True)
            self.by_name[dim.name], self.dims[s] = s, dim
            self.hints[s], self.ranges[s], self.sources[s] = hint, (dim.min, dim.max), source
        return self.by_name[dim.name]

    def named(self, e):
        """`e` over the Dims' own names (for messages and the printed graph)."""
        return e.subs({s: sympy.Symbol(d.name, integer=True, positive=True) for s, d in self.dims.items()})


# ---- §10.2 Reading the declaration ----


def _param_names(fn, n: int) -> list:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:n]]
    return names + [f"arg{i}" for i in range(len(names), n)]


def _declared_dims(names, args, dynamic_shapes) -> dict:
    """(input position, dim) -> Dim, checked against the example arguments."""
    if dynamic_shapes is None:
        return {}
    if isinstance(dynamic_shapes, (tuple, list)):
        dynamic_shapes = {names[i]: d for i, d in enumerate(dynamic_shapes) if d is not None}
    unknown = set(dynamic_shapes) - set(names)
    if unknown:
        raise ValueError(f"stax.export: dynamic_shapes names {sorted(unknown)}, which are not "
                         f"parameters of the function (its parameters: {names})")
    position = {id(t): p for p, t in enumerate(input_tensors(args))}
    declared, sizes = {}, {}
    for i, name in enumerate(names):
        spec = dynamic_shapes.get(name)
        if not spec:
            continue
        if not isinstance(args[i], Tensor):
            raise ValueError(f"stax.export: dynamic_shapes declares dims of {name!r}, which is not a tensor")
        for d, dim in spec.items():
            if not isinstance(dim, Dim):
                raise TypeError(f"stax.export: dynamic_shapes[{name!r}][{d}] must be a stax.Dim, got {dim!r}")
            if not -args[i].ndim <= d < args[i].ndim:
                raise ValueError(f"stax.export: {name!r} has {args[i].ndim} dims; dim {d} does not exist")
            size = args[i].shape[d]
            if not (dim.min <= size and (dim.max is None or size <= dim.max)):
                raise ValueError(f"stax.export: {name}.shape[{d % args[i].ndim}] is {size} in the example, "
                                 f"outside {dim!r}; pass an example inside the declared range")
            if sizes.setdefault(dim.name, (dim, size, name))[:2] != (dim, size):
                other = sizes[dim.name]
                raise ValueError(f"stax.export: {name}.shape[{d}] = {size} and a dim of {other[2]} "
                                 f"(size {other[1]}) are both declared {dim.name!r}: one Dim stands for "
                                 "one size; give the example equal sizes or declare two Dims")
            declared[(position[id(args[i])], d % args[i].ndim)] = dim
    return declared


# ---- §10.2 Adjudicating the guards against the declared ranges ----


def _range_text(lo, hi) -> str:
    return f"[{lo}, {'inf' if hi is None else hi}]"


def _violation_message(violated, env) -> str:
    """Example 10.2's message: each guard that narrows a range, then the narrower declarations."""
    names = ", ".join(sorted({env.dims[s].name for s, _, _, _ in violated}))
    lines = [f"Constraints violated ({names})! The captured program holds only for some of the declared sizes:"]
    fixes: dict = {}
    for s, lo, hi, guard in violated:
        a, b = env.ranges[s]
        lines.append(f"  - Not all values of {env.dims[s].name} in {_range_text(a, b)} satisfy the guard "
                     f"{dynshape.relation_text(env.named(guard))}, which the program was captured under")
        flo, fhi = fixes.get(s, (a, b))
        flo = flo if lo is None else builtins.max(flo, int(lo))
        fhi = fhi if hi is None else (int(hi) if fhi is None else builtins.min(fhi, int(hi)))
        fixes[s] = (flo, fhi)
    lines.append("Suggested fixes:")
    for s, (lo, hi) in fixes.items():
        s = env.dims[s].name
        if hi is not None and lo > hi:
            lines.append(f"    {s} = None  # no size in the declared range holds: leave the dim out of dynamic_shapes")
        elif lo == hi:
            lines.append(f"    {s} = None  # the program holds only for {s} == {lo}: leave the dim out of "
                         "dynamic_shapes (a static size)")
        else:
            lines.append(f"    {s} = {Dim(s, lo, hi)!r}")
    return "\n".join(lines)


def _adjudicate(env) -> list:
    """The guards kept as run-time assertions; raises ConstraintViolation for outcome 2."""
    kept, violated = [], []
    for guard in env.guards:
        if env.evaluate(guard) is True:          # outcome 1: implied by the declared ranges
            continue
        bound = dynshape.linear_bound(guard)
        if bound is not None and bound[0] in env.ranges:
            violated.append(bound + (guard,))    # outcome 2
        else:
            kept.append(guard)                   # outcome 3
    if violated:
        raise ConstraintViolation(_violation_message(violated, env))
    return kept


# ---- §10.2 The printed graph (Example 10.1) ----

_PY_BINARY = {"add": ("+", "add"), "sub": ("-", "sub"), "mul": ("*", "mul"), "div": ("/", "truediv"),
              "floordiv": ("//", "floordiv"), "remainder": ("%", "mod"), "pow": ("**", "pow"),
              "eq": ("==", "eq"), "ne": ("!=", "ne"), "lt": ("<", "lt"), "le": ("<=", "le"),
              "gt": (">", "gt"), "ge": (">=", "ge"), "bitwise_and": ("&", "and_"),
              "bitwise_or": ("|", "or_"), "bitwise_xor": ("^", "xor")}
_SYMPY_OPS = {sympy.Add: ("+", "add"), sympy.Mul: ("*", "mul")}
_RESERVED = set(dir(builtins))


class _GraphPrinter:
    """One line per graph node, in the chapter's form; sizes are read from the inputs where a node
    or an assertion first needs them (`getattr_0 = getattr_1(x, 'shape')`, `getitem = getattr_0[0]`).
    `check_lines` are the shape reads and assertions alone: the run-time check executes them."""

    def __init__(self, graph, input_names: list, sources: dict, labels: dict):
        self.graph, self.sources = graph, sources       # symbol -> [(input position, dim), ...]
        self.labels = labels                            # symbol -> the name it is declared as
        self.used, self.counters, self.refs = set(input_names), {}, {}
        self.input_names = input_names
        self.names: dict = {}                           # Node -> printed name
        self.reads: dict = {}                           # (position, dim) / position -> printed name
        self.lines: list = []
        self.check_lines: list = []
        for pos, n in enumerate(n for n in graph.inputs if n.op == "placeholder"):
            self.names[n] = input_names[pos]
        for k, n in enumerate(n for n in graph.inputs if n.op == "constant"):
            self.names[n] = self.fresh(f"_tensor_constant{k}")

    def fresh(self, base: str) -> str:
        if base not in self.used and base not in _RESERVED:
            self.used.add(base)
            return base
        k = self.counters.get(base, 0)
        while f"{base}_{k}" in self.used:
            k += 1
        self.counters[base] = k + 1
        self.used.add(f"{base}_{k}")
        return f"{base}_{k}"

    def ref(self, qualified: str) -> str:
        """The name a called function goes by (`getattr` -> `getattr_1`, `stax.relu` -> `stax_relu`)."""
        if qualified not in self.refs:
            self.refs[qualified] = self.fresh(qualified.replace(".", "_"))
        return self.refs[qualified]

    def emit(self, base: str, text, check=False) -> str:
        name = self.fresh(base)
        line = f"{name} = {text(name) if callable(text) else text}"
        self.lines.append(line)
        if check:
            self.check_lines.append(line)
        return name

    # -- sizes as nodes --
    def size(self, pos: int, dim: int) -> str:
        if (pos, dim) not in self.reads:
            if pos not in self.reads:
                self.reads[pos] = self.emit("getattr", lambda me: f"{self.ref('getattr')}("
                                            f"{self.input_names[pos]}, 'shape')", True)
            self.reads[(pos, dim)] = self.emit("getitem", f"{self.reads[pos]}[{dim}]", True)
        return self.reads[(pos, dim)]

    def expr(self, e, check=False) -> str:
        """A size expression as nodes over the shape reads (a number stays a literal)."""
        e = sympy.sympify(e)
        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            return self.size(*self.sources[e][0])
        if isinstance(e, sympy.Rel):
            op = dynshape.REL_OPS[type(e)]
            base = {"==": "eq", "!=": "ne", ">": "gt", ">=": "ge", "<": "lt", "<=": "le"}[op]
            return self.emit(base, f"{self.expr(e.lhs, check)} {op} {self.expr(e.rhs, check)}", check)
        if type(e) in _SYMPY_OPS:
            op, base = _SYMPY_OPS[type(e)]
            return self.emit(base, f" {op} ".join(self.expr(a, check) for a in e.args), check)
        if type(e).__name__ == "FloorDiv":
            return self.emit("floordiv", f"{self.expr(e.args[0], check)} // {self.expr(e.args[1], check)}", check)
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            return self.emit("pow", f"{self.expr(e.base, check)} ** {int(e.exp)}", check)
        return self.emit("sym_size", dynshape.pyexpr(e.subs({s: sympy.Symbol(self.expr(s, check))
                                                              for s in e.free_symbols})), check)

    # -- graph nodes --
    def arg(self, a) -> str:
        if isinstance(a, Node):
            return self.names[a]
        if isinstance(a, list):
            return "[" + ", ".join(self.arg(x) for x in a) + "]"
        if isinstance(a, sympy.Basic):
            return self.expr(a)
        return repr(a)

    def node(self, n):
        args = [self.arg(a) for a in n.inputs]
        params = {k: dynshape.to_sympy(v) for k, v in n.params.items()}
        if n.op in _PY_BINARY and len(args) == 2 and not params:
            op, base = _PY_BINARY[n.op]
            text = f"{args[0]} {op} {args[1]}"
        elif n.op in ("sum", "prod", "amax", "amin") and set(params) <= {"dims", "keepdim"}:
            base, text = n.op, f"{args[0]}.{n.op}({self._dims_text(n, params)})"
        else:
            base = n.op
            extra = [f"{k}={self.arg(v)}" for k, v in params.items()]
            text = f"{self.ref('stax.' + n.op)}({', '.join(args + extra)})"
        self.names[n] = self.emit(base, text)

    @staticmethod
    def _dims_text(n, params) -> str:
        rank = len(n.inputs[0].meta.shape)
        dims = [d - rank if d == rank - 1 else d for d in params.get("dims", ())]
        text = str(dims[0]) if len(dims) == 1 else str(tuple(dims))
        return text + (", keepdim=True" if params.get("keepdim") else "")

    # -- §10.2 the assertions at the end --
    def assertions(self, ranges: dict, guards: list):
        for s, srcs in self.sources.items():
            (bp, bd) = srcs[0]
            for pos, dim in srcs[1:]:
                self.emit("_assert_dims_equal", f"{self.ref('stax.export._assert_dims_equal')}("
                          f"{self.input_names[pos]}, {dim}, {self.input_names[bp]}, {bd}, "
                          f"'{self.labels.get(s, s)}')", True)
            dim = ranges.get(s)
            if dim is not None and dim.bounded:
                pos, d = srcs[-1]
                self.emit("_assert_dim_range", f"{self.ref('stax.export._assert_dim_range')}("
                          f"{self.input_names[pos]}, {d}, {dim.min}, {dim.max}, '{dim.name}')", True)
        for g in guards:
            if isinstance(g, (sympy.Eq, sympy.Ne)) and self._first_read(g.rhs) < self._first_read(g.lhs):
                g = type(g)(g.rhs, g.lhs, evaluate=False)    # the earlier input on the left
            value = self.expr(g, check=True)
            what = dynshape.relation_text(g.subs({s: sympy.Symbol(f"{self.input_names[p]}.size()[{d}]")
                                          for s, ((p, d), *_) in self.sources.items()}))
            self.emit("_assert_shape_guard", f"{self.ref('stax.export._assert_shape_guard')}("
                      f"{value}, True, {what!r})", True)

    def _first_read(self, e):
        return min((self.sources[s][0] for s in sympy.sympify(e).free_symbols if s in self.sources),
                   default=(len(self.input_names), 0))

    def finish(self, outputs) -> str:
        outs = [self.arg(o) for o in outputs]
        self.lines.append("return " + (outs[0] if len(outs) == 1 else f"({', '.join(outs)})"))
        return "\n".join(self.lines)

    def mutations(self, mutations):
        """An input the function updated in place: the write-back, as `x.copy_(new value)`."""
        for inp, new in mutations:
            self.emit("copy_", f"{self.names[inp]}.copy_({self.names[new]})")


# ---- §10.2 The run-time assertions the printed graph calls ----


def _assert_dims_equal(a, da: int, b, db: int, name: str):
    if a.shape[da] != b.shape[db]:
        raise AssertionError(f"exported program: dim {da} of one input ({a.shape[da]}) and dim {db} of "
                             f"another ({b.shape[db]}) are both declared {name!r} and must be equal")


def _assert_dim_range(t, d: int, lo: int, hi, name: str):
    if not (lo <= t.shape[d] and (hi is None or t.shape[d] <= hi)):
        raise AssertionError(f"exported program: {name} = {t.shape[d]} (dim {d} of an input of shape "
                             f"{tuple(t.shape)}) is outside the declared range {_range_text(lo, hi)}")


def _assert_shape_guard(value, expected: bool, text: str):
    if bool(value) != expected:
        raise AssertionError(f"exported program: the sizes break `{text}`, which the program was "
                             "captured under (a guard kept as a run-time assertion, §10.2); pass sizes "
                             "that satisfy it, or export again from an example with these sizes")


def _check_function(printer: _GraphPrinter, params: list):
    """The printed shape reads and assertions as one Python function of the call's arguments."""
    scope = {name: builtins.getattr if q == "getattr" else globals()[q.rsplit(".", 1)[1]]
             for q, name in printer.refs.items() if q == "getattr" or q.startswith("stax.export.")}
    body = printer.check_lines or ["pass"]
    source = f"def check({', '.join(params)}):\n" + "".join(f"    {line}\n" for line in body)
    exec(builtins.compile(source, "<stax export check>", "exec"), scope)
    return scope["check"], source


# ---- The exported program ----


@dataclass
class ExportedGraph:
    """What `ExportedProgram.graph` prints: Example 10.1's lines. `captured` is the Stax graph."""
    text: str
    captured: object

    def __str__(self):
        return self.text

    __repr__ = __str__


@dataclass(repr=False)
class ExportedProgram:
    """`stax.export`'s result: `.graph` prints the program; calling it checks the inputs, runs the
    shape reads and assertions of the graph, then the compiled kernels (compiled on first call)."""
    graph: ExportedGraph
    names: list                 # parameter names, one per positional argument
    examples: list              # per argument: None for a tensor, else the value it was exported with
    sources: dict               # symbol -> [(input position, dim)], the first one binds it
    guards: list                # the guards kept as run-time assertions (outcome 3)
    check_source: str           # the generated check (the printed shape reads and assertions)
    labels: dict = field(default_factory=dict)      # symbol -> its Dim's name
    check: object = None
    spec: object = None
    device: str = "cpu"
    _call: object = field(default=None, repr=False)

    def _check_inputs(self, args):
        if len(args) != len(self.examples):
            raise TypeError(f"exported program: takes {len(self.examples)} arguments ({', '.join(self.names)}), "
                            f"got {len(args)}")
        for name, a, ex in zip(self.names, args, self.examples):
            if ex is None and not isinstance(a, Tensor):
                raise TypeError(f"exported program: {name} must be a tensor, got {type(a).__name__}")
            if ex is not None and (type(a) is not type(ex) or a != ex):
                raise ValueError(f"exported program: {name} was exported as the constant {ex!r}; got {a!r} "
                                 "(export again to use another value)")
        placeholders = [n for n in self.graph.captured.inputs if n.op == "placeholder"]
        tensors = [a for a in args if isinstance(a, Tensor)]
        env = {s: tensors[p].shape[d] for s, ((p, d), *_) in self.sources.items() if p < len(tensors)
               and d < tensors[p].ndim}
        for node, t, name in zip(placeholders, tensors, [n for n, e in zip(self.names, self.examples) if e is None]):
            _check_layout(node.meta, t, name, env, self.device, self.labels)

    def __repr__(self):
        return f"ExportedProgram({', '.join(self.names)}):\n{self.graph}"

    def __call__(self, *args):
        self._check_inputs(args)
        self.check(*args)
        if self._call is None:
            self._call = _load(self.graph.captured, self.device)
        g = self.graph.captured
        tensors = [a for a in args if isinstance(a, Tensor)]
        consts = [g.constants[n.name] for n in g.inputs if n.op == "constant"]
        return unflatten(self.spec, iter(self._call(tensors + consts)), tensors)


def _check_layout(meta, t, name, env, device, labels):
    """An argument against its placeholder: rank, dtype, device, static sizes, sizes >= 2 for the
    symbols (Prop. 10.2), strides as the expressions the kernels were generated for."""
    if t.ndim != len(meta.shape) or t.dtype != meta.dtype or str(t.device) != device:
        raise ValueError(f"exported program: {name} must be a {len(meta.shape)}-d {meta.dtype.name} tensor "
                         f"on {device}; got a {t.ndim}-d {t.dtype.name} tensor on {t.device}")
    for d, e in enumerate(meta.shape):
        e = sympy.sympify(e)
        if e.is_Integer and t.shape[d] != int(e):
            raise ValueError(f"exported program: {name}.shape[{d}] was exported static as {int(e)}; got "
                             f"{t.shape[d]} (declare it in dynamic_shapes to let it vary)")
        if e.is_Symbol and t.shape[d] < 2:
            raise ValueError(f"exported program: {name}.shape[{d}] is {t.shape[d]}, but the symbol {labels.get(e, e)} stands "
                             "for sizes >= 2 (Prop. 10.2); export sizes 0 and 1 separately, as static dims")
    want = tuple(int(sympy.sympify(e).subs(env)) for e in meta.stride)
    if tuple(t.stride()) != want:
        raise ValueError(f"exported program: {name} has strides {tuple(t.stride())}; the program was "
                         f"exported for strides {want} at these sizes (pass {name}.contiguous(), or "
                         "export on an example of this layout)")


def _load(graph, device: str):
    """Lower, schedule, print and load the captured graph (the pipeline of stax.compile)."""
    from . import lower, runtime, schedule
    if device.startswith("cuda"):
        from . import codegen_triton as backend
    else:
        from . import codegen_cpp as backend
    lowered = lower.lower(graph, split_policy=backend.split_policy,
                          outer_split_policy=getattr(backend, "outer_split_policy", None),
                          operand_strides=getattr(backend, "operand_strides", None))
    return runtime.load_module(backend.generate(schedule.schedule(lowered)))


# ---- Entry points ----


def _symbolic_capture(fn, args, env, dims, what: str):
    """(graph, spec): capture with sizes as symbols; data-dependent branches and sizes raise."""
    for a in args:
        if isinstance(a, (list, tuple, dict)):
            raise TypeError(f"{what} takes tensors and Python scalars as positional arguments; pass "
                            "the tensors of a container as separate arguments")
    from .capture import aliasing
    tensors = input_tensors(args)
    if len(tensors) > 1 and aliasing(tensors) is not None:
        raise ValueError(f"{what}: two tensor arguments share memory; pass separate tensors (.clone())")
    try:
        graph, spec = capture(fn, list(args), {}, shape_env=env, dynamic_dims=dims)
    except GraphBreak as e:
        raise GraphBreak(f"{what} cannot capture {getattr(fn, '__name__', 'fn')}: {e}. Replace the "
                         "data-dependent branch with stax.where(...)") from None
    if graph.unbacked:
        ops = sorted({node for node, _ in graph.unbacked.values()})
        raise NotImplementedError(f"{what} does not support ops whose output size depends on the data "
                                  f"({', '.join(ops)}, §10.5); compile the function with stax.compile, "
                                  "which runs them as fallback kernels")
    return graph, spec


def _program(fn, args, graph, spec, ranges: dict, guards: list) -> ExportedProgram:
    names = _param_names(fn, len(args))
    tensor_names = [n for n, a in zip(names, args) if isinstance(a, Tensor)]
    sources: dict = {}
    for p, node in enumerate(n for n in graph.inputs if n.op == "placeholder"):
        for d, e in enumerate(node.meta.shape):
            if isinstance(e, sympy.Symbol):
                sources.setdefault(e, []).append((p, d))
    labels = {s: d.name for s, d in ranges.items()}
    printer = _GraphPrinter(graph, tensor_names, sources, labels)
    for n in graph.nodes:
        printer.node(n)
    printer.mutations(graph.mutations)
    printer.assertions(ranges, guards)
    text = printer.finish(graph.outputs)
    check, source = _check_function(printer, names)
    devices = {str(t.device) for t in input_tensors(args)}
    return ExportedProgram(ExportedGraph(text, graph), names,
                           [None if isinstance(a, Tensor) else a for a in args], sources, guards,
                           source, labels, check, spec, devices.pop() if len(devices) == 1 else "cpu")


def export(fn, args, dynamic_shapes=None) -> ExportedProgram:
    """§10.2: capture `fn` on `args` with the declared dims as symbols over their ranges.

    dynamic_shapes: {parameter name: {dim: Dim}} (or a tuple, one entry per argument). Undeclared
    dims are static. Raises ConstraintViolation when the program holds only for part of a declared
    range (Example 10.2), with the narrower declaration to use.
    """
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    names = _param_names(fn, len(args))
    declared = _declared_dims(names, args, dynamic_shapes)
    env = _DeclaredShapeEnv(declared)
    dims: dict = {}
    for p, d in declared:
        dims.setdefault(p, []).append(d)
    graph, spec = _symbolic_capture(fn, args, env, dims, "stax.export")
    kept = _adjudicate(env)
    return _program(fn, args, graph, spec, env.dims, kept)


def make_graph(fn, *args, tracing_mode: str = "symbolic") -> ExportedProgram:
    """§10.4 symbolic capture on its own: every dim of every tensor argument a symbol (sizes 0 and 1
    specialized, equal sizes sharing a symbol), every guard a run-time assertion. Raises on ops
    whose output size depends on the data (§10.5)."""
    if tracing_mode != "symbolic":
        raise ValueError(f"stax.make_graph: tracing_mode must be 'symbolic', got {tracing_mode!r} "
                         "(stax.generate shows the graph of concrete sizes)")
    env = dynshape.ShapeEnv()
    graph, spec = _symbolic_capture(fn, args, env, None, "stax.make_graph")
    kept = [g for g in env.guards if env.evaluate(g) is not True]
    return _program(fn, args, graph, spec, {}, kept)


class _CallableModule(types.ModuleType):
    """`import stax.export` binds the name `stax.export` to this module (Python sets the package's
    attribute after the submodule loads), so the module itself calls `export`: `stax.export(f, ...)`
    works whichever was imported first."""

    def __call__(self, fn, args, dynamic_shapes=None) -> ExportedProgram:
        return export(fn, args, dynamic_shapes)


sys.modules[__name__].__class__ = _CallableModule
