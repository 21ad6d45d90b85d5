"""Weight-only one-row products alone: llama2-7b's four linear shapes (qkv, gate-up, down, attention output),
8 copies of each (8 layers' weights, far more than L2 holds), all 32 products captured in one CUDA graph and
replayed, in bf16 and through each quantised kernel; per replay in microseconds, and each shape's 8 products
in a graph of their own.

    python bench/quantized_gemv.py [--gpus 1] [--preset llama2-7b] [--rows 1[,16]] [--systems ...]
                                   [--bn 128[,64,...]] [--warps 2[,1,4,...]] [--sum-rows 0[,32,...]]
                                   [--gemv-rows 256[,128,512]] [--mm-forms tiles,planes,dequant]
                                   [--bm 16,32,64] [--mm-bn 32,64,128] [--mm-warps 4[,8]]
                                   [--warm 10] [--replays 200] [--record FILE]
    python bench/quantized_gemv.py --check    # the split-K kernels on small shapes (Triton's interpreter on a CPU)

Systems:
- `bf16`: torch.nn.functional.linear (cuBLAS).
- `int8`: shardlm.inference.int8's int8_linear (per-channel int8, its one-row GEMV and few-row tl.dot kernels;
  beyond MAX_ROWS rows the weight dequantised and multiplied as bf16). `int8-mm`: its tl.dot kernel at any rows.
- `int4`: shardlm.inference.int4 (`--quantize int4`): words [N/8, K/8, 8], each block of 8 outputs one
  contiguous run along K, its one-row kernel a program a block (`--gemv-rows` rows of words a step and `--warps`
  swept at one row), its few-row forms at 2-64.
- `int4-mm`: the same weights through int4_mm at 2-64 rows only, each of its forms (`--mm-forms`: tiles, a
  group's tile of nibbles a tl.dot; planes, 128 inputs' words loaded once as eight nibble planes, a tl.dot each;
  dequant, the weight written in bf16 by one Triton pass, then cuBLAS) at each tile (`--bm` rows, `--mm-bn`
  outputs; dequant: `--mm-bn` rows of words a program, no `--bm`) and `--mm-warps`; tiles of more rows than
  max(16, rows) are left out. int4 at those rows is its default form and launch (int4.py's MM_*).
- `int4-torchao`: torchao's tinygemm (Int4WeightOnlyConfig, tile_packed_to_4d, groups of 128) on nn.Linear
  modules, built by shardlm.inference.quantize as `--quantize int4` builds it.
- `int4-splitk`: the transposed split-K GEMV of branch next/int4-t, its kernel here: int32 words [K/8, N] (eight
  inputs of one output a word, outputs contiguous), per group of G inputs a minimum and a scale, a program per
  (BN outputs, group); each program stores its partial sums to an fp32 workspace and counts itself in its
  block's counter, and the last to arrive adds the block's partials, writes the bf16 output and sets the counter
  back to zero (one launch, the same bits every run). The last arriver loads the partials as 2D tiles of
  SUM_ROWS groups by BN outputs (0: all of them, K/G rounded up to a power of two, as one tile) and sums them by
  tl.sum, a fixed tree, where the branch added K/G rows one dependent load after another.
- `int4-splitk-atomic`: the same partial sums added by fp32 atomics into an output zeroed by a launch before,
  cast to bf16 by a launch after (three launches; the order of addition, so the bits, change from run to run).
The split-K systems run at one row only (their kernels are one-row kernels); `--bn`, `--warps` and
`--sum-rows` sweep their launches, a row each.

Each row's error is the largest |y - ref| over the largest |ref| of the four shapes' first copies, ref the
product in fp32 of x and the system's own dequantised weight (bf16: the weight itself; int8: q x scale; int4:
q x scale + minimum; torchao's: its kernel's bf16 weight, read back by multiplying the identity). `same_bits`:
two replays gave equal outputs. Random weights (normal, std 0.02) and inputs, the same for every system. Rows
with bench "quantized_gemv" go to bench/results.jsonl (seq 1, micro_batch the rows); the table comes last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:  # CUDA builds of torch ship it; the CPU check needs it installed
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("bf16", "int8", "int8-mm", "int4", "int4-mm", "int4-torchao", "int4-splitk", "int4-splitk-atomic")
SPLITK = ("int4-splitk", "int4-splitk-atomic")
COPIES = 8  # layers' worth of each shape: 8 x 0.4 GB in bf16, 8 x 0.1 GB in int4, against an L2 of tens of MB
# The split-K kernels' launch: outputs a program and warps (the branch's, from an H200 sweep); groups a tile of
# the last arriver's sum (0: all of them in one tile).
BN, WARPS, SUM_ROWS = 128, 2, 0
GEMV_ROWS = 128  # inference/int4.py's GEMV_ROWS
GROUP_SIZES = (128, 64, 32)  # the largest that divides a layer's inputs is its int4 group


def shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, outputs N, inputs K) of one block's linear layers, from the preset's model config."""
    from shardlm.config import load_config
    m = load_config(preset).model
    heads = m.num_heads * m.head_size
    return [("qkv", heads + 2 * m.kv_heads * m.head_size, m.hidden_size),
            ("gate-up", (1 if m.arch == "gpt2" else 2) * m.ffn_size, m.hidden_size),
            ("down", m.hidden_size, m.ffn_size), ("o", m.hidden_size, heads)]


