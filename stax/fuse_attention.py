"""§9.10 The attention pattern: hand-written softmax(q kᵀ · s) v becomes one `sdpa` node.

Layer: a graph pass between capture (§3) and lowering (§6): it reads and rewrites a
`capture.Graph` and imports capture.py and tensor.py (Node, Meta), attention_kernels.py to ask
whether the template covers a match, and autograd.py (§5: the tape of a training capture).
`__init__._compile_graph` runs it for the GPU, where an `sdpa` node prints as the flash template
(codegen_triton.py) and the N × N scores never reach memory (Theorem 9.2); partition.py runs
`fuse_attention_for_training` on the forward half of a joint graph before its backward is traced.

Consumes a captured Graph; produces the same Graph with each matched pattern's final matmul turned
into an `sdpa` node and the nodes only the pattern used removed.

The pattern, read backward from the second matmul (what `stax.softmax` records, §6.2's casts
included):

    matmul(P, V);  P = [to_dtype] div(E, sum(E, -1));  E = exp(sub(X, amax(X, -1)));  X = [to_dtype] S'
    S' = mul(S', c) | mul(c, S') | div(S', c)            the scale (c a positive constant to pass a mask)
       | add(S', mask) | add(mask, S')                    an additive mask: the last op before softmax
       | where(keep, S', -inf)                            a bool mask (tril/arange comparisons included)
       | where(drop, -inf, S')                            masked_fill(drop, -inf): keep = not drop
       | matmul(Q, Kᵀ)                                    Kᵀ a permute of K, or any [.., D, N] value

Dropout at inference records nothing, so it needs no case; in training it records a random mask
between P and the matmul, which the pattern does not match. Anything else (a second mask, a
positional bias added before the scale, an intermediate used outside the pattern, a softmax over
another dim, in training a mask that requires grad) is left alone: the ordinary kernels compute it,
never a wrong answer.

Training (§5): the rewrite happens before the joint graph's backward exists, so that the backward
is sdpa's derivative (the dK/dV and dQ templates from the saved LSE) rather than the operator-by-
operator backward of the pattern: rewriting the backward too, after the fact, would mean matching
what autograd makes of softmax and two matmuls, a second pattern as long as the first and brittle.

Where to look:
  - `_match_scores` ......... S' back to the first matmul: scale, masks
  - `_match` ................ the whole pattern at one matmul
  - `_causal_values` ........ a mask that is data (nanoGPT's tril buffer), causal by its values:
                              computed once per compile, its tensors guarded (graph.value_guards)
  - `_rewrite` .............. one match -> the sdpa node
  - `fuse_attention(graph)` . the entry point
  - `fuse_attention_for_training` . §5: the forward half of a joint graph, and its autograd tape
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np

from .attention_kernels import as_operand, make_spec
from . import autograd
from .capture import Node, _apply_view, _contiguous_strides, call_aliasing, input_tensors
from .dtypes import bool_, float32
from .op_table import OPS
from .template_tuning import input_precision
from .tensor import VIEW_OPS, Meta, Tensor, _run_eager, set_tracer

NEG_INF = float("-inf")


@dataclass
class AttentionMatch:
    q: Node
    k_t: Node                     # [.., D, N]: K transposed
    v: Node
    scale: float = 1.0
    mask: Node | None = None
    drop: bool = False            # the mask says where to drop (masked_fill), not where to keep
    used: list = field(default_factory=list)      # nodes only the pattern reads (removed)


def _uses(graph) -> dict:
    """Node -> how many times nodes, outputs and write-backs read it."""
    count: dict = {}
    for n in graph.nodes:
        for a in n.inputs:
            for x in (a if isinstance(a, list) else [a]):
                if isinstance(x, Node):
                    count[x] = count.get(x, 0) + 1
    for x in list(graph.outputs) + [new for _, new in graph.mutations]:
        if isinstance(x, Node):
            count[x] = count.get(x, 0) + 100          # a graph output is never removed
    return count


def _ancestors(node: Node) -> list:
    """`node` and every node it reads, transitively (removal candidates: dead ones go)."""
    out, todo = [], [node]
    while todo:
        x = todo.pop()
        if isinstance(x, Node) and x.op not in ("placeholder", "constant") and not any(x is y for y in out):
            out.append(x)
            todo += [y for a in x.inputs for y in (a if isinstance(a, list) else [a])]
    return out


def _is_last_dim(node: Node) -> bool:
    dims = node.params.get("dims")
    return (node.params.get("keepdim") and isinstance(dims, tuple) and len(dims) == 1
            and dims[0] in (-1, len(node.inputs[0].meta.shape) - 1))


def _neg_inf(x) -> bool:
    """-inf, as a number or as masked_fill's one-element `full` tensor."""
    if isinstance(x, Node):
        p = x.params
        return x.op == "full" and p.get("value") == NEG_INF and all(d == 1 for d in p.get("shape", (2,)))
    return x == NEG_INF


