"""Tiny random Hugging Face models and tokenizers, built locally (no download), as test references."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
        "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. ") * 20


def make_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    """A byte-level BPE trained on TEXT, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


def sentencepiece_style_tokenizer():
    """A byte-fallback BPE that marks word starts as Llama 2's and Mistral's tokenizers do (Metaspace, "<s>" opening
    each text), trained on TEXT: a tokenizers.Tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"] + [
        f"<0x{b:02X}>" for b in range(256)], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def hf_model(kind: str, vocab: int = 300, seed: int = 0):
    """A tiny random transformers model of `kind` (llama, llama3, llama_linear, llama_tied, qwen2, qwen2_window, mistral,
    mistral_window, gpt2, and the mixtures of experts mixtral and qwen2_moe); the _window kinds attend over the
    last 8 positions."""
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=128)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_theta=50000.0))
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        try:
            cfg = tf.LlamaConfig(**common, rope_parameters={**rope, "rope_theta": 500000.0})
        except TypeError:  # transformers 4.x
            cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=rope)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama_linear":  # linear RoPE scaling, a large base, one KV head of head_dim 32 (not 64 / 4)
        rope = {"rope_type": "linear", "factor": 4.0}
        shape = {**common, "num_key_value_heads": 1}
        try:
            cfg = tf.LlamaConfig(**shape, head_dim=32, rope_parameters={**rope, "rope_theta": 5e6})
        except TypeError:  # transformers 4.x
            cfg = tf.LlamaConfig(**shape, head_dim=32, rope_theta=5e6, rope_scaling=rope)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "llama_tied":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif kind == "qwen2_window":  # max_window_layers 0: every layer slides
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=8,
                                                   max_window_layers=0))
    elif kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    elif kind == "mistral_window":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=8))
    elif kind == "mixtral":  # 4 experts, top-2, renormalised
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen2_moe":  # layer 0 dense, layer 1 4 experts (top-2, not renormalised) + the shared expert
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                         mlp_only_layers=[0]))
    elif kind == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=vocab, n_positions=128,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        raise ValueError(kind)
    with torch.no_grad():  # HF zero-initialises biases and sets norms to one: perturb everything
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def save_hf(kind: str, directory: Path, with_tokenizer: bool = True):
    model = hf_model(kind)
    model.save_pretrained(directory)
    if with_tokenizer:
        make_tokenizer(directory)
    return model


def run_cli(*args, check=True, env=None, timeout=240):
    """`python -m shardlm ...` in a subprocess; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "shardlm", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"shardlm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def cli_here(capsys, *args) -> str:
    """`shardlm ...` run in this process (the same command line as run_cli, without starting Python and
    importing torch again); its stdout (capsys: pytest's fixture; None: not captured, ""). A failing command
    raises AssertionError with its stderr."""
    from shardlm.cli import main
    if capsys is not None:
        capsys.readouterr()
    try:
        code = main(list(map(str, args)))
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr() if capsys is not None else ("", "(not captured)")
    if code not in (0, None):
        raise AssertionError(f"shardlm {' '.join(map(str, args))} failed ({code}):\n{out}\n{err}")
    return out


def cli_proc(capsys, *args) -> subprocess.CompletedProcess:
    """`shardlm ...` run in this process, as run_cli(..., check=False) runs it in a subprocess: a CompletedProcess
    with main()'s status and what it printed (capsys: pytest's fixture). An exception main() lets out, which a
    user would see as a traceback, fails the test where it is raised."""
    from shardlm.cli import main
    capsys.readouterr()
    argv = list(map(str, args))
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["shardlm", *argv], 0 if code is None else code, out, err)


def assert_same_export(run: Path, reference: Path, out: Path, rtol: float, atol: float) -> None:
    """`shardlm export` of two runs' checkpoints: the same config.json, tensors equal within the tolerance."""
    from safetensors.torch import load_file
    for name, src in (("got", run), ("want", reference)):
        cli_here(None, "export", "--checkpoint", src, "--out", out / name)
    assert json.loads((out / "got" / "config.json").read_text()) == json.loads((out / "want" / "config.json").read_text())
    got, want = (load_file(out / name / "model.safetensors") for name in ("got", "want"))
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=name)


def matched_to_transformers(kind: str, tmp_path: Path):
    """A tiny transformers model of `kind`, saved and read back as shardlm's: (theirs, ours, our config, our
    state, token ids, their logits), after checking that ours gives the same logits (fp32, atol 1e-5)."""
    from shardlm.model import build_model
    from shardlm.model.hf import read_hf_dir
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
    return ref, ours, cfg, state, ids, expected


def tiny_decoder(overrides: dict):
    """The `tiny` preset's Decoder with `overrides` (LoRA adapters applied where lora.rank is set), initialised
    on the CPU; and its config."""
    import torch

    from shardlm.config import load_config
    from shardlm.model import Decoder
    from shardlm.parallel.lora import apply_lora
    cfg = load_config("tiny", overrides)
    with torch.device("meta"):
        model = Decoder(cfg.model)
    if cfg.lora.rank:
        apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model, cfg


def run_in_tritons_interpreter(module: str, function: str, timeout: int = 220) -> str:
    """`module.function()` (a test module's) in a subprocess under TRITON_INTERPRET=1, which triton reads when it
    is imported: Triton's kernels run on the CPU. pytest.skip where triton is not installed (a CPU build of
    torch) or its interpreter does not run a kernel with this torch; the function's output, else a failure."""
    import importlib.util
    import os

    import pytest
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (a CPU build of torch): its interpreter runs the kernels here")
    here = Path(__file__).resolve().parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(here.parent / "src"), str(here), os.environ.get("PYTHONPATH", "")])}
    probe = ("import torch, triton, triton.language as tl\n"
             "@triton.jit\ndef k(p):\n    tl.store(p + tl.arange(0, 4), tl.arange(0, 4))\n"
             "t = torch.zeros(4, dtype=torch.int32)\nk[(1,)](t)\nassert t.tolist() == [0, 1, 2, 3]\n")
    if subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120).returncode:
        pytest.skip("triton's interpreter does not run a kernel with this torch")
    done = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=here)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def write_jsonl(path: Path, records) -> Path:
    """Each record a JSON line (a str written as it is: a deliberately bad line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def bracket_chat_tokenizer(directory: Path) -> Path:
    """The byte tokenizer saved in `directory` with a chat template that renders each turn as [role]content and
    closes it with the end-of-text token."""
    from shardlm.tokenizer import load_tokenizer
    load_tokenizer("byte").save(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    return directory


def unwritable(tmp_path: Path, name: str) -> Path:
    """A path under a directory this user cannot write (read-only, or for root a kernel filesystem); the test
    skipped where there is none."""
    import os

    import pytest
    if os.geteuid() != 0:  # permissions hold
        ro = tmp_path / "ro"
        ro.mkdir(exist_ok=True)
        ro.chmod(0o555)
        return ro / name
    if os.path.isdir("/sys/kernel"):  # root writes anywhere but a kernel filesystem
        return Path("/sys/kernel") / name
    pytest.skip("no directory this user cannot write")
