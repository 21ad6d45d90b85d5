"""Collectives shared by the data-parallel engines.

`all_gather_into_tensor` / `reduce_scatter_tensor`: torch 2.13 renamed them all_gather_single and
reduce_scatter_single (same signatures, old names deprecated); torch 2.11 has only the old ones.

`start_reduce_scatter` sums equal-sized buckets over the ranks of a group, rank r keeping slice r, in a
dtype that may be wider than the bucket's (16-bit gradients summed in fp32). Two ways to widen:
- "ring": NCCL reduce-scatters an fp32 copy of the bucket, so fp32 values travel: (n-1)/n x 4 bytes
  per element leave each rank.
- "all_to_all": the 16-bit values travel and each rank sums the n copies of its slice in fp32 itself,
  once they have arrived: (n-1)/n x 2 bytes per element, the same fp32 sum rounded once. Half the
  traffic of "ring", and less of the compute slowdown that overlapping traffic causes (on 4 H200s,
  backward overlapped with the reduction slows down about in proportion to the bytes moved).

`CopyEngineAllReduce` ("copy_engine", DDP on GPUs) takes the SMs out of the traffic: the gradient
buckets live in symmetric memory (every rank maps its peers' buffers), and each rank pulls its slice of
every peer's bucket with peer-to-peer copies, which the GPU's copy engines run; sums them in the
reduction dtype (one small kernel); and pulls the peers' summed slices back, with symmetric-memory
barriers between the phases. NCCL's kernels instead hold an SM per channel while they run, and cuBLAS's
persistent GEMMs, one CTA per SM, wait for those SMs: the slowdown measured above. PyTorch's
"low-contention" collectives (torch.distributed._symmetric_memory) work the same way.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
REDUCE_ALGOS = ("all_to_all", "ring", "copy_engine")


def start_reduce_scatter(bucket: torch.Tensor, dtype: torch.dtype, group, algo: str = "all_to_all"):
    """Launch the sum over `group` (two ranks or more) of `bucket` (numel a multiple of the group size),
    reduced in `dtype`. Returns (work, result, keep): after `work.wait()`, `result()` gives this rank's
    summed slice in `dtype`; `keep` holds the buffers the collective uses until it completes."""
    world = dist.get_world_size(group)
    n = bucket.numel() // world
    if bucket.dtype == dtype or algo == "ring":
        src = bucket.to(dtype)
        out = torch.empty(n, dtype=dtype, device=bucket.device)
        return reduce_scatter_tensor(out, src, group=group, async_op=True), (lambda: out), (src, out)
    if algo != "all_to_all":
        raise ValueError(f"unknown reduction algorithm {algo!r}: expected one of {', '.join(REDUCE_ALGOS)}")
    parts = torch.empty_like(bucket)  # row j: rank j's copy of this rank's slice
    work = dist.all_to_all_single(parts, bucket, group=group, async_op=True)
    return work, (lambda: parts.view(world, n).sum(0, dtype=dtype)), (bucket, parts)


class _Done:
    """A collective finished by the side stream at `event`: waiting makes the current stream wait."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)


class CopyEngineAllReduce:
    """Bucketed all-reduce over symmetric memory with copy-engine transfers (see the module docstring).
    `bucket(b)` is bucket b's view of the one symmetric gradient buffer; `launch(b)` queues bucket b's
    reduction on `stream` after the current stream's work and returns a waitable."""

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device, group, reduce_dtype,
                 stream, timeout_s: float):
        if device.type != "cuda":
            raise ValueError("parallel.reduce_algo = 'copy_engine' needs CUDA GPUs (peer-to-peer copies)")
        from torch.distributed import _symmetric_memory as symm_mem
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.numels, self.dtype, self.reduce_dtype, self.stream = numels, dtype, reduce_dtype, stream
        self.timeout_ms = int(timeout_s * 1000)  # a barrier that waits longer traps: no silent hang
        self.buffer = symm_mem.empty(sum(numels), dtype=dtype, device=device)
        self.buffer.zero_()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():  # deprecated (unneeded) from torch 2.9; torch 2.8 needs it
                warnings.simplefilter("ignore")
                enable(group.group_name)
        self.handle = symm_mem.rendezvous(self.buffer, group)

    def bucket(self, b: int) -> torch.Tensor:
        return self.buffer[self.offsets[b]:self.offsets[b] + self.numels[b]]

    def _peer(self, j: int, b: int, start: int, n: int) -> torch.Tensor:
        return self.handle.get_buffer(j, (n,), self.dtype, self.offsets[b] + start)

    def launch(self, b: int):
        h, w, r = self.handle, self.world, self.rank
        n = self.numels[b] // w
        grad = self.bucket(b)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            h.barrier(channel=0, timeout_ms=self.timeout_ms)  # every rank's bucket b is complete
            parts = torch.empty(w, n, dtype=self.dtype, device=grad.device)
            for k in range(w):
                j = (r + k) % w  # ranks start at different peers, spreading the links' load
                parts[j].copy_(self._peer(j, b, r * n, n))
            h.barrier(channel=0, timeout_ms=self.timeout_ms)  # nobody reads a slice about to be overwritten
            grad[r * n:(r + 1) * n].copy_(parts.sum(0, dtype=self.reduce_dtype))
            h.barrier(channel=0, timeout_ms=self.timeout_ms)  # every summed slice is in place
            for k in range(1, w):
                j = (r + k) % w
                grad[j * n:(j + 1) * n].copy_(self._peer(j, b, j * n, n))
            h.barrier(channel=0, timeout_ms=self.timeout_ms)  # peers are done reading this rank's slice
            done = torch.cuda.Event()
            done.record()
        return _Done(done)
