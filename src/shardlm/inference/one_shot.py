"""Tensor-parallel decoding's small all-reduces as one-shot all-reduces over symmetric memory.

A decode step all-reduces a few kilobytes twice a layer (the attention's output and the MLP's), and NCCL's
ring took about 29 us for each inside the step's CUDA graph on two H200s (bench/README.md): more than the
weights' reading at tp 2. The one-shot form is one kernel in which every rank, after a barrier on signal
flags, reads each peer's copy over NVLink and sums them itself: vLLM's and SGLang's custom all-reduce,
TensorRT-LLM's one-shot all-reduce, PyTorch's `symm_mem.one_shot_all_reduce`, which this module calls.

Its input must lie in symmetric memory mapped by every rank, so the partial sums are first copied into a
buffer allocated and exchanged (rendezvous) once, before any CUDA graph is captured: Inductor's own lowering
of the op allocates buffers that are exchanged inside the graphs' memory pool, which fails CUDA graph
trees' check, so the op is called through an operator of shardlm's own. torch's kernel barriers before its
reads and after them, so a rank refills a buffer only once every peer has read it; the all-reduces still
take turns over separate buffers (the row-parallel linears two, the embedding a third, the logits'
all-gather a fourth), which keeps reuse safe under a kernel that barriers only before.

Unlike NCCL's, these barriers have no timeout: a rank whose step failed leaves its peers' GPUs waiting. Every
rank therefore decides together whether to use them (the same shapes, one agreed answer on the hardware),
and NCCL stays where the memory cannot be shared.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..kernels import triton_ok
from .gemv_all_reduce import GemvAllReduce

# Above this the bandwidth-optimal algorithms win (each rank reads every peer's whole buffer here).
MAX_BYTES = 512 * 1024


@torch.library.custom_op("shardlm::one_shot_all_reduce", mutates_args=("buffer",))
def one_shot_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of `x` over the group: staged in `buffer` (symmetric memory, exchanged at its allocation),
    then `symm_mem.one_shot_all_reduce`. An operator of its own so that Inductor calls it as it is: its
    lowering of the symm_mem op copies the input into buffers of its own, exchanged inside the CUDA graphs."""
    staged = buffer[:x.numel()]
    staged.copy_(x.reshape(-1))
    return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group_name).view(x.shape)


