"""Bookkeeping of the global gradient norm that clipping uses (Pascanu et al. 2013): the square root of the
sum of squares of every gradient element of the model, counted once, whatever the layout.

Each rank squares the gradient elements it alone owns (its ZeRO shard, or its slice of a replicated
bucket; an element several ranks hold, as a tensor-parallel replica or a tied embedding's copy, is
counted by one of them, from each parameter's placement) and one all-reduce over the world adds them
(optim.py's `count_once`), whatever the parameter groups and their reduce groups. `SliceSquares` takes
the squares as the reduction goes, so that no pass over the whole gradient is left to make after the
last bucket arrives (bench/README.md measures what that saves).
"""
from __future__ import annotations

import itertools

import torch

from .kernels import square_parts, sum_of_squares, sum_of_squares_into


def sum_of_squares_over(parts: list[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of `parts` (this rank's gradient shards, any device) as an fp32 scalar on `device`; the
    caller adds the ranks' sums (an all-reduce carries inf or nan anywhere to every rank)."""
    sumsq = torch.zeros((), device=device, dtype=torch.float32)
    for g in parts:
        sumsq += sum_of_squares(g).to(device)
    return sumsq


class SliceSquares:
    """The sum of squares taken as a bucketed reduction goes: each rank squares its summed slice of a bucket
    as soon as that slice is reduced (on the side stream, while backward runs on); the optimizer adds
    the ranks' totals.
    `slices[b]`: this rank's slice of bucket b."""

    def __init__(self, slices: list[torch.Tensor]):
        self.slices = slices
        self.offsets = [0, *itertools.accumulate(square_parts(s) for s in slices)]
        self.parts = torch.zeros(self.offsets[-1], dtype=torch.float32, device=slices[0].device)

    def add(self, b: int) -> None:
        """Square bucket b's slice (once it holds the summed values), on the current stream."""
        sum_of_squares_into(self.slices[b], self.parts[self.offsets[b]:self.offsets[b + 1]])

    def rank_total(self, out: torch.Tensor) -> None:
        """This rank's share into `out` (0-dim): valid once every bucket of the step has been added."""
        torch.sum(self.parts, 0, out=out)
