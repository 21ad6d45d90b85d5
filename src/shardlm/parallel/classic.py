"""Classic data parallelism, the baseline the others are measured against: every rank computes gradients on
its slice of the batch; the gradients are summed onto rank 0 (`reduce`), rank 0 alone runs the
optimizer, and the weights are `broadcast` back. Per step it moves the gradients into one rank and the
weights out of it, so rank 0's links carry 2 x (N - 1) x the model's bytes while every other rank waits
idle through the optimizer step; rank 0 also holds the only optimizer state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..flat import FlatParams
from ..optim import MasterWeightOptimizer, NonFiniteGradient
from ..precision import DynamicLossScaler
from .engine import LocalEngine


class ClassicEngine(LocalEngine):
    def __init__(self, model: nn.Module, cfg, scaler, group, fill=None, names=None, divisor: int | None = None):
        self.cfg, self.group = cfg, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.divisor = divisor or self.world  # the root holds the sum over ranks
        self.root = dist.get_global_rank(group, 0)
        self.flat = FlatParams(model, fill=fill, names=names)
        self.scaler = scaler
        # Only the root holds optimizer state; the others only compute gradients.
        self.opt = MasterWeightOptimizer(self.flat, cfg.train, scaler) if self.rank == 0 else None
        # norm, loss scale, skipped steps, and the first step whose gradient was not finite (0: none) and its norm
        self.stats = torch.zeros(5, dtype=torch.float64, device=self.flat.device)

    def finish_backward(self, last: bool) -> None:
        if last:
            for b in self.flat.buckets:
                dist.reduce(b.grad, dst=self.root, group=self.group)

    @torch.no_grad()
    def optimizer_step(self, lr: float, step: int) -> None:
        if self.opt is not None:
            self.opt.step(lr, step, self.grad_shard, lambda b: self.flat.buckets[b].data, self.grad_factor())
            self.stats.copy_(torch.cat([torch.stack([self.opt.last_norm.to(self.stats),
                                                     torch.tensor(float(self.scaler.scale)).to(self.stats),
                                                     torch.tensor(float(self.scaler.skipped_steps)).to(self.stats)]),
                                        self.opt.first_nonfinite().to(self.stats)]))
        for b in self.flat.buckets:
            dist.broadcast(b.data, src=self.root, group=self.group)
        dist.broadcast(self.stats, src=self.root, group=self.group)
        if self.opt is None:  # the loss scale (fp16) must match on every rank
            self.scaler.scale = float(self.stats[1])
            self.scaler.skipped_steps = int(self.stats[2])
        self.flat.zero_grad()

    def step_stats(self, step: int) -> tuple[float, int]:
        if self.opt is not None:
            return self.opt.sync(step)
        norm, _, skipped, first, first_norm = self.stats.tolist()
        if first and not isinstance(self.scaler, DynamicLossScaler):
            raise NonFiniteGradient(int(first), first_norm)  # as the root raises: every rank stops alike
        return norm, int(skipped)

    def gather_full_state(self):
        return (None, None) if self.opt is None else super().gather_full_state()

    @torch.no_grad()
    def load_full_state(self, masters: dict, state: dict) -> None:
        if self.opt is not None:
            self.opt.load(masters, state)
        for i, name in enumerate(self.flat.names):
            self.flat.view(self.flat.bucket_of(i).data, i).copy_(masters[name])
