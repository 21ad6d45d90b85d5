"""The decoder's own KV cache for incremental decoding (one prefill, then a token per step, every row at the
same position), as Hugging Face's dynamic cache works: what the simple decoder (inference/reference.py) uses
on any layout. The fast path keeps a static cache of slots instead (inference/slots.py).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig


class KVCache:
    """Preallocated keys and values per layer for incremental decoding: one prefill, then a token per step.
    `kv_heads`: the key/value heads each layer computes here (Decoder.cache_heads)."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype, kv_heads: int | None = None):
        shape = (batch, kv_heads or cfg.kv_heads, max_len, cfg.head_size)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.pos = 0
        self.max_len = max_len

    def update(self, layer: int, k, v):
        start, end = self.pos, self.pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]
