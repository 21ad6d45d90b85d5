"""Where each parameter lives on the mesh, as data on its module (Megatron-core's tensor-model-parallel
attributes, `set_tensor_model_parallel_attributes`; torchtitan's DTensor placements): a transform that
shards, copies or keeps a parameter whole tags its module, and initialisation, checkpoints (gather and
re-split by name), the gradient norm (count an element several ranks hold once), the engines' parameter
groups and loading for inference read the tags, never names.

- Along tp: `TPSharding` (`tag`), how the full tensor maps to a rank's local one.
- On the data side: `DataPlacement` (`place`), the mesh view whose ranks hold the parameter's replicas
  and reduce its gradient ("dp+cp"; experts split over ep: "edp"), and the axes over which ranks hold
  equal copies (a pipeline's tied embedding over pp). Untagged parameters are dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..sharding import TPSharding


def degree(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def tag(module: nn.Module, shardings: dict, partial: dict | None = None) -> None:
    """Record on `module` how its direct parameters are sharded, and from which row of dimension 0 on each
    one's gradient is partial (0: all of it), so they survive the module's materialisation."""
    module.shardings = shardings
    module.partial_grads = partial or {}


def replicated(module: nn.Module, group, partial: bool = False) -> nn.Module:
    """Tag a module whose parameters every rank holds whole; `partial`: each rank computes part of their
    gradients (it sees only its slice of the sequence)."""
    names = [n for n, _ in module.named_parameters(recurse=False)]
    tag(module, {n: TPSharding(rank_in(group), degree(group)) for n in names},
         {n: 0 for n in names} if partial else {})
    return module


@dataclass(frozen=True)
class DataPlacement:
    """`reduce`: the mesh view (mesh.py) whose ranks hold this parameter's replicas and sum its gradient;
    `copies`: axes along which ranks hold equal copies of it, counted once by the gradient norm (by the
    rank at coordinate 0 of each)."""
    reduce: str = "dp+cp"
    copies: tuple[str, ...] = ()


DENSE = DataPlacement()


def place(module: nn.Module, placement: DataPlacement, names=None) -> None:
    """Record the data-side placement of `module`'s direct parameters (`names`: of some of them)."""
    names = names if names is not None else [n for n, _ in module.named_parameters(recurse=False)]
    module.data_placements = {**getattr(module, "data_placements", {}), **dict.fromkeys(names, placement)}


def data_placements(model: nn.Module) -> dict[str, DataPlacement]:
    """Every parameter's data-side placement, by name (DENSE where no transform placed it)."""
    return {name: _tags(model, "data_placements").get(name, DENSE) for name, _ in model.named_parameters()}


def _tags(model: nn.Module, attr: str) -> dict:
    out = {}
    for mod_name, module in model.named_modules():
        for name, value in getattr(module, attr, {}).items():
            out[f"{mod_name}.{name}" if mod_name else name] = value
    return out


def shardings(model: nn.Module) -> dict[str, TPSharding]:
    """Every tensor-parallel parameter's sharding, by name (empty for a model that is not sharded)."""
    return _tags(model, "shardings")


# ---- layout-free state: full tensors by name ---------------------------------------------------------

def gather_full(state: dict[str, torch.Tensor], specs: dict[str, TPSharding], group, device) -> dict | None:
    """Full tensors from every rank's local ones (names `param` or `param::key`), gathered tensor by tensor
    onto the group's first rank, in CPU memory (None elsewhere): a model's full state never sits on one
    device, nor on every rank."""
    first = dist.get_global_rank(group, 0)
    mine = dist.get_rank(group) == 0
    out = {} if mine else None
    for key, local in state.items():
        spec = specs.get(key.split("::")[0])
        if spec is None or spec.dim is None or local.dim() == 0:
            if mine:
                out[key] = local.cpu()
            continue
        parts = [torch.empty_like(local, device=device) for _ in range(spec.degree)] if mine else None
        dist.gather(local.to(device).contiguous(), parts, dst=first, group=group)
        if mine:
            out[key] = spec.full([p.cpu() for p in parts])
    return out


def take_local(state: dict[str, torch.Tensor], specs: dict[str, TPSharding]) -> dict:
    """This rank's local tensors from full ones by name (`param` or `param::key`)."""
    out = {}
    for key, full in state.items():
        spec = specs.get(key.split("::")[0])
        out[key] = spec.local(full).contiguous() if spec is not None and full.dim() > 0 else full
    return out
