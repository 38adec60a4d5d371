"""Random Stax programs, run compiled (C++ and Triton) against a float64 reference (issue 9).

A seeded generator writes small straight-line programs: pointwise math, broadcasting, views
(permute, transpose, slices with steps, select, reshape, expand), reductions (sum, amax, amin,
prod, mean, argmax/argmin over various dims, keepdim), softmax, layer_norm, matmul, casts, half
types, 0-d and size-0/1 dims, in-place updates (also through views of the inputs). Each program is

  - run eagerly on its own dtypes (the dtypes and shapes compiled code must produce);
  - run eagerly with every float input widened to float64 (the *reference*: eager Stax is numpy
    op by op, independent of capture, lowering and code generation; a cast the program writes to
    float16/bfloat16 still rounds there, casts to float32 keep float64);
  - compiled (`fullgraph=True`) on the CPU and/or through the Triton back end (the interpreter
    when TRITON_INTERPRET=1, the GPU otherwise), its outputs and the inputs it mutated compared
    with the reference under tests/conftest.py's `assert_close`, at the tolerance of the least
    precise float dtype the program computes in.

The generator keeps the comparison meaningful: it tracks a bound on every value's magnitude (no
overflow), and which values are *exact* (equal in float32 and float64: inputs, views, neg/abs,
max/min, casts of exact values), and compares, casts floats to ints, argmaxes and rounds only
exact values, so that a flipped comparison is a bug and not rounding.

Command line (the lead's H200 run; without a GPU, add TRITON_INTERPRET=1):

    python tests/randprog.py --n 5000 --device cuda [--seed S] [--sm90]
    python tests/randprog.py --show 1234            # print the program of one seed

prints a table of counts per device and outcome, then each failure with its reproducer source.
tests/test_random_programs.py runs a few hundred of them in CI (STAX_RANDPROG_N for more).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))          # conftest's assert_close
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the stax of this checkout

import stax  # noqa: E402
from conftest import TOLERANCES, assert_close  # noqa: E402

FLOATS = ("float32", "float16", "bfloat16")
INTS = ("int32", "int64")
HALF = ("float16", "bfloat16")
SIZES = (0, 1, 1, 2, 3, 4, 5, 7, 8, 8, 16, 33, 64)
LONG_ROWS = (1100, 2500, 9000)      # looped rows (> 1024) and, with few rows, split reductions
PRECISION = ["float64", "float32", "float16", "bfloat16"]          # most to least precise


# ---- The values a program holds while it is written ----


@dataclass
class V:
    """A value of the program being written: its variable, shape, dtype, a bound on |value|,
    whether float32 and float64 runs hold exactly the same numbers, and what storage it views."""
    name: str
    shape: tuple
    dtype: str
    bound: float
    exact: bool
    base: str                  # the value whose storage this one shares (itself when computed)
    expanded: bool = False     # a broadcast view (stride 0): never written in place

    @property
    def numel(self):
        return math.prod(self.shape)

    @property
    def is_float(self):
        return self.dtype in FLOATS


@dataclass
class InputSpec:
    shape: tuple
    dtype: str
    layout: str = "contiguous"     # or "transposed" (a permuted view) or "strided" (every other element)


@dataclass
class Program:
    seed: int
    source: str
    inputs: list
    precision: str                 # the least precise float dtype the program computes in
    ops: list = field(default_factory=list)

    def make_inputs(self) -> list:
        """Fresh eager CPU tensors for the inputs (the same values on every call)."""
        rng = np.random.default_rng(self.seed)
        return [_make_input(spec, rng) for spec in self.inputs]


def _make_input(spec: InputSpec, rng):
    shape = spec.shape
    full = tuple(reversed(shape)) if spec.layout == "transposed" else \
        (shape[:-1] + (2 * shape[-1],) if spec.layout == "strided" else shape)
    if spec.dtype == "bool":
        a = rng.random(full) < 0.5
    elif spec.dtype in INTS:
        a = rng.integers(-6, 7, full).astype(spec.dtype)
    else:
        a = rng.standard_normal(full).astype(np.float32)
    t = stax.tensor(a, dtype=getattr(stax, spec.dtype))
    if spec.layout == "transposed":
        t = t.permute(*reversed(range(len(shape))))
    elif spec.layout == "strided":
        t = t[..., ::2]
    return t


# ---- The generator ----


class Writer:
    """Writes one program: `ops` picks an op at random and appends its line, `finish` returns it."""

    def __init__(self, seed: int, n_ops: int | None = None):
        self.rng = np.random.default_rng(seed)
        self.seed = seed
        self.n_ops = n_ops if n_ops is not None else int(self.rng.integers(1, 7))
        self.inputs, self.values, self.lines, self.ops = [], [], [], []
        self.dtypes = set()
        self.mutated = False

    # -- choices --
    def chance(self, p) -> bool:
        return self.rng.random() < p

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def shape(self, ndim=None, allow_long=True) -> tuple:
        ndim = int(self.rng.choice([0, 1, 2, 2, 3, 3, 4])) if ndim is None else ndim
        dims = [int(self.pick(SIZES)) for _ in range(ndim)]
        if ndim and allow_long and self.chance(0.08):
            dims[-1] = int(self.pick(LONG_ROWS))
            dims[:-1] = [min(d, 3) for d in dims[:-1]]
        while math.prod(dims) > 20000:
            dims[int(self.rng.integers(ndim))] = 1
        return tuple(dims)

    def dtype(self) -> str:
        r = self.rng.random()
        if r < 0.55:
            return "float32"
        if r < 0.7:
            return self.pick(HALF)
        if r < 0.9:
            return self.pick(INTS)
        return "bool"

    # -- values --
    def new_input(self, shape=None, dtype=None) -> V:
        shape = self.shape() if shape is None else tuple(shape)
        dtype = dtype or self.dtype()
        layout = "contiguous"
        if len(shape) >= 2 and self.chance(0.2):
            layout = self.pick(["transposed", "strided"])
        name = f"a{len(self.inputs)}"
        self.inputs.append(InputSpec(shape, dtype, layout))
        bound = 6.0 if dtype in INTS else (1.0 if dtype == "bool" else 5.5)
        v = V(name, shape, dtype, bound, True, name)
        self.values.append(v)
        self.dtypes.add(dtype)
        return v

    def emit(self, expr, shape, dtype, bound, exact, base=None, expanded=False, op="") -> V:
        name = f"v{len(self.lines)}"
        self.lines.append(f"{name} = {expr}")
        v = V(name, tuple(shape), dtype, float(bound), exact, base or name, expanded)
        self.values.append(v)
        self.dtypes.add(dtype)
        if op:
            self.ops.append(op)
        return v

    def operand(self, want=None) -> V:
        """An existing value (more often a recent one) satisfying `want`, or a new input."""
        pool = [v for v in self.values if want is None or want(v)]
        if pool and pool[-1] is self.values[-1] and self.chance(0.5):
            return pool[-1]                 # mostly chains: each op consumes the value before it
        if pool and self.chance(0.8):
            weights = np.arange(1, len(pool) + 1, dtype=float) ** 2
            return pool[int(self.rng.choice(len(pool), p=weights / weights.sum()))]
        for _ in range(20):
            v = self.new_input()
            if want is None or want(v):
                return v
        return self.new_input(shape=(4, 8), dtype="float32")

    def broadcast_partner(self, v: V, dtype=None) -> V:
        """A value whose shape broadcasts with v's: v's shape with some dims 1 or dropped."""
        same = [w for w in self.values if w.shape == v.shape and w is not v
                and (dtype is None or w.dtype == dtype)]
        if same and self.chance(0.4):
            return self.pick(same)
        shape = [1 if self.chance(0.3) else d for d in v.shape]
        shape = shape[int(self.rng.integers(len(shape) + 1)):] if shape and self.chance(0.3) else shape
        if len(shape) == len(v.shape) and self.chance(0.1):     # the partner has more dims than v
            shape = [int(self.pick((2, 3)))] + shape
        return self.new_input(shape, dtype or self.dtype())

    # -- the program --
    def write(self) -> Program:
        ops = [self.op_unary, self.op_binary, self.op_binary, self.op_view, self.op_view,
               self.op_reduce, self.op_reduce, self.op_softmax, self.op_layer_norm, self.op_matmul,
               self.op_cast, self.op_compare_where, self.op_inplace, self.op_int]
        while len(self.lines) < self.n_ops:
            try:
                self.pick(ops)()
            except _Retry:
                continue
        outs = [self.values[-1]]
        for v in self.values[:-1]:
            if v.name.startswith("v") and self.chance(0.25):
                outs.append(v)
        body = "\n".join("    " + line for line in self.lines)
        ret = ", ".join(v.name for v in outs)
        args = ", ".join(s_name for s_name in (f"a{i}" for i in range(len(self.inputs))))
        source = f"def f({args}):\n{body}\n    return ({ret},)\n"
        floats = [d for d in self.dtypes if d in FLOATS] or ["float32"]
        precision = max(floats, key=PRECISION.index)
        return Program(self.seed, source, self.inputs, precision, self.ops)

    # -- ops --
    def op_unary(self):
        v = self.operand(lambda v: v.is_float)
        if not v.is_float:
            raise _Retry
        safe = ["neg", "abs", "relu", "sigmoid", "tanh", "sin", "cos", "erf", "silu", "gelu"]
        if v.bound <= 8:
            safe += ["exp", "expm1"]
        fn = self.pick(safe + ["log_abs", "sqrt_abs", "floor", "round"])
        if fn in ("floor", "round") and not v.exact:
            fn = "abs"
        bound = {"neg": v.bound, "abs": v.bound, "relu": v.bound, "floor": v.bound + 1,
                 "round": v.bound + 1, "exp": math.exp(min(v.bound, 50)), "expm1": math.exp(min(v.bound, 50)),
                 "log_abs": math.log1p(v.bound), "sqrt_abs": math.sqrt(v.bound) + 1,
                 "silu": v.bound, "gelu": v.bound}.get(fn, 1.0)
        exact = v.exact and fn in ("neg", "abs", "relu", "floor", "round")
        expr = {"log_abs": f"stax.log1p({v.name}.abs())", "sqrt_abs": f"stax.sqrt({v.name}.abs())",
                "silu": f"stax.silu({v.name})", "gelu": f"stax.gelu({v.name})"}.get(fn, f"stax.{fn}({v.name})")
        self.emit(expr, v.shape, v.dtype, bound, exact, op=fn)

    def op_binary(self):
        v = self.operand(lambda v: v.dtype != "bool")
        if v.dtype == "bool":
            raise _Retry
        if self.chance(0.2):                      # a Python scalar
            c = self.pick([0.5, 2.0, -1.5, 3]) if v.is_float else int(self.pick([2, -3, 1]))
            fn = self.pick(["add", "sub", "mul"])
            sym = {"add": "+", "sub": "-", "mul": "*"}[fn]
            exact = v.exact and (c == 2.0 or fn == "mul" and c in (2, -3, 1)) or not v.is_float and v.exact
            bound = v.bound * abs(c) if fn == "mul" else v.bound + abs(c)
            if bound > 1e4:
                raise _Retry
            self.emit(f"({v.name} {sym} {c})", v.shape, v.dtype, bound, exact, op=f"{fn}_scalar")
            return
        w = self.broadcast_partner(v, v.dtype if self.chance(0.5) else None)
        if w.dtype == "bool":
            raise _Retry
        shape = np.broadcast_shapes(v.shape, w.shape)
        dtype = _promote(v.dtype, w.dtype)
        fn = self.pick(["add", "sub", "mul", "maximum", "minimum", "div"])
        if fn == "div" and dtype in INTS:
            fn = "add"
        bound = {"add": v.bound + w.bound, "sub": v.bound + w.bound, "mul": v.bound * w.bound,
                 "maximum": max(v.bound, w.bound), "minimum": max(v.bound, w.bound),
                 "div": v.bound}[fn]
        if bound > 1e4:
            raise _Retry
        exact = v.exact and w.exact and (fn in ("maximum", "minimum") or dtype in INTS)
        if fn == "div":                                # away from zero: no amplified rounding
            expr = f"({v.name} / ({w.name}.abs() + 1))"
            dtype = dtype if dtype in FLOATS else "float32"
        elif fn in ("maximum", "minimum"):
            expr = f"stax.{fn}({v.name}, {w.name})"
        else:
            expr = f"({v.name} {dict(add='+', sub='-', mul='*')[fn]} {w.name})"
        self.emit(expr, shape, dtype, bound, exact, op=fn)

    def op_view(self):
        v = self.operand()
        nd = len(v.shape)
        kinds = ["unsqueeze", "reshape"] + (["permute", "transpose", "slice", "select", "expand",
                                              "flatten", "narrow", "squeeze"] if nd else [])
        kind = self.pick(kinds)
        shape, expr, expanded = list(v.shape), None, v.expanded
        if kind == "permute":
            perm = [int(i) for i in self.rng.permutation(nd)]
            expr, shape = f"{v.name}.permute({', '.join(map(str, perm))})", [v.shape[i] for i in perm]
        elif kind == "transpose":
            a, b = int(self.rng.integers(nd)), int(self.rng.integers(nd))
            shape[a], shape[b] = shape[b], shape[a]
            expr = f"{v.name}.transpose({a}, {b - nd if self.chance(0.5) else b})"
        elif kind == "slice":
            d = int(self.rng.integers(nd))
            n = v.shape[d]
            start, step = int(self.rng.integers(0, max(n, 1))), int(self.pick([1, 2, 3]))
            stop = int(self.rng.integers(start, n + 1)) if n else 0
            shape[d] = len(range(start, stop, step))
            key = ", ".join([":"] * d + [f"{start}:{stop}:{step}"])
            expr = f"{v.name}[{key}]"
        elif kind == "select":
            d = int(self.rng.integers(nd))
            if v.shape[d] == 0:
                raise _Retry
            i = int(self.rng.integers(v.shape[d]))
            i = i - v.shape[d] if self.chance(0.3) else i
            expr = f"{v.name}.select({d}, {i})"
            del shape[d]
        elif kind == "narrow":
            d = int(self.rng.integers(nd))
            start = int(self.rng.integers(0, v.shape[d] + 1))
            length = int(self.rng.integers(0, v.shape[d] - start + 1))
            expr, shape[d] = f"{v.name}.narrow({d}, {start}, {length})", length
        elif kind == "expand":
            ones = [i for i, s in enumerate(v.shape) if s == 1]
            new = [int(self.pick((2, 3, 5))) if i in ones and self.chance(0.7) else s for i, s in enumerate(v.shape)]
            lead = [int(self.pick((2, 3)))] if self.chance(0.4) else []
            if math.prod(lead + new) > 20000:
                raise _Retry
            expr, shape, expanded = f"{v.name}.expand({', '.join(map(str, lead + new))})", lead + new, True
        elif kind == "unsqueeze":
            d = int(self.rng.integers(nd + 1))
            expr = f"{v.name}.unsqueeze({d})"
            shape.insert(d, 1)
        elif kind == "squeeze":
            ones = [i for i, s in enumerate(v.shape) if s == 1]
            if not ones:
                raise _Retry
            d = self.pick(ones)
            expr = f"{v.name}.squeeze({d})"
            del shape[d]
        elif kind == "flatten":
            expr, shape = f"{v.name}.flatten()", [v.numel]
        else:                                             # reshape to another factoring
            shape = _refactor(v.shape, self.rng)
            expr = f"{v.name}.reshape({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"
            if not shape:
                expr = f"{v.name}.reshape(())"
        # a reshape may copy: then it is a value of its own (in place updates do not reach v)
        base = None if kind in ("reshape", "flatten") else v.base
        self.emit(expr, shape, v.dtype, v.bound, v.exact, base=base, expanded=expanded, op=kind)

    def _dims(self, v, single=False):
        nd = len(v.shape)
        if nd == 0:
            return None if single else self.pick([None, ()])
        if single:
            return None if self.chance(0.15) else int(self.rng.integers(-nd, nd))
        r = self.rng.random()
        if r < 0.15:
            return None
        if r < 0.6:
            return int(self.rng.integers(-nd, nd))
        k = int(self.rng.integers(1, nd + 1))
        return tuple(int(d) for d in sorted(self.rng.choice(nd, k, replace=False)))

    def op_reduce(self):
        v = self.operand()
        fn = self.pick(["sum", "sum", "amax", "amin", "mean", "prod", "argmax", "argmin"])
        if fn == "mean" and not v.is_float or fn in ("amax", "amin", "argmax", "argmin", "prod") and v.dtype == "bool":
            fn = "sum"
        dims = self._dims(v, single=fn in ("argmax", "argmin"))
        nd = len(v.shape)
        reduced = list(range(nd)) if dims is None or dims == () else \
            [d % nd for d in ((dims,) if isinstance(dims, int) else dims)]
        rnumel = math.prod(v.shape[d] for d in reduced) if nd else 1
        if fn in ("amax", "amin", "argmax", "argmin") and rnumel == 0:
            raise _Retry                                  # an error in eager (and torch)
        if fn in ("argmax", "argmin") and v.is_float and not v.exact:
            raise _Retry
        if fn == "prod" and (rnumel > 8 or v.bound ** rnumel > 1e4):
            raise _Retry
        keep = self.chance(0.4)
        if fn in ("argmax", "argmin") and dims is None:
            keep = False
        shape = [1 if i in reduced else s for i, s in enumerate(v.shape)] if keep else \
            [s for i, s in enumerate(v.shape) if i not in reduced]
        if dims is None and fn not in ("argmax", "argmin") and not keep:
            args = ""
        elif dims is None:
            args = f"dim=None, keepdim={keep}" if fn in ("argmax", "argmin") else ""
            shape = [] if not keep else shape
        else:
            args = f"{dims!r}" + (f", keepdim={keep}" if keep or self.chance(0.3) else "")
        if dims is None and fn not in ("argmax", "argmin"):
            shape = []
            args = ""
        dtype = {"argmax": "int64", "argmin": "int64"}.get(fn, v.dtype)
        if fn in ("sum", "prod") and v.dtype in INTS + ("bool",):
            dtype = "int64"
        bound = {"sum": v.bound * max(rnumel, 1), "prod": v.bound ** min(rnumel, 8), "mean": v.bound,
                 "argmax": max(rnumel, 1), "argmin": max(rnumel, 1)}.get(fn, v.bound)
        if bound > 1e5:
            raise _Retry
        exact = v.exact and (fn in ("amax", "amin", "argmax", "argmin") or not v.is_float)
        self.emit(f"{v.name}.{fn}({args})", shape, dtype, bound, exact, op=fn)

    def op_softmax(self):
        v = self.operand(lambda v: v.is_float and v.shape != ())
        if not v.is_float or not v.shape:
            raise _Retry
        d = int(self.rng.integers(-len(v.shape), len(v.shape)))
        fn = self.pick(["softmax", "softmax", "log_softmax"])
        self.emit(f"stax.{fn}({v.name}, {d})", v.shape, v.dtype,
                  1.0 if fn == "softmax" else 2 * v.bound + 12, False, op=fn)

    def op_layer_norm(self):
        v = self.operand(lambda v: v.is_float and v.shape != ())
        if not v.is_float or not v.shape:
            raise _Retry
        k = int(self.rng.integers(1, min(len(v.shape), 2) + 1))
        norm = v.shape[-k:]
        if math.prod(norm) < 2:
            raise _Retry                    # one element: x - mean is rounding noise over 1e-5
        # plus a fresh random row: a row of equal values (a fill_, an expand) makes x - mean pure
        # rounding, scaled up by 1/sqrt(eps): noise, not a bug
        noise = self.new_input(norm, "float32" if v.dtype not in HALF else v.dtype)
        v = self.emit(f"({v.name} + {noise.name})", v.shape, _promote(v.dtype, noise.dtype), v.bound + 5.5, False, op="add")
        args = f"{v.name}, {tuple(norm)!r}"
        if self.chance(0.5):
            w = self.new_input(norm, v.dtype)
            b = self.new_input(norm, v.dtype)
            args += f", {w.name}, {b.name}"
        self.emit(f"stax.layer_norm({args})", v.shape, v.dtype, 40 * 6, False, op="layer_norm")

    def op_matmul(self):
        v = self.operand(lambda v: v.is_float and len(v.shape) >= 2)
        if not v.is_float or len(v.shape) < 2:
            raise _Retry
        k = v.shape[-1]
        n = int(self.pick((1, 3, 8, 16, 33)))
        bshape = v.shape[:-2] + (k, n) if self.chance(0.7) else (k, n)
        if self.chance(0.3):
            w = self.new_input((n, k) if len(bshape) == 2 else bshape[:-2] + (n, k), v.dtype)
            w = self.emit(f"{w.name}.transpose(-1, -2)", bshape, v.dtype, w.bound, True, base=w.base, op="transpose")
        else:
            w = self.new_input(bshape, v.dtype)
        bound = v.bound * w.bound * max(k, 1)
        if bound > 1e5 or math.prod(v.shape[:-1]) * n > 20000:
            raise _Retry
        shape = np.broadcast_shapes(v.shape[:-2], w.shape[:-2]) + (v.shape[-2], n)
        self.emit(f"({v.name} @ {w.name})", shape, v.dtype, bound, False, op="matmul")

    def op_cast(self):
        v = self.operand()
        to = self.dtype()
        if to == v.dtype or (v.is_float and to not in FLOATS and not v.exact):
            raise _Retry
        if v.is_float and to in INTS + ("bool",) and v.bound > 1e4:
            raise _Retry
        exact = v.exact
        bound = {"bool": 1.0}.get(to, v.bound + 1)
        self.emit(f"cast({v.name}, {to!r})", v.shape, to, bound, exact, op=f"cast_{to}")

    def op_compare_where(self):
        v = self.operand(lambda v: v.exact and v.dtype != "bool")
        if not v.exact or v.dtype == "bool":
            raise _Retry
        if self.chance(0.5):
            w = self.broadcast_partner(v, v.dtype)
            rhs = w.name
            shape = np.broadcast_shapes(v.shape, w.shape)
        else:
            rhs, shape = self.pick(["0", "1", "-0.5"]) if v.is_float else self.pick(["0", "2"]), v.shape
        cmp = self.pick(["<", "<=", ">", ">=", "==", "!="])
        c = self.emit(f"({v.name} {cmp} {rhs})", shape, "bool", 1.0, True, op="compare")
        if self.chance(0.3):
            d = self.operand(lambda u: u.exact and _broadcasts_to(u.shape, c.shape))
            if d.exact and _broadcasts_to(d.shape, c.shape):
                fn = self.pick(["logical_and", "logical_or", "logical_xor"])
                c = self.emit(f"stax.{fn}({c.name}, {d.name})", c.shape, "bool", 1.0, True, op=fn)
        if self.chance(0.3):
            self.emit(f"stax.logical_not({c.name})", c.shape, "bool", 1.0, True, op="logical_not")
            return
        a = self.operand(lambda u: u.dtype != "bool")
        if a.dtype == "bool":
            raise _Retry
        b = self.broadcast_partner(a, a.dtype) if self.chance(0.6) else None
        try:
            shape = np.broadcast_shapes(c.shape, a.shape, b.shape if b else ())
        except ValueError:
            raise _Retry from None
        bexpr = b.name if b else ("0.0" if a.is_float else "0")
        self.emit(f"stax.where({c.name}, {a.name}, {bexpr})", shape, a.dtype if not b else _promote(a.dtype, b.dtype),
                  max(a.bound, b.bound if b else 0), a.exact and (b is None or b.exact), op="where")

    def op_inplace(self):
        v = self.operand(lambda v: not v.expanded and v.dtype != "bool" and v.numel > 0)
        if v.expanded or v.dtype == "bool":
            raise _Retry
        kind = self.pick(["add_", "mul_", "setitem", "fill_", "copy_", "relu_"])
        if kind in ("add_", "mul_", "copy_"):
            w = self.operand(lambda u: u.base != v.base and u.dtype == v.dtype
                             and _broadcasts_to(u.shape, v.shape))
            if w.base == v.base or w.dtype != v.dtype or not _broadcasts_to(w.shape, v.shape):
                w = self.new_input([d if self.chance(0.7) else 1 for d in v.shape], v.dtype)
            bound = {"add_": v.bound + w.bound, "mul_": v.bound * w.bound, "copy_": w.bound}[kind]
            if bound > 1e4:
                raise _Retry
            line, exact = f"{v.name}.{kind}({w.name})", v.exact and w.exact and (kind == "copy_" or not v.is_float)
        elif kind == "relu_":
            if not v.is_float:
                raise _Retry
            line, bound, exact = f"{v.name}.relu_()", v.bound, v.exact
        elif kind == "fill_":
            c = self.pick([1.5, -2.0]) if v.is_float else 3
            line, bound, exact = f"{v.name}.fill_({c})", max(v.bound, 2), v.exact
        else:                                                 # v[key] = value
            if not v.shape or v.shape[0] == 0:
                raise _Retry
            i = int(self.rng.integers(v.shape[0]))
            key, sub = (f"{i}", v.shape[1:]) if self.chance(0.5) else (f"{i}::2", (len(range(i, v.shape[0], 2)),) + v.shape[1:])
            c = "0.25" if v.is_float else "-1"
            line, bound, exact = f"{v.name}[{key}] = {c}", v.bound, v.exact
            del sub
        self.lines.append(line)
        self.ops.append(kind)
        # every value viewing v's storage may have changed: re-bound them
        for u in self.values:
            if u.base == v.base:
                u.bound, u.exact = max(u.bound, bound), u.exact and exact
        self.mutated = True

    def op_int(self):
        v = self.operand(lambda v: v.dtype in INTS + ("bool",))
        if v.dtype not in INTS + ("bool",):
            raise _Retry
        if v.dtype == "bool":
            w = self.broadcast_partner(v, "bool")
            fn = self.pick(["&", "|", "^"])
            self.emit(f"({v.name} {fn} {w.name})", np.broadcast_shapes(v.shape, w.shape), "bool", 1, True, op="bool_bitwise")
            return
        fn = self.pick(["//", "%", "&", "|", "^", "abs"])
        if fn == "abs":
            self.emit(f"{v.name}.abs()", v.shape, v.dtype, v.bound, v.exact, op="int_abs")
        elif fn in ("//", "%"):
            c = self.pick([2, 3, -4])
            self.emit(f"({v.name} {fn} {c})", v.shape, v.dtype, v.bound, v.exact, op=f"int{fn}")
        else:
            w = self.broadcast_partner(v, v.dtype)
            self.emit(f"({v.name} {fn} {w.name})", np.broadcast_shapes(v.shape, w.shape), _promote(v.dtype, w.dtype),
                      2 ** math.ceil(math.log2(max(v.bound, w.bound) + 1)), v.exact and w.exact, op=f"int{fn}")


class _Retry(Exception):
    """This op does not fit the value picked: pick again."""


def _broadcasts_to(shape, target) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def _promote(a: str, b: str) -> str:
    return stax.promote_types(getattr(stax, a), getattr(stax, b)).name if hasattr(stax, "promote_types") \
        else np.promote_types(_np(a), _np(b)).name


def _np(name):
    return {"bfloat16": np.float32, "bool": np.bool_}.get(name, name)


def _refactor(shape, rng) -> list:
    """Another shape of the same numel: its prime factors regrouped into 0-3 dims."""
    n = math.prod(shape)
    if n == 0:
        return [0] + ([int(rng.integers(1, 4))] if rng.random() < 0.5 else [])
    if n == 1:
        return [] if rng.random() < 0.5 else [1, 1]
    factors, m, p = [], n, 2
    while m > 1:
        while m % p == 0:
            factors.append(p)
            m //= p
        p += 1
    k = int(rng.integers(1, min(3, len(factors)) + 1))
    dims = [1] * k
    for f in factors:
        dims[int(rng.integers(k))] *= f
    return dims


def write_program(seed: int) -> Program:
    return Writer(seed).write()


# ---- Running a program ----


def _cast_compiled(x, name):
    return x.to(getattr(stax, name))


def _cast_reference(x, name):
    """The reference keeps float64, except that a cast to a half type still rounds."""
    if name in HALF:
        return x.to(getattr(stax, name)).to(stax.float64)
    return x.to(stax.float64 if name == "float32" else getattr(stax, name))


def program_function(prog: Program, reference=False):
    scope = {"stax": stax, "cast": _cast_reference if reference else _cast_compiled}
    exec(compile(prog.source, f"<randprog seed {prog.seed}>", "exec"), scope)
    return scope["f"]


def _widen(t):
    return t.to(stax.float64) if t.dtype.is_floating_point else t


@dataclass
class Outcome:
    status: str            # "ok", "fail" (wrong or crashed), "eager-error" (both raise: a clear error)
    detail: str = ""


def _host(t):
    return t.cpu() if t.device != "cpu" else t


def _compare(got, want_dtype_shape, ref, precision, what, half_atol=False):
    """One compiled tensor against the eager dtype/shape and the float64 reference's values."""
    dtype, shape = want_dtype_shape
    got = _host(got)
    if got.dtype is not dtype or tuple(got.shape) != tuple(shape):
        raise AssertionError(f"{what}: compiled gives {got.dtype.name}{list(got.shape)}, "
                             f"eager {dtype.name}{list(shape)}")
    if dtype.is_floating_point:
        # the reference rounded to the output's dtype (an overflow is inf in both), compared at
        # the tolerance of the least precise float the program computed in
        expected = np.asarray(_host(ref).to(dtype), np.float64)
        tol = max(dtype.name, precision, key=PRECISION.index)
        atol = TOLERANCES[tol][0] if half_atol else None
        assert_close(np.asarray(got, np.float64), expected, tol, atol=atol, msg=what)
    else:
        assert_close(got.numpy(), np.asarray(_host(ref)), dtype.name, msg=what)


