"""stax.cuda -- the GPU driver layer (bottom of the stack): a cffi (ABI mode) binding of ``libcuda.so.1``.

Layer: bottom (imports no other stax module; tensor.py and everything above may import it).
Chapter: docs/DESIGN.md "Runtime" (GPU bullet); §9.7 (caching allocator, Listing 9.6's device context).
No PyTorch, CuPy or cuda-python underneath: ``cffi.FFI().dlopen("libcuda.so.1")``, no C compiler.

What it consumes / produces
  * consumes: numpy arrays for host<->device copies;
  * produces: ``DeviceBuffer`` (device memory from the caching allocator), ``Stream``, ``Event``,
    ``CUDAGraph`` (CUDA-graph capture of the default stream), ``DeviceProperties``, the storage of
    "cuda" tensors (``DeviceArray``: device memory on a GPU, guarded host memory under Triton's
    interpreter), ``device`` (the wrapper's ``with stax.cuda.device(0):``), and ``_state`` (the
    driver's handles) that cuda_triton.py loads and launches cubins with.

Parts (banners below): driver binding & lazy init; errors; device properties; caching allocator;
copies; streams & events; CUDA graphs; tensor storage on the device. Loading and launching Triton
cubins (``Kernel``, ``Launcher``, ``compile_triton``) is one layer up, in cuda_triton.py.

Rules kept here
  * importing this module touches neither the driver nor triton; the first real use initialises
    (cuInit, primary context of device 0, one created stream -- not the legacy NULL stream, so that
    CUDA graphs can capture it). ``is_available()`` never raises.
  * every driver call is checked; failures raise ``CudaError`` with the driver's error name, e.g.
    ``CUDA_ERROR_OUT_OF_MEMORY in cuMemAlloc_v2(1099511627776 bytes)``.
  * all work goes on the one default stream, so stream order makes reuse of freed blocks safe.
  * launches are asynchronous; ``synchronize()`` waits; ``copy_device_to_host`` syncs first.
  * ``TRITON_INTERPRET=1`` (``interpreting()``): "cuda" tensors live in host memory between guard
    zones, and kernels run in Triton's interpreter -- how CI, with no GPU, runs every Triton kernel.

Where to look: ``init``; ``_CachingAllocator``; ``CUDAGraph``; ``DeviceArray``;
tests/test_cuda.py (CPU and ``gpu``-marked tests), bench/cuda_runtime_check.py (device checks).
"""
from __future__ import annotations

import bisect
import dataclasses
import os
import threading
import time
import weakref

__all__ = [
    "CudaError", "CudaUnavailableError", "is_available", "init", "get_device_properties",
    "DeviceProperties", "H200_PROPERTIES", "DeviceBuffer", "allocate", "memory_stats",
    "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "empty_cache",
    "copy_host_to_device", "copy_device_to_host",
    "copy_device_to_device", "memset_zero", "to_device", "to_host", "Stream", "current_stream",
    "synchronize", "Event", "CUDAGraph", "interpreting", "check_device", "DeviceArray", "device",
    "CDEF", "allocating_from",
]

# ---- §9.7 Driver binding (cdef) and lazy initialisation ----

CDEF = """
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;

CUresult cuGetErrorName(CUresult error, const char **pStr);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuInit(unsigned int Flags);
CUresult cuDriverGetVersion(int *driverVersion);

CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetName(char *name, int len, CUdevice dev);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxSynchronize(void);

CUresult cuMemGetInfo_v2(size_t *free, size_t *total);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                              CUstream hStream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount,
                              CUstream hStream);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N, CUstream hStream);

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventDestroy_v2(CUevent hEvent);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventSynchronize(CUevent hEvent);
CUresult cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd);

CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleUnload(CUmodule hmod);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction hfunc);
CUresult cuFuncSetAttribute(CUfunction hfunc, int attrib, int value);
CUresult cuLaunchKernel(CUfunction f,
                        unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);

CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuStreamIsCapturing(CUstream hStream, int *captureStatus);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                     unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
"""

# enum values from cuda.h
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_STREAM_NON_BLOCKING = 1
CU_STREAM_CAPTURE_MODE_RELAXED = 2
CU_EVENT_DEFAULT = 0

_UNAVAILABLE_MSG = ("device='cuda' needs an NVIDIA GPU and its driver (libcuda.so.1); none was found: "
                    "{reason}. Use device='cpu'.")

_ffi_cached = None


def _make_ffi():
    """The cffi FFI with CDEF parsed (no driver needed). Cached."""
    global _ffi_cached
    if _ffi_cached is None:
        import cffi
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        _ffi_cached = ffi
    return _ffi_cached


