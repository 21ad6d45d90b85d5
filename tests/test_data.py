"""Token shards: formats, dtypes, streaming, integrity errors, and the layout-independent sampler."""
import json
import os
import re

import numpy as np
import pytest

from helpers import TEXT, make_tokenizer, run_cli, write_jsonl
from shardlm.data.loader import DataError, GlobalSampler, TokenShards, WindowDataset, open_train_data
from shardlm.data.prepare import HEADER_BYTES, prepare
from shardlm.tokenizer import load_tokenizer


def _inputs(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT[:2000])
    with open(tmp_path / "b.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"document {i}: " + TEXT[i * 100:(i + 1) * 100], "id": i}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": [TEXT[:300], "short row"]}), tmp_path / "c.parquet")
    return [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"]


def test_prepare_txt_jsonl_parquet_in_order(tmp_path):
    inputs = _inputs(tmp_path)
    index = prepare(inputs, "byte", tmp_path / "out", shard_tokens=1024, progress=False)
    assert index["dtype"] == "uint16" and index["documents"] == 1 + 5 + 2
    assert len(index["shards"]) > 1  # rolled over at 1024 tokens
    shards = TokenShards(tmp_path / "out", model_vocab=257)
    stream = np.concatenate([np.asarray(t) for t in shards.tokens])
    docs = [TEXT[:2000]] + [f"document {i}: " + TEXT[i * 100:(i + 1) * 100] for i in range(5)] + [TEXT[:300], "short row"]
    expected = []
    for d in docs:
        expected += list(d.encode()) + [256]
    assert stream.tolist() == expected
    assert load_tokenizer(tmp_path / "out").vocab_size == 257


def test_a_utf8_byte_order_mark_opening_a_file_is_no_text(tmp_path):
    """Windows editors open UTF-8 files with U+FEFF: a jsonl (instruction or text) failed on line 1 with "Unexpected
    UTF-8 BOM", and a text file trained the mark's bytes as its first token."""
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + b"hi\r\n")
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "yo"}\r\n')
    (tmp_path / "c.jsonl").write_bytes(bom + b'{"prompt": "q", "completion": "a"}\r\n')
    prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], "byte", tmp_path / "out", progress=False)
    assert np.asarray(TokenShards(tmp_path / "out").tokens[0]).tolist() == list(b"hi\r\n") + [256] + list(b"yo") + [256]
    index = prepare([tmp_path / "c.jsonl"], "byte", tmp_path / "out2", progress=False)
    assert index["examples"] == 1 and np.asarray(TokenShards(tmp_path / "out2").tokens[0]).tolist() == \
        list(b"qa") + [256]


def test_large_vocab_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(70000)}
    vocab["[UNK]"] = 70000
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("w1 w69999 w5 nothing")
    index = prepare([tmp_path / "in.txt"], tmp_path / "tokenizer.json", tmp_path / "out", progress=False)
    assert index["dtype"] == "uint32"
    shards = TokenShards(tmp_path / "out", model_vocab=70001)
    assert np.asarray(shards.tokens[0]).tolist() == [1, 69999, 5, 70000]


