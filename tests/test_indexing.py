"""Indirect indexing (stax/indexing.py, ops.indirect_indexing): gathers, scatters and masks.

Every case runs eagerly and compiled (C++ on the CPU, Triton through the interpreter or on a GPU)
against a float64 numpy reference on fresh random inputs: odd sizes, non-contiguous operands,
negative, duplicate and out-of-range indices, half types. Kernel counts check the fusion.
"""
import numpy as np
import pytest

import stax
from conftest import assert_close


def f64(t):
    return np.asarray(t.numpy() if t.device == "cpu" else t.cpu().numpy(), np.float64)


def rand(rng, *shape, dtype=np.float32):
    return stax.tensor(rng.standard_normal(shape).astype(dtype))


def idx(rng, lo, hi, *shape):
    return stax.tensor(rng.integers(lo, hi, shape).astype(np.int64))


def both(fn, *args, device="cpu"):
    """(compiled result, eager result, generated code); inputs cloned so writes do not leak."""
    eager = fn(*[a.clone() if isinstance(a, stax.Tensor) else a for a in args])
    dev = [a.clone().to(device) if isinstance(a, stax.Tensor) else a for a in args]
    cf = stax.compile(fn)
    out = cf(*dev)
    return out, eager, cf.last_generated


# ---- reads ----


def _read_cases(rng):
    x = rand(rng, 7, 5, 3)
    xt = rand(rng, 5, 7).t()                          # non-contiguous
    i = idx(rng, -7, 7, 4)                             # negatives wrap
    j = idx(rng, -5, 5, 3, 1)
    k = idx(rng, 0, 3, 4)
    return [
        ("x[i]", lambda x, i: x[i], (x, i), lambda X, I: X[I]),
        ("x[:, j]", lambda x, j: x[:, j], (x, j), lambda X, J: X[:, J]),
        ("x[arange, t]", lambda x, k: x[stax.arange(4), :, k], (rand(rng, 4, 5, 3), k),
         lambda X, K: X[np.arange(4), :, K]),
        ("x[i1, i2] broadcast", lambda x, j, k: x[:, j, k], (x, j, k), lambda X, J, K: X[:, J, K]),
        ("x[i, :, k] (placed first)", lambda x, i, k: x[i, :, k], (x, i, k), lambda X, I, K: X[I, :, K]),
        ("list index", lambda x: x[[1, -2, 0]] * 2, (x,), lambda X: X[[1, -2, 0]] * 2),
        ("index_select non-contiguous", lambda x, i: stax.index_select(x, 0, i), (xt, i),
         lambda X, I: X[I]),
        ("gather", lambda x, t: x.gather(1, t), (x[:, :, 0], idx(rng, -5, 5, 6, 4)),
         lambda X, T: np.take_along_axis(X[:6], T % 5, 1)),
        ("take_along_dim broadcast", lambda x, t: stax.take_along_dim(x, t, 1),
         (rand(rng, 7, 5), idx(rng, 0, 5, 1, 3)), lambda X, T: np.take_along_axis(X, np.broadcast_to(T, (7, 3)), 1)),
        ("take_along_dim flat", lambda x, t: stax.take_along_dim(x, t), (rand(rng, 3, 5), idx(rng, 0, 15, 4)),
         lambda X, T: X.reshape(-1)[T]),
        ("embedding", lambda t, w: stax.embedding(t, w), (idx(rng, 0, 11, 2, 3), rand(rng, 11, 6)),
         lambda T, W: W[T]),
        ("empty index", lambda x, i: x[i] + 1, (x, stax.tensor(np.zeros(0, np.int64))), lambda X, I: X[I] + 1),
        ("int32 index of size 1", lambda x, i: x[i], (x, stax.tensor(np.array([-1], np.int32))), lambda X, I: X[I]),
    ]


@pytest.mark.parametrize("case", range(13))
def test_reads_cpu(rng, case):
    name, fn, args, ref = _read_cases(rng)[case]
    out, eager, _ = both(fn, *args)
    want = ref(*[f64(a) if a.dtype.is_floating_point else a.numpy() for a in args])
    assert_close(eager, want, stax.float32, msg=name)
    assert_close(out, want, stax.float32, msg=name)


