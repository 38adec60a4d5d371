"""§7 Scheduling: dependence graph, fusion, kernel order, buffer lifetimes.

Layer: above ir.py (the IR it reads; it never imports lower.py), below the code generators
(codegen_cpp.py, codegen_triton.py), which print one kernel per group.

Consumes an `ir.LoweredGraph` (IR buffers in dependence order) and produces a `Schedule`: an
ordered list of `FusionGroup`s, each of which becomes one kernel, plus the lifetime facts the
wrapper needs (after which kernel each buffer is dead, which buffers never leave a kernel).

Every computed buffer is iterated over *loop ranges*: a pointwise buffer over its shape, a reduction
over (kept ranges, reduction ranges). Size-1 dimensions are dropped first, so `[64, 1]` and `[64]`
meet. Two buffers can share a kernel when their loops fit one loop nest:
  - pointwise + pointwise over the same ranges (vertical chains that were realized, and independent
    nodes side by side: horizontal fusion);
  - a reduction with pointwise nodes over its kept ranges (per-row values, e.g. `mean = sum / n`) or
    over kept + reduced ranges (per-element prologue/epilogue, e.g. softmax's `exp(x - max) / sum`);
  - several reductions over the same rows (softmax's max and sum; layer_norm's mean and variance),
    even when one needs the other's result: the kernel makes one pass over the row per phase
    (a chain of dependent row reductions too, up to MAX_FUSED_REDUCTIONS in one kernel);
  - on the CPU (`cross=True`), a row and a column reduction of one 2-D input (`x.sum(1)` and
    `x.sum(0)`): one pass over the input computes both (`FusionGroup.cross`).
A consumer may join its producer's kernel only if it reads the producer at exactly the point where
the producer stores it in that loop nest (§7.1's dependence edge becomes program order in the loop
body); otherwise it starts a later kernel.

Where to look:
  - `loop_ranges`, `_node_loops` ............ a buffer's loop nest with size-1 dims dropped
  - `_reads` ................................ the loads a body makes (run with a collecting handler)
  - `_can_join` ............................. the fusion rule above (an ir.Scatter runs alone, after
                                              the copy it writes into)
  - `_can_cross`, `cross_orientation` ........ a row and a column reduction of one input in one pass
  - `phases` ................................ one fused reduction kernel's passes over a row
  - a scan (ir.Scan) opens a 'scan' group over (other dims, scanned dim); pointwise nodes join it
    per element, after it, when they read it where it stores (its fused epilogue)
  - `all_indices`, `all_accesses` ............ every index a group's bodies use (Prop. 6.3, §9.3)
  - `schedule(lowered)` ..................... §7.1 dependence graph, fusion, order, §7.5 lifetimes
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .ir import (output_buffer, ExternKernel, IndexCollector, LoadCollector, Pointwise, Reduction, ReinterpretView, Scan, Scatter,
                 index_vars, set_handler, simplify_index)

# ---- Data types ----


@dataclass
class FusionGroup:
    """One kernel: nodes run in this order inside one loop nest over (ranges, reduction_ranges)."""
    index: int
    kind: str                        # 'pointwise' | 'reduction' | 'extern' | 'template' (§9.8: a
                                     # matmul template, then the pointwise epilogues it computes)
                                     # | 'scan' (an ir.Scan, then its per-element epilogues)
    ranges: list                     # x (kept) loop sizes
    reduction_ranges: list           # r loop sizes ([] for pointwise)
    nodes: list = field(default_factory=list)
    # reductions over the same elements with the loops swapped (kept ranges = the group's reduction
    # ranges): `x.sum(1)` beside `x.sum(0)`, computed in the same pass over the input (`_can_cross`)
    cross: list = field(default_factory=list)

    @property
    def origins(self) -> list:
        return [o for n in self.nodes + self.cross for o in n.origins]


@dataclass
class Schedule:
    groups: list                     # FusionGroup, in launch order
    lowered: object                  # the LoweredGraph
    last_use: dict                   # buffer name -> index of the last group that reads it
    kernel_local: set                # buffers whose producer and readers share one kernel (never stored)


# A chain of dependent row reductions (issue 13: `x = sin(x) + x.sum(-1, keepdim=True)`, 20 times)
# fuses into one kernel, one pass over the row per reduction. Past this many reductions a kernel
# is closed and the next one starts: the kernel's text grows with every pass (on the CPU each pass
# also recomputes the pointwise prefix lower.py inlined, up to its inline_limit of ops), and its
# build time with it: on this project's 2-core build machine the C++ of a 20-step chain took 21 s
# and of a 100-step one 183 s to compile. 32 keeps any one kernel near the 20-step one's size;
# real programs fuse 2 or 3 (softmax, layer_norm), so only such chains are affected, at the cost
# of one launch and one store and load of the row per 32 steps.
MAX_FUSED_REDUCTIONS = 32


# ---- Loop ranges of one buffer ----


def loop_ranges(sizes) -> tuple:
    """Drop size-1 dims; return (kept sizes, positions of the kept dims)."""
    kept = [(k, s) for k, s in enumerate(sizes) if s != 1]
    return [s for _, s in kept], [k for k, _ in kept]


def _sizes(buf):
    """The loop sizes of a buffer's own iteration: its ranges, or an extern kernel's output shape."""
    return buf.layout.shape if isinstance(buf, ExternKernel) else buf.ranges


def _node_loops(buf):
    """(x ranges, r ranges) of a computed buffer, size-1 dims dropped."""
    if isinstance(buf, Reduction):
        return loop_ranges(buf.ranges)[0], loop_ranges(buf.reduction_ranges)[0]
    return loop_ranges(_sizes(buf))[0], []


def node_index(buf, xvars, rvars):
    """The buffer's own index (and rindex) for the group loop variables xvars (+ rvars).

    A pointwise node over kept + reduced ranges takes xvars + rvars; size-1 dims get 0.
    """
    def expand(sizes, vars_):
        _, pos = loop_ranges(sizes)
        full, it = [sympy.Integer(0)] * len(sizes), iter(vars_)
        for k in pos:
            full[k] = next(it)
        return full
    if isinstance(buf, Reduction):
        return expand(buf.ranges, xvars), expand(buf.reduction_ranges, rvars)
    n = len(loop_ranges(_sizes(buf))[0])
    return expand(_sizes(buf), (list(xvars) + list(rvars))[:n]), None


def store_index(buf, xvars, rvars):
    idx, ridx = node_index(buf, xvars, rvars)
    if isinstance(buf, Scan):       # one value per element: the scanned dim put back in place
        return buf.layout.index(buf.full_index(idx, ridx))
    if isinstance(buf, Scatter):    # through loaded indices: symbols `indN` stand for them here
        with set_handler(LoadCollector()):
            return buf.layout.index(buf.output_indexer(idx))
    return buf.layout.index(idx)


# ---- Which loads a body makes ----


def _reads(buf, xvars, rvars) -> list:
    """[(buffer name, index expression)] for every load in buf's body, in the group's loop vars."""
    c = LoadCollector()
    idx, ridx = node_index(buf, xvars, rvars)
    with set_handler(c):
        if isinstance(buf, Reduction):
            buf.inner_fn(idx, ridx)
        else:
            buf.inner_fn(idx)
    return c.loads


def buffer_reads(buf) -> set:
    """Names of the buffers a node reads (any index)."""
    if isinstance(buf, ExternKernel):
        names = set()
        for a in buf.inputs:
            for x in (a if isinstance(a, list) else [a]):
                if isinstance(x, str):
                    names.add(x)
                elif isinstance(x, ReinterpretView):
                    names.add(x.buffer)
        return names
    x, r = _node_loops(buf)
    reads = {name for name, _ in _reads(buf, index_vars("x", len(x)), index_vars("r", len(r)))}
    return reads | {buf.target} if isinstance(buf, Scatter) else reads


# ---- §7 Fusion ----


def _fits(group: FusionGroup, buf) -> tuple | None:
    """The (ranges, reduction_ranges) of `group` after adding `buf`, or None if the loops differ."""
    if isinstance(buf, (ExternKernel, Scan)) or group.kind == "extern":
        return None                  # a scan opens its own kernel (its loop order is its own)
    bx, br = _node_loops(buf)
    gx, gr = group.ranges, group.reduction_ranges
    if group.kind == "scan":         # epilogues: per element, visited once in the scan's loops
        return (gx, gr) if isinstance(buf, Pointwise) and bx == gx + gr else None
    if group.kind == "template":     # §9.8 epilogue: pointwise over the template's output blocks
        return (gx, gr) if isinstance(buf, Pointwise) and bx == gx else None
    if isinstance(buf, Reduction):
        if group.kind == "reduction":
            return (gx, gr) if (bx, br) == (gx, gr) else None
        # a pointwise group joins a reduction over its rows (x-level) or its elements (x + r)
        return (bx, br) if gx in (bx, bx + br) else None
    if group.kind == "reduction":
        return (gx, gr) if bx in (gx, gx + gr) else None
    return (gx, gr) if bx == gx else None


def _can_join(group: FusionGroup, buf, writes_input: str | None) -> bool:
    """May `buf` run inside `group`'s loop nest? Its loops must fit, it must read every producer in
    the group exactly where that producer stores, and a write-back into input `writes_input` must
    write the very element each reader of that input in the group reads."""
    if group.cross:                 # one pass both ways: only another reduction of that pass
        return isinstance(buf, Reduction) and _cross_pass(group, group.nodes + [buf], group.cross)
    fit = _fits(group, buf)
    if isinstance(buf, Reduction) and sum(isinstance(n, Reduction) for n in group.nodes) >= MAX_FUSED_REDUCTIONS:
        return False                # one more pass over the row would make the kernel too long to build
    if fit is None or isinstance(buf, Scatter) or any(isinstance(n, Scatter) for n in group.nodes):
        return False                # a scatter's writes collide across the loop: a kernel of its own
    gx, gr = fit
    xvars, rvars = index_vars("x", len(gx)), index_vars("r", len(gr))
    ranges = dict(zip(xvars + rvars, gx + gr))
    here = {n.name: n for n in group.nodes}
    reads = _reads(buf, xvars, rvars)
    if group.kind == "template" and (writes_input is not None or not any(n in here for n, _ in reads)):
        return False                 # §9.8: an epilogue updates no input in place and uses the template
    for name, index in reads:
        if name in here:
            # read exactly where the producer stores in this loop nest, or not in this kernel
            want = store_index(here[name], xvars, rvars)
            if simplify_index(index - want, ranges) != 0:
                return False
    if writes_input is not None:
        # a write-back into an input: every reader of that input in this kernel reads the same point
        target = store_index(buf, xvars, rvars)
        for node in group.nodes:
            for name, index in _reads(node, xvars, rvars):
                if name == writes_input and simplify_index(index - target, ranges) != 0:
                    return False
    return True


# ---- §7 Fusion across orientations: a row and a column reduction of one input, one pass ----

MAX_CROSS_COLUMNS = 1024     # a row of the input at most: each pass over a row keeps it in L1
_CROSS_TYPES = ("sum", "prod", "amax", "amin")


def cross_orientation(main, cross):
    """(row var, column var) of a pass computing reductions `main` over the group's loops and
    `cross` over them swapped (x0 or r0 each, in the group's loop vars): the column var runs along
    the input's contiguous dim, the row var along none; None when no orientation does."""
    xv, rv = index_vars("x", 1), index_vars("r", 1)
    own = {n.name for n in main + cross}      # (their stores: along their own outputs)
    exprs = [e for e, name in all_accesses(main, xv, rv) + all_accesses(cross, rv, xv)
             if name is not None and name not in own]
    for row, col in ((rv[0], xv[0]), (xv[0], rv[0])):
        if any(e.coeff(col) == 1 for e in exprs) and not any(e.coeff(row) == 1 for e in exprs):
            return row, col
    return None


def _cross_pass(group: FusionGroup, main: list, cross: list) -> bool:
    """Can one pass over a 2-D input compute reductions `main` over the group's loops and `cross`
    over them swapped? Static 1-D loops each way, plain combines, no reduction reading another,
    a contiguous dim, and a row along it of at most MAX_CROSS_COLUMNS."""
    gx, gr = group.ranges, group.reduction_ranges
    if len(gx) != 1 or len(gr) != 1 or not all(sympy.sympify(s).is_Integer for s in gx + gr):
        return False
    nodes = main + cross
    if not all(isinstance(n, Reduction) and not isinstance(n, Scatter) and n.reduction_type in _CROSS_TYPES
               for n in nodes):
        return False
    if any(_node_loops(n) != (gx, gr) for n in main) or any(_node_loops(n) != (gr, gx) for n in cross):
        return False
    names = {n.name for n in nodes}
    if any(buffer_reads(n) & names for n in nodes):
        return False
    where = cross_orientation(main, cross)
    if where is None:
        return False
    columns = gx[0] if where[1].name.startswith("x") else gr[0]
    return int(columns) <= MAX_CROSS_COLUMNS


def _can_cross(group: FusionGroup, buf) -> bool:
    """May reduction `buf` run in `group`'s pass with the loops swapped (`x.sum(1)` beside
    `x.sum(0)`)?"""
    return group.kind == "reduction" and isinstance(buf, Reduction) and \
        _cross_pass(group, group.nodes, group.cross + [buf])


def schedule(lowered, template=None, cross: bool = False) -> Schedule:
    """Place each buffer, in dependence order, into the first kernel it can join.

    A buffer may only join a kernel at or after the kernels of everything it depends on (its
    producers, and for a write-back into an input, every earlier reader of that input).
    `template(extern, lowered)`, given by a back end with templates (§9.8), says which extern
    kernels run as a template that takes pointwise epilogues: such a kernel opens a 'template'
    group over its output's loops, which later pointwise nodes may join. `cross`, for a back end
    that prints it (the CPU's), lets a reduction that fits no kernel join one over the same
    elements with its loops swapped (`_can_cross`).
    """
    groups: list = []
    group_of: dict = {}              # buffer name -> group index
    readers: dict = {}               # buffer/input name -> groups that read it
    for buf in lowered.buffers:
        reads = buffer_reads(buf)
        earliest = max([group_of[r] for r in reads if r in group_of] + [0])
        writes_input = None
        if isinstance(buf, Pointwise) and any(buf.name == w for _, w in lowered.mutations):
            writes_input = next(i for i, w in lowered.mutations if w == buf.name)
            earliest = max([earliest] + list(readers.get(writes_input, [])))
        if isinstance(buf, ExternKernel):
            earliest = max(earliest, len(groups) - 1 if groups else 0)
        placed = None
        for g in groups[earliest:]:
            if _can_join(g, buf, writes_input):
                placed = g
                break
        if placed is None and cross and isinstance(buf, Reduction):
            g = next((g for g in groups[earliest:] if _can_cross(g, buf)), None)
            if g is not None:
                g.cross.append(buf)
                group_of[buf.name] = g.index
                for r in reads:
                    readers.setdefault(r, set()).add(g.index)
                continue
        if placed is None:
            if isinstance(buf, ExternKernel) and template is not None and template(buf, lowered):
                placed = FusionGroup(len(groups), "template", _node_loops(buf)[0], [])
            elif isinstance(buf, ExternKernel):
                placed = FusionGroup(len(groups), "extern", [], [])
            else:
                x, r = _node_loops(buf)
                kind = "scan" if isinstance(buf, Scan) else "reduction" if isinstance(buf, Reduction) else "pointwise"
                placed = FusionGroup(len(groups), kind, x, r)
            groups.append(placed)
        else:
            fit = _fits(placed, buf)
            if isinstance(buf, Reduction) and placed.kind == "pointwise":
                placed.kind = "reduction"
            placed.ranges, placed.reduction_ranges = fit
        placed.nodes.append(buf)
        group_of[buf.name] = placed.index
        for r in reads:
            readers.setdefault(r, set()).add(placed.index)
    last_use, kernel_local = _lifetimes(lowered, groups, group_of, readers)
    return Schedule(groups, lowered, last_use, kernel_local)


def _lifetimes(lowered, groups, group_of, readers):
    """§7.5: the last kernel that reads each buffer, and the buffers that never leave their kernel."""
    last_use = {}
    for name, gs in readers.items():
        last_use[name] = max(gs)
    for inp, w in lowered.mutations:     # an input is used until its write-back kernel has run
        last_use[inp] = max(last_use.get(inp, -1), group_of[w])
    outputs = {output_buffer(o) for o in lowered.outputs} - {None}
    written_back = {w for _, w in lowered.mutations}
    kernel_local = set()
    for g in groups:
        for n in g.nodes:
            private = readers.get(n.name, set()) <= {g.index}
            if (private and n.name not in outputs and n.name not in written_back
                    and g.kind != "extern" and not _is_elementwise(n, g) and not isinstance(n, Scatter)):
                kernel_local.add(n.name)
    return last_use, kernel_local


def _is_elementwise(buf, group) -> bool:
    """True when a pointwise node in a reduction kernel runs per element (x + r), not per row."""
    return isinstance(buf, Pointwise) and len(group.reduction_ranges) > 0 and \
        _node_loops(buf)[0] == group.ranges + group.reduction_ranges


def phases(group):
    """Split the group's nodes into row statements and loops over the reduction dims.

    A loop phase ends where a later node needs a reduction that phase computes.
    """
    g = group
    phases = []
    for node in g.nodes:
        x, r = _node_loops(node)
        per_element = isinstance(node, Reduction) or (len(x) == len(g.ranges) + len(g.reduction_ranges) and g.reduction_ranges)
        kind = "loop" if per_element else "row"
        if kind == "row":
            phases.append(("row", [node]))
            continue
        if phases and phases[-1][0] == "loop":
            open_reductions = {n.name for n in phases[-1][1] if isinstance(n, Reduction)}
            xv, rv = index_vars("x", len(g.ranges)), index_vars("r", len(g.reduction_ranges))
            if not ({name for name, _ in _reads(node, xv, rv)} & open_reductions):
                phases[-1][1].append(node)
                continue
        phases.append(("loop", [node]))
    return phases


def all_accesses(nodes, xvars, rvars) -> list:
    """(index, buffer) of every load, index_expr (buffer None) and store of a group's bodies."""
    out = []
    for n in nodes:
        c = IndexCollector()
        idx, ridx = node_index(n, xvars, rvars)
        with set_handler(c):
            n.inner_fn(idx, ridx) if isinstance(n, Reduction) else n.inner_fn(idx)
        out += list(zip(c.exprs, c.names))
        out.append((store_index(n, xvars, rvars), n.name))
    return out


def all_indices(nodes, xvars, rvars) -> list:
    return [e for e, _ in all_accesses(nodes, xvars, rvars)]


def dead_after(sched: Schedule, group_index: int, alive: set) -> list:
    """§7.5: the buffers in `alive` whose last reader is this group (graph outputs live on)."""
    outputs = {output_buffer(o) for o in sched.lowered.outputs} - {None}
    return sorted(n for n in alive if sched.last_use.get(n) == group_index and n not in outputs)


def format_schedule(sched: Schedule) -> str:
    lines = []
    for g in sched.groups:
        if g.kind == "extern":
            lines.append(f"kernel {g.index}: extern {g.nodes[0].op} -> {g.nodes[0].name}  # {', '.join(g.origins)}")
            continue
        if g.kind == "template":
            lines.append(f"kernel {g.index}: template {g.nodes[0].op} ranges={g.ranges} "
                         f"nodes={[n.name for n in g.nodes]}  # fuses {', '.join(g.origins)}")
            continue
        shape = f"ranges={g.ranges}" + (f" reduction_ranges={g.reduction_ranges}" if g.kind in ("reduction", "scan") else "")
        shape += f" cross={[n.name for n in g.cross]}" if g.cross else ""
        lines.append(f"kernel {g.index}: {g.kind} {shape} nodes={[n.name for n in g.nodes]}  "
                     f"# fuses {', '.join(g.origins)}")
    local = sorted(sched.kernel_local)
    if local:
        lines.append(f"kept inside their kernel (never stored): {', '.join(local)}")
    return "\n".join(lines)
