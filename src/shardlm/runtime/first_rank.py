"""Long work while peer ranks wait: a checkpoint's pick and verification before a resume or a tensor-parallel load
(every byte's CRC32), the first rank's writes of a save, each rank's shards of a save; many minutes for a large
model on a network disk. Waiting in one collective, the peers were ended by the process group's timeout while the
work went on. Here the work runs in a thread, and the main threads answer each other with a small collective
every tick (a quarter of the stall limit, at most TICK_S seconds) until it is done: a wait lasts as long as the
work makes progress. The work says so by calling `moved()` (each file written, each 16 MB read); work that has
not for `stall_s` seconds (a write to a filesystem that hangs) ends the wait on every rank with an error naming
it, as the timeout did before; a rank that dies still ends the others at the timeout."""
from __future__ import annotations

import math
import pickle
import threading
import time

import torch.distributed as dist

from ..config import RunError

TICK_S = 10.0


class Moved:
    """`moved()`: what work calls as it makes progress (any arguments ignored: a progress callback's count of
    bytes); the waiting loop compares `count` between ticks."""

    def __init__(self):
        self.count = 0

    def __call__(self, *_) -> None:
        self.count += 1


def tick_s(stall_s: float | None) -> float:
    """How often waiting ranks answer each other: well within the stall limit (and the process group's timeout,
    which it equals)."""
    return TICK_S if stall_s is None else min(TICK_S, stall_s / 4)


def stalled(what: str, stall_s: float) -> RunError:
    return RunError(f"{what} made no progress for {stall_s:g} s (parallel.timeout_s): a read or write that does not "
                    "return (a network filesystem that hangs?)")


def first_rank_result(work, group=None, stall_s: float | None = None, what: str = "the first rank's work",
                      on_tick=None):
    """`work(moved)`, run on the first rank of `group` (None: the world), its result on every rank of the group;
    an exception it raised is raised on every rank, as is `stalled(what, ...)` once it has not called `moved()`
    for `stall_s` seconds (None: no limit). `on_tick()` is called on every rank at each answer (a watchdog's
    sign that the wait is alive). `work` runs in a thread beside those answers: it must use no collective."""
    moved = Moved()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return work(moved)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank() == first:
        box: dict = {}
        thread = threading.Thread(target=_run, args=(lambda: work(moved), box), name="first rank's work", daemon=True)
        thread.start()
        seen, since = moved.count, time.monotonic()
        while True:
            thread.join(tick_s(stall_s))
            done, value = not thread.is_alive(), box.get("value")
            if moved.count != seen:
                seen, since = moved.count, time.monotonic()
            elif not done and stall_s is not None and time.monotonic() - since > stall_s:
                done, value = True, stalled(what, stall_s)  # the thread is left to its daemon's fate
            dist.broadcast_object_list([done, _sendable(value) if done else None], src=first, group=group)
            if on_tick is not None:
                on_tick()
            if done:
                return _returned(value)
    while True:
        said = [None, None]
        dist.broadcast_object_list(said, src=first, group=group)
        if on_tick is not None:
            on_tick()
        if said[0]:
            return _returned(said[1])


def every_rank_done(thread: threading.Thread, moved: Moved, group=None, stall_s: float | None = None,
                    what: str = "the work", on_tick=None) -> None:
    """Wait until `thread` (this rank's part of work that every rank of `group` does in a thread, calling
    `moved()` as it goes) has ended on every rank, however long it takes; a rank's part that has not moved for
    `stall_s` seconds ends the wait on every rank with `stalled` naming the rank. `on_tick()` as in
    first_rank_result. All ranks decide from the same answers, counted in ticks, so they decide alike."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        thread.join()
        return
    size, tick = dist.get_world_size(group), tick_s(stall_s)
    limit = None if stall_s is None else math.ceil(stall_s / tick)
    last, quiet = [None] * size, [0] * size  # each rank's count at the last answer, and answers since it moved
    while True:
        thread.join(tick)
        answers = [None] * size
        dist.all_gather_object(answers, (not thread.is_alive(), moved.count), group=group)
        if on_tick is not None:
            on_tick()
        if all(done for done, _ in answers):
            return
        for r, (done, count) in enumerate(answers):
            quiet[r] = 0 if done or count != last[r] else quiet[r] + 1
            last[r] = count
        if limit is not None and (stuck := [r for r in range(size) if quiet[r] >= limit]):
            rank = dist.get_global_rank(group, stuck[0]) if group is not None else stuck[0]
            raise stalled(f"{what} on rank {rank}", stall_s)


def _run(work, box: dict) -> None:
    try:
        box["value"] = work()
    except BaseException as e:  # raised on every rank, this one's main thread too
        box["value"] = e


def _sendable(value):
    """The value, or an exception that does not survive pickling (an exception class whose arguments are not its
    message) as a RunError with its message."""
    try:
        pickle.loads(pickle.dumps(value))
        return value
    except Exception:
        if isinstance(value, BaseException):
            return RunError(f"{type(value).__name__}: {value}")
        raise


def _returned(value):
    if isinstance(value, BaseException):
        raise value
    return value
