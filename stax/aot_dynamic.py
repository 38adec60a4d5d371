"""§10.4 Training with dynamic shapes: one shape-polymorphic forward and one backward artifact.

Layer: just below `__init__` (CompiledFunction's dynamic training path calls `build`); above
aot_autograd (the TrainingEntry and CompiledNode it fills in), partition (the joint graph, here
captured with symbolic sizes), dynshape (the guard functions) and specialize (size carriers).

Consumes a training call (inputs that require grad) in dynamic or automatic-dynamic mode, its
shape environment and the dims that are symbols. Produces the forward artifact's guard function
and a TrainingEntry whose `dyn` is a `Sizes`: the joint graph is captured once over symbols, the
min-cut splits it (weights at the hints), and

  - the forward artifact takes the call's tensors (and int arguments' carriers) as any dynamic
    artifact does, guarded by the ShapeEnv's guard function (STAX_LOGS=guards, `<fn>_forward`);
  - the sizes the backward reads are not baked in: each forward call saves them as symbolic
    values, one carrier (a stride-0 tensor whose length is the size, specialize.carrier) per
    symbol the backward graph mentions, passed after the tangents (`size_s0`, ...); the backward
    binds each symbol as any artifact does, from the first input dim that holds it (a saved
    tensor's, else the carrier's), and its guard checks that the others agree;
  - the backward artifact is compiled on first use over the same symbols, with the layouts the
    forward returned written as expressions of them, and guarded by its own function
    (`<fn>_backward`: every symbol's range, each input's sizes and strides); one backward
    serves every size; a call whose layouts it does not hold for compiles another.

Where to look: `build`, `Sizes.attach` (what a forward call saves), `Sizes.backward_call`,
`_layout` (a saved tensor's layout as expressions).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .aot_autograd import TrainingEntry, guarded
from .capture import Node, _contiguous_strides, input_tensors, tensor_layouts
from .dtypes import bool_
from .dynshape import ShapeEnv
from .partition import capture_joint, partition
from .specialize import carrier
from .tensor import Meta

# ---- §10.4 The sizes a backward reads, and its guarded artifacts ----


def _symbols(g) -> list:
    """The size symbols a graph mentions (metadata, parameters, scalar operands), sorted by name."""
    found = set()

    def visit(v):
        if isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif isinstance(v, dict):
            for x in v.values():
                visit(x)
        elif not isinstance(v, Node) and getattr(v, "free_symbols", None):
            found.update(v.free_symbols)
    for n in g.inputs + g.nodes:
        visit((n.meta.shape, n.meta.stride, n.meta.offset, n.params, n.inputs))
    return sorted(found, key=str)


def _at(exprs, values) -> list:
    return [int(e) if not getattr(e, "free_symbols", None) else int(e.subs(values)) for e in exprs]


def _layout(meta, t, values) -> Meta:
    """Backward input `t`'s layout over the symbols: the graph's sizes (they must give `t`'s), and
    the graph's strides, or dense strides (a saved view comes back dense), whichever gives `t`'s;
    else its concrete strides (guarded: other sizes compile another backward)."""
    if _at(meta.shape, values) != list(t.shape):
        raise RuntimeError(f"stax internal error: a backward input of size {tuple(t.shape)} where "
                           f"the graph has {meta.shape} at {values}")
    for stride in (meta.stride, _contiguous_strides(meta.shape)):
        if _at(stride, values) == list(t.stride()):
            return Meta(tuple(meta.shape), tuple(stride), meta.dtype, meta.device, 0)
    return Meta(tuple(meta.shape), tuple(t.stride()), meta.dtype, meta.device, 0)


@dataclass
class Sizes:
    symbols: list           # the size symbols the backward reads: its last inputs, one carrier each
    where: list             # per symbol: (forward input position, dim) it is read from
    ranges: dict            # symbol -> (lo, hi or None), as the forward's guard checks it
    log: object             # __init__._log
    backwards: list = field(default_factory=list)      # (guard, call) per backward artifact
    lock: object = field(default_factory=threading.Lock)

    def attach(self, node, inputs, diff_outputs):
        """What one forward call keeps for its backward: its sizes, its outputs' layouts."""
        node.sizes = [carrier(inputs[p]._meta.shape[d]) for p, d in self.where]
        node.tangent_metas = [Meta(tuple(t.shape), _contiguous_strides(tuple(t.shape)), t.dtype, t.device, 0)
                              for t in diff_outputs]

    def backward_call(self, entry, args):
        """The backward artifact whose guard holds for `args` (saved, tangents, sizes), compiled
        when none does."""
        for guard, call in self.backwards:
            if guard(args):
                return call
        with self.lock:
            for guard, call in self.backwards:
                if guard(args):
                    return call
            return self._compile(entry, args)

    def _compile(self, entry, args):
        g = entry.part.backward
        first = len(args) - len(self.symbols)
        values = {s: args[first + k]._meta.shape[0] for k, s in enumerate(self.symbols)}
        for ph, t in zip(g.inputs[:first], args):
            ph.meta = _layout(ph.meta, t, values)
        env = ShapeEnv()
        env.ranges = dict(self.ranges)
        env.sources = {s: (first + k, 0) for k, s in enumerate(self.symbols)}
        source = env.guard_source([(ph.meta.shape, ph.meta.stride) for ph in g.inputs])
        guard = _guard_function(source, entry.name + "_backward")
        if not guard(args):
            raise RuntimeError(f"stax internal error: the backward's guards fail on the inputs they "
                               f"were made for:\n{source}")
        gen = entry.compile_graph(g, entry.device, entry.name + "_backward", use_cache=True)
        self.log("guards", entry.name + "_backward", source)
        entry.gen_backward, entry.backward = gen, entry.load(gen.module)
        entry.stats["backward_compiles"] += 1
        self.backwards.append((guard, entry.backward))
        return entry.backward


def _guard_function(source: str, name: str):
    scope: dict = {}
    exec(compile(source, f"<stax guard of {name}>", "exec"), scope)     # noqa: S102 (our own text)
    return scope["guard"]


# ---- §10.4 The pair of artifacts ----


def build(fn, args, kwargs, device, name, compile_graph, load, log, env, dims, sized):
    """The TrainingEntry (its `.guard`: the forward's guard function): the joint graph over symbols (`dims`: input position -> the dims
    that are symbols; `sized`: the int arguments' carriers), partitioned, the forward compiled;
    the backward compiled on first use. Raises capture.GraphBreak where capture would."""
    joint = capture_joint(fn, list(args), kwargs, shape_env=env, dynamic_dims=dims, sized_ints=sized)
    part = partition(joint)
    symbols = _symbols(part.backward)
    if any(s not in env.sources for s in symbols):
        from .capture import GraphBreak
        raise GraphBreak("the backward reads a size that no input holds")
    part.backward.inputs += [Node(f"size_{s}", "placeholder", [], {}, Meta((s,), (0,), bool_, "cpu", 0))
                             for s in symbols]
    # §10.3: int32 indices for both artifacts, guarded on the forward's inputs
    index32 = device.startswith("cuda") and env.index32(tensor_layouts(joint.graph))
    for g in (part.forward, part.backward):
        g.checks, g.bounds, g.hints, g.index32 = joint.graph.checks, joint.graph.bounds, joint.graph.hints, index32
    source = env.guard_source([(n.meta.shape, n.meta.stride) for n in part.forward.inputs if n.op == "placeholder"])
    guard = _guard_function(source, name + "_forward")
    if not guard(input_tensors(args, kwargs) + [c for _, c in sized]):
        raise RuntimeError(f"stax internal error: the guards of {name} do not hold for the inputs "
                           f"they were captured on:\n{source}")
    log("partition", name, part.format())
    log("guards", name + "_forward", source)
    gen = compile_graph(part.forward, device, name + "_forward", use_cache=True)
    consts = [part.forward.constants[n.name] for n in part.forward.inputs if n.op == "constant"]
    entry = TrainingEntry(name, device, part, joint, load(gen.module), consts, compile_graph, load, gen)
    entry.dyn = Sizes(symbols, [env.sources[s] for s in symbols], {s: env.ranges[s] for s in symbols}, log)
    entry.guard = guard
    return guarded(entry)
