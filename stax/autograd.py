"""Eager autograd on the tiny tensor (§5: the backward pass a training step needs).

Layer: front, above tensor_ops (whose functions the derivative formulas call) and tensor (whose
choke points `_dispatch` and `_write` call `record` and `before_write`/`after_write` here).

Consumes: every primitive op run while grad mode is on with an input that requires grad (the op,
its inputs, params and output), and the formulas of `op_table.DERIVATIVES`.
Produces: a graph of `GradNode`s behind each result (`t.grad_fn`), and on `t.backward()` /
`autograd.grad(...)` the gradients, computed with Stax's own ops (so they run eagerly, or are
captured into a graph when the backward runs inside a compiled function).

Three rules come from PyTorch:
  - A node keeps edges to the nodes (or leaves) of its inputs as they were when it ran, so an
    in-place update that later rebinds a tensor's history cannot redirect an earlier gradient.
  - A node saves the values its formula reads (`_SAVES`) with their storage's version; a value
    changed in place afterwards makes backward raise (a wrong gradient is never returned). An
    in-place op's own inputs are snapshotted before it writes, so `h.mul_(y)` differentiates.
  - A leaf that requires grad may not be updated in place under grad mode; `.grad` accumulates.

Where to look: `record` (the forward hook), `GradNode`, `_run_backward` (the engine: topological
order, accumulation, version checks), `backward` and `grad` (the public entries), `no_grad`.
"""
from __future__ import annotations

import builtins
import functools
import sys
import threading
from types import SimpleNamespace

from . import tensor_ops as T
from .op_table import DERIVATIVES
from .indexing import _result_shape
from .shape_ops import flip as _flip
from .math_ops import ones_like, zeros_like     # (they keep the device: a CUDA backward stays on it)
from .tensor import Tensor, _meta, _op, arange

__all__ = ["backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "inference_mode",
           "GradNode"]

# ---- Grad mode ----


class _Mode(threading.local):
    enabled = True


_mode = _Mode()


def is_grad_enabled() -> bool:
    return _mode.enabled


def needs_grad(values) -> bool:
    """Does any tensor among `values` (nested in lists, tuples, dicts) take part in autograd?"""
    if not is_grad_enabled():
        return False
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, Tensor):
            if v.requires_grad:
                return True
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return False


class _GradModeContext:
    """Sets grad mode to `self.mode` inside a `with` block or a decorated function."""
    mode = True

    def __enter__(self):
        self.prev, _mode.enabled = _mode.enabled, self.mode
        return self

    def __exit__(self, *exc):
        _mode.enabled = self.prev

    def __call__(self, fn):
        mode = self.mode

        @functools.wraps(fn)
        def run(*a, **k):
            prev, _mode.enabled = _mode.enabled, mode
            try:
                return fn(*a, **k)
            finally:
                _mode.enabled = prev
        return run


class no_grad(_GradModeContext):
    """`with stax.no_grad():` (or `@stax.no_grad()`): ops record no history (an optimizer step)."""
    mode = False


class enable_grad(_GradModeContext):
    mode = True


class inference_mode(_GradModeContext):
    """`with stax.inference_mode():` records no history (no_grad; Stax has no separate
    inference tensors)."""

    def __init__(self, mode: bool = True):
        self.mode = not mode


class set_grad_enabled(_GradModeContext):
    """`stax.set_grad_enabled(False)` turns recording off now (as in PyTorch), and back to the
    previous mode at the end of a `with` block."""

    def __init__(self, mode: bool):
        self.mode = builtins.bool(mode)
        self.prev, _mode.enabled = _mode.enabled, self.mode

    def __enter__(self):
        return self


# ---- The graph ----

# what each formula reads besides shapes: "in" (the inputs' values), "out" (the output), both
_SAVES = {op: "in" for op in DERIVATIVES}
_SAVES.update({op: "" for op in ("add", "sub", "neg", "expand", "reshape", "permute", "slice", "select",
                                  "sum", "clone", "to_dtype", "cat", "floor", "ceil", "round", "trunc",
                                  "sign", "cumsum")})
_SAVES.update({op: "out" for op in ("exp", "exp2", "sqrt", "rsqrt", "tanh", "sigmoid", "expm1",
                                     "reciprocal", "relu")})
