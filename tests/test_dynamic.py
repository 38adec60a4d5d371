"""§10 dynamic shapes: symbolic capture, guards, one artifact for many sizes (CPU and Triton).

Example 10.4's three sequences are the acceptance checks; then compiled equals eager at sizes
2..20, primes, powers of two ± 1 and sizes past a tile or persistent-reduction bound, on the CPU
and through Triton's interpreter; then the shape environment itself (three-valued decisions,
guards, duck sizing), automatic dynamic (`dynamic=None`) and mark_dynamic / mark_static.
"""
import json

import numpy as np
import pytest

import stax
from stax import dynshape
from conftest import run_outside_interpreter

SIZES = list(range(2, 21)) + [31, 37, 63, 65, 127, 129, 255, 257, 1023, 1025, 2049]
rng = np.random.default_rng(10)


def _rand(*shape):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _close(got, want):
    got, want = np.asarray(got.cpu().numpy() if got.device != "cpu" else got.numpy()), want.numpy()
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


# ---- Example 10.4, exactly ----


def test_example_10_4_branch_on_a_size_gives_two_artifacts():
    def fn(x):
        return x + 1 if x.shape[0] > 4 else x * 2
    compiled = stax.compile(fn, dynamic=True)
    for n in (3, 7, 2, 9, 4, 11):
        x = stax.arange(n, dtype=stax.float32)
        _close(compiled(x), fn(x))
    assert compiled.stats["compiles"] == 2 and compiled.stats["eager_calls"] == 0


def test_example_10_4_sizes_0_and_1_are_specialized():
    fn = lambda x: x * 2 + 1
    compiled = stax.compile(fn, dynamic=True)
    for n in (3, 1, 0, 7, 1, 0, 11):
        x = stax.arange(n, dtype=stax.float32)
        _close(compiled(x), fn(x))
    assert compiled.stats["compiles"] == 3


def test_example_10_4_contiguous_and_transposed_alternately():
    fn = lambda x: x * 2 + 1
    compiled = stax.compile(fn, dynamic=True)
    for k in range(6):
        x = _rand(3 + k, 5 + 2 * k) if k % 2 == 0 else _rand(5 + 2 * k, 3 + k).t()
        _close(compiled(x), fn(x))
    assert compiled.stats["compiles"] == 2


# ---- compiled equals eager at every size, one artifact ----

