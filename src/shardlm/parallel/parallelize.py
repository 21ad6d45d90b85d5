"""`parallelize`: the one place that turns the one-device model into this rank's part of the layout, as an
ordered series of transforms, the way torchtitan's `parallelize_llama` reads: the pipeline stage (the
slice of layers this rank holds) -> tensor (and sequence) parallelism, on the meta device -> context
parallelism (each sequence split over ranks, attention exchanging heads for it) -> low-rank adapters (the
rest frozen) -> `train.freeze`'s modules frozen (parallel/freeze.py) -> recomputation -> compilation -> data
parallelism / ZeRO (the engine, over the trainable parameters, which materialises and initialises this
rank's weights in its own buffers, as torchtitan's meta-device init and FSDP2's `to_empty` do) -> the step's seam (a plain forward and backward, or a pipeline
schedule). Mixture-of-experts layers under tensor parallelism (moe_tensor.py: each tp rank routes its own
tokens) and expert parallelism (each MoE layer's block of experts, all-to-all dispatch) follow context
parallelism, in that order, on the meta device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .. import schedules
from ..config import ConfigError
from ..flat import free_storage, materialise
from ..mesh import DeviceMesh
from ..model import Decoder
from ..precision import DTYPES
from . import build_engine
from .async_tp import async_tensor_parallel, unavailable as async_tp_unavailable
from .context import context_parallel
from .engine import Engine
from .expert import expert_parallel, gather_experts
from .forward_backward import ForwardBackward
from .freeze import apply_freeze
from .lora import adapter_names, apply_lora
from .moe_tensor import moe_tensor_parallel
from .qlora import is_nf4, plain, quantize_base, set_nf4
from .pipeline import PipelineSchedule, stage_decoder
from .placement import DataPlacement, gather_full, place, shardings, take_local
from ..sharded_read import as_lazy
from .tensor import sum_partial_gradients, tensor_parallel


@dataclass
class Parallelized:
    """This rank's part of the model, its engine and the step's seam, and the model's state as full tensors."""
    model: Decoder
    engine: Engine
    forward_backward: ForwardBackward | PipelineSchedule
    mesh: DeviceMesh
    specs: dict  # tensor- and expert-parallel shardings by parameter name (empty: neither)

    def symmetric_bytes(self) -> int:
        """Bytes in symmetric memory (the copy engines' buffers: gradient reductions, pipeline transfers),
        which PyTorch's allocator statistics miss."""
        pipeline = getattr(self.forward_backward, "symmetric_bytes", None)
        return self.engine.symmetric_bytes() + (pipeline() if pipeline is not None else 0)

    def gather_full_state(self):
        """(fp32 masters, optimizer state) as full tensors by parameter name on the mesh's main rank (None,
        None elsewhere): gathered over data parallelism by the engine, then on the first data-parallel
        rank's lines only, over tensor parallelism onto its first rank, and over the pipeline's stages."""
        masters, optim = self.engine.gather_full_state()
        sharded = self.engine.frozen_state()  # a collective where ZeRO-3 shards a frozen base
        device = next(self.model.parameters()).device
        if masters is not None:  # frozen experts (train.freeze) are blocks like trained ones: joined over ep too
            masters = {**masters, **{n: plain(p.detach()) for n, p in self.model.named_parameters()
                                     if not p.requires_grad and n not in sharded
                                     and (s := self.specs.get(n)) is not None and s.axis == "ep"}}
        masters, optim = gather_experts(masters, optim, self.specs, self.mesh, device)  # over ep
        if masters is None or self.mesh.coord("dp") or self.mesh.coord("cp"):
            return None, None  # the first replica holds what the others hold
        # Frozen weights (a LoRA run's base) have no masters: saved as the model holds them.
        masters = {**{n: plain(p.detach()) for n, p in self.model.named_parameters()
                       if not p.requires_grad and n not in sharded}, **sharded, **masters}
        if tp_specs := {n: s for n, s in self.specs.items() if s.axis == "tp"}:
            masters = gather_full(masters, tp_specs, self.mesh.tp_group, device)
            optim = gather_full(optim, tp_specs, self.mesh.tp_group, device)
            if masters is None:
                return None, None
        if self.mesh.pp > 1:
            stages = [None] * self.mesh.pp if self.mesh.pp_rank == 0 else None
            dist.gather_object((masters, optim), stages, dst=dist.get_global_rank(self.mesh.pp_group, 0),
                               group=self.mesh.pp_group)
            if stages is None:
                return None, None
            # A tied embedding's copies are equal: the first stage's is the one kept.
            masters = {k: v for m, _ in reversed(stages) for k, v in m.items()}
            optim = {k: v for _, o in reversed(stages) for k, v in o.items()}
        return (masters, optim) if self.mesh.is_main else (None, None)

    def load_full_state(self, masters, optim) -> None:
        """This rank's part of full per-name state (mappings, whose values a sharded checkpoint assembles only
        when read, one at a time): its stage's parameters, its tensor-parallel slices."""
        own = {n for n, _ in self.model.named_parameters()}
        masters = as_lazy(masters).where(lambda k: k in own)
        optim = as_lazy(optim).where(lambda k: k.split("::")[0] in own)
        if self.specs:
            local = lambda k, v: take_local({k: v}, self.specs)[k]  # noqa: E731
            whole = lambda k: k.split("::")[0] not in self.specs  # noqa: E731 - a tensor tp leaves as it is
            masters, optim = masters.mapped(local, whole), optim.mapped(local, whole)
        frozen = {n for n, p in self.model.named_parameters() if not p.requires_grad}
        # Lazily, each read as it is set: a QLoRA base held whole in host memory (as fp32) took 4x the model's bytes.
        rest = self.engine.load_frozen(masters.where(lambda k: k in frozen))
        masters = masters.where(lambda k: k not in frozen)
        with torch.no_grad():
            for name, value in rest.items():
                p = self.model.get_parameter(name)
                if is_nf4(p):  # quantised again (parallel/qlora.py says how closely)
                    set_nf4(self.model.get_submodule(name.rpartition(".")[0]), value.to(p.device, p.dtype), name)
                else:
                    p.copy_(value)
        self.engine.load_full_state(masters, optim)

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if isinstance(self.forward_backward, PipelineSchedule):
            return self.forward_backward.evaluate(x, y).item()
        return self.model(x, y).item()


