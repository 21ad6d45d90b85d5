"""`shardlm data prepare`: document separators, what a killed run leaves behind, and inputs that are pipes."""
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


@pytest.mark.timeout(120)
def test_a_run_killed_inside_an_empty_out_does_not_block_the_next(tmp_path, capsys):
    """`mkdir out` then a prepare killed outright (the OOM killer, kill -9, a lost node): its scratch directory was
    left inside out, and every later prepare into out was refused, the leftover named as a foreign file ('give a
    new or empty one'). The leftover is removed as those beside --out are, and the run goes on."""
    big = tmp_path / "big.txt"
    big.write_text("the quick brown fox jumps over the lazy dog\n" * 400_000)  # seconds to tokenize
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "data", "prepare", "--input", big, "--tokenizer", "byte",
                             "--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(out.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    if proc.returncode == 0:
        pytest.skip("prepare finished before the signal")
    assert any(out.iterdir())  # what the killed run left

    small = tmp_path / "small.txt"
    small.write_text(TEXT[:500])
    r = cli_proc(capsys, "data", "prepare", "--input", small, "--tokenizer", "byte", "--out", out)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["index.json", "shard_00000.bin", "tokenizer.json"]
    assert TokenShards(out).index["total_tokens"] == 501  # the text and its end-of-text


def test_empty_rows_are_skipped_not_written_as_a_lone_end_of_text(tmp_path, capsys):
    """wikitext exported to jsonl has a third of its rows "": each was written as an end-of-text alone (the
    dataset opened with one, and runs of them were trained on) and counted as a document. They are skipped, and
    the summary says how many."""
    rows = ["", " = Valkyria Chronicles = \n", "", " Senjo no Valkyria 3 .\n", ""]
    docs = tmp_path / "wiki.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    r = cli_proc(capsys, "data", "prepare", "--input", docs, "--tokenizer", "byte", "--out", tmp_path / "out")
    assert r.returncode == 0 and "from 2 documents (3 empty skipped)" in r.stdout, r.stdout + r.stderr
    shards = TokenShards(tmp_path / "out")
    ids = np.concatenate([np.asarray(t) for t in shards.tokens]).tolist()
    eos = shards.index["eos_id"]
    want = [*rows[1].encode(), eos, *rows[3].encode(), eos]  # the byte tokenizer: one id per byte
    assert ids == want and shards.index["documents"] == 2


def test_a_pipe_is_named_as_one_not_as_missing(tmp_path, capsys):
    """`--input <(zcat data.txt.gz)` (and eval's --data, generate's --input) said the pipe "does not exist"
    (no such file), sending the user to look for a path that is there."""
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: nothing may open it, or the command would hang
    for args in (("data", "prepare", "--input", fifo, "--tokenizer", "byte", "--out", tmp_path / "out"),
                 ("eval", "--model", tmp_path, "--data", fifo, "--seq-len", 8),
                 ("eval", "--model", tmp_path, "--tasks", "bleu", "--data", fifo)):
        r = cli_proc(capsys, *args)
        assert r.returncode == 2 and "not a regular file (a pipe" in r.stderr, (args, r.stderr)
        assert "does not exist" not in r.stderr and "no such file" not in r.stderr


def test_an_index_json_of_another_tool_or_a_damaged_one_is_one_line(tmp_path, capsys):
    """LitData's optimize() writes an index.json too: training on its directory asked for a tokenizer.json to be
    copied into it (and, with one, called the index corrupt). A shard's entry edited by hand ended in a
    KeyError's traceback."""
    lit = tmp_path / "lit"
    lit.mkdir()
    (lit / "index.json").write_text(json.dumps({"chunks": [{"chunk_bytes": 100, "filename": "chunk-0-0.bin"}],
                                                "config": {"data_format": ["int"]}}))
    r = cli_proc(capsys, "train", "tiny", "--data.path", lit, "--train.steps", 1, "--out", tmp_path / "run")
    assert r.returncode == 2 and "not the index of a dataset `shardlm data prepare` wrote" in r.stderr, r.stderr

    (tmp_path / "t.txt").write_text(TEXT[:2000])
    data = tmp_path / "data"
    assert cli_proc(capsys, "data", "prepare", "--input", tmp_path / "t.txt", "--tokenizer", "byte",
                    "--out", data).returncode == 0
    index = json.loads((data / "index.json").read_text())
    del index["shards"][0]["crc32"]
    (data / "index.json").write_text(json.dumps(index))
    r = cli_proc(capsys, "train", "tiny", "--data.path", data, "--train.steps", 1, "--out", tmp_path / "run2")
    assert r.returncode == 2 and "index.json is corrupt" in r.stderr and "crc32" in r.stderr, r.stderr


