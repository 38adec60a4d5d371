"""§5 / §9.10 hand-written attention in a compiled training step becomes the flash template.

partition.capture_joint rewrites the forward half of the joint graph (fuse_attention.py's
`fuse_attention_for_training`) before autograd traces the backward: the forward runs the flash
template and saves q, k, v, out and the LSE (never the N x N scores), the backward is the dK/dV and
dQ templates. On the GPU (Triton's interpreter here: conftest sets TRITON_INTERPRET=1) the kernel
counts show it; on the CPU (no rewrite, as for inference) the gradients equal eager all the same.
What the rewrite does not cover (a learned positional bias, dropout in training, the probabilities
used elsewhere, two masks) keeps the operator-by-operator backward, and matches eager too.
References: float64 numpy (test_attention_grad.ref_loss_grads) and the eager autograd.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import stax
import stax.nn.functional as F
from conftest import assert_close
from test_attention import record_direct_launches  # noqa: F401 (autouse: direct launches go to test_zz_sm90)
from test_attention_grad import host, randn, ref_loss_grads

TOL = {"float32": dict(rtol=2e-4, atol=2e-4), "float16": dict(rtol=3e-2, atol=3e-2)}


@pytest.fixture(autouse=True)
def ieee_float32_rewritten(monkeypatch):
    """These tests check the rewritten path in float32 (the interpreter's exact dots); by default
    IEEE float32 training keeps the ordinary kernels (test_ieee_float32_training_is_not_rewritten)."""
    from stax import fuse_attention
    monkeypatch.setattr(fuse_attention, "TRAIN_IEEE_FLOAT32", True)


# ---- hand-written attention, the ways people write it ----


def causal_masked_fill(q, k, v):
    """nanoGPT's: masked_fill of a tril mask (a tensor computed here) with -inf."""
    t = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    keep = stax.tril(stax.ones(t, t, device=q.device)).view(1, 1, t, t)
    return F.softmax(att.masked_fill(keep == 0, float("-inf")), dim=-1) @ v


def causal_aranges(q, k, v):
    """where(q_idx >= kv_idx, S, -inf) from two aranges: the template's causal loop, no mask."""
    m, n = q.shape[-2], k.shape[-2]
    keep = stax.arange(m, device=q.device).view(m, 1) >= stax.arange(n, device=q.device).view(1, n)
    s = stax.where(keep, q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), float("-inf"))
    return stax.softmax(s, -1) @ v


def plain(q, k, v):
    return stax.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v


def _mask_fns(rng, dev, m, n):
    add = stax.from_numpy(rng.standard_normal((m, n)).astype(np.float32)).to(dev)
    keep = rng.random((1, 1, m, n)) < 0.7
    keep[..., 0] = True                                  # every query keeps a key
    drop = stax.from_numpy(~keep).to(dev)
    fns = {
        "additive": lambda q, k, v: stax.softmax(q @ k.transpose(-2, -1) * 0.25 + add, -1) @ v,
        "bool_masked_fill": lambda q, k, v: F.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(
            drop, float("-inf")), dim=-1) @ v,
    }
    refs = {"additive": dict(mask=host(add), scale=0.25), "bool_masked_fill": dict(mask=keep, scale=0.25)}
    return fns, refs


def _inputs(rng, dev, shapes, dtype=stax.float32):
    return [randn(rng, s, dtype, dev, grad=True) for s in shapes]


def _grads(fn, ins, w, compiled):
    for t in ins:
        t.grad = None
    f = lambda *a: (fn(*a[:-1]) * a[-1]).sum()          # noqa: E731
    run = stax.compile(f) if compiled else f
    run(*ins, w).backward()
    if compiled:
        assert run.stats["eager_calls"] == 0 and run.stats["compiles"] == 1
    return [host(t.grad) for t in ins]


def _generated(fn, ins, w, dev):
    return stax.generate(lambda *a: (fn(*a[:-1]) * a[-1]).sum(), *ins, w, device=dev)


