"""A tensor-parallel decode step's row-parallel products and their all-reduces alone: llama2-7b's attention
output and MLP down projections at tp N, one row, 32 layers' weights (more than L2 holds) in one CUDA graph,
replayed; per replay in microseconds.

    python bench/gemv_all_reduce.py [--gpus 2] [--preset llama2-7b] [--bn 2,4,8] [--bk 512,1024,2048]
                                    [--warps 4,8] [--replays 200] [--record FILE]

Systems:
- `cublas`: the products alone (torch.nn.functional.linear), no sum: what the weights' reading costs.
- `cublas+one-shot`: the products, each then summed over the ranks by shardlm's one-shot all-reduce (a copy into
  symmetric memory, then `symm_mem.one_shot_all_reduce`): the decode step's path before the fused kernel.
- `fused BN/BK/WARPS`: shardlm.inference.gemv_all_reduce's one kernel per product and sum, a row per launch.
- `fused-ll BN/BK/WARPS`, `fused-ll-strong ...`: the same by the LL protocol (inference/gemv_all_reduce_ll.py,
  the engine's default), its stores to the peers weak or relaxed at system scope.
- `gemv-only BN/BK/WARPS`: that kernel's product alone, no sum (its reading against cuBLAS's).
- `cublas column`, `gemv-only column ...`: the column-parallel products (qkv, gate-up), which need no sum.
Two forms measured at 7c9d726 and dropped since (bench/README.md): cuBLAS's product into symmetric memory and a
one-barrier Triton sum reading the peers' ("pull"), and the fused kernel's outputs sent to the peers by its last
program ("fused-late").

Each fused row's error is the largest |y - ref| over the largest |ref|, ref the one-shot path's output;
`same_bits`: every replay gave the first replay's bits (a race would show as a changed bit). Rows with bench
"gemv_all_reduce" go to --record; the table comes last.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 32


def graph_us(fn, replays: int) -> tuple[float, list[torch.Tensor]]:
    """fn() captured once in a CUDA graph; the median of `replays` timed replays in microseconds, and its
    outputs after the first replay."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    first = [o.clone() for o in outs]
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    same = all(torch.equal(o, f) for o, f in zip(outs, first))
    return statistics.median(times), first, same


