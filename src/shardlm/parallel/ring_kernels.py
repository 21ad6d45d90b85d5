"""The block kernels of ring attention (ring_attention.py): softmax(q k^T / sqrt(d) + mask) v of one block of
queries over one chunk of keys and values, returning the block's log-sum-exp beside its output, and the
block's gradients given the whole row's output and log-sum-exp (FlashAttention's backward, Dao et al. 2022:
dS = P (dP - rowsum(dO O)), P = exp(S - lse), which is exact for a block once O and lse are the whole row's).
These are the fused ops PyTorch's own context parallelism (torch.distributed.tensor.experimental
`context_parallel`) and ring-flash-attention call:

- "cudnn" (CUDA, fp16/bf16, where SDPA itself would take cuDNN's attention, as it does on Hopper):
  aten._scaled_dot_product_cudnn_attention and its backward, masks as an additive bias, grouped-query attention
  native; about twice FlashAttention-2's rate at the block shapes of a long sequence on an H200;
- "flash" (CUDA, fp16/bf16, no mask, elsewhere): aten._scaled_dot_product_flash_attention and its backward;
  grouped-query attention native (FlashAttention-2 reads a key/value head per group of query heads);
- "efficient" (CUDA, fp32, or a mask where cuDNN's kernels are not taken; computed in fp32):
  aten._scaled_dot_product_efficient_attention (the xFormers kernel, which takes fp32 and an additive bias)
  and its backward, key/value heads repeated;
- "flash_cpu" (CPU, any float dtype, masks as an additive bias, grouped-query native):
  aten._scaled_dot_product_flash_attention_for_cpu and its backward, so that the CPU tests run the GPU's code
  path, block for block;
- "math": plain torch ops, fp32 scores QUERY_ROWS queries at a time, where no fused op serves (other devices).

`ring_kernel` says which one a device, dtype and mask take.
"""
from __future__ import annotations

import math

import torch

from ..config import RING_QUERY_ROWS

aten = torch.ops.aten
KERNELS = ("cudnn", "flash", "efficient", "flash_cpu", "math")


def ring_kernel(device_type: str, dtype: torch.dtype, masked: bool, cudnn: bool = False) -> str:
    """The block kernel ring attention uses on `device_type` ("cuda", "cpu", ...) for inputs of `dtype`,
    with a mask (`masked`: sliding windows, packed documents) or causal/full blocks; `cudnn`: SDPA would take
    cuDNN's attention for these inputs (sdpa_prefers_cudnn)."""
    if device_type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "flash_cpu"
    if device_type == "cuda":
        if dtype not in (torch.float16, torch.bfloat16):
            return "efficient"
        return "cudnn" if cudnn else "efficient" if masked else "flash"
    return "math"


def sdpa_prefers_cudnn(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether SDPA itself would run q over k, v (causal) through cuDNN's attention: its own choice, so that the
    ring follows the device's best kernel and a user's `torch.nn.attention.sdpa_kernel` alike."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention import SDPBackend
        choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=q.shape[1] != k.shape[1])
    except (AttributeError, ImportError, RuntimeError, TypeError):  # no such backend in this build
        return False
    return choice == SDPBackend.CUDNN_ATTENTION.value


def block_forward(kind: str, q, k, v, causal: bool, mask, rows: int = RING_QUERY_ROWS):
    """(out [b, h, sq, d] in q's dtype, lse [b, h, sq] fp32, the kernel's random-number state for its backward
    or None) of q over k, v; `causal` (top-left aligned, as the diagonal block's sq == sk) or `mask` (boolean,
    True: attend, broadcasting to [b, h, sq, sk]) or neither. A row whose every key the mask hides gets lse
    -inf (its out is 0): merged, it weighs nothing."""
    scale, rng = 1.0 / math.sqrt(q.shape[-1]), None
    if kind == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, _bias(mask, q, k), True, 0.0, causal, False, scale=scale)
        lse = lse.view(q.shape[:-1])  # cuDNN's softmax statistics come as [b, h, sq, 1]
        rng = (seed, offset, cum_q, cum_k, max_q, max_k)
    elif kind == "flash":
        out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        rng = (rest[4], rest[5])  # philox seed and offset, as autograd hands them to the backward
    elif kind == "efficient":
        dtype, (q, k, v) = q.dtype, _fp32(q, _expand(k, q.shape[1]), _expand(v, q.shape[1]))
        out, lse, *rng = aten._scaled_dot_product_efficient_attention(q, k, v, _bias(mask, q, k), True, 0.0, causal,
                                                                      scale=scale)
        out, lse = out.to(dtype), lse[..., :q.shape[2]]  # the kernel pads its rows to a multiple of its tile
    elif kind == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=_bias(mask, q, k),
                                                                    scale=scale)
    else:
        return (*_math_forward(q, k, v, causal, mask, scale, rows), None)
    if mask is not None:  # the fused kernels leave a fully masked row at lse 0 (CPU) or +-inf: it has no keys
        empty = ~mask.any(-1)
        lse = lse.masked_fill(empty, -math.inf)
        # and its output 0, whatever the kernel wrote there (SDPA's memory-efficient kernel has been reported to
        # leave NaN in fully masked rows, pytorch#109517): merged at weight 0, a NaN would still spread
        out = out.masked_fill_(empty.unsqueeze(-1), 0.0)  # the kernel's own fresh output
    return out, lse.float(), rng


