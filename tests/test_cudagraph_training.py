"""§9.9 CUDA graphs for training (stax/cudagraph.py, stax/aot_autograd.py): under
mode="reduce-overhead" a call on inputs that require grad replays its forward artifact and its
backward artifact, each from a CUDA graph of its own.

Driven by tests/test_cudagraph.py's FAKE driver (its capture records the kernel launches, its
replay runs them again on the recorded buffers), through Triton's interpreter. Covered: each
graph recorded once and replayed, a training loop (SGD, AdamW from stax.optim) equal to the
compiled path without graphs step by step and to float64 numpy gradients, the pending-backward
rule (a forward while the backward of the last replay has not run runs directly), gradients kept
in `.grad` across the next backward replay, dynamic mode (no graphs, a log line) and the
STAX_LOGS=cudagraphs lines.
"""
from __future__ import annotations

import numpy as np
import pytest

import stax
import stax.nn.functional as F
from conftest import assert_close
from stax import cuda, cudagraph
from test_cudagraph import FakeDriver, fake  # noqa: F401 -- the fixture

IN, HID = 5, 13


def mlp_loss(w1, b1, w2, b2, x, y):
    return F.mse_loss(F.linear(stax.tanh(F.linear(x, w1, b1)), w2, b2), y)


def mlp_grads_ref(w1, b1, w2, b2, x, y):
    """float64 numpy: the loss and d loss / d (w1, b1, w2, b2)."""
    a = x @ w1.T + b1
    h = np.tanh(a)
    out = h @ w2.T + b2
    d_out = 2 * (out - y) / out.size
    d_h = d_out @ w2
    d_a = d_h * (1 - h * h)
    return ((out - y) ** 2).mean(), [d_a.T @ x, d_a.sum(0), d_out.T @ h, d_out.sum(0)]


def make_params(seed=1, dtype=stax.float32):
    rng = np.random.default_rng(seed)
    shapes = [(HID, IN), (HID,), (1, HID), (1,)]
    return [stax.from_numpy((rng.standard_normal(s) * 0.4).astype(np.float32)).to("cuda").to(dtype).requires_grad_()
            for s in shapes]


