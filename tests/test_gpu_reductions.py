"""Reductions in every layout on the GPU (§9.4, issue 12): every op over every subset of dims.

Each reduction op (sum mean amax amin prod var std argmax argmin logsumexp) over subsets of the
dims of 2-D, 3-D and 4-D inputs, contiguous and permuted, odd sizes, NaNs and half types, against
float64 numpy. The cases are a seeded sample of that product (the whole of it would take minutes
in Triton's interpreter), plus fixed cases for each OUTER form: persistent, looped, split.
"""
import itertools
import math
import random

import numpy as np
import pytest

import stax
from conftest import assert_close

OPS = ["sum", "mean", "amax", "amin", "prod", "var", "std", "argmax", "argmin", "logsumexp"]
SHAPES = [(37, 19), (70, 3), (5, 33, 7), (9, 4, 66), (3, 6, 5, 9), (2, 7, 3, 65)]


def _ref(op, a, dims):
    """float64 numpy; dims is a tuple of axes (one axis for argmax/argmin)."""
    if op == "sum":
        return a.sum(axis=dims)
    if op == "mean":
        return a.mean(axis=dims)
    if op == "amax":
        return a.max(axis=dims)
    if op == "amin":
        return a.min(axis=dims)
    if op == "prod":
        return a.prod(axis=dims)
    if op in ("var", "std"):
        v = a.var(axis=dims, ddof=1)
        return v if op == "var" else np.sqrt(v)
    if op in ("argmax", "argmin"):
        return (np.argmax if op == "argmax" else np.argmin)(a, axis=dims[0])
    m = a.max(axis=dims, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(a - m).sum(axis=dims, keepdims=True)) + m).squeeze(axis=dims)


def _call(op, x, dims):
    if op in ("argmax", "argmin"):
        return getattr(x, op)(dims[0])
    if op == "logsumexp":
        return stax.logsumexp(x, dims)
    return getattr(x, op)(dims)


def _input(shape, perm, op, dtype, nan, rng):
    base = rng.standard_normal([shape[p] for p in np.argsort(perm)] if perm else list(shape))
    if op == "prod":
        base = 1 + 0.05 * base           # a product of many randn values under- or overflows
    if nan:
        base.flat[rng.integers(0, base.size, 2)] = np.nan
    t = stax.tensor(base.astype(np.float32))
    return t if dtype == "float32" else t.to(getattr(stax, dtype))


def _check(op, shape, dims, perm=None, dtype="float32", nan=False, seed=0):
    """`op` over `dims` of a `shape` tensor: a contiguous input, or (perm) a permuted view of one
    taken inside the compiled function (a device copy would make it contiguous again)."""
    rng = np.random.default_rng(seed)
    base = _input(shape, perm, op, dtype, nan, rng)
    x = base.permute(*perm) if perm else base
    assert tuple(x.shape) == tuple(shape)
    cf = stax.compile(lambda t: _call(op, t.permute(*perm) if perm else t, dims))
    out = cf(base.to("cuda")).cpu()
    a = np.asarray(x.float().numpy(), np.float64)
    ref = _ref(op, a, dims)
    count = math.prod(shape[d] for d in dims)
    what = f"{op} over {dims} of {shape} perm={perm} {dtype} nan={nan}\n{cf.last_generated}"
    if op in ("argmax", "argmin"):
        if nan or dtype != "float32":    # NaN and ties: compare with eager, which follows torch
            ref = _call(op, x, dims).numpy()
        assert_close(out, ref, stax.int64, msg=what)
        return cf.last_generated
    rtol = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    atol = rtol * 0.1 * math.sqrt(count) * (2 if op in ("var", "std") else 1)
    out = out.float() if dtype == "bfloat16" else out      # (stax's numpy() has no bfloat16)
    assert_close(out, ref.astype(np.float64), getattr(stax, dtype), rtol=rtol, atol=atol, msg=what)
    return cf.last_generated


def _all_cases():
    cases = []
    for shape, op in itertools.product(SHAPES, OPS):
        n = len(shape)
        subsets = [(d,) for d in range(n)] if op in ("argmax", "argmin") else [
            s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]
        cases += [(op, shape, s) for s in subsets]
    return cases


def _sample(k, seed):
    rng = random.Random(seed)
    cases = _all_cases()
    out = []
    for op, shape, dims in rng.sample(cases, k):
        perm = tuple(rng.sample(range(len(shape)), len(shape))) if rng.random() < 0.4 else None
        dtype = rng.choice(["float32"] * 4 + ["float16", "bfloat16"])
        out.append((op, shape, dims, perm, dtype, rng.random() < 0.15))
    return out


@pytest.mark.parametrize("op,shape,dims,perm,dtype,nan", _sample(48, 12))
def test_sampled_reduction(op, shape, dims, perm, dtype, nan):
    _check(op, shape, dims, perm, dtype, nan)


@pytest.mark.parametrize("op", OPS)
def test_every_op_over_dim_0(op):
    """Each op over the outer dim of a contiguous matrix: the OUTER form (looped, 300 rows)."""
    gen = _check(op, (300, 40), (0,), seed=1)
    assert "ReductionHint.OUTER" in "".join(gen.kernels.values())


# ---- the three OUTER forms (§9.4) ----


def _texts(gen):
    return list(gen.kernels.values())


def test_outer_persistent_form():
    gen = _check("sum", (48, 200), (0,))
    (text,) = _texts(gen)
    assert "triton_per_fused_0" in text and "ReductionHint.OUTER" in text
    assert "xindex = xoffset + tl.arange(0, XBLOCK)[None, :]" in text
    assert "r0_index = tl.arange(0, R0_BLOCK)[:, None]" in text
    assert "tl.sum(tmp2, 0)[None, :]" in text and "R0_BLOCK: tl.constexpr = 64" in text


