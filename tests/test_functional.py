"""`stax.nn.functional` (issue 11 item 2) against float64 numpy, eagerly and compiled (C++), and a
few through the Triton back end (TRITON_INTERPRET=1 without a GPU): activations, normalization,
pad and pooling, the losses (cross_entropy's one fused row kernel), dropout's Philox stream.

Each test compiles one function returning several results, so a test costs one C++ build.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import stax
import stax.nn.functional as F
from conftest import assert_close


def f64(t):
    return np.asarray(t.numpy(), np.float64)


def both(fn, *args):
    """(eager outputs, compiled outputs) as tuples."""
    eager = fn(*args)
    compiled = stax.compile(fn)(*args)
    wrap = lambda r: r if isinstance(r, tuple) else (r,)
    return wrap(eager), wrap(compiled)


def check(fn, args, refs, dtype=stax.float32):
    eager, compiled = both(fn, *args)
    for k, (e, c, r) in enumerate(zip(eager, compiled, refs)):
        assert_close(e, r, dtype, msg=f"eager output {k}")
        assert_close(c, r, dtype, msg=f"compiled output {k}")


def _softplus(X, beta=1.0, th=20.0):
    return np.where(X * beta > th, X, np.log1p(np.exp(X * beta)) / beta)


# ---- activations ----


def test_activations(rng):
    X = rng.standard_normal((7, 13)) * 3
    X[0, :3] = [np.nan, np.inf, -np.inf]
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)

    def fn(x):
        return (F.relu(x), F.leaky_relu(x, 0.2), F.elu(x), F.softplus(x, 2.0, 5.0), F.hardswish(x),
                F.mish(x), F.sigmoid(x), F.tanh(x), F.silu(x), F.gelu(x), F.relu6(x), F.logsigmoid(x),
                F.hardsigmoid(x), F.selu(x), F.softsign(x))
    with np.errstate(all="ignore"):
        sp = _softplus(X)
        sig = 1 / (1 + np.exp(-X))
        refs = (np.where(X < 0, 0, X), np.where(X > 0, X, 0.2 * X), np.where(X > 0, X, np.expm1(X)),
                _softplus(X, 2.0, 5.0), X * np.clip(X + 3, 0, 6) / 6, X * np.tanh(sp), sig, np.tanh(X),
                X * sig, 0.5 * X * (1 + np.vectorize(math.erf)(X / math.sqrt(2))), np.clip(X, 0, 6),
                -_softplus(-X), np.clip(X + 3, 0, 6) / 6,
                1.0507009873554805 * np.where(X > 0, X, 1.6732632423543772 * np.expm1(X)), X / (1 + np.abs(X)))
    check(fn, [x], refs)


def test_softmax_implicit_dim_and_half(rng):
    X = rng.standard_normal((5, 9))
    x = stax.tensor(X, dtype=stax.float16)
    Xh = f64(x)
    e = np.exp(Xh - Xh.max(1, keepdims=True))
    check(lambda x: (F.softmax(x, dim=-1), F.log_softmax(x, 1)), [x],
          (e / e.sum(1, keepdims=True), np.log(e / e.sum(1, keepdims=True))), stax.float16)


# ---- normalization, linear ----


def test_norms(rng):
    X = rng.standard_normal((4, 6, 5))
    x = stax.tensor(X, dtype=stax.float32).permute(0, 2, 1)      # non-contiguous (4, 5, 6)
    w, b = stax.tensor(rng.standard_normal(6), dtype=stax.float32), stax.tensor(rng.standard_normal(6), dtype=stax.float32)
    X, W, B = f64(x), f64(w), f64(b)

    def fn(x, w, b):
        return (F.rms_norm(x, (6,), w, eps=1e-6), F.layer_norm(x, (6,), w, b),
                F.normalize(x, dim=-1), F.normalize(x, p=1.0, dim=1))
    mu, var = X.mean(-1, keepdims=True), X.var(-1, keepdims=True)
    refs = (X / np.sqrt((X * X).mean(-1, keepdims=True) + 1e-6) * W, (X - mu) / np.sqrt(var + 1e-5) * W + B,
            X / np.maximum(np.sqrt((X * X).sum(-1, keepdims=True)), 1e-12),
            X / np.maximum(np.abs(X).sum(1, keepdims=True), 1e-12))
    check(fn, [x, w, b], refs)


def test_group_norm(rng):
    X = rng.standard_normal((3, 6, 5, 7))
    x = stax.tensor(X, dtype=stax.float32)
    w, b = stax.tensor(rng.standard_normal(6), dtype=stax.float32), stax.tensor(rng.standard_normal(6), dtype=stax.float32)
    X, W, B = f64(x), f64(w), f64(b)
    g = X.reshape(3, 2, -1)
    ref = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)).reshape(X.shape)
    ref = ref * W[None, :, None, None] + B[None, :, None, None]
    check(lambda x, w, b: F.group_norm(x, 2, w, b), [x, w, b], (ref,))
    with pytest.raises(RuntimeError, match="divisible by num_groups"):
        F.group_norm(x, 4)


def test_batch_norm_training_updates_running_stats(rng):
    X = rng.standard_normal((5, 3, 7)) * 2 + 1
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)
    rm0, rv0 = rng.standard_normal(3), rng.random(3) + 0.5

    def fn(x, rm, rv):
        return F.batch_norm(x, rm, rv, training=True, momentum=0.2)
    mu, var = X.mean((0, 2)), X.var((0, 2))
    ref = (X - mu[None, :, None]) / np.sqrt(var[None, :, None] + 1e-5)
    want_rm, want_rv = 0.8 * rm0 + 0.2 * mu, 0.8 * rv0 + 0.2 * X.var((0, 2), ddof=1)
    for run in (fn, stax.compile(fn)):
        rm, rv = stax.tensor(rm0, dtype=stax.float32), stax.tensor(rv0, dtype=stax.float32)
        assert_close(run(x, rm, rv), ref, stax.float32)
        assert_close(rm, want_rm, stax.float32)
        assert_close(rv, want_rv, stax.float32)
    rm, rv = stax.tensor(rm0, dtype=stax.float32), stax.tensor(rv0, dtype=stax.float32)
    w = stax.tensor([1.5, -1.0, 0.5])
    evald = (X - rm0[None, :, None]) / np.sqrt(rv0[None, :, None] + 1e-5) * np.array([1.5, -1.0, 0.5])[None, :, None]
    check(lambda x, rm, rv, w: F.batch_norm(x, rm, rv, w, training=False), [x, rm, rv, w], (evald,))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        F.batch_norm(stax.randn(1, 3), None, None, training=True)


def test_linear_and_attention(rng):
    x = stax.tensor(rng.standard_normal((2, 5, 8)), dtype=stax.float32)
    w = stax.tensor(rng.standard_normal((6, 8)), dtype=stax.float32)
    b = stax.tensor(rng.standard_normal(6), dtype=stax.float32)
    q, k, v = (stax.tensor(rng.standard_normal((2, 3, 5, 4)), dtype=stax.float32) for _ in range(3))
    X, W, B, Q, K, V = map(f64, (x, w, b, q, k, v))
    s = Q @ K.swapaxes(-1, -2) / 2 + np.triu(np.full((5, 5), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    check(lambda x, w, b, q, k, v: (F.linear(x, w, b), F.scaled_dot_product_attention(q, k, v, is_causal=True)),
          [x, w, b, q, k, v], (X @ W.T + B, (p / p.sum(-1, keepdims=True)) @ V))


# ---- pad, pooling ----


def test_pad_modes(rng):
    X = rng.standard_normal((2, 3, 5, 6))
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)

    def fn(x):
        return (F.pad(x, (1, 2), value=-3.5), F.pad(x, (2, 1, 3, 0), mode="reflect"),
                F.pad(x, (3, 1, 0, 2), mode="replicate"), F.pad(x, (-1, 2)), F.pad(x, (2, 3), mode="circular"))
    refs = (np.pad(X, ((0, 0), (0, 0), (0, 0), (1, 2)), constant_values=-3.5),
            np.pad(X, ((0, 0), (0, 0), (3, 0), (2, 1)), mode="reflect"),
            np.pad(X, ((0, 0), (0, 0), (0, 2), (3, 1)), mode="edge"),
            np.pad(X[..., 1:], ((0, 0), (0, 0), (0, 0), (0, 2))),
            np.pad(X, ((0, 0), (0, 0), (0, 0), (2, 3)), mode="wrap"))
    check(fn, [x], refs)
    with pytest.raises(RuntimeError, match="Padding size should be less than"):
        F.pad(x, (6, 0), mode="reflect")


def _pool_ref(X, k, s, p, ceil, op, include_pad=True):
    n, c, h, w = X.shape
    def size(L):
        span = L + 2 * p - k
        o = (-(-span // s) if ceil else span // s) + 1
        return o - 1 if ceil and (o - 1) * s >= L + p else o
    ho, wo = size(h), size(w)
    out = np.zeros((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            h0, w0 = i * s - p, j * s - p
            h1, w1 = min(h0 + k, h + p), min(w0 + k, w + p)
            win = X[:, :, max(h0, 0):min(h1, h), max(w0, 0):min(w1, w)]
            if op == "max":
                out[:, :, i, j] = win.max((2, 3))
            else:
                div = (h1 - h0) * (w1 - w0) if include_pad else win.shape[2] * win.shape[3]
                out[:, :, i, j] = win.sum((2, 3)) / div
    return out


@pytest.mark.parametrize("k,s,p,ceil", [(3, 2, 1, False), (2, 2, 0, True), (3, 3, 1, True)])
def test_pools(rng, k, s, p, ceil):
    X = rng.standard_normal((2, 3, 7, 9))
    X[0, 0, 1, 1] = np.nan
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)

    def fn(x):
        return (F.max_pool2d(x, k, s, p, ceil_mode=ceil), F.avg_pool2d(x, k, s, p, ceil_mode=ceil),
                F.avg_pool2d(x, k, s, p, ceil_mode=ceil, count_include_pad=False))
    with np.errstate(invalid="ignore"):
        refs = (_pool_ref(X, k, s, p, ceil, "max"), _pool_ref(X, k, s, p, ceil, "avg"),
                _pool_ref(X, k, s, p, ceil, "avg", include_pad=False))
    check(fn, [x], refs)


# ---- losses ----


def _ce_ref(X, T, W=None, ii=-100, red="mean", ls=0.0):
    C = X.shape[1]
    m = X.max(1, keepdims=True)
    logp = X - (np.log(np.exp(X - m).sum(1, keepdims=True)) + m)
    valid = T != ii
    Tc = np.where(valid, T, 0)
    Wv = np.ones(C) if W is None else W
    w = Wv[Tc] * valid
    nll = -np.take_along_axis(logp, np.expand_dims(Tc, 1), 1).squeeze(1) * w
    wc = Wv.reshape((C,) + (1,) * (X.ndim - 2))
    smooth = -(logp * wc).sum(1) * valid
    if red == "none":
        return (1 - ls) * nll + ls / C * smooth
    if red == "sum":
        return (1 - ls) * nll.sum() + ls / C * smooth.sum()
    return (1 - ls) * nll.sum() / w.sum() + ls / C * smooth.sum() / w.sum()


def test_cross_entropy_variants(rng):
    N, C = 11, 7
    X = rng.standard_normal((N, C)) * 3
    T = rng.integers(0, C, N)
    T[[2, 5]] = -100
    W = rng.random(C) + 0.5
    T3 = np.where(T == -100, 3, T)
    x, t, w = stax.tensor(X, dtype=stax.float32), stax.tensor(T), stax.tensor(W, dtype=stax.float32)
    t3 = stax.tensor(T3)
    X, W = f64(x), f64(w)

    def fn(x, t, w, t3):
        return (F.cross_entropy(x, t), F.cross_entropy(x, t, reduction="none"),
                F.cross_entropy(x, t, w, reduction="sum"), F.cross_entropy(x, t, w, label_smoothing=0.2),
                F.cross_entropy(x, t, label_smoothing=0.1, reduction="none"),
                F.nll_loss(F.log_softmax(x, 1), t, w), F.cross_entropy(x, t3, ignore_index=3))
    refs = (_ce_ref(X, T), _ce_ref(X, T, red="none"), _ce_ref(X, T, W, red="sum"), _ce_ref(X, T, W, ls=0.2),
            _ce_ref(X, T, ls=0.1, red="none"), _ce_ref(X, T, W), _ce_ref(X, T3, ii=3))
    check(fn, [x, t, w, t3], refs)
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        F.cross_entropy(x, t, ignore_index=3)


def test_cross_entropy_spatial_probs_and_half(rng):
    X = rng.standard_normal((3, 5, 4, 2))
    T = rng.integers(0, 5, (3, 4, 2))
    P = rng.random((6, 5))
    P /= P.sum(1, keepdims=True)
    Y = rng.standard_normal((6, 5))
    x, t = stax.tensor(X, dtype=stax.float32), stax.tensor(T)
    p, y = stax.tensor(P, dtype=stax.float32), stax.tensor(Y, dtype=stax.float16)
    X, P, Y = f64(x), f64(p), f64(y)
    m = Y.max(1, keepdims=True)
    logp = Y - np.log(np.exp(Y - m).sum(1, keepdims=True)) - m
    check(lambda x, t, y, p: (F.cross_entropy(x, t), F.cross_entropy(y, p, reduction="none")),
          [x, t, y, p], (_ce_ref(X, T), -(P * logp).sum(1)), stax.float16)


def test_cross_entropy_non_contiguous_and_bfloat16(rng):
    X = rng.standard_normal((13, 6)) * 2
    T = rng.integers(0, 13, 6)
    x = stax.tensor(X, dtype=stax.float32).T                  # (6, 13) logits, class dim strided
    xb = stax.tensor(X.T, dtype=stax.bfloat16)
    t = stax.tensor(T)
    ref32, ref16 = _ce_ref(f64(x), T, red="none"), _ce_ref(f64(xb.float()), T, red="none")
    eager, compiled = both(lambda x, xb, t: (F.cross_entropy(x, t, reduction="none"),
                                             F.cross_entropy(xb, t, reduction="none").float()), x, xb, t)
    for e, c, r, dt in zip(eager, compiled, (ref32, ref16), (stax.float32, stax.bfloat16)):
        assert_close(e, r, dt)
        assert_close(c, r, dt)


def test_cross_entropy_is_one_row_kernel_without_an_nc_temporary():
    x, t = stax.randn(64, 1000), stax.randint(0, 1000, (64,))
    gen = stax.generate(lambda x, t: F.cross_entropy(x, t, reduction="none"), x, t)
    assert len(gen.kernels) == 1
    gen = stax.generate(lambda x, t: F.cross_entropy(x, t), x, t)
    assert len(gen.kernels) == 2                     # the rows, then the mean over them
    assert "(64, 1000)" not in gen.wrapper.replace("assert_size_stride(arg0_1, (64, 1000)", "")


def test_cross_entropy_bad_target_is_an_error():
    with pytest.raises(IndexError, match="Target 7 is out of bounds"):
        F.cross_entropy(stax.randn(3, 7), stax.tensor([0, 7, 1]))
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        F.cross_entropy(stax.randn(3, 7), stax.tensor([0, 1, 1]), reduction="avg")


def test_regression_losses(rng):
    X, Y = rng.standard_normal((9, 5)) * 2, rng.standard_normal((9, 5))
    Z = (rng.random((9, 5)) > 0.5).astype(np.float64)
    PW = rng.random(5) + 0.5
    x, y, z, pw = (stax.tensor(a, dtype=stax.float32) for a in (X, Y, Z, PW))
    X, Y, Z, PW = map(f64, (x, y, z, pw))
    d = X - Y

    def fn(x, y, z, pw):
        return (F.mse_loss(x, y), F.l1_loss(x, y, reduction="sum"), F.smooth_l1_loss(x, y, beta=0.5, reduction="none"),
                F.huber_loss(x, y, delta=0.7), F.binary_cross_entropy_with_logits(x, z),
                F.binary_cross_entropy_with_logits(x, z, pos_weight=pw, reduction="none"))
    soft = np.log1p(np.exp(-np.abs(X))) + np.maximum(-X, 0)
    a = np.abs(d)
    refs = ((d * d).mean(), a.sum(), np.where(a < 0.5, 0.5 * d * d / 0.5, a - 0.25),
            np.where(a < 0.7, 0.5 * d * d, 0.7 * (a - 0.35)).mean(), ((1 - Z) * X + soft).mean(),
            (1 - Z) * X + ((PW - 1) * Z + 1) * soft)
    check(fn, [x, y, z, pw], refs)


def test_one_hot(rng):
    T = rng.integers(0, 6, (4, 3))
    t = stax.tensor(T)
    check(lambda t: F.one_hot(t, 6), [t], (np.eye(6, dtype=np.int64)[T],), stax.int64)
    assert F.one_hot(t).shape == (4, 3, int(T.max()) + 1)
    with pytest.raises(RuntimeError, match="smaller than num_classes"):
        F.one_hot(t, 2)


# ---- dropout ----


def test_dropout_philox_stream():
    x = stax.randn(64, 33)
    assert F.dropout(x, 0.3, training=False) is x
    stax.manual_seed(7)
    a = F.dropout(x, 0.3)
    stax.manual_seed(7)
    b = stax.compile(lambda x: F.dropout(x, 0.3))(x)
    c = F.dropout(x, 0.3)                             # the stream moved on: another mask
    A, X = f64(a), f64(x)
    assert np.array_equal(A, f64(b))
    assert not np.array_equal(A, f64(c))
    kept = A != 0
    assert 0.6 < kept.mean() < 0.8
    assert_close(A[kept], X[kept] / 0.7, stax.float32)
    u = stax.math_ops.philox_rand((5000,)).numpy()
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(x, 1.5)


def test_dropout_on_triton():
    """The Philox draw is a fallback on the device too (its dtype parameter reaches the wrapper)."""
    x = stax.randn(40, 30)
    stax.manual_seed(3)
    a = F.dropout(x, 0.25)
    stax.manual_seed(3)
    b = stax.compile(lambda x: F.dropout(x, 0.25) * 2)(x.to("cuda"))
    assert b.device == "cuda" and np.array_equal(f64(a) * 2, f64(b.cpu()))


def test_philox_known_answer():
    """Philox4x32-10 of counter 0, key 0 (Random123's known-answer vector 0x6627e8d5)."""
    from stax.op_table import philox_uniform
    assert philox_uniform(0, np.array([0], np.uint64))[0] == 0x6627E8D5 / 2 ** 32


def test_conv2d_is_stax_conv2d():
    x, w = stax.randn(1, 2, 5, 5), stax.randn(3, 2, 2, 2)
    assert np.array_equal(F.conv2d(x, w, padding=1).numpy(), stax.conv2d(x, w, padding=1).numpy())


# ---- the Triton back end ----


def test_norms_and_pools_on_triton(rng):
    X = rng.standard_normal((2, 3, 7, 5))
    x = stax.tensor(X, dtype=stax.float32)
    X = f64(x)
    rm0, rv0 = np.zeros(3), np.ones(3)
    rm, rv = stax.tensor(rm0, dtype=stax.float32).to("cuda"), stax.tensor(rv0, dtype=stax.float32).to("cuda")

    def fn(x, rm, rv):
        return F.batch_norm(x, rm, rv, training=True), F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 2, ceil_mode=True)
    out = stax.compile(fn)(x.to("cuda"), rm, rv)
    mu, var = X.mean((0, 2, 3)), X.var((0, 2, 3))
    refs = ((X - mu[None, :, None, None]) / np.sqrt(var[None, :, None, None] + 1e-5),
            _pool_ref(X, 3, 2, 1, False, "max"), _pool_ref(X, 2, 2, 0, True, "avg"))
    for o, r in zip(out, refs):
        assert_close(o.cpu(), r, stax.float32)
    assert_close(rm.cpu(), 0.1 * mu, stax.float32)
    assert_close(rv.cpu(), 0.9 + 0.1 * X.var((0, 2, 3), ddof=1), stax.float32)


