"""The optimizer step with fp32 master weights, global-norm clipping and the learning-rate schedule.

`MasterWeightOptimizer` keeps an fp32 copy of the 16-bit parameters (one flat buffer, see flat.py) and
runs AdamW (Loshchilov & Hutter 2019) or SGD with momentum on it in one fused pass (kernels.py), as
mixed-precision training prescribes; in fp32 the parameters are their own masters. Gradients are
unscaled, clipped by the global L2 norm (Pascanu et al. 2013), and a step whose norm is not finite is
skipped. Its state is saved by parameter name, so a checkpoint does not depend on how parameters are
laid out or sharded.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import TrainConfig
from .flat import FlatParams
from .kernels import adamw_master_step, sgd_master_step, sum_of_squares
from .precision import DynamicLossScaler


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


class MasterWeightOptimizer:
    """AdamW or SGD over the model's flat buffers, with fp32 masters when the parameters are 16-bit.

    `step` never waits for the host: the global norm, the clip/unscale factor and the skip flag stay on
    the device, and the kernels read them there. The loss scaler, which must decide on the host, is
    updated here only in fp16; elsewhere a non-finite norm skips the step on the device and is reported
    by `check_finite` when the trainer next logs.
    """

    def __init__(self, model: nn.Module, cfg: TrainConfig, loss_scaler, pad_multiple: int = 1):
        self.cfg, self.scaler = cfg, loss_scaler
        self.flat = FlatParams(model, cfg.weight_decay, pad_multiple)
        self.names, self.params = self.flat.names, self.flat.params
        self.mixed = self.flat.data.dtype != torch.float32
        self.master = self.flat.data.float() if self.mixed else self.flat.data
        zeros = lambda: torch.zeros_like(self.master)  # noqa: E731
        self.state = {"exp_avg": zeros(), "exp_avg_sq": zeros()} if cfg.optimizer == "adamw" else {"momentum_buffer": zeros()}
        self.steps_taken = 0
        dev = self.master.device
        self._skip = torch.zeros((), dtype=torch.int32, device=dev)
        self._nonfinite = torch.zeros((), dtype=torch.int32, device=dev)
        self.last_norm = torch.zeros((), device=dev)

    @property
    def masters(self) -> list[torch.Tensor]:
        return [self.flat.view(self.master, i) for i in range(len(self.params))]

    def zero_grad(self) -> None:
        self.flat.zero_grad()

    @torch.no_grad()
    def step(self, lr: float, step: int) -> None:
        """Unscale, clip by the global norm and apply; a step with a non-finite norm changes nothing."""
        cfg = self.cfg
        loss_scale = self.scaler.scale
        norm = sum_of_squares(self.flat.grad).sqrt() / loss_scale
        finite = torch.isfinite(norm)
        self._skip.copy_(~finite)
        if isinstance(self.scaler, DynamicLossScaler):  # fp16: the scale schedule is decided on the host
            applied = bool(finite)
            self.scaler.update(not applied, step)
            if not applied:
                self.last_norm = norm
                self.zero_grad()
                return
        else:
            self._nonfinite += self._skip  # reported (and fatal) at the next sync
        scale = torch.full((), 1.0 / loss_scale, device=norm.device)
        if cfg.grad_clip > 0:
            scale = scale * torch.clamp(cfg.grad_clip / (norm + 1e-6), max=1.0)
        self.last_norm = norm
        self.steps_taken += 1
        param = self.flat.data if self.mixed else None
        for seg in self.flat.segments:
            sl = slice(seg.start, seg.end)
            args = (self.master[sl], None if param is None else param[sl], self.flat.grad[sl])
            if cfg.optimizer == "adamw":
                adamw_master_step(*args, self.state["exp_avg"][sl], self.state["exp_avg_sq"][sl], scale, self._skip,
                                  step=self.steps_taken, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                                  weight_decay=seg.weight_decay)
            else:
                sgd_master_step(*args, self.state["momentum_buffer"][sl], scale, self._skip, step=self.steps_taken,
                                lr=lr, momentum=cfg.momentum, weight_decay=seg.weight_decay)
        self.zero_grad()

    def sync(self, step: int) -> tuple[float, int]:
        """Host view of the last step: (its grad norm, steps skipped so far); bf16/fp32 divergence raises."""
        if int(self._nonfinite):
            self.scaler.update(True, step)  # raises: a non-finite norm in bf16/fp32 is divergence
        return float(self.last_norm), self.scaler.skipped_steps

    # ---- layout-free state: tensors keyed by parameter name --------------------------------------
    def master_state(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.masters))

    def state_by_name(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, name in enumerate(self.names):
            for k, buf in self.state.items():
                out[f"{name}::{k}"] = self.flat.view(buf, i)
            out[f"{name}::step"] = torch.tensor(float(self.steps_taken))
        return out

    @torch.no_grad()
    def load(self, masters: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.names if n not in masters]
        if missing:
            raise KeyError(f"checkpoint lacks parameters {missing[:4]}")
        unknown = {k.split("::")[0] for k in state} - set(self.names)
        if unknown:
            raise KeyError(f"checkpoint optimizer state names unknown parameters {sorted(unknown)[:4]}")
        for i, name in enumerate(self.names):
            self.flat.view(self.master, i).copy_(masters[name])
            for k, buf in self.state.items():
                if f"{name}::{k}" not in state:
                    raise KeyError(f"checkpoint lacks optimizer state {name}::{k} (saved with another optimizer?)")
                self.flat.view(buf, i).copy_(state[f"{name}::{k}"])
        if self.mixed:
            self.flat.data.copy_(self.master)
        self.steps_taken = int(state[f"{self.names[0]}::step"]) if self.names else 0
