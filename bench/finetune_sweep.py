"""LoRA fine-tuning at each system's fastest setting that fits an 80 GB card, beside PEFT's: a sweep of
micro-batch and recomputation over bench/finetune.py's jobs, with each row's share of the matrix products'
bound (bench/finetune_bound.py) at its own setting.

    python bench/finetune_sweep.py --gpus 2 [--preset llama2-7b --seq 2048 --micro-batch 1 --microbatches 8]
    python bench/finetune_sweep.py --device cpu --preset tiny --seq 32 --micro-batch 1 --microbatches 4 \\
        --warm 1 --steps 1 --compile 0      # smoke run of the code, not a measurement

Every job trains the same sequences a step (--micro-batch x --microbatches of --seq tokens), split into
micro-batches of 1, 2, 4 or 8. shardlm's settings are ranked by the planner's step time among those it
predicts to fit --fit-gib, and the --top fastest run, besides the three block recomputations (full and its
partial forms, model/recompute.py) at PEFT's setting (--micro-batch, full recomputation). PEFT has no planner:
it runs full recomputation at --micro-batch and none at each micro-batch. Jobs are dealt to --gpus GPUs, one
job a GPU at a time (at 2 GPUs, PEFT's on one and shardlm's on the other), most needed first. A row fits when its peak allocated memory is at most --fit-gib (76 GiB: an 80 GB card's
79.2 GiB less the allocator's reserve beyond its peak); each system's best is its fastest row that fits.

Floors (issue 48, part 3): shardlm's best >= 1.2x PEFT's best; at PEFT's full-recomputation setting,
shardlm's fastest block recomputation at no more memory than PEFT's >= 1.1x PEFT. Rows go to
bench/results.jsonl with bench "finetune" and each job's setting.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import threading
from pathlib import Path

from common import job_env, run_systems, workload_args

ROOT = Path(__file__).resolve().parents[1]
OURS, PEER = "shardlm-lora", "peft-lora"
SCHEMES = ("none", "selective", "full-skip-out-down", "full-skip-down", "full")
BLOCK = ("full", "full-skip-down", "full-skip-out-down")


def micro_batches(args) -> list[int]:
    total = args.micro_batch * args.microbatches
    return [m for m in (1, 2, 4, 8) if total % m == 0]


def planned(args, micro: int, recompute: str) -> tuple[float, float]:
    """The planner's (peak GiB, step seconds) of shardlm's LoRA job at this setting on one --card."""
    from shardlm.config import load_config
    from shardlm.plan import Layout, Workload, estimate, gpu
    total = args.micro_batch * args.microbatches
    cfg = load_config(args.preset, {"train.seq_len": str(args.seq), "train.micro_batch_size": str(micro),
                                    "train.global_batch_size": str(total), "train.precision": "bf16",
                                    "train.recompute": recompute, "lora.rank": str(args.rank),
                                    "lora.alpha": str(args.alpha), "lora.targets": args.targets,
                                    "model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len))})
    e = estimate(cfg.model, Workload(args.seq, micro, total), Layout.from_config(cfg), gpu(args.card))
    return e.memory.total / 2**30, e.step_time_s


def jobs(args) -> list[str]:
    """The sweep's jobs, system/micro-batch/recompute, PEFT's and shardlm's alternating, each system's in the
    order its floors need them (a queue cut short by --budget keeps the first): PEFT's full-recomputation
    setting, then its largest micro-batch without recomputation that may fit, down; shardlm's block recomputations at that
    setting (the one without an extra tensor first) between its fastest predicted settings that fit."""
    plans = {(m, r): planned(args, m, r) for m in micro_batches(args) for r in SCHEMES}
    fits = sorted((step, m, r) for (m, r), (mem, step) in plans.items() if mem <= args.fit_gib)
    top = [f"{OURS}/{m}/{r}" for _, m, r in fits[:args.top]]
    block = [f"{OURS}/{args.micro_batch}/{r}" for r in ("full-skip-down", "full-skip-out-down", "full")]
    ours = list(dict.fromkeys(j for pair in zip(block, top + [None] * len(block)) for j in pair if j))
    ours += [j for j in top if j not in ours]
    # PEFT holds at least what shardlm's planner predicts for the same setting: none beyond it is tried
    peer = [f"{PEER}/{args.micro_batch}/full"] + [f"{PEER}/{m}/none" for m in reversed(micro_batches(args))
                                                   if plans[m, "none"][0] <= args.fit_gib]
    both = [j for pair in zip(peer, ours) for j in pair]
    longer = peer if len(peer) > len(ours) else ours
    return both + longer[min(len(peer), len(ours)):]


def run_on_gpus(args, names: list[str], own: list[str]) -> list[dict]:
    """The jobs dealt round-robin to --gpus queues, each queue's jobs one after another on its own GPU."""
    queues = [names[i::args.gpus] for i in range(args.gpus)]
    rows, lock = [], threading.Lock()

    def drain(gpu: int, queue: list[str]) -> None:
        env = job_env(ROOT)
        if args.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        got = run_systems(str(ROOT / "bench" / "finetune.py"), queue, lambda s: 1, lambda s: own, env,
                          args.timeout, args.budget)
        with lock:
            rows.extend(got)
    threads = [threading.Thread(target=drain, args=(g, q)) for g, q in enumerate(queues) if q]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(rows, key=lambda r: names.index(r["job"]))


