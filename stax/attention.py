"""§9.10 Attention, the user's side: `scaled_dot_product_attention`, `omni_attention`, block masks.

Layer: front, beside tensor_ops.py (it builds ops from tensors), but it also reaches down to the
back end to launch its templates directly (attention_kernels.py prints them, triton_heuristics.py
runs them) and to capture/lower/print a `score_mod` or `mask_mod` (capture.py, lower.py,
triton_kernel.py's printer). Only __init__.py imports it.

Consumes Stax tensors q [B, H, M, D], k and v [B, HK, N, D] (HK divides H: grouped heads), and
for omni_attention the user's `score_mod(score, b, h, q_idx, kv_idx)` and a `BlockMask`.
Produces the attention output (and with `return_lse`, the LSE [B, H, M] the backward needs).

- `scaled_dot_product_attention` is one graph op, `sdpa` (op_table.py): eager it runs in float64
  numpy; compiled for the GPU it becomes the flash template (codegen_triton.py); compiled for the
  CPU it runs as a §6.1 fallback.
- `omni_attention` traces `score_mod` and `mask_mod` into small graphs, lowers them, and prints
  their `inner_fn` with the Triton printer between the QKᵀ dot and the online update. On "cuda"
  tensors it launches that template; on the CPU it evaluates the same functions eagerly. Under
  `stax.compile` it is a graph break: the template is itself the compiled kernel.

Where to look:
  - `scaled_dot_product_attention`, `attention_forward` ..... the sdpa op, and (out, LSE)
  - `create_block_mask`, `BlockMask` ......................... Figure 9.3's full/partial/empty blocks
  - `trace_mod` ............................................... score_mod/mask_mod → printed lines
  - `omni_attention` .......................................... Listing 9.7
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import tensor_ops as _ops
from .attention_kernels import (ModBody, apply_mask, as_operand, attention_scores, attention_template,
                                finish_triple, launch_numels, make_spec, sdpa_lse_numpy, triple_of,
                                _expand_heads)
from .dtypes import bool_, float32, float64, int32
from .tensor import Tensor, _meta, _op, current_tracer, empty, from_numpy

BACKENDS = ("TRITON", "CPP")


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
    a float mask adds; `is_causal` keeps key j ≤ query i. Inference only: dropout_p must be 0."""
    _check_qkv(query, key, value, enable_gqa)
    if dropout_p:
        raise NotImplementedError("scaled_dot_product_attention: Stax has no dropout (inference "
                                  "only); pass dropout_p=0.0")
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
    return _op("sdpa", inputs, params, _meta(shape, query.dtype, query.device))


def _host(t) -> np.ndarray:
    """A tensor's values on the host in their compute form (half types as float32)."""
    return None if t is None else t.cpu()._compute()


def _to_tensor(a: np.ndarray, dtype, device) -> Tensor:
    t = from_numpy(np.ascontiguousarray(a.astype(np.float64))).to(dtype)
    return t if device == "cpu" else t.to(device)


# ---- §9.10 Launching a template directly (eager on "cuda" tensors) ----

_KERNELS: dict = {}          # kernel text -> its CachingAutotuner (compiled once per text)


def _operand(t):
    return as_operand(t._meta.shape, t._meta.stride, t._meta.offset)


def _launch(spec, args: list):
    """Run the template of `spec` on `args` (q, k, v [, mask] [, block mask], out, lse)."""
    from .triton_heuristics import kernel_from_source
    name, src = attention_template(0, spec)
    kernel = _KERNELS.get(src)
    if kernel is None:
        kernel = _KERNELS[src] = kernel_from_source(name, src)
    kernel.run(*args, *launch_numels(spec))


def _gpu_forward(q, k, v, spec, extra: list):
    b, h, _, m, _, _ = spec.dims
    out = empty(*q.shape, dtype=q.dtype, device=q.device)
    lse = empty(*q.shape[:-1], dtype=float32, device=q.device)
    spec.out = _operand(out)
    _launch(spec, [q, k, v] + extra + [out, lse])
    return out, lse


def _backend(kernel_options, device) -> str:
    backend = (kernel_options or {}).get("BACKEND", "TRITON" if device != "cpu" else "EAGER")
    if backend not in BACKENDS + ("EAGER",):
        raise ValueError(f"kernel_options BACKEND={backend!r}: choose one of {BACKENDS}")
    if backend == "CPP":
        raise NotImplementedError("BACKEND='CPP': Stax has no C++ attention template yet; leave BACKEND "
                                  "unset on CPU tensors (the eager float64 path) or use 'TRITON' on "
                                  "cuda tensors")
    if backend == "TRITON" and device == "cpu":
        raise RuntimeError("BACKEND='TRITON' needs cuda tensors; move q, k, v with .to('cuda')")
    return backend


def attention_forward(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
                      kernel_options=None):
    """(out, LSE): the attention and its per-row log-sum-exp m + log ℓ ([..., M], float32), what
    the backward recomputes P from. cuda tensors run the flash template, CPU ones float64 numpy."""
    _check_qkv(q, k, v, enable_gqa)
    if current_tracer() is not None:
        current_tracer().graph_break("attention_forward launches its own kernel")
    if _backend(kernel_options, q.device) == "TRITON":
        mask_dtype = attn_mask.dtype.name if attn_mask is not None else ""
        spec = make_spec(_operand(q), _operand(k), _operand(v), _operand(q), q.dtype.name, scale,
                         is_causal, _operand(attn_mask) if attn_mask is not None else None, mask_dtype)
        if spec is None:
            raise RuntimeError(f"the flash template does not cover q {tuple(q.shape)}, k {tuple(k.shape)}, "
                               f"{q.dtype.name} (rank ≤ 4, head dim ≤ 256, ≤ 65535 batch·heads); "
                               "run on the CPU instead")
        return _gpu_forward(q, k, v, spec, [attn_mask] if attn_mask is not None else [])
    with np.errstate(all="ignore"):
        o, lse = sdpa_lse_numpy(_host(q), _host(k), _host(v), _host(attn_mask), is_causal, scale)
    return _to_tensor(o, q.dtype, q.device), _to_tensor(lse, float32, q.device)
