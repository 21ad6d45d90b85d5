"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-LM's context
parallelism with `cp_comm_type p2p`; Llama 3's context parallelism, Dubey et al. 2024): the other way to split
each sequence over the cp ranks (`parallel.cp_comm p2p`, beside Ulysses' all-to-all in parallel/ulysses.py;
context.py installs either as each attention's core). Each rank keeps its queries and passes its keys and
values around the ring, one neighbour's chunk per step, while it attends to the chunk it holds; the partial
outputs merge by their log-sum-exp in fp32 (the online softmax of flash attention), so no rank holds more than
two chunks of keys and values at a time, and the heads need not divide by cp.

Each (queries, chunk) block runs through a fused attention kernel that returns its log-sum-exp (ring_kernels.py:
cuDNN's or FlashAttention's forward and backward on CUDA, as SDPA would choose, the efficient kernel for fp32,
the CPU's flash op, plain ops elsewhere), as PyTorch's `context_parallel` and zhuzilin's ring-flash-attention
do. Backward runs the same ring: each chunk of keys and values travels with the fp32 gradient accumulated for
it so far and arrives home after cp steps with every rank's share; each step's sends and receives (the next
chunk, the gradient that follows it) run while the current block computes.

Causal load balance (Brandon et al. 2023, "Striped Attention"; the zig-zag layout of ring-flash-attention and
Llama 3): context.py cuts the sequence into 2 cp chunks and rank i holds chunks i and 2cp-1-i, so at every step
each rank computes half a square of scores: its own chunks causally, an earlier rank's first chunk for all its
queries, a later rank's whole pair for its second chunk's queries. Blocks that the mask hides entirely are
skipped, their chunk only passed on. Masks (sliding windows, packed documents) come whole-sequence and are cut
per block; blocks they leave whole run unmasked.
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from ..config import RING_QUERY_ROWS
from ..model.lazy_compiler import eager
from .ring_kernels import block_backward, block_forward, ring_kernel, sdpa_prefers_cudnn

QUERY_ROWS = RING_QUERY_ROWS  # the plain-op kernel's queries a pass (its fp32 scores: [b, h, rows, chunk])


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d) + mask) v for this rank's queries over the whole sequence, whose key/value
    chunks the ranks of `context` (context.py's ContextParallel) hold in its layout. q: [b, h, s, d]; k, v:
    [b, h_kv, s, d] (h_kv divides h: grouped-query attention); `mask`: the whole sequence's boolean mask
    [..., T, T] (True: attend), or None for causal attention; `kernel`: the block kernel (None: ring_kernel's
    choice); `tally`: a Counter of the block kernels run (forward), or None."""

    @staticmethod
    def forward(ctx, q, k, v, mask, context, kernel, tally):
        ring = _Ring(context)
        cudnn = kernel is None and sdpa_prefers_cudnn(q, k)
        out = lse = None  # the running fp32 output and log-sum-exp (_start, merge)
        kv, rngs, plan = torch.stack([k, v]), [], ring_plan(context, mask, q)
        for step in range(ring.cp):
            incoming = ring.shift(kv) if step < ring.cp - 1 else None  # the next chunk comes in meanwhile
            holder = (ring.rank - step) % ring.cp
            for qs, ks, causal, block in _with_masks(context, holder, mask, q, plan[step]):
                kind = kernel or ring_kernel(q.device.type, q.dtype, block is not None, cudnn)
                if tally is not None:
                    tally[kind] += 1
                o, l, rng = block_forward(kind, q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], causal, block,
                                          QUERY_ROWS)
                if out is None:
                    out, lse = _start(q, qs, o, l)
                else:
                    merge(out[:, :, qs], lse[:, :, qs], o, l)
                rngs.append(rng)
            if incoming is not None:
                kv, = incoming.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, mask if mask is not None else torch.empty(0))
        ctx.context, ctx.kernel, ctx.causal, ctx.rngs, ctx.plan = context, kernel, mask is None, rngs, plan
        ctx.cudnn = cudnn
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, mask = ctx.saved_tensors
        mask = None if ctx.causal else mask
        context, ring = ctx.context, _Ring(ctx.context)
        grad = grad.contiguous()  # the fused backward kernels read rows of contiguous head dims
        lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # a row with no key: every p exp(s - inf) = 0
        dq = _RowSum(q)
        kv = torch.stack([k, v])
        travelling = None  # the gradient of the chunk this rank held last step, on its way to the next rank
        rngs = iter(ctx.rngs)  # the blocks come in the forward's order
        for step in range(ring.cp):
            incoming = ring.shift(kv) if step < ring.cp - 1 else None
            dk, dv = _RowSum(k), _RowSum(v)
            holder = (ring.rank - step) % ring.cp
            for qs, ks, causal, block in _with_masks(context, holder, mask, q, ctx.plan[step]):
                kind = ctx.kernel or ring_kernel(q.device.type, q.dtype, block is not None, ctx.cudnn)
                dqb, dkb, dvb = block_backward(kind, grad[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks],
                                               out[:, :, qs], lse[:, :, qs], causal, block, next(rngs), QUERY_ROWS)
                dq.add(qs, dqb)  # in fp32, reading the 16-bit gradients as they are
                dk.add(ks, dkb)
                dv.add(ks, dvb)
            mine = [dk.total(), dv.total()]
            # The gradient that arrived with this chunk took its earlier holders' shares; it moves on with the
            # chunk, sent while the next block computes, and after cp steps it is home with every share. The
            # last hop, which nothing overlaps, goes in the inputs' dtype: its owner would round it to that on
            # arrival, so rounding before sending halves the bytes and changes no bit.
            if travelling is not None:
                for t, arrived in zip(mine, travelling.wait()):
                    t += arrived
            travelling = ring.shift(*(mine if step < ring.cp - 1 else [t.to(k.dtype) for t in mine]))
            if incoming is not None:
                kv, = incoming.wait()
        dk, dv = travelling.wait()
        return dq.total().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _start(q: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor):
    """The running fp32 output and log-sum-exp from the first block: the block itself where it covers every
    row (the own chunks, always first), else nothing yet (0, -inf) with the block merged in."""
    if rows == slice(0, q.shape[2]):
        return block_out.float(), block_lse
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
    merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
    return out, lse


class _RowSum:
    """An fp32 sum of gradients over blocks of the rows (dim 2) of `like`: a first block that covers every row
    is copied in rather than added to zeros (one pass over the sum instead of three)."""

    def __init__(self, like: torch.Tensor):
        self.like, self.sum = like, None

    def add(self, rows: slice, part: torch.Tensor) -> None:
        if self.sum is None and rows == slice(0, self.like.shape[2]):
            self.sum = part.float()
            return
        if self.sum is None:
            self.sum = torch.zeros(self.like.shape, dtype=torch.float32, device=self.like.device)
        self.sum[:, :, rows].add_(part)

    def total(self) -> torch.Tensor:
        if self.sum is None:  # no block this step: nothing to add, but the chunk's gradient still travels
            self.sum = torch.zeros(self.like.shape, dtype=torch.float32, device=self.like.device)
        return self.sum


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds a block's softmax-normalised output and log-sum-exp into the running ones (fp32, in place):
    each weighs by its share exp(lse - merged) of the merged row sum. Rows with no keys yet (-inf) weigh 0;
    a block's row with no key must hold 0, not NaN (block_forward sees to it). Two passes over the rows: the
    block's 16-bit output is read as it is, not copied to fp32 first."""
    merged = torch.logaddexp(lse, block_lse)
    old = torch.exp(lse - merged).nan_to_num_(0.0).unsqueeze(-1)
    new = torch.exp(block_lse - merged).nan_to_num_(0.0).unsqueeze(-1)
    out.mul_(old).addcmul_(block_out, new)
    lse.copy_(merged)


def ring_blocks(context, holder: int, mask, q) -> list[tuple[slice, slice, bool, torch.Tensor | None]]:
    """The kernel calls of this rank's queries over rank `holder`'s keys: (query rows, key rows, causal, the
    block's boolean mask or None). Under causal attention a query chunk sees a key chunk wholly when it comes
    later in the sequence, not at all when earlier (the own chunks, in sequence order, causally); the visible
    pairs are joined into one call where they form a rectangle (always, for the zig-zag and contiguous
    layouts). A mask (a subset of causal's) is cut to each call, which is dropped where it hides everything."""
    step = (context.rank - holder) % context.size
    return _with_masks(context, holder, mask, q, ring_plan(context, mask, q)[step])


def ring_plan(context, mask, q) -> list[list[tuple[slice, slice, bool, bool]]]:
    """ring_blocks' calls at every step of the ring (step s: the keys of rank `rank - s`), each as (query rows,
    key rows, causal, masked): one host sync for all of them (which blocks a mask hides wholly, which it leaves
    whole), so that every layer's forward asks once and its backward not at all."""
    holders = [(context.rank - step) % context.size for step in range(context.size)]
    calls = [_calls(context, holder, q) for holder in holders]
    if mask is None:
        return [[(qs, ks, causal, False) for qs, ks, causal in step] for step in calls]
    subs = [(_holder_mask(context, holder, mask, q)[..., qs, ks]) for holder, step in zip(holders, calls)
            for qs, ks, _ in step]
    seen = torch.stack([torch.stack([sub.any(), sub.all()]) for sub in subs]).tolist() if subs else []
    flags, plan = iter(seen), []
    for step in calls:
        kept = []
        for qs, ks, _ in step:
            some, every = next(flags)
            if some:
                kept.append((qs, ks, False, not every))
        plan.append(kept)
    return plan


def _calls(context, holder: int, q) -> list[tuple[slice, slice, bool]]:
    mine, theirs = context.chunks(context.rank), context.chunks(holder)
    n, c = len(mine), q.shape[2] // len(mine)
    if holder == context.rank:
        return [(slice(0, n * c), slice(0, n * c), True)]
    seen = [[a > b for b in theirs] for a in mine]
    rows = [i for i in range(n) if any(seen[i])]
    cols = [j for j in range(n) if any(seen[i][j] for i in range(n))]
    whole = rows == list(range(rows[0], rows[-1] + 1)) and cols == list(range(cols[0], cols[-1] + 1)) and \
        all(seen[i][j] for i in rows for j in cols) if rows else False
    if whole:
        return [(slice(rows[0] * c, (rows[-1] + 1) * c), slice(cols[0] * c, (cols[-1] + 1) * c), False)]
    return [(slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), False)
            for i in range(n) for j in range(n) if seen[i][j]]


