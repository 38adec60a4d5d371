"""§9.10 attention: the online triple, the flash template, block masks, omni_attention.

Triton kernels run on the GPU where there is one, else in Triton's interpreter (conftest sets
TRITON_INTERPRET=1); every kernel text generated here is also built for sm_90 by test_zz_sm90.py.
References are float64 numpy. Half types: the template rounds P to the input dtype before the
P·V dot (as every flash kernel does), so their tolerance is the dtype's epsilon-scale one.
"""
import math
import sys

import numpy as np
import pytest

import conftest
import stax
from conftest import assert_close
from stax.attention_kernels import attention_template as TEMPLATE, finish_triple, merge_triples, triple_of

# float16/bfloat16 outputs: P is rounded to the input dtype before the P·V dot
HALF_TOL = {"float16": dict(rtol=5e-3, atol=2e-3), "bfloat16": dict(rtol=3e-2, atol=1.5e-2)}


@pytest.fixture(autouse=True, scope="module")
def record_direct_launches():
    """Kernels omni_attention and attention_forward launch directly (not through
    codegen_triton.generate) are recorded too, for test_zz_sm90.py to build."""
    import stax.attention as att
    plain, plain_bwd, plain_dec = att.attention_template, att.backward_templates, att.decode_templates

    def template(index, spec):
        name, src = plain(index, spec)
        conftest.GENERATED_TRITON_KERNELS.setdefault(src, name)
        return name, src

    def recorded(make):
        def kernels(*args):
            made = make(*args)
            for name, src, _ in made:
                conftest.GENERATED_TRITON_KERNELS.setdefault(src, name)
            return made
        return kernels
    att.attention_template, att.backward_templates = template, recorded(plain_bwd)
    att.decode_templates = recorded(plain_dec)
    att._LAUNCHES.clear()                 # (a launch remembered from another module prints no text here)
    yield
    att.attention_template, att.backward_templates, att.decode_templates = plain, plain_bwd, plain_dec


def ref_attention(q, k, v, mask=None, causal=False, scale=None):
    """softmax(q kᵀ · scale [+ mask]) v and the LSE, in float64, written the plain way."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if k.shape[-3] != q.shape[-3]:
        k, v = (np.repeat(x, q.shape[-3] // x.shape[-3], axis=-3) for x in (k, v))
    s = q @ np.swapaxes(k, -1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    mx = s.max(-1, keepdims=True)
    e = np.exp(s - mx)
    return (e / e.sum(-1, keepdims=True)) @ v, (mx + np.log(e.sum(-1, keepdims=True)))[..., 0]


def host(t):
    if isinstance(t, np.ndarray):
        return t.astype(np.float64)
    return np.asarray(t.cpu().float().numpy(), np.float64)


def randn(rng, shape, dtype=stax.float32):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


# ---- the online triple ----


def _random_tree_merge(triples, rng):
    """Merge the segments' triples in a random order and a random bracketing."""
    items = list(triples)
    while len(items) > 1:
        i = int(rng.integers(len(items) - 1))
        a, b = items[i], items[i + 1]
        merged = merge_triples(a, b) if rng.random() < 0.5 else merge_triples(b, a)
        items[i:i + 2] = [merged]
    return items[0]


@pytest.mark.parametrize("n", [1, 2, 7, 100, 257])
def test_triple_merges_any_segmentation_in_any_order(rng, n):
    rows, d = 5, 3
    for trial in range(20):
        s = rng.standard_normal((rows, n)) * rng.choice([1, 10, 100])
        if trial % 4 == 1:                       # masked keys (every row keeps one), so that
            alive = rng.integers(n, size=rows)   # whole segments of a row are -inf
            s[rng.random((rows, n)) < 0.6] = -np.inf
            s[np.arange(rows), alive] = 0.5
        v = rng.standard_normal((n, d))
        cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 6))), replace=False)) \
            if n > 1 else np.array([], int)
        bounds = [0, *cuts.tolist(), n]
        triples = [triple_of(s[:, a:b], v[a:b]) for a, b in zip(bounds, bounds[1:])]
        perm = rng.permutation(len(triples))            # commutativity: any order of segments
        o, lse = finish_triple(_random_tree_merge([triples[i] for i in perm], rng))
        mx = s.max(-1, keepdims=True)
        e = np.exp(s - mx)
        np.testing.assert_allclose(o, (e / e.sum(-1, keepdims=True)) @ v, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, mx[:, 0] + np.log(e.sum(-1)), rtol=1e-12, atol=1e-12)


def test_triple_of_an_empty_or_masked_segment_is_the_identity(rng):
    s, v = rng.standard_normal((2, 4)), rng.standard_normal((4, 3))
    t = triple_of(s, v)
    for empty in (triple_of(np.zeros((2, 0)), np.zeros((0, 3))), triple_of(np.full((2, 4), -np.inf), v)):
        for got in (merge_triples(t, empty), merge_triples(empty, t)):
            for x, y in zip(got, t):
                np.testing.assert_allclose(x, y, rtol=1e-15)
    o, lse = finish_triple(triple_of(np.full((1, 3), -np.inf), v[:3]))
    assert np.isnan(o).all() and np.isneginf(lse).all()     # softmax of nothing: NaN, as eager


# ---- the flash template (scaled_dot_product_attention) ----


def _sdpa_case(rng, dtype, shape_q, n, causal, hk=None):
    b, h, m, d = shape_q
    q = randn(rng, (b, h, m, d), dtype)
    k, v = (randn(rng, (b, hk or h, n, d), dtype) for _ in range(2))
    ref, lse_ref = ref_attention(host(q), host(k), host(v), causal=causal)
    return q, k, v, ref, lse_ref


def _close(out, ref, dtype):
    if dtype.name in HALF_TOL:
        assert_close(out.cpu().float(), ref, stax.float32, **HALF_TOL[dtype.name])
    else:
        assert_close(out.cpu(), ref, dtype)


