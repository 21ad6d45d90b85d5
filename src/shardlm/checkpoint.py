"""Atomic, layout-free checkpoints, full or sharded.

A checkpoint is a directory `RUN/checkpoints/step_00000042/` holding the fp32 master weights and the
optimizer state by parameter name, so any later layout can reshard them, everything else that a resumed
run needs to continue bit-for-bit (state.json: step, config, data position, loss scaler; rng.pt), and the
tokenizer. The tensors are either full (model.safetensors, optimizer.safetensors with `name::key` tensors:
gathered onto one rank) or sharded: each rank's pieces in its own files (`rank00003-0000.safetensors`),
written in parallel, and a manifest naming each piece's parameter, kind, flat range of its rank's local
tensor and tensor-parallel sharding (parallel/sharded_state.py writes them; sharded_read.py's
`ShardedState` reads them back by name, one tensor at a time, so no reader holds the whole model either).
It is written under a temporary name, fsynced, and renamed into place: a run killed mid-save leaves
only a temporary directory, which loading ignores (and the next run removes), so it resumes from the
previous complete one. state.json, written last, records each file's size and CRC32; loading verifies
them, and a run directory whose newest checkpoint is damaged (truncated, emptied, a flipped bit, a file
missing) resumes from the newest one that verifies, saying so. This module finds, verifies and reads them;
checkpoint_write.py writes them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from .config import RunError
from .sharded_read import ShardedState

CKPT_DIR = "checkpoints"
STATE = "state.json"
MANIFEST = "manifest.json"  # a sharded save's pieces (parallel/sharded_state.py)
VERIFY_THREADS = 8
# What saves name their checkpoints: a copy beside them (`cp -r step_00000004 step_00000004.bak`) is the user's, not
# a step of the run; taken for the newest one, its name failed as "invalid literal for int()".
STEP_NAME = re.compile(r"step_(\d+)")
UNFINISHED = re.compile(r"\.tmp-step_(\d+)(?:-\d+)?")  # a save's temporary directory (begin_checkpoint)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths, moved=None) -> None:
    """Each file flushed to disk; `moved()` called after each (minutes for tens of GB)."""
    for f in paths:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        if moved is not None:
            moved()


def fsync_tree(path: Path, moved=None) -> None:
    fsync_files(path.iterdir(), moved)
    fsync_dir(path)


class CheckpointError(RunError):
    """A checkpoint could not be written, or one on disk is damaged; the message names the file."""


def file_crc32(path: Path, done=None) -> int:
    crc = 0
    try:
        f = open(path, "rb")
    except PermissionError as e:  # not a damaged checkpoint (which a run's newest is skipped for): the reader's
        raise RunError(f"{path} cannot be read: {e.strerror}") from None
    with f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
            if done is not None:
                done(len(chunk))
    return crc


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete the temporary directories that saves cut short (a crash, a full disk) left behind, and what a
    deletion cut short left of a checkpoint rotated out, or of the checkpoints --overwrite deleted (`discard`);
    returns the former."""
    shutil.rmtree(Path(run_dir) / f".old-{CKPT_DIR}", ignore_errors=True)
    root = Path(run_dir) / CKPT_DIR
    partial = sorted(root.glob(".tmp-step_*")) if root.is_dir() else []
    for p in [*partial, *(root.glob(".old-step_*") if root.is_dir() else [])]:
        shutil.rmtree(p, ignore_errors=True)
    return partial


