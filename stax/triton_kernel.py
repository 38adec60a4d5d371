"""§9.1–9.3 The Triton kernel writer: the state, printer and index/axis lines every GPU kernel shares.

Layer: back end (GPU), below the kernel forms. Imports the IR (`ir`), the schedule (`schedule`),
the printer skeleton (`printer`) and §9.6's limits on block sizes and grids (`autotune`); triton_reduction.py (§9.4–9.5) and
codegen_triton.py (§9.7) build on it. Nothing here imports triton: it prints text.

Consumes one fusion group of a `schedule.Schedule`; produces the lines of its kernel. Each kernel
is printed by running the IR's `inner_fn`s with `TritonPrinter`, an `ops` handler whose values are
block-level temporaries `tmpN` (CSE and the op table's `triton` spellings come from
`printer.Printer`): `ops.load` becomes a masked `tl.load`, the index
expression becomes the address offset verbatim (Listing 9.1). `finish` turns the lines into a whole
kernel: the `@triton_heuristics.<kind>(...)` decorator, the signature, renamed pointer parameters.

Where to look:
  - `Target`, `current_target` ........... §9.1 the device the code is generated for
  - `texpr` (`TritonIndexPrinter`), `literal`, `tl_dtype`  index expressions, constants and dtypes as Triton text
  - `_choose_tiling`, `Axis` ............. §9.3 1-D, 2-D or 3-D tiles, scored by coalesced bytes
  - `TritonPrinter` ...................... ops.* → tl.* (masks, `other=`, eviction policies, CSE)
  - `TritonKernel` ....................... a kernel's printing state (buffers, axes, masks, stores)
  - `setup_axes`, `axis_lines`, `var_lines`  program axes and their index/mask lines (Listing 9.1 (2))
  - `numel_lines` ........................ `xnumel = 512`; a symbolic or data-dependent numel stays the parameter
  - `pointwise_kernel` ................... Listings 9.2, 9.3
  - `finish` ............................. the whole kernel's text, its parameters and numels
"""
from __future__ import annotations

import math
import operator
import os
from dataclasses import dataclass

import re

import sympy

from .autotune import GRID_LIMIT, MAX_OUTER_BLOCK, MAX_XBLOCK, next_pow2
from .dtypes import bool_, int32
from .ir import Reduction, Scatter, index_vars, indirect_symbol, merge_dims, set_handler, simplify_index
from .printer import IndexPrinter, Printer
from .schedule import all_accesses, node_index, store_index
from .wrapper import scalars_in

# ---- §9.1 The device the code is generated for ----


@dataclass(frozen=True)
class Target:
    sm_count: int = 132          # an H200 unless a GPU is present or a target is given
    cc: int = 90


def current_target() -> Target:
    from . import cuda
    if cuda.is_available():
        p = cuda.get_device_properties()
        return Target(p.sm_count, p.cc[0] * 10 + p.cc[1])
    return Target()


# ---- §9.1 Types, literals, index expressions ----

_TL = {"float32": "tl.float32", "float64": "tl.float64", "float16": "tl.float16",
       "bfloat16": "tl.bfloat16", "int8": "tl.int8", "uint8": "tl.uint8", "int16": "tl.int16",
       "int32": "tl.int32", "int64": "tl.int64", "bool": "tl.int1",
       "float8_e4m3fn": "tl.float8e4nv", "float8_e5m2": "tl.float8e5"}
_SIG = {"float32": "*fp32", "float64": "*fp64", "float16": "*fp16", "bfloat16": "*bf16", "int8": "*i8",
        "uint8": "*u8", "int16": "*i16", "int32": "*i32", "int64": "*i64", "bool": "*i1",
        "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5"}


def tl_dtype(dtype) -> str:
    return _TL[dtype.name]


def pointer_type(dtype) -> str:
    """A pointer parameter's type in a kernel's signature (`*fp32`)."""
    return _SIG[dtype.name]


def literal(value, dtype) -> str:
    if dtype == bool_:
        return "True" if value else "False"
    if not dtype.is_floating_point:
        return repr(operator.index(int(value)))    # exact int: a subclass never prints itself
    v = float.__float__(float(value))              # exact float, likewise
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


class TritonIndexPrinter(IndexPrinter):
    """Index expressions as Triton: terms ordered by variable name (`r0_1 + 128*x0`)."""

    FLOORDIV = "//"

    def add(self, e) -> str:
        def key(t):
            syms = sorted(s.name for s in t.free_symbols)
            return (0, syms[0]) if syms else (1, "")
        terms = [self.expr(t) for t in sorted(e.args, key=key)]
        out = terms[0]
        for t in terms[1:]:
            out += f" + ({t})" if t.startswith("-") else f" + {t}"
        return out

    def modular(self, a, d, m) -> str:
        base = self.expr(a) if d == 1 else f"(({self.expr(a)}) // {self.paren(d)})"
        base = base if base.replace("_", "").isalnum() else f"({base})"
        return f"{base} % {self.paren(m)}"


_INDEX = TritonIndexPrinter()
texpr = _INDEX.expr


def debug_index_checks() -> bool:
    """STAX_DEBUG_INDEX=1: GPU kernels assert that indirect indices are in bounds (§9.1)."""
    return os.environ.get("STAX_DEBUG_INDEX", "") == "1"


# ---- §9.3 Tiling ----


