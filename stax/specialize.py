"""§2 The specialization key: what a compiled artifact is reused under, and §10.4's bookkeeping.

Layer: just below the API (`__init__`): imports the tensor (`tensor`, `dtypes`), the front end
(`capture`); `LastCall` calls a CUDA graph's generated replay (cudagraph.py) it is handed; `stax.compile`
(`CompiledFunction`) builds its keys and automatic-dynamic decisions from these functions.

Consumes a call's arguments; produces hashable keys (static: dtypes, devices, shapes, strides;
dynamic: ranks and the 0/1 sizes; a family key for automatic dynamic), the int arguments carried
as sizes, the float arguments passed at run time, and the words the recompiles log uses.

Where to look:
  - `key_of`, `rank_key_of`, `family_key_of`  the three keys (§2, §10.4 dynamic, automatic dynamic)
  - `sized_ints`, `dynamic_dims` ............ int arguments as sizes; which dims become symbols
  - `floats_of`, `scalar_key`, `Rekey` ...... float arguments passed at run time (§10.4)
  - `mark_dynamic`, `mark_static` ........... PyTorch's marks on a tensor
  - `describe_change` ....................... which guard failed, in words (STAX_LOGS=recompiles)
  - `LastCall` .............................. the memo of the last call's tensors (the host path
                                              of a call with the same tensors again)
"""
from __future__ import annotations

import builtins
import math
import os
import sys
import weakref
from operator import call as _call, is_ as _is

import numpy as np

from . import capture as _capture
from .dtypes import bool_ as _bool
from .tensor import Meta, Storage, Tensor


# ---- §2 The specialization key ----


def key_of(x):
    if x.__class__ is Tensor:
        m = x._meta
        return ("tensor", m.dtype.name, m.device, m.shape, m.stride)
    if x.__class__ is builtins.float and (x != x or x == 0):
        # -0.0 == 0.0 but 1/-0.0 is -inf; NaN != NaN would miss its own key on every call
        return ("float", "nan" if x != x else x, math.copysign(1.0, x))
    # builtins.*: this module's globals `bool`, `int`, `float` are the dtype aliases stax.bool, ...
    if isinstance(x, (builtins.bool, builtins.int, builtins.float, str, type(None))):
        return (type(x).__name__, x)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(key_of(y) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, key_of(v)) for k, v in x.items()))
    if isinstance(x, np.ndarray):      # always run eagerly (capture.py): one key, never a stale id
        return ("ndarray",)
    if hasattr(type(x), "_stax_flatten"):     # a container of tensors (a BlockMask): their layouts
        return (type(x).__name__, x._stax_key(), tuple(key_of(t) for t in x._stax_flatten()[0]))
    return ("object", id(x))


def rank_key_of(x):
    """§10.4 dynamic mode: a tensor's key holds its rank and which dims are 0 or 1 (specialized),
    not its sizes; the rest of the layout is checked by each artifact's guard function. An int
    argument >= 2 is a size too (`sized_ints`): its value is checked by the guard function."""
    if x.__class__ is Tensor:
        m = x._meta
        return ("tensor", m.dtype.name, m.device, tuple(s if s < 2 else None for s in m.shape))
    if x.__class__ is builtins.int and x >= 2:
        return ("int",)
    return key_of(x)


def family_key_of(x):
    """Automatic dynamic: calls whose tensors differ only in sizes (and whose int arguments differ
    only in value) are one family."""
    if x.__class__ is Tensor:
        m = x._meta
        return ("tensor", m.dtype.name, m.device, len(m.shape))
    if x.__class__ is builtins.int and x >= 2:
        return ("int",)
    return key_of(x)


CARRIER_STORAGE = Storage(np.zeros(1, np.bool_))


def sized_ints(args, kwargs) -> list:
    """§10.4: the int arguments (top level, >= 2) that dynamic mode may make symbols, each carried
    as the size of a stride-0 1-D tensor (no memory of its own): (position or keyword, carrier).
    The guard function and the wrapper then read it like any size; 0, 1 and negative ints stay in
    the key by value."""
    out = [(i, a) for i, a in enumerate(args) if a.__class__ is builtins.int and a >= 2]
    if kwargs:
        out += [(k, kwargs[k]) for k in sorted(kwargs) if kwargs[k].__class__ is builtins.int and kwargs[k] >= 2]
    return [(where, carrier(n)) for where, n in out]


def carrier(n: int) -> Tensor:
    """A size as a tensor input: stride 0, length `n`, no memory of its own (§10.4; compiled
    training saves the sizes its backward needs this way, aot_dynamic.py)."""
    return Tensor._make(CARRIER_STORAGE, Meta((n,), (0,), _bool, "cpu", 0))


def floats_of(args, kwargs) -> list:
    """(position or keyword, value) of a call's top-level float arguments (§10.4)."""
    out = [(i, a) for i, a in enumerate(args) if a.__class__ is builtins.float]
    if kwargs:
        out += [(k, kwargs[k]) for k in sorted(kwargs) if kwargs[k].__class__ is builtins.float]
    return out


