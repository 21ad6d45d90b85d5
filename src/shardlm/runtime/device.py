"""Which device a run uses."""
from __future__ import annotations

import torch

from ..config import ConfigError


def pick_device(name: str = "auto") -> torch.device:
    """`auto`: the GPU where there is one, else the CPU; `cuda` without a GPU is an error, not a fallback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda', but no CUDA device is visible to this process: use "
                          "train.device auto or cpu")
    return torch.device(name)
