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
  - `compile`, `CompiledFunction` ........ §2 artifact cache (keys from specialize.py), recompile limit,
                                            one compile per key across threads (a lock per function)
  - `_reads_of`, `_guard_key` ............. §2 guards on what the function reads besides its arguments
                                            (globals, closure cells, attributes, attributes of its
                                            argument objects): rebinding recompiles
  - `_lookup_dynamic`, `_auto_dims` ...... §10.4 dynamic and automatic dynamic (the default) mode;
                                            `sized_ints`: int arguments as sizes; `_note_floats`:
                                            float arguments as run-time scalars (kernel parameters)
  - `_admit` ............................. §2.4 the recompile and cumulative compile limits
  - `generate`, `Generated` .............. the generated code without running it
  - `_compile_graph` ..................... the pipeline, stage by stage, with STAX_LOGS output
"""
from __future__ import annotations

import builtins
import dis
import functools
import os
import re
import sys
import threading
import time
import types
import warnings
from dataclasses import dataclass

import numpy as np

from . import capture as _capture
from .specialize import (Rekey, arg_at, describe_change, describe_dims, describe_read_change, dynamic_dims,  # noqa: F401
                         dynamic_inputs, family_key_of, floats_of, key_of, mark_dynamic, mark_static,
                         rank_key_of, sized_ints, user_stacklevel)
from .specialize import LastCall as _LastCall, scalar_key as _scalar_key
from .tensor import *  # noqa: F401,F403  (the PyTorch-spelled tensor API: Tensor, factories)
from .tensor import Tensor, _ALIASES, _TLS, current_tracer, get_num_threads
from .tensor_ops import *  # noqa: F401,F403  (the op functions; binds the Tensor methods)
from .shape_ops import *  # noqa: F401,F403  (split, repeat, flip, roll, tril, meshgrid, ...)
from .math_ops import *  # noqa: F401,F403  (lerp, einsum, sort, norm, aliases, in-place forms, ...)
from .indexing import *  # noqa: F401,F403  (gathers, scatters, advanced indexing, masks)
from . import autograd  # noqa: E402  (§5 eager autograd: binds .backward, .grad_fn, .detach)
from .autograd import (enable_grad, inference_mode, is_grad_enabled, no_grad,  # noqa: E402,F401
                       set_grad_enabled)
from .autograd import needs_grad as _needs_grad  # noqa: E402
from .conv import conv2d  # noqa: F401  (§9.8 convolution: eager im2col, a GPU template)
from .memory import empty_cache, memory_stats, reset_peak_memory_stats  # noqa: F401 (host allocator)
from . import math_ops as _math_ops_mod, shape_ops as _shape_ops_mod, tensor_ops as _tensor_ops_mod
from . import indexing as _indexing_mod
from .attention import (BlockMask, attention_backward, attention_forward, create_block_mask, omni_attention,  # noqa: F401 (§9.10)
                        scaled_dot_product_attention)
from . import template_tuning as _tuning
from .template_tuning import get_float32_matmul_precision, set_float32_matmul_precision  # noqa: F401

for _name, _dt in _ALIASES.items():     # stax.float32, stax.float, stax.long, stax.bool, ...
    globals()[_name] = _dt

RECOMPILE_LIMIT = 8     # artifacts kept per function (§2.4); past it a miss compiles without keeping
COMPILE_LIMIT = 64      # compiles per function in all (§2.4); past it a miss runs eagerly
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_MISS = object()
_IN_KEY = object()      # an argument's attribute that the argument's own key covers

# Hook for `python -m stax run` (off by default): when a list, every CompiledFunction created is
# appended to it and remembers the inputs of its last call (`last_inputs`), so that the CLI can
# summarize each one and time it against eager on those inputs.
_RUN_REGISTRY: list | None = None

# ---- Observability: STAX_LOGS=graph,ir,schedule,kernels,wrapper,guards,recompiles ----

LOG_STAGES = ("graph", "ir", "schedule", "kernels", "wrapper", "guards", "recompiles", "autotune",
              "cudagraphs", "partition")


def _logs() -> set:
    value = os.environ.get("STAX_LOGS", "")
    stages = {s.strip() for s in value.split(",") if s.strip()}
    if "all" in stages:
        stages = set(LOG_STAGES)
    unknown = stages - set(LOG_STAGES)
    if unknown:
        raise ValueError(f"STAX_LOGS has unknown stage(s) {sorted(unknown)}; choose from {', '.join(LOG_STAGES)}")
    return stages


_OBSERVERS: list = []       # callables (stage, title, payload): `python -m stax report`, `explain`


def _log(stage: str, title: str, text: str):
    for observe in _OBSERVERS:
        observe(stage, title, text)
    if stage in _logs():
        print(f"==== stax {stage}: {title} ====\n{text.rstrip()}\n", file=sys.stderr)


# ---- §2 Guards on what the function reads besides its arguments ----
#
# The function also reads globals, closure cells and attributes of them (`SCALE`, `cfg.eps`,
# `self.weight`, and the same in the functions it calls). A traced graph bakes in what it read
# then, so each call re-reads those values and adds them to the key: Python scalars (and other
# plain values) by value, tensors by layout -- a tensor read this way is a constant *input* of the
# compiled code, fed the tensor the name holds now, so a rebound or updated tensor is read fresh --,
# numpy arrays by contents, functions and classes by identity. A change is a recompile, logged
# under STAX_LOGS=recompiles with the name that changed. Reads the bytecode does not spell
# (`globals()[name]`, `getattr(obj, name)`, items of a container argument) are not guarded.

_LIBRARY_ROOTS = frozenset(sys.stdlib_module_names) | {"stax", "numpy", "torch", "sympy", "triton", "cffi"}
_PLAIN = (builtins.bool, builtins.int, builtins.float, str, type(None))
_KEYED = (Tensor, builtins.bool, builtins.int, builtins.float, str, type(None), tuple, list, dict,
          np.ndarray, complex, bytes)
_NAMED = (types.FunctionType, types.BuiltinFunctionType, type, types.ModuleType)
_MAX_WALKED = 64    # functions walked for reads, per compiled function (deep call trees stop here)


def _is_library(v) -> bool:
    """A module, function or class of the standard library, numpy or stax: not the user's code."""
    if not isinstance(v, _NAMED):
        return False
    name = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
    return isinstance(name, str) and name.partition(".")[0] in _LIBRARY_ROOTS


