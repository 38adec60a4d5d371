"""Content-addressed cache and the C++ toolchain (§11.1 content-addressed cache; §8 runtime:
compile & load).

Layer: bottom (imports only ``remote_cache``, the optional second level; everything that writes
to disk builds on it).

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

Nothing read back is trusted until checked. Each entry's sha256 is recorded when it is written:
on the entry's first line (``write_sealed``/``read_sealed``: artifact records, tuning records,
cubins) or, for a library that must stay a plain ELF file, in ``<key>.so.sha256``, checked before
the dlopen. An entry that fails (truncated, edited, garbage) is logged (StaxCacheWarning),
removed and rebuilt. Generated Python runs from the checked text itself (``exec_source``), never
from the file beside it. The root is created with mode 0700 and marked (``CACHEDIR.TAG``); a
folder others can write, or a non-empty one Stax did not mark, is refused (CacheError), and
``clear_cache`` removes only Stax's own subfolders.

Where to look: ``load_cpp`` is the whole compile-and-load path; ``compiler_identity`` is what
enters every native cache key; ``CXXFLAGS`` are the flags (``STAX_CXXFLAGS`` appends more);
``<cache>/cpp/<key>.cpp`` is the exact source that was compiled, kept beside ``<key>.so``;
``_failure`` decides whom a failed compile blames (a trivial file built the same way);
``compile_timeout`` (``STAX_COMPILE_TIMEOUT``) stops a hung compiler; ``cache_dir`` and
``_check_private`` are the folder rules; ``sweep_stale`` removes what killed compiles left.

A second level (``remote_cache.py``, ``STAX_REMOTE_CACHE=redis://...``) is read on a local miss
and written after a local write, with the same names and the same sealed bytes: sealed entries
(artifact records, tuning records, cubins) are data and always shared; a library is taken from it
only under ``STAX_REMOTE_CACHE_TRUST_NATIVE=1`` (``_library_from_remote``). ``LOCAL`` and
``remote_cache.STATS`` count hits and misses; ``_save_stats`` adds them up in ``stats/``.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import hashlib
import json
import linecache
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "cache_dir", "folder", "atomic_write", "content_hash", "clear_cache", "write_sealed", "read_sealed",
    "discard", "exec_source", "CacheError", "StaxCacheWarning", "cxx_compiler", "compiler_identity",
    "cxx_flags", "CXXFLAGS", "CppCompileError", "compile_timeout", "load_cpp", "prelude", "storage_ctype",
]

# ---- §11.1 Content-addressed cache: where, and whose ----

FORMAT = "2"        # enters every key: entries of the older, unchecked layout are never read
MARKER = "CACHEDIR.TAG"
_MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by Stax (a tensor-program compiler).\n"
                "# `python -m stax cache clear` removes only Stax's subfolders of this folder.\n"
                "# For information about cache directory tags see https://bford.info/cachedir/\n")
SUBDIRS = ("cpp", "py", "kernels", "artifacts", "autotune", "cubin", "stats", "tmp")   # all Stax writes


class CacheError(RuntimeError):
    """The cache folder cannot be used: it is a file, not Stax's, or others can write to it."""


class StaxCacheWarning(UserWarning):
    """A cache entry failed its check (damaged, truncated, edited): it was removed and is rebuilt."""


_roots: dict = {}           # $STAX_CACHE_DIR -> its checked root (one check per process)
_checked: set = set()       # subfolders whose owner and mode were checked


def cache_dir() -> Path:
    """The cache root: ``$STAX_CACHE_DIR`` or ``~/.cache/stax``, created on demand (mode 0700,
    marked with a ``CACHEDIR.TAG`` naming Stax). Raises CacheError for a path that is a file, a
    non-empty folder that Stax did not mark, or a folder that another user owns or can write."""
    env = os.environ.get("STAX_CACHE_DIR") or None
    root = _roots.get(env)
    if root is None:
        root = _roots[env] = _prepare_root(env)
    return root


