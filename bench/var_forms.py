"""var over dim 0 in three hand-written Triton forms beside Stax and torch.compile (§9.4, issue 12).

Stax reduces `x.var(0)` of a contiguous 8192×4096 float32 in pieces of 64 rows held in registers
(`lower.chunk_deviations`, the OUTER persistent form), then combines the 128 pieces of each column
in a second kernel: 0.039 ms with a clean L2, 0.82 of the copy floor; the pieces kernel alone is
0.87 of it. Which form reaches 0.9? This script times, each after a 1 GB read (clean L2), median of
many calls:

  - `colsum`   the one-read speed of this layout: a looped OUTER column sum, split SPLITS ways,
               the last split of a column block adds the partials (no var at all);
  - `chan`     pieces of 64 rows merged in registers with Chan's update, NP pieces a program, so
               only 128/NP partials a column; the last split combines (one kernel);
  - `welford`  a looped OUTER kernel with Welford state per lane ([R0_BLOCK, XBLOCK] means and M2s,
               one element per lane a step, as Inductor's `welford_reduce`), lanes merged once at
               the end, splits combined by the last to arrive (one kernel);
  - Stax's own `x.var(0)` and torch.compile's, the same way.

    python bench/var_forms.py                 # the H200 (needs torch, for the buffers and timers)
    TRITON_INTERPRET=1 python bench/var_forms.py --check    # small sizes on the CPU, results only

Every form is checked against float64 on data with mean 100 and standard deviation 3 (a large mean
is where a one-pass sum of squares would lose its digits).

Measured on the H200, 2026-12-04 (bench/RESULTS.md; floor 31.4 µs at 4.27 TB/s), best configuration
of each: colsum 36.1 µs (0.87 of the floor), welford 38.5 (0.82), chan 39.2 (0.80), Stax's x.var(0)
40.7 (0.77 in that run), torch.compile 47.4. No form reaches 0.9; a flat read of the same 134 MB
reaches 0.95 (33 µs): the column form's row-strided reads and its last-arriving combine cost the
difference, var or not (that run did not tell the two apart).
"""
import sys

import torch
import triton
import triton.language as tl

from gpu import torch_clean_ms       # (bench/gpu.py; it puts the repository on sys.path)
from stax.triton_helpers import last_arrival   # Stax's one-kernel split arrives the same way

CHECK = "--check" in sys.argv
DEVICE = "cpu" if CHECK else "cuda"


# ---- the forms ----