@dataclass(frozen=True, eq=False)
class _Read:
    """One value the function reads: `root` (a globals dict, a closure cell, the object bound
    to `self`, or the position of an argument), then the attributes `attrs`. `base` is the
    variable's name, for the log."""
    root: object
    kind: str           # "global", "closure", "object" or "argument" (root: its position or None)
    key: str            # the global's or the argument's name (kinds "global", "argument")
    attrs: tuple
    base: str

    @property
    def name(self) -> str:
        return ".".join((self.base,) + self.attrs)

    @property
    def sig(self) -> tuple:
        return ("argument" if self.kind == "argument" else id(self.root), self.key, self.attrs)

    def prefix(self, k: int):
        return _Read(self.root, self.kind, self.key, self.attrs[:k], self.base)

    def value(self, call=None):
        """The value now; for an attribute of an argument, of the call `call` = (args, kwargs)."""
        if self.kind == "argument":
            v = self.argument(call)
            if v is _IN_KEY:
                return v
        elif self.kind == "global":
            v = self.root.get(self.key, _MISS)
            if not self.attrs:
                return v
        elif self.kind == "closure":
            try:
                v = self.root.cell_contents
            except ValueError:      # an empty cell: the variable is not assigned yet
                return _MISS
        else:
            v = self.root
        for a in self.attrs:
            if v is _MISS:
                break
            v = getattr(v, a, _MISS)
        return v

    def argument(self, call):
        """The argument itself; _IN_KEY when the key already covers it (a tensor, a scalar, a
        container, an array: their attributes are metadata or methods, never guarded apart)."""
        if call is None:
            return _MISS
        args, kwargs = call
        v = args[self.root] if self.root is not None and self.root < len(args) else kwargs.get(self.key, _MISS)
        return _IN_KEY if isinstance(v, _KEYED) else v


def _chains(code):
    """(root load instruction, attribute names) for each `X.a.b` (or plain `X`) load in `code`."""
    out, chain = [], None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            chain[1].append(ins.argval)
            continue
        if chain is not None:
            out.append((chain[0], tuple(chain[1])))
            chain = None
        if ins.opname in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FAST"):
            chain = (ins, [])
    if chain is not None:
        out.append((chain[0], tuple(chain[1])))
    return out


def _params(fn) -> dict:
    """The compiled function's parameter names -> position in a call's args (None: keyword-only)."""
    bound = isinstance(fn, types.MethodType)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return {}
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return {n: (i - bound if i < code.co_argcount else None) for i, n in enumerate(names) if i >= bound}


def _walk(fn, self_read, found: dict, walked: set, params=None):
    """Add the reads of function `fn` and of its nested code (lambdas, comprehensions) to `found`;
    `params` (the compiled function only): its parameters, whose attributes are reads too."""
    if isinstance(fn, types.MethodType):
        fn, self_read = fn.__func__, self_read or _Read(fn.__self__, "object", "", (), "self")
    fn = getattr(fn, "fn", fn)      # a CompiledFunction called inside is inlined: walk its function
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in walked or len(walked) >= _MAX_WALKED or _is_library(fn):
        return
    walked.add(id(fn))
    glob, cells = fn.__globals__, dict(zip(code.co_freevars, fn.__closure__ or ()))
    self_name = code.co_varnames[0] if self_read is not None and code.co_argcount else None
    codes = [code]
    while codes:
        c = codes.pop()
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        for ins, attrs in _chains(c):
            name, read = ins.argval, None
            if ins.opname == "LOAD_GLOBAL" and (name in glob or not hasattr(builtins, name)):
                read = _Read(glob, "global", name, attrs, name)
            elif ins.opname == "LOAD_FAST" and c is code and name == self_name:
                read = _Read(self_read.root, self_read.kind, self_read.key, self_read.attrs + attrs,
                             self_read.base)
            elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and name in cells:
                read = _Read(cells[name], "closure", "", attrs, name)
            elif ins.opname == "LOAD_FAST" and c is code and params and name in params and attrs:
                for k in range(1, len(attrs) + 1):      # `m.cfg`, `m.cfg.eps` of an argument `m`
                    part = _Read(params[name], "argument", name, attrs[:k], name)
                    found.setdefault(part.sig, part)
            if read is not None:    # (else a builtin, a local, or a cell of fn's own)
                _add_read(read, found, walked)


def _add_read(read, found, walked):
    """Record `read` and its prefixes (`cfg`, `cfg.eps`), and walk the functions they name."""
    for k in range(len(read.attrs) + 1):
        part = read.prefix(k)
        v = part.value()
        if _is_library(v):
            return                  # stax.relu, math.pi, np.float32: library code, not guarded
        found.setdefault(part.sig, part)
        if isinstance(v, types.MethodType):
            _walk(v, part.prefix(k - 1) if k else None, found, walked)
        elif isinstance(v, types.FunctionType) or isinstance(v, CompiledFunction):
            _walk(v, None, found, walked)


def _reads_of(fn) -> tuple:
    found: dict = {}
    _walk(fn, None, found, set(), _params(getattr(fn, "fn", fn)))
    return tuple(found.values())


def _guard_key(v, lifted: list):
    """What the compiled code depends on in a value read from a global, closure or attribute."""
    cls = v.__class__
    if cls is builtins.int or cls is builtins.bool or (cls is builtins.float and v == v and v != 0):
        return (cls.__name__, v)        # (the common cases first: this runs on every call)
    if isinstance(v, Tensor):
        for k, t in enumerate(lifted):
            if t is v:
                return ("the same tensor as", k)
        lifted.append(v)
        m = v._meta
        return ("tensor", m.dtype.name, m.device, m.shape, m.stride)
    if isinstance(v, _PLAIN):
        return key_of(v)
    if isinstance(v, (complex, bytes)):
        return (type(v).__name__, v)
    if isinstance(v, np.ndarray):
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_frozen_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _frozen_key(x)) for k, x in v.items()))
    if isinstance(v, (_NAMED, types.MethodType, CompiledFunction)):
        return ("identity", id(getattr(v, "__func__", v)), id(getattr(v, "__self__", None)))
    return ("unbound",) if v is _MISS else None   # other objects: the attributes read are guarded


def _frozen_key(v):
    """A value inside a container the function reads: tensors in it are frozen constants of the
    compiled code, guarded by identity (the entry keeps them alive, so ids stay unique)."""
    if isinstance(v, Tensor):
        m = v._meta
        return ("tensor object", id(v), m.dtype.name, m.device, m.shape, m.stride)
    return _guard_key(v, [])


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
    backward: object = None     # §5: inputs that require grad: the backward's Generated
    partition: object = None    # §5: partition.Partition (the saved set)

    def __str__(self):
        return str(self.module) if self.module is not None else \
            "\n\n".join(self.kernels.values()) + "\n\n" + self.wrapper


