"""Issue 14 on the CPU: the Triton compiles a cold first call of the 4-layer MLP block makes.

`python bench/compile_count.py [--threads N] [--extern-wins] [--no-warm]` runs, in a fresh process with fresh
Stax and Triton caches and no GPU, what the first call's launches do at compile time: each kernel
of `mlp_block` (bench/gpu.py; its text from `stax.generate(..., device="cuda")`) goes through
Algorithm 9.1 as `CachingAutotuner.choose_config` runs it (its candidates, the threads of
`_precompile`, the shared tuning records, the cubin cache), for sm_90 on a fake H200, with the
timing of a candidate replaced by a constant (the heuristic default wins). Every real
`triton.compile` is counted and timed. `--extern-wins`: cuBLASLt wins the first GEMM's choice, so
the other three GEMMs never launch the template (the wrapper's `mm_choice` runs the extern).
`--no-warm`: triton's setup (`cuda_triton.warm_compiler`, which an artifact miss starts before
the lowering) is left to the first compile.

`--pool N`: instead, the start cost of a pool of N spawned processes (each imports triton and
hashes it) and the first GEMM's candidates compiled in it, against compiling them in this process.

It prints one line per kernel launch (what it compiled, seconds) and a total line:
`COMPILES n  TRITON_SECONDS s  WALL s  WITH_GENERATE s` (WALL: the launches' compile work;
WITH_GENERATE: from the artifact miss on, the lowering and printing of the kernels included). The H200 figure is `python bench/gpu.py coldmlp`.
"""
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

CHILD = r"""
import json, re, sys, threading, time
from types import SimpleNamespace
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/bench")
import numpy as np
import stax, gpu
from stax import cuda, cuda_triton, triton_heuristics as th
cuda.get_device_properties = lambda: SimpleNamespace(name="fake H200", cc=(9, 0))
cuda.interpreting = lambda: False
fn, _, arrays, _ = gpu.launch_bound_inputs(np.random.default_rng(0))["mlp_bf16_b8"]
args = [stax.from_numpy(a.astype(np.float32)).to(stax.bfloat16) for a in arrays]
start = t0 = time.perf_counter()
if {warm}:
    cuda_triton.warm_compiler()         # as stax.compile's artifact miss starts it
gen = stax.generate(fn, *args, device="cuda")
t_generate = time.perf_counter() - t0
compiles, lock, real = [], threading.Lock(), cuda_triton.compile_triton

def compile_triton(fn, *a, **kw):
    t = time.perf_counter()
    out = real(fn, *a, **kw)
    with lock:
        compiles.append((fn.__name__, time.perf_counter() - t))
    return out
cuda_triton.compile_triton = compile_triton

def measure(k):
    # Alg. 9.1's timing of one candidate, without a GPU: its cubin is built (as _launcher would),
    # the default (first candidate) measures fastest
    def fake(cfg, numels, args):
        k._build(cfg, True, k._divs(args))
        return 1.0 if cfg == th.candidates(k.kind, numels, k.reduction_hint, k.r0_block)[0] else 2.0
    return fake

ptr = SimpleNamespace(data_ptr=lambda: 1 << 20)
kernels, gemms_launched, rows = {{}}, 0, []
t0 = time.perf_counter()
for name, rest in re.findall(r"(triton_\w+)\.run\((.*), stream=", gen.wrapper):
    if name.startswith("triton_tem") and {extern_wins} and gemms_launched:
        continue                      # mm_choice_N runs cuBLASLt: the template never launches
    gemms_launched += name.startswith("triton_tem")
    k = kernels.get(name) or kernels.setdefault(name, th.kernel_from_source(name, gen.kernels[name]))
    k._measure, k._protect, k._restore = measure(k), (lambda a: []), (lambda s: None)
    launch = tuple(int(a) if a.isdigit() else ptr for a in rest.split(", "))
    numels = dict(zip(k.numel_names, launch[len(launch) - len(k.numel_names):]))
    before, t = len(compiles), time.perf_counter()
    cfg = k.choose_config(numels, launch)
    k._build(cfg, True, k._divs(launch))       # the launch itself (_launcher -> _compile)
    rows.append({{"kernel": name, "compiles": len(compiles) - before,
                 "seconds": round(time.perf_counter() - t, 3), "config": cfg}})
print("RESULT " + json.dumps({{"rows": rows, "compiles": len(compiles),
                              "triton_seconds": sum(s for _, s in compiles),
                              "wall": time.perf_counter() - t0, "generate": t_generate,
                              "total": time.perf_counter() - start,
                              "threads": th.compile_threads()}}))
"""


