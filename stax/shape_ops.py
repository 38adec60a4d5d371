"""Shape ops with PyTorch's names: splitting, repeating, reordering and masking along dims.

Layer: above tensor_ops.py (whose views and pointwise functions these are written in); below
math_ops.py and the package. Nothing here is a primitive: every function is a composite of the
view ops (slice, select, reshape, permute, expand), `cat`, `where` and the `flip` copy, so it traces
into nodes the §6 lowering already knows (a split is views, `repeat` an expand read through a copy,
`roll` a cat of two slices, `tril` a pointwise `where` on index expressions). Consumes Tensors and
Python ints; produces Tensors (views where PyTorch gives views, copies where it copies).

Where to look:
  - splitting:        chunk, split, tensor_split, unbind, unflatten
  - repeating:        repeat, repeat_interleave, tile
  - reordering:       flip (fliplr, flipud), roll, movedim, swapaxes, diagonal
  - masks on indices: tril, triu, eye, meshgrid
"""
import builtins as _b
import math
import operator

from .dtypes import bool_, float32, int64
from .tensor import Tensor, _meta, _numel, _op, _shape_args, _wrap_dim, arange
from .tensor_ops import (_slice, cat, expand, full, permute, reshape, select, to_dtype, unsqueeze, view,
                         where)

__all__ = """chunk split tensor_split unbind unflatten repeat repeat_interleave tile flip fliplr flipud
    roll movedim moveaxis swapaxes swapdims diagonal tril triu eye meshgrid""".split()


# ---- Splitting: every piece is a view (a slice or a select) ----


def _pieces(x, dim, bounds):
    """Slices [a, b) of x along dim for consecutive bounds."""
    return tuple(_slice(x, dim, a, b) for a, b in zip(bounds[:-1], bounds[1:]))


