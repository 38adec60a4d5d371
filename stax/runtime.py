"""Runtime: loading generated modules, and the names a generated wrapper calls (docs/DESIGN.md "Runtime").

Layer: back end, the top (above both code generators; only `stax/__init__.py` and `__main__` sit
higher). It imports `cache` (and its `storage_ctype`), `cuda`, the tensor runtime (`tensor`),
capture's `ValuesChanged` and,
lazily for GPU modules, `triton_heuristics`. It never imports a code generator: a warm start
loads a module from the artifact cache without them.

Consumes what a code generator produced (a `codegen_cpp.CppModule`: the C++ source with its cffi
declarations and the wrapper's Python source; a `codegen_triton.TritonModule`: the module text; or
either read back from the artifact cache); produces the wrapper's `call(args)`, ready to run. It
also keeps §11.1's artifact cache: the generated module of a captured graph, stored on disk, so a
new process that captures the same graph loads it without lowering again. Nothing here imports
sympy or triton: a warm start pays only for capture, a hash and a dlopen.

Where to look:
  - `load_module` ............................... the entry: a generated module → `call`
  - `load_cpu_module`, `load_gpu_module` ........ compile/dlopen, write the wrapper to a file, import it
  - `cpu_wrapper_globals`, `gpu_wrapper_globals`  ptr(), empty(), assert_size_stride(), extern_kernel(),
    reinterpret_tensor(), reshaped_output()
  - `AsyncCompile` .............................. Listing 9.6's `async_compile`: kernel handles
    (compiled at first launch), carrying `stax.compile`'s mode and options to each kernel
  - `artifact_path`, `save_artifact`, `load_artifact`  §11.1 across processes: a record sealed with
    its sha256 and checked for structure when read back; a bad one is logged, removed, regenerated
  - `guard_values` .............................. §9.10 an artifact specialized on tensors' values
    (a mask found causal): checked on each call; write-backs counted as writes (versions)
  - `_exec_wrapper` ............................. runs the wrapper's text itself (cache.exec_source),
    never the file mirrored beside it in `<cache>/py`
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

from . import cache, cublas, cuda, memory
from .cache import storage_ctype
from .capture import ValuesChanged
from .dtypes import DTYPES
from .tensor import Meta, Storage, Tensor, _contig, _meta, _numel, _run_eager, get_num_threads

# ---- §9.7 The helpers every wrapper calls ----


def assert_size_stride(t, shape, stride, what="input"):
    """The wrapper's first check (Listing 9.6): the layout the code was generated for."""
    if t._meta.shape != shape or t._meta.stride != stride:
        raise AssertionError(f"{what}: expected size {shape} and stride {stride}, got size "
                             f"{tuple(t.shape)} and stride {tuple(t.stride())}")


def reinterpret_tensor(t, shape, stride, offset):
    """A view of `t`'s storage with the given layout (an extern kernel's input, no copy)."""
    return Tensor._make(t._storage, Meta(tuple(shape), tuple(stride), t.dtype, t.device,
                                             t._meta.offset + offset), base=t)


def reshaped_output(t, shape):
    """A graph output that is all of buffer `t` under another shape (contiguous both): a tensor of
    its own over the same memory, not a view (the wrapper drops `t` itself)."""
    return Tensor._make(t._storage, Meta(tuple(shape), _contig(tuple(shape)), t.dtype, t.device, t._meta.offset))


def extern_kernel(op, inputs, params, dtype, device="cpu"):
    """§6.1 fallback: the eager implementation of `op` (on the host); the result is contiguous."""
    return _run_eager(op, inputs, params, [Meta((), (), dtype, device)])[0]


def _exec_wrapper(source: str, stem: str, names: dict):
    """Run a generated module (its text, checked or freshly generated; the file written beside it
    in the cache is only a mirror for tracebacks) and return its `call`."""
    return cache.exec_source("py", stem, source, names).call


# ---- §8 CPU: C++ kernels through cffi ----


def cpu_wrapper_globals(ffi, lib) -> dict:
    """kernels (the dlopen'ed library), ptr(), empty(), the dtypes, and a thread-count prologue."""
    casts = {d: f"{storage_ctype(d)}[]" for d in DTYPES.values()}
    threads = [None]

    def ptr(t):
        return ffi.from_buffer(casts[t.dtype], t._storage.data) + t._meta.offset

    def launch_prologue():
        if threads[0] != get_num_threads():
            lib.stax_set_num_threads(get_num_threads())
            threads[0] = get_num_threads()

    def empty(shape, dtype):   # from the host caching allocator (memory.py): steady large outputs
        return Tensor._make(Storage(memory.empty(_numel(shape), dtype.np)), _meta(shape, dtype))

    names = {"kernels": lib, "ptr": ptr, "empty": empty, "assert_size_stride": assert_size_stride,
             "extern_kernel": extern_kernel, "launch_prologue": launch_prologue,
             "reinterpret_tensor": reinterpret_tensor, "reshaped_output": reshaped_output, "NULL": ffi.NULL}
    names.update({d.name: d for d in DTYPES.values()})
    return names