def scalar_key(key, args, kwargs, scalars) -> tuple:
    """`key` with each run-time float argument (`scalars`: positions and keywords) keyed as
    ("scalar",), whatever its value (§10.4)."""
    key, names = list(key), sorted(kwargs) if kwargs else []
    for where in scalars:
        if isinstance(where, str):
            if kwargs and kwargs.get(where).__class__ is builtins.float:
                key[len(args) + names.index(where)] = (where, ("scalar",))
        elif where < len(args) and args[where].__class__ is builtins.float:
            key[where] = ("scalar",)
    return tuple(key)


def arg_at(args, kwargs, where):
    return kwargs[where] if isinstance(where, str) else args[where]


class Rekey(Exception):
    """A float argument was specialized while capturing (capture.SpecializeScalar): key the call
    again, that argument now by value."""


def user_stacklevel() -> int:
    """warnings.warn's stacklevel that names the user's line (the first frame outside stax/)."""
    here, level, frame = os.path.dirname(os.path.abspath(__file__)), 1, sys._getframe(1)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
        level, frame = level + 1, frame.f_back
    return level


def describe_dims(dims: dict, sized: list) -> str:
    """The dims that become symbols, in words: tensor inputs by position, then int arguments."""
    first_int = builtins.max(dims, default=-1) + 1 - len(sized)
    return ", ".join(f"int argument {sized[p - first_int][0]!r}" if p >= first_int else
                     f"tensor input {p} dim{'s' if len(ds) > 1 else ''} {', '.join(map(str, ds))}"
                     for p, ds in dims.items() if ds)


def dynamic_dims(args, kwargs, auto=None, ints=0) -> dict:
    """Input position (capture's placeholder order) -> the dims that become symbols: every dim
    of a tensor argument (or those `auto` lists), none of a tensor inside a list, tuple or dict
    (those stay specialized, §10.4); then the `ints` carriers of int arguments."""
    out, pos = {}, 0
    for top in list(args) + [kwargs[k] for k in sorted(kwargs or {})]:
        for t in _capture.input_tensors([top]):
            if t is not top:
                out[pos] = ()
            elif auto is not None:
                out[pos] = tuple(auto.get(pos, ()))
            else:
                marked = getattr(t, "_stax_static", ())
                out[pos] = tuple(d for d in range(t.ndim) if d not in marked)
            pos += 1
    for p in range(pos, pos + ints):
        out[p] = (0,) if auto is None else tuple(auto.get(p, ()))
    return out


def dynamic_inputs(args, kwargs) -> list:
    """What a dynamic artifact's guard function and wrapper read: the call's tensors, then the
    carriers of its int arguments."""
    return _capture.input_tensors(args, kwargs) + [c for _, c in sized_ints(args, kwargs)]


def mark_dynamic(t, dim):
    """`stax.mark_dynamic(t, dim)`: the next compile of a function taking `t` makes its dim `dim`
    a symbol even on the first call (automatic dynamic mode, `dynamic=None`)."""
    dims = set(getattr(t, "_stax_dynamic", ())) | {dim % builtins.max(t.ndim, 1)}
    t._stax_dynamic = tuple(sorted(dims))


def mark_static(t, dim):
    """`stax.mark_static(t, dim)`: dim `dim` of `t` stays a concrete size, even with dynamic=True."""
    dims = set(getattr(t, "_stax_static", ())) | {dim % builtins.max(t.ndim, 1)}
    t._stax_static = tuple(sorted(dims))


def describe_read_change(reads, old, new) -> str | None:
    """Which value read from a global, closure or attribute (`reads`, their names) changed between
    two keys' read parts, or None."""
    for r, a, b in zip(reads, old[1:], new[1:]):
        if a != b:
            return f"{r.name} changed from {a!r:.80} to {b!r:.80}"
    return None


def describe_change(old, new) -> str:
    """Which part of the key differs: the guard that failed, in words."""
    shared = [_capture.describe_aliasing(k[-1] if k and k[-1][0] == "aliasing" else None) for k in (old, new)]
    if shared[0] != shared[1]:
        return f"tensor inputs sharing memory changed from {shared[0]} to {shared[1]}"
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if a[0] == "tensor" and b[0] == "tensor":
            for what, k in (("dtype", 1), ("device", 2), ("size", 3), ("stride", 4)):
                if a[k] != b[k]:
                    return f"argument {i}: tensor {what} changed from {a[k]} to {b[k]}"
        if ("scalar",) in (a, b) or ("scalar",) in (a[1:], b[1:]):
            return f"argument {i}: a float passed at run time, or keyed by value"
        return f"argument {i} changed from {a[1:]!r} to {b[1:]!r}"
    return "the number of arguments changed"


# ---- §2 The last call again: a key decided without being built (host time per call) ----

_new = object.__new__


def _span(t):
    """The memory of `t`'s storage, as the key's aliasing test sees it (None: no elements)."""
    return None if 0 in t._meta.shape or t._storage is None else _capture.storage_memory(t._storage)



