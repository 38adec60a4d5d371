"""§6.5 + §10.3: var/std (and batch-norm statistics) in pieces read once under symbolic sizes.

One artifact compiled at a hint long enough to cut the deviations in pieces (lower.chunk_deviations:
the piece is chosen at the hint, the piece count is a run-time expression, the last piece ragged
and masked) must equal float64 numpy at every later size: 2..20, primes, 1000, 8193, fewer rows
than one piece, exactly one piece, one piece + 1, on the CPU and through Triton (the interpreter
when there is no GPU). Then the form itself: two kernels (the pieces, then Chan's combine), the
mask kept for the ragged piece, the CPU's row-uniform bound check tested once per block, and the
Triton kernels building for sm_90.
"""
import json

import numpy as np
import pytest

import stax
from stax import codegen_cpp, codegen_triton
from conftest import assert_close, run_outside_interpreter

CPU_PIECE = codegen_cpp.deviation_piece(37, 10 ** 6, True)        # rows per piece of a column var
GPU_PIECE = codegen_triton.deviation_piece(37, 10 ** 6, True)


def _sizes(piece):
    small = list(range(2, 21)) + [23, 31, 97, 127, 131, 257, 1000, 1009, 8193]
    return sorted(set(small + [piece - 1, piece, piece + 1, 2 * piece, 2 * piece + 1]))


def _data(rng, shape, dtype=np.float32):
    return (1e3 + 3 * rng.standard_normal(shape)).astype(dtype)


def _run(compiled, a, device):
    x = stax.tensor(a)
    out = compiled(x.to("cuda") if device == "cuda" else x)
    return [np.asarray(o.cpu() if device == "cuda" else o).astype(np.float64) for o in out]


def _texts(gen):
    return "\n".join(gen.kernels.values()), gen.wrapper


# ---- var / std over dim 0: one artifact, every size ----


@pytest.mark.filterwarnings("ignore:divide by zero", "ignore:invalid value")
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_var_std_dim0_equal_numpy_at_every_size(rng, device):
    piece = CPU_PIECE if device == "cpu" else GPU_PIECE
    fn = lambda x: (x.var(0), x.std(0), x.var(0, correction=0), x.var(0, correction=2), x.mean(0))  # noqa: E731
    compiled = stax.compile(fn, dynamic=True)
    hint = 40 * piece + 3                    # many pieces, the last one ragged
    sizes = [hint] + _sizes(piece) if device == "cpu" else \
        [hint] + list(range(2, 21)) + [23, 31, 97, piece - 1, piece, piece + 1, 2 * piece + 1, 257, 1000]
    for n in sizes:
        cols = 37 if device == "cpu" else 19
        a = _data(rng, (n, cols))
        A = a.astype(np.float64)
        got = _run(compiled, a, device)
        with np.errstate(divide="ignore", invalid="ignore"):      # n = 2, correction 2: inf as eager
            want = (A.var(0, ddof=1), A.std(0, ddof=1), A.var(0), A.var(0, ddof=2), A.mean(0))
        for g, w in zip(got, want):
            assert_close(g, w, "float32", rtol=1e-4)
    assert compiled.stats["compiles"] == 1 and compiled.stats["eager_calls"] == 0, compiled.stats
    kernels, wrapper = _texts(compiled.last_generated)
    launches = wrapper.count("kernels.cpp_fused_") if device == "cpu" else wrapper.count(".run(")
    assert launches == 2, wrapper                          # the pieces, then the combine
    assert f"(s0 // {piece})" in wrapper                     # a run-time count of whole pieces: no guard
    first, combine = list(compiled.last_generated.kernels.values())[:2]
    if device == "cpu":              # whole pieces: no bound check; the combine's tail test
        assert "if (!(" not in first and "< s0" not in first, first     # hoisted per block
        assert f"s0 - {piece - 1}*((s0) / {piece}) - 1 < (s0) / {piece}" in combine, combine
    else:
        assert "& tmp" not in first and "tl.where(tmp" not in first, first   # no row mask
        assert first.count("tl.load(in_ptr0 + (r0_") == 1, first   # each piece read once
        assert "xmask & tmp" in combine, combine            # the combine's whole pieces masked


# ---- wide columns: the pieces on the grid's y (triton_kernel.grid_y_lines) ----


