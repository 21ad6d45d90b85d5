"""Context parallelism by Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses"; ring attention, the other way, is
parallel/ring_attention.py, chosen by `parallel.cp_comm`): the cp ranks of a group each hold a
contiguous 1/cp of every sequence, from the embeddings to the loss. Everything in a block but attention
works token by token, so only attention needs the rest of the sequence: before it, one all-to-all of q, k
and v together trades the split of the sequence for a split of the heads (each rank then attends over the
whole sequence with 1/cp of the heads, causal and windowed masks as on one device), and one all-to-all
after it trades them back. The parameters are the same on every rank of the group, like data parallelism's,
so the engines reduce gradients over dp x cp (the mesh's `dp+cp` group), and the loss of a micro-batch is the
mean over the group's tokens.

Each rank keeps its tokens' true positions (RoPE, GPT-2's position embeddings); packed examples' document
masks are computed from the whole sequence's ids, gathered over the group. With tensor parallelism the
heads split first over tp, then over cp (cp must divide each tensor-parallel rank's query heads); key/value
heads that cp does not divide are repeated, as few times as their grouping allows, before the exchange.
Under sequence parallelism a block's qkv already holds the cp slice's whole sequence (sp splits it further
outside the linears), so the two compose.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import exchanged_kv_heads
from .ring_attention import ring_attention

# ---- the exchanges -------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk j of `x` (dimension 0, one chunk per rank) to rank j; returns the chunks received, stacked in
    rank order along dimension 0."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, heads, s, d] (this rank's slice of the sequence, all heads) -> [b, heads / cp, cp s, d] (this rank's
    heads, the whole sequence in rank order)."""
    b, n, s, d = x.shape
    chunks = x.reshape(b, cp, n // cp, s, d).transpose(0, 1)  # [cp, b, n/cp, s, d]: chunk j for rank j
    got = _all_to_all(chunks, group)  # got[j]: rank j's slice of the sequence, for this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s, d)


def _heads_to_seq(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of _seq_to_heads: [b, heads / cp, cp s, d] -> [b, heads, s, d]."""
    b, n, t, d = x.shape
    chunks = x.reshape(b, n, cp, t // cp, d).permute(2, 0, 1, 3, 4)  # [cp, b, n, s, d]: sequence slice j for rank j
    got = _all_to_all(chunks, group)  # got[j]: rank j's heads, for this rank's slice of the sequence
    return got.transpose(0, 1).reshape(b, cp * n, t // cp, d)


class _Exchange(torch.autograd.Function):
    """Ulysses' all-to-all, from the sequence split to the heads split (`to_heads`, before attention) or back
    (after it); its backward is the same exchange the other way, on the gradient."""

    @staticmethod
    def forward(ctx, x, group, cp: int, to_heads: bool):
        ctx.group, ctx.cp, ctx.to_heads = group, cp, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.group, ctx.cp), None, None, None


def _gather_sequence(ids: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, s] slices of the sequence -> [b, cp s] on every rank (token ids: no gradient)."""
    parts = [torch.empty_like(ids) for _ in range(cp)]
    dist.all_gather(parts, ids.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ---- the transform -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextParallel:
    """A model's place in its context-parallel group: which slice of each sequence this rank holds, and how its
    attention reaches the rest (`comm`: "a2a", Ulysses' exchanges of heads below; "p2p", ring attention)."""
    group: object
    rank: int
    size: int
    comm: str = "a2a"

    @property
    def ring(self) -> bool:
        return self.comm == "p2p"

    def ring_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """This rank's queries over the whole sequence, the keys and values passed around the ring
        (parallel/ring_attention.py); `mask`: the whole sequence's, or None for causal attention."""
        return ring_attention(q, k, v, mask, self)

    def heads_in(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q, k, v of this rank's slice of the sequence ([b, heads, s, d]) -> this rank's heads over the whole
        sequence. Key/value heads that do not divide by cp are first repeated as few times as makes them
        (config.exchanged_kv_heads), each query head still reading its own."""
        heads = exchanged_kv_heads(q.shape[1], k.shape[1], self.size)
        if heads != k.shape[1]:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        # One exchange for the three: each rank's chunk of the joined heads is its q, k and v heads together.
        b, _, s, d = q.shape
        cp, sizes = self.size, [t.shape[1] // self.size for t in (q, k, v)]
        joined = torch.cat([t.reshape(b, cp, n, s, d) for t, n in zip((q, k, v), sizes)], dim=2)
        out = _Exchange.apply(joined.view(b, cp * sum(sizes), s, d), self.group, cp, True)
        return out.split(sizes, dim=1)

    def heads_out(self, y: torch.Tensor) -> torch.Tensor:
        """Attention's output for this rank's heads over the whole sequence -> all heads over its slice."""
        return _Exchange.apply(y, self.group, self.size, False)

    def whole(self, ids: torch.Tensor) -> torch.Tensor:
        """The whole sequence's token ids from every rank's slice."""
        return _gather_sequence(ids, self.group, self.size)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole-sequence tensor ([b, T] or [T])."""
        return t.chunk(self.size, dim=-1)[self.rank]


def context_parallel(model: nn.Module, group, comm: str = "a2a") -> None:
    """Split every sequence over `group` (two ranks or more): the model's attention exchanges heads for
    sequence around its core (`comm` "a2a") or passes keys and values around the ring ("p2p"), and its
    positions and masks follow from this rank's slice."""
    context = ContextParallel(group, dist.get_rank(group), dist.get_world_size(group), comm)
    model.context = context
    for block in model.parts().layers:
        block.attn.context = context
