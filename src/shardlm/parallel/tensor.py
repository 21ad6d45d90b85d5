"""Megatron tensor parallelism (Shoeybi et al. 2019, "Megatron-LM") with sequence parallelism (Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models"), as a transform of the
one-device model (`tensor_parallel`), the way torchtitan's `parallelize_llama` applies its plan.

Each block's attention and MLP become a column-parallel linear (output features split: each rank holds its
heads' q, k and v, its slice of gate and of up) followed by a row-parallel one (input features split), so
a block needs one all-reduce of activations in forward (`reduce_from_tp`, Megatron's g) and one in
backward (`copy_to_tp`, f). The vocabulary is split too: a vocab-parallel embedding (padded to a
multiple of the degree) and a vocab-parallel cross-entropy (cross_entropy.py) that never gathers logits.
With sequence parallelism (`parallel.sp`) the norms and residuals hold only this rank's slice of the
sequence: the all-reduces become an all-gather along the sequence before each column-parallel linear and
a reduce-scatter after each row-parallel one (the same bytes), and activations outside the linears take
1/tp of the memory. It applies in training mode; evaluation and generation run the plain
tensor-parallel path on the same weights (a single generated token cannot be split). async_tp.py fuses
these collectives with their matmuls.

Every parameter carries its sharding (placement.py's `TPSharding`, on its module), which says how the full
tensor maps to the local one: initialisation draws the full tensor and keeps the rank's slice (a tp = 2 run starts from
exactly the tp = 1 model), checkpoints gather and re-split by name, and the gradient norm counts an
element held by several ranks once. A parameter whose gradient each rank only partly computes (the
norms, row-parallel biases and position embeddings under sequence parallelism, where each rank sees its
tokens only; key/value heads kept whole on every rank when there are fewer than the ranks) has those
gradients summed over the group as autograd produces them (`sum_partial_gradients`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm.collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..model import gemv
from ..model.moe import MoE
from ..model.weight_grad import WeightGradStore, adapted_linear
from .cross_entropy import vocab_parallel_cross_entropy
from .placement import TPSharding, degree, rank_in, replicated, tag


# ---- the collectives around the parallel layers ------------------------------------------------------

# `fusable`: written as torch's functional all_gather_tensor / reduce_scatter_tensor decompose a sequence
# dimension (chunks joined by cat), the form inductor's async-TP pass fuses with the matmul beside it
# (async_tp.py). Otherwise, at b == 1, views that copy nothing; at b > 1 the sequence slices are not
# contiguous, so one copy is needed either way, and cat is that copy.

def _seq_all_gather(x: torch.Tensor, group, fusable: bool = False) -> torch.Tensor:
    """[b, s, h] slices of the sequence -> [b, tp s, h] on every rank."""
    tp = degree(group)
    buf = _gathered(x, group)
    if fusable or x.shape[0] > 1:
        return torch.cat(buf.chunk(tp), dim=1)
    return buf.view(1, tp * x.shape[1], *x.shape[2:])


def _seq_reduce_scatter(x: torch.Tensor, group, fusable: bool = False) -> torch.Tensor:
    """[b, S, h] partial sums -> this rank's [b, S / tp, h] slice of their sum."""
    tp = degree(group)
    b, s = x.shape[0], x.shape[1] // tp
    if fusable or b > 1:
        src = torch.cat(x.chunk(tp, dim=1))  # [tp b, s, h]: rank r's slice of every sequence at r b
    else:
        src = x.contiguous().view(tp, s, *x.shape[2:])
    out = torch.empty((b, s, *x.shape[2:]), dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out, src, group=group)  # slices along dim 0
    # A view, not `out` itself: torch 2.11's AOTAutograd gives an autograd.Function's output that is the
    # buffer a traced in-place collective filled a zero gradient, so a compiled block's weights got none.
    return out.view(out.shape)


