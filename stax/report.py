"""See it: one HTML page per run with the fusion graph, the kernels and a roofline.

Layer: top, under ``__init__`` (``stax.explain``) and ``__main__`` (``python -m stax report``,
``python -m stax run``'s summary). Imports only lower layers; the compiled functions it is given
are used through their attributes (``fn``, ``stats``, ``artifacts``, ``last_inputs``).

Consumes: what a compile announces to ``stax._OBSERVERS`` (a ``Recorder``): the captured graph,
the IR, the schedule, each ``Generated`` module (§6-§9), the guards (§2, §10.4) and recompile
reasons; the printers that wrote each kernel (``printer.collect_printers``), whose variables know
the graph node they compute (``ir.with_origin``); the autotuning records in the cache (§9.6).
Produces: ``Explanation`` (``.functions``: per compiled function, per artifact, the kernels with
kind, chapter section, bytes, an op count and a measured time), its HTML (``to_html``, also
``_repr_html_`` for Jupyter), and the bytes-moved table of Prop. 1.1 (``traffic``).

Where to look:
  - ``traffic`` ................ bytes each kernel moves against Prop. 1.1's lower bound
  - ``kernel_form`` ............ a kernel's kind and the section of the chapter that builds it
  - ``line_origins`` ........... which graph node each line of a kernel comes from
  - ``time_kernels`` ........... each kernel's time inside a real call (the roofline's y)
  - ``measure_roofs`` .......... the machine's memory and compute roofs, measured here
  - ``report_html`` ............. the page and its two pictures (fusion graph, roofline)
  - ``explain_functions`` ...... compiled functions + a Recorder -> Explanation
"""
from __future__ import annotations

import html
import json
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from . import cache, printer, report_html
from .ir import output_buffer

# ---- Data types ----


@dataclass
class KernelInfo:
    """One kernel of an artifact, as the page shows it."""
    name: str
    kind: str                   # pointwise | persistent reduction | looped reduction | ... | fallback
    section: str                # the chapter section that builds this form
    nodes: list                 # graph nodes it computes
    source: str
    origins: list               # per line of `source`: the graph node it comes from, or None
    reads: list
    writes: list
    nbytes: int
    ops: int = 0                # estimated arithmetic ops (one per printed line, times the iterations)
    seconds: float | None = None
    tuning: dict | None = None  # the autotuning record: candidates, their times, the choice


@dataclass
class ArtifactInfo:
    """One compiled specialization of a function."""
    title: str
    graph: str
    ir: str
    schedule: str
    wrapper: str
    kernels: list
    moved: int
    bound: int
    guards: list = field(default_factory=list)
    recompiles: list = field(default_factory=list)
    cudagraphs: list = field(default_factory=list)     # §9.9: recorded, replayed, or why not


@dataclass
class FunctionInfo:
    name: str
    where: str
    stats: dict
    artifacts: list


@dataclass
class Roofs:
    bandwidth: float            # bytes per second
    compute: float              # ops per second
    how: str                    # how they were obtained (measured, and on what)


# ---- Recording what compiles announce ----


class Recorder:
    """An observer for ``stax._OBSERVERS``: keeps every compile's stages, by function name, and
    the printers of each generated module (so that lines can be traced to graph nodes)."""

    def __init__(self):
        self.by_function: dict = {}          # name -> [artifact dicts, in compile order]
        self.pending: dict = {}
        printer.collect_printers(True)

    def __call__(self, stage: str, title: str, payload) -> None:
        current = self.pending.setdefault(title, {})
        if stage == "generated":
            current["generated"] = payload
            current["printers"] = printer.collect_printers(True)
            self.by_function.setdefault(title, []).append(current)
            self.pending[title] = {}
        elif stage in ("guards", "cudagraphs") and self.by_function.get(title):
            self.by_function[title][-1].setdefault(stage, []).append(payload)
        elif stage == "recompiles":
            current.setdefault("recompiles", []).append(payload)
        else:
            current[stage] = payload

    def close(self) -> None:
        printer.collect_printers(False)


