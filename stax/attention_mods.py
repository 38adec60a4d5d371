"""§9.10 A traced score_mod made cheap: hoisted by what it depends on, row terms dropped, folded.

Layer: back end (GPU) and bottom at once, below attention_kernels.py and attention_grad.py (which
print its plans into the templates); it imports nothing of stax. It reads a score_mod's printed
Triton lines (`attention_kernels.ModBody`: `name = expr` lines over the kernel's variables
`score`, `b`, `h`, `q_idx`, `kv_idx`) with `ast`, so every path that prints a mod (eager launches,
a graph's `omni_attn` node, the backward) gets the same plan from the same text.

Consumes a ModBody and the index bounds of one template (B, H, M, N). Produces a `ModPlan`: the
mod's operations split by where they run, and what the softmax lets the template leave out:

1. Hoisting. A subexpression that depends on (b, h) only runs once per program, one on q_idx only
   once per query block ([BLOCK_M, 1]), one on kv_idx only once per KV block ([1, BLOCK_N]); only
   what reads the score, or q_idx and kv_idx together, runs per score.
2. Dropping. The result is split into additive terms (through +, -, products with a (b, h) factor,
   and float(i - j) = float(i) - float(j), exact while every integer is below 2^24: the bounds are
   checked). A term of (b, h, q_idx) only adds the same value to every score of a row, so the
   softmax does not see it (the running max moves by the same amount): it is left out of the
   scores and added back to the row's LSE (`dropped`), so the LSE, and the backward that reads it,
   are those of the full mod. An integer split is re-centred on the query block's first row q0,
   float(i - q0) and float(q0 - j), so that the kept column term stays small near the diagonal
   (float(j) alone would cost ulp(N · slope) on every score).
3. Folding. When what is left is c · score + col(kv_idx), the template computes qk · (scale ·
   log2 e · c) + col · log2 e: one FMA per score (the plain template's form, `_raw_scores`).

A mod that does not parse, or whose result is not float, gets no plan (the template prints it as
traced); a non-additive mod (tanh soft-capping) is hoisted but never decomposed.

Where to look:
  - `ModPlan` ................................ the four groups of lines and the folded form
  - `plan_score_mod` ......................... the entry
  - `_fterms`, `_iterms`, `_split_to_float` .. the additive decomposition (float, integer)
  - `_Emitter` ............................... the lines, common subexpressions once, by group
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field
from functools import lru_cache

LOG2E = 1.4426950408889634
INT_EXACT = 2 ** 24            # integers below this convert to float32 exactly
_MAX_NODES = 4000              # a mod bigger than this once inlined is printed as traced
_VALUES = (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Call, ast.BoolOp, ast.IfExp)
_DEPS = {"score": "s", "q_idx": "q", "kv_idx": "k"}
_INTS = ("b", "h", "q_idx", "kv_idx", "q0")
_DTYPES = {"tl.float32": "f", "tl.float16": "f", "tl.bfloat16": "f", "tl.float64": "f",
           "tl.int32": "i", "tl.int64": "i", "tl.int1": "b"}


@dataclass
class ModPlan:
    """A score_mod's lines by where they run (`uniform`: once per program, (b, h) only; `row`:
    once per query block, q_idx = the rows; `col`: once per KV block, kv_idx = the keys; `tile`:
    per score) and how the score is formed from them. Folded (`result` None): the score is
    qk · `factor` + `column` (base 2, natural scale and log2 e included; `factor` None: the
    template's own scale · log2 e, `column` None: no column term). Else `result` is the
    per-score value in natural units. `dropped` names a (b, h, q_idx) value left out of every
    score (natural units, to add back to the LSE), or is None."""
    uniform: list
    row: list
    col: list
    tile: list
    result: str | None
    factor: str | None
    column: str | None
    dropped: str | None
    notes: list = field(default_factory=list)

    @property
    def folded(self) -> bool:
        return self.result is None


# ---- reading the lines ----


def _parse(lines: tuple, result: str):
    """The result's expression with every temporary inlined (ast, shared subtrees), or None."""
    env = {}
    try:
        for line in lines:
            stmt = ast.parse(line).body[0]
            if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1 or \
                    not isinstance(stmt.targets[0], ast.Name):
                return None
            env[stmt.targets[0].id] = _inline(stmt.value, env)
        tree = _inline(ast.parse(result, mode="eval").body, env)
    except (SyntaxError, IndexError):
        return None
    return tree if _size(tree, {}) <= _MAX_NODES else None


def _inline(node, env: dict):
    if isinstance(node, ast.Name):
        return env.get(node.id, node)
    node = copy.copy(node)
    for name, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            setattr(node, name, _inline(value, env))
        elif isinstance(value, list):
            setattr(node, name, [_inline(v, env) if isinstance(v, ast.AST) else v for v in value])
    return node


def _size(node, memo: dict) -> int:
    if id(node) not in memo:
        memo[id(node)] = 1 + sum(_size(c, memo) for c in ast.iter_child_nodes(node))
    return memo[id(node)]


def _deps(node) -> frozenset:
    """Which of score ('s'), q_idx ('q'), kv_idx ('k') the node reads ((b, h, q0): none)."""
    if isinstance(node, ast.Name):
        return frozenset(_DEPS[node.id]) if node.id in _DEPS else frozenset()
    out = frozenset()
    for c in ast.iter_child_nodes(node):
        out |= _deps(c)
    return out


def _text(node) -> str:
    return ast.unparse(node)


def _dtype(node):
    """'f' (float), 'i' (integer), 'b' (bool), or None when not known."""
    if isinstance(node, ast.Name):
        return "f" if node.id == "score" else "i" if node.id in _INTS else None
    if isinstance(node, ast.Constant):
        v = node.value
        return "b" if isinstance(v, bool) else "i" if isinstance(v, int) else "f" if isinstance(v, float) else None
    if isinstance(node, ast.UnaryOp):
        return _dtype(node.operand) if isinstance(node.op, (ast.USub, ast.UAdd)) else None
    if isinstance(node, ast.BinOp):
        a, b = _dtype(node.left), _dtype(node.right)
        if isinstance(node.op, ast.Div):
            return "f" if a and b else None
        if isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)) and a and b:
            return "f" if "f" in (a, b) else "i"
        return None
    if isinstance(node, ast.Compare):
        return "b"
    if isinstance(node, ast.Call):
        if _is_to(node):
            return _DTYPES.get(_text(node.args[0]))
        fn = _text(node.func)
        if fn == "tl.full" and len(node.args) == 3:
            return _DTYPES.get(_text(node.args[2]))
        if fn.startswith("libdevice.") or fn == "tl.sigmoid":
            return "f" if all(_dtype(a) == "f" for a in node.args) else None
        if fn in ("tl.where", "triton_helpers.maximum", "triton_helpers.minimum", "tl.abs") and node.args:
            return _dtype(node.args[-1])
    return None


