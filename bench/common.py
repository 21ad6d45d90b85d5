"""What every benchmark here shares: the timing loop and the one FLOPs-per-token formula all systems are
charged (6 x non-embedding parameters + 12 x layers x hidden x seq, the torchtitan convention that
../shared/bench/peer_baseline.py uses) against the dense bf16 peak of an H100/H200."""
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


def flops_per_token(m, seq: int) -> int:
    return 6 * (m.num_params() - m.param_counts()["embedding"]) + 12 * m.num_layers * m.hidden_size * seq
