"""§10.5 data-dependent sizes: nonzero, unique, bincount, masked_select as fallback kernels whose
output sizes are symbols u0, u1, ... without a hint (0 <= u <= N), decided only when their
constraints settle it (Prop. 10.4); otherwise an error that suggests stax._check, which turns the
decision into a run-time check. On the CPU and through Triton's interpreter (the GPU path after a
fallback once printed `xnumel = u0` in a kernel body, a NameError).
"""
import numpy as np
import pytest
import sympy

import stax
from conftest import assert_close
from stax import dynshape

rng = np.random.default_rng(105)


def _rand(*shape):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _f64(t):
    return np.asarray(t.numpy(), dtype=np.float64)


def after_nonzero(x):
    i = stax.nonzero(x > 0.5)               # (u0, 1) int64
    return (i * 2 + 1).sum(0), stax.unique(x).sum()


def _ref_after_nonzero(x):
    xf = _f64(x)
    i = np.argwhere(xf > 0.5)
    return (i * 2 + 1).sum(0), np.unique(xf).sum()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kernels_after_fallbacks_take_the_data_dependent_size(device):
    # (cuda: on the GPU when there is one; conftest runs the Triton interpreter otherwise)
    compiled = stax.compile(after_nonzero, dynamic=True, fullgraph=True)
    for n, shift in ((37, 0.0), (2, 0.0), (129, 0.0), (7, -9.0), (5, 9.0)):
        x = stax.from_numpy((rng.standard_normal(n) + shift).astype(np.float32))
        x.numpy()[0] = 0.75                 # at least one row some times, none when shift < 0
        if shift < 0:
            x.numpy()[0] = -1.0
        a, b = compiled(x.to(device))
        ra, rb = _ref_after_nonzero(x)
        np.testing.assert_array_equal(a.cpu().numpy(), ra)
        assert_close(b.cpu(), rb, "float32")
    assert compiled.stats["compiles"] == 1
    text = str(compiled.last_generated)
    assert "u0 = buf" in text and "u1 = buf" in text
    if device == "cuda":
        assert "xnumel = u0" not in text and "r0_numel = u0" not in text


@pytest.mark.parametrize("dynamic", [False, True])
def test_bincount_masked_select_unique_equal_numpy(dynamic):
    def f(x, k):
        return stax.masked_select(x, x > 0) * 2, stax.bincount(k, minlength=4) + 1, stax.unique(k)
    compiled = stax.compile(f, dynamic=dynamic)
    for n in (3, 17, 64):
        x = _rand(n, 3)
        x.numpy()[0, 0] = np.inf
        k = stax.from_numpy(rng.integers(0, 11, n).astype(np.int64))
        got = compiled(x, k)
        xf, kf = _f64(x), k.numpy()
        assert_close(got[0], xf[xf > 0] * 2, "float32")
        np.testing.assert_array_equal(got[1].numpy(), np.bincount(kf, minlength=4) + 1)
        np.testing.assert_array_equal(got[2].numpy(), np.unique(kf))
        for eager, want in zip(f(x, k), got):
            np.testing.assert_array_equal(eager.numpy(), want.numpy())


def test_an_undecidable_decision_names_itself_and_suggests_check():
    def f(x, y):
        v = stax.masked_select(x, x > 0)
        return v + y                        # u0 against y's size: nothing proves them equal
    compiled = stax.compile(f, dynamic=True)
    with pytest.raises(dynshape.DataDependentError) as e:
        compiled(_rand(9), _rand(9))
    msg = str(e.value)
    assert "cannot decide `s0 != u0`" in msg
    assert "u0 is the length of masked_select, 0 <= u0" in msg and "stax._check(" in msg
    assert "test_data_dependent.py" in msg and "return v + y" in msg


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_check_becomes_a_run_time_check(device):
    def f(x, y):
        v = stax.masked_select(x, x > 0)
        stax._check(v.shape[0] == y.shape[0])
        return v * 2 + y
    compiled = stax.compile(f, dynamic=True)
    for n in (4, 11):
        x = stax.from_numpy(np.abs(rng.standard_normal(n)).astype(np.float32) + 0.1)
        x.numpy()[1] = -1.0                 # one dropped: v has n - 1 elements
        y = _rand(n - 1)
        assert_close(compiled(x.to(device), y.to(device)).cpu(), _f64(x)[_f64(x) > 0] * 2 + _f64(y), "float32")
    assert compiled.stats["compiles"] == 1
    assert "if not ((u0 == s" in compiled.last_generated.wrapper or "if not ((u0 ==" in str(compiled.last_generated)
    with pytest.raises(RuntimeError, match=r"stax._check\(u0 == s\d\) failed"):
        compiled(_rand(6).to(device) * 0 + 1, _rand(2).to(device))     # 6 selected, 2 expected


def test_shape_env_decides_unbacked_only_from_constraints():
    env = dynshape.ShapeEnv()
    s = env.create_symbol(10, (0, 0))
    u = sympy.Symbol("u0", integer=True, nonnegative=True)
    env.add_unbacked(u, "the row count of nonzero", s)
    assert env.decide(sympy.Ge(u, 0)) is True                    # from 0 <= u
    assert env.decide(sympy.Le(u, s)) is True                    # from u <= N
    assert env.decide(sympy.Lt(u, 0)) is False
    with pytest.raises(dynshape.DataDependentError, match="u0 is the row count of nonzero"):
        env.decide(sympy.Gt(u, 4))
    assert env.guards == []                                      # never a guard on the (absent) hint
    env.assume(sympy.Ge(u, 2))                                   # stax._check(u >= 2)
    assert env.ranges[u] == (2, None) and env.decide(sympy.Ne(u, 1)) is True
    env.assume(sympy.Eq(u, s))
    assert env.decide(sympy.Eq(u, s)) is True and env.checks == [sympy.Ge(u, 2), sympy.Eq(u, s)]
    with pytest.raises(dynshape.DataDependentError, match="the value of `u0"):
        dynshape.ShapeEnv.specialize(env, u + 1)


def test_check_on_real_sizes_and_bad_inputs():
    stax._check(True)
    with pytest.raises(RuntimeError, match="sizes differ"):
        stax._check(3 == 4, "sizes differ")
    with pytest.raises(RuntimeError, match="1-d non-negative integral"):
        stax.bincount(_rand(4))
    with pytest.raises(RuntimeError, match="expected a bool mask"):
        stax.masked_select(_rand(4), _rand(4))
    with pytest.raises(NotImplementedError, match="weights"):
        stax.bincount(stax.from_numpy(np.arange(3)), weights=_rand(3))


@pytest.mark.parametrize("dynamic", [False, None, True])
def test_slicing_a_data_dependent_size_in_static_mode(dynamic):
    """nonzero's (u0, 1) result sliced and used as an index: in static mode too its size is a
    SymInt (a TypeError from slice.indices before); training runs the function eagerly when its
    backward would decide on u0, with eager's gradients."""
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((7, 3)).astype(np.float32)
    mv = np.array([1, 0, 1, 1, 0, 1, 1], dtype=bool)

    def f(x, m):
        return (x[stax.nonzero(m)[:, 0]] * 2).sum()
    x, m = stax.tensor(xv), stax.tensor(mv)
    got = stax.compile(f, dynamic=dynamic)(x, m)
    assert_close(got, np.float64(xv[mv].astype(np.float64).sum() * 2), stax.float32)
    xg = stax.tensor(xv).requires_grad_()
    stax.compile(f, dynamic=dynamic)(xg, m).backward()
    assert_close(xg.grad, np.where(mv[:, None], 2.0, 0.0) * np.ones((7, 3)), stax.float32)
