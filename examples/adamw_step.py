"""One AdamW step over a list of parameters, written as PyTorch code (torch.optim's single-tensor
AdamW, in its "capturable" form: the step count is a tensor, so one compile serves every step).

Only the import differs from the PyTorch program (`import stax as torch`). Every in-place update
(`mul_`, `lerp_`, `addcmul_`, `addcdiv_`) is captured functionally and written back into the
parameter and state tensors; each parameter's whole update is one fused kernel.

    python -m stax run examples/adamw_step.py --show kernels,wrapper
"""
import numpy as np

import stax as torch


@torch.compile
def adamw_step(params, grads, exp_avgs, exp_avg_sqs, step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
               weight_decay=1e-2):
    step.add_(1)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2.sqrt()
    for param, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs):
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)


def reference(ps, gs, ms, vs, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=1e-2):
    """The same update in float64 numpy."""
    for p, g, m, v in zip(ps, gs, ms, vs):
        p *= 1 - lr * wd
        m += (g - m) * (1 - b1)
        v[...] = v * b2 + g * g * (1 - b2)
        p -= lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)


def main():
    torch.manual_seed(0)
    shapes = [(256, 64), (64,), (7, 3, 5), (1000,)]
    params = [torch.randn(*s) for s in shapes]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    step = torch.tensor(0.0)
    ref = [p.numpy().astype(np.float64) for p in params]
    ref_m = [np.zeros_like(r) for r in ref]
    ref_v = [np.zeros_like(r) for r in ref]
    for t in range(1, 4):
        grads = [torch.randn(*s) for s in shapes]
        adamw_step(params, grads, exp_avgs, exp_avg_sqs, step)
        reference(ref, [g.numpy().astype(np.float64) for g in grads], ref_m, ref_v, t)
    for p, r in zip(params, ref):
        np.testing.assert_allclose(p.numpy(), r, rtol=1e-5, atol=1e-6)
    print(f"3 AdamW steps over {len(params)} parameters; compiles: {adamw_step.stats['compiles']}")
    print("matches numpy: OK")


if __name__ == "__main__":
    main()
