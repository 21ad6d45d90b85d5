"""Hugging Face parity: logits equal transformers' (fp32, atol 1e-5); export -> import is exact; a config
feature shardlm does not implement is refused, never ignored."""
import dataclasses
import re

import pytest
import torch

from helpers import cli_proc, hf_model, matched_to_transformers, save_hf
from shardlm.config import ConfigError, load_config
from shardlm.hf_config import model_config_from_hf
from shardlm.model import build_model
from shardlm.model.hf import open_hf_dir, read_hf_dir, write_hf_dir


def reads_as_transformers(directory, t: int) -> None:
    """shardlm's read of the HF `directory` gives transformers' logits for it (fp32, atol 1e-5), `t` tokens."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(directory).eval()
    cfg, state = read_hf_dir(directory)
    ours = build_model(cfg, init=False)
    ours.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), ref(ids).logits, rtol=0, atol=1e-5)

KINDS = ["llama", "llama3", "llama_tied", "qwen2", "qwen2_window", "mistral", "mistral_window", "gpt2"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_and_export_roundtrips(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    _, ours, cfg, state, ids, expected = matched_to_transformers(kind, tmp_path)
    write_hf_dir(ours.state_dict(), cfg, tmp_path / "export")
    cfg2, state2 = read_hf_dir(tmp_path / "export")
    assert cfg2 == cfg
    assert state2.keys() == state.keys()
    for k in state:
        assert torch.equal(state2[k], state[k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-5)


def test_the_window_cases_test_the_window(tmp_path):
    """transformers' windowed Mistral equals full causal attention before position `window` and differs from
    it at every position after, so matching it (above, 48 positions over a window of 8) tests the window."""
    ref = hf_model("mistral_window")
    ref.save_pretrained(tmp_path)
    cfg, state = read_hf_dir(tmp_path)
    full = build_model(dataclasses.replace(cfg, sliding_window=0), init=False)
    full.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = ref(ids).logits, full.eval()(ids)
    w = cfg.sliding_window
    torch.testing.assert_close(got[:, :w], expected[:, :w], rtol=0, atol=1e-5)
    assert (got[:, w:] - expected[:, w:]).abs().amax(-1).min() > 1e-3


def test_no_mask_while_the_window_spans_every_key():
    """Within the window attention stays plain causal SDPA (is_causal, no mask: flash applies)."""
    model = build_model(dataclasses.replace(load_config("tiny").model, sliding_window=8))
    assert model.window_mask(0, 8, "cpu") is None and model.window_mask(5, 3, "cpu") is None
    band = model.window_mask(6, 4, "cpu")  # queries 6..9 over keys 0..9: query i sees i-7..i
    assert band.tolist() == [[j <= i and j > i - 8 for j in range(10)] for i in range(6, 10)]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_window_trains_under_recompute(recompute):
    cfg = dataclasses.replace(load_config("tiny").model, sliding_window=5)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))

    def loss_and_grads(mode, window):
        model = build_model(dataclasses.replace(cfg, sliding_window=window), seed=1)
        model.set_recompute(mode)
        loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    loss, grads = loss_and_grads("none", 5)
    loss_r, grads_r = loss_and_grads(recompute, 5)
    torch.testing.assert_close(loss_r, loss, rtol=0, atol=0)
    for g, g_r in zip(grads, grads_r):
        torch.testing.assert_close(g_r, g, rtol=0, atol=1e-7)
    assert abs(loss_and_grads("none", 0)[0] - loss) > 1e-4  # the window is in effect


def _hf(cls, **kw):
    import transformers as tf
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300)
    return getattr(tf, cls)(**common, **kw).to_dict()


REFUSED = [
    # Llama's attention_bias also puts a bias on o_proj, which shardlm would drop (logits off by ~1.6).
    (lambda: _hf("LlamaConfig", attention_bias=True), "attention_bias = True"),
    (lambda: _hf("LlamaConfig", mlp_bias=True), "mlp_bias = True"),
    (lambda: _hf("LlamaConfig", hidden_act="gelu"), "hidden_act = 'gelu'"),
    (lambda: _hf("LlamaConfig", rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type = 'yarn'"),
    (lambda: _hf("LlamaConfig", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type = 'dynamic'"),
    (lambda: {**_hf("LlamaConfig"), "partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    # A window on the second layer only, as transformers 5 writes it and as 4.x did (no layer_types).
    (lambda: _hf("Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=1),
     "layer_types = ['full_attention', 'sliding_attention']"),
    (lambda: {k: v for k, v in _hf("Qwen2Config", use_sliding_window=True, sliding_window=8,
                                   max_window_layers=1).items() if k != "layer_types"}, "max_window_layers = 1"),
    # Qwen2-MoE's rule without layer_types: every other layer below max_window_layers (not Qwen2's from it on).
    (lambda: {k: v for k, v in _hf("Qwen2MoeConfig", use_sliding_window=True, sliding_window=8,
                                   max_window_layers=2).items() if k != "layer_types"}, "max_window_layers = 2"),
    # transformers' AutoModel reads a Mistral config with layer_types as Ministral's (a window per layer type);
    # MistralForCausalLM slides every layer: shardlm takes neither reading where they differ.
    (lambda: {**_hf("MistralConfig", sliding_window=8), "layer_types": ["full_attention", "sliding_attention"]},
     "layer_types = ['full_attention', 'sliding_attention']"),
    (lambda: {**_hf("MistralConfig", sliding_window=8), "layer_types": ["full_attention"] * 2},
     "layer_types = ['full_attention', 'full_attention']"),
    # AutoModel builds the class of model_type, whatever architectures names: here Mistral's, with a window.
    (lambda: {**_hf("MistralConfig", sliding_window=8), "architectures": ["LlamaForCausalLM"]},
     "model_type = 'mistral'"),
]


@pytest.mark.parametrize("make, message", REFUSED, ids=[m for _, m in REFUSED])
def test_unimplemented_hf_features_are_refused(make, message):
    with pytest.raises(ConfigError, match=re.escape("Hugging Face config " + message)):
        model_config_from_hf(make())


def test_features_transformers_ignores_are_not_refused():
    """Mistral and Qwen2 build bias-free MLPs and o_proj whatever attention_bias and mlp_bias say, Qwen2
    slides no layer without use_sliding_window, and transformers' "swish" is its "silu"."""
    for cls in ("MistralConfig", "Qwen2Config"):
        assert model_config_from_hf(_hf(cls, sliding_window=None, attention_bias=True, mlp_bias=True)).sliding_window == 0
    assert model_config_from_hf(_hf("Qwen2Config", sliding_window=8, max_window_layers=0)).sliding_window == 0
    assert model_config_from_hf(_hf("Qwen2Config", use_sliding_window=True, sliding_window=8,
                                    max_window_layers=0)).sliding_window == 8
    import transformers
    x = torch.linspace(-6, 6, 101)
    assert torch.equal(transformers.activations.ACT2FN["swish"](x), torch.nn.functional.silu(x))
    assert model_config_from_hf(_hf("LlamaConfig", hidden_act="swish")) == model_config_from_hf(_hf("LlamaConfig"))