def _holder_mask(context, holder: int, mask, q) -> torch.Tensor:
    """The mask's rows of this rank's queries and columns of `holder`'s keys, in the order each holds them."""
    whole = context.size * q.shape[2]
    return mask[..., context.indices(context.rank, whole, q.device), :][..., context.indices(holder, whole, q.device)]


def _with_masks(context, holder: int, mask, q, step: list) -> list[tuple[slice, slice, bool, torch.Tensor | None]]:
    """A step of ring_plan with each masked call's block of the mask (sliced on the device: no host sync)."""
    block = None if mask is None or not any(masked for *_, masked in step) else _holder_mask(context, holder, mask, q)
    return [(qs, ks, causal, block[..., qs, ks] if masked else None) for qs, ks, causal, masked in step]


@eager  # its point-to-point sends stay eager; the block around it compiles
def ring_attention(q, k, v, mask, context, kernel: str | None = None, tally: Counter | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence (`context`: parallel/context.py's
    ContextParallel); `mask`: the whole sequence's boolean mask (Decoder.window_mask, packed documents), or
    None for causal attention."""
    return RingAttention.apply(q, k, v, mask, context, kernel, tally)


class RingCore(nn.Module):
    """An attention core over this rank's part of each sequence (model/attention.py's call), by ring
    attention; `local`, the one-device core it replaced, is kept for whole sequences (a KV cache's).
    `kernel`: the block kernel, None for ring_kernel's choice; `kernel_calls`: the block kernels its forwards
    ran, by name (ring_kernels.KERNELS)."""

    def __init__(self, local: nn.Module, context):
        super().__init__()
        self.local, self.context = local, context
        self.kernel: str | None = None
        self.kernel_calls: Counter = Counter()

    def forward(self, q, k, v, causal: bool, mask=None):
        """`mask`: the whole sequence's; None: causal (a sliced sequence always is, or is masked)."""
        return ring_attention(q, k, v, mask, self.context, self.kernel, self.kernel_calls)


class _Ring:
    """Sends to the next rank of the group and receives from the previous one."""

    def __init__(self, context):
        self.group, self.rank, self.cp = context.group, context.rank, context.size
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.cp)

    def shift(self, *tensors: torch.Tensor) -> _Shift:
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
