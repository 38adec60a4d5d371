"""The compiled path on the CPU, end to end: `stax.compile(fn)(...)` against float64 numpy
references on fresh random inputs (docs/DESIGN.md tolerances), for every op and the chapter's examples,
odd sizes, non-contiguous and broadcast inputs, NaN/inf, int and half dtypes, scalars and
constants, output structures; then specialization and guards, and the errors eager raises.

Compilation costs ~0.3 s per compiled function, so each test batches many checks into one
compiled function (one C++ file) with small shapes.
"""
import math
import warnings

import numpy as np
import pytest

import stax
from conftest import assert_close

erf = np.vectorize(math.erf, otypes=[np.float64])


# ---- helpers ----


def rand(rng, *shape, dtype=stax.float32, lo=-2.0, hi=2.0):
    """Fresh random values (never zeros: uniform draws), stored as `dtype`."""
    return stax.tensor(rng.uniform(lo, hi, shape)).to(dtype)


def nonzero_rand(rng, *shape, dtype=stax.float32):
    """Values with |v| in [0.5, 2): safe denominators."""
    a = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return stax.tensor(a).to(dtype)


def f64(x):
    """float64 numpy copy of a tensor's (compute-form) values; bools stay bool."""
    a = np.asarray(x)
    return a if a.dtype == np.bool_ else a.astype(np.float64)


def check(actual, expected, dtype=None, msg=""):
    """`actual` (a stax Tensor) matches the numpy reference within its dtype's tolerance.

    `dtype` (default: actual's) is also asserted to be actual's dtype."""
    assert isinstance(actual, stax.Tensor), f"{msg}: expected a Tensor, got {type(actual).__name__}"
    want_dtype = dtype or actual.dtype
    assert actual.dtype is want_dtype, f"{msg}: dtype {actual.dtype} != {want_dtype}"
    assert_close(np.asarray(actual), np.asarray(expected), want_dtype.name, msg=msg)


def check_all(got: dict, want: dict, dtypes: dict | None = None):
    assert set(got) == set(want)
    for k in want:
        check(got[k], want[k], (dtypes or {}).get(k), msg=k)


_DYNAMIC = [False]     # set by the `dynamic` fixture: the tests taking it run static and dynamic (§10)


@pytest.fixture(params=[False, True], ids=["static", "dynamic"])
def dynamic(request):
    _DYNAMIC[0] = request.param
    yield request.param
    _DYNAMIC[0] = False


def run(fn, *args, **kwargs):
    """Compile `fn`, call it once, and return (result, CompiledFunction)."""
    cf = stax.compile(fn, dynamic=_DYNAMIC[0])
    out = cf(*args, **kwargs)
    assert cf.stats["compiles"] == 1 and cf.stats["eager_calls"] == 0, cf.stats
    return out, cf


# ---- every op ----

UNARY = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "exp2": np.exp2, "sin": np.sin, "cos": np.cos,
    "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "erf": erf,
    "relu": lambda x: np.maximum(x, 0), "floor": np.floor, "ceil": np.ceil, "round": np.round,
    "trunc": np.trunc, "sign": np.sign, "expm1": np.expm1,
}
POSITIVE_UNARY = {"log": np.log, "log1p": np.log1p, "log2": np.log2, "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
                  "reciprocal": lambda x: 1 / x}


def test_unary_ops(rng):
    x, p = rand(rng, 6, 35, lo=-3, hi=3), rand(rng, 6, 35, lo=0.1, hi=3)

    def f(x, p):
        out = {n: getattr(stax, n)(x) for n in UNARY}
        out.update({n: getattr(stax, n)(p) for n in POSITIVE_UNARY})
        out.update({"m_" + n: getattr(x, n)() for n in ("exp", "abs", "neg")})
        out["isnan"], out["isinf"] = stax.isnan(x), stax.isinf(x)
        return out
    got, _ = run(f, x, p)
    want = {n: r(f64(x)) for n, r in UNARY.items()}
    want.update({n: r(f64(p)) for n, r in POSITIVE_UNARY.items()})
    want.update({"m_exp": np.exp(f64(x)), "m_abs": np.abs(f64(x)), "m_neg": -f64(x),
                 "isnan": np.zeros((6, 35), bool), "isinf": np.zeros((6, 35), bool)})
    check_all(got, want, {"isnan": stax.bool, "isinf": stax.bool, "exp": stax.float32})


def test_binary_ops_tensor_broadcast_scalar_reversed(dynamic, rng):
    x, y, b = rand(rng, 5, 33), nonzero_rand(rng, 5, 33), nonzero_rand(rng, 33)
    p = rand(rng, 5, 33, lo=0.2, hi=2)

    def f(x, y, b, p):
        return {
            "add": x + y, "sub": x - y, "mul": x * y, "div": x / y, "pow": p ** y,
            "maximum": stax.maximum(x, y), "minimum": stax.minimum(x, y),
            "floordiv": x // y, "remainder": x % y, "add_alpha": stax.add(x, y, alpha=3),
            "b_add": x + b, "b_sub": b - x, "b_mul": x * b, "b_div": x / b, "b_max": stax.maximum(b, x),
            "s_add": x + 2.5, "s_sub": x - 2, "s_mul": x * 3, "s_div": x / 4.0, "s_pow": p ** 2,
            "s_pow3": p ** 3, "s_powf": p ** 0.5, "s_floordiv": x // 0.75, "s_mod": x % 0.75,
            "r_add": 2.5 + x, "r_sub": 1 - x, "r_mul": 3 * x, "r_div": 2 / y, "r_pow": 2 ** x,
            "r_floordiv": 3 // y, "r_mod": 3 % y,
            "eq": x == y, "ne": x != y, "lt": x < y, "le": x <= b, "gt": x > 0.5, "ge": 0.1 >= x,
            "and": (x > 0) & (y > 0), "or": (x > 0) | (y > 0), "xor": (x > 0) ^ (y > 0),
            "logical_and": stax.logical_and(x > 0, y), "logical_not": stax.logical_not(x > 0),
            "div_trunc": stax.div(x, y, rounding_mode="trunc"),
            "div_floor": stax.div(x, y, rounding_mode="floor"),
        }
    got, _ = run(f, x, y, b, p)
    X, Y, B, P = f64(x), f64(y), f64(b), f64(p)
    want = {
        "add": X + Y, "sub": X - Y, "mul": X * Y, "div": X / Y, "pow": P ** Y,
        "maximum": np.maximum(X, Y), "minimum": np.minimum(X, Y),
        "floordiv": np.floor_divide(X, Y), "remainder": np.remainder(X, Y), "add_alpha": X + 3 * Y,
        "b_add": X + B, "b_sub": B - X, "b_mul": X * B, "b_div": X / B, "b_max": np.maximum(B, X),
        "s_add": X + 2.5, "s_sub": X - 2, "s_mul": X * 3, "s_div": X / 4, "s_pow": P ** 2,
        "s_pow3": P ** 3, "s_powf": P ** 0.5, "s_floordiv": np.floor_divide(X, 0.75),
        "s_mod": np.remainder(X, 0.75),
        "r_add": 2.5 + X, "r_sub": 1 - X, "r_mul": 3 * X, "r_div": 2 / Y, "r_pow": 2 ** X,
        "r_floordiv": np.floor_divide(3, Y), "r_mod": np.remainder(3, Y),
        "eq": X == Y, "ne": X != Y, "lt": X < Y, "le": X <= B, "gt": X > 0.5, "ge": 0.1 >= X,
        "and": (X > 0) & (Y > 0), "or": (X > 0) | (Y > 0), "xor": (X > 0) ^ (Y > 0),
        "logical_and": (X > 0) & (Y != 0), "logical_not": ~(X > 0),
        "div_trunc": np.trunc(X / Y), "div_floor": np.floor(X / Y),
    }
    check_all(got, want)
    assert all(got[k].dtype is stax.bool for k in ("eq", "lt", "and", "logical_not", "xor"))