def _compile_graph(graph, device: str, name: str, use_cache: bool = False, values=None) -> Generated:
    """Lower, schedule and print one captured graph, or find its module in the artifact cache.
    `values`: the call, (args, kwargs), whose tensors' values the attention rewrite may specialize
    on (graph.value_guards, which the caller checks: runtime.guard_values); None: none."""
    from . import runtime
    cuda = device.startswith("cuda")
    if cuda:                         # §9.10: hand-written attention becomes the flash template
        from .fuse_attention import fuse_attention
        graph = fuse_attention(graph, values)
    _log("graph", name, graph.format())
    path = runtime.artifact_path(graph, device, _target(device)) if use_cache else None
    if path is not None and not (_logs() & {"ir", "schedule"}) and not _OBSERVERS:   # a miss reads the remote level
        module = runtime.load_artifact(path)
        if module is not None:
            _log("kernels", name, "\n".join(module.kernels.values()) or "(no kernels)")
            _log("wrapper", name, module.wrapper)
            note = "(from the artifact cache: lowering and scheduling were skipped)"
            return Generated(dict(module.kernels), module.wrapper, graph, note, note, module)
    if cuda and use_cache:           # kernels will compile: triton's setup overlaps the lowering
        from .cuda_triton import warm_compiler
        warm_compiler()
    from . import ir, lower, schedule
    if cuda:
        from . import codegen_triton as backend
    else:
        from . import codegen_cpp as backend
    lowered = lower.lower(graph, split_policy=backend.split_policy,
                          outer_split_policy=getattr(backend, "outer_split_policy", None),
                          deviation_piece=getattr(backend, "deviation_piece", None),
                          operand_strides=getattr(backend, "operand_strides", None))
    ir_text = ir.format_ir(lowered)
    _log("ir", name, ir_text)
    sched = schedule.schedule(lowered, template=getattr(backend, "template_applies", None),
                              cross=getattr(backend, "CROSS_REDUCTIONS", False))
    sched_text = schedule.format_schedule(sched)
    _log("schedule", name, sched_text)
    module = backend.generate(sched)
    _log("kernels", name, "\n".join(module.kernels.values()) or "(no kernels)")
    _log("wrapper", name, module.wrapper)
    if path is not None:
        runtime.save_artifact(path, module)
    gen = Generated(dict(module.kernels), module.wrapper, graph, ir_text, sched_text, module)
    for observe in _OBSERVERS:
        observe("generated", name, gen)
    return gen


def _target(device: str) -> str:
    """The device facts a back end's decisions depend on (threads for Alg. 6.1 on the CPU, SMs on the GPU)."""
    if device.startswith("cuda"):
        from . import cuda
        from .triton_kernel import debug_index_checks
        from .cublas import available
        debug = ",debug_index" if debug_index_checks() else ""    # kernels with device asserts
        debug += ",cublaslt" if available() else ""               # §9.8: the extern candidate printed
        from .triton_outer import one_kernel_mode
        split = one_kernel_mode()                                 # §6.5 STAX_SPLIT_ONE_KERNEL
        debug += "" if split == "outer" else f",one_kernel_split={split}"
        if cuda.is_available():
            p = cuda.get_device_properties()
            return f"sm={p.sm_count},cc={p.cc},mm={_tuning._precision[0]}{debug}"
        return f"sm=132,cc=(9, 0),mm={_tuning._precision[0]}{debug}"
    return f"threads={get_num_threads()}"


def _device_of(args) -> str:
    devs = {str(a.device) for a in args if isinstance(a, Tensor)}
    return devs.pop() if len(devs) == 1 else "cpu"


def generate(fn, *example_inputs, device: str | None = None, **kwargs) -> Generated:
    """The code `stax.compile(fn)` would run on these inputs, without running it."""
    from .capture import capture
    name, device = getattr(fn, "__name__", "fn"), device or _device_of(example_inputs)
    if _needs_grad(example_inputs) or (kwargs and _needs_grad(list(kwargs.values()))):
        from . import aot_autograd       # §5: the forward's code, the backward's as .backward
        return aot_autograd.generate(getattr(fn, "fn", fn), example_inputs, kwargs, device, name, _compile_graph)
    graph, _ = capture(fn, list(example_inputs), kwargs)
    return _compile_graph(graph, device, name, values=(example_inputs, kwargs))


