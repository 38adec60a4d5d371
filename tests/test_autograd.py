"""§5 eager autograd: every differentiable op against float64 finite differences (a gradcheck),
textbook gradients against numpy formulas, and PyTorch's rules (accumulation, retain_graph,
no_grad, detach, in-place updates and version counters)."""
import numpy as np
import pytest

import stax
from stax.op_table import DERIVATIVES, OPS

rng = np.random.default_rng(7)


def leaf(shape, low=-2.0, high=2.0, away_from=None):
    a = rng.uniform(low, high, shape)
    if away_from is not None:                     # keep finite differences off kinks
        a = np.where(np.abs(a - away_from) < 0.1, a + 0.3, a)
    return stax.tensor(a, dtype=stax.float64, requires_grad=True)


def gradcheck(fn, *inputs, eps=1e-6, atol=1e-6, rtol=1e-5):
    """Analytic gradients of sum(fn(*inputs) * w) against central differences, in float64."""
    out = fn(*inputs)
    w = stax.tensor(rng.uniform(0.5, 1.5, tuple(out.shape)), dtype=stax.float64)
    grads = stax.autograd.grad((out * w).sum(), inputs)
    W = w.numpy()
    for x, g in zip(inputs, grads):
        base = x.detach().numpy().copy()
        num = np.zeros_like(base)
        for i in np.ndindex(base.shape):
            vals = []
            for step in (eps, -eps):
                moved = base.copy()
                moved[i] += step
                args = [stax.tensor(moved) if y is x else y.detach() for y in inputs]
                with stax.no_grad():
                    vals.append(float((fn(*args).numpy() * W).sum()))
            num[i] = (vals[0] - vals[1]) / (2 * eps)
        np.testing.assert_allclose(g.numpy(), num, atol=atol, rtol=rtol)


UNARY = {
    "neg": {}, "abs": {"away_from": 0}, "exp": {}, "exp2": {}, "log": {"low": 0.2}, "log2": {"low": 0.2},
    "sqrt": {"low": 0.2}, "rsqrt": {"low": 0.2}, "sin": {}, "cos": {}, "tanh": {}, "sigmoid": {},
    "erf": {}, "log1p": {"low": -0.5}, "expm1": {}, "relu": {"away_from": 0}, "reciprocal": {"low": 0.3},
    "floor": {"away_from": 0}, "ceil": {}, "trunc": {}, "sign": {"away_from": 0},
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_ops(op):
    gradcheck(getattr(stax, op), leaf((3, 5), **UNARY[op]))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow", "maximum", "minimum", "remainder"])
def test_binary_ops_with_broadcasting(op):
    kw = {"low": 0.5} if op in ("pow", "div", "remainder") else {}
    a, b = leaf((4, 1, 3), **kw), leaf((5, 3), **kw)
    if op == "remainder":
        b = stax.tensor(rng.uniform(2.5, 3.0, (5, 3)), dtype=stax.float64, requires_grad=True)
    gradcheck(getattr(stax, op), a, b)


def test_scalar_operands_and_where():
    x, y = leaf((4, 6)), leaf((6,))
    gradcheck(lambda x: 2.5 * x - 1 / (x * x + 1) + x ** 3, x)
    gradcheck(lambda x, y: stax.where(x > 0, x * y, y), x, y)


def test_max_and_min_share_the_gradient_at_ties():
    a = stax.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = stax.tensor([1.0, 5.0, 0.0], requires_grad=True)
    stax.maximum(a, b).sum().backward()
    assert a.grad.numpy().tolist() == [0.5, 0.0, 1.0] and b.grad.numpy().tolist() == [0.5, 1.0, 0.0]


@pytest.mark.parametrize("fn", [
    lambda x: x.permute(2, 0, 1), lambda x: x.transpose(0, 2)[1:, ::2], lambda x: x[1, :, 2],
    lambda x: x.reshape(6, 5), lambda x: x.unsqueeze(1).expand(2, 4, 3, 5), lambda x: x[..., 1:4:2],
    lambda x: x.t() if x.ndim == 2 else x.flatten(), lambda x: stax.cat([x, x * 2], 1),
    lambda x: stax.stack([x, x.exp()], 0),
], ids=["permute", "transpose_slice", "select", "reshape", "expand", "step_slice", "flatten", "cat", "stack"])
def test_views_and_joins(fn):
    gradcheck(fn, leaf((2, 3, 5)))


@pytest.mark.parametrize("fn", [
    lambda x: x.sum(), lambda x: x.sum((0, 2), keepdim=True), lambda x: x.mean(1), lambda x: x.prod(1),
    lambda x: x.amax(2), lambda x: x.amin((0, 1)), lambda x: x.var(1), lambda x: x.std(0),
    lambda x: stax.logsumexp(x, -1), lambda x: stax.softmax(x, -1), lambda x: stax.log_softmax(x, 1),
    lambda x: stax.cumsum(x, 1), lambda x: stax.layer_norm(x, (5,)), lambda x: stax.gelu(x),
    lambda x: stax.silu(x), lambda x: x.clamp(-0.5, 0.7),
], ids=["sum", "sum_keep", "mean", "prod", "amax", "amin", "var", "std", "logsumexp", "softmax",
        "log_softmax", "cumsum", "layer_norm", "gelu", "silu", "clamp"])
def test_reductions_and_composites(fn):
    gradcheck(fn, leaf((3, 4, 5), away_from=0))


def test_prod_with_zeros_is_exact():
    x = stax.tensor([[2.0, 0.0, 3.0], [0.0, 0.0, 4.0], [1.0, 2.0, 3.0]], requires_grad=True)
    x.prod(1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0, 6, 0], [0, 0, 0], [6, 3, 2]])


