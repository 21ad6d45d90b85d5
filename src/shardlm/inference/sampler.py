"""Next-token choice on the device, each row with its own settings: greedy, or temperature, then top-k, then
top-p (Holtzman et al. 2020) over what top-k kept, as Hugging Face's samplers order them.

A row draws by the Gumbel-max trick (argmax of logits / T + Gumbel noise samples the softmax exactly), with
noise from a counter-based hash of (the request's seed, the token's position, the vocabulary id), not from
a generator shared by the batch: a request samples the same tokens alone, in any batch, in any slot, and
after any other request, and the whole choice stays inside one compiled graph with no host round trip.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest: the engine holds temperatures in float32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # 0: the whole vocabulary
    top_p: float = 1.0        # 1: no nucleus cut
    seed: int = 0

    def __post_init__(self):
        if not (0 <= self.temperature <= MAX_TEMPERATURE and self.top_k >= 0 and 0 < self.top_p <= 1):
            raise ValueError(f"temperature ({self.temperature}) must lie in [0, {MAX_TEMPERATURE:.4g}], top_k "
                             f"({self.top_k}) must not be negative and top_p ({self.top_p}) must lie in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (Mueller's, from the hash-prospector family) on int64 tensors: every product stays
    below 2^59, so no backend's int64 arithmetic overflows."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def uniform(seed: torch.Tensor, counter: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in (0, 1), float32, a pure function of (seed[b], counter[b], index[b, v]). 23 bits: with
    24, the top value (2^24 - 1 + 0.5) rounds to 2^24 in float32, a u of exactly 1 whose Gumbel noise is +inf,
    which drew that token (one in 2^24 per id, 0.8% of draws at a 128k vocabulary) even where top-k or top-p had
    removed it (-inf + inf is NaN, which argmax picks)."""
    row = _hash32(_hash32((seed & _MASK32) ^ _hash32(counter & _MASK32)) ^ ((seed >> 32) & _MASK32))
    bits = _hash32(row[:, None] ^ _hash32(index))
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """The next token of every row ([b]) from `logits` [b, vocab]; per-row settings are [b] tensors, `counter`
    the position of the token being chosen. A row of temperature 0 takes the argmax."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    vocab = logits.shape[-1]
    scaled, order = (logits / temperature.clamp_min(1e-6)[:, None]).sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    scaled = scaled.masked_fill(rank >= k, float("-inf"))
    probs = scaled.softmax(-1)
    # The smallest prefix whose mass reaches top_p; its first token always stays.
    scaled = scaled.masked_fill(prefix_sums(probs) - probs > top_p[:, None], float("-inf"))
    gumbel = -torch.log(-torch.log(uniform(seed, counter, order)))
    choice = (scaled + gumbel).argmax(-1, keepdim=True)
    drawn = order.gather(-1, choice).squeeze(-1)
    return torch.where(temperature > 0, drawn, greedy)


def prefix_sums(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """x.cumsum(-1) of a [b, n] tensor in two short scans: within blocks of `block`, then over the blocks'
    totals. Inductor splits one scan longer than 8192 over few rows into a two-pass kernel whose code it
    failed to generate on torch 2.11 (a 32k vocabulary at 16 rows, in the compiled decode step)."""
    b, n = x.shape
    blocks = torch.nn.functional.pad(x, (0, -n % block)).view(b, -1, block).cumsum(-1)
    totals = blocks[..., -1]
    return (blocks + (totals.cumsum(-1) - totals)[..., None]).view(b, -1)[:, :n]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)
