"""Indirect indexing at the tensor level: advanced indexing, gathers, scatters, boolean masks.

Layer: front, above tensor_ops.py (whose basic indexing, views and `where` it builds on) and
tensor.py; nothing below imports it. Chapter: §6 (indirect indexing in the loop IR) seen from the
user's side. Every function here has PyTorch's name, signature and checks, and ends in one of two
primitives of op_table.py, so that capture records one node and lower.py lowers it as a fused
kernel (`ops.indirect_indexing`), not a host fallback:

  - `index(x, i_0..i_k)`: x read at integer index tensors (broadcast together) on some of its dims:
    `x[idx]`, `x[:, idx]`, `x[arange, t]`, `x[i1, i2]`, `index_select`, `gather`,
    `take_along_dim`, `embedding`;
  - `index_put(x, values, i_0..i_k)`: a copy of x with those positions written (or, with
    `accumulate`, added to): `x[idx] = v`, `index_put_`, `scatter(_)`, `scatter_add(_)`,
    `index_add(_)`, `index_copy(_)`. The in-place forms write the result back (tensor._write),
    which capture functionalizes.

Gathers along one dim (`gather`, `scatter`) index every other dim with an `arange`, which the
lowering turns back into plain loop indices. Boolean masks: `x[mask] = v` and `masked_fill` are
pointwise `where`s; `x[mask]` (its size depends on the data) runs eagerly: while compiling it is a
graph break. Negative indices wrap, out-of-range ones raise IndexError naming the op, the index
and the size (eager, and compiled on the CPU; on the GPU see triton_kernel.debug_index_checks).

Duplicates: a position written twice without accumulation keeps the last value in row-major
order of the index (eager and the CPU kernels, as PyTorch's CPU); on the GPU which write wins is
unspecified (PyTorch documents the same). Accumulation adds every value (atomic adds on the GPU).

Where to look:
  - the two primitives and their checks ......... `_index`, `_index_put`
  - parsing a PyTorch indexing key .............. `_parse_key`, `getitem`, `setitem`
  - one-dim gathers and scatters ................ `index_select`, `gather`, `scatter`, `index_add`, ...
  - masks ....................................... `masked_fill`, `_mask_setitem`
  - Tensor methods .............................. the end of the module
"""
import builtins as _b
import operator

import numpy as np

from .dtypes import bool_, int32, int64
from .tensor import Tensor, _device, _meta, _op, _scalar, _wrap_dim, _write, arange, full, tensor
from .tensor_ops import _broadcast_shapes, _getitem as _basic_getitem, _setitem as _basic_setitem
from .tensor_ops import expand, mul, reshape, select, to_dtype, unsqueeze, where

__all__ = """index_select gather take_along_dim embedding scatter scatter_add index_add index_copy
    index_put masked_fill""".split()

# ---- The two primitives: index and index_put ----


def _check_index_dtype(indices, op):
    for i in indices:
        if i.dtype not in (int64, int32):
            raise IndexError(f"{op}(): tensors used as indices must be long or int tensors, "
                             f"got {i.dtype._tname}; cast with .long()")


def _result_shape(x, indices, dims, pos):
    b = _broadcast_shapes(*[i.shape for i in indices])
    rest = [x.shape[d] for d in range(x.ndim) if d not in dims]
    return tuple(rest[:pos]) + b + tuple(rest[pos:])


def _index(x, indices, dims, pos, op):
    """x read at `indices` on `dims`; the broadcast index shape sits at output position `pos`."""
    _check_index_dtype(indices, op)
    shape = _result_shape(x, indices, dims, pos)
    return _op("index", [x, *indices], {"dims": tuple(dims), "pos": pos, "op": op},
               _meta(shape, x.dtype, _device(x, *indices)))


def _index_put(x, indices, dims, pos, values, accumulate, op):
    """A copy of x with x[indices on dims] = values (added with `accumulate`)."""
    _check_index_dtype(indices, op)
    if accumulate and x.dtype is bool_:
        raise RuntimeError(f"{op}(): accumulating into a bool tensor is not supported (the GPU has "
                           "no atomic add for it); accumulate into an integer tensor and compare with 0")
    shape = _result_shape(x, indices, dims, pos)
    values = _scalar(values)
    if isinstance(values, Tensor):
        values = to_dtype(values, x.dtype) if values.dtype is not x.dtype else values
        try:
            values = expand(values, shape)
        except RuntimeError:
            raise RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be "
                               f"broadcast to indexing result of shape {list(shape)}") from None
    else:
        values = full(shape, values, dtype=x.dtype, device=x.device)
    return _op("index_put", [x, values, *indices],
               {"dims": tuple(dims), "pos": pos, "accumulate": _b.bool(accumulate), "op": op},
               _meta(x.shape, x.dtype, _device(x, values, *indices)))


