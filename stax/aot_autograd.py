"""§5 Compiled training: a stax.compile'd function called on inputs that require grad.

Layer: just below `__init__` (CompiledFunction's training path calls `build` and `run`, passing
its own pipeline `_compile_graph` and its log, which sit above this module); above partition
(the joint graph, the min-cut), autograd (the GradNode machinery), runtime (loading modules) and
capture.

Consumes the function, the call's inputs and the two graphs `partition` makes of them. Produces a
`TrainingEntry`: the forward artifact, compiled now, and the backward artifact, compiled on first use
(its graph is kept). `run` executes the forward and gives the results one `CompiledNode` (a
GradNode with one output per differentiable result) whose backward runs the backward artifact on
the saved tensors and the incoming gradients, so `loss.backward()` fills the inputs' `.grad` and the
autograd graph continues through eager ops before and after the compiled region.

As in eager autograd: a saved input changed in place before the backward makes it raise; without
`retain_graph=True` a second backward raises, and the saved tensors are released after the first;
an output with no gradient gets zeros; `create_graph=True` raises (the backward has no history).
Sizes are static: a training call compiles one specialization per input layout (the key also holds
which inputs require grad), whatever `dynamic=` says.

Where to look: `build` (joint graph -> partition -> forward artifact), `CompiledNode.apply` (the
backward), `run`, `generate` (both graphs' code, for stax.generate).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import autograd
from .autograd import GradNode, _edge, _version
from .capture import input_tensors, unflatten
from .partition import capture_joint, partition
from .tensor import Meta, zeros
from .tensor_ops import clone, to_dtype

# ---- §5 The artifacts of one training specialization ----


@dataclass
class TrainingEntry:
    name: str
    device: str
    part: object                # partition.Partition: the two graphs, the saved set
    joint: object               # partition.Joint: which outputs are differentiable, which inputs
    forward: object             # call(args) of the forward artifact
    consts: list                # the forward's constant inputs (tensors read from globals, closures)
    compile_graph: object       # __init__._compile_graph
    load: object                # (module) -> call
    gen_forward: object = None
    gen_backward: object = None
    backward: object = None     # call(args) of the backward artifact, once compiled
    stats: dict = field(default_factory=lambda: {"backward_compiles": 0})

    def backward_call(self, saved):
        """The backward artifact, compiled (or read from the artifact cache) on first use. Its
        saved placeholders take the layouts the forward artifact returned (a saved view comes
        back as its own dense buffer)."""
        if self.backward is None:
            for ph, t in zip(self.part.backward.inputs, saved):
                ph.meta = Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, 0)
            self.gen_backward = self.compile_graph(self.part.backward, self.device, self.name + "_backward",
                                                   use_cache=True)
            self.backward = self.load(self.gen_backward.module)
            self.stats["backward_compiles"] += 1
        return self.backward


def build(fn, args, kwargs, device, name, compile_graph, load, log) -> TrainingEntry:
    """Capture the joint graph, partition it (logged under STAX_LOGS=partition) and compile the
    forward. Raises capture.GraphBreak where stax.compile's capture would."""
    joint = capture_joint(fn, list(args), kwargs)
    part = partition(joint)
    log("partition", name, part.format())
    gen = compile_graph(part.forward, device, name + "_forward", use_cache=True)
    consts = [part.forward.constants[n.name] for n in part.forward.inputs if n.op == "constant"]
    return TrainingEntry(name, device, part, joint, load(gen.module), consts, compile_graph, load, gen)


# ---- §5 The grad node of a compiled region ----


class CompiledNode(GradNode):
    """The autograd node behind a compiled call's differentiable results (PyTorch's
    CompiledFunctionBackward): output k's gradient is tangent k of the backward graph."""

    def __init__(self, entry, saved, wrt_inputs):
        self.op, self.params, self.inputs, self.out = "compiled", {}, [], None
        self.entry, self.saved = entry, saved
        self.n_outputs = len(entry.joint.diff)
        # the saved tensors the caller can reach (inputs, returned outputs) may be changed in place
        self.versions = [(t, _version(t)) for t in saved]
        self.edges = [_edge(t) if t.requires_grad else None for t in wrt_inputs]
        self._freed = False

    @property
    def freed(self):
        return self._freed

    @freed.setter
    def freed(self, value):
        self._freed = value
        if value:                       # the engine is done with it (no retain_graph): let go
            self.saved = None

    def name(self) -> str:
        return "CompiledFunctionBackward"

    def _tangents(self, grads):
        out = []
        for g, ph in zip(grads, self.entry.part.backward.inputs[len(self.entry.part.saved):]):
            m = ph.meta
            if g is None:               # an output the loss does not use: its gradient is zero
                g = zeros(*m.shape, dtype=m.dtype, device=m.device)
            if g.dtype is not m.dtype:
                g = to_dtype(g, m.dtype)
            if tuple(g._meta.stride) != tuple(m.stride):      # the layout the backward was made for
                g = clone(g)
            out.append(g)
        return out

    def apply(self, grads, retain_graph=True):
        """The inputs' gradients: the backward artifact on the saved tensors and the tangents.
        Without retain_graph the node lets go of its saved tensors first (as AOTAutograd steals
        its backward's arguments): the artifact's `args.clear()` and `del`s then free each one
        right after its last use instead of after the whole backward."""
        grads = grads if self.n_outputs > 1 else [grads]
        with autograd.no_grad():
            tangents = self._tangents(grads)
            call = self.entry.backward_call(self.saved)
            args = list(self.saved) + tangents
            del tangents, grads
            if not retain_graph:
                self.saved, self.versions = None, []
            outs = call(args)
        return [None if slot is None else outs[slot] for slot in self.entry.part.grad_slot]


def run(entry: TrainingEntry, args, kwargs, consts):
    """One compiled training call: the forward artifact, then the results wired into autograd."""
    inputs = input_tensors(args, kwargs)
    part, joint = entry.part, entry.joint
    with autograd.no_grad():
        outs = entry.forward(list(inputs) + list(consts))
    by_name = {n.name: t for n, t in zip([n for n in part.forward.inputs if n.op == "constant"], consts)}
    saved = [inputs[k] if kind == "input" else by_name[k] if kind == "constant" else outs[k]
             for kind, k in part.saved_from]
    user = list(outs[:part.n_out])
    if joint.diff and any(inputs[p].requires_grad for p in joint.wrt):
        node = CompiledNode(entry, saved, [inputs[p] for p in joint.wrt])
        for nr, k in enumerate(joint.diff):
            t = user[k]
            t.requires_grad, t._grad_fn, t._output_nr = True, node, nr
    # outputs that are inputs or views of them are rebuilt from the inputs, under autograd
    return unflatten(joint.spec, iter(user), inputs)


def generate(fn, args, kwargs, device, name, compile_graph):
    """stax.generate on inputs that require grad: the forward's Generated, the backward's as its
    `.backward`, and the partition as its `.partition`."""
    part = partition(capture_joint(fn, list(args), kwargs))
    gen = compile_graph(part.forward, device, name + "_forward")
    gen.backward = compile_graph(part.backward, device, name + "_backward")
    gen.partition = part
    return gen