def test_int_and_bool_ops_exact(rng):
    i = stax.tensor(rng.integers(-50, 50, (4, 9)))                      # int64
    j = stax.tensor(rng.integers(1, 7, (4, 9)), dtype=stax.int32)
    bl = stax.tensor(rng.uniform(size=(4, 9)) > 0.5)

    def f(i, j, bl):
        return {
            "add": i + j, "sub": i - 3, "mul": i * j, "floordiv": i // j, "mod": i % j,
            "neg": -i, "abs": i.abs(), "max": stax.maximum(i, j), "pow": j ** 2,
            "and": i & j, "or": i | 5, "xor": i ^ j, "not": ~i, "div": i / j, "i_plus_f": i + 0.5,
            "rfloordiv": 100 // j, "relu": stax.relu(i), "sign": stax.sign(i),
            "b_not": ~bl, "b_and": bl & (i > 0), "b_add_int": bl + j, "b_mul_f": bl * 1.5,
            "b_to_i": bl.int(), "i_to_b": i.bool(), "i_to_f": i.float(), "j_to_i64": j.long(),
            "where": stax.where(bl, i, j), "where_s": stax.where(bl, 7, j),
            "sum": i.sum(), "sum_j": j.sum(1), "sum_b": bl.sum(0), "prod": j.prod(1),
            "amax": i.amax(0), "amin": j.amin(1), "bmax": bl.amax(0), "bmin": bl.amin(1),
            "argmax": i.argmax(1), "argmin": j.argmin(0), "cumsum": j.cumsum(1), "mean_f": i.float().mean(),
        }
    got, _ = run(f, i, j, bl)
    I, J, BL = np.asarray(i), np.asarray(j), np.asarray(bl)
    want = {
        "add": I + J, "sub": I - 3, "mul": I * J, "floordiv": I // J, "mod": I % J, "neg": -I,
        "abs": np.abs(I), "max": np.maximum(I, J), "pow": J ** 2, "and": I & J, "or": I | 5,
        "xor": I ^ J, "not": ~I, "div": I / J, "i_plus_f": I + 0.5, "rfloordiv": 100 // J,
        "relu": np.maximum(I, 0), "sign": np.sign(I), "b_not": ~BL, "b_and": BL & (I > 0),
        "b_add_int": BL + J, "b_mul_f": BL * 1.5, "b_to_i": BL.astype(np.int32), "i_to_b": I != 0,
        "i_to_f": I, "j_to_i64": J, "where": np.where(BL, I, J), "where_s": np.where(BL, 7, J),
        "sum": I.sum(), "sum_j": J.sum(1), "sum_b": BL.sum(0), "prod": J.astype(np.int64).prod(1),
        "amax": I.max(0), "amin": J.min(1), "bmax": BL.max(0), "bmin": BL.min(1),
        "argmax": I.argmax(1), "argmin": J.argmin(0), "cumsum": J.cumsum(1), "mean_f": I.mean(),
    }
    dt = {"add": stax.int64, "mul": stax.int64, "sub": stax.int64, "floordiv": stax.int64,
          "max": stax.int64, "pow": stax.int32, "div": stax.float32, "i_plus_f": stax.float32,
          "rfloordiv": stax.int32, "b_add_int": stax.int32, "b_mul_f": stax.float32,
          "b_to_i": stax.int32, "i_to_b": stax.bool, "where": stax.int64, "where_s": stax.int32,
          "sum": stax.int64, "sum_j": stax.int64, "sum_b": stax.int64, "prod": stax.int64,
          "amax": stax.int64, "amin": stax.int32, "bmax": stax.bool, "bmin": stax.bool,
          "argmax": stax.int64, "cumsum": stax.int64}
    check_all(got, want, dt)


def test_bool_max_reductions_start_from_false(rng):
    """amax over a bool column that is all False must be False (the identity is not -inf → true)."""
    m = stax.tensor(np.array([[False, True, False], [False, False, False]]))
    got, _ = run(lambda m: (m.amax(0), m.amin(0), m.amax(1), (m.int() - 5).amax(0)), m)
    assert got[0].tolist() == [False, True, False] and got[1].tolist() == [False, False, False]
    assert got[2].tolist() == [True, False] and got[3].tolist() == [-5, -4, -5]


