"""`train.freeze` in the planner: the parameters its patterns hold fixed (parallel/freeze.py), matched against the
model's own parameter names (ModelConfig.parameter_shapes, the Decoder's), so that a plan of a fine-tuning run
with frozen modules ("experts,router", "embed", "layers.0") charges them no gradient, fp32 master or optimizer
moment, no weight-gradient FLOPs, and frozen experts no inputs kept for backward, as the engine allocates and
computes none. LoRA's frozen base is counted apart (LoRAConfig); patterns under LoRA, which can only freeze
adapters, are neither checked nor counted here (the run checks them against its adapters' names)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from ..config import ConfigError, ModelConfig
from ..config.freeze_patterns import frozen_by_pattern


@dataclass(frozen=True)
class Frozen:
    """Frozen parameters by where they live: per layer the dense ones (attention, norms, router, shared
    expert) and the routed experts, then the token and position embeddings, the final norm and the output
    head; and the share of the MoE layers whose experts' up (down) projections are frozen, whose
    inputs backward then keeps not (they serve only the weight's gradient)."""
    dense: tuple[int, ...]
    experts: tuple[int, ...]
    embedding: int = 0
    position: int = 0
    final_norm: int = 0
    head: int = 0
    expert_up: float = 0.0
    expert_down: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.dense) + sum(self.experts) + self.embedding + self.position + self.final_norm + self.head


def frozen_of(m: ModelConfig, spec: str) -> Frozen | None:
    """What `spec` (train.freeze) freezes in the model `m`; None for "". A pattern that matches no parameter,
    or a freeze of every one, is refused as the run refuses it."""
    if not spec.strip():
        return None
    return _count(json.dumps(asdict(m), sort_keys=True), spec)


@lru_cache(maxsize=16)  # a search estimates hundreds of layouts of one model and one spec
def _count(model_json: str, spec: str) -> Frozen:
    m = ModelConfig(**json.loads(model_json))
    shapes = m.parameter_shapes()
    names = set().union(*frozen_by_pattern(spec, shapes).values())
    if len(names) == len(shapes):
        raise ConfigError(f"train.freeze = {spec!r} freezes every trainable parameter: nothing would train")
    dense, experts = [0] * m.num_layers, [0] * m.num_layers
    ends = {"embed": 0, "pos_embed": 0, "norm": 0, "lm_head": 0}
    for name in names:
        n = math.prod(shapes[name])
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            if ".experts." in name:
                experts[i] += n
            else:
                dense[i] += n
        else:
            ends[name.split(".")[0]] += n
    moe = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
    share = {p: sum(f"layers.{i}.mlp.experts.{p}.weight" in names for i in moe) / max(len(moe), 1)
             for p in ("up", "down")}
    return Frozen(tuple(dense), tuple(experts), ends["embed"], ends["pos_embed"], ends["norm"], ends["lm_head"],
                  share["up"], share["down"])


def layout_frozen(m: ModelConfig, L) -> Frozen | None:
    """What a layout's train.freeze holds fixed; None without one, and under LoRA (whose adapters are the trained
    set, its base counted apart)."""
    return None if L.lora.rank else frozen_of(m, L.freeze)


def head_frozen(m: ModelConfig, L) -> bool:
    """Whether train.freeze holds the output head (a tied one with the embedding)."""
    f = layout_frozen(m, L)
    return f is not None and bool(f.head or (m.tie_embeddings and f.embedding))


def frozen_flops_per_token(m: ModelConfig, L) -> float:
    """The weight-gradient FLOPs a token does not cost for train.freeze's parameters (2 a multiplying
    parameter, of the 6 training counts): the dense ones and the head (a tied one with the embedding), the
    experts at top_k of num_experts (an embedding's lookup and the norms' scales are no products)."""
    f = layout_frozen(m, L)
    if f is None:
        return 0.0
    routed = min(m.top_k, m.num_experts) / m.num_experts if m.num_experts else 0.0
    head = f.head + (f.embedding if m.tie_embeddings else 0)
    return 2.0 * (sum(f.dense) + head + sum(f.experts) * routed)


def frozen_expert_inputs(m: ModelConfig, L) -> tuple[float, float]:
    """The share of MoE layers whose experts' up, and down, projections train.freeze holds: their inputs (a
    token copy's row, and its SwiGLU output) are not kept for backward there."""
    f = layout_frozen(m, L)
    return (0.0, 0.0) if f is None else (f.expert_up, f.expert_down)