POOL = r"""
import sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/bench")
import concurrent.futures as cf, multiprocessing as mp
from compile_count import pool_build, pool_ready

if __name__ == "__main__":
    import numpy as np
    import stax, gpu
    from stax import triton_heuristics as th
    fn, _, arrays, _ = gpu.launch_bound_inputs(np.random.default_rng(0))["mlp_bf16_b8"]
    gen = stax.generate(fn, *[stax.from_numpy(a.astype(np.float32)).to(stax.bfloat16) for a in arrays],
                        device="cuda")
    name = next(n for n in gen.kernels if n.startswith("triton_tem"))
    k = th.kernel_from_source(name, gen.kernels[name])
    cands = th.candidates(k.kind, {{**{{f"{{p}}numel": n for p, n in k.size_hints.items()}}, **k.meta}})
    jobs = ([name] * len(cands), [gen.kernels[name]] * len(cands), cands)
    t = time.perf_counter()
    pool_ready()
    t_here_ready = time.perf_counter() - t
    here = list(map(pool_build, *jobs))
    import os, tempfile
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-pool-")   # (no hits on the above)
    t = time.perf_counter()
    with cf.ProcessPoolExecutor({workers}, mp_context=mp.get_context("spawn")) as pool:
        ready = [f.result() for f in [pool.submit(pool_ready) for _ in range({workers})]]
        t_ready = time.perf_counter() - t
        t = time.perf_counter()
        in_pool = list(pool.map(pool_build, *jobs))
        t_pool = time.perf_counter() - t
    print(f"pool of {workers}: workers ready (python, import triton, its cache key) after {{t_ready:.2f}} s "
          f"(import + key {{', '.join(f'{{a:.2f}}' for a in ready)}}); {{len(cands)}} candidates of {{name}} "
          f"compiled in the pool {{t_pool:.2f}} s (each {{', '.join(f'{{x:.2f}}' for x in in_pool)}})")
    print(f"in this process: import + key {{t_here_ready:.2f}} s, the {{len(cands)}} candidates one by one "
          f"{{sum(here):.2f}} s (each {{', '.join(f'{{x:.2f}}' for x in here)}})")
"""


def pool_ready() -> float:
    """A pool worker's start: import triton and hash it (`triton_key`), as its first compile would."""
    import time
    t = time.perf_counter()
    from triton.runtime.cache import triton_key
    triton_key()
    return time.perf_counter() - t


def pool_build(name: str, source: str, cfg: dict) -> float:
    """Seconds to compile one candidate for sm_90 from the kernel's text (a worker's job)."""
    import time
    from stax import triton_heuristics as th
    t = time.perf_counter()
    th.kernel_from_source(name, source).compile_for(90, cfg)
    return time.perf_counter() - t


def main(argv):
    threads = argv[argv.index("--threads") + 1] if "--threads" in argv else None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(STAX_CACHE_DIR=tempfile.mkdtemp(prefix="stax-count-"),
               TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-count-"))
    if threads:
        env["STAX_COMPILE_THREADS"] = threads
    if "--pool" in argv:            # the start cost of a process pool against compiling here
        code = POOL.format(root=ROOT, workers=int(argv[argv.index("--pool") + 1]))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        print(r.stdout if r.returncode == 0 else r.stdout[-3000:] + r.stderr[-3000:], end="")
        return
    code = CHILD.format(root=ROOT, extern_wins="--extern-wins" in argv, warm="--no-warm" not in argv)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode or not line:
        sys.exit(r.stdout[-3000:] + r.stderr[-3000:])
    out = json.loads(line[0][len("RESULT "):])
    for row in out["rows"]:
        cfg = ", ".join(f"{k}={v}" for k, v in row["config"].items())
        print(f"{row['kernel']:24s} compiles {row['compiles']:2d}  {row['seconds']:6.2f} s  chose {cfg}")
    print(f"(stax.generate {out['generate']:.2f} s; {out['threads']} compile thread(s))")
    print(f"COMPILES {out['compiles']}  TRITON_SECONDS {out['triton_seconds']:.2f}  WALL {out['wall']:.2f}  "
          f"WITH_GENERATE {out['total']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
