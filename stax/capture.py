"""§3 Capture by tracing (and the §2 specialization it relies on).

Layer: above tensor.py and tensor_ops.py (it installs itself as tensor.py's tracer); below lower.py,
which consumes its `Graph`.

Consumes a Python function and example inputs; produces a `Graph`: placeholder nodes for the tensor
inputs, one node per primitive op the function ran (with its output metadata: shape, stride, dtype),
the outputs, and the write-backs of inputs the function updated in place.

The function runs once on *proxy* tensors: tensor.py routes every primitive op through one choke
point (`tensor._dispatch`), which hands ops on proxies to the `Tracer` below (installed with
`tensor.set_tracer`) instead of computing them. Python control flow runs normally, so a branch on a
shape is simply taken (the specialization key covers shapes); a branch on tensor *data* (`bool(t)`,
`t.item()`) cannot be recorded (§3.4) and raises `GraphBreak`, naming the user's source line.

Where to look:
  - `Node`, `Graph` ........................ the graph; `Graph.format()` prints one node per line
  - `Tracer.record` ........................ one op → one node (real tensors become constants)
  - `Tracer.mutate` ........................ in-place updates as functional updates (+ write-back)
  - `GraphBreak`, `Tracer.graph_break` ..... data-dependent control flow
  - `capture(fn, args)` .................... the entry point (`input_tensors`: its placeholder order)
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field

from .dtypes import DType
from .tensor import VIEW_OPS, Meta, Tensor, _dispatch, set_tracer

# ---- §3 The graph ----


@dataclass(eq=False)
class Node:
    name: str
    op: str                 # 'placeholder', 'constant' or a primitive op (op_table.OPS)
    inputs: list            # Nodes, Python scalars, or (for 'cat') a list of Nodes
    params: dict
    meta: object            # tensor.Meta: shape, stride, offset, dtype, device

    def __repr__(self):
        return self.name


def _fmt_meta(meta) -> str:
    return f"{meta.dtype.name}[{', '.join(str(s) for s in meta.shape)}]"


def _fmt_arg(a) -> str:
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x) for x in a) + "]"
    if isinstance(a, DType):
        return f"stax.{a.name}"
    return repr(a) if not isinstance(a, Node) else a.name


@dataclass
class Graph:
    inputs: list = field(default_factory=list)      # placeholder / constant nodes, in call order
    nodes: list = field(default_factory=list)       # op nodes, in execution order
    outputs: list = field(default_factory=list)     # Node or Python value per flattened output
    mutations: list = field(default_factory=list)   # (input node, node holding its new value)
    constants: dict = field(default_factory=dict)   # constant node name -> the real Tensor
    unbacked: dict = field(default_factory=dict)    # data-dependent size symbol -> (node name, dim)

    def format(self) -> str:
        lines = [f"{n.name}: {_fmt_meta(n.meta)} = {n.op}()" for n in self.inputs]
        for n in self.nodes:
            args = ", ".join([_fmt_arg(a) for a in n.inputs] +
                             [f"{k}={_fmt_arg(v)}" for k, v in n.params.items()])
            lines.append(f"{n.name}: {_fmt_meta(n.meta)} = {n.op}({args})")
        lines.append(f"return ({', '.join(_fmt_arg(o) for o in self.outputs)},)")
        for inp, new in self.mutations:
            lines.append(f"write back {new.name} -> {inp.name}")
        return "\n".join(lines)


class GraphBreak(Exception):
    """The function cannot be captured as one graph (data-dependent control flow, §3.4)."""


# ---- §3 The tracer: what tensor._dispatch calls while a function is being captured ----


def _user_frame() -> str:
    """The innermost stack frame outside the stax package: where the user's code asked for data."""
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(here):
            return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"
    return "<unknown>"


