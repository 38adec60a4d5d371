"""§9.9 CUDA graphs: `stax.compile(mode="reduce-overhead")` records a GPU artifact's launches once
and replays them with one cuGraphLaunch per call.

Layer: runtime (beside runtime.py, under `stax/__init__.py`, which hands each GPU artifact's
`call` to `wrap`). Imports `cuda` (stream capture, device copies, the allocator hook) and `tensor`
(the output tensors it hands back). It never imports a code generator: it reads the generated
module's wrapper text and the captured graph, both of which a warm start from the artifact cache
also has.

Consumes an artifact's `call(args)` (runtime.load_module), its captured graph and its generated
module. Produces a `GraphedCall` that `CompiledFunction` calls in the artifact's place, or the
`call` unchanged with a `STAX_LOGS=cudagraphs` line saying why it was not wrapped.

§9.9's three conditions, and where each is checked:
  1. no data-dependent sizes, no host reads of device data ... `static_reasons`, before wrapping
  2. the inputs at the recorded addresses (or copied there),
     the same number of inputs and the same layouts ........... `GraphedCall.__call__`, every call
  3. one GPU, no host-side computation (§6.1 fallback kernels) . `static_reasons`

Memory: a replay writes its outputs into buffers the graph owns (`GraphPool`), so the next replay
overwrites them. The tensors a replay returns read through a `GraphOutputArray`, which raises an
error saying to `.clone()` once a later replay has overwritten them, instead of returning newer
values. Graphs share one pool when their lifetimes allow it: scratch blocks (dead by the end of a
replay) are shared, since every replay runs in order on the one stream; a graph whose outputs
landed on another live graph's scratch is recorded again in a pool of its own.

Where to look:
  - `wrap` .................... the entry: which artifacts are wrapped, the log line when not
  - `static_reasons` .......... conditions 1 and 3
  - `GraphedCall` ............. warm-up call, recording, condition 2, copies into the recorded
                                inputs, replay, the fallback state after a driver error
  - `GraphPool` ............... graph-owned memory, shared between graphs when safe
  - `GraphOutputArray` ........ an output's storage; raises once a later replay overwrote it;
                                `keep` moves one still referenced out (a training backward's
                                gradients, `GraphedCall(keep_outputs=True)`)
  - `GraphedCall.replayer` .... the generated replay of a call's very tensors again (the host path
                                of the same tensors again, here and in `specialize.LastCall`): in
                                C (`_native_replayer`, cudagraph_c.py) when the extension builds,
                                else the generated Python (`_hot_factory`)
  - `graph_owned` ............. whether tensors read what a graph's next replay overwrites
                                (aot_autograd's rule for a forward whose backward is pending)
  - `CudaDriver`, `set_driver`  the driver seam (tests/test_cudagraph.py installs a fake one)
"""
from __future__ import annotations

import re
import threading
import warnings
import weakref
from operator import is_ as _is

from . import cuda, cudagraph_c
from .tensor import Meta, Storage, Tensor

_new = object.__new__

# ---- §9.9 Data types: the driver seam, graph-owned memory, guarded outputs ----


class CudaDriver:
    """What recording needs from the driver: stream capture of stax.cuda's one stream
    (`cuda.CUDAGraph`), stream-ordered device copies, and the pool recordings allocate from."""

    def unavailable(self) -> str | None:
        """Why graphs cannot be recorded here, or None."""
        if cuda.interpreting():
            return "kernels run in Triton's interpreter (TRITON_INTERPRET=1), not on a GPU"
        if not cuda.is_available():
            return f"no GPU: {cuda.unavailable_reason()}"
        return None

    def graph(self):
        return cuda.CUDAGraph()

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        cuda.copy_device_to_device(dst, src, nbytes)

    def pool(self, private: bool = False):
        return GraphPool(cuda.init().alloc) if private else shared_pool()


_DRIVER = CudaDriver()


def set_driver(driver):
    """Install `driver` (an object with `unavailable`, `graph`, `copy`, `pool`); returns the old one.
    Tests put a fake driver here so that CI, with no GPU, covers the recording logic."""
    global _DRIVER
    old, _DRIVER = _DRIVER, driver
    return old


class _Generation:
    """The replay count of one GraphedCall (and its name, for the error); outputs remember the
    count they were made at. Outputs hold this cell, not the GraphedCall, so an output kept by the
    caller does not keep the graph."""
    __slots__ = ("value", "name", "lock")

    def __init__(self, name="", lock=None):
        # `lock`: the GraphedCall's, which every replay holds while it launches and counts; a host
        # read of an output holds it across its check and its copy, so another thread's replay
        # cannot overwrite the values between the two
        self.value, self.name, self.lock = 0, name, lock or threading.Lock()