def test_out_of_range_raises_index_error_naming_op_index_and_size(rng):
    x, w = rand(rng, 5, 3), rand(rng, 3)
    cf = stax.compile(lambda x, i: stax.index_select(x, 0, i) * 2)
    assert_close(cf(x, stax.tensor([4, -5])), f64(x)[[4, 0]] * 2, stax.float32)
    for bad in (5, -6):
        i = stax.tensor([0, bad, 1])
        with pytest.raises(IndexError, match=rf"index_select\(\): index {bad} is out of bounds for dimension 0 with size 5"):
            stax.index_select(x, 0, i)
        with pytest.raises(IndexError, match=rf"index_select\(\): index {bad} is out of bounds for dimension 0 with size 5"):
            cf(x, i)
    t = stax.tensor([[0, 3]])
    for g in (lambda x, t: x.gather(1, t), stax.compile(lambda x, t: x.gather(1, t) + w[:2])):
        with pytest.raises(IndexError, match=r"gather\(\): index 3 is out of bounds for dimension 1 with size 3"):
            g(x, t)
    with pytest.raises(IndexError, match="must be long or int"):
        x[stax.tensor([0.0])]


def test_x_idx_times_w_is_one_kernel_and_embedding_layer_norm_is_one_kernel(rng):
    x, w, i = rand(rng, 9, 33), rand(rng, 33), idx(rng, -9, 9, 17)
    out, _, gen = both(lambda x, i, w: x[i] * w, x, i, w)
    assert_close(out, f64(x)[i.numpy()] * f64(w), stax.float32)
    assert len(gen.kernels) == 1
    table, t = rand(rng, 13, 24), idx(rng, 0, 13, 3, 5)
    out, _, gen = both(lambda t, w: stax.layer_norm(stax.embedding(t, w), (24,)), t, table)
    rows = f64(table)[t.numpy()]
    want = (rows - rows.mean(-1, keepdims=True)) / np.sqrt(rows.var(-1, keepdims=True) + 1e-5)
    assert_close(out, want, stax.float32)
    assert len(gen.kernels) == 1


def test_gather_along_a_dim_loads_no_arange(rng):
    """gather's other dims are aranges: they become plain loop indices (no load, no check)."""
    x, t = rand(rng, 6, 5), idx(rng, 0, 5, 6, 2)
    out, _, gen = both(lambda x, t: x.gather(1, t), x, t)
    assert_close(out, np.take_along_axis(f64(x), t.numpy(), 1), stax.float32)
    src = str(gen)
    assert src.count("stax_check_index(") == 1 and src.count("in_ptr") <= 4


# ---- writes ----


def _write_cases(rng):
    x = rand(rng, 7, 4)
    dup = stax.tensor([3, -1, 3, 0, 6])                 # duplicates (3 and -1 == 6)
    v = rand(rng, 5, 4)
    return [
        ("x[idx] = v (last wins)", lambda x, i, v: x.__setitem__(i, v) or x, (x, dup, v),
         lambda X, I, V: _last_wins(X, I % 7, V)),
        ("x[idx] = scalar", lambda x, i: x.__setitem__((slice(None), i), 2.5) or x, (x, stax.tensor([1, -1])),
         lambda X, I: _set(X, (slice(None), I), 2.5)),
        ("index_put_ accumulate", lambda x, i, v: x.index_put_((i,), v, accumulate=True), (x, dup, v),
         lambda X, I, V: _add_at(X, I % 7, V)),
        ("index_add_ alpha", lambda x, i, v: x.index_add_(0, i, v, alpha=2), (x, dup, v),
         lambda X, I, V: _add_at(X, I % 7, 2 * V)),
        ("index_add dim 1", lambda x, i, v: x.index_add(1, i, v), (x, stax.tensor([0, 0, 3]), rand(rng, 7, 3)),
         lambda X, I, V: _add_at(X.T, I, V.T).T),
        ("index_copy_", lambda x, i, v: x.index_copy_(0, i, v), (x, stax.tensor([6, 2]), rand(rng, 2, 4)),
         lambda X, I, V: _set(X, I, V)),
        ("scatter_ src", lambda x, t, s: x.scatter_(1, t, s), (x, stax.tensor([[0, 3], [2, 1]]), rand(rng, 3, 5)),
         lambda X, T, S: _scatter(X, T, S)),
        ("scatter value", lambda x, t: x.scatter(0, t, -1.0), (x, stax.tensor([[6, 0, 1, 2]])),
         lambda X, T: _set(X, (T[0], np.arange(4)), -1.0)),
        ("scatter_add_ duplicates", lambda x, t, s: x.scatter_add_(0, t, s), (x, idx(rng, 0, 7, 6, 4), rand(rng, 6, 4)),
         lambda X, T, S: _scatter_add0(X, T, S)),
        ("index_add_ non-contiguous x", lambda x, i, v: x.t().index_add_(1, i, v.t()).t(), (x, dup, v),
         lambda X, I, V: _add_at(X, I % 7, V)),
    ]


