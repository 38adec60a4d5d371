"""§7 fusion of several reductions over one input into one kernel (issue 13's chain, issue 12 item 4).

A chain of dependent row reductions (`x = sin(x) + x.sum(-1, keepdim=True) * 1e-3`, repeated) is
one kernel on both back ends, up to `schedule.MAX_FUSED_REDUCTIONS` reductions a kernel; its
persistent GPU form launches enough programs to use the SMs (`autotune.default_config`). Kernel
counts come from `stax.generate` (no compiler); numerics against float64 numpy on the CPU and
through Triton's interpreter (tests/test_zz_sm90.py then builds every kernel here for sm_90).
"""
import numpy as np
import pytest

import stax
from conftest import assert_close
from stax import autotune, schedule


def chain(steps):
    def fn(x):
        for _ in range(steps):
            x = stax.sin(x) + x.sum(-1, keepdim=True) * 1e-3
        return x
    return fn


def chain_ref(x, steps):
    x = np.asarray(x, np.float64)
    for _ in range(steps):
        x = np.sin(x) + x.sum(-1, keepdims=True) * 1e-3
    return x


def tensor(a, device):
    t = stax.from_numpy(np.ascontiguousarray(a, np.float32))
    return t.to("cuda") if device == "cuda" else t


# ---- issue 13: the chain of dependent row reductions ----


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_twenty_step_chain_is_one_kernel(device):
    g = stax.generate(chain(20), stax.randn(64, 64), device=device)
    assert len(g.kernels) == 1
    (text,) = g.kernels.values()
    if device == "cuda":        # the persistent form: the row stays in registers, sin once a step
        assert "triton_per_" in text and text.count("libdevice.sin(") == 20
        assert text.count("tl.load(") == 1 and text.count("tl.store(") == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_longer_chain_splits_at_the_limit(device):
    n = schedule.MAX_FUSED_REDUCTIONS
    g = stax.generate(chain(n + 3), stax.randn(16, 24), device=device)
    assert len(g.kernels) == 2
    sched = g.schedule.splitlines()
    assert sum(line.startswith("kernel") for line in sched) == 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("shape", [(7, 33), (1, 1000), (5, 1)])
