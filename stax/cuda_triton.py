"""stax.cuda_triton -- Triton cubins compiled, loaded and launched through the CUDA driver.

Layer: bottom, one above cuda.py (imports only ``stax.cuda``). Chapter: docs/DESIGN.md "Runtime";
Listing 9.6's launches; §9.6 (the launch path whose host cost the measurements include).
cuda.py binds the driver and knows nothing of Triton; this module builds on it with what follows
Triton's conventions. triton_heuristics.py (the launch-time kernel class) is its caller.

What it consumes / produces
  * consumes: a ``@triton.jit`` function and its signature (``compile_triton`` wraps
    ``triton.compile`` for a target with no GPU present), cubins, grids and arguments in Triton's
    signature spelling (``"*fp32"``, ``"i32"``);
  * produces: ``Kernel`` / ``Launcher`` (a loaded cubin function plus a launch path whose argument
    array is built once), ``TritonKernelInfo``.

Rules kept here
  * importing this module imports neither triton nor the driver (``compile_triton`` imports triton).
  * Triton >= 3.5 kernels take trailing scratch pointers (global_scratch, profile_scratch) after the
    user arguments; ``Launcher`` passes NULL when the metadata's size is 0, otherwise a buffer of
    ``size * grid programs * num_ctas`` bytes (Triton's own launcher rule), kept by the launcher.
  * the driver's state is read through the module, ``cuda._state``, never copied: it appears at
    the first use (and tests stand a fake one in).

Where to look: ``Launcher.launch`` and ``Launcher.launch_ints`` (the hot path),
``compile_triton`` / ``launcher_for_triton``, ``warm_compiler`` (triton's setup, started early); tests/test_cuda.py, bench/cuda_runtime_check.py.
"""
from __future__ import annotations

import dataclasses
import struct

from . import cuda

__all__ = ["Kernel", "Launcher", "load_kernel", "TritonKernelInfo", "compile_triton",
           "launcher_for_triton"]

# ---- §9.7 Modules and launch (Listing 9.6's `.run`) ----

# Triton signature spelling -> (struct code for one 8-byte slot, is pointer)
_ARG_CODES = {
    "i1": "i4x", "i8": "i4x", "i16": "i4x", "i32": "i4x",
    "u1": "I4x", "u8": "I4x", "u16": "I4x", "u32": "I4x",
    "i64": "q", "u64": "Q",
    "fp16": "f4x", "bf16": "f4x", "fp32": "f4x", "f32": "f4x",
    "fp64": "d",
}


def _arg_code(ty: str) -> str:
    if ty.startswith("*"):
        return "Q"
    try:
        return _ARG_CODES[ty]
    except KeyError:
        raise ValueError(f"unsupported kernel argument type {ty!r} (pointer '*fp32', 'i32', 'i64', "
                         f"'fp32', 'fp64', ...)") from None


