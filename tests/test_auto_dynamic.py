"""Automatic dynamic, the default (`stax.compile(fn)` is `dynamic=None`, issue 10 item 3), and the
§2.4 limits.

The first call compiles static; a later call that differs only in sizes makes the dims that
changed symbols, and one guarded artifact serves from then on. Sizes 0 and 1 keep their own static
artifacts, a new dtype, rank or layout of what the function reads starts a new family (static
first again). The counts here are the acceptance checks; every result is checked against float64
numpy on fresh random inputs.
"""
import sys

import numpy as np
import pytest

import stax

rng = np.random.default_rng(2024)


def _rand(*shape, dtype=np.float32):
    return stax.from_numpy(rng.standard_normal(shape).astype(dtype))


def _f64(t):
    return t.numpy().astype(np.float64)


def _check(got, want):
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=1e-5, atol=1e-5)


def test_default_is_automatic_dynamic():
    assert stax.compile(lambda x: x).dynamic is None
    assert stax.compile(dynamic=False)(lambda x: x).dynamic is False


def test_a_loop_over_100_batch_sizes_compiles_at_most_twice():
    fn = lambda x, w: (x * w).sum(-1)      # noqa: E731
    cf = stax.compile(fn)
    w = _rand(7)
    for n in range(1, 101):                # 1 (static: sizes 1 are specialized), then 2..100 symbolic
        x = _rand(n, 7)
        _check(cf(x, w), (_f64(x) * _f64(w)).sum(-1))
    assert cf.stats["compiles"] == 2 and cf.stats["eager_calls"] == 0, cf.stats
    wrapper = cf.last_generated.wrapper
    assert "s0 = arg0_1.shape[0]" in wrapper and "(s0, 7)" in wrapper   # only dim 0 became a symbol


def test_first_shape_keeps_its_static_artifact_and_changed_dims_accumulate():
    cf = stax.compile(lambda x: x * 2 + 1)
    first = _rand(4, 6)
    cf(first)
    for shape in [(5, 6), (9, 6), (4, 6)]:     # dim 0 changes: one symbolic artifact; (4, 6): static
        x = _rand(*shape)
        _check(cf(x), _f64(x) * 2 + 1)
    assert cf.stats["compiles"] == 2
    for shape in [(4, 11), (13, 3)]:           # dim 1 changes too: both dims symbols, once
        x = _rand(*shape)
        _check(cf(x), _f64(x) * 2 + 1)
    assert cf.stats["compiles"] == 3
    assert "(s0, s1)" in cf.last_generated.wrapper
    for shape in [(0, 6), (1, 1), (17, 2)]:    # 0/1 sizes: their own specializations
        x = _rand(*shape)
        _check(cf(x), _f64(x) * 2 + 1)
    assert cf.stats["compiles"] == 5 and cf.stats["eager_calls"] == 0


def test_a_new_dtype_or_layout_starts_static_again():
    cf = stax.compile(lambda x: x - 3)
    for x in (_rand(3, 4), _rand(5, 4), _rand(6, 4)):       # static, then symbolic
        _check(cf(x), _f64(x) - 3)
    assert cf.stats["compiles"] == 2
    for x in (_rand(3, 4, dtype=np.float64), _rand(8, 4, dtype=np.float64)):
        _check(cf(x), _f64(x) - 3)
    assert cf.stats["compiles"] == 4
    t = _rand(4, 9).t()                                      # transposed: the guard's strides fail
    _check(cf(t), _f64(t) - 3)
    assert cf.stats["compiles"] == 5


W = stax.tensor([1.0, 2.0, 3.0])
SCALE = 2.0


def _reads_globals(x):
    return x * SCALE + W


