"""stax.optim: SGD and AdamW against float64 numpy references of torch.optim's algorithms over
several steps (odd shapes, float32 and float16 parameters, weight decay, momentum, nesterov,
amsgrad, maximize, a parameter without a gradient), one compiled artifact per step shape (no
recompile on the second step), state_dict round trips, the training example, and one step through
the GPU back end (Triton's interpreter without a GPU)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import stax

rng = np.random.default_rng(16)
SHAPES = [(7, 5), (13,), (1,), (3, 1, 4)]


def make_params(dtype, shapes=SHAPES, device="cpu"):
    arrays = [rng.standard_normal(s) for s in shapes]
    params = [stax.tensor(a, dtype=dtype, device=device, requires_grad=True) for a in arrays]
    return params, [host(p) for p in params]


def host(t):
    """A tensor's values as float64 numpy, from any device."""
    return t.detach().cpu().numpy().astype(np.float64)


def set_grads(params, skip=()):
    """Fresh random gradients (None for the indices in skip); their float64 values as numpy."""
    out = []
    for i, p in enumerate(params):
        if i in skip:
            p.grad = None
            out.append(None)
            continue
        g = stax.tensor(rng.standard_normal(tuple(p.shape)) * 0.5, dtype=p.dtype, device=p.device)
        p.grad = g
        out.append(host(g))
    return out


# ---- float64 references: torch.optim's single-tensor algorithms, transcribed ----


def ref_sgd(p, g, state, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False):
    g = -g if maximize else g
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        buf = state.get("buf")
        buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
        state["buf"] = buf
        g = g + momentum * buf if nesterov else buf
    return p - lr * g


def ref_adamw(p, g, state, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
              maximize=False):
    g = -g if maximize else g
    b1, b2 = betas
    step = state["step"] = state.get("step", 0) + 1
    m, v = state.get("m", np.zeros_like(p)), state.get("v", np.zeros_like(p))
    p = p * (1 - lr * weight_decay)
    m = m + (1 - b1) * (g - m)
    v = b2 * v + (1 - b2) * g * g
    state["m"], state["v"] = m, v
    if amsgrad:
        v = state["vmax"] = np.maximum(state.get("vmax", np.zeros_like(p)), v)
    denom = np.sqrt(v) / math.sqrt(1 - b2 ** step) + eps
    return p - (lr / (1 - b1 ** step)) * m / denom


def run_against_reference(make_opt, ref, dtype, kw, steps=4, skip_at=None, device="cpu"):
    params, ref_p = make_params(dtype, device=device)
    opt = make_opt(params, **kw)
    states = [{} for _ in params]
    for k in range(steps):
        grads = set_grads(params, skip=(1,) if k == skip_at else ())
        opt.step()
        for i, g in enumerate(grads):
            if g is not None:
                ref_p[i] = ref(ref_p[i], g, states[i], **kw)
    return opt, params, ref_p


TOL = {stax.float32: dict(rtol=1e-5, atol=1e-6), stax.float16: dict(rtol=4e-3, atol=4e-3)}

SGD_CASES = [dict(lr=0.1), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.1),
             dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01), dict(lr=0.1, momentum=0.5, maximize=True)]
