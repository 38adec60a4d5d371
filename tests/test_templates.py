"""§9.8 matmul templates: epilogue fusion, split-K, precision, tuning cost (issue 14).

Runs through Triton's interpreter where there is no GPU (conftest sets TRITON_INTERPRET=1); every
kernel generated here is also built for sm_90 by tests/test_zz_sm90.py. References are float64
numpy on fresh random inputs.
"""
import numpy as np
import pytest

import stax
from conftest import assert_close
from stax import template_tuning as tt


def compiled(fn, *args):
    """(compiled outputs as a tuple, the generated code)."""
    cf = stax.compile(fn)
    out = cf(*[a.to("cuda") for a in args])
    return (out if isinstance(out, tuple) else (out,)), cf.last_generated


def check(fn, *args, k=1):
    """Compiled against float64: the reference runs eagerly on float64 copies of the inputs."""
    outs, gen = compiled(fn, *args)
    refs = fn(*[a.double() for a in args])
    refs = refs if isinstance(refs, tuple) else (refs,)
    # a half-precision intermediate (a @ b returned and reused, as eager does) is rounded once: an
    # error up to one ulp of the largest value, which a cancelling epilogue (+ c) does not shrink
    ulp = {stax.bfloat16: 2.0 ** -8, stax.float16: 2.0 ** -11}
    biggest = max(float(np.abs(r.cpu().numpy()).max(initial=0)) for r in refs)
    for o, r in zip(outs, refs):
        dt = o.dtype
        atol = max({stax.float32: 1e-5}.get(dt, 1e-3) * max(1.0, k ** 0.5), ulp.get(dt, 0) * biggest)
        assert_close(o.cpu().double(), r, dt, atol=atol)
    return gen


def kinds(gen) -> list:
    """The kernels that run, in order (the persistent TMA alternative of a template left out)."""
    return [name.rsplit("_", 1)[0] for name in gen.kernels if not name.startswith("triton_persistent")]


# ---- §9.8 epilogue fusion ----


@pytest.mark.parametrize("name,fn,shapes,dtype", [
    ("linear_relu", lambda x, w, b: stax.relu(x @ w.t() + b), [(33, 40), (45, 40), (45,)], stax.float32),
    ("residual_scale", lambda a, b, r: (a @ b) * 0.5 + r, [(17, 70), (70, 9), (17, 9)], stax.float16),
    ("cast_out", lambda a, b: ((a @ b).sigmoid()).to(stax.float16), [(5, 37), (37, 11)], stax.float32),
    ("two_outputs", lambda a, b, c: (a @ b, stax.relu(a @ b + c) * 2), [(9, 20), (20, 13), (13,)], stax.bfloat16),
    ("m_is_1", lambda a, b, c: (a @ b + c).tanh(), [(1, 50), (50, 7), (7,)], stax.float32),
    ("n_is_1", lambda a, b, c: stax.relu(a @ b - c), [(7, 50), (50, 1), (7, 1)], stax.float32),
    ("batched_broadcast", lambda a, b, c: a @ b + c, [(3, 1, 5, 9), (4, 9, 6), (6,)], stax.float32),
])
def test_epilogue_is_fused_into_the_template(name, fn, shapes, dtype):
    args = [stax.randn(*s).to(dtype) for s in shapes]
    gen = check(fn, *args, k=shapes[0][-1])
    tem = [s for n, s in gen.kernels.items() if n.startswith("triton_tem")]
    assert tem and all("tl.dot" in s for s in tem)
    assert kinds(gen).count("triton_poi_fused") <= (1 if name == "batched_broadcast" else 0), list(gen.kernels)
    assert "extern_kernel" not in gen.module.source
    # the epilogue sits between the accumulation and the store, under the template's mask
    src = tem[-1]
    assert src.index("acc = tl.dot(") < src.index("xmask = ") < src.index("tl.store(")


