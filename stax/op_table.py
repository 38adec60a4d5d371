"""The op table: every primitive op of Stax, declared once.

Layer: the bottom of the stack, next to dtypes.py (it imports only numpy, math, dtypes.py and conv_numpy.py).
Every other layer reads it: tensor.py (which ops are views or factories, the eager numpy
implementation the choke point runs), tensor_ops.py (each pointwise op's dtype rule), lower.py
(§6: which ops lower as pointwise math, which as views, which stay fallback kernels), and the
printers of §8/§9 (the C++ and Triton spelling of the generic pointwise ops).

An entry is an `OpDef`; `OPS` maps the op's name (the name a captured graph node carries) to it.
Nothing here is computed from anything else: read it top to bottom.

Where to look:
  - the fields .............................. OpDef
  - unary / binary pointwise math ............ "neg" ... "bitwise_xor"
  - the other ops ............................ where, to_dtype, clone, views, reductions, factories,
                                               scans, fallbacks (matmul, conv2d, sort, nonzero, unique),
                                               index / index_put (gathers and scatters), scatters
  - Philox4x32-10 (dropout's counter-based stream) ... philox_uniform, _philox_rand
  - the eager random state ................... manual_seed (tensor.py re-exports it)

How a printer spells an op: for a generic unary op, `cpp`/`triton` is a function name, printed
`fn(x)`; for a generic binary op it is an infix operator, printed `(a op b)`; the result dtype is
bool when `dtype == "bool"`, else the operand's. `None` means the printer has its own method for the
op (pow, relu, sign, maximum, ...). A binary spelling that is a name (`std::atan2`,
`libdevice.fmod`) is printed as a call, `fn(a, b)`. The ops handler calls an op by
`OpDef.handler` (div is `ops.truediv`, as in Inductor), so a printer looks an op up in `BY_HANDLER`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .attention_grad import attn_bwd_numpy
from .attention_kernels import attn_lse_numpy, sdpa_numpy
from .conv_numpy import conv2d_numpy
from .dtypes import float64

# ---- The record ----


@dataclass(frozen=True)
class OpDef:
    """One primitive op.

    kind:   "unary" | "binary" (pointwise math with a dtype rule), "pointwise" (where, to_dtype,
            clone: elementwise with their own lowering), "view", "reduction", "scan" (cumsum,
            cumprod, logcumsumexp, cummax, cummin), "factory", "other" (matmul, cat, nonzero, unique), "scatter" (graph-only: capture's
            functionalized writes through views; no eager implementation)
    arity:  number of inputs (cat's one input is a list of tensors; -1: any number)
    dtype:  unary/binary output dtype rule: "same" keeps the promoted dtype, "float" turns int/bool
            into float32 (and lowering computes the op in float), "bool" gives bool
    eager:  the numpy implementation `tensor._dispatch` runs (inputs in compute form, params as kwargs)
    cast_inputs: eager casts every tensor input to one compute dtype first (tensor._run_eager)
    fallback:    lowering leaves the op to its eager implementation, as an ExternKernel (§6.1)
    cpp, triton: the generic spelling in each printer (see the module docstring), or None
    handler:     the `ops.<name>` the IR calls; "" means the op's own name
    """
    name: str
    kind: str
    arity: int
    eager: Callable | None
    dtype: str | None = None
    cast_inputs: bool = False
    fallback: bool = False
    cpp: str | None = None
    triton: str | None = None
    handler: str = ""

    @property
    def float_only(self) -> bool:
        """Computed in floating point even for int/bool inputs (lower.py's promotion to float32)."""
        return self.dtype == "float"

    @property
    def ops_name(self) -> str:
        return self.handler or self.name


def _unary(name, eager, dtype, cpp=None, triton=None):
    return OpDef(name, "unary", 1, eager, dtype, cast_inputs=True, cpp=cpp, triton=triton)


def _binary(name, eager, dtype, cpp=None, triton=None, handler=""):
    return OpDef(name, "binary", 2, eager, dtype, cast_inputs=True, cpp=cpp, triton=triton,
                 handler=handler)


# ---- Eager helpers (numpy has no erf; ints keep their values under floor/ceil/...) ----


def _erf(x):
    # math.erf is exact to double precision (slow, but this is the eager reference)
    # (asarray: on a 0-d array, frompyfunc returns a Python float)
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x.astype(np.float64)), np.float64).astype(x.dtype)


