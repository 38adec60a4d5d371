"""Host (CPU) caching allocator: runtime support, §7.5 buffer lifetimes / §8 runtime.

A compiled CPU wrapper allocates every output and intermediate buffer with `empty(...)`
(runtime.cpu_wrapper_globals). Fresh numpy allocations of large buffers are mmap'ed by malloc,
faulted in (and zeroed by the kernel) on first touch and unmapped when freed, so every call of a
function with a large output paid page faults, and when huge pages had to be assembled by
compaction it paid them many times over (issue 8, item 6). This module keeps freed large blocks
and hands them out again, like the CUDA caching allocator (cuda.py's `_CachingAllocator`).

Consumes: a number of elements and a numpy dtype (`empty(numel, np_dtype)`).
Produces: a flat, writable, C-contiguous numpy array of that many elements, page aligned when it
comes from the pool; plus `memory_stats()`, `reset_peak_memory_stats()`, `empty_cache()` and
`set_cache_limit()` (reachable as `stax.memory_stats()` etc.).

Ownership (why a block is never reused while anything can still see it): a pooled block is an
anonymous `mmap.mmap` that only the allocator references. Each allocation wraps it in a *fresh*
ctypes array made with `from_buffer` (the "handle"), and the array handed out is
`np.frombuffer(handle, ...)`, whose `.base` is the handle itself. numpy keeps the object that
exports a buffer alive from every array built on it: a view's `.base` chain ends at an ndarray
that holds the handle, `np.asarray`/`as_strided`/`memoryview` keep their source array alive, and
cffi's `from_buffer` keeps the array alive while the cdata lives. So the handle dies only when
nothing that can reach the memory is left, and only its finalizer (`weakref.finalize`) gives the
block back. (A memoryview would not do: `np.frombuffer(memoryview)` takes a *new* memoryview on
the underlying export, and the one handed to it may die while the array lives.)

Finalizers may run in any thread, at any allocation (garbage collection), even while this thread
holds the lock; so a finalizer only appends to a deque (atomic), and every locked operation first
moves the pending blocks to the free lists.

Where to look: `empty` (the entry point), `_HostAllocator.allocate` / `_drain` (the free lists),
`SMALL_LIMIT` (requests below it are plain `np.empty`), `GRANULE`, the cap `cache_limit`
(`STAX_CPU_CACHE_LIMIT` bytes, default min(4 GiB, RAM/8)), `HUGEPAGE` (madvise on new blocks,
`STAX_CPU_HUGEPAGE=0` turns it off).
"""
from __future__ import annotations

import bisect
import collections
import ctypes
import mmap
import os
import threading
import weakref

import numpy as np

__all__ = ["empty", "memory_stats", "reset_peak_memory_stats", "empty_cache", "set_cache_limit",
           "round_size", "SMALL_LIMIT", "GRANULE"]

SMALL_LIMIT = 1 << 20          # requests below 1 MiB: plain np.empty (malloc's own free lists)
GRANULE = 2 << 20              # pooled blocks: multiples of 2 MiB (one transparent huge page)
HUGEPAGE = os.environ.get("STAX_CPU_HUGEPAGE", "1") != "0"


def round_size(nbytes: int) -> int:
    """The block size reserved for a pooled request of nbytes."""
    return (max(int(nbytes), 1) + GRANULE - 1) // GRANULE * GRANULE