def run_program(prog: Program, device: str) -> Outcome:
    """Compile `prog` for `device` ('cpu' or 'cuda') and check it against eager and the reference."""
    try:
        return _run_program(prog, device)
    except Exception as e:                                # noqa: BLE001 - a failure, with its story
        return Outcome("fail", f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e, limit=-4)))


def _run_program(prog: Program, device: str) -> Outcome:
    fn, ref_fn = program_function(prog), program_function(prog, reference=True)
    try:
        eager_in = prog.make_inputs()
        eager = fn(*eager_in)
    except Exception as e:                               # noqa: BLE001 - the program is an error
        eager_error = f"{type(e).__name__}: {e}"
    else:
        eager_error = None
    ref_in = [_widen(t) for t in prog.make_inputs()]
    if eager_error is None:
        ref = ref_fn(*ref_in)
    dev_in = [t.to(device) for t in prog.make_inputs()]
    try:
        out = stax.compile(fn, fullgraph=True)(*dev_in)
    except Exception as e:                                # noqa: BLE001
        if eager_error is not None:
            return Outcome("eager-error", f"eager: {eager_error}; compiled: {type(e).__name__}: {e}")
        return Outcome("fail", f"compiled raised {type(e).__name__}: {e}\n"
                       + "".join(traceback.format_exception(e, limit=-4)))
    if eager_error is not None:
        return Outcome("fail", f"eager raised {eager_error}, compiled did not")
    pairs = [(o, e, r, f"output {i}") for i, (o, e, r) in enumerate(zip(out, eager, ref))]
    pairs += [(d, e, r, f"input {i} after the call") for i, (d, e, r) in enumerate(zip(dev_in, eager_in, ref_in))]
    status = "ok"
    for got, e, r, what in pairs:
        try:
            _compare(got, (e.dtype, e.shape), r, prog.precision, what)
        except AssertionError as err:
            if prog.precision not in HALF:
                return Outcome("fail", str(err))
            # a half-precision program rounds each value it stores (eager: each op's result), and
            # a later subtraction (layer_norm's x - mean) can make that rounding larger than the
            # tolerance at a result near 0. Close to eager on its own dtypes, or to the reference
            # with an absolute tolerance as large as the relative one, it is rounding, not a bug
            # (counted apart)
            try:
                _compare(got, (e.dtype, e.shape), e, prog.precision, what)
            except AssertionError:
                try:
                    _compare(got, (e.dtype, e.shape), r, prog.precision, what, half_atol=True)
                except AssertionError:
                    return Outcome("fail", f"{err}\n(and not close to eager on its own dtypes either)")
            status = "ok-half"
    return Outcome(status)


