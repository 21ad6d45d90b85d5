"""The refusal of a micro-batch that cannot fit names every figure it adds: `shardlm train moe-1b` on a CPU with
22.9 GiB free was told its micro-batch 'needs about 7.1 GiB for its activations ... and cpu has 22.9 GiB free',
a figure below the memory free (the weights, gradients and AdamW state, 18.2 GiB, made up the rest)."""
import re

import pytest
import torch

from shardlm import memory_check
from shardlm.config import ConfigError, load_config


def test_the_activations_refusal_counts_the_model_state_it_adds(monkeypatch):
    monkeypatch.setattr(memory_check, "free_memory", lambda device: int(22.9 * 2**30))
    with pytest.raises(ConfigError) as e:
        memory_check.check_memory(load_config("moe-1b", {}), torch.device("cpu"), lambda short: short)
    msg = str(e.value)
    act, state, total = (float(x) for x in re.search(
        r"needs about ([\d.]+) GiB for its activations by the planner's count, beside ([\d.]+) GiB for the weights, "
        r"gradients and optimizer state \(([\d.]+) GiB in all\), and cpu has 22.9 GiB free", msg).groups())
    assert act < 22.9 < total and total == pytest.approx(act + state, abs=0.11), msg
    assert "or shard the model (parallel.zero_stage 3, parallel.tp, more ranks)" in msg, msg


def test_activations_beyond_the_memory_alone_say_no_more(monkeypatch):
    monkeypatch.setattr(memory_check, "free_memory", lambda device: 2**30)
    with pytest.raises(ConfigError) as e:
        memory_check.check_memory(load_config("tiny", {"model.max_seq_len": "1000000", "train.seq_len": "1000000"}),
                                  torch.device("cpu"), lambda short: short)
    assert "in all" not in str(e.value) and "shard the model" not in str(e.value), str(e.value)
