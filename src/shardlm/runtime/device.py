"""Which device a run uses."""
from __future__ import annotations

import torch


def pick_device(name: str = "auto") -> torch.device:
    """`auto`: the GPU where there is one, else the CPU; `cuda` without a GPU is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device = 'cuda' but no CUDA device is available")
    return torch.device(name)
