"""`stax.conv2d`: PyTorch's 2-D convolution as one primitive op (§9.8, convolution as a template).

Layer: front, beside tensor_ops.py (it imports tensor.py and tensor_ops.py; nothing below imports
it). It checks the arguments as PyTorch does (with PyTorch's messages where they are simple),
normalizes stride / padding / dilation to pairs, computes the output's metadata and hands one
`conv2d` node to the choke point `tensor._op`. The eager implementation (im2col + BLAS) is
conv_numpy.py's, declared in op_table.py; lowering leaves the node as an ExternKernel (§6.1), which
the CPU runs as that fallback and the GPU prints as conv_template.py's implicit-GEMM kernel.

Consumes an input [N, C, H, W] (or unbatched [C, H, W]) of any strides, channels-last included
(read in place, never copied), a weight [C_out, C / groups, KH, KW] and an optional bias [C_out].
Produces a contiguous [N, C_out, OH, OW] tensor of the input's dtype, like every eager result.

Where to look:
  - `_pair`, `_padding` ........ int / tuple / "valid" / "same" → normalized parameters
  - `_check` ................... shape, dtype and device errors (PyTorch's wording)
  - `conv2d` ................... the entry
"""
from __future__ import annotations

from .conv_numpy import conv_out_size
from .tensor import Tensor, _device, _meta, _op
from .tensor_ops import squeeze, unsqueeze

__all__ = ["conv2d"]


# ---- Parameters ----


def _pair(value, name: str) -> tuple:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
        raise TypeError(f"conv2d(): argument '{name}' must be an int or a tuple of two ints, "
                        f"but got {value!r}")
    return pair


def _padding(padding, kernel: tuple, stride: tuple, dilation: tuple) -> tuple:
    """((top, bottom), (left, right)). "same" puts the odd element of an even total at the end,
    as PyTorch does."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0), (0, 0))
        if padding != "same":
            raise ValueError(f"Invalid padding string '{padding}', should be one of ['valid', 'same']")
        if stride != (1, 1):
            raise ValueError("padding='same' is not supported for strided convolutions")
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return tuple((t // 2, t - t // 2) for t in totals)
    ph, pw = _pair(padding, "padding")
    if ph < 0 or pw < 0:
        raise RuntimeError("negative padding is not supported")
    return ((ph, ph), (pw, pw))


# ---- Checks ----


def _check_tensors(x, weight, bias) -> None:
    for t, what in ((x, "input"), (weight, "weight"), (bias, "bias")):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"conv2d(): argument '{what}' must be a Tensor, not {type(t).__name__}")
    if not x.dtype.is_floating_point:
        raise RuntimeError(f"conv2d: expected a floating-point input, but got {x.dtype._tname.lower()}; "
                           "convert it with .float()")
    for t, what in ((weight, "weight"), (bias, "bias")):
        if t is not None and t.dtype is not x.dtype:
            raise RuntimeError(f"Input type ({x.dtype._tname.lower()}) and {what} type "
                               f"({t.dtype._tname.lower()}) should be the same")
    _device(x, weight, *([bias] if bias is not None else []))
    if weight.ndim != 4:
        raise RuntimeError(f"weight should have 4 dimensions for conv2d, but got weight of size "
                           f"{list(weight.shape)}")


def _check_shapes(x, weight, bias, groups: int, pad: tuple, dilation: tuple) -> None:
    c_out, cg, kh, kw = weight.shape
    if groups <= 0:
        raise RuntimeError("non-positive groups is not supported")
    if c_out % groups:
        raise RuntimeError(f"Given groups={groups}, expected weight to be divisible by {groups} at "
                           f"dimension 0, but got weight of size {list(weight.shape)} instead")
    if x.shape[1] != cg * groups:
        raise RuntimeError(f"Given groups={groups}, weight of size {list(weight.shape)}, expected "
                           f"input{list(x.shape)} to have {cg * groups} channels, but got "
                           f"{x.shape[1]} channels instead")
    if bias is not None and tuple(bias.shape) != (c_out,):
        raise RuntimeError(f"Given weight of size {list(weight.shape)}, expected bias to be "
                           f"1-dimensional with {c_out} elements, but got bias of size "
                           f"{list(bias.shape)} instead")
    padded = [x.shape[2 + i] + sum(pad[i]) for i in range(2)]
    extent = [dilation[i] * (k - 1) + 1 for i, k in enumerate((kh, kw))]
    if padded[0] < extent[0] or padded[1] < extent[1]:
        raise RuntimeError(f"Calculated padded input size per channel: ({padded[0]} x {padded[1]}). "
                           f"Kernel size: ({extent[0]} x {extent[1]}). Kernel size can't be greater "
                           "than actual input size")


# ---- The op ----


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d: out[n, co] = bias[co] + Σ_{c, kh, kw} weight[co, c, kh, kw] ·
    input_padded[n, g·Cg + c, oh·sh + kh·dh, ow·sw + kw·dw], g = co // (C_out / groups)."""
    _check_tensors(input, weight, bias)
    if input.ndim == 3:                  # unbatched
        return squeeze(conv2d(unsqueeze(input, 0), weight, bias, stride, padding, dilation, groups), 0)
    if input.ndim != 4:
        raise RuntimeError(f"Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input "
                           f"of size: {list(input.shape)}")
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    if min(stride) <= 0:
        raise RuntimeError("non-positive stride is not supported")
    if min(dilation) <= 0:
        raise RuntimeError("dilation should be greater than zero")
    if not isinstance(groups, int) or isinstance(groups, bool):
        raise TypeError(f"conv2d(): argument 'groups' must be int, not {type(groups).__name__}")
    kernel = tuple(weight.shape[2:])
    pad = _padding(padding, kernel, stride, dilation)
    _check_shapes(input, weight, bias, groups, pad, dilation)
    oh, ow = (conv_out_size(input.shape[2 + i], pad[i], dilation[i], kernel[i], stride[i]) for i in range(2))
    meta = _meta((input.shape[0], weight.shape[0], oh, ow), input.dtype, _device(input, weight))
    params = {"stride": stride, "padding": pad, "dilation": dilation, "groups": groups}
    inputs = [input, weight] + ([bias] if bias is not None else [])
    return _op("conv2d", inputs, params, meta)
