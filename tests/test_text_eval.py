"""`shardlm eval --tasks bleu,rouge`: the scores, batched generation and the messages for bad input."""
import json

import pytest
import torch

from helpers import cli_here
from shardlm.cli import main
from shardlm.inference import generate_ids, generate_many, load_pretrained, prompt_ids, until_eos
from shardlm.text_metrics import read_examples, score

sacrebleu = pytest.importorskip("sacrebleu")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

PATTERN = "the cat sat on the mat. "
EXAMPLES = [
    {"prompt": "the cat ", "completion": "sat on the mat."},
    {"prompt": "mat. the", "completion": "cat sat on a mat"},  # as long as the first: one batch
    {"prompt": "the cat sat on ", "reference": "a mat"},  # "reference" names the reference too
    {"prompt": "", "completion": "the cat sat"},
    {"prompt": "a dog ", "completion": "sat on the dog."},
]


def library_scores(hyps, refs) -> dict:
    """The libraries run directly, as the module promises: corpus BLEU/chrF, mean ROUGE F1, all times 100."""
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    rouge = [scorer.score(r, h) for h, r in zip(hyps, refs)]
    return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
            **{k: 100 * sum(s[k].fmeasure for s in rouge) / len(rouge) for k in ("rouge1", "rouge2", "rougeL")}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama (HF directory, byte tokenizer) that has learnt PATTERN by heart: its completions are words
    that partly match the references, so the scores are neither 0 nor 100. A few seconds in process, where a
    `shardlm train` run on its default data would only learn to emit spaces."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    from shardlm.model.hf import write_hf_dir
    from shardlm.tokenizer import load_tokenizer
    cfg, tok = load_config("tiny").model, load_tokenizer("byte")
    model = build_model(cfg, seed=0)
    ids = torch.tensor(tok.encode(PATTERN * 20))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        starts = torch.randint(0, len(ids) - 33, (8,), generator=g).tolist()
        batch = torch.stack([ids[s:s + 33] for s in starts])
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5
    out = tmp_path_factory.mktemp("text_eval") / "hf"
    write_hf_dir(model.state_dict(), cfg, out, tok)
    return out


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_scores_equal_the_libraries():
    hyps = ["the cat sat on the mat", "a quick brown fox jumps", "", "running dogs ran"]
    refs = ["the cat is on the mat", "the quick brown fox jumped over", "nothing here", "the dog runs"]
    got = score(hyps, refs, ["bleu", "rouge"])
    assert got == pytest.approx(library_scores(hyps, refs), abs=1e-9)
    assert 0 < got["bleu"] < 100 and 0 < got["rouge1"] < 100
    assert set(score(hyps, refs, ["rouge"])) == {"rouge1", "rouge2", "rougeL"}
    perfect = score(refs[:2], refs[:2], ["bleu", "rouge"])
    assert perfect == pytest.approx(dict.fromkeys(perfect, 100.0))


@pytest.mark.parametrize("batch_size", [2, 8])
def test_batched_greedy_generation_equals_one_prompt_at_a_time(batch_size):
    import dataclasses

    from shardlm.config import load_config
    from shardlm.model import build_model
    # A larger init than the default's 0.02 keeps random logits away from ties that rounding could flip.
    cfg = dataclasses.replace(load_config("tiny").model, init_std=0.2)
    model = build_model(cfg, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    # Lengths 3, 5, 5, 5, 7, 3, 1: groups of one and of several, and a group split over batches of 2.
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 5, 5, 5, 7, 3, 1)]
    alone = [generate_ids(model, torch.tensor([p]), 12)[0].tolist() for p in prompts]
    assert generate_many(model, prompts, 12, batch_size=batch_size) == alone
    # An end-of-text token that some rows produce mid-way: those rows end before it, the others run on.
    eos = alone[2][4]
    want = [until_eos(a, eos) for a in alone]
    assert any(len(w) < 12 for w in want) and any(len(w) == 12 for w in want)
    assert generate_many(model, prompts, 12, stop_ids=(eos,), batch_size=batch_size) == want


