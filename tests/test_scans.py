"""Scans (issue 11): cumsum, cumprod, logcumsumexp lowered as an ir.Scan, not a fallback kernel.

Against float64 numpy on fresh random inputs, compiled on the CPU (a sequential loop along the dim:
bit for bit eager's numpy for sums and products) and through the Triton interpreter (an
associative_scan, persistent and looped with a carry); every dim, size 0 and 1, non-contiguous
inputs, NaN/inf, int/bool -> int64 and `dtype=`, half types; fusion by kernel count; goldens
(`--regen-goldens` rewrites tests/golden/cumsum.cpp and cumsum.py).
"""
from pathlib import Path

import numpy as np
import pytest

import stax
from conftest import assert_close

GOLDEN = Path(__file__).parent / "golden"

REF = {"cumsum": lambda a, d: np.cumsum(a, d), "cumprod": lambda a, d: np.cumprod(a, d),
       "logcumsumexp": lambda a, d: np.logaddexp.accumulate(a, d)}
PROLOGUE = {"cumsum": (lambda x: x * 2 - 1, lambda a: a * 2 - 1),
            "cumprod": (lambda x: x * 0.01 + 1, lambda a: a * 0.01 + 1),
            "logcumsumexp": (lambda x: x * 2 - 1, lambda a: a * 2 - 1)}


def _f64(t):
    return np.asarray(t.float().numpy(), np.float64)


def _fn(op, dim):
    pro, _ = PROLOGUE[op]
    return lambda x: getattr(stax, op)(pro(x), dim)


def _ref(op, a, dim):
    b = PROLOGUE[op][1](a)
    return REF[op](b, dim) if b.ndim else b       # a 0-d scan is its element


def _kernels(fn, *args, device="cpu"):
    gen = stax.generate(fn, *args, device=device)
    return list(gen.kernels), gen


CASES = [((1000,), 0), ((7, 1000), 1), ((7, 1000), 0), ((3, 5, 7), 1), ((3, 5, 7), -1),
         ((4, 1, 6), 1), ((0, 5), 1), ((5, 0), 1), ((1,), 0), ((), 0)]


# ---- the CPU: a loop along the dim, threads and SIMD lanes across the others ----


@pytest.mark.parametrize("op", list(REF))
@pytest.mark.parametrize("shape,dim", CASES)
def test_scan_cpu_against_numpy(op, shape, dim, rng):
    a = rng.standard_normal(shape).astype(np.float32)
    out = stax.compile(_fn(op, dim))(stax.from_numpy(a))
    assert out.dtype is stax.float32 and tuple(out.shape) == shape
    assert_close(out, _ref(op, a.astype(np.float64), dim), stax.float32)
    if op != "logcumsumexp":        # the same order of float operations as eager's numpy
        b = stax.from_numpy(np.asarray(PROLOGUE[op][1](a), np.float32))
        scan = lambda x: getattr(stax, op)(x, dim)
        assert np.array_equal(stax.compile(scan)(b).numpy(), scan(b).numpy())


def test_scan_is_one_kernel_with_prologue_and_epilogue(rng):
    x = stax.from_numpy(rng.standard_normal((7, 1000)).astype(np.float32))
    names, gen = _kernels(lambda x: stax.cumsum(x * 2, -1) + 1, x)
    assert names == ["cpp_fused_0"] and "extern_kernel" not in gen.wrapper
    src = gen.kernels["cpp_fused_0"]
    assert "acc_buf0 = acc_buf0 + " in src            # the running value, in index order
    # along an outer dim: column blocks, one SIMD lane per column; the epilogue a kernel of its own
    names, gen = _kernels(lambda x: stax.cumsum(x * 2, 0), x)
    assert names == ["cpp_fused_0"] and "#pragma omp simd" in gen.kernels["cpp_fused_0"]
    assert "acc_buf0[l]" in gen.kernels["cpp_fused_0"]


def test_scan_dtypes(rng):
    i = rng.integers(-50, 50, (6, 9)).astype(np.int32)
    b = rng.random((6, 9)) < 0.5
    i8 = rng.integers(-100, 100, (300,)).astype(np.int8)
    f = stax.compile(lambda i, b, i8: (stax.cumsum(i, 1), stax.cumsum(b, 0), i8.cumsum(0),
                                       stax.cumprod(i % 3 + 1, 1), stax.cumsum(i, 0, dtype=stax.float64),
                                       stax.cumsum(b, 1, dtype=stax.float32)))
    outs = f(stax.from_numpy(i), stax.from_numpy(b), stax.from_numpy(i8))
    refs = (np.cumsum(i, 1), np.cumsum(b, 0), np.cumsum(i8.astype(np.int64)), np.cumprod(i % 3 + 1, 1),
            np.cumsum(i.astype(np.float64), 0), np.cumsum(b, 1).astype(np.float32))
    dtypes = (stax.int64, stax.int64, stax.int64, stax.int64, stax.float64, stax.float32)
    for o, r, dt in zip(outs, refs, dtypes):
        assert o.dtype is dt
        np.testing.assert_array_equal(o.numpy(), r)
    with pytest.raises(RuntimeError, match="logcumsumexp"):
        stax.compile(lambda i: stax.logcumsumexp(i, 0))(stax.from_numpy(i))


