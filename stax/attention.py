"""§9.10 Attention, the user's side: `scaled_dot_product_attention`, `omni_attention`, block masks.

Layer: front, beside the tensor op modules (it builds ops from tensors), but it also reaches down to the
back end to launch its templates directly (attention_kernels.py prints them, triton_heuristics.py
runs them) and to capture/lower/print a `score_mod` or `mask_mod` (capture.py, lower.py,
triton_kernel.py's printer). Only __init__.py imports it.

Consumes Stax tensors q [B, H, M, D], k and v [B, HK, N, D] (HK divides H: grouped heads), and
for omni_attention the user's `score_mod(score, b, h, q_idx, kv_idx)` and a `BlockMask`.
Produces the attention output (and with `return_lse`, the LSE [B, H, M] the backward needs).

- `scaled_dot_product_attention` is one graph op, `sdpa` (op_table.py): eager on CPU tensors it
  runs in float64 numpy, on cuda tensors it launches the flash template; compiled for the GPU the
  node becomes the same template (codegen_triton.py); compiled for the CPU it is a §6.1 fallback.
- `omni_attention` traces `score_mod` and `mask_mod` into small graphs, lowers them, and prints
  their `inner_fn` with the Triton printer between the QKᵀ dot and the online update. On "cuda"
  tensors it launches that template; on the CPU it evaluates the same functions eagerly. Under
  `stax.compile` it is one graph node, `omni_attn`: the mods' printed bodies (both printers) are
  its params, the block mask's arrays its inputs (BlockMask flattens into the call's tensors);
  codegen_triton.py prints the Triton template, codegen_cpp.py the C++ one.
- `attention_backward` takes the same score_mod and block mask: ∂score_mod/∂score is traced
  through Stax's own autograd (`score_derivative`) and printed into the backward kernels.
- On inputs that require grad both ops keep their LSE as the node's last input, and
  `attention_grads` (op_table.DERIVATIVES's formula for `sdpa` and `omni_attn`) runs
  attention_backward eagerly, or records one `attn_bwd` node in a compiled training step.
- `kernel_options={"BACKEND": ...}` picks the implementation: "TRITON" (cuda tensors, the default
  there), "TRITON_DECODE" (≤ 64 queries: the keys split across programs, the triples merged; the
  default for ≤ 16 queries when B·H programs cannot fill the SMs),
  "CPP" (the C++ template, CPU tensors; the mods printed by the C++ printer). Unset on the CPU:
  float64 numpy. A backend that cannot run the inputs is an error, never a silent fallback.

Where to look:
  - `scaled_dot_product_attention`, `attention_forward` ..... the sdpa op, and (out, LSE)
  - `create_block_mask`, `BlockMask` ......................... Figure 9.3's full/partial/empty blocks
  - `trace_mod` ............................................... score_mod/mask_mod → printed lines
  - `omni_attention`, `_traced_omni` ......................... Listing 9.7; the graph node under compile
  - `score_derivative` ........................................ ∂score_mod/∂score by autograd
  - `attention_backward` ...................................... dQ, dK, dV without N x N buffers
  - `attention_grads`, `_sdpa_with_grad`, `_omni_with_grad` ...... autograd (§5): the saved LSE
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .attention_grad import BackwardSpec, backward_templates, grads_from_scores, packed_offsets
from .attention_kernels import (ModBody, apply_mask, as_operand, attention_scores, attention_template,
                                ModText, contiguous_operand,
                                DECODE_MAX_QUERIES, cpp_template, decode_splits,
                                decode_templates,
                                finish_triple, launch_numels, make_spec,
                                sdpa_lse_numpy, spec_key, triple_of, _expand_heads)
from . import autograd
from .autograd import is_grad_enabled, no_grad, record
from .dtypes import float32, int32
from .tensor import SymbolicInt, Tensor, _meta, _op, current_tracer, empty, from_numpy

BACKENDS = ("TRITON", "TRITON_DECODE", "CPP")


# ---- §9.10 scaled_dot_product_attention ----


def _check_qkv(q, k, v, enable_gqa: bool):
    """PyTorch's rules, with errors that say what to pass instead."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a stax.Tensor, got {type(t).__name__}")
        if t.ndim < 2 or not t.dtype.is_floating_point:
            raise RuntimeError(f"scaled_dot_product_attention: {name} must be a floating tensor of rank "
                               f">= 2 ([..., L, E]), got {t.dtype.name} of shape {tuple(t.shape)}")
    if not (q.dtype is k.dtype is v.dtype):
        raise RuntimeError(f"scaled_dot_product_attention: query, key and value must share a dtype, got "
                           f"{q.dtype.name}, {k.dtype.name}, {v.dtype.name}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise RuntimeError(f"scaled_dot_product_attention: query {tuple(q.shape)}, key {tuple(k.shape)} and "
                           f"value {tuple(v.shape)} need query.size(-1) == key.size(-1) and "
                           "key.size(-2) == value.size(-2)")
    if q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        hq, hk = q.shape[-3], k.shape[-3]
        if not enable_gqa or hk == 0 or hq % hk or v.shape[-3] != hk:
            raise RuntimeError(f"scaled_dot_product_attention: {hq} query heads and {hk} key heads: pass "
                               "enable_gqa=True when the key/value heads divide the query heads")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v, PyTorch's spelling (§9.10). A bool mask keeps where True,
    a float mask adds; `is_causal` keeps key j ≤ query i. dropout_p must be 0. On inputs that
    require grad the node keeps its LSE for the backward (the §5 section at the end)."""
    _check_qkv(query, key, value, enable_gqa)
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention: Stax has no attention dropout; "
                                  "pass dropout_p=0.0")
    if is_causal and attn_mask is not None:
        raise RuntimeError("scaled_dot_product_attention: pass attn_mask or is_causal, not both")
    inputs = [query, key, value]
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError("scaled_dot_product_attention: attn_mask must be a stax.Tensor (bool: keep, "
                            "float: add to the scores)")
        inputs.append(attn_mask)
    shape = tuple(query.shape[:-1]) + (value.shape[-1],)
    params = {"is_causal": bool(is_causal), "scale": None if scale is None else float(scale)}
    if _needs_grad(inputs):
        return _sdpa_with_grad(inputs, params, shape, enable_gqa)
    if current_tracer() is None and query.device != "cpu" and _eager_template(inputs, is_causal, scale):
        return attention_forward(query, key, value, attn_mask, is_causal, scale, enable_gqa)[0]
    return _op("sdpa", inputs, params, _meta(shape, query.dtype, query.device))


def _eager_template(inputs: list, is_causal, scale) -> bool:
    """Eager on cuda tensors: does the flash template cover these (else the op runs on the host)?"""
    q, k, v = inputs[:3]
    mask = inputs[3] if len(inputs) == 4 else None
    if len({t.device for t in inputs}) != 1:
        return False
    return make_spec(_operand(q), _operand(k), _operand(v), _operand(q), q.dtype.name, scale, is_causal,
                     _operand(mask) if mask is not None else None,
                     mask.dtype.name if mask is not None else "") is not None


def _host(t) -> np.ndarray:
    """A tensor's values on the host in their compute form (half types as float32)."""
    return None if t is None else t.cpu()._compute()


