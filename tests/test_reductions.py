"""Reductions in every layout on the CPU (§6.5, §8; issue 12): every reduction op over every subset
of dims of 2-D, 3-D and 4-D inputs, contiguous and permuted, odd sizes, NaN and half types, against
float64 numpy (conftest.assert_close's tolerances); the column kernel form that reductions over
outer, middle and several non-adjacent dims take; var's accuracy in that form; prologue and
epilogue fusion into it.

Each case compiles ONE function that returns every (op, dims) of its input, so a case costs one
C++ build: the matrix stays fast (seeded; 4-D subsets sampled).
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import stax
from conftest import assert_close

OPS = ("sum", "mean", "amax", "amin", "prod", "var", "std", "logsumexp")     # over any dims
ARG_OPS = ("argmax", "argmin")                                              # over one dim


def _ref(op, X, dims):
    """float64 numpy reference of `op` over `dims` (a tuple) of X."""
    if op == "sum":
        return X.sum(dims)
    if op == "mean":
        return X.mean(dims)
    if op in ("amax", "amin"):
        return (X.max if op == "amax" else X.min)(dims)
    if op == "prod":
        return (1 + 0.1 * X).prod(dims)
    if op in ("var", "std"):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)      # one element: nan, as eager
            v = X.var(dims, ddof=1)
        return v if op == "var" else np.sqrt(v)
    if op == "logsumexp":
        m = X.max(dims, keepdims=True)
        m = np.where(np.isinf(m), 0, m)
        return np.squeeze(np.log(np.exp(X - m).sum(dims, keepdims=True)) + m, dims)
    return (X.argmax if op == "argmax" else X.argmin)(dims[0])


def _stax(op, x, dims):
    if op == "prod":
        return (1 + 0.1 * x).prod(dims) if len(dims) == 1 else \
            _prod_dims(1 + 0.1 * x, dims)
    if op in ARG_OPS:
        return getattr(x, op)(dims[0])
    return getattr(x, op)(dims) if op != "logsumexp" else stax.logsumexp(x, dims)


def _prod_dims(y, dims):
    """prod takes one dim (as torch's): several dims, one after the other (highest first)."""
    for d in sorted(dims, reverse=True):
        y = y.prod(d)
    return y


def _combos(ndim, rng, sample=None):
    subsets = [s for k in range(1, ndim + 1) for s in itertools.combinations(range(ndim), k)]
    if sample is not None and len(subsets) > sample:
        keep = rng.choice(len(subsets), sample, replace=False)
        subsets = [subsets[i] for i in sorted(keep)]
    combos = [(op, s) for s in subsets for op in OPS]
    return combos + [(op, (d,)) for d in range(ndim) for op in ARG_OPS]


CASES = [   # (shape, permutation applied inside the function or None, dtype, NaNs, sampled subsets)
    ((7, 1000), None, "float32", False, None),
    ((1000, 7), None, "float32", False, None),
    ((33, 48), (1, 0), "float32", False, None),
    ((5, 37, 64), None, "float32", False, None),
    ((1, 7, 13), None, "float32", False, None),
    ((6, 40, 9), (2, 0, 1), "float32", False, None),
    ((3, 5, 7, 36), None, "float32", False, 8),
    ((4, 1, 9, 20), (0, 3, 2, 1), "float32", False, 8),
    ((9, 65, 17), None, "float32", True, None),
    ((5, 48, 24), None, "float16", False, None),
    ((2, 6, 5, 32), (1, 0, 3, 2), "bfloat16", False, 6),
]


@pytest.mark.parametrize("shape,perm,dtype,nans,sample", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_every_reduction_in_every_layout(rng, shape, perm, dtype, nans, sample):
    a = rng.uniform(-2.0, 2.0, shape)
    if nans:
        a.flat[rng.choice(a.size, 5, replace=False)] = np.nan
    x = stax.tensor(a).to(getattr(stax, dtype))
    X = np.asarray(x.float()).astype(np.float64)
    if perm is not None:
        X = X.transpose(perm)
    combos = _combos(X.ndim, rng, sample)
    if dtype != "float32":    # prod over several dims rounds to the half type between the dims
        combos = [(op, d) for op, d in combos if op != "prod" or len(d) == 1]

    def f(x):
        y = x.permute(perm) if perm is not None else x
        return [_stax(op, y, dims) for op, dims in combos]

    got = stax.compile(f)(x)
    for (op, dims), g in zip(combos, got):
        want = _ref(op, X, dims)
        tol = "int64" if op in ARG_OPS else dtype
        assert_close(np.asarray(g.float() if tol != "int64" else g), want, tol, msg=f"{op} over {dims}")


def _kernels(fn, *args):
    return list(stax.generate(fn, *args).kernels.values())


def test_column_sum_kernel_form(rng):
    """x.sum(0): lanes own output columns (the innermost simd loop runs along them), the
    reduction loop outside, no lanes to combine; parallel over column blocks."""
    x = stax.tensor(rng.standard_normal((4096, 512), dtype=np.float32))
    (src,) = _kernels(lambda x: x.sum(0), x)
    assert "x0_block" in src and "for (int64_t r0 = 0; r0 < 4096; r0++)" in src
    assert "#pragma omp parallel for" in src and "acc_buf0[l] = acc_buf0[l] + tmp0;" in src
    assert src.index("r0 < 4096") < src.index("#pragma omp simd")


def test_row_sum_keeps_the_row_form(rng):
    x = stax.tensor(rng.standard_normal((64, 48), dtype=np.float32))
    (src,) = _kernels(lambda x: x.sum(1), x)
    assert "_block" not in src and "r0_lane0" in src


def test_prologue_and_epilogue_fuse_into_the_column_kernel(rng):
    a = rng.standard_normal((300, 130))
    x = stax.tensor(a.astype(np.float32))

    def f(x):
        m = x.mean(0, keepdim=True)
        return (x.relu() * 2).sum(0).sqrt() + 1, (x - m).abs().amax(0)
    cf = stax.compile(f)
    s, spread = cf(x)
    assert len(cf.last_generated.kernels) == 1, list(cf.last_generated.kernels.values())
    assert_close(np.asarray(s), np.sqrt((np.maximum(a, 0) * 2).sum(0)) + 1, "float32")
    assert_close(np.asarray(spread), np.abs(a - a.mean(0, keepdims=True)).max(0), "float32")


def test_batch_norm_statistics_nchw(rng):
    a = rng.standard_normal((8, 12, 15, 15)) * 3 + 5
    x = stax.tensor(a.astype(np.float32))
    cf = stax.compile(lambda x: (x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)))
    mean, var = cf(x)
    assert len(cf.last_generated.kernels) == 1
    assert_close(np.asarray(mean), a.mean((0, 2, 3)), "float32")
    assert_close(np.asarray(var), a.var((0, 2, 3)), "float32")


def test_column_var_is_as_accurate_as_the_row_var(rng):
    """Two passes (mean, then squared deviations) in the column form too: a large offset costs
    no more accuracy than in the row form."""
    a = 1e4 + rng.standard_normal((4099, 67))
    x = stax.tensor(a.astype(np.float32))
    X = np.asarray(x).astype(np.float64)
    col = np.asarray(stax.compile(lambda x: x.var(0))(x)).astype(np.float64)
    row = np.asarray(stax.compile(lambda x: x.t().contiguous().var(1))(x)).astype(np.float64)
    want = X.var(0, ddof=1)
    err_col, err_row = np.abs(col - want).max(), np.abs(row - want).max()
    assert err_col <= 4 * err_row + 1e-4, (err_col, err_row)
    assert_close(col, want, "float32", rtol=1e-3)


@pytest.mark.parametrize("shape", [(1, 40000), (3, 20000), (40000, 3), (2, 3, 40000)])
def test_few_outputs_and_long_reductions(rng, shape):
    """Few output columns (fewer blocks than threads) and long reductions (Alg. 6.1's split)."""
    a = rng.standard_normal(shape).astype(np.float32)
    x = stax.tensor(a)
    got = stax.compile(lambda x: (x.sum(0), x.amax(0), x.mean(-1), x.var(0)))(x)
    A = a.astype(np.float64)
    for g, w in zip(got, (A.sum(0), A.max(0), A.mean(-1), A.var(0, ddof=1) if shape[0] > 1 else None)):
        if w is not None:
            assert_close(np.asarray(g), w, "float32", rtol=1e-3)


# ---- var's deviations in pieces read once (lower.chunk_deviations) ----


@pytest.mark.parametrize("shape,dims", [((1001, 37), (0,)), ((3, 70001), (1,)), ((20, 3, 60, 60), (0, 2, 3))])
def test_var_in_pieces_is_read_once_and_accurate(rng, shape, dims):
    """Columns longer than a piece (128 rows; 1001 = 7 pieces of 126 and one of 119), rows longer
    than 64K and (N, H, W) statistics (a piece per image): the deviations run in pieces, each read
    once, combined by Chan's formula. Data with a
    large mean (1e4 + randn) against float64 numpy: the per-piece shift keeps the float32 sums of
    the pieces accurate (a plain float32 column sum of 1e4's is off by ~1e-4 relative)."""
    a = (1e4 + rng.standard_normal(shape)).astype(np.float32)
    A = a.astype(np.float64)
    cf = stax.compile(lambda x: (x.var(dims), x.mean(dims), x.std(dims, unbiased=False)))
    var, mean, std = cf(stax.tensor(a))
    assert_close(np.asarray(var), A.var(dims, ddof=1), "float32", rtol=2e-5)
    assert_close(np.asarray(mean), A.mean(dims), "float32")
    assert_close(np.asarray(std), A.std(dims), "float32", rtol=2e-5)
    kernels = list(cf.last_generated.kernels.values())
    assert len(kernels) == 2, kernels    # the pieces (sums and deviations), then the combine


def test_var_in_pieces_nan_inf_and_odd_sizes(rng):
    a = rng.standard_normal((300, 7)).astype(np.float32) + 50
    a[17, 1], a[299, 2], a[5, 3], a[6, 3] = np.nan, np.inf, np.inf, -np.inf
    got = stax.compile(lambda x: x.var(0))(stax.tensor(a))
    with np.errstate(invalid="ignore"):
        want = a.astype(np.float64).var(0, ddof=1)
    assert_close(np.asarray(got), want, "float32")
    assert np.isnan(np.asarray(got)[[1, 2, 3]]).all()
    one = stax.compile(lambda x: x.var(0))(stax.tensor(a[:129, :1]))    # 129 rows: two pieces, one output
    assert_close(np.asarray(one), a[:129, :1].astype(np.float64).var(0, ddof=1), "float32")


def test_few_columns_split_across_the_reduction(rng):
    """Three output columns, 40000 rows: one block of columns would leave a thread idle, so the rows
    are split (codegen_cpp.outer_split_policy) and the pieces run in parallel, then combine."""
    a = rng.standard_normal((40000, 3)).astype(np.float32)
    cf = stax.compile(lambda x: (x.sum(0), x.amax(0)))
    s, m = cf(stax.tensor(a))
    kernels = list(cf.last_generated.kernels.values())
    assert len(kernels) == 2 and "#pragma omp parallel for" in kernels[0], kernels
    assert_close(np.asarray(s), a.astype(np.float64).sum(0), "float32", rtol=1e-4)
    assert_close(np.asarray(m), a.max(0), "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_var_in_pieces_half_permuted_keepdim(rng, dtype):
    """Half inputs (computed in float32), a permuted view and keepdim: the pieces see the same
    values the two-pass form saw."""
    a = rng.standard_normal((300, 37)) * 2 + 3
    x = stax.tensor(a).to(getattr(stax, dtype))
    X = np.asarray(x.float()).astype(np.float64)
    cf = stax.compile(lambda x: (x.t().var(1, keepdim=True), x.t().std(1, correction=0), x.t().mean(1)))
    v, s, m = cf(x)
    assert len(cf.last_generated.kernels) == 2, list(cf.last_generated.kernels.values())
    assert tuple(v.shape) == (37, 1)
    assert_close(np.asarray(v.float()), X.T.var(1, ddof=1, keepdims=True), dtype)
    assert_close(np.asarray(s.float()), X.T.std(1), dtype)
    assert_close(np.asarray(m.float()), X.T.mean(1), dtype)
