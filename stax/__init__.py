"""Stax: a small, complete compiler for tensor programs (the design card's `stax.py`).

    import stax
    @stax.compile
    def f(x, y):
        return (stax.relu(x + y) * 2).sum(-1)      # Example 1.1

Public API: the tensor functions of `tensor.py` (PyTorch spelling), `stax.compile` and
`stax.generate`. The compiler's stages live in their own modules, one per chapter section:
capture.py (§3) → lower.py (§6) → schedule.py (§7) → codegen_cpp.py (§8) / codegen_triton.py (§9)
→ runtime.py (loading, §11.1 artifact cache). This module is the top of that stack (§2).

Where to look:
  - `compile`, `CompiledFunction` ........ §2 specialization key, artifact cache, recompile limit
  - `generate`, `Generated` .............. the generated code without running it
  - `_compile_graph` ..................... the pipeline, stage by stage, with STAX_LOGS output
"""
from __future__ import annotations

import builtins
import functools
import os
import sys
import time
import warnings
from dataclasses import dataclass

import numpy as _np

from . import capture as _capture
from .tensor import *  # noqa: F401,F403  (the PyTorch-spelled tensor API: Tensor, factories)
from .tensor import Tensor, _ALIASES, current_tracer, get_num_threads
from .tensor_ops import *  # noqa: F401,F403  (the op functions; binds the Tensor methods)
from .memory import empty_cache, memory_stats, reset_peak_memory_stats  # noqa: F401 (host allocator)

for _name, _dt in _ALIASES.items():     # stax.float32, stax.float, stax.long, stax.bool, ...
    globals()[_name] = _dt

RECOMPILE_LIMIT = 8
_MISS = object()

# Hook for `python -m stax run` (off by default): when a list, every CompiledFunction created is
# appended to it and remembers the inputs of its last call (`last_inputs`), so that the CLI can
# summarize each one and time it against eager on those inputs.
_RUN_REGISTRY: list | None = None

# ---- Observability: STAX_LOGS=graph,ir,schedule,kernels,wrapper,guards,recompiles ----

LOG_STAGES = ("graph", "ir", "schedule", "kernels", "wrapper", "guards", "recompiles", "autotune")


def _logs() -> set:
    value = os.environ.get("STAX_LOGS", "")
    stages = {s.strip() for s in value.split(",") if s.strip()}
    if "all" in stages:
        stages = set(LOG_STAGES)
    unknown = stages - set(LOG_STAGES)
    if unknown:
        raise ValueError(f"STAX_LOGS has unknown stage(s) {sorted(unknown)}; choose from {', '.join(LOG_STAGES)}")
    return stages


def _log(stage: str, title: str, text: str):
    if stage in _logs():
        print(f"==== stax {stage}: {title} ====\n{text.rstrip()}\n", file=sys.stderr)


# ---- §2 The specialization key ----


def _key_of(x):
    if x.__class__ is Tensor:
        m = x._meta
        return ("tensor", m.dtype.name, m.device, m.shape, m.stride)
    # builtins.*: this module's globals `bool`, `int`, `float` are the dtype aliases stax.bool, ...
    if isinstance(x, (builtins.bool, builtins.int, builtins.float, str, type(None))):
        return (type(x).__name__, x)
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_key_of(y) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key_of(v)) for k, v in x.items()))
    if isinstance(x, _np.ndarray):      # always run eagerly (capture.py): one key, never a stale id
        return ("ndarray",)
    return ("object", id(x))


def _describe_change(old, new) -> str:
    """Which part of the key differs: the guard that failed, in words."""
    shared = [_capture.describe_aliasing(k[-1] if k and k[-1][0] == "aliasing" else None) for k in (old, new)]
    if shared[0] != shared[1]:
        return f"tensor inputs sharing memory changed from {shared[0]} to {shared[1]}"
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if a[0] == "tensor" and b[0] == "tensor":
            for what, k in (("dtype", 1), ("device", 2), ("size", 3), ("stride", 4)):
                if a[k] != b[k]:
                    return f"argument {i}: tensor {what} changed from {a[k]} to {b[k]}"
        return f"argument {i} changed from {a[1:]!r} to {b[1:]!r}"
    return "the number of arguments changed"


