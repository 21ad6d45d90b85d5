"""Data parallelism without sharding: one process, classic DP, and DDP.

- One process (`LocalEngine`): the flat buckets and the master-weight optimizer, no communication.
- Classic DP (`ClassicEngine`): every rank computes gradients on its slice of the batch; the gradients
  are summed onto rank 0 (`reduce`), rank 0 alone runs the optimizer, and the weights are `broadcast`
  back. It exists to compare against: per step it moves the gradients into one rank and the weights
  out of it, so rank 0's links carry 2 x (N - 1) x the model's bytes while every other rank waits
  idle through the optimizer step; rank 0 also holds the only optimizer state.
- DDP (`DDPEngine`, Li et al. 2020, "PyTorch Distributed"): gradients are grouped into buckets of
  about `parallel.bucket_mb` in reverse registration order (the order backward produces them); on the
  last micro-step of an accumulation each bucket is all-reduced asynchronously as soon as its last
  gradient is accumulated, overlapping the rest of backward. Buckets are launched strictly in order,
  so every rank issues the same collectives in the same sequence. Earlier micro-steps accumulate
  locally with no communication. `parallel.reduce_dtype` chooses fp32 or the compute dtype for the
  reduction. Reducing 16-bit gradients in fp32 runs the all-reduce as its two halves (an all-reduce is a
  reduce-scatter followed by an all-gather): the reduce-scatter sums in fp32 (`comm.start_reduce_scatter`:
  by default the 16-bit values travel and each rank sums its slice in fp32), each rank rounds its summed
  slice to the gradients' dtype, and the all-gather moves 16-bit values. The result is the one an fp32
  all-reduce rounded into the 16-bit buffer gives, for half of its traffic. On GPU the sum, the rounding
  and the all-gather are queued on a side stream, so backward never waits for them. On the GPUs of one
  node, `parallel.reduce_algo copy_engine` (what `auto`, the default, picks there) moves the buckets
  with the copy engines instead of NCCL's kernels (`comm.CopyEngineAllReduce`), leaving the SMs to
  backward. Wherever the reduction goes through slices, each rank squares its summed slices as they
  are reduced and the clipping norm adds the ranks' totals (`comm.SliceSquares`): the optimizer makes
  no pass over the whole gradient after the last bucket arrives.

Every engine offers the trainer the same calls: `before_backward(last)`, `after_backward(last)`,
`step(lr, step)`, `sync(step)`, `finish()`, and layout-free `full_state()` / `load(...)`.
"""
from __future__ import annotations

import weakref
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ..flat import FlatParams, split_buckets
from ..optim import MasterWeightOptimizer
from .comm import (CopyEngineAllReduce, SliceSquares, all_gather_into_tensor, resolve_reduce_algo,
                   start_copy_engine, start_reduce_scatter)


