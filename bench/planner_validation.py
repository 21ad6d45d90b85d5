"""The planner against reality: predicted peak memory and step time beside what was measured on the GPU.

    python bench/planner_validation.py [--record bench/results.jsonl]

The measured figures are the rows of bench/results.jsonl that bench/single_gpu.py, bench/data_parallel.py,
bench/tensor_parallel.py, bench/context_parallel.py, bench/pipeline_parallel.py, bench/planner_pick.py,
bench/finetune.py and bench/offload.py wrote on the device
(torch.cuda.max_memory_allocated, plus symmetric memory, and the timed step), the newest row of each layout;
an offload row's host memory rate is the one measured beside it, where its row has one.
Rows timed eagerly (`--compile 0`) or without a warm-up step (`--warm 0`) are left out: the planner models
compiled steps in their steady state; so are rows marked "invalid" or "superseded" (the reason is in the row:
a figure the code no longer gives), rows run
"concurrent" with other jobs on the host (a share of its cores and memory bandwidth), and A/B rows whose command
changes a parallel setting beside the system's own (`--parallel.*`). Floors:
memory within 10%, step time within 25%.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from shardlm.config import LoRAConfig, load_config  # noqa: E402
from shardlm.plan import Layout, Workload, estimate, gpu  # noqa: E402

# (bench, gpus, system) -> the layout that system ran
LAYOUTS = {
    ("single_gpu", 1, "shardlm"): Layout(),
    ("single_gpu", 1, "shardlm-selective"): Layout(recompute="selective"),
    ("single_gpu", 1, "shardlm-full"): Layout(recompute="full"),
    ("data_parallel", 1, "shardlm-ddp"): Layout(),
    ("data_parallel", 4, "shardlm-ddp"): Layout(dp=4),
    ("data_parallel", 2, "shardlm-ddp"): Layout(dp=2),
    ("data_parallel", 2, "shardlm-zero1"): Layout(dp=2, zero_stage=1),
    ("data_parallel", 2, "shardlm-zero2"): Layout(dp=2, zero_stage=2),
    ("data_parallel", 2, "shardlm-zero1-a2a"): Layout(dp=2, zero_stage=1, reduce_algo="all_to_all"),
    ("data_parallel", 2, "shardlm-zero2-a2a"): Layout(dp=2, zero_stage=2, reduce_algo="all_to_all"),
    ("data_parallel", 2, "shardlm-zero3"): Layout(dp=2, zero_stage=3),
    ("data_parallel", 2, "shardlm-zero3-a2a"): Layout(dp=2, zero_stage=3, reduce_algo="all_to_all"),
    ("data_parallel", 4, "shardlm-ddp-bf16reduce"): Layout(dp=4, reduce_dtype="compute"),
    ("data_parallel", 4, "shardlm-ddp-ce"): Layout(dp=4, reduce_algo="copy_engine"),
    ("data_parallel", 4, "shardlm-ddp-a2a"): Layout(dp=4, reduce_algo="all_to_all"),
    ("data_parallel", 4, "shardlm-zero3-offload"): Layout(dp=4, zero_stage=3, offload="optimizer"),
    ("data_parallel", 4, "shardlm-zero1"): Layout(dp=4, zero_stage=1),
    ("data_parallel", 4, "shardlm-zero2"): Layout(dp=4, zero_stage=2),
    ("data_parallel", 4, "shardlm-zero3"): Layout(dp=4, zero_stage=3),
    ("data_parallel", 1, "shardlm-zero1"): Layout(zero_stage=1),
    ("data_parallel", 1, "shardlm-zero2"): Layout(zero_stage=2),
    ("data_parallel", 1, "shardlm-zero3"): Layout(zero_stage=3),
    ("tensor_parallel", 4, "shardlm-tp4-sp"): Layout(tp=4, sp=True),
    ("tensor_parallel", 2, "shardlm-tp2-sp"): Layout(tp=2, sp=True),
    ("context_parallel", 2, "shardlm-ring"): Layout(cp=2, cp_comm="p2p", zero_stage=3),
    ("context_parallel", 2, "shardlm-ulysses"): Layout(cp=2, cp_comm="a2a", zero_stage=3),
    ("tensor_parallel", 4, "shardlm-tp4"): Layout(tp=4),
    **{("pipeline_parallel", 4, f"shardlm-pp4-{s}"):
       Layout(pp=4, pp_schedule=s, virtual_stages=2 if s == "interleaved" else 1)
       for s in ("gpipe", "1f1b", "interleaved", "zb-h1")},
    ("pipeline_parallel", 4, "shardlm-pp2-tp2-1f1b"): Layout(pp=2, tp=2, sp=True),
    ("offload", 1, "shardlm-zero2-offload"): Layout(zero_stage=2, offload="optimizer", recompute="full"),
    ("offload", 1, "shardlm-zero2-offload-delayed"): Layout(zero_stage=2, offload="optimizer", recompute="full",
                                                            delayed_update=True),
    ("offload", 1, "shardlm-zero2-offload-acts"): Layout(zero_stage=2, offload="optimizer", recompute="full",
                                                         offload_activations=True),
    ("offload", 1, "shardlm-zero2-offload-overlap"): Layout(zero_stage=2, offload="optimizer", recompute="full",
                                                            overlap_update=True),
    ("offload", 1, "shardlm-zero2-offload-acts-overlap"): Layout(zero_stage=2, offload="optimizer", recompute="full",
                                                                 offload_activations=True, overlap_update=True),
    ("offload", 1, "shardlm-zero2-offload-nvme"): Layout(zero_stage=2, offload="optimizer", recompute="full",
                                                         offload_dir="nvme"),
    ("offload", 1, "shardlm-zero3-offload-params"): Layout(zero_stage=3, offload="params", recompute="full"),
    ("offload", 1, "shardlm-zero3-offload-params-nvme"): Layout(zero_stage=3, offload="params", recompute="full",
                                                                offload_dir="nvme"),
    # shardlm-tp2-dp2's only row leaves out its symmetric memory; planner_pick's dp2-tp2-sp-z1 row is that layout.
}


def pick_layout(system: str) -> Layout:
    """The layout of a bench/planner_pick.py row, from its name: shardlm-dp2-tp2-sp-pp2-zb-h1-z1-none-mb1 (with
    context parallelism shardlm-dp1-cp2-tp2-...)."""
    parts = system.removeprefix("shardlm-").split("-")
    cp = int(parts.pop(1)[2:]) if parts[1].startswith("cp") else 1
    dp, tp = int(parts[0][2:]), int(parts[1][2:])
    sp = parts[2] == "sp"
    rest = parts[3 if sp else 2:]
    pp = int(rest[0][2:])
    schedule = "-".join(rest[1:-3]) or "1f1b"
    return Layout(dp=dp, cp=cp, tp=tp, sp=sp, pp=pp, pp_schedule=schedule, zero_stage=int(rest[-3][1:]),
                  recompute=rest[-2], virtual_stages=2 if schedule == "interleaved" else 1)


def finetune_layout(r: dict) -> Layout | None:
    """The layout of a bench/finetune.py row of shardlm's, its LoRA rank and targets read from its command."""
    if r["system"] not in ("shardlm-lora", "shardlm-qlora"):
        return None
    flags = r["command"].split()
    # bench/finetune.py's (and finetune_sweep.py's) defaults where the command left them out
    rank, targets = (flags[flags.index(f) + 1] if f in flags else default
                     for f, default in (("--rank", "16"), ("--targets", "all-linear")))
    return Layout(recompute=r["recompute"], lora=LoRAConfig(rank=int(rank), targets=targets,
                                                           quantize="nf4" if r["system"] == "shardlm-qlora" else "none"))


