"""Example 1.1: (relu(x + y) * 2).sum(-1) on 64x128.

Four operations, one kernel. Eagerly, each op reads its inputs from memory and writes a fresh
64x128 result, so the data crosses memory seven times; Stax fuses add, relu, mul and sum into one
loop nest that reads x and y once and writes 64 numbers: the lower bound of Prop. 1.1.

Run it with the compiler's stages shown:

    python -m stax run examples/ex1_1_relu_sum.py --show graph,ir,schedule,kernels,wrapper
"""
import numpy as np

import stax


@stax.compile                      # capture on the first call, then compile and cache
def relu_sum(x, y):
    return (stax.relu(x + y) * 2).sum(-1)


def main():
    stax.manual_seed(0)
    x = stax.randn(64, 128)        # float32, like torch.randn
    y = stax.randn(64, 128)

    out = relu_sum(x, y)           # first call: capture -> lower -> schedule -> C++ -> run
    out = relu_sum(x, y)           # same shapes/strides/dtypes: reuses the compiled artifact

    # The same computation in float64 numpy, as a reference.
    xn, yn = x.cpu().numpy().astype(np.float64), y.cpu().numpy().astype(np.float64)
    expected = (np.maximum(xn + yn, 0) * 2).sum(-1)
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)

    print("out.shape:", tuple(out.shape))
    print("out[:4]:  ", np.round(out.cpu().numpy()[:4], 4))
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
