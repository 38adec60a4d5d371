"""CPU benchmark: Stax against numpy, the memory-bandwidth floor and (when installed) torch.compile.

    python bench/cpu.py                      # every workload of ANCHORS.md's CPU table
    python bench/cpu.py --only ex1_1,softmax --runs 20
    python bench/cpu.py --torch-python /tmp/benchvenv/bin/python   # torch from another venv

For each workload, at ANCHORS.md's shapes, one run prints:
  - Stax: median time of a compiled call (after a warm-up call), over --runs calls (the min too:
    on a shared machine it is the steadier number);
  - numpy: the same computation written naturally in float32 numpy (median of fewer calls);
  - the floor (Prop. 1.1): bytes of every input read once + every output written once, over the
    copy bandwidth measured in this run (np.copyto of a 256 MB array into a preallocated one,
    counting the bytes read and written); frac = floor / Stax time (1.0 = memory speed);
  - Stax's cold compile (capture .. g++ .. dlopen, `stats["compile_seconds"]`, fresh cache dir);
  - torch.compile (default Inductor, same thread count), in a separate process so that its OpenMP
    runtime and Stax's never share one; its first call (compile + one run) in a fresh
    TORCHINDUCTOR_CACHE_DIR; the ratio Stax / torch.compile (target <= 1.25).
Then two process-level measurements:
  - cold: a new process, fresh cache dir, `import stax`, first call of a one-kernel function:
    seconds after `import stax` (target < 1.5 s);
  - hit: a new process whose first call finds the kernel in the on-disk cache: seconds after
    `import stax` (target < 0.2 s), and whether triton was imported (it must not be).
numpy runs first, before any Stax kernel, so that OpenMP threads still spinning after a Stax
kernel cannot slow it. torch is never a dependency of Stax: only this script uses it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
INV_SQRT2 = 1 / math.sqrt(2)
INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
GELU_G = 0.7      # ANCHORS' gelu: g * (Phi(h) + h*phi(h)) with g = 0.7 (one 64M input, one output)


# ---- Workloads: inputs, and the computation in each framework's natural spelling ----


def _erf_np(x):
    """numpy has no erf (and scipy is not a dependency): Abramowitz & Stegun 7.1.26 in float32,
    |error| < 1.5e-7, the way a numpy user would write it."""
    s = np.sign(x)
    a = np.abs(x)
    t = np.float32(1) / (np.float32(1) + np.float32(0.3275911) * a)
    poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (
        np.float32(1.421413741) + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
    return s * (np.float32(1) - poly * np.exp(-a * a))


def workloads():
    """name -> dict(shape text, inputs (seeded float32 numpy arrays, made lazily), stax, numpy,
    torch, memory_bound)."""
    def rand(*shapes):
        def make():
            rng = np.random.default_rng(0)
            return [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        return make

    def stax_gelu(h, S):
        return GELU_G * (0.5 * (1 + S.erf(h * INV_SQRT2)) + h * S.exp(-0.5 * h * h) * INV_SQRT_2PI)

    def stax_layernorm(x, w, b, S):
        return S.layer_norm(x, (x.shape[-1],), w, b)

    def np_softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def np_layernorm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + np.float32(1e-5)) * w + b

    return {
        "ex1_1": dict(
            shape="8192x4096", inputs=rand((8192, 4096), (8192, 4096)),
            stax=lambda S: (lambda x, y: (S.relu(x + y) * 2).sum(-1)),
            numpy=lambda x, y: (np.maximum(x + y, 0) * 2).sum(-1),
            torch=lambda T: (lambda x, y: (T.relu(x + y) * 2).sum(-1))),
        "ex6_1": dict(
            shape="x 4096x8192, y 8192x4096", inputs=rand((4096, 8192), (8192, 4096)),
            stax=lambda S: (lambda x, y: x.t() + y),
            numpy=lambda x, y: x.T + y,
            torch=lambda T: (lambda x, y: x.t() + y)),
        "gelu": dict(
            shape="64M (8192x8192)", inputs=rand((8192, 8192)),
            stax=lambda S: (lambda h: stax_gelu(h, S)),
            numpy=lambda h: GELU_G * (0.5 * (1 + _erf_np(h * np.float32(INV_SQRT2)))
                                      + h * np.exp(np.float32(-0.5) * h * h) * np.float32(INV_SQRT_2PI)),
            torch=lambda T: (lambda h: stax_gelu(h, T))),
        "ex6_2": dict(
            shape="64x4194304", inputs=rand((64, 4194304)),
            stax=lambda S: (lambda x: (x * x).sum(-1)),
            numpy=lambda x: (x * x).sum(-1),
            torch=lambda T: (lambda x: (x * x).sum(-1))),
        "softmax": dict(
            shape="32768x1000", inputs=rand((32768, 1000)),
            stax=lambda S: (lambda x: S.softmax(x, -1)),
            numpy=np_softmax,
            torch=lambda T: (lambda x: T.softmax(x, -1))),
        "layernorm": dict(
            shape="32768x1024, w, b", inputs=rand((32768, 1024), (1024,), (1024,)),
            stax=lambda S: (lambda x, w, b: stax_layernorm(x, w, b, S)),
            numpy=np_layernorm,
            torch=lambda T: (lambda x, w, b: T.nn.functional.layer_norm(x, (x.shape[-1],), w, b))),
        "mm_bias_relu": dict(
            shape="2048^3", inputs=rand((2048, 2048), (2048, 2048), (2048,)),
            stax=lambda S: (lambda a, b, bias: S.relu(a @ b + bias)),
            numpy=lambda a, b, bias: np.maximum(a @ b + bias, 0),
            torch=lambda T: (lambda a, b, bias: T.relu(a @ b + bias)),
            memory_bound=False),
    }


def _out_bytes(name, inputs):
    """Bytes of the outputs (for the floor)."""
    if name in ("ex1_1", "ex6_2"):
        return inputs[0].shape[0] * 4
    if name == "mm_bias_relu":
        return inputs[0].shape[0] * inputs[1].shape[1] * 4
    return max(a.nbytes for a in inputs)       # same shape as the (largest) input


# ---- Timing ----


WARMUP_SECONDS = 2.0


def median_time(fn, args, runs, warmup=1, best=False):
    """Median seconds of fn(*args) over `runs` calls after `warmup` calls and at least
    WARMUP_SECONDS of calls (with best=True: (median, min); the min is robust to other processes
    sharing the machine). The time-based warm-up matters on this host: the first seconds of a
    process that touches large fresh arrays run up to 4x slower (transparent huge pages are
    assembled in the background: `x.t() + y` measured 180 ms a call, then 38 ms), so every
    contender (Stax, numpy, torch.compile) gets the same steady state."""
    t_end = time.perf_counter() + WARMUP_SECONDS
    done = 0
    while done < warmup or time.perf_counter() < t_end:
        fn(*args)
        done += 1
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t0)
    return (statistics.median(ts), min(ts)) if best else statistics.median(ts)


def copy_bandwidth(nbytes=256 * 2**20, runs=10) -> float:
    """Bytes per second of np.copyto between two preallocated 256 MB arrays (read + write)."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    t = median_time(lambda: np.copyto(dst, src), (), runs, warmup=2)
    return 2 * nbytes / t