class CompiledFunction:
    """`stax.compile(fn)`: one artifact per specialization key, guarded and cached.

    The key covers the arguments and what the function reads besides them (`_reads_of`). Threads
    may call one CompiledFunction at once: a miss compiles under the function's lock, so one key
    is compiled once; different functions compile concurrently.
    """

    def __init__(self, fn, fullgraph: bool, mode, options, dynamic=False, strict_native=False):
        functools.update_wrapper(self, fn)
        self.fn, self.fullgraph, self.mode, self.options = fn, fullgraph, mode, options or {}
        self.strict_native = strict_native  # raise where a region would run as a host fallback (§6.1)
        self.dynamic = dynamic          # False: sizes in the key; True: ranks (§10.4); None: automatic
        self.guarded: dict = {}         # rank key -> [(guard function, entry)], tried in turn (§10.4)
        self.seen_shapes: dict = {}     # rank key -> the input shapes of its first static compile
        self.auto_dims: dict = {}       # rank key -> {input position: dims that changed}
        self.scalars: dict = {}         # float argument (position or keyword) -> its name, run-time (§10.4)
        self.scalar_first: dict = {}    # float argument -> the key of its first value (automatic mode)
        self.scalar_static: set = set() # float arguments the function reads as numbers: keyed by value
        self.ndarrays = False           # a call has passed an ndarray argument (numpy_args.py)
        self.artifacts: dict = {}       # key -> (call, output spec, flat, constants, lifts, reads) or None: eager
        self.constants: dict = {}       # key -> real tensors the function closed over (lifted inputs)
        self.reads = None               # what the function reads besides its arguments (`_Read`s)
        self.stats = {"compiles": 0, "calls": 0, "eager_calls": 0, "compile_seconds": 0.0}
        self.last_generated = None
        self.last_inputs = None         # (args, kwargs) of the last call, only under `python -m stax run`
        self.last_key = None            # the static key of the call last compiled (for the recompiles log)
        self._warned: set = set()       # the §2.4 limits each warn once
        self._fast = None               # the last call's specialize.LastCall
        self._lock = threading.RLock()
        self._precision = _tuning._precision[0]    # §9.8: the float32 matmul precision compiled for
        self.by_value = True            # §9.10: a mask may be found causal by its values (guarded)
        if _RUN_REGISTRY is not None:
            _RUN_REGISTRY.append(self)

    def _key(self, args, kwargs, lifted, alias, key_of=key_of, train=()):
        """The key of a call; `train` (§5: which inputs require grad) leads a training call's key,
        whose floats are keyed by value (the joint graph bakes them in)."""
        key = train + tuple([key_of(a) for a in args])
        if kwargs:
            key += tuple((k, key_of(v)) for k, v in sorted(kwargs.items()))
        if self.scalars and not train:          # run-time floats: any value (§10.4)
            key = _scalar_key(key, args, kwargs, tuple(self.scalars))   # (another thread may add one)
        if self.ndarrays:                       # which tensors are ndarray arguments (numpy_args.py)
            key += (("ndarrays",) + _capture.ndarray_marks(args, kwargs),)
        if alias is not None:                   # which tensor inputs share memory, and how
            key += (alias.pattern,)
        if self.reads:
            call = (args, kwargs)
            key += (("reads",) + tuple([_guard_key(r.value(call), lifted) for r in self.reads]),)
        return key

    def _note_floats(self, floats):
        """§10.4: a float argument is passed to the kernels at run time from its first call
        (dynamic=True) or from the first call that passes another value (automatic dynamic);
        one artifact then serves every value. One the function reads as a Python number stays
        keyed by value (`scalar_static`)."""
        for where, v in floats:
            if where in self.scalars or where in self.scalar_static:
                continue
            if self.dynamic is None:
                first = self.scalar_first.setdefault(where, key_of(v))
                if first == key_of(v):
                    continue
            with self._lock:
                base = where if isinstance(where, str) else \
                    next((n for n, p in _params(self.fn).items() if p == where), str(where))
                name = "scalar_" + re.sub(r"[^A-Za-z0-9_]", "_", base)
                self.scalars[where] = name if name not in self.scalars.values() else f"{name}_{len(self.scalars)}"
            _log("recompiles", getattr(self.fn, "__name__", "fn"), f"float argument {where!r} changed "
                 f"value: passed to the kernels at run time from now on ({self.scalars[where]})")

    def _scalar_args(self, args, kwargs) -> list:
        """(where, name) of the run-time float arguments of this call, in the kernels' order."""
        floats = floats_of(args, kwargs)
        return [(w, self.scalars[w]) for w, _ in floats if w in self.scalars]

    def __call__(self, *args, **kwargs):
        self.stats["calls"] += 1
        try:
            fast = self._fast
            if fast is not None and not kwargs:
                hot = fast.hot          # §9.9: a CUDA graph's replay of the last call's very tensors
                # (the checks of `_call_again`, in line; cudagraph_c.install_entry: the same in C)
                if hot is not None and fast.reads is self.reads and _TLS.tracer is None and _tuning._precision[0] is self._precision:
                    if (outs := hot(args, autograd._mode.enabled)).__class__ is tuple:
                        return outs[0] if fast.spec is None else fast.result(outs, args)
                out = self._call_again(fast, args)
                if out is not _MISS:
                    return out
            if current_tracer() is not None:    # called from inside another compiled function: inline it
                return self.fn(*args, **kwargs)
            return self._call(args, kwargs)
        except _capture.ValuesChanged as e:     # §9.10 (raised before any kernel ran)
            self._values_changed(str(e))
            self.stats["calls"] -= 1
            return self(*args, **kwargs)

    def _call(self, args, kwargs):
        self._prepare(args, kwargs)
        if _needs_grad(args) or (kwargs and _needs_grad(list(kwargs.values()))):
            return self._call_training(args, kwargs)    # §5: a forward and a backward artifact
        called = (args, kwargs)                 # (what eager runs: the ndarrays themselves)
        converted = _capture.ndarray_inputs(args, kwargs)
        if converted is not None:               # ndarray arguments: zero-copy tensor inputs
            self.ndarrays = True
            args, kwargs = converted
            args = tuple(args)
        alias = _capture.call_aliasing(args, kwargs)    # None unless two tensor inputs share memory
        if self.dynamic is not False:
            floats = floats_of(args, kwargs)
            if floats:
                self._note_floats(floats)
        while True:
            try:
                entry, lifted = self._entry(args, kwargs, alias)
                break
            except Rekey:                      # a float argument is now keyed by value
                continue
        if converted is None and not kwargs and entry is not None and _RUN_REGISTRY is None:
            self._remember(args, entry, alias)
        return self._run(entry, args, kwargs, lifted, alias, called)

    def _entry(self, args, kwargs, alias):
        """(entry, lifted: the tensors read from globals/closures/attributes), compiling on a miss."""
        lifted = []
        if self.dynamic is not False and alias is None:
            return self._lookup_dynamic(args, kwargs)
        key = self._key(args, kwargs, lifted, alias)
        entry = self.artifacts.get(key, _MISS)
        if entry is _MISS:
            with self._lock:
                entry, key, lifted = self._compile(key, args, kwargs, lifted)
        return entry, lifted

    def _remember(self, args, entry, alias):
        """Keep this call's tensors (weakly, `specialize.LastCall`) for `_call_again`, when every
        argument is a tensor and `entry` is stored (an artifact run without storing it, past the
        recompile limit, is compiled again on every call, and stays so)."""
        if builtins.any(a.__class__ is not Tensor for a in args):
            return
        stored = builtins.any(e is entry for e in self.artifacts.values()) or \
            builtins.any(e is entry for v in self.guarded.values() for _, e in v)
        if stored:
            # an argument's attributes are in the key (`_IN_KEY`) when the arguments are tensors
            live = tuple([r for r in self.reads if r.kind != "argument"])
            key = tuple([_guard_key(r.value((args, {})), []) for r in live])
            self._fast = _LastCall(args, self.reads, live, key, entry, alias)

    def _call_again(self, fast, args):
        """The call with the very tensors of the last one, or with some replaced by tensors of the
        same layout (`LastCall.similar`): their key, aliasing and guards are the last call's; what
        can change between calls is checked again (the tracer, grad, the matmul precision, the
        values the function reads besides its arguments). _MISS: the full path."""
        if fast.reads is not self.reads or _TLS.tracer is not None or _tuning._precision[0] is not self._precision:
            return _MISS
        grad = autograd._mode.enabled
        if not fast.same(args, grad):   # a new batch: its own memo if its key is the same
            if (fast := fast.similar(args, grad, self.ndarrays)) is None:
                return _MISS
            self._fast = fast
        lifted = []
        if fast.live and tuple([_guard_key(r.value((args, {})), lifted) for r in fast.live]) != fast.key:
            return _MISS
        if fast.call is not None and not lifted:
            return fast.run(args)
        return self._run(fast.entry, args, {}, lifted, fast.alias)

    def _prepare(self, args, kwargs):
        """Before a call looks up its artifact: the CLI's record of the inputs, a changed matmul
        precision (compile again), and on the first call the reads to guard."""
        if _RUN_REGISTRY is not None:
            self.last_inputs = (args, kwargs)
        if _tuning._precision[0] is not self._precision:
            self._precision_changed()
        if self.reads is None:
            with self._lock:
                if self.reads is None:
                    self.reads = _reads_of(self.fn)

    def _call_training(self, args, kwargs):
        """§5: inputs require grad: the joint graph's forward artifact, its results wired into
        autograd (aot_autograd.py). The key also holds which inputs require grad; dynamic and
        automatic dynamic mode look the entry up as inference does (§10.4, aot_dynamic.py)."""
        from . import aot_autograd
        lifted, alias = [], _capture.call_aliasing(args, kwargs)
        train = ("requires_grad", tuple(t.requires_grad for t in _capture.input_tensors(args, kwargs)))
        if self.dynamic is False or alias is not None:
            key = self._key(args, kwargs, lifted, alias, train=train)
            entry = self.artifacts.get(key, _MISS)
        else:
            entry, lifted = self._lookup_dynamic(args, kwargs, train)
        if entry is _MISS:
            with self._lock:
                entry = self.artifacts.get(key, _MISS)
                if entry is _MISS:
                    name = getattr(self.fn, "__name__", "fn")
                    admit = self._admit(name, "new inputs that require grad")
                    entry = None if admit == "eager" else self._build_training(key, args, kwargs, lifted, name)
                    if admit != "run":
                        self.artifacts[key] = entry
        if entry is None or alias is not None or (lifted and _needs_grad(lifted)):
            self.stats["eager_calls"] += 1
            return self.fn(*args, **kwargs)
        consts = list(entry.consts)
        for pos, k in getattr(entry, "lifts", ()):
            consts[pos] = lifted[k]
        return aot_autograd.run(entry, args, kwargs, consts, dynamic_inputs(args, kwargs) if entry.dyn else None)

    def _build_training(self, key, args, kwargs, lifted, name, dynamic=None):
        """Capture the joint graph, partition it, compile the forward (None: run eagerly).
        `dynamic`: (ShapeEnv, dims, sized ints): shape-polymorphic (aot_dynamic), with `.guard`."""
        from . import aot_autograd, aot_dynamic, runtime
        from .capture import GraphBreak
        why = "inputs that share memory" if _capture.call_aliasing(args, kwargs) is not None else \
            "a tensor it reads from a global, closure or attribute requires grad" if _needs_grad(lifted) else None
        if why:
            _log("graph", name, f"{why}: running eagerly under autograd (compiled training takes "
                 "the tensors that require grad as arguments)")
            return None
        t0 = time.perf_counter()
        try:
            dev = _device_of(args)
            how = (self.fn, args, kwargs, dev, name, _compile_graph,
                   lambda m: runtime.load_module(m, mode=None, options=self.options), _log)
            graphed = None if self.mode != "reduce-overhead" else lambda c, g, gen, n, keep: \
                self._graphed(c, g, gen, n, dev, self.dynamic is True, keep)
            if dynamic is not None and graphed is not None:
                _log("cudagraphs", name, f"{name}_forward and {name}_backward are not wrapped in CUDA "
                     "graphs: dynamic mode (one artifact serves many shapes, §9.9)")
            entry = aot_autograd.build(*how, graphed, self.by_value) if dynamic is None else \
                aot_dynamic.build(*how, *dynamic)
        except GraphBreak as e:
            if self.fullgraph:
                raise GraphBreak(f"stax.compile(fullgraph=True) cannot capture {name}: {e}") from None
            _log("graph", name, f"graph break, running eagerly: {e}")
            return None
        if self.strict_native:
            _check_native(entry.gen_forward, name)
        entry.lifts = [(pos, k) for pos, t in enumerate(entry.consts) for k, u in enumerate(lifted) if t is u]
        self.last_generated = entry.gen_forward
        self.stats["compiles"] += 1
        self.stats["compile_seconds"] += time.perf_counter() - t0
        return entry

    def _values_changed(self, why: str):
        """§9.10: a tensor an artifact was specialized on by its values changed: every artifact
        goes, and masks are data from now on (a mask that changes once may change again)."""
        self.by_value, self.last_key = False, None
        self._precision_changed(f"{why}: compiling again with masks as data")

    def _precision_changed(self, why=None):
        """set_float32_matmul_precision changed what the templates print (§9.8): compile again."""
        with self._lock:
            _log("recompiles", getattr(self.fn, "__name__", "fn"), why or
                 f"float32 matmul precision changed from {self._precision!r} to {_tuning._precision[0]!r}")
            self.artifacts.clear()
            self._fast = None
            self.constants.clear()
            self.guarded.clear()
            self._precision = _tuning._precision[0]

    def _run(self, entry, args, kwargs, lifted, alias, called=None):
        if entry is None or (lifted and _needs_grad(lifted)):
            self.stats["eager_calls"] += 1
            args, kwargs = called or (args, kwargs)
            return self.fn(*args, **kwargs)
        call, spec, flat, consts, lifts, _, floats = entry
        # the common call, tensors and scalars passed positionally, skips walking nested arguments
        inputs = [a for a in args if a.__class__ is Tensor] if flat is True and not kwargs else \
            _capture.input_tensors(args, kwargs)
        if flat == "sized":                     # a dynamic artifact: int arguments as carriers
            inputs = dynamic_inputs(args, kwargs)
        if lifts:                               # the tensors those names hold now, not at capture
            consts = list(consts)
            for pos, k in lifts:
                consts[pos] = lifted[k]
        if floats:                              # run-time float arguments, after the constants
            consts = list(consts) + [arg_at(args, kwargs, w) for w in floats]
        if alias is None:
            outs = call(inputs + consts)
            return _capture.unflatten(spec, iter(outs), inputs)
        outs = call(alias.call_inputs(inputs) + consts)
        return _capture.unflatten(spec, iter(outs), alias.sources(inputs))

    # ---- §10.4 dynamic mode: a rank key, several guarded artifacts under it ----

    def _lookup_dynamic(self, args, kwargs, train=()):
        """(entry, lifted) for a call in dynamic (or automatic) mode, compiling on a miss.
        `train`: the requires-grad part of a training call's keys (§5)."""
        lifted = []
        if self.dynamic is None:                # automatic: an exact static artifact first
            key = self._key(args, kwargs, lifted, None, train=train)
            entry = self.artifacts.get(key, _MISS)
            if entry is not _MISS:
                return entry, lifted
            lifted.clear()                      # (the rank key lists the same reads again)
        rkey = self._key(args, kwargs, lifted, None, rank_key_of, train)
        inputs = None
        for guard, entry in self.guarded.get(rkey, ()):
            inputs = inputs if inputs is not None else dynamic_inputs(args, kwargs)
            if guard(inputs):
                return entry, lifted
        with self._lock:
            lifted.clear()
            return self._compile_dynamic(args, kwargs, lifted, train), lifted

    def _compile_dynamic(self, args, kwargs, lifted, train=()):
        """Under the lock: the entry for a call no artifact's guards accept (`lifted` filled)."""
        self._reread()
        rkey = self._key(args, kwargs, lifted, None, rank_key_of, train)
        inputs = dynamic_inputs(args, kwargs)
        for guard, entry in self.guarded.get(rkey, ()):     # another thread may have compiled it
            if guard(inputs):
                return entry
        key = self._key(args, kwargs, [], None, train=train)    # this call's static key
        dims = None
        if self.dynamic is None:
            if key in self.artifacts:                       # another thread compiled it static
                return self.artifacts[key]
            dims = self._auto_dims(self._key(args, kwargs, [], None, family_key_of, train), inputs)
            if dims is None:            # the first call of its family (or no size changed): static
                return self._compile(key, args, kwargs, lifted)[0]
        name = getattr(self.fn, "__name__", "fn")
        change = self._describe(key) if self.last_key is not None else None
        _log("recompiles", name, f"recompiling {name}: {change}; sizes that changed become symbols "
             f"({describe_dims(dims, sized_ints(args, kwargs))})" if change and dims is not None else
             f"recompiling {name}: {change}" if change else f"compiling {name} with symbolic sizes")
        admit = self._admit(name, change or "new sizes")
        if admit == "eager":
            self.guarded.setdefault(rkey, []).append((lambda inputs: True, None))
            return None
        self.last_key = key
        sized = sized_ints(args, kwargs)
        dims = dynamic_dims(args, kwargs, dims, len(sized))
        guard, entry = self._build_dynamic(args, kwargs, lifted, name, dims, inputs, sized, train)
        if admit == "store":
            self.guarded.setdefault(rkey, []).append((guard, entry))
        return entry

    def _auto_dims(self, family, inputs):
        """Automatic dynamic: None on the first call of a family (same dtypes, devices, ranks and
        reads; compile it static); after that, {input position: dims} whose sizes changed since
        the first call (accumulated), plus those marked dynamic; None while there are none."""
        shapes = [tuple(t.shape) for t in inputs]
        first = self.seen_shapes.setdefault(family, shapes)
        dims = self.auto_dims.setdefault(family, {})
        for p, (t, shape) in enumerate(zip(inputs, shapes)):
            changed = {d for d in range(len(shape)) if shape[d] != first[p][d]}
            static = set(getattr(t, "_stax_static", ()))
            dims[p] = sorted((set(dims.get(p, ())) | changed | set(getattr(t, "_stax_dynamic", ()))) - static)
        return dims if builtins.any(dims.values()) else None

    def _build_dynamic(self, args, kwargs, lifted, name, dims, inputs, sized, train=()):
        """Capture with symbolic sizes, compile, and build the guard function (§10.4)."""
        from . import dynshape, runtime
        t0 = time.perf_counter()
        env = dynshape.ShapeEnv(padding=self.options.get("shape_padding"))     # Prop. 10.3 buckets
        if train:                               # §5: a shape-polymorphic forward/backward pair
            entry = self._build_training(None, args, kwargs, lifted, name, (env, dims, sized))
            return getattr(entry, "guard", lambda inputs: True), entry
        captured = self._capture(name, args, kwargs, shape_env=env, dynamic_dims=dims, sized_ints=sized,
                                 scalar_args=self._scalar_args(args, kwargs))
        if captured is None:
            return (lambda inputs: True), None
        graph, spec = captured
        layouts = [(n.meta.shape, n.meta.stride) for n in graph.inputs if n.op == "placeholder"]
        if _device_of(args).startswith("cuda"):     # §10.3: int32 indices, guarded, where the hints allow
            graph.index32 = env.index32(_capture.tensor_layouts(graph))
        source = env.guard_source(layouts)
        scope: dict = {}
        exec(compile_source(source, f"<stax guard of {name}>"), scope)
        guard = scope["guard"]
        if not guard(inputs):
            raise RuntimeError(f"stax internal error: the guards of {name} do not hold for the "
                               f"inputs they were captured on:\n{source}")
        gen = _compile_graph(graph, _device_of(args), name, use_cache=True)
        if self.strict_native:
            _check_native(gen, name)
        call = runtime.load_module(gen.module, mode=self.mode, options=self.options)
        call = runtime.guard_values(self._graphed(call, graph, gen, name, _device_of(args), dynamic=True), graph)
        consts = [graph.constants[n.name] for n in graph.inputs if n.op == "constant"]
        lifts = [(pos, k) for pos, t in enumerate(consts) for k, u in enumerate(lifted) if t is u]
        self.last_generated = gen
        self.stats["compiles"] += 1
        self.stats["compile_seconds"] += time.perf_counter() - t0
        _log("guards", name, source)
        return guard, (call, spec, "sized", consts, lifts, [r.value((args, kwargs)) for r in self.reads],
                       [w for w, _ in self._scalar_args(args, kwargs)])

    def _compile(self, key, args, kwargs, lifted):
        """Under the lock: (entry, key, lifted), compiling unless another thread just did."""
        entry = self.artifacts.get(key, _MISS)
        if entry is not _MISS:
            return entry, key, lifted
        if self._reread():                      # a function read was rebound: key it again
            lifted = []
            key = self._key(args, kwargs, lifted, _capture.call_aliasing(args, kwargs))
            entry = self.artifacts.get(key, _MISS)
            if entry is not _MISS:
                return entry, key, lifted
        name = getattr(self.fn, "__name__", "fn")
        change = self._describe(key) if self.last_key is not None else None
        if change:
            _log("recompiles", name, f"recompiling {name}: {change}")
        admit = self._admit(name, change or "a new specialization")
        if admit == "eager":
            self.artifacts[key] = None
            return None, key, lifted
        self.last_key = key
        entry = self._build(key, args, kwargs, lifted, name)
        if admit == "store":
            self.artifacts[key] = entry
        return entry, key, lifted

    def _reread(self) -> bool:
        """Walk the function's reads again (a function it calls may have been rebound): changed?"""
        reads = _reads_of(self.fn)
        if [r.sig for r in reads] == [r.sig for r in self.reads]:
            return False
        self.reads = reads
        return True

    def _admit(self, name, change) -> str:
        """§2.4 limits on a miss: "store" the new artifact; "run" it without storing it, once
        RECOMPILE_LIMIT artifacts are stored (fullgraph=True raises there); "eager" once the
        function has compiled COMPILE_LIMIT times in all. Each limit warns once."""
        stored = builtins.sum(e is not None for e in self.artifacts.values()) + \
            builtins.sum(e is not None for v in self.guarded.values() for _, e in v)
        if stored < RECOMPILE_LIMIT:
            return "store"
        msg = f"stax.compile: {name} hit the recompile limit ({RECOMPILE_LIMIT} specializations); " \
              f"last change: {change}"
        if self.fullgraph:
            raise RuntimeError(msg + ". Pass inputs of fewer distinct shapes/dtypes, use dynamic=True, "
                               "or drop fullgraph=True.")
        if self.stats["compiles"] >= COMPILE_LIMIT:
            if "eager" not in self._warned:
                self._warned.add("eager")
                warnings.warn(f"stax.compile: {name} compiled {COMPILE_LIMIT} times (the cumulative "
                              f"limit, stax.COMPILE_LIMIT); running eagerly from now on for new inputs "
                              f"(last change: {change}).", stacklevel=user_stacklevel())
            return "eager"
        if "run" not in self._warned:
            self._warned.add("run")
            warnings.warn(msg + "; a new specialization is compiled on each miss and not kept, up to "
                          f"{COMPILE_LIMIT} compiles in all (then eager). dynamic=True or fewer "
                          "distinct shapes/dtypes avoids it.", stacklevel=user_stacklevel())
        return "run"

    def _describe(self, key) -> str:
        old = self.last_key
        if old == key:
            return f"the artifact for these inputs was not kept (past the recompile limit, {RECOMPILE_LIMIT})"
        if old[:2] == key[:2] and old[:1] == ("requires_grad",):    # (§5: count the arguments from 0)
            old, key = old[2:], key[2:]
        if old[-1:] and key[-1:] and old[-1][:1] == ("reads",) == key[-1][:1] and old[:-1] == key[:-1]:
            return describe_read_change(self.reads, old[-1], key[-1]) or describe_change(old, key)
        return describe_change(old, key)

    def _capture(self, name, args, kwargs, **how):
        """(graph, spec), or None after a graph break (logged; fullgraph=True raises instead)."""
        from .capture import GraphBreak, SpecializeScalar, capture
        try:
            return capture(self.fn, list(args), kwargs, **how)
        except SpecializeScalar as e:           # §10.4: a float read as a number: key it by value
            for where in e.wheres:
                self.scalars.pop(where, None)
                self.scalar_static.add(where)
            _log("recompiles", name, f"{e}: specialized, keyed by value from now on")
            raise Rekey() from None
        except GraphBreak as e:
            if self.fullgraph:
                raise GraphBreak(f"stax.compile(fullgraph=True) cannot capture {name}: {e}. "
                                 "Replace the data-dependent branch with stax.where(...), or drop "
                                 "fullgraph=True to run the function eagerly.") from None
            _log("graph", name, f"graph break, running eagerly: {e}")
            return None

    def _build(self, key, args, kwargs, lifted, name):
        """Capture, compile and load one specialization: its artifact entry (None: run eagerly)."""
        if key[:1] == ("requires_grad",):       # automatic dynamic's first training call (§5)
            return self._build_training(key, args, kwargs, lifted, name)
        t0 = time.perf_counter()
        captured = self._capture(name, args, kwargs, scalar_args=self._scalar_args(args, kwargs))
        if captured is None:
            return None
        graph, spec = captured
        gen = _compile_graph(graph, _device_of(args), name, use_cache=True,
                             values=(args, kwargs) if self.by_value else None)
        if self.strict_native:
            _check_native(gen, name)
        from . import runtime
        call = runtime.load_module(gen.module, mode=self.mode, options=self.options)
        call = self._graphed(call, graph, gen, name, _device_of(args), dynamic=builtins.bool(graph.scalars))
        call = runtime.guard_values(call, graph)    # §9.10: values guarded, write-backs counted
        consts = [graph.constants[n.name] for n in graph.inputs if n.op == "constant"]
        # a constant that is a tensor read from a global/closure/attribute is fed from it each call
        lifts = [(pos, k) for pos, t in enumerate(consts) for k, u in enumerate(lifted) if t is u]
        self.constants[key] = consts
        flat = _flat(args)
        self.last_generated = gen
        self.stats["compiles"] += 1
        self.stats["compile_seconds"] += time.perf_counter() - t0
        args_key, reads_key = (key[:-1], key[-1][1:]) if self.reads else (key, ())
        _log("guards", name, "specialized on: " + "; ".join(repr(k) for k in args_key) +
             "".join(f"\n  {r.name}: {k!r:.100}" for r, k in zip(self.reads, reads_key)))
        # the values read are kept alive: a function or object guarded by id keeps its id unique
        return (call, spec, flat, consts, lifts, [r.value((args, kwargs)) for r in self.reads],
                [w for w, _ in self._scalar_args(args, kwargs)])

    def _graphed(self, call, graph, gen, name, device, dynamic, keep_outputs=False):
        """§9.9: under mode='reduce-overhead', `call` replayed from a CUDA graph where it may be."""
        if self.mode != "reduce-overhead":
            return call
        from . import cudagraph, cudagraph_c
        wrapped = cudagraph.wrap(call, graph, gen.module, name=name, device=device, dynamic=dynamic, log=_log,
                                 keep_outputs=keep_outputs)
        cudagraph_c.install_entry(CompiledFunction, _TLS, _tuning._precision, autograd._mode, _LastCall)  # (once built)
        return wrapped


