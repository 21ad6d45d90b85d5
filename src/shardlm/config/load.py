"""Loading: a configuration built from the schema's defaults, then a preset or TOML file, then dotted
command-line overrides (`--section.key value`, torchtitan's style), each value converted to its field's
type or refused naming the key. The presets are the package's configs/*.toml (package data, so a
non-editable install has them), and a source checkout's top-level configs/.
"""
from __future__ import annotations

import difflib
import os
import sys
from decimal import Decimal, InvalidOperation
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

from .errors import ConfigError
from .schema import SECTIONS, Config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# This file is shardlm/config/load.py: parents[1] is the package (shardlm/configs), parents[3] a checkout's root.
CONFIG_DIRS = (Path(__file__).resolve().parents[1] / "configs", Path(__file__).resolve().parents[3] / "configs")


def preset_names() -> list[str]:
    names = set()
    for d in CONFIG_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def _resolve_source(source: str) -> Path:
    p = Path(source)
    if p.suffix == ".toml" and p.is_file():
        return p
    if p.suffix != ".toml" and ("/" in source or os.sep in source) and p.with_name(p.name + ".toml").is_file():
        # `../configs/tiny`, a path without its suffix: joined onto the presets' directory it named the bundled
        # preset of that name (an absolute one the user's file), silently
        return p.with_name(p.name + ".toml")
    for d in CONFIG_DIRS:
        if (d / f"{source}.toml").is_file():
            return d / f"{source}.toml"
    if p.suffix == ".toml":  # a path, not a preset's name: say what is wrong with it
        raise ConfigError(f"config {source!r}: {'is a directory' if p.is_dir() else 'no such file'} (or a preset: "
                          f"{', '.join(preset_names())})")
    raise ConfigError(f"config {source!r} is neither a TOML file nor a preset (presets: {', '.join(preset_names())})")


def _convert(key: str, value: Any, typ: Any) -> Any:
    """Turn a TOML value or a command-line string into the field's type, or fail naming the key."""
    if isinstance(value, str) and not value.isascii():
        refuse_non_utf8(key, value)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, str):
                return _integer(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, str):
                raise ValueError
            return value
        if typ is dict:
            if isinstance(value, str):
                import json
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError
            return {k: v for k, v in value.items() if v is not None}  # JSON's null is unset, and TOML has none
    except (ValueError, TypeError):
        pass
    how = ""  # the two a first config gets wrong: a bool spelled otherwise, a TOML list where one string goes
    if typ is bool:
        how = ": give true or false"
    elif typ is str and isinstance(value, list) and all(isinstance(v, str) for v in value):
        how = f": give one string, the items separated by commas ({key.split('.')[1]} = {','.join(value)!r})"
    elif typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):  # precision = 16: a number
        from .checks import CHOICES
        allowed = CHOICES.get(key)
        quoted = f"{key.split('.')[1]} = \"{value}\""
        how = f": one of {', '.join(allowed)}, in quotes" if allowed else f": give it in quotes ({quoted})"
    raise ConfigError(f"{key} = {value!r} is not a valid {typ.__name__}{how}")