@pytest.mark.parametrize("dtype,shape_q,n,causal", [
    (stax.float32, (1, 1, 1, 16), 1, False),
    (stax.float32, (2, 3, 37, 16), 300, True),
    (stax.float32, (1, 2, 130, 64), 7, False),
    (stax.float16, (1, 2, 129, 64), 129, True),
    (stax.bfloat16, (2, 1, 65, 128), 100, False),
    (stax.float32, (1, 1, 20, 48), 33, True),          # head dim 48: padded to 64 inside
])
def test_compiled_sdpa_is_one_flash_template(rng, dtype, shape_q, n, causal):
    q, k, v, ref, lse_ref = _sdpa_case(rng, dtype, shape_q, n, causal)
    f = stax.compile(lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, is_causal=causal))
    out = f(q.to("cuda"), k.to("cuda"), v.to("cuda"))
    assert list(f.last_generated.kernels) == ["triton_tem_fused_attention_0"]
    d = shape_q[-1]             # a power-of-two head dim is the whole `rd` range: no mask along it
    assert ("< D)" in f.last_generated.kernels["triton_tem_fused_attention_0"]) == bool(d & (d - 1))
    assert out.dtype is dtype and out.device == "cuda"
    _close(out, ref, dtype)
    eager = stax.scaled_dot_product_attention(q, k, v, is_causal=causal)
    _close(eager, ref, dtype)


def test_attention_forward_writes_the_lse(rng):
    q, k, v, ref, lse_ref = _sdpa_case(rng, stax.float32, (2, 2, 50, 16), 77, True)
    out, lse = stax.attention_forward(q.to("cuda"), k.to("cuda"), v.to("cuda"), is_causal=True)
    assert tuple(lse.shape) == (2, 2, 50) and lse.dtype is stax.float32
    assert_close(out.cpu(), ref, stax.float32)
    assert_close(lse.cpu(), lse_ref, stax.float32)
    out_cpu, lse_cpu = stax.attention_forward(q, k, v, is_causal=True)     # CPU: float64 numpy
    assert_close(out_cpu, ref, stax.float32)
    assert_close(lse_cpu, lse_ref, stax.float32)


def test_sdpa_grouped_heads_views_and_masks(rng):
    """GQA (2 key heads for 4 query heads), q read through a permuted view, a broadcast bool mask
    and an additive float mask, against float64."""
    b, h, hk, m, n, d = 2, 4, 2, 33, 70, 16
    q = randn(rng, (b, m, h, d)).permute(0, 2, 1, 3)             # non-contiguous
    k, v = randn(rng, (b, hk, n, d)), randn(rng, (b, hk, n, d))
    keep = rng.random((m, n)) < 0.7
    keep[:, 0] = True
    bias = rng.standard_normal((1, h, m, n)).astype(np.float32)
    cases = [(stax.from_numpy(keep), keep), (stax.from_numpy(bias), bias.astype(np.float64))]
    for mask, mask_np in cases:
        f = stax.compile(lambda q, k, v, mask: stax.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True))
        out = f(q.to("cuda"), k.to("cuda"), v.to("cuda"), mask.to("cuda"))
        assert list(f.last_generated.kernels) == ["triton_tem_fused_attention_0"]
        ref, _ = ref_attention(host(q), host(k), host(v), mask=mask_np)
        assert_close(out.cpu(), ref, stax.float32)
        assert_close(stax.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), ref,
                     stax.float32)


def test_sdpa_fully_masked_row_is_nan_like_eager_and_inf_propagates(rng):
    q, k, v = randn(rng, (1, 1, 5, 16)), randn(rng, (1, 1, 6, 16)), randn(rng, (1, 1, 6, 16))
    keep = np.ones((5, 6), bool)
    keep[2] = False
    bias = np.zeros((5, 6), np.float32)
    bias[3, 1:] = -np.inf                                       # row 3: only key 0 counts
    for mask in (stax.from_numpy(keep), stax.from_numpy(bias)):
        f = stax.compile(lambda q, k, v, m: stax.scaled_dot_product_attention(q, k, v, attn_mask=m))
        out = host(f(q.to("cuda"), k.to("cuda"), v.to("cuda"), mask.to("cuda")))
        eager = host(stax.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(eager))
        assert_close(out, eager, stax.float32)
    assert np.isnan(out[0, 0, 2]).sum() == 0 and np.isnan(eager[0, 0, 2]).sum() == 0
    assert_close(out[0, 0, 3], host(v)[0, 0, 0], stax.float32)


def test_sdpa_on_the_cpu_compiles_to_the_fallback(rng):
    q, k, v, ref, _ = _sdpa_case(rng, stax.float32, (1, 2, 9, 8), 11, True)
    f = stax.compile(lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, is_causal=True) * 2)
    assert_close(f(q, k, v), ref * 2, stax.float32)


def test_sdpa_errors_say_what_to_do(rng):
    q, k = randn(rng, (1, 4, 3, 8)), randn(rng, (1, 2, 3, 8))
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        stax.scaled_dot_product_attention(q, k, k)
    with pytest.raises(NotImplementedError, match="dropout_p=0.0"):
        stax.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        stax.scaled_dot_product_attention(q, q.half(), q)
    with pytest.raises(RuntimeError, match="runs on CPU tensors"):
        stax.attention_forward(q.to("cuda"), q.to("cuda"), q.to("cuda"), kernel_options={"BACKEND": "CPP"})
    with pytest.raises(ValueError, match="choose one of"):
        stax.attention_forward(q, q, q, kernel_options={"BACKEND": "CUTE"})
    with pytest.raises(RuntimeError, match="cuda tensors"):
        stax.attention_forward(q, q, q, kernel_options={"BACKEND": "TRITON"})


# ---- block masks and omni_attention (Listing 9.7, Figure 9.3) ----


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx):
    slope = stax.exp2(-(h + 1).to(stax.float32))       # one slope per head
    return score - slope * (q_idx - kv_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * stax.tanh(score / 20.0)


def sliding_window(b, h, q_idx, kv_idx):                # a per-head window: 40 keys for head 0, 80 for 1
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40 * (h + 1))


