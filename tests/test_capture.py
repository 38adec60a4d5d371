"""§3 capture through the compiled path: in-place updates written back to the caller's inputs
exactly as eager does them, graph breaks (eager fallback, or an error naming the user's line under
fullgraph=True), data-dependent ops as fallback kernels with unbacked sizes, and the printed graph.
"""
import numpy as np
import pytest

import stax
from stax.capture import GraphBreak, capture
from conftest import assert_close


def twins(rng, *shape, make=lambda t: t):
    """Two equal, independent tensors (and the views `make` takes of each): one for eager, one
    for the compiled function."""
    a = rng.uniform(-2, 2, shape)
    b1, b2 = stax.tensor(a, dtype=stax.float32), stax.tensor(a, dtype=stax.float32)
    return (b1, make(b1)), (b2, make(b2))


def same(actual, expected, msg=""):
    """Compiled and eager results agree (values and structure); None/scalars compare equal."""
    if isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) and len(actual) == len(expected), msg
        for k, (a, e) in enumerate(zip(actual, expected)):
            same(a, e, f"{msg}[{k}]")
        return
    if not isinstance(expected, stax.Tensor):
        assert actual == expected, msg
        return
    assert isinstance(actual, stax.Tensor) and actual.dtype is expected.dtype, msg
    assert_close(np.asarray(actual), np.asarray(expected, np.float64), expected.dtype.name, msg=msg)


# ---- in-place updates ----


def add_(x):
    x.add_(1)
    return x * 2


def setitem_rows(x):
    x[1:3] = 0
    return x.sum(-1)


def mul_column(x):
    x[:, 0].mul_(2)
    return x


def read_after_mutation(x):
    before = x * 1
    x.add_(1)
    return before, x * 3, x.sum()


def view_taken_before(x):
    row, t = x[1], x.t()
    x.mul_(2)
    x[0] = 5
    return row + 0, t.sum(0), t


def mutate_through_view(x):
    v = x[:, 1:3]
    v.add_(10)
    v[0].zero_()
    return x


def chained(x):
    x.add_(1)
    x.mul_(2)
    x[0] = x[1]
    x[:, ::2] = x[:, 1::2] * -1
    x += 1
    x.clamp_(-3, 3)
    return None


def setitem_tensor_broadcast(x):
    x[2:] = x[0] * 10
    x[:, 1] = 7.5
    return x.t()


def noreturn(x):
    x.relu_()


INPLACE = [add_, setitem_rows, mul_column, read_after_mutation, view_taken_before,
           mutate_through_view, chained, setitem_tensor_broadcast, noreturn]


@pytest.mark.parametrize("fn", INPLACE, ids=lambda f: f.__name__)
def test_inplace_updates_the_callers_input(rng, fn):
    (base_e, x_e), (base_c, x_c) = twins(rng, 5, 6)
    want = fn(x_e)
    cf = stax.compile(fn)
    got = cf(x_c)
    assert cf.stats["compiles"] == 1 and cf.stats["eager_calls"] == 0
    same(got, want, "return value")
    same(base_c, base_e, "input after the call")
    # a second call on the same (now updated) input keeps agreeing
    same(cf(x_c), fn(x_e), "second call")
    same(base_c, base_e, "input after the second call")


VIEW_INPUTS = {"transposed": lambda t: t.t(), "step_sliced": lambda t: t[1:5:2, 1:],
               "offset_row": lambda t: t[3:], "permuted": lambda t: t.reshape(2, 3, 6).permute(2, 0, 1)}


@pytest.mark.parametrize("view", sorted(VIEW_INPUTS))
@pytest.mark.parametrize("fn", [add_, setitem_rows, mutate_through_view], ids=lambda f: f.__name__)
def test_inplace_on_noncontiguous_inputs_writes_through_their_strides(rng, view, fn):
    (base_e, x_e), (base_c, x_c) = twins(rng, 6, 6, make=VIEW_INPUTS[view])
    want = fn(x_e)
    got = stax.compile(fn)(x_c)
    same(got, want)
    same(base_c, base_e, "the storage around the view (untouched parts included)")


def copy_transpose(x):
    x.copy_(x.t())


def shift_rows(x):
    x[1:] = x[:-1]
    return x.sum()


def shift_columns(x):
    x[:, 1:] = x[:, :-1] * 2


