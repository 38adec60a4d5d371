"""§9.9 CUDA graphs, the replay of the same tensors in C (issue 13: host µs per replay).

Layer: runtime, under cudagraph.py (its replays) and `stax/__init__.py` (`install_entry`). Imports
`cache` (the cache folder, the compiler run, the library's recorded hash) and `cuda` (the driver's
function addresses); it knows nothing of recordings or compiled functions: its callers hand it
every object the C code touches.

`GraphedCall.replayer`'s generated Python replay of a call with the last call's very tensors, and
`CompiledFunction.__call__` around it, cost ~1.7 µs of Python (fake driver, a dev box) around the
one cuGraphLaunch (~3.4 µs on the H200 host, which runs the same Python ~2x slower). The C
`Replay` here does the same steps for the same cases and returns the same values (the outputs
tuple; False: other tensors, or one that requires grad under grad mode; None: the recording
changed, or the replay failed and the graph is broken now):
  1. the argument count and one `is` per tensor; under grad mode requires_grad read from each
     tensor's own __dict__ (a value other than True/False: the Python replay decides), skipped
     on 3.11/3.12 for a dict whose version tag (PEP 509) is the one it had when last read False;
  2. the GraphedCall's lock: its PyThread lock tried without blocking (for a `_thread.lock` of
     the layout `make` checked), else its `acquire()`, which waits with the GIL released;
     `GraphOutputArray.host` holds the same lock across its check and copy;
  3. `rec.again is token`, read from the recording's __dict__;
  4. the staged copies and the launch: raw driver calls (cuMemcpyDtoDAsync_v2, cuGraphLaunch
     through their addresses in the cffi library, the GIL released around each as cffi does;
     `cuda.init` once per thread first, which makes the context current) or, for a fake
     driver, its Python callables; a failure calls `fail(err, i)` (err: the CUresult or the
     exception; i: the copy's index, -1 the launch), which reports it and breaks the graph, and
     the replay returns None, as the Python replay does;
  5. `cell.value += 1`, then the outputs: for one output over one graph-owned buffer the
     GraphOutputArray, Storage and Tensor made without __init__ with `Recording.outputs`'s
     fields (slots written at their offsets, dict attributes set in the same order), else
     `rec.outputs(cell)` itself.
Arguments neither a tuple nor a list go to the Python replay (`python`), unchanged.
`install_entry` puts an `Entry` in CompiledFunction.__call__'s place: the hot branch's checks
and the replay without the Python frame; any other call runs the Python __call__ it keeps.

The extension is compiled at run time (as Triton builds its launchers) with the host's C compiler
($CC, else gcc, cc, clang) against `sysconfig.get_paths()['include']`, cached in
`<cache>/cpp/replay-<key>.so` (key: the source, the Python version and ABI, the compiler) with its
sha256 recorded beside it (cache.py's rule for libraries), and loaded with importlib. No compiler,
no Python.h, a failed build, or STAX_CUDAGRAPH_C=0: `unavailable()` says why, and cudagraph.py
uses the Python replay (logged once under STAX_LOGS=cudagraphs).

Where to look: `make_replay` (what the C replay is given), `raw_launch`/`raw_copy` (the driver's
addresses), `install_entry` (CompiledFunction.__call__'s hot branch in C), `module`/`_build`
(compile and load); cudagraph_replay.c: `replay` is the hot path, `entry_call` the entry,
`stub_*` C functions with the driver's signatures for tests and bench/host_path.py (no GPU).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

from . import cache, cuda

SOURCE = Path(__file__).with_name("cudagraph_replay.c")      # (package data, as cpp_prelude.h)

def source() -> str:
    """The extension's C source."""
    return SOURCE.read_text()


_STATE: dict = {}           # "module" / "why": the outcome of the one build per process
_LOCK = threading.Lock()
CFLAGS = ["-O2", "-shared", "-fPIC", "-fno-strict-aliasing"]


def _compiler() -> str | None:
    for name in [os.environ.get("CC", "").split()[0] if os.environ.get("CC", "").strip() else None,
                 "gcc", "cc", "clang"]:
        found = name and shutil.which(name)
        if found:
            return found
    return None


def _build():
    """(module, None) or (None, why)."""
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.exists(os.path.join(include, "Python.h")):
        return None, f"no Python.h under {include!r} (install the Python development headers)"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler ($CC, gcc, cc, clang)"
    text = source()
    key = cache.content_hash(text, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", cc,
                             " ".join(CFLAGS), include)
    so = cache.folder("cpp") / f"replay-{key}.so"
    if not cache._verified_library(so):                  # (cache.py's load path for libraries)
        kept = cache.atomic_write(so.with_suffix(".c"), text)
        with cache._work_dir() as work:
            src, out = Path(work) / "replay.c", Path(work) / "replay.so"
            src.write_text(text)
            rc, log = cache._run_compiler([cc, *CFLAGS, f"-I{include}", str(src), "-o", str(out)])
            if rc != 0 or not out.exists():
                lines = log.replace(str(src), str(kept)).splitlines()
                return None, f"{cc} failed (exit {rc}): " + " | ".join(lines[:3])
            cache._store_library(so, out.read_bytes())
    spec = importlib.util.spec_from_file_location("stax_replay", str(so))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, None