def test_linear_reads_the_weight_in_place_and_is_one_kernel():
    x, w, b = stax.randn(8, 29), stax.randn(40, 31), stax.randn(29)
    gen = check(lambda x, w, b: stax.relu(x @ w[3:32, 2:].t() + b), x, w, b, k=29)
    (src,) = gen.kernels.values()
    assert "B = in_ptr1 + (95 + rk[:, None] + rn[None, :] * 31)" in src
    assert "tl.maximum(" in src and src.count("tl.store(") == 1


def test_epilogue_propagates_nan_and_inf():
    a, b, c = stax.randn(6, 8), stax.randn(8, 5), stax.randn(5)
    a[2, 3], c[1], c[4] = float("nan"), float("inf"), float("-inf")
    gen = check(lambda a, b, c: stax.relu(a @ b + c), a, b, c, k=8)
    assert kinds(gen) == ["triton_tem_fused_mm"]


@pytest.mark.parametrize("name,fn,count", [
    ("reduction", lambda a, b: (a @ b).sum(-1), 2),               # a reduction is never an epilogue
    ("transposed_read", lambda a, b: (a @ b).t() + a, 2),          # reads another element than it computes
])
def test_epilogues_that_cannot_fuse_run_separately(name, fn, count):
    a, b = stax.randn(12, 12), stax.randn(12, 12)
    gen = check(fn, a, b, k=12)
    assert len(kinds(gen)) == count and kinds(gen)[0] == "triton_tem_fused_mm"


def test_in_place_update_of_an_input_is_not_an_epilogue():
    def f(x, a, b):
        x.add_(a @ b)
        return x
    x, a, b = stax.randn(6, 5), stax.randn(6, 4), stax.randn(4, 5)
    dev = [t.to("cuda") for t in (x, a, b)]
    cf = stax.compile(f)
    cf(*dev)
    ref = x.double() + a.double() @ b.double()
    assert_close(dev[0].cpu().double(), ref, stax.float32)
    assert len(kinds(cf.last_generated)) == 2


# ---- §9.8 split-K ----


def test_split_k_exactly_on_the_chapters_criterion():
    assert tt.split_k_applies(32, 32, 4096) and not tt.split_k_applies(32, 32, 4064)
    a, b, c = stax.randn(32, 4096), stax.randn(4096, 32), stax.randn(32)
    fn = lambda a, b, c: stax.relu(a @ b + c)            # noqa: E731
    gen = check(fn, a, b, c, k=4096)
    tem, total = gen.kernels["triton_tem_fused_mm_0"], gen.kernels["triton_poi_fused_1"]
    assert "SPLIT_K : tl.constexpr" in tem and "'SPLIT_K': 16" in tem and "tl.maximum" not in tem
    assert "for z in range(1, 16):" in total and "tl.maximum" in total     # the epilogue after the sum
    again, _ = compiled(fn, a, b, c)
    first, _ = compiled(fn, a, b, c)
    assert np.array_equal(again[0].cpu().numpy(), first[0].cpu().numpy())   # deterministic
    gen = check(lambda a, b: a @ b, stax.randn(32, 4064), stax.randn(4064, 32), k=4064)
    assert kinds(gen) == ["triton_tem_fused_mm"] and "SPLIT_K" not in gen.kernels["triton_tem_fused_mm_0"]


def test_split_k_batched_half_and_ragged_k():
    a, b = stax.randn(2, 3, 1000), stax.randn(1000, 5)
    gen = check(lambda a, b: (a @ b) * 2, a.to(stax.bfloat16), b.to(stax.bfloat16), k=1000)
    (tem,) = [s for n, s in gen.kernels.items() if n.startswith("triton_tem")]
    assert "SPLIT_K : tl.constexpr" in tem
    assert tt.split_k_factor(3, 5, 1000, 2, 132) == 3       # at least 256 of K per split: 1000 // 256
    assert tt.split_k_factor(64, 64, 65536, 1, 132) == tt.SPLIT_K_MAX


# ---- §9.8 precision ----


