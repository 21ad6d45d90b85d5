"""What the planner is asked about: a model (shardlm's ModelConfig, the runtime's own shape arithmetic), a
workload (sequence length, micro and global batch) and a layout: the runtime's own layout schema
(config.ParallelConfig) plus the training options that change memory and time, checked by the runtime's
own check (config.check_layout) with errors that name the planner's flags."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import (BLOCK_RECOMPUTE, Config, ConfigError, LoRAConfig, ModelConfig, Naming, ParallelConfig,
                      check_expert_lora, check_layout, check_stages_train, lora_targets, rank_layers)
from .frozen import frozen_of


class PlanError(ConfigError):
    """An impossible layout or workload; the message names the value."""


@dataclass(frozen=True)
class Workload:
    seq: int
    micro_batch: int
    global_batch: int
    tokens: float = 0.0  # total training tokens, for train_flops / train_days


@dataclass
class Layout(ParallelConfig):
    recompute: str = "none"        # none | selective | full
    precision: str = "bf16"        # fp32 | bf16 | fp16
    optimizer_dtype: str = "fp32"  # fp32 | bf16: the masters' and moments' (train.optimizer_dtype)
    attention: str = "flash"       # flash | standard
    loss_chunk: int = 2048         # tokens per chunk of shardlm's fused head + loss; 0: full logits
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank 0: every weight trained
    free_grads: bool = True        # one process gives its gradients' memory back between steps (train.free_grads)
    freeze: str = ""               # train.freeze's module patterns: held fixed, no gradients nor optimizer state

    @property
    def gpus(self) -> int:
        return self.world

    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        """The layout a training config runs."""
        return cls(**vars(cfg.parallel), recompute=cfg.train.recompute, precision=cfg.train.precision,
                   optimizer_dtype=cfg.train.optimizer_dtype, loss_chunk=cfg.train.loss_chunk_tokens, lora=cfg.lora,
                   free_grads=cfg.train.free_grads, freeze=cfg.train.freeze)


FLAGS = Naming(flags=True)


def stage_layers(m: ModelConfig, L: Layout, rank: int) -> list[int]:
    """The layers pipeline rank `rank` holds: its stages rank, rank + pp, ... of the runtime's own split
    (schedules.split_layers: balanced by compute, or parallel.pp_layers)."""
    return rank_layers(m, L.pp, L.virtual_stages, L.pp_layers)[rank] if L.pp > 1 else list(range(m.num_layers))


def check(model: ModelConfig, work: Workload, layout: Layout, gpus: int | None = None) -> None:
    L = layout
    for name, value, allowed in (("recompute", L.recompute, ("none", "selective", *BLOCK_RECOMPUTE)),
                                 ("precision", L.precision, ("fp32", "bf16", "fp16")),
                                 ("optimizer-dtype", L.optimizer_dtype, ("fp32", "bf16")),
                                 ("attention", L.attention, ("flash", "standard"))):
        if value not in allowed:
            raise PlanError(f"--{name} {value!r} is not one of {', '.join(map(str, allowed))}")
    if L.optimizer_dtype == "bf16" and (L.precision != "bf16" or L.offload != "none"):
        raise PlanError(f"--optimizer-dtype bf16 needs --precision bf16 (it is {L.precision}) and no --offload (it is "
                        f"{L.offload}): the runtime refuses the others (train.optimizer_dtype)")
    if L.lora.quantize not in ("none", "nf4"):
        raise PlanError(f"--quantize {L.lora.quantize!r} is not one of none, nf4")
    if L.lora.quantize == "nf4" and not L.lora.rank:
        raise PlanError("--quantize nf4 quantises a frozen base: it needs --lora-rank")
    if L.lora.rank < 0:
        raise PlanError(f"--lora-rank {L.lora.rank} must not be negative")
    if L.lora.rank > model.hidden_size:  # config.checks.validate's refusal: planned, it was a run that cannot start
        raise PlanError(f"--lora-rank {L.lora.rank} exceeds the model's hidden size {model.hidden_size}, the most an "
                        f"adapter's update B A can have: lower --lora-rank (to {model.hidden_size} at most)")
    if L.offload_activations and L.recompute != "full":
        raise PlanError("--offload-activations offloads what full recomputation keeps of a block (its input): it "
                        f"needs --recompute full (it is {L.recompute})")
    if L.delayed_update and L.precision == "fp16":
        raise PlanError("--delayed-update with --precision fp16: a step skipped for an overflow is only known once "
                        "the update that was to overlap has run; use bf16")
    if L.delayed_update and L.ep > 1:  # config.checks.check_moe's refusal: a plan of it was a run that cannot start
        raise PlanError(f"--delayed-update with --ep {L.ep}: the delayed update of two parameter groups (dense and "
                        "experts) is not validated yet")
    if L.lora.rank:
        try:
            if model.num_experts:  # first: it names an expert's linears as such, not as unknown modules
                check_expert_lora(model, L.lora, FLAGS)
            lora_targets(model.arch, L.lora.targets)
        except ConfigError as e:
            raise PlanError(str(e).replace("lora.targets", "--lora-targets")) from None
    if L.freeze and not L.lora.rank:  # under LoRA the run checks them against its adapters' names
        try:
            frozen_of(model, L.freeze)
        except ConfigError as e:
            raise PlanError(str(e).replace("train.freeze", "--freeze")) from None
    try:
        check_layout(model, L, work.seq, work.micro_batch, work.global_batch, gpus, FLAGS)
        check_stages_train(model, L.pp, L.virtual_stages, L.pp_layers, L.freeze, L.lora, FLAGS)
    except ConfigError as e:
        raise PlanError(str(e)) from None


def expert_loads(m: ModelConfig, L: Layout) -> tuple[float, float, str]:
    """A rank's experts at their worst, in balanced loads (its own token copies): (the rows whose activations
    they hold, the rows that arrive, why, as the planner says it). Padded blocks hold ep at any routing; exact
    counts bring up to ep (capacity routing: its factor), past parallel.ep_load_budget run in checkpointed
    chunks that keep the arrived rows alone (parallel/expert_chunks.py). One process: one."""
    if L.ep_padded(not m.capacity_factor):
        return L.ep, L.ep, f"padded blocks, {L.ep} loads at any routing"
    arrived = min(L.ep, m.capacity_factor) if m.capacity_factor else L.ep
    if L.ep_load_budget and arrived > L.ep_load_budget:
        return L.ep_load_budget, arrived, f"past --ep-load-budget {L.ep_load_budget:g} in recomputed chunks"
    why = "one process" if L.ep == 1 else ("capacity" if arrived < L.ep else "every token copy on one rank")
    return arrived, arrived, why
