"""Checks: a configuration refused before any work starts, with a message naming the key and the value.
`validate` checks each value (finite, in range, one of its choices) and the combinations the runtime cannot
run; `check_layout` checks a parallel layout against the model and the batch, the one check the runtime and
the planner (plan/layout.py) share, naming what it refuses by config key or by the planner's flags (Naming).
"""
from __future__ import annotations

import math
from dataclasses import fields

from ..schedules import SCHEDULES, ScheduleError
from ..schedules import check_layout as check_schedule
from .errors import ConfigError
from .expert_checks import check_dense, check_experts
from ..naming import Naming
from .rope_checks import check_rope_scaling
from .schema import SECTIONS, Config, ModelConfig, ParallelConfig, TrainConfig
from .shapes import lora_targets
from .stage_checks import batch_fix, check_batch, check_stages_train, schedule_takes


# Full recomputation and its partial forms, which skip the last linear of a block's halves (model/recompute.py).
BLOCK_RECOMPUTE = ("full", "full-skip-down", "full-skip-out-down")
# The values each key may take; `validate` refuses any other, naming the choices.
CHOICES = {
    "model.arch": ("llama", "gpt2"),
    "model.router_scoring": ("softmax", "sigmoid"),
    "train.checkpoint_format": ("sharded", "full"),
    "data.tokenizer": ("byte",),  # any other value was silently ignored
    "train.lr_schedule": ("cosine", "linear", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.recompute": ("none", "selective", *BLOCK_RECOMPUTE),
    "train.optimizer": ("adamw", "sgd"),
    "train.optimizer_dtype": ("fp32", "bf16"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.attention": ("auto", "flash", "cudnn", "efficient", "math"),
    "parallel.offload": ("none", "optimizer", "params"),
    "parallel.dp_mode": ("ddp", "classic"),
    "parallel.reduce_dtype": ("fp32", "compute"),
    "parallel.reduce_algo": ("auto", "all_to_all", "ring", "copy_engine"),
    "parallel.pp_transfer": ("auto", "process_group", "copy_engine"),
    "parallel.pp_schedule": SCHEDULES,
    "parallel.cp_comm": ("a2a", "p2p"),
    "parallel.ep_dispatch": ("auto", "padded", "exact"),
    "lora.quantize": ("none", "nf4"),
}
POSITIVE = ("model.hidden_size", "model.num_layers", "model.num_heads", "model.max_seq_len",
            "train.steps", "train.global_batch_size", "train.micro_batch_size", "train.seq_len",
            "train.log_every", "train.eval_batches", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp",
            "parallel.ep", "parallel.virtual_stages", "parallel.prefetch_units", "model.init_std",
            "parallel.timeout_s", "parallel.bucket_mb", "model.norm_eps", "model.rope_theta", "train.keep_checkpoints",
            "train.checkpoint_buffer_mb", "lora.alpha", "train.eps", "model.moe_every")  # alpha 0: no update at all; eps 0: Adam's 0 / 0 where a gradient is 0
NON_NEGATIVE = ("model.vocab_size", "model.num_kv_heads", "model.num_experts", "model.top_k", "model.head_dim", "model.ffn_hidden_size", "model.sliding_window",
                "train.lr", "train.warmup_steps", "train.weight_decay", "train.grad_clip", "train.eval_every",
                "train.save_every", "train.gc_every", "train.sample_tokens", "train.loss_chunk_tokens", "train.peak_tflops", "data.eval_windows",
                "train.min_lr_ratio", "train.momentum", "train.seed", "parallel.persist_threshold",
                "parallel.offload_threads", "lora.rank", "model.moe_ffn_hidden_size",
                "model.shared_expert_ffn_hidden_size", "model.moe_first_dense", "train.moe_aux_loss_coef",
                "train.moe_z_loss_coef", "model.capacity_factor", "model.router_bias_update_rate",
                "parallel.ep_load_budget")


UNIT_INTERVAL = ("train.beta1", "train.beta2", "train.momentum", "lora.dropout")  # in [0, 1)
# (train key, value): the keys it leaves unread (set away from their defaults once without a word), and their reader.
UNREAD = {("optimizer", "adamw"): (("momentum",), "optimizer = 'sgd'"),
          ("optimizer", "sgd"): (("beta1", "beta2", "eps"), "optimizer = 'adamw'"),
          ("lr_schedule", "constant"): (("min_lr_ratio",), "lr_schedule = 'cosine' or 'linear'")}
MAX_ACCUM = 1 << 16  # micro-batches per rank a step: global_batch_size 1e30 ran on, deaf to SIGTERM (heard between)


def validate(cfg: Config, world_size: int = 1) -> None:
    """Fail before any work with a message naming the key and the value."""
    def get(key):
        s, n = key.split(".")
        return getattr(getattr(cfg, s), n)

    for section in SECTIONS:  # nan compares false with everything, so the range checks below would pass it
        obj = getattr(cfg, section)
        for f in fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{f.name} = {value!r} must be a finite number")
    for key in UNIT_INTERVAL:
        if not 0 <= get(key) < 1:
            raise ConfigError(f"{key} = {get(key)!r} must be in [0, 1)")
    check_rope_scaling(cfg.model.rope_scaling)

    for key, allowed in CHOICES.items():
        if get(key) not in allowed:
            raise ConfigError(f"{key} = {get(key)!r} is not one of {', '.join(allowed)}{_spelled(get(key), allowed)}")
    for key in POSITIVE:
        if not get(key) > 0:
            raise ConfigError(f"{key} = {get(key)!r} must be positive")
    for key in NON_NEGATIVE:
        if get(key) < 0:
            raise ConfigError(f"{key} = {get(key)!r} must not be negative")
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if t.seed >= 2**64:  # torch's generators take 64 bits: 2^64 stopped the run with 'Overflow when unpacking long long'
        raise ConfigError(f"train.seed = {t.seed} does not fit in 64 bits: give a seed from 0 to {2**64 - 1}")
    if m.head_dim == 0 and m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size = {m.hidden_size} is not divisible by model.num_heads = {m.num_heads}")
    if m.num_heads % m.kv_heads:
        raise ConfigError(f"model.num_heads = {m.num_heads} is not divisible by model.num_kv_heads = {m.num_kv_heads}")
    llama_only = [f"model.{k} = {v!r}" for k, v in (("num_kv_heads", m.num_kv_heads), ("qkv_bias", m.qkv_bias),
                  ("rope_scaling", m.rope_scaling), ("sliding_window", m.sliding_window), ("head_dim", m.head_dim))
                  if v and not (k == "num_kv_heads" and v == m.num_heads)
                  and not (k == "head_dim" and v * m.num_heads == m.hidden_size)]
    if m.arch == "gpt2" and llama_only:  # named: the key is often a preset's, left set under --model.arch gpt2
        raise ConfigError(f"model.arch = 'gpt2' has no grouped-query attention, separate qkv_bias, rope_scaling, "
                          f"sliding_window or head size of its own (GPT-2's config.json has none to export): "
                          f"{', '.join(llama_only)} needs model.arch = 'llama' (for GPT-2 leave it unset; "
                          "model.num_kv_heads 0 is one per head)")
    if m.arch == "llama" and m.head_size % 2:
        raise ConfigError(f"model head size {m.head_size} must be even for rotary embeddings")
    if t.seq_len > m.max_seq_len:
        # Under init_from the model section is the checkpoint's config.json, whatever a config file's said
        whose = (" (with train.init_from, the checkpoint's config.json's unless --model.max_seq_len overrides it)"
                 if cfg.train.init_from else "")
        raise ConfigError(f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}{whose}")
    # The sample after training may run to max_seq_len: past the window too.
    longest = max(t.seq_len, m.max_seq_len if t.sample_tokens else 0)
    if m.sliding_window and longest > m.sliding_window and t.attention == "flash":
        raise ConfigError(f"train.attention = 'flash' takes no attention mask, which model.sliding_window = "
                          f"{m.sliding_window} below {'train.seq_len' if longest == t.seq_len else 'model.max_seq_len (the sample)'} "
                          f"= {longest} needs (use auto, efficient or math)")
    if t.optimizer_dtype == "bf16":
        check_bf16_optimizer(cfg)
    if m.num_experts:
        check_experts(cfg)
    else:
        check_dense(cfg)
    if any(not x.strip() for x in cfg.train.freeze.split(",")) and cfg.train.freeze.strip():
        raise ConfigError(f"train.freeze = {cfg.train.freeze!r} has an empty pattern: patterns are separated by "
                          "single commas")
    if cfg.lora.rank:
        lora_targets(m.arch, cfg.lora.targets)
        # Every block linear has hidden_size on one side: B A can have no higher rank, and alpha / rank would
        # shrink the update (a typo's rank 16000 trained nothing, at gigabytes of adapters).
        if cfg.lora.rank > m.hidden_size:
            raise ConfigError(f"lora.rank = {cfg.lora.rank} exceeds model.hidden_size = {m.hidden_size}, the most "
                              f"an adapter's update B A can have: lower lora.rank (to {m.hidden_size} at most)")
    elif cfg.lora.quantize != "none":
        raise ConfigError(f"lora.quantize = {cfg.lora.quantize!r} quantizes a frozen base under adapters: set lora.rank")
    if t.min_lr_ratio > 1:
        raise ConfigError(f"train.min_lr_ratio = {t.min_lr_ratio} must be at most 1")
    for (key, value), (names, reader) in UNREAD.items():
        for name in (n for n in names if getattr(t, key) == value and getattr(t, n) != getattr(TrainConfig, n)):
            raise ConfigError(f"train.{name} = {getattr(t, name)!r} applies to train.{reader}, and train.{key} is "
                              f"{value!r}: set train.{reader}, or leave train.{name} at {getattr(TrainConfig, name)!r}")
    if p.tp_async and not (p.sp and t.compile):
        raise ConfigError("parallel.tp_async = True fuses the sequence-parallel collectives with their matmuls when the "
                          f"blocks compile: it needs parallel.sp = True and train.compile = True (they are {p.sp} and "
                          f"{t.compile})")
    if p.tp_async and t.device == "cpu":
        raise ConfigError("parallel.tp_async = True needs CUDA GPUs (train.device is 'cpu'): the fused kernels move "
                          "chunks through symmetric memory")
    if p.tp_async and p.pp > 1:
        raise ConfigError("parallel.tp_async = True is not yet validated with pipeline stages (parallel.pp = "
                          f"{p.pp}): both take symmetric memory, whose rendezvous must come in the same order on "
                          "every rank; use parallel.pp = 1 or parallel.tp_async = False")
    if p.offload_activations and t.recompute != "full":
        raise ConfigError("parallel.offload_activations = True offloads what full recomputation keeps of a block (its "
                          f"input): it needs train.recompute = 'full' (it is {t.recompute!r})")
    if p.delayed_update and t.precision == "fp16":
        raise ConfigError("parallel.delayed_update = True with train.precision = 'fp16': a step skipped for an "
                          "overflow is only known once the update that was to overlap has run; use bf16")
    if p.tp_async and p.cp > 1:
        raise ConfigError(f"parallel.tp_async = True is not yet validated with context parallelism (parallel.cp = "
                          f"{p.cp}): use parallel.cp = 1 or parallel.tp_async = False")
    check_layout(m, p, t.seq_len, t.micro_batch_size, t.global_batch_size, world_size)
    check_stages_train(m, p.pp, p.virtual_stages, p.pp_layers, t.freeze, cfg.lora)


def check_bf16_optimizer(cfg: Config) -> None:
    """train.optimizer_dtype = 'bf16' (masters and moments in bf16, optim.py): bf16 weights, and the optimizer on
    the GPU (offload's CPU and NVMe steps keep fp32 state, cpu_adam.py and parallel/offload*.py)."""
    t, p = cfg.train, cfg.parallel
    if t.precision != "bf16":
        raise ConfigError(f"train.optimizer_dtype = 'bf16' keeps bf16 master weights, which needs train.precision "
                          f"= 'bf16' (it is {t.precision!r}): the weights are then the masters themselves, as fp32 "
                          "or fp16 weights are not; use train.optimizer_dtype = 'fp32'")
    if p.offload != "none":
        raise ConfigError(f"train.optimizer_dtype = 'bf16' with parallel.offload = {p.offload!r}: the offloaded "
                          "optimizer keeps its masters and moments in host memory or files, in fp32 (its CPU step, "
                          "cpu_adam.py, is fp32 only), so bf16 would save no GPU memory; use parallel.offload = "
                          "'none' or train.optimizer_dtype = 'fp32'")
    # A moment moves by (1 - beta) of its distance to the new value a step, and bf16 rounds away a change under
    # half its spacing (2^-9 to 2^-8 of the value): a moment then stops within (1 - beta) / (1 - beta - 2^-8) of
    # where it heads, 1.6x at beta 0.99, never arriving at 0.996 (Adam's second moment at beta2 0.999 would keep
    # a gradient spike's size for the rest of the run).
    for name in ("beta1", "beta2") if t.optimizer == "adamw" else ():
        beta = getattr(t, name)
        if beta > 0.99:
            raise ConfigError(f"train.optimizer_dtype = 'bf16' with train.{name} = {beta:g}: bf16 rounds away a "
                              f"moment's change of {1 - beta:.2g} of itself (under half its spacing, 2^-9 to 2^-8 of "
                              f"it), so it stops short of the gradients' size or never decays; use train.{name} <= "
                              "0.99 or train.optimizer_dtype = 'fp32'")


# ---- the one check of a layout, shared by the runtime (`validate`) and the planner (plan/layout.py) ------

def _spelled(value, allowed) -> str:
    """The choice `value` spells in other case (the README writes schedules as papers do: 1F1B, ZB-H1, GPipe)."""
    same = [c for c in allowed if isinstance(value, str) and c.lower() == value.lower()]
    return f" (did you mean {same[0]!r}? choices are lowercase)" if same else ""


def check_layout(m: ModelConfig, p: ParallelConfig, seq: int, micro_batch: int, global_batch: int,
                 world: int | None = None, naming: Naming = Naming()) -> None:
    """A layout against the model, the batch and (when given) the world size; raises ConfigError naming the
    values. Every rank runs it before any collective, and the planner before it estimates."""
    key, show = naming.key, naming.show
    for name in ("dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        if getattr(p, name) < 1:
            raise ConfigError(f"{show(name, getattr(p, name))} must be at least 1")
    if micro_batch >= 1 and global_batch // (micro_batch * p.dp) > MAX_ACCUM:
        raise ConfigError(f"{show('global_batch', global_batch)} is over {MAX_ACCUM:,} micro-batches of "
                          f"{key('micro_batch')} ({micro_batch}) per {key('dp')} rank a step, more than any run takes: "
                          f"lower it (to {MAX_ACCUM * micro_batch * p.dp:,} at most here) or raise {key('micro_batch')}")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{show('zero_stage', p.zero_stage)} is not one of 0, 1, 2, 3")
    for name, allowed in (("offload", ("none", "optimizer", "params")), ("pp_schedule", CHOICES["parallel.pp_schedule"]),
                          ("cp_comm", CHOICES["parallel.cp_comm"]), ("ep_dispatch", CHOICES["parallel.ep_dispatch"])):
        if getattr(p, name) not in allowed:
            raise ConfigError(f"{show(name, getattr(p, name))} is not one of {', '.join(allowed)}"
                              f"{_spelled(getattr(p, name), allowed)}")
    if world is not None and p.world != world:
        axes = [a for a in ("dp", "tp", "pp", "cp") if a != "cp" or p.cp != 1]
        got = " x ".join(f"{key(a)} ({getattr(p, a)})" for a in axes)
        other = p.world // p.dp  # tp x pp x cp: what data parallelism multiplies
        if naming.flags:
            hint = ""
        elif world == 1:  # every axis above 1 named: pp, cp or ep left as they were would refuse the next try
            ones = " ".join(f"--parallel.{a} 1" for a in ("dp", "tp", "pp", "cp", "ep", "virtual_stages")
                            if a in ("dp", "tp") or getattr(p, a) > 1) + (" --parallel.pp_layers ''" if p.pp_layers
                                                                           else "") + \
                (" --parallel.sp false" if p.sp else "")
            hint = (f": start {p.world} processes, e.g. `torchrun --nproc-per-node {p.world} -m shardlm train ...`, "
                    f"or set the layout for one ({ones}; checkpoints resume under any layout)")
        else:  # ep must divide the new dp x cp, which carries the experts
            ep = math.gcd(p.ep, world // other * p.cp) if world % other == 0 else p.ep
            # a layout of one needs no torchrun at all
            launch = (f"launch {p.world} processes (torchrun --nproc-per-node {p.world})" if p.world > 1
                      else "run one process, without torchrun")
            dp = world // other
            batch = ""
            if world % other == 0 and (global_batch % (micro_batch * dp)
                                       or not schedule_takes(global_batch // (micro_batch * dp), p)):
                name, value, _ = batch_fix(global_batch, micro_batch, dp, p)
                batch = f" --{key(name)} {value}"
            hint = (f": {launch}, or set a layout of {world}"
                    + (f", e.g. --parallel.dp {dp}" + (f" --parallel.ep {ep}" if ep != p.ep else "") + batch
                       if world % other == 0 else f" (the other axes' {other} does not divide {world})"))
        raise ConfigError(f"{got} = {p.world} != {'--gpus' if naming.flags else 'world size'} {world}{hint}")
    both = math.gcd(m.num_heads, m.ffn_size)  # the tp values that fit, named: the fix is one of them
    fits = [str(d) for d in range(2, both + 1) if both % d == 0]
    fits = f": {key('tp')} can be {', '.join(fits)} for this model" if fits else f": no {key('tp')} above 1 fits it"
    if m.num_heads % p.tp:
        raise ConfigError(f"{show('tp', p.tp)} does not divide the {m.num_heads} attention heads{fits}")
    if m.ffn_size % p.tp:
        raise ConfigError(f"{show('tp', p.tp)} does not divide the MLP's {m.ffn_size} hidden features{fits}")
    if p.cp_comm == "a2a" and (m.num_heads // p.tp) % p.cp:
        raise ConfigError(f"{show('cp', p.cp)} must divide the {m.num_heads // p.tp} attention heads each tensor-parallel "
                          f"rank holds: Ulysses' context parallelism splits them over its ranks around attention "
                          f"(ring attention, {show('cp_comm', 'p2p')}, does not)")
    if seq % p.cp:
        raise ConfigError(f"{show('seq', seq)} must divide by {show('cp', p.cp)}")
    if p.cp > 1 and p.cp_comm == "p2p" and not m.capacity_factor and seq % (2 * p.cp):
        raise ConfigError(f"{show('seq', seq)} must divide by 2 x {key('cp')} ({p.cp}) = {2 * p.cp} for ring "
                          f"attention's zig-zag layout: each rank holds two of 2 x {key('cp')} chunks of every sequence")
    if p.sp and p.tp == 1:
        raise ConfigError(f"{show('sp', True)} (sequence parallelism) needs {key('tp')} > 1")
    if p.sp and seq % (p.tp * p.cp):
        cp = f" x {key('cp')} ({p.cp})" if p.cp > 1 else ""
        raise ConfigError(f"{show('seq', seq)} must divide by {show('tp', p.tp)}{cp} for sequence parallelism")
    if p.pp > m.num_layers:
        raise ConfigError(f"{show('pp', p.pp)} exceeds the model's {m.num_layers} layers")
    stages = p.pp * p.virtual_stages
    if stages > m.num_layers:
        raise ConfigError(f"{show('pp', p.pp)} x {show('virtual_stages', p.virtual_stages)} = {stages} stages exceed "
                          f"the model's {m.num_layers} layers")
    if p.pp_layers:
        try:
            counts = [int(c) for c in p.pp_layers.split(",")]
        except ValueError:
            counts = []
        if len(counts) != stages or min(counts, default=0) < 1 or sum(counts) != m.num_layers:
            # a run resumed at another pp or virtual_stages carries the split it was saved with
            other = f", or {key('pp_layers')} '' for a split balanced by compute" if len(counts) != stages else ""
            raise ConfigError(f"{show('pp_layers', p.pp_layers)} must give {stages} positive layer counts, one per "
                              f"stage, summing to the model's {m.num_layers} layers{other}")
    if p.virtual_stages > 1 and p.pp_schedule != "interleaved":
        raise ConfigError(f"{show('virtual_stages', p.virtual_stages)} needs {show('pp_schedule', 'interleaved')}")
    if p.pp > 1:
        check_batch(p, seq, micro_batch, global_batch, naming)  # before the schedule's count, which floors it
        try:
            check_schedule(p.pp_schedule, p.pp, p.virtual_stages, global_batch // (micro_batch * p.dp), naming)
        except ScheduleError as e:
            raise ConfigError(str(e)) from None
    # Before the ZeRO stage's own refusal, whose "use zero_stage 1" these two would refuse in turn.
    needs = [f"{show('offload', 'params')} needs {show('zero_stage', 3)}"] if p.offload == "params" else []
    needs += [f"{show('delayed_update', True)} needs {show('zero_stage', 2)}"] if p.delayed_update else []
    if needs and p.pp > 1:
        raise ConfigError(f"{' and '.join(needs)}, which {show('pp', p.pp)} does not support: keep the stages with "
                          f"{show('zero_stage', 1)} and {show('offload', 'optimizer')}"
                          + (f" and no {key('delayed_update')}" if p.delayed_update else "")
                          + f", or set {key('pp')} = 1")
    if p.zero_stage >= 2 and p.pp > 1:
        raise ConfigError(f"{show('zero_stage', p.zero_stage)} with {show('pp', p.pp)} is not supported: ZeRO-2 would "
                          "reduce-scatter every micro-batch's gradients (m times ZeRO-1's traffic) and ZeRO-3 gather "
                          f"the parameters for every micro-batch of every stage; use {show('zero_stage', 1)}")
    if p.offload != "none" and p.zero_stage < 1:
        # params' own need: ">= 1" would send the user to zero_stage 1, which is refused in turn
        least = "= 3" if p.offload == "params" else ">= 1"
        # classic DP refuses every ZeRO stage: the fix this names would be refused in turn without the other half
        ddp = f" and {show('dp_mode', 'ddp')} (classic DP runs no ZeRO)" if p.dp_mode == "classic" else ""
        raise ConfigError(f"{show('offload', p.offload)} needs {key('zero_stage')} {least} (it is {p.zero_stage})"
                          f"{ddp}")
    if p.offload_dir and p.offload == "none":
        raise ConfigError(f"{show('offload_dir', p.offload_dir)} needs {key('offload')} optimizer or params")
    if p.delayed_update and not (p.zero_stage == 2 and p.offload == "optimizer" and not p.offload_dir):
        raise ConfigError(f"{show('delayed_update', True)} is ZeRO-Offload's: it needs {show('zero_stage', 2)} with "
                          f"{show('offload', 'optimizer')} (and no {key('offload_dir')})")
    if p.overlap_update and not (p.zero_stage in (1, 2) and p.offload == "optimizer" and not p.offload_dir
                                 and not p.delayed_update and p.dp * p.cp == 1 and p.pp == 1):
        raise ConfigError(f"{show('overlap_update', True)} runs one rank's offloaded update beside the next forward: it "
                          f"needs {key('zero_stage')} 1 or 2 with {show('offload', 'optimizer')}, {key('dp')} = "
                          f"{key('cp')} = 1 (with more replicas the updated shards' all-gathers overlap forward already), "
                          f"{key('pp')} = 1 (a "
                          f"pipeline's schedule waits for all of it), no {key('offload_dir')} and no "
                          f"{key('delayed_update')}")
    if p.delayed_update and (p.tp > 1 or p.pp > 1):
        raise ConfigError(f"{show('delayed_update', True)} runs the update beside the next step, which tensor and "
                          f"pipeline parallelism would need collectives in; it needs {key('tp')} = {key('pp')} = 1")
    if p.offload == "params" and p.zero_stage < 3:
        raise ConfigError(f"{show('offload', p.offload)} needs {show('zero_stage', 3)} (it is {p.zero_stage})")
    if p.dp_mode == "classic" and p.zero_stage:
        raise ConfigError(f"{show('dp_mode', 'classic')} keeps everything on one rank; it cannot be combined "
                          f"with {show('zero_stage', p.zero_stage)}")
    if p.reduce_algo == "copy_engine" and p.dp_mode == "classic":
        raise ConfigError(f"{show('reduce_algo', 'copy_engine')} is implemented for DDP and ZeRO, not for "
                          f"{show('dp_mode', 'classic')}")
    if p.ep > 1 and not m.num_experts:
        raise ConfigError(f"{show('ep', p.ep)} needs a mixture-of-experts model (model.num_experts)")
    if m.num_experts and (m.num_experts % p.ep or (p.dp * p.cp) % p.ep):
        raise ConfigError(f"{show('ep', p.ep)} must divide the {m.num_experts} experts and {key('dp')} x {key('cp')} "
                          f"({p.dp * p.cp}): expert parallelism is carved out of data and context parallelism")
    if m.num_experts and p.tp > 1 and seq % (p.tp * p.cp):
        cp = f" x {key('cp')} ({p.cp})" if p.cp > 1 else ""
        raise ConfigError(f"{show('seq', seq)} must divide by {show('tp', p.tp)}{cp} for a mixture of experts: each "
                          "tensor-parallel rank routes its slice of every sequence")
    if m.num_experts and m.shared_expert_ffn_hidden_size % p.tp:
        raise ConfigError(f"{show('tp', p.tp)} does not divide the shared expert's {m.shared_expert_ffn_hidden_size} "
                          "hidden features")
    if not (p.ep_load_budget == 0 or 1 <= p.ep_load_budget < math.inf):  # nan too
        raise ConfigError(f"{show('ep_load_budget', p.ep_load_budget)}: a rank's experts take at least one balanced "
                          "load (its own token copies) in one pass; use 0 (never in chunks) or a finite multiple of "
                          "at least 1")
    if m.num_experts and p.ep == 1 and p.ep_dispatch != "auto":  # here: the planner refuses it too
        raise ConfigError(f"{show('ep_dispatch', p.ep_dispatch)} applies to expert parallelism, and {show('ep', 1)} "
                          f"(every expert on every rank): set {key('ep')} above 1, or leave {key('ep_dispatch')} at "
                          "'auto'")
    if m.num_experts and p.ep == 1 and p.ep_load_budget != ParallelConfig.ep_load_budget:
        # nothing reads it at ep 1 (a rank's experts take its own copies, one balanced load): a value given there
        # would be ignored without a word, so refused as ep_dispatch is
        raise ConfigError(f"{show('ep_load_budget', p.ep_load_budget)} applies to expert parallelism's exact dispatch, "
                          f"and {show('ep', 1)} (every expert on every rank, each taking its own token copies): set "
                          f"{key('ep')} above 1, or leave {key('ep_load_budget')} at {ParallelConfig.ep_load_budget:g}")
    if m.num_experts and not 1 <= m.top_k <= m.num_experts:
        raise ConfigError(f"model.top_k = {m.top_k} must be between 1 and the {m.num_experts} experts")
    check_batch(p, seq, micro_batch, global_batch, naming)
