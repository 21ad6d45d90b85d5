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

import functools

import torch
import torch.nn.functional as F

from ..config import IGNORE

CHUNK_TOKENS = 2048


def ce_and_grad(logits: torch.Tensor, targets: torch.Tensor, n) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy (fp32) of a chunk and d(mean loss over n)/d(logits) in the logits' dtype; targets
    IGNORE count for nothing."""
    x = logits.float()
    trained = targets != IGNORE
    targets = targets.clamp(min=0)
    lse = torch.logsumexp(x, dim=-1)
    loss = ((lse - x.gather(1, targets[:, None]).squeeze(1)) * trained).sum()
    grad = (x - lse[:, None]).exp()
    grad = grad.scatter_add(1, targets[:, None], torch.full_like(grad[:, :1], -1.0)) * trained[:, None]
    return loss, (grad / n).to(logits.dtype)


_compiled_ce_and_grad = None


def _fused_ce_and_grad():
    """ce_and_grad compiled into one or two kernels (one read of the logits, one write of the gradient)."""
    global _compiled_ce_and_grad
    if _compiled_ce_and_grad is None:
        _compiled_ce_and_grad = torch.compile(ce_and_grad, dynamic=False)
    return _compiled_ce_and_grad


class LinearCrossEntropy(torch.autograd.Function):
    """mean_i CE over chunks of tokens whose gradients are formed in forward. `chunk_loss(hc, weight, tc, n,
    want_grad)` gives one chunk's summed fp32 loss and d(mean loss over n)/d(its logits) (the single-device
    one below; the vocab-parallel one in parallel/cross_entropy.py)."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int, chunk_loss):
        h2 = h.reshape(-1, h.shape[-1])
        t = targets.reshape(-1)
        n = trained_count(t)
        grad_h = torch.empty_like(h2)
        # Summed over chunks in the weight's dtype, as autograd would; none for a frozen head (LoRA).
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, t.numel(), chunk):
            hc = h2[s:s + chunk]
            loss, grad = chunk_loss(hc, weight, t[s:s + chunk], n, True)
            total += loss
            torch.mm(grad, weight, out=grad_h[s:s + chunk])
            if grad_w is not None:
                grad_w.addmm_(grad.t(), hc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.h_shape = h.shape
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return ((grad_h * grad_out.to(grad_h.dtype)).view(ctx.h_shape),
                None if grad_w is None else grad_w * grad_out.to(grad_w.dtype), None, None, None)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                          chunk_loss) -> torch.Tensor:
    """The mean loss through `chunk_loss` (see LinearCrossEntropy), chunk by chunk: with gradients formed in
    forward where autograd needs them, and the same chunks without them in evaluation."""
    if not (torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)):
        h2, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        return sum(chunk_loss(h2[s:s + chunk], weight, t[s:s + chunk], 1, False)[0]
                   for s in range(0, t.numel(), chunk)) / trained_count(t)
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        # Under autocast (fp32 weights, 16-bit compute) cast once here; the casts' backward returns the
        # gradients in the parameters' dtype, and the Function runs in one dtype throughout.
        dtype = torch.get_autocast_dtype(dev)
        with torch.autocast(dev, enabled=False):
            return LinearCrossEntropy.apply(h.to(dtype), weight.to(dtype), targets, chunk, chunk_loss)
    return LinearCrossEntropy.apply(h, weight, targets, chunk, chunk_loss)


def trained_count(targets: torch.Tensor) -> torch.Tensor:
    """The targets trained on (at least 1: a batch of prompts alone has loss 0, not 0 / 0), on the device."""
    return (targets != IGNORE).sum().clamp(min=1)


def _local_chunk_loss(compiled: bool, hc, weight, tc, n, want_grad: bool):
    logits = hc @ weight.t()
    if not want_grad:
        return F.cross_entropy(logits.float(), tc, reduction="sum", ignore_index=IGNORE), None
    return (_fused_ce_and_grad() if compiled else ce_and_grad)(logits, tc, n)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int = CHUNK_TOKENS, compiled: bool = False) -> torch.Tensor:
    """mean_i CE(h_i W^T, t_i) in fp32, equal to F.cross_entropy(F.linear(h, W).float(), t)."""
    return chunked_cross_entropy(h, weight, targets, chunk, functools.partial(_local_chunk_loss, compiled))
