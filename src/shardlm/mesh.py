"""The device mesh: ranks laid out as a (pp, dp, tp) grid, tensor parallel innermost so that its heavy
collectives stay inside a node (Narayanan et al. 2021). As in picotron, the grid is a reshaped arange
and each axis's process groups are the grid's lines along that axis.

The layout is validated from the environment torchrun sets, on every rank, before the process group
exists, so a bad layout fails with the same message everywhere and no rank waits in a collective.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import Config, ConfigError, validate


@dataclass
class Mesh:
    world: int = 1
    rank: int = 0
    local_rank: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_group: object = None
    tp_group: object = None
    pp_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world_from_env() -> tuple[int, int, int]:
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))


def build_mesh(dp: int, tp: int, pp: int, timeout: timedelta | None = None) -> Mesh:
    """Groups for an initialised process group (or a single process when none is initialised)."""
    if not dist.is_initialized():
        return Mesh(dp=dp, tp=tp, pp=pp)
    world, rank = dist.get_world_size(), dist.get_rank()
    if dp * tp * pp != world:
        raise ValueError(f"dp ({dp}) x tp ({tp}) x pp ({pp}) = {dp * tp * pp} != world size {world}")
    grid = torch.arange(world).view(pp, dp, tp)
    pp_rank, dp_rank, tp_rank = (int(i) for i in (grid == rank).nonzero()[0])
    mesh = Mesh(world=world, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", 0)), dp=dp, tp=tp, pp=pp,
                dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank)
    # Every rank must create every group, in the same order, even those it is not in. An axis that
    # spans the whole world is the default group itself; one of size 1 needs no group.
    for axis, lines in (("tp", grid.reshape(-1, tp)), ("dp", grid.transpose(1, 2).reshape(-1, dp)),
                        ("pp", grid.permute(1, 2, 0).reshape(-1, pp))):
        size = lines.shape[1]
        if size == world:
            setattr(mesh, f"{axis}_group", dist.group.WORLD)
            continue
        if size == 1:
            continue
        for line in lines.tolist():
            group = dist.new_group(line, timeout=timeout)
            if rank in line:
                setattr(mesh, f"{axis}_group", group)
    return mesh


def init_distributed(cfg: Config) -> Mesh:
    world, rank, local_rank = world_from_env()
    validate(cfg, world)
    if world == 1:
        return Mesh()
    use_cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        # Every rank of the node checks the node's process count, so none goes on into a rendezvous that
        # the ranks without a GPU never join.
        local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", 0)), local_rank + 1)
        gpus = torch.cuda.device_count()
        if local_world > gpus:
            raise ConfigError(f"{local_world} processes on this node need one GPU each, but {gpus} "
                              f"{'is' if gpus == 1 else 'are'} visible: start at most {gpus} per node "
                              f"(torchrun --nproc-per-node {gpus}), or train on the CPU (--train.device cpu)")
        torch.cuda.set_device(local_rank)
    # gloo raises at the timeout. NCCL's watchdog would abort the communicator and let the step go on with
    # the aborted collectives' data: the trainer's own watchdog (runtime/watchdog.py) ends the rank at
    # timeout_s instead, and NCCL's, at twice that, is only the backstop.
    p = cfg.parallel
    timeout = timedelta(seconds=p.timeout_s * (2 if use_cuda else 1))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    return build_mesh(p.dp, p.tp, p.pp, timeout)
