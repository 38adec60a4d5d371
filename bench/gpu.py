"""GPU benchmark (issue 3): Stax's Triton kernels against the memory floor and torch.compile.

Run on the H200 (the `device` tool): `python bench/gpu.py [workload ...] [--json FILE]`; a workload
is a name, a family (`colsum`) or the group `reductions` (issue 12's reductions in every layout),
or `indexing` (issue 11: the embedding gather and index_add_ on a 1M x 1024 table, INDEXING).
`python bench/gpu.py launchbound` runs only §9.9's launch-bound section (issue 13): an MLP block and
a 20-step chain in default mode, mode="reduce-overhead" (CUDA graphs) and torch.compile's two modes.
`python bench/gpu.py attention` runs only §9.10's attention rows (issue 15) against torch's SDPA and
FlexAttention; `python bench/gpu.py conv` only the conv2d workloads (CONVS: ResNet-50 layers, bf16,
channels-last; a name, e.g. `layer4_3x3`, that one; each row says which blocks and SPLIT_K Alg. 9.1 chose,
`STAX_LOGS=autotune` prints every candidate's time); `python bench/gpu.py adamw` only issue 16's optimizer step: stax.optim.AdamW's compiled
step over a 4-layer width-1024 MLP's parameters against torch.optim.AdamW (foreach=True and fused=True).
`python bench/gpu.py train` only §5's training steps (forward + backward + AdamW, the loss
stax.compile'd against torch.compile'd, with each one's peak memory): the 4-layer width-1024 MLP at
batch 64, and a GPT-2-small block (examples/gpt2_block.py, C=768, seq 1024, batch 8; `train gpt2
[--no-torch]` that one alone, e.g. beside STAX_ATTENTION_REWRITE=0); `train --tiny`
runs Stax's side at small sizes (through TRITON_INTERPRET=1 where there is no GPU).
For each workload (WORKLOADS below, at the shapes the torch.compile reference figures were taken) it prints, from one run: Stax's time
(CUDA events around each call of the compiled function after an L2 flush, as
triton.testing.do_bench times torch.compile; outputs allocated by Stax's caching allocator as a
user would see), the floor (each input read once + each output written once, over
the device-to-device copy bandwidth measured in the same run), the fraction floor / time, and,
when torch is importable, torch.compile's time (triton.testing.do_bench) and the ratio.
It also measures the host time per launch, the cold compile of a one-kernel function (after
`import stax` and device start) and the same with the on-disk cache warm.

`python bench/gpu.py coldmlp` times issue 14's tuning cost: the 4-layer MLP block's cold compile
(fresh caches, a new process, default mode) and its warm-cache first call.
`python bench/gpu.py smallm` times that block's GEMM under every candidate of the template's table
(the GPU alone, in a CUDA graph), before and after issue 14's small-M candidate list.
`python bench/gpu.py fp8` runs only §9.8's float8 rows: stax._scaled_mm against torch._scaled_mm.
A matmul row (`python bench/gpu.py mm_fp32_high split_k`) also says which candidate Alg. 9.1 chose
for each GEMM: the Triton template or cuBLASLt (stax/cublas.py, when nvidia-cublas is installed),
with both measured times.

`python bench/gpu.py reductions --onekernel-compare` (§6.5, issue 12): each reduction workload with
Alg. 6.1's OUTER splits in one kernel (the default), every split as two kernels
(STAX_SPLIT_ONE_KERNEL=0) and row splits in one kernel too (=all), timed side by side in one run,
checked against each other and each bitwise stable over 50 calls.

`python bench/gpu.py --dynamic [workload ...]` (§10, issue 10): each workload compiled static and
with dynamic=True in the same run, both checked against each other, timed at the workload's size
(the hint) in alternating rounds; prints the ratio dynamic / static (target <= 1.10 on every
workload) and the host microseconds per call of each on a tiny input.
"""
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import stax  # noqa: E402
from stax import cublas, cuda  # noqa: E402

GB = 1e9


def gelu_like(h):
    return 0.7 * (0.5 * (1 + stax.erf(h * 0.7071067811865476)) + h * stax.exp(-0.5 * h * h) * 0.3989422804014327)


# name -> (function, input shapes, output elements count function)
WORKLOADS = {
    "ex1_1": (lambda x, y: (stax.relu(x + y) * 2).sum(-1), [(16384, 8192), (16384, 8192)]),
    "ex6_1": (lambda x, y: x.t() + y, [(8192, 16384), (16384, 8192)]),
    "ex6_2": (lambda x: (x * x).sum(-1), [(64, 4194304)]),
    "softmax": (lambda x: stax.softmax(x, -1), [(65536, 1000)]),
    "softmax:long": (lambda x: stax.softmax(x, -1), [(4096, 32768)]),
    "softmax:verylong": (lambda x: stax.softmax(x, -1), [(2048, 65536)]),   # online (m, d), Prop. 9.1
    "layernorm": (lambda x, w, b: stax.layer_norm(x, (4096,), w, b), [(65536, 4096), (4096,), (4096,)]),
    "gelu": (gelu_like, [(64 << 20,)]),
    "tile3d": (lambda x, y, z: x + y.permute(2, 0, 1) * z.permute(1, 2, 0), [(512, 256, 512), (256, 512, 512), (512, 512, 256)]),
    # the simplest streaming kernel, as a reference for what a kernel (not the copy engine) attains
    "scale": (lambda x: x * 2, [(64 << 20,)]),
    # reductions in every layout (issue 12, §9.4 OUTER): `python bench/gpu.py reductions`
    "colsum:large": (lambda x: x.sum(0), [(32768, 8192)]),
    "colsum:small": (lambda x: x.sum(0), [(4096, 1024)]),
    "mean01": (lambda x: x.mean((0, 1)), [(64, 512, 2048)]),
    "var0": (lambda x: x.var(0), [(8192, 4096)]),
    "bnstats": (lambda x: (x.mean((0, 2, 3)), x.var((0, 2, 3))), [(32, 256, 56, 56)]),
    "amax_mid": (lambda x: x.amax(1), [(256, 1024, 64)]),
    "biasgrad": (lambda g: g.reshape(-1, 1024).sum(0), [(32, 512, 1024)]),
    # F.cross_entropy (issue 11): one row kernel (max, sum of exp, the target's logit), then the mean
    "xent": (lambda x, t: stax.nn.functional.cross_entropy(x, t), [(8192, 32768), ("int", 32768, (8192,))]),
}
GROUPS = {"reductions": ["colsum:large", "colsum:small", "mean01", "var0", "bnstats", "amax_mid", "biasgrad"]}
# issue 12's reductions (each reads its input once and writes little): their rows also show the
# read ceiling of their input's bytes (`read_ceiling_ms`)
REDUCTION_NAMES = set(GROUPS["reductions"])
# matmuls (§9.8): the template with its epilogue fused; TFLOP/s, not a fraction of a floor.
# name -> (function of a [m, k], b [k, n], c [n], (m, k, n), dtype, float32 matmul precision)
MATMULS = {
    "mm_bf16": (lambda a, b, c: stax.relu(a @ b + c), (8192, 8192, 8192), "bfloat16", "highest"),
    "mm_fp32": (lambda a, b, c: stax.relu(a @ b + c), (4096, 4096, 4096), "float32", "highest"),
    "mm_fp32_high": (lambda a, b, c: stax.relu(a @ b + c), (4096, 4096, 4096), "float32", "high"),
    "mm_splitk": (lambda a, b, c: a @ b + c, (64, 65536, 64), "bfloat16", "highest"),   # SPLIT_K
}
TORCH_MATMULS = {"mm_splitk": lambda a, b, c: a @ b + c}     # the others: relu(a @ b + c)
MATMULS["split_k"] = MATMULS["mm_splitk"]                     # (the name the chapter's issue uses)
TORCH_MATMULS["split_k"] = TORCH_MATMULS["mm_splitk"]


def mm_winners(f) -> dict:
    """Alg. 9.1's choice of each GEMM of a compiled function: the Triton template or cuBLASLt
    (stax/cublas.py, when installed), with both measured times (None before the first call)."""
    out = {}
    for entry in f.artifacts.values():
        names = getattr(entry[0], "__globals__", {}) if entry else {}
        for name, v in names.items():
            if isinstance(v, cublas.MatmulChoice):
                ms = v.times or (None, None)
                out[name] = {"winner": v.chosen, "template_ms": ms[0], "cublaslt_ms": ms[1]}
    return out


def make_input(spec, lib=stax, device="cuda"):
    """A shape: standard normal float32. ("int", high, shape): int64 in [0, high)."""
    if spec and spec[0] == "int":
        return lib.randint(0, spec[1], spec[2], device=device)
    return lib.randn(*spec, device=device)
# indirect indexing (issue 11): a 1M x 1024 float32 table (4 GiB) and 65,536 random row indices;
# the floor counts the bytes touched (the indices, each row read or written once: `passes` row
# passes of 65,536 x 1024 floats), not the whole table. index_add_ updates the table in place.
EMB_ROWS, EMB_DIM, N_IDX = 1 << 20, 1024, 65536


def _index_add(t, i, r):
    t.index_add_(0, i, r)


INDEXING = {   # name -> (Stax function, torch function (given torch), row passes)
    "embedding": (lambda t, i: stax.embedding(i, t), lambda T: (lambda t, i: T.nn.functional.embedding(i, t)), 2),
    "index_add": (_index_add, lambda T: _index_add, 3),
}
# conv2d (§9.8, issue 14 item 7): the implicit-GEMM template on ResNet-50 layers, batch 32, bf16,
# input and weight channels-last, bias; name -> (C_in, H, W, C_out, K, stride, padding).
# `python bench/gpu.py conv` runs only these.
CONVS = {
    "conv1_7x7_s2": (3, 224, 224, 64, 7, 2, 3),
    "layer1_3x3": (64, 56, 56, 64, 3, 1, 1),
    "layer2_3x3_s2": (128, 56, 56, 128, 3, 2, 1),
    "layer3_1x1": (1024, 14, 14, 256, 1, 1, 0),
    "layer4_3x3": (512, 7, 7, 512, 3, 1, 1),
}
CONV_BATCH = 32


def copy_bandwidth() -> float:
    n = 1 << 30
    a, b = cuda.allocate(n), cuda.allocate(n)
    cuda.copy_device_to_device(b, a, n)
    cuda.synchronize()
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record()
    for _ in range(10):
        cuda.copy_device_to_device(b, a, n)
    e1.record()
    e1.synchronize()
    ms = e0.elapsed_time(e1) / 10
    return 2 * n / (ms * 1e-3)          # read + write


