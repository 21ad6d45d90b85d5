"""The notes a resume prints where it continues other than the checkpoint's run did: a learning-rate schedule
that moved, optimizer settings that went back to the config given, an eval set of other windows, a QLoRA base
quantised again in other blocks. None of these is refused (each can be meant); each is said once, on rank 0."""
from __future__ import annotations

from .config import Config, TrainConfig
from .optim import lr_at


def resume_notes(saved: Config, saved_step: int, now: Config, step: int, held_out: int) -> list[str]:
    """What a run resumed at `step` from a checkpoint of `saved` (its optimizer at `saved_step`) says before it
    trains; `held_out`: the eval windows there are."""
    notes = [requantized_note(saved, now)]
    if step < now.train.steps:  # else nothing runs
        notes += [schedule_note(saved.train, saved_step, now.train, step), trajectory_note(saved.train, now.train),
                  eval_set_note(saved.train, now.train, held_out)]
    return [note for note in notes if note]


def schedule_note(saved: TrainConfig, saved_step: int, now: TrainConfig, step: int) -> str | None:
    """A resume that changes the schedule (most often a raised train.steps, which stretches the cosine) moved the
    learning rate without a word: back up from near its floor, where the checkpoint's run was decaying (or,
    changed during warmup, from the first step after it). The note saying so, or None."""
    keys = ("steps", "global_batch_size", "lr", "lr_schedule", "warmup_steps", "min_lr_ratio")
    changed = ", ".join(f"train.{k} {getattr(saved, k)!r} -> {getattr(now, k)!r}" for k in keys
                        if getattr(saved, k) != getattr(now, k))
    ahead = range(step, max(now.steps, saved.steps))
    if not changed or all(abs(lr_at(s, now) - lr_at(s, saved)) <= 1e-6 * max(abs(lr_at(s, saved)), 1e-30)
                          for s in ahead):
        return None
    return (f"note: the learning-rate schedule is not the checkpoint's ({changed}): step {step + 1} runs at lr "
            f"{lr_at(step, now):.2e}, where the checkpoint's schedule continued at {lr_at(saved_step, saved):.2e}")


# What a step computes, beside the schedule (schedule_note) and what a resume refuses to change (check_resume).
TRAJECTORY_KEYS = ("weight_decay", "beta1", "beta2", "eps", "momentum", "grad_clip", "precision", "optimizer_dtype",
                   "moe_aux_loss_coef", "moe_z_loss_coef")


def trajectory_note(saved: TrainConfig, now: TrainConfig) -> str | None:
    """A resume given a config (`train tiny --resume RUN`) takes that config's values, not the run's: its
    --train.weight_decay 0 or grad_clip given at the start silently went back to the file's. The note naming
    each key that changes what a step computes, or None."""
    changed = [f"train.{k} {getattr(saved, k)!r} -> {getattr(now, k)!r}" for k in TRAJECTORY_KEYS
               if getattr(saved, k) != getattr(now, k)]
    if not changed:
        return None
    return (f"note: this run's config is not the checkpoint's ({', '.join(changed)}): a resume takes the config "
            "and flags given; `shardlm train --resume RUN` alone continues with the run's own")


def requantized_note(saved: Config, now: Config) -> str | None:
    """QLoRA quantises each tensor-parallel rank's shard of a weight in blocks of its own: resumed at another
    parallel.tp, the checkpoint's base (saved dequantised) is quantised again in other blocks, and the adapters
    continue on a base a little off the one they were fitted to, which the loss shows. The note, or None."""
    if now.lora.quantize != "nf4" or saved.parallel.tp == now.parallel.tp:
        return None
    return (f"note: lora.quantize = 'nf4' at parallel.tp {now.parallel.tp}, the checkpoint's {saved.parallel.tp}: "
            "each rank quantises its shard of the base, so the base is quantised again in other blocks and differs "
            "from the one the adapters were trained on (within NF4's rounding); the loss may step at the resume "
            f"(parallel.tp {saved.parallel.tp} keeps the base)")


def eval_set_note(saved: TrainConfig, now: TrainConfig, held_out: int) -> str | None:
    """Eval scores the first train.eval_batches x train.micro_batch_size held-out windows: a resume that changes
    either (a new layout's micro batch most often) scores other windows, and the eval curve steps at the resume
    with no change of the model. The note saying so, or None. `held_out`: the windows there are to score."""
    then = min(held_out, saved.eval_batches * saved.micro_batch_size)
    count = min(held_out, now.eval_batches * now.micro_batch_size)
    if not now.eval_every or then == count:
        return None
    same = then // now.micro_batch_size if then % now.micro_batch_size == 0 else None
    how = (f"; train.eval_batches {same} scores the checkpoint's windows" if same
           else "; eval_loss before and after it is not one curve")
    return (f"note: eval scores {count} held-out windows (train.eval_batches {now.eval_batches} x "
            f"train.micro_batch_size {now.micro_batch_size}), the checkpoint's run scored {then}{how}")
