"""numpy ndarray arguments compiled as tensor inputs, with numpy's semantics (issue 9 item 3).

Each function runs compiled on ndarray arguments and eagerly in numpy; the results must have
numpy's types and dtypes exactly (NumPy 2 / NEP 50 promotion) and close values (float64 numpy is
the eager reference here: the eager call *is* numpy). Fresh arrays give fresh results, a changed
array is read again, in-place updates reach the caller's array, and what the stand-in does not
support runs eagerly (a graph break) or, under fullgraph=True, raises.
"""
import numpy as np
import pytest

import stax
from stax.capture import GraphBreak

DTYPES = ["float32", "float64", "float16", "int32", "bool"]


def _arr(rng, shape, dtype):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("int"):
        return rng.integers(-9, 10, shape).astype(dtype)
    return (rng.standard_normal(shape) * 2).astype(dtype)


def _check(got, want):
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert type(g) is type(w), (type(g), type(w))
        if isinstance(w, stax.Tensor):
            g, w = g.numpy(), w.numpy()
        if isinstance(w, (np.ndarray, np.generic)):
            assert g.dtype == w.dtype and np.shape(g) == np.shape(w), (g.dtype, w.dtype, np.shape(g), np.shape(w))
            rtol = 2e-3 if w.dtype == np.float16 else 1e-5
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=rtol)
        else:
            assert g == w


