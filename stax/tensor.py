"""The tiny tensor: Stax's eager tensor, spelled like PyTorch, computed with numpy.

This is "the tiny tensor" of DESIGN.md. It gives the user a `Tensor` (shape, stride, storage
offset, dtype, device, storage shared between views), the factories, and eager execution of every
op with PyTorch's names, signatures, dtype-promotion rules and error messages. It consumes Python
scalars, nested lists and numpy arrays; it produces Tensors, and (for the compiler) the contract
below.

The contract with the compiler: every primitive op goes through one choke point, `_dispatch(op,
inputs, params, metas)`. Eagerly it runs `EAGER[op]` (plain numpy) or, for a view op, shares the
input's storage. While `capture.py` traces (module-level `TRACER` is set and an input is a proxy
tensor), `_dispatch` hands the op to `TRACER.record` instead. Composite ops (softmax, layer_norm,
var, gelu, ...) are written only in terms of the public functions, so they trace into primitives
automatically. In-place writes end in `_write(target, value)`, which the tracer sees as
`TRACER.mutate`; views carry `_base` and `_view_ops` so the tracer can replay them functionally.

Where to look:
  - data types and promotion:  DType, promote_types, result_type
  - metadata and storage:      Meta, Storage, Tensor
  - the choke point:           _dispatch, EAGER, VIEW_OPS, PRIMITIVES
  - views:                     permute/expand/_slice/select/reshape and their composites
  - pointwise ops:             the _UNARY / _BINARY tables
  - reductions, composites:    sum ... logsumexp, softmax, layer_norm, matmul, cat/stack
  - writes:                    _write, the in-place methods, Tensor.__setitem__
"""
import builtins as _b
import math
import operator
import os
from collections import namedtuple
from dataclasses import dataclass

import numpy as np

__all__ = """DType Meta Storage Tensor DTYPES float32 float64 float16 bfloat16 int32 int64 bool_
    promote_types result_type can_cast set_num_threads get_num_threads manual_seed tensor from_numpy
    set_default_device get_default_device
    zeros ones full empty zeros_like ones_like full_like arange rand randn permute expand expand_as
    select view reshape unsqueeze squeeze flatten transpose t narrow broadcast_shapes add sub div
    true_divide floor_divide multiply subtract to_dtype where clamp clip gelu silu sum prod amax
    amin argmax argmin max min mean var std logsumexp cumsum softmax log_softmax layer_norm matmul
    mm bmm cat concat stack clone contiguous nonzero unique copy_ fill_ zero_""".split()


# ---- Data types ----


class DType:
    """A Stax dtype: `np` is the storage dtype, `compute` the numpy dtype arithmetic runs in."""

    def __init__(self, name, torch_name, itemsize, kind, np_storage, np_compute):
        self.name, self._tname, self.itemsize, self.kind = name, torch_name, itemsize, kind
        self.np, self.compute = np.dtype(np_storage), np.dtype(np_compute)
        self.is_floating_point = kind == "f"

    def __repr__(self):
        return f"stax.{self.name}"

    def __reduce__(self):  # pickles (for the cache) as a reference to the module constant
        return (_dtype_by_name, (self.name,))


float32 = DType("float32", "Float", 4, "f", np.float32, np.float32)
float64 = DType("float64", "Double", 8, "f", np.float64, np.float64)
float16 = DType("float16", "Half", 2, "f", np.float16, np.float32)      # §6.2: computed in float32
bfloat16 = DType("bfloat16", "BFloat16", 2, "f", np.uint16, np.float32)  # stored as 16-bit words
int32 = DType("int32", "Int", 4, "i", np.int32, np.int32)
int64 = DType("int64", "Long", 8, "i", np.int64, np.int64)
bool_ = DType("bool", "Bool", 1, "b", np.bool_, np.bool_)
DTYPES = {d.name: d for d in (float32, float64, float16, bfloat16, int32, int64, bool_)}
# PyTorch's aliases. `bool`, `int`, `float` must not shadow the builtins inside this module, so
# they are reachable only as attributes (PEP 562 module __getattr__): stax.tensor.bool works.
_ALIASES = dict(DTYPES, float=float32, double=float64, half=float16, int=int32, long=int64)
_FROM_NP = {np.dtype(np.float32): float32, np.dtype(np.float64): float64,
            np.dtype(np.float16): float16, np.dtype(np.int32): int32,
            np.dtype(np.int64): int64, np.dtype(np.bool_): bool_}
_HALF = (float16, bfloat16)


def _dtype_by_name(name):
    return DTYPES[name]


def __getattr__(name):
    if name in _ALIASES:
        return _ALIASES[name]
    raise AttributeError(f"module 'stax.tensor' has no attribute '{name}'")


def promote_types(a, b):
    """PyTorch's promotion lattice: bool < int32 < int64 < float16, bfloat16 < float32 < float64."""
    if a is b:
        return a
    if a is bool_ or b is bool_:
        return b if a is bool_ else a
    if a.is_floating_point != b.is_floating_point:
        return a if a.is_floating_point else b
    if {a, b} == {float16, bfloat16}:
        return float32
    return a if a.itemsize >= b.itemsize else b


def _scalar_dtype(s):
    return bool_ if isinstance(s, bool) else int64 if isinstance(s, int) else float32


def _combine(higher, lower):
    # c10's combine_categories: a lower-priority group only matters if it is of a higher category
    if higher is None or lower is None:
        return lower if higher is None else higher
    if higher.is_floating_point:
        return higher
    if higher is bool_ or lower.is_floating_point:
        return promote_types(higher, lower)
    return higher


def result_type(*args):
    """Dimensioned tensors > zero-dim tensors > Python scalars, each compared by category."""
    groups = [None, None, None]
    for a in args:
        if isinstance(a, Tensor):
            g, d = (0 if a.ndim > 0 else 1), a.dtype
        elif isinstance(a, DType):
            g, d = 1, a
        else:
            g, d = 2, _scalar_dtype(a)
        groups[g] = d if groups[g] is None else promote_types(groups[g], d)
    return _combine(groups[0], _combine(groups[1], groups[2]))


def can_cast(frm, to):  # c10::canCast, for in-place results
    if frm.is_floating_point and not to.is_floating_point:
        return False
    return not (frm is not bool_ and to is bool_)


def _to_storage_form(a, dtype):
    """A numpy array in compute form -> the same values in `dtype`'s storage form (rounding once)."""
    if dtype is bfloat16:
        u = np.asarray(a, np.float32).view(np.uint32)
        rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)  # nearest-even
        return np.where(np.isnan(a), ((u >> 16) | 0x40).astype(np.uint16), rounded)  # keep NaN
    return np.asarray(a).astype(dtype.np, copy=False)


def _to_compute_form(a, dtype):
    if dtype is bfloat16:   # np.asarray: a 0-d shift gives a numpy scalar, not a 0-d array
        return np.asarray(a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32) if dtype is float16 else a


# ---- Metadata, storage, the Tensor ----

TRACER = None        # set by capture.py while tracing; see the module docstring
_NUM_THREADS = os.cpu_count() or 1
_RNG = np.random.default_rng()


def set_num_threads(n):
    global _NUM_THREADS
    _NUM_THREADS = _b.max(1, _b.int(n))


def get_num_threads():
    return _NUM_THREADS


def manual_seed(seed):
    global _RNG
    _RNG = np.random.default_rng(seed)