@pytest.mark.parametrize("dtype", [stax.float16, stax.bfloat16])
def test_scan_half_types_compute_in_float32(dtype, rng):
    a = rng.standard_normal((5, 300)).astype(np.float32)
    x, y = stax.from_numpy(a).to(dtype), stax.from_numpy(a * 0.01 + 1).to(dtype)
    f = lambda x, y: (stax.cumsum(x, 1) * 2, stax.logcumsumexp(x, 0), stax.cumprod(y, 1))
    outs, eager = stax.compile(f)(x, y), f(x, y)
    xa, ya = _f64(x), _f64(y)
    refs = (np.cumsum(xa, 1) * 2, np.logaddexp.accumulate(xa, 0), np.cumprod(ya, 1))
    for o, e, r in zip(outs, eager, refs):
        assert o.dtype is dtype
        assert_close(o.float(), r, dtype)
        assert_close(o.float(), _f64(e), dtype)


def test_scan_nan_inf_as_eager(rng):
    a = rng.standard_normal((4, 50)).astype(np.float32)
    a[0, 3], a[1, 10], a[2, 0], a[3, 7], a[3, 20] = np.nan, np.inf, -np.inf, np.inf, -np.inf
    f = lambda x: (stax.cumsum(x, 1), stax.cumprod(x, 1), stax.logcumsumexp(x, 1), stax.logcumsumexp(x, 0))
    x = stax.from_numpy(a)
    for o, e in zip(stax.compile(f)(x), f(x)):
        np.testing.assert_array_equal(np.isnan(o.numpy()), np.isnan(e.numpy()))
        np.testing.assert_allclose(o.numpy(), e.numpy(), rtol=1e-6, equal_nan=True)
    ninf = stax.full((3, 4), float("-inf"))
    assert np.all(stax.compile(lambda x: stax.logcumsumexp(x, 1))(ninf).numpy() == -np.inf)


