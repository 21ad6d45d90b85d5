"""`shardlm export`'s refusals found in an audit: what an --overwrite must never replace."""
import pytest

from helpers import cli_here, cli_proc


@pytest.mark.timeout(120)
def test_adapter_export_never_replaces_its_own_base(tmp_path, capsys):
    """A LoRA run's adapter exported with `--out BASE --overwrite`, BASE being the run's train.init_from (an
    HF directory, so it looked like a previous export), deleted the base model and wrote an adapter whose
    adapter_config.json names that deleted base: the adapter could never be loaded again. It is refused, BASE
    left as it was."""
    base = tmp_path / "base"
    cli_here(capsys, "train", "tiny", "--train.steps", "1", "--out", tmp_path / "pre")
    cli_here(capsys, "export", "--checkpoint", tmp_path / "pre", "--out", base)
    cli_here(capsys, "train", "tiny", "--train.init_from", base, "--train.steps", "1", "--lora.rank", "4",
             "--lora.targets", "q_proj", "--out", tmp_path / "run")
    before = sorted(p.name for p in base.iterdir())
    proc = cli_proc(capsys, "export", "--checkpoint", tmp_path / "run", "--out", base, "--overwrite")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "train.init_from" in proc.stderr and "--merge" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in base.iterdir()) == before and (base / "config.json").is_file()
    # the merged model stands alone: replacing the base with it stays the user's choice
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.timeout(120)
def test_exported_files_are_readable_as_the_umask_allows(tmp_path, capsys):
    """safetensors' save_file makes its file 0600: an export's model.safetensors (and a PEFT adapter's
    adapter_model.safetensors) could be read by its owner alone, while config.json and the tokenizer beside
    it were 0644: a server or a colleague reading a shared export got "Permission denied" on the weights.
    Every file of an export has the mode the umask gives a new file, as save_pretrained's have."""
    import os
    umask = os.umask(0o022)
    try:
        cli_here(capsys, "train", "tiny", "--train.steps", "1", "--lora.rank", "4", "--lora.targets", "q_proj",
                 "--out", tmp_path / "run")
        for out, extra in (("merged", ["--merge"]), ("adapter", [])):
            cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / out, *extra)
            modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / out).iterdir()}
            assert set(modes.values()) == {"0o644"}, modes
    finally:
        os.umask(umask)


@pytest.mark.timeout(120)
def test_export_into_an_empty_directory_keeps_that_directory(tmp_path, capsys):
    """An existing empty --out was swapped out for the scratch directory (renameat2 RENAME_EXCHANGE) and
    deleted: on a mount point (a container's empty volume, `docker -v ...:/out`) the swap failed with
    "Device or resource busy", and `--out .` left the shell in a deleted directory, where `ls` showed nothing.
    The files now go into the directory itself, whose inode is the same after the export."""
    import os
    import shardlm.model.hf as hf
    cli_here(capsys, "train", "tiny", "--train.steps", "1", "--out", tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    inode = os.stat(out).st_ino

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    with pytest.MonkeyPatch.context() as m:  # a failed export leaves the empty directory empty, no scratch in it
        m.setattr(hf, "save_file", full_disk)
        assert cli_proc(capsys, "export", "--checkpoint", tmp_path / "run", "--out", out).returncode == 1
    assert list(out.iterdir()) == [] and os.stat(out).st_ino == inode
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", out)
    assert os.stat(out).st_ino == inode and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("out")] == ["out"]  # no scratch left
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.timeout(120)
def test_an_adapter_export_in_fp16_checks_the_adapter_not_the_base(tmp_path, monkeypatch, capsys):
    """`--dtype fp16` refuses weights beyond fp16's range; for a LoRA run's adapter export it checked the whole
    state, frozen base included, which is not written: a base weight beyond 65504 (a bf16 model's) refused an
    adapter that fits, naming a base weight (and read the whole base, minutes for a 7B checkpoint)."""
    import shardlm.checkpoint as ckpt_mod
    from safetensors.torch import load_file
    cli_here(capsys, "train", "tiny", "--train.steps", "1", "--lora.rank", "4", "--lora.targets", "q_proj",
             "--out", tmp_path / "run")
    load = ckpt_mod.load_checkpoint

    def with_a_large_base_weight(*args, **kwargs):
        out = load(*args, **kwargs)
        model = dict(out["model"].items())
        model["norm.weight"] = model["norm.weight"] * 0 + 1e5
        return {**out, "model": model}
    monkeypatch.setattr(ckpt_mod, "load_checkpoint", with_a_large_base_weight)
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "adapter", "--dtype", "fp16")
    assert all(t.dtype == torch_fp16() for t in load_file(tmp_path / "adapter" / "adapter_model.safetensors").values())
    proc = cli_proc(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "m", "--dtype", "fp16",
                    "--merge")
    assert proc.returncode == 2 and "norm.weight" in proc.stderr  # the merged model writes it: still refused


def torch_fp16():
    import torch
    return torch.float16



@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A Hugging Face directory to fine-tune from: a tiny model's export, with no chat template."""
    root = tmp_path_factory.mktemp("base")
    cli_here(None, "train", "tiny", "--train.steps", "1", "--train.sample_tokens", "0", "--out", root / "pre")
    cli_here(None, "export", "--checkpoint", root / "pre", "--out", root / "hf")
    return root / "hf"