def test_where_clamp_casts(dynamic, rng):
    x, y = rand(rng, 4, 17), rand(rng, 4, 17)

    def f(x, y):
        return {
            "where": stax.where(x > 0, x, y), "where_s1": stax.where(x > 0, 1.0, y),
            "where_s2": stax.where(x > y, x, 0), "where_m": x.where(x > 0, y),
            "clamp": stax.clamp(x, -0.5, 0.5), "clamp_min": x.clamp(min=0.1),
            "clamp_max": x.clamp(max=-0.1), "clip_t": stax.clamp(x, y, 1.0),
            "to_i32": x.to(stax.int32), "to_i64": (x * 10).long(), "to_b": x.bool(),
            "to_f64": x.double(), "to_f16": x.half(), "to_bf16": x.to(stax.bfloat16),
            "roundtrip": x.half().float(),
        }
    got, _ = run(f, x, y)
    X, Y = f64(x), f64(y)
    want = {
        "where": np.where(X > 0, X, Y), "where_s1": np.where(X > 0, 1.0, Y),
        "where_s2": np.where(X > Y, X, 0), "where_m": np.where(X > 0, X, Y),
        "clamp": np.clip(X, -0.5, 0.5), "clamp_min": np.maximum(X, 0.1),
        "clamp_max": np.minimum(X, -0.1), "clip_t": np.minimum(np.maximum(X, Y), 1.0),
        "to_i32": np.trunc(X), "to_i64": np.trunc(np.float32(10) * x.numpy()), "to_b": X != 0,
        "to_f64": X, "to_f16": X, "to_bf16": X, "roundtrip": X.astype(np.float16),
    }
    check_all(got, want, {"to_i32": stax.int32, "to_i64": stax.int64, "to_b": stax.bool,
                          "to_f64": stax.float64, "to_f16": stax.float16, "to_bf16": stax.bfloat16,
                          "roundtrip": stax.float32})
    # exact rounding of the casts (not just within tolerance)
    assert np.array_equal(np.asarray(got["to_f16"]), x.numpy().astype(np.float16))
    assert np.array_equal(np.asarray(got["roundtrip"]), x.numpy().astype(np.float16).astype(np.float32))


REDUCTION_DIMS = [0, -1, [0, 2], (1,), None]


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", REDUCTION_DIMS, ids=str)
def test_reductions(dynamic, rng, dim, keepdim):
    x = rand(rng, 4, 7, 9)
    npdim = None if dim is None else tuple(dim) if isinstance(dim, (list, tuple)) else dim

    def f(x):
        return {
            "sum": x.sum(dim, keepdim), "mean": x.mean(dim, keepdim=keepdim),
            "amax": x.amax(() if dim is None else dim, keepdim),
            "amin": x.amin(() if dim is None else dim, keepdim), "prod": x.prod(dim, keepdim),
            "var": x.var(dim, keepdim=keepdim), "std": x.std(dim, keepdim=keepdim),
            "var0": x.var(dim, correction=0, keepdim=keepdim),
            "std2": x.std(dim, correction=2, keepdim=keepdim),
            "lse": stax.logsumexp(x, [0, 1, 2] if dim is None else dim, keepdim),
            "sum_f64": x.sum(dim, keepdim, dtype=stax.float64),
        }
    got, _ = run(f, x)
    X = f64(x)
    n = X.size if dim is None else int(np.prod([X.shape[d] for d in np.atleast_1d(npdim)]))
    ss = ((X - X.mean(npdim, keepdims=True)) ** 2).sum(npdim, keepdims=keepdim)
    m = X.max(npdim, keepdims=True)
    lse = np.log(np.exp(X - m).sum(npdim, keepdims=True)) + m
    want = {
        "sum": X.sum(npdim, keepdims=keepdim), "mean": X.mean(npdim, keepdims=keepdim),
        "amax": X.max(npdim, keepdims=keepdim), "amin": X.min(npdim, keepdims=keepdim),
        "prod": X.prod(npdim, keepdims=keepdim), "var": ss / (n - 1), "std": np.sqrt(ss / (n - 1)),
        "var0": ss / n, "std2": np.sqrt(ss / (n - 2)),
        "lse": lse if keepdim else lse.reshape(X.sum(npdim).shape), "sum_f64": X.sum(npdim, keepdims=keepdim),
    }
    check_all(got, want, {"sum_f64": stax.float64})


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_arg_reductions_and_max_min(dynamic, rng, dim):
    x = rand(rng, 6, 37)

    def f(x):
        mx, mn = x.max(dim, keepdim=True), x.min(dim)
        return (x.argmax(dim), x.argmin(dim, keepdim=True), mx.values, mx.indices, mn.values,
                mn.indices, x.argmax(), x.argmin(), x.max(), x.min())
    got, _ = run(f, x)
    X = f64(x)
    want = (X.argmax(dim), np.expand_dims(X.argmin(dim), dim), X.max(dim, keepdims=True),
            np.expand_dims(X.argmax(dim), dim), X.min(dim), X.argmin(dim), X.argmax(), X.argmin(),
            X.max(), X.min())
    for k, (g, w) in enumerate(zip(got, want)):
        check(g, w, msg=str(k))
    assert got[0].dtype is stax.int64 and got[6].dtype is stax.int64


def test_cumsum_softmax_layer_norm_gelu_silu(dynamic, rng):
    x, w, b = rand(rng, 6, 45), rand(rng, 45), rand(rng, 45)
    x3 = rand(rng, 3, 4, 5)

    def f(x, w, b, x3):
        return {
            "cumsum0": x.cumsum(0), "cumsum1": stax.cumsum(x, -1),
            "softmax": stax.softmax(x, -1), "softmax0": stax.softmax(x, 0),
            "log_softmax": stax.log_softmax(x, -1), "log_softmax0": x.log_softmax(0),
            "softmax3": stax.softmax(x3, 1), "ln": stax.layer_norm(x, 45),
            "ln_wb": stax.layer_norm(x, (45,), w, b, eps=1e-3), "ln2": stax.layer_norm(x3, [4, 5]),
            "gelu": stax.gelu(x), "gelu_tanh": stax.gelu(x, approximate="tanh"), "silu": stax.silu(x),
        }
    got, _ = run(f, x, w, b, x3)
    X, W, B, X3 = f64(x), f64(w), f64(b), f64(x3)

    def softmax(a, d):
        e = np.exp(a - a.max(d, keepdims=True))
        return e / e.sum(d, keepdims=True)

    def ln(a, dims, eps=1e-5):
        mu = a.mean(dims, keepdims=True)
        return (a - mu) / np.sqrt(((a - mu) ** 2).mean(dims, keepdims=True) + eps)
    want = {
        "cumsum0": X.cumsum(0), "cumsum1": X.cumsum(1), "softmax": softmax(X, -1),
        "softmax0": softmax(X, 0), "log_softmax": np.log(softmax(X, -1)),
        "log_softmax0": np.log(softmax(X, 0)), "softmax3": softmax(X3, 1), "ln": ln(X, -1),
        "ln_wb": ln(X, -1, 1e-3) * W + B, "ln2": ln(X3, (1, 2)),
        "gelu": 0.5 * X * (1 + erf(X / np.sqrt(2))),
        "gelu_tanh": 0.5 * X * (1 + np.tanh(np.sqrt(2 / np.pi) * (X + 0.044715 * X ** 3))),
        "silu": X / (1 + np.exp(-X)),
    }
    check_all(got, want)