def batches(n, rows=7, seed=2, transposed=False):
    """`n` batches (x, y); `transposed`: x a non-contiguous view (the transpose of an IN x rows array)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((rows, IN)).astype(np.float32)
        x = stax.from_numpy(np.ascontiguousarray(x.T)).to("cuda").t() if transposed else stax.from_numpy(x).to("cuda")
        out.append((x, stax.from_numpy(rng.standard_normal((rows, 1)).astype(np.float32)).to("cuda")))
    return out


def entry_of(cf):
    (entry,) = cf.artifacts.values()
    return entry


def host(t):
    t = t.detach()
    return np.asarray((t.float() if t.dtype is stax.bfloat16 else t).cpu().numpy(), np.float64)


def train(mode, opt_name, steps, check_ref=False, dtype=stax.float32, **batch):
    params = make_params(dtype=dtype)
    f = stax.compile(mlp_loss, mode=mode)
    opt = stax.optim.AdamW(params, lr=0.05) if opt_name == "adamw" else stax.optim.SGD(params, lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(steps, **batch):    # a new batch (new addresses, new values) every step
        x, y = x.to(dtype), y.to(dtype)
        before = [host(p) for p in params]
        opt.zero_grad()
        loss = f(*params, x, y)
        loss.backward()
        if check_ref:
            ref_loss, ref_grads = mlp_grads_ref(*before, host(x), host(y))
            assert_close(loss.detach().cpu(), np.asarray(ref_loss), stax.float32)
            for p, g in zip(params, ref_grads):
                assert_close(p.grad.cpu(), g, stax.float32)
        opt.step()
        losses.append(float(loss.float().item()))
    return f, losses, [host(p) for p in params]


# ---- each artifact recorded once and replayed; equal to the path without graphs ----


@pytest.mark.parametrize("opt_name, batch", [("sgd", {}), ("adamw", {}), ("adamw", {"rows": 1}),
                                             ("sgd", {"rows": 3, "transposed": True}),
                                             ("adamw", {"dtype": stax.bfloat16})])
def test_training_loop_replays_both_artifacts_and_equals_no_graphs(fake, opt_name, batch):
    steps = 12
    f, losses, params = train("reduce-overhead", opt_name, steps, check_ref="dtype" not in batch, **batch)
    _, plain_losses, plain_params = train(None, opt_name, steps, **batch)
    np.testing.assert_array_equal(losses, plain_losses)      # the same kernels on the same data
    for a, b in zip(params, plain_params):
        np.testing.assert_array_equal(a, b)
    entry = entry_of(f)
    fwd, bwd = entry.forward, entry.backward
    assert isinstance(fwd, cudagraph.GraphedCall) and isinstance(bwd, cudagraph.GraphedCall)
    # warm-up, then recorded once and replayed every step; once more at most when the allocator
    # happened to hand a new batch the address of the last one (it looked static, then moved:
    # GraphedCall stages it from then on), a second record that replaces the first
    for g in (fwd, bwd):
        assert g.stats["direct"] == 1 and g.stats["records"] in (1, 2)
        assert steps - 2 <= g.stats["replays"] <= steps - 1
    assert 2 <= fake.graphs <= 4


def test_grads_in_dot_grad_do_not_alias_the_next_replay(fake, monkeypatch, capsys):
    """Gradient accumulation (no zero_grad between backward calls): `.grad` holds the last
    replay's output when the next backward replays; it is copied out first, so the sum is right."""
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    params = make_params()
    f = stax.compile(mlp_loss, mode="reduce-overhead")
    data = batches(5)
    for x, y in data[:2]:                    # warm-up, record
        f(*params, x, y).backward()
    for p in params:
        p.grad = None
    expect = [np.zeros(p.shape) for p in params]
    for x, y in data[2:]:                    # .grad = the replay's gradient, then .grad + the next
        f(*params, x, y).backward()
        _, grads = mlp_grads_ref(*[host(p) for p in params], host(x), host(y))
        expect = [e + g for e, g in zip(expect, grads)]
        for p, e in zip(params, expect):
            assert_close(p.grad.cpu(), e, stax.float32)
    bwd = entry_of(f).backward
    assert bwd.stats["replays"] == 4 and bwd.stats["kept"] == len(params)
    assert "mlp_loss_backward: 4 output(s) of the last replay were still referenced" in capsys.readouterr().err
    held = stax.autograd.grad(f(*params, *data[0]), params)       # held by the caller, then replayed over
    again = stax.autograd.grad(f(*params, *data[1]), params)
    for got, (x, y) in zip((held, again), data[:2]):
        _, grads = mlp_grads_ref(*[host(p) for p in params], host(x), host(y))
        for t, g in zip(got, grads):
            assert_close(t.cpu(), g, stax.float32)


# ---- the pending-backward rule ----


def recorded_mlp(x, y):
    """The parameters and the compiled MLP loss, warmed up and recorded on (x, y), no .grad left."""
    params = make_params()
    f = stax.compile(mlp_loss, mode="reduce-overhead")
    for _ in range(2):
        f(*params, x, y).backward()
    for p in params:
        p.grad = None
    return params, f