def layout_of(r: dict) -> Layout | None:
    flags = " ".join(r.get("command", "").split()) + " "
    if "invalid" in r or "superseded" in r or r.get("concurrent") or any(f"{f} 0 " in flags or f"{f}=0 " in flags for f in ("--compile", "--warm")):
        return None
    if " --parallel." in flags:  # a parallel setting changed beside the system's own: an A/B
        return None
    if r["bench"] == "planner_pick":
        return pick_layout(r["system"])
    if r["bench"] == "finetune":
        return finetune_layout(r)
    return LAYOUTS.get((r["bench"], r["gpus"], r["system"]))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "bench" / "results.jsonl"))
    p.add_argument("--record", default=None, help="append planner_validation rows here")
    args = p.parse_args()
    rows = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x.strip()]
    latest = {}
    for r in rows:  # later rows are newer; seq variants of single_gpu count as their own layouts, and each card
        key = (r["bench"], r["gpus"], r["system"], r.get("model"), r.get("seq"), r.get("micro_batch"),
               r.get("microbatches"), r["card"])
        if layout_of(r) is not None and r.get("model") in ("tinyllama-1.1b", "llama2-7b", "llama3-8b", "llama2-13b"):
            latest[key] = r
    out, ok = [], True
    print(f"{'layout':<46}{'mem pred':>9}{'meas':>7}{'err':>7}{'step pred':>11}{'meas':>8}{'err':>7}")
    for (bench, gpus, system, model, seq, mb, micro, card), r in sorted(latest.items(), key=lambda kv: str(kv[0])):
        layout = layout_of(r)
        m = load_config(model, {"model.max_seq_len": str(seq)}).model
        batch = r.get("global_batch", mb * layout.dp * (micro or 1))
        # Offload's host side as fast as that host's AdamW pass was measured (bench/offload.py), where it was.
        host = {"host_bw": r["host_bw_gb_s"] * 1e9} if "host_bw_gb_s" in r else {}
        e = estimate(m, Workload(seq, mb, batch), layout, gpu("h200" if "H200" in r["card"] else "h100", **host))
        mem = e.memory.total / 2**30
        step = batch * seq / (r["tok_s_gpu"] * gpus)
        mem_err, step_err = mem / r["peak_mem_gib"] - 1, e.step_time_s / step - 1
        ok &= abs(mem_err) <= 0.10 and abs(step_err) <= 0.25
        name = f"{system} x{gpus} s{seq} mb{mb}" + (f" m{micro}" if micro else "") + (" H100" if "H100" in card else "")
        print(f"{name:<46}{mem:>9.1f}{r['peak_mem_gib']:>7.1f}{100 * mem_err:>+6.1f}%"
              f"{e.step_time_s:>11.3f}{step:>8.3f}{100 * step_err:>+6.1f}%")
        out.append({"bench": "planner_validation", "date": datetime.date.today().isoformat(), "card": r["card"],
                    "gpus": gpus, "system": name, "model": r["model"], "seq": seq, "micro_batch": mb,
                    "tok_s_gpu": r["tok_s_gpu"], "mfu": r["mfu"], "peak_mem_gib": r["peak_mem_gib"],
                    "predicted_mem_gib": round(mem, 2), "predicted_step_s": round(e.step_time_s, 4),
                    "measured_step_s": round(step, 4), "measured_commit": r.get("commit", ""),
                    "command": "python bench/planner_validation.py"})
    print(f"\n{len(out)} layouts; all within 10% memory and 25% step time: {ok}")
    if args.record:
        with open(args.record, "a") as f:
            for row in out:
                f.write(json.dumps(row) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
