"""`shardlm data prepare`: document separators and what a killed run leaves behind."""
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import TEXT, cli_proc
from shardlm.data.loader import TokenShards


def _tokenizer_without_eos(directory):
    """A byte-level BPE whose only special token is none of the end-of-text names shardlm knows, and no
    tokenizer_config.json to name one: a custom tokenizer as a first-time user may have."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["[END]"], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_documents_are_not_run_together_by_a_tokenizer_without_end_of_text(tmp_path, capsys):
    """Three jsonl documents through a tokenizer with no end-of-text token were written back to back with nothing
    between them, and the index still counted 3 documents: training read one text. It is refused, naming the fix;
    once tokenizer_config.json names the token, each document ends with it."""
    tok = _tokenizer_without_eos(tmp_path / "tok")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("first doc.", "second doc.", "third.")))
    r = cli_proc(capsys, "data", "prepare", "--input", docs, "--tokenizer", tok, "--out", tmp_path / "out")
    assert r.returncode == 2 and "no end-of-text token" in r.stderr and "eos_token" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()

    single = tmp_path / "one.txt"  # one document needs no separator
    single.write_text("a single text")
    r = cli_proc(capsys, "data", "prepare", "--input", single, "--tokenizer", tok, "--out", tmp_path / "single")
    assert r.returncode == 0, r.stderr

    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[END]"}))
    r = cli_proc(capsys, "data", "prepare", "--input", docs, "--tokenizer", tok, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    shards = TokenShards(tmp_path / "out")
    ids = np.concatenate([np.asarray(t) for t in shards.tokens])
    end = shards.index["eos_id"]
    assert shards.index["documents"] == 3 and int((ids == end).sum()) == 3 and ids[-1] == end
