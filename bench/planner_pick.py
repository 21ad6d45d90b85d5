"""Does the planner pick the layout? Every layout of (dp, tp, pp, ZeRO stage, recompute) that `shardlm plan`
says fits, measured on the GPUs, beside the planner's prediction of its throughput and memory.

    python bench/planner_pick.py --gpus 4 [--preset llama2-7b --seq 4096 --global-batch 16 --count 10]
    python bench/planner_pick.py --list                 # the layouts it would measure, with predictions
    python bench/planner_pick.py --device cpu --preset tiny --seq 32 --global-batch 8 --gpus 2 --count 3 \\
        --warm 1 --steps 1 --compile 0                  # smoke run of the code, not a measurement

The planner's search (`shardlm.plan.search`: the same space `shardlm plan --search` ranks) scores every layout
of the workload on `--gpus` GPUs of the card found (or `--card`); of each (dp, tp, pp, zero, recompute)
combination it keeps the variant it predicts fastest (micro-batch, sequence parallelism, schedule), and
measures the `--count` best-predicted (all of them if fewer), each as its own torchrun job of shardlm's
trainer (bf16, blocks compiled, warm-up then timed steps). Peak memory is the largest over the ranks of
torch.cuda.max_memory_allocated plus the copy engines' symmetric memory. The floors: the planner's first
pick within 5% of the best measured throughput, and its memory within 10% of the measured on every
layout. Rows with bench "planner_pick", one per layout, with the prediction beside the measurement.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from common import PEAK, driver_args, forwarded, job_env, run_systems, shardlm_trainer, timed

ROOT = Path(__file__).resolve().parents[1]


def workload(args):
    from shardlm.config import load_config
    from shardlm.plan import Workload
    cfg = load_config(args.preset, {"model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len))})
    return cfg, Workload(args.seq, 1, args.global_batch)


def candidates(args) -> list[tuple]:
    """(name, predicted estimate, workload, layout) of the layouts to measure, best predicted first."""
    from shardlm.plan import Layout, gpu
    from shardlm.plan.search import search
    cfg, work = workload(args)
    fitting, _, _, _ = search(cfg.model, work, gpu(args.card), args.gpus, args.gpus, Layout(cp=args.cp), top=10**6)
    chosen, seen = [], set()
    for e, w, L in fitting:
        key = (L.dp, L.tp, L.pp, L.zero_stage if L.dp > 1 else 0, L.recompute)  # ZeRO over one rank: none
        if key in seen:
            continue
        seen.add(key)
        name = (f"dp{L.dp}{f'-cp{L.cp}' if L.cp > 1 else ''}-tp{L.tp}{'-sp' if L.sp else ''}-pp{L.pp}"
                f"{'-' + L.pp_schedule if L.pp > 1 else ''}-z{L.zero_stage}-{L.recompute}-mb{w.micro_batch}")
        chosen.append((name, e, w, L))
    return chosen[:args.count]


def overrides(w, L) -> dict:
    return {"parallel.dp": str(L.dp), "parallel.cp": str(L.cp), "parallel.tp": str(L.tp), "parallel.pp": str(L.pp),
            "parallel.sp": str(L.sp).lower(),
            "parallel.zero_stage": str(L.zero_stage), "parallel.pp_schedule": L.pp_schedule,
            "parallel.virtual_stages": str(L.virtual_stages), "train.recompute": L.recompute,
            "train.micro_batch_size": str(w.micro_batch)}


def worker(args, extra):
    import torch
    import torch.distributed as dist
    name, _, w, L = next(c for c in candidates(args) if c[0] == args.system)
    cfg, _ = workload(args)
    over = {"train.seq_len": str(args.seq), "train.global_batch_size": str(args.global_batch), "train.steps": "1000000",
            "train.precision": "bf16", "train.tensorboard": "false", "train.compile": str(args.compile),
            "train.device": args.device, "model.max_seq_len": str(cfg.model.max_seq_len), **overrides(w, L)}
    trainer, step = shardlm_trainer(args.preset, over, extra)
    dt, mem = timed(step, args.warm, args.steps, args.device)
    world = int(os.environ.get("WORLD_SIZE", 1))
    peak = torch.tensor([mem + trainer.parallel.symmetric_bytes() / 2**30], device=args.device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tok = args.global_batch * args.seq / dt / world
    if int(os.environ.get("RANK", 0)) == 0:
        print("RESULT " + json.dumps({"system": name, "gpus": world, "step_s": dt, "tok_s_gpu": tok,
                                      "mfu": tok * cfg.model.flops_per_token(args.seq) / PEAK,
                                      "peak_mem_gib": float(peak)}), flush=True)
    trainer.close()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--card", default=None, help="the planner's GPU (h100, h200, ...); default: the one found")
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--cp", type=int, default=1, help="context parallelism: every layout splits sequences over cp ranks")
    p.add_argument("--count", type=int, default=10, help="layouts measured, best predicted first (the floor: 8)")
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--list", action="store_true", help="print the layouts and their predictions, measure none")
    driver_args(p, timeout=300)
    args, extra = p.parse_known_args()
    if args.card is None:
        import torch
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "NVIDIA H100"
        args.card = "h200" if "H200" in name else "h100"
    if args.system:
        return worker(args, extra)
    chosen = candidates(args)
    predicted = {name: (e, L) for name, e, _, L in chosen}
    if not args.list:
        own = forwarded(args, ("gpus", "card", "preset", "seq", "global_batch", "cp", "count", "warm", "steps",
                               "compile", "device"))
        rows = run_systems(__file__, [c[0] for c in chosen], lambda s: predicted[s][1].world, lambda s: [*own, *extra],
                           job_env(ROOT), args.timeout, args.budget)
    else:
        rows = []
    measured = {r["system"]: r for r in rows}
    print(f"\n{args.card} x{args.gpus}, {args.preset}, seq {args.seq}, global batch {args.global_batch}: "
          f"{len(chosen)} layouts, best predicted first")
    print(f"{'layout':<34}{'pred tok/s/GPU':>15}{'meas':>8}{'pred GiB':>10}{'meas':>7}{'mem err':>9}")
    def error(name):  # the memory prediction's relative error (None: not measured, or a CPU smoke run)
        r = measured.get(name)
        return predicted[name][0].memory.total / 2**30 / r["peak_mem_gib"] - 1 if r and r["peak_mem_gib"] else None

    for name, e, _, _ in chosen:
        r, err = measured.get(name), error(name)
        got = f"{r['tok_s_gpu']:.0f}" if r else "-"
        peak = f"{r['peak_mem_gib']:.1f}" if r else "-"
        off = f"{100 * err:.1f}%" if err is not None else "-"
        print(f"{name:<34}{e.tokens_per_s / args.gpus:>15.0f}{got:>8}{e.memory.total / 2**30:>10.1f}{peak:>7}{off:>9}")
    if rows:
        best = max(rows, key=lambda r: r["tok_s_gpu"])
        pick = measured.get(chosen[0][0])
        ratio = f"{pick['tok_s_gpu'] / best['tok_s_gpu']:.3f}" if pick else "not measured"
        errors = [abs(x) for x in map(error, measured) if x is not None]
        worst = f"{100 * max(errors):.1f}%" if errors else "-"
        print(f"planner's pick {chosen[0][0]}: {ratio} of the best measured ({best['system']}; floor >= 0.95); "
              f"memory error at most {worst} (floor 10%) over {len(rows)} layouts (floor: at least 8)")
    if rows and args.record and args.device == "cuda":
        import torch
        card = torch.cuda.get_device_name()
        with open(args.record, "a") as f:
            for r in rows:
                e, L = predicted[r["system"]]
                f.write(json.dumps({"bench": "planner_pick", "date": datetime.date.today().isoformat(), "card": card,
                                    "gpus": r["gpus"], "system": f"shardlm-{r['system']}", "model": args.preset,
                                    "seq": args.seq, "global_batch": args.global_batch,
                                    "micro_batch": int(r["system"].rsplit("mb", 1)[1]),
                                    "tok_s_gpu": round(r["tok_s_gpu"]), "mfu": round(r["mfu"], 4),
                                    "peak_mem_gib": round(r["peak_mem_gib"], 2),
                                    "predicted_tok_s_gpu": round(e.tokens_per_s / args.gpus),
                                    "predicted_mem_gib": round(e.memory.total / 2**30, 2),
                                    "planner_rank": [c[0] for c in chosen].index(r["system"]) + 1,
                                    "command": f"python bench/planner_pick.py --gpus {args.gpus} --preset {args.preset} "
                                               f"--seq {args.seq} --global-batch {args.global_batch} --count {args.count}"
                                               f"{f' --cp {args.cp}' if args.cp > 1 else ''}"})
                        + "\n")


if __name__ == "__main__":
    main()
