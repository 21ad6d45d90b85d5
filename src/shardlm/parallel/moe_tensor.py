"""A mixture of experts under tensor parallelism, as Megatron-core runs it with an expert-tensor-parallel size
of 1 (`transformer/moe/token_dispatcher.py`: each tp rank dispatches its own S/tp x B tokens): attention, the
shared expert and its gate are tensor parallel like the rest of the block (the shared expert's linears column-
then row-parallel), the router is replicated, and the routed experts stay whole on every tp rank.

Each tp rank routes a different slice of every sequence through its whole experts, so for the experts the tp
ranks are data-parallel replicas: no token is routed twice.
- With sequence parallelism (`parallel.sp`) the layer's input already is this rank's slice of each sequence.
- Without, every tp rank holds all the tokens. The layer takes this rank's slice (`_Split`, whose backward
  all-gathers the input gradients) and all-gathers the routed outputs (`_Join`, whose backward keeps this
  rank's slice of a gradient every tp rank holds whole). The alternative, every tp rank routing every token,
  would run tp times the experts' FLOPs (k x 3 matmuls of h x f per token) and the ep all-to-alls' bytes to
  save two all-gathers of [tokens, h] per layer (forward and backward), which a dense tensor-parallel MLP's
  all-reduce matches in bytes already; it would also make the experts' gradients tp copies rather than parts.
Evaluation and generation (the plain tensor-parallel path, a single token included) route every token on every
rank: no gradients, the same outputs.

So every gradient of the routed part is partial over tp, as over dp x cp:
- the experts' are summed over their replicas and the tp ranks, the placement's reduce view "edp+tp" (their
  engine's group: ZeRO shards their state over it, the global norm and sharded checkpoints count each element
  once over it), and divided by dp x cp as every group's are;
- the router's (and under sp the shared gate's) are summed over tp as autograd produces them
  (tensor.py's `sum_partial_gradients`), as a norm's are under sequence parallelism;
- the routing statistics span cp x tp slices of each sequence (`TensorParallelSequences` over the mesh's
  "cp+tp" group, slice c tp + t): the balance loss's shares and capacity's queues are one process's, and
  each slice's auxiliary losses are its share of the whole (`summed` = tp), since its router gradient is
  summed over tp, not averaged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model.moe import moe_layers
from .context import SlicedSequences
from .expert import expert_reduce_view
from .placement import DataPlacement, degree, place, rank_in, replicated
from .tensor import ColumnParallelLinear, RowParallelLinear, _gathered


def _gather_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """[..., s, h] slices of the sequence -> [..., tp s, h] on every rank, in rank order."""
    return torch.cat(_gathered(x, group).chunk(degree(group)), dim=-2)


def _slice_tokens(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(degree(group), dim=-2)[rank_in(group)].contiguous()


class _Split(torch.autograd.Function):
    """This rank's slice of tokens every tp rank holds; backward: the slices' gradients gathered, whole."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _slice_tokens(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_tokens(grad, ctx.group), None


class _Join(torch.autograd.Function):
    """Every rank's slice gathered; backward: this rank's slice of the gradient (each tp rank holds it whole,
    as every activation outside the parallel linears without sequence parallelism)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _gather_tokens(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice_tokens(grad, ctx.group), None


@dataclass(frozen=True)
class TensorParallelSequences(SlicedSequences):
    """The routing statistics over the cp x tp slices of each sequence (`group`: the "cp+tp" ranks); without
    sequence parallelism a training forward takes this rank's tp slice and joins the outputs over `tp_group`."""
    tp_group: object = None
    summed: int = 1
    sequence_parallel: bool = False

    def split(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        return x if self.sequence_parallel or not training else _Split.apply(x, self.tp_group)

    def join(self, y: torch.Tensor, training: bool) -> torch.Tensor:
        return y if self.sequence_parallel or not training else _Join.apply(y, self.tp_group)


def moe_tensor_parallel(model: nn.Module, mesh, sequence_parallel: bool) -> None:
    """Every MoE layer of `model` made tensor parallel over the mesh's tp group (the module docstring), on the
    meta model, after tensor.py's `tensor_parallel` and context parallelism, before expert parallelism."""
    tp, group = mesh.size("tp"), mesh.group("tp")
    if tp == 1:
        return
    cfg = model.cfg
    for layer in moe_layers(model):
        if layer.shared is not None:
            f, shared = cfg.shared_expert_ffn_hidden_size, layer.shared
            shared.up = ColumnParallelLinear(cfg.hidden_size, (f, f), False, group, sequence_parallel,
                                             shared.up.init_std)
            shared.down = RowParallelLinear(f, cfg.hidden_size, False, group, sequence_parallel, shared.down.init_std)
            replicated(layer.shared_gate, group, partial=sequence_parallel)
        replicated(layer.router, group, partial=True)
        for linear in (layer.experts.up, layer.experts.down):
            place(linear, DataPlacement(reduce=expert_reduce_view(tp)))
        layer.sequences = TensorParallelSequences(
            mesh.group("cp+tp"), mesh.coord("cp") * tp + mesh.coord("tp"), mesh.size("cp+tp"), group, tp,
            sequence_parallel)
