"""§9.8 float8 (stax.float8_e4m3fn, stax.float8_e5m2) and stax._scaled_mm.

The formats are checked code by code against their definition (OCP FP8: sign, exponent, mantissa;
e4m3fn without infinities), rounding against a brute-force nearest-value search. `_scaled_mm`
runs eagerly (numpy) and compiled: on the CPU as a fallback, on "cuda" as the Triton matmul
template with float8 operands into tl.dot -- in Triton's interpreter where there is no GPU (it
multiplies float8 blocks), on the H200 for real; its kernels are built for sm_90 by
tests/test_zz_sm90.py. References are float64 numpy on the float8 values.
"""
import numpy as np
import pytest

import stax
from conftest import assert_close
from stax import dtypes

F8 = [stax.float8_e4m3fn, stax.float8_e5m2]
MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _values(dtype):
    return dtypes._F8[dtype.name][1]


def _f8(rng, shape, dtype=stax.float8_e4m3fn, scale=1.0):
    return stax.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(dtype)


def _f64(t) -> np.ndarray:
    return t.float().cpu().numpy().astype(np.float64)


# ---- the formats ----


def test_codes_decode_as_the_formats_define():
    e4 = _values(stax.float8_e4m3fn)
    assert e4[0x38] == 1.0 and e4[0x7E] == 448.0 and e4[0x01] == 2.0 ** -9 and e4[0x08] == 2.0 ** -6
    assert np.isnan(e4[0x7F]) and np.isnan(e4[0xFF]) and np.isfinite(np.delete(e4, [0x7F, 0xFF])).all()
    assert e4[0x80] == 0 and np.signbit(e4[0x80]) and e4[0xB8] == -1.0
    e5 = _values(stax.float8_e5m2)
    assert e5[0x3C] == 1.0 and e5[0x7B] == 57344.0 and e5[0x01] == 2.0 ** -16 and e5[0x7C] == np.inf
    assert np.isnan(e5[0x7D:0x80]).all() and e5[0xFC] == -np.inf


@pytest.mark.parametrize("dtype", F8, ids=lambda d: d.name)
def test_every_value_round_trips_and_rounding_is_nearest_even(dtype, rng):
    vals = _values(dtype)
    finite = np.isfinite(vals)
    codes = dtypes._float8_encode(vals[finite], dtype)
    np.testing.assert_array_equal(codes, np.arange(256)[finite])     # each value is its own code
    x = np.concatenate([rng.standard_normal(4000) * s for s in (1e-3, 1, 30, 300)]).astype(np.float32)
    pos = vals[:128][np.isfinite(vals[:128])]
    dist = np.abs(np.abs(x)[:, None].astype(np.float64) - pos[None, :])
    best = dist.min(1, keepdims=True)
    ties = dist == best                      # two nearest: the even code (mantissa's last bit 0)
    want = np.where(ties.sum(1) > 1, np.argmax(ties & (np.arange(len(pos)) % 2 == 0), 1), np.argmin(dist, 1))
    inside = np.abs(x) <= pos[-1]
    got = dtypes._float8_encode(x, dtype)
    np.testing.assert_array_equal((got & 0x7F)[inside], want[inside])
    np.testing.assert_array_equal(got >> 7, np.signbit(x).astype(np.uint8))


@pytest.mark.parametrize("dtype", F8, ids=lambda d: d.name)
def test_casts_saturate_and_keep_nan(dtype):
    big = MAX[dtype.name]
    x = stax.tensor([big * 1.01, -big * 4, float("inf"), float("-inf"), float("nan"), -0.0, 1e-30])
    y = x.to(dtype).float().numpy()
    np.testing.assert_array_equal(y[:4], [big, -big, big, -big])
    assert np.isnan(y[4]) and y[5] == 0 and np.signbit(y[5]) and y[6] == 0
    assert x.to(stax.bfloat16).to(dtype).dtype is dtype
    assert x.to(dtype).to(stax.float16).dtype is stax.float16


