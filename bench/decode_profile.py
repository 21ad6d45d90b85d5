"""Where a decode step of the continuous batcher (inference/engine.py) spends its time: the step timed at
--rows requests in --slots slots, against the time to read the weights once at the card's memory bandwidth
(batch-1 decode's bound), then one burst under torch.profiler, its top kernels printed.

    python bench/decode_profile.py [--preset llama2-7b] [--slots 16] [--rows 1 16] [--prompt 128] [--new 64]
        [--quantize int4]

The eighteenth lease (bench/README.md) measured 6.5 ms a step at 1 row and 8.3 ms at 16 on an H200, where
reading llama2-7b's bf16 weights takes 2.8 ms: this says which kernels take the rest. A step's time is the
difference of runs of --new and of 1 new token, over --new - 1 steps (the prefill cancels). Random bf16
weights (fp32 on the CPU, where `--preset tiny` is a smoke run).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from generate import build, sync, weight_bytes


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="requests decoding together")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64, help="tokens each request generates")
    p.add_argument("--quantize", default="none", choices=("none", "int8", "int4"),
                   help="the block linears' weights as `--quantize` gives them (inference/quantize.py)")
    p.add_argument("--card", default="h200", help="the planner's GPU, for the memory bandwidth")
    p.add_argument("--out", default="profiles", help="where the traces are written")
    p.add_argument("--prefill", type=int, nargs="*", default=[64, 256, 512],
                   help="prompt lengths whose prefill (and first token) alone is timed, the longest profiled")
    args = p.parse_args()
    from shardlm.inference import Engine, Request
    from shardlm.plan import gpu
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = build(args, device)
    bound = weight_bytes(model) / gpu(args.card).hbm_bw  # bf16's: quantised weights are buffers, not parameters
    if args.quantize != "none":
        from shardlm.inference.quantize import quantize
        quantize(model, args.quantize)
    engine = Engine(model, args.slots, max([args.prompt, *args.prefill]) + args.new + 8, compile=device == "cuda")
    g = torch.Generator().manual_seed(0)

    def run(rows: int, new: int, prompt: int | None = None) -> float:
        prompts = [torch.randint(1, cfg.vocab_size, (prompt or args.prompt,), generator=g).tolist()
                   for _ in range(rows)]
        sync(device)
        start = time.perf_counter()
        engine.run([Request(prompt, new) for prompt in prompts])
        sync(device)
        return time.perf_counter() - start

    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU] + ([kinds.CUDA] if device == "cuda" else [])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for rows in args.rows:
        run(rows, args.new)  # compiles and captures the steps
        steps = [(run(rows, args.new) - run(rows, 1)) / (args.new - 1) for _ in range(3)]
        with torch.profiler.profile(activities=activities) as prof:
            run(rows, args.new)
        prof.export_chrome_trace(str(out / f"decode-{rows}.trace.json"))
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(f"\n{rows} rows, {args.new} new tokens each (the whole run's kernels, prefill included):")
        print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=70))
        step = min(steps)
        lines.append(f"{args.preset}, {rows} of {args.slots} slots: {1e3 * step:.2f} ms a decode step, "
                     f"{rows / step:.0f} tok/s; reading the bf16 weights at {args.card}'s bandwidth {1e3 * bound:.2f} ms "
                     f"({bound / step:.0%} of the step)")
    for n in args.prefill:  # one request's prefill and first token, as a served request waits for it
        run(1, 1, n)
        took = min(run(1, 1, n) for _ in range(3))
        lines.append(f"{args.preset}, prefill of one {n}-token prompt and its first token: {1e3 * took:.1f} ms")
    if args.prefill:
        with torch.profiler.profile(activities=activities) as prof:
            run(1, 1, max(args.prefill))
        prof.export_chrome_trace(str(out / "prefill.trace.json"))
        print(f"\nprefill of one {max(args.prefill)}-token prompt (host time first: is it the launches?):")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
