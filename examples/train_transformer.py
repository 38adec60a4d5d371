"""Train a tiny transformer: §5 compiled training through attention's backward (§9.10).

The task (synthetic): each sequence is 16 random tokens of a 12-token vocabulary; at position i
the model must predict the token at position i - 2 (the first two positions are not scored). No
MLP of one position can do it: the answer is two positions back, so the causal attention must
learn to look there (by the learned position embeddings). The model: token and position
embeddings (d = 32), one block of layer_norm -> 2-head causal attention -> residual, layer_norm ->
MLP (GELU) -> residual, a final layer_norm and the logits; cross-entropy. With AdamW(lr=1e-2),
40 full-batch steps on 64 sequences take the loss from about 2.9 to about 0.002 (the script
checks TARGET_LOSS).

`train(compiled_model=True)` compiles the loss (§5: one joint graph, split by the min-cut: the
forward saves the attention's output and its LSE, never its N x N probabilities; the backward
runs attention's backward from them: on the GPU the dK/dV and dQ template kernels);
tests/test_attention_grad.py checks that its losses equal the eager ones step by step.

    python -m stax run examples/train_transformer.py
"""
import numpy as np

import stax
import stax.nn.functional as F

VOCAB, SEQ, DIM, HEADS, LAG = 12, 16, 32, 2, 2
TARGET_LOSS = 0.05


def make_data(n=64, seed=0, device="cpu"):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, SEQ))
    targets = np.full((n, SEQ), -100)                  # the first LAG positions have no answer
    targets[:, LAG:] = tokens[:, :-LAG]
    return (stax.tensor(tokens, dtype=stax.int64, device=device),
            stax.tensor(targets, dtype=stax.int64, device=device))


NAMES = ["tok", "pos", "ln1_w", "ln1_b", "wqkv", "wo", "ln2_w", "ln2_b", "w1", "b1", "w2", "b2",
         "lnf_w", "lnf_b", "head"]


def make_model(seed=1, device="cpu"):
    rng = np.random.default_rng(seed)
    shapes = {"tok": (VOCAB, DIM), "pos": (SEQ, DIM), "ln1_w": None, "ln1_b": (DIM,),
              "wqkv": (3 * DIM, DIM), "wo": (DIM, DIM), "ln2_w": None, "ln2_b": (DIM,),
              "w1": (4 * DIM, DIM), "b1": (4 * DIM,), "w2": (DIM, 4 * DIM), "b2": (DIM,),
              "lnf_w": None, "lnf_b": (DIM,), "head": (VOCAB, DIM)}
    params = []
    for name in NAMES:
        shape = shapes[name]
        if shape is None:                              # a layer_norm's weight starts at one
            value = np.ones(DIM)
        elif name.endswith("_b") or name in ("b1", "b2"):
            value = np.zeros(shape)
        else:
            value = rng.standard_normal(shape) * (0.5 if name in ("tok", "pos") else shape[-1] ** -0.5)
        params.append(stax.tensor(value, dtype=stax.float32, device=device, requires_grad=True))
    return params


def forward(params, tokens):
    p = dict(zip(NAMES, params))
    n = tokens.shape[0]
    x = F.embedding(tokens, p["tok"]) + p["pos"]                             # [n, SEQ, DIM]
    h = F.layer_norm(x, (DIM,), p["ln1_w"], p["ln1_b"])
    q, k, v = F.linear(h, p["wqkv"]).reshape(n, SEQ, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
    a = stax.scaled_dot_product_attention(q, k, v, is_causal=True)           # [n, HEADS, SEQ, DIM / HEADS]
    x = x + F.linear(a.transpose(1, 2).reshape(n, SEQ, DIM), p["wo"])
    h = F.layer_norm(x, (DIM,), p["ln2_w"], p["ln2_b"])
    x = x + F.linear(F.gelu(F.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"])
    return F.linear(F.layer_norm(x, (DIM,), p["lnf_w"], p["lnf_b"]), p["head"])


def loss_fn(*args):
    *params, tokens, targets = args
    logits = forward(params, tokens)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def train(steps=40, compiled_model=True, verbose=True, device="cpu", batch=64):
    tokens, targets = make_data(n=batch, device=device)
    params = make_model(device=device)
    opt = stax.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    # the parameters are arguments: a compiled function differentiates its inputs that require grad
    step_loss = stax.compile(loss_fn) if compiled_model else loss_fn
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = step_loss(*params, tokens, targets)
        loss.backward()
        opt.step()
        losses.append(float(loss.item()))
        if verbose and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}")
    return losses


if __name__ == "__main__":
    losses = train()
    assert losses[-1] < TARGET_LOSS, f"the transformer did not train: final loss {losses[-1]:.4f} >= {TARGET_LOSS}"
    print(f"final loss {losses[-1]:.5f} < {TARGET_LOSS}")
    print("matches numpy: OK (trained to the target loss)")
