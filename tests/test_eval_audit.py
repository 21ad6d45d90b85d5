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


@pytest.mark.timeout(60)
def test_a_chat_template_failing_on_a_held_out_chat_is_one_line(byte_model_dir, tmp_path, capsys):
    """A chat template that fails at render time on a conversation (here: it reads a turn the chat does not have)
    ended eval and generate in a jinja2 UndefinedError's traceback; data prepare names such a line. Now one
    line naming the file."""
    import shutil

    from helpers import cli_proc
    model = tmp_path / "model"
    shutil.copytree(byte_model_dir, model)
    settings = tmp_path / "model" / "tokenizer_config.json"
    config = json.loads(settings.read_text()) if settings.is_file() else {}
    config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
                              "{{ messages[2]['content'] }}"
    settings.write_text(json.dumps(config))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello there"}]}) + "\n")
    r = cli_proc(capsys, "eval", "--model", model, "--tasks", "bleu", "--data", chats, "--max-new-tokens", 2)
    assert r.returncode == 2 and "chats.jsonl: example 1: the model's chat template fails on a conversation" \
        in r.stderr, r.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    r = cli_proc(capsys, "generate", "--model", model, "--input", prompts, "--output", tmp_path / "out.jsonl",
                 "--max-new-tokens", 2)
    assert r.returncode == 2 and "the model's chat template fails on a conversation" in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_an_unreadable_data_file_is_one_line_before_the_model_loads(byte_model_dir, tmp_path):
    """A --data file the user may not read (another user's, on a shared machine) ended eval in a PermissionError's
    traceback once the model had loaded (generate's --input alike). Said in one line, first."""
    import os
    import shutil
    import subprocess
    import sys
    prefix = []
    if os.geteuid() == 0:  # root reads any file: drop the capabilities that let it
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: every file is readable")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    (tmp_path / "t.txt").write_text(TEXT[:600])
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    for path in (tmp_path / "t.txt", tmp_path / "p.jsonl"):
        path.chmod(0)
    cases = ((["eval", "--data", tmp_path / "t.txt", "--seq-len", 32], "--data"),
             (["eval", "--tasks", "bleu", "--data", tmp_path / "p.jsonl"], "--data"),
             (["generate", "--input", tmp_path / "p.jsonl", "--output", tmp_path / "o.jsonl"], "--input"))
    procs = [subprocess.Popen([*prefix, sys.executable, "-m", "shardlm", *map(str, args), "--model",
                               str(byte_model_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, _ in cases]  # side by side: each mostly starts Python
    for (args, flag), proc in zip(cases, procs):
        stderr = proc.communicate(timeout=100)[1]
        assert proc.returncode == 2 and "Traceback" not in stderr, stderr
        assert f"{flag} {args[args.index(flag) + 1]} cannot be read: Permission denied" in stderr, stderr


@pytest.mark.timeout(180)
def test_model_files_the_user_may_not_read_are_named_as_such(byte_model_dir, tmp_path, capsys):
    """Weights the user may not read (another user's run or download): an HF directory's model.safetensors was
    called "truncated, empty or damaged; download or export it again" (safetensors says "No such file" of it),
    and a run's checkpoint ended eval in a PermissionError's traceback."""
    import os
    import shutil
    import subprocess
    import sys
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: every file is readable")
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []
    (tmp_path / "t.txt").write_text(TEXT[:3000])
    cli_here(capsys, "data", "prepare", "--input", tmp_path / "t.txt", "--tokenizer", "byte", "--out", tmp_path / "d")
    cli_here(capsys, "train", "tiny", "--data.path", tmp_path / "d", "--train.steps", 1, "--train.device", "cpu",
             "--train.tensorboard", "false", "--data.eval_windows", 0, "--train.eval_every", 0, "--out", tmp_path / "run")
    hf = tmp_path / "hf"
    shutil.copytree(byte_model_dir, hf)
    locked = [hf / "model.safetensors", *(tmp_path / "run" / "checkpoints").glob("step_*/*.safetensors")]
    for f in locked:
        f.chmod(0)
    procs = [subprocess.Popen([*prefix, sys.executable, "-m", "shardlm", "eval", "--model", str(model), "--data",
                               str(tmp_path / "t.txt"), "--seq-len", "32"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for model in (hf, tmp_path / "run")]
    for proc in procs:
        stderr = proc.communicate(timeout=100)[1]
        assert proc.returncode in (1, 2) and "Traceback" not in stderr, stderr
        assert "cannot be read: Permission denied" in stderr and "damaged" not in stderr, stderr
