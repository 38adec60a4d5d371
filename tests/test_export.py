"""§10.2 export with declared ranges and §10.4 `make_graph(tracing_mode="symbolic")`.

Examples 10.1, 10.2 and 10.3 exactly (the printed graph, the error message, the run-time
assertion); then the exported program against float64 numpy at many sizes, on the CPU and through
Triton's interpreter; then bad declarations and bad calls, each a clear error.
"""
import numpy as np
import pytest

import stax
from conftest import assert_close

rng = np.random.default_rng(102)


def _rand(*shape):
    return stax.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _f64(t):
    return np.asarray(t.numpy(), dtype=np.float64)


def example_10_1(x, w):
    y = (stax.relu(x + w) * 2).sum(-1)
    return y / x.shape[0]


def _ref_10_1(x, w):
    x, w = _f64(x), _f64(w)
    return (np.maximum(x + w, 0) * 2).sum(-1) / x.shape[0]


EXAMPLE_10_1 = """\
add = x + w
relu = stax_relu(add)
mul = relu * 2
sum_0 = mul.sum(-1)
getattr_0 = getattr_1(x, 'shape')
getitem = getattr_0[0]
truediv = sum_0 / getitem
_assert_dims_equal = stax_export__assert_dims_equal(w, 0, x, 0, 'n')
_assert_dim_range = stax_export__assert_dim_range(w, 0, 2, 4096, 'n')
return truediv"""

EXAMPLE_10_2 = """\
Constraints violated (n)! The captured program holds only for some of the declared sizes:
  - Not all values of n in [2, 4096] satisfy the guard n > 32, which the program was captured under
Suggested fixes:
    n = Dim('n', min=33, max=4096)"""

EXAMPLE_10_3 = """\
add = x + y
getattr_0 = getattr_1(x, 'shape')
getitem = getattr_0[0]
getattr_2 = getattr_1(y, 'shape')
getitem_0 = getattr_2[0]
eq = getitem == getitem_0
_assert_shape_guard = stax_export__assert_shape_guard(eq, True, 'x.size()[0] == y.size()[0]')
return add"""


# ---- the chapter's examples, exactly ----


def test_example_10_1_graph_and_a_call_at_another_size():
    n = stax.Dim("n", min=2, max=4096)
    ep = stax.export(example_10_1, (_rand(64, 8), _rand(64, 8)), dynamic_shapes={"x": {0: n}, "w": {0: n}})
    assert str(ep.graph) == EXAMPLE_10_1
    x, w = _rand(10, 8), _rand(10, 8)
    out = ep(x, w)
    assert tuple(out.shape) == (10,)
    assert_close(out, _ref_10_1(x, w), "float32")


def test_example_10_1_equals_numpy_at_odd_sizes_and_asserts_the_declaration():
    n = stax.Dim("n", min=2, max=4096)
    ep = stax.export(example_10_1, (_rand(64, 8), _rand(64, 8)), dynamic_shapes={"x": {0: n}, "w": {0: n}})
    for size in (2, 3, 7, 31, 33, 127, 257, 4096):
        x, w = _rand(size, 8), _rand(size, 8)
        assert_close(ep(x, w), _ref_10_1(x, w), "float32")
    x = _rand(5, 8)
    x.numpy()[1, 2], x.numpy()[3, 0] = np.nan, np.inf
    got = ep(x, _rand(5, 8)).numpy()
    assert np.isnan(got[1]) and np.isinf(got[3]) and np.isfinite(got[[0, 2, 4]]).all()
    with pytest.raises(AssertionError, match=r"n = 4097 .* outside the declared range \[2, 4096\]"):
        ep(_rand(4097, 8), _rand(4097, 8))
    with pytest.raises(AssertionError, match="both declared 'n' and must be equal"):
        ep(_rand(9, 8), _rand(10, 8))
    with pytest.raises(ValueError, match=r"x.shape\[1\] was exported static as 8; got 9"):
        ep(_rand(9, 9), _rand(9, 9))


def test_example_10_2_message_and_the_suggested_fix():
    def f(x):
        return x + 1 if x.shape[0] > 32 else x * 2
    with pytest.raises(stax.ConstraintViolation) as e:
        stax.export(f, (_rand(64),), dynamic_shapes={"x": {0: stax.Dim("n", min=2, max=4096)}})
    assert str(e.value) == EXAMPLE_10_2
    ep = stax.export(f, (_rand(64),), dynamic_shapes={"x": {0: stax.Dim("n", min=33, max=4096)}})
    assert str(ep.graph) == ("add = x + 1\n_assert_dim_range = stax_export__assert_dim_range(x, 0, 33, "
                             "4096, 'n')\nreturn add")
    x = _rand(33)
    assert_close(ep(x), _f64(x) + 1, "float32")
    with pytest.raises(AssertionError, match=r"n = 32 .* \[33, 4096\]"):
        ep(_rand(32))


def test_the_false_branch_suggests_an_upper_bound():
    def f(x):
        return x + 1 if x.shape[0] > 32 else x * 2
    with pytest.raises(stax.ConstraintViolation, match=r"n <= 32.*\n.*\n    n = Dim\('n', min=2, max=32\)"):
        stax.export(f, (_rand(10),), dynamic_shapes={"x": {0: stax.Dim("n", max=4096)}})


