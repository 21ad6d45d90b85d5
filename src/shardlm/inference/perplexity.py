"""Perplexity: the text cut into non-overlapping windows of N tokens, the mean cross-entropy of every
next-token prediction inside them. The last len(ids) % N tokens, fewer than a window, are not scored."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..model import Decoder


@torch.no_grad()
def evaluate_ids(model: Decoder, ids: list[int], seq_len: int, batch_size: int = 8, progress=None) -> dict:
    """Mean next-token cross-entropy (fp32) over non-overlapping windows of seq_len tokens;
    `progress(k)`, where given, after each batch with the k windows it scored (of len(ids) // seq_len)."""
    if seq_len < 2:
        raise ValueError(f"--seq-len {seq_len} must be at least 2")
    if seq_len > model.cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {model.cfg.max_seq_len}")
    n = len(ids) // seq_len
    if n == 0:
        fix = f"lower --seq-len to {len(ids)} at most, or give a longer text" if len(ids) >= 2 else "give a longer text"
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of --seq-len {seq_len}: {fix}")
    device = next(model.parameters()).device
    windows = torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)
    total, count = 0.0, 0
    model.eval()
    for i in range(0, n, batch_size):
        w = windows[i:i + batch_size].to(device)
        logits = model(w[:, :-1]).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
        if progress is not None:
            progress(len(w))
    loss = total / count
    # exp overflows a float past 709.78 nats a token (a diverged model): an infinite perplexity, not a traceback
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return {"loss": loss, "perplexity": perplexity, "tokens": count}
