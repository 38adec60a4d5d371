"""§10.4 dynamic shapes for compiled training (issue 10, issue 16 item 5): one shape-polymorphic
forward artifact and one backward artifact serve every batch size.

- a training loop over batch sizes 2..20, primes, 33, 64, 100 compiles the forward at most twice
  and the backward at most twice by default (automatic dynamic: static first, then symbolic), once
  each with dynamic=True; gradients equal eager autograd at every size and a float64 numpy
  gradient; on the CPU and through the Triton interpreter;
- the examples/train_mlp.py MLP trained with AdamW over changing batch sizes, step by step equal to eager;
- sizes 0 and 1 are specialized (their own pair of artifacts), a reshape using x.size(0), a mean
  over the dynamic dim, broadcasting, an int argument (a step counter) that changes;
- each forward call saves its own sizes for its own backward (two calls, backwards in reverse order);
- STAX_LOGS=guards prints both artifacts' guard functions; the backward binds the saved sizes.
"""
import math

import numpy as np
import pytest

import stax
import stax.nn.functional as F
from stax import aot_autograd

SIZES = list(range(2, 21)) + [23, 29, 31, 37, 33, 64, 100]


def _t(rng, *shape, grad=False, device="cpu"):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device).requires_grad_(grad)


def _entries(cf):
    """The TrainingEntries a compiled function holds (static ones and guarded ones)."""
    found = list(cf.artifacts.values()) + [e for v in cf.guarded.values() for _, e in v]
    return [e for e in found if isinstance(e, aot_autograd.TrainingEntry)]


def _backward_compiles(cf) -> int:
    return sum(e.stats["backward_compiles"] for e in _entries(cf))


def _grads(fn, inputs, params):
    for p in params:
        p.grad = None
    loss = fn(*inputs)
    loss.backward()
    return loss, [p.grad.cpu().numpy().astype(np.float64) for p in params]


# ---- the model: linear + gelu + layer_norm + a mean over the batch (a reshape by x.size(0)) ----


def model(x, w, b, g, c):
    h = F.gelu(F.linear(x, w, b))                       # broadcasting: the bias over the batch
    y = stax.layer_norm(h, (h.shape[-1],), g, None)
    return (y.reshape(x.size(0), -1).mean(0) * c).sum()


def _erf(x):
    return np.vectorize(math.erf)(x)


