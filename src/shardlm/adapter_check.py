"""Refusing a LoRA adapter on a model that already carries it: `--adapter` applied twice.

A shardlm LoRA run loads for inference with its adapters merged into the base, so `--adapter` on such a run
(or a merged export of it) added the update a second time: BLEU fell from 63.8 to 0.6 without a word. The
adapters' fingerprint (a hash of their fp32 tensors, computed from the checkpoint) is written into both of a
run's exports (the PEFT adapter's and the merged model's safetensors metadata), so the merged model and its
own adapter are recognised as a pair; an adapter from elsewhere on a merged model stays allowed.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .config import ConfigError

ADAPTER_KEY, MERGED_KEY = "shardlm_adapter", "shardlm_merged_adapter"


def adapter_fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A short hash of the adapters of a full state dict (`*.lora.A.*`/`*.lora.B.*`, by name, as fp32)."""
    h = hashlib.sha256()
    for name in sorted(k for k in state if ".lora." in k):
        h.update(name.encode())
        h.update(state[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _metadata(files) -> dict:
    from safetensors import safe_open
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                out.update(st.metadata() or {})
        except Exception:  # a damaged file is the loader's to report, with its own message
            continue
    return out


def check_adapter_target(model: str | Path, adapter: str | Path) -> None:
    """Raise ConfigError (one line, naming both and the fix) when `adapter` would be applied to a `model` that
    already carries adapters: a shardlm LoRA run or checkpoint (merged on load), or an HF directory exported
    merged from the run this adapter was exported from. `model` is what --model names (an HF directory, a
    shardlm run or checkpoint); `adapter` a PEFT adapter directory."""
    from .checkpoint import read_state
    from .model.hf import is_hf_dir
    model, adapter = Path(model), Path(adapter)
    if not is_hf_dir(model):
        try:
            config = read_state(model)["config"]
        except (OSError, ValueError, KeyError):
            return  # not a run: the loader names what is wrong with it
        lora = config.get("lora") or {}
        if lora.get("rank"):
            base = (config.get("train") or {}).get("init_from") or "the model it was trained from (train.init_from)"
            raise ConfigError(f"--adapter {adapter}: --model {model} is a LoRA run (lora.rank = {lora['rank']}) whose "
                              "adapters are merged into it when it loads, so the adapter would be applied on top "
                              f"(twice, if it is this run's): drop --adapter, or give --model the base, {base}")
        return
    merged = _metadata(sorted(model.glob("*.safetensors"))).get(MERGED_KEY)
    if merged is None:
        return
    mine = _metadata([adapter / "adapter_model.safetensors"]).get(ADAPTER_KEY)
    if mine == merged:
        raise ConfigError(f"--adapter {adapter}: --model {model} is a merged export that already holds this adapter "
                          f"(fingerprint {merged}), so it would be applied twice: drop --adapter, or give --model "
                          "the base model")

