"""The instructions a Triton kernel's main loop issues, compiled for a Hopper GPU on a machine without one: a
kernel bound by what it issues can be tuned on the CPU by counting, then timed on a GPU once. inference/int4.py's
one-row GEMV was: its time followed its instruction count (5.9 a nibble, 536 us for 8 of llama2-7b's layers;
4.6, 446-464 us), at about 2 warp-instructions a clock per SM, half the SMs' peak issue rate. Not always: a
count is a guide, not a timing (int8's f16x2 GEMV over pairs of words counted 3.4 a byte and ran 2x slower than
the 4.8 of the tile it replaced, bench/README.md, thirty-sixth lease).

    python bench/sass_count.py int4-gemv|int8-gemv [--k 4096] [--rows R] [--warps W] [--fp32]

It needs the triton package only (with a CPU build of torch: `pip install triton` into a virtual environment
that sees torch), not a GPU or CUDA; written against triton 3.5 (`ASTSource(..., attrs=)`).

Compiles with Triton's own ptxas for sm_90 (pointer arguments 16-byte aligned, as the launcher specialises
them at run time), disassembles the cubin with its nvdisasm, and prints the opcodes of the longest loop (the
body between a backward branch and its label): per iteration and per nibble (byte) of weight.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile


def compile_sass(fn, signature: dict, constexprs: dict, warps: int, stages: int = 3, multiples: tuple = ()) -> str:
    """`multiples`: integer arguments to take as multiples of 16, as Triton's launcher specialises them at run
    time when they are (a row stride of 4096 or 11008 bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
               if t.startswith("*") or name in multiples}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(tools, "nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes of the longest loop: the lines between a label and the last backward branch to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    body = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i and (body is None or i - labels[m.group(1)] > body[1] - body[0]):
            body = (labels[m.group(1)], i + 1)
    body = body or (0, len(lines))  # no loop (unrolled): the whole kernel
    ops = collections.Counter()
    for line in lines[body[0]:body[1]]:
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    return ops


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", choices=("int4-gemv", "int8-gemv"))
    p.add_argument("--k", type=int, default=4096, help="the layer's inputs")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--rows", type=int, default=None, help="int4: rows of words a step (default: int4.GEMV_ROWS); "
                   "int8: outputs a program (default: int8.GEMV_NARROW_LAUNCH's)")
    p.add_argument("--warps", type=int, default=None, help="default: int4.GEMV_WARPS")
    p.add_argument("--fp32", action="store_true", help="the fp32 path (fp16 inputs, Triton's interpreter)")
    args = p.parse_args()
    if args.kernel == "int8-gemv":
        return int8_gemv(args)
    from shardlm.inference import int4
    rows, warps = args.rows or int4.GEMV_ROWS, args.warps or int4.GEMV_WARPS
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "y_ptr": "*bf16", "magic": "i32",
           "K": "constexpr", "G": "constexpr", "ROWS": "constexpr", "BF16X2": "constexpr"}
    ops = loop_opcodes(compile_sass(int4._int4_gemv_kernel, sig, {"K": args.k, "G": args.group, "ROWS": rows,
                                                                  "BF16X2": not args.fp32}, warps))
    total = sum(ops.values())
    nibbles = rows * 64 // (32 * warps)  # a thread's share of a step's nibbles
    print(f"int4 one-row GEMV, K {args.k}, {rows} rows of words a step, {warps} warps: {total} instructions an "
          f"iteration, {total / nibbles:.2f} a nibble")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


def int8_gemv(args):
    from shardlm.inference import int8
    bn, bk, warps, stages = int8.GEMV_NARROW_LAUNCH
    bn, warps = args.rows or bn, args.warps or warps
    sig = {"x_ptr": "*bf16", "w_ptr": "*i8", "s_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "sw": "i32",
           "magic": "i32", "K": "constexpr", "BN": "constexpr", "BK": "constexpr", "HALF2": "constexpr"}
    ops = loop_opcodes(compile_sass(int8._int8_gemv_kernel, sig, {"K": args.k, "BN": bn, "BK": bk,
                                                                  "HALF2": not args.fp32}, warps, stages, ("sw",)))
    total = sum(ops.values())
    weights = bn * bk // (32 * warps)  # a thread's share of a step's bytes
    print(f"int8 one-row GEMV, K {args.k}, {bn} outputs by {bk} inputs a step, {warps} warps: {total} instructions an "
          f"iteration, {total / weights:.2f} a byte")
    print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
