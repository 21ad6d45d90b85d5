"""The run directory (`--out`): a run's checkpoints, metrics.jsonl, TensorBoard events and config, and the
rules that keep two runs from mixing in one directory or a run from losing its own work.

- A directory that holds another run's checkpoints is refused; the user continues that run (`--resume`),
  starts over in it (`--overwrite`, which deletes them), or picks another `--out`. Without this a new
  run's metrics would replace the old run's, and checkpoint rotation would delete the new run's first
  checkpoint in favour of the old run's higher step numbers.
- A run resumed into its own directory from an explicitly chosen earlier checkpoint would continue next
  to checkpoints of the future it abandons: refused unless `--overwrite` deletes them. (Resuming a run
  directory picks its newest checkpoint that verifies; later ones are then damaged, and moved aside.)
- Temporary directories of saves cut short are removed.
- One process group owns the directory for the run's life (`claim`, runlock.py): a second run into it, or a
  resume of a run still going, is refused before either writes anything.
- Every rank must see the directory rank 0 locked: a sharded checkpoint is written by all of them into it
  (`refuse_unshared`).
- A group that torchrun restarts (`--max-restarts`) runs the failed attempt's command again: it continues from
  the checkpoints the job's attempts saved rather than being refused beside them (`claim`).
"""
from __future__ import annotations

import itertools
import os
import shutil
import socket
import time
from pathlib import Path

from .checkpoint import (CKPT_DIR, STATE, checkpoint_step, complete_checkpoints, discard, remove_partial,
                         unfinished_save)
from .config import ConfigError
from .runlock import RunLock, acquire, launcher, owner, restarted_attempt

METRICS, TENSORBOARD, CONFIG = "metrics.jsonl", "tensorboard", "config.toml"


def contains(directory: Path, path: Path) -> bool:
    directory, path = directory.resolve(), path.resolve()
    return path == directory or directory in path.parents


def claim(out: Path, main: bool, from_main, log=print) -> tuple[RunLock | None, bool]:
    """The main rank takes `out`'s lock before anything is written into it; `from_main(value)` hands the main
    rank's value to every rank, so all refuse alike (with its message) when it could not. Also returns whether
    this group is torchrun's restart of the run that last held `out`, which saved checkpoints there (`restarted`):
    the caller resumes them."""
    lock, failure, again = None, None, False
    if main:
        try:
            if out.exists() and not out.is_dir():
                raise ConfigError(f"--out {out} is a file, not a directory")
            _refuse_foreign(out)
            lock = acquire(out, log)
            if again := restarted(out, lock):
                log(f"torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: resuming the newest checkpoint in "
                    f"{out}, saved by an attempt that failed")
        except ConfigError as e:
            failure = str(e)
        except OSError as e:
            failure = f"--out {out} cannot be written: {e.strerror or e}"
    failure, again = from_main((failure, again))
    if failure:
        raise ConfigError(failure)
    return lock, again


def refuse_unshared(out: Path, rank: int, from_main, any_rank) -> None:
    """Every rank writes its pieces of a sharded checkpoint into rank 0's --out: a path local to each node (the
    default runs/... under each node's own working directory, /scratch) failed at the first save, on the other
    nodes, with everything trained since the start lost. Each rank looks for the lock rank 0 holds there
    (`from_main`, `any_rank`: the mesh's broadcast from rank 0 and its any-rank check)."""
    seen = owner(out)
    main = from_main(seen)
    for _ in range(10):  # a network filesystem's client may serve its cached view of the file for a few seconds
        if main is None or seen == main:
            break
        time.sleep(0.5)
        seen = owner(out)
    blind = main is None or seen != main
    if any_rank(blind):
        who = f"rank {rank} (on {socket.gethostname()}) does not see" if blind else "some ranks do not see"
        raise ConfigError(f"--out {out}: {who} the files rank 0 writes there (a directory local to each node?): "
                          "every rank writes its part of a sharded checkpoint into it; give an --out on a filesystem "
                          "every node shares, or set train.checkpoint_format = 'full' (gathered onto rank 0, which "
                          "alone writes)")


def restarted(out: Path, lock: RunLock) -> bool:
    """Whether this is an attempt torchrun restarted after a failure, whose previous attempt (the same agent) held
    `out`, and an attempt of that job (the previous one, or one before it whose restart died before saving) saved a
    checkpoint there. Run again unchanged, its command was refused beside the job's own checkpoints (given --resume
    of an earlier checkpoint, beside the later ones), and the restart was wasted."""
    if not restarted_attempt():
        return False
    before, newest = lock.previous_owner(), complete_checkpoints(out)
    if not before or before.get("launcher") != launcher() or not newest:
        return False
    # Saved by the job: not an older run's that it was to --overwrite when it died.
    began = before.get("job_started", before.get("started", float("inf")))
    return (newest[-1] / STATE).stat().st_mtime >= began


def _refuse_foreign(out: Path) -> None:
    """A dataset, a checkpoint or an exported model is no run directory: a run's files would mix with theirs (and
    `data prepare`, `export` and `--resume` would then refuse or misread them)."""
    what = {"index.json": "a prepared dataset", STATE: "a checkpoint", "config.json": "an exported model"}
    for above in [out, *out.resolve().parents]:
        found = next((kind for name, kind in what.items() if (above / name).is_file()), None)
        if found is not None and (above == out or found == "a checkpoint"):
            where = "is" if above == out else f"is inside {above}, which is"
            # --out left out: a resumed checkpoint that is not in a run's checkpoints folder is its own default
            default = " (without one, --resume of a checkpoint outside a run's checkpoints folder takes the " \
                "checkpoint as --out)" if above == out and found == "a checkpoint" else ""
            raise ConfigError(f"--out {out} {where} {found}, not a run directory: train into another --out{default}")
    # A project's own config.toml or metrics.jsonl (`--out .`) was replaced by the run's without a word.
    for name, ours in ((CONFIG, _run_config), (METRICS, _run_metrics)):
        if (out / name).is_file() and not ours(out / name):
            raise ConfigError(f"--out {out} holds a {name} that is not a shardlm run's, which the run would replace: "
                              "train into another --out (a new or empty directory)")


