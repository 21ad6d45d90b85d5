"""ZeRO stages 1-3 over flat, rank-aligned buckets (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"), with optimizer and parameter offload (Ren et al. 2021,
"ZeRO-Offload"). The offloaded step runs torch's vectorised CPU AdamW kernel on a persistent pinned
fp32 gradient buffer, with `parallel.offload_threads` threads (default: the rank's share of the cores).

Every bucket is padded to a multiple of N (the data-parallel degree) and rank r owns elements
[r B/N, (r+1) B/N) of each bucket B: its fp32 master weights, Adam moments and reduced gradients are
kept for that slice only (Megatron-LM's distributed optimizer lays shards out the same way).

- Stage 1 shards the optimizer state. Gradients accumulate into full 16-bit bucket buffers; on the last
  micro-step each bucket is reduce-scattered as soon as its gradients are in (overlapping backward), the
  optimizer updates the owned slice, and an all-gather per bucket returns the updated weights. The
  all-gathers are issued in the order the next forward reads the buckets and left in flight: forward
  waits for a bucket only just before the first module that reads it (the embeddings, a block, the
  head), so they overlap its compute (Megatron-LM's distributed optimizer overlaps them likewise).
  On the GPUs of one node (`parallel.reduce_algo auto` or `copy_engine`) both collectives run on the
  copy engines over symmetric memory (`comm.CopyEngineZero`, as DDP's all-reduce does), leaving the
  SMs to backward and forward.
- Stage 2 also shards gradients. No full gradient buffer exists: as autograd produces a parameter's
  gradient it is copied into its bucket's transient buffer and freed; a complete bucket is
  reduce-scattered into the rank's persistent gradient shard and its buffer freed. This runs on every
  micro-step (as DeepSpeed's stage 2 does), so gradient memory stays at the shard plus the buckets in
  flight. By the copy engines, a bucket's gradients stay with their parameters until the bucket is
  complete and are then staged in a symmetric ring with room for the REDUCTIONS_IN_FLIGHT buckets
  in flight.
- Stage 3 also shards parameters. Buckets are units: one per transformer block, one for the input
  embeddings, one for the final norm and output head (one "root" unit when the head is tied to the
  embedding), and one for all parameters of at most `parallel.persist_threshold` elements, which stay
  whole. A block's unit is all-gathered just before its forward and again before its backward (when
  the gradient of its output arrives), its storage freed after each; the next unit's all-gather is
  issued early so it overlaps the current block's compute. The embedding unit is freed as soon as
  the embeddings are looked up (their backward needs no weights), the head unit after backward.
  As in FSDP2, the 16-bit weights are not stored: each gather casts the rank's fp32 master slice,
  so parameters cost (2 + K) Phi / N per rank instead of (2 + 2 + K) Phi / N (with parameter offload
  the 16-bit slice is kept in pinned CPU memory instead). Gradients are reduced as in stage 2, one unit
  in flight. By the copy engines, each gather puts the rank's cast slice into one of two small symmetric
  slots and pulls the peers' (`comm.CopyEngineZero.gather`), still with no 16-bit weights at rest.

The gradient norm is the square root of the sum over ranks of each shard's sum of squares, so it is the
global norm on every rank, and an fp16 overflow anywhere skips the step everywhere.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from ..flat import FlatParams
from ..optim import MasterWeightOptimizer
from .comm import (CopyEngineZero, all_gather_into_tensor, resolve_reduce_algo, start_copy_engine,
                   start_reduce_scatter)
from .data import BucketReadiness, LocalEngine, reverse_order_buckets


def _eager(fn):
    """Hooks run eagerly even inside a compiled block: collectives and storage resizes stay out of the
    graph (a graph break), as FSDP2's hooks do under torch.compile."""
    return torch._dynamo.disable(fn, recursive=True)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


EMBED_PREFIXES = ("embed.", "pos_embed.")
# Stage 2 bounds the full-size bucket gradients alive at once by finishing the oldest reduction when
# more than this many are in flight. Finishing one makes the compute stream wait for it, so the bound
# must cover a whole compiled block, whose gradients all arrive at once (about 4 buckets of the default
# 25 MB in a 1B model's block): waiting for the previous bucket alone stalled backward on every bucket
# of the block. Stage 3's buckets are whole blocks already: one in flight suffices there.
REDUCTIONS_IN_FLIGHT = 4


