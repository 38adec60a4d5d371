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
With dynamic=False a training call compiles one specialization per input layout (the key also
holds which inputs require grad); dynamic=True and automatic dynamic make one shape-polymorphic
pair of artifacts (aot_dynamic.py, §10.4), `dyn` on the entry.

Under mode='reduce-overhead' (§9.9) each artifact replays from a CUDA graph (`build`'s `graphed`);
a forward whose replay would overwrite saved tensors a pending backward reads runs directly.

Where to look: `build` (joint graph -> partition -> forward artifact), `CompiledNode.apply` (the
backward), `_forward_call` (§9.9: replay or run directly), `run`, `generate` (both graphs' code,
for stax.generate).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from . import autograd
from .autograd import GradNode, _edge, _version
from .capture import input_tensors, unflatten
from .cudagraph import graph_owned
from .partition import capture_joint, partition
from .runtime import guard_values
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
    dyn: object = None          # §10.4: aot_dynamic.Sizes (symbolic sizes), or None (static)
    # §9.9 mode='reduce-overhead': (call, graph, gen, name, keep_outputs) -> call in a CUDA graph
    graphed: object = None
    direct: object = None       # the forward artifact itself, run while a backward is pending
    pending: list = field(default_factory=list)   # weakrefs: nodes whose saved tensors a replay overwrites
    log: object = None

    def backward_call(self, saved, args=None):
        """The backward artifact, compiled (or read from the artifact cache) on first use. Its
        saved placeholders take the layouts the forward artifact returned (a saved view comes
        back as its own dense buffer). Dynamic (§10.4): the guarded one that takes `args`."""
        if self.dyn is not None:
            return self.dyn.backward_call(self, args)
        if self.backward is None:
            for ph, t in zip(self.part.backward.inputs, saved):
                ph.meta = Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, 0)
            self.gen_backward = self.compile_graph(self.part.backward, self.device, self.name + "_backward",
                                                   use_cache=True)
            self.backward = self.load(self.gen_backward.module)
            if self.graphed is not None:   # its gradients may stay in .grad: kept past a replay
                self.backward = self.graphed(self.backward, self.part.backward, self.gen_backward,
                                             self.name + "_backward", True)
            self.stats["backward_compiles"] += 1
        return self.backward


def build(fn, args, kwargs, device, name, compile_graph, load, log, graphed=None, by_value=False) -> TrainingEntry:
    """Capture the joint graph, partition it (logged under STAX_LOGS=partition) and compile the
    forward. Raises capture.GraphBreak where stax.compile's capture would. `graphed` (§9.9,
    mode='reduce-overhead') wraps each artifact in a CUDA graph where it may be. `by_value`
    (§9.10): the attention rewrite may specialize on the inputs' values (part.forward.value_guards,
    which the caller checks around `forward`)."""
    joint = capture_joint(fn, list(args), kwargs, by_value=by_value)
    part = partition(joint)
    log("partition", name, part.format())
    gen = compile_graph(part.forward, device, name + "_forward", use_cache=True)
    consts = [part.forward.constants[n.name] for n in part.forward.inputs if n.op == "constant"]
    entry = TrainingEntry(name, device, part, joint, load(gen.module), consts, compile_graph, load, gen)
    if graphed is not None:
        entry.graphed, entry.direct, entry.log = graphed, entry.forward, log
        entry.forward = graphed(entry.forward, part.forward, gen, name + "_forward", False)
    return guarded(entry)


def guarded(entry: TrainingEntry) -> TrainingEntry:
    """§9.10: the forward checks its value guards and counts its write-backs (runtime.guard_values;
    the direct call and the replayed one each wrapped apart: `run` tells them apart by identity)."""
    if entry.direct is not None:
        entry.direct = guard_values(entry.direct, entry.part.forward)
    entry.forward = guard_values(entry.forward, entry.part.forward)
    return entry


# ---- §5 The grad node of a compiled region ----


