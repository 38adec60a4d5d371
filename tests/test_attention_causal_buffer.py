"""§9.10 a mask that is data, causal by its values: nanoGPT's `tril` buffer takes the causal loop.

`att.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)` reads a tensor, not aranges: the rewrite
(fuse_attention.py) computes the mask's values when the function compiles and, when they are
exactly the top-left causal pattern, prints the causal template (the blocks left of the diagonal
without a mask, none past it) with no N x N mask; the tensors it read are value guards (their
storage and version, runtime.guard_values). Another tensor there, or a write to it (eager or
compiled), compiles again with the mask as data. Triton runs in its interpreter here (conftest);
references are float64 numpy.
"""
import math

import numpy as np
import pytest

import stax
import stax.nn.functional as F
from conftest import assert_close
from test_attention import record_direct_launches, ref_attention  # noqa: F401 (autouse fixture)
from test_attention_grad import host, randn, ref_loss_grads

TOL = dict(rtol=2e-4, atol=2e-4)
CAUSAL_LOOP = "# the blocks left of the diagonal: no causal mask"


def attention(q, k, v, bias):
    """nanoGPT's CausalSelfAttention, after the projections."""
    T = q.size(-2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


class Attention:
    def __init__(self, block):
        self.bias = stax.tril(stax.ones(block, block)).view(1, 1, block, block).to("cuda")

    def forward(self, q, k, v):
        return attention(q, k, v, self.bias)


def qkv(rng, b, t, n=None, d=16):
    n = t if n is None else n
    return [randn(rng, s, device="cuda") for s in ((b, 2, t, d), (b, 2, n, d), (b, 2, n, d))]


def kernels(f):
    return f.last_generated.kernels


def assert_causal(f, guarded=True):
    """One kernel, the causal template (no mask read); the guard says so in the graph."""
    text = f.last_generated.graph.format()
    assert "is_causal=True" in text, text
    assert ("values of" in text) == guarded, text
    ks = kernels(f)
    assert len(ks) == 1 and CAUSAL_LOOP in next(iter(ks.values())), list(ks)


def assert_data(f):
    text = f.last_generated.graph.format()
    assert "is_causal=False" in text and "values of" not in text, text


@pytest.mark.parametrize("b,t", [(1, 7), (2, 33), (1, 64)])
def test_module_buffer_compiles_to_the_causal_template(rng, b, t):
    m = Attention(64)
    f = stax.compile(lambda q, k, v: m.forward(q, k, v))
    q, k, v = qkv(rng, b, t)
    assert_close(host(f(q, k, v)), ref_attention(host(q), host(k), host(v), causal=True)[0],
                 stax.float64, **TOL)
    assert_causal(f)


def test_closure_buffer_and_the_slice(rng):
    bias = stax.tril(stax.ones(40, 40)).view(1, 1, 40, 40).to("cuda")
    f = stax.compile(lambda q, k, v: attention(q, k, v, bias), dynamic=False)   # (the template: static sizes)
    for t in (9, 40):                             # T below the buffer's size, then all of it
        q, k, v = qkv(rng, 2, t)
        assert_close(host(f(q, k, v)), ref_attention(host(q), host(k), host(v), causal=True)[0],
                     stax.float64, **TOL)
        assert_causal(f)


def test_argument_mask_is_guarded_by_identity(rng):
    """A mask passed as an argument (bench/gpu.py's GPT-2 step): causal while it is the same
    tensor, unwritten; another tensor compiles again, as data from then on."""
    bias = stax.tril(stax.ones(16, 16)).view(1, 1, 16, 16).to("cuda")
    f = stax.compile(attention)
    q, k, v = qkv(rng, 1, 11)
    ref = ref_attention(host(q), host(k), host(v), causal=True)[0]
    assert_close(host(f(q, k, v, bias)), ref, stax.float64, **TOL)
    assert_causal(f)
    assert_close(host(f(q, k, v, bias)), ref, stax.float64, **TOL)
    assert f.stats["compiles"] == 1
    other = (stax.rand(1, 1, 16, 16) < 0.6).float().to("cuda")
    keep = host(other)[:, :, :11, :11] != 0
    keep[..., 0] = True
    other[:, :, :11, 0] = 1.0
    assert_close(host(f(q, k, v, other)), ref_attention(host(q), host(k), host(v), mask=keep)[0],
                 stax.float64, **TOL)
    assert f.stats["compiles"] == 2
    assert_data(f)


def _flipped(t, i, j, value, diagonal=0):
    m = stax.tril(stax.ones(t, t), diagonal=diagonal)
    m[i, j] = value
    return m


@pytest.mark.parametrize("name,make", [
    ("tril_one_off", lambda t: _flipped(t, 5, 2, 0.0)),      # one kept entry dropped
    ("tril_one_on", lambda t: _flipped(t, 2, 5, 1.0)),       # one future key kept
    ("strict_tril", lambda t: _flipped(t, 0, 0, 1.0, diagonal=-1)),   # no diagonal (row 0 keeps key 0)
    ("triu", lambda t: stax.triu(stax.ones(t, t))),
])
def test_non_causal_buffers_stay_data(rng, name, make):
    bias = make(16).view(1, 1, 16, 16).to("cuda")
    f = stax.compile(lambda q, k, v: attention(q, k, v, bias))
    q, k, v = qkv(rng, 2, 16)
    keep = host(bias) != 0
    assert_close(host(f(q, k, v)), ref_attention(host(q), host(k), host(v), mask=keep)[0],
                 stax.float64, **TOL)
    assert_data(f)


def test_top_left_when_queries_and_keys_differ(rng):
    """Nq != Nk: PyTorch's is_causal is top left (query i sees keys j <= i); a buffer sliced to
    [:M, :N] is that; the bottom-right alignment (tril(diagonal=N-M)) is data."""
    m, n = 7, 12
    tri = stax.tril(stax.ones(16, 16)).to("cuda")
    bottom = stax.tril(stax.ones(m, n), diagonal=n - m).to("cuda")
    q, k, v = qkv(rng, 1, m, n)

    def fn(q, k, v, mask):
        s = (q @ k.transpose(-2, -1)) * 0.25
        return F.softmax(s.masked_fill(mask[:m, :n] == 0, float("-inf")), dim=-1) @ v
    f = stax.compile(lambda q, k, v: fn(q, k, v, tri))
    assert_close(host(f(q, k, v)), ref_attention(host(q), host(k), host(v), causal=True, scale=0.25)[0],
                 stax.float64, **TOL)
    assert_causal(f)
    g = stax.compile(lambda q, k, v: fn(q, k, v, bottom))
    assert_close(host(g(q, k, v)), ref_attention(host(q), host(k), host(v), mask=host(bottom) != 0,
                                                 scale=0.25)[0], stax.float64, **TOL)
    assert_data(g)


@pytest.mark.parametrize("how", ["eager_write", "compiled_write", "rebound"])
def test_a_changed_buffer_gives_the_eager_answer(rng, how):
    """After the first call the buffer changes (an entry set to 0 in place, eagerly or by a
    compiled function, or the name rebound to another tril tensor of that layout): the next call
    equals eager, from a recompile with the mask as data."""
    m = Attention(16)
    f = stax.compile(lambda q, k, v: m.forward(q, k, v))
    q, k, v = qkv(rng, 1, 13)
    f(q, k, v)
    assert_causal(f)
    if how == "eager_write":
        m.bias[0, 0, 6, 3] = 0.0
    elif how == "compiled_write":
        def drop(b):
            b[0, 0, 6, 3] = 0.0
        stax.compile(drop)(m.bias)
    else:
        m.bias = stax.tril(stax.ones(16, 16)).view(1, 1, 16, 16).to("cuda")
    got = host(f(q, k, v))
    assert_close(got, host(m.forward(q, k, v)), stax.float64, **TOL)
    keep = host(m.bias)[..., :13, :13] != 0
    assert_close(got, ref_attention(host(q), host(k), host(v), mask=keep)[0], stax.float64, **TOL)
    assert f.stats["compiles"] == 2
    assert_data(f)
    f(q, k, v)
    assert f.stats["compiles"] == 2                # (the data mask is kept: no recompile per call)


def test_tril_inside_the_function_and_an_additive_buffer(rng):
    """tril computed in the function: causal with nothing to guard; an additive 0 / -inf buffer."""
    def inside(q, k, v):
        t = q.size(-2)
        return attention(q, k, v, stax.tril(stax.ones(t, t, device=q.device)).view(1, 1, t, t))
    add = stax.where(stax.tril(stax.ones(20, 20)) != 0, 0.0, float("-inf")).to("cuda")
    additive = lambda q, k, v: stax.softmax(q @ k.transpose(-2, -1) * 0.25 + add[:9, :9], -1) @ v  # noqa: E731
    q, k, v = qkv(rng, 2, 9)
    for fn, guarded, scale in ((inside, False, None), (additive, True, 0.25)):
        f = stax.compile(fn)
        assert_close(host(f(q, k, v)), ref_attention(host(q), host(k), host(v), causal=True, scale=scale)[0],
                     stax.float64, **TOL)
        assert_causal(f, guarded)


def test_training_takes_the_causal_templates(rng, monkeypatch):
    """fuse_attention_for_training finds the buffer causal too: the forward saves no mask, the
    backward is the causal dK/dV and dQ templates; a write after the first step recompiles."""
    from stax import fuse_attention
    monkeypatch.setattr(fuse_attention, "TRAIN_IEEE_FLOAT32", True)
    m = Attention(16)
    q, k, v = (randn(rng, (1, 2, 10, 16), device="cuda", grad=True) for _ in range(3))
    w = randn(rng, (1, 2, 10, 16), device="cuda")
    f = stax.compile(lambda q, k, v, w: (m.forward(q, k, v) * w).sum())

    def grads(mask=None):
        for t in (q, k, v):
            t.grad = None
        f(q, k, v, w).backward()
        ref = ref_loss_grads(host(q), host(k), host(v), host(w), causal=mask is None, mask=mask)
        for t, r in zip((q, k, v), ref):
            assert_close(host(t.grad), r, stax.float64, **TOL)
    grads()
    part = next(e for e in f.artifacts.values() if e is not None).part
    fwd, bwd = part.forward.format(), part.backward.format()
    assert "is_causal=True" in fwd and "values of" in fwd, fwd
    assert "attn_bwd" in bwd and "is_causal=False" not in bwd, bwd
    assert not any(n.op == "constant" for n in part.saved), part.format()     # no mask saved
    m.bias[0, 0, 4, 1] = 0.0
    grads(mask=host(m.bias)[..., :10, :10] != 0)
    assert f.stats["compiles"] == 2
    assert "is_causal=False" in f.last_generated.graph.format()