class OverwrittenOutputError(RuntimeError):
    """An output of a CUDA graph replay was read after a later replay overwrote it."""


class GraphOutputArray:
    """The storage of a tensor a replay returned: the graph's own device array, usable until the
    next replay overwrites it. Every read (`ptr`, `host()`, the interpreter's `host_array`) and
    write (`upload`) checks the generation first."""
    __slots__ = ("_array", "_cell", "_gen", "__weakref__")

    def __init__(self, array, cell: _Generation):
        self._array, self._cell, self._gen = array, cell, cell.value

    count = property(lambda self: self._array.count)      # (metadata: readable after a replay)
    dtype = property(lambda self: self._array.dtype)

    def _live(self):
        if self._cell.value != self._gen:
            name = self._cell.name
            raise OverwrittenOutputError(
                f"this tensor is an output of a CUDA graph replay of {name} (stax.compile "
                f"mode='reduce-overhead'), and a later call of {name} has overwritten it: a "
                "replay writes its outputs into the same graph-owned memory every time. To keep an "
                "output across calls, copy it before the next call: `y = f(x).clone()`.")
        return self._array

    ptr = property(lambda self: self._live().ptr)
    buffer = property(lambda self: self._live().buffer)
    host_array = property(lambda self: self._live().host_array)

    def host(self):
        with self._cell.lock:
            return self._live().host()

    def upload(self, array):
        self._live().upload(array)
        return self

    def guards_intact(self) -> bool:
        return self._array.guards_intact()

    def keep(self, driver) -> None:
        """Move this output out of the graph's memory before a replay overwrites it: a copy of
        its own (one device copy), read without a generation check from now on."""
        array = self._live()
        fresh = cuda.DeviceArray(array.count, array.dtype)
        if array.count:
            driver.copy(fresh.ptr, array.ptr, array.count * array.dtype.itemsize)
        self._array, self._cell, self._gen = fresh, _Generation(self._cell.name), 0


class GraphPool:
    """Device memory owned by CUDA graphs (§9.9). Blocks come from `backing` (the caching
    allocator) and stay with the pool while any graph that recorded into it is alive, so a buffer
    a graph writes on replay is never handed to anyone else. `owner`, while a graph records, is
    the key every block it touches is marked with (`written`): a block one live graph writes may
    not become another live graph's output or staged input (`conflicts`)."""

    def __init__(self, backing):
        self.backing = backing
        self.reserved: dict = {}       # ptr -> the DeviceBuffer from `backing` behind a block
        self.free: dict = {}           # block size -> free ptrs
        self.written: dict = {}        # ptr -> keys of the graphs that write it on replay
        self.live: set = set()         # keys of the graphs alive that recorded here
        self.owner = None
        self.lock = threading.RLock()      # a buffer collected inside `allocate` releases re-entrantly

    def allocate(self, nbytes: int):
        size = cuda.round_size(nbytes)
        with self.lock:
            ptrs = self.free.get(size)
            if ptrs:
                ptr = ptrs.pop()
            else:
                buf = self.backing.allocate(size)
                ptr = buf.ptr
                self.reserved[ptr] = buf
            if self.owner is not None:
                self.written.setdefault(ptr, set()).add(self.owner)
        return cuda.DeviceBuffer(ptr, int(nbytes), size, self)

    def release(self, ptr: int, size: int) -> None:
        with self.lock:
            if self.live:
                self.free.setdefault(size, []).append(ptr)
            else:                       # no graph replays any more: back to the caching allocator
                self.written.pop(ptr, None)
                self.reserved.pop(ptr).free()

    def conflicts(self, key, owned_ptrs) -> list:
        """The blocks among `owned_ptrs` (what graph `key` keeps between replays) that another
        live graph writes on its replays."""
        with self.lock:
            return [p for p in owned_ptrs if (self.written.get(p, set()) & self.live) - {key}]

    def join(self, key) -> None:
        with self.lock:
            self.live.add(key)

    def leave(self, key) -> None:
        """Graph `key` is gone; with no graph left, every free block goes back to `backing`."""
        with self.lock:
            self.live.discard(key)
            for marks in self.written.values():
                marks.discard(key)
            if self.live:
                return
            for ptrs in self.free.values():
                for ptr in ptrs:
                    self.written.pop(ptr, None)
                    self.reserved.pop(ptr).free()
            self.free.clear()

    def stats(self) -> dict:
        with self.lock:
            free = sum(size * len(p) for size, p in self.free.items())
            return {"reserved_bytes": sum(b.block_size for b in self.reserved.values()),
                    "free_bytes": free, "graphs": len(self.live)}


