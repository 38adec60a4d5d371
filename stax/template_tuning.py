"""§9.8 (with §9.6) The matmul templates at launch time: candidates, grids, tuning cost.

Layer: back end (GPU), launch time: imports only `autotune` (next_pow2). triton_heuristics.py
imports it for a template kernel (a warm start needs no sympy and no printer), and templates.py
(the kernel text) reads GROUP_M and the split-K and precision choices from here, conv_template.py
the conv's split-K bound (`conv_split_max`).

Consumes the numels a template launch passes (`bnumel`, `mnumel`, `nnumel`, `knumel`) and the
facts its decorator carries (`meta`: the element size, SPLIT_K, the tuning key; a conv's
SPLIT_K_MAX, K_TAPS, SM_COUNT); produces the
candidate configurations (Alg. 9.1's set), the grid (Def. 9.1) and the max-autotune space.

Where to look:
  - `grouped_blocks_read` ........ Prop. 9.4 / Fig. 9.1: the A and B blocks W programs read
  - `stage_bytes`, `fits_shared_memory`  the pipeline's shared memory, checked before compiling
  - `split_k_applies`, `split_k_factor`  the chapter's criterion k ≥ 128·max(m, n), and s
  - `set_float32_matmul_precision` the global precision setting (tl.dot's input_precision)
  - `template_configs`, `template_grid`, `template_tuning_space`  §9.6 for the templates
  - `_small_m`, `launch_bound` ... the candidates a GEMM of a few rows keeps, and when it measures none
  - `conv_split_max`, `_conv_splits`  the conv template's split-K: measured candidates, not a rule
"""
from __future__ import annotations

import math

from .autotune import ASSUMED_BANDWIDTH, MAX_CANDIDATES, TARGET_PROGRAMS, next_pow2

GROUP_M = 8                   # Prop. 9.4: near the optimum 2·√W for W ≈ one program per SM
SMEM_BUDGET = 227 * 1024      # bytes of shared memory one block may use on an H100/H200 (sm_90)
SPLIT_K_RATIO = 128           # §9.8: split K when k ≥ 128·max(m, n)
SPLIT_K_MIN_PIECE = 256       # each split multiplies at least this much of K
SPLIT_K_MAX = 128             # bounds the partials' traffic: s × m × n float32 written and read
SMALL_M = 16                  # rows up to which every candidate's BLOCK_M is 16 (`_small_m`)
CONV_SPLITS = (2, 3, 4)       # the conv template's split-K factors, measured where tiles leave SMs idle
CONV_SPLIT_MIN_STEPS = 4      # BLOCK_K steps each split accumulates, at least
CONV_SPLIT_DEFAULT_K = 1024   # K each split of the unmeasured default sums, at least
CONV_SPLIT_CANDIDATES = 8     # split candidates measured beside the MAX_CANDIDATES unsplit ones
LAUNCH_MS = 0.005             # about one launch's host time on the H200's host (6.8 µs, RESULTS.md)
PRECISIONS = {"highest": "ieee", "high": "tf32", "medium": "tf32"}
_precision = ["highest"]      # PyTorch's default: float32 matmuls in IEEE float32


# ---- §9.8 Precision of float32 operands ----


def set_float32_matmul_precision(precision: str) -> None:
    """As torch.set_float32_matmul_precision: "highest" multiplies float32 in IEEE float32,
    "high" and "medium" let tl.dot use TF32 (10-bit mantissas, float32 accumulation). Functions
    compiled afterwards use it (it is part of every compiled function's key)."""
    if precision not in PRECISIONS:
        raise ValueError(f"float32 matmul precision must be one of {sorted(PRECISIONS)}, "
                         f"not {precision!r}")
    _precision[0] = next(p for p in PRECISIONS if p == precision)   # the one str object (cheap `is` test)


def get_float32_matmul_precision() -> str:
    return _precision[0]


def input_precision() -> str:
    """tl.dot's input_precision for float32 operands under the current setting."""
    return PRECISIONS[_precision[0]]


# ---- Prop. 9.4 Grouped numbering ----