def add_own_transpose(x):
    x.add_(x.t())
    return x[0]


def write_through_transpose(x):
    x.t().copy_(x * 2)


def write_row_from_column(x):
    x[0] = x[:, 0] + 1
    return x


@pytest.mark.parametrize("fn", [copy_transpose, shift_rows, shift_columns, add_own_transpose,
                                write_through_transpose, write_row_from_column], ids=lambda f: f.__name__)
def test_inplace_reading_other_elements_of_the_target_sees_old_values(rng, fn):
    """The new value is computed from the input's old values (as eager's copy does), even where
    the write-back would overwrite elements the computation still has to read."""
    (base_e, x_e), (base_c, x_c) = twins(rng, 6, 6)
    want = fn(x_e)
    got = stax.compile(fn)(x_c)
    same(got, want)
    same(base_c, base_e, "input after the call")


def test_two_write_backs_reading_each_others_old_values(rng):
    def f(x, y):
        x.add_(y.t())
        y.add_(x.t())          # the updated x, as eager computes it
        return x.sum(), y[0]
    (bx_e, x_e), (bx_c, x_c) = twins(rng, 5, 5)
    (by_e, y_e), (by_c, y_c) = twins(rng, 5, 5)
    same(stax.compile(f)(x_c, y_c), f(x_e, y_e))
    same(bx_c, bx_e), same(by_c, by_e)


def test_copy_and_fill_inside_compiled_function(rng):
    def f(x, y):
        x.copy_(y)                     # broadcast copy
        x[0].fill_(2.0)
        return x + 1, y
    (bx_e, x_e), (bx_c, x_c) = twins(rng, 4, 5)
    (_, y_e), (_, y_c) = twins(rng, 5)
    same(stax.compile(f)(x_c, y_c), f(x_e, y_e))
    same(bx_c, bx_e)


def test_copy_with_dtype_conversion_and_int_inputs(rng):
    def f(x, i):
        i.add_(3)
        x.copy_(i)                     # int64 -> float32
        i[0] = 1.9                     # float scalar into an int tensor: truncates
        return x * 0.5, i
    (bx_e, x_e), (bx_c, x_c) = twins(rng, 3)
    ints = rng.integers(-9, 9, 3)
    i_e, i_c = stax.tensor(ints), stax.tensor(ints)
    same(stax.compile(f)(x_c, i_c), f(x_e, i_e))
    same(bx_c, bx_e), same(i_c, i_e)
    assert i_c.dtype is stax.int64 and i_c.tolist()[0] == 1


def test_mutating_two_inputs_and_aliasing_reads(rng):
    def f(x, y):
        x.add_(y)
        y.mul_(x)                      # reads the updated x
        return x - y
    (bx_e, x_e), (bx_c, x_c) = twins(rng, 4, 4)
    (by_e, y_e), (by_c, y_c) = twins(rng, 4, 4)
    same(stax.compile(f)(x_c, y_c), f(x_e, y_e))
    same(bx_c, bx_e), same(by_c, by_e)


def test_inplace_on_a_closed_over_tensor_runs_eagerly(rng):
    state = stax.zeros(3)

    def f(x):
        state.add_(x)
        return state * 1
    cf = stax.compile(f)
    x = stax.ones(3)
    same(cf(x), stax.ones(3))
    same(cf(x), stax.full((3,), 2.0))
    assert cf.stats["compiles"] == 0 and cf.stats["eager_calls"] == 2


def test_inplace_through_expand_raises_like_eager(rng):
    def f(x):
        x.expand(3, 4).add_(1)
        return x
    with pytest.raises(RuntimeError, match="more than one element"):
        f(stax.ones(4))
    with pytest.raises(RuntimeError, match="more than one element"):
        stax.compile(f)(stax.ones(4))


# ---- graph breaks ----


def branchy(x):
    if x.sum() > 0:
        return x + 1
    return x - 1


def uses_item(x):
    return x * x.amax().item()


def uses_float(x):
    return x / float(x[0])


def uses_tolist(x):
    return x + len([v for v in x.tolist() if v > 0])