# ---- §1.1 Bytes moved against Prop. 1.1's bound ----


def _numel_spanned(layout) -> int:
    """Distinct elements a layout addresses: a broadcast (stride-0) dimension adds none."""
    n = 1
    for size, stride in zip(layout.shape, layout.stride):
        if int(stride) != 0:
            n *= int(size)
        elif int(size) == 0:
            return 0
    return n


def _nbytes(lowered, name) -> int:
    buf = lowered.buffer(name)
    return _numel_spanned(buf.layout) * buf.dtype.itemsize


def _kernel_params(source: str) -> list:
    """[(param name, is_read, is_written)] from a C++ kernel's signature: `const T* in_ptrN` is read,
    `T* out_ptrN` written, `T* in_out_ptrN` both."""
    head = source[source.index("(") + 1:source.index(")")]
    params = []
    for decl in head.split(","):
        decl = decl.strip()
        if "*" not in decl:
            continue            # a size argument (int64_t s0)
        pname = decl.split("*")[-1].strip()
        params.append((pname, "in_" in pname, "out_" in pname))
    return params


def _kernel_buffers(wrapper: str, name: str) -> list:
    """Buffer names passed to kernel `name` in the wrapper: `kernels.NAME(ptr(a), ptr(b), ...)`."""
    for line in wrapper.splitlines():
        line = line.strip()
        if line.startswith(f"kernels.{name}("):
            args = line[len(f"kernels.{name}("):line.rindex(")")]
            return [a.strip()[4:-1] for a in args.split(",") if a.strip().startswith("ptr(")]
    raise LookupError(name)


def _group_io(g, gen, kname, src, sched):
    try:
        bufs = _kernel_buffers(gen.wrapper, kname)
        params = _kernel_params(src)
        return ([b for b, (_, r, _) in zip(bufs, params) if r],
                [b for b, (_, _, w) in zip(bufs, params) if w])
    except (LookupError, ValueError):
        # another back end's wrapper: what the schedule says the nodes load and store
        from .schedule import buffer_reads
        inside = {n.name for n in g.nodes}
        reads = sorted({r for n in g.nodes for r in buffer_reads(n)} - inside)
        return reads, [n.name for n in g.nodes if n.name not in sched.kernel_local]


def traffic(gen) -> dict:
    """Bytes the compiled code moves, and the Prop. 1.1 lower bound, for one specialization.

    Estimate: each kernel reads every buffer it takes as an input pointer once and writes every
    buffer it takes as an output pointer once (the signature says which: `const T* in_ptrN` is
    read, `T* out_ptrN` written, `in_out_ptrN` both), sized from the lowered graph's layout of that
    buffer (elements spanned, broadcast dimensions counted once, times the itemsize). Summed over
    kernels, so an intermediate buffer written by one kernel and read by another counts twice,
    which is exactly the traffic fusion removes. Re-reads of the same buffer inside one kernel
    (softmax's passes over a row) are assumed to hit the cache: a row is small next to the caches,
    so main-memory traffic is the distinct buffers. Fallback (extern) kernels, e.g. matmul, read
    their inputs and write their output once. The bound is the graph's inputs read once plus its
    outputs (and inputs it updates in place) written once."""
    sched = gen.module.schedule
    low = sched.lowered
    kernels = list(gen.kernels.items())
    rows, moved, ki = [], 0, 0
    for g in sched.groups:
        origins = list(dict.fromkeys(g.origins))
        if g.kind == "extern":
            e = g.nodes[0]
            reads = sorted({x for a in e.inputs for x in (a if isinstance(a, list) else [a])
                            if isinstance(x, str)})
            writes, kname, src = [e.name], f"fallback {e.op}", ""
            count = _printed_as_template(e, kernels, ki)
            for extra in range(count - 1):      # (the backward's dK/dV kernel before its dQ one)
                rows.append({"kernel": kernels[ki][0], "kind": g.kind, "nodes": origins, "reads": reads,
                             "writes": writes, "bytes": 0, "group": g, "source": kernels[ki][1]})
                ki += 1
            if count:
                kname, src = kernels[ki]
                ki += 1
            elif e.op in ("attn_lse", "omni_lse") and ki < len(kernels) and "_attention_" in kernels[ki][0]:
                # §9.10 training: only allocated here; the attention template that follows writes it
                reads, writes, kname = [], [], f"{e.op} (written by {kernels[ki][0]})"
        else:
            kname, src = kernels[ki]
            ki += 1
            reads, writes = _group_io(g, gen, kname, src, sched)
        nbytes = sum(_nbytes(low, b) for b in dict.fromkeys(reads)) + \
            sum(_nbytes(low, b) for b in dict.fromkeys(writes))
        moved += nbytes
        rows.append({"kernel": kname, "kind": g.kind, "nodes": origins, "reads": reads,
                     "writes": writes, "bytes": nbytes, "group": g, "source": src})
    inputs = {b.name for b in low.inputs}
    updated = {i for i, _ in low.mutations}
    # an output that is an input returned unchanged costs nothing; an updated input is written
    written = {output_buffer(o) for o in low.outputs} - {None} - inputs | updated
    bound = sum(_nbytes(low, b) for b in inputs) + sum(_nbytes(low, b) for b in written)
    return {"kernels": rows, "moved": moved, "bound": bound}


