"""§9.4–9.5 Reduction kernels for the GPU: the three forms, and several reductions in one kernel.

Layer: back end (GPU), above the kernel writer: builds on `triton_kernel`'s printing state
(`TritonKernel`, its axes, `TritonPrinter`, `setup_axes` / `axis_lines` / `var_lines`);
codegen_triton.py calls it.

Consumes a reduction fusion group; produces the kernel body's lines, the form ('per' persistent:
the row in registers; 'red' looped: R0_BLOCK at a time) and the ReductionHint. The third form, the
split reduction, is decided before this: lowering splits the group in two (Alg. 6.1,
`codegen_triton.split_policy`). `codegen_triton.generate` calls `reduction_kernel` and
`triton_kernel.finish` prints the result as a whole kernel.

Where to look:
  - `_reduction_form` ........ §9.4's rule (persistent up to 1024 INNER, 64 OUTER), and both forms
                               for multi-pass rows up to MULTI_PASS_PERSISTENT_LIMIT (measured)
  - `_persistent_phase` ...... a reduction over a row held in registers (Listings 9.1, 9.5)
  - `_looped_phase` .......... the R0_BLOCK loop with an XBLOCK × R0_BLOCK accumulator (Listing 9.4)
  - `_online_phase` .......... Prop. 9.1: softmax's max and sum in one pass, as the pair (m, d)
  - `reduction_kernel` ....... the entry: phases of a group (`schedule.phases`) in order
"""
from __future__ import annotations

import sympy

from .autotune import next_pow2
from .dtypes import int64
from .ir import ModularIndexing, Reduction, reduction_identity, set_handler, upper_bound
from .printer import Var
from .schedule import node_index, phases
from .triton_kernel import (TritonKernel, TritonPrinter, axis_lines, literal, numel_lines, setup_axes, texpr,
                            tl_dtype, var_lines)

# ---- §9.4 The three forms of reduction kernels ----

MULTI_PASS_PERSISTENT_LIMIT = 32768


def _contiguous_along(e, r) -> bool:
    """Consecutive r read consecutive addresses: r with coefficient 1, or `r % m` (r // 1 % m,
    ModularIndexing(r, 1, m)) with coefficient 1 for a row of m ≥ 32 elements (the (N, H, W)
    statistics of NCHW data, whose flattened reduction index wraps every H·W elements; in a piece of
    a split reduction, `(r + 1024*x1) % 56`)."""
    e = sympy.sympify(e)
    if e.coeff(r) == 1:
        return True
    return any(sympy.expand(m.args[0]).coeff(r) == 1 and m.args[1] == 1 and m.args[2].is_Integer
               and int(m.args[2]) >= 32 and e.coeff(m) == 1 for m in e.atoms(ModularIndexing))


def _multi_pass(k) -> bool:
    """Does the group pass over its row more than once (softmax, layer_norm)?"""
    return len([p for p in phases(k.group) if p[0] == "loop"]) > 1


def _reduction_form(k) -> tuple:
    """§9.4: ('per', R0_BLOCK) for a short row, else ('red', None); plus the ReductionHint."""
    rnumel = k.raxis.numel
    inner = any(_contiguous_along(e, k.raxis.dims[-1]) for e in k.exprs) if k.raxis.dims else True
    hint = "INNER" if inner else "OUTER"
    limit = 1024 if inner else 64
    if not rnumel.is_Integer:          # §10.3: decided against the range's upper end (masks kept)
        hi = upper_bound(rnumel, k.sched.lowered.bounds)
        if hi is not None and hi <= limit:
            return "per", next_pow2(hi), hint
        return _dynamic_row_forms(k, rnumel, inner, limit, hint)
    if inner and int(rnumel) > limit and _multi_pass(k):
        # Stax's addition to the chapter's rule: a multi-pass row (softmax, layer_norm) up to
        # MULTI_PASS_PERSISTENT_LIMIT gets both forms, and the launch measures which is faster
        # (async_compile.multi_kernel). Neither wins everywhere on the H200 (bench/RESULTS.md):
        # rows in registers are read once (softmax 65536×4096: 0.93 of the floor against 0.81
        # looped), while a looped layer_norm, its row kept in L2 between passes, reaches 1.01
        # against 0.96 persistent. The persistent form is the heuristic default.
        if int(rnumel) <= MULTI_PASS_PERSISTENT_LIMIT:
            k.other_form = "red" if k.force_form is None else None
            if k.force_form != "red":
                return "per", next_pow2(int(rnumel)), hint
        return "red", None, hint
    if int(rnumel) <= limit:
        return "per", next_pow2(int(rnumel)), hint
    return "red", None, hint


