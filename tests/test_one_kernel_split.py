"""§6.5 / §9.4 Alg. 6.1's OUTER split as one kernel (issue 12): the last split of a column block combines.

`triton_outer.one_kernel_split` joins the split kernel (partials [splits, outputs]) and the
kernel that combines them: each program stores its partials, arrives at its column block's int32
counter (`triton_helpers.last_arrival`), and the last to arrive reads the block's partials in
split order and runs the combine and any epilogue, then sets the counter back to 0. These tests
run the kernels in Triton's interpreter against float64 numpy (odd sizes, 7 splits, half types,
fused prologues and epilogues, symbolic sizes), check that a second call (the counters reset)
gives the same bits, that `STAX_SPLIT_ONE_KERNEL=0` restores the two kernels and `=all` joins
row splits too (a multi_kernel where the pieces have two forms), and that the kernel text builds
for sm_90 (tests/test_gpu.py's MORE holds the var case; the golden is
tests/golden/outer_split.py).
"""
import math

import numpy as np
import pytest

import stax
from conftest import assert_close, run_outside_interpreter


def _one_kernel(gen) -> bool:
    return "split_counts_" in gen.wrapper and "triton_helpers.last_arrival" in "".join(gen.kernels.values())


def _run(fn, ref, base, dtype=stax.float32, rtol=1e-4, count=1, dynamic=False, again=None):
    """Compile `fn`, call it twice on `base` (then once on `again`, if given), compare each with
    float64 numpy; return the generated code."""
    cf = stax.compile(fn, dynamic=dynamic)
    outs = [cf(base.to("cuda")).cpu() for _ in range(2)]
    a = np.asarray(base.float().numpy(), np.float64)
    atol = rtol * 0.1 * math.sqrt(count)
    for out in outs:
        out = out.float() if out.dtype == stax.bfloat16 else out
        assert_close(out, ref(a), dtype, rtol=rtol, atol=atol, msg=str(cf.last_generated))
    first, second = (np.asarray(o.float().numpy() if o.dtype == stax.bfloat16 else o.numpy()) for o in outs)
    assert np.array_equal(first, second, equal_nan=True), "the second call (counters reset) differs"
    if again is not None:
        out = cf(again.to("cuda")).cpu()
        assert_close(out, ref(np.asarray(again.numpy(), np.float64)), dtype, rtol=rtol, atol=atol)
    return cf.last_generated


REFS = {
    "sum": lambda a, d: a.sum(d), "mean": lambda a, d: a.mean(d), "amax": lambda a, d: a.max(d),
    "amin": lambda a, d: a.min(d), "var": lambda a, d: a.var(d, ddof=1),
    "std": lambda a, d: a.std(d, ddof=1), "prod": lambda a, d: a.prod(d),
}


@pytest.mark.parametrize("op,shape", [("sum", (1000, 263)), ("mean", (4097, 65)), ("amax", (2048, 160)),
                                      ("amin", (1000, 263)), ("var", (4097, 65)), ("std", (2048, 160)),
                                      ("prod", (1000, 263))])
def test_ops_over_dim_0(op, shape):
    """(1000, 263): 7 splits of 143 rows (the last one short); (4097, 65): 32, one column past 64."""
    rng = np.random.default_rng(hash((op, shape)) % 2**32)
    base = rng.standard_normal(shape)
    base = 1 + 0.002 * base if op == "prod" else base
    x = stax.tensor(base.astype(np.float32))
    gen = _run(lambda t: getattr(t, op)(0), lambda a: REFS[op](a, 0), x, count=shape[0])
    if op == "var" and any(n.startswith("triton_red") for n in gen.kernels):
        # var's pieces whose combine loops over its splits stay two kernels (triton_outer:
        # serial in one program, it lost to the second kernel on the H200)
        assert len(gen.kernels) == 2 and not _one_kernel(gen), gen
    else:
        assert _one_kernel(gen) and len(gen.kernels) == 1, gen


@pytest.mark.parametrize("op", ["amax", "sum"])
def test_outputs_over_two_dims(op):
    """amax over a middle dim (issue 12's amax_mid, smaller): the outputs (16, 24) stay two dims
    in the pieces' index, [splits, 16, 24] with the input's strides (they do not merge), and are
    still one kernel; 24 columns, not a power of two, and 1000 rows, 7 splits."""
    x = stax.tensor(np.random.default_rng(11).standard_normal((16, 1000, 24)).astype(np.float32))
    gen = _run(lambda t: getattr(t, op)(1), lambda a: REFS[op](a, 1), x, count=1000)
    assert _one_kernel(gen) and len(gen.kernels) == 1, gen


