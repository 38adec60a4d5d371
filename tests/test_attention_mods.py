"""§9.10 score_mod plans (stax/attention_mods.py): hoisting, dropped row terms, the folded FMA.

The plan is read off the traced lines; the kernels it prints are checked against the float64
eager path (CPU tensors) and against the kernels of the same mod printed as traced, per score
(STAX_SCORE_MOD_PLAN=0): outputs, LSEs and gradients, dense and block-sparse, the decode
template, odd sizes, grouped heads. Kernels run in Triton's interpreter where there is no GPU.
"""
import numpy as np
import pytest

import stax
from conftest import assert_close
from test_attention import record_direct_launches  # noqa: F401 (autouse: test_zz_sm90.py builds these kernels)
from stax.attention import trace_mod
from stax.attention_kernels import PLAN_ENV, _raw_scores, attention_template, contiguous_operand, make_spec
from stax.attention_mods import hoist_mod, plan_score_mod

f32 = stax.float32


def alibi(s, b, h, q, kv):
    return s - stax.exp2(-(h + 1).to(f32)) * (q - kv)


MODS = {
    "alibi": alibi,
    "row_only": lambda s, b, h, q, kv: s + stax.sin(q.to(f32)) * 3.0 - q * 0.25,
    "column_only": lambda s, b, h, q, kv: s + kv * 0.05 - stax.cos(kv.to(f32)),
    "bh_only": lambda s, b, h, q, kv: s + h * 0.5 + b - 3.0,
    "scaled": lambda s, b, h, q, kv: (s * 2.0 - (h + 1).to(f32) * (q - kv) * 0.01) / (h + 1).to(f32),
    "negated": lambda s, b, h, q, kv: 0.5 - s + kv * 0.01,
    "softcap": lambda s, b, h, q, kv: 20.0 * stax.tanh(s / 20.0),
    "softcap_alibi": lambda s, b, h, q, kv: 20.0 * stax.tanh(s / 20.0) - stax.exp2(-(h + 1).to(f32)) * (q - kv),
    "joint": lambda s, b, h, q, kv: s + (q * kv).to(f32) * 0.001 + q * 0.1,
    "huge_ints": lambda s, b, h, q, kv: s + (q * 100000 - kv).to(f32) * 1e-6,
}
BOUNDS = (("b", 0, 1), ("h", 0, 3), ("q_idx", 0, 256), ("kv_idx", 0, 256))


def plan(name, bounds=BOUNDS):
    body = trace_mod(MODS[name], True)
    return plan_score_mod(tuple(body.lines), body.result, bounds, 0.25)


# ---- the plans ----


def test_alibi_is_folded_with_its_row_term_dropped():
    p = plan("alibi")
    assert p.folded and p.factor is None and p.column and p.dropped and not p.tile
    assert any("libdevice.exp2" in x for x in p.uniform)           # the slope: once per program
    assert any("q_idx - q0" in x for x in p.row)                    # centred on the block's first row
    assert any("q0 - kv_idx" in x for x in p.col)
    assert not any("q_idx" in x for x in p.col) and not any("kv_idx" in x for x in p.row)


@pytest.mark.parametrize("name,folded,factor,column,dropped", [
    ("row_only", True, False, False, True),
    ("column_only", True, False, True, False),
    ("bh_only", True, False, False, True),
    ("scaled", True, True, True, True),
    ("negated", True, True, True, True),
    ("softcap", False, False, False, False),
    ("softcap_alibi", False, False, False, True),
    ("joint", False, False, False, True),
    ("huge_ints", False, False, False, False),
])
def test_plans_by_kind(name, folded, factor, column, dropped):
    p = plan(name)
    assert (p.folded, bool(p.factor), bool(p.column), bool(p.dropped)) == (folded, factor, column, dropped)
    if not folded:
        assert p.result and p.tile
    if name == "softcap":           # not additive: hoisted only, the traced expression kept
        assert p.uniform == ["mod_u0 = tl.full([1, 1], 20.0, tl.float32)"] and len(p.tile) == 3
    if name == "huge_ints":         # q * 100000 passes 2^24: the conversion is not split
        assert any(".to(tl.float32)" in x and "mod_s" in x.split(" = ")[1] for x in p.tile)