@pytest.mark.parametrize("kind, edit", [
    ("qwen2_moe", lambda c: {**c, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("mistral_window", lambda c: {**c, "layer_types": ["sliding_attention"] * 2}),
], ids=["qwen2_moe_window_rule", "mistral_layer_types"])
def test_window_rules_of_configs_without_or_with_layer_types_match_automodel(kind, edit, tmp_path):
    """A Qwen2-MoE config.json without layer_types (as transformers 4 wrote it) slides the layers transformers'
    Qwen2-MoE rule picks (here none); a Mistral one with layer_types, those AutoModel reads from them."""
    import json

    hf_model(kind).save_pretrained(tmp_path)
    config = {k: v for k, v in json.loads((tmp_path / "config.json").read_text()).items() if k != "layer_types"}
    (tmp_path / "config.json").write_text(json.dumps(edit(config)))
    reads_as_transformers(tmp_path, 24)


def test_qwen2_moe_dense_layers_that_decoder_sparse_step_leaves_dense_anyway_are_read(tmp_path):
    """mlp_only_layers = [0] with decoder_sparse_step 2 makes layer 1 alone sparse, as shardlm's first dense layer
    and moe_every 2 do: read (it was refused as dense layers other than the first); [1] alone at step 1 is not."""
    import json

    hf_model("qwen2_moe").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "decoder_sparse_step": 2}))
    reads_as_transformers(tmp_path, 24)
    assert [read_hf_dir(tmp_path)[0].is_moe_layer(i) for i in range(2)] == [False, True]
    with pytest.raises(ConfigError, match=re.escape("mlp_only_layers = [1] is not supported")):
        model_config_from_hf({**config, "mlp_only_layers": [1]})


def test_a_qwen2_moe_without_a_shared_expert_exports_as_qwen2_moe(tmp_path):
    """shared_expert_intermediate_size 0 (its shared expert adds 0): read, and exported back to the class it came
    from (it was refused as neither Mixtral's nor Qwen2-MoE's)."""
    import transformers as tf
    torch.manual_seed(0)
    ref = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=0))
    ref.save_pretrained(tmp_path / "hf")
    reads_as_transformers(tmp_path / "hf", 24)
    cfg, state = read_hf_dir(tmp_path / "hf")
    write_hf_dir(state, cfg, tmp_path / "export")
    assert read_hf_dir(tmp_path / "export")[0] == cfg
    reads_as_transformers(tmp_path / "export", 24)


