"""Math ops with PyTorch's names that tensor_ops.py lacks: pointwise composites, reductions,
sorting and scans, factories, in-place forms and keyword aliases.

Layer: above tensor_ops.py and shape_ops.py; below the package (`stax.<name>`) and stax/nn. Like
tensor_ops.py, each function either hands one primitive of op_table.py to the choke point
(`atan2`, `fmod`, the scans `cumprod`/`logcumsumexp`, the fallbacks `sort`/`argsort`, the factories `randint`
and `philox_rand`) or is a composite of public functions that traces into primitives the §6
lowering fuses: `lerp`, `addcmul`, `isclose`, `masked_fill` are pointwise; `any`, `all`, `norm`,
`var_mean` are reductions; `einsum` is permutes, reshapes, one `matmul` per operand pair and sums.
Consumes Tensors and Python scalars; produces Tensors.

Where the §6.1 fallbacks are: `sort`, `argsort` (and `topk`, a sort then a slice) run their numpy
implementation in an extern kernel; `where(cond)` is `nonzero` (an output size that depends on the
data). `cumprod` and `logcumsumexp` (like `cumsum`) are scans, lowered as an ir.Scan (lower_scan.py).

Where to look:
  - pointwise composites:    square, atan2, fmod, lerp, addcmul, addcdiv, clamp_min/max, masked_fill,
                             isclose, allclose, where (one argument)
  - reductions:              any, all, norm, linalg.vector_norm, var_mean, std_mean, count_nonzero
  - products:                outer, einsum, _scaled_mm (§9.8 float8, torch's spelling)
  - sorting and scans:       sort, argsort, topk, msort, cumprod, logcumsumexp, cummax, cummin
  - factories:               *_like with dtype=/device=, randint, linspace, logspace, new_*, type_as
  - aliases and in-place:    axis=/keepdims= on reductions; x.sqrt_(), x.lerp_(...), ...
  - ops Stax lacks ........... SPELLINGS, missing_op (the AttributeError that names what works)
"""
import builtins as _b
import functools
import math
import types
from collections import namedtuple

from . import tensor_ops as _t
from .dtypes import _HALF, FLOAT8, bfloat16, bool_, float16, float32, float64, float8_e5m2, int8, int16, int64, uint8
from .tensor import (Tensor, _meta, _op, _scalar, _wrap_dim, arange, empty, full, rand, randn,
                     result_type, tensor)
from .tensor_ops import (_POINTWISE_FUNCTIONS, _downcast, _inplace, _upcast,
                         abs, add, amax, amin, div, expand, isinf, isnan, logical_and, logical_or,
                         matmul, maximum, minimum, mul, ne, permute, remainder, reshape, sqrt, sub,
                         sum, to_dtype, unsqueeze, where)
from .shape_ops import diagonal, tril, triu

__all__ = """square atan2 arctan2 fmod round lerp addcmul addcdiv clamp_min clamp_max masked_fill isclose
    allclose where any all norm var_mean std_mean count_nonzero outer ger einsum sort argsort topk msort
    cumsum cumprod logcumsumexp cummax cummin zeros_like ones_like full_like empty_like rand_like randn_like randint
    linspace logspace type_as
    linalg sum mean amax amin prod var std logsumexp argmax argmin max min _scaled_mm""".split()


# ---- Pointwise composites (one fused kernel each) ----

_atan2, _fmod = _t.atan2, _t.fmod


def square(x):
    return mul(x, x) if x.dtype is not bool_ else mul(to_dtype(x, int64), to_dtype(x, int64))


def atan2(a, b):
    return _atan2(a, b)


arctan2 = atan2


def fmod(a, b):
    """C's fmod: the remainder with the dividend's sign. Integers: `remainder` moved to that sign."""
    dt = result_type(_scalar(a), _scalar(b))
    if dt.is_floating_point:
        return _fmod(a, b)
    r = remainder(a, b)
    a_neg = _t.lt(a, 0) if isinstance(a, Tensor) else a < 0
    b_neg = _t.lt(b, 0) if isinstance(b, Tensor) else b < 0
    signs_differ = _t.logical_xor(a_neg, b_neg) if isinstance(a_neg, Tensor) else _t.logical_xor(b_neg, a_neg)
    return where(logical_and(ne(r, 0), signs_differ), sub(r, b), r)


