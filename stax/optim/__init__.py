"""`stax.optim`: PyTorch's SGD and AdamW, each step one compiled, fused update (§5, training).

Layer: the top of the stack, beside `stax/__init__.py` and `stax.nn`: it calls `stax.compile`, so
nothing in `stax/` imports it except the package's lazy `stax.optim` attribute.

Consumes: parameters (tensors that require grad) and the `.grad` that `backward()` left on them.
Produces: the parameters and the optimizer's state (momentum buffers, Adam's moments) updated in
place, with PyTorch's exact formulas (torch.optim.SGD / torch.optim.AdamW, single-tensor form).

How a step runs (horizontal fusion): the parameters of one param group that have a gradient are
batched by (device, dtype, step count), and each batch is ONE call of a `stax.compile`d function
that takes the lists of parameters, gradients and states and updates them in place under
`no_grad`. The graph holds every parameter's update; the scheduler fuses each parameter's chain
(read grad and states once, write parameter and states once) into one kernel, and fuses the
chains of parameters with the same number of elements side by side (`_flat_views` passes
contiguous tensors as 1-D views, so equal counts mean one iteration space): a step launches one
kernel per distinct parameter size (2 for an MLP of one width: weights, biases) from one
artifact. Sizes that differ stay separate kernels: the scheduler has no concatenating ("combo")
kernel over unequal ranges. What changes from step to step (the learning rate,
the bias corrections) is passed as tensors (0-d; AdamW's three in one 3-element tensor), so the key - and the artifact - stays the same and
a second step does not recompile; hyper-parameters that stay fixed (betas, eps, momentum) are
Python floats, specialized into the kernel text.

Where to look: `_adamw_update` and `_sgd_update` (the formulas, written once and run compiled or,
with `compiled=False`, eagerly), `Optimizer._batches` (the horizontal batching), `AdamW._step_batch`
(decay and bias corrections in one tensor), `Optimizer.state_dict` / `load_state_dict`.
"""
from __future__ import annotations

import builtins
import math

from .. import autograd as _autograd
from .. import tensor_ops as _t
from ..tensor import Meta as _Meta, Tensor
from ..tensor import tensor as _tensor
from ..math_ops import zeros_like as _zeros_like   # (tensor.zeros_like keeps no device)

__all__ = ["Optimizer", "SGD", "AdamW"]


# ---- §5 The update formulas (torch.optim's single-tensor algorithms) ----


