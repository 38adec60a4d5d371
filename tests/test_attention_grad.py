"""§5 / §9.10 attention's backward through autograd: `.backward()` on sdpa and omni_attention.

The derivative of `sdpa` and `omni_attn` (op_table.DERIVATIVES) runs the backward template from
the saved LSE: eagerly on the CPU (float64 numpy) and on "cuda" tensors (the Triton kernels, in
Triton's interpreter here: conftest sets TRITON_INTERPRET=1), and in a compiled training step as
the joint graph's `attn_bwd` node. References: float64 numpy written the plain way (softmax and
the chain rule over the whole N x N matrix), itself checked against finite differences.
"""
import math

import numpy as np
import pytest

import stax
from conftest import assert_close
from test_attention import record_direct_launches  # noqa: F401 (autouse: direct launches go to test_zz_sm90)

TOL = {"float32": dict(rtol=2e-4, atol=2e-4), "float16": dict(rtol=3e-2, atol=3e-2),
       "bfloat16": dict(rtol=8e-2, atol=8e-2)}


def randn(rng, shape, dtype=stax.float32, device="cpu", grad=False):
    t = stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype).to(device)
    return t.requires_grad_() if grad else t


def host(t):
    return np.asarray(t.cpu().float().numpy(), np.float64)


def ref_loss_grads(q, k, v, w, causal=False, mask=None, score=None, dscore=None, keep=None, scale=None):
    """d(sum(attention(q, k, v) * w))/d(q, k, v) in float64: S = scale q kᵀ, S' = score(S) masked,
    P = softmax(S'), dS = P (dP - rowsum(dP P)) score'(S); grouped heads summed."""
    h, hk = q.shape[-3], k.shape[-3]
    kk, vv = (np.repeat(x, h // hk, axis=-3) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(kk, -1, -2) * scale
    grids = np.ix_(*(np.arange(n) for n in s.shape)) if s.ndim == 4 else None
    s2 = score(s, *grids) if score is not None else s
    if causal:
        s2 = np.where(np.tril(np.ones(s.shape[-2:], bool)), s2, -np.inf)
    if keep is not None:
        s2 = np.where(keep(*grids), s2, -np.inf)
    if mask is not None:
        s2 = np.where(mask, s2, -np.inf) if mask.dtype == bool else s2 + mask
    p = np.exp(s2 - s2.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = w @ np.swapaxes(vv, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * (dscore(s, *grids) if dscore is not None else 1.0)
    fold = lambda x: x.reshape(x.shape[:-3] + (hk, h // hk) + x.shape[-2:]).sum(-3)   # noqa: E731
    return ds @ kk * scale, fold(np.swapaxes(ds, -1, -2) @ q * scale), fold(np.swapaxes(p, -1, -2) @ w)


def test_reference_matches_finite_differences(rng):
    q, k, v, w = (rng.standard_normal(s) for s in ((1, 2, 5, 4), (1, 1, 6, 4), (1, 1, 6, 4), (1, 2, 5, 4)))
    cap, dcap = (lambda s, *g: 3 * np.tanh(s / 3)), (lambda s, *g: 1 - np.tanh(s / 3) ** 2)

    def loss(q, k, v):
        kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        s = np.where(np.tril(np.ones((5, 6), bool)), cap(q @ np.swapaxes(kk, -1, -2) / 2), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return ((p / p.sum(-1, keepdims=True)) @ vv * w).sum()
    grads = ref_loss_grads(q, k, v, w, causal=True, score=cap, dscore=dcap)
    for which, g in enumerate(grads):
        fd = np.zeros_like(g)
        for idx in np.ndindex(g.shape):
            for sign in (1, -1):
                args = [q.copy(), k.copy(), v.copy()]
                args[which][idx] += sign * 1e-6
                fd[idx] += sign * loss(*args) / 2e-6
        np.testing.assert_allclose(g, fd, rtol=1e-5, atol=1e-7)


def _backward(fn, dev, shapes, dtype, rng, compiled=False, compiled_eagerly=0):
    """Run sum(fn(q, k, v) * w).backward() on fresh inputs; (grads as float64, the inputs as float64)."""
    q, k, v = (randn(rng, s, dtype, dev, grad=True) for s in shapes)
    w = randn(rng, shapes[0][:-1] + (shapes[2][-1],), dtype, dev)
    f = (lambda q, k, v, w: (fn(q, k, v) * w).sum())
    run = stax.compile(f) if compiled else f
    run(q, k, v, w).backward()
    if compiled:            # compiled (one artifact pair), or run eagerly where it says it must
        assert run.stats["eager_calls"] == compiled_eagerly and run.stats["compiles"] == 1 - compiled_eagerly
    for t, g in zip((q, k, v), (q.grad, k.grad, v.grad)):
        assert g is not None and g.device == dev and g.dtype is dtype and tuple(g.shape) == tuple(t.shape)
    return [host(t.grad) for t in (q, k, v)], [host(t) for t in (q, k, v, w)]


def _check(grads, refs, dtype):
    for g, r in zip(grads, refs):
        assert_close(g, r, stax.float64, **TOL[dtype.name])


# ---- eager: sdpa ----


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype,shape,causal", [
    (stax.float32, (2, 4, 2, 70, 70, 16), True),
    (stax.float32, (1, 2, 1, 7, 9, 32), False),
    (stax.float32, (1, 1, 1, 1, 1, 16), False),
    (stax.float16, (1, 2, 2, 33, 50, 64), True),
    (stax.bfloat16, (2, 2, 1, 7, 7, 16), False),
])
def test_sdpa_backward_matches_float64(rng, dev, dtype, shape, causal):
    b, h, hk, m, n, d = shape
    shapes = ((b, h, m, d), (b, hk, n, d), (b, hk, n, d))
    sdpa = lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)  # noqa: E731
    grads, ins = _backward(sdpa, dev, shapes, dtype, rng)
    _check(grads, ref_loss_grads(*ins, causal=causal), dtype)


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_backward_with_an_attention_mask(rng, dev, kind):
    m, n = 7, 70
    if kind == "bool":
        mask_np = rng.random((m, n)) < 0.5
        mask_np[:, 3] = True                            # every row keeps a key
    else:
        mask_np = rng.standard_normal((1, 2, m, n)).astype(np.float32)
    mask = stax.from_numpy(mask_np).to(dev)
    sdpa = lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)  # noqa: E731
    grads, ins = _backward(sdpa, dev, ((1, 2, m, 16), (1, 2, n, 16), (1, 2, n, 16)), stax.float32, rng)
    _check(grads, ref_loss_grads(*ins, mask=mask_np.astype(np.float64) if kind == "float" else mask_np,
                                 scale=0.3), stax.float32)


def test_sdpa_backward_rank_3_and_non_contiguous(rng):
    q = randn(rng, (3, 16, 9)).transpose(1, 2).requires_grad_()        # [3, 9, 16], strided
    k, v = randn(rng, (3, 11, 16), grad=True), randn(rng, (3, 11, 8), grad=True)
    w = randn(rng, (3, 9, 8))
    (stax.scaled_dot_product_attention(q, k, v) * w).sum().backward()
    refs = ref_loss_grads(*(host(t)[None] for t in (q, k, v, w)))
    for t, r in zip((q, k, v), refs):
        assert_close(host(t.grad), r[0], stax.float64, **TOL["float32"])


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_views_of_one_packed_qkv_tensor(rng, dev):
    """q, k, v as views at offsets of one [B, L, 3·H·E] tensor (a fused QKV projection): the
    launches' pointers already include the offset (it was once counted twice on cuda)."""
    x = randn(rng, (2, 11, 96), device=dev, grad=True)
    q, k, v = x.reshape(2, 11, 3, 2, 16).permute(2, 0, 3, 1, 4)
    w = randn(rng, (2, 2, 11, 16), device=dev)
    (stax.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum().backward()
    xs = host(x).reshape(2, 11, 3, 2, 16).transpose(2, 0, 3, 1, 4)
    dq, dk, dv = ref_loss_grads(xs[0], xs[1], xs[2], host(w), causal=True)
    ref = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(2, 11, 96)
    assert_close(host(x.grad), ref, stax.float64, **TOL["float32"])


def test_sdpa_grad_errors_say_what_to_do(rng):
    q = randn(rng, (1, 1, 4, 8), grad=True)
    mask = randn(rng, (4, 4), grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask.detach"):
        stax.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    q5 = randn(rng, (1, 1, 1, 4, 8), grad=True)
    with pytest.raises(NotImplementedError, match="rank <= 4"):
        stax.scaled_dot_product_attention(q5, q5, q5)
    kb = randn(rng, (2, 1, 4, 8))
    with pytest.raises(NotImplementedError, match="same batch dims"):
        stax.scaled_dot_product_attention(q, kb, kb)
    with stax.no_grad():        # (no gradient wanted: the forward alone, as before)
        assert stax.scaled_dot_product_attention(q, kb[:1], kb[:1]).grad_fn is None


def test_double_backward_raises(rng):
    q = randn(rng, (1, 1, 5, 8), grad=True)
    out = stax.scaled_dot_product_attention(q, q, q)
    with pytest.raises(NotImplementedError, match="create_graph"):
        stax.autograd.grad(out.sum(), q, create_graph=True)


def test_saved_input_changed_in_place_raises(rng):
    q, k = randn(rng, (1, 1, 5, 8), grad=True), randn(rng, (1, 1, 5, 8))
    out = stax.scaled_dot_product_attention(q, k, k)
    with stax.no_grad():
        k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---- eager: omni_attention ----


def alibi(score, b, h, q_idx, kv_idx):
    return score - stax.exp2(-(h + 1).to(stax.float32)) * (q_idx - kv_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * stax.tanh(score / 20.0)


MODS = {"alibi": (alibi, lambda s, b, h, i, j: s - 2.0 ** -(h + 1.0) * (i - j), lambda s, *g: np.ones_like(s)),
        "softcap": (softcap, lambda s, *g: 20 * np.tanh(s / 20), lambda s, *g: 1 - np.tanh(s / 20) ** 2),
        "none": (None, None, None)}
WINDOW = lambda b, h, i, j: (i >= j) & (i - j < 24 * (h + 1))           # noqa: E731 (a per-head window)


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("mod,masked,dtype,shape", [
    ("alibi", True, stax.float32, (1, 2, 1, 70, 70, 16)),
    ("softcap", False, stax.float32, (2, 4, 2, 7, 33, 16)),
    ("softcap", True, stax.float16, (1, 2, 2, 40, 40, 32)),
    ("none", True, stax.float32, (1, 1, 1, 1, 1, 16)),
])
def test_omni_backward_matches_float64(rng, dev, mod, masked, dtype, shape):
    b, h, hk, m, n, d = shape
    score_mod, f, fprime = MODS[mod]
    bm = stax.create_block_mask(WINDOW, None, h, m, n, device=dev, BLOCK_SIZE=16) if masked else None
    omni = lambda q, k, v: stax.omni_attention(q, k, v, score_mod=score_mod, block_mask=bm,  # noqa: E731
                                               enable_gqa=True)
    grads, ins = _backward(omni, dev, ((b, h, m, d), (b, hk, n, d), (b, hk, n, d)), dtype, rng)
    _check(grads, ref_loss_grads(*ins, score=f, dscore=fprime, keep=WINDOW if masked else None), dtype)


def test_omni_grad_errors(rng):
    q = randn(rng, (1, 2, 16, 8), grad=True)
    with pytest.raises(NotImplementedError, match="return_lse=False"):
        stax.omni_attention(q, q, q, return_lse=True)
    floor_mod = lambda s, b, h, i, j: s // 0.5                  # noqa: E731 (floordiv has no derivative)
    out = stax.omni_attention(q, q, q, score_mod=floor_mod)       # the forward runs; the backward says why not
    with pytest.raises(NotImplementedError, match="derivative of score_mod cannot be traced"):
        out.sum().backward()


# ---- compiled training: the joint graph, partitioned ----


def _train_step_matches_eager(rng, fn, dev, shapes, dtype, eagerly=0):
    g_eager, _ = _backward(fn, dev, shapes, dtype, np.random.default_rng(7))
    g_comp, _ = _backward(fn, dev, shapes, dtype, np.random.default_rng(7), True, eagerly)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is stax.float32 else TOL[dtype.name]
    for a, b in zip(g_comp, g_eager):
        assert_close(a, b, stax.float64, **tol)


def _generated(fn, dev, shapes, rng):
    q, k, v = (randn(rng, s, device=dev, grad=True) for s in shapes)
    w = randn(rng, shapes[0], device=dev)
    return stax.generate(lambda q, k, v, w: (fn(q, k, v) * w).sum(), q, k, v, w, device=dev)


def _saved_shapes(gen) -> list:
    return [tuple(n.meta.shape) for n in gen.partition.saved]


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [stax.float32, stax.float16])
def test_compiled_sdpa_training_step(rng, dev, dtype):
    shapes = ((2, 4, 70, 16), (2, 2, 70, 16), (2, 2, 70, 16))
    sdpa = lambda q, k, v: stax.scaled_dot_product_attention(q * 0.5, k, v, is_causal=True,  # noqa: E731
                                                             enable_gqa=True)
    _train_step_matches_eager(rng, sdpa, dev, shapes, dtype)
    gen = _generated(sdpa, dev, shapes, rng)
    saved = _saved_shapes(gen)
    assert (2, 4, 70) in saved and not any(s[-2:] == (70, 70) for s in saved)    # the LSE, never P
    if dev == "cuda":       # forward: one flash template writes out and LSE; backward: dK/dV, dQ
        assert [k for k in gen.kernels if "attention" in k] == ["triton_tem_fused_attention_1"]
        assert "extern_kernel" not in gen.wrapper
        bwd = [k for k in gen.backward.kernels if "attention" in k]
        assert [k.rsplit("_", 1)[0] for k in bwd] == ["triton_tem_fused_attention_bwd_dkdv",
                                                      "triton_tem_fused_attention_bwd_dq"]
        assert "extern_kernel" not in gen.backward.wrapper
    else:
        assert "extern_kernel('attn_bwd'" in gen.backward.wrapper


def test_compiled_sdpa_training_with_a_mask(rng):
    mask = stax.from_numpy(rng.standard_normal((7, 9)).astype(np.float32)).to("cuda")
    sdpa = lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, attn_mask=mask)    # noqa: E731
    _train_step_matches_eager(rng, sdpa, "cuda", ((1, 2, 7, 16), (1, 2, 9, 16), (1, 2, 9, 16)), stax.float32)


@pytest.mark.parametrize("mod", ["alibi", "softcap"])
def test_compiled_omni_training_step_on_the_gpu(rng, mod):
    m = 70
    bm = stax.create_block_mask(WINDOW, None, 2, m, m, device="cuda", BLOCK_SIZE=16)
    omni = lambda q, k, v: stax.omni_attention(q, k, v, score_mod=MODS[mod][0], block_mask=bm,  # noqa: E731
                                               enable_gqa=True)
    shapes = ((1, 2, m, 16), (1, 1, m, 16), (1, 1, m, 16))
    _train_step_matches_eager(rng, omni, "cuda", shapes, stax.float32)
    gen = _generated(omni, "cuda", shapes, rng)
    assert "extern_kernel" not in gen.wrapper + gen.backward.wrapper
    assert sum("attention_bwd" in k for k in gen.backward.kernels) == 2
    assert not any(s[-2:] == (m, m) for s in _saved_shapes(gen))
    dq = next(src for k, src in gen.backward.kernels.items() if "bwd_dq" in k)
    if mod == "softcap":            # ∂score_mod/∂score is printed per score
        assert "p * (dp - delta[:, None]) * dmod_" in dq
    else:                           # additive: the derivative is 1, the row term left in the LSE
        assert "dmod_" not in dq and "row_drop" in dq and "tl.math.exp2(sc - lse[:, None])" in dq


def test_compiled_omni_training_on_the_cpu_runs_eagerly(rng):
    omni = lambda q, k, v: stax.omni_attention(q, k, v, score_mod=softcap)      # noqa: E731
    _train_step_matches_eager(rng, omni, "cpu", ((1, 2, 9, 16),) * 3, stax.float32, eagerly=1)


def test_compiled_training_backward_twice_needs_retain_graph(rng):
    q = randn(rng, (1, 2, 7, 16), grad=True)
    f = stax.compile(lambda q: stax.scaled_dot_product_attention(q, q, q, is_causal=True).sum())
    loss = f(q)
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


# ---- the example: a tiny transformer trained compiled and eagerly ----


@pytest.mark.parametrize("dev,steps,batch", [("cpu", 12, 64), ("cuda", 2, 4)])
def test_train_transformer_compiled_equals_eager(dev, steps, batch):
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import train_transformer as T
    compiled = T.train(steps=steps, compiled_model=True, verbose=False, device=dev, batch=batch)
    eager = T.train(steps=steps, compiled_model=False, verbose=False, device=dev, batch=batch)
    np.testing.assert_allclose(compiled, eager, rtol=2e-5, atol=1e-6)
    assert compiled[-1] < compiled[0] * (0.5 if steps > 10 else 1.0)
