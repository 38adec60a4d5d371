"""Where a cold compile's time goes on the GPU (run in a fresh process with fresh Stax and Triton
caches: STAX_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python bench/gpu_coldprofile.py).

`--autotune`: the one-kernel function's candidates measured as by default (else the heuristic
configuration only); `--mlp`: issue 14's 4-layer MLP block (bench/gpu.py `mlp_block`, default
mode) instead; `--sort tottime`: by own time (default: cumulative). cProfile sees the main thread
only: candidates compiled in `_precompile`'s threads show as the wait for them."""
import cProfile
import pstats
import sys
import time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])
import numpy as np  # noqa: E402
import stax  # noqa: E402
from stax import cuda  # noqa: E402

if "--mlp" in sys.argv:
    import gpu  # noqa: E402
    fn, _, arrays, _ = gpu.launch_bound_inputs(np.random.default_rng(0))["mlp_bf16_b8"]
    args = [stax.from_numpy(a.astype(np.float32)).to("cuda").to(stax.bfloat16) for a in arrays]
    f = stax.compile(fn)
else:
    args = [stax.randn(1 << 20, device="cuda")]
    f = stax.compile(lambda x: (x * 2 + 1).relu(), options={} if "--autotune" in sys.argv else {"autotune": False})
cuda.synchronize()
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
f(*args)
cuda.synchronize()
prof.disable()
print(f"cold first call: {time.perf_counter() - t0:.2f} s")
sort = sys.argv[sys.argv.index("--sort") + 1] if "--sort" in sys.argv else "cumulative"
pstats.Stats(prof).sort_stats(sort).print_stats(40)
