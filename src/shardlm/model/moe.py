"""A sparsely-gated mixture of experts in place of the dense MLP (Shazeer et al. 2017): a router scores each
token against every expert, the token runs through its top-k experts only, and their outputs are summed with
the router's weights. Routing follows the models users load: softmax top-k renormalised over the chosen k
(Mixtral, Jiang et al. 2024; Qwen2-MoE's `norm_topk_prob` off keeps the raw probabilities), or sigmoid
scores with the top-k normalised (DeepSeek-V3, 2024); Qwen2-MoE's shared expert runs on every token behind a
sigmoid gate. Balance comes from the Switch Transformer's auxiliary loss (Fedus et al. 2021; GShard's, Lepikhin
et al. 2020) and ST-MoE's router z-loss (Zoph et al. 2022).

The computation follows torchtitan's `models/common/moe.py` and Megatron-core's `transformer/moe/`: dropless
routing (every token reaches its k experts: token copies sorted by expert, counts, offsets), experts stored
stacked (`[E, out, in]`, gate and up fused as the dense MLP's `up` is) and run as grouped GEMMs, one kernel for
all experts (`torch._grouped_mm`) where it runs, else a loop over experts. The auxiliary losses are kept per
forward and added by the step's loop (parallel/forward_backward.py) scaled like their micro-batch's loss, so
they are exact under gradient accumulation (a pipeline adds each stage's, parallel/pipeline.py; context
parallelism takes the balance loss's shares over the whole micro-batch). Expert parallelism (`parallel.ep`,
parallel/expert.py) swaps in `run_experts`: the routing, the losses and the load stay this layer's, per rank's
tokens.

Dropless is the default. `model.capacity_factor` > 0 gives the Switch Transformer's (Fedus et al. 2021) and
GShard's (Lepikhin et al. 2020) expert capacity, counted per sequence rather than per rank's batch, as
ceil(factor x seq_len x k / E) copies per expert per sequence: which copies are dropped then turns on each
sequence's routing alone, the same at every dp, ep, pp, cp and micro-batching (a per-batch capacity would drop
different tokens at each layout; under context parallelism `sequences` carries each expert's queue over from
the ranks holding the earlier slices). Priority by position (Megatron-core's drop policy "position", the Switch
Transformer's order at top-1; deterministic, unlike a priority by probability it needs no second sort over
near-equal fp32 scores): a token's k copies queue at its position, so a late token can lose all of them, where
GShard queues every first choice before any second; a dropped copy adds nothing and its token keeps the residual
path and its other experts. Training only: evaluation and generation run dropless, as the exported HF model does.
`model.router_bias_update_rate` > 0 adds DeepSeek-V3's selection bias (Liu et al. 2024: auxiliary-loss-free
balancing) to the scores for the top-k choice only; parallel/moe_balance.py updates it after each step from
the global batch's loads, and gathers the per-layer statistics recorded here (`stats`) for the logs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .lazy_compiler import eager
from .grouped_mm import grouped_mm
from .weight_grad import Linear


class GroupedLinear(nn.Module):
    """`num` linear layers' weights stacked ([num, out, in], nn.Linear's layout per expert), no bias."""

    def __init__(self, num: int, in_features: int, out_features: int, init_std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, out_features, in_features))
        self.init_std = init_std  # read by Decoder.init_parameter

    def forward(self, x: torch.Tensor, counts: torch.Tensor, impl: str = "auto") -> torch.Tensor:
        """Rows of `x` sorted by expert, counts[e] of them for expert e: each row times its expert's weight
        (rows past them: grouped_mm's padding)."""
        return grouped_mm(x, self.weight, counts, impl)


class SwiGLU(nn.Module):
    """A dense SwiGLU MLP of `ffn` hidden features (the shared expert), gate and up fused as the decoder's MLP."""

    def __init__(self, cfg: ModelConfig, ffn: int):
        super().__init__()
        self.up = Linear(cfg.hidden_size, 2 * ffn, bias=False)
        self.down = Linear(ffn, cfg.hidden_size, bias=False)
        self.up.init_std, self.down.init_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Experts(nn.Module):
    """The routed experts: SwiGLU MLPs as two grouped linears (names mlp.experts.up / mlp.experts.down, as the
    dense MLP's mlp.up / mlp.down), the unit expert parallelism will split over its ranks."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_size
        self.up = GroupedLinear(e, h, 2 * f, cfg.init_std)  # rows [gate; up] per expert
        self.down = GroupedLinear(e, f, h, cfg.init_std / math.sqrt(2 * cfg.num_layers))  # GPT-2's residual init

    def forward(self, x, counts, impl="auto"):
        gate, up = self.up(x, counts, impl).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, counts, impl)


class MoE(nn.Module):
    """The mixture-of-experts MLP: `Block.mlp` where `cfg.is_moe_layer(layer)`. Input and output [..., h].

    After each training forward it holds `balance_loss` and `z_loss` (scalars with their graph, for the step to
    add) and adds the tokens each expert received to `load` (not under a recomputation's second forward, which
    would count them twice)."""
    # Weight-only quantisation leaves these linears as they are: route() reads the router's weight itself, in fp32.
    unquantised = ("router",)


    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.num_experts, self.top_k = layer, cfg.num_experts, cfg.top_k
        self.scoring, self.renormalize = cfg.router_scoring, cfg.router_renormalize
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.router.init_std = cfg.init_std
        self.experts = Experts(cfg)
        shared = cfg.shared_expert_ffn_hidden_size
        self.shared = SwiGLU(cfg, shared) if shared else None
        self.shared_gate = Linear(cfg.hidden_size, 1, bias=False) if shared else None
        if shared:
            self.shared_gate.init_std = cfg.init_std
        self.impl = "auto"  # auto | grouped | loop: how the experts' GEMMs run (tests compare them)
        self.capacity_factor, self.bias_rate = cfg.capacity_factor, cfg.router_bias_update_rate
        # DeepSeek-V3's selection bias [E] (fp32; None when off): a plain attribute, not a parameter or buffer,
        # made on the first forward's device; saved in the trainer's state (parallel/moe_balance.py).
        self.router_bias: torch.Tensor | None = None
        self.balance_loss = self.z_loss = None
        # After the first training forward these stay tensors, zeroed when taken: a compiled block guards on
        # whether an attribute is None, and would compile again at each change.
        self.load: torch.Tensor | None = None  # tokens per expert since the last take_load (int64, [E])
        self.stats: torch.Tensor | None = None  # since the last take_stats, fp64 [routed E | kept E | probs E | T]
        self.recomputed = False  # whether its block's forward runs again in backward (Decoder.set_recompute)
        # token copies routed per expert this step (the bias's input); zeroed, never reset to None, by
        # take_routed, so that a compiled block sees one kind of value across steps (no second graph)
        self.step_routed: torch.Tensor | None = None
        self.sequences = WholeSequences()  # context parallelism swaps in each rank's slices (parallel/context.py)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens x [T, h]: the fp32 router logits [T, E], the chosen experts [T, k] and their weights
        [T, k] (fp32)."""
        # fp32 logits: in bf16 near-equal scores round to ties and the top-k choice turns on rounding.
        logits = F.linear(x.float(), self.router.weight.float())
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        if self.bias_rate > 0:  # DeepSeek-V3: the bias chooses the experts, the unbiased scores weigh them
            if self.router_bias is None or self.router_bias.device != x.device:  # made, or moved, once
                self.router_bias = torch.zeros(self.num_experts, device=x.device) if self.router_bias is None \
                    else self.router_bias.to(x.device)
            experts = (scores + self.router_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, experts)
        else:
            weights, experts = scores.topk(self.top_k, dim=-1)
        if self.renormalize:  # Mixtral: softmax over the chosen k; DeepSeek-V3 likewise for sigmoid scores
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        return logits, experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tensor parallelism without sequence parallelism hands every tp rank all the tokens: each routes its
        # slice of the sequence and the outputs are joined (parallel/moe_tensor.py). The shared expert, whose
        # linears tensor parallelism splits, takes the tokens as the layer was given them.
        y = self.sequences.join(self.routed(self.sequences.split(x, self.training)), self.training)
        if self.shared is not None:  # Qwen2-MoE: every token also through the shared expert, gated per token
            y = y + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return y

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted outputs for tokens x [..., h] (the layer's output but the shared expert's)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, experts, weights = self.route(x)
        # Dropless dispatch: the T k token copies sorted by expert (stable, so each expert sees its tokens in
        # sequence order), run as one grouped GEMM per linear, weighted, and summed back into their tokens.
        flat = experts.reshape(-1)
        routed = expert_counts(flat, self.num_experts)
        if self.capacity_factor > 0 and self.training:  # Switch/GShard: at most `capacity` copies per sequence
            seq_len = shape[-2] if len(shape) > 2 else x.shape[0]  # this rank's slice of each sequence
            whole = seq_len * self.sequences.parts
            # at most a copy of each token reaches an expert: a factor of 1e30 ("never drop") keeps all, not an
            # integer too large for a tensor comparison
            factor = min(self.capacity_factor, self.num_experts / self.top_k)  # 1e308 times the copies is inf
            capacity = min(math.ceil(factor * whole * self.top_k / self.num_experts), whole)
            per_seq, taken = seq_len * self.top_k, None
            if self.sequences.parts > 1:  # the queues start where the earlier slices of each sequence left them
                taken = self.sequences.earlier(sequence_counts(flat, per_seq, self.num_experts))
            kept = capacity_keep(flat, per_seq, capacity, self.num_experts, taken).nonzero().squeeze(1)
            order = kept[flat[kept].argsort(stable=True)]  # a host sync for the kept count
            counts = torch.bincount(flat[kept], minlength=self.num_experts)
            token = order // self.top_k
            out = self.run_experts(x[token], counts, flat.numel())
            out = (out * weights.reshape(-1)[order, None]).to(x.dtype)  # weights in fp32, as HF's are
            # A dropped copy adds nothing: its token keeps the residual path and its other experts' outputs,
            # with their weights as routed (not renormalised over the survivors: Switch, GShard, Megatron-core).
            y = torch.zeros_like(x).index_add_(0, token, out)
        else:
            # Every copy kept, `order` is a permutation: its inverse puts the experts' outputs back in token
            # order, each token's k summed in fp32 with their weights (one fused kernel, HF's combine), and
            # both gathers' gradients are gathers too (no atomic scatter-add: deterministic).
            order, counts = flat.argsort(stable=True), routed
            inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
            out = self.run_experts(GatherRows.apply(x, order // self.top_k, inverse, self.top_k), counts,
                                   flat.numel())
            out = GatherRows.apply(out, inverse, order, 1).view(-1, self.top_k, out.shape[-1])
            y = (out.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)  # weights in fp32, as HF's are
        if self.training:  # evaluation and generation neither train on these nor count into the load
            self._record(logits, routed, counts)
        return y.view(shape)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, copies: int) -> torch.Tensor:
        """The experts' outputs for token copies `rows` sorted by expert, counts[e] of them for expert e
        (global ids), of the `copies` this rank routed (capacity's dropped ones too); expert parallelism
        (parallel/expert.py) swaps in a layer that sends them to the ranks holding their experts and back."""
        return self.experts(rows, counts, self.impl)

    def _record(self, logits: torch.Tensor, routed: torch.Tensor, counts: torch.Tensor) -> None:
        # Computed on every run alike (recomputation must save the tensors the first run saved), kept from the
        # first only: a recomputed forward (full recomputation) runs inside backward, after the step read them.
        # The balance loss and the bias see the router's choice (routed, before any drop), as Megatron-core's.
        # Its shares are the micro-batch's, over every slice of its sequences (context and tensor parallelism).
        # Where the slices' gradients are summed (tensor parallel ranks) rather than averaged (data and context
        # parallel ones), each slice's losses are its share of the whole.
        summed = self.sequences.summed
        losses = (balance_loss(logits, self.sequences.total(routed), self.top_k, self.scoring,
                               logits.shape[0] * self.sequences.parts) / summed, z_loss(logits) / summed)
        with torch.no_grad():
            probs = logits.softmax(-1) if self.scoring == "softmax" else _normalised(logits.sigmoid())
            tokens = torch.tensor([logits.shape[0]], dtype=torch.float64, device=logits.device)
            stats = torch.cat([routed.double(), counts.double(), probs.double().sum(0), tokens])
        # Under recomputation whether this is the first run is known only as it runs: a graph break (_keep).
        keep = _keep if self.recomputed else _accumulate
        keep(self, losses, routed.detach(), counts.detach(), stats)

    def take_load(self) -> torch.Tensor | None:
        """The tokens each expert received since the last call ([E], int64; None if none), and start counting
        anew."""
        load = self._take("load")
        return load if load is not None and bool(load.any()) else None

    def take_stats(self) -> torch.Tensor | None:
        """The statistics since the last call (fp64 [routed E | kept E | probs E | tokens]; None if none)."""
        return self._take("stats")

    def take_routed(self) -> torch.Tensor | None:
        """The token copies routed to each expert since the last call ([E]; None before any training forward
        with the router bias on), the bias update's input (parallel/moe_balance.py)."""
        return self._take("step_routed")

    def _take(self, name: str) -> torch.Tensor | None:
        held = getattr(self, name)
        if held is not None:
            setattr(self, name, torch.zeros_like(held))
        return held


def _accumulate(layer: MoE, losses: tuple, routed: torch.Tensor, counts: torch.Tensor, stats: torch.Tensor) -> None:
    """A training forward's losses and counts into `layer`."""
    layer.balance_loss, layer.z_loss = losses
    layer.load = counts if layer.load is None else layer.load + counts
    layer.stats = stats if layer.stats is None else layer.stats + stats
    if layer.bias_rate > 0:
        layer.step_routed = routed if layer.step_routed is None else layer.step_routed + routed


@eager  # whether autograd's engine runs this is no value the compiler can trace
def _keep(layer: MoE, losses: tuple, routed: torch.Tensor, counts: torch.Tensor, stats: torch.Tensor) -> None:
    """_accumulate from the first run of a recomputed block only (not its recomputation inside backward)."""
    if not in_backward():
        _accumulate(layer, losses, routed, counts, stats)


class GatherRows(torch.autograd.Function):
    """rows = x[index], every row of x taken `copies` times; `inverse` [rows of x x copies]: where copy j of
    row t went in `rows` (at t x copies + j). Backward sums each row's copies through `inverse`: a gather and
    a sum in fp32, where autograd's own (x[index]) scatter-adds with atomics."""

    @staticmethod
    def forward(ctx, x, index, inverse, copies):
        ctx.save_for_backward(inverse)
        ctx.copies = copies
        return x[index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad[inverse]
        if ctx.copies > 1:
            grad = grad.view(-1, ctx.copies, grad.shape[-1]).sum(1, dtype=torch.float32).to(grad.dtype)
        return grad, None, None, None


def expert_counts(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of the token copies `flat` (expert ids) each expert got ([E], int64). A scatter-add, not
    bincount, whose output size depends on the ids' values: the compiler would break the block's graph there."""
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def capacity_keep(flat: torch.Tensor, copies_per_sequence: int, capacity: int, num_experts: int,
                  taken: torch.Tensor | None = None) -> torch.Tensor:
    """Which token copies (`flat` [T k], the chosen expert of each, token-major) an expert of capacity
    `capacity` per sequence keeps ([T k] bool). Priority by position (Megatron-core's drop policy "position",
    the Switch Transformer's order at top-1; not GShard's, which takes every first choice first): within each
    sequence an expert takes its copies in token order and drops those past its capacity. Decided by each sequence's
    routing alone, so the same copies are dropped however sequences are grouped into ranks (dp, ep) and micro-
    batches. `taken` [sequences, E]: the copies each expert was sent in the slices of each sequence before these
    tokens (context parallelism)."""
    slot = torch.arange(flat.numel(), device=flat.device)
    key = (slot // copies_per_sequence) * num_experts + flat  # (sequence, expert)
    order = key.argsort(stable=True)  # grouped by (sequence, expert), in position order within each
    sizes = torch.bincount(key, minlength=1)
    start = sizes.cumsum(0) - sizes
    rank = torch.empty_like(order)
    rank[order] = slot - start[key[order]]  # a copy's place in its expert's queue within its sequence
    if taken is not None:
        rank = rank + taken.reshape(-1)[key]
    return rank < capacity


def sequence_counts(flat: torch.Tensor, copies_per_sequence: int, num_experts: int) -> torch.Tensor:
    """The copies each expert was sent in each sequence ([sequences, E], int64) of `flat` [T k]."""
    sequences = flat.numel() // copies_per_sequence
    key = (torch.arange(flat.numel(), device=flat.device) // copies_per_sequence) * num_experts + flat
    return torch.bincount(key, minlength=sequences * num_experts).view(sequences, num_experts)


class WholeSequences:
    """Where a layer's tokens lie in their sequences, for what routing computes over a sequence or a
    micro-batch (capacity's queues, the balance loss's shares): here each sequence is whole, in `parts` = 1
    slice. Context parallelism (parallel/context.py) swaps in one whose ranks each hold a slice, tensor
    parallelism (parallel/moe_tensor.py) one that also splits them over its ranks. `summed`: how many of the
    slices have their gradients summed (tensor parallel ranks) rather than averaged."""
    parts = 1
    summed = 1

    def split(self, x: torch.Tensor, training: bool) -> torch.Tensor:
        """The layer's input [..., s, h] -> the tokens this rank routes."""
        return x

    def join(self, y: torch.Tensor, training: bool) -> torch.Tensor:
        """The routed outputs of `split`'s tokens -> the layer's output for all its input."""
        return y

    def total(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-expert counts [E] of these tokens -> those of the whole sequences (no gradient)."""
        return counts

    def earlier(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-sequence counts [sequences, E] of this slice -> those of the slices before it in each sequence."""
        return torch.zeros_like(counts)


def balance_loss(logits: torch.Tensor, counts: torch.Tensor, k: int, scoring: str = "softmax",
                 tokens: int | None = None) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss with top-k routing, Megatron-core's normalisation:
    E * sum_e f_e P_e, f_e the share of the T k token copies sent to expert e (no gradient) and P_e the mean
    probability the router gives e (softmax; sigmoid scores normalised per token, DeepSeek-V3's). 1 when the
    load is uniform, E when one expert takes everything.

    Where `logits` are one slice of `tokens` (context parallelism: `counts` are then the whole micro-batch's),
    P_e is the slice's mean: its loss is the whole one's share of these tokens times the slices, as its token
    mean losses are, so the gradients' mean over the slices' ranks is the whole loss's gradient."""
    probs = logits.softmax(-1) if scoring == "softmax" else _normalised(logits.sigmoid())
    tokens = logits.shape[0] if tokens is None else tokens
    f = counts.detach().float() / (tokens * k)
    return logits.shape[-1] * (f * probs.mean(0)).sum()


def _normalised(scores):
    return scores / scores.sum(-1, keepdim=True)


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2, which keeps the logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def in_backward() -> bool:
    """Whether autograd's engine is running this code (a checkpointed block's recomputation)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


# ---- what the step and the logs read -----------------------------------------------------------------------

def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(layers: list[MoE], balance_coef: float, z_coef: float) -> torch.Tensor | None:
    """The auxiliary losses of the forward that just ran, summed over the MoE layers (Megatron-core's and
    torchtitan's per-layer sum), times their coefficients; None without MoE layers. Each layer's are dropped
    once read, so a later forward's can never be added twice."""
    total = None
    for m in layers:
        if m.balance_loss is None:
            continue
        term = balance_coef * m.balance_loss + z_coef * m.z_loss
        total = term if total is None else total + term
        m.balance_loss = m.z_loss = None
    return total


def expert_load(model: nn.Module) -> dict[int, dict]:
    """Per MoE layer, the tokens each expert received since the last call (summed over micro-batches, counted
    once under recomputation), with the max / mean load that logs show: {layer: {tokens, max_over_mean}}."""
    out = {}
    for m in moe_layers(model):
        load = m.take_load()
        if load is not None:
            load = load.cpu()
            mean = load.float().mean().item()
            out[m.layer] = {"tokens": load.tolist(), "max_over_mean": load.max().item() / mean if mean else 0.0}
    return out