@dataclass
class Meta:
    """What the compiler knows about a tensor without its data. Sizes may be sympy expressions."""
    shape: tuple
    stride: tuple
    dtype: DType
    device: str = "cpu"
    offset: object = 0


@dataclass
class Storage:
    """Flat 1-D buffer of the storage dtype. A CUDA storage only has to provide the same fields."""
    data: np.ndarray
    device: str = "cpu"


def _contig(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc = None if s is None or acc is None else acc * s   # None: a data-dependent size
    return tuple(reversed(strides))


def _numel(shape):
    n = 1
    for s in shape:
        n = n * s
    return n


def _meta(shape, dtype, device="cpu"):
    shape = tuple(shape)
    return Meta(shape, _contig(shape), dtype, device, 0)


class Tensor:
    __array_ufunc__ = None   # numpy defers `ndarray op Tensor` to our reflected operators
    __hash__ = object.__hash__

    def __init__(self, *a, **k):
        raise TypeError("create tensors with stax.tensor(...), stax.zeros(...), stax.from_numpy(...)")

    @classmethod
    def _make(cls, storage, meta, base=None, view_ops=(), node=None):
        t = object.__new__(cls)
        t._storage, t._meta, t._base, t._view_ops, t._node = storage, meta, base, list(view_ops), node
        return t

    @classmethod
    def _proxy(cls, meta, node):
        return cls._make(None, meta, node=node)

    # metadata
    shape = property(lambda self: self._meta.shape)
    dtype = property(lambda self: self._meta.dtype)
    device = property(lambda self: self._meta.device)
    ndim = property(lambda self: len(self._meta.shape))
    T = property(lambda self: permute(self, tuple(range(self.ndim))[::-1]))

    def dim(self):
        return self.ndim

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[_wrap_dim(dim, self.ndim)]

    def stride(self, dim=None):
        return self._meta.stride if dim is None else self._meta.stride[_wrap_dim(dim, self.ndim)]

    def storage_offset(self):
        return self._meta.offset

    def numel(self):
        return _numel(self.shape)

    def element_size(self):
        return self.dtype.itemsize

    def is_floating_point(self):
        return self.dtype.is_floating_point

    def is_contiguous(self):
        expect = 1
        for size, st in zip(reversed(self.shape), reversed(self._meta.stride)):
            if size == 0:
                return True
            if size != 1 and st != expect:
                return False
            expect = expect * size
        return True

    def data_ptr(self):
        storage = self._storage
        if storage is None:
            self._need_data("data_ptr()")
        base = storage.data.ctypes.data if storage.device == "cpu" else storage.data.ptr
        return base + self._meta.offset * self._meta.dtype.itemsize

    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (select(self, 0, i) for i in range(self.shape[0]))

    # data access: a proxy has no data, so each of these is a graph break while tracing
    def _need_data(self, what):
        if self._node is not None:
            if TRACER is not None:
                TRACER.graph_break(f"{what} needs tensor data")
            raise RuntimeError(f"{what} needs tensor data, but this is a proxy tensor")

    def _np(self):
        """Storage-form strided numpy view (shares memory)."""
        self._need_data("reading a tensor")
        m, isz = self._meta, self.dtype.np.itemsize
        # a CUDA tensor is read through a host copy of its storage ("through the host", DESIGN.md)
        data = self._storage.data if self.device == "cpu" else self._storage.data.host()
        return np.lib.stride_tricks.as_strided(data[m.offset:], m.shape, tuple(s * isz for s in m.stride))

    def _compute(self):
        return _to_compute_form(self._np(), self.dtype)

    def numpy(self):
        self._need_data("numpy()")
        if self.device != "cpu":
            raise TypeError(f"can't convert {self.device}:0 device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        if self.dtype is bfloat16:
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self._np()

    def __array__(self, dtype=None, copy=None):
        self._need_data("__array__")
        a = self._compute() if self.dtype is bfloat16 else self._np()
        return a if dtype is None else a.astype(dtype)

    def tolist(self):
        self._need_data("tolist()")
        return self._compute().tolist()

    def item(self):
        self._need_data("item()")
        n = self.numel()
        if n != 1:
            raise RuntimeError(f"a Tensor with {n} elements cannot be converted to Scalar")
        return self._compute().reshape(-1)[0].item()

    def __bool__(self):
        self._need_data("bool()")
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return _b.bool(self.item())

    def __float__(self):
        self._need_data("float()")
        return _b.float(self.item())

    def __int__(self):
        self._need_data("int()")
        return _b.int(self.item())

    def __index__(self):
        self._need_data("__index__")
        if self.dtype.is_floating_point or self.numel() != 1:
            raise TypeError("only integer tensors of a single element can be converted to an index")
        return _b.int(self.item())

    def __format__(self, spec):
        return format(self.item(), spec) if self.ndim == 0 and self._node is None else repr(self)

    def __repr__(self):
        if self._node is not None:
            return f"Tensor(proxy {self._node}, shape={self.shape}, dtype={self.dtype})"
        suffix = "" if self.dtype in (float32, int64, bool_) else f", dtype={self.dtype}"
        if self.numel() == 0:
            return f"tensor([], size={self.shape}{suffix})"
        body = np.array2string(self._compute(), separator=", ", prefix="tensor(")
        return f"tensor({body}{suffix})"

    # casts
    def to(self, *args, dtype=None, device=None, copy=False):
        for a in args:
            if isinstance(a, DType):
                dtype = a
            elif isinstance(a, Tensor):
                dtype, device = a.dtype, a.device
            else:
                device = a
        x = self
        if device is not None and _norm_device(device) != self.device:
            x = _move(self, _norm_device(device))
        if dtype is None or dtype is x.dtype:
            return clone(x) if copy and x is self else x
        return to_dtype(x, dtype)

    def cpu(self):
        return self.to("cpu")

    def cuda(self):
        return self.to("cuda")

    def float(self): return self.to(float32)
    def double(self): return self.to(float64)
    def half(self): return self.to(float16)
    def bfloat16(self): return self.to(bfloat16)
    def int(self): return self.to(int32)
    def long(self): return self.to(int64)
    def bool(self): return self.to(bool_)

    def __setitem__(self, key, value):
        target = self[key]
        if isinstance(value, Tensor):
            if value.dtype is not target.dtype:
                value = to_dtype(value, target.dtype)
            try:
                value = expand(value, target.shape)
            except RuntimeError:
                raise RuntimeError(f"shape mismatch: value tensor of shape {list(value.shape)} "
                                   f"cannot be broadcast to indexing result of shape "
                                   f"{list(target.shape)}") from None
        else:
            value = full(target.shape, value, dtype=target.dtype, device=target.device)
        _write(target, value)

    def __getitem__(self, key):
        return _getitem(self, key)


# ---- Devices: CUDA tensors are stored on the GPU; eager ops on them run through the host ----


def _norm_device(device):
    dev = str(device)
    if dev == "cpu":
        return "cpu"
    from . import cuda
    return cuda.check_device(dev)


def _new_storage(flat, device):
    """Storage for a flat storage-form numpy array on `device` (copied to the GPU for 'cuda')."""
    if device == "cpu":
        return Storage(flat)
    from . import cuda
    return Storage(cuda.DeviceArray(flat.size, flat.dtype).upload(flat), device)


def _move(x, device):
    """A contiguous copy of `x` on `device` (cpu <-> cuda)."""
    x._need_data(f".to('{device}')")
    flat = np.ascontiguousarray(x._np()).reshape(-1)
    return Tensor._make(_new_storage(flat, device), _meta(x.shape, x.dtype, device))


def _wrap_dim(d, ndim):
    n = _b.max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {d})")
    return d % n if ndim > 0 else 0


def _shape_args(args):
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


def _is_proxy(x):
    if isinstance(x, (list, tuple)):
        return _b.any(_is_proxy(i) for i in x)
    return isinstance(x, Tensor) and x._node is not None


def _scalar(x):
    """Python scalar or Tensor; numpy scalars become Python scalars; anything else is an error."""
    if isinstance(x, (Tensor, _b.bool, _b.int, _b.float)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"expected a Tensor or a Python scalar, got {type(x).__name__}")


def _device(*xs):
    devs = {x.device for x in xs if isinstance(x, Tensor)}
    if len(devs) > 1:
        a, b = sorted(devs)
        raise RuntimeError("Expected all tensors to be on the same device, but found at least "
                           f"two devices, {a} and {b}!")
    return devs.pop() if devs else "cpu"


# ---- The choke point ----

UNARY_OPS = ("neg abs exp exp2 log log2 sqrt rsqrt sin cos tanh sigmoid erf relu floor ceil round "
             "trunc sign reciprocal isnan isinf logical_not bitwise_not").split()
BINARY_OPS = ("add sub mul div floordiv remainder pow maximum minimum eq ne lt le gt ge logical_and "
              "logical_or logical_xor bitwise_and bitwise_or bitwise_xor").split()
REDUCTION_OPS = ("sum", "prod", "amax", "amin", "argmax", "argmin")
VIEW_OPS = frozenset(("permute", "expand", "slice", "select", "reshape"))
FACTORY_OPS = frozenset(("full", "arange", "rand", "randn"))
PRIMITIVES = frozenset(UNARY_OPS + BINARY_OPS + list(REDUCTION_OPS) + list(VIEW_OPS) + list(
    FACTORY_OPS) + ["where", "to_dtype", "cumsum", "matmul", "cat", "clone", "nonzero", "unique"])
# ops whose Tensor inputs are cast to one compute dtype before the numpy function runs
_CAST_OPS = frozenset(UNARY_OPS + BINARY_OPS + ["where", "sum", "prod", "amax", "amin", "cumsum",
                                                "matmul", "cat"])


def _dispatch(op, inputs, params, metas):
    """Run one primitive op: record it while tracing a proxy, else run EAGER[op] (or share storage)."""
    if TRACER is not None and (op in FACTORY_OPS or _is_proxy(inputs)):
        outs = TRACER.record(op, inputs, params, metas)
    elif op in VIEW_OPS:
        outs = [Tensor._make(inputs[0]._storage, metas[0])]
    else:
        outs = _run_eager(op, inputs, params, metas)
    if op in VIEW_OPS:  # who owns the storage, and how to get from it to this view
        x = inputs[0]
        outs[0]._base = x if x._base is None else x._base
        outs[0]._view_ops = x._view_ops + [(op, params)]
    return outs


def _run_eager(op, inputs, params, metas):
    out_dt = metas[0].dtype
    if op in _CAST_OPS:
        flat = inputs[0] if op == "cat" else inputs
        # compute in the output dtype for float results and accumulations, else the promoted one
        acc = out_dt.is_floating_point or op in ("sum", "prod", "cumsum")
        ct = out_dt if acc else result_type(*flat)
        def conv(x):
            if not isinstance(x, Tensor):
                return np.asarray(x, ct.compute)   # Python scalars stay unrounded, as in ATen
            a = x._compute()
            if ct in _HALF and x.dtype is not ct:  # tensors are cast to the common dtype first
                a = _to_compute_form(_to_storage_form(a, ct), ct)
            return a.astype(ct.compute, copy=False)
    else:
        conv = lambda x: x._compute() if isinstance(x, Tensor) else x
    args = [[conv(t) for t in x] if isinstance(x, list) else conv(x) for x in inputs]
    with np.errstate(all="ignore"):
        res = EAGER[op](*args, **params)
        res = res if isinstance(res, tuple) else (res,)
        outs = []
        for r, m in zip(res, metas):
            s = _to_storage_form(r, m.dtype)
            if not (s.flags.owndata and s.flags.c_contiguous):   # never alias an input
                s = np.array(s, order="C")
            outs.append(Tensor._make(_new_storage(s.reshape(-1), m.device), _meta(s.shape, m.dtype, m.device)))
    return outs


def _erf(x):
    # numpy has no erf; math.erf is exact to double precision (slow, but this is the eager reference)
    return np.frompyfunc(math.erf, 1, 1)(x.astype(np.float64)).astype(x.dtype)


def _keep_int(f):
    return lambda x: x.copy() if x.dtype.kind in "iub" else f(x)


def _reduce(f):
    return lambda x, dims, keepdim: f(x, axis=dims, keepdims=keepdim)


def _arg_reduce(f):
    def run(x, dims, keepdim):
        kept = [d for d in range(x.ndim) if d not in dims]
        y = x.transpose(kept + list(dims)).reshape([x.shape[d] for d in kept] + [-1])
        r = f(y, axis=-1).astype(np.int64)
        return r.reshape([1 if d in dims else x.shape[d] for d in range(x.ndim)]) if keepdim else r
    return run


def _int_div_check(f):
    def run(a, b):
        if b.dtype.kind in "iub" and not np.all(b):
            raise RuntimeError("ZeroDivisionError")
        return f(a, b)
    return run


def _unique(x):
    return np.unique(x.reshape(-1))


EAGER = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "exp2": np.exp2, "log": np.log,
    "log2": np.log2, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin,
    "cos": np.cos, "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "erf": _erf,
    "relu": lambda x: np.where(x < 0, 0, x),         # keeps NaN, unlike maximum(x, 0) on ints
    "floor": _keep_int(np.floor), "ceil": _keep_int(np.ceil), "round": _keep_int(np.round),
    "trunc": _keep_int(np.trunc), "sign": lambda x: np.sign(np.nan_to_num(x, nan=0, posinf=1, neginf=-1)),
    "reciprocal": lambda x: 1 / x, "isnan": np.isnan, "isinf": np.isinf,
    "logical_not": np.logical_not, "bitwise_not": np.invert,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
    "floordiv": _int_div_check(np.floor_divide), "remainder": _int_div_check(np.remainder),
    "pow": np.power,
    "maximum": np.maximum, "minimum": np.minimum, "eq": np.equal, "ne": np.not_equal,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "logical_and": np.logical_and, "logical_or": np.logical_or, "logical_xor": np.logical_xor,
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor,
    "where": lambda c, a, b: np.where(c.astype(bool), a, b),
    "to_dtype": lambda x, dtype: x,                   # the result wrapper rounds to the new dtype
    "sum": _reduce(np.sum), "prod": _reduce(np.prod), "amax": _reduce(np.max),
    "amin": _reduce(np.min), "argmax": _arg_reduce(np.argmax), "argmin": _arg_reduce(np.argmin),
    "cumsum": lambda x, dim: np.cumsum(x, axis=dim) if x.ndim else x.copy(),
    "matmul": np.matmul,
    "cat": lambda xs, dim: np.concatenate(xs, axis=dim),
    "clone": lambda x: x,                              # the wrapper copies into fresh storage
    "full": lambda shape, value, dtype: np.full(shape, value, dtype.compute),
    "arange": lambda start, end, step, dtype: (
        start + np.arange(len(range(0, math.ceil((end - start) / step)))) * step).astype(dtype.compute),
    "rand": lambda shape, dtype: _RNG.random(shape, dtype=np.float64 if dtype is float64 else np.float32),
    "randn": lambda shape, dtype: _RNG.standard_normal(shape, dtype=np.float64 if dtype is float64 else np.float32),
    "nonzero": lambda x: np.argwhere(x).astype(np.int64),
    "unique": _unique,
}


