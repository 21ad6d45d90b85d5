"""Capacity's dropped token copies in the console: a bare count ('dropped 961') summed over the layers and the
steps since the last log gave no scale (of how many copies? a few, or nearly all of them?). Each layer's
routed copies are logged beside its dropped ones, and the console gives the share."""
import dist_fns
from shardlm.metrics import format_line

LINE = {"step": 1, "loss": 6.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mfu": None, "mem_gib": 0.1}


def test_the_console_gives_the_share_of_copies_dropped():
    rec = {**LINE, "moe/layer0/max_over_mean": 1.0, "moe/layer0/dropped": 500, "moe/layer0/routed": 512,
           "moe/layer1/max_over_mean": 1.0, "moe/layer1/dropped": 461, "moe/layer1/routed": 512}
    assert "dropped 961 (93.8%)" in format_line(rec)


def test_a_record_without_routed_copies_still_prints():  # metrics.jsonl written before the key was logged
    rec = {**LINE, "moe/layer0/max_over_mean": 1.0, "moe/layer0/dropped": 5}
    assert format_line(rec).endswith("dropped 5")


def test_the_trainer_logs_the_routed_copies_per_layer(tmp_path):
    over = {"model.num_experts": "4", "model.top_k": "2", "model.capacity_factor": "0.0001", "train.steps": "1"}
    rec = dist_fns.train_and_capture(0, 1, over, str(tmp_path))["moe"][-1]
    for layer in (0, 1):  # capacity 1 per expert per sequence: at most 4 of each sequence's 2 x seq copies kept
        assert rec[f"moe/layer{layer}/routed"] == 8 * 32 * 2
        assert 8 * (32 * 2 - 4) <= rec[f"moe/layer{layer}/dropped"] < rec[f"moe/layer{layer}/routed"]
