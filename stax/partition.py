"""§5 Training: the joint forward+backward graph, and the min-cut that splits it in two.

Layer: front/middle, above capture (whose Tracer it drives) and autograd (whose engine runs the
derivative formulas of op_table.DERIVATIVES on proxies); below aot_autograd, which compiles the two
graphs it produces as two artifacts. Nothing here lowers or prints code.

Consumes a function, its example inputs and which of them require grad. Produces:
  - a `Joint`: one captured graph holding the forward (the function run on proxies that take part in
    autograd) and the backward (autograd's engine run from one tangent placeholder per
    differentiable output to the gradients of the inputs that require grad), as AOTAutograd builds it;
  - a `Partition` of it: the forward graph (the function's outputs, then the values it saves), the
    backward graph (saved values and tangents in, gradients out), and the saved set with its sizes.

What the forward saves is a minimum cut (Ford-Fulkerson, Edmonds-Karp) of a flow network over the
joint graph, weighted by bytes: each node is an edge in -> out whose capacity is its output's size;
cheap pointwise and view ops may be recomputed in the backward, reductions, matmuls, fallbacks and
random ops may not (their in-vertex hangs from the source); the inputs (primals and constants) are
free to save, as the caller keeps them alive anyway; whatever depends on a tangent hangs from the
sink. Of the minimum cuts, the one nearest the backward is taken (its vertices: those that reach the
sink in the residual network), so the backward recomputes as little as the minimum allows.

Where to look: `capture_joint` (the joint graph), `min_cut` (the flow network and its cut),
`partition` (the two graphs), `Partition.format` (what STAX_LOGS=partition prints).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import autograd
from . import tensor_ops as T
from .capture import (Graph, GraphBreak, Node, Tracer, _contiguous_strides, _drop_dead_nodes, _flatten,
                      _input_alias, _input_proxies, _map_tensors, _print_breaks_graph, _reject_ndarrays,
                      input_tensors)
from .fuse_attention import fuse_attention_for_training
from .op_table import OPS
from .tensor import VIEW_OPS, Meta, Tensor, set_tracer

_INF = float("inf")

# ---- §5 The joint graph ----


@dataclass
class Joint:
    graph: Graph            # forward and backward nodes; outputs: forward outputs, then gradients
    spec: object            # the function's output spec (capture._flatten)
    n_out: int              # graph.outputs[:n_out] are the function's tensor outputs
    primals: list           # placeholder node of each of the call's tensors
    tangents: list          # one placeholder per differentiable output
    diff: list              # the index of each differentiable output among the forward outputs
    wrt: list               # positions (among the call's tensors) of the inputs that require grad
    grads: list             # per `wrt` input, its gradient node, or None (the input is unused)
    fused: list = field(default_factory=list)   # §9.10: sdpa nodes made of hand-written attention


def _needs_copy(t) -> bool:
    """A gradient that is an input (a tangent) or a view of one: the backward must return its own
    buffer, never an alias of what it was given."""
    node = t._node
    while node.op in VIEW_OPS:
        node = node.inputs[0]
    return node.op in ("placeholder", "constant")


def _tangent(tracer, leaf, source):
    """The placeholder of a differentiable output's gradient: the output's (symbolic) sizes,
    contiguous; in dynamic mode it makes no symbols of its own (§10.4: the forward's bind it)."""
    if tracer.shape_env is None:
        return tracer.placeholder(Meta(tuple(leaf.shape), _contiguous_strides(leaf.shape), leaf.dtype,
                                       leaf.device, 0), source)
    from .dynshape import to_sympy
    shape = to_sympy(tuple(leaf.shape))
    node = Node(f"arg{len(tracer.graph.inputs)}_1", "placeholder", [], {},
                Meta(shape, _contiguous_strides(shape), leaf.dtype, leaf.device, 0))
    tracer.graph.inputs.append(node)
    tracer.sources[node] = source
    return Tensor._proxy(tracer._proxy_meta(node.meta), node)


def _run_joint(fn, tracer, real, args, kwargs, sized_ints=(), by_value=False):
    """Run `fn` on proxies taking part in autograd, then the backward from tangent placeholders.
    `by_value`: the rewrite may find a mask causal by the values of `real` (guarded, §9.10)."""
    proxies = _input_proxies(tracer, real, None)
    for p, t in zip(proxies, real):
        p.requires_grad = t.requires_grad
    made = iter(proxies)
    pargs = _map_tensors(list(args), lambda t: next(made))
    kw = dict(zip(sorted(kwargs), _map_tensors([kwargs[k] for k in sorted(kwargs)], lambda t: next(made))))
    for where, _ in sized_ints:             # §10.4: an int argument is its carrier's size (a SymInt)
        (kw if isinstance(where, str) else pargs)[where] = next(made).shape[0]
    result = fn(*pargs, **kw)
    leaves = []
    spec = _flatten(result, leaves, lambda t: _input_alias(t, tracer) if t._node is not None else None)
    outs = [tracer._node_of(x) for x in leaves]
    # §9.10: hand-written attention becomes sdpa before its backward is traced (no N x N saved)
    fused = fuse_attention_for_training(tracer, leaves, outs, real if by_value else None) if leaves else []
    diff = [k for k, x in enumerate(leaves) if x.requires_grad and x.dtype.is_floating_point]
    tangents = [_tangent(tracer, leaves[k], len(real) + j) for j, k in enumerate(diff)]
    wrt = [p for p, t in enumerate(real) if t.requires_grad]
    grads = [None] * len(wrt)
    if diff:
        try:
            grads = autograd.grad([leaves[k] for k in diff], [proxies[p] for p in wrt], tangents,
                                  retain_graph=True, allow_unused=True)
        except (RuntimeError, NotImplementedError) as e:
            # eager raises this only if a backward runs: run eagerly, so that it does the same
            raise GraphBreak(f"its backward cannot be traced ({e})") from None
        except TypeError as e:
            if not tracer.graph.unbacked:
                raise
            # static mode: a data-dependent size (nonzero's u0) is a bare symbol, which the
            # gradients' shapes (expand, sum_to) cannot take: run eagerly (exact)
            raise GraphBreak(f"its backward needs a data-dependent size as a number ({e})") from None
    nodes = []
    for g in grads:                         # each gradient its own buffer, never an input's
        node = None if g is None else tracer._node_of(g)
        if node is not None and (_needs_copy(g) or node in nodes):
            node = tracer._node_of(T.clone(g))
        nodes.append(node)
    return spec, outs, diff, [t._node for t in tangents], wrt, nodes, fused


def capture_joint(fn, args: list, kwargs: dict | None = None, shape_env=None, dynamic_dims=None,
                  sized_ints=(), by_value=False) -> Joint:
    """§5: the joint forward+backward graph of `fn` on these inputs. Raises capture.GraphBreak
    where capture would (data-dependent control flow, print). With a `shape_env` (§10.4) sizes
    are symbols, as capture.capture makes them (`dynamic_dims`, `sized_ints`: the int arguments'
    carriers, placed after the call's tensors), and the backward computes with the same symbols.
    `by_value` (§9.10): a mask computed from the inputs' values alone may be found causal by them
    (the forward graph's value_guards)."""
    kwargs = kwargs or {}
    _reject_ndarrays(list(args) + [kwargs[k] for k in sorted(kwargs)])
    tracer = Tracer(shape_env, dynamic_dims)
    real = input_tensors(args, kwargs) + [c for _, c in sized_ints]
    prev = set_tracer(tracer)
    try:
        with _print_breaks_graph(tracer), autograd.enable_grad():
            spec, outs, diff, tangents, wrt, grads, fused = _run_joint(fn, tracer, real, args, kwargs,
                                                                        sized_ints, by_value)
    finally:
        set_tracer(prev)
    g = tracer.graph
    if shape_env is not None:
        _keep_sizes(g, shape_env)
    g.outputs = outs + [n for n in grads if n is not None]
    _drop_dead_nodes(g)
    primals = [n for n in g.inputs if n.op == "placeholder" and n not in tangents]
    for k, n in enumerate(primals):         # AOTAutograd's names: primals_1, ..., tangents_1, ...
        n.name = f"primals_{k + 1}"
    for k, n in enumerate(tangents):
        n.name = f"tangents_{k + 1}"
    return Joint(g, spec, len(outs), primals, tangents, diff, wrt, grads, fused)


def _keep_sizes(g, env):
    """What lowering reads of the shape environment (as capture.capture keeps it on its graph)."""
    if env.unbacked:
        raise GraphBreak("a data-dependent size in compiled training (§10.5)")
    g.checks = list(env.checks)
    g.bounds = {s: hi for s, (lo, hi) in env.ranges.items() if hi is not None}
    g.hints = dict(env.hints)


# ---- §5 The min-cut ----


def recomputable(node) -> bool:
    """May the backward compute this node again? Cheap elementwise and view ops: yes. Reductions,
    matmuls, other ops, host fallbacks and random ops (a second draw would differ): never."""
    d = OPS.get(node.op)
    if d is None or d.fallback:
        return False
    return d.kind in ("unary", "binary", "pointwise", "view", "scatter", "factory")


def nbytes(node, hints=None) -> int:
    """A node's output size in bytes; a symbolic size (§10.4) counts at its hint (the example's)."""
    n = 1
    for s in node.meta.shape:
        n *= int(s) if hints is None or not getattr(s, "free_symbols", None) else int(s.subs(hints))
    return n * node.meta.dtype.itemsize


def _ancestors(roots, stop=()):
    seen, todo = set(), [r for r in roots if isinstance(r, Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(_node_inputs(n))
    return seen


def _node_inputs(n):
    return [y for a in n.inputs for y in (a if isinstance(a, list) else [a]) if isinstance(y, Node)]


class _Flow:
    """A flow network: capacities on directed edges; Edmonds-Karp max flow; the sink side of the cut."""

    def __init__(self):
        self.cap: dict = {}
        self.adj: dict = {}

    def edge(self, a, b, c):
        self.cap[a, b] = self.cap.get((a, b), 0) + c
        self.cap.setdefault((b, a), 0)
        self.adj.setdefault(a, set()).add(b)
        self.adj.setdefault(b, set()).add(a)

    def _path(self, s, t):
        parent, todo = {s: None}, deque([s])
        while todo:
            u = todo.popleft()
            for v in sorted(self.adj.get(u, ()), key=str):
                if v not in parent and self.cap[u, v] > 0:
                    parent[v] = u
                    if v == t:
                        return parent
                    todo.append(v)
        return None

    def max_flow(self, s, t):
        while (parent := self._path(s, t)) is not None:
            path, v = [], t
            while parent[v] is not None:
                path.append((parent[v], v))
                v = parent[v]
            push = min(self.cap[e] for e in path)
            for a, b in path:
                self.cap[a, b] -= push
                self.cap[b, a] += push

    def reaches(self, t) -> set:
        """Vertices with a residual path to `t`."""
        seen, todo = {t}, [t]
        while todo:
            v = todo.pop()
            for u in self.adj.get(v, ()):
                if u not in seen and self.cap[u, v] > 0:
                    seen.add(u)
                    todo.append(u)
        return seen


def min_cut(joint: Joint) -> list:
    """The nodes the forward saves for the backward (in graph order)."""
    g = joint.graph
    grads = [n for n in joint.grads if n is not None]
    bw = set(joint.tangents)                # what depends on a tangent, and the gradients
    for n in g.nodes:
        if any(a in bw for a in _node_inputs(n)):
            bw.add(n)
    bw |= set(grads)
    fw = _ancestors(g.outputs[:joint.n_out] + [v for _, v in g.mutations])
    mutated = {i for i, _ in g.mutations}
    need = _ancestors(grads)
    net = _Flow()
    for n in [x for x in g.inputs + g.nodes if x in need]:
        if n in bw:
            net.edge((n, "in"), "sink", _INF)
        elif n.op in ("placeholder", "constant"):   # free to save: the caller holds it anyway
            net.edge("source", (n, "in"), _INF)
            net.edge((n, "in"), (n, "out"), nbytes(n, g.hints) if n in mutated else 0)
        else:
            net.edge((n, "in"), (n, "out"), nbytes(n, g.hints))
            if not recomputable(n) and n in fw:
                net.edge("source", (n, "in"), _INF)
        for a in _node_inputs(n):
            net.edge((a, "out"), (n, "in"), _INF)
    net.max_flow("source", "sink")
    sink_side = net.reaches("sink")
    return [n for n in g.inputs + g.nodes if n in need and n not in bw
            and (n, "in") not in sink_side and (n, "out") in sink_side]


# ---- §5 The two graphs ----


@dataclass
class Partition:
    forward: Graph          # inputs: the call's tensors, constants; outputs: the function's, then saved
    backward: Graph         # inputs: saved values, then tangents; outputs: the gradients (not None)
    saved: list             # the joint nodes the forward saves, in the backward's input order
    saved_from: list        # per saved node: ("input", position) / ("constant", name) / ("output", k)
    n_out: int              # forward.outputs[:n_out] are the function's outputs
    grad_slot: list = field(default_factory=list)   # per `wrt` input: its backward output, or None
    hints: dict = field(default_factory=dict)       # §10.4: size symbol -> the example's size
    fused: list = field(default_factory=list)       # §9.10: sdpa nodes made of hand-written attention

    def format(self) -> str:
        """STAX_LOGS=partition: the forward graph, the saved values with their sizes, the backward."""
        saved = [f"  {n.name}: {n.meta.dtype.name}[{', '.join(map(str, n.meta.shape))}] {nbytes(n, self.hints)} bytes"
                 + (" (an input: free to save)" if where[0] != "output" else "")
                 for n, where in zip(self.saved, self.saved_from)]
        total = sum(nbytes(n, self.hints) for n, w in zip(self.saved, self.saved_from) if w[0] == "output")
        fused = (f"hand-written attention rewritten before the backward was traced: {', '.join(self.fused)} "
                 "(the flash template forward; its backward the attn_bwd templates, from the saved LSE)\n\n"
                 if self.fused else "")
        return (fused + "forward graph:\n" + self.forward.format() +
                f"\n\nsaved for backward ({len(self.saved)} values, {total} bytes beyond the inputs):\n" +
                ("\n".join(saved) or "  (nothing)") + "\n\nbackward graph:\n" + self.backward.format())


def _forward(joint, saved):
    """The forward graph: the joint's forward nodes that the outputs and the saved values need."""
    g = joint.graph
    mutated = {i for i, _ in g.mutations}
    fwd = Graph(inputs=[n for n in g.inputs if n not in joint.tangents], mutations=list(g.mutations),
                constants=dict(g.constants), value_guards=dict(g.value_guards))
    copies, saved_from, extra = [], [], []
    outs = g.outputs[:joint.n_out]
    for n in saved:
        if n.op == "placeholder" and n not in mutated:
            saved_from.append(("input", joint.primals.index(n)))
        elif n.op == "constant":
            saved_from.append(("constant", n.name))
        else:
            if n in mutated:                # its value before the function's write-back
                n = Node(f"{n.name}_saved", "clone", [n], {}, n.meta)
                copies.append(n)
            if n not in outs and n not in extra:
                extra.append(n)
            saved_from.append(("output", (outs + extra).index(n)))
    live = _ancestors(outs + extra + [v for _, v in g.mutations])
    fwd.nodes = copies + [n for n in g.nodes if n in live]
    fwd.outputs = outs + extra
    return fwd, saved_from


def _backward(joint, saved, saved_from):
    """The backward graph: saved values and tangents as placeholders, nodes recomputed from them."""
    g = joint.graph
    grads = [n for n in joint.grads if n is not None]
    remap = {}
    for n in list(saved) + joint.tangents:
        remap[n] = Node(n.name, "placeholder", [], {}, n.meta)
    live = _ancestors(grads, stop=set(remap))
    nodes = []
    for n in g.nodes:
        if n in live and n not in remap:
            new = Node(n.name, n.op, _remap(n.inputs, remap), dict(n.params), n.meta)
            remap[n] = new
            nodes.append(new)
    missing = [n.name for n in live if n.op in ("placeholder", "constant") and n not in remap]
    if missing:
        raise RuntimeError(f"stax internal error: the backward graph reads {missing}, which the "
                           "forward does not save")
    return Graph(inputs=[remap[n] for n in list(saved) + joint.tangents], nodes=nodes,
                 outputs=[remap[n] for n in grads])


def _remap(inputs, remap):
    return [[remap.get(y, y) for y in a] if isinstance(a, list) else remap.get(a, a) for a in inputs]


def partition(joint: Joint) -> Partition:
    """Split the joint graph at its min-cut into the forward and the backward graphs."""
    saved = min_cut(joint)
    fwd, saved_from = _forward(joint, saved)
    bwd = _backward(joint, saved, saved_from)
    slots, k = [], 0
    for n in joint.grads:
        slots.append(None if n is None else k)
        k += n is not None
    return Partition(fwd, bwd, saved, saved_from, joint.n_out, slots, joint.graph.hints, joint.fused)


__all__ = ["Joint", "Partition", "capture_joint", "partition", "min_cut", "recomputable", "GraphBreak"]
