"""Flat parameter and gradient buffers: every trainable parameter becomes a view into one contiguous
buffer, and its `.grad` a view into a second one that autograd accumulates into in place.

This is the memory layout of Megatron-LM's DistributedOptimizer, DeepSpeed's ZeRO and PyTorch DDP's
`gradient_as_bucket_view`: the optimizer, the gradient-norm reduction and later the data-parallel
collectives each work on a handful of large contiguous ranges instead of hundreds of tensors.
Parameters that take weight decay (matrices) come first, the rest (norms, biases) after, so each group
is one range. The buffer is padded to a multiple of `pad_multiple` elements, so it splits into equal,
rank-aligned shards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """A range [start, end) of the flat buffer that shares one optimizer setting."""
    start: int
    end: int
    weight_decay: float


class FlatParams:
    def __init__(self, model: nn.Module, weight_decay: float, pad_multiple: int = 1):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"flat buffers need one parameter dtype, found {sorted(map(str, dtypes))}")
        named.sort(key=lambda np_: np_[1].dim() < 2)  # stable: matrices first, in model order
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.offsets, off = [], 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.padded = -(-off // pad_multiple) * pad_multiple
        decay_end = sum(p.numel() for p in self.params if p.dim() >= 2)
        self.segments = [s for s in (Segment(0, decay_end, weight_decay), Segment(decay_end, self.padded, 0.0))
                         if s.end > s.start]
        p0 = self.params[0]
        self.data = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        self.grad = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, o in zip(self.params, self.offsets):
                self.data[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self.data[o:o + p.numel()].view_as(p)
                p.grad = self.grad[o:o + p.numel()].view_as(p)

    def view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a buffer laid out like the flat parameters (a master or state buffer)."""
        o = self.offsets[i]
        return buf[o:o + self.params[i].numel()].view(self.params[i].shape)

    def zero_grad(self) -> None:
        self.grad.zero_()
        # A user (or a library) may have replaced .grad; point it back at the flat buffer.
        for i, p in enumerate(self.params):
            if p.grad is None or p.grad.data_ptr() != self.grad[self.offsets[i]:].data_ptr():
                p.grad = self.view(self.grad, i)

    def check_views(self) -> None:
        for i, p in enumerate(self.params):
            if p.data_ptr() != self.data[self.offsets[i]:].data_ptr():
                raise RuntimeError(f"parameter {self.names[i]} no longer lives in the flat buffer "
                                   "(was the model moved or cast after the optimizer was built?)")
