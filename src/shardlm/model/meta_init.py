"""Layers built on the meta device without torch's random init: the model is built there, then materialised
and filled by Decoder.init_weights (or a checkpoint), so the init of a meta tensor fills nothing; and an
embedding's (normal_, whose meta kernel is a Python reference) imports torch's compiler, about a second a
process (model/lazy_compiler.py)."""
from __future__ import annotations

from torch import nn


class NoInitOnMeta:
    """A mixin for nn.Linear and nn.Embedding: torch's init on any device but meta."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Embedding(NoInitOnMeta, nn.Embedding):
    pass
