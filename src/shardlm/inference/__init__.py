"""Using a trained model: load it (load.py), decode fast with continuous batching over a static KV cache
(engine.py over slots.py and sampler.py), decode simply on any layout (reference.py), and measure
perplexity (perplexity.py)."""
from __future__ import annotations

from typing import Callable, Sequence

from ..model import Decoder
from ..parallel.tensor import tensor_parallel_group
from .engine import Engine, Request
from .load import inference_dtype, load_pretrained
from .perplexity import evaluate_ids
from .request import prompt_context
from .reference import generate_ids, generate_text, prompt_ids, sample_next, until_eos
from .sampler import SamplingParams
from .slots import slots_that_fit

__all__ = ["Engine", "Request", "SamplingParams", "evaluate_ids", "generate_ids", "generate_many",
           "generate_text", "inference_dtype", "load_pretrained", "prompt_context",
           "prompt_ids", "sample_next", "slots_that_fit",
           "until_eos"]


def generate_many(model: Decoder, prompts: list[list[int]], max_new_tokens: int, stop_ids: Sequence[int] = (),
                  batch_size: int = 8, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0, compile: bool | None = None, progress: Callable | None = None,
                  vocab: int | None = None) -> list[list[int]]:
    """The new tokens of every prompt (token ids), in order, each cut before its first of `stop_ids`
    (data.instruct.completion_stop_ids': the end of text and a chat model's end of turn), all of them
    through one engine of up to `batch_size` slots, longest prompts first. Prompt i samples with seed
    `seed + i`, the same tokens whatever the batch. `progress(n)`: told of every n finished. `vocab`: the
    tokenizer's ids, past which the model's rows are never drawn (Engine's)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be at least 1")
    limit = model.cfg.max_seq_len
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {i + 1} has no tokens")
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"prompt {i + 1} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the model's max_seq_len {limit}")
    if not prompts:
        return []
    max_len = max(len(p) for p in prompts) + max_new_tokens
    # Under tensor parallelism the fewest slots any rank's memory holds: ranks that each took their own count
    # batched the prompts differently, and their steps' collectives no longer met.
    slots = slots_that_fit(model, max_len, min(batch_size, len(prompts)), group=tensor_parallel_group(model),
                           shorter="shorten the longest prompt or --max-new-tokens")
    engine = Engine(model, slots, max_len, compile=compile, vocab=vocab)
    stops = tuple(stop_ids)
    requests = [Request(list(p), max_new_tokens, SamplingParams(temperature, top_k, top_p, seed + i), stops)
                for i, p in enumerate(prompts)]
    engine.run(sorted(requests, key=lambda r: -len(r.prompt)), progress)
    return [r.completion for r in requests]