_SHARED = [None]            # the pool recordings share while one is alive (a weak hold, see below)
_SHARED_LOCK = threading.Lock()


def shared_pool() -> GraphPool:
    """The process's shared graph pool: a new one when no graph holds the last one any more."""
    with _SHARED_LOCK:
        pool = _SHARED[0]
        if pool is None or not pool.live:
            pool = _SHARED[0] = GraphPool(cuda.init().alloc)
        return pool


# ---- §9.9 Conditions 1 and 3, checked before wrapping ----

_EXTERN = re.compile(r"extern_kernel\('([A-Za-z0-9_]+)'")


def static_reasons(graph, module) -> list:
    """Why an artifact cannot be replayed from a graph (empty: it can). Condition 1: sizes that
    depend on data, host reads of device data; condition 3: inputs on another device, host-side
    computation (a §6.1 fallback kernel runs its numpy implementation through the host)."""
    reasons = []
    for sym, (node, dim) in getattr(graph, "unbacked", {}).items():
        reasons.append(f"condition 1: the size {sym} (dim {dim} of {node}) depends on the data")
    ops = list(dict.fromkeys(_EXTERN.findall(module.wrapper)))
    for op in ops:
        reasons.append(f"conditions 1 and 3: the fallback kernel '{op}' copies device data to the "
                       "host and computes there")
    for n in graph.inputs:
        if not str(n.meta.device).startswith("cuda"):
            reasons.append(f"condition 3: input {n.name} is on {n.meta.device}, not the GPU")
    return reasons


def graph_owned(tensors, graphed) -> bool:
    """Whether any of `tensors` reads the memory that `graphed`'s next replay overwrites (an
    output of its last replay; aot_autograd: a forward's saved tensors)."""
    cell = graphed.cell
    for t in tensors:
        a = t._storage.data
        if a.__class__ is GraphOutputArray and a._cell is cell and a._gen == cell.value:
            return True
    return False


def mutated_positions(graph) -> frozenset:
    """The argument positions the artifact writes to (in-place updates of inputs): those are
    never copied into graph-owned buffers, since the write must reach the caller's tensor."""
    names = {inp.name for inp, _ in getattr(graph, "mutations", ())}
    return frozenset(i for i, n in enumerate(graph.inputs) if n.name in names)


_HOT: dict = {}             # arity -> the factory of `GraphedCall.replayer`'s functions (compiled once per arity)

# The replay of a call with the last call's very tensors (issue 13: host µs per replay), generated
# straight-line: one `is` per input and, under grad mode, one requires_grad read each (a loop over
# 17 inputs cost about three times as much), read from the tensor's own __dict__, held from when the
# replay is made (`Tensor.__getattr__`, the missing-op message, keeps CPython 3.11 from specializing
# any attribute read on a Tensor: `t.requires_grad` cost ~25 ns, `d["requires_grad"]` ~15; the dict
# is the tensor's for life, so a later `t.requires_grad = True` is seen), then under the
# GraphedCall's lock: the recording and
# its remembered tensors still current, the copies into staged inputs, the launch, the outputs.
# In one function, not five calls (the entry, the check, the lock's `with`, `_replay`, `outputs`):
# each Python call level was ~0.05-0.1 µs of the host path. The C replay (cudagraph_c.py,
# `_native_replayer`) does the same steps without the interpreter and stands in for this one
# wherever the extension builds; this one serves where it does not, and for what it leaves to it.
_HOT_SOURCE = '''\
def make({params}{dicts}rec, token, acquire, release, cell, copies, copy, counts, graphed):
    def replay(args, grad):
        """A replay for the {n} tensors of one call again (cudagraph.GraphedCall.replayer): its
        outputs; False: other tensors (or one requires grad now); None: these tensors, but the
        graph was recorded again or remembers another call's tensors (call it as usual)."""
        if len(args) != {n}:
            return False
{test}        acquire()
        try:
            if rec.again is not token:      # (a recording closed, or recorded again, has none)
                return None
            try:
                if copies is not None:      # staged inputs: into the buffers the graph reads
                    for dst, src, nbytes in copies:
                        copy(dst, src, nbytes)
                    counts["copies"] += len(token[1])
                rec.launch()
            except Exception as e:  # noqa: BLE001 -- a driver failure: the usual path runs directly
                graphed()._break("replaying", e)
                return None
            cell.value += 1         # every output of earlier replays is now overwritten
            return rec.outputs(cell)
        finally:
            release()
    return replay
'''