def _run_config(path: Path) -> bool:
    """Whether `path` is a config.toml a run wrote (its sections are shardlm's), or empty."""
    from .config import SECTIONS
    from .config.load import tomllib
    try:
        sections = tomllib.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError):  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return False
    return set(sections) <= set(SECTIONS)


def _run_metrics(path: Path) -> bool:
    """Whether `path` is a metrics.jsonl a run wrote (its first record has a step), or empty."""
    import json
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        record = json.loads(first) if first.strip() else {"step": 0}
    except (ValueError, OSError):
        return False
    return isinstance(record, dict) and "step" in record


def prepare(out: Path, resume: Path | None, overwrite: bool, main: bool, log=print) -> str | None:
    """Check `out` (on every rank, so all refuse alike) and prepare it (on the main rank) before the run
    writes anything into it; returns what failed in the main rank's preparation (the caller makes every
    rank stop on it, not the main rank alone), or None."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if resume is not None and (unfinished := unfinished_save(resume)) is not None:  # before it is removed as one
        raise unfinished
    existing = complete_checkpoints(out)
    own = resume is not None and contains(out, Path(resume))
    if existing and not own and not overwrite:
        raise ConfigError(f"{out} already holds a run's checkpoints (up to {existing[-1].name}): continue that run "
                          f"with --resume {out}, start over in it with --overwrite (deletes its checkpoints and "
                          "metrics), or train into another --out")
    if not main:
        return None
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".shardlm-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return f"--out {out} cannot be written: {e.strerror or e}"
    partial = remove_partial(out)
    if partial:  # which steps were lost and where the run stands: a resume continues from the newest complete one
        steps = ", ".join(sorted({str(int(p.name.split("_")[1].split("-")[0])) for p in partial}, key=int))
        newest = complete_checkpoints(out)
        log(f"removed {len(partial)} unfinished checkpoint save(s) in {out / CKPT_DIR} (step {steps}, cut short by a "
            f"crash or kill); " + (f"the newest complete checkpoint is {newest[-1].name}" if newest else
                                   "no complete checkpoint is left"))
    return None


def overwrite_run(out: Path, checkpoint: Path | None, log=print) -> None:
    """--overwrite: delete the run in `out` (its checkpoints and metrics), or, resuming its own `checkpoint`,
    the checkpoints after it (main rank). Called once the new run has passed its checks (data, tokenizer,
    model, train.freeze), so that one refused keeps the old run whole."""
    existing = complete_checkpoints(out)
    if checkpoint is not None and contains(out, checkpoint):
        for p in (p for p in existing if checkpoint_step(p) > checkpoint_step(checkpoint)):
            discard(p)
            log(f"--overwrite: deleted {p.name}, after the resumed {checkpoint.name}")
    elif existing:
        discard(out / CKPT_DIR)  # renamed away first: a kill midway leaves no half of it for --resume to take
        shutil.rmtree(out / TENSORBOARD, ignore_errors=True)
        (out / METRICS).unlink(missing_ok=True)
        log(f"--overwrite: deleted the checkpoints (up to {existing[-1].name}) and metrics in {out}")


def drop_damaged_after(out: Path, checkpoint: Path, log=print) -> None:
    """Resuming its own run directory (not --overwrite, which deletes them anyway): the checkpoints after
    `checkpoint`, the newest that verified, are damaged. Kept, they counted towards train.keep_checkpoints,
    and rotation deleted good checkpoints in their place. Moved aside rather than deleted: one that only
    could not be read just then (a flaky network filesystem) is still there (main rank; once the run has
    passed its checks)."""
    for p in (p for p in complete_checkpoints(out) if checkpoint_step(p) > checkpoint_step(checkpoint)):
        aside = p.with_name(f"damaged-{p.name}")
        for i in itertools.count(1):  # an earlier damaged copy of the same step stays too (it may read later)
            if not aside.exists():
                break
            aside = p.with_name(f"damaged-{p.name}.{i}")
        p.rename(aside)
        log(f"moved the damaged {p.name} aside to {aside} (delete it once it is of no use): the run continues "
            f"from {checkpoint.name}")


def check_resume_into(out: Path, resume: Path, checkpoint: Path, overwrite: bool, saved_batch: int,
                      batch: int) -> bool:
    """Whether resuming `checkpoint` (asked for as `resume`) continues its own run in `out`; refuses another
    global batch there (`saved_batch`, the checkpoint's, against `batch`), and to resume an explicitly chosen
    earlier checkpoint beside later ones unless `overwrite` (overwrite_run deletes them)."""
    if not contains(out, checkpoint):
        return False
    if saved_batch != batch:
        raise ConfigError(f"{checkpoint} was trained with train.global_batch_size {saved_batch}: with {batch} the "
                          "steps would be numbered anew beside its checkpoints; resume into another --out")
    later = [p for p in complete_checkpoints(out) if checkpoint_step(p) > checkpoint_step(checkpoint)]
    if later and Path(resume).resolve() != out.resolve() and not overwrite:
        raise ConfigError(f"{out} holds checkpoints after {checkpoint.name} ({', '.join(p.name for p in later)}): "
                          f"resuming {checkpoint.name} into it would mix two futures of the run; resume into "
                          "another --out, or pass --overwrite to delete the later checkpoints")
    return True