def _set(X, key, V):
    X = X.copy()
    X[key] = V
    return X


def _last_wins(X, I, V):
    X = X.copy()
    for i, row in zip(I, V):
        X[i] = row
    return X


def _add_at(X, I, V):
    X = X.copy()
    np.add.at(X, I, V)
    return X


def _scatter(X, T, S):
    X = X.copy()
    for a in range(T.shape[0]):
        for b in range(T.shape[1]):
            X[a, T[a, b]] = S[a, b]
    return X


def _scatter_add0(X, T, S):
    X = X.copy()
    for a in range(T.shape[0]):
        for b in range(T.shape[1]):
            X[T[a, b], b] += S[a, b]
    return X


@pytest.mark.parametrize("case", range(10))
def test_writes_cpu(rng, case):
    name, fn, args, ref = _write_cases(rng)[case]
    want = ref(*[f64(a) if a.dtype.is_floating_point else a.numpy() for a in args])
    out, eager, _ = both(fn, *args)
    assert_close(eager, want, stax.float32, msg=name)
    assert_close(out, want, stax.float32, msg=name)


def test_writes_into_inputs_and_errors(rng):
    x, v, i = rand(rng, 7, 4), rand(rng, 2, 4), stax.tensor([1, -3])

    def f(x, i, v):
        x.index_add_(0, i, v)
        return x.sum()
    want = _add_at(f64(x), i.numpy() % 7, f64(v))
    xc = x.clone()
    out = stax.compile(f)(xc, i, v)
    assert_close(xc, want, stax.float32)
    assert_close(out, want.sum(), stax.float32)
    with pytest.raises(IndexError, match=r"index_add\(\): index 7 is out of bounds for dimension 0 with size 7"):
        stax.compile(f)(x.clone(), stax.tensor([0, 7]), v)
    with pytest.raises(IndexError, match=r"index_add\(\): index -8 is out of bounds"):
        f(x.clone(), stax.tensor([-8, 1]), v)

    def in_place(x, i, v):                       # nothing else reads x: the scatter writes into it
        x.index_add_(0, i, v)

    def reads_old(x, i, v):                      # y needs the old x: the scatter writes into a copy
        y = x * 2
        x.index_add_(0, i, v)
        return y + 1
    for fn, kernels in ((in_place, 1), (reads_old, 3)):
        xc, xe = x.clone(), x.clone()
        cf = stax.compile(fn)
        out, ref = cf(xc, i, v), fn(xe, i, v)
        assert_close(xc, want, stax.float32)
        assert_close(xe, want, stax.float32)
        if ref is not None:
            assert_close(out, f64(x) * 2 + 1, stax.float32)
        assert len(cf.last_generated.kernels) == kernels
    xc, cf = x.clone(), stax.compile(in_place)
    with pytest.raises(IndexError, match=r"index_add\(\): index 7 is out of bounds"):
        cf(xc, stax.tensor([0, 7]), v)
    assert np.array_equal(xc.numpy(), x.numpy())      # checked before any write, as eager
    assert "STAX_ERR_INDEX) return;" in str(cf.last_generated)
    with pytest.raises(RuntimeError, match="same scalar type"):
        x.index_add_(0, i, v.double())
    with pytest.raises(RuntimeError, match="shape mismatch"):
        x[i] = rand(rng, 3, 4)


