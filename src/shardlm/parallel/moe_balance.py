"""Mixture-of-experts balance across the run (model/moe.py keeps each layer's counts): DeepSeek-V3's
auxiliary-loss-free bias update after each optimizer step, the per-layer statistics the trainer logs, and the
bias's place in a checkpoint.

Auxiliary-loss-free balancing (DeepSeek-V3, Liu et al. 2024, section 2.1.2; Wang et al. 2024): each MoE layer
adds a per-expert bias b to the router's scores for the top-k choice only (the gating weights stay the
unbiased scores), and after each step b_e += rate * sign(mean load - load_e): an overloaded expert becomes
less likely to be chosen, an idle one more, with no gradient through the router. A frozen router
(`train.freeze` matching it) keeps its bias: it still chooses, and is saved, but is no longer updated. The
load is the step's whole global batch (the token copies routed to each expert, summed over the micro-batches
and all-reduced over dp x cp, which holds the ep ranks, and tp, whose ranks route their own tokens), so every
rank takes the same step and the bias is the same at every layout.
It is not a parameter (no gradient, no optimizer state): the trainer saves it in its state (`state`, `load`),
exactly (fp32 values written as Python floats, which round-trip), so a resume continues it.

Statistics (`stats`, at logging steps): per layer, the tokens each expert received (max / mean load), the
token copies dropped by capacity (model.capacity_factor, the Switch Transformer's and GShard's capacity), the
forwards whose experts ran in chunks past their load budget (parallel/expert_chunks.py), and
the Switch balance loss E sum_e f_e P_e evaluated on the global batch of the steps since the last log. Counted
once under recomputation (moe.py records the first forward only), summed over every rank by one all-reduce in
fp64 (each tp rank its own slice of the tokens, parallel/moe_tensor.py), so they do not depend on the layout;
under pipelines each stage adds its own layers.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.moe import moe_layers


class MoEBalance:
    def __init__(self, model, mesh, model_cfg, device: torch.device):
        self.layers, self.mesh, self.device = moe_layers(model), mesh, device
        self.num_layers, self.num_experts = model_cfg.num_layers, model_cfg.num_experts
        self.rate = model_cfg.router_bias_update_rate

    def after_step(self, skipped: bool = False) -> None:
        """The bias update, after the optimizer step (a no-op when off): one all-reduce of [layers, E] counts
        over dp x cp. `skipped`: the step was not applied (fp16 overflow, decided alike on every rank), and
        the bias stays too, as the weights do."""
        if self.rate <= 0 or not self.layers:
            return
        routed = [m.take_routed() for m in self.layers]
        if skipped or any(r is None for r in routed):  # no update, or no training forward yet: nothing to learn
            return
        # A step without a training forward leaves zeros: sign(0) moves no bias.
        counts = torch.stack(routed).float()
        if (group := self.mesh.group("dp+cp+tp")) is not None:  # tp ranks route their own tokens (moe_tensor.py)
            dist.all_reduce(counts, group=group)
        for m, load in zip(self.layers, counts):
            if m.router.weight.requires_grad:  # a frozen router (train.freeze) keeps its bias as it is
                m.router_bias += self.rate * torch.sign(load.mean() - load)

    def _world_sum(self, per_layer: torch.Tensor) -> torch.Tensor:
        if dist.is_available() and dist.is_initialized() and self.mesh.world > 1:
            dist.all_reduce(per_layer)
        return per_layer

    def stats(self) -> dict:
        """{"moe/layer{i}/max_over_mean", ".../dropped", ".../routed", ".../aux_loss"} for the steps since the last call, and
        under expert parallelism ".../ep_max_over_mean" (by rank) and, where any ran, ".../chunked" (the training
        forwards, summed over the ranks, whose experts took more than parallel.ep_load_budget and ran in chunks);
        a collective over every rank (call it on all of them); {} for a dense model."""
        if not self.num_experts:
            return {}
        e = self.num_experts
        table = torch.zeros(self.num_layers, 3 * e + 2, dtype=torch.float64, device=self.device)
        for m in self.layers:
            stats = m.take_stats()
            if stats is not None:
                table[m.layer, :-1] = stats
            if chunked := getattr(m, "chunked", 0):  # an exact dispatch's passes past its budget
                table[m.layer, -1], m.chunked = chunked, 0
        table = self._world_sum(table).cpu()
        ep = self.mesh.size("ep")
        out = {}
        for layer, row in enumerate(table):
            routed, kept, probs, tokens = row[:e], row[e:2 * e], row[2 * e:3 * e], row[3 * e].item()
            if tokens == 0:
                continue
            mean = kept.mean().item()
            copies = routed.sum().item()
            out[f"moe/layer{layer}/max_over_mean"] = kept.max().item() / mean if mean else 0.0
            if ep > 1:  # the busiest expert-parallel rank's copies (its block of experts) over the mean rank's:
                # what the other ranks wait for at the combine
                busiest = kept.view(ep, -1).sum(1).max().item()
                out[f"moe/layer{layer}/ep_max_over_mean"] = busiest / (mean * e / ep) if mean else 0.0
            if row[-1]:  # forwards run in chunks, summed over the ranks; said where any ran (a rare event)
                out[f"moe/layer{layer}/chunked"] = int(row[-1].item())
            out[f"moe/layer{layer}/dropped"] = int(copies - kept.sum().item())
            out[f"moe/layer{layer}/routed"] = int(copies)  # what the dropped count is out of
            out[f"moe/layer{layer}/aux_loss"] = e * ((routed / copies) * (probs / tokens)).sum().item()
        return out

    def state(self) -> dict | None:
        """Every layer's bias, gathered onto every rank (a collective: call it on all of them); None when off."""
        if self.rate <= 0:
            return None
        table = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        owner = all(self.mesh.coord(a) == 0 for a in ("dp", "cp", "tp"))  # one copy of each stage's layers
        for m in self.layers:
            if owner and m.router_bias is not None:
                table[m.layer] = m.router_bias.double().cpu()
        if self.mesh.world > 1:
            table = self._world_sum(table.to(self.device)).cpu()  # on the device: NCCL reduces device tensors
        return {str(i): row.tolist() for i, row in enumerate(table)}

    def load(self, state: dict | None) -> None:
        """Resume each layer's bias from `state` (a run saved without one starts at zero)."""
        if self.rate <= 0 or not state:
            return
        for m in self.layers:
            m.router_bias = torch.tensor(state[str(m.layer)], dtype=torch.float32, device=self.device)