def test_argmax_over_dim_0():
    """argmax is not split (its combine needs the index): correct in whatever form it takes."""
    x = stax.randn(4097, 65)
    cf = stax.compile(lambda t: t.argmax(0))
    assert np.array_equal(cf(x.to("cuda")).cpu().numpy(), np.argmax(x.numpy(), 0))


@pytest.mark.parametrize("channels_last,mode", [(False, "1"), (False, "all"), (True, "1")])
def test_batch_norm_statistics_over_0_2_3(channels_last, mode, monkeypatch):
    """NCHW (0, 2, 3): contiguous it is a row reduction, whose split stays two kernels by default
    (STAX_SPLIT_ONE_KERNEL=all: one); channels-last its reads run across rows, the OUTER split,
    one kernel."""
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", mode)
    shape = (16, 32, 30, 30)
    if channels_last:
        base = stax.randn(5, 23, 29, 96)

        def fn(t):
            t = t.permute(0, 3, 1, 2)
            return t.mean((0, 2, 3)), t.var((0, 2, 3))

        def ref(a):
            a = a.transpose(0, 3, 1, 2)
            return a.mean((0, 2, 3)), a.var((0, 2, 3), ddof=1)
    else:
        base = stax.randn(*shape)

        def fn(t):
            return t.mean((0, 2, 3)), t.var((0, 2, 3))

        def ref(a):
            return a.mean((0, 2, 3)), a.var((0, 2, 3), ddof=1)
    cf = stax.compile(fn)
    for _ in range(2):
        mean, var = cf(base.to("cuda"))
        m_ref, v_ref = ref(np.asarray(base.numpy(), np.float64))
        assert_close(mean.cpu(), m_ref, stax.float32, rtol=1e-4, atol=1e-5)
        assert_close(var.cpu(), v_ref, stax.float32, rtol=1e-4, atol=1e-5)
    assert _one_kernel(cf.last_generated) == (channels_last or mode == "all"), cf.last_generated


@pytest.mark.parametrize("shape", [(64, 16384), (7, 40000), (3, 100003)])
def test_row_splits_in_one_kernel(shape, monkeypatch):
    """STAX_SPLIT_ONE_KERNEL=all: a row split (Listing 9.4's two kernels by default) as one, with
    an epilogue; odd row lengths and row counts."""
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", "all")
    x = stax.randn(*shape)
    gen = _run(lambda t: (t * t).sum(-1).sqrt() + 1, lambda a: np.sqrt((a * a).sum(-1)) + 1, x, count=shape[1])
    assert _one_kernel(gen) and len(gen.kernels) == 1, gen


def test_unknown_switch_value_is_an_error(monkeypatch):
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", "yes")
    with pytest.raises(ValueError, match="STAX_SPLIT_ONE_KERNEL='yes': use 1"):
        stax.generate(lambda t: t.sum(0), stax.randn(2048, 160), device="cuda")


def test_fused_prologue_and_epilogues():
    """A prologue in the split's loads; a pointwise epilogue reading another input, in the combine."""
    x, b = stax.randn(2048, 160), stax.randn(160)
    cf = stax.compile(lambda t, c: ((t * 2 + 1).abs().sum(0).sqrt() * 3 + c, (t.amax(0) - c).relu()))
    outs = cf(x.to("cuda"), b.to("cuda"))
    a, c = np.asarray(x.numpy(), np.float64), np.asarray(b.numpy(), np.float64)
    assert_close(outs[0].cpu(), np.sqrt(np.abs(a * 2 + 1).sum(0)) * 3 + c, stax.float32)
    assert_close(outs[1].cpu(), np.maximum(a.max(0) - c, 0), stax.float32)
    assert _one_kernel(cf.last_generated), cf.last_generated