class _State:
    """Everything that exists once the driver is up: one per process (device 0)."""
    __slots__ = ("ffi", "lib", "device", "context", "stream", "init_seconds", "driver_version",
                 "props", "alloc")


_state: _State | None = None
_init_error: str | None = None
_init_lock = threading.RLock()


class CudaUnavailableError(RuntimeError):
    """Raised on any CUDA use when no usable GPU / driver exists."""


_thread = threading.local()     # .current: this thread has made the primary context current


def init() -> _State:
    """Initialise the driver once (cuInit, primary context of device 0, the default stream), and
    make the context current on the calling thread the first time that thread asks (contexts are
    current per thread: a copy from a new thread would otherwise fail with INVALID_CONTEXT)."""
    global _state, _init_error
    st = _state
    if st is not None:
        if not getattr(_thread, "current", False):
            _thread.current = True          # (first: _check's error path calls init too)
            _check(st.lib.cuCtxSetCurrent(st.context), "cuCtxSetCurrent")
        return st
    with _init_lock:
        if _state is not None:
            return _state
        if _init_error is not None:
            raise CudaUnavailableError(_UNAVAILABLE_MSG.format(reason=_init_error))
        try:
            _state = _do_init()
            _thread.current = True
        except CudaUnavailableError:
            raise
        except Exception as e:  # noqa: BLE001 -- any failure here means "no GPU"
            _init_error = f"{type(e).__name__}: {e}"
            raise CudaUnavailableError(_UNAVAILABLE_MSG.format(reason=_init_error)) from e
        return _state


def _do_init() -> _State:
    global _init_error
    if os.environ.get("STAX_DISABLE_CUDA", "") not in ("", "0"):
        _init_error = "disabled by STAX_DISABLE_CUDA"
        raise CudaUnavailableError(_UNAVAILABLE_MSG.format(reason=_init_error))
    t0 = time.perf_counter()
    ffi = _make_ffi()
    libname = os.environ.get("STAX_LIBCUDA", "libcuda.so.1")
    try:
        lib = ffi.dlopen(libname)
    except OSError as e:
        _init_error = f"cannot load {libname} ({str(e).split('.  Additionally')[0]})"
        raise CudaUnavailableError(_UNAVAILABLE_MSG.format(reason=_init_error)) from None
    st = _State()
    st.ffi, st.lib = ffi, lib
    rc = lib.cuInit(0)
    if rc != CUDA_SUCCESS:
        _init_error = f"cuInit failed with {_error_name(ffi, lib, rc)}"
        raise CudaUnavailableError(_UNAVAILABLE_MSG.format(reason=_init_error))
    n = ffi.new("int*")
    _check_raw(ffi, lib, lib.cuDeviceGetCount(n), "cuDeviceGetCount")
    if n[0] < 1:
        _init_error = "the driver reports no CUDA devices"
        raise CudaUnavailableError(_UNAVAILABLE_MSG.format(reason=_init_error))
    dev = ffi.new("CUdevice*")
    _check_raw(ffi, lib, lib.cuDeviceGet(dev, 0), "cuDeviceGet", "0")
    st.device = dev[0]
    ctx = ffi.new("CUcontext*")
    _check_raw(ffi, lib, lib.cuDevicePrimaryCtxRetain(ctx, st.device), "cuDevicePrimaryCtxRetain")
    st.context = ctx[0]
    _check_raw(ffi, lib, lib.cuCtxSetCurrent(st.context), "cuCtxSetCurrent")
    ver = ffi.new("int*")
    _check_raw(ffi, lib, lib.cuDriverGetVersion(ver), "cuDriverGetVersion")
    st.driver_version = ver[0]
    s = ffi.new("CUstream*")
    # A created, blocking stream (flags 0): capturable by CUDA graphs, and ordered with the legacy
    # stream that the synchronous cuMemcpy* calls use.
    _check_raw(ffi, lib, lib.cuStreamCreate(s, 0), "cuStreamCreate")
    st.stream = Stream._wrap(s[0], ffi)
    st.props = None
    st.alloc = _CachingAllocator(ffi, lib)
    st.init_seconds = time.perf_counter() - t0
    return st


def is_available() -> bool:
    """True when libcuda loads, cuInit succeeds and a device exists. Never raises."""
    if _state is not None:
        return True
    try:
        init()
        return True
    except Exception:  # noqa: BLE001
        return False


def unavailable_reason() -> str | None:
    """Why is_available() is False (None when it is True or was not asked yet)."""
    return _init_error


def init_seconds() -> float:
    """Seconds spent in cuInit + context + stream creation by this process."""
    return init().init_seconds


