"""§9.8 cuBLASLt as an extern candidate (stax/cublas.py): loader, plan, descriptors, epilogue
choice, Alg. 9.1's choice, and the wrapper's extern branch.

Without a GPU these run against a FAKE cuBLASLt (`FakeLt`, the binding's methods): it records the
descriptors it is asked for and, on `matmul`, computes what cuBLASLt would -- column-major
D = epilogue(op(A) · op(B) + bias) read from raw memory through the recorded ops, leading dims
and batch strides -- so, under Triton's interpreter (host memory), the wrapper's extern branch
runs end to end and is checked against float64 numpy. Tests marked `gpu` use the real library
(`pip install stax[cublas]`, or $STAX_CUBLASLT) and skip without a GPU or without it.
"""
from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace

import numpy as np
import pytest

import stax
from conftest import assert_close
from stax import cublas, cuda

HAVE_GPU = cuda.is_available() and not cuda.interpreting()
NP = {0: np.float32, 2: np.float16, 14: np.uint16}


# ---- the fake cuBLASLt ----


def _read(ptr: int, dtype: int, count: int) -> np.ndarray:
    nbytes = count * np.dtype(NP[dtype]).itemsize
    a = np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), NP[dtype]).copy()
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dtype == 14 else a.astype(np.float64)


def _write(ptr: int, dtype: int, index: np.ndarray, values: np.ndarray) -> None:
    count = int(index.max()) + 1
    nbytes = count * np.dtype(NP[dtype]).itemsize
    mem = np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), NP[dtype])
    if dtype == 14:       # bfloat16, round to nearest even
        bits = values.astype(np.float32).view(np.uint32)
        values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    mem[index] = values.astype(NP[dtype])


class FakeLt:
    """The binding's methods; descriptors are dicts, and every call is recorded."""
    version = 120000
    path = "/fake/libcublasLt.so.12"

    def __init__(self):
        self.calls = []

    def matmul_desc(self, compute, scale):
        self.calls.append(("desc", compute, scale))
        return {"compute": compute, "trans_a": 0, "trans_b": 0, "epilogue": 1, "bias": 0}

    def set_desc(self, desc, attr, ctype, value):
        self.calls.append(("set_desc", attr, value))
        desc[{3: "trans_a", 4: "trans_b", 7: "epilogue", 8: "bias", 10: "bias_stride"}[attr]] = value

    def layout(self, dtype, rows, cols, ld):
        self.calls.append(("layout", dtype, rows, cols, ld))
        return {"type": dtype, "rows": rows, "cols": cols, "ld": ld, "batch": 1, "stride": 0}

    def set_layout(self, layout, attr, ctype, value):
        self.calls.append(("set_layout", attr, value))
        layout[{5: "batch", 6: "stride"}[attr]] = value

    def heuristic(self, desc, a, b, d, prefs, requested=1):
        self.calls.append(("heuristic", dict(prefs)))
        return ["algo"]

    def stream(self):
        return 0

    def matmul(self, desc, a_ptr, a, b_ptr, b, d_ptr, d, algo, stream):
        """What cuBLASLt computes, column-major, on host memory (the interpreter's "cuda" tensors)."""
        self.calls.append(("matmul",))
        for i in range(d["batch"]):
            x = self._matrix(a_ptr, a, i, desc["trans_a"])
            y = self._matrix(b_ptr, b, i, desc["trans_b"])
            acc = x @ y
            if desc["epilogue"] & 4:
                acc = acc + _read(desc["bias"], d["type"], d["rows"])[:, None]
            if desc["epilogue"] & 2:
                acc = np.maximum(acc, 0)
            if desc["epilogue"] & 32:
                acc = 0.5 * acc * (1 + np.tanh(math.sqrt(2 / math.pi) * (acc + 0.044715 * acc ** 3)))
            r, c = np.meshgrid(np.arange(d["rows"]), np.arange(d["cols"]), indexing="ij")
            _write(d_ptr, d["type"], (i * d["stride"] + r + c * d["ld"]).ravel(), acc.ravel())

    @staticmethod
    def _matrix(ptr, lay, i, op):
        r, c = np.meshgrid(np.arange(lay["rows"]), np.arange(lay["cols"]), indexing="ij")
        idx = i * lay["stride"] + r + c * lay["ld"]
        mem = _read(ptr, lay["type"], int(idx.max()) + 1)
        return mem[idx].T if op == 1 else mem[idx]


