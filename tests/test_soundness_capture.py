"""Issue 9 (items 1, 2, 3, 6): compiled Stax must equal eager Stax, never silently differ.

Every case runs the function eagerly and compiled on twin copies of fresh random inputs that share
memory exactly as the originals do, and compares the returned values AND the final state of every
input (in-place updates must reach the caller's tensors as in eager):
  - inputs that alias (`f(x, x)`, overlapping slices, `(x, x.t())`) with in-place updates;
  - views of intermediates taken before an in-place update of their base (regenerated from it);
  - mutation patterns on single inputs (returned, through a view, twice, read after, half dtypes,
    size-0/1 tensors);
  - numpy array arguments (tensor inputs with numpy's semantics, tests/test_numpy_args.py: never
    a stale frozen constant);
  - print() inside the function (a graph break; an error under fullgraph=True).
"""
import numpy as np
import pytest

import stax
from stax.capture import GraphBreak
from stax.tensor import Storage, Tensor
from conftest import assert_close


def twin(args):
    """Independent copies of `args` whose tensors share memory among themselves as `args`' do."""
    storages = {}

    def copy(a):
        if not isinstance(a, Tensor):
            return a
        if id(a._storage) not in storages:
            storages[id(a._storage)] = Storage(a._storage.data.copy())
        return Tensor._make(storages[id(a._storage)], a._meta)
    return [copy(a) for a in args]


def flat(o):
    if isinstance(o, (tuple, list)):
        return [y for x in o for y in flat(x)]
    return [o]


def agree(actual, expected, what):
    if not isinstance(expected, Tensor):
        assert actual == expected, what
        return
    assert isinstance(actual, Tensor) and actual.dtype is expected.dtype, what
    assert actual.shape == expected.shape, what
    assert_close(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                 expected.dtype.name, msg=what)


def check(fn, args, calls=2, refresh=None, compiles=True):
    """Compiled equals eager on `args` and (refreshed) fresh inputs: outputs and inputs' final state.
    compiles: the function really compiled (no eager fallback)."""
    compiled = stax.compile(fn)
    for k in range(calls):
        if k and refresh is not None:
            args = refresh()
        eager_args, compiled_args = twin(args), twin(args)
        want = fn(*eager_args)
        got = compiled(*compiled_args)
        for i, (a, e) in enumerate(zip(flat(got), flat(want))):
            agree(a, e, f"{fn.__name__}: output {i}")
        for i, (a, e) in enumerate(zip(compiled_args, eager_args)):
            if isinstance(e, Tensor):
                agree(a, e, f"{fn.__name__}: input {i} after the call")
    assert compiled.stats["eager_calls"] == 0 or not compiles, "ran eagerly"
    return compiled


def rand(rng, *shape, dtype=stax.float32):
    return stax.tensor(rng.uniform(-2, 2, shape), dtype=dtype)


# ---- 1. aliased inputs ----


def add_one_return_other(a, b):
    a.add_(1)
    return b * 2


def mul_then_sum(a, b):
    a.mul_(2)
    return a + b


def add_other(a, b):
    a.add_(b)
    return a, b


def both_written(a, b):
    b.sub_(1)
    a.mul_(3)
    c = b + a.sum()
    b.add_(c)
    return a, b, c


ALIASED = {
    "same tensor": lambda t: (t, t),
    "overlapping slices": lambda t: (t.reshape(-1)[1:], t.reshape(-1)[:-1]),
    "transpose": lambda t: (t, t.t()),
    "disjoint rows": lambda t: (t[0], t[1]),
    "columns": lambda t: (t[:, 0], t[:, 2]),
    "block and row": lambda t: (t[:, :2], t[1]),
    "strided and shifted": lambda t: (t[:, ::2], t[:, 1:]),
    "whole and element": lambda t: (t, t[2, 1]),
    "view and reshape": lambda t: (t.reshape(-1), t[1:].t()),
}