def _op(op, inputs, params, meta):
    return _dispatch(op, inputs, params, [meta])[0]


# ---- Factories ----


def _np_dtype_to_stax(dt):
    if np.dtype(dt) not in _FROM_NP:
        raise TypeError(f"can't convert np.ndarray of type numpy.{np.dtype(dt)}. The only supported "
                        "types are: float64, float32, float16, int64, int32, and bool.")
    return _FROM_NP[np.dtype(dt)]


def _from_array(a, dtype):
    s = np.array(_to_storage_form(a, dtype), order="C")
    return Tensor._make(Storage(s.reshape(-1)), _meta(s.shape, dtype))


_DEFAULT_DEVICE = "cpu"


def set_default_device(device):
    """Where factories (`tensor`, `zeros`, `randn`, ...) put tensors when no device is given."""
    global _DEFAULT_DEVICE
    _DEFAULT_DEVICE = _norm_device(device)


def get_default_device():
    return _DEFAULT_DEVICE


def tensor(data, dtype=None, device=None):
    """A new tensor holding a copy of `data` (nested lists, scalars, numpy arrays, tensors)."""
    device = _DEFAULT_DEVICE if device is None else device
    if _norm_device(device) != "cpu":
        return tensor(data, dtype).to(device)
    if isinstance(data, Tensor):
        return clone(data.to(dtype or data.dtype))
    a = np.asarray(data)
    if dtype is None:
        if isinstance(data, np.ndarray):
            dtype = _np_dtype_to_stax(a.dtype)
        else:
            dtype = {"b": bool_, "i": int64, "u": int64, "f": float32}.get(a.dtype.kind)
            if dtype is None:
                raise TypeError(f"Could not infer dtype of {type(data).__name__}")
    return _from_array(np.asarray(a, dtype.compute), dtype)


