"""§3 Capture by tracing (and the §2 specialization it relies on).

Layer: above tensor.py and tensor_ops.py (it installs itself as tensor.py's tracer); below lower.py,
which consumes its `Graph`.

Consumes a Python function and example inputs; produces a `Graph`: placeholder nodes for the tensor
inputs (inputs that share memory are views of one base placeholder), one node per primitive op the function ran (with its output metadata: shape, stride, dtype),
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
  - `GraphBreak`, `Tracer.graph_break` ..... data-dependent control flow, print(), nested ndarrays
  - `ndarray_inputs`, `_wrap_ndarrays` ..... ndarray arguments: zero-copy inputs, numpy_args.NdProxy
  - `SymFloat`, `SpecializeScalar` ......... float arguments passed to the kernels at run time (§10.4)
  - `aliasing`, `_view_chain` .............. inputs sharing memory: one base, the key's pattern
  - `capture(fn, args)` .................... the entry point (`input_tensors`: its placeholder order)
"""
from __future__ import annotations

import builtins
import contextlib
import os
import traceback
from dataclasses import dataclass, field

import numpy as np

from .dtypes import DType
from .numpy_args import NdProxy
from .tensor import (VIEW_OPS, Meta, Storage, SymbolicFloat, SymbolicInt, Tensor, _dispatch, current_tracer,
                     set_tracer)

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
    checks: list = field(default_factory=list)      # §10.5 stax._check relations, checked at run time
    bounds: dict = field(default_factory=dict)      # size symbol -> upper end of its range (buckets)
    hints: dict = field(default_factory=dict)       # size symbol -> the example's size (Alg. 6.1's choice)
    index32: bool = False                           # §10.3: int32 indices guarded (ShapeEnv.index32)
    scalars: list = field(default_factory=list)     # run-time float arguments' names (§10.4), call order
    # §9.10 inputs whose values the code was specialized on: input node -> (why, a weakref of its
    # storage, its version then); runtime.guard_values checks them on every call
    value_guards: dict = field(default_factory=dict)

    def format(self) -> str:
        lines = [f"{n.name}: {_fmt_meta(n.meta)} = {n.op}()" for n in self.inputs]
        lines += [f"{name}: float = scalar()" for name in self.scalars]
        for n in self.nodes:
            args = ", ".join([_fmt_arg(a) for a in n.inputs] +
                             [f"{k}={_fmt_arg(v)}" for k, v in n.params.items()])
            lines.append(f"{n.name}: {_fmt_meta(n.meta)} = {n.op}({args})")
        lines.append(f"return ({', '.join(_fmt_arg(o) for o in self.outputs)},)")
        for inp, new in self.mutations:
            lines.append(f"write back {new.name} -> {inp.name}")
        for s, hi in sorted(self.bounds.items(), key=lambda kv: str(kv[0])):
            lines.append(f"size {s} <= {hi}")       # (the code depends on it: part of the artifact key)
        lines += [f"check {c}" for c in self.checks]
        if self.index32:
            lines.append("indices < 2**31 (guarded)")   # (also part of the artifact key)
        lines += [f"values of {n.name} guarded: {why}" for n, (why, _, _) in self.value_guards.items()]
        return "\n".join(lines)


class GraphBreak(Exception):
    """The function cannot be captured as one graph (data-dependent control flow, §3.4)."""


class ValuesChanged(Exception):
    """§9.10 A tensor whose values a compiled artifact was specialized on (`Graph.value_guards`: a
    mask found causal, fuse_attention.py) is another tensor at this call, or was written to since
    (runtime.guard_values raises it before any kernel runs): the caller, CompiledFunction, compiles
    again without specializing on values."""


# ---- §3 The tracer: what tensor._dispatch calls while a function is being captured ----


def _user_frame() -> str:
    """The innermost stack frame outside the stax package: where the user's code asked for data."""
    here = os.path.dirname(os.path.abspath(__file__))
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(here):
            return f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"
    return "<unknown>"


