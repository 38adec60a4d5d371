"""numpy ndarray arguments compiled as tensor inputs, with numpy's semantics (issue 9 item 3).

Layer: front, above tensor_ops.py / math_ops.py (whose ops it calls), below capture.py, which hands
the function an `NdProxy` over the placeholder of each top-level ndarray argument (the caller's
array is passed as `stax.from_numpy(a)`: zero copy, so in-place updates reach it) and turns each
`NdProxy` the function returns back into an ndarray (or a numpy scalar, where numpy gives one).

Consumes numpy operations on the stand-in: operators, comparisons, basic indexing and slicing,
`.T`, `.shape`, `.reshape`, `.transpose`, `.astype`, `.sum/.mean/.max/.min(axis=, keepdims=)`,
ufuncs through `__array_ufunc__` (np.exp, np.sqrt, np.maximum, np.matmul, ...) and a few functions
through `__array_function__` (np.sum, np.mean, np.where, np.reshape, np.transpose, ...). Produces
Stax ops recorded by the tracer, with numpy's result dtypes (NumPy 2 / NEP 50: each ufunc's loop
dtypes come from `ufunc.resolve_dtypes`, Python scalars weak): int32 + 1.0 is float64, int / int
float64, float32 + 1.0 float32, sums of int32 int64. Anything else is a graph break (the call runs
eagerly, in numpy; fullgraph=True raises): never a wrong answer.

Where to look:
  - `NdProxy` .............. the stand-in: metadata, operators, indexing, methods
  - `apply_ufunc` .......... one ufunc call: loop dtypes, casts, the Stax op, `out=` writes
  - `_UFUNCS`, `_FUNCTIONS`  what is supported
  - `_reduce` .............. sum/mean/max/min with numpy's dtypes
"""
from __future__ import annotations

import builtins
import numbers

import numpy as np

from . import tensor_ops
from .dtypes import DTYPES
from .tensor import Tensor, current_tracer, full

# ---- §3 The dtypes numpy and Stax share ----

_TO_STAX = {np.dtype(name): d for name, d in DTYPES.items() if d.np == d.compute or d.name == "float16"}


def _stax_dtype(npdt):
    d = _TO_STAX.get(np.dtype(npdt))
    if d is None:
        _break(f"numpy dtype {np.dtype(npdt)} (Stax has no such dtype)")
    return d


def _break(reason: str):
    current_tracer().graph_break(f"a numpy operation Stax does not compile: {reason} (the call runs "
                                 "in numpy; stax.from_numpy(array) compiles it with Stax's semantics)")


# ---- §3 The stand-in ----


