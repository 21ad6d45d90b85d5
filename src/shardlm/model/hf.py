"""Hugging Face interop: read and write checkpoint directories (config.json, *.safetensors, tokenizer.json)
of LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM and GPT2LMHeadModel.

The mapping is a state-dict adapter in torchtitan's style: names and layouts are translated tensor by
tensor (q/k/v and gate/up are fused here, GPT-2's Conv1D weights are transposed), so no transformers
import is needed to load or save; the tests use transformers as the reference.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..hf_config import hf_config_from_model, model_config_from_hf  # noqa: F401 (re-exported)

def _hf_names(cfg: ModelConfig, i: int) -> dict:
    if cfg.arch == "gpt2":
        p = f"transformer.h.{i}."
        return {"attn_norm": p + "ln_1", "mlp_norm": p + "ln_2", "qkv": p + "attn.c_attn", "out": p + "attn.c_proj",
                "up": p + "mlp.c_fc", "down": p + "mlp.c_proj"}
    p = f"model.layers.{i}."
    return {"attn_norm": p + "input_layernorm", "mlp_norm": p + "post_attention_layernorm",
            "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
            "out": p + "self_attn.o_proj", "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj",
            "down": p + "mlp.down_proj"}


def from_hf_state(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (any prefix convention) -> shardlm's state dict."""
    hf = {k.removeprefix("transformer.") if cfg.arch == "gpt2" else k: v for k, v in hf.items()}
    if cfg.arch == "gpt2":
        hf = {("transformer." + k if not k.startswith("lm_head") else k): v for k, v in hf.items()}
    out: dict[str, torch.Tensor] = {}

    def take(name):
        if name not in hf:
            raise KeyError(f"checkpoint is missing {name}")
        return hf[name]

    if cfg.arch == "gpt2":
        out["embed.weight"] = take("transformer.wte.weight")
        out["pos_embed.weight"] = take("transformer.wpe.weight")
        out["norm.weight"], out["norm.bias"] = take("transformer.ln_f.weight"), take("transformer.ln_f.bias")
    else:
        out["embed.weight"] = take("model.embed_tokens.weight")
        out["norm.weight"] = take("model.norm.weight")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        n, p = _hf_names(cfg, i), f"layers.{i}."
        if cfg.arch == "gpt2":
            for ours in ("attn_norm", "mlp_norm"):
                out[p + ours + ".weight"], out[p + ours + ".bias"] = take(n[ours] + ".weight"), take(n[ours] + ".bias")
            for ours, theirs in (("attn.qkv", "qkv"), ("attn.out", "out"), ("mlp.up", "up"), ("mlp.down", "down")):
                out[p + ours + ".weight"] = take(n[theirs] + ".weight").t().contiguous()  # Conv1D stores [in, out]
                out[p + ours + ".bias"] = take(n[theirs] + ".bias")
            continue
        out[p + "attn_norm.weight"], out[p + "mlp_norm.weight"] = take(n["attn_norm"] + ".weight"), take(n["mlp_norm"] + ".weight")
        out[p + "attn.qkv.weight"] = torch.cat([take(n[x] + ".weight") for x in "qkv"])
        if cfg.qkv_bias:
            out[p + "attn.qkv.bias"] = torch.cat([take(n[x] + ".bias") for x in "qkv"])
        out[p + "attn.out.weight"] = take(n["out"] + ".weight")
        out[p + "mlp.up.weight"] = torch.cat([take(n["gate"] + ".weight"), take(n["up"] + ".weight")])
        out[p + "mlp.down.weight"] = take(n["down"] + ".weight")
    return out


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """shardlm's state dict -> HF tensor names and layouts (the exact inverse of from_hf_state)."""
    out: dict[str, torch.Tensor] = {}
    q, kv = cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    if cfg.arch == "gpt2":
        out["transformer.wte.weight"] = state["embed.weight"]
        out["transformer.wpe.weight"] = state["pos_embed.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["norm.weight"], state["norm.bias"]
    else:
        out["model.embed_tokens.weight"] = state["embed.weight"]
        out["model.norm.weight"] = state["norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        n, p = _hf_names(cfg, i), f"layers.{i}."
        if cfg.arch == "gpt2":
            for ours in ("attn_norm", "mlp_norm"):
                out[n[ours] + ".weight"], out[n[ours] + ".bias"] = state[p + ours + ".weight"], state[p + ours + ".bias"]
            for ours, theirs in (("attn.qkv", "qkv"), ("attn.out", "out"), ("mlp.up", "up"), ("mlp.down", "down")):
                out[n[theirs] + ".weight"] = state[p + ours + ".weight"].t().contiguous()
                out[n[theirs] + ".bias"] = state[p + ours + ".bias"]
            continue
        out[n["attn_norm"] + ".weight"], out[n["mlp_norm"] + ".weight"] = state[p + "attn_norm.weight"], state[p + "mlp_norm.weight"]
        for x, part in zip("qkv", state[p + "attn.qkv.weight"].split([q, kv, kv])):
            out[n[x] + ".weight"] = part.contiguous()
        if cfg.qkv_bias:
            for x, part in zip("qkv", state[p + "attn.qkv.bias"].split([q, kv, kv])):
                out[n[x] + ".bias"] = part.contiguous()
        out[n["out"] + ".weight"] = state[p + "attn.out.weight"]
        gate, up = state[p + "mlp.up.weight"].chunk(2)
        out[n["gate"] + ".weight"], out[n["up"] + ".weight"] = gate.contiguous(), up.contiguous()
        out[n["down"] + ".weight"] = state[p + "mlp.down.weight"]
    return out


def is_hf_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_hf_dir(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json and every *.safetensors shard (an index file, if any, just lists the same shards)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    cfg = model_config_from_hf(json.loads((path / "config.json").read_text()))
    hf = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                hf[k] = st.get_tensor(k)
    return cfg, from_hf_state(hf, cfg)


def write_hf_dir(state: dict[str, torch.Tensor], cfg: ModelConfig, out: str | Path, tokenizer=None,
                 dtype: torch.dtype | None = None) -> None:
    """A directory that transformers' from_pretrained loads: config.json, model.safetensors, tokenizer files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_hf_state(state, cfg)
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    dtype_name = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    save_file({k: v.contiguous() for k, v in hf.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    eos = tokenizer.eos_id if tokenizer is not None else None
    (out / "config.json").write_text(json.dumps(hf_config_from_model(cfg, dtype_name, eos), indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(out)
        if not (out / "tokenizer_config.json").is_file():
            eos_tok = tokenizer.tok.id_to_token(eos) if eos is not None else None
            (out / "tokenizer_config.json").write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_tok, "bos_token": eos_tok,
                 "model_max_length": cfg.max_seq_len}, indent=2) + "\n")