@pytest.fixture
def fake(monkeypatch):
    """cuBLASLt 'installed' (a file), bound to FakeLt; the choice always takes the extern branch."""
    lt = FakeLt()
    monkeypatch.setattr(cublas, "library_path", lambda: lt.path)
    old = cublas.set_binding(lt)
    monkeypatch.setattr(cublas.MatmulChoice, "_choose", lambda self, t, e: (e(), "extern")[1])
    yield lt
    cublas.set_binding(old)


# ---- finding the library ----


def test_loader_searches_the_package_then_the_env_var(tmp_path, monkeypatch):
    pkg, other = tmp_path / "nvidia" / "cublas" / "lib", tmp_path / "libcublasLt.so.13"
    pkg.mkdir(parents=True)
    other.write_bytes(b"")
    monkeypatch.setattr(cublas, "_package_dirs", lambda: [str(pkg)])
    monkeypatch.setenv("STAX_CUBLASLT", str(other))
    assert cublas.library_path() == str(other)                # the package dir holds no library
    (pkg / "libcublasLt.so.12").write_bytes(b"")
    assert cublas.library_path() == str(pkg / "libcublasLt.so.12")    # the package comes first
    monkeypatch.setattr(cublas, "_package_dirs", lambda: [])
    monkeypatch.setenv("STAX_CUBLASLT", str(tmp_path / "missing.so"))
    assert cublas.library_path() is None and not cublas.available()


def test_missing_package_is_not_a_candidate(monkeypatch):
    monkeypatch.setattr(cublas, "library_path", lambda: None)
    monkeypatch.setattr(cublas, "_LT", [None])
    gen = stax.generate(lambda a, b: stax.relu(a @ b), stax.zeros(33, 17), stax.zeros(17, 9), device="cuda")
    assert "extern_kernels" not in gen.wrapper and "mm_choice" not in str(gen)
    with pytest.raises(cublas.CublasError, match="pip install stax\\[cublas\\]"):
        cublas.load()


# ---- the plan: layouts, leading dims, batch ----


def _op(shape, stride, dtype="float32"):
    return cublas.MatrixLayout(tuple(shape), tuple(stride), dtype)


def _contig(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


@pytest.mark.parametrize("a_shape,a_stride,b_shape,b_stride", [
    ((7, 5), (5, 1), (5, 3), (3, 1)),            # row-major both
    ((7, 5), (1, 7), (5, 3), (3, 1)),            # a = x.t()
    ((7, 5), (5, 1), (5, 3), (1, 5)),            # b = w.t() (linear)
    ((7, 5), (9, 1), (5, 3), (1, 11)),           # slices: leading dims past the sizes
    ((1, 5), (5, 1), (5, 1), (1, 1)),            # m = n = 1
    ((4, 7, 5), (35, 5, 1), (4, 5, 3), (15, 1, 5)),    # batched
    ((4, 7, 5), (35, 5, 1), (4, 5, 3), (0, 3, 1)),     # b broadcast along the batch
    ((2, 2, 7, 5), (70, 35, 5, 1), (2, 2, 5, 3), (30, 15, 3, 1)),   # two batch dims, one strided batch
])
def test_plan_reads_each_layout_as_cublas_does(a_shape, a_stride, b_shape, b_stride, rng):
    """The plan, run by the fake's column-major emulation on memory laid out as given, is a @ b."""
    out_shape = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2])) + (a_shape[-2], b_shape[-1])
    plan = cublas.plan_matmul(_op(a_shape, a_stride), _op(b_shape, b_stride), _op(out_shape, _contig(out_shape)))
    mems = []
    for shape, stride in ((a_shape, a_stride), (b_shape, b_stride)):
        size = 1 + sum((d - 1) * s for d, s in zip(shape, stride))
        mems.append(rng.standard_normal(size).astype(np.float32))
    views = [np.lib.stride_tricks.as_strided(m, shape, [4 * s for s in st])
             for m, shape, st in zip(mems, (a_shape, b_shape), (a_stride, b_stride))]
    out = np.zeros(math.prod(out_shape), np.float32)
    lt = FakeLt()
    desc, la, lb, ld, (algo,) = cublas.build(lt, plan, (256, 256, 256, 256))
    first, second = (mems[1], mems[0]) if plan.swap else (mems[0], mems[1])
    lt.matmul(desc, first.ctypes.data, la, second.ctypes.data, lb, out.ctypes.data, ld, algo, 0)
    ref = np.matmul(views[0].astype(np.float64), views[1].astype(np.float64))
    np.testing.assert_allclose(out.reshape(out_shape), ref, rtol=1e-5, atol=1e-5)