def test_a_mixture_of_experts_without_qkv_biases_exports_as_qwen2_moe(tmp_path):
    """DeepSeek-style layers (a shared expert, dense first layers, no qkv biases) trained from scratch: the export
    was refused as neither Mixtral's nor Qwen2-MoE's, where Qwen2-MoE's class computes them (qkv_bias false)."""
    cfg = load_config("mixtral-tiny", {"model.shared_expert_ffn_hidden_size": "48", "model.moe_first_dense": "1",
                                        "model.moe_ffn_hidden_size": "64",
                                        "model.num_layers": "3"}).model
    assert not cfg.qkv_bias
    model = build_model(cfg)
    write_hf_dir(model.state_dict(), cfg, tmp_path / "export")
    assert read_hf_dir(tmp_path / "export")[0] == cfg
    reads_as_transformers(tmp_path / "export", 24)


@pytest.mark.parametrize("kind, key, value, message", [
    ("mixtral", "num_experts_per_tok", 0, "num_experts_per_tok = 0 must be between 1 and its 4 experts"),
    ("mixtral", "num_experts_per_tok", 5, "num_experts_per_tok = 5 must be between 1 and its 4 experts"),
    ("qwen2_moe", "decoder_sparse_step", 0, "model.moe_every = 0 (shardlm's name for the config.json key), below 1"),
    ("qwen2_moe", "shared_expert_intermediate_size", -1, "model.shared_expert_ffn_hidden_size = -1"),
])
def test_generate_on_a_checkpoint_of_impossible_experts_is_refused(kind, key, value, message, tmp_path, capsys):
    """A config.json routing to more experts than it has, or none, or sizing them below 0: one line naming the
    key (it was a traceback from the router's top-k, a modulo by zero or a negative dimension)."""
    import json

    save_hf(kind, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    proc = cli_proc(capsys, "generate", "--model", tmp_path, "--prompt", "hi", "--max-new-tokens", "2")
    assert proc.returncode == 2 and message in proc.stderr


def test_a_windowed_qwen2_moe_exports_with_its_window(tmp_path):
    """Every layer of the export slides in transformers too (its Qwen2-MoE rule from max_window_layers alone
    slides every other layer or none)."""
    from transformers import AutoModelForCausalLM
    hf_model("qwen2_moe").save_pretrained(tmp_path / "hf")
    cfg, state = read_hf_dir(tmp_path / "hf")
    cfg = dataclasses.replace(cfg, sliding_window=8)
    ours = build_model(cfg, init=False)
    ours.load_state_dict(state)
    write_hf_dir(ours.state_dict(), cfg, tmp_path / "export")
    assert read_hf_dir(tmp_path / "export")[0] == cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()(ids).logits
        torch.testing.assert_close(ours.eval()(ids), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cls", ["LlamaConfig", "MistralConfig", "Qwen2Config", "MixtralConfig", "Qwen2MoeConfig"])
def test_keys_a_config_json_leaves_out_take_the_transformers_class_defaults(cls):
    """A config.json without rms_norm_eps, rope_theta, num_key_value_heads, sliding_window or
    max_position_embeddings is the transformers class's defaults (Mixtral's 1e-5 and 1e6, Mistral's window of
    4096), not Llama's."""
    import transformers as tf
    # 64 heads, which no class's key/value default equals: a missing key read as Llama's (as many) would show
    theirs = getattr(tf, cls)(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=64,
                              vocab_size=300)
    ours = model_config_from_hf({"architectures": theirs.architectures or [theirs.__class__.__name__.replace(
        "Config", "ForCausalLM")], "model_type": theirs.model_type, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 64, "vocab_size": 300})
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
    assert (ours.norm_eps, ours.rope_theta, ours.kv_heads, ours.max_seq_len) == (
        theirs.rms_norm_eps, rope["rope_theta"], theirs.num_key_value_heads, theirs.max_position_embeddings)
    if cls == "MistralConfig":
        assert ours.sliding_window == theirs.sliding_window == 4096
    if cls == "Qwen2Config":  # use_sliding_window with no sliding_window: the class's window of 4096
        keys = {k: v for k, v in theirs.to_dict().items() if k not in ("sliding_window", "layer_types")}
        assert model_config_from_hf({**keys, "use_sliding_window": True, "max_window_layers": 0}).sliding_window == 4096


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_materialised_as_such_equals_the_fp32_one_cast_down(dtype):
    """Weights drawn in fp32 and rounded once, as an fp32 model cast to 16 bits holds them, without ever
    holding the fp32 copy (a 13B model's does not fit an 80 GB GPU beside its 16-bit one)."""
    cfg = load_config("tiny").model
    fp32, direct = build_model(cfg, seed=5), build_model(cfg, dtype=dtype, seed=5)
    for (n, p), q in zip(fp32.named_parameters(), direct.parameters()):
        assert q.dtype == dtype and torch.equal(p.to(dtype), q), n


@pytest.mark.parametrize("preset", ["gpt2-124m", "tinyllama-1.1b", "llama2-7b", "llama2-13b", "llama3-8b"])
def test_param_counts_match_published_sizes(preset):
    """The shape arithmetic (shared with the planner) against the runtime model on the meta device."""
    from shardlm.config import load_config
    from shardlm.model import Decoder
    cfg = load_config(preset).model
    with torch.device("meta"):
        model = Decoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    published = {"gpt2-124m": 124.48e6, "tinyllama-1.1b": 1.100e9, "llama2-7b": 6.738e9, "llama2-13b": 13.016e9,
                 "llama3-8b": 8.030e9}[preset]
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


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_tensors_read_one_at_a_time_from_a_sharded_checkpoint(kind, tmp_path):
    """open_hf_dir reads a tensor only when asked (train.init_from: a rank takes its stage's, one at a time),
    across the shards of a checkpoint saved in pieces, equal to reading it whole."""
    ref = hf_model(kind)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    _, whole = read_hf_dir(tmp_path / "hf")
    _, tensors = open_hf_dir(tmp_path / "hf")
    assert tensors.names == list(whole)
    for name in ("layers.1.attn.qkv.weight", "layers.0.mlp.up.weight", "norm.weight"):
        assert torch.equal(tensors(name), whole[name]), name



@pytest.mark.timeout(120)
@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "linear"}, "lacks factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks low_freq_factor"),
    ({"rope_type": "linear", "factor": "2"}, "factor = '2' must be a positive number"),
    ({"rope_type": "linear", "factor": 0.0}, "factor = 0.0 must be a positive number"),
], ids=["linear-no-factor", "llama3-partial", "factor-str", "factor-0"])
def test_an_incomplete_rope_scaling_in_config_json_is_refused_on_load(rope, message, tmp_path):
    """A config.json whose RoPE scaling lacks a key its type needs, or holds a non-number, is refused naming it
    when the directory is opened (`generate --model`, `train.init_from`), not met as a KeyError or TypeError
    traceback in the first forward pass (training's validate caught it; loading for inference did not)."""
    import json
    from helpers import save_hf
    save_hf("llama", tmp_path, with_tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {**rope, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(message)):
        open_hf_dir(tmp_path)


@pytest.mark.timeout(120)
def test_the_weight_files_read_are_those_transformers_reads(tmp_path):
    """A directory holding safetensors files beside the ones its index lists (shards of an earlier download
    left by `huggingface-cli download --local-dir`, another tool's consolidated file) loads the index's files,
    as from_pretrained does: every *.safetensors was read and a stale shard sorting last silently replaced
    the model's tensors. Logits equal transformers' on the same directory."""
    import shutil

    hf_model("llama", seed=1).save_pretrained(tmp_path / "old", max_shard_size="60KB")
    hf_model("llama", seed=2).save_pretrained(tmp_path / "new", max_shard_size="100KB")
    old = sorted(p.name for p in (tmp_path / "old").glob("model-*.safetensors"))
    new = sorted(p.name for p in (tmp_path / "new").glob("model-*.safetensors"))
    assert len(old) > len(new) > 1 and not set(old) & set(new)  # e.g. -of-00004 after -of-00002
    for name in old:
        shutil.copy(tmp_path / "old" / name, tmp_path / "new" / name)
    reads_as_transformers(tmp_path / "new", 16)


@pytest.mark.timeout(120)
def test_an_index_naming_shards_in_a_subdirectory_loads_as_transformers_loads_it(tmp_path):
    """model.safetensors.index.json's weight_map names files relative to the directory, as transformers joins
    them: shards under a subdirectory (none at the top) load, equal to transformers' logits, rather than the
    directory being refused as holding no *.safetensors weights."""
    import json
    import shutil

    hf_model("llama", seed=3).save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / "weights").mkdir()
    for name in set(index["weight_map"].values()):
        shutil.move(tmp_path / name, tmp_path / "weights" / name)
    index["weight_map"] = {k: f"weights/{v}" for k, v in index["weight_map"].items()}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reads_as_transformers(tmp_path, 16)