def _dynamic_row_forms(k, rnumel, inner: bool, limit: int, hint: str) -> tuple:
    """§10.3 with a row that no range bounds: the range's upper end says 'looped', yet most calls
    pass rows near the hint. A row whose hint fits the persistent bound (MULTI_PASS_PERSISTENT_LIMIT
    for a multi-pass row) gets both forms: the persistent one, its R0_BLOCK taken at the hint, runs
    every call whose row fits R0_BLOCK, the looped one every longer row; the launch dispatches on
    r0_numel (`MultiKernel`), so one artifact still serves every size."""
    at_hint = sympy.sympify(rnumel).subs(k.sched.lowered.hints)
    bound = MULTI_PASS_PERSISTENT_LIMIT if _multi_pass(k) else limit
    if not (inner and at_hint.is_Integer and 1 <= int(at_hint) <= bound):
        return "red", None, hint
    k.other_form = "red" if k.force_form is None else None
    if k.force_form == "red":
        return "red", None, hint
    return "per", next_pow2(int(at_hint)), hint


# the reduction over dim {d} of a block: 1 in the row form's [XBLOCK, R0_BLOCK], 0 in OUTER's
_RED_FN = {"sum": "tl.sum({v}, {d})", "prod": "triton_helpers.prod({v}, {d})",
           "amax": "triton_helpers.max2({v}, {d})", "amin": "triton_helpers.min2({v}, {d})"}
_COMBINE = {"sum": "({a} + {v})", "prod": "({a} * {v})",
            "amax": "triton_helpers.maximum({a}, {v})", "amin": "triton_helpers.minimum({a}, {v})"}


def _identity(n) -> str:
    """A reduction's identity as the listings print it: 0 and 1 plain, ±inf as float("±inf")."""
    v = reduction_identity(n.reduction_type, n.src_dtype)
    return str(int(v)) if v in (0, 1) and not isinstance(v, bool) else literal(v, n.src_dtype)


def _reduce_mask(k) -> str:
    return " & ".join(m for m in ("r0_mask", "xmask") if m not in k.always_true)


def _flat_index(dims, sizes):
    """The row-major flat index of loop variables `dims` (outer to inner) of extents `sizes`."""
    return sum((d * sympy.prod(sizes[i + 1:]) for i, d in enumerate(dims)), sympy.Integer(0))


def _flat_rindex(k) -> str:
    return texpr(_flat_index(k.raxis.dims, k.raxis.sizes))


def _persistent_phase(k, nodes, xvars, rvars, p):
    """The whole row is in registers: each reduction is one tl.sum / max2 over dimension 1."""
    for n in nodes:
        value = k.body(n, xvars, rvars, p)
        if isinstance(n, Reduction):
            mask = _reduce_mask(k)
            b = p.emit(f"tl.broadcast_to({value}, [XBLOCK, R0_BLOCK])", value.dtype)
            acc = tl_dtype(n.src_dtype)
            if n.reduction_type in ("argmax", "argmin"):
                ident = _identity(n)
                m = p.emit(f"tl.where({mask}, {b}, {ident})", value.dtype)
                idx = p.emit(f"tl.broadcast_to({_flat_rindex(k)}, [XBLOCK, R0_BLOCK]).to(tl.int64)", int64)
                fn = "max_with_index" if n.reduction_type == "argmax" else "min_with_index"
                pair = k.new_tmp()
                p.lines.append(f"_, {pair} = triton_helpers.{fn}({m}, {idx}, 1)")
                result = p.emit(f"{pair}[:, None]", int64)
            else:
                ident = _identity(n)
                m = p.emit(f"tl.where({mask}, {b}, {ident})", value.dtype)
                result = p.emit(_RED_FN[n.reduction_type].format(v=m, d=1) + f"[:, None].to({acc})", n.src_dtype)
            k.locals[n.name] = result
            if n.name not in k.sched.kernel_local:
                p.lines.append(k.store(n, result, xvars, rvars))
        else:
            k.locals[n.name] = value
            if n.name not in k.sched.kernel_local:
                p.lines.append(k.store(n, value, xvars, rvars))