def _ctx_current() -> None:
    """Make the primary context current on this thread (contexts are per thread)."""
    st = init()
    cur = st.ffi.new("CUcontext*")
    _check(st.lib.cuCtxGetCurrent(cur), "cuCtxGetCurrent")
    if cur[0] != st.context:
        _check(st.lib.cuCtxSetCurrent(st.context), "cuCtxSetCurrent")


# ---- §9.7 Errors ----

class CudaError(RuntimeError):
    """A CUDA driver call failed. ``.code`` is the CUresult, ``.name`` e.g. CUDA_ERROR_OUT_OF_MEMORY."""

    def __init__(self, code: int, name: str, call: str, detail: str = "", description: str = ""):
        self.code, self.name, self.call = code, name, call
        msg = f"{name} in {call}({detail})"
        if description:
            msg += f": {description}"
        super().__init__(msg)


def _error_name(ffi, lib, rc: int) -> str:
    p = ffi.new("const char**")
    if lib.cuGetErrorName(rc, p) == CUDA_SUCCESS and p[0] != ffi.NULL:
        return ffi.string(p[0]).decode()
    return f"CUDA_ERROR_{rc}"


def _error_string(ffi, lib, rc: int) -> str:
    p = ffi.new("const char**")
    if lib.cuGetErrorString(rc, p) == CUDA_SUCCESS and p[0] != ffi.NULL:
        return ffi.string(p[0]).decode()
    return ""


def _make_error(ffi, lib, rc: int, call: str, detail: str = "") -> CudaError:
    return CudaError(rc, _error_name(ffi, lib, rc), call, detail, _error_string(ffi, lib, rc))


def _check_raw(ffi, lib, rc: int, call: str, detail: str = "") -> None:
    if rc != CUDA_SUCCESS:
        raise _make_error(ffi, lib, rc, call, detail)


def _check(rc: int, call: str, detail: str = "") -> None:
    if rc != CUDA_SUCCESS:
        st = _state
        raise _make_error(st.ffi, st.lib, rc, call, detail)


# ---- §9.1 Device properties (the target code is generated for) ----

@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    name: str
    sm_count: int
    cc: tuple            # (major, minor)
    max_shared_memory_per_block_optin: int
    shared_memory_per_block: int
    total_memory: int
    warp_size: int
    l2_cache_size: int = 0
    max_threads_per_block: int = 1024
    shared_memory_per_multiprocessor: int = 0


# What code generation assumes when no GPU is present (the default target).
H200_PROPERTIES = DeviceProperties(
    name="NVIDIA H200", sm_count=132, cc=(9, 0), max_shared_memory_per_block_optin=232448,
    shared_memory_per_block=49152, total_memory=143771 * 2**20, warp_size=32,
    l2_cache_size=60 * 2**20, max_threads_per_block=1024, shared_memory_per_multiprocessor=233472)


def get_device_properties() -> DeviceProperties:
    st = init()
    if st.props is None:
        ffi, lib = st.ffi, st.lib
        v = ffi.new("int*")

        def attr(a):
            _check(lib.cuDeviceGetAttribute(v, a, st.device), "cuDeviceGetAttribute", str(a))
            return v[0]

        buf = ffi.new("char[256]")
        _check(lib.cuDeviceGetName(buf, 256, st.device), "cuDeviceGetName")
        total = ffi.new("size_t*")
        _check(lib.cuDeviceTotalMem_v2(total, st.device), "cuDeviceTotalMem_v2")
        st.props = DeviceProperties(
            name=ffi.string(buf).decode(),
            sm_count=attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            cc=(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            max_shared_memory_per_block_optin=attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            shared_memory_per_block=attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
            total_memory=int(total[0]),
            warp_size=attr(CU_DEVICE_ATTRIBUTE_WARP_SIZE),
            l2_cache_size=attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            max_threads_per_block=attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            shared_memory_per_multiprocessor=attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        )
    return st.props


def mem_get_info() -> tuple:
    """(free, total) bytes on the device, from the driver."""
    st = init()
    f, t = st.ffi.new("size_t*"), st.ffi.new("size_t*")
    _check(st.lib.cuMemGetInfo_v2(f, t), "cuMemGetInfo_v2")
    return int(f[0]), int(t[0])


def driver_version() -> int:
    return init().driver_version


# ---- §9.7 Caching allocator ----

_SMALL_LIMIT = 1 << 20          # requests up to 1 MiB: 512 B granules
_SMALL_GRANULE = 512
_LARGE_GRANULE = 2 << 20        # larger requests: 2 MiB granules


def round_size(nbytes: int) -> int:
    """The block size the allocator reserves for a request of nbytes (0 -> 512)."""
    n = max(int(nbytes), 1)
    g = _SMALL_GRANULE if n <= _SMALL_LIMIT else _LARGE_GRANULE
    return (n + g - 1) // g * g


class DeviceBuffer:
    """A block of device memory from the caching allocator.

    ``ptr`` (int) is the device address, ``nbytes`` the size asked for, ``block_size`` the rounded
    size reserved. ``free()`` (or garbage collection) gives the block back to the cache, not the
    driver. Work already queued on the default stream that uses the block stays correct: any later
    user of the block is queued behind it on the same stream.
    """
    __slots__ = ("ptr", "nbytes", "block_size", "device", "_alloc", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, block_size: int, alloc):
        self.ptr = ptr
        self.nbytes = nbytes
        self.block_size = block_size
        self.device = "cuda"
        self._alloc = alloc

    def free(self) -> None:
        a = self._alloc
        if a is not None:
            self._alloc = None
            a.release(self.ptr, self.block_size)

    def __del__(self):
        try:
            self.free()
        except Exception:  # noqa: BLE001 -- interpreter shutdown, driver gone
            pass

    def data_ptr(self) -> int:
        return self.ptr

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self):
        state = "" if self._alloc is not None else ", freed"
        return f"DeviceBuffer(ptr=0x{self.ptr:x}, nbytes={self.nbytes}{state})"