def _to_tensor(a: np.ndarray, dtype, device) -> Tensor:
    t = from_numpy(np.ascontiguousarray(a.astype(np.float64))).to(dtype)
    return t if device == "cpu" else t.to(device)


# ---- §9.10 Launching a template directly (eager on "cuda" tensors) ----

_KERNELS: dict = {}          # kernel text -> its CachingAutotuner, or (ffi, lib) of a C++ template
_LAUNCHES: dict = {}         # (kind, spec_key, ...) -> [(CachingAutotuner, numels)]: the text printed once


def _operand(t):
    """The layout of a tensor a launch receives: its pointer already points at its first element
    (data_ptr() includes the view's offset), so the Operand's offset is 0."""
    return as_operand(t._meta.shape, t._meta.stride, 0)


def _kernels_of(key: tuple, make) -> list:
    """[(kernel, numels)] of a launch, remembered by its spec's key: `make()` prints the kernels'
    [(name, source, numels)] only the first time (a decode loop's step would spend more host time
    printing the text than its kernels take)."""
    from .triton_heuristics import kernel_from_source
    if key not in _LAUNCHES:
        made = []
        for name, src, numels in make():
            if src not in _KERNELS:
                _KERNELS[src] = kernel_from_source(name, src)
            made.append((_KERNELS[src], numels))
        _LAUNCHES[key] = made
    return _LAUNCHES[key]


def _run_kernels(kernels: list, args: list):
    """Launch [(kernel, numels)] in order, each on its own argument list."""
    for (kernel, numels), a in zip(kernels, args):
        kernel.run(*a, *numels)


def _launch(spec, args: list):
    """Run the template of `spec` on `args` (q, k, v [, mask] [, block mask], out, lse)."""
    _run_kernels(_kernels_of(("forward", spec_key(spec)),
                             lambda: [(*attention_template(0, spec), launch_numels(spec))]), [args])