def lerp(start, end, weight):
    """ATen's two-sided form: exact at both ends (weight 0 gives start, weight 1 gives end)."""
    start, half = _upcast(start)
    diff = sub(end, start)
    if not isinstance(weight, Tensor):      # a scalar weight picks its side here
        y = add(start, mul(diff, weight)) if _b.abs(weight) < 0.5 else sub(end, mul(diff, 1 - weight))
        return _downcast(y, half)
    y = where(_t.lt(_t.abs(weight), 0.5), add(start, mul(weight, diff)), sub(end, mul(diff, sub(1, weight))))
    return _downcast(y, half)


def _scaled(t, value):
    """t * value, skipped for the Python scalar 1 (a tensor value is always applied)."""
    return t if not isinstance(value, Tensor) and value == 1 else mul(t, value)


def addcmul(x, tensor1, tensor2, *, value=1):
    return add(x, _scaled(mul(tensor1, tensor2), value))


def addcdiv(x, tensor1, tensor2, *, value=1):
    return add(x, _scaled(div(tensor1, tensor2), value))


def round(x, *, decimals=0):
    """Round half to even; with `decimals`, at that decimal place (ATen: scale, round, unscale)."""
    if decimals == 0:
        return _t.round(x)
    if not x.dtype.is_floating_point:
        raise RuntimeError("round_decimals: not implemented for integer inputs")
    scale = 10.0 ** _b.abs(decimals)
    return div(_t.round(mul(x, scale)), scale) if decimals > 0 else mul(_t.round(div(x, scale)), scale)


def clamp_min(x, min):
    return maximum(x, min)


def clamp_max(x, max):
    return minimum(x, max)


def masked_fill(x, mask, value):
    if not isinstance(mask, Tensor) or mask.dtype is not bool_:
        raise RuntimeError("masked_fill_ only supports boolean masks, but got mask with dtype "
                           f"{mask.dtype._tname if isinstance(mask, Tensor) else type(mask).__name__}")
    if isinstance(value, Tensor):
        if value.ndim:
            raise RuntimeError("masked_fill_ only supports a 0-dimensional value tensor, but got tensor "
                               f"with {value.ndim} dimension(s).")
        value = to_dtype(value, x.dtype)
    else:
        value = full((), value, dtype=x.dtype, device=x.device)
    return expand(where(mask, value, x), _t._broadcast_shapes(x.shape, mask.shape))


def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    if a.dtype is not b.dtype:
        raise RuntimeError(f"{a.dtype._tname} did not match {b.dtype._tname}")
    if not a.dtype.is_floating_point:
        return _t.eq(a, b) if rtol == 0 and atol == 0 else _t.le(abs(sub(to_dtype(a, float32), b)),
                                                                 atol + rtol * abs(to_dtype(b, float32)))
    x, y = (to_dtype(a, float32), to_dtype(b, float32)) if a.dtype in _HALF else (a, b)
    close = logical_or(_t.eq(x, y), _t.le(abs(sub(x, y)), add(mul(abs(y), rtol), atol)))
    close = logical_and(close, _inf_compatible(x, y))
    return logical_or(close, logical_and(isnan(x), isnan(y))) if equal_nan else close


def _inf_compatible(x, y):
    """Infinities are close only to themselves (|inf - 1| <= inf must not count)."""
    return _t.logical_not(logical_or(_t.logical_xor(isinf(x), isinf(y)),
                                     logical_and(isinf(x), ne(x, y))))


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(all(isclose(a, b, rtol, atol, equal_nan)).item())


def where(condition, input=None, other=None):
    """where(cond, x, y), or where(cond): the indices of the true elements, one tensor per dim."""
    if input is None and other is None:
        idx = _t.nonzero(condition)
        return tuple(_t.select(idx, 1, d) for d in range(condition.ndim))
    return _t.where(condition, input, other)


# ---- Reductions ----


def any(x, dim=None, keepdim=False):
    """Is any element nonzero (NaN counts): a sum of the nonzero flags, compared with 0."""
    return _t.gt(sum(to_dtype(ne(x, 0), int64), dim, keepdim), 0)


def all(x, dim=None, keepdim=False):
    return _t.eq(sum(to_dtype(_t.eq(x, 0), int64), dim, keepdim), 0)


