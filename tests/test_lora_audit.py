"""First-use faults of LoRA adapters: PEFT adapters this version must refuse, configs, exports."""
import pytest
import torch

from shardlm.config import ConfigError
from shardlm.model.hf import write_hf_dir
from shardlm.parallel.lora import is_adapter_key
from test_lora import lora_model

peft = pytest.importorskip("peft")


def test_an_activated_lora_adapter_from_peft_is_refused_not_applied_as_plain_lora(tmp_path):
    """PEFT's aLoRA (alora_invocation_tokens) adapts only the tokens after its invocation sequence: loaded as
    plain LoRA every token was adapted, logits 0.7 off PeftModel's without a word."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardlm.parallel.lora import read_peft_dir
    cfg, model = lora_model("llama")
    write_hf_dir({k: v.detach() for k, v in model.state_dict().items() if not is_adapter_key(k)}, cfg.model,
                 tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    for extra, words in [({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
                         ({"lora_bias": True}, "lora_bias")]:
        peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **extra))
        peft_model.save_pretrained(tmp_path / words)
        base = peft_model.unload()
        with pytest.raises(ConfigError, match=f"sets {words}, which this version does not load"):
            read_peft_dir(tmp_path / words, cfg.model)