def discard(path: Path) -> None:
    """Delete a checkpoint, renamed out of the run's steps first: a kill midway through deleting it in place left
    a step_N without its state.json, which no rotation or cleanup ever removed (a whole checkpoint's disk)."""
    old = path.with_name(f".old-{path.name}")
    shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(path, old)
    except OSError:
        old = path
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_step(path: Path) -> int:
    """The step of checkpoint `path`: from its name, or from its state.json for one renamed or copied elsewhere."""
    if (named := STEP_NAME.match(path.name)) is not None:
        return int(named.group(1))
    try:
        return int(json.loads((path / STATE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} has no step: neither its name (step_N) nor its {STATE} ({e}) gives one") from None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if STEP_NAME.fullmatch(p.name) and (p / STATE).is_file())


def unfinished_save(path: Path) -> FileNotFoundError | None:
    """A save's temporary directory named as a checkpoint: once "holds no complete checkpoint (looked for
    .tmp-step_N/checkpoints/...)", taken as --resume's own --out, or removed as unfinished before it was read."""
    if (named := UNFINISHED.fullmatch(path.name)) is None:
        return None
    newest = [p.name for p in complete_checkpoints(path.parent.parent)] or ["none yet"]
    return FileNotFoundError(f"{path} is the unfinished save of step {int(named.group(1))} (cut short by a crash or "
                             f"kill, or still being written), not a checkpoint: name its run {path.parent.parent} "
                             f"instead (its newest complete checkpoint: {newest[-1]})")


def _no_checkpoint(path: Path) -> FileNotFoundError:
    if (unfinished := unfinished_save(path)) is not None:
        return unfinished
    if path.is_file():
        return FileNotFoundError(f"{path} is a file; a run, a checkpoint or a Hugging Face model is a directory")
    hf = (path / "config.json").is_file()  # an HF directory (an export) is where a new run starts, not a resume
    adapter = (path / "adapter_config.json").is_file()
    # A run still before its first save (a run writes config.toml and metrics.jsonl at its start): the bare
    # "holds no complete checkpoint" read as a wrong path, and said nothing of when there will be one.
    run = (path / "config.toml").is_file() or (path / "metrics.jsonl").is_file()
    if path.name == CKPT_DIR and complete_checkpoints(path.parent):  # RUN/checkpoints: it does hold checkpoints
        newest = complete_checkpoints(path.parent)[-1]
        return FileNotFoundError(f"{path} is the checkpoints folder of the run {path.parent}: name the run (its newest "
                                 f"checkpoint) or one checkpoint in it, such as {newest}")
    partial = sorted(p for p in (path / CKPT_DIR).glob("step_*") if STEP_NAME.fullmatch(p.name)) if run else []
    if partial:  # "saved no checkpoint yet" once sent a user to wait for a run whose state.json was deleted
        return FileNotFoundError(f"{path} holds no complete checkpoint: {partial[-1]} has no {STATE}, which a save "
                                 "writes last (a save still under way, or one cut short or damaged): wait for the "
                                 "save, or train the run again (--overwrite) or name another checkpoint")
    return FileNotFoundError(f"{path} holds no complete checkpoint (looked for {path / CKPT_DIR}/step_*/{STATE})"
                             + ("; it is a Hugging Face directory: start a run from it with --train.init_from"
                                if hf else "; it is a PEFT adapter: give its base model and this as --adapter"
                                if adapter else "; it is a run that has saved no checkpoint yet: a run saves one "
                                "every train.save_every steps (0: at its end) and when stopped by Ctrl-C or SIGTERM; "
                                "wait for its first, or name a run or checkpoint that has one" if run else ""))


def read_state(path: str | Path) -> dict:
    """state.json of a checkpoint, or of the newest checkpoint of a run directory whose state.json reads,
    without reading (or verifying) the tensors: what a resumed run's config comes from."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: name a run directory or one of its checkpoints")
    candidates = [path] if (path / STATE).is_file() else list(reversed(complete_checkpoints(path)))
    if not candidates:
        raise _no_checkpoint(path)
    problems = []
    for ckpt in candidates:
        try:
            state = json.loads((ckpt / STATE).read_text())
        except (OSError, ValueError) as e:
            problems.append(f"{ckpt / STATE} is not readable JSON ({e})")
            continue
        if isinstance(state, dict) and isinstance(state.get("config"), dict):  # null: config_from_dict's traceback
            return state
        problems.append(f"{ckpt / STATE} holds no config")
    raise CheckpointError(f"no checkpoint of {path} has a readable {STATE}: {'; '.join(problems)}")


def verify_checkpoint(path: Path, progress=None) -> dict:
    """The checkpoint's state (state.json), after checking that every file it records is there, whole and
    unchanged; CheckpointError names the first file that is not. `progress`: called with the bytes to read, it
    returns what to call with each piece read (a model of billions of parameters is minutes of reading)."""
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / STATE} is not readable JSON ({e})") from None
    if not isinstance(state, dict) or not {"step", "config", "data"} <= state.keys():
        raise CheckpointError(f"{path / STATE} lacks the step, config or data of the checkpoint")
    files = state.get("files", {})  # checkpoints written before checksums have none
    for name, want in (files if isinstance(files, dict) else {"its files": files}).items():
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and isinstance(want.get("crc32"), int)):
            raise CheckpointError(f"{path / STATE} records {name} as {want!r}, not its size and CRC32 (edited by "
                                  "hand?): put back the state.json the run saved, or resume another checkpoint")
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{f} has {size} bytes, {want['bytes']} were written (truncated or replaced)")
    if progress is not None:
        update, lock = progress(sum(want["bytes"] for want in files.values())), threading.Lock()

        def done(n):
            with lock:  # the threads' counts would race
                update(n)
    else:
        done = None
    # A sharded checkpoint is many files (all ranks' pieces) checked by one rank: the reads and zlib release
    # the GIL, so threads check them at the disk's rate rather than one core's.
    with ThreadPoolExecutor(max_workers=min(VERIFY_THREADS, max(len(files), 1))) as pool:
        crcs = [pool.submit(file_crc32, path / name, done) for name in files]
        for (name, want), crc in zip(files.items(), crcs):
            if crc.result() != want["crc32"]:  # the files not yet read are not read
                pool.shutdown(cancel_futures=True)
                raise CheckpointError(f"{path / name} does not match its checksum (corrupted on disk)")
    return state


def resolve_checkpoint(path: str | Path, log=None, verify: bool = True, progress=None, option: str = "") -> Path:
    """A checkpoint directory itself (verified), or the newest checkpoint of a run directory that verifies;
    a damaged one is skipped with a message through `log` (None: a note on stderr, as export, generate and
    eval once took an older step without a word). `verify` False: trust a path another rank resolved and
    verified already. `option`: the command's option that named `path`, for the message of a damaged one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: name a run directory or one of its checkpoints")
    if (path / STATE).is_file() or path.name.startswith("step_"):
        if verify:
            try:
                verify_checkpoint(path, progress)
            except CheckpointError as e:
                raise CheckpointError(f"{e}{_run_hint(path, option)}") from None
        return path
    found = complete_checkpoints(path)
    if not found:
        raise _no_checkpoint(path)
    problems = []
    for ckpt in reversed(found):
        try:
            verify_checkpoint(ckpt, progress)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if problems:
            note = f"skipping damaged checkpoints ({'; '.join(problems)}); using {ckpt}, the newest that verifies"
            log(note) if log is not None else print(f"note: {note}", file=sys.stderr)
        return ckpt
    raise CheckpointError(f"no checkpoint of {path} verifies: {'; '.join(problems)}")


def _run_hint(ckpt: Path, option: str) -> str:
    """A damaged checkpoint named explicitly ends the command, where its run directory named instead would fall
    take the newest one that verifies: say so where the run has another."""
    run = ckpt.parent.parent
    if ckpt.parent.name != CKPT_DIR or not any(p.name != ckpt.name for p in complete_checkpoints(run)):
        return ""
    named = f"{option} {run}" if option else f"the run directory {run}"
    return f"; {named} instead takes the newest of its checkpoints that verifies"


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for any damage it finds
        raise CheckpointError(f"{path} could not be read ({e})") from None


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The full shape of each master tensor of checkpoint `path`, read from the files' headers only."""
    if (path / MANIFEST).is_file():
        state = ShardedState(path, json.loads((path / MANIFEST).read_text()))
        return {n: state.shape(n) for n, k in state.pieces if k == "master"}
    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error type for any damage it finds
        raise CheckpointError(f"{path / 'model.safetensors'} could not be read ({e})") from None


def load_checkpoint(path: str | Path, with_optimizer: bool = True, log=None, verify: bool = True,
                    progress=None) -> dict:
    """The checkpoint's state, its masters ("model") and optimizer state by name, and the RNG state. Those of
    a sharded save (a manifest of pieces) are mappings that assemble each tensor when it is read. `progress`:
    verify_checkpoint's."""
    ckpt = resolve_checkpoint(path, log, verify, progress)
    out = {"path": ckpt, "state": json.loads((ckpt / STATE).read_text())}
    if (ckpt / MANIFEST).is_file():
        state = ShardedState(ckpt, json.loads((ckpt / MANIFEST).read_text()))
        out["model"] = state.masters()
        if with_optimizer:
            out["optimizer"] = state.optimizer()
    else:
        out["model"] = _read_tensors(ckpt / "model.safetensors")
        if with_optimizer:
            out["optimizer"] = _read_tensors(ckpt / "optimizer.safetensors")
    if with_optimizer:
        out["rng"] = torch.load(ckpt / "rng.pt", weights_only=True)
    return out