@pytest.mark.timeout(60)
def test_ids_past_the_token_count_use_uint32(tmp_path):
    """A tokenizer of 4 tokens whose end-of-text is id 70000: uint16 shards wrapped it to 4464, unnoticed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "[UNK]": 2, "<|endoftext|>": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("a b a")
    index = prepare([tmp_path / "in.txt"], tmp_path / "tokenizer.json", tmp_path / "out", progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] == 70001 and index["eos_id"] == 70000
    shards = TokenShards(tmp_path / "out", model_vocab=70001)
    assert np.asarray(shards.tokens[0]).tolist() == [0, 1, 0, 70000]


def test_hf_tokenizer_directory(tmp_path):
    make_tokenizer(tmp_path / "tok")
    (tmp_path / "in.txt").write_text(TEXT[:500])
    index = prepare([tmp_path / "in.txt"], tmp_path / "tok", tmp_path / "out", progress=False)
    tok = load_tokenizer(tmp_path / "tok")
    shards = TokenShards(tmp_path / "out", model_vocab=tok.vocab_size)
    assert np.asarray(shards.tokens[0]).tolist() == tok.encode(TEXT[:500]) + [tok.eos_id]
    assert index["eos_id"] == tok.eos_id


def test_big_text_file_streams_as_one_document(tmp_path, monkeypatch):
    import shardlm.data.prepare as prep
    monkeypatch.setattr(prep, "CHUNK_CHARS", 64)  # force many pieces
    body = "".join(f"line {i}\n" for i in range(400))
    (tmp_path / "big.txt").write_text(body)
    index = prepare([tmp_path / "big.txt"], "byte", tmp_path / "out", progress=False)
    assert index["documents"] == 1
    stream = np.asarray(TokenShards(tmp_path / "out").tokens[0]).tolist()
    assert stream == list(body.encode()) + [256]


def test_truncated_and_corrupt_shards_are_named(tmp_path):
    (tmp_path / "in.txt").write_text(TEXT[:3000])
    prepare([tmp_path / "in.txt"], "byte", tmp_path / "out", progress=False)
    shard = tmp_path / "out" / "shard_00000.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES + 100] ^= 0x01  # flip one bit inside the tokens
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard_00000.bin is corrupt"):
        TokenShards(tmp_path / "out")
    shard.write_bytes(bytes(data[:-7]))
    with pytest.raises(DataError, match="shard_00000.bin is truncated"):
        TokenShards(tmp_path / "out")
    shard.unlink()
    with pytest.raises(DataError, match="shard_00000.bin is missing"):
        TokenShards(tmp_path / "out")


def test_token_ids_beyond_the_model_vocab_are_refused(tmp_path):
    (tmp_path / "in.txt").write_text("abc")
    prepare([tmp_path / "in.txt"], "byte", tmp_path / "out", progress=False)
    with pytest.raises(DataError, match="token id 256 >= the model's vocab_size 200"):
        TokenShards(tmp_path / "out", model_vocab=200)


def test_sample_order_is_independent_of_dp(tmp_path):
    (tmp_path / "in.txt").write_text(TEXT * 2)
    prepare([tmp_path / "in.txt"], "byte", tmp_path / "out", progress=False)
    args = dict(path=tmp_path / "out", eval_path=None, eval_windows=4, seq_len=16, model_vocab=257, seed=5,
                global_batch=8)
    one = open_train_data(**args, micro_batch=8)
    for dp, micro in ((2, 2), (4, 1), (2, 4)):
        ranks = [open_train_data(**args, micro_batch=micro, dp=dp, dp_rank=r) for r in range(dp)]
        for step in (0, 3, 400):  # 400 steps is past the first epoch
            ref_x, ref_y = one.micro_batch_at(step, 0)
            parts = [d.micro_batch_at(step, m) for d in ranks for m in range(8 // (dp * micro))]
            assert np.array_equal(np.concatenate([p[0] for p in parts]), ref_x)
            assert np.array_equal(np.concatenate([p[1] for p in parts]), ref_y)


def test_sampler_covers_each_epoch_once_and_reshuffles():
    s = GlobalSampler(50, seed=1)
    first, second = s.indices(0, 50), s.indices(50, 50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second
    assert GlobalSampler(50, seed=1).indices(73, 5) == second[23:28]  # random access = resumable position


def test_windows_and_targets(tmp_path):
    (tmp_path / "in.txt").write_text("abcdefghijklmnopqrstuvwxyz")
    prepare([tmp_path / "in.txt"], "byte", tmp_path / "out", progress=False)
    ds = WindowDataset(TokenShards(tmp_path / "out"), seq_len=8)
    assert len(ds) == 3  # 27 tokens: (27 - 1) // 8 windows of 9
    assert bytes(ds.window(1)[:8].tolist()) == b"ijklmnop"


def test_data_prepare_cli(tmp_path):
    inputs = _inputs(tmp_path)
    proc = run_cli("data", "prepare", "--input", *inputs, "--tokenizer", "byte", "--out", tmp_path / "out")
    assert "documents" in proc.stdout
    assert (tmp_path / "out" / "index.json").is_file()
    bad = run_cli("data", "prepare", "--input", tmp_path / "missing.txt", "--tokenizer", "byte",
                  "--out", tmp_path / "x", check=False)
    assert bad.returncode == 2 and "missing.txt" in bad.stderr


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _scratch_dirs(out):
    return [p.name for p in out.parent.iterdir() if p.name.startswith(out.name + ".")]


@pytest.mark.parametrize("second", ["bad.jsonl", "binary.txt", "missing.txt", "disk_full"])
def test_a_failed_prepare_keeps_the_previous_dataset(tmp_path, monkeypatch, second):
    (tmp_path / "good.txt").write_text(TEXT)
    out = tmp_path / "out"
    prepare([tmp_path / "good.txt"], "byte", out, shard_tokens=1024, progress=False)
    before = _snapshot(out)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    (tmp_path / "binary.txt").write_bytes(b"text first\n" + bytes(range(256)))
    inputs = [tmp_path / "good.txt", tmp_path / second]
    if second == "disk_full":
        import shardlm.data.prepare as prep
        real = prep.ShardWriter._close

        def close_then_fill(self):
            real(self)
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(prep.ShardWriter, "_close", close_then_fill)
        inputs = [tmp_path / "good.txt"]
    with pytest.raises((ValueError, OSError), match=re.escape(f"{out} still holds its previous dataset")):
        prepare(inputs, "byte", out, shard_tokens=2048, progress=False)
    assert _snapshot(out) == before
    assert np.asarray(TokenShards(out).tokens[0]).tolist()[:5] == list(TEXT[:5].encode())
    assert _scratch_dirs(out) == []


def test_a_new_dataset_replaces_the_old_one_whole(tmp_path, monkeypatch):
    from shardlm.data import swap
    make_tokenizer(tmp_path / "tok")
    (tmp_path / "in.txt").write_text(TEXT[:3000])
    out = tmp_path / "out"
    prepare([tmp_path / "in.txt"], tmp_path / "tok", out, shard_tokens=1024, progress=False)
    assert (out / "tokenizer_config.json").is_file() and (out / "shard_00001.bin").is_file()
    prepare([tmp_path / "in.txt"], "byte", out, progress=False)
    assert sorted(os.listdir(out)) == ["index.json", "shard_00000.bin", "tokenizer.json"]  # no stale shard or config
    monkeypatch.setattr(swap, "_exchange", lambda a, b: False)  # filesystems without RENAME_EXCHANGE
    prepare([tmp_path / "in.txt"], "byte", out, shard_tokens=1024, progress=False)
    assert len(TokenShards(out, model_vocab=257).tokens) == 3
    assert _scratch_dirs(out) == []
    link = tmp_path / "link"
    link.symlink_to(out)
    prepare([tmp_path / "in.txt"], "byte", link, progress=False)
    assert link.is_symlink() and len(TokenShards(link).tokens) == 1


def test_an_output_holding_other_files_is_refused(tmp_path):
    (tmp_path / "in.txt").write_text("abc")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.md").write_text("mine")
    with pytest.raises(ValueError, match="out holds files that are not part of a prepared dataset .notes.md."):
        prepare([tmp_path / "in.txt"], "byte", tmp_path / "out", progress=False)
    assert os.listdir(tmp_path / "out") == ["notes.md"]


def test_an_output_inside_a_prepared_dataset_is_refused(tmp_path):
    """It would be a foreign directory of that dataset, whose next preparation then refuses it."""
    (tmp_path / "in.txt").write_text("abc")
    prepare([tmp_path / "in.txt"], "byte", tmp_path / "d1", progress=False)
    with pytest.raises(ValueError, match="d1/sub is inside the prepared dataset .*d1: give an --out outside it"):
        prepare([tmp_path / "in.txt"], "byte", tmp_path / "d1" / "sub", progress=False)
    assert not (tmp_path / "d1" / "sub").exists()
    prepare([tmp_path / "in.txt"], "byte", tmp_path / "d1", progress=False)  # the dataset itself, prepared again


def test_leftovers_of_killed_runs_are_removed_and_live_ones_kept(tmp_path):
    import fcntl

    from shardlm.data import swap
    (tmp_path / "in.txt").write_text("abc")
    out = tmp_path / "out"
    dead = tmp_path / "out.prepare-tmp-1-dead"
    live = tmp_path / "out.prepare-tmp-2-live"
    for d in (dead, live):
        d.mkdir()
        (d / "shard_00000.bin").write_bytes(b"partial")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the run that owns it does
    try:
        prepare([tmp_path / "in.txt"], "byte", out, progress=False)
        assert not dead.exists() and live.is_dir()
    finally:
        os.close(fd)
    # A crash between the two renames of the fallback swap: the old dataset waits under its backup name.
    backup = tmp_path / "out.prepare-old-3-crash"
    out.rename(backup)
    swap.remove_leftovers(out)
    assert not backup.exists() and not live.exists()
    assert np.asarray(TokenShards(out).tokens[0]).tolist() == [97, 98, 99, 256]


UNREADABLE = [
    ("bad.txt", b"line one\nline two \xff\xfe end\n", r"bad.txt: not UTF-8 text \(line 2, byte offset 18\)"),
    ("nul.txt", b"looks like text\n\x00\x01\x02\x03",
     r"nul.txt: binary data, not text \(a NUL byte at line 2, byte offset 16\)"),
    ("utf16.txt", "hello\n".encode("utf-16"),
     r"utf16.txt: not UTF-8 text \(line 1, byte offset 0\); it starts with a UTF-16 byte-order mark"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bad.jsonl:2: not UTF-8 text \(byte offset 28\)"),
    ("json.jsonl", b'{"text": "ok"}\n\n{"text": "a",}\n', r"json.jsonl:3: not JSON \(.* at column 14\)"),
    ("field.jsonl", b'{"text": "ok"}\n{"body": "b"}\n', r"field.jsonl:2: no 'text' field \(fields: 'body'\)"),
    ("type.jsonl", b'{"text": "ok"}\n{"text": 5}\n', r"type.jsonl:2: 'text' is a number, not a string"),
    ("null.jsonl", b'{"text": null}\n', r"null.jsonl:1: 'text' is null, not a string"),
    ("array.jsonl", b'["text"]\n', r"array.jsonl:1: an array, not an object with a 'text' field"),
    ("surrogate.jsonl", b'{"text": "a\\ud800b"}\n', r"surrogate.jsonl:1: 'text' holds an unpaired surrogate"),
    ("fake.parquet", b"not a parquet file", r"fake.parquet: not a readable parquet file"),
    ("deep.jsonl", b'{"text": ' + b"[" * 200000 + b"]" * 200000 + b"}\n", r"deep.jsonl:1: JSON nested too deeply"),
]


@pytest.mark.parametrize("name,data,message", [pytest.param(*case, id=case[0]) for case in UNREADABLE])
def test_unreadable_inputs_are_named(tmp_path, name, data, message):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=message):
        prepare([tmp_path / name], "byte", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_an_input_of_another_type_or_parquet_column_is_refused_before_any_input_is_tokenized(tmp_path, monkeypatch):
    """Found when its turn came, after the inputs before it had been tokenized (hours, on a large corpus)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import shardlm.data.prepare as prep
    (tmp_path / "big.txt").write_text("text " * 100)
    (tmp_path / "z.csv").write_text("a,b\n")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "z.parquet")
    monkeypatch.setattr(prep, "iter_pieces", lambda *a: pytest.fail("an input was read before the checks"))
    for last, said in (("z.csv", "z.csv: unsupported input type '.csv'"), ("z.parquet", "z.parquet: no column 'text'")):
        with pytest.raises(ValueError, match=said):
            prepare([tmp_path / "big.txt", tmp_path / last], "byte", tmp_path / "out", progress=False)


