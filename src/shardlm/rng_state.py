"""The random-number state a checkpoint holds (rng.pt): every rank's, so that a resumed run draws what the
uninterrupted one would have (dropout over a pipeline stage's layers, which differ in number across stages),
each rank its own where the layout is the one saved, else rank 0's, as every rank started from the seed.
"""
from __future__ import annotations

import torch


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


# What decides how many random numbers each rank draws a step (dropout over the layers a pipeline stage holds).
RNG_LAYOUT = ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "pp_layers")


def rng_layout(parallel) -> list:
    return [getattr(parallel, k) for k in RNG_LAYOUT]


def set_rng_state(state: dict, rank: int = 0, layout: list | None = None) -> None:
    """Restore the RNG state saved; each rank its own where the checkpoint has every rank's (`state["ranks"]`) and
    the layout (`rng_layout`) is the one saved, else rank 0's, as every rank started from the seed."""
    ranks = state.get("ranks")
    if ranks is not None and state.get("layout") == layout and rank < len(ranks):
        state = ranks[rank]
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
