"""Weight-only quantisation for inference (gpt-fast's int8 and int4): the blocks' linear layers' weights stored
in 8 or 4 bits with per-channel (int8) or per-group (int4) scales, dequantised inside the matrix product, so
that batch-1 decode, bound by reading the weights, reads half or a quarter of the bytes. Activations,
embeddings, norms and the output head stay in the model's dtype.

int8 is int8.py's (torchao's symmetric per-channel scheme), int4 int4.py's (a scale and a minimum per group of
inputs); each reads its packed weights in Triton products when a step has few rows on a GPU, and elsewhere
(prefill's many rows, the CPU) dequantises the weight whole: the same rounding, none of the speed.
"""
from __future__ import annotations

from torch import nn

from ..config import ConfigError
from .int4 import GROUPS, to_int4
from .int8 import to_int8

KINDS = ("none", "int8", "int4")
INT4_GROUPS = GROUPS  # the largest of these that divides a layer's input size is its int4 group


def quantize(model: nn.Module, kind: str) -> int:
    """Quantise the blocks' linear layers of `model` in place to `kind` (none, int8, int4); returns how many.
    int4 leaves a layer whose input size no group of INT4_GROUPS divides as it is (ConfigError where that is
    every layer)."""
    if kind not in KINDS:
        raise ConfigError(f"--quantize {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "none":
        return 0
    return to_int8(model) if kind == "int8" else to_int4(model)
