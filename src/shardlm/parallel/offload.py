"""Optimizer offload (Ren et al. 2021, "ZeRO-Offload"): the fp32 master weights and the optimizer's moments
live in CPU memory and the update runs on the CPU; only 16-bit weights and gradients stay on the GPU.

The gradient shards end up in one persistent fp32 host buffer (pinned where there is a GPU: a fresh
allocation per step would page-fault its way through gigabytes, and a pageable target makes the copy
synchronous); stage 1 copies its shards there at the step. The step runs torch's fused CPU AdamW (which
unscales the gradients as it reads them) on `parallel.offload_threads` threads (default: this rank's share
of the cores), writes the updated 16-bit shard into pinned staging memory and copies it back to wherever
the engine keeps the weights.
Parameter offload (ZeRO-3's 16-bit shards on the CPU too) is a placement choice of parallel/zero3.py.

With stages 2 and 3 the gradients leave the GPU as they are reduced (the paper's section 4.1): `HostGradients`
copies each bucket's reduced shard into pinned staging memory on a stream of its own and a host thread adds
it into the fp32 host buffer, accumulating across micro-batches there, so no gradient shard stays on the
GPU; the step then reads that buffer where it lies. Profiler ranges named shardlm.offload.* mark the main
thread's host phases (waits for staging slots and for the adds, the update) and `HostGradients.seconds`
sums the host thread's (waits for copies, adds): bench/offload.py --profile reports both.
"""
from __future__ import annotations

import itertools
import os
import queue
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.autograd.profiler import record_function

from .. import cpu_adam
from ..grad_norm import sum_of_squares
from ..optim import MasterWeightOptimizer
from ..runtime.device import host_empty


def offload_threads(requested: int) -> int:
    """Threads for the CPU optimizer step: as asked, else this rank's share of the cores it may run on
    (torchrun sets OMP_NUM_THREADS=1 per rank, which would leave the offloaded step on one core), less one
    where there is a GPU: the host threads' passes split their work evenly over their threads, so one
    thread sharing a core with the training thread (launching kernels meanwhile) would hold up each
    pass, and the passes are memory-bound (half the cores stream as fast as all: bench/README.md)."""
    if requested > 0:
        return requested
    total = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else total
    # Bound to fewer cores than the host has, the set is shared by the node's ranks in proportion: one srun
    # task per rank (--cpus-per-task) holds its own share already, which divided by the node's ranks again left
    # its updates one thread; every rank in one task's set (or a NUMA node's) shares it.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = cores // max(1, round(local * cores / total))
    return max(1, share - 1 if torch.cuda.is_available() else share)


class OffloadedOptimizer(MasterWeightOptimizer):
    offloaded = True
    consume_grads = True  # its host gradient buffer is refilled every step

    def __init__(self, *args, threads: int = 0, **kwargs):
        torch.set_num_threads(offload_threads(threads))
        cpu_adam.load()  # built now, not in the middle of the first step
        super().__init__(*args, **kwargs)
        self.host_grad = host_empty(self.total, torch.float32, pin=torch.cuda.is_available())
        # parallel.overlap_update: the engine's OverlappedUpdate, and the landings of the update in flight
        self.overlap, self.landings = None, {}

    def wait_for_update(self) -> None:
        """The overlapped update in flight, if any, done: the masters, moments and host gradients are free."""
        for landing in self.landings.values():
            landing.wait()
        self.landings = {}

    def host_parts(self) -> list[torch.Tensor]:
        """The fp32 host buffer's view of each bucket's gradient shard."""
        return [self.host_grad[o:o + n] for o, n in zip(self.master_off, self.shard_len)]

    def _apply(self, lr: float, grads: list, params: list, scale: torch.Tensor, skip: torch.Tensor) -> None:
        self.wait_for_update()
        host = self.host_parts()
        with record_function("shardlm.offload.gradients_in"):
            for h, g in zip(host, grads):
                if g.data_ptr() != h.data_ptr():  # HostGradients has put them there already
                    h.copy_(g, non_blocking=True)
            scale, skip = scale.cpu(), skip.cpu()  # waits for the copies above too
        if bool(skip):  # a gradient that is not finite: the weights stay as they are (the next sync reports it)
            return
        # 16-bit weights that live in host memory (parameter offload) are updated where they lie: nothing
        # reads them until the next forward; the others through pinned staging, then copied up.
        staged = _Staged(params)

        def landed(b: int) -> None:  # each bucket goes up as soon as it is updated, beside the next ones' update
            if params[b] is not None and staged[b] is not params[b]:
                params[b].copy_(staged[b], non_blocking=True)
                staged[b] = None  # the pinned allocator reuses it once the copy is done: a bucket or two staged

        if self.overlap is not None:  # on a thread of its own, beside the next forward (update_overlap.py)
            runs, steps = self._bucket_segments(), self.steps_taken  # this step's count, whenever the thread runs

            def update(b: int) -> None:
                MasterWeightOptimizer._apply(self, lr, host, staged, scale, skip, runs[b], steps=steps)
            self.landings = self.overlap.start(list(runs), update, landed)
            return
        with record_function("shardlm.offload.host_update"):
            self._update_on_host(lr, host, staged, scale, skip, landed)

    def _update_on_host(self, lr: float, grads: list, staged: list, scale: torch.Tensor, skip: torch.Tensor,
                        landed=None) -> None:
        """The update of every segment, all on the host: the updated 16-bit shards into `staged`, and
        `landed(b)` called once bucket b's is complete."""
        for b, run in self._bucket_segments().items():
            super()._apply(lr, grads, staged, scale, skip, segments=run)
            if landed is not None:
                landed(b)

    def _bucket_segments(self) -> dict[int, list]:
        """The update's segments by bucket, in bucket order."""
        return {b: list(run) for b, run in itertools.groupby(self.segments, key=lambda seg: seg.bucket)}


