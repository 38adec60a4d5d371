"""The ops of issue 11 item 3 (shape_ops.py, math_ops.py, the new op_table entries) against float64
numpy, eagerly and compiled (C++), a few through the Triton back end (TRITON_INTERPRET=1 without a
GPU): odd sizes, non-contiguous and broadcast operands, NaN/inf, half types; and issue 11 item 4,
discovery: dir(stax), AttributeErrors that name the spelling that works, docs/OPS.md current.

Each test compiles one function returning several results (one C++ build per test).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stax
from conftest import assert_close

ROOT = Path(__file__).resolve().parent.parent


def f64(t):
    return np.asarray(t.numpy(), np.float64)


def check(fn, args, refs, dtype=None, compiled=True):
    runs = [("eager", fn)] + ([("compiled", stax.compile(fn))] if compiled else [])
    for how, run in runs:
        out = run(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        assert len(out) == len(refs)
        for k, (o, r) in enumerate(zip(out, refs)):
            dt = dtype or o.dtype
            assert_close(o.float() if o.dtype is stax.bfloat16 else o, r, dt, msg=f"{how} output {k}")


# ---- shape ops ----


def test_splits(rng):
    X = rng.standard_normal((7, 10))
    x = stax.tensor(X)
    assert [p.shape for p in stax.chunk(x, 3)] == [(3, 10), (3, 10), (1, 10)]
    assert [p.shape for p in x.split([2, 5], 0)] == [(2, 10), (5, 10)]
    assert [p.shape[1] for p in stax.tensor_split(x, 4, 1)] == [3, 3, 2, 2]
    assert [p.shape[1] for p in stax.tensor_split(x, [2, -3, 20], 1)] == [2, 5, 3, 0]
    assert len(stax.split(stax.zeros(0), 2)) == 1 and len(stax.chunk(stax.zeros(0), 3)) == 3
    with pytest.raises(RuntimeError, match="sum exactly to 7"):
        stax.split(x, [3, 3])

    def fn(x):
        a, b, c = stax.chunk(x.T, 3, dim=0)           # non-contiguous pieces
        return a * 2, c + 1, stax.unbind(x, 1)[3], x.unflatten(1, (2, -1)).sum(1), *stax.split(x, 4, 1)
    refs = (X.T[:4] * 2, X.T[8:] + 1, X[:, 3], X.reshape(7, 2, 5).sum(1), X[:, :4], X[:, 4:8], X[:, 8:])
    check(fn, [x], refs)


def test_repeat_flip_roll_movedim(rng):
    X = rng.standard_normal((3, 5))
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)

    def fn(x):
        return (x.repeat(2, 1, 3), stax.repeat_interleave(x, 2, dim=1), stax.repeat_interleave(x, 3),
                stax.flip(x, (0, 1)), x.T.flip(1) * 2, stax.roll(x, 2, 1), stax.roll(x, (-1, 7), (0, 1)),
                stax.roll(x, 4), stax.movedim(x.unsqueeze(0), 0, 2), x.mT, stax.tile(x, (2,)),
                stax.fliplr(x), stax.swapaxes(x, 0, 1))
    refs = (np.tile(X, (2, 1, 3)), np.repeat(X, 2, 1), np.repeat(X, 3), X[::-1, ::-1], X.T[:, ::-1] * 2,
            np.roll(X, 2, 1), np.roll(X, (-1, 7), (0, 1)), np.roll(X, 4), X[None].transpose(1, 2, 0), X.T,
            np.tile(X, 2), X[:, ::-1], X.T)
    check(fn, [x], refs)


@pytest.mark.parametrize("offset", [0, 2, -1, -4])
def test_diagonal_tril_triu(rng, offset):
    X = rng.standard_normal((2, 4, 6))
    x = stax.tensor(X)

    def fn(x):
        return (stax.diagonal(x, offset, 1, 2), x.diagonal(offset, -1, -2), stax.tril(x, offset),
                stax.triu(x, offset), stax.tril(x.transpose(1, 2), offset))
    refs = (np.diagonal(X, offset, 1, 2), np.diagonal(X, offset, 2, 1), np.tril(X, offset), np.triu(X, offset),
            np.tril(X.transpose(0, 2, 1), offset))
    check(fn, [x], refs)


def test_index_factories():
    check(lambda: (stax.eye(3, 5), stax.eye(4, dtype=stax.int64), stax.linspace(-1, 2, 7),
                   stax.linspace(0, 1, 1), stax.logspace(0, 2, 5, base=2.0), *stax.meshgrid(stax.arange(3), stax.arange(4)),
                   *stax.meshgrid(stax.arange(3), stax.arange(2), indexing="xy")), [],
          (np.eye(3, 5), np.eye(4, dtype=np.int64), np.linspace(-1, 2, 7), np.array([0.0]), 2 ** np.linspace(0, 2, 5),
           *np.meshgrid(np.arange(3), np.arange(4), indexing="ij"), *np.meshgrid(np.arange(3), np.arange(2))))


# ---- pointwise composites ----


def test_pointwise_composites(rng):
    A, B, W = rng.standard_normal((5, 7)) * 3, rng.standard_normal((1, 7)) * 2, rng.random((5, 1))
    A[0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    a, b, w = (stax.tensor(v, dtype=stax.float32) for v in (A, B, W))
    A, B, W = map(f64, (a, b, w))
    M = A > 1

    def fn(a, b, w):
        return (stax.square(a), stax.atan2(a, b), stax.fmod(a, b), stax.lerp(a, b, w), stax.lerp(a, b, 0.75),
                stax.addcmul(a, b, w, value=0.5), stax.addcdiv(a, b, w), stax.clamp_min(a, -1.0),
                stax.clamp_max(a, b), a.masked_fill(a > 1, -2.0), stax.isclose(a, a + 1e-6),
                stax.isclose(a, b, atol=1.0, equal_nan=True), stax.round(a, decimals=2), a.round(decimals=-1))
    with np.errstate(all="ignore"):
        refs = (A * A, np.arctan2(A, B), np.fmod(A, B), np.where(W < 0.5, A + W * (B - A), B - (B - A) * (1 - W)),
                B - (B - A) * 0.25, A + 0.5 * B * W, A + B / W, np.maximum(A, -1), np.minimum(A, B),
                np.where(M, -2.0, A), np.isclose(A, A + 1e-6, 1e-5, 1e-8), np.isclose(A, B, 1e-5, 1.0, equal_nan=True),
                np.round(A * 100) / 100, np.round(A / 10) * 10)
    check(fn, [a, b, w], refs)


def test_integer_and_half_pointwise(rng):
    I, J = rng.integers(-20, 20, (4, 6)), rng.integers(1, 7, (6,)) * rng.choice([-1, 1], 6)
    i, j = stax.tensor(I), stax.tensor(J)
    H = rng.standard_normal((4, 6))
    h = stax.tensor(H, dtype=stax.float16)
    bf = stax.tensor(H, dtype=stax.bfloat16)
    Hh, Hb = f64(h), f64(bf.float())
    check(lambda i, j: (stax.fmod(i, j), stax.square(i), i.remainder(j)), [i, j],
          (np.fmod(I, J), I * I, np.remainder(I, J)))
    check(lambda h: (stax.lerp(h, h * 2, 0.3), h.square()), [h], (Hh + 0.3 * Hh, Hh * Hh), stax.float16)
    check(lambda b: stax.atan2(b, b + 1), [bf], (np.arctan2(Hb, f64((bf + 1).float())),), stax.bfloat16)


def test_inplace_forms(rng):
    X, Y = rng.random((3, 4)) + 0.5, rng.random((3, 4))
    x, y = stax.tensor(X), stax.tensor(Y)
    x.sqrt_()
    x.addcmul_(y, y, value=2)
    x.lerp_(y, 0.5)
    x.sigmoid_()
    x.abs_()
    x.clamp_min_(0.6)
    ref = np.sqrt(X) + 2 * Y * Y
    ref = ref + 0.5 * (Y - ref)
    ref = np.maximum(np.abs(1 / (1 + np.exp(-ref))), 0.6)
    assert_close(x, ref, stax.float64)

    def step(p, g):
        p.mul_(0.9).addcdiv_(g, g.abs() + 1, value=-0.1)
        return p
    p0 = stax.tensor(X)
    out = stax.compile(step)(p0, y)
    assert_close(p0, X * 0.9 - 0.1 * Y / (np.abs(Y) + 1), stax.float64)
    assert out is p0 or np.array_equal(out.numpy(), p0.numpy())


# ---- reductions, products ----


def test_reductions(rng):
    X = rng.standard_normal((6, 5))
    X[1, 2] = 0
    B = rng.random((6, 5)) > 0.7
    x, b = stax.tensor(X, dtype=stax.float32).T, stax.tensor(B)     # x non-contiguous (5, 6)
    X = f64(x)

    def fn(x, b):
        v, m = stax.var_mean(x, 1)
        s, m2 = x.std_mean(axis=0, keepdims=True)
        return (stax.any(b, 0), b.all(1), stax.all(x != 0), stax.any(x > 10), stax.norm(x), x.norm(1, dim=1),
                stax.linalg.vector_norm(x, float("inf"), dim=0), stax.linalg.vector_norm(x, 3, dim=(0, 1)),
                stax.norm(x, 0, 1), v, m, s, m2, x.sum(axis=1), stax.count_nonzero(x, 0))
    refs = (B.any(0), B.all(1), np.all(X != 0), np.any(X > 10), np.sqrt((X * X).sum()), np.abs(X).sum(1),
            np.abs(X).max(0), (np.abs(X) ** 3).sum() ** (1 / 3), (X != 0).sum(1).astype(np.float64),
            X.var(1, ddof=1), X.mean(1), X.std(0, ddof=1, keepdims=True), X.mean(0, keepdims=True), X.sum(1),
            (X != 0).sum(0))
    check(fn, [x, b], refs)


@pytest.mark.parametrize("eq,shapes", [("ij,jk->ik", [(3, 5), (5, 4)]), ("bij,bjk->bik", [(2, 3, 5), (2, 5, 1)]),
                                       ("i,j->ij", [(4,), (3,)]), ("ij->ji", [(3, 7)]), ("ij,ij->", [(3, 4), (3, 4)]),
                                       ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
                                       ("ijk,jl,lm->mi", [(2, 3, 4), (3, 5), (5, 2)]), ("ij,jk", [(3, 2), (2, 5)]),
                                       ("ii->", [(4, 4)]), ("bii->bi", [(2, 5, 5)]), ("iji->j", [(3, 2, 3)]),
                                       ("bij,bjj->bi", [(2, 3, 4), (2, 4, 4)])])
def test_einsum(rng, eq, shapes):
    arrs = [rng.standard_normal(s) for s in shapes]
    ts = [stax.tensor(a) for a in arrs]
    check(lambda *t: stax.einsum(eq, *t), ts, (np.einsum(eq, *arrs),), compiled=len(shapes) != 3)


def test_einsum_errors():
    with pytest.raises(RuntimeError, match="subscript i is repeated for operand 0 but the sizes don't match"):
        stax.einsum("ii->i", stax.randn(3, 4))
    with pytest.raises(RuntimeError, match="number of subscripts"):
        stax.einsum("ij,jk->ik", stax.randn(3), stax.randn(3, 3))


def test_outer_sort_topk_scans(rng):
    A = rng.standard_normal((4, 9)).round(1)          # rounding makes ties
    A[2, 3] = np.nan
    V = rng.standard_normal(5)
    a, v = stax.tensor(A, dtype=stax.float32), stax.tensor(V, dtype=stax.float32)
    A, V = f64(a), f64(v)
    A_nan = np.isnan(A)

    def fn(a, v):
        s = stax.sort(a, 1)
        sd = a.sort(dim=1, descending=True)
        t = stax.topk(a, 3, dim=1)
        tl = a.topk(2, dim=0, largest=False)
        return (stax.outer(v, v), s.values, s.indices, sd.values, sd.indices, t.values, t.indices, tl.values,
                stax.argsort(a, 0), stax.cumprod(a * 0.5 + 1, 1), stax.logcumsumexp(a, 1), stax.cumsum(a, 0))
    order = np.argsort(A, 1, kind="stable")
    n = A.shape[1]
    dorder = np.flip(n - 1 - np.argsort(np.flip(A, 1), 1, kind="stable"), 1)
    lorder = np.argsort(A, 0, kind="stable")
    with np.errstate(invalid="ignore"):
        scans = (np.cumprod(A * 0.5 + 1, 1), np.logaddexp.accumulate(A, 1), np.cumsum(A, 0))
    refs = (np.outer(V, V), np.take_along_axis(A, order, 1), order, np.take_along_axis(A, dorder, 1), dorder,
            np.take_along_axis(A, dorder, 1)[:, :3], dorder[:, :3], np.take_along_axis(A, lorder, 0)[:2], lorder,
            *scans)
    assert A_nan.any()
    check(fn, [a, v], refs)
    with pytest.raises(RuntimeError, match="out of range"):
        stax.topk(a, 10)


# ---- factories, methods, autograd stand-ins, aliases ----


def test_factories_and_methods(rng):
    x = stax.tensor(rng.standard_normal((3, 4)), dtype=stax.float32)
    assert stax.zeros_like(x, dtype=stax.int64).dtype is stax.int64
    assert stax.ones_like(x).numpy().sum() == 12 and stax.full_like(x, 2.5, dtype=stax.float64).dtype is stax.float64
    assert stax.empty_like(x).shape == (3, 4) and stax.rand_like(x).dtype is stax.float32
    assert stax.randn_like(x, dtype=stax.float64).dtype is stax.float64
    r = stax.randint(3, 9, (200,))
    assert r.dtype is stax.int64 and r.numpy().min() >= 3 and r.numpy().max() < 9
    assert stax.randint(5, (2, 2)).shape == (2, 2)
    assert x.type_as(r).dtype is stax.int64 and x.detach()._storage is x._storage and not x.detach().requires_grad
    assert x.new_zeros(2, 3).dtype is stax.float32 and x.new_ones((2,)).numpy().tolist() == [1, 1]
    assert x.new_full((2,), 7).numpy().tolist() == [7, 7] and x.new_empty(5).shape == (5,)
    assert x.squeeze((0, 1)).shape == (3, 4) and stax.ones(1, 3, 1).squeeze((0, 2)).shape == (3,)
    with stax.no_grad():
        y = x * 2

    @stax.no_grad()
    def g(t):
        return t + 1
    assert_close(g(y), f64(x) * 2 + 1, stax.float32)
    assert x.sum(axis=0).shape == (4,) and stax.amax(x, axis=1, keepdims=True).shape == (3, 1)
    with pytest.raises(TypeError, match="alias axis="):
        x.sum(dim=0, axis=1)
    cond = stax.tensor([[True, False], [False, True]])
    rows, cols = stax.where(cond)
    assert rows.numpy().tolist() == [0, 1] and cols.numpy().tolist() == [0, 1]
    assert stax.allclose(x, x + 1e-7) and not stax.allclose(x, x + 1)


# ---- int8, uint8, int16 ----


def _small_int_fn(a, b):
    return (a + a, b + b, a + b, (a + a) > 0, a.sum(), b.amax(), b.amin(), a.amax(), (a * a) // 3,
            a.float() / 2, b - 1, -a, b.short() * 300, stax.where(b > 100, b, a.byte()))


def test_small_int_dtypes_wrap_as_eager(rng):
    """int8/uint8 arithmetic wraps in the dtype (C++ computes in int: every result is cast back);
    uint8 with int8 promotes to int16; max/min identities respect the unsigned range."""
    A = rng.integers(-128, 128, 37).astype(np.int8)
    B = rng.integers(0, 256, 37).astype(np.uint8)
    A[:3], B[:3] = [-128, 127, 100], [255, 0, 200]
    a, b = stax.tensor(A), stax.tensor(B)
    assert (a.dtype, b.dtype, (a + b).dtype, (a + 1).dtype) == (stax.int8, stax.uint8, stax.int16, stax.int8)
    with np.errstate(over="ignore"):
        refs = (A + A, B + B, A.astype(np.int16) + B, (A + A) > 0, A.astype(np.int64).sum(), B.max(), B.min(),
                A.max(), (A * A) // 3, A / 2, B - np.uint8(1), -A, B.astype(np.int16) * 300,
                np.where(B > 100, B, A.astype(np.uint8)))
    check(_small_int_fn, [a, b], refs, compiled=True)
    out = stax.compile(_small_int_fn)(a.to("cuda"), b.to("cuda"))     # the Triton back end
    for k, (o, r) in enumerate(zip(out, refs)):
        assert_close(o.cpu(), r, o.dtype, msg=f"triton output {k}")
    assert stax.tensor(np.array([1, 2], np.uint8)).dtype is stax.uint8


# ---- the Triton back end ----


def test_ops_on_triton(rng):
    A, B = rng.standard_normal((6, 11)), rng.standard_normal((6, 11))
    a, b = stax.tensor(A, dtype=stax.float32), stax.tensor(B, dtype=stax.float32)
    A, B = f64(a), f64(b)

    def fn(a, b):
        return (stax.atan2(a, b), stax.fmod(a, b), stax.flip(a, 1), stax.tril(a, 1), stax.roll(a, 3, 1),
                stax.sort(a, 1).values, stax.lerp(a, b, 0.3), stax.any(a > 1.5, 1))
    out = stax.compile(fn)(a.to("cuda"), b.to("cuda"))
    refs = (np.arctan2(A, B), np.fmod(A, B), A[:, ::-1], np.tril(A, 1), np.roll(A, 3, 1), np.sort(A, 1),
            A + 0.3 * (B - A), (A > 1.5).any(1))
    for k, (o, r) in enumerate(zip(out, refs)):
        assert o.device == "cuda"
        assert_close(o.cpu(), r, o.dtype, msg=f"output {k}")


# ---- discovery (issue 11 item 4) ----


def test_dir_lists_only_the_public_api():
    names = dir(stax)
    for private in ("os", "sys", "builtins", "np", "math", "dis", "threading", "types", "warnings"):
        assert private not in names
    for public in ("compile", "tensor", "einsum", "lerp", "float32", "no_grad", "nn", "Tensor"):
        assert public in names


def test_missing_op_names_the_spelling_that_works():
    with pytest.raises(AttributeError, match="no attribute 'index_fill'"):
        stax.index_fill
    with pytest.raises(AttributeError, match="stax.clamp"):
        stax.hardtanh
    with pytest.raises(AttributeError, match="x.reshape"):
        stax.randn(2).resize_


def test_ops_md_is_current():
    """docs/OPS.md is what tools/ops_md.py writes from the package now."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "ops_md.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_repeat_interleave_with_tensor_counts(rng):
    """Counts in a tensor: an output size that depends on the data (a fallback index kernel with
    an unbacked size, then a fused index_select); one count for all; PyTorch's errors."""
    X = rng.standard_normal((3, 4))
    x, r = stax.tensor(X, dtype=stax.float32), stax.tensor([2, 0, 3])
    X = f64(x)
    check(lambda x, r: (stax.repeat_interleave(x, r, dim=0) * 2, x.t().repeat_interleave(r, dim=1),
                        stax.repeat_interleave(x[:, 1], stax.tensor([2]))),
          [x, r], (np.repeat(X, [2, 0, 3], 0) * 2, np.repeat(X.T, [2, 0, 3], 1), np.repeat(X[:, 1], 2)))
    f = stax.compile(lambda x, r: stax.repeat_interleave(x, r, dim=0))
    assert f(x, stax.tensor([1, 1, 5])).shape == (7, 4)
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        f(x, stax.tensor([1, -1, 5]))
    with pytest.raises(RuntimeError, match="repeats must have the same size as input along dim"):
        stax.repeat_interleave(x, stax.tensor([1, 2]), dim=0)


def test_scans_take_axis(rng):
    X = rng.standard_normal((3, 5))
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)
    check(lambda x: (stax.cumsum(x, axis=1), x.cumprod(axis=0), stax.logcumsumexp(x, axis=-1),
                     stax.cummax(x, axis=0).values),
          [x], (np.cumsum(X, 1), np.cumprod(X, 0), np.logaddexp.accumulate(X, 1), np.maximum.accumulate(X, 0)))
    y = x.clone()
    stax.compile(lambda y: y.cumsum_(axis=1))(y)            # in place, through the scan kernel
    assert_close(y, np.cumsum(X, 1), stax.float32)