def _placement(dims) -> int:
    """PyTorch's rule: the index dims replace the indexed dims where those are adjacent, else
    they go first."""
    return dims[0] if list(dims) == list(range(dims[0], dims[0] + len(dims))) else 0


# ---- Parsing an indexing key: basic parts as views, tensors and lists as index tensors ----


def _as_index(k, device="cpu"):
    """Lists and arrays in a key become index tensors on the indexed tensor's device."""
    if isinstance(k, (list, np.ndarray)):
        return tensor(k, device=device) if len(k) or isinstance(k, np.ndarray) else \
            tensor(k, dtype=int64, device=device)
    return k


def _is_advanced(key) -> bool:
    return _b.any(isinstance(k, (Tensor, list, np.ndarray)) or k is True or k is False for k in key)


def _parse_key(x, key):
    """Apply a key's ints, slices, None and ... to x as views; return (the view, the dims of the
    view indexed by tensors, those index tensors). Boolean masks become their nonzero columns
    (eagerly: the count depends on the data)."""
    key = [_as_index(k, x.device) for k in (key if isinstance(key, tuple) else (key,))]
    if _b.any(k is True or k is False for k in key):
        raise IndexError("stax does not support Python bools as indices; use a bool tensor mask")
    used = _b.sum(k.ndim if isinstance(k, Tensor) and k.dtype is bool_ else 1
                  for k in key if k is not None and k is not Ellipsis)
    if used > x.ndim:
        raise IndexError(f"too many indices for tensor of dimension {x.ndim}")
    if _b.sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    y, dim, dims, tensors = x, 0, [], []
    for k in key:
        if k is Ellipsis:
            dim += x.ndim - used
        elif k is None:
            y, dim = unsqueeze(y, dim), dim + 1
        elif isinstance(k, slice):
            y, dim = _basic_getitem(y, (slice(None),) * dim + (k,)), dim + 1
        elif isinstance(k, Tensor) and k.dtype is bool_:
            if tuple(k.shape) != tuple(y.shape[dim:dim + k.ndim]):
                raise IndexError(f"The shape of the mask {list(k.shape)} at index {dim} does not match "
                                 f"the shape of the indexed tensor {list(y.shape)}")
            k._need_data("indexing with a boolean mask (its result's size depends on the data)")
            for col in np.nonzero(k._np()):
                dims.append(dim)
                tensors.append(tensor(col.astype(np.int64), device=y.device))
                dim += 1
        elif isinstance(k, Tensor):
            dims.append(dim)
            tensors.append(k)
            dim += 1
        else:
            y = select(y, dim, operator.index(k))
    return y, dims, tensors


def getitem(x, key):
    """x[key]: basic indexing as views (tensor_ops), advanced indexing as one `index` node."""
    if not _is_advanced(key if isinstance(key, tuple) else (key,)):
        return _basic_getitem(x, key)
    y, dims, tensors = _parse_key(x, key)
    return _index(y, tensors, dims, _placement(dims), "index")


def _mask_setitem(x, mask, value) -> bool:
    """x[mask] = v as a pointwise where, when v broadcasts over the masked rows (a scalar, or a
    tensor shaped like the dims the mask leaves); returns False when it does not."""
    rest = tuple(x.shape[mask.ndim:])
    if tuple(mask.shape) != tuple(x.shape[:mask.ndim]):
        raise IndexError(f"The shape of the mask {list(mask.shape)} at index 0 does not match the "
                         f"shape of the indexed tensor {list(x.shape)}")
    if isinstance(value, Tensor):
        shape = tuple(value.shape)
        while shape and shape[0] == 1 and len(shape) > len(rest):
            shape = shape[1:]
        if len(shape) > len(rest) or _broadcast_shapes(shape, rest) != rest:
            return False
        value = to_dtype(reshape(value, shape), x.dtype) if value.dtype is not x.dtype else reshape(value, shape)
    else:
        value = full((), value, dtype=x.dtype, device=x.device)
    m = reshape(mask, tuple(mask.shape) + (1,) * len(rest))
    _write(x, expand(where(m, value, x), x.shape))
    return True


