"""A decode step's rotary embedding and KV-cache append in one kernel (vLLM's and FlashInfer's fused RoPE and
append), a Triton kernel.

At one token a row, the step between a layer's qkv product and its attention is a few hundred numbers a head:
rotate the query and the key, copy the query for the attention kernel, write the key and the value into the
row's slot at its position. The compiler spreads that over about five small kernels a layer, each a launch
whose cost is its latency, not its bytes (bench/README.md); here it is one launch, a program per (row, head):
a query head's program rotates its head into the attention kernel's input, a key/value head's rotates the key
and writes it and the value into the cache. The rotation is rotate_half's (Llama's), in fp32 and rounded once,
as the compiler's fused kernels compute it.
"""
from __future__ import annotations

import torch

from ..kernels import triton, triton_ok

if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def _rope_append_kernel(qkv_ptr, cos_ptr, sin_ptr, rows_ptr, pos_ptr, q_ptr, k_ptr, v_ptr, s_qkv, s_rope,
                            sk_n, sk_h, sk_t, sv_n, sv_h, sv_t,
                            HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr):
        n, head = tl.program_id(0), tl.program_id(1)  # query heads first, then key/value heads
        half = tl.arange(0, D // 2)
        src = qkv_ptr + n * s_qkv + head * D
        x1 = tl.load(src + half).to(tl.float32)
        x2 = tl.load(src + D // 2 + half).to(tl.float32)
        angles = n * s_rope + half
        c1, c2 = tl.load(cos_ptr + angles).to(tl.float32), tl.load(cos_ptr + angles + D // 2).to(tl.float32)
        s1, s2 = tl.load(sin_ptr + angles).to(tl.float32), tl.load(sin_ptr + angles + D // 2).to(tl.float32)
        y1 = x1 * c1 - x2 * s1  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        y2 = x2 * c2 + x1 * s2
        if head < HEADS:
            dst = q_ptr + (n * HEADS + head) * D
        else:
            row, pos = tl.load(rows_ptr + n).to(tl.int64), tl.load(pos_ptr + n)
            h = head - HEADS
            dst = k_ptr + row * sk_n + h * sk_h + pos * sk_t
            d = tl.arange(0, D)
            value = tl.load(qkv_ptr + n * s_qkv + (HEADS + KV + h) * D + d)
            tl.store(v_ptr + row * sv_n + h * sv_h + pos * sv_t + d, value.to(v_ptr.dtype.element_ty))
        tl.store(dst + half, y1.to(dst.dtype.element_ty))
        tl.store(dst + D // 2 + half, y2.to(dst.dtype.element_ty))

    # Declared as writing the caches, so that the compiler orders the attention that reads them after it (it
    # writes them in place: they are the step's static inputs, no copies).
    @torch.library.custom_op("shardlm::rope_append", mutates_args=("k_cache", "v_cache"))
    def _rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     heads: int) -> torch.Tensor:
        n, kv, d = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
        q = qkv.new_empty(n, heads, d)
        _rope_append_kernel[(n, heads + kv)](
            qkv, cos, sin, rows, positions, q, k_cache, v_cache, qkv.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), HEADS=heads, KV=kv, D=d, num_warps=1)
        return q

    @_rope_append.register_fake
    def _(qkv, cos, sin, rows, positions, k_cache, v_cache, heads):
        return qkv.new_empty(qkv.shape[0], heads, k_cache.shape[3])


def kernel_ok(qkv: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes this step: Triton on a GPU, a power-of-two head size, one token a row, rows of
    qkv, cos and sin contiguous along their last dimension, and a cache whose head dimension is."""
    d = k_cache.shape[-1]
    return (triton_ok(qkv) and hasattr(torch.library, "custom_op") and d >= 16 and d & (d - 1) == 0
            and qkv.stride(-1) == 1 and k_cache.stride(-1) == 1 and cos.stride(-1) == 1)


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [n, (heads + 2 KV) d] (one token a row: its query heads, key heads, value heads), cos and sin [n, d]
    at each row's position: the rotated queries [n, heads, d]; the rotated keys and the values written into
    k_cache and v_cache [slots, KV, positions, d] at (rows[i], :, positions[i])."""
    return torch.ops.shardlm.rope_append(qkv, cos, sin, rows, positions, k_cache, v_cache, heads)