_FLUSH = []        # a 256 MB buffer: filling it evicts the 50 MB L2 between timed calls
# --dynamic times kernels, not the host: a 1 GB fill (about 0.3 ms on the H200) before each call
# keeps the host's launches ahead of the GPU, so no gap between one call's kernels is counted (a
# call of about 40 µs of kernels and as much host time, bnstats, read 1.4-1.8x when the host was
# slow, 0.99 when not; the host's cost is the separate "host µs per call" figure)
HOST_AHEAD_FILL = 1 << 30


# The fill leaves the L2 full of dirty lines, whose write-back the timed call pays for as it
# reads (a 128 MB stream read after the fill: 0.76 of the copy floor; after a 256 MB read instead,
# which leaves the L2 clean: 0.95; 64 MB 0.64 against 0.84; H200, 2026-12-03). `clean=True`
# evicts by reading (1 GB): the reductions table shows both, each library timed the same way.
_CLEAN_FLUSH = []


def clean_flush():
    """Evict the L2 by reading 1 GB (a compiled amax), so it holds clean lines only. (Not 256 MB:
    its 60 µs did not cover a Stax call's host time on a slow host, so the timed call's kernels
    waited for their launches: bnstats read 0.053 ms clean against 0.035 after the fill.)"""
    if not _CLEAN_FLUSH:
        buf = make_input((256 << 20,))
        amax = stax.compile(lambda t: t.amax())
        amax(buf)
        _CLEAN_FLUSH.append(lambda: amax(buf))
    _CLEAN_FLUSH[0]()


def time_calls(fn, args, iters=None, fill: int = 256 << 20, clean: bool = False) -> float:
    """Median milliseconds per call, measured as triton.testing.do_bench measures torch.compile
    below: before each call a 256 MB fill (or `fill` bytes) evicts the L2 cache (no input is still
    cached from the previous call), and CUDA events bracket the call alone. `clean`: evict by a
    1 GB read instead (`clean_flush`)."""
    if not _FLUSH or _FLUSH[0].nbytes != fill:
        _FLUSH.clear()
        _FLUSH.append(cuda.allocate(fill))
    for _ in range(3):
        fn(*args)
    cuda.synchronize()
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record()
    fn(*args)
    e1.record()
    e1.synchronize()
    one = max(e0.elapsed_time(e1), 1e-3)
    events = [(cuda.Event(), cuda.Event()) for _ in range(iters or max(10, min(200, int(100 / one))))]
    for start, end in events:
        clean_flush() if clean else cuda.memset_zero(_FLUSH[0])
        start.record()
        fn(*args)
        end.record()
    cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in events]))


_CEILINGS: dict = {}


def read_ceiling_ms(nbytes: int):
    """The fastest a kernel can stream `nbytes` from memory once under `time_calls`' conditions
    (L2 evicted first, CUDA events): a grid-stride float32 sum, best of a few launch shapes
    (measured on the H200: BLOCK 4096, 8 or 16 warps, 16-32 programs per SM). A reduction that
    reads its input once cannot beat it. For tens of megabytes it is well below the copy
    bandwidth's floor, mostly because the fill leaves dirty lines in L2 whose write-back the read
    pays for (`clean_flush`): 64 MB reached 0.64 of the floor, 128 MB 0.76, 256 MB 0.89, 512 MB
    0.98; after a 256 MB read instead, 0.84, 0.95 and 0.99 for 64-256 MB. Needs torch (for the buffer
    and the timer, as the torch.compile columns do); None without it."""
    if nbytes in _CEILINGS:
        return _CEILINGS[nbytes]
    try:
        import torch
        import triton
        import triton.language as tl
        import triton.testing
    except Exception:
        return None

    @triton.jit
    def stream_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = i + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc))

    n = nbytes // 4
    x = torch.randn(n, device="cuda")
    out = torch.empty(1 << 13, device="cuda")
    sms = cuda.get_device_properties().sm_count
    best = min(triton.testing.do_bench(lambda: stream_sum[(p,)](x, out, n, 4096, num_warps=w), return_mode="median")
               for p in (16 * sms, 32 * sms) for w in (8, 16))
    _CEILINGS[nbytes] = best
    return best


def torch_time(name, shapes):
    try:
        import torch
        import triton.testing
    except Exception:
        return None
    fns = {
        "ex1_1": lambda x, y: (torch.relu(x + y) * 2).sum(-1),
        "ex6_1": lambda x, y: x.t() + y,
        "ex6_2": lambda x: (x * x).sum(-1),
        "softmax": lambda x: torch.softmax(x, -1),
        "softmax:long": lambda x: torch.softmax(x, -1),
        "softmax:verylong": lambda x: torch.softmax(x, -1),
        "layernorm": lambda x, w, b: torch.nn.functional.layer_norm(x, (4096,), w, b),
        "gelu": lambda h: 0.7 * (0.5 * (1 + torch.erf(h * 0.7071067811865476)) + h * torch.exp(-0.5 * h * h) * 0.3989422804014327),
        "tile3d": lambda x, y, z: x + y.permute(2, 0, 1) * z.permute(1, 2, 0),
        "scale": lambda x: x * 2,
        "colsum:large": lambda x: x.sum(0),
        "colsum:small": lambda x: x.sum(0),
        "mean01": lambda x: x.mean((0, 1)),
        "var0": lambda x: x.var(0),
        "bnstats": lambda x: (x.mean((0, 2, 3)), x.var((0, 2, 3))),
        "amax_mid": lambda x: x.amax(1),
        "biasgrad": lambda g: g.reshape(-1, 1024).sum(0),
        "xent": lambda x, t: torch.nn.functional.cross_entropy(x, t),
    }
    args = [make_input(s, torch) for s in shapes]
    f = torch.compile(fns[name])
    t0 = time.perf_counter()
    f(*args)
    torch.cuda.synchronize()
    cold = time.perf_counter() - t0
    ms = triton.testing.do_bench(lambda: f(*args), return_mode="median")
    clean_ms = torch_clean_ms(lambda: f(*args)) if name in REDUCTION_NAMES else None
    del args
    torch.cuda.empty_cache()
    return ms, cold, clean_ms


_TORCH_FLUSH = []     # torch_clean_ms's 1 GB buffer, made once


def torch_clean_ms(call, iters: int = 100) -> float:
    """torch's side of `time_calls(clean=True)`: median ms, a 1 GB read (amax) before each call."""
    import torch
    if not _TORCH_FLUSH:
        _TORCH_FLUSH.append(torch.randn(256 << 20, device="cuda"))
    buf = _TORCH_FLUSH[0]
    for _ in range(3):
        call()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in pairs:
        buf.amax()
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in pairs]))


def _torch_matmul(name, shape, dt, precision) -> dict:
    """torch.compile default and max-autotune on the same problem, under the same precision."""
    try:
        import torch
        import triton.testing
    except ImportError:
        return {}
    m, k, n = shape
    torch.set_float32_matmul_precision(precision)
    ta = [torch.randn(m, k, device="cuda", dtype=getattr(torch, dt)),
          torch.randn(k, n, device="cuda", dtype=getattr(torch, dt)), torch.randn(n, device="cuda", dtype=getattr(torch, dt))]
    fn = TORCH_MATMULS.get(name, lambda a, b, c: torch.relu(a @ b + c))
    out = {}
    for mode in ("default", "max-autotune"):
        torch._dynamo.reset()
        tf = torch.compile(fn, mode=mode)
        tf(*ta)
        tms = triton.testing.do_bench(lambda: tf(*ta), return_mode="median")
        out[f"torch_{mode}_ms"] = tms
        out[f"torch_{mode}_tflops"] = 2 * m * n * k / tms * 1e-9
    torch.set_float32_matmul_precision("highest")
    return out


def matmuls(names):
    """The template (epilogue fused; split-K where the chapter's criterion holds) against
    torch.compile default and max-autotune at the same shape, dtype and matmul precision."""
    rows = []
    for name in names:
        fn, (m, k, n), dt, precision = MATMULS[name]
        dtype = getattr(stax, dt)
        stax.set_float32_matmul_precision(precision)
        args = [stax.randn(m, k, device="cuda").to(dtype), stax.randn(k, n, device="cuda").to(dtype),
                stax.randn(n, device="cuda").to(dtype)]
        f = stax.compile(fn)
        t0 = time.perf_counter()
        f(*args)
        cuda.synchronize()
        cold = time.perf_counter() - t0
        ms = time_calls(f, args, iters=10)
        stax.set_float32_matmul_precision("highest")
        row = {"workload": name, "shape": [m, k, n], "dtype": dt, "precision": precision, "stax_ms": ms,
               "stax_tflops": 2 * m * n * k / ms * 1e-9, "stax_first_call_s": cold,
               "kernels": list(f.last_generated.kernels),
               "candidates": mm_winners(f) or "templates only (cuBLASLt not installed)"}
        row.update(_torch_matmul(name, (m, k, n), dt, precision))
        if "torch_default_ms" in row:
            row["speedup"] = row["torch_default_ms"] / ms
            row["speedup_max_autotune"] = row["torch_max-autotune_ms"] / ms
        print(json.dumps(row), flush=True)
        rows.append(row)
        del args
    return rows


FP8_SHAPES = [(8192, 8192, 8192), (4096, 4096, 14336), (64, 8192, 8192)]    # m, k, n