def test_plan_is_the_transposition_trick_with_its_descriptors():
    plan = cublas.plan_matmul(_op((7, 5), (5, 1)), _op((5, 3), (1, 5)), _op((7, 3), (3, 1)),
                              compute="tf32", epilogue="relu_bias", bias="float32")
    # out^T[3, 7] = b^T[3, 5] · a^T[5, 7]: b^T is column-major [5, 3] transposed (ld 5), a^T is a
    # column-major [5, 7] (ld 5) as it is; D column-major [3, 7], ld 3
    assert (plan.m, plan.n, plan.k, plan.swap) == (3, 7, 5, True)
    assert (plan.trans_a, plan.lda, plan.trans_b, plan.ldb, plan.ldd) == (cublas.OP_T, 5, cublas.OP_N, 5, 3)
    lt = FakeLt()
    cublas.build(lt, plan, (16, 256, 8, 4), bias_ptr=0x1004)
    # the heuristic reads the bias pointer's alignment: it is set before the heuristic is asked
    assert lt.calls.index(("set_desc", cublas.DESC_BIAS_POINTER, 0x1004)) < \
        next(i for i, c in enumerate(lt.calls) if c[0] == "heuristic")
    assert ("desc", 77, 0) in lt.calls                       # CUBLAS_COMPUTE_32F_FAST_TF32
    assert ("set_desc", cublas.DESC_EPILOGUE, 6) in lt.calls  # CUBLASLT_EPILOGUE_RELU_BIAS
    assert ("layout", 0, 5, 3, 5) in lt.calls and ("layout", 0, 5, 7, 5) in lt.calls
    assert ("layout", 0, 3, 7, 3) in lt.calls
    prefs = next(c[1] for c in lt.calls if c[0] == "heuristic")
    assert prefs[cublas.PREF_MAX_WORKSPACE] == cublas.WORKSPACE_BYTES
    assert [prefs[cublas.PREF_ALIGN[x]] for x in "abd"] == [16, 256, 8]
    ieee = cublas.plan_matmul(_op((7, 5), (5, 1)), _op((5, 3), (3, 1)), _op((7, 3), (3, 1)))
    assert ieee.compute == 68                                 # "highest": IEEE float32
    half = cublas.plan_matmul(_op((7, 5), (5, 1), "bfloat16"), _op((5, 3), (3, 1), "bfloat16"),
                              _op((7, 3), (3, 1), "float32"), compute="tf32")
    assert (half.a_type, half.d_type, half.compute) == (14, 0, 68)   # TF32 is for float32 only


@pytest.mark.parametrize("a,b,out,kw,why", [
    (((7, 5), (10, 2)), ((5, 3), (3, 1)), ((7, 3), (3, 1)), {}, "no unit stride"),
    (((7, 5), (5, 1)), ((5, 3), (3, 1)), ((7, 3), (3, 1)), {"epilogue": "bias"}, "bias"),
    (((7, 5), (5, 1)), ((5, 3), (3, 1)), ((7, 3), (3, 1)), {"epilogue": "bias", "bias": "float16"}, "dtype"),
    (((2, 3, 7, 5), (105, 35, 5, 1)), ((5, 3), (3, 1)), ((2, 3, 7, 3), (3, 6, 3, 1)), {}, "one strided batch"),
])
def test_plan_refuses_what_cublas_cannot_read(a, b, out, kw, why):
    with pytest.raises(cublas.CublasError, match=why):
        cublas.plan_matmul(_op(*a), _op(*b), _op(*out), **kw)