def module():
    """The compiled extension (built or loaded once per process), or None: `unavailable()`."""
    if os.environ.get("STAX_CUDAGRAPH_C", "1") == "0":
        return None
    if "why" not in _STATE:
        with _LOCK:
            if "why" not in _STATE:
                try:
                    mod, why = _build()
                except Exception as e:  # noqa: BLE001 -- any failure: the Python replay serves
                    mod, why = None, f"{type(e).__name__}: {e}"
                _STATE["module"], _STATE["why"] = mod, why
    return _STATE["module"]


def unavailable() -> str | None:
    """Why the replay runs in Python (None: the C replay serves)."""
    if os.environ.get("STAX_CUDAGRAPH_C", "1") == "0":
        return "STAX_CUDAGRAPH_C=0"
    return None if module() is not None else _STATE["why"]


def _address(name: str) -> int:
    st = cuda._state
    return int(st.ffi.cast("uintptr_t", st.ffi.addressof(st.lib, name)))


def raw_launch(graph):
    """(cuGraphLaunch's address, the graph exec, the stream, graph) for a recorded cuda.CUDAGraph;
    a test graph's `raw_launch()`; None: call the graph's `replay`."""
    if graph.__class__ is cuda.CUDAGraph:
        st = cuda._state
        if st is None or graph._exec is None:
            return None
        ffi = st.ffi
        return (_address("cuGraphLaunch"), int(ffi.cast("uintptr_t", graph._exec)),
                int(ffi.cast("uintptr_t", st.stream.handle)), graph)
    raw = getattr(graph, "raw_launch", None)
    return raw() if raw is not None else None


def raw_copy():
    """(cuMemcpyDtoDAsync_v2's address, the stream) of the driver now, for CudaDriver's copies."""
    st = cuda._state
    if st is None:
        return None
    return _address("cuMemcpyDtoDAsync_v2"), int(st.ffi.cast("uintptr_t", st.stream.handle))


_ENTRIES: dict = {}         # class -> its Python __call__, while `install_entry` has replaced it


def install_entry(cls, tls, precision, mode, last_type) -> None:
    """`cls.__call__` (CompiledFunction's) with its hot branch in C, once the extension is loaded
    (never built here): the same checks (`tls.tracer`, `precision[0]`, `mode.enabled`, the
    instance's `_fast` a `last_type` whose `hot` is a C Replay), the replay, the count and the
    result; every other call runs the Python `__call__` itself, which it keeps."""
    mod = _STATE.get("module")
    if mod is None or cls in _ENTRIES or os.environ.get("STAX_CUDAGRAPH_C", "1") == "0":
        return
    python = cls.__dict__["__call__"]
    _ENTRIES[cls] = python
    cls.__call__ = mod.entry(python, tls, precision, mode, last_type)


def remove_entry(cls) -> None:
    """`cls.__call__` back to its Python self (tests)."""
    python = _ENTRIES.pop(cls, None)
    if python is not None:
        cls.__call__ = python


@contextlib.contextmanager
def python_entry(cls):
    """`cls.__call__` its Python self inside the block, the entry again after (bench/host_path.py:
    the call as it is without the extension)."""
    entry, python = cls.__dict__["__call__"], _ENTRIES.get(cls)
    remove_entry(cls)
    try:
        yield
    finally:
        if python is not None:
            _ENTRIES[cls] = python
            cls.__call__ = entry


def driver_error(rc: int, copy=None) -> Exception:
    """The CudaError the Python call raises for CUresult `rc` of cuGraphLaunch, or of the copy
    (dst, src, nbytes) (cuda.copy_device_to_device's message)."""
    call, detail = ("cuGraphLaunch", "") if copy is None else \
        ("cuMemcpyDtoDAsync_v2", f"0x{copy[0]:x}, 0x{copy[1]:x}, {copy[2]} bytes")
    if cuda._state is None:         # (a test's stubs: no driver to name the error)
        return cuda.CudaError(rc, f"CUDA_ERROR_{rc}", call, detail)
    try:
        cuda._check(rc, call, detail)
    except cuda.CudaError as e:
        return e
    return cuda.CudaError(rc, f"CUDA_ERROR_{rc}", call, detail)


def make_replay(mod, *, python, tensors, rec, token, lock, cell, launch, copies, counted, copy, counts,
                single, outputs, types, fail, init):
    """The C replay (see the module docstring) of `tensors` under `token`, in `mod`.

    python: the generated Python replay of the same (for arguments neither tuple nor list);
    rec: the Recording (its `again` read from its __dict__); lock: the GraphedCall's (its
    PyThread lock taken directly when it is a `_thread.lock` of the known layout);
    cell: its _Generation; launch: `raw_launch`'s tuple or the graph's `replay`;
    copies: the token's non-empty copies, or None when it has none; counted: how many copies the
    token has, the empty ones too (each replay adds them to counts["copies"], as the Python one);
    copy: `raw_copy`'s tuple or the driver's `copy(dst, src, nbytes)`;
    single: (buffer, meta) of the one output over one graph-owned buffer, or None: `outputs(cell)`;
    types: (GraphOutputArray, Storage, Tensor); fail(err, i): a failed copy (i) or launch (-1);
    init: called once per thread before the first raw driver call (cuda.init), or None."""
    tensors = tuple(tensors)
    return mod.make(python, tensors, tuple([t.__dict__ for t in tensors]), rec.__dict__, token, lock, cell,
                    launch, copies, copy, counts, counted, single, outputs, types, fail, init)