def _hot_factory(n: int):
    make = _HOT.get(n)
    if make is None:
        ps, xs, ds = [f"p{i}" for i in range(n)], [f"a{i}" for i in range(n)], [f"d{i}" for i in range(n)]
        differ = " or ".join(f"{a} is not {p}" for a, p in zip(xs, ps))
        needs_grad = " or ".join(d + "['requires_grad']" for d in ds)
        test = (f"        {', '.join(xs)}, = args\n"
                f"        if {differ}:\n"
                "            return False\n"
                f"        if grad and ({needs_grad}):\n"
                "            return False\n" if n else "")
        src = _HOT_SOURCE.format(params="".join(p + ", " for p in ps), dicts="".join(d + ", " for d in ds),
                                 n=n, test=test)
        scope: dict = {}
        exec(compile(src, f"<stax cudagraph replayer/{n}>", "exec"), scope)
        make = _HOT.setdefault(n, scope["make"])
    return make


def _native_replayer(mod, python, rec, token, tensors, copies, owner, ref):
    """The C replay (cudagraph_c) doing what `python` does: the launch and the copies as raw
    driver calls when the graph is a cuda.CUDAGraph and the driver CudaDriver (or a test's C
    stubs: `raw_launch`, `raw_copy`), else through their Python callables. `copies`: the token's
    non-empty ones, or None when it has none. It holds the lock, generation and counts of `owner`
    (the GraphedCall), and `owner` only through `ref`."""
    driver = _DRIVER
    launch = cudagraph_c.raw_launch(rec.graph) or rec.launch
    raw = cudagraph_c.raw_copy() if driver.__class__ is CudaDriver else getattr(driver, "raw_copy", lambda: None)()
    copy = raw or driver.copy
    real = (launch.__class__ is tuple and rec.graph.__class__ is cuda.CUDAGraph) or \
        (raw is not None and driver.__class__ is CudaDriver)

    def fail(err, i):
        if err.__class__ is int:        # the CUresult of a raw call: the error its Python call raises
            err = cudagraph_c.driver_error(err, copies[i] if i >= 0 else None)
        ref()._break("replaying", err)
    return cudagraph_c.make_replay(
        mod, python=python, tensors=tensors, rec=rec, token=token, lock=owner._lock, cell=owner.cell,
        launch=launch, copies=copies, counted=len(token[1]) if token[1] else 0, copy=copy,
        counts=owner.counts, single=rec.single,
        outputs=rec.outputs, types=(GraphOutputArray, Storage, Tensor), fail=fail,
        init=cuda.init if real else None)


def _copy_in(copies, counts) -> None:
    """A replay's copies of staged inputs into the buffers the graph reads (before its launch)."""
    copy = _DRIVER.copy
    for dst, src, nbytes in copies:
        if nbytes:
            copy(dst, src, nbytes)
    counts["copies"] += len(copies)


# ---- §9.9 Recording: one captured launch sequence and what it holds alive ----


def _span_bytes(meta) -> int:
    """The bytes from a tensor's first element to past its last (strides are not negative)."""
    if any(s == 0 for s in meta.shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride))) * meta.dtype.itemsize