def _wide_var(rng, compiled, shapes):
    for shape in shapes:
        a = _data(rng, shape)
        A = a.astype(np.float64)
        got = _run(compiled, a, "cuda")
        for g, w in zip(got, (A.var(0, ddof=1), A.std(0), A.mean(0))):
            # atol: of two rows, some of 1000 columns hold values one float32 ulp apart (6e-5 at
            # 1e3), whose std float32 eager rounds as much (its mean is rounded to that ulp)
            assert_close(g, w, "float32", rtol=1e-4, atol=1e-4)
    assert compiled.stats["compiles"] == 1 and compiled.stats["eager_calls"] == 0, compiled.stats


WIDE = lambda x: (x.var(0), x.std(0, correction=0), x.mean(0))  # noqa: E731


def test_var_wide_columns_pieces_on_grid_y(rng, monkeypatch, tmp_path):
    """Columns at the hint >= MAX_OUTER_BLOCK: the pieces kernel takes its piece from
    program_id(1) and its columns from program_id(0) (no run-time `// s1`, `% s1` per element);
    every later size (narrow, ragged, one piece, primes) equals float64 numpy. (A cache of its
    own: a dynamic artifact on disk serves every hint of its ranks, the first one's form.)"""
    monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path))
    compiled = stax.compile(WIDE, dynamic=True)
    piece = GPU_PIECE
    _wide_var(rng, compiled, [(3 * piece + 7, 1024), (2, 1024), (piece - 1, 1031), (piece, 1000),
                              (piece + 1, 17), (2 * piece + 1, 3), (97, 2), (1000, 13), (131, 1029)])
    pieces = next(iter(compiled.last_generated.kernels.values()))
    assert "tl.program_id(1)" in pieces and "ymask = yindex < ynumel" in pieces, pieces
    assert "% s1" not in pieces and "// s1" not in pieces, pieces
    assert "meta={'grid_y': 65535}" in pieces, pieces
    assert pieces.count("tl.load(in_ptr0 + (r0_") == 1, pieces       # each piece read once
    assert pieces.count(" / ") == 1, pieces     # 1 / the ragged piece's length: no division per element


def test_var_wide_columns_pieces_fold_onto_z(rng, monkeypatch, tmp_path):
    """More pieces than the grid's y extent: the rest fold onto z, the programs past the last
    piece masked (the fold made 3 here, so a few hundred rows exercise it)."""
    from stax import triton_kernel
    monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton_kernel, "GRID_LIMIT_YZ", 3)
    compiled = stax.compile(WIDE, dynamic=True)
    piece = GPU_PIECE
    _wide_var(rng, compiled, [(3 * piece + 7, 1024), (7 * piece + 3, 5), (2, 1030), (3 * piece, 9),
                              (10 * piece - 1, 2)])
    pieces = next(iter(compiled.last_generated.kernels.values()))
    assert "tl.program_id(2) * 3 + tl.program_id(1)" in pieces and "'grid_y': 3" in pieces, pieces


# ---- batch-norm statistics over (0, 2, 3) of NCHW ----


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_batch_norm_statistics_equal_numpy_at_every_size(rng, device):
    fn = lambda x: (x.mean((0, 2, 3)), x.var((0, 2, 3)), x.std((0, 2, 3), correction=0))  # noqa: E731
    compiled = stax.compile(fn, dynamic=True)
    if device == "cpu":       # pieces of 45 images of 9 x 10 (4096 // 90); the hint ragged
        shapes = [(1000, 3, 9, 10), (2, 3, 9, 10), (44, 3, 9, 10), (45, 3, 9, 10), (46, 3, 9, 10),
                  (91, 3, 9, 10), (13, 5, 4, 6), (1009, 2, 7, 11), (8193, 2, 3, 5)]
    else:                     # pieces of 11 images (1024 // 90)
        shapes = [(400, 3, 9, 10), (2, 3, 9, 10), (10, 3, 9, 10), (11, 3, 9, 10), (12, 3, 9, 10),
                  (37, 2, 7, 11), (13, 5, 4, 6)]
    for shape in shapes:
        a = _data(rng, shape)
        A = a.astype(np.float64)
        got = _run(compiled, a, device)
        want = (A.mean((0, 2, 3)), A.var((0, 2, 3), ddof=1), A.std((0, 2, 3)))
        for g, w in zip(got, want):
            assert_close(g, w, "float32", rtol=1e-4)
    assert compiled.stats["compiles"] == 1 and compiled.stats["eager_calls"] == 0, compiled.stats
    _, wrapper = _texts(compiled.last_generated)
    launches = wrapper.count("kernels.cpp_fused_") if device == "cpu" else wrapper.count(".run(")
    assert launches == 2, wrapper


