"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-LM's context
parallelism with `cp_comm_type p2p`): the other way to split each sequence over the cp ranks
(`parallel.cp_comm p2p`, beside Ulysses' all-to-all in parallel/ulysses.py; context.py installs either as
each attention's core). Each rank keeps its slice's queries and passes its keys and values around the ring,
one neighbour's chunk per step, while it attends to the chunk it holds; the partial results merge by their
log-sum-exp (the online softmax of flash attention), so no rank holds more than a few chunks of keys and
values at a time, and the heads need not divide by cp.

Backward runs the same ring: each chunk of keys and values travels with the gradient accumulated for it so
far, and after cp steps arrives home with every rank's share added. Blocks that the mask hides entirely (a
later chunk under causal attention) are skipped, their chunk only passed on. As in flash attention (Dao et al.
2022) the matrix products take q, k, v and the probabilities in the inputs' dtype (16-bit on GPUs: the tensor
cores), the softmax, the running sums and the gradients that travel are fp32; QUERY_ROWS queries at a time.
The result has q's dtype.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..config import RING_QUERY_ROWS


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + mask) v for this rank's queries over the whole sequence, whose key/value
    chunks the ranks of `group` hold in rank order. q: [b, h, s, d]; k, v: [b, h_kv, s, d] (h_kv divides h:
    grouped-query attention); `rows`: the whole-sequence mask's rows of this rank's queries, boolean
    [..., s, cp s] (True: attend), or None for causal attention."""

    @staticmethod
    def forward(ctx, q, k, v, rows, group, rank: int, cp: int):
        ring = _Ring(group, rank, cp)
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            chunk = (rank - step) % cp
            incoming = ring.shift(kv) if step < cp - 1 else None  # the next chunk comes in meanwhile
            allowed = _block_mask(rows, rank, chunk, q.shape[2], q.device)
            if allowed is not False:
                kc, vc = (_expand(t, groups) for t in kv)
                for r in _query_rows(q.shape[2]):
                    scores = _scores(q[:, :, r], kc, allowed, r, scale)
                    block_lse = torch.logsumexp(scores, dim=-1)
                    p = torch.exp(scores - _finite(block_lse).unsqueeze(-1))
                    block = (p.to(q.dtype) @ vc).float() / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
                    merged = torch.logaddexp(lse[:, :, r], block_lse)
                    out[:, :, r] = out[:, :, r] * torch.exp(lse[:, :, r] - merged).nan_to_num(0.0).unsqueeze(-1) + \
                        block * torch.exp(block_lse - merged).nan_to_num(0.0).unsqueeze(-1)
                    lse[:, :, r] = merged
            if incoming is not None:
                kv, = incoming.wait()
        ctx.save_for_backward(q, k, v, out, lse, rows if rows is not None else torch.empty(0))
        ctx.ring, ctx.causal = ring, rows is None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, rows = ctx.saved_tensors
        rows = None if ctx.causal else rows
        ring = ctx.ring
        rank, cp = ring.rank, ring.cp
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        delta = (grad.float() * out).sum(-1, keepdim=True)  # softmax's backward: sum_j p_ij dP_ij
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=k.device)  # travels with its chunk
        for step in range(cp):
            chunk = (rank - step) % cp
            # The next chunk of keys and values comes in meanwhile; its gradient follows once computed.
            incoming = ring.shift(kv) if step < cp - 1 else None
            allowed = _block_mask(rows, rank, chunk, q.shape[2], q.device)
            if allowed is not False:
                kc, vc = (_expand(t, groups) for t in kv)
                for r in _query_rows(q.shape[2]):
                    qr, gr = q[:, :, r], grad[:, :, r]
                    p = torch.exp(_scores(qr, kc, allowed, r, scale) - _finite(lse[:, :, r]).unsqueeze(-1))
                    ds = (p * ((gr @ vc.transpose(-1, -2)).float() - delta[:, :, r]) * scale).to(q.dtype)
                    dq[:, :, r] += (ds @ kc).float()
                    dkv[0] += _fold((ds.transpose(-1, -2) @ qr).float(), groups)
                    dkv[1] += _fold((p.to(q.dtype).transpose(-1, -2) @ gr).float(), groups)
            # Every chunk's gradient moves on with it: after cp steps each is home with all ranks' shares.
            dkv, = ring.shift(dkv).wait()
            if incoming is not None:
                kv, = incoming.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


@torch.compiler.disable  # its point-to-point sends stay eager; the block around it compiles
def ring_attention(q, k, v, mask, context) -> torch.Tensor:
    """Attention of this rank's slice of queries over the whole sequence (`context`: parallel/context.py's
    ContextParallel); `mask`: the whole sequence's boolean mask (Decoder.window_mask, packed documents), or
    None for causal attention."""
    s = q.shape[2]
    rows = None if mask is None else mask[..., context.rank * s:(context.rank + 1) * s, :]
    return RingAttention.apply(q, k, v, rows, context.group, context.rank, context.size)


class RingCore(nn.Module):
    """An attention core over this rank's slice of each sequence (model/attention.py's call), by ring
    attention; `local`, the one-device core it replaced, is kept for whole sequences (a KV cache's)."""

    def __init__(self, local: nn.Module, context):
        super().__init__()
        self.local, self.context = local, context

    def forward(self, q, k, v, causal: bool, mask=None):
        """`mask`: the whole sequence's; None: causal (a sliced sequence always is, or is masked)."""
        return ring_attention(q, k, v, mask, self.context)


class _Ring:
    """Sends to the next rank of the group and receives from the previous one."""

    def __init__(self, group, rank: int, cp: int):
        self.group, self.rank, self.cp = group, rank, cp
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def shift(self, *tensors: torch.Tensor) -> "_Shift":
        """`tensors` to the next rank; what the previous rank shifts arrives in the result's wait()."""
        sent = [t.contiguous() for t in tensors]
        got = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent] + \
              [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in got]
        return _Shift(dist.batch_isend_irecv(ops), got, sent)


