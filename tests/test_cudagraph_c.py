"""§9.9 CUDA graphs, the replay of the same tensors in C (stax/cudagraph_c.py, cudagraph_replay.c).

With tests/test_cudagraph.py's fake driver: the C replay's launch and copies call its Python
callables, or, with `raw_launch`/`raw_copy` on the fake, the extension's C stubs (`stubs()`: the
driver's signatures, counting calls, returning the rc they are told), which stand for the raw
cuGraphLaunch / cuMemcpyDtoDAsync_v2 calls the GPU makes. Covered: identity hits and misses, grad
mode, the token after a recording again, the overwritten-output error, the lock held by another
thread, driver failures (both kinds of launch), CompiledFunction's C entry, and the Python replay
when the extension cannot be built.
"""
from __future__ import annotations

import gc
import sys
from collections import deque
import threading
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

import stax
from conftest import assert_close, call_from_threads
from stax import cudagraph, cudagraph_c
from test_cudagraph import (FakeDriver, FakeGraph, chain, chain_ref, cuda_randn, fake, graphed,  # noqa: F401
                            many, many_ref)

pytestmark = pytest.mark.skipif(cudagraph_c.module() is None, reason=f"no C replay: {cudagraph_c.unavailable()}")


def is_c(replay) -> bool:
    return type(replay).__name__ == "Replay"


def replaying(fn, args, n=4):
    f = stax.compile(fn, mode="reduce-overhead")
    for _ in range(n):                       # warm-up, record, replay, replay (through the C replay)
        out = f(*args)
    return f, out


class RawGraph(FakeGraph):
    """A fake graph whose replay is the C stub (nothing runs: only what the host does is real)."""

    def raw_launch(self):
        return (cudagraph_c.module().stubs()[0], 0, 0, self)


class RawDriver(FakeDriver):
    def graph(self):
        return RawGraph(self)

    def raw_copy(self):
        return (cudagraph_c.module().stubs()[1], 0)


@pytest.fixture
def raw():
    driver = RawDriver()
    old = cudagraph.set_driver(driver)
    mod = cudagraph_c.module()
    mod.stubs(0)
    try:
        yield mod
    finally:
        mod.stubs(0)
        cudagraph.set_driver(old)


def test_the_c_replay_serves_and_equals_eager(fake, rng):
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    f, out = replaying(many, args)
    assert is_c(f._fast.hot) and type(stax.CompiledFunction.__dict__["__call__"]).__name__ == "Entry"
    assert f._fast.hot.direct_lock == (sys.version_info < (3, 13))     # (3.13's lock is another struct)
    assert not f._fast.hot.raw_launch and not f._fast.hot.raw_copy     # (the fake driver's callables)
    calls = f.stats["calls"]
    for k in range(3):
        args[0].copy_(stax.from_numpy(rng.standard_normal((5, 7)).astype(np.float32) + k))
        assert_close(f(*args).cpu(), many_ref(*args), stax.float32)
    assert f.stats["calls"] == calls + 3 and graphed(f).stats["replays"] == 6
    assert_close(f.__call__(*args).cpu(), many_ref(*args), stax.float32)    # (bound through the entry)
    python = cudagraph_c._ENTRIES[stax.CompiledFunction]
    assert f.__call__.__func__.__wrapped__ is python and f.__call__.__qualname__ == python.__qualname__


def test_identity_hits_and_misses(fake, rng):
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    f, _ = replaying(many, args, 4)
    g = graphed(f)
    hot = g.replayer(g.rec.again, 17)
    assert is_c(hot)
    replays = g.stats["replays"]
    for i in (0, 8, 16):
        other = list(args)
        other[i] = args[i].clone()
        assert hot(other, False) is False and hot(tuple(other), True) is False
    assert hot(args[:16], False) is False and hot(args + [args[0]], True) is False and hot([], True) is False
    assert g.stats["replays"] == replays
    assert_close(hot(args, True)[0].cpu(), many_ref(*args), stax.float32)
    assert_close(hot(tuple(args), False)[0].cpu(), many_ref(*args), stax.float32)
    assert_close(hot(deque(args), True)[0].cpu(), many_ref(*args), stax.float32)  # (the Python replay)
    with pytest.raises(TypeError):           # (as the Python replay: no len())
        hot(iter(args), True)
    assert g.stats["replays"] == replays + 3
    with pytest.raises(TypeError):
        hot(args)