def count_nonzero(x, dim=None):
    return sum(to_dtype(ne(x, 0), int64), dim)


def _vector_norm(x, ord, dim, keepdim):
    if not x.dtype.is_floating_point:
        raise RuntimeError(f"linalg.vector_norm: Expected a floating point or complex tensor as input. "
                           f"Got {x.dtype._tname}")
    x, half = _upcast(x)
    a = abs(x)
    if ord == 2:
        y = sqrt(sum(mul(x, x), dim, keepdim))
    elif ord == 1:
        y = sum(a, dim, keepdim)
    elif ord == math.inf:
        y = amax(a, dim if dim is not None else (), keepdim)
    elif ord == -math.inf:
        y = amin(a, dim if dim is not None else (), keepdim)
    elif ord == 0:
        y = sum(to_dtype(ne(x, 0), x.dtype), dim, keepdim)
    else:
        y = _t.pow(sum(_t.pow(a, ord), dim, keepdim), 1.0 / ord)
    return _downcast(y, half)


def _linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(x if dtype is None else to_dtype(x, dtype), ord, dim, keepdim)


def norm(x, p="fro", dim=None, keepdim=False, dtype=None):
    """torch.norm: vector norms over `dim` (all elements by default); "fro" is the 2-norm."""
    if p == "nuc":
        raise NotImplementedError("stax.norm: the nuclear norm needs an SVD, which Stax does not have")
    p = 2 if p == "fro" or p is None else p
    return _vector_norm(x if dtype is None else to_dtype(x, dtype), p, dim, keepdim)


linalg = types.SimpleNamespace(vector_norm=_linalg_vector_norm, norm=norm)


def var_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return (_t.var(x, dim, unbiased, keepdim, correction=correction), _t.mean(x, dim, keepdim))


def std_mean(x, dim=None, unbiased=None, keepdim=False, *, correction=None):
    return (_t.std(x, dim, unbiased, keepdim, correction=correction), _t.mean(x, dim, keepdim))


# ---- Products: outer, einsum (to matmul and pointwise) ----


def outer(a, b):
    if a.ndim != 1 or b.ndim != 1:
        raise RuntimeError(f"outer: expected 1-D tensors, got {a.ndim}-D and {b.ndim}-D")
    return mul(unsqueeze(a, 1), unsqueeze(b, 0))


ger = outer


def _einsum_parse(equation, n):
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    ins = lhs.split(",")
    if len(ins) != n:
        raise ValueError(f"einsum(): {len(ins)} operands in the equation but {n} were given")
    if "." in eq:
        raise NotImplementedError("stax.einsum: ellipsis ('...') is not supported; name every dim")
    if not arrow:       # implicit output: the letters seen once, in alphabetical order
        out = "".join(sorted(c for c in set(lhs) - {","} if lhs.count(c) == 1))
    return ins, out


def _einsum_diagonals(t, s, k):
    """A letter repeated in one operand ('ii', 'bii') is its diagonal: taken (a view) as the last
    dim until every letter of the operand is distinct."""
    while len(set(s)) != len(s):
        c = next(c for c in s if s.count(c) > 1)
        i, j = s.index(c), s.index(c, s.index(c) + 1)
        if t.shape[i] != t.shape[j]:
            raise RuntimeError(f"einsum(): subscript {c} is repeated for operand {k} but the sizes "
                               f"don't match, {t.shape[j]} != {t.shape[i]}")
        t, s = diagonal(t, 0, i, j), "".join(x for n, x in enumerate(s) if n not in (i, j)) + c
    return t, s


def _einsum_pair(a, sa, b, sb, keep):
    """Contract two operands (letters sa, sb) into one whose letters are `keep` order-free:
    batch letters (both, kept), contracted (both, dropped), left- and right-only letters."""
    batch = [c for c in sa if c in sb and c in keep]
    contr = [c for c in sa if c in sb and c not in keep]
    left = [c for c in sa if c not in sb]
    right = [c for c in sb if c not in sa]
    size = {c: a.shape[i] for i, c in enumerate(sa)} | {c: b.shape[i] for i, c in enumerate(sb)}
    pa = permute(a, [sa.index(c) for c in batch + left + contr])
    pb = permute(b, [sb.index(c) for c in batch + contr + right])
    n = lambda cs: math.prod(size[c] for c in cs)
    nb, nl, nk, nr = n(batch), n(left), n(contr), n(right)
    prod = matmul(reshape(pa, (nb, nl, nk)), reshape(pb, (nb, nk, nr)))
    return reshape(prod, [size[c] for c in batch + left + right]), "".join(batch + left + right)