def _decode(q, k, v, spec, extra: list, out, lse):
    """§9.10 decode: the keys split so that B·H·splits programs fill the GPU; each split's triple
    goes to float32 scratch, a second kernel merges them (the triple is associative)."""
    from .triton_kernel import current_target
    b, h, _, m, n, d = spec.dims
    if m > DECODE_MAX_QUERIES or spec.sparse:
        raise ValueError(f"BACKEND='TRITON_DECODE' is for at most {DECODE_MAX_QUERIES} queries and no "
                         f"block mask (got {m} queries{', a block mask' if spec.sparse else ''}); use 'TRITON'")
    splits, chunk = decode_splits(n, -(-4 * current_target().sm_count // (b * h)))
    rows, dp = max(16, 1 << (m - 1).bit_length()), max(16, 1 << (d - 1).bit_length())
    ml = [empty(b * h * splits * rows, dtype=float32, device=q.device) for _ in range(2)]
    acc = empty(b * h * splits * rows * dp, dtype=float32, device=q.device)
    kernels = _kernels_of(("decode", spec_key(spec), splits, chunk), lambda: decode_templates(spec, splits, chunk))
    _run_kernels(kernels, [[q, k, v] + extra + ml + [acc], ml + [acc, out, lse]])


def _default_decode(spec, kernel_options) -> bool:
    """With no BACKEND named: a few queries per (batch, head) and too few programs for the SMs
    (one per 16 queries) take the decode template, which splits the keys."""
    from .triton_kernel import current_target
    b, h, _, m, _, _ = spec.dims
    return ("BACKEND" not in (kernel_options or {}) and m <= 16 and not spec.sparse
            and b * h < current_target().sm_count)


def _gpu_forward(q, k, v, spec, extra: list, backend="TRITON"):
    out = empty(*q.shape, dtype=q.dtype, device=q.device)
    lse = empty(*q.shape[:-1], dtype=float32, device=q.device)
    spec.out = _operand(out)
    if backend == "TRITON_DECODE":
        _decode(q, k, v, spec, extra, out, lse)
    else:
        _launch(spec, [q, k, v] + extra + [out, lse])
    return out, lse


def _backend(kernel_options, device) -> str:
    backend = (kernel_options or {}).get("BACKEND", "TRITON" if device != "cpu" else "EAGER")
    if backend not in BACKENDS + ("EAGER",):
        raise ValueError(f"kernel_options BACKEND={backend!r}: choose one of {BACKENDS}")
    if backend == "CPP" and device != "cpu":
        raise RuntimeError("BACKEND='CPP' runs on CPU tensors; move q, k, v with .cpu() or use 'TRITON'")
    if backend.startswith("TRITON") and device == "cpu":
        raise RuntimeError(f"BACKEND={backend!r} needs cuda tensors; move q, k, v with .to('cuda')")
    return backend


def attention_forward(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                      kernel_options=None):
    """(out, LSE): the attention and its per-row log-sum-exp m + log ℓ ([..., M], float32), what
    the backward recomputes P from. cuda tensors run the flash template, CPU ones float64 numpy."""
    _check_qkv(q, k, v, enable_gqa)
    if current_tracer() is not None:
        current_tracer().graph_break("attention_forward launches its own kernel")
    backend = _backend(kernel_options, q.device)
    if backend != "EAGER":
        mask_dtype = attn_mask.dtype.name if attn_mask is not None else ""
        spec = make_spec(_operand(q), _operand(k), _operand(v), _operand(q), q.dtype.name, scale,
                         is_causal, _operand(attn_mask) if attn_mask is not None else None, mask_dtype)
        if spec is None:
            raise RuntimeError(f"the flash template does not cover q {tuple(q.shape)}, k {tuple(k.shape)}, "
                               f"{q.dtype.name} (rank ≤ 4, head dim ≤ 256, ≤ 65535 batch·heads); "
                               "run on the CPU instead")
        if backend == "CPP":
            if attn_mask is not None or q.ndim != 4:
                raise NotImplementedError("BACKEND='CPP' takes [B, H, L, E] tensors and no attn_mask "
                                          "(use omni_attention's block mask, or leave BACKEND unset)")
            return _cpp_forward(q, k, v, spec)
        backend = "TRITON_DECODE" if _default_decode(spec, kernel_options) else backend
        return _gpu_forward(q, k, v, spec, [attn_mask] if attn_mask is not None else [], backend)
    with np.errstate(all="ignore"):
        o, lse = sdpa_lse_numpy(_host(q), _host(k), _host(v), _host(attn_mask), is_causal, scale)
    return _to_tensor(o, q.dtype, q.device), _to_tensor(lse, float32, q.device)


# ---- §9.10 Block masks (Figure 9.3) ----


@dataclass
class BlockMask:
    """mask_mod reduced per BLOCK_SIZE block, in BCSR form: for each (b, h, Q block) the KV blocks
    to visit with mask_mod (partial: `kv_num_blocks`, `kv_indices`) and without it (full:
    `full_kv_num_blocks`, `full_kv_indices`). Blocks in neither list are empty: never visited.
    B or H of 1 broadcasts. The indices are int32; each row lists its blocks first."""
    kv_num_blocks: Tensor
    kv_indices: Tensor
    full_kv_num_blocks: Tensor
    full_kv_indices: Tensor
    Q_LEN: int
    KV_LEN: int
    BLOCK_SIZE: tuple
    mask_mod: object

    def counts(self) -> dict:
        """How many (b, h, Q block, KV block) blocks are partial, full and empty."""
        partial = int(self.kv_num_blocks.cpu()._compute().sum())
        full = int(self.full_kv_num_blocks.cpu()._compute().sum())
        b, h, qb, kb = self.kv_indices.shape
        return {"partial": partial, "full": full, "empty": b * h * qb * kb - partial - full}

    def to(self, device):
        moved = [t.to(device) for t in (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                                        self.full_kv_indices)]
        return BlockMask(*moved, self.Q_LEN, self.KV_LEN, self.BLOCK_SIZE, self.mask_mod)

    def _stax_flatten(self):
        """For stax.compile: the four arrays are tensors of the call (capture makes them graph
        inputs, the key holds their layouts), so a new mask of the same shape reuses the artifact."""
        return ([self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices],
                lambda ts: BlockMask(*ts, self.Q_LEN, self.KV_LEN, self.BLOCK_SIZE, self.mask_mod))

    def _stax_key(self) -> tuple:
        """The rest of the specialization key: sizes, and mask_mod (traced into the code) with
        the values it reads."""
        return (self.Q_LEN, self.KV_LEN, self.BLOCK_SIZE, self.mask_mod, _reads(self.mask_mod))


def _index_grids(b: int, h: int, m: int, n: int, device="cpu") -> list:
    """int32 tensors b, h, q_idx, kv_idx that broadcast to [B, H, M, N] (what the mods receive)."""
    from .tensor import arange
    return [arange(size, dtype=int32, device=device).reshape(*[size if i == d else 1 for i in range(4)])
            for d, size in enumerate((b, h, m, n))]


def _eval_mask(mask_mod, b: int, h: int, m: int, n: int) -> np.ndarray:
    """mask_mod at every position, eagerly: a bool [B, H, M, N] array."""
    keep = mask_mod(*_index_grids(b, h, m, n))
    keep = keep.cpu()._compute() if isinstance(keep, Tensor) else np.asarray(keep)
    return np.broadcast_to(keep.astype(bool), (b, h, m, n))


def _bcsr(blocks: np.ndarray) -> tuple:
    """(count [B, H, QB], indices [B, H, QB, KB]) of the True blocks, listed first in each row."""
    order = np.argsort(~blocks, axis=-1, kind="stable")
    return blocks.sum(-1).astype(np.int32), order.astype(np.int32)


def _block_sizes(block_size) -> tuple:
    sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(sizes) != 2 or any(not isinstance(s, int) or s < 16 or s & (s - 1) for s in sizes):
        raise ValueError(f"create_block_mask: BLOCK_SIZE must be a power of two >= 16 (or a pair of "
                         f"them), got {block_size!r}")
    return sizes


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128) -> BlockMask:
    """Evaluate mask_mod once at all positions, then classify each block as full, partial or empty
    (Figure 9.3). Positions past Q_LEN or KV_LEN do not count (the template masks them anyway)."""
    b, h = B or 1, H or 1
    bq, bkv = _block_sizes(BLOCK_SIZE)
    qb, kb = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    keep = _eval_mask(mask_mod, b, h, Q_LEN, KV_LEN)
    pad = ((0, 0), (0, 0), (0, qb * bq - Q_LEN), (0, kb * bkv - KV_LEN))
    shape = (b, h, qb, bq, kb, bkv)
    any_ = np.pad(keep, pad, constant_values=False).reshape(shape).any(axis=(3, 5))
    all_ = np.pad(keep, pad, constant_values=True).reshape(shape).all(axis=(3, 5))
    arrays = [*_bcsr(any_ & ~all_), *_bcsr(all_)]
    tensors = [from_numpy(np.ascontiguousarray(a)) for a in arrays]
    if device != "cpu":
        tensors = [t.to(device) for t in tensors]
    return BlockMask(*tensors, Q_LEN, KV_LEN, (bq, bkv), mask_mod)


# ---- §9.10 score_mod and mask_mod: traced, lowered, printed into the template ----


class _ModKernel:
    """What the Triton printer asks of a kernel, for a mod's body: fresh temporaries, the mod's
    arguments as the template's variables, [1, 1] constants (they broadcast over a block)."""

    def __init__(self, prefix: str, local: dict):
        self.prefix, self.locals, self.count = prefix, local, 0
        self.axes, self.constants, self.index64 = [None, None], {}, False
        self.block_axes = None      # (no grid-y axis of its own: the printer's shapes are the axes')

    def new_tmp(self) -> str:
        self.count += 1
        return f"{self.prefix}{self.count - 1}"

    def final(self, expr):
        return expr


_MODS: dict = {}             # (fn, is_score, what it reads) -> its ModBody


def _reads(fn) -> tuple:
    """What a mod reads besides its arguments: the globals and closure cells it names, by value
    for scalars (a changed value must retrace), by identity otherwise."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return (id(fn),)
    cells = [c.cell_contents for c in (fn.__closure__ or ()) if c.cell_contents is not None]
    names = [fn.__globals__[n] for n in code.co_names if n in fn.__globals__]
    return tuple(v if isinstance(v, (bool, int, float, str)) else ("id", id(v)) for v in cells + names)


def score_derivative(fn):
    """∂score_mod/∂score as a function of the same arguments, through Stax's own derivative
    formulas (autograd.py, op_table.DERIVATIVES): traced like the mod itself, or run eagerly on
    full score tensors. An op without a formula raises (never a wrong gradient)."""
    from .autograd import enable_grad, grad
    from .math_ops import ones_like, zeros_like

    def dmod(score, b, h, q_idx, kv_idx):
        s = score.detach().requires_grad_()
        with enable_grad():
            out = fn(s, b, h, q_idx, kv_idx)
            if not isinstance(out, Tensor) or not out.requires_grad:     # the score is not used
                return zeros_like(score)
            try:
                (g,) = grad([out], [s], [ones_like(out)], allow_unused=True)
            except NotImplementedError as e:
                raise NotImplementedError(f"attention_backward: the derivative of score_mod cannot be traced "
                                          f"({e}); write score_mod with differentiable ops") from None
        return zeros_like(score) if g is None else g
    return dmod


def trace_mod_uncached(fn, is_score: bool, language: str = "triton", derivative: bool = False) -> ModBody:
    """Capture `fn` on 0-d proxies (score: float32; b, h, q_idx, kv_idx: int32), lower it, and
    print its inner_fn with the Triton printer: the lines the template runs per score block."""
    from .capture import capture
    from .ir import Pointwise, set_handler
    from .lower import lower
    from .printer import Var
    from .tensor import tensor
    from .triton_kernel import TritonPrinter
    names = (["score"] if is_score else []) + ["b", "h", "q_idx", "kv_idx"]
    args = [tensor(0.5, dtype=float32, device="cpu") if n == "score" else tensor(0, dtype=int32, device="cpu")
            for n in names]
    what = "score_mod" if is_score else "mask_mod"
    if derivative:                        # ∂score_mod/∂score: its own temporaries beside the mod's
        fn, what = score_derivative(fn), "the derivative of score_mod"
    graph, _ = capture(fn, args)
    low = lower(graph, inline_limit=1 << 30)
    bodies = [x for x in low.buffers if low.outputs and x.name == low.outputs[0]]
    if len(low.inputs) != len(names) or len(low.outputs) != 1 or len(low.buffers) != 1 \
            or not bodies or not isinstance(bodies[0], Pointwise) or bodies[0].ranges:
        raise NotImplementedError(f"{what} must compute one scalar from its arguments with pointwise ops "
                                  "(no reductions, no tensors read from outside its arguments)")
    shim = _ModKernel("dscore_tmp" if derivative else "score_tmp" if is_score else "mask_tmp",
                      {x.name: Var(n, x.dtype) for x, n in zip(low.inputs, names)})
    if language == "cpp":                 # C++: `auto tmpN = ...;` lines, in a scope of their own
        from .cpp_kernel import CppPrinter
        printer = CppPrinter(shim, [0])
    else:
        printer = TritonPrinter(shim)
    with set_handler(printer):
        result = bodies[0].inner_fn([])
    return ModBody(printer.lines, str(result))


def trace_mod(fn, is_score: bool, language: str = "triton", derivative: bool = False) -> ModBody:
    """trace_mod_uncached, remembered per function, language and the values it reads."""
    key = (fn, is_score, language, derivative, _reads(fn))
    if key not in _MODS:
        _MODS[key] = trace_mod_uncached(fn, is_score, language, derivative)
    return _MODS[key]



def _cpp_forward(q, k, v, spec, block_mask=None):
    """BACKEND='CPP': the C++ template on contiguous float32 copies (half types widened first)."""
    from .cache import load_cpp, prelude
    arrays = [np.ascontiguousarray(_host(t), np.float32) for t in (q, k, v)]
    spec.q, spec.k, spec.v = (contiguous_operand(a.shape) for a in arrays)
    spec.out = contiguous_operand(arrays[0].shape)
    blocks = [np.zeros(1, np.int32)] * 4
    if block_mask is not None:
        blocks = [np.ascontiguousarray(t.cpu()._compute(), np.int32) for t in
                  (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                   block_mask.full_kv_indices)]
        spec.sparse = (*block_mask.BLOCK_SIZE, contiguous_operand(blocks[0].shape + (1,)),
                       contiguous_operand(blocks[1].shape))
    src, cdef = cpp_template(spec)
    if src not in _KERNELS:                  # (load_cpp hashes the compiler's identity each call)
        _KERNELS[src] = load_cpp(prelude() + src, cdef)
    ffi, lib = _KERNELS[src]
    b, h, _, m, _, d = spec.dims
    out, lse = np.empty((b, h, m, d), np.float32), np.empty((b, h, m), np.float32)
    lib.stax_attention_cpu(*[ffi.from_buffer("float[]", a) for a in arrays],
                           *[ffi.from_buffer("int32_t[]", a) for a in blocks],
                           ffi.from_buffer("float[]", out), ffi.from_buffer("float[]", lse))
    return _to_tensor(out, q.dtype, "cpu"), _to_tensor(lse, float32, "cpu")


# ---- §9.10 omni_attention (Listing 9.7) ----


def _check_block_mask(spec, block_mask):
    b, h, _, m, n, _ = spec.dims
    if (block_mask.Q_LEN, block_mask.KV_LEN) != (m, n):
        raise ValueError(f"omni_attention: the block mask covers {block_mask.Q_LEN} x {block_mask.KV_LEN}, "
                         f"the inputs {m} x {n}; build it with create_block_mask(..., Q_LEN={m}, KV_LEN={n})")
    bm, hm = block_mask.kv_num_blocks.shape[:2]
    if bm not in (1, b) or hm not in (1, h):
        raise ValueError(f"omni_attention: the block mask's B={bm}, H={hm} do not broadcast to B={b}, H={h}")


def _sparse_args(spec, block_mask, q) -> list:
    _check_block_mask(spec, block_mask)
    arrays = [t if t.device == q.device else t.to(q.device) for t in
              (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
               block_mask.full_kv_indices)]
    nb, ind = (as_operand(t._meta.shape if t.ndim == 4 else tuple(t.shape) + (1,),
                          t._meta.stride if t.ndim == 4 else tuple(t._meta.stride) + (1,), 0)
               for t in arrays[:2])
    spec.sparse = (*block_mask.BLOCK_SIZE, nb, ind)
    spec.mask_mod = trace_mod(block_mask.mask_mod, False)
    return arrays


def _cpp_omni(q, k, v, spec, score_mod, block_mask):
    """BACKEND='CPP' for omni_attention: the mods printed by the C++ printer into the template."""
    if score_mod is not None:
        spec.score_mod = trace_mod(score_mod, True, "cpp")
    if block_mask is not None:
        _check_block_mask(spec, block_mask)
        spec.mask_mod = trace_mod(block_mask.mask_mod, False, "cpp")
    return _cpp_forward(q, k, v, spec, block_mask)


def _eager_omni(q, k, v, score_mod, block_mask, scale):
    """The CPU path: the scores in float64, the mods run eagerly on float64 tensors."""
    s = attention_scores(_host(q), _host(k), scale)
    b, h, m, n = s.shape
    if score_mod is not None:
        out = score_mod(from_numpy(np.ascontiguousarray(s)), *_index_grids(b, h, m, n))
        s = np.broadcast_to(out._compute().astype(np.float64), s.shape)
    if block_mask is not None:
        s = np.where(_eval_mask(block_mask.mask_mod, b, h, m, n), s, -np.inf)
    with np.errstate(all="ignore"):
        o, lse = finish_triple(triple_of(s, _expand_heads(_host(v).astype(np.float64), h)))
    return _to_tensor(o, q.dtype, q.device), _to_tensor(lse, float32, q.device)


def _mod_text(fn, is_score: bool) -> ModText:
    return ModText(trace_mod(fn, is_score, "triton"), trace_mod(fn, is_score, "cpp"))


def _traced_omni(q, k, v, score_mod, block_mask, scale, return_lse, backend):
    """Under stax.compile: one `omni_attn` node whose params hold the traced mods, its inputs q, k,
    v and the block mask's arrays; the back ends print it as the Triton or the C++ template. On
    the CPU half types are widened to float32 around it (pointwise casts that fuse with their
    neighbours), as the C++ template computes. What no template runs is a graph break (eager)."""
    tracer = current_tracer()
    if return_lse:
        tracer.graph_break("omni_attention(return_lse=True) under stax.compile (the LSE is no graph output)")
    if backend == "TRITON_DECODE":
        tracer.graph_break("omni_attention with BACKEND='TRITON_DECODE' (two kernels of its own)")
    symbolic = any(isinstance(n, SymbolicInt) for n in tuple(q.shape) + tuple(k.shape) + tuple(v.shape))
    if symbolic and _needs_grad([q, k, v]):
        tracer.graph_break("omni_attention with symbolic sizes on inputs that require grad (the backward "
                           "templates take static sizes); mark these dims static (stax.mark_static)")
    spec = make_spec(_operand(q), _operand(k), _operand(v), _operand(q), q.dtype.name, scale)
    if spec is None:
        tracer.graph_break(f"omni_attention on q {tuple(q.shape)}, k {tuple(k.shape)}, {q.dtype.name}: no "
                           "template covers it (static sizes, head dim <= 256, float32/float16/bfloat16)")
    inputs = [q, k, v]
    params = {"scale": spec.scale, "score_mod": None if score_mod is None else _mod_text(score_mod, True),
              "mask_mod": None, "block": None}
    if block_mask is not None:
        _check_block_mask(spec, block_mask)
        arrays, _ = block_mask._stax_flatten()
        if any(t.device != q.device for t in arrays):
            tracer.graph_break(f"omni_attention with the block mask on {arrays[0].device} and q on "
                               f"{q.device} (build it with create_block_mask(..., device=q.device))")
        inputs += arrays
        params.update(mask_mod=_mod_text(block_mask.mask_mod, False), block=tuple(block_mask.BLOCK_SIZE))
    if _needs_grad([q, k, v]):
        return _traced_omni_grad(tracer, inputs, params, score_mod, _meta(tuple(q.shape), q.dtype, q.device))
    widen = q.device == "cpu" and q.dtype is not float32
    if widen:
        inputs[:3] = [t.to(float32) for t in inputs[:3]]
    shape = tuple(q.shape)
    if symbolic:
        # §10.4: the templates take static sizes, so under dynamic shapes q, k and v's layouts
        # are specialized to the hints, each size, stride and offset guarded equal (as PyTorch
        # specializes a size an op needs as a number): another size compiles again
        params["layouts"] = tuple(_specialized_layout(tracer.shape_env, t) for t in inputs[:3])
        shape = params["layouts"][0][0]
    out = _op("omni_attn", inputs, params, _meta(shape, inputs[0].dtype, q.device))
    return out.to(q.dtype) if widen else out


def _specialized_layout(env, t) -> tuple:
    """(shape, stride, offset) of a traced tensor as ints, each symbolic one guarded equal to its hint."""
    import sympy

    def num(e):
        e = sympy.sympify(e)
        return int(e) if e.is_Integer else env.specialize(e)
    m = t._meta
    return tuple(num(n) for n in m.shape), tuple(num(st) for st in m.stride), num(m.offset)


def omni_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None):
    """Attention with a programmable score: score_mod(score, b, h, q_idx, kv_idx) rewrites each
    score, the block mask's mask_mod(b, h, q_idx, kv_idx) says which positions count (Listing
    9.7). q [B, H, M, D], k and v [B, HK, N, D]."""
    _check_qkv(query, key, value, enable_gqa)
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise RuntimeError("omni_attention: query, key and value must be [B, H, L, E] tensors")
    if _needs_grad((query, key, value)) and current_tracer() is None:
        return _omni_with_grad(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                               kernel_options)
    backend = _backend(kernel_options, query.device)
    if current_tracer() is not None:      # stax.compile: one graph node, printed as the template
        return _traced_omni(query, key, value, score_mod, block_mask, scale, return_lse, backend)
    if backend != "EAGER":
        spec = make_spec(_operand(query), _operand(key), _operand(value), _operand(query),
                         query.dtype.name, scale)
        if spec is None:
            raise RuntimeError(f"the omni_attention template does not cover q {tuple(query.shape)}, "
                               f"k {tuple(key.shape)}, {query.dtype.name}; run on the CPU instead")
        if backend == "CPP":
            out, lse = _cpp_omni(query, key, value, spec, score_mod, block_mask)
        else:
            if score_mod is not None:
                spec.score_mod = trace_mod(score_mod, True)
            extra = _sparse_args(spec, block_mask, query) if block_mask is not None else []
            backend = "TRITON_DECODE" if _default_decode(spec, kernel_options) else backend
            out, lse = _gpu_forward(query, key, value, spec, extra, backend)
    else:
        out, lse = _eager_omni(query, key, value, score_mod, block_mask, scale)
    return (out, lse) if return_lse else out


# ---- §9.10 The backward: P = exp(S - LSE) recomputed, dQ, dK, dV ----


def _eager_mods(s, score_mod, block_mask) -> tuple:
    """The CPU path's (S', ∂S'/∂S, keep) from float64 scores S [B, H, M, N]: the mods run
    eagerly on float64 tensors, the derivative through Stax's autograd (score_derivative)."""
    b, h, m, n = s.shape
    grids, ds, keep = _index_grids(b, h, m, n), None, None
    if score_mod is not None:
        st = from_numpy(np.ascontiguousarray(s))
        ds = np.broadcast_to(score_derivative(score_mod)(st, *grids)._compute().astype(np.float64), s.shape)
        s = np.broadcast_to(score_mod(st, *grids)._compute().astype(np.float64), s.shape)
    if block_mask is not None:
        keep = _eval_mask(block_mask.mask_mod, b, h, m, n)
        s = np.where(keep, s, -np.inf)
    return s, ds, keep


