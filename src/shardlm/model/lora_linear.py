"""A frozen linear layer and its low-rank update (LoRA, Hu et al. 2021) as one operator for compiled blocks:
y = x W^T + (x A^T) B^T, with B's scale already folded in (parallel/lora.py).

Written as two custom operators (torch.library) so that inductor takes each as a whole: inside, the update
is computed first and the base product accumulates onto it in place (cuBLAS's C = x W^T + C), and backward's
input gradient likewise takes the adapter's share as the base product's accumulator. Left to inductor, the
same ops cost a pass over the output each way: it adds the update after the base product forward (for the
gate/up layer of llama2-7b, 0.36 GB read twice and written a micro-batch of 4 x 2048 tokens), and an
in-place accumulation, functionalised, becomes a copy. Backward recomputes x A^T (a product of rank
columns) rather than saving it: it is then an input of the operator alone, and a recomputing partitioner
never reruns the base product to get it.
"""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("shardlm::lora_linear", mutates_args=())
def lora_linear(x: Tensor, weight: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """x [..., in] W [out, in] A [r, in] B [out, r] -> x W^T + x A^T B^T [..., out]; W is not trained."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(torch.mm(x2, a.t()), b.t())
    y.addmm_(x2, weight.t())
    return y.view(*x.shape[:-1], weight.shape[0])


@lora_linear.register_fake
def _(x, weight, a, b):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("shardlm::lora_linear_backward", mutates_args=())
def lora_linear_backward(grad: Tensor, x: Tensor, weight: Tensor, a: Tensor, b: Tensor
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of x, A and B."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    grad_xa = torch.mm(g2, b)
    grad_b = torch.mm(g2.t(), torch.mm(x2, a.t()))
    grad_a = torch.mm(grad_xa.t(), x2)
    grad_x = torch.mm(grad_xa, a)
    grad_x.addmm_(g2, weight)
    return grad_x.view(x.shape), grad_a, grad_b


@lora_linear_backward.register_fake
def _(grad, x, weight, a, b):
    return x.new_empty(x.shape), a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, weight, a, b = ctx.saved_tensors
    grad_x, grad_a, grad_b = lora_linear_backward(grad, x, weight, a, b)
    return grad_x, None, grad_a, grad_b


lora_linear.register_autograd(_backward, setup_context=_setup_context)
