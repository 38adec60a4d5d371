"""Choosing a kernel's launch configuration (chapter §9.6).

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
(tests/test_autotune.py). The GPU side (Algorithm 9.1: candidate sets, measurement with CUDA
events, the on-disk record) feeds them real timings; see the marked section at the end.
Nothing here imports triton or touches a GPU.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence

__all__ = [
    "AutotuneError",
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


# ---- shared helpers ----

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


# ---- §9.6 Algorithm 9.1: measured choice among candidates (GPU; not yet written) ----
#
# To come here, beside the search functions above (see issue 4):
#   - candidate sets from a kernel's form (pointwise 1-D/2-D/3-D, looped / persistent / split
#     reduction), its size_hints and reduction direction, and the decorators the kernel text
#     calls as `triton_heuristics.pointwise / .reduction / .persistent_reduction`;
#   - Algorithm 9.1: the record keyed by (kernel source hash, candidate list, GPU name and
#     compute capability, Triton version) looked up first; a single candidate returned
#     unmeasured; compile each candidate, cost inf on a compile failure or register spill
#     (local memory size of the loaded kernel); time the rest with CUDA events after a
#     warm-up, median of repeats; outputs and in-place buffers protected while candidates run;
#   - the record written atomically under STAX_CACHE_DIR and kept in memory;
#   - STAX_LOGS=autotune output (candidates, times, choice) and a progress line;
#   - mode="max-autotune": coordinate_descent from the best candidate, or
#     options={"autotune_search": "random"}: random_search with samples_for_quantile(q, delta).