# ---- The pipeline ----


@dataclass
class Generated:
    """The code Stax generates for one specialization: kernels (launch order) and the wrapper."""
    kernels: dict
    wrapper: str
    graph: object = None
    ir: str = ""
    schedule: str = ""
    module: object = None

    def __str__(self):
        return str(self.module) if self.module is not None else \
            "\n\n".join(self.kernels.values()) + "\n\n" + self.wrapper


def _compile_graph(graph, device: str, name: str, use_cache: bool = False) -> Generated:
    """Lower, schedule and print one captured graph, or find its module in the artifact cache."""
    from . import runtime
    _log("graph", name, graph.format())
    cuda = device.startswith("cuda")
    path = runtime.artifact_path(graph, device, _target(device)) if use_cache else None
    if path is not None and path.exists() and not (_logs() & {"ir", "schedule"}):
        module = runtime.load_artifact(path)
        if module is not None:
            _log("kernels", name, "\n".join(module.kernels.values()) or "(no kernels)")
            _log("wrapper", name, module.wrapper)
            note = "(from the artifact cache: lowering and scheduling were skipped)"
            return Generated(dict(module.kernels), module.wrapper, graph, note, note, module)
    from . import ir, lower, schedule
    if cuda:
        from . import codegen_triton as backend
    else:
        from . import codegen_cpp as backend
    lowered = lower.lower(graph, split_policy=backend.split_policy)
    ir_text = ir.format_ir(lowered)
    _log("ir", name, ir_text)
    sched = schedule.schedule(lowered)
    sched_text = schedule.format_schedule(sched)
    _log("schedule", name, sched_text)
    module = backend.generate(sched)
    _log("kernels", name, "\n".join(module.kernels.values()) or "(no kernels)")
    _log("wrapper", name, module.wrapper)
    if path is not None:
        runtime.save_artifact(path, module)
    return Generated(dict(module.kernels), module.wrapper, graph, ir_text, sched_text, module)


def _target(device: str) -> str:
    """The device facts a back end's decisions depend on (threads for Alg. 6.1 on the CPU, SMs on the GPU)."""
    if device.startswith("cuda"):
        from . import cuda
        if cuda.is_available():
            p = cuda.get_device_properties()
            return f"sm={p.sm_count},cc={p.cc}"
        return "sm=132,cc=(9, 0)"
    return f"threads={get_num_threads()}"


def _device_of(args) -> str:
    devs = {str(a.device) for a in args if isinstance(a, Tensor)}
    return devs.pop() if len(devs) == 1 else "cpu"


def generate(fn, *example_inputs, device: str | None = None, **kwargs) -> Generated:
    """The code `stax.compile(fn)` would run on these inputs, without running it."""
    from .capture import capture
    graph, _ = capture(fn, list(example_inputs), kwargs)
    return _compile_graph(graph, device or _device_of(example_inputs), getattr(fn, "__name__", "fn"))


