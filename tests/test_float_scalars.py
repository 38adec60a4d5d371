"""Float arguments as run-time scalars (issue 10 item 3, §10.4).

Under automatic dynamic (the default) a float argument is baked into the first artifact; the
first call that passes another value makes it a run-time scalar: a `double` parameter of the C++
and Triton kernels, passed by the wrapper, one artifact for every value. dynamic=True does so from
the first call, dynamic=False keys every value. A float the function reads as a Python number
(`if s > 0:`, `s * 2`, `math.sqrt(s)`, returning it) is specialized: keyed by value, so a branch
on it is decided anew for each value. Results are checked against eager Stax (exactly: dtypes and
bits, -0.0, NaN and inf included) and against float64 numpy, on the CPU and through Triton.
"""
import math

import numpy as np
import pytest

import stax

VALUES = (1.0, 2.5, -3.25, 0.1, 1e-30, 7e30, -0.0, 0.0, float("nan"), float("inf"), float("-inf"), 1 / 3)
DEVICES = ["cpu", "cuda"]       # (cuda: Triton's interpreter when there is no GPU, conftest.py)


def _rand(rng, n, dtype):
    if dtype in ("int32", "int64"):
        return rng.integers(-9, 10, n).astype(dtype)
    if dtype == "bool":
        return rng.random(n) < 0.5
    return (rng.standard_normal(n) * 3).astype(dtype)


def _same(got, want, exact=True):
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
    if exact:
        np.testing.assert_array_equal(got.cpu().numpy(), want.cpu().numpy())
    else:       # (the C++ compiler and Triton may contract a * b + c into one rounding, baked
        # constants too; near a cancellation that is a few ulp of the operands, not of the result)
        np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), rtol=1e-6, atol=1e-6)


INEXACT = {"div", "pow"}       # more than one rounding per element: equal to eager within 1e-6
USES = {
    "mul": (lambda x, s: x * s, lambda x, s: x * s),
    "add_rsub": (lambda x, s: (x + s) - (s - x), lambda x, s: (x + s) - (s - x)),
    "div": (lambda x, s: x / s + s / (x * x + 1), lambda x, s: x / s + s / (x * x + 1)),
    "where_clamp": (lambda x, s: stax.where(x > s, x.clamp(max=s), s),
                    lambda x, s: np.where(x > s, np.minimum(x, s), s)),
    "full_like": (lambda x, s: stax.full(tuple(x.shape), s, device=x.device) + x, lambda x, s: np.full(x.shape, s) + x),
    "pow": (lambda x, s: x.abs() ** s, lambda x, s: np.abs(x) ** s),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use", sorted(USES))
def test_one_artifact_serves_every_value(use, device, rng):
    fn, ref = USES[use]
    cf = stax.compile(fn)
    x = _rand(rng, 37, "float32")
    xt = stax.tensor(x).to(device)
    with np.errstate(all="ignore"):
        for s in VALUES:
            got = cf(xt, s)
            _same(got, fn(xt, s), use not in INEXACT)
            want = ref(x.astype(np.float64), np.float64(np.float32(s)))
            np.testing.assert_allclose(got.cpu().numpy().astype(np.float64), want, rtol=2e-5, atol=1e-30)
    assert cf.stats["compiles"] == 2 and cf.stats["eager_calls"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "bool"])
def test_weak_scalar_dtype_rules(dtype, device, rng):
    """A Python float is a weak scalar: float32 * s is float32, float16 stays float16, float64
    stays float64 (s exact), int and bool tensors give the default float dtype (float32)."""
    cf = stax.compile(lambda x, s: x * s, dynamic=True)
    x = stax.tensor(_rand(rng, 13, dtype)).to(device)
    want_dtype = {"float64": "float64", "float16": "float16"}.get(dtype, "float32")
    for s in (0.1, -2.75, 1e-8, float("nan"), -0.0):
        got = cf(x, s)
        assert got.dtype.name == want_dtype
        _same(got, x * s)
    assert cf.stats["compiles"] == 1


def test_compile_counts_by_mode(rng):
    x = stax.tensor(_rand(rng, 9, "float32"))
    counts = {}
    for dynamic in (None, True, False):
        h = stax.compile(lambda x, s: x * s, dynamic=dynamic)
        for s in (1.0, 2.0, 3.0, 4.0):
            _same(h(x, s), x * s)
        counts[dynamic] = h.stats["compiles"]
    assert counts == {None: 2, True: 1, False: 4}


def test_many_values_never_fall_to_eager(rng):
    """Past the old recompile and compile limits: still one run-time artifact."""
    h = stax.compile(lambda x, s: (x * s).sum())
    x = stax.tensor(_rand(rng, 100, "float32"))
    for s in np.linspace(-5, 5, stax.COMPILE_LIMIT + 10):
        np.testing.assert_allclose(h(x, float(s)).numpy(), (x.numpy().astype(np.float64) * s).sum(), rtol=1e-4)
    assert h.stats["compiles"] == 2 and h.stats["eager_calls"] == 0