FUNCTIONS = {
    "ex1_1": lambda x, y: (stax.relu(x + y) * 2).sum(-1),
    "softmax": lambda x, y: stax.softmax(x, -1),
    "layer_norm": lambda x, y: stax.layer_norm(x, (x.shape[-1],)),
    "mean_over_rows": lambda x, y: x.mean(0) - y.amax(0),
    "reshape_infer": lambda x, y: (x.reshape(x.size(0), -1) * 2).sum(0),
    "flatten": lambda x, y: x.reshape(-1) * 3,
    "slices": lambda x, y: x[:, 1:] - y[:, :-1],
    "transpose": lambda x, y: x.t() + y.t(),
    "broadcast_row": lambda x, y: x + y[0],
    "by_numel": lambda x, y: x.sum() / x.numel(),
    "cat": lambda x, y: stax.cat([x, y * 2], 0).sum(0),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_cpu_one_artifact_equals_eager_at_every_size(name):
    fn = FUNCTIONS[name]
    compiled = stax.compile(fn, dynamic=True)
    for n in SIZES:
        m = 3 + n % 7 if n > 100 else n + 3
        x, y = _rand(n, m), _rand(n, m)
        _close(compiled(x, y), fn(x, y))
    assert compiled.stats["compiles"] == 1, compiled.stats
    assert compiled.stats["eager_calls"] == 0


@pytest.mark.parametrize("name", ["ex1_1", "softmax", "slices", "transpose", "reshape_infer", "by_numel"])
def test_triton_one_artifact_equals_eager(name):
    # (on the GPU when there is one; conftest runs the Triton interpreter otherwise)
    fn = FUNCTIONS[name]
    compiled = stax.compile(fn, dynamic=True)
    for n in (2, 3, 5, 17, 33, 130):
        x, y = _rand(n, 2 * n + 3), _rand(n, 2 * n + 3)
        _close(compiled(x.to("cuda"), y.to("cuda")), fn(x, y))
    assert compiled.stats["compiles"] <= 2


def test_triton_kernel_takes_sizes_as_parameters_and_keeps_masks():
    compiled = stax.compile(FUNCTIONS["ex1_1"], dynamic=True)
    compiled(_rand(64, 128).to("cuda"), _rand(64, 128).to("cuda"))
    text = str(compiled.last_generated)
    assert "xnumel = " not in text.split("def call")[0]          # sizes are parameters, not constants
    assert "r0_mask = r0_index < r0_numel" in text or "r0_mask" in text
    assert "s0 = arg0_1.shape[0]" in text and "s1 = arg0_1.shape[1]" in text
    # unbounded: the looped form exists, its whole steps unmasked and the last step masked
    assert "for r0_offset in tl.range(0, r0_whole, R0_BLOCK)" in text
    assert "for r0_offset in tl.range(r0_whole, r0_numel, R0_BLOCK)" in text


# (graphs no other test compiles: an artifact cached from a run at other hints has other R0_BLOCKs)
UNBOUNDED_ROWS = {
    "sum": lambda x, y: (stax.relu(x + y) * 3).sum(-1),
    "softmax": lambda x, y: stax.softmax(x * 1.5, -1),
    "layer_norm": lambda x, y: stax.layer_norm(x + y, (x.shape[-1],)),
}


@pytest.mark.parametrize("name", sorted(UNBOUNDED_ROWS))
def test_triton_unbounded_row_runs_persistent_when_it_fits(name, monkeypatch):
    # §10.3: the row is unbounded, so the looped form must exist; the persistent one (R0_BLOCK from
    # the hint, 128 for 100) runs every row that fits it; the launch dispatches on r0_numel
    from stax import triton_heuristics
    ran = []
    real = triton_heuristics.CachingAutotuner.run

    def spy(self, *args, **kw):
        ran.append(self.name.split("_")[1])
        return real(self, *args, **kw)
    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "run", spy)
    fn = UNBOUNDED_ROWS[name]
    compiled = stax.compile(fn, dynamic=True)
    for m, form in ((100, "per"), (37, "per"), (128, "per"), (129, "red"), (1000, "red"), (65, "per")):
        ran.clear()
        x, y = _rand(5, m), _rand(5, m)
        _close(compiled(x.to("cuda"), y.to("cuda")), fn(x, y))
        assert ran == [form], (m, ran)
    assert compiled.stats["compiles"] == 1, compiled.stats
    kernels = str(compiled.last_generated)
    assert "'r0_': 128}" in kernels and "multi_kernel_0.run(" in kernels


def test_triton_indices_are_int32_under_a_guard(monkeypatch, capsys):
    # §10.3: every tensor below 2^31 elements on the hints: int32 indices, guarded; a size past it
    # fails the guard (a new artifact, int64); data-dependent sizes keep int64
    monkeypatch.setenv("STAX_LOGS", "guards")
    compiled = stax.compile(lambda x: x.sum(0) * 2, dynamic=True)
    x = _rand(100, 37)
    _close(compiled(x.to("cuda")), x.sum(0) * 2)
    text = str(compiled.last_generated)
    assert "'r0_numel': 'i32'" in text and ".to(tl.int64)" not in text
    assert "s0*s1 < 2147483648" in capsys.readouterr().err
    env = dynshape.ShapeEnv()
    s0, s1 = env.create_symbol(3, ("x", 0)), env.create_symbol(5, ("x", 1))
    assert env.index32([((s0, s1), (s1, 1), 0)]) and env.guards
    big = dynshape.ShapeEnv()
    s0, s1 = big.create_symbol(2**16, ("x", 0)), big.create_symbol(2**15, ("x", 1))
    assert not big.index32([((s0, s1), (s1, 1), 0)]) and not big.guards


