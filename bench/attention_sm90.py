"""§9.10 (issue 15): the flash templates of a compiled GPT-2-small training step, built for sm_90.

Hand-written causal attention (examples/gpt2_block.py's masked_fill form) at GPT-2-small sizes
(B=8, 12 heads, T=1024, head dim 64) in a compiled training step becomes the flash forward and the
dK/dV and dQ backward templates (fuse_attention.py). This prints, for each of them and each of its
candidate configurations (triton_heuristics.candidates), the registers per thread, the spill bytes
and the shared memory of its sm_90 build, under each float32 matmul precision. It needs no GPU:
the kernels are generated with "cuda" tensors in Triton's interpreter's host memory, then built
for sm_90 in a process without TRITON_INTERPRET (cuobjdump, shipped with Triton, reads the cubins):

    python bench/attention_sm90.py [float32|float16|bfloat16] [--t 1024]
"""
import json
import math
import os
import re
import subprocess
import sys
import tempfile

BUILD = "--build" in sys.argv            # the second process: build the kernels it is given
if BUILD:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import stax  # noqa: E402
import stax.nn.functional as F  # noqa: E402
from stax.triton_heuristics import candidates, kernel_from_source  # noqa: E402


def attention_step(q, k, v, w):
    """nanoGPT's attention (the masked_fill'ed scores of a tril mask), times a weight, summed."""
    t = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    keep = stax.tril(stax.ones(t, t, device=q.device)).view(1, 1, t, t)
    return ((F.softmax(att.masked_fill(keep == 0, float("-inf")), dim=-1) @ v) * w).sum()


def _cuobjdump():
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> dict:
    """REG, STACK (spills land on the stack), SHARED, LOCAL of the cubin's one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", fh.name], capture_output=True,
                             text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def generated(dtype, t: int) -> list:
    """(precision, kernel name, source) of the attention kernels of the training step."""
    b, h, d = 8, 12, 64
    shape = (b, h, t, d)
    ins = [stax.empty(*shape, dtype=dtype, device="cuda").requires_grad_() for _ in range(3)]
    w = stax.empty(*shape, dtype=dtype, device="cuda")
    out = []
    for precision in ("highest", "high"):
        stax.set_float32_matmul_precision(precision)
        gen = stax.generate(attention_step, *ins, w, device="cuda")
        assert gen.partition.fused, "the attention was not rewritten"
        out += [(precision, name, src) for name, src in {**gen.kernels, **gen.backward.kernels}.items()
                if "attention" in name]
    stax.set_float32_matmul_precision("highest")
    return out


def build(path: str, dtype_name: str) -> list:
    rows = []
    for precision, name, src in json.load(open(path)):
        kern = kernel_from_source(name, src)
        numels = {**{f"{p}numel": n for p, n in kern.size_hints.items()}, **kern.meta}
        for cfg in candidates(kern.kind, numels):
            try:
                cubin, _, _ = kern.compile_for(90, cfg)
                res = resources(cubin)
            except Exception as e:                  # noqa: BLE001 (report it, go on)
                res = {"error": str(e).splitlines()[-1][:200] if str(e) else type(e).__name__}
            row = {"kernel": name.rsplit("_", 1)[0], "dtype": dtype_name, "precision": precision,
                   "config": dict(cfg), **res}
            rows.append(row)
            print(json.dumps(row), flush=True)
    bad = [r for r in rows if r.get("STACK", 0) or r.get("LOCAL", 0) or "error" in r]
    print(f"{len(rows)} builds for sm_90, {len(bad)} with spills or errors")
    return rows


def main(argv):
    if BUILD:
        return build(argv[argv.index("--build") + 1], argv[argv.index("--dtype") + 1])
    dtype = getattr(stax, argv[0]) if argv and not argv[0].startswith("--") else stax.float32
    t = int(argv[argv.index("--t") + 1]) if "--t" in argv else 1024
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(generated(dtype, t), fh)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--build", fh.name, "--dtype", dtype.name],
                       env=env, check=True)
    finally:
        os.unlink(fh.name)


if __name__ == "__main__":
    main(sys.argv[1:])
