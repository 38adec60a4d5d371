"""Listing 9.7 (§9.10): causal attention with an ALiBi bias through omni_attention.

`score_mod` rewrites each score, the block mask's `mask_mod` says which positions count. Both are
traced into small graphs, lowered, and printed into the attention template between the QKᵀ dot
and the online-softmax update; `create_block_mask` sorts 128×128 blocks into full, partial and
empty ones, so the template skips the empty half and calls mask_mod only on the diagonal
(Figure 9.3). Compiled, omni_attention is one graph node and one kernel: the flash Triton
template on a GPU, the C++ template on the CPU (eagerly on the CPU the same functions run in
float64 numpy, or in the C++ template with kernel_options={"BACKEND": "CPP"}).

The hand-written form, softmax(q @ k.transpose(-2, -1) / 8) @ v, is compiled too: on the GPU the
pattern rewrite turns it into the same template (one kernel, no N×N scores in memory).

    python -m stax run examples/listing_9_7_omni_attention.py --device cuda --show kernels
"""
import numpy as np

import stax
import stax as tp
from stax import create_block_mask, omni_attention

N = 256


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx):
    slope = tp.exp2(-(h + 1).to(tp.float32))       # one slope per head
    return score - slope * (q_idx - kv_idx)


@stax.compile
def attention(q, k, v):
    return stax.softmax(q @ k.transpose(-2, -1) / 8.0, -1) @ v


def reference(q, k, v, bias=True):
    q, k, v = (x.cpu().numpy().astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / 8.0
    if bias:
        i = np.arange(N)
        slope = 2.0 ** -(np.arange(q.shape[1]) + 1.0)
        s = s - slope[None, :, None, None] * (i[:, None] - i[None, :])
        s = np.where(i[:, None] >= i[None, :], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def main():
    stax.manual_seed(0)
    q, k, v = (stax.randn(1, 4, N, 64) for _ in range(3))     # `--device cuda`: on the GPU

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=N, KV_LEN=N, device=q.device)
    out = tp.compile(omni_attention)(q, k, v, score_mod=alibi, block_mask=block_mask)
    np.testing.assert_allclose(out.cpu().numpy(), reference(q, k, v), rtol=1e-4, atol=1e-5)
    print("block mask:", block_mask.counts(), "(Figure 9.3 at 1024: 8 partial, 28 full, 28 empty)")

    plain = attention(q, k, v)
    np.testing.assert_allclose(plain.cpu().numpy(), reference(q, k, v, bias=False), rtol=1e-4, atol=1e-5)
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