def _backward_numpy(do, q, k, v, o, lse, is_causal, scale, attn_mask=None, score_mod=None, block_mask=None):
    """float64: the same recomputation as the kernels; dS = P (dP - delta) ∂score_mod/∂S."""
    s, dmod, keep = _eager_mods(attention_scores(q, k, scale), score_mod, block_mask)
    return grads_from_scores(apply_mask(s, attn_mask, is_causal), dmod, do, q, k, v, o, lse, scale)


def _check_backward_args(grad_out, query, key, value, out, lse, enable_gqa):
    _check_qkv(query, key, value, enable_gqa)
    if query.ndim != 4 or key.shape[0] != query.shape[0]:
        raise RuntimeError("attention_backward: query, key and value must be [B, H, L, E] with one batch size")
    if tuple(grad_out.shape) != tuple(out.shape) or tuple(lse.shape) != tuple(query.shape[:-1]):
        raise RuntimeError(f"attention_backward: grad_out {tuple(grad_out.shape)} must match out "
                           f"{tuple(out.shape)} and lse {tuple(lse.shape)} must be {tuple(query.shape[:-1])}")


def attention_backward(grad_out, query, key, value, out, lse, is_causal=False, scale=None,
                       enable_gqa=False, kernel_options=None, attn_mask=None, score_mod=None, block_mask=None):
    """(dQ, dK, dV) of attention_forward's or omni_attention's (out, lse), P recomputed as
    exp(S' - LSE) (§9.10): nothing N x N is stored. cuda tensors run two Triton kernels (dK and
    dV over key blocks, dQ over query blocks), CPU ones float64 numpy. `attn_mask` as in the
    forward (bool keeps, float adds); `score_mod` and `block_mask` as omni_attention's: dS is
    P (dP - delta) ⊙ ∂score_mod/∂score, the derivative traced through Stax's autograd (the
    backward evaluates mask_mod on every block; it skips none)."""
    _check_backward_args(grad_out, query, key, value, out, lse, enable_gqa)
    backend = _backend(kernel_options, query.device)
    if backend in ("TRITON_DECODE", "CPP"):
        raise ValueError(f"attention_backward: BACKEND={backend!r} has no backward; use 'TRITON' on cuda "
                         "tensors, or leave BACKEND unset on the CPU")
    if backend == "EAGER":
        with np.errstate(all="ignore"):
            grads = _backward_numpy(*(_host(t).astype(np.float64) for t in (grad_out, query, key, value, out, lse)),
                                    is_causal, scale, None if attn_mask is None else _host(attn_mask),
                                    score_mod, block_mask)
        return tuple(_to_tensor(g, query.dtype, query.device) for g in grads)
    spec = make_spec(_operand(query), _operand(key), _operand(value), _operand(query), query.dtype.name,
                     scale, is_causal, _operand(attn_mask) if attn_mask is not None else None,
                     attn_mask.dtype.name if attn_mask is not None else "")
    if spec is None:
        raise RuntimeError(f"the backward template does not cover q {tuple(query.shape)}, {query.dtype.name}")
    bs = BackwardSpec(spec, _operand(out), _operand(grad_out))
    if score_mod is not None:
        spec.score_mod, bs.score_grad = trace_mod(score_mod, True), trace_mod(score_mod, True, derivative=True)
    if block_mask is not None:
        _check_block_mask(spec, block_mask)
        spec.mask_mod = trace_mod(block_mask.mask_mod, False)
    lse = lse.contiguous() if lse.dtype is float32 else lse.to(float32).contiguous()
    dq = empty(*query.shape, dtype=query.dtype, device=query.device)
    dk, dv = (empty(*key.shape, dtype=query.dtype, device=query.device) for _ in range(2))
    ins = [query, key, value, out, grad_out, lse] + ([attn_mask] if attn_mask is not None else [])
    grad = None if bs.score_grad is None else (tuple(bs.score_grad.lines), bs.score_grad.result)
    key = ("backward", spec_key(spec), *((o.shape, o.stride, o.offset) for o in (bs.o, bs.do)), grad, bs.offsets)
    _run_kernels(_kernels_of(key, lambda: backward_templates(bs)), [ins + [dk, dv], ins + [dq]])
    return dq, dk, dv