_SAVES.update({op: "in+out" for op in ("pow", "prod", "amax", "amin", "remainder", "sdpa", "omni_attn")})


class GradNode:
    """One recorded op: how to turn its output's gradient into its inputs' gradients."""
    n_outputs = 1       # outputs whose gradients arrive apart (a compiled region's: aot_autograd.py)

    def __init__(self, op, inputs, params, out):
        self.op, self.params, self.out_shape = op, params, out.shape
        saves = _SAVES.get(op, "")
        self.inputs = inputs                    # values (tensors and scalars) the formula reads
        self.out = out if "out" in saves else None
        self.versions = [(t, _version(t)) for t in self._saved()] if saves else []
        self.edges = [_edge(t) if isinstance(t, Tensor) and t.requires_grad else None for t in _flat(inputs)]
        self.freed = False

    def name(self) -> str:
        return f"{self.op.capitalize()}Backward"

    def __repr__(self):
        return f"<{self.name()}>"

    def _saved(self):
        saves = _SAVES.get(self.op, "")
        ins = [t for t in _flat(self.inputs) if isinstance(t, Tensor)] if "in" in saves else []
        return ins + ([self.out] if self.out is not None else [])

    def check_versions(self):
        for t, v in self.versions:
            if _version(t) != v:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: [{t.dtype._tname} {list(t.shape)}], which is output 0 of "
                    f"{self.name()}, is at version {_version(t)}; expected version {v} instead. "
                    "Clone it before the in-place update (x = x.clone()), or update a copy.")


def _edge(t):
    """Where `t`'s gradient goes: (its node or None for a leaf, t, which output of the node)."""
    return (t._grad_fn, t, getattr(t, "_output_nr", 0))


def _version(t) -> int:
    """A tensor's version: its storage's; a proxy's (a compiled function being captured, §5) is
    the count of in-place writes capture.Tracer.mutate made to its base."""
    if t._storage is not None:
        return t._storage.version
    root = t._base if t._base is not None else t
    return getattr(root, "_version", 0)


def _same_memory(a, b) -> bool:
    if a._storage is not None or b._storage is not None:
        return a._storage is b._storage
    return (a._base if a._base is not None else a) is (b._base if b._base is not None else b)


def _flat(inputs):
    return [x for a in inputs for x in (a if isinstance(a, list) else [a])]


def record(op, inputs, params, outs):
    """The forward hook (tensor._dispatch): give `outs` a Node when an input requires grad."""
    if not _mode.enabled:
        return
    if not any(isinstance(t, Tensor) and t.requires_grad for t in _flat(inputs)):
        return
    if op not in DERIVATIVES and not any(o.dtype.is_floating_point for o in outs):
        return                                  # integer/bool results carry no gradient
    node = GradNode(op, inputs, params, outs[0])
    for o in outs:
        if o.dtype.is_floating_point:
            o.requires_grad, o._grad_fn = True, node


# ---- In-place updates ----


def _fresh_nodes(value: Tensor, stop):
    """The nodes computing `value` back to (not into) `stop`: the in-place op's own expression."""
    todo, seen = [value._grad_fn], []
    while todo and len(seen) < 16:
        n = todo.pop()
        if n is None or n is stop or n in seen:
            continue
        seen.append(n)
        todo.extend(e[0] for e in n.edges if e is not None)
    return seen


def before_write(target: Tensor, value: Tensor) -> None:
    """Called before `target` is overwritten in place with `value` (tensor._write)."""
    if not _mode.enabled or not (target.requires_grad or value.requires_grad):
        return
    if target.requires_grad and target._grad_fn is None and target._base is None:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation. "
                           "Wrap the update in `with stax.no_grad():` (an optimizer step), or work on "
                           "x.clone().")
    if target._base is not None:
        raise NotImplementedError(
            "stax autograd: an in-place update of a view of a tensor that takes part in autograd is "
            "not supported yet. Update the whole tensor, or clone the view first (v = v.clone()).")
    with no_grad():                             # snapshot what the new value's nodes read of target
        for n in _fresh_nodes(value, target._grad_fn):
            for i, (t, v) in enumerate(n.versions):
                if _same_memory(t, target):
                    snap = T.clone(t)
                    n.versions[i] = (snap, _version(snap))
                    n.inputs = [snap if x is t else x for x in n.inputs]
                    n.out = snap if n.out is t else n.out


