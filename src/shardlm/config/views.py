"""Each named group's size and stride in the rank grid: the one definition of the mesh's views, which the
runtime (mesh.py) builds its process groups from and the planner its link choices.

The ranks are a reshaped arange read through two views (mesh.py, after torchtitan's `ParallelDims`):

    dense   (pp, dp, cp, tp)      tp innermost
    experts (pp, edp, ep, tp)     the flattened dp x cp block read as edp x ep, ep innermost

so a group's ranks sit `stride` apart, the product of the degrees of the axes inside it in its view: tp 1,
cp and ep tp, dp tp x cp, edp ep x tp, pp dp x cp x tp. A group of adjacent axes joined by '+' ("dp+cp",
the ranks that hold the same dense parameters) is one line of `size` ranks at its innermost axis's stride.
Pure arithmetic (no torch), so the planner imports it without torch.
"""
from __future__ import annotations

import math
from functools import lru_cache

VIEWS = {"dense": ("pp", "dp", "cp", "tp"), "experts": ("pp", "edp", "ep", "tp")}  # outermost first


def view_shapes(sizes: dict[str, int]) -> dict[str, dict[str, int]]:
    """Each view's axes and degrees, outermost first, from the degrees pp, dp, cp, tp (and ep, 1 if absent)."""
    ep = sizes.get("ep", 1)
    replicas = sizes["dp"] * sizes["cp"]
    if replicas % ep:  # config.check_layout refuses this with the flags' names; here it is a caller's bug
        raise ValueError(f"ep = {ep} must divide dp x cp = {replicas}")
    degrees = {**{a: sizes[a] for a in VIEWS["dense"]}, "ep": ep, "edp": replicas // ep}
    return {name: {a: degrees[a] for a in axes} for name, axes in VIEWS.items()}


def group_span(layout, name: str) -> tuple[int, int]:
    """(size, stride) of the group `name` ("tp", "cp", "dp", "pp", "ep", "edp", or adjacent axes of one view
    joined by '+', as "dp+cp") for a layout: a Layout (anything with pp, dp, cp, tp and ep) or a dict of them."""
    if isinstance(layout, dict):
        return _span(*(layout.get(a, 1) for a in ("pp", "dp", "cp", "tp", "ep")), name)
    return _span(layout.pp, layout.dp, layout.cp, layout.tp, layout.ep, name)


@lru_cache(maxsize=4096)  # the search scores thousands of layouts, each asking for a dozen spans
def _span(pp: int, dp: int, cp: int, tp: int, ep: int, name: str) -> tuple[int, int]:
    axes = name.split("+")
    for view in view_shapes({"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}).values():
        names = list(view)
        if all(a in names for a in axes):
            at = sorted(names.index(a) for a in axes)
            if at != list(range(at[0], at[0] + len(at))):
                raise KeyError(f"{name}: not adjacent axes of one view, so not one line of ranks")
            return math.prod(view[a] for a in axes), math.prod(view[a] for a in names[at[-1] + 1:])
    raise KeyError(f"{name}: no view has the axes {', '.join(axes)} (views: {VIEWS})")


def within_node(layout, name: str, gpus_per_node: int) -> bool:
    """Whether each of the group's lines stays inside one node: its ranks span size x stride consecutive
    ranks, aligned to that span, and nodes hold gpus_per_node consecutive ranks."""
    size, stride = group_span(layout, name)
    return size * stride <= gpus_per_node
