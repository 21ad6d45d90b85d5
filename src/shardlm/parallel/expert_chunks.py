"""Dropless expert parallelism under imbalance: a rank whose experts receive more rows than its budget
(`parallel.ep_load_budget` balanced loads, a balanced load being the rank's own token copies) runs them in
chunks of at most that many rows, each chunk under activation checkpointing, instead of running out of memory
or dropping tokens.

Dropless dispatch (Megatron-core's alltoall dispatcher, torchtitan's, MegaBlocks') lets a rank receive up to
ep times a balanced load, all of one layer's token copies in the ep group; the experts' intermediates for
them ([rows, 2f] gate and up, [rows, f] their product) then grow with whatever the router did. Capacity
routing (GShard, the Switch Transformer, DeepSpeed-MoE's capacity factor) bounds that by dropping the
overflow; this keeps every row and bounds the memory instead: past the budget only each chunk's input (a
view of the arrived rows, which exist anyway) is kept for backward, and the intermediates exist for one
chunk at a time, in forward and again in backward's recomputation (torch's non-reentrant checkpoint; nested
inside a recomputed block it is recomputed with the block). The recomputation is Megatron-core's MoE
recomputation (`--moe-layer-recompute`, the `moe_act` recompute module), which it applies at every load;
here it is applied to an overloaded rank's layer only, whose expert GEMMs then run twice. The arrived rows
themselves ([rows, h], up to ep balanced loads) are not bounded: they are the dispatch's.

Which dispatches need it (parallel/expert.py): the exact one, whose rows arrive in whatever number the
router sent; not the padded one, whose blocks already hold ep balanced loads whatever the routing (its
memory is the worst case by construction, which the planner charges), nor one process, whose experts always
receive exactly its own token copies, one balanced load, never past a budget of at least 1.
"""
from __future__ import annotations

import math
from itertools import accumulate

import torch
from torch.utils.checkpoint import checkpoint


def budget_rows(budget: float, copies: int) -> int:
    """The most rows one pass takes: `budget` balanced loads of `copies` token copies (0: no limit). At least
    one row, so a rank that sent nothing (every copy dropped by capacity) still makes progress."""
    return max(1, math.ceil(budget * copies)) if budget > 0 else 0


def run_in_chunks(experts, rows: torch.Tensor, counts: list[int], size: int, impl: str) -> torch.Tensor:
    """`experts(rows, counts, impl)` over chunks of at most `size` rows: rows sorted by expert, counts[e] of
    them for local expert e. A chunk may cut through an expert's rows; it is given its own per-expert counts
    (those of each expert's rows that fall in it), so the grouped GEMMs see each chunk as a whole batch."""
    ends = list(accumulate(counts))
    starts = [0, *ends[:-1]]
    outs, keep = [], torch.is_grad_enabled()  # evaluation keeps nothing: the chunks alone bound its memory
    for lo in range(0, rows.shape[0], size):
        hi = min(lo + size, rows.shape[0])
        part = torch.tensor([max(0, min(e, hi) - max(s, lo)) for s, e in zip(starts, ends)], device=rows.device)
        # Checkpointed: backward keeps the chunk's input (a view of `rows`) and recomputes the [size, 2f] and
        # [size, f] intermediates, one chunk at a time (autograd runs the later chunk's chain to its end first).
        outs.append(checkpoint(experts, rows[lo:hi], part, impl, use_reentrant=False) if keep
                    else experts(rows[lo:hi], part, impl))
    return torch.cat(outs)
