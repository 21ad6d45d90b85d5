"""`generate` and `eval` given input the model cannot take as asked: each refused in one line naming where, before
any decoding, rather than a traceback or an answer other than the one asked for."""
import json

import pytest

from helpers import TEXT, cli_proc, hf_model, make_tokenizer


@pytest.fixture(scope="module")
def foreign_tokenizer(tmp_path_factory):
    """An HF directory whose model has 100 ids and whose tokenizer has 300 (one not the model's), a text file
    and a jsonl of prompts with references."""
    d = tmp_path_factory.mktemp("foreign")
    hf_model("llama", vocab=100).save_pretrained(d / "hf")
    make_tokenizer(d / "hf")
    (d / "text.txt").write_text(TEXT[:2000])
    (d / "prompts.jsonl").write_text(json.dumps({"prompt": "To be, or not to be", "completion": "that is"}) + "\n")
    return d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["generate", "generate-input", "eval-loss", "eval-bleu"])
def test_token_ids_beyond_the_models_vocabulary_are_named(foreign_tokenizer, how, capsys):
    """A prompt or text whose tokens the model has no embedding for: exit 2 naming the source and the id, not
    the embedding's IndexError (on a GPU, a device-side assert)."""
    d = foreign_tokenizer
    model = ["--model", d / "hf"]
    args = {"generate": ["generate", *model, "--prompt", "To be, or not to be", "--max-new-tokens", "2"],
            "generate-input": ["generate", *model, "--input", d / "prompts.jsonl", "--output", d / f"{how}.jsonl",
                               "--max-new-tokens", "2"],
            "eval-loss": ["eval", *model, "--data", d / "text.txt", "--seq-len", "32"],
            "eval-bleu": ["eval", *model, "--tasks", "bleu", "--data", d / "prompts.jsonl", "--max-new-tokens", "2"],
            }[how]
    if how == "eval-bleu":
        pytest.importorskip("sacrebleu")
    r = cli_proc(capsys, *args)
    assert r.returncode == 2, r.stderr
    assert "is beyond the model's vocabulary of 100: the tokenizer is not the model's" in r.stderr
    where = {"generate": "--prompt", "generate-input": "prompts.jsonl:1", "eval-loss": "text.txt",
             "eval-bleu": "prompts.jsonl: example 1"}[how]
    assert where in r.stderr.splitlines()[-1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny HF Llama with its own tokenizer."""
    d = tmp_path_factory.mktemp("model")
    hf_model("llama").save_pretrained(d)
    make_tokenizer(d)
    return d


def _lines(path, *objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("line, flags, said", [
    ({"prompt": "a", "top_k": 5}, [], "in.jsonl:1: top_k = 5 has no effect at temperature 0"),
    ({"prompt": "a", "temperature": 0, "top_p": 0.5}, ["--temperature", "1"],
     "in.jsonl:1: top_p = 0.5 has no effect at temperature 0"),
    ({"prompt": "a"}, ["--top-p", "0.9"], "--top-p 0.9 has no effect: every --input line decodes greedily"),
    ({"prompt": "a"}, ["--top-k", "3"], "--top-k 3 has no effect: every --input line decodes greedily"),
])
def test_nucleus_and_top_k_where_every_token_is_greedy_are_refused(model_dir, tmp_path, capsys, line, flags, said):
    """An --input line (or the flags, for lines that set no temperature) asking for top-k/top-p sampling at
    temperature 0 was decoded greedily without a word, as --prompt refuses; it is refused naming the line or
    flag."""
    src = _lines(tmp_path / "in.jsonl", {"prompt": "b"}, line) if flags == [] else _lines(tmp_path / "in.jsonl", line)
    said = said.replace("in.jsonl:1", "in.jsonl:2") if flags == [] else said
    r = cli_proc(capsys, "generate", "--model", model_dir, "--input", src, "--output", tmp_path / "out.jsonl",
                 "--max-new-tokens", "2", *flags)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.timeout(120)
def test_flags_shaping_the_lines_that_sample_are_taken(model_dir, tmp_path, capsys):
    """--top-p applies to the lines that set a temperature: not refused where one line samples."""
    src = _lines(tmp_path / "in.jsonl", {"prompt": "a"}, {"prompt": "b", "temperature": 0.8},
                 {"prompt": "c", "temperature": 0, "top_k": 0})
    r = cli_proc(capsys, "generate", "--model", model_dir, "--input", src, "--output", tmp_path / "out.jsonl",
                 "--max-new-tokens", "2", "--top-p", "0.9")
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_seed_that_overflows_for_a_later_line_is_named_before_the_model(model_dir, tmp_path, capsys, command):
    """Line i samples with --seed + i: the largest 64-bit --seed made line 2's seed overflow, reported as
    torch's 'Overflow when unpacking long long' after the model had loaded; now named with its line."""
    src = _lines(tmp_path / "in.jsonl", {"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"})
    seed = str(2**63 - 1)
    if command == "generate":
        args = ["--input", src, "--output", tmp_path / "out.jsonl", "--seed", seed]
        said = "in.jsonl:2: its seed, --seed 9223372036854775807 + 1, does not fit in 64 bits"
    else:
        pytest.importorskip("sacrebleu")
        args = ["--tasks", "bleu", "--data", src, "--seed", seed]
        said = "--seed 9223372036854775807: prompt i samples with --seed + i"
    r = cli_proc(capsys, command, "--model", model_dir, *args, "--max-new-tokens", "2")
    assert r.returncode == 2 and said in r.stderr, r.stderr
    ok = cli_proc(capsys, command, "--model", model_dir, *args[:-1], str(2**63 - 2), "--max-new-tokens", "2",
                  *(["--overwrite"] if command == "generate" else []))
    assert ok.returncode == 0, ok.stderr


@pytest.mark.timeout(120)
def test_an_output_through_a_link_or_to_a_device_keeps_what_it_names(model_dir, tmp_path, capsys):
    """--output a link: its file replaced (with --overwrite), the link kept; a link to /dev/null (or /dev/null
    itself, /dev/stdout, a fifo): written as it is. Both were replaced by a regular file holding the completions."""
    import os
    src = _lines(tmp_path / "in.jsonl", {"prompt": "a"}, {"prompt": "b"})
    mine = tmp_path / "mine.jsonl"
    mine.write_text("the old completions\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(mine)
    r = cli_proc(capsys, "generate", "--model", model_dir, "--input", src, "--output", link, "--max-new-tokens", "2",
                 "--overwrite")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and os.readlink(link) == str(mine)
    assert [json.loads(line)["prompt"] for line in mine.read_text().splitlines()] == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "link.jsonl", "mine.jsonl"]  # no partial left
    if not os.path.exists(os.devnull):
        return
    null = tmp_path / "null.jsonl"
    null.symlink_to(os.devnull)
    r = cli_proc(capsys, "generate", "--model", model_dir, "--input", src, "--output", null, "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    assert null.is_symlink() and os.readlink(null) == os.devnull


@pytest.mark.timeout(120)
@pytest.mark.parametrize("weights", ["huge", "nan"])
def test_eval_json_writes_what_is_not_a_finite_number_as_null(model_dir, tmp_path, capsys, weights):
    """A diverged model: a loss past 709.78 nats a token overflows the perplexity, NaN logits make both NaN, which
    json.dumps wrote as Infinity and NaN, tokens strict JSON parsers refuse."""
    import torch
    from safetensors.torch import load_file, save_file
    huge = tmp_path / "huge"
    huge.mkdir()
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (huge / f.name).write_bytes(f.read_bytes())
    tensors = load_file(model_dir / "model.safetensors")
    # logits of about 1e4: losses far past 709; or NaN logits
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * (1e5 if weights == "huge" else float("nan"))
    save_file(tensors, huge / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "text.txt").write_text(TEXT[:400])
    r = cli_proc(capsys, "eval", "--model", huge, "--data", tmp_path / "text.txt", "--seq-len", "32", "--json")
    assert r.returncode == 0, r.stderr

    def refuse(token):
        raise AssertionError(f"{token} is not JSON")
    got = json.loads(r.stdout, parse_constant=refuse)
    assert got["perplexity"] is None and got["tokens"] > 0, got
    if weights == "huge":
        assert got["loss"] > 709.79 and torch.isfinite(torch.tensor(got["loss"]))
    else:
        assert got["loss"] is None


@pytest.mark.timeout(120)
def test_output_to_dev_stdout_redirected_to_a_file_appends_to_it(model_dir, tmp_path):
    """`--output /dev/stdout >> log`: /dev/stdout resolves to the log, a regular file, which was refused as existing
    and, with --overwrite, replaced (unlinking the file the shell had open); it is appended to."""
    import os
    import subprocess
    import sys
    if not os.path.exists("/dev/stdout"):
        pytest.skip("no /dev/stdout")
    src = _lines(tmp_path / "in.jsonl", {"prompt": "a"}, {"prompt": "b"})
    log = tmp_path / "log.jsonl"
    log.write_text('{"earlier": 1}\n')
    inode = log.stat().st_ino
    with open(log, "a") as out:
        proc = subprocess.run([sys.executable, "-m", "shardlm", "generate", "--model", str(model_dir), "--input",
                               str(src), "--output", "/dev/stdout", "--max-new-tokens", "2"], stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines[0] == {"earlier": 1} and [x["prompt"] for x in lines[1:]] == ["a", "b"], lines
    assert log.stat().st_ino == inode


@pytest.mark.timeout(180)
def test_a_chat_rows_completion_opens_as_serve_and_eval_open_it(tmp_path, capsys):
    """Under a tokenizer whose decoder drops the space opening a text (Llama 2's, Mistral's), `generate --input`
    decoded a chat's answer after its prompt's last token, as a completion continues its prompt: the answer's
    first word kept a space that serve and eval (and transformers) drop, the template placing its own."""
    import torch

    from helpers import sentencepiece_style_tokenizer
    d = tmp_path / "sp"
    tok = sentencepiece_style_tokenizer()
    model = hf_model("llama")
    # Every greedy token a word's start: the output head reads one feature, its sign choosing between two words
    heads = [i for t, i in sorted(tok.get_vocab().items()) if t.startswith("\u2581") and len(t) > 2][:2]
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1
        model.lm_head.weight.zero_()
        model.lm_head.weight[heads[0], 0], model.lm_head.weight[heads[1], 0] = 10, -10
    model.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"}))
    words = ["To be", "or not", "that is"]
    chats = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": "x"}]} for w in words]
    _lines(tmp_path / "chats.jsonl", *chats)
    _lines(tmp_path / "in.jsonl", *({"messages": c["messages"][:1]} for c in chats))
    got = cli_proc(capsys, "generate", "--model", d, "--input", tmp_path / "in.jsonl", "--output",
                   tmp_path / "out.jsonl", "--max-new-tokens", "3", "--temperature", "0")
    assert got.returncode == 0, got.stderr
    generated = [json.loads(line)["completion"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    pytest.importorskip("sacrebleu")
    got = cli_proc(capsys, "eval", "--model", d, "--tasks", "bleu", "--data", tmp_path / "chats.jsonl",
                   "--max-new-tokens", "3", "--json")
    assert got.returncode == 0, got.stderr
    assert generated == json.loads(got.stdout)["completions"]
    assert generated and not any(text.startswith(" ") for text in generated), generated


def test_a_stop_string_that_is_a_special_tokens_text_stops_as_its_id():
    """Generated text leaves special tokens out, so `--stop "<|im_end|>"` (or a line's) would never be seen in
    it: generate and serve split such strings off as stop ids."""
    from shardlm.tokenizer import Tokenizer, byte_tokenizer
    tok = Tokenizer(byte_tokenizer())
    assert tok.split_stops(("<|endoftext|>", "\n\n")) == (("\n\n",), (256,))
    assert tok.text([104, 105, 256]) == "hi" and tok.decode([104, 105, 256]) == "hi<|endoftext|>"
