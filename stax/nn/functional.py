"""`stax.nn.functional`: PyTorch's `torch.nn.functional`, spelled the same, over Stax's ops.

    import stax.nn.functional as F
    loss = F.cross_entropy(logits, target, label_smoothing=0.1)

Layer: the top of the stack, beside the package (`stax/nn/` holds only thin PyTorch-spelling
modules over the flat package). Every function here is a composite of the public ops of
tensor_ops.py, shape_ops.py and math_ops.py, so it traces into primitives the §6 lowering fuses;
nothing here reaches the IR. Consumes and produces Tensors.

How the losses fuse: `cross_entropy` picks the target's logit without a gather, as a reduction
over the class dim beside logsumexp (`sum(where(class_index == target, x, 0))`), so the row max, the
sum of exponentials and the pick are one multi-reduction kernel (§9.5) and no (N, C) temporary is
stored; `mean` adds one small reduction over the rows.

Where to look:
  - activations ........... relu ... mish, softmax, log_softmax, glu
  - normalization ......... layer_norm, rms_norm, group_norm, batch_norm, normalize
  - linear, attention ..... linear, scaled_dot_product_attention
  - pad, pooling .......... pad (constant, reflect, replicate, circular), max_pool2d, avg_pool2d
  - losses ................ cross_entropy, nll_loss, mse_loss, l1_loss, smooth_l1_loss, huber_loss,
                            binary_cross_entropy(_with_logits)
  - dropout, one_hot ...... dropout (Philox4x32-10 stream, op_table.philox_uniform), one_hot
  - not here yet .......... conv2d (a template, another piece of work), embedding (indirect indexing)
"""
import builtins as _b
import math

from .. import shape_ops as _s
from .. import tensor_ops as _t
from ..dtypes import _HALF, bfloat16, float16, float32, float64, int64
from ..indexing import _along_dim, _index
from ..math_ops import abs, clamp_min, masked_fill, norm, philox_rand, zeros_like
from ..tensor import Tensor, arange, full
from ..tensor_ops import (_downcast, _upcast, add, amax, cat, div, exp, expand, expm1, gelu, log, log1p,
                          matmul, maximum, mean, mul, reshape, rsqrt, sigmoid, softmax as _softmax,
                          log_softmax as _log_softmax, layer_norm, sub, sum, tanh, to_dtype, unsqueeze,
                          view, where)

__all__ = """relu relu6 hardtanh leaky_relu elu selu celu gelu silu sigmoid tanh softplus logsigmoid
    hardsigmoid hardswish mish softsign tanhshrink glu softmax log_softmax softmin layer_norm rms_norm
    group_norm batch_norm normalize linear scaled_dot_product_attention pad max_pool2d avg_pool2d
    mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy_with_logits binary_cross_entropy
    nll_loss cross_entropy dropout one_hot conv2d""".split()

_EPS = {float32: 1.1920928955078125e-07, float64: 2.220446049250313e-16, float16: 0.0009765625,
        bfloat16: 0.0078125}


# ---- Activations ----


def _maybe_inplace(x, y, inplace):
    return _t._inplace(x, y, "inplace") if inplace else y


def relu(input, inplace=False):
    return _maybe_inplace(input, _t.relu(input), inplace)


def silu(input, inplace=False):
    return _maybe_inplace(input, _t.silu(input), inplace)


def relu6(input, inplace=False):
    return hardtanh(input, 0.0, 6.0, inplace)


def hardtanh(input, min_val=-1.0, max_val=1.0, inplace=False):
    return _maybe_inplace(input, _t.clamp(input, min_val, max_val), inplace)


def leaky_relu(input, negative_slope=0.01, inplace=False):
    return _maybe_inplace(input, where(_t.gt(input, 0), input, mul(input, negative_slope)), inplace)


def elu(input, alpha=1.0, inplace=False):
    x, half = _upcast(input)
    y = _downcast(where(_t.gt(x, 0), x, mul(expm1(x), alpha)), half)
    return _maybe_inplace(input, y, inplace)


def selu(input, inplace=False):
    alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
    return _maybe_inplace(input, mul(elu(input, alpha), scale), inplace)


def celu(input, alpha=1.0, inplace=False):
    x, half = _upcast(input)
    y = _downcast(where(_t.gt(x, 0), x, mul(expm1(div(x, alpha)), alpha)), half)
    return _maybe_inplace(input, y, inplace)


