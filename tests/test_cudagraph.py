"""§9.9 CUDA graphs (stax/cudagraph.py): `stax.compile(mode="reduce-overhead")`.

CPU tests run everywhere with a FAKE driver (`FakeDriver`): its "capture" records the kernel
launches the artifact makes (`CachingAutotuner.run`) without running them, and its "replay" runs
that launch list again on the recorded buffers -- what a CUDA graph does, so the recording logic,
condition 2, the copies into recorded inputs, the fallback state and the overwritten-output error
are all covered without a GPU. `GraphPool` is tested against a fake backing allocator. Tests
marked `gpu` use the real driver and skip cleanly without a GPU.
"""
from __future__ import annotations

import ctypes
import gc
from types import SimpleNamespace

import numpy as np
import pytest

import stax
from conftest import assert_close, call_from_threads
from stax import cuda, cudagraph, triton_heuristics

HAVE_GPU = cuda.is_available() and not cuda.interpreting()
ORIGINAL_RUN = triton_heuristics.CachingAutotuner.run


# ---- the fake driver ----


class FakeGraph:
    def __init__(self, driver):
        self.driver, self.launches = driver, None

    def __enter__(self):
        self.driver.graphs += 1
        recorded = self._recorded = []

        def record_launch(kernel, *args, stream=None):     # captured, not run (as on a stream)
            recorded.append((kernel, args))
        triton_heuristics.CachingAutotuner.run = record_launch
        return self

    def __exit__(self, exc_type, exc, tb):
        triton_heuristics.CachingAutotuner.run = ORIGINAL_RUN
        if exc_type is None:
            if self.driver.fail_record:
                raise cuda.CudaError(900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "cuStreamEndCapture")
            self.launches = self._recorded
        return False

    def replay(self):
        if self.driver.fail_replay:
            raise cuda.CudaError(719, "CUDA_ERROR_LAUNCH_FAILED", "cuGraphLaunch")
        self.driver.replays += 1
        for kernel, args in self.launches:
            ORIGINAL_RUN(kernel, *args)


class FakeDriver:
    def __init__(self):
        self.graphs = self.replays = self.copies = 0
        self.fail_record = self.fail_replay = False

    def unavailable(self):
        return None

    def graph(self):
        return FakeGraph(self)

    def copy(self, dst, src, nbytes):
        self.copies += 1
        if cuda.interpreting():
            ctypes.memmove(dst, src, nbytes)
        else:
            cuda.copy_device_to_device(dst, src, nbytes)

    def pool(self, private=False):
        return None


@pytest.fixture
def fake():
    driver = FakeDriver()
    old = cudagraph.set_driver(driver)
    try:
        yield driver
    finally:
        cudagraph.set_driver(old)
        triton_heuristics.CachingAutotuner.run = ORIGINAL_RUN


def graphed(cf):
    """The GraphedCall of a compiled function's one artifact (None: not wrapped)."""
    (entry,) = cf.artifacts.values()
    call = getattr(entry[0], "inner", entry[0])     # (runtime.GuardedCall: it writes an input)
    return call if isinstance(call, cudagraph.GraphedCall) else None


def chain(x, w):
    return stax.sin(x) + x.sum(-1, keepdim=True) * 1e-3 * w


def chain_ref(x, w):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return np.sin(x) + x.sum(-1, keepdims=True) * 1e-3 * w


def cuda_randn(rng, *shape):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32)).to("cuda")


# ---- recording and replay, condition 2 ----


