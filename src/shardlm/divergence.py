"""Divergence: a run whose numbers stop being finite is stopped with a TrainingError that says where and
why. Before any update the weights are the initialisation's, so a first step that is not finite blames the
data, model.init_std or a damaged train.init_from, not the learning rate; after updates the run diverged.
In fp16 a nan loss is told apart from a loss-scale overflow (which only skips a step), and no checkpoint is
written of weights that are not finite or beyond fp16's range: the last good one is kept, and named.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from . import compat
from .checkpoint import complete_checkpoints
from .config import Config, RunError
from .optim import NonFiniteGradient
from .precision import LossScaleError


class TrainingError(RunError):
    """The run cannot go on (its numbers stopped being finite); the message says where and why."""


def refuse_nan_loss(loss: torch.Tensor, step: int, fresh: bool, cfg: Config) -> None:
    """fp16: a loss-scale overflow gives inf gradients and a skipped step; a nan loss (forward) is not one,
    and skipping it would skip every step from here on. fp16 waits for the host each step anyway. `step`
    counts the steps done before this one; `fresh`: no update has changed the weights yet (the run resumed no
    checkpoint, and every step so far was skipped), so the learning rate cannot be to blame."""
    nan = torch.isnan(loss).to(torch.float32)
    if dist.is_initialized():
        dist.all_reduce(nan, op=dist.ReduceOp.MAX)  # every rank stops alike
    if nan.item():
        if fresh and (bad := compat.non_finite_init(cfg)):
            raise TrainingError(f"step {step + 1}: the loss is nan: {bad}")
        if fresh:  # a model trained in bf16 often holds activations past fp16's range; or an init_std far too large
            init_from = cfg.train.init_from
            start = ("train.init_from's weights" if init_from
                     else f"model.init_std = {cfg.model.init_std:g}'s initialisation")
            raise TrainingError(f"step {step + 1}: the loss is nan in fp16 before any update, so the learning rate is "
                                f"not to blame: the forward overflowed fp16 (largest value 65504) with {start}: use "
                                "train.precision bf16" + ("" if init_from else " or a smaller model.init_std"))
        raise TrainingError(f"step {step + 1}: the loss is nan in fp16, which is no loss-scale overflow: "
                            "the run diverged (lower train.lr, or train.precision bf16)")


def diagnose(e: NonFiniteGradient, cfg: Config, fresh: bool, out: Path | None) -> TrainingError:
    """Where the gradient stopped being finite says why: before any update the weights are the
    initialisation's, so the data or model.init_std are to blame, not the learning rate."""
    if e.step <= 1 and fresh and (bad := compat.non_finite_init(cfg)):
        return TrainingError(f"{e}: {bad}")
    if e.step <= 1 and fresh:
        why = ("at step 1, before any update: the data or the model's initialisation (model.init_std), "
               "not the learning rate")
    else:
        why = (f"after {e.step - 1} updates the run diverged (lower train.lr = {cfg.train.lr:g} or raise "
               f"train.warmup_steps = {cfg.train.warmup_steps})")
    return TrainingError(f"{e}: {why}; the step was skipped, the weights are finite ({last_checkpoint(out)})")


def step_numbers(engine, step: int, cfg: Config, fresh: bool, out: Path | None) -> tuple[float, int]:
    """The last step's (gradient norm, skipped steps), read from the device; a bf16/fp32 gradient that stopped
    being finite since they were last read raises its TrainingError. A save reads them first: bf16/fp32 report
    a divergence only when they are read (train.log_every), and a save between reads kept the diverged run's
    weights under a later step and, past train.keep_checkpoints, deleted the last checkpoint before it."""
    try:
        return engine.step_stats(step)
    except NonFiniteGradient as e:
        raise diagnose(e, cfg, fresh, out) from None


@contextmanager
def numerical_failures(total: torch.Tensor, step: int, fresh: bool, cfg: Config, out: Path | None):
    """Around a step's update: fp16's nan loss refused before it (refuse_nan_loss; `fresh`: no update yet), and
    a loss scale backed off to its minimum named with the checkpoint that a resume in bf16 starts from."""
    if cfg.train.precision == "fp16":
        refuse_nan_loss(total, step, fresh, cfg)
    try:
        yield
    except LossScaleError as e:
        raise TrainingError(f"{e} ({last_checkpoint(out)})") from None


def last_checkpoint(out: Path | None) -> str:
    found = complete_checkpoints(out) if out is not None else []
    return f"the last checkpoint is {found[-1]}" if found else "no checkpoint was saved"


def refuse_unusable_weights(masters: dict, precision: str, step: int, out: Path | None) -> None:
    """No checkpoint holds weights that are not finite, or in fp16 beyond its range (the 16-bit copy
    would be inf): the run stops instead, its last good checkpoint kept."""
    limit = torch.finfo(torch.float16).max if precision == "fp16" else math.inf
    bad = next((name for name, w in masters.items()
                if not bool(torch.isfinite(w).all()) or (limit < math.inf and bool(w.abs().gt(limit).any()))), None)
    if bad is not None:
        raise TrainingError(f"step {step}: the weights of {bad} are not finite"
                            + (" in fp16" if limit != math.inf else "") + f"; not saved ({last_checkpoint(out)}): "
                            "the run diverged (lower train.lr)")