@one_shot_all_reduce.register_fake
def _(x, buffer, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("shardlm::one_shot_all_gather", mutates_args=("buffer",))
def one_shot_all_gather(x: torch.Tensor, buffer: torch.Tensor, group_name: str, rank: int, world: int) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension, in rank order: each rank writes its own into its
    place in the zeroed `buffer`, and the one-shot sum of the buffers is the gathered tensor (adding zeros is
    exact)."""
    n = x.shape[-1]
    rows = x.numel() // n
    staged = buffer[:rows * world * n]
    staged.zero_()
    staged.view(rows, world, n)[:, rank].copy_(x.reshape(rows, n))
    out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group_name)
    return out.view(*x.shape[:-1], world * n)


@one_shot_all_gather.register_fake
def _(x, buffer, group_name, rank, world):
    return x.new_empty(*x.shape[:-1], world * x.shape[-1])


class OneShotAllReduce:
    """Sums a tensor over `group` by `symm_mem.one_shot_all_reduce` through the symmetric `buffer`; a tensor
    larger than it goes to NCCL. `linear(x, w)`: a row-parallel product and its sum, one kernel for one row
    (`fused`, gemv_all_reduce.py, through its buffer `turn`)."""

    def __init__(self, buffer: torch.Tensor, group, fused: GemvAllReduce | None = None, turn: int = 0):
        self.buffer, self.group, self.fused, self.turn = buffer, group, fused, turn

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.fits(x, w):
            return self.fused(x, w, self.turn)
        return self(F.linear(x, w))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer
        if x.numel() > buf.numel() or x.dtype != buf.dtype or not aligned(x.numel(), x):
            x = x.contiguous()
            dist.all_reduce(x, group=self.group)
            return x
        return one_shot_all_reduce(x.contiguous(), buf, self.group.group_name)


class OneShotAllGather:
    """Gathers a tensor along its last dimension over `group` by `one_shot_all_gather` through the symmetric
    `buffer`; a tensor whose gathered size exceeds it goes to NCCL."""

    def __init__(self, buffer: torch.Tensor, group):
        self.buffer, self.group = buffer, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() * self.world
        if n > self.buffer.numel() or x.dtype != self.buffer.dtype or not aligned(n, x):
            parts = [torch.empty_like(x) for _ in range(self.world)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            return torch.cat(parts, dim=-1)
        return one_shot_all_gather(x.contiguous(), self.buffer, self.group.group_name, self.rank, self.world)


def aligned(numel: int, like: torch.Tensor) -> bool:
    """Whether `numel` elements of `like`'s dtype fill whole 4-byte words, as torch's kernel requires (an odd
    count of bf16 logits at an odd tp degree does not)."""
    return numel * like.element_size() % 4 == 0


def agreed(ok: bool, group) -> bool:
    """Whether `ok` holds on every rank of `group` (a collective over the GPUs)."""
    flag = torch.tensor([int(ok)], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def peers_mapped(group) -> bool:
    """Whether every rank of `group` holds a GPU of this host that this process sees and can read directly
    (NVLink or PCIe peer access): what symmetric memory needs. GPUs are told apart by their UUIDs, since
    ranks that each see one GPU all call it device 0. A collective, every rank the same answer."""
    def uuid(i: int) -> str:
        return str(getattr(torch.cuda.get_device_properties(i), "uuid", i))

    mine = torch.cuda.current_device()
    here = (socket.gethostname(), uuid(mine))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, here, group=group)
    seen = {uuid(i): i for i in range(torch.cuda.device_count())}
    ok = all(host == here[0] and d in seen and (seen[d] == mine or torch.cuda.can_device_access_peer(mine, seen[d]))
             for host, d in everyone)
    return agreed(ok, group)


def use_one_shot(model: torch.nn.Module, rows: int, one_shot: bool | None = None) -> bool:
    """Give `model`'s row-parallel linears and vocab-parallel embedding one-shot all-reduces, and its
    vocab-parallel head a one-shot all-gather of the logits, for up to `rows` rows of one token (a decode
    step's) where they pay: on GPUs that map each other's memory, in bf16 or fp32 (the kernel's types), for
    at most MAX_BYTES each; `one_shot` True insists (an error where it cannot), False takes NCCL. Returns
    whether they were given. A collective for a tensor-parallel model: every rank calls it with the same
    arguments."""
    from ..parallel.tensor import RowParallelLinear, VocabParallelEmbedding, VocabParallelOutput
    # in the order they run: the embedding's, then each block's attention's and MLP's
    layers = [m for m in model.modules() if isinstance(m, (VocabParallelEmbedding, RowParallelLinear))]
    heads = [m for m in model.modules() if isinstance(m, VocabParallelOutput)]
    for layer in layers:
        layer.small_all_reduce = None
    for head in heads:
        head.small_all_gather = None
    if one_shot is False or (not layers and one_shot is None):
        return False
    if not layers:
        raise RuntimeError("one-shot all-reduces asked for, but the model is not tensor-parallel")
    weight = layers[0].weight
    # the hidden size: a row-parallel linear's output, and the embedding's
    numel = rows * max(m.weight.shape[0] for m in layers if isinstance(m, RowParallelLinear))
    why = ("not on a GPU" if weight.device.type != "cuda" else
           f"{weight.dtype} is not bf16 or fp32" if weight.dtype not in (torch.bfloat16, torch.float32) else
           f"{rows} rows exceed {MAX_BYTES} bytes" if numel * weight.element_size() > MAX_BYTES else
           "the GPUs do not map each other's memory" if not peers_mapped(layers[0].group) else None)
    if why is not None:
        if one_shot:
            raise RuntimeError(f"one-shot all-reduces asked for, but {why}")
        return False
    group = layers[0].group
    world = dist.get_world_size(group)
    vocab = max((rows * -(-head.vocab_size // world) * world for head in heads), default=0)
    if vocab * weight.element_size() > MAX_BYTES:  # the logits' all-gather stays NCCL's
        vocab = 0
    rows_parallel = [m for m in layers if isinstance(m, RowParallelLinear)]
    max_n = max(m.weight.shape[0] for m in rows_parallel)
    buffers = symmetric_buffers([numel] * 3 + ([vocab] if vocab else []) + [2 * world * max_n] * 2, weight, group)
    if buffers is None:
        if one_shot:
            raise RuntimeError("one-shot all-reduces asked for, but a rank could not allocate symmetric memory")
        return False
    # One row's product and sum in one kernel (gemv_all_reduce.py) where every rank can run Triton.
    fused = GemvAllReduce(buffers[-2:], max_n, group) if agreed(triton_ok(weight), group) else None
    for i, layer in enumerate(rows_parallel):
        layer.small_all_reduce = OneShotAllReduce(buffers[i % 2], group, fused, i % 2)
    for layer in layers:
        if isinstance(layer, VocabParallelEmbedding):
            layer.small_all_reduce = OneShotAllReduce(buffers[2], group)
    for head in heads if vocab else ():  # the logits: after the last block's all-reduce, before the embedding's
        head.small_all_gather = OneShotAllGather(buffers[3], group)
    return True


def fused_check(model: torch.nn.Module):
    """The check (GemvAllReduce.check) of the one-row product and all-reduce kernel that use_one_shot gave
    `model`'s row-parallel linears, else None: to run after a decode step's tokens reach the host, so that a
    sum its kernel gave up on raises rather than passing on wrong tokens."""
    return next((m.small_all_reduce.fused.check for m in model.modules()
                 if getattr(getattr(m, "small_all_reduce", None), "fused", None) is not None), None)


def symmetric_buffers(sizes: list[int], like: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Symmetric buffers of at least `sizes` elements of `like`'s dtype on its device (rounded up to 8: whole
    16-byte vectors), exchanged over `group` and each used once, outside any CUDA graph (the op's first call
    on a buffer allocates, in torch 2.11); None on every rank where one could not allocate them."""
    from torch.distributed import _symmetric_memory as symm_mem
    try:
        buffers = [symm_mem.empty(-(-n // 8) * 8, dtype=like.dtype, device=like.device) for n in sizes]
    except RuntimeError:  # a driver or container without the memory-sharing handles symmetric memory needs
        buffers = None
    if not agreed(buffers is not None, group):
        return None
    for buf in buffers:
        symm_mem.rendezvous(buf, group.group_name)
        torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)
        # a CUDA graph may then write into it: its address never changes
        torch._dynamo.mark_static_address(buf)
    return buffers