def test_matmul_cat_stack(dynamic, rng):
    a, b, c = rand(rng, 5, 7), rand(rng, 7, 3), rand(rng, 5, 7)
    ba, bb = rand(rng, 2, 5, 7), rand(rng, 2, 7, 3)
    v = rand(rng, 7)

    def f(a, b, c, ba, bb, v):
        return {
            "mm": a @ b, "mm_bias": stax.matmul(a, b) + 1.5, "bmm": ba @ bb, "bmm_bcast": ba @ b,
            "mv": a @ v, "vm": v @ b, "mm_t": c.t() @ a, "mm_chain": stax.relu(a @ b) @ b.t(),
            "cat0": stax.cat([a, c]), "cat1": stax.cat([a, c * 2, a], 1), "cat_neg": stax.cat([a, c], -1),
            "stack0": stax.stack([a, c]), "stack_last": stax.stack([a, c], -1),
            "cat_mixed": stax.cat([a, (c > 0).int()], 0),
        }
    got, _ = run(f, a, b, c, ba, bb, v)
    A, B, C, BA, BB, V = map(f64, (a, b, c, ba, bb, v))
    want = {
        "mm": A @ B, "mm_bias": A @ B + 1.5, "bmm": BA @ BB, "bmm_bcast": BA @ B, "mv": A @ V,
        "vm": V @ B, "mm_t": C.T @ A, "mm_chain": np.maximum(A @ B, 0) @ B.T,
        "cat0": np.concatenate([A, C]), "cat1": np.concatenate([A, C * 2, A], 1),
        "cat_neg": np.concatenate([A, C], -1), "stack0": np.stack([A, C]),
        "stack_last": np.stack([A, C], -1), "cat_mixed": np.concatenate([A, (C > 0)], 0),
    }
    check_all(got, want)


def test_fallback_inputs_that_are_views_are_not_copied(rng):
    """`x @ w.t()`, a sliced weight, a broadcast batch: the matmul gets the buffer with the view's
    strides and offset (reinterpret_tensor), no copy kernel; a view that is not affine (a reshape
    that mixes dims) or one with arithmetic is still stored first."""
    x, w, ba = rand(rng, 7, 9), rand(rng, 13, 10), rand(rng, 3, 1, 5, 9)
    X, W, BA = f64(x), f64(w), f64(ba)
    cases = [
        (lambda x, w: x @ w[2:11, 1:].t(), (x, w), X @ W[2:11, 1:].T, 0),
        (lambda x, w: x @ w[:9, :9], (x, w), X @ W[:9, :9], 0),
        (lambda ba, w: ba @ w[:9, :6].expand(4, 9, 6), (ba, w), BA @ np.broadcast_to(W[:9, :6], (4, 9, 6)), 0),
        (lambda x, w: x @ w.t().reshape(13, 10)[:9, :4], (x, w), X @ W.T.reshape(13, 10)[:9, :4], 1),
        (lambda x, w: x @ (w[:9, :5] * 2), (x, w), X @ (W[:9, :5] * 2), 1),
    ]
    for fn, args, want, copies in cases:
        gen = stax.generate(fn, *args)
        assert len(gen.kernels) == copies, gen
        assert ("reinterpret_tensor(" in gen.wrapper) == (copies == 0)
        assert_close(stax.compile(fn)(*args), want, stax.float32)


def test_views(dynamic, rng):
    x, v = rand(rng, 6, 10), rand(rng, 10)

    def f(x, v):
        return {
            "t": x.t() * 1, "t_out": x.t(), "transpose": x.transpose(0, 1) + 1,
            "permute3": x.reshape(2, 3, 10).permute(2, 0, 1) - 1, "reshape": x.reshape(10, 6) * 2,
            "reshape_t": x.t().reshape(60) + 0, "view": x.view(3, 20), "view_flat": x.view(-1),
            "expand": v.expand(4, 10) + x[:4], "expand_out": v.unsqueeze(1).expand(10, 3),
            "slice_step": x[1:6:2, ::3] * 3, "slice_neg": x[-2:, 2:-1], "int_index": x[2] + 1,
            "int_index2": x[:, 3], "scalar_index": x[2, 3] * 1, "unsqueeze": x.unsqueeze(0) + x,
            "squeeze": x[None, :, None].squeeze() - x, "squeeze_dim": x[:, None].squeeze(1),
            "contiguous": x.t().contiguous(), "clone": x.clone(), "flatten": x.reshape(2, 3, 10).flatten(1),
            "ellipsis": x[..., 1], "narrow": x.narrow(1, 2, 5) * 1, "T": x.T,
            "chain": x.t()[2:8:3].reshape(-1)[1:5],
        }
    got, _ = run(f, x, v)
    X, V = f64(x), f64(v)
    want = {
        "t": X.T, "t_out": X.T, "transpose": X.T + 1,
        "permute3": X.reshape(2, 3, 10).transpose(2, 0, 1) - 1, "reshape": X.reshape(10, 6) * 2,
        "reshape_t": X.T.reshape(60), "view": X.reshape(3, 20), "view_flat": X.reshape(-1),
        "expand": V + X[:4], "expand_out": np.broadcast_to(V[:, None], (10, 3)),
        "slice_step": X[1:6:2, ::3] * 3, "slice_neg": X[-2:, 2:-1], "int_index": X[2] + 1,
        "int_index2": X[:, 3], "scalar_index": X[2, 3], "unsqueeze": X[None] + X,
        "squeeze": np.zeros_like(X), "squeeze_dim": X, "contiguous": X.T, "clone": X,
        "flatten": X.reshape(2, 30), "ellipsis": X[..., 1], "narrow": X[:, 2:7], "T": X.T,
        "chain": X.T[2:8:3].reshape(-1)[1:5],
    }
    check_all(got, want)


# ---- the chapter's examples ----