def test_a_mount_point_holding_a_dataset_is_refused_before_tokenizing(tmp_path, capsys, monkeypatch):
    """`--out` a container's volume: the first prepare fills it in place, but the next tokenized its whole input
    and then failed ("Device or resource busy": a mount point cannot be renamed). Refused before any work, the
    old dataset kept; emptied, the volume is filled again."""
    import os
    out = tmp_path / "volume"
    is_mount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.path.realpath(p) == str(out) or is_mount(p))
    (tmp_path / "t.txt").write_text(TEXT[:500])
    args = ("data", "prepare", "--input", tmp_path / "t.txt", "--tokenizer", "byte", "--out", out)
    out.mkdir()
    assert cli_proc(capsys, *args).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = cli_proc(capsys, *args)
    assert r.returncode == 2 and "is a mount point holding a dataset" in r.stderr and "tokenize" not in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    for p in out.iterdir():
        p.unlink()
    assert cli_proc(capsys, *args).returncode == 0 and TokenShards(out).index["total_tokens"] == 501


def test_permission_errors_name_the_input_or_the_out_the_user_gave(tmp_path):
    """An input the user may not read printed the tokenizing bar, then errno's "[Errno 13] Permission denied:
    't.txt'"; an empty --out the user may not write into named the scratch directory made inside it
    ("'.../out/.prepare-tmp-1234-abcd'") where --out beside it is named."""
    import os
    import shutil
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: every file is readable")
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []

    def prepare(source, out):
        return subprocess.run([*prefix, sys.executable, "-m", "shardlm", "data", "prepare", "--input", str(source),
                               "--tokenizer", "byte", "--out", str(out)], capture_output=True, text=True, timeout=100)
    (tmp_path / "t.txt").write_text(TEXT[:500])
    (tmp_path / "locked.txt").write_text(TEXT[:500])
    (tmp_path / "locked.txt").chmod(0)
    r = prepare(tmp_path / "locked.txt", tmp_path / "a")
    assert r.returncode == 2 and r.stderr.strip() == f"shardlm data: error: input {tmp_path / 'locked.txt'} cannot " \
                                                     "be read: Permission denied", r.stderr
    (tmp_path / "readonly").mkdir()
    (tmp_path / "readonly").chmod(0o555)
    r = prepare(tmp_path / "t.txt", tmp_path / "readonly")
    assert r.returncode == 2 and "prepare-tmp" not in r.stderr, r.stderr
    assert f"--out {tmp_path / 'readonly'} cannot be written: Permission denied" in r.stderr, r.stderr