def test_scan_non_contiguous_inputs(rng):
    a = rng.standard_normal((40, 30)).astype(np.float32)
    x = stax.from_numpy(a)
    f = lambda x: (stax.cumsum(x.t(), 1), stax.cumsum(x[::3, 1::2], 0), stax.cumprod(x[:, 5] * 0.1 + 1, 0),
                   stax.cumsum(x.unsqueeze(1).expand(40, 3, 30), 1))
    refs = (np.cumsum(a.T, 1), np.cumsum(a[::3, 1::2], 0), np.cumprod(a[:, 5] * 0.1 + 1, 0),
            np.cumsum(np.broadcast_to(a[:, None], (40, 3, 30)), 1))
    for o, r in zip(stax.compile(f)(x), refs):
        assert_close(o, r.astype(np.float64), stax.float32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_scan_dynamic_sizes(device, rng):
    """§10.3: symbolic sizes; the column blocks of a scan over dim 0 take a remainder branch."""
    f = stax.compile(lambda x: (stax.cumsum(x + 1, -1) * 3, stax.cumprod(x * 0.1 + 1, 0)), dynamic=True)
    for n in (9, 1030, 33):
        a = rng.standard_normal((3, n)).astype(np.float32)
        s, p = f(stax.from_numpy(a).to(device))
        assert_close(s.cpu(), np.cumsum(a.astype(np.float64) + 1, -1) * 3, stax.float32)
        assert_close(p.cpu(), np.cumprod(a.astype(np.float64) * 0.1 + 1, 0), stax.float32)


# ---- Triton (through the interpreter where there is no GPU) ----


@pytest.mark.parametrize("op", list(REF))
@pytest.mark.parametrize("shape,dim", [((7, 1000), 1), ((3, 5000), 1), ((1000, 7), 0), ((2, 9, 5), 1),
                                       ((2000,), 0), ((6, 0), 1), ((4, 1), 1)])
def test_scan_triton(op, shape, dim, rng):
    a = rng.standard_normal(shape).astype(np.float32)
    fn = _fn(op, dim)
    out = stax.compile(fn)(stax.from_numpy(a).to("cuda"))
    assert out.device == "cuda"
    assert_close(out.cpu(), _ref(op, a.astype(np.float64), dim), stax.float32)


def test_scan_triton_forms_and_fusion(rng):
    x = stax.from_numpy(rng.standard_normal((7, 1000)).astype(np.float32))
    names, gen = _kernels(lambda x: stax.cumsum(x * 2, -1) + 1, x, device="cuda")
    assert names == ["triton_per_fused_0"] and "extern_kernel" not in gen.wrapper
    assert "triton_helpers.cumsum(" in gen.kernels["triton_per_fused_0"]
    y = stax.from_numpy(rng.standard_normal((3, 5000)).astype(np.float32))
    names, gen = _kernels(lambda x: stax.cumsum(x * 2, -1) + 1, y, device="cuda")
    assert names == ["triton_red_fused_0"]
    src = gen.kernels["triton_red_fused_0"]
    assert "for r0_offset in tl.range" in src and "r0_numel - 1" in src     # the carry across blocks


def test_scan_triton_dtypes_and_specials(rng):
    i = rng.integers(-50, 50, (6, 2000)).astype(np.int32)
    a = rng.standard_normal((4, 50)).astype(np.float32)
    a[0, 3], a[1, 10], a[2, 0], a[3, 7], a[3, 20] = np.nan, np.inf, -np.inf, np.inf, -np.inf
    h = stax.from_numpy(rng.standard_normal((5, 300)).astype(np.float32)).half()
    f = lambda i, a, h: (stax.cumsum(i, 1), stax.cumsum(i > 0, 1), stax.cumprod(i % 3 - 1, 1),
                         stax.logcumsumexp(a, 1), stax.cumsum(a, 1), stax.cumsum(h, 1) * 2)
    args = (stax.from_numpy(i), stax.from_numpy(a), h)
    outs = stax.compile(f)(*[t.to("cuda") for t in args])
    eager = f(*args)
    for o, e in zip(outs[:3], eager[:3]):
        assert o.dtype is stax.int64
        np.testing.assert_array_equal(o.cpu().numpy(), e.numpy())
    for o, e in zip(outs[3:5], eager[3:5]):
        np.testing.assert_array_equal(np.isnan(o.cpu().numpy()), np.isnan(e.numpy()))
        np.testing.assert_allclose(o.cpu().numpy(), e.numpy(), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert outs[5].dtype is stax.float16
    assert_close(outs[5].cpu(), np.cumsum(_f64(h), 1) * 2, stax.float16)


# ---- cummax / cummin: the running value (a scan) and PyTorch's indices (a second scan) ----


def _cum_extreme_ref(a, d, largest):
    """PyTorch's cummax/cummin loop: an element replaces the running value when it is NaN, or
    >= it (<= for cummin) while the running value is not NaN; the index is that element's."""
    a = np.moveaxis(a, d, -1)
    v, idx = np.empty_like(a), np.zeros(a.shape, np.int64)
    for pos in np.ndindex(a.shape[:-1]):
        out, k = a[pos][0], 0
        for i, e in enumerate(a[pos]):
            if np.isnan(e) or (not np.isnan(out) and (e >= out if largest else e <= out)):
                out, k = e, i
            v[pos][i], idx[pos][i] = out, k
    return np.moveaxis(v, -1, d), np.moveaxis(idx, -1, d)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cummax_cummin(device, rng):
    a = rng.integers(0, 4, (5, 40)).astype(np.float32)        # ties
    a[1, 3], a[1, 6], a[2, 0], a[3, 9] = np.nan, np.nan, np.inf, -np.inf
    i = rng.integers(-9, 9, (7, 3)).astype(np.int32)
    b = rng.random((4, 6)) < 0.5
    f = lambda a, i, b: (stax.cummax(a, 1), stax.cummin(a, 0), a.cummax(dim=0), stax.cummin(i, 0),
                         stax.cummax(b, 1))
    refs = (_cum_extreme_ref(a, 1, True), _cum_extreme_ref(a, 0, False), _cum_extreme_ref(a, 0, True),
            _cum_extreme_ref(i.astype(np.float64), 0, False), (np.maximum.accumulate(b, 1), None))
    args = [stax.from_numpy(t) for t in (a, i, b)]
    for run in (f, stax.compile(f)):
        outs = run(*[t.to(device) for t in args]) if run is not f else f(*args)
        for (values, indices), (rv, ri) in zip(outs, refs):
            assert indices.dtype is stax.int64
            np.testing.assert_array_equal(values.cpu().numpy().astype(np.float64), np.asarray(rv, np.float64))
            if ri is not None:
                np.testing.assert_array_equal(indices.cpu().numpy(), ri)
    assert outs[3].values.dtype is stax.int32 and outs[4].values.dtype is stax.bool


# ---- goldens: a cumsum with a fused prologue, per back end ----


@pytest.mark.parametrize("device,path", [("cpu", "cumsum.cpp"), ("cuda", "cumsum.py")])
def test_golden_scan(device, path, request):
    x = stax.randn(64, 1000)
    gen = stax.generate(lambda x: stax.cumsum(x * 2 + 1, -1), x, device=device)
    text = "\n".join(gen.kernels.values())
    golden = GOLDEN / path
    if request.config.getoption("--regen-goldens"):
        golden.write_text(text)
    assert golden.exists(), f"{golden} missing: run pytest tests/test_scans.py --regen-goldens"
    assert text == golden.read_text(), f"generated code differs from {golden}"
