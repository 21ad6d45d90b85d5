"""generation_config.json: the model's side of when generation stops, as transformers keeps it.

A chat model's end of turn often lives only here (Llama 3 Instruct's eos_token_id [<|end_of_text|>, <|eot_id|>]),
not in the tokenizer's files, and transformers' generate, vLLM and `shardlm serve`/`generate`/`eval` stop at it.
It is the model's file, not the tokenizer's: `Tokenizer.save` (a prepared dataset, whose tokenizer may serve a
model trained from scratch) never writes it. A run takes it from its weights' source (`train.init_from`, or
the checkpoint it resumes) and keeps it in every checkpoint; `shardlm export` writes it, or one made from
config.json's ids as transformers' GenerationConfig.from_model_config makes it.
"""
from __future__ import annotations

import json
from pathlib import Path

GENERATION_CONFIG = "generation_config.json"


def own_generation_config(directory: str | Path | None) -> dict | None:
    """`directory`'s generation_config.json, where it is one written for the model: None where there is none,
    it does not read as a JSON object, or transformers made it from the model class's defaults
    (`_from_model_config`: its ids are config.json's, which know nothing of the tokenizer)."""
    if not directory:
        return None
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
    except (ValueError, OSError):
        return None
    if not isinstance(found, dict) or found.get("_from_model_config"):
        return None
    return found


def derived_generation_config(bos_id: int | None, eos_id: int | None) -> dict:
    """What transformers' GenerationConfig.from_model_config writes for a config.json with these ids."""
    ids = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    return {"_from_model_config": True, **{k: v for k, v in ids.items() if v is not None}}


def with_eos(config: dict, *stops: int | None) -> dict:
    """A generation config that also stops at `stops` (None: none): the run's tokenizer's end-of-text and its chat
    template's end of turn, where shardlm stops (data.instruct.completion_stop_ids). A base fine-tuned to end its turns with another
    token (Qwen2.5's <|im_end|>, set as the data's eos_token) stopped there in shardlm while transformers'
    generate, reading this file, ran past it."""
    have = config.get("eos_token_id")
    ids = have if isinstance(have, list) else [] if have is None else [have]
    new = [t for t in dict.fromkeys(stops) if t is not None and t not in ids]
    return {**config, "eos_token_id": [*ids, *new]} if new else config


def write_generation_config(directory: str | Path, config: dict) -> None:
    (Path(directory) / GENERATION_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def stop_ids_of(tok, generation: dict | None = None) -> tuple[int, ...]:
    """The ids that end a completion, for everything that generates (generate, eval, serve, a run's sample):
    the tokenizer's end-of-text token, the eos_token_id (one or a list) of `generation`, else of the
    generation_config.json beside the tokenizer's files (`own_generation_config`: not one made from the model
    class's defaults), on which transformers' generate and vLLM stop too. What generates stops at these and at
    the chat template's end of turn: data.instruct.completion_stop_ids."""
    ids = [] if tok.eos_id is None else [tok.eos_id]
    found = generation or own_generation_config(getattr(tok, "source", None)) or {}
    extra = found.get("eos_token_id")
    extra = extra if isinstance(extra, list) else [extra]
    ids += [t for t in extra if isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tok.vocab_size
            and t not in ids]
    return tuple(ids)
