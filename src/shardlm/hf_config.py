"""Hugging Face config.json <-> shardlm ModelConfig, with no torch import (the planner reads HF configs too).

A key that transformers reads for the architecture and that would change the model's math is either mapped
or refused with its name and value: a checkpoint never loads into a model that computes something else.
"""
from __future__ import annotations

from .config import Config, ConfigError, ModelConfig, apply_overrides
from .config.checks import NON_NEGATIVE, POSITIVE
from .config.rope_checks import check_rope_scaling

LLAMA_LIKE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
              "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe"}
SUPPORTED = (*LLAMA_LIKE, "GPT2LMHeadModel")
ROPE_TYPES = ("default", "linear", "llama3")
# The transformers class's defaults for the keys a config.json may leave out that differ from Llama's (which the
# reading below falls back to): Mixtral's norm and RoPE base, Mistral's window.
HF_DEFAULTS = {
    "MistralForCausalLM": dict(num_key_value_heads=8, max_position_embeddings=4096 * 32, sliding_window=4096),
    "Qwen2ForCausalLM": dict(num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096),
    "MixtralForCausalLM": dict(num_key_value_heads=8, max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                               rope_theta=1e6),
    "Qwen2MoeForCausalLM": dict(num_key_value_heads=16, max_position_embeddings=32768, sliding_window=4096),
}


def _refuse(key: str, value, why: str):
    raise ConfigError(f"Hugging Face config {key} = {value!r} is not supported: {why}")


def _one_window(hf: dict, types: list, key: str, value) -> int:
    """The window of every layer where `types` (layer_types, or what `key` = `value` makes of them) is one kind;
    shardlm has one attention pattern for every layer."""
    if not set(types) <= {"full_attention", "sliding_attention"}:
        _refuse("layer_types", types, "shardlm has full and sliding-window attention only")
    if len(set(types)) > 1:
        _refuse(key, value, "a sliding window on some layers only (shardlm applies one window to every layer)")
    return (hf["sliding_window"] or 0) if types[0] == "sliding_attention" else 0


def _qwen2_window(hf: dict, moe: bool) -> int:
    """Qwen2 slides a window over the layers from max_window_layers on (or those layer_types names), and only
    with use_sliding_window. Qwen2-MoE's rule is transformers' Qwen2MoeConfig's: every other layer, from the
    first, below max_window_layers (a config.json written without layer_types, as transformers 4 wrote them)."""
    if not (hf.get("use_sliding_window") and hf.get("sliding_window")):
        return 0
    first = hf.get("max_window_layers", 28)  # both configs' default
    slides = (lambda i: i % 2 == 0 and i < first) if moe else (lambda i: i >= first)
    types = hf.get("layer_types") or ["sliding_attention" if slides(i) else "full_attention"
                                      for i in range(hf["num_hidden_layers"])]
    key, value = ("layer_types", types) if hf.get("layer_types") else ("max_window_layers", first)
    return _one_window(hf, types, key, value)


def _mistral_window(hf: dict) -> int:
    """MistralForCausalLM slides every layer; transformers' AutoModel reads a Mistral config.json that has
    layer_types as Ministral's (a window on the sliding_attention layers only): where the two differ, the
    checkpoint's numbers depend on how it is loaded, and it is refused."""
    window = hf.get("sliding_window") or 0
    types = hf.get("layer_types")
    if window and types and _one_window(hf, types, "layer_types", types) != window:  # no window: both read full
        _refuse("layer_types", types, f"with sliding_window = {window or None}, AutoModel (as Ministral) and "
                "MistralForCausalLM compute different attention")
    return window