class _CachingAllocator:
    """Free lists per rounded size; best fit among cached blocks of size in [n, 2n)."""

    def __init__(self, ffi, lib):
        self.ffi, self.lib = ffi, lib
        self.lock = threading.Lock()
        self.free_blocks: dict[int, list[int]] = {}   # block size -> device pointers
        self.free_sizes: list[int] = []                # sorted sizes that have cached blocks
        self.allocated_bytes = 0
        self.cached_bytes = 0
        self.peak_allocated_bytes = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.num_cache_hits = 0
        self.num_driver_allocs = 0
        self.num_driver_frees = 0
        self.num_ooms = 0
        self._out = ffi.new("CUdeviceptr*")

    def _take_cached(self, size: int):
        sizes = self.free_sizes
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] < 2 * size:
            bsize = sizes[i]
            lst = self.free_blocks[bsize]
            ptr = lst.pop()
            if not lst:
                del self.free_blocks[bsize]
                sizes.pop(i)
            self.cached_bytes -= bsize
            return ptr, bsize
        return None

    def allocate(self, nbytes: int) -> DeviceBuffer:
        if nbytes < 0:
            raise ValueError(f"negative allocation size {nbytes}")
        size = round_size(nbytes)
        with self.lock:
            self.num_allocs += 1
            hit = self._take_cached(size)
            if hit is not None:
                self.num_cache_hits += 1
                ptr, bsize = hit
            else:
                ptr, bsize = self._driver_alloc(size), size
            self.allocated_bytes += bsize
            if self.allocated_bytes > self.peak_allocated_bytes:
                self.peak_allocated_bytes = self.allocated_bytes
        return DeviceBuffer(ptr, int(nbytes), bsize, self)

    def _driver_alloc(self, size: int) -> int:
        out = self._out
        rc = self.lib.cuMemAlloc_v2(out, size)
        if rc == CUDA_ERROR_OUT_OF_MEMORY and self.cached_bytes:
            self._empty_cache_locked()
            rc = self.lib.cuMemAlloc_v2(out, size)
        if rc != CUDA_SUCCESS:
            if rc == CUDA_ERROR_OUT_OF_MEMORY:
                self.num_ooms += 1
            err = _make_error(self.ffi, self.lib, rc, "cuMemAlloc_v2", f"{size} bytes")
            if rc == CUDA_ERROR_OUT_OF_MEMORY:
                err.args = (f"{err.args[0]} (stax holds {self.allocated_bytes} bytes allocated, "
                            f"{self.cached_bytes} cached)",)
            raise err
        self.num_driver_allocs += 1
        return int(out[0])

    def release(self, ptr: int, bsize: int) -> None:
        with self.lock:
            self.num_frees += 1
            self.allocated_bytes -= bsize
            lst = self.free_blocks.get(bsize)
            if lst is None:
                self.free_blocks[bsize] = [ptr]
                bisect.insort(self.free_sizes, bsize)
            else:
                lst.append(ptr)
            self.cached_bytes += bsize

    def _empty_cache_locked(self) -> None:
        if not self.free_blocks:
            return
        # cuMemFree waits for work that may still touch the blocks; sync explicitly anyway.
        st = _state
        if st is not None:
            _check(self.lib.cuStreamSynchronize(st.stream.handle), "cuStreamSynchronize")
        for bsize, lst in self.free_blocks.items():
            for ptr in lst:
                _check(self.lib.cuMemFree_v2(ptr), "cuMemFree_v2", f"0x{ptr:x}")
                self.num_driver_frees += 1
        self.free_blocks.clear()
        self.free_sizes.clear()
        self.cached_bytes = 0

    def empty_cache(self) -> None:
        with self.lock:
            self._empty_cache_locked()

    def stats(self) -> dict:
        with self.lock:
            return {
                "allocated_bytes": self.allocated_bytes,
                "reserved_bytes": self.allocated_bytes + self.cached_bytes,
                "cached_bytes": self.cached_bytes,
                "peak_allocated_bytes": self.peak_allocated_bytes,
                "num_allocs": self.num_allocs,
                "num_frees": self.num_frees,
                "num_cache_hits": self.num_cache_hits,
                "num_driver_allocs": self.num_driver_allocs,
                "num_driver_frees": self.num_driver_frees,
                "num_ooms": self.num_ooms,
            }