def load_cpu_module(source: str, cdefs: list, wrapper: str):
    """Compile the C++ file (or find it in the cache), dlopen it, import the wrapper; return `call`."""
    # OpenMP workers that spin long after a kernel steal the cores a BLAS call (the matmul
    # fallback) needs: 2048³ relu(a @ b + c) took 127 ms spinning, 87 ms (numpy's time) with this
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    ffi, lib = cache.load_cpp(source, "\n".join(cdefs + ["void stax_set_num_threads(int n);"]))
    return _exec_wrapper(wrapper, "wrapper", cpu_wrapper_globals(ffi, lib))


# ---- §9.7 GPU: Triton kernels through the CUDA driver ----


class AsyncCompile:
    """Listing 9.6's `async_compile`: `async_compile.triton(name, source)` is a kernel handle whose
    code is compiled at first launch. Each handle gets the `mode` and `options` of `stax.compile`
    (mode="max-autotune" searches past the candidates, options={"autotune": False} measures nothing)."""

    def __init__(self, mode=None, options=None):
        self.mode, self.options = mode, dict(options or {})

    def triton(self, name, source, device_str="cuda"):
        from .triton_heuristics import kernel_from_source
        kernel = kernel_from_source(name, source)
        kernel.mode, kernel.options = self.mode, self.options
        return kernel

    def multi_kernel(self, name, kernels):
        """Alternative kernels for one group; the first launch measures and keeps the faster."""
        from .triton_heuristics import MultiKernel
        return MultiKernel(name, kernels)

    def mm_choice(self, name, key):
        """§9.8: the Triton template or cuBLASLt for one GEMM; the first call measures both."""
        return cublas.MatmulChoice(name, key, self.options)


def gpu_wrapper_globals(mode=None, options=None) -> dict:
    # the names the wrapper text spells `stax.cuda.device(0)` and `stax.float32` (Listing 9.6's
    # `tp.`): a namespace of this layer's modules, not the package, whose __init__ sits above us
    stax = SimpleNamespace(cuda=cuda, **DTYPES)

    def empty_strided_cuda(shape, stride, dtype):
        numel = 1
        for s in shape:
            numel *= s
        storage = Storage(cuda.DeviceArray(numel, dtype.np), "cuda")
        return Tensor._make(storage, Meta(shape, stride, dtype, "cuda", 0))

    counters = {}                # §6.5: a one-kernel split's counters, this artifact's own

    def zeroed_workspace_cuda(name, numel):
        """int32 counters zeroed once, when first allocated (or outgrown by a larger size), and kept:
        every launch leaves them 0 again (triton_helpers.last_arrival), so no call zeroes them.
        Outgrown ones stay allocated too: a CUDA graph recorded at a smaller size replays on them."""
        held = counters.setdefault(name, [])
        if not held or held[-1].shape[0] < numel:
            import numpy as np
            n = max(1, numel)
            array = cuda.DeviceArray(n, np.dtype(np.int32)).upload(np.zeros(n, np.int32))
            held.append(Tensor._make(Storage(array, "cuda"), Meta((n,), (1,), DTYPES["int32"], "cuda", 0)))
        return held[-1]

    def get_raw_stream(index):
        return None            # one stream per process (stax.cuda's default stream)

    def gpu_extern_kernel(op, inputs, params, dtype):
        return extern_kernel(op, inputs, params, dtype, "cuda")     # through the host, back on the GPU

    # (the dtypes by bare name too: a fallback's parameters spell them so, `'dtype': float32`)
    return {"stax": stax, "assert_size_stride": assert_size_stride,
            "async_compile": AsyncCompile(mode, options),
            "empty_strided_cuda": empty_strided_cuda, "get_raw_stream": get_raw_stream,
            "zeroed_workspace_cuda": zeroed_workspace_cuda,
            "extern_kernels": SimpleNamespace(mm=cublas.mm),     # §9.8 cuBLASLt (when installed)
            "extern_kernel": gpu_extern_kernel, "reinterpret_tensor": reinterpret_tensor,
            "reshaped_output": reshaped_output, **DTYPES}


def load_gpu_module(source: str, mode=None, options=None):
    """Import the generated module; its kernels compile (or load cached cubins) at first launch."""
    return _exec_wrapper(source, "triton", gpu_wrapper_globals(mode, options))


def load_module(module, mode=None, options=None):
    """`call(args)` of a generated module (`codegen_cpp.CppModule`, `codegen_triton.TritonModule` or
    a `LoadedModule` from the artifact cache). `mode` and `options` reach each GPU kernel."""
    if module.kind == "triton":
        return load_gpu_module(module.source, mode, options)
    return load_cpu_module(module.source, module.cdefs, module.wrapper)


# ---- §9.10 Artifacts specialized on values: the guard around `call` ----


