"""Convolution in numpy (§9.8's convolution, eager side): im2col plus one BLAS matmul per group.

Layer: bottom, beside op_table.py (it imports only numpy). op_table.py's `conv2d` entry runs
`conv2d_numpy` as the eager implementation; the same function is the CPU's compiled form, run as a
§6.1 fallback kernel on the stored operands (views in place, whatever their strides). conv.py (the
tensor-level op) checks the arguments and computes the output shape with `conv_out_size`; the GPU
runs conv_template.py's implicit GEMM instead.

Consumes numpy arrays in compute form (float32 for half types, float64 for float64):
input [N, C, H, W], weight [C_out, C / groups, KH, KW], an optional bias [C_out], and normalized
parameters: stride (sh, sw), padding ((top, bottom), (left, right)), dilation (dh, dw), groups.
Produces the output [N, C_out, OH, OW], C-contiguous.

Why im2col + matmul: the gathered patches [groups, C/groups·KH·KW, N·OH·OW] make the whole
convolution one batched GEMM, which numpy hands to BLAS (multi-threaded, blocked). A direct C++
loop nest was measured against it on ResNet-50 shapes at batch 1 (bench/cpu.py, bench/RESULTS.md).

Where to look:
  - `conv_out_size` ........... PyTorch's output size (floor division; asymmetric padding allowed)
  - `_windows` ................ the zero-copy [N, C, KH, KW, OH, OW] view of the padded input
  - `conv2d_numpy` ............ the entry: pad, gather, matmul, bias
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def conv_out_size(size: int, pad: tuple, dilation: int, kernel: int, stride: int) -> int:
    """One spatial output size: (size + pad_before + pad_after - dilation·(kernel-1) - 1) // stride + 1."""
    return (size + pad[0] + pad[1] - dilation * (kernel - 1) - 1) // stride + 1


def _windows(xp: np.ndarray, kernel: tuple, out: tuple, stride: tuple, dilation: tuple) -> np.ndarray:
    """xp [N, C, Hp, Wp] seen as [N, C, KH, KW, OH, OW]: element (n, c, kh, kw, oh, ow) is
    xp[n, c, oh·sh + kh·dh, ow·sw + kw·dw]. A view (no copy); read-only, as it overlaps itself."""
    sn, sc, sh, sw = xp.strides
    shape = xp.shape[:2] + tuple(kernel) + tuple(out)
    strides = (sn, sc, sh * dilation[0], sw * dilation[1], sh * stride[0], sw * stride[1])
    return as_strided(xp, shape, strides, writeable=False)


def conv2d_numpy(x, weight, bias=None, *, stride, padding, dilation, groups):
    """The convolution of PyTorch's conv2d (cross-correlation), computed in x's dtype."""
    n, c, h, w = x.shape
    c_out, cg, kh, kw = weight.shape
    (pt, pb), (pl, pr) = padding
    oh = conv_out_size(h, (pt, pb), dilation[0], kh, stride[0])
    ow = conv_out_size(w, (pl, pr), dilation[1], kw, stride[1])
    out = np.empty((n, c_out, oh, ow), dtype=x.dtype)
    if out.size == 0:
        return out
    if cg == 0 or x.size == 0:                     # an empty sum: only the bias
        out[...] = 0 if bias is None else bias.reshape(1, c_out, 1, 1)
        return out
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr))) if (pt or pb or pl or pr) else x
    win = _windows(xp, (kh, kw), (oh, ow), stride, dilation)
    # patches [groups, Cg·KH·KW, N·OH·OW]: one copy, laid out for a batched GEMM
    cols = win.reshape(n, groups, cg, kh, kw, oh, ow).transpose(1, 2, 3, 4, 0, 5, 6)
    cols = cols.reshape(groups, cg * kh * kw, n * oh * ow)
    wmat = np.ascontiguousarray(weight).reshape(groups, c_out // groups, cg * kh * kw)
    res = np.matmul(wmat, cols)                    # [groups, C_out/groups, N·OH·OW]
    res = res.reshape(c_out, n, oh, ow).transpose(1, 0, 2, 3)
    if bias is not None:
        res = res + bias.reshape(1, c_out, 1, 1)
    out[...] = res
    return out
