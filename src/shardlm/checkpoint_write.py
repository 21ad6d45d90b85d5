"""Writing a checkpoint (checkpoint.py describes its layout): the tensors as safetensors files whose checksums
are taken from memory on the way, under a temporary name, the RNG state, tokenizer and state.json (last)
beside them, everything fsynced, then renamed into place and older checkpoints rotated out. A failed write
(a full or read-only disk) removes the temporary directory and names the checkpoint that is kept."""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import zlib
from pathlib import Path

import torch

from .checkpoint import (CKPT_DIR, STATE, CheckpointError, complete_checkpoints, discard, file_crc32, fsync_dir,
                         fsync_tree)
from .generation_config import write_generation_config
from .rng_state import rng_state


def save_checkpoint(run_dir: str | Path, step: int, masters: dict[str, torch.Tensor],
                    optimizer: dict[str, torch.Tensor], state: dict, tokenizer=None, keep: int = 2,
                    generation_config: dict | None = None, rng: dict | None = None, moved=None) -> Path:
    """Write step `step`'s checkpoint atomically and keep the newest `keep` of those up to it; a failed
    write (disk full, read-only) raises CheckpointError and leaves every earlier checkpoint as it was.
    `moved()` is called as the writes make progress (runtime/first_rank.py)."""
    tmp = begin_checkpoint(run_dir, step, f"-{os.getpid()}")
    # write_tensors, not safetensors' save_file, whose I/O errors are not OSError: a full disk must end in
    # failed_save's line, not a traceback; the checksums come from memory too.
    with _FailingSave(run_dir, step, tmp):
        cpu = lambda d: {k: v.detach().to("cpu").contiguous() for k, v in d.items()}  # noqa: E731
        written = {name: write_tensors(tmp / name, cpu(tensors), sync=False, moved=moved)
                   for name, tensors in (("model.safetensors", masters), ("optimizer.safetensors", optimizer))}
    return commit_checkpoint(run_dir, step, tmp, state, written, tokenizer, keep, rng=rng,
                             generation_config=generation_config, moved=moved)


def begin_checkpoint(run_dir: str | Path, step: int, suffix: str = "") -> Path:
    """The empty temporary directory step `step`'s files are written into (a sharded save: by every rank)."""
    tmp = Path(run_dir) / CKPT_DIR / f".tmp-step_{step:08d}{suffix}"
    with _FailingSave(run_dir, step, tmp):
        if not tmp.parent.is_dir():  # its entry in the run directory, made durable as the commit's rename will be
            tmp.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(tmp.parent.parent)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    return tmp


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL"}


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], sync: bool = True, moved=None) -> dict:
    """One safetensors file of a sharded save (CPU tensors), flushed to disk where `sync`; its record (size,
    CRC32) for state.json; `moved()` called after each tensor written. The format (a little-endian u64 header
    size, the JSON header padded to 8 bytes, the tensors' bytes) is written here rather than by safetensors'
    save_file, so that each tensor's memory goes to the file as it is and its checksum is taken from memory on
    the way, not by reading the file back: a third of the time on one disk (bench/README.md, "Sixteenth
    lease"). safetensors reads it."""
    datas, header, at = [], {"__metadata__": {"format": "pt"}}, 0
    for key, t in tensors.items():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        header[key] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [at, at + data.nbytes]}
        datas.append(data)
        at += data.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head = len(head + b" " * (-len(head) % 8)).to_bytes(8, "little") + head + b" " * (-len(head) % 8)
    crc = zlib.crc32(head)
    with open(path, "wb") as f:
        f.write(head)
        for data in datas:
            crc = zlib.crc32(data, crc)  # zlib and the write release the GIL: a save's thread runs beside training
            f.write(data)
            if moved is not None:
                moved()
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return {"bytes": len(head) + at, "crc32": crc}