_EXTERN_CALL = re.compile(r"= extern_kernel\('(\w+)'")


def _check_native(gen, name):
    """strict_native=True (§10.4, §11.3): a region Stax cannot generate code for runs its eager
    implementation on the host (an `extern_kernel` line in the wrapper): raise instead."""
    ops = sorted(set(_EXTERN_CALL.findall(gen.wrapper)))
    if ops:
        raise RuntimeError(f"stax.compile(strict_native=True): {name} needs host fallback kernels "
                           f"for {', '.join(ops)} (no generated code for them on this back end); "
                           "drop strict_native=True to run them with their eager implementation")


def explain(fn, *inputs, timing: bool = True, **kwargs):
    """What `stax.compile(fn)` does on these inputs, as an object for notebooks: the fusion graph,
    the kernels (each line tied to its graph node), the IR, the wrapper, the guards and, with
    `timing`, each kernel's time and a roofline (`report.Explanation`; Jupyter shows its page
    inline, `.to_html()` is the page `python -m stax report` writes). Compiles fn afresh (a
    CompiledFunction keeps its options) and runs it once on the inputs."""
    from . import report
    if isinstance(fn, CompiledFunction):
        f = CompiledFunction(fn.fn, fn.fullgraph, fn.mode, fn.options, fn.dynamic, fn.strict_native)
    else:
        f = CompiledFunction(fn, False, None, None, None)
    recorder = report.Recorder()
    _OBSERVERS.append(recorder)
    try:
        f(*inputs, **kwargs)
    finally:
        _OBSERVERS.remove(recorder)
        recorder.close()
    f.last_inputs = (inputs, kwargs)
    return report.explain_functions([f], recorder, timing=timing, device=_device_of(inputs))