def test_functional_on_triton(rng):
    X = rng.standard_normal((9, 37)) * 2
    T = rng.integers(0, 37, 9)
    T[4] = -100
    x, t = stax.tensor(X, dtype=stax.float32), stax.tensor(T)
    X = f64(x)

    def fn(x, t):
        return F.cross_entropy(x, t, label_smoothing=0.1), F.mish(x), F.pad(x, (2, 1), mode="reflect")
    out = stax.compile(fn)(x.to("cuda"), t.to("cuda"))
    refs = (_ce_ref(X, T, ls=0.1), X * np.tanh(_softplus(X)), np.pad(X, ((0, 0), (2, 1)), mode="reflect"))
    for o, r in zip(out, refs):
        assert o.device == "cuda"
        assert_close(o.cpu(), r, stax.float32)


def test_compiled_cross_entropy_bad_target_raises_as_eager(rng):
    """A target outside [0, C) (not ignore_index) is PyTorch's IndexError in compiled CPU code too,
    negatives included; ignore_index anywhere is allowed. The pick stays a gather fused into the
    row kernel (one kernel for reduction='none', the rows and their mean for 'mean')."""
    x = stax.from_numpy(rng.standard_normal((5, 7)).astype(np.float32))
    f = stax.compile(lambda x, t: F.cross_entropy(x, t, ignore_index=-100))
    g = stax.compile(lambda x, t: F.nll_loss(F.log_softmax(x, 1), t, reduction="none"))
    good = stax.tensor([0, 6, -100, 3, 2])
    assert_close(f(x, good), _ce_ref(f64(x), good.numpy(), ii=-100), stax.float32)
    for bad, shown in (([0, 7, 1, 2, 3], 7), ([0, 1, -1, 2, 3], -1), ([9, 1, -100, 2, 3], 9)):
        for fn in (f, g):
            with pytest.raises(IndexError, match=f"Target {shown} is out of bounds"):
                fn(x, stax.tensor(bad))
    src = "\n".join(stax.generate(lambda x, t: F.cross_entropy(x, t, reduction="none"), x, good).kernels.values())
    assert "stax_check_index" in src


def test_gpu_cross_entropy_bad_target_asserts_in_debug_mode(rng, monkeypatch):
    x = stax.from_numpy(rng.standard_normal((5, 7)).astype(np.float32)).cuda()
    monkeypatch.setenv("STAX_DEBUG_INDEX", "1")
    cf = stax.compile(lambda x, t: F.cross_entropy(x, t, reduction="none"))
    t = stax.tensor([0, 6, -100, 3, 2])
    assert_close(cf(x, t.cuda()).cpu(), _ce_ref(f64(x.cpu()), t.numpy(), red="none"), stax.float32)
    assert "tl.device_assert" in str(cf.last_generated)
    from stax import cuda
    if cuda.is_available():
        pytest.skip("a device-side assert would leave the CUDA context unusable")
    with pytest.raises(Exception, match="index out of bounds"):
        cf(x, stax.tensor([0, 7, 1, 2, 3]).cuda())
