"""A decode step's elementwise work as Triton kernels launched in a chain with its GEMVs and attention: the
residual add with the RMSNorm after it (FasterTransformer's add-bias-residual-layernorm, vLLM's
fused_add_rms_norm) and SwiGLU's silu(gate) * up.

At one row these kernels are latency, not bytes (a row of 4,096 values is 8 KB). Compiled, they are the
compiler's kernels, launched the usual way: each waits for the kernel before it to end and the next waits for
it, a few hundred boundaries a token. Here they take programmatic dependent launch like the products and
attention around them (kernels.pdl_launch), so that every kernel of a layer starts as the one before ends. The
arithmetic is the model's: RMSNorm in fp32, the normalised row rounded to the model's type, then times the
weight, rounded (decoder.RMSNorm; only the sum of squares' order differs); SiLU in fp32 rounded, times up.
"""
from __future__ import annotations

import torch

from ..kernels import on_device, pdl_launch, triton, triton_ok, wait_for_inputs

MAX_WIDTH = 16384  # a row's values one program holds (16 a thread at 32 warps)

if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, sum_ptr, h_ptr, eps, K: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
        k = tl.arange(0, BLOCK)
        ok = k < K
        w = tl.load(w_ptr + k, mask=ok, other=0.0).to(tl.float32)  # a weight: loaded before the wait
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64) * K
        x = tl.load(x_ptr + row + k, mask=ok, other=0.0).to(tl.float32)
        x += tl.load(d_ptr + row + k, mask=ok, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)  # the residual stream in the model's type, as `x + delta` stores it
        tl.store(sum_ptr + row + k, x, mask=ok)
        x = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
        normed = (x * scale).to(h_ptr.dtype.element_ty).to(tl.float32)
        tl.store(h_ptr + row + k, (w * normed).to(h_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(h_ptr, y_ptr, F: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        f = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = f < F
        gate = tl.load(h_ptr + row * 2 * F + f, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * F + F + f, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        tl.store(y_ptr + row * F + f, (act * up).to(y_ptr.dtype.element_ty), mask=ok)

    # Opaque to the compiler (as decode_attention.py's ops), which calls them inside the decode step's CUDA graph.
    @torch.library.custom_op("shardlm::add_rms_norm", mutates_args=())
    def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        with on_device(x):
            k = x.shape[-1]
            total, h = torch.empty_like(x), torch.empty_like(x)
            block = triton.next_power_of_2(k)
            _add_rms_norm_kernel[(x.numel() // k,)](x, delta, weight, total, h, eps, K=k, BLOCK=block,
                                                    num_warps=max(4, min(32, block // 512)), **pdl_launch(x))
            return total, h

    @_add_rms_norm.register_fake
    def _(x, delta, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.custom_op("shardlm::silu_mul", mutates_args=())
    def _silu_mul(h: torch.Tensor) -> torch.Tensor:
        with on_device(h):
            f = h.shape[-1] // 2
            y = h.new_empty(*h.shape[:-1], f)
            _silu_mul_kernel[(h.numel() // (2 * f), triton.cdiv(f, 1024))](h, y, F=f, BLOCK=1024, num_warps=4,
                                                                          **pdl_launch(h))
            return y

    @_silu_mul.register_fake
    def _(h):
        return h.new_empty(*h.shape[:-1], h.shape[-1] // 2)


def norm_ok(norm, x: torch.Tensor) -> bool:
    """Whether `norm` of a residual sum of rows like x [n, 1, hidden] runs as the kernel: an RMSNorm (not GPT-2's
    LayerNorm) whose weight has x's type, on a GPU, one position a row, rows of at most MAX_WIDTH values."""
    from ..model.decoder import RMSNorm
    return (type(norm) is RMSNorm and triton_ok(x) and hasattr(torch.library, "custom_op")
            and norm.weight.dtype == x.dtype and x.dim() == 3 and x.shape[1] == 1 and x.shape[-1] <= MAX_WIDTH)


def add_norm(norm, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, norm(x + delta)) (delta None: x and norm(x)), the sum and the norm in one kernel where
    `norm_ok`."""
    if delta is not None and norm_ok(norm, x):
        return torch.ops.shardlm.add_rms_norm(x.contiguous(), delta.contiguous(), norm.weight, norm.eps)
    x = x if delta is None else x + delta
    return x, norm(x)


def mlp(block_mlp, h: torch.Tensor) -> torch.Tensor:
    """block_mlp(h), its SwiGLU as the kernel where it is a gated decoder.MLP and h a GPU's contiguous rows."""
    from ..model.decoder import MLP
    if not (type(block_mlp) is MLP and block_mlp.gated and triton_ok(h) and hasattr(torch.library, "custom_op")):
        return block_mlp(h)
    return block_mlp.down(torch.ops.shardlm.silu_mul(block_mlp.up(h).contiguous()))
