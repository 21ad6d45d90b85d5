"""Grouped GEMMs for mixture-of-experts layers: rows sorted by expert, each group times its own weight, in one
kernel (`torch._grouped_mm`, as Megatron-core's and transformers' grouped experts run) where the device, dtype
and shapes allow it, else a loop over experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .lazy_compiler import eager


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x [N, in] whose rows are sorted into groups of counts[e] rows, weight [E, out, in]: each group times
    its weight transposed, [N, out]. Rows past the groups (sum counts < N) are padding, whose outputs are
    never read: the grouped kernel leaves them unwritten, the loop writes zeros. `impl`: grouped
    (torch._grouped_mm), loop, or auto (grouped where this device, dtype and the shapes allow it)."""
    if impl == "grouped" or (impl == "auto" and grouped_available(x, weight)):
        if x.device.type == "cpu" and torch.compiler.is_compiling():
            return _eager_grouped_mm(x, weight, counts)  # the compiler's shape rules are the GPU kernel's (bf16)
        return _grouped_mm(x, weight, counts)
    ends = counts.tolist()  # one host sync for the group sizes
    ends.append(x.shape[0] - sum(ends))
    parts = [F.linear(xe, weight[e]) if e < len(weight) else x.new_zeros(ends[e], weight.shape[1])
             for e, xe in enumerate(x.split(ends)) if ends[e]]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def _grouped_mm(x, weight, counts):
    offsets = counts.cumsum(0).to(torch.int32)  # the kernels take int32 offsets: each group's end row
    # The backward of _grouped_mm (torch 2.13's CPU one) refuses a gradient with a stride 0 (from a sum) or
    # transposed: hand it a contiguous one.
    return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets))


_eager_grouped_mm = eager(_grouped_mm)


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


_PROBED: dict = {}


def grouped_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm on CUDA needs bf16 on Hopper or newer; on the CPU, where the build has it, rows whose
    strides are multiples of 16 bytes (probed once per device type and dtype: older builds lack it there)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    size = x.element_size()
    if (x.shape[-1] * size) % 16 or (weight.shape[-2] * size) % 16:
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu":
        return False
    key = (x.device.type, x.dtype)
    if key not in _PROBED:
        _PROBED[key] = _probe(x.dtype)
    return _PROBED[key]


@eager  # run, not traced, when the first call comes from a compiled block
def _probe(dtype) -> bool:
    """Whether the CPU's _grouped_mm runs forward and backward. Its tensors are its own: apart from any
    autograd state of the caller (no_grad, inference mode, a checkpoint's saved-tensor hooks, which would
    count them as the first forward's and find them missing from the recomputation)."""
    same = lambda t: t  # noqa: E731
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(same, same):
            a = torch.ones(2, 8, dtype=dtype, requires_grad=True)
            w = torch.ones(2, 8, 8, dtype=dtype, requires_grad=True)
            y = torch._grouped_mm(a, w.transpose(-2, -1), offs=torch.tensor([1, 2], dtype=torch.int32))
            y.backward(torch.ones_like(y))
            return bool(torch.equal(y.detach(), torch.full_like(y, 8)))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