class CompiledNode(GradNode):
    """The autograd node behind a compiled call's differentiable results (PyTorch's
    CompiledFunctionBackward): output k's gradient is tangent k of the backward graph."""
    sizes: tuple = ()           # §10.4: this call's sizes the backward reads (carriers), after the tangents
    tangent_metas = None        # §10.4: this call's layouts of the tangents (else the backward graph's)

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
        metas = self.tangent_metas or [ph.meta for ph in self.entry.part.backward.inputs[len(self.entry.part.saved):]]
        for g, m in zip(grads, metas):
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
            args = list(self.saved) + tangents + list(self.sizes)
            call = self.entry.backward_call(self.saved, args)
            del tangents, grads
            if not retain_graph:
                self.saved, self.versions = None, []
            outs = call(args)
        return [None if slot is None else outs[slot] for slot in self.entry.part.grad_slot]


def _forward_call(entry, inputs):
    """§9.9: a forward replay writes into the graph's memory, where the last replay left its
    outputs: saved tensors a backward still has to read (a node alive and not freed: no backward
    yet, or retain_graph=True), or inputs this call saves (f(f(x))). Then the forward artifact
    runs directly, its outputs in fresh memory; else it replays."""
    graphed, live = entry.forward, []
    for ref in entry.pending:
        node = ref()
        if node is not None and node.saved is not None and graph_owned(node.saved, graphed):
            live.append(ref)
    entry.pending = live
    if not live and not graph_owned([inputs[k] for kind, k in entry.part.saved_from if kind == "input"], graphed):
        return graphed
    entry.stats["forward_direct"] = n = entry.stats.get("forward_direct", 0) + 1
    if n == 1:                              # (logged once)
        entry.log("cudagraphs", entry.name, f"{entry.name}_forward: a backward still to run reads saved "
                  "tensors in the memory its CUDA graph writes; such calls run the forward artifact "
                  "directly instead of replaying over them")
    return entry.direct


def run(entry: TrainingEntry, args, kwargs, consts, inputs=None):
    """One compiled training call: the forward artifact, then the results wired into autograd.
    `inputs`: the call's tensors (dynamic: then the carriers of its int arguments)."""
    inputs = input_tensors(args, kwargs) if inputs is None else inputs
    part, joint = entry.part, entry.joint
    forward = entry.forward if entry.direct is None or entry.direct is entry.forward else \
        _forward_call(entry, inputs)
    with autograd.no_grad():
        outs = forward(list(inputs) + list(consts))
    by_name = {n.name: t for n, t in zip([n for n in part.forward.inputs if n.op == "constant"], consts)}
    saved = [inputs[k] if kind == "input" else by_name[k] if kind == "constant" else outs[k]
             for kind, k in part.saved_from]
    user = list(outs[:part.n_out])
    if joint.diff and any(inputs[p].requires_grad for p in joint.wrt):
        node = CompiledNode(entry, saved, [inputs[p] for p in joint.wrt])
        for nr, k in enumerate(joint.diff):
            t = user[k]
            t.requires_grad, t._grad_fn, t._output_nr = True, node, nr
        if entry.dyn is not None:
            entry.dyn.attach(node, inputs, [user[k] for k in joint.diff])
        if forward is not entry.direct and entry.direct is not None and graph_owned(saved, forward):
            entry.pending.append(weakref.ref(node))
    # outputs that are inputs or views of them are rebuilt from the inputs, under autograd
    return unflatten(joint.spec, iter(user), inputs)


def generate(fn, args, kwargs, device, name, compile_graph):
    """stax.generate on inputs that require grad: the forward's Generated, the backward's as its
    `.backward`, and the partition as its `.partition`."""
    part = partition(capture_joint(fn, list(args), kwargs, by_value=True))
    gen = compile_graph(part.forward, device, name + "_forward")
    gen.backward = compile_graph(part.backward, device, name + "_backward")
    gen.partition = part
    return gen