def _prepare_root(env) -> Path:
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "stax"
    what = f"STAX_CACHE_DIR={env!r}" if env else f"Stax's cache folder {str(root)!r}"
    if root.exists() and not root.is_dir():
        raise CacheError(f"{what} names a file, not a folder. Set STAX_CACHE_DIR to a folder "
                         "(Stax creates it if missing), or unset it to use ~/.cache/stax.")
    created = False
    if not root.is_dir():
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
            root.mkdir(mode=0o700)
            created = True
        except FileExistsError:
            pass                     # another process made it first
        except OSError as e:
            raise CacheError(f"cannot create {what}: {e}. Set STAX_CACHE_DIR to a folder you can "
                             "write.") from None
    _check_private(root, what)
    if not _is_marked(root):
        # the default folder is Stax's by its name; any other must be new or empty to be taken
        if env and not created and any(not _is_temp(p.name) for p in root.iterdir()):
            raise CacheError(
                f"{what} is not a Stax cache: the folder is not empty and has no {MARKER} naming "
                "Stax, so Stax will neither write into it nor clear it. Point STAX_CACHE_DIR at a "
                "new or empty folder (Stax marks it), or at an existing Stax cache.")
        atomic_write(root / MARKER, _MARKER_TEXT, _root=root)
    return root


def _is_marked(root: Path) -> bool:
    try:
        text = (root / MARKER).read_text(errors="replace")
    except OSError:
        return False
    return text.startswith("Signature: 8a477f597d28d172789f06886806bc55") and "Stax" in text


def _check_private(path: Path, what: str) -> None:
    """Stax loads native code from the cache: refuse a folder that someone else could write."""
    if not hasattr(os, "getuid"):
        return                       # no POSIX owners and modes (Windows)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise CacheError(f"{what}: {path} belongs to another user (uid {st.st_uid}); Stax will "
                         "not load code from it. Set STAX_CACHE_DIR to a folder of your own.")
    if st.st_mode & 0o022:
        raise CacheError(f"{what}: {path} can be written by other users (mode "
                         f"{oct(st.st_mode & 0o777)}), so Stax will not load code from it. Run "
                         f"`chmod go-w {path}` (Stax creates its folders with mode 0700), or set "
                         "STAX_CACHE_DIR to a private folder.")


def folder(name: str) -> Path:
    """``<cache>/<name>`` (one of SUBDIRS), its owner and mode checked once per process when it
    exists. It may not exist: writers create it (``atomic_write``), readers see a miss."""
    path = cache_dir() / name
    if path not in _checked and path.is_dir():
        _check_private(path, "the cache folder")
        _checked.add(path)
    return path


def _make_folder(path: Path, root: Path | None = None) -> None:
    """Create a cache folder (mode 0700); recreate the root, marked, if it was deleted meanwhile."""
    if path.is_dir():
        return
    root = root or _roots.get(os.environ.get("STAX_CACHE_DIR") or None)
    if root is not None and (path == root or root in path.parents) and not root.is_dir():
        _roots.clear()               # deleted under us: make it again, private and marked
        _checked.clear()
        cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


# ---- §11.1 Writing: atomic, temp names that say whose they are ----

_NODE = re.sub(r"[^A-Za-z0-9-]", "-", platform.node())[:40] or "host"
_TEMP = re.compile(r"\.(\d+)@([A-Za-z0-9-]*)\.")     # `.<pid>@<host>.` inside a temp name
STALE_SECONDS = 3600        # a temp file or work folder this old is left over, whoever made it


def _temp_tag() -> str:
    return f".{os.getpid()}@{_NODE}."


def _is_temp(name: str) -> bool:
    return name.endswith(".tmp") or bool(_TEMP.match("." + name))


