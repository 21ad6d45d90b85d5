"""Bytes each GPU sends per step on each parallel axis, and how long that takes on its link.

Ring collectives (Patarasuk & Yuan 2009): an all-reduce of B bytes moves 2(n-1)/n B per GPU, a
reduce-scatter or an all-gather (n-1)/n B. DDP all-reduces the gradients once per step (16-bit
gradients reduced in fp32: a reduce-scatter, then a 16-bit all-gather; the reduce-scatter moves 16-bit
values with reduce_algo all_to_all, fp32 values with ring); ZeRO-1/2 reduce-scatter them and all-gather
the updated weights (the same volume); ZeRO-3 also gathers the weights again for backward: 1.5x DDP
(Rajbhandari et al. 2020, section 7). With gradient accumulation DDP and ZeRO-1 still reduce once per
step, while ZeRO-2 and -3 reduce-scatter (and ZeRO-3 gathers) on every micro-step. Tensor parallelism runs four
collectives of b s h per layer per micro-batch (two all-reduces forward, two backward; with sequence
parallelism the same volume as all-gathers and reduce-scatters); pipeline parallelism sends b s h
activations forward and their gradients back across each stage boundary per micro-batch; context
parallelism (Ulysses) exchanges q, k and v before each layer's attention and its output after it, all-to-alls
that each keep 1/cp of a rank's slice, forward and again backward (and in the recomputed forward); ring attention
(`cp_comm` p2p) passes every other rank's keys and values through each rank instead. Its ranks
hold the same parameters, so gradients are reduced over dp x cp. An axis that spans GPUs of one node uses
NVLink, else the network.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig, exchanged_kv_heads
from .hardware import GPU
from .layout import Layout, Workload
from .memory import nf4_weights, rank_layers, stage_params, trained_and_frozen


def comm_bytes(m: ModelConfig, w: Workload, L: Layout) -> dict[str, float]:
    act = 2 if L.precision != "fp32" else 4
    micro = w.global_batch // (w.micro_batch * L.dp)
    tokens = w.seq * w.micro_batch / L.cp
    phi = stage_params(m, L, 0) - nf4_weights(m, L, 0)  # gathered by ZeRO-3 (QLoRA's 4-bit weights stay whole)
    grads, _ = trained_and_frozen(m, L, 0, act)  # reduced: LoRA's adapters alone
    n = L.replicas
    red = 4 if (L.reduce_dtype == "fp32" or L.precision == "fp32") else act
    if L.reduce_algo in ("auto", "all_to_all", "copy_engine"):
        red = act  # the 16-bit values travel; each rank sums its slice in fp32 (comm/collectives.py)
    ring = (n - 1) / n
    if n == 1:
        dp = 0.0
    elif L.zero_stage in (0, 1):  # once per step: a reduce-scatter and a 16-bit all-gather (comm/transport.py)
        dp = ring * grads * (red + act)
    elif L.zero_stage == 2:  # a reduce-scatter on every micro-step, the all-gather after the step
        dp = ring * grads * (red * micro + act)
    else:  # and the weights gathered for forward and for backward on every micro-step
        dp = ring * (grads * red + phi * 2 * act) * micro
    layers = rank_layers(m, L, 0)
    t = L.tp
    tp = 0.0 if t == 1 else 4 * 2 * (t - 1) / t * tokens * m.hidden_size * act * layers * micro
    pp = 0.0 if L.pp == 1 else 2 * tokens * m.hidden_size * act * micro
    q = m.num_heads // t
    kv = m.kv_heads // t if m.kv_heads % t == 0 else q  # fewer than tp: every rank reads one per query head
    kv = exchanged_kv_heads(q, kv, L.cp)  # repeated where cp does not divide them
    passes = 3 if L.recompute == "full" else 2  # forward, backward, and the recomputed forward
    exchanged = tokens * (2 * q + 2 * kv) * m.head_size * act  # q, k, v in; the output back
    cp = 0.0 if L.cp == 1 else passes * (L.cp - 1) / L.cp * exchanged * layers * micro
    if L.cp > 1 and L.cp_comm == "p2p":  # ring attention: each forward (and backward) passes cp - 1 chunks of k
        # and v on; backward also each chunk's fp32 gradient all the way home (cp passes). Its time is counted as
        # the attention FLOPs of flash attention: its fp32 scores outside the fused kernels, and the causal
        # imbalance between its ranks (the last does cp blocks, the first one), are not modelled.
        chunk = tokens * 2 * (m.kv_heads // t if m.kv_heads % t == 0 else q) * m.head_size
        cp = (passes * (L.cp - 1) * chunk * act + L.cp * chunk * 4) * layers * micro
    # Expert parallelism: dispatch and combine all-to-alls forward and again backward, each moving the
    # routed copies of every token (top_k of them) except the 1/ep that stay local (Lepikhin et al. 2021).
    ep = 0.0 if L.ep == 1 else 4 * (L.ep - 1) / L.ep * tokens * m.top_k * m.hidden_size * act * layers * micro
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}


def link_bw(g: GPU, group: int, stride: int, gpus_per_node: int) -> float:
    """An axis whose `group` ranks sit `stride` apart in the rank grid stays inside a node if it fits."""
    return g.nvlink_bw if group * stride <= gpus_per_node else g.network_bw


EXPOSED = {"allreduce": 0.85, "reduce_scatter": 0.3, "allgather_step": 1.0, "zero3_gather": 0.1, "tp": 1.0, "pp": 0.0}
# ZeRO-2 and -3 reduce on every micro-step; each micro-step before the last costs this much per gradient
# bucket (parallel.bucket_mb) beyond the last one's exposed traffic. Fitted to the four ZeRO-2/3 rows with
# accumulation that bench/planner_pick.py measured (4x H100, llama2-7b, 4 and 8 micro-steps: 58 to 100 us).
ACCUM_BUCKET_S = 80e-6


def comm_seconds(m: ModelConfig, w: Workload, L: Layout, g: GPU, gpus_per_node: int) -> float:
    """Exposed communication time per step."""
    b = comm_bytes(m, w, L)
    tp_bw = link_bw(g, L.tp, 1, gpus_per_node)
    dp_bw = link_bw(g, L.replicas, L.tp, gpus_per_node)  # dp x cp, cp inside dp (mesh.py's AXES)
    cp_bw = link_bw(g, L.cp, L.tp, gpus_per_node)
    pp_bw = link_bw(g, L.pp, L.tp * L.cp * L.dp, gpus_per_node)
    ep_bw = link_bw(g, L.ep, L.tp * L.cp, gpus_per_node)
    t = b["tp"] / tp_bw * EXPOSED["tp"] + b["pp"] / pp_bw * EXPOSED["pp"] + b["cp"] / cp_bw + b["ep"] / ep_bw
    if L.replicas > 1:
        act = 2 if L.precision != "fp32" else 4
        micro = w.global_batch // (w.micro_batch * L.dp)
        once = b["dp"] if L.zero_stage < 2 else comm_bytes(m, replace(w, global_batch=w.global_batch // micro), L)["dp"]
        if L.zero_stage == 0:
            t += once / dp_bw * EXPOSED["allreduce"]
        elif L.zero_stage in (1, 2):
            t += once / dp_bw * (EXPOSED["reduce_scatter"] + EXPOSED["allgather_step"]) / 2
        else:
            t += once / dp_bw * EXPOSED["zero3_gather"]
        if L.zero_stage >= 2:
            buckets = trained_and_frozen(m, L, 0, act)[0] * act / (L.bucket_mb * 2**20)
            t += (micro - 1) * buckets * ACCUM_BUCKET_S
    return t
