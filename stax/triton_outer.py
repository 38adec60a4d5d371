"""§9.4 The OUTER reduction kernel: a reduction that reads across rows, coalesced along its outputs.

Layer: back end (GPU), beside triton_reduction.py: builds on `triton_kernel`'s printing state and
reuses the row form's identities and masks (`triton_reduction`); codegen_triton.py chooses it.

A reduction over a dim that is not the innermost in memory (`x.sum(0)` of a contiguous matrix, a
bias gradient, batch statistics over (0, 1), `amax` over a middle dim) reads, for one output, a
column: elements a whole row apart. Printed as a row kernel, each program walks its columns with
that stride and a warp's loads touch one element per cache line. The OUTER form turns the block
around: a block is [R0_BLOCK, XBLOCK], XBLOCK consecutive outputs along the block's last (fastest)
dim, so a warp reads consecutive addresses of one row and every load is coalesced along x. The
R0_BLOCK rows of a step are reduced along dim 0 (`tl.sum(_tmp0, 0)[None, :]`).

The chapter's rule (§9.4) decides the form: persistent ('per', the whole reduction in registers)
when the length is static and at most 64 (the OUTER bound), else looped ('red', R0_BLOCK rows a
step). The third form, the split, is decided in lowering: `codegen_triton.outer_split_policy`
splits a reduction whose outputs give too few programs of XBLOCK columns to fill the SMs, with its
partials laid out [splits, outputs] (`lower.split_reduction(outer=True)`), so both of its kernels
are OUTER kernels too; `one_kernel_split` prints the two as one kernel (§6.5): programs (column
block, split) store their partials, and the last of a column block to arrive at its counter runs
the combine's text (two launches, a ramp and a tail saved; STAX_SPLIT_ONE_KERNEL=0 keeps two;
=all does the same for a row reduction's split, printed by `triton_reduction.reduction_kernel`).

Consumes a reduction fusion group; produces (form, lines, 'OUTER') like `reduction_kernel`.

Where to look:
  - `outer_applies` ........ whether a group reads across rows with an output dim contiguous
  - `_x_order` ............. the output dim its loads are contiguous along goes innermost in xindex
  - `_outer_persistent` .... the whole column block in registers (R0_BLOCK = next_pow2(r0_numel))
  - `_outer_looped` ........ R0_BLOCK rows a step, an [R0_BLOCK, XBLOCK] accumulator
  - `outer_reduction_kernel` the entry
  - `one_kernel_split` ...... Alg. 6.1's two OUTER kernels as one: the last split combines
"""
from __future__ import annotations

import os
import re

import sympy

from .autotune import MAX_OUTER_BLOCK, next_pow2
from .dtypes import int32, int64
from .ir import IndexCollector, Reduction, Scatter, index_vars, set_handler, simplify_index
from .schedule import node_index, phases
from .triton_kernel import (GRID_LIMIT_YZ, Axis, TritonKernel, TritonPrinter, axis_lines, finish, grid_y_lines,
                            setup_axes, texpr, tl_dtype, var_lines)
from .triton_reduction import (_RED_FN, _contiguous_along, _flat_index, _flat_rindex, _identity, _reduce_mask, accumulate, r_loop,
                               reduction_kernel)

OUTER_PERSISTENT_LIMIT = 64        # §9.4: a reduction that is not INNER is persistent up to 64
BLOCK = "[R0_BLOCK, XBLOCK]"



def _loads(k, xv, rv) -> list:
    """(index, bytes per element) of every load of the group's bodies from memory, a reshape's
    digits recombined (`simplify_index`: with symbolic sizes they are still divided here)."""
    out = []
    ranges = dict(zip(list(xv) + list(rv), list(k.group.ranges) + list(k.group.reduction_ranges)))
    for n in k.group.nodes:
        c = IndexCollector()
        idx, ridx = node_index(n, xv, rv)
        with set_handler(c):
            n.inner_fn(idx, ridx) if isinstance(n, Reduction) else n.inner_fn(idx)
        out += [(simplify_index(e, ranges), k.dtype_of(name).itemsize) for e, name in zip(c.exprs, c.names)
                if name is not None and name not in k.sched.kernel_local]
    return out


