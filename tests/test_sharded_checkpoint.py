"""Sharded checkpoints: a save raises no rank's host memory by more than its staging buffer and a tenth of its
own shard, and a pipeline's save takes no longer than twice one process's (the full format gathers the whole
state onto rank 0: the contrast shows the memory measure can fail)."""
import pytest

import dist_fns
from shardlm.testing.distributed import run_distributed

BUFFER_MB = 2
# About 5M parameters (60 MB of fp32 masters and moments): large beside the staging buffer and the noise.
MODEL = {"model.hidden_size": "256", "model.num_layers": "4", "model.ffn_hidden_size": "688",
         "model.vocab_size": "4096", "train.seq_len": "16", "train.checkpoint_buffer_mb": str(BUFFER_MB),
         "train.tensorboard": "false"}


@pytest.mark.parametrize("layout", [{"parallel.pp": "2", "parallel.dp": "1"},
                                    {"parallel.dp": "2", "parallel.zero_stage": "3"}], ids=["pp2", "dp2-zero3"])
def test_a_sharded_save_holds_no_more_than_its_buffer_and_a_tenth_of_its_shard(tmp_path, layout):
    results = run_distributed(dist_fns.save_memory, 2, {**MODEL, **layout}, str(tmp_path / "sharded"), timeout=240)
    for grown, shard, _ in results:
        assert grown <= BUFFER_MB * 2**20 + 0.1 * shard, (grown, shard)
    full = run_distributed(dist_fns.save_memory, 2, {**MODEL, **layout, "train.checkpoint_format": "full"},
                           str(tmp_path / "full"), timeout=240)
    grown, shard, _ = full[0]
    assert grown > BUFFER_MB * 2**20 + 0.1 * shard  # rank 0 gathers every rank's state
    if "parallel.pp" in layout:  # a second of slack: the machine's other work, not the save's
        _, _, alone = dist_fns.save_memory(0, 1, MODEL, str(tmp_path / "one"))
        assert max(seconds for _, _, seconds in results) <= 2 * alone + 1.0
