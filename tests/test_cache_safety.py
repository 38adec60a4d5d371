"""The cache's safety (issue 9; §11.1 content-addressed cache, stax/cache.py):

- verify before trusting: a truncated, empty, garbage or planted `.so`, an edited wrapper, an
  artifact or tuning record of the wrong structure, an edited cubin are logged, removed and rebuilt,
  never loaded (the SIGBUS cases run in subprocesses);
- only Stax's files: the root is marked (CACHEDIR.TAG); `cache clear` removes Stax's subfolders
  only, and refuses a non-empty folder Stax did not mark;
- permissions: the root is created 0700; one that others can write (or own) is refused;
- faults: STAX_CACHE_DIR naming a file, `cache clear` during compiles, a killed compile's leftovers,
  a compiler that writes nothing, hangs (STAX_COMPILE_TIMEOUT) or fails;
- honest errors: the generator is blamed only when a trivial file builds with the same toolchain;
- no injection: an int/float subclass whose __repr__/__str__/__format__ return code is printed as
  its plain value in every wrapper and kernel.
"""
import builtins
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import stax
from stax import cache, runtime, triton_heuristics, wrapper
from stax.cache import CacheError, CppCompileError, StaxCacheWarning

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = """
    import numpy as np, stax
    f = stax.compile(lambda x: (x * 3 + 1).relu())
    print(np.asarray(f(stax.from_numpy(np.arange(-2, 3, dtype=np.float32)))).tolist())
"""
EXPECTED = "[0.0, 0.0, 1.0, 4.0, 7.0]"


def _pythonpath() -> str:
    """ROOT first, then whatever PYTHONPATH holds already (where cffi may live)."""
    return os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


def _python(code, env_extra, timeout=180):
    env = {**os.environ, **env_extra, "PYTHONPATH": _pythonpath()}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("STAX_CACHE_DIR", str(root))
    cache._loaded.clear()
    return root


def _warm(root):
    out = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
    assert out.returncode == 0 and out.stdout.strip() == EXPECTED, out.stderr
    return out


# ---- verify before trusting: libraries ----


