"""Decode attention that reads each row's own keys only: flash-decoding (Dao et al., 2023), a Triton kernel.

A decode step's query attends to its slot's cached keys, and the slots of one batch hold requests of every
length; attention over a shared bound (slots.attend_cached, the key count rounded up to a power of two so
that a few CUDA graphs serve every step) reads and masks the keys past each row's end: at 16 rows near the
end of the bound, most of what it reads. Here every (row, query head, split of the keys) is one program that
reads the keys and values of its split that its row sees (`lo` to `hi`, its position and sliding window) and
keeps an online softmax over them (a split with no key keeps the finite -1e30 as its maximum, so it
weighs nothing); a second kernel, a program for each (row, head), weighs the splits' partial sums by their
maxima and adds them. Splits past a row's end return at once, so a step costs the keys the rows hold.

A decode step takes it fused (attention_step): the split kernel reads the step's q, k, v projection as it
comes out of its linear layer, rotates q and the new key (RoPE, in fp32, rounded as the unfused step rounds
them), and the one program whose split holds a row's position writes its new key and value into the cache,
every program taking that position's key and value from its registers: the rotations and the cache writes
were five small kernels a layer, 5.2 us together on an H200 for llama2-7b (bench/README.md).
"""
from __future__ import annotations

import torch

from ..kernels import on_device, pdl_launch, triton, triton_ok, wait_for_inputs


# Keys a loop iteration loads, keys a program reads at most, warps a program: an H200's best over 32-256,
# 32-128 and 2-8 for one and for 16 rows of 16 slots, 512 and 2048 keys (bench/README.md). With the values loaded
# beside the keys, 2 warps (which spill a few registers) ran 16 rows of 512 keys in 29.6 us against 4 warps' 46.3,
# and one row in 5.4-5.6 against 5.8-7.6 (thirty-sixth lease). Small splits keep the SMs busy when few rows hold
# keys; a split that holds none of its row's keys skips its loop.
BLOCK, SPLIT, WARPS = 32, 64, 2


