"""int4's storage format (inference/int4.py's kernels read it): per group of G inputs (128, else 64 or 32) of an
output channel, 16 levels spanning the group's range and 0, a scale in the model's dtype and the level of 0 (an
integer zero point, a byte: the asymmetric scheme of GPTQ's and AWQ's checkpoints), so that the weight is (q -
zero) * scale; the levels packed as int32 words [N/8, K/8, 8], eight consecutive inputs of one output a word and
each block of 8 outputs one contiguous run along K (as the one-row kernel streams it), the scales and zero points
beside them [N/8, K/G, 8].
"""
from __future__ import annotations

import torch
from torch import nn

from .int8 import check_finite

GROUPS = (128, 64, 32)  # the largest of these that divides a layer's input size is its group
BLOCK = 8  # outputs a block of the packed weight (and a program of the one-row kernel)
CHUNK = 2048  # outputs quantised at a time: a 70B layer's fp32 and int32 temporaries stay below a GB


def group_size(k: int) -> int | None:
    """The int4 group of a layer of `k` inputs: the largest of GROUPS dividing it (each a multiple of the 8
    inputs of a word); None where none does, and the layer stays unquantised."""
    return next((g for g in GROUPS if k % g == 0), None)


def eligible(linear: nn.Linear) -> bool:
    """Whether int4 can take the layer: a group divides its inputs and blocks of BLOCK its outputs."""
    return group_size(linear.in_features) is not None and linear.out_features % BLOCK == 0


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (integers 0..15) as int32 words [N/8, K/8, 8]: word (b, r, o) holds q[8b + o, 8r + j] in bits
    4j..4j+3, so each block of 8 outputs is one contiguous run of memory along K."""
    n, k = q.shape
    nibbles = q.reshape(n // BLOCK, BLOCK, k // 8, 8).permute(0, 2, 1, 3).to(torch.int32)
    words = nibbles[..., 0].contiguous()
    for j in range(1, 8):
        words |= nibbles[..., j] << (4 * j)  # the top nibble's 8-15 set the sign bit: the same 32 bits
    return words


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack's inverse: words [N/8, K/8, 8] as q [N, K] (int32, 0..15)."""
    b, r, _ = words.shape
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    q = (words[..., None] >> shifts) & 15  # [N/8, K/8, 8 outputs, 8 inputs]; & 15 drops the sign's bits
    return q.permute(0, 2, 1, 3).reshape(b * BLOCK, r * 8)


def blocked(t: torch.Tensor) -> torch.Tensor:
    """Per-output values [N, C] in pack's order: [N/8, C, 8], each block's run contiguous."""
    n, c = t.shape
    return t.reshape(n // BLOCK, BLOCK, c).transpose(1, 2).contiguous()


def unblocked(t: torch.Tensor) -> torch.Tensor:
    """blocked's inverse: [N/8, C, 8] as [N, C]."""
    b, c, _ = t.shape
    return t.transpose(1, 2).reshape(b * BLOCK, c)


def quantize_weight(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] as (words [N/8, K/8, 8] int32, scale [N/8, K/G, 8] in w's dtype, zero [N/8, K/G, 8] uint8): per
    output and group of `group` inputs, the range [min(w, 0), max(w, 0)] in 15 steps of `scale` (as stored, in
    its dtype), `zero` the level of 0 (an integer: GPTQ's and AWQ's asymmetric scheme), q = round(w / scale) +
    zero in 0..15, so that the weight is (q - zero) * scale."""
    n, k = w.shape
    if group not in GROUPS or k % group or n % BLOCK:
        raise ValueError(f"int4 takes groups of {', '.join(map(str, GROUPS))} inputs and blocks of {BLOCK} "
                         f"outputs: a group of {group} over a [{n}, {k}] weight")
    parts = []
    for i, rows in enumerate(w.detach().split(CHUNK)):
        groups = rows.float().reshape(len(rows), k // group, group)
        low, high = groups.amin(-1).clamp_max(0), groups.amax(-1).clamp_min(0)
        scale = ((high - low) / 15).clamp_min(torch.finfo(w.dtype).tiny).to(w.dtype)
        check_finite(scale, "int4", w.shape, i * CHUNK)
        s = scale.float()[..., None]
        zero = (-low[..., None] / s).round_().clamp_(0, 15)
        q = ((groups / s).round_() + zero).clamp_(0, 15)
        parts.append((pack(q.reshape(len(rows), k)), blocked(scale), blocked(zero[..., 0].to(torch.uint8))))
    return tuple(torch.cat(p) for p in zip(*parts))


def dequantize(words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype | None = None):
    """The weight [N, K] that `words`, `scale` and `zero` stand for, (q - zero) * scale of its group computed
    in fp32 (exactly: a small integer times the scale), in `dtype` (the scale's by default)."""
    q = unpack(words)
    n, k = q.shape
    g = scale.shape[1]
    w = (q.view(n, g, k // g) - unblocked(zero).int()[..., None]) * unblocked(scale).float()[..., None]
    return w.view(n, k).to(dtype or scale.dtype)