def atomic_write(path, data, _root=None) -> Path:
    """Write ``data`` (bytes or str) to ``path`` atomically: a temp file in the same folder (its
    name carries this process's id), then ``os.replace``. Readers see the old file or the whole
    new one, never a partial one. A folder removed meanwhile (``cache clear``) is made again."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    for attempt in range(3):
        _make_folder(path.parent, _root)
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + _temp_tag(),
                                       suffix=".tmp")
        except FileNotFoundError:
            continue                 # the folder vanished between mkdir and mkstemp
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return path
        except FileNotFoundError:
            if attempt == 2:
                raise
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    raise FileNotFoundError(f"could not write {path}: its folder keeps disappearing")


def content_hash(*parts: str) -> str:
    """sha256 of the parts (length-prefixed, so ("ab", "c") != ("a", "bc")), 20 hex chars."""
    h = hashlib.sha256()
    for p in parts:
        b = p.encode("utf-8") if isinstance(p, str) else bytes(p)
        h.update(str(len(b)).encode() + b":")
        h.update(b)
    return h.hexdigest()[:20]


# ---- §11.1 Reading: verify before trusting ----

_SEAL = b"stax-sha256 "


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).hexdigest().encode()


def _sealed(payload: bytes) -> bytes:
    return _SEAL + _sha(payload) + b"\n" + payload


def _unseal(data: bytes) -> bytes | None:
    """The payload if `data` carries the right hash on its first line, else None."""
    head, _, payload = data.partition(b"\n")
    return payload if head == _SEAL + _sha(payload) else None


def write_sealed(path, payload, shared: bool = True) -> Path:
    """Write an entry with the sha256 of its payload on its first line (``read_sealed`` checks it),
    and, when `shared`, the same bytes to the remote level (``STAX_REMOTE_CACHE``)."""
    if isinstance(payload, str):
        payload = payload.encode("utf-8")
    data = _sealed(payload)
    path = atomic_write(path, data)
    if shared:
        _push_remote(path, data)
    return path


def read_sealed(path, shared: bool = True) -> bytes | None:
    """The payload of an entry ``write_sealed`` wrote, or None: missing here and (when `shared`)
    on the remote level (a miss), or failing its check (truncated, edited, garbage: logged and
    removed, so that the caller rebuilds it; a bad remote entry is deleted there too)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        data = _fetch_remote(path) if shared else None
        if shared:
            LOCAL.count(path.parent.name, "misses")
        if data is None:
            return None
        payload = _unseal(data)
        if payload is None:
            _remote_bad(path, "its content does not match the hash it carries")
            return None
        atomic_write(path, data)     # the first level keeps it
        return payload
    except OSError as e:
        discard(path, f"unreadable: {e.strerror or e}")
        return None
    payload = _unseal(data)
    if payload is None:
        discard(path, "its content does not match the hash recorded when it was written")
        return None
    if shared:
        LOCAL.count(path.parent.name, "hits", len(data))
    return payload


def discard(path, why: str) -> None:
    """Log and remove a bad cache entry (and the hash record of a library); it is never loaded."""
    path = Path(path)
    warnings.warn(f"stax: cache entry {path} failed its check ({why}); removed, it will be rebuilt",
                  StaxCacheWarning, stacklevel=3)
    for p in (path, path.with_name(path.name + ".sha256")):
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink()
        except OSError:
            pass


# ---- §11.1 The second level (remote_cache.py) and the counters `cache stats` shows ----

class LocalStats:
    """This process's first-level reads: entries found (and their bytes) and entries missing.
    (A plain class: tests load this module alone, where a dataclass cannot find its module.)"""

    def __init__(self):
        self.hits, self.misses, self.bytes_read = 0, 0, 0
        self.by_kind: dict = {}                    # "artifacts" -> {"hits": n, "misses": n}

    def count(self, kind: str, what: str, nbytes: int = 0) -> None:
        setattr(self, what, getattr(self, what) + 1)
        self.bytes_read += nbytes
        per = self.by_kind.setdefault(kind, {"hits": 0, "misses": 0})
        per[what] += 1
        _save_stats_at_exit()


LOCAL = LocalStats()


def _remote_name(path: Path) -> str | None:
    """An entry's name on the remote level: its path under the cache root, as the local cache
    keys it (``artifacts/<hash>.json``); None for a path outside the cache."""
    try:
        return path.resolve().relative_to(cache_dir().resolve()).as_posix()
    except ValueError:
        return None


def _remote_for(path: Path):
    """(store, name) when a remote level is configured and `path` is a cache entry, else None."""
    from . import remote_cache       # lazy: `cache.py` alone stays importable (and light)
    store = remote_cache.remote()
    name = _remote_name(path) if store is not None else None
    return None if name is None else (store, name)