@dataclass
class Axis:
    """One program axis: 'z', 'y', 'x' or 'r0_', covering loop dims (listed outer to inner)."""
    prefix: str
    dims: list                 # printed loop variables (sympy symbols), outer → inner
    sizes: list

    @property
    def numel(self):
        return sympy.sympify(sympy.prod(self.sizes)) if self.sizes else sympy.Integer(1)

    @property
    def block(self) -> str:
        return "R0_BLOCK" if self.prefix == "r0_" else f"{self.prefix.upper()}BLOCK"


MAX_TILING_AXES = 3          # the chapter's default limit on program axes (x, y, z)
GRID_LIMIT_YZ = GRID_LIMIT[1]   # CUDA's limit on the grid's y and z extents
MIN_OUTER_BLOCK = 16            # YBLOCK/ZBLOCK of the default configurations are ≥ this, so the
                                # default always launches (candidates that would not are dropped)


def _tiling_score(cuts, names, exprs, weights) -> int:
    """Bytes coalesced when the loop dims split into axes at `cuts`: an access is coalesced when it
    is contiguous along the innermost dim of some axis (Triton reorders a block's accesses along
    it), or constant along x, the axis a warp's threads are laid out on."""
    bounds = list(cuts) + [len(names)]
    inners = [names[b - 1] for b in bounds]
    score = 0
    for e, w in zip(exprs, weights):
        e = sympy.sympify(e)
        if e.coeff(inners[-1]) in (0, 1) or any(e.coeff(v) == 1 for v in inners[:-1]):
            score += w
    return score


def _choose_tiling(exprs, weights, names, sizes) -> tuple:
    """§9.3: where the loop dims split into program axes: () is one flat x axis, (c,) is
    y = dims[:c] × x = dims[c:], (c1, c2) is z × y × x. Every split of at most MAX_TILING_AXES
    axes is scored by the bytes it coalesces; the best wins, fewer axes on a tie."""
    n = len(names)
    if n == 0:                     # a 0-d or one-element output: one x axis without dims
        return ()
    splits = [()] + [(c,) for c in range(1, n)]
    if MAX_TILING_AXES >= 3:
        splits += [(a, b) for a in range(1, n) for b in range(a + 1, n)]
    best, best_score = (), _tiling_score((), names, exprs, weights)
    for cuts in splits[1:]:
        outer = [sympy.sympify(sympy.prod(sizes[lo:hi])) for lo, hi in zip((0,) + cuts, cuts)]
        if all(o.is_Integer for o in outer) and any(int(o) > GRID_LIMIT_YZ * MIN_OUTER_BLOCK for o in outer):
            continue                   # the y/z grid extents could not be launched
        # (a symbolic y or z extent (§10.3) launches at any size: its blocks fold, `fold_y`)
        score = _tiling_score(cuts, names, exprs, weights)
        if score > best_score:
            best, best_score = cuts, score
    return best


# ---- §9.1 The ops handler that prints Triton ----

CACHE_LINE = 128                 # bytes of an L2 cache line (NVIDIA GPUs since Fermi)


def _rows_start_on_lines(expr, dtype, rvars) -> bool:
    """Whether every row of a load starts on a cache line: each per-row coefficient, in bytes, is a
    multiple of CACHE_LINE (then no two rows, hence no two programs, share a line)."""
    expr = sympy.sympify(expr)
    for term in [expr.subs({s: 0 for s in expr.free_symbols})] + [
            expr.coeff(s) for s in expr.free_symbols if s not in rvars]:
        if not term.is_Integer or (int(term) * dtype.itemsize) % CACHE_LINE:
            return False
    return True


def _columns_start_on_lines(expr, dtype, k) -> bool:
    """The OUTER form's `_rows_start_on_lines`: the load is contiguous along the innermost output
    dim (coefficient 1), whose extent and every other coefficient, in bytes, are multiples of
    CACHE_LINE (then blocks of columns share lines only where XBLOCK is under a line)."""
    expr = sympy.sympify(expr)
    xaxis = k.block_axes[-1]
    if not xaxis.dims or expr.coeff(xaxis.dims[-1]) != 1:
        return False
    extent = sympy.sympify(xaxis.sizes[-1]).subs(k.lowered.hints or {})
    if not extent.is_Integer or (int(extent) * dtype.itemsize) % CACHE_LINE:
        return False
    return _rows_start_on_lines(expr, dtype, {xaxis.dims[-1]})    # every other coefficient on a line