@pytest.mark.parametrize("sa,sb", [((4, 3), (3, 5)), ((2, 4, 3), (3, 5)), ((3,), (3, 2)), ((4, 3), (3,)),
                                   ((2, 1, 4, 3), (5, 3, 2))])
def test_matmul_shapes(sa, sb):
    gradcheck(lambda a, b: a @ b, leaf(sa), leaf(sb))


def test_mlp_against_numpy_formulas():
    x, w, b = leaf((6, 4)), leaf((4, 3)), leaf((3,))
    loss = stax.tanh(x @ w + b).sum()
    loss.backward()
    X, W, B = (t.detach().numpy() for t in (x, w, b))
    gh = 1 - np.tanh(X @ W + B) ** 2
    np.testing.assert_allclose(x.grad.numpy(), gh @ W.T, rtol=1e-12)
    np.testing.assert_allclose(w.grad.numpy(), X.T @ gh, rtol=1e-12)
    np.testing.assert_allclose(b.grad.numpy(), gh.sum(0), rtol=1e-12)


def test_float32_and_half_gradients_keep_their_dtype():
    for dt in (stax.float32, stax.float16, stax.bfloat16):
        x = stax.randn(7, dtype=dt, requires_grad=True)
        (x * x).sum().backward()
        assert x.grad.dtype is dt
        np.testing.assert_allclose(x.grad.to(stax.float64).numpy(), 2 * x.detach().to(stax.float64).numpy(),
                                   rtol=1e-2)


def test_accumulation_retain_graph_and_second_backward():
    x = leaf((3,))
    y = (x * x).sum()
    y.backward(retain_graph=True)
    y.backward()
    np.testing.assert_allclose(x.grad.numpy(), 4 * x.detach().numpy())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        (x * 2).backward()
    g = stax.ones(3, dtype=stax.float64)
    x.grad = None
    (x * 3).backward(g)
    np.testing.assert_allclose(x.grad.numpy(), [3, 3, 3])


