"""The planner's inference figures (`shardlm plan --inference`): memory of the weights, the KV cache of a batch
of requests and the engine's workspace, how many requests fit, and the decode speed.

A decode step reads every weight but the input embedding once (of a mixture's routed experts, those its
rows' choices reach), and each row's cached keys and values up to the positions it attends over, so its
time is at least those bytes over the memory's bandwidth (the bound that gpt-fast and the inference
literature quote: batch-1 tokens/s = bandwidth / weight bytes). The engine's compiled step reaches
DECODE_EFFICIENCY of that bound on one H200 and ONE_ROW_EFFICIENCY at batch 1, where its one-row products run
as a Triton GEMV (model/gemv.py), since a step's kernels launch as one chain (inference/step_kernels.py; llama2-7b, bf16, bench/generate.py, 2026-12-01: 261-264 tok/s at batch 1, 2,881-2,897
at batch 16 with a 729-position cache; before the chain 246-251 and 3,008-3,079 with a 385-position one).

`generate --quantize int8|int4` (inference/quantize.py) stores linear layers' weights in fewer bytes, which
shrinks the weights and the bytes a decode step reads; its kernels reach a share of the bound of their own.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .hardware import GPU

DECODE_EFFICIENCY = 0.72
ONE_ROW_EFFICIENCY = 0.73
# The quantised products' share of their own, smaller bound: llama2-7b at batch 1 on one H200
# (bench/results.jsonl): int8 384.6 tok/s through inference/int8.py's one-row kernel (f16x2 dots) in the launch
# chain (336.8-355.8 before it); int4 501.5 through inference/int4.py's (bf16x2 dots) in the chain (402.9-465.8
# before it); each bound by the instructions it issues a byte or nibble, not by the memory's rate. Larger batches
# are not measured quantised.
QUANTIZED_EFFICIENCY = {"int8": 0.52, "int4": 0.38}
# A mixture's decode step reaches less of its (smaller) bound: routing, sorting and grouped GEMMs of a few rows per
# expert. mixtral-8x7b's shape on one H200 (bench/generate.py --preset mixtral-8x7b --prompt 128 --new 64,
# 2026-12-01): 83.8 tok/s at batch 1 and 423.4 at 16, 0.45 and 0.51 of the bound with only the reached experts read.
MOE_DECODE_EFFICIENCY = 0.48
QUANTIZE = ("none", "int8", "int4")
INT4_GROUPS = (128, 64, 32)  # inference/quantize.py's: the largest that divides a layer's input is its group
PREFILL_TOKENS = 8192  # the engine's default tokens per prefill pass (inference.Engine)


@dataclass(frozen=True)
class InferencePlan:
    weights: float        # bytes
    kv_cache: float       # bytes, the batch's slots of `context` positions
    workspace: float      # bytes: a prefill pass's activations, the batch's logits and sampling
    fits: bool
    slots: int            # requests of `context` positions that fit beside the weights
    step_bound_s: float   # a decode step over the batch at the bandwidth bound
    tokens_per_s: float   # the batch's new tokens a second at the measured share of that bound
    batch1_tokens_per_s: float  # likewise for one request of `context` positions

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.workspace


def linears(m: ModelConfig) -> list[tuple[int, int, int, str]]:
    """(inputs, outputs, how many, where) of the model's nn.Linear layers, where is "block", "router" (an MoE's,
    which --quantize leaves as it is) or "head" (an untied output head, which --quantize stores in int8).
    The routed experts are stacked weights, not linear layers: no --quantize touches them."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_size, m.kv_heads * m.head_size
    n_moe = m.moe_layers()
    up = 2 * m.ffn_size if m.arch != "gpt2" else m.ffn_size
    out = [(h, q + 2 * kv, m.num_layers, "block"), (q, h, m.num_layers, "block"),
           (h, up, m.num_layers - n_moe, "block"), (m.ffn_size, h, m.num_layers - n_moe, "block")]
    if n_moe:
        out.append((h, m.num_experts, n_moe, "router"))
        shared = m.shared_expert_ffn_hidden_size
        if shared:
            out += [(h, 2 * shared, n_moe, "block"), (shared, h, n_moe, "block"), (h, 1, n_moe, "block")]
    if not m.tie_embeddings:
        out.append((h, m.vocab_size, 1, "head"))
    return [x for x in out if x[2]]


