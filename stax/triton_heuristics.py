"""§9.6–9.7 The launch-time side of a Triton kernel: what the kernel text's decorators return.

Layer: back end (GPU runtime), Inductor's `triton_heuristics`. Imports the §9.6 search and the
configurations of generated kernels (`autotune`), the §9.8 template's configurations
(`template_tuning`, imported for a template only), the cache (`cache`) and the driver (`cuda`, `cuda_triton`). runtime.py's
`async_compile` hands each kernel's text to `kernel_from_source`. Importing it imports neither
triton nor the driver: a warm start (cubins and choices on disk) never imports triton.

A generated kernel reads
    @triton_heuristics.persistent_reduction(size_hints={'x': 64, 'r0_': 128}, ...)
    @triton.jit
    def triton_per_fused_0(in_ptr0, in_ptr1, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
The decorator wraps the @triton.jit function in a `CachingAutotuner`, whose `.run(*args, stream=)`
picks the launch configuration (the block sizes, num_warps, num_stages: Algorithm 9.1 on first use),
computes the grid from it (Definition 9.1: ⌈xnumel / XBLOCK⌉ programs along x), compiles once per
configuration (the cubin cached on disk by content), and launches through cuda_triton's Launcher.
Under TRITON_INTERPRET=1 the same call runs in Triton's interpreter on host memory.

Consumes: a kernel's text (its decorator's arguments are read without importing triton), the
kernel's arguments at launch, `mode`/`options` of `stax.compile`. Produces: launches; the records of
Algorithm 9.1 under `<cache>/autotune`, cubins under `<cache>/cubin` (JSON metadata + the cubin's
bytes, never pickle), each sealed with its sha256 and checked when read back (cache.read_sealed).

Where to look:
  - `HEADER` ............................. the imports a kernel file opens with
  - `candidates`, `default_config`, `grid_for`, `tuning_space`  any kernel kind, templates included
  - `CachingAutotuner.run` ............... the launch hot path; `_slow_run` the first launch
  - `CachingAutotuner._autotune` ......... Algorithm 9.1 (records, candidates, CUDA-event timing)
  - `CachingAutotuner._compile` .......... the cubin cache (`_save_cubin`, `_load_cubin`; records:
    `_load_choice`); `_exec_kernel_source` runs a kernel's checked text (cache.exec_source)
  - `MultiKernel` ........................ §9.4 a multi-pass row's two forms, measured at first launch
  - `_InterpTensor` ...................... the adapter Triton's interpreter sees for a "cuda" tensor
  - `_fix_interpreter_bf16` .............. the interpreter's bfloat16 dot and casts, made as on the GPU
  - `kernel_from_source`, `pointwise` / `reduction` / `persistent_reduction` / `template`
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import random
import re
import sys
import time

from . import cache, cuda, cuda_triton
from . import autotune
from .autotune import (AutotuneError, Config, ReductionHint, TileHint, autotune_enabled,  # noqa: F401
                       coordinate_descent, fits_grid, memory_floor_ms, random_search,
                       samples_for_quantile, SMALL_KERNEL_MS)

# The imports every kernel file opens with: the names its decorators and body use.
HEADER = '''import triton
import triton.language as tl
from stax import triton_heuristics
from stax.triton_heuristics import ReductionHint, TileHint
from stax import triton_helpers
from stax.triton_helpers import libdevice
'''

# ---- §9.6 Configurations of any kernel: generated kernels (autotune) and the §9.8 template ----
# (template_tuning.py is imported only for a template)


def _as_flat(numels: dict) -> dict:
    """A kernel with a y axis of one program per index (`grid_y`: triton_kernel.grid_y_lines)
    chooses its configuration as the kernel over the flat x = y * x would (its static twin, whose
    x index holds both): at the same sizes the same blocks, warps and candidates."""
    if not numels.get("grid_y"):
        return numels
    flat = {k: v for k, v in numels.items() if k not in ("grid_y", "ynumel")}
    flat["xnumel"] = int(numels["xnumel"]) * int(numels["ynumel"])
    return flat


def default_config(kind: str, numels: dict, reduction_hint=None, r0_block=None) -> Config:
    """The heuristic configuration: what a kernel runs with before (or without) measurement."""
    numels = _as_flat(numels)
    if kind == "template":
        from .template_tuning import template_configs
        return template_configs(numels)[0]
    if kind.startswith("attention"):
        from .attention_kernels import attention_configs
        return attention_configs(numels, kind)[0]
    return autotune.default_config(kind, numels, reduction_hint, r0_block)


def grid_for(kind: str, numels: dict, cfg: Config) -> tuple:
    """Definition 9.1: the grid of a launch with configuration `cfg`. A `grid_y` kernel runs one
    program per y index, along y up to CUDA's 65535 and the rest folded onto z."""
    if numels.get("grid_y"):         # (its value: the y extent past which the rest goes on z)
        fold, y = int(numels["grid_y"]), int(numels["ynumel"])
        return (-(-int(numels["xnumel"]) // cfg["XBLOCK"]), min(y, fold), -(-y // fold))
    if kind == "template":
        from .template_tuning import template_grid
        return template_grid(numels, cfg)
    if kind.startswith("attention"):
        from .attention_kernels import attention_grid
        return attention_grid(numels, cfg)
    return autotune.grid_for(kind, numels, cfg)


def candidates(kind: str, numels: dict, reduction_hint=None, r0_block=None) -> list:
    """§9.6's candidate set C, the heuristic default first."""
    numels = _as_flat(numels)
    if kind == "template":
        from .template_tuning import candidate_limit, template_configs, template_grid
        return autotune.launchable(template_configs(numels), lambda c: template_grid(numels, c),
                                   candidate_limit(numels))
    if kind.startswith("attention"):
        from .attention_kernels import attention_configs, attention_grid
        return autotune.launchable(attention_configs(numels, kind), lambda c: attention_grid(numels, c))
    return autotune.candidates(kind, numels, reduction_hint, r0_block)


def tuning_space(kind: str, start: Config, numels: dict, reduction_hint=None) -> dict:
    """Definition 9.2's Π for mode="max-autotune"."""
    numels = _as_flat(numels)
    if kind == "template":
        from .template_tuning import template_tuning_space
        return template_tuning_space(start, numels)
    if kind.startswith("attention"):
        from .attention_kernels import attention_tuning_space
        return attention_tuning_space(start, numels)
    return autotune.tuning_space(kind, start, numels, reduction_hint)


# ---- §9.7 Triton's interpreter (TRITON_INTERPRET=1): "cuda" tensors as host memory ----


_SCALARS = (int, float, bool)   # launch arguments passed by value: sizes, run-time floats (§10.4)


def _interp_arg(a):
    """What Triton's interpreter needs of a pointer argument: a torch-like view of host memory."""
    if hasattr(a, "_storage"):
        return _InterpTensor(a._storage.data.host_array, a._meta.offset, a.dtype.name)
    if a.__class__ is float:    # a run-time float (§10.4): fp64, as the compiled signature says
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle
        return tl.tensor(TensorHandle(np.array([a], np.float64), tl.float64), tl.float64)
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
    """The adapter: data_ptr, dtype, untyped_storage(), new_empty, set_, size, stride (docs/DESIGN.md)."""

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


def _fix_interpreter_bf16_casts():
    """The same interpreter casts between bfloat16 and any type but float32 as numpy's astype of
    the raw words (int 3 becomes the word 3, a denormal): go through float32, as the GPU does.
    And it rounds float32 to bfloat16 toward zero: round to nearest even, as the GPU (and eager)."""
    from triton.runtime import interpreter
    from .dtypes import _to_storage_form, bfloat16
    builder, tl = interpreter.InterpreterBuilder, interpreter.tl
    if getattr(builder.cast_impl, "_stax_bf16", False):
        return
    plain = builder.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if (s == tl.bfloat16) != (d == tl.bfloat16) and tl.float32 not in (s, d):
            return plain(self, plain(self, src, tl.float32), dst_type)
        if s == tl.float32 and d == tl.bfloat16:
            return interpreter.TensorHandle(_to_storage_form(src.data, bfloat16), d)
        return plain(self, src, dst_type)
    cast_impl._stax_bf16 = True
    builder.cast_impl = cast_impl


def _interpreter_asserts():
    """STAX_DEBUG_INDEX=1's `tl.device_assert`s (triton_kernel.debug_index_checks) fire in the
    interpreter too: its builder drops them unless its options say debug, as the compiler does."""
    import dataclasses
    from triton.runtime import interpreter
    b = interpreter.interpreter_builder
    if not b.options.debug:
        # debug also turns on the overflow sanitizer, but int8/int16 arithmetic must wrap as eager
        fields = {f.name for f in dataclasses.fields(b.options)}
        extra = {"sanitize_overflow": False} if "sanitize_overflow" in fields else {}
        b.options = dataclasses.replace(b.options, debug=True, **extra)


def _fix_interpreter_bf16():
    _fix_interpreter_bf16_dot()
    _fix_interpreter_bf16_casts()


# ---- §9.6 Algorithm 9.1: records, kernel files ----

_RECORDS: dict = {}      # Algorithm 9.1's records, in memory (also on disk under the cache dir)


def _show_autotune() -> bool:
    return "autotune" in os.environ.get("STAX_LOGS", "").split(",") or "all" in os.environ.get("STAX_LOGS", "")


def _progress(text: str, times: list, done: bool = False) -> None:
    """One line of autotuning progress, rewritten in place (candidate i of n, best so far), on a
    terminal only (or under STAX_LOGS=autotune); quiet when stderr is a file or a pipe."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not (tty or _show_autotune()):
        return
    finite = [t for t in times if t != math.inf]
    best = f", best so far {min(finite):.4f} ms" if finite else ""
    print(f"\r{text}{best}\033[K" if tty else f"\r{text}{best}", end="\n" if done else "",
          file=sys.stderr, flush=True)


# Local memory a candidate may use and still be measured: libdevice's sin and cos keep a 28-byte
# array on the stack for their large-argument range reduction (32 bytes in every configuration of a
# kernel that calls them); register spills of a tile are larger, and are never chosen.
LOCAL_FRAME_BYTES = 64


def _triton_version() -> str:
    """Triton's version without importing triton (a warm cache never imports it)."""
    from importlib.metadata import version
    return version("triton")


def _exec_kernel_source(name: str, source: str):
    """The @triton.jit function of one kernel: its text is run as a module (Triton reads a
    kernel's source through `inspect`, served from the text itself: cache.exec_source). Only
    needed to compile or interpret."""
    mod = cache.exec_source("kernels", name, HEADER + "\n\n" + source, {})
    obj = getattr(mod, name)
    return obj.fn if isinstance(obj, CachingAutotuner) else obj


def _is_choice(record) -> bool:
    """A tuning record's structure: a configuration of int values and its time."""
    cfg = record.get("config") if isinstance(record, dict) else None
    return (isinstance(cfg, dict) and all(isinstance(k, str) and type(v) is int for k, v in cfg.items())
            and type(record.get("ms")) in (int, float))


def _load_choice(path):
    """(config, ms) from a tuning record on disk, or None (missing, or bad: logged and removed)."""
    record = cache.read_sealed_json(path, _is_choice, "a tuning record")
    return None if record is None else (record["config"], record["ms"])


def _save_cubin(path, cubin: bytes, info) -> None:
    """A cubin entry: its launch metadata as one JSON line, then the cubin's bytes (no pickle:
    reading an entry never runs code), sealed with their sha256."""
    cache.write_sealed(path, json.dumps(dataclasses.asdict(info)).encode() + b"\n" + cubin)


def _load_cubin(path):
    """(cubin, TritonKernelInfo) from disk, or None (missing, or bad: logged and removed)."""
    payload = cache.read_sealed(path)
    if payload is None:
        return None
    head, _, cubin = payload.partition(b"\n")
    fields = {f.name: getattr(f.type, "__name__", f.type)
              for f in dataclasses.fields(cuda_triton.TritonKernelInfo)}
    try:
        info = json.loads(head)
        ok = (isinstance(info, dict) and set(info) <= set(fields) and "name" in info and cubin
              and all(type(v).__name__ == fields[k] for k, v in info.items()))
    except ValueError:
        ok = False
    if not ok:
        cache.discard(path, "not a cubin entry of the expected structure")
        return None
    return cubin, cuda_triton.TritonKernelInfo(**info)


# ---- §9.6–9.7 The kernel launcher ----


class CachingAutotuner:
    """A generated kernel plus how to launch it: what `@triton_heuristics.<kind>(...)` and
    `async_compile.triton(name, source)` return.

    `run(*args)` picks the launch configuration (Algorithm 9.1 on first use), compiles it once (the
    cubin is cached on disk by content), and launches through cuda_triton's Launcher, whose argument
    array is built once. With the cubin and the choice already on disk, triton is never imported.
    """

    def __init__(self, name, kind, size_hints, signature, reduction_hint=None, tile_hint=None,
                 fn=None, source=None, meta=None):
        self.name, self.kind, self.size_hints = name, kind, size_hints
        # a template's facts beyond its numels (element size, SPLIT_K, the GEMM's tuning key)
        self.meta = dict(meta or {})
        self.signature, self.reduction_hint = signature, reduction_hint
        self._fn, self._source = fn, source
        self.numel_names = [n for n in signature if n.endswith("numel")]
        self.pointer_index = [i for i, t in enumerate(signature.values()) if t.startswith("*")]
        # the integer arguments (sizes, numels) follow the pointers; each is compiled with the
        # largest power of two up to 16 that divides it (Triton's own JIT does so for 16): with it,
        # loads along a row of run-time length vectorize as they do for a constant one
        types = list(signature.values())
        scalars = [i for i, t in enumerate(types) if not t.startswith("*")]
        contiguous = bool(scalars) and scalars == list(range(scalars[0], len(types)))
        # where the fast path's comparison starts: every scalar argument, else the numels alone
        self.ints_from = scalars[0] if contiguous else len(types) - len(self.numel_names)
        self.int_index = [i for i in scalars if types[i].startswith("i")] if contiguous else []
        self.r0_block = size_hints.get("r0_") if kind == "persistent_reduction" else None
        self.launchers: dict = {}
        self.config = None
        # the last aligned launch: (its scalar arguments from `ints_from` on, grid, launcher);
        # `run` reuses it when a launch passes the same scalars
        self._fast = None
        self.mode, self.options = None, {}   # runtime.AsyncCompile sets stax.compile's mode and options
        self.tuning_seconds = 0.0
        self.best_ms = None          # the chosen configuration's measured time, when measured
        self._text_key = None

    @property
    def fn(self):
        if self._fn is None:
            self._fn = _exec_kernel_source(self.name, self._source)
        return self._fn

    @property
    def source(self) -> str:
        return self._source if self._source is not None else self.fn.src

    @property
    def text_key(self) -> str:
        """The kernel's text without its own name (`shared_text`): what its cubins and tuning
        records are keyed by, so identical kernels of one program compile and tune once."""
        if self._text_key is None:
            self._text_key = shared_text(self.name, self.source)
        return self._text_key

    def grid(self, numels: dict, cfg: Config) -> tuple:
        """Definition 9.1: ⌈numel / BLOCK⌉ programs along each axis (x on program_id(0))."""
        return grid_for(self.kind, numels, cfg)

    def choose_config(self, numels: dict, args=()) -> Config:
        if self.config is None:
            numels = {**numels, **self.meta}    # (a MultiKernel passes the launch's numels alone)
            if cuda.interpreting():
                self.config = default_config(self.kind, numels, self.reduction_hint, self.r0_block)
            else:
                self.config = self._autotune(numels, args)
        return self.config

    def run(self, *args, stream=None):
        """Launch on the current stream; the fast path is one list of pointers and one driver call."""
        ptrs = [a if a.__class__ in _SCALARS else a.data_ptr() for a in args]
        fast = self._fast
        if fast is not None and fast[0] == args[self.ints_from:]:
            low_bits = 0
            for i in self.pointer_index:
                low_bits |= ptrs[i]
            if not low_bits & 15:
                fast[2].launch_ints(fast[1], ptrs)
                return
        self._slow_run(args, ptrs)

    def _slow_run(self, args, ptrs):
        n = len(self.numel_names)
        numels = {**dict(zip(self.numel_names, args[len(args) - n:])), **self.meta}
        cfg = self.choose_config(numels, args)
        grid = self.grid(numels, cfg)
        if 0 in grid:
            return
        if cuda.interpreting():
            _fix_interpreter_bf16()
            if "tl.device_assert" in self.source:
                _interpreter_asserts()
            constexprs = {k: v for k, v in self._even_r0(cfg, args).items() if k.isupper()}
            self.fn[grid](*[_interp_arg(a) for a in args], **constexprs)
            for name, a in zip(self.signature, args):      # no write outside any buffer
                if hasattr(a, "_storage") and not a._storage.data.guards_intact():
                    raise RuntimeError(f"{self.name} wrote outside {name} (a bug in the generated "
                                       f"kernel):\n{self.source}")
            return
        aligned = not any(ptrs[i] & 15 for i in self.pointer_index)
        launcher = self._launcher(cfg, aligned, args)
        launcher(grid, ptrs)
        if aligned:     # the next launch with these sizes skips straight to the driver call
            self._fast = (args[self.ints_from:], grid, launcher)

    def _launcher(self, cfg: Config, aligned: bool, args):
        cfg, divs = self._even_r0(cfg, args), self._divs(args)
        key = (tuple(sorted(cfg.items())), aligned, divs)
        if key not in self.launchers:
            self.launchers[key] = self._compile(cfg, aligned, divs)
        return self.launchers[key]

    def _even_r0(self, cfg: Config, args) -> Config:
        """§10.3: a kernel over a row of symbolic length (meta `even_r0`) is compiled for each
        launch with EVEN_R0 = 1 when its row is a positive whole number of R0_BLOCK steps (no
        partial step, no row-end mask: the static kernel's code), else 0. Like `_divs`, a fact of
        the arguments the kernel is specialized on; the tuning records keep the configuration."""
        if not self.meta.get("even_r0"):
            return cfg
        n = args[list(self.signature).index("r0_numel")]
        return {**cfg, "EVEN_R0": even_r0(n, cfg.get("R0_BLOCK", self.r0_block))}

    def _divs(self, args) -> tuple:
        return tuple((i, _pow2_divisor(args[i])) for i in self.int_index if args[i] % 2 == 0)

    def _precompile(self, cands: list, args) -> None:
        """Build the candidates' cubins side by side before measuring them one by one: Triton's
        passes and ptxas run mostly outside the GIL, and a kernel's first launch compiled its 6-10
        candidates one after the other (a GPT-2 block's training step: ~460 compiles, most of its
        first-step time). Threads only write cubins (`_build`); loading them (the driver's
        context is per thread) stays on this thread, in `_compile`."""
        if not args:
            return
        ptrs = [a if a.__class__ in _SCALARS else a.data_ptr() for a in args]
        aligned, divs = not any(ptrs[i] & 15 for i in self.pointer_index), self._divs(args)
        cands = [self._even_r0(c, args) for c in cands]
        todo = [c for c in cands if (tuple(sorted(c.items())), aligned, divs) not in self.launchers]
        workers = min(compile_threads(), len(todo))
        if workers < 2:
            return
        self.fn                                        # (exec the kernel's text once, on this thread)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(workers, thread_name_prefix="stax-compile") as pool:
            list(pool.map(lambda c: self._build(c, aligned, divs, quiet=True), todo))

    # -- Algorithm 9.1 --
    def _autotune(self, numels: dict, args) -> Config:
        """Algorithm 9.1: the recorded choice, else the only candidate, else measure them all."""
        cands = candidates(self.kind, numels, self.reduction_hint, self.r0_block)
        search = self.options.get("autotune_search", "coordinate") if self.mode == "max-autotune" else None
        small = len(cands) == 1 or self._floor_ms(numels) < SMALL_KERNEL_MS
        if (small and search is None) or not autotune_enabled(self.options):
            return cands[0]
        props = cuda.get_device_properties()
        # identical GEMMs (shape, layouts, dtypes, precision) share one record, whatever their
        # names and epilogues (§9.8: the epilogue does not change which blocks are fastest)
        shared = self.meta.get("tuning_key")
        # the launch's sizes too: a kernel of symbolic sizes (§10.3) is one text for every size,
        # and is tuned at the size it first runs at (the hint); softmax's dynamic looped kernel
        # tuned on rows of 32768 was served that choice on rows of 65536 (1.16x its static twin)
        key = cache.content_hash(shared or self.text_key, repr(cands), repr(sorted(numels.items())),
                                 props.name, repr(props.cc),
                                 _triton_version(), repr(search), repr(sorted(self.options.items())),
                                 cache.FORMAT, "cold" if self.kind == "template" else "warm")
        path = cache.folder("autotune") / f"{'template' if shared else _family(self.name)}_{key}.json"
        if key not in _RECORDS:
            choice = _load_choice(path)
            if choice is not None:
                _RECORDS[key] = choice
        if key in _RECORDS:
            chosen, self.best_ms = _RECORDS[key]
            return chosen
        start = time.perf_counter()
        self._precompile(cands, args)
        saved = self._protect(args)
        times = []
        for i, cfg in enumerate(cands):
            _progress(f"stax autotune {self.name}: candidate {i + 1}/{len(cands)}", times)
            times.append(self._measure(cfg, numels, args))
        _progress(f"stax autotune {self.name}: {len(cands)} candidate(s) measured", times, done=True)
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
        cache.write_sealed(path, json.dumps({"config": chosen, "ms": chosen_ms, "candidates": cands,
                                             "candidate_ms": times, "search": search,
                                             "seconds": self.tuning_seconds}))
        if _show_autotune():
            for cfg, t in zip(cands, times):
                mark = "  <- best candidate" if cfg is cands[best] else ""
                print(f"  {cfg}: {t:.4f} ms{mark}", file=sys.stderr)
            if search is not None:
                print(f"  {search} search from the best candidate: {chosen}: {chosen_ms:.4f} ms",
                      file=sys.stderr)
            print(f"  chosen in {self.tuning_seconds:.2f} s", file=sys.stderr)
        return chosen

    def _floor_ms(self, numels: dict) -> float:
        """An upper estimate of the kernel's memory floor (autotune.memory_floor_ms)."""
        if self.kind == "template":            # compute-bound, measured; unless a few rows, launch-bound
            from .template_tuning import launch_bound
            return 0.0 if launch_bound(numels) else math.inf
        if self.kind in ("attention", "attention_decode"):
            return math.inf                    # compute-bound: always worth measuring
        return memory_floor_ms(_as_flat(numels), self.signature)

    def _search(self, search: str, start: Config, numels: dict, args) -> tuple:
        """mode="max-autotune": Algorithm 9.2 from the best candidate, or random search (Prop. 9.3)."""
        space = tuning_space(self.kind, start, numels, self.reduction_hint)
        seen: list = []

        def cost(cfg):
            seen.append(self._measure(cfg, numels, args))
            _progress(f"stax max-autotune {self.name}: {search} search, step {len(seen)}", seen)
            return seen[-1]
        if search == "random":
            q, delta = self.options.get("autotune_q", 0.05), self.options.get("autotune_delta", 0.05)
            found = random_search(space, cost, samples_for_quantile(q, delta), random.Random(0))
            if cost(found) >= cost(start):
                found = start
        else:
            found = coordinate_descent(start, cost, space, eps=self.options.get("autotune_eps", 1e-3))
        found_ms = cost(found)
        _progress(f"stax max-autotune {self.name}: {search} search, {len(seen)} step(s)", seen, done=True)
        return found, found_ms

    def _measure(self, cfg: Config, numels: dict, args) -> float:
        """Median time of one launch in ms (CUDA events, after a warm-up); inf if it cannot run."""
        grid = self.grid(numels, cfg)
        if not fits_grid(grid):
            return math.inf                    # more programs along y or z than CUDA launches
        ptrs = [a if a.__class__ in _SCALARS else a.data_ptr() for a in args]
        try:
            launcher = self._launcher(cfg, not any(ptrs[i] & 15 for i in self.pointer_index), args)
        except Exception:                      # a candidate that does not compile costs inf
            return math.inf
        if launcher.kernel.local_size_bytes > LOCAL_FRAME_BYTES:
            return math.inf                    # spills registers to local memory
        return cuda.median_ms(lambda: launcher(grid, ptrs), cold=self.kind == "template")

    def _protect(self, args) -> list:
        """Copies of the buffers this kernel updates in place, so tuning never changes a result."""
        saved = []
        for name, a in zip(self.signature, args):
            if name.startswith("in_out_ptr"):
                nbytes = a._storage.data.count * a._storage.data.dtype.itemsize
                copy = cuda.allocate(max(1, nbytes))
                cuda.copy_device_to_device(copy, a._storage.data.buffer, nbytes)
                saved.append((a, copy, nbytes))
        return saved

    def _restore(self, saved):
        for a, copy, nbytes in saved:
            cuda.copy_device_to_device(a._storage.data.buffer, copy, nbytes)

    def compile_for(self, cc: int = 90, cfg: Config | None = None, divs: tuple = (), even_r0: bool = False):
        """Compile for sm_{cc} without a GPU (CI checks every generated kernel this way); `divs`:
        (argument index, a power of two it is a multiple of) for integer arguments; `even_r0`:
        the EVEN_R0 specialization, for a kernel that has one (`_even_r0`)."""
        numels = {**{f"{p}numel": n for p, n in self.size_hints.items()}, **self.meta}
        cfg = cfg or default_config(self.kind, numels, self.reduction_hint, self.r0_block)
        cfg = {**cfg, "EVEN_R0": int(even_r0)} if self.meta.get("even_r0") else cfg
        constexprs = {k: v for k, v in cfg.items() if k.isupper()}
        return cuda_triton.compile_triton(self.fn, dict(self.signature), constexprs, num_warps=cfg["num_warps"],
                                   num_stages=cfg["num_stages"], cc=cc, attrs=self._attrs(True, divs))

    def _attrs(self, aligned: bool, divs: tuple = ()) -> dict:
        """Pointer arguments known to be 16-byte aligned, and integer arguments known to be
        multiples of a power of two (`divs`), let Triton vectorize loads and stores."""
        attrs = {(i,): [["tt.divisibility", 16]] for i in (self.pointer_index if aligned else ())}
        attrs.update({(i,): [["tt.divisibility", d]] for i, d in divs})
        return attrs

    def _compile(self, cfg: Config, aligned: bool, divs: tuple = ()):
        """Compile for this GPU once per configuration; cubins are cached on disk by content."""
        cubin, info = self._build(cfg, aligned, divs)
        return cuda_triton.launcher_for_triton(cubin, info, list(self.signature.values()))

    def _build(self, cfg: Config, aligned: bool, divs: tuple, quiet: bool = False):
        """(cubin, info) of one configuration: from the cubin cache, else compiled and saved.
        `quiet` (a `_precompile` thread): a failure is left for `_compile` to raise again."""
        props = cuda.get_device_properties()
        cc = props.cc[0] * 10 + props.cc[1]
        constexprs = {k: v for k, v in cfg.items() if k.isupper()}
        key = cache.content_hash(self.text_key, repr(sorted(cfg.items())), repr(self.signature),
                                 _triton_version(), str(cc), str(aligned), repr(divs), cache.FORMAT)
        path = cache.folder("cubin") / f"{_family(self.name)}_{key}.bin"
        entry = _load_cubin(path)
        if entry is not None:
            return entry
        try:
            cubin, info, _ = cuda_triton.compile_triton(self.fn, dict(self.signature), constexprs,
                                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                                 cc=cc, attrs=self._attrs(aligned, divs))
        except Exception:
            if quiet:
                return None
            raise
        _save_cubin(path, cubin, info)
        return cubin, info


def shared_text(name: str, source: str) -> str:
    """A kernel's text with its name taken out: the comment line naming its graph nodes dropped,
    the name itself (the def line) spelled KERNEL. Kernels whose texts differ only there compile
    to the same code (issue 14: the MLP block's four layers are four copies of one GEMM and one
    layer norm), so they share one cubin and one tuning record; the cubin keeps the name of the
    kernel that compiled it (what a profiler shows for every copy)."""
    lines = [line for line in source.splitlines() if not line.startswith(f"# {name}:")]
    return re.sub(rf"\b{re.escape(name)}\b", "KERNEL", "\n".join(lines))


def _family(name: str) -> str:
    """A kernel's name without its index (triton_per_fused_3 -> triton_per_fused): the stem of
    its cache entries, which copies under other indices share."""
    return re.sub(r"_\d+$", "", name)


def compile_threads() -> int:
    """Threads that build a kernel's candidates at once (`STAX_COMPILE_THREADS`; 1: one by one)."""
    env = os.environ.get("STAX_COMPILE_THREADS")
    return max(1, int(env)) if env else max(1, min(8, os.cpu_count() or 1))


def even_r0(r0_numel: int, r0_block: int) -> int:
    """EVEN_R0 of a launch (`CachingAutotuner._even_r0`): 1 when the row is a positive whole
    number of R0_BLOCK steps."""
    return int(r0_numel > 0 and r0_numel % r0_block == 0)


def _pow2_divisor(n: int) -> int:
    """The largest of 2, 4, 8, 16 that divides the even `n` (0 counts as a multiple of 16)."""
    return next(d for d in (16, 8, 4, 2) if n % d == 0)


# ---- §9.4 A multi-pass row's two forms ----


def _misaligned(args) -> bool:
    return any(a.data_ptr() & 15 for a in args if a.__class__ not in _SCALARS)


class MultiKernel:
    """Alternative kernels for one fusion group: a multi-pass row's persistent and looped forms
    (§9.4). The first launch runs Algorithm 9.1 for each and keeps the one whose best configuration
    is faster; the choice follows from the records, so a later process measures nothing. Without
    measurements (the interpreter, autotuning off, a kernel of microseconds) the first runs."""

    def __init__(self, name: str, kernels: list):
        self.name, self.kernels = name, kernels
        self.chosen = None
        # §9.8: a persistent TMA template reads 16-byte aligned operands only; the first kernel
        # (the grouped template) runs any call whose buffers are not
        self.tma = any(getattr(k, "meta", {}).get("tma") for k in kernels)
        # §10.3: a symbolic row's persistent form takes rows up to its R0_BLOCK, the looped form
        # any row: where r0_numel sits in the arguments (counted from the end), else None
        first = kernels[0]
        bounded = any(getattr(k, "r0_block", None) for k in kernels)
        self.r0_at = (len(first.numel_names) - first.numel_names.index("r0_numel")
                      if bounded and "r0_numel" in getattr(first, "numel_names", ()) else None)

    def run(self, *args, stream=None):
        if self.r0_at is not None and self._too_long(self.chosen or self.kernels[0], args):
            kernel = next(k for k in self.kernels if not self._too_long(k, args))
            kernel.run(*args, stream=stream)       # (the choice waits for a row both forms take)
            return
        kernel = self.chosen
        if kernel is None:
            kernel = self.chosen = self._choose(args)
        if self.tma and kernel is not self.kernels[0] and _misaligned(args):
            kernel = self.kernels[0]
        kernel.run(*args, stream=stream)

    def _too_long(self, kernel, args) -> bool:
        """Is this launch's row longer than the persistent `kernel` holds in registers?"""
        bound = kernel.r0_block
        return bound is not None and args[len(args) - self.r0_at] > bound

    def _choose(self, args) -> CachingAutotuner:
        if cuda.interpreting():
            return self.kernels[0]
        if self.tma and _misaligned(args):
            return self.kernels[0]         # never measure a TMA kernel on unaligned operands
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


# ---- The decorators the kernel text calls ----


def kernel_from_source(name: str, source: str) -> CachingAutotuner:
    """A CachingAutotuner from generated text, without importing triton: the decorator's arguments
    (kind, size_hints, reduction_hint, signature) are read from the text itself."""
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    deco = next(d for d in fn.decorator_list if isinstance(d, ast.Call)
                and isinstance(d.func, ast.Attribute) and getattr(d.func.value, "id", "") == "triton_heuristics")
    kw = {}
    for k in deco.keywords:
        kw[k.arg] = k.value.attr if isinstance(k.value, ast.Attribute) else ast.literal_eval(k.value)
    return CachingAutotuner(name, deco.func.attr, kw.get("size_hints", {}), kw.get("signature", {}),
                        kw.get("reduction_hint"), kw.get("tile_hint"), source=source, meta=kw.get("meta"))


def _decorator(kind):
    def make(size_hints, reduction_hint=None, tile_hint=None, signature=None, meta=None, **_):
        return lambda fn: CachingAutotuner(fn.__name__, kind, size_hints, signature or {}, reduction_hint,
                                           tile_hint, fn=fn, meta=meta)
    return make


pointwise = _decorator("pointwise")
reduction = _decorator("reduction")
persistent_reduction = _decorator("persistent_reduction")
template = _decorator("template")
attention = _decorator("attention")
attention_decode = _decorator("attention_decode")
