"""The model over a static KV cache of slots: each row of the cache belongs to one request at a time and
keeps its own length, so requests of any prompt length share one batch without padding shifting anyone's
positions (gpt-fast's static cache, vLLM's slots without the paging).

Every token carries its own position: it is embedded (RoPE, GPT-2's learned positions) there, its key and
value are written there in its slot, and its query reads the slot's keys up to it (within the sliding
window). A new prompt's first chunk attends to its own keys through SDPA's causal kernels (flash on GPUs);
everything else (a decode step, a later chunk of a long prompt) reads the cache through two matrix
products per layer, grouped by key/value head so GQA never copies keys.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError
from ..memory_check import free_memory
from ..model import Decoder
from . import step_kernels
from .decode_attention import attention_step, decode_attention, kernel_ok, step_kernel_ok


class StaticKVCache:
    """Keys and values [slots, kv heads, max_len, head_dim] per layer, allocated once. On a GPU the buffers
    are marked static so that a compiled decode step can run as one CUDA graph that writes into them."""

    def __init__(self, model: Decoder, slots: int, max_len: int, device, dtype):
        shape = (slots, model.cache_heads(), max_len, model.cfg.head_size)
        self.slots, self.max_len = slots, max_len
        self.scratch = max_len - 1  # where idle slots and padding write; no query reads it, and one there none
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks()]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in model.blocks()]
        if torch.device(device).type == "cuda":
            for t in self.k + self.v:
                torch._dynamo.mark_static_address(t)


def slots_that_fit(model: Decoder, max_len: int, limit: int, share: float = 0.9, group=None,
                   shorter: str = "shorten the context (--max-len)") -> int:
    """How many slots of `max_len` positions fit in `share` of the memory the GPU (or on the CPU, the host) has
    free, at most `limit`. Each slot holds its keys and values and its fp32 logits and sampling workspace.
    With a tensor-parallel `group`, the fewest any of its ranks holds (a collective): every rank's engine
    must have as many, or their steps' shapes and collectives would differ. `shorter`: the advice where not
    even one slot fits."""
    p = next(model.parameters())
    # On the host, what Linux counts available: the page cache that the checkpoint's files just filled is
    # memory a slot can take (free pages alone undercounted it); elsewhere the limit as given.
    free, where = free_memory(p.device), "the GPU" if p.device.type == "cuda" else "the host"
    cfg = model.cfg
    per_slot = (cfg.kv_bytes_per_token(p.element_size(), model.cache_heads()) * (max_len + 1)
                + 4 * 4 * cfg.vocab_size)
    fit = limit if free is None else int(share * free // per_slot)
    if group is not None and dist.get_world_size(group) > 1:
        fewest = torch.tensor([fit], device=p.device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=group)
        fit = int(fewest.item())
    if fit < 1:
        have = f"{free / 2**30:.2f} GiB" if free is not None and fit == int(share * free // per_slot) else "too little"
        raise ConfigError(f"out of memory: one slot of {max_len} positions needs {per_slot / 2**30:.2f} GiB, "
                          f"{where} has {have} free{' (on some rank)' if group is not None else ''}: {shorter}")
    return min(limit, fit)


def visible(positions: torch.Tensor, keys: int, window: int, idle: int | None = None) -> torch.Tensor:
    """[n, T, keys]: which cached positions each query (at `positions` [n, T]) attends to: every earlier one
    and itself, and within a sliding window only the last `window` of those; a query at `idle` (an idle
    slot's or padding's scratch position) none, so that the decode kernel reads nothing for it."""
    j = torch.arange(keys, device=positions.device)
    pos = positions[..., None]
    mask = j <= pos
    if idle is not None:
        mask = mask & (pos != idle)
    return mask & (j > pos - window) if window else mask


def visible_bounds(positions: torch.Tensor, keys: int, window: int, idle: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For one query a row (`positions` [n, 1]): the first cached position `visible` shows it and one past the
    last (int32 [n] each); 0 and 0 for an idle row. Computed once a decode step for every layer's unfused
    kernel (decode_attention); the fused step's kernel computes the same from each row's position."""
    pos = positions[:, 0].int()
    hi = (pos + 1).clamp_max(keys)
    lo = (pos + 1 - window).clamp(0, keys) if window else torch.zeros_like(hi)
    idle_rows = pos == idle
    return lo.masked_fill(idle_rows, 0), hi.masked_fill(idle_rows, 0)