class CompiledFunction:
    """`stax.compile(fn)`: one artifact per specialization key, guarded and cached."""

    def __init__(self, fn, fullgraph: bool, mode, options):
        functools.update_wrapper(self, fn)
        self.fn, self.fullgraph, self.mode, self.options = fn, fullgraph, mode, options or {}
        self.artifacts: dict = {}       # key -> (call, output spec) or None for "run eagerly"
        self.constants: dict = {}       # key -> real tensors the function closed over (lifted inputs)
        self.stats = {"compiles": 0, "calls": 0, "eager_calls": 0, "compile_seconds": 0.0}
        self.last_generated = None
        self.last_inputs = None         # (args, kwargs) of the last call, only under `python -m stax run`
        if _RUN_REGISTRY is not None:
            _RUN_REGISTRY.append(self)

    def __call__(self, *args, **kwargs):
        self.stats["calls"] += 1
        if current_tracer() is not None:        # called from inside another compiled function: inline it
            return self.fn(*args, **kwargs)
        if _RUN_REGISTRY is not None:
            self.last_inputs = (args, kwargs)
        key = tuple([_key_of(a) for a in args])
        if kwargs:
            key += tuple((k, _key_of(v)) for k, v in sorted(kwargs.items()))
        alias = _capture.call_aliasing(args, kwargs)    # None unless two tensor inputs share memory
        if alias is not None:
            key += (alias.pattern,)
        entry = self.artifacts.get(key, _MISS)
        if entry is _MISS:
            entry = self._compile(key, args, kwargs)
        if entry is None:
            self.stats["eager_calls"] += 1
            return self.fn(*args, **kwargs)
        call, spec, flat = entry
        # the common call, tensors and scalars passed positionally, skips walking nested arguments
        inputs = [a for a in args if a.__class__ is Tensor] if flat and not kwargs else \
            _capture.input_tensors(args, kwargs)
        if alias is None:
            outs = call(inputs + self.constants[key])
            return _capture.unflatten(spec, iter(outs), inputs)
        outs = call(alias.call_inputs(inputs) + self.constants[key])
        return _capture.unflatten(spec, iter(outs), alias.sources(inputs))

    def _compile(self, key, args, kwargs):
        from .capture import GraphBreak, capture
        name = getattr(self.fn, "__name__", "fn")
        if self.artifacts:
            old = next(reversed(self.artifacts))
            _log("recompiles", name, f"recompiling {name}: {_describe_change(old, key)}")
        if len(self.artifacts) >= RECOMPILE_LIMIT:
            msg = (f"stax.compile: {name} hit the recompile limit ({RECOMPILE_LIMIT} specializations); "
                   f"last change: {_describe_change(next(reversed(self.artifacts)), key)}")
            if self.fullgraph:
                raise RuntimeError(msg + ". Pass inputs of fewer distinct shapes/dtypes, or drop fullgraph=True.")
            warnings.warn(msg + "; running eagerly from now on for new inputs.", stacklevel=3)
            self.artifacts[key] = None
            return None
        t0 = time.perf_counter()
        try:
            graph, spec = capture(self.fn, list(args), kwargs)
        except GraphBreak as e:
            if self.fullgraph:
                raise GraphBreak(f"stax.compile(fullgraph=True) cannot capture {name}: {e}. "
                                 "Replace the data-dependent branch with stax.where(...), or drop "
                                 "fullgraph=True to run the function eagerly.") from None
            _log("graph", name, f"graph break, running eagerly: {e}")
            self.artifacts[key] = None
            return None
        gen = _compile_graph(graph, _device_of(args), name, use_cache=True)
        from . import runtime
        call = runtime.load_module(gen.module, mode=self.mode, options=self.options)
        self.constants[key] = [graph.constants[n.name] for n in graph.inputs if n.op == "constant"]
        flat = all(a.__class__ is Tensor or isinstance(a, (builtins.bool, builtins.int, builtins.float,
                                                             str, type(None))) for a in args)
        self.artifacts[key] = (call, spec, flat)
        self.last_generated = gen
        self.stats["compiles"] += 1
        self.stats["compile_seconds"] += time.perf_counter() - t0
        _log("guards", name, "specialized on: " + "; ".join(repr(k) for k in key))
        return self.artifacts[key]


def compile(fn=None, *, dynamic: bool = False, fullgraph: bool = False, mode=None, options=None):
    """Compile `fn` (also usable as `@stax.compile` and `@stax.compile(...)`).

    dynamic: dynamic shapes (§10) are not implemented yet; True raises.
    fullgraph: raise instead of running eagerly when the function cannot be captured whole.
    mode: None/"default" (the CPU back end ignores "reduce-overhead" and "max-autotune").
    """
    if dynamic:
        raise NotImplementedError("stax.compile(dynamic=True): dynamic shapes (§10) are not "
                                  "implemented yet; use dynamic=False (the default): each new "
                                  "shape compiles its own specialization")
    if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise ValueError(f"stax.compile: unknown mode {mode!r}; choose None, 'default', "
                         "'reduce-overhead' or 'max-autotune'")
    if fn is None:
        return lambda f: compile(f, dynamic=dynamic, fullgraph=fullgraph, mode=mode, options=options)
    if not callable(fn):
        raise TypeError(f"stax.compile expects a function, got {type(fn).__name__}")
    return CompiledFunction(fn, fullgraph, mode, options)
