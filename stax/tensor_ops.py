"""The op functions of the tiny tensor, and the Tensor methods and operators that call them.

Layer: above tensor.py (it imports tensor.py; tensor.py never imports it) and op_table.py. Every
function here has PyTorch's name, signature, dtype rule and error messages, and does one of two
things: it computes an output's metadata (shape, stride, dtype, device) and hands a primitive op to
the choke point `tensor._op` (so the tracer sees it as one node), or it is a composite (softmax,
layer_norm, var, gelu, ...) written only in terms of the public functions, so that it traces into
primitives automatically. It consumes Tensors and Python scalars and produces Tensors. At its end it
binds the methods, operators and in-place methods onto `tensor.Tensor` (`x.sum()`, `x + y`, `x[1:]`,
`x.T`, `x.to(...)`, `x.add_(y)`), so importing `stax` gives a complete Tensor. The package exports
everything public here as `stax.<name>`.

Where to look:
  - views:                     permute/expand/_slice/select/reshape and their composites, _getitem
  - pointwise ops:             one line per op (`exp = _unary_op("exp")`), rules from op_table.OPS;
                               add/sub/div, where, clamp, gelu
  - reductions, composites:    sum ... logsumexp, softmax, layer_norm
  - matmul, cat, stack:        matmul, cat, stack, clone, nonzero, unique
  - in-place writes:           _inplace, copy_, fill_, zero_ (they end in tensor._write)
  - Tensor methods:            the last section (casts, indexing, operators, in-place methods)
"""
import builtins as _b
import math
import operator
import sys
from collections import namedtuple

import numpy as np

from .dtypes import _HALF, DType, bfloat16, bool_, can_cast, float16, float32, float64, int32, int64
from .op_table import OPS
from .tensor import (Meta, SymbolicFloat, SymbolicInt, Tensor, _contig, _device, _meta, _move, _norm_device, _numel, _op,
                     _scalar, _shape_args, _wrap_dim, _write, current_tracer, full, result_type, tensor)

__all__ = """permute expand expand_as select view reshape unsqueeze squeeze flatten transpose t
    narrow broadcast_shapes add sub div true_divide floor_divide multiply subtract to_dtype where
    clamp clip gelu silu sum prod amax amin argmax argmin max min mean var std logsumexp cumsum
    softmax log_softmax layer_norm matmul mm bmm cat concat stack clone contiguous nonzero
    unique bincount masked_select _check copy_ fill_ zero_""".split()
__all__ += [d.name for d in OPS.values() if d.kind in ("unary", "binary") and d.name not in __all__]


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
    if isinstance(size, SymbolicInt) or isinstance(index, SymbolicInt):   # (§10: no modulo of a symbol)
        index = index + size if index < 0 else index
    else:
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
            # (a data-dependent size in static mode is a bare sympy symbol: no slice.indices either)
            symbolic = _b.any(isinstance(v, SymbolicInt) or (v is not None and not isinstance(v, _b.int))
                              for v in (x.shape[dim], k.start, k.stop))
            start, stop, step = _symbolic_indices(k, x.shape[dim]) if symbolic else k.indices(x.shape[dim])
            if step <= 0:
                raise ValueError("step must be greater than zero")
            if (start, stop, step) != (0, x.shape[dim], 1):   # a full ':' needs no view op
                x = _slice(x, dim, start, _b.max(stop, start), step)
            dim += 1
        else:
            x = select(x, dim, operator.index(k))
    return x


def _symbolic_indices(k, n):
    """slice.indices for a symbolic size `n` or bound (§10.4): the same clamps, each a decision (a guard
    where the ranges do not settle it), so `x[1:]`, `x[:-1]`, `x[2:n-1]` keep symbolic bounds."""
    step = 1 if k.step is None else operator.index(k.step)
    if step != 1:       # a stepped slice's length is a floor division: the size is specialized
        return k.indices(operator.index(n))

    def clamp(v, default):
        if v is None:
            return default
        v = v if isinstance(v, SymbolicInt) else operator.index(v)
        if v < 0:
            v = v + n
            return 0 if v < 0 else v
        return n if v > n else v
    return clamp(k.start, 0), clamp(k.stop, n), step


# ---- Pointwise ops ----


def _broadcast_shapes(*shapes):
    nd = _b.max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, size in enumerate(s):
            j = nd - len(s) + i
            # a literal 1 on either side needs no decision: the other size is the result, even
            # when it is a data-dependent size (§10.5) that turns out to be 1 at run time
            if size.__class__ is int and size == 1:
                continue
            if out[j].__class__ is int and out[j] == 1:
                out[j] = size
            elif size != out[j]:
                raise RuntimeError(f"The size of tensor a ({out[j]}) must match the size of "
                                   f"tensor b ({size}) at non-singleton dimension {j}")
    return tuple(out)


def broadcast_shapes(*shapes):
    return _broadcast_shapes(*[tuple(s) for s in shapes])