def test_a_quoted_pattern_is_expanded_not_called_unmatched(tmp_path, capsys):
    """`--input 'shards/*.txt'` (quoted, or from a script that runs no shell) reached prepare as written and was
    refused as "a pattern that matched no file" while it matched two. It is expanded, sorted."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "b.txt").write_text("second")
    (tmp_path / "in" / "a.txt").write_text("first")
    r = cli_proc(capsys, "data", "prepare", "--input", tmp_path / "in" / "*.txt", "--tokenizer", "byte",
                 "--out", tmp_path / "out")
    assert r.returncode == 0 and "from 2 documents" in r.stdout, r.stderr
    ids = np.concatenate([np.asarray(t) for t in TokenShards(tmp_path / "out").tokens]).tolist()
    assert ids == [*b"first", 256, *b"second", 256]
    r = cli_proc(capsys, "data", "prepare", "--input", tmp_path / "in" / "*.md", "--tokenizer", "byte",
                 "--out", tmp_path / "out2")
    assert r.returncode == 2 and "a pattern that matched no file" in r.stderr


def test_empty_answers_are_refused_when_every_one_is_and_counted_when_some_are(tmp_path, capsys):
    """A completion of "" trains only the end-of-text after the prompt: the example still had a trained token, so a
    file whose every answer was empty (a conversion that read another field) prepared without a word and trained a
    model to stop at once. All empty is refused; some are counted, the first named."""
    def prepare(name, records):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return cli_proc(capsys, "data", "prepare", "--input", path, "--tokenizer", "byte", "--out", tmp_path / name)

    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}
    r = prepare("none", [{"prompt": "What is 2+2?", "completion": ""}, chat])
    assert r.returncode == 2 and "every one of the 2 examples has an empty answer" in r.stderr, r.stderr
    assert not (tmp_path / "none").exists()
    r = prepare("some", [{"prompt": "What is 2+2?", "completion": "4"}, {"prompt": "Name a colour.", "completion": ""}])
    assert r.returncode == 0 and ", 1 with an empty answer (the first: " in r.stdout, r.stdout
    assert r.stdout.split("the first: ")[1].startswith(f"{tmp_path / 'some.jsonl'}:2)"), r.stdout
    r = prepare("full", [{"prompt": "What is 2+2?", "completion": "4"}])
    assert r.returncode == 0 and "empty answer" not in r.stdout + r.stderr


def _word_level(directory, vocab):
    """A word-level tokenizer without its unk_token in the vocabulary: any other word fails to encode."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return directory


def test_a_text_the_tokenizer_cannot_encode_is_one_line(tmp_path, capsys):
    """The tokenizers library raises a bare Exception for a word its WordLevel model cannot map (no unk_token in
    the vocabulary): prepare (and every command that encodes) ended in its traceback."""
    tok = _word_level(tmp_path / "tok", {"a": 0, "hello": 1, "world": 2, "</s>": 3})
    (tmp_path / "ok.txt").write_text("hello world a")
    (tmp_path / "bad.txt").write_text("hello there")
    assert cli_proc(capsys, "data", "prepare", "--input", tmp_path / "ok.txt", "--tokenizer", tok, "--out",
                    tmp_path / "ok").returncode == 0
    r = cli_proc(capsys, "data", "prepare", "--input", tmp_path / "bad.txt", "--tokenizer", tok, "--out",
                 tmp_path / "bad")
    assert r.returncode == 2 and "cannot encode this text (WordLevel error: Missing [UNK] token" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()


def test_an_end_of_text_named_only_in_special_tokens_map_json_is_transformers_one(tmp_path):
    """Older Hub checkpoints name their special tokens in special_tokens_map.json alone: shardlm read
    tokenizer_config.json only and took the first usual end-of-text name the vocabulary holds (<|endoftext|>),
    where transformers takes the map's (<|im_end|>, over a config without added_tokens_decoder's too): documents
    separated, and generation stopped, elsewhere."""
    from transformers import AutoTokenizer

    from shardlm.tokenizer import load_tokenizer
    tok = _word_level(tmp_path / "tok", {"a": 0, "<|endoftext|>": 1, "<|im_end|>": 2, "[UNK]": 3})
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (tok / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert load_tokenizer(tok).eos_id == AutoTokenizer.from_pretrained(tok).eos_token_id == 2
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))  # the map wins there too
    assert load_tokenizer(tok).eos_id == AutoTokenizer.from_pretrained(tok).eos_token_id == 2
    (tok / "special_tokens_map.json").write_text(json.dumps({"pad_token": "a"}))  # silent on eos: the config's
    assert load_tokenizer(tok).eos_id == AutoTokenizer.from_pretrained(tok).eos_token_id == 1
    # a config of transformers >= 4.34 (its added_tokens_decoder) is read alone, the map left as it is
    (tok / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "added_tokens_decoder": {
        "1": {"content": "<|endoftext|>", "special": True}, "2": {"content": "<|im_end|>", "special": True}}}))
    assert load_tokenizer(tok).eos_id == AutoTokenizer.from_pretrained(tok).eos_token_id == 1
