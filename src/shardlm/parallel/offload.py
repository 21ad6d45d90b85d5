"""Optimizer offload (Ren et al. 2021, "ZeRO-Offload"): the fp32 master weights and the optimizer's moments
live in CPU memory and the update runs on the CPU; only 16-bit weights and gradients stay on the GPU.

Each step copies this rank's gradient shards into one persistent fp32 host buffer (pinned where there is
a GPU: a fresh allocation per step would page-fault its way through gigabytes, and a pageable target
makes the copy synchronous), scales them there, runs torch's vectorised CPU AdamW kernel on
`parallel.offload_threads` threads (default: this rank's share of the cores), writes the updated 16-bit
shard into pinned staging memory and copies it back to wherever the engine keeps the weights.
Parameter offload (ZeRO-3's 16-bit shards on the CPU too) is a placement choice of parallel/zero3.py.
"""
from __future__ import annotations

import os

import torch

from ..optim import MasterWeightOptimizer


def offload_threads(requested: int) -> int:
    """Threads for the CPU optimizer step: as asked, else this rank's share of the cores it may run on
    (torchrun sets OMP_NUM_THREADS=1 per rank, which would leave the offloaded step on one core)."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class OffloadedOptimizer(MasterWeightOptimizer):
    offloaded = True

    def __init__(self, *args, threads: int = 0, **kwargs):
        torch.set_num_threads(offload_threads(threads))
        super().__init__(*args, **kwargs)
        self.host_grad = torch.empty(self.total, dtype=torch.float32, pin_memory=torch.cuda.is_available())

    def _apply(self, lr: float, grads: list, params: list, scale: torch.Tensor, skip: torch.Tensor) -> None:
        host = [self.host_grad[o:o + n] for o, n in zip(self.master_off, self.shard_len)]
        for h, g in zip(host, grads):
            h.copy_(g, non_blocking=True)
        scale, skip = scale.cpu(), skip.cpu()  # waits for the copies above too
        for h in host:
            h.mul_(scale)
        staged = [None if p is None else torch.empty(p.shape, dtype=p.dtype, pin_memory=p.is_cuda) for p in params]
        super()._apply(lr, host, staged, torch.ones(()), skip)
        for dst, src in zip(params, staged):
            if dst is not None:
                dst.copy_(src, non_blocking=True)


def sharded_optimizer(flat, cfg, scaler, group, initial_shards=None, params_kept: bool = True) -> MasterWeightOptimizer:
    """ZeRO's optimizer over this rank's 1/N of every bucket: on the GPU, or on the CPU with
    `parallel.offload` optimizer or params."""
    if cfg.parallel.offload == "none":
        return MasterWeightOptimizer(flat, cfg.train, scaler, group, shard=True, initial_shards=initial_shards,
                                     params_kept=params_kept)
    return OffloadedOptimizer(flat, cfg.train, scaler, group, shard=True, initial_shards=initial_shards,
                              threads=cfg.parallel.offload_threads)