def test_outer_looped_form():
    gen = _check("sum", (1000, 96), (0,))
    (text,) = _texts(gen)
    assert "triton_red_fused_0" in text and "tl.full([R0_BLOCK, XBLOCK], 0, tl.float32)" in text
    assert "tl.load(in_ptr0 + (96*r0_1 + x0), r0_mask & xmask" in text


def test_outer_split_form(monkeypatch):
    """Too few outputs for the SMs: the partials laid out [splits, outputs], combined by the last
    split of each column block in the same kernel (§6.5); STAX_SPLIT_ONE_KERNEL=0: two OUTER kernels."""
    gen = _check("sum", (2048, 160), (0,))
    (text,) = _texts(gen)
    assert "triton_red_fused_0" in text and "x1 = xindex % 160" in text
    assert "tl.store(in_out_ptr0 + (160*x0 + x1)" in text and "triton_helpers.last_arrival(" in text
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", "0")
    gen = _check("sum", (2048, 160), (0,))
    first, second = _texts(gen)
    assert "triton_red_fused_0" in first and "tl.store(out_ptr0 + (160*x0 + x1)" in first
    assert "triton_per_fused_1" in second and "ReductionHint.OUTER" in second


def test_middle_dim_keeps_the_contiguous_output_dim_fast():
    gen = _check("amax", (6, 300, 24), (1,))
    (text,) = _texts(gen)
    assert "ReductionHint.OUTER" in text and "x1 = xindex % 24" in text


def test_permuted_input_puts_the_contiguous_dim_innermost():
    """x.permute(2, 0, 1).sum(2): the output dim of stride 1 is the outer one; XBLOCK runs along it."""
    gen = _check("sum", (24, 5, 70), (2,), perm=(2, 0, 1))
    text = "".join(_texts(gen))
    assert "ReductionHint.OUTER" in text and "x1 = xindex % 24" in text


def test_several_nonadjacent_dims():
    _check("mean", (7, 33, 9, 40), (0, 2))
    _check("var", (7, 33, 9, 40), (0, 2))


def test_prologue_and_epilogue_fuse_into_one_outer_kernel():
    x = stax.randn(300, 48)
    cf = stax.compile(lambda t: (t * 2 + 1).sum(0).sqrt() * 3 + 1)
    out = cf(x.to("cuda")).cpu()
    a = np.asarray(x.numpy(), np.float64)
    assert_close(out, np.sqrt((a * 2 + 1).sum(0)) * 3 + 1, stax.float32)
    assert len(cf.last_generated.kernels) == 1
    assert "ReductionHint.OUTER" in _texts(cf.last_generated)[0]


def test_var_outer_is_as_accurate_as_rows():
    """A large mean and a small spread: the two-pass form keeps var accurate along columns too."""
    base = np.random.default_rng(3).standard_normal((500, 40)) * 1e-2 + 1e3
    x = stax.tensor(base.astype(np.float32))
    out = stax.compile(lambda t: t.var(0))(x.to("cuda")).cpu()
    rows = stax.compile(lambda t: t.var(1))(x.t().contiguous().to("cuda")).cpu()
    ref = np.asarray(x.numpy(), np.float64).var(0, ddof=1)
    assert_close(out, ref, stax.float32, rtol=2e-3)
    assert_close(out, rows.numpy(), stax.float32, rtol=2e-3)


def test_nan_in_a_column():
    for op in ("sum", "amax", "amin", "argmax"):
        _check(op, (300, 33), (0,), nan=True, seed=5)


# ---- var's deviations in pieces read once (lower.chunk_deviations) ----


def test_var_in_pieces_outer_and_inner():
    """var over dim 0 (OUTER, pieces of 64 rows held in registers: a persistent first kernel) and
    batch-norm statistics longer than 32768 (INNER, pieces of whole images), on data with a large mean
    against float64 numpy."""
    rng = np.random.default_rng(7)
    a = (1e4 + rng.standard_normal((257, 33))).astype(np.float32)      # 5 pieces: 52 rows, the last 49
    cf = stax.compile(lambda t: (t.var(0), t.mean(0)))
    var, mean = cf(stax.tensor(a).to("cuda"))
    A = a.astype(np.float64)
    assert_close(var.cpu(), A.var(0, ddof=1), stax.float32, rtol=2e-5)
    assert_close(mean.cpu(), A.mean(0), stax.float32)
    texts = _texts(cf.last_generated)
    # (the pieces and their combine: one kernel, §6.5)
    assert len(texts) == 1 and "triton_per_fused_0" in texts[0] and "ReductionHint.OUTER" in texts[0]
    assert "triton_helpers.last_arrival(" in texts[0]
    b = (5 + 3 * rng.standard_normal((8, 3, 65, 65))).astype(np.float32)    # 8 pieces of 65 x 65
    cf = stax.compile(lambda t: (t.mean((0, 2, 3)), t.var((0, 2, 3), unbiased=False)))
    mean, var = cf(stax.tensor(b).to("cuda"))
    B = b.astype(np.float64)
    assert_close(mean.cpu(), B.mean((0, 2, 3)), stax.float32)
    assert_close(var.cpu(), B.var((0, 2, 3)), stax.float32, rtol=2e-5)
    texts = _texts(cf.last_generated)       # (a multi-pass row: both forms of the pieces' kernel)
    assert cf.last_generated.wrapper.count(".run(") == 2 and "triton_per_fused_0" in texts[0], texts
