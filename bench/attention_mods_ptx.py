"""§9.10 (issue 15): the inner loops of omni_attention's kernels built for sm_90, score_mod plan on and off.

bench/gpu.py's "omni causal+alibi" row (B=8, H=16, N=4096, bf16, ALiBi score_mod, causal block
mask) as the forward template (and, with --backward, the dK/dV and dQ kernels), built for sm_90
in their default configuration with the score_mod plan (stax/attention_mods.py) and without it
(STAX_SCORE_MOD_PLAN=0: the traced lines per score). For each loop of the PTX (a label and the
backward branch to it) it prints the instruction count and the counts of the opcodes a score_mod
costs (cvt, sub, mul, fma, ex2), and the SASS instruction count of the same loops (nvdisasm).
No GPU needed:

    python bench/attention_mods_ptx.py [--d 64] [--backward] [--mod alibi|softcap|rel]
"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import stax  # noqa: E402
from stax.attention import trace_mod  # noqa: E402
from stax.attention_grad import BackwardSpec, backward_templates  # noqa: E402
from stax.attention_kernels import PLAN_ENV, attention_template, contiguous_operand, make_spec  # noqa: E402
from stax.triton_heuristics import default_config, kernel_from_source  # noqa: E402

MODS = {
    "alibi": lambda s, b, h, q, kv: s - stax.exp2(-(h + 1).to(stax.float32)) * (q - kv),
    "softcap": lambda s, b, h, q, kv: 20.0 * stax.tanh(s / 20.0),
    "rel": lambda s, b, h, q, kv: s + (q - kv).to(stax.float32) * 0.1,
}
OPS = ("cvt", "sub", "add", "mul", "fma", "ex2", "selp", "max")


def causal(b, h, q, kv):
    return q >= kv


def kernels(d: int, mod: str, backward: bool) -> list:
    """(name, source) of the forward template (block-sparse, causal) [and the two backward ones]."""
    b, h, n = 8, 16, 4096
    x = contiguous_operand((b, h, n, d))
    spec = make_spec(x, x, x, x, "bfloat16")
    spec.score_mod, spec.mask_mod = trace_mod(MODS[mod], True), trace_mod(causal, False)
    out = []
    if backward:
        bs = BackwardSpec(spec, x, x, trace_mod(MODS[mod], True, derivative=True))
        out += [(name, src) for name, src, _ in backward_templates(bs)]
    blocks = n // 128
    spec.sparse = (128, 128, contiguous_operand((1, 1, blocks, 1)), contiguous_operand((1, 1, blocks, blocks)))
    return [attention_template(0, spec)] + out


def loops(text: str, instruction: re.Pattern, label: re.Pattern, branch: re.Pattern) -> list:
    """[(label, instruction lines)] of each loop: from a label to the last branch back to it."""
    lines = text.splitlines()
    where = {m.group(1): i for i, line in enumerate(lines) if (m := label.match(line))}
    found = {}
    for i, line in enumerate(lines):
        m = branch.search(line)
        if m and m.group(1) in where and where[m.group(1)] < i:
            found[m.group(1)] = (where[m.group(1)], i)
    return [(name, [x for x in lines[a:b + 1] if instruction.match(x)]) for name, (a, b) in found.items()]


PTX = (re.compile(r"\s+@?%?[!\w.]*\s*[a-z][\w.]*[ \t].*;|\s+(ret|bar\.sync\s.*);"),
       re.compile(r"(\$L__BB\d+_\d+):"), re.compile(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);"))
SASS = (re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+\S"), re.compile(r"(\.L_x_\d+):"),
        re.compile(r"BRA\s+(?:`\()?(\.L_x_\d+)"))


def opcode(line: str) -> str:
    x = line.strip().split()
    x = x[1:] if x[0].startswith("@") else x
    return x[0].split(".")[0]


def sass_of(cubin: bytes) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([tool, "-c", fh.name], capture_output=True, text=True, check=True).stdout


def build(name: str, src: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kern = kernel_from_source(name, src)
    numels = {**{f"{p}numel": n for p, n in kern.size_hints.items()}, **kern.meta}
    cfg = default_config(kern.kind, numels, kern.reduction_hint, kern.r0_block)
    consts = {k: v for k, v in cfg.items() if k.isupper()}
    sig = {**kern.signature, **{k: "constexpr" for k in consts}}
    compiled = triton.compile(ASTSource(fn=kern.fn, signature=sig, constexprs=consts, attrs=kern._attrs(True)),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    ptx_loops = loops(compiled.asm["ptx"], *PTX)
    sass_loops = loops(sass_of(compiled.asm["cubin"]), *SASS)
    return {"kernel": name, "config": {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")},
            "ptx_loops": [{"instructions": len(body), **{op: c for op, c in collections.Counter(
                opcode(x) for x in body).items() if op in OPS}} for _, body in ptx_loops],
            "sass_loops": [len(body) for _, body in sass_loops]}


def main(argv):
    d = int(argv[argv.index("--d") + 1]) if "--d" in argv else 64
    mod = argv[argv.index("--mod") + 1] if "--mod" in argv else "alibi"
    rows = []
    for plan in ("0", "1"):
        os.environ[PLAN_ENV] = plan
        for name, src in kernels(d, mod, "--backward" in argv):
            row = {"plan": plan == "1", "mod": mod, "d": d, **build(name, src)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
