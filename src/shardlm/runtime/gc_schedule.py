"""Python's garbage collector on a schedule while training (torchtitan's `training.gc_freq`): automatic
collection off, a generation-1 collection every `every` steps, at the same step on every rank. Left to itself
the collector runs whenever a rank has allocated enough objects, at a different moment on each rank, and a
rank stalled in a collection holds up every peer at the next collective."""
from __future__ import annotations

import gc


class ScheduledGC:
    """`with ScheduledGC(every) as collector:` ... `collector.step(n)` after step n. `every` 0 leaves Python's
    automatic collection as it is; on exit the collector is on again if it was before."""

    def __init__(self, every: int):
        self.every, self.was_enabled = every, False

    def __enter__(self) -> "ScheduledGC":
        if self.every:
            self.was_enabled = gc.isenabled()
            gc.disable()
            gc.collect(1)  # what model building and compilation left, before the first step
        return self

    def step(self, n: int) -> None:
        if self.every and n % self.every == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.every and self.was_enabled:
            gc.enable()