def setitem(x, key, value, accumulate=False):
    """x[key] = value (index_put_ with `accumulate`): basic keys write through a view; tensor keys
    write the `index_put` result back into the view they index."""
    tup = key if isinstance(key, tuple) else (key,)
    if not _is_advanced(tup):
        return _basic_setitem(x, key, value)
    k0 = _as_index(tup[0], x.device)
    if (len(tup) == 1 and isinstance(k0, Tensor) and k0.dtype is bool_ and not accumulate
            and _mask_setitem(x, k0, _scalar(value))):
        return
    y, dims, tensors = _parse_key(x, key)
    _write(y, _index_put(y, tensors, dims, _placement(dims), value, accumulate, "index_put"))


def index_put(x, indices, values, accumulate=False):
    key = tuple(slice(None) if i is None else i for i in indices)
    out = x.clone()
    setitem(out, key, values, accumulate)
    return out


def index_put_(x, indices, values, accumulate=False):
    setitem(x, tuple(slice(None) if i is None else i for i in indices), values, accumulate)
    return x


# ---- Gathers and scatters along one dim ----


def _one_dim_index(index, op):
    if index.ndim > 1:
        raise IndexError(f"{op}(): Index is supposed to be a vector, got {index.ndim} dims")
    return reshape(index, (-1,))


def index_select(x, dim, index):
    dim = _wrap_dim(dim, _b.max(x.ndim, 1))
    return _index(x, [_one_dim_index(index, "index_select")], [dim], dim, "index_select")


def embedding(input, weight):
    """F.embedding(input, weight): rows of `weight` (num_embeddings x dim) at `input`."""
    if weight.ndim != 2:
        raise RuntimeError(f"'weight' must be 2-D, got {weight.ndim}-D")
    return _index(weight, [input], [0], 0, "embedding")


def _along_dim(x, dim, index, op, extent_of=None):
    """Index tensors for every dim of x: `index` at dim, an arange of index's extent elsewhere."""
    if index.ndim != x.ndim:
        raise RuntimeError(f"{op}(): Index tensor must have the same number of dimensions as "
                           f"{'input' if op == 'gather' else 'self'} tensor")
    for d in range(x.ndim):
        if d != dim and index.shape[d] > x.shape[d]:
            raise RuntimeError(f"Size does not match at dimension {d} expected index {list(index.shape)} "
                               f"to be smaller than self {list(x.shape)} apart from dimension {dim}")
    out = []
    for d in range(x.ndim):
        if d == dim:
            out.append(index)
        else:
            shape = [1] * x.ndim
            shape[d] = index.shape[d]
            out.append(reshape(arange(index.shape[d], device=index.device), shape))
    return out


def gather(x, dim, index):
    dim = _wrap_dim(dim, _b.max(x.ndim, 1))
    if x.ndim == 0:
        return reshape(gather(reshape(x, (1,)), 0, reshape(index, (-1,))), index.shape)
    return _index(x, _along_dim(x, dim, index, "gather"), list(range(x.ndim)), 0, "gather")


def take_along_dim(x, indices, dim=None):
    if dim is None:
        return gather(reshape(x, (-1,)), 0, reshape(indices, (-1,)))
    dim = _wrap_dim(dim, x.ndim)
    if x.ndim != indices.ndim:
        raise RuntimeError(f"torch.take_along_dim(): input and indices should have the same number "
                           f"of dimensions, but got {x.ndim} dimensions for input, and "
                           f"{indices.ndim} dimensions for indices")
    xs, js = list(x.shape), list(indices.shape)
    xs[dim] = js[dim] = 1
    b = list(_broadcast_shapes(tuple(xs), tuple(js)))
    x = expand(x, tuple(b[:dim] + [x.shape[dim]] + b[dim + 1:]))
    indices = expand(indices, tuple(b[:dim] + [indices.shape[dim]] + b[dim + 1:]))
    return _index(x, _along_dim(x, dim, indices, "take_along_dim"), list(range(x.ndim)), 0, "take_along_dim")


