"""FLOPs per step and the predicted step time.

Model FLOPs per token are ModelConfig.flops_per_token, the runtime's own count: 6 x matmul parameters +
12 x layers x heads x head_dim x seq (Narayanan et al. 2021, eq. 3, and the torchtitan convention;
for the GPT block this is their 72 B s l h^2 (1 + s/(6h) + V/(16 l h)) per batch). Recomputation adds
forward work the MFU does not credit: full recomputation one more forward of the layers (8N instead of
6N per token), selective the attention scores and values again (12 -> 16 L h s).

Step time = compute / (peak x efficiency) x (1 + pipeline bubble) + the optimizer's memory traffic +
the part of each collective not hidden behind compute + an MoE's routed copies' own passes
(MOE_ROUTING_BYTES); attention's computed FLOPs (half the square the MFU counts, under the causal mask) run
at their own efficiency, 0.4. The efficiency (the fraction of the dense
peak that shardlm's fused blocks reach, 0.55) and the exposed fractions of collectives (all-reduce 0.85,
reduce-scatter 0.3, ZeRO-3's prefetched gathers 0.1, ZeRO-1/2's post-step all-gather 1.0) were measured
on H200s with tinyllama-1.1b (bench/README.md); override them for other hardware.
"""
from __future__ import annotations

from functools import lru_cache

from ..config import BLOCK_RECOMPUTE, ModelConfig, rank_layers
from ..schedules import Simulation, schedule, simulate
from .layout import Layout, Workload

EFFICIENCY = 0.55
# Attention's computed FLOPs (attention_flops_per_token) run at their own rate: at long sequences they are most
# of the step, and the fused kernels' rate depends on the head size and the kernel, not on the GEMMs'. Fitted
# to context parallelism's rows at 16k and 64k tokens on H200s (cuDNN's kernels; bench/README.md).
ATTENTION_EFFICIENCY = 0.4
ADAM_BYTES = 28          # per parameter: 16-bit grad in, fp32 master, m, v in and out, 16-bit weight out
# train.optimizer_dtype bf16: master, m, v in and out at 2 bytes each; the 16-bit weight written apart only where
# the optimizer is sharded (unsharded, the weights are the masters)
ADAM_BYTES_BF16 = {True: 16, False: 14}
# Bytes per feature (hidden + 2 x expert ffn) of each routed token copy in each MoE layer, for what the copies
# cost beside the products a dense block has too: the permutations into and out of expert order, the gathers and
# their scatter-adds backward, the experts' SwiGLU forward, backward and recomputed. Fitted to moe-1b on one H200
# (58.6 ms a step of 8,192 tokens, 40.3 predicted without it; bench/README.md, twenty-eighth lease).
MOE_ROUTING_BYTES = 50


def model_flops_per_token(m: ModelConfig, seq: int) -> float:
    return m.flops_per_token(seq)


@lru_cache(maxsize=256)
def simulated(name: str, pp: int, v: int, m: int) -> Simulation:
    """The pipeline schedule's table (schedules.py), simulated with unit costs."""
    return simulate(schedule(name, pp, v, m), pp)


def recompute_flops_per_token(m: ModelConfig, seq: int, recompute: str) -> float:
    c = m.param_counts()
    attn = 4 * m.num_layers * m.num_heads * m.head_size * seq  # one forward of QK^T and AV
    if recompute in BLOCK_RECOMPUTE:  # the partial forms skip the down (and out) projections' forward
        return 2 * (c["layers"]) + attn - skipped_flops_per_token(m, recompute)
    if recompute == "selective":
        return attn
    return 0.0


def attention_flops_per_token(m: ModelConfig, seq: int, recompute: str) -> float:
    """The attention score and value products' share of the counted FLOPs (model and recomputation), as
    computed: the causal kernels skip the masked half of the square that the MFU convention counts."""
    forward = 4 * m.num_layers * m.num_heads * m.head_size * seq  # the full square, as counted
    counted = 3 * forward + (forward if recompute in BLOCK_RECOMPUTE or recompute == "selective" else 0)
    return counted / 2


def skipped_flops_per_token(m: ModelConfig, recompute: str) -> float:
    """The forward FLOPs a partial recomputation's recomputed forward leaves out (model/recompute.py): the
    dense MLP's down projection (ffn x hidden), with full-skip-out-down also attention's output projection
    (heads x head_dim x hidden), 2 FLOPs a weight, every layer (an MoE layer's experts are not counted)."""
    dense = m.num_layers - m.moe_layers()
    down = 2 * m.ffn_size * m.hidden_size * dense if recompute in ("full-skip-down", "full-skip-out-down") else 0
    out = 2 * m.num_heads * m.head_size * m.hidden_size * m.num_layers if recompute == "full-skip-out-down" else 0
    return float(down + out)


def moe_routing_seconds(m: ModelConfig, w: Workload, L: Layout, hbm_bw: float) -> float:
    """A step's routed-copy passes (MOE_ROUTING_BYTES) on the busiest rank: its pipeline stage's MoE layers,
    its replica's tokens (each tp rank routes its slice), top_k copies each. Fixed-size blocks at ep > 1
    (parallel.ep_dispatch padded) hold ep times the copies on the experts' side of the passes, half of them."""
    layers = m.moe_layers() / L.pp
    if not layers:
        return 0.0
    copies = w.global_batch * w.seq / (L.dp * L.cp * L.tp) * m.top_k
    padded = (1 + L.ep) / 2 if L.ep_padded(m.capacity_factor == 0) else 1.0
    return layers * copies * padded * MOE_ROUTING_BYTES * (m.hidden_size + 2 * m.moe_ffn_size) / hbm_bw


def bubble(w: Workload, L: Layout) -> float:
    """Idle time over compute time of the busiest pipeline rank, from the schedule's own table run by the
    simulator with F = 1, B = 2 (I = W = 1): (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) interleaved,
    (p - 1) / (3 m) for zb-h1, p - 1 for naive."""
    if L.pp == 1:
        return 0.0
    sim = simulated(L.pp_schedule, L.pp, L.virtual_stages, w.global_batch // (w.micro_batch * L.dp))
    return sim.time / max(sim.busy) - 1


def stage_imbalance(m: ModelConfig, L: Layout) -> float:
    """A split given by parallel.pp_layers: its busiest pipeline rank's compute over that of the split balanced
    by compute (1: as balanced), by split_layers' own cost (a layer's FLOPs per token, the head's on the last
    rank). The balanced split's own unevenness is in the measured pipeline rows the efficiencies were fitted
    to, so it is the reference."""
    if L.pp == 1 or not L.pp_layers:
        return 1.0
    return _busiest(m, L, L.pp_layers) / _busiest(m, L, "")


def _busiest(m: ModelConfig, L: Layout, pp_layers: str) -> float:
    per_layer = m.param_counts()["active_per_layer"]
    cost = [per_layer * len(layers) for layers in rank_layers(m, L.pp, L.virtual_stages, pp_layers)]
    cost[-1] += m.vocab_size * m.hidden_size
    return max(cost)
