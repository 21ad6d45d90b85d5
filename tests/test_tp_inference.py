"""Tensor-parallel inference misused or interrupted (`torchrun ... -m shardlm generate|eval|serve --tp N`): a
degree the model does not fit, ranks that never meet, a peer that dies: each rank stops with one line, never a
shape error blamed on the checkpoint, a silent wait or a traceback."""
from pathlib import Path

import pytest

import dist_fns
from helpers import make_tokenizer


def save_llama(directory: Path, **shape) -> Path:
    """A tiny random HF Llama of `shape` (hidden 64, 4 heads, 2 KV heads, MLP 96 unless given), with a tokenizer."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=300, max_position_embeddings=128)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**cfg, **shape})).save_pretrained(directory)
    make_tokenizer(directory)
    return directory


@pytest.mark.timeout(120)
def test_a_tp_degree_that_does_not_divide_the_mlp_is_refused_on_every_rank(tmp_path):
    """`generate --tp 2` of a model with 97 MLP features: rank 0's slice came out a row longer and it stopped on
    'layers.0.mlp.up.weight has shape (98, 64), the config gives (96, 64)', blamed on the checkpoint, while rank
    1 loaded its slice and went on to wait for it. Every rank now refuses the degree before a weight is read."""
    from shardlm.testing.distributed import run_distributed
    model = save_llama(tmp_path / "hf", intermediate_size=97)
    args = ["generate", "--model", model, "--prompt", "To be", "--max-new-tokens", 2, "--tp", 2]
    got = run_distributed(dist_fns.cli_with_rank_one_given, 2, args, [], timeout=90)
    said = "shardlm generate: error: --tp 2 does not divide the model's 97 MLP hidden features: no --tp above 1 fits"
    assert [status for status, _ in got] == [2, 2], got
    assert all(said in err for _, err in got), got


def test_a_tp_degree_that_does_not_divide_the_heads_names_the_degrees_that_do(tmp_path):
    import dataclasses

    from shardlm.config import ConfigError, load_config
    from shardlm.inference.load import check_tp_degree
    cfg = load_config("tiny").model  # 4 heads, 128 MLP features
    with pytest.raises(ConfigError, match=r"^--tp 3 does not divide the model's 4 attention heads: give --tp 2 or 4$"):
        check_tp_degree(cfg, 3)
    moe = load_config("mixtral-tiny").model  # every MLP a mixture of experts, whole on each rank: no MLP to split
    check_tp_degree(dataclasses.replace(moe, ffn_hidden_size=97), 2)