@pytest.mark.parametrize("dtype", [stax.float16, stax.bfloat16])
def test_half_gather_and_index_add(rng, dtype):
    x, v = rand(rng, 9, 6).to(dtype), rand(rng, 4, 6).to(dtype)
    i = stax.tensor([2, -1, 2, 5])

    def f(x, i, v):
        return x[i] * 2, x.index_add(0, i, v)
    (g, a), (ge, ae), _ = both(f, x, i, v)
    X, V = f64(x.float()), f64(v.float())
    assert g.dtype is dtype and a.dtype is dtype
    for o in (g, ge):
        assert_close(o.float(), X[i.numpy()] * 2, dtype)
    for o in (a, ae):
        assert_close(o.float(), _add_at(X, i.numpy() % 9, V), dtype)


# ---- masks ----


def test_masks(rng):
    x = rand(rng, 7, 5)
    X = f64(x)
    x[0, 0] = float("nan")
    X[0, 0] = np.nan
    m = stax.tensor(rng.random((7, 5)) > 0.5)
    rows = stax.tensor(rng.random(7) > 0.5)
    M, R = m.numpy(), rows.numpy()
    out, eager, gen = both(lambda x, m: x.masked_fill(m, float("inf")) + 1, x, m)
    for o in (out, eager):
        assert_close(o, np.where(M, np.inf, X) + 1, stax.float32)
    assert len(gen.kernels) == 1
    out, eager, _ = both(lambda x, m: x.masked_fill_(m, stax.tensor(-2.0)), x, m)
    for o in (out, eager):
        assert_close(o, np.where(M, -2.0, X), stax.float32)
    row = rand(rng, 5)
    out, eager, gen = both(lambda x, r, v: x.__setitem__(r, v) or x, x, rows, row)
    for o in (out, eager):
        assert_close(o, np.where(R[:, None], f64(row), X), stax.float32)
    assert len(gen.kernels) == 1
    out, eager, _ = both(lambda x, m: x[m] * 2, x, m)          # data-dependent size: runs eagerly
    for o in (out, eager):
        assert_close(o, X[M] * 2, stax.float32)
    with pytest.raises(RuntimeError, match="boolean masks"):
        x.masked_fill(stax.tensor([1, 0, 1, 0, 1]), 0.0)


# ---- GPU (Triton's interpreter without a GPU) ----


def _gpu(fn, *args):
    out, eager, gen = both(fn, *args, device="cuda")
    return out, eager, gen


def test_gpu_gathers_fuse(rng):
    x, w, i = rand(rng, 9, 33), rand(rng, 33), idx(rng, -9, 9, 17)
    out, eager, gen = _gpu(lambda x, i, w: x[i] * w, x, i, w)
    assert_close(out.cpu(), f64(x)[i.numpy()] * f64(w), stax.float32)
    assert len(gen.kernels) == 1
    table, t = rand(rng, 13, 24), idx(rng, 0, 13, 3, 5)
    out, _, gen = _gpu(lambda t, w: stax.layer_norm(stax.embedding(t, w), (24,)), t, table)
    rows = f64(table)[t.numpy()]
    want = (rows - rows.mean(-1, keepdims=True)) / np.sqrt(rows.var(-1, keepdims=True) + 1e-5)
    assert_close(out.cpu(), want, stax.float32)
    assert len(gen.kernels) == 1
    xt, j, k = rand(rng, 5, 7, 3).permute(1, 0, 2), idx(rng, -7, 7, 4, 1), idx(rng, 0, 3, 2)
    out, _, _ = _gpu(lambda x, j, k: x[j, :, k].sum(-1), xt, j, k)
    assert_close(out.cpu(), f64(xt)[j.numpy(), :, k.numpy()].sum(-1), stax.float32)
    out, _, _ = _gpu(lambda x, m: x[[1, -2]] * 2 + x[:2].masked_fill(m, 0.5), x, x[:2] > 0)   # a list: on x's device
    X = f64(x)
    assert_close(out.cpu(), X[[1, -2]] * 2 + np.where(X[:2] > 0, 0.5, X[:2]), stax.float32)


