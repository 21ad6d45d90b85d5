"""The planner: per-GPU memory, FLOPs, step time, MFU and communication of a training layout, before launch.

Pure arithmetic (no torch import), sharing the runtime's shape arithmetic (shardlm.config.ModelConfig).
memory.py, flops.py, comm.py and offload.py each document their formulas and sources; search.py ranks layouts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import BLOCK_RECOMPUTE, NF4_BYTES_PER_WEIGHT, ModelConfig
from ..config.views import group_span
from .comm import comm_bytes, comm_seconds
from .flops import (ADAM_BYTES, ADAM_BYTES_BF16, ATTENTION_EFFICIENCY, EFFICIENCY, attention_flops_per_token, bubble,
                    model_flops_per_token, moe_routing_seconds, recompute_flops_per_token, stage_imbalance)
from .frozen import frozen_flops_per_token, layout_frozen
from .hardware import GPU, gpu
from .layout import Layout, PlanError, Workload, check
from .memory import (Memory, checkpoint_bytes, estimate_memory, in_flight, nf4_weights, paper_model_states,
                     trained_and_frozen, zero_shard)
from .offload import host_bytes, offload_seconds

__all__ = ["Estimate", "GPU", "Layout", "Memory", "PlanError", "Workload", "estimate", "gpu", "host_bytes",
           "paper_model_states"]

HEADROOM = 0.10      # of the card's memory kept free for allocator fragmentation and transient spikes
CUDA_CONTEXT = 0.75 * 2**30  # CUDA context, cuBLAS and NCCL state: outside torch's allocator, so outside `total`


@dataclass(frozen=True)
class Estimate:
    memory: Memory
    flops_per_step: float      # per GPU, including recomputation
    step_time_s: float
    mfu: float
    bubble: float
    comm_bytes_per_step: dict
    fits: bool
    tokens_per_s: float        # whole cluster
    train_flops: float = 0.0
    train_days: float = 0.0
    gpu_hours: float = 0.0     # training cost is counted in these: days x 24 x GPUs
    cost: float = 0.0          # gpu_hours x the price per GPU-hour, when one is given
    host_memory: float = 0.0   # per rank, bytes of host memory that offload takes (offload.host_bytes)
    checkpoint_bytes: float = 0.0       # a sharded checkpoint's size (save_bytes)
    checkpoint_rank_bytes: float = 0.0  # the most one rank writes of it
    checkpoint_save_s: float = 0.0      # that rank's write at its share of the node's disk rate

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"] = {**asdict(self.memory), "total": self.memory.total}
        d["activation_per_layer"] = d["memory"].pop("activation_per_layer")
        return d


def estimate(m: ModelConfig, w: Workload, L: Layout, g: GPU, gpus_per_node: int = 8, gpus: int | None = None,
             efficiency: float = EFFICIENCY, price_per_gpu_hour: float = 0.0,
             attention_efficiency: float = ATTENTION_EFFICIENCY) -> Estimate:
    check(m, w, L, gpus)
    mem = estimate_memory(m, w, L)
    tokens_per_gpu = w.global_batch * w.seq / (L.dp * L.cp)  # a model replica's tokens, split over tp x pp
    per_token = L.lora.flops_per_token(m, w.seq) if L.lora.rank else \
        model_flops_per_token(m, w.seq) - frozen_flops_per_token(m, L)
    model = per_token * tokens_per_gpu / (L.tp * L.pp)
    extra = recompute_flops_per_token(m, w.seq, L.recompute) * tokens_per_gpu / (L.tp * L.pp)
    b = bubble(w, L)
    # counted = computed + the masked half of attention's square: the rest at `efficiency`, the fused attention
    # kernels' share apart (standard attention computes the whole square in plain GEMMs: all at `efficiency`)
    fused = L.attention == "flash"
    attention = fused * attention_flops_per_token(m, w.seq, L.recompute) * tokens_per_gpu / (L.tp * L.pp)
    rest = model + extra - 2 * attention
    compute = (rest / efficiency + attention / attention_efficiency) / g.peak_flops * (1 + b) * stage_imbalance(m, L)
    phi, _ = trained_and_frozen(m, L, 0, 2)
    shard = zero_shard(m, L, 0, phi) if L.zero_stage >= 1 else phi  # each parameter over its own reduce group
    separate_master = L.zero_stage >= 1 and group_span(L, "dp+cp")[0] > 1  # else the weights are the masters
    adam_bytes = ADAM_BYTES_BF16[separate_master] if L.optimizer_dtype == "bf16" else ADAM_BYTES
    optimizer = offload_seconds(m, w, L, g, gpus_per_node, compute) if L.offload != "none" else \
        shard * adam_bytes / g.hbm_bw
    step = compute + optimizer + comm_seconds(m, w, L, g, gpus_per_node) + moe_routing_seconds(m, w, L, g.hbm_bw)
    if L.offload_activations:  # each block's input comes back up when its backward starts, on the compute stream
        micro = w.global_batch // (w.micro_batch * L.dp)
        step += micro / in_flight(w, L) * checkpoint_bytes(m, w, L) / g.pcie_bw
    if L.lora.quantize == "nf4":  # each NF4 weight dequantised (read, 16-bit written and read) in every pass
        passes = 3 if L.recompute in BLOCK_RECOMPUTE else 2
        micro = w.global_batch // (w.micro_batch * L.dp)
        step += passes * micro * nf4_weights(m, L, 0) * (NF4_BYTES_PER_WEIGHT + 4) / g.hbm_bw
    mfu = model / (step * g.peak_flops)
    tokens_per_s = w.global_batch * w.seq / step
    train_flops = train_days = 0.0
    if w.tokens:
        n = m.num_params() - m.param_counts()["embedding"] - m.param_counts()["position"]
        train_flops = (8 if L.recompute in BLOCK_RECOMPUTE else 6) * n * w.tokens
        train_days = w.tokens / tokens_per_s / 86400
    gpu_hours = train_days * 24 * L.gpus
    fits = mem.total + CUDA_CONTEXT <= g.memory * (1 - HEADROOM)
    saved, per_rank = save_bytes(m, L)
    save_s = per_rank / (g.disk_bw / min(gpus_per_node, L.gpus))  # the node's ranks write at once
    return Estimate(mem, model + extra, step, mfu, b, comm_bytes(m, w, L), fits, tokens_per_s, train_flops, train_days,
                    gpu_hours, gpu_hours * price_per_gpu_hour, host_bytes(m, L, w), saved, per_rank, save_s)


def save_bytes(m: ModelConfig, L: Layout) -> tuple[float, float]:
    """(the whole, the most one rank writes) of a sharded checkpoint (parallel/sharded_state.py): every trained
    parameter's master and AdamW moments once (fp32, or bf16 under --optimizer-dtype bf16), spread evenly over
    the world's ranks (each writes the elements it owns), and a LoRA run's frozen base (or train.freeze's
    parameters) in the training dtype, written by the ranks of the first data replica: its routed experts by
    the first of their edp ranks, each ep rank its block (whole on every tp rank: the first writes)."""
    held = layout_frozen(m, L)
    if L.lora.rank:
        frozen, experts = m.num_params(), m.param_counts()["expert_per_layer"] * m.moe_layers()
    else:
        frozen, experts = (held.total, sum(held.experts)) if held is not None else (0, 0)
    trained = L.lora.adapter_count(m) if L.lora.rank else m.num_params() - frozen
    state = 6 if L.optimizer_dtype == "bf16" else 12  # a master and two moments
    kept = 4 if L.precision == "fp32" else 2
    per_rank = state * trained / L.gpus + kept * (frozen - experts) / (L.pp * L.tp) + kept * experts / (L.pp * L.ep)
    return state * trained + kept * frozen, per_rank
