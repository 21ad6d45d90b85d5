"""Enumerate every valid layout for a cluster, drop those that do not fit, rank the rest by throughput.

The space: dp x tp x pp = GPUs / cp (the layout's cp, 1 by default) with tp inside a node and dividing the
heads, pp dividing the layers, for a mixture of experts every ep dividing both the experts and dp x cp (expert
parallelism is carved out of them; a dense model keeps ep 1), ZeRO 0-3 (3 only without pipelining), sequence
parallelism with tp > 1, recomputation none / selective / full, every micro-batch that divides the per-replica
batch, and the 1F1B or interleaved schedule. Each layout is a few hundred arithmetic operations, and each pipeline shape's schedule
is simulated once: 64 GPUs' 2,688 layouts of llama2-7b take about 5 s on one core, most of it the simulations.
"""
from __future__ import annotations

import math
from dataclasses import replace
from itertools import product

from ..config import BLOCK_RECOMPUTE, ModelConfig
from ..config.checks import MAX_ACCUM
from . import Estimate, HEADROOM, estimate
from .hardware import GPU
from .layout import Layout, PlanError, Workload, check


MAX_MICRO = 64  # sequences a micro-batch the search tries at most


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def expert_degrees(m: ModelConfig, dp: int, cp: int) -> list[int]:
    """The ep degrees config.check_layout accepts beside dp x cp; the rest of its refusals the estimate makes."""
    if not m.num_experts:
        return [1]
    return divisors(math.gcd(m.num_experts, dp * cp))


