"""QLoRA (Dettmers et al. 2023): under LoRA's adapters, the frozen weights of every block linear are stored
as 4-bit NormalFloat with double quantisation and dequantised inside each matmul. The format is torchao's
NF4Tensor: blocks of 64 weights share an absmax scale, and the scales are themselves quantised to int8 in
blocks (of 256 where the weight's size allows), about 4.13 bits per weight instead of 16. It runs on the
CPU as on GPUs, and F.linear takes it as a weight, so the linears need no code of their own.

The checkpoint keeps the base as the model computes with it (dequantised, in the run's dtype), which any
layout and `shardlm export --merge` read; loading quantises it again, which gives back the same 4-bit
codes but block scales that may differ in their last bits (double quantisation is not idempotent), so a
resumed QLoRA run follows the interrupted one closely, not bit for bit.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import LORA_MODULES, NF4_BLOCK, ConfigError
from ..extras import broken_line, import_optional
from ..flat import materialise


def _torchao():
    import logging
    import warnings
    # torchao warns at import about its CUDA kernels (absent on a CPU, unused here) and a deprecated
    # torch.compile registration: nothing a user of NF4 can act on.
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    needs = "lora.quantize = 'nf4'"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import_optional("torchao", "torchao", needs, "lora.quantize = 'nf4' needs torchao: pip install "
                            "'shardlm[qlora]' (or pip install torchao)", ConfigError)
            try:
                from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
            except Exception as first:  # noqa: BLE001 - said below if the older place fails too
                try:
                    from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4  # torchao before 0.15
                except Exception:  # noqa: BLE001 - torchao imports, its NF4 module does not
                    raise ConfigError(broken_line(needs, "torchao", first)) from None
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return NF4Tensor, to_nf4


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def to_nf4(weight: torch.Tensor, name: str = "weight"):
    """`weight` as an NF4Tensor: blocks of 64, scale blocks of the largest size up to 256 that divides the
    number of blocks (torchao requires it to)."""
    _, quantize = _torchao()
    if weight.numel() % NF4_BLOCK:
        raise ConfigError(f"{name} has {weight.numel()} elements, not a multiple of NF4's block of {NF4_BLOCK}: "
                          "lora.quantize = 'nf4' needs layer sizes divisible by 64")
    blocks = weight.numel() // NF4_BLOCK
    scaler_block = max(d for d in range(1, min(256, blocks) + 1) if blocks % d == 0)
    return quantize(weight.detach(), NF4_BLOCK, scaler_block)


def set_nf4(module: nn.Module, value: torch.Tensor, name: str) -> None:
    """`module.weight` frozen, as the NF4 form of `value` (`name` for errors)."""
    module.weight = nn.Parameter(to_nf4(value, name), requires_grad=False)


def quantize_base(model: nn.Module, fill=None) -> None:
    """Replace the weight of every block linear by its NF4 form (after the weights are initialised and
    cast; they are frozen). `fill(name, out)`: the parameters have no storage yet, and each block's are
    filled just before its linears are quantised, so the 16-bit base never exists whole (a 70B model's is
    140 GB); the rest of the model is left to the caller."""
    name_of = {id(m): n for n, m in model.named_modules()}
    for block in model.parts().layers:
        if fill is not None:
            for name, q in block.named_parameters():
                materialise(q, f"{name_of[id(block)]}.{name}", fill)
        for path in LORA_MODULES[model.cfg.arch]:
            base = block.get_submodule(path)
            set_nf4(base, base.weight, f"layers.{block.attn.layer}.{path}.weight")  # global index, any stage


def plain(t: torch.Tensor) -> torch.Tensor:
    """A tensor as it computes: an NF4 weight dequantised."""
    return t.get_original_weight() if is_nf4(t) else t


def base_bytes(model: nn.Module) -> int:
    """Bytes the frozen base weights take, NF4 ones by their codes, scales and their scales' scales."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            continue
        if is_nf4(p):
            total += sum(t.numel() * t.element_size() for t in (p.quantized_data, p.quantized_scalers,
                                                                  p.quantization_factor, p.nf4))
        else:
            total += p.numel() * p.element_size()
    return total