def _keep_int(f):
    return lambda x: x.copy() if x.dtype.kind in "iub" else f(x)


def _int_div_check(f):
    def run(a, b):
        if b.dtype.kind in "iub" and not np.all(b):
            raise RuntimeError("ZeroDivisionError")
        return f(a, b)
    return run


def _reduce(f):
    return lambda x, dims, keepdim: f(x, axis=dims, keepdims=keepdim)


def _arg_reduce(f):
    def run(x, dims, keepdim):
        kept = [d for d in range(x.ndim) if d not in dims]
        # (the row length spelled out: -1 is ambiguous when a kept dim is 0)
        y = x.transpose(kept + list(dims)).reshape([x.shape[d] for d in kept] + [math.prod(x.shape[d] for d in dims)])
        r = f(y, axis=-1).astype(np.int64)
        return r.reshape([1 if d in dims else x.shape[d] for d in range(x.ndim)]) if keepdim else r
    return run


def _arange(start, end, step, dtype):
    n = len(range(0, math.ceil((end - start) / step)))
    return (start + np.arange(n) * step).astype(dtype.compute)


def _wrapped_indices(indices, shape, dims, op):
    """Index arrays broadcast together, negatives wrapped, each checked against its dim's size:
    eager's IndexError names the op, the index as written and the size (as the kernels' do)."""
    out = []
    for i, d in zip(np.broadcast_arrays(*indices), dims):
        n = shape[d]
        w = (i if op in TARGET_INDEX_OPS else np.where(i < 0, i + n, i)).astype(np.int64)
        bad = (w < 0) | (w >= n)
        if bad.any():
            raw = int(i.reshape(-1)[np.argmax(bad.reshape(-1))])
            raise IndexError(index_message(op, d).format(raw, n))
        out.append(w)
    return out


# index ops whose indices are class targets (nll_loss / cross_entropy's pick): a negative target is
# out of range, not wrapped, and the message is PyTorch's for a target
TARGET_INDEX_OPS = frozenset({"nll_loss"})


def index_message(op, dim) -> str:
    """The IndexError text of an out-of-range index (eager, the C++ wrapper), `{}`s: index, size."""
    if op in TARGET_INDEX_OPS:
        return "Target {} is out of bounds."
    return f"{op}(): index {{}} is out of bounds for dimension {dim} with size {{}}"


def _index(x, *indices, dims, pos, op):
    """out = x[indices at dims]: the broadcast index shape B sits at output position `pos`
    among x's other dims (PyTorch's placement: where the indexed dims were if they are adjacent,
    else first)."""
    rest = [d for d in range(x.ndim) if d not in dims]
    idx = _wrapped_indices(indices, x.shape, dims, op)
    r = x.transpose(list(dims) + rest)[tuple(idx)]
    nb = idx[0].ndim
    return np.moveaxis(r, list(range(nb)), list(range(pos, pos + nb)))


def _index_put(x, values, *indices, dims, pos, accumulate, op):
    """A copy of x with x[indices at dims] = values (+= with `accumulate`, in index order).
    `values` has the shape of x[indices]. A position written twice without `accumulate` keeps
    the last value in row-major order of the index shape (as PyTorch's CPU kernels do)."""
    rest = [d for d in range(x.ndim) if d not in dims]
    idx = _wrapped_indices(indices, x.shape, dims, op)
    nb = idx[0].ndim
    xt = np.array(x.transpose(list(dims) + rest), order="C")      # a copy: never write into x
    v = np.moveaxis(values, list(range(pos, pos + nb)), list(range(nb)))
    lin = np.ravel_multi_index(idx, [x.shape[d] for d in dims]).reshape(-1) if idx[0].size else \
        np.zeros(0, np.int64)
    flat = xt.reshape((-1,) + xt.shape[len(dims):])
    v = np.broadcast_to(v, idx[0].shape + xt.shape[len(dims):]).reshape((lin.size,) + xt.shape[len(dims):])
    if accumulate:
        np.add.at(flat, lin, v.astype(flat.dtype))
    else:
        _, first_of_reversed = np.unique(lin[::-1], return_index=True)
        keep = lin.size - 1 - first_of_reversed
        flat[lin[keep]] = v[keep]
    return xt.transpose(np.argsort(list(dims) + rest))


