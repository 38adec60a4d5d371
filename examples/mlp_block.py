"""A small MLP block: layer_norm(gelu(x @ w + b)), 128x256 @ 256x512.

The matmul is a "framework matmul" (§6.1 fallback kernel: on the CPU it calls BLAS through numpy).
Everything after it (the bias add, the exact GELU 0.5*h*(1 + erf(h/sqrt(2))), and the layer norm's
two reductions and its epilogue) is fused by Stax into generated C++ kernels that read the matmul's
output once. Stax carries its own vectorizable erf, so the GELU loop stays SIMD without -ffast-math.

    python -m stax run examples/mlp_block.py --show schedule,kernels,wrapper
"""
import math

import numpy as np

import stax


@stax.compile
def mlp_block(x, w, b, gamma, beta):
    h = x @ w + b                          # matmul (BLAS), then bias: broadcast over rows
    h = stax.gelu(h)                       # exact GELU (erf form)
    return stax.layer_norm(h, (h.shape[-1],), gamma, beta)


def main():
    stax.manual_seed(0)
    m, k, n = 128, 256, 512
    x = stax.randn(m, k)
    w = stax.randn(k, n) / math.sqrt(k)    # keep activations O(1)
    b = stax.randn(n)
    gamma, beta = stax.randn(n), stax.randn(n)

    out = mlp_block(x, w, b, gamma, beta)

    # float64 numpy reference
    f64 = lambda t: t.cpu().numpy().astype(np.float64)
    h = f64(x) @ f64(w) + f64(b)
    erf = np.vectorize(math.erf)
    h = 0.5 * h * (1 + erf(h / math.sqrt(2)))
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    expected = (h - mean) / np.sqrt(var + 1e-5) * f64(gamma) + f64(beta)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-4)

    print("out.shape:", tuple(out.shape))
    print("out[0, :4]:", np.round(out.cpu().numpy()[0, :4], 4))
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