def test_no_grad_detach_and_flags():
    x = leaf((3,))
    with stax.no_grad():
        y = x * 2
    assert not y.requires_grad and y.grad_fn is None
    z = x.detach() * 2
    assert not z.requires_grad and x.detach().is_leaf
    w = x * 2
    assert w.requires_grad and not w.is_leaf and w.grad_fn.name() == "MulBackward"
    assert not (x > 0).requires_grad                     # comparisons are not differentiable

    @stax.no_grad()
    def step():
        return x * 3
    assert not step().requires_grad and stax.is_grad_enabled()
    with pytest.raises(RuntimeError, match="floating point"):
        stax.tensor([1, 2], requires_grad=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        (x.detach() * 2).sum().backward()


def test_autograd_grad_leaves_dot_grad_alone_and_reaches_non_leaves():
    x = leaf((4,))
    h = x.exp()
    loss = (h * h).sum()
    gh, gx = stax.autograd.grad(loss, [h, x], retain_graph=True)
    np.testing.assert_allclose(gh.numpy(), 2 * h.detach().numpy())
    np.testing.assert_allclose(gx.numpy(), 2 * np.exp(2 * x.detach().numpy()))
    assert x.grad is None
    u = leaf((2,))
    with pytest.raises(RuntimeError, match="not have been used"):
        stax.autograd.grad(loss, [u], retain_graph=True)
    assert stax.autograd.grad(loss, [u], allow_unused=True) == (None,)


def test_in_place_rules():
    x = leaf((5,))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.add_(1)
    with stax.no_grad():
        x.add_(1)                                        # an optimizer step
    h = x * 2
    h.relu_()
    y = leaf((5,))
    h.mul_(y)                                            # reads h's old value: snapshotted
    g = stax.autograd.grad(h.sum(), [x, y])
    X, Y = x.detach().numpy(), y.detach().numpy()
    np.testing.assert_allclose(g[0].numpy(), np.where(X > 0, 2 * Y, 0))
    np.testing.assert_allclose(g[1].numpy(), np.maximum(2 * X, 0))
    e = x.exp()
    s = e.sum() * e.sum()
    e.add_(1)                                            # exp's saved output changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.backward()
    v = x * 1
    with pytest.raises(NotImplementedError, match="view"):
        v[1:].mul_(y[1:])


def test_compiled_function_with_grad_inputs_compiles_forward_and_backward():
    """(tests/test_training.py covers compiled training, §5, in depth.)"""
    f = stax.compile(lambda x, w: stax.gelu(x @ w).sum())
    x, w = leaf((3, 4)), leaf((4, 2))
    f(x, w).backward()
    gx = x.grad.numpy().copy()
    x.grad = None
    stax.gelu(x @ w).sum().backward()
    np.testing.assert_allclose(gx, x.grad.numpy(), rtol=1e-12)
    assert f.stats["eager_calls"] == 0 and f.stats["compiles"] == 1
    assert float(f(x.detach(), w.detach())) == pytest.approx(float(stax.gelu(x @ w).sum()))


def test_every_float_op_has_a_derivative_or_is_listed_as_not_differentiable():
    none = {"floordiv", "isnan", "isinf", "logical_not", "bitwise_not", "eq", "ne", "lt", "le", "gt", "ge",
            "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor",
            "argmax", "argmin", "full", "arange", "rand", "randn", "randint", "philox_rand", "nonzero",
            "unique", "argsort", "bincount", "repeat_index", "slice_scatter", "select_scatter",
            # §9.10 training: an attention node's LSE (its gradient is in the node's) and its backward
            "attn_lse", "omni_lse", "attn_bwd"}
    # backward raises if reached (scaled_mm: torch._scaled_mm has no derivative either)
    raises = {"cumprod", "logcumsumexp", "cummax", "cummin", "sort", "masked_select", "conv2d", "scaled_mm"}
    missing = [n for n in OPS if n not in DERIVATIVES and n not in none | raises]
    assert not missing, f"ops with neither a derivative in op_table.DERIVATIVES nor a reason: {missing}"


def test_an_op_without_a_formula_raises_instead_of_dropping_its_path():
    x = leaf((4,), low=0.5)
    y = stax.cumprod(x, 0).sum() + x.sum()
    with pytest.raises(NotImplementedError, match="derivative of cumprod"):
        y.backward()
    gradcheck(lambda a, b: stax.atan2(a, b) + stax.fmod(a, b), leaf((5,), low=0.5), leaf((5,), low=2.0, high=3.0))
    gradcheck(lambda a: stax.flip(a, 0, 1), leaf((3, 4)))


def test_gathers_and_scatters():
    idx = stax.tensor([2, 0, 2, -1])
    gradcheck(lambda t: t[idx] * 2, leaf((5, 3)))
    gradcheck(lambda t: stax.gather(t, 1, stax.tensor([[0, 2], [1, 1], [2, 0]])), leaf((3, 4)))
    gradcheck(lambda t, v: t.index_add(0, stax.tensor([1, 3, 1]), v), leaf((5, 2)), leaf((3, 2)))
    gradcheck(lambda t, v: t.index_put((stax.tensor([0, 3]),), v), leaf((4, 2)), leaf((2, 2)))


def test_gradients_stay_on_the_inputs_device():
    """Through Triton's interpreter in CI: a slice's and a gather's backward build their zeros on
    the input's device."""
    x = stax.randn(4, 3, device="cuda", requires_grad=True)
    (x[1:, ::2].sum() + x[stax.tensor([0, 2], device="cuda")].sum()).backward()
    assert x.grad.device == x.device
    expect = np.zeros((4, 3))
    expect[1:, ::2] += 1
    expect[[0, 2]] += 1
    np.testing.assert_allclose(x.grad.cpu().numpy(), expect)