def _fetch_remote(path: Path) -> bytes | None:
    found = _remote_for(path)
    return None if found is None else found[0].get(found[1])


def _push_remote(path: Path, data: bytes) -> None:
    found = _remote_for(path)
    if found is not None:
        _save_stats_at_exit()
        found[0].put(found[1], data)


def _remote_bad(path: Path, why: str) -> None:
    found = _remote_for(path)
    if found is not None:
        found[0].delete(found[1], why)


_stats_hooked = False


def _save_stats_at_exit() -> None:
    global _stats_hooked
    if not _stats_hooked:
        _stats_hooked = True
        atexit.register(_save_stats)


def _save_stats() -> None:
    """Add this process's counters to ``<cache>/stats/counters.json`` (under a lock: many
    processes end at once). Never raises: statistics must not fail a run."""
    from . import remote_cache
    mine = {"local": dict(vars(LOCAL)), "remote": dataclasses.asdict(remote_cache.STATS)}
    try:
        path = folder("stats") / "counters.json"
        _make_folder(path.parent)
        with open(path.with_suffix(".lock"), "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            total = stats_totals()
            atomic_write(path, json.dumps(_add_counts(total, mine), sort_keys=True))
    except Exception:                # noqa: BLE001
        pass


def _add_counts(a, b):
    if isinstance(a, dict) or isinstance(b, dict):
        a, b = (x if isinstance(x, dict) else {} for x in (a, b))
        return {k: _add_counts(a.get(k, 0), b.get(k, 0)) for k in sorted(set(a) | set(b))}
    return (a if isinstance(a, (int, float)) else 0) + (b if isinstance(b, (int, float)) else 0)


def stats_totals() -> dict:
    """The counters of every finished process since the last ``cache clear`` (a damaged file
    reads as empty)."""
    try:
        total = json.loads((folder("stats") / "counters.json").read_text())
    except (OSError, ValueError):
        return {}
    return total if isinstance(total, dict) else {}


def read_sealed_json(path, valid, what: str):
    """The JSON record at `path` if it passes its hash and `valid(record)`, else None (a bad one
    is logged and removed: the caller builds it again)."""
    payload = read_sealed(path)
    if payload is None:
        return None
    try:
        record = json.loads(payload)
    except ValueError:
        record = None
    if not valid(record):
        discard(path, f"not {what} of the expected structure")
        return None
    return record


def exec_source(kind: str, stem: str, source: str, names: dict) -> types.ModuleType:
    """Run generated Python ``source`` as a module (``names`` preset in its namespace).

    The code executed is ``source`` itself, never what a file holds: the file
    ``<cache>/<kind>/<stem>_<hash>.py`` is a mirror for tracebacks, debuggers and Triton's
    ``inspect.getsource`` (served from ``linecache``, primed here), rewritten if it differs."""
    path = folder(kind) / f"{stem}_{content_hash(source)}.py"
    data = source.encode("utf-8")
    try:
        same = path.read_bytes() == data
    except OSError:
        same = None
    if not same:
        if same is False:
            discard(path, "it differs from the source it is named after")
        atomic_write(path, data)
    name = str(path)
    code = compile(source, name, "exec")
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    mod = types.ModuleType(path.stem)
    mod.__file__ = name
    mod.__dict__.update(names)
    exec(code, mod.__dict__)
    return mod


# ---- §11.1 Clearing: only Stax's folders; temp files of dead processes ----


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True                  # cannot tell: age decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _stale(path: Path, now: float) -> bool:
    """A temp left by a process that is gone (same host), or older than STALE_SECONDS."""
    m = _TEMP.search(path.name if path.name.startswith(".") else "." + path.name)
    try:
        age = now - path.lstat().st_mtime
    except OSError:
        return False
    if m and m.group(2) == _NODE and not _pid_alive(int(m.group(1))):
        return True
    return age > max(STALE_SECONDS, 2 * compile_timeout())


def sweep_stale(root: Path | None = None) -> int:
    """Remove temp files and compile folders whose process is gone; returns how many."""
    root = root or cache_dir()
    now, n = time.time(), 0
    for name in SUBDIRS:
        try:
            entries = list((root / name).iterdir())
        except OSError:
            continue
        for p in entries:
            if (name == "tmp" or p.name.endswith(".tmp")) and _stale(p, now):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    try:
                        p.unlink()
                    except OSError:
                        continue
                n += 1
    return n


def _remove_tree(path: Path) -> int:
    if path.is_symlink() or not path.is_dir():
        try:
            path.unlink()
            return 1
        except OSError:
            return 0
    n = sum(len(files) for _, _, files in os.walk(path))
    shutil.rmtree(path, ignore_errors=True)      # entries vanishing under a concurrent writer: fine
    return n


def clear_cache() -> int:
    """Remove Stax's subfolders of the cache (``python -m stax cache clear``) and the work folders
    of compiles whose process is gone; returns the number of files removed. Nothing else in the
    folder is touched, and a folder that is not a marked Stax cache is refused (CacheError).
    Concurrent processes are unharmed: they recreate folders and rebuild what vanished. The
    in-process table of loaded libraries is forgotten too."""
    root = cache_dir()
    n = sum(_remove_tree(root / name) for name in SUBDIRS if name != "tmp" and
            os.path.lexists(root / name))
    n += sweep_stale(root)
    _checked.clear()
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
    """The C++ compiler failed, hung, or wrote no library. The message starts with the compiler's
    own; ``generated_code_at_fault`` says whether the kernel (a Stax bug) or the toolchain (the
    compiler, CXX, STAX_CXXFLAGS) is to blame: decided by compiling a trivial file the same way."""
    generated_code_at_fault = False


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


def compile_timeout() -> float:
    """Seconds a compiler run may take (``$STAX_COMPILE_TIMEOUT``, default 300) before it is stopped."""
    text = os.environ.get("STAX_COMPILE_TIMEOUT", "").strip()
    if not text:
        return 300.0
    try:
        t = float(text)
    except ValueError:
        t = -1.0
    if not 0 < t < float("inf"):
        raise ValueError(f"STAX_COMPILE_TIMEOUT={text!r} is not a positive number of seconds "
                         "(unset it for the default, 300)")
    return t


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
        stamp = content_hash(FORMAT, cxx, real, str(st.st_size), str(st.st_mtime_ns), flags, cpu)
        memo = folder("cpp") / f"identity-{stamp}.txt"
    except OSError:
        memo = None
    payload = read_sealed(memo, shared=False) if memo is not None else None   # this host's only
    if payload is not None:
        ident = payload.decode("utf-8", "replace")
    else:
        try:
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                                 timeout=min(60.0, compile_timeout()))
            text = (out.stdout or out.stderr).strip()
            version = text.splitlines()[0] if text else "unknown"
        except (OSError, subprocess.SubprocessError):
            version = "unknown"
        ident = f"{cxx} | {version} | {flags} | {cpu}"
        if memo is not None:
            write_sealed(memo, ident, shared=False)
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
                  "int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "int32": "int32_t",
                  "int64": "int64_t", "bool": "bool", "float8_e4m3fn": "uint8_t", "float8_e5m2": "uint8_t"}


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