class NdProxy:
    """What the traced function sees of an ndarray argument (and of arrays computed from it):
    a Stax proxy tensor `t` with numpy's semantics on top. `scalar`: numpy would give a numpy
    scalar here (a 0-d ufunc or reduction result), not a 0-d array. `readonly`: a view of an
    array numpy does not let the function write to (np.broadcast_to's, flags.writeable False)."""
    __slots__ = ("t", "scalar", "readonly")
    __array_priority__ = 1000

    def __init__(self, t, scalar=False, readonly=False):
        self.t, self.scalar, self.readonly = t, scalar, readonly

    def __repr__(self):
        return f"NdProxy(shape={tuple(self.t.shape)}, dtype={self.dtype})"

    def _stax_from_numpy(self):     # stax.from_numpy(a) inside the function: the tensor over a's memory
        return self.t

    def __getattr__(self, name):     # an ndarray method or attribute the stand-in lacks
        if hasattr(np.ndarray, name):
            _break(f"ndarray.{name}")
        raise AttributeError(f"'numpy.ndarray' object has no attribute '{name}'")

    # -- metadata --
    @property
    def dtype(self):
        return np.dtype(self.t.dtype.name)

    @property
    def shape(self):
        return tuple(self.t.shape)

    @property
    def ndim(self):
        return self.t.ndim

    @property
    def size(self):
        n = 1
        for s in self.t.shape:
            n = n * s
        return n

    def __len__(self):
        if self.t.ndim == 0:
            raise TypeError("len() of unsized object")
        return len(self.t)

    @property
    def T(self):
        return self.transpose()

    # -- data: not while tracing --
    def _data(self, what):
        _break(f"{what} reads the array's data")

    def __bool__(self):
        self._data("bool()")

    def __float__(self):
        self._data("float()")

    def __int__(self):
        self._data("int()")

    def __index__(self):
        self._data("an index")

    def __iter__(self):
        self._data("iterating over it")

    def __str__(self):
        self._data("str()")

    def __format__(self, spec):
        self._data("format()")

    def __array__(self, *args, **kwargs):
        self._data("np.asarray()")

    def item(self, *args):
        self._data(".item()")

    def tolist(self):
        self._data(".tolist()")

    # -- numpy's entry points --
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__":
            _break(f"np.{ufunc.__name__}.{method}")
        return apply_ufunc(ufunc, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        fn = _FUNCTIONS.get(getattr(func, "__name__", None))
        if fn is None or getattr(func, "__module__", "").partition(".")[0] != "numpy":
            _break(f"np.{getattr(func, '__name__', func)}")
        return fn(*args, **kwargs)

    # -- views --
    def __getitem__(self, key):
        items = key if isinstance(key, tuple) else (key,)
        for k in items:
            if isinstance(k, slice):
                if k.step is not None and (not isinstance(k.step, numbers.Integral) or k.step <= 0):
                    _break("a slice with a negative or non-integer step")
            elif not (k is None or k is Ellipsis or (isinstance(k, numbers.Integral) and not isinstance(k, (builtins.bool, np.bool_)))):
                _break("advanced indexing (arrays, lists or booleans as indices)")
        out = self.t[key if not isinstance(key, numbers.Integral) else int(key)]
        return NdProxy(out, out.ndim == 0 and not any(k is Ellipsis for k in items), self.readonly)

    def __setitem__(self, key, value):
        target = self[key]
        _write(NdProxy(target.t, False, self.readonly), value, "an assignment")

    def reshape(self, *shape, order="C"):
        if order != "C":
            _break(f"reshape(order={order!r})")
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        return NdProxy(self.t.reshape(*shape), False, self.readonly)

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        axes = tuple(axes) or tuple(reversed(range(self.t.ndim)))
        return NdProxy(self.t.permute(*axes), False, self.readonly)

    def astype(self, dtype, copy=True):
        dt = _stax_dtype(dtype)
        if dt is self.t.dtype and not copy:
            return self                 # numpy returns the array itself: writes reach it
        t = self.t.clone() if dt is self.t.dtype else self.t.to(dt)
        return NdProxy(t, self.scalar)

    def copy(self):
        return NdProxy(self.t.clone(), self.scalar)

    # -- reductions --
    def sum(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce("sum", self, axis, keepdims, dtype, out)

    def mean(self, axis=None, dtype=None, out=None, keepdims=False):
        return _reduce("mean", self, axis, keepdims, dtype, out)

    def max(self, axis=None, out=None, keepdims=False):
        return _reduce("max", self, axis, keepdims, None, out)

    def min(self, axis=None, out=None, keepdims=False):
        return _reduce("min", self, axis, keepdims, None, out)


def _operator(ufunc, reverse=False, inplace=False):
    def method(self, other):
        if isinstance(other, Tensor):
            _break("an operation between an ndarray and a Stax tensor (see docs/DESIGN.md)")
        ins = (other, self) if reverse else (self, other)
        return apply_ufunc(ufunc, ins, {"out": (self,)} if inplace else {})
    return method


for _name, _uf in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
                   "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power,
                   "matmul": np.matmul, "and": np.bitwise_and, "or": np.bitwise_or,
                   "xor": np.bitwise_xor}.items():
    setattr(NdProxy, f"__{_name}__", _operator(_uf))
    setattr(NdProxy, f"__r{_name}__", _operator(_uf, reverse=True))
    setattr(NdProxy, f"__i{_name}__", _operator(_uf, inplace=True))
for _name, _uf in {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
                   "gt": np.greater, "ge": np.greater_equal}.items():
    setattr(NdProxy, f"__{_name}__", _operator(_uf))
NdProxy.__hash__ = None
NdProxy.__neg__ = lambda self: apply_ufunc(np.negative, (self,), {})
NdProxy.__pos__ = lambda self: apply_ufunc(np.positive, (self,), {})
NdProxy.__abs__ = lambda self: apply_ufunc(np.absolute, (self,), {})
NdProxy.__invert__ = lambda self: apply_ufunc(np.invert, (self,), {})


# ---- §3 Ufuncs: numpy's loop dtypes over Stax ops ----


def _float_only(fn):
    """Integer forms whose numpy semantics Stax's op does not share (// and % by 0 give 0 with
    a warning in numpy; int ** negative raises): graph breaks."""
    def apply(*xs):
        if not xs[0].dtype.is_floating_point:
            _break("integer //, % or ** (numpy's zero-divisor and negative-power rules)")
        return fn(*xs)
    return apply


def _invert(x):
    return tensor_ops.logical_not(x) if x.dtype.name == "bool" else tensor_ops.bitwise_not(x)


_UFUNCS = {
    np.add: tensor_ops.add, np.subtract: tensor_ops.sub, np.multiply: tensor_ops.mul,
    np.true_divide: tensor_ops.div, np.floor_divide: _float_only(tensor_ops.floordiv),
    np.remainder: _float_only(tensor_ops.remainder), np.power: _float_only(tensor_ops.pow),
    np.maximum: tensor_ops.maximum, np.minimum: tensor_ops.minimum, np.arctan2: tensor_ops.atan2,
    np.equal: tensor_ops.eq, np.not_equal: tensor_ops.ne, np.less: tensor_ops.lt,
    np.less_equal: tensor_ops.le, np.greater: tensor_ops.gt, np.greater_equal: tensor_ops.ge,
    np.logical_and: tensor_ops.logical_and, np.logical_or: tensor_ops.logical_or,
    np.logical_xor: tensor_ops.logical_xor, np.logical_not: tensor_ops.logical_not,
    np.bitwise_and: tensor_ops.bitwise_and, np.bitwise_or: tensor_ops.bitwise_or,
    np.bitwise_xor: tensor_ops.bitwise_xor, np.invert: _invert,
    np.negative: tensor_ops.neg, np.positive: lambda x: x.clone(), np.absolute: tensor_ops.abs,
    np.exp: tensor_ops.exp, np.exp2: tensor_ops.exp2, np.log: tensor_ops.log, np.log2: tensor_ops.log2,
    np.log1p: tensor_ops.log1p, np.expm1: tensor_ops.expm1, np.sqrt: tensor_ops.sqrt,
    np.sin: tensor_ops.sin, np.cos: tensor_ops.cos, np.tanh: tensor_ops.tanh,
    np.floor: tensor_ops.floor, np.ceil: tensor_ops.ceil, np.trunc: tensor_ops.trunc,
    np.rint: tensor_ops.round, np.isnan: tensor_ops.isnan, np.isinf: tensor_ops.isinf,
    np.square: lambda x: tensor_ops.mul(x, x), np.matmul: tensor_ops.matmul,
}


def _weak(x):
    """resolve_dtypes' spelling of an operand: a dtype, or the Python type of a weak scalar."""
    if isinstance(x, NdProxy):
        return x.dtype
    if isinstance(x, np.generic):
        return x.dtype
    if type(x) in (builtins.bool, builtins.int, builtins.float):
        return type(x)
    _break(f"an operand of type {type(x).__name__}")


def _operand(x, loop):
    """An operand cast to its loop dtype: a Stax tensor, or a Python scalar already rounded to
    that dtype (numpy converts a scalar to the loop dtype first; Stax would keep it exact)."""
    if isinstance(x, NdProxy):
        dt = _stax_dtype(loop)
        return x.t if x.t.dtype is dt else x.t.to(dt)
    try:
        with np.errstate(all="ignore"):
            return np.asarray(x, dtype=loop).item()
    except (OverflowError, ValueError, TypeError):      # numpy raises: so will the eager call
        _break(f"the scalar {x!r} does not convert to {loop}")


def apply_ufunc(ufunc, inputs, kwargs):
    """One ufunc call on stand-ins and scalars: numpy's result (a new NdProxy), or the write
    into `out=` (an argument's memory in the end: a mutated input, written back)."""
    fn = _UFUNCS.get(ufunc)
    out = kwargs.pop("out", None)
    if fn is None or kwargs:
        _break(f"np.{ufunc.__name__}" + (f" with {sorted(kwargs)}" if kwargs else ""))
    try:
        loops = ufunc.resolve_dtypes(tuple(_weak(x) for x in inputs) + (None,) * ufunc.nout)
    except Exception as e:          # (numpy has no loop for these dtypes: the eager call raises)
        _break(f"np.{ufunc.__name__} on {[str(_weak(x)) for x in inputs]}: {e}")
    if not any(isinstance(x, NdProxy) for x in inputs):
        _break(f"np.{ufunc.__name__} on scalars only")
    args = [_operand(x, dt) for x, dt in zip(inputs, loops)]
    if not any(isinstance(a, Tensor) for a in args):
        _break(f"np.{ufunc.__name__} on scalars only")
    if ufunc is np.matmul and loops[0] == np.bool_:
        _break("np.matmul of bool arrays")
    res = fn(*args)
    want = _stax_dtype(loops[-1])
    if res.dtype is not want:
        res = res.to(want)
    result = NdProxy(res, res.ndim == 0)
    if out is None:
        return result
    target = out[0] if isinstance(out, tuple) and len(out) == 1 else out
    if not isinstance(target, NdProxy):
        _break("out= that is not an array argument or an array computed from one")
    if not np.can_cast(loops[-1], target.dtype, "same_kind"):
        _break(f"out= of dtype {target.dtype} for a {loops[-1]} result (numpy raises)")
    _write(target, result, f"np.{ufunc.__name__}(..., out=)")
    return target


def _write(target: NdProxy, value, what):
    """An in-place write of `value` into `target` (numpy casts it to target's dtype)."""
    if target.readonly:
        _break(f"{what} into a read-only array (numpy raises)")
    if isinstance(value, NdProxy):
        if tuple(np.broadcast_shapes(value.shape, target.shape)) != target.shape:
            _break(f"{what} of a value of shape {value.shape} into shape {target.shape}")
        v = value.t
    else:
        v = _operand(value, target.dtype)
    target.t.copy_(v if not isinstance(v, Tensor) or v.dtype is target.t.dtype else v.to(target.t.dtype))


# ---- §3 Reductions ----


def _reduce(kind, x, axis, keepdims, dtype, out):
    if dtype is not None or out is not None:
        _break(f".{kind}(dtype=, out=)")
    if not isinstance(x, NdProxy):
        _break(f"np.{kind} of {type(x).__name__}")
    # (a bad axis raises numpy's own AxisError here, as the eager call would)
    probe = getattr(np, kind)(np.ones((1,) * x.ndim, x.dtype), axis=axis, keepdims=keepdims)
    dims = tuple(range(x.ndim)) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    dims = tuple(int(d) % builtins.max(x.ndim, 1) for d in dims)
    want = _stax_dtype(probe.dtype)
    if kind in ("max", "min") and any(x.shape[d] == 0 for d in dims):
        _break(f".{kind}() of an empty axis (numpy raises)")
    t = x.t
    if not dims:
        res = t.clone()
    elif kind == "sum":
        res = t.to(want).sum(dim=dims, keepdim=keepdims) if t.dtype is not want else t.sum(dim=dims, keepdim=keepdims)
    elif kind == "mean":
        wide = want if not want.name.startswith("float16") else _stax_dtype("float32")
        res = t.to(wide).mean(dim=dims, keepdim=keepdims)
    else:
        res = (t.amax if kind == "max" else t.amin)(dim=dims, keepdim=keepdims)
    if res.dtype is not want:
        res = res.to(want)
    return NdProxy(res, res.ndim == 0 and not keepdims)


# ---- §3 __array_function__: the numpy functions the stand-in takes ----


def _where(cond, x=None, y=None):
    if x is None or y is None or not isinstance(cond, NdProxy):
        _break("np.where with one argument, or a condition that is not an array")
    probe = np.where(np.zeros(0, bool), _probe(x), _probe(y))
    want = probe.dtype
    c = cond.t if cond.dtype == np.bool_ else tensor_ops.ne(cond.t, 0)
    a, b = _operand(x, want), _operand(y, want)
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        a = full(tuple(c.shape), a, dtype=_stax_dtype(want), device=c.device)
    res = tensor_ops.where(c, a, b)
    return NdProxy(res if res.dtype is _stax_dtype(want) else res.to(_stax_dtype(want)), False)


def _probe(x):
    """A zero-size array (or the scalar itself) with x's dtype, for numpy to say the result dtype."""
    return np.zeros(0, x.dtype) if isinstance(x, NdProxy) else x


def _method(name):
    def fn(a, *args, **kwargs):
        if not isinstance(a, NdProxy):
            _break(f"np.{name} of {type(a).__name__}")
        return getattr(a, name)(*args, **kwargs)
    return fn


_FUNCTIONS = {
    "sum": _method("sum"), "mean": _method("mean"), "max": _method("max"), "amax": _method("max"),
    "min": _method("min"), "amin": _method("min"), "reshape": _method("reshape"),
    "transpose": _method("transpose"), "copy": _method("copy"), "where": _where,
    "shape": lambda a: a.shape, "ndim": lambda a: a.ndim, "size": lambda a: a.size,
}
