"""Weight-only int4 linear layers with per-group scales (gpt-fast's int4): each output channel's weights in
groups of G inputs (128, else 64 or 32), each group rounded to 16 levels between its minimum and its maximum
(a scale and a minimum per group, in the model's dtype), so that a decode step, bound by reading the weights,
reads about a quarter of bf16's bytes.

A one-row product (batch-1 decode) pays only if its reading runs near the memory's rate, and a GEMV that walks
all of K for a few outputs per program does not: for layers of 4,096 outputs it has too few programs to hide
the memory's latency. So the packed weight is stored transposed, as GemLite's "GEMV RevSplit-K" stores it
(mobiusml/gemlite): int32 words [K/8, N], eight consecutive inputs of one output in a word, the outputs
contiguous, and K is split by groups: a program takes one group of one block of outputs, so that every layer
has thousands of programs, each warp's loads are whole cache lines and all of its threads read the same
inputs. GemLite adds the groups' partial sums with fp32 atomics into a zeroed output (a zeroing launch before,
a cast after, and an order of addition that changes from run to run); here each program writes its partial
sum to a workspace and counts itself in its output block's counter, and the last to arrive adds the block's
partials in group order, writes the output and sets the counter back to zero: one launch, the same bits every
run, and nothing to reset between calls (a CUDA graph replays it as it is). A few rows (2-64) go through a
tensor-core kernel that unpacks a group's tile in registers; elsewhere (prefill's many rows, the CPU, fp32)
the weight is dequantised whole and multiplied as usual: the same rounding, none of the speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..kernels import triton, triton_ok
from .int8 import unquantised

GROUPS = (128, 64, 32)  # the largest of these that divides a layer's input size is its group
MAX_ROWS = 64  # rows beyond which the product is the GPU's arithmetic, not the weight's reading
# The one-row kernel's outputs a program and warps: the best of an H200 sweep over llama2-7b's layers
# (bench/README.md, twenty-third lease); the few-row kernel's tile (rows, outputs; its K step is the group).
GEMV_BN, GEMV_WARPS = 128, 2
MM_BM, MM_BN = 16, 64


def group_size(k: int) -> int | None:
    """The int4 group of a layer of `k` inputs: the largest of GROUPS dividing it (each a multiple of the 8
    inputs of a word); None where none does, and the layer stays unquantised."""
    return next((g for g in GROUPS if k % g == 0), None)


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (integers 0..15) as int32 words [K/8, N]: word (r, n) holds q[n, 8r + j] in bits 4j..4j+3."""
    n, k = q.shape
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64)
    words = (q.t().reshape(k // 8, 8, n).to(torch.int64) << shifts[None, :, None]).sum(1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack's inverse: words [K/8, N] as q [K, N] (int32, 0..15), inputs along the first dimension."""
    r, n = words.shape
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    return ((words[:, None, :] >> shifts[None, :, None]) & 15).reshape(8 * r, n)  # & 15 drops the sign's bits


def quantize_weight(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] as (words [K/8, N] int32, scale [K/G, N], low [K/G, N]) in w's dtype: per output and group of
    `group` inputs, low = the minimum, scale = (maximum - minimum) / 15, q = round((w - low) / scale) in 0..15,
    rounded against the scale and minimum as stored (their dtype's)."""
    n, k = w.shape
    if k % group or group % 8:
        raise ValueError(f"int4 groups of {group} do not tile {k} inputs in words of 8")
    groups = w.detach().float().reshape(n, k // group, group)
    low = groups.amin(-1)
    scale = ((groups.amax(-1) - low) / 15).clamp_min(torch.finfo(w.dtype).tiny).to(w.dtype)
    low = low.to(w.dtype)
    q = ((groups - low.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    return pack(q.reshape(n, k)), scale.t().contiguous(), low.t().contiguous()


def dequantize(words: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype | None = None):
    """The weight [N, K] that `words`, `scale` and `low` stand for, q * scale + low of its group computed in
    fp32, in `dtype` (the scale's by default); a transposed view of a [K, N] tensor."""
    q = unpack(words)
    k, n = q.shape
    g = scale.shape[0]
    w = q.view(g, k // g, n) * scale.float()[:, None, :] + low.float()[:, None, :]
    return w.view(k, n).to(dtype or scale.dtype).t()


if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, lo_ptr, part_ptr, arrivals_ptr, y_ptr, N,
                          G: tl.constexpr, GROUPS: tl.constexpr, BN: tl.constexpr):
        pn, g = tl.program_id(0), tl.program_id(1)
        n = pn * BN + tl.arange(0, BN)
        ok = n < N
        r = g * (G // 8) + tl.arange(0, G // 8)  # the group's rows of words
        words = tl.load(w_ptr + r[:, None].to(tl.int64) * N + n[None, :], mask=ok[None, :], other=0)
        acc = tl.zeros([G // 8, BN], tl.float32)
        xs = tl.zeros([G // 8], tl.float32)
        for j in tl.static_range(8):  # the j-th nibble of every word: input 8r + j
            x = tl.load(x_ptr + r * 8 + j).to(tl.float32)
            # The nibble as the low mantissa bits of 2^23: the float 2^23 + q, less 2^23 exactly q.
            bits = ((words >> (4 * j)) & 15) | 0x4B000000
            acc += (bits.to(tl.float32, bitcast=True) - 8388608.0) * x[:, None]
            xs += x
        scale = tl.load(s_ptr + g * N + n, mask=ok, other=0.0).to(tl.float32)
        low = tl.load(lo_ptr + g * N + n, mask=ok, other=0.0).to(tl.float32)
        # sum_k x_k (q_k scale + low) over the group
        tl.store(part_ptr + g * N + n, tl.sum(acc, 0) * scale + tl.sum(xs, 0) * low, mask=ok)
        # Every thread's partial stored before one thread's atomic (acq_rel at GPU scope, Triton's default)
        # releases them to the last program of the block.
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + pn, 1) == GROUPS - 1:
            tl.debug_barrier()  # the atomic's acquire before any thread's loads
            total = tl.zeros([BN], tl.float32)
            for i in range(GROUPS):  # in group order: the same sum, bit for bit, whichever program came last
                # .cg: from L2, where the other programs' stores are, never a stale line of this SM's L1
                total += tl.load(part_ptr + i * N + n, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + n, total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(arrivals_ptr + pn, 0)  # every program of the block has counted: ready for the next call

    @triton.jit
    def _int4_mm_kernel(x_ptr, w_ptr, s_ptr, lo_ptr, y_ptr, M, N, sx, sy,
                        G: tl.constexpr, GROUPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        kk = tl.arange(0, G)
        acc = tl.zeros([BM, BN], tl.float32)
        for g in range(GROUPS):
            k = g * G + kk
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=m[:, None] < M, other=0.0)
            # each word read for its eight inputs (the same address: one read from memory), its nibble taken
            words = tl.load(w_ptr + (k // 8)[:, None].to(tl.int64) * N + n[None, :], mask=n[None, :] < N, other=0)
            q = (words >> ((k % 8) * 4)[:, None]) & 15
            scale = tl.load(s_ptr + g * N + n, mask=n < N, other=0.0).to(tl.float32)
            low = tl.load(lo_ptr + g * N + n, mask=n < N, other=0.0).to(tl.float32)
            xs = tl.sum(x.to(tl.float32), 1)
            acc += tl.dot(x, q.to(x.dtype)) * scale[None, :] + xs[:, None] * low[None, :]  # 0..15 exact in 16 bits
        tl.store(y_ptr + m[:, None] * sy + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(m[:, None] < M) & (n[None, :] < N))

    # An opaque custom op (as int8.py's): the compiler calls it as it is, inside the CUDA graph. The one-row
    # kernel counts its programs in `arrivals` and leaves it at zeros, as it found it.
    @torch.library.custom_op("shardlm::int4_mm", mutates_args=("arrivals",))
    def _int4_mm(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                 arrivals: torch.Tensor) -> torch.Tensor:
        (m, k), n, groups = x.shape, words.shape[1], scale.shape[0]
        y = x.new_empty(m, n)
        if m == 1:
            part = torch.empty(groups, n, device=x.device, dtype=torch.float32)  # each group's partial sums
            _int4_gemv_kernel[(triton.cdiv(n, GEMV_BN), groups)](
                x, words, scale, low, part, arrivals, y, n, G=k // groups, GROUPS=groups, BN=GEMV_BN,
                num_warps=GEMV_WARPS)
            return y
        _int4_mm_kernel[(triton.cdiv(n, MM_BN), triton.cdiv(m, MM_BM))](
            x, words, scale, low, y, m, n, x.stride(0), y.stride(0), G=k // groups, GROUPS=groups, BM=MM_BM,
            BN=MM_BN)
        return y

    @_int4_mm.register_fake
    def _(x, words, scale, low, arrivals):
        return x.new_empty(x.shape[0], words.shape[1])


def kernel_ok(x: torch.Tensor) -> bool:
    return triton_ok(x) and hasattr(torch.library, "custom_op") and x.dtype in (torch.bfloat16, torch.float16)


def int4_linear(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                arrivals: torch.Tensor) -> torch.Tensor:
    """x [..., K] times the int4 weight [N, K] that `words` [K/8, N], `scale` and `low` [K/G, N] stand for,
    transposed: [..., N]. `arrivals`: int32 zeros, one per GEMV_BN outputs, which the one-row kernel counts in
    (and leaves at zeros); a layer's products run one at a time."""
    rows = x.numel() // x.shape[-1]
    if 0 < rows <= MAX_ROWS and kernel_ok(x):
        y = torch.ops.shardlm.int4_mm(x.reshape(rows, x.shape[-1]).contiguous(), words, scale, low, arrivals)
        return y.view(*x.shape[:-1], words.shape[1])
    return F.linear(x, dequantize(words, scale, low, x.dtype))


class Int4Linear(nn.Module):
    """`linear` with its weight in int4 (buffers `words` [in/8, out] int32, `scale` and `low` [in/G, out] in the
    weight's dtype; `arrivals`, the one-row kernel's counters, outside the state dict); keeps its bias and a
    low-rank adapter set on it (`lora`: inference/adapters.py adds one per request row)."""

    def __init__(self, linear: nn.Linear, group: int | None = None):
        super().__init__()
        k, n = linear.in_features, linear.out_features
        self.group = group or group_size(k)
        if self.group is None:
            raise ValueError(f"int4 needs an input size that a group of {', '.join(map(str, GROUPS))} divides, "
                             f"not {k}")
        words, scale, low = quantize_weight(linear.weight, self.group)
        self.register_buffer("words", words)
        self.register_buffer("scale", scale)
        self.register_buffer("low", low)
        self.register_buffer("arrivals", torch.zeros(-(-n // GEMV_BN), dtype=torch.int32, device=words.device),
                             persistent=False)
        self.bias = linear.bias
        self.lora = getattr(linear, "lora", None)
        self.in_features, self.out_features = k, n

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_linear(x, self.words, self.scale, self.low, self.arrivals)
        if self.bias is not None:
            y = y + self.bias
        return y if self.lora is None else y + self.lora(x)


def to_int4(model: nn.Module) -> int:
    """Every nn.Linear of `model`'s blocks whose input size a group divides as an Int4Linear, in place; how
    many (ConfigError where none). The output head stays in 16 bits, as int8's (to_int8)."""
    kept = unquantised(model)
    swapped = 0
    for block in model.blocks():
        for name, m in list(block.named_modules()):
            if isinstance(m, nn.Linear) and id(m) not in kept and group_size(m.in_features):
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent) if parent else block, leaf, Int4Linear(m))
                swapped += 1
    if not swapped:
        raise ConfigError(f"--quantize int4: none of this model's linear layers can be quantised (int4 needs an "
                          f"input size that a group of {', '.join(map(str, GROUPS))} divides)")
    return swapped