class TritonPrinter(Printer):
    """ops handler: each call appends `tmpN = <expr>` (deduplicated) and returns a Var.

    Generic ops are spelled from the op table's `triton` field (printer.Printer); the methods here
    are Triton's own forms (masked loads, block-shaped constants, NaN-propagating maximum, ...)."""

    LANGUAGE = "triton"

    def __init__(self, kernel):
        super().__init__()
        self.k = kernel
        self.masks = []             # extra masks of the ops.masked bodies being printed
        self.masked_cse = {}        # mask -> what earlier bodies under it computed (its lines are above)

    def new_name(self) -> str:
        return self.k.new_tmp()

    def assignment(self, name: str, expr: str) -> str:
        return f"{name} = {expr}"

    def _shape1(self) -> str:
        return "[" + ", ".join(["1"] * len(self.k.block_axes or self.k.axes)) + "]"

    def _one_shape(self) -> str:
        """The block a one-element load fills: in a reduction kernel [XBLOCK, 1], over the rows
        only, since it may meet a reduced value, and a store through an [XBLOCK, 1] pointer (a 0-d
        output) cannot take an [XBLOCK, R0_BLOCK] value ([1, XBLOCK] in the OUTER form's block);
        elsewhere the whole block."""
        return self.k.row_shape() if self.k.reduction else self.k.block_shape()

    def load(self, name, index):
        local = self.k.locals.get(name)
        if local is not None:
            return local
        dtype = self.k.dtype_of(name)
        ptr = self.k.arg(name, read=True)
        expr = self.k.final(index)
        mask = self.k.mask_for(expr, extra=self.masks)
        extras = ""
        if self.k.reduction:
            # data each row reads once streams through (evict_first); data every row reads again,
            # a row value or a per-column weight such as layer_norm's w and b, stays in L2
            # (a looped kernel reads the row again in a later pass: keep it in L2 until that last pass)
            uses_r = any(s in self.k.rvars_printed for s in expr.free_symbols)
            uses_x = any(s not in self.k.rvars_printed for s in expr.free_symbols)
            if not (uses_r and uses_x) or self.k.row_read_again:
                extras = ", eviction_policy='evict_last'"
            else:
                # (symbolic strides, §10.3: decided at the hint, as the launch configuration is)
                # §9.4 OUTER: the columns stream through too, and what stays in L2 is what is
                # written meanwhile (a split's partials, read back by its combine: var0's pair of
                # kernels 41.7 -> 39.1 us on the H200 with the input evict_first)
                at_hint = expr.subs(self.k.lowered.hints or {})
                if (self.k.outer_form() and _columns_start_on_lines(at_hint, dtype, self.k)) or \
                        _rows_start_on_lines(at_hint, dtype, self.k.rvars_printed):
                    extras = ", eviction_policy='evict_first'"
                # else no hint: a row that starts inside a cache line shares that line with the row
                # before it, which another program reads; evicted first, the line is read twice
                # (softmax over rows of 1000 on the H200: 0.94 of the floor with evict_first, 0.96
                # without; Inductor prints no hint there either)
        offset = texpr(expr)
        if not expr.free_symbols and mask:
            # one element under a block mask (ops.masked): Triton wants a block of pointers for a
            # block mask, so the offset is a block of equal offsets (as for a one-element store)
            # (in a reduction kernel [XBLOCK, 1], as below: tl.load broadcasts it against a row mask)
            offset = f"tl.full({self._one_shape()}, {offset}, {'tl.int64' if self.k.index64 else 'tl.int32'})"
        if mask:
            extras += f", other={'0.0' if dtype.is_floating_point else '0'}" if (self.k.reduction or self.masks) else ""
            text = f"tl.load({ptr} + ({offset}), {mask}{extras})"
        else:
            text = f"tl.load({ptr} + ({offset}){extras})"
        var = self.emit(text, dtype)
        if not expr.free_symbols and not mask:        # one element, broadcast over the block
            var = self.emit(f"tl.broadcast_to({var}, {self._one_shape()})", dtype)
        return var

    def constant(self, value, dtype):
        var = self.emit(f"tl.full({self._shape1()}, {literal(value, dtype)}, {tl_dtype(dtype)})", dtype)
        self.k.constants[var.name] = value
        return var

    def index_expr(self, expr, dtype):
        expr = self.k.final(expr)
        if not expr.free_symbols:
            return self.constant(int(expr), dtype)
        return self.emit(f"({texpr(expr)}).to({tl_dtype(dtype)})", dtype)

    def to_dtype(self, x, dtype):
        return self.emit(f"{x}.to({tl_dtype(dtype)})", dtype)

    def where(self, c, a, b):
        return self.emit(f"tl.where({c}, {a}, {b})", a.dtype)

    def indirect_indexing(self, value, size, check=True, wrap_neg=True, where=""):
        """A loaded integer as an index: wrapped when negative; checked only in debug mode
        (STAX_DEBUG_INDEX=1: a `tl.device_assert`, compiled with Triton's debug option). Otherwise
        an out-of-range index is not checked on the GPU: the access is undefined (it may read
        other memory or fault), as in Triton and Inductor without their debug options."""
        n = texpr(self.k.final(size))
        v = self.emit(f"tl.where({value} < 0, {value} + {n}, {value})", value.dtype) if wrap_neg else value
        if check and debug_index_checks():
            masks = [f"{a.prefix}mask" for a in self.k.axes if f"{a.prefix}mask" not in self.k.always_true
                     and not (self.k.row_node and a.prefix.startswith("r"))]
            cond = f"(0 <= {v}) & ({v} < {n})"
            if masks + self.masks:
                cond = f"({cond}) | ~({' & '.join(masks + self.masks)})"
            self.lines.append(f'tl.device_assert({cond}, "index out of bounds: 0 <= {v} < {n}")')
        sym = indirect_symbol(v.name)
        self.k.indirect.add(sym)
        return sym

    def masked(self, mask, body, other):
        """Loads inside `body` carry the extra mask; lanes outside it take `other`. A later body
        under the same mask (the deviations of a ragged piece after its sum) reuses what an earlier
        one computed, its loads included, as an unmasked body would."""
        self.masks.append(str(mask))
        kept = self.masked_cse.setdefault(tuple(self.masks), {})
        saved, self.cse = self.cse, {**self.cse, **kept}
        try:
            result = body()
        finally:
            self.masks.pop()
            kept.update({key: v for key, v in self.cse.items() if key not in saved})
            self.cse = saved
        return self.emit(f"tl.where({mask}, {result}, {other})", result.dtype)

    def neg(self, x):
        return self.emit(f"-{x}", x.dtype)

    def relu(self, x):
        zero = self.emit(f"tl.full({self._shape1()}, 0, tl.int32)", int32)
        return self.emit(f"tl.maximum({zero}, {x}, tl.PropagateNan.ALL)", x.dtype) if x.dtype.is_floating_point \
            else self.emit(f"tl.maximum({zero}, {x})", x.dtype)

    def reciprocal(self, x):
        one = self.constant(1, x.dtype)
        return self.emit(f"({one} / {x})", x.dtype)

    def isnan(self, x):
        return self.emit(f"({x} != {x})", bool_)

    def isinf(self, x):
        return self.emit(f"(tl.abs({x}) == float(\"inf\"))" if x.dtype.is_floating_point else f"({x} != {x})", bool_)

    def logical_not(self, x):
        return self.emit(f"({x} == 0)", bool_)

    def bitwise_not(self, x):
        return self.emit(f"({x} == 0)" if x.dtype == bool_ else f"~{x}", x.dtype)

    def maximum(self, a, b):
        return self.emit(f"triton_helpers.maximum({a}, {b})", a.dtype)

    def minimum(self, a, b):
        return self.emit(f"triton_helpers.minimum({a}, {b})", a.dtype)

    def floordiv(self, a, b):
        fn = "floordiv_float" if a.dtype.is_floating_point else "floordiv"
        return self.emit(f"triton_helpers.{fn}({a}, {b})", a.dtype)

    def remainder(self, a, b):
        fn = "remainder_float" if a.dtype.is_floating_point else "remainder"
        return self.emit(f"triton_helpers.{fn}({a}, {b})", a.dtype)

    def pow(self, a, b):
        if a.dtype.is_floating_point:
            c = self.k.constants.get(b.name)
            if c in (2, 3):         # x ** 2 and x ** 3 are products, as in the C++ back end
                return self.emit(f"({a} * {a})" if c == 2 else f"({a} * {a} * {a})", a.dtype)
            return self.emit(f"libdevice.pow({a}, {b})", a.dtype)
        return self.emit(f"triton_helpers.ipow({a}, {b})", a.dtype)


