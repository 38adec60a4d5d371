"""Tests of stax/cuda.py (the CUDA driver runtime: docs/DESIGN.md "Runtime"; section 9.7 allocator) and
stax/cuda_triton.py (Triton cubins compiled, loaded and launched).

CPU tests (run everywhere): the cdef parses, import is lazy, no-GPU errors are clear, Triton
compiles an add kernel to an sm_90 cubin without a GPU. Tests marked ``gpu`` need a device and skip
cleanly without one. stax.cuda is loaded standalone from its file when the package does not import,
so these tests do not depend on the rest of stax.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parent.parent / "stax" / "cuda.py"


def _load_cuda():
    try:
        from stax import cuda as mod  # the package's own module when the package imports
        return mod
    except Exception:  # noqa: BLE001 -- package half-written: load the file on its own
        name = "_stax_cuda_standalone"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, _PATH)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod


cuda = _load_cuda()
from stax import cuda_triton  # noqa: E402  (Kernel, Launcher, compile_triton: the layer above cuda.py)
HAVE_GPU = cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU: "
                                           f"{cuda.unavailable_reason()}")]


def _have_triton() -> bool:
    try:
        import triton  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


needs_triton = pytest.mark.skipif(not _have_triton() or os.environ.get("TRITON_INTERPRET") == "1",
                                  reason="triton is not installed, or kernels are interpreted "
                                         "(TRITON_INTERPRET=1: @triton.jit functions cannot be "
                                         "compiled; tests/test_gpu.py builds them in a subprocess)")


def _apply(marks):
    def deco(f):
        for m in marks:
            f = m(f)
        return f
    return deco


on_gpu = _apply(gpu)


# ---------------------------------------------------------------- CPU-side tests

def test_cdef_parses():
    ffi = cuda._make_ffi()
    assert ffi.sizeof("CUdeviceptr") == 8
    assert ffi.typeof("CUresult (*)(CUfunction, unsigned int, unsigned int, unsigned int, "
                      "unsigned int, unsigned int, unsigned int, unsigned int, CUstream, void **, "
                      "void **)") is not None


def test_import_is_lazy():
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('c', {str(_PATH)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['c'] = m; "
            "spec.loader.exec_module(m); "
            "assert m._state is None and m._ffi_cached is None; "
            "assert 'triton' not in sys.modules and 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout


def test_unavailable_message():
    # Force "no GPU" in a child process so that this runs on GPU machines too.
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('c', {str(_PATH)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['c'] = m; "
            "spec.loader.exec_module(m); "
            "assert m.is_available() is False; assert m.is_available() is False\n"
            "try:\n    m.allocate(16)\nexcept RuntimeError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('no error')\n")
    env = dict(os.environ, STAX_DISABLE_CUDA="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.strip()
    assert msg.startswith("device='cuda' needs an NVIDIA GPU and its driver (libcuda.so.1); "
                          "none was found: "), msg
    assert msg.endswith("Use device='cpu'."), msg


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present")
def test_no_gpu_here_raises_clearly():
    assert cuda.is_available() is False
    assert cuda.unavailable_reason()
    with pytest.raises(RuntimeError, match=r"device='cuda' needs an NVIDIA GPU"):
        cuda.get_device_properties()
    with pytest.raises(RuntimeError, match=r"Use device='cpu'"):
        cuda.allocate(1)


def test_round_size():
    assert cuda.round_size(0) == 512
    assert cuda.round_size(1) == 512
    assert cuda.round_size(513) == 1024
    assert cuda.round_size(1 << 20) == 1 << 20
    assert cuda.round_size((1 << 20) + 1) == 2 << 20
    assert cuda.round_size((5 << 20) + 3) == 6 << 20


def test_h200_defaults():
    p = cuda.H200_PROPERTIES
    assert p.sm_count == 132 and p.cc == (9, 0) and p.warp_size == 32


def test_ptx_param_count():
    ptx = (".visible .entry k(\n .param .u64 .ptr .global .align 1 k_param_0,\n"
           " .param .u32 k_param_1,\n .param .u64 .ptr .global .align 1 k_param_2\n)\n{\n")
    assert cuda_triton._ptx_entry_param_count(ptx, "k") == 3
    assert cuda_triton._ptx_entry_param_count(ptx, "other") is None


def _add_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stax_test_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x + y, mask=mask)

    return stax_test_add


ADD_SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}


@needs_triton
def test_compile_triton_sm90_without_gpu():
    cubin, info, name = cuda_triton.compile_triton(_add_kernel(), ADD_SIG, {"BLOCK": 1024}, num_warps=4,
                                            num_stages=3, cc=90)
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
    assert name == "stax_test_add" == info.name
    assert info.num_warps == 4 and info.num_user_params == 4
    assert 0 <= info.num_scratch_params <= 2
    assert info.global_scratch_size == 0 and info.shared >= 0


_WARM = """
import sys
import triton
import triton.language as tl
from stax import cuda_triton