_POOL = threading.local()      # .pool: where this thread's allocations come from while a CUDA graph records


def allocate(nbytes: int) -> DeviceBuffer:
    """nbytes of device memory from the caching allocator (contents undefined), or from the
    graph's pool while this thread records a CUDA graph (``allocating_from``)."""
    pool = getattr(_POOL, "pool", None)
    if pool is not None:
        return pool.allocate(nbytes)
    return init().alloc.allocate(nbytes)


class allocating_from:
    """``with allocating_from(pool):`` this thread's allocations come from ``pool`` (§9.9: a CUDA
    graph's buffers must not go back to the shared cache while the graph may replay). ``pool``
    has ``allocate(nbytes) -> DeviceBuffer``; the buffers it hands out give themselves back to it."""

    def __init__(self, pool):
        self.pool, self.prev = pool, None

    def __enter__(self):
        self.prev = getattr(_POOL, "pool", None)
        _POOL.pool = self.pool
        return self.pool

    def __exit__(self, *exc):
        _POOL.pool = self.prev
        return False


class _InterpretedMemory:
    """Under TRITON_INTERPRET=1 "cuda" tensors are host arrays (DeviceArray); this counts them as
    the caching allocator counts device blocks (the same round_size), so a test without a GPU
    measures a compiled step's peak device memory the way the H200 does (issue 16)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.allocated_bytes = self.peak_allocated_bytes = self.num_allocs = self.num_frees = 0

    def track(self, array, nbytes: int) -> None:
        """Count `array` (the host memory of one DeviceArray) until numpy frees it."""
        size = round_size(nbytes)
        with self.lock:
            self.num_allocs += 1
            self.allocated_bytes += size
            if self.allocated_bytes > self.peak_allocated_bytes:
                self.peak_allocated_bytes = self.allocated_bytes
        weakref.finalize(array, self._release, size).atexit = False

    def _release(self, size: int) -> None:
        with self.lock:
            self.num_frees += 1
            self.allocated_bytes -= size

    def stats(self) -> dict:
        with self.lock:
            return {"allocated_bytes": self.allocated_bytes, "reserved_bytes": self.allocated_bytes,
                    "cached_bytes": 0, "peak_allocated_bytes": self.peak_allocated_bytes,
                    "num_allocs": self.num_allocs, "num_frees": self.num_frees, "num_cache_hits": 0,
                    "num_driver_allocs": 0, "num_driver_frees": 0, "num_ooms": 0}


_INTERPRETED = _InterpretedMemory()


def _counters():
    """The allocator whose counters memory_stats() reads: the device's, or the interpreter's."""
    return _INTERPRETED if interpreting() else init().alloc


def memory_stats() -> dict:
    """allocated_bytes, reserved_bytes, peak_allocated_bytes, num_allocs, num_cache_hits,
    num_driver_allocs (plus cached_bytes, num_frees, num_driver_frees, num_ooms). Under
    TRITON_INTERPRET=1: the interpreted "cuda" arrays' bytes, rounded as on the device."""
    return _counters().stats()


def memory_allocated() -> int:
    """Bytes of device memory held by live buffers now (as torch.cuda.memory_allocated)."""
    return memory_stats()["allocated_bytes"]


def max_memory_allocated() -> int:
    """The most bytes held by live buffers since the last reset_peak_memory_stats() (as
    torch.cuda.max_memory_allocated; freed blocks the cache keeps are not counted)."""
    return memory_stats()["peak_allocated_bytes"]


def reset_peak_memory_stats() -> None:
    a = _counters()
    with a.lock:
        a.peak_allocated_bytes = a.allocated_bytes


def empty_cache() -> None:
    """Give every cached (free) block back to the driver."""
    init().alloc.empty_cache()


# ---- §9.7 Copies (offsets in bytes; a DeviceBuffer or a raw int device pointer is accepted) ----