# ---- §9.1–9.3 A kernel being printed: its state, program axes and index lines ----


class TritonKernel:
    """The printing state of one Triton kernel: buffers read and written (renamed to in_ptrN /
    out_ptrN by `finish`), values computed earlier (`locals`), program axes and always-true masks.
    (The launch-time object a kernel's text turns into is triton_heuristics.CachingAutotuner.)"""

    def __init__(self, name_index, group, sched):
        self.index_no, self.group, self.sched = name_index, group, sched
        self.lowered = sched.lowered
        self.reads, self.writes, self.locals, self.constants = {}, {}, {}, {}
        self.ranges, self.steps, self.tmp = {}, [], 0
        self.reduction = group.kind == "reduction"
        self.target = {w: i for i, w in sched.lowered.mutations}
        self.rvars_printed = set()
        self.indirect = set()                         # symbols bound by ops.indirect_indexing
        self.scatter_index = {}                       # ir.Scatter name -> the index it stores at
        self.always_true = set()                      # masks known true (set by the kernel forms)
        self.index64 = _needs_int64(sched.lowered)   # an index may pass 2^31: compute indices in int64
        self.row_read_again = False                   # a later looped pass reads the row again
        self.stream_stores = False                    # this pass's row stores are evict_first
        self.force_form = None                        # 'red': print the looped form of a group
        self.other_form = None                        # that has a persistent one too (§9.4)
        self.r0_block = None                          # a persistent row's R0_BLOCK (its size hint)
        self.block_axes = None                        # the block's dims when not `axes` (OUTER: r0_, x)
        self.row_node = False                         # printing a per-row node of a reduction kernel
        self.workspace = {}                           # name -> dtype of scratch a form adds (counters)
        self.grid_y = False                           # y: one program per index, no YBLOCK (grid_y_lines)
        # a tiled kernel whose y (or z) extent is symbolic (§10.3): its (z, y) blocks are numbered
        # along program_id(1) up to CUDA's 65535, the rest folded onto program_id(2) (the
        # decorator's `meta={'fold_y': 65535}`, read by autotune.grid_for), so any size launches
        self.fold_y = False
        # a row of symbolic length whose kernel is compiled twice (§10.3): with the constexpr
        # EVEN_R0 true for launches whose row is a whole number of R0_BLOCK steps (the row-end
        # mask constant true, as in the static kernel), false for any other row (the decorator's
        # `meta={'even_r0': 1}`; the launcher sets EVEN_R0 per call, as Triton specializes sizes)
        self.even_r0 = False
        self.xunroll = False                          # XUNROLL: two blocks a program (`_two_blocks`)

    # -- naming and buffers --

    def outer_form(self) -> bool:
        """Printed in §9.4's OUTER form ([R0_BLOCK, XBLOCK] blocks, coalesced along x)."""
        return bool(self.block_axes) and self.block_axes[0].prefix == "r0_"

    def new_tmp(self) -> str:
        self.tmp += 1
        return f"tmp{self.tmp - 1}"

    def dtype_of(self, name):
        return self.workspace[name] if name in self.workspace else self.lowered.buffer(name).dtype

    def arg(self, name, read=False):
        (self.reads if read else self.writes)[name] = True
        return f"@{name}@"                     # renamed to in_ptrN / out_ptrN at the end

    def final(self, expr):
        expr = simplify_index(expr, self.ranges)
        for step in self.steps:
            expr = sympy.expand(expr.subs(step, simultaneous=True))
        return expr

    # -- blocks and masks --
    def block_shape(self) -> str:
        return "[" + ", ".join(a.block for a in (self.block_axes or self.axes)) + "]"

    def row_shape(self) -> str:
        """The block with its reduction dims 1: one value per row ([XBLOCK, 1]; OUTER [1, XBLOCK])."""
        return "[" + ", ".join("1" if a.prefix.startswith("r") else a.block
                               for a in (self.block_axes or self.axes)) + "]"

    def mask_for(self, expr, extra=()) -> str:
        used = {a.prefix for a in self.axes for s in expr.free_symbols if s in a.dims}
        if expr.free_symbols & self.indirect:
            # an index loaded from memory is garbage in masked-off lanes: every axis' mask (but a
            # row statement of a reduction kernel, whose values are one per row, has no r lanes)
            used = {a.prefix for a in self.axes if not (self.row_node and a.prefix.startswith("r"))}
        masks = [f"{p}mask" for p in sorted(used) if f"{p}mask" not in self.always_true]
        return " & ".join(masks + list(extra))

    def scatter_store(self, node, value) -> str:
        """An ir.Scatter's write at its loaded indices: `tl.atomic_add` when it accumulates (every
        duplicate adds), else `tl.store` (of duplicates, one unspecified write wins)."""
        expr = self.final(self.scatter_index[node.name])
        self.arg(node.target, read=True)    # in_out: what it leaves alone is kept (and the
        ptr, mask = self.arg(node.target), self.mask_for(expr)   # autotuner restores it, §9.6)
        fn = "tl.atomic_add" if node.mode == "atomic_add" else "tl.store"
        extra = ", sem='relaxed'" if node.mode == "atomic_add" else ""
        return f"{fn}({ptr} + ({texpr(expr)}), {value}{', ' + mask if mask else ''}{extra})"

    def store(self, node, value, xvars, rvars) -> str:
        if isinstance(node, Scatter):
            return self.scatter_store(node, value)
        expr = self.final(store_index(node, xvars, rvars))
        ptr = self.arg(self.target.get(node.name, node.name))
        mask = self.mask_for(expr)
        offset = texpr(expr)
        if not expr.free_symbols:
            # one element (a full reduction, a 0-d output): a block of equal offsets, one lane writes
            shape = self.row_shape() if self.reduction else self.block_shape()
            offset, mask = f"tl.full({shape}, {offset}, tl.int32)", "xmask"
        stream = self.stream_stores and any(s in self.rvars_printed for s in expr.free_symbols)
        return (f"tl.store({ptr} + ({offset}), {value}{', ' + mask if mask else ''}"
                + (", eviction_policy='evict_first')" if stream else ")"))

    def body(self, node, xvars, rvars, printer):
        idx, ridx = node_index(node, xvars, rvars)
        self.row_node = not isinstance(node, Reduction) and not (set(rvars) & {
            s for i in idx for s in sympy.sympify(i).free_symbols})
        with set_handler(printer):
            value = node.inner_fn(idx, ridx) if isinstance(node, Reduction) else node.inner_fn(idx)
            if isinstance(node, Scatter):   # where it writes: its loaded indices
                self.scatter_index[node.name] = node.layout.index(node.output_indexer(idx))
        return value