ADAMW_CASES = [dict(), dict(lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
               dict(lr=0.01, amsgrad=True), dict(lr=0.02, eps=1e-3, weight_decay=0.0, maximize=True)]


@pytest.mark.parametrize("dtype", [stax.float32, stax.float16])
@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_matches_reference(kw, dtype):
    _, params, ref_p = run_against_reference(stax.optim.SGD, ref_sgd, dtype, kw, skip_at=2)
    for p, r in zip(params, ref_p):
        # float16 parameters: PyTorch rounds after each op, the fused kernel once (closer to float64)
        np.testing.assert_allclose(p.detach().numpy().astype(np.float64), r, **TOL[dtype])


@pytest.mark.parametrize("dtype", [stax.float32, stax.float16])
@pytest.mark.parametrize("kw", ADAMW_CASES)
def test_adamw_matches_reference(kw, dtype):
    _, params, ref_p = run_against_reference(stax.optim.AdamW, ref_adamw, dtype, kw, skip_at=2)
    for p, r in zip(params, ref_p):
        np.testing.assert_allclose(p.detach().numpy().astype(np.float64), r, **TOL[dtype])


def test_step_is_one_artifact_and_does_not_recompile():
    params, _ = make_params(stax.float32)
    opt = stax.optim.AdamW(params, lr=0.01)
    for k in range(3):
        set_grads(params)
        opt.step()
        if k == 1:
            opt.param_groups[0]["lr"] = 0.005        # a scheduler's change: a 0-d tensor input too
    assert opt._fn.stats["compiles"] == 1 and opt._fn.stats["eager_calls"] == 0
    gen = opt._fn.last_generated
    # one kernel per parameter size: each reads its grad and states once and writes them back once
    assert len(gen.kernels) == len({math.prod(s) for s in SHAPES})
    assert "return ()" in gen.wrapper                     # every write lands in the inputs in place


def test_equal_sized_parameters_share_one_kernel():
    """Horizontal fusion: an MLP's weights (one size) and biases (another) update in two kernels."""
    params, ref_p = make_params(stax.float32, shapes=[(6, 5), (5,), (5, 6), (5,), (30,)])
    opt = stax.optim.AdamW(params, lr=0.01)
    states = [{} for _ in params]
    for g, i in zip(set_grads(params), range(len(params))):
        ref_p[i] = ref_adamw(ref_p[i], g, states[i], lr=0.01)
    opt.step()
    assert len(opt._fn.last_generated.kernels) == 2
    for p, r in zip(params, ref_p):
        np.testing.assert_allclose(host(p), r, **TOL[stax.float32])


def test_sgd_momentum_compiles_first_step_and_rest():
    params, _ = make_params(stax.float32)
    opt = stax.optim.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(3):
        set_grads(params)
        opt.step()
    assert opt._fn.stats["compiles"] == 2                 # the first step (buffers := grad), the rest


def test_mixed_dtypes_are_separate_batches():
    p32, r32 = make_params(stax.float32, shapes=[(5, 3)])
    p16, r16 = make_params(stax.float16, shapes=[(9,)])
    opt = stax.optim.SGD(p32 + p16, lr=0.1)
    g = set_grads(p32 + p16)
    opt.step()
    np.testing.assert_allclose(p32[0].detach().numpy(), r32[0] - 0.1 * g[0], rtol=1e-6)
    np.testing.assert_allclose(p16[0].detach().numpy().astype(np.float64), r16[0] - 0.1 * g[1], rtol=2e-3,
                               atol=2e-3)
    assert p16[0].dtype == stax.float16 and opt._fn.stats["compiles"] == 2


def test_param_groups_zero_grad_and_state_dict_round_trip():
    params, _ = make_params(stax.float32)
    opt = stax.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}], lr=0.01)
    assert opt.param_groups[1]["lr"] == 0.1 and opt.param_groups[0]["lr"] == 0.01
    set_grads(params)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][1]["params"] == [2, 3] and sd["state"][0]["step"] == 1
    clone = [stax.tensor(p.detach(), requires_grad=True) for p in params]
    opt2 = stax.optim.AdamW([{"params": clone[:2]}, {"params": clone[2:]}], lr=0.5)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[1]["lr"] == 0.1
    for a, b in zip(params, clone):
        a.grad = b.grad = stax.tensor(rng.standard_normal(tuple(a.shape)), dtype=stax.float32)
    opt.step()
    opt2.step()
    for a, b in zip(params, clone):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-6)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    opt2.zero_grad(set_to_none=False)
    assert all((p.grad.numpy() == 0).all() for p in clone)