def test_float8_takes_casts_views_and_scaled_mm_only():
    x = stax.ones(4, 6).to(stax.float8_e4m3fn)
    assert x.t().shape == (6, 4) and x[1:3].dtype is stax.float8_e4m3fn
    with pytest.raises(RuntimeError, match='"add" is not implemented for float8 .Float8_e4m3fn.*to.stax.float32'):
        x + 1
    with pytest.raises(TypeError, match="Promotion for Float8"):
        stax.promote_types(stax.float8_e4m3fn, stax.float32)
    with pytest.raises(TypeError, match="unsupported ScalarType Float8_e4m3fn"):
        x.numpy()


# ---- _scaled_mm: eager ----


def _ref(a, b, sa, sb):
    return _f64(a) @ _f64(b) * _f64(sa) * _f64(sb)


@pytest.mark.parametrize("shapes,rowwise,dtypes_", [
    ((37, 70, 45), False, (stax.float8_e4m3fn, stax.float8_e4m3fn)),
    ((1, 33, 7), False, (stax.float8_e4m3fn, stax.float8_e5m2)),
    ((64, 48, 9), True, (stax.float8_e5m2, stax.float8_e4m3fn)),
    ((7, 1, 5), True, (stax.float8_e4m3fn, stax.float8_e4m3fn)),
])
@pytest.mark.parametrize("out", [stax.float32, stax.bfloat16, stax.float16], ids=lambda d: d.name)
def test_scaled_mm_eager_and_compiled(shapes, rowwise, dtypes_, out, rng):
    m, k, n = shapes
    a, w = _f8(rng, (m, k), dtypes_[0]), _f8(rng, (n, k), dtypes_[1])
    if rowwise:
        sa = stax.from_numpy(rng.uniform(0.5, 2, (m, 1)).astype(np.float32))
        sb = stax.from_numpy(rng.uniform(0.5, 2, (1, n)).astype(np.float32))
    else:
        sa, sb = stax.tensor(0.25), stax.tensor([3.0])
    ref = _ref(a, w.t(), sa, sb)
    tol = {stax.float32: 1e-5}.get(out, 1e-2) * max(1.0, k ** 0.5)
    eager = stax._scaled_mm(a, w.t(), sa, sb, out_dtype=out)
    assert eager.dtype is out and eager.shape == (m, n)
    assert_close(eager.double(), ref, out, atol=tol)

    def fn(a, b, sa, sb):
        return stax._scaled_mm(a, b, sa, sb, out_dtype=out)
    # Hopper's float8 MMA keeps about 14 bits of its float32 accumulator (measured on the H200:
    # 3e-3 on a sum of 8.8 at K=70): on real hardware the bound is 2^-13 of the sum of |products|
    mags = np.abs(_f64(a)) @ np.abs(_f64(w.t())) * np.abs(_f64(sa)) * np.abs(_f64(sb))
    hw_tol = max(tol, 2.0 ** -13 * float(mags.max()))
    for device in ("cpu", "cuda"):
        cf = stax.compile(fn)
        got = cf(a.to(device), w.to(device).t(), sa.to(device), sb.to(device))
        assert cf.stats["eager_calls"] == 0
        real_gpu = device == "cuda" and not stax.cuda.interpreting()
        assert_close(got.cpu().double(), ref, out, atol=hw_tol if real_gpu else tol)
    assert "triton_tem_fused_mm_0" in cf.last_generated.kernels
    assert f"'in_ptr0': '*fp8e{'4nv' if dtypes_[0] is stax.float8_e4m3fn else '5'}'" in str(cf.last_generated)


