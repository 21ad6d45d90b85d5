"""ZeRO-3 for frozen parameters (a LoRA run's base): sharded over the data-parallel ranks like the trained
ones and gathered around each use, but with no master weights, gradients or optimizer state; each rank
keeps its 1/N slice in the model's dtype. Left whole, the base would sit on every rank: the memory that
users of FSDP with LoRA run out of. Gathers are all_gather_into_tensor over the data-parallel group,
issued ahead of use like the trained units' (`parallel.prefetch_units`; zero3.py calls them by role: a
block, the embeddings, the head). QLoRA's 4-bit weights stay whole on every rank (a quarter of the base).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..flat import alloc_storage, free_storage, materialise
from .placement import data_placements
from .qlora import is_nf4


class FrozenShards:
    def __init__(self, model: nn.Module, group, persist_threshold: int, fill=None):
        """`fill(name, out)`: the frozen parameters have no storage yet (parallelize); each unit is filled,
        sharded and freed in turn, and the ones kept whole get their values in place."""
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        parts = model.parts()
        name_of = {id(p): n for n, p in model.named_parameters()}
        roles = {("block", i): [layer] for i, layer in enumerate(parts.layers)}
        roles["embed"] = list(parts.embeddings)
        roles["head"] = [parts.final_norm] + ([parts.head] if parts.head is not None else [])
        # role -> (names, params, full buffer, this rank's shard); small ones stay whole, as zero3's do,
        # and NF4 ones (QLoRA) are whole at a quarter of the bytes already.
        self.units: dict = {}
        self.gathered: dict = {}
        self.pending: dict = {}
        taken = set()
        # Frozen experts split over ep (train.freeze) differ between this group's ranks: each keeps its block
        # whole (their replicas are the edp group's, not this one's).
        placements = data_placements(model)
        elsewhere = {id(p) for n, p in model.named_parameters() if placements[n].reduce != "dp+cp"}
        for role, modules in roles.items():
            params = [p for m in modules for p in m.parameters() if not p.requires_grad and id(p) not in taken
                      and p.numel() > persist_threshold and not is_nf4(p) and id(p) not in elsewhere]
            if not params:
                continue
            taken |= {id(p) for p in params}
            numel = sum(p.numel() for p in params)
            full = torch.empty(-(-numel // self.world) * self.world, dtype=params[0].dtype, device=params[0].device)
            at = 0
            with torch.no_grad():
                for p in params:
                    view = full[at:at + p.numel()].view_as(p)
                    if fill is None:
                        view.copy_(p.detach())
                    else:
                        fill(name_of[id(p)], view)
                    p.data = view
                    at += p.numel()
            shard = self._own(full).clone()
            self.units[role] = ([name_of[id(p)] for p in params], params, full, shard)
            free_storage(full)
            self.gathered[role] = False
        if fill is not None:
            for name, p in model.named_parameters():
                if not p.requires_grad and id(p) not in taken:
                    materialise(p, name, fill)

    def _own(self, full: torch.Tensor) -> torch.Tensor:
        n = full.numel() // self.world
        return full[self.rank * n:(self.rank + 1) * n]

    def issue(self, role) -> None:
        """Start gathering `role`'s frozen weights (a prefetch)."""
        if role not in self.units or self.gathered[role]:
            return
        _, _, full, shard = self.units[role]
        alloc_storage(full)
        self.pending[role] = dist.all_gather_into_tensor(full, shard, group=self.group, async_op=True)
        self.gathered[role] = True

    def gather(self, role) -> None:
        """`role`'s frozen weights whole, before its use."""
        self.issue(role)
        work = self.pending.pop(role, None)
        if work is not None:
            work.wait()

    def release(self, role) -> None:
        if role not in self.units or not self.gathered[role]:
            return
        work = self.pending.pop(role, None)
        if work is not None:
            work.wait()  # it may still be writing into the storage freed next
        free_storage(self.units[role][2])
        self.gathered[role] = False

    def release_all(self) -> None:
        for role in self.units:
            self.release(role)

    def names(self) -> set[str]:
        return {n for names, _, _, _ in self.units.values() for n in names}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every sharded frozen parameter whole, by name (a collective over the group)."""
        out = {}
        for role, (names, params, _, _) in self.units.items():
            held = self.gathered[role]
            self.gather(role)
            out.update({n: p.detach().clone() for n, p in zip(names, params)})
            if not held:
                self.release(role)
        return out

    def shard_pieces(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        """This rank's shard of every sharded frozen parameter, by name: (lo, hi, values) flat ranges of the
        parameter that its shard of the unit holds (none: another rank's shard holds it all), with no collective:
        a sharded checkpoint writes these, and so no rank holds the frozen base whole."""
        out: dict[str, list] = {}
        for names, params, _, shard in self.units.values():
            start, end, at = self.rank * shard.numel(), (self.rank + 1) * shard.numel(), 0
            for name, p in zip(names, params):
                lo, hi = max(start, at), min(end, at + p.numel())
                out[name] = [(lo - at, hi - at, shard[lo - start:hi - start])] if hi > lo else []
                at += p.numel()
        return out

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's slices of full frozen tensors by name (and the whole of any gathered now)."""
        for role, (names, params, full, shard) in self.units.items():
            flat = torch.cat([state[n].reshape(-1).to(full.dtype) for n in names])
            flat = torch.cat([flat, flat.new_zeros(full.numel() - flat.numel())]).to(full.device)
            shard.copy_(self._own(flat))
            if self.gathered[role]:
                full.copy_(flat)

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [("frozen_shards", shard) for _, _, _, shard in self.units.values()]