def model_ref(x, w, b, g, c):
    """float64 numpy: the gradients of `model` with respect to w, b, g and c."""
    n, hdim = x.shape[0], w.shape[0]
    h = x @ w.T + b
    a = 0.5 * h * (1 + _erf(h / math.sqrt(2)))
    mu = a.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((a - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (a - mu) * rstd
    dy = np.broadcast_to(c / n, (n, hdim))
    gx = dy * g
    da = rstd / hdim * (hdim * gx - gx.sum(-1, keepdims=True) - xhat * (gx * xhat).sum(-1, keepdims=True))
    dh = da * (0.5 * (1 + _erf(h / math.sqrt(2))) + h * np.exp(-0.5 * h * h) / math.sqrt(2 * math.pi))
    return [dh.T @ x, dh.sum(0), (dy * xhat).sum(0), (xhat * g).mean(0)]


def _params(rng, device, features=8, hidden=6):
    return [_t(rng, hidden, features, grad=True, device=device), _t(rng, hidden, grad=True, device=device),
            _t(rng, hidden, grad=True, device=device), _t(rng, hidden, grad=True, device=device)]


@pytest.mark.parametrize("device,dynamic", [("cpu", None), ("cpu", True), ("cuda", None), ("cuda", True)])
def test_a_loop_over_batch_sizes_compiles_each_artifact_at_most_twice(rng, device, dynamic):
    cf = stax.compile(model, dynamic=dynamic)
    params = _params(rng, device)
    for n in SIZES:
        x = _t(rng, n, 8, device=device)
        loss_c, got = _grads(cf, [x] + params, params)
        loss_e, want = _grads(model, [x] + params, params)
        np.testing.assert_allclose(loss_c.item(), loss_e.item(), rtol=1e-5, atol=1e-6)
        ref = model_ref(*[t.cpu().numpy().astype(np.float64) for t in [x] + params])
        for a, e, r in zip(got, want, ref):
            np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-5)
    twice = 1 if dynamic else 2
    assert cf.stats["compiles"] == twice and cf.stats["eager_calls"] == 0, cf.stats
    assert _backward_compiles(cf) == twice
    dyn = [e for e in _entries(cf) if e.dyn is not None]
    assert len(dyn) == 1 and len(dyn[0].dyn.backwards) == 1     # one backward served every size
    assert "s0 = " in dyn[0].gen_backward.wrapper and "size_s0" in dyn[0].gen_backward.wrapper


def test_dynamic_false_stays_static_per_size(rng):
    cf = stax.compile(model, dynamic=False)
    params = _params(rng, "cpu")
    for n in (3, 5, 9):
        _grads(cf, [_t(rng, n, 8)] + params, params)
    assert cf.stats["compiles"] == 3 and all(e.dyn is None for e in _entries(cf))


# ---- examples/train_mlp.py: AdamW steps over changing batch sizes, against eager ----


def test_train_mlp_over_batch_sizes_equals_eager_step_by_step():
    import examples.train_mlp as ex
    x, y = ex.make_data(n=256)
    runs = {}
    for compiled in (True, False):
        params = ex.make_model()
        opt = stax.optim.AdamW(params, lr=1e-2, weight_decay=1e-4, compiled=False)
        loss_fn = stax.compile(ex.loss_fn) if compiled else ex.loss_fn
        losses, grads = [], []
        start = 0
        for n in SIZES:
            xb, yb = x[start:start + n], y[start:start + n]      # (views: offsets into the data)
            start = (start + n) % 128
            opt.zero_grad()
            loss = loss_fn(*params, xb, yb)
            loss.backward()
            grads.append([p.grad.numpy().copy() for p in params])
            opt.step()
            losses.append(loss.item())
        runs[compiled] = (losses, grads, loss_fn)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    for gc, ge in zip(runs[True][1], runs[False][1]):
        for a, b in zip(gc, ge):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    cf = runs[True][2]
    assert cf.stats["compiles"] == 2 and _backward_compiles(cf) == 2 and cf.stats["eager_calls"] == 0, cf.stats


# ---- sizes 0 and 1, broadcasting, int arguments ----


def test_sizes_0_and_1_are_specialized(rng):
    fn = lambda x, v: ((x * v).sum(0) * 2).sum()      # noqa: E731  (broadcast v: [1, 4])
    cf = stax.compile(fn, dynamic=True)
    v = _t(rng, 1, 4, grad=True)
    for n in (3, 1, 0, 7, 1, 0, 11):
        x = _t(rng, n, 4, grad=True)
        loss = cf(x, v)
        loss.backward()
        gx, gv = x.grad.numpy(), v.grad.numpy().copy()
        v.grad = None
        np.testing.assert_allclose(gx, np.broadcast_to(2 * v.numpy(), (n, 4)), rtol=1e-6)
        np.testing.assert_allclose(gv, 2 * x.numpy().sum(0, keepdims=True), rtol=1e-5, atol=1e-6)
    assert cf.stats["compiles"] == 3 and _backward_compiles(cf) == 3       # n >= 2, n == 1, n == 0


def test_reshape_by_size_mean_over_the_batch_and_broadcasting(rng):
    def fn(x, s):
        y = x.reshape(x.size(0), -1, 2) * s               # s: [2], broadcast over [n, k, 2]
        return (y - y.mean(0)).pow(2).mean()
    cf = stax.compile(fn, dynamic=True)
    s = _t(rng, 2, grad=True)
    for n in (3, 5, 13, 64):                          # (n = 2 would share s's symbol: duck sizing)
        x = _t(rng, n, 6, grad=True)
        cf(x, s).backward()
        gx, gs = x.grad.numpy().astype(np.float64), s.grad.numpy().astype(np.float64)
        s.grad = None
        x64, s64 = x.numpy().astype(np.float64).reshape(n, 3, 2), s.numpy().astype(np.float64)
        y = x64 * s64
        d = y - y.mean(0)
        gy = 2 * d / d.size
        gy = gy - gy.mean(0)                               # through the mean over the batch
        np.testing.assert_allclose(gx, (gy * s64).reshape(n, 6), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(gs, (gy * x64).sum((0, 1)), rtol=1e-4, atol=1e-6)
    assert cf.stats["compiles"] == 1 and _backward_compiles(cf) == 1


@pytest.mark.parametrize("dynamic", [None, True])
def test_an_int_step_counter_does_not_recompile_the_backward(rng, dynamic):
    def fn(w, x, step):
        return ((x @ w).tanh() * step).mean() + step    # the step scales the gradient too
    cf = stax.compile(fn, dynamic=dynamic)
    w, x = _t(rng, 5, 3, grad=True), _t(rng, 4, 5)
    for step in range(0, 30):
        w.grad = None
        loss = cf(w, x, step)
        loss.backward()
        t = np.tanh(x.numpy().astype(np.float64) @ w.detach().numpy().astype(np.float64))
        np.testing.assert_allclose(loss.item(), t.mean() * step + step, rtol=1e-5)
        np.testing.assert_allclose(w.grad.numpy(), x.numpy().T @ ((1 - t * t) * step / t.size), rtol=1e-4, atol=1e-6)
    # steps 0 and 1 are specialized (as sizes 0 and 1 are); from 2 on one pair serves every step
    # (automatic dynamic: step 2 compiles static first, step 3 makes it a symbol)
    pairs = 3 if dynamic else 4
    assert cf.stats["compiles"] == pairs and _backward_compiles(cf) == pairs, cf.stats
    # one backward reads the step as a saved size: the carrier after the call's two tensors
    assert len([e for e in _entries(cf) if e.dyn is not None and (2, 0) in e.dyn.where]) == 1


def test_each_forward_saves_its_own_sizes(rng):
    cf = stax.compile(model, dynamic=True)
    params = _params(rng, "cpu")
    xs = [_t(rng, n, 8) for n in (5, 9)]
    losses = [cf(x, *params) for x in xs]
    grads = []
    for loss in reversed(losses):                     # the backward of the later call first
        for p in params:
            p.grad = None
        loss.backward()
        grads.append([p.grad.numpy().astype(np.float64) for p in params])
    for x, got in zip(reversed(xs), grads):
        for a, r in zip(got, model_ref(*[t.numpy().astype(np.float64) for t in [x] + params])):
            np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-5)
    assert cf.stats["compiles"] == 1 and _backward_compiles(cf) == 1


def test_guards_of_both_artifacts_are_printed(rng, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "guards")
    cf = stax.compile(lambda x, w: (x @ w).relu().sum(), dynamic=True)
    w = _t(rng, 4, 3, grad=True)
    cf(_t(rng, 6, 4), w).backward()
    cf(_t(rng, 10, 4), w).backward()
    err = capsys.readouterr().err
    assert err.count("==== stax guards: <lambda>_forward ====") == 1
    assert err.count("==== stax guards: <lambda>_backward ====") == 1
    backward = err.split("<lambda>_backward ====")[1]
    assert "def guard(inputs):" in backward and "s0 = m" in backward and "if s0 < 2: return False" in backward


# ---- more of §5's cases over changing batch sizes, against eager autograd ----

CASES = {
    "softmax": (lambda x, w: stax.softmax(x * w, -1), [(None, 13), (13,)]),
    "views": (lambda x, w: (x[1:, ::2].t() * x[:-1, 1::2].t() * w, x.reshape(-1)[3:9], x.permute(1, 0)[2]),
              [(None, 10), (1,)]),
    "saved_view": (lambda x, w, v: (x @ w)[:, 1:5:2] * v[:, :2], [(None, 4), (4, 8), (None, 3)]),
    "unused_output": (lambda x, w: ((x * w).sum(-1), (x - w).exp()), [(None, 5), (5,)]),
    "var_and_std": (lambda x: (x.var(0), x.std(-1)), [(None, 6)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cases_over_batch_sizes_equal_eager(rng, name):
    fn, shapes = CASES[name]
    cf = stax.compile(fn, dynamic=True)
    for n in (7, 3, 12):
        inputs = [_t(rng, *[n if s is None else s for s in shape], grad=True) for shape in shapes]
        got = []
        for f in (cf, fn):
            for t in inputs:
                t.grad = None
            out = f(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            (outs[0] * 1.5).sum().backward() if name == "unused_output" else \
                sum([(o * (k + 1)).sum() for k, o in enumerate(outs)]).backward()
            got.append(([o.detach().numpy() for o in outs], [t.grad.numpy() for t in inputs]))
        for a, b in zip(got[0][0] + got[0][1], got[1][0] + got[1][1]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert cf.stats["eager_calls"] == 0
    assert cf.stats["compiles"] == 1 and _backward_compiles(cf) == 1, (cf.stats, _backward_compiles(cf))


def test_a_write_through_a_slice_with_a_symbolic_end():
    """slice_scatter's bounds over symbols (x[1:-1] = ...; a slice's gradient is one): the
    lowering reads them as index expressions (inference mode shows it on its own)."""
    def fn(x):
        y = x * 2
        y[1:-1] = 0.0
        return y
    cf = stax.compile(fn, dynamic=True)
    for n in (4, 9):
        x = stax.from_numpy(np.arange(n * 3, dtype=np.float32).reshape(n, 3))
        want = x.numpy().astype(np.float64) * 2
        want[1:-1] = 0
        np.testing.assert_array_equal(cf(x).numpy(), want)
    assert cf.stats["compiles"] == 1


@pytest.mark.parametrize("dynamic", [False, None, True])
def test_a_float_argument_of_a_training_call_is_keyed_by_value(rng, dynamic):
    """Inference calls make a changing float a run-time scalar (§10.4); the joint graph bakes it
    in, so a training call keys it by value (it once reused the artifact of another value)."""
    cf = stax.compile(lambda x, a: (x * a).sum(), dynamic=dynamic)
    x = _t(rng, 4)
    cf(x, 0.5), cf(x, 0.7)
    xs = x.detach().requires_grad_()
    for a in (0.5, 2.0, -3.0):
        xs.grad = None
        loss = cf(xs, a)
        loss.backward()
        np.testing.assert_allclose(loss.item(), (x.numpy().astype(np.float64) * a).sum(), rtol=1e-5)
        np.testing.assert_allclose(xs.grad.numpy(), np.full(4, a))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_half_and_non_contiguous_inputs_over_batch_sizes(rng, device):
    """float16 parameters and transposed / stride-0 / strided inputs: one pair per layout, each
    serving every size, gradients equal eager autograd."""
    from conftest import assert_close

    def fn(x, w):
        return (stax.tanh(x @ w.float()) * x.sum(-1, keepdim=True)).mean()
    cf = stax.compile(fn, dynamic=True)
    w = _t(rng, 5, 3, device=device).to(stax.float16).requires_grad_()
    layouts = {"t": lambda n: _t(rng, 5, n, device=device).t(), "expand": lambda n: _t(rng, 1, 5, device=device).expand(n, 5),
               "slice": lambda n: _t(rng, n, 10, device=device)[:, ::2], "dense": lambda n: _t(rng, n, 5, device=device)}
    for n in (4, 7, 11):
        for make in layouts.values():
            x = make(n).detach().requires_grad_()
            got = []
            for f in (cf, fn):
                x.grad = w.grad = None
                f(x, w).backward()
                got.append((x.grad.cpu(), w.grad.cpu()))
            assert got[0][1].dtype is stax.float16
            assert_close(got[0][0], got[1][0], stax.float32)
            assert_close(got[0][1], got[1][1], stax.float16)
    assert cf.stats["compiles"] == len(layouts) and _backward_compiles(cf) == len(layouts), cf.stats