class Tracer:
    lifts_constants = True      # ops on real (global/closure) tensors are recorded, not run (tensor._dispatch)

    def __init__(self, shape_env=None, dynamic_dims=None):
        self.graph = Graph()
        self.shape_env = shape_env      # §10: a dynshape.ShapeEnv when sizes are symbols, else None
        self.dynamic_dims = dynamic_dims    # input position -> dims made symbols (None: every dim)
        self.counts: dict = {}
        self.const_ids: dict = {}       # id(real tensor) -> constant node
        self.sources: dict = {}         # placeholder node -> index into the call's input sources
        self.specialize: dict = {}      # run-time float arguments read as numbers -> where (SymFloat)

    def _name(self, op: str) -> str:
        k = self.counts.get(op, 0)
        self.counts[op] = k + 1
        return op if k == 0 else f"{op}_{k}"

    def placeholder(self, meta, source: int):
        """A graph input; `source` is its index in the call's tensors (+ aliasing bases, after them)."""
        node = Node(f"arg{len(self.graph.inputs)}_1", "placeholder", [], {}, meta)
        self.graph.inputs.append(node)
        self.sources[node] = source
        if self.shape_env is not None:      # §10.4: one symbol per dim (0 and 1 specialized)
            dims = None if self.dynamic_dims is None else self.dynamic_dims.get(source, ())
            node.meta = symbolic_meta(self.shape_env, meta, source, dims)
        proxy = Tensor._proxy(self._proxy_meta(node.meta), node)
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

    def _proxy_meta(self, meta):
        """What traced code sees of a node's metadata: its sizes as SymInts (dynamic mode)."""
        if self.shape_env is None:
            return meta
        from . import dynshape      # (sympy is loaded only when sizes are symbols)
        env = self.shape_env
        return Meta(tuple(dynshape.wrap(s, env) for s in meta.shape),
                    tuple(dynshape.wrap(s, env) for s in meta.stride), meta.dtype, meta.device,
                    dynshape.wrap(meta.offset, env))

    def record(self, op, inputs, params, metas):
        if op in ("to_dtype", "clone") and (metas[0].dtype.name.startswith("float8") or
                                            inputs[0].dtype.name.startswith("float8")):
            raise GraphBreak("a float8 cast runs eagerly (compiled code takes float8 only as the "
                             "operands of stax._scaled_mm)")
        if self.graph.scalars:      # a run-time float argument enters the graph as its symbol (§10.4)
            inputs = [x.expr if isinstance(x, SymbolicFloat) else x for x in inputs]
            params = {k: v.expr if isinstance(v, SymbolicFloat) else v for k, v in params.items()}
        if self.shape_env is not None:
            from . import dynshape
            # sizes in scalar operands, metadata and parameters enter the graph as sympy
            # expressions (the kernels read them as run-time ints)
            inputs = [x.expr if isinstance(x, dynshape.SymInt) else x for x in inputs]
            params = dynshape.to_sympy(params)
            metas = [Meta(dynshape.to_sympy(tuple(m.shape)), dynshape.to_sympy(tuple(m.stride)),
                          m.dtype, m.device, dynshape.to_sympy(m.offset)) for m in metas]
        args = [[self._node_of(y) for y in x] if isinstance(x, (list, tuple)) else self._node_of(x)
                for x in inputs]
        base = None
        if op in VIEW_OPS:
            base = inputs[0]._base if inputs[0]._base is not None else inputs[0]
        outs = []
        for k, meta in enumerate(metas):
            name = self._name(op if k == 0 else f"{op}_out{k}")
            node = Node(name, op, args, dict(params), self._bind_unbacked(meta, name, op, args))
            self.graph.nodes.append(node)
            proxy = Tensor._proxy(self._proxy_meta(node.meta), node)
            proxy._seen = getattr(base, "_version", 0)
            outs.append(proxy)
        return outs

    def _bind_unbacked(self, meta, name, op, args):
        """Data-dependent sizes (None in the meta, e.g. nonzero's row count) become symbols u0, u1, ...
        (§10.5); in dynamic mode the shape environment learns 0 <= u (<= the input's numel)."""
        if all(s is not None for s in meta.shape):
            return meta
        shape = []
        for dim, s in enumerate(meta.shape):
            if s is None:
                import sympy   # only data-dependent sizes need symbols: capture stays light otherwise
                s = sympy.Symbol(f"u{len(self.graph.unbacked)}", integer=True, nonnegative=True)
                self.graph.unbacked[s] = (name, dim)
                if self.shape_env is not None:
                    self.shape_env.add_unbacked(s, _UNBACKED_WHAT.get(op, f"an output size of {op}"),
                                                _numel_bound(op, args))
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


_UNBACKED_WHAT = {"nonzero": "the row count of nonzero", "unique": "the length of unique",
                  "masked_select": "the length of masked_select", "bincount": "the length of bincount"}