def _run_compiler(cmd: list) -> tuple:
    """(exit status, output) of one compiler run, stopped (its whole process group) after
    ``compile_timeout()`` seconds with a CppCompileError that says so."""
    timeout = compile_timeout()
    posix = os.name == "posix"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=posix)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if posix:
            os.killpg(proc.pid, signal.SIGKILL)      # the driver and cc1plus/as under it
        else:
            proc.kill()
        proc.communicate()
        raise CppCompileError(
            f"The C++ compiler did not finish within {timeout:g} seconds and was stopped "
            f"(STAX_COMPILE_TIMEOUT={os.environ.get('STAX_COMPILE_TIMEOUT', '300 (default)')}).\n"
            f"command: {' '.join(cmd)}\nNothing was cached. If the compiler is just slow, raise "
            "STAX_COMPILE_TIMEOUT (seconds); if it hangs, check CXX and STAX_CXXFLAGS.") from None
    return proc.returncode, ((err or "") + (out or "")).strip()


@contextmanager
def _work_dir():
    """A private folder for one compile, ``<cache>/tmp/<pid>@<host>.<random>``, removed after it;
    one a killed process left behind is swept by the next compile or ``cache clear``."""
    tmp = folder("tmp")
    _make_folder(tmp)
    path = Path(tempfile.mkdtemp(dir=tmp, prefix=_temp_tag()[1:]))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