def test_signed_zero_nan_and_inf_through_the_run_time_scalar():
    f = lambda x, s: 1 / (x * s)   # noqa: E731
    cf, x = stax.compile(f, dynamic=True), stax.ones(3)
    assert np.all(cf(x, -0.0).numpy() == -np.inf) and np.all(cf(x, 0.0).numpy() == np.inf)
    assert np.all(np.isnan(cf(x, float("nan")).numpy()))
    assert np.all(cf(x, float("-inf")).numpy() == 0) and np.signbit(cf(x, float("-inf")).numpy()).all()
    assert cf.stats["compiles"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_branch_on_the_value_specializes_it(device, rng):
    """`if s > 0:` needs the value: the argument is specialized (keyed by value), so each value
    takes its own branch, as in eager."""
    def fn(x, s):
        return (x + 1) * s if s > 0 else x - s
    cf = stax.compile(fn)
    x = stax.tensor(_rand(rng, 11, "float32")).to(device)
    for s in (1.0, 2.0, -3.0, 4.0, -3.0, 0.0, -0.0):
        _same(cf(x, s), fn(x, s))
    assert cf.scalar_static == {1} and not cf.scalars
    assert cf.stats["compiles"] == 6 and cf.stats["eager_calls"] == 0


NUMBER_USES = {
    "arith": lambda x, s: x * (s * 2 + 1),
    "math": lambda x, s: x * math.sqrt(abs(s)),
    "returned": lambda x, s: (x * s, s),
    "float": lambda x, s: x + float(s),
    "format": lambda x, s: x + len(f"{s:.3f}"),
    "caught": lambda x, s: x + _swallow(s),
    "tensor_data": lambda x, s: x * stax.tensor([s, 1.0]).sum(),
}


def _swallow(s):
    try:
        return 1.0 if s > 1 else 2.0
    except Exception:           # a function that swallows the exception still gets a correct result
        return 3.0


@pytest.mark.parametrize("name", sorted(NUMBER_USES))
def test_python_number_uses_are_specialized_and_correct(name, rng):
    fn = NUMBER_USES[name]
    cf = stax.compile(fn, dynamic=True)
    x = stax.tensor(_rand(rng, 8, "float32"))
    for s in (0.5, 2.0, 0.5, 9.0):
        got, want = cf(x, s), fn(x, s)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            if isinstance(w, float):
                assert g == w and type(g) is float
            else:
                _same(g, w)
    assert cf.scalar_static == {1} and cf.stats["compiles"] == 3


def test_keyword_and_several_floats_and_generated_names(rng):
    fn = lambda x, alpha, *, beta=1.0: x * alpha + beta    # noqa: E731
    cf = stax.compile(fn, dynamic=True)
    x = stax.tensor(_rand(rng, 5, "float32"))
    for a, b in ((0.5, 2.0), (-1.5, 0.25), (3.0, -0.0)):
        _same(cf(x, a, beta=b), fn(x, a, beta=b))
    assert cf.stats["compiles"] == 1
    text = str(cf.last_generated)
    assert "double scalar_alpha" in text and "double scalar_beta" in text
    assert "arg0_1, scalar_alpha, scalar_beta = args" in text


def test_triton_kernel_takes_an_fp64_parameter(rng):
    cf = stax.compile(lambda x, s: (x * s).sum(-1), dynamic=True)
    x = stax.tensor(_rand(rng, 6 * 33, "float32").reshape(6, 33)).to("cuda")
    for s in (0.5, -2.0):
        np.testing.assert_allclose(cf(x, s).cpu().numpy(), (x.cpu().numpy().astype(np.float64) * s).sum(-1),
                                   rtol=1e-5, atol=1e-5)
    text = str(cf.last_generated)
    assert "'scalar_s': 'fp64'" in text and "(scalar_s).to(tl.float32)" in text
    assert cf.stats["compiles"] == 1


def test_floats_in_containers_and_globals_stay_keyed_by_value(rng):
    """Only top-level float arguments become run-time scalars; a float in a list or read from
    a global is guarded by value, as before."""
    cf = stax.compile(lambda x, c: x * c[0])
    x = stax.tensor(_rand(rng, 4, "float32"))
    for s in (1.0, 2.0, 3.0):
        _same(cf(x, [s]), x * s)
    assert cf.stats["compiles"] == 3


@pytest.mark.parametrize("shape", [(64, 64, 64), (8, 2048, 8)], ids=["template", "split_k"])
def test_matmul_and_conv_epilogues_read_the_scalar(shape, rng):
    """A template's fused epilogue (§9.8) takes the scalar as an fp64 parameter too."""
    m, k, n = shape
    x = stax.tensor(_rand(rng, m * k, "float32").reshape(m, k)).to("cuda")
    w = stax.tensor(_rand(rng, k * n, "float32").reshape(k, n)).to("cuda")
    f = lambda x, s: stax.relu(x @ w) * s + s     # noqa: E731
    cf = stax.compile(f)
    for s in (0.5, 1.5, -2.0):
        want = np.maximum(x.cpu().numpy().astype(np.float64) @ w.cpu().numpy(), 0) * s + s
        np.testing.assert_allclose(cf(x, s).cpu().numpy(), want, rtol=1e-4, atol=1e-3)
    assert cf.stats["compiles"] == 2 and "scalar_s" in "".join(cf.last_generated.kernels.values())
    xi = stax.tensor(_rand(rng, 3 * 81, "float32").reshape(1, 3, 9, 9)).to("cuda")
    wi = stax.tensor(_rand(rng, 4 * 27, "float32").reshape(4, 3, 3, 3)).to("cuda")
    g = lambda x, s: stax.relu(stax.conv2d(x, wi) * s)     # noqa: E731
    cg = stax.compile(g)
    for s in (0.5, -1.5, 2.0):
        np.testing.assert_allclose(cg(xi, s).cpu().numpy(), g(xi, s).cpu().numpy(), rtol=1e-5, atol=1e-5)
    assert cg.stats["compiles"] == 2