def grouped_blocks_read(gm: int, gn: int, w: int, group: int) -> tuple:
    """(row blocks of A, column blocks of B) that programs 0..w-1 read on a gm × gn grid of
    output blocks, numbered as the template numbers them (group = 1 is row-major order).

    Runs the template's own pid → (pid_m, pid_n) lines, so the count is of what the kernel does."""
    rows, cols = set(), set()
    for pid in range(min(w, gm * gn)):
        width = group * gn
        group_id = pid // width
        group_size = min(gm - group_id * group, group)
        rows.add(group_id * group + pid % group_size)
        cols.add((pid % width) // group_size)
    return len(rows), len(cols)


# ---- §9.8 Software pipelining: shared memory per stage ----


def stage_bytes(cfg: dict, itemsize: int) -> int:
    """Bytes one pipeline stage holds: a BLOCK_M × BLOCK_K tile of A and BLOCK_K × BLOCK_N of B."""
    return (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * itemsize


def fits_shared_memory(cfg: dict, itemsize: int, budget: int = SMEM_BUDGET) -> bool:
    """num_stages buffers of each operand must fit the SM's shared memory (§9.8's bound on s)."""
    return stage_bytes(cfg, itemsize) * cfg["num_stages"] <= budget


# ---- §9.8 Split-K ----


def split_k_applies(m: int, n: int, k: int) -> bool:
    """The chapter's criterion: K long enough that the output blocks alone cannot fill the SMs."""
    return k >= SPLIT_K_RATIO * max(m, n)


def split_k_factor(m: int, n: int, k: int, batch: int, sm_count: int) -> int:
    """s: enough programs for every SM (one per 64 × 64 output block), each split at least
    SPLIT_K_MIN_PIECE of K, at most SPLIT_K_MAX; 1 when the criterion does not hold. It is fixed
    when the code is generated (the partials' buffer is sized for it), not tuned."""
    if not split_k_applies(m, n, k):
        return 1
    tiles = math.ceil(m / 64) * math.ceil(n / 64) * batch
    s = next_pow2(max(1, math.ceil(sm_count / tiles)))
    return max(1, min(s, SPLIT_K_MAX, k // SPLIT_K_MIN_PIECE))


def conv_split_max(m: int, n: int, k: int, groups: int, sm_count: int) -> int:
    """The largest SPLIT_K a conv template's candidates may take (its float32 partials are sized
    for it when the code is generated): split only where the chapter's 128 x 128 tiles leave SMs
    idle, each split at least CONV_SPLIT_MIN_STEPS steps of the smallest BLOCK_K (16); else 1.
    The chapter's static rule k >= 128·max(m, n) does not hold for a conv (ResNet-50's layer4:
    m 1568, n 512, k 4608, 52 tiles on 132 SMs), so which split runs is measured (`_conv_splits`)."""
    if math.ceil(m / 128) * math.ceil(n / 128) * groups >= sm_count:
        return 1
    return max([1] + [s for s in CONV_SPLITS if k // s >= CONV_SPLIT_MIN_STEPS * 16])


def _conv_splits(configs: list, numels: dict) -> list:
    """A split-capable conv's candidates (meta SPLIT_K_MAX > 1): each unsplit one with SPLIT_K 1,
    then, up to CONV_SPLIT_CANDIDATES, each whose tiles leave SMs idle with SPLIT_K 2, 3, 4 (at most
    two programs per SM; s divides the K loop's steps, the kernel's unmasked slices, with at least
    CONV_SPLIT_MIN_STEPS a split), those whose waves keep the most SMs busy first, for Alg. 9.1
    to measure. The default
    (first) is split when its tiles fill under half the SMs and each split still sums
    CONV_SPLIT_DEFAULT_K of K: the largest such s, up to one program per SM."""
    m, n, k, b = (int(numels.get(f"{p}numel", 1)) for p in "mnkb")
    most, taps, sms = int(numels["SPLIT_K_MAX"]), int(numels.get("K_TAPS", 1)), int(numels["SM_COUNT"])

    def tiles(c):
        return -(-m // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]) * b

    def fits(c, s):           # the s splits share the K loop's steps evenly, enough steps each
        steps = taps * -(-k // c["BLOCK_K"])
        return steps % s == 0 and steps // s >= CONV_SPLIT_MIN_STEPS
    plain = [{**c, "SPLIT_K": 1} for c in configs[:candidate_limit(numels, splits=False)]]
    def combines(c):          # the last split's combine loads a second tile of float32 partials:
        return c["BLOCK_M"] * c["BLOCK_N"] <= 64 * 32 * c["num_warps"]   # (wider accumulators spill on sm_90)
    splits = [{**c, "SPLIT_K": s} for c in plain for s in CONV_SPLITS
              if s <= most and tiles(c) < sms and tiles(c) * s <= 2 * sms and fits(c, s) and combines(c)]

    def busy(c):              # the share of the SMs its waves keep busy, then the larger tile
        programs = tiles(c) * c["SPLIT_K"]
        return -programs / (-(-programs // sms) * sms), -c["BLOCK_M"] * c["BLOCK_N"]
    splits.sort(key=busy)     # (stable: the table's order among equals)
    first = plain[0]
    default = [s for s in CONV_SPLITS if s <= most and tiles(first) * 2 < sms and fits(first, s)
               and taps * k // s >= CONV_SPLIT_DEFAULT_K and tiles(first) * s <= max(sms, 2 * tiles(first))]
    head = [{**first, "SPLIT_K": max(default)}] if default else []
    return head + plain + [c for c in splits if c not in head][:CONV_SPLIT_CANDIDATES - len(head)]


def candidate_limit(numels: dict, splits: bool = True) -> int:
    """How many candidates Alg. 9.1 measures: MAX_CANDIDATES, a conv's deep-K ones, and a split
    conv's split ones (`splits`)."""
    plain = MAX_CANDIDATES + (len(CONV_DEEP_K) if numels.get("conv") else 0)
    return plain + (CONV_SPLIT_CANDIDATES if splits and int(numels.get("SPLIT_K_MAX", 1)) > 1 else 0)


# ---- §9.6 Launch configurations and the grid ----


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the default first, then the measured ones
GEMM_CONFIGS = ((64, 64, 32, 4, 3), (128, 128, 32, 8, 3), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
                (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 4),
                (32, 32, 32, 4, 2), (16, 64, 64, 4, 3))
# a conv's implicit GEMM also tries 128-deep K blocks: its K loop runs taps x C/BLOCK_K steps, each
# gathering a shifted input tile (ResNet's layer4 on the H200, timed cold: 64 x 128 x 128, 4 stages,
# 0.025 ms against 0.030 for the best 64-deep one)
CONV_DEEP_K = ((64, 128, 128, 4, 4), (64, 128, 128, 4, 3))


def template_configs(numels: dict) -> list:
    """The candidate set: block shapes around the chapter's 128×128×32, clamped to the sizes, and
    without those whose pipeline would not fit in shared memory (never compiled); for a GEMM of at
    most SMALL_M rows only those that can win (`_small_m`).

    The first is the heuristic default (what runs unmeasured, e.g. in Triton's interpreter)."""
    m, n, k = (int(numels.get(f"{p}numel", 1)) for p in "mnk")
    itemsize, split = int(numels.get("itemsize", 4)), int(numels.get("SPLIT_K", 1))
    cap_m, cap_n = (max(16, next_pow2(v)) for v in (m, n))
    cap_k = max(32 if itemsize == 1 else 16, next_pow2(-(-k // split)))    # (fp8 tl.dot: K ≥ 32)
    out = []
    table = GEMM_CONFIGS[:1] + CONV_DEEP_K + GEMM_CONFIGS[1:] if numels.get("conv") else GEMM_CONFIGS
    for bm, bn, bk, warps, stages in table:
        cfg = {"BLOCK_M": min(bm, cap_m), "BLOCK_N": min(bn, cap_n), "BLOCK_K": min(bk, cap_k),
               "GROUP_M": GROUP_M, "num_warps": warps, "num_stages": stages}
        if split > 1:
            cfg["SPLIT_K"] = split
        if "NUM_SMS" in numels:           # the persistent template: its grid is one program per SM
            cfg["NUM_SMS"] = int(numels["NUM_SMS"])
        if cfg not in out and fits_shared_memory(cfg, itemsize):
            out.append(cfg)
    if m <= SMALL_M:
        out = _small_m(out, n, int(numels.get("bnumel", 1)))
    if int(numels.get("SPLIT_K_MAX", 1)) > 1:
        out = _conv_splits(out, numels)
    return out


def _small_m(configs: list, n: int, batch: int) -> list:
    """A GEMM of at most SMALL_M rows (every BLOCK_M is 16) streams B once, at most 16 rows of A
    beside it: what bounds its time is the bytes of B in flight, (num_stages - 1) x BLOCK_K x N
    over all programs, and the SMs that carry them (N / BLOCK_N programs a batch). A shallower
    BLOCK_K halves the first, BLOCK_N 256 where its programs leave SMs idle cuts the second: those
    candidates cannot win, and are not compiled (issue 14: the MLP block at batch 8 compiled 8
    candidates, 4 of them of BLOCK_K 32, and never the two last of the table). The rest go most
    bytes in flight first, then most programs: the first is the default."""
    deepest = max(c["BLOCK_K"] for c in configs)
    keep = [c for c in configs if c["BLOCK_K"] == deepest and not
            (c["BLOCK_N"] > 128 and -(-n // c["BLOCK_N"]) * batch < TARGET_PROGRAMS)]
    return sorted(keep, key=lambda c: (-(c["num_stages"] - 1) * c["BLOCK_K"], c["BLOCK_N"]))


def launch_bound(numels: dict) -> bool:
    """A GEMM of at most SMALL_M rows whose operands stream in under LAUNCH_MS: Alg. 9.1's timing of
    back-to-back launches measures the host's launch time for every candidate (they cannot be told
    apart; the MLP block's GEMM at batch 8: 2 MB, 0.7 µs), so its default runs unmeasured, the
    deepest pipeline of `_small_m`, as a generated kernel of a few microseconds runs its own."""
    m, n, k, batch = (int(numels.get(f"{p}numel", 1)) for p in "mnkb")
    nbytes = (m * k + k * n + m * n) * batch * int(numels.get("itemsize", 4))
    return m <= SMALL_M and nbytes / ASSUMED_BANDWIDTH * 1e3 < LAUNCH_MS


def template_tuning_space(start: dict, numels: dict | None = None) -> dict:
    """Definition 9.2's Π for mode="max-autotune" (GROUP_M stays the chapter's 8, a matmul's
    SPLIT_K the generator's s: the partials' buffer is sized for it; a conv's any s up to the
    SPLIT_K_MAX its partials are sized for: one that does not divide the K loop's steps fails the
    kernel's static_assert, so it costs inf, never a wrong sum)."""
    space = {"BLOCK_M": [16, 32, 64, 128, 256], "BLOCK_N": [16, 32, 64, 128, 256],
             "BLOCK_K": [16, 32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [2, 3, 4, 5],
             "GROUP_M": [GROUP_M]}
    for fixed in ("SPLIT_K", "NUM_SMS"):
        if fixed in start:
            space[fixed] = [start[fixed]]
    if "SPLIT_K" in start and int((numels or {}).get("SPLIT_K_MAX", 1)) > 1:
        space["SPLIT_K"] = list(range(1, int(numels["SPLIT_K_MAX"]) + 1))
    for name, value in start.items():
        if value not in space[name]:
            space[name] = sorted(space[name] + [value])
    return space


def template_grid(numels: dict, cfg: dict) -> tuple:
    """One program per BLOCK_M × BLOCK_N output block along program_id(0), batches along (1), the
    SPLIT_K pieces of K along (2); the persistent template: min(tiles, NUM_SMS) programs."""
    def cdiv(a, b):
        return -(-int(a) // b)
    tiles = cdiv(numels["mnumel"], cfg["BLOCK_M"]) * cdiv(numels["nnumel"], cfg["BLOCK_N"])
    if "NUM_SMS" in cfg:              # persistent: each program loops over tiles NUM_SMS apart
        return (min(tiles, cfg["NUM_SMS"]), 1, 1)
    return (tiles, int(numels["bnumel"]), cfg.get("SPLIT_K", 1))