# ---- What each kernel is, and where each of its lines comes from ----


_TEMPLATE_OPS = {"sdpa": ("_attention_",), "omni_attn": ("_attention_",), "conv2d": ("_conv_",),
                 "attn_bwd": ("_attention_bwd_dkdv", "_attention_bwd_dq")}


def _printed_as_template(e, kernels, ki) -> int:
    """How many template kernels of its own a back end printed for an extern node (§9.8 conv,
    §9.10 attention and its backward's two) rather than a §6.1 fallback call: the next ones."""
    marks = _TEMPLATE_OPS.get(e.op, ())
    ok = all(ki + i < len(kernels) and m in kernels[ki + i][0] for i, m in enumerate(marks))
    return len(marks) if marks and ok else 0


def kernel_form(row: dict, previous: dict | None) -> tuple:
    """(kind, chapter section) of a kernel: from its group and the decorator it was printed with."""
    if row["kind"] == "extern" and row["kernel"].startswith("fallback "):
        return "fallback", "§6.1"
    if row["kind"] == "extern" and " (written by " in row["kernel"]:
        return "buffer", "§9.10"
    if row["kind"] == "extern":                 # a template printed for an extern node
        return "template", "§9.10" if "attention" in row["kernel"] else "§9.8"
    src = row["source"]
    deco = re.search(r"@triton_heuristics\.(\w+)", src)
    if deco is not None:
        kind = {"pointwise": "pointwise", "persistent_reduction": "persistent reduction",
                "reduction": "looped reduction", "template": "template"}.get(deco.group(1), deco.group(1))
        section = {"pointwise": "§9.3", "template": "§9.8"}.get(kind, "§9.4")
    elif row["kind"] == "pointwise":
        kind, section = "pointwise", "§8"
    elif row["kind"] in ("reduction", "scan"):
        kind, section = row["kind"], "§8"
    else:
        kind, section = row["kind"], "§9.8" if "template" in row["kind"] else "§7"
    if "reduction" in kind and previous is not None and previous["nodes"] == row["nodes"]:
        kind, section = "split reduction (combine)", "§6.5 Alg. 6.1"
    return kind, section


_ASSIGNED = re.compile(r"\b(tmp\d+)\s*=(?!=)")
_USED = re.compile(r"\btmp\d+\b")
_STORE = re.compile(r"\s*(in_)?out_ptr\d+\[")


_NAMED = re.compile(r"\b(?!tmp\d+\b)[A-Za-z_]\w*\d\w*\b")