def _assert_flash(gen, n_queries, n_keys):
    """The forward is the flash template and saves no N x N value; the backward the two templates."""
    assert gen.partition.fused, gen.partition.format()
    assert sum("fused_attention" in k for k in gen.kernels) == 1, list(gen.kernels)
    bwd = [k.rsplit("_", 1)[0] for k in gen.backward.kernels if "attention" in k]
    assert bwd == ["triton_tem_fused_attention_bwd_dkdv", "triton_tem_fused_attention_bwd_dq"], bwd
    assert "extern_kernel" not in gen.wrapper + gen.backward.wrapper
    part = gen.partition
    scores = [n.name for n, (kind, _) in zip(part.saved, part.saved_from) if kind == "output"
              and n.meta.dtype.is_floating_point and not n.name.endswith("_lse")
              and len(n.meta.shape) >= 2 and tuple(n.meta.shape[-2:]) == (n_queries, n_keys)]
    assert not scores, part.format()
    assert "hand-written attention rewritten" in gen.partition.format()


# ---- the rewrite: gradients, kernels, what is saved ----


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("fn,shape", [(causal_masked_fill, (2, 3, 7, 16)), (causal_aranges, (1, 2, 9, 16)),
                                      (plain, (1, 1, 1, 16)), (plain, (3, 5, 32))])
def test_hand_written_attention_trains_as_the_template(rng, dev, fn, shape):
    ins = _inputs(rng, dev, [shape] * 3)
    w = randn(rng, shape, device=dev)
    ref = ref_loss_grads(*(host(t) for t in ins), host(w), causal=fn is not plain,
                         scale=0.3 if fn is plain else None)
    for g, r in zip(_grads(fn, ins, w, True), ref):
        assert_close(g, r, stax.float64, **TOL["float32"])
    gen = _generated(fn, ins, w, dev)
    if dev == "cuda":
        _assert_flash(gen, shape[-2], shape[-2])
        if fn is causal_aranges:         # the causal loop: no mask in memory
            assert "is_causal=True" in gen.partition.forward.format()
    else:                                # the CPU keeps the ordinary kernels (as for inference)
        assert not gen.partition.fused


@pytest.mark.parametrize("kind", ["additive", "bool_masked_fill"])
def test_masks_train_as_the_template(rng, kind):
    m, n = 7, 12
    fns, refs = _mask_fns(rng, "cuda", m, n)
    ins = _inputs(rng, "cuda", [(2, 2, m, 16), (2, 2, n, 16), (2, 2, n, 16)])
    w = randn(rng, (2, 2, m, 16), device="cuda")
    ref = ref_loss_grads(*(host(t) for t in ins), host(w), **refs[kind])
    for g, r in zip(_grads(fns[kind], ins, w, True), ref):
        assert_close(g, r, stax.float64, **TOL["float32"])
    _assert_flash(_generated(fns[kind], ins, w, "cuda"), m, n)


def test_float16_and_views_of_one_packed_projection(rng):
    """q, k, v split from one [B, T, 3C] tensor and transposed (strided views), in float16."""
    b, t, h, d = 2, 9, 2, 16
    x = randn(rng, (b, t, 3 * h * d), stax.float16, "cuda", grad=True)
    w = randn(rng, (b, h, t, d), stax.float16, "cuda")

    def fn(x, w):
        q, k, v = (a.view(b, t, h, d).transpose(1, 2) for a in x.split(h * d, dim=2))
        return (causal_masked_fill(q, k, v) * w).sum()
    f = stax.compile(fn)
    f(x, w).backward()
    got = host(x.grad)
    x.grad = None
    fn(x, w).backward()
    assert_close(got, host(x.grad), stax.float64, **TOL["float16"])
    gen = stax.generate(fn, x, w, device="cuda")
    _assert_flash(gen, t, t)


def test_keys_given_transposed(rng):
    """q @ kt with kt an input [B, H, D, N]: the rewrite makes K a permute, its gradient flows back."""
    q, kt, v = _inputs(rng, "cuda", [(1, 2, 7, 16), (1, 2, 16, 10), (1, 2, 10, 16)])
    w = randn(rng, (1, 2, 7, 16), device="cuda")
    fn = lambda q, kt, v: stax.softmax(q @ kt * 0.25, -1) @ v         # noqa: E731
    got = _grads(fn, [q, kt, v], w, True)
    ref = ref_loss_grads(host(q), np.swapaxes(host(kt), -1, -2), host(v), host(w), scale=0.25)
    for g, r in zip(got, (ref[0], np.swapaxes(ref[1], -1, -2), ref[2])):
        assert_close(g, r, stax.float64, **TOL["float32"])
    _assert_flash(_generated(fn, [q, kt, v], w, "cuda"), 7, 10)