# ---- the cffi binding itself, over a fake C library ----


class FakeCLib:
    """libcublasLt's C functions as cffi hands them their arguments: out-parameters filled,
    attribute buffers read back as the bytes the binding wrote."""

    def __init__(self, ffi, fail=None):
        self.ffi, self.fail, self.calls, self.n = ffi, fail, [], 0x1000

    def _handle(self, out, ctype):
        self.n += 0x10
        out[0] = self.ffi.cast(ctype, self.n)
        return 0

    def cublasLtMatmulDescCreate(self, out, compute, scale):
        self.calls.append(("desc", compute, scale))
        return self._handle(out, "cublasLtMatmulDesc_t")

    def cublasLtMatrixLayoutCreate(self, out, dtype, rows, cols, ld):
        self.calls.append(("layout", dtype, rows, cols, ld))
        return self._handle(out, "cublasLtMatrixLayout_t")

    def cublasLtMatmulPreferenceCreate(self, out):
        return self._handle(out, "cublasLtMatmulPreference_t")

    def _attr(self, kind, obj, attr, buf, size):
        raw = self.ffi.buffer(self.ffi.cast("char *", buf), size)[:]
        self.calls.append((kind, attr, int.from_bytes(raw, "little", signed=True)))
        return 0

    def cublasLtMatmulDescSetAttribute(self, *a):
        return self._attr("set_desc", *a)

    def cublasLtMatrixLayoutSetAttribute(self, *a):
        return self._attr("set_layout", *a)

    def cublasLtMatmulPreferenceSetAttribute(self, *a):
        return self._attr("pref", *a)

    def cublasLtMatmulAlgoGetHeuristic(self, handle, desc, a, b, c, d, pref, requested, results, count):
        count[0] = min(requested, 3)
        for i in range(count[0]):         # the second proposal is one the product cannot run
            results[i].algo.data[0] = 42 + i
            results[i].workspaceSize = 1024
            results[i].state = 15 if i == 1 else 0
        return 0

    def cublasLtMatmul(self, handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, ws, size, stream):
        f = self.ffi
        self.calls.append(("matmul", f.cast("float *", alpha)[0], int(f.cast("uintptr_t", A)), int(f.cast("uintptr_t", B)),
                           f.cast("float *", beta)[0], int(f.cast("uintptr_t", D)), algo.data[0], size,
                           int(f.cast("uintptr_t", stream))))
        return self.fail or 0

    def cublasLtGetStatusName(self, rc):
        return self.ffi.new("char[]", b"CUBLAS_STATUS_NOT_SUPPORTED")


def _binding(fail=None):
    import cffi
    lt = object.__new__(cublas.LtBinding)      # everything but dlopen and the driver
    lt.ffi = cffi.FFI()
    lt.ffi.cdef(cublas.CDEF)
    lt.lib, lt.handle, lt._keep = FakeCLib(lt.ffi, fail), lt.ffi.NULL, []
    lt.workspace = SimpleNamespace(data_ptr=lambda: 0xABC00)
    return lt


