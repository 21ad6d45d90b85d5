"""A schedule's table: each rank's list of actions, the form every schedule takes and the one engine
(parallel/pipeline.py) runs, as in torch.distributed.pipelining's lowered action lists. Compute actions (F,
B, and zero-bubble's I and W) and the point-to-point actions around them; `lower` places the latter, by a
timed run of the compute orders, so that a receive is posted about when its data leaves. No torch.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
SENDS = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}


class Action(NamedTuple):
    kind: str   # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B
    stage: int  # the stage computed, or whose input (RECV_F, SEND_B) or output (SEND_F, RECV_B) moves
    mb: int     # the micro-batch

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


class ScheduleError(ValueError):
    """A schedule's table cannot run as written; the message names the rank and action."""


def rank_of(stage: int, pp: int) -> int:
    return stage % pp



def peer(a: Action, pp: int) -> int:
    """The rank on the other end of a communication action."""
    return rank_of(a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1), pp)


def batches(actions: list[Action]) -> list[list[Action] | Action]:
    """The rank's actions with each run of consecutive communication actions as one batch."""
    out: list = []
    for a in actions:
        if a.kind in COMPUTE:
            out.append(a)
        elif out and isinstance(out[-1], list):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def counterpart(a: Action) -> Action:
    """The action on the peer that a communication action pairs with."""
    if a.kind == "SEND_F":
        return Action("RECV_F", a.stage + 1, a.mb)
    if a.kind == "RECV_F":
        return Action("SEND_F", a.stage - 1, a.mb)
    if a.kind == "SEND_B":
        return Action("RECV_B", a.stage - 1, a.mb)
    return Action("SEND_B", a.stage + 1, a.mb)


# ---- lowering: the point-to-point actions around the compute -------------------------------------------

NOMINAL = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # a backward twice a forward, split evenly into I and W


def lower(orders: list[list[Action]], pp: int, v: int, cost: dict | None = None) -> list[list[Action]]:
    """Each rank's compute order with its communication placed by a timed run of the orders (`cost` per
    action kind or (kind, stage) as `simulate` takes them, NOMINAL by default; data moves in no time): a
    send follows the compute that produces it, and its receive is posted at the edge of the receiver's
    computations nearest to when the data is sent (before the first compute starting then, or before the
    one running then if it is less than half done). Each flow's sends and receives then come in the same
    order on both ranks, and a receive is posted about when its data leaves: NCCL's kernel for a receive
    (or a send) occupies SMs from the moment it is launched until its peer's arrives, slowing the
    computations beside it, so neither should wait long for the other."""
    cost = {**NOMINAL, **(cost or {})}
    S = pp * v
    sent: dict = {}  # receive -> when its data is sent, in the order sent (a flow's, whatever the costs)
    starts: list[list[float]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while len(starts[r]) < len(orders[r]):
                a = orders[r][len(starts[r])]
                need = recv_for(a, S)
                if need is not None and need not in sent:
                    break
                starts[r].append(max(clock[r], sent[need]) if need is not None else clock[r])
                clock[r] = starts[r][-1] + cost.get((a.kind, a.stage), cost[a.kind])
                if (send := _send_after(a, S)) is not None:
                    sent[counterpart(send)] = clock[r]
                progressed = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        waiting = ", ".join(f"rank {r} at {orders[r][len(starts[r])]}" for r in range(pp)
                            if len(starts[r]) < len(orders[r]))
        raise ScheduleError(f"the compute orders deadlock: {waiting} wait for data never computed")
    mine: list[list] = [[] for _ in range(pp)]  # each rank's receives (when sent, order sent, receive)
    for k, (recv, t) in enumerate(sent.items()):
        mine[rank_of(recv.stage, pp)].append((t, k, recv))
    lowered: list[list[Action]] = [[] for _ in range(pp)]
    for r in range(pp):
        at: dict = {}  # compute index -> the receives posted before it, in the order their data is sent
        for t, _, recv in sorted(mine[r]):
            i = bisect.bisect_left(starts[r], t)  # the first compute starting once the data is sent
            running = orders[r][i - 1] if i else None
            if running and t - starts[r][i - 1] < starts[r][i - 1] + cost.get((running.kind, running.stage),
                                                                             cost[running.kind]) - t:
                i -= 1  # sent early in a compute: the receive waits beside it less than the send would
            at.setdefault(i, []).append(recv)
        for i, a in enumerate(orders[r]):
            lowered[r] += at.get(i, [])
            lowered[r].append(a)
            if (send := _send_after(a, S)) is not None:
                lowered[r].append(send)
    return lowered


def recv_for(a: Action, S: int) -> Action | None:
    """The receive whose data compute action `a` waits for (None: it needs none), of S stages."""
    if a.kind == "F" and a.stage > 0:
        return Action("RECV_F", a.stage, a.mb)
    if a.kind in ("B", "I") and a.stage < S - 1:
        return Action("RECV_B", a.stage, a.mb)
    return None


def _send_after(a: Action, S: int) -> Action | None:
    if a.kind == "F" and a.stage < S - 1:
        return Action("SEND_F", a.stage, a.mb)
    if a.kind in ("B", "I") and a.stage > 0:
        return Action("SEND_B", a.stage, a.mb)
    return None