def from_numpy(a):
    """A tensor sharing `a`'s memory (zero copy)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(a).__name__})")
    dtype, isz = _np_dtype_to_stax(a.dtype), a.itemsize
    if _b.any(s < 0 for s in a.strides):
        raise ValueError("At least one stride in the given numpy array is negative, and tensors "
                         "with negative strides are not currently supported. (You can probably "
                         "work around this by making a copy of your array  with array.copy().) ")
    if _b.any(s % isz for s in a.strides):
        raise ValueError("given numpy array strides not a multiple of the element byte size. "
                         "Copy the numpy array to reallocate the memory.")
    stride = tuple(s // isz for s in a.strides)
    extent = 0 if a.size == 0 else 1 + _b.sum((n - 1) * s for n, s in zip(a.shape, stride))
    flat = np.lib.stride_tricks.as_strided(a, (extent,), (isz,))   # covers a's memory, no copy
    return Tensor._make(Storage(flat), Meta(a.shape, stride, dtype, "cpu", 0))


def _factory(op, params, shape, dtype, device):
    device = _DEFAULT_DEVICE if device is None else _norm_device(device)
    if device != "cpu" and TRACER is None:
        return _op(op, [], params, _meta(shape, dtype)).to(device)
    return _op(op, [], params, _meta(shape, dtype, device))


def full(size, fill_value, *, dtype=None, device=None):
    dtype = dtype or _scalar_dtype(_scalar(fill_value))
    size = tuple(size) if isinstance(size, (tuple, list)) else (size,)
    return _factory("full", {"shape": size, "value": fill_value, "dtype": dtype}, size, dtype, device)


def zeros(*size, dtype=None, device=None):
    return full(_shape_args(size), 0, dtype=dtype or float32, device=device)


def ones(*size, dtype=None, device=None):
    return full(_shape_args(size), 1, dtype=dtype or float32, device=device)


def empty(*size, dtype=None, device=None):
    """Uninitialized memory eagerly (the C++ wrapper allocates its buffers with it); a zero
    `full` node while tracing, so a graph never reads garbage."""
    size, dtype = _shape_args(size), dtype or float32
    device = _DEFAULT_DEVICE if device is None else _norm_device(device)
    if TRACER is not None:
        return zeros(size, dtype=dtype, device=device)
    if device != "cpu":
        from . import cuda
        return Tensor._make(Storage(cuda.DeviceArray(_numel(size), dtype.np), device), _meta(size, dtype, device))
    data = np.empty(_numel(size), dtype.np)
    return Tensor._make(Storage(data), _meta(size, dtype))


def zeros_like(x, dtype=None):
    return zeros(x.shape, dtype=dtype or x.dtype)


def ones_like(x, dtype=None):
    return ones(x.shape, dtype=dtype or x.dtype)


def full_like(x, fill_value, dtype=None):
    return full(x.shape, fill_value, dtype=dtype or x.dtype)


def arange(start, end=None, step=1, *, dtype=None, device=None):
    if end is None:
        start, end = 0, start
    if step == 0:
        raise RuntimeError("step must be nonzero")
    if (end - start) * step < 0:
        raise RuntimeError("upper bound and lower bound inconsistent with step sign")
    if dtype is None:
        dtype = float32 if _b.any(isinstance(v, _b.float) for v in (start, end, step)) else int64
    n = math.ceil((end - start) / step)
    return _factory("arange", {"start": start, "end": end, "step": step, "dtype": dtype},
                    (n,), dtype, device)


def rand(*size, dtype=None, device=None):
    size, dtype = _shape_args(size), dtype or float32
    return _factory("rand", {"shape": size, "dtype": dtype}, size, dtype, device)


def randn(*size, dtype=None, device=None):
    size, dtype = _shape_args(size), dtype or float32
    return _factory("randn", {"shape": size, "dtype": dtype}, size, dtype, device)


# ---- Views ----
# Each view op computes the new (shape, stride, offset) as eager would and shares storage.


def _view(x, op, params, shape, stride, offset):
    return _op(op, [x], params, Meta(tuple(shape), tuple(stride), x.dtype, x.device, offset))


def permute(x, *dims):
    dims = _shape_args(dims)
    if len(dims) != x.ndim:
        raise RuntimeError("permute(sparse_coo): number of dimensions in the tensor input does not "
                           "match the length of the desired ordering of dimensions i.e. input.dim()"
                           f" = {x.ndim} is not equal to len(dims) = {len(dims)}")
    dims = tuple(_wrap_dim(d, x.ndim) for d in dims)
    if len(set(dims)) != len(dims):
        raise RuntimeError("permute(): duplicate dims are not allowed.")
    m = x._meta
    return _view(x, "permute", {"dims": dims}, [m.shape[d] for d in dims],
                 [m.stride[d] for d in dims], m.offset)


def expand(x, *sizes):
    sizes = _shape_args(sizes)
    if len(sizes) < x.ndim:
        raise RuntimeError(f"expand({x.dtype._tname}Type{{{list(x.shape)}}}, size={list(sizes)}): "
                           "the number of sizes provided (%d) must be greater or equal to the number "
                           "of dimensions in the tensor (%d)" % (len(sizes), x.ndim))
    lead = len(sizes) - x.ndim
    shape, stride = [], []
    for i, want in enumerate(sizes):
        if i < lead:
            if want < 0:
                raise RuntimeError(f"The expanded size of the tensor ({want}) isn't allowed in a "
                                   "leading, non-existing dimension 0")
            shape.append(want), stride.append(0)
            continue
        have, st = x.shape[i - lead], x._meta.stride[i - lead]
        if want == -1 or want == have:
            shape.append(have), stride.append(st)
        elif have == 1:
            shape.append(want), stride.append(0)
        else:
            raise RuntimeError(f"The expanded size of the tensor ({want}) must match the existing "
                               f"size ({have}) at non-singleton dimension {i}.  Target sizes: "
                               f"{list(sizes)}.  Tensor sizes: {list(x.shape)}")
    if tuple(shape) == x.shape:
        return x
    return _view(x, "expand", {"shape": tuple(shape)}, shape, stride, x._meta.offset)


def expand_as(x, other):
    return expand(x, other.shape)


def _slice(x, dim, start, end, step=1):
    """x[start:end:step] along dim; start/end already clamped to [0, size], end >= start."""
    m = x._meta
    n = (end - start + step - 1) // step
    shape, stride = list(m.shape), list(m.stride)
    shape[dim], stride[dim] = n, stride[dim] * step
    return _view(x, "slice", {"dim": dim, "start": start, "end": end, "step": step}, shape, stride,
                 m.offset + start * m.stride[dim])


def select(x, dim, index):
    if x.ndim == 0:
        raise IndexError("select() cannot be applied to a 0-dim tensor.")
    dim = _wrap_dim(dim, x.ndim)
    size = x.shape[dim]
    if not -size <= index < size:
        raise IndexError(f"index {index} is out of bounds for dimension {dim} with size {size}")
    index = index % size
    m = x._meta
    return _view(x, "select", {"dim": dim, "index": index}, m.shape[:dim] + m.shape[dim + 1:],
                 m.stride[:dim] + m.stride[dim + 1:], m.offset + index * m.stride[dim])


def _infer_shape(shape, numel):
    shape = list(shape)
    if shape.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    if -1 in shape:
        rest = _numel([s for s in shape if s != -1])
        if rest == 0 or numel % rest:
            raise RuntimeError(f"shape '{shape}' is invalid for input of size {numel}")
        shape[shape.index(-1)] = numel // rest
    if _numel(shape) != numel:
        raise RuntimeError(f"shape '{shape}' is invalid for input of size {numel}")
    return tuple(shape)


def _view_strides(old_shape, old_stride, new_shape):
    """Strides that view `old` as `new_shape` without a copy, or None (ATen's computeStride)."""
    if _numel(old_shape) == 0:
        return old_stride if tuple(old_shape) == tuple(new_shape) else _contig(new_shape)
    if len(old_shape) == 0:
        return _contig(new_shape)
    new_stride = [0] * len(new_shape)
    view_d, chunk = len(new_shape) - 1, old_stride[-1]
    tensor_numel, view_numel = 1, 1
    for d in range(len(old_shape) - 1, -1, -1):
        tensor_numel *= old_shape[d]
        if d == 0 or (old_shape[d - 1] != 1 and old_stride[d - 1] != tensor_numel * chunk):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_stride[view_d] = view_numel * chunk
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk, tensor_numel, view_numel = old_stride[d - 1], 1, 1
    return tuple(new_stride) if view_d == -1 else None


def view(x, *shape):
    shape = _infer_shape(_shape_args(shape), x.numel())
    stride = _view_strides(x.shape, x._meta.stride, shape)
    if stride is None:
        raise RuntimeError("view size is not compatible with input tensor's size and stride (at "
                           "least one dimension spans across two contiguous subspaces). Use "
                           ".reshape(...) instead.")
    if shape == x.shape:
        return x
    return _view(x, "reshape", {"shape": shape}, shape, stride, x._meta.offset)


def reshape(x, *shape):
    shape = _infer_shape(_shape_args(shape), x.numel())
    if _view_strides(x.shape, x._meta.stride, shape) is None:
        x = clone(x)   # not viewable: copy to contiguous, then view
    return view(x, shape)


def unsqueeze(x, dim):
    dim = _wrap_dim(dim, x.ndim + 1)
    return view(x, x.shape[:dim] + (1,) + x.shape[dim:])


def squeeze(x, dim=None):
    if dim is None:
        dims = range(x.ndim)
    else:
        dims = [_wrap_dim(d, x.ndim) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
    return view(x, tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)))


