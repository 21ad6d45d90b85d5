"""The two bucket transports the data-parallel engines are written against, each by the process group
(NCCL or gloo, `collectives.py`) or by the copy engines over symmetric memory (`copy_engine.py`): an
engine says what to move, the transport how, so no engine branches on the algorithm.

- A bucket all-reduce (DDP): `launch(b)` once bucket b's gradients are all in, buckets in the same order
  on every rank; `wait_all()` makes the compute stream wait for every launch; `grad_sumsq()`, the
  squares of this rank's summed slices where the reduction took them (else None: the optimizer does).
- A sharded transport (ZeRO): `reduce_scatter(b, out)` sums bucket b over the ranks, this rank keeping its
  slice; `all_gather_weights(order, mine)` spreads every rank's updated slices of the 16-bit weights;
  `gather(src, out)` assembles one ZeRO-3 unit from the ranks' slices.

Reducing 16-bit gradients in fp32 through the process group runs the all-reduce as its two halves (an
all-reduce is a reduce-scatter followed by an all-gather): the reduce-scatter sums in fp32
(`start_reduce_scatter`), each rank rounds its summed slice to the gradients' dtype, and the all-gather
moves 16-bit values: what an fp32 all-reduce rounded into the 16-bit buffer gives, for half its traffic.
On GPU the sum, the rounding and the all-gather are queued on a side stream, so backward never waits.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from ..flat import FlatParams
from ..grad_norm import SliceSquares
from .collectives import all_gather_into_tensor, start_reduce_scatter
from .copy_engine import CopyEngineAllReduce, CopyEngineZero, start_copy_engine


def _side_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


# ---- DDP: bucket all-reduce ---------------------------------------------------------------------------

class ProcessGroupAllReduce:
    def __init__(self, flat: FlatParams, group, algo: str, reduce_dtype: torch.dtype):
        self.flat, self.group, self.algo, self.reduce_dtype = flat, group, algo, reduce_dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.side = _side_stream(flat.device)
        self.works: list = []  # (work, tensors the collective uses until it completes)
        # Where buckets are reduced as reduce-scatter + all-gather, the norm's squares come from the slices.
        self.squares = None
        if flat.dtype != reduce_dtype:
            self.squares = SliceSquares([self._own(b.grad) for b in flat.buckets])
            self.sumsq = torch.zeros((), dtype=torch.float32, device=flat.device)  # this rank's slices'"'"' squares

    def _own(self, grad: torch.Tensor) -> torch.Tensor:
        n = grad.numel() // self.world
        return grad[self.rank * n:(self.rank + 1) * n]

    def launch(self, b: int) -> None:
        grad = self.flat.buckets[b].grad
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

    def wait_all(self) -> None:
        for work, _ in self.works:
            work.wait()
        # The compute stream now waits for every collective, so the buffers they used can be reused.
        self.works.clear()
        if self.squares is not None:
            self.squares.rank_total(out=self.sumsq)

    def grad_sumsq(self) -> torch.Tensor | None:
        return self.sumsq if self.squares is not None else None

    def symmetric_bytes(self) -> int:
        return 0


class CopyEngineBucketAllReduce:
    """DDP's all-reduce by the copy engines: the gradient buckets move into symmetric memory."""

    def __init__(self, flat: FlatParams, group):
        self.algo = "copy_engine"
        self.impl = start_copy_engine(CopyEngineAllReduce, [b.numel for b in flat.buckets], flat.dtype,
                                      flat.device, group, _side_stream(flat.device))
        flat.rehome(grad=self.impl.grads.buffer)
        self.works: list = []

    def launch(self, b: int) -> None:
        self.works.append(self.impl.launch(b))

    def wait_all(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()

    def grad_sumsq(self) -> torch.Tensor | None:
        return self.impl.sumsq if self.impl.squares is not None else None

    def symmetric_bytes(self) -> int:
        return self.impl.symmetric_bytes()


def bucket_all_reduce(flat: FlatParams, group, algo: str, reduce_dtype: torch.dtype):
    if algo == "copy_engine":
        return CopyEngineBucketAllReduce(flat, group)
    return ProcessGroupAllReduce(flat, group, algo, reduce_dtype)


# ---- ZeRO: reduce-scatter of gradients, all-gathers of weights -------------------------------------------

class ProcessGroupSharded:
    """ZeRO's collectives through the process group. A group of None (one rank) copies instead."""
    stages_gradients = False  # gradients are reduced from the engine's own bucket buffers

    def __init__(self, flat: FlatParams, group, algo: str, reduce_dtype: torch.dtype):
        self.flat, self.group, self.algo, self.reduce_dtype = flat, group, algo, reduce_dtype
        self.world = dist.get_world_size(group) if group is not None else 1
        self.upload = None  # the stream that copies offloaded parameters up (made at the first such gather)

    def reduce_scatter(self, b: int, out: torch.Tensor | None = None):
        """Launch bucket b's reduction (its `grad` buffer). Returns (work or None, result, keep): after the
        wait, result() is this rank's summed slice in the reduction dtype; `out` is not used."""
        grad = self.flat.buckets[b].grad
        if self.world == 1:
            return None, (lambda: grad.to(self.reduce_dtype, copy=True)), ()
        return start_reduce_scatter(grad, self.reduce_dtype, self.group, self.algo)

    def all_gather_weights(self, order: list[int], mine) -> dict[int, tuple]:
        """Every rank's updated slice (`mine(b)`, a view of bucket b's weights) into each bucket of `order`;
        returns {bucket: (work, its input)}, left in flight."""
        out = {}
        for b in order:
            shard = mine(b).clone()
            out[b] = (all_gather_into_tensor(self.flat.buckets[b].data, shard, group=self.group, async_op=True), shard)
        return out

    def gather(self, src: torch.Tensor, out: torch.Tensor):
        """Rank r's slice `src` (any dtype, any device) into slice r of `out`, on every rank: (work, input).
        A slice in host memory (parameter offload) is copied up on a stream of its own, so a prefetch runs
        beside the compute queued after it instead of delaying it; the work's wait() joins that stream (the
        CPU waits for the compute stream before it writes that slice again: zero3.py's _before_step)."""
        if src.device.type == "cpu" and out.is_cuda:
            return self._gather_from_host(src, out)
        shard = src.to(out.device, out.dtype, non_blocking=True)
        if self.world == 1:
            out.copy_(shard)
            return None, None
        return all_gather_into_tensor(out, shard, group=self.group, async_op=True), shard

    def _gather_from_host(self, src: torch.Tensor, out: torch.Tensor):
        if self.upload is None:
            self.upload = torch.cuda.Stream(out.device)
        self.upload.wait_stream(torch.cuda.current_stream(out.device))  # out's storage was just allocated
        with torch.cuda.stream(self.upload):
            if self.world == 1:
                out.copy_(src, non_blocking=True)
                return StreamWork(self._recorded()), None
            shard = src.to(out.device, out.dtype, non_blocking=True)
            work = all_gather_into_tensor(out, shard, group=self.group, async_op=True)  # after the copy
            return StreamWork(self._recorded(), work), shard

    def _recorded(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self.upload)
        return done

    def symmetric_bytes(self) -> int:
        return 0


class StreamWork:
    """A copy on a side stream (and the collective after it, if any) as a work: wait() makes the current
    stream wait for them."""

    def __init__(self, done: torch.cuda.Event, work=None):
        self.done, self.work = done, work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        torch.cuda.current_stream().wait_event(self.done)


class CopyEngineSharded:
    """ZeRO's collectives by the copy engines (`CopyEngineZero`). Stage 1 keeps every gradient bucket in
    symmetric memory; stages 2 and 3 stage a complete bucket's gradients into a symmetric ring (`stage`)
    with room for `in_flight` buckets. Stages 1 and 2 keep the 16-bit weights in symmetric memory; stage 3
    gathers each unit through a few small symmetric slots."""

    def __init__(self, flat: FlatParams, group, reduce_dtype: torch.dtype, stage: int, in_flight: int):
        self.flat, self.reduce_dtype = flat, reduce_dtype
        self.world = dist.get_world_size(group)
        self.stages_gradients = stage > 1
        self.impl = start_copy_engine(CopyEngineZero, [b.numel for b in flat.buckets], flat.dtype, flat.device,
                                      group, torch.cuda.Stream(flat.device),
                                      window=in_flight if self.stages_gradients else None,
                                      gather_slots=2 if stage == 3 else 0)
        if stage < 3:
            flat.rehome(data=self.impl.params.buffer, grad=self.impl.grads.buffer if stage == 1 else None)

    def stage(self, b: int) -> None:
        """Bucket b's gradients into its range of the symmetric ring (zeros for parameters that got none),
        freed from the parameters. The caller keeps the reductions in flight below the ring's window."""
        bucket, region = self.flat.buckets[b], self.impl.grads.bucket(b)
        for i in bucket.params:
            param = self.flat.params[i]
            if param.grad is None:
                self.flat.view(region, i).zero_()
            else:
                self.flat.view(region, i).copy_(param.grad)
                param.grad = None
        used = sum(self.flat.params[i].numel() for i in bucket.params)
        region[used:].zero_()  # the padding

    def reduce_scatter(self, b: int, out: torch.Tensor | None = None):
        """Queue bucket b's reduction into `out` (this rank's slice, any float dtype; None: a new tensor in the
        reduction dtype): (work, result, keep)."""
        if out is None:
            out = torch.empty(self.flat.buckets[b].numel // self.world, dtype=self.reduce_dtype, device=self.flat.device)
        return self.impl.reduce_scatter(b, out), (lambda: out), ()

    def all_gather_weights(self, order: list[int], mine) -> dict[int, tuple]:
        return {b: (work, None) for b, work in self.impl.all_gather(order).items()}

    def gather(self, src: torch.Tensor, out: torch.Tensor):
        return self.impl.gather(src, out), None

    def symmetric_bytes(self) -> int:
        return self.impl.symmetric_bytes()


def sharded_transport(flat: FlatParams, group, algo: str, reduce_dtype: torch.dtype, stage: int, in_flight: int):
    if algo == "copy_engine":
        return CopyEngineSharded(flat, group, reduce_dtype, stage, in_flight)
    return ProcessGroupSharded(flat, group, algo, reduce_dtype)
