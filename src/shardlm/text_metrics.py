"""Scores of generated text against references, and the files they come from: prompts with references, and the
loss task's plain text.

BLEU (Papineni et al. 2002) and chrF (Popović 2015) are corpus scores computed by sacrebleu (Post 2018)
with its default tokenisation, so they compare with published sacrebleu numbers. ROUGE-1, ROUGE-2 and
ROUGE-L (Lin 2004) are F1 scores per example by Google's rouge-score (lowercased, Porter-stemmed),
averaged over the examples. All five are on a 0-100 scale.
"""
from __future__ import annotations

import re
from pathlib import Path

from .config import ConfigError
from .extras import import_optional
from .data.jsonl import objects

# A task and the scores it reports.
TASKS = {"bleu": ("bleu", "chrf"), "rouge": ("rouge1", "rouge2", "rougeL")}
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def parse_tasks(spec: str) -> list[str]:
    """`bleu,rouge` -> ["bleu", "rouge"]; `loss` (perplexity over a text file) is a task of its own."""
    tasks = list(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))  # loss,loss is loss alone
    known = ("loss", *TASKS)
    for t in tasks:
        if t not in known:
            raise ConfigError(f"--tasks: unknown task {t!r} (known: {', '.join(known)})")
    if not tasks:
        raise ConfigError(f"--tasks is empty (known: {', '.join(known)})")
    if "loss" in tasks and len(tasks) > 1:
        raise ConfigError("--tasks: loss reads a text file and the others a jsonl file of prompts and "
                          "references; run them separately")
    return tasks


def read_examples(path: str | Path, tasks=()) -> tuple[list, list[str]]:
    """Prompts and references of a jsonl file: one object per line with `prompt` and `completion` (or
    `reference`), both strings, or a chat as training reads it (`messages`), whose last turn, the assistant's,
    is the reference and the turns before it the prompt (a list, for the model's chat template). Blank lines
    are skipped. A reference no completion could score against is refused naming its line: an empty one, or,
    for `tasks` with rouge, one in which rouge-score's tokeniser finds no word."""
    from .config.input_files import input_file
    path = Path(path)
    input_file(path, "--data")
    prompts, refs = [], []
    for where, obj, _ in objects(path, ConfigError, " with prompt and completion"):
        if "messages" in obj and "prompt" not in obj:  # held-out chats of the data a run trained on
            turns = obj["messages"]
            if not (isinstance(turns, list) and len(turns) > 1 and all(
                    isinstance(m, dict) and isinstance(m.get("content"), str) for m in turns)
                    and turns[-1].get("role") == "assistant"):
                raise ConfigError(f"{where}: messages must be a list of {{role, content: string}} turns ending "
                                  "with the assistant's, the reference, after at least one turn to answer")
            prompts.append(turns[:-1])
            refs.append(_reference(turns[-1]["content"], where, tasks))
            continue
        ref = obj.get("completion", obj.get("reference"))
        if not isinstance(obj.get("prompt"), str) or not isinstance(ref, str):
            raise ConfigError(f"{where}: needs string fields prompt and completion (or reference), or messages, "
                              f"has {', '.join(sorted(obj)) or 'none'}")
        prompts.append(obj["prompt"])
        refs.append(_reference(ref, where, tasks))
    if not prompts:
        raise ConfigError(f"--data {path}: no examples (expected one JSON object per line)")
    return prompts, refs


def _reference(ref: str, where: str, tasks) -> str:
    # ROUGE scored such a reference 0 whatever was generated, and pulled the mean down without a word: an empty
    # one even against an empty completion, and one in which rouge-score's tokeniser (a-z and 0-9 only) finds
    # no word, a Chinese or Russian one even against an exact copy. BLEU and chrF score both (corpus-level).
    if "rouge" in tasks and not _ROUGE_WORDS.findall(ref.lower()):
        what = "is empty" if not ref.strip() else f"{ref[:40]!r} has no word rouge-score's tokeniser keeps (a-z, 0-9)"
        raise ConfigError(f"{where}: the reference {what}, so its ROUGE is 0 whatever is generated: give its "
                          "reference or drop the example, or score this data with --tasks bleu (BLEU and chrF "
                          "compare characters of any script)")
    return ref


