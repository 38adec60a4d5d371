"""Example 6.1: x.t() + y, output 256x512.

`x.t()` is a view: no data moves, only the index changes. Lowering turns the transpose into an index
rewrite, so the kernel reads x[j, i] while it reads y[i, j]: one input walks memory along rows, the
other along columns. The C++ back end tiles the loop nest (§8.2) so that both stay cache-friendly.
Output 256x512 from x of shape 512x256 and y of shape 256x512.

    python -m stax run examples/ex6_1_transpose_add.py --show ir,kernels
"""
import numpy as np

import stax


@stax.compile
def transpose_add(x, y):
    return x.t() + y


def main():
    stax.manual_seed(0)
    x = stax.randn(512, 256)
    y = stax.randn(256, 512)

    out = transpose_add(x, y)

    expected = x.cpu().numpy().astype(np.float64).T + y.cpu().numpy().astype(np.float64)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)

    print("out.shape:", tuple(out.shape))
    print("out[0, :4]:", np.round(out.cpu().numpy()[0, :4], 4))
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