def _numel_bound(op, args):
    """An upper bound of a data-dependent size: the numel of the input it selects from."""
    if op not in ("nonzero", "unique") or not isinstance(args[0], Node):
        return None
    n = 1
    for s in args[0].meta.shape:
        n = n * s
    return n


def _contiguous_strides(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc = acc * s
    return tuple(reversed(stride))


def symbolic_meta(env, meta, source: int, dims=None):
    """§10.4: an input's metadata over symbols. Each size >= 2 of a dim in `dims` (None: every dim)
    is a symbol; strides that are the running products of sizes in stride order (a dense layout,
    any permutation of it) are those products, the others stay concrete (and are guarded)."""
    import sympy
    shape = [env.create_symbol(n, (source, d)) if dims is None or d in dims else sympy.Integer(n)
             for d, n in enumerate(meta.shape)]
    stride = [sympy.Integer(st) for st in meta.stride]
    order = sorted((d for d in range(len(shape)) if meta.shape[d] > 1 and meta.stride[d] != 0),
                   key=lambda d: meta.stride[d])
    acc_hint, acc = 1, sympy.Integer(1)
    for d in order:
        if meta.stride[d] != acc_hint:
            break
        stride[d] = acc
        acc_hint, acc = acc_hint * meta.shape[d], acc * shape[d]
    return Meta(tuple(shape), tuple(stride), meta.dtype, meta.device, 0)


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


# ---- §3 Aliased inputs: tensors sharing memory are views of one base placeholder ----
#
# `f(a, b)` called as `f(x, x)`, `f(s[1:], s[:-1])` or `f(x, x.t())`: a write through `a` must reach
# `b`. As torch.compile does, the inputs that share memory are captured as views of ONE placeholder,
# a 1-D buffer over the memory they span (the base), so functionalization sees every write through
# one of them reach the others and writes the base back once, in program order. The key includes
# the pattern (which inputs share memory, and each one's view of the base): a call with distinct
# tensors and a call with aliased ones get different specializations.


def storage_memory(storage) -> tuple:
    """(first byte, end byte) of a storage's memory; cached on it (a storage never moves)."""
    mem = storage.__dict__.get("_mem")
    if mem is None:
        d = storage.data
        lo, n = (d.ctypes.data, d.nbytes) if storage.device == "cpu" else (d.ptr, d.count * d.dtype.itemsize)
        mem = storage._mem = (lo, lo + n)
    return mem


@dataclass
class AliasGroup:
    positions: tuple        # the call's tensors (input_tensors order) whose memory overlaps
    length: int             # elements of the base; 0: not expressible as views of one base
    chains: tuple           # per position: the view ops from the base, ((op, ((param, value), ...)), ...)
    storage: object = None  # this call's base: storage and element offset (not part of the key)
    offset: int = 0

    def base(self, like):
        return Tensor._make(self.storage, Meta((self.length,), (1,), like.dtype, like.device, self.offset))


@dataclass
class Aliasing:
    """The memory sharing among one call's tensors: `pattern` goes into the key."""
    groups: list

    @property
    def pattern(self) -> tuple:
        return ("aliasing",) + tuple((g.positions, g.length, g.chains) for g in self.groups)

    def expressible(self) -> dict:
        return {p: g for g in self.groups if g.length for p in g.positions}

    def call_inputs(self, inputs: list) -> list:
        """The placeholders' tensors: each expressible group's base where its first member was."""
        grouped, out = self.expressible(), []
        for p, t in enumerate(inputs):
            g = grouped.get(p)
            if g is None:
                out.append(t)
            elif g.positions[0] == p:
                out.append(g.base(t))
        return out

    def sources(self, inputs: list) -> list:
        """What output aliases index (`_input_alias`): the call's tensors, then the groups' bases."""
        return list(inputs) + [g.base(inputs[g.positions[0]]) if g.length else None for g in self.groups]


def aliasing(tensors: list):
    """None when no two of the call's tensors share memory (the common case, checked cheaply);
    else the groups of those that do (a size-0 tensor shares nothing)."""
    if len(tensors) < 2:
        return None
    spans = sorted((storage_memory(t._storage), p) for p, t in enumerate(tensors)
                   if t._storage is not None and 0 not in t._meta.shape)
    groups, hi = [], None
    for (lo2, hi2), p in spans:
        if hi is not None and lo2 < hi:
            groups[-1].append(p)
            hi = max(hi, hi2)
        else:
            groups.append([p])
            hi = hi2
    groups = [_alias_group(tensors, sorted(g)) for g in groups if len(g) > 1]
    return Aliasing(groups) if groups else None


def _alias_group(tensors, positions) -> AliasGroup:
    ts = [tensors[p] for p in positions]
    unexpressible = AliasGroup(tuple(positions), 0, ())
    if any(t.dtype is not ts[0].dtype for t in ts):
        return unexpressible
    isz = ts[0].dtype.itemsize
    org = min(storage_memory(t._storage)[0] for t in ts)
    total = (max(storage_memory(t._storage)[1] for t in ts) - org) // isz
    needs = []
    for t in ts:
        byte = storage_memory(t._storage)[0] - org + t._meta.offset * isz
        need = None if byte % isz else _view_chain(t.shape, t.stride(), byte // isz, total)
        if need is None:
            return unexpressible
        needs.append(need)
    lo, hi = min(a for a, _, _ in needs), max(a + n for a, n, _ in needs)
    chains = tuple(tuple(([("slice", (("dim", 0), ("start", a - lo), ("end", a - lo + n), ("step", 1)))]
                          if (a - lo, n) != (0, hi - lo) else []) + chain) for a, n, chain in needs)
    first = min(ts, key=lambda t: storage_memory(t._storage)[0])
    storage = first._storage
    if any(t._storage is not storage for t in ts):      # one memory, several Storage objects
        if storage.device != "cpu":
            return unexpressible
        storage = Storage(np.lib.stride_tricks.as_strided(storage.data, (hi,), (isz,)))
    return AliasGroup(tuple(positions), hi - lo, chains, storage, lo)


def _view_chain(shape, stride, off, total):
    """A tensor (shape, stride) at element `off` of a buffer of `total` elements, as view ops of the
    range [a, a + n) of that buffer: (a, n, view ops), or None where none is found (overlapping
    or interleaved dims). Dims by decreasing stride: the range is reshaped into rows of the
    outermost stride, each split by the next stride, then each dim sliced; last a permute back to
    the tensor's dim order, a reshape for its size-1 dims and an expand for its broadcast dims."""
    real = sorted(((s, n, d) for d, (n, s) in enumerate(zip(shape, stride)) if n > 1 and s != 0),
                  reverse=True)
    strides, sizes = [s for s, _, _ in real], [n for _, n, _ in real]
    if any(s < 0 for s in strides):
        return None
    chain, k = [], len(real) - 1
    if k <= 0:
        a, n = off, 1 if k < 0 else (sizes[0] - 1) * strides[0] + 1
        if k == 0 and strides[0] != 1:
            chain.append(("slice", (("dim", 0), ("start", 0), ("end", n), ("step", strides[0]))))
    else:
        a, n, r = off - off % strides[0], sizes[0] * strides[0], off % strides[0]
        rows, cuts = [sizes[0]], []
        for i in range(1, k + 1):
            if i < k:
                if strides[i - 1] % strides[i]:
                    return None
                q, r = divmod(r, strides[i])
                rows.append(strides[i - 1] // strides[i])
                cuts.append((i, q, q + sizes[i], 1))
            else:
                rows.append(strides[i - 1])
                cuts.append((i, r, r + (sizes[i] - 1) * strides[i] + 1, strides[i]))
            if cuts[-1][2] > rows[-1]:
                return None
        chain.append(("reshape", (("shape", tuple(rows)),)))
        chain += [("slice", (("dim", d), ("start", b), ("end", e), ("step", st)))
                  for d, b, e, st in cuts if (b, e, st) != (0, rows[d], 1)]
    if a < 0 or a + n > total:
        return None
    perm = tuple(sorted(range(len(real)), key=lambda j: real[j][2]))
    if perm != tuple(range(len(real))):
        chain.append(("permute", (("dims", perm),)))
    mid = tuple(n_ if n_ > 1 and s != 0 else 1 for n_, s in zip(shape, stride))
    if mid != ((1,) if k < 0 else tuple(sizes[j] for j in perm)):
        chain.append(("reshape", (("shape", mid),)))
    if mid != tuple(shape):
        chain.append(("expand", (("shape", tuple(shape)),)))
    return a, n, chain


def _input_proxies(tracer, real: list, alias) -> list:
    """One proxy per tensor of the call; those sharing memory are views of their group's base."""
    grouped = alias.expressible() if alias is not None else {}
    bases, proxies = {}, []
    for p, t in enumerate(real):
        g = grouped.get(p)
        if g is None:
            proxies.append(tracer.placeholder(_meta_of(t), p))
            continue
        gi = alias.groups.index(g)
        if gi not in bases:
            bases[gi] = tracer.placeholder(Meta((g.length,), (1,), t.dtype, t.device, 0), len(real) + gi)
        view = _replay_views(bases[gi], [(op, dict(ps)) for op, ps in g.chains[g.positions.index(p)]])
        if getattr(view, "_input_pos", None) is None:
            view._input_pos = p
        proxies.append(view)
    return proxies


def _check_unexpressible_writes(g, tracer, alias):
    """Inputs sharing memory in a layout not expressed as views of one base are independent
    placeholders: correct while nothing writes to them, so a write to one of them breaks the graph."""
    if alias is None:
        return
    loose = {p for grp in alias.groups if not grp.length for p in grp.positions}
    for inp, _ in g.mutations:
        if tracer.sources.get(inp) in loose:
            raise GraphBreak(f"the function writes to an input that shares memory with another "
                             f"input (inputs {sorted(loose)}, in a layout Stax cannot capture as "
                             f"views of one buffer); pass separate tensors (clone one) to compile it")


# ---- §10.4 Float arguments as run-time scalars ----


class SpecializeScalar(Exception):
    """A run-time float argument was used as a Python number (`if s > 0:`, `s * 2`, `float(s)`,
    `math.sqrt(s)`): the caller captures again with those arguments baked in, keyed by value."""

    def __init__(self, uses: dict):
        super().__init__("; ".join(f"the float argument {how}" for how in uses.values()))
        self.wheres = set(uses)


_FLOAT_METHODS = frozenset(n for n in dir(float) if not n.startswith("_"))


class SymFloat(SymbolicFloat):
    """What the function sees of a float argument passed at run time: an operand of tensor ops
    only (recorded as the sympy symbol `scalar_<name>`, a `double` parameter of the kernels).
    Anything that needs its value as a Python number specializes the argument (`SpecializeScalar`):
    a branch on it then stays correct, decided anew for each value."""
    __slots__ = ("expr", "where", "tracer")

    def __init__(self, name, where, tracer):
        import sympy    # (only functions with run-time floats load sympy here)
        self.expr, self.where, self.tracer = sympy.Symbol(name, real=True), where, tracer

    def specialize(self, how):
        self.tracer.specialize.setdefault(self.where, f"{str(self.expr)[7:]!r} is used as a Python number "
                                          f"({how} at {_user_frame()})")
        raise SpecializeScalar(self.tracer.specialize)

    def __repr__(self):
        return f"SymFloat({self.expr})"

    def __getattr__(self, name):
        if name in _FLOAT_METHODS:
            self.specialize(f".{name}")
        raise AttributeError(name)


def _as_number(how):
    def method(self, *args):
        if args and isinstance(args[0], Tensor):
            return NotImplemented       # `s * x`, `s < x`: the tensor's reflected method records it
        self.specialize(how)
    return method


for _how in ("bool float int index complex round trunc floor ceil hash format str neg pos abs "
             "eq ne lt le gt ge add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv "
             "mod rmod pow rpow divmod rdivmod").split():
    setattr(SymFloat, f"__{_how}__", _as_number(f"__{_how}__"))


# ---- §3 numpy arrays as arguments (numpy_args.py): zero-copy tensor inputs, numpy's semantics ----


def ndarray_inputs(args, kwargs):
    """The call with each top-level ndarray argument as `stax.from_numpy(a)` (zero copy; `_ndarray`
    on the tensor names the array), or None when there is none. An array no tensor can share
    (a dtype Stax lacks, negative strides) stays as it is: the call then runs eagerly."""
    if not any(isinstance(a, np.ndarray) for a in args) and \
            not (kwargs and any(isinstance(v, np.ndarray) for v in kwargs.values())):
        return None
    from .tensor import from_numpy

    def convert(a):
        if type(a) is not np.ndarray or a.dtype.byteorder == ">":    # (np.matrix, masked arrays:
            return a                                                # other semantics, eager)
        try:
            t = from_numpy(a)
        except (TypeError, ValueError):
            return a
        t._ndarray = a
        return t
    return [convert(a) for a in args], {k: convert(v) for k, v in (kwargs or {}).items()}


def ndarray_marks(args, kwargs) -> tuple:
    """The key's part for ndarray arguments: where they are, and which ones numpy lets the
    function write to."""
    found = [(i, a) for i, a in enumerate(args)] + sorted((kwargs or {}).items())
    return tuple((w, a._ndarray.flags.writeable) for w, a in found
                 if a.__class__ is Tensor and "_ndarray" in a.__dict__)


def _to_ndarray(t, scalar):
    """A result the function computed as an ndarray: the caller's array itself, a numpy view of a
    compiled output (zero copy), or a numpy scalar where numpy gives one."""
    if getattr(t, "_ndarray", None) is not None:
        return t._ndarray
    a = t.numpy()
    return a[()] if scalar else a


def _reject_ndarrays(args):
    def check(x):
        if isinstance(x, np.ndarray):
            raise GraphBreak("a numpy array inside a list, tuple or dict argument, or one no tensor "
                             "can share (a dtype Stax lacks, negative strides, an ndarray subclass); "
                             "pass it as an argument of its own, or stax.from_numpy(array), to compile it")
        if type(x) in (tuple, list):
            for y in x:
                check(y)
        elif type(x) is dict:
            for y in x.values():
                check(y)
    check(args)


@contextlib.contextmanager
def _print_breaks_graph(tracer):
    """While `tracer` captures, `print` is a graph break: it would print proxies once, at capture,
    and never again. Other threads (and other tracers) print as usual."""
    original = builtins.print

    def print_(*args, **kwargs):
        if current_tracer() is tracer:
            tracer.graph_break("print() (a Python side effect, run once at capture)")
        return original(*args, **kwargs)
    builtins.print = print_
    try:
        yield
    finally:
        builtins.print = original


# ---- §3 Entry point ----


_CONST = object()    # spec kind of a non-tensor output leaf: returned as is, never enters the graph
_ALIAS = object()    # spec kind of an output that is an input or a view of one: rebuilt from the input
_SAME = object()     # spec kind of a tensor already returned at an earlier leaf
_SIZE = object()     # spec kind of an int output that is a symbolic size: computed from the inputs
_NDARRAY = object()  # spec kind of an ndarray output (numpy_args.py): the inner spec's tensor as one


def _input_alias(t, tracer):
    """(source index, view ops, symbolic) when output `t` is a tensor input or a view of one, else
    None; `symbolic`: the view ops hold `_RunTimeSize`s (dynamic mode), resolved per call.

    Eager returns the input object itself (or a view sharing its storage), so the compiled function
    must too: writing to the result then updates the input, as in eager. Such an output is rebuilt
    from the caller's tensor after the write-backs, never computed into a copy. The source index
    counts the call's tensors, then the aliasing bases (`Aliasing.sources`).
    """
    if getattr(t, "_input_pos", None) is not None:
        return t._input_pos, [], False  # an input itself (also one of several sharing memory)
    root = t if t._base is None else t._base
    origin = getattr(root, "_origin", None)
    if origin is None or origin.op != "placeholder":
        return None
    if tracer.shape_env is None:
        return tracer.sources[origin], list(t._view_ops), False
    return tracer.sources[origin], [(op, _run_time_params(params, tracer.shape_env))
                                    for op, params in t._view_ops], True


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
    if isinstance(obj, SymbolicInt):   # a size returned as a number: read at run time
        return _size_output(obj)
    if isinstance(obj, SymFloat):      # a run-time float returned as a number: specialize it
        obj.specialize("returned")
    if isinstance(obj, NdProxy):       # an array result: the tensor, made an ndarray per call
        return (_NDARRAY, (_flatten(obj.t, leaves, alias), obj.scalar))
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


@dataclass(frozen=True)
class _RunTimeSize:
    """A size expression evaluated on each call from the inputs' sizes (dynamic mode, §10.4):
    `fn(*sizes)`, the sizes read at `where` ((input position, dim) per symbol)."""
    fn: object
    where: tuple

    def value(self, inputs) -> int:
        return self.fn(*[inputs[p]._meta.shape[d] for p, d in self.where])


def _run_time_size(expr, env):
    """A `_RunTimeSize` of a sympy size expression, or None when a symbol in it is not read from
    an input (a data-dependent size)."""
    from .dynshape import pyexpr
    syms = sorted(expr.free_symbols, key=str)
    if any(s not in env.sources for s in syms):
        return None
    fn = eval(f"lambda {', '.join(map(str, syms))}: int({pyexpr(expr)})", {})   # noqa: S307
    return _RunTimeSize(fn, tuple(env.sources[s] for s in syms))


def _size_output(size):
    """The spec of an int output that is a size expression: computed on each call; else (a
    data-dependent size) specialized under a guard."""
    reader = _run_time_size(size.expr, size.env)
    return (_SIZE, reader) if reader is not None else (_CONST, int(size))


def _run_time_params(obj, env):
    """The parameters of a view op with every symbolic size made a `_RunTimeSize`: an output that
    is a view of an input is rebuilt from the caller's tensor with this call's sizes."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(_run_time_params(x, env) for x in obj)
    if isinstance(obj, dict):
        return {k: _run_time_params(v, env) for k, v in obj.items()}
    expr = obj.expr if isinstance(obj, SymbolicInt) else obj
    if getattr(expr, "free_symbols", None):
        reader = _run_time_size(expr, env)
        if reader is None:
            raise GraphBreak("an output that views an input with a data-dependent size")
        return reader
    return int(expr) if hasattr(expr, "is_Integer") and expr.is_Integer else obj


def _resolve_sizes(obj, inputs):
    if isinstance(obj, _RunTimeSize):
        return obj.value(inputs)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_resolve_sizes(x, inputs) for x in obj)
    if isinstance(obj, dict):
        return {k: _resolve_sizes(v, inputs) for k, v in obj.items()}
    return obj


def _build(spec, leaves, order, inputs):
    # a plain recursive function, not a closure over itself: a self-referencing closure is a cycle
    # that would keep every call's outputs alive until the garbage collector runs (memory.py)
    if spec is None:
        return leaves[next(order)]
    kind, items = spec
    if kind is _CONST:
        return items
    if kind is _SAME:
        return leaves[items]
    if kind is _SIZE:
        return items.value(inputs)
    if kind is _NDARRAY:
        return _to_ndarray(_build(items[0], leaves, order, inputs), items[1])
    if kind is _ALIAS:
        k, view_ops, symbolic = items
        if symbolic:
            view_ops = [(op, _resolve_sizes(params, inputs)) for op, params in view_ops]
        return _replay_views(inputs[k], view_ops)
    if kind is dict:
        return {k: _build(s, leaves, order, inputs) for k, s in items}
    vals = [_build(s, leaves, order, inputs) for s in items]
    return kind(vals) if kind in (tuple, list) else kind(*vals)


def unflatten(spec, leaves, inputs=()):
    """Rebuild the function's result from the computed tensors (and the call's input tensors)."""
    return _build(spec, list(leaves), iter(range(1 << 62)), inputs)


def _map_tensors(obj, f):
    """`obj` with every Tensor inside (nested tuples, lists, dicts) replaced by f(tensor), in order."""
    if isinstance(obj, Tensor):
        return f(obj)
    if type(obj) in (tuple, list):
        return type(obj)(_map_tensors(x, f) for x in obj)
    if type(obj) is dict:
        return {k: _map_tensors(v, f) for k, v in obj.items()}
    if hasattr(type(obj), "_stax_flatten"):     # a container of tensors an API defines (a BlockMask)
        tensors, rebuild = obj._stax_flatten()
        return rebuild([_map_tensors(t, f) for t in tensors])
    return obj


def input_tensors(args, kwargs=None) -> list:
    """The tensors of a call, in the order `capture` makes placeholders of them: positional
    arguments, then keyword arguments by name, looking inside tuples, lists and dicts (a tensor
    passed in a list is an input, not a constant frozen at its first value)."""
    found = []
    _map_tensors((list(args), [(kwargs or {})[k] for k in sorted(kwargs or {})]), found.append)
    return found


def capture(fn, args: list, kwargs: dict | None = None, shape_env=None, dynamic_dims=None,
            sized_ints=(), scalar_args=()):
    """Run `fn` on proxies of the tensor arguments; return (graph, output spec).

    Non-tensor arguments are passed through unchanged (their values are part of the key), except
    `sized_ints` (dynamic mode, §10.4): (argument position or keyword, carrier) pairs, an int
    argument carried as the size of a 1-D tensor placed after the call's tensors; the function
    gets that placeholder's `shape[0]`, a SymInt when the size is a symbol.
    Tensor inputs that share memory become views of one base placeholder (`aliasing`).
    Raises GraphBreak when the function needs tensor data to decide what to do, prints, takes a
    numpy array nested in a container, or does numpy what numpy_args.NdProxy does not cover (a
    top-level array argument, converted by `ndarray_inputs`, is seen as an NdProxy).
    `scalar_args`: (argument position or keyword, name) of float arguments passed at run time
    (`SymFloat`s); SpecializeScalar when the function needs one as a Python number.
    """
    kwargs = kwargs or {}
    _reject_ndarrays(list(args) + [kwargs[k] for k in sorted(kwargs)])
    tracer = Tracer(shape_env, dynamic_dims)
    real = input_tensors(args, kwargs) + [c for _, c in sized_ints]
    alias = aliasing(real) if not sized_ints else None
    prev = set_tracer(tracer)
    try:
        with _print_breaks_graph(tracer):
            made = iter(_input_proxies(tracer, real, alias))
            proxies = _map_tensors(list(args), lambda t: next(made))
            kw = dict(zip(sorted(kwargs), _map_tensors([kwargs[k] for k in sorted(kwargs)],
                                                       lambda t: next(made))))
            _wrap_ndarrays(args, kwargs, proxies, kw)
            for where, _ in sized_ints:     # an int argument: its carrier's size (a SymInt)
                (kw if isinstance(where, str) else proxies)[where] = next(made).shape[0]
            for where, name in scalar_args:     # a float argument passed at run time
                (kw if isinstance(where, str) else proxies)[where] = SymFloat(name, where, tracer)
            tracer.graph.scalars = [name for _, name in scalar_args]
            result = _run_specializing(tracer, fn, proxies, kw)
            leaves = []
            # the outputs are read while tracing: a view of a value updated in place since the view
            # was taken is regenerated from the new value, which records nodes
            spec = _flatten(result, leaves, lambda t: _input_alias(t, tracer) if t._node is not None else None)
            tracer.graph.outputs = [tracer._node_of(x) for x in leaves]
    finally:
        set_tracer(prev)
    g = tracer.graph
    if shape_env is not None:
        g.checks = list(shape_env.checks)
        g.bounds = {s: hi for s, (lo, hi) in shape_env.ranges.items()
                    if hi is not None and s not in shape_env.unbacked}
        g.hints = dict(shape_env.hints)
    _check_unexpressible_writes(g, tracer, alias)
    _drop_dead_nodes(g)
    return g, spec


def tensor_layouts(g) -> list:
    """(shape, stride, offset) of every tensor the graph holds: its inputs and each node's result."""
    return [(n.meta.shape, n.meta.stride, n.meta.offset) for n in g.inputs + g.nodes if n.meta is not None]


def _wrap_ndarrays(args, kwargs, proxies, kw):
    """Each ndarray argument's proxy as the function sees it: an NdProxy (numpy's semantics)."""
    for i, a in enumerate(args):
        if a.__class__ is Tensor and "_ndarray" in a.__dict__:
            proxies[i] = NdProxy(proxies[i], False, not a._ndarray.flags.writeable)
    for k, a in kwargs.items():
        if a.__class__ is Tensor and "_ndarray" in a.__dict__:
            kw[k] = NdProxy(kw[k], False, not a._ndarray.flags.writeable)


def _run_specializing(tracer, fn, args, kwargs):
    """fn(*args, **kwargs); SpecializeScalar when it read a run-time float as a number, even if
    it caught the exception itself (it would have gone on with a wrong value)."""
    try:
        result = fn(*args, **kwargs)
    except Exception:
        if tracer.specialize:
            raise SpecializeScalar(tracer.specialize) from None
        raise
    if tracer.specialize:
        raise SpecializeScalar(tracer.specialize)
    return result


def _drop_dead_nodes(g):
    """Drop nodes nothing depends on (ops whose results the function never used)."""
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


def call_aliasing(args, kwargs=None):
    """`aliasing` of a call's tensors (CompiledFunction's key includes its pattern)."""
    if not kwargs and not any(type(a) in (tuple, list, dict) for a in args):
        tensors = [a for a in args if a.__class__ is Tensor]
    else:
        tensors = input_tensors(args, kwargs)
    return aliasing(tensors) if len(tensors) > 1 else None


def describe_aliasing(pattern) -> str:
    """A key's aliasing part in words (for the recompiles log)."""
    if pattern is None:
        return "none"
    return "; ".join(f"inputs {', '.join(map(str, positions))} share memory" + ("" if length else
                     " (not as views of one buffer)") for positions, length, _ in pattern[1:])
