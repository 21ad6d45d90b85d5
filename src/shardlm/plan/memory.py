"""Per-GPU memory of a training layout, for the worst pipeline stage.

Model states (Rajbhandari et al. 2020, ZeRO, section 3): with mixed-precision Adam a parameter costs
2 bytes (16-bit weight) + 2 (16-bit gradient) + K = 12 (fp32 master, momentum, variance), so Phi
parameters need (2 + 2 + K) Phi bytes, e.g. 7B -> 112 GB; stage 1 divides K by Nd, stage 2 also the
gradients, stage 3 everything: 2 Phi + 2 Phi + K Phi / Nd, 2 Phi + (2 + K) Phi / Nd, (2 + 2 + K) Phi / Nd
(`paper_model_states`). Nd is each parameter's own reduce group (`zero_shard`): dp x cp for the dense
ones; a mixture of experts' experts are split over ep (num_experts / ep whole experts a rank) and their
state is sharded over the ranks holding the same experts, edp = dp x cp / ep (groups.py).
shardlm's stage 3 keeps no 16-bit copy (each gather casts the fp32 master).
With bf16 optimizer state (train.optimizer_dtype, `--optimizer-dtype bf16`) K = 2 + 2 for the moments, plus
2 for a bf16 master where the optimizer is sharded (ZeRO): unsharded, the bf16 weights are their own masters.
Its gradient shards in the reduction dtype (stages 2 and 3, and stage 1 when that dtype differs from the
gradients') exist from backward until the step: with one micro-batch they never meet forward's activation
peak, but stages 2 and 3 reduce on every micro-step, so with accumulation (or a pipeline) they sit beside
the later micro-batches' activations.

Activations per layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Table 2), for that paper's GPT block (GELU 4h MLP, standard attention, dropout), in bytes:
sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with tensor parallelism; sbh(34/t +
5as/(ht)) adding sequence parallelism; the 5as/h term vanishes with selective recomputation; full
recomputation keeps 2sbh (the layer input, /t with sequence parallelism). Any other model is counted by
the tensors shardlm's block actually saves (2 bytes each in 16-bit): both norms' inputs and outputs
(with sequence parallelism the inputs as slices, the outputs gathered for the linears' weight gradients,
as a compiled block keeps them: no collective is recomputed in backward), q, k, v (GQA-sized), the
attention output, the MLP's up projection (2f for SwiGLU) and activation, and with standard attention
the softmax output (2as^2 per token-row batch); flash attention keeps only a per-head log-sum-exp, so
no s^2 term. A pipeline stage holds several micro-batches in flight: GPipe m,
1F1B min(p, m) on the first stage, interleaved 1F1B that times (1 + (p - 1) / (p v)) (Narayanan et
al. 2021).

LoRA (Hu et al. 2021): gradients and optimizer state for the adapters alone; the frozen base in 16-bit
(QLoRA, Dettmers et al. 2023: the block linears in NF4, about 4.13 bits a weight, one of them dequantised
at a time), sharded by ZeRO-3 like the trained parameters except for the 4-bit weights, kept whole. The
activations are counted as in full training: the frozen linears save the same inputs, which the adapters'
A matrices need.

Buffers: the output head and loss (shardlm's chunked head: one chunk of fp32 logits, its gradient and
the head's gradient; otherwise the full bf16 logits, their fp32 copy and gradient), ZeRO-3's gathered
units (the current block, the `parallel.prefetch_units` prefetched after it and the head), DDP and ZeRO
reduction buckets in flight, and a fixed 256 MiB for cuBLAS and attention workspaces. `total` is what
torch.cuda.max_memory_allocated would report; `fits` adds the CUDA context (0.75 GiB, outside PyTorch's
allocator) and keeps 10% of the card for allocator fragmentation (plan/__init__.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import BLOCK_RECOMPUTE, FREE_GRAD_BUCKET_MB, NF4_BYTES_PER_WEIGHT, ModelConfig, exchanged_kv_heads
from ..config.views import group_span
from .flops import simulated
from .frozen import frozen_expert_inputs, head_frozen, layout_frozen
from .layout import Layout, Workload, expert_loads, stage_layers

MiB = 2**20
WORKSPACE = 256 * MiB
BUCKET_BYTES = 25 * MiB


@dataclass(frozen=True)
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    activation_per_layer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers


def paper_model_states(phi: float, stage: int, nd: int, k: int = 12) -> float:
    """ZeRO paper, Figure 1: bytes of model states per GPU for Phi parameters at data-parallel degree Nd."""
    return {0: (2 + 2 + k) * phi, 1: 2 * phi + 2 * phi + k * phi / nd, 2: 2 * phi + (2 + k) * phi / nd,
            3: (2 + 2 + k) * phi / nd}[stage]


def rank_layers(m: ModelConfig, L: Layout, rank: int) -> int:
    """How many layers pipeline rank `rank` holds (layout.stage_layers)."""
    return m.num_layers if L.pp == 1 else len(stage_layers(m, L, rank))


def stage_params(m: ModelConfig, L: Layout, stage: int) -> float:
    """Parameters held by pipeline rank `stage` (before ZeRO), after tensor and expert parallelism (routed
    experts whole on every tp rank: parallel/moe_tensor.py)."""
    c = m.param_counts()
    layers = rank_layers(m, L, stage)
    dense = c["per_layer"] - c["expert_per_layer"]
    n = layers * (dense / L.tp + c["expert_per_layer"] / L.ep)
    if m.kv_heads % L.tp:  # key/value heads fewer than the ranks stay whole on each (parallel/tensor.py)
        kv = 2 * m.hidden_size * m.kv_heads * m.head_size
        n += layers * kv * (1 - 1 / L.tp)
    if stage == 0:
        n += c["embedding"] / L.tp + c["position"]
    if stage == L.pp - 1:
        n += c["final_norm"] + (c["lm_head"] / L.tp if not m.tie_embeddings or L.pp > 1 else 0)
        if m.tie_embeddings and L.pp > 1:
            n += c["embedding"] / L.tp  # the last stage keeps its own copy of a tied head
    return n


def expert_params(m: ModelConfig, L: Layout, stage: int) -> float:
    """The experts' parameters held by pipeline rank `stage`: num_experts / ep of each of its layers', whole
    on every tp rank."""
    if not m.num_experts:  # the common case, asked for several times in each of the search's estimates
        return 0.0
    return rank_layers(m, L, stage) * m.param_counts()["expert_per_layer"] / L.ep


def layer_params(m: ModelConfig, L: Layout) -> float:
    """One block's parameters on a rank (ZeRO-3's gathered unit): its dense part and its ep share of the experts."""
    c = m.param_counts()
    return (c["per_layer"] - c["expert_per_layer"]) / L.tp + c["expert_per_layer"] / L.ep


def zero_shard(m: ModelConfig, L: Layout, stage: int, phi: float) -> float:
    """Of pipeline rank `stage`'s `phi` trained parameters (trained_and_frozen's), those whose ZeRO-sharded
    state (fp32 masters and moments; at stage 2 the gradients, at 3 the weights too) it keeps: each
    parameter's over its own reduce group, the experts' over edp and the rest over dp x cp, so experts held
    whole by one rank (edp 1) keep all their state there. LoRA's adapters (counted on the dense linears,
    LoRAConfig.adapter_count) are all dense."""
    experts = trained_experts(m, L, stage)
    return (phi - experts) / group_span(L, "dp+cp")[0] + experts / expert_replicas(L)


def bf16_optimizer_bytes(m: ModelConfig, L: Layout, stage: int, phi: float) -> float:
    """train.optimizer_dtype bf16 (optim.py): bf16 moments, 4 bytes a parameter on its ZeRO share, and a bf16
    master, 2 more, only where a reduce group of more than one rank shards it: unsharded, the weights are their
    own masters."""
    if L.zero_stage == 0:
        return 4.0 * phi
    experts = trained_experts(m, L, stage)
    dense, edp = group_span(L, "dp+cp")[0], expert_replicas(L)
    masters = (phi - experts) / dense * (dense > 1) + experts / edp * (edp > 1)
    return 4.0 * zero_shard(m, L, stage, phi) + 2.0 * masters


def frozen_params(m: ModelConfig, L: Layout, stage: int) -> tuple[float, float]:
    """train.freeze's parameters on pipeline rank `stage`, before ZeRO (plan/frozen.py): (the dense ones after
    tensor parallelism, the routed experts' ep share). (0, 0) without a freeze, and under LoRA."""
    f = layout_frozen(m, L)
    if f is None:
        return 0.0, 0.0
    layers = stage_layers(m, L, stage)
    dense = sum(f.dense[i] for i in layers) / L.tp
    if stage == 0:
        dense += f.embedding / L.tp + f.position
    if stage == L.pp - 1:  # the final norm whole on each tp rank, a tied head's copy on the last stage
        dense += f.final_norm + (f.head + (f.embedding if m.tie_embeddings and L.pp > 1 else 0)) / L.tp
    return dense, sum(f.experts[i] for i in layers) / L.ep