@pytest.mark.timeout(120)
def test_an_adapter_trained_under_a_changed_rope_is_not_exported_as_the_bases(base, tmp_path, capsys):
    """`--model.rope_theta` (or rope_scaling, norm_eps, a window) over train.init_from trains the adapters for
    another model than the base's config.json, which is all a PEFT adapter is applied with (by PEFT, and by
    eval/generate/serve --adapter): the export wrote it without a word, and it ran under the base's RoPE. It is
    refused naming the key and both values; --merge writes the model trained."""
    cli_here(capsys, "train", "tiny", "--train.init_from", base, "--model.rope_theta", "1000000", "--train.steps",
             "1", "--lora.rank", "4", "--lora.targets", "q_proj", "--train.sample_tokens", "0", "--out",
             tmp_path / "run")
    proc = cli_proc(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "adapter")
    assert proc.returncode == 2 and not (tmp_path / "adapter").exists(), (proc.returncode, proc.stderr)
    assert f"model.rope_theta is 1000000.0 here and 10000.0 in {base}'s config.json" in proc.stderr, proc.stderr
    assert "export --merge for the model it trained" in proc.stderr and "Traceback" not in proc.stderr
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "merged", "--merge")
    assert '"rope_theta": 1000000.0' in (tmp_path / "merged" / "config.json").read_text()


@pytest.fixture(scope="module")
def chat_adapter(base, tmp_path_factory):
    """A LoRA run over `base` (whose generation_config.json ends texts at 256 and 65) on chats prepared without a
    chat template, and its adapter export: (base, run, adapter, held-out chat file)."""
    import json
    import shutil
    root = tmp_path_factory.mktemp("chat")
    shutil.copytree(base, root / "base")
    base = root / "base"
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [256, 65]}))
    chats = root / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                                      {"role": "assistant", "content": f"yo {i}"}]}) + "\n"
                             for i in range(40)))
    cli_here(None, "data", "prepare", "--input", chats, "--tokenizer", base, "--out", root / "data")
    cli_here(None, "train", "tiny", "--train.init_from", base, "--data.path", root / "data", "--train.steps", "1",
             "--train.seq_len", "16", "--lora.rank", "4", "--lora.targets", "q_proj", "--train.sample_tokens", "0",
             "--out", root / "run")
    cli_here(None, "export", "--checkpoint", root / "run", "--out", root / "adapter")
    held = root / "held.jsonl"
    held.write_text(chats.read_text().splitlines(keepends=True)[0])
    return base, root / "run", root / "adapter", held


@pytest.mark.timeout(180)
def test_an_adapter_carries_the_chat_template_its_data_was_rendered_in(chat_adapter, capsys):
    """Chats prepared over a base without a chat template are rendered as '<|role|>' turns, a template written
    into the dataset's tokenizer, which the run keeps: its adapter export held no tokenizer, so `eval`/`generate
    --adapter` over the base refused every chat ("no chat template"), and PEFT users had none to load. The
    adapter directory holds the run's tokenizer, which eval/generate --adapter take where the base has no template,
    and the run's generation_config.json, whose end-of-text ids they stop on as they did with the base's."""
    import json

    from shardlm.generation_config import stop_ids_of
    from shardlm.inference.load import load_pretrained
    base, run, adapter, held = chat_adapter
    assert "chat_template" in json.loads((adapter / "tokenizer_config.json").read_text())
    scores = {}
    for model in (["--model", run], ["--model", base, "--adapter", adapter]):
        out = cli_here(capsys, "eval", *model, "--tasks", "bleu", "--data", held, "--max-new-tokens", "4", "--json")
        scores[len(model)] = json.loads(out)["completions"]
    assert scores[2] == scores[4], scores  # the run and its base + adapter: the same prompt, the same greedy tokens
    assert stop_ids_of(load_pretrained(base, adapter=adapter)[1]) == (256, 65)


@pytest.mark.timeout(180)
def test_serve_renders_an_adapters_chats_with_its_own_template_and_ends_them_at_its_stops(chat_adapter):
    """serve took every chat template and stop id from the base: an adapter carrying its run's template was
    refused chats the base has no template for. (No capsys here: uvicorn's logging setup closes every handler's
    stream that is not sys.stderr, and absl's, which rouge-score imports, holds pytest's own.)"""
    import httpx

    from shardlm.data.instruct import chat_prompter
    from shardlm.inference import generate_many, prompt_ids
    from shardlm.inference.load import load_pretrained
    from shardlm.serve.protocol import Models
    from test_serve import TIMEOUT, serving
    base, _, adapter, _ = chat_adapter
    model, tok, _ = load_pretrained(base, adapter=adapter)
    ids = prompt_ids(tok, chat_prompter(tok)([{"role": "user", "content": "hi 0"}]), opened=True)
    want = tok.decode(generate_many(model, [ids], 4, (256, 65), compile=False)[0])
    with serving(base, adapters={"tuned": adapter}) as s:
        asks = {name: httpx.post(s.url + "/v1/chat/completions", timeout=TIMEOUT, json={
            "model": name, "messages": [{"role": "user", "content": "hi 0"}], "max_tokens": 4, "temperature": 0})
            for name in ("tuned", "base")}
    assert asks["tuned"].status_code == 200, asks["tuned"].text
    assert asks["tuned"].json()["choices"][0]["message"]["content"] == want, asks["tuned"].json()
    assert asks["base"].status_code == 400 and "no chat template" in asks["base"].text
    import shutil

    from shardlm.tokenizer import load_tokenizer
    plain = base.parent / "plain"  # the base's tokenizer without its generation_config.json: it stops at 256 alone
    plain.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, plain / name)
    models = Models("base", {"tuned": ""}, 64, load_tokenizer(plain), adapter_toks={"tuned": tok})
    assert (models.stops_of(None), models.stops_of("tuned")) == ((256,), (256, 65))