def r_loop(k, nodes, body: list) -> list:
    """`for r0_offset in tl.range(...)` around `body`, with the loop's index lines; the group's
    per-element values are dropped from `k.locals` (they do not outlive the loop)."""
    for n in nodes:
        if not isinstance(n, Reduction):
            k.locals.pop(n.name, None)
    return _r_loops(k, body)


def _r_loops(k, body: list) -> list:
    """The loop over the row around `body` (its lines printed once, for any step)."""
    head = axis_lines(k, k.raxis, None, looped=True) + var_lines(k.raxis)
    loop = ["for r0_offset in tl.range(0, r0_numel, R0_BLOCK):"] + ["    " + line for line in head + body]
    if sympy.sympify(k.raxis.numel).is_Integer or "r0_mask" in k.always_true:
        return loop
    # §10.3, a row of symbolic length: its whole R0_BLOCK steps run without the row-end mask, the
    # last (partial) step with it, and a launch whose row is whole steps (EVEN_R0) has no last
    # step at all. Masked, each step's per-vector predicates stayed live across the step and a
    # long row's loads issued in waves (softmax over 32768 on the H200: 1.28x the static kernel's
    # time); compiled at all, the partial step alone raises the kernel's registers (65536-long
    # rows, 8 warps: 48 against the static kernel's 32, fewer programs per SM)
    k.even_r0 = True
    whole = axis_lines(k, k.raxis, None, looped=True, whole=True) + var_lines(k.raxis)
    return (["r0_whole = r0_numel - r0_numel % R0_BLOCK",
             "for r0_offset in tl.range(0, r0_whole, R0_BLOCK):"] + ["    " + line for line in whole + body]
            + ["if not EVEN_R0:", "    for r0_offset in tl.range(r0_whole, r0_numel, R0_BLOCK):"]
            + ["        " + line for line in head + body])


def accumulate(k, n, num, b, p, post, block: str, rdim: int) -> Var:
    """One loop step of reduction `n` into its accumulator `_tmp{num}` (a `block`-shaped tensor;
    `b` is this step's values), masked by the reduction mask; the final reduction over dim `rdim`
    goes to `post`. The row form's block is [XBLOCK, R0_BLOCK] (rdim 1), the OUTER form's
    [R0_BLOCK, XBLOCK] (rdim 0)."""
    mask, keep = _reduce_mask(k), "[:, None]" if rdim == 1 else "[None, :]"
    if n.reduction_type in ("argmax", "argmin"):
        idx = p.emit(f"tl.broadcast_to({_flat_rindex(k)}, {block}).to(tl.int64)", int64)
        pick = "_pick_max" if n.reduction_type == "argmax" else "_pick_min"
        nv, ni = k.new_tmp(), k.new_tmp()
        p.lines.append(f"{nv}, {ni} = triton_helpers.{pick}({b}, {idx}, _tmp{num}, _tmp{num}_index)")
        p.lines.append(f"_tmp{num} = tl.where({mask}, {nv}, _tmp{num})")
        p.lines.append(f"_tmp{num}_index = tl.where({mask}, {ni}, _tmp{num}_index)")
        fn = "max_with_index" if n.reduction_type == "argmax" else "min_with_index"
        post.append(f"_, tmp{num}_idx = triton_helpers.{fn}(_tmp{num}, _tmp{num}_index, {rdim})")
        post.append(f"tmp{num} = tmp{num}_idx{keep}")
        return Var(f"tmp{num}", int64)
    comb = p.emit(_COMBINE[n.reduction_type].format(a=f"_tmp{num}", v=b), n.src_dtype)
    p.lines.append(f"_tmp{num} = tl.where({mask}, {comb}, _tmp{num})")
    post.append(f"tmp{num} = " + _RED_FN[n.reduction_type].format(v=f"_tmp{num}", d=rdim) + keep)
    return Var(f"tmp{num}", n.src_dtype)