def test_example_10_3_broadcast_guard_is_a_run_time_assertion():
    def b(x, y):
        return x + y
    ep = stax.export(b, (_rand(64), _rand(64)),
                     dynamic_shapes={"x": {0: stax.Dim("p")}, "y": {0: stax.Dim("q")}})
    assert str(ep.graph) == EXAMPLE_10_3
    for size in (2, 7, 1000):
        x, y = _rand(size), _rand(size)
        assert_close(ep(x, y), _f64(x) + _f64(y), "float32")
    with pytest.raises(AssertionError, match=r"break `x.size\(\)\[0\] == y.size\(\)\[0\]`"):
        ep(_rand(5), _rand(6))
    with pytest.raises(ValueError, match=r"x.shape\[0\] is 1, but the symbol p stands for sizes >= 2"):
        ep(_rand(1), _rand(1))


def test_a_specialized_size_is_a_violation_naming_the_value():
    def f(x):
        return x * int(x.shape[0])      # int() needs a number: the size is specialized
    with pytest.raises(stax.ConstraintViolation, match=r"guard n == 12.*\n.*\n    n = None  # the program holds only for n == 12"):
        stax.export(f, (_rand(12),), dynamic_shapes={"x": {0: stax.Dim("n")}})


def test_guards_implied_by_the_range_are_dropped_and_a_2d_reduction_is_polymorphic():
    def f(x):
        y = stax.softmax(x, -1) if x.shape[1] >= 2 else x       # implied by n >= 2: no guard
        return y.amax(-1) + x.sum(-1) / x.shape[1]
    ep = stax.export(f, (_rand(3, 64),), dynamic_shapes={"x": {1: stax.Dim("n", max=5000)}})
    assert "_assert_shape_guard" not in str(ep.graph) and "exp = stax_exp(sub)" in str(ep.graph)
    for cols in (2, 7, 129, 1025, 4099):
        x = _rand(3, cols)
        xf = _f64(x)
        e = np.exp(xf - xf.max(-1, keepdims=True))
        want = (e / e.sum(-1, keepdims=True)).max(-1) + xf.sum(-1) / cols
        assert_close(ep(x), want, "float32")


def test_exported_program_through_triton():
    # (on the GPU when there is one; conftest runs the Triton interpreter otherwise)
    n = stax.Dim("n", min=2, max=4096)
    x, w = _rand(64, 8).to("cuda"), _rand(64, 8).to("cuda")
    ep = stax.export(example_10_1, (x, w), dynamic_shapes={"x": {0: n}, "w": {0: n}})
    for size in (3, 65, 130):
        x, w = _rand(size, 8), _rand(size, 8)
        assert_close(ep(x.to("cuda"), w.to("cuda")).cpu(), _ref_10_1(x, w), "float32")


# ---- make_graph(tracing_mode="symbolic") ----


def test_the_module_and_the_function_are_both_stax_export():
    import importlib
    module = importlib.import_module("stax.export")     # binds stax.export to the module
    ep = stax.export(lambda x: x + 1, (_rand(5),), dynamic_shapes={"x": {0: module.Dim("n")}})
    x = _rand(9)
    assert_close(ep(x), _f64(x) + 1, "float32")


def test_make_graph_symbolic_alone():
    gm = stax.make_graph(example_10_1, _rand(64, 8), _rand(64, 8), tracing_mode="symbolic")
    text = str(gm.graph)
    assert "_assert_dims_equal = stax_export__assert_dims_equal(w, 0, x, 0, 's0')" in text
    assert "truediv = sum_0 / getitem" in text and "_assert_dim_range" not in text
    x, w = _rand(7, 5), _rand(7, 5)
    assert_close(gm(x, w), _ref_10_1(x, w), "float32")


def test_make_graph_raises_on_data_dependent_ops_and_branches():
    with pytest.raises(NotImplementedError, match=r"output size depends on the data \(nonzero"):
        stax.make_graph(lambda x: stax.nonzero(x), _rand(6), tracing_mode="symbolic")
    with pytest.raises(stax.GraphBreak if hasattr(stax, "GraphBreak") else Exception,
                       match="cannot capture"):
        stax.make_graph(lambda x: x + 1 if x.sum() > 0 else x, _rand(6), tracing_mode="symbolic")
    with pytest.raises(ValueError, match="tracing_mode must be 'symbolic'"):
        stax.make_graph(lambda x: x, _rand(6), tracing_mode="fake")


# ---- bad declarations and bad calls ----


def test_bad_declarations_say_what_to_do():
    with pytest.raises(ValueError, match="sizes >= 2"):
        stax.Dim("n", min=1)
    with pytest.raises(ValueError, match="max=1 must be an int >= min=2"):
        stax.Dim("n", max=1)
    with pytest.raises(ValueError, match=r"names \['z'\], which are not parameters"):
        stax.export(example_10_1, (_rand(4, 3), _rand(4, 3)), dynamic_shapes={"z": {0: stax.Dim("n")}})
    with pytest.raises(ValueError, match="outside Dim\\('n', min=8, max=16\\)"):
        stax.export(example_10_1, (_rand(4, 3), _rand(4, 3)), dynamic_shapes={"x": {0: stax.Dim("n", min=8, max=16)}})
    n = stax.Dim("n")
    with pytest.raises(ValueError, match="both declared 'n'"):
        stax.export(lambda x, w: x.sum() + w.sum(), (_rand(4), _rand(5)), dynamic_shapes={"x": {0: n}, "w": {0: n}})


def test_bad_calls_say_what_was_wrong():
    n = stax.Dim("n")
    ep = stax.export(lambda x: x * 2, (_rand(6, 4),), dynamic_shapes={"x": {0: n}})
    with pytest.raises(ValueError, match="must be a 2-d float32 tensor"):
        ep(_rand(6))
    with pytest.raises(ValueError, match=r"strides \(1, 5\); the program was exported for strides \(4, 1\)"):
        ep(_rand(4, 5).t())
    x = _rand(5, 4)
    assert_close(ep(x), _f64(x) * 2, "float32")