@pytest.mark.parametrize("fn", [add_one_return_other, mul_then_sum, both_written],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", sorted(ALIASED))
def test_aliased_inputs_with_mutation_match_eager(rng, fn, case):
    make = ALIASED[case]
    a, b = make(rand(rng, 3, 3))
    if a.shape != b.shape and fn is not add_one_return_other:
        b = b.sum()     # mul_then_sum / both_written broadcast a scalar from the other view
    fresh = lambda: _remake(rng, make, fn)
    check(fn, [a, b], calls=3, refresh=fresh)


def _remake(rng, make, fn):
    a, b = make(rand(rng, 3, 3))
    return [a, b] if a.shape == b.shape or fn is add_one_return_other else [a, b.sum()]


def test_issue_example_returns_eager_value():
    f = stax.compile(add_one_return_other)
    x = stax.zeros(3)
    assert f(x, x).tolist() == [2.0, 2.0, 2.0] and x.tolist() == [1.0, 1.0, 1.0]


def test_add_other_aliases_and_writes_back_in_order(rng):
    s = rand(rng, 6)
    check(add_other, [s[1:], s[:-1]])
    x = rand(rng, 4, 4)
    check(add_other, [x, x.t()])


def test_aliased_and_distinct_calls_get_their_own_specializations(rng):
    f = stax.compile(add_one_return_other)
    x, y = stax.zeros(3), stax.zeros(3)
    assert f(x, y).tolist() == [0.0, 0.0, 0.0]
    assert f(x, x).tolist() == [4.0, 4.0, 4.0]        # x was 1 after the first call
    assert f(y, stax.zeros(3)).tolist() == [0.0, 0.0, 0.0]
    assert f.stats["compiles"] == 2


def test_aliased_output_is_the_callers_tensor(rng):
    def f(a, b):
        a.add_(1)
        return b, a[0]
    x = rand(rng, 2, 3)
    out_b, row = stax.compile(f)(x, x)
    assert out_b is x
    row.zero_()                                        # a view of the caller's tensor, as in eager
    assert x[0].tolist() == [0.0, 0.0, 0.0]


def test_same_memory_through_two_numpy_wrappers(rng):
    a = rng.uniform(-1, 1, (3, 4)).astype(np.float32)
    ref = a.copy()
    f = stax.compile(add_one_return_other)
    got = f(stax.from_numpy(a), stax.from_numpy(a[1:]))
    np.testing.assert_allclose(got.numpy(), (ref[1:] + 1) * 2, rtol=1e-6)
    np.testing.assert_allclose(a, ref + 1, rtol=1e-6)


def test_unexpressible_aliasing_with_a_write_runs_eagerly(rng):
    a = rng.uniform(-1, 1, 12).astype(np.float32)
    weird = np.lib.stride_tricks.as_strided(a, (3, 3), (8, 12))   # dims interleave in memory
    x, y = stax.from_numpy(weird), stax.from_numpy(a[:6])
    ref = a.copy()
    f = stax.compile(add_one_return_other)
    got = f(y, x)
    eager_a = ref.copy()
    e = add_one_return_other(stax.from_numpy(eager_a[:6]),
                             stax.from_numpy(np.lib.stride_tricks.as_strided(eager_a, (3, 3), (8, 12))))
    np.testing.assert_allclose(got.numpy(), e.numpy())
    np.testing.assert_allclose(a, eager_a)
    assert f.stats["eager_calls"] == 1
    with pytest.raises(GraphBreak, match="shares memory"):
        stax.compile(add_one_return_other, fullgraph=True)(y, x)


def test_aliased_read_only_inputs(rng):
    def f(a, b, c):
        return a * b + c.sum()
    x = rand(rng, 4, 4)
    check(f, [x, x.t(), x[1:, 1:]])
    check(f, [x[0], x[0], x.expand(2, 4, 4)])


def test_aliasing_in_lists_and_kwargs(rng):
    def f(xs, *, other):
        xs[0].mul_(2)
        return other + xs[1]
    x = rand(rng, 3)
    eager, comp = twin([x]), twin([x])
    want = f([eager[0], eager[0]], other=eager[0])
    got = stax.compile(f)([comp[0], comp[0]], other=comp[0])
    agree(got, want, "output")
    agree(comp[0], eager[0], "input")


# ---- 2. views of values updated in place ----


def view_then_add_(x):
    y = x + 1
    z = y[0]
    y.add_(1)
    return z


def t_then_relu_(x):
    y = x + 1
    z = y.t()
    y.relu_()
    return z


def slice_then_relu_(x):
    y = x - 0.5
    z = y[:, :2]
    y.relu_()
    return z, y.sum()


def view_mutated_updates_base(x):
    y = x + 1
    z = y[0]
    z.mul_(2)
    return y


def chain_of_views(x):
    y = x * 1
    z = y[1:]
    w = z.t()
    v = w[0]
    y.add_(1)
    v.mul_(3)
    return z, w, v, y


def view_of_view_then_input_mutation(x):
    v = x[1:][0]
    t = x.t()[:, 1]
    x.mul_(-1)
    return v, t, x[0].reshape(1, -1)


@pytest.mark.parametrize("fn", [view_then_add_, t_then_relu_, slice_then_relu_,
                                view_mutated_updates_base, chain_of_views,
                                view_of_view_then_input_mutation], ids=lambda f: f.__name__)
def test_views_follow_in_place_updates(rng, fn):
    check(fn, [rand(rng, 3, 3)], calls=2, refresh=lambda: [rand(rng, 3, 3)])


def test_issue_view_example():
    assert stax.compile(view_then_add_)(stax.ones(3, 3)).tolist() == [3.0, 3.0, 3.0]


# ---- single-input mutation patterns ----


def returns_mutated(x):
    x.add_(1)
    return x


def mutate_through_view(x):
    x[0].add_(1)
    return x * 1


def twice(x):
    x.add_(1)
    x.add_(1)


def mutate_then_read(x):
    x.mul_(2)
    return x.sum(), x + 1


def unchanged(x, y):
    return x, y + 1


@pytest.mark.parametrize("fn", [returns_mutated, mutate_through_view, twice, mutate_then_read],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [stax.float32, stax.float16, stax.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3), (1,), (1, 1)], ids=str)
def test_input_mutations_match_eager(rng, fn, dtype, shape):
    check(fn, [rand(rng, *shape, dtype=dtype)], refresh=lambda: [rand(rng, *shape, dtype=dtype)])


