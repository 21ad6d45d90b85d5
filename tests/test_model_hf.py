"""Hugging Face parity: logits equal transformers' (fp32, atol 1e-5); export -> import is exact."""
import pytest
import torch

from helpers import hf_model
from shardlm.model import build_model
from shardlm.model.hf import read_hf_dir, write_hf_dir

KINDS = ["llama", "llama3", "llama_tied", "qwen2", "mistral", "gpt2"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_and_export_roundtrips(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = hf_model(kind)
    ref.save_pretrained(tmp_path / "hf")
    cfg, state = read_hf_dir(tmp_path / "hf")
    ours = build_model(cfg, init=False)
    ours.load_state_dict(state, strict=True)
    ours.eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ref(ids).logits, ours(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)

    write_hf_dir(ours.state_dict(), cfg, tmp_path / "export")
    cfg2, state2 = read_hf_dir(tmp_path / "export")
    assert cfg2 == cfg
    assert state2.keys() == state.keys()
    for k in state:
        assert torch.equal(state2[k], state[k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-5)


def test_loss_matches_transformers(tmp_path):
    ref = hf_model("llama")
    ref.save_pretrained(tmp_path)
    cfg, state = read_hf_dir(tmp_path)
    ours = build_model(cfg, init=False)
    ours.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(ids, labels=ids).loss
        got = ours(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_unsupported_architecture_is_refused(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="BertForMaskedLM"):
        read_hf_dir(tmp_path)


def test_meta_init_is_deterministic_and_materialises_everything():
    from shardlm.config import load_config
    cfg = load_config("tiny").model
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    c = build_model(cfg, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert p.device.type == "cpu" and torch.isfinite(p).all(), n
        assert torch.equal(p, q), n
        if p.dim() >= 2:
            assert not torch.equal(p, r), n
    assert sum(p.numel() for p in a.parameters()) == cfg.num_params()


@pytest.mark.parametrize("preset", ["gpt2-124m", "tinyllama-1.1b", "llama2-7b", "llama3-8b"])
def test_param_counts_match_published_sizes(preset):
    """The shape arithmetic (shared with the planner) against the runtime model on the meta device."""
    from shardlm.config import load_config
    from shardlm.model import Decoder
    cfg = load_config(preset).model
    with torch.device("meta"):
        model = Decoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    published = {"gpt2-124m": 124.48e6, "tinyllama-1.1b": 1.100e9, "llama2-7b": 6.738e9, "llama3-8b": 8.030e9}[preset]
    # gpt2-124m pads the vocabulary to 50304 (+36.9k parameters).
    assert abs(cfg.num_params() - published) / published < 0.001


@pytest.mark.parametrize("chunk", [7, 64, 4096])
def test_chunked_head_and_loss_equal_plain_cross_entropy(chunk):
    from shardlm.model.loss import linear_cross_entropy
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 50, 16, generator=g, requires_grad=True)
    w = torch.randn(100, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 100, (3, 50), generator=g)
    loss = linear_cross_entropy(h, w, t, chunk)
    (loss * 3).backward()  # a non-unit incoming gradient, as accumulation and loss scaling give
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h2, w2).view(-1, 100), t.view(-1))
    (ref * 3).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, t, chunk), ref)