def _flat(args) -> bool:
    """Tensors and plain scalars only, passed positionally: a call's tensors need no walk."""
    return builtins.all(a.__class__ is Tensor or isinstance(a, (builtins.bool, builtins.int, builtins.float,
                                                       str, type(None))) for a in args)


def compile_source(source: str, filename: str):
    """Python's builtin compile (this module's `compile` is stax.compile)."""
    return builtins.compile(source, filename, "exec")


def compile(fn=None, *, dynamic: bool | None = None, fullgraph: bool = False, mode=None, options=None,
            strict_native: bool = False):
    """Compile `fn` (also usable as `@stax.compile` and `@stax.compile(...)`).

    dynamic: None (the default): automatic dynamic (§10.4): the first call compiles static; a
             later call that differs only in sizes compiles one artifact in which the dims that
             changed are symbols, and it serves every later size (0 and 1 stay specialized).
             False: one specialization per input shape (the key holds sizes and strides).
             True: every size is a symbol from the first call: the key holds ranks, and each
             artifact carries a guard function on the layouts it serves (STAX_LOGS=guards).
             Limits (§2.4): past RECOMPILE_LIMIT kept artifacts a miss compiles without keeping
             the artifact (fullgraph=True raises); past COMPILE_LIMIT compiles, a miss runs eagerly.
    fullgraph: raise instead of running eagerly when the function cannot be captured whole.
    strict_native: raise instead of running a region with no generated code (a §6.1 fallback
             such as matmul on the CPU, nonzero, unique, rand) with its eager implementation.
    options: {"shape_padding": "pow2"} (Prop. 10.3): each symbolic size gets the artifact of its
             power-of-two bucket, whose kernels mask up to the bucket's end (persistent reductions
             where it is short enough); [m, M] needs at most ceil(log2 M) - floor(log2 m) + 1.
    mode: None/"default"; "reduce-overhead" replays each GPU artifact from a CUDA graph (§9.9,
          cudagraph.py: a replay's outputs are overwritten by the next call, so `.clone()` what
          you keep); "max-autotune" searches launch configurations further (§9.6);
          "max-autotune-no-cudagraphs" is accepted as PyTorch spells it. The CPU back end runs
          its code as usual in every mode (reduce-overhead says so once, STAX_LOGS=cudagraphs).
    """
    if dynamic not in (None, True, False):
        raise ValueError(f"stax.compile: dynamic must be None, True or False, got {dynamic!r}")
    if mode not in MODES:
        raise ValueError(f"stax.compile: unknown mode {mode!r}; choose one of "
                         + ", ".join(repr(m) for m in MODES))
    if (options or {}).get("shape_padding") not in (None, "pow2"):
        raise ValueError(f"stax.compile: options['shape_padding'] must be 'pow2' (Prop. 10.3 buckets) "
                         f"or None, got {options['shape_padding']!r}")
    if (options or {}).get("shape_padding") and dynamic is False:
        raise ValueError("stax.compile: shape_padding buckets the dims that are symbols; pass "
                         "dynamic=True (or None) with it")
    if fn is None:
        return lambda f: compile(f, dynamic=dynamic, fullgraph=fullgraph, mode=mode, options=options,
                                 strict_native=strict_native)
    if not callable(fn):
        raise TypeError(f"stax.compile expects a function, got {type(fn).__name__}")
    return CompiledFunction(fn, fullgraph, mode, options, dynamic, strict_native)