def test_chain_matches_float64(device, shape, rng):
    a = rng.standard_normal(shape)
    assert_close(stax.compile(chain(6))(tensor(a, device)).cpu(), chain_ref(a, 6), stax.float32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_chain_split_by_a_small_limit_matches_float64(device, rng, monkeypatch):
    """7 reductions at a limit of 3: three kernels, the sums of the first read by the later ones;
    a NaN in one row stays in that row."""
    monkeypatch.setattr(schedule, "MAX_FUSED_REDUCTIONS", 3)
    a = rng.standard_normal((9, 17))
    a[4, 3] = np.nan
    x = tensor(a, device)
    assert len(stax.generate(chain(7), x).kernels) == 3
    out = stax.compile(chain(7))(x).cpu().numpy()
    ref = chain_ref(a, 7)
    assert np.isnan(out[4]).all() and not np.isnan(np.delete(out, 4, 0)).any()
    assert_close(out, ref, stax.float32)


def test_chain_of_a_transposed_input(rng):
    a = rng.standard_normal((19, 6))
    x = stax.from_numpy(a.astype(np.float32)).t()        # (6, 19), rows strided
    assert_close(stax.compile(chain(4))(x), chain_ref(a.T, 4), stax.float32)


def test_few_rows_spread_over_the_sms():
    """The persistent default gives each SM a program before packing rows (64 rows of 64: XBLOCK
    1, one warp; it was one program of 64 rows on one SM); many rows keep 4K elements a block."""
    def cfg(x, r):
        return autotune.default_config("persistent_reduction", {"xnumel": x, "r0_numel": r},
                                       autotune.ReductionHint.INNER, autotune.next_pow2(r))
    small = cfg(64, 64)
    assert small["XBLOCK"] == 1 and small["num_warps"] == 1
    assert cfg(8, 1024)["XBLOCK"] == 1
    big = cfg(32768, 1024)
    assert big["XBLOCK"] == 4 and autotune.grid_for("persistent_reduction", {"xnumel": 32768}, big)[0] == 8192
    for x, r in [(64, 64), (300, 128), (1000, 7), (8192, 32)]:
        c = cfg(x, r)
        programs = -(-x // c["XBLOCK"])
        assert programs >= min(x, autotune.TARGET_PROGRAMS)


# ---- issue 12 item 4: `x.sum(0)` and `x.sum(1)` of one input read it once ----


def both(x):
    return x.sum(0), x.sum(1)


def four(x):
    return x.amax(1), x.amin(0), x.sum(1), x.prod(0)


def four_ref(a):
    a = np.asarray(a, np.float64)
    return a.max(1), a.min(0), a.sum(1), a.prod(0)


def kernels(fn, x, device="cpu"):
    return stax.generate(fn, x, device=device).kernels


@pytest.mark.parametrize("fn", [both, lambda x: (x.sum(1), x.sum(0)), four])
def test_row_and_column_reductions_are_one_cpu_kernel(fn):
    ks = kernels(fn, stax.randn(37, 53))
    assert len(ks) == 1
    (text,) = ks.values()
    assert text.count("in_ptr0[") == 1          # one load of the input in the one pass


def test_gpu_keeps_two_kernels():
    """The GPU decision: a row block cannot finish a column's sum, so one kernel would need a
    cross-program combine (atomics or a second pass); two kernels each read the input once."""
    assert len(kernels(both, stax.randn(37, 53), "cuda")) == 2


@pytest.mark.parametrize("shape", [(4, 2000), (6, 5, 7)])
def test_what_does_not_fit_stays_apart(shape):
    x = stax.randn(*shape)           # a row past MAX_CROSS_COLUMNS; a 3-D input reduced two ways
    assert len(kernels(lambda x: (x.sum(0), x.sum(-1)), x)) == 2


def test_a_reduction_that_reads_the_other_is_not_crossed(rng):
    def fn(x):
        c = x.sum(0)
        return c, (x * c).sum(1)
    a = rng.standard_normal((9, 14))
    assert len(kernels(fn, stax.randn(9, 14))) == 2
    c, r = stax.compile(fn)(stax.from_numpy(a.astype(np.float32)))
    assert_close(c, a.sum(0), stax.float32)
    assert_close(r, (a * a.sum(0)).sum(1), stax.float32)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("shape", [(37, 53), (1000, 7), (7, 1000), (300, 256), (0, 5), (5, 0)])
def test_row_and_column_sums_match_float64(device, shape, rng):
    a = rng.standard_normal(shape)
    s0, s1 = stax.compile(both)(tensor(a, device))
    assert_close(s0.cpu(), a.sum(0), stax.float32)
    assert_close(s1.cpu(), a.sum(1), stax.float32)


def test_large_pass_runs_in_parallel_parts(rng):
    (text,) = kernels(both, stax.randn(300, 256)).values()
    if stax.get_num_threads() > 1:
        assert "#pragma omp parallel for" in text and "part_" in text


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_four_reductions_with_nan_and_inf(device, rng):
    a = rng.standard_normal((23, 19))
    a[3, 5], a[7, 2], a[11, 11] = np.nan, np.inf, -np.inf
    outs = stax.compile(four)(tensor(a, device))
    for got, ref in zip(outs, four_ref(a)):
        assert_close(got.cpu(), ref, stax.float32)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_strided_inputs(layout, rng):
    a = rng.standard_normal((21, 40))
    t = stax.from_numpy(a.astype(np.float32))
    x, ref = (t.t(), a.T) if layout == "transposed" else (t[:, ::2], a[:, ::2])
    s0, s1 = stax.compile(both)(x)
    assert_close(s0, ref.sum(0), stax.float32)
    assert_close(s1, ref.sum(1), stax.float32)


def test_half_types(rng):
    a = rng.standard_normal((17, 33))
    for dt in (stax.bfloat16, stax.float16):
        x = stax.from_numpy(a.astype(np.float32)).to(dt)
        ref = np.asarray(x.float().numpy(), np.float64)
        s0, s1 = stax.compile(both)(x)
        assert s0.dtype is dt
        assert_close(s0.float(), ref.sum(0), dt)
        assert_close(s1.float(), ref.sum(1), dt)