def model_config_from_hf(hf: dict) -> ModelConfig:
    if not isinstance(hf, dict):  # valid JSON, but a list or a string: not a config at all
        raise ConfigError(f"the Hugging Face config is a JSON {type(hf).__name__}, not an object of keys: it is not a "
                          "config.json (download or save the model again)")
    try:
        cfg = _model_config_from_hf(hf)
    except ConfigError:  # a ValueError too: its own message, not the wrong-type one below
        raise
    except KeyError as e:  # a config.json cut short or written by hand: one line, not a traceback
        raise ConfigError(f"the Hugging Face config lacks {e.args[0]!r}, which its architecture needs: it is not a "
                          "complete config.json (download or save the model again)") from None
    except (TypeError, ValueError) as e:  # "hidden_size": "64", "rope_parameters": [...]: arithmetic on it failed
        raise ConfigError(f"the Hugging Face config holds a value of the wrong type ({e}): fix config.json, or "
                          "download or save the model again") from None
    except ZeroDivisionError:  # the head size is hidden_size // num_attention_heads
        raise ConfigError(f"the Hugging Face config's num_attention_heads = {hf.get('num_attention_heads')!r} must be "
                          "positive: fix config.json, or download or save the model again") from None
    # Every value as the TOML path checks it (ConfigError naming the key): "num_hidden_layers": null or
    # "rms_norm_eps": "x" once reached the model's build and ended there in a traceback.
    typed = Config()
    try:
        apply_overrides(typed, {f"model.{k}": v for k, v in vars(cfg).items()})
    except ConfigError as e:
        raise ConfigError(f"{e} (shardlm's name for the config.json key): fix config.json, or download or save "
                          "the model again") from None
    try:  # what training's validate refuses, refused for inference too (not a traceback in the first forward)
        check_rope_scaling(typed.model.rope_scaling)
    except ConfigError as e:
        raise ConfigError(f"{e}: fix config.json's rope_scaling (or rope_parameters), or download or save the model "
                          "again") from None
    m = typed.model  # as validate refuses them: generate and eval once ended in a traceback building or routing
    for key in (k for k in POSITIVE + NON_NEGATIVE if k.startswith("model.") and ("expert" in k or "moe" in k)):
        value, least = getattr(m, key[len("model."):]), 1 if key in POSITIVE else 0
        if value < least:  # decoder_sparse_step 0: a modulo by zero; shared_expert_intermediate_size -1
            raise ConfigError(f"the Hugging Face config gives {key} = {value} (shardlm's name for the config.json "
                              f"key), below {least}: fix config.json, or download or save the model again")
    if m.num_experts and not 1 <= m.top_k <= m.num_experts:
        raise ConfigError(f"the Hugging Face config's num_experts_per_tok = {m.top_k} must be between 1 and its "
                          f"{m.num_experts} experts: fix config.json, or download or save the model again")
    return typed.model


def _model_config_from_hf(hf: dict) -> ModelConfig:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = archs[0] if archs else {**{v: k for k, v in LLAMA_LIKE.items()}, "gpt2": "GPT2LMHeadModel"}.get(model_type)
    if arch not in SUPPORTED:
        raise ConfigError(f"unsupported Hugging Face architecture {arch or model_type!r}: shardlm builds the decoder-only "
                          f"language models {', '.join(SUPPORTED)}; start from a checkpoint of one of them")
    ours = {**LLAMA_LIKE, "GPT2LMHeadModel": "gpt2"}[arch]
    if archs and model_type and model_type != ours:  # AutoModel builds model_type's class, not architectures'
        _refuse("model_type", model_type, f"architectures names {arch}, whose model_type is {ours!r}: transformers "
                "builds the model_type's class; fix whichever of the two is wrong")
    if arch == "GPT2LMHeadModel":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse("activation_function", act, "GPT-2's MLP here is gelu_new")
        if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn") or not hf.get("scale_attn_weights", True):
            raise ConfigError("GPT-2 attention variants (scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, "
                              "scale_attn_weights=false) are not supported")
        return ModelConfig(arch="gpt2", vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
                           num_heads=hf["n_head"], ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
                           max_seq_len=hf.get("n_positions", 1024), norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                           tie_embeddings=hf.get("tie_word_embeddings", True))
    hf = {**HF_DEFAULTS.get(arch, {}), **hf}
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers' swish is SiLU
        _refuse("hidden_act", hf["hidden_act"], "the MLP is SwiGLU (silu)")
    if arch == "LlamaForCausalLM":  # Mistral and Qwen2 build their linears without these, whatever the config says
        if hf.get("mlp_bias"):
            _refuse("mlp_bias", hf["mlp_bias"], "the MLP has no biases")
        if hf.get("attention_bias"):
            _refuse("attention_bias", hf["attention_bias"],
                    "Llama then adds a bias to o_proj too; shardlm has biases on q, k and v only (Qwen2)")
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = {k: v for k, v in (hf.get(rope_key) or {}).items() if v is not None}  # null: unset, as transformers reads it
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        _refuse(f"{rope_key}.rope_type", kind, f"RoPE scaling is one of {', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse("partial_rotary_factor", partial, "RoPE rotates every dimension of a head")
    if kind == "default":
        rope = {}
    window = 0
    if arch == "MistralForCausalLM":
        window = _mistral_window(hf)
    elif arch == "MixtralForCausalLM":  # every layer slides (it ignores layer_types)
        window = hf.get("sliding_window") or 0
    elif arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        window = _qwen2_window(hf, moe=arch == "Qwen2MoeForCausalLM")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or 0
    if head_dim == hf["hidden_size"] // heads:
        head_dim = 0  # the default; keep configs equal whether or not HF wrote it out
    experts = _experts_from_hf(arch, hf)
    return ModelConfig(
        **experts, arch="llama", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim, ffn_hidden_size=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=rope, tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and hf.get("qkv_bias", True)),
        sliding_window=window)


