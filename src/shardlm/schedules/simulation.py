"""Checking and simulating a table without processes: `validate` refuses a table that cannot run as
written (an action out of order, a send without its receive, a deadlock), and `simulate` runs one with
per-action costs, as the engine would, for its time, each rank's busy time, the bubble and the peak of
micro-batches in flight. The planner prices pipelines with it (plan/flops.py). No torch.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .table import NOMINAL, SENDS, Action, ScheduleError, batches, counterpart, peer, rank_of, recv_for


class Streams:
    """The point-to-point traffic as the engine runs it: each flow (activations or gradients, one direction,
    one pair of ranks) on a stream of its own at each end, its operations launched there in posting order;
    the k-th send of a flow matches its k-th receive once both are posted and the flow's previous pair has
    matched, `comm` later. Flows do not wait for each other."""

    def __init__(self, pp: int, comm: float = 0.0):
        self.pp, self.comm = pp, comm
        self.posted: dict = {}   # flow -> ([(send, post time)], [(receive, post time)]) in posting order
        self.count: dict = {}    # flow -> pairs matched
        self.last: dict = {}     # flow -> when its last pair matched
        self.matched: dict = {}  # action -> when it matched
        self.done_at = [0.0] * pp
        self.waits: list = []    # (rank, from, to): an operation launched before its peer's, waiting for it

    def post(self, rank: int, batch: list[Action], time: float) -> None:
        for a in batch:
            other, sending = peer(a, self.pp), a.kind.startswith("SEND")
            flow = (a.kind[-1], rank, other) if sending else (a.kind[-1], other, rank)
            if (ops := self.posted.get(flow)) is None:
                ops = self.posted[flow] = ([], [])
            ops[0 if sending else 1].append((a, time))
            self._match(flow, *ops)

    def _match(self, flow: tuple, sends: list, recvs: list) -> None:
        k, ready = self.count.get(flow, 0), min(len(sends), len(recvs))
        if k == ready:  # most posts: the peer's side of the pair is not posted yet
            return
        last, (src, dst), matched, done_at = self.last.get(flow, 0.0), flow[1:], self.matched, self.done_at
        for k in range(k, ready):  # indices, not slices: a flow may hold hundreds of operations
            (sa, st), (ra, rt) = sends[k], recvs[k]
            if counterpart(sa) != ra:
                raise ScheduleError(f"rank {src} sends {sa} where rank {dst} receives {ra}: their orders differ")
            met = max(st, rt, last)
            self.waits += ((src, max(st, last), met), (dst, max(rt, last), met))
            last = matched[sa] = matched[ra] = met + self.comm
            done_at[src], done_at[dst] = max(done_at[src], last), max(done_at[dst], last)
        self.last[flow], self.count[flow] = last, ready

    def unmatched(self) -> list[str]:
        return [f"rank {flow[1 + side]} {a}" for flow, both in self.posted.items() for side in (0, 1)
                for a, _ in both[side][self.count.get(flow, 0):]]


def validate(tables: list[list[Action]], pp: int, v: int, m: int) -> None:
    """Every stage of this rank computes each micro-batch's F once and then its B (or I, then W) once; every
    receive comes before the compute that uses it and every send after the compute that produces it; each
    flow's sends and receives pair up in the same order (Streams); and a run of the table completes, no
    compute waiting, through sends and receives, on itself (`simulate`). ScheduleError otherwise."""
    S = pp * v
    if len(tables) != pp:
        raise ScheduleError(f"{len(tables)} action lists for {pp} ranks")
    for r, actions in enumerate(tables):
        done: set = set()
        for a in actions:
            if rank_of(a.stage, pp) != r:
                raise ScheduleError(f"rank {r}: {a} belongs to rank {rank_of(a.stage, pp)}")
            if a in done:
                raise ScheduleError(f"rank {r}: {a} appears twice")
            for need in _needs(a, S, done):
                if need not in done:
                    raise ScheduleError(f"rank {r}: {a} comes before {need}")
            done.add(a)
        for s in range(r, S, pp):
            for i in range(m):
                if Action("F", s, i) not in done or not (Action("B", s, i) in done or Action("W", s, i) in done):
                    raise ScheduleError(f"rank {r}: stage {s} does not compute micro-batch {i} forward and backward")
    streams = Streams(pp)
    for r, actions in enumerate(tables):
        streams.post(r, [a for a in actions if a.kind in SENDS or a.kind in SENDS.values()], 0.0)
    if streams.unmatched():
        raise ScheduleError(f"point-to-point operations without their peer's: {', '.join(streams.unmatched())}")
    simulate(tables, pp)


def _needs(a: Action, S: int, done: set) -> list[Action]:
    """What must come before `a` on its rank."""
    if a.kind == "F":
        return [Action("RECV_F", a.stage, a.mb)] if a.stage > 0 else []
    if a.kind in ("B", "I"):
        return [Action("F", a.stage, a.mb)] + ([Action("RECV_B", a.stage, a.mb)] if a.stage < S - 1 else [])
    if a.kind == "W":
        return [Action("I", a.stage, a.mb)]
    if a.kind == "SEND_F":
        return [Action("F", a.stage, a.mb)]
    if a.kind == "SEND_B":  # after its B, or its I where the schedule splits the backward
        split = Action("I", a.stage, a.mb)
        return [split if split in done else Action("B", a.stage, a.mb)]
    return []


@dataclass(frozen=True)
class Simulation:
    time: float              # when the last rank finishes
    busy: list[float]        # each rank's compute time
    in_flight: list[int]     # each rank's peak of micro-batches whose activations it holds
    spinning: float = 0.0    # time sends and receives waited for their peers beside a computation (see lower)

    @property
    def bubble(self) -> float:
        """The idle fraction of the ranks' time, averaged over the ranks."""
        return 1 - sum(self.busy) / (len(self.busy) * self.time)


