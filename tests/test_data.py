"""Token shards: formats, dtypes, streaming, integrity errors, and the layout-independent sampler."""
import json

import numpy as np
import pytest

from helpers import TEXT, make_tokenizer, run_cli
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
    index = prepare(inputs, "byte", tmp_path / "out", shard_tokens=1000, progress=False)
    assert index["dtype"] == "uint16" and index["documents"] == 1 + 5 + 2
    assert len(index["shards"]) > 1  # rolled over at 1000 tokens
    shards = TokenShards(tmp_path / "out", model_vocab=257)
    stream = np.concatenate([np.asarray(t) for t in shards.tokens])
    docs = [TEXT[:2000]] + [f"document {i}: " + TEXT[i * 100:(i + 1) * 100] for i in range(5)] + [TEXT[:300], "short row"]
    expected = []
    for d in docs:
        expected += list(d.encode()) + [256]
    assert stream.tolist() == expected
    assert load_tokenizer(tmp_path / "out").vocab_size == 257


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