def flatten(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return view(x, (1,))
    s, e = _wrap_dim(start_dim, x.ndim), _wrap_dim(end_dim, x.ndim)
    if s > e:
        raise RuntimeError("flatten() has invalid args: start_dim cannot come after end_dim")
    return reshape(x, x.shape[:s] + (_numel(x.shape[s:e + 1]),) + x.shape[e + 1:])


def transpose(x, dim0, dim1):
    dims = list(range(x.ndim))
    d0, d1 = _wrap_dim(dim0, x.ndim), _wrap_dim(dim1, x.ndim)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return permute(x, dims)


def t(x):
    if x.ndim > 2:
        raise RuntimeError(f"t() expects a tensor with <= 2 dimensions, but self is {x.ndim}D")
    return permute(x, tuple(range(x.ndim))[::-1])


def narrow(x, dim, start, length):
    dim = _wrap_dim(dim, x.ndim)
    size = x.shape[dim]
    start = start + size if start < 0 else start
    if start + length > size or length < 0 or start < 0:
        raise RuntimeError(f"start ({start}) + length ({length}) exceeds dimension size ({size}).")
    return _slice(x, dim, start, start + length)


def _getitem(x, key):
    """Basic indexing: ints, slices (step >= 1), None and one Ellipsis."""
    key = key if isinstance(key, tuple) else (key,)
    if _b.any(isinstance(k, (Tensor, list, np.ndarray, _b.bool)) for k in key):
        raise IndexError("stax supports basic indexing only (ints, slices, None, ...); "
                         "advanced indexing with tensors, lists or bools is not implemented")
    n_real = _b.sum(1 for k in key if k is not None and k is not Ellipsis)
    if n_real > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    if _b.sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    ndim, dim = x.ndim, 0      # dim: where the next key item applies in the current result
    for k in key:
        if k is Ellipsis:
            dim += ndim - n_real   # the dims '...' covers stay as they are
        elif k is None:
            x = unsqueeze(x, dim)
            dim += 1
        elif isinstance(k, _b.slice):
            start, stop, step = k.indices(x.shape[dim])
            if step <= 0:
                raise ValueError("step must be greater than zero")
            if (start, stop, step) != (0, x.shape[dim], 1):   # a full ':' needs no view op
                x = _slice(x, dim, start, _b.max(stop, start), step)
            dim += 1
        else:
            x = select(x, dim, operator.index(k))
    return x


# ---- Pointwise ops ----


def _broadcast_shapes(*shapes):
    nd = _b.max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, size in enumerate(s):
            j = nd - len(s) + i
            if size != out[j] and size != 1:
                if out[j] != 1:
                    raise RuntimeError(f"The size of tensor a ({out[j]}) must match the size of "
                                       f"tensor b ({size}) at non-singleton dimension {j}")
                out[j] = size
    return tuple(out)


def broadcast_shapes(*shapes):
    return _broadcast_shapes(*[tuple(s) for s in shapes])


def _pointwise(op, inputs, out_dtype):
    tensors = [x for x in inputs if isinstance(x, Tensor)]
    shape = _broadcast_shapes(*[x.shape for x in tensors])
    return _op(op, list(inputs), {}, _meta(shape, out_dtype, _device(*tensors)))


def _float_result(dt):
    return dt if dt.is_floating_point else float32


# (op, output dtype rule): "same" keeps the promoted dtype, "float" makes int/bool float32,
# "bool" gives bool. Argument checks follow what ATen refuses.
_UNARY = {**{n: "float" for n in "exp exp2 log log2 sqrt rsqrt sin cos tanh sigmoid erf reciprocal".split()},
          **{n: "same" for n in "neg abs relu floor ceil round trunc sign bitwise_not".split()},
          "isnan": "bool", "isinf": "bool", "logical_not": "bool"}
_BINARY = {"add": "same", "sub": "same", "mul": "same", "div": "float", "floordiv": "same",
           "remainder": "same", "pow": "same", "maximum": "same", "minimum": "same",
           **{n: "bool" for n in "eq ne lt le gt ge logical_and logical_or logical_xor".split()},
           "bitwise_and": "same", "bitwise_or": "same", "bitwise_xor": "same"}


def _out_dtype(rule, dt):
    return {"same": dt, "float": _float_result(dt), "bool": bool_}[rule]


def _make_unary(op):
    def fn(x):
        if not isinstance(x, Tensor):
            raise TypeError(f"{op}(): argument 'input' must be Tensor, not {type(x).__name__}")
        dt = x.dtype
        if op == "neg" and dt is bool_:
            raise RuntimeError("Negation, the `-` operator, on a bool tensor is not supported. If "
                               "you are trying to invert a mask, use the `~` or `logical_not()` "
                               "operator instead.")
        if op == "bitwise_not" and dt.is_floating_point:
            raise TypeError("~ (operator.invert) is only implemented on integer and Boolean-type "
                            "tensors")
        return _pointwise(op, [x], _out_dtype(_UNARY[op], dt))
    fn.__name__ = op
    return fn


def _make_binary(op):
    def fn(a, b):
        a, b = _scalar(a), _scalar(b)
        if not (isinstance(a, Tensor) or isinstance(b, Tensor)):
            a = tensor(a)   # two scalars: like torch, the first becomes a 0-dim tensor
        dt = result_type(a, b)
        if op.startswith("bitwise") and dt.is_floating_point:
            raise RuntimeError(f"\"{op}_cpu\" not implemented for '{dt._tname}'")
        if op == "sub" and bool_ in (result_type(a), result_type(b)):
            if dt is bool_:
                raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not "
                                   "supported. Use the `^` or `logical_xor()` operator instead.")
            raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. "
                               "If you are trying to invert a mask, use the `~` or `logical_not()` "
                               "operator instead.")
        return _pointwise(op, [a, b], _out_dtype(_BINARY[op], dt))
    fn.__name__ = op
    return fn