def test_grad_mode(fake, rng):
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    f, _ = replaying(many, args, 4)
    g = graphed(f)
    hot = g.replayer(g.rec.again, 17)
    assert hot(args, True)[0] is not None    # requires_grad read False everywhere (and remembered)
    for i in (0, 9, 16):
        args[i].requires_grad = True         # a change the C replay must see, remembered or not
        assert hot(args, True) is False and hot(args, 1) is False
        assert hot(args, False)[0] is not None and hot(args, 0)[0] is not None
        out = f(*args)                       # the training path
        assert out.requires_grad and out.grad_fn is not None
        args[i].requires_grad = False
        assert hot(args, True)[0] is not None
    args[3].__dict__["requires_grad"] = 1    # not a bool: the Python replay decides (truthy)
    assert hot(args, True) is False
    args[3].__dict__["requires_grad"] = False
    with stax.no_grad():
        assert_close(f(*args).cpu(), many_ref(*args), stax.float32)
    assert_close(f(*args).cpu(), many_ref(*args), stax.float32)


def test_token_after_recording_again(fake, rng):
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    f = stax.compile(many, mode="reduce-overhead")
    f(cuda_randn(rng, 5, 7), *args[1:])      # warm-up at another first address: it is staged
    for _ in range(3):
        f(*args)
    g = graphed(f)
    assert 0 in g.rec.staged
    token, rec = g.rec.again, g.rec
    hot = g.replayer(token, 17)
    g([args[0].clone()] + args[1:])          # another first tensor: the recording remembers it
    assert g.rec is rec and hot(args, True) is None
    moved = list(args)
    moved[5] = args[5].clone()
    g(moved)                                 # an unstaged input moved: recorded again
    assert g.rec is not rec and hot(args, True) is None and hot(args, False) is None
    for _ in range(3):                       # the old tensors: the new recording's own C replay
        assert_close(f(*args).cpu(), many_ref(*args), stax.float32)
    assert is_c(f._fast.hot) and f._fast.hot is not hot and g.broken is None


