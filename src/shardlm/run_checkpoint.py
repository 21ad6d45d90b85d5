"""A run's checkpoint, saved by every rank: sharded (each rank writes the state it owns, in parallel, and the
main rank commits the manifest and state.json once all are written: parallel/sharded_state.py), or
gathered onto the main rank as full tensors (`train.checkpoint_format = "full"`, and ZeRO-Offload's delayed
update, whose second copy of the weights the pieces do not describe). Either way the checkpoint is atomic:
a crash before the commit leaves only a temporary directory, and every earlier checkpoint as it was.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from .checkpoint import (CKPT_DIR, MANIFEST, CheckpointError, begin_checkpoint, commit_checkpoint, failed_save,
                         save_checkpoint, write_tensors)
from .config import RunError
from .divergence import TrainingError, refuse_unusable_weights
from .parallel.sharded_state import write_shards


def save_run(parallel, cfg, out: Path, step: int, state: dict, tokenizer, any_rank) -> Path | None:
    """Save step `step` (`state`: state.json's contents, the main rank's counts); `any_rank(failed)`: whether
    any rank failed, so that all stop together. The checkpoint's path on the main rank."""
    if cfg.train.checkpoint_format == "full" or cfg.parallel.delayed_update:
        return _save_gathered(parallel, cfg, out, step, state, tokenizer, any_rank)
    return _save_sharded(parallel, cfg, out, step, state, tokenizer, any_rank)


def _save_gathered(parallel, cfg, out, step, state, tokenizer, any_rank) -> Path | None:
    masters, optim = parallel.gather_full_state()  # a collective when the state is sharded
    path, error = None, None
    if parallel.mesh.is_main:
        try:
            refuse_unusable_weights(masters, cfg.train.precision, step, out)
            path = save_checkpoint(out, step, masters, optim, state, tokenizer, keep=cfg.train.keep_checkpoints)
        except RunError as e:
            error = e
    # The others wait here while the main rank writes (NCCL's timeout, twice parallel.timeout_s, bounds
    # it), and stop with it if it could not save.
    if any_rank(error is not None):
        raise error or TrainingError(f"rank 0 could not save step {step} (its message says why)")
    return path


def _save_sharded(parallel, cfg, out, step, state, tokenizer, any_rank) -> Path | None:
    mesh, engine = parallel.mesh, parallel.engine
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if mesh.is_main:
        try:
            begin_checkpoint(out, step)
        except CheckpointError as e:
            error = e
    if any_rank(error is not None):
        raise error or TrainingError(f"rank 0 could not begin saving step {step} (its message says why)")
    tmp = Path(out) / CKPT_DIR / f".tmp-step_{step:08d}"
    engine.wait_for_weights()  # an update still in flight writes the masters
    usable = _usable(cfg.train.precision, step, out)
    mine = {"files": [], "pieces": [], "problem": None,
            "steps": max([e.opt.steps_taken for e in engine.group_engines() if e.opt is not None], default=0)}
    try:
        mine["files"], mine["pieces"], mine["problem"] = write_shards(
            engine, parallel.model, mesh, tmp, rank, cfg.train.checkpoint_buffer_mb * 2**20, write_tensors, usable)
    except OSError as e:
        mine["problem"] = f"{e.strerror or e} (rank {rank})" if rank else (e.strerror or str(e))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size() if mesh.is_main else None
        dist.gather_object(mine, everyone, dst=0)
    path = None
    if mesh.is_main:
        try:
            problem = next((m["problem"] for m in everyone if m["problem"] is not None), None)
            if isinstance(problem, str):
                shutil.rmtree(tmp, ignore_errors=True)
                raise failed_save(out, step, problem)
            if problem is not None:
                raise problem
            manifest = {"optimizer_steps": max(m["steps"] for m in everyone),
                        "pieces": [p for m in everyone for p in m["pieces"]]}
            (tmp / MANIFEST).write_text(json.dumps(manifest) + "\n")
            written = {name: record for m in everyone for name, record in m["files"]}
            path = commit_checkpoint(out, step, tmp, state, written, tokenizer, keep=cfg.train.keep_checkpoints)
        except RunError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = e
    if any_rank(error is not None):
        raise error or TrainingError(f"rank 0 could not save step {step} (its message says why)")
    return path


def _usable(precision: str, step: int, out):
    """A check of one master piece: None, or the error that refuses saving it (not finite; beyond fp16)."""
    def check(name, value):
        try:
            refuse_unusable_weights({name: value}, precision, step, out)
        except TrainingError as e:
            return e
        return None
    return check