# an sm_90 build script's start (run_outside_interpreter; argv[1]: the kernel's [name, source]):
# `k` the kernel, `seen` each triton.compile result
_BUILDS = (
    "import json, sys, triton\n"
    "from stax.triton_heuristics import kernel_from_source\n"
    "seen, real = [], triton.compile\n"
    "triton.compile = lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1]\n"
    "k = kernel_from_source(*json.loads(sys.argv[1]))\n")


def test_triton_size_arguments_compile_with_their_divisibility(monkeypatch):
    # a row of run-time length vectorizes as a constant one does when the kernel is compiled
    # knowing the sizes' power-of-two divisors (Triton's JIT specializes ints the same way)
    from stax import capture, triton_heuristics
    env = dynshape.ShapeEnv()
    g, _ = capture.capture(lambda x: stax.layer_norm(x, (x.shape[-1],)), [stax.randn(64, 4096)], shape_env=env)
    g.index32 = env.index32(capture.tensor_layouts(g))
    name, src = next(iter(stax._compile_graph(g, "cuda", "ln").kernels.items()))
    k = triton_heuristics.kernel_from_source(name, src)       # launchers: which build each call gets
    built = []
    monkeypatch.setattr(k, "_compile", lambda cfg, aligned, divs: built.append(divs) or object())
    cfg = {"XBLOCK": 1, "num_warps": 4, "num_stages": 1}
    s1, xnumel, r0 = k.int_index                 # (the row's stride, rows, the row's length)
    for row, d in ((4096, 16), (1000, 8), (1002, 2)):
        k._launcher(cfg, True, [None] * k.ints_from + [row, 64, row])
        assert built[-1] == ((s1, d), (xnumel, 16), (r0, d)), (row, built[-1])
    k._launcher(cfg, True, [None] * k.ints_from + [1001, 64, 1001])
    assert built[-1] == ((xnumel, 16),)
    k._launcher(cfg, True, [None] * k.ints_from + [4096, 64, 4096])
    assert len(built) == 4                       # one launcher per divisibility pattern, kept
    # the sm_90 builds (in a process of their own: this one may run Triton's interpreter)
    script = _BUILDS + (
        "for divs in ((), tuple((i, 16) for i in k.int_index)):\n"
        "    k.compile_for(90, divs=divs)\n"
        "import re\n"      # (ld.global, its cache modifiers such as L1::evict_first, .v4)
        "print(json.dumps([len(re.findall(r'ld\\.global[.:\\w]*\\.v4', c.asm['ptx'])) for c in seen]))\n")
    plain, known = run_outside_interpreter(script, json.dumps([name, src]), timeout=300)
    assert plain == 0 and known > 0, (plain, known)