def trained_experts(m: ModelConfig, L: Layout, stage: int) -> float:
    """The routed experts' parameters pipeline rank `stage` trains: none under LoRA (a frozen base), else those
    train.freeze leaves."""
    return 0.0 if L.lora.rank else expert_params(m, L, stage) - frozen_params(m, L, stage)[1]


def expert_replicas(L: Layout) -> int:
    """The ranks over which an expert's gradients reduce and its ZeRO state shards: edp, and the tp ranks,
    each routing its own tokens through whole experts (placement "edp+tp", parallel/moe_tensor.py)."""
    return group_span(L, "edp")[0] * L.tp


def trained_and_frozen(m: ModelConfig, L: Layout, stage: int, p_b: int) -> tuple[float, float]:
    """(parameters trained, bytes of the frozen ones) on pipeline rank `stage`, before ZeRO. Without LoRA
    every parameter trains but those train.freeze holds (plan/frozen.py). With LoRA only the adapters do
    (LoRAConfig.adapter_count, over the rank's layers and tensor-parallel degree); the base is frozen in
    16-bit, QLoRA's block linears in NF4."""
    phi = stage_params(m, L, stage)
    if not L.lora.rank:  # train.freeze's parameters: held in the weights' dtype, as a LoRA base is
        frozen = sum(frozen_params(m, L, stage))
        return phi - frozen, frozen * p_b
    adapters = L.lora.adapter_count(m) * rank_layers(m, L, stage) / m.num_layers / L.tp
    return adapters, phi * p_b - nf4_weights(m, L, stage) * (p_b - NF4_BYTES_PER_WEIGHT)


