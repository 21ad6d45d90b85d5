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
hold the same parameters, so dense gradients are reduced over dp x cp; a mixture of experts' experts, split
over ep, over the ranks holding the same ones, edp = dp x cp / ep (none at ep = dp x cp). A group whose
ranks (groups.py's sizes and strides) lie inside one node uses NVLink, else the network.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import BLOCK_RECOMPUTE, ModelConfig, exchanged_kv_heads
from ..config.views import group_span, within_node
from .hardware import GPU
from .layout import Layout, Workload
from .memory import (expert_params, expert_replicas, nf4_weights, rank_layers, stage_params, trained_and_frozen,
                     trained_experts)


def reduce_bytes(m: ModelConfig, w: Workload, L: Layout) -> dict[str, float]:
    """Bytes each GPU sends per step reducing gradients (and gathering ZeRO's weights), by reduce group:
    "dp+cp" for the dense parameters, "edp" for the experts' (over edp x tp ranks: expert_replicas)."""
    act = 2 if L.precision != "fp32" else 4
    micro = w.global_batch // (w.micro_batch * L.dp)
    phi = stage_params(m, L, 0) - nf4_weights(m, L, 0)  # gathered by ZeRO-3 (QLoRA's 4-bit weights stay whole)
    grads, _ = trained_and_frozen(m, L, 0, act)  # reduced: LoRA's adapters alone, or what train.freeze leaves
    experts = expert_params(m, L, 0)  # gathered over edp; reduced there too, those that train
    trained = trained_experts(m, L, 0)
    # Frozen experts split over ep or routed whole per tp rank stay whole under ZeRO-3 (zero3_frozen.py)
    gathered = experts if L.ep == 1 and L.tp == 1 else trained
    groups = {"dp+cp": (grads - trained, phi - experts), "edp": (trained, gathered)}
    red = 4 if (L.reduce_dtype == "fp32" or L.precision == "fp32") else act
    if L.reduce_algo in ("auto", "all_to_all", "copy_engine"):
        red = act  # the 16-bit values travel; each rank sums its slice in fp32 (comm/collectives.py)
    out = {}
    for name, (reduced, gathered) in groups.items():
        if not (reduced or gathered):  # no experts (or none trained nor gathered): nothing over edp
            out[name] = 0.0
            continue
        n = group_span(L, name)[0] if name == "dp+cp" else expert_replicas(L)
        ring = (n - 1) / n
        if n == 1:
            out[name] = 0.0
        elif L.zero_stage in (0, 1):  # once per step: a reduce-scatter and a 16-bit all-gather (comm/transport.py)
            out[name] = ring * reduced * (red + act)
        elif L.zero_stage == 2:  # a reduce-scatter on every micro-step, the all-gather after the step
            out[name] = ring * reduced * (red * micro + act)
        else:  # and the weights gathered for forward and for backward on every micro-step
            out[name] = ring * (reduced * red + gathered * 2 * act) * micro
    return out


def comm_bytes(m: ModelConfig, w: Workload, L: Layout) -> dict[str, float]:
    """Bytes each GPU sends per step on each axis; "dp" counts every gradient reduction (dense and experts')."""
    return {"dp": sum(reduce_bytes(m, w, L).values()), **model_parallel_bytes(m, w, L)}


def model_parallel_bytes(m: ModelConfig, w: Workload, L: Layout) -> dict[str, float]:
    """Bytes each GPU sends per step on the axes that split a model replica's work: tp, pp, cp and ep."""
    act = 2 if L.precision != "fp32" else 4
    micro = w.global_batch // (w.micro_batch * L.dp)
    tokens = w.seq * w.micro_batch / L.cp
    layers = rank_layers(m, L, 0)
    t = L.tp
    tp = 0.0 if t == 1 else 4 * 2 * (t - 1) / t * tokens * m.hidden_size * act * layers * micro
    pp = 0.0 if L.pp == 1 else 2 * tokens * m.hidden_size * act * micro
    q = m.num_heads // t
    kv = m.kv_heads // t if m.kv_heads % t == 0 else q  # fewer than tp: every rank reads one per query head
    kv = exchanged_kv_heads(q, kv, L.cp)  # repeated where cp does not divide them
    passes = 3 if L.recompute in BLOCK_RECOMPUTE else 2  # forward, backward, and the recomputed forward
    exchanged = tokens * (2 * q + 2 * kv) * m.head_size * act  # q, k, v in; the output back
    cp = 0.0 if L.cp == 1 else passes * (L.cp - 1) / L.cp * exchanged * layers * micro
    if L.cp > 1 and L.cp_comm == "p2p":  # ring attention: each forward (and backward) passes cp - 1 chunks of k
        # and v on; backward also each chunk's fp32 gradient all the way home (cp passes). Its time is counted as
        # the attention FLOPs of flash attention: its fp32 scores outside the fused kernels, and the causal
        # imbalance of the contiguous layout capacity routing keeps (the last rank does cp blocks, the first
        # one; zig-zag chunks balance them otherwise), are not modelled.
        chunk = tokens * 2 * (m.kv_heads // t if m.kv_heads % t == 0 else q) * m.head_size
        cp = (passes * (L.cp - 1) * chunk * act + L.cp * chunk * 4) * layers * micro
    # Expert parallelism: dispatch and combine all-to-alls forward and again backward, each moving the
    # routed copies of every token (top_k of them) except the 1/ep that stay local (Lepikhin et al. 2021);
    # fixed-size blocks send every peer room for all of them (parallel/expert.py).
    sent = L.ep - 1 if L.ep_padded(not m.capacity_factor) else (L.ep - 1) / L.ep
    ep = 0.0 if L.ep == 1 else 4 * sent * tokens * m.top_k * m.hidden_size * act * layers * micro
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep}


def tp_collectives(m: ModelConfig, w: Workload, L: Layout) -> int:
    """Tensor parallelism's collectives per step on a rank: per layer and pass, two all-gathers and two
    reduce-scatters with sequence parallelism, two all-reduces without; forward, backward and a recomputed
    forward."""
    if L.tp == 1:
        return 0
    passes = 3 if L.recompute in BLOCK_RECOMPUTE else 2
    micro = w.global_batch // (w.micro_batch * L.dp)
    return (4 if L.sp else 2) * passes * rank_layers(m, L, 0) * micro


def link_bw(g: GPU, L: Layout, group: str, gpus_per_node: int) -> float:
    """The bandwidth of the named group's link (groups.py): NVLink if its ranks stay inside a node."""
    return g.nvlink_bw if within_node(L, group, gpus_per_node) else g.network_bw


EXPOSED = {"allreduce": 0.85, "reduce_scatter": 0.3, "allgather_step": 1.0, "zero3_gather": 0.1, "tp": 1.0, "pp": 0.0}
# Each of tensor parallelism's synchronous collectives (a layer's all-gathers and reduce-scatters with sp, its
# all-reduces without, in forward, backward and a recomputed forward) takes tp - 1 steps of a ring, each this
# much beyond its bytes at the link's rate (the alpha of the alpha-beta model): the launch and the ranks' wait
# for the slowest, at thousands of collectives a step. Fitted to the tp rows bench/planner_validation.py reads
# (llama2-7b, seq 4096: tp 2 on 2x H200, dp 2 x tp 2 and pp 2 x tp 2 on 4x H100, tp 4 on 4x H200 within 5%;
# tp 4 on 4x H100 -17%).
TP_STEP_S = 35e-6
# ZeRO-2 and -3 reduce on every micro-step; each micro-step before the last costs this much per gradient
# bucket (parallel.bucket_mb) beyond the last one's exposed traffic. Fitted to the four ZeRO-2/3 rows with
# accumulation that bench/planner_pick.py measured (4x H100, llama2-7b, 4 and 8 micro-steps: 58 to 100 us).
ACCUM_BUCKET_S = 80e-6


def comm_seconds(m: ModelConfig, w: Workload, L: Layout, g: GPU, gpus_per_node: int) -> float:
    """Exposed communication time per step."""
    def seconds(group: str, sent: float) -> float:  # an idle group's link is not looked up (the search's hot path)
        return sent / link_bw(g, L, group, gpus_per_node) if sent else 0.0

    b = model_parallel_bytes(m, w, L)
    t = seconds("tp", b["tp"]) * EXPOSED["tp"] + seconds("pp", b["pp"]) * EXPOSED["pp"] + seconds("cp", b["cp"]) \
        + seconds("ep", b["ep"]) + tp_collectives(m, w, L) * (L.tp - 1) * TP_STEP_S
    if L.replicas > 1:
        act = 2 if L.precision != "fp32" else 4
        micro = w.global_batch // (w.micro_batch * L.dp)
        # ZeRO-2 and -3 reduce on every micro-step: the last one's traffic is exposed
        once = reduce_bytes(m, w if L.zero_stage < 2 else replace(w, global_batch=w.global_batch // micro), L)
        for group, sent in once.items():  # the dense gradients over dp x cp, the experts' over edp
            if L.zero_stage == 0:
                t += seconds(group, sent) * EXPOSED["allreduce"]
            elif L.zero_stage in (1, 2):
                t += seconds(group, sent) * (EXPOSED["reduce_scatter"] + EXPOSED["allgather_step"]) / 2
            else:
                t += seconds(group, sent) * EXPOSED["zero3_gather"]
        if L.zero_stage >= 2:
            buckets = trained_and_frozen(m, L, 0, act)[0] * act / (L.bucket_mb * 2**20)
            t += (micro - 1) * buckets * ACCUM_BUCKET_S
    return t