_probes: dict = {}      # (compiler, flags) -> (builds a trivial file?, its output)


def _probe(cxx: str, flags: list) -> tuple:
    """Does a trivial, known-good C++ file (the prelude's headers and one function) build with
    this compiler and these flags? Tells a toolchain problem from a code-generator bug."""
    key = (cxx, tuple(flags))
    if key not in _probes:
        includes = [ln for ln in prelude().splitlines() if ln.startswith("#include")]
        text = "\n".join(includes + ['extern "C" int stax_probe(int n) { return n + 1; }', ""])
        with _work_dir() as work:
            (work / "probe.cpp").write_text(text)
            try:
                rc, out = _run_compiler([cxx, *flags, str(work / "probe.cpp"), "-o",
                                         str(work / "probe.so")])
                ok = rc == 0 and _library_problem(work / "probe.so") is None
            except CppCompileError as e:
                ok, out = False, str(e)
        _probes[key] = (ok, out)
    return _probes[key]


def _library_problem(path: Path) -> str | None:
    """Why the compiler's output is no library (missing, empty, not ELF on Linux), or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return "wrote no library (its output file is missing)"
    if not head:
        return "wrote an empty file instead of a library"
    if sys.platform.startswith("linux") and head != b"\x7fELF":
        return "wrote a file that is not a shared library (no ELF header)"
    return None


def _failure(cxx, flags, rc, out, command, kept, source) -> CppCompileError:
    """The error for a failed compile, the compiler's message first; the code generator is
    blamed only when a trivial file builds with the same compiler and flags."""
    ok, probe_out = _probe(cxx, flags)
    head = f"---- compiler stderr ----\n{out}\n(exit status {rc})\n"
    if ok:
        err = CppCompileError(
            f"C++ compilation of a Stax kernel failed.\n{head}"
            f"---- kernel source ----\n{_numbered(source)}\n"
            f"command: {command}\nsource: {kept}\n"
            "A trivial C++ file builds with the same compiler and flags, so the generated kernel is "
            "at fault: this is a bug in Stax's C++ code generator. Please report it with the "
            "source above.")
        err.generated_code_at_fault = True
        return err
    extra = os.environ.get("STAX_CXXFLAGS", "")
    return CppCompileError(
        f"The C++ compiler failed.\n{head}"
        f"command: {command}\n"
        "It fails on a trivial C++ file with the same flags too, so the compiler or its flags are "
        f"at fault, not Stax's generated code (compiler: {cxx}; Stax's flags: {' '.join(CXXFLAGS)}; "
        f"STAX_CXXFLAGS={extra!r}). Check CXX and STAX_CXXFLAGS, or unset them.\n"
        f"---- the trivial file's compiler output ----\n{probe_out}")


def _compile(cxx: str, source: str, key: str, kept: Path) -> bytes:
    """Build ``source`` in a private work folder; returns the library's bytes. ``kept`` is the
    copy of the source in the cache that messages point to."""
    flags = cxx_flags()
    command = " ".join([cxx, *flags, str(kept), "-o", f"{key}.so"])
    with _work_dir() as work:
        src, out_path = work / f"{key}.cpp", work / f"{key}.so"
        src.write_text(source)
        rc, out = _run_compiler([cxx, *flags, str(src), "-o", str(out_path)])
        out = out.replace(str(src), str(kept))      # point at the copy that is kept
        if rc != 0:
            raise _failure(cxx, flags, rc, out, command, kept, source)
        problem = _library_problem(out_path)
        if problem is not None:
            shown = f"\n---- compiler output ----\n{out}" if out else ""
            raise CppCompileError(
                f"The C++ compiler exited successfully but {problem}; nothing was cached.\n"
                f"command: {command}{shown}\nCheck that CXX ({cxx}) names a working C++ compiler "
                "and that STAX_CXXFLAGS does not redirect its output.")
        return out_path.read_bytes()


def _verified_library(so: Path) -> bool:
    """Is ``<key>.so`` in the cache, whole and as written? Its sha256 was recorded at write time
    in ``<key>.so.sha256``; a library without a record or with another hash is removed."""
    want = read_sealed(so.with_name(so.name + ".sha256"), shared=False)
    if want is None:
        if so.exists():
            discard(so, "no hash was recorded for it")
        return False
    try:
        data = so.read_bytes()
    except FileNotFoundError:
        return False                 # written by a process still at it, or cleared: a miss
    except OSError as e:
        discard(so, f"unreadable: {e.strerror or e}")
        return False
    if _sha(data) != want:
        discard(so, "its content does not match the hash recorded when it was written")
        return False
    return True


def _store_library(so: Path, data: bytes) -> None:
    """The hash record first, then the library, each atomically (``_verified_library`` reads)."""
    write_sealed(so.with_name(so.name + ".sha256"), _sha(data), shared=False)
    atomic_write(so, data)


def trust_remote_native() -> bool:
    """May a native library from the remote level be loaded? Only when the user says so
    (``STAX_REMOTE_CACHE_TRUST_NATIVE=1``): a dlopen runs the library's code, so a shared cache
    that others can write must not be able to plant one by default."""
    return os.environ.get("STAX_REMOTE_CACHE_TRUST_NATIVE", "") == "1"


def _local_miss(so: Path) -> bool:
    LOCAL.count("cpp", "misses")
    return False


def _library_from_remote(so: Path, source: str) -> bool:
    """A local miss of ``<key>.so``: take it from the remote level if trusted and whole (the
    sha256 it carries checks out); its source is kept beside it as for a local compile."""
    if _remote_for(so) is None or not trust_remote_native():
        return False
    data = _fetch_remote(so)
    if data is None:
        return False
    library = _unseal(data)
    if library is None or _library_problem_bytes(library):
        _remote_bad(so, "its content does not match the hash it carries, or it is not a library")
        return False
    atomic_write(so.with_suffix(".cpp"), source)
    _store_library(so, library)
    return True


def _library_problem_bytes(data: bytes) -> bool:
    return len(data) < 64 or (sys.platform.startswith("linux") and data[:4] != b"\x7fELF")


_swept = False


def load_cpp(source: str, cdef: str):
    """Compile (or find in the cache) a C++ source and load it: returns ``(ffi, lib)``.

    key = content_hash(source, cdef, compiler_identity()); ``<cache>/cpp/<key>.so`` is dlopened
    if present and its sha256 matches ``<key>.so.sha256`` (no compiler run), else compiled in a
    work folder and written: the hash record first, then the library, each atomically. Raises
    CppCompileError if the compiler fails, hangs or writes nothing."""
    global _swept
    key = content_hash(FORMAT, source, cdef, compiler_identity())
    hit = _loaded.get(key)
    if hit is not None:
        return hit
    with _lock:
        hit = _loaded.get(key)
        if hit is not None:
            return hit
        import cffi  # lazy: keeps `import stax.cache` cheap

        ffi = cffi.FFI()
        ffi.cdef(cdef)
        for attempt in range(3):
            so = folder("cpp") / f"{key}.so"
            if _verified_library(so):
                LOCAL.count("cpp", "hits", so.stat().st_size)
            elif not _local_miss(so) and not _library_from_remote(so, source):
                if not _swept:       # once per process: what killed compiles left behind
                    sweep_stale()
                    _swept = True
                kept = atomic_write(so.with_suffix(".cpp"), source)
                data = _compile(cxx_compiler(), source, key, kept)
                _store_library(so, data)
                _push_remote(so, _sealed(data))
            try:
                lib = ffi.dlopen(str(so))
                break
            except OSError:
                if attempt == 2 or so.exists():
                    raise
                # removed between the check and the dlopen (a concurrent `cache clear`): again
        _loaded[key] = (ffi, lib)
        return ffi, lib