def bounds(args, rows: list[dict]) -> None:
    """Each row's tokens/s over the matrix products' bound at its micro-batch and recomputation (GPU only)."""
    if args.device != "cuda":
        return
    from finetune_bound import bound_seconds, parts
    timed = {m: parts(args.preset, args.seq, m, 20) for m in sorted({r["micro_batch"] for r in rows})}
    for r in rows:
        r["bound_share"] = r["tok_s_gpu"] / (r["micro_batch"] * args.seq / bound_seconds(timed[r["micro_batch"]],
                                                                                          r["recompute"]))


def best(rows: list[dict], system: str, fit: float, **where) -> dict | None:
    chosen = [r for r in rows if r["system"] == system and r["peak_mem_gib"] <= fit
              and all(r[k] in v for k, v in where.items())]
    return max(chosen, key=lambda r: r["tok_s_gpu"], default=None)


def floors(args, rows: list[dict]) -> list[str]:
    peer_best, ours_best = best(rows, PEER, args.fit_gib), best(rows, OURS, args.fit_gib)
    setting = best(rows, PEER, float("inf"), micro_batch=(args.micro_batch,), recompute=("full",))
    ours_there = setting and best(rows, OURS, setting["peak_mem_gib"], micro_batch=(args.micro_batch,),
                                  recompute=BLOCK)

    def line(text, a, b, floor):
        if not (a and b):
            return f"{text}: - (a row is missing)"
        ratio = a["tok_s_gpu"] / b["tok_s_gpu"]
        return f"{text}: {ratio:.2f} ({a['job']} vs {b['job']}; {'met' if ratio >= floor else 'NOT met'})"
    return [line("best / PEFT's best that fit, floor >= 1.2", ours_best, peer_best, 1.2),
            line("at PEFT's full recomputation, no more memory, floor >= 1.1", ours_there, setting, 1.1)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(p)
    p.add_argument("--gpus", type=int, default=1, help="GPUs to deal the jobs to (one job a GPU at a time)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="all-linear")
    p.add_argument("--fit-gib", type=float, default=76.0, help="peak allocated GiB that fits the card")
    p.add_argument("--card", default="h200", help="the planner's GPU for its step times")
    p.add_argument("--top", type=int, default=3, help="shardlm's settings run, fastest predicted first")
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the jobs' code on gloo (tiny presets)")
    p.add_argument("--record", default=str(ROOT / "bench" / "results.jsonl"))
    p.add_argument("--timeout", type=float, default=600, help="seconds one job may take")
    p.add_argument("--budget", type=float, default=None, help="seconds each GPU's queue may take")
    args = p.parse_args()
    names = jobs(args)
    print(f"{len(names)} jobs on {args.gpus} GPU(s): {' '.join(names)}", flush=True)
    own = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("preset", "seq", "micro-batch", "microbatches",
                                                                    "rank", "alpha", "targets", "warm", "steps",
                                                                    "compile", "device")] + [f"--peer-compile={args.compile}"]
    rows = run_on_gpus(args, names, own)
    bounds(args, rows)
    card = "cpu"
    if args.device == "cuda":
        import torch
        card = torch.cuda.get_device_name()
    print(f"\n{card}, {args.preset}, seq {args.seq}, {args.micro_batch * args.microbatches} sequences a step, "
          f"LoRA rank {args.rank} on {args.targets}; fits: peak <= {args.fit_gib:g} GiB")
    print(f"{'job':<34}{'tok/s':>9}{'MFU':>8}{'peak GiB':>10}{'fits':>6}{'of bound':>10}{'planner s':>11}")
    for r in rows:
        share = f"{100 * r['bound_share']:.0f}%" if "bound_share" in r else "-"
        pred = f"{planned(args, r['micro_batch'], r['recompute'])[1]:.3f}" if r["system"] == OURS else "-"
        print(f"{r['job']:<34}{r['tok_s_gpu']:>9.0f}{100 * r['mfu']:>7.1f}%{r['peak_mem_gib']:>10.2f}"
              f"{'yes' if r['peak_mem_gib'] <= args.fit_gib else 'no':>6}{share:>10}{pred:>11}")
    if args.device != "cuda":
        print("(a CPU smoke run: the floors below are for the GPU measurement)")
    for text in floors(args, rows):
        print(text)
    if args.record and args.device == "cuda":
        with open(args.record, "a") as f:
            for r in rows:
                f.write(json.dumps({
                    "bench": "finetune", "date": datetime.date.today().isoformat(), "card": card, "gpus": 1,
                    "system": r["system"], "model": args.preset, "seq": args.seq, "micro_batch": r["micro_batch"],
                    "microbatches": r["microbatches"], "tok_s_gpu": round(r["tok_s_gpu"]), "mfu": round(r["mfu"], 4),
                    "peak_mem_gib": round(r["peak_mem_gib"], 2), "recompute": r["recompute"],
                    "compiled": r["compiled"], "bound_share": round(r.get("bound_share", 0.0), 3),
                    "command": f"python bench/finetune_sweep.py --preset {args.preset} --seq {args.seq} "
                               f"--micro-batch {args.micro_batch} --microbatches {args.microbatches} (job {r['job']})"})
                        + "\n")


if __name__ == "__main__":
    sys.exit(main())