def test_integer_split_needs_the_bounds():
    small = plan("alibi")
    big = plan("alibi", (("b", 0, 1), ("h", 0, 3), ("q_idx", 0, 1 << 25), ("kv_idx", 0, 1 << 25)))
    assert small.folded and small.dropped
    assert not big.folded and big.dropped is None and any("q_idx - kv_idx" in x for x in big.tile)


def test_derivative_of_an_additive_mod_is_one():
    d = trace_mod(alibi, True, derivative=True)
    assert hoist_mod(tuple(d.lines), d.result).result == "1.0"
    d = trace_mod(MODS["softcap"], True, derivative=True)
    h = hoist_mod(tuple(d.lines), d.result)
    assert h.result.startswith("dmod_s") and h.uniform and h.tile


def _spec(name, m=256, n=256):
    x, y = contiguous_operand((2, 4, m, 16)), contiguous_operand((2, 4, n, 16))
    spec = make_spec(x, y, y, x, "bfloat16")
    spec.score_mod = trace_mod(MODS[name], True)
    return spec


def test_kernel_text_names_what_it_hoisted_and_dropped(monkeypatch):
    src = attention_template(0, _spec("alibi"))[1]
    loop = src.split("for start_n")[1]
    assert "# score_mod, hoisted by what it reads" in src and "dropped from the scores" in src
    assert "libdevice.exp2" not in loop and "q_idx - q0" not in loop
    assert "qk = qk * 0.36067376022224085 + mod_c" in loop                  # 0.25 · log2 e
    assert "+ row_drop" in src.split("tl.store(out_ptr1")[1]
    assert _raw_scores(_spec("row_only")) and not _raw_scores(_spec("alibi"))
    monkeypatch.setenv(PLAN_ENV, "0")
    plain = attention_template(0, _spec("alibi"))[1]
    assert "row_drop" not in plain and "score_tmp5 = (q_idx - kv_idx)" in plain.split("for start_n")[1]


# ---- the kernels: planned = float64 = printed as traced ----


def randn(rng, shape):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _omni(q, k, v, mod, bm, backend=None):
    dev = q.device
    opts = {"BACKEND": backend} if backend else None
    out, lse = stax.omni_attention(q, k, v, score_mod=mod, block_mask=bm if bm is None or dev == "cuda"
                                   else bm.to("cpu"), enable_gqa=True, return_lse=True, kernel_options=opts)
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("name", list(MODS))
def test_forward_matches_float64_and_the_traced_kernel(rng, monkeypatch, name):
    mod = MODS[name]
    q = randn(rng, (2, 4, 70, 16))
    k, v = randn(rng, (2, 2, 90, 16)), randn(rng, (2, 2, 90, 16))
    window = lambda b, h, i, j: (i + 20 >= j) & (j + 30 * (h + 1) > i)        # noqa: E731
    bm = stax.create_block_mask(window, None, 4, 70, 90, device="cuda", BLOCK_SIZE=16)
    for mask in (None, bm):
        ref_out, ref_lse = _omni(q, k, v, mod, mask)
        gpu = [t.to("cuda") for t in (q, k, v)]
        out, lse = _omni(*gpu, mod, mask)
        monkeypatch.setenv(PLAN_ENV, "0")
        traced_out, traced_lse = _omni(*gpu, mod, mask)
        monkeypatch.delenv(PLAN_ENV)
        for got in ((out, lse), (traced_out, traced_lse)):
            assert_close(got[0], ref_out, f32, rtol=1e-4, atol=1e-4)
            assert_close(got[1], ref_lse, f32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["alibi", "row_only", "softcap_alibi"])
