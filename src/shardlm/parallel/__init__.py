"""Parallel strategies, one file each; `build_engine` picks the data-parallel engine of a layout."""
from __future__ import annotations

from torch import nn

from .engine import Engine, LocalEngine


def build_engine(model: nn.Module, cfg, mesh, scaler, fill=None) -> Engine:
    """The data-parallel engine for cfg.parallel over the ranks holding the same parameters (the mesh's
    `dp+cp` group: context parallelism's ranks are replicas too): one process, classic DP, DDP, or ZeRO stage
    1-3 (with offload). `fill(name, out)`: the parameters have no storage yet, and the
    engine writes each one's initial values straight into its buffers (ZeRO-3: a unit at a time, each sharded
    and freed before the next)."""
    p, group = cfg.parallel, mesh.group("dp+cp")
    if p.zero_stage == 3:
        from .zero3 import Zero3Engine
        return Zero3Engine(model, cfg, scaler, group, fill)
    if p.zero_stage > 0:
        from .zero import ZeroEngine
        return ZeroEngine(model, cfg, scaler, group, fill)
    if mesh.size("dp+cp") == 1:
        return LocalEngine(model, cfg, scaler, fill=fill)
    if p.dp_mode == "classic":
        from .classic import ClassicEngine
        return ClassicEngine(model, cfg, scaler, group, fill)
    from .ddp import DDPEngine
    return DDPEngine(model, cfg, scaler, group, fill)