def _default_limit() -> int:
    env = os.environ.get("STAX_CPU_CACHE_LIMIT")
    if env:
        return int(env)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    return min(4 << 30, ram // 8)


class _HostAllocator:
    """Free lists per block size; best fit among cached blocks of size in [n, 2n)."""

    def __init__(self, cache_limit: int):
        self.lock = threading.Lock()
        self.cache_limit = cache_limit
        self.free_blocks: dict[int, list[mmap.mmap]] = {}   # block size -> blocks
        self.free_sizes: list[int] = []                      # sorted sizes with cached blocks
        self.pending = collections.deque()                   # (block, size) freed by finalizers
        self.types: dict[int, type] = {}                     # block size -> ctypes array type
        self.allocated_bytes = 0       # bytes of blocks handed out and still alive
        self.cached_bytes = 0          # bytes of free blocks kept for reuse
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0
        self.num_allocs = 0            # pooled requests
        self.num_cache_hits = 0        # ... served by a cached block (reuses)
        self.num_frees = 0             # pooled blocks given back
        self.num_os_allocs = 0         # new mmaps
        self.num_os_frees = 0          # blocks dropped (cap, empty_cache)
        self.num_small_allocs = 0      # requests below SMALL_LIMIT (plain np.empty)

    # -- called by finalizers, in any thread, possibly while this thread holds the lock --
    def _release(self, block, size):
        self.pending.append((block, size))
        if self.lock.acquire(blocking=False):    # file it now when nobody is in the middle
            try:
                self._drain()
            finally:
                self.lock.release()

    def _drain(self):
        """Move blocks freed by finalizers to the free lists (lock held)."""
        pending = self.pending
        while True:
            try:
                block, size = pending.popleft()
            except IndexError:
                return
            self.num_frees += 1
            self.allocated_bytes -= size
            if self.cached_bytes + size > self.cache_limit:
                self.num_os_frees += 1          # over the cap: let the mapping go
                continue
            lst = self.free_blocks.get(size)
            if lst is None:
                self.free_blocks[size] = [block]
                bisect.insort(self.free_sizes, size)
            else:
                lst.append(block)
            self.cached_bytes += size

    def _take_cached(self, size):
        sizes = self.free_sizes
        i = bisect.bisect_left(sizes, size)
        if i < len(sizes) and sizes[i] < 2 * size:
            bsize = sizes[i]
            lst = self.free_blocks[bsize]
            block = lst.pop()
            if not lst:
                del self.free_blocks[bsize]
                sizes.pop(i)
            self.cached_bytes -= bsize
            return block, bsize
        return None

    def _new_block(self, size):
        try:
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        except (OSError, MemoryError):
            self._empty_cache_locked()
            block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        if HUGEPAGE and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                block.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.num_os_allocs += 1
        return block

    def allocate(self, nbytes: int, dtype: np.dtype, count: int) -> np.ndarray:
        size = round_size(nbytes)
        with self.lock:
            self._drain()
            self.num_allocs += 1
            hit = self._take_cached(size)
            if hit is not None:
                self.num_cache_hits += 1
                block, bsize = hit
            else:
                block, bsize = self._new_block(size), size
            self.allocated_bytes += bsize
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
            self.peak_reserved_bytes = max(self.peak_reserved_bytes,
                                           self.allocated_bytes + self.cached_bytes)
            ctype = self.types.get(bsize)
            if ctype is None:
                ctype = self.types[bsize] = ctypes.c_char * bsize
        handle = ctype.from_buffer(block)            # fresh per allocation: its life is the block's
        fin = weakref.finalize(handle, self._release, block, bsize)
        fin.atexit = False
        return np.frombuffer(handle, dtype=dtype, count=count)

    def _empty_cache_locked(self):
        for lst in self.free_blocks.values():
            self.num_os_frees += len(lst)
        self.free_blocks.clear()
        self.free_sizes.clear()
        self.cached_bytes = 0

    def empty_cache(self):
        with self.lock:
            self._drain()
            self._empty_cache_locked()

    def stats(self) -> dict:
        with self.lock:
            self._drain()
            return {
                "allocated_bytes": self.allocated_bytes,
                "reserved_bytes": self.allocated_bytes + self.cached_bytes,
                "cached_bytes": self.cached_bytes,
                "peak_allocated_bytes": self.peak_allocated_bytes,
                "peak_reserved_bytes": self.peak_reserved_bytes,
                "cache_limit_bytes": self.cache_limit,
                "num_allocs": self.num_allocs,
                "num_frees": self.num_frees,
                "num_cache_hits": self.num_cache_hits,
                "num_os_allocs": self.num_os_allocs,
                "num_os_frees": self.num_os_frees,
                "num_small_allocs": self.num_small_allocs,
            }


_ALLOC = _HostAllocator(_default_limit())
if hasattr(os, "register_at_fork"):      # a child forked while another thread held the lock
    os.register_at_fork(after_in_child=lambda: setattr(_ALLOC, "lock", threading.Lock()))


def empty(numel: int, dtype) -> np.ndarray:
    """A flat, uninitialized, writable array of numel elements of the numpy dtype `dtype`;
    from the pool when it has at least SMALL_LIMIT bytes."""
    dtype = np.dtype(dtype)
    numel = int(numel)
    nbytes = numel * dtype.itemsize
    if nbytes < SMALL_LIMIT:
        with _ALLOC.lock:
            _ALLOC.num_small_allocs += 1
        return np.empty(numel, dtype)
    return _ALLOC.allocate(nbytes, dtype, numel)


def memory_stats() -> dict:
    """The host allocator's counters: allocated_bytes (blocks alive), reserved_bytes (alive +
    cached), cached_bytes, peak_allocated_bytes, peak_reserved_bytes, cache_limit_bytes,
    num_allocs, num_frees, num_cache_hits (reuses), num_os_allocs, num_os_frees (pooled requests
    only) and num_small_allocs (requests below SMALL_LIMIT, served by np.empty)."""
    return _ALLOC.stats()


def reset_peak_memory_stats() -> None:
    a = _ALLOC
    with a.lock:
        a._drain()
        a.peak_allocated_bytes = a.allocated_bytes
        a.peak_reserved_bytes = a.allocated_bytes + a.cached_bytes


def empty_cache() -> None:
    """Give every cached (free) block back to the operating system."""
    _ALLOC.empty_cache()


def set_cache_limit(nbytes: int) -> int:
    """Cap the bytes of free blocks kept for reuse (blocks in use are not counted); returns the
    previous cap. Blocks already cached above the new cap are released."""
    a = _ALLOC
    with a.lock:
        a._drain()
        old, a.cache_limit = a.cache_limit, int(nbytes)
        if a.cached_bytes > a.cache_limit:
            a._empty_cache_locked()
    return old