class GuardedCall:
    """`call(args)` that first checks the value guards (the very storage, at the version it had)
    and afterwards counts each write-back into an input as a write to it (its storage's version),
    as eager's in-place ops do: the guards of other artifacts, and autograd's saved-tensor checks,
    see compiled writes too. A CUDA graph's token calls (specialize.LastCall) are passed through."""

    def __init__(self, call, checks, writes):
        self.inner, self.checks, self.writes = call, checks, writes
        if hasattr(call, "call_with_token"):
            self.call_with_token, self.replay_again = self._call_with_token, self._replay_again

    @property
    def __globals__(self) -> dict:
        """The guarded wrapper's globals (its kernel handles), for tools that look inside an
        artifact's `call` (the report's kernel timing, bench/gpu.py)."""
        return self.inner.__globals__

    def _check(self, args):
        for pos, ref, version, why in self.checks:
            st = args[pos]._storage
            if st is not ref() or st.version != version:
                raise ValuesChanged(f"{why}; its tensor is {'another one' if st is not ref() else 'written to'} now")

    def _run(self, args, run):
        """`run()` between the checks of `args` and the version bumps of the storages its
        write-backs update (taken first: a wrapper clears `args` as it runs); a replay that did
        not happen (None) writes nothing."""
        self._check(args)
        written = [args[pos]._storage for pos in self.writes]
        outs = run()
        if outs is not None:
            for st in written:
                st.version += 1
        return outs

    def __call__(self, args):
        return self._run(args, lambda: self.inner(args))

    def _call_with_token(self, args):
        return self._run(args, lambda: self.inner.call_with_token(args))

    def _replay_again(self, token):
        return self._run(token[0], lambda: self.inner.replay_again(token))


def guard_values(call, graph):
    """`call` guarded by `graph.value_guards` and counting its `graph.mutations` (GuardedCall);
    `call` itself when the graph has neither. The call's arguments are the graph's inputs in order."""
    pos = {id(n): k for k, n in enumerate(graph.inputs)}
    checks = [(pos[id(n)], ref, version, f"the values of {n.name} changed: {why}")
              for n, (why, ref, version) in graph.value_guards.items() if id(n) in pos]
    writes = sorted({pos[id(inp)] for inp, _ in graph.mutations if id(inp) in pos})
    return GuardedCall(call, checks, writes) if checks or writes else call


# ---- §11.1 The artifact cache: a captured graph's generated module, across processes ----

_CODE_VERSION = None


def _code_version() -> str:
    """A hash of Stax's own source: an artifact made by other code is never reused."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        from pathlib import Path
        here = Path(__file__).parent
        files = sorted(here.glob("*.py")) + sorted(here.glob("*.h"))
        _CODE_VERSION = cache.content_hash(*(p.name + p.read_text() for p in files))
    return _CODE_VERSION


def artifact_path(graph, device: str, target: str):
    """Keyed by what determines the generated code: the graph (ops, parameters, dtypes, shapes),
    the inputs' strides, the size symbols' hints and bounds (§10.3: a persistent row's R0_BLOCK, a split's
    pieces are chosen at them; softmax over rows of 65536 was served the kernels chosen for rows
    of 32768), the back end's device decisions (`target`), and the compiler's source."""
    inputs = [(n.name, n.op, n.meta.dtype.name, [str(s) for s in n.meta.shape],
               [str(s) for s in n.meta.stride]) for n in graph.inputs]
    sizes = [sorted((str(s), str(v)) for s, v in (getattr(graph, what, None) or {}).items())
             for what in ("hints", "bounds")]      # (bounds: a range's upper end decides too)
    key = cache.content_hash(graph.format(), repr(inputs), repr(sizes), device, target, _code_version())
    return cache.folder("artifacts") / f"{key}.json"


def save_artifact(path, module) -> None:
    record = {"kind": module.kind, "kernels": module.kernels, "wrapper": module.wrapper, "source": module.source,
              "cdefs": getattr(module, "cdefs", [])}
    cache.write_sealed(path, json.dumps(record))     # its sha256 on the first line


def _is_record(r) -> bool:
    """The structure `save_artifact` writes (JSON holds only plain str/list/dict, so no subclass)."""
    return (isinstance(r, dict) and r.get("kind") in ("cpp", "triton")
            and isinstance(r.get("kernels"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in r["kernels"].items())
            and isinstance(r.get("wrapper"), str) and isinstance(r.get("source"), str)
            and isinstance(r.get("cdefs"), list) and all(isinstance(c, str) for c in r["cdefs"]))


class LoadedModule:
    """A generated module read back from the artifact cache (what `stax.generate` would print)."""

    def __init__(self, record: dict):
        self.kind, self.kernels, self.wrapper = record["kind"], record["kernels"], record["wrapper"]
        self.source, self.cdefs = record["source"], record["cdefs"]

    def __str__(self):
        return self.source if self.kind == "triton" else \
            "\n".join(self.kernels.values()) + "\n\n# ---- wrapper ----\n" + self.wrapper


def load_artifact(path) -> LoadedModule | None:
    """The record at `path` if it passes its hash and has the right structure, else None (the
    caller generates the module again); a bad record is logged and removed."""
    record = cache.read_sealed_json(path, _is_record, "an artifact record")
    return None if record is None else LoadedModule(record)