def test_an_empty_input_among_instruction_examples_is_named(tmp_path):
    """An empty .jsonl reads as no instruction data, and the refusal of mixed inputs named the good file alone."""
    from shardlm.data.prepare import PrepareError
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "completion": "b"}])
    (tmp_path / "b.jsonl").write_text("\n")
    with pytest.raises(PrepareError, match=r"instruction examples in .*a.jsonl; plain text in .*b.jsonl \(empty\)"):
        prepare([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], "byte", tmp_path / "out", progress=False)


def test_parquet_columns_must_exist_and_hold_strings(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: no column 'text' \(columns: body\)"):
        prepare([tmp_path / "a.parquet"], "byte", tmp_path / "out", progress=False)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet: column 'text' holds int64, not strings"):
        prepare([tmp_path / "b.parquet"], "byte", tmp_path / "out", progress=False)
    # a null row is refused as a jsonl line's null is, not dropped unseen
    pq.write_table(pa.table({"text": ["a"] * 1030 + [None]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n.parquet: row 1031: 'text' is null, not a string \(drop or fill"):
        prepare([tmp_path / "n.parquet"], "byte", tmp_path / "out", progress=False)
    pq.write_table(pa.table({"text": pa.array(["ab", "c", "ab"]).dictionary_encode()}), tmp_path / "c.parquet")
    prepare([tmp_path / "c.parquet"], "byte", tmp_path / "out", progress=False)
    assert np.asarray(TokenShards(tmp_path / "out").tokens[0]).tolist() == [97, 98, 256, 99, 256, 97, 98, 256]


def test_text_streams_in_pieces_that_keep_characters_whole(tmp_path, monkeypatch):
    import shardlm.data.prepare as prep
    monkeypatch.setattr(prep, "CHUNK_CHARS", 64)
    one_line = "é€𝄞x" * 300  # no newline or space: cut at character boundaries
    (tmp_path / "long.txt").write_text(one_line)
    prepare([tmp_path / "long.txt"], "byte", tmp_path / "out", progress=False)
    assert bytes(np.asarray(TokenShards(tmp_path / "out").tokens[0]).tolist()[:-1]) == one_line.encode()
    body = "".join(f"line {i} é\n" for i in range(100)).encode()
    (tmp_path / "late.txt").write_bytes(body + b"bad \xc3(\n")
    with pytest.raises(ValueError, match=rf"late.txt: not UTF-8 text \(line 101, byte offset {len(body) + 4}\)"):
        prepare([tmp_path / "late.txt"], "byte", tmp_path / "out2", progress=False)


@pytest.mark.parametrize("value", [0, -5, 1, 1 << 41, 1.5, True, "1000"])
def test_shard_tokens_are_checked(tmp_path, value):
    (tmp_path / "in.txt").write_text("abc")
    with pytest.raises(ValueError, match="shard_tokens"):
        prepare([tmp_path / "in.txt"], "byte", tmp_path / "out", shard_tokens=value, progress=False)
    assert not (tmp_path / "out").exists()


def _error_line(proc):
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def test_data_prepare_cli_errors_are_one_line(tmp_path):
    (tmp_path / "in.txt").write_text(TEXT)
    (tmp_path / "bin.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    out = tmp_path / "out"
    run_cli("data", "prepare", "--input", tmp_path / "in.txt", "--tokenizer", "byte", "--out", out)
    before = _snapshot(out)
    for value, says in (("0", "0 is out of range"), ("-5", "-5 is out of range"), ("1e30", "10000000000000000"),
                        ("lots", "'lots' is not a whole number of tokens")):
        bad = run_cli("data", "prepare", "--input", tmp_path / "in.txt", "--tokenizer", "byte", "--out", out,
                      "--shard-tokens", value, check=False)
        assert _error_line(bad).startswith(f"shardlm data: error: --shard-tokens {says}")
    bad = run_cli("data", "prepare", "--input", tmp_path / "in.txt", tmp_path / "bin.txt", "--tokenizer", "byte",
                  "--out", out, "--shard-tokens", "1e4", check=False)
    assert _error_line(bad) == (f"shardlm data: error: {tmp_path / 'bin.txt'}: not UTF-8 text (line 1, byte offset 0); "
                                f"{out} still holds its previous dataset")
    assert _snapshot(out) == before


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_text_streamed_in_pieces_gets_the_whole_texts_tokens(tmp_path, monkeypatch, kind):
    """A text file is tokenized a megabyte at a time (here 64 bytes): cut at a word's end and each piece encoded
    after the character before it, the pieces' tokens are the whole text's, with a byte-level BPE (GPT-2's kind,
    whose whitespace runs merge) and with a SentencePiece-style tokenizer (Llama 2's: every text it is given
    alone opens with a word-start mark, which a piece encoded alone got where the text has none). Lines, blank
    and indented lines, CRLF ends, lines ending in a no-break space, and a line longer than four pieces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    import shardlm.data.prepare as prep
    if kind == "byte-level":
        make_tokenizer(tmp_path / "tok")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        # Trained on words, as SentencePiece splits at whitespace (no merge spans two words), then applied to
        # whole texts, as Llama 2's tokenizer.json does.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=[
            "<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)], show_progress=False))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        (tmp_path / "tok").mkdir()
        tok.save(str(tmp_path / "tok" / "tokenizer.json"))
        (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    words = TEXT.split()
    lines = [" ".join(words[i:i + 7]) for i in range(0, 140, 7)]
    body = ("\n".join(lines[:6]) + "\n\n  " + "\n    ".join(lines[6:10]) + "\r\n" + "\r\n".join(lines[10:14])
            + "\n" + " ".join(words[:80]) + "\n" + "\u00a0\n".join(lines[14:]) + "\n")
    (tmp_path / "in.txt").write_text(body, newline="")
    monkeypatch.setattr(prep, "CHUNK_CHARS", 64)
    prepare([tmp_path / "in.txt"], str(tmp_path / "tok"), tmp_path / "out", progress=False)
    tok = load_tokenizer(tmp_path / "tok")
    stream = np.asarray(TokenShards(tmp_path / "out").tokens[0]).tolist()
    assert stream == tok.bos_ids + tok.encode(body) + [tok.eos_id]
    assert (tok.bos_ids != []) == (kind == "sentencepiece")


def test_sigterm_ends_data_prepare_in_one_line_and_removes_its_partial_output(tmp_path):
    """A scheduler's SIGTERM during `data prepare` ends it as Ctrl-C does: exit 143, one line, no scratch
    directory left (it was killed silently, its partial shards left for the next run to remove)."""
    import signal
    import subprocess
    import sys
    import time
    big = tmp_path / "big.txt"
    big.write_text("the quick brown fox jumps over the lazy dog\n" * 200_000)  # 8.8 MB: seconds to tokenize
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "data", "prepare", "--input", big, "--tokenizer", "byte",
                             "--out", out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("out.prepare-tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("prepare finished before the signal")
    assert proc.returncode == 128 + signal.SIGTERM and "interrupted (SIGTERM)" in err and "Traceback" not in err
    assert not list(tmp_path.glob("out.prepare-tmp-*")) and not out.exists()


def test_one_file_given_twice_is_refused(tmp_path):
    """Named twice, or through a link: its text would be trained on twice. Two files of equal text are two inputs."""
    (tmp_path / "a.txt").write_text(TEXT[:100])
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")
    (tmp_path / "copy.txt").write_text(TEXT[:100])
    with pytest.raises(ValueError, match=r"--input .*link.txt is given twice \(the same file as .*a.txt\)"):
        prepare([tmp_path / "a.txt", tmp_path / "link.txt"], "byte", tmp_path / "out", progress=False)
    assert prepare([tmp_path / "a.txt", tmp_path / "copy.txt"], "byte", tmp_path / "out", progress=False)["documents"] == 2


def test_the_default_corpus_reads_a_module_linked_under_two_names_once(tmp_path, monkeypatch):
    """Debian's Python links _sysconfigdata_* under two names; prepare refuses a file given twice, so the default
    corpus (and `shardlm train` with no arguments) must list it once."""
    import sysconfig

    from shardlm.data.default import default_sources
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "c.py").symlink_to(tmp_path / "a.py")
    os.link(tmp_path / "b.py", tmp_path / "d.py")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    files = default_sources()
    assert [f.name for f in files] == ["a.py", "b.py"]
    prepare(files, "byte", tmp_path / "out", progress=False)


def test_the_default_corpus_is_prepared_again_for_a_source_edited_at_the_same_size(tmp_path, monkeypatch):
    """Its cache was keyed by each file's path and size: a module edited in place kept its old tokens."""
    import sysconfig

    from shardlm.data.default import default_corpus
    from shardlm.data.loader import TokenShards
    (tmp_path / "lib").mkdir()
    src = tmp_path / "lib" / "m.py"
    src.write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = default_corpus()
    src.write_text("y = 2\n")
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    again = default_corpus()
    assert again != first and bytes(TokenShards(again).tokens[0][:6].astype("uint8")) == b"y = 2\n"


def test_a_special_tokens_spelling_in_plain_text_is_text(tmp_path):
    """A document quoting "<|endoftext|>" was cut there by the special token it tokenized as, unsaid (the
    document count said one); it is the text it spells, as nanoGPT's encode_ordinary reads it."""
    from shardlm.data.loader import TokenShards
    text = "GPT-2 ends texts with <|endoftext|> as a token."
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "next"}) + "\n")
    index = prepare([tmp_path / "a.jsonl"], "byte", tmp_path / "out", progress=False)
    ids = [int(t) for t in TokenShards(tmp_path / "out").tokens[0]]
    assert index["documents"] == 2 and ids.count(256) == 2 and ids[:len(text)] == list(text.encode())


def test_the_default_corpus_leaves_no_partial_copy_behind(tmp_path, monkeypatch):
    """An interrupted first preparation (Ctrl-C) left a stdlib-*.tmp-* directory in the cache for good, as did a
    killed one; the next run removes a dead process's copy of this host and keeps a live one's and another
    host's (a shared home's cache is also written by other nodes)."""
    import shutil
    import socket
    import subprocess
    import sysconfig

    import shardlm.data.default as default
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "a.py").write_text("x = 1\n" * 50)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path / "lib")})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = default.default_corpus()
    shutil.rmtree(cache)

    def interrupted(files, tokenizer, out, progress, moved):
        (out / "half").parent.mkdir(parents=True)
        (out / "half").write_bytes(b"x")
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(default, "prepare", interrupted)
        with pytest.raises(KeyboardInterrupt):
            default.default_corpus()
    assert list(cache.parent.iterdir()) == []

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    with subprocess.Popen(["sleep", "60"]) as live:
        kept = [f"{cache.name}.tmp-{host}-{live.pid}", f"{cache.name}.tmp-elsewhere-{dead.pid}"]
        for name in kept + [f"{cache.name}.tmp-{host}-{dead.pid}"]:
            (cache.parent / name).mkdir()
        assert default.default_corpus() == cache and (cache / "index.json").is_file()
        assert sorted(p.name for p in cache.parent.iterdir()) == sorted([cache.name] + kept)
        live.kill()


@pytest.mark.timeout(60)
def test_text_field_reads_records_that_hold_a_prompt_as_text(tmp_path):
    """A jsonl of {"prompt": ...} records to pretrain on: --text-field prompt was refused as having no effect, and
    without it the records were instruction examples lacking a completion, a dead end."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi there"}\n{"prompt": "bye", "id": 2}\n')
    index = prepare([tmp_path / "p.jsonl"], "byte", tmp_path / "out", text_field="prompt", progress=False)
    assert index["documents"] == 2 and "loss_mask" not in index
    stream = np.asarray(TokenShards(tmp_path / "out").tokens[0]).tolist()
    assert stream == list(b"hi there") + [256] + list(b"bye") + [256]
    with pytest.raises(ValueError, match=r"p.jsonl:1: needs string fields prompt and completion \(or messages\); "
                                         r"has 'prompt' \(for plain text, name its field with --text-field\)"):
        prepare([tmp_path / "p.jsonl"], "byte", tmp_path / "out2", progress=False)
