"""§5 compiled training: the joint graph, the min-cut partition, the forward and backward artifacts.

- gradients through a compiled function against eager autograd and float64 numpy formulas, for
  pointwise ops, reductions, softmax, layer_norm, a matmul+bias+gelu MLP, views and slices,
  broadcasting; odd sizes (0, 1, 7, 1000), non-contiguous and broadcast inputs, NaN, half types;
  on the CPU and through the Triton interpreter;
- the saved set of three textbook cases, with the reason for each choice;
- autograd's rules through a compiled region (retain_graph, version counters, several outputs,
  outputs and inputs that take no part, eager ops before and after, create_graph);
- Example 5.1's backward: Listing 9.3 (tests/golden/ex5_1_backward.py, exactly, and every line of
  the listing in order) and its CPU form (tests/golden/ex5_1_backward.cpp); `--regen-goldens`
  rewrites both (tests/golden/README.md).
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import stax
from conftest import assert_close
from stax import partition as P

GOLDEN = Path(__file__).parent / "golden"
ROOT = Path(__file__).parent.parent


def _grads(fn, inputs, compiled):
    """(outputs, .grad of each input that requires grad) of sum(out * w) over fn's float outputs."""
    ins = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, stax.Tensor) else t for t in inputs]
    f = stax.compile(fn) if compiled else fn
    out = f(*ins)
    outs = out if isinstance(out, tuple) else (out,)
    loss = 0
    for k, o in enumerate(outs):
        if o.dtype.is_floating_point and o.requires_grad:
            w = stax.from_numpy(np.linspace(0.5, 1.5, max(o.numel(), 1))[:o.numel()].reshape(tuple(o.shape))
                                .astype(np.float32)).to(o.dtype).to(o.device)
            loss = loss + (o * w).sum() * (k + 1)
    loss.backward()
    return outs, [t.grad for t in ins if isinstance(t, stax.Tensor) and t.requires_grad], f


def _host(t):
    t = t.cpu()
    return t.to(stax.float32) if t.dtype is stax.bfloat16 else t


def check(fn, *inputs, dtype=None, ref=None):
    """Compiled forward and backward against eager autograd (and a numpy float64 gradient `ref`)."""
    oc, gc, f = _grads(fn, inputs, True)
    oe, ge, _ = _grads(fn, inputs, False)
    assert f.stats["eager_calls"] == 0 and f.stats["compiles"] == 1
    for a, b in zip(oc, oe):
        assert_close(_host(a), _host(b), dtype or b.dtype)
    assert len(gc) == len(ge)
    for a, b in zip(gc, ge):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.device == b.device and tuple(a.shape) == tuple(b.shape)
            assert_close(_host(a), _host(b), dtype or b.dtype)
    if ref is not None:
        for a, r in zip(gc, ref(*[t.cpu().numpy().astype(np.float64) for t in inputs])):
            np.testing.assert_allclose(a.cpu().numpy().astype(np.float64), r, rtol=2e-4, atol=2e-5)
    return f


def _t(rng, *shape, dtype=stax.float32, grad=True, device="cpu"):
    return stax.from_numpy(rng.standard_normal(shape)).to(dtype).to(device).requires_grad_(grad)


# float64 numpy gradients of sum(f(x) * w) with w = linspace(0.5, 1.5) (as `_grads` builds it)
def _w(shape):
    n = int(np.prod(shape))
    return np.linspace(0.5, 1.5, max(n, 1))[:n].reshape(shape)


def _erf(x):
    return np.vectorize(math.erf)(x)


