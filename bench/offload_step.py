"""The offloaded optimizer step alone, per parameter, beside DeepSpeedCPUAdam on the same cores: the CPU AdamW
that ZeRO-Offload's step time rests on (issue: at least as fast per parameter as DeepSpeed's).

    python bench/offload_step.py --params 1e9 --threads 16 [--device cuda] [--record bench/results.jsonl]

- shardlm: parallel/offload.py's OffloadedOptimizer over N bf16 parameters, its fp32 gradient shards already
  in host memory (where HostGradients leaves them): scale, global norm, torch's fused CPU AdamW on the fp32
  masters and moments, the updated bf16 weights written to pinned memory and copied to --device.
- shardlm-kernel: the AdamW kernel alone (kernels.adamw_master_step: cpu_adam.py's compiled pass, or torch's
  fused CPU AdamW without a C compiler) over N fp32 masters, moments and gradients: the same work as
  DeepSpeed's call below, which the issue's floor compares.
- torch-fused: torch's fused CPU AdamW (torch.optim.AdamW(fused=True)'s kernel) over the same tensors.
- deepspeed: DeepSpeedCPUAdam.step over the same N fp32 parameters with fp32 gradients (its AVX kernel; the
  bf16 copy-back is not in this call), where deepspeed imports (its cpu_adam op builds at first use).
Both run on --threads threads (torch.set_num_threads; OMP_NUM_THREADS for DeepSpeed's OpenMP loop). Every
system is built first, warmed up once, then timed in --steps rounds of one step of each in turn, so that a
drift of the host (its clock, a neighbour) falls on all of them alike: one system after another, the same
kernel measured 10% apart between calls. Prints each system's median seconds per step and nanoseconds per
parameter; with --record, one row per system, bench "offload_step".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def rounds(steps: dict, count: int, cuda: bool) -> dict:
    """Each system's step times over `count` rounds of every system in turn, after one warm-up step each."""
    import torch

    def timed(step):
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t
    for step in steps.values():
        timed(step)
    times = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            times[name].append(timed(step))
    return times


def shardlm_step(n: int, device: str, threads: int):
    import torch
    from torch import nn

    from shardlm.config import load_config
    from shardlm.flat import FlatParams
    from shardlm.parallel.offload import OffloadedOptimizer
    from shardlm.precision import NoLossScaler
    chunk = 16 * 2**20
    model = nn.Module()
    model.ws = nn.ParameterList(nn.Parameter(torch.randn(min(chunk, n - i), dtype=torch.bfloat16, device=device))
                                for i in range(0, n, chunk))
    flat = FlatParams(model, [[f"ws.{i}"] for i in range(len(model.ws))])
    opt = OffloadedOptimizer(flat, load_config("tiny", {}).train, NoLossScaler(), None, shard=True, threads=threads)
    for g in opt.host_parts():
        g.normal_()
    grads = opt.host_parts()
    steps = iter(range(1, 10**9))
    return lambda: opt.step(1e-4, next(steps), lambda b: grads[b], lambda b: flat.buckets[b].data)


def kernel_step(n: int):
    import torch

    from shardlm.kernels import adamw_master_step
    chunk = 16 * 2**20
    parts = [[torch.randn(min(chunk, n - i)) for _ in range(2)] + [torch.zeros(min(chunk, n - i)) for _ in range(2)]
             for i in range(0, n, chunk)]
    one, no = torch.ones(()), torch.zeros((), dtype=torch.bool)
    steps = iter(range(1, 10**9))

    def step():
        k = next(steps)
        for master, grad, m, v in parts:
            adamw_master_step(master, None, grad, m, v, one, no, step=k, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, host_kernel=True)
    return step


def torch_fused_step(n: int):
    """torch's fused CPU AdamW over the same tensors: what kernels.adamw_master_step runs without a C compiler."""
    import torch
    chunk = 16 * 2**20
    parts = [[torch.randn(min(chunk, n - i)) for _ in range(2)] + [torch.zeros(min(chunk, n - i)) for _ in range(2)]
             for i in range(0, n, chunk)]
    steps = iter(range(1, 10**9))

    def step():
        k = torch.tensor(float(next(steps)))
        for master, grad, m, v in parts:
            torch._fused_adamw_([master], [grad], [m], [v], [], [k], lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                                eps=1e-8, amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
    return step


def deepspeed_step(n: int):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    chunk = 16 * 2**20
    params = [torch.nn.Parameter(torch.randn(min(chunk, n - i))) for i in range(0, n, chunk)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.1, adamw_mode=True)
    return opt.step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--steps", type=int, default=5, help="rounds: one timed step of every system each")
    p.add_argument("--threads", type=int, default=0, help="0: this process's cores")
    p.add_argument("--device", default="cpu", help="where the 16-bit weights live (cuda: the copy back is timed)")
    p.add_argument("--systems", nargs="+", default=["shardlm", "shardlm-kernel", "torch-fused", "deepspeed"])
    p.add_argument("--record", default="")
    a = p.parse_args()
    import torch
    threads = a.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    n, cuda = int(a.params), a.device == "cuda"
    builders = {"shardlm": lambda: shardlm_step(n, a.device, threads), "shardlm-kernel": lambda: kernel_step(n),
                "torch-fused": lambda: torch_fused_step(n), "deepspeed": lambda: deepspeed_step(n)}
    steps = {}
    for system in a.systems:
        try:
            steps[system] = builders[system]()
        except ImportError as e:
            print(f"{system}: skipped ({e})")
    rows = []
    for system, times in rounds(steps, a.steps, cuda).items():
        dt = statistics.median(times)
        rows.append({"system": system, "s": dt, "ns_per_param": dt / n * 1e9})
        print(f"{system:<15} {n / 1e6:,.0f}M parameters, {threads} threads: {dt:.3f} s per step (median of {a.steps}, "
              f"{min(times):.3f} to {max(times):.3f}), {dt / n * 1e9:.2f} ns per parameter", flush=True)
    by = {r["system"]: r["s"] for r in rows}
    if "deepspeed" in by:
        for ours in ("shardlm-kernel", "torch-fused", "shardlm"):
            if ours in by:
                print(f"{ours} / deepspeed time per parameter: {by[ours] / by['deepspeed']:.2f}"
                      + {"shardlm-kernel": " (floor <= 1.0)", "shardlm": " (with the norm and the bf16 weights)"}.get(ours, ""))
    if a.record:
        card = torch.cuda.get_device_name() if cuda else "cpu"
        with open(a.record, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "offload_step", "date": datetime.date.today().isoformat(), "card": card,
                                    "gpus": 1 if cuda else 0, "system": r["system"], "model": f"{n} parameters",
                                    "seq": None, "micro_batch": None, "tok_s_gpu": None, "mfu": None,
                                    "peak_mem_gib": None, "threads": threads, "step_s": round(r["s"], 4),
                                    "ns_per_param": round(r["ns_per_param"], 3),
                                    "command": f"python bench/offload_step.py --params {a.params:g} --threads "
                                               f"{threads} --device {a.device} --steps {a.steps} --systems "
                                               f"{' '.join(a.systems)}"}) + "\n")


if __name__ == "__main__":
    main()
