"""A GPT-2 transformer block with its cross-entropy loss, written as PyTorch code (nanoGPT's Block).

Only the imports differ from the PyTorch program: `import stax as torch` and
`import stax.nn.functional as F`. The block is pre-norm attention (causal, a masked_fill'ed
score matrix, softmax) then a tanh-GELU MLP, then the tied LM head and `F.cross_entropy`. Stax
compiles it to matmul fallbacks (§6.1) with everything between them fused; the loss is one
reduction kernel over the logits' rows (the target's logit picked inside it, no (N, V) temporary).

    python -m stax run examples/gpt2_block.py --show kernels
"""
import math

import numpy as np

import stax as torch
import stax.nn.functional as F

N_EMBD, N_HEAD, VOCAB, BLOCK = 64, 4, 257, 16


def block_loss(x, targets, p, bias):
    B, T, C = x.size()
    # ---- attention ----
    h = F.layer_norm(x, (C,), p["ln_1.weight"], p["ln_1.bias"])
    q, k, v = F.linear(h, p["attn.c_attn.weight"], p["attn.c_attn.bias"]).split(N_EMBD, dim=2)
    k = k.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
    q = q.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
    v = v.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    att = att.masked_fill(bias[:, :, :T, :T] == 0, float("-inf"))
    att = F.softmax(att, dim=-1)
    y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
    x = x + F.linear(y, p["attn.c_proj.weight"], p["attn.c_proj.bias"])
    # ---- MLP ----
    h = F.layer_norm(x, (C,), p["ln_2.weight"], p["ln_2.bias"])
    h = F.gelu(F.linear(h, p["mlp.c_fc.weight"], p["mlp.c_fc.bias"]), approximate="tanh")
    x = x + F.linear(h, p["mlp.c_proj.weight"], p["mlp.c_proj.bias"])
    # ---- LM head and loss ----
    logits = F.linear(F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"]), p["wte.weight"])
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
    return logits, loss


def init_params():
    C, std = N_EMBD, 0.02
    shapes = {"ln_1": C, "ln_2": C, "ln_f": C}
    p = {}
    for name, n in shapes.items():
        p[name + ".weight"], p[name + ".bias"] = torch.ones(n), torch.zeros(n)
    for name, (o, i) in {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (4 * C, C),
                         "mlp.c_proj": (C, 4 * C)}.items():
        p[name + ".weight"] = torch.randn(o, i) * std
        p[name + ".bias"] = torch.zeros(o)
    p["wte.weight"] = torch.randn(VOCAB, C) * std
    return p


def numpy_reference(x, targets, p):
    """The same block and loss in float64 numpy."""
    P = {k: v.numpy().astype(np.float64) for k, v in p.items()}
    x, t = x.numpy().astype(np.float64), targets.numpy()
    B, T, C = x.shape
    hd = C // N_HEAD

    def ln(h, name):
        mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
        return (h - mu) / np.sqrt(var + 1e-5) * P[name + ".weight"] + P[name + ".bias"]

    def lin(h, name, bias=True):
        return h @ P[name + ".weight"].T + (P[name + ".bias"] if bias else 0)

    q, k, v = np.split(lin(ln(x, "ln_1"), "attn.c_attn"), 3, axis=2)
    q, k, v = (a.reshape(B, T, N_HEAD, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + np.triu(np.full((T, T), -np.inf), 1)
    att = np.exp(att - att.max(-1, keepdims=True))
    y = ((att / att.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
    x = x + lin(y, "attn.c_proj")
    h = lin(ln(x, "ln_2"), "mlp.c_fc")
    h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    x = x + lin(h, "mlp.c_proj")
    logits = ln(x, "ln_f") @ P["wte.weight"].T
    z = logits.reshape(-1, VOCAB)
    m = z.max(-1, keepdims=True)
    logp = z - (np.log(np.exp(z - m).sum(-1, keepdims=True)) + m)
    keep = t.reshape(-1) != -1
    loss = -logp[np.arange(len(z)), np.where(keep, t.reshape(-1), 0)][keep].mean()
    return logits, loss


def main():
    torch.manual_seed(0)
    B, T = 4, BLOCK
    p = init_params()
    bias = torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK)
    x = torch.randn(B, T, N_EMBD)
    targets = torch.randint(0, VOCAB, (B, T))
    targets[0, :3] = -1                                  # ignored positions

    compiled = torch.compile(block_loss)
    logits, loss = compiled(x, targets, p, bias)
    ref_logits, ref_loss = numpy_reference(x, targets, p)
    np.testing.assert_allclose(logits.numpy(), ref_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=1e-5)
    print(f"logits {tuple(logits.shape)}, loss {loss.item():.4f} (log(vocab) = {math.log(VOCAB):.4f})")
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
