"""Alg. 6.1 with symbolic reduction sizes (§10.3): the split count is chosen at the hint (the
example's size) and the split stays correct at every size: each piece is ceil(R / splits) long,
computed at run time, and the part past R is masked to the reduction's identity.
"""
import numpy as np
import pytest
import sympy

import stax
from conftest import assert_close
from stax import dynshape
from stax.ir import FloorDiv

rng = np.random.default_rng(65)


def _f64(t):
    return np.asarray(t.numpy(), dtype=np.float64)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_split_chosen_at_the_hint_is_correct_at_every_size(device):
    # (cuda: on the GPU when there is one; conftest runs the Triton interpreter otherwise)
    # one row (CPU: fewer rows than threads) of 100000 at the hint: both back ends split it
    base = stax.from_numpy((rng.standard_normal((1, 100000)) - 3).astype(np.float32))
    compiled = stax.compile(lambda x: ((x * x).sum(-1), x.amax(-1)), dynamic=True)
    on_device = base.to(device)
    for n in (100000, 9001, 13, 2):
        got = compiled(on_device[:, :n])    # one layout (row stride 100000): one artifact
        xf = _f64(base[:, :n])
        assert_close(got[0].cpu(), (xf * xf).sum(-1), "float32")
        assert_close(got[1].cpu(), xf.max(-1), "float32")
    assert compiled.stats["compiles"] == 1
    text = str(compiled.last_generated)
    assert "// " in text or "floor" in text.lower()   # the piece length, a run-time division


def test_split_count_comes_from_the_hint_on_the_gpu():
    compiled = stax.compile(lambda x: (x * x).sum(-1), dynamic=True)
    x = stax.from_numpy(rng.standard_normal((3, 100000)).astype(np.float32))
    assert_close(compiled(x.to("cuda")).cpu(), (_f64(x) ** 2).sum(-1), "float32")
    text = str(compiled.last_generated)
    assert "triton_per_fused_1" in text and "(s1 + 12) // 13" in text      # 13 pieces of ~8192
    assert "empty_strided_cuda((s0, 13), (13, 1)" in text


def test_guard_text_keeps_a_product_divisor_together():
    # `(s0*s1 // 2*s1)` once read as ((s0*s1) // 2) * s1: the guard of this reshape failed on the
    # very inputs it was captured on
    fn = lambda x: x.reshape(2, -1, x.shape[-1]).mean((0, 1))     # noqa: E731
    compiled = stax.compile(fn, dynamic=True)
    for n, m in ((6, 512), (10, 1030), (4, 7)):
        x = stax.from_numpy(rng.standard_normal((n, m)).astype(np.float32))
        assert_close(compiled(x), _f64(x).reshape(2, -1, m).mean((0, 1)), "float32")
    assert compiled.stats["compiles"] == 1
    s0, s1 = (sympy.Symbol(n, integer=True, positive=True) for n in ("s0", "s1"))
    text = dynshape.pyexpr(FloorDiv(s0 * s1, 2 * s1))
    assert eval(text, {"s0": 6, "s1": 5}) == 3, text


def test_column_reductions_keep_full_blocks_constant():
    compiled = stax.compile(lambda x: (x.sum(0), x.var(0)), dynamic=True)
    for n, m in ((6, 1024), (5, 1030), (3, 2049), (2, 3)):
        x = stax.from_numpy(rng.standard_normal((n, m)).astype(np.float32))
        got = compiled(x)
        assert_close(got[0], _f64(x).sum(0), "float32")
        assert_close(got[1], _f64(x).var(0, ddof=1), "float32")
    assert compiled.stats["compiles"] == 1
    kernel = next(iter(compiled.last_generated.kernels.values()))
    assert "if (x0_n == " in kernel and "l < x0_n" in kernel      # (the block: chosen at the hint)


def test_a_reshape_of_symbolic_sizes_loads_without_dividing():
    # k*(y % m) + k*m*(y // m) = k*y puts a contiguous input's digits back together (§10.3)
    fn = lambda g: g.reshape(-1, 64).sum(0)      # noqa: E731
    compiled = stax.compile(fn, dynamic=True)
    for shape in ((8, 16, 64), (3, 5, 64), (2, 7, 128)):
        g = stax.from_numpy(rng.standard_normal(shape).astype(np.float32))
        assert_close(compiled(g), _f64(g).reshape(-1, 64).sum(0), "float32")
    assert compiled.stats["compiles"] == 1
    kernel = next(iter(compiled.last_generated.kernels.values()))
    assert "in_ptr0[64*r0 + x0]" in kernel and "/ s" not in kernel.split("r0++")[1]
