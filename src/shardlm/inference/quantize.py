"""Weight-only quantisation for inference (gpt-fast's int8 and int4): the blocks' linear layers' weights stored
in 8 or 4 bits with per-channel (int8) or per-group (int4) scales, dequantised inside the matrix product, so
that batch-1 decode, bound by reading the weights, reads half or a quarter of the bytes. The output head is
stored in int8 for both kinds (QuantizedHead), as gpt-fast quantises its output layer too: its logits pick the
tokens, and int8 per channel barely moves them where int4's groups would; at batch 1 it is the largest single
product (llama2-7b's 262 MB in bf16). Activations, embeddings and norms stay in the model's dtype.

int8 is int8.py's (torchao's symmetric per-channel scheme), int4 int4.py's (a scale and an integer zero point per
group of inputs); each reads its packed weights in Triton products when a step has few rows on a GPU, and elsewhere
(prefill's many rows, the CPU) dequantises the weight whole: the same rounding, none of the speed.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import IGNORE, ConfigError
from ..model.decoder import LMOutput
from ..model.loss import trained_count
from .int4 import int4_block, to_int4
from .int4_format import GROUPS
from .int8 import MAX_ROWS, Int8Linear, int8_block, int8_linear, to_int8

KINDS = ("none", "int8", "int4")
INT4_GROUPS = GROUPS  # the largest of these that divides a layer's input size is its int4 group


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ConfigError(f"--quantize {kind!r} is not one of {', '.join(KINDS)}")


def quantize_block(block: nn.Module, kind: str, kept: set[int]) -> None:
    """One block's linear layers in `kind` (int8, int4) but those in `kept` (int8.unquantised): a model being
    loaded is quantised block by block as each is filled, so that its 16-bit weights never lie on the device
    whole (a 70B model's are 140 GB, its int4 ones 35); `quantize` does the rest."""
    (int8_block if kind == "int8" else int4_block)(block, kept)


def quantize(model: nn.Module, kind: str) -> int:
    """Quantise the blocks' linear layers of `model` in place to `kind` (none, int8, int4) (those quantize_block
    left), and its output head to int8 (quantize_head); returns how many of the blocks' layers are. int4 leaves a
    layer whose input size no group of INT4_GROUPS divides as it is (ConfigError where that is every layer)."""
    check_kind(kind)
    if kind == "none":
        return 0
    swapped = to_int8(model) if kind == "int8" else to_int4(model)
    quantize_head(model)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the 16-bit weights replaced: memory the engine's slots are counted from
    return swapped


class QuantizedHead(nn.Module):
    """The output head with its weight in int8 (int8.py's per-channel scheme), in LMOutput's place: it takes
    the same arguments and ignores the 16-bit weight passed in (the tied embedding's, which the embedding
    keeps for its lookups)."""

    def __init__(self, weight, slab: int = 4096):
        super().__init__()
        n, k = weight.shape
        self.linear = Int8Linear(SimpleNamespace(weight=weight, bias=None, in_features=k, out_features=n))
        self.slab = slab

    def forward(self, h, weight=None, targets=None, chunk: int = 2048, compiled: bool = False):
        if h.numel() // h.shape[-1] <= MAX_ROWS:
            logits = self.linear(h)
        else:
            # Beyond the kernels' rows (a prefill pass of many prompts, eval's windows) int8_linear multiplies by
            # a 16-bit copy of the weight: `slab` outputs at a time, as a whole vocabulary's can be gigabytes.
            w, s = self.linear.weight, self.linear.scale
            logits = torch.cat([int8_linear(h, w[i:i + self.slab], s[i:i + self.slab])
                                for i in range(0, w.shape[0], self.slab)], -1)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, -2), targets.reshape(-1), reduction="sum",
                               ignore_index=IGNORE) / trained_count(targets)


def quantize_head(model: nn.Module) -> bool:
    """`model`'s output head in int8 (QuantizedHead), its 16-bit lm_head dropped; whether it was. A tensor-
    parallel model's vocab-parallel head stays as it is."""
    if type(getattr(model, "output", None)) is not LMOutput:
        return False
    model.output = QuantizedHead(model.head_weight)
    if model.lm_head is not None:
        model.lm_head = None  # head_weight is then the embedding's, passed to QuantizedHead and not read
    return True
