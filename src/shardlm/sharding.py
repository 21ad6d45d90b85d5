"""How a tensor-parallel parameter's full tensor maps to one rank's local tensor (Megatron-core's tensor-model-
parallel attributes: partition dimension and stride): the pure tensor arithmetic that the parallel layers
(parallel/placement.py tags each parameter with one) and checkpoints (assembling full tensors from any
layout's pieces) share.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPSharding:
    """How a parameter's full tensor maps to tensor-parallel rank `rank`'s local one. Along `dim` the full
    tensor is the concatenation of `parts` (fused components: q, k, v; gate, up; or one), each split
    evenly over the ranks (rank r keeps its r-th slice) or, where `split` says not, kept whole on every
    rank; the local tensor concatenates what the rank keeps of each. `pad` zero rows after the last part
    make it divisible (a vocabulary padded to a multiple of the degree). `dim` None: every rank holds the
    whole tensor. `axis`: the mesh axis whose ranks split it: "tp", or "ep" (routed experts' stacked weights
    in contiguous blocks along dim 0, parallel/expert.py); the arithmetic is the same."""
    rank: int
    degree: int
    dim: int | None = None
    parts: tuple[int, ...] = ()
    split: tuple[bool, ...] = ()
    pad: int = 0
    axis: str = "tp"

    def _sizes(self) -> list[int]:
        sizes = list(self.parts)
        sizes[-1] += self.pad
        return sizes

    def local_sizes(self) -> list[int]:
        """Each part's size along `dim` in the local tensor."""
        return [n // self.degree if s else n for n, s in zip(self._sizes(), self.split)]

    def full_shape(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] = sum(self.parts)
        return tuple(shape)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        if self.pad:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.pad
            full = torch.cat([full, full.new_zeros(pad_shape)], self.dim)
        pieces = full.split(self._sizes(), self.dim)
        return torch.cat([p.chunk(self.degree, self.dim)[self.rank] if s else p
                          for p, s in zip(pieces, self.split)], self.dim)

    def full(self, locals_by_rank: list[torch.Tensor]) -> torch.Tensor:
        if self.dim is None:
            return locals_by_rank[0]
        segments = [t.split(self.local_sizes(), self.dim) for t in locals_by_rank]
        parts = [torch.cat([seg[i] for seg in segments], self.dim) if s else segments[0][i]
                 for i, s in enumerate(self.split)]
        return torch.cat(parts, self.dim).narrow(self.dim, 0, sum(self.parts))

    def duplicates(self, local_shape) -> list[tuple[int, int]]:
        """Element ranges (of the flattened local tensor) that another rank holds too; rank 0 counts them."""
        numel = int(torch.Size(local_shape).numel())
        if self.rank == 0:
            return []
        if self.dim is None:
            return [(0, numel)]
        row = numel // local_shape[0]  # whole parts are rows of dimension 0
        out, start = [], 0
        for n, s in zip(self.local_sizes(), self.split):
            if not s:
                out.append((start * row, (start + n) * row))
            start += n
        return out