def test_the_cffi_binding_writes_what_cublaslt_reads():
    lt = _binding()
    assert lt.ffi.sizeof("cublasLtMatmulHeuristicResult_t") == 96     # cublasLt.h's struct
    plan = cublas.plan_matmul(_op((4, 7, 5), (35, 5, 1)), _op((4, 5, 3), (15, 1, 5)), _op((4, 7, 3), _contig((4, 7, 3))),
                              compute="tf32", epilogue="gelu_bias", bias="float32")
    desc, la, lb, ld, algos = cublas.build(lt, plan, (256, 16, 8, 4), bias_ptr=0x5004, requested=3)
    assert len(algos) == 2                    # the proposals the heuristic returned with state 0
    algo = algos[0]
    calls = lt.lib.calls
    assert ("set_desc", cublas.DESC_EPILOGUE, 36) in calls and ("set_desc", cublas.DESC_BIAS_POINTER, 0x5004) in calls
    assert ("set_desc", cublas.DESC_TRANSA, plan.trans_a) in calls and ("set_desc", cublas.DESC_BIAS_BATCH_STRIDE, 0) in calls
    assert [c for c in calls if c[0] == "set_layout"][:2] == [("set_layout", cublas.LAYOUT_BATCH_COUNT, 4),
                                                          ("set_layout", cublas.LAYOUT_BATCH_STRIDE, 15)]
    assert ("pref", cublas.PREF_MAX_WORKSPACE, cublas.WORKSPACE_BYTES) in calls
    assert ("pref", cublas.PREF_ALIGN["b"], 16) in calls
    lt.matmul(desc, 0x100, la, 0x200, lb, 0x300, ld, algo, 0x77)
    assert calls[-1] == ("matmul", 1.0, 0x100, 0x200, 0.0, 0x300, 42, cublas.WORKSPACE_BYTES, 0x77)
    bad = _binding(fail=15)
    with pytest.raises(cublas.CublasError, match="CUBLAS_STATUS_NOT_SUPPORTED .15. in cublasLtMatmul"):
        bad.matmul(*cublas.build(bad, plan, (256,) * 4)[:1], 0, la, 0, lb, 0, ld, algo, 0)


# ---- which epilogue cuBLASLt fuses ----


def _gen(fn, *shapes, dtype=stax.float32):
    """The generated code (zeros: only shapes matter, and stax's global RNG stays untouched)."""
    return stax.generate(fn, *[stax.zeros(*s, dtype=dtype) for s in shapes], device="cuda")


@pytest.mark.parametrize("fn,shapes,line", [
    (lambda a, b: a @ b, [(33, 17), (17, 9)], "extern_kernels.mm(arg0_1, arg1_1, out=buf0, compute='ieee')"),
    (lambda a, b, c: a @ b + c, [(33, 17), (17, 9), (9,)], "bias=arg2_1, epilogue='bias'"),
    (lambda a, b, c: stax.relu(a @ b + c), [(33, 17), (17, 9), (9,)], "epilogue='relu_bias'"),
    (lambda a, b: stax.relu(a @ b), [(33, 17), (17, 9)], "epilogue='relu'"),
    (lambda a, b, c: stax.nn.functional.gelu(c + a @ b, approximate="tanh"), [(33, 17), (17, 9), (9,)],
     "epilogue='gelu_bias'"),
    (lambda x, w, b: stax.relu(x @ w.t() + b), [(33, 17), (9, 17), (9,)],
     "reinterpret_tensor(arg1_1, (17, 9), (1, 17), 0), out=buf1, bias=arg2_1, epilogue='relu_bias'"),
])
def test_fused_epilogues_are_cublas_epilogues(fake, fn, shapes, line):
    gen = _gen(fn, *shapes)
    assert line in gen.wrapper, gen.wrapper
    assert "mm_choice_0.run(template_0, extern_0)" in gen.wrapper
    assert "mm_choice_0 = async_compile.mm_choice('mm_choice_0'" in str(gen)


@pytest.mark.parametrize("fn,shapes", [
    (lambda a, b: stax.nn.functional.gelu(a @ b), [(33, 17), (17, 9)]),            # exact gelu: erf
    (lambda a, b, c: stax.relu(a @ b + c), [(33, 17), (17, 9), (33, 1)]),          # bias along M
    (lambda a, b, c: (a @ b).sigmoid() * c, [(33, 17), (17, 9), (9,)]),
    (lambda a, b, c: a @ b + c, [(33, 17), (17, 9), (33, 9)]),                    # a residual, not a bias
])
def test_other_epilogues_run_as_a_stax_kernel_after_cublas(fake, fn, shapes):
    gen = _gen(fn, *shapes)
    extern = gen.wrapper.split("def extern_0():")[1].split("mm_choice_0.run")[0]
    assert "out=buf0_acc" in extern and "triton_poi_fused_1.run(buf0_acc" in extern, gen.wrapper
    assert "epilogue=" not in extern


# ---- the extern branch runs (interpreter + fake) and equals float64 numpy ----


