"""Pipeline schedules as data (the lowered action lists of torch.distributed.pipelining, built here from the
orders their papers give): a schedule is a function from (stages, virtual stages, micro-batches) to one
list of actions per rank, and one engine (parallel/pipeline.py) executes any such list. A new schedule is
a new list, not a new engine. This module imports no torch: the planner and the tests read the tables.

Stages: S = pp x v model chunks in order; chunk c of rank r is stage c pp + r (the looped placement of
interleaved 1F1B, Narayanan et al. 2021). Compute actions: F (forward of a stage on a micro-batch), B (its
backward), and for zero-bubble schedules I (the backward to the stage's input) and W (its weights'
gradients), Qi et al. 2024. `lower` inserts the point-to-point actions: RECV_F before a forward that needs
the previous stage's activations, SEND_F after it; RECV_B before a backward that needs the next stage's
gradient, SEND_B after it. Consecutive communication actions with the same peer form one batch
(batch_isend_irecv), so every batch has one peer.

- naive: one micro-batch at a time through every stage and back (plain model parallelism).
- gpipe (Huang et al. 2019): every forward, then every backward; holds m micro-batches' activations.
- 1f1b (PipeDream-flush, Narayanan et al. 2021): p - r - 1 warm-up forwards on rank r, then one forward
  and one backward in turn, then the remaining backwards; holds at most p micro-batches on rank 0.
- interleaved (Narayanan et al. 2021): 1F1B over v chunks per rank in groups of p micro-batches (Megatron-LM's
  order); the bubble shrinks v-fold. Needs m a multiple of p.
- zb-h1 (Qi et al. 2024, ZB-H1): 1F1B whose backward is split into I and W; each rank's W's are deferred by
  the warm-up count, filling the cool-down's bubble, with 1F1B's memory.

`validate` checks a table without running it; `simulate` runs it with per-action costs and reports the
time, each rank's busy time, the bubble and the peak of micro-batches in flight, or the deadlock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

COMPUTE = ("F", "B", "I", "W")
SENDS = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}
SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


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


# ---- compute orders ----------------------------------------------------------------------------------

def _naive(pp: int, v: int, m: int) -> list[list[Action]]:
    S = pp * v
    orders = [[] for _ in range(pp)]
    for i in range(m):
        for s in range(S):
            orders[rank_of(s, pp)].append(Action("F", s, i))
        for s in reversed(range(S)):
            orders[rank_of(s, pp)].append(Action("B", s, i))
    return orders


def _gpipe(pp: int, v: int, m: int) -> list[list[Action]]:
    S = pp * v
    orders = [[] for _ in range(pp)]
    for s in range(S):
        orders[rank_of(s, pp)] += [Action("F", s, i) for i in range(m)]
    for s in reversed(range(S)):
        orders[rank_of(s, pp)] += [Action("B", s, i) for i in range(m)]
    return orders


def _one_f_one_b(pp: int, v: int, m: int) -> list[list[Action]]:
    orders = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        order = [Action("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action("F", r, warm + i), Action("B", r, i)]
        order += [Action("B", r, i) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def _interleaved(pp: int, v: int, m: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: a rank's k-th forward is chunk (k // pp) % v of micro-batch
    (k // (pp v)) pp + k % pp, its k-th backward the same with chunks in reverse; (pp - r - 1) x 2 +
    (v - 1) x pp warm-up forwards on rank r."""
    total = m * v

    def fwd(k):
        return (k // pp) % v, (k // (pp * v)) * pp + k % pp

    def bwd(k):
        c, i = fwd(k)
        return v - 1 - c, i
    orders = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        order = [Action("F", fwd(k)[0] * pp + r, fwd(k)[1]) for k in range(warm)]
        for k in range(total - warm):
            c, i = fwd(warm + k)
            order.append(Action("F", c * pp + r, i))
            c, i = bwd(k)
            order.append(Action("B", c * pp + r, i))
        for k in range(total - warm, total):
            c, i = bwd(k)
            order.append(Action("B", c * pp + r, i))
        orders.append(order)
    return orders


def _zb_h1(pp: int, v: int, m: int) -> list[list[Action]]:
    """1F1B with B split into I and W; rank r defers its W's by its warm-up count, so the ranks that wait
    longest in the cool-down compute weight gradients meanwhile (ZB-H1, Qi et al. 2024, figure 3)."""
    orders = []
    for r, order in enumerate(_one_f_one_b(pp, 1, m)):
        out, pending = [], []
        delay = pp - r - 1
        for a in order:
            if a.kind != "B":
                out.append(a)
                continue
            out.append(Action("I", a.stage, a.mb))
            pending.append(Action("W", a.stage, a.mb))
            if len(pending) > delay:
                out.append(pending.pop(0))
        orders.append(out + pending)
    return orders


ORDERS = {"naive": _naive, "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1}


def check_layout(name: str, pp: int, v: int, m: int) -> None:
    """A schedule's conditions on its layout, refused with the values named."""
    if name not in ORDERS:
        raise ScheduleError(f"parallel.pp_schedule = {name!r} is not one of {', '.join(SCHEDULES)}")
    if v > 1 and name != "interleaved":
        raise ScheduleError(f"parallel.virtual_stages = {v} needs parallel.pp_schedule = 'interleaved' (not {name!r})")
    if name == "interleaved" and m % pp:
        raise ScheduleError(f"the interleaved schedule runs micro-batches in groups of parallel.pp = {pp}: "
                            f"{m} micro-batches per step is not a multiple of it")
    if name in ("1f1b", "interleaved", "zb-h1") and m < pp:
        raise ScheduleError(f"the {name} schedule needs at least parallel.pp = {pp} micro-batches per step to "
                            f"fill the pipeline, not {m}: raise train.global_batch_size or lower "
                            "train.micro_batch_size (or use pp_schedule gpipe)")


def schedule(name: str, pp: int, v: int, m: int) -> list[list[Action]]:
    """Each rank's lowered action list for schedule `name` with pp ranks, v chunks per rank, m micro-batches."""
    check_layout(name, pp, v, m)
    return lower(ORDERS[name](pp, v, m), pp, v)


# ---- lowering: the point-to-point actions around the compute -------------------------------------------

def lower(orders: list[list[Action]], pp: int, v: int) -> list[list[Action]]:
    S = pp * v
    split = any(a.kind == "I" for order in orders for a in order)
    lowered = []
    for order in orders:
        out = []
        for a in order:
            if a.kind == "F":
                if a.stage > 0:
                    out.append(Action("RECV_F", a.stage, a.mb))
                out.append(a)
                if a.stage < S - 1:
                    out.append(Action("SEND_F", a.stage, a.mb))
            elif a.kind in ("B", "I"):
                if a.stage < S - 1:
                    out.append(Action("RECV_B", a.stage, a.mb))
                out.append(a)
                if a.stage > 0:
                    out.append(Action("SEND_B", a.stage, a.mb))
            else:
                assert a.kind == "W" and split
                out.append(a)
        lowered.append(out)
    return lowered


def peer(a: Action, pp: int) -> int:
    """The rank on the other end of a communication action."""
    return rank_of(a.stage + (1 if a.kind in ("SEND_F", "RECV_B") else -1), pp)


def batches(actions: list[Action], pp: int) -> list[list[Action] | Action]:
    """The rank's actions with consecutive communication actions to one peer grouped into batches."""
    out: list = []
    for a in actions:
        if a.kind in COMPUTE:
            out.append(a)
        elif out and isinstance(out[-1], list) and peer(out[-1][0], pp) == peer(a, pp):
            out[-1].append(a)
        else:
            out.append([a])
    return out


def _counterpart(a: Action) -> Action:
    """The action on the peer that a communication action pairs with."""
    if a.kind == "SEND_F":
        return Action("RECV_F", a.stage + 1, a.mb)
    if a.kind == "RECV_F":
        return Action("SEND_F", a.stage - 1, a.mb)
    if a.kind == "SEND_B":
        return Action("RECV_B", a.stage - 1, a.mb)
    return Action("SEND_B", a.stage + 1, a.mb)


# ---- checking and simulating a table -----------------------------------------------------------------

def validate(tables: list[list[Action]], pp: int, v: int, m: int) -> None:
    """Without running it: every stage of this rank computes each micro-batch's F once, then its B (or I
    and W) once, after that F; every send has its receive on the peer and the two ranks post their
    batches to each other in the same order (per-pair order is what NCCL's point-to-point needs); every
    receive comes before the compute that uses it. ScheduleError otherwise."""
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
            needs = {"B": [("F", a.stage), ("RECV_B", a.stage) if a.stage < S - 1 else None],
                     "I": [("F", a.stage), ("RECV_B", a.stage) if a.stage < S - 1 else None],
                     "W": [("I", a.stage)], "F": [("RECV_F", a.stage) if a.stage > 0 else None],
                     "SEND_F": [("F", a.stage)], "SEND_B": [("B", a.stage), ("I", a.stage)]}.get(a.kind, [])
            needs = [n for n in needs if n is not None]
            if a.kind == "SEND_B":  # after its B or its I, whichever the schedule has
                needs = [n for n in needs if Action(n[0], n[1], a.mb) in done][:1] or needs[:1]
            for kind, stage in needs:
                if Action(kind, stage, a.mb) not in done:
                    raise ScheduleError(f"rank {r}: {a} comes before {Action(kind, stage, a.mb)}")
            done.add(a)
        for s in range(r, S, pp):
            for i in range(m):
                if Action("F", s, i) not in done or not (Action("B", s, i) in done or Action("W", s, i) in done):
                    raise ScheduleError(f"rank {r}: stage {s} does not compute micro-batch {i} forward and backward")
    for a_rank in range(pp):
        for b_rank in range(a_rank + 1, pp):
            mine = [b for b in batches(tables[a_rank], pp) if isinstance(b, list) and peer(b[0], pp) == b_rank]
            theirs = [b for b in batches(tables[b_rank], pp) if isinstance(b, list) and peer(b[0], pp) == a_rank]
            for k, (x, y) in enumerate(zip(mine, theirs)):
                if sorted(map(_counterpart, x)) != sorted(y):
                    raise ScheduleError(f"ranks {a_rank} and {b_rank} post their batch {k} to each other out of step: "
                                        f"[{', '.join(map(str, x))}] against [{', '.join(map(str, y))}]")
            if len(mine) != len(theirs):
                raise ScheduleError(f"ranks {a_rank} and {b_rank} post {len(mine)} and {len(theirs)} batches to each other")


@dataclass(frozen=True)
class Simulation:
    time: float              # when the last rank finishes
    busy: list[float]        # each rank's compute time
    in_flight: list[int]     # each rank's peak of micro-batches whose activations it holds

    @property
    def bubble(self) -> float:
        """The idle fraction of the ranks' time, averaged over the ranks."""
        return 1 - sum(self.busy) / (len(self.busy) * self.time)


def simulate(tables: list[list[Action]], pp: int, cost: dict | None = None, comm: float = 0.0) -> Simulation:
    """Run a table with per-action costs (F, B, I, W; a batch takes `comm` once both ranks have posted it):
    each rank computes in its list's order, posts its batches as it reaches them (posting never blocks),
    and waits before a compute only for the receive it needs. ScheduleError names the ranks stuck in a
    deadlock."""
    cost = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, **(cost or {})}
    lists = [batches(t, pp) for t in tables]
    pos, clock = [0] * pp, [0.0] * pp
    busy, held, peak = [0.0] * pp, [0] * pp, [0] * pp
    posted: dict = {}     # (rank, peer) -> [post time of each batch, in order]
    arrived: dict = {}    # action received -> time its batch completed
    matched: dict = {}    # (rank, peer) -> batches completed so far

    def complete(r: int, q: int) -> None:
        """Complete the batches both ranks have posted to each other, in order."""
        key, back = (r, q), (q, r)
        while matched.get(key, 0) < min(len(posted.get(key, [])), len(posted.get(back, []))):
            k = matched.get(key, 0)
            done = max(posted[key][k][0], posted[back][k][0]) + comm
            for a in posted[key][k][1] + posted[back][k][1]:
                if a.kind.startswith("RECV"):
                    arrived[a] = done
            matched[key] = matched[back] = k + 1
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                item = lists[r][pos[r]]
                if isinstance(item, list):
                    q = peer(item[0], pp)
                    posted.setdefault((r, q), []).append((clock[r], item))
                    complete(r, q)
                else:
                    need = None
                    if item.kind == "F" and item.stage > 0:
                        need = Action("RECV_F", item.stage, item.mb)
                    elif item.kind in ("B", "I") and any(a == Action("RECV_B", item.stage, item.mb) for a in tables[r]):
                        need = Action("RECV_B", item.stage, item.mb)
                    if need is not None and need not in arrived:
                        break
                    start = max(clock[r], arrived.get(need, 0.0))
                    clock[r] = start + cost[item.kind]
                    busy[r] += cost[item.kind]
                    if item.kind == "F":
                        held[r] += 1
                        peak[r] = max(peak[r], held[r])
                    elif item.kind in ("B", "W"):
                        held[r] -= 1
                pos[r] += 1
                progress = True
    stuck = [r for r in range(pp) if pos[r] < len(lists[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at {lists[r][pos[r]]}" for r in stuck)
        raise ScheduleError(f"deadlock: {waits} wait for receives that are never sent")
    return Simulation(max(clock), busy, peak)