class _Staged(list):
    """Where the update writes bucket b's 16-bit weights: the weights themselves where they live in host memory
    (parameter offload), else pinned staging allocated when the update reaches the bucket, so that only the
    buckets not yet copied up hold any."""

    def __init__(self, params: list):
        super().__init__([p if p is None or p.device.type == "cpu" else False for p in params])
        self.params = params

    def __getitem__(self, b):
        if super().__getitem__(b) is False:
            p = self.params[b]
            self[b] = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
        return super().__getitem__(b)


class HostGradients:
    """Gradient shards accumulated in fp32 in host memory (`host`: one view per bucket), each reduced bucket
    added as it comes: on a GPU copied down on a stream of its own into one of `slots` pinned staging buffers
    and added by a host thread once the copy is done, so backward runs on meanwhile; on the CPU added at once."""

    def __init__(self, host: list[torch.Tensor], device: torch.device, slots: int = 8):
        self.host, self.cuda, self.slots = host, device.type == "cuda", slots
        self.fresh = [True] * len(host)  # a bucket's first micro-batch of the step writes, later ones add
        # On the step's last micro-batch each bucket's sum of squares is taken as it is folded in, while the
        # data is in cache and backward still runs: the step's norm then needs no pass of its own.
        self.squares: list | None = None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.staging: queue.Queue = queue.Queue()
        self.made = 0
        self.pending: deque = deque()
        self.converted: torch.Tensor | None = None  # _add_converted's fp32 chunk (one host thread uses it)
        # The host threads' time in each phase, summed (a profiler records its starting thread's ranges only);
        # the *_cpu entries count the thread's own CPU time: the rest of the phase it waited (for the GIL, or
        # for a core).
        self.seconds = {k: 0.0 for k in ("wait_for_copy", "host_add", "host_add_cpu", "delayed_update",
                                         "overlapped_update", "overlapped_update_cpu")}
        # The host thread waits on this device's events (a thread starts on device 0, whose context it
        # would otherwise create on every rank).
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-host-grads", initializer=torch.cuda.set_device,
                                       initargs=(device,)) if self.cuda else None

    def add(self, b: int, shard: torch.Tensor) -> None:
        """Add bucket b's reduced shard (ready on the current stream) into its host view."""
        if not self.cuda:
            self._fold(b, shard, self.squares)
            return
        buf = self._free_buffer(shard.dtype)
        staging = buf[:shard.numel()]
        # `shard` is a tensor of its own (every transport's result is): once the side stream has read it, the
        # allocator may hand its memory on.
        self.stream.wait_stream(torch.cuda.current_stream(shard.device))
        with torch.cuda.stream(self.stream):
            staging.copy_(shard, non_blocking=True)
            done = torch.cuda.Event(blocking=True)  # the host thread sleeps on it instead of spinning
            done.record(self.stream)
        shard.record_stream(self.stream)
        self.pending.append(self.pool.submit(self._fold_after, b, staging, done, buf, self.squares))
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()  # raises what the host thread raised

    def _free_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        if self.made < self.slots and self.staging.empty():
            self.made += 1
            return host_empty(max(h.numel() for h in self.host), dtype, pin=True)
        with record_function("shardlm.offload.wait_for_slot"):  # the host's adds behind the device's backward
            return self.staging.get()  # blocks until the host thread has added one in

    def last_micro_batch(self) -> None:
        """The shards added from now on complete the step's gradient: take their sums of squares."""
        self.squares = [None] * len(self.host)

    def _fold(self, b: int, src: torch.Tensor, squares: list | None) -> None:
        """`squares`: the list the shard's add was made for (None before the last micro-batch), so that an
        earlier micro-batch's add, still running, never squares a partial sum."""
        lib = cpu_adam.load()
        if lib is not None and src.dtype == torch.bfloat16 and src.is_contiguous():
            # One pass, the squares taken on the way (cpu_adam.py).
            total = cpu_adam.fold_bf16(lib, self.host[b], src, write=self.fresh[b], squares=squares is not None)
            self.fresh[b] = False
            if squares is not None:
                squares[b] = total
            return
        if self.fresh[b]:
            self.host[b].copy_(src)
        elif src.dtype == self.host[b].dtype:
            self.host[b].add_(src)
        else:
            self._add_converted(self.host[b], src)
        self.fresh[b] = False
        if squares is not None:
            squares[b] = cpu_adam.sum_squares(lib, self.host[b]) if lib is not None else sum_of_squares(self.host[b])

    def _add_converted(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst += a 16-bit src, converted to fp32 a chunk at a time (each thread's part of a chunk stays in its
        cache between the two passes): torch's mixed-dtype add casts element by element, about five times
        slower, and at 7B parameters this add runs once per micro-batch."""
        assert dst.numel() == src.numel(), (dst.shape, src.shape)
        chunk = min(dst.numel(), (1 << 19) * torch.get_num_threads())
        if self.converted is None or self.converted.numel() < chunk:
            self.converted = torch.empty(chunk, dtype=dst.dtype)
        for d, s in zip(dst.split(chunk), src.split(chunk)):
            tmp = self.converted[:d.numel()]
            tmp.copy_(s)
            d.add_(tmp)

    def sum_of_squares(self, device: torch.device) -> torch.Tensor | None:
        """The step's gradient's sum of squares on `device` (bucket by bucket, as the optimizer would add
        them), once wait() has returned; None if some bucket's was not taken."""
        if self.squares is None or any(q is None for q in self.squares):
            return None
        total = torch.zeros((), device=device, dtype=torch.float32)
        for q in self.squares:
            total += q.to(device)
        return total

    def _fold_after(self, b: int, staging: torch.Tensor, done, buf: torch.Tensor, squares: list | None) -> None:
        try:
            start = time.perf_counter()
            done.synchronize()
            copied, cpu = time.perf_counter(), time.thread_time()
            self._fold(b, staging, squares)
            self.seconds["wait_for_copy"] += copied - start
            self.seconds["host_add"] += time.perf_counter() - copied
            self.seconds["host_add_cpu"] += time.thread_time() - cpu
        finally:
            self.staging.put(buf)

    @record_function("shardlm.offload.wait_for_adds")
    def wait(self) -> None:
        """Every added shard is in the host buffer (the first failure of the host thread raised, after all)."""
        error = None
        while self.pending:
            try:
                self.pending.popleft().result()
            except Exception as e:  # noqa: BLE001  (kept, so that the others are waited for first)
                error = error or e
        if error is not None:
            raise error

    def step_done(self) -> None:
        """The step has read the buffer: the next micro-batch starts the sum afresh."""
        self.fresh = [True] * len(self.host)
        self.squares = None

    def swap(self, other: list[torch.Tensor]) -> list[torch.Tensor]:
        """Accumulate into `other` from now on; returns the views filled so far (a delayed update reads them)."""
        filled, self.host = self.host, other
        return filled
