"""`shardlm eval --tasks loss`: perplexity = exp(mean NLL) over the exact tokens of the file."""
import json
import math

import pytest
import torch

from helpers import cli_here


def tiny_model():
    from shardlm.config import load_config
    from shardlm.model import build_model
    return build_model(load_config("tiny").model, seed=0).eval()


@pytest.mark.timeout(60)
def test_a_loss_past_exps_range_has_an_infinite_perplexity_not_a_traceback():
    """A diverged model (here: the head's weights scaled up) scores a mean NLL above 709.78 nats, where
    math.exp overflows: evaluate_ids raised OverflowError (a traceback from `shardlm eval`, which only catches
    ValueError) instead of reporting the loss with an infinite perplexity, as transformers' run_clm does."""
    from shardlm.inference import evaluate_ids
    model = tiny_model()
    with torch.no_grad():
        model.head_weight.mul_(3000)
    ids = list(range(100)) * 3
    r = evaluate_ids(model, ids, 16)
    w = torch.tensor(ids[:18 * 16]).view(18, 16)
    with torch.no_grad():
        logits = model(w[:, :-1]).float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()
    assert r["loss"] > 710 and r["loss"] == pytest.approx(want, rel=1e-5)
    assert r["perplexity"] == math.inf and r["tokens"] == 18 * 15


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    """A tiny llama with the byte tokenizer, as an HF directory: one token per byte of the text."""
    from shardlm.config import load_config
    from shardlm.model.hf import write_hf_dir
    from shardlm.tokenizer import load_tokenizer
    out = tmp_path_factory.mktemp("eval_loss") / "hf"
    write_hf_dir(tiny_model().state_dict(), load_config("tiny").model, out, load_tokenizer("byte"))
    return out


@pytest.mark.timeout(60)
def test_the_loss_task_scores_a_crlf_files_bytes_as_they_are(byte_model_dir, tmp_path, capsys):
    """The loss task read the file in Python's universal-newline mode (Path.read_text), so a Windows text's
    "\\r\\n" became "\\n" before tokenising: 480 bytes scored as 460 tokens, the same loss as the LF file, where
    `data prepare` (which reads bytes) trains on the "\\r". The file's characters are scored as they are."""
    from shardlm.inference import evaluate_ids, load_pretrained
    raw = b"the cat sat on the mat\r\n" * 20  # 480 bytes: 30 windows of 16
    (tmp_path / "crlf.txt").write_bytes(raw)
    r = json.loads(cli_here(capsys, "eval", "--model", byte_model_dir, "--data", tmp_path / "crlf.txt",
                            "--seq-len", 16, "--json"))
    model, tok, _ = load_pretrained(byte_model_dir)
    want = evaluate_ids(model, tok.encode_document(raw.decode("utf-8")), 16)
    assert r["tokens"] == 30 * 15 == want["tokens"]
    assert r["loss"] == pytest.approx(want["loss"], rel=1e-6)


@pytest.mark.timeout(60)
def test_the_help_says_the_tail_shorter_than_a_window_is_not_scored(byte_model_dir, tmp_path, capsys):
    """A text of 250 tokens at --seq-len 128 is scored on its first window alone (127 predictions, 122 tokens
    never seen), which neither `eval --help` nor the README said: the help now says so."""
    (tmp_path / "t.txt").write_bytes(b"x" * 250)
    r = json.loads(cli_here(capsys, "eval", "--model", byte_model_dir, "--data", tmp_path / "t.txt",
                            "--seq-len", 128, "--json"))
    assert r["tokens"] == 127
    assert "fewer than a window, are not scored" in " ".join(cli_here(capsys, "eval", "--help").split())