def test_triton_rows_of_whole_steps_are_compiled_without_the_row_end_mask(monkeypatch):
    """§10.3: a kernel over a row of symbolic length is specialized per launch on EVEN_R0 (the
    row a positive whole number of R0_BLOCK steps): then the persistent row's mask is constant
    true and the looped row has no partial step, as in the static kernel. Every length equals
    eager, whichever specialization ran; the sm_90 build with EVEN_R0 has fewer loads."""
    from stax import triton_heuristics
    seen = []
    plain = triton_heuristics.CachingAutotuner._even_r0

    def record(self, cfg, args):
        out = plain(self, cfg, args)
        if "EVEN_R0" in out:
            seen.append((self.kind, args[list(self.signature).index("r0_numel")], out["EVEN_R0"]))
        return out
    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "_even_r0", record)
    fn = lambda x: stax.softmax(x, -1)            # noqa: E731  (hint 64: persistent up to 64, else looped)
    compiled = stax.compile(fn, dynamic=True)
    for n in (64, 37, 4096, 4100, 2):
        x = _rand(3, n)
        _close(compiled(x.to("cuda")), fn(x))
    assert compiled.stats["compiles"] == 1, compiled.stats
    per = {(n, e) for kind, n, e in seen if kind == "persistent_reduction"}
    red = {(n, e) for kind, n, e in seen if kind == "reduction"}
    assert (64, 1) in per and (37, 0) in per and (2, 0) in per, per
    assert (4096, 1) in red and (4100, 0) in red, red
    name, src = next((n, s) for n, s in compiled.last_generated.kernels.items() if "triton_red" in n)
    assert "if not EVEN_R0:" in src and "EVEN_R0 : tl.constexpr" in src
    script = _BUILDS + (
        "for e in (False, True):\n"
        "    k.compile_for(90, even_r0=e)\n"
        "print(json.dumps([c.asm['ptx'].count('ld.global') for c in seen]))\n")
    masked, whole = run_outside_interpreter(script, json.dumps([name, src]), timeout=300)
    assert 0 < whole < masked, (masked, whole)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_dynamic_artifact_is_cached_with_its_hints(device):
    """The code of a dynamic artifact depends on its hints (a persistent row's R0_BLOCK, a
    split's pieces), so the artifact cache keys them: the same graph first called at another
    size is generated again, not served the kernels chosen for the first; the same size hits."""
    def softmax(x):
        return stax.softmax(x, -1) * 3.0
    hits = []
    for n in (64, 4096, 64):
        f = stax.compile(lambda x: softmax(x), dynamic=True)      # (a new function each time)
        x = _rand(3, n)
        _close(f(x.to(device)), softmax(x))
        hits.append("from the artifact cache" in f.last_generated.schedule)
        if n == 4096 and device == "cuda":
            assert "R0_BLOCK: tl.constexpr = 4096" in str(f.last_generated)
    assert hits[1:] == [False, True], hits


@pytest.mark.parametrize("case", ["transpose_add", "permute3d"])
def test_triton_symbolic_tiles_fold_past_the_grid_limit(case, monkeypatch):
    """§9.3's y × x (and z × y × x) tiling of a transposed access is kept for symbolic sizes: the
    (z, y) blocks fold onto program_id(2) past CUDA's 65535 (`fold_y`). Here the limit is 3, so a
    few blocks already fold; every size equals eager."""
    from stax import triton_kernel
    monkeypatch.setattr(triton_kernel, "GRID_LIMIT_YZ", 3)
    if case == "transpose_add":
        fn, shapes = (lambda x, y: x.t() + y), (lambda n: [(n, 2 * n + 1), (2 * n + 1, n)])
    else:
        fn = lambda x, y, z: x + y.permute(2, 0, 1) * z.permute(1, 2, 0)     # noqa: E731
        shapes = lambda n: [(n, n + 2, n), (n + 2, n, n), (n, n, n + 2)]     # noqa: E731
    compiled = stax.compile(fn, dynamic=True)
    for n in (40, 7, 97, 2):
        args = [_rand(*s) for s in shapes(n)]
        _close(compiled(*[a.to("cuda") for a in args]), fn(*args))
    assert compiled.stats["compiles"] == 1, compiled.stats
    kernel = next(iter(compiled.last_generated.kernels.values()))
    assert "meta={'fold_y': 3}" in kernel and "tl.program_id(2) * 3" in kernel
    assert ("zoffset = (zy // y_blocks) * ZBLOCK" in kernel) == (case == "permute3d")
    assert "//" not in kernel.split("xmask = ")[1]        # no division per element: the dims are axes


def test_triton_flattened_column_sum_is_an_outer_reduction():
    """`g.reshape(-1, C).sum(0)` of a 3-d g with symbolic sizes: the flattened view's digits are
    recombined before §9.4's direction test, so it is the OUTER form (coalesced along the C
    outputs, [R0_BLOCK, XBLOCK]) split by Alg. 6.1, as for static sizes, not the row form."""
    compiled = stax.compile(lambda g: g.reshape(-1, 256).sum(0), dynamic=True)
    for shape in ((16, 64, 256), (3, 5, 256)):
        g = _rand(*shape)
        got = compiled(g.to("cuda")).cpu().numpy()
        np.testing.assert_allclose(got, np.asarray(g.numpy(), np.float64).reshape(-1, 256).sum(0), rtol=1e-4,
                                   atol=2e-4)
    kernel = next(iter(compiled.last_generated.kernels.values()))
    assert "reduction_hint=ReductionHint.OUTER" in kernel and "[R0_BLOCK, XBLOCK]" in kernel
    assert "split = tl.program_id(1)" in kernel
    assert compiled.stats["compiles"] == 1


