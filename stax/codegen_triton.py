"""§9.7 GPU code generation, the entry: fusion groups → Triton kernels + the wrapper of Listing 9.6.

Layer: back end (GPU), the top of the Triton writers. Mirrors codegen_cpp.py: `generate(schedule)`
returns the text of a module and loads nothing (runtime.load_module imports it). It imports the
kernel writer (`triton_kernel`: pointwise kernels and the kernel's text), the reduction forms
(`triton_reduction`), the §9.8 matmul template (`templates`) and the shared wrapper pieces
(`wrapper`).

Consumes a `schedule.Schedule` (the same one the C++ back end prints); produces a `TritonModule`:
one Python module holding a Triton kernel per fusion group (`triton_poi_fused_N`,
`triton_per_fused_N`, `triton_red_fused_N`, `triton_tem_fused_mm_N`, `triton_tem_fused_conv_N`), each handed to
`async_compile.triton(...)`, and the wrapper `call(args)` of Listing 9.6.

Where to look:
  - `split_policy` ....................... Alg. 6.1 on the GPU: split when outputs cannot fill the SMs
  - `triton_kernel.py` ................... §9.1–9.3 the printer, tiling, pointwise kernels
  - `triton_reduction.py` ................ §9.4–9.5 reduction kernels (Listings 9.1, 9.4, 9.5)
  - `triton_scan.py` ..................... scans (cumsum, ...): tl.associative_scan, looped with a carry
  - `templates.py` ....................... §9.8 the matmul kernel
  - `conv_template.py` ................... §9.8 the convolution kernel (implicit GEMM)
  - `_wrapper` ........................... Listing 9.6
  - `generate(schedule)` ................. the entry point; `TritonModule.source` the module's text
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import sympy

from .ir import Scatter
from .attention_grad import backward_templates, bwd_extern_spec
from .attention_kernels import _extern_operand, attention_template, extern_spec, launch_numels
from .conv_template import conv_applies, conv_template
from .templates import mm_extern, mm_template, template_applies, tf32_operand_strides
from .triton_kernel import Target, TritonKernel, current_target, finish, pointwise_kernel
from .triton_outer import OUTER_PERSISTENT_LIMIT, one_kernel_split, outer_applies, outer_reduction_kernel
from .triton_reduction import MULTI_PASS_PERSISTENT_LIMIT, reduction_kernel
from .triton_scan import scan_kernel
from .wrapper import (extern_call, pyarg, pydtype, pyint, pylit, pyname, pyoutputs, pyshape, pysize,
                      wrapper_launches, wrapper_prologue)

# ---- §6.1 Alg. 6.1 on the GPU ----


def split_policy(numel_out, numel_red, target: Target | None = None) -> int:
    """Alg. 6.1 on the GPU: too few outputs to give every SM work → split each row in two levels."""
    sm = (target or current_target()).sm_count
    out, red = sympy.sympify(numel_out), sympy.sympify(numel_red)
    if not (out.is_Integer and red.is_Integer):
        return 1
    out, red = int(out), int(red)
    if out >= 2 * sm or red <= 8192:
        return 1
    if out * red <= 32 * sm * 2048:                 # a modest reduction: pieces of about 8192
        return -(-red // 8192)
    splits = 1 << max(0, math.ceil(math.log2(8 * sm / out)))   # enough programs for every SM
    return max(1, min(splits, red // 8192))


OUTER_XBLOCK = 64           # the outputs one program of an OUTER kernel covers (autotune's default)
operand_strides = tf32_operand_strides   # (lower.lower's hook: tf32 matmul operands K-major)
OUTER_MAX_SPLITS = 64       # the partials' reduction stays persistent (§9.4's OUTER bound)
OUTER_MIN_PIECE = 128       # rows each piece reduces, at least
OUTER_MIN_ELEMENTS = 1 << 18    # below this one kernel beats two launches


def outer_split_policy(numel_out, numel_red, target: Target | None = None) -> int:
    """Alg. 6.1 for a reduction that reads across rows (§9.4 OUTER): a program covers OUTER_XBLOCK
    outputs, so the outputs give out / OUTER_XBLOCK programs, not `out`; split the rows until there
    are about four programs per SM. The partials are [splits, outputs] (lower.split_reduction)."""
    sm = (target or current_target()).sm_count
    out, red = sympy.sympify(numel_out), sympy.sympify(numel_red)
    if not (out.is_Integer and red.is_Integer):
        return 1
    out, red = int(out), int(red)
    programs = -(-out // OUTER_XBLOCK)
    if programs >= 4 * sm or out * red < OUTER_MIN_ELEMENTS or red < 2 * OUTER_MIN_PIECE:
        return 1
    splits = 1 << math.ceil(math.log2(4 * sm / programs))
    return max(1, min(splits, OUTER_MAX_SPLITS, red // OUTER_MIN_PIECE))


def deviation_piece(numel_out, numel_red, outer: bool) -> int:
    """Elements per piece of var's deviations (lower.chunk_deviations): a piece an OUTER kernel
    holds in registers (§9.4's bound of 64 rows), so each piece is read once. A row (INNER) up to
    MULTI_PASS_PERSISTENT_LIMIT is already read once by the persistent form (and its per-element
    epilogue, layer_norm's, shares that read): longer rows go in pieces of 1024."""
    if outer:
        return OUTER_PERSISTENT_LIMIT
    return 1024 if numel_red > MULTI_PASS_PERSISTENT_LIMIT else 0


# ---- §9.7 The module and its wrapper ----


@dataclass
class TritonModule:
    """The generated text: kernels (launch order), the wrapper, and the alternative kernels of a
    multi-pass row (§9.4). runtime.load_module imports it."""
    kind = "triton"                  # (a class attribute: the artifact cache's record says which loader)
    kernels: dict
    wrapper: str
    schedule: object
    multi: dict = None               # multi_kernel_N -> the names of its alternative kernels
    choices: dict = None             # mm_choice_N -> the key of its record (template or cuBLASLt)

    @property
    def source(self) -> str:
        """The module: each kernel's text handed to async_compile (Listing 9.6), then `call`.

        Kernels are compiled on first launch and their cubins cached on disk, so a process that
        finds everything in the cache never imports triton.
        """
        for text in self.kernels.values():    # each text sits verbatim between triple quotes
            if "\'\'\'" in text or "\\" in text:
                raise ValueError("Stax will not quote a kernel text that holds triple quotes or a backslash")
        loads = [f"{pyname(name)} = async_compile.triton('{name}', \'\'\'\n{text}\'\'\', device_str='cuda')"
                 for name, text in self.kernels.items()]
        loads += [f"{pyname(name)} = async_compile.multi_kernel('{name}', [{', '.join(map(pyname, names))}])"
                  for name, names in (self.multi or {}).items()]
        loads += [f"{pyname(name)} = async_compile.mm_choice('{name}', {pylit(key)})"
                  for name, key in (self.choices or {}).items()]
        return "\n\n".join(loads + [self.wrapper])

    def __str__(self):
        return self.source


def _wrapper(sched, calls) -> str:
    """Listing 9.6: check inputs, then under the device context allocate, launch, `del` (§7.5)."""
    outs = pyoutputs(sched.lowered)
    lines = wrapper_prologue(sched.lowered, ", 'input'")
    launches = wrapper_launches(sched, calls, "        ")
    if launches:                     # (a function returning only views of its inputs launches nothing)
        lines += ["    with stax.cuda.device(0):"] + launches
    lines.append(f"    return ({', '.join(outs)}{', ' if len(outs) == 1 else ''})")
    return "\n".join(lines) + "\n"


_NUMEL_TEXT = re.compile(r"[A-Za-z0-9_ +\-*/()]*\Z")


def _numel_text(text: str) -> str:
    """A launch's numel argument, printed from the IR's sympy sizes (texpr): digits, size symbols
    and arithmetic only, checked like every other printed value."""
    if not _NUMEL_TEXT.match(text):
        raise ValueError(f"Stax will not print the numel {text!r} into generated code")
    for word in re.findall(r"[A-Za-z_]\w*", text):
        pyname(word)
    return text


STREAM_LINE = "raw_stream0 = get_raw_stream(0)"


def _alloc(name, layout, dtype) -> str:
    return (f"{pyname(name)} = empty_strided_cuda({pyshape(layout.shape)}, {pyshape(layout.stride)}, "
            f"stax.{pydtype(dtype)})")


def _fused_kernel(index: int, g, sched) -> tuple:
    """A fusion group's kernel text: ({name: source}, the buffers it takes, its numels, and the
    names of its two alternative forms when a multi-pass row has both (§9.4), else None)."""
    k = TritonKernel(index, g, sched)
    if g.kind == "pointwise":
        form, lines, hint = pointwise_kernel(k)
    elif g.kind == "scan":           # §9.4-style: tl.associative_scan along the r0_ axis
        form, lines, hint = scan_kernel(k)
    elif outer_applies(k):           # §9.4 OUTER: reads across rows, coalesced along the outputs
        form, lines, hint = outer_reduction_kernel(k)
    else:
        form, lines, hint = reduction_kernel(k)
    name, src, params, numels = finish(k, form, lines, hint)
    if k.other_form is None:
        return {name: src}, params, numels, None
    # both forms of a multi-pass row; the first launch measures them (multi_kernel_N)
    k2 = TritonKernel(index, g, sched)
    k2.force_form = k.other_form
    name2, src2, params2, _ = finish(k2, *reduction_kernel(k2))
    assert params2 == params, (params, params2)
    return {name: src, name2: src2}, params, numels, [name, name2]


def _attention_call(index: int, e, spec, operands, launch, low) -> list:
    """§9.10: an `sdpa` node as the flash template. Its LSE is scratch, or, for a node recorded
    with its LSE (training, params with_lse), the buffer of that `attn_lse` node (`_lse_paired`)."""
    name, src = attention_template(index, spec)
    call = [_alloc(e.name, e.layout, e.dtype)]
    if e.params.get("with_lse"):
        lse = _extern_operand(e.inputs[-1], low)[0]
    else:
        lse = f"{e.name}_lse"
        call.append(f"{pyname(lse)} = empty_strided_cuda(({spec.dims[0] * spec.dims[1] * spec.dims[3]},), (1,), "
                    "stax.float32)")
    launch(call, {name: src}, name, [pyname(o) for o in operands + [e.name, lse]]
           + [str(int(n)) for n in launch_numels(spec)])
    if not e.params.get("with_lse"):
        call.append(f"del {pyname(lse)}")
    return call


def _lse_paired(e, low) -> bool:
    """Is this `attn_lse` / `omni_lse` node written by the template launch of the attention node
    that takes it as its LSE (attention.py records that node on the same inputs)? Then its group
    only allocates it; the launch comes later (the attention node reads it)."""
    if e.op not in ("attn_lse", "omni_lse"):
        return False
    return any(getattr(b, "params", {}).get("with_lse") and b.inputs and b.inputs[-1] == e.name
               and extern_spec(b, low)[0] is not None for b in low.buffers)


def _backward_call(index: int, e, bs, operands, launch) -> list:
    """§9.10: an `attn_bwd` node as the two backward kernels, writing dQ, dK, dV into its one buffer."""
    call = [_alloc(e.name, e.layout, e.dtype)]
    for (name, src, numels), outs in zip(backward_templates(bs, index), ([e.name, e.name], [e.name])):
        launch(call, {name: src}, name, [pyname(o) for o in operands + outs] + [str(int(n)) for n in numels])
    return call


def _template_calls(index, g, sched, call, new, allocated, multi, choices, launch) -> int:
    """The launches of one 'template' group (§9.8): its scratch (split-K partials), its kernels
    (a multi_kernel when the persistent TMA template competes), and, where cuBLASLt is installed
    and can run it, the extern branch measured against them (Alg. 9.1); returns the next index."""
    low = sched.lowered
    launches, scratch = mm_template(index, g, sched)
    extern = mm_extern(index + len(launches), g, sched)
    for t in launches:            # the group's outputs, before either branch writes them
        fresh = [p for p in t.params if p not in allocated | new | set(scratch) | set(low.scalars)]
        call += [_alloc(p, low.buffer(p).layout, low.buffer(p).dtype) for p in fresh]
        new |= set(fresh)
    body = [f"{pyname(s)} = empty_strided_cuda(({pyint(n)},), (1,), stax.{pydtype(d)})"
            for s, (n, d) in scratch.items()]
    for t in launches:
        sources, runner = {t.name: t.source}, t.name
        if t.alternative is not None:      # Alg. 9.1 measures both at the first launch
            assert t.alternative.params == t.params, (t.params, t.alternative.params)
            sources[t.alternative.name] = t.alternative.source
            runner = f"multi_kernel_{index}"
            multi[runner] = [t.name, t.alternative.name]
        launch(body, sources, runner, [pyname(o) for o in t.params] + [pysize(v) for v in t.numels])
        index += 1
    if scratch:
        body.append(f"del {', '.join(pyname(s) for s in scratch)}")
    if extern is None:
        call += body
        return index
    n = index - len(launches)
    choice = f"mm_choice_{n}"
    choices[choice] = extern.key
    other = _extern_lines(extern, g, low, launch)
    call += [line for line in body + other if line == STREAM_LINE]    # (defined outside both branches)
    call += [f"# §9.8 Alg. 9.1: the Triton template or cuBLASLt, whichever the first call measures faster",
             f"def template_{n}():"] + ["    " + line for line in body if line != STREAM_LINE]
    call += [f"def extern_{n}():"] + ["    " + line for line in other if line != STREAM_LINE]
    call.append(f"{choice}.run(template_{n}, extern_{n})")
    return index + (extern.kernel is not None)


def _extern_lines(x, g, low, launch) -> list:
    """cuBLASLt's branch: `extern_kernels.mm(...)` (Inductor's spelling), then the epilogue kernel
    when cuBLASLt does not fuse it."""
    e = g.nodes[0]
    lines = [_alloc(name, e.layout, d) for name, (_, d) in x.scratch.items()]
    extra = (f", bias={pyname(x.bias)}" if x.bias else "") + (f", epilogue={pylit(x.epilogue)}"
                                                             if x.epilogue != "none" else "")
    lines.append(f"extern_kernels.mm({pyarg(x.a)}, {pyarg(x.b)}, out={pyname(x.out)}{extra}, "
                 f"compute={pylit(x.compute)})")
    if x.kernel is not None:
        t = x.kernel
        launch(lines, {t.name: t.source}, t.name, [pyname(o) for o in t.params] + [pysize(v) for v in t.numels])
    if x.scratch:
        lines.append(f"del {', '.join(pyname(s) for s in x.scratch)}")
    return lines


def _extern_group(index: int, e, low, call: list, new: set, launch) -> int:
    """An extern node's lines: the conv template (§9.8), the attention templates forward and
    backward (§9.10; an LSE the forward template writes needs only its buffer), or a fallback call."""
    if conv_applies(e, low):         # §9.8: a convolution runs as an implicit-GEMM Triton template
        name, src, operands, numels, split = conv_template(index, e, low)
        call.append(_alloc(e.name, e.layout, e.dtype))
        scratch = []
        if split is not None:        # split-K candidates: float32 partials, the tiles' counters
            scratch = [split.partials, split.counts]
            call += [f"{pyname(split.partials)} = empty_strided_cuda(({pyint(split.partials_numel)},), (1,), "
                     "stax.float32)",
                     f"{pyname(split.counts)} = zeroed_workspace_cuda({pylit(split.counts)}, "
                     f"{pyint(split.counts_numel)})"]
        launch(call, {name: src}, name, [pyname(o) for o in operands + [e.name] + scratch]
               + [pysize(v) for v in numels])
        if scratch:
            call.append(f"del {', '.join(pyname(s) for s in scratch)}")
        index += 1
    elif extern_spec(e, low)[0] is not None:     # §9.10: attention runs as the flash template
        spec, operands = extern_spec(e, low)
        call += _attention_call(index, e, spec, operands, launch, low)
        index += 1
    elif _lse_paired(e, low):
        call.append(_alloc(e.name, e.layout, e.dtype))
    elif bwd_extern_spec(e, low)[0] is not None:  # §9.10: the backward templates, P from the LSE
        bs, operands = bwd_extern_spec(e, low)
        call += _backward_call(index, e, bs, operands, launch)
        index += 1
    else:
        call += extern_call(e, low.unbacked, f"stax.{pydtype(e.dtype)}", low.checks)
    new.add(e.name)
    return index


def _one_kernel_calls(index: int, ga, gb, sched, allocated: set, launch, multi: dict):
    """§6.5: Alg. 6.1's split (groups ga, gb) as one kernel (triton_outer.one_kernel_split): its
    buffers, its blocks' counters (int32, zeroed once, kept per artifact: the kernel sets each
    back to 0) and its launch (a multi_kernel of both forms when the pieces' kernel has two);
    (lines, the buffers they define), or None."""
    fused = one_kernel_split(index, ga, gb, sched)
    if fused is None:
        return None
    name, src, params, numels, (counter, count), other = fused
    sources, runner = {name: src}, name
    if other is not None:            # both forms of a multi-pass row's pieces; the first launch measures
        name2, src2, params2 = one_kernel_split(index, ga, gb, sched, force_form=other)[:3]
        assert params2 == params, (params, params2)
        sources[name2] = src2
        runner = f"multi_kernel_{index}"
        multi[runner] = [name, name2]
    call, new, low = [], set(), sched.lowered
    for p in params:
        if p == counter:
            call.append(f"{pyname(p)} = zeroed_workspace_cuda({pylit(p)}, {_numel_text(count)})")
        elif p not in allocated:
            b = low.buffer(p)
            call.append(_alloc(p, b.layout, b.dtype))
            new.add(p)
    launch(call, sources, runner, [pyname(p) for p in params] + [_numel_text(n) for n in numels])
    call.append(f"del {pyname(counter)}")
    return call, new


def generate(sched) -> TritonModule:
    """Print every fusion group as a Triton kernel (or a template, or a fallback call) + `call`."""
    low = sched.lowered
    kernels, multi, choices, calls, allocated = {}, {}, {}, [], {b.name for b in low.inputs}
    index = 0                        # the N of each kernel's name
    stream = []                      # [True] once raw_stream0 is defined

    def launch(call, sources: dict, runner: str, args: list):
        if not stream:
            call.append(STREAM_LINE)     # before the first launch
            stream.append(True)
        kernels.update(sources)
        call.append(f"{pyname(runner)}.run({', '.join(args)}, stream=raw_stream0)")

    groups, combined = sched.groups, set()     # combined: groups a one-kernel split launched
    for pos, g in enumerate(groups):
        call, new = [], set()
        fused = None
        if g.kind == "reduction" and g.index not in combined:
            fused = _one_kernel_calls(index, g, groups[pos + 1] if pos + 1 < len(groups) else None,
                                      sched, allocated, launch, multi)
        if g.index in combined:
            pass                     # (its lines ran in the one kernel before it)
        elif fused is not None:
            call, new = fused
            combined.add(groups[pos + 1].index)
            index += 1
        elif g.kind == "template":     # §9.8: a matmul template and the epilogue fused into it
            index = _template_calls(index, g, sched, call, new, allocated, multi, choices, launch)
        elif g.kind == "extern":
            index = _extern_group(index, g.nodes[0], low, call, new, launch)
        else:
            sources, params, numels, alternatives = _fused_kernel(index, g, sched)
            for p in params:
                if p not in allocated:
                    b = low.buffer(p)
                    call.append(_alloc(p, b.layout, b.dtype))
                    new.add(p)
            runner = next(iter(sources))
            if alternatives is not None:
                runner = f"multi_kernel_{index}"
                multi[runner] = alternatives
            launch(call, sources, runner, [pyname(p) for p in params] + [_numel_text(n) for n in numels])
            index += 1
            for n in g.nodes:          # a scatter's result is the memory it wrote into
                if isinstance(n, Scatter):
                    call.append(f"{pyname(n.name)} = {pyname(n.target)}")
                    new.add(n.name)
        allocated |= new
        calls.append((g.index, call, new))
    return TritonModule(kernels, _wrapper(sched, calls), sched, multi, choices)
