"""A watchdog that ends a rank whose collectives make no progress (a peer died or stalled), with a message.

Needed on GPUs: a stream that waits on a flag no peer will ever set (the copy engines' `StreamFlags`)
never errors out by itself, and NCCL's own watchdog, at its timeout, aborts the communicator, which lets
the waiting kernels finish on whatever data they hold: the step would go on with wrong numbers (a
checkpoint could be written from them) until NCCL ends the process later. The trainer's watchdog fires
first (NCCL's timeout is set longer, see mesh.py): it watches each step's completion on the GPU
(`watch`, an event) and host sections that wait on peers (`guard`). gloo raises at its own timeout.
"""
from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time

import torch.distributed as dist

from .heartbeat import Peers


class _Flag:
    """A waitable for `Watchdog.guard`: done when the guarded host section has returned. `alive()`, called
    inside the section as it makes progress (a save's each file written), moves its deadline on: a large
    model's save on a slow disk outlasts parallel.timeout_s and stalls nowhere."""

    def __init__(self, timeout_s: float):
        self.done, self.timeout_s = False, timeout_s
        self.deadline = time.monotonic() + timeout_s

    def query(self) -> bool:
        return self.done

    def alive(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s


class Watchdog:
    """Ends the process with a message when watched work makes no progress for `timeout_s`."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.pending = collections.deque()  # (deadline, event, label)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shardlm-watchdog", daemon=True)
        self.thread.start()

    def watch(self, event, label: str) -> None:
        """`event` (anything with query(), such as a CUDA event) must be done within timeout_s from now."""
        self.pending.append((time.monotonic() + self.timeout_s, event, label))

    @contextlib.contextmanager
    def guard(self, label: str):
        """The block must return within timeout_s (it waits on peers: collectives, their results), or within
        timeout_s of its last call of what it is given (`alive`)."""
        flag = _Flag(self.timeout_s)
        self.watch(flag, label)
        try:
            yield flag.alive
        finally:
            flag.done = True

    def _run(self) -> None:
        while not self.stop.wait(min(1.0, self.timeout_s / 4)):
            while self.pending and self.pending[0][1].query():
                self.pending.popleft()
            if self.pending and time.monotonic() > max(self.pending[0][0], getattr(self.pending[0][1], "deadline", 0)):
                peers = Peers.from_env()
                if peers is not None:
                    peers.gave_up()
                who = f": {peers.report()}" if peers is not None else ""
                print(f"shardlm: {self.pending[0][2]} made no progress for {self.timeout_s:g} s "
                      f"(parallel.timeout_s): a peer rank died or stalled{who}; exiting", file=sys.stderr, flush=True)
                os._exit(1)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def peer_failure(error: BaseException) -> str | None:
    """What failed, in a few words, if `error` is a collective that failed because a peer rank died or
    stalled (gloo raises plain RuntimeErrors naming its transport; NCCL and the store raise DistError)."""
    text = str(error)
    if not (isinstance(error, getattr(dist, "DistError", ())) or "/gloo/" in text or "NCCL" in text):
        return None
    detail = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    detail = detail.split("] ", 1)[-1] if detail.startswith("[") else detail  # drop gloo's source location
    detail = detail.split(". This is typically", 1)[0].rstrip(".")  # and its advice to read the peer's logs
    return f"communication failed: {detail}"