def _scalar(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _match_scores(x: Node, m: AttentionMatch, uses: dict) -> Node | None:
    """Walk S' back to matmul(Q, Kᵀ), collecting the scale and one mask; the matmul, or None."""
    positive, scaled = True, False               # walking backward: a mask met after a scale was
                                                 # added before it
    while isinstance(x, Node) and uses.get(x, 0) == 1:
        m.used.append(x)
        a = x.inputs
        if x.op == "matmul":
            m.q, m.k_t = a
            return x if (m.mask is None or positive) else None
        if x.op == "to_dtype":
            x = a[0]
        elif x.op == "mul" and (_scalar(a[1]) is not None or _scalar(a[0]) is not None):
            c = _scalar(a[1]) if _scalar(a[1]) is not None else _scalar(a[0])
            if c == 0:
                return None
            m.scale, positive, scaled = m.scale * c, positive and c > 0, True
            x = a[0] if _scalar(a[1]) is not None else a[1]
        elif x.op == "div" and _scalar(a[1]) not in (None, 0):
            m.scale, positive, scaled = m.scale / a[1], positive and a[1] > 0, True
            x = a[0]
        elif x.op == "add" and m.mask is None and not scaled and all(isinstance(y, Node) for y in a):
            side = 0 if a[1].meta.shape == x.meta.shape and a[0].meta.shape != x.meta.shape else 1
            m.mask, x = a[side], a[1 - side]        # S · s + mask: the template's additive mask
            if m.mask.meta.dtype.name == "bool" or not m.mask.meta.dtype.is_floating_point:
                return None
        elif x.op == "where" and m.mask is None and isinstance(a[0], Node) and _neg_inf(a[2]) \
                and isinstance(a[1], Node) and a[0].meta.dtype.name == "bool":
            m.mask, x = a[0], a[1]
            m.used += [a[2]] if isinstance(a[2], Node) else []
        elif x.op == "where" and m.mask is None and isinstance(a[0], Node) and _neg_inf(a[1]) \
                and isinstance(a[2], Node) and a[0].meta.dtype.name == "bool":
            m.mask, m.drop, x = a[0], True, a[2]    # masked_fill(drop, -inf): keep = not drop
            m.used += [a[1]] if isinstance(a[1], Node) else []
        else:
            return None
    return None


def _arange_along(x, size, axis: int, rank: int) -> bool:
    """Is `x` arange(0, size) laid along `axis` of a [.., M, N] score (size 1 elsewhere)?"""
    while isinstance(x, Node) and x.op in ("reshape", "expand") and len(x.meta.shape) <= rank:
        shape = tuple(x.meta.shape)
        if any(d != 1 for i, d in enumerate(shape) if i != len(shape) + axis):
            return False
        x = x.inputs[0]
    p = x.params if isinstance(x, Node) and x.op == "arange" else {}
    return p.get("start") == 0 and p.get("step") == 1 and p.get("end") == size


def _is_causal(keep: Node, score_shape: tuple, drop: bool = False) -> bool:
    """keep = (q_idx >= kv_idx) from two aranges (or kv_idx <= q_idx): the top-left causal mask;
    with `drop`, the mask says where to drop: q_idx < kv_idx (or kv_idx > q_idx)."""
    ops = ("lt", "gt") if drop else ("ge", "le")
    if keep.op not in ops or not all(isinstance(x, Node) for x in keep.inputs):
        return False
    rows, cols = keep.inputs if keep.op == ops[0] else keep.inputs[::-1]
    m, n = score_shape[-2:]
    rank = len(score_shape)
    return _arange_along(rows, m, -2, rank) and _arange_along(cols, n, -1, rank)


# ---- §9.10 A mask that is data: causal by its values, read once per compile ----
#
# nanoGPT's mask is a buffer, `tril(ones(block, block))`, read as `self.bias[:, :, :T, :T] == 0`
# from a module attribute (a lifted constant, capture.py) or passed as an argument (a
# placeholder); `tril` inside the function records comparisons of aranges under a `where`. Either
# way the aranges test above does not see it. When the function compiles, the mask's values are
# known: `_mask_values` computes them from the real tensors behind its leaves (eagerly, the ops the
# call would run), and a mask whose values are exactly the top-left causal pattern takes the
# causal loop. The code then no longer reads those tensors, so it is right only while they hold
# those values: each leaf tensor becomes a value guard (graph.value_guards: its storage and its
# version, which every write bumps), checked on every call by runtime.guard_values; another tensor
# there, or a write to it since, raises runtime.ValuesChanged and the function compiles again with
# the mask as data (`values=None` from then on: a mask that changes is data).

MASK_VALUES_LIMIT = 1 << 24     # elements: a larger mask is not read at compile time


def _mask_leaves(mask: Node) -> tuple | None:
    """(the input nodes the mask is computed from, its op nodes), or None when an op in between
    is not a deterministic elementwise, view or factory op (a random mask differs per call)."""
    leaves, ops, todo = [], [], [mask]
    while todo:
        x = todo.pop()
        if not isinstance(x, Node) or any(x is y for y in leaves + ops):
            continue
        if x.op in ("placeholder", "constant"):
            leaves.append(x)
            continue
        d = OPS.get(x.op)
        if d is None or d.fallback or d.kind not in ("unary", "binary", "pointwise", "view", "factory"):
            return None
        ops.append(x)
        todo += [y for a in x.inputs for y in (a if isinstance(a, list) else [a])]
    return leaves, ops


def _mask_values(graph, mask: Node, values: dict) -> tuple | None:
    """(the mask's values as a numpy array, the input nodes they came from), computed from the
    real tensors in `values` (input node name -> tensor); None when it reads anything else."""
    found = _mask_leaves(mask)
    n = 1
    for d in mask.meta.shape:
        n *= d if isinstance(d, int) else MASK_VALUES_LIMIT
    if found is None or n > MASK_VALUES_LIMIT:
        return None
    leaves, ops = found
    # only device tensors: their memory is written through Stax alone (eager writes and compiled
    # write-backs bump the version); a CPU tensor may share an ndarray's memory (from_numpy)
    env = {x: values.get(x.name) for x in leaves}
    if any(t is None or t._storage is None or not str(t.device).startswith("cuda") for t in env.values()):
        return None
    order = [x for x in graph.nodes if any(x is y for y in ops)]
    prev = set_tracer(None)                  # (training: this runs while the joint graph is traced)
    try:
        with autograd.no_grad():
            for x in order:
                args = [[env[y] for y in a] if isinstance(a, list) else env[a] if isinstance(a, Node) else a
                        for a in x.inputs]
                env[x] = _apply_view(args[0], x.op, x.params) if x.op in VIEW_OPS else \
                    _run_eager(x.op, args, x.params, [x.meta])[0]
                if tuple(env[x].shape) != tuple(x.meta.shape):
                    return None
    finally:
        set_tracer(prev)
    return np.asarray(env[mask]._compute()), leaves


def _causal_values(graph, m: AttentionMatch, score_shape: tuple, values: dict) -> list | None:
    """The input nodes to guard when the mask's values are exactly the top-left causal pattern of
    a [.., M, N] score (query i keeps keys j <= i, PyTorch's is_causal also for M != N): a bool
    mask that keeps (or with `drop` drops) just those, or an additive one of 0 there and -inf
    elsewhere; None otherwise. The mask must broadcast to the score as it is (dropping it must
    not change the result's shape)."""
    shape = tuple(m.mask.meta.shape)
    if len(shape) > len(score_shape) or any(d not in (1, s) for d, s in zip(shape[::-1], score_shape[::-1])):
        return None
    got = _mask_values(graph, m.mask, values)
    if got is None:
        return None
    a, leaves = got
    mq, nk = score_shape[-2:]
    tri = np.arange(nk)[None, :] <= np.arange(mq)[:, None]
    if a.dtype == np.bool_:
        ok = np.all((~a if m.drop else a) == tri)
    else:
        ok = np.all(np.where(tri, a == 0, a == NEG_INF))
    return leaves if ok else None


def _guard_values(graph, leaves: list, values: dict, why: str):
    for x in leaves:
        st = values[x.name]._storage
        graph.value_guards[x] = (why, weakref.ref(st), st.version)


def _match(mm2: Node, uses: dict) -> AttentionMatch | None:
    """The whole pattern ending at `mm2` = matmul(P, V), or None."""
    p, v = mm2.inputs
    m = AttentionMatch(None, None, v)
    chain = []
    while isinstance(p, Node) and p.op == "to_dtype" and uses.get(p, 0) == 1:
        chain.append(p)
        p = p.inputs[0]
    if not (isinstance(p, Node) and p.op == "div" and uses.get(p, 0) == 1):
        return None
    e, total = p.inputs
    if not (isinstance(e, Node) and isinstance(total, Node) and e.op == "exp" and total.op == "sum"
            and total.inputs[0] is e and _is_last_dim(total) and uses.get(e, 0) == 2
            and uses.get(total, 0) == 1):
        return None
    sub = e.inputs[0]
    if not (isinstance(sub, Node) and sub.op == "sub" and uses.get(sub, 0) == 1):
        return None
    x, mx = sub.inputs
    if not (isinstance(mx, Node) and mx.op == "amax" and mx.inputs[0] is x and _is_last_dim(mx)
            and uses.get(mx, 0) == 1 and uses.get(x, 0) == 2):
        return None
    uses = dict(uses)
    uses[x] = 1                                   # amax and sub both read X: the pattern's own reads
    chain += [p, e, total, sub, mx]
    if _match_scores(x, m, uses) is None:
        return None
    m.used = chain + m.used
    return m


def _template_runs(m: AttentionMatch, mm2: Node) -> bool:
    """Rewrite only what the template computes (static sizes, rank ≤ 4, a float dtype it has, head
    dim ≤ 256, ...): otherwise the sdpa node would run on the host, slower than the ordinary
    kernels it replaced."""
    def operand(meta, swap=False):
        shape, stride = tuple(meta.shape), tuple(meta.stride)
        if swap:
            shape, stride = shape[:-2] + shape[:-3:-1], stride[:-2] + stride[:-3:-1]
        return as_operand(shape, stride, meta.offset)
    mask = operand(m.mask.meta) if m.mask is not None else None
    mask_dtype = m.mask.meta.dtype.name if m.mask is not None else ""
    return make_spec(operand(m.q.meta), operand(m.k_t.meta, swap=True), operand(m.v.meta),
                     operand(mm2.meta), mm2.meta.dtype.name, m.scale, False, mask, mask_dtype) is not None


def _key_of(graph, m: AttentionMatch, before: Node) -> Node:
    """K [.., N, D]: the permute's input when Kᵀ is K.transpose(-2, -1), else a new permute."""
    kt = m.k_t
    n = len(kt.meta.shape)
    swap = tuple(range(n - 2)) + (n - 1, n - 2)
    if kt.op == "permute" and tuple(kt.params.get("dims", ())) == swap:
        m.used.append(kt)                         # removed below unless another node reads it
        return kt.inputs[0]
    meta = Meta(tuple(kt.meta.shape[i] for i in swap), tuple(kt.meta.stride[i] for i in swap),
                kt.meta.dtype, kt.meta.device, kt.meta.offset)
    node = Node(f"{before.name}_key", "permute", [kt], {"dims": swap}, meta)
    graph.nodes.insert(graph.nodes.index(before), node)
    return node


def _remove_dead(graph, candidates: list):
    """Remove the candidates nothing reads any more, until none is left (they read each other)."""
    while True:
        read = _uses(graph)
        dead = [n for n in candidates if n in graph.nodes and read.get(n, 0) == 0]
        if not dead:
            return
        graph.nodes = [n for n in graph.nodes if not any(n is d for d in dead)]


def _keep_of(graph, m: AttentionMatch, before: Node) -> Node:
    """masked_fill's mask says where to drop; the template's bool mask says where to keep."""
    drop = m.mask
    meta = Meta(tuple(drop.meta.shape), _contiguous_strides(drop.meta.shape), bool_, drop.meta.device, 0)
    node = Node(f"{before.name}_keep", "logical_not", [drop], {}, meta)
    graph.nodes.insert(graph.nodes.index(before), node)
    return node


def _rewrite(graph, mm2: Node, m: AttentionMatch, values: dict | None = None) -> tuple:
    """Turn `mm2` into the `sdpa` node of match `m`, removing what only the pattern read;
    (K, the template's mask or None, causal). `values`: the real tensors behind input nodes, by
    name, whose values a mask may be found causal by (guarded); None: none."""
    key = _key_of(graph, m, mm2)
    score = tuple(m.q.meta.shape[:-1]) + (key.meta.shape[-2],)
    causal = m.mask is not None and m.mask.meta.dtype.name == "bool" and _is_causal(m.mask, score, m.drop)
    if m.mask is not None and not causal and values is not None:
        leaves = _causal_values(graph, m, score, values)
        if leaves is not None:
            causal = True
            _guard_values(graph, leaves, values, f"the mask of sdpa_{mm2.name} is causal by its values "
                          "(is_causal=True)")
    if causal:
        m.used += _ancestors(m.mask)          # no M x N mask in memory: the template's causal loop
    mask = None if m.mask is None or causal else _keep_of(graph, m, mm2) if m.drop else m.mask
    mm2.op, mm2.params = "sdpa", {"is_causal": causal, "scale": float(m.scale)}
    mm2.name = f"sdpa_{mm2.name}"             # the kernel's comment names what it computes
    mm2.inputs = [m.q, key, m.v] + ([mask] if mask is not None else [])
    _remove_dead(graph, m.used)
    return key, mask, causal


REWRITE_ENV = "STAX_ATTENTION_REWRITE"     # "0": leave hand-written attention as it is written
                                           # (to compare the two forms; kernels are keyed by
                                           # their text, so caches stay sound)


# IEEE float32 flash kernels (set_float32_matmul_precision("highest"), the default) run on the
# FMA units with small tiles: the GPT-2 block's training step (B8 T1024 d64) took 59.3 ms on the
# H200 with them against 51.0 ms with cuBLAS's SIMT GEMMs and the fused softmax kernels, so in
# training only TF32 and half precision are rewritten by default (inference is rewritten always:
# there the template saves the N x N scores' round trips and no backward recomputes them).
TRAIN_IEEE_FLOAT32 = False


def rewrite_enabled() -> bool:
    return os.environ.get(REWRITE_ENV, "1") != "0"


def _template_match(graph, mm2: Node) -> AttentionMatch | None:
    """The pattern ending at matmul `mm2` (still in the graph: an earlier rewrite may have removed
    it), when the template can compute it; else None."""
    if mm2 not in graph.nodes:
        return None
    m = _match(mm2, _uses(graph))
    if m is None or len(m.q.meta.shape) != len(mm2.meta.shape) or not _template_runs(m, mm2):
        return None
    return m


def _call_values(graph, call) -> dict:
    """Input node name -> tensor: the call's (args, kwargs) behind the placeholders (none when
    inputs share memory: their placeholders are views of a base), and the graph's constants."""
    tensors = input_tensors(*call)
    ph = [n for n in graph.inputs if n.op == "placeholder"]
    own = len(ph) == len(tensors) and call_aliasing(*call) is None
    return {**({n.name: t for n, t in zip(ph, tensors)} if own else {}), **graph.constants}


def fuse_attention(graph, call=None):
    """Rewrite every matched attention pattern in place into one `sdpa` node; returns the graph.
    `call`: the (args, kwargs) captured; a mask computed from its tensors and the graph's
    constants alone may be found causal by their values (guarded); None: masks stay data."""
    if not rewrite_enabled():
        return graph
    values = _call_values(graph, call) if call is not None else None
    for mm2 in [n for n in graph.nodes if n.op == "matmul"]:
        m = _template_match(graph, mm2)
        if m is not None:
            _rewrite(graph, mm2, m, values)
    return graph


# ---- §5 / §9.10 In a compiled training step: the forward rewritten before its backward is traced ----
#
# partition.capture_joint runs the function on proxies that take part in autograd, then autograd's
# engine from the tangents. Between the two the forward half of the joint graph is rewritten here,
# and so is the autograd tape behind it: the GradNode of the final matmul becomes an `sdpa` node
# recorded with its LSE (what attention.py records for scaled_dot_product_attention on inputs that
# require grad), so the engine traces one `attn_bwd` node, the forward saves q, k, v, out and the
# LSE, and the nodes of the pattern (the N x N scores) are in neither graph.


def _node_of(tracer, x):
    return x._node if x._node is not None else tracer.const_ids.get(id(x))


def _tape(tracer, leaves) -> dict:
    """Graph node -> the proxy holding it, for every tensor on the autograd tape behind `leaves`."""
    found, seen, todo = {}, set(), list(leaves)
    for t in leaves:
        found.setdefault(_node_of(tracer, t), t)
    while todo:
        g = todo.pop()._grad_fn
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        for x in [y for a in getattr(g, "inputs", []) for y in (a if isinstance(a, list) else [a])]:
            if isinstance(x, Tensor):
                found.setdefault(_node_of(tracer, x), x)
                todo.append(x)
    return found


def _pattern_tensors(tracer, out: Tensor, inside: set) -> dict | None:
    """The pattern's proxies (node -> tensor), from its output down the tape through the nodes
    `inside` it; None when the tape and the graph disagree (a value rebound by an in-place update
    after it was read): then the pattern keeps its operator-by-operator backward."""
    found, todo = {out._node: out}, [out]
    while todo:
        t = todo.pop()
        g, n = t._grad_fn, t._node
        if g is None:                   # nothing below requires grad (else this would have a node)
            continue
        if getattr(g, "op", None) != n.op or len(g.inputs) != len(n.inputs):
            return None
        for a, x in zip(n.inputs, g.inputs):
            if isinstance(a, list) or isinstance(x, list):
                return None
            if isinstance(x, Tensor):
                if _node_of(tracer, x) is not a:
                    return None
                found[a] = x
                if a in inside:
                    todo.append(x)
    return found


def _trainable(m: AttentionMatch, mm2: Node, ts: dict) -> bool:
    """What sdpa's derivative takes (attention._check_grad_inputs): one dtype, the same batch dims,
    and a mask that needs no gradient (a learned positional bias keeps the ordinary backward)."""
    q, kt, v = (x.meta for x in (m.q, m.k_t, m.v))
    if not (q.dtype is kt.dtype is v.dtype is mm2.meta.dtype) or len(q.shape) < 3:
        return False
    if q.dtype is float32 and input_precision() == "ieee" and not TRAIN_IEEE_FLOAT32:
        return False
    if not (tuple(q.shape[:-3]) == tuple(kt.shape[:-3]) == tuple(v.shape[:-3])):
        return False
    mask = ts.get(m.mask) if m.mask is not None else None
    return mask is None or not mask.requires_grad


def _proxy(tracer, node: Node, found: dict) -> Tensor:
    """The proxy of `node` on the tape, else a new one: a value no gradient reaches."""
    t = found.get(node)
    return t if t is not None else Tensor._proxy(tracer._proxy_meta(node.meta), node)


def _retape(tracer, mm2: Node, m: AttentionMatch, key: Node, mask: Node | None, causal: bool, ts: dict):
    """Give the rewritten `sdpa` node its LSE (an `attn_lse` node before it) and turn the matmul's
    GradNode, in place (the consumers' edges point at it), into sdpa's."""
    graph, out = tracer.graph, ts[mm2]
    ins = [m.q, key, m.v] + ([mask] if mask is not None else [])
    params = {"is_causal": causal, "scale": float(m.scale)}
    shape = tuple(m.q.meta.shape[:-1])
    lse = Node(f"{mm2.name}_lse", "attn_lse", list(ins), dict(params),
               Meta(shape, _contiguous_strides(shape), float32, m.q.meta.device, 0))
    graph.nodes.insert(graph.nodes.index(mm2), lse)
    mm2.inputs = ins + [lse]
    mm2.params = {**params, "with_lse": True}
    k_t = ts.get(key)
    if k_t is None:
        k_t = _proxy(tracer, key, {})
        kT = ts.get(m.k_t)
        if key.op == "permute" and key.inputs[0] is m.k_t and kT is not None and kT.requires_grad:
            autograd.record("permute", [kT], dict(key.params), [k_t])   # (the new K = Kᵀ transposed)
    tensors = [_proxy(tracer, m.q, ts), k_t, _proxy(tracer, m.v, ts)] + \
        ([_proxy(tracer, mask, ts)] if mask is not None else []) + [_proxy(tracer, lse, {})]
    grad_fn = out._grad_fn
    grad_fn.__dict__.update(autograd.GradNode("sdpa", tensors, mm2.params, out).__dict__)


def fuse_attention_for_training(tracer, leaves: list, outputs: list, real: list | None = None) -> list:
    """§5: rewrite the forward traced so far (the function's result: `leaves`, their nodes
    `outputs`) before its backward is traced; the names of the `sdpa` nodes made. Only for the
    GPU, as `fuse_attention` (on the CPU the ordinary kernels beat a float64 host op), with
    static sizes; a pattern no gradient flows through is left to `fuse_attention`. `real`: the
    call's tensors (placeholder sources), whose values a mask may be found causal by; None: none."""
    graph = tracer.graph
    matmuls = [n for n in graph.nodes if n.op == "matmul" and str(n.meta.device).startswith("cuda")]
    if not rewrite_enabled() or tracer.shape_env is not None or not matmuls:
        return []
    values = None
    if real is not None:
        values = {n.name: real[tracer.sources[n]] for n in graph.inputs
                  if n.op == "placeholder" and tracer.sources.get(n, len(real)) < len(real)}
        values.update(graph.constants)
    tape, made = _tape(tracer, leaves), []
    kept, graph.outputs = graph.outputs, list(graph.outputs) + list(outputs)   # (outputs are uses)
    try:
        for mm2 in matmuls:
            out = tape.get(mm2)
            if out is None or out._grad_fn is None:
                continue
            m = _template_match(graph, mm2)
            if m is None:
                continue
            ts = _pattern_tensors(tracer, out, set(m.used) | {m.k_t})
            if ts is None or not _trainable(m, mm2, ts):
                continue
            key, mask, causal = _rewrite(graph, mm2, m, values)
            _retape(tracer, mm2, m, key, mask, causal, ts)
            made.append(mm2.name)
    finally:
        graph.outputs = kept
    return made
