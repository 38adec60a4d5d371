"""The host caching allocator (stax/memory.py) and the CPU wrappers' outputs that come from it.

Soundness first: a block goes back to the free list only when nothing can see its memory (the
tensor, its storage, a view, an array from .numpy()/np.asarray, a memoryview); then reuse (the
statistics show it), threads, zero-size outputs, the cap and empty_cache. No timing."""

import gc
import threading

import numpy as np
import pytest

import stax
from stax import memory

N = 1024 * 1024            # float32 elements: 4 MiB, above memory.SMALL_LIMIT (pooled)


def _stats():
    return stax.memory_stats()


@pytest.fixture
def double():
    f = stax.compile(lambda x: x * 2)
    x = stax.from_numpy(np.arange(N, dtype=np.float32).reshape(1024, 1024))
    f(x)                                    # compile; the first call's temporaries go away
    gc.collect()
    return f, x


def _addr_range(a):
    a = np.asarray(a)
    return a.__array_interface__["data"][0], a.nbytes


def test_api_and_keys():
    s = stax.memory_stats()
    for k in ("allocated_bytes", "reserved_bytes", "cached_bytes", "peak_allocated_bytes",
              "peak_reserved_bytes", "num_allocs", "num_frees", "num_cache_hits", "num_os_allocs",
              "num_os_frees", "cache_limit_bytes"):
        assert isinstance(s[k], int), k
    assert s["reserved_bytes"] == s["allocated_bytes"] + s["cached_bytes"]
    assert stax.empty_cache is memory.empty_cache
    assert stax.reset_peak_memory_stats is memory.reset_peak_memory_stats


def test_empty_is_flat_writable_aligned():
    a = memory.empty(N, np.float32)
    assert a.shape == (N,) and a.dtype == np.float32 and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % 4096 == 0
    a[:] = 3
    assert float(a.sum()) == 3 * N
    small = memory.empty(10, np.int64)
    assert small.shape == (10,) and small.dtype == np.int64
    for dt in (np.float64, np.uint16, np.bool_, np.int32):
        b = memory.empty(N, dt)
        assert b.dtype == dt and b.shape == (N,)


def test_zero_size():
    a = memory.empty(0, np.float32)
    assert a.shape == (0,)
    f = stax.compile(lambda x: x + 1)
    out = f(stax.zeros(0, 1024))
    assert tuple(out.shape) == (0, 1024)
    out2 = f(stax.zeros(0, 1024))
    assert out2.numpy().size == 0


def test_block_returns_when_tensor_dropped_and_is_reused(double):
    f, x = double
    gc.disable()                     # outputs must be freed by reference counting alone
    try:
        s0 = _stats()
        out = f(x)
        addr = out.data_ptr()
        assert _stats()["allocated_bytes"] >= s0["allocated_bytes"] + N * 4
        del out
        s1 = _stats()
        assert s1["allocated_bytes"] == s0["allocated_bytes"]
        assert s1["num_frees"] == s0["num_frees"] + 1
        out = f(x)
        s2 = _stats()
        assert s2["num_cache_hits"] == s1["num_cache_hits"] + 1
        assert s2["num_os_allocs"] == s1["num_os_allocs"]
        assert out.data_ptr() == addr                    # the same block again
        np.testing.assert_array_equal(out.numpy(), np.arange(N, dtype=np.float32).reshape(1024, 1024) * 2)
    finally:
        gc.enable()


def _check_never_overwritten(f, x, keep, expected):
    """Call f many times while `keep` (something derived from an output) is the only reference;
    no new output may share its memory and its values must not change."""
    lo, n = _addr_range(keep)
    outs = []
    for i in range(6):
        o = f(x * 0 + i)                 # different values every call
        p = o.data_ptr()
        assert not (lo <= p < lo + n or p <= lo < p + o.numel() * 4)
        outs.append(o)
        if i % 2:
            outs.clear()                 # free some so that the pool has blocks to hand out
    np.testing.assert_array_equal(np.asarray(keep), expected)


def test_kept_output_is_not_overwritten(double):
    f, x = double
    out = f(x)
    _check_never_overwritten(f, x, out.numpy(), np.asarray(x.numpy()) * 2)


