"""§10.4 dynamic training (issues 10, 16 item 5): a training step compiled static against one
compiled with dynamic=True, on the H200.

    python bench/dyn_train.py [--json FILE]

The step: bench/gpu.py's 4-layer width-1024 MLP (linear + gelu, mse loss), forward + backward
(the parameters' .grad), the loss stax.compile'd. For each batch size it prints the static step's
milliseconds (its own pair of artifacts per size), the dynamic step's (one shape-polymorphic
forward and one backward for every size, timed after all sizes have run once), the ratio
dynamic / static (the kernels take their sizes at run time; target <= 1.10 at the hint, batch 64)
and the compiles of each. Gradients of the two are checked against each other at every size.
Without a GPU it runs a smoke pass at small sizes through TRITON_INTERPRET=1 (no times).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402  (bench/gpu.py: time_calls, the MLP)
from gpu import cuda, stax  # noqa: E402

BATCHES = [64, 17, 33, 100, 128, 250]      # the first is the hint the dynamic artifacts are made at


def _step(f, params, x, y):
    def step():
        for p in params:
            p.grad = None
        loss = f(*params, x, y)
        loss.backward()
        return loss
    return step


def _backward_compiles(f) -> int:
    from stax import aot_autograd
    found = list(f.artifacts.values()) + [e for v in f.guarded.values() for _, e in v]
    return sum(e.stats["backward_compiles"] for e in found if isinstance(e, aot_autograd.TrainingEntry))


def main(json_path=None):
    real = cuda.is_available()
    width, batches = (1024, BATCHES) if real else (32, [4, 7, 9])
    arrays = gpu._mlp_arrays(width, 4, max(batches))
    params = [stax.tensor(a, device="cuda").requires_grad_() for a in arrays[:-2]]
    xs, ys = (stax.tensor(a, device="cuda") for a in arrays[-2:])
    loss = gpu._mlp_loss(stax.nn.functional, 4)
    fs = {"static": stax.compile(loss, dynamic=False), "dynamic": stax.compile(loss, dynamic=True)}
    for n in batches:                                   # every size once: all compiles happen here
        grads = []
        for f in fs.values():
            _step(f, params, xs[:n], ys[:n])()
            grads.append([p.grad.cpu().numpy() for p in params])
        for a, b in zip(*grads):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)
    rows = []
    for n in batches:
        row = {"workload": f"train_mlp4 {width}x{n}", "batch": n}
        if real:
            for kind, f in fs.items():
                row[f"{kind}_ms"] = gpu.time_calls(_step(f, params, xs[:n], ys[:n]), (), iters=20)
            row["ratio"] = row["dynamic_ms"] / row["static_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    counts = {kind: {"forward_compiles": f.stats["compiles"], "backward_compiles": _backward_compiles(f)}
              for kind, f in fs.items()}
    print(json.dumps(counts), flush=True)
    assert counts["dynamic"] == {"forward_compiles": 1, "backward_compiles": 1}, counts
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"rows": rows, "compiles": counts}, fh, indent=1)
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[args.index("--json") + 1] if "--json" in args else None)
