"""Offline (no GPU): the static and the dynamic=True kernels of a reduction workload, built for sm_90,
their instruction counts side by side (issue 10: dynamic within 1.10x of static on the H200).

    python bench/dynamic_ptx.py [var0|bnstats|softmax|softmax:verylong] [--shape 8192x4096] [--out DIR]
        [--config R0_BLOCK=32768,num_warps=32]

For each kernel of each artifact it prints the launch configuration the heuristic picks at the
hint (`triton_heuristics.default_config` at the launch's numels), the PTX and SASS instruction
counts of the whole kernel and of each loop (a label to the branch back to it), and of those the
integer div/rem, 64-bit multiplies, compares, selects, float divisions and global loads. With
--out, the kernel texts, .ptx and .sass files go there. Nothing runs: `stax._compile_graph` is
stopped once it has generated the artifact (under TRITON_INTERPRET=1, so a "cuda" tensor needs
no GPU), then a process of its own without it (`--build`) runs `triton.compile` for sm_90 on each
kernel (`CachingAutotuner.compile_for`'s route) with the size arguments marked multiples of 16,
as the H200 launch does at these sizes.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

import stax

WORKLOADS = {"var0": (lambda x: x.var(0), (8192, 4096)),
             "bnstats": (lambda x: (x.mean((0, 2, 3)), x.var((0, 2, 3))), (32, 256, 56, 56)),
             "softmax": (lambda x: stax.softmax(x, -1), (4096, 32768)),
             "softmax:verylong": (lambda x: stax.softmax(x, -1), (2048, 65536))}


class _Generated(Exception):
    pass


def generated(fn, shape, dynamic: bool):
    """The artifact stax.compile would build for one call at `shape` (not run)."""
    plain = stax._compile_graph

    def stop(*args, **kwargs):
        raise _Generated(plain(*args, **kwargs))
    stax._compile_graph = stop
    try:
        stax.compile(fn, dynamic=dynamic)(stax.tensor(np.zeros(shape, np.float32)).to("cuda"))
    except _Generated as g:
        return g.args[0]
    finally:
        stax._compile_graph = plain
    raise RuntimeError("no artifact was compiled (served from a cache? set a fresh STAX_CACHE_DIR)")


def _ptx_ops(lines):
    out = []
    for line in lines:
        s = line.strip()
        if not s or s.startswith(("//", ".", "$", "{", "}", "(", ")")) or s.endswith(":"):
            continue
        words = s.split()
        out.append((words[1] if s.startswith("@") and len(words) > 1 else words[0]).rstrip(";"))
    return out


def _summary(ops) -> dict:
    c = collections.Counter(ops)

    def n(*prefixes):
        return sum(v for k, v in c.items() if k.startswith(prefixes))
    return {"all": len(ops), "div/rem int": n("div.s", "div.u", "rem."), "64-bit mul": n(
        "mul.wide", "mul.lo.s64", "mad.wide", "mad.lo.s64", "mul.lo.u64"), "setp": n("setp"),
        "selp": n("selp"), "div f32": n("div.full", "div.rn", "div.approx", "rcp"), "ld.global": n("ld.global")}


def ptx_loops(ptx: str) -> list:
    """(label line, branch line) of each loop: a branch back to a label above it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$L\w+):", line.strip()))}
    return [(labels[m.group(1)], i) for i, line in enumerate(lines)
            if (m := re.search(r"bra(?:\.uni)?\s+(\$L\w+);", line)) and labels.get(m.group(1), i) < i]


def _top_level_args(text: str) -> list:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([" and 1 or -(ch in ")]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()] if cur.strip() else out


def launch_numels(gen, shape) -> dict:
    """kernel name -> the numels its launch passes at `shape` (the wrapper's `.run(...)` lines,
    their size expressions evaluated at the input's sizes)."""
    sizes = {m.group(1): shape[int(m.group(2))] for m in re.finditer(r"(s\d+) = arg0_1\.shape\[(\d+)\]", gen.wrapper)}
    multi = getattr(gen.module, "multi", None) or {}
    out = {"sizes": sizes}
    for m in re.finditer(r"(\w+)\.run\((.*), stream=", gen.wrapper):
        args = _top_level_args(m.group(2))
        for name in multi.get(m.group(1), [m.group(1)]):
            names = [n for n in re.search(r"signature=(\{.*?\})", gen.kernels[name]).group(1).split("'")
                     if n.endswith("numel")]
            out[name] = {n: int(eval(a, {}, dict(sizes))) for n, a in zip(names, args[len(args) - len(names):])}
    return out