def outer_applies(k: TritonKernel) -> bool:
    """§9.4 OUTER: no load is contiguous along the innermost reduction dim, and a load is
    contiguous along some output dim (the dim XBLOCK then runs along)."""
    g = k.group
    if g.kind != "reduction" or not g.reduction_ranges or not g.ranges:
        return False
    xv, rv = index_vars("x", len(g.ranges)), index_vars("r", len(g.reduction_ranges))
    loads = _loads(k, xv, rv)
    if not loads or any(_contiguous_along(e, rv[-1]) for e, _ in loads):
        return False
    return any(e.coeff(v) == 1 for e, _ in loads for v in xv)


def _x_order(names, exprs, weights) -> list:
    """The merged output dims, the one most bytes are contiguous along moved innermost (ties keep
    the innermost): consecutive lanes of XBLOCK then read consecutive addresses. An access inside
    the reduction loop (it uses a reduction variable) outweighs any once-per-output access."""
    def bytes_of(e, w):
        return w * (1 << 20) if sympy.sympify(e).free_symbols - set(names) else w
    score = [sum(bytes_of(e, w) for e, w in zip(exprs, weights) if sympy.sympify(e).coeff(v) == 1)
             for v in names]
    best = max(range(len(names)), key=lambda i: (score[i], i)) if names else 0
    return [i for i in range(len(names)) if i != best] + [best] if names else []


def _store_or_keep(k, n, value, xvars, rvars, lines):
    k.locals[n.name] = value
    if n.name not in k.sched.kernel_local:
        lines.append(k.store(n, value, xvars, rvars))


def _outer_persistent(k, nodes, xvars, rvars, p):
    """The column block is in registers: each reduction is one reduction over dim 0."""
    for n in nodes:
        value = k.body(n, xvars, rvars, p)
        if not isinstance(n, Reduction):
            _store_or_keep(k, n, value, xvars, rvars, p.lines)
            continue
        mask, ident = _reduce_mask(k), _identity(n)
        b = p.emit(f"tl.broadcast_to({value}, {BLOCK})", value.dtype)
        m = p.emit(f"tl.where({mask}, {b}, {ident})", value.dtype)
        if n.reduction_type in ("argmax", "argmin"):
            idx = p.emit(f"tl.broadcast_to({_flat_rindex(k)}, {BLOCK}).to(tl.int64)", int64)
            fn = "max_with_index" if n.reduction_type == "argmax" else "min_with_index"
            pair = k.new_tmp()
            p.lines.append(f"_, {pair} = triton_helpers.{fn}({m}, {idx}, 0)")
            result = p.emit(f"{pair}[None, :]", int64)
        else:
            red = _RED_FN[n.reduction_type].format(v=m, d=0)
            result = p.emit(f"{red}[None, :].to({tl_dtype(n.src_dtype)})", n.src_dtype)
        _store_or_keep(k, n, result, xvars, rvars, p.lines)


def _outer_looped(k, nodes, xvars, rvars) -> list:
    """R0_BLOCK rows a step with an [R0_BLOCK, XBLOCK] accumulator per reduction."""
    pre, post, accs = [], [], {}
    for n in nodes:
        if isinstance(n, Reduction):
            num = accs[n.name] = k.new_tmp()[3:]
            pre.append(f"_tmp{num} = tl.full({BLOCK}, {_identity(n)}, {tl_dtype(n.src_dtype)})")
            if n.reduction_type in ("argmax", "argmin"):
                pre.append(f"_tmp{num}_index = tl.full({BLOCK}, 0, tl.int64)")
    p = TritonPrinter(k)
    for n in nodes:
        value = k.body(n, xvars, rvars, p)
        if not isinstance(n, Reduction):
            _store_or_keep(k, n, value, xvars, rvars, p.lines)
            continue
        b = p.emit(f"tl.broadcast_to({value}, {BLOCK})", value.dtype)
        k.locals[n.name] = accumulate(k, n, accs[n.name], b, p, post, BLOCK, 0)
        if n.name not in k.sched.kernel_local:
            post.append(k.store(n, k.locals[n.name], xvars, rvars))
    return pre + r_loop(k, nodes, p.lines) + post