def block_backward(kind: str, dout, q, k, v, out, lse, causal: bool, mask, rng, rows: int = RING_QUERY_ROWS):
    """(dq, dk, dv) of the block given the whole row's `out` (q's dtype) and `lse` (fp32, finite; +inf for
    a row with no key at all): this block's shares of the row's gradients. `rng`: block_forward's."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    lse = lse.contiguous()  # the kernels index it as [b, h, sq] rows
    if kind == "cudnn":
        seed, offset, cum_q, cum_k, max_q, max_k = rng
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, offset, _bias(mask, q, k), cum_q, cum_k, max_q, max_k, 0.0,
            causal, scale=scale)
    if kind == "flash":
        # No cumulative sequence lengths (None: dense, not varlen), as the forward returned them.
        return aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, q.shape[2],
                                                                 k.shape[2], 0.0, causal, *rng, scale=scale)
    if kind == "efficient":
        dout, q, kx, vx, out = _fp32(dout, q, _expand(k, q.shape[1]), _expand(v, q.shape[1]), out)
        bias = _bias(mask, q, kx)
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, kx, vx, bias, out, _pad_rows(lse), *rng, 0.0, [True, True, True, False], causal,
            scale=scale)[:3]
        return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])
    if kind == "flash_cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=_bias(mask, q, k), scale=scale)
    return _math_backward(dout, q, k, v, out, lse, causal, mask, scale, rows)


def _bias(mask, q, k):
    """A boolean mask as the additive bias the fused kernels take (q's dtype, -inf where hidden), [b, h, sq, sk]
    broadcast; on CUDA its rows padded to a multiple of 16 keys and sliced back (the efficient kernel's
    alignment, as SDPA's own front end pads it)."""
    if mask is None:
        return None
    sq, sk = q.shape[2], k.shape[2]
    if q.device.type != "cuda":
        return torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, -math.inf)
    padded = torch.zeros(*mask.shape[:-1], -(-sk // 16) * 16, dtype=q.dtype, device=q.device)
    padded[..., :sk].masked_fill_(~mask, -math.inf)
    return padded[..., :sk].expand(q.shape[0], q.shape[1], sq, sk)


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The efficient kernel's inputs in fp32: its 16-bit backward wrote NaN into dq and dk for blocks of
    contiguous [b, h, s, d] rows with an additive mask (H200, torch 2.11), where fp32 is exact. Only masked
    16-bit blocks on GPUs where SDPA does not take cuDNN's attention come here."""
    return [t.float() for t in tensors]


def _pad_rows(lse: torch.Tensor) -> torch.Tensor:
    """lse padded to the efficient kernel's 32-row tiles, as its forward returned it."""
    s = lse.shape[-1]
    pad = -(-s // 32) * 32 - s
    return lse if not pad else torch.nn.functional.pad(lse, (0, pad), value=math.inf).contiguous()


def _expand(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that read them (grouped-query attention)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of _expand: each key/value head's query heads summed."""
    if t.shape[1] == heads:
        return t
    b, h, s, d = t.shape
    return t.view(b, heads, h // heads, s, d).sum(2)


def _scores(q, k, causal: bool, mask, r: slice, scale: float) -> torch.Tensor:
    """fp32 scores of the queries `r` (q holds just those), -inf where hidden; forward and backward alike."""
    scores = (q @ k.transpose(-1, -2)).float() * scale
    if causal:
        i = torch.arange(r.start, r.stop, device=q.device)[:, None]
        return scores.masked_fill(torch.arange(k.shape[2], device=q.device) > i, -math.inf)
    return scores if mask is None else scores.masked_fill(~mask[..., r, :], -math.inf)


def _math_forward(q, k, v, causal, mask, scale, rows):
    kx, vx = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i in range(0, q.shape[2], rows):
        r = slice(i, min(i + rows, q.shape[2]))
        scores = _scores(q[:, :, r], kx, causal, mask, r, scale)
        lse[:, :, r] = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - _finite(lse[:, :, r]).unsqueeze(-1))
        out[:, :, r] = ((p.to(q.dtype) @ vx).float() / p.sum(-1, keepdim=True).clamp_min(1e-38)).to(q.dtype)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, causal, mask, scale, rows):
    kx, vx = _expand(k, q.shape[1]), _expand(v, q.shape[1])
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)  # softmax's backward: sum_j p_ij dP_ij
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kx.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(vx.shape, dtype=torch.float32, device=q.device)
    for i in range(0, q.shape[2], rows):
        r = slice(i, min(i + rows, q.shape[2]))
        qr, gr = q[:, :, r], dout[:, :, r]
        p = torch.exp(_scores(qr, kx, causal, mask, r, scale) - lse[:, :, r].unsqueeze(-1))
        ds = (p * ((gr @ vx.transpose(-1, -2)).float() - delta[:, :, r]) * scale).to(q.dtype)
        dq[:, :, r] = (ds @ kx).float()
        dk += (ds.transpose(-1, -2) @ qr).float()
        dv += (p.to(q.dtype).transpose(-1, -2) @ gr).float()
    return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])


def _finite(x: torch.Tensor) -> torch.Tensor:
    """A row whose every key is hidden has lse -inf: subtracted as 0 there, its p is all 0, not NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)
