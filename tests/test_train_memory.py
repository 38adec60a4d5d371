"""§5 / §7.5 (issue 16): a compiled training step's peak device memory, and the matmul gradients
that keep it near the floor.

- `stax.cuda.max_memory_allocated()` / `reset_peak_memory_stats()` / `memory_allocated()` count
  the interpreted "cuda" arrays under TRITON_INTERPRET=1 as the caching allocator counts device
  blocks (the same `round_size`), so these run in CI without a GPU;
- the peak of one step (forward + backward + AdamW) of an MLP is at most its parameters, their
  gradients and AdamW's two moments plus the activations the step keeps: a bound computed from the
  model, with the widths chosen so that one extra weight-sized buffer breaks it;
- the gradients behind it, against float64 numpy: an N-D input times a 2-D matrix gives the
  matrix's gradient as one 2-D product over all rows (read in place when the rows merge, copied
  when not), and F.linear's weight gets it straight out of one GEMM (no transposing copy, no
  per-batch partials); a whole buffer returned under another shape is not copied.
"""
import gc
import sys
from pathlib import Path

import numpy as np
import pytest

import stax
import stax.nn.functional as F
from stax import cuda

ROOT = Path(__file__).parent.parent
needs_interpreter = pytest.mark.skipif(not cuda.interpreting(), reason="counts interpreted 'cuda' arrays "
                                       "(on a GPU: bench/gpu.py train measures the same thing)")


def _cuda(a):
    return stax.tensor(np.ascontiguousarray(a, np.float32), device="cuda")


# ---- the counters ----


@needs_interpreter
def test_counters_follow_interpreted_arrays():
    gc.collect()
    base = cuda.memory_allocated()
    cuda.reset_peak_memory_stats()
    assert cuda.max_memory_allocated() == base
    x = stax.zeros(1000, 3, device="cuda")              # 12000 bytes -> 12288 (512 B granules)
    assert cuda.memory_allocated() == base + cuda.round_size(12000) == base + 12288
    y = stax.zeros(7, device="cuda")
    assert cuda.memory_allocated() == base + 12288 + 512
    view = x[::2]                                       # a view keeps its storage counted
    del x, y
    gc.collect()
    assert cuda.memory_allocated() == base + 12288
    del view
    gc.collect()
    assert cuda.memory_allocated() == base
    assert cuda.max_memory_allocated() == base + 12288 + 512
    assert cuda.memory_stats()["peak_allocated_bytes"] == cuda.max_memory_allocated()


# ---- the peak of a training step ----


def _mlp(width, layers):
    def loss(*a):
        h = a[-2]
        for i in range(layers):
            h = F.linear(h, a[2 * i], a[2 * i + 1])
            h = F.gelu(h) if i < layers - 1 else h
        return F.mse_loss(h, a[-1])
    return loss


@needs_interpreter
@pytest.mark.parametrize("width,batch,layers", [(128, 8, 3), (96, 7, 2)])
def test_mlp_step_peak_is_params_grads_moments_and_activations(width, batch, layers, rng):
    """What a step must hold: parameters P, gradients P, AdamW's moments 2P, the inputs, and the
    activations (each layer's input and pre-activation saved by the forward, two more in flight in
    the backward). One weight-sized buffer more (the transposing copy of a weight's gradient, or a
    second copy of the gradients) is larger than the whole activation allowance, so it fails."""
    R = cuda.round_size
    params = []
    for _ in range(layers):
        params += [_cuda(rng.standard_normal((width, width)) * width ** -0.5), _cuda(np.zeros(width))]
    for p in params:
        p.requires_grad_()
    x, target = _cuda(rng.standard_normal((batch, width))), _cuda(rng.standard_normal((batch, width)))
    f, opt = stax.compile(_mlp(width, layers)), stax.optim.AdamW(params, lr=1e-3)

    def step():
        opt.zero_grad()
        loss = f(*params, x, target)
        loss.backward()
        opt.step()
        return float(loss.item())
    first = step()                                      # compiles forward, backward, AdamW's step
    gc.collect()
    cuda.reset_peak_memory_stats()
    before = cuda.memory_allocated()
    second = step()
    gc.collect()
    peak = cuda.max_memory_allocated() - before         # what the step adds to what it found
    assert second < first
    weights = sum(R(p.numel() * 4) for p in params)
    act = R(batch * width * 4)
    # found: params, last step's grads, 2 moments (4P) and x, target; the step frees the old grads
    # (zero_grad) before the new ones exist, so it adds activations only (plus 0-d scalars)
    allowance = (2 * layers + 2) * act + 8 * 512
    assert peak <= allowance, (peak, allowance)
    assert R(width * width * 4) > allowance             # ... so one weight-sized buffer more fails
    assert cuda.max_memory_allocated() <= 4 * weights + 2 * act + allowance


