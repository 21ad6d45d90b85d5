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


def degree(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class TPSharding:
    """How a parameter's full tensor maps to tensor-parallel rank `rank`'s local one. Along `dim` the full
    tensor is the concatenation of `parts` (fused components: q, k, v; gate, up; or one), each split
    evenly over the ranks (rank r keeps its r-th slice) or, where `split` says not, kept whole on every
    rank; the local tensor concatenates what the rank keeps of each. `pad` zero rows after the last part
    make it divisible (a vocabulary padded to a multiple of the degree). `dim` None: every rank holds the
    whole tensor."""
    rank: int
    degree: int
    dim: int | None = None
    parts: tuple[int, ...] = ()
    split: tuple[bool, ...] = ()
    pad: int = 0

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