def _is_to(node) -> bool:
    """`x.to(dtype)`, a conversion."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
            and len(node.args) == 1)


def _is_score(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "score"


# ---- the additive decomposition ----
#
# A term is (sign, factors, leaf): sign · leaf · Π factors, each factor ('*' or '/', a node of
# (b, h) only).


def _neg(terms: list) -> list:
    return [(-s, f, leaf) for s, f, leaf in terms]


def _times(terms: list, op: str, factor) -> list:
    return [(s, f + ((op, factor),), leaf) for s, f, leaf in terms]


def _fterms(node, ctx) -> list:
    """The float node as a sum of terms."""
    if _dtype(node) != "f":
        return [(1, (), node)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        right = _fterms(node.right, ctx)
        return _fterms(node.left, ctx) + (right if isinstance(node.op, ast.Add) else _neg(right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _neg(_fterms(node.operand, ctx))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        op = "*" if isinstance(node.op, ast.Mult) else "/"
        if not _deps(node.right) and _dtype(node.right) == "f":
            return _times(_fterms(node.left, ctx), op, node.right)
        if op == "*" and not _deps(node.left) and _dtype(node.left) == "f":
            return _times(_fterms(node.right, ctx), op, node.left)
    if _is_to(node) and _text(node.args[0]) == "tl.float32":
        return _split_to_float(node, ctx)
    return [(1, (), node)]


def _iterms(node) -> list:
    """The integer node as a sum of terms (int32 arithmetic is a ring: exact, given the bounds)."""
    if _dtype(node) != "i":
        return [(1, (), node)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        right = _iterms(node.right)
        return _iterms(node.left) + (right if isinstance(node.op, ast.Add) else _neg(right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _neg(_iterms(node.operand))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        if not _deps(node.right):
            return _times(_iterms(node.left), "*", node.right)
        if not _deps(node.left):
            return _times(_iterms(node.right), "*", node.left)
    return [(1, (), node)]


def _factor(factors: tuple):
    """Π factors as one node of (b, h) only (so that it runs once per program), or None."""
    out = None
    for op, f in factors:
        if out is None:
            out = f if op == "*" else ast.BinOp(ast.Constant(1.0), ast.Div(), f)
        else:
            out = ast.BinOp(out, ast.Mult() if op == "*" else ast.Div(), f)
    return out


def _sum(terms: list):
    """The node of Σ sign · leaf · Π factors (None for no terms); a leaf of 1.0 is left out."""
    out = None
    for sign, factors, leaf in terms:
        f = _factor(factors)
        one = isinstance(leaf, ast.Constant) and leaf.value == 1.0
        x = leaf if f is None else f if one else ast.BinOp(leaf, ast.Mult(), f)
        if out is None:
            out = x if sign > 0 else ast.UnaryOp(ast.USub(), x)
        else:
            out = ast.BinOp(out, ast.Add() if sign > 0 else ast.Sub(), x)
    return out


def _subst(node, name: str, new: str):
    if isinstance(node, ast.Name):
        return ast.Name(new) if node.id == name else node
    node = copy.copy(node)
    for fname, value in ast.iter_fields(node):
        if isinstance(value, ast.AST):
            setattr(node, fname, _subst(value, name, new))
        elif isinstance(value, list):
            setattr(node, fname, [_subst(v, name, new) if isinstance(v, ast.AST) else v for v in value])
    return node


def _bounds(node, ctx: dict):
    """(lo, hi) of an integer node, or None when not known (or not an integer)."""
    if isinstance(node, ast.Name):
        return ctx.get(node.id)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value, node.value
    if isinstance(node, ast.Call) and _text(node.func) == "tl.full" and len(node.args) == 3 \
            and _dtype(node) == "i" and isinstance(node.args[1], ast.Constant):
        return _bounds(node.args[1], ctx)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        b = _bounds(node.operand, ctx)
        return None if b is None else (-b[1], -b[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _bounds(node.left, ctx), _bounds(node.right, ctx)
        if a is None or b is None:
            return None
        if isinstance(node.op, ast.Add):
            return a[0] + b[0], a[1] + b[1]
        if isinstance(node.op, ast.Sub):
            return a[0] - b[1], a[1] - b[0]
        p = [x * y for x in a for y in b]
        return min(p), max(p)
    return None


def _exact(node, ctx: dict) -> bool:
    """Every integer inside `node` is known to lie below 2^24 (so float(x) is exact, and int32
    arithmetic did not wrap)."""
    for n in ast.walk(node):
        if _dtype(n) == "i" and not isinstance(n, ast.Attribute):
            b = _bounds(n, ctx)
            if b is None or max(abs(b[0]), abs(b[1])) >= INT_EXACT:
                return False
    return True


def _to_float(node):
    return ast.Call(ast.Attribute(node, "to"), [ast.Attribute(ast.Name("tl"), "float32")], [])


def _split_to_float(node, ctx: dict) -> list:
    """float(rows(q_idx) + cols(kv_idx)) as float(rows(q_idx) - rows(q0)) + float(rows(q0) + cols):
    a row term and a column term, both exact under the bounds; else the conversion is one leaf."""
    x = node.func.value
    if _dtype(x) != "i":
        return [(1, (), node)]
    groups = {"q": [], "k": [], "": []}
    for t in _iterms(x):
        d = "".join(sorted(_deps(t[2])))
        if d not in groups:
            return [(1, (), node)]
        groups[d].append(t)
    if not groups["q"] or not groups["k"]:
        return [(1, (), node)]
    rows = _sum(groups["q"])
    rows0 = _subst(rows, "q_idx", "q0")
    left = ast.BinOp(rows, ast.Sub(), rows0)
    right = _sum([(1, (), rows0)] + groups[""] + groups["k"])
    if not all(_exact(n, ctx) for n in (x, left, right)):
        return [(1, (), node)]
    return [(1, (), _to_float(left)), (1, (), _to_float(right))]


# ---- emitting the lines ----


class _Emitter:
    """Each value node once (common subexpressions by their text), in the group its
    dependencies say: 'u' (b, h), 'r' (q_idx), 'c' (kv_idx), 's' (per score)."""

    def __init__(self, prefix: str):
        self.prefix, self.memo, self.count = prefix, {}, 0
        self.groups = {"u": [], "r": [], "c": [], "s": []}

    def emit(self, node) -> str:
        if not isinstance(node, _VALUES):
            return _text(self._rebuild(node))
        key = ast.dump(node)
        if key not in self.memo:
            text = _text(self._rebuild(node))
            d = _deps(node)
            group = "s" if "s" in d or d == {"q", "k"} else "r" if d == {"q"} else "c" if d == {"k"} else "u"
            name = f"{self.prefix}{group}{self.count}"
            self.count += 1
            self.groups[group].append(f"{name} = {text}")
            self.memo[key] = name
        return self.memo[key]

    def _rebuild(self, node):
        """The node with each value child replaced by its emitted name."""
        node = copy.copy(node)
        for fname, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, fname, self._child(value))
            elif isinstance(value, list):
                setattr(node, fname, [self._child(v) if isinstance(v, ast.expr) else
                                      ast.keyword(v.arg, self._child(v.value)) if isinstance(v, ast.keyword)
                                      else v for v in value])
        return node

    def _child(self, value):
        return ast.Name(self.emit(value)) if isinstance(value, _VALUES) else self._rebuild(value)


def _short(node, limit: int = 90) -> str:
    text = _text(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _product(terms: list):
    """The node of Σ sign · Π factors of terms whose leaf is the score (None: exactly 1)."""
    if len(terms) == 1 and terms[0][0] == 1 and not terms[0][1]:
        return None
    ones = [(s, f, ast.Constant(1.0)) for s, f, _ in terms]
    return _sum(ones)


@lru_cache(maxsize=256)
def plan_score_mod(lines: tuple, result: str, bounds: tuple, scale: float, prefix: str = "mod_") -> ModPlan | None:
    """The plan of a score_mod's printed lines. `bounds` is ((name, lo, hi), ...) for b, h,
    q_idx, kv_idx (q0 takes q_idx's); `scale` is the template's (folded into `factor`);
    None: print the mod as traced."""
    tree = _parse(lines, result)
    if tree is None or _dtype(tree) != "f":
        return None
    ctx = {name: (lo, hi) for name, lo, hi in bounds}
    ctx["q0"] = ctx["q_idx"]
    kinds = {"score": [], "drop": [], "col": [], "tile": []}
    for term in _fterms(tree, ctx):
        d = _deps(term[2])
        kind = "score" if _is_score(term[2]) else "drop" if d <= {"q"} else "col" if d == {"k"} else "tile"
        kinds[kind].append(term)
    em = _Emitter(prefix)
    dropped = _sum(kinds["drop"])
    if not kinds["tile"] and kinds["score"]:                 # c · score + col: folded
        coef = _product(kinds["score"])
        factor = None if coef is None else em.emit(ast.BinOp(coef, ast.Mult(), ast.Constant(scale * LOG2E)))
        # (log2 e and the sign join each column term's (b, h) factor: one product per column)
        base2 = [(1, f + (("*", ast.Constant(s * LOG2E)),), leaf) for s, f, leaf in kinds["col"]]
        column = em.emit(_sum(base2)) if base2 else None
        plan = ModPlan([], [], [], [], None, factor, column, None)
    else:
        kept = tree if dropped is None else _sum(kinds["score"] + kinds["col"] + kinds["tile"])
        plan = ModPlan([], [], [], [], em.emit(kept if kept is not None else ast.Constant(0.0)), None, None, None)
    if dropped is not None:
        plan.dropped = em.emit(dropped)
    plan.uniform, plan.row, plan.col, plan.tile = (em.groups[g] for g in "urcs")
    plan.notes = [f"score_mod, hoisted by what it reads: {len(plan.uniform)} ops of (b, h) only, {len(plan.row)} of "
                  f"q_idx only, {len(plan.col)} of kv_idx only; {len(plan.tile)} per score"]
    if dropped is not None:
        plan.notes.append(f"{plan.dropped}: dropped from the scores (one value per row, which the softmax does not "
                          "see), added back to the LSE")
    if plan.folded:
        plan.notes.append(f"folded into exp2's argument: qk * {plan.factor or 'scale * log2 e'}"
                          + (f" + {plan.column}" if plan.column else "") + ", one FMA per score")
    return plan


def _is_one(node) -> bool:
    """tl.full([1, 1], 1.0, ...) (or 1.0): the derivative of score + anything of the indices."""
    if isinstance(node, ast.Call) and _text(node.func) == "tl.full" and len(node.args) == 3:
        node = node.args[1]
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == 1


@lru_cache(maxsize=256)
def hoist_mod(lines: tuple, result: str, prefix: str = "dmod_") -> ModPlan | None:
    """Only the hoisting of `plan_score_mod` (for ∂score_mod/∂score in the backward: nothing
    dropped, nothing folded): `result` names the per-score value, "1.0" when it is the constant
    one (the factor can be left out). None: the lines as traced."""
    tree = _parse(lines, result)
    if tree is None:
        return None
    if _is_one(tree):
        return ModPlan([], [], [], [], "1.0", None, None, None)
    em = _Emitter(prefix)
    out = em.emit(tree)
    return ModPlan(*(em.groups[g] for g in "urcs"), out, None, None, None)
