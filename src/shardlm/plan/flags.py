"""The planner's flags that argparse's types do not check: numeric ranges, and flags given without the ones
they need or beside ones they contradict.

argparse takes `--gpu-tflops -5` and `--dp 0` as numbers; the planner then printed a negative step time, and
`--dp 0` became 1 through a falsy default. Each is refused here, naming the flag, its value and what it must be.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..config import ModelConfig
from .layout import PlanError

SHAPE = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")  # a model's shape, with --arch
AT_LEAST_ONE = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "micro_batch", "global_batch", "top", *SHAPE, "top_k")
FINITE = ("tokens", "price_per_gpu_hour", "params")


def check_numbers(a) -> None:
    for name in AT_LEAST_ONE:
        value = getattr(a, name, None)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} {value} must be at least 1")
    if (getattr(a, "experts", None) or 0) < 0:
        raise PlanError(f"--experts {a.experts} must not be negative (0: a dense MLP)")
    for name in FINITE:
        value = getattr(a, name, None)
        if value is not None and not math.isfinite(value):
            raise PlanError(f"--{name.replace('_', '-')} {value} must be a finite number")
    tflops = getattr(a, "gpu_tflops", None)
    if tflops is not None and not (math.isfinite(tflops) and tflops > 0):
        raise PlanError(f"--gpu-tflops {tflops:g} must be a positive, finite number of TFLOP/s (the GPU's dense "
                        "16-bit peak)")


def check_flags(a) -> None:
    """The values no layout check sees."""
    check_numbers(a)
    if not a.inference and (a.batch != 1 or a.context is not None):
        raise PlanError("--batch and --context size a served batch: give them with --inference (training's are "
                        "--micro-batch and --seq)")
    for flag, value in (("--tokens", a.tokens), ("--price-per-gpu-hour", a.price_per_gpu_hour)):
        if value < 0:
            raise PlanError(f"{flag} {value:g} must not be negative")
    if a.params is not None and a.params <= 0:
        raise PlanError(f"--params {a.params:g} must be positive")
    if a.gpus is not None and a.gpus < 1:
        raise PlanError(f"--gpus {a.gpus} must be at least 1")
    if a.gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node {a.gpus_per_node} must be at least 1")
    for flag, value, needs in (("--pcie-bw", a.pcie_bw, a.offload != "none"), ("--host-bw", a.host_bw, a.offload != "none"),
                               ("--disk-bw", a.disk_bw, bool(a.offload_dir))):
        if value and (not needs or a.params):
            also = " and --offload-dir" if flag == "--disk-bw" else ""
            raise PlanError(f"{flag} times offload's traffic: give it with --offload{also} and a model to time "
                            "(--model or --arch)")
    if a.optimizer_dtype != "fp32" and (a.params or a.inference):
        raise PlanError(f"--optimizer-dtype {a.optimizer_dtype} sizes a training's optimizer state: "
                        + ("--params gives the ZeRO paper's fp32 model states only" if a.params else
                           "--inference holds none"))
    if a.params and a.inference:
        raise PlanError("--params gives training's model states only; --inference needs the model's shape (--model "
                        "or --arch)")
    # Each way of giving the model reads only its own flags: beside another, one was ignored without a word
    # (`--model tiny --layers 4` planned tiny's 2 layers).
    shape = " ".join(f"--{n.replace('_', '-')} {getattr(a, n)}" for n in ("arch", *SHAPE)
                     if getattr(a, n) is not None)
    ways = [way for way in (a.model and f"--model {a.model}", shape, a.params and f"--params {a.params:g}") if way]
    if len(ways) > 1:
        raise PlanError(f"{' and '.join(ways)} each give the model, and only one is read: give --model, or --arch "
                        "with --layers --hidden --heads --vocab, or --params (to change a preset's shape, copy it "
                        "into a TOML file for --model)")
    if a.params:  # each was read as nothing: --tp 2 printed the whole model's states on each GPU, --search dp 1
        unread = [f for f, on in (("--tp", a.tp > 1), ("--pp", a.pp > 1), ("--ep", a.ep > 1), ("--search", a.search),
                                  ("--largest", a.largest), ("--freeze", a.freeze), ("--lora-rank", a.lora_rank),
                                  ("--quantize", a.quantize != "none"), ("--offload", a.offload != "none"),
                                  ("--recompute", a.recompute != "none"), ("--precision", a.precision != "bf16"))
                  if on]
        if unread:
            raise PlanError(f"--params gives the ZeRO paper's model states over --dp (x --cp) replicas of the whole "
                            f"model, and {', '.join(unread)} need{'s' if len(unread) == 1 else ''} the model's shape: "
                            "give --model or --arch instead")
    if a.host_memory and not a.largest:
        raise PlanError("--host-memory bounds --largest's search: give --largest too")
    if a.largest and a.search:
        raise PlanError("--largest and --search answer different questions: give one")
    if a.search:
        check_searched(a)
    if a.lora_rank is None and a.lora_targets != "all-linear" and not (a.model and Path(a.model).suffix == ".toml"):
        raise PlanError("--lora-targets names the modules LoRA adapts: give --lora-rank too")
    if a.price_per_gpu_hour and not a.tokens:
        raise PlanError("--price-per-gpu-hour needs --tokens: the cost is that of training on them")
    if a.price_per_gpu_hour and a.params:
        raise PlanError("--price-per-gpu-hour needs a model to time (--model or --arch); --params gives model "
                        "states and train FLOPs only")


def check_searched(a) -> None:
    """--search tries every value of these itself: one given was ignored without a word (`--search --zero 3` ranked
    ZeRO-0 layouts first). Without --gpus, --dp x --tp x --pp x --cp is the number of GPUs searched, and stays."""
    fixed = [("--zero", a.zero, 0), ("--ep", a.ep, 1), ("--sp", a.sp, False), ("--recompute", a.recompute, "none"),
             ("--pp-schedule", a.pp_schedule, "1f1b"), ("--virtual-stages", a.virtual_stages, 1),
             ("--pp-layers", a.pp_layers, "")]
    if a.gpus is not None:
        fixed += [("--dp", a.dp, None), ("--tp", a.tp, 1), ("--pp", a.pp, 1)]
    for flag, value, default in fixed:
        if value != default:
            shown = "" if value is True else f" {value}"
            raise PlanError(f"{flag}{shown} has no effect with --search, which tries every dp, tp, pp, ep, ZeRO "
                            "stage, sequence parallelism, recomputation and schedule itself: leave it out, or plan "
                            "that layout without --search")


# Flags that shape a training plan only: given with --inference they would be ignored, so they are refused.
TRAINING_ONLY = ("seq", "micro_batch", "global_batch", "tokens", "price_per_gpu_hour", "offload", "offload_dir",
                 "offload_activations", "delayed_update", "overlap_update", "cp_comm", "ep_dispatch", "ep_load_budget",
                 "sp", "recompute", "pp_schedule", "virtual_stages", "pp_layers", "attention", "reduce_dtype",
                 "reduce_algo",
                 "lora_targets", "host_memory", "top")


def check_inference_flags(a, model: ModelConfig, defaults) -> int:
    """The flags --inference reads, checked, each refusal naming only its own flags (`defaults`: the parser's
    values when none is given); returns the context."""
    from .inference import QUANTIZE
    ignored = [f"--{name.replace('_', '-')}" for name in TRAINING_ONLY if getattr(a, name) != getattr(defaults, name)]
    if ignored:
        raise PlanError(f"{', '.join(ignored)} shape{'s' if len(ignored) == 1 else ''} a training plan; --inference "
                        "reads the model, --batch, --context, --quantize, --precision and the GPU")
    if a.search:
        raise PlanError("--search ranks training layouts; --inference plans serving: give one of them")
    if a.largest:
        raise PlanError("--largest finds the largest model a training layout fits; --inference plans serving: give "
                        "one of them")
    parallel = [f"--{n} {v}" for n, v, on in (("gpus", a.gpus, (a.gpus or 1) > 1), ("tp", a.tp, a.tp > 1)) if on]
    if parallel:
        raise PlanError(f"{' '.join(parallel)}: --inference plans one GPU holding the whole model; tensor-parallel "
                        "serving (serve or generate --tp N) holds about 1/N of the weights on each GPU, which it "
                        "does not plan")
    training = [f for f, on in (("--dp", a.dp), ("--pp", a.pp > 1), ("--cp", a.cp > 1), ("--ep", a.ep > 1),
                                ("--zero", a.zero)) if on]
    if training:
        raise PlanError(f"{', '.join(training)} describe{'s' if len(training) == 1 else ''} a training layout; "
                        "--inference plans one GPU serving the whole model")
    if a.lora_rank is not None:
        raise PlanError("--lora-rank plans LoRA fine-tuning; --inference counts no adapters")
    if a.freeze:
        raise PlanError("--freeze plans fine-tuning with modules held fixed; --inference trains nothing")
    if a.quantize not in QUANTIZE:
        nf4 = " (nf4 is QLoRA's 4-bit base for training with --lora-rank)" if a.quantize == "nf4" else ""
        raise PlanError(f"--quantize {a.quantize!r} with --inference is not one of {', '.join(QUANTIZE)}{nf4}")
    if a.precision not in ("bf16", "fp16", "fp32"):
        raise PlanError(f"--precision {a.precision!r}: inference runs in bf16, fp16 or fp32")
    if a.quantize != "none" and a.precision == "fp32":
        # Their kernels take 16-bit inputs; in fp32 each step dequantises every weight whole, slower than fp32's.
        raise PlanError(f"--quantize {a.quantize} is planned in bf16 or fp16 (its kernels' inputs): give "
                        "--precision bf16 or fp16, not fp32")
    if a.batch < 1:
        raise PlanError(f"--batch {a.batch} must be at least 1")
    # None, not a falsy 0, means the model's whole window: --context 0 is refused below.
    context = model.max_seq_len if a.context is None else a.context
    if not 2 <= context <= model.max_seq_len:
        raise PlanError(f"--context {context} must be between 2 and the model's max_seq_len {model.max_seq_len}")
    return context


# A TOML --model's run settings that a plan takes as flags (the rest of [train] and [parallel] shape no plan).
RUN_FLAGS = {"train.seq_len": "seq", "train.micro_batch_size": "micro_batch", "train.global_batch_size": "global_batch",
             "train.precision": "precision", "train.recompute": "recompute", "train.optimizer_dtype": "optimizer_dtype",
             "train.freeze": "freeze",
             **{f"parallel.{k}": k for k in ("dp", "tp", "pp", "cp", "ep", "sp", "offload", "pp_schedule",
                                              "virtual_stages", "pp_layers", "offload_activations", "cp_comm",
                                              "ep_dispatch",
                                              "ep_load_budget", "offload_dir", "delayed_update", "overlap_update",
                                              "reduce_dtype", "reduce_algo")},
             "parallel.zero_stage": "zero"}


def unplanned_settings(source: str, planned: dict) -> str:
    """A note naming what the TOML `source` sets for its run that differs from the plan (`planned`: each
    RUN_FLAGS flag's value in it): plan reads the file's [model] and [lora], and planned a TOML of tp 2 at
    seq 64 as tp 1 at seq 2048 without a word."""
    from ..config.load import tomllib
    try:
        with open(source, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, ValueError):
        return ""
    given = {f"{s}.{k}": v for s in ("train", "parallel") for k, v in (raw.get(s) or {}).items()}
    off = [(key, given[key], flag) for key, flag in RUN_FLAGS.items() if key in given and given[key] != planned[flag]]
    if not off:
        return ""

    def toml(value):  # as the file writes it
        return str(value).lower() if isinstance(value, bool) else json.dumps(value)

    def flag(name, value):
        if value is False:
            return f"no --{name.replace('_', '-')}"
        return f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
    return (f"note: plan reads {source}'s [model] and [lora] only: it planned "
            f"{', '.join(flag(f, planned[f]) for _, _, f in off)}, not its "
            f"{', '.join(f'{k} = {toml(v)}' for k, v, _ in off)}; give {' '.join(flag(f, v) for _, v, f in off)} to plan "
            "its run")
