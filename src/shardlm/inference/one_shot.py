"""Tensor-parallel decoding's small all-reduces as one-shot all-reduces over symmetric memory.

A decode step all-reduces a few kilobytes twice a layer (the attention output and the MLP's), and NCCL's
ring takes about 18 us for each inside a CUDA graph on H200s (bench/README.md, fourteenth lease): a fifth of
a token's time at tp 2. The one-shot form is one kernel in which every rank, after a barrier on signal
flags, reads each peer's buffer over NVLink and sums them itself: vLLM's custom all-reduce, TensorRT-LLM's
one-shot all-reduce, PyTorch's `symm_mem.one_shot_all_reduce`. Inductor lowers a compiled all-reduce to the
latter when its input fits `_collective.one_shot_all_reduce_threshold_bytes` (128 KiB: 16 rows of a 4096
hidden size in bf16) and the group has symmetric memory; this module turns both on where every rank of the
group can map every other's memory, which all ranks agree on so that none waits in a collective the
others do not run.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def tensor_parallel_group(model: torch.nn.Module):
    """The process group of `model`'s tensor-parallel layers; None for a model without them."""
    from ..parallel.tensor import RowParallelLinear
    return next((m.group for m in model.modules() if isinstance(m, RowParallelLinear)), None)


def peers_mapped(group) -> bool:
    """Whether every rank of `group` holds a GPU of this host that can read each other rank's GPU directly
    (NVLink or PCIe peer access): what symmetric memory needs. A collective: every rank of the group calls
    it, and all get the same answer."""
    import socket
    here = (socket.gethostname(), torch.cuda.current_device())
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    same_host = all(host == here[0] for host, _ in everyone)
    mine = here[1]
    ok = same_host and all(d == mine or torch.cuda.can_device_access_peer(mine, d) for _, d in everyone)
    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def decode_compile_options(model: torch.nn.Module, device: torch.device, one_shot: bool | None = None) -> dict:
    """torch.compile's keyword arguments for the decode step on `device`: CUDA graphs on a GPU, and for a
    tensor-parallel model there (`one_shot` None: where its group's GPUs map each other's memory) the
    all-reduces lowered to the one-shot kernel. A collective for tensor-parallel models: every rank calls it."""
    if device.type != "cuda":
        return {}
    group = tensor_parallel_group(model)
    collective = getattr(torch._inductor.config, "_collective", None)
    if group is None or collective is None or not hasattr(collective, "auto_select") or one_shot is False:
        return {"mode": "reduce-overhead"}
    if not peers_mapped(group):
        if one_shot:
            raise RuntimeError("one-shot all-reduces need every tensor-parallel rank's GPU on one host, each "
                               "able to read the others' memory (peer access)")
        return {"mode": "reduce-overhead"}
    from torch.distributed import _symmetric_memory as symm_mem
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            # Deprecated since torch 2.9, yet Inductor lowers to the one-shot kernel only for a group it
            # enabled (2.11 to 2.13).
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    # `mode` and `options` exclude each other: "reduce-overhead" is "triton.cudagraphs" spelled out
    return {"options": {"triton.cudagraphs": True, "_collective.auto_select": True}}