# ---- int4 as branch next/int4-t stores it --------------------------------------------------------------------

def group_size(k: int) -> int:
    g = next((g for g in GROUP_SIZES if k % g == 0), None)
    if g is None:
        raise ValueError(f"int4 needs an input size that a group of {GROUP_SIZES} divides, not {k}")
    return g


def pack(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (integers 0..15) as int32 words [K/8, N]: word (r, n) holds q[n, 8r + j] in bits 4j..4j+3."""
    n, k = q.shape
    shifts = 4 * torch.arange(8, device=q.device, dtype=torch.int64)
    words = (q.t().reshape(k // 8, 8, n).to(torch.int64) << shifts[None, :, None]).sum(1)  # 0 .. 2^32 - 1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def unpack(words: torch.Tensor) -> torch.Tensor:
    """pack's inverse: words [K/8, N] as q [K, N] (int32, 0..15)."""
    r, n = words.shape
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    return ((words[:, None, :] >> shifts[None, :, None]) & 15).reshape(8 * r, n)  # & 15 drops the sign's bits


def quantize_weight(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] as (words [K/8, N] int32, scale [K/G, N], low [K/G, N]) in w's dtype: per output and group,
    low the minimum, scale (maximum - minimum) / 15, q = round((w - low) / scale) in 0..15 against the scale
    and minimum as stored."""
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group, group)
    low = groups.amin(-1)
    scale = ((groups.amax(-1) - low) / 15).clamp_min(torch.finfo(w.dtype).tiny).to(w.dtype)
    low = low.to(w.dtype)
    q = ((groups - low.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 15)
    return pack(q.reshape(n, k)), scale.t().contiguous(), low.t().contiguous()


def dequantize(words: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The weight [N, K] that words, scale and low stand for (q x scale + low in fp32), in `dtype`."""
    q = unpack(words)
    k, n = q.shape
    g = scale.shape[0]
    w = q.view(g, k // g, n) * scale.float()[:, None, :] + low.float()[:, None, :]
    return w.view(k, n).to(dtype).t()


if triton is not None:
    @triton.jit
    def _group_partial(x_ptr, w_ptr, s_ptr, lo_ptr, N, g, n, ok, G: tl.constexpr, BN: tl.constexpr):
        """sum over group g's inputs of x_k (q_k scale + low), for the outputs n: [BN] fp32."""
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
        return tl.sum(acc, 0) * scale + tl.sum(xs, 0) * low

    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, s_ptr, lo_ptr, part_ptr, arrivals_ptr, y_ptr, N, G: tl.constexpr,
                       GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, SUM_ROWS: tl.constexpr, BN: tl.constexpr):
        pn, g = tl.program_id(0), tl.program_id(1)
        n = pn * BN + tl.arange(0, BN)
        ok = n < N
        tl.store(part_ptr + g * N + n, _group_partial(x_ptr, w_ptr, s_ptr, lo_ptr, N, g, n, ok, G, BN), mask=ok)
        # Every thread's partial stored before one thread's atomic (acq_rel at GPU scope, Triton's default)
        # releases them to the last program of the block.
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + pn, 1) == GROUPS - 1:
            tl.debug_barrier()  # the atomic's acquire before any thread's loads
            total = tl.zeros([BN], tl.float32)
            # The partials as tiles whose loads are all in flight at once, each summed by a fixed tree (the
            # same bits whichever program came last), masked rows past the last group adding zeros.
            for c in tl.static_range(0, GROUPS_P2, SUM_ROWS):
                i = c + tl.arange(0, SUM_ROWS)
                # .cg: from L2, where the other programs' stores are, never a stale line of this SM's L1
                parts = tl.load(part_ptr + i[:, None] * N + n[None, :], mask=(i[:, None] < GROUPS) & ok[None, :],
                                other=0.0, cache_modifier=".cg")
                total += tl.sum(parts, axis=0)
            tl.store(y_ptr + n, total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.store(arrivals_ptr + pn, 0)  # every program of the block has counted: ready for the next call

    @triton.jit
    def _splitk_atomic_kernel(x_ptr, w_ptr, s_ptr, lo_ptr, out_ptr, N, G: tl.constexpr, BN: tl.constexpr):
        pn, g = tl.program_id(0), tl.program_id(1)
        n = pn * BN + tl.arange(0, BN)
        ok = n < N
        # relaxed: the additions need no ordering with anything else, only atomicity
        tl.atomic_add(out_ptr + n, _group_partial(x_ptr, w_ptr, s_ptr, lo_ptr, N, g, n, ok, G, BN), mask=ok,
                      sem="relaxed")


def splitk_mm(x, words, scale, low, arrivals, bn: int = BN, warps: int = WARPS, sum_rows: int = SUM_ROWS):
    """x [1, K] times the int4 weight, transposed: [1, N] in x's dtype. `arrivals`: int32 zeros, one per bn
    outputs, left at zeros."""
    k, n, groups = x.shape[-1], words.shape[1], scale.shape[0]
    p2 = triton.next_power_of_2(groups)
    y = x.new_empty(1, n)
    part = torch.empty(groups, n, device=x.device, dtype=torch.float32)  # each group's partial sums
    _splitk_kernel[(triton.cdiv(n, bn), groups)](x, words, scale, low, part, arrivals, y, n, G=k // groups,
                                                 GROUPS=groups, GROUPS_P2=p2, SUM_ROWS=min(sum_rows or p2, p2),
                                                 BN=bn, num_warps=warps)
    return y


def splitk_atomic_mm(x, words, scale, low, bn: int = BN, warps: int = WARPS):
    """The same product by fp32 atomics: a zeroing launch, the kernel, a cast."""
    k, n, groups = x.shape[-1], words.shape[1], scale.shape[0]
    out = torch.zeros(1, n, device=x.device, dtype=torch.float32)
    _splitk_atomic_kernel[(triton.cdiv(n, bn), groups)](x, words, scale, low, out, n, G=k // groups, BN=bn,
                                                        num_warps=warps)
    return out.to(x.dtype)


# ---- the systems: each an operand built from a bf16 weight, its product, its dequantised weight ---------------

def _linear(w: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


def _torchao(w):
    from shardlm.inference.quantize import quantize
    lin = _linear(w)
    quantize(nn.ModuleList([lin]), "int4")
    return lin


def _torchao_weight(lin) -> torch.Tensor:
    """The bf16 weight tinygemm multiplies by: the identity's product, row k of which is column k of it."""
    eye = torch.eye(lin.in_features, device=lin.weight.device, dtype=lin.weight.dtype)
    return lin(eye).t().float()


def _int4(w):
    words, scale, low = quantize_weight(w, group_size(w.shape[1]))
    return words, scale, low


def make_system(name: str):
    """(build: bf16 weight -> operand, run: (x, operand, launch) -> y, dequantised: operand -> fp32 [N, K])."""
    if name == "bf16":
        return (lambda w: w), (lambda x, w, _: F.linear(x, w)), (lambda w: w.float())
    if name == "int8":
        from shardlm.inference.int8 import Int8Linear, int8_gemv, int8_linear

        def run(x, q, launch):
            return int8_linear(x, q.weight, q.scale) if launch is None else int8_gemv(x, q.weight, q.scale,
                                                                                      launch=launch)
        return ((lambda w: Int8Linear(_linear(w))), run, (lambda q: q.weight.float() * q.scale.float()[:, None]))
    if name == "int8-mm":  # the few-row tl.dot kernel at any rows: whether prefill's prompts should take it
        from shardlm.inference import int8
        return ((lambda w: int8.Int8Linear(_linear(w))), (lambda x, q, _: torch.ops.shardlm.int8_mm(x, q.weight, q.scale)),
                (lambda q: q.weight.float() * q.scale.float()[:, None]))
    if name in ("int4", "int4-mm"):
        from shardlm.inference import int4, int4_format

        def run(x, op, launch):
            if name == "int4-mm":  # (form, bm, bn, warps)
                return int4.int4_mm(x, *op, *launch)
            if launch is None:
                return int4.int4_linear(x, *op)
            return int4.int4_gemv(x, *op, rows=launch[0], warps=launch[1])
        return ((lambda w: int4_format.quantize_weight(w, int4_format.group_size(w.shape[1]))), run,
                (lambda op: int4_format.dequantize(*op, torch.float32)))
    if name == "int4-torchao":
        return _torchao, (lambda x, lin, _: lin(x)), _torchao_weight
    if name == "int4-splitk":
        def run(x, op, launch):
            bn, warps, sum_rows = launch
            words, scale, low = op[:3]
            if bn not in op[3]:  # made by the warm-up call, before the capture: the graph holds no zeroing
                op[3][bn] = torch.zeros(triton.cdiv(words.shape[1], bn), dtype=torch.int32, device=words.device)
            return splitk_mm(x, words, scale, low, op[3][bn], bn, warps, sum_rows)
        return (lambda w: (*_int4(w), {})), run, (lambda op: dequantize(*op[:3]))
    if name == "int4-splitk-atomic":
        return (_int4, (lambda x, op, launch: splitk_atomic_mm(x, *op, bn=launch[0], warps=launch[1])),
                (lambda op: dequantize(*op)))
    raise ValueError(f"unknown system {name}")


def weights(layers: list[tuple[str, int, int]], copies: int, device, dtype=torch.bfloat16):
    """The bf16 weights, copy by copy (the order of a model's layers), each from its own seed: the same for every
    system."""
    for c in range(copies):
        for i, (_, n, k) in enumerate(layers):
            g = torch.Generator(device=device).manual_seed(1000 * c + i)
            yield (torch.randn(n, k, generator=g, device=device) * 0.02).to(dtype)


def graphed(fn):
    """fn (which returns a list of tensors) captured in a CUDA graph after a warm-up call on a side stream (its
    kernels compiled); the graph and the outputs its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    return graph, outs


def measure(name: str, args, layers, xs_by_rows, rows: list[dict]) -> None:
    """Time system `name` at each row count and launch, its rows appended to `rows` as they come (a launch that
    fails is said on stderr and left out)."""
    from common import timed
    build, run, dequantised = make_system(name)
    x = next(iter(xs_by_rows.values()))[layers[0][2]]
    ops = [build(w) for w in weights(layers, COPIES, x.device, x.dtype)]
    torch.cuda.synchronize()
    third = args.sum_rows if name == "int4-splitk" else [SUM_ROWS]
    launches = [(bn, w, s) for bn in (args.gemv_rows if name == "int4" else args.bn) for w in args.warps
                for s in third]
    for m, xs in xs_by_rows.items():
        if name in SPLITK and m != 1:
            print(f"{name}: one row only, {m} rows left out", file=sys.stderr, flush=True)
            continue
        if name == "int4-mm":
            if not 1 < m <= 64:
                print(f"{name}: 2-64 rows only, {m} rows left out", file=sys.stderr, flush=True)
                continue
            # (form, bm, bn, warps); dequant has no bm (0)
            launches = [(f, bm, bn, w) for f in args.mm_forms for bm in ([0] if f == "dequant" else args.bm)
                        if bm <= max(16, m) for bn in args.mm_bn for w in args.mm_warps]
        if name == "int8":  # the one-row kernel's (BN, BK, warps, stages); else int8_linear's own choice
            launches = args.int8_launches if m == 1 and args.int8_launches else [None]
        refs = [xs[k].float() @ dequantised(op).t() for op, (_, _, k) in zip(ops, layers)]  # the first copies
        for launch in launches if name in (*SPLITK, "int4-mm", "int8") or (name == "int4" and m == 1) else [None]:
            def products(which=range(len(ops))):
                return [run(xs[layers[i % len(layers)][2]], ops[i], launch) for i in which]
            try:  # a launch whose kernel does not build fails in the warm-up call, before any capture
                graph, outs = graphed(products)
            except Exception:
                print(f"{name} {launch}: failed\n{traceback.format_exc()[-3000:]}", file=sys.stderr, flush=True)
                continue
            seconds, peak = timed(graph.replay, args.warm, args.replays)
            graph.replay()
            first = torch.cat([o.flatten() for o in outs])
            graph.replay()
            same = torch.equal(first, torch.cat([o.flatten() for o in outs]))
            errors = {shape: ((outs[i].float() - ref).abs().max() / ref.abs().max()).item()
                      for i, ((shape, _, _), ref) in enumerate(zip(layers, refs))}
            by_shape = {}
            for j, (shape, _, _) in enumerate(layers):
                g, _ = graphed(lambda j=j: products(range(j, len(ops), len(layers))))
                by_shape[shape] = round(timed(g.replay, args.warm, args.replays)[0] * 1e6, 1)
                del g
            del graph, outs
            setting = {} if launch is None else {"gemv_rows" if name == "int4" else "bn": launch[0],
                                                 "warps": launch[1]}
            if name == "int4-mm":
                setting = {"form": launch[0], **({"bm": launch[1]} if launch[1] else {}), "bn": launch[2],
                           "warps": launch[3]}
            if name == "int4-splitk":
                setting["sum_rows"] = launch[2]
            if name == "int8" and launch is not None:
                setting = {"bn": launch[0], "bk": launch[1], "warps": launch[2], "stages": launch[3]}
            rows.append({"system": name, "micro_batch": m, **setting, "us": round(seconds * 1e6, 1),
                         "us_by_shape": by_shape, "error": max(errors.values()), "error_by_shape": errors,
                         "same_bits": same, "peak_mem_gib": round(peak, 3)})
            print(json.dumps(rows[-1]), flush=True)
        del refs
    del ops
    torch.cuda.empty_cache()


def bench(args, device="cuda", dtype=torch.bfloat16) -> None:
    from common import record
    layers = shapes(args.preset)
    g = torch.Generator(device=device).manual_seed(7)
    xs_by_rows = {m: {k: torch.randn(m, k, generator=g, device=device).to(dtype)
                      for k in sorted({k for _, _, k in layers})} for m in args.rows}
    rows = []
    for name in args.systems:
        try:
            measure(name, args, layers, xs_by_rows, rows)
        except Exception:  # one system's failure (a missing torchao, a kernel that does not build) leaves the rest
            print(f"{name}: failed\n{traceback.format_exc()[-3000:]}", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    base = {r["micro_batch"]: r["us"] for r in rows if r["system"] == "bf16"}
    for r in rows:
        r["x_bf16"] = round(base[r["micro_batch"]] / r["us"], 3) if r["micro_batch"] in base else None
    card = torch.cuda.get_device_name()
    if args.record:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
        cmd = "python bench/quantized_gemv.py " + " ".join(sys.argv[1:])
        record(args.record, "quantized_gemv", card, 1,
               [{"system": r["system"], "model": args.preset, "seq": 1, "micro_batch": r["micro_batch"],
                 "tok_s_gpu": None, "mfu": None, "peak_mem_gib": r["peak_mem_gib"], "command": cmd,
                 **{k: v for k, v in r.items() if k not in ("system", "micro_batch", "peak_mem_gib")},
                 "commit": commit} for r in rows])
    names = [s for s, _, _ in layers]
    print(f"\n{card}, {args.preset}: {COPIES} copies of {', '.join(f'{s} {n}x{k}' for s, n, k in layers)}; "
          f"us per replay of one CUDA graph")
    print(f"{'system':<20}{'rows':>5}  {'launch':<18}{'all us':>8}" + "".join(f"{s:>9}" for s in names)
          + f"{'x bf16':>8}{'max err':>9}{'same bits':>10}{'peak GiB':>9}")
    for r in rows:
        launch = f"rows {r['gemv_rows']} w {r['warps']}" if "gemv_rows" in r else "" if "bn" not in r else (
            f"bn {r['bn']} w {r['warps']}" + (f" s {r['sum_rows'] or 'all'}" if "sum_rows" in r else ""))
        if "form" in r:
            launch = (f"{r['form']} {r['bm']}x{r['bn']} w{r['warps']}" if "bm" in r
                      else f"{r['form']} r{r['bn']} w{r['warps']}")
        if "bk" in r:
            launch = f"{r['bn']}/{r['bk']} w{r['warps']} s{r['stages']}"
        ratio = f"{r['x_bf16']:.2f}" if r["x_bf16"] else "-"
        print(f"{r['system']:<20}{r['micro_batch']:>5}  {launch:<18}{r['us']:>8.1f}"
              + "".join(f"{r['us_by_shape'][s]:>9.1f}" for s in names)
              + f"{ratio:>8}{r['error']:>9.2e}{str(r['same_bits']):>10}{r['peak_mem_gib']:>9.2f}")
    varied = [r for r in rows if r["system"] == "int4-splitk" and not r["same_bits"]]
    if varied:
        print(f"int4-splitk: two replays gave different bits in {len(varied)} of its rows (it should not)")


# ---- the split-K kernels on small shapes: Triton's interpreter on a CPU, the GPU where there is one ------------

def check(args) -> None:
    """Both split-K kernels against the product in fp64 of the dequantised weight: outputs that fill no block
    evenly, groups of 128 and 64, K/G a power of two and not (the sum's tile with masked rows), the sum in one
    tile and in tiles of two groups; the split-K kernel called twice (its counters back at zeros, the same
    bits); and every nibble read exactly (scale 1, minimum 0, x of ones: integer sums, exact in fp32, rounded
    once). fp16 on the CPU (the interpreter's bf16 is broken), bf16 on a GPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(0)
    worst = {"int4-splitk": 0.0, "int4-splitk-atomic": 0.0}
    for k, n, group in ((256, 200, 128), (384, 200, 128), (256, 200, 64), (384, 200, 64), (320, 72, 64)):
        w = (torch.randn(n, k, generator=g) * 0.02).to(dtype).to(device)
        words, scale, low = quantize_weight(w, group)
        x = torch.randn(1, k, generator=g).to(dtype).to(device)
        want = x.double() @ dequantize(words, scale, low, torch.float64).t()
        groups = k // group
        for bn in args.bn:
            arrivals = torch.zeros(triton.cdiv(n, bn), dtype=torch.int32, device=device)
            for sum_rows in sorted({0, 2, *args.sum_rows}):
                y = splitk_mm(x, words, scale, low, arrivals, bn, WARPS, sum_rows)
                assert not arrivals.any(), (k, n, group, bn, sum_rows, arrivals)
                again = splitk_mm(x, words, scale, low, arrivals, bn, WARPS, sum_rows)
                assert torch.equal(again, y) and not arrivals.any(), (k, n, group, bn, sum_rows)
                err = ((y.double() - want).abs().max() / want.abs().max()).item()
                worst["int4-splitk"] = max(worst["int4-splitk"], err)
                assert err < 2**-7, (k, n, group, bn, sum_rows, err)
            y = splitk_atomic_mm(x, words, scale, low, bn, WARPS)
            err = ((y.double() - want).abs().max() / want.abs().max()).item()
            worst["int4-splitk-atomic"] = max(worst["int4-splitk-atomic"], err)
            assert err < 2**-7, (k, n, group, bn, err)
            levels = torch.randint(0, 16, (n, k), generator=g).to(device)
            ones = torch.ones(groups, n, dtype=dtype, device=device)
            exact = levels.sum(1).to(dtype)[None]
            x1 = torch.ones(1, k, dtype=dtype, device=device)
            assert torch.equal(splitk_mm(x1, pack(levels), ones, 0 * ones, arrivals, bn, WARPS), exact), (k, n, bn)
            assert torch.equal(splitk_atomic_mm(x1, pack(levels), ones, 0 * ones, bn, WARPS), exact), (k, n, bn)
        print(f"K {k} N {n} G {group} ({groups} groups, tile of {triton.next_power_of_2(groups)}): ok")
    print(f"check passed on {device} ({'interpreter, ' if os.environ.get('TRITON_INTERPRET') == '1' else ''}"
          f"{str(dtype).removeprefix('torch.')}); max |y - ref| / max |ref| against the fp64 product: "
          + ", ".join(f"{s} {e:.2e}" for s, e in worst.items()))


def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).split(",")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=1, help="accepted as every bench takes it; one GPU is used")
    p.add_argument("--preset", default="llama2-7b", help="the model whose block's linear shapes are timed")
    p.add_argument("--rows", type=_ints, default=[1], help="rows of x, comma-separated (e.g. 1,16)")
    p.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS), help=", ".join(SYSTEMS))
    p.add_argument("--bn", type=_ints, default=[BN], help="split-K systems: outputs a program, comma-separated")
    p.add_argument("--warps", type=_ints, default=[WARPS], help="split-K systems and int4: warps a program, "
                   "comma-separated")
    p.add_argument("--gemv-rows", type=_ints, default=[GEMV_ROWS], help="int4 (inference/int4.py): rows of words "
                   "a step of its one-row kernel, powers of two, comma-separated")
    p.add_argument("--mm-forms", type=lambda s: s.split(","), default=["tiles", "planes", "dequant"],
                   help="int4-mm: int4_mm's forms, comma-separated (tiles, planes, dequant)")
    p.add_argument("--bm", type=_ints, default=[16, 32, 64], help="int4-mm: rows a tile (16, 32, 64), comma-separated")
    p.add_argument("--mm-bn", type=_ints, default=[32, 64, 128], help="int4-mm: outputs a tile, powers of two "
                   "(dequant: rows of words a program), comma-separated")
    p.add_argument("--mm-warps", type=_ints, default=[4], help="int4-mm: warps a program, comma-separated")
    p.add_argument("--int8-launches", type=lambda v: [tuple(map(int, x.split("/"))) for x in v.split(",")],
                   default=[], help="int8 at one row: its GEMV's launches, BN/BK/warps/stages comma-separated "
                   "(e.g. 16/512/4/3,32/512/4/3); none: int8_linear's own")
    p.add_argument("--sum-rows", type=_ints, default=[SUM_ROWS],
                   help="int4-splitk: groups a tile of the last arriver's sum, powers of two (0: all, one tile)")
    p.add_argument("--warm", type=int, default=10, help="graph replays before timing")
    p.add_argument("--replays", type=int, default=200, help="graph replays timed")
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"), help="'' records nothing")
    p.add_argument("--check", action="store_true", help="only check the split-K kernels on small shapes (on a "
                   "CPU under Triton's interpreter, which this re-runs itself under)")
    args = p.parse_args()
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s}: one of {', '.join(SYSTEMS)}")
    if any(v & (v - 1) for v in args.sum_rows) or any(v < 1 or v & (v - 1) for v in args.bn):
        p.error("--bn and --sum-rows take powers of two (--sum-rows also 0)")
    if any(f not in ("tiles", "planes", "dequant") for f in args.mm_forms):
        p.error("--mm-forms: tiles, planes, dequant")
    if any(v < 16 or v & (v - 1) for v in args.bm + args.mm_bn):
        p.error("--bm and --mm-bn take powers of two from 16 (tl.dot's least)")
    if args.gpus != 1:
        print(f"--gpus {args.gpus}: one GPU is used", file=sys.stderr)
    if args.check:
        if triton is None:
            sys.exit("--check needs triton (a CUDA build of torch, or triton installed for its interpreter)")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            # the interpreter is chosen when triton is imported: a fresh interpreter with it on
            env = {**os.environ, "TRITON_INTERPRET": "1"}
            sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode)
        return check(args)
    if not torch.cuda.is_available() or triton is None:
        sys.exit("the timing needs a CUDA GPU (--check runs the split-K kernels on a CPU)")
    bench(args)


if __name__ == "__main__":
    main()