def parallelize(cfg, mesh: DeviceMesh, device: torch.device, scaler, resuming: bool = False) -> Parallelized:
    """`resuming`: the weights will come from a checkpoint, so `train.init_from` is not read (it may be gone)."""
    t, p, m = cfg.train, cfg.parallel, cfg.model
    if p.tp_async and (why := async_tp_unavailable(p.tp, device)):
        raise ConfigError(f"parallel.tp_async = True needs {why}: the fused kernels move chunks through "
                          "symmetric memory")
    stages = p.pp * p.virtual_stages
    layers_of = schedules.split_layers(m, stages, p.pp_layers) if p.pp > 1 else None
    with torch.device("meta"):
        model = stage_decoder(m, p.pp, p.virtual_stages, mesh.pp_rank, layers_of) if p.pp > 1 else Decoder(m)
    if mesh.tp > 1:
        tensor_parallel(model, mesh.tp_group, p.sp)
    if mesh.cp > 1:
        context_parallel(model, mesh.group("cp"), p.cp_comm)
    moe_tensor_parallel(model, mesh, p.sp)  # MoE layers under tp > 1: each tp rank routes its own tokens
    # each MoE layer's experts, dispatched by all-to-all (ep > 1)
    expert_parallel(model, mesh, p.ep_padded(), p.ep_load_budget)
    if cfg.lora.rank:
        apply_lora(model, cfg.lora)
    if t.freeze:  # train.freeze: checked against the whole model's names, applied to this rank's part
        apply_freeze(model, t.freeze, _whole(cfg) if p.pp > 1 else None)
    model.to(DTYPES[t.precision])  # still on meta: the weights are materialised in their training dtype
    initial = _fill(model, t.init_from if not resuming else "", t.seed, shardings(model))
    fill = None
    if cfg.lora.quantize == "nf4":  # each block's base quantised as soon as it is materialised
        _empty_parameters(model, device)
        quantize_base(model, initial)
        for name, q in model.named_parameters():
            if not is_nf4(q) and q.untyped_storage().size() == 0:
                materialise(q, name, initial)
    else:
        # The engine writes the weights straight into its buffers, so the model never exists twice on the
        # device, and ZeRO-3 fills one unit at a time and keeps only its shard (a 24B model's 16-bit weights
        # are 48 GB): until then the parameters have a device but no storage. A LoRA run's frozen base lies
        # outside the engine's buffers: ZeRO-3 over several ranks shards it the same way, else it is
        # materialised here.
        _empty_parameters(model, device)
        fill = initial
        if not (p.zero_stage == 3 and mesh.size("dp+cp") > 1):  # frozen: a LoRA base, train.freeze
            for name, q in model.named_parameters():
                if not q.requires_grad:
                    materialise(q, name, fill)
    if mesh.tp > 1:
        sum_partial_gradients(model, mesh.tp_group)
    model.set_recompute(t.recompute, offload_to=device if p.offload_activations else None)
    model.loss_chunk = t.loss_chunk_tokens
    model.compile_loss = t.compile and device.type == "cuda"
    model.set_attention(t.attention)
    model.train()
    if t.compile:
        options = async_tensor_parallel(model, mesh.tp_group) if p.tp_async else {}
        ddp = mesh.size("dp+cp") > 1 and p.zero_stage == 0 and p.dp_mode == "ddp" and p.pp == 1
        for i, block in enumerate(model.blocks()):
            # Block 0's backward is the last: DDP reduces its gradients after it, on the critical path,
            # unless they arrive in two parts (bench/README.md measures what that saves).
            if i == 0 and ddp:
                block.compile_in_halves(options=options)
            else:
                block.compile(options=options)
    if p.pp > 1 and m.tie_embeddings and model.last and not model.first:  # the head's copy of the embedding
        place(model.embed, DataPlacement(copies=("pp",)))
    engine = build_engine(model, cfg, mesh, scaler, fill)
    for e in {engine, *engine.group_engines()}:
        e.prescaled = t.precision == "fp16"
    specs = shardings(model)
    if p.pp == 1:
        step = ForwardBackward(model, engine, scaler, (t.moe_aux_loss_coef, t.moe_z_loss_coef))
        return Parallelized(model, engine, step, mesh, specs)
    table = schedules.schedule(p.pp_schedule, p.pp, p.virtual_stages, cfg.grad_accum_steps)[mesh.pp_rank]
    seq_here = t.seq_len // mesh.cp // (mesh.tp if p.sp else 1)  # a stage's output holds its slice of the sequence
    tied = mesh.group("pp_ends") if (m.tie_embeddings and (model.first or model.last) and model.embed is not None
                                     and model.embed.weight.requires_grad) else None  # frozen: LoRA, train.freeze
    step = PipelineSchedule(model, engine, scaler, mesh, table, layers_of, (t.micro_batch_size, seq_here, m.hidden_size),
                            tied, p.pp_transfer, (t.moe_aux_loss_coef, t.moe_z_loss_coef))
    return Parallelized(model, engine, step, mesh, specs)


