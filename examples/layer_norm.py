"""Layer normalization over the last dimension, 512x768, with weight and bias.

y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      (var without correction, eps = 1e-5)

Two reductions over the same row (the mean, then the variance, which needs the mean) and a
pointwise epilogue: the scheduler puts them in one kernel (§7: several reductions over the same
rows), so x is read from memory once per row and y written once.

    python -m stax run examples/layer_norm.py --show schedule,kernels
"""
import numpy as np

import stax


@stax.compile
def layer_norm(x, weight, bias):
    return stax.layer_norm(x, (x.shape[-1],), weight, bias, eps=1e-5)


def main():
    stax.manual_seed(0)
    n, d = 512, 768
    x = stax.randn(n, d) * 3 + 1          # not already normalized
    weight = stax.randn(d)
    bias = stax.randn(d)

    out = layer_norm(x, weight, bias)

    xn = x.cpu().numpy().astype(np.float64)
    mean = xn.mean(-1, keepdims=True)
    var = ((xn - mean) ** 2).mean(-1, keepdims=True)
    expected = (xn - mean) / np.sqrt(var + 1e-5) * weight.cpu().numpy() + bias.cpu().numpy()
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-4)

    print("out.shape:", tuple(out.shape))
    print("out[0, :4]:", np.round(out.cpu().numpy()[0, :4], 4))
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