def test_eval_cli_scores_its_completions(model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", EXAMPLES)
    r = json.loads(cli_here(capsys, "eval", "--model", model_dir, "--tasks", "bleu,rouge", "--data", data, "--json",
                            "--max-new-tokens", 16, "--batch-size", 2))
    prompts, refs = read_examples(data)
    assert r["examples"] == len(EXAMPLES) and len(r["completions"]) == len(EXAMPLES)
    assert {k: r[k] for k in ("bleu", "chrf", "rouge1", "rouge2", "rougeL")} == pytest.approx(
        library_scores(r["completions"], refs), abs=1e-9)
    assert all(0 < r[k] < 100 for k in ("bleu", "chrf", "rouge1", "rouge2", "rougeL")), r
    # The completions are those of one prompt at a time, cut at the end-of-text token.
    model, tok, _ = load_pretrained(model_dir)
    alone = [tok.decode(until_eos(generate_ids(model, torch.tensor([prompt_ids(tok, p)]), 16)[0].tolist(),
                                  tok.eos_id)) for p in prompts]
    assert r["completions"] == alone
    assert main(["eval", "--model", str(model_dir), "--tasks", "rouge", "--data", str(data), "--max-new-tokens", "4"]) == 0
    table = capsys.readouterr().out
    assert "rougeL" in table and "bleu" not in table and "5 examples" in table


def test_held_out_chats_are_scored_through_the_models_chat_template(model_dir, tmp_path, capsys):
    """A run fine-tuned on messages jsonl could not be scored on its held-out chats ("needs string fields prompt
    and completion"): the turns before the last are the prompt, rendered as training and serve render them, and
    the last, the assistant's, the reference."""
    import shutil
    chat_model = tmp_path / "chat"
    shutil.copytree(model_dir, chat_model)
    config = json.loads((chat_model / "tokenizer_config.json").read_text()) \
        if (chat_model / "tokenizer_config.json").is_file() else {}
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    (chat_model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    turns = [{"role": "user", "content": "the cat "}, {"role": "assistant", "content": "sat on the mat."}]
    chats = write_jsonl(tmp_path / "c.jsonl", [{"messages": turns}])
    plain = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "[user]the cat [assistant]",
                                                "completion": "sat on the mat."}])
    run = lambda data: json.loads(cli_here(capsys, "eval", "--model", chat_model, "--tasks", "bleu",  # noqa: E731
                                           "--data", data, "--json", "--max-new-tokens", 8))
    assert run(chats) == run(plain)
    import shardlm.inference.load as load
    with pytest.MonkeyPatch.context() as mp:  # refused on the tokenizer, before the weights load
        mp.setattr(load, "Decoder", lambda *a, **k: pytest.fail("the model was built"))
        assert main(["eval", "--model", str(model_dir), "--tasks", "bleu", "--data", str(chats)]) == 2
    assert "holds chats (messages) and the model's tokenizer has no chat template" in capsys.readouterr().err
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": turns[:1]}])
    assert main(["eval", "--model", str(model_dir), "--tasks", "bleu", "--data", str(bad)]) == 2
    assert "b.jsonl:1: messages must be a list of {role, content: string} turns ending with the assistant's" in \
        capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    def error(*args, model=tmp_path / "no_model"):
        assert main(["eval", "--model", str(model), *map(str, args)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("shardlm eval: error: ")
        return err

    ok = write_jsonl(tmp_path / "ok.jsonl", EXAMPLES[:1])
    # The file is read before the model is loaded: these fail fast without one.
    assert "no such file" in error("--tasks", "bleu", "--data", tmp_path / "missing.jsonl")
    assert "unknown task 'blue'" in error("--tasks", "bleu,blue", "--data", ok)
    assert "run them separately" in error("--tasks", "loss,bleu", "--data", ok)
    assert "needs --seq-len" in error("--tasks", "loss,loss", "--data", ok)  # a repeat is no other task
    assert "no examples" in error("--tasks", "rouge", "--data", write_jsonl(tmp_path / "e.jsonl", ["", " "]))
    bad = write_jsonl(tmp_path / "bad.jsonl", [EXAMPLES[0], "", "{not json"])
    assert f"{bad}:3: not JSON" in error("--tasks", "bleu", "--data", bad)
    no_ref = write_jsonl(tmp_path / "no_ref.jsonl", [EXAMPLES[0], {"prompt": "x", "answer": "y"}])
    assert f"{no_ref}:2: needs string fields prompt and completion" in error("--tasks", "bleu", "--data", no_ref)
    not_obj = write_jsonl(tmp_path / "list.jsonl", ['["x", "y"]'])
    assert f"{not_obj}:1: an array, not an object with prompt and completion" in error("--tasks", "bleu", "--data", not_obj)
    assert "needs --seq-len" in error("--data", ok)
    (tmp_path / "prepared").mkdir()  # what `data prepare` wrote, which a fine-tuning user holds
    (tmp_path / "prepared" / "index.json").write_text("{}")
    assert "is a directory, not a file; it is a prepared dataset, which eval does not read: name it as a run's " \
        "data.eval_path" in error("--data", tmp_path / "prepared", "--seq-len", 16)
    # The other kind of task's flags, once ignored without a word
    assert "--max-new-tokens has no effect on the loss task, which scores the text and generates nothing" in \
        error("--data", ok, "--seq-len", 16, "--max-new-tokens", 64)
    assert "--temperature has no effect on the loss task" in error("--data", ok, "--seq-len", 16, "--temperature", 0)
    assert "--seq-len has no effect on --tasks bleu,rouge: it scores whole completions" in \
        error("--tasks", "bleu,rouge", "--data", ok, "--seq-len", 16)
    # The loss task scores a text file's characters: a jsonl's syntax would be scored as if it were text.
    assert "the loss task reads a plain UTF-8 text file, not .jsonl" in error("--data", ok, "--seq-len", 16, model=tmp_path)
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"abc\xff")
    assert f"--data {binary}: not UTF-8 text (byte offset 3)" in error("--data", binary, "--seq-len", 16, model=tmp_path)


@pytest.mark.timeout(60)
def test_a_reference_no_completion_can_score_against_is_named_before_the_model(tmp_path, capsys):
    """For ROUGE, an empty reference or one in a script rouge-score drops scored 0 against any completion, its own
    text too; now refused naming its line, before --model is read (it does not exist here). BLEU and chrF score
    both (an empty reference against an empty completion 100): refused for them no more."""
    assert score(["你好 世界"], ["你好 世界"], ["rouge"])["rouge1"] == 0  # why: rouge-score keeps a-z and 0-9
    assert score(["a cat sat on the mat", ""], ["a cat sat on the mat", ""], ["bleu"])["bleu"] == pytest.approx(100)
    def error(tasks, rows):
        data = write_jsonl(tmp_path / "d.jsonl", [EXAMPLES[0], *rows])
        assert main(["eval", "--model", str(tmp_path / "no_model"), "--tasks", tasks, "--data", str(data)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err
        return err
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}
    assert "d.jsonl:2: the reference is empty" in error("rouge", [{"prompt": "x", "completion": ""}])
    assert "d.jsonl:3: the reference is empty" in error("bleu,rouge", ["", empty])
    assert "d.jsonl:2: the reference '你好 世界' has no word rouge-score's tokeniser keeps" in \
        error("bleu,rouge", [{"prompt": "x", "completion": "你好 世界"}])
    for rows in ([{"prompt": "x", "completion": "你好 世界"}], [{"prompt": "x", "completion": ""}], ["", empty]):
        assert "no such directory" in error("bleu", rows)  # BLEU scores them: the model is looked for
    assert read_examples(write_jsonl(tmp_path / "ok.jsonl", EXAMPLES), ["rouge"])[1][2] == "a mat"


def test_a_prompt_too_long_for_the_model_is_named(model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "long.jsonl", [EXAMPLES[0], {"prompt": "x" * 125, "completion": "y"}])
    assert main(["eval", "--model", str(model_dir), "--tasks", "bleu", "--data", str(data), "--max-new-tokens", "8"]) == 2
    assert ("long.jsonl: example 2: a prompt of 125 tokens + --max-new-tokens 8 exceeds the model's max_seq_len 128: "
            "lower --max-new-tokens to 3 at most, or shorten the prompt") in capsys.readouterr().err