def worker(args) -> None:
    from shardlm.config import load_config
    from shardlm.inference.gemv_all_reduce import GemvAllReduce
    from shardlm.inference.one_shot import OneShotAllReduce, symmetric_buffers
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    m = load_config(args.preset).model
    h, f = m.hidden_size, m.ffn_size
    torch.manual_seed(rank)
    dt = torch.bfloat16
    # per layer: the attention output [h, heads x head_size / tp] and the down projection [h, f / tp]
    ws = [(torch.randn(h, m.num_heads * m.head_size // world, device="cuda", dtype=dt) * 0.02,
           torch.randn(h, f // world, device="cuda", dtype=dt) * 0.02) for _ in range(LAYERS)]
    xs = (torch.randn(1, 1, ws[0][0].shape[1], device="cuda", dtype=dt),
          torch.randn(1, 1, ws[0][1].shape[1], device="cuda", dtype=dt))
    buffers = symmetric_buffers([h, h], ws[0][0], group)
    plain = [OneShotAllReduce(buffers[i], group) for i in range(2)]

    def run(op):
        return lambda: [op(i, x, w) for pair in ws for i, (x, w) in enumerate(zip(xs, pair))]

    rows = []
    us, ref, _ = graph_us(run(lambda i, x, w: F.linear(x, w)), args.replays)
    rows.append({"system": "cublas", "us": us})
    us, ref, _ = graph_us(run(lambda i, x, w: plain[i](F.linear(x, w))), args.replays)
    rows.append({"system": "cublas+one-shot", "us": us})
    scale = max(r.abs().max().item() for r in ref)
    modes = ("fused", "fused-ll", "fused-ll-strong", "gemv-only")
    for launch, mode in itertools.product(itertools.product(args.bn, args.bk, args.warps), modes):
        name = f"{mode} {'/'.join(map(str, launch))}"
        fused = GemvAllReduce(symmetric_buffers([2 * world * h] * 2, ws[0][0], group), h, group, launch=launch,
                              reduce=mode != "gemv-only",
                              protocol=mode.removeprefix("fused-") if mode.startswith("fused-") else "barrier")
        try:
            us, out, same = graph_us(run(lambda i, x, w: fused(x, w, i)), args.replays)
            fused.check()
        except Exception as e:  # noqa: BLE001 (a launch that does not compile; the others run)
            rows.append({"system": name, "error": str(e).splitlines()[0][:120]})
            continue
        row = {"system": name, "us": us, "same_bits": same}
        if mode != "gemv-only":
            row["rel_err"] = max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref)) / scale
        rows.append(row)
    # The column-parallel products (qkv, gate-up: no sum), cuBLAS against the kernel's product alone.
    heads = m.num_heads * m.head_size + 2 * m.kv_heads * m.head_size
    cols = [(torch.randn(heads // world, h, device="cuda", dtype=dt) * 0.02,
             torch.randn(2 * f // world, h, device="cuda", dtype=dt) * 0.02) for _ in range(LAYERS)]
    xc = torch.randn(1, 1, h, device="cuda", dtype=dt)
    col_run = lambda op: lambda: [op(xc, w) for pair in cols for w in pair]  # noqa: E731
    us, _, _ = graph_us(col_run(F.linear), args.replays)
    rows.append({"system": "cublas column", "us": us})
    for launch in itertools.product(args.bn, args.bk, args.warps):
        alone = GemvAllReduce(symmetric_buffers([2 * f] * 2, ws[0][0], group), 2 * f // world, group, launch=launch,
                              reduce=False, protocol="barrier")
        us, _, _ = graph_us(col_run(lambda x, w: alone(x, w, 0)), args.replays)
        rows.append({"system": f"gemv-only column {'/'.join(map(str, launch))}", "us": us})
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        out = []
        for i, r in enumerate(rows):  # the slower rank's time: each replay waits for both
            us = [e[i].get("us") for e in everyone]
            out.append({**r, "us": max(us) if None not in us else None})
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--preset", default="llama2-7b")
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    p.add_argument("--bn", type=ints, default=[8, 16])
    p.add_argument("--bk", type=ints, default=[512])
    p.add_argument("--warps", type=ints, default=[4, 8])
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--record", help="append rows (bench 'gemv_all_reduce') to this JSONL file")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the job's ranks are stopped")
    args = p.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.gpus}", __file__, *sys.argv[1:]]
    from common import job_env, run_job
    # every rank killed past the limit, its stack in the report: a rank left spinning would hold the GPUs
    code, stdout, stderr = run_job(cmd, job_env(ROOT), args.timeout)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        sys.exit(f"no result ({'timed out' if code is None else f'exit {code}'}):\n{stderr[-6000:]}")
    rows = json.loads(lines[-1][7:])
    base = next(r["us"] for r in rows if r["system"] == "cublas+one-shot")
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "?"
    print(f"{args.preset} row-parallel products at tp {args.gpus}, {LAYERS} layers x 2, one row, {card}")
    print(f"{'system':<22}{'us/replay':>10}{'x one-shot':>11}{'rel err':>9}{'same bits':>10}")
    for r in rows:
        if r.get("us") is None:
            print(f"{r['system']:<22}  {r.get('error', 'failed')}")
            continue
        err = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
        print(f"{r['system']:<22}{r['us']:>10.1f}{base / r['us']:>10.2f}x{err:>9}{str(r.get('same_bits', '-')):>10}")
    if args.record:
        from common import record
        record(args.record, "gemv_all_reduce", card, args.gpus,
               [{"system": r["system"], "model": args.preset, "seq": 1, "micro_batch": 1, "us_per_replay": r.get("us"),
                 "rel_err": r.get("rel_err"), "same_bits": r.get("same_bits")} for r in rows])


if __name__ == "__main__":
    main()
