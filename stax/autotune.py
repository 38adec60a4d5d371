"""§9.6 Choosing a kernel's launch configuration: the search, and what it searches over.

Layer: back end, pure (imports nothing of stax; no triton, no GPU). The kernel writers read its
limits on block sizes (triton_kernel.py, templates.py); the launch-time module
triton_heuristics.py feeds it real timings (Algorithm 9.1: measurement with CUDA events, the
on-disk record, the matmul template's own candidates).

A launch configuration is a dict name -> value (``{"XBLOCK": 64, "R0_BLOCK": 128,
"num_warps": 8, "num_stages": 1}``); a configuration space (Definition 9.2) is a dict
name -> list of allowed values, and Π is the product of those lists. A cost callback
``cost(config) -> float`` measures one configuration: a running time, or ``math.inf`` for a
configuration that cannot be compiled or exceeds a resource limit.

This module consumes a space, a starting point and a cost callback, and produces a
configuration:

- ``coordinate_descent`` (Algorithm 9.2): from a start, try ×2 and ÷2 of one parameter at a
  time and move when the neighbour is faster by more than the factor (1 − ε). Prop. 9.2 bounds
  the number of moves and makes the result a local optimum.
- ``random_search`` (Prop. 9.3): the fastest of N uniform samples of Π, which lies among the
  fastest fraction q of Π with probability at least 1 − (1 − q)^N;
  ``samples_for_quantile(q, δ)`` is the N that makes that probability ≥ 1 − δ.

Both are pure functions of the callback, so tests drive them with synthetic costs
(tests/test_autotune.py). For a generated kernel (pointwise and reduction kinds) it also gives the
heuristic default (``default_config``), the candidate set C (``candidates``), the grid
(``grid_for``, Definition 9.1), the max-autotune space (``tuning_space``) and the memory-floor
estimate below which measuring does not pay (``memory_floor_ms``).

Where to look:
  - ``coordinate_descent``, ``random_search``, ``samples_for_quantile``  Alg. 9.2, Prop. 9.3
  - ``default_config``, ``candidates``, ``tuning_space``  per kernel kind and ReductionHint
  - ``grid_for``, ``fits_grid``, ``launchable``  Definition 9.1 and CUDA's grid limits
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

__all__ = [
    "AutotuneError",
    "ReductionHint",
    "TileHint",
    "SearchStats",
    "coordinate_descent",
    "random_search",
    "samples_for_quantile",
]

Config = dict[str, Any]
Space = Mapping[str, Sequence[Hashable]]
Cost = Callable[[Config], float]


class AutotuneError(RuntimeError):
    """No configuration could be chosen (every one measured was invalid)."""


@dataclass
class SearchStats:
    """What a search did; pass one as ``stats=`` to have it filled in.

    ``trajectory`` lists (configuration, cost) in the order they became the current choice:
    for coordinate descent the start and then each accepted neighbour; for random search each
    sample that was strictly faster than every sample before it. ``evaluations`` counts the
    distinct configurations whose cost was asked for (costs are memoized per configuration).
    """

    evaluations: int = 0
    trajectory: list[tuple[Config, float]] = field(default_factory=list)

    @property
    def acceptances(self) -> int:
        """Moves made: len(trajectory) - 1 (0 when nothing was recorded)."""
        return max(0, len(self.trajectory) - 1)

    @property
    def config(self) -> Config | None:
        return self.trajectory[-1][0] if self.trajectory else None

    @property
    def cost(self) -> float:
        return self.trajectory[-1][1] if self.trajectory else math.inf


# ---- §9.6 Helpers both searches share ----

def _check_space(space: Space) -> None:
    for name, values in space.items():
        values = list(values)
        if not values:
            raise ValueError(f"autotune: space[{name!r}] is empty; give at least one value")
        if len(set(values)) != len(values):
            raise ValueError(f"autotune: space[{name!r}] = {values} repeats a value; "
                             "each value must appear once (Π is a product of sets)")


class _Memo:
    """cost(config), measured once per configuration of the space."""

    def __init__(self, cost: Cost, names: Sequence[str], stats: SearchStats):
        self._cost, self._names, self._stats = cost, tuple(names), stats
        self._seen: dict[tuple, float] = {}

    def __call__(self, config: Config) -> float:
        key = tuple(config[n] for n in self._names)
        t = self._seen.get(key)
        if t is None:
            t = float(self._cost(dict(config)))
            if math.isnan(t) or t < 0:
                raise ValueError(f"autotune: cost({config}) returned {t}; a cost must be a "
                                 "time >= 0, or inf for an invalid configuration")
            self._seen[key] = t
            self._stats.evaluations += 1
        return t


def _reset(stats: SearchStats | None) -> SearchStats:
    if stats is None:
        return SearchStats()
    stats.evaluations = 0
    stats.trajectory = []
    return stats


# ---- §9.6 Algorithm 9.2: coordinate descent ----

def _scaled(value, factor: int, allowed: Mapping) -> Any:
    """value ×2 (factor=2) or ÷2 (factor=-2) when that lies in `allowed`, else None.

    `allowed` maps each allowed value to itself, so the result is the space's own element
    (an int stays an int). An odd integer has no half.
    """
    if factor == 2:
        target = value * 2
    elif isinstance(value, int):
        if value % 2:
            return None
        target = value // 2
    else:
        target = value / 2
    return allowed.get(target)


def coordinate_descent(start: Mapping[str, Any], cost: Cost, space: Space, eps: float = 1e-3,
                       *, stats: SearchStats | None = None) -> Config:
    """Algorithm 9.2: local search by ×2 / ÷2 moves of one parameter at a time.

    For each parameter in turn (the order of `space`), try the neighbour with that parameter
    doubled, then halved (only values listed in ``space[name]``), and move to it when
    ``cost(neighbour) < (1 - eps) * cost(current)``; repeat rounds until a whole round moves
    nowhere. Costs are memoized per configuration. Keys of `start` that are not in `space` are
    carried through unchanged.

    Prop. 9.2: with a deterministic cost and a finite start, at most
    ``min(|Π|, ceil(log(t(start)/t_min) / -log(1-eps)))`` moves are made, and every ×2/÷2
    neighbour c' of the result c has ``cost(c') >= (1 - eps) * cost(c)``. With measurement noise
    |η| <= η_max, every move is a real improvement when ``eps > 2 η_max / (1 + η_max)``.

    Returns the final configuration (a new dict); `stats`, if given, receives the trajectory.
    Raises AutotuneError when the start and every configuration it reached cost inf.
    """
    if not 0 < eps < 1:
        raise ValueError(f"autotune: eps must lie in (0, 1), got {eps}")
    _check_space(space)
    lookup: dict[str, dict] = {}
    for name, values in space.items():
        if name not in start:
            raise ValueError(f"autotune: start has no value for parameter {name!r}")
        if start[name] not in values:
            raise ValueError(f"autotune: start[{name!r}] = {start[name]!r} is not in "
                             f"space[{name!r}] = {list(values)}")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"autotune: coordinate descent needs numbers; space[{name!r}] "
                                f"holds {v!r}")
        lookup[name] = {v: v for v in values}

    stats = _reset(stats)
    t = _Memo(cost, list(space), stats)
    current: Config = dict(start)
    t_current = t(current)
    stats.trajectory.append((dict(current), t_current))

    improved = True
    while improved:
        improved = False
        for name in space:
            for factor in (2, -2):
                value = _scaled(current[name], factor, lookup[name])
                if value is None:
                    continue
                neighbour = {**current, name: value}
                t_neighbour = t(neighbour)
                if t_neighbour < (1 - eps) * t_current:
                    current, t_current = neighbour, t_neighbour
                    stats.trajectory.append((dict(current), t_current))
                    improved = True

    if math.isinf(t_current):
        raise AutotuneError(
            f"autotune: no valid configuration: the start {dict(start)} and all "
            f"{stats.evaluations - 1} neighbours tried cost inf (failed to compile or exceed "
            "a resource limit); start from a valid configuration")
    return current


# ---- §9.6 Proposition 9.3: random search ----

def samples_for_quantile(q: float = 0.05, delta: float = 0.05) -> int:
    """N = ceil(ln(1/delta) / q): enough uniform samples that their fastest lies among the
    fastest fraction q of the space with probability >= 1 - delta (Prop. 9.3)."""
    if not 0 < q <= 1:
        raise ValueError(f"autotune: q must lie in (0, 1], got {q}")
    if not 0 < delta < 1:
        raise ValueError(f"autotune: delta must lie in (0, 1), got {delta}")
    return max(1, math.ceil(math.log(1 / delta) / q))


def random_search(space: Space, cost: Cost, n: int, rng: random.Random,
                  *, stats: SearchStats | None = None) -> Config:
    """Prop. 9.3: the fastest of `n` configurations drawn uniformly from Π.

    Draws are independent and with replacement (each parameter's value is ``rng.choice`` of
    its list, parameters in the order of `space`), so the result depends only on `rng`'s state.
    Costs are memoized per configuration; ties go to the configuration drawn first.
    Raises AutotuneError when every sample costs inf.
    """
    if n < 1:
        raise ValueError(f"autotune: random search needs n >= 1 samples, got {n}")
    _check_space(space)
    names = list(space)
    values = {name: list(space[name]) for name in names}
    stats = _reset(stats)
    t = _Memo(cost, names, stats)

    best: Config | None = None
    t_best = math.inf
    for _ in range(n):
        config = {name: rng.choice(values[name]) for name in names}
        t_config = t(config)
        if t_config < t_best:
            best, t_best = config, t_config
            stats.trajectory.append((dict(config), t_config))

    if best is None:
        raise AutotuneError(
            f"autotune: no valid configuration: all {n} random samples ({stats.evaluations} "
            "distinct) cost inf (failed to compile or exceed a resource limit)")
    return best


# ---- §9.6 Kernel hints, block-size limits, the heuristic default ----


class ReductionHint:
    """The direction of a reduction, printed in the kernel text (`reduction_hint=ReductionHint.INNER`)."""
    INNER = "INNER"        # the reduction runs along contiguous memory
    OUTER = "OUTER"        # the reduction runs across rows (strided)
    DEFAULT = "DEFAULT"


class TileHint:
    """Printed on kernels with 2-D or 3-D tiles (`tile_hint=TileHint.DEFAULT`)."""
    DEFAULT = "DEFAULT"


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n, and 1 for n ≤ 1 (size hints, R0_BLOCK of a persistent row)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def _pow2_at_most(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(n, cap):
        p *= 2
    return p


def default_config(kind: str, numels: dict, reduction_hint=None, r0_block=None) -> Config:
    """The heuristic configuration: what a kernel runs with before (or without) measurement."""
    x = int(numels.get("xnumel", 1))
    if kind == "pointwise":
        if "znumel" in numels:
            return {"ZBLOCK": 16, "YBLOCK": 16, "XBLOCK": 16, "num_warps": 4, "num_stages": 1}
        if "ynumel" in numels:
            return {"YBLOCK": 32, "XBLOCK": 64, "num_warps": 4, "num_stages": 1}
        unroll = {"XUNROLL": 1} if numels.get("xunroll") else {}     # (triton_kernel._two_blocks)
        return {"XBLOCK": max(16, _pow2_at_most(x, 1024)), **unroll, "num_warps": 4, "num_stages": 1}
    if kind == "persistent_reduction" and reduction_hint == ReductionHint.OUTER:
        return _outer_persistent_default(x, r0_block)
    if kind == "persistent_reduction":
        # the whole row lives in registers: keep XBLOCK × R0_BLOCK around 4K elements, but first
        # give each SM a program: with few rows the kernel is latency-bound (a chain of dependent
        # row reductions, issue 13: 64 rows at XBLOCK 64 ran 20 block-wide sums on one SM)
        xblock = max(1, min(_pow2_at_most(max(x, 1), 64), 4096 // r0_block))
        while xblock > 1 and -(-x // xblock) < TARGET_PROGRAMS:
            xblock //= 2
        warps = max(1, min(32, xblock * r0_block // 256 if r0_block <= 4096 else r0_block // 1024))
        return {"XBLOCK": xblock, "num_warps": warps, "num_stages": 1}
    r = int(numels.get("r0_numel", 1))
    if reduction_hint == ReductionHint.OUTER:
        # (a one-kernel split runs `splits` programs per column block)
        if -(-x // OUTER_LOOPED[0]["XBLOCK"]) * int(numels.get("splits", 1)) < TARGET_PROGRAMS:
            # few outputs (the combine of var's pieces: 4096 columns): narrower programs, more of
            # them, and a pipelined loop (H200: 14.7 -> 6.4 us for that kernel)
            return {"XBLOCK": 32, "R0_BLOCK": 64, "num_warps": 8, "num_stages": 2}
        return dict(OUTER_LOOPED[0])
    return {"XBLOCK": 1, "R0_BLOCK": _pow2_at_most(max(r, 1), 2048), "num_warps": 8, "num_stages": 1}


TARGET_PROGRAMS = 132   # programs that fill the GPU code generation assumes (cuda.H200_PROPERTIES' SMs)
MAX_CANDIDATES = 8      # compile + measure stays well under 2 s per kernel
MAX_XBLOCK = 8192       # the largest pointwise XBLOCK and YBLOCK/ZBLOCK any configuration takes
MAX_OUTER_BLOCK = 1024  # (candidates and the max-autotune space): masks over multiples are dropped
# Tuning a kernel whose memory floor is a few microseconds buys less than compiling and timing
# its candidates costs (about 0.1 s each): below this floor the heuristic default runs.
SMALL_KERNEL_MS = 0.02
ASSUMED_BANDWIDTH = 3e12          # bytes/s of an H100/H200-class GPU, for that estimate only
_POINTER_BYTES = {"fp64": 8, "i64": 8, "fp32": 4, "i32": 4, "fp16": 2, "bf16": 2, "i16": 2, "i8": 1,
                  "u8": 1, "i1": 1}
GRID_LIMIT = (2 ** 31 - 1, 65535, 65535)     # CUDA's grid extents along x, y, z

# ---- §9.6 Algorithm 9.1's inputs: grids, whether to measure, spaces and candidates ----


def grid_for(kind: str, numels: dict, cfg: Config) -> tuple:
    """Definition 9.1: ⌈numel / BLOCK⌉ programs along each axis (x on program_id(0))."""
    def cdiv(a, b):
        return -(-int(a) // b)
    grid = tuple(cdiv(numels[f"{p}numel"], cfg[f"{p.upper()}BLOCK"] * (cfg.get("XUNROLL", 1) if p == "x" else 1))
                 if f"{p}numel" in numels else 1 for p in "xyz")
    if "fold_y" in numels:      # symbolic y/z (triton_kernel's fold_y): the (z, y) blocks, 65535 a row
        fold, zy = int(numels["fold_y"]), grid[1] * grid[2]
        grid = (grid[0], min(zy, fold), cdiv(zy, fold))
    # §6.5 a one-kernel split (triton_outer.one_kernel_split): its pieces of the rows along y
    return (grid[0], int(numels["splits"]), grid[2]) if "splits" in numels else grid


def fits_grid(grid: tuple) -> bool:
    return all(g <= lim for g, lim in zip(grid, GRID_LIMIT))


def memory_floor_ms(numels: dict, signature: dict) -> float:
    """An upper estimate of a kernel's memory floor: every pointer of `signature` touched once per
    element, at ASSUMED_BANDWIDTH. Below SMALL_KERNEL_MS the heuristic default runs unmeasured."""
    elements = 1
    for name, v in numels.items():
        if name != "fold_y":        # (a grid limit, not a size)
            elements *= max(1, int(v))
    nbytes = sum(_POINTER_BYTES.get(t[1:], 4) for t in signature.values() if t.startswith("*"))
    return elements * nbytes / ASSUMED_BANDWIDTH * 1e3


def autotune_enabled(options: dict) -> bool:
    """Measurement is on unless STAX_AUTOTUNE=0 or options={"autotune": False} (then the
    heuristic default runs: what the chapter calls the candidate set's first member)."""
    import os
    return options.get("autotune", os.environ.get("STAX_AUTOTUNE", "1") != "0")


def tuning_space(kind: str, start: Config, numels: dict, reduction_hint=None) -> dict:
    """Definition 9.2's Π for mode="max-autotune": powers of two around the kernel's sizes."""
    def pow2(lo, hi):
        out, v = [], lo
        while v <= hi:
            out.append(v)
            v *= 2
        return out
    x = max(1, int(numels.get("xnumel", 1)))
    space = {"num_warps": [1, 2, 4, 8, 16, 32], "num_stages": [1, 2, 3]}
    if kind == "persistent_reduction" and reduction_hint == ReductionHint.OUTER:
        space["XBLOCK"] = pow2(1, max(1, _pow2_at_most(x, 1024)))     # columns: a wide XBLOCK
    elif kind == "persistent_reduction":
        space["XBLOCK"] = pow2(1, max(1, min(64, _pow2_at_most(x, 64))))
    else:
        space["XBLOCK"] = pow2(1, max(1, _pow2_at_most(x, MAX_XBLOCK if kind == "pointwise" else 1024)))
    for axis in "YZ":
        if f"{axis}BLOCK" in start:
            space[f"{axis}BLOCK"] = pow2(1, max(1, _pow2_at_most(int(numels.get(f"{axis.lower()}numel", 1)),
                                                                MAX_OUTER_BLOCK)))
    if "XUNROLL" in start:
        space["XUNROLL"] = [1, 2]
    if "R0_BLOCK" in start:
        space["R0_BLOCK"] = pow2(1, max(1, _pow2_at_most(int(numels.get("r0_numel", 1)), 16384)))
    for name, value in start.items():            # the start must lie in the space
        if value not in space.get(name, [value]):
            space[name] = sorted(set(space[name]) | {value})
    return space


def candidates(kind: str, numels: dict, reduction_hint=None, r0_block=None) -> list:
    """§9.6: a small candidate set C from the kernel's form, its sizes and reduction direction.

    The heuristic default comes first (it is what runs when there is nothing to measure, e.g. in
    Triton's interpreter); the others vary the block sizes and warps around it.
    """
    x = max(1, int(numels.get("xnumel", 1)))
    base = default_config(kind, numels, reduction_hint, r0_block)
    out = [base]
    if kind == "pointwise" and "znumel" in numels:
        for zb, yb, xb, w in ((8, 16, 32, 4), (16, 16, 32, 8), (32, 8, 16, 4), (8, 32, 16, 4),
                              (32, 32, 4, 4), (4, 32, 32, 4), (16, 16, 16, 8)):
            out.append({"ZBLOCK": zb, "YBLOCK": yb, "XBLOCK": xb, "num_warps": w, "num_stages": 1})
    elif kind == "pointwise" and "ynumel" in numels:
        for yb, xb, w in ((64, 64, 8), (64, 64, 16), (32, 32, 4), (16, 128, 4), (64, 128, 8), (128, 64, 8)):
            out.append({"YBLOCK": yb, "XBLOCK": xb, "num_warps": w, "num_stages": 1})
    elif kind == "pointwise":
        # (4096, 4) and (8192, 8): 32 elements a thread, for a kernel whose math (erf and exp:
        # the exact GELU) is as long as its memory time, so more loads are in flight per thread
        unroll = {"XUNROLL": 1} if numels.get("xunroll") else {}
        # two blocks a program, both loads first (triton_kernel._two_blocks): the exact GELU's
        # best form on the H200 in a standalone probe, 0.98 of a copy's speed against 0.95.
        # Listed right after the default, so the cap of MAX_CANDIDATES drops plain forms instead
        for xb, w in ((1024, 4), (512, 4), (2048, 8)) if unroll else ():
            if 2 * xb <= max(16, _pow2_at_most(x, 4096)):
                out.append({"XBLOCK": xb, "XUNROLL": 2, "num_warps": w, "num_stages": 1})
        for xb, w in ((512, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16), (4096, 4), (8192, 8)):
            if xb <= max(16, _pow2_at_most(x, 8192 if xb > 4096 else 4096)):
                out.append({"XBLOCK": xb, **unroll, "num_warps": w, "num_stages": 1})
    elif kind == "persistent_reduction" and reduction_hint == ReductionHint.OUTER:
        out += _outer_persistent_candidates(x, r0_block)
    elif kind == "persistent_reduction":
        # rows in registers: the two smallest warp counts per XBLOCK that keep at most 32 elements
        # per thread (128 for one very long row: 8, 16 and 32 warps all stay in registers on a
        # 32768-wide softmax, ANCHORS.md)
        for xb in (1, 2, 4, 8, 16, 32):
            if xb <= _pow2_at_most(x, 64) and (xb * r0_block <= 8192 or xb == 1):
                limit = 32 if xb * r0_block <= 8192 else 128
                warps = [w for w in (4, 8, 16, 32) if xb * r0_block // (32 * w) <= limit][:2]
                out += [{"XBLOCK": xb, "num_warps": w, "num_stages": 1} for w in warps]
    elif reduction_hint == ReductionHint.OUTER:
        out += [dict(c) for c in OUTER_LOOPED[1:]]
    else:
        r = max(1, int(numels.get("r0_numel", 1)))
        # (16384, 32) and (32768, 32): one program of 32 warps an SM, so fewer rows are in flight
        # and the second pass finds its row in L2; a 65536-long online softmax row at 0.80 of the
        # floor with (16384, 32) against 0.68 with (8192, 16) on the H200, and with the online
        # sum per row (triton_reduction._online_phase) 32768-element steps fit in registers
        for xb, rb, w in ((1, 1024, 4), (1, 4096, 8), (1, 4096, 16), (2, 2048, 8), (1, 8192, 16),
                          (1, 16384, 32), (1, 32768, 32)):
            if rb <= max(16, _pow2_at_most(r, 8192 if rb <= 8192 else 65536)):
                out.append({"XBLOCK": xb, "R0_BLOCK": rb, "num_warps": w, "num_stages": 1})
    return launchable(out, lambda c: grid_for(kind, numels, c))


# §9.4 OUTER (triton_outer.py): blocks are [R0_BLOCK, XBLOCK] with XBLOCK along the contiguous
# outputs. A warp reads a row segment of XBLOCK elements; R0_BLOCK rows a step are in flight.
OUTER_LOOPED = [{"XBLOCK": xb, "R0_BLOCK": rb, "num_warps": w, "num_stages": 1}
                for xb, rb, w in ((64, 32, 4), (128, 16, 4), (32, 64, 4), (64, 64, 8), (128, 32, 8),
                                  (256, 16, 8), (64, 16, 4), (128, 64, 8))]


def _outer_persistent_default(x: int, r0_block: int) -> Config:
    """All R0_BLOCK ≤ 64 rows in registers: XBLOCK columns so a program holds about 4K elements."""
    xblock = max(1, min(_pow2_at_most(max(x, 1), 1024), max(32, 4096 // r0_block), 256))
    # 4 warps, not 8, for a 64×64 block (H200, var0's pieces: 36.9 against 89.9 us; 128×64: 36.0
    # against 87.7); the candidates keep 8
    return {"XBLOCK": xblock, "num_warps": max(1, min(4, xblock * r0_block // 1024)), "num_stages": 1}


def _outer_persistent_candidates(x: int, r0_block: int) -> list:
    out = []
    for xb in (32, 64, 128, 256, 512):
        if xb <= max(1, _pow2_at_most(x, 1024)) and xb * r0_block <= 16384:
            out += [{"XBLOCK": xb, "num_warps": w, "num_stages": 1} for w in (4, 8)]
    return out


def launchable(configs: list, grid, limit: int = MAX_CANDIDATES) -> list:
    """The first configuration (the default) and, after it, each other whose grid CUDA can launch
    (`grid(config)`), without repeats, at most `limit` (MAX_CANDIDATES)."""
    unique = []
    for c in configs:
        if c not in unique and (not unique or fits_grid(grid(c))):
            unique.append(c)
    return unique[:limit]