def test_float32_matmul_precision():
    assert stax.get_float32_matmul_precision() == "highest"
    f = stax.compile(lambda a, b: a @ b)
    a, b = stax.randn(8, 16).to("cuda"), stax.randn(16, 8).to("cuda")
    f(a, b)
    assert 'input_precision="ieee"' in str(f.last_generated)
    try:
        for p in ("high", "medium"):
            stax.set_float32_matmul_precision(p)
            out = f(a, b)
            assert 'input_precision="tf32"' in str(f.last_generated) and "out_dtype=tl.float32" in str(f.last_generated)
            # TF32 rounds each operand to 10 bits: an error of 2^-11 a product, growing as √K
            assert_close(out.cpu().double(), a.cpu().double() @ b.cpu().double(), stax.bfloat16,
                         atol=5e-3 * 16 ** 0.5)
        with pytest.raises(ValueError, match="highest"):
            stax.set_float32_matmul_precision("low")
    finally:
        stax.set_float32_matmul_precision("highest")
    f(a, b)
    assert 'input_precision="ieee"' in str(f.last_generated)
    h = stax.compile(lambda a, b: a @ b)(a.to(stax.float16), b.to(stax.float16))
    assert h.dtype == stax.float16


def test_tf32_copies_operands_that_are_not_k_major(monkeypatch):
    # under TF32 Hopper's tensor cores read float32 operands K-major only: a row-major B (or a
    # transposed A) is copied K-major by one pointwise kernel first; x @ w.t() is read in place
    from stax import templates
    big = [(512, 520), (520, 600), (600,)]
    cases = {"row_major_b": (lambda a, b, c: stax.relu(a @ b + c), big, ["triton_poi_fused", "triton_tem_fused_mm"]),
             "linear": (lambda x, w, c: x @ w.t() + c, [(512, 520), (600, 520), (600,)], ["triton_tem_fused_mm"]),
             "transposed_a": (lambda a, b, c: a.t() @ b.t() + c, [(520, 512), (600, 520), (600,)],
                              ["triton_poi_fused", "triton_tem_fused_mm"])}
    try:
        stax.set_float32_matmul_precision("high")
        for name, (fn, shapes, want) in cases.items():
            gen = stax.generate(fn, *[stax.randn(*s) for s in shapes], device="cuda")
            assert kinds(gen) == want, (name, list(gen.kernels))
        gen = stax.generate(cases["row_major_b"][0], *[stax.randn(*s) for s in big], device="cuda")
        assert "empty_strided_cuda((520, 600), (1, 520), stax.float32)" in gen.wrapper
        assert "computes matmul" in next(iter(gen.kernels.values()))
        # odd and batched shapes against float64 (the copy forced below its size threshold)
        monkeypatch.setattr(templates, "TF32_COPY_MIN_FLOPS", 0)
        for fn, shapes in ((lambda a, b: a @ b, [(33, 47), (47, 29)]),
                           (lambda a, b: (a.transpose(-1, -2) @ b) * 2, [(3, 20, 17), (3, 20, 9)])):
            args = [stax.randn(*s) for s in shapes]
            (out,), gen = compiled(fn, *args)
            assert kinds(gen)[0] == "triton_poi_fused", list(gen.kernels)
            k = shapes[0][-2] if len(shapes[0]) == 3 else shapes[0][-1]      # TF32 (2^-11 a product) grows as √K
            assert_close(out.cpu().double(), fn(*[x.double() for x in args]), stax.bfloat16, atol=5e-3 * k ** 0.5)
    finally:
        stax.set_float32_matmul_precision("highest")
    gen = stax.generate(cases["row_major_b"][0], *[stax.randn(*s) for s in big], device="cuda")
    assert kinds(gen) == ["triton_tem_fused_mm"]          # IEEE float32 reads B in place


# ---- §9.8 tuning cost: Prop. 9.4, shared memory, one record per GEMM ----


