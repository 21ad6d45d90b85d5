"""Generation (KV cache, greedy parity with transformers) and evaluation (perplexity over windows)."""
import json
import math

import pytest
import torch

from helpers import TEXT, cli_here, save_hf
from shardlm.inference import evaluate_ids, generate_ids, load_pretrained
from shardlm.model import KVCache


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_greedy_generation_matches_transformers(kind, tmp_path):
    ref = save_hf(kind, tmp_path)
    model, tok, cfg = load_pretrained(tmp_path)
    prompt = torch.tensor([tok.encode("To be, or not")])
    expected = ref.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate_ids(model, prompt, 20)
    assert got.tolist() == expected[:, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("kind", ["mistral_window", "qwen2_window"])
@pytest.mark.parametrize("prompt", ["To be", "To be, or not to be, that is the question"])
def test_greedy_generation_past_the_window_matches_transformers(kind, prompt, tmp_path):
    """A window of 8: prompts shorter and longer than it, and 24 new tokens, so the prefill and the cached
    steps both drop keys."""
    ref = save_hf(kind, tmp_path)
    model, tok, cfg = load_pretrained(tmp_path)
    ids = torch.tensor([tok.encode(prompt)])
    assert cfg.sliding_window == 8 and ids.shape[1] + 24 > 2 * cfg.sliding_window
    expected = ref.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate_ids(model, ids, 24)
    assert got.tolist() == expected[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("window", [0, 6])
def test_kv_cache_decoding_equals_full_forward(window):
    import dataclasses

    from shardlm.config import load_config
    from shardlm.model import build_model
    cfg = dataclasses.replace(load_config("tiny").model, sliding_window=window)
    model = build_model(cfg, seed=1).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(cfg, 2, 24, "cpu", torch.float32)
        parts = [model(ids[:, :10], cache=cache)]          # prefill
        parts += [model(ids[:, i:i + 1], cache=cache) for i in range(10, 20)]  # one token per step
        parts.append(model(ids[:, 20:], cache=cache))      # a multi-token block after a prefix
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_sampling_is_seeded_and_respects_top_k(tmp_path):
    save_hf("llama", tmp_path)
    model, tok, _ = load_pretrained(tmp_path)
    ids = torch.tensor([tok.encode("To be")])
    a = generate_ids(model, ids, 12, temperature=1.0, top_k=5, seed=7)
    b = generate_ids(model, ids, 12, temperature=1.0, top_k=5, seed=7)
    assert torch.equal(a, b)
    with torch.no_grad():  # each sampled token is among the top 5 of its step
        full = model(torch.cat([ids, a], dim=1))[0, ids.shape[1] - 1:-1]
    top5 = full.topk(5, dim=-1).indices
    assert all(t in row for t, row in zip(a[0].tolist(), top5.tolist()))
    c = generate_ids(model, ids, 12, temperature=1.0, top_p=1e-6, seed=3)  # tiny top-p is greedy
    assert torch.equal(c, generate_ids(model, ids, 12))


def test_eval_cli_matches_transformers_windows(tmp_path, capsys):
    ref = save_hf("llama", tmp_path / "hf")
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXT[:3000])
    out = cli_here(capsys, "eval", "--model", tmp_path / "hf", "--data", text_file, "--seq-len", 32, "--json")
    got = json.loads(out.strip().splitlines()[-1])
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json")).encode(TEXT[:3000], add_special_tokens=False).ids
    n = len(ids) // 32
    windows = torch.tensor(ids[:n * 32]).view(n, 32)
    with torch.no_grad():
        logits = ref(windows).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    assert got["tokens"] == n * 31
    assert got["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(loss.item()), rel=1e-5)


def test_generate_cli_json(tmp_path, capsys):
    ref = save_hf("gpt2", tmp_path)
    out = cli_here(capsys, "generate", "--model", tmp_path, "--prompt", "To be", "--max-new-tokens", 8, "--json")
    completion = json.loads(out.strip().splitlines()[-1])["completion"]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    prompt = torch.tensor([tok.encode("To be", add_special_tokens=False).ids])
    expected = ref.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert completion == tok.decode(expected[0, prompt.shape[1]:].tolist(), skip_special_tokens=False)


def test_evaluate_reports_its_progress_by_windows(tmp_path):
    """`eval --tasks loss` scored a large text for minutes with nothing shown: its bar counts windows."""
    save_hf("llama", tmp_path)
    model, _, _ = load_pretrained(tmp_path)
    ids = list(range(1, 200)) * 3  # 597 tokens: 37 windows of 16, the last batch of 5
    done = []
    r = evaluate_ids(model, ids, 16, batch_size=8, progress=done.append)
    assert done == [8, 8, 8, 8, 5] and r == evaluate_ids(model, ids, 16, batch_size=8)


def test_evaluate_rejects_short_text(tmp_path):
    save_hf("llama", tmp_path)
    model, _, _ = load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate_ids(model, [1, 2, 3], 8)
