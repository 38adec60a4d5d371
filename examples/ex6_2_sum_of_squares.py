"""Example 6.2: (x * x).sum(-1) on 64x16384.

Only 64 outputs, each a sum of 16384 squares. With one row per thread the machine would be
poorly used when rows are few and long; §6.5 (Alg. 6.1) splits such a reduction in two levels
(partial sums, then a small sum over them) when the back end asks for it. Watch the IR and the
schedule to see whether it does at this shape.

    python -m stax run examples/ex6_2_sum_of_squares.py --show ir,schedule,kernels
"""
import numpy as np

import stax


@stax.compile
def sum_of_squares(x):
    return (x * x).sum(-1)


def main():
    stax.manual_seed(0)
    x = stax.randn(64, 16384)

    out = sum_of_squares(x)

    xn = x.cpu().numpy().astype(np.float64)
    expected = (xn * xn).sum(-1)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)

    print("out.shape:", tuple(out.shape))
    print("out[:4]:  ", np.round(out.cpu().numpy()[:4], 2))
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
