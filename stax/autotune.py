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
    "ReductionHint",
    "TileHint",
    "triton_heuristics",
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


# ---- §9.6 The decorators the kernel text calls: triton_heuristics ----
#
# A generated kernel reads
#     @triton_heuristics.persistent_reduction(size_hints={'x': 64, 'r0_': 128}, ...)
#     @triton.jit
#     def triton_per_fused_0(in_ptr0, in_ptr1, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
# The decorator wraps the @triton.jit function in a `TritonKernel`, whose `.run(*args, stream=)`
# picks the launch configuration (the block sizes, num_warps, num_stages), computes the grid from
# it (Definition 9.1: ⌈xnumel / XBLOCK⌉ programs along x), compiles once per configuration, and
# launches. Under TRITON_INTERPRET=1 the same call runs in Triton's interpreter on host memory.


class ReductionHint:
    INNER = "INNER"        # the reduction runs along contiguous memory
    OUTER = "OUTER"        # the reduction runs across rows (strided)
    DEFAULT = "DEFAULT"


class TileHint:
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
    if kind == "template":
        from .templates import template_configs
        return template_configs(numels)[0]
    if kind == "pointwise":
        if "znumel" in numels:
            return {"ZBLOCK": 16, "YBLOCK": 16, "XBLOCK": 16, "num_warps": 4, "num_stages": 1}
        if "ynumel" in numels:
            return {"YBLOCK": 32, "XBLOCK": 64, "num_warps": 4, "num_stages": 1}
        return {"XBLOCK": max(16, _pow2_at_most(x, 1024)), "num_warps": 4, "num_stages": 1}
    if kind == "persistent_reduction":
        # the whole row lives in registers: keep XBLOCK × R0_BLOCK around 4K elements
        xblock = max(1, min(_pow2_at_most(max(x, 1), 64), 4096 // r0_block))
        warps = max(1, min(32, xblock * r0_block // 256 if r0_block <= 4096 else r0_block // 1024))
        return {"XBLOCK": xblock, "num_warps": warps, "num_stages": 1}
    r = int(numels.get("r0_numel", 1))
    if reduction_hint == ReductionHint.OUTER:
        return {"XBLOCK": 64, "R0_BLOCK": 8, "num_warps": 4, "num_stages": 1}
    return {"XBLOCK": 1, "R0_BLOCK": _pow2_at_most(max(r, 1), 2048), "num_warps": 8, "num_stages": 1}


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


def grid_for(kind: str, numels: dict, cfg: Config) -> tuple:
    """Definition 9.1: ⌈numel / BLOCK⌉ programs along each axis (x on program_id(0))."""
    def cdiv(a, b):
        return -(-int(a) // b)
    if kind == "template":
        from .templates import template_grid
        return template_grid(numels, cfg)
    return tuple(cdiv(numels[f"{p}numel"], cfg[f"{p.upper()}BLOCK"]) if f"{p}numel" in numels else 1
                 for p in "xyz")


def fits_grid(grid: tuple) -> bool:
    return all(g <= lim for g, lim in zip(grid, GRID_LIMIT))


def autotune_enabled(options: dict) -> bool:
    """Measurement is on unless STAX_AUTOTUNE=0 or options={"autotune": False} (then the
    heuristic default runs: what the chapter calls the candidate set's first member)."""
    import os
    return options.get("autotune", os.environ.get("STAX_AUTOTUNE", "1") != "0")


def tuning_space(kind: str, start: Config, numels: dict) -> dict:
    """Definition 9.2's Π for mode="max-autotune": powers of two around the kernel's sizes."""
    def pow2(lo, hi):
        out, v = [], lo
        while v <= hi:
            out.append(v)
            v *= 2
        return out
    if kind == "template":
        from .templates import template_tuning_space
        return template_tuning_space(start)
    x = max(1, int(numels.get("xnumel", 1)))
    space = {"num_warps": [1, 2, 4, 8, 16, 32], "num_stages": [1, 2, 3]}
    if kind == "persistent_reduction":
        space["XBLOCK"] = pow2(1, max(1, min(64, _pow2_at_most(x, 64))))
    else:
        space["XBLOCK"] = pow2(1, max(1, _pow2_at_most(x, MAX_XBLOCK if kind == "pointwise" else 1024)))
    for axis in "YZ":
        if f"{axis}BLOCK" in start:
            space[f"{axis}BLOCK"] = pow2(1, max(1, _pow2_at_most(int(numels.get(f"{axis.lower()}numel", 1)),
                                                                MAX_OUTER_BLOCK)))
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
    if kind == "template":
        from .templates import template_configs
        out = template_configs(numels)
    elif kind == "pointwise" and "znumel" in numels:
        for zb, yb, xb, w in ((8, 16, 32, 4), (16, 16, 32, 8), (32, 8, 16, 4), (8, 32, 16, 4),
                              (32, 32, 4, 4), (4, 32, 32, 4), (16, 16, 16, 8)):
            out.append({"ZBLOCK": zb, "YBLOCK": yb, "XBLOCK": xb, "num_warps": w, "num_stages": 1})
    elif kind == "pointwise" and "ynumel" in numels:
        for yb, xb, w in ((64, 64, 8), (64, 64, 16), (32, 32, 4), (16, 128, 4), (64, 128, 8), (128, 64, 8)):
            out.append({"YBLOCK": yb, "XBLOCK": xb, "num_warps": w, "num_stages": 1})
    elif kind == "pointwise":
        for xb, w in ((512, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16)):
            if xb <= max(16, _pow2_at_most(x, 4096)):
                out.append({"XBLOCK": xb, "num_warps": w, "num_stages": 1})
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
        for xb, rb, w in ((64, 4, 8), (32, 16, 4), (8, 128, 4), (128, 8, 8)):
            out.append({"XBLOCK": xb, "R0_BLOCK": rb, "num_warps": w, "num_stages": 1})
    else:
        r = max(1, int(numels.get("r0_numel", 1)))
        for xb, rb, w in ((1, 1024, 4), (1, 4096, 8), (1, 4096, 16), (2, 2048, 8), (1, 8192, 16)):
            if rb <= max(16, _pow2_at_most(r, 8192)):
                out.append({"XBLOCK": xb, "R0_BLOCK": rb, "num_warps": w, "num_stages": 1})
    unique = []
    for c in out:
        if c not in unique and (not unique or fits_grid(grid_for(kind, numels, c))):
            unique.append(c)
    return unique[:MAX_CANDIDATES]


def _interp_arg(a):
    """What Triton's interpreter needs of a pointer argument: a torch-like view of host memory."""
    if hasattr(a, "_storage"):
        return _InterpTensor(a._storage.data.host_array, a._meta.offset, a.dtype.name)
    return a


class _InterpStorage:
    def __init__(self, array):
        self.array = array

    def data_ptr(self):
        return self.array.ctypes.data

    def cpu(self):
        return self               # already host memory: the interpreter writes it in place

    def copy_(self, other):
        if other is not self:
            self.array[...] = other.array


class _InterpDtype:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


# One dtype object per name, for the life of the process: Triton's argument specialization may
# remember a dtype object by identity, so a fresh object per call could be mistaken for an earlier,
# freed one of another dtype (a float32 buffer read as float16).
_INTERP_DTYPES: dict = {}


class _InterpTensor:
    """The adapter: data_ptr, dtype, untyped_storage(), new_empty, set_, size, stride (DESIGN.md)."""

    def __init__(self, array, offset, dtype_name):
        dtype = _INTERP_DTYPES.get(dtype_name)
        if dtype is None:
            dtype = _INTERP_DTYPES[dtype_name] = _InterpDtype(dtype_name)
        self.array, self.offset, self.dtype = array, offset, dtype

    def data_ptr(self):
        return self.array.ctypes.data + self.offset * self.array.itemsize

    def untyped_storage(self):
        return _InterpStorage(self.array)

    def new_empty(self, *args, **kwargs):
        return _InterpTensor(self.array, self.offset, self.dtype.name)

    def set_(self, storage, offset, size, stride):
        self.array, self.offset = storage.array, offset
        return self

    def storage_offset(self):
        return self.offset

    def size(self):
        return (self.array.size,)

    def stride(self):
        return (1,)


def _fix_interpreter_bf16_dot():
    """Triton 3.6's interpreter multiplies bfloat16 blocks as their raw 16-bit words (it stores
    bfloat16 as uint16 and hands those to np.matmul). Widen them to float32 first, as the tensor
    cores do; the accumulator is float32 either way. Done once, only under TRITON_INTERPRET=1."""
    import numpy as np
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_stax_bf16", False):
        return
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if str(h.dtype.scalar) == "bf16":
                words = h.data.astype(np.uint32) << 16
                return interpreter.TensorHandle(words.view(np.float32), interpreter.tl.float32)
            return h
        return plain(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)
    create_dot._stax_bf16 = True
    builder.create_dot = create_dot


_RECORDS: dict = {}      # Algorithm 9.1's records, in memory (also on disk under the cache dir)


def _show_autotune() -> bool:
    import os
    return "autotune" in os.environ.get("STAX_LOGS", "").split(",") or "all" in os.environ.get("STAX_LOGS", "")


def _triton_version() -> str:
    """Triton's version without importing triton (a warm cache never imports it)."""
    from importlib.metadata import version
    return version("triton")


def _exec_kernel_source(name: str, source: str):
    """The @triton.jit function of one kernel: its text is written to a file and imported
    (Triton reads a kernel's source from its file). Only needed to compile or interpret."""
    import importlib.util
    from . import cache
    from .codegen_triton import HEADER
    path = cache.cache_dir() / "kernels" / f"{name}_{cache.content_hash(source)}.py"
    if not path.exists():
        cache.atomic_write(path, HEADER + "\n\n" + source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    obj = getattr(mod, name)
    return obj.fn if isinstance(obj, TritonKernel) else obj


class TritonKernel:
    """A generated kernel plus how to launch it: what `@triton_heuristics.<kind>(...)` and
    `async_compile.triton(name, source)` return.

    `run(*args)` picks the launch configuration (Algorithm 9.1 on first use), compiles it once (the
    cubin is cached on disk by content), and launches through stax.cuda's Launcher, whose argument
    array is built once. With the cubin and the choice already on disk, triton is never imported.
    """

    def __init__(self, name, kind, size_hints, signature, reduction_hint=None, tile_hint=None,
                 fn=None, source=None):
        self.name, self.kind, self.size_hints = name, kind, size_hints
        self.signature, self.reduction_hint = signature, reduction_hint
        self._fn, self._source = fn, source
        self.numel_names = [n for n in signature if n.endswith("numel")]
        self.pointer_index = [i for i, t in enumerate(signature.values()) if t.startswith("*")]
        self.r0_block = size_hints.get("r0_") if kind == "persistent_reduction" else None
        self.launchers: dict = {}
        self.config = None
        self._fast = None            # (numels, grid, launcher) of the last launch
        self.mode, self.options = None, {}   # set by stax.compile(mode=..., options=...)
        self.tuning_seconds = 0.0
        self.best_ms = None          # the chosen configuration's measured time, when measured

    @property
    def fn(self):
        if self._fn is None:
            self._fn = _exec_kernel_source(self.name, self._source)
        return self._fn

    @property
    def source(self) -> str:
        return self._source if self._source is not None else self.fn.src

    def grid(self, numels: dict, cfg: Config) -> tuple:
        """Definition 9.1: ⌈numel / BLOCK⌉ programs along each axis (x on program_id(0))."""
        return grid_for(self.kind, numels, cfg)

    def choose_config(self, numels: dict, args=()) -> Config:
        if self.config is None:
            from . import cuda
            if cuda.interpreting():
                self.config = default_config(self.kind, numels, self.reduction_hint, self.r0_block)
            else:
                self.config = self._autotune(numels, args)
        return self.config

    def run(self, *args, stream=None):
        """Launch on the current stream; the fast path is one list of pointers and one driver call."""
        ptrs = [a if a.__class__ is int else a.data_ptr() for a in args]
        fast = self._fast
        if fast is not None and fast[0] == args[fast[3]:]:
            low_bits = 0
            for i in self.pointer_index:
                low_bits |= ptrs[i]
            if not low_bits & 15:
                fast[2].launch_ints(fast[1], ptrs)
                return
        self._slow_run(args, ptrs)

    def _slow_run(self, args, ptrs):
        n = len(self.numel_names)
        numels = dict(zip(self.numel_names, args[len(args) - n:]))
        cfg = self.choose_config(numels, args)
        grid = self.grid(numels, cfg)
        if 0 in grid:
            return
        from . import cuda
        if cuda.interpreting():
            if self.kind == "template":
                _fix_interpreter_bf16_dot()
            constexprs = {k: v for k, v in cfg.items() if k.isupper()}
            self.fn[grid](*[_interp_arg(a) for a in args], **constexprs)
            for name, a in zip(self.signature, args):      # no write outside any buffer
                if hasattr(a, "_storage") and not a._storage.data.guards_intact():
                    raise RuntimeError(f"{self.name} wrote outside {name} (a bug in the generated "
                                       f"kernel):\n{self.source}")
            return
        aligned = not any(ptrs[i] & 15 for i in self.pointer_index)
        launcher = self._launcher(cfg, aligned)
        launcher(grid, ptrs)
        if aligned:     # the next launch with these sizes skips straight to the driver call
            self._fast = (args[len(args) - n:], grid, launcher, len(args) - n)

    def _launcher(self, cfg: Config, aligned: bool = True):
        key = (tuple(sorted(cfg.items())), aligned)
        if key not in self.launchers:
            self.launchers[key] = self._compile(cfg, aligned)
        return self.launchers[key]

    # -- Algorithm 9.1 --
    def _autotune(self, numels: dict, args) -> Config:
        """Algorithm 9.1: the recorded choice, else the only candidate, else measure them all."""
        import json
        import sys
        from . import cache, cuda
        cands = candidates(self.kind, numels, self.reduction_hint, self.r0_block)
        search = self.options.get("autotune_search", "coordinate") if self.mode == "max-autotune" else None
        small = len(cands) == 1 or self._floor_ms(numels) < SMALL_KERNEL_MS
        if (small and search is None) or not autotune_enabled(self.options):
            return cands[0]
        props = cuda.get_device_properties()
        key = cache.content_hash(self.source, repr(cands), props.name, repr(props.cc), _triton_version(),
                                 repr(search), repr(sorted(self.options.items())))
        path = cache.cache_dir() / "autotune" / f"{self.name}_{key}.json"
        if key not in _RECORDS and path.exists():
            record = json.loads(path.read_text())
            _RECORDS[key] = (record["config"], record["ms"])
        if key in _RECORDS:
            chosen, self.best_ms = _RECORDS[key]
            return chosen
        import time
        start = time.perf_counter()
        saved = self._protect(args)
        times = []
        for i, cfg in enumerate(cands):
            if _show_autotune():
                print(f"\rstax autotune {self.name}: candidate {i + 1}/{len(cands)}", end="",
                      file=sys.stderr, flush=True)
            times.append(self._measure(cfg, numels, args))
        best = min(range(len(cands)), key=lambda i: times[i])
        if times[best] == math.inf:
            self._restore(saved)
            raise AutotuneError(f"{self.name}: every launch configuration failed to compile or spilled")
        chosen, chosen_ms = cands[best], times[best]
        if search is not None:
            chosen, chosen_ms = self._search(search, chosen, numels, args)
        self._restore(saved)
        self.tuning_seconds = time.perf_counter() - start
        _RECORDS[key] = (chosen, chosen_ms)
        self.best_ms = chosen_ms
        cache.atomic_write(path, json.dumps({"config": chosen, "ms": chosen_ms, "candidates": cands,
                                             "candidate_ms": times, "search": search,
                                             "seconds": self.tuning_seconds}))
        if _show_autotune():
            print("", file=sys.stderr)
            for cfg, t in zip(cands, times):
                mark = "  <- best candidate" if cfg is cands[best] else ""
                print(f"  {cfg}: {t:.4f} ms{mark}", file=sys.stderr)
            if search is not None:
                print(f"  {search} search from the best candidate: {chosen}: {chosen_ms:.4f} ms",
                      file=sys.stderr)
            print(f"  chosen in {self.tuning_seconds:.2f} s", file=sys.stderr)
        return chosen

    def _floor_ms(self, numels: dict) -> float:
        """An upper estimate of the kernel's memory floor: every pointer touched once per element."""
        if self.kind == "template":
            return math.inf                    # compute-bound: always worth measuring
        elements = 1
        for v in numels.values():
            elements *= max(1, int(v))
        nbytes = sum(_POINTER_BYTES.get(t[1:], 4) for t in self.signature.values() if t.startswith("*"))
        return elements * nbytes / ASSUMED_BANDWIDTH * 1e3

    def _search(self, search: str, start: Config, numels: dict, args) -> tuple:
        """mode="max-autotune": Algorithm 9.2 from the best candidate, or random search (Prop. 9.3)."""
        space = tuning_space(self.kind, start, numels)
        cost = lambda cfg: self._measure(cfg, numels, args)   # noqa: E731
        if search == "random":
            q, delta = self.options.get("autotune_q", 0.05), self.options.get("autotune_delta", 0.05)
            found = random_search(space, cost, samples_for_quantile(q, delta), random.Random(0))
            if cost(found) >= cost(start):
                found = start
        else:
            found = coordinate_descent(start, cost, space, eps=self.options.get("autotune_eps", 1e-3))
        return found, cost(found)

    def _measure(self, cfg: Config, numels: dict, args) -> float:
        """Median time of one launch in ms (CUDA events, after a warm-up); inf if it cannot run."""
        from . import cuda
        grid = self.grid(numels, cfg)
        if not fits_grid(grid):
            return math.inf                    # more programs along y or z than CUDA launches
        ptrs = [a if isinstance(a, int) else a.data_ptr() for a in args]
        try:
            launcher = self._launcher(cfg, not any(ptrs[i] & 15 for i in self.pointer_index))
        except Exception:                      # a candidate that does not compile costs inf
            return math.inf
        if launcher.kernel.local_size_bytes > 0:
            return math.inf                    # spills registers to local memory
        launcher(grid, ptrs)
        e0, e1 = cuda.Event(), cuda.Event()
        e0.record()
        launcher(grid, ptrs)
        e1.record()
        e1.synchronize()
        reps = max(1, min(100, int(1.0 / max(e0.elapsed_time(e1), 1e-3))))
        samples = []
        for _ in range(5):
            e0.record()
            for _ in range(reps):
                launcher(grid, ptrs)
            e1.record()
            e1.synchronize()
            samples.append(e0.elapsed_time(e1) / reps)
        return sorted(samples)[len(samples) // 2]

    def _protect(self, args) -> list:
        """Copies of the buffers this kernel updates in place, so tuning never changes a result."""
        from . import cuda
        saved = []
        for name, a in zip(self.signature, args):
            if name.startswith("in_out_ptr"):
                nbytes = a._storage.data.count * a._storage.data.dtype.itemsize
                copy = cuda.allocate(max(1, nbytes))
                cuda.copy_device_to_device(copy, a._storage.data.buffer, nbytes)
                saved.append((a, copy, nbytes))
        return saved

    def _restore(self, saved):
        from . import cuda
        for a, copy, nbytes in saved:
            cuda.copy_device_to_device(a._storage.data.buffer, copy, nbytes)

    def compile_for(self, cc: int = 90, cfg: Config | None = None):
        """Compile for sm_{cc} without a GPU (CI checks every generated kernel this way)."""
        from . import cuda_triton
        numels = {f"{p}numel": n for p, n in self.size_hints.items()}
        cfg = cfg or default_config(self.kind, numels, self.reduction_hint, self.r0_block)
        constexprs = {k: v for k, v in cfg.items() if k.isupper()}
        return cuda_triton.compile_triton(self.fn, dict(self.signature), constexprs, num_warps=cfg["num_warps"],
                                   num_stages=cfg["num_stages"], cc=cc, attrs=self._attrs(True))

    def _attrs(self, aligned: bool) -> dict:
        """Pointer arguments known to be 16-byte aligned let Triton vectorize loads and stores."""
        return {(i,): [["tt.divisibility", 16]] for i in self.pointer_index} if aligned else {}

    def _compile(self, cfg: Config, aligned: bool):
        """Compile for this GPU once per configuration; cubins are cached on disk by content."""
        import pickle
        from . import cache, cuda, cuda_triton
        props = cuda.get_device_properties()
        cc = props.cc[0] * 10 + props.cc[1]
        constexprs = {k: v for k, v in cfg.items() if k.isupper()}
        key = cache.content_hash(self.source, repr(sorted(cfg.items())), repr(self.signature),
                                 _triton_version(), str(cc), str(aligned))
        path = cache.cache_dir() / "cubin" / f"{self.name}_{key}.pkl"
        if path.exists():
            cubin, info = pickle.loads(path.read_bytes())
        else:
            cubin, info, _ = cuda_triton.compile_triton(self.fn, dict(self.signature), constexprs,
                                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                                 cc=cc, attrs=self._attrs(aligned))
            cache.atomic_write(path, pickle.dumps((cubin, info)))
        return cuda_triton.launcher_for_triton(cubin, info, list(self.signature.values()))


class MultiKernel:
    """Alternative kernels for one fusion group: a multi-pass row's persistent and looped forms
    (§9.4). The first launch runs Algorithm 9.1 for each and keeps the one whose best configuration
    is faster; the choice follows from the records, so a later process measures nothing. Without
    measurements (the interpreter, autotuning off, a kernel of microseconds) the first runs."""

    def __init__(self, name: str, kernels: list):
        self.name, self.kernels = name, kernels
        self.chosen = None

    def run(self, *args, stream=None):
        kernel = self.chosen
        if kernel is None:
            kernel = self.chosen = self._choose(args)
        kernel.run(*args, stream=stream)

    def _choose(self, args) -> TritonKernel:
        import sys
        from . import cuda
        if cuda.interpreting():
            return self.kernels[0]
        first = self.kernels[0]
        numels = dict(zip(first.numel_names, args[len(args) - len(first.numel_names):]))
        for k in self.kernels:
            k.choose_config(numels, args)
        times = [k.best_ms for k in self.kernels]
        if any(t is None for t in times):
            return first
        best = min(range(len(times)), key=lambda i: times[i])
        if _show_autotune():
            print(f"stax autotune {self.name}: " + ", ".join(
                f"{k.name} {t:.4f} ms" for k, t in zip(self.kernels, times))
                + f" -> {self.kernels[best].name}", file=sys.stderr)
        return self.kernels[best]


def kernel_from_source(name: str, source: str) -> TritonKernel:
    """A TritonKernel from generated text, without importing triton: the decorator's arguments
    (kind, size_hints, reduction_hint, signature) are read from the text itself."""
    import ast
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    deco = next(d for d in fn.decorator_list if isinstance(d, ast.Call)
                and isinstance(d.func, ast.Attribute) and getattr(d.func.value, "id", "") == "triton_heuristics")
    kw = {}
    for k in deco.keywords:
        kw[k.arg] = k.value.attr if isinstance(k.value, ast.Attribute) else ast.literal_eval(k.value)
    return TritonKernel(name, deco.func.attr, kw.get("size_hints", {}), kw.get("signature", {}),
                        kw.get("reduction_hint"), kw.get("tile_hint"), source=source)


def _decorator(kind):
    def make(size_hints, reduction_hint=None, tile_hint=None, signature=None, **_):
        return lambda fn: TritonKernel(fn.__name__, kind, size_hints, signature or {}, reduction_hint,
                                       tile_hint, fn=fn)
    return make


class triton_heuristics:  # noqa: N801  (the name the kernel text uses, as in the chapter's listings)
    pointwise = staticmethod(_decorator("pointwise"))
    reduction = staticmethod(_decorator("reduction"))
    persistent_reduction = staticmethod(_decorator("persistent_reduction"))
    template = staticmethod(_decorator("template"))