def _damage_so(so: Path, how: str, other: Path | None):
    data = so.read_bytes()
    if how == "truncated":
        so.write_bytes(data[: len(data) // 3])
    elif how == "empty":
        so.write_bytes(b"")
    elif how == "garbage":
        so.write_bytes(os.urandom(len(data)))
    elif how == "planted":
        so.write_bytes(other.read_bytes())        # a valid library, but not the one written here
    elif how == "no-record":
        so.with_name(so.name + ".sha256").unlink()


@pytest.mark.parametrize("how", ["truncated", "empty", "garbage", "planted", "no-record"])
def test_a_damaged_library_is_rebuilt_not_loaded(tmp_path, how):
    root = tmp_path / "cache"
    _warm(root)
    (so,) = (root / "cpp").glob("*.so")
    other = None
    if how == "planted":                          # another valid library, from another program
        other_root = tmp_path / "other"
        out = _python(PROGRAM.replace("x * 3", "x * 5"), {"STAX_CACHE_DIR": str(other_root)})
        assert out.returncode == 0, out.stderr
        (other,) = (other_root / "cpp").glob("*.so")
    _damage_so(so, how, other)
    again = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
    assert again.returncode == 0, f"rc={again.returncode} (SIGBUS is -7)\n{again.stderr}"
    assert again.stdout.strip() == EXPECTED
    assert "failed its check" in again.stderr and so.name in again.stderr
    # rebuilt: the entry passes its check now, and a third run is quiet
    assert cache._verified_library(so)
    third = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
    assert third.returncode == 0 and "failed its check" not in third.stderr


def test_a_corrupt_hash_record_is_rebuilt(tmp_path):
    root = tmp_path / "cache"
    _warm(root)
    (rec,) = (root / "cpp").glob("*.so.sha256")
    rec.write_bytes(b"stax-sha256 0000\n")
    again = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
    assert again.returncode == 0 and again.stdout.strip() == EXPECTED, again.stderr
    assert "failed its check" in again.stderr


# ---- verify before trusting: generated Python and records ----

MARK = "__import__('builtins').__dict__.__setitem__('STAX_TAMPERED', 1)\n"
CHECK = PROGRAM + "\n    import builtins; print('tampered' if hasattr(builtins, 'STAX_TAMPERED') else 'clean')\n"


def test_an_edited_wrapper_file_is_never_executed(tmp_path):
    root = tmp_path / "cache"
    _warm(root)
    (py,) = (root / "py").glob("wrapper_*.py")
    original = py.read_text()
    py.write_text(MARK + original)
    # a planted bytecode file beside it would not be read either: nothing is imported from there
    out = _python(CHECK, {"STAX_CACHE_DIR": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "clean" and EXPECTED in out.stdout
    assert py.read_text() == original                       # repaired
    assert "failed its check" in out.stderr
    assert not (root / "py" / "__pycache__").exists()


def _artifact(root) -> Path:
    (path,) = (root / "artifacts").glob("*.json")
    return path


def test_an_edited_artifact_record_is_never_executed(tmp_path):
    root = tmp_path / "cache"
    _warm(root)
    path = _artifact(root)
    head, payload = path.read_bytes().split(b"\n", 1)
    record = json.loads(payload)
    record["wrapper"] = MARK + record["wrapper"]
    path.write_bytes(head + b"\n" + json.dumps(record).encode())   # old hash, new content
    out = _python(CHECK, {"STAX_CACHE_DIR": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "clean" and "failed its check" in out.stderr


@pytest.mark.parametrize("content", [
    b"",                                                   # empty
    b"\x00garbage\xff" * 10,                               # garbage
    b"stax-sha256 abc\n{}",                                # a wrong hash
    "structure",                                           # the right hash, the wrong structure
])
def test_a_bad_artifact_record_is_regenerated(tmp_cache, content):
    path = tmp_cache / "artifacts" / "x.json"
    if content == "structure":
        cache.write_sealed(path, json.dumps({"kind": "cpp", "kernels": ["not", "a", "dict"],
                                             "wrapper": 1, "source": "", "cdefs": []}))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    with pytest.warns(StaxCacheWarning, match="failed its check"):
        assert runtime.load_artifact(path) is None
    assert not path.exists()


def test_bad_artifacts_never_fail_a_compile(tmp_path):
    """Every artifact garbled: each run logs, regenerates and gives the right answer."""
    root = tmp_path / "cache"
    _warm(root)
    for bad in (b"", b"{not json", b"stax-sha256 " + b"0" * 64 + b"\n{}"):
        _artifact(root).write_bytes(bad)
        out = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
        assert out.returncode == 0 and out.stdout.strip() == EXPECTED, out.stderr
        assert "failed its check" in out.stderr


def test_sealed_entries(tmp_cache):
    p = cache.write_sealed(tmp_cache / "autotune" / "k.json", "payload")
    assert cache.read_sealed(p) == b"payload"
    assert cache.read_sealed(tmp_cache / "autotune" / "missing.json") is None     # a quiet miss
    p.write_bytes(p.read_bytes()[:-2])                                             # truncated
    with pytest.warns(StaxCacheWarning):
        assert cache.read_sealed(p) is None
    assert not p.exists()


def test_tuning_records_and_cubins_are_checked(tmp_cache):
    from stax.cuda_triton import TritonKernelInfo
    rec = tmp_cache / "autotune" / "k.json"
    cache.write_sealed(rec, json.dumps({"config": {"XBLOCK": 64, "num_warps": 4}, "ms": 0.5}))
    assert triton_heuristics._load_choice(rec) == ({"XBLOCK": 64, "num_warps": 4}, 0.5)
    cache.write_sealed(rec, json.dumps({"config": {"XBLOCK": "64; import os"}, "ms": 0.5}))
    with pytest.warns(StaxCacheWarning, match="tuning record"):
        assert triton_heuristics._load_choice(rec) is None
    info = TritonKernelInfo(name="k", num_warps=4, num_stages=1, shared=0, arch="sm90")
    cub = tmp_cache / "cubin" / "k.bin"
    triton_heuristics._save_cubin(cub, b"\x7fELF\ncubin bytes", info)
    assert triton_heuristics._load_cubin(cub) == (b"\x7fELF\ncubin bytes", info)
    data = bytearray(cub.read_bytes())
    data[-1] ^= 1                                                      # one flipped bit
    cub.write_bytes(bytes(data))
    with pytest.warns(StaxCacheWarning):
        assert triton_heuristics._load_cubin(cub) is None
    cache.write_sealed(cub, json.dumps({"name": "k", "num_warps": "4"}).encode() + b"\nxx")
    with pytest.warns(StaxCacheWarning, match="cubin entry"):
        assert triton_heuristics._load_cubin(cub) is None             # right hash, wrong types


def test_an_edited_triton_kernel_file_is_never_executed(tmp_path):
    """Triton kernels (run by the interpreter here) come from the checked text, not the file."""
    root = tmp_path / "cache"
    prog = """
        import numpy as np, stax
        f = stax.compile(lambda x: (x * 3 + 1).relu())
        x = stax.from_numpy(np.arange(-2, 3, dtype=np.float32)).to("cuda")
        print(np.asarray(f(x).cpu()).tolist())
    """
    env = {"STAX_CACHE_DIR": str(root), "TRITON_INTERPRET": "1"}
    out = _python(prog, env)
    assert out.returncode == 0 and out.stdout.strip() == EXPECTED, out.stderr
    (kfile,) = (root / "kernels").glob("*.py")
    original = kfile.read_text()
    kfile.write_text(MARK + original)
    out = _python(prog + "\n        import builtins; print(hasattr(builtins, 'STAX_TAMPERED'))\n", env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False" and kfile.read_text() == original


# ---- only Stax's files; permissions ----


def test_the_root_is_private_and_marked(tmp_cache):
    root = cache.cache_dir()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert (root / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    cache.atomic_write(cache.folder("cpp") / "x", "1")
    assert stat.S_IMODE((root / "cpp").stat().st_mode) == 0o700


def test_clear_removes_only_stax_subfolders(tmp_cache):
    root = cache.cache_dir()
    cache.atomic_write(root / "cpp" / "a.so", b"x")
    cache.atomic_write(root / "artifacts" / "b.json", b"x")
    (root / "notes.txt").write_text("mine")
    (root / "mine").mkdir()
    (root / "mine" / "data.bin").write_bytes(b"keep")
    assert cache.clear_cache() == 2
    assert sorted(p.name for p in root.iterdir()) == ["CACHEDIR.TAG", "mine", "notes.txt"]
    assert (root / "mine" / "data.bin").read_bytes() == b"keep"


def test_clear_refuses_a_folder_that_is_not_a_stax_cache(tmp_path):
    project = tmp_path / "project"
    project.mkdir(mode=0o700)
    (project / "main.py").write_text("print('hi')")
    (project / "cpp").mkdir()
    (project / "cpp" / "important.cpp").write_text("int main() {}")
    out = _python("import sys; from stax.__main__ import main; sys.exit(main(['cache', 'clear']))",
                  {"STAX_CACHE_DIR": str(project)})
    assert out.returncode == 2
    assert "is not a Stax cache" in out.stderr and "CACHEDIR.TAG" in out.stderr
    assert (project / "main.py").exists() and (project / "cpp" / "important.cpp").exists()
    # and nothing is compiled into it either
    out = _python(PROGRAM, {"STAX_CACHE_DIR": str(project)})
    assert out.returncode != 0 and "is not a Stax cache" in out.stderr
    assert sorted(p.name for p in project.rglob("*")) == ["cpp", "important.cpp", "main.py"]


def test_an_existing_empty_folder_is_taken(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    monkeypatch.setenv("STAX_CACHE_DIR", str(empty))
    assert cache.cache_dir() == empty and (empty / "CACHEDIR.TAG").exists()


def test_cache_dir_naming_a_file_says_so(tmp_path, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("STAX_CACHE_DIR", str(f))
    with pytest.raises(CacheError, match="names a file, not a folder"):
        cache.cache_dir()
    out = _python(PROGRAM, {"STAX_CACHE_DIR": str(f)})
    assert out.returncode != 0 and "names a file, not a folder" in out.stderr
    assert f.read_text() == "x"


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX modes")
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_folder_others_can_write_is_refused(tmp_path, monkeypatch, mode):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    monkeypatch.setenv("STAX_CACHE_DIR", str(root))
    with pytest.raises(CacheError, match="can be written by other users.*chmod go-w"):
        cache.cache_dir()
    out = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
    assert out.returncode != 0 and "can be written by other users" in out.stderr


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners")
def test_a_subfolder_others_can_write_is_refused(tmp_path):
    root = tmp_path / "cache"
    _warm(root)
    os.chmod(root / "cpp", 0o777)
    out = _python(PROGRAM, {"STAX_CACHE_DIR": str(root)})
    assert out.returncode != 0 and "can be written by other users" in out.stderr


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners")
def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path / "c"))
    (tmp_path / "c").mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(CacheError, match="belongs to another user"):
        cache.cache_dir()


# ---- faults ----


def _fake_cxx(tmp_path, body: str) -> str:
    script = tmp_path / "fake-c++"
    script.write_text("#!/bin/sh\n"
                      'case "$1" in --version) echo "fake-c++ 1.0"; exit 0;; esac\n' + body + "\n")
    script.chmod(0o755)
    return str(script)


SMALL = cache.prelude() + 'extern "C" void k(float* out) { out[0] = 1.0f; }\n'


def test_a_compiler_that_writes_nothing(tmp_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", _fake_cxx(tmp_path, "exit 0"))
    with pytest.raises(CppCompileError, match="exited successfully but wrote no library"):
        cache.load_cpp(SMALL, "void k(float* out);")
    assert not list((tmp_cache / "cpp").glob("*.so*"))
    assert not any((tmp_cache / "tmp").iterdir())


def test_a_compiler_that_writes_garbage(tmp_cache, tmp_path, monkeypatch):
    body = 'for a; do :; done; out=""; prev=""\nfor a; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\necho junk > "$out"'
    monkeypatch.setenv("CXX", _fake_cxx(tmp_path, body))
    with pytest.raises(CppCompileError, match="not a shared library"):
        cache.load_cpp(SMALL, "void k(float* out);")
    assert not list((tmp_cache / "cpp").glob("*.so*"))


def test_a_hung_compiler_is_stopped(tmp_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", _fake_cxx(tmp_path, "exec sleep 60"))
    monkeypatch.setenv("STAX_COMPILE_TIMEOUT", "1")
    t = time.perf_counter()
    with pytest.raises(CppCompileError, match=r"did not finish within 1 seconds.*STAX_COMPILE_TIMEOUT"):
        cache.load_cpp(SMALL, "void k(float* out);")
    assert time.perf_counter() - t < 20
    assert not list((tmp_cache / "cpp").glob("*.so*"))


def test_a_bad_timeout_setting_says_so(tmp_cache, monkeypatch):
    monkeypatch.setenv("STAX_COMPILE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="STAX_COMPILE_TIMEOUT='soon' is not a positive number"):
        cache.compile_timeout()


def test_a_failing_compiler_is_blamed_not_the_generator(tmp_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", _fake_cxx(tmp_path, 'echo "fake-c++: fatal: licence expired" >&2; exit 4'))
    with pytest.raises(CppCompileError) as ei:
        cache.load_cpp(SMALL, "void k(float* out);")
    msg = str(ei.value)
    assert msg.index("licence expired") < msg.index("command:")          # its message first
    assert "compiler or its flags are at fault" in msg and "bug in Stax" not in msg
    assert not ei.value.generated_code_at_fault


def test_bad_stax_cxxflags_are_blamed_not_the_generator(tmp_cache, monkeypatch):
    monkeypatch.setenv("STAX_CXXFLAGS", "-fno-such-flag-at-all")
    with pytest.raises(CppCompileError) as ei:
        cache.load_cpp(SMALL, "void k(float* out);")
    msg = str(ei.value)
    assert "-fno-such-flag-at-all" in msg.split("command:")[0]           # the compiler's message
    assert "STAX_CXXFLAGS='-fno-such-flag-at-all'" in msg and "bug in Stax" not in msg


def test_bad_generated_code_is_blamed_on_the_generator(tmp_cache):
    bad = cache.prelude() + 'extern "C" void k(float* out) { out[0] = no_such_name; }\n'
    with pytest.raises(CppCompileError) as ei:
        cache.load_cpp(bad, "void k(float* out);")
    assert "bug in Stax's C++ code generator" in str(ei.value) and ei.value.generated_code_at_fault
    assert str(ei.value).index("no_such_name") < str(ei.value).index("---- kernel source ----")


def test_a_killed_compile_leaves_nothing_for_long(tmp_cache, tmp_path):
    pidfile = tmp_path / "compiler.pid"
    cxx = _fake_cxx(tmp_path, f'echo $$ > {pidfile}\nexec sleep 60')
    code = f"""
        from stax import cache
        cache.load_cpp({SMALL!r}, "void k(float* out);")
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env={**os.environ, "CXX": cxx, "STAX_CACHE_DIR": str(tmp_cache),
                                 "PYTHONPATH": _pythonpath()})
    try:
        for _ in range(300):
            if pidfile.exists() and pidfile.read_text().strip():
                break
            time.sleep(0.05)
        assert pidfile.exists(), "the fake compiler never started"
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(int(pidfile.read_text()), signal.SIGKILL)           # the compiler it started
        except (OSError, ValueError):
            pass
    left = list((tmp_cache / "tmp").iterdir())
    assert left and all(p.name.startswith(f"{proc.pid}@") for p in left)   # named by its pid
    stray = cache.atomic_write(tmp_cache / "cpp" / "x", "1").with_name(f".x.{proc.pid}@{cache._NODE}.abc.tmp")
    stray.write_text("half")                                             # a half-written temp
    cache._swept = False
    cache.load_cpp(SMALL, "void k(float* out);")                         # the next compile sweeps
    assert not any((tmp_cache / "tmp").iterdir()) and not stray.exists()


def test_clear_during_compiles_does_not_fail_them(tmp_path):
    root = tmp_path / "cache"
    env = {"STAX_CACHE_DIR": str(root)}
    code = """
        import numpy as np, stax
        x = stax.from_numpy(np.arange(5, dtype=np.float32))
        for i in range(12):
            f = stax.compile(lambda x: (x * (i + 2) + 1).relu())
            assert np.asarray(f(x)).tolist() == ((np.arange(5) * (i + 2) + 1)).tolist()
        print("done")
    """
    stax.ones(1)
    full_env = {**os.environ, **env, "PYTHONPATH": _pythonpath()}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    clears = 0
    while proc.poll() is None:
        c = subprocess.run([sys.executable, "-m", "stax", "cache", "clear"], cwd=ROOT, env=full_env,
                           capture_output=True, text=True)
        assert c.returncode == 0, c.stderr
        clears += 1
    out, err = proc.communicate()
    assert proc.returncode == 0 and out.strip() == "done", err
    assert clears >= 2


def test_a_deleted_root_is_made_again_marked(tmp_cache):
    root = cache.cache_dir()
    import shutil
    shutil.rmtree(root)
    cache.atomic_write(root / "cpp" / "x", "1")
    assert (root / "CACHEDIR.TAG").exists() and stat.S_IMODE(root.stat().st_mode) == 0o700


# ---- no injection ----


class EvilInt(int):
    """Prints itself as code that sets a flag, were it ever pasted into source and run."""
    def __repr__(self):
        return f"__import__('builtins').__dict__.__setitem__('STAX_INJECTED', 1) or {int.__repr__(self)}"
    __str__ = __repr__

    def __format__(self, spec):
        return repr(self)


class EvilFloat(float):
    def __repr__(self):
        return f"(__import__('builtins').__dict__.__setitem__('STAX_INJECTED', 1) or {float.__repr__(self)})"
    __str__ = __repr__

    def __format__(self, spec):
        return repr(self)


class SneakyInt(int):
    """Converts itself to the hostile subclasses (int()/float() may return subclasses)."""
    def __int__(self):
        return EvilInt(int.__int__(self))

    def __float__(self):
        return EvilFloat(int.__int__(self))
    __repr__ = EvilInt.__repr__
    __str__ = EvilInt.__str__


E = EvilInt
CASES = {
    "reshape size": (lambda x: x.reshape(E(2), E(3)) * 2, lambda a: a.reshape(2, 3) * 2),
    "view size": (lambda x: x.view(E(3), E(2)) + 1, lambda a: a.reshape(3, 2) + 1),
    "expand size": (lambda x: x.unsqueeze(E(0)).expand(E(2), E(6)) + 1,
                    lambda a: np.broadcast_to(a, (2, 6)) + 1),
    "slice bounds": (lambda x: x[E(1):E(5):E(2)] * 2, lambda a: a[1:5:2] * 2),
    "int constant": (lambda x: x * E(3), lambda a: a * 3),
    "float constant": (lambda x: x * EvilFloat(1.5), lambda a: a * 1.5),
    "converting constant": (lambda x: x * SneakyInt(4), lambda a: a * 4),
    "int tensor constant": (lambda x: x.to(stax.int64) + SneakyInt(2), lambda a: a.astype(np.int64) + 2),
    "kwarg": (lambda x: x.cumsum(dim=E(0)) + x.sum(dim=E(0)), lambda a: np.cumsum(a) + a.sum()),
    "matmul of reshapes": (lambda x: x.reshape(E(2), E(3)) @ x.reshape(E(3), E(2)),
                           lambda a: a.reshape(2, 3) @ a.reshape(3, 2)),
}


@pytest.mark.filterwarnings("ignore:.*returned non-(int|float):DeprecationWarning")   # SneakyInt
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_numbers_are_printed_as_numbers(case, device):
    fn, ref = CASES[case]
    a = np.arange(6, dtype=np.float32)
    x = stax.from_numpy(a)
    if device == "cuda":
        x = x.to("cuda")
    gen = stax.generate(fn, x)
    text = "\n".join(gen.kernels.values()) + "\n" + gen.wrapper
    assert "__import__" not in text and "STAX_INJECTED" not in text
    out = stax.compile(fn)(x)
    assert not hasattr(builtins, "STAX_INJECTED")
    out = np.asarray(out.cpu() if device == "cuda" else out)
    np.testing.assert_allclose(out, ref(a), rtol=1e-6)


def test_printers_normalize_or_refuse():
    class EvilStr(str):
        def __repr__(self):
            return "__import__('os')"
    assert wrapper.pylit(EvilStr("floor")) == "'floor'"
    assert wrapper.pylit(EvilFloat(2.5)) == "2.5" and wrapper.pylit(float("inf")) == "float('inf')"
    assert wrapper.pylit((E(1), [E(2)], None, True)) == "(1, [2], None, True)"
    assert wrapper.pyshape((E(4),)) == "(4,)" and wrapper.pyname(EvilStr("buf0")) == "buf0"
    for bad in ("a; b", "x)", "__import__('os')", "for", "b\u00e9"):
        with pytest.raises(ValueError, match="not a plain identifier"):
            wrapper.pyname(bad)
    with pytest.raises(TypeError):
        wrapper.pylit(object())
    import sympy
    with pytest.raises((TypeError, ValueError)):
        wrapper.pysize(sympy.Symbol("__import__('os').system('x')"))
    with pytest.raises((TypeError, ValueError)):
        wrapper.pysize(sympy.Function("exec")(sympy.Integer(1)))
    u = sympy.Symbol("u0", integer=True)
    assert wrapper.pysize(2 * u + 1) == "2*u0 + 1"
