"""Split backward for zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; their
WeightGradStore): a linear layer's backward is two matmuls, the input gradient dX = dY W, which the
previous stage waits for, and the weight gradient dW = dY^T X, which nobody waits for. While a store
defers, the linear layers attached to it compute dX only and queue dW's matmul; the schedule runs the
queue later (its W action), filling the pipeline's idle time with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lora_linear import lora_linear


class WeightGradStore:
    def __init__(self):
        self.deferring = False
        self.queue: list = []

    def take(self) -> list:
        """The weight-gradient matmuls queued since the last take, to run later with `run`."""
        queue, self.queue = self.queue, []
        return queue

    @staticmethod
    @torch.no_grad()
    def run(queue: list) -> None:
        for compute in queue:
            compute()


class Linear(nn.Linear):
    """nn.Linear whose weight gradient a WeightGradStore may defer (`weight_grads`, None: never), and to which
    low-rank adapters may add their update (`lora`, parallel/lora.py)."""
    weight_grads: WeightGradStore | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora = None

    def forward(self, x):
        if self.lora is None:
            return linear(x, self.weight, self.bias, self.weight_grads)
        if self._one_operator(x):
            out = lora_linear(x, self.weight, *self.lora.factors())
            return out if self.bias is None else out + self.bias
        # The adapter first: the base product's inputs are then the last tensors the layer saves, so a
        # recomputation that only needs those stops before the product runs (model/recompute.py).
        update = self.lora(x)
        return linear(x, self.weight, self.bias, self.weight_grads) + update

    def _one_operator(self, x) -> bool:
        """Whether the base product and the adapters' update run as one operator (lora_linear.py): in compiled
        graphs only, where the partitioner, not checkpoint's early stop, decides what a recomputation reruns;
        with a plain frozen weight of x's dtype (not QLoRA's 4-bit one), no autocast and no dropout."""
        w = self.weight
        if not hasattr(self.lora, "factors"):  # serving's per-row adapters (inference/adapters.py)
            return False
        return (torch.compiler.is_compiling() and not w.requires_grad and type(w) in (torch.Tensor, nn.Parameter)
                and w.dtype == x.dtype == self.lora.A[self.lora.spans[0][0]].dtype
                and not torch.is_autocast_enabled(x.device.type) and not self.lora.drops())


def linear(x, weight, bias=None, store: WeightGradStore | None = None):
    """F.linear, with the weight's (and bias's) gradient deferred while `store` defers."""
    if store is None or not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _deferrable_linear(x, weight, bias, store)


# Outside any compiled graph: torch.compile traces a Function's backward when it compiles the forward, with
# the store's `deferring` read then (False) as a constant, so a compiled block would compute every dW at once
# and leave its W actions nothing to do. The graph breaks here keep the matmul eager and fuse the rest.
@torch.compiler.disable
def _deferrable_linear(x, weight, bias, store):
    return _DeferrableLinear.apply(x, weight, bias, store)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    # Into the existing .grad, as autograd does: data-parallel engines keep it as a view of their buckets.
    # No hook runs, as autograd's accumulation would run them: a parameter whose gradient a hook changes
    # (tensor parallelism's partial sums) is never deferred (parallel/pipeline.py).
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # The parameters themselves (leaves: no reference cycle), for the deferred accumulation.
        ctx.params, ctx.store = (weight, bias), store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight_param, bias = ctx.params
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad @ weight if need_x else None
        if not ctx.store.deferring:
            grad2 = grad.reshape(-1, grad.shape[-1])
            return (grad_x, grad2.t() @ x.reshape(-1, x.shape[-1]) if need_w else None,
                    grad2.sum(0) if need_b else None, None)

        def weight_grad():
            # x itself, not a view, is what the closure keeps: its life is the micro-batch's until W.
            grad2 = grad.reshape(-1, grad.shape[-1])
            if need_w:
                _accumulate(weight_param, grad2.t() @ x.reshape(-1, x.shape[-1]))
            if need_b:
                _accumulate(bias, grad2.sum(0))
        ctx.store.queue.append(weight_grad)
        return grad_x, None, None, None