for _name in _UNARY:
    globals()[_name] = _make_unary(_name)
for _name in _BINARY:
    if _name not in ("add", "sub", "div"):
        globals()[_name] = _make_binary(_name)
__all__ += [n for n in list(_UNARY) + list(_BINARY) if n not in __all__]
_add, _sub, _div = _make_binary("add"), _make_binary("sub"), _make_binary("div")


def add(a, b, *, alpha=1):
    return _add(a, b if alpha == 1 else mul(b, alpha))


def sub(a, b, *, alpha=1):
    return _sub(a, b if alpha == 1 else mul(b, alpha))


def div(a, b, *, rounding_mode=None):
    if rounding_mode is None:
        return _div(a, b)
    if rounding_mode == "floor":
        return floordiv(a, b)
    if rounding_mode == "trunc":
        dt = result_type(_scalar(a), _scalar(b))
        q = trunc(_div(a, b))
        return q if q.dtype is dt else to_dtype(q, dt)
    raise RuntimeError(f"div expected rounding_mode to be one of None, 'trunc', or 'floor' but "
                       f"found '{rounding_mode}'")


true_divide, floor_divide, multiply, subtract = div, floordiv, mul, sub


def to_dtype(x, dtype):
    if dtype is x.dtype:
        return x
    return _op("to_dtype", [x], {"dtype": dtype}, _meta(x.shape, dtype, x.device))


def where(condition, input, other):
    if not isinstance(condition, Tensor) or condition.dtype is not bool_:
        got = condition.dtype._tname if isinstance(condition, Tensor) else type(condition).__name__
        raise RuntimeError(f"where expected condition to be a boolean tensor, but got a tensor "
                           f"with dtype {got}")
    a, b = _scalar(input), _scalar(other)
    return _pointwise("where", [condition, a, b], result_type(a, b))


def clamp(x, min=None, max=None):
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
    # maximum/minimum propagate NaN from x, as torch.clamp does
    if min is not None:
        x = maximum(x, min)
    return x if max is None else minimum(x, max)


clip = clamp


def _upcast(x):
    """Half inputs of composites compute in float32 and round once at the end (as ATen does)."""
    return (to_dtype(x, float32), x.dtype) if x.dtype in _HALF else (x, None)


def _downcast(y, dt):
    return y if dt is None else to_dtype(y, dt)


def gelu(x, approximate="none"):
    x, dt = _upcast(x)
    if approximate == "tanh":
        inner = mul(add(x, mul(pow(x, 3), 0.044715)), math.sqrt(2 / math.pi))
        y = mul(mul(x, 0.5), add(tanh(inner), 1))
    elif approximate == "none":
        y = mul(mul(x, 0.5), add(erf(mul(x, 0.7071067811865476)), 1))
    else:
        raise RuntimeError(f"approximate argument must be either none or tanh.")
    return _downcast(y, dt)


def silu(x):
    x, dt = _upcast(x)
    return _downcast(mul(x, sigmoid(x)), dt)


# ---- Reductions ----