def generated_kernels(prog: Program) -> dict:
    """The Triton kernels of `prog` (name -> source), printed without running them."""
    inputs = [t.to("cuda") if os.environ.get("TRITON_INTERPRET") == "1" or _gpu() else t
              for t in prog.make_inputs()]
    return stax.generate(program_function(prog), *inputs, device="cuda").kernels


def _gpu() -> bool:
    try:
        from stax import cuda
        return cuda.is_available()
    except Exception:                                      # noqa: BLE001
        return False


# ---- The command line: a count table and reproducers ----


def run_many(seeds, devices, stream=sys.stdout, sm90=None):
    """Run the programs of `seeds` on each device; returns {device: {status: count}}, failures."""
    counts = {d: {"ok": 0, "ok-half": 0, "fail": 0, "eager-error": 0} for d in devices}
    failures, kernels = [], {}
    t0 = time.time()
    for i, s in enumerate(seeds):
        prog = write_program(s)
        for d in devices:
            out = run_program(prog, d)
            counts[d][out.status] += 1
            if out.status == "fail":
                failures.append((prog, d, out.detail))
                print(f"FAIL seed {s} on {d}: {out.detail.splitlines()[0][:160]}", file=stream)
        if sm90:
            try:
                kernels.update({src: (name, s) for name, src in generated_kernels(prog).items()})
            except Exception:                              # noqa: BLE001 - run_program reported it
                pass
        if (i + 1) % 100 == 0:
            print(f"... {i + 1} programs, {time.time() - t0:.0f}s", file=stream)
    if sm90:
        errors = build_sm90({src: name for src, (name, _) in kernels.items()}, sm90 == "all")
        for src, (name, s) in kernels.items():
            c = counts.setdefault("sm_90 build", {"ok": 0, "fail": 0})
            c["fail" if src in errors else "ok"] += 1
            if src in errors:
                failures.append((write_program(s), "sm_90 build", f"{name}:\n{errors[src]}\n{src}"))
    return counts, failures