# ---- torch.compile, in its own process ----


def torch_worker(names, runs, threads):
    import torch
    torch.set_num_threads(threads)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    for name in names:
        w = workloads()[name]
        args = [torch.from_numpy(a) for a in w["inputs"]()]
        fn = torch.compile(w["torch"](torch))
        t0 = time.perf_counter()
        fn(*args)
        first = time.perf_counter() - t0
        t, tmin = median_time(fn, args, runs, best=True)
        out[name] = {"ms": t * 1e3, "min_ms": tmin * 1e3, "cold_s": first - t}
        del args
        print(json.dumps({name: out[name]}), file=sys.stderr, flush=True)
    print(json.dumps(out))


def run_torch(python, names, runs, threads):
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-inductor-")
    cmd = [python, str(Path(__file__).resolve()), "--torch-worker", "--only", ",".join(names),
           "--runs", str(runs), "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(f"torch.compile worker failed:\n{p.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def _has_torch(python) -> bool:
    p = subprocess.run([python, "-c", "import torch"], capture_output=True)
    return p.returncode == 0


# ---- New-process probes: cold compile, cache hit ----

PROBE = r"""
import sys, time, json
t0 = time.perf_counter()
import stax
t1 = time.perf_counter()
x = stax.randn(1024, 1024); y = stax.randn(1024, 1024)
t2 = time.perf_counter()
f = stax.compile(lambda x, y: (stax.relu(x + y) * 2).sum(-1))
f(x, y)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "first_call_s": t3 - t2, "triton": "triton" in sys.modules,
                  "sympy": "sympy" in sys.modules}))
"""


def probe(cache, reps):
    env = dict(os.environ, STAX_CACHE_DIR=cache)
    env.pop("STAX_LOGS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    results = []
    for _ in range(reps):
        p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                           cwd=tempfile.gettempdir())
        if p.returncode != 0:
            raise RuntimeError(p.stderr)
        results.append(json.loads(p.stdout))
    return results


# ---- Main ----


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--runs", type=int, default=20, help="timed calls per workload (median)")
    ap.add_argument("--numpy-runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="threads (default: Stax's default)")
    ap.add_argument("--torch-python", default="", help="a Python with torch (default: this one)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    all_w = workloads()
    names = [n for n in a.only.split(",") if n] or list(all_w)
    for n in names:
        if n not in all_w:
            ap.error(f"unknown workload {n}; choose from {', '.join(all_w)}")
    if a.torch_worker:
        return torch_worker(names, a.runs, a.threads)

    sys.path.insert(0, str(ROOT))
    os.environ.pop("STAX_LOGS", None)
    import stax
    threads = a.threads or stax.get_num_threads()
    stax.set_num_threads(threads)
    import platform
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    print(f"# bench/cpu.py  {time.strftime('%Y-%m-%d %H:%M')}  {model}, {os.cpu_count()} logical CPUs, "
          f"{threads} threads; numpy {np.__version__}; runs={a.runs}")

    bw = copy_bandwidth()
    print(f"copy bandwidth (np.copyto 256 MB, read+write): {bw / 1e9:.1f} GB/s")

    rows = {n: {} for n in names}
    # numpy first: no Stax OpenMP threads exist yet to compete with it
    for n in names:
        w = all_w[n]
        args = w["inputs"]()
        rows[n]["bytes"] = sum(x.nbytes for x in args) + _out_bytes(n, args)
        rows[n]["numpy_ms"] = median_time(w["numpy"], args, a.numpy_runs) * 1e3
        print(f"numpy  {n:<13} {rows[n]['numpy_ms']:9.1f} ms", flush=True)
        del args

    for n in names:
        w = all_w[n]
        os.environ["STAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-stax-")   # cold compile
        arrays = w["inputs"]()
        args = [stax.from_numpy(x) for x in arrays]
        f = stax.compile(w["stax"](stax))
        out = f(*args)
        rows[n]["stax_cold_s"] = f.stats["compile_seconds"]
        got = out.numpy()
        want = w["numpy"](*arrays)
        err = float(np.max(np.abs(got - want) / (1e-3 + np.abs(want))))
        rows[n]["max_rel_err_vs_numpy"] = err
        del out, got, want
        rows[n]["kernels"] = len(f.last_generated.kernels)
        t, tmin = median_time(f, args, a.runs, best=True)
        rows[n]["stax_ms"], rows[n]["stax_min_ms"] = t * 1e3, tmin * 1e3
        if w.get("memory_bound", True):
            rows[n]["floor_ms"] = rows[n]["bytes"] / bw * 1e3
            rows[n]["frac"] = rows[n]["floor_ms"] / rows[n]["stax_ms"]
        print(f"stax   {n:<13} {rows[n]['stax_ms']:9.1f} ms  cold compile {rows[n]['stax_cold_s']:.2f} s  "
              f"kernels {rows[n]['kernels']}  max rel err vs numpy {err:.1e}", flush=True)
        del args, arrays, f

    torch_info = None
    python = a.torch_python or sys.executable
    if not a.no_torch and _has_torch(python):
        torch_info = run_torch(python, names, a.runs, threads)
        if torch_info:
            for n in names:
                rows[n]["torch_ms"] = torch_info[n]["ms"]
                rows[n]["torch_cold_s"] = torch_info[n]["cold_s"]
                rows[n]["ratio"] = rows[n]["stax_ms"] / rows[n]["torch_ms"]
                rows[n]["ratio_min"] = rows[n]["stax_min_ms"] / torch_info[n]["min_ms"]
                print(f"torch  {n:<13} {rows[n]['torch_ms']:9.1f} ms  first call {rows[n]['torch_cold_s']:.1f} s",
                      flush=True)
    else:
        print("torch not importable: no torch.compile column (pass --torch-python)")

    cache = tempfile.mkdtemp(prefix="bench-probe-")
    cold = [probe(tempfile.mkdtemp(prefix="bench-probe-"), 1)[0] for _ in range(3)]
    probe(cache, 1)                                     # fill the cache
    hit = probe(cache, 5)
    cold_s = statistics.median(r["first_call_s"] for r in cold)
    hit_s = statistics.median(r["first_call_s"] for r in hit)
    imp_s = statistics.median(r["import_s"] for r in hit)
    triton = any(r["triton"] for r in hit)

    print()
    print("| workload | shape | Stax ms | numpy ms | torch.compile ms | Stax/torch | Stax/torch (min) | floor ms | frac | Stax cold compile s | torch first call s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    fmt = lambda v, f: (f.format(v) if v is not None else "")
    for n in names:
        r = rows[n]
        print(f"| {n} | {all_w[n]['shape']} | {r['stax_ms']:.1f} | {r['numpy_ms']:.1f} | "
              f"{fmt(r.get('torch_ms'), '{:.1f}')} | {fmt(r.get('ratio'), '{:.2f}')} | "
              f"{fmt(r.get('ratio_min'), '{:.2f}')} | "
              f"{fmt(r.get('floor_ms'), '{:.1f}')} | {fmt(r.get('frac'), '{:.2f}')} | "
              f"{r['stax_cold_s']:.2f} | {fmt(r.get('torch_cold_s'), '{:.1f}')} |")
    print()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s; threads {threads}"
          + (f"; torch {torch_info['torch']} ({torch_info['threads']} threads)" if torch_info else ""))
    print(f"new process, fresh cache, one-kernel function: {cold_s:.2f} s after `import stax` "
          f"(median of 3; target < 1.5 s) {'OK' if cold_s < 1.5 else 'MISSED'}")
    print(f"new process, on-disk cache hit: {hit_s:.3f} s after `import stax` (median of 5; "
          f"import stax itself {imp_s:.3f} s; target < 0.2 s) {'OK' if hit_s < 0.2 else 'MISSED'}; "
          f"triton imported: {triton}")
    missed = [n for n in names if rows[n].get("ratio", 0) > 1.25]
    if missed:
        print(f"slower than 1.25x torch.compile: {', '.join(missed)}")


if __name__ == "__main__":
    main()