# ---- §5 / §9.10 Autograd: sdpa's and omni_attn's derivative (op_table.DERIVATIVES) ----
#
# A forward on inputs that require grad keeps its LSE as the node's last input (params
# with_lse=True; the output does not depend on it), so that autograd saves q, k, v, out and the
# LSE, and a compiled training step's partition saves the LSE, never the N x N probabilities.
# Eager, one forward computes (out, LSE) and `record`s the node; under stax.compile the LSE is an
# `attn_lse` / `omni_lse` node that the GPU back end writes in the same template launch.


def _needs_grad(tensors) -> bool:
    return is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_grad_inputs(what: str, q, k, v, mask=None):
    if mask is not None and mask.requires_grad:
        raise NotImplementedError(f"{what}: attn_mask gets no gradient; pass attn_mask.detach() (query, "
                                  "key and value get theirs)")
    if q.ndim > 4 or tuple(q.shape[:-3]) != tuple(k.shape[:-3]) or tuple(k.shape[:-3]) != tuple(v.shape[:-3]):
        raise NotImplementedError(f"{what}: the backward takes query, key and value of rank <= 4 with the "
                                  f"same batch dims, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; "
                                  "expand or reshape them to [B, H, L, E] first")


def _sdpa_with_grad(inputs: list, params: dict, shape: tuple, enable_gqa: bool):
    q, k, v = inputs[:3]
    mask = inputs[3] if len(inputs) == 4 else None
    _check_grad_inputs("scaled_dot_product_attention", q, k, v, mask)
    params = {**params, "with_lse": True}
    if current_tracer() is not None:        # the joint graph of stax.compile (partition.py)
        lse = _op("attn_lse", inputs, {"is_causal": params["is_causal"], "scale": params["scale"]},
                  _meta(tuple(q.shape[:-1]), float32, q.device))
        return _op("sdpa", inputs + [lse], params, _meta(shape, q.dtype, q.device))
    with no_grad():
        if q.device != "cpu" and not _eager_template(inputs, params["is_causal"], params["scale"]):
            out, lse = attention_forward(*(t.cpu() for t in inputs[:3]), None if mask is None else mask.cpu(),
                                         params["is_causal"], params["scale"], enable_gqa)
            out, lse = out.to(q.device), lse.to(q.device)
        else:
            out, lse = attention_forward(q, k, v, mask, params["is_causal"], params["scale"], enable_gqa)
    record("sdpa", inputs + [lse], params, [out])
    return out