def _experts_from_hf(arch: str, hf: dict) -> dict:
    """The mixture-of-experts keys of Mixtral's and Qwen2-MoE's configs."""
    if arch == "MixtralForCausalLM":  # router_jitter_noise: transformers jitters in training only (with_init_from)
        return dict(num_experts=hf.get("num_local_experts", 8), top_k=hf.get("num_experts_per_tok", 2))
    if arch != "Qwen2MoeForCausalLM":
        return {}
    step, dense = hf.get("decoder_sparse_step", 1), sorted(hf.get("mlp_only_layers") or [])
    first = len(dense)
    if dense and isinstance(step, int) and step >= 1:  # else refused below as model.moe_every, by value or type
        # shardlm's rule is the first layers dense, then every moe_every-th layer a mixture of experts; what counts
        # is which layers transformers makes sparse (mlp_only_layers = [0] with decoder_sparse_step 2 changes none)
        n = hf["num_hidden_layers"]
        sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        first = next((k for k in [first, *range(n + 1)]
                      if [i for i in range(k, n) if (i + 1) % step == 0] == sparse), None)
        if first is None:
            _refuse("mlp_only_layers", dense, f"with decoder_sparse_step = {step} it leaves layers {sparse} sparse, "
                    "and shardlm's dense layers are the first ones only (then every decoder_sparse_step-th sparse)")
    return dict(num_experts=hf.get("num_experts", 60), top_k=hf.get("num_experts_per_tok", 4),
                moe_ffn_hidden_size=hf.get("moe_intermediate_size", 1408),
                shared_expert_ffn_hidden_size=hf.get("shared_expert_intermediate_size", 5632),
                moe_every=step, moe_first_dense=first, router_renormalize=bool(hf.get("norm_topk_prob", False)))


READ_THE_RUN = "; shardlm generate, eval and serve read the run itself (--model RUN)"