_rng = np.random.default_rng()


def manual_seed(seed):
    """Seed the eager random ops (rand, randn, randint) and the Philox stream of dropout."""
    global _rng
    _rng = np.random.default_rng(seed)
    _PHILOX.update(seed=int(seed) & 0xFFFFFFFFFFFFFFFF, offset=0)


def _rand(shape, dtype):
    return _rng.random(shape, dtype=np.float64 if dtype is float64 else np.float32)


def _randn(shape, dtype):
    return _rng.standard_normal(shape, dtype=np.float64 if dtype is float64 else np.float32)


def _randint(shape, low, high, dtype):
    return _rng.integers(low, high, size=shape).astype(dtype.compute)


# ---- Philox4x32-10: a counter-based generator (Salmon et al., 2011), as CUDA's curand and
# PyTorch's dropout use. Element i of a draw is a pure function of (seed, offset + i); each draw
# advances the stream's offset by its size at run time, so eager and compiled code consume the
# same stream in the same order and `manual_seed` replays it.

_PHILOX = {"seed": 67280421310721, "offset": 0}
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85


def _mulhilo(a, b):
    p = a.astype(np.uint64) * np.uint64(b)
    return (p >> np.uint64(32)).astype(np.uint32), (p & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def philox_uniform(seed: int, counter: np.ndarray) -> np.ndarray:
    """Uniform float64 in [0, 1) for each 64-bit counter: the first 32-bit word of Philox4x32-10."""
    c = counter.astype(np.uint64)
    x = [(c & np.uint64(0xFFFFFFFF)).astype(np.uint32), (c >> np.uint64(32)).astype(np.uint32),
         np.zeros_like(c, np.uint32), np.zeros_like(c, np.uint32)]
    k0, k1 = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for _ in range(10):
            hi0, lo0 = _mulhilo(x[0], _M0)
            hi1, lo1 = _mulhilo(x[2], _M1)
            x = [hi1 ^ x[1] ^ k0, lo1, hi0 ^ x[3] ^ k1, lo0]
            k0, k1 = np.uint32((int(k0) + _W0) & 0xFFFFFFFF), np.uint32((int(k1) + _W1) & 0xFFFFFFFF)
    return x[0].astype(np.float64) * (1.0 / 4294967296.0)


def _philox_rand(shape, dtype):
    n = math.prod(shape)
    start = _PHILOX["offset"]
    _PHILOX["offset"] = start + n
    u = philox_uniform(_PHILOX["seed"], np.arange(start, start + n, dtype=np.uint64))
    return u.reshape(shape).astype(dtype.compute)


def _stable_order(x, dim, descending):
    """Indices that sort x along dim, ties in input order; NaN is the largest value (as PyTorch)."""
    if not descending:
        return np.argsort(x, axis=dim, kind="stable")
    n = x.shape[dim]
    flipped = np.argsort(np.flip(x, dim), axis=dim, kind="stable")
    return np.flip(n - 1 - flipped, dim)


def _sort(x, dim, descending):
    if x.ndim == 0:
        return x.copy()
    return np.take_along_axis(x, _stable_order(x, dim, descending), dim)


def _argsort(x, dim, descending):
    if x.ndim == 0:
        return np.zeros((), np.int64)
    return _stable_order(x, dim, descending).astype(np.int64)


def _logcumsumexp(x, dim):
    if x.ndim == 0:
        return x.copy()
    return np.logaddexp.accumulate(x, axis=dim)


def _repeat_index(repeats):
    """repeat_interleave's index: each position k of `repeats` (1-D ints) repeats[k] times."""
    if repeats.size and repeats.min() < 0:
        raise RuntimeError("repeats can not be negative")
    return np.repeat(np.arange(repeats.shape[0], dtype=np.int64), repeats)


def _fmod(a, b):
    return np.fmod(a, b)


# ---- The table ----

OPS = {d.name: d for d in [
    # unary pointwise math
    _unary("neg", np.negative, "same"),
    _unary("abs", np.abs, "same", cpp="stax_abs", triton="tl.abs"),
    _unary("exp", np.exp, "float", cpp="stax_exp", triton="libdevice.exp"),
    _unary("exp2", np.exp2, "float", cpp="stax_exp2", triton="libdevice.exp2"),
    _unary("log", np.log, "float", cpp="stax_log", triton="libdevice.log"),
    _unary("log2", np.log2, "float", cpp="stax_log2", triton="libdevice.log2"),
    _unary("sqrt", np.sqrt, "float", cpp="sqrt", triton="libdevice.sqrt"),
    _unary("rsqrt", lambda x: 1 / np.sqrt(x), "float", cpp="stax_rsqrt", triton="libdevice.rsqrt"),
    _unary("sin", np.sin, "float", cpp="stax_sin", triton="libdevice.sin"),
    _unary("cos", np.cos, "float", cpp="stax_cos", triton="libdevice.cos"),
    _unary("tanh", np.tanh, "float", cpp="stax_tanh", triton="libdevice.tanh"),
    _unary("sigmoid", lambda x: 1 / (1 + np.exp(-x)), "float", cpp="stax_sigmoid", triton="tl.sigmoid"),
    _unary("erf", _erf, "float", cpp="stax_erf", triton="libdevice.erf"),
    _unary("log1p", np.log1p, "float", cpp="log1p", triton="libdevice.log1p"),
    _unary("expm1", np.expm1, "float", cpp="expm1", triton="libdevice.expm1"),
    # relu keeps NaN, unlike maximum(x, 0) on ints
    _unary("relu", lambda x: np.where(x < 0, 0, x), "same", cpp="stax_relu"),
    _unary("floor", _keep_int(np.floor), "same", cpp="floor", triton="libdevice.floor"),
    _unary("ceil", _keep_int(np.ceil), "same", cpp="ceil", triton="libdevice.ceil"),
    _unary("round", _keep_int(np.round), "same", cpp="rint", triton="libdevice.nearbyint"),
    _unary("trunc", _keep_int(np.trunc), "same", cpp="trunc", triton="libdevice.trunc"),
    _unary("sign", lambda x: np.sign(np.nan_to_num(x, nan=0, posinf=1, neginf=-1)), "same",
           triton="triton_helpers.sign"),
    _unary("reciprocal", lambda x: 1 / x, "float"),
    _unary("isnan", np.isnan, "bool"),
    _unary("isinf", np.isinf, "bool"),
    _unary("logical_not", np.logical_not, "bool"),
    _unary("bitwise_not", np.invert, "same"),
    # binary pointwise math
    _binary("add", np.add, "same", cpp="+", triton="+"),
    _binary("sub", np.subtract, "same", cpp="-", triton="-"),
    _binary("mul", np.multiply, "same", cpp="*", triton="*"),
    _binary("div", np.true_divide, "float", cpp="/", triton="/", handler="truediv"),
    _binary("floordiv", _int_div_check(np.floor_divide), "same"),
    _binary("remainder", _int_div_check(np.remainder), "same"),
    _binary("pow", np.power, "same"),
    _binary("atan2", np.arctan2, "float", cpp="std::atan2", triton="libdevice.atan2"),
    _binary("fmod", _fmod, "same", cpp="std::fmod", triton="libdevice.fmod"),
    _binary("maximum", np.maximum, "same"),
    _binary("minimum", np.minimum, "same"),
    _binary("eq", np.equal, "bool", cpp="==", triton="=="),
    _binary("ne", np.not_equal, "bool", cpp="!=", triton="!="),
    _binary("lt", np.less, "bool", cpp="<", triton="<"),
    _binary("le", np.less_equal, "bool", cpp="<=", triton="<="),
    _binary("gt", np.greater, "bool", cpp=">", triton=">"),
    _binary("ge", np.greater_equal, "bool", cpp=">=", triton=">="),
    _binary("logical_and", np.logical_and, "bool", cpp="&&", triton="&"),
    _binary("logical_or", np.logical_or, "bool", cpp="||", triton="|"),
    _binary("logical_xor", np.logical_xor, "bool", cpp="!=", triton="^"),
    _binary("bitwise_and", np.bitwise_and, "same", cpp="&", triton="&"),
    _binary("bitwise_or", np.bitwise_or, "same", cpp="|", triton="|"),
    _binary("bitwise_xor", np.bitwise_xor, "same", cpp="^", triton="^"),
    # other elementwise ops
    OpDef("where", "pointwise", 3, lambda c, a, b: np.where(c.astype(bool), a, b), cast_inputs=True),
    OpDef("to_dtype", "pointwise", 1, lambda x, dtype: x),   # the result wrapper rounds to the new dtype
    OpDef("clone", "pointwise", 1, lambda x: x),             # the wrapper copies into fresh storage
    # a copy read backwards along `dims` (torch.flip copies; negative strides are no view here)
    OpDef("flip", "pointwise", 1, lambda x, dims: np.flip(x, dims).copy()),
    # views: eager shares the input's storage (no implementation to run)
    OpDef("permute", "view", 1, None),
    OpDef("expand", "view", 1, None),
    OpDef("slice", "view", 1, None),
    OpDef("select", "view", 1, None),
    OpDef("reshape", "view", 1, None),
    # reductions
    OpDef("sum", "reduction", 1, _reduce(np.sum), cast_inputs=True),
    OpDef("prod", "reduction", 1, _reduce(np.prod), cast_inputs=True),
    OpDef("amax", "reduction", 1, _reduce(np.max), cast_inputs=True),
    OpDef("amin", "reduction", 1, _reduce(np.min), cast_inputs=True),
    OpDef("argmax", "reduction", 1, _arg_reduce(np.argmax)),
    OpDef("argmin", "reduction", 1, _arg_reduce(np.argmin)),
    # factories (no tensor inputs)
    OpDef("full", "factory", 0, lambda shape, value, dtype: np.full(shape, value, dtype.compute)),
    OpDef("arange", "factory", 0, _arange),
    OpDef("rand", "factory", 0, _rand, fallback=True),
    OpDef("randn", "factory", 0, _randn, fallback=True),
    OpDef("randint", "factory", 0, _randint, fallback=True),
    OpDef("philox_rand", "factory", 0, _philox_rand, fallback=True),
    # the rest: cat is lowered (masked loads); the others are fallback kernels (§6.1),
    # nonzero and unique because their output sizes depend on the data
    # scans (§6, ir.Scan): lowered as a loop along the dim (C++) or tl.associative_scan (Triton)
    OpDef("cumsum", "scan", 1, lambda x, dim: np.cumsum(x, axis=dim) if x.ndim else x.copy(),
          cast_inputs=True),
    OpDef("cumprod", "scan", 1, lambda x, dim: np.cumprod(x, axis=dim) if x.ndim else x.copy(),
          cast_inputs=True),
    OpDef("logcumsumexp", "scan", 1, _logcumsumexp, cast_inputs=True),
    # the running max / min (NaN propagates); math_ops.cummax adds the indices (a second scan)
    OpDef("cummax", "scan", 1, lambda x, dim: np.maximum.accumulate(x, axis=dim) if x.ndim else x.copy()),
    OpDef("cummin", "scan", 1, lambda x, dim: np.minimum.accumulate(x, axis=dim) if x.ndim else x.copy()),
    OpDef("sort", "other", 1, _sort, fallback=True),
    OpDef("argsort", "other", 1, _argsort, fallback=True),
    OpDef("matmul", "other", 2, np.matmul, cast_inputs=True, fallback=True),
    # §9.8 torch._scaled_mm: float8 a [m, k] @ b [k, n] (exact products, float32 sums) times the
    # float32 scales (one each, or a's per row and b's per column); on the GPU a Triton template
    OpDef("scaled_mm", "other", 4, lambda a, b, sa, sb: np.matmul(a, b) * sa * sb, fallback=True),
    # inputs [x, weight] or [x, weight, bias]; on the GPU conv_template.py prints it as a template
    OpDef("conv2d", "other", 3, conv2d_numpy, cast_inputs=True, fallback=True),
    OpDef("cat", "other", 1, lambda xs, dim: np.concatenate(xs, axis=dim), cast_inputs=True),
    OpDef("nonzero", "other", 1, lambda x: np.argwhere(x).astype(np.int64), fallback=True),
    OpDef("unique", "other", 1, lambda x: np.unique(x.reshape(-1)), fallback=True),
    # indirect indexing (stax/indexing.py builds every gather and scatter from these two):
    # inputs x, [values,] then one integer index tensor per indexed dim, broadcast together
    OpDef("index", "other", -1, _index),
    OpDef("index_put", "other", -1, _index_put),
    # §9.10 scaled dot-product attention: q, k, v [, attn_mask]; a flash template on the GPU
    OpDef("sdpa", "other", 3, sdpa_numpy, fallback=True),
    OpDef("repeat_index", "other", 1, _repeat_index, fallback=True),     # repeat_interleave's index
    # §9.10 omni_attention under stax.compile: q, k, v [, a block mask's four int32 arrays]; its
    # score_mod / mask_mod traced into params (attention_kernels.ModText). Always a template (C++ or
    # Triton), never run here: attention.py records it only for inputs a template runs
    OpDef("omni_attn", "other", -1, None, fallback=True),
    # §5 / §9.10 training (attention.py records these only for inputs that require grad): the LSE
    # of an sdpa / omni_attn of the same inputs, which that node then takes as its last input
    # (params with_lse; its value does not depend on it) and the GPU template writes in the same
    # launch; and the backward, attn_bwd(dO, q, k, v, o, LSE [, attn_mask]) -> [dQ | dK | dV] flat
    OpDef("attn_lse", "other", -1, attn_lse_numpy, fallback=True),
    OpDef("omni_lse", "other", -1, None, fallback=True),
    OpDef("attn_bwd", "other", -1, attn_bwd_numpy, fallback=True),
    OpDef("bincount", "other", 1, lambda x, minlength: np.bincount(x, minlength=minlength).astype(np.int64),
          fallback=True),
    OpDef("masked_select", "other", 2, lambda x, m: np.broadcast_arrays(x, m)[0][np.broadcast_arrays(x, m)[1]],
          fallback=True),
    # graph-only: capture.py's functional form of a write through a slice / select view
    OpDef("slice_scatter", "scatter", 2, None),
    OpDef("select_scatter", "scatter", 2, None),
]}

# ---- §5 Derivatives: one formula per differentiable op ----
#
# DERIVATIVES[op](F, g, inputs, out, params) -> one gradient per input (None: not differentiable).
# `g` is the gradient of the op's output, `F` the tensor functions autograd.py passes in (so
# this table stays at the bottom of the stack): where, exp, sin, cos, sign, sum_to (reduce a
# broadcast gradient to an input's shape), unreduce (broadcast a reduction's gradient back),
# cumsum, flip, index, index_put, zeros_like, matmul_grads, slice_grad, select_grad, cat_grads, to_dtype,
# attention_grads. An op absent from the
# table has no gradient: one with integer or bool results (comparisons, argmax) needs none; a float
# one (cumprod, sort, ...) makes backward raise when a gradient reaches it, never drop the path.

_LN2 = math.log(2.0)
_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_grad(F, g, ins, out, p):
    """GELU'(x) = Phi(x) + x phi(x) (§5.5), written in Listing 9.3's order: g * (cdf + x * pdf)."""
    (x,) = ins
    cdf = F.mul(0.5, F.add(1.0, F.erf(x * _SQRT1_2)))
    pdf = F.mul(_INV_SQRT_2PI, F.exp(F.mul(-0.5, x * x)))
    return (g * (cdf + x * pdf),)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _pow_grads(F, g, ins, out, p):
    a, b = ins
    ga = g * b * F.pow(a, b - 1) if not F.is_tensor(b) else F.sum_to(g * b * F.pow(a, b - 1), a.shape)
    gb = F.sum_to(g * out * F.log(F.where(a > 0, a, 1.0)) * (a > 0), b.shape) if F.is_tensor(b) else None
    return (F.sum_to(ga, a.shape) if F.is_tensor(a) else None), gb


def _max_min_grads(F, g, ins, out, p, wins):
    a, b = ins                                  # ties share the gradient (as PyTorch does)
    half = F.where(a == b, g * 0.5, g)
    return (F.sum_to(F.where(wins(b, a), 0.0, half), a.shape) if F.is_tensor(a) else None,
            F.sum_to(F.where(wins(a, b), 0.0, half), b.shape) if F.is_tensor(b) else None)


def _prod_grad(F, g, ins, out, p):
    (x,) = ins
    zero = x == 0
    nz = F.unreduce(F.sum(zero, p["dims"], True), x, p["dims"], True)
    others = F.unreduce(F.prod(F.where(zero, 1.0, x), p["dims"], True), x, p["dims"], True)
    outx = F.unreduce(out, x, p["dims"], p["keepdim"])
    grad = F.where(zero, F.where(nz == 1, others, 0.0), outx / F.where(zero, 1.0, x))
    return (F.unreduce(g, x, p["dims"], p["keepdim"]) * grad,)


def _extreme_grad(F, g, ins, out, p):
    (x,) = ins                                  # ties share the gradient evenly
    hit = x == F.unreduce(out, x, p["dims"], p["keepdim"])
    count = F.unreduce(F.sum(hit, p["dims"], True), x, p["dims"], True)
    return (F.where(hit, F.unreduce(g, x, p["dims"], p["keepdim"]) / count, 0.0),)


def _unary_grad(f):
    return lambda F, g, ins, out, p: (f(F, g, ins[0], out),)


def _binary_grad(fa, fb):
    def grads(F, g, ins, out, p):
        a, b = ins
        return (F.sum_to(fa(F, g, a, b, out), a.shape) if F.is_tensor(a) else None,
                F.sum_to(fb(F, g, a, b, out), b.shape) if F.is_tensor(b) else None)
    return grads


DERIVATIVES = {
    "neg": _unary_grad(lambda F, g, x, y: -g),
    "abs": _unary_grad(lambda F, g, x, y: g * F.sign(x)),
    "exp": _unary_grad(lambda F, g, x, y: g * y),
    "exp2": _unary_grad(lambda F, g, x, y: g * y * _LN2),
    "log": _unary_grad(lambda F, g, x, y: g / x),
    "log2": _unary_grad(lambda F, g, x, y: g / (x * _LN2)),
    "sqrt": _unary_grad(lambda F, g, x, y: g / (2 * y)),
    "rsqrt": _unary_grad(lambda F, g, x, y: -0.5 * g * y * y * y),
    "sin": _unary_grad(lambda F, g, x, y: g * F.cos(x)),
    "cos": _unary_grad(lambda F, g, x, y: -g * F.sin(x)),
    "tanh": _unary_grad(lambda F, g, x, y: g * (1 - y * y)),
    "sigmoid": _unary_grad(lambda F, g, x, y: g * y * (1 - y)),
    "erf": _unary_grad(lambda F, g, x, y: g * _TWO_OVER_SQRT_PI * F.exp(-(x * x))),
    "gelu": _gelu_grad,         # a composite (tensor_ops.gelu) that autograd sees as one node
    "log1p": _unary_grad(lambda F, g, x, y: g / (1 + x)),
    "expm1": _unary_grad(lambda F, g, x, y: g * (y + 1)),
    "relu": _unary_grad(lambda F, g, x, y: F.where(y > 0, g, 0.0)),
    "reciprocal": _unary_grad(lambda F, g, x, y: -g * y * y),
    "floor": _unary_grad(lambda F, g, x, y: g * 0), "ceil": _unary_grad(lambda F, g, x, y: g * 0),
    "round": _unary_grad(lambda F, g, x, y: g * 0), "trunc": _unary_grad(lambda F, g, x, y: g * 0),
    "sign": _unary_grad(lambda F, g, x, y: g * 0),
    "add": _binary_grad(lambda F, g, a, b, y: g, lambda F, g, a, b, y: g),
    "sub": _binary_grad(lambda F, g, a, b, y: g, lambda F, g, a, b, y: -g),
    "mul": _binary_grad(lambda F, g, a, b, y: g * b, lambda F, g, a, b, y: g * a),
    "div": _binary_grad(lambda F, g, a, b, y: g / b, lambda F, g, a, b, y: -g * a / (b * b)),
    "remainder": _binary_grad(lambda F, g, a, b, y: g,
                              lambda F, g, a, b, y: -g * F.floor((a - y) / b)),
    "atan2": _binary_grad(lambda F, g, a, b, y: g * b / (a * a + b * b),
                          lambda F, g, a, b, y: -g * a / (a * a + b * b)),
    "fmod": _binary_grad(lambda F, g, a, b, y: g, lambda F, g, a, b, y: -g * F.trunc(a / b)),
    "pow": _pow_grads,
    "maximum": lambda F, g, ins, out, p: _max_min_grads(F, g, ins, out, p, lambda a, b: a > b),
    "minimum": lambda F, g, ins, out, p: _max_min_grads(F, g, ins, out, p, lambda a, b: a < b),
    "where": lambda F, g, ins, out, p: (None, F.sum_to(F.where(ins[0], g, 0.0), ins[1].shape)
                                        if F.is_tensor(ins[1]) else None,
                                        F.sum_to(F.where(ins[0], 0.0, g), ins[2].shape)
                                        if F.is_tensor(ins[2]) else None),
    "to_dtype": lambda F, g, ins, out, p: (F.to_dtype(g, ins[0].dtype),),
    "clone": lambda F, g, ins, out, p: (g,),
    "flip": lambda F, g, ins, out, p: (F.flip(g, p["dims"]),),
    "permute": lambda F, g, ins, out, p: (F.permute(g, [p["dims"].index(i) for i in range(len(p["dims"]))]),),
    "expand": lambda F, g, ins, out, p: (F.sum_to(g, ins[0].shape),),
    "reshape": lambda F, g, ins, out, p: (F.reshape(g, ins[0].shape),),
    "slice": lambda F, g, ins, out, p: (F.slice_grad(g, ins[0], p),),
    "select": lambda F, g, ins, out, p: (F.select_grad(g, ins[0], p),),
    "sum": lambda F, g, ins, out, p: (F.unreduce(g, ins[0], p["dims"], p["keepdim"]),),
    "prod": _prod_grad,
    "amax": _extreme_grad,
    "amin": _extreme_grad,
    "cumsum": lambda F, g, ins, out, p: (F.sum(g, (p["dim"],), True) - F.cumsum(g, p["dim"]) + g
                                         if ins[0].ndim else g,),
    "matmul": lambda F, g, ins, out, p: F.matmul_grads(g, ins[0], ins[1]),
    # a gather's gradient adds into the gathered positions; a scatter's goes to what was written
    "index": lambda F, g, ins, out, p: (F.pick_grad(g, ins[0], ins[2]) if p["op"] == "nll_loss" else
                                        F.index_put(F.zeros_like(ins[0], g.dtype), g, ins[1:], p, True),)
                                       + (None,) * (len(ins) - 1),
    "index_put": lambda F, g, ins, out, p: (
        g if p["accumulate"] else F.index_put(g, F.zeros_like(ins[1], g.dtype), ins[2:], p, False),
        F.index(g, ins[2:], p)) + (None,) * (len(ins) - 2),
    # cat's one input is a list of tensors: one gradient per tensor of the list
    "cat": lambda F, g, ins, out, p: F.cat_grads(g, ins[0], p["dim"]),
    # §9.10: dQ, dK, dV by the backward template from the saved LSE (the node's last input), P
    # recomputed; None for the mask, the block mask's arrays and the LSE itself (attention.py)
    "sdpa": lambda F, g, ins, out, p: F.attention_grads(g, ins, out, p, "sdpa"),
    "omni_attn": lambda F, g, ins, out, p: F.attention_grads(g, ins, out, p, "omni_attn"),
}

# the ops handler's name -> OpDef (for printers: `ops.truediv` is div)
BY_HANDLER = {d.ops_name: d for d in OPS.values()}


def names(kind: str) -> list:
    """The ops of one kind, in table order."""
    return [name for name, d in OPS.items() if d.kind == kind]
