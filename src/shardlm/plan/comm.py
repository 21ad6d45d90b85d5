"""Bytes each GPU sends per step on each parallel axis, and how long that takes on its link.

Ring collectives (Patarasuk & Yuan 2009): an all-reduce of B bytes moves 2(n-1)/n B per GPU, a
reduce-scatter or an all-gather (n-1)/n B. DDP all-reduces the gradients once per step (16-bit
gradients reduced in fp32: a reduce-scatter, then a 16-bit all-gather; the reduce-scatter moves 16-bit
values with reduce_algo all_to_all, fp32 values with ring); ZeRO-1/2 reduce-scatter them and all-gather
the updated weights (the same volume); ZeRO-3 also gathers the weights again for backward: 1.5x DDP
(Rajbhandari et al. 2020, section 7). Tensor parallelism runs four
collectives of b s h per layer per micro-batch (two all-reduces forward, two backward; with sequence
parallelism the same volume as all-gathers and reduce-scatters); pipeline parallelism sends b s h
activations forward and their gradients back across each stage boundary per micro-batch; context
parallelism all-gathers K and V per layer. An axis that spans GPUs of one node uses NVLink, else the
network.
"""
from __future__ import annotations

from ..config import ModelConfig
from .hardware import GPU
from .layout import Layout, Workload
from .memory import stage_params


def comm_bytes(m: ModelConfig, w: Workload, L: Layout) -> dict[str, float]:
    act = 2 if L.precision != "fp32" else 4
    micro = w.global_batch // (w.micro_batch * L.dp)
    tokens = w.seq * w.micro_batch / L.cp
    phi = stage_params(m, L, 0)
    n = L.dp
    red = 4 if (L.reduce_dtype == "fp32" or L.precision == "fp32") else act
    if L.reduce_algo in ("auto", "all_to_all", "copy_engine"):
        red = act  # the 16-bit values travel; each rank sums its slice in fp32 (comm/collectives.py)
    ring = (n - 1) / n
    if n == 1:
        dp = 0.0
    elif L.zero_stage == 0:
        dp = ring * phi * (red + act)  # a reduce-scatter and a 16-bit all-gather (comm/transport.py)
    elif L.zero_stage in (1, 2):
        dp = ring * phi * (red + act)
    else:
        dp = ring * phi * (red + 2 * act)
    layers = m.num_layers // L.pp
    t = L.tp
    tp = 0.0 if t == 1 else 4 * 2 * (t - 1) / t * tokens * m.hidden_size * act * layers * micro
    pp = 0.0 if L.pp == 1 else 2 * tokens * m.hidden_size * act * micro
    kv = m.kv_heads * m.head_size / t
    cp = 0.0 if L.cp == 1 else 2 * (L.cp - 1) / L.cp * 2 * tokens * L.cp * kv * act * layers * micro
    # Expert parallelism: dispatch and combine all-to-alls forward and again backward, each moving the
    # routed copies of every token (top_k of them) except the 1/ep that stay local (Lepikhin et al. 2021).
    ep = 0.0 if L.ep == 1 else 4 * (L.ep - 1) / L.ep * tokens * m.top_k * m.hidden_size * act * layers * micro
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}


def link_bw(g: GPU, group: int, stride: int, gpus_per_node: int) -> float:
    """An axis whose `group` ranks sit `stride` apart in the rank grid stays inside a node if it fits."""
    return g.nvlink_bw if group * stride <= gpus_per_node else g.network_bw


EXPOSED = {"allreduce": 0.85, "reduce_scatter": 0.3, "allgather_step": 1.0, "zero3_gather": 0.1, "tp": 1.0, "pp": 0.0}


def comm_seconds(m: ModelConfig, w: Workload, L: Layout, g: GPU, gpus_per_node: int) -> float:
    """Exposed communication time per step."""
    b = comm_bytes(m, w, L)
    tp_bw = link_bw(g, L.tp, 1, gpus_per_node)
    dp_bw = link_bw(g, L.dp, L.tp * L.cp, gpus_per_node)
    pp_bw = link_bw(g, L.pp, L.tp * L.cp * L.dp, gpus_per_node)
    ep_bw = link_bw(g, L.ep, L.tp * L.cp, gpus_per_node)
    t = b["tp"] / tp_bw * EXPOSED["tp"] + b["pp"] / pp_bw * EXPOSED["pp"] + b["cp"] / tp_bw + b["ep"] / ep_bw
    if L.dp > 1:
        if L.zero_stage == 0:
            t += b["dp"] / dp_bw * EXPOSED["allreduce"]
        elif L.zero_stage in (1, 2):
            t += b["dp"] / dp_bw * (EXPOSED["reduce_scatter"] + EXPOSED["allgather_step"]) / 2
        else:
            t += b["dp"] / dp_bw * EXPOSED["zero3_gather"]
    return t
