"""The offloaded update beside the next step: delayed (ZeRO-Offload's DPU), or exact.

ZeRO-Offload (Ren et al. 2021) runs the CPU update after backward. Its one-step delayed update (DPU,
`parallel.delayed_update`, `DelayedUpdate`) hides it behind the whole next step by training on weights one
update stale: it changes the math. `OverlappedUpdate` (`parallel.overlap_update`) hides what exactness
allows: the CPU updates the buckets in the order forward first reads them, each bucket's 16-bit weights go
up as soon as they are done, and the next forward waits, block by block, only for the buckets it is about to
read, through the hooks ZeRO-1/2 use for the all-gathers of updated weights (parallel/zero.py). The first
micro-batch's forward then runs behind the update instead of after it; backward, the next step, a
checkpoint and evaluation wait for the whole update first.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable

import torch

from ..runtime.device import host_empty

if TYPE_CHECKING:
    from .offload import HostGradients, OffloadedOptimizer


class Landing:
    """Bucket b updated and its weights on their way up. `wait()` blocks until the update thread has
    issued their copy (raising what that thread raised), then makes the current stream wait for the copy."""

    def __init__(self, device: torch.device):
        self.device = device
        self.issued = threading.Event()
        self.copied: torch.cuda.Event | None = None
        self.future: Future | None = None

    def wait(self) -> None:
        while not self.issued.wait(timeout=0.2):
            if self.future is not None and self.future.done():
                self.future.result()  # the update failed: raise its error here, in the training thread
                if not self.issued.is_set():
                    raise RuntimeError("the overlapped update ended without updating every bucket")
        if self.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)


class OverlappedUpdate:
    """One host thread that runs a step's update bucket by bucket in `order` (set by the engine: the order
    forward reads the buckets in) and copies each bucket's weights up on a stream of its own."""

    def __init__(self, device: torch.device, seconds: dict | None = None):
        self.device, self.cuda = device, device.type == "cuda"
        self.seconds = seconds  # HostGradients.seconds, where the update's time is summed (the profile's phases)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        init = dict(initializer=torch.cuda.set_device, initargs=(device,)) if self.cuda else {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-overlapped-update", **init)
        self.order: list[int] = []

    def start(self, buckets: list[int], update: Callable[[int], None],
              land: Callable[[int], None]) -> dict[int, Landing]:
        """For each of `buckets`, in `order`: `update(b)`, then `land(b)` (the copy up, on this object's
        stream); returns their landings, to be waited for before anything reads the weights."""
        todo = set(buckets)
        order = [b for b in self.order if b in todo] + sorted(todo - set(self.order))
        landings = {b: Landing(self.device) for b in order}
        # The step's own work on the compute stream (the last backward's reads of the weights) comes first.
        ready = torch.cuda.current_stream(self.device).record_event() if self.cuda else None
        future = self.pool.submit(self._run, order, landings, ready, update, land)
        for landing in landings.values():
            landing.future = future
        return landings

    def _run(self, order: list[int], landings: dict[int, Landing], ready, update, land) -> None:
        if ready is not None:
            self.stream.wait_event(ready)
        for b in order:
            start, cpu = time.perf_counter(), time.thread_time()
            update(b)
            if self.seconds is not None:
                self.seconds["overlapped_update"] += time.perf_counter() - start
                self.seconds["overlapped_update_cpu"] += time.thread_time() - cpu
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    land(b)
                    landings[b].copied = self.stream.record_event()
            else:
                land(b)
            landings[b].issued.set()


class DelayedUpdate:
    """ZeRO-Offload's one-step delayed parameter update (Ren et al. 2021, section 4.2): step N's update runs on
    the CPU while the GPU runs step N + 1's forward and backward on the weights from before it, and lands at
    step N + 1's own update. So the gradient of step k is taken at the weights of update k - 2 (those of the
    start for k = 1, 2) and applied on top of update k - 1: it changes the math, and is off by default. Host
    gradients are double-buffered (4 bytes a parameter more), the updated 16-bit shards staged in pinned
    memory until they land; the host thread does CPU work only, so no collective or device work leaves the
    main thread. A checkpoint waits for the update in flight without landing it and keeps the live weights
    beside the masters (`::delayed_weights`), so saving changes nothing and a resumed run lands the saved
    masters at its first step, as the run it continues would have."""

    def __init__(self, opt: OffloadedOptimizer, host_grads: HostGradients, device: torch.device,
                 dtype: torch.dtype):
        self.opt, self.host_grads = opt, host_grads
        self.cuda = device.type == "cuda"
        self.spare_buffer = host_empty(opt.total, torch.float32, pin=self.cuda)
        self.spare = [self.spare_buffer[o:o + n] for o, n in zip(opt.master_off, opt.shard_len)]
        self.staged = [host_empty(n, dtype, pin=self.cuda) for n in opt.shard_len]
        init = dict(initializer=torch.cuda.set_device, initargs=(device,)) if self.cuda else {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="shardlm-delayed-update", **init)
        self.pending = None
        self.unlanded = False  # `staged` holds a finished update not yet copied to the weights
        self.copied = None  # the event after the last landing's copies, which read `staged`

    def submit(self, lr: float, step: int, grad_factor: float, sumsq: torch.Tensor | None) -> None:
        """Start this step's update on the CPU (the norm's bookkeeping, on the main thread, first)."""
        grads = list(self.host_grads.host)
        scale = self.opt.clip_scale(step, grads, grad_factor, sumsq)  # None only in fp16, which is refused
        self.spare = self.host_grads.swap(self.spare)
        self.opt.steps_taken += 1
        scale, skip = scale.cpu(), self.opt.skip_flag().cpu()
        self.pending = self.pool.submit(self._update, lr, grads, scale, skip, self.copied)

    def _update(self, lr: float, grads: list, scale: torch.Tensor, skip: torch.Tensor, copied) -> bool:
        """Whether it wrote `staged`: a skipped step (a gradient not finite) writes nothing there, which after
        a first step holds no update at all (uninitialised memory)."""
        if copied is not None:
            copied.synchronize()  # the last landing's copies have read the staged shards
        start = time.perf_counter()
        self.opt._update_on_host(lr, grads, self.staged, scale, skip)
        self.host_grads.seconds["delayed_update"] += time.perf_counter() - start
        return not bool(skip)

    def finish(self) -> None:
        """Wait for the update in flight: the masters and moments are then the step's, the weights not yet."""
        if self.pending is not None:
            wrote = self.pending.result()
            self.pending, self.unlanded = None, self.unlanded or wrote

    def resume(self, masters: list[torch.Tensor]) -> None:
        """A checkpoint's masters (this rank's shards) are the update that its run had not landed yet."""
        for staged, master in zip(self.staged, masters):
            staged.copy_(master)
        self.unlanded = True

    def land(self, param_shard) -> bool:
        """Wait for the update in flight, if any, and copy its 16-bit shards to `param_shard(b)`."""
        self.finish()
        if not self.unlanded:
            return False
        self.unlanded = False
        for b, src in enumerate(self.staged):
            dst = param_shard(b)
            if dst is not None:
                dst.copy_(src, non_blocking=True)
        if self.cuda:
            self.copied = torch.cuda.Event(blocking=True)
            self.copied.record()
        return True