def _dptr(buf, offset: int, nbytes: int, what: str) -> int:
    if isinstance(buf, DeviceBuffer):
        if buf._alloc is None:
            raise ValueError(f"{what}: buffer was freed")
        if offset < 0 or offset + nbytes > buf.nbytes:
            raise ValueError(f"{what}: {nbytes} bytes at offset {offset} exceed the buffer's "
                             f"{buf.nbytes} bytes")
        return buf.ptr + offset
    return int(buf) + offset


def copy_host_to_device(dst, src, dst_offset: int = 0) -> None:
    """Copy the bytes of a numpy array into dst (stream-ordered on the default stream).

    Pageable host memory: the driver has taken the bytes when this returns, so ``src`` may be reused.
    """
    import numpy as np
    st = init()
    a = np.ascontiguousarray(src)
    n = a.nbytes
    p = _dptr(dst, dst_offset, n, "copy_host_to_device")
    if n == 0:
        return
    h = st.ffi.from_buffer(a)
    _check(st.lib.cuMemcpyHtoDAsync_v2(p, h, n, st.stream.handle), "cuMemcpyHtoDAsync_v2",
           f"0x{p:x}, {n} bytes")


def copy_device_to_host(dst, src, src_offset: int = 0) -> None:
    """Copy dst.nbytes bytes from src into a writable C-contiguous numpy array (waits for the stream)."""
    st = init()
    if not dst.flags["C_CONTIGUOUS"] or not dst.flags["WRITEABLE"]:
        raise ValueError("copy_device_to_host: destination must be a writable C-contiguous array")
    n = dst.nbytes
    p = _dptr(src, src_offset, n, "copy_device_to_host")
    if n == 0:
        return
    _check(st.lib.cuStreamSynchronize(st.stream.handle), "cuStreamSynchronize")
    h = st.ffi.from_buffer(dst, require_writable=True)
    _check(st.lib.cuMemcpyDtoH_v2(h, p, n), "cuMemcpyDtoH_v2", f"0x{p:x}, {n} bytes")


def copy_device_to_device(dst, src, nbytes: int, dst_offset: int = 0, src_offset: int = 0) -> None:
    """Stream-ordered device copy of nbytes."""
    st = init()
    d = _dptr(dst, dst_offset, nbytes, "copy_device_to_device")
    s = _dptr(src, src_offset, nbytes, "copy_device_to_device")
    if nbytes == 0:
        return
    _check(st.lib.cuMemcpyDtoDAsync_v2(d, s, nbytes, st.stream.handle), "cuMemcpyDtoDAsync_v2",
           f"0x{d:x}, 0x{s:x}, {nbytes} bytes")


def memset_zero(buf, nbytes: int | None = None, offset: int = 0) -> None:
    """Stream-ordered zero fill (the whole buffer when nbytes is None)."""
    st = init()
    if nbytes is None:
        nbytes = buf.nbytes - offset
    p = _dptr(buf, offset, nbytes, "memset_zero")
    if nbytes == 0:
        return
    _check(st.lib.cuMemsetD8Async(p, 0, nbytes, st.stream.handle), "cuMemsetD8Async",
           f"0x{p:x}, {nbytes} bytes")


def to_device(array) -> DeviceBuffer:
    """A new DeviceBuffer holding a copy of a numpy array's bytes."""
    import numpy as np
    a = np.ascontiguousarray(array)
    buf = allocate(a.nbytes)
    copy_host_to_device(buf, a)
    return buf


def to_host(buf, shape, dtype, offset: int = 0):
    """A new numpy array of shape/dtype filled from buf (waits for the stream)."""
    import numpy as np
    out = np.empty(shape, dtype=dtype)
    copy_device_to_host(out, buf, offset)
    return out


# ---- §9.6–9.7 Streams and events (events time Algorithm 9.1's candidates) ----