def test_replay_equals_eager_as_input_values_change(fake, rng):
    x, w = cuda_randn(rng, 7, 33), cuda_randn(rng, 33)
    cf = stax.compile(chain, mode="reduce-overhead")
    for step in range(4):
        x.copy_(stax.from_numpy(rng.standard_normal((7, 33)).astype(np.float32)))   # same address
        out = cf(x, w)
        assert_close(out.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    g = graphed(cf)
    assert g is not None and any(k.startswith("triton_") for k in g.__globals__)
    assert g.stats == {"direct": 1, "records": 1, "replays": 3, "copies": 0}
    assert fake.graphs == 1 and fake.replays == 3


def test_new_addresses_are_copied_into_recorded_inputs(fake, rng):
    cf = stax.compile(chain, mode="reduce-overhead")
    w = cuda_randn(rng, 33)
    first = cuda_randn(rng, 7, 33)
    keep = first.cpu().numpy().copy()
    cf(first, w)
    cf(first, w)                          # recorded at first's address
    for _ in range(3):
        x = cuda_randn(rng, 7, 33)        # a new batch tensor: a new address each call
        assert_close(cf(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    g = graphed(cf)
    assert fake.graphs == 2               # recorded again once, reading a graph-owned copy of x
    assert sorted(g.rec.staged) == [0]
    assert g.stats["copies"] == 3 and g.stats["direct"] == 1
    np.testing.assert_array_equal(first.cpu().numpy(), keep)      # the caller's tensor is untouched


@pytest.mark.parametrize("layout", ["transposed", "broadcast", "sliced"])
def test_copies_of_strided_inputs(fake, rng, layout):
    base = rng.standard_normal((9, 12)).astype(np.float32)

    def make(a):
        t = stax.from_numpy(a).to("cuda")
        if layout == "transposed":
            return t.t()[:7]
        if layout == "broadcast":
            return t[0].expand(7, 12)
        return t[1:8, ::2]
    f = stax.compile(lambda x: stax.exp(x) * 2 + x.sum(0), mode="reduce-overhead")
    for k in range(4):                     # warm-up, then three new addresses: copies from the record on
        a = base + k
        x = make(a)
        ref = np.exp(np.asarray(x.cpu(), np.float64)) * 2 + np.asarray(x.cpu(), np.float64).sum(0)
        assert_close(f(x).cpu(), ref, stax.float32)
    assert graphed(f).stats["copies"] == 3 and graphed(f).stats["records"] == 1


def test_condition_2_count_and_layout_run_directly(fake, rng):
    inner = stax.compile(lambda x: stax.cos(x) * 3)
    g = cudagraph.GraphedCall(lambda args: (inner(*args),), "inner")
    x = cuda_randn(rng, 5, 6)
    for _ in range(3):
        (out,) = g([x])
    assert g.stats["replays"] == 2
    y = cuda_randn(rng, 6, 5)              # another shape: condition 2 fails, run directly
    (out,) = g([y])
    assert_close(out.cpu(), np.cos(np.asarray(y.cpu(), np.float64)) * 3, stax.float32)
    z = cuda_randn(rng, 5, 6).t().contiguous().t()    # same shape, other strides
    assert z.stride() != x.stride()
    (out,) = g([z])
    assert_close(out.cpu(), np.cos(np.asarray(z.cpu(), np.float64)) * 3, stax.float32)
    assert g.stats["direct"] == 3 and g.stats["records"] == 1
    with pytest.raises(TypeError):          # a different argument count also runs directly
        g([x, x])
    (out,) = g([x])                        # the recording still serves the recorded layout
    assert g.stats["replays"] == 3


def test_bfloat16_and_default_mode(fake, rng):
    a, b = rng.standard_normal((5, 24)), rng.standard_normal(24)
    x = stax.from_numpy(a.astype(np.float32)).to("cuda").to(stax.bfloat16)
    w = stax.from_numpy(b.astype(np.float32)).to("cuda").to(stax.bfloat16)
    f = stax.compile(chain, mode="reduce-overhead")
    plain = stax.compile(chain)
    for _ in range(3):
        out = f(x, w)
        assert out.dtype is stax.bfloat16
        assert_close(out.float().cpu(), chain_ref(x.float().cpu(), w.float().cpu()), stax.bfloat16)
        np.testing.assert_array_equal(out.float().cpu().numpy(), plain(x, w).float().cpu().numpy())
    assert graphed(f).stats["replays"] == 2 and graphed(plain) is None


def test_special_values_and_empty(fake):
    a = np.array([[0.0, -0.0, np.inf], [-np.inf, np.nan, 1e-30]], np.float32)
    f = stax.compile(lambda x: stax.sin(x) + x.sum(-1, keepdim=True), mode="reduce-overhead")
    x = stax.from_numpy(a).to("cuda")
    for _ in range(3):
        out = f(x).cpu().numpy()
    ref = np.sin(a.astype(np.float64)) + a.astype(np.float64).sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    empty = stax.from_numpy(np.zeros((0, 4), np.float32)).to("cuda")
    g = stax.compile(lambda x: x * 2, mode="reduce-overhead")
    for _ in range(3):
        assert g(empty).shape == (0, 4)


def test_input_written_in_place(fake, rng):
    def bump(x, y):
        x.add_(y)
        return x * 2
    f = stax.compile(bump, mode="reduce-overhead")
    x, y = cuda_randn(rng, 4, 5), cuda_randn(rng, 4, 5)
    expect = np.asarray(x.cpu(), np.float64)
    for _ in range(4):                     # the write reaches the caller's x on every replay
        out = f(x, y)
        expect = expect + np.asarray(y.cpu(), np.float64)
        assert_close(x.cpu(), expect, stax.float32)
        assert_close(out.cpu(), expect * 2, stax.float32)
    x2 = cuda_randn(rng, 4, 5)             # moved: not copied (the write must reach x2): direct
    ref = np.asarray(x2.cpu(), np.float64) + np.asarray(y.cpu(), np.float64)
    out = f(x2, y)
    assert_close(x2.cpu(), ref, stax.float32)
    assert_close(out.cpu(), ref * 2, stax.float32)
    assert graphed(f).stats["direct"] == 2


# ---- memory: outputs are overwritten by the next replay ----


def test_reading_an_overwritten_output_raises(fake, rng):
    f = stax.compile(chain, mode="reduce-overhead")
    x, w = cuda_randn(rng, 6, 10), cuda_randn(rng, 10)
    f(x, w)
    first = f(x, w)                        # a replay's output
    kept = first.clone()
    second = f(x, w)
    with pytest.raises(cudagraph.OverwrittenOutputError, match=r"\.clone\(\)"):
        first.cpu()
    with pytest.raises(cudagraph.OverwrittenOutputError):
        f(first, w)                        # nor may it be passed back in
    assert_close(kept.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert_close(second.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)


def test_output_fed_back_as_input(fake, rng):
    f = stax.compile(lambda x: stax.sin(x) * 0.5 + 0.1, mode="reduce-overhead")
    x = cuda_randn(rng, 3, 17)
    ref = np.asarray(x.cpu(), np.float64)
    for _ in range(5):                     # y = f(y): copied into the recorded input, then replayed
        x = f(x)
        ref = np.sin(ref) * 0.5 + 0.1
    assert_close(x.cpu(), ref, stax.float32)


def test_an_output_passed_twice_is_checked_each_time(fake, rng):
    f = stax.compile(lambda x: stax.cos(x) + 1, mode="reduce-overhead")
    x = cuda_randn(rng, 4, 9)
    f(x)
    y = f(x)
    z = f(y)                               # y is current: copied in, then overwritten by the replay
    assert_close(z.cpu(), np.cos(np.cos(np.asarray(x.cpu(), np.float64)) + 1) + 1, stax.float32)
    with pytest.raises(cudagraph.OverwrittenOutputError):
        f(y)


# ---- the host path of a call with the last call's tensors (issue 13: host µs per replay) ----


def test_same_tensors_again_still_copy_staged_inputs(fake, rng):
    """`Recording.again`: the same tensors skip the per-input checks, but a staged input (one
    that moved since recording) is still copied in on every call, so new values are seen."""
    f = stax.compile(chain, mode="reduce-overhead")
    w = cuda_randn(rng, 33)
    f(cuda_randn(rng, 7, 33), w)
    f(cuda_randn(rng, 7, 33), w)             # another address than the warm-up's: recorded staged
    x = cuda_randn(rng, 7, 33)
    for k in range(4):                       # the same tensor object, its values rewritten
        x.copy_(stax.from_numpy((rng.standard_normal((7, 33)) + k).astype(np.float32)))
        assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    g = graphed(f)
    assert g.rec.again is not None and g.rec.again[0][0] is x
    assert g.stats["copies"] == 5 and fake.copies == 5      # the recording call, then each of the 4
    assert g.stats["records"] == 1


def test_same_tensors_again_after_a_layout_miss(fake, rng):
    """A call that fails condition 2 between two calls with the remembered tensors leaves the
    recording intact; a graph output passed in is never remembered (it must be checked)."""
    f = stax.compile(lambda x: stax.cos(x) + 1, mode="reduce-overhead")
    x = cuda_randn(rng, 4, 9)
    f(x)
    f(x)
    f(cuda_randn(rng, 9, 4))                 # another shape: another artifact, no effect here
    y = f(x)
    assert graphed_calls(f)[(4, 9)].rec.again[0][0] is x
    z = f(y)                                 # an output of ours: copied in, never remembered
    assert graphed_calls(f)[(4, 9)].rec.again is None
    assert_close(z.cpu(), np.cos(np.cos(np.asarray(x.cpu(), np.float64)) + 1) + 1, stax.float32)
    with pytest.raises(cudagraph.OverwrittenOutputError):
        f(y)


def test_the_last_calls_token_is_that_calls_own(fake, rng):
    """`GraphedCall.replay_again` (the call with the last call's tensors, told so by
    `specialize.LastCall`) replays only on the token of that very call: a call that ran directly
    (an input written in place moved) leaves no token, so the next same call is checked again
    and also runs directly, writing its own tensor, never the one recorded."""
    def bump(x, y):
        x.add_(y)
        return x * 2
    f = stax.compile(bump, mode="reduce-overhead")
    x1, y = cuda_randn(rng, 4, 5), cuda_randn(rng, 4, 5)
    for _ in range(3):                       # warm-up, record, replay with the same tensors
        f(x1, y)
    keep1 = x1.cpu().numpy().copy()
    x2 = cuda_randn(rng, 4, 5)
    expect = np.asarray(x2.cpu(), np.float64)
    for _ in range(3):                       # the same new tensor three times: direct each time
        out = f(x2, y)
        expect = expect + np.asarray(y.cpu(), np.float64)
        assert_close(x2.cpu(), expect, stax.float32)
        assert_close(out.cpu(), expect * 2, stax.float32)
    np.testing.assert_array_equal(x1.cpu().numpy(), keep1)
    assert graphed(f).stats["direct"] == 4
    for _ in range(2):                       # back to the recorded tensor: replays (token path)
        f(x1, y)
    assert_close(x1.cpu(), keep1.astype(np.float64) + 2 * np.asarray(y.cpu(), np.float64), stax.float32)


def many(x, *params):                    # issue 13's input count: x, then 4 layers of w, b, gamma, beta
    h = x
    for p in params:
        h = h * 0.5 + p
    return stax.sin(h)


def many_ref(x, *params):
    h = np.asarray(x.cpu(), np.float64)
    for p in params:
        h = h * 0.5 + np.asarray(p.cpu(), np.float64)
    return np.sin(h)


def test_generated_replay_checks_every_position(fake, rng):
    """`GraphedCall.replayer`: the generated replay refuses (False, nothing launched) another
    tensor in any position (the first, a middle one, the 17th, even with the same data and
    layout), another arity, and under grad a tensor that requires grad now; it replays the
    very tensors, and refuses (None) once the graph remembers another call's tensors."""
    f = stax.compile(many, mode="reduce-overhead")
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    f(cuda_randn(rng, 5, 7), *args[1:])      # warm-up at another first address: it is staged
    for _ in range(3):                       # record, replay (remembered), replay (generated)
        f(*args)
    g = graphed(f)
    assert 0 in g.rec.staged
    token = g.rec.again
    hot = g.replayer(token, 17)
    assert hot is not None and f._fast.hot is not None
    replays = g.stats["replays"]
    for i in (0, 8, 16):
        other = list(args)
        other[i] = args[i].clone()           # equal values, equal layout: still another tensor
        assert hot(other, False) is False and hot(other, True) is False
    assert hot(args[:16], False) is False and hot(args + [args[0]], False) is False
    assert g.stats["replays"] == replays     # none of those launched
    args[16].requires_grad = True
    assert hot(args, True) is False
    out = hot(tuple(args), False)            # (grad mode off: requires_grad is not this call's business)
    assert g.stats["replays"] == replays + 1
    assert_close(out[0].cpu(), many_ref(*args), stax.float32)
    args[16].requires_grad = False
    rec = g.rec
    g([args[0].clone()] + args[1:])          # another first tensor (copied in): remembered instead
    assert g.rec is rec and g.rec.again is not token
    assert hot(args, False) is None and g.stats["replays"] == replays + 2
    moved = list(args)
    moved[5] = args[5].clone()               # an unstaged position moved: recorded again
    g(moved)
    assert g.rec is not rec and hot(args, False) is None
    assert g.broken is None and g.stats["records"] == 2


def test_last_call_replay_leaves_for_the_slow_path(fake, rng):
    """The whole call's generated replay (`LastCall.hot`) replays only the very tensors: a
    tensor that now requires grad takes the training path, a new batch of the same layout is
    copied in, another shape is another artifact, and after a recording again (an input
    moved) the same tensors replay the new recording; every result equals float64."""
    f = stax.compile(many, mode="reduce-overhead")
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    for _ in range(4):
        out = f(*args)
    assert f._fast.hot is not None
    assert_close(out.cpu(), many_ref(*args), stax.float32)
    g = graphed(f)
    args[3].requires_grad = True             # the same tensor objects; one requires grad now
    out = f(*args)
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    assert_close(args[3].grad.cpu(), _dmany(args, 3), stax.float32)
    args[3].requires_grad, args[3].grad = False, None
    with stax.no_grad():
        assert_close(f(*args).cpu(), many_ref(*args), stax.float32)
    moved = cuda_randn(rng, 7)               # position 9 moves (not staged): recorded again
    before = g.stats["records"]
    assert_close(f(*args[:9], moved, *args[10:]).cpu(), many_ref(*args[:9], moved, *args[10:]), stax.float32)
    assert g.stats["records"] == before + 1
    for _ in range(3):                       # the old tensors again: the new recording's copies
        assert_close(f(*args).cpu(), many_ref(*args), stax.float32)
    small = [cuda_randn(rng, 3, 7)] + args[1:]
    assert_close(f(*small).cpu(), many_ref(*small), stax.float32)
    assert_close(f(*args).cpu(), many_ref(*args), stax.float32)
    assert g.broken is None


def test_threads_replaying_at_once_never_see_each_others_values(fake, rng):
    """Two threads calling one graphed function, one with the same tensors each time (the
    generated replay), one alternating new batches (copied in): each result equals float64
    for its own input, or reading it raises because the other thread's replay overwrote it;
    never the other thread's values. Every call is counted once."""
    f = stax.compile(chain, mode="reduce-overhead")
    w = cuda_randn(rng, 33)
    f(cuda_randn(rng, 7, 33), w)
    f(cuda_randn(rng, 7, 33), w)             # recorded with the first input staged
    xs = [cuda_randn(rng, 7, 33) for _ in range(3)]
    refs = [chain_ref(x.cpu(), w.cpu()) for x in xs]
    bad, _, _ = call_from_threads(f, xs, w, refs, [[0] * 40, [1, 2] * 20])
    assert not bad
    g = graphed(f)
    assert g.stats["replays"] + g.stats["direct"] == 82 and g.stats["records"] == 1


def test_replay_outputs_are_made_as_tensor_make_makes_them(fake, rng):
    """`Recording.outputs` builds its one output in line (no `_make`, `Storage(...)` calls):
    the tensor and its storage have exactly the attributes and defaults `_make` gives, so a
    field added to Tensor or Storage cannot be missed here silently."""
    import dataclasses
    from stax.tensor import Storage
    f = stax.compile(lambda x: stax.cos(x) + 1, mode="reduce-overhead")
    x = cuda_randn(rng, 4, 9)
    for _ in range(3):
        out = f(x)
    assert graphed(f).rec.single is not None
    made = stax.Tensor._make(out._storage, out._meta)
    assert vars(out).keys() == vars(made).keys()
    assert {k: v for k, v in vars(out).items() if k != "_storage"} == \
        {k: v for k, v in vars(made).items() if k != "_storage"}
    fields = {fl.name: fl.default for fl in dataclasses.fields(Storage)}
    assert vars(out._storage).keys() == fields.keys()
    assert out._storage.device == "cuda" and out._storage.version == fields["version"]
    assert_close(out.cpu(), np.cos(np.asarray(x.cpu(), np.float64)) + 1, stax.float32)


def _dmany(args, i):
    """d/d args[i] of many(...).sum(): cos(h) * 0.5 ** (16 - i) summed over the batch rows."""
    h = np.asarray(args[0].cpu(), np.float64)
    for p in args[1:]:
        h = h * 0.5 + np.asarray(p.cpu(), np.float64)
    return (np.cos(h) * 0.5 ** (16 - i)).sum(0)


def test_17_inputs_a_change_in_the_17th_is_caught(fake, rng):
    """17 inputs replayed through the generated check: a new tensor in the 17th position (same
    layout, another address) is copied in from then on, a changed layout there is another
    specialization; every result equals float64."""
    f = stax.compile(many, mode="reduce-overhead")
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    for _ in range(4):                       # warm-up, record, two replays of the same tensors
        out = f(*args)
    assert_close(out.cpu(), many_ref(*args), stax.float32)
    g = graphed(f)
    assert g.stats == {"direct": 1, "records": 1, "replays": 3, "copies": 0}
    assert f._fast.hot is not None and g.rec.again[2] is None     # LastCall's generated replay in use
    g(list(args))
    assert_close(g(list(args))[0].cpu(), many_ref(*args), stax.float32)
    assert g.rec.again[2] is not None        # the GraphedCall's own, made on the first repeat
    for _ in range(2):
        last = cuda_randn(rng, 7)
        out = f(*args[:16], last)
        assert_close(out.cpu(), many_ref(*args[:16], last), stax.float32)
    assert 16 in g.rec.staged and g.stats["records"] == 2 and g.stats["copies"] == 2
    assert g.stats["replays"] == 7
    out = g(args[:16] + [last])[0]           # on the GraphedCall itself (bench/gpu.py's replay_host_us)
    assert_close(out.cpu(), many_ref(*args[:16], last), stax.float32)
    strided = cuda_randn(rng, 14)[::2]       # the 17th with stride 2: a new key
    out = f(*args[:16], strided)
    assert_close(out.cpu(), many_ref(*args[:16], strided), stax.float32)
    assert f.stats["compiles"] == 2
    with stax.no_grad():                     # the replay path is the same without grad mode
        assert_close(f(*args).cpu(), many_ref(*args), stax.float32)


def test_overwritten_outputs_raise_on_the_fast_paths(fake, rng):
    """An output read after the next replay raises, whether that replay came from the same
    tensors (the token) or a new batch (`LastCall.similar`), and so does passing it in."""
    f = stax.compile(many, mode="reduce-overhead")
    args = [cuda_randn(rng, 5, 7)] + [cuda_randn(rng, 7) for _ in range(16)]
    for _ in range(3):
        f(*args)
    y, z = f(*args), f(*args)
    with pytest.raises(cudagraph.OverwrittenOutputError):
        y.cpu()
    assert_close(z.cpu(), many_ref(*args), stax.float32)
    b1, b2 = cuda_randn(rng, 5, 7), cuda_randn(rng, 5, 7)
    y1 = f(b1, *args[1:])
    y2 = f(b2, *args[1:])
    with pytest.raises(cudagraph.OverwrittenOutputError):
        y1.cpu()
    assert_close(y2.cpu(), many_ref(b2, *args[1:]), stax.float32)
    with pytest.raises(cudagraph.OverwrittenOutputError):
        f(y1, *args[1:])
    g = graphed(f)                           # on the GraphedCall itself: only the new first input
    g([b1] + args[1:])                       # is checked (`Recording.again`), and it raises
    with pytest.raises(cudagraph.OverwrittenOutputError):
        g([y2] + args[1:])
    moved = cuda_randn(rng, 7)               # a changed, unstaged position: recorded again
    assert_close(g([b1] + args[1:16] + [moved])[0].cpu(), many_ref(b1, *args[1:16], moved), stax.float32)


def test_new_batch_reuses_the_key_only_when_it_would_be_the_same(fake, rng):
    """`LastCall.similar`: a new first input of the same layout takes the last call's decision;
    another stride or dtype, one that requires grad, or one sharing memory with another input
    does not (the full path then decides: a new key, aliasing, the training path)."""
    base = cuda_randn(rng, 7 * 33 + 33)
    w = base[7 * 33:]                        # a view: a new batch may share its storage
    f = stax.compile(chain, mode="reduce-overhead")
    for _ in range(4):
        x = cuda_randn(rng, 7, 33)
        assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert f.stats["compiles"] == 1 and graphed(f).stats["records"] == 1
    fast, grad = f._fast, stax.is_grad_enabled()
    new = fast.similar((cuda_randn(rng, 7, 33), w), grad)
    assert new is not None and new is not fast and new.token is None
    assert fast.similar((cuda_randn(rng, 7, 66)[:, ::2], w), grad) is None          # stride
    assert fast.similar((cuda_randn(rng, 7, 33).to(stax.float16), w), grad) is None  # dtype
    xg = cuda_randn(rng, 7, 33)
    xg.requires_grad = True
    assert fast.similar((xg, w), grad) is None and fast.similar((xg, w), False) is not None
    shared = base[:7 * 33].reshape(7, 33)    # the same storage as w
    assert fast.similar((shared, w), grad) is None
    assert fast.similar((x, w), grad, ndarrays=True) is None
    out = f(shared, w)                       # aliasing: its own key, equal to eager
    assert_close(out.cpu(), chain_ref(shared.cpu(), w.cpu()), stax.float32)
    assert f.stats["compiles"] == 2


def graphed_calls(cf):
    return {e[0].rec.shapes[0]: e[0] for e in cf.artifacts.values()
            if isinstance(e[0], cudagraph.GraphedCall) and e[0].rec is not None}


_SCALE = 2.0


def test_wrapper_memo_rechecks_what_can_change(rng):
    """`CompiledFunction._call_again` (the call with the last call's very tensors) must still see
    a global it reads rebound and grad switched on; each takes the full path."""
    global _SCALE
    _SCALE = 2.0

    def fn(x):
        return stax.sin(x) * _SCALE

    cf = stax.compile(fn)
    x = stax.tensor(rng.standard_normal((5, 3)).astype(np.float32))
    ref = np.sin(np.asarray(x.numpy(), np.float64))
    for _ in range(3):
        assert_close(cf(x), ref * 2.0, stax.float32)
    assert cf._fast is not None and cf.stats["compiles"] == 1
    _SCALE = 3.0                             # a read rebound: a new key, compiled again
    assert_close(cf(x), ref * 3.0, stax.float32)
    assert cf.stats["compiles"] == 2
    x.requires_grad_()                       # grad: the training path (§5), not the memo
    out = cf(x)
    assert out.requires_grad and out.grad_fn is not None and cf.stats["compiles"] == 3
    x.requires_grad_(False)
    with stax.no_grad():
        assert_close(cf(x), ref * 3.0, stax.float32)
    assert cf.stats["compiles"] == 3
    dead = stax.tensor(rng.standard_normal((5, 3)).astype(np.float32))
    cf(dead)
    del dead                                 # the memo holds its tensors weakly
    assert cf._fast.refs[0]() is None
    assert_close(cf(x), ref * 3.0, stax.float32)


# ---- the fallback state ----


@pytest.mark.parametrize("failing", ["record", "replay"])
def test_driver_failure_falls_back_once(fake, rng, failing, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    setattr(fake, f"fail_{failing}", True)
    f = stax.compile(chain, mode="reduce-overhead")
    x, w = cuda_randn(rng, 5, 8), cuda_randn(rng, 8)
    f(x, w)
    with pytest.warns(RuntimeWarning, match="CUDA_ERROR_"):
        out = f(x, w)
    assert_close(out.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    for _ in range(2):
        x = cuda_randn(rng, 5, 8)
        assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    g = graphed(f)
    assert g.broken is not None and g.rec is None and fake.graphs == 1
    assert g.stats["direct"] == 4
    assert capsys.readouterr().err.count("failed (CudaError") == 1


# ---- conditions 1 and 3: what is never wrapped, and why ----


@pytest.mark.parametrize("fn, why", [
    (lambda x: stax.sort(x, 0).values * 2, "fallback kernel 'sort'"),
    (lambda x: stax.nonzero(x > 0), "depends on the data"),
    (lambda x: (x.to(stax.int64) @ x.t().to(stax.int64)) + 1, "fallback kernel 'matmul'"),
])
def test_static_conditions_reject(fake, rng, monkeypatch, capsys, fn, why):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    x = cuda_randn(rng, 4, 4)
    f = stax.compile(fn, mode="reduce-overhead")
    out = f(x)
    assert out.shape == fn(x).shape
    assert graphed(f) is None and fake.graphs == 0
    err = capsys.readouterr().err
    assert "is not wrapped in a CUDA graph" in err and why in err


def test_a_scan_is_replayed(fake, rng):
    """cumsum is a Triton scan kernel, not a host fallback: nothing stops the graph (issue 11)."""
    f = stax.compile(lambda x: x.cumsum(0) * 2 + x.cumsum(1), mode="reduce-overhead")
    x = cuda_randn(rng, 5, 9)
    for _ in range(3):
        a = x.cpu().numpy().astype(np.float64)
        assert_close(f(x).cpu(), np.cumsum(a, 0) * 2 + np.cumsum(a, 1), stax.float32)
    g = graphed(f)
    assert g is not None and g.stats["replays"] == 2 and fake.graphs == 1


def test_nothing_to_replay(fake, rng):
    f = stax.compile(lambda x: x.t(), mode="reduce-overhead")
    x = cuda_randn(rng, 2, 3)
    for _ in range(3):
        assert f(x).shape == (3, 2)
    assert graphed(f) is None and fake.graphs == 0


def test_condition_3_other_device():
    node = SimpleNamespace(name="arg0_1", meta=SimpleNamespace(device="cpu"))
    graph = SimpleNamespace(inputs=[node], unbacked={}, mutations=[])
    reasons = cudagraph.static_reasons(graph, SimpleNamespace(wrapper="def call(args):\n"))
    assert reasons == ["condition 3: input arg0_1 is on cpu, not the GPU"]


def test_dynamic_mode_records_no_graph(fake, rng, monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    f = stax.compile(chain, mode="reduce-overhead", dynamic=True)
    w = cuda_randn(rng, 9)
    for n in (3, 5, 5):
        x = cuda_randn(rng, n, 9)
        assert_close(f(x, w).cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
    assert fake.graphs == 0
    assert "dynamic mode" in capsys.readouterr().err


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'reduce-overhead'.*'max-autotune-no-cudagraphs'"):
        stax.compile(chain, mode="reduce_overhead")


def test_cpu_says_so_once(monkeypatch, capsys, rng):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    monkeypatch.setattr(cudagraph, "_CPU_NOTED", [False])
    f = stax.compile(lambda x: x * 2 + 1, mode="reduce-overhead")
    g = stax.compile(lambda x: x - 1, mode="reduce-overhead")
    a = rng.standard_normal((3, 4)).astype(np.float32)
    assert_close(f(stax.from_numpy(a)), a.astype(np.float64) * 2 + 1, stax.float32)
    assert_close(g(stax.from_numpy(a)), a.astype(np.float64) - 1, stax.float32)
    assert capsys.readouterr().err.count("on the CPU") == 1


@pytest.mark.skipif(not cuda.interpreting(), reason="only under TRITON_INTERPRET=1")
def test_interpreter_without_a_driver_is_logged(monkeypatch, capsys, rng):
    monkeypatch.setenv("STAX_LOGS", "cudagraphs")
    f = stax.compile(lambda x: x * 3, mode="reduce-overhead")
    x = cuda_randn(rng, 2, 3)
    assert_close(f(x).cpu(), np.asarray(x.cpu(), np.float64) * 3, stax.float32)
    assert "interpreter" in capsys.readouterr().err and graphed(f) is None


# ---- GraphPool against a fake backing allocator ----


class FakeBacking:
    def __init__(self):
        self.next, self.live = 1 << 20, {}

    def allocate(self, size):
        ptr, self.next = self.next, self.next + size
        self.live[ptr] = size
        return cuda.DeviceBuffer(ptr, size, size, self)

    def release(self, ptr, size):
        del self.live[ptr]


def test_allocations_come_from_the_pool_while_recording():
    pool = cudagraph.GraphPool(FakeBacking())
    pool.join("g")
    with cuda.allocating_from(pool):
        buf = cuda.allocate(300)
        with cuda.allocating_from(None):           # nested: back to the caching allocator's route
            assert getattr(cuda._POOL, "pool", None) is None
        assert buf._alloc is pool and buf.block_size == cuda.round_size(300)
    assert getattr(cuda._POOL, "pool", None) is None
    ptr = buf.ptr
    buf.free()
    assert pool.free == {cuda.round_size(300): [ptr]}
    pool.leave("g")
    assert pool.free == {} and pool.reserved == {}


def test_pool_shares_scratch_and_detects_conflicts():
    backing = FakeBacking()
    pool = cudagraph.GraphPool(backing)
    a, b = object(), object()
    pool.join(a)
    pool.owner = a
    scratch = pool.allocate(1000)
    out_a = pool.allocate(1000)
    scratch_ptr = scratch.ptr
    scratch.free()                          # dead by the end of a's replay: back to the pool
    pool.owner = None
    assert pool.conflicts(a, [out_a.ptr]) == []
    pool.join(b)
    pool.owner = b
    reused = pool.allocate(1000)            # b reuses a's scratch block
    assert reused.ptr == scratch_ptr and len(backing.live) == 2
    pool.owner = None
    assert pool.conflicts(b, [reused.ptr]) == [scratch_ptr]     # as b's output it would clash
    reused.free()
    pool.leave(b)
    pool.leave(a)
    assert list(backing.live) == [out_a.ptr]     # free blocks went back; a held output stays
    out_a.free()
    assert backing.live == {}


# ---- on a GPU ----

gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU")


@pytest.mark.gpu
@gpu
def test_gpu_1000_replays_equal_the_artifact(rng):
    plain = stax.compile(chain)
    graph = stax.compile(chain, mode="reduce-overhead")
    w = cuda_randn(rng, 64)
    x = cuda_randn(rng, 64, 64)
    for step in range(1000):
        if step % 2:
            x.copy_(stax.from_numpy(rng.standard_normal((64, 64)).astype(np.float32)))
        else:
            x = cuda_randn(rng, 64, 64)
        got = graph(x, w).cpu().numpy()
        np.testing.assert_array_equal(got, plain(x, w).cpu().numpy())
    g = graphed(graph)
    assert g.stats["replays"] >= 997 and g.broken is None


@pytest.mark.gpu
@gpu
def test_gpu_two_graphs_share_a_pool(rng):
    f = stax.compile(chain, mode="reduce-overhead")
    g = stax.compile(lambda x: stax.exp(x) * 0.5 - x.sum(0), mode="reduce-overhead")
    x, w = cuda_randn(rng, 33, 65), cuda_randn(rng, 65)
    for _ in range(4):
        a, b = f(x, w), g(x)
        assert_close(a.cpu(), chain_ref(x.cpu(), w.cpu()), stax.float32)
        ref = np.exp(np.asarray(x.cpu(), np.float64)) * 0.5 - np.asarray(x.cpu(), np.float64).sum(0)
        assert_close(b.cpu(), ref, stax.float32)
    pools = {id(graphed(f).rec.pool), id(graphed(g).rec.pool)}
    assert graphed(f).stats["replays"] == graphed(g).stats["replays"] == 3
    assert len(pools) == 1 or "private" in graphed(g).noted


@pytest.mark.gpu
@gpu
def test_gpu_graph_memory_released(rng):
    gc.collect()
    before = cuda.memory_stats()["allocated_bytes"]
    f = stax.compile(chain, mode="reduce-overhead")
    x, w = cuda_randn(rng, 256, 256), cuda_randn(rng, 256)
    base = cuda.memory_stats()["allocated_bytes"]
    for _ in range(5):
        out = f(x, w)
    cuda.synchronize()
    assert graphed(f).stats["replays"] == 4
    assert cuda.memory_stats()["allocated_bytes"] > base
    del f, out
    gc.collect()
    assert cuda.memory_stats()["allocated_bytes"] == base
    del x, w
    gc.collect()
    assert cuda.memory_stats()["allocated_bytes"] == before


def test_one_kernel_split_is_replayed(fake, rng):
    """§6.5 the OUTER split as one kernel: its counters stay zero between replays (each launch
    resets them), so every replay combines again; new values each step at the same address."""
    f = stax.compile(lambda x: x.sum(0) * 2, mode="reduce-overhead")
    x = cuda_randn(rng, 2048, 160)
    for _ in range(4):
        x.copy_(stax.from_numpy(rng.standard_normal((2048, 160)).astype(np.float32)))
        a = x.cpu().numpy().astype(np.float64)
        assert_close(f(x).cpu(), a.sum(0) * 2, stax.float32, rtol=1e-4, atol=1e-4)
    g = graphed(f)
    assert g is not None and g.stats["replays"] == 3 and fake.graphs == 1
    assert "split_counts_" in f.last_generated.wrapper