# rouge-score's DefaultTokenizer keeps the runs of these (rouge_score/tokenize.py): a reference with none is empty
# to it, whatever its stemmer does.
_ROUGE_WORDS = re.compile(r"[a-z0-9]+")


def _require(module: str, package: str):
    return import_optional(module, package, "scoring", f"scoring needs the {package} package: pip install "
                           f"{package} (or pip install 'shardlm[eval]')", ConfigError)


def require_scorers(tasks: list[str]) -> None:
    """The packages that score `tasks`, looked for before a model loads: they were imported only once every
    completion had been generated, which a missing one then threw away."""
    if "bleu" in tasks:
        _require("sacrebleu", "sacrebleu")
    if "rouge" in tasks:
        _require("rouge_score.rouge_scorer", "rouge-score")


def bleu_scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """Corpus BLEU and chrF of the hypotheses, one reference each."""
    sacrebleu = _require("sacrebleu", "sacrebleu")
    return {"bleu": sacrebleu.corpus_bleu(hyps, [refs]).score, "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score}


def rouge_scores(hyps: list[str], refs: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 over the examples, times 100."""
    rouge_scorer = _require("rouge_score.rouge_scorer", "rouge-score")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_TYPES, 0.0)
    for hyp, ref in zip(hyps, refs):
        s = scorer.score(ref, hyp)  # (target, prediction)
        for k in ROUGE_TYPES:
            totals[k] += s[k].fmeasure
    return {k: 100 * v / len(hyps) for k, v in totals.items()}


def score(hyps: list[str], refs: list[str], tasks: list[str]) -> dict[str, float]:
    """The scores of `tasks` (bleu: BLEU and chrF; rouge: ROUGE-1/2/L), all on a 0-100 scale."""
    if len(hyps) != len(refs) or not hyps:
        raise ValueError(f"{len(hyps)} hypotheses for {len(refs)} references")
    out: dict[str, float] = {}
    if "bleu" in tasks:
        out.update(bleu_scores(hyps, refs))
    if "rouge" in tasks:
        out.update(rouge_scores(hyps, refs))
    return out


def loss_text(path: Path) -> str:
    """The text the loss task (perplexity) scores: the file's characters as they are, refused where not text."""
    # The loss task scores the file's characters as they are: a jsonl's or parquet's syntax would be scored
    # with its text, a perplexity that looks plausible and means nothing.
    if path.suffix.lower() in (".jsonl", ".parquet"):
        raise ConfigError(f"--data {path}: the loss task reads a plain UTF-8 text file, not {path.suffix} (its "
                          "syntax would be scored too); give a .txt file, or --tasks bleu,rouge for prompts "
                          "with completions")
    # Bytes decoded as they are: read_text's universal newlines turned a Windows text's "\r\n" into "\n", a
    # text other than the file's (data prepare reads bytes, and trains on the "\r").
    data = path.read_bytes()
    # NUL is valid UTF-8, so a binary file (a prepared dataset's token shard of ASCII text is one, whole) was
    # scored as text, a perplexity of nothing; data prepare refuses it alike.
    if (nul := data.find(b"\0")) >= 0:
        from .data.prepare import MAGIC
        what = "a prepared dataset's token shard" if data.startswith(MAGIC) else "binary data"
        raise ConfigError(f"--data {path}: {what}, not text (a NUL byte at byte offset {nul}); the loss task reads "
                          "a plain UTF-8 text file")
    try:
        # A byte-order mark (Windows editors write one) is no text: data prepare drops it, and scored here it
        # shifted every window.
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--data {path}: not UTF-8 text (byte offset {e.start}); the loss task reads a plain "
                          "UTF-8 text file") from None