def _scatter(x, dim, index, src, accumulate, op):
    dim = _wrap_dim(dim, _b.max(x.ndim, 1))
    src = _scalar(src)
    if isinstance(src, Tensor):
        if src.ndim != index.ndim or _b.any(i > s for i, s in zip(index.shape, src.shape)):
            raise RuntimeError(f"Expected index {list(index.shape)} to be smaller than self "
                               f"{list(x.shape)} apart from dimension {dim} and to be smaller size "
                               f"than src {list(src.shape)}")
        if src.dtype is not x.dtype:
            raise RuntimeError(f"{op}(): Expected self.dtype to be equal to src.dtype")
        src = _basic_getitem(src, tuple(slice(0, n) for n in index.shape)) if src.ndim else src
    return _index_put(x, _along_dim(x, dim, index, op), list(range(x.ndim)), 0, src, accumulate, op)


def scatter(x, dim, index, src=None, value=None, reduce=None):
    """x.scatter(dim, index, src | value): out[..., index[i], ...] = src[i] along `dim`."""
    if reduce not in (None, "add"):
        raise NotImplementedError(f"scatter(reduce={reduce!r}) is not supported; use reduce='add' "
                                  "or scatter_add")
    src = value if src is None else src
    return _scatter(x, dim, index, src, reduce == "add", "scatter")


def scatter_add(x, dim, index, src):
    return _scatter(x, dim, index, src, True, "scatter_add")


def _index_dim_update(x, dim, index, source, accumulate, op, alpha=1):
    dim = _wrap_dim(dim, _b.max(x.ndim, 1))
    index = _one_dim_index(index, op)
    want = list(x.shape)
    if x.ndim:
        want[dim] = index.shape[0]
    if list(source.shape) != want and not (x.ndim == 0 and source.numel() == 1):
        raise RuntimeError(f"{op}(): source tensor shape {list(source.shape)} must match self tensor "
                           f"shape {list(x.shape)}, excluding the specified dimension {dim}")
    if source.dtype is not x.dtype:
        raise RuntimeError(f"{op}(): self ({x.dtype._tname}) and source ({source.dtype._tname}) must "
                           "have the same scalar type")
    if alpha != 1:
        source = mul(source, alpha)
    if x.ndim == 0:
        return reshape(_index_dim_update(reshape(x, (1,)), 0, index, reshape(source, (1,)),
                                         accumulate, op), ())
    return _index_put(x, [index], [dim], dim, source, accumulate, op)


def index_add(x, dim, index, source, *, alpha=1):
    return _index_dim_update(x, dim, index, source, True, "index_add", alpha)


def index_copy(x, dim, index, source):
    return _index_dim_update(x, dim, index, source, False, "index_copy")


# ---- Masks ----


def masked_fill(x, mask, value):
    """x where mask is False, `value` (in x's dtype) where it is True: a pointwise where."""
    if not isinstance(mask, Tensor) or mask.dtype is not bool_:
        raise RuntimeError("masked_fill only supports boolean masks, but got mask with dtype "
                           f"{getattr(getattr(mask, 'dtype', None), '_tname', type(mask).__name__)}")
    value = _scalar(value)
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise RuntimeError("masked_fill only supports a 0-dimensional value tensor, but got "
                               f"tensor with {value.ndim} dimension(s).")
        value = to_dtype(value, x.dtype) if value.dtype is not x.dtype else value
    else:
        value = full((), value, dtype=x.dtype, device=x.device)
    return where(mask, value, x)


# ---- Methods on Tensor (in-place forms write the result back through tensor._write) ----


def _inplace(f):
    def method(self, *args, **kwargs):
        out = f(self, *args, **kwargs)
        if tuple(out.shape) != tuple(self.shape):
            raise RuntimeError(f"output with shape {list(self.shape)} doesn't match the broadcast "
                               f"shape {list(out.shape)}")
        _write(self, out)
        return self
    method.__name__ = f.__name__ + "_"
    return method


Tensor.__getitem__ = getitem
Tensor.__setitem__ = setitem
for _f in (index_select, gather, take_along_dim, scatter, scatter_add, index_add, index_copy,
           index_put, masked_fill):
    setattr(Tensor, _f.__name__, _f)
for _f in (scatter, scatter_add, index_add, index_copy, masked_fill):
    setattr(Tensor, _f.__name__ + "_", _inplace(_f))
Tensor.index_put_ = index_put_