def softplus(input, beta=1.0, threshold=20.0):
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (PyTorch's cut-off)."""
    x, half = _upcast(input)
    bx = mul(x, beta)
    return _downcast(where(_t.gt(bx, threshold), x, div(log1p(exp(bx)), beta)), half)


def logsigmoid(input):
    x, half = _upcast(input)     # -softplus(-x), stable for both signs
    return _downcast(sub(_t.minimum(x, 0), log1p(exp(_t.neg(abs(x))))), half)


def hardsigmoid(input, inplace=False):
    return _maybe_inplace(input, div(_t.clamp(add(input, 3), 0, 6), 6), inplace)


def hardswish(input, inplace=False):
    return _maybe_inplace(input, mul(input, div(_t.clamp(add(input, 3), 0, 6), 6)), inplace)


def mish(input, inplace=False):
    x, half = _upcast(input)
    return _maybe_inplace(input, _downcast(mul(x, tanh(softplus(x))), half), inplace)


def softsign(input):
    return div(input, add(abs(input), 1))


def tanhshrink(input):
    return sub(input, tanh(input))


def glu(input, dim=-1):
    a, b = _s.chunk(input, 2, dim)
    return mul(a, sigmoid(b))


def _softmax_dim(ndim):
    return 0 if ndim in (0, 1, 3) else 1      # PyTorch's legacy implicit dim


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    return _softmax(input, _softmax_dim(input.ndim) if dim is None else dim, dtype)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    return _log_softmax(input, _softmax_dim(input.ndim) if dim is None else dim, dtype)


def softmin(input, dim=None, _stacklevel=3, dtype=None):
    return softmax(_t.neg(input), dim, dtype=dtype)


# ---- Normalization ----


def rms_norm(input, normalized_shape, weight=None, eps=None):
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(input.shape[input.ndim - len(ns):]) != ns:
        raise RuntimeError(f"Given normalized_shape={list(ns)}, expected input with shape [*, "
                           f"{', '.join(map(str, ns))}], but got input of size{list(input.shape)}")
    eps = _EPS.get(input.dtype, _EPS[float32]) if eps is None else eps
    x, half = _upcast(input)
    dims = tuple(range(x.ndim - len(ns), x.ndim))
    y = mul(x, rsqrt(add(mean(mul(x, x), dims, keepdim=True), eps)))
    if weight is not None:
        y = mul(y, weight)
    return _downcast(y, half)


def _channel_view(t, ndim):
    """A per-channel (C,) tensor shaped to broadcast along dim 1 of an ndim-D input."""
    return view(t, (1, t.shape[0]) + (1,) * (ndim - 2)) if ndim >= 2 else t


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-05):
    n, c = input.shape[0], input.shape[1]
    if c % num_groups:
        raise RuntimeError(f"Expected number of channels in input to be divisible by num_groups, but got "
                           f"input of shape {list(input.shape)} and num_groups={num_groups}")
    x, half = _upcast(input)
    g = reshape(x, (n, num_groups, -1))
    mu = mean(g, -1, keepdim=True)
    dev = sub(g, mu)
    var = mean(mul(dev, dev), -1, keepdim=True)
    y = reshape(mul(dev, rsqrt(add(var, eps))), x.shape)
    if weight is not None:
        y = mul(y, _channel_view(weight, x.ndim))
    if bias is not None:
        y = add(y, _channel_view(bias, x.ndim))
    return _downcast(y, half)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
               eps=1e-05):
    """Normalize over every dim but the channels (dim 1). Training: batch statistics, and the
    running statistics are updated in place (the variance unbiased, as PyTorch)."""
    dims = tuple(d for d in range(input.ndim) if d != 1)
    count = math.prod(input.shape[d] for d in dims)
    x, half = _upcast(input)
    if training:
        if count <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size "
                             f"{list(input.shape)}")
        mu = mean(x, dims)
        dev = sub(x, _channel_view(mu, x.ndim))
        var = div(sum(mul(dev, dev), dims), count)
        if running_mean is not None:
            running_mean.copy_(add(mul(running_mean, 1 - momentum), mul(mu, momentum)))
        if running_var is not None:
            running_var.copy_(add(mul(running_var, 1 - momentum), mul(var, momentum * count / (count - 1))))
    else:
        if running_mean is None or running_var is None:
            raise RuntimeError("batch_norm: running_mean and running_var must be given when training=False")
        mu, var = to_dtype(running_mean, x.dtype), to_dtype(running_var, x.dtype)
        dev = sub(x, _channel_view(mu, x.ndim))
    y = mul(dev, _channel_view(rsqrt(add(var, eps)), x.ndim))
    if weight is not None:
        y = mul(y, _channel_view(weight, x.ndim))
    if bias is not None:
        y = add(y, _channel_view(bias, x.ndim))
    return _downcast(y, half)


