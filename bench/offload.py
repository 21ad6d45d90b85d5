"""Offload on one GPU: full training of a 7-8B model with the optimizer (and the parameters) in host memory,
shardlm beside DeepSpeed's ZeRO-Offload on the same shapes and batch.

    python bench/offload.py [--preset llama2-7b] [--seq 2048] [--micro-batch 1] [--microbatches 8]
    python bench/offload.py --preset llama3-8b --systems shardlm-zero2-offload
    CUDA_VISIBLE_DEVICES=0 python bench/offload.py ...   # one GPU of a larger host (say the host's cores)
    python bench/offload.py --profile 1 ...               # + seconds a step in each host-side phase

Each system is its own process on one GPU; a step is --microbatches micro-batches of --micro-batch x --seq
tokens, bf16, full recomputation, AdamW with the update on the CPU.
- shardlm-zero2-offload: `parallel.zero_stage 2, parallel.offload optimizer`: 16-bit weights on the GPU,
  gradient shards accumulated in pinned host memory as each bucket is done, fp32 masters and moments and
  the step on the CPU (parallel/offload.py). Blocks compiled.
- shardlm-zero2-offload-delayed: the same with the one-step delayed parameter update (`parallel.delayed_update`:
  changes the math, each gradient one update stale; the step's CPU update runs beside the next step).
- shardlm-zero2-offload-acts: the same with each block's input (what full recomputation keeps) in pinned host
  memory until its backward (`parallel.offload_activations`): larger micro-batches in the same GPU memory.
- shardlm-zero2-offload-overlap, -acts-overlap: the same with the update beside the next step's first forward,
  which waits block by block for its weights (`parallel.overlap_update`: exact).
- shardlm-zero2-offload-nvme: the same with the fp32 masters and moments in files under $TMPDIR/shardlm-nvme
  (`parallel.offload_dir`: ZeRO-Infinity's NVMe tier; the disk bandwidth is logged).
- shardlm-zero3-offload-params: `parallel.zero_stage 3, parallel.offload params`: the 16-bit weights in
  host memory too, each unit gathered to the GPU around its use; -nvme: the masters, moments and 16-bit
  shards in files under $TMPDIR/shardlm-nvme (ZeRO-Infinity's NVMe tier).
- ds-zero2-offload, ds-zero3-offload: DeepSpeed's ZeRO-Offload (optimizer states and the update on the CPU)
  on Hugging Face's LlamaForCausalLM of the preset's shape, by ../shared/bench/peer_offload.py's method
  (bf16 weights, sdpa, gradient checkpointing, DeepSpeedCPUAdam, each micro-batch through engine.step);
  ds-zero3-offload-params: ZeRO-Infinity's parameter offload too (`offload_param` to pinned CPU memory).
  ZeRO-3's model is built under deepspeed.zero.Init, partitioned as it is made, as DeepSpeed's users build
  models larger than the GPU. Needs deepspeed importable (its cpu_adam op builds at first use).
MFU charges ModelConfig.flops_per_token (6 N + attention) against 989 TFLOP/s; peak memory is
torch.cuda.max_memory_allocated over the timed steps, the build's peak the same before them (what the card
must hold to start), the host's the process's peak resident memory (getrusage, pinned buffers included). Prints a
table with the ratios to ds-zero2-offload and the issue's floor (shardlm ZeRO-2 + offload >= 1.5x its tokens/s at
<= its peak memory), and the host threads' seconds a step (wall and CPU: the difference is time spent waiting);
appends rows with bench "offload", each with the rate the host's AdamW pass streams at on the same cores
(`host_bw_gb_s`, which bench/planner_validation.py gives the planner).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from common import (PEAK, driver_args, forwarded, host_rate, job_env, run_systems, shardlm_trainer, timed,
                    workload_args)

ROOT = Path(__file__).resolve().parents[1]
SHARDLM = {"shardlm-zero2-offload": {"parallel.zero_stage": "2", "parallel.offload": "optimizer"},
           "shardlm-zero2-offload-delayed": {"parallel.zero_stage": "2", "parallel.offload": "optimizer",
                                             "parallel.delayed_update": "true"},
           "shardlm-zero2-offload-acts": {"parallel.zero_stage": "2", "parallel.offload": "optimizer",
                                          "parallel.offload_activations": "true"},
           "shardlm-zero2-offload-overlap": {"parallel.zero_stage": "2", "parallel.offload": "optimizer",
                                             "parallel.overlap_update": "true"},
           "shardlm-zero2-offload-acts-overlap": {"parallel.zero_stage": "2", "parallel.offload": "optimizer",
                                                  "parallel.offload_activations": "true",
                                                  "parallel.overlap_update": "true"},
           "shardlm-zero2-offload-nvme": {"parallel.zero_stage": "2", "parallel.offload": "optimizer",
                                          "parallel.offload_dir": os.path.join(tempfile.gettempdir(), "shardlm-nvme")},
           "shardlm-zero3-offload-params": {"parallel.zero_stage": "3", "parallel.offload": "params"},
           "shardlm-zero3-offload-params-nvme": {"parallel.zero_stage": "3", "parallel.offload": "params",
                                                 "parallel.offload_dir": os.path.join(tempfile.gettempdir(),
                                                                                      "shardlm-nvme")}}
# DeepSpeed systems: (ZeRO stage, parameters offloaded too)
PEERS = {"ds-zero2-offload": (2, False), "ds-zero3-offload": (3, False), "ds-zero3-offload-params": (3, True)}
BASELINE = "ds-zero2-offload"


def model_config(args):
    from shardlm.config import load_config
    return load_config(args.preset, {"model.max_seq_len": str(max(args.seq, load_config(args.preset).model.max_seq_len))})


def build_peak_gib(device: str) -> float:
    """GiB the GPU held at most while the model and its engine were built (the timed steps' peak leaves this
    out: a model that trains in 20 GiB but is built whole first needs its full size on the card)."""
    import torch
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def host_peak_gib() -> float:
    """This process's peak resident host memory (pinned buffers included), in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def worker(args, extra):
    """One shardlm system in this process: its RESULT line."""
    import torch
    over = {"train.seq_len": str(args.seq), "train.micro_batch_size": str(args.micro_batch),
            "train.global_batch_size": str(args.micro_batch * args.microbatches), "train.steps": "1000000",
            "train.precision": "bf16", "train.tensorboard": "false", "train.compile": str(bool(args.compile)).lower(),
            "train.recompute": "full", "train.device": args.device, "parallel.dp": "1",
            "model.max_seq_len": str(model_config(args).model.max_seq_len), **SHARDLM[args.system]}
    t0 = time.perf_counter()
    trainer, step = shardlm_trainer(args.preset, over, extra)
    print(f"[{args.system}] built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    build = build_peak_gib(args.device)

    def step_said():  # progress on stderr: a 7B step on the CPU's optimizer takes seconds
        step()
        print(f"[{args.system}] step done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.switch_interval:  # how long a host thread may wait for the GIL (bench/README.md, twelfth lease)
        sys.setswitchinterval(args.switch_interval)
    for _ in range(args.warm):
        step_said()
    host = getattr(trainer.engine, "host_grads", None)
    before = dict(host.seconds) if host is not None else {}
    phases = {}
    if not args.profile:
        dt, mem = timed(step_said, 0, args.steps, args.device)
    else:  # seconds a timed step in each host-side phase (parallel/offload.py's shardlm.offload.* ranges)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            dt, mem = timed(step_said, 0, args.steps, args.device)
        phases = {e.key.removeprefix("shardlm.offload."): round(e.cpu_time_total / 1e6 / args.steps, 3)
                  for e in prof.key_averages() if e.key.startswith("shardlm.offload.")}
    # The host threads' phases a step (the profiler sees the main thread's only), wall and CPU seconds.
    host_s = {k: round((v - before.get(k, 0.0)) / args.steps, 3) for k, v in (host.seconds if host else {}).items()
              if v > before.get(k, 0.0)}
    tokens = args.micro_batch * args.microbatches * args.seq
    m = model_config(args).model
    print("RESULT " + json.dumps({"system": args.system, "params": m.num_params(), "step_s": dt, "tok_s": tokens / dt,
                                  "mfu": tokens / dt * m.flops_per_token(args.seq) / PEAK,
                                  "peak_mem_gib": mem + trainer.engine.symmetric_bytes() / 2**30,
                                  "build_peak_gib": build, "host_peak_gib": host_peak_gib(),
                                  **trainer.engine.metrics(),
                                  **({"phases_s": phases} if phases else {}),
                                  **({"host_thread_s": host_s} if host_s else {})}), flush=True)
    trainer.close()
    if args.device == "cuda":
        torch.cuda.synchronize()


def ds_worker(args):
    """One DeepSpeed system in this process (PEERS): its RESULT line, charged the same FLOPs as shardlm's."""
    import deepspeed
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlm.hf_config import hf_config_from_model
    m = model_config(args).model
    if m.arch != "llama" or m.qkv_bias or m.sliding_window:  # LlamaConfig would drop a bias or a window
        raise SystemExit(f"{args.system}: DeepSpeed runs HF's LlamaForCausalLM, a plain Llama; {args.preset} is not")
    stage, params_too = PEERS[args.system]
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
            "contiguous_gradients": True}
    if params_too:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.microbatches,
              "bf16": {"enabled": True}, "zero_optimization": zero, "steps_per_print": 10**9}
    hf = LlamaConfig(**{**hf_config_from_model(m, "bfloat16"), "attn_implementation": "sdpa"})
    deepspeed.init_distributed()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    t0 = time.perf_counter()
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
            model = LlamaForCausalLM(hf)
    else:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf).to(torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=DeepSpeedCPUAdam(model.parameters(), lr=1e-5),
                                           config=config)
    print(f"[{args.system}] built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    build = build_peak_gib("cuda")
    x = torch.randint(0, hf.vocab_size, (args.micro_batch, args.seq), device="cuda")

    def step():
        for _ in range(args.microbatches):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        print(f"[{args.system}] step done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    dt, mem = timed(step, args.warm, args.steps, "cuda")
    tokens = args.micro_batch * args.microbatches * args.seq
    print("RESULT " + json.dumps({"system": args.system, "params": m.num_params(), "step_s": dt, "tok_s": tokens / dt,
                                  "mfu": tokens / dt * m.flops_per_token(args.seq) / PEAK, "peak_mem_gib": mem,
                                  "build_peak_gib": build, "host_peak_gib": host_peak_gib()}),
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_args(p)
    p.add_argument("--warm", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of shardlm's systems (tiny presets)")
    p.add_argument("--profile", type=int, default=0,
                   help="1: each row gets the host-side phases' seconds a step (phases_s); rows not recorded")
    p.add_argument("--switch-interval", type=float, default=0,
                   help="seconds: the interpreter's switch interval for shardlm's systems after their build "
                        "(0: Python's, 5 ms)")
    p.add_argument("--systems", nargs="+", default=[*SHARDLM, *PEERS])
    driver_args(p, timeout=900)
    args, extra = p.parse_known_args()
    if args.system:
        return ds_worker(args) if args.system in PEERS else worker(args, extra)
    own = forwarded(args, ("preset", "seq", "micro_batch", "microbatches", "warm", "steps", "compile", "device",
                          "profile", "switch_interval"))
    unknown = [s for s in args.systems if s not in SHARDLM and s not in PEERS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}: choose from {[*SHARDLM, *PEERS]}")
    if args.device != "cuda" and any(s in PEERS for s in args.systems):
        print(f"{', '.join(s for s in args.systems if s in PEERS)}: skipped (DeepSpeed's offload runs on a GPU)",
              file=sys.stderr)
        args.systems = [s for s in args.systems if s in SHARDLM]
    rows = run_systems(__file__, args.systems, lambda s: 1, lambda s: [*own, *(extra if s in SHARDLM else [])],
                       job_env(ROOT), args.timeout, args.budget)
    card = "cpu"
    if args.device == "cuda":
        import torch
        card = torch.cuda.get_device_name()
    cores = len(os.sched_getaffinity(0))
    host_bw = host_rate() if args.device == "cuda" else None
    by = {r["system"]: r for r in rows}
    print(f"\n{card} x1 ({cores} cores), {args.preset}, {args.microbatches} micro-batches of "
          f"{args.micro_batch} x {args.seq}, full recomputation"
          + (f"; the host's AdamW pass streams {host_bw / 1e9:.0f} GB/s" if host_bw else ""))
    print(f"{'system':<30}{'params':>8}{'tok/s':>9}{'MFU':>8}{'peak GiB':>10}{'build GiB':>10}{'host GiB':>9}"
          f"{'vs ' + BASELINE:>22}")
    for r in rows:
        rel = f"{r['tok_s'] / by[BASELINE]['tok_s']:.2f}" if BASELINE in by else "-"
        disk = f"  (disk {r['disk_gb_s']:.1f} GB/s)" if "disk_gb_s" in r else ""
        print(f"{r['system']:<30}{r['params'] / 1e9:>7.2f}B{r['tok_s']:>9.0f}{100 * r['mfu']:>7.1f}%"
              f"{r['peak_mem_gib']:>10.1f}{r['build_peak_gib']:>10.1f}{r['host_peak_gib']:>9.0f}{rel:>22}{disk}")
        if "host_thread_s" in r:
            print(f"{'':<30}host threads a step (s): {r['host_thread_s']}")
    theirs = by.get(BASELINE)
    for ours in (r for r in rows if r["system"].startswith("shardlm-zero2-offload") and theirs):
        speed, mem = ours["tok_s"] / theirs["tok_s"], ours["peak_mem_gib"] / theirs["peak_mem_gib"]
        print(f"{ours['system']} / {BASELINE}: {speed:.2f}x tok/s (floor >= 1.5) at {mem:.2f}x peak memory "
              f"(floor <= 1.0): {'met' if speed >= 1.5 and mem <= 1.0 else 'NOT met'}")
    if args.record and args.device == "cuda" and not args.profile:  # a profiled step is slower: not a measurement
        with open(args.record, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "offload", "date": datetime.date.today().isoformat(), "card": card,
                                    "gpus": 1, "host_cores": cores, "system": r["system"], "model": args.preset,
                                    "params": r["params"], "seq": args.seq, "micro_batch": args.micro_batch,
                                    "microbatches": args.microbatches, "tok_s_gpu": round(r["tok_s"]),
                                    "mfu": round(r["mfu"], 4), "peak_mem_gib": round(r["peak_mem_gib"], 2),
                                    "build_peak_gib": round(r["build_peak_gib"], 2),
                                    "host_peak_gib": round(r["host_peak_gib"], 1),
                                    **({"disk_gb_s": round(r["disk_gb_s"], 2)} if "disk_gb_s" in r else {}),
                                    **({"ended": r["ended"]} if "ended" in r else {}),
                                    **({"host_bw_gb_s": round(host_bw / 1e9, 1)} if host_bw else {}),
                                    **({"host_thread_s": r["host_thread_s"]} if "host_thread_s" in r else {}),
                                    **({"switch_interval": args.switch_interval} if args.switch_interval and
                                       r["system"] in SHARDLM else {}),
                                    "command": f"python bench/offload.py --preset {args.preset} --seq {args.seq} "
                                               f"--micro-batch {args.micro_batch} --microbatches {args.microbatches} "
                                               f"--warm {args.warm} --steps {args.steps} --compile {args.compile} "
                                               + (f"--switch-interval {args.switch_interval} "
                                                  if args.switch_interval and r["system"] in SHARDLM else "")
                                               + f"--systems {r['system']}"}) + "\n")


if __name__ == "__main__":
    main()