@needs_interpreter
def test_saved_tensors_are_freed_as_the_backward_runs(rng):
    """Without retain_graph the compiled node lets go of its saved activations before the backward
    artifact runs, so each is freed after its last use in it: the backward's peak is lower than
    with retain_graph=True (which keeps them all to the end) by at least one activation."""
    w = [_cuda(rng.standard_normal((16, 16)) * 0.25).requires_grad_() for _ in range(4)]
    x = _cuda(rng.standard_normal((2048, 16)))
    act = cuda.round_size(2048 * 16 * 4)

    def fn(x, *w):
        for m in w:
            x = stax.tanh(x @ m)
        return x.sum()
    f = stax.compile(fn)
    f(x, *w).backward()                                 # compile both artifacts
    peaks = {}
    for retain in (True, False):
        for m in w:
            m.grad = None
        loss = f(x, *w)
        node = loss._grad_fn
        assert sum(t.numel() == 2048 * 16 and t is not x for t in node.saved) >= 3
        gc.collect()
        before = cuda.memory_allocated()
        cuda.reset_peak_memory_stats()
        loss.backward(retain_graph=retain)
        peaks[retain] = cuda.max_memory_allocated() - before
        assert (node.saved is None) == (not retain)
        assert all(m.grad is not None for m in w)
        del loss, node
    assert peaks[False] + act <= peaks[True], peaks


# ---- the gradients behind it, against float64 numpy ----


def _grads(fn, arrays, compiled, device):
    ts = [stax.tensor(a.astype(np.float32), device=device).requires_grad_() for a in arrays]
    g = stax.compile(fn) if compiled else fn
    out = g(*ts)
    wgt = np.linspace(0.5, 1.5, out.numel()).reshape(tuple(out.shape)).astype(np.float32)
    (out * stax.tensor(wgt, device=device)).sum().backward()
    return out.cpu().numpy(), [t.grad for t in ts], wgt


def _check(fn, ref, arrays, device):
    """Compiled and eager equal the float64 formula; the compiled weight gradient is contiguous,
    as the weight (eager autograd keeps a transposed product's strides: PyTorch's AccumulateGrad
    would copy it to the weight's layout, Stax's engine does not)."""
    want_out = ref(*[a.astype(np.float64) for a in arrays])
    for compiled in (False, True):
        out, grads, wgt = _grads(fn, arrays, compiled, device)
        np.testing.assert_allclose(out, want_out, rtol=2e-4, atol=2e-5)
        want = _numeric_grads(ref, arrays, wgt)
        for g, w, a in zip(grads, want, arrays):
            assert tuple(g.shape) == a.shape
            np.testing.assert_allclose(g.cpu().numpy(), w, rtol=2e-4, atol=2e-5)
        assert grads[1].is_contiguous() or not compiled


def _numeric_grads(ref, arrays, wgt):
    """Exact gradients of sum(ref(...) * wgt) for the bilinear refs below (linear in each input)."""
    out = []
    a64 = [a.astype(np.float64) for a in arrays]
    base = (ref(*a64) * wgt).sum()
    for i, a in enumerate(a64):
        g = np.zeros_like(a)
        flat = g.reshape(-1)
        for j in range(a.size):             # linear in each input: a unit step is exact
            e = [b.copy() for b in a64]
            e[i].reshape(-1)[j] += 1.0
            flat[j] = (ref(*e) * wgt).sum() - base
        out.append(g)
    return out


