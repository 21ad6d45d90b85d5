"""Ulysses attention (Jacobs et al. 2023, "DeepSpeed Ulysses"; DeepSpeed's `sequence/layer.py`): the core that
context parallelism (context.py) installs around each attention's one-device core when `parallel.cp_comm` is
a2a. Each cp rank holds a contiguous slice of every sequence; one all-to-all of q, k and v together trades that
split of the sequence for a split of the heads, so each rank attends over the whole sequence with 1/cp of the
heads (causal and windowed masks as on one device), and one all-to-all after it trades them back.

With tensor parallelism the heads split first over tp, then over cp (cp must divide each tensor-parallel
rank's query heads); key/value heads that cp does not divide are repeated, as few times as their grouping
allows, before the exchange.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..config import exchanged_kv_heads


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


class UlyssesCore(nn.Module):
    """An attention core over this rank's slice of each sequence (model/attention.py's call): the heads
    exchanged for the sequence around `local`, the one-device core, which keeps its own settings (kernel
    choice, selective recomputation: the exchanges are not recomputed)."""

    def __init__(self, local: nn.Module, group, cp: int):
        super().__init__()
        self.local, self.group, self.cp = local, group, cp

    def forward(self, q, k, v, causal: bool, mask=None):
        """`mask`: the whole sequence's, as on one device."""
        q, k, v = self.heads_in(q, k, v)
        return self.heads_out(self.local(q, k, v, causal, mask))

    def heads_in(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q, k, v of this rank's slice of the sequence ([b, heads, s, d]) -> this rank's heads over the whole
        sequence. Key/value heads that do not divide by cp are first repeated as few times as makes them
        (config.exchanged_kv_heads), each query head still reading its own."""
        heads = exchanged_kv_heads(q.shape[1], k.shape[1], self.cp)
        if heads != k.shape[1]:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        # One exchange for the three: each rank's chunk of the joined heads is its q, k and v heads together.
        b, _, s, d = q.shape
        cp, sizes = self.cp, [t.shape[1] // self.cp for t in (q, k, v)]
        joined = torch.cat([t.reshape(b, cp, n, s, d) for t, n in zip((q, k, v), sizes)], dim=2)
        out = _Exchange.apply(joined.view(b, cp * sum(sizes), s, d), self.group, cp, True)
        return out.split(sizes, dim=1)

    def heads_out(self, y: torch.Tensor) -> torch.Tensor:
        """Attention's output for this rank's heads over the whole sequence -> all heads over its slice."""
        return _Exchange.apply(y, self.group, self.cp, False)
