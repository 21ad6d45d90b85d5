"""Long work that one rank does for all (a checkpoint's pick and verification before a resume or a tensor-parallel
load: every byte's CRC32, many minutes for a large model on a network disk) while the others wait. Waiting in one
collective, they were ended by the process group's timeout (10 minutes) while the first rank still worked. Here
the work runs in a thread of the first rank, whose main thread answers the others with a broadcast every TICK_S
seconds until the work is done: a wait lasts as long as the work, and a first rank that dies still ends the
others at the timeout."""
from __future__ import annotations

import pickle
import threading

import torch.distributed as dist

from ..config import RunError

TICK_S = 10.0


def first_rank_result(work, group=None, tick_s: float | None = None, on_tick=None):
    """`work()`, run on the first rank of `group` (None: the world), its result on every rank of the group; an
    exception it raised is raised on every rank. `on_tick()` is called on every rank at each answer (a
    watchdog's sign that the wait is alive). `work` runs in a thread beside those answers: it must use no
    collective of its own."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return work()
    first = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank() == first:
        box: dict = {}
        thread = threading.Thread(target=_run, args=(work, box), name="first rank's work", daemon=True)
        thread.start()
        while True:
            thread.join(TICK_S if tick_s is None else tick_s)
            done = not thread.is_alive()
            dist.broadcast_object_list([done, _sendable(box.get("value")) if done else None], src=first, group=group)
            if on_tick is not None:
                on_tick()
            if done:
                return _returned(box["value"])
    while True:
        said = [None, None]
        dist.broadcast_object_list(said, src=first, group=group)
        if on_tick is not None:
            on_tick()
        if said[0]:
            return _returned(said[1])


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