def _gelu_grad(x):
    return 0.5 * (1 + _erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _softmax_ref(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    y = e / e.sum(-1, keepdims=True)
    w = _w(x.shape)
    return [y * (w - (w * y).sum(-1, keepdims=True))]


def _layer_norm_ref(x, wt, b):
    n = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xhat = (x - mu) * rstd
    g = _w(x.shape)
    gx = g * wt
    dx = rstd / n * (n * gx - gx.sum(-1, keepdims=True) - xhat * (gx * xhat).sum(-1, keepdims=True))
    return [dx, (g * xhat).sum(0), g.sum(0)]


def _mlp_ref(x, w, b):
    h = x @ w + b
    g = _w(h.shape) * _gelu_grad(h)
    return [g @ w.T, x.T @ g, g.sum(0)]


CASES = {
    "pointwise": (lambda x, y: stax.sin(x) * y + stax.exp(x) / (1 + y * y), [(7, 5), (7, 5)],
                  lambda x, y: [_w(x.shape) * (np.cos(x) * y + np.exp(x) / (1 + y * y)),
                                _w(x.shape) * (np.sin(x) - 2 * y * np.exp(x) / (1 + y * y) ** 2)]),
    "broadcast": (lambda x, b: (x + b) * (x - b), [(8, 6), (6,)],
                  lambda x, b: [_w(x.shape) * 2 * x, (_w(x.shape) * -2 * b).sum(0)]),
    "reductions": (lambda x: (x.sum(-1) ** 2, x.mean(0)), [(9, 13)], None),
    "softmax": (lambda x: stax.softmax(x, -1), [(9, 13)], _softmax_ref),
    "layer_norm": (lambda x, w, b: stax.layer_norm(x, (13,), w, b), [(9, 13), (13,), (13,)], _layer_norm_ref),
    "mlp": (lambda x, w, b: stax.gelu(x @ w + b), [(16, 32), (32, 8), (8,)], _mlp_ref),
    "views": (lambda x: (x[1:, ::2].t() * x[:-1, 1::2].t(), x.reshape(-1)[3:9], x.permute(1, 0)[2]), [(7, 10)],
              None),
    # a saved value that is a strided view of a matmul's result: the forward returns it dense,
    # and the backward (compiled at first use) takes the layout it gets
    "saved_view": (lambda x, w, v: (x @ w)[:, 1:5:2] * v[:, :2], [(6, 4), (4, 8), (6, 3)], None),
    "gelu_1000": (lambda x: stax.gelu(x), [(1000,)], lambda x: [_w(x.shape) * _gelu_grad(x)]),
    "size_1": (lambda x, y: (x * y).sum(), [(1,), (1, 1)], lambda x, y: [0.5 * y.reshape(1), 0.5 * x.reshape(1, 1)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_eager_and_numpy(name, rng):
    fn, shapes, ref = CASES[name]
    check(fn, *[_t(rng, *s) for s in shapes], ref=ref)


@pytest.mark.parametrize("name", ["pointwise", "softmax", "layer_norm", "mlp", "views"])
def test_gradients_through_triton(name, rng):
    fn, shapes, ref = CASES[name]
    check(fn, *[_t(rng, *s, device="cuda") for s in shapes], ref=ref)


def test_odd_inputs_non_contiguous_broadcast_empty_nan_half(rng):
    x = _t(rng, 10, 7)
    check(lambda a, b: stax.tanh(a) * b, x.t(), _t(rng, 1, 10).expand(7, 10))   # non-leaf, views
    check(lambda a: stax.relu(a) * 3, _t(rng, 0, 5))                             # size 0
    a = _t(rng, 7, grad=False)
    a[2], a[4] = float("nan"), float("inf")
    check(lambda a, b: (a * b).exp(), a.requires_grad_(), _t(rng, 7))
    for dt in (stax.float16, stax.bfloat16):
        check(lambda a, w: stax.gelu(a @ w), _t(rng, 4, 6, dtype=dt), _t(rng, 6, 3, dtype=dt), dtype=dt)


def test_inputs_and_outputs_that_take_no_part(rng):
    """An input that does not require grad gets no .grad; an int output carries no gradient; an
    output that is the input itself, or a view of it, is rebuilt from the input under autograd."""
    def fn(x, y):
        return x * y, x.argmax(), x, x[1:]
    f = check(fn, _t(rng, 5), _t(rng, 5, grad=False))
    x, y = _t(rng, 5), _t(rng, 5, grad=False)
    out, idx, same, view = f(x, y)
    assert same is x and idx.grad_fn is None and not idx.requires_grad
    (out.sum() + view.sum() * 2).backward()
    expect = y.numpy().copy()
    expect[1:] += 2
    np.testing.assert_allclose(x.grad.numpy(), expect, rtol=1e-6)
    assert y.grad is None


def test_several_outputs_an_unused_one_gets_zeros_and_eager_ops_around(rng):
    a = _t(rng, 6)
    g = stax.compile(lambda t: (t.exp(), t * 3, (t * t).sum()))
    u, v, s = g(a * 2)                      # an eager op before, and after
    (u.sum() * 2 + s).backward()
    x = a.detach().numpy().astype(np.float64)
    np.testing.assert_allclose(a.grad.numpy(), 4 * np.exp(2 * x) + 8 * x, rtol=1e-5)
    a.grad = None
    stax.autograd.grad(g(a)[1].sum(), a)    # autograd.grad: .grad untouched
    assert a.grad is None
    assert g.stats["compiles"] == 1 and g.stats["eager_calls"] == 0   # a leaf or not: one key


def test_retain_graph_second_backward_and_saved_tensors_changed_in_place(rng):
    f = stax.compile(lambda x, y: (x * y).sum())
    x, y = _t(rng, 5), _t(rng, 5, grad=False)
    loss = f(x, y)
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * y.numpy())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    loss = f(x, y)
    with stax.no_grad():
        y.add_(1)                           # y is saved for the backward (an input: free to save)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(NotImplementedError, match="create_graph"):
        stax.autograd.grad(f(x, y), x, create_graph=True)


def test_in_place_ops_inside_the_function(rng):
    """An in-place update differentiates as in eager; one that overwrites a value the backward
    needs raises in both."""
    def ok(x):
        h = x * 2
        h.mul_(x)
        h.add_(h.sin())
        return h.sum()

    def bad(x):
        h = x * 2
        y = h * h
        h.mul_(3)
        return (y + h).sum()
    check(lambda x: ok(x), _t(rng, 6))
    f = stax.compile(bad)
    for fn in (bad, f):
        loss = fn(_t(rng, 4))               # the forward runs (eager raises only in backward)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert f.stats["eager_calls"] == 1      # its backward cannot be traced: eager, as eager is


def test_an_op_without_a_derivative_raises_in_backward_as_in_eager(rng):
    f = stax.compile(lambda x: stax.cumprod(x, 0).sum())
    loss = f(_t(rng, 5))
    assert float(loss) == pytest.approx(float(loss))
    with pytest.raises(NotImplementedError, match="derivative of cumprod"):
        loss.backward()


def test_key_holds_requires_grad_and_backward_compiles_on_first_use(rng):
    from stax import aot_autograd
    f = stax.compile(lambda x, w: (x @ w).relu().sum())
    x, w = _t(rng, 4, 3), _t(rng, 3, 2)
    loss = f(x, w)
    entry = next(e for e in f.artifacts.values() if isinstance(e, aot_autograd.TrainingEntry))
    assert entry.backward is None            # not compiled until a gradient is asked for
    loss.backward()
    assert entry.stats["backward_compiles"] == 1
    f(x, w).backward()
    assert entry.stats["backward_compiles"] == 1
    with stax.no_grad():
        plain = f(x, w)                      # grad mode off: the inference artifact
    assert plain.grad_fn is None and f.stats["compiles"] == 2
    f(x.detach(), w)                         # another requires_grad pattern: another artifact
    assert f.stats["compiles"] == 3 and f.stats["eager_calls"] == 0


def test_dropout_mask_is_saved_not_drawn_again(rng):
    """A random op is never recomputed: the backward uses the forward's mask."""
    import stax.nn.functional as F
    x = _t(rng, 200)
    out = stax.compile(lambda x: F.dropout(x, 0.5, training=True))(x)
    out.sum().backward()
    kept = out.detach().numpy() != 0
    np.testing.assert_allclose(x.grad.numpy(), np.where(kept, 2.0, 0.0))


# ---- §5 the min-cut's saved set on three textbook cases ----


def _saved(fn, *shapes):
    ins = [stax.randn(*s, requires_grad=True) for s in shapes]
    part = P.partition(P.capture_joint(fn, ins))
    return [(n.op, tuple(n.meta.shape)) for n in part.saved], part


def test_gelu_saves_its_input_only():
    """GELU's backward needs x alone (GELU'(x) = Phi(x) + x phi(x)); x is an input, free to save,
    so the cut costs 0 bytes and every pointwise op is recomputed in the backward."""
    saved, part = _saved(lambda x: stax.gelu(x), (64, 32))
    assert saved == [("placeholder", (64, 32))]
    assert part.forward.outputs == part.forward.outputs[:1]      # only the result leaves the forward


def test_softmax_saves_its_input_and_the_two_row_statistics():
    """Stax's softmax is a composite (amax, sub, exp, sum, div), and amax's derivative reads x and
    the row max; so x must reach the backward (an input: free), and then the cheapest cut saves the
    row max and the row sum (reductions, never recomputed: 2 floats a row) and recomputes exp(x - m)
    instead of saving it or the output (a float per element). PyTorch saves the output instead,
    because there softmax is one op whose derivative is written in terms of its output."""
    saved, part = _saved(lambda x: stax.softmax(x, -1), (64, 100))
    assert saved == [("placeholder", (64, 100)), ("amax", (64, 1)), ("sum", (64, 1))]
    assert sum(P.nbytes(n) for n, w in zip(part.saved, part.saved_from) if w[0] == "output") == 2 * 64 * 4


def test_layer_norm_saves_x_mean_and_rstd():
    """The backward needs x - mean and rstd. The two sums are reductions (never recomputed); every
    cut through a row statistic costs the same 4 bytes a row, and of equal cuts the one nearest
    the backward is taken: the mean (the first sum divided by n) and rstd (rsqrt(var + eps)), the
    textbook choice, with x (free) to recompute x - mean."""
    saved, _ = _saved(lambda x: stax.layer_norm(x, (100,)), (64, 100))
    assert saved == [("placeholder", (64, 100)), ("div", (64, 1)), ("rsqrt", (64, 1))]


def test_the_mlp_layer_saves_the_matmul_operands_and_the_pre_activation():
    saved, _ = _saved(lambda x, w, b: stax.gelu(x @ w + b), (8, 16), (16, 32), (32,))
    assert saved == [("placeholder", (8, 16)), ("placeholder", (16, 32)), ("add", (8, 32))]


def test_partition_log(capfd, monkeypatch, rng):
    monkeypatch.setenv("STAX_LOGS", "partition")
    stax.compile(lambda x: stax.gelu(x).sum())(_t(rng, 2048))
    err = capfd.readouterr().err
    assert "==== stax partition: <lambda> ====" in err
    assert "forward graph:" in err and "backward graph:" in err
    assert "primals_1: float32[2048] 8192 bytes (an input: free to save)" in err


# ---- §5 Example 5.1: gelu(x).sum() over 2048 floats, then .backward(): Listing 9.3 ----


def _ex5_1(device):
    gen = stax.generate(lambda x: stax.gelu(x).sum(), stax.randn(2048, requires_grad=True), device=device)
    assert isinstance(gen.backward, stax.Generated) and isinstance(gen, stax.Generated)
    return "\n".join(gen.backward.kernels.values()) + "\n\n" + gen.backward.wrapper


@pytest.mark.parametrize("device,path", [("cuda", "ex5_1_backward.py"), ("cpu", "ex5_1_backward.cpp")])
def test_example_5_1_backward_golden(device, path, request):
    text = _ex5_1(device)
    if request.config.getoption("--regen-goldens"):
        (GOLDEN / path).write_text(text)
    assert (GOLDEN / path).exists(), f"{path} missing: run pytest tests/test_training.py --regen-goldens"
    assert text == (GOLDEN / path).read_text(), f"generated backward of Example 5.1 differs from {path}"


def test_listing_9_3_lines_appear_in_order():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_gpu import _listing_lines, _normalize
    golden = [_normalize(line) for line in (GOLDEN / "ex5_1_backward.py").read_text().splitlines()]
    pos, missing = 0, []
    for line in _listing_lines((GOLDEN / "listing_9_3.txt").read_text()):
        try:
            pos = golden.index(_normalize(line), pos) + 1
        except ValueError:
            missing.append(line)
    assert not missing, f"listing 9.3: lines not found in order in the golden: {missing}"


# ---- §5 the example: a fully compiled training step ----


def test_train_mlp_fully_compiled_equals_eager():
    sys.path.insert(0, str(ROOT / "examples"))
    import train_mlp
    eager = train_mlp.train(steps=25, compiled=False, verbose=False)
    full = train_mlp.train(steps=25, compiled=True, verbose=False, compiled_model=True)
    np.testing.assert_allclose(full, eager, rtol=2e-5, atol=1e-6)
    assert full[-1] < full[0] * 0.7


def test_gpt2_block_gradients_match_eager(rng):
    """examples/gpt2_block.py (parameters in a dict, split, masked_fill, softmax, tanh-GELU,
    layer_norm, cross_entropy with ignored targets): every parameter's gradient equals eager's."""
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt2_block as G
    stax.manual_seed(0)
    p = {k: v.requires_grad_() for k, v in G.init_params().items()}
    bias = stax.tril(stax.ones(G.BLOCK, G.BLOCK)).view(1, 1, G.BLOCK, G.BLOCK)
    x = _t(rng, 2, G.BLOCK, G.N_EMBD)
    t = stax.randint(0, G.VOCAB, (2, G.BLOCK))
    t[0, :3] = -1
    G.block_loss(x, t, p, bias)[1].backward()
    eager = {k: v.grad for k, v in p.items()}
    for v in p.values():
        v.grad = None
    f = stax.compile(G.block_loss)
    logits, loss = f(x, t, p, bias)
    loss.backward()
    assert f.stats["eager_calls"] == 0 and logits.requires_grad
    for k, v in p.items():
        assert_close(v.grad, eager[k], stax.float32, msg=k)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cross_entropy_backward_is_one_pass_over_the_logits(device, rng, monkeypatch):
    """An LM head's loss: the logits' gradient (softmax - one-hot) / valid rows is one kernel, with
    the target's one-hot a pointwise compare (no zeros (N, V) tensor scattered into), stored once
    and read by both GEMMs (the weight's gradient reads it transposed, in place)."""
    if device == "cuda":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    import stax.nn.functional as F
    n, c, v = 12, 8, 37
    h, w = _t(rng, n, c, device=device), _t(rng, v, c, device=device)
    t_np = rng.integers(0, v, (n,))
    t_np[[2, 7]] = 3                                   # two ignored rows
    t = stax.from_numpy(t_np).to(device)
    fn = lambda h, w, t: F.cross_entropy(F.linear(h, w), t, ignore_index=3)   # noqa: E731
    gen = stax.generate(fn, h, w, t)
    assert len([k for k in gen.backward.kernels if "_tem_" not in k]) == 1
    assert "index_put" not in gen.backward.wrapper and "scatter" not in " ".join(gen.backward.kernels.values())
    f = check(fn, h, w, t)
    assert f.stats["compiles"] == 1
    H, W = h.detach().cpu().numpy().astype(np.float64), w.detach().cpu().numpy().astype(np.float64)
    x = H @ W.T
    p = np.exp(x - x.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    valid = t_np != 3
    g = (p - np.eye(v)[t_np]) * valid[:, None] / valid.sum()
    hc, wc = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    stax.compile(fn)(hc, wc, t).backward()
    np.testing.assert_allclose(hc.grad.cpu().numpy(), g @ W, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(wc.grad.cpu().numpy(), g.T @ H, rtol=1e-4, atol=1e-6)
