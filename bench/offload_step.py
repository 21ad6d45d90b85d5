"""The offloaded optimizer step alone: MasterWeightOptimizer with `offload` on N bf16 parameters whose
gradients live on --device (cuda: the real ZeRO-Offload path with its copies over PCIe; cpu: only the
host-side work), timed over a few steps.

    python bench/offload_step.py --params 275e6 --threads 4 [--device cuda]

275M is a rank's shard of tinyllama-1.1b at 4 GPUs; --threads is what `parallel.offload_threads` sets.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from shardlm.config import load_config
from shardlm.flat import FlatParams
from shardlm.optim import MasterWeightOptimizer
from shardlm.precision import NoLossScaler


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=100e6)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="0: torch's default")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    n, chunk = int(a.params), 16 * 2**20
    model = nn.Module()
    model.ws = nn.ParameterList(nn.Parameter(torch.randn(min(chunk, n - i), dtype=torch.bfloat16, device=a.device))
                                for i in range(0, n, chunk))
    flat = FlatParams(model, [[f"ws.{i}"] for i in range(len(model.ws))])
    for b in flat.buckets:
        b.grad.normal_()
    opt = MasterWeightOptimizer(flat, load_config("tiny", {}).train, NoLossScaler(), offload=True)
    times = []
    for s in range(a.steps):
        t = time.perf_counter()
        opt.step(1e-3, s + 1, lambda b: flat.buckets[b].grad, lambda b: flat.buckets[b].data, 0.5)
        if a.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    print(f"{n / 1e6:.0f}M parameters, gradients on {a.device}, {torch.get_num_threads()} threads: "
          f"{min(times[1:]):.3f} s per step (first {times[0]:.3f} s)")


if __name__ == "__main__":
    main()