def _pointwise(op, inputs, out_dtype):
    tensors = [x for x in inputs if isinstance(x, Tensor)]
    shape = _broadcast_shapes(*[x.shape for x in tensors])
    return _op(op, list(inputs), {}, _meta(shape, out_dtype, _device(*tensors)))


def _float_result(dt):
    return dt if dt.is_floating_point else float32


def _out_dtype(rule, dt):
    return {"same": dt, "float": _float_result(dt), "bool": bool_}[rule]


# op name -> the public function of a unary or binary op of op_table.OPS; each becomes a Tensor
# method of the same name (`x.exp()`) at the end of this module
_POINTWISE_FUNCTIONS = {}


def _unary_op(op):
    """The public function of a unary op of op_table.OPS (its dtype rule, ATen's refusals)."""
    rule = OPS[op].dtype

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
        return _pointwise(op, [x], _out_dtype(rule, dt))
    fn.__name__ = op
    _POINTWISE_FUNCTIONS[op] = fn
    return fn


def _binary_op(op):
    """The public function of a binary op of op_table.OPS (promotion, its dtype rule, refusals)."""
    rule = OPS[op].dtype

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
        return _pointwise(op, [a, b], _out_dtype(rule, dt))
    fn.__name__ = op
    _POINTWISE_FUNCTIONS[op] = fn
    return fn


neg = _unary_op("neg")
abs = _unary_op("abs")
exp = _unary_op("exp")
exp2 = _unary_op("exp2")
log = _unary_op("log")
log2 = _unary_op("log2")
sqrt = _unary_op("sqrt")
rsqrt = _unary_op("rsqrt")
sin = _unary_op("sin")
cos = _unary_op("cos")
tanh = _unary_op("tanh")
sigmoid = _unary_op("sigmoid")
erf = _unary_op("erf")
log1p = _unary_op("log1p")
expm1 = _unary_op("expm1")
relu = _unary_op("relu")
floor = _unary_op("floor")
ceil = _unary_op("ceil")
round = _unary_op("round")
trunc = _unary_op("trunc")
sign = _unary_op("sign")
reciprocal = _unary_op("reciprocal")
isnan = _unary_op("isnan")
isinf = _unary_op("isinf")
logical_not = _unary_op("logical_not")
bitwise_not = _unary_op("bitwise_not")

_add = _binary_op("add")        # add, sub, div: the public functions below take alpha / rounding_mode
_sub = _binary_op("sub")
_div = _binary_op("div")
mul = _binary_op("mul")
floordiv = _binary_op("floordiv")
remainder = _binary_op("remainder")
pow = _binary_op("pow")
atan2 = _binary_op("atan2")
fmod = _binary_op("fmod")       # (math_ops.fmod is the public one: integers there, floats here)
maximum = _binary_op("maximum")
minimum = _binary_op("minimum")
eq = _binary_op("eq")
ne = _binary_op("ne")
lt = _binary_op("lt")
le = _binary_op("le")
gt = _binary_op("gt")
ge = _binary_op("ge")
logical_and = _binary_op("logical_and")
logical_or = _binary_op("logical_or")
logical_xor = _binary_op("logical_xor")
bitwise_and = _binary_op("bitwise_and")
bitwise_or = _binary_op("bitwise_or")
bitwise_xor = _binary_op("bitwise_xor")


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
    elif approximate == "none":       # one autograd node: its derivative is op_table's "gelu"
        y = _composite("gelu", [x], {}, lambda: mul(mul(x, 0.5), add(erf(mul(x, 0.7071067811865476)), 1)))
    else:
        raise RuntimeError("approximate argument must be either none or tanh.")
    return _downcast(y, dt)


def _composite(op, inputs, params, compute):
    """`compute()`, standing for one autograd node `op` (autograd.composite) when autograd is loaded."""
    hooks = sys.modules[Tensor.__module__]._AUTOGRAD
    return compute() if hooks is None else hooks.composite(op, inputs, params, compute)


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


def _max_or_min(name, x, dim, keepdim):
    """torch.max/min: elementwise with a tensor, the whole reduction without dim, else (values, indices)."""
    pairwise, reduce, arg, ret = ((maximum, amax, argmax, _max_ret) if name == "max" else
                                  (minimum, amin, argmin, _min_ret))
    if isinstance(dim, Tensor):
        return pairwise(x, dim)
    if dim is None:
        if x.numel() == 0:
            raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == "
                               "0. Specify the reduction dim with the 'dim' argument.")
        return reduce(x)
    return ret(reduce(x, dim, keepdim), arg(x, dim, keepdim))


def max(x, dim=None, keepdim=False):
    return _max_or_min("max", x, dim, keepdim)


