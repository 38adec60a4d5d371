"""Shared test helpers for Stax.

- `assert_close(actual, expected, dtype)`: docs/DESIGN.md's tolerances; importable as
  `from conftest import assert_close` and also a fixture of the same name.
- `STAX_CACHE_DIR`: pointed at a fresh temporary folder for the session unless already set
  (set in `pytest_configure`, before collection imports stax, so that a module-level
  default cannot capture the user's cache).
- `rng`: a numpy Generator seeded from the test's node id (different per test,
  the same on every run).
- `@pytest.mark.gpu`: skipped unless `stax.cuda` imports and reports a device.
- `GENERATED_TRITON_KERNELS`: every Triton kernel text the session generated (recorded around
  `codegen_triton.generate`), for tests/test_zz_sm90.py.
- `REPORT_LINES`: lines printed in pytest's closing summary, even under -q (the random-program counts).
- `run_outside_interpreter(script, *args)`: a Python script in a process of its own without
  TRITON_INTERPRET (sm_90 builds), from the repository root; the JSON of its last stdout line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

# ---- sm_90 builds in a process of their own ----


def run_outside_interpreter(script: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Run `python -c script *args` from the repository root with TRITON_INTERPRET unset (this
    session's triton runs as the interpreter, which builds nothing), `env` added; it must exit 0.
    Returns the JSON of the last line it printed."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env or {})
    r = subprocess.run([sys.executable, "-c", script, *args], env=full, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent.parent, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- tolerances (docs/DESIGN.md, Tests) ----

# dtype name -> (rtol, atol); dtypes not listed here (ints, bool) compare exactly.
TOLERANCES = {
    "float32": (1e-4, 1e-5),
    "float64": (1e-7, 1e-9),
    "float16": (2e-3, 1e-4),
    "bfloat16": (1.6e-2, 1e-3),
}
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
            "long": "int64", "int": "int32", "bool_": "bool"}


def call_from_threads(f, xs, w, refs, picks_per_thread) -> tuple:
    """Call f(xs[i], w) from one thread per list of picks, switching every microsecond, reading
    each result at once: (the picks whose result differed from refs[i], results read, results
    overwritten by the other thread's replay before they were read: OverwrittenOutputError)."""
    import threading
    from stax import cudagraph
    bad, read, overwritten = [], [0], [0]

    def run(picks):
        for i in picks:
            out = f(xs[i], w)
            try:
                got = out.cpu()
            except cudagraph.OverwrittenOutputError:
                overwritten[0] += 1
                continue
            read[0] += 1
            if not np.allclose(np.asarray(got, np.float64), refs[i], rtol=1e-5, atol=1e-5):
                bad.append(i)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(picks,)) for picks in picks_per_thread]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    return bad, read[0], overwritten[0]


def _dtype_name(dtype) -> str:
    """'float32' for np.float32, np.dtype('float32'), 'float32', stax.float32, torch.float32..."""
    if dtype is None:
        raise TypeError("dtype is None")
    if isinstance(dtype, type) and issubclass(dtype, np.generic):
        name = np.dtype(dtype).name
    elif isinstance(dtype, np.dtype):
        name = dtype.name
    else:
        name = getattr(dtype, "name", None)
        if not isinstance(name, str):
            name = str(dtype)
    name = name.rsplit(".", 1)[-1].strip().lower()  # 'stax.float32' -> 'float32'
    return _ALIASES.get(name, name)