def _gathered(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x`, stacked along dimension 0 (rank order): [tp x.shape[0], ...]."""
    buf = torch.empty((degree(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into_tensor(buf, x.contiguous(), group=group)
    return buf


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity in forward, all-reduce of the input gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce of partial sums in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """Sequence parallelism's f: all-gather along the sequence in forward, reduce-scatter in backward."""

    @staticmethod
    def forward(ctx, x, group, fusable):
        ctx.group, ctx.fusable = group, fusable
        return _seq_all_gather(x, group, fusable)

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.group, ctx.fusable), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter along the sequence in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx, x, group, fusable):
        ctx.group, ctx.fusable = group, fusable
        return _seq_reduce_scatter(x, group, fusable)

    @staticmethod
    def backward(ctx, grad):
        return _seq_all_gather(grad, ctx.group, ctx.fusable), None, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension (the vocabulary's logits) in forward, the local slice in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.cat(_gathered(x, group).chunk(degree(group)), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(degree(ctx.group), dim=-1)[rank_in(ctx.group)].contiguous(), None


def copy_to_tp(x, group):
    return x if degree(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if degree(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sp(x, group, fusable: bool = False):
    return x if degree(group) == 1 else _GatherFromSP.apply(x, group, fusable)


def reduce_scatter_to_sp(x, group, fusable: bool = False):
    return x if degree(group) == 1 else _ReduceScatterToSP.apply(x, group, fusable)


# ---- the parallel layers -----------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):

    """y = x A^T with A's rows (output features) split over the group, each fused component (`parts`: q, k,
    v; gate, up) on its own, so rank r holds [q_r; k_r; v_r], never one contiguous block of the fused
    matrix (that would give one rank all of q). A component `whole` stays complete on every rank (key and
    value heads fewer than the ranks); its rows' gradients are partial, and summed. `pad` zero rows
    (split with the last part) make an undivisible output size divisible."""
    weight_grads: WeightGradStore | None = None  # a zero-bubble schedule's deferral of dW (model/weight_grad.py)
    async_tp = False  # the sequence all-gather fusable with this matmul (async_tp.py)

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool, group, sequence_parallel: bool,
                 init_std: float, whole: tuple[bool, ...] | None = None, pad: int = 0):
        super().__init__()
        whole = whole or (False,) * len(parts)
        if list(whole) != sorted(whole):
            raise ValueError(f"whole parts must come last (their rows' gradients are summed from a row on): {whole}")
        self.group, self.sequence_parallel, self.init_std = group, sequence_parallel, init_std
        self.lora = None
        spec = TPSharding(rank_in(group), degree(group), 0, tuple(parts), tuple(not w for w in whole), pad)
        rows = sum(spec.local_sizes())
        self.weight = nn.Parameter(torch.empty(rows, in_features))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        first_whole = sum(n for n, w in zip(spec.local_sizes(), whole) if not w) if any(whole) else None
        partial = {} if first_whole is None else {n: first_whole for n in ("weight", "bias") if getattr(self, n) is not None}
        tag(self, {n: spec for n in ("weight", "bias") if getattr(self, n) is not None}, partial)

    def forward(self, x):
        if self.sequence_parallel and self.training:
            x = gather_from_sp(x, self.group, self.async_tp)
        else:
            x = copy_to_tp(x, self.group)
        # adapters: this rank's rows of their update
        return adapted_linear(x, self.weight, self.bias, self.weight_grads, self.lora)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q, k, v linear where the key/value heads are fewer than the ranks: every rank computes them
    all (`whole`) and emits, after its query heads, the key/value head each of those reads, so its attention
    sees one key/value head per query head, as an ungrouped model's does (`heads`: the output heads in order)."""

    def __init__(self, in_features: int, parts: tuple[int, ...], bias: bool, group, sequence_parallel: bool,
                 init_std: float, head_dim: int, heads: list[int]):
        super().__init__(in_features, parts, bias, group, sequence_parallel, init_std, whole=(False, True, True))
        self.head_dim, self.heads = head_dim, heads

    def forward(self, x):
        y = super().forward(x)
        return y.unflatten(-1, (-1, self.head_dim))[..., self.heads, :].flatten(-2)


class RowParallelLinear(nn.Module):

    """y = x A^T with A's columns (input features) split: partial sums all-reduced (or reduce-scattered along
    the sequence), the bias added once after."""
    weight_grads: WeightGradStore | None = None
    async_tp = False  # the sequence reduce-scatter fusable with this matmul (async_tp.py)
    small_all_reduce = None  # inference: a faster all-reduce without gradient (inference/one_shot.py)

    def __init__(self, in_features: int, out_features: int, bias: bool, group, sequence_parallel: bool,
                 init_std: float):
        super().__init__()
        self.group, self.sequence_parallel, self.init_std = group, sequence_parallel, init_std
        self.lora = None
        tp, rank = degree(group), rank_in(group)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        shardings = {"weight": TPSharding(rank, tp, 1, (in_features,), (True,))}
        if bias:
            shardings["bias"] = TPSharding(rank, tp)
        tag(self, shardings, {"bias": 0} if bias and sequence_parallel else {})

    def forward(self, x):
        small = self.small_all_reduce is not None and not torch.is_grad_enabled()
        if small and self.lora is None and not (self.sequence_parallel and self.training):
            # the product and its sum, one kernel where it can (inference/gemv_all_reduce.py)
            y = self.small_all_reduce.linear(x, self.weight)
        else:
            # An adapter's partial product joins the base's before their reduction.
            y = adapted_linear(x, self.weight, None, self.weight_grads, self.lora)
            if self.sequence_parallel and self.training:
                y = reduce_scatter_to_sp(y, self.group, self.async_tp)
            elif small:
                y = self.small_all_reduce(y)
            else:
                y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary rows (padded to a multiple of the degree) are split over the group: ids
    outside this rank's rows look up zeros, and the ranks' lookups are summed (reduce-scattered along the
    sequence with sequence parallelism)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group, sequence_parallel: bool):
        super().__init__()
        tp, rank = degree(group), rank_in(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings = num_embeddings
        rows = -(-num_embeddings // tp)
        self.vocab_start = rank * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        tag(self, {"weight": TPSharding(rank, tp, 0, (num_embeddings,), (True,), rows * tp - num_embeddings)})

    small_all_reduce = None  # as RowParallelLinear's

    def forward(self, ids):
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel and self.training:
            return reduce_scatter_to_sp(out, self.group)
        if self.small_all_reduce is not None and not torch.is_grad_enabled():
            return self.small_all_reduce(out)
        return reduce_from_tp(out, self.group)


class SequenceParallelPositions(nn.Module):
    """GPT-2's learned positions under sequence parallelism: the rows of this rank's slice of the sequence
    (the token embeddings arrive sliced). Every rank holds all rows; each computes part of their gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        replicated(self, group, partial=True)

    def forward(self, positions):
        if self.training:
            positions = positions.chunk(degree(self.group), dim=-1)[rank_in(self.group)]  # [t] or [b, t]
        return F.embedding(positions, self.weight)


class VocabParallelOutput(nn.Module):
    """The output head over this rank's vocabulary rows: the vocab-parallel cross-entropy, or the logits
    gathered over the group (padding dropped) where they are asked for."""

    def __init__(self, group, vocab_start: int, vocab_size: int, sequence_parallel: bool):
        super().__init__()
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.sequence_parallel = sequence_parallel

    small_all_gather = None  # inference: a faster all-gather without gradient (inference/one_shot.py)

    def forward(self, h, weight, targets=None, chunk: int = 2048, compiled: bool = False):
        h = gather_from_sp(h, self.group) if self.sequence_parallel and self.training else copy_to_tp(h, self.group)
        if targets is None:
            if self.small_all_gather is not None and not torch.is_grad_enabled():
                return self.small_all_gather(gemv.linear(h, weight))[..., :self.vocab_size]
            return _GatherLastDim.apply(F.linear(h, weight), self.group)[..., :self.vocab_size]
        return vocab_parallel_cross_entropy(h, weight, targets, self.group, self.vocab_start, self.vocab_size,
                                            chunk or targets.numel(), compiled)


# ---- the transform -----------------------------------------------------------------------------------

def tensor_parallel_group(model: nn.Module):
    """The process group of `model`'s tensor-parallel layers; None for a model without them."""
    return next((m.group for m in model.modules() if isinstance(m, RowParallelLinear)), None)


def tensor_parallel(model: nn.Module, group, sequence_parallel: bool = False) -> None:
    """Shard a decoder over `group`, in place, on the meta device (before its weights exist): the linears of
    every block, the embeddings, the head and the loss are replaced by their parallel versions; the norms
    (and GPT-2's positions) stay whole on every rank. Parameter names are those of the one-device model."""
    cfg, tp, sp = model.cfg, degree(group), sequence_parallel
    h, hd, f = cfg.hidden_size, cfg.head_size, cfg.ffn_size
    for block in model.parts().layers:
        attn, mlp = block.attn, block.mlp
        nq, nkv = attn.n_heads, attn.n_kv
        parts, bias = (nq * hd, nkv * hd, nkv * hd), attn.qkv.bias is not None
        attn.n_heads = nq // tp
        if nkv % tp:  # every rank computes all key/value heads and passes on those of its query heads
            kv = [(rank_in(group) * attn.n_heads + j) // (nq // nkv) for j in range(attn.n_heads)]
            heads = list(range(attn.n_heads)) + [attn.n_heads + i for i in kv] + [attn.n_heads + nkv + i for i in kv]
            attn.qkv = QKVParallelLinear(h, parts, bias, group, sp, attn.qkv.init_std, hd, heads)
            attn.n_kv = attn.n_heads
        else:
            attn.qkv = ColumnParallelLinear(h, parts, bias, group, sp, attn.qkv.init_std)
            attn.n_kv = nkv // tp
        attn.out = RowParallelLinear(nq * hd, h, attn.out.bias is not None, group, sp, attn.out.init_std)
        if not isinstance(mlp, MoE):  # a mixture of experts: moe_tensor.py's transform (left whole here)
            up_parts = (f, f) if mlp.gated else (f,)
            mlp.up = ColumnParallelLinear(h, up_parts, mlp.up.bias is not None, group, sp, mlp.up.init_std)
            mlp.down = RowParallelLinear(f, h, mlp.down.bias is not None, group, sp, mlp.down.init_std)
        replicated(block.attn_norm, group, partial=sp)
        replicated(block.mlp_norm, group, partial=sp)
    rows = -(-cfg.vocab_size // tp)  # a pipeline stage may hold the embedding, the head, both or neither
    if model.embed is not None:
        model.embed = VocabParallelEmbedding(cfg.vocab_size, h, group, sp)
    if model.pos_embed is not None:
        model.pos_embed = SequenceParallelPositions(cfg.max_seq_len, h, group) if sp else replicated(model.pos_embed, group)
    if model.norm is not None:
        replicated(model.norm, group, partial=sp)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(h, (cfg.vocab_size,), False, group, sp, model.lm_head.init_std,
                                             pad=rows * tp - cfg.vocab_size)
    if model.output is not None:
        model.output = VocabParallelOutput(group, rank_in(group) * rows, cfg.vocab_size, sp)


def sum_partial_gradients(model: nn.Module, group) -> None:
    """After the weights exist: sum over the group the gradients each rank computes only part of, as
    autograd produces them (before they are accumulated, so every engine sees complete gradients)."""
    for module in model.modules():
        for name, first_row in getattr(module, "partial_grads", {}).items():
            if getattr(module, name).requires_grad:  # frozen (a LoRA run's base): no gradient to sum
                getattr(module, name).register_hook(_summed_from(first_row, group))


def _summed_from(first_row: int, group):
    def hook(grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad[first_row:], group=group)  # rows of a contiguous tensor are contiguous
        return grad
    return hook
