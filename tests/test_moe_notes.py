"""Notes before a mixture of experts trains, for settings that run but not as their user likely meant:
a capacity below a balanced load drops copies however evenly the router spreads them (a capacity_factor of
1e-4 dropped 94% of them without a word before the first log line), and parallel.ep_dispatch = 'padded' is
not what training's capacity routing sends."""
from helpers import cli_proc
from shardlm.config import load_config
from shardlm.config.expert_checks import moe_notes

MOE = {"model.num_experts": "4", "model.top_k": "2"}


def test_a_capacity_below_a_balanced_load_says_how_much_it_must_drop():
    # seq 32, top-2 of 4: a balanced load is 16 copies per expert per sequence, capacity ceil(1e-4 x 16) = 1
    notes = moe_notes(load_config("tiny", {**MOE, "model.capacity_factor": "0.0001"}))
    assert any("model.capacity_factor = 0.0001 lets each expert take 1 token copy per sequence of the 16 a "
               "balanced load gives it: at least 93.8% of the copies are dropped in training" in n for n in notes), notes
    half = moe_notes(load_config("tiny", {**MOE, "model.capacity_factor": "0.5"}))
    assert any("take 8 token copies per sequence of the 16" in n and "at least 50.0%" in n for n in half), half


def test_a_capacity_of_a_balanced_load_or_more_says_nothing():
    for factor in ("0", "1.0", "1.25", "1e30"):
        assert not moe_notes(load_config("tiny", {**MOE, "model.capacity_factor": factor})), factor


def test_padded_dispatch_under_capacity_says_training_sends_exact_counts():
    cfg = load_config("tiny", {**MOE, "model.capacity_factor": "1.0", "parallel.dp": "2", "parallel.ep": "2",
                               "parallel.ep_dispatch": "padded"})
    assert any("parallel.ep_dispatch = 'padded' with model.capacity_factor = 1.0: training sends the copies capacity "
               "keeps by their exact counts" in n for n in moe_notes(cfg))
    assert not moe_notes(load_config("tiny", {**MOE, "parallel.dp": "2", "parallel.ep": "2",
                                               "parallel.ep_dispatch": "padded"}))


def test_the_trainer_prints_them(capsys, tmp_path):
    proc = cli_proc(capsys, "train", "mixtral-tiny", "--train.tensorboard", "false", "--train.sample_tokens", "0",
                    "--train.steps", "1", "--model.capacity_factor", "0.0001", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "at least 93.8% of the copies are dropped in training" in proc.stdout + proc.stderr


def test_capacity_routing_under_ring_attention_says_its_ranks_attend_unevenly():
    """It keeps each rank's slice contiguous (not zig-zag) without a word: attention up to twice as long."""
    ring = {**MOE, "model.capacity_factor": "1.25", "parallel.cp": "2", "parallel.cp_comm": "p2p"}
    assert any("keeps each rank's slice of a sequence contiguous" in n for n in moe_notes(load_config("tiny", ring)))
    for other in ({"parallel.cp_comm": "a2a"}, {"model.capacity_factor": "0"}):
        assert not moe_notes(load_config("tiny", {**ring, **other})), other