def test_only_some_inputs_require_grad(rng):
    """v alone requires grad: the scores have no autograd history, the rewrite still holds."""
    q, k = (randn(rng, (1, 2, 7, 16), device="cuda") for _ in range(2))
    v = randn(rng, (1, 2, 7, 16), device="cuda", grad=True)
    w = randn(rng, (1, 2, 7, 16), device="cuda")
    f = stax.compile(lambda q, k, v, w: (causal_masked_fill(q, k, v) * w).sum())
    f(q, k, v, w).backward()
    ref = ref_loss_grads(host(q), host(k), host(v), host(w), causal=True)
    assert_close(host(v.grad), ref[2], stax.float64, **TOL["float32"])
    assert q.grad is None and k.grad is None
    gen = stax.generate(lambda q, k, v, w: (causal_masked_fill(q, k, v) * w).sum(), q, k, v, w, device="cuda")
    assert gen.partition.fused


def test_partition_log_says_so(rng, capfd, monkeypatch):
    monkeypatch.setenv("STAX_LOGS", "partition")
    ins = _inputs(rng, "cuda", [(1, 2, 7, 16)] * 3)
    f = stax.compile(lambda q, k, v: causal_masked_fill(q, k, v).sum())
    f(*ins).backward()
    assert "hand-written attention rewritten before the backward was traced: sdpa_" in capfd.readouterr().err


# ---- what the rewrite leaves alone: the ordinary backward, still equal to eager ----


def _unmatched(rng):
    n = 7
    bias = randn(rng, (1, 2, n, n), device="cuda", grad=True)          # a learned positional bias

    def positional_bias(q, k, v):
        return stax.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, -1) @ v

    def dropout_in_training(q, k, v):
        return F.dropout(F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1), 0.3, training=True) @ v

    def probabilities_used_elsewhere(q, k, v):
        p = stax.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
        return p @ v + p.sum(-1, keepdim=True)

    def two_masks(q, k, v):
        s = (q @ k.transpose(-2, -1) * 0.25 + bias.detach()).masked_fill(bias.detach() > 1.0, float("-inf"))
        return stax.softmax(s, -1) @ v
    return bias, [positional_bias, dropout_in_training, probabilities_used_elsewhere, two_masks]


@pytest.mark.parametrize("which", range(4))
def test_unmatched_patterns_keep_their_backward(rng, which):
    bias, fns = _unmatched(rng)
    fn = fns[which]
    ins = _inputs(rng, "cuda", [(1, 2, 7, 16)] * 3) + ([bias] if which == 0 else [])
    w = randn(rng, (1, 2, 7, 16), device="cuda")
    loss = lambda *a: (fn(*a[:3]) * w).sum()             # noqa: E731  (bias: read from the closure)
    stax.manual_seed(3)                                  # dropout: the same Philox stream both times
    f = stax.compile(lambda q, k, v: loss(q, k, v))
    f(*ins[:3]).backward()
    got = [host(t.grad) for t in ins]
    for t in ins:
        t.grad = None
    stax.manual_seed(3)
    loss(*ins[:3]).backward()
    for g, t in zip(got, ins):
        assert_close(g, host(t.grad), stax.float64, rtol=1e-4, atol=1e-5)
    gen = stax.generate(lambda q, k, v: loss(q, k, v), *ins[:3], device="cuda")
    assert not gen.partition.fused and "sdpa" not in gen.partition.forward.format()


# ---- a tiny GPT-2 block: every weight's gradient ----