def test_overwritten_outputs_raise(fake, rng):
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f, first = replaying(chain, [x, w])
    assert is_c(f._fast.hot)
    kept = first.clone()
    second = f(x, w)
    with pytest.raises(cudagraph.OverwrittenOutputError, match=r"\.clone\(\)"):
        first.cpu()
    with pytest.raises(cudagraph.OverwrittenOutputError):
        f(first, w)
    assert_close(kept.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert_close(second.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    made = stax.Tensor._make(second._storage, second._meta)   # made as Recording.outputs makes it
    assert vars(second).keys() == vars(made).keys() and list(vars(second)) == list(vars(made))
    assert {k: v for k, v in vars(second).items() if k != "_storage"} == \
        {k: v for k, v in vars(made).items() if k != "_storage"}
    assert type(second._storage.data) is cudagraph.GraphOutputArray and second._storage.version == 0


def test_several_outputs_and_a_tuple_result(fake, rng):
    """Two outputs over two buffers: `rec.outputs(cell)` from C; the entry's `fast.result`."""
    def two(x, w):
        return stax.sin(x) * w, (x + w).sum(-1)
    x, w = cuda_randn(rng, 4, 9), cuda_randn(rng, 9)
    f, _ = replaying(two, [x, w], 4)
    assert is_c(f._fast.hot) and graphed(f).rec.single is None
    a, b = f(x, w)
    xs, ws = np.asarray(x.cpu(), np.float64), np.asarray(w.cpu(), np.float64)
    assert_close(a.cpu(), np.sin(xs) * ws, stax.float32)
    assert_close(b.cpu(), (xs + ws).sum(-1), stax.float32)
    f(x, w)
    with pytest.raises(cudagraph.OverwrittenOutputError):
        a.cpu()


def test_the_entry_leaves_other_calls_to_python(fake, rng):
    """Keywords, a tracer (called inside another compiled function), another matmul precision:
    the Python __call__ decides, as without the entry."""
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f, _ = replaying(chain, [x, w])
    assert_close(f(x, w=w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    outer = stax.compile(lambda x, w: f(x, w) * 2)
    assert_close(outer(x, w).cpu(), chain_ref(x.cpu(), w.cpu()) * 2, stax.float32)
    old = stax.get_float32_matmul_precision()
    stax.set_float32_matmul_precision("high")
    try:
        assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    finally:
        stax.set_float32_matmul_precision(old)
    for _ in range(3):
        assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert graphed(f).broken is None


def test_lock_held_by_another_thread(fake, rng):
    """A replay waits for the lock (a host read of an output holds it): the C replay neither
    skips it nor spins holding the GIL."""
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f, _ = replaying(chain, [x, w])
    g = graphed(f)
    done = []
    g._lock.acquire()
    try:
        t = threading.Thread(target=lambda: done.append(f(x, w)))
        t.start()
        time.sleep(0.2)
        assert not done and t.is_alive()     # waiting, and this thread still runs (GIL released)
        replays = g.stats["replays"]
    finally:
        g._lock.release()
    t.join(10)
    assert done and g.stats["replays"] == replays + 1 and not g._lock.locked()
    assert_close(done[0].cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)


class CountingLock:
    """Not a _thread.lock: the C replay calls its methods."""

    def __init__(self):
        self.inner, self.calls = threading.Lock(), 0

    def acquire(self):
        self.calls += 1
        return self.inner.acquire()

    def release(self):
        self.inner.release()

    def locked(self):
        return self.inner.locked()


def test_a_lock_of_another_kind_is_called(fake, rng, monkeypatch):
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f, _ = replaying(chain, [x, w])
    g = graphed(f)
    lock = CountingLock()
    monkeypatch.setattr(g, "_lock", lock)
    hot = g.replayer(g.rec.again, 2)
    for _ in range(3):
        assert_close(hot([x, w], True)[0].cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert lock.calls == 3 and not lock.locked()


def test_threads_replaying_at_once(fake, rng):
    f = stax.compile(chain, mode="reduce-overhead")
    w = cuda_randn(rng, 33)
    xs = [cuda_randn(rng, 7, 33) for _ in range(3)]
    for _ in range(3):
        f(xs[0], w)
    refs = [chain_ref(x.cpu(), w.cpu()) for x in xs]
    bad, n, _ = call_from_threads(f, xs, w, refs, [[0] * 40, [0, 1, 2] * 13])
    g = graphed(f)
    assert not bad and n > 0 and g.stats["replays"] + g.stats["direct"] == 82 and g.broken is None


# ---- raw launches and copies (the C stubs in the driver's place) ----


def test_raw_launch_and_copies(raw, rng):
    f = stax.compile(chain, mode="reduce-overhead")
    w = cuda_randn(rng, 33)
    f(cuda_randn(rng, 7, 33), w)
    f(cuda_randn(rng, 7, 33), w)             # recorded with the first input staged
    x = cuda_randn(rng, 7, 33)
    f(x, w)
    f(x, w)                                  # (the C replay made on the first repeat)
    assert is_c(f._fast.hot) and f._fast.hot.raw_launch and f._fast.hot.raw_copy
    _, _, launches, copies, _ = raw.stubs()
    for _ in range(3):
        out = f(x, w)
    _, _, launches2, copies2, _ = raw.stubs()
    assert launches2 - launches == 3 and copies2 - copies == 3
    assert out.shape == (7, 33) and type(out._storage.data) is cudagraph.GraphOutputArray
    g = graphed(f)
    assert g.stats["copies"] >= 5 and g.broken is None


@pytest.mark.parametrize("what", ["launch", "copy"])
def test_raw_failure_breaks_the_graph_once(raw, rng, what, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    f = stax.compile(chain, mode="reduce-overhead")
    x, w = cuda_randn(rng, 7, 33), cuda_randn(rng, 33)
    f(cuda_randn(rng, 7, 33) if what == "copy" else x, w)     # a copy: x staged from the recording
    for _ in range(3):
        f(x, w)
    assert is_c(f._fast.hot) and bool(graphed(f).rec.staged) == (what == "copy")
    raw.stubs(719)
    # (719 is CUDA_ERROR_LAUNCH_FAILED: a real driver names it, the fake library does not)
    with pytest.warns(RuntimeWarning, match="CUDA_ERROR_(719|LAUNCH_FAILED) in " + (
            "cuGraphLaunch" if what == "launch" else r"cuMemcpyDtoDAsync_v2\(0x")):
        out = f(x, w)                        # the replay failed: this call runs directly
    raw.stubs(0)
    assert_close(out.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    g = graphed(f)
    assert g.broken is not None and g.rec is None
    assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert capsys.readouterr().err.count("failed (CudaError") == 1


def test_callable_failure_breaks_the_graph_once(fake, rng):
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f, _ = replaying(chain, [x, w])
    assert is_c(f._fast.hot)
    fake.fail_replay = True
    with pytest.warns(RuntimeWarning, match="CUDA_ERROR_LAUNCH_FAILED"):
        out = f(x, w)
    fake.fail_replay = False
    assert_close(out.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert graphed(f).broken is not None and graphed(f).stats["direct"] == 2


def test_a_graph_with_its_c_replay_is_collected(fake, rng):
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f, _ = replaying(chain, [x, w], 4)
    g = graphed(f)
    g([x, w])
    g([x, w])                                # (its own C replay, made on its first repeat)
    assert is_c(f._fast.hot) and g.rec.again[2] is not None and is_c(g.rec.again[2])
    ref = weakref.ref(g)
    del f, g
    gc.collect()
    assert ref() is None


# ---- no extension: the Python replay ----


@pytest.mark.parametrize("why", ["compiler fails", "no compiler", "no Python.h", "off"])
def test_python_replay_when_the_extension_cannot_be_built(fake, rng, monkeypatch, capsys, tmp_path, why):
    python = cudagraph_c._ENTRIES.get(stax.CompiledFunction, stax.CompiledFunction.__dict__["__call__"])
    monkeypatch.setattr(cudagraph_c, "_STATE", {})
    monkeypatch.setattr(cudagraph, "_C_NOTED", [None])
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    if why == "compiler fails":
        cc = tmp_path / "cc"
        cc.write_text("#!/bin/sh\necho 'simulated: cannot compile' >&2\nexit 1\n")
        cc.chmod(0o755)
        monkeypatch.setenv("CC", str(cc))
    elif why == "no compiler":
        monkeypatch.setattr(cudagraph_c, "_compiler", lambda: None)
    elif why == "no Python.h":
        monkeypatch.setattr(cudagraph_c.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    else:
        monkeypatch.setenv("STAX_CUDAGRAPH_C", "0")
    with cudagraph_c.python_entry(stax.CompiledFunction):
        x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
        f, _ = replaying(chain, [x, w], 4)
        assert f._fast.hot is not None and not is_c(f._fast.hot)
        assert stax.CompiledFunction.__dict__["__call__"] is python     # (no entry installed)
        for _ in range(2):
            assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
        err = capsys.readouterr().err
        assert err.count("runs in Python (the generated replay), not in C") == 1
        assert {"compiler fails": "simulated: cannot compile", "no compiler": "no C compiler",
                "no Python.h": "no Python.h", "off": "STAX_CUDAGRAPH_C=0"}[why] in err


# ---- the GPU's path (cffi addresses of a cuda.CUDAGraph, CudaDriver's copies) on a fake libcuda ----

FAKE_LIBCUDA = r"""
#include <stddef.h>
#include <string.h>
typedef unsigned long long u64;
static int rc_next;
static long long launches, copies, contexts;
static void *last_exec, *last_stream;
static u64 last_copy[3];
int cuGraphLaunch(void *exec, void *stream) { launches++; last_exec = exec; last_stream = stream; return rc_next; }
int cuMemcpyDtoDAsync_v2(u64 d, u64 s, size_t n, void *stream)
{
    copies++; last_copy[0] = d; last_copy[1] = s; last_copy[2] = n; last_stream = stream;
    return rc_next;
}
int cuCtxSetCurrent(void *ctx) { contexts++; return 0; }
int cuGetErrorName(int rc, const char **p) { *p = rc == 719 ? "CUDA_ERROR_LAUNCH_FAILED" : "CUDA_ERROR_UNKNOWN"; return 0; }
int cuGetErrorString(int rc, const char **p) { *p = "fake libcuda"; return 0; }
void fake_set(int rc) { rc_next = rc; }
void fake_counts(long long *out, void **where, u64 *copy)
{
    out[0] = launches; out[1] = copies; out[2] = contexts; where[0] = last_exec; where[1] = last_stream;
    memcpy(copy, last_copy, sizeof last_copy);
}
"""


@pytest.fixture
def fake_libcuda(tmp_path, monkeypatch):
    """cuda._state over a fake libcuda.so (the functions a replay calls), from `activate()` on:
    what the H200 runs, with the driver's entry points counting their calls."""
    import shutil
    import subprocess
    from stax import cuda
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src, so = tmp_path / "fakecuda.c", tmp_path / "libfakecuda.so"
    src.write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    ffi = cuda._make_ffi()
    st = cuda._State()
    st.ffi, st.lib = ffi, ffi.dlopen(str(so))
    st.context = ffi.cast("CUcontext", 0xC0)
    st.stream = cuda.Stream._wrap(ffi.cast("CUstream", 0x5170), ffi)
    import cffi
    probe = cffi.FFI()
    probe.cdef("void fake_set(int rc); void fake_counts(long long *out, void **where, unsigned long long *copy);")
    lib = probe.dlopen(str(so))

    def counts():
        out, where, copy = probe.new("long long[3]"), probe.new("void *[2]"), probe.new("unsigned long long[3]")
        lib.fake_counts(out, where, copy)
        return {"launches": out[0], "copies": out[1], "contexts": out[2],
                "exec": int(probe.cast("uintptr_t", where[0])), "stream": int(probe.cast("uintptr_t", where[1])),
                "copy": tuple(copy)}

    def activate():                          # (after compiling: the compiler reads the device too)
        monkeypatch.setattr(cuda, "_state", st)
        monkeypatch.setattr(cuda, "_thread", threading.local())
    yield SimpleNamespace(counts=counts, set=lib.fake_set, ffi=ffi, activate=activate)


def test_the_gpu_path_on_a_fake_libcuda(fake, rng, fake_libcuda, monkeypatch):
    from stax import cuda
    f = stax.compile(chain, mode="reduce-overhead")
    x, w = cuda_randn(rng, 7, 33), cuda_randn(rng, 33)
    f(cuda_randn(rng, 7, 33), w)
    for _ in range(3):
        f(x, w)                              # x staged: one copy per replay
    g = graphed(f)
    rec, token = g.rec, g.rec.again
    fake_libcuda.activate()
    graph = cuda.CUDAGraph()                 # the recording's graph as the GPU's: an exec handle
    graph._exec = fake_libcuda.ffi.cast("CUgraphExec", 0xE7EC)
    monkeypatch.setattr(rec, "graph", graph)
    old = cudagraph.set_driver(cudagraph.CudaDriver())     # (restored before `fake` restores its own)
    try:
        hot = g.replayer(token, 2)
        assert is_c(hot) and hot.raw_launch and hot.raw_copy
        before = g.stats
        out = hot([x, w], True)
        c = fake_libcuda.counts()
        assert c["launches"] == 1 and c["copies"] == 1 and c["contexts"] == 1      # cuda.init: once
        assert c["exec"] == 0xE7EC and c["stream"] == 0x5170
        dst, src, nbytes = token[1][0]
        assert c["copy"] == (dst, src, nbytes) and src == x.data_ptr()
        assert g.stats["copies"] == before["copies"] + 1 and g.stats["replays"] == before["replays"] + 1
        assert type(out[0]._storage.data) is cudagraph.GraphOutputArray
        t = threading.Thread(target=lambda: hot([x, w], True))
        t.start()
        t.join()
        hot([x, w], False)
        assert fake_libcuda.counts()["contexts"] == 2     # a new thread: made current there once
        fake_libcuda.set(719)
        with pytest.warns(RuntimeWarning, match=r"CUDA_ERROR_LAUNCH_FAILED in cuMemcpyDtoDAsync_v2\(0x"):
            assert hot([x, w], True) is None
        assert g.broken is not None and "fake libcuda" in g.broken and g.rec is None
        assert fake_libcuda.counts()["launches"] == 3    # (the failed copy: no launch)
    finally:
        cudagraph.set_driver(old)
        fake_libcuda.set(0)
        graph._exec = None