def _bf16_words_to_f32(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def _to_numpy(x, name: str | None) -> np.ndarray:
    if isinstance(x, np.ndarray):
        a = x
    elif hasattr(x, "numpy") and callable(x.numpy):
        a = np.asarray(x.numpy())
    else:
        a = np.asarray(x)
    # bfloat16 stored as raw 16-bit words (as stax does): reinterpret, do not convert.
    if name == "bfloat16" and a.dtype == np.uint16:
        a = _bf16_words_to_f32(a)
    return a


def assert_close(actual, expected, dtype=None, *, rtol=None, atol=None, msg: str = "") -> None:
    """Assert `actual` matches the reference `expected` within `dtype`'s tolerance.

    `dtype` picks the tolerance (default: `actual`'s dtype). Floats: shapes equal, NaNs at
    the same positions, infinities at the same positions with the same sign, and elsewhere
    |actual - expected| <= atol + rtol * |expected|. Integers and bools: exactly equal.
    `rtol`/`atol` override the table for one call.
    """
    if dtype is None:
        dtype = getattr(actual, "dtype", None)
        if dtype is None:
            dtype = np.asarray(actual).dtype
    name = _dtype_name(dtype)
    a = _to_numpy(actual, name)
    e = _to_numpy(expected, None)
    where = f" ({msg})" if msg else ""
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch{where}: actual {a.shape}, expected {e.shape}")

    if name not in TOLERANCES:  # ints, bools: exact
        if a.dtype.kind == "f" or e.dtype.kind == "f":
            eq = (a == e) | (np.isnan(a.astype(np.float64)) & np.isnan(e.astype(np.float64)))
        else:
            eq = a == e
        bad = ~np.asarray(eq)
        if bad.any():
            _fail(f"{name} values differ{where}", a, e, bad)
        return

    table_rtol, table_atol = TOLERANCES[name]
    rtol = table_rtol if rtol is None else rtol
    atol = table_atol if atol is None else atol
    a64 = a.astype(np.float64)
    e64 = e.astype(np.float64)

    nan_a, nan_e = np.isnan(a64), np.isnan(e64)
    if (nan_a != nan_e).any():
        _fail(f"NaN positions differ{where}", a, e, nan_a != nan_e)
    inf_a, inf_e = np.isinf(a64), np.isinf(e64)
    bad_inf = (inf_a != inf_e) | (inf_a & inf_e & (np.sign(a64) != np.sign(e64)))
    if bad_inf.any():
        _fail(f"infinities differ{where}", a, e, bad_inf)

    finite = ~(nan_a | inf_a | inf_e)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.where(finite, np.abs(a64 - e64), 0.0)
        bad = err > atol + rtol * np.abs(np.where(finite, e64, 0.0))
    if bad.any():
        _fail(f"{name} values not close (rtol={rtol:g}, atol={atol:g}){where}", a, e, bad,
              err=err)


def _fail(what: str, a: np.ndarray, e: np.ndarray, bad: np.ndarray, err=None):
    bad = np.asarray(bad)
    n_bad = int(bad.sum())
    idx = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
    lines = [f"{what}: {n_bad} of {bad.size} elements",
             f"  first at index {idx}: actual {a[idx].item()!r}, expected {e[idx].item()!r}"]
    if err is not None:
        scale = np.abs(e.astype(np.float64))
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(bad, err / scale, 0.0)
        lines.append(f"  max abs error {float(np.max(np.where(bad, err, 0.0))):.3e}, "
                     f"max rel error {float(np.nanmax(rel)):.3e}")
    raise AssertionError("\n".join(lines))


@pytest.fixture(name="assert_close")
def _assert_close_fixture():
    return assert_close


# ---- a cold, private kernel cache ----

_OWN_CACHE_DIR: str | None = None


def pytest_addoption(parser):
    parser.addoption("--regen-goldens", action="store_true",
                     help="rewrite tests/golden/ from the current code generators")


def pytest_configure(config):
    global _OWN_CACHE_DIR
    # no GPU: device="cuda" tests run their Triton kernels in Triton's interpreter on host memory
    if _gpu_unavailable_reason() is not None:
        os.environ["TRITON_INTERPRET"] = "1"
    if not os.environ.get("STAX_CACHE_DIR"):
        _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="stax-test-cache-")
        os.environ["STAX_CACHE_DIR"] = _OWN_CACHE_DIR
    _record_triton_kernels()


# ---- every Triton kernel the session prints (tests/test_zz_sm90.py builds them for sm_90) ----

GENERATED_TRITON_KERNELS: dict = {}      # kernel source -> kernel name


def _record_triton_kernels():
    from stax import codegen_triton
    plain = codegen_triton.generate
    if getattr(plain, "records_kernels", False):
        return

    def generate(sched):
        module = plain(sched)
        for name, source in module.kernels.items():
            GENERATED_TRITON_KERNELS.setdefault(source, name)
        return module
    generate.records_kernels = True
    codegen_triton.generate = generate


# ---- lines for pytest's closing summary (tests/test_random_programs.py's counts) ----

REPORT_LINES: list = []


def pytest_terminal_summary(terminalreporter):
    for line in REPORT_LINES:
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    global _OWN_CACHE_DIR
    if _OWN_CACHE_DIR is not None:
        if os.environ.get("STAX_CACHE_DIR") == _OWN_CACHE_DIR:
            del os.environ["STAX_CACHE_DIR"]
        shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)
        _OWN_CACHE_DIR = None


@pytest.fixture(scope="session", autouse=True)
def stax_cache_dir(tmp_path_factory) -> Path:
    """The session's STAX_CACHE_DIR (a fresh temporary folder unless the caller set one)."""
    if not os.environ.get("STAX_CACHE_DIR"):
        os.environ["STAX_CACHE_DIR"] = str(tmp_path_factory.mktemp("stax-cache"))
    return Path(os.environ["STAX_CACHE_DIR"])


# ---- reproducible randomness ----

def seed_for(nodeid: str) -> int:
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:8], "little")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """numpy Generator seeded from the test's node id: fresh per test, same every run."""
    return np.random.default_rng(seed_for(request.node.nodeid))


# ---- §9.8 cuBLASLt: only tests/test_cublas.py sees it ----


@pytest.fixture(autouse=True)
def _templates_only(request, monkeypatch):
    """Where nvidia-cublas is installed (the H200 with torch), generated code would carry a
    cuBLASLt branch beside each template; the other test files count kernels and compare goldens
    as the templates alone print them, so they see no library. test_cublas.py tests that branch."""
    if request.module.__name__ != "test_cublas":
        from stax import cublas
        monkeypatch.setattr(cublas, "library_path", lambda: None)


# ---- @pytest.mark.gpu ----

def _gpu_unavailable_reason() -> str | None:
    """None when a GPU can be used, else why not. stax.cuda is imported lazily."""
    try:
        from stax import cuda
    except Exception as exc:  # noqa: BLE001 - any failure means "no GPU here"
        return f"stax.cuda not importable ({type(exc).__name__}: {exc})"
    try:
        if not cuda.is_available():
            return "no NVIDIA GPU (stax.cuda.is_available() is False)"
    except Exception as exc:  # noqa: BLE001
        return f"stax.cuda.is_available() failed ({type(exc).__name__}: {exc})"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {reason}")
    for item in gpu_items:
        item.add_marker(skip)