def after_write(target: Tensor, value: Tensor) -> None:
    if _mode.enabled and value.requires_grad:
        target.requires_grad, target._grad_fn = True, value._grad_fn
        target._output_nr = getattr(value, "_output_nr", 0)


def composite(op, inputs, params, compute):
    """A composite op with its own formula in DERIVATIVES (gelu): its pieces run without recording
    and one node stands for the whole, so its backward is the formula (Listing 9.3's kernel)."""
    if not _mode.enabled or not any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        return compute()
    with no_grad():
        out = compute()
    record(op, inputs, params, [out])
    return out


# ---- The engine ----


def _order(roots) -> list:
    """Nodes reachable from `roots`, each after every node that feeds a gradient into it."""
    order, state = [], {}
    for root in roots:
        stack = [(root, False)]
        while stack:
            n, done = stack.pop()
            if n is None or (state.get(n) == 2 and not done):
                continue
            if done:
                state[n] = 2
                order.append(n)
                continue
            if state.get(n) == 1:
                continue
            state[n] = 1
            stack.append((n, True))
            stack.extend((e[0], False) for e in n.edges if e is not None and e[0] is not None)
    return order[::-1]


def _accumulate(store: dict, key, g):
    store[key] = g if key not in store else store[key] + g


def _push(pending: dict, node, nr: int, g):
    """Add gradient `g` of output `nr` of `node`; a node of several outputs keeps one per output."""
    if node.n_outputs == 1:
        _accumulate(pending, node, g)
        return
    slots = pending.setdefault(node, [None] * node.n_outputs)
    slots[nr] = g if slots[nr] is None else slots[nr] + g


def _apply(node, g, create_graph, retain_graph=True):
    """The gradients of `node`'s inputs: its formula, or the node's own `apply` (a compiled region,
    which may let go of its saved tensors as it runs when the graph is not retained)."""
    if hasattr(node, "apply"):
        if create_graph:
            raise NotImplementedError(
                "stax: create_graph=True (a double backward) through a stax.compile'd function is not "
                "supported: its backward is a compiled artifact with no history. Call the function "
                "uncompiled (its .fn) for higher-order gradients.")
        return node.apply(g, retain_graph)
    formula = DERIVATIVES.get(node.op)
    if formula is None:
        raise NotImplementedError(
            f"stax autograd: the derivative of {node.op} is not implemented, and a gradient "
            "reached it. Compute that part under stax.no_grad() or on .detach()ed inputs, or "
            "add its formula to op_table.DERIVATIVES.")
    return formula(F, g, node.inputs, node.out, node.params)


def _run_backward(roots, grads, retain_graph, create_graph, wanted=None):
    """Propagate `grads` (root tensor -> gradient) to the leaves. With `wanted` (a dict: (node,
    output number) -> non-leaf tensor whose gradient is asked for), returns {tensor: gradient} for leaves and those
    tensors (`autograd.grad`); else accumulates into each leaf's `.grad` (`backward`)."""
    pending = {}                                # Node -> gradient of its output (or outputs)
    found = {}
    for t, g in zip(roots, grads):
        if t._grad_fn is None:
            _accumulate(found, t, g)
        else:
            _push(pending, t._grad_fn, getattr(t, "_output_nr", 0), g)
    with set_grad_enabled(create_graph):
        for node in _order([t._grad_fn for t in roots]):
            g = pending.pop(node, None)
            if g is None:
                continue
            if node.freed:
                raise RuntimeError("Trying to backward through the graph a second time (or directly "
                                   "access saved tensors after they have already been freed). Specify "
                                   "retain_graph=True on the first backward.")
            for nr in range(node.n_outputs) if wanted else ():
                if (node, nr) in wanted and (node.n_outputs == 1 or g[nr] is not None):
                    _accumulate(found, wanted[node, nr], g if node.n_outputs == 1 else g[nr])
            node.check_versions()
            outs = _apply(node, g, create_graph, bool(retain_graph))
            for edge, gi in zip(node.edges, outs):
                if edge is None or gi is None:
                    continue
                fn, t, nr = edge
                if gi.dtype is not t.dtype:
                    gi = T.to_dtype(gi, t.dtype)
                if fn is None:
                    _accumulate(found, t, gi)
                else:
                    _push(pending, fn, nr, gi)
            if not retain_graph:
                node.freed = True
    if wanted is not None:
        return found
    for t, g in found.items():
        if t.requires_grad and t._grad_fn is None:
            t.grad = g if t.grad is None else t.grad + g
    return None


