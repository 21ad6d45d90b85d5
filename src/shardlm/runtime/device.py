"""Which device a run uses, and host memory that the GPU's copy engines can read and write asynchronously."""
from __future__ import annotations

import weakref

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


# torch's pinned allocator rounds every block up to a power of two bytes, so a 52 GB buffer (a 13B
# model's fp32 gradients) would hold 64 GiB; from this size on a buffer is page-locked in place instead,
# at its exact size (as torch's distributed checkpoint stager does).
EXACT_PIN_BYTES = 1 << 28


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of `numel` elements, page-locked if `pin`. The lock ends with its
    storage (the last tensor viewing it), which must outlive the asynchronous copies that read or write it:
    unlike the caching allocator's blocks, this memory is freed at once."""
    if not pin:
        return torch.empty(numel, dtype=dtype)
    if numel * dtype.itemsize < EXACT_PIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    t = torch.empty(numel, dtype=dtype)
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(t.data_ptr(), numel * dtype.itemsize, 1))  # 1: cudaHostRegisterPortable
    if code != 0:
        raise RuntimeError(f"page-locking {numel * dtype.itemsize / 2**30:.1f} GiB of host memory failed "
                           f"(cudaError {code}): the host may limit locked memory (ulimit -l)")
    weakref.finalize(t.untyped_storage(), cudart.cudaHostUnregister, t.data_ptr()).atexit = False  # exit unlocks it
    return t