def ref_omni(q, k, v, score_fn=None, keep_fn=None):
    """float64 numpy, with the score and mask functions written on numpy index grids."""
    q, k, v = (host(x) for x in (q, k, v))
    if k.shape[1] != q.shape[1]:
        k, v = (np.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    b, h, m, n = s.shape
    grids = np.ix_(np.arange(b), np.arange(h), np.arange(m), np.arange(n))
    if score_fn is not None:
        s = score_fn(s, *grids)
    if keep_fn is not None:
        s = np.where(keep_fn(*grids), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


REF_ALIBI = lambda s, b, h, i, j: s - 2.0 ** -(h + 1.0) * (i - j)          # noqa: E731
REF_CAUSAL = lambda b, h, i, j: i >= j                                      # noqa: E731


def test_figure_9_3_causal_block_counts():
    bm = stax.create_block_mask(causal, B=None, H=None, Q_LEN=1024, KV_LEN=1024)
    assert bm.counts() == {"partial": 8, "full": 28, "empty": 28}
    assert tuple(bm.kv_num_blocks.shape) == (1, 1, 8) and bm.kv_indices.dtype is stax.int32
    assert bm.kv_num_blocks.numpy().tolist() == [[[1] * 8]]
    assert bm.full_kv_num_blocks.numpy().tolist() == [[list(range(8))]]
    assert bm.kv_indices.numpy()[0, 0, :, 0].tolist() == list(range(8))      # the diagonal
    # lengths off the block grid: positions past the end do not make a block partial
    bm = stax.create_block_mask(lambda b, h, q, kv: q >= 0, None, None, 200, 130, BLOCK_SIZE=64)
    assert bm.counts() == {"partial": 0, "full": 12, "empty": 0}
    with pytest.raises(ValueError, match="power of two"):
        stax.create_block_mask(causal, None, None, 64, 64, BLOCK_SIZE=48)


def test_listing_9_7_runs_as_printed(rng):
    """Causal attention with an ALiBi bias through stax.compile(omni_attention), N=300 (3 blocks
    of 128, the last one short), against float64; the CPU path too."""
    tp = stax
    q, k, v = (randn(rng, (1, 2, 300, 16)) for _ in range(3))
    block_mask = tp.create_block_mask(causal, B=None, H=None, Q_LEN=300, KV_LEN=300, device="cuda")
    out = tp.compile(tp.omni_attention)(q.to("cuda"), k.to("cuda"), v.to("cuda"), score_mod=alibi,
                                        block_mask=block_mask)
    ref = ref_omni(q, k, v, REF_ALIBI, REF_CAUSAL)
    assert_close(out.cpu(), ref, stax.float32)
    cpu_mask = tp.create_block_mask(causal, None, None, 300, 300)
    assert_close(tp.omni_attention(q, k, v, score_mod=alibi, block_mask=cpu_mask), ref, stax.float32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_listing_9_7_compiles_without_a_graph_break(rng, device):
    """stax.compile(omni_attention) is one graph node and one template kernel (C++ on the CPU,
    Triton on the GPU), the block mask's arrays inputs of the call: a new mask of the same
    shape reuses the artifact, another mask_mod compiles again. Odd length, grouped heads."""
    q = randn(rng, (2, 4, 200, 16))
    k, v = randn(rng, (2, 2, 200, 16)), randn(rng, (2, 2, 200, 16))
    f = stax.compile(stax.omni_attention)
    args = [t.to(device) for t in (q, k, v)]
    for mask_mod, keep in ((causal, REF_CAUSAL), (causal, REF_CAUSAL),
                           (sliding_window, lambda b, h, i, j: (i >= j) & (i - j < 40 * (h + 1)))):
        bm = stax.create_block_mask(mask_mod, None, 4, 200, 200, device=device, BLOCK_SIZE=64)
        out = f(*args, score_mod=alibi, block_mask=bm, enable_gqa=True)
        assert_close(out.cpu(), ref_omni(q, k, v, REF_ALIBI, keep), stax.float32)
        assert f.stats["eager_calls"] == 0 and len(f.last_generated.kernels) == 1
        name = next(iter(f.last_generated.kernels))
        assert name.startswith("cpp_fused_attention" if device == "cpu" else "triton_tem_fused_attention")
    assert f.stats["compiles"] == 2            # the second causal mask reused the first artifact
    with pytest.raises(stax.capture.GraphBreak, match="return_lse"):
        stax.compile(stax.omni_attention, fullgraph=True)(*args, enable_gqa=True, return_lse=True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_compiled_omni_in_a_block_fuses_its_neighbours(rng, device):
    """Projections in, heads split by a view + transpose (read in place: strided operands), the
    template, heads merged, the output projection; half types on the CPU are widened by casts
    that fuse with the ops around them. Kernel count and result against float64."""
    b, n, heads, d = 1, 70, 2, 16
    x = randn(rng, (b, n, heads * d))
    w = [randn(rng, (heads * d, heads * d)) * 0.2 for _ in range(4)]

    def block(x, wq, wk, wv, wo):
        split = lambda t: t.reshape(b, n, heads, d).transpose(1, 2)      # noqa: E731
        q, k, v = (split(x @ w_) for w_ in (wq, wk, wv))
        o = stax.omni_attention(q * 2.0, k, v, score_mod=softcap)
        return stax.relu(o.transpose(1, 2).reshape(b, n, heads * d)) @ wo

    xs, ws = host(x), [host(t) for t in w]
    split = lambda t: t.reshape(b, n, heads, d).transpose(0, 2, 1, 3)   # noqa: E731
    q, k, v = (split(xs @ w_) for w_ in ws[:3])
    o = ref_omni(q * 2.0, k, v, lambda s, b_, h, i, j: 20 * np.tanh(s / 20))
    ref = np.maximum(o.transpose(0, 2, 1, 3).reshape(b, n, heads * d), 0) @ ws[3]
    for dtype in ((stax.float32, stax.float16) if device == "cpu" else (stax.float32,)):
        f = stax.compile(block)
        out = f(*[t.to(dtype).to(device) for t in [x] + w])
        assert f.stats["eager_calls"] == 0 and out.dtype is dtype
        kernels = list(f.last_generated.kernels)
        assert sum("attention" in k_ for k_ in kernels) == 1, kernels
        tol = dict(rtol=2e-2, atol=2e-2) if dtype is stax.float16 else dict(rtol=1e-4, atol=1e-4)
        assert_close(out.cpu().float(), ref, stax.float32, **tol)
        if device == "cpu" and dtype is stax.float32:    # matmuls are extern: q * 2 fuses alone
            assert len(kernels) == 3, kernels             # q * 2; the template; relu(transpose)
    q_off = randn(rng, (1, 2, 33, 16))[:, :, 1:]             # a view with an offset and a gap
    out = stax.compile(lambda q: stax.omni_attention(q, q, q, score_mod=alibi))(q_off.to(device))
    assert_close(out.cpu(), ref_omni(q_off, q_off, q_off, REF_ALIBI), stax.float32)


@pytest.mark.parametrize("dtype", [stax.float32, stax.bfloat16])
def test_omni_softcap_sliding_window_per_head_gqa(rng, dtype):
    q = randn(rng, (2, 2, 150, 16), dtype)
    k, v = randn(rng, (2, 1, 150, 16), dtype), randn(rng, (2, 1, 150, 16), dtype)
    bm = stax.create_block_mask(sliding_window, None, 2, 150, 150, device="cuda", BLOCK_SIZE=32)
    assert bm.counts()["empty"] > 0 and bm.counts()["full"] > 0
    out, lse = stax.omni_attention(q.to("cuda"), k.to("cuda"), v.to("cuda"), score_mod=softcap,
                                   block_mask=bm, enable_gqa=True, return_lse=True)
    ref = ref_omni(q, k, v, lambda s, b, h, i, j: 20 * np.tanh(s / 20),
                   lambda b, h, i, j: (i >= j) & (i - j < 40 * (h + 1)))
    _close(out, ref, dtype)
    cpu_out, cpu_lse = stax.omni_attention(q, k, v, score_mod=softcap, block_mask=bm.to("cpu"),
                                           enable_gqa=True, return_lse=True)
    _close(cpu_out, ref, dtype)
    assert_close(lse.cpu(), host(cpu_lse), stax.float32, rtol=1e-3, atol=1e-3)


def test_omni_block_lists_of_every_length_with_blocks_read_in_pieces(rng):
    """The sparse loops load each piece's block index a step ahead: lists of 0, 1 and several
    blocks, 128-key blocks read in BLOCK_N pieces (per > 1), a ragged last block, and Q blocks
    that see no key at all (NaN rows, as eager softmax of nothing)."""
    n = 300
    late = lambda b, h, q_idx, kv_idx: (q_idx >= 128) & (q_idx >= kv_idx) & (q_idx - kv_idx < 200 * (h + 1))  # noqa: E731
    q, k, v = (randn(rng, (1, 2, n, 32)) for _ in range(3))
    bm = stax.create_block_mask(late, None, 2, n, n, device="cuda")
    counts = bm.counts()
    assert counts["empty"] > 0 and counts["full"] > 0 and counts["partial"] > 0
    out = stax.omni_attention(q.to("cuda"), k.to("cuda"), v.to("cuda"), score_mod=alibi, block_mask=bm)
    ref = ref_omni(q, k, v, REF_ALIBI, lambda b, h, i, j: (i >= 128) & (i >= j) & (i - j < 200 * (h + 1)))
    got = host(out)
    assert np.isnan(got[:, :, :128]).all() and np.isnan(ref[:, :, :128]).all()
    assert_close(got[:, :, 128:], ref[:, :, 128:], stax.float32)


def test_omni_relative_position_without_block_mask(rng):
    q, k, v = (randn(rng, (1, 3, 7, 64)) for _ in range(3))
    rel = lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx).to(stax.float32) * 0.1  # noqa: E731
    out = stax.omni_attention(q.to("cuda"), k.to("cuda"), v.to("cuda"), score_mod=rel)
    assert_close(out.cpu(), ref_omni(q, k, v, lambda s, b, h, i, j: s + (i - j) * 0.1), stax.float32)


def test_template_visits_partial_blocks_with_mask_mod_and_full_ones_without():
    from stax.attention import trace_mod
    from stax.attention_kernels import Operand, attention_template, make_spec
    x = Operand((1, 1, 256, 16), (4096, 4096, 16, 1))
    spec = make_spec(x, x, x, x, "float32")
    nb, ind = Operand((1, 1, 2, 1), (2, 2, 1, 1)), Operand((1, 1, 2, 2), (4, 4, 2, 1))
    spec.sparse, spec.mask_mod = (128, 128, nb, ind), trace_mod(causal, False)
    src = attention_template(0, spec)[1]
    partial, full = src.split("# the full blocks")
    assert "mask_tmp0 = (q_idx >= kv_idx)" in partial and "mask_tmp" not in full
    assert "range(0, pieces)" in full    # only the listed blocks: empty ones never load


def test_omni_errors(rng):
    q = randn(rng, (1, 1, 8, 16))
    outside = stax.randn(8)
    with pytest.raises(NotImplementedError, match="score_mod must compute one scalar"):
        stax.omni_attention(q.to("cuda"), q.to("cuda"), q.to("cuda"),
                            score_mod=lambda s, b, h, i, j: s + outside.sum())
    bm = stax.create_block_mask(causal, None, None, 16, 16)
    with pytest.raises(ValueError, match="Q_LEN=8, KV_LEN=8"):
        stax.omni_attention(q.to("cuda"), q.to("cuda"), q.to("cuda"), block_mask=bm)
    with pytest.raises(stax.capture.GraphBreak, match="TRITON_DECODE"):
        stax.compile(stax.omni_attention, fullgraph=True)(q.to("cuda"), q.to("cuda"), q.to("cuda"),
                                                          kernel_options={"BACKEND": "TRITON_DECODE"})


# ---- the pattern rewrite: hand-written attention becomes one template kernel ----


def _compile_on_cuda(fn, *args):
    cf = stax.compile(fn)
    out = cf(*[a.to("cuda") for a in args])
    return out, cf.last_generated


def _qkv(rng, m=9, n=13, d=16, dtype=stax.float32):
    return randn(rng, (2, 2, m, d), dtype), randn(rng, (2, 2, n, d), dtype), randn(rng, (2, 2, n, d), dtype)


def _causal_where(s):
    i = stax.arange(s.shape[-2], device=s.device)
    j = stax.arange(s.shape[-1], device=s.device)
    return stax.where(i[:, None] >= j[None, :], s, float("-inf"))


REWRITTEN = {
    "multiply": (lambda q, k, v: stax.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v,
                 lambda q, k, v: ref_attention(q, k, v, scale=0.25)[0]),
    "divide_scale_left": (lambda q, k, v: stax.softmax(0.5 * (q @ k.transpose(-2, -1)) / 2.0, dim=-1) @ v,
                          lambda q, k, v: ref_attention(q, k, v, scale=0.25)[0]),
    "causal_from_arange": (lambda q, k, v: stax.softmax(_causal_where(q @ k.transpose(-2, -1) / 4.0), -1) @ v,
                           lambda q, k, v: ref_attention(q, k, v, causal=True, scale=0.25)[0]),
    "no_scale": (lambda q, k, v: stax.softmax(q @ k.transpose(-2, -1), -1) @ v,
                 lambda q, k, v: ref_attention(q, k, v, scale=1.0)[0]),
}


@pytest.mark.parametrize("variant", sorted(REWRITTEN))
def test_hand_written_attention_is_one_template_kernel(rng, variant):
    fn, ref_fn = REWRITTEN[variant]
    q, k, v = _qkv(rng)
    out, gen = _compile_on_cuda(fn, q, k, v)
    assert list(gen.kernels) == ["triton_tem_fused_attention_0"], gen.graph.format()
    assert_close(out.cpu(), ref_fn(host(q), host(k), host(v)), stax.float32)
    assert "is_causal=True" in gen.graph.format() if variant == "causal_from_arange" else True


def test_rewrite_key_transposed_before_masks_and_half(rng):
    """K handed over already transposed ([.., D, N]), an additive mask, a bool mask, float16."""
    q, k, v = _qkv(rng)
    kt = k.transpose(-2, -1).contiguous()
    bias = randn(rng, (9, 13))
    out, gen = _compile_on_cuda(lambda q, kt, v, b: stax.softmax(q @ kt * 0.25 + b, -1) @ v, q, kt, v, bias)
    assert list(gen.kernels) == ["triton_tem_fused_attention_0"]
    assert_close(out.cpu(), ref_attention(host(q), host(k), host(v), mask=host(bias), scale=0.25)[0],
                 stax.float32)
    keep = stax.from_numpy(rng.random((2, 1, 9, 13)) < 0.8)
    out, gen = _compile_on_cuda(
        lambda q, k, v, m: stax.softmax(stax.where(m, q @ k.transpose(-2, -1) * 0.25, float("-inf")), -1) @ v,
        q, k, v, keep)
    assert list(gen.kernels) == ["triton_tem_fused_attention_0"]
    ref = ref_attention(host(q), host(k), host(v), mask=keep.numpy(), scale=0.25)[0]
    np.testing.assert_array_equal(np.isnan(host(out)), np.isnan(ref))
    assert_close(out.cpu(), ref, stax.float32)
    qh, kh, vh = (x.half() for x in (q, k, v))
    out, gen = _compile_on_cuda(lambda q, k, v: stax.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v, qh, kh, vh)
    assert list(gen.kernels) == ["triton_tem_fused_attention_0"] and out.dtype is stax.float16
    _close(out, ref_attention(host(qh), host(kh), host(vh), scale=0.25)[0], stax.float16)


UNMATCHED = {
    # a positional bias added before the scale: (S + B) * s is not S * s + mask
    "bias_before_scale": lambda q, k, v, b: stax.softmax((q @ k.transpose(-2, -1) + b) * 0.25, -1) @ v,
    # two masks
    "bias_and_where": lambda q, k, v, b: stax.softmax(_causal_where(q @ k.transpose(-2, -1) * 0.25 + b), -1) @ v,
    # the probabilities are an output too
    "weights_returned": lambda q, k, v, b: (lambda p: (p @ v, p))(stax.softmax(q @ k.transpose(-2, -1), -1)),
    # softmax over the queries, not the keys
    "other_dim": lambda q, k, v, b: stax.softmax(q @ k.transpose(-2, -1), -2) @ v,
}


@pytest.mark.parametrize("variant", sorted(UNMATCHED))
def test_unmatched_attention_runs_the_ordinary_kernels(rng, variant):
    q, k, v = _qkv(rng, m=13)
    bias = randn(rng, (13, 13))
    fn = UNMATCHED[variant]
    out, gen = _compile_on_cuda(fn, q, k, v, bias)
    assert not any("attention" in name for name in gen.kernels) and "sdpa" not in gen.graph.format()
    outs, refs = (out if isinstance(out, tuple) else (out,)), fn(q, k, v, bias)
    for o, r in zip(outs, refs if isinstance(refs, tuple) else (refs,)):
        assert_close(o.cpu(), host(r), stax.float32)


# ---- the backward: P recomputed from the LSE ----


def ref_grads(q, k, v, do, causal, mask=None):
    """dQ, dK, dV of softmax(q kᵀ/√d [+ mask]) v by the chain rule in float64 (grouped heads summed)."""
    h, hk = q.shape[1], k.shape[1]
    kk, vv = (np.repeat(x, h // hk, axis=1) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ np.swapaxes(kk, -1, -2) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ np.swapaxes(vv, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    fold = lambda x: x.reshape(x.shape[0], hk, h // hk, *x.shape[2:]).sum(2)   # noqa: E731
    return ds @ kk * scale, fold(np.swapaxes(ds, -1, -2) @ q * scale), fold(np.swapaxes(p, -1, -2) @ do)


@pytest.mark.parametrize("dtype,b,h,hk,m,n,d,causal", [
    (stax.float32, 1, 2, 2, 37, 45, 16, False),
    (stax.float32, 2, 4, 2, 70, 70, 16, True),
    (stax.float32, 1, 1, 1, 1, 1, 64, False),
    (stax.bfloat16, 1, 2, 1, 33, 50, 64, True),
])
def test_backward_kernels_match_float64(rng, dtype, b, h, hk, m, n, d, causal):
    q, do = randn(rng, (b, h, m, d), dtype), randn(rng, (b, h, m, d), dtype)
    k, v = randn(rng, (b, hk, n, d), dtype), randn(rng, (b, hk, n, d), dtype)
    refs = ref_grads(host(q), host(k), host(v), host(do), causal)
    for dev in ("cuda", "cpu"):
        args = [t.to(dev) for t in (q, k, v)]
        out, lse = stax.attention_forward(*args, is_causal=causal, enable_gqa=True)
        grads = stax.attention_backward(do.to(dev), *args, out, lse, is_causal=causal, enable_gqa=True)
        for g, r in zip(grads, refs):
            assert g.device == dev and g.dtype is dtype and tuple(g.shape) == r.shape
            if dtype is stax.float32:
                assert_close(g.cpu(), r, stax.float32, rtol=1e-4, atol=1e-4)
            else:
                assert_close(g.cpu().float(), r, stax.float32, rtol=5e-2, atol=5e-2)


def ref_mod_grads(q, k, v, do, f=None, fprime=None, keep=None):
    """dQ, dK, dV of softmax(mask(f(q kᵀ/√d))) v in float64, f' in closed form (grouped heads summed)."""
    h, hk = q.shape[1], k.shape[1]
    kk, vv = (np.repeat(x, h // hk, axis=1) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ np.swapaxes(kk, -1, -2) * scale
    grids = np.ix_(*(np.arange(n) for n in s.shape))
    s2 = f(s, *grids) if f is not None else s
    if keep is not None:
        s2 = np.where(keep(*grids), s2, -np.inf)
    p = np.exp(s2 - s2.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ np.swapaxes(vv, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * (fprime(s, *grids) if fprime is not None else 1.0)
    fold = lambda x: x.reshape(x.shape[0], hk, h // hk, *x.shape[2:]).sum(2)   # noqa: E731
    return ds @ kk * scale, fold(np.swapaxes(ds, -1, -2) @ q * scale), fold(np.swapaxes(p, -1, -2) @ do)


def relative(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx).to(stax.float32) * 0.1


MODS = {   # score_mod, f and f' on numpy grids (closed forms)
    "alibi": (alibi, REF_ALIBI, lambda s, b, h, i, j: np.ones_like(s)),
    "softcap": (softcap, lambda s, b, h, i, j: 20 * np.tanh(s / 20), lambda s, b, h, i, j: 1 - np.tanh(s / 20) ** 2),
    "relative": (relative, lambda s, b, h, i, j: s + (i - j) * 0.1, lambda s, b, h, i, j: np.ones_like(s)),
    "squared": (lambda s, b, h, i, j: s * s * 0.5 + s, lambda s, b, h, i, j: s * s * 0.5 + s,
                lambda s, b, h, i, j: s + 1),
}


def test_mod_reference_gradient_matches_finite_differences(rng):
    """The closed-form reference itself, against central differences of the float64 forward."""
    q, k, v, do = (rng.standard_normal((1, 2, 5, 4)) for _ in range(4))
    _, f, fp = MODS["softcap"]
    keep = lambda b, h, i, j: i >= j                    # noqa: E731
    dq = ref_mod_grads(q, k, v, do, lambda s, *g: f(s * 8, *g), lambda s, *g: fp(s * 8, *g) * 8, keep)[0]
    fd = np.zeros_like(q)
    for idx in np.ndindex(q.shape):
        for sign in (1, -1):
            qq = q.copy()
            qq[idx] += sign * 1e-6
            s = qq @ np.swapaxes(k, -1, -2) / 2 * 8
            s = np.where(np.tril(np.ones((5, 5), bool)), 20 * np.tanh(s / 20), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            fd[idx] += sign * ((p / p.sum(-1, keepdims=True)) @ v * do).sum() / 2e-6
    np.testing.assert_allclose(dq, fd, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mod,masked,b,h,hk,m,n,d", [
    ("alibi", True, 1, 2, 2, 37, 45, 16),
    ("softcap", False, 2, 4, 2, 70, 70, 16),
    ("relative", True, 1, 2, 1, 1, 33, 64),
    ("squared", False, 1, 1, 1, 65, 7, 16),
])
def test_backward_with_a_score_mod_matches_float64(rng, mod, masked, b, h, hk, m, n, d):
    """dS = P (dP - delta) ⊙ ∂score_mod/∂score, the derivative traced through Stax's autograd and
    printed into both backward kernels (cuda), or run eagerly on float64 scores (CPU)."""
    score_mod, f, fprime = MODS[mod]
    q, do = randn(rng, (b, h, m, d)), randn(rng, (b, h, m, d))
    k, v = randn(rng, (b, hk, n, d)), randn(rng, (b, hk, n, d))
    keep = (lambda b_, h_, i, j: (i >= j - 3) & (i - j < 20 * (h_ + 1))) if masked else None
    refs = ref_mod_grads(*(host(t) for t in (q, k, v, do)), f, fprime, keep)
    for dev in ("cuda", "cpu"):
        bm = None
        if masked:
            bm = stax.create_block_mask(lambda b_, h_, i, j: (i >= j - 3) & (i - j < 20 * (h_ + 1)),
                                        None, h, m, n, device=dev, BLOCK_SIZE=16)
        args = [t.to(dev) for t in (q, k, v)]
        out, lse = stax.omni_attention(*args, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)
        grads = stax.attention_backward(do.to(dev), *args, out, lse, enable_gqa=True, score_mod=score_mod,
                                        block_mask=bm)
        for g, r in zip(grads, refs):
            assert g.device == dev and tuple(g.shape) == r.shape
            assert_close(g.cpu(), r, stax.float32, rtol=1e-4, atol=1e-4)


def test_backward_of_an_untraceable_score_mod_is_an_error(rng):
    q = randn(rng, (1, 1, 8, 16))
    floor_mod = lambda s, b, h, i, j: s // 0.5                   # noqa: E731 (floordiv has no derivative)
    out, lse = stax.omni_attention(q, q, q, score_mod=floor_mod, return_lse=True)
    for dev in ("cpu", "cuda"):
        x = q.to(dev)
        with pytest.raises(NotImplementedError, match="derivative of score_mod cannot be traced"):
            stax.attention_backward(x, x, x, x, out.to(dev), lse.to(dev), score_mod=floor_mod)


# ---- the decode template: the keys split, the splits' triples merged ----


@pytest.mark.parametrize("b,h,hk,m,n,d", [(1, 4, 2, 1, 1000, 16), (2, 2, 2, 3, 300, 64), (1, 1, 1, 1, 1, 16)])
def test_decode_backend_splits_the_keys(rng, b, h, hk, m, n, d):
    from stax.attention_kernels import decode_splits
    assert decode_splits(1000, 132) == (8, 128) and decode_splits(32768, 17) == (16, 2048)
    q = randn(rng, (b, h, m, d))
    k, v = randn(rng, (b, hk, n, d)), randn(rng, (b, hk, n, d))
    out, lse = stax.omni_attention(q.to("cuda"), k.to("cuda"), v.to("cuda"), score_mod=alibi, enable_gqa=True,
                                   return_lse=True, kernel_options={"BACKEND": "TRITON_DECODE"})
    ref = ref_omni(q, k, v, REF_ALIBI)
    assert_close(out.cpu(), ref, stax.float32)
    _, lse_ref = stax.omni_attention(q, k, v, score_mod=alibi, enable_gqa=True, return_lse=True)
    assert_close(lse.cpu(), host(lse_ref), stax.float32)


def test_decode_backend_errors(rng):
    q = randn(rng, (1, 1, 100, 16)).to("cuda")
    with pytest.raises(ValueError, match="at most 64 queries"):
        stax.omni_attention(q, q, q, kernel_options={"BACKEND": "TRITON_DECODE"})
    with pytest.raises(RuntimeError, match="needs cuda tensors"):
        stax.omni_attention(q.cpu(), q.cpu(), q.cpu(), kernel_options={"BACKEND": "TRITON_DECODE"})
    out, lse = stax.attention_forward(q, q, q)
    with pytest.raises(ValueError, match="no backward"):
        stax.attention_backward(q, q, q, q, out, lse, kernel_options={"BACKEND": "TRITON_DECODE"})


def test_golden_attention_rewrite(request):
    """tests/golden/attention.py: hand-written causal attention (bf16, 2×4×256×64) as the one
    template kernel and its wrapper; `--regen-goldens` rewrites it (tests/golden/README.md)."""
    from pathlib import Path
    path = Path(__file__).parent / "golden" / "attention.py"
    q, k, v = (stax.randn(2, 4, 256, 64).to(stax.bfloat16) for _ in range(3))
    gen = stax.generate(REWRITTEN["causal_from_arange"][0], q, k, v, device="cuda")
    text = "\n".join(gen.kernels.values()) + "\n\n" + gen.wrapper
    if request.config.getoption("--regen-goldens"):
        path.write_text(text)
    assert path.exists(), f"{path} missing: run pytest tests/test_attention.py --regen-goldens"
    assert text == path.read_text(), f"generated code for the attention rewrite differs from {path}"


# ---- BACKEND="CPP": the C++ template on the CPU ----


def test_cpp_backend_sdpa_and_omni(rng):
    """One C++ build per case: causal sdpa with its LSE, then omni with ALiBi + a causal block
    mask, then soft-capping + a per-head sliding window with grouped heads in float16."""
    q, k, v = (randn(rng, (2, 2, 150, 16)) for _ in range(3))
    out, lse = stax.attention_forward(q, k, v, is_causal=True, kernel_options={"BACKEND": "CPP"})
    ref, lse_ref = ref_attention(host(q), host(k), host(v), causal=True)
    assert_close(out, ref, stax.float32)
    assert_close(lse, lse_ref, stax.float32)
    bm = stax.create_block_mask(causal, None, None, 150, 150, BLOCK_SIZE=64)
    out = stax.omni_attention(q, k, v, score_mod=alibi, block_mask=bm, kernel_options={"BACKEND": "CPP"})
    assert_close(out, ref_omni(q, k, v, REF_ALIBI, REF_CAUSAL), stax.float32)
    qh = randn(rng, (1, 2, 70, 16), stax.float16)
    kh, vh = randn(rng, (1, 1, 70, 16), stax.float16), randn(rng, (1, 1, 70, 16), stax.float16)
    bm = stax.create_block_mask(sliding_window, None, 2, 70, 70, BLOCK_SIZE=16)
    out = stax.omni_attention(qh, kh, vh, score_mod=softcap, block_mask=bm, enable_gqa=True,
                              kernel_options={"BACKEND": "CPP"})
    assert out.dtype is stax.float16
    ref = ref_omni(qh, kh, vh, lambda s, b, h, i, j: 20 * np.tanh(s / 20),
                   lambda b, h, i, j: (i >= j) & (i - j < 40 * (h + 1)))
    assert_close(out, ref, stax.float16)


def test_rewrite_only_what_the_template_runs(rng):
    """Rank 5 and symbolic sizes (dynamic=True): the template would not run them, so the graph
    keeps its ordinary kernels rather than an sdpa node on the host."""
    f = lambda q, k, v: stax.softmax(q @ k.transpose(-2, -1) * 0.3, -1) @ v       # noqa: E731
    q, k, v = randn(rng, (2, 2, 3, 5, 8)), randn(rng, (2, 2, 3, 6, 8)), randn(rng, (2, 2, 3, 6, 8))
    out, gen = _compile_on_cuda(f, q, k, v)
    assert "sdpa" not in gen.graph.format() and len(gen.kernels) == 3
    assert_close(out.cpu(), ref_attention(host(q), host(k), host(v), scale=0.3)[0], stax.float32)
    q, k, v = _qkv(rng)
    cf = stax.compile(f, dynamic=True)
    out = cf(q.to("cuda"), k.to("cuda"), v.to("cuda"))
    assert "sdpa" not in cf.last_generated.graph.format()
    assert_close(out.cpu(), ref_attention(host(q), host(k), host(v), scale=0.3)[0], stax.float32)


def test_decode_is_the_default_for_a_few_queries(rng):
    import stax.attention as att
    q, k, v = randn(rng, (1, 2, 1, 16)), randn(rng, (1, 2, 200, 16)), randn(rng, (1, 2, 200, 16))
    att._KERNELS.clear(), att._LAUNCHES.clear()
    out = stax.omni_attention(q.to("cuda"), k.to("cuda"), v.to("cuda"))
    assert [kern.name for kern in att._KERNELS.values()] == ["triton_tem_fused_attention_decode_split",
                                                               "triton_tem_fused_attention_decode_merge"]
    assert_close(out.cpu(), ref_attention(host(q), host(k), host(v))[0], stax.float32)


def test_nan_and_inf_inputs_match_eager(rng):
    """A NaN in a query row makes that row NaN (eager's softmax); an inf key makes every row that
    sees it NaN or inf alike; the GPU template, the CPU template and eager agree on where."""
    q, k, v = randn(rng, (1, 1, 20, 16)), randn(rng, (1, 1, 33, 16)), randn(rng, (1, 1, 33, 16))
    qn, kn = host(q).astype(np.float32), host(k).astype(np.float32)
    qn[0, 0, 3, 5] = np.nan
    kn[0, 0, 10, 2] = np.inf
    q, k = stax.from_numpy(qn), stax.from_numpy(kn)
    eager = host(stax.scaled_dot_product_attention(q, k, v, is_causal=True))
    f = stax.compile(lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, is_causal=True))
    gpu = host(f(q.to("cuda"), k.to("cuda"), v.to("cuda")))
    cpu, _ = stax.attention_forward(q, k, v, is_causal=True, kernel_options={"BACKEND": "CPP"})
    bm = stax.create_block_mask(causal, None, None, 20, 33, BLOCK_SIZE=16)
    compiled_cpu = stax.compile(lambda q, k, v: stax.omni_attention(q, k, v, block_mask=bm))(q, k, v)
    for got in (gpu, host(cpu), host(compiled_cpu)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(eager))
        assert_close(got, eager, stax.float32)
    assert np.isnan(eager[0, 0, 3]).all() and not np.isnan(eager[0, 0, 4]).any()


def test_tensor_with_cuda_as_the_default_device():
    """stax.tensor under set_default_device('cuda') once recursed forever (it built its host copy
    on the default device again); the mods' proxies and the examples' --device cuda need it."""
    stax.set_default_device("cuda")
    try:
        t = stax.tensor([0.5, 1.5])
    finally:
        stax.set_default_device("cpu")
    assert t.device == "cuda" and t.cpu().numpy().tolist() == [0.5, 1.5]


def test_eager_sdpa_on_cuda_runs_the_template(rng):
    import stax.attention as att
    q, k, v, ref, _ = _sdpa_case(rng, stax.float32, (1, 2, 40, 16), 50, True)
    att._KERNELS.clear(), att._LAUNCHES.clear()
    out = stax.scaled_dot_product_attention(q.to("cuda"), k.to("cuda"), v.to("cuda"), is_causal=True)
    assert out.device == "cuda" and [kern.name for kern in att._KERNELS.values()] == ["triton_tem_fused_attention_0"]
    assert_close(out.cpu(), ref, stax.float32)
    q5 = q.reshape(1, 1, 2, 40, 16).to("cuda")            # rank 5: no template, the op on the host
    out5 = stax.scaled_dot_product_attention(q5, q5, q5)
    assert_close(out5.cpu(), ref_attention(host(q5)[0], host(q5)[0], host(q5)[0])[0][None], stax.float32)


SOFTCAP = 4.0


def softcap_by_global(score, b, h, q_idx, kv_idx):
    return SOFTCAP * stax.tanh(score / SOFTCAP)


def test_eager_launches_print_their_text_once(rng, monkeypatch):
    """An eager call on cuda tensors prints its template only the first time (a decode loop's
    steps spend no host time printing); another shape, causality, a mod, or a new value of a
    global the mod reads prints a new kernel, and each answer is the float64 one."""
    import stax.attention as att
    printed = []
    monkeypatch.setattr(att, "attention_template", lambda i, spec: printed.append(spec) or TEMPLATE(i, spec))
    decode = att.decode_templates
    monkeypatch.setattr(att, "decode_templates", lambda spec, *a: printed.append(spec) or decode(spec, *a))
    monkeypatch.setattr(att, "_LAUNCHES", {})
    q, k, v = (randn(rng, (1, 2, n, 16)) for n in (24, 30, 30))
    qc, kc, vc = (t.to("cuda") for t in (q, k, v))
    s = host(q).astype(np.float64) @ np.swapaxes(host(k), -1, -2) / 4.0
    for _ in range(3):
        out = stax.omni_attention(qc, kc, vc, score_mod=softcap_by_global)
    assert len(printed) == 1
    probs = lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    assert_close(out.cpu(), probs(4.0 * np.tanh(s / 4.0)) @ host(v), stax.float32)
    monkeypatch.setattr(sys.modules[__name__], "SOFTCAP", 2.0)
    out = stax.omni_attention(qc, kc, vc, score_mod=softcap_by_global)
    assert len(printed) == 2
    assert_close(out.cpu(), probs(2.0 * np.tanh(s / 2.0)) @ host(v), stax.float32)
    for args, kw in (((qc[:, :, :7], kc, vc), {}), ((qc, kc, vc), {"is_causal": True})):   # (7 queries: decode)
        for _ in range(2):
            out = stax.scaled_dot_product_attention(*args, **kw)
        assert_close(out.cpu(), ref_attention(*(host(t) for t in args), causal=bool(kw))[0], stax.float32)
    assert len(printed) == 4


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_backward_with_an_attention_mask(rng, kind):
    b, h, m, n, d = 1, 2, 30, 41, 16
    q, do = randn(rng, (b, h, m, d)), randn(rng, (b, h, m, d))
    k, v = randn(rng, (b, h, n, d)), randn(rng, (b, h, n, d))
    if kind == "bool":
        mask_np = rng.random((m, n)) < 0.6
        mask_np[:, 0] = True                     # every row keeps a key
    else:
        mask_np = rng.standard_normal((1, h, m, n)).astype(np.float32)
    mask = stax.from_numpy(mask_np)
    refs = ref_grads(host(q), host(k), host(v), host(do), False, mask_np if kind == "bool" else mask_np.astype(np.float64))
    for dev in ("cuda", "cpu"):
        args = [t.to(dev) for t in (q, k, v)]
        out, lse = stax.attention_forward(*args, attn_mask=mask.to(dev))
        grads = stax.attention_backward(do.to(dev), *args, out, lse, attn_mask=mask.to(dev))
        for g, r in zip(grads, refs):
            assert_close(g.cpu(), r, stax.float32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_omni_attention_under_dynamic_shapes_specializes_its_sizes(rng, device):
    """Its templates take static sizes: with dynamic=True, q, k and v's sizes and strides are
    specialized to the call's (guarded), so the template runs (no eager call, equal to eager),
    and a call at another size fails the guard and compiles again."""
    for mask_n in (None, 33):
        bm = None if mask_n is None else stax.create_block_mask(lambda b, h, i, j: i >= j, None, None, 33, 33,
                                                                device=device)
        f = stax.compile(lambda q, k, v: stax.omni_attention(q, k, v, block_mask=bm) * 2, dynamic=True)
        for n in ((33, 40) if bm is None else (33, 33)):
            q, k, v = (randn(rng, (1, 2, n, 16)).to(device) for _ in range(3))
            want = stax.omni_attention(q.cpu(), k.cpu(), v.cpu(), block_mask=None if bm is None else
                                       stax.create_block_mask(lambda b, h, i, j: i >= j, None, None, 33, 33)) * 2
            assert_close(f(q, k, v).cpu(), want, stax.float32)
        assert f.stats["eager_calls"] == 0 and f.stats["compiles"] == (2 if bm is None else 1), f.stats
        assert "omni_attn" in f.last_generated.graph.format()
