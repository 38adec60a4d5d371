"""§8 C++ code generation and its runtime, through `stax.compile`: 64-bit indexing past 2^31
elements, a kernel the compiler rejects (the message shows the kernel and the compiler's error),
a missing C++ compiler, the on-disk cache seen from a new process, and deterministic kernel text."""
import dataclasses
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import stax
from stax import cache, codegen_cpp, op_table
from conftest import assert_close

ROOT = Path(__file__).resolve().parents[1]


def _python(code, env, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=ROOT, env={**env, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}, timeout=timeout)


# ---- 64-bit indexing ----


def test_more_than_2_pow_31_elements_use_int64_indices():
    n = 2 ** 31 + 5
    x = stax.tensor([0.5])
    fn = lambda x: x.expand(n).sum()                     # noqa: E731  (no 8 GB allocation)
    src = "\n".join(stax.generate(fn, x).kernels.values())
    assert str(n) in src
    loops = re.findall(r"for \((\w+) (\w+) = ", src)
    assert loops and all(t == "int64_t" for t, v in loops if not v == "l"), loops
    assert not re.search(r"\bint32_t\b|\bunsigned\b|\bint (?!l\b)", src)
    out = stax.compile(fn)(x)
    assert_close(out, np.float64(n) * 0.5, "float32")


def test_wide_rows_index_in_int64():
    """A 2-D view whose flat index passes 2^31: the index arithmetic must not wrap in int."""
    x = stax.tensor([1.0, 2.0, 3.0])
    fn = lambda x: x.unsqueeze(1).expand(3, 2 ** 31 + 1).amax(-1)   # noqa: E731
    src = "\n".join(stax.generate(fn, x).kernels.values())
    assert "int64_t r" in src and "int r" not in src


# ---- compiler errors ----


def test_a_kernel_that_fails_to_compile_shows_the_kernel_and_the_compiler_message(monkeypatch):
    exp = dataclasses.replace(op_table.BY_HANDLER["exp"], cpp="stax_no_such_function")
    monkeypatch.setitem(op_table.BY_HANDLER, "exp", exp)
    with pytest.raises(cache.CppCompileError) as ei:
        stax.compile(lambda x: x.exp() + 1)(stax.ones(7))
    msg = str(ei.value)
    assert "cpp_fused_0" in msg and "stax_no_such_function(" in msg        # the kernel source
    assert "was not declared" in msg or "undeclared" in msg               # the compiler's message
    assert "---- compiler stderr ----" in msg


def test_missing_compiler_is_a_clear_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path), STAX_CACHE_DIR=str(tmp_path / "cache"))
    out = _python("""
        import stax
        try:
            stax.compile(lambda x: x * 2 + 1)(stax.ones(5))
        except RuntimeError as e:
            print("ERROR:", e)
    """, env)
    assert out.returncode == 0, out.stderr
    assert "ERROR: Stax needs a C++ compiler" in out.stdout and "set CXX" in out.stdout


# ---- the on-disk cache across processes ----


def test_second_process_reuses_the_disk_cache_without_the_compiler(tmp_path):
    env = {**os.environ, "STAX_CACHE_DIR": str(tmp_path / "cache")}
    program = """
        import numpy as np, stax
        f = stax.compile(lambda x, y: stax.softmax(x @ y + 1, -1).sum(0))
        x = stax.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
        y = stax.from_numpy(np.ones((4, 5), np.float32))
        print(repr(np.asarray(f(x, y)).tolist()))
    """
    warm = _python(program, env)
    assert warm.returncode == 0, warm.stderr
    assert list((tmp_path / "cache" / "cpp").glob("*.so"))
    # any attempt to start a process (the compiler, or even `g++ --version`) fails loudly
    cold_env = env
    guard = """
        import subprocess
        def no_processes(*a, **k):
            raise SystemExit("a subprocess was started on a cache hit: " + repr(a[:1]))
        subprocess.run = subprocess.Popen = subprocess.check_output = no_processes
    """
    hit = _python(textwrap.dedent(guard) + textwrap.dedent(program), cold_env)
    assert hit.returncode == 0, hit.stderr + hit.stdout
    assert hit.stdout == warm.stdout
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 10
    z = x @ np.ones((4, 5)) + 1
    e = np.exp(z - z.max(-1, keepdims=True))
    assert_close(np.array(eval(hit.stdout)), (e / e.sum(-1, keepdims=True)).sum(0), "float32")


# ---- kernel text ----


def test_generated_code_is_deterministic_and_names_its_nodes():
    fn = lambda x, y: (stax.relu(x + y) * 2).sum(-1)       # noqa: E731
    a = stax.generate(fn, stax.randn(64, 128), stax.randn(64, 128))
    b = stax.generate(fn, stax.randn(64, 128), stax.randn(64, 128))
    assert str(a) == str(b) and a.kernels == b.kernels and a.wrapper == b.wrapper
    text = str(a)
    assert "/tmp" not in text and os.path.expanduser("~") not in text
    src = a.kernels["cpp_fused_0"]
    assert src.startswith("// cpp_fused_0: computes add, relu, mul, sum")
    assert "#pragma omp" in src
    assert "def call(args):" in a.wrapper and "assert_size_stride(arg0_1, (64, 128), (128, 1))" in a.wrapper


def test_transposed_pointwise_is_tiled():
    src = stax.generate(lambda x, y: x.t() + y, stax.randn(128, 64), stax.randn(64, 128)).kernels["cpp_fused_0"]
    assert "_tile" in src


def test_max_propagates_nan_in_generated_code():
    a = np.array([[1.0, np.nan, 3.0], [np.nan, -1.0, -2.0], [0.5, 0.25, 2.0]], np.float32)
    x = stax.from_numpy(a)
    got = stax.compile(lambda x: (x.amax(-1), stax.maximum(x, 1.0), stax.minimum(x, 1.0)))(x)
    assert_close(got[0], np.array([np.nan, np.nan, 2.0]), "float32")
    assert_close(got[1], np.maximum(a, 1.0), "float32")
    assert_close(got[2], np.minimum(a, 1.0), "float32")


def test_cat_loads_each_part_only_inside_its_range():
    """Every load of a cat is guarded by its part's range (found with AddressSanitizer: the last
    part used to be loaded unconditionally, reading before its buffer for the other parts' rows)."""
    xs = [stax.randn(5, 7), stax.randn(3, 7), stax.randn(2, 7)]
    src = stax.generate(lambda a, b, c: stax.cat([a, b * 2, c], 0), *xs).kernels
    (text,) = src.values()
    inside = False
    for line in text.splitlines():
        if "[&]() ->" in line:
            inside = True
        elif line.strip() == "}();":
            inside = False
        elif "in_ptr" in line and "[" in line:
            assert inside, f"unguarded load in a cat kernel: {line.strip()}"