def test_var_non_contiguous_half_and_long_rows(rng):
    """A transposed input (the pieces read strided), float16 (computed in float32) and layer_norm
    over rows longer than the CPU's one-read bound (pieces along the row itself)."""
    compiled = stax.compile(lambda x: (x.t().var(1), x.t().std(1, correction=0)), dynamic=True)
    for n in (1000, 7, 128, 129, 1001):
        a = _data(rng, (n, 21))
        A = a.astype(np.float64)
        v, s = _run(compiled, a, "cpu")
        assert_close(v, A.var(0, ddof=1), "float32", rtol=1e-4)
        assert_close(s, A.std(0), "float32", rtol=1e-4)
    assert compiled.stats["compiles"] == 1
    half = stax.compile(lambda x: x.var(0), dynamic=True)
    for n in (1000, 5, 129):
        a = _data(rng, (n, 9), np.float16)
        got = np.asarray(half(stax.tensor(a)).float())
        assert_close(got, a.astype(np.float64).var(0, ddof=1), "float16")
    ln = stax.compile(lambda x: stax.layer_norm(x, (x.shape[-1],)), dynamic=True)
    for m in (70001, 4095, 4097, 9000):
        a = _data(rng, (3, m))
        A = a.astype(np.float64)
        want = (A - A.mean(1, keepdims=True)) / np.sqrt(A.var(1, keepdims=True) + 1e-5)
        assert_close(np.asarray(ln(stax.tensor(a))), want, "float32", rtol=1e-3, atol=1e-3)
    assert ln.stats["compiles"] == 1


def test_triton_var_pieces_build_for_sm90(monkeypatch, tmp_path):
    """The dynamic pieces' kernels (masked, sizes as parameters) build for sm_90, in a process
    of its own (this one may run Triton's interpreter)."""
    kernels = []
    for shape in ((2000, 33), (300, 1024)):         # a flat x index; the pieces on the grid's y
        monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path / str(shape[1])))   # (one form per hint)
        compiled = stax.compile(lambda x: (x.var(0), x.mean(0)), dynamic=True)
        compiled(stax.randn(*shape).to("cuda"))
        gen = compiled.last_generated
        assert len(gen.kernels) == 2
        kernels += list(gen.kernels.items())
    assert sum("'grid_y'" in src for _, src in kernels) == 1
    script = (
        "import json, sys\n"
        "from stax.triton_heuristics import kernel_from_source\n"
        "for name, src in json.loads(sys.argv[1]):\n"
        "    cubin, info, _ = kernel_from_source(name, src).compile_for(90)\n"
        "    assert cubin[:4] == b'\\x7fELF', name\n"
        "print(json.dumps('built'))\n")
    assert run_outside_interpreter(script, json.dumps(kernels), timeout=300) == "built"


def test_var_dynamic_launches_as_static_at_the_hint(rng, monkeypatch, tmp_path):
    """At its hint the dynamic artifact launches what the static one does: per kernel the same
    heuristic configuration, the same candidates and the same number of programs (the pieces on
    the grid's y count as the static kernel's flat x: triton_heuristics._as_flat)."""
    from stax import triton_heuristics as th
    monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path))
    seen = []
    plain = th.CachingAutotuner.choose_config

    def record(self, numels, args=()):
        cfg = plain(self, numels, args)
        full = {**numels, **self.meta}
        cands = th.candidates(self.kind, full, self.reduction_hint, self.r0_block)
        grid = th.grid_for(self.kind, full, cfg)
        seen.append((cfg, cands, grid[0] * grid[1] * grid[2]))
        return cfg
    monkeypatch.setattr(th.CachingAutotuner, "choose_config", record)
    a = _data(rng, (66 * GPU_PIECE, 1024))      # more pieces than a combine holds in registers:
    # two kernels static too (fewer: the static combine is one kernel with its pieces, §6.5)
    for kw in ({}, {"dynamic": True}):
        got, = _run(stax.compile(lambda x: (x.var(0),), **kw), a, "cuda")
        assert_close(got, a.astype(np.float64).var(0, ddof=1), "float32", rtol=1e-4)
    assert len(seen) == 4, seen
    assert seen[:2] == seen[2:], seen