def _hf_moe_class(cfg: ModelConfig) -> str:
    """The HF class that computes this mixture of experts: Mixtral's (every layer, experts of the dense size,
    renormalised softmax top-k, no shared expert, no biases) or Qwen2-MoE's (every other: shared expert, dense layers,
    other expert sizes, qkv biases or none)."""
    if cfg.router_bias_update_rate > 0:
        raise ConfigError(f"model.router_bias_update_rate = {cfg.router_bias_update_rate}: the experts were chosen "
                          "with DeepSeek-V3's selection bias, which Mixtral's and Qwen2-MoE's routers lack (an export "
                          "would route differently; shardlm generate, eval and serve read the bias from the run)")
    if cfg.router_scoring != "softmax":
        raise ConfigError(f"model.router_scoring = {cfg.router_scoring!r} has no Hugging Face class here "
                          f"(Mixtral and Qwen2-MoE score with a softmax){READ_THE_RUN}")
    # What makes it other than Mixtral's, named: the bare refusal left a user to find it among six keys.
    unlike = [f"model.{k} = {v!r}" for k, v, mixtral in (
        ("shared_expert_ffn_hidden_size", cfg.shared_expert_ffn_hidden_size, 0),
        ("router_renormalize", cfg.router_renormalize, True), ("qkv_bias", cfg.qkv_bias, False),
        ("moe_every", cfg.moe_every, 1), ("moe_first_dense", cfg.moe_first_dense, 0),
        ("moe_ffn_hidden_size", cfg.moe_ffn_size, cfg.ffn_size)) if v != mixtral]
    if not unlike:
        return "MixtralForCausalLM"
    # Qwen2-MoE's class computes the rest: any shared expert (0 features adds 0, model/hf.py writes it so), dense
    # layers, other expert sizes, top-k renormalised or not, qkv biases or none (its config's qkv_bias).
    return "Qwen2MoeForCausalLM"


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32", eos_id: int | None = None,
                         bos_id: int | None = None) -> dict:
    """config.json for the HF class that matches these shapes (Qwen2 for qkv biases, Mistral for a window).
    Without a beginning-of-sequence token, its id is the end-of-text's, as GPT-2's."""
    bos_id = eos_id if bos_id is None else bos_id
    if cfg.arch == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
                "n_inner": cfg.ffn_size, "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0,
                "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
                "torch_dtype": dtype}
    if cfg.num_experts:
        arch = _hf_moe_class(cfg)
        model_type = LLAMA_LIKE[arch]
    elif cfg.qkv_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    elif cfg.sliding_window:
        arch, model_type = "MistralForCausalLM", "mistral"
    else:
        arch, model_type = "LlamaForCausalLM", "llama"
    rope = {"rope_type": "default"} if not cfg.rope_scaling else dict(cfg.rope_scaling)
    out = {"architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
           "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
           # transformers >= 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
           "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling or None,
           "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
           "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
           "attention_dropout": 0.0, "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype}
    if model_type == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, sliding_window=cfg.sliding_window
                   or None, router_jitter_noise=0.0, output_router_logits=False)
    if model_type == "qwen2_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_ffn_size,
                   shared_expert_intermediate_size=cfg.shared_expert_ffn_hidden_size, norm_topk_prob=cfg.router_renormalize,
                   decoder_sparse_step=cfg.moe_every, mlp_only_layers=list(range(cfg.moe_first_dense)),
                   qkv_bias=cfg.qkv_bias, output_router_logits=False)
    if model_type in ("qwen2", "qwen2_moe"):
        # Qwen2 slides the layers from max_window_layers on, Qwen2-MoE every other one below it: layer_types,
        # which both read first, says every layer.
        window = cfg.sliding_window or None
        out.update(use_sliding_window=bool(window), sliding_window=window,
                   max_window_layers=0 if window else cfg.num_layers,
                   layer_types=["sliding_attention" if window else "full_attention"] * cfg.num_layers)
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    return out


# A name as from_pretrained takes it (gpt2, meta-llama/...) is no directory here: nothing is fetched.
HUB_HINT = ("; for a Hugging Face Hub model, download its config.json, *.safetensors, tokenizer.json and "
            "tokenizer_config.json into a directory and give that")