def _y_split(k):
    """§10.3: under symbolic sizes, is the outermost output dim better on a y axis of its own?
    Yes when its size and the inner dims' are both symbolic (var's pieces x columns: a flat index
    would recover piece and column with a run-time `// s` and `% s` per element, the piece's row
    bounds and length per element too), and the inner dims at the hint hold a column block of
    any configuration (MAX_OUTER_BLOCK): the blocks then waste few lanes at a row's end."""
    hints = k.lowered.hints or {}

    def split(sizes) -> bool:
        outer, inner = sympy.sympify(sizes[0]), sympy.sympify(sympy.prod(sizes[1:]))
        if outer.is_Integer or inner.is_Integer:
            return False
        at_hint = inner.subs(hints)
        return at_hint.is_Integer and int(at_hint) >= MAX_OUTER_BLOCK
    return split


def outer_reduction_kernel(k: TritonKernel) -> tuple:
    """An OUTER reduction group's kernel body: (form 'per' | 'red', lines, 'OUTER')."""
    g = k.group
    xvars, rvars = setup_axes(k, g.ranges, g.reduction_ranges, x_order=_x_order, y_split=_y_split(k))
    xaxis, raxis = k.axes[-2], k.axes[-1]
    k.block_axes = [raxis, xaxis]              # XBLOCK last: the fast dim of the block
    rnumel = raxis.numel
    per = rnumel.is_Integer and int(rnumel) <= OUTER_PERSISTENT_LIMIT
    r0_block = next_pow2(int(rnumel)) if per else None
    k.always_true = {"r0_mask"} if per and int(rnumel) == r0_block else set()
    head = [f"xnumel = {texpr(xaxis.numel)}", f"r0_numel = {texpr(rnumel)}"]
    if per:
        head.append(f"R0_BLOCK: tl.constexpr = {r0_block}")
    head += ["rnumel = r0_numel", "RBLOCK: tl.constexpr = R0_BLOCK"]
    if k.grid_y:
        head += grid_y_lines(k) + var_lines(k.axes[0])
    head += axis_lines(k, xaxis, 0)
    if per:
        head += axis_lines(k, raxis, None, per_block=r0_block) + var_lines(raxis) + var_lines(xaxis)
    else:
        base = "tl.arange(0, R0_BLOCK)[:, None]" + (".to(tl.int64)" if k.index64 else "")
        head += [f"r0_base = {base}", "rbase = r0_base"] + var_lines(xaxis)
    top = TritonPrinter(k)
    plan = phases(g)
    for i, (phase, nodes) in enumerate(plan):
        k.row_read_again = not per and any(q[0] == "loop" for q in plan[i + 1:])
        if phase == "row":
            for node in nodes:
                _store_or_keep(k, node, k.body(node, xvars, rvars, top), xvars, rvars, top.lines)
        elif per:
            _outer_persistent(k, nodes, xvars, rvars, top)
        else:
            top.lines += _outer_looped(k, nodes, xvars, rvars)
    return ("per" if per else "red"), head + top.lines, "OUTER"


# ---- §6.5 / §9.4 The one-kernel split: the last split of a column block combines ----

# Alg. 6.1's splits in one kernel: "1" (the default) OUTER splits; "0" none (the two kernels, to
# compare); "all" row splits too (batch-norm statistics of NCHW: not the default, whose row split
# is the chapter's Listing 9.4)
ONE_KERNEL_ENV = "STAX_SPLIT_ONE_KERNEL"
_COMBINE_NAMES = re.compile(r"\b(r0_numel|rnumel|R0_BLOCK|RBLOCK|xoffset|xindex|xmask|r0_index|r0_offset|"
                            r"r0_mask|roffset|rindex|r0_base|rbase|x\d+|r0_\d+)\b")


def one_kernel_mode() -> str:
    """'outer', 'none' or 'all' (ONE_KERNEL_ENV); an unknown value is an error saying which work."""
    value = os.environ.get(ONE_KERNEL_ENV, "1")
    modes = {"1": "outer", "0": "none", "all": "all"}
    if value not in modes:
        raise ValueError(f"{ONE_KERNEL_ENV}={value!r}: use 1 (OUTER splits in one kernel, the default), "
                         "0 (every split as two kernels) or all (row splits in one kernel too)")
    return modes[value]