def nf4_weights(m: ModelConfig, L: Layout, stage: int) -> float:
    """Weights QLoRA stores in NF4 on pipeline rank `stage`: its block linears' (none without QLoRA)."""
    if not (L.lora.rank and L.lora.quantize == "nf4"):
        return 0.0
    q, kv, h, f = m.num_heads * m.head_size, m.kv_heads * m.head_size, m.hidden_size, m.ffn_size
    per_layer = h * (q + 2 * kv) + q * h + (3 if m.arch != "gpt2" else 2) * h * f
    return per_layer * rank_layers(m, L, stage) / L.tp


def activation_per_layer(m: ModelConfig, w: Workload, L: Layout, balanced: bool = False) -> float:
    """Bytes a layer keeps for backward; a mixture of experts' at its worst load (expert_loads), or at a
    balanced one (`balanced`)."""
    s, b, h, a, t = w.seq / L.cp, w.micro_batch, m.hidden_size, m.num_heads, L.tp
    sbh = s * b * h
    if m.arch == "gpt2" and L.attention == "standard" and m.ffn_size == 4 * h:
        if L.recompute in BLOCK_RECOMPUTE:
            per = (2 + kept_residual(L, 2)) * sbh / (t if L.sp else 1)
        else:
            # Ulysses: a rank's 1 / (t cp) of the heads attend over the whole sequence, cp s; ring attention
            # keeps no probabilities
            ring = L.cp > 1 and L.cp_comm == "p2p"
            score = 0.0 if L.recompute == "selective" or ring else 5 * a * s * L.cp / (h * t)
            per = sbh * ((34 / t if L.sp else 10 + 24 / t) + score)
    else:
        act = 2 if L.precision != "fp32" else 4
        if L.recompute in BLOCK_RECOMPUTE:
            per = (act + kept_residual(L, act)) * sbh / (t if L.sp else 1)
        else:
            q, f = a * m.head_size, m.ffn_size
            kv = m.kv_heads * m.head_size  # under cp, as many as the exchange holds (repeated where cp needs)
            if L.cp > 1 and L.cp_comm == "a2a" and m.kv_heads % t == 0:
                kv = exchanged_kv_heads(a // t, m.kv_heads // t, L.cp) * t * m.head_size
            # Two norms, input and output each; with sequence parallelism the inputs are slices, and the
            # outputs are kept gathered, as the column-parallel linears' weight gradients read them.
            norms = (2 * sbh / t + 2 * sbh) if L.sp else 4 * sbh
            attn = s * b * (2 * q + 2 * kv) / t  # q, attention output; k and v
            mlp = s * b * (3 * f if m.arch != "gpt2" else 2 * f) / t  # up (2f gated) and activation
            if m.num_experts:  # each token copy's input row and up (2f gated) and activation in its expert,
                # at the worst load a rank's experts hold (expert_loads), plus each token's routing. Past the
                # budget a layer keeps the arrived rows alone (its chunks' intermediates: expert_chunk_bytes);
                # a load of the budget itself runs whole, keeping everything: the worse of the two.
                held, arrived, _ = (1, 1, "") if balanced else expert_loads(m, L)
                up, down = frozen_expert_inputs(m, L)  # frozen projections keep no input for their weight
                f_e = m.moe_ffn_size
                kept = held * (2 * f_e + (1 - down) * f_e + (1 - up) * h)
                if held < arrived:
                    kept = max(kept, arrived * h)
                mlp = s * b * m.top_k / t * kept + s * b * m.num_experts * m.top_k / t
            per = act * (norms + attn + mlp)
            if L.attention == "standard" and L.recompute != "selective" and not (L.cp > 1 and L.cp_comm == "p2p"):
                per += act * a * s * s * L.cp * b / t  # softmax probabilities (over the whole sequence under cp)
            per += 4 * s * b * (2 + a / t)  # fp32 norm statistics and the attention log-sum-exp
    return per


def expert_chunk_bytes(m: ModelConfig, w: Workload, L: Layout) -> float:
    """One chunk's up (2f gated) and activation, budget balanced loads: an overloaded rank's experts hold them a
    chunk at a time, in forward and in backward's recomputation (parallel/expert_chunks.py); else 0."""
    held, arrived, _ = expert_loads(m, L) if m.num_experts else (1, 1, "")
    act = 2 if L.precision != "fp32" else 4
    return act * w.seq / L.cp * w.micro_batch * m.top_k / L.tp * held * 3 * m.moe_ffn_size if held < arrived else 0.0


def kept_residual(L: Layout, act: float) -> float:
    """Bytes per hidden element a block keeps beside its input under `L.recompute`: full-skip-out-down keeps
    its mid-residual (x + attention(x)), which the MLP norm's backward reads and only the output projection
    could recompute; the projections' inputs are recomputed with what produces them (model/recompute.py)."""
    return act if L.recompute == "full-skip-out-down" else 0.0


def in_flight(w: Workload, L: Layout) -> float:
    """Micro-batches whose activations the worst (first) pipeline rank holds at once, in units of all its
    layers' (an interleaved rank's chunk holds 1/v of them), from the schedule's simulated table: m for
    GPipe, p for 1F1B and zb-h1, p (1 + (p - 1) / (p v)) interleaved, 1 naive."""
    if L.pp == 1:
        return 1
    sim = simulated(L.pp_schedule, L.pp, L.virtual_stages, w.global_batch // (w.micro_batch * L.dp))
    return max(sim.in_flight) / L.virtual_stages


def head_and_loss(m: ModelConfig, w: Workload, L: Layout) -> float:
    tokens = w.seq * w.micro_batch / L.cp
    v, h = m.vocab_size / L.tp, m.hidden_size
    act = 2 if L.precision != "fp32" else 4
    final = 2 * act * tokens * h  # the final norm's input and output
    if L.loss_chunk:
        c = min(L.loss_chunk, tokens)
        head_grad = 0 if L.lora.rank or head_frozen(m, L) else v * h * act  # a frozen head forms no weight gradient
        return final + c * v * (4 + act) + head_grad + tokens * h * act
    return final + tokens * v * (act + 4 + 4)  # logits, their fp32 copy, the softmax gradient


def estimate_memory(m: ModelConfig, w: Workload, L: Layout) -> Memory:
    worst = None
    # A split balanced by compute loads the first rank (the embedding, layers rounded up, most micro-batches in
    # flight) or the last (the head) most; a split given by parallel.pp_layers may load any.
    for stage in range(L.pp) if L.pp_layers else sorted({0, L.pp - 1}):
        n = L.replicas
        mixed = L.precision != "fp32"
        p_b, g_b, k = (2, 2, 12) if mixed else (4, 4, 8)
        phi, frozen = trained_and_frozen(m, L, stage, p_b)
        sharded = zero_shard(m, L, stage, phi)  # each parameter's share over its own reduce group
        red = 4 if L.reduce_dtype == "fp32" else g_b
        params, grads, opt = p_b * phi, g_b * phi, k * phi
        if L.zero_stage >= 1:
            opt = k * sharded
        if L.optimizer_dtype == "bf16":
            opt = bf16_optimizer_bytes(m, L, stage, phi)
        # The reduced shard (beside stage 1's full 16-bit gradients) lives from backward to the step only.
        shard = red * sharded if (L.zero_stage >= 2 or (L.zero_stage == 1 and red != g_b)) else 0.0
        if L.offload != "none" and L.zero_stage >= 2:  # accumulated in host memory (parallel/offload.py)
            shard = 0.0
        if L.zero_stage >= 2:
            grads = 0.0
        if L.zero_stage == 3:
            params = (p_b * sharded) if L.offload == "params" else 0.0
            if not mixed:
                params = 0.0
        if L.offload != "none":
            opt = 0.0
            if L.offload == "params":
                params = 0.0
        if L.zero_stage == 3:  # ZeRO-3 shards a frozen base over dp x cp in its own units, all but QLoRA's 4-bit
            # weights and frozen experts split over ep or routed whole per tp rank, which each rank keeps whole
            # (parallel/zero3_frozen.py). (QLoRA's 4-bit count is one dense MLP a layer: not split for experts.)
            nf4 = nf4_weights(m, L, stage) * NF4_BYTES_PER_WEIGHT
            experts = p_b * (expert_params(m, L, stage) if L.lora.rank and L.lora.quantize != "nf4" else
                             frozen_params(m, L, stage)[1])
            frozen = (frozen - nf4 - experts) / n + experts / (n if L.ep == 1 and L.tp == 1 else 1) + nf4
        params += frozen
        per_layer = activation_per_layer(m, w, L)
        layers = rank_layers(m, L, stage)
        acts = per_layer * layers * in_flight(w, L)
        if L.offload_activations:  # the blocks' inputs wait in host memory (model/activation_offload.py)
            acts = 0.0
        acts += expert_chunk_bytes(m, w, L)
        recomputed = 0.0
        if L.recompute in BLOCK_RECOMPUTE:  # the layer being recomputed holds its full activations
            recomputed = activation_per_layer(m, w, Layout(**{**L.__dict__, "recompute": "none"}))
            acts += recomputed
        if stage == 0 and L.pp > 1:
            acts += 2 * w.seq * w.micro_batch * m.hidden_size / L.cp * in_flight(w, L)  # received activations
        buffers = WORKSPACE
        if L.cp > 1 and L.cp_comm == "p2p":  # ring attention on the fused kernels (no scores held): its fp32
            # dq (or output, forward) and a block's gradients in 16 bits, for the query heads; for the key/value
            # heads the chunk held and the one coming in (16 bits), and the fp32 gradients of the chunk: this
            # step's, the one travelling and the one arriving
            chunk, heads, kv_heads = w.seq / L.cp, m.num_heads / L.tp, max(m.kv_heads / L.tp, 1)
            buffers += w.micro_batch * chunk * m.head_size * (6 * heads + 36 * kv_heads)
        if L.pp > 1:  # the copy engines' staging (comm/p2p.py, auto on one node): two slots each for
            # activations and gradients, in the weights' dtype
            buffers += 4 * p_b * w.seq * w.micro_batch * m.hidden_size / L.cp / (L.tp if L.sp else 1)
        unit = layer_params(m, L) * p_b
        # ZeRO-3's gathered weights: a block's unit with those prefetched after it, and the head's
        blocks_gathered = head_gathered = 0.0
        if L.zero_stage == 3:
            blocks_gathered = (1 + L.prefetch_units) * unit
            head_gathered = (m.param_counts()["lm_head"] or m.param_counts()["embedding"]) / L.tp * p_b
        gathered = blocks_gathered + head_gathered
        if stage == L.pp - 1:
            loss = head_and_loss(m, w, L)
            # With full recomputation a layer's activations (and ZeRO-3's units around it) exist only in the
            # blocks' backward, when the loss's buffers (and the gathered head) are gone but for the gradient
            # they send into the blocks; during the loss only the first blocks of backward are being
            # prefetched. The peak is the larger of the two phases. Not under GPipe, where later
            # micro-batches' loss buffers are still alive while earlier ones' blocks run backward.
            if recomputed and (L.pp == 1 or L.pp_schedule != "gpipe"):
                into_blocks = p_b * w.seq * w.micro_batch / L.cp * m.hidden_size  # the gradient of the blocks' output
                loss_phase = loss + head_gathered + (L.prefetch_units * unit if L.zero_stage == 3 else 0.0)
                blocks_phase = recomputed + into_blocks + blocks_gathered
                buffers += max(loss_phase, blocks_phase) - recomputed  # `acts` holds the recomputed layer's
                gathered = 0.0
            else:
                buffers += loss
        buffers += gathered
        if L.lora.quantize == "nf4":  # the largest block linear, dequantised for its matmul
            buffers += m.hidden_size * max(m.ffn_size * (2 if m.arch != "gpt2" else 1),
                                           (m.num_heads + 2 * m.kv_heads) * m.head_size) / L.tp * p_b
        if L.zero_stage >= 2:  # transient full-size bucket gradients in the reduction dtype (an offloading
            # rank alone copies its 16-bit gradients down as they are: parallel/offload.py's HostGradients)
            buffers += 2 * unit * (g_b if L.offload != "none" and n == 1 else red) / p_b
        elif L.replicas > 1 and red != g_b:
            buffers += 2 * BUCKET_BYTES * red / g_b
        # Stages 2 and 3 reduce on every micro-step, so once the first backward has run their shards stay
        # beside the activations of the micro-batches after it (a pipeline's in flight ones too). Otherwise
        # the shards live from the last backward to the step, and the peak is the larger of the two moments.
        micro = w.global_batch // (w.micro_batch * L.dp)
        if shard and L.zero_stage >= 2 and (micro > 1 or L.pp > 1):
            grads += shard
        elif shard > acts:  # the step, after the activations are gone
            grads, acts = grads + shard, 0.0
        peak = params + grads + opt + buffers + acts
        cand = (peak, Memory(params, grads, opt, acts, buffers, per_layer))
        if L.free_grads and L.world == 1 and L.zero_stage == 0 and micro == 1 and grads:
            # One process takes its gradients bucket by bucket in backward (train.free_grads): at the activations'
            # peak, early in backward, the head's and about one bucket's exist; nearly all of them meet the first
            # block's backward (its activations, or its recomputed forward), and all of them the step.
            counts = m.param_counts()
            head = 0 if L.lora.rank or head_frozen(m, L) else counts["lm_head"] or counts["embedding"]
            early = min(grads, g_b * head + FREE_GRAD_BUCKET_MB * MiB)
            late = per_layer + recomputed
            cand = max((params + early + opt + buffers + acts, Memory(params, early, opt, acts, buffers, per_layer)),
                       (params + grads + opt + WORKSPACE + late, Memory(params, grads, opt, late, WORKSPACE, per_layer)),
                       key=lambda c: c[0])
        if worst is None or cand[0] > worst[0]:
            worst = cand
    return worst[1]


def checkpoint_bytes(m: ModelConfig, w: Workload, L: Layout, pinned: bool = False) -> float:
    """What full recomputation keeps of the worst pipeline rank's blocks from forward to backward: their
    inputs, of the micro-batches in flight; in host memory with `offload_activations`. `pinned`: as the
    pinned allocator holds them, each rounded up to a power of two bytes."""
    per_layer = activation_per_layer(m, w, L)
    if pinned:
        per_layer = 2.0 ** math.ceil(math.log2(per_layer))
    return max(per_layer * rank_layers(m, L, stage) for stage in {0, L.pp - 1}) * in_flight(w, L)