def _skeleton(line: str) -> str:
    """A line with its buffer and loop names blanked: the back end renames buffers to pointer
    parameters (`arg0_1` -> `in_ptr0`) after the printer wrote the line."""
    return _NAMED.sub("#", line.strip().replace("@", ""))


def _printers_of(source: str, printers: list) -> list:
    """The printers whose every line appears in `source` (the ones that wrote this kernel)."""
    lines = {_skeleton(ln) for ln in source.splitlines()}
    return [p for p in printers if p.lines and all(_skeleton(ln) in lines for ln in p.lines)]


def line_origins(source: str, printers: list) -> list:
    """Per line of a kernel: the graph node it computes (a variable's definition, or a store of a
    variable), or None (indexing, loops, the accumulators a reduction kernel adds)."""
    origin_of: dict = {}
    for p in _printers_of(source, printers):
        for var, node in p.origin_of.items():
            if node is not None:
                origin_of.setdefault(var, node)
    out = []
    for ln in source.splitlines():
        m = _ASSIGNED.search(ln)
        stores = "tl.store(" in ln or _STORE.match(ln) is not None
        var = m.group(1) if m else next(iter(_USED.findall(ln)), None) if stores else None
        out.append(origin_of.get(var))
    return out


def _op_count(source: str, printers: list, group) -> int:
    """Arithmetic ops a kernel performs, estimated: the printed lines that are not loads or
    constants, times the iterations of the group's loop nest. A fallback matmul counts 2mnk."""
    mine = _printers_of(source, printers)
    per_element = max((sum(1 for ln in p.lines if "ptr" not in ln and "load" not in ln
                           and not re.search(r"=\s*[-\d.e]+[f;]?\s*;?$", ln)) for p in mine), default=0)
    try:
        iterations = math.prod(int(s) for s in list(group.ranges) + list(group.reduction_ranges))
    except (TypeError, AttributeError):
        return 0                    # symbolic sizes: no single count
    return per_element * iterations


def _matmul_ops(group, lowered) -> int:
    e = group.nodes[0]
    if e.op not in ("matmul", "mm", "bmm"):
        return 0
    try:
        a = lowered.buffer(e.inputs[0]).layout.shape
        out = lowered.buffer(e.name).layout.shape
        return 2 * math.prod(int(s) for s in out) * int(a[-1])
    except (AttributeError, KeyError, LookupError, TypeError, ValueError, IndexError):
        return 0


def _tuning_record(kernel_name: str) -> dict | None:
    """The newest autotuning record of a kernel in the cache (candidates, times, the choice)."""
    try:
        paths = sorted(cache.folder("autotune").glob(f"{kernel_name}_*.json"),
                       key=lambda p: p.stat().st_mtime)
    except OSError:
        return None
    for path in reversed(paths):
        record = cache.read_sealed_json(path, lambda r: isinstance(r, dict) and "config" in r,
                                        "a tuning record")
        if record is not None:
            return record
    return None


# ---- §9.7 Timing each kernel inside a real call ----


class _TimedKernels:
    """Stands in for a CPU wrapper's `kernels` (the cffi library): each call is timed."""

    def __init__(self, lib, times: dict):
        self._lib, self._times = lib, times

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self._times.setdefault(name, []).append(time.perf_counter() - t0)
            return out
        return timed


class _TimedLaunch:
    """Stands in for a GPU kernel object in a wrapper: `run` synchronizes around the launch."""

    def __init__(self, kernel, name, times, sync):
        self._kernel, self._name, self._times, self._sync = kernel, name, times, sync

    def __getattr__(self, attr):
        return getattr(self._kernel, attr)

    def run(self, *args, **kwargs):
        self._sync()
        t0 = time.perf_counter()
        out = self._kernel.run(*args, **kwargs)
        self._sync()
        self._times.setdefault(self._name, []).append(time.perf_counter() - t0)
        return out


