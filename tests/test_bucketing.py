"""Prop. 10.3 bucketing: options={"shape_padding": "pow2"} gives each symbolic size the artifact of
its power-of-two bucket (2^(k-1), 2^k]; kernels mask up to 2^k and reductions pad with their
identity, so sum, amax, softmax and layer_norm equal float64 numpy at every size, with at most
ceil(log2 M) - floor(log2 m) + 1 artifacts for sizes in [m, M].
"""
import math

import numpy as np
import pytest

import stax
from conftest import assert_close

rng = np.random.default_rng(103)


def four(x):
    return x.sum(-1), x.amax(-1), stax.softmax(x, -1), stax.layer_norm(x, (x.shape[-1],))


def _refs(x):
    x = np.asarray(x.numpy(), dtype=np.float64)
    with np.errstate(invalid="ignore"):         # (the NaN / inf rows: their values are not compared)
        e = np.exp(x - x.max(-1, keepdims=True))
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return x.sum(-1), x.max(-1), e / e.sum(-1, keepdims=True), (x - mu) / np.sqrt(var + 1e-5)


def _check(got, x):
    for g, want in zip(got, _refs(x)):
        assert_close(g.cpu(), want, "float32")


def test_buckets_bound_the_versions_and_results_equal_numpy():
    compiled = stax.compile(four, dynamic=True, options={"shape_padding": "pow2"})
    sizes = [3, 5, 7, 9, 17, 31, 33, 63, 65, 100]
    for n in sizes:
        x = stax.from_numpy((rng.standard_normal((6, n)) - 4).astype(np.float32))   # all < 0: a 0 pad would show in amax
        _check(compiled(x), x)
    m, M = min(sizes), max(sizes)
    buckets = {1 << (n - 1).bit_length() for n in sizes}
    assert compiled.stats["compiles"] == len(buckets) <= math.ceil(math.log2(M)) - math.floor(math.log2(m)) + 1
    assert compiled.stats["eager_calls"] == 0
    x = stax.from_numpy(rng.standard_normal((6, 70)).astype(np.float32))             # same bucket as 65, 100: reused
    x.numpy()[1, 3], x.numpy()[2, 5] = np.nan, np.inf
    got = compiled(x)
    assert compiled.stats["compiles"] == len(buckets)
    assert np.isnan(got[0].numpy()[1]) and np.isinf(got[1].numpy()[2]) and np.isnan(got[2].numpy()[2]).all()
    ok = [0, 3, 4]
    for g, want in zip(got, _refs(x)):
        assert_close(g.numpy()[ok], want[ok], "float32")


def test_guard_checks_the_bucket(monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "guards,graph")
    compiled = stax.compile(lambda x: x.sum(-1), dynamic=True, options={"shape_padding": "pow2"})
    compiled(stax.randn(3, 100))
    out = capsys.readouterr().err
    assert "if s1 < 65: return False" in out and "if s1 > 128: return False" in out
    assert "size s1 <= 128" in out            # in the graph, hence in the artifact key


def test_triton_bucket_is_a_persistent_reduction_with_masks():
    # (on the GPU when there is one; conftest runs the Triton interpreter otherwise)
    compiled = stax.compile(four, dynamic=True, options={"shape_padding": "pow2"})
    for n in (65, 100, 127):
        x = stax.from_numpy((rng.standard_normal((3, n)) - 4).astype(np.float32))
        _check(compiled(x.to("cuda")), x)
    assert compiled.stats["compiles"] == 1
    text = str(compiled.last_generated)
    assert "R0_BLOCK: tl.constexpr = 128" in text and "if EVEN_R0 else r0_index < r0_numel" in text
    assert "persistent_reduction" in text


def test_bad_options_are_errors():
    with pytest.raises(ValueError, match="must be 'pow2'"):
        stax.compile(four, dynamic=True, options={"shape_padding": "pow3"})
    with pytest.raises(ValueError, match="pass dynamic=True"):
        stax.compile(four, dynamic=False, options={"shape_padding": "pow2"})
