"""Weight-only quantisation for inference (gpt-fast's int8 and int4): linear layers' weights stored in 8 or 4
bits with per-channel (int8) or per-group (int4) scales, dequantised inside the matrix product, so that
batch-1 decode, bound by reading the weights, reads half or a quarter of the bytes. Activations, embeddings
and norms stay in the model's dtype.

int8 is int8.py's (torchao's scheme, with a Triton product for decode: torchao's own ran slower than bf16).

int4 runs tinygemm's packed kernel on CUDA GPUs (bf16 only, torchao's tile_packed_to_4d format); elsewhere
torchao's unpacked int4 weights, dequantised before the product: the same rounding, none of the speed.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ConfigError
from .int8 import to_int8, unquantised

KINDS = ("none", "int8", "int4")
INT4_GROUPS = (128, 64, 32)  # the largest of these that divides a layer's input is its int4 group


def _torchao():
    import logging
    # torchao warns on import about each optional kernel library this machine's CUDA cannot load (the kernels
    # used here need none of them), and newer torch about the enums torchao registers with pytree.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torchao.quantization as q
    except ImportError:
        raise ConfigError("--quantize needs torchao: pip install torchao (or pip install 'shardlm[qlora]')") from None
    return q


def quantize(model: nn.Module, kind: str) -> int:
    """Quantise the linear layers of `model` in place to `kind` (none, int8, int4); returns how many (int8:
    those of the blocks, the output head stays in 16 bits). The model's dtype must be bf16 for int4 on a
    GPU."""
    if kind not in KINDS:
        raise ConfigError(f"--quantize {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "none":
        return 0
    if kind == "int8":
        return to_int8(model)
    q = _torchao()
    p = next(model.parameters())
    kept = unquantised(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in kept]
    cuda = p.device.type == "cuda"
    if cuda and p.dtype != torch.bfloat16:
        raise ConfigError(f"--quantize int4 runs in bf16 on GPUs (tinygemm's kernel); the model is in "
                          f"{str(p.dtype).removeprefix('torch.')}: pass --dtype bf16")
    left = linears
    for group in INT4_GROUPS:
        chosen = {id(m) for m in left if m.in_features % group == 0}
        left = [m for m in left if id(m) not in chosen]
        if not chosen:
            continue
        if cuda:
            from torchao.quantization.quantize_.workflows.int4.int4_packing_format import Int4PackingFormat
            config = q.Int4WeightOnlyConfig(group_size=group, int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
        else:
            from torchao.quantization.granularity import PerGroup
            config = q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group))
        q.quantize_(model, config, filter_fn=lambda m, _, chosen=chosen: id(m) in chosen)
    if len(left) == len(linears):
        raise ConfigError(f"--quantize int4: none of this model's linear layers can be quantised (int4 needs an "
                          f"input size that a group of {', '.join(map(str, INT4_GROUPS))} divides)")
    return len(linears) - len(left)
