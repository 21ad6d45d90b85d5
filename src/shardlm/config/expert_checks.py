"""The checks of a mixture of experts' configuration (model/moe.py, parallel/expert.py): keys only a mixture of
experts reads, refused on a dense model; what a mixture of experts runs with; LoRA on one. Shared by the
runtime (checks.validate) and the planner (plan/layout.py)."""
from __future__ import annotations

import math
from dataclasses import fields

from ..naming import Naming
from .errors import ConfigError
from .schema import Config, LoRAConfig, ModelConfig
from .shapes import LORA_MODULES, MOE_LORA_NAMES, block_linears, lora_targets


# The keys only a mixture of experts reads: on a dense model they would be ignored without a word. Those with
# another default than 0 count as set where they differ from it (`--model.top_k 2` once trained a dense model).
MOE_ONLY = ("model.moe_ffn_hidden_size", "model.shared_expert_ffn_hidden_size", "model.capacity_factor",
            "model.router_bias_update_rate", "model.moe_first_dense", "train.moe_z_loss_coef", "model.top_k",
            "model.moe_every", "model.router_scoring", "model.router_renormalize", "train.moe_aux_loss_coef",
            "parallel.ep_dispatch", "parallel.ep_load_budget")


def check_dense(cfg: Config) -> None:
    for key in MOE_ONLY:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        default = next(f.default for f in fields(getattr(cfg, section)) if f.name == name)
        off = (default, 0) if key in ("model.top_k", "train.moe_aux_loss_coef") else (default,)  # 0: "none", said
        if value not in off:
            whose = (f"the config.json of train.init_from = {cfg.train.init_from!r} has no experts"
                     if cfg.train.init_from else "model.num_experts = 0")
            leave = " or ".join(f"{v:g}" if isinstance(v, float) else repr(v) for v in off)
            raise ConfigError(f"{key} = {value!r} applies to a mixture of experts, and this model is dense ({whose}): "
                              f"set model.num_experts (and model.top_k), or leave {key} at {leave}")


def check_experts(cfg: Config) -> None:
    """What a mixture-of-experts model (model/moe.py) runs with: one process, data parallelism (DDP, ZeRO),
    pipeline parallelism (each stage its layers' experts and auxiliary losses), context parallelism (the
    routing statistics reduced over the cp group) and expert parallelism (parallel/expert.py) carved out of
    dp x cp, within each pipeline stage, and tensor parallelism (parallel/moe_tensor.py: routed experts whole on
    each tp rank, which routes its own slice of the tokens); LoRA adapts attention and any dense MLP, not the
    experts, a shared expert or the router (frozen with the base)."""
    m, p = cfg.model, cfg.parallel
    if m.arch != "llama":
        raise ConfigError(f"model.num_experts = {m.num_experts} needs model.arch = 'llama' (SwiGLU experts); it is "
                          f"{m.arch!r}")
    if not any(m.is_moe_layer(i) for i in range(m.num_layers)):
        raise ConfigError(f"model.moe_first_dense = {m.moe_first_dense} and model.moe_every = {m.moe_every} leave "
                          f"none of the {m.num_layers} layers a mixture of experts")
    if p.tp > 1 and p.dp_mode == "classic" and p.zero_stage == 0 and p.dp * p.cp > 1:
        raise ConfigError(f"parallel.dp_mode = 'classic' with parallel.tp = {p.tp}: the experts, whole on each tensor-"
                          "parallel rank, reduce over the tp ranks too, which classic data parallelism cannot; use DDP "
                          "or ZeRO")
    if p.ep > 1 and p.delayed_update:
        raise ConfigError(f"parallel.delayed_update = True with parallel.ep = {p.ep}: the delayed update of two "
                          "parameter groups (dense and experts) is not validated yet; use parallel.delayed_update = False")
    if p.ep > 1 and p.dp_mode == "classic" and p.zero_stage == 0:
        raise ConfigError(f"parallel.dp_mode = 'classic' with parallel.ep = {p.ep}: classic data parallelism reduces "
                          "every gradient onto one rank, not the experts' over their own replicas; use DDP or ZeRO")
    check_expert_lora(m, cfg.lora)