def test_numpy_view_kept_after_tensor_dropped(double):
    f, x = double
    want = np.asarray(x.numpy()) * 2
    cases = [
        lambda t: t.numpy(),                       # the whole array
        lambda t: t.numpy()[3:, ::2],              # a strided numpy view of it
        lambda t: np.asarray(t)[100],              # through __array__
        lambda t: t[5:9].numpy(),                  # a Tensor view, then numpy
        lambda t: t.t().numpy().T,                 # permuted views both ways
        lambda t: np.frombuffer(memoryview(t.numpy()), np.float32),   # a buffer export
        lambda t: t.numpy().reshape(-1)[::7],
    ]
    slices = [lambda a: a, lambda a: a[3:, ::2], lambda a: a[100], lambda a: a[5:9],
              lambda a: a, lambda a: a.reshape(-1), lambda a: a.reshape(-1)[::7]]
    for make, sl in zip(cases, slices):
        out = f(x)
        keep = make(out)
        del out
        gc.collect()
        _check_never_overwritten(f, x, keep, sl(want))


def test_storage_kept_alive_by_view_tensor(double):
    f, x = double
    out = f(x)
    v = out[10:20]                   # a Tensor view shares the Storage
    del out
    gc.collect()
    s = _stats()
    _check_never_overwritten(f, x, v.numpy(), np.asarray(x.numpy())[10:20] * 2)
    assert _stats()["allocated_bytes"] >= s["allocated_bytes"]
    del v


def test_pooled_memory_freed_only_when_last_view_dies():
    s0 = _stats()
    a = memory.empty(N, np.float32)
    v = a[::3]
    mv = memoryview(a)
    del a
    assert _stats()["allocated_bytes"] == s0["allocated_bytes"] + memory.round_size(N * 4)
    del v
    assert _stats()["allocated_bytes"] == s0["allocated_bytes"] + memory.round_size(N * 4)
    del mv
    assert _stats()["allocated_bytes"] == s0["allocated_bytes"]


def test_threads(double):
    f, _ = double
    errors = []
    ref = np.arange(N, dtype=np.float32).reshape(1024, 1024)

    def work(k):
        try:
            x = stax.from_numpy(ref + k)
            for i in range(15):
                out = f(x)
                held = out if i % 3 == 0 else None          # keep some across calls
                np.testing.assert_array_equal(out.numpy(), (ref + k) * 2)
                a = memory.empty(N + 17 * k, np.float32)   # raw allocations race too
                a[:] = k
                assert (a == k).all()
                del out, a
                if held is not None:
                    np.testing.assert_array_equal(held.numpy(), (ref + k) * 2)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    s0 = _stats()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[0]
    gc.collect()
    s1 = _stats()
    assert s1["allocated_bytes"] == s0["allocated_bytes"]
    assert s1["num_cache_hits"] > s0["num_cache_hits"]


def test_cap_and_empty_cache():
    memory.empty_cache()
    old = memory.set_cache_limit(memory.round_size(N * 4))      # room for one block
    try:
        s0 = _stats()
        assert s0["cached_bytes"] == 0
        a, b = memory.empty(N, np.float32), memory.empty(N, np.float32)
        del a, b
        s1 = _stats()
        assert s1["cached_bytes"] == memory.round_size(N * 4)    # one kept, one let go
        assert s1["num_os_frees"] == s0["num_os_frees"] + 1
        c = memory.empty(N, np.float32)
        assert _stats()["num_cache_hits"] == s1["num_cache_hits"] + 1
        del c
        memory.empty_cache()
        s2 = _stats()
        assert s2["cached_bytes"] == 0 and s2["reserved_bytes"] == s2["allocated_bytes"]
    finally:
        memory.set_cache_limit(old)


def test_best_fit_reuses_larger_block_but_not_too_large():
    memory.empty_cache()
    big = memory.empty(3 * N, np.float32)        # 12 MiB block
    del big
    s = _stats()
    a = memory.empty(2 * N, np.float32)          # 8 MiB: 12 < 2 * 8, reused
    assert _stats()["num_cache_hits"] == s["num_cache_hits"] + 1
    del a
    s = _stats()
    b = memory.empty(N, np.float32)              # 4 MiB: 12 >= 2 * 4, a new block
    assert _stats()["num_cache_hits"] == s["num_cache_hits"]
    del b
    memory.empty_cache()


def test_peak_and_reset():
    memory.reset_peak_memory_stats()
    s0 = _stats()
    a = memory.empty(4 * N, np.float32)
    assert _stats()["peak_allocated_bytes"] >= s0["allocated_bytes"] + 16 * 2**20
    del a
    memory.reset_peak_memory_stats()
    s1 = _stats()
    assert s1["peak_allocated_bytes"] == s1["allocated_bytes"]