def _adamw_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, scalars, beta1, beta2, eps, maximize):
    """torch.optim.AdamW: decoupled decay, moments, bias-corrected step. `scalars` holds `decay` =
    1 - lr*wd, `step_size` = -lr / (1 - beta1**step), `bc2_sqrt` = sqrt(1 - beta2**step): one
    3-element tensor (one host-to-device copy a step, not three)."""
    decay, step_size, bc2_sqrt = scalars[0], scalars[1], scalars[2]
    for i, p in enumerate(params):
        g = _t.neg(grads[i]) if maximize else grads[i]
        p.mul_(decay)
        exp_avgs[i].lerp_(g, 1 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        second = exp_avg_sqs[i]
        if max_exp_avg_sqs:                        # amsgrad: the running maximum of the second moment
            max_exp_avg_sqs[i].copy_(_t.maximum(max_exp_avg_sqs[i], second))
            second = max_exp_avg_sqs[i]
        denom = (second.sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(exp_avgs[i], denom, value=step_size)


def _adamw_flat(n, lists, scalars, beta1, beta2, eps, maximize, *tensors):
    """`_adamw_update` with its lists of tensors passed as one flat run of `lists` × `n`
    positional tensors: the compiled call's common path (a tensor per argument: its key, aliasing
    and inputs come without walking nested lists, a step's largest host cost after the kernels)."""
    ts = [list(tensors[k * n:(k + 1) * n]) for k in range(lists)] + [[]] * (5 - lists)
    _adamw_update(*ts, scalars, beta1, beta2, eps, maximize)


def _sgd_update(params, grads, bufs, fresh, neg_lr, momentum, dampening, weight_decay, nesterov, maximize):
    """torch.optim.SGD. `fresh[i]`: buffer i is new, so it starts as a copy of the gradient
    (PyTorch's first step), not as a damped update of zeros."""
    for i, p in enumerate(params):
        g = _t.neg(grads[i]) if maximize else grads[i]
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum != 0:
            if fresh[i]:
                bufs[i].copy_(g)
            else:
                bufs[i].mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(bufs[i], alpha=momentum) if nesterov else bufs[i]
        p.add_(g * neg_lr)


# ---- The optimizer base: param groups, batching, state_dict ----


def _scalar(value, like: Tensor) -> Tensor:
    """A 0-d float32 tensor (or 1-D, of a list of values) on `like`'s device: an input of the
    compiled step (no recompile when it changes; a 0-d tensor, or an element of one, does not
    promote a float16 parameter)."""
    from ..dtypes import float32
    return _tensor(value, dtype=float32, device=like.device)


def _flat_views(*lists):
    """The step's tensors (parameters, gradients, states: lists by role) as detached aliases of the
    same storage, flattened to 1-D where all of one parameter's tensors are contiguous: parameters
    of one element count (weights (6, 5) and (5, 6)) then share an iteration space and their
    updates fuse into one kernel. Detached, so a later call of the compiled step outside `no_grad`
    (`python -m stax run` re-times it) stays compiled instead of tripping autograd's rule on
    in-place updates of leaves."""
    out = [list(ts) for ts in lists]
    for i in range(len(out[0])):
        flat = all(ts[i].is_contiguous() for ts in out if ts)
        for ts in out:
            if ts:
                ts[i] = _flat(ts[i].detach()) if flat else ts[i].detach()
    return out


def _flat(t: Tensor) -> Tensor:
    """`t.reshape(-1)` of a contiguous tensor, without the general reshape's stride search."""
    n = t.numel()
    return t if t.ndim == 1 else _t._view(t, "reshape", {"shape": (n,)}, (n,), (1,), t._meta.offset)


def _flat_alias(g: Tensor) -> Tensor:
    """`_flat(g.detach())` of a contiguous gradient in one step: a fresh tensor over its storage
    (no autograd history, as detach gives), without building the detached tensor and the view."""
    m = g._meta
    if len(m.shape) == 1 and not g.requires_grad and g.grad_fn is None:
        return g
    n = g.numel()
    return Tensor._make(g._storage, _Meta((n,), (1,), m.dtype, m.device, m.offset))


class Optimizer:
    """What SGD and AdamW share: param groups (`param_groups`, `add_param_group`), per-parameter
    state (`state`, keyed by id(param)), `zero_grad`, `state_dict` / `load_state_dict`."""
    _update = None          # the formula (a plain function); each instance compiles its own copy

    def __init__(self, params, defaults: dict, compiled: bool = True):
        self.defaults, self.param_groups, self.state = dict(defaults), [], {}
        self._view_cache: dict = {}     # see _views
        self.compiled = compiled
        if compiled:
            from .. import compile as _compile      # lazy: stax/__init__ sits below this module
            self._fn = _compile(type(self)._update)
        else:
            self._fn = type(self)._update
        groups = list(params) if not isinstance(params, Tensor) else None
        if not groups:
            raise ValueError(f"{type(self).__name__}: params must be a non-empty iterable of tensors or "
                             "of dicts (param groups)")
        for g in (groups if isinstance(groups[0], dict) else [{"params": groups}]):
            self.add_param_group(g)

    def add_param_group(self, group: dict):
        params = group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"{type(self).__name__} optimizes tensors, got {type(p).__name__}")
            if not p.requires_grad or p.grad_fn is not None:
                raise ValueError(f"{type(self).__name__} can only optimize leaf tensors that require grad "
                                 "(make them with requires_grad=True)")
            if id(p) in seen:
                raise ValueError("some parameters appear in more than one parameter group")
            seen.add(id(p))
        unknown = set(group) - set(self.defaults) - {"params"}
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {sorted(unknown)} in a param group")
        full = {**self.defaults, **group, "params": params}
        self._check(full)
        self.param_groups.append(full)

    def zero_grad(self, set_to_none: bool = True):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        with _autograd.no_grad():
                            p.grad.zero_()

    def _batches(self, group):
        """Parameters with a gradient, batched by (device, dtype, step count): one compiled call each."""
        batches: dict = {}
        for p in group["params"]:
            if p.grad is None:                     # PyTorch skips it: no update, no state
                continue
            pm, gm = p._meta, p.grad._meta
            if gm.shape != pm.shape or gm.dtype != pm.dtype or gm.device != pm.device:
                raise ValueError(f"{type(self).__name__}.step: a gradient {p.grad.dtype.name}{list(p.grad.shape)} "
                                 f"on {p.grad.device} is set on a parameter {p.dtype.name}{list(p.shape)} on "
                                 f"{p.device}; a gradient must match its parameter's shape, dtype and device")
            st = self.state.setdefault(id(p), {})
            key = (str(p.device), p.dtype.name, st.get("step", 0))
            batches.setdefault(key, []).append(p)
        return batches.values()

    def _views(self, params, grads, *states):
        """`_flat_views` of the step's tensors. The views of the parameters and their states are kept
        while the same tensor objects come back (rebuilding them was most of a step's host time); the
        gradients' are rebuilt each step, since backward makes new ones and a kept view would keep
        a freed gradient's memory alive. The cache holds the tensors it was built from, so their ids
        stay unique while it lives; one entry per batch."""
        kept = [params, *states]
        tensors = [t for ts in kept for t in ts]
        key = (id(params[0]), len(tensors))
        cached = self._view_cache.get(key)
        if cached is None or not builtins.all(a is b for a, b in zip(cached[0], tensors)):
            views = _flat_views(*kept)
            flat = [v.ndim == 1 and t.ndim != 1 or t.ndim == 1 for v, t in zip(views[0], params)]
            cached = self._view_cache[key] = (tensors, views, flat)
        _, views, flat = cached
        if not builtins.all(g.is_contiguous() for g, f in zip(grads, flat) if f):
            return _flat_views(params, grads, *states)      # a gradient laid out unlike its parameter
        grad_views = [_flat_alias(g) if f else g.detach() for g, f in zip(grads, flat)]
        return [views[0], grad_views, *views[1:]]

    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns closure()'s loss if given."""
        loss = None
        if closure is not None:
            with _autograd.enable_grad():
                loss = closure()
        with _autograd.no_grad():
            for group in self.param_groups:
                for batch in self._batches(group):
                    self._step_batch(group, batch)
        return loss

    def state_dict(self) -> dict:
        """PyTorch's layout: state by parameter index, groups with `params` as index lists."""
        index, groups = {}, []
        for g in self.param_groups:
            ids = []
            for p in g["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        state = {index[pid]: dict(s) for pid, s in self.state.items() if pid in index and s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict):
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)):
            raise ValueError("load_state_dict: the saved param groups do not match this optimizer's "
                             "(group count or group sizes differ)")
        by_index = {i: p for a, b in zip(groups, self.param_groups) for i, p in zip(a["params"], b["params"])}
        self.state = {}
        for i, s in state_dict["state"].items():
            p = by_index[int(i)]
            self.state[id(p)] = {k: self._state_value(v, p) for k, v in s.items()}
        for a, b in zip(groups, self.param_groups):
            b.update({k: v for k, v in a.items() if k != "params"})

    @staticmethod
    def _state_value(v, p: Tensor):
        if not isinstance(v, Tensor):
            return v
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"load_state_dict: a state tensor of shape {tuple(v.shape)} does not fit a "
                             f"parameter of shape {tuple(p.shape)}")
        return _tensor(v, dtype=p.dtype, device=p.device)     # a copy, as PyTorch casts and copies

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(g.items()) if k != "params"]
        return "\n".join(lines + [")"])


