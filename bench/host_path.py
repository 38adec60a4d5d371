"""Host µs per call of a compiled function's Python path, without a GPU (issue 13: host time per
CUDA-graph replay ≤ 5 µs).

    TRITON_INTERPRET=1 python bench/host_path.py            # this checkout
    TRITON_INTERPRET=1 python bench/host_path.py --profile  # and cProfile's top entries

Kernel time is taken out so that only the host path is left: under mode="reduce-overhead" a fake
CUDA-graph driver whose replay does nothing (as `tests/test_cudagraph.py`'s FakeDriver, minus
the launches), and in default mode the Triton launch (`CachingAutotuner.run`) stubbed out. Each
figure is the best of 5 loops of 20000 calls in process CPU time (`time.process_time`, steadier
than wall time on a shared machine). Workloads: issue 13's chain step (2 inputs, 1 output) and a
function of 17 inputs (the MLP block's input count: x and 4 layers of w, b, gamma, beta).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's stax

import numpy as np  # noqa: E402

import stax  # noqa: E402
from stax import cudagraph, triton_heuristics  # noqa: E402


class _Graph:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def replay(self):
        pass


class _Driver:
    def unavailable(self):
        return None

    def graph(self):
        return _Graph()

    def copy(self, dst, src, nbytes):
        pass

    def pool(self, private=False):
        return None


def chain(x, w):
    return stax.sin(x) + x.sum(-1, keepdim=True) * 1e-3 * w


def many(x, *params):
    h = x
    for p in params:
        h = h + p
    return stax.sin(h)


def per_call_us(f, args, n=20000) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            f(*args)
        best = min(best, (time.process_time() - t0) / n * 1e6)
    return best


def main(argv):
    cudagraph.set_driver(_Driver())
    rng = np.random.default_rng(0)

    def cuda(*shape):
        return stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda")
    work = {"chain (2 inputs)": (chain, [cuda(7, 33), cuda(33)]),
            "17 inputs": (many, [cuda(8, 64)] + [cuda(64) for _ in range(16)])}
    for name, (fn, args) in work.items():
        graphs = stax.compile(fn, mode="reduce-overhead")
        for _ in range(3):                      # warm-up, record, replay
            graphs(*args)
        g = next(iter(graphs.artifacts.values()))[0]
        assert isinstance(g, cudagraph.GraphedCall) and g.rec is not None, "not replaying"
        plain = stax.compile(fn)
        plain(*args)
        run = triton_heuristics.CachingAutotuner.run
        triton_heuristics.CachingAutotuner.run = lambda self, *a, **k: None
        try:
            row = {"reduce-overhead call": per_call_us(graphs, args),
                   "replay (GraphedCall)": per_call_us(lambda *a: g(list(a)), args),
                   "default call (launch stubbed)": per_call_us(plain, args)}
            if "--profile" in argv:
                prof = cProfile.Profile()
                prof.runcall(lambda: [graphs(*args) for _ in range(20000)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(10)
        finally:
            triton_heuristics.CachingAutotuner.run = run
        print(f"{name}: " + ", ".join(f"{k} {v:.2f} µs" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