class _Shift:
    def __init__(self, works, got: list, sent: list):
        self.works, self.got, self.sent = works, got, sent  # the sent tensors live until the sends are done

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.got


def _block_mask(rows, rank: int, chunk: int, s: int, device):
    """Which of this rank's queries see which keys of `chunk`: None (all), a boolean tensor, or False (none)."""
    if rows is None:  # causal: earlier chunks whole, this rank's own lower-triangular, later ones hidden
        if chunk < rank:
            return None
        if chunk > rank:
            return False
        return torch.ones(s, s, dtype=torch.bool, device=device).tril()
    block = rows[..., chunk * s:(chunk + 1) * s]
    return block if bool(block.any()) else False


# Queries whose scores over a chunk are held at once: [b, heads, QUERY_ROWS, chunk] in fp32 and a few tensors of
# that size, not the chunk's whole square (8 GiB for 32 heads of 8K tokens).
QUERY_ROWS = RING_QUERY_ROWS


def _query_rows(s: int) -> list[slice]:
    return [slice(i, min(i + QUERY_ROWS, s)) for i in range(0, s, QUERY_ROWS)]


def _scores(q: torch.Tensor, k: torch.Tensor, allowed, r: slice, scale: float) -> torch.Tensor:
    """The fp32 scores of the queries `r` (q holds just those) over a chunk's keys, -inf where `allowed` (_block_mask's:
    None for all) hides a key; forward and backward compute them alike."""
    scores = (q @ k.transpose(-1, -2)).float() * scale
    return scores if allowed is None else scores.masked_fill(~allowed[..., r, :], -math.inf)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Rows whose every key is hidden have a log-sum-exp of -inf: subtracted as 0 there, their p is all 0 (no
    mask of the model's hides a query from itself; this keeps such a row's gradient 0, not NaN)."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that read them (grouped-query attention)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of _expand: each key/value head's query heads summed."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)
