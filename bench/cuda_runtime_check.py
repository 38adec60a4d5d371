"""Device check of stax/cuda.py (run on the GPU machine; prints a short table last).

Measures: cuInit + context time; a 1 GiB float32 add through a Triton kernel launched by
stax.cuda (bandwidth counting 2 reads + 1 write); host microseconds per launch with the argument
array built once (Launcher), the bare cffi cuLaunchKernel call, and Triton's own launcher (torch) for
comparison; per-launch time of 100 launches replayed from one CUDA graph; cached alloc/free cost;
pageable H2D / D2H bandwidth. Loads stax/cuda.py standalone (no dependence on the rest of stax).
Writes $OUT/bench.json when OUT is set.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("stax_cuda_bench", ROOT / "stax" / "cuda.py")
cuda = importlib.util.module_from_spec(spec)
sys.modules["stax_cuda_bench"] = cuda
spec.loader.exec_module(cuda)
T_IMPORT = time.perf_counter() - T_START
# cubins are compiled and launched one layer up, in stax/cuda_triton.py: point it at this same
# standalone driver module so both share one driver state
sys.path.insert(0, str(ROOT))
import stax.cuda_triton as cuda_triton  # noqa: E402
cuda_triton.cuda = cuda

import numpy as np  # noqa: E402

rows: list[tuple[str, str, str]] = []   # (what, measured, target)
res: dict = {"import_s": T_IMPORT}


def row(what, measured, target=""):
    rows.append((what, measured, target))
    print(f"  {what}: {measured}  {target}", flush=True)


def main():
    t0 = time.perf_counter()
    ok = cuda.is_available()
    t_first = time.perf_counter() - t0
    if not ok:
        print("no GPU:", cuda.unavailable_reason())
        return 1
    res["init_wall_s"] = t_first
    res["init_driver_s"] = cuda.init_seconds()
    row("cuInit+ctx+stream (first use)", f"{t_first * 1e3:.0f} ms", "~400 ms")
    p = cuda.get_device_properties()
    res["props"] = dataclasses.asdict(p)
    print("device:", p, "driver", cuda.driver_version(), flush=True)

    import triton
    import triton.language as tl
    print("triton", triton.__version__, flush=True)

    @triton.jit
    def stax_bench_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x + y, mask=mask)

    sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    configs = [(1024, 4), (2048, 8), (4096, 8), (8192, 16)]
    launchers = {}
    for blk, nw in configs:
        t0 = time.perf_counter()
        cubin, info, name = cuda_triton.compile_triton(stax_bench_add, sig, {"BLOCK": blk}, num_warps=nw)
        tc = time.perf_counter() - t0
        launchers[(blk, nw)] = cuda_triton.launcher_for_triton(cubin, info, sig)
        print(f"compiled BLOCK={blk} warps={nw} in {tc:.2f}s: {info}", flush=True)
        res.setdefault("compile_s", []).append(tc)
    row("triton compile (first / later)", f"{res['compile_s'][0]:.2f} / "
        f"{min(res['compile_s'][1:]):.2f} s", "0.1-0.2 s later")

    # ---------------- 1 GiB add: correctness then bandwidth
    n = 1 << 28
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    t0 = time.perf_counter()
    xb = cuda.to_device(x)
    cuda.synchronize()
    t_h2d = time.perf_counter() - t0
    yb = cuda.to_device(y)
    ob = cuda.allocate(4 * n)
    st = cuda.init()
    best = None
    for (blk, nw), lz in launchers.items():
        st.lib.cuMemsetD8Async(ob.ptr, 0xFF, 4 * n, st.stream.handle)   # NaN poison
        grid = ((n + blk - 1) // blk, 1, 1)
        lz(grid, [xb, yb, ob, n])
        out = np.empty(n, np.float32)
        t0 = time.perf_counter()
        cuda.copy_device_to_host(out, ob)
        t_d2h = time.perf_counter() - t0
        okv = bool(np.array_equal(out, x + y))
        del out
        for _ in range(3):
            lz(grid, [xb, yb, ob, n])
        times = []
        for _ in range(20):
            a, b = cuda.Event(), cuda.Event()
            a.record()
            lz(grid, [xb, yb, ob, n])
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        ms = statistics.median(times)
        tbs = 3 * 4 * n / (ms * 1e-3) / 1e12
        print(f"add 1GiB BLOCK={blk} warps={nw}: correct={okv} median {ms:.3f} ms = {tbs:.2f} TB/s "
              f"(min {min(times):.3f} ms)", flush=True)
        res.setdefault("add_1gib", []).append({"block": blk, "warps": nw, "correct": okv,
                                               "ms": ms, "tbs": tbs})
        if not okv:
            row(f"add 1GiB BLOCK={blk} CORRECTNESS", "FAILED", "")
        if best is None or tbs > best[0]:
            best = (tbs, blk, nw, ms)
    row("1 GiB add bandwidth (best config)", f"{best[0]:.2f} TB/s ({best[3]:.3f} ms, "
        f"BLOCK={best[1]}, w={best[2]})", "~4.3 TB/s")
    row("pageable H2D / D2H 1 GiB", f"{4 * n / t_h2d / 1e9:.1f} / {4 * n / t_d2h / 1e9:.1f} GB/s", "")
    for b in (xb, yb, ob):
        b.free()
    del x, y

    # ---------------- host cost per launch
    small = 1024
    lz = launchers[(1024, 4)]
    xs = cuda.to_device(np.arange(small, dtype=np.float32))
    ys = cuda.to_device(np.ones(small, dtype=np.float32))
    os_ = cuda.allocate(4 * small)
    args_buf = [xs, ys, os_, small]
    args_int = [xs.ptr, ys.ptr, os_.ptr, small]
    grid = (1, 1, 1)
    N = 20000

    def host_us(fn):
        for _ in range(500):
            fn()
        cuda.synchronize()
        best_us = None
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(N):
                fn()
            t = (time.perf_counter() - t0) / N * 1e6
            cuda.synchronize()
            best_us = t if best_us is None else min(best_us, t)
        return best_us

    us_buf = host_us(lambda: lz(grid, args_buf))
    us_int = host_us(lambda: lz(grid, args_int))
    call, func, params, stream, null = lz._call, lz._func, lz._params, lz._stream, lz._null
    lz(grid, args_int)
    us_raw = host_us(lambda: call(func, 1, 1, 1, 128, 1, 1, 0, stream, params, null))
    out = cuda.to_host(os_, (small,), np.float32)
    assert np.array_equal(out, np.arange(small, dtype=np.float32) + 1), "small add wrong"
    res.update(launch_us_buffers=us_buf, launch_us_ints=us_int, launch_us_raw_cffi=us_raw)
    row("host us/launch, Launcher (DeviceBuffer args)", f"{us_buf:.2f} us", "<= 7 us")
    row("host us/launch, Launcher (int args)", f"{us_int:.2f} us", "")
    row("host us/launch, bare cffi cuLaunchKernel", f"{us_raw:.2f} us", "~6 us")

    # ---------------- CUDA graph: 100 launches replayed
    g = cuda.CUDAGraph()
    with g:
        for _ in range(100):
            lz(grid, args_buf)
    for _ in range(3):
        g.replay()
    cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = cuda.Event(), cuda.Event()
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    per = statistics.median(times) * 1e3 / 100
    t0 = time.perf_counter()
    for _ in range(200):
        g.replay()
    host_replay = (time.perf_counter() - t0) / 200 * 1e6
    cuda.synchronize()
    # stream-mode reference: 100 plain launches timed on the device
    times2 = []
    for _ in range(10):
        a, b = cuda.Event(), cuda.Event()
        a.record()
        for _ in range(100):
            lz(grid, args_buf)
        b.record()
        b.synchronize()
        times2.append(a.elapsed_time(b))
    per_stream = statistics.median(times2) * 1e3 / 100
    res.update(graph_us_per_launch=per, graph_host_us_per_replay=host_replay,
               stream_us_per_launch=per_stream)
    row("graph replay, device us per launch (100/graph)", f"{per:.2f} us", "~0.95 us")
    row("graph replay host cost (whole graph)", f"{host_replay:.1f} us", "")
    row("plain launches, device us per launch", f"{per_stream:.2f} us", "")

    # ---------------- allocator cost
    cuda.allocate(4096).free()
    t0 = time.perf_counter()
    M = 100000
    for _ in range(M):
        cuda.allocate(4000).free()
    al_us = (time.perf_counter() - t0) / M * 1e6
    res["alloc_free_cached_us"] = al_us
    res["memory_stats"] = cuda.memory_stats()
    row("cached allocate+free", f"{al_us:.2f} us", "")
    try:
        cuda.allocate(1 << 40)
        row("1 TiB allocation", "NO ERROR?!", "CUDA_ERROR_OUT_OF_MEMORY")
    except cuda.CudaError as e:
        row("1 TiB allocation error", e.name, "CUDA_ERROR_OUT_OF_MEMORY")
        print("  message:", e)

    # ---------------- Triton's own launcher (torch), for comparison only
    try:
        t0 = time.perf_counter()
        import torch
        xt = torch.arange(small, dtype=torch.float32, device="cuda")
        yt = torch.ones(small, dtype=torch.float32, device="cuda")
        ot = torch.empty_like(xt)

        def tl_launch():
            stax_bench_add[(1,)](xt, yt, ot, small, BLOCK=1024, num_warps=4)

        tl_launch()
        torch.cuda.synchronize()
        for _ in range(500):
            tl_launch()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        K = 5000
        for _ in range(K):
            tl_launch()
        tus = (time.perf_counter() - t1) / K * 1e6
        torch.cuda.synchronize()
        res["triton_launcher_us"] = tus
        row("host us/launch, Triton's own launcher", f"{tus:.2f} us", "~19 us (reference)")
        print(f"  (torch import + first triton launch took {t1 - t0:.1f} s)")
    except Exception as e:  # noqa: BLE001
        print("triton launcher comparison skipped:", type(e).__name__, e)
    return 0


if __name__ == "__main__":
    rc = 1
    try:
        rc = main()
    finally:
        out = os.environ.get("OUT")
        if out:
            with open(os.path.join(out, "bench.json"), "w") as f:
                json.dump(res, f, indent=1, default=str)
        print("\n==== stax.cuda runtime check ====")
        w = max([len(r[0]) for r in rows] + [10])
        for what, meas, tgt in rows:
            print(f"{what:<{w}}  {meas:<42} {tgt}")
        print(f"total {time.perf_counter() - T_START:.1f} s")
    sys.exit(rc)