def _timed_extern(extern_kernel, times: dict):
    """A wrapper's `extern_kernel(op, ...)` (a §6.1 fallback call), timed under the op's name."""
    def timed(op, *args, **kwargs):
        t0 = time.perf_counter()
        out = extern_kernel(op, *args, **kwargs)
        times.setdefault(op, []).append(time.perf_counter() - t0)
        return out
    timed._timed = True
    return timed


def _calls_of(f) -> list:
    entries = [e for e in getattr(f, "artifacts", {}).values() if e]
    entries += [e for pairs in getattr(f, "guarded", {}).values() for _, e in pairs if e]
    return [e[0] for e in entries if callable(e[0])]


def time_kernels(f, kernel_names, repeat: int = 20) -> dict:
    """kernel name -> median seconds of one launch, measured inside real calls of compiled
    function `f` on its last inputs (the wrapper's kernel handles swapped for timed ones)."""
    args, kwargs = f.last_inputs
    times: dict = {}
    swapped = []
    for call in _calls_of(f):
        g = call.__globals__
        if "kernels" in g and hasattr(g["kernels"], "__dir__") and not isinstance(g["kernels"], _TimedKernels):
            swapped.append((g, "kernels", g["kernels"]))
            g["kernels"] = _TimedKernels(g["kernels"], times)
        if callable(g.get("extern_kernel")) and not getattr(g["extern_kernel"], "_timed", False):
            swapped.append((g, "extern_kernel", g["extern_kernel"]))
            g["extern_kernel"] = _timed_extern(g["extern_kernel"], times)
        for name in kernel_names:
            if name in g and hasattr(g[name], "run"):
                from . import cuda      # the interpreter runs each launch to its end: no sync
                sync = (lambda: None) if cuda.interpreting() else cuda.synchronize
                swapped.append((g, name, g[name]))
                g[name] = _TimedLaunch(g[name], name, times, sync)
    try:
        for _ in range(repeat):
            f(*args, **kwargs)
    finally:
        for g, name, old in reversed(swapped):
            g[name] = old
    return {k: statistics.median(v) for k, v in times.items()}


# ---- Roofs: the machine's memory and compute limits, measured here ----

_roofs: dict = {}


def measure_roofs(device: str = "cpu") -> Roofs:
    """Memory roof: the best of a few 64 MiB array copies (bytes read + written per second).
    Compute roof: the best of a few float32 1024^3 matmuls (numpy's BLAS) on the CPU; on the GPU
    a copy between device buffers for the memory roof and the H200's dense bf16 peak (nominal)."""
    if device in _roofs:
        return _roofs[device]
    from . import cuda
    if device.startswith("cuda") and not cuda.interpreting():
        roofs = _gpu_roofs()
    else:
        a = np.ones(16 << 20, np.float32)
        b = np.empty_like(a)
        copy = min(_seconds(lambda: np.copyto(b, a)) for _ in range(5))
        m = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
        mm = min(_seconds(lambda: m @ m) for _ in range(3))
        roofs = Roofs(2 * a.nbytes / copy, 2 * 1024 ** 3 / mm,
                      "measured here on the CPU" + (" (Triton's interpreter runs the GPU kernels on it)"
                                                    if device.startswith("cuda") else "")
                      + ": a 64 MiB numpy copy; a float32 1024^3 numpy matmul")
    _roofs[device] = roofs
    return roofs


def _gpu_roofs() -> Roofs:
    from . import cuda
    n = 256 << 20
    src, dst = cuda.allocate(n), cuda.allocate(n)
    best = math.inf
    for _ in range(5):
        cuda.synchronize()
        t0 = time.perf_counter()
        cuda.copy_device_to_device(dst, src, n)
        cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return Roofs(2 * n / best, 989e12, "memory measured here (a 256 MiB device copy); compute: "
                 "the H200's nominal dense bf16 peak")


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- Building the explanation ----