def reverse_order_buckets(model: nn.Module, bucket_mb: float, itemsize: int) -> list[list[str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    return split_buckets([n for n, _ in named], [p.numel() for _, p in named],
                         max(1, int(bucket_mb * 2**20 / itemsize)))


class BucketReadiness:
    """Counts gradients as autograd accumulates them and calls `launch(bucket)` for each bucket whose
    gradients are all in, strictly in bucket order; `flush()` launches the rest (parameters that got no
    gradient this step count as zero), so no rank ever waits for a collective its peers never issue."""

    def __init__(self, flat: FlatParams, launch, on_grad=None):
        self.flat, self.launch, self.on_grad = flat, launch, on_grad
        self.active = False
        self.pending = [0] * len(flat.buckets)
        self.next = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(flat.params)]

    def _hook(self, i: int):
        b = self.flat.where[i][0]
        # Weakly: a parameter keeps its hooks where Python's collector does not look, so a hook holding
        # this object would keep the engine (its gradients, its optimizer state) alive as long as the
        # parameters, cycle or not: every engine built in one process would stay in memory.
        ref = weakref.ref(self)

        def hook(param):
            self = ref()
            if self is None or not self.active:
                return
            if self.on_grad is not None:
                self.on_grad(i, param)
            self.pending[b] -= 1
            while self.next < len(self.pending) and self.pending[self.next] == 0:
                self.launch(self.next)
                self.next += 1
        return hook

    def arm(self) -> None:
        self.active = True
        self.pending = [len(b.params) for b in self.flat.buckets]
        self.next = 0

    def flush(self) -> None:
        if self.active:
            while self.next < len(self.pending):
                self.launch(self.next)
                self.next += 1
        self.active = False


class LocalEngine:
    """One data-parallel rank: flat buckets and the optimizer, nothing to communicate."""

    def __init__(self, model: nn.Module, cfg, scaler, buckets=None, pad_multiple: int = 1):
        self.cfg = cfg
        self.flat = FlatParams(model, buckets, pad_multiple=pad_multiple)
        self.opt = MasterWeightOptimizer(self.flat, cfg.train, scaler)

    def before_backward(self, last: bool) -> None:
        pass

    def after_backward(self, last: bool) -> None:
        pass

    def grad_factor(self) -> float:
        return 1.0

    def step(self, lr: float, step: int) -> None:
        self.opt.step(lr, step, lambda b: self.flat.buckets[b].grad, lambda b: self.flat.buckets[b].data,
                      self.grad_factor(), sumsq=self.grad_sumsq())
        self.flat.zero_grad()

    def grad_sumsq(self) -> torch.Tensor | None:
        """The gradient's sum of squares where the reduction already took it; None: the optimizer does."""
        return None

    def sync(self, step: int) -> tuple[float, int]:
        return self.opt.sync(step)

    def finish(self) -> None:
        """Complete any communication still in flight (training is over)."""

    def full_state(self):
        """(masters, optimizer state) by parameter name; a collective where state is sharded."""
        return self.opt.master_state(), self.opt.state_by_name()

    @torch.no_grad()
    def load(self, masters: dict, state: dict) -> None:
        shards = self.opt.load(masters, state)
        for b, part in zip(self.flat.buckets, shards):
            b.data.copy_(part)

    def tensor_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (master weights included)."""
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
        opt = [t for parts in self.opt.state.values() for t in parts]
        if self.opt.master is not None:
            opt.append(self.opt.master)
        return {"params": nbytes(b.data for b in self.flat.buckets), "grads": nbytes(b.grad for b in self.flat.buckets),
                "optimizer": nbytes(opt)}


class DDPEngine(LocalEngine):
    def __init__(self, model: nn.Module, cfg, scaler, group):
        p = cfg.parallel
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        item = next(model.parameters()).element_size()
        # Buckets padded to a multiple of the world size split into equal reduce-scatter slices.
        super().__init__(model, cfg, scaler, reverse_order_buckets(model, p.bucket_mb, item), pad_multiple=self.world)
        self.reduce_dtype = torch.float32 if p.reduce_dtype == "fp32" else self.flat.dtype
        self.works: list = []  # (work, tensors the collective uses until it completes)
        self.side = torch.cuda.Stream(self.flat.device) if self.flat.device.type == "cuda" else None
        self.algo = resolve_reduce_algo(p.reduce_algo, group, self.flat.device)
        self.copy_engine = None
        if self.algo == "copy_engine":
            self.copy_engine = start_copy_engine(CopyEngineAllReduce, [b.numel for b in self.flat.buckets],
                                                 self.flat.dtype, self.flat.device, group, self.side)
            self.flat.rehome(grad=self.copy_engine.grads.buffer)
        # Where buckets are reduced as reduce-scatter + all-gather, the norm's squares come from the slices.
        self.squares = None
        if self.copy_engine is None and self.flat.dtype != self.reduce_dtype:
            self.squares = SliceSquares([self._own(b.grad) for b in self.flat.buckets])
            self.totals = torch.zeros(self.world, dtype=torch.float32, device=self.flat.device)  # by rank
            self.mine = torch.zeros(1, dtype=torch.float32, device=self.flat.device)  # this rank's, sent
            self.sumsq = torch.zeros((), dtype=torch.float32, device=self.flat.device)
        self.ready = BucketReadiness(self.flat, self._launch)

    def _own(self, grad: torch.Tensor) -> torch.Tensor:
        n = grad.numel() // self.world
        return grad[self.rank * n:(self.rank + 1) * n]

    def _launch(self, b: int) -> None:
        grad = self.flat.buckets[b].grad
        if self.copy_engine is not None:
            self.works.append((self.copy_engine.launch(b), ()))
            return
        if grad.dtype == self.reduce_dtype:
            self.works.append((dist.all_reduce(grad, group=self.group, async_op=True), ()))
            return
        rs, mine, keep = start_reduce_scatter(grad, self.reduce_dtype, self.group, self.algo)
        own = self._own(grad)
        with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
            rs.wait()  # on GPU: the side stream waits, the compute stream runs on
            own.copy_(mine())
            if self.squares is not None:
                self.squares.add(b)
            ag = all_gather_into_tensor(grad, own, group=self.group, async_op=True)
        self.works.append((ag, keep))

    def before_backward(self, last: bool) -> None:
        if last:
            self.ready.arm()

    def after_backward(self, last: bool) -> None:
        if not last:
            return
        self.ready.flush()
        for work, _ in self.works:
            work.wait()
        # The compute stream now waits for every collective, so the buffers they used can be reused.
        self.works.clear()
        if self.squares is not None:
            self.squares.rank_total(out=self.mine[0])
            all_gather_into_tensor(self.totals, self.mine, group=self.group)
            SliceSquares.over_ranks(self.totals, self.sumsq)

    def grad_sumsq(self) -> torch.Tensor | None:
        if self.copy_engine is not None:
            return self.copy_engine.sumsq if self.copy_engine.squares is not None else None
        return self.sumsq if self.squares is not None else None

    def grad_factor(self) -> float:
        return 1.0 / self.world  # buckets hold sums; the mean is taken inside the optimizer's scale


class ClassicEngine(LocalEngine):
    def __init__(self, model: nn.Module, cfg, scaler, group):
        self.cfg, self.group = cfg, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.root = dist.get_global_rank(group, 0)
        self.flat = FlatParams(model)
        self.scaler = scaler
        # Only the root holds optimizer state; the others only compute gradients.
        self.opt = MasterWeightOptimizer(self.flat, cfg.train, scaler) if self.rank == 0 else None
        self.stats = torch.zeros(3, device=self.flat.device)  # norm, loss scale, skipped steps

    def after_backward(self, last: bool) -> None:
        if last:
            for b in self.flat.buckets:
                dist.reduce(b.grad, dst=self.root, group=self.group)

    @torch.no_grad()
    def step(self, lr: float, step: int) -> None:
        if self.opt is not None:
            self.opt.step(lr, step, lambda b: self.flat.buckets[b].grad, lambda b: self.flat.buckets[b].data,
                          self.grad_factor())
            self.stats.copy_(torch.stack([self.opt.last_norm.float(), torch.tensor(float(self.scaler.scale)).to(self.stats),
                                          torch.tensor(float(self.scaler.skipped_steps)).to(self.stats)]))
        for b in self.flat.buckets:
            dist.broadcast(b.data, src=self.root, group=self.group)
        dist.broadcast(self.stats, src=self.root, group=self.group)
        if self.opt is None:  # the loss scale (fp16) must match on every rank
            self.scaler.scale = float(self.stats[1])
            self.scaler.skipped_steps = int(self.stats[2])
        self.flat.zero_grad()

    def grad_factor(self) -> float:
        return 1.0 / self.world  # the root holds the sum over ranks

    def sync(self, step: int) -> tuple[float, int]:
        if self.opt is not None:
            return self.opt.sync(step)
        return float(self.stats[0]), int(self.stats[2])

    def full_state(self):
        return (None, None) if self.opt is None else super().full_state()

    @torch.no_grad()
    def load(self, masters: dict, state: dict) -> None:
        if self.opt is not None:
            self.opt.load(masters, state)
        for i, name in enumerate(self.flat.names):
            self.flat.view(self.flat.bucket_of(i).data, i).copy_(masters[name])

    def tensor_bytes(self) -> dict[str, int]:
        if self.opt is not None:
            return super().tensor_bytes()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": nbytes(b.data for b in self.flat.buckets),
                "grads": nbytes(b.grad for b in self.flat.buckets), "optimizer": 0}


def build_engine(model: nn.Module, cfg, mesh, scaler):
    """The data-parallel engine for cfg.parallel: local, classic, DDP, or ZeRO stage 1-3."""
    p = cfg.parallel
    if p.zero_stage > 0:
        from .zero import ZeroEngine
        return ZeroEngine(model, cfg, scaler, mesh.dp_group)
    if mesh.dp == 1:
        return LocalEngine(model, cfg, scaler)
    if p.dp_mode == "classic":
        return ClassicEngine(model, cfg, scaler, mesh.dp_group)
    return DDPEngine(model, cfg, scaler, mesh.dp_group)