_SM90 = """
import json, sys, traceback
from stax.triton_heuristics import candidates, kernel_from_source
every = sys.argv[1] == "all"
failed = {}
for source, name in json.loads(sys.stdin.read()).items():
    try:
        k = kernel_from_source(name, source)
        numels = {p + "numel": n for p, n in k.size_hints.items()}
        for cfg in candidates(k.kind, numels, k.reduction_hint, k.r0_block) if every else [None]:
            k.compile_for(90, cfg)
    except Exception:
        failed[source] = traceback.format_exc(limit=3)[-1500:]
print(json.dumps(failed))
"""


def build_sm90(kernels: dict, every_config=False) -> dict:
    """Build each kernel (source -> name) for sm_90 in one process without TRITON_INTERPRET, in
    its default launch configuration or in every candidate; returns {source: why it failed}."""
    import json
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _SM90, "all" if every_config else "default"], input=json.dumps(kernels), text=True,
                       capture_output=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="how many programs")
    ap.add_argument("--seed", type=int, default=0, help="the first program's seed")
    ap.add_argument("--device", default="both", choices=["cpu", "cuda", "both"])
    ap.add_argument("--sm90", nargs="?", const="default", choices=["default", "all"],
                    help="also build every Triton kernel for sm_90 (in its default launch "
                         "configuration, or in 'all' candidate configurations)")
    ap.add_argument("--seeds", help="run only these seeds (comma-separated): reproduce failures")
    ap.add_argument("--show", type=int, metavar="SEED", help="print one program and exit")
    args = ap.parse_args(argv)
    if args.show is not None:
        prog = write_program(args.show)
        print(prog.source + f"# inputs: {prog.inputs}\n# precision: {prog.precision}")
        return 0
    devices = ["cpu", "cuda"] if args.device == "both" else [args.device]
    os.environ.setdefault("STAX_CACHE_DIR", str(Path.home() / ".cache" / "stax-randprog"))
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else range(args.seed, args.seed + args.n)
    counts, failures = run_many(seeds, devices, sm90=args.sm90)
    print(f"\nrandom programs: seeds {args.seeds or f'{args.seed}..{args.seed + args.n - 1}'}"
          f"{' (Triton interpreter)' if os.environ.get('TRITON_INTERPRET') == '1' else ''}")
    print(f"{'device':<14}{'ok':>8}{'ok~half':>10}{'fail':>8}{'both raise':>12}")
    for d, c in counts.items():
        print(f"{d:<14}{c['ok']:>8}{c.get('ok-half', 0):>10}{c['fail']:>8}{c.get('eager-error', 0):>12}")
    print("(ok~half: a half-precision program off the float64 reference by rounding: equal to eager,\n"
          " or within an absolute tolerance as large as the relative one)")
    for prog, d, detail in failures:
        print(f"\n==== seed {prog.seed} on {d} ====\n{prog.source}# inputs: {prog.inputs}\n{detail}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