def _accesses(lines, name, fn) -> list | None:
    """The offsets of every `fn(@name@ + (offset)` in `lines`, or None when the buffer is used
    any other way (then the one-kernel form does not apply)."""
    text = "\n".join(lines)
    found = re.findall(rf"{fn}\(@{re.escape(name)}@ \+ \(([^()]*)\)", text)
    return found if len(found) == text.count(f"@{name}@") else None


def _split_pair(ga, gb) -> tuple:
    """(S, outer) when groups (ga, gb) are shaped like Alg. 6.1's split: gb reduces S partials per
    output, which ga reduces over ranges [S] + outputs (OUTER: `split_reduction(outer=True)`) or
    outputs + [S] (a row reduction's split); else (0, None)."""
    if ga.kind != "reduction" or gb.kind != "reduction" or len(gb.reduction_ranges) != 1:
        return 0, None
    s = sympy.sympify(gb.reduction_ranges[0])
    if not s.is_Integer or not 2 <= int(s) <= GRID_LIMIT_YZ:
        return 0, None               # (the splits are the grid's y extent)
    if any(isinstance(n, Scatter) for n in ga.nodes + gb.nodes):
        return 0, None
    if list(ga.ranges) == [s] + list(gb.ranges):
        return int(s), True
    return (int(s), False) if list(ga.ranges) == list(gb.ranges) + [s] else (0, None)


def _print_pair(ka, kb, outer: bool):
    """Both groups' bodies in one form (OUTER, or the row form without a multi-pass alternative),
    the second's temporaries numbered on from the first's: (form, ga's lines, hint, gb's lines);
    None where they take other forms, or where the combine loops over its splits (var's 128
    pieces): run serially in the last program of each block, that lost on the H200 (var0 0.055 ms
    as one kernel against 0.049 as two; 2026-12-03 with a clean L2, 0.049 against 0.040, the
    splits of a block launched together or apart alike)."""
    if outer_applies(ka) != outer or outer_applies(kb) != outer:
        return None
    kernel = outer_reduction_kernel if outer else reduction_kernel
    form, lines_a, hint = kernel(ka)
    kb.tmp = ka.tmp                              # one kernel: temporaries numbered on
    form_b, lines_b, _ = kernel(kb)
    if form_b == "red" or kb.other_form or "xmask" in ka.always_true | kb.always_true:
        return None
    return form, lines_a, hint, lines_b


def _partials_shaped(xa, splits, cols, outer) -> bool:
    """True when ga's x axis covers the partials [S, outputs] (OUTER) or [outputs, S], the outputs
    in one or more dims (amax over a middle dim: [S, 256, 64]), or all of it merged into one
    flat dim (Prop. 6.3)."""
    sizes = [sympy.sympify(s) for s in xa.sizes]
    if len(sizes) == 1:
        return sympy.simplify(sizes[0] - splits * cols) == 0
    split, out = (sizes[0], sizes[1:]) if outer else (sizes[-1], sizes[:-1])
    return sympy.simplify(split - splits) == 0 and sympy.simplify(sympy.prod(out) - cols) == 0