def offload_threads(requested: int) -> int:
    """Threads for the CPU optimizer step: as asked, else this rank's share of the cores it may run on
    (torchrun sets OMP_NUM_THREADS=1 per rank, which would leave the offloaded step on one core)."""
    if requested > 0:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def stage3_units(model: nn.Module, persist_threshold: int) -> list[list[str]]:
    """Units in the order backward completes them: the head, blocks last-to-first, the small whole
    parameters, the embeddings (one root unit holding embeddings and head when they are tied)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    small = [n for n, p in named if p.numel() <= persist_threshold]
    blocks = []
    for i in reversed(range(len(model.layers))):
        blocks.append([n for n, p in named if n.startswith(f"layers.{i}.") and n not in small])
    rest = [n for n, p in named if not n.startswith("layers.") and n not in small]
    if model.lm_head is None:  # tied: the embedding is also the head
        head, embed = [], rest
    else:
        head = [n for n in rest if not n.startswith(EMBED_PREFIXES)]
        embed = [n for n in rest if n.startswith(EMBED_PREFIXES)]
    return [u for u in [head, *blocks, small, embed] if u]


class ZeroEngine(LocalEngine):
    def __init__(self, model: nn.Module, cfg, scaler, group):
        p = cfg.parallel
        self.cfg, self.group, self.stage = cfg, group, p.zero_stage
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        item = next(model.parameters()).element_size()
        if self.stage == 3:
            units = stage3_units(model, int(p.persist_threshold))
            small = set(n for n, q in model.named_parameters() if q.numel() <= p.persist_threshold)
            self.flat = FlatParams(model, units, pad_multiple=self.world, materialize=False)
            self.persistent = [all(self.flat.names[i] in small for i in b.params) for b in self.flat.buckets]
        else:
            self.flat = FlatParams(model, reverse_order_buckets(model, p.bucket_mb, item), pad_multiple=self.world,
                                   grad_buffers=self.stage == 1)
            self.persistent = [True] * len(self.flat.buckets)
        flat = self.flat
        self.reduce_dtype = torch.float32 if p.reduce_dtype == "fp32" else flat.dtype
        self.algo = "all_to_all" if group is None else resolve_reduce_algo(p.reduce_algo, group, flat.device)
        # Stages 2 and 3 gather each micro-step's gradients into transient bucket buffers: in the dtype
        # that travels, so a ring reduction's cast to fp32 happens in that copy, not in another pass.
        self.bucket_dtype = self.reduce_dtype if self.algo == "ring" else flat.dtype
        # Reductions stage 2 keeps in flight; fixed here, since the copy engines' ring is sized for it.
        self.in_flight = REDUCTIONS_IN_FLIGHT if self.stage == 2 else 1
        self.copy_engine = None
        if self.algo == "copy_engine":
            # Stage 2's and 3's ring holds the buckets in flight, the one being staged among them (see
            # _launch); stage 3's gathers in flight are the unit in use and the one prefetched.
            self.copy_engine = start_copy_engine(CopyEngineZero, [b.numel for b in flat.buckets], flat.dtype,
                                                 flat.device, group, torch.cuda.Stream(flat.device),
                                                 window=None if self.stage == 1 else self.in_flight,
                                                 gather_slots=2 if self.stage == 3 else 0)
            if self.stage < 3:
                flat.rehome(data=self.copy_engine.params.buffer,
                            grad=self.copy_engine.grads.buffer if self.stage == 1 else None)
        self.offload_params = p.offload == "params"
        if p.offload != "none":
            torch.set_num_threads(offload_threads(p.offload_threads))
        self.gather_work: dict[int, tuple] = {}  # stage 3: unit -> (its gather in flight, the gather's input)
        if self.stage == 3:
            self._materialize_stage3(model)
        self.opt = MasterWeightOptimizer(flat, cfg.train, scaler, group, shard=True, offload=p.offload != "none",
                                         initial_shards=[b.extra.get("shard") for b in flat.buckets]
                                         if self.stage == 3 else None)
        if self.stage == 3 and p.offload == "none":
            for b in flat.buckets:
                if not self.persistent[b.index]:
                    del b.extra["shard"]  # gathers cast the fp32 master slice: no 16-bit copy at rest
        # Gradient shards: filled by the reduce-scatter (stage 1) or accumulated into (stages 2, 3).
        # Stage 1 reducing in the gradients' own dtype keeps its shard inside the full bucket buffer;
        # otherwise a shard exists from its bucket's first reduction until the step (as FSDP2's sharded
        # gradients do), so forward's activation peak never shares memory with gradients.
        self.gshard_in_bucket = self.stage == 1 and self.reduce_dtype == flat.dtype
        self.gshard: list[torch.Tensor | None] = [self.opt.shard_of(b.grad, b.index) if self.gshard_in_bucket
                                                  else None for b in flat.buckets]
        self.works: list = []
        # Stages 2, 3 take each gradient from its parameter as it arrives, except by the copy engines,
        # which stage a bucket's gradients once the bucket is complete.
        take = self.stage > 1 and self.copy_engine is None
        self.ready = BucketReadiness(flat, self._launch, self._take_grad if take else None)
        self.in_backward = False
        self.publishing: dict[int, tuple] = {}  # bucket -> (all-gather in flight, its input)
        self.publish_order = list(range(len(flat.buckets)))
        if self.stage < 3 and self.world > 1:
            self._await_publish_in_forward(model)

    # ---- stage 3: parameters live as shards; units are gathered around their use -----------------
    def _materialize_stage3(self, model: nn.Module) -> None:
        flat = self.flat
        pin = self.offload_params and torch.cuda.is_available()
        for b in flat.buckets:
            full = torch.zeros(b.numel, dtype=flat.dtype, device=flat.device)
            with torch.no_grad():
                for i in b.params:
                    flat.view(full, i).copy_(flat.params[i].detach())
                    flat.params[i].data = flat.view(full, i)
            b.data = full
            n = b.numel // self.world
            shard = full[self.rank * n:(self.rank + 1) * n].clone()
            b.extra["shard"] = shard.to("cpu").pin_memory() if pin else (shard.cpu() if self.offload_params else shard)
            b.extra["gathered"] = True
        unit_of_block, self.embed_unit, self.head_unit = {}, None, None
        for b in flat.buckets:
            if self.persistent[b.index]:
                continue
            name = flat.names[b.params[0]]
            if name.startswith("layers."):
                unit_of_block[int(name.split(".")[1])] = b.index
            elif any(flat.names[i].startswith(EMBED_PREFIXES) for i in b.params):
                self.embed_unit = b.index
            else:
                self.head_unit = b.index
        tied = model.lm_head is None
        if tied:
            self.head_unit = self.embed_unit  # one root unit, kept from forward until after backward
        self.block_units = [unit_of_block.get(i) for i in range(len(model.layers))]
        for i, block in enumerate(model.layers):
            block.register_forward_pre_hook(self._block_pre_hook(i))
            block.register_forward_hook(self._block_post_hook(i))
        model.register_forward_pre_hook(_eager(lambda mod, args: self._gather(self.embed_unit)))
        if not tied:
            # The embeddings' backward needs no weights: free them once the lookup is done.
            model.layers[0].register_forward_pre_hook(_eager(lambda mod, args: self._release(self.embed_unit)))
            model.norm.register_forward_pre_hook(_eager(lambda mod, args: self._gather(self.head_unit)))
        model.register_forward_hook(self._model_post_hook)
        for b in flat.buckets:  # at rest, only the small parameters are whole
            self._release(b.index)

    def _release(self, b: int | None) -> None:
        if b is None:
            return
        bucket = self.flat.buckets[b]
        if bucket.extra.get("gathered") and not self.persistent[b]:
            work = self.gather_work.pop(b, None)  # a prefetch never waited for
            if work is not None and work[0] is not None:
                work[0].wait()  # it may still be writing into the storage freed next
            _free(bucket.data)
            bucket.extra["gathered"] = False

    def _issue_gather(self, b: int | None) -> None:
        if b is None or b in self.gather_work:
            return
        bucket = self.flat.buckets[b]
        if bucket.extra["gathered"]:
            return
        _alloc(bucket.data)
        src = bucket.extra.get("shard")  # None: the gather casts the fp32 master slice
        src = self.opt.master_part(b) if src is None else src
        if self.copy_engine is not None:
            work, shard = self.copy_engine.gather(src, bucket.data), None
        else:
            shard = src.to(self.flat.device, self.flat.dtype, non_blocking=True)
            if self.world == 1:
                bucket.data.copy_(shard)
                work = None
            else:
                work = all_gather_into_tensor(bucket.data, shard, group=self.group, async_op=True)
        self.gather_work[b] = (work, shard)
        bucket.extra["gathered"] = True

    def _gather(self, b: int | None) -> None:
        if b is None:
            return
        self._issue_gather(b)
        work = self.gather_work.pop(b, None)
        if work is not None and work[0] is not None:
            work[0].wait()

    def _block_pre_hook(self, i: int):
        @_eager
        def hook(module, args):
            self._gather(self.block_units[i])
            if not self.in_backward:  # prefetch what forward needs next: overlaps this block's compute
                self._issue_gather(self.block_units[i + 1] if i + 1 < len(self.block_units) else self.head_unit)
        return hook

    def _block_post_hook(self, i: int):
        @_eager
        def hook(module, args, output):
            if self.in_backward:  # a recomputation inside backward: the unit stays for its gradients
                return output
            self._release(self.block_units[i])
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(self._pre_backward(i))
            return output
        return hook

    def _pre_backward(self, i: int):
        @_eager
        def hook(grad):
            self.in_backward = True
            self._gather(self.block_units[i])
            if i > 0:
                self._issue_gather(self.block_units[i - 1])  # prefetch the block backward visits next
            return grad
        return hook

    @_eager
    def _model_post_hook(self, module, args, output):
        if not torch.is_grad_enabled():  # eval or generation: nothing will need the head again
            self._release(self.head_unit)
        return output

    # ---- stages 1, 2: updated weights arrive while the next forward runs ----------------------
    def _await_publish_in_forward(self, model: nn.Module) -> None:
        last = len(model.layers) + 1

        def point(name: str) -> int:  # where forward first reads a parameter: 0 embeddings, i + 1 block i
            if name.startswith("layers."):
                return int(name.split(".")[1]) + 1
            return 0 if name.startswith(EMBED_PREFIXES) else last
        first = [last] * len(self.flat.buckets)
        for i, name in enumerate(self.flat.names):
            b = self.flat.where[i][0]
            first[b] = min(first[b], point(name))
        self.first_read = first
        self.publish_order = sorted(range(len(first)), key=lambda b: (first[b], b))
        model.register_forward_pre_hook(_eager(lambda mod, args: self._await_published(0)))
        for i, block in enumerate(model.layers):
            block.register_forward_pre_hook(_eager(lambda mod, args, at=i + 1: self._await_published(at)))
        model.norm.register_forward_pre_hook(_eager(lambda mod, args: self._await_published(last)))

    def finish(self) -> None:
        self._await_published()

    def _await_published(self, at: int | None = None) -> None:
        """Wait (the compute stream waits, on GPU) for the weights read at forward point `at` or before;
        None: for all of them."""
        if not self.publishing:
            return
        for b in [b for b in self.publishing if at is None or self.first_read[b] <= at]:
            work, _ = self.publishing.pop(b)
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
        if self.copy_engine is not None:
            if self.stage > 1:
                # Into the symmetric ring (stages 2, 3 have no bucket.grad by the copy engines), where the
                # ranges of the `in_flight` - 1 reductions still running are apart from b's.
                self._drain(keep=self.in_flight - 1)
                self._stage(b)
            out = self.gshard[b] if self.gshard_in_bucket else \
                torch.empty(bucket.numel // self.world, dtype=self.reduce_dtype, device=self.flat.device)
            work, result, keep = self.copy_engine.reduce_scatter(b, out), (lambda: out), ()
        else:
            if bucket.grad is None:  # no parameter of this bucket received a gradient this micro-step
                bucket.grad = torch.zeros(bucket.numel, dtype=self.bucket_dtype, device=self.flat.device)
            if self.world == 1:
                work, result, keep = None, (lambda g=bucket.grad: g.to(self.reduce_dtype, copy=True)), ()
            else:
                work, result, keep = start_reduce_scatter(bucket.grad, self.reduce_dtype, self.group, self.algo)
        self.works.append((work, b, result, keep))
        if self.stage == 3 and b != self.head_unit:
            self._release(b)  # this unit's backward is done: its gradients are all in
        if self.stage > 1 and self.copy_engine is None:  # the copy engines drained before staging
            self._drain(keep=self.in_flight)

    def _stage(self, b: int) -> None:
        """Stages 2, 3 by the copy engines: bucket b's gradients into its range of the symmetric ring (zeros
        for parameters that got none), freed from the parameters. The range is free: the ring keeps
        `in_flight` consecutive buckets apart, and _launch stages b with at most `in_flight` - 1 reductions
        in flight, each waited for only once every peer has read it."""
        bucket, region = self.flat.buckets[b], self.copy_engine.grads.bucket(b)
        for i in bucket.params:
            param = self.flat.params[i]
            if param.grad is None:
                self.flat.view(region, i).zero_()
            else:
                self.flat.view(region, i).copy_(param.grad)
                param.grad = None
        used = sum(self.flat.params[i].numel() for i in bucket.params)
        region[used:].zero_()  # the padding

    def _drain(self, keep: int = 0) -> None:
        """Finish all but the newest `keep` reductions: fold each into the gradient shard, free its bucket."""
        while len(self.works) > keep:
            work, b, result, _ = self.works.pop(0)
            if work is not None:
                work.wait()
            out = result()
            if self.gshard_in_bucket:
                if out is not self.gshard[b]:  # the copy engines sum into the shard itself
                    self.gshard[b].copy_(out)
            elif self.gshard[b] is None:
                self.gshard[b] = out
            else:
                self.gshard[b] += out
            if self.stage > 1:
                self.flat.buckets[b].grad = None

    def before_backward(self, last: bool) -> None:
        self._await_published()  # backward reads the weights too, whatever forward waited for
        if self.stage == 1 and not last:
            return  # stage 1 accumulates full gradients locally until the last micro-step
        self.ready.arm()

    def after_backward(self, last: bool) -> None:
        if not self.ready.active:
            return
        self.ready.flush()
        self._drain()
        self.in_backward = False
        if self.stage == 3:
            self._release(self.head_unit)

    def grad_factor(self) -> float:
        return 1.0 / self.world

    # ---- the step ------------------------------------------------------------------------------
    def _param_shard(self, b: int) -> torch.Tensor | None:
        bucket = self.flat.buckets[b]
        if self.stage == 3 and not self.persistent[b]:
            return bucket.extra.get("shard")  # None: the next gather casts the master itself
        return self.opt.shard_of(bucket.data, b)

    @torch.no_grad()
    def step(self, lr: float, step: int) -> None:
        self._await_published()
        for work, _ in self.gather_work.values():  # a prefetch not waited for yet still reads the masters
            if work is not None:
                work.wait()
        self.gather_work.clear()
        applied = self.opt.step(lr, step, lambda b: self.gshard[b], self._param_shard, self.grad_factor())
        if applied:
            self._publish()
        if self.stage == 1:
            self.flat.zero_grad()
        if not self.gshard_in_bucket:
            self.gshard = [None] * len(self.gshard)

    def _publish(self) -> None:
        """All-gather the updated slices of every bucket kept whole (stages 1, 2; stage 3's small params),
        in the order forward reads them; stages 1 and 2 leave them in flight (`_await_published`)."""
        if self.copy_engine is not None and self.stage < 3:
            self.publishing = {b: (work, None) for b, work in self.copy_engine.all_gather(self.publish_order).items()}
            return
        for i in self.publish_order:
            b = self.flat.buckets[i]
            if not self.persistent[i]:
                continue
            if self.stage == 3:
                b.extra["shard"].copy_(self.opt.shard_of(b.data, i))
            if self.copy_engine is not None:  # stage 3
                self.publishing[i] = (self.copy_engine.gather(b.extra["shard"], b.data), None)
            elif self.world > 1:
                mine = self.opt.shard_of(b.data, i).clone()
                self.publishing[i] = (all_gather_into_tensor(b.data, mine, group=self.group, async_op=True), mine)
        if self.stage == 3:
            self._await_published()

    @torch.no_grad()
    def load(self, masters: dict, state: dict) -> None:
        self._await_published()
        shards = self.opt.load(masters, state)
        for b, part in zip(self.flat.buckets, shards):
            if "shard" in b.extra:
                b.extra["shard"].copy_(part)
            if b.extra.get("gathered", True):
                for i in b.params:
                    self.flat.view(b.data, i).copy_(masters[self.flat.names[i]])

    def tensor_bytes(self) -> dict[str, int]:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        if self.stage == 3:
            params = [b.extra["shard"] for b in self.flat.buckets if "shard" in b.extra and not self.persistent[b.index]]
            params += [b.data for b in self.flat.buckets if self.persistent[b.index]]
        else:
            params = [b.data for b in self.flat.buckets]
        grads = [b.grad for b in self.flat.buckets if b.grad is not None]
        grads += [] if self.gshard_in_bucket else [g for g in self.gshard if g is not None]
        opt = [self.opt.master] + [t for parts in self.opt.state.values() for t in parts]
        return {"params": nbytes(params), "grads": nbytes(grads), "optimizer": nbytes(opt)}