class Recording:
    """One recorded graph: the inputs it reads (the caller's tensors at their addresses, or
    graph-owned staged copies), the outputs it writes, and the pool that owns its memory."""

    def __init__(self, graph, pool, key, args, record_inputs, staged, outs):
        self.graph, self.pool, self.key = graph, pool, key
        self.n = len(args)
        self.shapes = [t._meta.shape for t in args]
        self.strides = [t._meta.stride for t in args]
        self.ptrs = [t.data_ptr() for t in record_inputs]
        # per position, the last call's (storage, meta, data pointer): a tensor passed again
        # (storage and layout objects identical, so the same address) skips its checks
        self.seen = [None] * self.n
        # [the last call's tensors, their copies, the generated replay of them (`GraphedCall.replayer`,
        # made on their first repeat)] when all were known: the same tensors again pass condition 2 whole
        self.again = None
        self.staged = staged               # position -> (staged array, its bytes)
        self.inputs = record_inputs        # keeps the static inputs' memory from being reused
        self.outs = outs
        static = {id(t._storage) for i, t in enumerate(record_inputs) if i not in staged}
        # a replay output of another graph, recorded through its raw array: an output viewing it
        # is made over the caller's storage, which keeps the generation check
        unwrapped = {id(t._storage): a._storage for t, a in zip(record_inputs, args) if t._storage is not a._storage}
        self.owned = []                    # graph-owned storages the outputs read
        self.plan = []                     # per output: (None, value) | (index in owned, meta)
        seen = {}
        for o in outs:
            if o.__class__ is not Tensor:
                self.plan.append((None, o))
            elif id(o._storage) in static:  # a view of the caller's input, at its recorded address
                st = unwrapped.get(id(o._storage))
                self.plan.append((None, o if st is None else Tensor._make(st, o._meta)))
            else:
                k = seen.setdefault(id(o._storage), len(self.owned))
                if k == len(self.owned):
                    self.owned.append(o._storage.data)
                self.plan.append((k, o._meta))
        # the common case, one output over one graph-owned buffer: (that buffer, its layout)
        self.single = (self.owned[0], self.plan[0][1]) if len(self.plan) == 1 and self.plan[0][0] == 0 else None
        self.launch = graph.replay             # (bound once: the replay's one driver call)

    def owned_ptrs(self) -> list:
        arrays = self.owned + [a for a, _ in self.staged.values()]
        return [a.buffer.ptr for a in arrays if getattr(a, "buffer", None) is not None]

    def outputs(self, cell: _Generation) -> tuple:
        """This replay's output tensors: fresh tensors over the graph's buffers, stamped with it."""
        single = self.single
        if single is not None:             # the common case: one output, one graph-owned buffer
            # GraphOutputArray(owned[0], cell), Storage(a, "cuda") and Tensor._fresh(s, meta), in
            # line: without their three calls (§9.9 host time: ~0.1 µs of the ~0.7 this takes)
            a = _new(GraphOutputArray)
            a._array, a._cell, a._gen = single[0], cell, cell.value
            s = _new(Storage)
            s.data, s.device, s.version = a, "cuda", 0
            t = _new(Tensor)
            t._storage, t._meta, t._base, t._view_ops, t._node = s, single[1], None, [], None
            t.requires_grad, t.grad, t._grad_fn = False, None, None
            return (t,)
        make, owned = Tensor._fresh, self.owned
        if len(owned) == 1:                # one graph-owned buffer, several views of it
            s = Storage(GraphOutputArray(owned[0], cell), "cuda")
            return tuple([v if k is None else make(s, v) for k, v in self.plan])
        storages = [Storage(GraphOutputArray(a, cell), "cuda") for a in owned]
        return tuple([v if k is None else make(storages[k], v) for k, v in self.plan])

    def close(self) -> None:
        self.graph = self.outs = self.inputs = self.launch = None
        self.owned, self.staged, self.plan, self.seen, self.again = [], {}, [], [None] * self.n, None
        self.single = None
        if self.pool is not None:
            self.pool.leave(self.key)
            self.pool = None