class CachedMask(NamedTuple):
    """What queries over the cache see: `visible`'s mask [n, T, keys], and for one query a row its bounds
    (visible_bounds), else None; what both are computed from, the sliding window (0: none) and the idle
    position."""
    mask: torch.Tensor
    bounds: tuple[torch.Tensor, torch.Tensor] | None
    window: int
    idle: int


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: CachedMask) -> torch.Tensor:
    """Attention of queries q [n, H, T, d] to cached keys and values [n, KV, keys, d] under `seen`'s mask
    [n, T, keys]; H = KV x G, query head h reading key/value head h // G. Returns [n, T, H * d]."""
    n, heads, t, d = q.shape
    kv, keys = k.shape[1], k.shape[2]
    g = heads // kv
    mask = seen.mask
    if kernel_ok(q, k):
        return decode_attention(q, k, v, mask, seen.bounds)
    if t == 1 and torch.compiler.is_compiling():
        return _attend_one(q, k, v, mask)
    scores = (q.reshape(n, kv, g * t, d) @ k.transpose(-1, -2)).view(n, kv, g, t, keys).float()
    # A large finite fill, not -inf: a row with no visible key (an idle slot) averages instead of dividing 0 by 0.
    scores = scores.mul(d ** -0.5).masked_fill(~mask[:, None, None], -1e30)
    probs = scores.softmax(-1).to(v.dtype).view(n, kv, g * t, keys)
    return (probs @ v).view(n, heads, t, d).transpose(1, 2).reshape(n, t, heads * d)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """attend_cached for one query a row (a decode step), compiled: as products and sums, which the compiler
    fuses with the mask and the softmax into kernels that read each cached key and value once. As matrix
    products they are a batch of matrix-vector products per head, which cuBLAS ran at a third of an H200's
    memory bandwidth (bench/README.md). Eager, the products would be materialised: compiled only."""
    n, heads, _, d = q.shape
    kv, keys = k.shape[1], k.shape[2]
    g = heads // kv
    qg = q.reshape(n, kv, g, 1, d).float()
    scores = (qg * k[:, :, None].float()).sum(-1) * d ** -0.5  # [n, kv, g, keys]
    probs = scores.masked_fill(~mask.view(n, 1, 1, keys), -1e30).softmax(-1)
    y = (probs[..., None] * v[:, :, None].float()).sum(-2)  # [n, kv, g, d]
    return y.to(v.dtype).reshape(n, 1, heads * d)


