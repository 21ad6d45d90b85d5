"""Which device a run uses, and host memory that the GPU's copy engines can read and write asynchronously."""
from __future__ import annotations

import weakref

import torch

from ..config import ConfigError


def pick_device(name: str = "auto", option: str = "train.device") -> torch.device:
    """`auto`: the GPU where there is one, else the CPU; `cuda` without a GPU is an error, not a fallback.
    `option` is where the name came from (a config key, or a command's flag such as --device), for the errors."""
    given = f"{option} {name!r}" if option.startswith("--") else f"{option} = {name!r}"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's message lists every backend it knows, which shardlm does not run on
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{given} is not a device (auto, cpu, cuda, cuda:N)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"{given}, but no CUDA device is visible to this process: use {option} auto or cpu")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{given}, but this process sees {count} CUDA device{'s' if count > 1 else ''} "
                              f"(cuda:0 to cuda:{count - 1})")
    return device



def training_device(train, parallel, mesh) -> torch.device:
    """The device of this training rank (`train.device`; under torchrun each rank its local GPU), with the
    parallel settings only GPUs can run refused elsewhere before a run claims its directory: on the CPU they
    would fail once the engine is built, as a traceback on every rank (and a single process, which never
    reduces, would not say it ignored them). So are train.compile on a CPU without a C++ compiler, bf16 on a
    GPU without bf16 arithmetic, and an attention kernel (train.attention) the device or precision lacks."""
    device = pick_device(train.device)
    if device.type == "cuda" and mesh.world > 1:
        device = torch.device("cuda", mesh.local_rank)
    if train.precision == "bf16" and device.type == "cuda" and not torch.version.hip:
        _check_bf16(device)
    _check_attention(train.attention, train.precision, device.type)
    for key in ("reduce_algo", "pp_transfer"):
        if getattr(parallel, key) == "copy_engine" and device.type != "cuda":
            raise ConfigError(f"parallel.{key} = 'copy_engine' needs CUDA GPUs (peer-to-peer copies), and this "
                              f"run is on {device.type}: use parallel.{key} auto")
    if train.compile and device.type == "cpu":
        _check_cpp_compiler()
    return device


def _check_bf16(device: torch.device) -> None:
    """bf16 arithmetic came with compute capability 8.0 (A100, RTX 30xx): on a V100 or a T4 torch emulates some of
    it, slowly, and the Triton kernels (the fused AdamW, compiled blocks) may not build at all; the gpt2-124m and
    larger presets train in bf16."""
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ConfigError(f"train.precision = 'bf16' needs a GPU with bf16 arithmetic (compute capability 8.0 or "
                          f"newer: A100, H100, RTX 30xx and later), and {torch.cuda.get_device_name(device)} is "
                          f"{major}.{minor}: "
                          "use train.precision fp16 (with dynamic loss scaling) or fp32")


def _check_attention(backend: str, precision: str, device_type: str) -> None:
    """A kernel that cannot take the run's tensors ended its first step in SDPA's "No viable backend" traceback
    (model.set_attention allows that kernel alone): cuDNN's and the memory-efficient ones are CUDA's, and
    FlashAttention's and cuDNN's take fp16 and bf16 only on a GPU."""
    key = f"train.attention = {backend!r}"
    if device_type == "cpu" and backend in ("cudnn", "efficient"):
        raise ConfigError(f"{key} is a CUDA kernel, and this run is on the CPU: use train.attention auto, flash "
                          "or math")
    if device_type == "cuda" and backend in ("flash", "cudnn") and precision == "fp32":
        raise ConfigError(f"{key} takes fp16 and bf16 only, and train.precision is 'fp32': use train.precision bf16, "
                          "or train.attention auto or efficient")


def _check_cpp_compiler() -> None:
    """Inductor builds compiled blocks' CPU kernels with the system's C++ compiler ($CXX, else g++): without one
    (a slim container image) the first step ended in InductorError's traceback, the run's directory claimed. The
    presets that compile (gpt2-124m, llama2-7b, ...) train on the CPU where there is no GPU."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another PyTorch's layout: its own error, at the first step, says it
        return
    try:
        get_cpp_compiler()
    except (RuntimeError, OSError) as e:  # torch's InvalidCxxCompiler
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"train.compile = true on the CPU needs a C++ compiler to build its kernels, and none was "
                          f"found ({why}): install one (g++, e.g. apt-get install g++, or name it in CXX), or set "
                          "train.compile false") from None

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
