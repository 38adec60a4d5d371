"""§7 scheduling, seen through the generated code: how many kernels each program becomes
(`len(stax.generate(...).kernels)`), which groups the schedule forms, and which intermediate
buffers never touch memory. Generation only: nothing here runs the C++ compiler."""
import pytest

import stax
from stax import ir, lower, schedule
from stax.capture import capture


def X(*shape):
    return stax.randn(*shape)


def gen(fn, *args):
    return stax.generate(fn, *args)


def sched(fn, *args):
    g, _ = capture(fn, list(args))
    return schedule.schedule(lower.lower(g))


CASES = {
    "softmax": (lambda x: stax.softmax(x, -1), (X(64, 128),), 1),
    "log_softmax": (lambda x: stax.log_softmax(x, -1), (X(64, 128),), 1),
    "layer_norm": (lambda x: stax.layer_norm(x, 128), (X(64, 128),), 1),
    "layer_norm_affine": (lambda x, w, b: stax.layer_norm(x, (128,), w, b), (X(64, 128), X(128), X(128)), 1),
    "example_1_1": (lambda x, y: (stax.relu(x + y) * 2).sum(-1), (X(64, 128), X(64, 128)), 1),
    "example_6_1": (lambda x, y: x.t() + y, (X(128, 64), X(64, 128)), 1),
    "example_6_2": (lambda x: (x * x).sum(-1), (X(64, 128),), 1),
    "pointwise_chain": (lambda x: ((x.exp() + 1) * 2).sigmoid().tanh() - x, (X(33, 17),), 1),
    "gelu": (lambda x: stax.gelu(x), (X(64, 128),), 1),
    "horizontal": (lambda x, y: (x + y, x * y, (x - y).exp(), stax.relu(x)), (X(64, 128), X(64, 128)), 1),
    "reduction_epilogue": (lambda x: x.sum(-1) * 2 + 1, (X(64, 128),), 1),
    "mean_and_var": (lambda x: (x.mean(-1), x.var(-1), x.amax(-1)), (X(64, 128),), 1),
    "reduction_and_elementwise": (lambda x: (x.sum(-1), x * 2), (X(64, 128),), 1),
    "logsumexp": (lambda x: stax.logsumexp(x, -1), (X(64, 128),), 1),
    "matmul_epilogue": (lambda a, b: stax.relu(a @ b + 1), (X(16, 32), X(32, 8)), 1),
    "mlp_block": (lambda x, w, b: stax.layer_norm(stax.gelu(x @ w + b), 48), (X(16, 32), X(32, 48), X(48)), 1),
    # one pass over x computes both on the CPU (issue 12 item 4: schedule._can_cross)
    "reductions_over_other_dims": (lambda x: (x.sum(-1), x.sum(0)), (X(64, 128),), 1),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_counts(name):
    fn, args, want = CASES[name]
    g = gen(fn, *args)
    assert len(g.kernels) == want, f"{name}: {list(g.kernels)}\n{g.schedule}"
    assert list(g.kernels) == [f"cpp_fused_{k}" for k in range(want)]


def test_softmax_keeps_intermediates_in_the_kernel():
    s = sched(lambda x: stax.softmax(x, -1), X(64, 128))
    (group,) = s.groups
    assert group.kind == "reduction" and group.ranges == [64] and group.reduction_ranges == [128]
    stored = [n.name for n in group.nodes if n.name not in s.kernel_local]
    assert stored == [s.lowered.outputs[0]]             # only the result is written to memory
    assert sum(isinstance(n, ir.Reduction) for n in group.nodes) == 2   # max and sum, one row pass each


def test_example_1_1_is_one_reduction_with_its_prologue():
    g = gen(lambda x, y: (stax.relu(x + y) * 2).sum(-1), X(64, 128), X(64, 128))
    (src,) = g.kernels.values()
    assert "computes" in src and all(op in src.splitlines()[0] for op in ("add", "relu", "mul", "sum"))
    assert src.count("in_ptr") >= 2 and "out_ptr0" in src and "out_ptr1" not in src


def test_extern_kernels_are_their_own_groups_in_order():
    s = sched(lambda a, b: (a @ b).sum(-1) + stax.nonzero(a > 0).sum(), X(8, 4), X(4, 6))
    kinds = [g.kind for g in s.groups]
    assert kinds.count("extern") == 2
    extern_ops = [g.nodes[0].op for g in s.groups if g.kind == "extern"]
    assert sorted(extern_ops) == ["matmul", "nonzero"]


def test_buffers_are_freed_after_their_last_use():
    g = gen(lambda a, b: stax.softmax(a @ b, -1), X(8, 4), X(4, 6))
    w = g.wrapper.splitlines()
    mm = next(i for i, line in enumerate(w) if "extern_kernel('matmul'" in line)
    launch = next(i for i, line in enumerate(w) if "kernels.cpp_fused_0" in line)
    name = w[mm].split("=")[0].strip()
    assert mm < launch and any(line.strip().startswith("del") and name in line for line in w[launch:])


def test_dependent_kernels_launch_in_dependence_order():
    g = gen(lambda x: (x - x.sum(0)).amax(-1), X(16, 8))
    assert len(g.kernels) == 2
    w = g.wrapper
    assert w.index("kernels.cpp_fused_0") < w.index("kernels.cpp_fused_1")