def scaled_mms():
    """stax._scaled_mm (float8 e4m3fn operands, tensor-wise scales, bfloat16 out: the Triton
    template with fp8 into tl.dot) against torch._scaled_mm (cuBLASLt) on the same codes,
    checked against each other; TFLOP/s."""
    rows = []
    for m, k, n in FP8_SHAPES:
        rng = np.random.default_rng(0)
        a = stax.from_numpy(rng.standard_normal((m, k), np.float32)).to(stax.float8_e4m3fn).to("cuda")
        w = stax.from_numpy(rng.standard_normal((n, k), np.float32)).to(stax.float8_e4m3fn).to("cuda")
        sa, sb = stax.tensor(0.5, device="cuda"), stax.tensor(0.25, device="cuda")
        f = stax.compile(lambda a, b, sa, sb: stax._scaled_mm(a, b, sa, sb, out_dtype=stax.bfloat16))
        out = f(a, w.t(), sa, sb)
        ms = time_calls(f, [a, w.t(), sa, sb], iters=10)
        row = {"workload": f"scaled_mm {m}x{k}x{n}", "stax_ms": ms, "stax_tflops": 2 * m * n * k / ms * 1e-9,
               "kernels": list(f.last_generated.kernels)}
        try:
            import torch
            import triton.testing
            ta = torch.from_numpy(_codes(a)).cuda().view(torch.float8_e4m3fn)
            tw = torch.from_numpy(_codes(w)).cuda().view(torch.float8_e4m3fn)
            ts = torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")
            ref = torch._scaled_mm(ta, tw.t(), *ts, out_dtype=torch.bfloat16)
            tms = triton.testing.do_bench(lambda: torch._scaled_mm(ta, tw.t(), *ts, out_dtype=torch.bfloat16),
                                          return_mode="median")
            err = (ref.float().cpu().numpy() - out.float().cpu().numpy())
            row.update(torch_ms=tms, torch_tflops=2 * m * n * k / tms * 1e-9, speedup=tms / ms,
                       max_abs_diff=float(np.abs(err).max()))
        except ImportError:
            pass
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _codes(t) -> np.ndarray:
    """The one-byte codes of a float8 Stax tensor (its storage), as a [rows, cols] uint8 array."""
    return t.cpu()._storage.data.reshape(t.shape).copy()


def _winner_text(c) -> str:
    if isinstance(c, str):
        return c
    return "; ".join(f"{v['winner']} (template {v['template_ms']:.3f} ms, cuBLASLt {v['cublaslt_ms']:.3f} ms)"
                     if v["template_ms"] is not None else str(v["winner"]) for v in c.values())


def indexing(names, bw):
    """The gather and the scatter of INDEXING: Stax (one kernel each) against the floor and
    torch.compile, on the same table, indices and rows."""
    rows = []
    rng = np.random.default_rng(0)
    idx_np = rng.integers(0, EMB_ROWS, N_IDX, dtype=np.int64)
    for name in names:
        fn, torch_fn, passes = INDEXING[name]
        args = [stax.zeros(EMB_ROWS, EMB_DIM, device="cuda"), stax.tensor(idx_np, device="cuda")]
        if name == "index_add":
            args.append(stax.randn(N_IDX, EMB_DIM, device="cuda"))
        f = stax.compile(fn)
        t0 = time.perf_counter()
        f(*args)
        cuda.synchronize()
        cold = time.perf_counter() - t0
        ms = time_calls(f, args)
        floor = (N_IDX * 8 + passes * N_IDX * EMB_DIM * 4) / bw * 1e3
        row = {"workload": name, "stax_ms": ms, "floor_ms": floor, "frac": floor / ms,
               "kernels": list(f.last_generated.kernels), "stax_cold_s": cold}
        del args
        try:
            import torch
            import triton.testing
            targs = [torch.zeros(EMB_ROWS, EMB_DIM, device="cuda"), torch.from_numpy(idx_np).cuda()]
            if name == "index_add":
                targs.append(torch.randn(N_IDX, EMB_DIM, device="cuda"))
            tf = torch.compile(torch_fn(torch))
            tf(*targs)
            tms = triton.testing.do_bench(lambda: tf(*targs), return_mode="median")
            row.update(torch_ms=tms, speedup=tms / ms)
            del targs
            torch.cuda.empty_cache()
        except ImportError:
            pass
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _torch_conv(c, h, w, co, k, stride, pad, host):
    """torch's time for the same conv (the faster of torch.compile and eager cuDNN with
    cudnn.benchmark), and the largest error of Stax's result
    (host: Stax's output and the inputs as float32 numpy) relative to torch's largest value."""
    try:
        import torch
        import triton.testing
    except ImportError:
        return {}
    x, wt, b, out = (torch.from_numpy(a).cuda().to(torch.bfloat16) for a in host)
    x, wt = (t.contiguous(memory_format=torch.channels_last) for t in (x, wt))
    tf = torch.compile(lambda x, w, b: torch.nn.functional.conv2d(x, w, b, stride=stride, padding=pad))
    want = tf(x, wt, b).float()
    err = float((out.float() - want).abs().max() / want.abs().max())
    tms = triton.testing.do_bench(lambda: tf(x, wt, b), return_mode="median")
    # cuDNN's default heuristic can pick a slow algorithm for bf16 channels-last; eager conv2d with
    # cudnn.benchmark (every algorithm timed once) is torch's best case, and the one compared with
    torch.backends.cudnn.benchmark = True
    try:
        eager = lambda: torch.nn.functional.conv2d(x, wt, b, stride=stride, padding=pad)
        eager()
        bench_ms = triton.testing.do_bench(eager, return_mode="median")
    finally:
        torch.backends.cudnn.benchmark = False
    return {"torch_ms": min(tms, bench_ms), "torch_compile_ms": tms, "torch_cudnn_benchmark_ms": bench_ms,
            "rel_err_vs_torch": err}


def convs(names):
    """conv2d as an implicit GEMM (bf16, channels-last input and weight, bias) against torch.compile."""
    rows = []
    for name in names:
        c, h, w, co, k, stride, pad = CONVS[name]
        n = CONV_BATCH
        x = stax.randn(n, h, w, c, device="cuda").to(stax.bfloat16).permute(0, 3, 1, 2)
        wt = (stax.randn(co, k, k, c, device="cuda") * (1 / math.sqrt(c * k * k))).to(stax.bfloat16).permute(0, 3, 1, 2)
        b = stax.randn(co, device="cuda").to(stax.bfloat16)
        f = stax.compile(lambda x, w, b: stax.conv2d(x, w, b, stride=stride, padding=pad))
        t0 = time.perf_counter()
        out = f(x, wt, b)
        cuda.synchronize()
        cold = time.perf_counter() - t0
        ms = time_calls(f, [x, wt, b])
        # split-K's combine sums the partials in split order: every call gives the same bits
        stable = all(np.array_equal(f(x, wt, b).float().cpu().numpy(), out.float().cpu().numpy()) for _ in range(3))
        oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        flop = 2 * n * co * oh * ow * c * k * k
        conv = [v for key, v in f.artifacts[next(iter(f.artifacts))][0].__globals__.items()
                if key.startswith("triton_tem_fused_conv") and hasattr(v, "config")]
        row = {"workload": name, "shape": f"{n}x{c}x{h}x{w} * {co}x{c}x{k}x{k} s{stride} p{pad}",
               "stax_ms": ms, "stax_tflops": flop / ms * 1e-9, "stax_cold_s": cold,
               "kernels": list(f.last_generated.kernels),
               # Alg. 9.1's choice (SPLIT_K > 1: the split-K form, issue 14) and its measured time
               "config": conv[0].config if conv else None, "kernel_ms": conv[0].best_ms if conv else None,
               "bitwise_stable": stable}
        host = [t.float().cpu().numpy() for t in (x.contiguous(), wt.contiguous(), b, out)]
        row.update(_torch_conv(c, h, w, co, k, stride, pad, host))
        if "torch_ms" in row:
            row.update(torch_tflops=flop / row["torch_ms"] * 1e-9, speedup=row["torch_ms"] / ms)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x, wt, b, out
    return rows