def one_kernel_split(index: int, ga, gb, sched, force_form=None):
    """Alg. 6.1's two kernels (ga: the split's partials, gb: their combine and epilogue) as one:
    programs (column block, split) reduce their piece and store its partials as ga's kernel
    does; each then arrives at its column block's counter (`last_arrival`), and the last to
    arrive runs gb's kernel text for that block, reading the partials in split order 0..S-1 (the
    result does not depend on the order of arrival). Returns (name, source, params, numels,
    (counter name, its count as text: one per output)), or None where it does not apply: the
    partials must be written at [split, output] (OUTER) or [output, split] by ga and read only
    there by gb (outputs the same in both), and gb must write nothing ga touches. A split whose
    pieces' kernel has two forms (a multi-pass row, §9.4) gives both: the result's last item is
    the other form, for a second call with `force_form` (else None)."""
    mode = one_kernel_mode()
    splits, outer = _split_pair(ga, gb) if gb is not None and mode != "none" else (0, None)
    if not splits or (not outer and mode != "all"):
        return None
    ka, kb = TritonKernel(index, ga, sched), TritonKernel(index, gb, sched)
    ka.force_form = force_form
    printed = _print_pair(ka, kb, outer)
    if printed is None or ka.grid_y or kb.grid_y:
        return None                  # (its splits take the grid's y)
    (xa, xb), rb = (ka.axes[0], kb.axes[0]), kb.axes[1]
    cols = xb.numel
    if len(xb.dims) != 1 or len(rb.dims) != 1 or not _partials_shaped(xa, splits, cols, outer):
        return None
    partials = [n for n in ka.writes if n in kb.reads]
    if not partials or set(kb.writes) & (set(ka.reads) | set(ka.writes)):
        return None
    stored = texpr(_flat_index(xa.dims, xa.sizes))
    loaded = texpr(cols * rb.dims[0] + xb.dims[0]) if outer else texpr(splits * xb.dims[0] + rb.dims[0])
    if any(_accesses(printed[1], n, "tl.store") != [stored] or
           set(_accesses(printed[3], n, "tl.load") or [None]) != {loaded} for n in partials):
        return None
    return _one_kernel_text(ka, kb, printed, splits, cols, outer)


def _split_head(ka, splits, cols, outer) -> dict:
    """ga's x lines, replaced: its program's outputs along program_id(0), its split program_id(1)."""
    pid = (lambda d: f"tl.program_id({d})" + (".to(tl.int64)" if ka.index64 else ""))
    split = f"split = {pid(1)}                # Alg. 6.1: the piece of the rows this program reduces"
    head = {"xnumel": [f"xnumel = {texpr(cols)}"] if cols.is_Integer else []}
    if outer:                        # partials [S, outputs]: split s's start at s * xnumel
        head.update(xoffset=[split, f"xoffset = split * xnumel + {pid(0)} * XBLOCK"],
                    xmask=["xmask = xindex < (split + 1) * xnumel"])
    else:                            # partials [outputs, S]: row o of split s is o * S + s
        head.update(xoffset=[split, f"xoffset = {pid(0)} * XBLOCK"],
                    xindex=[f"xindex = (xoffset + tl.arange(0, XBLOCK)[:, None]) * {splits} + split"],
                    xmask=[f"xmask = xindex < xnumel * {splits}"])
    return head


def _one_kernel_text(ka, kb, printed, splits, cols, outer) -> tuple:
    """Stitch the two printed bodies: ga's with program_id(1) as its split, gb's (its block names
    suffixed `_c`, the combine's) under `if last_arrival(...)`; then `finish` the kernel."""
    form, lines_a, hint, lines_b = printed
    head = _split_head(ka, splits, cols, outer)
    body = []
    for line in lines_a:
        body += head.get(line.split(" = ")[0], [line])
    counter = f"split_counts_{ka.index_no}"
    combine = [_COMBINE_NAMES.sub(r"\1_c", line) for line in lines_b if not line.startswith("xnumel =")]
    body += [f"# §6.5 one kernel: the last of the {splits} splits to store its partials for this block of",
             f"# outputs combines them: it reads splits 0..{splits - 1} as one block, reduced in a fixed order",
             "# (the same result whatever order they arrived in)",
             f"if triton_helpers.last_arrival(@{counter}@ + tl.program_id(0), {splits}):"]
    body += ["    " + line for line in combine]
    ka.workspace[counter] = int32
    ka.reads.update(kb.reads)
    ka.reads[counter] = True
    ka.writes.update(kb.writes)
    ka.writes[counter] = True
    ka.axes[0] = Axis("x", list(kb.axes[0].dims), [cols])     # the launch's x: the output columns
    name, src, params, numels = finish(ka, form, body, hint, meta={"splits": splits})
    combined = ", ".join(dict.fromkeys(kb.group.origins))
    first = src.split("\n", 1)[0]
    src = src.replace(first, f"{first}; the last split of each block of outputs combines: {combined}", 1)
    return name, src, params, numels, (counter, texpr(cols)), ka.other_form
