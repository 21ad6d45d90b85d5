"""Activation offload under full recomputation (DeepSpeed's `cpu_checkpointing`, from ZeRO-R: Rajbhandari et
al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 6.1).

With `train.recompute full` a block keeps one tensor from forward to backward: its input, which its
backward recomputes it from. With `parallel.offload_activations` that input waits in pinned host memory
instead: copied down on a stream of its own while forward goes on, copied back when backward reaches the
block. The GPU then no longer holds layers x micro-batch x sequence x hidden of them, so larger
micro-batches fit, and where gradients are accumulated in host memory (optimizer offload) fewer
micro-batches mean fewer passes over the host's fp32 sum.

The block runs under torch's (non-reentrant) checkpoint, which saves its inputs through autograd's
saved-tensor hooks: hooks around it see exactly the tensors it keeps, its own inner hooks the rest.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


class ActivationOffload:
    """Saved-tensor hooks that keep the tensors a checkpoint saves in host memory (pinned on a GPU:
    the copies run asynchronously on `stream`). On the CPU they keep a copy, so the same path runs there."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def checkpoint(self, block, x: torch.Tensor, *args):
        """`block(x, *args)` recomputed in backward, its input `x` kept in host memory meanwhile."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return checkpoint(block, x, *args, use_reentrant=False)

    def _pack(self, t: torch.Tensor):
        if not t.is_floating_point() or (self.cuda and not t.is_cuda):  # a boolean mask, checkpoint's marker
            return t
        if not self.cuda:
            return t.clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        t.record_stream(self.stream)  # its memory is free for others once the copy has read it
        return t.device, host, copied

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        stream = torch.cuda.current_stream(device)
        stream.wait_event(copied)
        return host.to(device, non_blocking=True)
