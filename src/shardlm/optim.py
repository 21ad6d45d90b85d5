"""The optimizer step with fp32 master weights, global-norm clipping and the learning-rate schedule.

`MasterWeightOptimizer` keeps an fp32 copy of every 16-bit parameter and runs AdamW (Loshchilov &
Hutter 2019; fused on GPU) or SGD with momentum on the copies, as mixed-precision training prescribes;
in fp32 the parameters are their own masters. Gradients are unscaled into the masters, clipped by the
global L2 norm (Pascanu et al. 2013), and a step whose norm is not finite is skipped. Its state is
saved by parameter name, so a checkpoint does not depend on how parameters are laid out or sharded.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine, linear or constant decay to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    low = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - low) * progress
    return low + (cfg.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradients, in fp32, as one tensor (no host sync)."""
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0)


class MasterWeightOptimizer:
    def __init__(self, model: nn.Module, cfg: TrainConfig, loss_scaler):
        self.cfg, self.scaler = cfg, loss_scaler
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.masters = [p.detach().float().clone() if self.mixed else p for p in self.params]
        decay = [m for m, p in zip(self.masters, self.params) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params) if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # The optimizer's parameter order (decay group first) differs from the model's; keep the map.
        order = {id(m): i for i, m in enumerate(self.masters)}
        self.opt_order = [order[id(m)] for g in groups for m in g["params"]]
        on_gpu = self.masters[0].is_cuda
        if cfg.optimizer == "adamw":
            self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                         fused=on_gpu or None, foreach=None if on_gpu else True)
        else:
            self.opt = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, foreach=True)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, lr: float, step: int) -> tuple[float, bool]:
        """Unscale, clip and apply; returns (grad norm before clipping, whether the step was applied)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
        grads = []
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if self.mixed:
                m.grad = p.grad.float()
            grads.append(m.grad)
        if self.scaler.scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        norm = global_grad_norm(grads).item()
        finite = math.isfinite(norm)
        self.scaler.update(not finite, step)
        if finite:
            if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
                torch._foreach_mul_(grads, self.cfg.grad_clip / (norm + 1e-6))
            self.opt.step()
            if self.mixed:
                torch._foreach_copy_(list(self.params), self.masters)
        if self.mixed:
            for m in self.masters:
                m.grad = None
        self.zero_grad()
        return norm, finite

    # ---- layout-free state: tensors keyed by parameter name --------------------------------------
    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: m.detach() for n, m in zip(self.names, self.masters)}

    def state_by_name(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, m in zip(self.names, self.masters):
            for k, v in self.opt.state.get(m, {}).items():
                out[f"{name}::{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        return out

    def load(self, masters: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in masters]
        if missing:
            raise KeyError(f"checkpoint lacks parameters {missing[:4]}")
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters):
                m.copy_(masters[name])
                if self.mixed:
                    p.copy_(m)
        sd = self.opt.state_dict()
        index = {n: i for i, n in enumerate(self.names)}
        per_param: dict[int, dict] = {}
        for key, v in state.items():
            name, k = key.split("::")
            if name not in index:
                raise KeyError(f"checkpoint optimizer state names unknown parameter {name!r}")
            per_param.setdefault(index[name], {})[k] = v
        sd["state"] = {pos: per_param[i] for pos, i in enumerate(self.opt_order) if i in per_param}
        self.opt.load_state_dict(sd)