def untrained_router_note(cfg: Config) -> str | None:
    """A note where the loss cannot train the router: top_k 1 with the chosen weight renormalised is 1 whatever
    the router says, so its gradient from the loss is 0 and only the balance and z losses train it (as in
    transformers for such a config). A note, not a refusal: a pretrained model may be so configured, and a run
    already started must resume."""
    m = cfg.model
    if cfg.lora.rank or _router_frozen(cfg):
        return None
    if m.num_experts == 1 and (m.router_renormalize or m.router_scoring == "softmax"):
        # the advice below would not help: a softmax over one expert is 1 too, and a balance loss over one is 1
        return ("note: model.num_experts = 1 weighs every token's one expert by 1, so nothing trains the router "
                "(its balance loss is 1 whatever it says): the layer computes a dense MLP, which model.num_experts "
                "= 0 builds without the router")
    if not (m.num_experts and m.top_k == 1 and m.router_renormalize):
        return None
    fixes = "freeze the router (train.freeze = 'router') or route to top_k 2 or more"
    if not cfg.train.init_from:  # a pretrained model's router_renormalize is part of what it computes
        fixes = ("set model.router_renormalize = False (Switch Transformer's top-1, weighted by the router's "
                 f"probability), {fixes}")
    return ("note: model.top_k = 1 with model.router_renormalize = True weighs every token's expert by 1, so the loss "
            "trains the router not at all (only train.moe_aux_loss_coef's balance loss does): " + fixes)


def moe_notes(cfg: Config) -> list[str]:
    """The notes a mixture of experts trains under (the trainer prints them): untrained_router_note's, a capacity
    below a balanced load, which drops copies however evenly the router spreads them (model/moe.py's capacity
    per expert per sequence), and a padded dispatch asked for under capacity routing, whose survivors go by
    exact counts (parallel/expert.py)."""
    m, p, seq = cfg.model, cfg.parallel, cfg.train.seq_len
    notes = [n for n in (untrained_router_note(cfg),) if n]
    if not (m.num_experts and m.capacity_factor > 0):
        return notes
    balanced = seq * m.top_k / m.num_experts
    capacity = min(math.ceil(min(m.capacity_factor, m.num_experts / m.top_k) * balanced), seq)
    if capacity * m.num_experts < seq * m.top_k:
        lost = 1 - capacity * m.num_experts / (seq * m.top_k)
        notes.append(f"note: model.capacity_factor = {m.capacity_factor} lets each expert take {capacity} token "
                     f"cop{'y' if capacity == 1 else 'ies'} per sequence of the {balanced:g} a balanced load gives it: "
                     f"at least {100 * lost:.1f}% of the copies are dropped in training, however evenly the router "
                     "spreads them (1 keeps a balanced load; the Switch Transformer trained at 1 to 1.25)")
    if p.cp > 1 and p.cp_comm == "p2p":
        notes.append(f"note: model.capacity_factor = {m.capacity_factor} under ring attention (parallel.cp_comm = "
                     "'p2p') keeps each rank's slice of a sequence contiguous, as an expert's queue runs along it in "
                     "order, not zig-zag: the last rank attends over every earlier slice, the first over its own, "
                     "so attention runs up to twice as long (dropless routing, or Ulysses' 'a2a', is balanced)")
    if p.ep > 1 and p.ep_dispatch == "padded":
        notes.append(f"note: parallel.ep_dispatch = 'padded' with model.capacity_factor = {m.capacity_factor}: "
                     "training sends the copies capacity keeps by their exact counts (padded blocks are sized for "
                     "dropless routing); evaluation, dropless, sends padded blocks")
    return notes


def _router_frozen(cfg: Config) -> bool:
    """Whether train.freeze holds every MoE layer's router (which its patterns may name by layer or weight)."""
    from .freeze_patterns import freezes, patterns
    names = [f"layers.{i}.mlp.router.weight" for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i)]
    pats = patterns(cfg.train.freeze)
    return all(any(freezes(p, n) for p in pats) for n in names)


def check_expert_lora(m: ModelConfig, lora: LoRAConfig, naming: Naming | None = None) -> None:
    """LoRA (`lora`) on a mixture of experts: adapters on attention and dense MLPs only, and no
    QLoRA; shared by the runtime and the planner (`naming`: how to name the values, Naming)."""
    show = (naming or Naming()).show
    if not lora.rank:
        return
    if lora.quantize != "none":
        raise ConfigError(f"{show('quantize', lora.quantize)} with {show('num_experts', m.num_experts)}: the "
                          "experts, most of the weights, would stay 16-bit; QLoRA on a mixture of experts is not "
                          f"built yet: use {show('quantize', 'none')}")
    for t in (t.strip() for t in lora.targets.split(",")):
        if MOE_LORA_NAMES & set(t.split(".")):  # else refused as no module of the dense architecture at all
            raise ConfigError(f"{show('targets', lora.targets)} names {t!r}, a linear of the mixture of experts (an "
                              "expert's or the router's), which take no adapters yet: adapt attention "
                              "(q_proj,k_proj,v_proj,o_proj) and any dense MLP, or use all-linear")
    chosen = lora_targets(m.arch, lora.targets)
    if not any(n in chosen for layer in range(m.num_layers) for path in block_linears(m, layer)
               for n in LORA_MODULES[m.arch][path]):
        raise ConfigError(f"{show('targets', lora.targets)} names MLP linears only, and every layer's MLP is a "
                          "mixture of experts, whose experts take no adapters yet: add attention's "
                          "(q_proj,k_proj,v_proj,o_proj) or use all-linear")
