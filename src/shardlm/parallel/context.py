"""Context parallelism (Megatron-LM's context parallelism; torchtitan's `context_parallel`): the cp ranks of a
group each hold 1/cp of every sequence, from the embeddings to the loss: a contiguous slice under Ulysses,
chunks i and 2cp-1-i of 2cp under ring attention (the zig-zag layout, for causal load balance). Everything in a block
but attention works token by token, so only attention needs the rest of the sequence: the transform
(`context_parallel`) replaces each attention's core by one that reaches it, Ulysses' all-to-all of heads
(ulysses.py, Jacobs et al. 2023) or ring attention (ring_attention.py, Liu et al. 2023), chosen by
`parallel.cp_comm`, and the model's sequence (model/attention.py's WholeSequence) by this rank's slice
(`ContextParallel`). The parameters are the same on every rank of the group, like data parallelism's, so the
engines reduce gradients over dp x cp (the mesh's `dp+cp` group), and the loss of a micro-batch is the mean
over the group's tokens.

Each rank keeps its tokens' true positions (RoPE, GPT-2's position embeddings; the labels follow the same
cut, `local`, and the loss, a mean over tokens, does not see the order); packed examples' document
masks are computed from the whole sequence's ids, gathered over the group. Under sequence parallelism a
block's qkv already holds the cp slice's whole sequence (sp splits it further outside the linears), so the
two compose.

A mixture of experts routes each token on its own rank, but capacity's queues run along a whole sequence and
the balance loss's shares over a whole micro-batch: each MoE layer gets `SlicedSequences`, whose collectives
over the cp group are an `all_reduce` of the per-expert counts [E] (the balance loss's f, every rank the
micro-batch's) and, under capacity routing, an `all_gather` of the per-sequence counts [sequences, E] (each
rank's queues start where the earlier slices of its sequences left them). Both run in every training forward
of the layer, the first and a recomputed one alike, on every rank of the group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..model.attention import WholeSequence
from ..model.moe import MoE, WholeSequences
from .ring_attention import RingCore, ring_attention
from .ulysses import UlyssesCore


def _gather_sequence(ids: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, s] slices of the sequence -> [b, cp s] on every rank (token ids: no gradient)."""
    parts = [torch.empty_like(ids) for _ in range(cp)]
    dist.all_gather(parts, ids.contiguous(), group=group)
    return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class ContextParallel(WholeSequence):
    """A model's place in its context-parallel group: which part of each sequence this rank holds (the model's
    `sequence`), and how its attention reaches the rest (`comm`: "a2a", Ulysses' exchanges of heads; "p2p",
    ring attention). `zigzag`: the sequence is cut into 2 size chunks and rank i holds chunks i and
    2 size - 1 - i, in that order (ring attention's causal load balance, ring_attention.py); else rank i holds
    chunk i of size."""
    group: object
    rank: int
    size: int
    comm: str = "a2a"
    zigzag: bool = False

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks of each sequence `rank` holds, in the order it holds them (ascending)."""
        return (rank, 2 * self.size - 1 - rank) if self.zigzag else (rank,)

    def indices(self, rank: int, whole: int, device=None) -> torch.Tensor:
        """The positions of `rank`'s tokens in a sequence of `whole` tokens, in the order it holds them."""
        return self.local(torch.arange(whole, device=device), rank)

    def span(self, start: int, length: int) -> tuple[int, int]:
        """(the position of this rank's first token, the whole sequence's length) for its `length` tokens."""
        return start + self.rank * length, self.size * length

    def order(self, whole: int, device) -> torch.Tensor | None:
        """This rank's positions where they do not run on from span's first (zigzag), else None."""
        return self.indices(self.rank, whole, device) if self.zigzag else None

    def whole(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole sequence's token ids from every rank's part."""
        gathered = _gather_sequence(ids, self.group, self.size)
        if not self.zigzag:
            return gathered
        chunks = [None] * (2 * self.size)
        for rank, part in enumerate(gathered.chunk(self.size, dim=1)):
            for chunk, piece in zip(self.chunks(rank), part.chunk(2, dim=1)):
                chunks[chunk] = piece
        return torch.cat(chunks, dim=1)

    def local(self, t: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """This rank's (or `rank`'s) part of a whole-sequence tensor ([b, T] or [T])."""
        pieces = t.chunk(2 * self.size if self.zigzag else self.size, dim=-1)
        held = [pieces[c] for c in self.chunks(self.rank if rank is None else rank)]
        return held[0] if len(held) == 1 else torch.cat(held, dim=-1)

    def ring_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """This rank's queries over the whole sequence, the keys and values passed around the ring
        (parallel/ring_attention.py); `mask`: the whole sequence's, or None for causal attention."""
        return ring_attention(q, k, v, mask, self)


@dataclass(frozen=True)
class SlicedSequences(WholeSequences):
    """A MoE layer's routing statistics over sequences whose slices the cp ranks hold in rank order."""
    group: object
    rank: int
    parts: int

    def total(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.group)
        return counts

    def earlier(self, counts: torch.Tensor) -> torch.Tensor:
        slices = [torch.empty_like(counts) for _ in range(self.parts)]
        dist.all_gather(slices, counts.contiguous(), group=self.group)
        return sum(slices[:self.rank], torch.zeros_like(counts))


def zigzag_layout(comm: str, capacity_factor: float) -> bool:
    """Whether ring attention's zig-zag layout splits the sequences: under ring attention ("p2p"), unless
    capacity routing (an expert's queue runs along each sequence in order, carried from the ranks holding the
    earlier slice: SlicedSequences.earlier) needs each rank's tokens contiguous. Ulysses' ranks each attend
    over the whole sequence: no imbalance to remove."""
    return comm == "p2p" and not capacity_factor


def context_parallel(model: nn.Module, group, comm: str = "a2a") -> None:
    """Split every sequence over `group` (two ranks or more), in place: each attention's core is wrapped by
    Ulysses' exchanges (`comm` "a2a") or replaced by ring attention ("p2p"), and the model's positions and
    masks follow from this rank's part (zigzag_layout's)."""
    context = ContextParallel(group, dist.get_rank(group), dist.get_world_size(group), comm,
                              zigzag_layout(comm, model.cfg.capacity_factor))
    model.sequence = context
    for block in model.parts().layers:
        attn = block.attn
        attn.core = RingCore(attn.core, context) if comm == "p2p" else UlyssesCore(attn.core, group, context.size)
        if isinstance(block.mlp, MoE):
            block.mlp.sequences = SlicedSequences(group, context.rank, context.size)