def _root_grads(outputs, grad_outputs):
    out = []
    for t, g in zip(outputs, grad_outputs):
        if not t.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn "
                               "(call .requires_grad_() on an input, or compute outside stax.no_grad())")
        if g is None:
            if t.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs: pass a "
                                   f"gradient of shape {list(t.shape)} to backward()")
            g = ones_like(t)
        elif tuple(g.shape) != tuple(t.shape):
            raise RuntimeError(f"Mismatch in shape: grad_output[0] has a shape of {list(g.shape)} and "
                               f"output[0] has a shape of {list(t.shape)}.")
        out.append(g)
    return out


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False):
    """`t.backward(gradient)`: accumulate d(tensors)/d(leaf) into each leaf's `.grad`."""
    tensors = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    if grad_tensors is None or isinstance(grad_tensors, Tensor):
        grad_tensors = [grad_tensors] * len(tensors) if grad_tensors is None else [grad_tensors]
    retain = create_graph if retain_graph is None else retain_graph
    _run_backward(tensors, _root_grads(tensors, grad_tensors), retain, create_graph)


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False, allow_unused=False):
    """`stax.autograd.grad`: the gradients of `outputs` with respect to `inputs`, as a tuple
    (the leaves' `.grad` untouched)."""
    outputs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    single = isinstance(inputs, Tensor)
    inputs = [inputs] if single else list(inputs)
    if grad_outputs is None or isinstance(grad_outputs, Tensor):
        grad_outputs = [grad_outputs] * len(outputs) if grad_outputs is None else [grad_outputs]
    retain = create_graph if retain_graph is None else retain_graph
    # a non-leaf input: its gradient is what arrives at the node that computed it
    stops = {(t._grad_fn, getattr(t, "_output_nr", 0)): t for t in inputs if t._grad_fn is not None}
    found = _run_backward(outputs, _root_grads(outputs, grad_outputs), retain, create_graph, stops)
    result = []
    for t in inputs:
        g = found.get(t)
        if g is None and not allow_unused:
            raise RuntimeError("One of the differentiated Tensors appears to not have been used in the "
                               "graph. Set allow_unused=True if this is the desired behavior.")
        result.append(g)
    return tuple(result)


# ---- The tensor functions the formulas use (op_table.DERIVATIVES's F) ----


def _sum_to(g, shape):
    """Sum a broadcast gradient back to `shape` (leading dims, then dims that were 1)."""
    shape = tuple(shape)
    if g.ndim == len(shape) and tuple(g.shape) == shape:     # (ranks first: no guard s0 == 6, §10.4)
        return g
    lead = g.ndim - len(shape)
    dims = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1)
    out = T.sum(g, dims, keepdim=True) if dims else g
    return T.reshape(out, shape)


def _unreduce(g, x, dims, keepdim):
    """A reduction's output gradient broadcast back over the reduced dims of `x`."""
    if not keepdim:
        for d in sorted(dims):
            g = T.unsqueeze(g, d)
    return T.expand(g, x.shape)


def _slice_grad(g, x, p):
    z = zeros_like(x, dtype=g.dtype)
    _slice_view(z, p).copy_(g)
    return z


def _slice_view(z, p):
    key = [builtins.slice(None)] * z.ndim
    key[p["dim"]] = builtins.slice(p["start"], p["end"], p["step"])
    return z[tuple(key)]


def _select_grad(g, x, p):
    z = zeros_like(x, dtype=g.dtype)
    T.select(z, p["dim"], p["index"]).copy_(g)
    return z