if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def _rotated(x_ptr, d, cos, sin, D: tl.constexpr, ROPE: tl.constexpr):
        """A head's D values at x_ptr in fp32, rotated by RoPE where ROPE: x cos + rotate_half(x) sin, with
        rotate_half(x) = (-x2, x1), in fp32 as the compiled step computes it."""
        x = tl.load(x_ptr + d).to(tl.float32)
        if ROPE:
            other = tl.load(x_ptr + (d + D // 2) % D).to(tl.float32)
            x = x * cos + tl.where(d < D // 2, -other, other) * sin
        return x

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, lo_ptr, hi_ptr, acc_ptr, max_ptr, sum_ptr,
                      sq_n, sq_h, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, scale, cos_ptr, sin_ptr, pos_ptr, sc_n,
                      n_keys, window, idle, HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK: tl.constexpr, FUSED: tl.constexpr, ROPE: tl.constexpr,
                      PDL: tl.constexpr = False):
        # FUSED: q_ptr is the step's q, k and v projection, a row [HEADS + 2 KV heads, D] (sq_n apart), not yet
        # rotated; the row's new key and value, at its position pos_ptr[row], go into the caches from here, and
        # its bounds come from that position as slots.visible_bounds computes them (lo_ptr and hi_ptr unread).
        wait_for_inputs(PDL)
        row, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if FUSED:
            at = tl.load(pos_ptr + row)
            live = at != idle
            lo = tl.where(live & (window > 0), tl.minimum(tl.maximum(at + 1 - window, 0), n_keys), 0)
            hi = tl.where(live, tl.minimum(at + 1, n_keys), 0)
        else:
            lo, hi = tl.load(lo_ptr + row), tl.load(hi_ptr + row)
        start = tl.maximum(lo, split * SPLIT)
        end = tl.minimum(hi, split * SPLIT + SPLIT)
        d = tl.arange(0, D)
        best = tl.max(tl.full([BLOCK], -1e30, tl.float32), 0)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        acc = tl.zeros([D], tl.float32)
        if start < end:
            keys = k_ptr + row.to(tl.int64) * sk_n + (head // GROUP) * sk_h
            values = v_ptr + row.to(tl.int64) * sv_n + (head // GROUP) * sv_h
            if FUSED:
                cos, sin = d, d  # unread without RoPE
                if ROPE:
                    cos = tl.load(cos_ptr + row * sc_n + d).to(tl.float32)
                    sin = tl.load(sin_ptr + row * sc_n + d).to(tl.float32)
                proj = q_ptr + row * sq_n
                # rounded to the model's type as the unfused step's q and cached key are
                q = _rotated(proj + head * D, d, cos, sin, D, ROPE).to(q_ptr.dtype.element_ty).to(tl.float32) * scale
                kv = HEADS + head // GROUP
                new_k = _rotated(proj + kv * D, d, cos, sin, D, ROPE).to(k_ptr.dtype.element_ty)
                new_v = tl.load(proj + (kv + HEADS // GROUP) * D + d).to(v_ptr.dtype.element_ty)
                if (head % GROUP == 0) & (at >= split * SPLIT) & (at < split * SPLIT + SPLIT):
                    tl.store(keys + at * sk_t + d, new_k)
                    tl.store(values + at * sv_t + d, new_v)
            else:
                q = tl.load(q_ptr + row * sq_n + head * sq_h + d).to(tl.float32) * scale
            for i in tl.static_range(SPLIT // BLOCK):  # loads past the row's end are masked off: no traffic
                t = split * SPLIT + i * BLOCK + tl.arange(0, BLOCK)
                ok = (t >= start) & (t < end)
                # the values loaded beside the keys, before the scores' reductions (whose barriers no load
                # crosses): one memory latency a tile, not two
                k = tl.load(keys + t[:, None] * sk_t + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                v = tl.load(values + t[:, None] * sv_t + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                if FUSED:  # the new position's key and value from registers: the cache's may not be written yet
                    mine = (t == at)[:, None]
                    k = tl.where(mine, new_k.to(tl.float32)[None, :], k)
                    v = tl.where(mine, new_v.to(tl.float32)[None, :], v)
                x = tl.where(ok, tl.sum(k * q[None, :], 1), -1e30)
                new = tl.maximum(best, tl.max(x, 0))
                fade = tl.exp(best - new)
                p = tl.where(ok, tl.exp(x - new), 0.0)
                acc = acc * fade + tl.sum(p[:, None] * v, 0)
                total = total * fade + tl.sum(p, 0)
                best = new
        out = (row * HEADS + head) * tl.num_programs(2) + split
        tl.store(acc_ptr + out * D + d, acc)
        tl.store(max_ptr + out, best)
        tl.store(sum_ptr + out, total)

    @triton.jit
    def _combine_kernel(acc_ptr, max_ptr, sum_ptr, y_ptr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                        D: tl.constexpr, PDL: tl.constexpr = False):
        # BLOCK splits at a time with the same online rescaling as the splits' own: a long context's hundreds
        # of splits at once would not fit one program's registers.
        wait_for_inputs(PDL)
        pair = tl.program_id(0)  # row * heads + head
        d = tl.arange(0, D)
        best = tl.max(tl.full([BLOCK], -1e30, tl.float32), 0)
        total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
        out = tl.zeros([D], tl.float32)
        for s0 in range(0, SPLITS, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            ok = s < SPLITS
            m = tl.load(max_ptr + pair * SPLITS + s, mask=ok, other=-1e30)
            new = tl.maximum(best, tl.max(m, 0))
            fade = tl.exp(best - new)
            weight = tl.where(ok, tl.exp(m - new), 0.0)
            acc = tl.load(acc_ptr + (pair * SPLITS + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            out = out * fade + tl.sum(acc * weight[:, None], 0)
            total = total * fade + tl.sum(tl.load(sum_ptr + pair * SPLITS + s, mask=ok, other=0.0) * weight, 0)
            best = new
        tl.store(y_ptr + pair * D + d, (out / tl.maximum(total, 1e-30)).to(y_ptr.dtype.element_ty))

    def _launch(q, k, v, lo, hi, n, heads, keys, fused=None):
        """The two kernels over `keys` cached positions of n rows' `heads` query heads, within bounds lo and hi;
        `fused`: (cos, sin, positions, window, idle) where q is the step's projection (FUSED above; lo and hi
        None); cos and sin None without RoPE."""
        d = k.shape[-1]
        acc, best, total = _split_outputs(n, heads, keys, d, q.device)
        splits = acc.shape[2]
        cos, sin, pos, window, idle = fused if fused is not None else (None, None, lo, 0, -1)
        lo, hi = (pos, pos) if fused is not None else (lo, hi)
        rope = cos is not None
        cos, sin = (cos, sin) if rope else (q, q)
        pdl = pdl_launch(q)
        _split_kernel[(n, heads, splits)](
            q, k, v, lo, hi, acc, best, total, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), d ** -0.5, cos, sin, pos, cos.stride(0), keys, window, idle,
            HEADS=heads, GROUP=heads // k.shape[1], D=d, SPLIT=SPLIT, BLOCK=BLOCK, FUSED=fused is not None,
            ROPE=rope, num_warps=WARPS, **pdl)
        y = q.new_empty(n, heads, d)
        _combine_kernel[(n * heads,)](acc, best, total, y, SPLITS=splits, BLOCK=16, D=d, num_warps=1, **pdl)
        return y

    # An opaque custom op, not a triton_op: the compiler then neither analyses the kernels for what they write
    # nor copies the cache views they read, and the decode step's CUDA graph captures the launches as they are.
    @torch.library.custom_op("shardlm::decode_attention", mutates_args=())
    def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo: torch.Tensor,
                   hi: torch.Tensor) -> torch.Tensor:
        with on_device(q):
            n, heads, _ = q.shape
            return _launch(q, k, v, lo, hi, n, heads, k.shape[2])

    @_attention.register_fake
    def _(q, k, v, lo, hi):
        return q.new_empty(q.shape)

    # Its cache writes reach the caches through their addresses, as gemv_all_reduce_ll.py's reach the peers'
    # buffers: declared, the compiler would functionalise them (a copy of the cache a layer at worst). Nothing
    # else in a decode step reads or writes a layer's cache, so no order the compiler picks can differ.
    @torch.library.custom_op("shardlm::decode_attention_step", mutates_args=())
    def _attention_step(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, k: torch.Tensor,
                        v: torch.Tensor, positions: torch.Tensor, heads: int, keys: int, window: int,
                        idle: int) -> torch.Tensor:
        with on_device(qkv):
            return _launch(qkv, k, v, None, None, qkv.shape[0], heads, keys, (cos, sin, positions, window, idle))

    @_attention_step.register_fake
    def _(qkv, cos, sin, k, v, positions, heads, keys, window, idle):
        return qkv.new_empty(qkv.shape[0], heads, k.shape[-1])


def _split_outputs(n: int, heads: int, keys: int, d: int, device) -> tuple[torch.Tensor, ...]:
    """The kernel's outputs, empty: each split's unnormalised sum [n, H, splits, d], maximum and total."""
    splits = -(-keys // SPLIT)
    acc = torch.empty((n, heads, splits, d), dtype=torch.float32, device=device)
    best = torch.empty((n, heads, splits), dtype=torch.float32, device=device)
    return acc, best, torch.empty_like(best)


def _kernels_take(x: torch.Tensor, k: torch.Tensor) -> bool:
    """Triton on x's GPU, a power-of-two head size (k's), keys whose last dimension is contiguous (the cache's
    views are)."""
    d = k.shape[-1]
    return (triton_ok(x) and hasattr(torch.library, "custom_op") and d >= 16 and d & (d - 1) == 0
            and k.stride(-1) == 1)


def kernel_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes this decode step's attention: _kernels_take's conditions, one query a row."""
    return _kernels_take(q, k) and q.shape[-1] == k.shape[-1] and q.shape[2] == 1


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     bounds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """slots.attend_cached for one query a row: q [n, H, 1, d], k and v [n, KV, keys, d], `mask` [n, 1, keys]
    one run of visible positions a row (its position, back to the window's start), or `bounds`, that run's
    first position and one past its last (int32 [n] each; slots.visible_bounds). Returns [n, 1, H * d]."""
    n, heads, _, d = q.shape
    if bounds is None:
        seen = mask[:, 0]
        lo = seen.int().argmax(-1).int()  # the first visible key
        hi = lo + seen.sum(-1).int()
    else:
        lo, hi = bounds
    y = torch.ops.shardlm.decode_attention(q[:, :, 0].contiguous(), k, v, lo, hi)
    return y.to(v.dtype).reshape(n, 1, heads * d)


def step_kernel_ok(x: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a decode step's attention over k_cache, its RoPE and its cache writes run as one kernel
    (attention_step) for the layer's normalised input x [n, T, hidden]: _kernels_take's conditions, one query
    a row, in the cache's dtype."""
    return _kernels_take(x, k_cache) and x.dim() == 3 and x.shape[1] == 1 and x.dtype == k_cache.dtype


def attention_step(qkv: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor] | None, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, positions: torch.Tensor, heads: int, keys: int, window: int,
                   idle: int) -> torch.Tensor:
    """A decode step's attention from its projection qkv [n, 1, (H + 2 KV) d] (q, k, v, not yet rotated):
    each row's key rotated by `angles` (cos, sin [n, 1, 1, d]; None: no RoPE) and its value written into its
    slot (row i's) of k_cache and v_cache [slots, KV, positions, d] at `positions` [n, 1], and its rotated
    query attending to the slot's keys that slots.visible_bounds shows it among the first `keys` (its position
    and the `window` before it, 0: all; a row at `idle` none, and it writes nothing): one kernel where the
    unfused step runs several (the rotations, the cache writes, the bounds, attention). The bounds are the
    kernel's own: computed outside, the compiler recomputed them for every layer, two kernels a layer (1-1.5
    us each on an H200, bench/README.md). Returns [n, 1, H d]."""
    n, d = qkv.shape[0], k_cache.shape[-1]
    cos, sin = (None, None) if angles is None else (a.reshape(n, d).contiguous() for a in angles)
    y = torch.ops.shardlm.decode_attention_step(qkv.reshape(n, -1).contiguous(), cos, sin, k_cache, v_cache,
                                                positions.reshape(n).contiguous(), heads, keys, window, idle)
    return y.reshape(n, 1, heads * d)
