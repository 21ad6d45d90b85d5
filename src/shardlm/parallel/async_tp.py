"""Async tensor parallelism: each sequence-parallel all-gather fused with the matmul that reads it, and each
matmul with the reduce-scatter that follows it, so the transfers of one chunk overlap the matmul of
another (Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models"; PyTorch's micro-pipeline TP, as torchtitan's `enable_async_tensor_parallel`).

Without it every collective of a tensor + sequence parallel block is exposed: the matmul after an
all-gather waits for all of it, and so does the reduce-scatter for its matmul. The fusion is inductor's
post-grad pass (`_micro_pipeline_tp`): it recognises the collectives in the form torch's functional
collectives write a sequence dimension (tensor.py writes them so for layers marked `async_tp`) and
replaces each pair by `symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, which move the
chunks through symmetric memory. It therefore needs compiled blocks, sequence parallelism, and each
tensor-parallel group on the GPUs of one node. Where the pass finds no pair (a row-parallel layer whose
LoRA update joins the partial sums before the reduce-scatter; evaluation, which runs the plain
tensor-parallel path and makes inductor log that it found no pattern), the collective runs unfused.
"""
from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from .tensor import ColumnParallelLinear, RowParallelLinear

# The inductor option that runs the fusion pass when a block compiles (torch.compile(options=...)).
COMPILE_OPTIONS = {"_micro_pipeline_tp": True}


def unavailable(tp: int, device: torch.device) -> str | None:
    """Why async TP cannot run here, or None. Symmetric memory spans one node's GPUs: with tp innermost in
    the mesh, a tp group stays on one node when each node runs a multiple of tp ranks, each of which sees
    the node's GPUs (to map its peers') with peer access between them. Where all that holds, the GPU
    kernels are still refused (NOT_VALIDATED)."""
    if device.type != "cuda":
        return f"CUDA GPUs (the device is {device.type})"
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return "a launch by torchrun (LOCAL_WORLD_SIZE is unset: the ranks on each node are unknown)"
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    if local % tp:
        return f"each node to run a multiple of parallel.tp = {tp} ranks (LOCAL_WORLD_SIZE is {local})"
    gpus = torch.cuda.device_count()
    if gpus < local:
        return (f"each rank to see its node's GPUs ({gpus} visible to {local} ranks a node: "
                "CUDA_VISIBLE_DEVICES hides them)")
    if not all(torch.cuda.can_device_access_peer(i, j) for i in range(local) for j in range(local) if i != j):
        return "peer access between the node's GPUs"
    return NOT_VALIDATED


# Refused on GPUs until the GPU tests pass (tests/test_tensor_parallel.py expects their failure until then,
# and fails once they pass, so that this goes). On 4x H200 with torch 2.11 every pair fused, and the losses
# and gradient norms of a tp 2 run (dp 1 and dp 2) equalled one GPU's, but the weights after three AdamW steps
# left the tolerance the unfused run meets (by how much was not recorded: AdamW amplifies rounding where a
# gradient nearly cancels, and the fused kernels sum in another order), and a tp 4 step of llama2-7b took
# 2.3x the unfused one's (bench/README.md, tenth lease). The CPU tests, with torch's reference kernels in
# place of the fused ones, equal one process.
NOT_VALIDATED = ("fused kernels validated on GPUs: on 4x H200 (torch 2.11) a tp 4 step took 2.3x the unfused "
                 "one's, and the weights after three AdamW steps left the unfused run's tolerance "
                 "(bench/README.md); train with parallel.tp_async = false")


def async_tensor_parallel(model: nn.Module, group) -> dict:
    """Mark the blocks' parallel linears so that their collectives take the fusable form, and give `group`
    symmetric memory (the fused kernels' workspace). Returns the options to compile each block with."""
    from torch.distributed import _symmetric_memory as symm_mem
    for block in model.blocks():
        for layer in block.modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.async_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            # Deprecated since torch 2.9, yet the pass fuses only for a group it enabled (2.11 to 2.13).
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    return dict(COMPILE_OPTIONS)