class Kernel:
    """One function of a loaded cubin. ``launch(grid, args, signature)`` launches it."""

    def __init__(self, module, function, name: str, shared_mem: int, num_warps: int, cubin: bytes):
        st = cuda._state
        self.module, self.function, self.name = module, function, name
        self.shared_mem, self.num_warps = int(shared_mem), int(num_warps)
        self._cubin = cubin          # keep the image alive with the module
        self._launchers: dict = {}
        v = st.ffi.new("int*")

        def fattr(a):
            cuda._check(st.lib.cuFuncGetAttribute(v, a, function), "cuFuncGetAttribute",
                        f"{name}, {a}")
            return v[0]

        self.num_regs = fattr(cuda.CU_FUNC_ATTRIBUTE_NUM_REGS)
        self.local_size_bytes = fattr(cuda.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
        self.static_shared_bytes = fattr(cuda.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
        self.max_threads_per_block = fattr(cuda.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)

    def launcher(self, signature, **kw) -> "Launcher":
        return Launcher(self, signature, **kw)

    def launch(self, grid, args, signature, **kw) -> None:
        """Launch with a Launcher cached per signature (kw: Launcher's scratch options).

        For the lowest host cost keep the Launcher (``kernel.launcher(signature)``) and call it."""
        key = tuple(signature.values()) if isinstance(signature, dict) else tuple(signature)
        lz = self._launchers.get(key)
        if lz is None:
            lz = self._launchers[key] = Launcher(self, list(key), **kw)
        lz.launch(grid, args)

    def __repr__(self):
        return (f"Kernel({self.name!r}, num_warps={self.num_warps}, shared_mem={self.shared_mem}, "
                f"regs={self.num_regs})")


def load_kernel(cubin: bytes, name: str, shared_mem: int = 0, num_warps: int = 4) -> Kernel:
    """cuModuleLoadData + cuModuleGetFunction; raises the dynamic shared-memory limit past 48 KiB."""
    st = cuda.init()
    cuda._ctx_current()
    ffi, lib = st.ffi, st.lib
    image = ffi.from_buffer(cubin) if not isinstance(cubin, str) else ffi.new("char[]", cubin.encode())
    mod = ffi.new("CUmodule*")
    cuda._check(lib.cuModuleLoadData(mod, image), "cuModuleLoadData", f"{len(cubin)} bytes, {name}")
    fn = ffi.new("CUfunction*")
    cuda._check(lib.cuModuleGetFunction(fn, mod[0], name.encode()), "cuModuleGetFunction", name)
    if shared_mem > 49152:
        optin = cuda.get_device_properties().max_shared_memory_per_block_optin
        v = ffi.new("int*")
        cuda._check(lib.cuFuncGetAttribute(v, cuda.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn[0]),
                    "cuFuncGetAttribute", name)
        if shared_mem + v[0] > optin:
            raise ValueError(f"kernel {name} needs {shared_mem} B of dynamic shared memory (+{v[0]} "
                             f"static); the device allows {optin} B per block")
        # Triton's rule: allow everything the block may opt into, minus the static part.
        cuda._check(lib.cuFuncSetAttribute(fn[0], cuda.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                           optin - v[0]),
                    "cuFuncSetAttribute", f"{name}, MAX_DYNAMIC_SHARED_SIZE_BYTES={optin - v[0]}")
    return Kernel(mod[0], fn[0], name, shared_mem, num_warps, cubin)


class Launcher:
    """Launch path for one kernel and one argument signature, built once.

    ``signature``: Triton's spelling per parameter, e.g. ``["*fp32", "*fp32", "i32"]``
    ("constexpr" entries, or a dict's values, are accepted and dropped). The void*[] parameter array
    and one 8-byte slot per parameter are allocated once; ``launch`` packs the values into the slots
    with one ``struct.pack_into`` and calls cuLaunchKernel. ``num_scratch_params`` trailing pointer
    parameters follow the user's (Triton 3.5+: global_scratch, profile_scratch); each is NULL when its
    size is 0, otherwise a buffer of ``size * gridX*gridY*gridZ * num_ctas`` bytes owned by the
    launcher (grown when a larger grid needs it; fine for graph capture since it is never freed while
    the launcher lives).
    """

    def __init__(self, kernel: Kernel, signature, *, num_scratch_params: int = 0,
                 global_scratch_size: int = 0, global_scratch_align: int = 1,
                 profile_scratch_size: int = 0, profile_scratch_align: int = 1,
                 num_ctas: int = 1, stream: cuda.Stream | None = None):
        st = cuda.init()
        ffi = st.ffi
        if isinstance(signature, dict):
            signature = list(signature.values())
        sig = [s for s in signature if s != "constexpr"]
        if num_ctas != 1:
            raise NotImplementedError("num_ctas > 1 (thread-block clusters) is not supported")
        self.kernel = kernel
        self.signature = sig
        self.nargs = len(sig)
        self._ptr_idx = tuple(i for i, s in enumerate(sig) if s.startswith("*"))
        nparams = self.nargs + num_scratch_params
        self._buf = ffi.new("char[]", 8 * max(nparams, 1))     # 8-byte aligned slots
        self._params = ffi.new("void*[]", max(nparams, 1))
        for i in range(nparams):
            self._params[i] = self._buf + 8 * i
        self._pack_into = struct.Struct("<" + "".join(_arg_code(s) for s in sig)).pack_into
        self._mem = ffi.buffer(self._buf)
        self._func = kernel.function
        self._block = 32 * kernel.num_warps
        self._shared = kernel.shared_mem
        self._stream = (stream or st.stream).handle
        self._call = st.lib.cuLaunchKernel
        self._null = ffi.NULL
        # scratch: (slot index, bytes per program, buffer or None)
        self._scratch = []
        sizes = [global_scratch_size, profile_scratch_size][:num_scratch_params]
        for j in range(num_scratch_params):
            size = sizes[j] if j < len(sizes) else 0
            struct.pack_into("<Q", self._mem, 8 * (self.nargs + j), 0)
            if size:
                self._scratch.append([self.nargs + j, int(size) * num_ctas, None])

    def _ensure_scratch(self, programs: int) -> None:
        for ent in self._scratch:
            need = ent[1] * programs
            buf = ent[2]
            if buf is None or buf.nbytes < need:
                ent[2] = buf = cuda.allocate(need)
                struct.pack_into("<Q", self._mem, 8 * ent[0], buf.ptr)

    def launch(self, grid, args) -> None:
        """Queue one launch on the launcher's stream. grid: int or tuple of 1-3 ints."""
        if grid.__class__ is tuple and len(grid) == 3:
            gx, gy, gz = grid
        elif isinstance(grid, int):
            gx, gy, gz = grid, 1, 1
        else:
            g = tuple(grid) + (1, 1)
            gx, gy, gz = g[0], g[1], g[2]
        if self._ptr_idx:
            args = list(args)
            for i in self._ptr_idx:
                a = args[i]
                if a.__class__ is not int:
                    args[i] = 0 if a is None else a.ptr
        try:
            self._pack_into(self._mem, 0, *args)
        except struct.error as e:
            raise TypeError(f"{self.kernel.name}: arguments {list(args)!r} do not match the "
                            f"signature {self.signature}: {e}") from None
        if self._scratch:
            self._ensure_scratch(gx * gy * gz)
        if gx * gy * gz == 0:
            return
        rc = self._call(self._func, gx, gy, gz, self._block, 1, 1, self._shared, self._stream,
                        self._params, self._null)
        if rc:
            cuda._check(rc, "cuLaunchKernel", f"{self.kernel.name}, grid=({gx}, {gy}, {gz}), "
                                              f"block={self._block}, shared={self._shared}")

    __call__ = launch

    def launch_ints(self, grid: tuple, args: list) -> None:
        """The hot path (`triton_heuristics.CachingAutotuner.run`): `grid` three positive ints, `args` plain ints that
        already matched the signature in an earlier `launch`."""
        self._pack_into(self._mem, 0, *args)
        if self._scratch:
            self._ensure_scratch(grid[0] * grid[1] * grid[2])
        rc = self._call(self._func, grid[0], grid[1], grid[2], self._block, 1, 1, self._shared,
                        self._stream, self._params, self._null)
        if rc:
            cuda._check(rc, "cuLaunchKernel", f"{self.kernel.name}, grid={grid}")


# ---- §9.7 Triton compile helper (no GPU needed) ----

@dataclasses.dataclass(frozen=True)
class TritonKernelInfo:
    """What a launch needs from Triton's compiled metadata (plain values: cacheable as JSON)."""
    name: str
    num_warps: int
    num_stages: int
    shared: int
    num_ctas: int = 1
    global_scratch_size: int = 0
    global_scratch_align: int = 1
    profile_scratch_size: int = 0
    profile_scratch_align: int = 1
    num_scratch_params: int = 2      # trailing pointer params of the PTX entry after user args
    num_user_params: int = 0
    launch_cooperative_grid: bool = False
    launch_pdl: bool = False
    triton_version: str = ""
    arch: str = ""


def _ptx_entry_param_count(ptx: str, name: str) -> int | None:
    i = ptx.find(f".entry {name}(")
    if i < 0:
        return None
    j = ptx.find(")", i)
    return ptx[i:j].count(".param")


_warming: list = []      # the thread of `warm_compiler`, while it runs


def warm_compiler() -> None:
    """Start Triton's once-per-process compile setup on a background thread: importing triton and
    its cache key (`triton_key`, a sha256 of its own files and of the 500 MB libtriton.so: 0.4 s
    on the H200's host, 0.9 s here, with the GIL released while it hashes), so that it overlaps
    the lowering and printing of the kernels instead of delaying the first compile (issue 14).
    Called where a compile is about to come: a CUDA graph missed the artifact cache."""
    if _warming or cuda.interpreting():
        return
    import threading

    def setup():
        try:
            from triton.runtime.cache import triton_key
            triton_key()
        except Exception:     # (an older triton without it, or none: compile_triton will say)
            pass
    thread = threading.Thread(target=setup, name="stax-triton-setup", daemon=True)
    _warming.append(thread)
    thread.start()


def compile_triton(fn, signature: dict, constexprs: dict | None = None, num_warps: int = 4,
                   num_stages: int = 3, cc: int = 90, attrs: dict | None = None):
    """Compile a @triton.jit function for sm_{cc} without a GPU.

    signature: {arg name: "*fp32" | "i32" | ... | "constexpr"}; constexprs: {arg name: value};
    attrs: {(argument index,): [["tt.divisibility", 16]]} for arguments known to be aligned.
    Returns (cubin bytes, TritonKernelInfo, kernel name).
    """
    if _warming:
        _warming[0].join()    # (triton_key's cache is no lock: it would hash a second time)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    constexprs = dict(constexprs or {})
    sig = dict(signature)
    for k in constexprs:
        sig.setdefault(k, "constexpr")
    try:
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    except TypeError:  # older spelling
        src = ASTSource(fn=fn, signature=sig, constants=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if "tl.device_assert" in getattr(fn, "src", ""):
        options["debug"] = True     # the asserts of STAX_DEBUG_INDEX=1 (Triton drops them otherwise)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    md = compiled.metadata
    name = md.name
    n_user = sum(1 for v in sig.values() if v != "constexpr")
    n_entry = _ptx_entry_param_count(compiled.asm.get("ptx", ""), name)
    n_scratch = (n_entry - n_user) if n_entry is not None else 2
    if not 0 <= n_scratch <= 2:
        raise RuntimeError(f"Triton kernel {name}: PTX entry declares {n_entry} parameters for "
                           f"{n_user} user arguments; cannot place the scratch arguments")
    info = TritonKernelInfo(
        name=name, num_warps=int(md.num_warps), num_stages=int(getattr(md, "num_stages", num_stages)),
        shared=int(md.shared), num_ctas=int(getattr(md, "num_ctas", 1)),
        global_scratch_size=int(getattr(md, "global_scratch_size", 0) or 0),
        global_scratch_align=int(getattr(md, "global_scratch_align", 1) or 1),
        profile_scratch_size=int(getattr(md, "profile_scratch_size", 0) or 0),
        profile_scratch_align=int(getattr(md, "profile_scratch_align", 1) or 1),
        num_scratch_params=n_scratch, num_user_params=n_user,
        launch_cooperative_grid=bool(getattr(md, "launch_cooperative_grid", False)),
        launch_pdl=bool(getattr(md, "launch_pdl", False)),
        triton_version=str(getattr(triton, "__version__", "")), arch=str(getattr(md, "arch", "")))
    return compiled.asm["cubin"], info, name


def launcher_for_triton(cubin: bytes, info: TritonKernelInfo, signature,
                        stream: cuda.Stream | None = None) -> Launcher:
    """Load a cubin from compile_triton and build its Launcher (scratch parameters included)."""
    if info.launch_cooperative_grid or info.launch_pdl:
        raise NotImplementedError(f"{info.name}: cooperative / PDL launches are not supported")
    k = load_kernel(cubin, info.name, info.shared, info.num_warps)
    return Launcher(k, signature, num_scratch_params=info.num_scratch_params,
                    global_scratch_size=info.global_scratch_size,
                    global_scratch_align=info.global_scratch_align,
                    profile_scratch_size=info.profile_scratch_size,
                    profile_scratch_align=info.profile_scratch_align,
                    num_ctas=info.num_ctas, stream=stream)