@pytest.mark.parametrize("shape", [(0,), (0, 3), ()], ids=str)
def test_size_zero_and_scalar_inputs(rng, shape):
    check(mutate_then_read, [rand(rng, *shape)])
    check(returns_mutated, [rand(rng, *shape)])


def test_input_returned_unchanged_is_the_callers_tensor(rng):
    x, y = rand(rng, 3), rand(rng, 3)
    out = check(unchanged, [x, y])(x, y)
    assert out[0] is x


# ---- 3. numpy arrays as arguments ----


def test_numpy_arguments_are_never_stale():
    def f(a, t):
        return t + a
    g = stax.compile(f)
    t = stax.zeros(3)
    a = np.ones(3, np.float32)
    assert g(a, t).tolist() == [1.0, 1.0, 1.0]
    a[:] = 5                                           # the same array, changed
    assert g(a, t).tolist() == [5.0, 5.0, 5.0]
    assert g(np.full(3, 7, np.float32), t).tolist() == [7.0, 7.0, 7.0]   # a fresh array
    assert g.stats["compiles"] == 0 and len(g.artifacts) == 1


def test_numpy_argument_keeps_numpy_semantics_and_in_place_updates():
    def f(a):
        a += 1                                         # numpy's in-place add, as in eager
        return a * 0.5                                 # numpy's result type, as in eager
    a = np.arange(3)
    out = stax.compile(f)(a)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    assert a.tolist() == [1, 2, 3] and out.tolist() == [0.5, 1.0, 1.5]


def test_numpy_argument_under_fullgraph_says_what_to_do():
    """An ndarray argument compiles (numpy's semantics); what the stand-in lacks raises under
    fullgraph=True and names the way out; stax.from_numpy inside the function compiles."""
    with pytest.raises(GraphBreak, match="from_numpy"):
        stax.compile(lambda a: np.dot(a, a) + 1, fullgraph=True)(np.ones(2, np.float32))
    a = np.ones(2, np.float32)
    g = stax.compile(lambda a: stax.from_numpy(a).add_(1) * 2, fullgraph=True)
    out = g(a)
    assert isinstance(out, stax.Tensor) and out.tolist() == [4.0, 4.0] and a.tolist() == [2.0, 2.0]
    assert g.stats["compiles"] == 1


def test_from_numpy_inputs_compile_and_write_back():
    def f(t):
        t.mul_(2)
        return t + 1
    a = np.arange(4, dtype=np.float32)
    g = stax.compile(f)
    assert g(stax.from_numpy(a)).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert a.tolist() == [0.0, 2.0, 4.0, 6.0] and g.stats["compiles"] == 1


# ---- 6. print ----


def test_print_is_a_graph_break(capsys, monkeypatch):
    def f(x):
        y = x + 1
        print("y is", y)
        return y * 2
    monkeypatch.setenv("STAX_LOGS", "graph")
    g = stax.compile(f)
    for k in range(2):
        out = g(stax.full((2,), float(k)))
        assert out.tolist() == [2.0 * (k + 1)] * 2
    captured = capsys.readouterr()
    assert captured.out.count("y is tensor(") == 2     # printed with real values, on every call
    assert "graph break" in captured.err and "print()" in captured.err
    assert g.stats["eager_calls"] == 2


def test_print_under_fullgraph_is_an_error():
    def f(x):
        print(x)
        return x + 1
    with pytest.raises(GraphBreak, match="print"):
        stax.compile(f, fullgraph=True)(stax.ones(2))


def test_print_restored_after_capture(capsys):
    import builtins
    before = builtins.print
    stax.compile(lambda x: x + 1)(stax.ones(2))
    assert builtins.print is before


# ---- the same on the GPU back end (Triton; the interpreter where there is no GPU) ----


def test_aliased_inputs_on_the_device(rng):
    a = rng.uniform(-2, 2, (3, 3)).astype(np.float32)
    x = stax.tensor(a).to("cuda")
    out = stax.compile(add_other)(x, x.t())
    ex = stax.tensor(a)
    want = add_other(ex, ex.t())
    for got, e in zip(out, want):
        assert_close(got.cpu(), e, "float32")
    assert_close(x.cpu(), ex, "float32")
    y = stax.tensor(a).to("cuda")
    assert_close(stax.compile(view_then_add_)(y).cpu(), view_then_add_(stax.tensor(a)), "float32")