def min(x, dim=None, keepdim=False):
    return _max_or_min("min", x, dim, keepdim)


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
        raise RuntimeError("std and var only support floating point and complex dtypes")
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
    if current_tracer() is not None and x.dtype is float32:
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
    if b.ndim == 2 and a.ndim > 2:
        # a matrix every batch shares stays 2-D in the graph (lowering broadcasts it for the
        # kernel), so its gradient is one product over all rows, not per-batch partials (autograd.py)
        return _op("matmul", [a, b], {}, _meta(tuple(a.shape[:-1]) + (n,), a.dtype, _device(a, b)))
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


def bincount(x, weights=None, minlength=0):
    if weights is not None:
        raise NotImplementedError("stax.bincount: weights are not supported; multiply the one-hot "
                                  "counts yourself, or run it outside the compiled function")
    if x.ndim != 1 or x.dtype.is_floating_point or x.dtype.name == "bool":
        raise RuntimeError(f"bincount only supports 1-d non-negative integral inputs, got a "
                           f"{x.ndim}-d {x.dtype.name} tensor")
    return _op("bincount", [x], {"minlength": int(minlength)}, _meta((None,), int64, x.device))


def masked_select(x, mask):
    if mask.dtype.name != "bool":
        raise RuntimeError(f"masked_select: expected a bool mask, got {mask.dtype.name}")
    _broadcast_shapes(x.shape, mask.shape)      # (raises as eager does when they do not broadcast)
    return _op("masked_select", [x, mask], {}, _meta((None,), x.dtype, _device(x, mask)))


def _check(cond, message=None):
    """`stax._check(cond)` (§10.5, Prop. 10.4): state a fact about sizes. On real sizes it raises
    when `cond` is false; while compiling, a decision about a data-dependent size that its
    constraints do not settle becomes a constraint and a run-time check."""
    if hasattr(cond, "assume"):             # a dynshape.SymBool
        cond.assume()
    elif not cond:
        raise RuntimeError(message or "stax._check failed")


# ---- In-place writes: cast and broadcast a result to the target, then tensor._write ----


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


def _setitem(x, key, value):
    target = _getitem(x, key)
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


# ---- Methods and operators on Tensor ----


def _to(x, *args, dtype=None, device=None, copy=False):
    """Tensor.to(dtype), .to(device), .to(other tensor), with keywords as in torch."""
    for a in args:
        if isinstance(a, DType):
            dtype = a
        elif isinstance(a, Tensor):
            dtype, device = a.dtype, a.device
        else:
            device = a
    y = x
    if device is not None and _norm_device(device) != x.device:
        y = _move(x, _norm_device(device))
    if dtype is None or dtype is y.dtype:
        return clone(y) if copy and y is x else y
    return to_dtype(y, dtype)


def _iter(x):
    if x.ndim == 0:
        raise TypeError("iteration over a 0-d tensor")
    return (select(x, 0, i) for i in range(x.shape[0]))


Tensor.to = _to
Tensor.cpu = lambda self: _to(self, "cpu")
Tensor.cuda = lambda self: _to(self, "cuda")
Tensor.float = lambda self: _to(self, float32)
Tensor.double = lambda self: _to(self, float64)
Tensor.half = lambda self: _to(self, float16)
Tensor.bfloat16 = lambda self: _to(self, bfloat16)
Tensor.int = lambda self: _to(self, int32)
Tensor.long = lambda self: _to(self, int64)
Tensor.bool = lambda self: _to(self, bool_)
Tensor.T = property(lambda self: permute(self, tuple(range(self.ndim))[::-1]))
Tensor.__iter__ = _iter
Tensor.__getitem__ = _getitem
Tensor.__setitem__ = _setitem

# x.f(...) == f(x, ...): every pointwise op of the table, then these functions, under their own names
for _name, _f in _POINTWISE_FUNCTIONS.items():
    setattr(Tensor, _name, _f)
for _f in (add, sub, div, clamp, gelu, silu, to_dtype, sum, prod, amax, amin, argmax, argmin, max, min, mean, var,
           std, logsumexp, cumsum, softmax, log_softmax, matmul, permute, expand, expand_as, view,
           reshape, unsqueeze, squeeze, flatten, transpose, t, narrow, select, clone, contiguous,
           nonzero, unique, copy_, fill_, zero_):
    setattr(Tensor, _f.__name__, _f)
Tensor.clip, Tensor.true_divide, Tensor.floor_divide = clamp, div, floordiv
Tensor.multiply, Tensor.subtract = mul, sub
Tensor.where = lambda self, cond, other: where(cond, self, other)   # == where(cond, x, other)

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


for _name, _f in _INPLACE.items():
    setattr(Tensor, _name, _make_inplace(_name, _f))


def _operand(f, reverse=False):
    def method(self, other):
        if isinstance(other, np.ndarray):
            other = tensor(other)
        elif isinstance(other, (SymbolicInt, SymbolicFloat)):
            pass                        # a size or float argument as a scalar operand: run time (§10.4)
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
