"""Fine-tuning from a Hugging Face checkpoint (`train.init_from`): its config.json gives the model section, its
weights the start, under any layout, with or without LoRA."""
import pytest
import torch

import dist_fns
from helpers import run_cli
from shardlm.config import ConfigError, load_config
from shardlm.hf_config import with_init_from
from shardlm.model import Decoder
from shardlm.model.hf import read_hf_dir, write_hf_dir
from shardlm.testing.distributed import run_distributed


def hf_dir(tmp_path, **model):
    """A random model of `tiny`'s family (with `model` changed) written as an HF directory."""
    cfg = load_config("tiny", {f"model.{k}": str(v) for k, v in model.items()})
    m = Decoder(cfg.model)
    m.init_weights(seed=7)
    with torch.no_grad():  # norms away from their initial ones, so that loading them is seen
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    write_hf_dir(m.state_dict(), cfg.model, tmp_path / "hf")
    return tmp_path / "hf", m.state_dict()


@pytest.mark.parametrize("layout", [{"parallel.dp": "1"}, {"parallel.tp": "2", "parallel.dp": "1"},
                                    {"parallel.pp": "2", "parallel.dp": "1"}], ids=["one", "tp2", "pp2"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_training_starts_from_the_checkpoints_weights(tmp_path, layout, lora):
    """With lr 0 the weights after a step are the checkpoint's, on every layout."""
    path, want = hf_dir(tmp_path)
    over = {"train.init_from": str(path), "train.lr": "0", "train.steps": "1", "train.warmup_steps": "0",
            "train.weight_decay": "0", **layout, **({"lora.rank": "4"} if lora else {})}
    world = int(layout.get("parallel.tp", 1)) * int(layout.get("parallel.pp", 1))
    results = run_distributed(dist_fns.train_and_capture, world, over, timeout=240) if world > 1 else \
        [dist_fns.train_and_capture(0, 1, {**over, "train.device": "cpu"})]
    masters = next(r["masters"] for r in results if r["masters"] is not None)
    for name, value in want.items():
        torch.testing.assert_close(masters[name], value, rtol=0, atol=0, msg=name)


def test_the_model_section_comes_from_the_checkpoint(tmp_path):
    path, want = hf_dir(tmp_path, num_layers=3, hidden_size=48, num_heads=6, num_kv_heads=3)
    cfg = with_init_from(load_config("tiny", {"train.init_from": str(path), "model.max_seq_len": "64"}),
                         {"model.max_seq_len": "64"})
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.kv_heads, cfg.model.max_seq_len) == (3, 48, 3, 64)
    run_cli("train", "tiny", "--train.init_from", path, "--train.steps", "2", "--lora.rank", "4",
            "--out", tmp_path / "run")
    state = read_hf_dir(path)[1]
    from shardlm.checkpoint import load_checkpoint
    saved = load_checkpoint(tmp_path / "run", with_optimizer=False)["model"]
    for name, value in state.items():  # the frozen base, as loaded
        assert torch.equal(saved[name], value), name


def test_a_missing_checkpoint_fails_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="train.init_from = .*nowhere.*config.json"):
        with_init_from(load_config("tiny", {"train.init_from": str(tmp_path / "nowhere")}))