def split(x, split_size_or_sections, dim=0):
    dim = _wrap_dim(dim, x.ndim)
    n = x.shape[dim]
    if isinstance(split_size_or_sections, (list, tuple)):
        sizes = [operator.index(s) for s in split_size_or_sections]
        if _b.sum(sizes) != n or _b.any(s < 0 for s in sizes):
            raise RuntimeError(f"split_with_sizes expects split_sizes to sum exactly to {n} (input "
                               f"tensor's size at dimension {dim}), but got split_sizes={sizes}")
    else:
        step = operator.index(split_size_or_sections)
        if step <= 0 and not (step == 0 and n == 0):
            raise RuntimeError(f"split expects split_size be non-negative, but got split_size={step}")
        sizes = ([step] * (n // step) + ([n % step] if n % step else [])) if step else []
        sizes = sizes or [0]        # an empty dim splits into one empty piece
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return _pieces(x, dim, bounds)


def chunk(x, chunks, dim=0):
    if chunks <= 0:
        raise RuntimeError("chunk expects `chunks` to be greater than 0, got: %d" % chunks)
    n = x.shape[_wrap_dim(dim, x.ndim)]
    if n == 0:              # (ATen: `chunks` empty pieces)
        return split(x, [0] * chunks, dim)
    return split(x, math.ceil(n / chunks), dim)


def tensor_split(x, indices_or_sections, dim=0):
    """`n` near-equal sections (the first n % sections one longer), or cuts at the given indices."""
    dim = _wrap_dim(dim, x.ndim)
    n = x.shape[dim]
    if isinstance(indices_or_sections, Tensor):
        indices_or_sections = indices_or_sections.tolist()
    if isinstance(indices_or_sections, (list, tuple)):
        cuts = [_b.min(_b.max(i + n if i < 0 else i, 0), n) for i in indices_or_sections]
        bounds = [0] + cuts + [n]
        return tuple(_slice(x, dim, a, _b.max(a, b)) for a, b in zip(bounds[:-1], bounds[1:]))
    k = operator.index(indices_or_sections)
    if k <= 0:
        raise RuntimeError(f"number of sections must be larger than 0, got {k}")
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + n // k + (1 if i < n % k else 0))
    return _pieces(x, dim, bounds)


def unbind(x, dim=0):
    dim = _wrap_dim(dim, x.ndim)
    return tuple(select(x, dim, i) for i in range(x.shape[dim]))


def unflatten(x, dim, sizes):
    dim = _wrap_dim(dim, x.ndim)
    sizes = list(sizes)
    if sizes.count(-1) > 1:
        raise RuntimeError("only one dimension can be inferred")
    if -1 in sizes:
        rest = _numel([s for s in sizes if s != -1])
        sizes[sizes.index(-1)] = x.shape[dim] // rest if rest else 0
    if _numel(sizes) != x.shape[dim]:
        raise RuntimeError(f"unflatten: Provided sizes {list(sizes)} don't multiply up to the size of "
                           f"dim {dim} ({x.shape[dim]}) in the input tensor")
    return view(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1:]) if x.is_contiguous() else \
        reshape(x, x.shape[:dim] + tuple(sizes) + x.shape[dim + 1:])


# ---- Repeating: an expand (stride 0) read through a copy ----


def repeat(x, *sizes):
    sizes = _shape_args(sizes)
    if len(sizes) < x.ndim:
        raise RuntimeError("Number of dimensions of repeat dims can not be smaller than number of "
                           "dimensions of tensor")
    x = view(x, (1,) * (len(sizes) - x.ndim) + x.shape) if len(sizes) > x.ndim else x
    inter, target = [], []
    for r, s in zip(sizes, x.shape):
        inter += [1, s]
        target += [r, s]
    y = expand(reshape(x, inter), target)
    return reshape(y, [r * s for r, s in zip(sizes, x.shape)])


def tile(x, dims):
    dims = tuple(dims)
    return repeat(x, (1,) * (x.ndim - len(dims)) + dims)


def repeat_interleave(x, repeats, dim=None, *, output_size=None):
    """Each element `repeats` times in a row: an int (a broadcast view, reshaped), or a tensor of
    counts, one per element along `dim` (or one for all). A tensor's output size depends on the
    data: the index `repeat_index(repeats)` is a §6.1 fallback kernel with an unbacked size
    (§10.5), and the rows are an index_select through it."""
    if dim is None:
        x, dim = reshape(x, (-1,)), 0
    dim = _wrap_dim(dim, x.ndim)
    if isinstance(repeats, Tensor):
        if repeats.ndim > 1 or repeats.dtype.is_floating_point or repeats.dtype is bool_:
            raise RuntimeError("repeat_interleave only accept 1D vector as repeat (of integers)")
        n = x.shape[dim]
        repeats = reshape(repeats, (-1,))
        if repeats.shape[0] == 1 and n != 1:
            repeats = expand(repeats, (n,))
        if repeats.shape[0] != n:
            raise RuntimeError(f"repeats must have the same size as input along dim, but got "
                               f"repeats.size(0) = {repeats.shape[0]} and input.size({dim}) = {n}")
        from .indexing import _index
        index = _op("repeat_index", [repeats], {}, _meta((None,), int64, repeats.device))
        return _index(x, [index], [dim], dim, "index_select")
    y = unsqueeze(x, dim + 1)
    shape = list(y.shape)
    shape[dim + 1] = repeats
    out = list(x.shape)
    out[dim] = x.shape[dim] * repeats
    return reshape(expand(y, shape), out)


# ---- Reordering ----


def flip(x, *dims):
    dims = sorted({_wrap_dim(d, x.ndim) for d in _shape_args(dims)})
    return _op("flip", [x], {"dims": tuple(dims)}, _meta(x.shape, x.dtype, x.device))


def fliplr(x):
    if x.ndim < 2:
        raise RuntimeError("Input must be >= 2-d.")
    return flip(x, 1)


def flipud(x):
    if x.ndim < 1:
        raise RuntimeError("Input must be >= 1-d.")
    return flip(x, 0)


def roll(x, shifts, dims=None):
    """A copy shifted cyclically: a cat of two slices along each dim (masked loads, one kernel)."""
    if dims is None:
        return view(roll(reshape(x, (-1,)), shifts, 0), x.shape)
    shifts = (shifts,) if isinstance(shifts, int) else tuple(shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims):
        raise RuntimeError(f"shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    for s, d in zip(shifts, dims):
        d = _wrap_dim(d, x.ndim)
        n = x.shape[d]
        k = s % n if n else 0
        if k:
            x = cat([_slice(x, d, n - k, n), _slice(x, d, 0, n - k)], d)
    return x


def movedim(x, source, destination):
    src = [source] if isinstance(source, int) else list(source)
    dst = [destination] if isinstance(destination, int) else list(destination)
    if len(src) != len(dst):
        raise RuntimeError(f"movedim: Invalid source or destination dims: source ({src} dims) should "
                           f"contain the same number of dims as destination ({dst} dims)")
    src = [_wrap_dim(d, x.ndim) for d in src]
    dst = [_wrap_dim(d, x.ndim) for d in dst]
    order = [None] * x.ndim
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(x.ndim) if d not in src)
    return permute(x, [o if o is not None else next(rest) for o in order])


moveaxis = movedim


def swapaxes(x, axis0, axis1):
    dims = list(range(x.ndim))
    a, b = _wrap_dim(axis0, x.ndim), _wrap_dim(axis1, x.ndim)
    dims[a], dims[b] = dims[b], dims[a]
    return permute(x, dims)


swapdims = swapaxes


def diagonal(x, offset=0, dim1=0, dim2=1):
    """The diagonal as the last dim: the two dims flattened, then every (size2 + 1)-th element.
    A view when the two dims can be flattened without a copy (contiguous ones), else a copy."""
    d1, d2 = _wrap_dim(dim1, x.ndim), _wrap_dim(dim2, x.ndim)
    if d1 == d2:
        raise RuntimeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
    y = movedim(x, (d1, d2), (-2, -1))
    n, m = y.shape[-2:]
    length = _b.max(0, _b.min(n + _b.min(offset, 0), m - _b.max(offset, 0)))
    start = offset if offset >= 0 else -offset * m
    flat = reshape(y, y.shape[:-2] + (n * m,))
    if length == 0:
        return _slice(flat, flat.ndim - 1, 0, 0)
    return _slice(flat, flat.ndim - 1, start, start + (length - 1) * (m + 1) + 1, m + 1)


# ---- Masks on indices: pointwise `where`s on index expressions ----


def _col_minus_row(x, device):
    n, m = x.shape[-2:]
    return arange(m, device=device) - unsqueeze(arange(n, device=device), 1)


def tril(x, diagonal=0):
    if x.ndim < 2:
        raise RuntimeError("tril: input tensor must have at least 2 dimensions")
    return where(_col_minus_row(x, x.device) <= diagonal, x, full((), 0, dtype=x.dtype, device=x.device))


def triu(x, diagonal=0):
    if x.ndim < 2:
        raise RuntimeError("triu: input tensor must have at least 2 dimensions")
    return where(_col_minus_row(x, x.device) >= diagonal, x, full((), 0, dtype=x.dtype, device=x.device))


def eye(n, m=None, *, dtype=None, device=None):
    m = n if m is None else m
    if n < 0 or m < 0:
        raise RuntimeError(f"n must be greater or equal to 0, got {_b.min(n, m)}")
    on = unsqueeze(arange(n, device=device), 1) == arange(m, device=device)
    return to_dtype(on, dtype or float32) if (dtype or float32) is not bool_ else on


def meshgrid(*tensors, indexing="ij"):
    ts = list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else list(tensors)
    if indexing not in ("ij", "xy"):
        raise RuntimeError(f"torch.meshgrid: indexing must be one of \"xy\" or \"ij\", but received: {indexing}")
    for t in ts:
        if t.ndim > 1:
            raise RuntimeError("torch.meshgrid: Expected 0D or 1D tensor in the tensor list but got: "
                               f"{t.ndim}D")
    ts = [reshape(t, (-1,)) for t in ts]
    swap = indexing == "xy" and len(ts) >= 2
    if swap:
        ts[0], ts[1] = ts[1], ts[0]
    shape = tuple(t.shape[0] for t in ts)
    out = [expand(view(t, tuple(-1 if k == i else 1 for k in range(len(ts)))), shape)
           for i, t in enumerate(ts)]
    if swap:                # "xy": the grid of the first two swapped, handed back in input order
        out[0], out[1] = out[1], out[0]
    return tuple(out)


# ---- Tensor methods ----

for _f in (chunk, split, tensor_split, unbind, unflatten, repeat, repeat_interleave, tile, flip, fliplr,
           flipud, roll, movedim, moveaxis, swapaxes, swapdims, diagonal, tril, triu):
    setattr(Tensor, _f.__name__, _f)
Tensor.mT = property(lambda self: swapaxes(self, -2, -1))
Tensor.mH = Tensor.mT
