"""Weight-only int4 linear layers with per-group scales and integer zero points (the asymmetric scheme of GPTQ's and
AWQ's checkpoints): each output channel's weights in groups of G inputs (128, else 64 or 32), each group rounded to
16 levels spanning its range and 0 (a scale in the model's dtype and the level of 0, a byte, per group), so that a
decode step, bound by reading the weights, reads about a quarter of bf16's bytes.

A one-row product (batch-1 decode) pays only if its reading runs near the memory's rate. A quarter of bf16's bytes
makes every product short, so what a launch costs besides its reading counts four times as much: a split-K GEMV
(GemLite's RevSplit-K: a program per group of inputs, partial sums added by atomics or by the last program to
arrive) pays two more trips through memory per product. So the packed weight is stored as the one-row kernel reads
it (as Marlin and gpt-fast's tinygemm store theirs, in their own tiles): int32 words [N/8, K/8, 8], eight
consecutive inputs of one output a word, each block of 8 outputs one contiguous run along K, its scales and zero
points beside it ([N/8, K/G, 8]). A program streams one block's run with wide loads, keeps a partial per row of
words and output in fp32, and sums them once at the end: one launch, no workspace, the same bits every run. It is
bound by the instructions it issues per nibble, not by the memory: each nibble becomes a number by its bits (OR-ed
into a float's mantissa, one instruction) rather than by a conversion instruction, whose throughput is a sixteenth
of an FMA's; for bf16, two nibbles at a time in bf16x2 registers, where the integer zero point makes q - zero exact
in one packed instruction and a second multiplies and adds the pair (3.5 instructions a nibble counted in its loop,
4.8 in fp32), and all else is done once per row. A few rows (2-64) go through int4_mm, in one of three forms:
tensor-core kernels that unpack the nibbles in registers, K split over programs until the launch fills the GPU (a
layer of 4,096 outputs has 64 tiles of 16 rows) and the splits summed in a fixed order, either a group's [G, BN]
tile at a time ("tiles": each word loaded once per input it holds, so its nibble is a per-input shift) or 128
inputs' words loaded once as eight nibble planes ("planes": a shift common to the plane, eight dots of x's columns
j::8); or the weight written whole in the model's dtype by one Triton pass and multiplied by cuBLAS ("dequant": the
tensor cores at their own rate, at the cost of writing and reading the bf16 weight). Elsewhere (prefill's many
rows, the CPU, fp32) the weight is dequantised whole in the model's dtype by torch and multiplied as usual.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..kernels import on_device, packed_ok, pdl_launch, triton, triton_ok, wait_for_inputs
from .int4_format import BLOCK, GROUPS, dequantize, eligible, group_size, quantize_weight
from .int8 import unquantised

MAX_ROWS = 64  # rows beyond which the product is the GPU's arithmetic, not the weight's reading
# The one-row kernel's word rows a step and warps: on an H200 (bf16, bf16x2 dots) llama2-7b's products took 362
# us at 128 rows and 4 warps against 364-445 at 128-512 rows and 2-8 warps (bench/quantized_gemv.py --gemv-rows).
GEMV_ROWS, GEMV_WARPS = 128, 4
MAGIC = 0x4B000000  # 2^23's bits, a float's mantissa that an OR-ed integer below 2^23 adds to exactly
# The few-row product's form (int4_mm: tiles, planes or dequant), tile (rows, outputs) and warps; its system
# int4-mm in bench/quantized_gemv.py sweeps them. Up to MM_PLANES_ROWS rows "planes" (llama2-7b's products at 2
# and 16 rows on an H200: 2.2-3.0x "tiles"), beyond them "dequant" (at 64 rows 1.13x "tiles" of 64 rows).
MM_FORM, MM_BM, MM_BN, MM_WARPS = "planes", 16, 128, 4
MM_PLANES_ROWS = 16  # inferred: 17-32 rows were not timed (planes' 16-row tiles would read the weight twice)
MM_DEQUANT_ROWS = 128  # rows of words a program of the dequantising pass (64: 0.5% slower in the same sweep)
MM_PROGRAMS = 512  # the few-row kernel splits K until its launch has about this many programs (4 an SM)


if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    @triton.jit
    def _nibble(words, mask: tl.constexpr, magic):
        # The nibble under `mask` OR-ed into the mantissa of 2^23 (kept below 2^23 by the masks chosen): the float
        # 2^23 + q 2^i, less 2^23 exactly q 2^i. `magic` (2^23's bits) is a runtime value, so that the AND and the
        # OR are one instruction: with both constants immediate the compiler emits two.
        return ((words & mask) | magic).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _dot8_bf16x2(words, x04, x15, x26, x37, zero2):
        # One word's 8 nibbles times their inputs, two at a time in bf16x2 (Marlin's and FasterTransformer's
        # conversion): nibbles j and j + 4 (bits 4j and 16 + 4j) OR-ed into the mantissas of two bf16 128s (one
        # LOP3), plus zero2 (-(128 + zero) in both halves; one HFMA2) the exact integers q - zero, then one HFMA2
        # of the pair of inputs (x_j, x_j+4). Two packed instructions a pair of nibbles where fp32 takes three
        # each; bf16's rounding of the four-term sums is far below int4's own (tests/test_gpu.py bounds it).
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, h, a, m, one, nz;
            mov.b32 m, 0x43004300;
            mov.b32 one, 0x3F803F80;
            mov.b32 nz, 0x80008000;
            lop3.b32 h, $1, 0x000F000F, m, 0xEA;
            fma.rn.bf16x2 h, h, one, $6;
            fma.rn.bf16x2 a, h, $2, nz;
            shr.u32 t, $1, 4;
            lop3.b32 h, t, 0x000F000F, m, 0xEA;
            fma.rn.bf16x2 h, h, one, $6;
            fma.rn.bf16x2 a, h, $3, a;
            shr.u32 t, $1, 8;
            lop3.b32 h, t, 0x000F000F, m, 0xEA;
            fma.rn.bf16x2 h, h, one, $6;
            fma.rn.bf16x2 a, h, $4, a;
            shr.u32 t, $1, 12;
            lop3.b32 h, t, 0x000F000F, m, 0xEA;
            fma.rn.bf16x2 h, h, one, $6;
            fma.rn.bf16x2 $0, h, $5, a;
            }""",
            constraints="=r,r,r,r,r,r,r", args=[words, x04, x15, x26, x37, zero2], dtype=tl.int32, is_pure=True,
            pack=1)

    @triton.jit
    def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, magic, K: tl.constexpr, G: tl.constexpr,
                          ROWS: tl.constexpr, BF16X2: tl.constexpr, PDL: tl.constexpr = False):
        # One program a block of 8 outputs: it streams the block's contiguous run of words along K, ROWS rows
        # of words a step, a thread a row: its words (one per output) and its 8 inputs, each read once and
        # taken apart in registers. The kernel is bound by the instructions it issues per nibble, so everything
        # else is done once per row, not once per nibble. BF16X2 (bf16 on sm_80+): _dot8_bf16x2; otherwise (fp16,
        # Triton's interpreter) each nibble to fp32 by its bits (an AND-OR, a subtraction, an FMA).
        wait_for_inputs(PDL)
        b = tl.program_id(0).to(tl.int64)
        o = tl.arange(0, 8)
        w_ptr += b * (K // 8) * 8
        meta = b * (K // G) * 8
        RG: tl.constexpr = G // 8  # rows of words a group
        acc = tl.zeros([ROWS, 8], tl.float32)
        acc_zero = tl.zeros([ROWS, 8], tl.float32)
        for r0 in range(0, K // 8, ROWS):
            r = r0 + tl.arange(0, ROWS)
            ok = r < K // 8
            at = r[:, None] * 8 + o[None, :]
            words = tl.load(w_ptr + at, mask=ok[:, None], other=0, eviction_policy="evict_first")
            g = meta + (r // RG)[:, None] * 8 + o[None, :]  # each row's group
            scale = tl.load(s_ptr + g, mask=ok[:, None], other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + g, mask=ok[:, None], other=0).to(tl.int32)
            if BF16X2:
                # inputs 8r..8r+7 as four words of two bf16s, paired (x_j, x_j+4) as the nibbles are
                xw = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + r[:, None] * 4 + tl.arange(0, 4)[None, :],
                             mask=ok[:, None], other=0)
                even, odd = tl.split(tl.reshape(xw, [ROWS, 2, 2]))
                x01, x45 = tl.split(even)
                x23, x67 = tl.split(odd)
                x04 = (x45 << 16) | (x01 & 0xFFFF)
                x15 = (x45 & -65536) | ((x01 >> 16) & 0xFFFF)
                x26 = (x67 << 16) | (x23 & 0xFFFF)
                x37 = (x67 & -65536) | ((x23 >> 16) & 0xFFFF)
                zero2 = (zero | 0xC300) * 65537  # -(128 + zero) as bf16's bits, in both halves
                dot = _dot8_bf16x2(words, x04[:, None], x15[:, None], x26[:, None], x37[:, None], zero2)
                part = (dot << 16).to(tl.float32, bitcast=True) + (dot & -65536).to(tl.float32, bitcast=True)
                acc += part * scale  # sum_k x_k (q_k - zero) scale over the row's 8 inputs
            else:
                xr = tl.load(x_ptr + at, mask=ok[:, None], other=0.0).to(tl.float32)  # inputs 8r..8r+7
                even, odd = tl.split(tl.reshape(xr, [ROWS, 4, 2]))
                e0, e1 = tl.split(tl.reshape(even, [ROWS, 2, 2]))
                o0, o1 = tl.split(tl.reshape(odd, [ROWS, 2, 2]))
                x0, x4 = tl.split(e0)
                x2, x6 = tl.split(e1)
                x1, x5 = tl.split(o0)
                x3, x7 = tl.split(o1)
                # Nibbles 0-4 in place (q 2^(4j) stays below 2^23 up to j = 4), 5-7 from the word shifted by 12;
                # each x scaled by the nibble's power of two (exact), so each product is q x.
                high = words >> 12
                part = _nibble(words, 0xF, magic) * x0[:, None]
                part += _nibble(words, 0xF0, magic) * (x1 * 2.0 ** -4)[:, None]
                part += _nibble(words, 0xF00, magic) * (x2 * 2.0 ** -8)[:, None]
                part += _nibble(words, 0xF000, magic) * (x3 * 2.0 ** -12)[:, None]
                part += _nibble(words, 0xF0000, magic) * (x4 * 2.0 ** -16)[:, None]
                part += _nibble(high, 0xF00, magic) * (x5 * 2.0 ** -8)[:, None]
                part += _nibble(high, 0xF000, magic) * (x6 * 2.0 ** -12)[:, None]
                part += _nibble(high, 0xF0000, magic) * (x7 * 2.0 ** -16)[:, None]
                acc += part * scale  # sum_k x_k (q_k - zero) scale, in two FMAs an output
                acc_zero += tl.sum(xr, 1)[:, None] * (zero.to(tl.float32) * scale)
        tl.store(y_ptr + b * 8 + o, tl.sum(acc - acc_zero, 0).to(y_ptr.dtype.element_ty))

    @triton.jit
    def _int4_mm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, M, N, sx, K: tl.constexpr, G: tl.constexpr,
                        SPLIT: tl.constexpr, BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # form "tiles": a tile of BM rows by BN outputs over SPLIT groups of inputs (the third program index picks
        # which); its fp32 partial to part[split], the splits summed apart in a fixed order.
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        split = tl.program_id(2)
        nb, no = (n // 8).to(tl.int64), n % 8
        kk = tl.arange(0, G)
        # The nibble OR-ed into the mantissa of 128 (bf16) or 1024 (fp16) is that number plus q, exactly, and
        # less it exactly q: no int-to-float conversion, whose throughput is a sixteenth of an FMA's.
        MAGIC: tl.constexpr = 0x4300 if BF16 else 0x6400
        OFFSET: tl.constexpr = 128.0 if BF16 else 1024.0
        acc = tl.zeros([BM, BN], tl.float32)
        for i in range(SPLIT):
            g = split * SPLIT + i
            live = g < K // G  # the last split may hold fewer groups
            k = g * G + kk
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=(m[:, None] < M) & live, other=0.0)
            # each word read for its eight inputs (the same address: one read from memory), its nibble taken
            words = tl.load(w_ptr + (nb[None, :] * (K // 8) + (k // 8)[:, None]) * 8 + no[None, :],
                            mask=(n[None, :] < N) & live, other=0)
            q = (((words >> ((k % 8) * 4)[:, None]) & 15) | MAGIC).to(tl.int16).to(x.dtype, bitcast=True) - OFFSET
            at = (nb * (K // G) + g) * 8 + no
            scale = tl.load(s_ptr + at, mask=(n < N) & live, other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + at, mask=(n < N) & live, other=0).to(tl.float32)
            xs = tl.sum(x.to(tl.float32), 1)
            # sum_k x_k (q_k - zero) scale
            acc += (tl.dot(x, q.to(x.dtype)) - xs[:, None] * zero[None, :]) * scale[None, :]
        tl.store(part_ptr + (split * M + m[:, None]).to(tl.int64) * N + n[None, :], acc,
                 mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _int4_planes_kernel(x_ptr, w_ptr, s_ptr, z_ptr, part_ptr, M, N, sx, K: tl.constexpr, G: tl.constexpr,
                            SPLIT: tl.constexpr, BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # form "planes": as "tiles", over SPLIT chunks of 128 inputs (16 rows of words, tl.dot's least K), each
        # word loaded once; its nibble j of every word (inputs j::8) one plane [16, BN] and one tl.dot with x's
        # columns j::8. A chunk of one group takes its scale after the sum; one of several groups cannot (a dot
        # sums across them), so its planes are dequantised first, in fp32 then x's dtype (dequantize's rounding).
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        m = tl.program_id(1) * BM + tl.arange(0, BM)
        nb, no = (n // 8).to(tl.int64), n % 8
        MAGIC: tl.constexpr = 0x4300 if BF16 else 0x6400
        OFFSET: tl.constexpr = 128.0 if BF16 else 1024.0
        acc = tl.zeros([BM, BN], tl.float32)
        for i in range(SPLIT):
            c = tl.program_id(2) * SPLIT + i
            r = c * 16 + tl.arange(0, 16)
            ok = (r < K // 8)[:, None] & (n < N)[None, :]
            words = tl.load(w_ptr + (nb[None, :] * (K // 8) + r[:, None]) * 8 + no[None, :], mask=ok, other=0)
            if G < 128:
                at = (nb[None, :] * (K // G) + (r // (G // 8))[:, None]) * 8 + no[None, :]  # each row's group
                scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + at, mask=ok, other=0).to(tl.float32)
            else:
                at = (nb * (K // G) + c) * 8 + no
                scale = tl.load(s_ptr + at, mask=(n < N) & (c < K // G), other=0.0).to(tl.float32)
                zero = tl.load(z_ptr + at, mask=(n < N) & (c < K // G), other=0).to(tl.float32)
            part = tl.zeros([BM, BN], tl.float32)
            xs = tl.zeros([BM], tl.float32)
            for j in tl.static_range(8):
                x = tl.load(x_ptr + m[:, None] * sx + r[None, :] * 8 + j,
                            mask=(m[:, None] < M) & (r < K // 8)[None, :], other=0.0)
                q = (((words >> (4 * j)) & 15) | MAGIC).to(tl.int16).to(x.dtype, bitcast=True) - OFFSET
                if G < 128:
                    q = (q.to(tl.float32) - zero) * scale
                else:
                    xs += tl.sum(x.to(tl.float32), 1)
                part += tl.dot(x, q.to(x.dtype))
            if G < 128:
                acc += part
            else:
                acc += (part - xs[:, None] * zero[None, :]) * scale[None, :]
        tl.store(part_ptr + (tl.program_id(2) * M + m[:, None]).to(tl.int64) * N + n[None, :], acc,
                 mask=(m[:, None] < M) & (n[None, :] < N))

    @triton.jit
    def _int4_dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, K: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr):
        # ROWS rows of words of one block of 8 outputs, read once along K as stored, written as the weight's 8
        # rows of ROWS * 8 inputs: w = (q - zero) * scale in fp32 (exact), then rounded to the dtype.
        b = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        o = tl.arange(0, 8)
        ok = (r < K // 8)[:, None]
        words = tl.load(w_ptr + (b * (K // 8) + r[:, None]) * 8 + o[None, :], mask=ok, other=0)
        at = (b * (K // G) + (r // (G // 8))[:, None]) * 8 + o[None, :]
        scale = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + at, mask=ok, other=0).to(tl.float32)
        bits = ((words[:, :, None] >> (4 * o)[None, None, :]) & 15) | 0x4B000000  # [rows, outputs, nibbles]
        w = (bits.to(tl.float32, bitcast=True) - 8388608.0 - zero[:, :, None]) * scale[:, :, None]
        w = tl.reshape(tl.permute(w, (1, 0, 2)), [8, ROWS * 8])
        k = tl.program_id(1) * ROWS * 8 + tl.arange(0, ROWS * 8)
        tl.store(out_ptr + (b * 8 + o)[:, None] * K + k[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=(k < K)[None, :])

    def int4_gemv(x, words, scale, zero, y=None, rows: int = GEMV_ROWS, warps: int = GEMV_WARPS) -> torch.Tensor:
        """The one-row kernel on contiguous operands, x [1, K]: y [1, N] (new, or given); its launch apart for
        bench/quantized_gemv.py's sweep."""
        k, n = x.shape[1], words.shape[0] * BLOCK
        y = x.new_empty(1, n) if y is None else y
        pairs = x.dtype == torch.bfloat16 and packed_ok(x) and x.data_ptr() % 4 == 0  # x read as 32-bit pairs
        _int4_gemv_kernel[(n // BLOCK,)](x, words, scale, zero, y, MAGIC, K=k, G=k // scale.shape[1], ROWS=rows,
                                         BF16X2=pairs, num_warps=warps, **pdl_launch(x))
        return y

    def int4_dequant(words, scale, zero, dtype, rows: int = MM_DEQUANT_ROWS, warps: int = MM_WARPS) -> torch.Tensor:
        """dequantize(words, scale, zero, dtype) on the GPU in one pass, the same bits: [N, K]."""
        b, r, _ = words.shape
        w = torch.empty(b * BLOCK, r * 8, device=words.device, dtype=dtype)
        _int4_dequant_kernel[(b, triton.cdiv(r, rows))](words, scale, zero, w, K=r * 8, G=r * 8 // scale.shape[1],
                                                        ROWS=rows, num_warps=warps)
        return w

    def int4_mm(x, words, scale, zero, form: str | None = None, bm: int | None = None, bn: int | None = None,
                warps: int | None = None) -> torch.Tensor:
        """x [M, K] (a few rows, contiguous operands) times the int4 weight, transposed: [M, N]. `form`: "tiles"
        (a group's [G, BN] tile of nibbles, each word loaded once per input it holds, a tl.dot a group),
        "planes" (each word loaded once, its 8 nibble planes 8 tl.dots against x's columns j::8) or "dequant"
        (the weight [N, K] in x's dtype by one pass of int4_dequant, then F.linear); bm x bn its tile (dequant:
        bn rows of words a program, no bm), warps a program's; where None, MM_FORM up to MM_PLANES_ROWS rows
        and dequant beyond, MM_* (bench/quantized_gemv.py's sweep passes them)."""
        (m, k), n, groups = x.shape, words.shape[0] * BLOCK, scale.shape[1]
        form = form or (MM_FORM if m <= MM_PLANES_ROWS else "dequant")
        bm, warps = bm or MM_BM, warps or MM_WARPS
        if form == "dequant":  # the layer's weight in x's dtype, transient (180 MB for llama2-7b's gate-up)
            return F.linear(x, int4_dequant(words, scale, zero, x.dtype, bn or MM_DEQUANT_ROWS, warps))
        if form not in ("tiles", "planes"):
            raise ValueError(f"int4_mm: form {form!r} is none of tiles, planes, dequant")
        bn = bn or MM_BN
        chunks = groups if form == "tiles" else triton.cdiv(k, 128)  # the K step: a group, or 128 inputs
        tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        # Split K until the launch fills the GPU: at 16 rows a layer of 4,096 outputs has only 64 tiles.
        per_split = triton.cdiv(chunks, min(chunks, triton.cdiv(MM_PROGRAMS, tiles)))
        splits = triton.cdiv(chunks, per_split)
        part = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
        kernel = _int4_mm_kernel if form == "tiles" else _int4_planes_kernel
        kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
            x, words, scale, zero, part, m, n, x.stride(0), K=k, G=k // groups, SPLIT=per_split,
            BF16=x.dtype == torch.bfloat16, BM=bm, BN=bn, num_warps=warps)
        return part.sum(0).to(x.dtype)

    # An opaque custom op (as int8.py's): the compiler calls it as it is, inside the CUDA graph.
    @torch.library.custom_op("shardlm::int4_mm", mutates_args=())
    def _int4_mm(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        with on_device(x):
            return int4_gemv(x, words, scale, zero) if x.shape[0] == 1 else int4_mm(x, words, scale, zero)

    @_int4_mm.register_fake
    def _(x, words, scale, zero):
        return x.new_empty(x.shape[0], words.shape[0] * BLOCK)


def kernel_ok(x: torch.Tensor) -> bool:
    return triton_ok(x) and hasattr(torch.library, "custom_op") and x.dtype in (torch.bfloat16, torch.float16)


def int4_linear(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x [..., K] times the int4 weight [N, K] that `words` [N/8, K/8, 8], `scale` and `zero` [N/8, K/G, 8]
    stand for, transposed: [..., N]. Outside the kernels' cases (more than MAX_ROWS rows, the CPU, fp32, an x
    that needs its gradient) the weight dequantised whole, in x's dtype, then multiplied."""
    if x.shape[-1] != 8 * words.shape[1]:
        raise ValueError(f"int4 product: an input of {x.shape[-1]} features against a weight of {8 * words.shape[1]}")
    rows = x.numel() // x.shape[-1]
    if 0 < rows <= MAX_ROWS and kernel_ok(x) and not x.requires_grad:
        y = torch.ops.shardlm.int4_mm(x.reshape(rows, x.shape[-1]).contiguous(), words.contiguous(),
                                      scale.contiguous(), zero.contiguous())
        return y.view(*x.shape[:-1], words.shape[0] * BLOCK)
    return F.linear(x, dequantize(words, scale, zero, x.dtype))


class Int4Linear(nn.Module):
    """`linear` with its weight in int4 (buffers `words` [out/8, in/8, 8] int32, `scale` [out/8, in/G, 8] in the
    weight's dtype, `zero` of the same shape uint8); keeps its bias and a low-rank adapter set on it (`lora`:
    inference/adapters.py adds one per request row)."""

    def __init__(self, linear: nn.Linear, group: int | None = None):
        super().__init__()
        k, n = linear.in_features, linear.out_features
        self.group = group or group_size(k)
        if not eligible(linear) or self.group not in GROUPS:
            raise ValueError(f"int4 needs an input size that a group of {', '.join(map(str, GROUPS))} divides "
                             f"and an output size that {BLOCK} divides, not {k} -> {n}")
        words, scale, zero = quantize_weight(linear.weight, self.group)
        self.register_buffer("words", words)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.bias = linear.bias
        self.lora = getattr(linear, "lora", None)
        self.in_features, self.out_features = k, n

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_linear(x, self.words, self.scale, self.zero)
        if self.bias is not None:
            y = y + self.bias
        return y if self.lora is None else y + self.lora(x)


def int4_block(block: nn.Module, kept: set[int]) -> None:
    """Every nn.Linear of `block` that int4 can take (eligible), but those in `kept` (unquantised), as an
    Int4Linear, in place."""
    for name, m in list(block.named_modules()):
        if isinstance(m, nn.Linear) and id(m) not in kept and eligible(m):
            parent, _, leaf = name.rpartition(".")
            setattr(block.get_submodule(parent) if parent else block, leaf, Int4Linear(m))


def to_int4(model: nn.Module) -> int:
    """Every nn.Linear of `model`'s blocks that int4 can take (eligible) as an Int4Linear, in place (those that
    are not yet); how many the blocks hold (ConfigError where none). The output head is not one of them:
    quantize.quantize_head stores it in int8."""
    kept = unquantised(model)
    for block in model.blocks():
        int4_block(block, kept)
    swapped = sum(isinstance(m, Int4Linear) for block in model.blocks() for m in block.modules())
    if not swapped:
        raise ConfigError(f"--quantize int4: none of this model's linear layers can be quantised (int4 needs an "
                          f"input size that a group of {', '.join(map(str, GROUPS))} divides and an output size "
                          f"that {BLOCK} divides)")
    return swapped