def test_prop_9_4_block_counts_and_figure_9_1():
    assert tt.grouped_blocks_read(6, 6, 8, 1) == (2, 6)       # Fig. 9.1, row-major
    assert tt.grouped_blocks_read(6, 6, 8, 2) == (2, 4)       # Fig. 9.1, G = 2
    assert sum(tt.grouped_blocks_read(32, 32, 128, 1)) == 36  # the chapter's example: 4 + 32
    assert tt.grouped_blocks_read(32, 32, 128, 8) == (8, 16)  # 24, near 2·√128 ≈ 22.6
    assert tt.grouped_blocks_read(5, 7, 35, 8) == (5, 7)      # a ragged last group covers the rest


def test_configs_that_overflow_shared_memory_are_dropped():
    big = {"bnumel": 1, "mnumel": 4096, "nnumel": 4096, "knumel": 4096}
    fp32 = tt.template_configs({**big, "itemsize": 4})
    bf16 = tt.template_configs({**big, "itemsize": 2})
    assert all(tt.stage_bytes(c, 4) * c["num_stages"] <= tt.SMEM_BUDGET for c in fp32)
    assert len(bf16) > len(fp32)                 # 256×128×64 × 4 stages: 192 KiB in bf16, 384 in fp32
    assert tt.stage_bytes({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 2) == 32 * 1024   # §9.8's figure


def test_a_gemm_of_few_rows_compiles_only_candidates_that_can_win():
    """Issue 14: at M = 8 every BLOCK_M is 16 and B streams once; a shallower BLOCK_K (fewer bytes
    of B in flight) or 4 programs of BLOCK_N 256 on 132 SMs cannot win. The MLP block's GEMM
    compiled 8 candidates; now 4, the deepest pipeline first."""
    from stax import triton_heuristics as th
    mlp = {"bnumel": 1, "mnumel": 8, "nnumel": 1024, "knumel": 1024, "itemsize": 2}
    cands = th.candidates("template", mlp)
    assert len(cands) == 4 and {c["BLOCK_M"] for c in cands} == {16} and {c["BLOCK_K"] for c in cands} == {64}
    assert all(c["BLOCK_N"] <= 128 for c in cands) and th.default_config("template", mlp) is not None
    assert cands[0] == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    full = {(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"])
            for c in tt.template_configs({**mlp, "mnumel": 17})}
    assert {(c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]) for c in cands} <= full | {(64, 64, 4, 3)}
    # enough batches fill the SMs with 4 programs each: BLOCK_N 256 stays
    assert any(c["BLOCK_N"] == 256 for c in th.candidates("template", {**mlp, "bnumel": 64}))
    # one BLOCK_K and one BLOCK_N for all (64 x 7): nothing to drop; 17 rows: the whole table
    assert len(th.candidates("template", {**mlp, "nnumel": 64, "knumel": 7})) == 5
    assert len(th.candidates("template", {**mlp, "mnumel": 17})) == 8
    for m, n, k in ((1, 7, 1024), (16, 4096, 4096), (3, 1, 5)):
        shape = {**mlp, "mnumel": m, "nnumel": n, "knumel": k}
        assert all(tt.fits_shared_memory(c, 2) for c in th.candidates("template", shape))


def test_identical_gemms_share_one_tuning_key():
    x, w1, w2 = stax.randn(16, 24), stax.randn(24, 24), stax.randn(24, 24)
    _, gen = compiled(lambda x, w1, w2: stax.relu(x @ w1) @ w2 + 1, x, w1, w2)
    keys = [s.split("'tuning_key': ")[1].split("'")[1] for n, s in gen.kernels.items() if n.startswith("triton_tem")]
    assert len(keys) == 2 and keys[0] == keys[1]


# ---- §9.8 the persistent TMA template ----


@pytest.mark.parametrize("fn,shapes,dtype", [
    (lambda x, w, b: stax.relu(x @ w.t() + b), [(70, 40), (36, 40), (36,)], stax.float32),     # w.t(): a .T load
    (lambda a, b, c: (a @ b) * 2 + c, [(33, 72), (72, 24), (33, 24)], stax.bfloat16),          # K past the block
    (lambda a, b: (a @ b).sigmoid(), [(1, 16), (16, 8)], stax.float16),                         # M of 1
])
def test_persistent_tma_template_is_a_candidate_and_computes_the_same(fn, shapes, dtype, monkeypatch):
    from stax import templates, triton_heuristics
    monkeypatch.setattr(templates, "PERSISTENT_MIN_TILES", 0)     # small shapes, for the interpreter
    monkeypatch.setattr(triton_heuristics.MultiKernel, "_choose", lambda self, args: self.kernels[-1])
    args = [stax.randn(*s).to(dtype) for s in shapes]
    gen = check(fn, *args, k=shapes[0][-1])
    (tma,) = [s for n, s in gen.kernels.items() if n.startswith("triton_persistent_tma_mm_")]
    assert "tl.make_tensor_descriptor(" in tma and "tl.range(tl.program_id(0), grid_m * grid_n, NUM_SMS)" in tma
    assert "multi_kernel_0 = async_compile.multi_kernel('multi_kernel_0', [triton_tem_fused_mm_0, " \
           "triton_persistent_tma_mm_0])" in gen.module.source
    assert tma.index("acc = tl.dot(") < tma.index("xmask = ") < tma.index("tl.store(")


def test_no_tma_candidate_where_tma_cannot_read_an_operand(monkeypatch):
    from stax import templates
    monkeypatch.setattr(templates, "PERSISTENT_MIN_TILES", 0)
    gen = stax.generate(lambda a, b: a @ b, stax.randn(64, 32), stax.randn(32, 48), device="cuda")
    assert "triton_persistent_tma_mm_0" in gen.kernels
    monkeypatch.setattr(templates, "PERSISTENT_MIN_TILES", 1)     # fewer 128² tiles than SMs: not offered
    gen = stax.generate(lambda a, b: a @ b, stax.randn(64, 32), stax.randn(32, 48), device="cuda")
    assert "triton_persistent_tma_mm_0" not in gen.kernels
    # a row of 9 float32 is 36 bytes, not a multiple of 16; batches run on the grouped template only
    for fn, shapes in ((lambda a, b: a @ b, [(5, 9), (9, 6)]), (lambda a, b: a @ b, [(2, 8, 16), (2, 16, 8)])):
        gen = check(fn, *[stax.randn(*s) for s in shapes], k=16)
        assert not any(n.startswith("triton_persistent") for n in gen.kernels) and "multi_kernel" not in gen.module.source
    assert tt.template_grid({"mnumel": 4096, "nnumel": 4096, "bnumel": 1},
                            {"BLOCK_M": 128, "BLOCK_N": 128, "NUM_SMS": 132}) == (132, 1, 1)


def test_measuring_the_persistent_template_sees_its_num_sms(monkeypatch):
    """A MultiKernel hands each alternative only the launch's numels; the kernel adds its own
    decorator facts (NUM_SMS, itemsize) before Alg. 9.1 builds its candidates."""
    from stax import cuda, templates, triton_heuristics
    monkeypatch.setattr(templates, "PERSISTENT_MIN_TILES", 0)
    gen = stax.generate(lambda a, b: a @ b, stax.randn(64, 32), stax.randn(32, 48), device="cuda")
    k = triton_heuristics.kernel_from_source("triton_persistent_tma_mm_0", gen.kernels["triton_persistent_tma_mm_0"])
    monkeypatch.setattr(cuda, "interpreting", lambda: False)
    monkeypatch.setattr(k, "_autotune", lambda numels, args: triton_heuristics.candidates(k.kind, numels)[0])
    cfg = k.choose_config({"bnumel": 1, "mnumel": 64, "nnumel": 48, "knumel": 32})
    assert cfg["NUM_SMS"] == 132
    assert k.grid({"bnumel": 1, "mnumel": 64, "nnumel": 48, "knumel": 32}, cfg) == (1, 1, 1)