FUNCTIONS = {
    "arith_float": lambda a: a * 2.5 + 1.0,
    "arith_int": lambda a: a * 3 - 1,
    "true_divide": lambda a: a / 3,
    "compare": lambda a: (a > 0.5, a == 0, a <= 1),
    "ufuncs": lambda a: np.exp(a) + np.sqrt(np.abs(a)) - np.sin(a),
    "maximum_where": lambda a: np.where(a > 0, np.maximum(a, 1), -1.5),
    "reductions": lambda a: (a.sum(), a.sum(axis=0), a.mean(axis=1), a.max(axis=-1, keepdims=True),
                             np.min(a), np.sum(a, axis=(0, 1))),
    "index_slice": lambda a: (a[0], a[1:, ::2], a[..., 1], a[None, 0, :2], a.T, a.shape[0] * 1.0),
    "reshape_transpose": lambda a: (a.reshape(-1), a.reshape(a.shape[1], -1).transpose() + 1,
                                    np.reshape(a, (2, -1))),
    "matmul": lambda a: a @ a.T,
    "astype": lambda a: a.astype(np.float32) + a.astype(np.int64),
}
NOT_BOOL = {"arith_int", "true_divide", "ufuncs", "maximum_where", "matmul"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_results_have_numpys_types_and_values(name, dtype, rng):
    fn = FUNCTIONS[name]
    if dtype == "bool" and name in NOT_BOOL:
        pytest.skip("numpy itself refuses or changes meaning on bool here")
    cf = stax.compile(fn)
    with np.errstate(all="ignore"):
        for shape in ((4, 6), (4, 6), (5, 8)):
            a = _arr(rng, shape, dtype)
            _check(cf(a), fn(a))
    assert cf.stats["eager_calls"] == 0


def test_two_arguments_promote_as_numpy(rng):
    fn = lambda a, b: (a + b, a / b, b * 1.5, (a * b).sum(axis=0))   # noqa: E731
    cf = stax.compile(fn)
    for da, db in (("int32", "float32"), ("float16", "int32"), ("int32", "int32"), ("float16", "float64")):
        a, b = _arr(rng, (3, 5), da), _arr(rng, (3, 5), db) + 20
        _check(cf(a, b), fn(a, b))
    assert cf.stats["eager_calls"] == 0


def test_fresh_arrays_fresh_results_and_changed_arrays_are_seen(rng):
    cf = stax.compile(lambda a: a * 2)
    a = _arr(rng, (7,), "float32")
    r1 = cf(a)
    a[:] = _arr(rng, (7,), "float32")          # changed in place: read again
    r2 = cf(a)
    np.testing.assert_array_equal(r2, a * 2)
    assert r1 is not r2 and not np.shares_memory(r1, r2)
    b = _arr(rng, (7,), "float32")
    np.testing.assert_array_equal(cf(b), b * 2)
    assert cf.stats["compiles"] == 1


@pytest.mark.parametrize("layout", ["transposed", "strided", "broadcast", "zero_d", "size_0", "size_1"])
def test_layouts(layout, rng):
    base = _arr(rng, (6, 9), "float32")
    a = {"transposed": base.T, "strided": base[::2, 1::3], "broadcast": np.broadcast_to(base[0], (4, 9)),
         "zero_d": np.array(2.5, np.float32), "size_0": base[:0], "size_1": base[:1, :1]}[layout]
    fn = lambda a: (a + 1, (a * a).sum(), a * np.float32(3))   # noqa: E731
    cf = stax.compile(fn)
    _check(cf(a), fn(a))
    _check(cf(a), fn(a))
    assert cf.stats["eager_calls"] == 0


def test_returning_the_argument_and_views_of_it():
    cf = stax.compile(lambda a: (a, a[1:], a.T))
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x, v, t = cf(a)
    assert x is a and np.shares_memory(v, a) and np.shares_memory(t, a)
    np.testing.assert_array_equal(t, a.T)


def _inplace(a):
    b = a.astype(a.dtype, copy=False)     # a itself
    b += 1
    a += 1
    a[0] = 5
    a[1:3] *= 2
    np.add(a, 1, out=a)
    return a.sum()


@pytest.mark.parametrize("dtype", ["float32", "int32", "float16"])
def test_in_place_updates_reach_the_callers_array(dtype, rng):
    cf = stax.compile(_inplace)
    for n in (6, 6, 11):
        a = _arr(rng, (n,), dtype)
        b = a.copy()
        _check(cf(a), _inplace(b))
        if dtype == "float16":      # (§6.2: fused half intermediates are held in float32, unrounded)
            np.testing.assert_allclose(a, b, rtol=2e-3)
        else:
            np.testing.assert_array_equal(a, b)
    assert cf.stats["eager_calls"] == 0


def test_in_place_on_a_read_only_array_raises_as_numpy():
    cf = stax.compile(_inplace)
    a = np.broadcast_to(np.ones(3, np.float32), (3,))
    with pytest.raises(ValueError, match="read-only"):
        cf(a)
    assert cf.stats["eager_calls"] == 1


def test_aliased_array_arguments(rng):
    def fn(a, b):
        a += 1
        return b * 2
    cf = stax.compile(fn)
    a = _arr(rng, (5,), "float32")
    want_a = a.copy()
    want = fn(want_a, want_a)
    got = cf(a, a)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(a, want_a)


UNSUPPORTED = {
    "cumsum_method": lambda a: a.cumsum(),
    "np_dot": lambda a: np.dot(a, a),
    "fancy_index": lambda a: a[[0, 2]],
    "bool_mask": lambda a: a[a > 0],
    "item": lambda a: a * a[0].item(),
    "branch": lambda a: a * 2 if a.sum() > 0 else a,
    "int_floordiv": lambda a: a.astype(np.int32) // 2,
    "real_array_inside": lambda a: a + np.ones(a.shape),
    "mixed_with_tensor": lambda a: a + stax.ones(tuple(a.shape)),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_numpy_runs_eagerly_and_fullgraph_raises(name, rng, monkeypatch, capsys):
    fn = UNSUPPORTED[name]
    a = _arr(rng, (4,), "float32")
    try:
        want = fn(a)
    except Exception as e:
        with pytest.raises(type(e)):
            stax.compile(fn)(a)
        return
    monkeypatch.setenv("STAX_LOGS", "graph")
    cf = stax.compile(fn)
    _check(cf(a), want)
    assert cf.stats["eager_calls"] == 1
    assert "graph break" in capsys.readouterr().err
    with pytest.raises(GraphBreak):
        stax.compile(fn, fullgraph=True)(a)


def test_mixed_tensor_and_array_arguments_compile_apart(rng):
    """A Stax tensor and an ndarray in one call: each computes with its own semantics; an
    operation between the two is a graph break (above)."""
    fn = lambda t, a: (t * 2, a * 2.5)     # noqa: E731
    cf = stax.compile(fn)
    t, a = stax.tensor(_arr(rng, (3,), "float32")), _arr(rng, (3,), "int32")
    gt, ga = cf(t, a)
    assert isinstance(gt, stax.Tensor) and isinstance(ga, np.ndarray) and ga.dtype == np.float64
    np.testing.assert_allclose(ga, a * 2.5)
    assert cf.stats["eager_calls"] == 0


def test_sizes_become_symbols_for_arrays_too(rng):
    cf = stax.compile(lambda a: (a * 2).sum(axis=-1))
    for n in (3, 5, 7, 9, 12):
        a = _arr(rng, (n, 4), "float32")
        _check(cf(a), (a * 2).sum(axis=-1))
    assert cf.stats["compiles"] == 2 and cf.stats["eager_calls"] == 0


def test_nan_and_inf_values(rng):
    fn = lambda a: (np.maximum(a, 0), a.max(axis=0), np.isnan(a), a * 0.0)   # noqa: E731
    cf = stax.compile(fn)
    a = np.array([[1.0, np.nan, -np.inf], [np.inf, -0.0, 2.0]], np.float32)
    for g, w in zip(cf(a), fn(a)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
