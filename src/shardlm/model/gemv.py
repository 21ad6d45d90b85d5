"""One row times a 16-bit weight as a Triton matrix-vector kernel (batch-1 decoding's linear layers).

At one row a linear layer reads its whole weight to produce a few kilobytes, so its time is the weight's
reading. On an H200 cuBLAS's kernels for llama2-7b's one-row shapes read at about 2.7-3.2 TB/s of the 4.8;
a plain split over output rows, each program holding a [BN, BK] tile of fp32 partial products and reducing
it once at the end (the GEMV of gpt-fast and of PyTorch's symmetric-memory recipes), took 7-27% less time on
every one of those shapes at tp 1 and tp 2 (bench/README.md). Taken only without autograd (inference), on
a GPU, in bf16 or fp16, for one row of a static shape; anything else is F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import on_device, pdl_launch, triton, triton_ok, wait_for_inputs


def launch(n: int, k: int) -> tuple[int, int, int]:
    """(BN outputs a program, BK inputs a step, warps) for an [n, k] weight. In an H200 sweep over nine
    launches on llama2-7b's products at tp 1 and 2 and llama3-8b's at tp 1, heads included, (4, 1024, 8) was
    within 4% of each shape's best but the long rows of the down projection, where (8, 512, 8) was best
    (bench/README.md)."""
    return (8, 512, 8) if k >= 5000 else (4, 1024, 8)


if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def gemv_tile(x_ptr, w_ptr, n, sw, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """The fp32 sums of outputs `n` (a program's BN rows of the weight, `sw` apart) with the row x."""
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k, mask=k < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        return tl.sum(acc, 1)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, sw, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     PDL: tl.constexpr = False):
        wait_for_inputs(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        tl.store(y_ptr + n, gemv_tile(x_ptr, w_ptr, n, sw, N, K, BN, BK).to(y_ptr.dtype.element_ty), mask=n < N)

    # Opaque to the compiler, which calls it inside the decode step's CUDA graph as it is.
    @torch.library.custom_op("shardlm::gemv", mutates_args=())
    def gemv(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, warps: int) -> torch.Tensor:
        """x [K] times w [N, K] (rows contiguous) transposed: [N]."""
        with on_device(x):
            n, k = w.shape
            y = x.new_empty(n)
            _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, w.stride(0), N=n, K=k, BN=bn, BK=bk, num_warps=warps,
                                                **pdl_launch(x))
            return y

    @gemv.register_fake
    def _(x, w, bn, bk, warps):
        return x.new_empty(w.shape[0])


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T runs as this kernel: one row of a static shape (a decode step's; a prefill
    compiled for any length would be guarded on its size), 16-bit, a plain weight with contiguous rows."""
    return (not torch.is_grad_enabled() and triton_ok(x) and hasattr(torch.library, "custom_op")
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dim() == 2 and weight.stride(1) == 1
            and all(isinstance(d, int) for d in x.shape) and x.numel() == weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by the kernel where `one_row`."""
    if not one_row(x, weight):
        return F.linear(x, weight, bias)
    y = torch.ops.shardlm.gemv(x.reshape(-1).contiguous(), weight, *launch(*weight.shape))
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