@pytest.mark.parametrize("fn,shapes,dtype", [
    (lambda a, b: a @ b, [(33, 17), (17, 9)], stax.float32),
    (lambda a, b, c: stax.relu(a @ b + c), [(33, 17), (17, 9), (9,)], stax.float32),
    (lambda x, w, b: stax.relu(x @ w.t() + b), [(1, 40), (45, 40), (45,)], stax.bfloat16),
    (lambda a, b, c: stax.nn.functional.gelu(a @ b + c, approximate="tanh"), [(7, 70), (70, 13), (13,)],
     stax.float16),
    (lambda a, b, c: (a @ b).sigmoid() * c, [(33, 17), (17, 9), (9,)], stax.float32),
    (lambda a, b: a.transpose(-1, -2) @ b, [(3, 17, 7), (3, 17, 9)], stax.float32),
    (lambda a, b, c: (a @ b, stax.relu(a @ b + c)), [(9, 20), (20, 13), (13,)], stax.bfloat16),
])
@pytest.mark.skipif(not cuda.interpreting(), reason="the fake reads host memory: Triton's interpreter's tensors")
def test_extern_branch_computes_the_product(fake, fn, shapes, dtype, rng):
    args = [stax.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dtype) for s in shapes]
    cf = stax.compile(fn)
    outs = cf(*[a.to("cuda") for a in args])
    assert "extern_kernels.mm(" in cf.last_generated.wrapper
    assert any(c[0] == "matmul" for c in fake.calls)
    refs = fn(*[a.double() for a in args])
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    for o, r in zip(outs, refs):
        assert_close(o.cpu().double(), r, dtype, atol={stax.float32: 1e-4}.get(dtype, 2e-2))


# ---- Alg. 9.1: the choice, measured once and recorded ----


def test_choice_measures_both_and_records_the_winner(monkeypatch):
    lt = FakeLt()
    monkeypatch.setattr(cuda, "interpreting", lambda: False)
    monkeypatch.setattr(cublas, "load", lambda: lt)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "get_device_properties", lambda: cuda.H200_PROPERTIES)
    ran = []
    times = {"template": 2.0, "extern": 1.0}
    monkeypatch.setattr(cublas.cuda, "median_ms", lambda run: (run(), times[run.__name__])[1])

    def template():
        ran.append("template")

    def extern():
        ran.append("extern")
    key = f"mm float32 test {np.random.default_rng().integers(1 << 60)}"
    c = cublas.MatmulChoice("mm_choice_0", key)
    c.run(template, extern)
    assert c.chosen == "extern" and c.times == (2.0, 1.0) and ran[-1] == "extern"
    ran.clear()
    c.run(template, extern)
    assert ran == ["extern"]
    times.update(template=0.5)          # a later process reads the record: it measures nothing
    monkeypatch.setattr(cublas.cuda, "median_ms", lambda run: pytest.fail("measured again"))
    c2 = cublas.MatmulChoice("mm_choice_0", key)
    c2.run(template, extern)
    assert c2.chosen == "extern"
    off = cublas.MatmulChoice("mm_choice_0", key + " off", {"autotune": False})
    off.run(template, extern)
    assert off.chosen == "template"