class Tracer:
    def __init__(self):
        self.graph = Graph()
        self.counts: dict = {}
        self.const_ids: dict = {}       # id(real tensor) -> constant node

    def _name(self, op: str) -> str:
        k = self.counts.get(op, 0)
        self.counts[op] = k + 1
        return op if k == 0 else f"{op}_{k}"

    def placeholder(self, t, index: int):
        node = Node(f"arg{index}_1", "placeholder", [], {}, _meta_of(t))
        self.graph.inputs.append(node)
        proxy = Tensor._proxy(node.meta, node)
        proxy._origin = node
        return proxy

    def _node_of(self, x):
        """The node that currently holds a tensor's value (constants are lifted on first use)."""
        if not isinstance(x, Tensor):
            return x
        if x._node is None:
            if id(x) not in self.const_ids:
                node = Node(f"const{len(self.const_ids)}", "constant", [], {}, _meta_of(x))
                self.graph.inputs.append(node)
                self.graph.constants[node.name] = x
                self.const_ids[id(x)] = node
            return self.const_ids[id(x)]
        base = getattr(x, "_base", None)
        if base is not None and base._node is not None and getattr(x, "_seen", 0) != getattr(base, "_version", 0):
            # the base was updated in place after this view was taken: view the new value
            x._node = _replay_views(base, x._view_ops)._node
            x._seen = base._version
        return x._node

    def record(self, op, inputs, params, metas):
        args = [[self._node_of(y) for y in x] if isinstance(x, (list, tuple)) else self._node_of(x)
                for x in inputs]
        base = None
        if op in VIEW_OPS:
            base = inputs[0]._base if inputs[0]._base is not None else inputs[0]
        outs = []
        for k, meta in enumerate(metas):
            name = self._name(op if k == 0 else f"{op}_out{k}")
            node = Node(name, op, args, dict(params), self._bind_unbacked(meta, name))
            self.graph.nodes.append(node)
            proxy = Tensor._proxy(node.meta, node)
            proxy._seen = getattr(base, "_version", 0)
            outs.append(proxy)
        return outs

    def _bind_unbacked(self, meta, name):
        """Data-dependent sizes (None in the meta, e.g. nonzero's row count) become symbols u0, u1, ..."""
        if all(s is not None for s in meta.shape):
            return meta
        shape = []
        for dim, s in enumerate(meta.shape):
            if s is None:
                import sympy   # only data-dependent sizes need symbols: capture stays light otherwise
                s = sympy.Symbol(f"u{len(self.graph.unbacked)}", integer=True, nonnegative=True)
                self.graph.unbacked[s] = (name, dim)
            shape.append(s)
        return Meta(tuple(shape), _contiguous_strides(shape), meta.dtype, meta.device, 0)

    def mutate(self, target, value):
        """`target` is updated in place to `value` (same shape and dtype): rebind, write back inputs."""
        if target._node is None:
            self.graph_break("an in-place update of a tensor that is not an input of the compiled "
                             "function (a global or closure tensor)")
        base = target._base if target._base is not None else target
        if target._base is None:
            new_base = value
        else:
            new_base = _scatter_into(base, value, target._view_ops)
        base._node = self._node_of(new_base)
        base._version = getattr(base, "_version", 0) + 1
        if target is not base:
            target._node, target._seen = self._node_of(value), base._version
        root = _root_placeholder(self.graph, base)
        if root is not None:
            self.graph.mutations = [(i, n) for i, n in self.graph.mutations if i is not root]
            self.graph.mutations.append((root, base._node))

    def graph_break(self, reason: str):
        raise GraphBreak(f"{reason} at {_user_frame()}")


def _contiguous_strides(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc = acc * s
    return tuple(reversed(stride))


def _meta_of(t) -> object:
    return Meta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, 0)


def _root_placeholder(graph, base):
    origin = getattr(base, "_origin", None)
    return origin if origin is not None and origin.op == "placeholder" else None


def _apply_view(x, op, params):
    """Replay one recorded view op on a (proxy) tensor with the public functions."""
    if op == "permute":
        return x.permute(*params["dims"])
    if op == "expand":
        return x.expand(*params["shape"])
    if op == "reshape":
        return x.reshape(*params["shape"])
    if op == "slice":
        key = (slice(None),) * params["dim"] + (slice(params["start"], params["end"], params["step"]),)
        return x[key]
    if op == "select":
        return x.select(params["dim"], params["index"])
    raise NotImplementedError(op)


def _replay_views(base, view_ops):
    x = base
    for op, params in view_ops:
        x = _apply_view(x, op, params)
    return x


def _scatter_into(base, value, view_ops):
    """Functionalization of a write through views: the new value of `base` after `view = value`."""
    if not view_ops:
        return value
    (op, params), rest = view_ops[0], view_ops[1:]
    inner = _apply_view(base, op, params)
    new_inner = _scatter_into(inner, value, rest)
    if op == "permute":
        inv = [0] * len(params["dims"])
        for k, d in enumerate(params["dims"]):
            inv[d] = k
        return new_inner.permute(*inv)
    if op == "reshape":
        return new_inner.reshape(*base.shape)
    if op in ("slice", "select"):
        meta = Meta(tuple(base.shape), _contiguous_strides(base.shape), base.dtype, base.device, 0)
        return _dispatch(f"{op}_scatter", [base, new_inner], dict(params), [meta])[0]
    raise RuntimeError("unsupported operation: more than one element of the written-to tensor "
                       "refers to a single memory location (an in-place update through expand())")


# ---- §3 Entry point ----


_CONST = object()    # spec kind of a non-tensor output leaf: returned as is, never enters the graph
_ALIAS = object()    # spec kind of an output that is an input or a view of one: rebuilt from the input
_SAME = object()     # spec kind of a tensor already returned at an earlier leaf