@pytest.mark.parametrize("dtype,rtol", [(stax.float16, 2e-3), (stax.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("op", ["sum", "mean", "amax"])
def test_half_inputs(op, dtype, rtol):
    x = stax.tensor((np.random.default_rng(3).standard_normal((2048, 160)) * 0.5).astype(np.float32)).to(dtype)
    gen = _run(lambda t: getattr(t, op)(0), lambda a: REFS[op](a, 0), x, dtype, rtol=rtol, count=2048)
    assert _one_kernel(gen), gen


def test_middle_dims_and_symbolic_sizes():
    """mean over (0, 1) of a 3-D tensor; a dynamic artifact called at a larger size (its counters
    grow, freshly zeroed) and a smaller one."""
    gen = _run(lambda t: t.mean((0, 1)), lambda a: a.mean((0, 1)), stax.randn(16, 70, 263), count=1120)
    assert _one_kernel(gen)
    gen = _run(lambda t: t.sum(0), lambda a: a.sum(0), stax.randn(2048, 160), count=3000, dynamic=True,
               again=stax.randn(3000, 170))
    assert _one_kernel(gen) and "zeroed_workspace_cuda('split_counts_0', s1)" in gen.wrapper, gen.wrapper
    cf = stax.compile(lambda t: t.sum(0), dynamic=True)
    for shape in ((2048, 160), (3000, 170), (999, 131)):
        x = stax.randn(*shape)
        assert_close(cf(x.to("cuda")).cpu(), np.asarray(x.numpy(), np.float64).sum(0), stax.float32,
                     rtol=1e-4, atol=1e-4 * math.sqrt(shape[0]))


def test_two_kernel_switch_gives_the_same_values(monkeypatch):
    """STAX_SPLIT_ONE_KERNEL=0: the two kernels of before (the lead compares both on the H200)."""
    x = stax.randn(2048, 160)
    one = stax.compile(lambda t: t.var(0))
    a = one(x.to("cuda")).cpu().numpy()
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", "0")
    two = stax.compile(lambda t: t.var(0))
    b = two(x.to("cuda")).cpu().numpy()
    assert not _one_kernel(two.last_generated) and len(two.last_generated.kernels) == 2
    assert np.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_cpu_keeps_its_column_split(rng):
    x = stax.from_numpy(rng.standard_normal((2048, 160)).astype(np.float32))
    gen = stax.generate(lambda t: t.sum(0), x)
    assert "last_arrival" not in str(gen) and "split_counts" not in gen.wrapper
    # (a float32 sum of 2048 terms of magnitude ~1: absolute errors up to ~2048·eps·|x| ≈ 2e-4)
    assert_close(stax.compile(lambda t: t.sum(0))(x), np.asarray(x.numpy(), np.float64).sum(0), stax.float32,
                 atol=2e-4)


def test_row_split_with_two_forms_of_its_pieces(monkeypatch):
    """STAX_SPLIT_ONE_KERNEL=all on batch-norm statistics whose pieces (whole images, 65 x 65) have
    a persistent and a looped form (§9.4's multi-pass row): a multi_kernel of two one-kernel forms,
    each checked (the interpreter runs the first; the second forced), data with a large mean."""
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", "all")
    rng = np.random.default_rng(5)
    b = (5 + 3 * rng.standard_normal((8, 3, 65, 65))).astype(np.float32)
    fn = lambda t: (t.mean((0, 2, 3)), t.var((0, 2, 3), unbiased=False))      # noqa: E731
    cf = stax.compile(fn)
    B = b.astype(np.float64)
    for _ in range(2):
        mean, var = cf(stax.tensor(b).to("cuda"))
        assert_close(mean.cpu(), B.mean((0, 2, 3)), stax.float32)
        assert_close(var.cpu(), B.var((0, 2, 3)), stax.float32, rtol=2e-5)
    gen = cf.last_generated
    assert "multi_kernel_0" in gen.wrapper and gen.wrapper.count(".run(") == 1 and len(gen.kernels) == 2, gen
    assert all("triton_helpers.last_arrival(" in t for t in gen.kernels.values())
    from stax import triton_heuristics
    names = list(gen.kernels)
    module = cf.artifacts[next(iter(cf.artifacts))][0].__globals__
    module["multi_kernel_0"].chosen = module[names[1]]          # the other form, run the same way
    mean, var = cf(stax.tensor(b).to("cuda"))
    assert_close(mean.cpu(), B.mean((0, 2, 3)), stax.float32)
    assert_close(var.cpu(), B.var((0, 2, 3)), stax.float32, rtol=2e-5)
    assert isinstance(module["multi_kernel_0"], triton_heuristics.MultiKernel)


def test_row_split_kernels_build_for_sm90(tmp_path, monkeypatch):
    """The =all forms (tests/test_gpu.py builds the default ones): every candidate for sm_90."""
    from test_gpu import SM90_SCRIPT
    monkeypatch.setenv("STAX_SPLIT_ONE_KERNEL", "all")
    paths = []
    for i, (fn, shape) in enumerate([(lambda t: (t * t).sum(-1).sqrt(), (64, 16384)),
                                     (lambda t: (t.mean((0, 2, 3)), t.var((0, 2, 3))), (8, 3, 65, 65))]):
        gen = stax.generate(fn, stax.randn(*shape), device="cuda")
        assert _one_kernel(gen), gen
        path = tmp_path / f"m{i}.py"
        path.write_text(gen.module.source)
        paths.append(str(path))
    built = run_outside_interpreter(SM90_SCRIPT, *paths)
    assert len(built) >= 6 and all(elf and warps >= 1 for elf, warps in built.values()), built