def test_cpu_kernel_takes_sizes_as_parameters():
    compiled = stax.compile(FUNCTIONS["ex1_1"], dynamic=True)
    compiled(_rand(64, 128), _rand(64, 128))
    gen = compiled.last_generated
    kernel = next(iter(gen.kernels.values()))
    assert "int64_t s0, int64_t s1" in kernel and "x0 < s0" in kernel
    assert "s0 = arg0_1.shape[0]" in gen.wrapper and "empty((s0,), float32)" in gen.wrapper


# ---- guards ----


def test_guard_function_is_printed_and_reads_only_metadata(monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "guards")
    compiled = stax.compile(lambda x: x + 1 if x.shape[0] > 4 else x * 2, dynamic=True)
    compiled(_rand(3, 5))
    err = capsys.readouterr().err
    assert "def guard(inputs):" in err and "if s0 < 2: return False" in err
    assert "s0 <= 4" in err and "m0.stride[0] != s1" in err


def test_duck_sizing_shares_a_symbol_and_guards_the_equality():
    compiled = stax.compile(lambda x, y: x + y, dynamic=True)
    x, z = _rand(6, 6), _rand(6, 6)
    _close(compiled(x, z.t()), x + z.t())
    a, b = _rand(4, 4), _rand(4, 4)
    _close(compiled(a, b.t()), a + b.t())
    assert compiled.stats["compiles"] == 1
    c, d = _rand(5, 7), _rand(5, 7)         # a non-square input: the shared symbol's guard fails
    _close(compiled(c, d.t().contiguous().t()), c + d)
    assert compiled.stats["compiles"] == 2


def test_mismatched_sizes_still_raise_as_eager():
    compiled = stax.compile(lambda x, y: x + y, dynamic=True)
    with pytest.raises(RuntimeError, match="must match"):
        compiled(_rand(3, 4), _rand(5, 4))


def test_shape_env_three_valued_and_guards():
    env = dynshape.ShapeEnv()
    s = env.create_symbol(7, (0, 0))
    assert env.create_symbol(7, (1, 0)) is s and env.create_symbol(1, (1, 1)) == 1
    n = dynshape.SymInt(s, env)
    assert (n != 1) is True and (n >= 2) is True and (n * 128 > 0) is True and not env.guards
    assert env.evaluate(s > 4) is None and (n > 4) is True
    assert env.guards == [s > 4]
    assert (n * 128).expr == 128 * s and ((n * 6) // 3).expr == 2 * s
    assert int(n) == 7 and env.guards[-1] == dynshape.sympy.Eq(s, 7)


# ---- automatic dynamic (dynamic=None), mark_dynamic / mark_static ----


def test_automatic_dynamic_compiles_at_most_twice():
    fn = lambda x: (x * 2).sum(-1)
    compiled = stax.compile(fn, dynamic=None)
    for n in range(2, 40):
        x = _rand(n, 16)
        _close(compiled(x), fn(x))
    assert compiled.stats["compiles"] == 2
    gen = compiled.last_generated
    assert "s0 = arg0_1.shape[0]" in gen.wrapper and "16" in gen.wrapper   # only dim 0 changed


def test_mark_dynamic_and_mark_static():
    fn = lambda x: x + 1
    compiled = stax.compile(fn, dynamic=None)
    x = _rand(5, 6)
    stax.mark_dynamic(x, 0)
    _close(compiled(x), fn(x))
    assert "s0 = arg0_1.shape[0]" in compiled.last_generated.wrapper
    pinned = stax.compile(fn, dynamic=True)
    y = _rand(5, 6)
    stax.mark_static(y, 1)
    _close(pinned(y), fn(y))
    assert "(s0, 6)" in pinned.last_generated.wrapper