@triton.jit
def stax_test_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

cuda_triton.warm_compiler()
cuda_triton.warm_compiler()
(thread,) = cuda_triton._warming
assert thread.name == "stax-triton-setup" and thread.daemon
cubin, info, name = cuda_triton.compile_triton(stax_test_copy, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"},
                                               {"BLOCK": 128}, cc=90)
from triton.runtime.cache import triton_key
assert not thread.is_alive() and cubin[:4] == b"\\x7fELF"
print("misses", triton_key.cache_info().misses)
"""


def test_triton_setup_runs_early_on_a_thread_and_compiles_wait_for_it(tmp_path):
    """Issue 14: `warm_compiler` (an artifact miss on the GPU calls it) hashes triton's files on a
    thread while the kernels are lowered; a compile waits for it, so the 500 MB are hashed once.
    Under the interpreter nothing starts (nothing compiles)."""
    pytest.importorskip("triton")
    script = tmp_path / "warm.py"
    script.write_text(_WARM)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(_PATH.parent.parent), TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["misses", "1"]
    code = ("import sys; from stax import cuda_triton; cuda_triton.warm_compiler(); "
            "assert cuda_triton._warming == [] and 'triton' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "TRITON_INTERPRET": "1"}, cwd=str(_PATH.parent.parent))
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


class _FakeLib:
    """Stands in for libcuda: records cuLaunchKernel's arguments (CPU test of the Launcher)."""

    def __init__(self, ffi):
        self.ffi, self.calls = ffi, []

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shm, stream, params, extra):
        ffi = self.ffi
        vals = [int(ffi.cast("unsigned long long *", params[0])[0]),
                int(ffi.cast("int *", params[1])[0]),
                int(ffi.cast("long long *", params[2])[0]),
                float(ffi.cast("float *", params[3])[0]),
                int(ffi.cast("unsigned long long *", params[4])[0]),
                int(ffi.cast("unsigned long long *", params[5])[0])]
        self.calls.append(((gx, gy, gz, bx, by, bz, shm), vals))
        return 0

    def cuCtxSetCurrent(self, ctx):      # (cuda.init makes the context current on each thread)
        return 0


def test_launcher_packs_slots_without_gpu(monkeypatch):
    ffi = cuda._make_ffi()
    st = cuda._State()
    st.ffi, st.lib, st.context = ffi, _FakeLib(ffi), ffi.NULL
    st.stream = cuda.Stream._wrap(ffi.NULL, ffi)
    monkeypatch.setattr(cuda, "_state", st)
    k = cuda_triton.Kernel.__new__(cuda_triton.Kernel)
    k.function, k.name, k.num_warps, k.shared_mem = ffi.NULL, "k", 8, 1234
    lz = cuda_triton.Launcher(k, ["*fp32", "i32", "i64", "fp32", "constexpr"], num_scratch_params=2)
    assert lz.nargs == 4

    class P:  # anything with .ptr passes as a pointer
        ptr = 0x7F0000001000

    lz((3, 2, 1), [P(), -5, -(1 << 40), 1.5])
    lz(7, [0x1234, 2**31 - 1, 2**62, -0.25])
    lz((0,), [None, 0, 0, 0.0])          # empty grid: no launch
    assert st.lib.calls == [((3, 2, 1, 256, 1, 1, 1234), [0x7F0000001000, -5, -(1 << 40), 1.5, 0, 0]),
                            ((7, 1, 1, 256, 1, 1, 1234), [0x1234, 2**31 - 1, 2**62, -0.25, 0, 0])]
    with pytest.raises(TypeError):
        lz(1, [0, 1, 2])


# ---------------------------------------------------------------- GPU tests

@on_gpu
def test_device_properties():
    p = cuda.get_device_properties()
    assert p.sm_count > 0 and p.warp_size == 32 and p.cc[0] >= 7
    assert p.total_memory > 1 << 30
    assert p.max_shared_memory_per_block_optin >= p.shared_memory_per_block >= 48 * 1024
    assert cuda.init_seconds() > 0


