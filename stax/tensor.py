"""The tiny tensor: Stax's eager tensor, spelled like PyTorch, computed with numpy.

Layer: above dtypes.py and op_table.py; below tensor_ops.py (which imports this module and never
the other way round). This is "the tiny tensor" of docs/DESIGN.md, the §2/§3 substrate the
compiler captures from. It gives the user a `Tensor` (shape, stride, storage offset, dtype, device,
storage shared between views), the factories, and the one choke point every primitive op goes
through. It consumes Python scalars, nested lists and numpy arrays; it produces Tensors, and (for
the compiler) the contract below. The op functions with PyTorch's names (views, pointwise ops,
reductions, matmul, cat, stack), the Tensor methods and operators that call them, and the in-place
methods live in tensor_ops.py; the dtypes and promotion rules in dtypes.py (re-exported here:
`stax.tensor.float32`); each primitive op's declaration and eager numpy implementation in
op_table.py.

The contract with the compiler: every primitive op goes through one choke point, `_dispatch(op,
inputs, params, metas)`. Eagerly it runs `EAGER[op]` (op_table.py's numpy implementation) or, for
a view op, shares the input's storage. While `capture.py` traces (a tracer is installed with
`set_tracer` and an input is a proxy tensor), `_dispatch` hands the op to the tracer's `record`
instead. Composite ops (softmax, layer_norm, var, gelu, ...) are written only in terms of the
public functions, so they trace into primitives automatically. In-place writes end in
`_write(target, value)`, which the tracer sees as `mutate`; views carry `_base` and `_view_ops` so
the tracer can replay them functionally.

Where to look:
  - data types and promotion:  dtypes.py (DType, promote_types); result_type here
  - metadata and storage:      Meta, Storage, Tensor
  - the tracer hook:           current_tracer, set_tracer (one tracer per thread)
  - the choke point:           _dispatch, _run_eager, EAGER, VIEW_OPS, PRIMITIVES (views of op_table.OPS)
  - factories:                 tensor, from_numpy, full, zeros, empty, arange, randn
  - writes:                    _write (the in-place methods and __setitem__ are in tensor_ops.py)
  - views, pointwise ops, reductions, matmul, cat/stack, Tensor methods: tensor_ops.py
"""
import builtins as _b
import functools
import math
import operator
import os
import threading
from dataclasses import dataclass

import numpy as np

from .dtypes import (_ALIASES, _FROM_NP, _HALF, DTYPES, DType, _combine,  # noqa: F401 (re-exported)
                     _scalar_dtype, _to_compute_form, _to_storage_form, bfloat16, bool_, can_cast,
                     float16, float32, float64, int8, int16, int32, int64, promote_types, uint8,
                     FLOAT8, float8_e4m3fn, float8_e5m2)
from .op_table import OPS, manual_seed, names  # noqa: F401 (manual_seed re-exported)

__all__ = """DType Meta Storage Tensor DTYPES float32 float64 float16 bfloat16 int8 uint8 int16 int32 int64 bool_
    float8_e4m3fn float8_e5m2
    promote_types result_type can_cast set_num_threads get_num_threads manual_seed tensor from_numpy
    set_default_device get_default_device
    zeros ones full empty zeros_like ones_like full_like arange rand randn""".split()


def __getattr__(name):
    if name in _ALIASES:
        return _ALIASES[name]
    raise AttributeError(f"module 'stax.tensor' has no attribute '{name}'")


# ---- Metadata, storage, the Tensor ----

class _TracerSlot(threading.local):
    """The tracer installed by capture.py (set_tracer) while tracing, one per thread: a thread
    capturing a function must not turn other threads' eager ops into proxies."""
    tracer = None


_TLS = _TracerSlot()
_NUM_THREADS = os.cpu_count() or 1


def current_tracer():
    """The tracer recording ops in this thread right now, or None when ops run eagerly."""
    return _TLS.tracer


def set_tracer(tracer):
    """Install `tracer` in this thread (None: run eagerly); returns the previous one, to restore."""
    prev, _TLS.tracer = _TLS.tracer, tracer
    return prev


def set_num_threads(n):
    global _NUM_THREADS
    _NUM_THREADS = _b.max(1, _b.int(n))


def get_num_threads():
    return _NUM_THREADS


class SymbolicInt:
    """The base of a size that is an expression while tracing in dynamic mode (§10): dynshape.SymInt
    implements it. Here only so that the op functions can accept one as a scalar (specialized)."""
    __slots__ = ()