def build(name, source, out_dir=None, numels=None, sizes=None, override=None) -> dict:
    """Build one kernel for sm_90 in the heuristic configuration of its launch (`numels`; else
    its size hints) updated by `override` (--config), its size arguments `sizes` marked with the
    powers of two they are multiples of (as a launch does: `CachingAutotuner._divs`); its counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from stax.triton_heuristics import default_config, even_r0, kernel_from_source
    k = kernel_from_source(name, source)
    numels = {**(numels or {f"{p}numel": n for p, n in k.size_hints.items()}), **k.meta}
    cfg = {**default_config(k.kind, numels, k.reduction_hint, k.r0_block), **(override or {})}
    constexprs = {c: v for c, v in cfg.items() if c.isupper()}
    if k.meta.get("even_r0"):          # the launch's specialization (CachingAutotuner._even_r0)
        constexprs["EVEN_R0"] = even_r0(numels.get("r0_numel", 0), cfg.get("R0_BLOCK", k.r0_block))
    sig = dict(k.signature)
    for c in constexprs:
        sig.setdefault(c, "constexpr")
    from stax.triton_heuristics import _pow2_divisor
    values = {**(sizes or {}), **(numels or {})}
    divs = tuple((i, _pow2_divisor(values[a])) for i, a in enumerate(k.signature)
                 if a in values and not k.signature[a].startswith("*") and values[a] % 2 == 0)
    src = ASTSource(fn=k.fn, signature=sig, constexprs=constexprs, attrs=k._attrs(True, divs))
    built = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    ptx, cubin = built.asm["ptx"], built.asm["cubin"]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass, regs = "", ""
    if os.path.exists(tool):
        path = os.path.join(out_dir or "/tmp", f"{name}_{os.getpid()}.cubin")
        with open(path, "wb") as fh:
            fh.write(cubin)
        sass = subprocess.run([tool, "-c", path], capture_output=True, text=True).stdout
        usage = subprocess.run([tool.replace("nvdisasm", "cuobjdump"), "-res-usage", path],
                               capture_output=True, text=True).stdout
        regs = (re.findall(r"REG:(\d+)", usage) or [""])[0]
        if not out_dir:
            os.remove(path)
    if out_dir:
        for ext, text in ((".py", source), (".ptx", ptx), (".sass", sass)):
            with open(os.path.join(out_dir, name + ext), "w") as fh:
                fh.write(text)
    lines = ptx.splitlines()
    sass_ops = [line for line in sass.splitlines() if re.match(r"^\s+/\*[0-9a-f]{4}\*/\s+(?!NOP)", line)]
    return {"config": cfg, "kernel": _summary(_ptx_ops(lines)), "sass": len(sass_ops), "regs": regs,
            "loops": [_summary(_ptx_ops(lines[a:b + 1])) for a, b in ptx_loops(ptx)]}


def main(argv):
    if argv and argv[0] == "--build":             # the child: [(title, where, name, source)]
        for title, where, name, source, numels, sizes, override in json.load(open(argv[1])):
            if title:
                print(title)
            r = build(name, source, where, numels, sizes, override)
            print(f"  {name}  launch {numels}  {r['config']}  SASS {r['sass']}  registers {r['regs']}")
            print(f"    PTX kernel {r['kernel']}")
            for i, loop in enumerate(r["loops"]):
                print(f"    PTX loop {i}  {loop}")
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"       # generate for "cuda" without a GPU
        os.execv(sys.executable, [sys.executable] + sys.argv)
    which = argv[0] if argv and not argv[0].startswith("--") else "var0"
    fn, shape = WORKLOADS[which]
    if "--shape" in argv:
        shape = tuple(int(v) for v in argv[argv.index("--shape") + 1].split("x"))
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    override = {}
    if "--config" in argv:                         # e.g. --config R0_BLOCK=32768,num_warps=32
        override = {k: int(v) for k, v in (kv.split("=") for kv in argv[argv.index("--config") + 1].split(","))}
    todo = []
    for kind in ("static", "dynamic"):
        gen = generated(fn, shape, kind == "dynamic")
        where = os.path.join(out, kind) if out else None
        if where:
            os.makedirs(where, exist_ok=True)
        title = f"== {which} {'x'.join(map(str, shape))} {kind}"
        numels = launch_numels(gen, shape)
        todo += [(title if i == 0 else "", where, name, source, numels.get(name), numels["sizes"], override)
                 for i, (name, source) in enumerate(gen.kernels.items())]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(todo, fh)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        subprocess.run([sys.executable, os.path.abspath(__file__), "--build", fh.name], env=env, check=True)
    finally:
        os.remove(fh.name)


if __name__ == "__main__":
    main(sys.argv[1:])
