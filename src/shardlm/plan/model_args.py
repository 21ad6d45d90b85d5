"""The model a plan is for, from `shardlm plan`'s flags: a preset or a run's TOML (its vocabulary from its data's
tokenizer where the config leaves it 0), a Hugging Face config.json or directory, or --arch's shape; and the
LoRA settings that go with it."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from ..config import (Config, ConfigError, LoRAConfig, ModelConfig, ParallelConfig, TrainConfig, load_config,
                      validate)
from .layout import PlanError

SEQ = 2048  # --seq's default, where the model's context holds it


def model_from_args(a) -> ModelConfig:
    """The model to plan (--model, or --arch and its shape flags, with --experts/--top-k), refused as `shardlm
    train` refuses it: a head size of 75 or none, key/value heads not dividing the heads, GPT-2 with grouped-query
    attention, a negative size were planned without a word, or ended in a ZeroDivisionError."""
    model = _model_from_args(a)
    try:  # the model's own checks, beside train's defaults elsewhere (the layout is the planner's to check)
        validate(Config(model=model, train=TrainConfig(seq_len=max(1, min(TrainConfig.seq_len, model.max_seq_len)))))
    except ConfigError as e:
        raise PlanError(f"the model: {_as_flags(str(e), a)}") from None
    return model


# The config keys plan's flags set: a refusal of a value the user typed names the flag, not a key never written.
FLAG_OF = {"num_layers": "layers", "hidden_size": "hidden", "num_heads": "heads", "num_kv_heads": "kv_heads",
           "ffn_hidden_size": "ffn", "vocab_size": "vocab", "num_experts": "experts", "top_k": "top_k"}


def _as_flags(message: str, a) -> str:
    """`message` with each `model.KEY = VALUE` (or `model.KEY`) that a flag of this command gave written as that
    flag: `--top-k 9 must be between 1 and the 4 experts`, not `model.top_k = 9 ...`."""
    def flag(match):
        name = FLAG_OF.get(match.group(1))
        if name is None or getattr(a, name, None) is None:  # from --model's config: its key is the right name
            return match.group(0)
        return f"--{name.replace('_', '-')}" + (" " if match.group(2) else "")
    return re.sub(r"model\.(\w+)( = )?", flag, message)


def _model_from_args(a) -> ModelConfig:
    if a.model:
        from ..config.load import own_model_keys
        from ..hf_config import model_config_from_hf, with_init_from
        path = Path(a.model)
        if path.is_dir() or path.suffix == ".json":
            cfg_file = path / "config.json" if path.is_dir() else path
            if not cfg_file.is_file():
                run = path / "config.toml"  # a shardlm run directory records the config it trained with
                above = path.parent.parent / "config.toml"  # a checkpoint's: RUN/checkpoints/step_N
                fix = (f": it is a shardlm run; plan it with --model {run}" if run.is_file() else
                       f": it is a checkpoint of a shardlm run; plan it with --model {above}"
                       if (path / "state.json").is_file() and above.is_file() else
                       ": it is a PEFT adapter; plan its base model with --lora-rank (adapter_config.json's r)"
                       if (path / "adapter_config.json").is_file() else "")
                raise PlanError(f"--model {a.model}: no config.json there{fix}")
            try:  # the error names the file: json's and the config's own messages do not
                hf = json.loads(cfg_file.read_text())
                if isinstance(hf, dict) and not ({"architectures", "model_type"} & hf.keys()):
                    above = cfg_file.parent.parent.parent / "config.toml"  # RUN/checkpoints/step_N/state.json
                    raise PlanError("not a Hugging Face config.json (no architectures or model_type)"
                                    + (f": plan its run with --model {above}" if above.is_file() else ""))
                cfg = model_config_from_hf(hf)
            except ConfigError as e:
                raise PlanError(f"--model {cfg_file}: {e}") from None
            except ValueError as e:
                raise PlanError(f"--model {cfg_file} is not valid JSON ({e}): download or save it again") from None
        else:
            full = load_config(a.model)
            if full.train.init_from:  # a fine-tune trains config.json's model, under its file's own [model] keys
                try:
                    full = with_init_from(full, own_model_keys(a.model))
                except ConfigError as e:
                    raise PlanError(f"--model {a.model}: {e}") from None
            cfg = full.model if full.model.vocab_size else replace(full.model, vocab_size=data_vocab(a.model, full))
        return with_experts(cfg, a)
    need = ("layers", "hidden", "heads", "vocab")
    missing = [n for n in need if getattr(a, n) is None]
    if a.arch is None or missing:
        raise PlanError("give --model, or --arch with --layers --hidden --heads --vocab (and optionally --kv-heads "
                        f"--ffn), or --params{'; missing ' + ', '.join('--' + n for n in missing) if a.arch else ''}")
    return with_experts(ModelConfig(arch="gpt2" if a.arch == "gpt" else "llama", num_layers=a.layers,
                                    hidden_size=a.hidden, num_heads=a.heads, num_kv_heads=a.kv_heads or 0,
                                    ffn_hidden_size=a.ffn or 0, vocab_size=a.vocab, max_seq_len=max(a.seq or SEQ, SEQ),
                                    tie_embeddings=a.arch == "gpt"), a)


def with_experts(cfg: ModelConfig, a) -> ModelConfig:
    """The model with --experts and --top-k where given, each alone: --top-k alone was ignored, --experts reset a
    preset's top-k to 2, and --experts 0 left a preset's experts in place (0 read as not given)."""
    experts = cfg.num_experts if a.experts is None else a.experts
    moe_only = [f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
                for flag, value, given in (("--ep-dispatch", a.ep_dispatch, a.ep_dispatch != ParallelConfig.ep_dispatch),
                                           ("--ep-load-budget", a.ep_load_budget,
                                            a.ep_load_budget != ParallelConfig.ep_load_budget)) if given]
    if not experts and moe_only:  # train refuses their keys on a dense model (config/expert_checks.py)
        verb = "apply" if len(moe_only) > 1 else "applies"
        raise PlanError(f"{', '.join(moe_only)} {verb} to a mixture of experts, and this model is dense")
    if not experts and a.top_k is not None:
        raise PlanError(f"--top-k {a.top_k} applies to a mixture of experts, and this model is dense: give --experts "
                        "too")
    return replace(cfg, num_experts=experts, top_k=cfg.top_k if a.top_k is None else a.top_k)


def data_vocab(source: str, cfg) -> int:
    """model.vocab_size = 0, which a run takes from its data's tokenizer: data.path's index, or the default corpus's
    byte tokenizer (256 bytes and an end-of-text). Planned as 0, it counted no embedding and no head."""
    if not cfg.data.path:
        return 257
    index = Path(cfg.data.path) / "index.json"
    try:
        return int(json.loads(index.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        raise PlanError(f"--model {source}: model.vocab_size = 0 takes the size of data.path's tokenizer, and {index} "
                        "cannot be read (is the data prepared, and plan run where training runs?): set "
                        "model.vocab_size") from None


def lora_from_args(a) -> LoRAConfig:
    """--lora-rank and its flags, else a TOML config's [lora] section, else none."""
    if a.lora_rank is None and a.model and Path(a.model).suffix == ".toml":
        if a.quantize != "none" or a.lora_targets != "all-linear":
            raise PlanError("--quantize and --lora-targets take effect with --lora-rank; without it the TOML's "
                            "[lora] section is used")
        return load_config(a.model).lora
    return LoRAConfig(rank=a.lora_rank or 0, targets=a.lora_targets, quantize=a.quantize)
