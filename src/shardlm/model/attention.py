"""The parts of attention that parallel strategies replace rather than branch on (torchtitan's module swaps, in
place of the runtime switches Megatron-core threads through its attention): the core, softmax(q k^T / sqrt(d) +
mask) v over the projected heads, and the sequence the positions and masks come from. On one device these are
PyTorch's scaled_dot_product_attention (FlashAttention, Dao et al. 2022, or the memory-efficient kernels) over
whole sequences; context parallelism (parallel/context.py) installs Ulysses' or ring attention's core and a
sequence that is this rank's slice.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class SDPA(nn.Module):
    """The one-device core. q [b, heads, t, d]; k, v [b, kv heads, keys, d] (grouped-query attention where
    fewer); `causal`, or `mask` (boolean, True: attend) where given, or neither (every key). Returns
    [b, heads, t, d]. Every core has this call, and `local`: the one-device core it falls back to where the
    sequence is whole on this rank (a KV cache's decoding)."""

    def __init__(self):
        super().__init__()
        self.expand_kv = False  # SDPA backends without native GQA get K/V repeated per query head
        self.recompute = False  # selective recomputation: the scores are recomputed in backward, not saved

    @property
    def local(self) -> SDPA:
        return self

    def forward(self, q, k, v, causal: bool, mask=None):
        if self.recompute and self.training:
            return checkpoint(self.attend, q, k, v, causal, mask, use_reentrant=False)
        return self.attend(q, k, v, causal, mask)

    def attend(self, q, k, v, causal: bool, mask=None):
        gqa = k.shape[1] != q.shape[1]
        if gqa and self.expand_kv:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


class WholeSequence:
    """Where this rank's tokens lie in their sequences: on one device, each sequence whole. Context parallelism
    replaces it by this rank's part (parallel/context.py's ContextParallel, the same methods)."""

    def span(self, start: int, length: int) -> tuple[int, int]:
        """(the position of this rank's first token, the whole sequence's length) for `length` tokens from
        `start`: positions count from the first, masks span the whole."""
        return start, length

    def order(self, whole: int, device):
        """This rank's positions (offsets from `start`) where its tokens are not a contiguous run from span's
        first (ring attention's zig-zag layout), else None."""
        return None

    def whole(self, ids):
        """The whole sequence's token ids [b, T] from this rank's part of them."""
        return ids

    def local(self, t):
        """This rank's part of a whole-sequence tensor ([b, T] or [T])."""
        return t


WHOLE = WholeSequence()