def test_rebinding_a_global_tensor_or_scalar_does_not_multiply_compiles(monkeypatch):
    """The static key and the family key both list the global tensor by layout (the first
    automatic-dynamic attempt keyed the static artifact by a stale lifted list: a rebound global
    tensor recompiled every time)."""
    mod = sys.modules[__name__]
    cf = stax.compile(_reads_globals)
    x = _rand(3)
    _check(cf(x), _f64(x) * 2 + _f64(W))
    monkeypatch.setattr(mod, "W", _rand(3))                 # same layout: read fresh, no recompile
    _check(cf(x), _f64(x) * 2 + _f64(W))
    monkeypatch.setattr(mod, "SCALE", -0.5)
    _check(cf(x), _f64(x) * -0.5 + _f64(W))
    monkeypatch.setattr(mod, "SCALE", 2.0)                  # back: the first artifact
    _check(cf(x), _f64(x) * 2 + _f64(W))
    assert cf.stats["compiles"] == 2
    y = _rand(2, 3)                                          # a new rank: static, then symbolic
    _check(cf(y), _f64(y) * 2 + _f64(W))
    y = _rand(5, 3)
    _check(cf(y), _f64(y) * 2 + _f64(W))
    monkeypatch.setattr(mod, "W", _rand(3))
    y = _rand(9, 3)
    _check(cf(y), _f64(y) * 2 + _f64(W))
    assert cf.stats["compiles"] == 4 and cf.stats["eager_calls"] == 0


def test_recompiles_log_says_which_dims_became_symbols(monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "recompiles")
    cf = stax.compile(lambda x: x.sum(0))
    cf(_rand(3, 4))
    cf(_rand(3, 5))
    err = capsys.readouterr().err
    assert "size changed from (3, 4) to (3, 5)" in err and "become symbols (tensor input 0 dim 1)" in err


def test_aliased_inputs_stay_static_and_correct():
    def f(a, b):
        a.add_(1)
        return b * 2
    cf = stax.compile(f)
    for n in (3, 4, 5):
        x = _rand(n)
        want = (_f64(x) + 1) * 2
        _check(cf(x, x), want)
    assert cf.stats["eager_calls"] == 0


def test_fullgraph_raises_at_the_recompile_limit(monkeypatch):
    monkeypatch.setattr(stax, "RECOMPILE_LIMIT", 1)
    cf = stax.compile(lambda x: x + 1, fullgraph=True)
    cf(_rand(3))
    with pytest.raises(RuntimeError, match="recompile limit"):
        cf(_rand(4))


# ---- int arguments are sizes: symbols under automatic dynamic (issue 10 item 3) ----


def test_an_int_step_counter_does_not_recompile_every_call():
    def step(p, g, t, *, warmup=4):
        upd = p - g * t                    # the counter as a run-time scalar
        head = upd[:t].sum()               # ... as a slice bound (x[:t] clamps under guards)
        return upd * 0.5 + head, t + 1, warmup * 2
    cf = stax.compile(step)
    p, g = _rand(40), _rand(40)
    for t in range(2, 32):
        upd, t_next, w = cf(p, g, t, warmup=t % 3 + 2)
        P, G = _f64(p), _f64(g)
        want = (P - G * t) * 0.5 + (P - G * t)[:t].sum()
        np.testing.assert_allclose(upd.numpy(), want, rtol=1e-4, atol=1e-4)
        assert t_next == t + 1 and type(t_next) is int        # a size output: computed per call
        assert w == (t % 3 + 2) * 2 and type(w) is int
    assert cf.stats["compiles"] <= 3 and cf.stats["eager_calls"] == 0, cf.stats
    assert "assert_size_stride(arg2_1, (s0,), (0,))" in cf.last_generated.wrapper   # the carrier


def test_small_and_negative_ints_and_dynamic_true():
    fn = lambda x, n: x[:n] * n if n > 0 else x * n      # noqa: E731
    cf = stax.compile(fn)
    x = _rand(9)
    for n in (0, 1, -3, 5, 6, 7, 1, 0, 12):   # 0, 1 and negatives keyed by value; then symbolic
        X = _f64(x)
        _check(cf(x, n), X[:n] * n if n > 0 else X * n)
    assert cf.stats["eager_calls"] == 0 and cf.stats["compiles"] <= 6
    dyn = stax.compile(lambda x, n: x.reshape(n, -1).sum(0), dynamic=True)
    for n in (2, 3, 4, 6):                    # one artifact from the first call on
        x = _rand(12)
        _check(dyn(x, n), _f64(x).reshape(n, -1).sum(0))
    assert dyn.stats["compiles"] == 1


def test_an_int_in_float_arithmetic_is_specialized_and_correct():
    """`1.0 / t` needs a number: the symbol is specialized under a guard, so each value compiles
    (until the limits): correct, not fast. Pass such a value as a tensor to avoid it."""
    cf = stax.compile(lambda x, t: x * (1.0 / t))
    for t in (3, 4, 3):
        x = _rand(5)
        _check(cf(x, t), _f64(x) * (1.0 / t))
    assert cf.stats["compiles"] == 2