def conv_table(rows):
    print("\n| conv2d (bf16, channels-last, batch 32) | Stax ms (TFLOP/s) | torch.compile ms (TFLOP/s) | torch/Stax | rel. err | blocks, SPLIT_K |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cfg = r.get("config") or {}
        blocks = "x".join(str(cfg.get(b, "?")) for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        print(f"| {r['workload']} {r['shape']} | {r['stax_ms']:.3f} ({r['stax_tflops']:.0f}) | "
              f"{r.get('torch_ms', float('nan')):.3f} ({r.get('torch_tflops', float('nan')):.0f}) | "
              f"{r.get('speedup', float('nan')):.2f} | {r.get('rel_err_vs_torch', float('nan')):.1e} | "
              f"{blocks}, {cfg.get('SPLIT_K', 1)} |")


def host_overhead():
    """Host µs per launch (best of 3 runs of 2000): a one-kernel compiled function on a tiny input,
    the kernel's launch alone (`CachingAutotuner.run`), and the bare driver call under it (the
    launcher with its argument list built beforehand: the floor for a launch from Python)."""
    x = stax.randn(1024, device="cuda")
    f = stax.compile(lambda x: x * 2 + 1)
    f(x)
    cuda.synchronize()
    call = next(iter(f.artifacts.values()))[0]
    kernel = [v for k, v in call.__globals__.items() if k.startswith("triton_poi")][0]
    out = stax.empty(1024, device="cuda")
    kernel.run(x, out, 1024, stream=None)
    cuda.synchronize()
    _, grid, launcher = kernel._fast
    ptrs = [x.data_ptr(), out.data_ptr(), 1024]

    def per(fn, n=2000):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best
    return (per(lambda: f(x)), per(lambda: kernel.run(x, out, 1024, stream=None)),
            per(lambda: launcher.launch_ints(grid, ptrs)))


COLD = r"""
import time, sys
sys.path.insert(0, {root!r})
import stax
from stax import cuda
x = stax.randn(1 << 20, device="cuda"); cuda.synchronize()
f = stax.compile(lambda x: (x * 2 + 1).relu())
t0 = time.perf_counter(); f(x); cuda.synchronize(); t = time.perf_counter() - t0
print("SECONDS", t, "triton_loaded", 'triton' in sys.modules)
"""


COLD_MLP = r"""
import time, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/bench")
import numpy as np
import stax
from stax import cuda
import gpu
rng = np.random.default_rng(0)
fn, _, arrays, dt = gpu.launch_bound_inputs(rng)["mlp_bf16_b8"]
args = [stax.from_numpy(a.astype(np.float32)).to("cuda").to(stax.bfloat16) for a in arrays]
cuda.synchronize()
if {late_setup}:                       # triton's setup left to the first compile, as before issue 14
    import threading
    from stax import cuda_triton
    done = threading.Thread(target=lambda: None); done.start(); done.join(); cuda_triton._warming.append(done)
if {full_table}:                       # the GEMM's 8 candidates of before issue 14's small-M list
    from stax import template_tuning
    template_tuning.SMALL_M = 0
f = stax.compile(fn)
t0 = time.perf_counter(); f(*args); cuda.synchronize(); t = time.perf_counter() - t0
print("SECONDS", t, "kernels", len(f.last_generated.kernels))
from stax import cache                 # what Alg. 9.1 measured (the records this process wrote)
for p in sorted(cache.folder("autotune").glob("*.json")):
    r = cache.read_sealed_json(p, lambda r: isinstance(r, dict), "a record")
    if r and "candidate_ms" in r:
        print("RECORD", p.stem.rsplit("_", 1)[0], "chosen", r["config"], "candidate ms",
              [round(x, 4) for x in r["candidate_ms"]], "of", len(r["candidates"]))
    elif r:
        print("RECORD", p.stem.rsplit("_", 1)[0], {{k: v for k, v in r.items() if k != "key"}})
"""


def mlp_compile_times():
    """Issue 14's tuning cost: the cold compile (fresh Stax and Triton caches, a new process) of the
    4-layer MLP block (four 1024x1024 bf16 matmuls at batch 8, default mode), then a warm-cache
    process; then, each cold, the two changes of issue 14 that can be undone in a process: triton's
    setup left to the first compile, and the GEMM's full 8 candidates. `python bench/gpu.py coldmlp`."""
    import tempfile
    root = os.path.join(os.path.dirname(__file__), "..")
    base = dict(os.environ)
    base.setdefault("PYTHONPYCACHEPREFIX", tempfile.mkdtemp(prefix="stax-pyc-"))
    base.pop("PYTHONDONTWRITEBYTECODE", None)     # bytecode present, as after `pip install`
    subprocess.run([sys.executable, "-c", "import sympy, triton, numpy, cffi"], check=True, env=base)
    def fresh():
        return dict(base, STAX_CACHE_DIR=tempfile.mkdtemp(prefix="stax-bench-"),
                    TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-bench-"))
    env = fresh()
    out = []
    for what, late_setup, full_table in (("cold compile", False, False), ("warm on-disk cache", False, False),
                                         ("cold, triton's setup at the first compile", True, False),
                                         ("cold, the GEMM's 8 candidates of before", False, True)):
        if what.startswith("cold") and out:
            env = fresh()
        code = COLD_MLP.format(root=root, late_setup=late_setup, full_table=full_table)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        line = [l for l in r.stdout.splitlines() if l.startswith("SECONDS")]
        print(f"MLP block, {what}:", line[0] if line else r.stdout + r.stderr[-2000:], flush=True)
        for rec in (l for l in r.stdout.splitlines() if l.startswith("RECORD") and what.startswith("cold")):
            print("  " + rec, flush=True)
        out.append(float(line[0].split()[1]) if line else float("nan"))
    return out[:2]


def small_m_gemm():
    """Issue 14's check that the small-M candidate list (template_tuning._small_m) keeps the
    fastest block shape: the MLP block's GEMM (8 x 1024 x 1024 bf16) under every configuration of
    the template's table clamped to its sizes (the 8 it compiled before, the 2 the cap cut, the 4
    of the small-M list, whose first, the default, now runs unmeasured), each timed on the GPU
    alone (a CUDA graph of 50 launches, so the host's launch time hides nothing) and as Alg. 9.1
    times it (cuda.median_ms: launch-bound at this size). `python bench/gpu.py smallm`."""
    from stax import template_tuning as tt, triton_heuristics as th
    a = stax.randn(8, 1024, device="cuda").to(stax.bfloat16)
    b = stax.randn(1024, 1024, device="cuda").to(stax.bfloat16)
    out = stax.empty(8, 1024, device="cuda", dtype=stax.bfloat16)
    gen = stax.generate(lambda a, b: a @ b, a, b, device="cuda")
    (name,) = [n for n in gen.kernels if n.startswith("triton_tem")]
    k = th.kernel_from_source(name, gen.kernels[name])
    numels = {"bnumel": 1, "mnumel": 8, "nnumel": 1024, "knumel": 1024, **k.meta}
    now = th.candidates("template", numels)
    small, tt.SMALL_M = tt.SMALL_M, 0
    try:
        table = tt.template_configs(numels)
    finally:
        tt.SMALL_M = small
    before = table[:8]
    args = (a, b, out, 1, 8, 1024, 1024)
    ptrs = [x if isinstance(x, int) else x.data_ptr() for x in args]
    rows = []
    for cfg in table + [c for c in now if c not in table]:
        launcher, grid = k._launcher(cfg, True, args), k.grid(numels, cfg)
        g = cuda.CUDAGraph()
        with g:
            for _ in range(50):
                launcher(grid, ptrs)
        gpu_us = cuda.median_ms(g.replay) / 50 * 1e3
        rows.append({"config": {x: cfg[x] for x in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")},
                     "gpu_us": round(gpu_us, 2), "alg91_us": round(cuda.median_ms(lambda: launcher(grid, ptrs)) * 1e3, 2),
                     "before": cfg in before, "now": cfg in now, "default_now": cfg == now[0],
                     "spills": launcher.kernel.local_size_bytes > 0})
        print(json.dumps(rows[-1]), flush=True)
    best = {w: min(r["gpu_us"] for r in rows if r[w]) for w in ("before", "now", "default_now")}
    print(f"best GPU time of the candidates compiled before: {best['before']:.2f} us, now: {best['now']:.2f} us "
          f"({'kept' if best['now'] <= best['before'] * 1.02 else '**SLOWER**'}); the default, which runs "
          f"unmeasured now (template_tuning.launch_bound): {best['default_now']:.2f} us")
    return rows


def compile_times():
    """Cold compile (fresh Stax and Triton caches) and warm on-disk cache, each in a new process.

    Python's bytecode of the installed packages is present, as after `pip install` (which compiles
    it): where site-packages holds none (the lent H200's), a first process writes it under
    PYTHONPYCACHEPREFIX; the time of a process without it is printed too.
    """
    import tempfile
    root = os.path.join(os.path.dirname(__file__), "..")
    base = dict(os.environ)
    base.setdefault("PYTHONPYCACHEPREFIX", tempfile.mkdtemp(prefix="stax-pyc-"))
    base.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import sympy, triton, numpy, cffi"], check=True, env=base)
    print(f"a process that imports sympy and triton (writing their bytecode): {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import triton"], check=True, env=base)
    print(f"a process that imports triton: {time.perf_counter() - t0:.2f} s")

    def fresh(**extra):
        return dict(base, STAX_CACHE_DIR=tempfile.mkdtemp(prefix="stax-bench-"),
                    TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton-bench-"), **extra)

    def run(env, what):
        r = subprocess.run([sys.executable, "-c", COLD.format(root=root)], env=env, capture_output=True, text=True)
        line = [l for l in r.stdout.splitlines() if l.startswith("SECONDS")]
        print(f"{what}:", line[0] if line else r.stdout + r.stderr[-2000:])
        return float(line[0].split()[1]) if line else float("nan")
    run(fresh(STAX_AUTOTUNE="0"), "cold compile without measuring candidates (STAX_AUTOTUNE=0)")
    nobytecode = {k: v for k, v in fresh().items() if k != "PYTHONPYCACHEPREFIX"}
    run(dict(nobytecode, PYTHONDONTWRITEBYTECODE="1"), "cold compile, no bytecode for installed packages")
    env = fresh()
    return [run(env, "cold compile"), run(env, "warm on-disk cache")]


# ---- §9.9 Launch-bound work: CUDA graphs (issue 13; `python bench/gpu.py launchbound`) ----


def mlp_block(x, *params):
    """Issue 13's MLP block: 4 layers of matmul + bias + GELU + layer_norm (width 1024)."""
    h = x
    for i in range(0, len(params), 4):
        w, b, g, beta = params[i:i + 4]
        h = stax.layer_norm(stax.gelu(h @ w + b), (h.shape[-1],), g, beta)
    return h


def chain20(x):
    """Issue 13's chain: 20 steps of sin(x) + x.sum(-1, keepdim=True) * 1e-3 on 64x64."""
    for _ in range(20):
        x = stax.sin(x) + x.sum(-1, keepdim=True) * 1e-3
    return x


def launch_bound_inputs(rng):
    """{name: (stax function, torch function, numpy inputs)} at issue 13's sizes."""
    def mlp_torch(x, *params):
        import torch.nn.functional as F
        h = x
        for i in range(0, len(params), 4):
            w, b, g, beta = params[i:i + 4]
            h = F.layer_norm(F.gelu(h @ w + b), (h.shape[-1],), g, beta)
        return h

    def chain_torch(x):
        for _ in range(20):
            x = x.sin() + x.sum(-1, keepdim=True) * 1e-3
        return x
    params = []
    for _ in range(4):
        params += [rng.standard_normal((1024, 1024)) / 32, rng.standard_normal(1024) * 0.1,
                   1 + rng.standard_normal(1024) * 0.1, rng.standard_normal(1024) * 0.1]
    return {"mlp_bf16_b8": (mlp_block, mlp_torch, [rng.standard_normal((8, 1024))] + params, "bfloat16"),
            "chain20_64x64": (chain20, chain_torch, [rng.standard_normal((64, 64))], "float32")}


def _per_call_us(fn, args, sync, n=2000, warm=20):
    """Wall µs per call of back-to-back calls (best of 3): what a launch-bound loop sees."""
    for _ in range(warm):
        fn(*args)
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        sync()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def _host_us(fn, args, sync, n=200):
    """Host µs per call, the old method (labelled `b2b200`): 200 back-to-back calls, the device
    left to catch up afterwards, best of 5. Once the driver's launch queue is full (about a
    thousand pending launches; a replay of ~25 µs of GPU work is enqueued in a few µs, so a long
    run gets there), the launch waits for the GPU to drain, and that wait is counted here."""
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    sync()
    return best


def _host_burst(fn, args, sync, k=16, reps=300):
    """Host µs per call, the method of record: bursts of `k` calls, each begun on an idle device
    (short enough that the launch queue never fills), median with p10-p90 (host_path.bursts)."""
    import host_path
    return host_path.bursts(fn, args, sync, k=k, reps=reps, warm=16)


BURST_LENGTHS = (4, 8, 16, 32, 64, 128, 256, 512)


def _burst_sweep(fn, args, sync) -> dict:
    """Median host µs per call against the burst length: flat while the host only enqueues,
    rising once the launch queue fills and the launches wait for the GPU (the back-pressure that
    `_host_us`'s 200 back-to-back calls may include)."""
    return {k: _host_burst(fn, args, sync, k=k, reps=max(8, 2048 // k)) for k in BURST_LENGTHS}


def launch_bound():
    """Default mode, reduce-overhead, torch.compile and torch.compile(mode='reduce-overhead'):
    µs per call and host µs per call; for Stax's graphs also the host µs of one replay (condition 2
    + cuGraphLaunch + the output tensors) and of the bare cuGraphLaunch."""
    import host_path                    # (bench/: the stage breakdown, as host_path.py prints it on the CPU)
    rows, stage_rows = [], {}
    for name, (fn, tfn, arrays, dt) in launch_bound_inputs(np.random.default_rng(0)).items():
        args = [stax.from_numpy(a.astype(np.float32)).to("cuda").to(getattr(stax, dt)) for a in arrays]
        row = {"workload": name}
        outs = {}
        for mode in ("default", "reduce-overhead"):
            f = stax.compile(fn, mode=mode)
            outs[mode] = f(*args).clone().float().cpu().numpy()     # warm-up (autotunes), then checked
            outs[mode] = f(*args).clone().float().cpu().numpy()
            row[f"stax_{mode}_us"] = _per_call_us(f, args, cuda.synchronize)
            t = _host_burst(f, args, cuda.synchronize)
            row[f"stax_{mode}_host_us"], row[f"stax_{mode}_host_us_p10_p90"] = float(t), (t.lo, t.hi)
            row[f"stax_{mode}_host_us_b2b200"] = _host_us(f, args, cuda.synchronize)
            row["kernels"] = len(f.last_generated.kernels)
        g = next(iter(f.artifacts.values()))[0]
        if hasattr(g, "rec") and g.rec is not None:
            replay = lambda *a: g(list(a))      # noqa: E731
            t = _host_burst(replay, args, cuda.synchronize)
            row["replay_host_us"], row["replay_host_us_p10_p90"] = float(t), (t.lo, t.hi)
            row["replay_host_us_b2b200"] = _host_us(replay, args, cuda.synchronize)
            t = _host_burst(g.rec.graph.replay, [], cuda.synchronize)
            row["cuGraphLaunch_host_us"], row["cuGraphLaunch_host_us_p10_p90"] = float(t), (t.lo, t.hi)
            row["cuGraphLaunch_host_us_b2b200"] = _host_us(g.rec.graph.replay, [], cuda.synchronize)
            row["replay_host_us_by_burst"] = {k: float(v) for k, v in
                                              _burst_sweep(replay, args, cuda.synchronize).items()}
            row["cuGraphLaunch_host_us_by_burst"] = {k: float(v) for k, v in
                                                     _burst_sweep(g.rec.graph.replay, [], cuda.synchronize).items()}
            row["graph_stats"] = dict(g.stats)
            batches = [stax.from_numpy(arrays[0].astype(np.float32)).to("cuda").to(getattr(stax, dt))
                       for _ in range(4)]          # (after the rows above: a new batch records once more)
            stage_rows[name] = host_path.stages(f, args, batches, lambda fn, a: _host_burst(fn, a, cuda.synchronize))
        else:
            row["graph_stats"] = "NOT WRAPPED (STAX_LOGS=cudagraphs says why)"
        row["max_abs_diff_vs_default"] = float(np.nanmax(np.abs(outs["reduce-overhead"] - outs["default"])))
        row.update(_torch_launch_bound(tfn, arrays, dt))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\nhost µs: median (p10–p90) of 16-call bursts, each begun on an idle device; [b2b200]: the old "
          "method, 200 back-to-back calls, best of 5 (counts any wait for a full launch queue)")
    print("| workload | Stax default µs | Stax reduce-overhead µs | torch.compile µs | torch reduce-overhead µs "
          "| host µs/call (default / graphs) [b2b200] | host µs per replay [b2b200] | cuGraphLaunch µs [b2b200] |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    nan = float("nan")

    def spread(r, k):
        lo, hi = r.get(k + "_p10_p90", (nan, nan))
        return f"{r.get(k, nan):.1f} ({lo:.1f}–{hi:.1f}) [{r.get(k + '_b2b200', nan):.1f}]"
    for r in rows:
        print(f"| {r['workload']} | {r['stax_default_us']:.1f} | {r['stax_reduce-overhead_us']:.1f} | "
              f"{r.get('torch_default_us', nan):.1f} | {r.get('torch_reduce-overhead_us', nan):.1f} | "
              f"{r['stax_default_host_us']:.1f} / {r['stax_reduce-overhead_host_us']:.1f} "
              f"[{r['stax_default_host_us_b2b200']:.1f} / {r['stax_reduce-overhead_host_us_b2b200']:.1f}] | "
              f"{spread(r, 'replay_host_us')} | {spread(r, 'cuGraphLaunch_host_us')} |")
    print("\nmedian host µs per call against the burst length (flat: the host's own time; rising: launches "
          "waiting on a full queue):")
    print("| workload | call | " + " | ".join(f"k={k}" for k in BURST_LENGTHS) + " |")
    print("| --- | --- |" + " --- |" * len(BURST_LENGTHS))
    for r in rows:
        for what in ("replay_host_us", "cuGraphLaunch_host_us"):
            if what + "_by_burst" in r:
                print(f"| {r['workload']} | {what[:-8]} | " +
                      " | ".join(f"{r[what + '_by_burst'][k]:.1f}" for k in BURST_LENGTHS) + " |")
    print("targets (issue 13): mlp_bf16_b8 <= 40 µs with reduce-overhead (<= 0.55x torch's reduce-overhead), "
          "chain20_64x64 <= 12 µs, host time per replay <= 5 µs")
    if stage_rows:
        print("\nreduce-overhead host path by stage (bench/host_path.py `stages`; GraphedCall(args) is "
              "replay_host_us):")
        host_path.print_stages(stage_rows)
    return rows


def _torch_launch_bound(tfn, arrays, dt) -> dict:
    try:
        import torch
    except ImportError:
        return {}
    targs = [torch.tensor(a, dtype=getattr(torch, dt), device="cuda") for a in arrays]
    found = {}
    for mode in ("default", "reduce-overhead"):
        tf = torch.compile(tfn, mode=mode)
        found[f"torch_{mode}_us"] = _per_call_us(tf, targs, torch.cuda.synchronize)
        found[f"torch_{mode}_host_us"] = float(_host_burst(tf, targs, torch.cuda.synchronize))
        found[f"torch_{mode}_host_us_b2b200"] = _host_us(tf, targs, torch.cuda.synchronize)
    return found
# ---- §9.10 attention (issue 15): `python bench/gpu.py attention [--json FILE]` ----

ATTENTION_SHAPES = [(8, 16, 4096, 64), (8, 16, 4096, 128)]     # B, H, N, d; bf16
DECODE_SHAPE = (1, 32, 1, 32768, 128)                           # B, H, queries, keys, d


def _attention_flops(b, h, m, n, d, causal) -> float:
    return 4 * b * h * m * n * d * (0.5 if causal else 1.0)


def _torch_attention(b, h, m, n, d, causal, alibi=False):
    """(torch SDPA ms, FlexAttention ms) at the same shape, bf16, or (None, None) without torch."""
    try:
        import torch
        import triton.testing
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:
        return None, None
    q = torch.randn(b, h, m, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sdpa = None
    if not alibi:
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        sdpa = triton.testing.do_bench(fn, return_mode="median")
    mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, m, n) if causal else None
    mod = (lambda s, b_, h_, qi, ki: s - torch.exp2(-(h_ + 1).to(torch.float32)) * (qi - ki)) if alibi else None
    flex = torch.compile(flex_attention)
    flex(q, k, v, score_mod=mod, block_mask=mask)
    flex_ms = triton.testing.do_bench(lambda: flex(q, k, v, score_mod=mod, block_mask=mask), return_mode="median")
    return sdpa, flex_ms


def _torch_flash_backend_ms(b, h, n, d, causal):
    """torch SDPA restricted to its FLASH_ATTENTION backend (FlashAttention-2). torch's default on
    the H200 (torch 2.11, bf16) runs cuDNN's fused flash kernel instead, which is what the
    issue's target compares with; both are recorded so a reader sees which kernel is which."""
    try:
        import torch
        import triton.testing
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:
        return None
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return triton.testing.do_bench(fn, return_mode="median")
    except RuntimeError as e:            # (a torch without that backend for these inputs)
        print(f"torch FLASH_ATTENTION backend: {e}")
        return None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _alibi(score, b, h, q_idx, kv_idx):
    slope = stax.exp2(-(h + 1).to(stax.float32))
    return score - slope * (q_idx - kv_idx)


def _hand_written(causal):
    def attention(q, k, v):
        s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]))
        if causal:
            i = stax.arange(q.shape[-2], device=q.device)
            j = stax.arange(k.shape[-2], device=q.device)
            s = stax.where(i[:, None] >= j[None, :], s, float("-inf"))
        return stax.softmax(s, -1) @ v
    return attention


def _attention_row(name, shape, causal, ms, kernels, torch_ms=None, flex_ms=None, flash_ms=None):
    tf = _attention_flops(*shape, causal) * 1e-9
    row = {"workload": name, "shape": shape, "causal": causal, "stax_ms": ms, "stax_tflops": tf / ms,
           "kernels": kernels}
    if torch_ms:
        row.update(torch_sdpa_ms=torch_ms, torch_sdpa_tflops=tf / torch_ms, vs_sdpa=torch_ms / ms)
    if flex_ms:
        row.update(flex_ms=flex_ms, flex_tflops=tf / flex_ms, vs_flex=flex_ms / ms)
    if flash_ms:
        row.update(torch_flash_backend_ms=flash_ms, torch_flash_backend_tflops=tf / flash_ms,
                   vs_flash_backend=flash_ms / ms)
    print(json.dumps(row), flush=True)
    return row


def _train_step_row(q, k, v, do, causal, flex_step_ms=None) -> dict:
    """§5 + §9.10: a stax.compile'd sdpa on inputs that require grad, forward and backward
    (the flash template saving its LSE, then the dK/dV and dQ kernels); FLOPs 3.5x the forward's."""
    b, h, n, d = q.shape
    step = stax.compile(lambda q, k, v, do: (stax.scaled_dot_product_attention(q, k, v, is_causal=causal)
                                             * do).sum())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def run():
        for t in leaves:
            t.grad = None
        step(*leaves, do).backward()
    run()
    ms = time_calls(lambda *a: run(), [], iters=10)
    row = _attention_row(f"train step d{d}", (b, h, n, n, d), causal, ms / 3.5, ["forward", "dkdv", "dq"],
                         None, flex_step_ms / 3.5 if flex_step_ms else None)
    row.update(stax_step_ms=ms, flex_step_ms=flex_step_ms)
    return row


def _backward_rows() -> list:
    """attention_backward (two kernels) against FlexAttention's backward (torch.compile'd, the
    forward's time subtracted), bf16, causal and not; FLOPs counted as 2.5x the forward's."""
    rows = []
    for b, h, n, d in ATTENTION_SHAPES:
        q, k, v, do = (stax.randn(b, h, n, d, device="cuda").to(stax.bfloat16) for _ in range(4))
        for causal in (False, True):
            out, lse = stax.attention_forward(q, k, v, is_causal=causal)
            fn = lambda: stax.attention_backward(do, q, k, v, out, lse, is_causal=causal)  # noqa: E731
            fn()
            ms = time_calls(lambda *a: fn(), [], iters=10)
            flex_ms = None
            try:
                import torch
                import triton.testing
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
                tq, tk, tv = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                              for _ in range(3))
                mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n) if causal else None
                flex = torch.compile(flex_attention)
                grad = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                fwd = triton.testing.do_bench(lambda: flex(tq, tk, tv, block_mask=mask), return_mode="median")
                both = triton.testing.do_bench(lambda: flex(tq, tk, tv, block_mask=mask).backward(grad),
                                               return_mode="median")
                flex_ms = both - fwd
            except Exception as e:          # no torch, or no FlexAttention in it
                fwd = None
                print(f"FlexAttention backward: {e}")
            row = _attention_row(f"backward d{d}", (b, h, n, n, d), causal, ms / 2.5, ["dkdv", "dq"],
                                 None, flex_ms / 2.5 if flex_ms else None)
            row.update(stax_backward_ms=ms, flex_backward_ms=flex_ms)
            rows.append(row)
            rows.append(_train_step_row(q, k, v, do, causal, flex_ms + fwd if flex_ms else None))
        del q, k, v, do
    return rows


def attention_benchmarks() -> list:
    """The SDPA pattern (hand-written, compiled: one template kernel) against torch's SDPA (its
    default, cuDNN's flash kernel on the H200, and its FLASH_ATTENTION backend) and FlexAttention; omni_attention with causal + ALiBi against FlexAttention; decode."""
    rows = []
    for b, h, n, d in ATTENTION_SHAPES:
        q, k, v = (stax.randn(b, h, n, d, device="cuda").to(stax.bfloat16) for _ in range(3))
        for causal in (False, True):
            f = stax.compile(_hand_written(causal))
            f(q, k, v)
            ms = time_calls(f, [q, k, v], iters=20)
            t_ms, f_ms = _torch_attention(b, h, n, n, d, causal)
            rows.append(_attention_row(f"sdpa_pattern d{d}", (b, h, n, n, d), causal, ms,
                                       list(f.last_generated.kernels), t_ms, f_ms,
                                       _torch_flash_backend_ms(b, h, n, d, causal)))
        mask = stax.create_block_mask(_causal, None, None, n, n, device="cuda")
        fn = lambda q, k, v: stax.omni_attention(q, k, v, score_mod=_alibi, block_mask=mask)  # noqa: E731
        fn(q, k, v)
        ms = time_calls(fn, [q, k, v], iters=20)
        _, f_ms = _torch_attention(b, h, n, n, d, True, alibi=True)
        rows.append(_attention_row(f"omni causal+alibi d{d}", (b, h, n, n, d), True, ms, ["omni"], None, f_ms))
        del q, k, v
    rows += _backward_rows()
    b, h, m, n, d = DECODE_SHAPE
    q = stax.randn(b, h, m, d, device="cuda").to(stax.bfloat16)
    k, v = (stax.randn(b, h, n, d, device="cuda").to(stax.bfloat16) for _ in range(2))
    for backend in ("TRITON", "TRITON_DECODE"):
        fn = lambda q, k, v: stax.omni_attention(q, k, v, kernel_options={"BACKEND": backend})  # noqa: E731
        try:
            fn(q, k, v)
        except (ValueError, NotImplementedError) as e:
            print(f"decode {backend}: {e}")
            continue
        ms = time_calls(fn, [q, k, v], iters=50)
        t_ms, f_ms = _torch_attention(b, h, m, n, d, False)
        rows.append(_attention_row(f"decode {backend}", (b, h, m, n, d), False, ms, [backend], t_ms, f_ms))
    print("\n| workload | causal | Stax TFLOP/s | torch SDPA TFLOP/s (default) | torch FLASH_ATTENTION backend "
          "| FlexAttention TFLOP/s | vs SDPA | vs FLASH backend | vs Flex |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        def fmt(key, spec=".0f"):
            return format(r[key], spec) if key in r else "-"
        print(f"| {r['workload']} {r['shape']} | {r['causal']} | {fmt('stax_tflops')} | {fmt('torch_sdpa_tflops')} | "
              f"{fmt('torch_flash_backend_tflops')} | {fmt('flex_tflops')} | {fmt('vs_sdpa', '.2f')} | "
              f"{fmt('vs_flash_backend', '.2f')} | {fmt('vs_flex', '.2f')} |")
    return rows


# ---- issue 16: one AdamW step over a 4-layer MLP's parameters (width 1024) ----


def _np_adamw_first_step(p, g, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=1e-2):
    """torch.optim.AdamW's first step from zero state, in float64."""
    p, g = p.astype(np.float64), g.astype(np.float64)
    m, v = (1 - b1) * g, (1 - b2) * g * g
    return p * (1 - lr * wd) - lr / (1 - b1) * m / (np.sqrt(v) / math.sqrt(1 - b2) + eps)


def adamw_step(width=1024, layers=4) -> dict:
    """stax.optim.AdamW's compiled step against torch.optim.AdamW (foreach=True, and fused=True)."""
    rng = np.random.default_rng(0)
    shapes = [(width, width), (width,)] * layers
    ps = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    gs = [rng.standard_normal(s, dtype=np.float32) * np.float32(0.01) for s in shapes]
    params = [stax.tensor(a, device="cuda", requires_grad=True) for a in ps]
    for p, g in zip(params, gs):
        p.grad = stax.tensor(g, device="cuda")
    opt = stax.optim.AdamW(params, lr=1e-3)
    opt.step()
    cuda.synchronize()
    err = max(float(np.max(np.abs(p.detach().cpu().numpy() - _np_adamw_first_step(a, g)))) for p, a, g in zip(params, ps, gs))
    row = {"workload": f"adamw_mlp{layers} step", "stax_ms": time_calls(opt.step, ()), "max_abs_err": err,
           "kernels": list(opt._fn.last_generated.kernels), "compiles": opt._fn.stats["compiles"]}
    nbytes = 7 * sum(a.nbytes for a in ps)          # p, g, m, v read; p, m, v written
    row["floor_ms"] = nbytes / copy_bandwidth() * 1e3
    try:
        import torch
        import triton.testing
    except Exception:
        return row
    for how in ("foreach", "fused"):
        tp = [torch.tensor(a, device="cuda", requires_grad=True) for a in ps]
        for p, g in zip(tp, gs):
            p.grad = torch.tensor(g, device="cuda")
        topt = torch.optim.AdamW(tp, lr=1e-3, **{how: True})
        row[f"torch_{how}_ms"] = triton.testing.do_bench(topt.step, return_mode="median")
    return row


# ---- §5 (issue 16): training steps, compiled forward + backward + AdamW, with peak memory ----


def _mlp_loss(F, layers):
    def loss(*a):
        h = a[-2]
        for i in range(layers):
            h = F.linear(h, a[2 * i], a[2 * i + 1])
            h = F.gelu(h) if i < layers - 1 else h
        return F.mse_loss(h, a[-1])
    return loss


def _mlp_arrays(width, layers, batch):
    rng = np.random.default_rng(0)
    shapes = [(width, width), (width,)] * layers + [(batch, width)] * 2
    return [rng.standard_normal(s, dtype=np.float32) * np.float32(width ** -0.5 if k < 2 * layers else 1)
            for k, s in enumerate(shapes)]


def _gpt2_arrays(n_embd, vocab, seq, batch):
    """GPT-2's block parameters (nanoGPT's initialization), inputs, targets, the causal mask."""
    rng = np.random.default_rng(0)
    C = n_embd
    p = {f"{n}.{w}": (np.ones if w == "weight" else np.zeros)(C, np.float32)
         for n in ("ln_1", "ln_2", "ln_f") for w in ("weight", "bias")}
    for name, (o, i) in {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (4 * C, C),
                         "mlp.c_proj": (C, 4 * C)}.items():
        p[name + ".weight"] = rng.standard_normal((o, i), dtype=np.float32) * np.float32(0.02)
        p[name + ".bias"] = np.zeros(o, np.float32)
    p["wte.weight"] = rng.standard_normal((vocab, C), dtype=np.float32) * np.float32(0.02)
    x = rng.standard_normal((batch, seq, C), dtype=np.float32)
    t = rng.integers(0, vocab, (batch, seq))
    return p, x, t, np.tril(np.ones((seq, seq), np.float32)).reshape(1, 1, seq, seq)


def _stax_step(loss_fn, params, inputs, mode=None):
    opt, f = stax.optim.AdamW(params, lr=1e-3), stax.compile(loss_fn, mode=mode)

    def step():
        opt.zero_grad()
        loss = f(*inputs())
        loss.backward()
        opt.step()
        return loss
    return step, f


def _step_row(name, step, torch_step, params):
    """Time a training step (CUDA events, as time_calls) and its peak memory beside torch's:
    stax.cuda.max_memory_allocated() over one step (forward, backward, AdamW), as
    torch.cuda.max_memory_allocated, before time_calls' 256 MB L2-flush buffer exists (the first
    measurement counted it: 337.6 MB = 256 MiB of flush + 81.6 MB of step). `floor_MB`: the
    parameters, their gradients and AdamW's two moments (4 bytes of state per parameter byte)."""
    t0 = time.perf_counter()
    first = float(step().item())                    # compiles forward, backward, the AdamW step
    first_s = time.perf_counter() - t0
    floor = 4 * sum(p.numel() * p.dtype.itemsize for p in params) / 2**20
    _FLUSH.clear()
    sync = cuda.synchronize if cuda.is_available() else (lambda: None)   # (no stream when interpreted)
    sync()
    cuda.reset_peak_memory_stats()
    second = float(step().item())
    sync()
    row = {"workload": name, "first_loss": first, "second_loss": second, "stax_first_step_s": first_s,
           "stax_peak_MB": cuda.max_memory_allocated() / 2**20, "floor_MB": floor}
    if not cuda.is_available():                     # the Triton interpreter: a smoke run, no times
        print(json.dumps(row), flush=True)
        return row
    row["stax_ms"] = time_calls(step, (), iters=20)
    if torch_step is not None:
        try:
            import torch
            import triton.testing
            t0 = time.perf_counter()
            tstep, tloss = torch_step(torch)
            row["torch_first_step_s"] = time.perf_counter() - t0
            row["torch_first_loss"] = tloss
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            tstep()
            torch.cuda.synchronize()
            row["torch_peak_MB"] = torch.cuda.max_memory_allocated() / 2**20
            row["torch_ms"] = triton.testing.do_bench(tstep, return_mode="median")
            row["ratio"] = row["stax_ms"] / row["torch_ms"]
        except ImportError:
            pass
    print(json.dumps(row), flush=True)
    return row


def _torch_mlp_step(arrays, layers):
    def make(torch):
        ts = [torch.tensor(a, device="cuda") for a in arrays]
        params = [t.requires_grad_() for t in ts[:-2]]
        opt, f = torch.optim.AdamW(params, lr=1e-3, foreach=True), torch.compile(_mlp_loss(torch.nn.functional, layers))

        def step():
            opt.zero_grad()
            loss = f(*params, *ts[-2:])
            loss.backward()
            opt.step()
            return loss
        return step, float(step().item())
    return make


def _torch_gpt2_step(arrays, block_loss_src):
    def make(torch):
        import torch.nn.functional as F
        p, x, t, mask = arrays
        tp = {k: torch.tensor(v, device="cuda", requires_grad=True) for k, v in p.items()}
        tx, tt, tm = (torch.tensor(a, device="cuda") for a in (x, t, mask))
        scope = {"torch": torch, "F": F, "math": math}
        exec(block_loss_src, scope)
        opt, f = torch.optim.AdamW(list(tp.values()), lr=1e-3, foreach=True), torch.compile(scope["block_loss"])

        def step():
            opt.zero_grad()
            loss = f(tx, tt, tp, tm)[1]
            loss.backward()
            opt.step()
            return loss
        return step, float(step().item())
    return make


def training_steps(tiny=False, only_gpt2=False, with_torch=True) -> list:
    """The MLP step (4 x width 1024, batch 64) and a GPT-2-small block step (768 wide, 12 heads,
    vocabulary 50257, sequence 1024, batch 8); `tiny`: small sizes, Stax only (the Triton
    interpreter can run them: TRITON_INTERPRET=1 python bench/gpu.py train --tiny)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import gpt2_block
    width, batch, (C, heads, vocab, seq, gb) = (32, 4, (32, 2, 97, 16, 2)) if tiny else \
        (1024, 64, (768, 12, 50257, 1024, 8))
    rows = []
    if only_gpt2:               # `train gpt2 [--no-torch]`: the GPT-2 block's step alone
        return _gpt2_step_row(gpt2_block, C, heads, vocab, seq, gb, tiny or not with_torch)
    arrays = _mlp_arrays(width, 4, batch)
    ts = [stax.tensor(a, device="cuda") for a in arrays]
    params = [t.requires_grad_() for t in ts[:-2]]
    step, _ = _stax_step(_mlp_loss(stax.nn.functional, 4), params, lambda: (*params, *ts[-2:]))
    rows.append(_step_row(f"train_mlp4 {width}x{batch}", step, None if tiny else _torch_mlp_step(arrays, 4), params))
    # §9.9 (issue 16): the same step with the forward and backward artifacts replayed from CUDA
    # graphs, and a launch-bound one (width 64, batch 8) in both modes
    for w, b, mode in ((width, batch, "reduce-overhead"), (64, 8, None), (64, 8, "reduce-overhead")):
        ts = [stax.tensor(a, device="cuda") for a in _mlp_arrays(w, 4, b)]
        ps = [t.requires_grad_() for t in ts[:-2]]
        step, _ = _stax_step(_mlp_loss(stax.nn.functional, 4), ps, lambda ps=ps, ts=ts: (*ps, *ts[-2:]), mode)
        rows.append(_step_row(f"train_mlp4 {w}x{b} {mode or 'default'}", step, None, ps))
    return rows + _gpt2_step_row(gpt2_block, C, heads, vocab, seq, gb, tiny)


def _gpt2_step_row(gpt2_block, C, heads, vocab, seq, gb, no_torch) -> list:
    import inspect
    gpt2_block.N_EMBD, gpt2_block.N_HEAD, gpt2_block.VOCAB = C, heads, vocab
    garrays = _gpt2_arrays(C, vocab, seq, gb)
    p = {k: stax.tensor(v, device="cuda", requires_grad=True) for k, v in garrays[0].items()}
    x, t, mask = (stax.tensor(a, device="cuda") for a in garrays[1:])
    step, _ = _stax_step(lambda *a: gpt2_block.block_loss(*a)[1], list(p.values()), lambda: (x, t, p, mask))
    src = inspect.getsource(gpt2_block.block_loss).replace("N_EMBD", str(C)).replace("N_HEAD", str(heads))
    return [_step_row(f"train_gpt2_block C={C} T={seq} B={gb}", step,
                      None if no_torch else _torch_gpt2_step(garrays, src), list(p.values()))]


def selected(argv) -> list:
    """Workloads named on the command line: a name (`softmax`, `colsum:small`), a family that is no
    name itself (`colsum`: both column sums) or a group (`reductions`), in WORKLOADS' order."""
    wanted = set()
    for a in argv:
        family = {n for n in WORKLOADS if n.split(":")[0] == a} if a not in WORKLOADS else {a}
        wanted |= set(GROUPS.get(a, [])) | family
    return [n for n in WORKLOADS if n in wanted]


def dynamic_vs_static(names, json_path=None):
    """--dynamic: the dynamic=True artifact beside the static one, at the same (hint) size."""
    rows = []
    for name in names:
        fn, shapes = WORKLOADS[name]
        args = [make_input(s) for s in shapes]
        fs = {"static": stax.compile(fn), "dynamic": stax.compile(fn, dynamic=True)}
        outs = {k: f(*args) for k, f in fs.items()}
        a, b = ([o] if not isinstance(o, (tuple, list)) else list(o) for o in outs.values())
        err = max(float(np.max(np.abs(x.cpu().numpy() - y.cpu().numpy()) / (1e-3 + np.abs(y.cpu().numpy()))))
                  for x, y in zip(b, a))
        del outs, a, b
        ms = {"static": [], "dynamic": [], "static_call": [], "dynamic_call": []}
        for rnd in range(4):
            for kind in (("static", "dynamic") if rnd % 2 == 0 else ("dynamic", "static")):
                ms[kind].append(time_calls(fs[kind], args, fill=HOST_AHEAD_FILL))
                ms[kind + "_call"].append(time_calls(fs[kind], args))
        s, d = float(np.median(ms["static"])), float(np.median(ms["dynamic"]))
        sc, dc = float(np.median(ms["static_call"])), float(np.median(ms["dynamic_call"]))
        kernels = list(fs["dynamic"].last_generated.kernels)
        rows.append({"workload": name, "static_ms": s, "dynamic_ms": d, "ratio": d / s,
                     "call_ratio": dc / sc, "static_call_ms": sc, "dynamic_call_ms": dc,
                     "max_rel_diff": err, "dynamic_kernels": kernels})
        print(json.dumps(rows[-1]), flush=True)
        del args
    x = stax.randn(4, 4, device="cuda")
    host = {}
    for kind, kw in (("static", {}), ("dynamic", {"dynamic": True})):
        f = stax.compile(lambda x: x * 2 + 1, **kw)
        for _ in range(50):
            f(x)
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            f(x)
        host[kind] = (time.perf_counter() - t0) / 2000 * 1e6
        cuda.synchronize()
    print("\n| workload | static ms | dynamic ms | dynamic/static (kernels) | target | whole call, 256 MB fill "
          "(static / dynamic ms, ratio) | max rel diff | dynamic kernels |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mark = "" if r["ratio"] <= 1.10 else " **MISSED**"
        print(f"| {r['workload']} | {r['static_ms']:.3f} | {r['dynamic_ms']:.3f} | {r['ratio']:.2f}{mark} | ≤ 1.10 | "
              f"{r['static_call_ms']:.3f} / {r['dynamic_call_ms']:.3f}, {r['call_ratio']:.2f} | "
              f"{r['max_rel_diff']:.1e} | {', '.join(r['dynamic_kernels'])} |")
    print(f"\nhost µs per call (4x4, one kernel): static {host['static']:.1f}, dynamic {host['dynamic']:.1f}")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"dynamic_rows": rows, "host_us": host}, fh, indent=1)


SPLIT_FORMS = {"one": "1", "two": "0", "all": "all"}    # STAX_SPLIT_ONE_KERNEL's values (stax/triton_outer.py)


def _compiled_with_split_form(fn, args, value: str):
    """fn compiled (and autotuned, at its first call) with STAX_SPLIT_ONE_KERNEL=value, which the
    first call reads when it generates the code."""
    saved = os.environ.get("STAX_SPLIT_ONE_KERNEL")
    os.environ["STAX_SPLIT_ONE_KERNEL"] = value
    try:
        f = stax.compile(fn)
        out = f(*args)
        cuda.synchronize()
    finally:
        if saved is None:
            os.environ.pop("STAX_SPLIT_ONE_KERNEL")
        else:
            os.environ["STAX_SPLIT_ONE_KERNEL"] = saved
    return f, out


def _host_arrays(out) -> list:
    return [np.asarray(o.cpu().float().numpy(), np.float64) for o in (out if isinstance(out, (tuple, list)) else [out])]


def onekernel_compare(names, json_path=None):
    """§6.5 (issue 12): each reduction workload with Alg. 6.1's splits in the three forms of
    STAX_SPLIT_ONE_KERNEL: OUTER splits in one kernel (the default, "one"), every split as two
    kernels ("two", as before) and row splits in one kernel too ("all"), timed in alternating
    rounds in one run; each checked against "two", and each called 50 times on one input, every
    result bitwise equal (the counters reset, the combine's order fixed)."""
    bw = copy_bandwidth()
    props = cuda.get_device_properties()
    print(f"device: {props.name}, {props.sm_count} SMs; copy bandwidth {bw / GB:.0f} GB/s")
    rows = []
    for name in names:
        fn, shapes = WORKLOADS[name]
        args = [make_input(s) for s in shapes]
        compiled = {form: _compiled_with_split_form(fn, args, value) for form, value in SPLIT_FORMS.items()}
        ref = _host_arrays(compiled["two"][1])
        row = {"workload": name}
        for form, (f, out) in compiled.items():
            got = _host_arrays(out)
            # (atol relative to the result's scale: float32 sums of 32768 values in another order
            # differ by about 1e-5 of the largest, colsum:large's 0.0045 of 800)
            row[f"agree_{form}"] = all(np.allclose(a, b, rtol=1e-4, atol=2e-5 * max(1.0, float(np.abs(b).max())))
                                       for a, b in zip(got, ref))
            row[f"stable_{form}"] = all(all(np.array_equal(a, b) for a, b in zip(_host_arrays(f(*args)), got))
                                        for _ in range(50))
            row[f"kernels_{form}"] = list(f.last_generated.kernels)
        times = {form: [] for form in compiled}
        clean = {form: [] for form in compiled}
        for _ in range(3):
            for form, (f, _) in compiled.items():
                times[form].append(time_calls(f, args))
                clean[form].append(time_calls(f, args, clean=True))
        out = compiled["one"][1]
        outs = out if isinstance(out, (tuple, list)) else [out]
        nbytes = sum(a.numel() * a.element_size() for a in args) + sum(o.numel() * o.element_size() for o in outs)
        row["floor_ms"] = nbytes / bw * 1e3
        for form in compiled:
            row[f"{form}_ms"] = min(times[form])
            row[f"frac_{form}"] = row["floor_ms"] / row[f"{form}_ms"]
            row[f"{form}_clean_ms"] = min(clean[form])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del args, compiled, out, outs
    print("\n| workload | one (default) ms | two ms | all ms | floor ms | frac one / two / all | "
          "clean L2: one / two / all ms | agree | stable | kernels (one / two / all) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ok = lambda key: all(r[f"{key}_{f}"] for f in SPLIT_FORMS)      # noqa: E731
        print(f"| {r['workload']} | {r['one_ms']:.4f} | {r['two_ms']:.4f} | {r['all_ms']:.4f} | {r['floor_ms']:.4f} | "
              f"{r['frac_one']:.2f} / {r['frac_two']:.2f} / {r['frac_all']:.2f} | "
              f"{r['one_clean_ms']:.4f} / {r['two_clean_ms']:.4f} / {r['all_clean_ms']:.4f} | {ok('agree')} | {ok('stable')} | "
              f"{' / '.join(', '.join(r['kernels_' + f]) for f in SPLIT_FORMS)} |")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"onekernel_compare": rows}, fh, indent=1)


def main(argv):
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    conv_names = [a for a in argv if a in CONVS] or (list(CONVS) if "conv" in argv else [])
    if conv_names:                   # `python bench/gpu.py conv [--json FILE]`: the convolutions only
        rows = convs(conv_names)
        conv_table(rows)
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"convs": rows}, fh, indent=1)
        return
    if "coldmlp" in argv:               # issue 14's tuning cost: the MLP block's cold compile
        cold, warm = mlp_compile_times()
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"mlp_cold_s": cold, "mlp_warm_s": warm}, fh, indent=1)
        return
    if "smallm" in argv:                # issue 14: the small-M GEMM's candidates, each timed
        rows = small_m_gemm()
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"small_m": rows}, fh, indent=1)
        return
    if "adamw" in argv:                 # issue 16's optimizer step only
        row = adamw_step()
        print(json.dumps(row))
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"adamw": row}, fh, indent=1)
        return
    if "train" in argv:                 # §5 (issue 16): training steps only
        rows = training_steps(tiny="--tiny" in argv, only_gpt2="gpt2" in argv, with_torch="--no-torch" not in argv)
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"train": rows}, fh, indent=1)
        return
    if "fp8" in argv:                   # §9.8 float8 only: stax._scaled_mm against torch._scaled_mm
        rows = scaled_mms()
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"fp8": rows}, fh, indent=1)
        return
    if "launchbound" in argv:           # §9.9 only (issue 13)
        rows = launch_bound()
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"launch_bound": rows}, fh, indent=1)
        return
    if "attention" in argv:          # §9.10 on its own: the attention rows, nothing else
        rows = attention_benchmarks()
        if json_path:
            with open(json_path, "w") as fh:
                json.dump({"attention": rows}, fh, indent=1)
        return
    if "--onekernel-compare" in argv:   # §6.5 (issue 12): the OUTER split as one kernel and as two
        return onekernel_compare(selected(argv) or GROUPS["reductions"], json_path)
    if "--dynamic" in argv:             # §10.4: each workload dynamic beside static (issue 10)
        return dynamic_vs_static(selected(argv) or list(WORKLOADS), json_path)
    idx_names = [a for a in argv if a in INDEXING] or (list(INDEXING) if "indexing" in argv else [])
    explicit = selected(argv) or idx_names or [a for a in argv if a in MATMULS]
    names = selected(argv) or ([] if explicit else list(WORKLOADS))
    mm_names = [a for a in argv if a in MATMULS] or ([] if explicit else list(MATMULS))
    idx_names = idx_names or ([] if explicit else list(INDEXING))
    props = cuda.get_device_properties()
    bw = copy_bandwidth()
    print(f"device: {props.name}, {props.sm_count} SMs; copy bandwidth {bw / GB:.0f} GB/s")
    rows = []
    modes = {"default": dict(options={"autotune": False}), "autotuned": {},
             "max-autotune": dict(mode="max-autotune")} if "--modes" in argv else {"autotuned": {}}
    for name in names:
        fn, shapes = WORKLOADS[name]
        args = [make_input(s) for s in shapes]
        by_mode = {}
        for mode, kw in modes.items():
            f = stax.compile(fn, **kw)
            t0 = time.perf_counter()
            out = f(*args)
            cuda.synchronize()
            cold = time.perf_counter() - t0
            kernels = [v for k, v in f.artifacts[next(iter(f.artifacts))][0].__globals__.items()
                       if k.startswith("triton_") and hasattr(v, "tuning_seconds")]
            by_mode[mode] = {"ms": time_calls(f, args), "first_call_s": cold,
                             "tuning_s": [round(k.tuning_seconds, 2) for k in kernels],
                             "configs": [k.config for k in kernels]}
            print(name, mode, json.dumps(by_mode[mode]), flush=True)
        outs = out if isinstance(out, (tuple, list)) else [out]
        nbytes = sum(a.numel() * a.element_size() for a in args) + sum(o.numel() * o.element_size() for o in outs)
        floor = nbytes / bw * 1e3
        ms = by_mode["autotuned"]["ms"]
        kernels = list(f.last_generated.kernels)
        tt = torch_time(name, shapes)
        row = {"workload": name, "stax_ms": ms, "floor_ms": floor, "frac": floor / ms,
               "kernels": kernels, "stax_cold_s": by_mode["autotuned"]["first_call_s"], "modes": by_mode}
        if tt:
            row.update(torch_ms=tt[0], torch_cold_s=tt[1], speedup=tt[0] / ms)
        ceiling = read_ceiling_ms(sum(a.numel() * a.element_size() for a in args)) if name in REDUCTION_NAMES else None
        if ceiling:
            row.update(read_ceiling_ms=ceiling, frac_of_ceiling=ceiling / ms)
        if name in REDUCTION_NAMES:
            row["clean_ms"] = time_calls(f, args, clean=True)
            row["clean_frac"] = floor / row["clean_ms"]
            if tt and tt[2]:
                row.update(torch_clean_ms=tt[2], clean_speedup=tt[2] / row["clean_ms"])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del args, out, outs
    rows += indexing(idx_names, bw)
    mm_rows = matmuls(mm_names)
    conv_rows = convs([] if selected(argv) else list(CONVS))
    per_call, per_launch, per_driver = host_overhead()
    cold, warm = compile_times()
    print()
    print(f"| workload | Stax ms | floor ms | frac | read ceiling ms (frac) | Stax frac of it | torch.compile ms | torch/Stax | kernels |")
    print(f"| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    if len(modes) > 1:
        print("\n| workload | heuristic ms | autotuned ms | max-autotune ms | tuning s (auto / max) | torch ms |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            if "modes" not in r:        # (INDEXING rows run in the default mode only)
                continue
            m = r["modes"]
            print(f"| {r['workload']} | {m['default']['ms']:.3f} | {m['autotuned']['ms']:.3f} | "
                  f"{m['max-autotune']['ms']:.3f} | {m['autotuned']['tuning_s']} / {m['max-autotune']['tuning_s']} | "
                  f"{r.get('torch_ms', float('nan')):.3f} |")
        print()
    for r in rows:
        tm = f"{r['torch_ms']:.3f}" if "torch_ms" in r else "-"
        sp = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        ceil = (f"{r['read_ceiling_ms']:.4f} ({r['floor_ms'] / r['read_ceiling_ms']:.2f}) | {r['frac_of_ceiling']:.2f}"
                if "read_ceiling_ms" in r else "- | -")
        print(f"| {r['workload']} | {r['stax_ms']:.3f} | {r['floor_ms']:.3f} | {r['frac']:.2f} | {ceil} | {tm} | {sp} | {', '.join(r['kernels'])} |")
    clean = [r for r in rows if "clean_ms" in r]
    if clean:
        print("\n| reduction, L2 evicted by a 1 GB read (clean) | Stax ms | frac of floor | torch.compile ms | torch/Stax |")
        print("| --- | --- | --- | --- | --- |")
    for r in clean:
        tm = f"{r['torch_clean_ms']:.3f} | {r['clean_speedup']:.2f}" if "torch_clean_ms" in r else "- | -"
        print(f"| {r['workload']} | {r['clean_ms']:.3f} | {r['clean_frac']:.2f} | {tm} |")
    if mm_rows:
        print("\n| matmul | m×k×n | Stax TFLOP/s | torch default | torch max-autotune | default/Stax | max-autotune/Stax | kernels | winner |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in mm_rows:
        nan = float("nan")
        print(f"| {r['workload']} ({r['dtype']}, {r['precision']}) | {'×'.join(map(str, r['shape']))} | "
              f"{r['stax_tflops']:.0f} | {r.get('torch_default_tflops', nan):.0f} | "
              f"{r.get('torch_max-autotune_tflops', nan):.0f} | {r.get('speedup', nan):.2f} | "
              f"{r.get('speedup_max_autotune', nan):.2f} | {', '.join(r['kernels'])} | {_winner_text(r['candidates'])} |")
    conv_table(conv_rows)
    print(f"\nhost µs per compiled call (1 kernel): {per_call:.1f}; per kernel launch alone: {per_launch:.1f}; "
          f"the driver call under it: {per_driver:.1f}")
    print(f"cold compile of a one-kernel function: {cold:.2f} s; warm on-disk cache: {warm:.3f} s")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"rows": rows, "matmuls": mm_rows, "convs": conv_rows, "per_call_us": per_call, "per_launch_us": per_launch, "per_driver_call_us": per_driver,
                       "cold_s": cold, "warm_s": warm, "bandwidth_GBs": bw / GB}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
