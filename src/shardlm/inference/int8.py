"""Weight-only int8 linear layers (gpt-fast's int8, the symmetric per-channel scheme of torchao's
Int8WeightOnlyConfig): each output channel's weights rounded to int8 against one scale, its largest magnitude
over 127.5, so that a decode step, bound by reading the weights, reads half the bytes of bf16.

The product must read them as int8 for that to pay: `mm(x, w.to(bf16)) * scale` (torchao's, compiled by
Inductor) ran at 0.86x bf16 on an H200, its fused reductions reading about 0.9 TB/s (bench/README.md). Here,
for the few rows of a decode step on a GPU, a Triton kernel loads int8 tiles, converts them in registers and
multiplies on the tensor cores (tl.dot), each program 32 output channels over all of K; for one row (batch-1
decode) a matrix-vector kernel on the CUDA cores instead, which reads the weight as words of four bytes,
converts two bytes at a time with one bitwise operation (each byte the mantissa of a half by its bits, as
FasterTransformer's and Marlin's fast int-to-float conversions do), multiplies them by their inputs two at a time
in f16x2 registers and holds several rows a thread, so that an input's load and conversion serve all of them:
that kernel is bound by the instructions it issues a byte. Its inputs go into fp16 as they are (exact from
2^-14 to 65504 in magnitude, a bf16's 8 bits inside fp16's 11; below, to 2^-24), its weights as w / 256 (exact),
so a product is at most half its input and no sum overflows before its inputs would: fp16's roundings of the
products and of each word's two-term sums (2^-11 of them) stay far inside int8's own rounding: emulated
(bench/int8_input_rounding.py, K 4096) 2.4-2.7e-4 of the output at inputs of rms 1 to 1e-3 and 1.3e-3 at 1e-4,
against int8's 8e-3; with the inputs scaled by 2^-10 instead, as first written, 1.9e-2 at 1e-3.
Elsewhere (prefill's many rows, the CPU) the weight is dequantised whole and multiplied as usual.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import RunError
from ..kernels import on_device, packed_ok, pdl_launch, triton, triton_ok, wait_for_inputs

MAX_ROWS = 64  # rows beyond which the product is the GPU's arithmetic, not the weight's reading
CHUNK = 2048  # outputs quantised at a time
BM = 16
# Launch blocks (BN, BK, warps, stages) for layers of fewer than WIDE outputs (whose 32-row tiles give about one
# program an SM) and for the others: each the best for llama2-7b's layers of its kind in an H200 sweep over
# BN 16-64, BK 128-256, 4-8 warps, 3-5 stages (bench/README.md).
WIDE = 8192
NARROW_LAUNCH = (32, 256, 4, 5)
WIDE_LAUNCH = (64, 256, 4, 3)
# The one-row kernel's (BN, BK, warps, stages), narrow and wide: with its f16x2 dots llama2-7b's products took
# 478 us on an H200 at (8, 1024, 4, 2) against 499-624 at BN 8-32, BK 512-2048 and 4-8 warps
# (bench/quantized_gemv.py --int8-launches; the fp32 dots' best, 557 us, at (16, 1024, 4, 2)).
GEMV_NARROW_LAUNCH = (8, 1024, 4, 2)
GEMV_WIDE_LAUNCH = (8, 1024, 4, 2)
MAGIC = 0x4B000000  # 2^23's bits

if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def _int8_mm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, sx, sw, sy, K: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K),
                        other=0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        scale = tl.load(s_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + m[:, None] * sy + n[None, :], (acc * scale[None, :]).to(y_ptr.dtype.element_ty),
                 mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _byte(words, mask: tl.constexpr, magic, offset: tl.constexpr):
        # The byte under `mask` (its sign bit flipped: w + 128) OR-ed into the mantissa of 2^23, less `offset`
        # (2^23 and the 128 at the byte's place): w 256^i exactly. `magic` (2^23's bits) is a runtime value, so
        # that the AND and the OR are one instruction: with both constants immediate the compiler emits two.
        return ((words & mask) | magic).to(tl.float32, bitcast=True) - offset

    @triton.jit
    def _dot4_f16x2(words, x02, x13):
        # A word's 4 bytes times their inputs, two at a time in f16x2 registers (FasterTransformer's
        # conversion): each byte's sign flipped (w + 128) and set by one PRMT as the low byte of a half whose
        # high byte is 0x64 (1024 + w + 128, exact in fp16's 10-bit mantissa), times 2^-8 less 4.5 (one HFMA2)
        # the exact w / 256; then one HFMA2 of the pair of inputs (x_j, x_j+2, as they are in fp16): a product
        # at most half an input, so a word's two-term sums overflow no sooner than the inputs themselves. The
        # halves' sum to fp32 once per word.
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 u, h0, h1, a, c, s, m;
            .reg .b16 lo, hi;
            .reg .f32 f0, f1;
            mov.b32 c, 0x64646464;
            mov.b32 s, 0x1C001C00;
            mov.b32 m, 0xC480C480;
            xor.b32 u, $1, 0x80808080;
            prmt.b32 h0, u, c, 0x4240;
            prmt.b32 h1, u, c, 0x4341;
            fma.rn.f16x2 h0, h0, s, m;
            fma.rn.f16x2 h1, h1, s, m;
            mul.rn.f16x2 a, h0, $2;
            fma.rn.f16x2 a, h1, $3, a;
            mov.b32 {lo, hi}, a;
            cvt.f32.f16 f0, lo;
            cvt.f32.f16 f1, hi;
            add.rn.f32 f0, f0, f1;
            mov.b32 $0, f0;
            }""",
            constraints="=r,r,r,r", args=[words, x02, x13], dtype=tl.int32, is_pure=True,
            pack=1).to(tl.float32, bitcast=True)

    @triton.jit
    def _half_pair(lo, hi):
        # fp32 lo and hi as one f16x2 word (cvt.rn.f16x2.f32, sm_80+): a bf16 input is exact in fp16 from 2^-14
        # to 65504 in magnitude (fp16's 11 bits hold bf16's 8), below it a multiple of 2^-24.
        return tl.inline_asm_elementwise(
            asm="""{ cvt.rn.f16x2.f32 $0, $2, $1; }""",
            constraints="=r,r,r", args=[lo, hi], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, sw, magic, K: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, HALF2: tl.constexpr, PDL: tl.constexpr = False):
        # BN outputs a program, BK inputs a step, the weight read as int32 words of 4 bytes (K and the row stride
        # multiples of 4). A thread holds several rows at the same inputs, so that each input is loaded and
        # converted once for all of them: the kernel is bound by the instructions it issues a byte, not by the
        # memory. HALF2 (sm_80+): _dot4_f16x2, 4.1 instructions a byte counted in its loop; otherwise (Triton's
        # interpreter) each byte to fp32 by its bits, 5.2 counted, 3.5 at the least: a quarter of a sign flip and
        # of a shift, an AND-OR, a subtraction, an FMA.
        wait_for_inputs(PDL)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        w32 = w_ptr.to(tl.pointer_type(tl.int32))
        c = tl.arange(0, BK // 4)
        j = tl.arange(0, 4)
        acc = tl.zeros([BN, BK // 4], tl.float32)
        for k0 in range(0, K, BK):
            kw = k0 // 4 + c
            ok = kw < K // 4
            words = tl.load(w32 + n[:, None].to(tl.int64) * (sw // 4) + kw[None, :],
                            mask=(n[:, None] < N) & ok[None, :], other=0, eviction_policy="evict_first")
            xr = tl.load(x_ptr + (4 * kw)[:, None] + j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            even, odd = tl.split(tl.reshape(xr, [BK // 4, 2, 2]))  # inputs 4c + (0, 2) and (1, 3)
            x0, x2 = tl.split(even)
            x1, x3 = tl.split(odd)
            if HALF2:
                acc += _dot4_f16x2(words, _half_pair(x0, x2)[None, :], _half_pair(x1, x3)[None, :])
            else:
                words ^= -2139062144  # 0x80808080: each byte's sign bit flipped, w + 128 in 0..255
                high = words >> 16  # bytes 2 and 3 at bits 0-15: each below 2^23 once OR-ed
                acc += _byte(words, 0xFF, magic, 8388736.0) * x0[None, :]
                acc += _byte(words, 0xFF00, magic, 8421376.0) * (x1 * 2.0 ** -8)[None, :]
                acc += _byte(high, 0xFF, magic, 8388736.0) * x2[None, :]
                acc += _byte(high, 0xFF00, magic, 8421376.0) * (x3 * 2.0 ** -8)[None, :]
        scale = tl.load(s_ptr + n, mask=n < N, other=0.0).to(tl.float32) * (256.0 if HALF2 else 1.0)
        tl.store(y_ptr + n, (tl.sum(acc, 1) * scale).to(y_ptr.dtype.element_ty), mask=n < N)

    def int8_gemv(x, w, scale, y=None, launch: tuple | None = None) -> torch.Tensor:
        """The one-row kernel, x [1, K] (K, w's row stride and address multiples of 4): y [1, N] (new, or given);
        `launch` (BN, BK, warps, stages), else GEMV_WIDE_LAUNCH or GEMV_NARROW_LAUNCH by the layer's outputs
        (bench/quantized_gemv.py's sweep passes its own)."""
        (_, k), n = x.shape, w.shape[0]
        y = x.new_empty(1, n) if y is None else y
        bn, bk, warps, stages = launch or (GEMV_WIDE_LAUNCH if n >= WIDE else GEMV_NARROW_LAUNCH)
        _int8_gemv_kernel[(triton.cdiv(n, bn),)](x, w, scale, y, n, w.stride(0), MAGIC, K=k, BN=bn, BK=bk,
                                                 HALF2=packed_ok(x), num_warps=warps, num_stages=stages,
                                                 **pdl_launch(x))
        return y

    # An opaque custom op (as decode_attention.py's): the compiler calls it as it is, inside the CUDA graph.
    @torch.library.custom_op("shardlm::int8_mm", mutates_args=())
    def _int8_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        with on_device(x):
            (m, k), n = x.shape, w.shape[0]
            y = x.new_empty(m, n)
            if m == 1 and k % 4 == 0 and w.stride(0) % 4 == 0 and w.data_ptr() % 4 == 0:
                return int8_gemv(x, w, scale, y)
            bn, bk, warps, stages = WIDE_LAUNCH if n >= WIDE else NARROW_LAUNCH
            _int8_mm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, BM))](
                x, w, scale, y, m, n, x.stride(0), w.stride(0), y.stride(0), K=k, BM=BM, BN=bn, BK=bk,
                num_warps=warps, num_stages=stages)
            return y

    @_int8_mm.register_fake
    def _(x, w, scale):
        return x.new_empty(x.shape[0], w.shape[0])


def kernel_ok(x: torch.Tensor) -> bool:
    return triton_ok(x) and hasattr(torch.library, "custom_op") and x.dtype in (torch.bfloat16, torch.float16)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] times the int8 `weight` [N, K] with per-channel `scale` [N], transposed: [..., N]."""
    rows = x.numel() // x.shape[-1]
    if rows <= MAX_ROWS and kernel_ok(x):
        y = torch.ops.shardlm.int8_mm(x.reshape(rows, x.shape[-1]).contiguous(), weight, scale)
        return y.view(*x.shape[:-1], weight.shape[0])
    # Scaled before the product: Inductor rewrites `mm(x, w.to(bf16)) * scale` into aten's
    # _weight_int8pack_mm, whose CUDA kernel took 14 ms for one of llama2-7b's prefill products.
    return F.linear(x, weight.to(x.dtype) * scale[:, None])


def check_finite(scale: torch.Tensor, kind: str, shape, first: int = 0) -> None:
    """Refuses a weight (of `shape`) whose scales, per output `first`.. and group, came out inf or NaN: a weight
    holding inf or NaN, or a range beyond fp32's. Quantised, their levels and every other weight of the group
    would be garbage, silently (int4's NaN levels, cast to integers, even set another nibble's top bit)."""
    bad = ~torch.isfinite(scale.reshape(len(scale), -1))
    if bad.any():
        row, group = bad.nonzero()[0].tolist()
        where = f"output {first + row}" + (f", group {group}" if scale.dim() > 1 else "")
        raise RunError(f"--quantize {kind}: the weight [{', '.join(map(str, shape))}] holds inf or NaN (or a range "
                       f"beyond fp32's) at {where}: its scale is {scale.reshape(len(scale), -1)[row, group].item()}")


class Int8Linear(nn.Module):
    """`linear` with its weight in int8 (buffers `weight` [out, in] int8 and `scale` [out]); keeps its bias
    and a low-rank adapter set on it (`lora`: inference/adapters.py adds one per request row)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
        scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for i in range(0, w.shape[0], CHUNK):  # a vocabulary head's fp32 temporaries whole would be gigabytes
            rows = w[i:i + CHUNK].float()
            scale[i:i + CHUNK] = rows.abs().amax(1).clamp_min(1e-12) / 127.5
            check_finite(scale[i:i + CHUNK], "int8", w.shape, i)
            q[i:i + CHUNK] = (rows / scale[i:i + CHUNK, None]).round().clamp(-128, 127)
        self.register_buffer("weight", q)
        self.register_buffer("scale", scale.to(w.dtype))
        self.bias = linear.bias
        self.lora = getattr(linear, "lora", None)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear(x, self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y if self.lora is None else y + self.lora(x)


def unquantised(model: nn.Module) -> set[int]:
    """The ids of the linear layers that weight-only quantisation leaves as they are: those a module names in its
    `unquantised` (model/moe.py's router, whose weight route() reads itself, in fp32)."""
    return {id(getattr(m, name)) for m in model.modules() for name in getattr(m, "unquantised", ())}


def int8_block(block: nn.Module, kept: set[int]) -> None:
    """Every nn.Linear of `block` but those in `kept` (unquantised) as an Int8Linear, in place."""
    for name, m in list(block.named_modules()):
        if isinstance(m, nn.Linear) and id(m) not in kept:
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, Int8Linear(m))


def to_int8(model: nn.Module) -> int:
    """Every nn.Linear of `model`'s blocks as an Int8Linear, in place (those that are not yet); how many the
    blocks hold. The output head is not one of them: quantize.quantize_head stores it in int8 (QuantizedHead)
    for both --quantize kinds."""
    kept = unquantised(model)
    for block in model.blocks():
        int8_block(block, kept)
    return sum(isinstance(m, Int8Linear) for block in model.blocks() for m in block.modules())