def test_gpu_scatters(rng):
    x, v = rand(rng, 7, 4), rand(rng, 5, 4)
    dup = stax.tensor([3, -1, 3, 0, 6])
    out, _, gen = _gpu(lambda x, i, v: x.index_add_(0, i, v), x, dup, v)
    assert_close(out.cpu(), _add_at(f64(x), dup.numpy() % 7, f64(v)), stax.float32)
    assert "tl.atomic_add" in str(gen)
    t, s = idx(rng, 0, 7, 6, 4), rand(rng, 6, 4)
    out, _, _ = _gpu(lambda x, t, s: x.scatter_add(0, t, s), x, t, s)
    assert_close(out.cpu(), _scatter_add0(f64(x), t.numpy(), f64(s)), stax.float32)
    u = stax.tensor([6, 1, 0])                        # no duplicates: the write is defined
    out, _, _ = _gpu(lambda x, u, v: x.__setitem__(u, v) or x, x, u, v[:3])
    assert_close(out.cpu(), _set(f64(x), u.numpy(), f64(v)[:3]), stax.float32)
    h, vh = x.half(), v.half()
    out, _, _ = _gpu(lambda x, i, v: x.index_add(0, i, v), h, dup, vh)
    assert_close(out.cpu(), _add_at(f64(h.float()), dup.numpy() % 7, f64(vh.float())), stax.float16)


def test_gpu_debug_index_assert(rng, monkeypatch):
    x = rand(rng, 5, 3)
    stax.compile(lambda x, i: x[i] + 1)(x.cuda(), stax.tensor([1]).cuda())   # cached without asserts
    monkeypatch.setenv("STAX_DEBUG_INDEX", "1")     # part of the artifact key: not that module
    cf = stax.compile(lambda x, i: x[i] + 1)
    ok = cf(x.cuda(), stax.tensor([-5, 4]).cuda())
    assert_close(ok.cpu(), f64(x)[[0, 4]] + 1, stax.float32)
    assert "tl.device_assert" in str(cf.last_generated)
    from stax import cuda
    if cuda.is_available():
        pytest.skip("a device-side assert would leave the CUDA context unusable")
    with pytest.raises(Exception, match="index out of bounds"):
        cf(x.cuda(), stax.tensor([0, 5]).cuda())


def test_scatter_threads_own_columns_and_add_in_index_order(rng):
    """A long inner loop of an index_add is split over threads by columns; each element still
    sees its adds in index order, so the result equals eager's bit for bit."""
    x, v = rand(rng, 5, 300), rand(rng, 200, 300)
    i = idx(rng, -5, 5, 200)                          # every row hit ~40 times
    out, eager, gen = both(lambda x, i, v: x.index_add(0, i, v), x, i, v)
    assert "x1_chunk" in str(gen) and "omp parallel for" in str(gen)
    assert np.array_equal(out.numpy(), eager.numpy())
    assert_close(out, _add_at(f64(x), i.numpy() % 5, f64(v)), stax.float32)
    with pytest.raises(RuntimeError, match="bool tensor"):
        (x > 0).index_put_((i,), stax.tensor(True), accumulate=True)


def test_symbolic_sizes(rng):
    """dynamic=True: the sizes an index is checked against are the symbols of §10.3."""
    g = stax.compile(lambda x, i, v: (x[i] * 2, x.index_add(0, i, v)), dynamic=True)
    for n, m in ((6, 4), (9, 5)):
        x, i, v = rand(rng, n, 3), idx(rng, -n, n, m), rand(rng, m, 3)
        a, b = g(x, i, v)
        assert_close(a, f64(x)[i.numpy()] * 2, stax.float32)
        assert_close(b, _add_at(f64(x), i.numpy() % n, f64(v)), stax.float32)
    assert g.stats["compiles"] <= 2
    with pytest.raises(IndexError, match=r"index(_add)?\(\): index 9 is out of bounds for dimension 0 with size 9"):
        g(x, stax.tensor([0, 9, 1, 2, 3]), v)


def test_out_of_place_scatters_leave_their_input_alone():
    t = stax.tensor(np.ones((5, 2), np.float32))
    v = stax.tensor(np.full((3, 2), 5.0, np.float32))
    i = stax.tensor([1, 3, 1])
    for fn in (lambda: t.index_add(0, i, v), lambda: t.index_copy(0, i[:2], v[:2]),
               lambda: t.index_put((i,), v, accumulate=True), lambda: t.index_put((i[:2],), v[:2])):
        fn()
        assert (t.numpy() == 1).all()