def _looped_phase(k, nodes, xvars, rvars) -> list:
    """Loop over the row in R0_BLOCK steps with an XBLOCK × R0_BLOCK accumulator (Listing 9.4)."""
    pre, post = [], []
    reductions = [n for n in nodes if isinstance(n, Reduction)]
    accs = {}
    for n in reductions:
        num = k.new_tmp()[3:]
        accs[n.name] = num
        ident = _identity(n)
        pre.append(f"_tmp{num} = tl.full([XBLOCK, R0_BLOCK], {ident}, {tl_dtype(n.src_dtype)})")
        if n.reduction_type in ("argmax", "argmin"):
            pre.append(f"_tmp{num}_index = tl.full([XBLOCK, R0_BLOCK], 0, tl.int64)")
    p = TritonPrinter(k)
    for n in nodes:
        value = k.body(n, xvars, rvars, p)
        if isinstance(n, Reduction):
            num = accs[n.name]
            b = p.emit(f"tl.broadcast_to({value}, [XBLOCK, R0_BLOCK])", value.dtype)
            k.locals[n.name] = accumulate(k, n, num, b, p, post, "[XBLOCK, R0_BLOCK]", 1)
            if n.name not in k.sched.kernel_local:
                post.append(k.store(n, k.locals[n.name], xvars, rvars))
        else:
            k.locals[n.name] = value
            if n.name not in k.sched.kernel_local:
                p.lines.append(k.store(n, value, xvars, rvars))
    return pre + r_loop(k, nodes, p.lines) + post


# ---- §9.5 Online softmax (Prop. 9.1): a multi-pass row too long for registers, in two passes ----


class _TreePrinter:
    """An ops handler whose values are expression trees, to compare two bodies structurally."""

    def __init__(self, k):
        self.k = k

    def load(self, name, index):
        return ("load", name, str(self.k.final(index)))

    def masked(self, mask, body, other):
        return ("masked", mask, body(), other)

    def __getattr__(self, op):
        return lambda *args: (op,) + tuple(a.name if hasattr(a, "itemsize") else a for a in args)


def _tree(k, node, xvars, rvars):
    idx, ridx = node_index(node, xvars, rvars)
    with set_handler(_TreePrinter(k)):
        return node.inner_fn(idx, ridx) if isinstance(node, Reduction) else node.inner_fn(idx)


def _online_softmax_pair(k, nodes, next_phase, xvars, rvars) -> bool:
    """This loop is `m = max_r v` and the next is `d = sum_r exp(v - m)` over the same v."""
    if next_phase[0] != "loop" or len(nodes) != 1 or len(next_phase[1]) != 1:
        return False
    m, d = nodes[0], next_phase[1][0]
    if not (isinstance(m, Reduction) and isinstance(d, Reduction)
            and m.reduction_type == "amax" and d.reduction_type == "sum"
            and m.src_dtype == d.src_dtype and m.src_dtype.is_floating_point):
        return False
    body = _tree(k, d, xvars, rvars)
    if not (isinstance(body, tuple) and body[0] == "exp" and isinstance(body[1], tuple) and body[1][0] == "sub"):
        return False
    v, row_max = body[1][1], body[1][2]
    return (v == _tree(k, m, xvars, rvars) and isinstance(row_max, tuple) and row_max[0] == "load"
            and row_max[1] == m.name and not any(str(r) in row_max[2] for r in k.rvars_printed))


# the running max starts at the type's lowest finite value, not -inf: e^(m - m') and e^(v - m')
# are then never e^(-inf + inf) = NaN, so the update needs no guard (a row of -inf still ends
# with d = 0 and its softmax NaN, as in eager)
LOWEST = {"tl.float16": -65504.0, "tl.bfloat16": -3.3895313892515355e38,
          "tl.float32": -3.4028234663852886e38, "tl.float64": -1.7976931348623157e308}