class SymbolicFloat:
    """The base of a float argument passed to kernels at run time (§10.4): capture.SymFloat
    implements it. Op functions take one as a Python float operand (a weak scalar: float32
    tensor * it is float32, int tensor * it the default float dtype)."""
    __slots__ = ()


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
    version: int = 0        # bumped by every in-place write (autograd checks what it saved)


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


_new = object.__new__


class Tensor:
    """A strided view of a Storage (eager), or a proxy holding a graph node (while tracing).

    Methods that call op functions (`.to`, `.T`, `x[...]`, `+`, `.sum`, `.add_`, ...) are bound
    onto this class by tensor_ops.py.
    """
    __array_ufunc__ = None   # numpy defers `ndarray op Tensor` to our reflected operators
    __hash__ = object.__hash__

    def __init__(self, *a, **k):
        raise TypeError("create tensors with stax.tensor(...), stax.zeros(...), stax.from_numpy(...)")

    @classmethod
    def _make(cls, storage, meta, base=None, view_ops=(), node=None):
        t = _new(cls)
        t._storage, t._meta, t._base, t._view_ops, t._node = storage, meta, base, list(view_ops), node
        t.requires_grad, t.grad, t._grad_fn = False, None, None     # §5 autograd (autograd.py)
        return t

    @staticmethod
    def _fresh(storage, meta):
        """`_make(storage, meta)` for a plain tensor (no base, views or node): a replay's outputs,
        made on every call (§9.9 host time)."""
        t = _new(Tensor)
        t._storage, t._meta, t._base, t._view_ops, t._node = storage, meta, None, [], None
        t.requires_grad, t.grad, t._grad_fn = False, None, None
        return t

    @classmethod
    def _proxy(cls, meta, node):
        return cls._make(None, meta, node=node)

    # metadata
    shape = property(lambda self: self._meta.shape)
    dtype = property(lambda self: self._meta.dtype)
    device = property(lambda self: self._meta.device)
    ndim = property(lambda self: len(self._meta.shape))

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

    # data access: a proxy has no data, so each of these is a graph break while tracing
    def _need_data(self, what, user=False):
        tracer = _TLS.tracer
        if self._node is not None:
            if tracer is not None:
                tracer.graph_break(f"{what} needs tensor data")
            raise RuntimeError(f"{what} needs tensor data, but this is a proxy tensor")
        if user and tracer is not None and getattr(tracer, "lifts_constants", False):
            # a real (global or closure) tensor read while tracing: its value would be frozen into
            # the compiled code, and a later in-place update of it silently ignored
            tracer.graph_break(f"{what} reads the data of a tensor the function closed over")

    def _np(self):
        """Storage-form strided numpy view (shares memory)."""
        self._need_data("reading a tensor")
        m, isz = self._meta, self.dtype.np.itemsize
        # a CUDA tensor is read through a host copy of its storage ("through the host", docs/DESIGN.md)
        data = self._storage.data if self.device == "cpu" else self._storage.data.host()
        return np.lib.stride_tricks.as_strided(data[m.offset:], m.shape, tuple(s * isz for s in m.stride))

    def _compute(self):
        return _to_compute_form(self._np(), self.dtype)

    def numpy(self):
        self._need_data("numpy()", user=True)
        if self.device != "cpu":
            raise TypeError(f"can't convert {self.device}:0 device type tensor to numpy. Use "
                            "Tensor.cpu() to copy the tensor to host memory first.")
        if self.dtype is bfloat16 or self.dtype in FLOAT8:
            raise TypeError(f"Got unsupported ScalarType {self.dtype._tname}")
        return self._np()

    def __array__(self, dtype=None, copy=None):
        self._need_data("__array__", user=True)
        a = self._compute() if self.dtype is bfloat16 or self.dtype in FLOAT8 else self._np()
        return a if dtype is None else a.astype(dtype)

    def tolist(self):
        self._need_data("tolist()", user=True)
        return self._compute().tolist()

    def item(self):
        self._need_data("item()", user=True)
        n = self.numel()
        if n != 1:
            raise RuntimeError(f"a Tensor with {n} elements cannot be converted to Scalar")
        return self._compute().reshape(-1)[0].item()

    def __bool__(self):
        self._need_data("bool()", user=True)
        if self.numel() != 1:
            raise RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
        return _b.bool(self.item())

    def __float__(self):
        self._need_data("float()", user=True)
        return _b.float(self.item())

    def __int__(self):
        self._need_data("int()", user=True)
        return _b.int(self.item())

    def __index__(self):
        self._need_data("__index__", user=True)
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


