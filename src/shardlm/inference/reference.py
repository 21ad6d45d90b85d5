"""The simple decoder: the model's own growing KV cache, one prefill then one token per step, eager, as
HF's `generate` with its dynamic cache. It runs on any layout the trainer holds (the sample at the end of a
run) and is the reference the fast path (engine.py) is tested against. Temperature 0 is greedy; sampling
applies temperature, then top-k, then top-p (Holtzman et al. 2020).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import ConfigError
from ..model import Decoder, KVCache
from ..tokenizer import Tokenizer


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(model: Decoder, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] = ()) -> torch.Tensor:
    """New tokens only, shape [batch, <= max_new_tokens]; stops early when every row produced one of
    `stop_ids` (data.instruct.completion_stop_ids')."""
    was_training = model.training
    model.eval()
    b, t = ids.shape
    total = t + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({t}) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len {model.cfg.max_seq_len}")
    cache = KVCache(model.cfg, b, total, ids.device, next(model.parameters()).dtype, model.cache_heads())
    gen = torch.Generator(device=ids.device)
    gen.manual_seed(seed)
    logits = model(ids, cache=cache, last_only=True)[:, -1]
    out = []
    done = torch.zeros(b, dtype=torch.bool, device=ids.device)
    stops = torch.tensor(list(stop_ids), dtype=ids.dtype, device=ids.device)
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out.append(nxt)
        if len(stops):
            done |= torch.isin(nxt, stops)
            if bool(done.all()):
                break
        logits = model(nxt[:, None], cache=cache, last_only=True)[:, -1]
    model.train(was_training)
    return torch.stack(out, dim=1) if out else ids.new_zeros((b, 0))


def prompt_ids(tok: Tokenizer, prompt: str, opened: bool = False) -> list[int]:
    """The prompt's tokens after those the tokenizer opens a text with (tok.bos_ids), as training's data
    opens each document, unless the prompt is `opened` already (a chat template places them); an empty
    prompt without them starts from the end-of-text token, as after a document."""
    ids = tok.encode(prompt) if opened else tok.encode_document(prompt)
    if not ids:
        if tok.eos_id is None:
            raise ValueError("the prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [tok.eos_id]
    return ids


def prompt_room(tok: Tokenizer, prompt: str, max_seq_len: int, key: str) -> int:
    """The new tokens `prompt` (the config `key`'s) leaves room for in `max_seq_len`; none is a ConfigError."""
    try:
        n = len(prompt_ids(tok, prompt))
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    if n >= max_seq_len - 1:
        raise ConfigError(f"{key} is {n} tokens, which leaves no room for a sample in model.max_seq_len = "
                          f"{max_seq_len}: shorten it")
    return max_seq_len - n - 1


def generate_text(model: Decoder, tok: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] | None = None) -> str:
    """The completion's text, up to its first of `stop_ids` (default: the tokenizer's completion_stop_ids)."""
    device = next(model.parameters()).device
    ids = prompt_ids(tok, prompt)
    from ..data.instruct import completion_stop_ids
    stops = completion_stop_ids(tok) if stop_ids is None else tuple(stop_ids)
    new = generate_ids(model, torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, top_p,
                       seed, stop_ids=stops)[0].tolist()
    return tok.text(next((new[:i] for i, t in enumerate(new) if t in stops), new))


def until_eos(ids: list[int], eos_id: int | None) -> list[int]:
    """The tokens before the first end-of-text token."""
    return ids[:ids.index(eos_id)] if eos_id in ids else ids