def _norm_dims(dim, ndim):
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return tuple(range(ndim))
    dims = [_wrap_dim(d, ndim) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
    for d in dims:
        if dims.count(d) > 1:
            raise RuntimeError(f"dim {d} appears multiple times in the list of dims")
    return tuple(sorted(dims)) if ndim > 0 else ()


def _reduced_shape(shape, dims, keepdim):
    return tuple(1 if i in dims else s for i, s in enumerate(shape) if keepdim or i not in dims)


def _reduction(op, x, dim, keepdim, out_dtype):
    dims = _norm_dims(dim, x.ndim)
    if op in ("amax", "amin", "argmax", "argmin"):
        if x.numel() == 0 and (dim is None or dim == () or dim == []):
            msg = f"{op}(): Expected reduction dim to be specified for input.numel() == 0."
            if op in ("amax", "amin"):
                raise RuntimeError(msg + " Specify the reduction dim with the 'dim' argument.")
            raise IndexError(msg)
        for d in dims:
            if x.shape[d] == 0:
                raise IndexError(f"{op}(): Expected reduction dim {d} to have non-zero size.")
    return _op(op, [x], {"dims": dims, "keepdim": keepdim},
               _meta(_reduced_shape(x.shape, dims, keepdim), out_dtype, x.device))


def _acc_dtype(dt):
    return dt if dt.is_floating_point else int64


def sum(x, dim=None, keepdim=False, *, dtype=None):
    x = x if dtype is None else to_dtype(x, dtype)
    return _reduction("sum", x, dim, keepdim, _acc_dtype(x.dtype))


def prod(x, dim=None, keepdim=False, *, dtype=None):
    x = x if dtype is None else to_dtype(x, dtype)
    return _reduction("prod", x, dim, keepdim, _acc_dtype(x.dtype))


def amax(x, dim=(), keepdim=False):
    return _reduction("amax", x, dim, keepdim, x.dtype)


def amin(x, dim=(), keepdim=False):
    return _reduction("amin", x, dim, keepdim, x.dtype)


def argmax(x, dim=None, keepdim=False):
    if dim is None:   # a flat index over x in row-major order
        return _reduction("argmax", x, None, False, int64)
    return _reduction("argmax", x, _wrap_dim(dim, x.ndim), keepdim, int64)


def argmin(x, dim=None, keepdim=False):
    if dim is None:
        return _reduction("argmin", x, None, False, int64)
    return _reduction("argmin", x, _wrap_dim(dim, x.ndim), keepdim, int64)


_max_ret = namedtuple("max", "values indices")
_min_ret = namedtuple("min", "values indices")


def max(x, dim=None, keepdim=False):
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    if dim is None:
        if x.numel() == 0:
            raise RuntimeError("max(): Expected reduction dim to be specified for input.numel() == "
                               "0. Specify the reduction dim with the 'dim' argument.")
        return amax(x)
    return _max_ret(amax(x, dim, keepdim), argmax(x, dim, keepdim))


def min(x, dim=None, keepdim=False):
    if isinstance(dim, Tensor):
        return minimum(x, dim)
    if dim is None:
        if x.numel() == 0:
            raise RuntimeError("min(): Expected reduction dim to be specified for input.numel() == "
                               "0. Specify the reduction dim with the 'dim' argument.")
        return amin(x)
    return _min_ret(amin(x, dim, keepdim), argmin(x, dim, keepdim))


def _count(x, dim):
    return _numel([x.shape[d] for d in _norm_dims(dim, x.ndim)])


def mean(x, dim=None, keepdim=False, *, dtype=None):
    dt = dtype or x.dtype
    if not dt.is_floating_point:
        raise RuntimeError("mean(): could not infer output dtype. Input dtype must be either a "
                           f"floating point or complex dtype. Got: {dt._tname}")
    x, half = _upcast(to_dtype(x, dt))
    return _downcast(div(sum(x, dim, keepdim), _count(x, dim)), half)


def var(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    if not x.dtype.is_floating_point:
        raise RuntimeError(f"std and var only support floating point and complex dtypes")
    x, half = _upcast(x)
    dev = sub(x, div(sum(x, dim, True), _count(x, dim)))   # two-pass: deviations from the mean
    ss = sum(mul(dev, dev), dim, keepdim)
    return _downcast(div(ss, _b.max(_count(x, dim) - correction, 0)), half)


def std(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    x, half = _upcast(x)
    return _downcast(sqrt(var(x, dim, unbiased, keepdim, correction=correction)), half)


def _row_max(x, dim):
    """amax with keepdim for the stabilizing shift; -inf where the reduced rows are empty."""
    dims = _norm_dims(dim, x.ndim)
    if _b.any(x.shape[d] == 0 for d in dims):
        return full(_reduced_shape(x.shape, dims, True), -math.inf, dtype=x.dtype, device=x.device)
    return amax(x, dims, keepdim=True)


def logsumexp(x, dim, keepdim=False):
    x = x if x.dtype.is_floating_point else to_dtype(x, float32)
    x, half = _upcast(x)
    m = _row_max(x, dim)
    m = where(isinf(m), 0.0, m)     # rows of all -inf (or an +inf) must not produce inf - inf
    y = add(log(sum(exp(sub(x, m)), dim, keepdim=True)), m)
    if not keepdim:
        y = squeeze(y, _norm_dims(dim, x.ndim))
    return _downcast(y, half)


def cumsum(x, dim, *, dtype=None):
    x = x if dtype is None else to_dtype(x, dtype)
    dim = _wrap_dim(dim, x.ndim)
    return _op("cumsum", [x], {"dim": dim}, _meta(x.shape, _acc_dtype(x.dtype), x.device))


def _check_float(x, name):
    if not x.dtype.is_floating_point:
        raise RuntimeError(f"\"{name}\" not implemented for '{x.dtype._tname}'")


def _compute_in_float32(x):
    """softmax's own casts to and from the compute dtype, recorded even when they change nothing
    (as ATen's decomposition records them; the Triton listing 9.5 shows both as `.to(tl.float32)`)."""
    if TRACER is not None and x.dtype is float32:
        return _op("to_dtype", [x], {"dtype": float32}, _meta(x.shape, float32, x.device)), float32
    return _upcast(x)


def softmax(x, dim, dtype=None):
    x = x if dtype is None else to_dtype(x, dtype)
    _check_float(x, "softmax_lastdim_kernel_impl")
    x, back = _compute_in_float32(x)
    e = exp(sub(x, _row_max(x, dim)))
    y = div(e, sum(e, dim, keepdim=True))
    if back is float32:
        return _op("to_dtype", [y], {"dtype": float32}, _meta(y.shape, float32, y.device))
    return _downcast(y, back)


def log_softmax(x, dim, dtype=None):
    x = x if dtype is None else to_dtype(x, dtype)
    _check_float(x, "log_softmax_lastdim_kernel_impl")
    x, half = _upcast(x)
    shifted = sub(x, _row_max(x, dim))
    return _downcast(sub(shifted, log(sum(exp(shifted), dim, keepdim=True))), half)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    ns = (normalized_shape,) if isinstance(normalized_shape, _b.int) else tuple(normalized_shape)
    k = len(ns)
    if k == 0 or x.ndim < k or tuple(x.shape[x.ndim - k:]) != ns:
        raise RuntimeError(f"Given normalized_shape={list(ns)}, expected input with shape "
                           f"[*, {', '.join(map(str, ns))}], but got input of size{list(x.shape)}")
    _check_float(x, "LayerNormKernelImpl")
    x, half = _upcast(x)
    dims = tuple(range(x.ndim - k, x.ndim))
    n = _numel(ns)
    mu = div(sum(x, dims, True), n)
    dev = sub(x, mu)
    var_ = div(sum(mul(dev, dev), dims, True), n)
    y = mul(dev, rsqrt(add(var_, eps)))
    if weight is not None:
        y = mul(y, weight)
    if bias is not None:
        y = add(y, bias)
    return _downcast(y, half)


# ---- matmul, cat, stack, copies, data-dependent ops ----


def matmul(a, b):
    if a.ndim == 0 or b.ndim == 0:
        raise RuntimeError(f"both arguments to matmul need to be at least 1D, but they are "
                           f"{a.ndim}D and {b.ndim}D")
    if a.dtype is not b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: "
                           f"{a.dtype._tname.lower()} != {b.dtype._tname.lower()}")
    if a.ndim == 1 and b.ndim == 1:
        if a.shape[0] != b.shape[0]:
            raise RuntimeError(f"inconsistent tensor size, expected tensor [{a.shape[0]}] and src "
                               f"[{b.shape[0]}] to have the same number of elements, but got "
                               f"{a.shape[0]} and {b.shape[0]} elements respectively")
        return reshape(matmul(unsqueeze(a, 0), unsqueeze(b, 1)), ())
    if a.ndim == 1:
        return squeeze(matmul(unsqueeze(a, 0), b), -2)
    if b.ndim == 1:
        return squeeze(matmul(a, unsqueeze(b, 1)), -1)
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        if a.ndim == 2 and b.ndim == 2:
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
        raise RuntimeError(f"Expected size for first two dimensions of batch2 tensor to be: "
                           f"[{_numel(b.shape[:-2])}, {k}] but got: [{_numel(b.shape[:-2])}, {k2}].")
    batch = _broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if a.ndim > 2 or b.ndim > 2:   # the primitive wants equal batch shapes: expand (a view)
        a, b = expand(a, batch + (m, k)), expand(b, batch + (k, n))
    return _op("matmul", [a, b], {}, _meta(batch + (m, n), a.dtype, _device(a, b)))


mm = bmm = matmul


def cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("torch.cat(): expected a non-empty list of Tensors")
    for i, x in enumerate(tensors):
        if x.ndim == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    dt = result_type(*tensors)
    # legacy rule: 1-D empty tensors are skipped
    keep = [x for x in tensors if not (x.ndim == 1 and x.shape[0] == 0)] or tensors[:1]
    ref = keep[0]
    dim = _wrap_dim(dim, ref.ndim)
    for i, x in enumerate(tensors):
        if x.ndim == 1 and x.shape[0] == 0:
            continue
        if x.ndim != ref.ndim:
            raise RuntimeError(f"Tensors must have same number of dimensions: got {ref.ndim} and {x.ndim}")
        for d in range(ref.ndim):
            if d != dim and x.shape[d] != ref.shape[d]:
                raise RuntimeError(f"Sizes of tensors must match except in dimension {dim}. Expected "
                                   f"size {ref.shape[d]} but got size {x.shape[d]} for tensor number "
                                   f"{i} in the list.")
    keep = [to_dtype(x, dt) for x in keep]
    shape = list(ref.shape)
    shape[dim] = _b.sum(x.shape[dim] for x in keep)
    return _op("cat", [keep], {"dim": dim}, _meta(shape, dt, _device(*keep)))


concat = cat


def stack(tensors, dim=0):
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    for i, x in enumerate(tensors):
        if x.shape != tensors[0].shape:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(tensors[0].shape)} at entry 0 and {list(x.shape)} at entry {i}")
    dim = _wrap_dim(dim, tensors[0].ndim + 1)
    return cat([unsqueeze(x, dim) for x in tensors], dim)


def clone(x):
    return _op("clone", [x], {}, _meta(x.shape, x.dtype, x.device))


def contiguous(x):
    return x if x.is_contiguous() else clone(x)


def nonzero(x):
    return _op("nonzero", [x], {}, _meta((None, x.ndim), int64, x.device))


def unique(x, sorted=True):
    return _op("unique", [x], {}, _meta((None,), x.dtype, x.device))


# ---- Writes: in-place ops and __setitem__ ----


def _write(target, value):
    """Store `value` (already target's shape and dtype) into target's storage, through its view."""
    if TRACER is not None and (_is_proxy(target) or _is_proxy(value)):
        TRACER.mutate(target, value)
        return
    if _b.any(st == 0 and s > 1 for s, st in zip(target.shape, target._meta.stride)):
        raise RuntimeError("unsupported operation: more than one element of the written-to tensor "
                           "refers to a single memory location. Please clone() the tensor before "
                           "performing the operation.")
    if target.device != "cpu":   # write through a host copy of the device storage
        host, m, isz = target._storage.data.host(), target._meta, target.dtype.np.itemsize
        np.lib.stride_tricks.as_strided(host[m.offset:], m.shape, tuple(s * isz for s in m.stride))[...] = value._np()
        target._storage.data.upload(host)
        return
    target._np()[...] = value._np()   # numpy copes with overlapping source and destination


def _inplace(target, value, name):
    """Cast and broadcast an out-of-place result to `target`, then write it."""
    if isinstance(value, Tensor):
        if not can_cast(value.dtype, target.dtype) and name != "copy_":
            raise RuntimeError(f"result type {value.dtype._tname} can't be cast to the desired "
                               f"output type {target.dtype._tname}")
        if name != "copy_" and _broadcast_shapes(value.shape, target.shape) != target.shape:
            raise RuntimeError(f"output with shape {list(target.shape)} doesn't match the broadcast "
                               f"shape {list(_broadcast_shapes(value.shape, target.shape))}")
        value = expand(to_dtype(value, target.dtype), target.shape)
    else:
        value = expand(full((), value, dtype=target.dtype, device=target.device), target.shape)
    _write(target, value)
    return target


def copy_(x, src):
    return _inplace(x, _scalar(src), "copy_")


def fill_(x, value):
    return _inplace(x, _scalar(value), "copy_")


def zero_(x):
    return fill_(x, 0)


_INPLACE = {"add_": lambda x, o, alpha=1: add(x, o, alpha=alpha),
            "sub_": lambda x, o, alpha=1: sub(x, o, alpha=alpha),
            "mul_": lambda x, o: mul(x, o), "div_": lambda x, o, **k: div(x, o, **k),
            "pow_": lambda x, o: pow(x, o), "clamp_": lambda x, min=None, max=None: clamp(x, min, max),
            "relu_": lambda x: relu(x), "neg_": lambda x: neg(x), "exp_": lambda x: exp(x)}


def _make_inplace(name, f):
    def method(self, *args, **kwargs):
        return _inplace(self, f(self, *args, **kwargs), name)
    method.__name__ = name
    return method


# ---- Methods and operators on Tensor ----

_METHODS = (list(_UNARY) + list(_BINARY) + """add sub div clamp clip gelu silu to_dtype where sum prod
    amax amin argmax argmin max min mean var std logsumexp cumsum softmax log_softmax matmul permute
    expand expand_as view reshape unsqueeze squeeze flatten transpose t narrow select clone
    contiguous nonzero unique copy_ fill_ zero_ true_divide floor_divide multiply subtract""".split())
for _name in _METHODS:
    _f = globals()[_name]
    if _name == "where":   # x.where(cond, other) == where(cond, x, other)
        setattr(Tensor, _name, lambda self, cond, other: where(cond, self, other))
    else:
        setattr(Tensor, _name, _f)
for _name, _f in _INPLACE.items():
    setattr(Tensor, _name, _make_inplace(_name, _f))


def _operand(f, reverse=False):
    def method(self, other):
        if isinstance(other, np.ndarray):
            other = tensor(other)
        elif not isinstance(other, (Tensor, _b.bool, _b.int, _b.float, np.generic)):
            return NotImplemented
        return f(other, self) if reverse else f(self, other)
    return method


for _dunder, _f in {"add": add, "sub": sub, "mul": mul, "truediv": div, "floordiv": floordiv,
                    "mod": remainder, "pow": pow, "matmul": matmul, "and": bitwise_and,
                    "or": bitwise_or, "xor": bitwise_xor}.items():
    setattr(Tensor, f"__{_dunder}__", _operand(_f))
    setattr(Tensor, f"__r{_dunder}__", _operand(_f, reverse=True))
    setattr(Tensor, f"__i{_dunder}__", lambda self, other, _f=_f: _inplace(self, _f(self, other), "op"))
for _dunder, _f in {"eq": eq, "ne": ne, "lt": lt, "le": le, "gt": gt, "ge": ge}.items():
    setattr(Tensor, f"__{_dunder}__", _operand(_f))
Tensor.__neg__, Tensor.__abs__, Tensor.__invert__ = neg, abs, bitwise_not
Tensor.__pos__ = lambda self: self
Tensor.__imatmul__ = None   # torch has no in-place matmul