def einsum(equation, *operands):
    """Einstein summation: letters only in one operand and not in the output are summed first,
    then operands are contracted pairwise by `matmul`, then the result is permuted."""
    ops_ = list(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else list(operands)
    ins, out = _einsum_parse(equation, len(ops_))
    for t, s in zip(ops_, ins):
        if t.ndim != len(s):
            raise RuntimeError(f"einsum(): the number of subscripts in the equation ({len(s)}) does not "
                               f"match the number of dimensions ({t.ndim}) for operand")
    terms = [_einsum_diagonals(t, s, k) for k, (t, s) in enumerate(zip(ops_, ins))]
    acc, sa = terms[0]
    for k, (b, sb) in enumerate(terms[1:], 1):
        later = set(out) | {c for _, s in terms[k + 1:] for c in s}
        lone = [c for c in sa if c not in sb and c not in later]
        if lone:
            acc, sa = sum(acc, [sa.index(c) for c in lone]), "".join(c for c in sa if c not in lone)
        acc, sa = _einsum_pair(acc, sa, b, sb, later | set(sa) - set(sb) | set(sb) - set(sa))
    drop = [sa.index(c) for c in sa if c not in out]
    if drop:
        acc, sa = sum(acc, drop), "".join(c for c in sa if c in out)
    if set(out) - set(sa):
        raise RuntimeError(f"einsum(): output subscript {sorted(set(out) - set(sa))[0]} does not "
                           "appear in the equation for any input operand")
    return permute(acc, [sa.index(c) for c in out]) if sa != out else acc


# ---- Sorting (§6.1 fallback kernels) and scans (§6 ir.Scan, as cumsum) ----

_sort_ret = namedtuple("sort", "values indices")
_topk_ret = namedtuple("topk", "values indices")


def _sort_op(op, x, dim, descending, dtype):
    dim = _wrap_dim(dim, x.ndim) if x.ndim else 0
    return _op(op, [x], {"dim": dim, "descending": _b.bool(descending)}, _meta(x.shape, dtype, x.device))


def sort(x, dim=-1, descending=False, stable=False):
    """(values, indices); ties keep their input order (a stable sort), NaN sorts as the largest."""
    return _sort_ret(_sort_op("sort", x, dim, descending, x.dtype),
                     _sort_op("argsort", x, dim, descending, int64))


def argsort(x, dim=-1, descending=False, stable=False):
    return _sort_op("argsort", x, dim, descending, int64)


def msort(x):
    return sort(x, 0).values


def topk(x, k, dim=-1, largest=True, sorted=True):
    d = _wrap_dim(dim, x.ndim) if x.ndim else 0
    n = x.shape[d] if x.ndim else 1
    if not 0 <= k <= n:
        raise RuntimeError("selected index k out of range")
    values, indices = sort(x, d, descending=largest)
    if x.ndim == 0:
        return _topk_ret(values, indices)
    return _topk_ret(_t.narrow(values, d, 0, k), _t.narrow(indices, d, 0, k))


def _scan(op, x, dim, dtype):
    x = x if dtype is None else to_dtype(x, dtype)
    if op == "logcumsumexp" and not x.dtype.is_floating_point:
        raise RuntimeError(f"\"logcumsumexp_out_cpu\" not implemented for '{x.dtype._tname}'")
    out = x.dtype if x.dtype.is_floating_point or op in ("cummax", "cummin") else int64
    return _op(op, [x], {"dim": _wrap_dim(dim, x.ndim) if x.ndim else 0}, _meta(x.shape, out, x.device))


_cummax_ret = namedtuple("cummax", "values indices")
_cummin_ret = namedtuple("cummin", "values indices")


def _cum_extreme(op, x, dim):
    """(values, indices) as PyTorch's cummax/cummin: the running max (NaN propagates), and the
    index of the last element that set it (ties and later NaNs take the later index). Element j
    sets it when it equals the running value there (or is NaN), so the indices are a second scan:
    the running max of j where it does, else 0."""
    d = _wrap_dim(dim, x.ndim) if x.ndim else 0
    v = to_dtype(_scan(op, to_dtype(x, uint8), d, None), bool_) if x.dtype is bool_ else _scan(op, x, d, None)
    n = x.shape[d] if x.ndim else 1
    j = reshape(arange(n, device=x.device), [n if k == d else 1 for k in range(x.ndim)])
    sets = _t.logical_or(_t.eq(x, v), _t.isnan(x)) if x.dtype.is_floating_point else _t.eq(x, v)
    return v, _scan("cummax", where(sets, j, 0), d, None)


def cummax(x, dim):
    return _cummax_ret(*_cum_extreme("cummax", x, dim))


def cummin(x, dim):
    return _cummin_ret(*_cum_extreme("cummin", x, dim))


def cumprod(x, dim, *, dtype=None):
    return _scan("cumprod", x, dim, dtype)


def logcumsumexp(x, dim):
    return _scan("logcumsumexp", x, dim, None)


# ---- Factories: *_like keep the input's device; dtype=/device= as in torch ----


def _like(x, fill, dtype, device):
    return full(x.shape, fill, dtype=dtype or x.dtype, device=device or x.device)


def zeros_like(x, *, dtype=None, device=None, **_):
    return _like(x, 0, dtype, device)


def ones_like(x, *, dtype=None, device=None, **_):
    return _like(x, 1, dtype, device)


def full_like(x, fill_value, *, dtype=None, device=None, **_):
    return _like(x, fill_value, dtype, device)


def empty_like(x, *, dtype=None, device=None, **_):
    return empty(x.shape, dtype=dtype or x.dtype, device=device or x.device)


def rand_like(x, *, dtype=None, device=None, **_):
    return rand(x.shape, dtype=dtype or x.dtype, device=device or x.device)


def randn_like(x, *, dtype=None, device=None, **_):
    return randn(x.shape, dtype=dtype or x.dtype, device=device or x.device)


def randint(low, high=None, size=None, *, dtype=None, device=None):
    if size is None and isinstance(high, (tuple, list)):     # randint(high, size)
        low, high, size = 0, low, high
    if size is None:
        raise TypeError("randint() missing required argument 'size'")
    if high is None:
        low, high = 0, low
    if high <= low:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")
    size, dtype = tuple(size), dtype or int64
    return _factory_op("randint", {"shape": size, "low": low, "high": high, "dtype": dtype}, size, dtype, device)


def philox_rand(shape, *, dtype=None, device=None):
    """Uniform [0, 1) from the Philox4x32-10 stream (dropout's): reproducible after manual_seed."""
    shape, dtype = tuple(shape), dtype or float32
    return _factory_op("philox_rand", {"shape": shape, "dtype": dtype}, shape, dtype, device)


def _factory_op(op, params, shape, dtype, device):
    from .tensor import _factory
    return _factory(op, params, shape, dtype, device)


def linspace(start, end, steps, *, dtype=None, device=None):
    """ATen's symmetric form: the first half steps up from start, the second down from end."""
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    dtype = dtype or float32
    if steps <= 1:
        return full((steps,), start, dtype=dtype, device=device)
    step = (end - start) / (steps - 1)
    i = arange(steps, device=device, dtype=float32 if dtype is not float64 else dtype)
    y = where(_t.lt(i, steps // 2), add(mul(i, step), start), sub(end, mul(sub(steps - 1, i), step)))
    return to_dtype(y, dtype)


def logspace(start, end, steps, base=10.0, *, dtype=None, device=None):
    dtype = dtype or float32
    return to_dtype(_t.pow(base, linspace(start, end, steps, dtype=float64 if dtype is float64 else
                                          float32, device=device)), dtype)


def type_as(x, other):
    return to_dtype(x, other.dtype)


def _new(fill):
    def method(self, *size, dtype=None, device=None, **_):
        shape = _t._shape_args(size)
        if fill is None:
            return empty(shape, dtype=dtype or self.dtype, device=device or self.device)
        return full(shape, fill, dtype=dtype or self.dtype, device=device or self.device)
    return method


def _new_full(self, size, fill_value, *, dtype=None, device=None, **_):
    return full(tuple(size), fill_value, dtype=dtype or self.dtype, device=device or self.device)


def _new_tensor(self, data, *, dtype=None, device=None, **_):
    return tensor(data, dtype=dtype or self.dtype, device=device or self.device)


# ---- Keyword aliases: axis= for dim=, keepdims= for keepdim= (NumPy spellings torch accepts) ----


def _aliased(f):
    @functools.wraps(f)
    def run(*args, axis=None, keepdims=None, **kwargs):
        if axis is not None:
            if "dim" in kwargs:
                raise TypeError(f"{f.__name__}() got both dim= and its alias axis=")
            kwargs["dim"] = axis
        if keepdims is not None:
            if "keepdim" in kwargs:
                raise TypeError(f"{f.__name__}() got both keepdim= and its alias keepdims=")
            kwargs["keepdim"] = keepdims
        return f(*args, **kwargs)
    return run


sum, mean, amax, amin, prod, var, std, logsumexp, argmax, argmin, max, min = (
    _aliased(f) for f in (_t.sum, _t.mean, _t.amax, _t.amin, _t.prod, _t.var, _t.std, _t.logsumexp,
                          _t.argmax, _t.argmin, _t.max, _t.min))
any, all, var_mean, std_mean = _aliased(any), _aliased(all), _aliased(var_mean), _aliased(std_mean)
cumsum, cumprod, logcumsumexp, cummax, cummin = (_aliased(f) for f in (_t.cumsum, cumprod, logcumsumexp, cummax, cummin))


# ---- Tensor methods and in-place forms ----

for _f in (sum, mean, amax, amin, prod, var, std, logsumexp, argmax, argmin, max, min, any, all, square,
           atan2, arctan2, fmod, round, lerp, addcmul, addcdiv, clamp_min, clamp_max, masked_fill, isclose,
           allclose, norm, var_mean, std_mean, count_nonzero, outer, ger, sort, argsort, topk, msort,
           cumsum, cumprod, logcumsumexp, cummax, cummin, type_as):
    setattr(Tensor, _f.__name__, _f)
Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty = _new(0), _new(1), _new(None)
Tensor.new_full, Tensor.new_tensor = _new_full, _new_tensor
Tensor.byte, Tensor.char, Tensor.short = (lambda self: to_dtype(self, uint8)), \
    (lambda self: to_dtype(self, int8)), (lambda self: to_dtype(self, int16))


def _inplace_method(name, f):
    def method(self, *args, **kwargs):
        return _inplace(self, f(self, *args, **kwargs), name)
    method.__name__ = name
    return method


# x.op_(...) writes op(x, ...) into x: every unary and binary op of the table, and the composites
_IN_PLACE = dict(_POINTWISE_FUNCTIONS, atan2=atan2, fmod=fmod, lerp=lerp, addcmul=addcmul,
                 addcdiv=addcdiv, clamp_min=clamp_min, clamp_max=clamp_max, masked_fill=masked_fill,
                 square=square, gelu=_t.gelu, silu=_t.silu, add=add, sub=sub, div=div, clamp=_t.clamp,
                 floor_divide=_t.floordiv, true_divide=div, multiply=mul, subtract=sub,
                 tril=tril, triu=triu, cumsum=cumsum, cumprod=cumprod)
for _name, _f in _IN_PLACE.items():
    if not hasattr(Tensor, _name + "_"):
        setattr(Tensor, _name + "_", _inplace_method(_name + "_", _f))


# ---- Ops Stax lacks: an AttributeError that names the spelling that works (issue 11 item 4) ----

SPELLINGS = {
    "hardtanh": "stax.clamp(x, min, max) (or stax.nn.functional.hardtanh)",
    "resize_": "x.reshape(...) (Stax tensors never resize their storage)",
    "as_strided": "permute, slice, reshape or expand views",
    "nan_to_num": "stax.where(stax.isnan(x), 0.0, x)",
    "logaddexp": "stax.logsumexp(stax.stack([a, b]), 0)",
    "hypot": "stax.sqrt(a * a + b * b)",
    "kthvalue": "stax.sort(x, dim).values.select(dim, k - 1)",
    "median": "stax.sort(x, dim).values.select(dim, (n - 1) // 2)",
    "bernoulli": "(stax.rand_like(p) < p)",
    "addmm": "beta * x + alpha * stax.matmul(a, b)",
    "baddbmm": "beta * x + alpha * stax.matmul(a, b)",
    "masked_select": "stax.where(mask, x, 0) keeps the shape (x[mask] has a data-dependent size)",
    "uint16": "stax.int32 (Stax's integer dtypes are int8, uint8, int16, int32 and int64)",
    "uint32": "stax.int64 (Stax's integer dtypes are int8, uint8, int16, int32 and int64)",
    "complex64": "pairs of real tensors (Stax has no complex dtypes)",
    "conv2d": "stax.nn.functional.conv2d (not built yet: it raises a clear error)",
}


def missing_op(owner: str, name: str) -> AttributeError:
    """The error for an op Stax lacks: its name and, where one exists, the spelling that works."""
    hint = SPELLINGS.get(name)
    msg = f"{owner} has no attribute '{name}'"
    if hint:
        msg += f"; Stax spells it {hint}"
    if not name.startswith("__"):
        msg += ". docs/OPS.md lists every op Stax has"
    return AttributeError(msg)


def _tensor_getattr(self, name):
    raise missing_op("'Tensor' object", name)


Tensor.__getattr__ = _tensor_getattr


# ---- §9.8 float8 matmul with scales (torch._scaled_mm) ----


def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm: (a @ b) · scale_a · scale_b for float8 `a` [m, k] (row-major) and `b`
    [k, n] (column-major: `w.t()` of a row-major [n, k] weight, as cuBLASLt and Hopper's fp8 tensor
    cores read it), with float32 scales: one each (tensor-wise) or scale_a [m, 1] and scale_b
    [1, n] (row-wise). The products are exact, the sums float32 (`use_fast_accum` changes
    nothing: Stax never accumulates in less); the result is rounded once to `out_dtype`."""
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.ndim == 2 and b.ndim == 2):
        raise RuntimeError("_scaled_mm: mat1 and mat2 must be matrices (2-D tensors)")
    if a.dtype not in FLOAT8 or b.dtype not in FLOAT8:
        raise RuntimeError(f"_scaled_mm: expected float8 matrices (stax.float8_e4m3fn, stax.float8_e5m2), "
                           f"got {a.dtype} and {b.dtype}: cast with .to(stax.float8_e4m3fn)")
    if a.dtype is float8_e5m2 and b.dtype is float8_e5m2:
        raise RuntimeError("_scaled_mm: multiplication of two Float8_e5m2 matrices is not supported")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise RuntimeError(f"_scaled_mm: mat1 and mat2 shapes cannot be multiplied ({m}x{k} and {k2}x{n})")
    if a.stride(1) != 1 and k != 1:
        raise RuntimeError(f"_scaled_mm: mat1 must be row-major (stride {a.stride()}); use a.contiguous()")
    if b.stride(0) != 1 and k != 1:
        raise RuntimeError(f"_scaled_mm: mat2 must be column-major, as in torch (stride {b.stride()}): pass "
                           "w.t() of a row-major [n, k] weight, or b.t().contiguous().t()")
    if out_dtype is None or out_dtype not in (float32, bfloat16, float16):
        raise RuntimeError(f"_scaled_mm: out_dtype={out_dtype} is not supported here: pass out_dtype= "
                           "stax.float32, stax.bfloat16 or stax.float16 (a float8 result: cast it after)")
    if bias is not None or scale_result is not None:
        raise RuntimeError("_scaled_mm: bias= and scale_result= are not supported: add the bias to "
                           "the result (it fuses into the same kernel on the GPU)")
    for name, s, want in (("scale_a", scale_a, (m, 1)), ("scale_b", scale_b, (1, n))):
        if not isinstance(s, Tensor) or s.dtype is not float32:
            raise RuntimeError(f"_scaled_mm: {name} must be a float32 tensor")
        if s.numel() != 1 and tuple(s.shape) != want:
            raise RuntimeError(f"_scaled_mm: {name} must have one element (tensor-wise) or shape "
                               f"{list(want)} (row-wise), not {list(s.shape)}")
    if (scale_a.numel() == 1) != (scale_b.numel() == 1):
        raise RuntimeError("_scaled_mm: scale_a and scale_b must both be tensor-wise or both row-wise")
    return _op("scaled_mm", [a, b, scale_a, scale_b], {}, _meta((m, n), out_dtype, _t._device(a, b)))