@on_gpu
def test_alloc_free_cache_reuse_and_stats():
    cuda.empty_cache()
    s0 = cuda.memory_stats()
    a = cuda.allocate(1000)
    assert a.block_size == 1024 and a.ptr % 256 == 0
    ptr = a.ptr
    s1 = cuda.memory_stats()
    assert s1["allocated_bytes"] == s0["allocated_bytes"] + 1024
    assert s1["num_driver_allocs"] == s0["num_driver_allocs"] + 1
    a.free()
    a.free()   # idempotent
    s2 = cuda.memory_stats()
    assert s2["allocated_bytes"] == s0["allocated_bytes"]
    assert s2["reserved_bytes"] >= s2["allocated_bytes"] + 1024
    b = cuda.allocate(900)           # same rounded size: served from the cache
    assert b.ptr == ptr
    s3 = cuda.memory_stats()
    assert s3["num_cache_hits"] == s2["num_cache_hits"] + 1
    assert s3["num_driver_allocs"] == s2["num_driver_allocs"]
    del b                            # __del__ returns it
    c = cuda.allocate(1536)          # [1536, 3072) does not hold 1024: new block
    assert c.ptr != ptr
    big = cuda.allocate(3 << 20)     # 4 MiB block
    big_ptr = big.ptr
    big.free()
    d = cuda.allocate((2 << 20) + 1)  # rounds to 4 MiB: best fit reuses the 4 MiB block
    assert d.ptr == big_ptr
    assert cuda.memory_stats()["peak_allocated_bytes"] >= (4 << 20)
    c.free()
    d.free()
    cuda.empty_cache()
    s4 = cuda.memory_stats()
    assert s4["reserved_bytes"] == s4["allocated_bytes"]


@on_gpu
@pytest.mark.parametrize("n", [1, 7, 1000, (1 << 20) + 3])
def test_h2d_d2h_roundtrip(n):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 256, size=n, dtype=np.uint8)
    buf = cuda.allocate(n)
    cuda.copy_host_to_device(buf, x)
    y = np.full(n, 0xAB, dtype=np.uint8)
    y[: min(n, 3)] = ~x[: min(n, 3)]
    cuda.copy_device_to_host(y, buf)
    np.testing.assert_array_equal(x, y)
    f = rng.standard_normal(n).astype(np.float32)
    fb = cuda.to_device(f)
    np.testing.assert_array_equal(cuda.to_host(fb, f.shape, f.dtype), f)


@on_gpu
def test_offsets_d2d_memset():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1000).astype(np.float32)
    src = cuda.to_device(x)
    dst = cuda.allocate(x.nbytes)
    cuda.memset_zero(dst)
    cuda.copy_device_to_device(dst, src, 400 * 4, dst_offset=100 * 4, src_offset=500 * 4)
    out = cuda.to_host(dst, x.shape, x.dtype)
    ref = np.zeros_like(x)
    ref[100:500] = x[500:900]
    np.testing.assert_array_equal(out, ref)
    # raw int pointers with byte offsets work too
    part = np.empty(10, np.float32)
    cuda.copy_device_to_host(part, src.ptr + 4 * 990)
    np.testing.assert_array_equal(part, x[990:])
    with pytest.raises(ValueError):
        cuda.copy_device_to_device(dst, src, x.nbytes, dst_offset=4)


@on_gpu
def test_events():
    a, b = cuda.Event(), cuda.Event()
    buf = cuda.allocate(64 << 20)
    a.record()
    for _ in range(4):
        cuda.memset_zero(buf)
    b.record()
    b.synchronize()
    ms = a.elapsed_time(b)
    assert 0.0 <= ms < 1000.0


@on_gpu
def test_median_ms_cold_flushes_outside_the_caching_allocator():
    """Alg. 9.1's cold timing (templates): each call after a 256 MB fill; the fill's memory comes
    from the driver and goes back to it, so no allocated, peak or cached bytes are left behind."""
    buf = cuda.allocate(32 << 20)
    cuda.synchronize()
    before = (cuda.memory_allocated(), cuda.max_memory_allocated())
    calls = []
    ms = cuda.median_ms(lambda: (calls.append(1), cuda.memset_zero(buf)), cold=True)
    warm = cuda.median_ms(lambda: cuda.memset_zero(buf))
    assert len(calls) == 1 + cuda.COLD_SAMPLES and 0.0 < warm and 0.0 < ms < 1000.0
    assert (cuda.memory_allocated(), cuda.max_memory_allocated()) == before


