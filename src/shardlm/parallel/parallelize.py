"""`parallelize`: the one place that turns the one-device model into this rank's part of the layout, as an
ordered series of transforms, the way torchtitan's `parallelize_llama` reads: tensor (and sequence)
parallelism on the meta device -> this rank's weights materialised and initialised -> recomputation ->
compilation -> data parallelism / ZeRO (the engine). Later strategies (pipeline stages, context and
expert parallelism, LoRA) are further transforms in this list.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..mesh import DeviceMesh
from ..model import Decoder
from ..precision import DTYPES
from . import build_engine
from .engine import Engine
from .schedule import ForwardBackward
from .tensor import gather_full, shardings, sum_partial_gradients, take_local, tensor_parallel


@dataclass
class Parallelized:
    """This rank's part of the model, its engine and the step's seam, and the model's state as full tensors."""
    model: Decoder
    engine: Engine
    forward_backward: ForwardBackward
    mesh: DeviceMesh
    specs: dict  # tensor-parallel shardings by parameter name (empty: no tensor parallelism)

    def gather_full_state(self):
        """(fp32 masters, optimizer state) as full tensors by parameter name on the mesh's main rank (None,
        None elsewhere): gathered over data parallelism by the engine, then, on the first data-parallel
        rank's tensor-parallel group only, over tensor parallelism onto its first rank."""
        masters, optim = self.engine.gather_full_state()
        if not self.specs or masters is None:
            return (masters, optim) if self.mesh.is_main else (None, None)
        if self.mesh.dp_rank != 0:  # its tp group holds what dp rank 0's holds
            return None, None
        device = next(self.model.parameters()).device
        masters = gather_full(masters, self.specs, self.mesh.tp_group, device)
        optim = gather_full(optim, self.specs, self.mesh.tp_group, device)
        return (masters, optim) if self.mesh.is_main else (None, None)

    def load_full_state(self, masters: dict, optim: dict) -> None:
        if self.specs:
            masters, optim = take_local(masters, self.specs), take_local(optim, self.specs)
        self.engine.load_full_state(masters, optim)


def parallelize(cfg, mesh: DeviceMesh, device: torch.device, scaler) -> Parallelized:
    t, p = cfg.train, cfg.parallel
    with torch.device("meta"):
        model = Decoder(cfg.model)
    if mesh.tp > 1:
        tensor_parallel(model, mesh.tp_group, p.sp)
    model.to_empty(device=device)
    model.init_weights(t.seed)
    model.to(DTYPES[t.precision])
    if mesh.tp > 1:
        sum_partial_gradients(model, mesh.tp_group)
    model.set_recompute(t.recompute)
    model.loss_chunk = t.loss_chunk_tokens
    model.compile_loss = t.compile and device.type == "cuda"
    model.set_attention(t.attention)
    model.train()
    if t.compile:
        ddp = mesh.dp > 1 and p.zero_stage == 0 and p.dp_mode == "ddp"
        for i, block in enumerate(model.layers):
            # Block 0's backward is the last: DDP reduces its gradients after it, on the critical path,
            # unless they arrive in two parts (bench/README.md measures what that saves).
            if i == 0 and ddp:
                block.compile_in_halves()
            else:
                block.compile()
    engine = build_engine(model, cfg, mesh, scaler)
    specs = shardings(model)
    if specs and engine.opt is not None:
        engine.opt.count_once(_duplicates(engine, specs), mesh.group("pp+tp"))
    return Parallelized(model, engine, ForwardBackward(model, engine, scaler), mesh, specs)


def _duplicates(engine: Engine, specs: dict) -> list[tuple[int, int, int]]:
    """(bucket, lo, hi) ranges of the engine's buckets holding elements another tensor-parallel rank holds too."""
    flat, out = engine.flat, []
    for i, name in enumerate(flat.names):
        spec = specs.get(name)
        if spec is not None:
            b, off = flat.where[i]
            out += [(b, off + lo, off + hi) for lo, hi in spec.duplicates(flat.params[i].shape)]
    return out
