"""Parallel strategies, one file each; `build_engine` picks the data-parallel engine of a layout."""
from __future__ import annotations

from torch import nn

from ..config import ConfigError
from .engine import Engine, LocalEngine
from .groups import GroupedEngine, count_once, group_names


def build_engine(model: nn.Module, cfg, mesh, scaler, fill=None) -> Engine:
    """The data-parallel engine for cfg.parallel: one process, classic DP, DDP, or ZeRO stage 1-3 (with
    offload), over the ranks holding the same parameters. Dense parameters reduce over the mesh's `dp+cp`
    group (context parallelism's ranks are replicas too); a parameter placed on another view (an expert:
    "edp") gets an engine of the same kind over that view's group, and `GroupedEngine` steps them as one.
    `fill(name, out)`: the parameters have no storage yet, and the engine writes each one's initial values
    straight into its buffers (ZeRO-3: a unit at a time, each sharded and freed before the next)."""
    groups = group_names(model)
    classic = cfg.parallel.zero_stage == 0 and cfg.parallel.dp_mode == "classic" and mesh.size("dp+cp") > 1
    if list(groups) == ["dp+cp"]:
        engine = _engine(model, cfg, mesh, scaler, fill, "dp+cp")
    elif classic:
        raise ConfigError("parallel.dp_mode = 'classic' reduces every gradient onto one rank: it takes no "
                          "parameters reduced over another group (experts); use DDP or ZeRO")
    else:
        engine = GroupedEngine([_engine(model, cfg, mesh, scaler, fill, view, names, mesh.size("dp+cp"), first=i == 0)
                                for i, (view, names) in enumerate(groups.items())])
    count_once(engine, model, mesh, classic)
    return engine


def _engine(model, cfg, mesh, scaler, fill, view: str, names=None, divisor=None, first: bool = True) -> Engine:
    """The layout's engine over the ranks of mesh view `view`, for `names` (None: every trainable parameter),
    its summed gradients divided by `divisor` (None: the size of the view)."""
    p, group, kw = cfg.parallel, mesh.group(view), {"names": names, "divisor": divisor}
    if p.zero_stage == 3:
        from .zero3 import Zero3Engine
        return Zero3Engine(model, cfg, scaler, group, fill, shard_frozen=first, **kw)
    if p.zero_stage > 0:
        from .zero import ZeroEngine
        return ZeroEngine(model, cfg, scaler, group, fill, **kw)
    if mesh.size(view) == 1:
        return LocalEngine(model, cfg, scaler, fill=fill, names=names, divisor=divisor or 1,
                           free_grads=cfg.train.free_grads and mesh.world == 1)
    if p.dp_mode == "classic":
        from .classic import ClassicEngine
        return ClassicEngine(model, cfg, scaler, group, fill, **kw)
    from .ddp import DDPEngine
    return DDPEngine(model, cfg, scaler, group, fill, **kw)