class _FailingSave:
    """An OSError inside: the temporary directory removed, CheckpointError saying which checkpoint is kept."""

    def __init__(self, run_dir, step: int, tmp: Path):
        self.run_dir, self.step, self.tmp = run_dir, step, tmp

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if not isinstance(e, OSError):
            return False
        shutil.rmtree(self.tmp, ignore_errors=True)
        raise failed_save(self.run_dir, self.step, e.strerror or str(e)) from None


def failed_save(run_dir, step: int, why: str) -> CheckpointError:
    """The error of a save that failed (its temporary directory removed), saying which checkpoint is kept, and
    on a full disk how much to free."""
    earlier = complete_checkpoints(run_dir)
    kept = f"{earlier[-1]} is kept" if earlier else "no earlier checkpoint exists"
    final = Path(run_dir) / CKPT_DIR / f"step_{step:08d}"
    room = _room(earlier, final.parent) if any(full in why for full in _FULL) else ""
    return CheckpointError(f"saving step {step} to {final} failed: {why}; {kept}{room}")


_FULL = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))  # as OSError's strerror and a rank's message say them


def _room(earlier: list[Path], root: Path) -> str:
    """A save writes a whole checkpoint beside the kept ones before rotating the oldest out: that much must be free."""
    try:
        size = sum(f.stat().st_size for f in earlier[-1].iterdir()) if earlier else 0
    except OSError:
        size = 0
    need = f"at least {size / 2**30:.1f} GiB" if size >= 2**30 else f"at least {size / 2**20:.1f} MiB" if size \
        else "room for a whole checkpoint"
    of = f" (the size of {earlier[-1].name})" if size else ""
    return (f"; free {need}{of} on the filesystem of {root}: a save writes a checkpoint beside the kept ones before "
            "the oldest is rotated out (train.keep_checkpoints), then resume")


def commit_checkpoint(run_dir: str | Path, step: int, tmp: Path, state: dict, written: dict, tokenizer=None,
                      keep: int = 2, rng: dict | None = None, generation_config: dict | None = None,
                      moved=None) -> Path:
    """Complete the checkpoint in `tmp` (`written`: the records of files written and checksummed already,
    by name; the others are checksummed here) with the RNG state (`rng`: as it was at the step saved; else
    now), the tokenizer, the generation_config.json of the weights' source (`generation_config`: the run's,
    generation_config.py) and state.json, written last; rename it into place and rotate. `moved()` is called
    as it makes progress (each file flushed, each old checkpoint deleted)."""
    moved = moved or (lambda *_: None)
    root = Path(run_dir) / CKPT_DIR
    final = root / f"step_{step:08d}"
    with _FailingSave(run_dir, step, tmp):
        # Through memory: torch.save's own writes fail on a full disk with a RuntimeError naming neither the
        # cause nor the file ("basic_ios::clear: iostream error"), which _FailingSave does not catch.
        rng_bytes = io.BytesIO()
        torch.save(rng if rng is not None else rng_state(), rng_bytes)
        (tmp / "rng.pt").write_bytes(rng_bytes.getvalue())
        if tokenizer is not None:  # with its tokenizer_config.json: the chat template and the end-of-text token
            tokenizer.save(tmp)
        if generation_config is not None:  # its eos ids stop generate/serve on the checkpoint, and go to exports
            write_generation_config(tmp, generation_config)
        files = {f.name: written.get(f.name) or {"bytes": f.stat().st_size, "crc32": file_crc32(f, moved)}
                 for f in sorted(tmp.iterdir())}
        (tmp / STATE).write_text(json.dumps({**state, "step": step, "files": files}, indent=1) + "\n")
        fsync_tree(tmp, moved)
        if final.exists():  # re-saving the same step (a resumed run that wrote to the same directory)
            discard(final)
        os.replace(tmp, final)
        fsync_dir(root)
    # Only checkpoints up to this step rotate out: one of a later step is not this run's to delete.
    older = [p for p in complete_checkpoints(run_dir) if p.name <= final.name]
    for old in older[:-keep] if keep > 0 else []:
        discard(old)
        moved()
    return final