def test_int_counter_and_changing_sizes_through_triton():
    # (on the GPU when there is one; conftest runs Triton's interpreter otherwise)
    def fn(x, t):
        return (x * t + x[:, :t].sum(-1, keepdim=True)).sum(0), t * 2
    cf = stax.compile(fn)
    for n, t in ((5, 2), (6, 3), (9, 4), (17, 5)):
        x = _rand(n, 8)
        out, t2 = cf(x.to("cuda"), t)
        X = _f64(x)
        np.testing.assert_allclose(out.cpu().numpy(), (X * t + X[:, :t].sum(-1, keepdims=True)).sum(0),
                                   rtol=1e-4, atol=1e-4)
        assert t2 == 2 * t
    assert cf.stats["compiles"] == 2 and cf.stats["eager_calls"] == 0


# ---- what a symbolic int or size must not change: each of these gave wrong answers or errors ----

INT_USES = {
    "rpow": lambda x, n: 2 ** n * x,
    "max": lambda x, n: x[:max(n, 3)],
    "fstring": lambda x, n: x + len(f"{n}") + len(str(n)),
    "narrow_output_view": lambda x, n: x.narrow(0, 1, n),
    "dim_argument": lambda x, n: stax.softmax(x.reshape(2, -1), n - 2),
    "tensor_of_sizes": lambda x, n: x + stax.tensor([n, n]).sum(),
    "select": lambda x, n: x[n],
    "stepped_slice": lambda x, n: x[::n],
    "float_mix": lambda x, n: x * (n * 0.5),
    "reshape": lambda x, n: x.reshape(n, -1).sum(0),
}


@pytest.mark.parametrize("name", sorted(INT_USES))
def test_int_argument_uses_equal_eager(name):
    fn = INT_USES[name]
    cf = stax.compile(fn)
    for n in (2, 3, 4, 6):
        x = _rand(12)
        try:
            want = fn(x, n)
        except Exception as e:          # (softmax over dim 2 of a 2-D tensor: eager's error)
            with pytest.raises(type(e)):
                cf(x, n)
            continue
        got = cf(x, n)
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (n, got.shape, want.shape)
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.numpy().astype(np.float64), rtol=1e-5)
    assert cf.stats["eager_calls"] == 0


@pytest.mark.parametrize("fn", [lambda x: x[1:], lambda x: x.reshape(2, -1), lambda x: (x[:-1], x.t()[0])],
                         ids=["slice", "reshape", "two_views"])
def test_outputs_that_view_an_input_get_this_calls_sizes(fn):
    """An output that views an input is rebuilt from the caller's tensor: with a symbolic size,
    its view parameters are evaluated from this call's sizes (they were the symbols' names)."""
    cf = stax.compile(fn)
    for n in (4, 6, 8, 10):
        x = _rand(n, 2)
        got, want = cf(x), fn(x)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert tuple(g.shape) == tuple(w.shape) and g.stride() == w.stride()
            assert g._storage is x._storage                 # a view of the input, as in eager
            np.testing.assert_array_equal(g.numpy(), w.numpy())
    assert cf.stats["compiles"] == 2


def test_float_arguments_keep_signed_zero_and_nan_under_the_default():
    """A float argument becomes a run-time scalar at its second value (tests/test_float_scalars.py);
    -0.0, NaN and 0.0 then go through the kernels' `double` parameter, and sizes still become
    symbols: the first call static, then static sizes with the scalar, then one dynamic artifact."""
    f = lambda x, s: 1 / (x * s) + x[:2].sum()     # noqa: E731
    cf = stax.compile(f)
    for n, s in ((4, 0.0), (5, -0.0), (6, float("nan")), (7, -0.0), (8, 0.0), (9, float("nan"))):
        x = _rand(n).abs() + 0.5
        np.testing.assert_array_equal(cf(x, s).numpy(), f(x, s).numpy())
    assert cf.stats["compiles"] == 3 and cf.stats["eager_calls"] == 0
    x = _rand(11).abs() + 0.5
    np.testing.assert_array_equal(cf(x, -0.0).numpy(), f(x, -0.0).numpy())
    assert cf.stats["compiles"] == 3                # the symbolic artifact serves size 11
