"""Megatron-style tensor-parallel layers (Shoeybi et al. 2019, Megatron-LM).

A ColumnParallelLinear splits the output features over the tensor-parallel group, a RowParallelLinear
splits the input features; a column layer followed by a row layer needs one all-reduce in forward
(`reduce_from_tp`) and one in backward (`copy_to_tp`). VocabParallelEmbedding splits the vocabulary.
With no group (degree 1) every layer is the plain single-device op, which is how the model runs
until tensor parallelism is switched on: the model is built from these layers from the start.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _degree(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _CopyToTP(torch.autograd.Function):
    """Identity in forward, all-reduce of the input gradient in backward (Megatron's `f`)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce of partial sums in forward, identity in backward (Megatron's `g`)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension in forward, keep the local slice in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        return grad.chunk(n, dim=-1)[dist.get_rank(ctx.group)].contiguous(), None


def copy_to_tp(x, group):
    return x if _degree(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if _degree(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    return x if _degree(group) == 1 else _GatherFromTP.apply(x, group)


def _split(n: int, group, what: str) -> int:
    d = _degree(group)
    if n % d:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel degree {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's rows (output features) split over the group; each rank holds out/tp rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group=None,
                 gather_output: bool = False, init_std: float = 0.02):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.init_std = group, gather_output, init_std
        self.weight = nn.Parameter(torch.empty(_split(out_features, group, "out_features"), in_features))
        self.bias = nn.Parameter(torch.empty(self.weight.shape[0])) if bias else None

    def forward(self, x):
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, tp={_degree(self.group)}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """y = x A^T with A's columns (input features) split; partial sums are all-reduced, bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group=None,
                 init_std: float = 0.02):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.init_std = group, init_std
        self.weight = nn.Parameter(torch.empty(out_features, _split(in_features, group, "in_features")))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x):
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, tp={_degree(self.group)}, bias={self.bias is not None}"


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over the group; out-of-shard ids look up zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, init_std: float = 0.02):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group, self.init_std = num_embeddings, embedding_dim, group, init_std
        rows = _split(num_embeddings, group, "vocab_size")
        self.vocab_start = _rank(group) * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))

    def forward(self, ids):
        if _degree(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={_degree(self.group)}"