class Stream:
    """A CUDA stream. The process's default one is ``current_stream()``."""
    __slots__ = ("handle", "_owned", "__weakref__")

    def __init__(self, flags: int = 0):
        st = init()
        s = st.ffi.new("CUstream*")
        _check(st.lib.cuStreamCreate(s, flags), "cuStreamCreate")
        self.handle, self._owned = s[0], True

    @classmethod
    def _wrap(cls, handle, ffi):
        obj = cls.__new__(cls)
        obj.handle, obj._owned = handle, False
        return obj

    def synchronize(self) -> None:
        _check(_state.lib.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def is_capturing(self) -> bool:
        st = _state
        v = st.ffi.new("int*")
        _check(st.lib.cuStreamIsCapturing(self.handle, v), "cuStreamIsCapturing")
        return v[0] != 0

    @property
    def ptr(self) -> int:
        return int(_state.ffi.cast("uintptr_t", self.handle))

    def __del__(self):
        try:
            if self._owned and _state is not None:
                _state.lib.cuStreamDestroy_v2(self.handle)
        except Exception:  # noqa: BLE001
            pass


def current_stream() -> Stream:
    return init().stream


def synchronize() -> None:
    """Wait for all work queued on the default stream."""
    st = init()
    _check(st.lib.cuStreamSynchronize(st.stream.handle), "cuStreamSynchronize")


def device_synchronize() -> None:
    """Wait for all work on the device (cuCtxSynchronize)."""
    st = init()
    _check(st.lib.cuCtxSynchronize(), "cuCtxSynchronize")


class Event:
    """A CUDA event (timing enabled). ``a.elapsed_time(b)``: milliseconds from a to b."""
    __slots__ = ("handle",)

    def __init__(self, flags: int = CU_EVENT_DEFAULT):
        st = init()
        e = st.ffi.new("CUevent*")
        _check(st.lib.cuEventCreate(e, flags), "cuEventCreate")
        self.handle = e[0]

    def record(self, stream: Stream | None = None) -> "Event":
        st = _state
        s = (stream or st.stream).handle
        _check(st.lib.cuEventRecord(self.handle, s), "cuEventRecord")
        return self

    def synchronize(self) -> None:
        _check(_state.lib.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_time(self, other: "Event") -> float:
        st = _state
        ms = st.ffi.new("float*")
        _check(st.lib.cuEventElapsedTime(ms, self.handle, other.handle), "cuEventElapsedTime")
        return float(ms[0])

    def __del__(self):
        try:
            if _state is not None:
                _state.lib.cuEventDestroy_v2(self.handle)
        except Exception:  # noqa: BLE001
            pass


L2_FLUSH_BYTES = 256 << 20     # a fill this large evicts the L2 (50 MB on the H200), as do_bench's does
COLD_SAMPLES = 25


def median_ms(run, cold: bool = False) -> float:
    """Median time of one call of `run` in ms (CUDA events, after a warm-up): how Alg. 9.1 times a
    candidate (triton_heuristics, cublas). Warm: enough back-to-back repetitions per sample for
    about a millisecond. Cold: each sample one call after a 256 MB fill has evicted the L2, as the
    benchmarks (and triton.testing.do_bench) time a call; the GEMM and conv templates are timed so,
    since how often a block's operands are re-read from L2 decides between their tiles (ResNet's
    layer4 conv: 64 x 128 x 64 is the fastest warm, 0.0217 ms, and runs 0.037 ms cold)."""
    run()
    if cold:
        return _cold_median_ms(run)
    e0, e1 = Event(), Event()
    e0.record()
    run()
    e1.record()
    e1.synchronize()
    reps = max(1, min(100, int(1.0 / max(e0.elapsed_time(e1), 1e-3))))
    samples = []
    for _ in range(5):
        e0.record()
        for _ in range(reps):
            run()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) / reps)
    return sorted(samples)[len(samples) // 2]


def _cold_median_ms(run) -> float:
    st = init()
    out = st.ffi.new("CUdeviceptr *")
    # (straight from the driver, outside the caching allocator: no peak or cached bytes are counted)
    _check(st.lib.cuMemAlloc_v2(out, L2_FLUSH_BYTES), "cuMemAlloc_v2", f"{L2_FLUSH_BYTES} bytes (L2 flush)")
    flush = int(out[0])
    try:
        events = [(Event(), Event()) for _ in range(COLD_SAMPLES)]
        for e0, e1 in events:
            _check(st.lib.cuMemsetD8Async(flush, 0, L2_FLUSH_BYTES, st.stream.handle), "cuMemsetD8Async",
                   "L2 flush")
            e0.record()
            run()
            e1.record()
        events[-1][1].synchronize()
        samples = sorted(e0.elapsed_time(e1) for e0, e1 in events)
    finally:
        st.lib.cuMemFree_v2(flush)
    return samples[len(samples) // 2]


# ---- §9.7 CUDA graphs (capture of the default stream) ----

class CUDAGraph:
    """Capture the work queued on the default stream, replay it with one cuGraphLaunch.

        g = CUDAGraph()
        with g:            # capture (nothing runs)
            launcher(grid, args) ...
        g.replay()         # runs the captured work; synchronize() to wait

    Buffers used inside must stay alive (and not be freed back to the cache) while the graph may
    replay. Capture mode is RELAXED, so allocator misses (cuMemAlloc) during capture are allowed.
    """

    def __init__(self):
        self._graph = None
        self._exec = None
        self._capturing = False

    def capture_begin(self) -> None:
        st = init()
        _check(st.lib.cuStreamBeginCapture_v2(st.stream.handle, CU_STREAM_CAPTURE_MODE_RELAXED),
               "cuStreamBeginCapture_v2")
        self._capturing = True

    def capture_end(self) -> None:
        st = _state
        g = st.ffi.new("CUgraph*")
        self._capturing = False
        _check(st.lib.cuStreamEndCapture(st.stream.handle, g), "cuStreamEndCapture")
        self._destroy()
        self._graph = g[0]
        ex = st.ffi.new("CUgraphExec*")
        _check(st.lib.cuGraphInstantiateWithFlags(ex, self._graph, 0), "cuGraphInstantiateWithFlags")
        self._exec = ex[0]

    def __enter__(self):
        self.capture_begin()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.capture_end()
        elif self._capturing:
            st = _state
            g = st.ffi.new("CUgraph*")
            self._capturing = False
            st.lib.cuStreamEndCapture(st.stream.handle, g)   # end the broken capture, ignore rc
            if g[0] != st.ffi.NULL:
                st.lib.cuGraphDestroy(g[0])
        return False

    def replay(self) -> None:
        graph_exec = self._exec
        if graph_exec is None:
            raise RuntimeError("CUDAGraph.replay: nothing captured")
        st = _state
        rc = st.lib.cuGraphLaunch(graph_exec, st.stream.handle)
        if rc != CUDA_SUCCESS:              # (tested inline: this runs on every replay, §9.9)
            _check(rc, "cuGraphLaunch")

    def _destroy(self) -> None:
        st = _state
        if st is None:
            return
        if self._exec is not None:
            st.lib.cuGraphExecDestroy(self._exec)
            self._exec = None
        if self._graph is not None:
            st.lib.cuGraphDestroy(self._graph)
            self._graph = None

    def __del__(self):
        try:
            self._destroy()
        except Exception:  # noqa: BLE001
            pass


# ---- §9.7 Tensor storage on the device (what stax.tensor keeps for device="cuda") ----

def interpreting() -> bool:
    """TRITON_INTERPRET=1: "cuda" tensors live in host memory and kernels run in Triton's interpreter.

    This is how CI, which has no GPU, runs every generated Triton kernel against numpy.
    """
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_device(device: str) -> str:
    """Normalize 'cuda' / 'cuda:0'; raise the clear no-GPU error when it cannot be used."""
    dev = str(device)
    if dev not in ("cuda", "cuda:0"):
        raise RuntimeError(f"unknown device '{dev}': Stax knows 'cpu' and 'cuda' (device 0)")
    if not interpreting():
        init()       # raises CudaUnavailableError with the reason when there is no GPU
    return "cuda"


class DeviceArray:
    """A flat array of `count` elements of numpy dtype `dtype` on the device.

    On a GPU it owns a DeviceBuffer from the caching allocator; under the Triton interpreter it
    owns host memory (a numpy array), which the interpreter reads and writes directly.
    """

    GUARD = 256      # elements of guard zone on each side of an interpreted array

    def __init__(self, count: int, dtype):
        import numpy as np
        self.count, self.dtype = count, dtype          # a numpy dtype
        if interpreting():
            # guard zones around the array: a kernel that writes outside it is caught after launch
            g = self.GUARD
            self._guarded = np.empty(count + 2 * g, dtype)
            self._guarded.view(np.uint8)[:] = 0xA5
            _INTERPRETED.track(self._guarded, count * dtype.itemsize)
            self.host_array, self.buffer = self._guarded[g:g + count], None
            self.ptr = self.host_array.ctypes.data
        else:
            self.host_array, self.buffer = None, allocate(max(1, count * dtype.itemsize))
            self.ptr = self.buffer.ptr      # a plain attribute: read on every launch (host time)

    def guards_intact(self) -> bool:
        """Under the interpreter: whether both guard zones still hold their fill pattern."""
        import numpy as np
        g = self.GUARD
        raw = self._guarded.view(np.uint8)
        n = g * self.dtype.itemsize
        return bool((raw[:n] == 0xA5).all() and (raw[len(raw) - n:] == 0xA5).all())

    def upload(self, array) -> "DeviceArray":
        import numpy as np
        array = np.ascontiguousarray(array, dtype=self.dtype).reshape(-1)
        if self.buffer is None:
            self.host_array[...] = array
        elif array.size:
            copy_host_to_device(self.buffer, array)
        return self

    def host(self):
        """A host copy of the whole array (waits for queued kernels first)."""
        import numpy as np
        if self.buffer is None:
            return self.host_array.copy()
        out = np.empty(self.count, self.dtype)
        if self.count:
            copy_device_to_host(out, self.buffer)
        return out


class device:
    """`with stax.cuda.device(0):` in a wrapper (Listing 9.6): Stax drives device 0 only."""

    def __init__(self, index: int = 0):
        if index != 0:
            raise RuntimeError("Stax drives one GPU (device 0)")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