def test_decode_template_shifts_its_stored_max_back(rng, name):
    q = randn(rng, (1, 4, 3, 16))
    k, v = randn(rng, (1, 2, 700, 16)), randn(rng, (1, 2, 700, 16))
    ref_out, ref_lse = _omni(q, k, v, MODS[name], None)
    out, lse = _omni(*(t.to("cuda") for t in (q, k, v)), MODS[name], None, "TRITON_DECODE")
    assert_close(out, ref_out, f32, rtol=1e-4, atol=1e-4)
    assert_close(lse, ref_lse, f32, rtol=1e-4, atol=1e-4)


def test_long_alibi_keeps_float32_accuracy(rng):
    """N=1024, slope 1/2 on head 0: the kept column term is centred on the query block (slope ·
    kv_idx alone would cost ulp(512) on every score)."""
    q, k, v = (randn(rng, (1, 2, 1024, 16)) for _ in range(3))
    bm = stax.create_block_mask(lambda b, h, i, j: i >= j, None, None, 1024, 1024, device="cuda")
    ref_out, ref_lse = _omni(q, k, v, alibi, bm)
    out, lse = _omni(*(t.to("cuda") for t in (q, k, v)), alibi, bm)
    assert_close(out, ref_out, f32)
    assert_close(lse, ref_lse, f32)


def test_a_dropped_term_that_is_not_finite_gives_the_rows_softmax_would(rng):
    """log(q_idx) is -inf on row 0: every score of that row is -inf, so its output is NaN (as
    softmax's) and its LSE -inf, though the kernel left the term out of the scores."""
    mod = lambda s, b, h, q, kv: s + stax.log(q.to(f32)) - kv * 0.1        # noqa: E731
    assert plan_score_mod(tuple(trace_mod(mod, True).lines), trace_mod(mod, True).result, BOUNDS, 1.0).dropped
    q, k, v = (randn(rng, (1, 2, 20, 16)) for _ in range(3))
    ref_out, ref_lse = _omni(q, k, v, mod, None)
    out, lse = _omni(*(t.to("cuda") for t in (q, k, v)), mod, None)
    assert np.isnan(out.numpy()[:, :, 0]).all() and np.isneginf(lse.numpy()[:, :, 0]).all()
    assert_close(out, ref_out, f32, rtol=1e-4, atol=1e-4)
    assert_close(lse, ref_lse, f32, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["alibi", "row_only", "column_only", "scaled", "softcap", "softcap_alibi"])
def test_backward_matches_float64_and_the_traced_kernels(rng, monkeypatch, name):
    """The backward kernels print the forward's plan (P = 2^(S - LSE), the dropped row terms out
    of the LSE): the gradients are the float64 ones, and the traced kernels'."""
    mod = MODS[name]
    q, do = randn(rng, (1, 4, 45, 16)), randn(rng, (1, 4, 45, 16))
    k, v = randn(rng, (1, 2, 37, 16)), randn(rng, (1, 2, 37, 16))
    keep = lambda b, h, i, j: (i + 5 >= j) & (i - j < 20 * (h + 1))          # noqa: E731
    grads = {}
    for dev, plan_env in (("cpu", "1"), ("cuda", "1"), ("cuda", "0")):
        monkeypatch.setenv(PLAN_ENV, plan_env)
        bm = stax.create_block_mask(keep, None, 4, 45, 37, device=dev, BLOCK_SIZE=16)
        args = [t.to(dev) for t in (q, k, v)]
        out, lse = stax.omni_attention(*args, score_mod=mod, block_mask=bm, enable_gqa=True, return_lse=True)
        grads[dev, plan_env] = [g.cpu() for g in stax.attention_backward(
            do.to(dev), *args, out, lse, enable_gqa=True, score_mod=mod, block_mask=bm)]
    for key in (("cuda", "1"), ("cuda", "0")):
        for g, r in zip(grads[key], grads["cpu", "1"]):
            assert_close(g, r, f32, rtol=1e-4, atol=1e-4, msg=str(key))
