"""Resuming a run (torchtitan's and Megatron-LM's --load): `choose` picks the checkpoint (rank 0 picks and verifies
it, the others take its pick) and refuses a resume that would change the model, its adapters, its tokenizer or its
data, before the model is built and before --overwrite deletes anything; `load` puts it into the built trainer
(weights, optimizer state, loss scaler, router bias, every rank's RNG, the data position) and says where the run
continues otherwise than the checkpoint's did (resume_notes.py)."""
from __future__ import annotations

from pathlib import Path

from . import compat, rundir
from .checkpoint import load_checkpoint, read_state, resolve_checkpoint
from .config import config_from_dict
from .resume_notes import resume_notes
from .rng_state import rng_layout, set_rng_state
from .runtime.first_rank import first_rank_result
from .runtime.said import also_moved, said_progress


def choose(trainer, resume) -> tuple[Path, bool]:
    """The checkpoint to resume (the main rank picks and verifies it, the others take its pick) and whether
    it continues its own run in this run's directory; a resume that would change the model, its adapters
    or its data is refused here, before the model is built and before --overwrite deletes anything."""
    said = said_progress(trainer.log, "verifying the checkpoint's {:,.1f} GB (CRC32 of every file) before resuming")
    chosen = first_rank_result(lambda moved: str(resolve_checkpoint(
        resume, trainer.log, option="--resume", progress=also_moved(said, moved))),
        stall_s=trainer.cfg.parallel.timeout_s, what="rank 0's check of the checkpoint to resume")
    path, state = Path(chosen), read_state(chosen)
    saved = config_from_dict(state["config"], f"the config saved in {path}")
    compat.check_resume(path, saved, trainer.cfg)
    if saved.train.init_from and not trainer.cfg.train.init_from:
        # A config without it (a preset given beside --resume): the weights are the checkpoint's either way, and
        # the run keeps naming its base (an exported adapter's base_model_name_or_path, the generation config).
        trainer.cfg.train.init_from = saved.train.init_from
    compat.check_tokenizer(trainer.cfg, trainer.data_dir, trainer.data.train.shards.index, trainer.tokenizer, path)
    compat.check_resume_data(path, state, trainer.data.train_windows, trainer.data.sampler.seed,
                             trainer.cfg.train.global_batch_size, trainer.cfg.train.seq_len, trainer.cfg.data)
    own = trainer.out is not None and rundir.check_resume_into(trainer.out, Path(resume), path, trainer.overwrite,
                                                               saved.train.global_batch_size,
                                                               trainer.cfg.train.global_batch_size)
    compat.warn_changed_data(path, state, trainer.data.train.shards, trainer.log if trainer.mesh.is_main else None)
    return path, own


def load(trainer, path: Path) -> None:
    """Load the checkpoint `choose` chose into `trainer` (built: its model, engine, scaler, data)."""
    ckpt = load_checkpoint(path, log=trainer.log, verify=False)
    data = ckpt["state"]["data"]
    trainer.untrained_steps = ckpt["state"].get("untrained_steps", 0)
    trainer.parallel.load_full_state(ckpt["model"], ckpt["optimizer"])
    trainer.scaler.load_state_dict(ckpt["state"]["loss_scaler"])
    trainer.moe.load(ckpt["state"].get("router_bias"))
    set_rng_state(ckpt["rng"], trainer.mesh.rank, rng_layout(trainer.cfg.parallel))
    trainer.step = data["consumed_samples"] // trainer.cfg.train.global_batch_size
    trainer.resumed_from = ckpt["path"]
    trainer.saved_step = trainer.step
    saved = config_from_dict(ckpt["state"]["config"])
    notes = resume_notes(saved, ckpt["state"]["step"], trainer.cfg, trainer.step, len(trainer.data.eval_range))
    for note in notes if trainer.mesh.is_main else ():
        trainer.log(note)
    if trainer.step >= trainer.cfg.train.steps and trainer.mesh.is_main:  # once, not once per rank
        trainer.log(f"checkpoint {ckpt['path']} is at step {trainer.step}, train.steps is {trainer.cfg.train.steps}: "
                    f"nothing to do (raise train.steps above {trainer.step} to continue)")