def _omni_with_grad(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options):
    """omni_attention on inputs that require grad, eagerly: the forward once, then the node."""
    _check_grad_inputs("omni_attention", q, k, v)
    if return_lse:
        raise NotImplementedError("omni_attention(return_lse=True): the LSE carries no gradient; pass "
                                  "return_lse=False, or run under stax.no_grad()")
    with no_grad():
        out, lse = omni_attention(q, k, v, score_mod, block_mask, scale, enable_gqa, True, kernel_options)
    params = {"scale": scale, "score_mod": score_mod, "block_mask": block_mask, "with_lse": True}
    record("omni_attn", [q, k, v, lse], params, [out])
    return out


def _traced_omni_grad(tracer, inputs: list, params: dict, score_mod, meta):
    """omni_attention on proxies that require grad (the joint graph): ∂score_mod/∂score traced
    into the params, the LSE an `omni_lse` node; what no template runs is a graph break."""
    q = inputs[0]
    if q.device == "cpu":
        tracer.graph_break("omni_attention on inputs that require grad on the CPU (no C++ backward "
                           "template): it runs eagerly")
    if score_mod is not None:
        try:
            params["score_grad"] = ModText(trace_mod(score_mod, True, "triton", True),
                                           trace_mod(score_mod, True, "cpp", True))
        except NotImplementedError as e:
            tracer.graph_break(f"omni_attention's backward cannot be traced ({e})")
    lse = _op("omni_lse", inputs, dict(params), _meta(tuple(q.shape[:-1]), float32, q.device))
    return _op("omni_attn", inputs + [lse], {**params, "with_lse": True}, meta)


