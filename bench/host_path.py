"""Host µs per call of a compiled function's Python path, without a GPU (issue 13: host time per
CUDA-graph replay ≤ 5 µs).

    python bench/host_path.py            # this checkout, under TRITON_INTERPRET=1
    python bench/host_path.py --profile  # and cProfile's top entries

Kernel time is taken out so that only the host path is left: under mode="reduce-overhead" a fake
CUDA-graph driver whose replay does nothing (as `tests/test_cudagraph.py`'s FakeDriver, minus
the launches), and in default mode the Triton launch (`CachingAutotuner.run`) stubbed out.
Workloads: issue 13's chain step (2 inputs, 1 output) and a function of 17 inputs (the MLP
block's input count: x and 4 layers of w, b, gamma, beta), each with its first input copied into
the graph's buffer every call (staged: it moved after the warm-up call), and the 17 inputs again
with none staged (as bench/gpu.py launchbound runs the MLP block).

The replay of the same tensors runs in C (stax/cudagraph_c.py) when the extension builds: the
fake driver's graph and copy then hand it the extension's C stubs (`raw_launch`, `raw_copy`: a
cuGraphLaunch and a cuMemcpyDtoDAsync that do nothing), as the GPU hands it the driver's. The
"Python:" rows are the same call as it is without the extension (the Python __call__ and the
generated Python replay, whose launch is the fake graph's Python `replay`): before and after in
one run. STAX_CUDAGRAPH_C=0 runs everything in Python.

Every figure is `bursts`'s: after waiting for the device (`sync`; nothing here, the GPU bench's
cuCtxSynchronize there), one burst of `k` = 16 calls is timed with perf_counter, many times; the
figure is the median µs per call over the bursts, with the 10th-90th percentiles beside it. Short
bursts on an idle device keep the GPU bench honest: the host is never throttled by a full launch
queue (a long run of replays, each ~25 µs of GPU work, fills it, and cuGraphLaunch then waits for
the GPU to drain), and the median shrugs off a shared host's preemptions, where "best of" would
report the luckiest loop.

`stages` breaks one reduce-overhead call down, every stage timed the same way (bench/gpu.py
`launchbound` prints the same table on the H200, with the real cuGraphLaunch):
  - same tensors: the whole call; the CompiledFunction entry (the whole call less the replay);
    the generated replay (`LastCall.hot`, cudagraph.GraphedCall.replayer: the C one when built),
    and its checks (identity and requires_grad of every input, the lock, the recording still
    current: the same replay on a token it refuses after the lock); then the same for the Python
    path ("Python:" rows), whose replay is broken down further: the copies into staged inputs,
    the launch, the output wrapping (`Recording.outputs`), and the rest (the replay count, the
    calls between); then `GraphedCall(args)` alone (gpu.py's `replay_host_us`);
  - a new batch tensor each call (the same other 16): the whole call (the full entry path: key,
    lookup, LastCall made again) and `GraphedCall(args)` alone (condition 2 input by input and
    the copy into the recorded input).
Rows below a stage are medians subtracted (no spread of their own).
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
from stax import autograd, cudagraph, cudagraph_c, triton_heuristics  # noqa: E402


class _Graph:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def replay(self):
        pass

    def raw_launch(self):
        """The C replay's launch: the extension's C stub (a cuGraphLaunch that does nothing)."""
        mod = cudagraph_c.module()
        return None if mod is None else (mod.stubs()[0], 0, 0, self)


class _Driver:
    def unavailable(self):
        return None

    def graph(self):
        return _Graph()

    def copy(self, dst, src, nbytes):
        pass

    def pool(self, private=False):
        return None

    def raw_copy(self):
        mod = cudagraph_c.module()
        return None if mod is None else (mod.stubs()[1], 0)


def chain(x, w):
    return stax.sin(x) + x.sum(-1, keepdim=True) * 1e-3 * w


def many(x, *params):
    h = x
    for p in params:
        h = h + p
    return stax.sin(h)


class Timing(float):
    """A median µs per call (the float itself) with its spread: `lo`, `hi` (10th and 90th
    percentiles of the bursts' µs per call), `bursts` of `k` calls."""

    def __new__(cls, median, lo, hi, bursts, k):
        t = super().__new__(cls, median)
        t.lo, t.hi, t.bursts, t.k = lo, hi, bursts, k
        return t

    def __str__(self):
        return f"{float(self):.2f} ({self.lo:.2f}–{self.hi:.2f})"


def bursts(fn, args, sync=None, k=16, reps=1500, warm=64) -> Timing:
    """Host µs per call of `fn(*args)`: `reps` bursts of `k` back-to-back calls, each burst
    started on an idle device (`sync()` before it, outside the timing); the median and the
    10th-90th percentiles of the bursts' µs per call."""
    for _ in range(warm):
        fn(*args)
    clock, per = time.perf_counter, []
    for _ in range(reps):
        if sync is not None:
            sync()
        t0 = clock()
        for _ in range(k):
            fn(*args)
        per.append((clock() - t0) / k * 1e6)
    if sync is not None:
        sync()
    per.sort()
    n = len(per)
    return Timing(per[n // 2], per[n // 10], per[(9 * n) // 10], n, k)


def cycling(f, tensors):
    """`f` called with the next of `tensors` in turn (each call another tensor than the last)."""
    state = [0]

    def call(*rest):
        i = state[0] = (state[0] + 1) % len(tensors)
        return f(tensors[i], *rest)
    return call


def stages(f, args, batches, timer=bursts) -> dict:
    """Host µs of each stage of a reduce-overhead call of `f` (warmed up, replaying) on `args`,
    then with a new first argument each call (`batches`: tensors like args[0]). `timer(fn, args)`
    times one stage (the GPU bench passes `bursts` with the device's sync)."""
    g = next(iter(f.artifacts.values()))[0]
    assert isinstance(g, cudagraph.GraphedCall) and g.rec is not None, "not replaying"
    for _ in range(3):
        f(*args)
    fast, rec, cell, targs = f._fast, g.rec, g.cell, tuple(args)
    hot = getattr(fast, "hot", None)
    if hot is None or fast.token is None or rec.again is not fast.token:
        # (then every call tests its inputs one by one: the figures below would not be the hot path)
        return {"same tensors replay whole": False, "graph stats": g.stats}
    grad = autograd.is_grad_enabled()
    token = fast.token
    stale = [token[0], token[1], None]       # the same tensors under a token the graph refuses
    refused = g._replayer(rec, stale, len(targs))
    python = g._replayer(rec, token, len(targs), native=False)     # the generated Python replay
    python_refused = g._replayer(rec, stale, len(targs), native=False)
    counts = dict(g.counts)                  # (the copies stage counts into a scratch dict)
    native = type(hot).__name__ == "Replay"
    row = {"same tensors replay whole": True, "C replay": native,
           "whole call": timer(f, args),
           "generated replay": timer(lambda: hot(targs, grad), []),
           "checks (identity, grad, lock)": timer(lambda: refused(targs, grad), [])}
    with cudagraph_c.python_entry(type(f)):  # today's path: the Python __call__ and replay
        fast.hot = python
        try:
            row["Python: whole call"] = timer(f, args)
        finally:
            fast.hot = hot
    row.update({"Python: generated replay": timer(lambda: python(targs, grad), []),
                "Python: checks (identity, grad, lock)": timer(lambda: python_refused(targs, grad), []),
                "Python: copies in": timer(lambda: cudagraph._copy_in(token[1], counts), []) if token[1] else 0.0,
                "Python: launch": timer(rec.launch, []),
                "Python: outputs": timer(lambda: rec.outputs(cell), []),
                "GraphedCall(args)": timer(lambda *a: g(list(a)), args)})
    assert refused(targs, grad) is None and python_refused(targs, grad) is None and rec.again is token, \
        "the checks stage replayed"
    assert fast.hot is hot and f._fast is fast, "the stages left another replay in place"
    row["CompiledFunction entry"] = row["whole call"] - row["generated replay"]
    row["Python: CompiledFunction entry"] = row["Python: whole call"] - row["Python: generated replay"]
    row["Python: replay rest"] = (row["Python: generated replay"] - row["Python: checks (identity, grad, lock)"]
                                  - row["Python: copies in"] - row["Python: launch"] - row["Python: outputs"])
    before = g.stats
    row["new batch: whole call"] = timer(cycling(f, batches), args[1:])
    row["new batch: GraphedCall(args)"] = timer(cycling(lambda *a: g(list(a)), batches), args[1:])
    after = g.stats            # (a first input not staged when recorded is recorded again, once)
    row["new batch copied in"] = after["copies"] > before["copies"] and after["records"] <= before["records"] + 1
    return row


STAGE_ORDER = ["whole call", "CompiledFunction entry", "generated replay", "checks (identity, grad, lock)",
               "Python: whole call", "Python: CompiledFunction entry", "Python: generated replay",
               "Python: checks (identity, grad, lock)", "Python: copies in", "Python: launch", "Python: outputs",
               "Python: replay rest", "GraphedCall(args)", "new batch: whole call", "new batch: GraphedCall(args)"]


def _cell(v) -> str:
    return "—" if v is None else str(v) if isinstance(v, Timing) else f"{v:.2f}"


def print_stages(rows: dict) -> None:
    """`rows`: workload -> `stages`'s dict; one markdown table, a column per workload."""
    names = list(rows)
    print("| stage (host µs per call: median (p10–p90) of 16-call bursts) | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    for k in STAGE_ORDER:
        print(f"| {k} | " + " | ".join(_cell(rows[n].get(k)) for n in names) + " |")
    for n, r in rows.items():
        if not r["same tensors replay whole"] or not r.get("new batch copied in"):
            print(f"{n}: NOT the hot path: {r}")
        elif not r["C replay"]:
            print(f"{n}: the C replay is not in use ({cudagraph_c.unavailable()}): the rows above the "
                  "'Python:' ones are the Python replay too")


def main(argv):
    cudagraph.set_driver(_Driver())
    rng = np.random.default_rng(0)

    def cuda(*shape):
        return stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda")
    work = {"chain (2 inputs)": (chain, [cuda(7, 33), cuda(33)], True),
            "17 inputs": (many, [cuda(8, 64)] + [cuda(64) for _ in range(16)], True),
            "17 inputs, none staged": (many, [cuda(8, 64)] + [cuda(64) for _ in range(16)], False)}
    table = {}
    for name, (fn, args, staged) in work.items():
        graphs = stax.compile(fn, mode="reduce-overhead")
        batches = [cuda(*args[0].shape) for _ in range(4)]
        graphs(*args)                           # warm-up
        # record: the first input moved, so it is staged (bench/gpu.py launchbound's MLP: none staged)
        graphs(*([batches[0]] if staged else args[:1]), *args[1:])
        graphs(*args)
        table[name] = stages(graphs, args, batches)
        plain = stax.compile(fn)
        plain(*args)
        run = triton_heuristics.CachingAutotuner.run
        triton_heuristics.CachingAutotuner.run = lambda self, *a, **k: None
        try:
            table[name]["default call (launch stubbed)"] = bursts(plain, args)
            if "--profile" in argv:
                prof = cProfile.Profile()
                prof.runcall(lambda: [graphs(*args) for _ in range(20000)])
                pstats.Stats(prof).sort_stats("tottime").print_stats(10)
        finally:
            triton_heuristics.CachingAutotuner.run = run
    print_stages(table)
    print("default mode, launch stubbed: " + ", ".join(f"{n} {r['default call (launch stubbed)']} µs"
                                                      for n, r in table.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