def setup_axes(k: TritonKernel, xsizes, rsizes, tiling_allowed=True, x_order=None, y_split=None):
    """Merge loop dims (Prop. 6.3), then map the printed loops onto program axes. `x_order(sizes,
    exprs, weights)`, if given, permutes the merged output dims (the OUTER form puts the one its
    loads are contiguous along innermost); `y_split(sizes)`, if given and true for the merged
    (ordered) output sizes, puts the outermost of them on a y axis of its own (`grid_y_lines`)."""
    xvars, rvars = index_vars("x", len(xsizes)), index_vars("r", len(rsizes))
    k.ranges = {**dict(zip(xvars, xsizes)), **dict(zip(rvars, rsizes))}
    accesses = all_accesses(k.group.nodes, xvars, rvars)
    xs, xm, xsteps, exprs = merge_dims(xsizes, xvars, [e for e, _ in accesses], k.ranges)
    rs, rm, rsteps, exprs = merge_dims(rsizes, rvars, exprs, {})
    k.exprs = exprs
    weights = [0 if name is None or name in k.sched.kernel_local else k.dtype_of(name).itemsize
               for _, name in accesses]                     # bytes each access moves per element
    cuts = _choose_tiling(exprs, weights, xm, xs) if (tiling_allowed and not rsizes) else ()
    if x_order is not None:
        perm = x_order(xm, exprs, weights)
        xm, xs = [xm[i] for i in perm], [xs[i] for i in perm]
    if y_split is not None and len(xm) >= 2 and not cuts and y_split(xs):
        cuts = (1,)
        k.grid_y = True
    elif cuts and not sympy.sympify(sympy.prod(xs[:cuts[-1]])).is_Integer:
        k.fold_y = True
    # name printed variables by position: z dims, y dims, x dims, then r dims (Listings 9.1, 9.2)
    bounds = (0,) + cuts + (len(xm),)
    prefixes = ["z", "y", "x"][3 - len(bounds) + 1:]
    groups = [(p, xm[lo:hi], xs[lo:hi]) for p, lo, hi in zip(prefixes, bounds, bounds[1:])]
    if rsizes is not None and k.reduction:
        groups.append(("r0_", rm, rs))
    rename, axes, pos = {}, [], 0
    for prefix, olds, sizes in groups:
        names = []
        for old in olds:
            sym = sympy.Symbol(f"{prefix if prefix != 'r0_' else 'r0_'}{pos}", integer=True, nonnegative=True)
            rename[old] = sym
            names.append(sym)
            pos += 1
        axes.append(Axis(prefix, names, list(sizes)))
    k.steps = xsteps + rsteps + [rename]
    k.axes = axes
    k.raxis = axes[-1] if k.reduction else None
    if k.raxis is not None:
        k.rvars_printed = set(k.raxis.dims)
    k.exprs = [sympy.expand(sympy.sympify(e).subs(rename, simultaneous=True)) for e in exprs]
    return xvars, rvars


