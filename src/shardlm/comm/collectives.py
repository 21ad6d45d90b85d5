"""Process-group collectives shared by the data-parallel engines and the optimizer.

`all_gather_into_tensor` / `reduce_scatter_tensor`: torch 2.13 renamed them all_gather_single and
reduce_scatter_single (same signatures, old names deprecated); torch 2.11 has only the old ones.

`start_reduce_scatter` sums equal-sized buckets over the ranks of a group, rank r keeping slice r, in a
dtype that may be wider than the bucket's (16-bit gradients summed in fp32). Two ways to widen:
- "ring": NCCL reduce-scatters an fp32 copy of the bucket, so fp32 values travel: (n-1)/n x 4 bytes
  per element leave each rank.
- "all_to_all": the 16-bit values travel and each rank sums the n copies of its slice in fp32 itself,
  once they have arrived: (n-1)/n x 2 bytes per element, the same fp32 sum rounded once. Half the
  traffic of "ring", and less of the slowdown that traffic overlapped with backward causes
  (bench/README.md).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
REDUCE_ALGOS = ("auto", "all_to_all", "ring", "copy_engine")


def copy_engines_reach(group, device: torch.device) -> bool:
    """Whether copy-engine transfers can serve `group`: every rank of the job on this node, on GPUs that
    reach each other peer to peer (symmetric memory spans one node). Every rank decides alike: the inputs
    are the same on all of them."""
    if device.type != "cuda" or group is None or dist.get_world_size(group) < 2:
        return False
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    gpus = torch.cuda.device_count()
    if local is None or local != world or gpus < int(world):
        return False  # several nodes, or GPUs this process cannot see
    return all(torch.cuda.can_device_access_peer(i, j) for i in range(gpus) for j in range(gpus) if i != j)


def resolve_reduce_algo(algo: str, group, device: torch.device) -> str:
    """What `parallel.reduce_algo auto` means here: the copy engines where they reach every rank, the
    all-to-all otherwise."""
    if algo != "auto":
        return algo
    return "copy_engine" if copy_engines_reach(group, device) else "all_to_all"


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
        raise ValueError(f"unknown reduction algorithm {algo!r}: expected all_to_all or ring")
    parts = torch.empty_like(bucket)  # row j: rank j's copy of this rank's slice
    work = dist.all_to_all_single(parts, bucket, group=group, async_op=True)
    return work, (lambda: parts.view(world, n).sum(0, dtype=dtype)), (bucket, parts)