def with_init_from(cfg: Config, overrides: dict | None = None) -> Config:
    """`cfg` with the model section of `train.init_from`'s config.json (the `model.*` overrides still win):
    fine-tuning starts from that checkpoint's model, whatever the preset said."""
    import json
    from pathlib import Path
    if not cfg.train.init_from:
        return cfg
    path = Path(cfg.train.init_from) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        run = (path.parent / "state.json").is_file() or (path.parent / "checkpoints").is_dir()
        adapter = path.parent / "adapter_config.json"
        base = json.loads(adapter.read_text()).get("base_model_name_or_path") if adapter.is_file() else None
        fix = (f": it is a shardlm run; continue it with --resume, or start from it after `shardlm export "
               f"--checkpoint {cfg.train.init_from} --out HF_DIR`" if run else
               f": it is a PEFT adapter, not a model; train.init_from takes its base model ("
               f"{base or 'adapter_config.json names none'}), and `generate`/`serve --adapter` take the adapter"
               if adapter.is_file() else
               # A file (model.safetensors, config.json) where transformers' from_pretrained takes its directory.
               f": it is a file; give the directory holding it ({path.parent.parent})" if path.parent.is_file()
               else HUB_HINT if not path.parent.exists() else "")
        raise ConfigError(f"train.init_from = {cfg.train.init_from!r}: no readable Hugging Face config.json "
                          f"({e}){fix}") from None
    try:  # the error names the directory: a preset's or a config's own model keys are not what is refused
        cfg.model, theirs = model_config_from_hf(hf), model_config_from_hf(hf)
    except ConfigError as e:
        raise ConfigError(f"train.init_from = {cfg.train.init_from!r}: {e}") from None
    mixtral = (hf.get("architectures") or [None])[0] == "MixtralForCausalLM" or hf.get("model_type") == "mixtral"
    if mixtral and hf.get("router_jitter_noise"):
        # transformers jitters in training only: generate, eval and serve read such a checkpoint as it does
        raise ConfigError(f"train.init_from = {cfg.train.init_from!r}: Hugging Face config router_jitter_noise = "
                          f"{hf['router_jitter_noise']!r} multiplies each expert layer's input by noise in training "
                          f"(Mixtral's), which shardlm does not: set it to 0 in {path} to fine-tune without it")
    apply_overrides(cfg, {k: v for k, v in (overrides or {}).items() if k.startswith("model.")})
    _refuse_other_weights(cfg.model, theirs, path)
    return cfg


# The keys that change what a model computes from the same weights: a run that overrode one over its base trains
# adapters for that model, which the base's config.json (all a PEFT adapter is applied with) does not give.
MATH_KEYS = ("norm_eps", "rope_theta", "rope_scaling", "sliding_window", "top_k", "router_scoring",
             "router_renormalize")


def changed_from_base(ours: ModelConfig, base: str) -> list[str]:
    """The MATH_KEYS on which `ours` differs from the Hugging Face model in directory `base`, each as "model.KEY
    is A here and B in its config.json"; none where that config cannot be read (the base moved: nothing to compare)."""
    import json
    from pathlib import Path
    try:
        theirs = model_config_from_hf(json.loads((Path(base) / "config.json").read_text()))
    except (OSError, ValueError, ConfigError):
        return []
    return [f"model.{k} is {getattr(ours, k)!r} here and {getattr(theirs, k)!r} in {base}'s config.json"
            for k in MATH_KEYS if getattr(ours, k) != getattr(theirs, k)]


# The keys that fix the weights' shapes or what they mean: an override of one would fail on a tensor's shape while
# the weights load, or load them into another model.
WEIGHT_KEYS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "ffn_hidden_size", "tie_embeddings", "qkv_bias", "num_experts", "moe_ffn_hidden_size",
               "shared_expert_ffn_hidden_size", "moe_every", "moe_first_dense")
# What those whose 0 means a default resolve to: a key is named where both differ (a head_dim written out as its
# default is the same model; a head_dim that follows a changed hidden_size is not the user's to change back).
RESOLVED = {"num_kv_heads": "kv_heads", "head_dim": "head_size", "ffn_hidden_size": "ffn_size",
            "moe_ffn_hidden_size": "moe_ffn_size"}


def _refuse_other_weights(ours: ModelConfig, theirs: ModelConfig, path) -> None:
    keys = WEIGHT_KEYS + (("max_seq_len",) if theirs.arch == "gpt2" else ())  # GPT-2's learned positions
    differ = [(key, getattr(ours, RESOLVED.get(key, key)), getattr(theirs, RESOLVED.get(key, key))) for key in keys
              if getattr(ours, key) != getattr(theirs, key)
              and getattr(ours, RESOLVED.get(key, key)) != getattr(theirs, RESOLVED.get(key, key))
              and not (key == "vocab_size" and ours.vocab_size == 0)]  # 0: the data's, checked against the tokenizer
    if differ:
        raise ConfigError(f"train.init_from = {str(path.parent)!r}: "
                          + "; ".join(f"model.{k} is {a!r} here and {b!r} in {path}" for k, a, b in differ)
                          + ": its weights are of that model; leave the model key(s) out to take config.json's")
