"""Tensor-parallel serving (`torchrun --nproc-per-node N -m shardlm serve ... --tp N`): every rank holds its
slice of the weights and runs the same engine steps, whose collectives (the tensor-parallel layers'
all-reduces) meet; rank 0 alone serves HTTP. Before each of its steps, rank 0's `Leader` broadcasts the
step's plan (the requests submitted since the last one, with their token ids and sampling, the ones
cancelled, and whether the last step failed) to the other ranks over a CPU (gloo) group beside the
accelerator's; each `follow`er applies it to its own engine and steps. The engines then hold the same
requests in the same slots, and as every rank's all-reduce returns the same logits, they pick the same
tokens: nothing comes back to rank 0.

So that no engine state changes between plans, the leader keeps what clients submit and cancel (from the
event loop's thread) until its next step, and applies it there. While idle it sends an empty plan every
`idle_s` seconds: a follower that hears nothing for PLAN_TIMEOUT_S (rank 0 gone) fails with a message
rather than waiting forever. On shutdown (rank 0's drain, after SIGTERM) the leader sends an exit plan and
the followers return 0; they ignore SIGTERM and SIGINT themselves (torchrun forwards them to every rank),
as rank 0 decides when they stop.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..inference import Engine, Request
from ..runtime.watchdog import peer_failure

log = logging.getLogger("shardlm.serve")
PLAN_TIMEOUT_S = 600.0  # the longest a follower waits for the next plan (a step's compile included)
IDLE_S = 5.0  # how often an idle leader tells the followers it is alive


@dataclass
class Plan:
    new: list[tuple[int, dict]] = field(default_factory=list)  # (sequence number, Request fields)
    cancel: list[int] = field(default_factory=list)  # sequence numbers
    abort: bool = False  # the leader's last step failed: drop every request, as it did
    step: bool = False  # run engine.step() after applying the rest
    exit: bool = False


def plan_group():
    """The CPU group the plans travel on, made by every rank (beside the NCCL one on GPUs)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=PLAN_TIMEOUT_S))


def agree_slots(slots: int, group) -> int:
    """The fewest slots any rank's free memory holds: every engine must have the same."""
    import torch
    n = torch.tensor([slots])
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=group)
    return int(n)


def _fields(r: Request) -> dict:
    return {"prompt": list(r.prompt), "max_new_tokens": r.max_new_tokens, "sampling": r.sampling,
            "stop_ids": tuple(r.stop_ids), "stop": tuple(r.stop), "adapter": r.adapter, "continues": r.continues}


class Leader:
    """Rank 0's engine, as EngineWorker uses one: submit and cancel from any thread, step() on the worker's."""

    idle_s = IDLE_S

    def __init__(self, engine: Engine, group):
        self.engine, self.group = engine, group
        self._lock = threading.Lock()
        self._new: list[Request] = []
        self._cancel: list[Request] = []
        self._abort = False
        self._seq: dict[int, int] = {}  # id(request) -> its sequence number, while the engine holds it
        self._next = 0

    def __getattr__(self, name):  # slots, max_len, model, device, in_use, ...
        return getattr(self.engine, name)

    def submit(self, request: Request) -> Request:
        if request.max_new_tokens == 0:  # ends at once on this rank; the followers need not know of it
            return self.engine.submit(request)
        self.engine.check(request)
        with self._lock:
            self._new.append(request)
        return request

    def cancel(self, request: Request) -> None:
        with self._lock:
            self._cancel.append(request)

    @property
    def busy(self) -> bool:
        return bool(self._new) or self.engine.busy

    @property
    def queued(self) -> int:
        return len(self._new) + self.engine.queued

    def step(self) -> list[Request]:
        with self._lock:
            new, cancel, self._new, self._cancel = self._new, self._cancel, [], []
        plan = Plan(abort=self._abort, step=True)
        self._abort = False
        for r in new:
            self._seq[id(r)], self._next = self._next, self._next + 1
            plan.new.append((self._seq[id(r)], _fields(r)))
        plan.cancel = [self._seq[id(r)] for r in cancel if id(r) in self._seq]
        self._send(plan)
        for r in new:
            self.engine.submit(r)
        for r in cancel:
            r.cancel()
        try:
            finished = self.engine.step()
        except RuntimeError as e:  # a step's collective with a follower gone: none can step again
            if peer_failure(e) is not None:
                _stop(e, "lost a follower mid-step")
            raise
        for r in finished:
            self._seq.pop(id(r), None)
        return finished

    def run(self, requests: list[Request]) -> list[Request]:
        for r in requests:
            self.submit(r)
        while self.busy:
            self.step()
        return requests

    def abort_all(self) -> list[Request]:
        self._abort = True
        held = self.engine.abort_all()
        for r in held:
            self._seq.pop(id(r), None)
        return held

    def idle(self) -> None:
        self._send(Plan())

    def finish(self) -> None:
        """Tell the followers to exit (after the worker's thread has stopped)."""
        self._send(Plan(exit=True))

    def _send(self, plan: Plan) -> None:
        try:
            dist.broadcast_object_list([plan], src=0, group=self.group)
        except Exception as e:  # a follower is gone: this server cannot step again, and must not hang
            _stop(e, "could not send the next step's plan to the other ranks (one exited?)")


def _stop(error: Exception, what: str) -> None:
    """Exit 1 with one line: a rank whose peers are gone can never step again. Each surviving rank printed a
    traceback or two of gloo's error first. os._exit: the broken group cannot be torn down, and left to
    interpreter shutdown its gloo threads abort the process (pytorch#190489)."""
    print(f"shardlm serve: error: rank {dist.get_rank()} {what}: {peer_failure(error) or error}; stopping",
          file=sys.stderr, flush=True)
    os._exit(1)


def follow(engine: Engine, group) -> int:
    """A follower rank's loop: each plan from rank 0 applied to `engine`, until the exit plan, at which the
    process exits 0."""
    rank = dist.get_rank()

    def stay(sig, _):
        print(f"shardlm serve --tp: rank {rank}: signal {sig}: rank 0 drains and then stops this rank",
              file=sys.stderr, flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stay)
    held: dict[int, Request] = {}
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
        except Exception as e:
            _stop(e, f"heard no plan from rank 0 within {PLAN_TIMEOUT_S:.0f} s, or lost it (rank 0 exited or hangs)")
        plan: Plan = box[0]
        if plan.exit:
            # Nothing of a follower's is left to write: it leaves now, not at interpreter shutdown, where the gloo
            # group's threads can abort the process (pytorch#190489; seen as exit -6 after SIGTERM under load).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if plan.abort:
            engine.abort_all()
            held.clear()
        for seq, fields in plan.new:
            held[seq] = engine.submit(Request(**fields, tag=seq))
        for seq in plan.cancel:
            if seq in held:
                held[seq].cancel()
        if not plan.step:
            continue
        try:
            finished = engine.step()
        except Exception as e:  # rank 0's step failed the same way: its next plan says abort
            if peer_failure(e) is not None:  # no plan will come: rank 0 is gone
                _stop(e, "lost rank 0 mid-step")
            log.error("rank %d: engine step failed:\n%s", rank, traceback.format_exc())
            engine.abort_all()
            held.clear()
            continue
        for r in finished:
            held.pop(r.tag, None)
