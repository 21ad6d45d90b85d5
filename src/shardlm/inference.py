"""Load a trained model (HF directory, shardlm run or checkpoint) and use it: perplexity and generation.

Generation decodes with a KV cache, one prefill then one token per step, as HF's `generate` does;
temperature 0 is greedy. Sampling applies temperature, then top-k, then top-p (Holtzman et al. 2020).
Many prompts decode in batches of prompts of equal token length (`generate_many`): the KV cache and the
positions (RoPE, GPT-2's position embeddings) are shared by the rows of a batch, so left padding would shift
a padded row's positions.
Evaluation cuts the text into non-overlapping windows of N tokens and averages the cross-entropy of
every next-token prediction inside them.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import load_checkpoint
from .config import ModelConfig, config_from_dict
from .model import Decoder, KVCache, build_model
from .model.hf import is_hf_dir, read_hf_dir
from .parallel.lora import merged, read_peft_dir
from .tokenizer import Tokenizer, load_tokenizer


def load_pretrained(path: str | Path, device="cpu", dtype=torch.float32,
                    adapter: str | Path | None = None) -> tuple[Decoder, Tokenizer, ModelConfig]:
    """A model for inference from an HF directory or a shardlm run, with a LoRA run's adapters, or those of a
    PEFT adapter directory `adapter`, merged into its weights."""
    path = Path(path)
    if is_hf_dir(path):
        cfg, state = read_hf_dir(path)
        tok_dir = path
    else:
        ckpt = load_checkpoint(path, with_optimizer=False)
        full = config_from_dict(ckpt["state"]["config"])
        cfg, state, tok_dir = full.model, ckpt["model"], ckpt["path"]
        if full.lora.rank:
            state = merged(state, cfg, full.lora)
    if adapter is not None:
        lora, adapters = read_peft_dir(adapter, cfg)
        state = merged({**state, **adapters}, cfg, lora)
    model = build_model(cfg, device=device, dtype=torch.float32, init=False)
    model.load_state_dict(state, strict=True)
    model = model.to(dtype).eval()
    return model, load_tokenizer(tok_dir), cfg


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
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | None = None) -> torch.Tensor:
    """New tokens only, shape [batch, <= max_new_tokens]; stops early when every row produced eos."""
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
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out.append(nxt)
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        logits = model(nxt[:, None], cache=cache, last_only=True)[:, -1]
    model.train(was_training)
    return torch.stack(out, dim=1) if out else ids.new_zeros((b, 0))


def prompt_ids(tok: Tokenizer, prompt: str) -> list[int]:
    """The prompt's tokens; an empty prompt starts from the end-of-text token, as after a document."""
    ids = tok.encode(prompt)
    if not ids:
        if tok.eos_id is None:
            raise ValueError("the prompt is empty and the tokenizer has no end-of-text token to start from")
        ids = [tok.eos_id]
    return ids


def generate_text(model: Decoder, tok: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> str:
    device = next(model.parameters()).device
    ids = prompt_ids(tok, prompt)
    new = generate_ids(model, torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, top_p,
                       seed, eos_id=tok.eos_id)
    return tok.decode(new[0].tolist())


def until_eos(ids: list[int], eos_id: int | None) -> list[int]:
    """The tokens before the first end-of-text token."""
    return ids[:ids.index(eos_id)] if eos_id in ids else ids


def generate_many(model: Decoder, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None = None,
                  batch_size: int = 8, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int = 0) -> list[list[int]]:
    """The new tokens of every prompt (token ids), in order, each cut before its first `eos_id`.

    Prompts of equal length decode together, up to `batch_size` at a time: the rows of a batch share one
    KV cache position and one set of positions, so prompts are grouped rather than left-padded. Greedy
    decoding gives each prompt the tokens it gets alone (unless batched matmuls' rounding flips a near tie
    of two logits). Sampling draws from one generator per batch, seeded with `seed` plus the batch's number."""
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size} must be at least 1")
    limit = model.cfg.max_seq_len
    for i, ids in enumerate(prompts):
        if not ids:
            raise ValueError(f"prompt {i + 1} has no tokens")
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"prompt {i + 1} ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"the model's max_seq_len {limit}")
    device = next(model.parameters()).device
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    n_batch = 0
    for length in sorted(by_length):
        group = by_length[length]
        for start in range(0, len(group), batch_size):
            rows = group[start:start + batch_size]
            ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long, device=device)
            new = generate_ids(model, ids, max_new_tokens, temperature, top_k, top_p, seed + n_batch, eos_id)
            for i, row in zip(rows, new.tolist()):
                out[i] = until_eos(row, eos_id)
            n_batch += 1
    return out


@torch.no_grad()
def evaluate_ids(model: Decoder, ids: list[int], seq_len: int, batch_size: int = 8) -> dict:
    """Mean next-token cross-entropy (fp32) over non-overlapping windows of seq_len tokens."""
    if seq_len < 2:
        raise ValueError(f"--seq-len {seq_len} must be at least 2")
    if seq_len > model.cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    device = next(model.parameters()).device
    windows = torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)
    total, count = 0.0, 0
    model.eval()
    for i in range(0, n, batch_size):
        w = windows[i:i + batch_size].to(device)
        logits = model(w[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
