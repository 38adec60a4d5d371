"""Softmax over the last dimension, 256x1000.

softmax(x)[i, j] = exp(x[i, j] - max_j x[i, :]) / sum_j exp(x[i, j] - max_j x[i, :])

Eagerly this is five ops (amax, sub, exp, sum, div) and four full-size temporaries. Stax fuses
all of it into ONE kernel: per row, a pass for the max, a pass for the sum of exponentials, and a
pass that writes the result (a row of 1000 floats stays in cache between passes).

    python -m stax run examples/softmax.py --show graph,schedule,kernels
"""
import numpy as np

import stax


@stax.compile
def softmax(x):
    return stax.softmax(x, dim=-1)


def main():
    stax.manual_seed(0)
    x = stax.randn(256, 1000)

    out = softmax(x)

    xn = x.cpu().numpy().astype(np.float64)
    e = np.exp(xn - xn.max(-1, keepdims=True))
    expected = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)
    # each row of a softmax sums to 1
    np.testing.assert_allclose(out.cpu().numpy().sum(-1), 1.0, rtol=1e-4)

    print("out.shape:", tuple(out.shape))
    print("row sums: ", np.round(out.cpu().numpy().sum(-1)[:4], 5))
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
