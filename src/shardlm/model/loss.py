"""Output head and cross-entropy fused and chunked over tokens, so the [tokens, vocab] logits of the
whole batch never exist at once (the idea of Liger-Kernel's fused linear cross-entropy and of
Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models").

Cross-entropy is the last op of the graph, so its gradients can be computed in the forward pass: for
each chunk of tokens, the logits are formed, reduced to the loss in fp32, turned into d(loss)/d(logits)
= (softmax - onehot) / N, and immediately multiplied back into the gradients of the hidden states and
of the head's weight. Backward then only scales the saved gradients by the incoming gradient (the
1/accumulation and loss-scale factors). Peak memory for the head drops from several copies of the full
logits (bf16 logits, their fp32 upcast, softmax, gradient) to one chunk's worth.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_TOKENS = 4096


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int):
        h2 = h.reshape(-1, h.shape[-1])
        t = targets.reshape(-1)
        n = t.numel()
        grad_h = torch.empty_like(h2)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk):
            hc, tc = h2[s:s + chunk], t[s:s + chunk]
            logits = (hc @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            # d(mean loss)/d(logits), written over the logits buffer to keep one chunk alive
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, tc[:, None], torch.full_like(grad[:, :1], -1.0))
            grad = grad.div_(n).to(h.dtype)
            grad_h[s:s + chunk] = grad @ weight
            grad_w += grad.t() @ hc  # each chunk's product in the compute dtype, summed in fp32
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        ctx.h_shape = h.shape
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h * grad_out.to(grad_h.dtype)).view(ctx.h_shape), grad_w * grad_out.to(grad_w.dtype), None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """mean_i CE(h_i W^T, t_i) in fp32, equal to F.cross_entropy(F.linear(h, W).float(), t)."""
    if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        total = sum(F.cross_entropy((h2[s:s + chunk] @ weight.t()).float(), t[s:s + chunk], reduction="sum")
                    for s in range(0, t.numel(), chunk))
        return total / t.numel()
    return LinearCrossEntropy.apply(h, weight, targets, chunk)