def weight_bytes(m: ModelConfig, itemsize: int, quantize: str = "none") -> float:
    """The model's weights in `itemsize`-byte numbers, the linear layers that `quantize` (none, int8, int4)
    reaches (the blocks') stored as inference/quantize.py stores them: int8, one byte a weight and one scale per
    output; int4, half a byte a weight and a scale and a zero point (a byte) per group of inputs (a layer whose input no
    group divides stays as it was); the output head in int8 for either (an untied head's 16-bit weight replaced, a
    tied one's int8 copy beside the embedding). Scales, biases, norms and embeddings keep `itemsize`."""
    total = m.num_params() * itemsize
    if quantize == "none":
        return total
    v, h = m.vocab_size, m.hidden_size
    total += v * (h + itemsize) - (0 if m.tie_embeddings else v * h * itemsize)
    for fan_in, fan_out, count, where in linears(m):
        if quantize == "int8" and where == "block":
            total -= count * fan_out * (fan_in * (itemsize - 1) - itemsize)
        elif quantize == "int4" and where == "block":
            group = next((g for g in INT4_GROUPS if fan_in % g == 0), None)
            if group and fan_out % 8 == 0:  # int4.py's blocks of 8 outputs
                total -= count * fan_out * (fan_in * (itemsize - 0.5) - (itemsize + 1) * (fan_in // group))
    return total


def plan_inference(m: ModelConfig, g: GPU, batch: int, context: int, itemsize: int = 2, headroom: float = 0.10,
                   reserved: float = 0.75 * 2**30, quantize: str = "none") -> InferencePlan:
    """`batch` requests of up to `context` positions each (prompt and new tokens) on one GPU of `g`, weights
    and cache in `itemsize`-byte numbers, the linear layers' weights as `quantize` (none, int8, int4) stores
    them; `reserved`: the CUDA context outside torch's allocator."""
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZE)}")
    weights = weight_bytes(m, itemsize, quantize)
    per_slot = (context + 1) * m.kv_bytes_per_token(itemsize)  # + the engine's scratch position
    activations = PREFILL_TOKENS * (2 * m.ffn_size + (m.num_heads + 2 * m.kv_heads) * m.head_size
                                    + 4 * m.hidden_size) * itemsize
    logits = 4 * 4 * m.vocab_size  # fp32 logits, sorted copy, order and noise per row
    workspace = activations + batch * logits
    usable = g.memory * (1 - headroom) - reserved
    slots = max(0, int((usable - weights - activations) // (per_slot + logits)))
    cache = context * m.kv_bytes_per_token(itemsize)  # a row's at `context` positions: the batch's slowest step
    # The quantised products reach their own share of the bound; attention over the cache stays bf16's.
    # The one-row GEMV takes 16-bit weights, and not a mixture's experts (grouped GEMMs).
    gemv = itemsize == 2 and not m.num_experts

    def tokens_per_s(rows: int) -> float:
        share = QUANTIZED_EFFICIENCY.get(quantize, ONE_ROW_EFFICIENCY if rows == 1 and gemv else
                                         MOE_DECODE_EFFICIENCY if m.num_experts else DECODE_EFFICIENCY)
        return rows * g.hbm_bw / (step_read(m, weights, itemsize, rows) / share + rows * cache / DECODE_EFFICIENCY)

    return InferencePlan(weights, batch * per_slot, workspace, weights + batch * per_slot + workspace <= usable,
                         slots, (step_read(m, weights, itemsize, batch) + batch * cache) / g.hbm_bw,
                         tokens_per_s(batch), tokens_per_s(1))


def step_read(m: ModelConfig, weights: float, itemsize: int, rows: int) -> float:
    """The weight bytes a decode step of `rows` reads: all but the input embedding and the experts it does not
    reach."""
    return weights - m.param_counts()["embedding"] * itemsize - unreached_expert_bytes(m, itemsize, rows)


def unreached_expert_bytes(m: ModelConfig, itemsize: int, rows: int) -> float:
    """A mixture's routed experts that a step of `rows` leaves unread (a grouped GEMM reads no expert without
    rows): in expectation, at balanced routing, (1 - top_k / num_experts)^rows of them; 0 for a dense model."""
    if not m.num_experts:
        return 0.0
    unreached = (1 - min(m.top_k, m.num_experts) / m.num_experts) ** rows
    return unreached * m.param_counts()["expert_per_layer"] * m.num_layers * itemsize
