"""What every benchmark here shares: the timing loop and the dense bf16 peak of an H100/H200 that every
system is charged against, with the one FLOPs-per-token definition (shardlm.config.ModelConfig.flops_per_token:
6 x matmul parameters + 12 x layers x heads x head_dim x seq, the torchtitan convention that
../shared/bench/peer_baseline.py uses)."""
import time

PEAK = 989e12


def timed(step, warm: int, steps: int) -> tuple[float, float]:
    """Seconds per step (mean over `steps` after `warm` warm-up steps) and peak GiB allocated while timing."""
    import torch
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps, torch.cuda.max_memory_allocated() / 2**30