# ---- Discovery: dir(stax) lists the public API; a missing op names what works ----

# §10.2 export (stax/export.py) is loaded on first use: it needs sympy, which `import stax` avoids
_EXPORT_NAMES = ("export", "Dim", "make_graph", "ExportedProgram", "ConstraintViolation")
_PUBLIC_EXTRAS = ["compile", "generate", "Generated", "CompiledFunction", "mark_dynamic", "mark_static",
                  "empty_cache", "memory_stats", "reset_peak_memory_stats", "nn", "optim", "RECOMPILE_LIMIT",
                  "COMPILE_LIMIT",
                  "explain", "autograd", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
                  "inference_mode", "scaled_dot_product_attention", "omni_attention",
                  "create_block_mask", "BlockMask", "attention_forward", "attention_backward", "conv2d",
                  *_EXPORT_NAMES]
# (`from stax import *` must not shadow the builtins bool, int, float: those aliases are in dir only)
__all__ = sorted((set(sys.modules[__name__ + ".tensor"].__all__) |   # (stax.tensor is the function)
                  set(_tensor_ops_mod.__all__) | set(_shape_ops_mod.__all__) | set(_math_ops_mod.__all__) |
                  set(_indexing_mod.__all__) | set(_ALIASES) | set(_PUBLIC_EXTRAS)) - {"bool", "int", "float"})


def __dir__():
    return sorted(__all__ + ["bool", "int", "float"])


def __getattr__(name):
    import importlib
    if name == "nn":        # stax.nn (PyTorch's spelling torch.nn.functional), imported on first use
        return importlib.import_module(".nn", __name__)
    if name == "optim":     # stax.optim (torch.optim's SGD, AdamW), imported on first use
        return importlib.import_module(".optim", __name__)
    if name in _EXPORT_NAMES:           # (not `from . import export`: that asks this hook for it)
        module = importlib.import_module(".export", __package__)   # binds stax.export to the module: rebind
        globals().update({n: getattr(module, n) for n in _EXPORT_NAMES})
        return globals()[name]
    raise _math_ops_mod.missing_op("module 'stax'", name)
