"""Host µs per call of a compiled function's Python path, without a GPU (issue 13: host time per
CUDA-graph replay ≤ 5 µs).

    python bench/host_path.py            # this checkout, under TRITON_INTERPRET=1
    python bench/host_path.py --profile  # and cProfile's top entries

Kernel time is taken out so that only the host path is left: under mode="reduce-overhead" a fake
CUDA-graph driver whose replay does nothing (as `tests/test_cudagraph.py`'s FakeDriver, minus
the launches), and in default mode the Triton launch (`CachingAutotuner.run`) stubbed out. Each
figure is the best of 5 loops of 20000 calls in process CPU time (`time.process_time`, steadier
than wall time on a shared machine). Workloads: issue 13's chain step (2 inputs, 1 output) and a
function of 17 inputs (the MLP block's input count: x and 4 layers of w, b, gamma, beta).

`stages` breaks one reduce-overhead call down (bench/gpu.py `launchbound` prints the same table
on the H200, with the real cuGraphLaunch):
  - same tensors: the whole call; the CompiledFunction entry (what is left of the whole call);
    `LastCall.same`; GraphedCall's checks (`replay_again` less `_replay`); `_replay` less the
    launch and the outputs; the launch; the output wrapping (`Recording.outputs`); and
    `GraphedCall(args)` alone (gpu.py's `replay_host_us`: condition 2, launch, outputs);
  - a new batch tensor each call (the same other 16): the whole call (the full entry path: key,
    lookup, LastCall made again) and `GraphedCall(args)` alone (condition 2 input by input and
    the copy into the recorded input).
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout

import numpy as np  # noqa: E402

import stax  # noqa: E402
from stax import autograd, cudagraph, triton_heuristics  # noqa: E402


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


def cycling(f, tensors):
    """`f` called with the next of `tensors` in turn (each call another tensor than the last)."""
    state = [0]

    def call(*rest):
        i = state[0] = (state[0] + 1) % len(tensors)
        return f(tensors[i], *rest)
    return call


def stages(f, args, batches, timer=per_call_us) -> dict:
    """Host µs of each stage of a reduce-overhead call of `f` (warmed up, replaying) on `args`,
    then with a new first argument each call (`batches`: tensors like args[0]). `timer(fn, args)`
    times one stage (the GPU bench passes one that waits for the device between loops)."""
    g = next(iter(f.artifacts.values()))[0]
    assert isinstance(g, cudagraph.GraphedCall) and g.rec is not None, "not replaying"
    f(*args)
    f(*args)
    fast, rec, cell, targs = f._fast, g.rec, g.cell, tuple(args)
    if fast is None or fast.token is None or rec.again is not fast.token:
        # (then every call tests its inputs one by one: the figures below would not be the hot path)
        return {"same tensors replay whole": False, "graph stats": g.stats}
    grad = autograd.is_grad_enabled()
    row = {"same tensors replay whole": True,
           "whole call": timer(f, args),
           "LastCall.same": timer(lambda: fast.same(targs, grad), []),
           "GraphedCall.replay_again": timer(lambda: g.replay_again(fast.token), []),
           "_replay": timer(lambda: g._replay(rec, targs, []), []),
           "launch": timer(rec.launch, []),
           "outputs": timer(lambda: rec.outputs(cell), []),
           "GraphedCall(args)": timer(lambda *a: g(list(a)), args)}
    row["CompiledFunction entry"] = row["whole call"] - row["LastCall.same"] - row["GraphedCall.replay_again"]
    row["GraphedCall checks"] = row["GraphedCall.replay_again"] - row["_replay"]
    row["_replay rest"] = row["_replay"] - row["launch"] - row["outputs"]
    before = g.stats
    row["new batch: whole call"] = timer(cycling(f, batches), args[1:])
    row["new batch: GraphedCall(args)"] = timer(cycling(lambda *a: g(list(a)), batches), args[1:])
    after = g.stats            # (a first input not staged when recorded is recorded again, once)
    row["new batch copied in"] = after["copies"] > before["copies"] and after["records"] <= before["records"] + 1
    return row


STAGE_ORDER = ["whole call", "CompiledFunction entry", "LastCall.same", "GraphedCall checks", "_replay rest",
               "launch", "outputs", "GraphedCall(args)", "new batch: whole call", "new batch: GraphedCall(args)"]


def print_stages(rows: dict) -> None:
    """`rows`: workload -> `stages`'s dict; one markdown table, a column per workload."""
    names = list(rows)
    print("| stage (host µs) | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for k in STAGE_ORDER:
        print(f"| {k} | " + " | ".join(f"{rows[n][k]:.2f}" if k in rows[n] else "—" for n in names) + " |")
    for n, r in rows.items():
        if not r["same tensors replay whole"] or not r.get("new batch copied in"):
            print(f"{n}: NOT the hot path: {r}")


def main(argv):
    cudagraph.set_driver(_Driver())
    rng = np.random.default_rng(0)

    def cuda(*shape):
        return stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda")
    work = {"chain (2 inputs)": (chain, [cuda(7, 33), cuda(33)]),
            "17 inputs": (many, [cuda(8, 64)] + [cuda(64) for _ in range(16)])}
    table = {}
    for name, (fn, args) in work.items():
        graphs = stax.compile(fn, mode="reduce-overhead")
        batches = [cuda(*args[0].shape) for _ in range(4)]
        graphs(*args)                           # warm-up
        graphs(batches[0], *args[1:])           # record: the first input moved, so it is staged
        graphs(*args)
        table[name] = stages(graphs, args, batches)
        plain = stax.compile(fn)
        plain(*args)
        run = triton_heuristics.CachingAutotuner.run
        triton_heuristics.CachingAutotuner.run = lambda self, *a, **k: None
        try:
            table[name]["default call (launch stubbed)"] = per_call_us(plain, args)
            if "--profile" in argv:
                prof = cProfile.Profile()
                prof.runcall(lambda: [graphs(*args) for _ in range(20000)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(10)
        finally:
            triton_heuristics.CachingAutotuner.run = run
    print_stages(table)
    print("default mode, launch stubbed: " + ", ".join(f"{n} {r['default call (launch stubbed)']:.2f} µs"
                                                      for n, r in table.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