def test_scaled_mm_epilogue_fuses_and_special_values_decode(rng):
    """relu(scaled_mm + bias) is one kernel; subnormals, the largest value and -0 decode exactly."""
    e4 = _values(stax.float8_e4m3fn)
    codes = np.array([0x01, 0x07, 0x7E, 0xFE, 0x80, 0x38, 0x08, 0x40] * 8, np.uint8)   # 64 codes
    a = stax.from_numpy(e4[codes].reshape(8, 8)).to(stax.float8_e4m3fn)
    w = _f8(rng, (11, 8))
    bias = stax.from_numpy(rng.standard_normal(11).astype(np.float32))
    sa, sb = stax.tensor(1.0), stax.tensor(0.125)

    def fn(a, b, sa, sb, bias):
        return stax.relu(stax._scaled_mm(a, b, sa, sb, out_dtype=stax.float32) + bias)
    cf = stax.compile(fn)
    got = cf(a.to("cuda"), w.to("cuda").t(), sa.to("cuda"), sb.to("cuda"), bias.to("cuda"))
    ref = np.maximum(_ref(a, w.t(), sa, sb) + _f64(bias), 0)
    assert_close(got.cpu().double(), ref, stax.float32, atol=1e-4)
    assert list(cf.last_generated.kernels) == ["triton_tem_fused_mm_0"]


@pytest.mark.parametrize("call,why", [
    (lambda a, w, s: stax._scaled_mm(a, w.t().contiguous(), s, s, out_dtype=stax.float32), "column-major"),
    (lambda a, w, s: stax._scaled_mm(a.t().contiguous().t(), w.t(), s, s, out_dtype=stax.float32), "row-major"),
    (lambda a, w, s: stax._scaled_mm(a, w.t(), s, s), "out_dtype"),
    (lambda a, w, s: stax._scaled_mm(a.float(), w.t(), s, s, out_dtype=stax.float32), "float8 matrices"),
    (lambda a, w, s: stax._scaled_mm(a.float().to(stax.float8_e5m2), w.float().to(stax.float8_e5m2).t(), s, s,
                                     out_dtype=stax.float32), "two Float8_e5m2"),
    (lambda a, w, s: stax._scaled_mm(a, w.t(), s.double(), s, out_dtype=stax.float32), "float32 tensor"),
    (lambda a, w, s: stax._scaled_mm(a, w.t(), stax.ones(3), s, out_dtype=stax.float32), "row-wise"),
    (lambda a, w, s: stax._scaled_mm(a, w.t(), s, s, bias=stax.ones(5), out_dtype=stax.float32), "bias"),
])
def test_scaled_mm_says_what_is_wrong(call, why, rng):
    a, w = _f8(rng, (6, 32)), _f8(rng, (5, 32))
    with pytest.raises(RuntimeError, match=why):
        call(a, w, stax.tensor(1.0))


def test_a_float8_cast_in_a_compiled_function_runs_eagerly(rng):
    x = stax.from_numpy(rng.standard_normal(37).astype(np.float32) * 300)
    cf = stax.compile(lambda x: x.to(stax.float8_e4m3fn))
    got = cf(x)
    assert cf.stats["eager_calls"] == 1
    np.testing.assert_array_equal(got.float().numpy(), x.to(stax.float8_e4m3fn).float().numpy())


def test_before_sm89_the_product_runs_eagerly_on_the_host(monkeypatch, rng):
    from stax import templates
    from stax.triton_kernel import Target
    monkeypatch.setattr(templates, "current_target", lambda: Target(108, 80))      # an A100
    a, w = _f8(rng, (9, 40)), _f8(rng, (6, 40))
    s = stax.tensor(0.5)
    cf = stax.compile(lambda a, b, s: stax._scaled_mm(a, b, s, s, out_dtype=stax.float32))
    got = cf(a.to("cuda"), w.to("cuda").t(), s.to("cuda"))
    assert "extern_kernel('scaled_mm'" in cf.last_generated.wrapper and not cf.last_generated.kernels
    assert_close(got.cpu().double(), _ref(a, w.t(), s, s), stax.float32, atol=1e-5)
