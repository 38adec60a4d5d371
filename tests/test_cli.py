"""The command line (`python -m stax`) and the examples.

- `python -m stax run FILE --show kernels` runs the script, prints the kernel and a summary;
- `python -m stax cache clear` empties the cache; `--help` works; bad options say what is wrong;
- every file in examples/ runs (in-process through the CLI's `run`, to stay fast) and passes its
  own check against numpy.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def stax_cli(*args, cwd=ROOT, env=None, timeout=300):
    """Run `python -m stax ARGS` in a subprocess (the session's STAX_CACHE_DIR is inherited)."""
    e = dict(os.environ)
    e.pop("STAX_LOGS", None)
    # from a checkout, `python -m stax` finds the package in the working folder; elsewhere it
    # needs the installed (or PYTHONPATH) package
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "stax", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_run_example_shows_kernel_and_summary():
    p = stax_cli("run", "examples/ex1_1_relu_sum.py", "--show", "kernels")
    assert p.returncode == 0, p.stderr
    # the script's own output
    assert "matches numpy: OK" in p.stdout
    # --show kernels: the fused kernel, on stderr
    assert "==== stax kernels: relu_sum ====" in p.stderr
    assert 'extern "C" void cpp_fused_0(' in p.stderr
    assert "// cpp_fused_0: computes add, relu, mul, sum" in p.stderr
    # stages not asked for are not shown
    assert "==== stax wrapper" not in p.stderr and "==== stax graph" not in p.stderr
    # the summary
    out = p.stdout
    assert "==== stax summary: 1 compiled function(s)" in out
    assert "relu_sum" in out and "kernels: 1" in out
    assert "fuses 4 node(s): add, relu, mul, sum" in out
    # Example 1.1 fused into one kernel meets the Prop. 1.1 bound: 2*64*128*4 + 64*4 bytes
    assert "(65,792 B); lower bound" in out and "ratio 1.00" in out
    assert "time per call: compiled" in out and "eager" in out


def test_run_from_another_folder_with_script_args(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, stax\n"
        "assert __name__ == '__main__'\n"
        "print('argv', sys.argv[1:])\n"
        "f = stax.compile(lambda x: (x * 2).sum())\n"
        "print('value', f(stax.ones(8)).item())\n"
        "sys.exit(3)\n")
    p = stax_cli("run", str(script), "--show", "graph", "--no-timing", "--", "a", "--b",
                 cwd=tmp_path)
    assert p.returncode == 3, p.stderr            # the script's exit status is kept
    assert "argv ['a', '--b']" in p.stdout
    assert "value 16.0" in p.stdout
    assert "==== stax graph: <lambda> ====" in p.stderr
    assert "==== stax summary: 1 compiled function(s)" in p.stdout
    assert "time per call" not in p.stdout        # --no-timing


def test_cache_clear(tmp_path):
    cache = tmp_path / "cache"
    env = {"STAX_CACHE_DIR": str(cache)}
    p = stax_cli("run", "examples/ex1_1_relu_sum.py", "--no-summary", env=env)
    assert p.returncode == 0, p.stderr
    assert any(cache.rglob("*.so")), "the run should have cached a compiled kernel"
    p = stax_cli("cache", "clear", env=env)
    assert p.returncode == 0, p.stderr
    assert "removed" in p.stdout and str(cache) in p.stdout
    # every file Stax cached is gone; the marker that says the folder is Stax's stays
    assert [f.name for f in cache.rglob("*") if f.is_file()] == ["CACHEDIR.TAG"]
    p = stax_cli("cache", "dir", env=env)
    assert p.stdout.strip() == str(cache)


def test_help_and_bad_arguments():
    p = stax_cli("--help")
    assert p.returncode == 0 and "run" in p.stdout and "cache" in p.stdout
    p = stax_cli()
    assert p.returncode == 0 and "usage" in p.stdout
    p = stax_cli("run", "examples/ex1_1_relu_sum.py", "--show", "kernals")
    assert p.returncode == 2 and "unknown stage(s) kernals" in p.stderr
    p = stax_cli("run", "no_such_file.py")
    assert p.returncode == 2 and "no such file" in p.stderr


def test_device_cuda_without_a_gpu_says_so():
    """--device cuda with no GPU (forced with STAX_DISABLE_CUDA=1) is a clear error, exit 2."""
    env = {"STAX_DISABLE_CUDA": "1", "TRITON_INTERPRET": "0"}
    p = stax_cli("run", "examples/ex1_1_relu_sum.py", "--device", "cuda", "--no-timing", env=env)
    assert p.returncode == 2, p.stderr
    assert "stax: --device cuda" in p.stderr and "GPU" in p.stderr


def test_device_cuda_runs_the_example_on_the_gpu_back_end():
    """--device cuda: the example's tensors live on the GPU (here: Triton's interpreter)."""
    p = stax_cli("run", "examples/ex1_1_relu_sum.py", "--device", "cuda", "--show", "kernels",
                 "--no-timing", env={"TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr
    assert "triton_per_fused_0" in p.stdout + p.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_and_checks(path, capsys, monkeypatch):
    """Each example runs under the CLI's `run` (in-process) and its numpy check passes."""
    from stax.__main__ import run
    monkeypatch.delenv("STAX_LOGS", raising=False)
    code = run(str(path), show=[], timing=False)
    out = capsys.readouterr().out
    assert code == 0
    assert "matches numpy: OK" in out
    assert "==== stax summary" in out and "kernels:" in out
