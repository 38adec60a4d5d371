"""The op table: every primitive op of Stax, declared once.

Layer: the bottom of the stack, next to dtypes.py (it imports only numpy, math, dtypes.py and conv_numpy.py).
Every other layer reads it: tensor.py (which ops are views or factories, the eager numpy
implementation the choke point runs), tensor_ops.py (each pointwise op's dtype rule), lower.py
(§6: which ops lower as pointwise math, which as views, which stay fallback kernels), and the
printers of §8/§9 (the C++ and Triton spelling of the generic pointwise ops).

An entry is an `OpDef`; `OPS` maps the op's name (the name a captured graph node carries) to it.
Nothing here is computed from anything else: read it top to bottom.

Where to look:
  - the fields .............................. OpDef
  - unary / binary pointwise math ............ "neg" ... "bitwise_xor"
  - the other ops ............................ where, to_dtype, clone, views, reductions, factories,
                                               fallbacks (matmul, conv2d, cumsum, nonzero, unique), scatters
  - the eager random state ................... manual_seed (tensor.py re-exports it)

How a printer spells an op: for a generic unary op, `cpp`/`triton` is a function name, printed
`fn(x)`; for a generic binary op it is an infix operator, printed `(a op b)`; the result dtype is
bool when `dtype == "bool"`, else the operand's. `None` means the printer has its own method for the
op (pow, relu, sign, maximum, ...). The ops handler calls an op by `OpDef.handler` (div is
`ops.truediv`, as in Inductor), so a printer looks an op up in `BY_HANDLER`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .conv_numpy import conv2d_numpy
from .dtypes import float64

# ---- The record ----


@dataclass(frozen=True)
class OpDef:
    """One primitive op.

    kind:   "unary" | "binary" (pointwise math with a dtype rule), "pointwise" (where, to_dtype,
            clone: elementwise with their own lowering), "view", "reduction", "factory", "other"
            (matmul, cumsum, cat, nonzero, unique), "scatter" (graph-only: capture's
            functionalized writes through views; no eager implementation)
    arity:  number of inputs (cat's one input is a list of tensors)
    dtype:  unary/binary output dtype rule: "same" keeps the promoted dtype, "float" turns int/bool
            into float32 (and lowering computes the op in float), "bool" gives bool
    eager:  the numpy implementation `tensor._dispatch` runs (inputs in compute form, params as kwargs)
    cast_inputs: eager casts every tensor input to one compute dtype first (tensor._run_eager)
    fallback:    lowering leaves the op to its eager implementation, as an ExternKernel (§6.1)
    cpp, triton: the generic spelling in each printer (see the module docstring), or None
    handler:     the `ops.<name>` the IR calls; "" means the op's own name
    """
    name: str
    kind: str
    arity: int
    eager: Callable | None
    dtype: str | None = None
    cast_inputs: bool = False
    fallback: bool = False
    cpp: str | None = None
    triton: str | None = None
    handler: str = ""

    @property
    def float_only(self) -> bool:
        """Computed in floating point even for int/bool inputs (lower.py's promotion to float32)."""
        return self.dtype == "float"

    @property
    def ops_name(self) -> str:
        return self.handler or self.name


def _unary(name, eager, dtype, cpp=None, triton=None):
    return OpDef(name, "unary", 1, eager, dtype, cast_inputs=True, cpp=cpp, triton=triton)


def _binary(name, eager, dtype, cpp=None, triton=None, handler=""):
    return OpDef(name, "binary", 2, eager, dtype, cast_inputs=True, cpp=cpp, triton=triton,
                 handler=handler)


# ---- Eager helpers (numpy has no erf; ints keep their values under floor/ceil/...) ----


def _erf(x):
    # math.erf is exact to double precision (slow, but this is the eager reference)
    # (asarray: on a 0-d array, frompyfunc returns a Python float)
    return np.asarray(np.frompyfunc(math.erf, 1, 1)(x.astype(np.float64)), np.float64).astype(x.dtype)


def _keep_int(f):
    return lambda x: x.copy() if x.dtype.kind in "iub" else f(x)


def _int_div_check(f):
    def run(a, b):
        if b.dtype.kind in "iub" and not np.all(b):
            raise RuntimeError("ZeroDivisionError")
        return f(a, b)
    return run


def _reduce(f):
    return lambda x, dims, keepdim: f(x, axis=dims, keepdims=keepdim)


def _arg_reduce(f):
    def run(x, dims, keepdim):
        kept = [d for d in range(x.ndim) if d not in dims]
        # (the row length spelled out: -1 is ambiguous when a kept dim is 0)
        y = x.transpose(kept + list(dims)).reshape([x.shape[d] for d in kept] + [math.prod(x.shape[d] for d in dims)])
        r = f(y, axis=-1).astype(np.int64)
        return r.reshape([1 if d in dims else x.shape[d] for d in range(x.ndim)]) if keepdim else r
    return run


def _arange(start, end, step, dtype):
    n = len(range(0, math.ceil((end - start) / step)))
    return (start + np.arange(n) * step).astype(dtype.compute)


_rng = np.random.default_rng()


def manual_seed(seed):
    """Seed the eager random ops (rand, randn)."""
    global _rng
    _rng = np.random.default_rng(seed)


def _rand(shape, dtype):
    return _rng.random(shape, dtype=np.float64 if dtype is float64 else np.float32)


def _randn(shape, dtype):
    return _rng.standard_normal(shape, dtype=np.float64 if dtype is float64 else np.float32)


# ---- The table ----

OPS = {d.name: d for d in [
    # unary pointwise math
    _unary("neg", np.negative, "same"),
    _unary("abs", np.abs, "same", cpp="stax_abs", triton="tl.abs"),
    _unary("exp", np.exp, "float", cpp="stax_exp", triton="libdevice.exp"),
    _unary("exp2", np.exp2, "float", cpp="stax_exp2", triton="libdevice.exp2"),
    _unary("log", np.log, "float", cpp="stax_log", triton="libdevice.log"),
    _unary("log2", np.log2, "float", cpp="stax_log2", triton="libdevice.log2"),
    _unary("sqrt", np.sqrt, "float", cpp="sqrt", triton="libdevice.sqrt"),
    _unary("rsqrt", lambda x: 1 / np.sqrt(x), "float", cpp="stax_rsqrt", triton="libdevice.rsqrt"),
    _unary("sin", np.sin, "float", cpp="stax_sin", triton="libdevice.sin"),
    _unary("cos", np.cos, "float", cpp="stax_cos", triton="libdevice.cos"),
    _unary("tanh", np.tanh, "float", cpp="stax_tanh", triton="libdevice.tanh"),
    _unary("sigmoid", lambda x: 1 / (1 + np.exp(-x)), "float", cpp="stax_sigmoid", triton="tl.sigmoid"),
    _unary("erf", _erf, "float", cpp="stax_erf", triton="libdevice.erf"),
    _unary("log1p", np.log1p, "float", cpp="log1p", triton="libdevice.log1p"),
    _unary("expm1", np.expm1, "float", cpp="expm1", triton="libdevice.expm1"),
    # relu keeps NaN, unlike maximum(x, 0) on ints
    _unary("relu", lambda x: np.where(x < 0, 0, x), "same", cpp="stax_relu"),
    _unary("floor", _keep_int(np.floor), "same", cpp="floor", triton="libdevice.floor"),
    _unary("ceil", _keep_int(np.ceil), "same", cpp="ceil", triton="libdevice.ceil"),
    _unary("round", _keep_int(np.round), "same", cpp="rint", triton="libdevice.nearbyint"),
    _unary("trunc", _keep_int(np.trunc), "same", cpp="trunc", triton="libdevice.trunc"),
    _unary("sign", lambda x: np.sign(np.nan_to_num(x, nan=0, posinf=1, neginf=-1)), "same",
           triton="triton_helpers.sign"),
    _unary("reciprocal", lambda x: 1 / x, "float"),
    _unary("isnan", np.isnan, "bool"),
    _unary("isinf", np.isinf, "bool"),
    _unary("logical_not", np.logical_not, "bool"),
    _unary("bitwise_not", np.invert, "same"),
    # binary pointwise math
    _binary("add", np.add, "same", cpp="+", triton="+"),
    _binary("sub", np.subtract, "same", cpp="-", triton="-"),
    _binary("mul", np.multiply, "same", cpp="*", triton="*"),
    _binary("div", np.true_divide, "float", cpp="/", triton="/", handler="truediv"),
    _binary("floordiv", _int_div_check(np.floor_divide), "same"),
    _binary("remainder", _int_div_check(np.remainder), "same"),
    _binary("pow", np.power, "same"),
    _binary("maximum", np.maximum, "same"),
    _binary("minimum", np.minimum, "same"),
    _binary("eq", np.equal, "bool", cpp="==", triton="=="),
    _binary("ne", np.not_equal, "bool", cpp="!=", triton="!="),
    _binary("lt", np.less, "bool", cpp="<", triton="<"),
    _binary("le", np.less_equal, "bool", cpp="<=", triton="<="),
    _binary("gt", np.greater, "bool", cpp=">", triton=">"),
    _binary("ge", np.greater_equal, "bool", cpp=">=", triton=">="),
    _binary("logical_and", np.logical_and, "bool", cpp="&&", triton="&"),
    _binary("logical_or", np.logical_or, "bool", cpp="||", triton="|"),
    _binary("logical_xor", np.logical_xor, "bool", cpp="!=", triton="^"),
    _binary("bitwise_and", np.bitwise_and, "same", cpp="&", triton="&"),
    _binary("bitwise_or", np.bitwise_or, "same", cpp="|", triton="|"),
    _binary("bitwise_xor", np.bitwise_xor, "same", cpp="^", triton="^"),
    # other elementwise ops
    OpDef("where", "pointwise", 3, lambda c, a, b: np.where(c.astype(bool), a, b), cast_inputs=True),
    OpDef("to_dtype", "pointwise", 1, lambda x, dtype: x),   # the result wrapper rounds to the new dtype
    OpDef("clone", "pointwise", 1, lambda x: x),             # the wrapper copies into fresh storage
    # views: eager shares the input's storage (no implementation to run)
    OpDef("permute", "view", 1, None),
    OpDef("expand", "view", 1, None),
    OpDef("slice", "view", 1, None),
    OpDef("select", "view", 1, None),
    OpDef("reshape", "view", 1, None),
    # reductions
    OpDef("sum", "reduction", 1, _reduce(np.sum), cast_inputs=True),
    OpDef("prod", "reduction", 1, _reduce(np.prod), cast_inputs=True),
    OpDef("amax", "reduction", 1, _reduce(np.max), cast_inputs=True),
    OpDef("amin", "reduction", 1, _reduce(np.min), cast_inputs=True),
    OpDef("argmax", "reduction", 1, _arg_reduce(np.argmax)),
    OpDef("argmin", "reduction", 1, _arg_reduce(np.argmin)),
    # factories (no tensor inputs)
    OpDef("full", "factory", 0, lambda shape, value, dtype: np.full(shape, value, dtype.compute)),
    OpDef("arange", "factory", 0, _arange),
    OpDef("rand", "factory", 0, _rand, fallback=True),
    OpDef("randn", "factory", 0, _randn, fallback=True),
    # the rest: cat is lowered (masked loads); the others are fallback kernels (§6.1),
    # nonzero and unique because their output sizes depend on the data
    OpDef("cumsum", "other", 1, lambda x, dim: np.cumsum(x, axis=dim) if x.ndim else x.copy(),
          cast_inputs=True, fallback=True),
    OpDef("matmul", "other", 2, np.matmul, cast_inputs=True, fallback=True),
    # inputs [x, weight] or [x, weight, bias]; on the GPU conv_template.py prints it as a template
    OpDef("conv2d", "other", 3, conv2d_numpy, cast_inputs=True, fallback=True),
    OpDef("cat", "other", 1, lambda xs, dim: np.concatenate(xs, axis=dim), cast_inputs=True),
    OpDef("nonzero", "other", 1, lambda x: np.argwhere(x).astype(np.int64), fallback=True),
    OpDef("unique", "other", 1, lambda x: np.unique(x.reshape(-1)), fallback=True),
    # graph-only: capture.py's functional form of a write through a slice / select view
    OpDef("slice_scatter", "scatter", 2, None),
    OpDef("select_scatter", "scatter", 2, None),
]}

# the ops handler's name -> OpDef (for printers: `ops.truediv` is div)
BY_HANDLER = {d.ops_name: d for d in OPS.values()}


def names(kind: str) -> list:
    """The ops of one kind, in table order."""
    return [name for name, d in OPS.items() if d.kind == kind]