def simulate(tables: list[list[Action]], pp: int, cost: dict | None = None, comm: float = 0.0) -> Simulation:
    """Run a table with per-action costs (F, B, I, W, or (kind, stage) where stages differ; a send and its
    receive take `comm` once both are launched): each rank computes in its list's order, posts its batches
    as it reaches them (posting does not block), and waits before a compute only for the receive it needs.
    ScheduleError names the ranks stuck in a deadlock."""
    cost = {**NOMINAL, **(cost or {})}
    S = max(a.stage for t in tables for a in t) + 1
    lists = [batches(t) for t in tables]
    streams = Streams(pp, comm)
    pos, clock = [0] * pp, [0.0] * pp
    busy, held, peak = [0.0] * pp, [0] * pp, [0] * pp
    computing: list[list] = [[] for _ in range(pp)]  # each rank's (start, end) of its computations
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                item = lists[r][pos[r]]
                if isinstance(item, list):
                    streams.post(r, item, clock[r])
                else:
                    need = recv_for(item, S)  # the one receive a compute may wait for
                    start = clock[r]
                    if need is not None:
                        if need not in streams.matched:
                            break
                        start = max(start, streams.matched[need])
                    c = cost.get((item.kind, item.stage), cost[item.kind])
                    clock[r] = start + c
                    busy[r] += c
                    computing[r].append((clock[r] - c, clock[r]))
                    if item.kind == "F":
                        held[r] += 1
                        peak[r] = max(peak[r], held[r])
                    elif item.kind in ("B", "W"):
                        held[r] -= 1
                pos[r] += 1
                progress = True
    stuck = [f"rank {r} at {lists[r][pos[r]]}" for r in range(pp) if pos[r] < len(lists[r])]
    if stuck:
        raise ScheduleError(f"deadlock: {', '.join(stuck)} wait for receives that never complete")
    return Simulation(max([*clock, *streams.done_at]), busy, peak, _overlap(streams.waits, computing))


def _overlap(waits: list[tuple[int, float, float]], computing: list[list[tuple[float, float]]]) -> float:
    """The time the waits (rank, start, end) overlap their rank's computations (each rank's in time order,
    disjoint): a pipeline of 32 stages and 128 micro-batches has tens of thousands of each, so each wait looks
    up only the computations it meets."""
    ends = [[b for _, b in c] for c in computing]
    total = 0.0
    for r, start, to in waits:
        i = bisect.bisect_right(ends[r], start)  # the first computation ending after the wait starts
        while i < len(computing[r]) and computing[r][i][0] < to:
            a, b = computing[r][i]
            total += max(0.0, min(b, to) - max(a, start))
            i += 1
    return total