# the one dtype rule that looks at tensors (dtypes.py has the others)
def result_type(*args):
    """Dimensioned tensors > zero-dim tensors > Python scalars, each compared by category."""
    groups = [None, None, None]
    for a in args:
        if isinstance(a, Tensor):
            g, d = (0 if a.ndim > 0 else 1), a.dtype
        elif isinstance(a, DType):
            g, d = 1, a
        elif isinstance(a, SymbolicInt):    # a size used as a scalar (§10): a Python int
            g, d = 2, int64
        else:
            g, d = 2, _scalar_dtype(a)
        groups[g] = d if groups[g] is None else promote_types(groups[g], d)
    return _combine(groups[0], _combine(groups[1], groups[2]))


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
    if isinstance(d, SymbolicInt):      # a dim is a number: a symbolic one (§10) is specialized
        d = d.__index__()
    n = _b.max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], "
                         f"but got {d})")
    return d % n if ndim > 0 else 0


def _plain_int(v):
    """A size as an exact Python int: an int subclass's own hooks (repr, arithmetic) never travel
    on into graphs, keys or generated code. A symbolic size (§10) stays symbolic."""
    if isinstance(v, SymbolicInt):
        return v
    v = operator.index(v)
    return v if type(v) is int else int.__int__(v)


def _shape_args(args):
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = args[0]
    return tuple(_plain_int(a) for a in args)


def _is_proxy(x):
    if isinstance(x, (list, tuple)):
        return _b.any(_is_proxy(i) for i in x)
    return isinstance(x, Tensor) and x._node is not None


def _has_tensor(x):
    if isinstance(x, (list, tuple)):
        return _b.any(_has_tensor(i) for i in x)
    return isinstance(x, Tensor)


def _scalar(x):
    """Python scalar or Tensor; numpy scalars become Python scalars; anything else is an error."""
    if isinstance(x, (Tensor, _b.bool)) or type(x) in (_b.int, _b.float):
        return x
    if isinstance(x, (SymbolicInt, SymbolicFloat)):     # a run-time int or float in the graph (§10.4)
        return x
    if isinstance(x, _b.int):           # subclasses become plain values (see _plain_int)
        return int.__int__(x)
    if isinstance(x, _b.float):
        return float.__float__(x)
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

# views of op_table.OPS (op_table.py declares every primitive op once)
UNARY_OPS = names("unary")
BINARY_OPS = names("binary")
REDUCTION_OPS = tuple(names("reduction"))
VIEW_OPS = frozenset(names("view"))
FACTORY_OPS = frozenset(names("factory"))
PRIMITIVES = frozenset(name for name, d in OPS.items() if d.kind != "scatter")   # what _dispatch runs
# ops whose Tensor inputs are cast to one compute dtype before the numpy function runs
_CAST_OPS = frozenset(name for name, d in OPS.items() if d.cast_inputs)
EAGER = {name: d.eager for name, d in OPS.items() if d.eager is not None}


def _dispatch(op, inputs, params, metas):
    """Run one primitive op: record it while tracing a proxy, else run EAGER[op] (or share storage)."""
    tracer = _TLS.tracer
    if op not in _FLOAT8_OPS and (metas[0].dtype in FLOAT8 or _any_float8(inputs)):
        raise RuntimeError(f'"{op}" is not implemented for float8 ({_float8_name(metas[0], inputs)}): '
                           "float8 tensors take casts (.to), views and stax._scaled_mm; cast with "
                           ".to(stax.float32) first")
    # a tracer that `lifts_constants` (capture.py's) records ops on real tensors too, making them
    # constant inputs: an op on a global tensor computed now would freeze its value, missing later
    # in-place updates of it
    if tracer is not None and (op in FACTORY_OPS or _is_proxy(inputs) or
                               (_has_tensor(inputs) and getattr(tracer, "lifts_constants", False))):
        outs = tracer.record(op, inputs, params, metas)
    elif op in VIEW_OPS:
        outs = [Tensor._make(inputs[0]._storage, metas[0])]
    else:
        outs = _run_eager(op, inputs, params, metas)
    if op in VIEW_OPS:  # who owns the storage, and how to get from it to this view
        x = inputs[0]
        outs[0]._base = x if x._base is None else x._base
        outs[0]._view_ops = x._view_ops + [(op, params)]
    if _AUTOGRAD is not None:
        _AUTOGRAD.record(op, inputs, params, outs)
    return outs