def axis_lines(k, axis, grid_dim, per_block=None, looped=False, whole=False) -> list:
    """The offset, index and mask lines of one axis (Listing 9.1's part (2)): a program axis reads
    `tl.program_id(grid_dim)`; the r0_ axis is the whole row (`per_block`, a persistent kernel) or
    one R0_BLOCK step of the loop (`looped`; `whole`: a step known to lie inside the row, its
    mask constant true). `var_lines` defines the loop variables from them."""
    order = k.block_axes or k.axes                  # the OUTER form's block is [R0_BLOCK, XBLOCK]
    p, n, i = axis.prefix, len(order), order.index(axis)
    sl = "[" + ", ".join(":" if j == i else "None" for j in range(n)) + "]"    # [:, None] for y of y × x
    lines = []
    if p == "r0_":
        true = f"tl.full([R0_BLOCK], True, tl.int1){sl}"
        if per_block is not None:
            lines.append(f"r0_index = tl.arange(0, R0_BLOCK){sl}" + (".to(tl.int64)" if k.index64 else ""))
            lines.append("r0_offset = 0")
            if "r0_mask" in k.always_true:
                lines.append(f"r0_mask = {true}")
            elif k.even_r0:         # (a symbolic row: the launch knows whether it is R0_BLOCK long)
                lines.append(f"r0_mask = {true} if EVEN_R0 else r0_index < r0_numel")
            else:
                lines.append("r0_mask = r0_index < r0_numel")
            lines += ["roffset = r0_offset", "rindex = r0_index"]
        elif looped:
            mask = true if whole else "r0_index < r0_numel"
            lines += ["r0_index = r0_offset + r0_base", f"r0_mask = {mask}", "roffset = r0_offset", "rindex = r0_index"]
    else:
        pid = f"tl.program_id({grid_dim})" + (".to(tl.int64)" if k.index64 else "")
        if k.fold_y and p in ("y", "z"):
            pid, lines = _folded_block(k, p)
        lines.append(f"{p}offset = {pid} * {axis.block}")
        lines.append(f"{p}index = {p}offset + tl.arange(0, {axis.block}){sl}")
        if f"{p}mask" in k.always_true:
            lines.append(f"{p}mask = tl.full([{axis.block}], True, tl.int1){sl}")
        else:
            lines.append(f"{p}mask = {p}index < {p}numel")
    return lines


def _folded_block(k, p: str) -> tuple:
    """(the block number along `p`, lines before it) of a `fold_y` kernel: program (1, 2) is
    block zy = pid1 + 65535·pid2 of the (z, y) blocks, y the faster; zy past the last block has
    zoffset past znumel (masked)."""
    cast = ".to(tl.int64)" if k.index64 else ""
    three = any(a.prefix == "z" for a in k.axes)
    lines = []
    if p == "z" or not three:       # (the first of the folded axes printed)
        lines.append(f"zy = tl.program_id(1){cast} + tl.program_id(2){cast} * {GRID_LIMIT_YZ}")
        if three:
            lines.append("y_blocks = (ynumel + YBLOCK - 1) // YBLOCK")
    block = {"y": "(zy % y_blocks)" if three else "zy", "z": "(zy // y_blocks)"}[p]
    return block, lines


def grid_y_lines(k) -> list:
    """A y axis of one program per index (`k.grid_y`: the OUTER form's outer output dim under
    symbolic sizes, §10.3, e.g. var's piece): no run-time `// s` per element recovers it from a
    flat index. Past CUDA's 65535 along y the grid folds the rest onto z (the decorator's
    `meta={'grid_y': 65535}`, read by triton_heuristics.grid_for); ymask drops the programs past
    the end."""
    pid = (lambda d: f"tl.program_id({d})" + (".to(tl.int64)" if k.index64 else ""))
    shape = "[" + ", ".join("1" for _ in (k.block_axes or k.axes)) + "]"
    # (a block of one, not a scalar: Triton 3.9's interpreter ands a scalar mask with a block
    # mask into int32, which its loads refuse; compiled, the two are the same code)
    return [f"yindex = tl.full({shape}, {pid(2)} * {GRID_LIMIT_YZ} + {pid(1)}, "
            f"{'tl.int64' if k.index64 else 'tl.int32'})", "ymask = yindex < ynumel"]


def var_lines(axis) -> list:
    """x0 = xindex, or for a flattened axis x0 = xindex % 512, x1 = xindex // 512 (inner first)."""
    if not axis.dims:
        return []
    if len(axis.dims) == 1:
        return [f"{axis.dims[0]} = {axis.prefix}index"]
    lines, div = [], sympy.Integer(1)
    for sym, size in zip(reversed(axis.dims), reversed(axis.sizes)):
        base = f"{axis.prefix}index" if div == 1 else f"({axis.prefix}index // {_INDEX.paren(div)})"
        last = sym == axis.dims[0]
        lines.append(f"{sym} = {base}" if last else f"{sym} = {base} % {_INDEX.paren(size)}")
        div = div * size
    return lines


