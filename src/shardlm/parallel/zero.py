"""ZeRO stages 1 and 2 over flat, rank-aligned buckets (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"); stage 3 (zero3.py) builds on this engine.

Every bucket is padded to a multiple of N (the data-parallel degree) and rank r owns elements
[r B/N, (r+1) B/N) of each bucket B: its fp32 master weights, Adam moments and reduced gradients are
kept for that slice only (Megatron-LM's distributed optimizer lays shards out the same way).

- Stage 1 shards the optimizer state. Gradients accumulate into full 16-bit bucket buffers; on the last
  micro-step each bucket is reduce-scattered as soon as its gradients are in (overlapping backward), the
  optimizer updates the owned slice, and an all-gather per bucket returns the updated weights. The
  all-gathers are issued in the order the next forward reads the buckets and left in flight: forward
  waits for a bucket only just before the first module that reads it (the embeddings, a block, the
  head), so they overlap its compute (Megatron-LM's distributed optimizer overlaps them likewise).
- Stage 2 also shards gradients. No full gradient buffer exists: as autograd produces a parameter's
  gradient it is copied into its bucket's transient buffer and freed; a complete bucket is
  reduce-scattered into the rank's persistent gradient shard and its buffer freed. This runs on every
  micro-step (as DeepSpeed's stage 2 does), so gradient memory stays at the shard plus the buckets in
  flight. By the copy engines (comm/transport.py), a bucket's gradients stay with their parameters until
  the bucket is complete and are then staged in a symmetric ring with room for the reductions in flight.

The gradient norm is the square root of the sum over ranks of each shard's sum of squares, so it is the
global norm on every rank, and an fp16 overflow anywhere skips the step everywhere.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import resolve_reduce_algo
from ..comm.transport import sharded_transport
from ..flat import FlatParams
from ..model.lazy_compiler import eager
from ..optim import MasterWeightOptimizer
from .buckets import BucketReadiness, reverse_order_buckets
from .engine import Engine
from .offload import HostGradients, OffloadedOptimizer
from .offload_disk import DiskOffloadedOptimizer
from .update_overlap import DelayedUpdate, OverlappedUpdate

# Stage 2 bounds the full-size bucket gradients alive at once by finishing the oldest reduction when
# more than this many are in flight. Finishing one makes the compute stream wait for it, so the bound
# must cover a whole compiled block, whose gradients all arrive at once (about 4 buckets of the default
# 25 MB in a 1B model's block): waiting for the previous bucket alone stalled backward on every bucket
# of the block. Stage 3's buckets are whole blocks already: one in flight suffices there.
REDUCTIONS_IN_FLIGHT = 4


class ZeroEngine(Engine):
    """ZeRO-1 and ZeRO-2 (`parallel.zero_stage`), over `group` (None: one rank)."""

    def __init__(self, model: nn.Module, cfg, scaler, group, fill=None, names=None, divisor: int | None = None):
        """`names`, `divisor`: one parameter group's trainable parameters and the data replicas its summed
        gradients are divided by (parallel/groups.py); None: every parameter, the size of `group`."""
        p = cfg.parallel
        self.fill, self.names = fill, names
        self.cfg, self.group, self.stage = cfg, group, p.zero_stage
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.divisor = divisor or self.world
        self.flat = flat = self._flat_params(model)
        self.reduce_dtype = torch.float32 if p.reduce_dtype == "fp32" else flat.dtype
        if self.world == 1 and p.offload != "none" and self.stage >= 2:
            # Nothing to sum, and the host accumulates in fp32: the 16-bit gradients cross PCIe at half the bytes.
            self.reduce_dtype = flat.dtype
        self.algo = "all_to_all" if group is None else resolve_reduce_algo(p.reduce_algo, group, flat.device)
        # Stages 2 and 3 gather each micro-step's gradients into transient bucket buffers: in the dtype
        # that travels, so a ring reduction's cast to fp32 happens in that copy, not in another pass.
        self.bucket_dtype = self.reduce_dtype if self.algo == "ring" else flat.dtype
        self.in_flight = REDUCTIONS_IN_FLIGHT if self.stage == 2 else 1
        self.transport = sharded_transport(flat, group, self.algo, self.reduce_dtype, self.stage, self.in_flight)
        shards = self._shard_parameters(model)
        self.opt = sharded_optimizer(flat, cfg, scaler, group, shards, params_kept=shards is None)
        # Offloaded stages 2 and 3 accumulate the gradient shards in host memory, not on the GPU.
        self.host_grads = HostGradients(self.opt.host_parts(), flat.device) \
            if self.opt.offloaded and self.stage >= 2 else None
        self.delayed = DelayedUpdate(self.opt, self.host_grads, flat.device, flat.dtype) if p.delayed_update else None
        if p.overlap_update:
            self.opt.overlap = OverlappedUpdate(flat.device, self.host_grads.seconds if self.host_grads else None)
        # Gradient shards: filled by the reduce-scatter (stage 1) or accumulated into (stages 2, 3).
        # Stage 1 reducing in the gradients' own dtype keeps its shard inside the full bucket buffer;
        # otherwise a shard exists from its bucket's first reduction until the step (as FSDP2's sharded
        # gradients do), so forward's activation peak never shares memory with gradients.
        self.grad_shards_in_bucket = self.stage == 1 and self.reduce_dtype == flat.dtype
        self.grad_shards: list[torch.Tensor | None] = [
            self.opt.shard_of(b.grad, b.index) if self.grad_shards_in_bucket else None for b in flat.buckets]
        self.reductions: list = []  # (work, bucket, result, keep), oldest first
        # Stages 2, 3 take each gradient from its parameter as it arrives, except where the transport stages
        # a bucket's gradients itself once the bucket is complete.
        take = self.stage > 1 and not self.transport.stages_gradients
        self.ready = BucketReadiness(flat, self._launch, self._take_grad if take else None)
        self.weight_gathers: dict[int, tuple] = {}  # bucket -> (all-gather of its updated weights, its input)
        self.gather_order = list(range(len(flat.buckets)))
        self._wait_for_weights_in_forward(model)
        if self.opt.offloaded and self.opt.overlap is not None:
            self.opt.overlap.order = self.gather_order

    def _flat_params(self, model: nn.Module) -> FlatParams:
        return FlatParams(model, reverse_order_buckets(model, self.cfg.parallel.bucket_mb, self.names),
                          pad_multiple=self.world, grad_buffers=self.stage == 1, fill=self.fill, names=self.names)

    def _shard_parameters(self, model: nn.Module) -> list | None:
        """Stage 3 turns the parameters into shards here (returning the 16-bit shards); 1 and 2 keep them."""
        return None

    # ---- stages 1, 2: updated weights arrive while the next forward runs ----------------------
    def _wait_for_weights_in_forward(self, model: nn.Module) -> None:
        """Hooks that make forward wait for a bucket's all-gather (or its overlapped update: update_overlap.py)
        just before the first module reading it."""
        if self.world == 1 and not self.cfg.parallel.overlap_update:
            return
        parts = model.parts()
        last = len(parts.layers) + 1
        point = {id(q): i + 1 for i, layer in enumerate(parts.layers) for q in layer.parameters()}
        point.update({id(q): 0 for m in parts.embeddings for q in m.parameters()})
        first = [last] * len(self.flat.buckets)  # where forward first reads a bucket: 0 embeddings, i + 1 block i
        for i, param in enumerate(self.flat.params):
            b = self.flat.where[i][0]
            first[b] = min(first[b], point.get(id(param), last))
        self.first_read = first
        self.gather_order = sorted(range(len(first)), key=lambda b: (first[b], b))
        model.register_forward_pre_hook(self._hook(lambda mod, args: self._wait_weight_gathers(0)))
        for i, block in enumerate(parts.layers):
            block.register_forward_pre_hook(self._hook(lambda mod, args, at=i + 1: self._wait_weight_gathers(at)))
        if parts.final_norm is not None:  # a pipeline stage before the last has none
            parts.final_norm.register_forward_pre_hook(self._hook(lambda mod, args: self._wait_weight_gathers(last)))

    def _hook(self, fn):
        """A hook (a module's, or a tensor's in backward) as it is, or where blocks compile (train.compile) run
        eagerly inside them: its collectives and storage resizes stay out of the graph (a graph break), as
        FSDP2's hooks do under torch.compile."""
        return eager(fn) if self.cfg.train.compile else fn

    def wait_for_weights(self) -> None:
        if self.delayed is not None and self.delayed.land(self._param_shard):
            self._gather_updated_weights()
        self._wait_weight_gathers()

    def owned_shards(self, which: str) -> dict[str, tuple[int, int, torch.Tensor]]:
        self._wait_weight_gathers()  # an overlapped update still writes the masters and moments
        return super().owned_shards(which)

    def gather_full_state(self) -> tuple[dict | None, dict | None]:
        self._wait_weight_gathers()  # an overlapped update still writes the masters
        if self.delayed is None:
            return super().gather_full_state()
        self.delayed.finish()  # the masters of the last step, and beside them the weights the next one uses
        masters, state = super().gather_full_state()
        if state is not None:
            state.update({f"{name}::delayed_weights": self.flat.view(self.flat.buckets[self.flat.where[i][0]].data,
                                                                      i).detach().cpu().clone()
                          for i, name in enumerate(self.flat.names)})
        return masters, state

    def _wait_weight_gathers(self, at: int | None = None) -> None:
        """Wait (the compute stream waits, on GPU) for the weights read at forward point `at` or before;
        None: for all of them."""
        if not self.weight_gathers:
            return
        for b in [b for b in self.weight_gathers if at is None or self.first_read[b] <= at]:
            work, _ = self.weight_gathers.pop(b)
            if work is not None:
                work.wait()

    # ---- gradients -----------------------------------------------------------------------------
    def _take_grad(self, i: int, param: nn.Parameter) -> None:
        """Stages 2, 3: move a fresh gradient into its bucket's transient buffer and free it."""
        bucket = self.flat.bucket_of(i)
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.numel, dtype=self.bucket_dtype, device=self.flat.device)
        self.flat.view(bucket.grad, i).copy_(param.grad)
        param.grad = None

    def _launch(self, b: int) -> None:
        bucket = self.flat.buckets[b]
        if self.transport.stages_gradients:
            # The staging ring keeps `in_flight` consecutive buckets apart: b's range is free once at most
            # `in_flight` - 1 reductions are still running.
            self._drain(keep=self.in_flight - 1)
            self.transport.stage(b)
        elif bucket.grad is None:  # no parameter of this bucket received a gradient this micro-step
            bucket.grad = torch.zeros(bucket.numel, dtype=self.bucket_dtype, device=self.flat.device)
        work, result, keep = self.transport.reduce_scatter(b, self.grad_shards[b] if self.grad_shards_in_bucket else None)
        self.reductions.append((work, b, result, keep))
        self._after_launch(b)
        if self.stage > 1 and not self.transport.stages_gradients:
            self._drain(keep=self.in_flight)

    def _after_launch(self, b: int) -> None:
        """Stage 3 frees the unit whose gradients were just launched."""

    def _drain(self, keep: int = 0) -> None:
        """Finish all but the newest `keep` reductions: fold each into the gradient shard, free its bucket."""
        while len(self.reductions) > keep:
            work, b, result, _ = self.reductions.pop(0)
            if work is not None:
                work.wait()
            out = result()
            if self.host_grads is not None:
                self.host_grads.add(b, out)
            elif self.grad_shards_in_bucket:
                if out is not self.grad_shards[b]:  # the copy engines sum into the shard itself
                    self.grad_shards[b].copy_(out)
            elif self.grad_shards[b] is None:
                self.grad_shards[b] = out
            else:
                self.grad_shards[b] += out
            if self.stage > 1:
                self.flat.buckets[b].grad = None

    def prepare_backward(self, last: bool) -> None:
        self._wait_weight_gathers()  # backward reads the weights too, whatever forward waited for
        if self.stage == 1 and not last:
            return  # stage 1 accumulates full gradients locally until the last micro-step
        if last and self.host_grads is not None:
            self.host_grads.last_micro_batch()
        self.ready.arm()

    def finish_backward(self, last: bool) -> None:
        if not self.ready.active:
            return
        self.ready.flush()
        self._drain()
        if last and self.host_grads is not None:
            self.host_grads.wait()
        self._backward_done()

    def _backward_done(self) -> None:
        """Stage 3 releases what backward kept gathered."""

    def grad_shard(self, b: int) -> torch.Tensor:
        return self.host_grads.host[b] if self.host_grads is not None else self.grad_shards[b]

    # ---- the step ------------------------------------------------------------------------------
    def _param_shard(self, b: int) -> torch.Tensor | None:
        """Where the optimizer writes bucket b's updated 16-bit slice."""
        return self.opt.shard_of(self.flat.buckets[b].data, b)

    @torch.no_grad()
    def optimizer_step(self, lr: float, step: int) -> None:
        self._wait_weight_gathers()
        self._before_step()
        if self.delayed is not None:  # the last step's update lands; this one's runs beside the next step
            landed = self.delayed.land(self._param_shard)
            self.delayed.submit(lr, step, self.grad_factor(), self.grad_sumsq())
            if landed:
                self._gather_updated_weights()
            self.host_grads.step_done()
            return
        if self.opt.step(lr, step, self.grad_shard, self._param_shard, self.grad_factor(), self.grad_sumsq()):
            self._gather_updated_weights()
        if self.stage == 1:
            self.flat.zero_grad()
        if self.host_grads is not None:
            self.host_grads.step_done()
        if not self.grad_shards_in_bucket:
            self.grad_shards = [None] * len(self.grad_shards)

    def grad_sumsq(self) -> torch.Tensor | None:
        """Offload's squares of this rank's shard, taken as the last micro-batch's gradients were added in host
        memory; None where the optimizer takes them itself (no offload)."""
        return self.host_grads.sum_of_squares(self.flat.device) if self.host_grads is not None else None

    def _before_step(self) -> None:
        """Stage 3 waits for prefetches that still read the masters."""

    def _gather_updated_weights(self) -> None:
        """Every rank's updated slices into the whole buckets, in the order forward reads them; left in
        flight for the next forward to wait on (`_wait_weight_gathers`)."""
        if self.opt.offloaded and self.opt.landings:
            self.weight_gathers = {b: (landing, None) for b, landing in self.opt.landings.items()}
        elif self.world > 1:
            self.weight_gathers = self.transport.all_gather_weights(
                self.gather_order, lambda b: self.opt.shard_of(self.flat.buckets[b].data, b))

    # ---- layout-free state ---------------------------------------------------------------------
    @torch.no_grad()
    def load_full_state(self, masters: dict, state: dict) -> None:
        self._wait_weight_gathers()
        for b, part in zip(self.flat.buckets, self.opt.load(masters, state)):
            self._load_bucket(b, part, masters)
        live = {k.split("::")[0]: state[k] for k in state if k.endswith("::delayed_weights")}
        if self.delayed is not None and live:  # the saved run's weights, one update behind its masters
            self.delayed.resume([self.opt.master_part(b.index) for b in self.flat.buckets])
            with torch.no_grad():
                for i, name in enumerate(self.flat.names):
                    self.flat.view(self.flat.buckets[self.flat.where[i][0]].data, i).copy_(live[name])

    def _load_bucket(self, bucket, part: torch.Tensor, masters: dict) -> None:
        if self.world == 1 or self.opt.offloaded:
            for i in bucket.params:
                self.flat.view(bucket.data, i).copy_(masters[self.flat.names[i]])
            return
        # The whole bucket from every rank's 16-bit shard just loaded: no full tensor read again (a sharded
        # checkpoint's other ranks' pieces).
        self.opt.shard_of(bucket.data, bucket.index).copy_(part)
        mine = lambda b: self.opt.shard_of(bucket.data, b)  # noqa: E731
        for work, _ in self.transport.all_gather_weights([bucket.index], mine).values():
            work.wait()

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        shards = [] if self.grad_shards_in_bucket else [("grads", g) for g in self.grad_shards if g is not None]
        return super().held_tensors() + shards


def sharded_optimizer(flat, cfg, scaler, group, initial_shards=None, params_kept: bool = True) -> MasterWeightOptimizer:
    """ZeRO's optimizer over this rank's 1/N of every bucket: on the GPU, or on the CPU with
    `parallel.offload` optimizer or params (its state on a local disk with `parallel.offload_dir`)."""
    p = cfg.parallel
    if p.offload == "none":
        return MasterWeightOptimizer(flat, cfg.train, scaler, group, shard=True, initial_shards=initial_shards,
                                     params_kept=params_kept)
    kind, extra = (DiskOffloadedOptimizer, {"directory": p.offload_dir}) if p.offload_dir else (OffloadedOptimizer, {})
    return kind(flat, cfg.train, scaler, group, shard=True, initial_shards=initial_shards, threads=p.offload_threads,
                **extra)
