"""The per-step seam: forward and backward over one step's micro-batches, with the engine's gradient
synchronisation around each backward. A model that is whole on every rank of its data-parallel group
(one process, data and tensor parallelism) runs `ForwardBackward`; a pipeline runs a schedule's action
table in its place, behind the same call."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..model.moe import aux_loss, moe_layers
from .engine import Engine


class ForwardBackward:
    """Gradient accumulation (Megatron-LM's forward_backward_no_pipelining): each micro-batch's mean loss is
    divided by the number of micro-batches, so the summed gradient is the gradient of the mean loss over
    the step's batch (every sample has the same number of tokens); the engine reduces gradients over the
    data-parallel ranks on the last micro-batch, or on each for ZeRO-2/3."""

    def __init__(self, model: nn.Module, engine: Engine, scaler, aux_coefs: tuple[float, float] = (0.0, 0.0)):
        self.forward, self.engine, self.scaler = model, engine, scaler
        # Mixture-of-experts layers' load-balancing and z-losses (model/moe.py), times these coefficients: each
        # micro-batch's scaled as its loss is, so accumulation gives the step's exact gradient.
        self.moe_layers, self.aux_coefs = moe_layers(model), aux_coefs

    def __call__(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], count: int,
                 device: torch.device, weights: list[float] | None = None,
                 aux_weights: list[float] | None = None) -> torch.Tensor:
        """Run the step's `count` micro-batches; returns the mean loss as a device tensor (no host sync).
        `weights`: each micro-batch's mean loss times its weight instead of divided by `count`, where they
        hold unequal numbers of trained targets (instruction data). `aux_weights`: its MoE auxiliary losses'
        where they differ (context parallelism: a loss over the whole sequences weighs by their targets, the
        mean of the slices' weights, not by this slice's); `weights` if None."""
        aux_weights = weights if aux_weights is None else aux_weights
        total = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro_batches):
            last = i == count - 1
            loss = self.forward(x, y) / count if weights is None else self.forward(x, y) * weights[i]
            total += loss.detach()
            aux = aux_loss(self.moe_layers, *self.aux_coefs) if self.moe_layers else None
            if aux is not None:  # trained on, not reported as the loss
                loss = loss + (aux / count if aux_weights is None else aux * aux_weights[i])
            self.engine.prepare_backward(last)
            factor = self.scaler.scale * self.engine.loss_factor()
            (loss * factor if factor != 1.0 else loss).backward()
            self.engine.finish_backward(last)
        return total