def _needs_int64(lowered) -> bool:
    """True when some buffer of the graph spans 2^31 elements or more (int32 indices would wrap).
    With symbolic sizes, False when the artifact's guards keep every tensor below that
    (`lowered.index32`, ShapeEnv.index32); the buffers lowering adds (split partials) are no
    larger than the tensors they reduce."""
    if lowered.index32:
        return False
    for b in lowered.inputs + lowered.buffers:
        extent = sympy.sympify(b.layout.offset) + 1
        for size, stride in zip(b.layout.shape, b.layout.stride):
            extent += (sympy.sympify(size) - 1) * abs(sympy.sympify(stride))
        numel = sympy.prod([sympy.sympify(s) for s in b.layout.shape]) if b.layout.shape else 1
        for n in (extent, sympy.sympify(numel)):
            if not n.is_Integer or int(n) >= 2**31:
                return True
    return False


# ---- §9.2–9.3 Pointwise kernels ----


def pointwise_kernel(k: TritonKernel) -> tuple:
    """A pointwise group's kernel body (Listings 9.2, 9.3): ('poi', lines, no ReductionHint)."""
    g = k.group
    xvars, _ = setup_axes(k, g.ranges, [])
    # a mask is always true when its numel is a multiple of every block size a configuration can
    # take (the candidates and the max-autotune space: powers of two up to these)
    k.always_true = {f"{a.prefix}mask" for a in k.axes
                     if a.numel.is_Integer and int(a.numel) % (MAX_XBLOCK if a.prefix == "x" else MAX_OUTER_BLOCK) == 0}
    p = TritonPrinter(k)
    stores = []
    for node in g.nodes:
        value = k.body(node, xvars, [], p)
        k.locals[node.name] = value
        if node.name not in k.sched.kernel_local:
            stores.append(k.store(node, value, xvars, []))
    head = numel_lines(k.axes)
    grid_dims = {a.prefix: i for i, a in enumerate(reversed(k.axes))}   # x is program_id(0)
    for a in k.axes:
        head += axis_lines(k, a, grid_dims[a.prefix])
    for a in reversed(k.axes):
        head += var_lines(a)
    if _unrollable(k, p.lines):
        return "poi", _two_blocks(k, head, p.lines + stores), None
    return "poi", head + p.lines + stores, None


# ---- §9.6 Two blocks a program, for math as long as the memory time ----

_LIBM = re.compile(r"\blibdevice\.(erf|erfc|exp|exp2|expm1|log|log1p|log2|sin|cos|tan|tanh|asin|acos|atan|"
                   r"sinh|cosh|asinh|acosh|atanh|pow|lgamma|tgamma|sqrt|rsqrt)\(")
_BLOCK_NAMES = re.compile(r"\b(tmp\d+|xindex|xmask|x\d+)\b")
# below this many elements (at the hint) Alg. 9.1 does not measure a kernel (SMALL_KERNEL_MS), so a
# second form would never run: such kernels keep one block a program (Listing 9.3's GELU backward)
UNROLL_MIN_NUMEL = 1 << 20


def _second_block_inside(numel) -> bool:
    """Does every program's second block lie inside the axis, for every XBLOCK a config takes?"""
    return numel.is_Integer and int(numel) % (2 * MAX_XBLOCK) == 0


def _unrollable(k, body: list) -> bool:
    """A flat (x-only) pointwise kernel that calls libdevice's math and whose loads read from the
    index alone (no loaded value in an address): it may run two blocks a program (XUNROLL)."""
    if len(k.axes) != 1 or k.indirect or k.scatter_index or k.fold_y or k.index64:
        return False
    numel = k.axes[0].numel
    at_hint = sympy.sympify(numel).subs(k.sched.lowered.hints or {})
    if not (at_hint.is_Integer and int(at_hint) >= UNROLL_MIN_NUMEL):
        return False
    if "xmask" in k.always_true and not _second_block_inside(numel):
        return False        # (the lines carry no mask, and the second block may pass the end)
    if any(line.startswith(" ") for line in body):
        return False
    loads = [line for line in body if "tl.load(" in line]
    return (any(_LIBM.search(line) for line in body) and bool(loads)
            and not any(re.search(r"\btmp\d+\b", line.split("=", 1)[1]) for line in loads))


def _two_blocks(k, head: list, body: list) -> list:
    """With XUNROLL == 2 (a launch configuration Alg. 9.1 measures) a program covers 2·XBLOCK
    elements: both blocks' loads first, then each block's math and its store. The H200 ran the
    exact GELU over 64M floats at 0.98 of a copy's speed this way, against 0.95 with one block a
    program and 0.93 with one block of 2·XBLOCK (whose stores all wait for all of its math:
    bench/RESULTS.md, 2026-12-03). The second block's names end in `_1`."""
    k.xunroll = True
    axis = k.axes[0]
    whole = _second_block_inside(axis.numel)
    second = lambda line: _BLOCK_NAMES.sub(lambda m: m.group(1) + "_1", line)     # noqa: E731
    head = [line.replace("xoffset = tl.program_id(0) * XBLOCK", "xoffset = tl.program_id(0) * (XBLOCK * XUNROLL)")
            for line in head]
    loads = [line for line in body if "tl.load(" in line]
    rest = [line for line in body if "tl.load(" not in line]
    index = ["xindex_1 = xindex + XBLOCK",
             "xmask_1 = " + ("tl.full([XBLOCK], True, tl.int1)[:]" if whole else "xindex_1 < xnumel")]
    index += [second(line) for line in var_lines(axis)]
    return (head + loads + ["if XUNROLL == 2:"] + ["    " + line for line in index + [second(x) for x in loads]]
            + rest + ["if XUNROLL == 2:"] + ["    " + second(line) for line in rest])