def test_forward_while_a_backward_is_pending_runs_directly(fake, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    (x0, y0), (x1, y1), (x2, y2) = batches(3)
    params, f = recorded_mlp(x0, y0)
    fwd = entry_of(f).forward
    first = f(*params, x1, y1)               # a replay: its saved tensors are in the graph's memory
    second = f(*params, x2, y2)              # would overwrite them: runs the artifact directly
    assert fwd.stats["replays"] == 2 and entry_of(f).stats["forward_direct"] == 1
    first.backward()
    ref1 = mlp_grads_ref(*[host(p) for p in params], host(x1), host(y1))
    for p, g in zip(params, ref1[1]):
        assert_close(p.grad.cpu(), g, stax.float32)
    second.backward()
    ref2 = mlp_grads_ref(*[host(p) for p in params], host(x2), host(y2))
    for p, g1, g2 in zip(params, ref1[1], ref2[1]):
        assert_close(p.grad.cpu(), g1 + g2, stax.float32)
    assert_close(first.detach().cpu(), np.asarray(ref1[0]), stax.float32)
    err = capsys.readouterr().err
    assert "mlp_loss_forward: recorded a CUDA graph" in err and "mlp_loss_backward: recorded a CUDA graph" in err
    assert "a backward still to run reads saved tensors" in err


def test_retain_graph_keeps_the_backward_pending(fake):
    (x0, y0), (x1, y1) = batches(2)
    params, f = recorded_mlp(x0, y0)
    loss = f(*params, x1, y1)
    loss.backward(retain_graph=True)
    other = f(*params, x0, y0)               # the retained backward still reads the saved tensors
    assert entry_of(f).stats["forward_direct"] == 1
    loss.backward()
    ref = mlp_grads_ref(*[host(p) for p in params], host(x1), host(y1))[1]
    for p, g in zip(params, ref):
        assert_close(p.grad.cpu(), 2 * g, stax.float32)
    other.backward()                          # and the direct call's own backward
    ref0 = mlp_grads_ref(*[host(p) for p in params], host(x0), host(y0))[1]
    for p, g, g0 in zip(params, ref, ref0):
        assert_close(p.grad.cpu(), 2 * g + g0, stax.float32)


def test_a_function_applied_twice_in_one_step(fake, rng):
    """f(f(x)): the second forward runs while the first's backward is pending; the backward
    replays twice in one pass, the first replay's gradient feeding the second (kept first)."""
    f = stax.compile(lambda x, w: stax.tanh(x * w) + 0.5 * x, mode="reduce-overhead")
    w = stax.from_numpy(rng.standard_normal(9).astype(np.float32)).to("cuda").requires_grad_()

    def ref(x, w):
        a = np.tanh(x * w)
        h = a + 0.5 * x
        b = np.tanh(h * w)
        d_h = (1 - b * b) * w + 0.5
        return ((1 - b * b) * h).sum(0) + (d_h * (1 - a * a) * x).sum(0)
    for step in range(4):
        x = stax.from_numpy(rng.standard_normal((6, 9)).astype(np.float32)).to("cuda").requires_grad_()
        w.grad = None
        f(f(x, w), w).sum().backward()
        assert_close(w.grad.cpu(), ref(host(x), host(w)), stax.float32)
    assert entry_of(f).backward.stats["replays"] >= 4 and entry_of(f).stats["forward_direct"] == 3


def test_an_overwritten_forward_output_raises(fake):
    (x0, y0), (x1, y1) = batches(2)
    params, f = recorded_mlp(x0, y0)
    kept = f(*params, x1, y1)
    kept.backward()
    f(*params, x0, y0).backward()            # a later replay of the forward
    with pytest.raises(cudagraph.OverwrittenOutputError, match=r"\.clone\(\)"):
        kept.item()


# ---- what is not graphed ----


def test_dynamic_mode_training_records_no_graph(fake, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    params = make_params()
    f = stax.compile(mlp_loss, mode="reduce-overhead", dynamic=True)
    for x, y in batches(3):
        f(*params, x, y).backward()
    assert fake.graphs == 0 and f.stats["compiles"] == 1       # one shape-polymorphic pair, no graph
    err = capsys.readouterr().err
    assert "mlp_loss_forward and mlp_loss_backward are not wrapped in CUDA graphs: dynamic mode" in err


# ---- on a GPU (the real driver) ----


@pytest.mark.gpu
@pytest.mark.skipif(not (cuda.is_available() and not cuda.interpreting()), reason="needs an NVIDIA GPU")
def test_gpu_training_loop_replays_and_equals_default():
    steps = 40
    f, losses, params = train("reduce-overhead", "adamw", steps, check_ref=True)
    _, plain_losses, plain_params = train(None, "adamw", steps)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5, atol=1e-7)
    for a, b in zip(params, plain_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    entry = entry_of(f)
    for g in (entry.forward, entry.backward):
        assert isinstance(g, cudagraph.GraphedCall) and g.broken is None
        assert g.stats["records"] == 1 and g.stats["replays"] == steps - 1
