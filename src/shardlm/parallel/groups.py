"""Parameter groups: parameters that reduce their gradients over different ranks, stepped as one model.

Dense parameters are replicated over dp x cp and their gradients summed there; an expert split over ep
has its replicas on edp = dp x cp / ep ranks (mesh.py's expert view), whose summed gradients already hold
the tokens the ep group routed to it. Both sums are divided by the same number of data replicas, dp x cp,
so that each is the gradient of the mean loss over the global batch. Each group gets an engine of the
layout's kind (DDP, ZeRO-1/2/3, offload) over its own reduce group, with its own flat buffers and
buckets; `GroupedEngine` steps them together, with one global gradient norm: each rank sums the squares
of the elements it alone owns in every group, one all-reduce adds them over the world (Megatron-core's
`ChainedOptimizer` over its dense and expert distributed optimizers does the same).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .engine import Engine
from .placement import data_placements, shardings
from ..sharded_read import as_lazy


def group_names(model: nn.Module) -> dict[str, list[str]]:
    """The trainable parameters' names by the mesh view that reduces them (`DataPlacement.reduce`), the
    dense group ("dp+cp") first."""
    out: dict[str, list[str]] = {"dp+cp": []}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for name, placement in data_placements(model).items():
        if name in trainable:
            out.setdefault(placement.reduce, []).append(name)
    return {view: names for view, names in out.items() if names}


class GroupedEngine(Engine):
    """One engine per parameter group, driven as one: every call goes to each; the step shares one norm."""

    def __init__(self, engines: list[Engine]):
        if len({e.divisor for e in engines}) != 1:
            raise ValueError("parameter groups must divide their summed gradients by the same number of "
                             f"data replicas, not {[e.divisor for e in engines]}")
        self.engines = engines
        self.divisor = engines[0].divisor
        self.algo = engines[0].algo
        for e in engines[1:]:
            if e.opt is not None:
                e.opt.updates_scaler = False  # fp16's loss scale moves once a step, with the first group

    def group_engines(self) -> list[Engine]:
        return list(self.engines)

    def prepare_backward(self, last: bool) -> None:
        for e in self.engines:
            e.prepare_backward(last)

    def finish_backward(self, last: bool) -> None:
        for e in self.engines:
            e.finish_backward(last)

    @torch.no_grad()
    def optimizer_step(self, lr: float, step: int) -> None:
        owned = sum(e.owned_sumsq() for e in self.engines)
        total = self.engines[0].opt.global_sumsq(owned)
        for e in self.engines:
            e.opt.given_sumsq = total
            e.optimizer_step(lr, step)
            e.opt.given_sumsq = None

    def step_stats(self, step: int) -> tuple[float, int]:
        return [e.step_stats(step) for e in self.engines][0]  # each raises on a non-finite step

    def wait_for_weights(self) -> None:
        for e in self.engines:
            e.wait_for_weights()

    def metrics(self) -> dict:
        return {k: v for e in self.engines for k, v in e.metrics().items()}

    def close(self) -> None:
        for e in self.engines:
            e.close()

    def gather_full_state(self) -> tuple[dict | None, dict | None]:
        parts = [e.gather_full_state() for e in self.engines]  # a collective in each group
        if any(m is None for m, _ in parts):
            return None, None
        return ({k: v for m, _ in parts for k, v in m.items()}, {k: v for _, o in parts for k, v in o.items()})

    def load_full_state(self, masters: dict, state: dict) -> None:
        for e in self.engines:
            own = set(e.flat.names)
            e.load_full_state(as_lazy(masters).where(lambda k, own=own: k in own),
                              as_lazy(state).where(lambda k, own=own: k.split("::")[0] in own))

    def frozen_state(self) -> dict[str, torch.Tensor]:
        return self.engines[0].frozen_state()

    def frozen_shard_pieces(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        return self.engines[0].frozen_shard_pieces()

    def load_frozen(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.engines[0].load_frozen(state)

    def owned_shards(self, which: str) -> dict[str, tuple[int, int, torch.Tensor]]:
        return {k: v for e in self.engines for k, v in e.owned_shards(which).items()}

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [t for e in self.engines for t in e.held_tensors()]

    def symmetric_bytes(self) -> int:
        return sum(e.symmetric_bytes() for e in self.engines)


def count_once(engine: Engine, model: nn.Module, mesh, classic: bool) -> None:
    """Tell each group's optimizer which ranks add their squares into the global gradient norm (the world;
    classic DP: its roots, the only ranks with summed gradients) and which of its elements another rank
    counts: tensor-parallel replicas (their sharding) and copies along an axis (at coordinate > 0)."""
    world = dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None
    norm_group = mesh.group("pp+tp") if classic else world
    specs, placements = shardings(model), data_placements(model)
    for e in engine.group_engines():
        if e.opt is None:
            continue
        flat, out = e.flat, []
        for i, name in enumerate(flat.names):
            b, off = flat.where[i]
            if any(mesh.coord(a) for a in placements[name].copies):
                out.append((b, off, off + flat.params[i].numel()))
            elif (spec := specs.get(name)) is not None:
                out += [(b, off + lo, off + hi) for lo, hi in spec.duplicates(flat.params[i].shape)]
        e.opt.count_once(out, norm_group)