def test_bad_inputs_raise():
    x = stax.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="require grad"):
        stax.optim.SGD([x], lr=0.1)
    w = stax.tensor([1.0], requires_grad=True)
    with pytest.raises(ValueError, match="nesterov"):
        stax.optim.SGD([w], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        stax.optim.AdamW([w], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="more than one"):
        stax.optim.AdamW([{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match="non-empty"):
        stax.optim.AdamW([])


def test_nan_gradient_propagates_like_eager():
    params, _ = make_params(stax.float32, shapes=[(6,)])
    opt = stax.optim.AdamW(params, lr=0.01)
    params[0].grad = stax.tensor([1.0, float("nan"), float("inf"), -1.0, 0.5, 2.0], dtype=stax.float32)
    opt.step()
    out = params[0].detach().numpy()
    assert np.isnan(out[1]) and np.isnan(out[2]) and np.isfinite(out[[0, 3, 4, 5]]).all()


def test_gpu_step_through_triton():
    """The same AdamW step on device='cuda' (Triton's interpreter when there is no GPU)."""
    kw = dict(lr=0.01, amsgrad=True)
    opt, params, ref_p = run_against_reference(stax.optim.AdamW, ref_adamw, stax.float32, kw, steps=2,
                                               device="cuda")
    assert all(name.startswith("triton_") for name in opt._fn.last_generated.kernels)
    assert opt._fn.stats["compiles"] == 1
    for p, r in zip(params, ref_p):
        np.testing.assert_allclose(host(p), r, **TOL[stax.float32])


def test_train_mlp_example_compiled_equals_eager():
    """examples/train_mlp.py: the compiled optimizer step gives the eager step's losses."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        import train_mlp
    finally:
        sys.path.pop(0)
    compiled = train_mlp.train(steps=30, compiled=True, verbose=False)
    eager = train_mlp.train(steps=30, compiled=False, verbose=False)
    np.testing.assert_allclose(compiled, eager, rtol=1e-4, atol=1e-6)
    assert compiled[-1] < 0.5 * compiled[0]


def test_non_contiguous_and_broadcast_gradients():
    """A transposed gradient and an expanded (stride-0) one: those parameters stay unflattened."""
    params, ref_p = make_params(stax.float32, shapes=[(6, 5), (4, 3), (30,)])
    gt = rng.standard_normal((5, 6))
    row = rng.standard_normal((1, 3))
    params[0].grad = stax.tensor(gt, dtype=stax.float32).t()
    params[1].grad = stax.tensor(row, dtype=stax.float32).expand(4, 3)
    params[2].grad = stax.tensor(rng.standard_normal(30), dtype=stax.float32)
    grads = [gt.T.astype(np.float32).astype(np.float64), np.broadcast_to(row.astype(np.float32), (4, 3)).astype(np.float64),
             host(params[2].grad)]
    assert not params[0].grad.is_contiguous()
    opt = stax.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)
    opt.step()
    for p, r, g in zip(params, ref_p, grads):
        np.testing.assert_allclose(host(p), ref_sgd(r, g, {}, lr=0.1, momentum=0.9, weight_decay=0.05),
                                   **TOL[stax.float32])


def test_closure_and_mismatched_gradient():
    w = stax.tensor(rng.standard_normal(5), dtype=stax.float32, requires_grad=True)
    x = rng.standard_normal(5)
    opt = stax.optim.SGD([w], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (w * stax.tensor(x, dtype=stax.float32)).sum()
        loss.backward()
        return loss
    before = host(w)
    loss = opt.step(closure)
    np.testing.assert_allclose(float(loss.item()), (before * x).sum(), rtol=1e-5)
    np.testing.assert_allclose(host(w), before - 0.1 * x.astype(np.float32), rtol=1e-5, atol=1e-6)
    w.grad = stax.tensor(rng.standard_normal(5), dtype=stax.float64)
    with pytest.raises(ValueError, match="must match its parameter"):
        opt.step()