# §9.8: what runs on float8 tensors (as in PyTorch, no arithmetic): casts, copies, views, factories
_FLOAT8_OPS = frozenset({"to_dtype", "clone", "scaled_mm"}) | VIEW_OPS | FACTORY_OPS


def _any_float8(inputs) -> bool:
    return any(x.__class__ is Tensor and x._meta.dtype in FLOAT8 for x in inputs)


def _float8_name(meta, inputs) -> str:
    d = next((x._meta.dtype for x in inputs if x.__class__ is Tensor and x._meta.dtype in FLOAT8), meta.dtype)
    return d._tname


# autograd.py's hooks (record, before_write, after_write), set when it is imported: the tensor
# sits below autograd in the stack, so autograd plugs itself into the two choke points
_AUTOGRAD = None


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


def _op(op, inputs, params, meta):
    return _dispatch(op, inputs, params, [meta])[0]


# ---- Factories ----


def _np_dtype_to_stax(dt):
    if np.dtype(dt) not in _FROM_NP:
        raise TypeError(f"can't convert np.ndarray of type numpy.{np.dtype(dt)}. The only supported "
                        "types are: float64, float32, float16, int64, int32, int16, int8, uint8, and bool.")
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


def _specialize_sizes(data):
    if isinstance(data, SymbolicInt):
        return int(data)
    if isinstance(data, SymbolicFloat):     # a run-time float as data: its value (specialized)
        return float(data)
    if isinstance(data, (list, tuple)):
        return [_specialize_sizes(x) for x in data]
    return data


def tensor(data, dtype=None, device=None):
    """A new tensor holding a copy of `data` (nested lists, scalars, numpy arrays, tensors)."""
    device = _DEFAULT_DEVICE if device is None else device
    if _norm_device(device) != "cpu":
        return _move(tensor(data, dtype, "cpu"), _norm_device(device))   # (not the default device again)
    if isinstance(data, Tensor):
        if dtype is not None and dtype is not data.dtype:
            data = _op("to_dtype", [data], {"dtype": dtype}, _meta(data.shape, dtype, data.device))
        return _op("clone", [data], {}, _meta(data.shape, data.dtype, data.device))
    if isinstance(data, (list, tuple, SymbolicInt, SymbolicFloat)):    # sizes, floats in the data: values
        data = _specialize_sizes(data)
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
        traced = getattr(type(a), "_stax_from_numpy", None)     # an ndarray argument while capturing
        if traced is not None:
            return traced(a)
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
    if device != "cpu" and _TLS.tracer is None:   # made on the host, then copied to the device
        return _move(_op(op, [], params, _meta(shape, dtype)), device)
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
    if _TLS.tracer is not None:
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


def _grad_leaf(factory):
    """`factory(..., requires_grad=True)`: the new tensor is a leaf that autograd tracks (§5)."""
    @functools.wraps(factory)
    def make(*args, requires_grad=False, **kwargs):
        t = factory(*args, **kwargs)
        if requires_grad:
            if not t.dtype.is_floating_point:
                raise RuntimeError("Only Tensors of floating point and complex dtype can require gradients")
            t.requires_grad = True
        return t
    return make


tensor, full, zeros, ones, empty, arange, rand, randn = (
    _grad_leaf(f) for f in (tensor, full, zeros, ones, empty, arange, rand, randn))


# ---- Writes: where in-place ops and __setitem__ (tensor_ops.py) end ----


def _write(target, value):
    """Store `value` (already target's shape and dtype) into target's storage, through its view."""
    tracer = _TLS.tracer
    if _AUTOGRAD is not None:
        _AUTOGRAD.before_write(target, value)
    if tracer is not None and (_is_proxy(target) or _is_proxy(value)):
        tracer.mutate(target, value)
        if _AUTOGRAD is not None:       # (a compiled training step's capture: §5, aot_autograd.py)
            _AUTOGRAD.after_write(target, value)
        return
    _write_data(target, value)
    target._storage.version += 1
    if _AUTOGRAD is not None:
        _AUTOGRAD.after_write(target, value)


def _write_data(target, value):
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
