"""What the planner is asked about: a model (shardlm's ModelConfig, the runtime's own shape arithmetic),
a workload (sequence length, micro and global batch) and a layout (the degree of every parallel axis and
the memory options), validated with errors that name the value."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig


class PlanError(ValueError):
    """An impossible layout or workload; the message names the value."""


@dataclass(frozen=True)
class Workload:
    seq: int
    micro_batch: int
    global_batch: int
    tokens: float = 0.0  # total training tokens, for train_flops / train_days


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    offload: str = "none"          # none | optimizer | params
    sp: bool = False               # Megatron sequence parallelism (with tp > 1)
    recompute: str = "none"        # none | selective | full
    pp_schedule: str = "1f1b"      # gpipe | 1f1b | interleaved
    virtual_stages: int = 1
    precision: str = "bf16"        # fp32 | bf16 | fp16
    attention: str = "flash"       # flash | standard
    reduce_dtype: str = "fp32"     # fp32 | compute
    reduce_algo: str = "auto"      # auto | all_to_all | ring | copy_engine: how 16-bit gradients are summed in fp32
    loss_chunk: int = 2048         # tokens per chunk of shardlm's fused head + loss; 0: full logits

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def check(model: ModelConfig, work: Workload, layout: Layout, gpus: int | None = None) -> None:
    L = layout
    for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        if getattr(L, name) < 1:
            raise PlanError(f"--{name.replace('_', '-')} {getattr(L, name)} must be at least 1")
    for name, value, allowed in (("zero", L.zero, (0, 1, 2, 3)), ("offload", L.offload, ("none", "optimizer", "params")),
                                 ("recompute", L.recompute, ("none", "selective", "full")),
                                 ("pp-schedule", L.pp_schedule, ("gpipe", "1f1b", "interleaved")),
                                 ("precision", L.precision, ("fp32", "bf16", "fp16")),
                                 ("attention", L.attention, ("flash", "standard"))):
        if value not in allowed:
            raise PlanError(f"--{name} {value!r} is not one of {', '.join(map(str, allowed))}")
    if gpus is not None and L.gpus != gpus:
        raise PlanError(f"dp ({L.dp}) x tp ({L.tp}) x pp ({L.pp}) x cp ({L.cp}) = {L.gpus} != --gpus {gpus}")
    if model.num_heads % L.tp:
        raise PlanError(f"--tp {L.tp} does not divide the {model.num_heads} attention heads")
    if model.kv_heads % L.tp:
        raise PlanError(f"--tp {L.tp} does not divide the {model.kv_heads} KV heads")
    if model.ffn_size % L.tp or model.vocab_size % L.tp:
        raise PlanError(f"--tp {L.tp} does not divide ffn {model.ffn_size} and vocab {model.vocab_size}")
    if L.pp > model.num_layers:
        raise PlanError(f"--pp {L.pp} exceeds the model's {model.num_layers} layers")
    if model.num_layers % (L.pp * L.virtual_stages):
        raise PlanError(f"{model.num_layers} layers do not split into --pp {L.pp} x --virtual-stages "
                        f"{L.virtual_stages} equal stages")
    if L.virtual_stages > 1 and L.pp_schedule != "interleaved":
        raise PlanError("--virtual-stages > 1 needs --pp-schedule interleaved")
    if L.zero == 3 and L.pp > 1:
        raise PlanError(f"--zero 3 with --pp {L.pp} is not supported (parameters would be gathered for every "
                        "micro-batch of every stage); use --zero 1 with pipeline parallelism")
    if L.offload != "none" and L.zero < 1:
        raise PlanError(f"--offload {L.offload} needs --zero >= 1")
    if L.offload == "params" and L.zero != 3:
        raise PlanError("--offload params needs --zero 3")
    if L.sp and L.tp == 1:
        raise PlanError("--sp (sequence parallelism) needs --tp > 1")
    if L.ep > 1 and not model.num_experts:
        raise PlanError(f"--ep {L.ep} needs a mixture-of-experts model (--experts)")
    if model.num_experts and (model.num_experts % L.ep or L.dp % L.ep):
        raise PlanError(f"--ep {L.ep} must divide the {model.num_experts} experts and --dp {L.dp} "
                        "(expert parallelism is carved out of data parallelism)")
    if model.num_experts and not 1 <= model.top_k <= model.num_experts:
        raise PlanError(f"--top-k {model.top_k} must be between 1 and the {model.num_experts} experts")
    if work.seq % L.cp or (L.sp and work.seq % L.tp):
        raise PlanError(f"--seq {work.seq} must divide by --cp {L.cp}" + (f" and --tp {L.tp}" if L.sp else ""))
    if work.global_batch % (work.micro_batch * L.dp):
        raise PlanError(f"--global-batch {work.global_batch} is not divisible by --micro-batch "
                        f"{work.micro_batch} x --dp {L.dp}")
    if min(work.seq, work.micro_batch, work.global_batch) < 1:
        raise PlanError("--seq, --micro-batch and --global-batch must be positive")