def test_chapter_examples(dynamic, rng):
    x, y = rand(rng, 64, 128), rand(rng, 64, 128)
    yt = rand(rng, 128, 64)
    X, Y, YT = f64(x), f64(y), f64(yt)

    got, _ = run(lambda x, y: (stax.relu(x + y) * 2).sum(-1), x, y)                # Example 1.1
    check(got, (np.maximum(X + Y, 0) * 2).sum(-1))
    got, _ = run(lambda x, y: x.t() + y, x, yt)                                     # Example 6.1
    check(got, X.T + YT)
    got, _ = run(lambda x: (x * x).sum(-1), x)                                      # Example 6.2
    check(got, (X * X).sum(-1))
    got, _ = run(lambda x: stax.softmax(x, -1), x)
    e = np.exp(X - X.max(-1, keepdims=True))
    check(got, e / e.sum(-1, keepdims=True))
    w, b = rand(rng, 128), rand(rng, 128)
    got, _ = run(lambda x, w, b: stax.layer_norm(x, (128,), w, b), x, w, b)
    mu = X.mean(-1, keepdims=True)
    ln = (X - mu) / np.sqrt(((X - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    check(got, ln * f64(w) + f64(b))


def test_mlp_block(dynamic, rng):
    x, w1, b1 = rand(rng, 16, 32), rand(rng, 32, 48, lo=-0.3, hi=0.3), rand(rng, 48)
    g, bb = rand(rng, 48), rand(rng, 48)

    def mlp(x, w1, b1, g, bb):
        return stax.layer_norm(stax.gelu(x @ w1 + b1), (48,), g, bb)
    got, cf = run(mlp, x, w1, b1, g, bb)
    h = f64(x) @ f64(w1) + f64(b1)
    h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
    mu = h.mean(-1, keepdims=True)
    want = (h - mu) / np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * f64(g) + f64(bb)
    check(got, want)
    # matmul is an extern call; bias + gelu + layer_norm fuse into one kernel after it
    assert len(cf.last_generated.kernels) == 1


# ---- odd sizes ----


@pytest.mark.parametrize("shape", [(0, 7), (7, 0), (1, 1), (1, 7), (7, 1), (7,), (1,), (1000,),
                                   (3, 1000), (1000, 3), (33, 17)], ids=str)
def test_odd_sizes(dynamic, rng, shape):
    x = rand(rng, *shape)
    X = f64(x)
    empty_rows = shape[-1] == 0

    def f(x):
        out = {"pw": stax.relu(x) * 2 + 1, "exp": x.exp(), "sum_last": x.sum(-1), "sum0": x.sum(0),
               "sum_all": x.sum(), "mean": x.mean(-1), "prod": x.prod(-1), "t": x.t() * 1,
               "var0": x.var(-1, correction=0)}
        if not empty_rows:
            out.update(amax=x.amax(-1, keepdim=True), argmax=x.argmax(-1), softmax=stax.softmax(x, -1),
                       log_softmax=stax.log_softmax(x, -1), ln=stax.layer_norm(x, shape[-1:]))
        if x.numel():
            out.update(max_all=x.amax(), argmin_all=x.argmin())
        return out
    got, _ = run(f, x)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # numpy on empty slices
        want = {"pw": np.maximum(X, 0) * 2 + 1, "exp": np.exp(X), "sum_last": X.sum(-1),
                "sum0": X.sum(0), "sum_all": X.sum(), "mean": X.mean(-1), "prod": X.prod(-1),
                "t": X.T, "var0": X.var(-1)}
        if not empty_rows:
            e = np.exp(X - X.max(-1, keepdims=True))
            mu = X.mean(-1, keepdims=True)
            want.update(amax=X.max(-1, keepdims=True), argmax=X.argmax(-1),
                        softmax=e / e.sum(-1, keepdims=True),
                        log_softmax=np.log(e / e.sum(-1, keepdims=True)),
                        ln=(X - mu) / np.sqrt(((X - mu) ** 2).mean(-1, keepdims=True) + 1e-5))
        if X.size:
            want.update(max_all=X.max(), argmin_all=X.argmin())
    check_all(got, want)


def test_size_one_reductions_are_not_loops(dynamic, rng):
    """A reduction over size-1 dims is the element itself (argmax: 0), also with keepdim."""
    x = rand(rng, 5, 1, 3)
    got, cf = run(lambda x: (x.sum(1), x.amax(1, keepdim=True), x.argmax(1), x.mean((1,)),
                             x[:, :, :1].sum((1, 2)), x[0, 0, 0].sum()), x)
    X = f64(x)
    check(got[0], X.sum(1)), check(got[1], X.max(1, keepdims=True))
    check(got[2], np.zeros((5, 3)), stax.int64), check(got[3], X.mean(1))
    check(got[4], X[:, :, :1].sum((1, 2))), check(got[5], X[0, 0, 0])
    assert "for (int64_t r" not in str(cf.last_generated)


# ---- non-contiguous and broadcast inputs ----


def _inputs_of_every_layout(rng):
    big = rand(rng, 9, 13, 11)
    return {
        "transposed": big[0].t(), "step_sliced": big[1:8:2, 2, ::3],
        "offset_row": big[3, 4:9], "offset_2d": big[5, 2:9, 1:6], "permuted": big.permute(2, 0, 1)[:, 3, 1:5],
        "broadcast_row": rand(rng, 11).expand(6, 11), "broadcast_col": rand(rng, 6, 1).expand(6, 11),
        "scalar_expand": rand(rng, 1, 1).expand(4, 5),
    }


@pytest.mark.parametrize("layout", ["transposed", "step_sliced", "offset_row", "offset_2d", "permuted",
                                    "broadcast_row", "broadcast_col", "scalar_expand"])
def test_noncontiguous_and_broadcast_inputs(dynamic, rng, layout):
    x = _inputs_of_every_layout(rng)[layout]
    assert not x.is_contiguous() or x.storage_offset() != 0
    X = f64(x)

    def f(x):
        return {"pw": stax.relu(x) * 2 + x.exp(), "sum": x.sum(-1), "sum0": x.sum(0),
                "softmax": stax.softmax(x, -1), "amax": x.amax(0), "t_add": x.t() * 1,
                "contig": x.contiguous(), "view": x.reshape(-1)}
    got, _ = run(f, x)
    e = np.exp(X - X.max(-1, keepdims=True))
    want = {"pw": np.maximum(X, 0) * 2 + np.exp(X), "sum": X.sum(-1), "sum0": X.sum(0),
            "softmax": e / e.sum(-1, keepdims=True), "amax": X.max(0), "t_add": X.T,
            "contig": X, "view": X.reshape(-1)}
    check_all(got, want)


def test_binary_with_mixed_layouts(rng):
    a = rand(rng, 12, 8)
    x, y, z = a.t(), rand(rng, 16, 12)[::2], rand(rng, 8, 1)
    got, _ = run(lambda x, y, z: (x + y * z, (x * y).sum(0), stax.maximum(x, y.t().t())), x, y, z)
    X, Y, Z = f64(x), f64(y), f64(z)
    check(got[0], X + Y * Z), check(got[1], (X * Y).sum(0)), check(got[2], np.maximum(X, Y))


# ---- NaN and inf ----


def test_nan_inf_propagation(rng):
    a = rng.uniform(-2, 2, (6, 37))
    a[1, 3], a[2, 20], a[3, :] = np.nan, np.inf, -np.inf
    a[4, 5], a[4, 30], a[5, 36] = np.inf, np.nan, np.nan
    x = stax.tensor(a, dtype=stax.float32)
    X = f64(x)

    def f(x):
        return {
            "amax": x.amax(-1), "amin": x.amin(-1), "amax0": x.amax(0), "max_all": x.amax(),
            "argmax": x.argmax(-1), "argmin": x.argmin(-1), "argmax0": x.argmax(0), "argmax_all": x.argmax(),
            "max_values": x.max(-1).values, "max_idx": x.max(-1).indices,
            "relu": stax.relu(x), "maximum": stax.maximum(x, 0.5), "minimum": stax.minimum(0.5, x),
            "clamp": x.clamp(-1, 1), "sum": x.sum(-1), "exp": x.exp(), "isnan": stax.isnan(x),
            "isinf": stax.isinf(x), "where": stax.where(stax.isnan(x), 0.0, x), "softmax": stax.softmax(x, -1),
            "sign": stax.sign(x), "lse": stax.logsumexp(x, -1),
        }
    got, _ = run(f, x)
    eager = f(x)                           # eager is the reference for NaN placement in arg-reductions
    with np.errstate(all="ignore"):
        e = np.exp(X - X.max(-1, keepdims=True))
        m = X.max(-1, keepdims=True)
        m = np.where(np.isinf(m), 0, m)
        want = {
            "amax": X.max(-1), "amin": X.min(-1), "amax0": X.max(0), "max_all": X.max(),
            "argmax": np.asarray(eager["argmax"]), "argmin": np.asarray(eager["argmin"]),
            "argmax0": np.asarray(eager["argmax0"]), "argmax_all": np.asarray(eager["argmax_all"]),
            "max_values": X.max(-1), "max_idx": np.asarray(eager["max_idx"]),
            "relu": np.where(X < 0, 0, X), "maximum": np.maximum(X, 0.5), "minimum": np.minimum(0.5, X),
            "clamp": np.minimum(np.maximum(X, -1), 1), "sum": X.sum(-1), "exp": np.exp(X),
            "isnan": np.isnan(X), "isinf": np.isinf(X), "where": np.where(np.isnan(X), 0, X),
            "softmax": e / e.sum(-1, keepdims=True), "sign": np.sign(np.nan_to_num(X, nan=0.0)),
            "lse": (np.log(np.exp(X - m).sum(-1, keepdims=True)) + m)[:, 0],
        }
    check_all(got, want)
    # torch semantics: argmax of a row holding NaN is the first NaN
    assert got["argmax"].tolist()[1] == 3 and got["argmax"].tolist()[4] == 30
    assert got["argmax_all"].item() == 1 * 37 + 3


# ---- int and half dtypes ----


@pytest.mark.parametrize("dtype", [stax.float16, stax.bfloat16, stax.float64])
def test_float_dtypes(dynamic, rng, dtype):
    x, y = rand(rng, 5, 37, dtype=dtype), rand(rng, 5, 37, dtype=dtype)
    X, Y = f64(x), f64(y)

    def f(x, y):
        return {"add": x + y, "mul_s": x * 2.5, "exp": x.exp(), "sum": x.sum(-1), "mean": x.mean(-1),
                "amax": x.amax(-1), "argmax": x.argmax(-1), "softmax": stax.softmax(x, -1),
                "ln": stax.layer_norm(x, 37), "gelu": stax.gelu(x), "var": x.var(-1),
                "to_f32": (x * y).float(), "t": x.t() + y.t(), "where": stax.where(x > y, x, y),
                "mm": x @ y.t()}
    got, _ = run(f, x, y)
    e = np.exp(X - X.max(-1, keepdims=True))
    mu = X.mean(-1, keepdims=True)
    want = {"add": X + Y, "mul_s": X * 2.5, "exp": np.exp(X), "sum": X.sum(-1), "mean": X.mean(-1),
            "amax": X.max(-1), "argmax": X.argmax(-1), "softmax": e / e.sum(-1, keepdims=True),
            "ln": (X - mu) / np.sqrt(X.var(-1, keepdims=True) + 1e-5),
            "gelu": 0.5 * X * (1 + erf(X / np.sqrt(2))), "var": X.var(-1, ddof=1),
            "to_f32": X * Y, "t": X.T + Y.T, "where": np.maximum(X, Y), "mm": X @ Y.T}
    for k in want:
        # computed in float32 (§6.2): judged at the precision of the inputs' dtype
        check(got[k], want[k], got[k].dtype, msg=k)
        assert_close(np.asarray(got[k]), want[k], dtype.name if k != "argmax" else "int64", msg=k)
    assert got["add"].dtype is dtype and got["to_f32"].dtype is stax.float32


@pytest.mark.parametrize("dtype", [stax.float16, stax.bfloat16])
def test_half_rule_other_tensor_dtypes_round_first(rng, dtype):
    """With a half common dtype, tensor operands of another dtype (int, 0-dim float) are rounded
    to the half type before computing, exactly as eager does; Python scalars are not."""
    x = rand(rng, 4, 33, dtype=dtype)
    i = stax.tensor(rng.integers(-3000, 3000, (4, 33)))
    c = stax.tensor(1 + 2 ** -10)                           # 0-dim float32: rounds to 1.0 in half

    def f(x, i, c):
        return (x + i, x * i, x - c, x - (1 + 2 ** -10), stax.where(x > 0, x, i), x < c, x * 0 + i)
    got, _ = run(f, x, i, c)
    want = f(x, i, c)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype is w.dtype
        assert np.array_equal(np.asarray(g), np.asarray(w)), f"output {k} differs from eager"


def test_user_cast_rounds_inside_fused_kernel(rng):
    """`.to(float16)` the user wrote rounds even when the whole chain is one kernel (docs/DESIGN.md)."""
    x = rand(rng, 8, 65)

    def f(x):
        h = (x * 1.001).to(stax.float16)               # rounds here
        return (h.float() * 3.0 + 1.0).sum(-1), (x.to(stax.bfloat16).to(stax.float32) - x)
    got, cf = run(f, x)
    want = f(x)
    assert_close(np.asarray(got[0]), np.asarray(want[0]), "float32")
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))   # exactly the rounding error
    assert np.abs(np.asarray(got[1])).max() > 0
    assert len(cf.last_generated.kernels) == 1


# ---- Python scalars, constants, argument containers ----


def test_python_scalars_and_closed_over_constants(rng):
    w = rand(rng, 9)
    bias = rand(rng, 4, 9)
    x = rand(rng, 4, 9)

    def f(x, alpha, n, flag, mode="add"):
        y = x * w + alpha
        if flag:
            y = y + bias
        return (y * n if mode == "add" else y - n), n + 1, "tag"
    cf = stax.compile(f)
    X, W, B = f64(x), f64(w), f64(bias)
    for alpha, n, flag, mode in [(0.5, 2, True, "add"), (1.5, 2, True, "add"), (0.5, 3, False, "sub")]:
        out, m, tag = cf(x, alpha, n, flag, mode=mode)
        y = X * W + alpha + (B if flag else 0)
        check(out, y * n if mode == "add" else y - n)
        assert m == n + 1 and tag == "tag"
    assert cf.stats["compiles"] == 3
    cf(x, 0.5, 2, True, mode="add")
    assert cf.stats["compiles"] == 3                      # the same key reuses the artifact
    # constants are read at call time (not frozen at compile time)
    w.mul_(0)
    out, _, _ = cf(x, 0.5, 2, True, mode="add")
    check(out, (0.5 + B) * 2)


def test_tensors_in_lists_and_kwargs_are_inputs(rng):
    """Tensors passed inside a list/tuple/dict or by keyword are inputs, not constants frozen
    at the first call's values."""
    def f(xs, scale, *, bias):
        return (xs[0] + xs[1]) * scale["s"] + bias
    cf = stax.compile(f)
    for _ in range(2):
        a, b, s, c = rand(rng, 3, 5), rand(rng, 3, 5), rand(rng, 5), rand(rng, 3, 5)
        check(cf([a, b], {"s": s}, bias=c), (f64(a) + f64(b)) * f64(s) + f64(c))
    assert cf.stats["compiles"] == 1


def test_output_structures(dynamic, rng):
    x, y = rand(rng, 3, 4), rand(rng, 4)

    def f(x, y):
        return {"sum": x.sum(), "nested": [(x + y, None), {"k": x * 2}], "scalar": 3.5,
                "tuple": (x.t(), 7)}
    got, _ = run(f, x, y)
    X, Y = f64(x), f64(y)
    assert isinstance(got, dict) and isinstance(got["nested"], list) and isinstance(got["nested"][0], tuple)
    check(got["sum"], X.sum()), check(got["nested"][0][0], X + Y), check(got["nested"][1]["k"], X * 2)
    check(got["tuple"][0], X.T)
    assert got["nested"][0][1] is None and got["scalar"] == 3.5 and got["tuple"][1] == 7
    single, _ = run(lambda x: x + 1, x)
    assert isinstance(single, stax.Tensor)
    lst, _ = run(lambda x: [x + 1, x - 1], x)
    assert isinstance(lst, list) and len(lst) == 2
    none, _ = run(lambda x: None, x)
    assert none is None
    twice, cf = run(lambda x: (lambda a: (a, [a], a + 0))(x * 2), x)     # one tensor returned twice
    assert twice[0] is twice[1][0] and twice[2] is not twice[0]
    check(twice[0], X * 2), check(twice[2], X * 2)


def test_outputs_that_are_inputs_or_views_of_inputs(rng):
    """As in eager, an output that is an input is that very tensor, and a view of an input shares
    the input's storage (writing to it writes the input); computed outputs never alias."""
    x = rand(rng, 4, 6)
    X = f64(x).copy()
    fn = lambda x: (x, x.t(), x[1], x[:, ::2], x.reshape(24), x.expand(2, 4, 6), x, x + 0)  # noqa: E731
    got, cf = run(fn, x)
    for g, w in zip(got, (X, X.T, X[1], X[:, ::2], X.reshape(24), np.broadcast_to(X, (2, 4, 6)), X, X)):
        check(g, w)
    assert np.array_equal(f64(x), X)                       # the input is untouched
    eager = fn(x)
    assert got[0] is x and got[6] is x
    for g, e in zip(got[1:6], eager[1:6]):
        assert g._storage is x._storage and g.shape == e.shape and g.stride() == e.stride()
        assert g.storage_offset() == e.storage_offset()
    assert got[7]._storage is not x._storage
    got[2].mul_(0)                                         # a write through the returned view
    assert f64(x)[1].tolist() == [0.0] * 6
    # a mutated input returned (or viewed) is the caller's tensor, updated
    y = rand(rng, 3, 5)
    Y = f64(y)

    def g(y):
        v = y[:, 1]
        y.add_(1)
        return y, v
    out, v = stax.compile(g)(y)
    assert out is y and v._storage is y._storage
    check(y, Y + 1), check(v, Y[:, 1] + 1)


# ---- specialization, guards, recompiles ----


def test_new_shapes_strides_dtypes_recompile_and_reuse(rng):
    cf = stax.compile(lambda x, y: (x * 2 + y).sum(-1))
    seen = 0

    def call(x, y, new):
        nonlocal seen
        check(cf(x, y), (f64(x) * 2 + f64(y)).sum(-1), msg=str(x.shape))
        seen += new
        assert cf.stats["compiles"] == seen
    a = rand(rng, 4, 6)
    call(a, rand(rng, 4, 6), True)
    call(rand(rng, 4, 6), rand(rng, 6), True)             # y's shape changed
    call(rand(rng, 4, 6), rand(rng, 4, 6), False)         # same key as the first call: reused
    call(rand(rng, 5, 3), rand(rng, 5, 3), True)          # new shape
    call(rand(rng, 6, 4).t(), rand(rng, 4, 6), True)      # transposed: new strides
    call(rand(rng, 6, 4).t(), rand(rng, 4, 6), False)
    call(rand(rng, 4, 6, dtype=stax.float64), rand(rng, 4, 6), True)   # new dtype
    call(rand(rng, 4, 6, dtype=stax.float16), rand(rng, 4, 6, dtype=stax.float16), True)
    call(rand(rng, 8, 6)[::2], rand(rng, 4, 6), True)     # a step-sliced view: new strides
    call(a, rand(rng, 4, 6), False)
    assert cf.stats["calls"] == 10 and cf.stats["eager_calls"] == 0


def test_recompile_limit_warns_then_runs_eagerly(rng, monkeypatch):
    # dynamic=False: this counts one specialization per size (the default, automatic dynamic,
    # would serve sizes 2..8 with one symbolic artifact)
    monkeypatch.setattr(stax, "COMPILE_LIMIT", 10)
    cf = stax.compile(lambda x: x * 3 - 1, dynamic=False)
    for n in range(1, 9):
        x = rand(rng, n)
        check(cf(x), f64(x) * 3 - 1)
    assert cf.stats["compiles"] == 8
    x = rand(rng, 9)
    with pytest.warns(UserWarning, match="recompile limit") as record:     # §2.4: compiled, not kept
        out = cf(x)
    assert record[0].filename == __file__                  # the warning names the caller's line
    check(out, f64(x) * 3 - 1)
    assert cf.stats["compiles"] == 9 and cf.stats["eager_calls"] == 0 and len(cf.artifacts) == 8
    x = rand(rng, 10)
    check(cf(x), f64(x) * 3 - 1)                           # warned once: no second warning
    assert cf.stats["compiles"] == 10
    x = rand(rng, 11)
    with pytest.warns(UserWarning, match="cumulative"):    # COMPILE_LIMIT reached: eager from now on
        check(cf(x), f64(x) * 3 - 1)
    assert cf.stats["compiles"] == 10 and cf.stats["eager_calls"] == 1
    check(cf(stax.ones(3)), np.full(3, 2.0))               # known keys still use their artifacts
    assert cf.stats["eager_calls"] == 1

    strict = stax.compile(lambda x: x * 3 - 1, fullgraph=True, dynamic=False)
    for n in range(1, 9):
        strict(stax.ones(n))
    with pytest.raises(RuntimeError, match="recompile limit"):
        strict(stax.ones(20))


def test_recompile_limit_counts_dynamic_artifacts(rng, monkeypatch):
    """Automatic dynamic: symbolic artifacts count towards the limits like static ones."""
    monkeypatch.setattr(stax, "RECOMPILE_LIMIT", 2)
    cf = stax.compile(lambda x: x + 1)
    for n in (3, 4, 5):                    # static, then one symbolic artifact for dim 0
        x = rand(rng, n, 2)
        check(cf(x), f64(x) + 1)
    x = rand(rng, 6, 2).t()                # a new layout: a third artifact, run but not kept
    with pytest.warns(UserWarning, match="recompile limit"):
        check(cf(x), f64(x) + 1)
    assert cf.stats["compiles"] == 3 and cf.stats["eager_calls"] == 0


def test_recompiles_log_names_the_failed_guard(rng, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "recompiles")
    cf = stax.compile(lambda x: x + 1)
    cf(rand(rng, 3, 4))
    assert "recompil" not in capsys.readouterr().err
    cf(rand(rng, 3, 5))
    err = capsys.readouterr().err
    assert "argument 0" in err and "size" in err and "(3, 4)" in err and "(3, 5)" in err
    cf(rand(rng, 5, 3).t())
    err = capsys.readouterr().err
    assert "stride" in err
    cf(rand(rng, 3, 4, dtype=stax.float64))
    err = capsys.readouterr().err
    assert "dtype" in err and "float64" in err


def test_dynamic_true_compiles_one_artifact_for_many_sizes(rng):
    # (this was test_dynamic_true_is_not_implemented; §10 is implemented: tests/test_dynamic.py)
    for cf in (stax.compile(lambda x: x * 3 - 1, dynamic=True),
               stax.compile(dynamic=True)(lambda x: x * 3 - 1)):
        for n in (5, 9, 17):
            x = rand(rng, n)
            check(cf(x), f64(x) * 3 - 1)
        assert cf.stats["compiles"] == 1
    with pytest.raises(ValueError, match="dynamic"):
        stax.compile(lambda x: x, dynamic="yes")


def test_decorator_forms(rng):
    @stax.compile
    def a(x):
        return x + 1

    @stax.compile(fullgraph=True)
    def b(x):
        return x * 2
    x = rand(rng, 3)
    check(a(x), f64(x) + 1), check(b(x), f64(x) * 2)
    assert a.__name__ == "a"


# ---- errors: the same ones eager raises ----


def _eager_error(fn, *args):
    with pytest.raises(Exception) as ei:
        fn(*args)
    return ei.type, str(ei.value)


@pytest.mark.parametrize("case", ["broadcast", "matmul_shape", "matmul_dtype", "cat_shape", "where_cond",
                                  "bitwise_float", "reshape", "view", "index", "dim"])
def test_errors_match_eager(rng, case):
    fns = {
        "broadcast": (lambda x, y: x + y, (rand(rng, 3, 4), rand(rng, 5, 4))),
        "matmul_shape": (lambda x, y: x @ y, (rand(rng, 3, 4), rand(rng, 5, 4))),
        "matmul_dtype": (lambda x, y: x @ y, (rand(rng, 3, 4), rand(rng, 4, 4, dtype=stax.float64))),
        "cat_shape": (lambda x, y: stax.cat([x, y], 1), (rand(rng, 3, 4), rand(rng, 5, 4))),
        "where_cond": (lambda x, y: stax.where(x, x, y), (rand(rng, 3), rand(rng, 3))),
        "bitwise_float": (lambda x, y: x & y, (rand(rng, 3), rand(rng, 3))),
        "reshape": (lambda x, y: x.reshape(5, 5) + y, (rand(rng, 3, 4), rand(rng, 1))),
        "view": (lambda x, y: x.t().view(12) + y, (rand(rng, 3, 4), rand(rng, 1))),
        "index": (lambda x, y: x[7] + y, (rand(rng, 3, 4), rand(rng, 1))),
        "dim": (lambda x, y: x.sum(3) + y, (rand(rng, 3, 4), rand(rng, 1))),
    }
    fn, args = fns[case]
    etype, emsg = _eager_error(fn, *args)
    with pytest.raises(etype) as ei:
        stax.compile(fn)(*args)
    assert str(ei.value) == emsg


def test_device_mismatch_error_matches_eager(rng):
    x = rand(rng, 3)
    y = rand(rng, 3)                    # only the metadata eager checks: a tensor on another device
    y._meta = type(y._meta)(y._meta.shape, y._meta.stride, y._meta.dtype, "cuda:0", y._meta.offset)
    etype, emsg = _eager_error(lambda x, y: x + y, x, y)
    assert "same device" in emsg
    with pytest.raises(etype, match="same device"):
        stax.compile(lambda x, y: x + y)(x, y)
