"""Instruction data's loss mask and the held-out split: what a run trains on and evaluates on is what the user
asked for, or the run says why not."""

import numpy as np
import pytest

from helpers import bracket_chat_tokenizer, write_jsonl
from shardlm.data.loader import TokenShards
from shardlm.data.prepare import prepare


def masked_text(out):
    """The prepared byte-tokenizer dataset as text, end-of-text as '#' and untrained tokens as '.'."""
    shards = TokenShards(out)
    ids = np.concatenate([np.asarray(t) for t in shards.tokens]).astype(np.int64)
    mask = np.concatenate([np.asarray(m) for m in shards.masks]).astype(bool)
    return "".join(("#" if i == 256 else chr(i)) if m else "." for i, m in zip(ids, mask))


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "bye"}]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("template", [False, True], ids=["plain", "template"])
def test_a_conversation_ending_in_a_users_turn_trains_no_end_of_text_after_it(tmp_path, template):
    """A chat whose last turn is the user's: the end-of-text closing the example only separates it from the
    next; trained, the model learned to end a text right after a user's message. The answer before it is
    still trained, and an example ending in an answer still trains the end-of-text that closes it."""
    tok = bracket_chat_tokenizer(tmp_path / "tok") if template else "byte"
    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    prepare([data], str(tok), tmp_path / "out", pad_to=40 if template else None, progress=False)
    trained = [run for run in masked_text(tmp_path / "out").split(".") if run]
    # the first chat's answer alone (no end-of-text after 'bye'), then the second's answer and its end
    assert trained == (["yo#", "yo#"] if template else ["yo\n", "yo\n#"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eval_is", ["same", "copy"])
def test_an_eval_path_holding_the_training_data_is_refused(tmp_path, eval_is):
    """data.eval_path naming data.path (or a copy of it) made the 'held-out' eval loss the loss on the very
    windows trained on, reported as eval with no word; refused naming both, while other text is taken."""
    import shutil

    from shardlm.data.loader import DataError, open_train_data
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "b.txt").write_text("pack my box with five dozen liquor jugs! " * 40)
    prepare([tmp_path / "a.txt"], "byte", tmp_path / "train", progress=False)
    prepare([tmp_path / "b.txt"], "byte", tmp_path / "held", progress=False)
    if eval_is == "copy":
        shutil.copytree(tmp_path / "train", tmp_path / "copy")
    args = dict(eval_windows=4, seq_len=16, model_vocab=257, seed=0, global_batch=4, micro_batch=4)
    with pytest.raises(DataError, match=r"data.eval_path .* holds the training data's tokens.*data.path"):
        open_train_data(tmp_path / "train", tmp_path / ("train" if eval_is == "same" else "copy"), **args)
    data = open_train_data(tmp_path / "train", tmp_path / "held", **args)
    assert len(data.eval_range) == len(data.eval) > 0


@pytest.mark.timeout(60)
def test_packed_eval_examples_beside_training_data_that_is_not_packed_are_refused(tmp_path):
    """The mask that keeps packed examples apart follows data.path: eval examples packed (no --pad-to) beside
    padded training examples were scored attending across examples, their eval loss no example's own. Refused,
    naming how data.path was prepared; packed beside packed, and padded eval data, are taken."""
    from shardlm.data.loader import DataError, open_train_data
    records = [{"prompt": f"question {i}?", "completion": f"answer {i}."} for i in range(40)]
    data = write_jsonl(tmp_path / "c.jsonl", records)
    for name, pad in (("padded", 32), ("packed", None)):
        prepare([data], "byte", tmp_path / name, pad_to=pad, progress=False)
    args = dict(eval_windows=4, seq_len=32, model_vocab=257, seed=0, global_batch=4, micro_batch=4)
    with pytest.raises(DataError, match=r"data.eval_path .*packed.* data.path .*padded was prepared with --pad-to 32"):
        open_train_data(tmp_path / "padded", tmp_path / "packed", **args)
    prepare([write_jsonl(tmp_path / "d.jsonl", records[::-1])], "byte", tmp_path / "other", progress=False)
    open_train_data(tmp_path / "packed", tmp_path / "other", **args)
    open_train_data(tmp_path / "packed", tmp_path / "padded", **args)


@pytest.mark.timeout(120)
def test_a_run_longer_than_one_pass_over_its_data_is_said(tmp_path, capsys):
    """20 steps of 8 windows over 10 windows read each about 16 times, with no word (only a batch larger than
    the data was said). Said with the step count of one pass; a run within one pass says nothing of it."""
    from shardlm.cli import main
    (tmp_path / "a.txt").write_text("hello world " * 30)  # 361 tokens: 11 windows of 32, one held out
    assert main(["data", "prepare", "--input", str(tmp_path / "a.txt"), "--tokenizer", "byte",
                 "--out", str(tmp_path / "d")]) == 0
    for steps, said in ((3, True), (1, False)):
        capsys.readouterr()
        assert main(["train", "tiny", "--data.path", str(tmp_path / "d"), "--train.steps", str(steps),
                     "--train.warmup_steps", "0", "--train.save_every", "0", "--out", str(tmp_path / "run"),
                     "--overwrite"]) == 0
        out = capsys.readouterr().out
        assert (f"note: {steps} steps of 8 windows read 24, 2.4 passes over {tmp_path / 'd'}'s 10 training windows "
                "(reshuffled each pass): train.steps = 1 is one pass" in out) == said, out
        assert said or "passes over" not in out


def test_a_large_datasets_check_at_start_is_said(monkeypatch):
    """Every rank reads every token shard once at start (their CRC32s): minutes on hundreds of GB, which a run
    spent silent. Past SAID_BYTES (runtime/said.py) the main rank says so, and how long it took."""
    import shardlm.runtime.said as said_module
    import shardlm.trainer as trainer
    from shardlm.config import load_config
    from shardlm.data.loader import data_bytes
    said = []
    monkeypatch.setattr(said_module, "SAID_BYTES", 0)
    t = trainer.Trainer(load_config("tiny", {"train.tensorboard": "false"}), log=said.append)
    size = data_bytes(t.data_dir)
    assert size > 0 and f"checking the CRC32 of {size / 1e9:,.1f} GB of token shards on each rank" in "\n".join(said)
    assert any(line.startswith("checked in ") for line in said)
