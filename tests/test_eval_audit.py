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