def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal attention of a prompt's first chunk to its own keys (`mask`: a sliding window's [T, T], or None
    for plain causal attention). Returns [n, T, H * d]."""
    n, heads, t, d = q.shape
    gqa = k.shape[1] != heads
    if gqa and mask is not None:  # the kernels that take a mask do not all group heads
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
        gqa = False
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    return y.transpose(1, 2).reshape(n, t, heads * d)


class _WithoutCuDNNAttention:
    """SDPA with cuDNN's backend off while any prefill runs. The flag is process-wide: engines on several
    threads (data-parallel replicas) share one switch, counted, and it returns to what it was when the last
    prefill in flight ends (a per-call save and restore would leave it off when two calls interleave)."""

    def __init__(self):
        self.lock, self.users, self.saved = threading.Lock(), 0, True

    def __enter__(self):
        with self.lock:
            if self.users == 0:
                self.saved = torch.backends.cuda.cudnn_sdp_enabled()
                torch.backends.cuda.enable_cudnn_sdp(False)
            self.users += 1

    def __exit__(self, *exc):
        with self.lock:
            self.users -= 1
            if self.users == 0:
                torch.backends.cuda.enable_cudnn_sdp(self.saved)


WITHOUT_CUDNN_ATTENTION = _WithoutCuDNNAttention()


def forward_tokens(model: Decoder, cache: StaticKVCache, rope: tuple | None, ids: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor | None = None, last: torch.Tensor | None = None,
                   fresh: bool = False, keys: int | None = None, layer=None) -> torch.Tensor:
    """Logits [n, vocab] of the token at index `last` [n] (default the last) of each row of `ids` [n, T],
    row i writing its keys and values into slot `slots[i]` (default: row i) at `positions` [n, T].

    `fresh`: every row is a prompt's first chunk, starting at position 0; its queries attend to its own keys
    only. Otherwise queries read the slot's cached keys 0 .. `keys` - 1 (default all). `rope`: the (cos, sin)
    tables over the cache's positions (None for GPT-2). `layer`: what runs each block (`decoder_layer`, or a
    compiled version of it)."""
    n, t = ids.shape
    layer = layer or decoder_layer
    rows = torch.arange(n, device=ids.device) if slots is None else slots
    x = model.embed(ids)
    if model.pos_embed is not None:
        x = x + model.pos_embed(positions.clamp(max=model.cfg.max_seq_len - 1))
    angles = None if rope is None else (rope[0][positions].unsqueeze(1), rope[1][positions].unsqueeze(1))
    keys = keys or cache.max_len
    window = model.cfg.sliding_window
    if fresh:
        mask = model.window_mask(0, t, ids.device)
    else:
        mask = CachedMask(visible(positions, keys, window, cache.scratch),
                          visible_bounds(positions, keys, window, cache.scratch) if t == 1 else None,
                          window, cache.scratch)
    if not fresh and slots is None and t == 1 and layer is decoder_layer and step_kernel_ok(x, cache.k[0]):
        delta = None  # each block's output, added to x by the next block's first norm kernel
        for i, block in enumerate(model.blocks()):
            x, delta = decode_layer(block, cache.k[i], cache.v[i], x, delta, angles, positions, mask, keys)
        # The last sum and norm as the compiler's kernel, not add_norm's opaque op: Inductor (torch 2.11) prints
        # an opaque op's arguments when a graph first calls it, through every opaque op behind them, and the head's
        # (int8's product under int4) is first called here, behind a chain whose printout doubles at each norm.
        h = model.norm(x + delta)
    else:
        for i, block in enumerate(model.blocks()):
            x = layer(block, cache.k[i], cache.v[i], x, angles, rows, positions, slots, mask, fresh, keys)
        h = model.norm(x)
    h = h[:, -1] if last is None else h[torch.arange(n, device=h.device), last]
    return model.output(h, model.head_weight)


def decoder_layer(block, k_cache: torch.Tensor, v_cache: torch.Tensor, x: torch.Tensor, angles, rows: torch.Tensor,
                  positions: torch.Tensor, slots: torch.Tensor | None, mask, fresh: bool, keys: int) -> torch.Tensor:
    """One block of forward_tokens over its layer's cache (`mask`: a prompt's window mask where `fresh`, else
    a CachedMask). Every block runs the same code on its own weights,
    so compiled once (the weights are the graph's inputs) it serves every layer: a prefill's shapes change with
    each prompt, which rules out one CUDA graph per shape, and eager, a 7B model's prefill spends most of its
    time launching a few hundred small operators per layer."""
    attn = block.attn
    q, k, v = attn.project(block.attn_norm(x), angles)
    k_cache[rows[:, None], :, positions] = k.transpose(1, 2)
    v_cache[rows[:, None], :, positions] = v.transpose(1, 2)
    if fresh:
        y = attend_fresh(q, k, v, mask)
    elif slots is None:  # row i in slot i, the first rows of the cache's
        n = x.shape[0]
        y = attend_cached(q, k_cache[:n, :, :keys], v_cache[:n, :, :keys], mask)
    else:
        y = attend_cached(q, k_cache[slots, :, :keys], v_cache[slots, :, :keys], mask)
    x = x + attn.out(y)
    return x + block.mlp(block.mlp_norm(x))


def decode_layer(block, k_cache: torch.Tensor, v_cache: torch.Tensor, x: torch.Tensor, delta: torch.Tensor | None,
                 angles, positions: torch.Tensor, mask: CachedMask, keys: int):
    """decoder_layer for a decode step on a GPU (one query a row, row i in slot i) as a chain of kernels that
    each start as the one before ends (kernels.pdl_launch): the rotations, the cache writes and attention in one
    (decode_attention.attention_step), each residual add with the norm after it, SwiGLU (step_kernels.py).
    Takes the residual stream x and the previous block's output `delta` not yet added (None: nothing to add);
    returns the same pair for the next block."""
    attn = block.attn
    x, h = step_kernels.add_norm(block.attn_norm, x, delta)
    y = attention_step(attn.qkv(h), angles, k_cache, v_cache, positions, attn.n_heads, keys, mask.window, mask.idle)
    x, h = step_kernels.add_norm(block.mlp_norm, x, attn.out(y))
    return x, step_kernels.mlp(block.mlp, h)