LINEAR = {   # name: (fn, float64 reference, shapes)
    "linear_3d": (lambda x, w: F.linear(x, w), lambda x, w: x @ w.T, [(2, 7, 5), (3, 5)]),
    "linear_4d_ones": (lambda x, w: F.linear(x, w), lambda x, w: x @ w.T, [(1, 3, 1, 5), (7, 5)]),
    "matmul_3d": (lambda x, w: x @ w, lambda x, w: x @ w, [(3, 4, 6), (6, 1)]),
    # rows that do not merge as a view (a stride-2 slice of the batch dim): the product is batched
    "matmul_sliced": (lambda x, w: x[::2] @ w.t(), lambda x, w: x[::2] @ w.T, [(5, 3, 4), (2, 4)]),
    "linear_2d": (lambda x, w: F.linear(x, w), lambda x, w: x @ w.T, [(1, 9), (7, 9)]),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", list(LINEAR))
def test_matmul_gradients_fold_and_keep_the_weight_layout(name, device, rng):
    fn, ref, shapes = LINEAR[name]
    _check(fn, ref, [rng.standard_normal(s) for s in shapes], device)


def test_linear_backward_makes_the_weight_gradient_in_one_gemm():
    """GPT-2's shape in small: F.linear of a (B, T, C) input. The backward has one 2-D product (one
    batch) and returns its output as the weight's gradient: no batched partials summed, no
    transposing copy."""
    x = stax.randn(4, 8, 16)
    w, b = stax.randn(24, 16).requires_grad_(), stax.randn(24).requires_grad_()
    bwd = stax.generate(lambda x, w, b: F.gelu(F.linear(x, w, b)).sum(), x, w, b, device="cuda").backward
    (mm,) = [k for k in bwd.kernels if "tem_fused_mm" in k]
    launch = next(line.strip() for line in bwd.wrapper.splitlines() if f"{mm}.run(" in line)
    returned = bwd.wrapper.strip().splitlines()[-1]         # return (grad_w, grad_b)
    grad_w = returned.split("(")[1].split(",")[0].strip()
    assert launch.startswith(f"{mm}.run(") and f", {grad_w}, 1, 24, 16, 32," in launch   # b=1, m, n, k


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_whole_buffer_reshaped_is_returned_without_a_copy(device, rng):
    """A product computed as (B*T, N) and returned as (B, T, N): the output is the buffer itself
    (`reshaped_output`), not a copy: a tensor of its own (no view), equal to float64 numpy, and
    writable without touching anything else."""
    x, w = rng.standard_normal((2, 7, 5)), rng.standard_normal((5, 3))
    fn = lambda x, w: (x.reshape(14, 5) @ w).reshape(2, 7, 3)       # noqa: E731
    xs, ws = (stax.tensor(a.astype(np.float32), device=device) for a in (x, w))
    gen = stax.generate(fn, xs, ws, device=device)
    assert "reshaped_output(" in gen.wrapper.strip().splitlines()[-1]
    assert len(gen.kernels) == (0 if device == "cpu" else 1)        # the matmul alone
    out = stax.compile(fn)(xs, ws)
    np.testing.assert_allclose(out.cpu().numpy(), x @ w, rtol=1e-4, atol=1e-5)
    assert tuple(out.shape) == (2, 7, 3) and out.is_contiguous() and out._base is None
    out.add_(1)
    np.testing.assert_allclose(out.cpu().numpy(), x @ w + 1, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_shared_2d_key_and_value_in_attention(device, rng):
    """softmax(q kᵀ s) v with one 2-D k and v for every batch of q: the matmuls keep them 2-D (the
    attention rewrite sees 2-D operands); compiled equals float64 numpy."""
    q, k, v = rng.standard_normal((2, 5, 8)), rng.standard_normal((6, 8)), rng.standard_normal((6, 7))
    fn = lambda q, k, v: stax.softmax(q @ k.t() * 0.3, -1) @ v      # noqa: E731
    s = q @ k.T * 0.3
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    ts = [stax.tensor(a.astype(np.float32), device=device) for a in (q, k, v)]
    np.testing.assert_allclose(stax.compile(fn)(*ts).cpu().numpy(), want, rtol=1e-4, atol=1e-5)