def _as4d(t):
    return t.reshape(*((1,) * (4 - t.ndim)), *t.shape) if t.ndim < 4 else t


def _eager_grads(g, ins, out, p, op) -> tuple:
    """(dq, dk, dv) through attention_backward: the templates on cuda tensors, float64 numpy on
    the CPU (and for what no template covers)."""
    q, k, v, lse = ins[0], ins[1], ins[2], ins[-1]
    mask = ins[3] if op == "sdpa" and len(ins) == 5 else None
    kw = (dict(is_causal=p["is_causal"], scale=p["scale"], attn_mask=mask) if op == "sdpa" else
          dict(scale=p["scale"], score_mod=p["score_mod"], block_mask=p["block_mask"]))
    args = [_as4d(t) for t in (g, q, k, v, out)] + [lse.reshape(*((1,) * (3 - lse.ndim)), *lse.shape)]
    dev = q.device
    covered = dev == "cpu" or make_spec(*(_operand(t) for t in args[1:4]), _operand(args[1]), q.dtype.name,
                                        p["scale"], kw.get("is_causal", False),
                                        _operand(mask) if mask is not None else None,
                                        mask.dtype.name if mask is not None else "") is not None
    if not covered:
        args = [t.cpu() for t in args]
        kw = {n: (x.cpu() if isinstance(x, Tensor) else x.to("cpu") if isinstance(x, BlockMask) else x)
              for n, x in kw.items()}
    grads = attention_backward(*args, enable_gqa=True, **kw)
    return tuple(gr.to(dev).reshape(*t.shape) for gr, t in zip(grads, (q, k, v)))


