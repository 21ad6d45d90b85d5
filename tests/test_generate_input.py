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