def _stage(t, pool):
    """A graph-owned buffer with `t`'s layout (offset 0) that `t`'s data is copied into each call."""
    m = t._meta
    nbytes = _span_bytes(m)
    array = cuda.DeviceArray(max(1, nbytes // m.dtype.itemsize), m.dtype.np)
    view = Tensor._make(Storage(array, "cuda"), Meta(m.shape, m.stride, m.dtype, m.device, 0))
    return array, nbytes, view


def record(call, args, staged_positions, pool, key):
    """Capture `call` on `args` (the positions in `staged_positions` read graph-owned copies)
    into a graph whose memory comes from `pool`. Nothing runs: the caller replays it."""
    graph = _DRIVER.graph()
    if pool is not None:
        pool.join(key)
        pool.owner = key
    try:
        with cuda.allocating_from(pool):
            staged, record_inputs = {}, []
            for i, t in enumerate(args):
                if i in staged_positions:
                    array, nbytes, view = _stage(t, pool)
                    staged[i] = (array, nbytes)
                    t = view
                elif t._storage.data.__class__ is GraphOutputArray:
                    # another graph's output (a forward's saved tensor): the graph reads its memory
                    # at this address on every replay, whatever the generation of this tensor
                    t = Tensor._make(Storage(t._storage.data._live(), "cuda"), t._meta)
                record_inputs.append(t)
            with graph:
                outs = call(list(record_inputs))
    except BaseException:
        if pool is not None:
            pool.owner = None
            pool.leave(key)
        raise
    if pool is not None:
        pool.owner = None
    return Recording(graph, pool, key, args, record_inputs, staged, tuple(outs))


# ---- §9.9 Condition 2 on every call, replay, the fallback state ----

_RECORD_LOCK = threading.Lock()     # one capture at a time: stax drives one stream


class GraphedCall:
    """An artifact's `call(args)` under mode='reduce-overhead'.

    The first call runs the artifact directly (it compiles and autotunes every kernel); the second
    records the launch sequence and replays it; later calls replay when condition 2 holds: the
    same number of inputs with the recorded shapes and strides, and each input at its recorded
    address. An input that moved is copied into a graph-owned buffer (the graph is recorded
    again once, reading that buffer; one already moved between the warm-up call and the second
    is read from such a buffer from the first recording); an input the artifact writes to that
    moved, or a layout change, runs the artifact directly. A driver error while recording or
    replaying is reported once, and the artifact runs directly from then on (the fallback state).
    `keep_outputs` (a training backward): outputs of the last replay still referenced when the
    next one comes are first copied to memory of their own (`GraphOutputArray.keep`)."""

    def __init__(self, call, name: str, mutated: frozenset = frozenset(), log=None, keep_outputs=False):
        self.call, self.name, self.mutated, self.log = call, name, mutated, log
        # keep_outputs (a backward's gradients, which `.grad` may hold across steps): weakrefs to
        # the last replay's output arrays; those still referenced are copied out before a replay
        self.held = [] if keep_outputs else None
        self.warmed = False           # then the warm-up call's input addresses, then True
        self.rec = None
        self.last = None              # the last call's `Recording.again`, if it passed condition 2 whole
        self.staged_positions = set()
        self.broken = None            # the driver's error, once recording or replay failed
        self.noted = set()            # log lines already given (each once)
        self.counts = {"direct": 0, "records": 0, "copies": 0}
        # One lock per call (uncontended: ~0.05 µs): two threads replaying at once would otherwise
        # interleave "replay, stamp the outputs" and hand one thread the other's values unchecked.
        self._lock = threading.Lock()
        self.cell = _Generation(name, self._lock)     # its value counts the replays (`stats`)

    @property
    def stats(self) -> dict:
        """Calls run directly, recordings, replays, inputs copied in (and outputs kept)."""
        return dict(self.counts, replays=self.cell.value)

    def __call__(self, args):
        rec = self.rec
        again = rec.again if rec is not None else None
        if again is not None and again[2] is not None:      # the last call's very tensors again?
            outs = again[2](args, False)
            if outs is not None and outs is not False:
                return outs
        with self._lock:
            return self._call(args)

    def replayer(self, token, n: int):
        """The generated replay (the C one, or `_hot_factory`'s) for a caller that keeps `token` (from
        `call_with_token`) and will pass the token's first `n` tensors again (`specialize.LastCall`:
        its arguments, the constants after them being its own): `replay(args, grad)`. None for a
        graph whose outputs may be kept across replays (`keep_outputs`: `_replay` moves them)."""
        rec = self.rec
        if self.held is not None or rec is None or rec.again is not token:
            return None
        if n == rec.n and token[2] is not None:
            return token[2]
        return self._replayer(rec, token, n)

    def _replayer(self, rec, token, n: int, native: bool = True):
        # (it holds no strong reference to self: `rec.again` keeps it, and self must stay
        # collectable as soon as its function is, to give the graph's memory back)
        # (the copies with the driver of now: the one the graph was recorded with)
        copies = tuple([c for c in token[1] if c[2]]) if token[1] else None
        lock = self._lock
        tensors = token[0][:n]
        graphed = weakref.ref(self)
        python = _hot_factory(n)(*tensors, *[t.__dict__ for t in tensors], rec, token, lock.acquire, lock.release,
                                 self.cell, copies, _DRIVER.copy, self.counts, graphed)
        mod = cudagraph_c.module() if native else None
        return python if mod is None else _native_replayer(mod, python, rec, token, tensors, copies, self, graphed)

    def call_with_token(self, args):
        """`self(args)` and, taken under the same lock, the token `replay_again` accepts for a
        next call with these very tensors (None: that call must be checked as usual)."""
        with self._lock:
            return self._call(args), self.last

    def replay_again(self, token):
        """A call with the very tensors of the call that `call_with_token` gave `token` for (the
        caller knows they are: `specialize.LastCall`), replayed without testing them again, if
        no other call came in between and the recording is the same. None otherwise: call it
        as usual."""
        with self._lock:
            rec = self.rec
            if rec is None or self.last is not token or rec.again is not token:
                return None
            return self._replay(rec, token[0], token[1])

    def _call(self, args):
        self.last = None
        rec = self.rec
        if rec is None or len(args) != rec.n:
            return self._slow(args)
        again = rec.again
        if again is not None and all(map(_is, args, again[0])):
            if again[2] is None and self.held is None:
                # their first repeat (a new batch each call makes none): `__call__` replays them
                # through the generated replay from now on
                again[2] = self._replayer(rec, again, rec.n)
            self.last = again
            return self._replay(rec, args, again[1])     # the last call's very tensors
        copies, seen, known = [], rec.seen, True
        for i, t in enumerate(args):
            st, m = t._storage, t._meta
            c = seen[i]
            if c is not None and c[0] is st and c[1] is m:   # the last call's tensor: known
                p = c[2]
            else:
                if m.shape != rec.shapes[i] or m.stride != rec.strides[i]:
                    return self._slow(args)
                p = t.data_ptr()          # an overwritten output raises here
                # (never cached: an output of ours must be checked on every call)
                seen[i] = None if st.data.__class__ is GraphOutputArray else (st, m, p)
                known = known and seen[i] is not None
            if p != rec.ptrs[i]:
                if i not in rec.staged:
                    return self._slow(args)
                copies.append((rec.ptrs[i], p, rec.staged[i][1]))
        # a tensor's storage and layout never change, so the same tensors pass condition 2
        # again with the same copies: one identity test per input next time
        rec.again = self.last = [tuple(args), copies, None] if known else None
        return self._replay(rec, args, copies)

    @property
    def __globals__(self) -> dict:
        """The wrapped wrapper's globals (its kernel handles), for tools that look inside an
        artifact's `call` (bench/gpu.py, the report's kernel timing); a replay calls none of them."""
        return self.call.__globals__

    def _replay(self, rec, args, copies):
        try:
            if self.held:
                self._keep_held()
            if copies:
                _copy_in(copies, self.counts)
            rec.launch()
        except Exception as e:  # noqa: BLE001 -- any driver failure: run directly from now on
            self._break("replaying", e)
            return self._direct(args)
        cell = self.cell
        cell.value += 1               # every output of earlier replays is now overwritten
        outs = rec.outputs(cell)
        if self.held is not None:
            self.held = [weakref.ref(t._storage.data) for t in outs
                         if t.__class__ is Tensor and t._storage.data.__class__ is GraphOutputArray]
        return outs

    def _keep_held(self) -> None:
        """keep_outputs: the last replay's outputs someone still holds (a gradient in `.grad`, one
        the engine is summing) move to memory of their own before this replay overwrites theirs."""
        cell, held, self.held = self.cell, self.held, []
        kept = 0
        for ref in held:
            array = ref()
            if array is not None and array._cell is cell and array._gen == cell.value:
                array.keep(_DRIVER)
                kept += 1
        if kept:
            self.counts["kept"] = self.counts.get("kept", 0) + kept
            self._note("kept", f"{self.name}: {kept} output(s) of the last replay were still referenced "
                       "(a gradient kept in .grad): copied out of the graph's memory before the next "
                       "replay, so they keep their values")

    def _direct(self, args):
        self.counts["direct"] += 1
        return self.call(list(args))       # (a list: the wrapper clears it; `replay_again` has a tuple)

    def _note(self, what: str, text: str) -> None:
        if what not in self.noted:
            self.noted.add(what)
            if self.log is not None:
                self.log("cudagraphs", self.name, text)

    def _slow(self, args):
        """No recording yet, or condition 2 failed: warm up, record (again), or run directly."""
        if self.broken is not None:
            return self._direct(args)
        if self.warmed is False:          # the warm-up call: its addresses, for `_stage_moved`
            self.warmed = [t.data_ptr() for t in args]
            return self._direct(args)
        rec = self.rec
        if rec is None and self.warmed is not True and len(args) == len(self.warmed):
            self._stage_moved(args)
        if rec is not None:
            why = self._mismatch(rec, args)
            if why is not None:
                self._note(why, f"{self.name}: {why}; this call runs the compiled code directly")
                return self._direct(args)
            moved = {i for i, t in enumerate(args) if i not in rec.staged and t.data_ptr() != rec.ptrs[i]}
            self._note("moved", f"{self.name}: input(s) {sorted(moved)} moved since recording; from now "
                       "on they are copied into graph-owned buffers before each replay")
            self.staged_positions |= moved
        return self._record(args)

    def _stage_moved(self, args) -> None:
        """The first recording: an input at another address than on the warm-up call (a new
        batch each call) is copied into a graph-owned buffer from the start, so the graph is
        recorded once. Not an input written in place, nor a replay's output (graph memory: the
        same address on every replay)."""
        moved = {i for i, (t, p) in enumerate(zip(args, self.warmed)) if i not in self.mutated and
                 t.data_ptr() != p and t._storage.data.__class__ is not GraphOutputArray}
        self.warmed = True
        if moved:
            self._note("moved", f"{self.name}: input(s) {sorted(moved)} moved since the warm-up call; "
                       "they are copied into graph-owned buffers before each replay")
            self.staged_positions |= moved

    def _mismatch(self, rec, args) -> str | None:
        if len(args) != rec.n:
            return f"condition 2: {len(args)} inputs, recorded with {rec.n}"
        for i, t in enumerate(args):
            if t._meta.shape != rec.shapes[i] or t._meta.stride != rec.strides[i]:
                return (f"condition 2: input {i} has size {tuple(t.shape)} and stride {tuple(t.stride())}, "
                        f"recorded with {rec.shapes[i]} and {rec.strides[i]}")
            if i in self.mutated and i not in rec.staged and t.data_ptr() != rec.ptrs[i]:
                return (f"condition 2: input {i}, which the function writes to, moved (its write "
                        "must reach the caller's tensor, so it is not copied)")
        return None

    def _record(self, args):
        old, self.rec = self.rec, None
        if old is not None:
            old.close()
        try:
            with _RECORD_LOCK:
                rec = self._record_in_pool(args)
        except Exception as e:  # noqa: BLE001
            self._break("recording", e)
            return self._direct(args)
        self.rec = rec
        self.counts["records"] += 1
        self._note("recorded", f"{self.name}: recorded a CUDA graph ({rec.n} inputs, "
                   f"{len(rec.staged)} copied into graph-owned buffers each call)")
        copies = [(rec.ptrs[i], t.data_ptr(), rec.staged[i][1]) for i, t in enumerate(args) if i in rec.staged]
        return self._replay(rec, args, copies)

    def _record_in_pool(self, args):
        """Record in the shared pool; again in a pool of its own if its outputs would land on
        memory another live graph writes."""
        key = object()
        rec = record(self.call, args, self.staged_positions, _DRIVER.pool(), key)
        if rec.pool is not None and rec.pool.conflicts(key, rec.owned_ptrs()):
            rec.close()
            self._note("private", f"{self.name}: its outputs would share memory another graph "
                       "writes; recorded in a pool of its own")
            rec = record(self.call, args, self.staged_positions, _DRIVER.pool(private=True), key)
        return rec

    def _break(self, what: str, e: Exception) -> None:
        """The fallback state: report the driver's error once, run directly from now on."""
        self.broken = f"{type(e).__name__}: {e}"
        if self.rec is not None:
            self.rec.close()
            self.rec = None
        text = (f"{self.name}: {what} the CUDA graph failed ({self.broken}); running the compiled "
                "code directly from now on")
        self._note("broken", text)
        warnings.warn(f"stax.compile(mode='reduce-overhead'): {text}", RuntimeWarning, stacklevel=4)

    def release(self) -> None:
        """Give the graph and its memory back now (also done when this object is collected)."""
        rec, self.rec = self.rec, None
        if rec is not None:
            rec.close()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass


# ---- §9.9 The entry: which artifacts are wrapped ----

_CPU_NOTED = [False]
_C_NOTED = [None]          # the reason last logged that the C replay is not used


def wrap(call, graph, module, *, name: str, device: str, dynamic: bool, log, keep_outputs=False):
    """`call` wrapped for replay from a CUDA graph (mode='reduce-overhead'), or `call` itself
    when §9.9 does not apply, with a `cudagraphs` log line saying why. `keep_outputs`: outputs
    still referenced at the next replay are copied out first (a training backward's gradients)."""
    if not str(device).startswith("cuda"):
        if not _CPU_NOTED[0]:
            _CPU_NOTED[0] = True
            log("cudagraphs", name, "mode='reduce-overhead' on the CPU: CUDA graphs are a GPU "
                "feature; the compiled C++ code runs as usual")
        return call
    if dynamic or any(getattr(s, "free_symbols", None) for n in graph.inputs for s in n.meta.shape):
        log("cudagraphs", name, f"{name} is not wrapped in a CUDA graph: dynamic mode (§10.4) "
            "serves many shapes from one artifact, and a graph replays one fixed shape")
        return call
    if not module.kernels:
        log("cudagraphs", name, f"{name} is not wrapped in a CUDA graph: it launches no kernel")
        return call
    reasons = static_reasons(graph, module)
    if reasons:
        log("cudagraphs", name, f"{name} is not wrapped in a CUDA graph:\n  " + "\n  ".join(reasons))
        return call
    why = _DRIVER.unavailable()
    if why is not None:
        log("cudagraphs", name, f"{name} is not wrapped in a CUDA graph: {why}")
        return call
    slow = cudagraph_c.unavailable()       # (the extension is built here, at compile time, once)
    if slow is not None and _C_NOTED[0] != slow:
        _C_NOTED[0] = slow
        log("cudagraphs", name, "the replay of a call's same tensors runs in Python (the generated "
            f"replay), not in C: {slow}")
    return GraphedCall(call, name, mutated_positions(graph), log, keep_outputs)
