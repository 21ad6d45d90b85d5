"""First-use faults of LoRA adapters: PEFT adapters this version must refuse, configs, exports."""
import pytest
import torch

from helpers import make_tokenizer
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


def test_a_pissa_adapter_is_refused_and_its_converted_save_loads_equal_to_peft(tmp_path):
    """PiSSA (and OLoRA, CorDA, LoftQ, LoRA-GA) subtract the initial B A from the base, which PeftModel
    recomputes on loading: applied to the base as plain LoRA, logits 0.14 off PeftModel's without a word."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardlm.inference.load import load_pretrained
    from shardlm.parallel.lora import read_peft_dir
    cfg, model = lora_model("llama")
    write_hf_dir({k: v.detach() for k, v in model.state_dict().items() if not is_adapter_key(k)}, cfg.model,
                 tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                 init_lora_weights="pissa"))
    peft_model.save_pretrained(tmp_path / "initial")
    with torch.no_grad():  # "training"
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p), alpha=0.1)
    peft_model.save_pretrained(tmp_path / "pissa")
    with pytest.raises(ConfigError, match="sets init_lora_weights = 'pissa'.*path_initial_model_for_weight_conversion"):
        read_peft_dir(tmp_path / "pissa", cfg.model)
    peft_model.save_pretrained(tmp_path / "plain", path_initial_model_for_weight_conversion=tmp_path / "initial")
    ids = torch.randint(0, cfg.model.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        theirs = PeftModel.from_pretrained(fresh, tmp_path / "pissa").eval()(input_ids=ids).logits
        make_tokenizer(tmp_path / "base", cfg.model.vocab_size)  # the loader wants one; the logits do not
        ours = load_pretrained(tmp_path / "base", dtype="fp32", adapter=tmp_path / "plain")[0](ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lost", ["lora_A", "lora_B"])
def test_an_adapter_file_missing_half_of_a_pair_is_refused_naming_it(tmp_path, lost):
    """A lone lora_A ended in KeyError('layers.0.attn.qkv.lora.B.q_proj'); a lone lora_B was dropped, the
    adapter applied without it."""
    from safetensors.torch import load_file, save_file

    from shardlm.parallel.lora import read_peft_dir, write_peft_dir
    cfg, model = lora_model("llama")
    write_peft_dir(model.state_dict(), cfg.model, cfg.lora, tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    del tensors[f"base_model.model.model.layers.1.self_attn.q_proj.{lost}.weight"]
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    have = {"lora_A": "lora_B", "lora_B": "lora_A"}[lost]
    with pytest.raises(ConfigError, match=rf"layers.1.self_attn.q_proj has its {have} but no {lost}"):
        read_peft_dir(tmp_path, cfg.model)


def test_lora_without_init_from_says_the_base_is_random_when_training_and_exporting(tmp_path, capsys):
    """`train --lora.rank 8` without train.init_from trained adapters over a frozen random base unsaid, and its
    export wrote an adapter of a base no command writes (base_model_name_or_path null) as any other."""
    from helpers import cli_here
    run = tmp_path / "run"
    out = cli_here(capsys, "train", "tiny", "--train.steps", "1", "--lora.rank", "4", "--train.sample_tokens", "0",
                   "--out", run)
    assert "LoRA rank 4 over a random base, frozen (no train.init_from to fine-tune)" in out
    out = cli_here(capsys, "export", "--checkpoint", run, "--out", tmp_path / "adapter")
    assert "of this run's random base, no train.init_from: only --merge writes that" in out


def test_an_adapter_whose_r_is_not_its_tensors_rank_is_named_as_such_not_as_another_models(tmp_path):
    """r = 8 in adapter_config.json over rank-4 tensors was reported as an adapter of another model
    ("use the adapter trained on this --model's base"), which it is not."""
    import json

    from shardlm.parallel.lora import read_peft_dir, write_peft_dir
    cfg, model = lora_model("llama")
    write_peft_dir(model.state_dict(), cfg.model, cfg.lora, tmp_path)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**conf, "r": 8}))
    with pytest.raises(ConfigError, match=r"gives r = 8, but its \w+ adapter of layer \d has rank 4") as e:
        read_peft_dir(tmp_path, cfg.model)
    assert "this --model's base" not in str(e.value)


def test_an_adapter_config_that_is_not_a_json_object_is_refused_naming_it(tmp_path):
    from shardlm.parallel.lora import read_peft_dir, write_peft_dir
    cfg, model = lora_model("llama")
    write_peft_dir(model.state_dict(), cfg.model, cfg.lora, tmp_path)
    (tmp_path / "adapter_config.json").write_text("[]")
    with pytest.raises(ConfigError, match="adapter_config.json holds list, not a JSON object"):
        read_peft_dir(tmp_path, cfg.model)


def test_an_adapter_file_with_no_tensors_is_refused_not_served_as_the_base(tmp_path):
    from safetensors.torch import save_file

    from shardlm.parallel.lora import read_peft_dir, write_peft_dir
    cfg, model = lora_model("llama")
    write_peft_dir(model.state_dict(), cfg.model, cfg.lora, tmp_path)
    save_file({}, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="holds no adapter tensors"):
        read_peft_dir(tmp_path, cfg.model)


@pytest.mark.parametrize("arch, sp", [("llama", False), ("llama", True), ("gpt2", True)],
                         ids=["llama-tp2", "llama-tp2-sp", "gpt2-tp2-sp"])
def test_lora_dropout_under_tensor_parallelism_draws_one_process_masks(arch, sp):
    """lora.dropout > 0 at tp 2: each rank drew the mask of its slice of a row-parallel layer's input (o_proj,
    down_proj, GPT-2's c_proj) over the slice alone, no slice of one process's mask, and its generator fell out
    of step with one process's, so the column-parallel layers' masks differed from there on too."""
    import dist_fns
    from shardlm.testing.distributed import run_distributed
    from test_lora import LORA, TARGETS
    from test_tensor_parallel import MODELS, check_equal
    over = {**MODELS[arch], **LORA, "lora.targets": TARGETS[arch], "lora.dropout": "0.3", "parallel.tp": "2",
            "parallel.dp": "1", "parallel.sp": str(sp).lower()}
    one = {**over, "train.device": "cpu", "parallel.tp": "1", "parallel.sp": "false"}
    ref = dist_fns.train_and_capture(0, 1, one)
    assert ref["grad_norms"] != dist_fns.train_and_capture(0, 1, {**one, "lora.dropout": "0"})["grad_norms"]
    check_equal(run_distributed(dist_fns.train_and_capture, 2, over, timeout=240), ref)


def _peft_model(cfg, model, tmp_path, **config):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    if not (tmp_path / "base").exists():
        write_hf_dir({k: v.detach() for k, v in model.state_dict().items() if not is_adapter_key(k)}, cfg.model,
                     tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), **config)


def test_a_pickled_peft_adapter_is_refused_saying_how_to_convert_it(tmp_path):
    """PEFT's adapter_model.bin (save_pretrained(..., safe_serialization=False), older PEFT's default) was
    refused with "No such file or directory" of the adapter_model.safetensors it lacks, and no more."""
    from peft import PeftModel

    from shardlm.parallel.lora import read_peft_dir
    cfg, model = lora_model("llama")
    _peft_model(cfg, model, tmp_path).save_pretrained(tmp_path / "old", safe_serialization=False)
    assert (tmp_path / "old" / "adapter_model.bin").is_file()
    with pytest.raises(ConfigError, match=r"it holds adapter_model.bin, PEFT's older pickle format, and shardlm reads "
                                          r"safetensors only: .*save_pretrained\(OUT, safe_serialization=True\)"):
        read_peft_dir(tmp_path / "old", cfg.model)
    base = _peft_model(cfg, model, tmp_path).unload()
    PeftModel.from_pretrained(base, tmp_path / "old").save_pretrained(tmp_path / "new", safe_serialization=True)
    read_peft_dir(tmp_path / "new", cfg.model)  # the conversion named


def test_a_folder_of_named_peft_adapters_is_refused_naming_the_subfolders_that_hold_one(tmp_path):
    """PEFT saves each adapter of a model but the "default" one under DIR/NAME: DIR was refused with "No such
    file or directory" of DIR/adapter_config.json, not naming where the adapters are."""
    from peft import LoraConfig

    from shardlm.parallel.lora import read_peft_dir
    cfg, model = lora_model("llama")
    peft_model = _peft_model(cfg, model, tmp_path, adapter_name="math")
    peft_model.add_adapter("code", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "both")
    (tmp_path / "both" / "logs").mkdir()
    with pytest.raises(ConfigError, match=r"it holds no adapter itself, its subfolders code, math do: give that "
                                          r"folder, e.g. .*both/code$"):
        read_peft_dir(tmp_path / "both", cfg.model)
    peft_model.save_pretrained(tmp_path / "one", selected_adapters=["code"])
    with pytest.raises(ConfigError, match=r"its subfolder code does: give that folder, e.g. .*one/code$"):
        read_peft_dir(tmp_path / "one", cfg.model)
    read_peft_dir(tmp_path / "both" / "code", cfg.model)