def numel_lines(axes) -> list:
    """`xnumel = 128` at the top of the body (Listing 9.2's form) where a size is a number; a
    symbolic size (§10.3) is only the parameter the wrapper passes, bound from the arguments."""
    return [f"{a.prefix}numel = {texpr(a.numel)}" for a in axes if sympy.sympify(a.numel).is_Integer]


# ---- §9.1 Printing a whole kernel ----

_SIZE_SYMBOL = re.compile(r"(?<![A-Za-z0-9_])([su][0-9]+)(?![A-Za-z0-9_])")   # u: §10.5



def _size_hint(k: TritonKernel, form: str, axis) -> int:
    """The decorator's size hint of an axis: its numel rounded up to a power of two; a persistent
    row's R0_BLOCK (the longest row the kernel handles: MultiKernel dispatches on it); 8192 for
    other symbolic sizes."""
    if form == "per" and axis.prefix == "r0_" and k.r0_block is not None:
        return k.r0_block
    return next_pow2(int(axis.numel)) if axis.numel.is_Integer else 8192


def finish(k: TritonKernel, form: str, lines: list, hint, meta=None) -> tuple:
    """The kernel's text around its body `lines`: the comment naming its origins, the
    `@triton_heuristics.<kind>(...)` decorator, the signature with pointer parameters renamed to
    in_ptrN / out_ptrN / in_out_ptrN. Returns (name, source, the buffers passed, in the order of the
    parameters, the numel of each axis as text). `meta`: launch facts beyond the numels (the
    decorator's `meta=`, which the grid reads: a one-kernel split's `splits`)."""
    name = f"triton_{form}_fused_{k.index_no}"
    order = list(dict.fromkeys(list(k.reads) + list(k.writes)))
    in_out = [n for n in order if n in k.reads and n in k.writes]
    ins = [n for n in order if n in k.reads and n not in k.writes]
    outs = [n for n in order if n in k.writes and n not in k.reads]
    rename = {}
    rename.update({n: f"in_out_ptr{i}" for i, n in enumerate(in_out)})
    rename.update({n: f"in_ptr{i}" for i, n in enumerate(ins)})
    rename.update({n: f"out_ptr{i}" for i, n in enumerate(outs)})
    params = in_out + ins + outs
    text = "\n".join(lines)
    for n, pname in rename.items():
        text = text.replace(f"@{n}@", pname)
    numels = [f"{a.prefix}numel" for a in k.axes]
    syms = sorted(set(_SIZE_SYMBOL.findall(text)), key=str)     # §10.3: sizes in indices
    floats = scalars_in(k.lowered, text)                        # §10.4: run-time float arguments
    blocks = [a.block for a in k.axes if not (form == "per" and a.prefix == "r0_")
              and not (k.grid_y and a.prefix == "y")]
    meta = {**(meta or {}), "grid_y": GRID_LIMIT_YZ} if k.grid_y else meta      # (grid_y_lines)
    meta = {**(meta or {}), "fold_y": GRID_LIMIT_YZ} if k.fold_y else meta      # (axis_lines)
    meta = {**(meta or {}), "even_r0": 1} if k.even_r0 else meta                 # (axis_lines)
    meta = {**(meta or {}), "xunroll": 1} if k.xunroll else meta                 # (_two_blocks)
    blocks += ["EVEN_R0"] if k.even_r0 else []
    blocks += ["XUNROLL"] if k.xunroll else []
    sig = [rename[n] for n in params] + syms + floats + numels + [f"{b} : tl.constexpr" for b in blocks]
    size_hints = ", ".join(f"'{a.prefix}': {_size_hint(k, form, a)}" for a in k.axes)
    signature = {rename[n]: _SIG[k.dtype_of(k.target.get(n, n)).name] for n in params}
    # (in the parameters' order: the launcher packs the arguments by it)
    signature.update({nm: "i64" if k.index64 else "i32" for nm in syms})
    signature.update({nm: "fp64" for nm in floats})
    signature.update({nm: "i64" if k.index64 else "i32" for nm in numels})
    kind = {"poi": "pointwise", "per": "persistent_reduction", "red": "reduction"}[form]
    extra = f", reduction_hint=ReductionHint.{hint}" if hint else (
        ", tile_hint=TileHint.DEFAULT" if len(k.axes) >= 2 else "")
    extra += f", meta={meta!r}" if meta else ""
    origins = ", ".join(dict.fromkeys(k.group.origins))
    src = (f"# {name}: computes {origins}\n"
           f"@triton_heuristics.{kind}(size_hints={{{size_hints}}}{extra}, signature={signature!r})\n"
           f"@triton.jit\n"
           f"def {name}({', '.join(sig)}):\n"
           + "\n".join("    " + line if line else line for line in text.split("\n")) + "\n")
    return name, src, params, syms + floats + [texpr(a.numel) for a in k.axes]