def layouts(m: ModelConfig, w: Workload, gpus: int, gpus_per_node: int, base: Layout, micro_batch: int | None = None):
    """Every valid layout with its micro-batch (`micro_batch`: that one only, where it divides a replica's batch)."""
    cp = base.cp  # context parallelism is searched over only where asked for (--cp): it pays for long sequences
    for tp in divisors(min(gpus // cp, gpus_per_node)):
        # ring attention (p2p) keeps the heads whole: only Ulysses needs cp to divide them
        # key/value heads that tp does not divide are kept whole on each rank, as the runtime does
        if m.num_heads % tp or gpus % (tp * cp) or base.cp_comm == "a2a" and (m.num_heads // tp) % cp:
            continue
        for pp in divisors(gpus // (tp * cp)):  # the runtime's split takes any pp up to the layers
            if pp > m.num_layers:
                continue
            dp = gpus // (tp * pp * cp)
            if w.global_batch % dp:
                continue
            micros = divisors(w.global_batch // dp) if micro_batch is None else \
                [micro_batch] if (w.global_batch // dp) % micro_batch == 0 else []
            for ep, micro in product(expert_degrees(m, dp, cp), micros):
                # the cap bounds the micro-batches tried, not one given; train refuses the accumulations' bound
                if micro_batch is None and micro > MAX_MICRO or w.global_batch // (dp * micro) > MAX_ACCUM:
                    continue
                for zero in ((0, 1, 2, 3) if pp == 1 else (0, 1)):
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for recompute in ("none", "selective", *BLOCK_RECOMPUTE):
                            schedules = [("1f1b", 1), ("zb-h1", 1)] if pp > 1 else [("1f1b", 1)]
                            if pp > 1 and m.num_layers >= pp * 2:
                                schedules.append(("interleaved", 2))
                            for sched, v in schedules:
                                yield replace(w, micro_batch=micro), replace(
                                    base, dp=dp, tp=tp, pp=pp, ep=ep, zero_stage=zero, sp=sp, recompute=recompute,
                                    pp_schedule=sched, virtual_stages=v)


def why(e: Estimate, L: Layout, best: Estimate | None) -> str:
    parts = [f"mem {e.memory.total / 2**30:.1f} GiB", f"step {e.step_time_s:.3f}s", f"MFU {100 * e.mfu:.1f}%"]
    if e.bubble:
        parts.append(f"bubble {100 * e.bubble:.0f}%")
    if L.recompute != "none":
        parts.append(f"{L.recompute} recompute costs compute")
    if best is not None and e is not best:
        parts.append(f"{best.tokens_per_s / e.tokens_per_s:.2f}x slower than the best")
    return ", ".join(parts)


def search(m: ModelConfig, w: Workload, g: GPU, gpus: int, gpus_per_node: int, base: Layout = Layout(),
           top: int = 5, price_per_gpu_hour: float = 0.0, micro_batch: int | None = None):
    """(ranked fitting (estimate, workload, layout) triples, number scored, number that did not fit); every
    micro-batch dividing a replica's batch tried, or `micro_batch` only."""
    if gpus % base.cp:
        raise PlanError(f"--gpus {gpus} is not a multiple of --cp {base.cp}: the search spreads dp x tp x pp over "
                        "the GPUs cp leaves")
    # What cp asks of the sequence and the heads holds at every tp and pp searched: named, as a plan without
    # --search names it, not left to read as no valid layout at all.
    check(m, Workload(w.seq, 1, 1), Layout(cp=base.cp, cp_comm=base.cp_comm))
    if w.global_batch > MAX_ACCUM * MAX_MICRO * gpus:  # not one layout valid: said before trying millions
        raise PlanError(f"--global-batch {w.global_batch:,} is over {MAX_ACCUM:,} micro-batches a step on each rank "
                        f"even at dp {gpus} and {MAX_MICRO} sequences a micro-batch, more than any run takes: lower "
                        f"it (to {MAX_ACCUM * MAX_MICRO * gpus:,} at most here)")
    fitting, scored, rejected = [], 0, 0
    for work, layout in layouts(m, w, gpus, gpus_per_node, base, micro_batch):
        try:
            e = estimate(m, work, layout, g, gpus_per_node, gpus, price_per_gpu_hour=price_per_gpu_hour)
        except PlanError:
            continue
        scored += 1
        if e.fits:
            fitting.append((e, work, layout))
        else:
            rejected += 1
    fitting.sort(key=lambda t: (-t[0].tokens_per_s, t[0].memory.total))  # ties: the one with more room
    return fitting[:top], scored, rejected, HEADROOM


def scaled(base: ModelConfig, hidden: int) -> ModelConfig | None:
    """`base`'s shape at another width: the same head size, layers per unit of width, FFN ratio (rounded to
    256, as Llama's), query heads per key/value head and vocabulary; Llama 2's 7B and 13B are each other's
    scaling. None where the width holds no whole number of heads or of key/value groups."""
    groups = base.num_heads // base.kv_heads
    if hidden % base.head_size or (hidden // base.head_size) % groups:
        return None
    heads = hidden // base.head_size
    layers = max(1, round(hidden * base.num_layers / base.hidden_size))
    ffn = max(256, round(hidden * base.ffn_size / base.hidden_size / 256) * 256)
    return replace(base, hidden_size=hidden, num_heads=heads, num_kv_heads=heads // groups, num_layers=layers,
                   ffn_hidden_size=ffn, head_dim=base.head_size)


def largest(base: ModelConfig, w: Workload, L: Layout, g: GPU, host_memory: float | None, gpus_per_node: int = 8,
            step: int = 256) -> tuple[ModelConfig, Estimate] | None:
    """The widest scaling of `base` (widths in multiples of `step`) whose layout `L` fits the GPU and, with
    offload, `host_memory` bytes per node (None: unbounded) shared by the node's ranks; None if none does."""
    try:
        check(base, w, L)
        refused = None
    except PlanError as e:  # said where no width passes: the layout as such, not as no width fitting
        refused = e
    best, estimated = None, False
    ranks_per_node = min(L.gpus, gpus_per_node)
    for hidden in range(step, 64 * 1024 + 1, step):
        m = scaled(base, hidden)
        if m is None:
            continue
        try:
            e = estimate(m, w, L, g, gpus_per_node)
        except PlanError:  # a width this layout cannot split (its heads over cp, say)
            continue
        estimated = True
        if not e.fits or (host_memory is not None and e.host_memory * ranks_per_node > host_memory):
            if best is not None:
                break  # memory grows with the width: nothing wider fits either
            continue
        best = (m, e)
    if not estimated and refused is not None:
        raise refused
    return best
