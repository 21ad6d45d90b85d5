"""The planner's inference figures (`shardlm plan --inference`): memory of the weights, the KV cache of a batch
of requests and the engine's workspace, how many requests fit, and the decode speed.

A decode step reads every weight but the input embedding once, and each row's cached keys and values up to
the positions it attends over, so its time is at least those bytes over the memory's bandwidth (the bound
that gpt-fast and the inference literature quote: batch-1 tokens/s = bandwidth / weight bytes). The
engine's compiled step reached DECODE_EFFICIENCY of that bound on one H200 (llama2-7b, bf16: 204 tok/s at
batch 1, 56%; 2,468 at batch 16 with a 385-position cache, 53%; bench/generate.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .hardware import GPU

DECODE_EFFICIENCY = 0.55
PREFILL_TOKENS = 8192  # the engine's default tokens per prefill pass (inference.Engine)


@dataclass(frozen=True)
class InferencePlan:
    weights: float        # bytes
    kv_cache: float       # bytes, the batch's slots of `context` positions
    workspace: float      # bytes: a prefill pass's activations, the batch's logits and sampling
    fits: bool
    slots: int            # requests of `context` positions that fit beside the weights
    step_bound_s: float   # a decode step over the batch at the bandwidth bound
    tokens_per_s: float   # the batch's new tokens a second at DECODE_EFFICIENCY of that bound
    batch1_tokens_per_s: float  # likewise for one request of `context` positions

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.workspace


def plan_inference(m: ModelConfig, g: GPU, batch: int, context: int, itemsize: int = 2, headroom: float = 0.10,
                   reserved: float = 0.75 * 2**30) -> InferencePlan:
    """`batch` requests of up to `context` positions each (prompt and new tokens) on one GPU of `g`, weights
    and cache in `itemsize`-byte numbers; `reserved`: the CUDA context outside torch's allocator."""
    weights = m.num_params() * itemsize
    per_slot = (context + 1) * m.kv_bytes_per_token(itemsize)  # + the engine's scratch position
    activations = PREFILL_TOKENS * (2 * m.ffn_size + (m.num_heads + 2 * m.kv_heads) * m.head_size
                                    + 4 * m.hidden_size) * itemsize
    logits = 4 * 4 * m.vocab_size  # fp32 logits, sorted copy, order and noise per row
    workspace = activations + batch * logits
    usable = g.memory * (1 - headroom) - reserved
    slots = max(0, int((usable - weights - activations) // (per_slot + logits)))
    read = weights - m.param_counts()["embedding"] * itemsize
    cache = context * m.kv_bytes_per_token(itemsize)  # a row's at `context` positions: the batch's slowest step

    def tokens_per_s(rows: int) -> float:
        return DECODE_EFFICIENCY * rows * g.hbm_bw / (read + rows * cache)

    return InferencePlan(weights, batch * per_slot, workspace, weights + batch * per_slot + workspace <= usable,
                         slots, (read + batch * cache) / g.hbm_bw, tokens_per_s(batch), tokens_per_s(1))
