"""Where a prompt's prefill spends its time in the continuous batcher (inference/engine.py): one request's
prefill timed alone, then under torch.profiler, its top kernels and host operators printed.

    python bench/prefill_profile.py [--preset llama2-7b] [--prompt 264] [--rows 1] [--out DIR] [--compile-prefill 0]
        [--prefill-graphs 0]

The fourteenth lease (bench/README.md) measured 82-85 ms a prefill pass of about 264 tokens on an H200 where
the arithmetic is about 10 ms; this says whether the time is kernels (which ones) or the host between them.
Random bf16 weights (fp32 on the CPU, where `--preset tiny` is a smoke run).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from generate import build, sync


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--prompt", type=int, default=264, help="prompt tokens")
    p.add_argument("--rows", type=int, default=1, help="prompts prefilled together")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="profiles", help="where the trace is written")
    p.add_argument("--compile-prefill", type=int, default=1, help="0: the eager prefill (engine.Engine)")
    p.add_argument("--prefill-graphs", type=int, default=None,
                   help="passes of up to this many tokens as CUDA graphs (0: none; default the engine's)")
    args = p.parse_args()
    from shardlm.inference import Engine, Request
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = build(args, device)
    engine = Engine(model, max(args.rows, 1), args.prompt + 8, compile=device == "cuda",
                    compile_prefill=bool(args.compile_prefill), prefill_graphs=args.prefill_graphs)
    g = torch.Generator().manual_seed(0)

    def once() -> float:
        prompts = [torch.randint(1, cfg.vocab_size, (args.prompt,), generator=g).tolist() for _ in range(args.rows)]
        sync(device)
        start = time.perf_counter()
        engine.run([Request(prompt, 1) for prompt in prompts])  # one new token: the prefill's own
        sync(device)
        return time.perf_counter() - start

    once()  # compiles the decode steps and warms the allocator
    times = [once() for _ in range(args.repeat)]
    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU] + ([kinds.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        once()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "prefill.trace.json"))
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=20, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    flops = 2 * cfg.num_params() * args.prompt * args.rows
    print(f"{args.preset}: {args.rows} x {args.prompt} prompt tokens, prefill + one token: "
          f"best {min(times) * 1e3:.1f} ms, median {sorted(times)[len(times) // 2] * 1e3:.1f} ms "
          f"(matmul arithmetic {flops / 1e12:.2f} TFLOP)")


if __name__ == "__main__":
    main()
