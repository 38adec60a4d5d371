"""§9.10 The attention pattern: hand-written softmax(q kᵀ · s) v becomes one `sdpa` node.

Layer: a graph pass between capture (§3) and lowering (§6): it reads and rewrites a
`capture.Graph` and imports capture.py and tensor.py (Node, Meta), and attention_kernels.py to ask
whether the template covers a match. `__init__._compile_graph`
runs it for the GPU, where an `sdpa` node prints as the flash template (codegen_triton.py) and
the N × N scores never reach memory (Theorem 9.2).

Consumes a captured Graph; produces the same Graph with each matched pattern's final matmul turned
into an `sdpa` node and the nodes only the pattern used removed.

The pattern, read backward from the second matmul (what `stax.softmax` records, §6.2's casts
included):

    matmul(P, V);  P = [to_dtype] div(E, sum(E, -1));  E = exp(sub(X, amax(X, -1)));  X = [to_dtype] S'
    S' = mul(S', c) | mul(c, S') | div(S', c)            the scale (c a positive constant to pass a mask)
       | add(S', mask) | add(mask, S')                    an additive mask: the last op before softmax
       | where(keep, S', -inf)                            a bool mask (tril/arange comparisons included)
       | matmul(Q, Kᵀ)                                    Kᵀ a permute of K, or any [.., D, N] value

Dropout at inference records nothing, so it needs no case. Anything else (a second mask, a
positional bias added before the scale, an intermediate used outside the pattern, a softmax over
another dim) is left alone: the ordinary kernels compute it, never a wrong answer.

Where to look:
  - `_match_scores` ......... S' back to the first matmul: scale, masks
  - `_match` ................ the whole pattern at one matmul
  - `fuse_attention(graph)` . the entry point
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .attention_kernels import as_operand, make_spec
from .capture import Node
from .tensor import Meta

NEG_INF = float("-inf")


@dataclass
class AttentionMatch:
    q: Node
    k_t: Node                     # [.., D, N]: K transposed
    v: Node
    scale: float = 1.0
    mask: Node | None = None
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
        elif x.op == "where" and m.mask is None and isinstance(a[0], Node) and a[2] == NEG_INF \
                and isinstance(a[1], Node) and a[0].meta.dtype.name == "bool":
            m.mask, x = a[0], a[1]
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


def _is_causal(keep: Node, score_shape: tuple) -> bool:
    """keep = (q_idx >= kv_idx) from two aranges (or kv_idx <= q_idx): the top-left causal mask."""
    if keep.op not in ("ge", "le") or not all(isinstance(x, Node) for x in keep.inputs):
        return False
    rows, cols = keep.inputs if keep.op == "ge" else keep.inputs[::-1]
    m, n = score_shape[-2:]
    rank = len(score_shape)
    return _arange_along(rows, m, -2, rank) and _arange_along(cols, n, -1, rank)


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


def fuse_attention(graph):
    """Rewrite every matched attention pattern in place into one `sdpa` node; returns the graph."""
    for mm2 in [n for n in graph.nodes if n.op == "matmul"]:
        if mm2 not in graph.nodes:
            continue
        m = _match(mm2, _uses(graph))
        if m is None or len(m.q.meta.shape) != len(mm2.meta.shape) or not _template_runs(m, mm2):
            continue
        key = _key_of(graph, m, mm2)
        causal = m.mask is not None and m.mask.meta.dtype.name == "bool" and _is_causal(
            m.mask, tuple(m.q.meta.shape[:-1]) + (key.meta.shape[-2],))
        if causal:
            m.used += _ancestors(m.mask)          # no M x N mask in memory: the template's causal loop
        mask = [] if m.mask is None or causal else [m.mask]
        mm2.op, mm2.params = "sdpa", {"is_causal": causal, "scale": float(m.scale)}
        mm2.name = f"sdpa_{mm2.name}"             # the kernel's comment names what it computes
        mm2.inputs = [m.q, key, m.v] + mask
        _remove_dead(graph, m.used)
    return graph