def _traced_grads(g, ins, out, p, op) -> tuple:
    """(dq, dk, dv) as views of one `attn_bwd` node (its output packs them flat)."""
    q, k, v, lse = ins[0], ins[1], ins[2], ins[-1]
    extra = [ins[3]] if op == "sdpa" and len(ins) == 5 else []
    params = ({"is_causal": p["is_causal"], "scale": p["scale"]} if op == "sdpa" else
              {"scale": p["scale"], "score_mod": p["score_mod"], "score_grad": p.get("score_grad"),
               "mask_mod": p["mask_mod"]})
    o0, o1, o2, total = packed_offsets(q.shape, k.shape, v.shape)
    flat = _op("attn_bwd", [g, q, k, v, out, lse] + extra, params, _meta((total,), q.dtype, q.device))
    return flat[o0:o1].reshape(*q.shape), flat[o1:o2].reshape(*k.shape), flat[o2:total].reshape(*v.shape)


def attention_grads(g, ins, out, p, op) -> tuple:
    """The derivative of an `sdpa` or `omni_attn` node recorded with its LSE (op_table.DERIVATIVES
    calls it as F.attention_grads): dq, dk, dv, then None for the mask, block mask and LSE."""
    if not p.get("with_lse"):
        raise NotImplementedError(f"stax autograd: this {op} node was recorded without its LSE; call "
                                  "scaled_dot_product_attention / omni_attention on inputs that require grad")
    if is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in [g] + list(ins)):
        # (the backward kernels record no history: a second derivative would silently be zero)
        raise NotImplementedError(f"stax autograd: create_graph=True (a double backward) through {op} is "
                                  "not supported; its backward kernels have no derivative")
    grads = (_traced_grads if current_tracer() is not None else _eager_grads)(g, ins, out, p, op)
    return grads + (None,) * (len(ins) - 3)


autograd.F.attention_grads = attention_grads      # (autograd sits below this module: plugged in here)