def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    n = clamp_min(norm(input, p, dim, keepdim=True), eps)
    return div(input, expand(n, input.shape))


# ---- Linear, attention ----


def linear(input, weight, bias=None):
    y = matmul(input, _t.t(weight) if weight.ndim == 2 else weight)
    return y if bias is None else add(y, bias)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False):
    """softmax(q k^T * scale + mask) v: the flash template (§9.10, stax.scaled_dot_product_attention);
    written out (one matmul, a fused softmax, one matmul) under dropout or when a gradient is
    needed (autograd differentiates the ops; the template's backward is not wired to it yet)."""
    from ..autograd import is_grad_enabled
    needs_grad = is_grad_enabled() and _b.any(
        isinstance(t, Tensor) and t.requires_grad for t in (query, key, value, attn_mask))
    if dropout_p == 0 and not needs_grad:
        from ..attention import scaled_dot_product_attention as flash
        return flash(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    L, S = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = mul(matmul(query, _s.swapaxes(key, -2, -1)), scale)
    if is_causal:
        s = masked_fill(s, _t.gt(arange(S, device=query.device), unsqueeze(arange(L, device=query.device), 1)),
                        -math.inf)
    if attn_mask is not None:
        s = masked_fill(s, _t.logical_not(attn_mask), -math.inf) if attn_mask.dtype.name == "bool" \
            else add(s, attn_mask)
    p = _softmax(s, -1)
    if dropout_p > 0:
        p = dropout(p, dropout_p)
    return matmul(p, value)


# ---- Pad and pooling ----


def _pad_dim(x, d, left, right, mode, value):
    n = x.shape[d]
    if left < 0 or right < 0:       # negative padding crops
        x = _t.narrow(x, d, _b.max(-left, 0), n - _b.max(-left, 0) - _b.max(-right, 0))
        return _pad_dim(x, d, _b.max(left, 0), _b.max(right, 0), mode, value)
    if left == 0 and right == 0:
        return x
    if mode == "constant":
        def block(k):
            shape = list(x.shape)
            shape[d] = k
            return full(tuple(shape), value, dtype=x.dtype, device=x.device)
        parts = [block(left), x, block(right)]
    elif mode == "reflect":
        if left >= n or right >= n:
            raise RuntimeError(f"Argument #4: Padding size should be less than the corresponding input "
                               f"dimension, but got: padding ({left}, {right}) at dimension {d} of input "
                               f"{list(x.shape)}")
        parts = [_s.flip(_t.narrow(x, d, 1, left), d), x, _s.flip(_t.narrow(x, d, n - 1 - right, right), d)]
    elif mode == "replicate":
        def edge(start, k):
            shape = list(x.shape)
            shape[d] = k
            return expand(_t.narrow(x, d, start, 1), tuple(shape))
        parts = [edge(0, left), x, edge(n - 1, right)]
    elif mode == "circular":
        if left > n or right > n:
            raise RuntimeError("Padding value causes wrapping around more than once.")
        parts = [_t.narrow(x, d, n - left, left), x, _t.narrow(x, d, 0, right)]
    else:
        raise NotImplementedError(f"Unrecognised padding mode {mode}")
    return cat([p for p in parts if p.shape[d] > 0], d)


def pad(input, pad, mode="constant", value=None):
    """Pad the last len(pad) // 2 dims, (left, right) pairs from the last dim back: a cat of
    constant blocks, flipped or repeated edge slices (masked loads, one kernel)."""
    if len(pad) % 2:
        raise RuntimeError("Padding length must be divisible by 2")
    if len(pad) // 2 > input.ndim:
        raise RuntimeError("Padding length should be less than or equal to two times the input dimension "
                           f"but got padding length {len(pad)} and input of dimension {input.ndim}")
    if mode != "constant" and value not in (None, 0):
        raise RuntimeError(f"Padding mode \"{mode}\" doesn't take in value argument")
    x = input
    for i in range(len(pad) // 2):
        x = _pad_dim(x, input.ndim - 1 - i, pad[2 * i], pad[2 * i + 1], mode, 0 if value is None else value)
    return x


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _pool_geometry(size, k, s, p, d, ceil_mode):
    """Output length and the right padding that makes every window's slice fit."""
    if p > (d * (k - 1) + 1) // 2:
        raise RuntimeError(f"pad should be at most half of effective kernel size, but got pad={p}, "
                           f"kernel_size={k} and dilation={d}")
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    if out <= 0:
        raise RuntimeError(f"Given input size {size}, kernel {k}, stride {s}, padding {p}, dilation {d}: "
                           "the output size is too small")
    return out, _b.max(p, (out - 1) * s + d * (k - 1) + 1 - size - p)


def _windows(x, k, s, d, out):
    """For each kernel offset (i, j): the strided (out_h, out_w) view of the padded input."""
    h, w = x.ndim - 2, x.ndim - 1
    for i in range(k[0]):
        rows = _t._slice(x, h, i * d[0], i * d[0] + (out[0] - 1) * s[0] + 1, s[0])
        for j in range(k[1]):
            yield _t._slice(rows, w, j * d[1], j * d[1] + (out[1] - 1) * s[1] + 1, s[1])


def _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode):
    if x.ndim not in (3, 4):
        raise RuntimeError(f"Expected 3D or 4D (batch mode) tensor for input, got {list(x.shape)}")
    k, p, d = _pair(kernel_size), _pair(padding), _pair(dilation)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _pair(stride)
    geo = [_pool_geometry(x.shape[x.ndim - 2 + a], k[a], s[a], p[a], d[a], ceil_mode) for a in (0, 1)]
    return k, s, p, d, tuple(g[0] for g in geo), (p[1], geo[1][1], p[0], geo[0][1])


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """The elementwise maximum of the k*k strided views of the -inf-padded input (one kernel)."""
    if return_indices:
        raise NotImplementedError("stax max_pool2d: return_indices=True is not supported yet")
    k, s, p, d, out, pads = _pool_args(input, kernel_size, stride, padding, dilation, ceil_mode)
    low = -math.inf if input.dtype.is_floating_point else -(2 ** (8 * input.dtype.itemsize - 1))
    x = pad(input, pads, value=low)
    y = None
    for win in _windows(x, k, s, d, out):
        y = win if y is None else maximum(y, win)
    return y


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """The sum of the k*k strided views of the zero-padded input over each window's divisor (the
    same sum over a mask of the cells that count, so ceil_mode and count_include_pad follow ATen)."""
    k, s, p, _, out, pads = _pool_args(input, kernel_size, stride, padding, 1, ceil_mode)
    x, half = _upcast(input if input.dtype.is_floating_point else to_dtype(input, float32))
    total = None
    for win in _windows(pad(x, pads), k, s, (1, 1), out):
        total = win if total is None else add(total, win)
    if divisor_override is not None:
        return _downcast(div(total, divisor_override), half)
    h, w = x.shape[-2:]
    inner = full((h, w), 1.0, dtype=float32, device=x.device)
    if count_include_pad:   # the padding counts, the ceil_mode overhang past it does not
        mask = pad(pad(inner, (p[1], p[1], p[0], p[0]), value=1.0),
                   (0, pads[1] - p[1], 0, pads[3] - p[0]), value=0.0)
    else:
        mask = pad(inner, pads, value=0.0)
    count = None
    for win in _windows(mask, k, s, (1, 1), out):
        count = win if count is None else add(count, win)
    return _downcast(div(total, count), half)


# ---- Losses ----


def _reduce(loss, reduction):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return sum(loss)
    if reduction == "mean":
        return mean(loss)
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _check_reduction(reduction):
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")


def _float_pair(input, target):
    x, half = _upcast(input)
    return x, to_dtype(target, x.dtype) if isinstance(target, Tensor) else target, half


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    _check_reduction(reduction)
    x, t, half = _float_pair(input, target)
    d = sub(x, t)
    loss = mul(d, d) if weight is None else mul(mul(d, d), weight)
    return _downcast(_reduce(loss, reduction), half)


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    _check_reduction(reduction)
    x, t, half = _float_pair(input, target)
    loss = abs(sub(x, t)) if weight is None else mul(abs(sub(x, t)), weight)
    return _downcast(_reduce(loss, reduction), half)


def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    _check_reduction(reduction)
    if beta < 0:
        raise RuntimeError("smooth_l1_loss does not support negative values for beta.")
    if beta == 0:
        return l1_loss(input, target, reduction=reduction)
    x, t, half = _float_pair(input, target)
    a = abs(sub(x, t))
    loss = where(_t.lt(a, beta), div(mul(mul(a, a), 0.5), beta), sub(a, 0.5 * beta))
    return _downcast(_reduce(loss, reduction), half)


def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    _check_reduction(reduction)
    x, t, half = _float_pair(input, target)
    a = abs(sub(x, t))
    loss = where(_t.lt(a, delta), mul(mul(a, a), 0.5), mul(sub(a, 0.5 * delta), delta))
    loss = loss if weight is None else mul(loss, weight)
    return _downcast(_reduce(loss, reduction), half)


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """(1 - y) x + (1 + (pw - 1) y) (log1p(exp(-|x|)) + max(-x, 0)): stable for large |x|."""
    _check_reduction(reduction)
    if tuple(target.shape) != tuple(input.shape):
        raise ValueError(f"Target size ({list(target.shape)}) must be the same as input size "
                         f"({list(input.shape)})")
    x, y, half = _float_pair(input, target)
    soft = add(log1p(exp(_t.neg(abs(x)))), maximum(_t.neg(x), 0))
    log_weight = 1 if pos_weight is None else add(mul(sub(pos_weight, 1), y), 1)
    loss = add(mul(sub(1, y), x), mul(log_weight, soft) if pos_weight is not None else soft)
    loss = loss if weight is None else mul(loss, weight)
    return _downcast(_reduce(loss, reduction), half)


def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    _check_reduction(reduction)
    x, y, half = _float_pair(input, target)
    lx, l1x = maximum(log(x), -100.0), maximum(log(sub(1, x)), -100.0)     # ATen clamps the logs
    loss = _t.neg(add(mul(y, lx), mul(sub(1, y), l1x)))
    loss = loss if weight is None else mul(loss, weight)
    return _downcast(_reduce(loss, reduction), half)


def _pick(x, tt, class_dim=1):
    """x[..., t, ...] along the class dim for class targets `tt` (size 1 there): a gather, fused
    into the kernel over the rows, whose indices are checked as nll_loss checks them: a target
    outside [0, C) raises PyTorch's IndexError ("Target 7 is out of bounds.") eagerly and in
    compiled CPU code, negatives included (op_table.TARGET_INDEX_OPS); on the GPU as any gather
    (a device_assert under STAX_DEBUG_INDEX=1)."""
    picked = _index(x, _along_dim(x, class_dim, tt, "nll_loss"), list(range(x.ndim)), 0, "nll_loss")
    return _t.squeeze(picked, class_dim)


def _nll_terms(logp_fn, x, target, weight, ignore_index):
    """Per-element (-w[t] * logp[t]) masked by ignore_index, the weights w[t], and the validity mask."""
    valid = _t.ne(target, ignore_index)
    tt = unsqueeze(where(valid, target, 0), 1)     # ignored elements read class 0 (unused)
    picked = logp_fn(_pick(x, tt))
    w = to_dtype(valid, x.dtype) if weight is None else \
        where(valid, _pick(expand(_channel_view(to_dtype(weight, x.dtype), x.ndim), x.shape), tt), 0.0)
    loss = where(valid, mul(_t.neg(picked), w), 0.0)
    return loss, w, valid


def _as_batched(input, target):
    """(C,) input with a 0-d target is one sample: (1, C) and (1,)."""
    if input.ndim == 1:
        return unsqueeze(input, 0), unsqueeze(target, 0), True
    return input, target, False


def _finish(loss, w, reduction, squeeze_one):
    if reduction == "none":
        return _t.squeeze(loss, 0) if squeeze_one else loss
    if reduction == "sum":
        return sum(loss)
    return div(sum(loss), sum(w))


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    _check_reduction(reduction)
    x, target, one = _as_batched(input, target)
    x, half = _upcast(x)
    loss, w, _ = _nll_terms(lambda picked: picked, x, target, weight, ignore_index)
    return _downcast(_finish(loss, w, reduction, one), half)


def _lse(x, class_dim=1):
    """logsumexp over the class dim, kept as a size-1 dim (the row max, then the sum: one kernel)."""
    m = amax(x, class_dim, keepdim=True)
    m = where(_t.isinf(m), 0.0, m)
    return add(log(sum(exp(sub(x, m)), class_dim, keepdim=True)), m)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """log_softmax + nll_loss in one pass over each row: loss = lse - x[target] (fused pick), with
    label smoothing lse - mean_c x_c blended in (PyTorch's formula, weights included)."""
    _check_reduction(reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"label_smoothing must be between 0.0 and 1.0. Got: {label_smoothing}")
    x, target, one = _as_batched(input, target)
    x, half = _upcast(x)
    if target.dtype.is_floating_point:
        return _downcast(_soft_cross_entropy(x, target, weight, reduction, label_smoothing, one), half)
    lse = _t.squeeze(_lse(x), 1)
    loss, w, valid = _nll_terms(lambda picked: sub(picked, lse), x, target, weight, ignore_index)
    if label_smoothing == 0:
        return _downcast(_finish(loss, w, reduction, one), half)
    c = x.shape[1]
    wc = None if weight is None else _channel_view(to_dtype(weight, x.dtype), x.ndim)
    logp_sum = sum(sub(x, unsqueeze(lse, 1)) if wc is None else mul(sub(x, unsqueeze(lse, 1)), wc), 1)
    smooth = where(valid, _t.neg(logp_sum), 0.0)
    if reduction == "none":
        smooth = _t.squeeze(smooth, 0) if one else smooth
        nll = _t.squeeze(loss, 0) if one else loss
        return _downcast(add(mul(nll, 1 - label_smoothing), mul(smooth, label_smoothing / c)), half)
    nll, smooth = _finish(loss, w, reduction, one), sum(smooth)
    if reduction == "mean":
        smooth = div(smooth, sum(w))
    return _downcast(add(mul(nll, 1 - label_smoothing), mul(smooth, label_smoothing / c)), half)


def _soft_cross_entropy(x, target, weight, reduction, label_smoothing, one):
    """Class probabilities as the target: -sum_c w_c y_c logp_c, mean over the batch elements."""
    if tuple(target.shape) != tuple(x.shape):
        raise RuntimeError(f"Expected target size {list(x.shape)}, got {list(target.shape)}")
    c = x.shape[1]
    y = to_dtype(target, x.dtype)
    if label_smoothing > 0:
        y = add(mul(y, 1 - label_smoothing), label_smoothing / c)
    logp = sub(x, _lse(x))
    term = mul(y, logp) if weight is None else mul(mul(y, logp), _channel_view(to_dtype(weight, x.dtype), x.ndim))
    loss = _t.neg(sum(term, 1))
    if reduction == "none":
        return _t.squeeze(loss, 0) if one else loss
    if reduction == "sum":
        return sum(loss)
    return div(sum(loss), loss.numel())


# ---- Dropout, one_hot ----


def dropout(input, p=0.5, training=True, inplace=False):
    """Zero each element with probability p and scale the rest by 1 / (1 - p); identity when not
    training. The mask comes from the Philox4x32-10 stream (`stax.manual_seed` replays it)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0:
        return input
    if p == 1:
        return _maybe_inplace(input, mul(input, zeros_like(input, dtype=input.dtype)), inplace)
    u = philox_rand(input.shape, dtype=float32, device=input.device)
    keep = to_dtype(_t.ge(u, p), float32)
    y = mul(input, mul(keep, 1.0 / (1.0 - p)))
    return _maybe_inplace(input, to_dtype(y, input.dtype) if input.dtype in _HALF else y, inplace)


def one_hot(tensor, num_classes=-1):
    if tensor.dtype is not int64:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    if num_classes == -1:
        if tensor.numel() == 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        num_classes = int(_t.amax(tensor).item()) + 1
    if tensor._node is None and tensor.numel():
        if int(_t.amin(tensor).item()) < 0:
            raise RuntimeError("Class values must be non-negative.")
        if int(_t.amax(tensor).item()) >= num_classes:
            raise RuntimeError("Class values must be smaller than num_classes.")
    return to_dtype(_t.eq(unsqueeze(tensor, -1), arange(num_classes, device=tensor.device)), int64)


# ---- Not here yet ----


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """Rows of `weight` at `input` (a fused gather, §6 indirect indexing)."""
    if max_norm is not None:
        raise NotImplementedError("F.embedding(max_norm=...) renormalizes the table in place: not "
                                  "supported; renormalize the weight yourself")
    from ..indexing import embedding as _embedding
    return _embedding(input, weight)


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """§9.8 convolution (stax.conv2d): an implicit-GEMM template on the GPU, im2col + BLAS on the CPU."""
    from ..conv import conv2d as _conv2d
    return _conv2d(input, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups)


def __getattr__(name):
    raise AttributeError(f"stax.nn.functional has no '{name}' (not implemented in Stax yet); "
                         "see docs/OPS.md for what exists")