def _matmul_grads(g, a, b):
    """A 2-D `b` that every batch of `a` shares gets ONE product over all rows, a[rows, k]ᵀ ·
    g[rows, n] (PyTorch's folding), not a batched product of per-batch partials summed afterwards
    (GPT-2's tied head: 8 × 768 × 50257 floats of them). A column-major `b` (F.linear's `w.t()`)
    gets its gradient as the transpose of gᵀ·a: a view of a product laid out as `w` itself, so the
    weight's gradient comes out contiguous instead of through a transposing copy."""
    ga = T.matmul(g, T.transpose(b, -1, -2))
    if b.ndim == 2:
        k, n = b.shape
        if a.ndim > 2:
            a, g = T.reshape(a, (a.numel() // k if k else 0, k)), T.reshape(g, (g.numel() // n if n else 0, n))
        if k > 1 and b.stride() == (1, k):
            return ga, T.transpose(T.matmul(T.transpose(g, 0, 1), a), 0, 1)
        return ga, T.matmul(T.transpose(a, 0, 1), g)
    gb = T.matmul(T.transpose(a, -1, -2), g)
    return _sum_to(ga, a.shape), _sum_to(gb, b.shape)


def _cat_grads(g, xs, dim):
    out, start = [], 0
    d = dim % g.ndim
    for x in xs:
        n = x.shape[d]
        out.append(T.narrow(g, d, start, n) if isinstance(x, Tensor) and x.requires_grad else None)
        start += n
    return out


def _index_put(x, values, indices, p, accumulate):
    return _op("index_put", [x, values, *indices], {"dims": p["dims"], "pos": p["pos"],
               "accumulate": accumulate, "op": p["op"]}, x._meta)


def _index(g, indices, p):
    shape = _result_shape(g, indices, p["dims"], p["pos"])
    return _op("index", [g, *indices], {"dims": p["dims"], "pos": p["pos"], "op": p["op"]},
               _meta(shape, g.dtype, g.device))


def _pick_grad(g, x, index, dim=1):
    """The gradient of nll_loss's pick x[..., t, ...] (nn.functional._pick: one element of each
    row along the class dim): g where the class is the target, else 0. A pointwise value, so it
    fuses with the softmax's gradient into one pass over the logits; the general gather gradient
    (an index_put into a zeros tensor) would write and re-read an (N, C) buffer."""
    shape = [1] * x.ndim
    shape[dim] = x.shape[dim]
    classes = T.reshape(arange(x.shape[dim], device=index.device), shape)
    return T.where(T.eq(classes, index), g, 0.0)


F = SimpleNamespace(
    where=T.where, exp=T.exp, erf=T.erf, mul=T.mul, add=T.add, sin=T.sin, cos=T.cos, log=T.log, sign=T.sign, floor=T.floor, pow=T.pow,
    trunc=T.trunc, flip=lambda g, dims: _flip(g, *dims),
    sum=T.sum, prod=T.prod, cumsum=T.cumsum, permute=T.permute, reshape=T.reshape, to_dtype=T.to_dtype,
    sum_to=_sum_to, unreduce=_unreduce, slice_grad=_slice_grad, select_grad=_select_grad,
    matmul_grads=_matmul_grads, cat_grads=_cat_grads, is_tensor=lambda x: isinstance(x, Tensor),
    index=_index, index_put=_index_put, pick_grad=_pick_grad, zeros_like=lambda x, dt: zeros_like(x, dtype=dt),
    attention_grads=None)       # attention.py (above this module) plugs in sdpa's and omni_attn's


# ---- Tensor methods ----


def _backward_method(self, gradient=None, retain_graph=None, create_graph=False):
    backward(self, gradient, retain_graph, create_graph)


def _requires_grad_(self, requires_grad=True):
    if requires_grad and not (self.dtype.is_floating_point):
        raise RuntimeError("only Tensors of floating point dtype can require gradients")
    if self._grad_fn is not None and not requires_grad:
        raise RuntimeError("you can only change requires_grad flags of leaf variables.")
    self.requires_grad = builtins.bool(requires_grad)
    return self


def _detach(self):
    return Tensor._make(self._storage, self._meta, base=self._base, view_ops=self._view_ops,
                        node=self._node)


Tensor.backward = _backward_method
Tensor.requires_grad_ = _requires_grad_
Tensor.detach = _detach
Tensor.grad_fn = property(lambda self: self._grad_fn)
Tensor.is_leaf = property(lambda self: self._grad_fn is None)
# (the module itself: `stax.tensor` the attribute is the factory function of the same name)
sys.modules[Tensor.__module__]._AUTOGRAD = SimpleNamespace(record=record, before_write=before_write, after_write=after_write,
                                                          composite=composite)
