"""§9.10: nanoGPT's attention with its `tril` buffer against is_causal=True, on the GPU.

Three forms at GPT-2-small sizes (B=8, 12 heads, T=1024, head dim 64, bfloat16 by default), each
stax.compile'd, timed as bench/gpu.py times (`time_calls`: CUDA events after an L2 flush):

  - `buffer`: `att.masked_fill(bias[:, :, :T, :T] == 0, -inf)` with `bias` a module's
    tril(ones(1024, 1024)) buffer: the rewrite finds it causal by its values (the causal loop);
  - `buffer_data`: the same function after an in-place write to the buffer (bias[0, 0, 0, 0] = 1,
    the value it had: the values stay causal, but the version changed): the function compiles
    again with the mask as data, the template reading the N x N mask and skipping no blocks, which
    is what every buffer mask cost before this change;
  - `is_causal`: stax.scaled_dot_product_attention(q, k, v, is_causal=True).

The buffer form should time as is_causal (about half of buffer_data). Prints one JSON line.

    python bench/causal_buffer.py [bfloat16|float16|float32] [--t 1024]
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stax  # noqa: E402
import stax.nn.functional as F  # noqa: E402
from gpu import time_calls  # noqa: E402


class Attention:
    def __init__(self, block):
        self.bias = stax.tril(stax.ones(block, block)).view(1, 1, block, block).to("cuda")

    def forward(self, q, k, v):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def main(argv):
    dtype = getattr(stax, next((a for a in argv if a in ("bfloat16", "float16", "float32")), "bfloat16"))
    t = int(argv[argv.index("--t") + 1]) if "--t" in argv else 1024
    q, k, v = (stax.randn(8, 12, t, 64).to(dtype).to("cuda") for _ in range(3))
    m = Attention(t)
    buffer = stax.compile(lambda q, k, v: m.forward(q, k, v))
    rows = {"buffer": time_calls(buffer, (q, k, v))}
    causal_found = "is_causal=True" in buffer.last_generated.graph.format()
    m.bias[0, 0, 0, 0] = 1.0                   # a write (same value): the guard sees the version
    rows["buffer_data"] = time_calls(buffer, (q, k, v))
    data_after = "is_causal=False" in buffer.last_generated.graph.format()
    sdpa = stax.compile(lambda q, k, v: stax.scaled_dot_product_attention(q, k, v, is_causal=True))
    rows["is_causal"] = time_calls(sdpa, (q, k, v))
    print(json.dumps({"dtype": dtype.name, "B": 8, "H": 12, "T": t, "D": 64, "ms": rows,
                      "buffer_found_causal": causal_found, "data_after_write": data_after}))


if __name__ == "__main__":
    main(sys.argv[1:])