def test_the_fastest_of_the_heuristics_proposals_runs_and_is_recorded(monkeypatch):
    class Proposals(FakeLt):            # four proposals; the third is the fastest
        def heuristic(self, desc, a, b, d, prefs, requested=1):
            self.calls.append(("heuristic", dict(prefs), requested))
            return ["algo0", "algo1", "algo2", "algo3"][:requested]

        def matmul(self, desc, a_ptr, a, b_ptr, b, d_ptr, d, algo, stream):
            self.calls.append(("matmul", algo))
    lt = Proposals()
    monkeypatch.setattr(cuda, "interpreting", lambda: False)
    monkeypatch.setattr(cuda, "get_device_properties", lambda: cuda.H200_PROPERTIES)
    speed = {"algo0": 3.0, "algo1": 2.0, "algo2": 1.0, "algo3": 4.0}
    monkeypatch.setattr(cublas.cuda, "median_ms", lambda run: (run(), speed[lt.calls[-1][1]])[1])
    plan = cublas.plan_matmul(_op((7, 5), (5, 1)), _op((5, 3), (3, 1)), _op((7, 3), (3, 1)))
    key = (plan, (256, 256, 256, np.random.default_rng().integers(1 << 30)))   # a fresh record
    desc, la, lb, ld, algos = cublas.build(lt, plan, key[1], requested=cublas.ALGO_CANDIDATES)
    assert cublas._pick_algorithm(lt, key, desc, (la, lb, ld), algos, (1, 2, 3, 0)) == "algo0"  # not measuring
    monkeypatch.setattr(cublas, "_MEASURING", ["mm_choice_0"])
    assert cublas._pick_algorithm(lt, key, desc, (la, lb, ld), algos, (1, 2, 3, 0)) == "algo2"
    assert [c[1] for c in lt.calls if c[0] == "matmul"] == algos          # each timed once
    monkeypatch.setattr(cublas.cuda, "median_ms", lambda run: pytest.fail("measured again"))
    monkeypatch.setattr(cublas, "_MEASURING", [])
    assert cublas._pick_algorithm(lt, key, desc, (la, lb, ld), algos, (1, 2, 3, 0)) == "algo2"  # the record


# ---- on the GPU, with the real library ----

needs_cublas = pytest.mark.skipif(not (HAVE_GPU and cublas.available()),
                                  reason="needs a GPU and cuBLASLt (pip install stax[cublas] or $STAX_CUBLASLT)")


@pytest.fixture
def always_extern(monkeypatch):
    monkeypatch.setattr(cublas.MatmulChoice, "_choose", lambda self, t, e: (e(), "extern")[1])


@pytest.mark.gpu
@needs_cublas
@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("fn,shapes,dtype", [
    (lambda a, b: a @ b, [(33, 17), (17, 9)], stax.float32),
    (lambda a, b, c: stax.relu(a @ b + c), [(127, 65), (65, 31), (31,)], stax.float32),
    (lambda a, b, c: a @ b + c, [(1, 257), (257, 7), (7,)], stax.bfloat16),
    (lambda x, w, b: stax.relu(x @ w.t() + b), [(45, 96), (77, 96), (77,)], stax.float16),
    (lambda a, b, c: stax.nn.functional.gelu(a @ b + c, approximate="tanh"), [(64, 64), (64, 72), (72,)],
     stax.bfloat16),
    (lambda a, b, c: (a @ b).sigmoid() * c, [(33, 17), (17, 9), (9,)], stax.float32),
    (lambda a, b: a @ b, [(5, 33, 17), (5, 17, 9)], stax.float32),
    (lambda a, b: a[:, 1:18] @ b, [(33, 20), (17, 9)], stax.float32),        # offset, ld 20
])
def test_cublas_matches_float64(always_extern, fn, shapes, dtype, precision, rng):
    stax.set_float32_matmul_precision(precision)
    try:
        args = [stax.from_numpy(rng.standard_normal(s).astype(np.float32)).to(dtype) for s in shapes]
        cf = stax.compile(fn)
        out = cf(*[a.to("cuda") for a in args])
        assert "extern_kernels.mm(" in cf.last_generated.wrapper
        ref = fn(*[a.double() for a in args])
        k = shapes[0][-1]
        tol = {stax.float32: 1e-5 if precision == "highest" else 2e-3}.get(dtype, 2e-2) * max(1.0, k ** 0.5)
        assert_close(out.cpu().double(), ref, dtype, atol=tol)
    finally:
        stax.set_float32_matmul_precision("highest")


@pytest.mark.gpu
@needs_cublas
def test_the_first_call_measures_both_and_says_which_won(monkeypatch, capsys, rng):
    monkeypatch.setenv("STAX_LOGS", "autotune")
    a, b = (stax.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda") for s in ((512, 384), (384, 256)))
    cf = stax.compile(lambda a, b: stax.relu(a @ b))
    out = cf(a, b)
    err = capsys.readouterr().err
    assert "cuBLASLt" in err and "->" in err
    ref = np.maximum(a.cpu().numpy().astype(np.float64) @ b.cpu().numpy().astype(np.float64), 0)
    assert_close(out.cpu().double(), ref, stax.float32, atol=1e-4)