@pytest.mark.parametrize("fn", [branchy, uses_item, uses_float, uses_tolist], ids=lambda f: f.__name__)
def test_graph_break_runs_eagerly_with_the_right_answer(rng, fn):
    cf = stax.compile(fn)
    for sign in (1.0, -1.0):
        x = stax.tensor(sign * rng.uniform(0.5, 2, 6), dtype=stax.float32)
        same(cf(x), fn(x))
    assert cf.stats["compiles"] == 0 and cf.stats["eager_calls"] == 2


@pytest.mark.parametrize("fn,line", [(branchy, "if x.sum() > 0:"), (uses_item, "x.amax().item()"),
                                     (uses_float, "float(x[0])")], ids=["branch", "item", "float"])
def test_graph_break_under_fullgraph_names_the_users_line(rng, fn, line):
    cf = stax.compile(fn, fullgraph=True)
    with pytest.raises(GraphBreak) as ei:
        cf(stax.ones(4))
    msg = str(ei.value)
    assert __file__.rstrip("c") in msg and line in msg and fn.__name__ in msg
    lineno = fn.__code__.co_firstlineno + 1
    assert f":{lineno}:" in msg


def test_graph_break_reason_is_logged(monkeypatch, capsys):
    monkeypatch.setenv("STAX_LOGS", "graph")
    stax.compile(branchy)(stax.ones(3))
    err = capsys.readouterr().err
    assert "graph break" in err and "if x.sum() > 0:" in err


# ---- data-dependent ops: fallback kernels with unbacked sizes ----


def test_nonzero_unique_and_ops_after_them(rng):
    a = rng.uniform(-2, 2, (5, 7))
    a[a > 1.2] = 0.0
    x = stax.tensor(a, dtype=stax.float32)

    def f(x):
        nz = stax.nonzero(x > 0)
        u = stax.unique((x * 2).floor())
        return nz, nz.sum(0) * 2, nz + 1, u, u * 3 + 1, u.sum(), stax.relu(u).amax(), nz.t()[1]
    cf = stax.compile(f)
    got = cf(x)
    A = a.astype(np.float32)
    nz = np.argwhere(A > 0)
    u = np.unique(np.floor(A * 2))
    want = (nz, nz.sum(0) * 2, nz + 1, u, u * 3 + 1, u.sum(), np.maximum(u, 0).max(), nz.T[1])
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, g.dtype.name, msg=str(k))
    assert got[0].dtype is stax.int64 and got[3].dtype is stax.float32
    gen = cf.last_generated
    assert "u0" in gen.graph.format() and "extern_kernel('nonzero'" in gen.wrapper
    assert "extern_kernel('unique'" in gen.wrapper
    assert any("int64_t u" in k for k in gen.kernels.values())   # kernels sized by unbacked symbols
    # the same specialization with other data: other sizes, still right, no recompile
    b = -a
    x2 = stax.tensor(b, dtype=stax.float32)
    got2 = cf(x2)
    assert cf.stats["compiles"] == 1
    assert_close(got2[0], np.argwhere(b.astype(np.float32) > 0), "int64")
    assert_close(got2[4], np.unique(np.floor(b.astype(np.float32) * 2)) * 3 + 1, "float32")


def test_nonzero_of_nothing(rng):
    got = stax.compile(lambda x: (stax.nonzero(x > 5), stax.nonzero(x > 5).sum(0)))(stax.ones(3, 4))
    assert got[0].shape == (0, 2) and got[1].tolist() == [0, 0]


# ---- the captured graph ----


def test_graph_records_ops_outputs_and_write_backs():
    def f(x, y):
        x.add_(1)
        return (stax.relu(x + y) * 2).sum(-1), 3
    g, _ = capture(f, [stax.ones(4, 8), stax.ones(4, 8)])
    text = g.format()
    lines = text.splitlines()
    assert lines[0] == "arg0_1: float32[4, 8] = placeholder()"
    assert any(line.startswith("sum: float32[4] = sum(") for line in lines)
    assert "write back" in text and "-> arg0_1" in text
    assert [n.op for n in g.nodes if n.op in ("add", "relu", "mul", "sum")] == ["add", "add", "relu", "mul", "sum"]


def test_unused_ops_are_dropped_and_constants_lifted():
    w = stax.ones(8)

    def f(x):
        _unused = x.exp()
        return x * w
    g, _ = capture(f, [stax.ones(4, 8)])
    assert [n.op for n in g.nodes] == ["mul"]
    assert [n.op for n in g.inputs] == ["placeholder", "constant"] and g.constants["const0"] is w