def _integer(text: str) -> int:
    """A command-line integer, exactly: 100000, 1e5 or 1.5e3 (an integral value in any notation). Through a float,
    --train.seed 9007199254740993 became ...992 and 18446744073709551615 (2^64 - 1) 2^64, which torch refused."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        d = Decimal(text.strip())
    except InvalidOperation:
        raise ValueError from None
    if not d.is_finite() or d.adjusted() > 308 or d != d.to_integral_value():  # 1e999999999: no int of a GB
        raise ValueError
    return int(d)


def refuse_non_utf8(name: str, value: str, fix: str = "") -> None:
    """ConfigError naming `name` where `value` is not UTF-8 text: bytes that are not UTF-8 on the command line
    reach Python as lone surrogates (surrogateescape), which fail later where a message names nothing (writing
    config.toml, a tokenizer's TypeError). `fix`: another way out, added to the message."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(e.object[e.start]) - 0xDC00
        what = f"the byte {byte:#04x}" if 0x80 <= byte <= 0xFF else repr(e.object[e.start])
        raise ConfigError(f"{name} holds {what}, which is not UTF-8 text: use a UTF-8 terminal or locale{fix}") \
            from None


# PEFT's LoraConfig and transformers' TrainingArguments names, which a user coming from them writes first.
HF_NAMES = {"lora.r": ("lora.rank", "PEFT"), "lora.lora_alpha": ("lora.alpha", "PEFT"),
            "lora.lora_dropout": ("lora.dropout", "PEFT"), "lora.target_modules": ("lora.targets", "PEFT"),
            "lora.use_rslora": ("lora.rslora", "PEFT"), "train.learning_rate": ("train.lr", "TrainingArguments"),
            "train.max_steps": ("train.steps", "TrainingArguments"),
            "train.num_train_epochs": ("train.steps (steps, not epochs)", "TrainingArguments"),
            "train.warmup_ratio": ("train.warmup_steps (steps, not a ratio)", "TrainingArguments"),
            "train.per_device_train_batch_size": ("train.micro_batch_size", "TrainingArguments"),
            "train.gradient_accumulation_steps": ("train.global_batch_size (micro batches x dp x accumulation)",
                                                  "TrainingArguments"),
            "train.max_grad_norm": ("train.grad_clip", "TrainingArguments"),
            "train.max_seq_length": ("train.seq_len", "TRL"), "train.max_length": ("train.seq_len", "TRL"),
            "train.save_steps": ("train.save_every", "TrainingArguments"),
            "train.save_total_limit": ("train.keep_checkpoints", "TrainingArguments"),
            "train.report_to": ("train.tensorboard (true or false)", "TrainingArguments"),
            "train.eval_steps": ("train.eval_every", "TrainingArguments"),
            "train.logging_steps": ("train.log_every", "TrainingArguments")}
# The mixture-of-experts keys under other trainers' names (config.json's, Megatron-LM's flags, DeepSpeed-MoE's):
# near spelling alone answered num_experts_per_tok, the top-k, with model.num_experts. Megatron-LM's and
# DeepSeek's moe_layer_freq count layers otherwise than model.moe_every, so it is left to the list of keys.
HF_NAMES |= {
    "model.num_local_experts": ("model.num_experts", "Mixtral"),
    "model.num_experts_per_tok": ("model.top_k", "Mixtral"),
    "model.n_routed_experts": ("model.num_experts", "DeepSeek"),
    "model.moe_intermediate_size": ("model.moe_ffn_hidden_size", "Qwen2-MoE"),
    "model.shared_expert_intermediate_size": ("model.shared_expert_ffn_hidden_size", "Qwen2-MoE"),
    "model.norm_topk_prob": ("model.router_renormalize", "Qwen2-MoE"),
    "model.decoder_sparse_step": ("model.moe_every", "Qwen2-MoE"),
    "model.first_k_dense_replace": ("model.moe_first_dense", "DeepSeek"),
    "model.scoring_func": ("model.router_scoring", "DeepSeek"),
    "model.router_aux_loss_coef": ("train.moe_aux_loss_coef", "Mixtral"),
    "model.router_z_loss_coef": ("train.moe_z_loss_coef", "Switch Transformers"),
    "model.moe_router_topk": ("model.top_k", "Megatron-LM"),
    "model.moe_expert_capacity_factor": ("model.capacity_factor", "Megatron-LM"),
    "model.moe_router_bias_update_rate": ("model.router_bias_update_rate", "Megatron-LM"),
    "model.moe_router_score_function": ("model.router_scoring", "Megatron-LM"),
    "model.moe_shared_expert_intermediate_size": ("model.shared_expert_ffn_hidden_size", "Megatron-LM"),
    "train.moe_aux_loss_coeff": ("train.moe_aux_loss_coef", "Megatron-LM"),
    "train.moe_z_loss_coeff": ("train.moe_z_loss_coef", "Megatron-LM"),
    "parallel.expert_model_parallel_size": ("parallel.ep", "Megatron-LM"),
    "parallel.ep_size": ("parallel.ep", "DeepSpeed-MoE"),
}


# Names other tools give two meanings: the hint names both of ours.
AMBIGUOUS = {"train.batch_size": "; did you mean train.global_batch_size (the sequences of a step) or "
                                 "train.micro_batch_size (those of one forward pass on a rank)?"}


def _near_section(section: str) -> str:
    """'; did you mean [train]?' for a misspelt or capitalised section ([trian], [Train]), else ""."""
    found = difflib.get_close_matches(section.lower(), SECTIONS, n=1, cutoff=0.6)
    return f"; did you mean [{found[0]}]?" if found else ""


def _near_key(section: str, name: str) -> str:
    """'; did you mean X?' for an unknown key: the same name in another section (train.tp), or a near spelling of
    one of the section's keys or of another tool's name for one (LR, learnig_rate); else "". The list of every key
    alone left a user to find the one meant among forty."""
    cfg = Config()
    elsewhere = [f"{s}.{name}" for s in SECTIONS if s != section and name in get_type_hints(type(getattr(cfg, s)))]
    names = {f.name: f"{section}.{f.name}" for f in fields(getattr(cfg, section))}
    names |= {k.partition(".")[2]: v[0].split()[0] for k, v in HF_NAMES.items() if k.startswith(section + ".")}
    found = elsewhere or [names[m] for m in difflib.get_close_matches(name.lower(), list(names), n=1, cutoff=0.7)] \
        or [names[m] for m in names if m.startswith(name.lower() + "_")]  # warmup, zero: a key's first word
    return f"; did you mean {found[0]}?" if found else ""


def apply_overrides(cfg: Config, flat: dict[str, Any]) -> None:
    """Set `section.key` values (strings from the command line, or TOML values) on `cfg`, converted to each
    field's type; an unknown key or a value of the wrong type raises ConfigError naming it."""
    for key, value in flat.items():
        section, _, name = key.partition(".")
        if section not in SECTIONS or not name:
            raise ConfigError(f"unknown config key {key!r}{_near_section(section)} (sections: {', '.join(SECTIONS)})")
        obj = getattr(cfg, section)
        hints = get_type_hints(type(obj))
        if name not in hints:
            known = ", ".join(f.name for f in fields(obj))
            ours = HF_NAMES.get(key)
            hint = f"; {ours[1]}'s {name} is {ours[0]} here" if ours else AMBIGUOUS.get(key) or _near_key(section, name)
            raise ConfigError(f"unknown config key {key!r}{hint} (known in [{section}]: {known})")
        setattr(obj, name, _convert(key, value, hints[name]))


def _flatten(d: dict, where: str) -> dict[str, Any]:
    flat = {}
    for section, body in d.items():
        if section in SECTIONS and isinstance(body, list) and all(isinstance(b, dict) for b in body):
            raise ConfigError(f"{where}: [[{section}]] is an array of tables (a list of sections): write [{section}], "
                              "one table")
        if not isinstance(body, dict):  # a key above every [section]: TOML puts it in none
            cfg = Config()
            homes = [s for s in SECTIONS if section in get_type_hints(type(getattr(cfg, s)))]
            home = f"put it under {' or '.join(f'[{h}]' for h in homes)}" if homes else \
                f"and no section has such a key (sections: {', '.join(SECTIONS)})"
            raise ConfigError(f"{where}: {section} = {body!r} is outside any [section]{':' if homes else ','} {home}")
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section [{section}] in {where}{_near_section(section)} (sections: "
                              f"{', '.join(SECTIONS)})")
        for k, v in body.items():
            flat[f"{section}.{k}"] = v
    return flat


def load_config(source: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Defaults <- preset or TOML file (`source`; None means the embedded default) <- dotted overrides."""
    cfg = Config()
    path = _resolve_source(source or "default")
    try:
        with open(path, "rb") as f:
            apply_overrides(cfg, _flatten(tomllib.load(f), str(path)))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text, as TOML must be (byte {e.start}: {e.reason})") from None
    apply_overrides(cfg, overrides or {})
    for key in PATH_KEYS:  # a TOML file's "~/data" (and --data.path=~/data) is no shell's to expand
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(getattr(cfg, section), name, os.path.expanduser(value))
    return cfg


def own_model_keys(source: str | None) -> dict[str, Any]:
    """A user's TOML file's own [model] keys (`model.KEY`: value), not a preset's: with train.init_from the model
    is the checkpoint's config.json, over which these still apply as `--model.*` overrides do. A fine-tune's
    capacity_factor or router_bias_update_rate, which no config.json holds, was dropped without a word."""
    if source is None:
        return {}
    path = _resolve_source(source)
    if any(path.resolve().parent == d for d in CONFIG_DIRS):
        return {}
    with open(path, "rb") as f:  # load_config read it already: no error of its own left to name
        model = tomllib.load(f).get("model", {})
    return {f"model.{k}": v for k, v in model.items()} if isinstance(model, dict) else {}


def config_from_dict(d: dict, where: str = "the saved config") -> Config:
    """The config a checkpoint saved (`where`: which). A key it holds that this version does not know, or a value
    of another type, was named as if the user had given it: a checkpoint of another version (or edited by hand)."""
    cfg = Config()
    try:
        apply_overrides(cfg, _flatten(d, where))
    except ConfigError as e:
        if str(e).startswith(where):  # _flatten's own names it
            raise
        raise ConfigError(f"{where}: {e} (saved by another version of shardlm, or edited by hand?)") from None
    return cfg


def refuse_misplaced_train_args(args: list[str]) -> None:
    """`shardlm train`'s arguments that are not overrides, written as other tools write their config: argparse said
    'unrecognized arguments' without saying how shardlm spells them."""
    for a in args:
        name = a.split("=", 1)[0]
        if name in ("--config", "--preset", "-c"):
            raise ConfigError(f"{name}: the config is the first argument, without a flag: shardlm train FILE.toml "
                              f"(or a preset: {', '.join(preset_names())})")
        if not a.startswith("-") and "=" in a and name.partition(".")[0] in SECTIONS:
            raise ConfigError(f"{a!r}: an override is written with two dashes: --{a}")
        bare = name.lstrip("-").replace("-", "_")
        if a.startswith("--") and "." not in name:  # --lr, --steps, --learning_rate: a key without its section
            owners = [f"{s}.{bare}" for s in SECTIONS if bare in {f.name for f in fields(getattr(Config(), s))}]
            owners += [HF_NAMES[f"{s}.{bare}"][0] for s in SECTIONS if f"{s}.{bare}" in HF_NAMES]
            if owners:
                others = ", ".join("--" + o.split()[0] for o in owners[1:])
                raise ConfigError(f"{name}: config keys are written with their section: --{owners[0].split()[0]}"
                                  + (f" (or {others})" if others else ""))


def refuse_empty_paths(argv: list[str]) -> None:
    """A path given as '' (a shell variable that was never set) read as '.' or as not given at all: --resume ''
    started a new run, --out '' trained into runs/<config>, --model '' named the working directory."""
    flags = ("--out", "--resume", "--model", "--checkpoint", "--data", "--input", "--output", "--tokenizer",
             "--adapter", "--config")
    for i, a in enumerate(argv):
        flag, eq, value = a.partition("=")
        if flag in flags and (value == "" if eq else i + 1 < len(argv) and argv[i + 1] == ""):
            raise ConfigError(f"{flag} is empty: give a path (is the shell variable for it set?)")


# The keys whose value names a file or directory ("" for none, data.tokenizer's "byte" the built-in one): given
# on the command line, "" is an unset shell variable, not a choice.
PATH_KEYS = ("data.path", "data.eval_path", "data.tokenizer", "train.init_from", "parallel.offload_dir")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--section.key value` and `--section.key=value` pairs into a flat dict."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key value")
        key = a[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            # `--train.steps --out run` forgot the value: taking '--out' as it would blame the wrong argument.
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"{key} is missing a value: give --{key} VALUE (or --{key}=VALUE)")
            value = args[i + 1]
            i += 2
        if value == "" and key in PATH_KEYS:
            # Left empty, these read as not given: the built-in corpus trained, or LoRA on a random base.
            raise ConfigError(f"--{key} is empty: give a path (is the shell variable for it set?)")
        out[key] = value
    return out