def _kernel_infos(gen, printers, seconds: dict) -> tuple:
    t = traffic(gen)
    low = gen.module.schedule.lowered
    infos, previous = [], None
    for row in t["kernels"]:
        kind, section = kernel_form(row, previous)
        previous = row
        src = row["source"]
        group = row["group"]
        ops = _matmul_ops(group, low) if row["kind"] == "extern" else _op_count(src, printers, group)
        infos.append(KernelInfo(row["kernel"], kind, section, row["nodes"], src,
                                line_origins(src, printers) if src else [], row["reads"], row["writes"],
                                row["bytes"], ops, seconds.get(row["kernel"].replace("fallback ", "")),
                                _tuning_record(row["kernel"]) if "triton" in row["kernel"] else None))
    return infos, t["moved"], t["bound"]


def _where(f) -> str:
    code = getattr(getattr(f, "fn", None), "__code__", None)
    if code is None:
        return ""
    path = code.co_filename
    if not path.startswith("<") and not os.path.relpath(path).startswith(".."):
        path = os.path.relpath(path)
    return f"{path}:{code.co_firstlineno}"


def explain_functions(functions, recorder: Recorder, timing: bool = True,
                      device: str = "cpu") -> "Explanation":
    """An Explanation of compiled functions after they ran with `recorder` observing."""
    out = []
    for f in functions:
        name = getattr(f, "__name__", "fn")
        recorded = recorder.by_function.get(name, [])
        last_names = list(recorded[-1]["generated"].kernels) if recorded else []
        seconds = {}
        if timing and recorded and f.last_inputs is not None:
            try:
                seconds = time_kernels(f, last_names)
            except Exception:        # noqa: BLE001 - a page without times beats no page
                seconds = {}
        arts = []
        for i, r in enumerate(recorded):
            gen = r["generated"]
            kernels, moved, bound = _kernel_infos(gen, r.get("printers", []),
                                                  seconds if i == len(recorded) - 1 else {})
            arts.append(ArtifactInfo(f"artifact {i + 1}", r.get("graph", ""), r.get("ir", ""),
                                     r.get("schedule", ""), gen.wrapper, kernels, moved, bound,
                                     r.get("guards", []), r.get("recompiles", []), r.get("cudagraphs", [])))
        out.append(FunctionInfo(name, _where(f), dict(f.stats), arts))
    return Explanation(out, measure_roofs(device) if timing else None, device)


@dataclass
class Explanation:
    """What Stax did to each compiled function: `stax.explain(fn, *inputs)` or `python -m stax
    report`. Shown inline by Jupyter (`_repr_html_`); `to_html()` is the whole page."""
    functions: list
    roofs: Roofs | None = None
    device: str = "cpu"

    def kernels(self) -> list:
        return [k for f in self.functions for a in f.artifacts for k in a.kernels]

    def roofline_points(self) -> list:
        pts = []
        for f in self.functions:
            if f.artifacts:
                for k in f.artifacts[-1].kernels:
                    if k.seconds and k.ops and k.nbytes:
                        pts.append({"kernel": k.name, "intensity": k.ops / k.nbytes,
                                    "throughput": k.ops / k.seconds})
        return pts

    def _repr_html_(self) -> str:
        return report_html.page_body(self)

    def to_html(self, title: str = "Stax report") -> str:
        return report_html.page(self, title)

    def __repr__(self):
        return (f"Explanation({len(self.functions)} function(s), "
                f"{sum(len(f.artifacts) for f in self.functions)} artifact(s), {len(self.kernels())} kernel(s))")


def as_json(expl: Explanation) -> str:
    """The explanation's facts (no sources) as JSON, for scripts and tests."""
    return json.dumps([{"function": f.name, "artifacts": [
        {"kernels": [{"name": k.name, "kind": k.kind, "section": k.section, "nodes": k.nodes,
                      "bytes": k.nbytes, "ops": k.ops, "seconds": k.seconds} for k in a.kernels],
         "moved": a.moved, "bound": a.bound} for a in f.artifacts]} for f in expl.functions], indent=1)