@on_gpu
def test_oom_error_name():
    with pytest.raises(cuda.CudaError) as ei:
        cuda.allocate(1 << 40)
    assert ei.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert "CUDA_ERROR_OUT_OF_MEMORY in cuMemAlloc_v2(1099511627776 bytes)" in str(ei.value)
    assert isinstance(ei.value, RuntimeError)
    x = cuda.allocate(16)   # still usable afterwards
    x.free()


@on_gpu
def test_bad_cubin_error_name():
    with pytest.raises(cuda.CudaError) as ei:
        cuda_triton.load_kernel(b"\x7fELF this is not a cubin" + bytes(64), "nope")
    assert ei.value.name.startswith("CUDA_ERROR_")


@pytest.fixture(scope="module")
def add_launcher():
    if not HAVE_GPU or not _have_triton():
        pytest.skip("needs a GPU and triton")
    cubin, info, name = cuda_triton.compile_triton(_add_kernel(), ADD_SIG, {"BLOCK": 1024}, num_warps=4)
    return cuda_triton.launcher_for_triton(cubin, info, ADD_SIG), info


@on_gpu
@needs_triton
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3])
def test_launch_triton_add(add_launcher, n):
    launch, info = add_launcher
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    xb, yb, ob = cuda.to_device(x), cuda.to_device(y), cuda.allocate(x.nbytes)
    poison = np.full(n, np.nan, np.float32)
    cuda.copy_host_to_device(ob, poison)
    launch(((n + 1023) // 1024, 1, 1), [xb, yb, ob, n])
    out = cuda.to_host(ob, (n,), np.float32)
    np.testing.assert_array_equal(out, x + y)


@on_gpu
@needs_triton
def test_graph_capture_replay_100(add_launcher):
    launch, info = add_launcher
    n = 4096
    rng = np.random.default_rng(7)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    xb, yb = cuda.to_device(x), cuda.to_device(y)
    acc = cuda.to_device(np.zeros(n, np.float32))
    grid = (n // 1024, 1, 1)
    g = cuda.CUDAGraph()
    with g:
        for i in range(100):              # acc = acc + y, 50 times; then x + acc ... alternating
            if i % 2 == 0:
                launch(grid, [acc, yb, acc, n])
            else:
                launch(grid, [acc, xb, acc, n])
    # capture ran nothing
    np.testing.assert_array_equal(cuda.to_host(acc, (n,), np.float32), np.zeros(n, np.float32))
    g.replay()
    g.replay()
    ref = np.zeros(n, np.float32)
    for _ in range(2):
        for i in range(100):
            ref = ref + (y if i % 2 == 0 else x)
    np.testing.assert_array_equal(cuda.to_host(acc, (n,), np.float32), ref)


def _tma_scale_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stax_test_tma_scale(x_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        # device-side TMA descriptors need Triton's global scratch (metadata global_scratch_size > 0)
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        dx = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        do = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        v = dx.load([pm * BM, pn * BN])
        do.store([pm * BM, pn * BN], v * 2)

    return stax_test_tma_scale


TMA_SIG = {"x_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32", "BM": "constexpr",
           "BN": "constexpr"}


@needs_triton
def test_compile_reports_global_scratch():
    cubin, info, name = cuda_triton.compile_triton(_tma_scale_kernel(), TMA_SIG, {"BM": 64, "BN": 64})
    assert info.global_scratch_size > 0
    assert info.num_scratch_params >= 1


@on_gpu
@needs_triton
def test_launch_with_global_scratch():
    cubin, info, name = cuda_triton.compile_triton(_tma_scale_kernel(), TMA_SIG, {"BM": 64, "BN": 64})
    assert info.global_scratch_size > 0
    launch = cuda_triton.launcher_for_triton(cubin, info, TMA_SIG)
    M, N = 256, 192
    x = np.random.default_rng(3).standard_normal((M, N)).astype(np.float32)
    xb = cuda.to_device(x)
    ob = cuda.to_device(np.full((M, N), np.nan, np.float32))
    launch((M // 64, N // 64, 1), [xb, ob, M, N])
    np.testing.assert_array_equal(cuda.to_host(ob, (M, N), np.float32), 2 * x)
