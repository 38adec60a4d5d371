"""§8 CPU code generation: fusion groups → C++ kernels + a Python wrapper.

Layer: back end (CPU). Imports the IR (`ir`), the schedule (`schedule`), the printer skeleton
(`printer`), the shared wrapper pieces (`wrapper`) and `cache.prelude`; nothing above it. runtime.py loads what it produces.

Consumes a `schedule.Schedule`; produces a `CppModule`: the text of one C++ file (the prelude
`cpp_prelude.h` with Stax's vectorizable math, then one `extern "C"` function per kernel), the cffi
declarations of those functions, and the text of a Python wrapper `call(args)` that allocates
buffers, launches kernels in order and drops each buffer after its last use. Generation stops at
text: `runtime.load_module` compiles the file with the system C++ compiler (through the
content-addressed cache of `cache.py`) and imports the wrapper.

Each kernel is printed by running the IR's `inner_fn`s with `CppPrinter`, an `ops` handler whose
values are C++ temporaries `tmpN`; CSE, temporaries and the op table's `cpp` spellings come from
`printer.Printer`, so `CppPrinter` holds only C++'s own forms.

Where to look:
  - `split_policy` ....................... Alg. 6.1 on the CPU: split a reduction to fill the threads
  - cpp_kernel.py ........................ C types, literals, CppPrinter, CppKernel, loop_nest (below this)
  - `_pointwise_kernel` .................. OpenMP outer loop, `omp simd` inner loop, 2-D tiles for transposes
  - `_reduction_kernel`, `_reduction_loop`  one pass over each row per phase; 16-lane accumulators
  - `_column_kernel` ..................... reductions over outer/middle dims: lanes own output columns
  - `_scan_kernel`, `_scan_body` ......... scans: a sequential loop along the dim, rows (or column
                                           blocks, one SIMD lane per column) across threads
  - `_wrapper` ........................... the Python `call(args)` (§7.5 lifetimes as `del`)
  - `generate(schedule)` ................. the entry point
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import sympy

from . import cache
from .dtypes import bfloat16, float16, int64
from .ir import Reduction, Scan, Scatter, reduction_identity, scan_identity, set_handler
from .schedule import all_accesses, all_indices, cross_orientation, node_index, phases, store_index
from .tensor import get_num_threads
from .printer import Var
from .cpp_kernel import (CppKernel, cexpr, cliteral, ctype, drop_unread_checks, for_line, loop_nest, numel_of,
                         uniform_bound_checks)
from .wrapper import (extern_call, pydtype, pylit, pyname, pyoutputs, pyshape, wrapper_launches,
                      wrapper_prologue)

LANES = 16          # accumulator lanes: one AVX-512 register of float32
TILE = 16           # 2-D tile edge for transposed pointwise kernels (cache lines)
PAGE_BLOCK = 64     # tiles are walked in blocks of this edge (pages: the TLB)
PARALLEL_MIN = 32768  # below this many elements a kernel runs on one thread
CROSS_REDUCTIONS = True  # schedule(cross=True): a row and a column reduction share one pass


def _omp_if(numel) -> str:
    """§10.3: a symbolic element count decides at run time whether to start the thread team (a
    small call would otherwise pay OpenMP's fork and join, hundreds of µs on a busy machine)."""
    numel = sympy.sympify(numel)
    return "" if numel.is_Integer else f" if(parallel: {cexpr(numel)} >= {PARALLEL_MIN})"



def split_policy(numel_out, numel_red) -> int:
    """Alg. 6.1 on the CPU: split a reduction only when its rows cannot keep every thread busy."""
    threads = get_num_threads()
    if not (sympy.sympify(numel_out).is_Integer and sympy.sympify(numel_red).is_Integer):
        return 1
    if int(numel_out) >= threads or int(numel_red) < 65536:
        return 1
    return 8 * threads


def outer_split_policy(numel_out, numel_red) -> int:
    """Alg. 6.1 for a reduction that reads across rows (the column form): its parallel work is its
    blocks of at least LANES columns, not its outputs. Too few blocks for the threads (`x.sum(0)`
    of a 40000 x 3 matrix: one block) → split the rows, partials [splits, outputs], so the pieces
    run in parallel and a second column kernel combines them."""
    threads = get_num_threads()
    if not (sympy.sympify(numel_out).is_Integer and sympy.sympify(numel_red).is_Integer):
        return 1
    out, red = int(numel_out), int(numel_red)
    if threads < 2 or -(-out // LANES) >= threads or red < 8192 or out * red < PARALLEL_MIN:
        return 1
    return max(1, min(4 * threads, red // 2048))


def deviation_piece(numel_out, numel_red, outer: bool) -> int:
    """Elements per piece of var's deviations (lower.chunk_deviations). Columns: 128 rows, so a
    block of COLUMN_BLOCK columns (512 KiB) stays in L2 for the second pass over its piece. A row
    stays in cache up to 64K elements; longer rows go in pieces of 4096."""
    if outer:
        return 128
    return 4096 if numel_red > 65536 else 0


# ---- §8.2 Pointwise kernels (2-D tiles for transposes) ----


def _pointwise_kernel(k: CppKernel) -> list:
    g = k.group
    xvars, _, (names, sizes), _ = loop_nest(k, g.ranges, [])
    p = k.printer()
    stores = []
    for node in g.nodes:
        _, value = k.body(node, xvars, [], printer=p)
        k.locals[node.name] = value
        if node.name not in k.sched.kernel_local:
            stores.append(k.store(node, value, xvars, []))
    body = p.lines + stores
    if not names:
        return body
    numel = numel_of(sizes)
    parallel = not (numel.is_Integer and int(numel) < PARALLEL_MIN)
    scatter = [n for n in g.nodes if isinstance(n, Scatter)]
    if scatter:
        return _index_pre_check(k, scatter[0], xvars, names, sizes) + \
            _scatter_loops(k, scatter[0], xvars, names, sizes, body)
    tile = _transpose_tile(k, xvars, names)
    if tile is not None:
        return _tiled_loops(names, sizes, tile, body, (_omp_if(numel) or True) if parallel else False)
    lines, depth = [], 0
    for d, (v, s) in enumerate(zip(names, sizes)):
        inner = d == len(names) - 1
        if d == 0 and parallel:
            lines.append("    " * depth + ("#pragma omp parallel for simd" if inner else "#pragma omp parallel for")
                         + _omp_if(numel))
        elif inner:
            lines.append("    " * depth + "#pragma omp simd")
        lines.append("    " * depth + for_line(v, s) + " {")
        depth += 1
    lines += ["    " * depth + line for line in "\n".join(body).split("\n")]
    for d in range(depth - 1, -1, -1):
        lines.append("    " * d + "}")
    return lines


def _index_pre_check(k, node, xvars, names, sizes) -> list:
    """A scatter into an input's own memory checks every index first, over the loops the indices
    depend on, and returns before writing anything if one is out of range: the input is left as
    eager leaves it when it raises."""
    if node.target not in {b.name for b in k.lowered.inputs}:
        return []                   # a fresh copy: a partial update is never seen
    p = k.printer()
    idx, _ = node_index(node, xvars, [])
    with set_handler(p):
        node.output_indexer(idx)
    if not p.lines:
        return []
    used = [(v, s) for v, s in zip(names, sizes) if re.search(rf"(?<![A-Za-z0-9_]){v}(?![A-Za-z0-9_])", "\n".join(p.lines))]
    lines = [("    " * d) + for_line(v, s) + " {" for d, (v, s) in enumerate(used)]
    lines += ["    " * len(used) + line for line in p.lines]
    lines += ["    " * d + "}" for d in range(len(used) - 1, -1, -1)]
    return lines + ["if (__atomic_load_n(&stax_errors, __ATOMIC_RELAXED) & STAX_ERR_INDEX) return;"]


SCATTER_CHUNK = 64        # columns of a scatter's inner loop one thread owns


def _scatter_loops(k, node, xvars, names, sizes, body) -> list:
    """A scatter's loops (§6 indirect writes): writes may collide, so the index loops run serially,
    in index order (the last write wins, adds happen in order, as eagerly). When the innermost loop
    is a coordinate of the written position, distinct iterations write distinct elements: it runs
    as SIMD lanes, and when long, its chunks of SCATTER_CHUNK are spread over the threads (each
    thread runs every index loop over its own columns: the same order per element)."""
    e = k.final(store_index(node, xvars, []))
    inner, n = names[-1], sympy.sympify(sizes[-1])
    own = e.coeff(inner) != 0 and not any(a.has(inner) for a in e.atoms(sympy.Function))
    lines, depth = [], 0
    chunked = own and len(names) > 1 and n.is_Integer and int(n) >= 4 * SCATTER_CHUNK
    if chunked:
        lines += ["#pragma omp parallel for", for_line(f"{inner}_chunk", n, step=SCATTER_CHUNK) + " {"]
        depth = 1
    for d, (v, s) in enumerate(zip(names, sizes)):
        if d == len(names) - 1 and own:
            lines.append("    " * depth + "#pragma omp simd")
        if d == len(names) - 1 and chunked:
            end = f"stax_min<int64_t>({inner}_chunk + {SCATTER_CHUNK}, {cexpr(s)})"
            lines.append("    " * depth + f"for (int64_t {v} = {inner}_chunk; {v} < {end}; {v}++) {{")
        else:
            lines.append("    " * depth + for_line(v, s) + " {")
        depth += 1
    lines += ["    " * depth + line for line in "\n".join(body).split("\n")]
    for d in range(depth - 1, -1, -1):
        lines.append("    " * d + "}")
    return lines


def _transpose_tile(k, xvars, names):
    """The loop to tile with the innermost one when some load is contiguous along it instead (§8.2)."""
    if len(names) < 2:
        return None
    inner = names[-1]
    for e in all_indices(k.group.nodes, xvars, []):
        e = k.final(e)
        if e.coeff(inner) == 1 or not e.has(inner):
            continue        # contiguous, or one value per row (a gather's index): not transposed
        for d, v in enumerate(names[:-1]):
            if e.coeff(v) == 1:
                return d
    return None


def _tiled_loops(names, sizes, d, body, parallel):
    """Loops over dims (d, last) in TILE×TILE tiles grouped into PAGE_BLOCK×PAGE_BLOCK blocks.

    A tile keeps both the strided load's cache lines and the store's in L1 (§8.2); a block keeps the
    pages the strided side walks across few, so the TLB is not thrashed (with 4 KiB pages a 16×16
    tile alone touches 16 new pages per 256 elements).
    """
    a, b = names[d], names[-1]
    outer = [(v, s) for v, s in zip(names, sizes) if v not in (a, b)]
    lines, depth = [], 0

    def open_loop(text):
        nonlocal depth
        lines.append("    " * depth + text + " {")
        depth += 1

    block_loops = [(f"{a}_block", sizes[d]), (f"{b}_block", sizes[-1])]
    if parallel:
        lines.append(f"#pragma omp parallel for collapse({len(outer) + 2})" + (parallel if isinstance(parallel, str) else ""))
    for v, s in outer:
        open_loop(for_line(v, s))
    for v, s in block_loops:
        open_loop(for_line(v, s, step=PAGE_BLOCK))
    for v, s in ((a, sizes[d]), (b, sizes[-1])):
        end = f"stax_min<int64_t>({v}_block + {PAGE_BLOCK}, {cexpr(s)})"
        open_loop(f"for (int64_t {v}_tile = {v}_block; {v}_tile < {end}; {v}_tile += {TILE})")
    ends = [f"stax_min<int64_t>({v}_tile + {TILE}, {cexpr(s)})" for v, s in ((a, sizes[d]), (b, sizes[-1]))]
    tile = _tile_loops(a, b, ends, body)
    if not all(sympy.sympify(s).is_Integer for s in (sizes[d], sizes[-1])):
        # §10.3: a symbolic size keeps the tile's trip counts constant (unrolled, vectorized)
        # except in the tiles at its edge, which take the remainder loops
        full = _tile_loops(a, b, [f"{a}_tile + {TILE}", f"{b}_tile + {TILE}"], body)
        test = f"{a}_tile + {TILE} <= {cexpr(sizes[d])} && {b}_tile + {TILE} <= {cexpr(sizes[-1])}"
        tile = [f"if ({test}) {{"] + ["    " + x for x in full] + ["} else {"] + ["    " + x for x in tile] + ["}"]
    lines += ["    " * depth + line for line in tile]
    for dd in range(depth - 1, -1, -1):
        lines.append("    " * dd + "}")
    return lines


def _tile_loops(a, b, ends, body) -> list:
    """One TILE x TILE tile: rows `a`, the vectorized columns `b` (ends: each loop's bound)."""
    return ([f"for (int64_t {a} = {a}_tile; {a} < {ends[0]}; {a}++) {{", "    #pragma omp simd",
             f"    for (int64_t {b} = {b}_tile; {b} < {ends[1]}; {b}++) {{"]
            + ["        " + line for line in "\n".join(body).split("\n")] + ["    }", "}"])


# ---- §8 Reduction kernels: one row per OpenMP iteration, one pass over the row per phase ----

_COMBINE = {
    "sum": "{a} + {v}", "prod": "{a} * {v}",
    "amax": "stax_max({a}, {v})", "amin": "stax_min({a}, {v})",
}


def _either(test: str, fast: list, slow: list) -> list:
    return [f"if ({test}) {{"] + ["    " + x for x in fast] + ["} else {"] + ["    " + x for x in slow] + ["}"]


def _unmasked(k: CppKernel, checks, make) -> list:
    """`make()`'s lines for a block that has tested its bound checks `checks` (a ragged piece's,
    `uniform_bound_checks`): their masks leave the SIMD loop, which then runs as the static one."""
    k.assume = set(checks)
    try:
        return drop_unread_checks(k, make())
    finally:
        k.assume = set()


def _reduction_kernel(k: CppKernel) -> list:
    g = k.group
    xvars, rvars, (xnames, xsizes), (rnames, rsizes) = loop_nest(k, g.ranges, g.reduction_ranges)
    if g.cross:
        return _cross_kernel(k, xvars, rvars)
    if _is_column_reduction(k, xvars, rvars, xnames, rnames):
        return _column_kernel(k, xvars, rvars, (xnames, xsizes), (rnames, rsizes))

    def rows():
        row = []
        for phase, nodes in phases(k.group):
            if phase == "row":
                for node in nodes:
                    p, value = k.body(node, xvars, rvars)
                    row += p.lines
                    k.locals[node.name] = value
                    if node.name not in k.sched.kernel_local:
                        row.append(k.store(node, value, xvars, rvars))
            else:
                row += _reduction_loop(k, nodes, xvars, rvars, rnames, rsizes)
        return row
    checks, hold = uniform_bound_checks(k, xvars, rvars, None, (rnames, rsizes)) if rnames else ((), None)
    row = _either(hold, _unmasked(k, checks, rows), rows()) if hold else rows()
    if not xnames:
        return row
    total = numel_of(xsizes) * numel_of(rsizes)
    parallel = not (total.is_Integer and int(total) < PARALLEL_MIN)
    lines = []
    if parallel:
        lines.append(f"#pragma omp parallel for{' collapse(%d)' % len(xnames) if len(xnames) > 1 else ''}"
                     + _omp_if(total))
    depth = 0
    for v, s in zip(xnames, xsizes):
        lines.append("    " * depth + for_line(v, s) + " {"); depth += 1
    lines += ["    " * depth + line for line in "\n".join(row).split("\n")]
    for d in range(depth - 1, -1, -1):
        lines.append("    " * d + "}")
    return lines


def _reduction_loop(k, nodes, xidx, ridx, rnames, rsizes) -> list:
    """One pass over the reduction dims computing `nodes` (reductions and per-element nodes):
    LANES accumulators per reduction, the loops over the row, then the lanes combined."""
    reductions = [n for n in nodes if isinstance(n, Reduction)]
    lines = _lane_accumulators(reductions)
    lines += _row_loops(k, nodes, xidx, ridx, rnames, rsizes, bool(reductions))
    return lines + _combine_lanes(k, reductions, xidx, ridx)


def _lane_accumulators(reductions, width=LANES) -> list:
    """Declare `acc_NAME[width]` (and `acc_NAME_idx` for argmax/argmin), filled with the identity:
    LANES lanes of a row reduction, or one per column of a column block."""
    pre = []
    for n in reductions:
        acc, t = f"acc_{n.name}", ctype(n.src_dtype)
        init = _identity(n)
        if n.reduction_type in ("argmax", "argmin"):
            pre.append(f"{t} {acc}[{width}]; int64_t {acc}_idx[{width}];")
            pre.append(f"for (int l = 0; l < {width}; l++) {{ {acc}[l] = {init}; {acc}_idx[l] = 0; }}")
        else:
            pre.append(f"{t} {acc}[{width}];")
            pre.append(f"for (int l = 0; l < {width}; l++) {acc}[l] = {init};")
    return pre


def _row_body(k, nodes, xidx, ridx, rnames, rsizes, lane: str) -> list:
    """The loop body for one element of the row: each node's value, folded into lane `lane` of
    its accumulator (a reduction) or stored (a per-element node that leaves the kernel)."""
    p = k.printer()
    lines = []
    for n in nodes:
        _, value = k.body(n, xidx, ridx, printer=p)
        if isinstance(n, Reduction):
            acc = f"acc_{n.name}"
            if n.reduction_type in ("argmax", "argmin"):
                cmp = ">" if n.reduction_type == "argmax" else "<"
                flat = cexpr(_flat_rindex(rnames, rsizes))
                lines.append(f"{{ bool take = ({value} {cmp} {acc}[{lane}]) || ({value} != {value} && {acc}[{lane}] == {acc}[{lane}]);"
                             f" {acc}[{lane}] = take ? {value} : {acc}[{lane}]; {acc}_idx[{lane}] = take ? {flat} : {acc}_idx[{lane}]; }}")
            else:
                lines.append(f"{acc}[{lane}] = " + _COMBINE[n.reduction_type].format(a=f"{acc}[{lane}]", v=value) + ";")
        else:
            k.locals[n.name] = value
            if n.name not in k.sched.kernel_local:
                lines.append(k.store(n, value, xidx, ridx))
    for n in nodes:                       # per-element values do not outlive the loop body
        if not isinstance(n, Reduction):
            k.locals.pop(n.name, None)
    return p.lines + lines


def _row_loops(k, nodes, xidx, ridx, rnames, rsizes, has_reductions: bool) -> list:
    """Loops over the outer reduction dims, then the innermost one: in LANES-wide `omp simd`
    chunks plus a scalar tail when there are accumulators, else one `omp simd` loop."""
    def body(lane):
        return "\n".join(_row_body(k, nodes, xidx, ridx, rnames, rsizes, lane)).split("\n")

    inner, innersize = rnames[-1], rsizes[-1]
    lines, depth = [], 0
    for v, s in zip(rnames[:-1], rsizes[:-1]):
        lines.append("    " * depth + for_line(v, s) + " {"); depth += 1
    pad = "    " * depth
    if has_reductions:
        static = sympy.sympify(innersize).is_Integer
        vec_end = str(int(innersize) // LANES * LANES) if static else f"({cexpr(innersize)}) / {LANES} * {LANES}"
        lines.append(pad + f"for (int64_t {inner}_lane0 = 0; {inner}_lane0 < {vec_end}; {inner}_lane0 += {LANES}) {{")
        lines.append(pad + "    #pragma omp simd")
        lines.append(pad + f"    for (int l = 0; l < {LANES}; l++) {{")
        lines.append(pad + f"        int64_t {inner} = {inner}_lane0 + l;")
        lines += [pad + "        " + s for s in body("l")]
        lines.append(pad + "    }")
        lines.append(pad + "}")
        if not static or int(innersize) % LANES:
            lines.append(pad + f"for (int64_t {inner} = {vec_end}; {inner} < {cexpr(innersize)}; {inner}++) {{")
            lines += [pad + "    " + s for s in body("0")]
            lines.append(pad + "}")
    else:
        lines.append(pad + "#pragma omp simd")
        lines.append(pad + for_line(inner, innersize) + " {")
        lines += [pad + "    " + s for s in body("0")]
        lines.append(pad + "}")
    for d in range(depth - 1, -1, -1):
        lines.append("    " * d + "}")
    return lines


def _combine_lanes(k, reductions, xidx, ridx) -> list:
    """Combine each reduction's lanes into `tmp_NAME`, the row's result (stored unless kernel-local)."""
    lines = []
    for n in reductions:
        acc, t = f"acc_{n.name}", ctype(n.src_dtype)
        var = f"tmp_{n.name}"
        if n.reduction_type in ("argmax", "argmin"):
            cmp = ">" if n.reduction_type == "argmax" else "<"
            lines.append(f"{t} {var}_val = {acc}[0]; int64_t {var} = {acc}_idx[0];")
            lines.append(f"for (int l = 1; l < {LANES}; l++) {{")
            lines.append(f"    {t} v = {acc}[l]; int64_t i = {acc}_idx[l];")
            lines.append(f"    bool vnan = v != v, bnan = {var}_val != {var}_val;")
            lines.append(f"    bool take = (vnan && !bnan) || (vnan == bnan && (v {cmp} {var}_val || (v == {var}_val || vnan) && i < {var}));")
            lines.append(f"    if (take) {{ {var}_val = v; {var} = i; }}")
            lines.append("}")
            value = Var(var, int64)
        else:
            lines.append(f"{t} {var} = {acc}[0];")
            comb = _COMBINE[n.reduction_type].format(a=var, v=f"{acc}[l]")
            lines.append(f"for (int l = 1; l < {LANES}; l++) {var} = {comb};")
            value = Var(var, n.src_dtype)
        k.locals[n.name] = value
        if n.name not in k.sched.kernel_local:
            lines.append(k.store(n, value, xidx, ridx))
    return lines


def _flat_rindex(rnames, rsizes):
    flat = sympy.Integer(0)
    for v, s in zip(rnames, rsizes):
        flat = flat * s + v
    return flat


def _identity(n) -> str:
    return cliteral(reduction_identity(n.reduction_type, n.src_dtype), n.src_dtype)


# ---- §8 Column reductions: the contiguous output dim is the fast axis, the reduction loop outside ----

# Output columns per block: 4 KiB of float accumulators each, in L1, and 4 KiB read from each row
# (a page: the prefetcher streams it). A later pass (var's deviations) re-reads the block from
# memory: narrow blocks that stay in L2 between passes measured slower (a new page per row).
COLUMN_BLOCK = 1024


def _is_column_reduction(k, xvars, rvars, xnames, rnames) -> bool:
    """True when the group's accesses run contiguously along the innermost kept dim and none is
    contiguous along the innermost reduced dim (sum(0), mean over outer dims, amax over a middle
    dim): then each SIMD lane owns an output column and the reduction loops go outside. An
    index_expr along the reduced dim (a piece's bound check `r0 + 128*x0 < s0`) touches no memory:
    it keeps the row form only when no load runs along the columns."""
    if not xnames or not rnames:
        return False
    xi, ri = xnames[-1], rnames[-1]
    stored = {n.name for n in k.group.nodes}
    accesses = [(k.final(e), name) for e, name in all_accesses(k.group.nodes, xvars, rvars)]
    memory = [e for e, name in accesses if name is not None]
    along_r = any(e.coeff(ri) == 1 for e, name in accesses if name is None)
    if along_r and not any(e.coeff(xi) == 1 for e, name in accesses if name is not None and name not in stored):
        return False
    return any(e.coeff(xi) == 1 for e in memory) and not any(e.coeff(ri) == 1 for e in memory)


def _column_block(xsizes, parallel: bool, hints=None) -> int:
    """Columns per block: COLUMN_BLOCK, fewer when a parallel kernel would have fewer blocks than
    threads (down to LANES); at most the row's length. Symbolic sizes (§10.3): chosen at the hints
    (any block is correct: the last one of a row takes the remainder)."""
    xb, inner, outer = COLUMN_BLOCK, sympy.sympify(xsizes[-1]), sympy.sympify(numel_of(xsizes[:-1]))
    if hints:
        inner, outer = inner.subs(hints), outer.subs(hints)
    if inner.is_Integer and outer.is_Integer:
        while parallel and xb > LANES and int(outer) * -(-int(inner) // xb) < get_num_threads():
            xb //= 2
        xb = max(1, min(xb, int(inner)))     # (a size-0 row: one empty block)
    return xb


def _column_kernel(k, xvars, rvars, xnest, rnest) -> list:
    """Per block of output columns, one pass over the reduction dims per phase: `acc_NAME[l]`
    holds column l's running value, the innermost loop (`omp simd`) runs along the columns; row
    statements run in a loop over the block's columns into `val_NAME[l]`."""
    (xnames, xsizes), (rnames, rsizes) = xnest, rnest
    loops = phases(k.group)
    total = numel_of(xsizes) * numel_of(rsizes)
    parallel = not (total.is_Integer and int(total) < PARALLEL_MIN)
    xb = _column_block(xsizes, parallel, k.sched.lowered.hints)
    xi, inner = xnames[-1], sympy.sympify(xsizes[-1])
    static = inner.is_Integer and int(inner) % xb == 0
    n = str(xb) if static else f"{xi}_n"

    def phases_of(n):
        out = []
        for kind, nodes in loops:
            if kind == "row":
                out += _column_rows(k, nodes, xvars, rvars, (xi, n, xb))
            else:
                out += _column_pass(k, nodes, xvars, rvars, (xi, n, xb), rnames, rsizes)
        return out
    checks, hold = uniform_bound_checks(k, xvars, rvars, xi, (rnames, rsizes))
    block = [] if static else [f"const int64_t {n} = stax_min<int64_t>({xb}, {cexpr(inner)} - {xi}_block);"]
    if inner.is_Integer:
        block += _either(hold, _unmasked(k, checks, lambda: phases_of(n)), phases_of(n)) if hold else phases_of(n)
    else:       # §10.3: full blocks run constant trip counts (unmasked pieces); the last one the remainder
        full = f"{n} == {xb}" + (f" && {hold}" if hold else "")
        block += _either(full, _unmasked(k, checks, lambda: phases_of(str(xb))), phases_of(n))
    lines = []
    if parallel:
        lines.append(f"#pragma omp parallel for{' collapse(%d)' % len(xnames) if len(xnames) > 1 else ''}"
                     + _omp_if(total))
    loops_x = [for_line(v, s) for v, s in zip(xnames[:-1], xsizes[:-1])] + [for_line(f"{xi}_block", inner, step=xb)]
    for d, text in enumerate(loops_x):
        lines.append("    " * d + text + " {")
    lines += ["    " * len(loops_x) + line for line in "\n".join(block).split("\n")]
    for d in range(len(loops_x) - 1, -1, -1):
        lines.append("    " * d + "}")
    return lines


def _column_loop(xi, n, body, simd=False) -> list:
    """`for l in block: x_i = block start + l; body` (the lane loop of a column block)."""
    head = ["#pragma omp simd"] if simd else []
    return head + [f"for (int64_t l = 0; l < {n}; l++) {{", f"    int64_t {xi} = {xi}_block + l;"] + \
        ["    " + s for s in "\n".join(body).split("\n")] + ["}"]


def _column_rows(k, nodes, xvars, rvars, block) -> list:
    """Per-column statements (mean = sum / n ...): computed for each column of the block into
    `val_NAME[l]`, which later passes read; stored when they leave the kernel."""
    (xi, n, xb), lines, body, p = block, [], [], k.printer()
    for node in nodes:
        _, value = k.body(node, xvars, rvars, printer=p)
        lines.append(f"{ctype(value.dtype)} val_{node.name}[{xb}];")
        body.append(f"val_{node.name}[l] = {value};")
        if node.name not in k.sched.kernel_local:
            body.append(k.store(node, value, xvars, rvars))
        k.locals[node.name] = Var(f"val_{node.name}[l]", value.dtype)
    return lines + _column_loop(xi, n, p.lines + body)


def _column_pass(k, nodes, xvars, rvars, block, rnames, rsizes) -> list:
    """One pass over the reduction dims for a block of columns: accumulators `acc_NAME[xb]`
    (no lanes to combine: lane l is column l), then the results stored per column."""
    xi, n, xb = block
    reductions = [r for r in nodes if isinstance(r, Reduction)]
    lines = _lane_accumulators(reductions, xb)
    body = _row_body(k, nodes, xvars, rvars, rnames, rsizes, "l")
    loop = _column_loop(xi, n, body, simd=True)
    for d, (v, s) in enumerate(reversed(list(zip(rnames, rsizes)))):
        loop = [for_line(v, s) + " {"] + ["    " + s_ for s_ in loop] + ["}"]
    lines += loop
    stores = []
    for r in reductions:
        arg = r.reduction_type in ("argmax", "argmin")
        value = Var(f"acc_{r.name}{'_idx' if arg else ''}[l]", int64 if arg else r.src_dtype)
        k.locals[r.name] = value
        if r.name not in k.sched.kernel_local:
            stores.append(k.store(r, value, xvars, rvars))
    return lines + (_column_loop(xi, n, stores) if stores else [])


# ---- §8 A row and a column reduction of one input in one pass (schedule._can_cross) ----

CROSS_PART_BYTES = 256 * 1024   # the column partials of all parts, on the kernel's stack


def _cross_parts(rows: int, columns: int, itemsize: int = 8) -> int:
    """Chunks of rows the pass runs in parallel, each with its own column accumulators (one when
    the kernel is small enough to run on one thread, as `PARALLEL_MIN` decides elsewhere)."""
    if rows * columns < PARALLEL_MIN:
        return 1
    return max(1, min(get_num_threads(), rows // 16, CROSS_PART_BYTES // (columns * itemsize)))


def _cross_element(k, colred, rowred, row, col) -> list:
    """The body for one element: folded into each column reduction's accumulator of this part,
    and kept as each row reduction's value for this row's column (loads shared: one printer)."""
    p, lines = k.printer(), []
    for n in colred:
        _, v = k.body(n, [col], [row], printer=p)
        acc = f"part_{n.name}[p][{col}]"
        lines.append(f"{acc} = " + _COMBINE[n.reduction_type].format(a=acc, v=v) + ";")
    for n in rowred:
        _, v = k.body(n, [row], [col], printer=p)
        lines.append(f"row_{n.name}[{col}] = {v};")
    return p.lines + lines


def _cross_row(k, rowred, row, col, columns: int) -> list:
    """A row's results from `row_NAME`: LANES lanes, then the tail into lane 0, then the lanes
    combined -- the row kernel's order of operations, so the results equal its results."""
    vec_end, lines = columns // LANES * LANES, _lane_accumulators(rowred)
    folds = [(n, f"acc_{n.name}", f"row_{n.name}") for n in rowred]
    lines.append(f"for (int64_t c0 = 0; c0 < {vec_end}; c0 += {LANES}) {{")
    lines.append("    #pragma omp simd")
    lines.append(f"    for (int l = 0; l < {LANES}; l++) {{")
    lines += [f"        {a}[l] = " + _COMBINE[n.reduction_type].format(a=f"{a}[l]", v=f"{r}[c0 + l]") + ";"
              for n, a, r in folds]
    lines += ["    }", "}"]
    if vec_end < columns:
        lines.append(f"for (int64_t c = {vec_end}; c < {columns}; c++) {{")
        lines += [f"    {a}[0] = " + _COMBINE[n.reduction_type].format(a=f"{a}[0]", v=f"{r}[c]") + ";"
                  for n, a, r in folds]
        lines.append("}")
    return lines + _combine_lanes(k, rowred, [row], [col])


def _cross_kernel(k, xvars, rvars) -> list:
    """One pass over a 2-D input for both orientations (`x.sum(0)` and `x.sum(1)`): the rows in
    `parts` chunks (in parallel when large); per row an `omp simd` loop along the contiguous
    columns folds each element into the column accumulators `part_NAME[p][c]` and keeps the row
    reductions' values in `row_NAME[c]`, then `_cross_row` reduces them. After the chunks, the
    column results are combined across parts in order (deterministic) and stored."""
    g = k.group
    row, col = cross_orientation(g.nodes, g.cross)
    colred, rowred = (g.nodes, g.cross) if col == xvars[0] else (g.cross, g.nodes)
    rows, columns = int(k.ranges[row]), int(k.ranges[col])
    parts = _cross_parts(rows, columns)
    lines = []
    for n in colred:
        lines.append(f"{ctype(n.src_dtype)} part_{n.name}[{parts}][{max(columns, 1)}];")
    if parts > 1:
        lines.append("#pragma omp parallel for")
    body = [f"{ctype(n.src_dtype)} row_{n.name}[{max(columns, 1)}];" for n in rowred]
    body += [f"for (int64_t c = 0; c < {columns}; c++) part_{n.name}[p][c] = {_identity(n)};" for n in colred]
    body.append(f"for (int64_t {row} = {rows} * p / {parts}; {row} < {rows} * (p + 1) / {parts}; {row}++) {{")
    element = ["#pragma omp simd", for_line(col, columns) + " {"] + \
        ["    " + x for x in _cross_element(k, colred, rowred, row, col)] + ["}"]
    body += ["    " + x for x in element + _cross_row(k, rowred, row, col, columns)]
    body.append("}")
    lines += [f"for (int64_t p = 0; p < {parts}; p++) {{"] + ["    " + x for x in body] + ["}"]
    out = []
    for n in colred:
        t, var = ctype(n.src_dtype), f"tmp_{n.name}"
        comb = _COMBINE[n.reduction_type].format(a=var, v=f"part_{n.name}[p][{col}]")
        out += [f"{t} {var} = part_{n.name}[0][{col}];", f"for (int64_t p = 1; p < {parts}; p++) {var} = {comb};",
                k.store(n, Var(var, n.src_dtype), [col], [row])]
    return lines + [for_line(col, columns) + " {"] + ["    " + x for x in out] + ["}"]


# ---- §8 Scans: a sequential loop along the scanned dim, threads (and SIMD lanes) across the others ----

_SCAN_COMBINE = {"cumsum": "{a} + {v}", "cumprod": "{a} * {v}", "logcumsumexp": "stax_logaddexp({a}, {v})",
                 "cummax": "stax_max({a}, {v})", "cummin": "stax_min({a}, {v})"}


def _scan_body(k, xvars, rvars, acc: str) -> list:
    """One element of a scan group: the Scan's input folded into the running value `acc` (in index
    order along the dim: the order eager's numpy accumulates in, so float results match bit for
    bit), stored; then the epilogues, which read the running value (rounded as stored)."""
    p, stores = k.printer(), []
    for n in k.group.nodes:
        _, value = k.body(n, xvars, rvars, printer=p)
        if isinstance(n, Scan):
            p.lines.append(f"{acc} = " + _SCAN_COMBINE[n.reduction_type].format(a=acc, v=value) + ";")
            value = Var(acc, n.src_dtype)
            k.locals[n.name] = p.to_dtype(value, n.dtype) if n.dtype in (float16, bfloat16) else value
        else:
            k.locals[n.name] = value
        if n.name not in k.sched.kernel_local:
            stores.append(k.store(n, value, xvars, rvars))
    for n in k.group.nodes:
        k.locals.pop(n.name, None)
    return p.lines + stores


def _scan_kernel(k: CppKernel) -> list:
    """A 'scan' group: per row of the other dims (OpenMP threads across rows), a loop along the
    scanned dim carrying the running value. When the loads run contiguously along the innermost
    other dim (a scan over an outer dim), columns go in blocks: lane l of `acc_NAME[l]` owns column
    l and the innermost loop (`omp simd`) runs across the block, as in `_column_kernel`."""
    g = k.group
    xvars, rvars, (xnames, xsizes), (rnames, rsizes) = loop_nest(k, g.ranges, g.reduction_ranges)
    scan = g.nodes[0]
    t, init = ctype(scan.src_dtype), cliteral(scan_identity(scan.reduction_type, scan.src_dtype), scan.src_dtype)
    total = numel_of(xsizes) * numel_of(rsizes)
    parallel = bool(xnames) and not (total.is_Integer and int(total) < PARALLEL_MIN)
    along = [for_line(rnames[0], rsizes[0]) + " {"]
    if _is_column_reduction(k, xvars, rvars, xnames, rnames):
        xb = _column_block(xsizes, parallel, k.sched.lowered.hints)
        xi, inner = xnames[-1], sympy.sympify(xsizes[-1])
        n = str(xb) if inner.is_Integer and int(inner) % xb == 0 else f"{xi}_n"
        row = [] if n == str(xb) else [f"const int64_t {n} = stax_min<int64_t>({xb}, {cexpr(inner)} - {xi}_block);"]
        row += [f"{t} acc_{scan.name}[{xb}];", f"for (int l = 0; l < {xb}; l++) acc_{scan.name}[l] = {init};"]
        row += along + ["    " + s for s in _column_loop(xi, n, _scan_body(k, xvars, rvars, f"acc_{scan.name}[l]"),
                                                          simd=True)] + ["}"]
        loops_x = [for_line(v, s) for v, s in zip(xnames[:-1], xsizes[:-1])] + [for_line(f"{xi}_block", inner, step=xb)]
    else:
        row = [f"{t} acc_{scan.name} = {init};"] + along
        row += ["    " + s for s in "\n".join(_scan_body(k, xvars, rvars, f"acc_{scan.name}")).split("\n")] + ["}"]
        loops_x = [for_line(v, s) for v, s in zip(xnames, xsizes)]
    lines = []
    if parallel:
        lines.append(f"#pragma omp parallel for{' collapse(%d)' % len(loops_x) if len(loops_x) > 1 else ''}"
                     + _omp_if(total))
    for d, text in enumerate(loops_x):
        lines.append("    " * d + text + " {")
    lines += ["    " * len(loops_x) + line for line in "\n".join(row).split("\n")]
    return lines + ["    " * d + "}" for d in range(len(loops_x) - 1, -1, -1)]


# ---- §7.5 The wrapper, and the module ----

# appended to the prelude in every kernel file: the thread count the wrapper sets from stax.set_num_threads
_RUNTIME_CPP = """
template <class T> STAX_INLINE T stax_abs(T x) { return x < 0 ? -x : x; }
STAX_INLINE float stax_abs(float x) { return __builtin_fabsf(x); }
STAX_INLINE double stax_abs(double x) { return __builtin_fabs(x); }
STAX_INLINE float stax_pow(float a, float b) { return powf(a, b); }
STAX_INLINE double stax_pow(double a, double b) { return pow(a, b); }
template <class T> STAX_INLINE T stax_pow(T a, T b) {
    if (b < 0) {
        stax_set_error(STAX_ERR_NEG_POW);
        return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
    }
    T r = 1;
    for (; b; b >>= 1, a *= a) if (b & 1) r *= a;
    return r;
}
extern "C" void stax_set_num_threads(int n) { omp_set_num_threads(n); }
extern "C" int stax_take_errors(void) { return __atomic_exchange_n(&stax_errors, 0, __ATOMIC_RELAXED); }

"""


@dataclass
class CppModule:
    """The generated text: one C++ file (prelude + kernels), its cffi declarations and the wrapper.
    runtime.load_module compiles and imports it."""
    kind = "cpp"            # (a class attribute: the artifact cache's record says which loader)
    kernels: dict           # kernel name -> C++ source (launch order)
    wrapper: str            # Python source of `call(args)`
    cdefs: list
    schedule: object

    @property
    def source(self) -> str:
        return cache.prelude() + _RUNTIME_CPP + "\n".join(self.kernels.values())

    def __str__(self):
        return "\n".join(self.kernels.values()) + "\n\n# ---- wrapper ----\n" + self.wrapper


# errors eager raises that a kernel detects only while running: (bit of cpp_prelude.h's
# stax_errors, the exception the wrapper raises, as op_table's eager implementation does)
_TAKE_ERRORS = "int stax_take_errors(void);\nint64_t stax_index_error_info(int k);"


def _error_checks(errors, cdefs) -> list:
    """Wrapper lines after a launch that may have set error bits: take them, raise eager's error."""
    if not errors:
        return []
    if _TAKE_ERRORS not in cdefs:
        cdefs.append(_TAKE_ERRORS)
    return ["errors = kernels.stax_take_errors()"] + \
        [f"if errors & {bit}: raise {exc}" for bit, exc in sorted(errors)]


def _wrapper(sched, calls) -> str:
    """`call(args)`: check inputs, then per kernel allocate, launch, and `del` dead buffers (§7.5)."""
    outs = pyoutputs(sched.lowered)
    lines = wrapper_prologue(sched.lowered) + ["    launch_prologue()"]
    lines += wrapper_launches(sched, calls, "    ")
    lines.append(f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})")
    return "\n".join(lines) + "\n"


def _attention_call(e, low, kernels: dict, cdefs: list) -> list:
    """§9.10: an `omni_attn` node as the C++ attention template, reading its inputs in place."""
    from .attention_kernels import cpp_template, omni_extern_spec
    spec, operands = omni_extern_spec(e, low, "cpp")
    name = f"cpp_fused_attention_{len(kernels)}"
    kernels[name], cdef = cpp_template(spec, name)
    cdefs.append(cdef)
    blocks = [f"ptr({pyname(o)})" for o in operands[3:]] or ["NULL"] * 4
    args = [f"ptr({pyname(o)})" for o in operands[:3]] + blocks + [f"ptr({pyname(e.name)})", "NULL"]
    return [f"{pyname(e.name)} = empty({pyshape(e.layout.shape)}, {pydtype(e.dtype)})",
            f"kernels.{pyname(name)}({', '.join(args)})"]


def generate(sched) -> CppModule:
    """Print every fusion group as a C++ kernel (or a fallback call) and the wrapper around them."""
    low = sched.lowered
    kernels, cdefs, calls, allocated = {}, [], [], {b.name for b in low.inputs}
    for g in sched.groups:
        call, new = [], set()
        if g.kind == "extern" and g.nodes[0].op == "omni_attn":
            call += _attention_call(g.nodes[0], low, kernels, cdefs)        # §9.10: the C++ template
            new.add(g.nodes[0].name)
        elif g.kind == "extern":
            e = g.nodes[0]
            call += extern_call(e, low.unbacked, pydtype(e.dtype), low.checks)
            new.add(e.name)
        else:
            k = CppKernel(f"cpp_fused_{len(kernels)}", g, sched)
            loops = _pointwise_kernel(k) if g.kind == "pointwise" else \
                _scan_kernel(k) if g.kind == "scan" else _reduction_kernel(k)
            src, cdef, params, syms = k.finish(loops)
            kernels[k.name], _ = src, cdefs.append(cdef)
            for name in params:
                if name not in allocated:
                    b = low.buffer(name)
                    call.append(f"{pyname(name)} = empty({pyshape(b.layout.shape)}, {pydtype(b.dtype)})")
                    new.add(name)
            args = [f"ptr({pyname(p)})" for p in params] + [pyname(s) for s in syms]
            call.append(f"kernels.{pyname(k.name)}({', '.join(args)})")
            call += _error_checks(k.errors, cdefs)
            for n in g.nodes:          # a scatter's result is the memory it wrote into
                if isinstance(n, Scatter):
                    call.append(f"{pyname(n.name)} = {pyname(n.target)}")
                    new.add(n.name)
        allocated |= new
        calls.append((g.index, call, new))
    return CppModule(kernels, _wrapper(sched, calls), cdefs, sched)
