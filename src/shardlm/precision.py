"""Mixed precision (Micikevicius et al. 2018): 16-bit parameters, activations and gradients for forward and
backward, fp32 master weights and optimizer states, and for fp16 a dynamic loss scale.

The loss scaler follows Megatron-LM's DynamicGradScaler: start at 2^16; an overflowing step is skipped
and counted, and after `hysteresis` overflows the scale halves; after `growth_interval` clean steps in a
row it doubles and the hysteresis budget is restored. An overflow at the minimum scale cannot be
backed off any further and stops the run with an error instead of training on garbage.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import RunError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaleError(RunError):
    """fp16 gradients overflow even at the minimum loss scale."""


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    growth_tracker: int = 0
    hysteresis_left: int = 2
    skipped_steps: int = 0

    def update(self, found_inf: bool, step: int = -1) -> None:
        if found_inf:
            self.skipped_steps += 1
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                if self.scale <= self.min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale} (step {step}); "
                        "the run cannot continue in fp16: lower train.lr or use train.precision bf16")
                self.scale = max(self.scale / 2, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_left = self.hysteresis
                self.scale *= 2

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        for k, v in d.items():
            setattr(self, k, v)


class NoLossScaler:
    """bf16 and fp32 need no scaling; a non-finite gradient there is divergence, not overflow."""
    scale = 1.0
    skipped_steps = 0

    def update(self, found_inf: bool, step: int = -1) -> None:
        if found_inf:
            raise FloatingPointError(f"non-finite gradient norm at step {step}: the run diverged "
                                     "(lower train.lr or raise train.warmup_steps)")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, d: dict) -> None:
        pass


def make_loss_scaler(precision: str):
    return DynamicLossScaler() if precision == "fp16" else NoLossScaler()