def _whole(cfg) -> Decoder:
    """The one-process model on meta (with its adapters): the names train.freeze is checked against."""
    with torch.device("meta"):
        whole = Decoder(cfg.model)
    if cfg.lora.rank:
        apply_lora(whole, cfg.lora)
    return whole


def _empty_parameters(model: nn.Module, device: torch.device) -> None:
    """The meta model's parameters on `device` with no storage (a tied parameter stays one parameter)."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, q in list(module.named_parameters(recurse=False)):
            if id(q) not in done:
                real = torch.empty_like(q, device=device)
                free_storage(real)
                done[id(q)] = nn.Parameter(real, requires_grad=q.requires_grad)
            setattr(module, name, done[id(q)])


def _fill(model: Decoder, init_from: str, seed: int, specs: dict):
    """`fill(name, out)`: a parameter's initial values, from `train.init_from` where it is set (but a LoRA
    run's adapters' from their initialisation), else from the model's seeded initialisation."""
    load = _initial_weights(model, init_from, specs) if init_from else None
    adapters = adapter_names(model)

    def fill(name: str, out: torch.Tensor) -> None:
        if load is None or name in adapters:
            model.init_parameter(name, out, seed)
        else:
            load(name, out)
    return fill


def _initial_weights(model: Decoder, path: str, specs: dict):
    """A function writing a parameter's `train.init_from` weights, as this rank holds it (its stage's, its
    tensor-parallel slice), into a tensor: one full tensor in memory at a time."""
    from ..model.hf import open_hf_dir
    _, tensors = open_hf_dir(path)
    adapters = adapter_names(model)
    missing = sorted(n for n, _ in model.named_parameters() if n not in adapters and n not in tensors.names)
    if missing:
        raise ConfigError(f"train.init_from = {path!r} lacks {', '.join(missing[:5])}"
                          f"{' ...' if len(missing) > 5 else ''}")

    @torch.no_grad()
    def fill(name: str, out: torch.Tensor) -> None:
        local = take_local({name: tensors(name)}, specs)[name]
        if local.shape != out.shape:
            raise ConfigError(f"train.init_from = {path!r}: {name} is {tuple(local.shape)} for this "
                              f"rank, the model's is {tuple(out.shape)}")
        out.copy_(local)
    return fill