def _online_phase(k, m, d, xvars, rvars) -> list:
    """One pass over the row keeping the pair (m, d) (Prop. 9.1), both per row: each step takes
    the block's max (m' = max(m, max_r v)), rescales d by e^(m - m') and adds the block's sum of
    e^(v - m'): one exponential per element. A running max per lane instead needs two
    exponentials per element (a 65536-long row is then compute-bound on the H200), and a sum
    per lane holds R0_BLOCK / threads more registers a thread: with d per row, a program of 32
    warps keeps 32768-element steps in registers (32 a thread), twice the bytes in flight of
    16384-element steps: 2048 rows of 65536 on the H200 at 0.90 of the floor, against 0.78."""
    nm, nd = k.new_tmp()[3:], k.new_tmp()[3:]
    mask, ty = _reduce_mask(k), tl_dtype(m.src_dtype)
    pre = [f"_tmp{nm} = tl.full([XBLOCK, 1], {LOWEST[ty]!r}, {ty})",
           f"_tmp{nd} = tl.full([XBLOCK, 1], 0, {ty})"]
    p = TritonPrinter(k)
    value = k.body(m, xvars, rvars, p)
    v = p.emit(f"tl.broadcast_to({value}, [XBLOCK, R0_BLOCK])", value.dtype)
    live = p.emit(f'tl.where({mask}, {v}, float("-inf"))', m.src_dtype)
    m_new = p.emit(f"triton_helpers.maximum(_tmp{nm}, triton_helpers.max2({live}, 1)[:, None])", m.src_dtype)
    scale = p.emit(f"libdevice.exp(_tmp{nm} - {m_new})", m.src_dtype)
    term = p.emit(f"tl.where({mask}, libdevice.exp({v} - {m_new}), 0.0)", m.src_dtype)
    p.lines.append(f"_tmp{nd} = _tmp{nd} * {scale} + tl.sum({term}, 1)[:, None]")
    p.lines.append(f"_tmp{nm} = {m_new}")
    loop = _r_loops(k, p.lines)
    post = [f"tmp{nm} = _tmp{nm}", f"tmp{nd} = _tmp{nd}"]
    for node, num in ((m, nm), (d, nd)):
        k.locals[node.name] = Var(f"tmp{num}", node.src_dtype)
        if node.name not in k.sched.kernel_local:
            post.append(k.store(node, k.locals[node.name], xvars, rvars))
    return pre + loop + post


# ---- §9.4–9.5 The whole reduction kernel ----


def reduction_kernel(k: TritonKernel) -> tuple:
    """A reduction group's kernel body: (form 'per' | 'red', lines, ReductionHint); Listings 9.1, 9.4, 9.5."""
    g = k.group
    xvars, rvars = setup_axes(k, g.ranges, g.reduction_ranges)
    form, r0_block, hint = _reduction_form(k)
    k.r0_block = r0_block
    rnumel = k.raxis.numel
    k.always_true = {"r0_mask"} if form == "per" and rnumel.is_Integer and int(rnumel) == r0_block else set()
    k.even_r0 = form == "per" and not rnumel.is_Integer      # (a looped row sets it in `_r_loops`)
    xaxis, raxis = k.axes[0], k.axes[1]
    head = numel_lines([xaxis, raxis])
    if form == "per":
        head.append(f"R0_BLOCK: tl.constexpr = {r0_block}")
    head += ["rnumel = r0_numel", "RBLOCK: tl.constexpr = R0_BLOCK"]
    head += axis_lines(k, xaxis, 0)
    if form == "per":
        head += axis_lines(k, raxis, None, per_block=r0_block)
        head += var_lines(raxis) + var_lines(xaxis)
    else:
        base = "tl.arange(0, R0_BLOCK)[None, :]" + (".to(tl.int64)" if k.index64 else "")
        head += [f"r0_base = {base}", "rbase = r0_base"] + var_lines(xaxis)
    # one printer for the kernel's top level: a persistent kernel holds the row in registers, so
    # every phase shares its loads (CSE); a looped kernel's loop bodies get printers of their own
    top = TritonPrinter(k)
    plan = phases(k.group)
    i = 0
    while i < len(plan):
        phase, nodes = plan[i]
        k.row_read_again = form == "red" and any(p[0] == "loop" for p in plan[i + 1:])
        # the last pass of a looped row read before writes what no later step reads: its stores
        # stream through L2 (evict_first) and leave the lines the pass still rereads (the 65536-long
        # softmax on the H200: 1% faster)
        k.stream_stores = (form == "red" and phase == "loop" and not k.row_read_again
                           and any(p[0] == "loop" for p in plan[:i]))
        if phase == "row":
            for node in nodes:
                value = k.body(node, xvars, rvars, top)
                k.locals[node.name] = value
                if node.name not in k.sched.kernel_local:
                    top.lines.append(k.store(node, value, xvars, rvars))
        elif form == "per":
            _persistent_phase(k, nodes, xvars, rvars, top)
        elif i + 1 < len(plan) and _online_softmax_pair(k, nodes, plan[i + 1], xvars, rvars):
            # Prop. 9.1: the row max and the sum of exp(v - max) in one pass, as the pair (m, d)
            top.lines += _online_phase(k, nodes[0], plan[i + 1][1][0], xvars, rvars)
            i += 1
        else:
            top.lines += _looped_phase(k, nodes, xvars, rvars)
        i += 1
    return form, head + top.lines, hint
