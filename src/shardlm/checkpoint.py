"""Atomic, layout-free checkpoints.

A checkpoint is a directory `RUN/checkpoints/step_00000042/` holding the fp32 master weights
(model.safetensors, by parameter name, so any later layout can reshard them), the optimizer state
(optimizer.safetensors, `name::key` tensors), everything else that a resumed run needs to continue
bit-for-bit (state.json: step, config, data position, loss scaler; rng.pt), and the tokenizer.
It is written under a temporary name, fsynced, and renamed into place: a run killed mid-save leaves
only a temporary directory, which loading ignores, so it resumes from the previous complete one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CKPT_DIR = "checkpoints"
STATE = "state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, masters: dict[str, torch.Tensor],
                    optimizer: dict[str, torch.Tensor], state: dict, tokenizer=None, keep: int = 2) -> Path:
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    cpu = lambda d: {k: v.detach().to("cpu").contiguous() for k, v in d.items()}  # noqa: E731
    save_file(cpu(masters), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    save_file(cpu(optimizer), str(tmp / "optimizer.safetensors"), metadata={"format": "pt"})
    torch.save(rng_state(), tmp / "rng.pt")
    if tokenizer is not None:
        tokenizer.tok.save(str(tmp / "tokenizer.json"))
    (tmp / STATE).write_text(json.dumps({**state, "step": step}, indent=1) + "\n")
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (a resumed run that wrote to the same directory)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE).is_file())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory itself, or the latest complete checkpoint of a run directory."""
    path = Path(path)
    if (path / STATE).is_file():
        return path
    found = complete_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (looked for {path / CKPT_DIR}/step_*/{STATE})")
    return found[-1]


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def load_checkpoint(path: str | Path, with_optimizer: bool = True) -> dict:
    ckpt = resolve_checkpoint(path)
    out = {"path": ckpt, "state": json.loads((ckpt / STATE).read_text()),
           "model": _read_tensors(ckpt / "model.safetensors")}
    if with_optimizer:
        out["optimizer"] = _read_tensors(ckpt / "optimizer.safetensors")
        out["rng"] = torch.load(ckpt / "rng.pt", weights_only=True)
    return out
