"""Goldens of the dynamic forms (§10.3) of Example 1.1 and softmax: the Triton kernels and the
wrapper with sizes as parameters (`s0 = arg0_1.shape[0]`, `xnumel`/`r0_numel` passed in) and
every mask kept. Compared exactly, as tests/test_gpu.py compares the static goldens (which, with
Listings 9.1, 9.2, 9.4 and 9.5, are unchanged by dynamic mode); `--regen-goldens` rewrites them.
"""
from pathlib import Path

import pytest

import stax
from stax import capture, dynshape

GOLDEN = Path(__file__).parent / "golden"

DYNAMIC_EXAMPLES = {
    "ex1_1_dynamic": (lambda x, y: (stax.relu(x + y) * 2).sum(-1), [(64, 128), (64, 128)]),
    "softmax_dynamic": (lambda x: stax.softmax(x, -1), [(256, 1000)]),
}


def _dynamic_source(name):
    fn, shapes = DYNAMIC_EXAMPLES[name]
    env = dynshape.ShapeEnv()
    graph, _ = capture.capture(fn, [stax.randn(*s) for s in shapes], shape_env=env)
    graph.index32 = env.index32(capture.tensor_layouts(graph))     # as stax.compile does for cuda
    gen = stax._compile_graph(graph, "cuda", name)
    return "\n".join(gen.kernels.values()) + "\n\n" + gen.wrapper


@pytest.mark.parametrize("name", list(DYNAMIC_EXAMPLES))
def test_dynamic_golden(name, request):
    path = GOLDEN / f"{name}.py"
    text = _dynamic_source(name)
    if request.config.getoption("--regen-goldens"):
        path.write_text(text)
    assert path.exists(), f"{path} missing: run pytest tests/test_golden_dynamic.py --regen-goldens"
    assert text == path.read_text(), f"generated code for {name} differs from {path}"
    kernels = text.split("def call")[0]
    assert "numel = " not in kernels.replace("rnumel = r0_numel", "")   # sizes are parameters
    assert "xmask = xindex < xnumel" in kernels and "r0_mask = r0_index < r0_numel" in kernels
    assert "s0 = arg0_1.shape[0]" in text and "s1 = arg0_1.shape[1]" in text
