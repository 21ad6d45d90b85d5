"""Split backward for zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"; their
WeightGradStore): a linear layer's backward is two matmuls, the input gradient dX = dY W, which the
previous stage waits for, and the weight gradient dW = dY^T X, which nobody waits for. While a store
defers, the linear layers attached to it compute dX only and queue dW's matmul; the schedule runs the
queue later (its W action), filling the pipeline's idle time with it.

Every linear layer's product goes through here (`adapted_linear`: the model's and the tensor-parallel ones),
with the update of the low-rank adapters attached to it, if any.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import gemv
from .lazy_compiler import eager
from .lora_linear import lora_linear
from .meta_init import NoInitOnMeta


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


class Linear(NoInitOnMeta, nn.Linear):
    """nn.Linear whose weight gradient a WeightGradStore may defer (`weight_grads`, None: never), and to which
    low-rank adapters may add their update (`lora`, parallel/lora.py)."""
    weight_grads: WeightGradStore | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora = None

    def forward(self, x):
        return adapted_linear(x, self.weight, self.bias, self.weight_grads, self.lora)


def linear(x, weight, bias=None, store: WeightGradStore | None = None):
    """F.linear, with the weight's (and bias's) gradient deferred while `store` defers."""
    if type(weight).__name__ == "NF4Tensor" and torch.compiler.is_compiling():  # QLoRA's frozen base
        return F.linear(x, _dequantised(weight, x.dtype), bias)
    if not torch.is_grad_enabled():
        return gemv.linear(x, weight, bias)  # a decode step's one row by a GEMV kernel
    if store is None or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _deferrable_linear(x, weight, bias, store)


def _dequantised(weight, dtype: torch.dtype) -> torch.Tensor:
    """A 4-bit weight in `dtype`, rerun for backward. Compiled, the partitioner would keep each layer's 16-bit
    form from forward to backward (it does not rerun NF4's code lookup): a copy of the whole base, the memory
    QLoRA exists to save (13 GB for llama2-7b). Eagerly, torchao's linear keeps the 4-bit weight and
    dequantises again in backward, as this does."""
    return torch.utils.checkpoint.checkpoint(_cast, weight, dtype, use_reentrant=False)


def _cast(weight, dtype):
    return weight.to(dtype)


def adapted_linear(x, weight, bias, store: WeightGradStore | None, lora):
    """`linear` plus the update of low-rank adapters (`lora`: parallel/lora.py's LoRA, serving's per-row
    adapters, or None). Compiled, with a plain frozen weight of x's dtype (not QLoRA's 4-bit one), no
    autocast and no dropout, the two run as one operator (lora_linear.py); eagerly the adapter runs first:
    the base product's inputs are then the last tensors the layer saves, so a recomputation that only needs
    those stops before the product runs (checkpoint's early stop, model/recompute.py), where under compile the
    partitioner decides what is rerun."""
    if lora is None:
        return linear(x, weight, bias, store)
    if (hasattr(lora, "factors") and torch.compiler.is_compiling() and not weight.requires_grad
            and type(weight) in (torch.Tensor, nn.Parameter) and not lora.drops()
            and weight.dtype == x.dtype == lora.A[lora.spans[0][0]].dtype
            and not torch.is_autocast_enabled(x.device.type)):
        out = lora_linear(x, weight, *lora.factors())
        return out if bias is None else out + bias
    update = lora(x)
    return linear(x, weight, bias, store) + update


# Outside any compiled graph: torch.compile traces a Function's backward when it compiles the forward, with
# the store's `deferring` read then (False) as a constant, so a compiled block would compute every dW at once
# and leave its W actions nothing to do. The graph breaks here keep the matmul eager and fuse the rest.
@eager
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