def _input_alias(t, graph):
    """(input position, view ops) when output `t` is a tensor input or a view of one, else None.

    Eager returns the input object itself (or a view sharing its storage), so the compiled function
    must too: writing to the result then updates the input, as in eager. Such an output is rebuilt
    from the caller's tensor after the write-backs, never computed into a copy.
    """
    root = t if t._base is None else t._base
    origin = getattr(root, "_origin", None)
    if origin is None or origin.op != "placeholder":
        return None
    placeholders = [n for n in graph.inputs if n.op == "placeholder"]
    return placeholders.index(origin), list(t._view_ops)


def _flatten(obj, leaves, alias=lambda t: None):
    """Flatten nested tuples/lists/dicts of outputs into tensor leaves; returns a rebuild spec.

    Non-tensor leaves (None, numbers, strings) are kept in the spec itself, so that generated code
    only ever returns buffers (a string output can't be mistaken for a buffer name); so are
    outputs that alias an input (`alias(t)` is not None).
    """
    if isinstance(obj, (tuple, list)):
        return (type(obj), [_flatten(x, leaves, alias) for x in obj])
    if isinstance(obj, dict):
        return (dict, [(k, _flatten(v, leaves, alias)) for k, v in obj.items()])
    if not isinstance(obj, Tensor):
        return (_CONST, obj)
    where = alias(obj)
    if where is not None:
        return (_ALIAS, where)
    for k, seen in enumerate(leaves):
        if seen is obj:            # the same tensor returned twice is one output, as in eager
            return (_SAME, k)
    leaves.append(obj)
    return None


def unflatten(spec, leaves, inputs=()):
    """Rebuild the function's result from the computed tensors (and the call's input tensors)."""
    leaves, order = list(leaves), iter(range(1 << 62))

    def build(spec):
        if spec is None:
            return leaves[next(order)]
        kind, items = spec
        if kind is _CONST:
            return items
        if kind is _SAME:
            return leaves[items]
        if kind is _ALIAS:
            k, view_ops = items
            return _replay_views(inputs[k], view_ops)
        if kind is dict:
            return {k: build(s) for k, s in items}
        vals = [build(s) for s in items]
        return kind(vals) if kind in (tuple, list) else kind(*vals)
    return build(spec)


def _map_tensors(obj, f):
    """`obj` with every Tensor inside (nested tuples, lists, dicts) replaced by f(tensor), in order."""
    if isinstance(obj, Tensor):
        return f(obj)
    if type(obj) in (tuple, list):
        return type(obj)(_map_tensors(x, f) for x in obj)
    if type(obj) is dict:
        return {k: _map_tensors(v, f) for k, v in obj.items()}
    return obj


def input_tensors(args, kwargs=None) -> list:
    """The tensors of a call, in the order `capture` makes placeholders of them: positional
    arguments, then keyword arguments by name, looking inside tuples, lists and dicts (a tensor
    passed in a list is an input, not a constant frozen at its first value)."""
    found = []
    _map_tensors((list(args), [(kwargs or {})[k] for k in sorted(kwargs or {})]), found.append)
    return found


def capture(fn, args: list, kwargs: dict | None = None):
    """Run `fn` on proxies of the tensor arguments; return (graph, output spec).

    Non-tensor arguments are passed through unchanged (their values are part of the key).
    Raises GraphBreak when the function needs tensor data to decide what to do.
    """
    tracer = Tracer()
    kwargs, count = kwargs or {}, [0]

    def proxy(t):
        count[0] += 1
        return tracer.placeholder(t, count[0] - 1)
    proxies = _map_tensors(list(args), proxy)
    kw = dict(zip(sorted(kwargs), _map_tensors([kwargs[k] for k in sorted(kwargs)], proxy)))
    prev = set_tracer(tracer)
    leaves = []
    g = tracer.graph
    try:
        result = fn(*proxies, **kw)
        spec = _flatten(result, leaves, lambda t: _input_alias(t, g) if t._node is not None else None)
        # (still tracing: an output viewing a value updated in place later replays its views on
        # the new value, and those view ops must be recorded)
        g.outputs = [tracer._node_of(x) for x in leaves]
    finally:
        set_tracer(prev)
    # drop nodes nothing depends on (ops whose results the function never used)
    live, keep = set(), []
    for x in g.outputs + [n for _, n in g.mutations]:
        if isinstance(x, Node):
            live.add(x)
    for n in reversed(g.nodes):
        if n in live:
            keep.append(n)
            for a in n.inputs:
                for y in (a if isinstance(a, list) else [a]):
                    if isinstance(y, Node):
                        live.add(y)
    g.nodes = list(reversed(keep))
    return g, spec
