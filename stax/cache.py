"""Content-addressed cache and the C++ toolchain (§11.1 content-addressed cache; §8 runtime:
compile & load).

Layer: bottom (imports no other stax module; everything that writes to disk builds on it).

Consumes: C++ kernel source text (the prelude ``cpp_prelude.h`` followed by the generated
``extern "C"`` kernels) and the C declarations of those kernels (a cffi ``cdef``).
Produces: ``(ffi, lib)``, a cffi handle on the compiled shared library, whose functions take
pointers into tensors' memory (runtime.py's ``ptr()``: ``ffi.from_buffer("float[]", data) + offset``,
typed by ``storage_ctype``).

Everything Stax writes to disk goes under ``cache_dir()`` (``$STAX_CACHE_DIR`` or
``~/.cache/stax``), named by a hash of its content (plus, for native code, the compiler's
identity: path, version, flags and host CPU), written atomically (temp file in the same folder,
then ``os.replace``), so that concurrent processes never see a half-written file and a cache
never serves a binary built for another compiler or CPU.

Where to look: ``load_cpp`` is the whole compile-and-load path; ``compiler_identity`` is what
enters every native cache key; ``CXXFLAGS`` are the flags (``STAX_CXXFLAGS`` appends more);
``<cache>/cpp/<key>.cpp`` is the exact source that was compiled, kept beside ``<key>.so``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

__all__ = [
    "cache_dir", "atomic_write", "content_hash", "clear_cache", "cxx_compiler",
    "compiler_identity", "cxx_flags", "CXXFLAGS", "CppCompileError", "load_cpp", "prelude",
    "storage_ctype",
]

# ---- §11.1 Content-addressed cache ----


def cache_dir() -> Path:
    """The cache root: ``$STAX_CACHE_DIR`` or ``~/.cache/stax``, created on demand."""
    env = os.environ.get("STAX_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "stax"
    root.mkdir(parents=True, exist_ok=True)
    return root


def atomic_write(path, data) -> Path:
    """Write ``data`` (bytes or str) to ``path`` atomically: a temp file in the same folder, then
    ``os.replace``. Readers see the old file or the whole new one, never a partial one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def content_hash(*parts: str) -> str:
    """sha256 of the parts (length-prefixed, so ("ab", "c") != ("a", "bc")), 20 hex chars."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8") if isinstance(p, str) else bytes(p)
        h.update(str(len(b)).encode() + b":")
        h.update(b)
    return h.hexdigest()[:20]


def clear_cache() -> int:
    """Remove everything under the cache dir (``python -m stax cache clear``); returns the number
    of files removed. The in-process table of loaded libraries is forgotten too."""
    root = cache_dir()
    n = 0
    for entry in list(root.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            n += sum(len(files) for _, _, files in os.walk(entry))
            shutil.rmtree(entry, ignore_errors=True)
        else:
            try:
                entry.unlink()
                n += 1
            except OSError:
                pass
    _loaded.clear()
    return n


# ---- §8 runtime: the C++ toolchain ----

# -fno-math-errno: libm results are unchanged (NaN/inf semantics intact) but sqrt needs no errno
# check, so it vectorizes. Never -ffast-math: it assumes no NaN/inf and breaks max/min, isnan, ...
# -fno-trapping-math: no result changes either (Stax never reads FP exception flags); it lets GCC
# evaluate both sides of a select, which the prelude's branch-free math needs to vectorize.
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
            "-fno-math-errno", "-fno-trapping-math"]

_NO_COMPILER = (
    "Stax needs a C++ compiler for the CPU back end: none found (looked for $CXX, g++, c++, "
    "clang++). Install one (e.g. `apt install g++`) or set CXX."
)


class CppCompileError(RuntimeError):
    """The C++ compiler rejected a generated kernel. The message holds the command, the
    numbered kernel source and the compiler's stderr."""


