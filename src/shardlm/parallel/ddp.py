"""DDP (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training").

Gradients are grouped into buckets of about `parallel.bucket_mb` in reverse registration order (the
order backward produces them); on the last micro-step of an accumulation each bucket is all-reduced
asynchronously as soon as its last gradient is accumulated, overlapping the rest of backward. Buckets are
launched strictly in order, so every rank issues the same collectives in the same sequence. Earlier
micro-steps accumulate locally with no communication. How a bucket is summed (`parallel.reduce_algo`:
through the process group, 16-bit gradients in fp32 by default, or by the copy engines on one node's
GPUs) is the transport's business (comm/transport.py); where the reduction goes through slices, it takes
the clipping norm's squares from them as they arrive.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import resolve_reduce_algo
from ..comm.transport import bucket_all_reduce
from .buckets import BucketReadiness, reverse_order_buckets
from .engine import LocalEngine


class DDPEngine(LocalEngine):
    def __init__(self, model: nn.Module, cfg, scaler, group, fill=None, names=None, divisor: int | None = None):
        p = cfg.parallel
        self.group = group
        self.world = dist.get_world_size(group)
        # Buckets padded to a multiple of the world size split into equal reduce-scatter slices.
        super().__init__(model, cfg, scaler, reverse_order_buckets(model, p.bucket_mb, names),
                         pad_multiple=self.world, fill=fill, names=names, divisor=divisor or self.world)
        reduce_dtype = torch.float32 if p.reduce_dtype == "fp32" else self.flat.dtype
        self.algo = resolve_reduce_algo(p.reduce_algo, group, self.flat.device)
        self.transport = bucket_all_reduce(self.flat, group, self.algo, reduce_dtype)
        self.ready = BucketReadiness(self.flat, self.transport.launch)
        self.opt.count_replica_slice(group)  # every rank holds the summed gradient: each counts its slice

    def prepare_backward(self, last: bool) -> None:
        if last:
            self.ready.arm()

    def finish_backward(self, last: bool) -> None:
        if last:
            self.ready.flush()
            self.transport.wait_all()

    def grad_sumsq(self) -> torch.Tensor | None:
        return self.transport.grad_sumsq()
