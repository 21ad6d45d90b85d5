"""`shardlm eval`: the loss task scores the text `data prepare` trains on."""
import json

import pytest

from helpers import TEXT, cli_here


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    """A tiny llama with the byte tokenizer, as an HF directory: one token per byte of the text."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    from shardlm.model.hf import write_hf_dir
    from shardlm.tokenizer import load_tokenizer
    out = tmp_path_factory.mktemp("eval_audit") / "hf"
    cfg = load_config("tiny").model
    write_hf_dir(build_model(cfg, seed=0).state_dict(), cfg, out, load_tokenizer("byte"))
    return out


@pytest.mark.timeout(60)
def test_a_byte_order_mark_is_not_scored(byte_model_dir, tmp_path, capsys):
    """A text file saved by a Windows editor opens with a UTF-8 byte-order mark, which `data prepare` drops: the
    loss task scored its 3 bytes as text, every window shifted by them, another loss than the same text's."""
    text = TEXT[:600].encode()
    (tmp_path / "plain.txt").write_bytes(text)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + text)
    plain, bom = (json.loads(cli_here(capsys, "eval", "--model", byte_model_dir, "--data", tmp_path / name,
                                      "--seq-len", 32, "--json")) for name in ("plain.txt", "bom.txt"))
    assert bom == plain


@pytest.mark.timeout(60)
def test_a_binary_file_is_refused_not_scored(byte_model_dir, tmp_path, capsys):
    """NUL is valid UTF-8: a prepared dataset's token shard of ASCII text (uint16 ids, every other byte 0) decoded
    whole, and the loss task reported a perplexity of its bytes without a word. It is refused as data prepare
    refuses binary input."""
    from helpers import cli_proc
    (tmp_path / "t.txt").write_text(TEXT[:600])
    cli_here(capsys, "data", "prepare", "--input", tmp_path / "t.txt", "--tokenizer", "byte", "--out", tmp_path / "d")
    r = cli_proc(capsys, "eval", "--model", byte_model_dir, "--data", tmp_path / "d" / "shard_00000.bin",
                 "--seq-len", 32)
    assert r.returncode == 2 and "a prepared dataset's token shard, not text" in r.stderr, r.stderr
    (tmp_path / "nul.txt").write_bytes(b"abc\0def")
    r = cli_proc(capsys, "eval", "--model", byte_model_dir, "--data", tmp_path / "nul.txt", "--seq-len", 2)
    assert r.returncode == 2 and "binary data, not text (a NUL byte at byte offset 3)" in r.stderr, r.stderr