# ---- SGD and AdamW ----


class SGD(Optimizer):
    """torch.optim.SGD(params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False,
    maximize=False). `compiled=False` runs the same formulas eagerly (op by op)."""
    _update = staticmethod(_sgd_update)

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 maximize=False, *, compiled: bool = True):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize), compiled)

    @staticmethod
    def _check(g):
        for k in ("lr", "momentum", "weight_decay"):
            if not g[k] >= 0:
                raise ValueError(f"SGD: invalid {k} {g[k]!r} (must be >= 0)")
        if g["nesterov"] and (g["momentum"] <= 0 or g["dampening"] != 0):
            raise ValueError("SGD: nesterov momentum needs momentum > 0 and dampening = 0")

    def _step_batch(self, g, batch):
        states = [self.state[id(p)] for p in batch]
        fresh = tuple(g["momentum"] != 0 and s.get("momentum_buffer") is None for s in states)
        for s, p, new in zip(states, batch, fresh):
            if new:
                s["momentum_buffer"] = _zeros_like(p)          # filled with the gradient by the step
        bufs = [s.get("momentum_buffer") for s in states] if g["momentum"] != 0 else []
        self._fn(*self._views(batch, [p.grad for p in batch], bufs), fresh, _scalar(-g["lr"], batch[0]),
                 float(g["momentum"]), float(g["dampening"]), float(g["weight_decay"]),
                 bool(g["nesterov"]), bool(g["maximize"]))


class AdamW(Optimizer):
    """torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    amsgrad=False, maximize=False). `compiled=False` runs the same formulas eagerly."""
    _update = staticmethod(_adamw_flat)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 maximize=False, *, compiled: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize), compiled)

    @staticmethod
    def _check(g):
        if not (g["lr"] >= 0 and g["eps"] >= 0 and g["weight_decay"] >= 0):
            raise ValueError(f"AdamW: lr, eps and weight_decay must be >= 0, got {g['lr']!r}, {g['eps']!r}, "
                             f"{g['weight_decay']!r}")
        b1, b2 = g["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"AdamW: betas must lie in [0, 1), got {g['betas']!r}")

    def _step_batch(self, g, batch):
        states = [self.state[id(p)] for p in batch]
        for s, p in zip(states, batch):
            if "step" not in s:
                s["step"] = 0
                s["exp_avg"], s["exp_avg_sq"] = _zeros_like(p), _zeros_like(p)
                if g["amsgrad"]:
                    s["max_exp_avg_sq"] = _zeros_like(p)
            s["step"] += 1
        step, (b1, b2), lr = states[0]["step"], g["betas"], g["lr"]
        # the step count enters as 0-d tensors (Python floats in the key would recompile every step)
        scalars = _scalar([1 - lr * g["weight_decay"], -lr / (1 - b1 ** step), math.sqrt(1 - b2 ** step)], batch[0])
        maxes = [s["max_exp_avg_sq"] for s in states] if g["amsgrad"] else []
        lists = [ts for ts in self._views(batch, [p.grad for p in batch], [s["exp_avg"] for s in states],
                                          [s["exp_avg_sq"] for s in states], maxes) if ts]
        self._fn(len(batch), len(lists), scalars, float(b1), float(b2), float(g["eps"]), bool(g["maximize"]),
                 *[t for ts in lists for t in ts])