@triton.jit
def _store_and_combine(mean_ptr, m2_ptr, cnt_ptr, out_ptr, mean, m2, pid, split, cols, C, R,
                       SPLITS: tl.constexpr):
    """Store this split's (mean, M2) of its columns; the last split of the block to arrive runs
    Chan's combine of the SPLITS partials, of equal counts (R / SPLITS rows each)."""
    tl.store(mean_ptr + split * C + cols, mean)
    tl.store(m2_ptr + split * C + cols, m2)
    if last_arrival(cnt_ptr + pid, SPLITS):
        s = tl.arange(0, SPLITS)[:, None]
        means = tl.load(mean_ptr + s * C + cols)
        m2s = tl.load(m2_ptr + s * C + cols)
        grand = tl.sum(means, 0)[None, :] / SPLITS
        d = means - grand
        total = tl.sum(m2s + (R // SPLITS) * d * d, 0)[None, :]
        tl.store(out_ptr + cols, total / (R - 1))


@triton.jit
def colsum(x_ptr, part_ptr, cnt_ptr, out_ptr, C, R, SPLITS: tl.constexpr, XBLOCK: tl.constexpr,
           R0_BLOCK: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    cols = pid * XBLOCK + tl.arange(0, XBLOCK)[None, :]
    rows = tl.arange(0, R0_BLOCK)[:, None]
    acc = tl.zeros([R0_BLOCK, XBLOCK], tl.float32)
    start = split * (R // SPLITS)
    for r in tl.range(0, R // SPLITS, R0_BLOCK):
        acc += tl.load(x_ptr + (start + r + rows) * C + cols, eviction_policy="evict_first")
    tl.store(part_ptr + split * C + cols, tl.sum(acc, 0)[None, :])
    if last_arrival(cnt_ptr + pid, SPLITS):
        s = tl.arange(0, SPLITS)[:, None]
        tl.store(out_ptr + cols, tl.sum(tl.load(part_ptr + s * C + cols), 0)[None, :])


@triton.jit
def chan(x_ptr, mean_ptr, m2_ptr, cnt_ptr, out_ptr, C, R, SPLITS: tl.constexpr, XBLOCK: tl.constexpr,
         PIECE: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    cols = pid * XBLOCK + tl.arange(0, XBLOCK)[None, :]
    rows = tl.arange(0, PIECE)[:, None]
    mean = tl.zeros([1, XBLOCK], tl.float32)
    m2 = tl.zeros([1, XBLOCK], tl.float32)
    start = split * (R // SPLITS)
    for p in tl.range(0, R // SPLITS // PIECE):
        v = tl.load(x_ptr + (start + p * PIECE + rows) * C + cols, eviction_policy="evict_first")
        piece_mean = tl.sum(v, 0)[None, :] / PIECE
        d = v - piece_mean
        piece_m2 = tl.sum(d * d, 0)[None, :]
        seen = p * 1.0                       # pieces merged so far, each of PIECE rows
        delta = piece_mean - mean
        mean = mean + delta / (seen + 1)
        m2 = m2 + piece_m2 + delta * delta * (PIECE * seen / (seen + 1))
    _store_and_combine(mean_ptr, m2_ptr, cnt_ptr, out_ptr, mean, m2, pid, split, cols, C, R, SPLITS)


@triton.jit
def welford(x_ptr, mean_ptr, m2_ptr, cnt_ptr, out_ptr, C, R, SPLITS: tl.constexpr, XBLOCK: tl.constexpr,
            R0_BLOCK: tl.constexpr):
    pid, split = tl.program_id(0), tl.program_id(1)
    cols = pid * XBLOCK + tl.arange(0, XBLOCK)[None, :]
    rows = tl.arange(0, R0_BLOCK)[:, None]
    mean = tl.zeros([R0_BLOCK, XBLOCK], tl.float32)
    m2 = tl.zeros([R0_BLOCK, XBLOCK], tl.float32)
    start = split * (R // SPLITS)
    steps = R // SPLITS // R0_BLOCK
    for i in tl.range(0, steps):
        v = tl.load(x_ptr + (start + i * R0_BLOCK + rows) * C + cols, eviction_policy="evict_first")
        d = v - mean
        mean = mean + d * (1.0 / (i + 1))     # each lane has seen i + 1 elements
        m2 = m2 + d * (v - mean)
    lane_mean = tl.sum(mean, 0)[None, :] / R0_BLOCK      # lanes of equal counts (`steps` each)
    d = mean - lane_mean
    _store_and_combine(mean_ptr, m2_ptr, cnt_ptr, out_ptr, lane_mean, tl.sum(m2 + steps * d * d, 0)[None, :],
                       pid, split, cols, C, R, SPLITS)


# ---- the launches ----


def launches(R, C):
    """(form name, configuration text, a call writing `out`, out, the check's want)."""
    x = torch.randn(R, C, device=DEVICE) * 3 + 100
    want = x.double().var(0)
    out = torch.empty(C, device=DEVICE)
    cnt = torch.zeros(C, dtype=torch.int32, device=DEVICE)     # one counter per column block at most
    found = []
    for splits in (16, 32, 64):
        if R % (splits * 64):
            continue
        mean = torch.empty(splits, C, device=DEVICE)
        m2 = torch.empty_like(mean)
        for xb in (64, 128):
            if C % xb:
                continue
            grid = (C // xb, splits)
            for rb in (4, 8, 16):
                found.append(("colsum", f"splits {splits}, XBLOCK {xb}, R0_BLOCK {rb}",
                              lambda g=grid, s=splits, xb=xb, rb=rb, p=mean: colsum[g](
                                  x, p, cnt, out, C, R, s, xb, rb, num_warps=4), out, x.double().sum(0)))
                found.append(("welford", f"splits {splits}, XBLOCK {xb}, R0_BLOCK {rb}",
                              lambda g=grid, s=splits, xb=xb, rb=rb, mean=mean, m2=m2: welford[g](
                                  x, mean, m2, cnt, out, C, R, s, xb, rb, num_warps=4), out, want))
            found.append(("chan", f"splits {splits}, XBLOCK {xb}, PIECE 64",
                          lambda g=grid, s=splits, xb=xb, mean=mean, m2=m2: chan[g](
                              x, mean, m2, cnt, out, C, R, s, xb, 64, num_warps=4), out, want))
    return x, found


def main():
    R, C = (4096, 128) if CHECK else (8192, 4096)
    x, found = launches(R, C)
    rows = []
    for form, cfg, call, out, want in found:
        out.zero_()
        call()
        call()                       # the second call: the counters were reset by the first
        err = float(((out.double() - want).abs() / want.abs()).max())
        assert err < 1e-4, (form, cfg, err)
        ms = None if CHECK else torch_clean_ms(call)
        rows.append((ms or 0.0, form, cfg, err))
        print(form, cfg, f"rel err {err:.1e}", "" if CHECK else f"{ms * 1e3:.1f} us", flush=True)
    if CHECK:
        return
    floor_us = R * C * 4 / 4.27e12 * 1e6      # the H200's copy bandwidth in bench/gpu.py's runs
    print(f"\nfloor (4.27 TB/s copy) {floor_us:.1f} us")
    for form in ("colsum", "chan", "welford"):
        ms, _, cfg, err = min(r for r in rows if r[1] == form)
        print(f"| {form} | {ms * 1e3:.1f} us | {floor_us / (ms * 1e3):.2f} of the floor | {cfg} | rel err {err:.1e} |")
    import stax
    xs = stax.tensor(x.cpu().numpy()).to("cuda")
    f = stax.compile(lambda t: t.var(0))
    f(xs)
    print(f"| Stax x.var(0) | {torch_clean_ms(lambda: f(xs)) * 1e3:.1f} us | {list(f.last_generated.kernels)} |")
    g = torch.compile(lambda t: t.var(0))
    print(f"| torch.compile x.var(0) | {torch_clean_ms(lambda: g(x)) * 1e3:.1f} us |")


if __name__ == "__main__":
    main()