@pytest.fixture
def gpt2():
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import gpt2_block
    return gpt2_block


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
def test_gpt2_block_weights_gradients_equal_eager(gpt2, dev):
    stax.manual_seed(0)
    p = {k: v.to(dev).requires_grad_() for k, v in gpt2.init_params().items()}
    t = 8
    bias = stax.tril(stax.ones(gpt2.BLOCK, gpt2.BLOCK)).view(1, 1, gpt2.BLOCK, gpt2.BLOCK).to(dev)
    x = stax.randn(2, t, gpt2.N_EMBD).to(dev)
    targets = stax.randint(0, gpt2.VOCAB, (2, t)).to(dev)
    loss = lambda x, targets, p, bias: gpt2.block_loss(x, targets, p, bias)[1]     # noqa: E731
    f = stax.compile(loss)
    f(x, targets, p, bias).backward()
    got = {k: host(v.grad) for k, v in p.items()}
    for v in p.values():
        v.grad = None
    loss(x, targets, p, bias).backward()
    for k, v in p.items():
        assert_close(got[k], host(v.grad), stax.float64, rtol=2e-4, atol=2e-6, msg=k)
    gen = stax.generate(loss, x, targets, p, bias, device=dev)
    if dev == "cuda":
        _assert_flash(gen, t, t)
    else:
        assert not gen.partition.fused


# ---- float32 dots follow set_float32_matmul_precision ----


@pytest.mark.parametrize("precision,expect", [("highest", "ieee"), ("high", "tf32")])
def test_float32_templates_follow_the_matmul_precision(rng, precision, expect):
    ins = _inputs(rng, "cuda", [(1, 2, 7, 16)] * 3)
    w = randn(rng, (1, 2, 7, 16), device="cuda")
    stax.set_float32_matmul_precision(precision)
    try:
        gen = _generated(causal_masked_fill, ins, w, "cuda")
    finally:
        stax.set_float32_matmul_precision("highest")
    sources = [src for k, src in {**gen.kernels, **gen.backward.kernels}.items() if "attention" in k]
    assert len(sources) == 3
    for src in sources:
        dots = src.count("tl.dot(")
        assert dots and src.count(f'input_precision="{expect}"') == dots, src
        assert ("meta={'ieee': " in src) == (expect == "ieee")     # IEEE dots: the small-tile table


def test_inference_masked_fill_becomes_the_template(rng):
    """(The same pattern without grad: masked_fill(drop, -inf) is matched at inference too.)"""
    m, n = 9, 12
    fns, refs = _mask_fns(rng, "cuda", m, n)
    q, k, v = (randn(rng, s, device="cuda") for s in ((2, 3, m, 16), (2, 3, n, 16), (2, 3, n, 16)))
    fn = fns["bool_masked_fill"]
    got = stax.compile(fn)(q, k, v)
    assert_close(host(got), host(fn(q, k, v)), stax.float64, **TOL["float32"])
    gen = stax.generate(fn, q, k, v, device="cuda")
    assert sum("fused_attention" in name for name in gen.kernels) == 1, list(gen.kernels)
    assert not any("where" == node.op for node in gen.graph.nodes)


def test_broadcast_key_heads(rng):
    """k and v with one head broadcast over the query's (multi-query attention): dK, dV summed."""
    q = randn(rng, (2, 3, 7, 16), device="cuda", grad=True)
    k, v = (randn(rng, (2, 1, 9, 16), device="cuda", grad=True) for _ in range(2))
    w = randn(rng, (2, 3, 7, 16), device="cuda")
    got = _grads(plain, [q, k, v], w, True)
    ref = ref_loss_grads(host(q), host(k), host(v), host(w), scale=0.3)
    for g, r in zip(got, ref):
        assert_close(g, r, stax.float64, **TOL["float32"])
    _assert_flash(_generated(plain, [q, k, v], w, "cuda"), 7, 9)


def test_ieee_float32_training_is_not_rewritten_by_default(rng, monkeypatch):
    """Under "highest" a float32 step keeps cuBLAS's GEMMs and the fused softmax (faster on the
    H200 at GPT-2's sizes, fuse_attention.TRAIN_IEEE_FLOAT32); under "high" it is rewritten."""
    from stax import fuse_attention
    monkeypatch.setattr(fuse_attention, "TRAIN_IEEE_FLOAT32", False)
    ins = _inputs(rng, "cuda", [(1, 2, 7, 16)] * 3)
    w = randn(rng, (1, 2, 7, 16), device="cuda")
    gen = _generated(causal_masked_fill, ins, w, "cuda")
    assert not any("attention" in k for k in {**gen.kernels, **gen.backward.kernels})
    stax.set_float32_matmul_precision("high")
    try:
        gen = _generated(causal_masked_fill, ins, w, "cuda")
    finally:
        stax.set_float32_matmul_precision("highest")
    assert sum("attention" in k for k in {**gen.kernels, **gen.backward.kernels}) == 3
