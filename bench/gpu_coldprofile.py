"""Where a cold compile's time goes on the GPU (run in a fresh process with fresh Stax and Triton
caches: STAX_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python bench/gpu_coldprofile.py)."""
import cProfile
import pstats
import sys
import time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
import stax  # noqa: E402
from stax import cuda  # noqa: E402

x = stax.randn(1 << 20, device="cuda")
cuda.synchronize()
# `--autotune`: candidates measured as by default; else the heuristic configuration only
f = stax.compile(lambda x: (x * 2 + 1).relu(), options={} if "--autotune" in sys.argv else {"autotune": False})
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
f(x)
cuda.synchronize()
prof.disable()
print(f"cold first call: {time.perf_counter() - t0:.2f} s")
pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