def cxx_compiler() -> str:
    """Path of the C++ compiler: ``$CXX`` if set (a name on PATH or a path), else the first of
    g++, c++, clang++ on PATH. Raises RuntimeError saying what to do if there is none."""
    env = os.environ.get("CXX")
    if env:
        found = shutil.which(env)
        if found:
            return found
        raise RuntimeError(f"CXX={env!r} names no C++ compiler Stax can run (not an executable file "
                           "or a name on PATH). Set CXX to your compiler (e.g. g++), or unset it "
                           "to use g++, c++ or clang++ from PATH.")
    for name in ("g++", "c++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(_NO_COMPILER)


def cxx_flags() -> list:
    """CXXFLAGS plus any extra flags in ``$STAX_CXXFLAGS`` (split on whitespace)."""
    return CXXFLAGS + os.environ.get("STAX_CXXFLAGS", "").split()


def _host_cpu() -> str:
    try:
        model = flags = ""
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif not flags and line.startswith("flags"):
                    flags = hashlib.sha256(line.split(":", 1)[1].strip().encode()).hexdigest()[:12]
                if model and flags:
                    break
        if model or flags:
            return f"{model} flags:{flags}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


_identity: dict = {}


def compiler_identity() -> str:
    """Compiler path + first line of ``--version`` + flags + host CPU: part of every native cache
    key. Cached per process, and on disk keyed by the compiler binary's path, size and mtime, so
    that a fresh process does not run ``--version`` again (a cache hit costs only the dlopen)."""
    cxx = cxx_compiler()
    flags = " ".join(cxx_flags())
    key = (cxx, flags)
    ident = _identity.get(key)
    if ident is not None:
        return ident
    cpu = _host_cpu()
    try:
        real = os.path.realpath(cxx)
        st = os.stat(real)
        stamp = content_hash(cxx, real, str(st.st_size), str(st.st_mtime_ns), flags, cpu)
        memo = cache_dir() / "cpp" / f"identity-{stamp}.txt"
    except OSError:
        memo = None
    if memo is not None and memo.exists():
        ident = memo.read_text()
    else:
        try:
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
            text = (out.stdout or out.stderr).strip()
            version = text.splitlines()[0] if text else "unknown"
        except (OSError, subprocess.SubprocessError):
            version = "unknown"
        ident = f"{cxx} | {version} | {flags} | {cpu}"
        if memo is not None:
            atomic_write(memo, ident)
    _identity[key] = ident
    return ident


_prelude_text = None


def prelude() -> str:
    """Text of ``cpp_prelude.h`` (read once), pasted at the top of every kernel file."""
    global _prelude_text
    if _prelude_text is None:
        _prelude_text = (Path(__file__).parent / "cpp_prelude.h").read_text()
    return _prelude_text


# The C++ element type of each dtype's buffers: the kernels' pointer parameters (codegen_cpp.py)
# and the runtime's `ptr()` casts (runtime.py) agree through this table, kept here, below both, so
# that a warm start (runtime only) never imports the code generator (and sympy with it).
_STORAGE_CTYPE = {"float32": "float", "float64": "double", "float16": "uint16_t", "bfloat16": "uint16_t",
                  "int32": "int32_t", "int64": "int64_t", "bool": "bool"}


def storage_ctype(dtype) -> str:
    """The C++ element type of a buffer of `dtype` (half types are stored as 16-bit words)."""
    return _STORAGE_CTYPE[dtype.name]


# ---- §8 runtime: compile & load ----

_loaded: dict = {}          # key -> (ffi, lib), so repeated loads in one process are free
_lock = threading.Lock()


def _numbered(source: str) -> str:
    """The source with line numbers; only the kernel part when it starts with the prelude."""
    lines = source.splitlines()
    start = 0
    pre = prelude()
    if source.startswith(pre):
        start = pre.count("\n")
    width = len(str(len(lines)))
    shown = [f"{i + 1:>{width}} | {lines[i]}" for i in range(start, len(lines))]
    head = f"(lines 1-{start} are the Stax prelude, not shown)\n" if start else ""
    return head + "\n".join(shown)


def _compile(cxx: str, src: Path, so: Path, source: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=so.parent, prefix="." + so.stem + ".", suffix=".so.tmp")
    os.close(fd)
    cmd = [cxx, *cxx_flags(), str(src), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CppCompileError(
                "C++ compilation of a Stax kernel failed.\n"
                f"command: {' '.join(cmd)}\n"
                f"source: {src}\n"
                f"---- kernel source ----\n{_numbered(source)}\n"
                f"---- compiler stderr ----\n{proc.stderr.strip()}\n"
                "This is a bug in Stax's C++ code generator (or a compiler problem): please report "
                "it with the source above. Setting STAX_CXXFLAGS adds compiler flags."
            )
        os.replace(tmp, so)   # atomic: concurrent compilers of the same key are both fine
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_cpp(source: str, cdef: str):
    """Compile (or find in the cache) a C++ source and load it: returns ``(ffi, lib)``.

    key = content_hash(source, cdef, compiler_identity()); ``<cache>/cpp/<key>.so`` is dlopened
    if present (no compiler run), else compiled from ``<key>.cpp`` with ``cxx_flags()`` into a
    temp name and atomically renamed. Raises CppCompileError if the compiler fails."""
    key = content_hash(source, cdef, compiler_identity())
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    with _lock:
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        folder = cache_dir() / "cpp"
        folder.mkdir(parents=True, exist_ok=True)
        so = folder / f"{key}.so"
        if not so.exists():
            src = folder / f"{key}.cpp"
            atomic_write(src, source)
            _compile(cxx_compiler(), src, so, source)
        import cffi  # lazy: keeps `import stax.cache` cheap

        ffi = cffi.FFI()
        ffi.cdef(cdef)
        lib = ffi.dlopen(str(so))
        _loaded[key] = (ffi, lib)
        return ffi, lib