class LastCall:
    """The last call's tensors, held weakly, and what `CompiledFunction` decided for them (the
    key's entry, the aliasing, the reads' guard values). A tensor's storage and layout never
    change after it is made, so the very same tensors have the same key. `same` tests that (one
    pass over the tensors, which also sees a tensor that requires grad now: that call takes the
    training path); the caller checks the tracer, the matmul precision and the reads.

    `run` is the entry's call without `_run`'s general steps, for an entry that needs none of
    them: tensors only, no lifted constants, no run-time floats, no aliasing. A CUDA graph's call
    (`cudagraph.GraphedCall`) is given the token of the last call instead of the tensors, when
    that call passed its condition 2 whole: these are the same tensors, so it replays at once.
    While it holds a token (which holds the tensors), and no guarded reads are live, `same`,
    once it passed, hands the call to `hot`, the graph's generated replay of these tensors
    (`cudagraph.GraphedCall.replayer`: one `is` and one requires_grad read per tensor, the launch
    and the outputs in one function), which `CompiledFunction._call_again` calls first."""
    __slots__ = ("refs", "reads", "live", "key", "entry", "alias", "call", "consts", "spec", "token", "again",
                 "hot", "metas", "spans")

    def __init__(self, args, reads, live, key, entry, alias):
        self.refs = tuple([weakref.ref(a) for a in args])
        self.metas, self.spans = tuple([a._meta for a in args]), None
        self.reads, self.live, self.key, self.entry, self.alias = reads, live, key, entry, alias
        call, self.spec, flat, consts, lifts, _, floats = entry
        self.consts = list(consts)
        self.call = call if flat is True and not lifts and not floats and alias is None else None
        self.again, self.token, self.hot = getattr(self.call, "call_with_token", None), None, None

    def same(self, args, grad_enabled) -> bool:
        """The very tensors of the last call, in order (and, under grad mode, none requiring grad)."""
        if len(args) != len(self.refs):
            return False
        if grad_enabled:
            for a, r in zip(args, self.refs):
                if r() is not a or a.requires_grad:
                    return False
        elif not all(map(_is, args, map(_call, self.refs))):
            return False
        replayer = getattr(self.call, "replayer", None)     # (none for a value-guarded artifact:
        if self.token is not None and not self.live and replayer is not None:    # its token path checks)
            self.hot = replayer(self.token, len(args))     # the graph's replay of them from now on
        return True

    def similar(self, args, grad_enabled, ndarrays=False):
        """A LastCall of `args`' own (`rebound`) when they are the last call's tensors with some
        replaced (a new batch) and their key would be the last call's: each new one a plain
        tensor with the very dtype, device, sizes and strides of the one it replaces, none of
        `args` requiring grad (under grad mode), no two of them sharing memory (the key's
        aliasing part stays None: the last call had none). None otherwise, or when the function
        was ever given ndarrays (`ndarrays`: their marks are in the key): the full path decides."""
        refs, metas = self.refs, self.metas
        if ndarrays or len(args) != len(refs) or self.alias is not None:
            return None
        changed = [i for i, a, r in zip(range(len(refs)), args, refs) if r() is not a]
        for i in changed:
            t, o = args[i], metas[i]
            if t.__class__ is not Tensor or "_ndarray" in t.__dict__:
                return None
            m = t._meta
            if m.shape != o.shape or m.stride != o.stride or m.dtype.name != o.dtype.name or m.device != o.device:
                return None
        if grad_enabled and builtins.any([a.requires_grad for a in args]):
            return None
        # (the unchanged positions hold the last call's tensors: their spans are the last call's)
        spans = list(self.spans) if self.spans is not None else [_span(a) for a in args]
        for i in changed:
            spans[i] = _span(args[i])
        for i in changed:
            if spans[i] is not None:
                lo, hi = spans[i]
                if builtins.any(s is not None and s[0] < hi and lo < s[1] for j, s in enumerate(spans) if j != i):
                    return None
        return self.rebound(args, changed, tuple(spans))

    def rebound(self, args, changed, spans):
        """This decision for `args` (`similar` said it holds): a LastCall of their own, since a
        token belongs to the tensors it was given for."""
        new = _new(LastCall)
        for k in LastCall.__slots__:
            setattr(new, k, getattr(self, k))
        refs, metas = list(self.refs), list(self.metas)
        for i in changed:
            refs[i], metas[i] = weakref.ref(args[i]), args[i]._meta
        new.refs, new.metas, new.spans, new.token, new.hot = tuple(refs), tuple(metas), spans, None, None
        return new

    def run(self, args):
        outs = None
        if self.token is not None:
            outs = self.call.replay_again(self.token)
        if outs is None:
            inputs = list(args) + self.consts if self.consts else list(args)
            if self.again is None:
                outs = self.call(inputs)
            else:
                outs, token = self.again(inputs)
                if token is not self.token:   # (token[0]: these args, then the constants)
                    self.token, self.hot = token, None
        return self.result(outs, args)

    def result(self, outs, args):
        """The function's result from the artifact's outputs."""
        if self.spec is None:                 # one tensor returned
            return outs[0]
        return _capture.unflatten(self.spec, iter(outs), list(args))
