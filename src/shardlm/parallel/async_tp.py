"""Async tensor parallelism: each sequence-parallel all-gather fused with the matmul that reads it, and each
matmul with the reduce-scatter that follows it, so the transfers of one chunk overlap the matmul of
another (Wang et al. 2022, "Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models"; PyTorch's micro-pipeline TP, as torchtitan's `enable_async_tensor_parallel`).

Without it every collective of a tensor + sequence parallel block is exposed: the matmul after an
all-gather waits for all of it, and so does the reduce-scatter for its matmul. The fusion is inductor's
post-grad pass (`_micro_pipeline_tp`): it recognises the collectives in the form torch's functional
collectives write a sequence dimension (tensor.py writes them so for layers marked `async_tp`) and
replaces each pair by `symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, which move the
chunks through symmetric memory on the copy engines. It therefore needs compiled blocks, sequence
parallelism and CUDA GPUs of one node.
"""
from __future__ import annotations

import warnings

from torch import nn

from .tensor import ColumnParallelLinear, RowParallelLinear

# The inductor option that runs the fusion pass when a block compiles (torch.compile(options=...)).
COMPILE_OPTIONS = {"_micro_pipeline_tp": True}


def async_tensor_parallel(model: nn.Module, group) -> dict:
    """Mark the blocks' parallel linears so that their collectives take the fusable form, and give `group`
    symmetric memory (the fused kernels' workspace). Returns the options to compile each block with."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    for block in model.parts().layers:
        for layer in block.modules():
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
                layer.async_tp = True
    with warnings.catch_warnings():
        # torch 2.11 deprecates it, but its fusion pass still asks whether the group was enabled.
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(group.group_name)
    return dict(COMPILE_OPTIONS)
