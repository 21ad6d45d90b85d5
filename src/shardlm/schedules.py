"""Pipeline schedules as data (the lowered action lists of torch.distributed.pipelining, built here from the
orders their papers give): a schedule is a function from (stages, virtual stages, micro-batches) to one
list of actions per rank, and one engine (parallel/pipeline.py) executes any such list. A new schedule is
a new list, not a new engine. This module imports no torch: the planner and the tests read the tables.

Stages: S = pp x v model chunks in order; chunk c of rank r is stage c pp + r (the looped placement of
interleaved 1F1B, Narayanan et al. 2021). Compute actions: F (forward of a stage on a micro-batch), B (its
backward), and for zero-bubble schedules I (the backward to the stage's input) and W (its weights'
gradients), Qi et al. 2024. `lower` inserts the point-to-point actions: RECV_F for a forward that needs
the previous stage's activations, SEND_F of its output; RECV_B for a backward that needs the next stage's
gradient, SEND_B of its input's. Each kind and direction between two ranks is a flow of its own, in order
on both ends (the engine gives each flow its process group).

- naive: one micro-batch at a time through every stage and back (plain model parallelism).
- gpipe (Huang et al. 2019): every forward, then every backward; holds m micro-batches' activations.
- 1f1b (PipeDream-flush, Narayanan et al. 2021): p - r - 1 warm-up forwards on rank r, then one forward
  and one backward in turn, then the remaining backwards; holds at most p micro-batches on rank 0.
- interleaved (Narayanan et al. 2021): 1F1B over v chunks per rank in groups of p micro-batches (Megatron-LM's
  order); the bubble shrinks v-fold. Needs m a multiple of p.
- zb-h1 (Qi et al. 2024, ZB-H1): 1F1B whose backward is split into I and W; rank r defers its W's by r
  micro-batches, so the input gradients reach the first stage sooner and the W's fill the cool-down's
  bubble, with 1F1B's memory.

`validate` checks a table without running it; `simulate` runs it with per-action costs and reports the
time, each rank's busy time, the bubble and the peak of micro-batches in flight, or the deadlock.
"""
from __future__ import annotations

import bisect
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
    """PipeDream-flush's 1F1B (Narayanan et al. 2021): rank r runs pp - r - 1 forwards before its first
    backward, then alternates, then drains its backwards."""
    orders = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        warm_up = [Action("F", r, i) for i in range(warm)]
        steady = [a for i in range(m - warm) for a in (Action("F", r, warm + i), Action("B", r, i))]
        cool_down = [Action("B", r, i) for i in range(m - warm, m)]
        orders.append(warm_up + steady + cool_down)
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
    """1F1B with B split into I and W (ZB-H1, Qi et al. 2024): rank r holds back r W's, computing each
    micro-batch's W r backwards later. The input gradients (I) then reach the first stage sooner, each
    rank's last r W's fill the wait for the last ones, and no rank holds more micro-batches than 1F1B's
    rank 0 (p): with F = I = W the bubble falls from (p - 1) 3 to p - 1 time units."""
    orders = []
    for r, order in enumerate(_one_f_one_b(pp, 1, m)):
        out, pending = [], []
        delay = r
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
                need = _recv_for(a, S)
                if need is not None and need not in sent:
                    break
                starts[r].append(max(clock[r], sent[need]) if need is not None else clock[r])
                clock[r] = starts[r][-1] + cost.get((a.kind, a.stage), cost[a.kind])
                if (send := _send_after(a, S)) is not None:
                    sent[_counterpart(send)] = clock[r]
                progressed = True
    if any(len(starts[r]) < len(orders[r]) for r in range(pp)):
        waiting = ", ".join(f"rank {r} at {orders[r][len(starts[r])]}" for r in range(pp)
                            if len(starts[r]) < len(orders[r]))
        raise ScheduleError(f"the compute orders deadlock: {waiting} wait for data never computed")
    lowered: list[list[Action]] = [[] for _ in range(pp)]
    for r in range(pp):
        at: dict = {}  # compute index -> the receives posted before it, in the order their data is sent
        mine = [(t, k, recv) for k, (recv, t) in enumerate(sent.items()) if rank_of(recv.stage, pp) == r]
        for t, _, recv in sorted(mine):
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


def _recv_for(a: Action, S: int) -> Action | None:
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

class Streams:
    """The point-to-point traffic as the engine runs it: each flow (activations or gradients, one direction,
    one pair of ranks) on a stream of its own at each end, its operations launched there in posting order;
    the k-th send of a flow matches its k-th receive once both are posted and the flow's previous pair has
    matched, `comm` later. Flows do not wait for each other."""

    def __init__(self, pp: int, comm: float = 0.0):
        self.pp, self.comm = pp, comm
        self.posted: dict = {}   # (flow, "SEND"/"RECV") -> [(action, post time)] in posting order
        self.count: dict = {}    # flow -> pairs matched
        self.last: dict = {}     # flow -> when its last pair matched
        self.matched: dict = {}  # action -> when it matched
        self.done_at = [0.0] * pp
        self.waits: list = []    # (rank, from, to): an operation launched before its peer's, waiting for it

    def _flow(self, rank: int, a: Action) -> tuple[tuple, str]:
        other = peer(a, self.pp)
        if a.kind.startswith("SEND"):
            return (a.kind[-1], rank, other), "SEND"
        return (a.kind[-1], other, rank), "RECV"

    def post(self, rank: int, batch: list[Action], time: float) -> None:
        for a in batch:
            flow, side = self._flow(rank, a)
            self.posted.setdefault((flow, side), []).append((a, time))
            self._match(flow)

    def _match(self, flow: tuple) -> None:
        sends, recvs = self.posted.get((flow, "SEND"), []), self.posted.get((flow, "RECV"), [])
        k = self.count.get(flow, 0)
        for (sa, st), (ra, rt) in zip(sends[k:], recvs[k:]):
            if _counterpart(sa) != ra:
                raise ScheduleError(f"rank {flow[1]} sends {sa} where rank {flow[2]} receives {ra}: "
                                    "their orders differ")
            before = self.last.get(flow, 0.0)
            self.matched[sa] = self.matched[ra] = self.last[flow] = max(st, rt, before) + self.comm
            for r, launched in ((flow[1], max(st, before)), (flow[2], max(rt, before))):
                self.waits.append((r, launched, max(st, rt, before)))
            for r in flow[1:]:
                self.done_at[r] = max(self.done_at[r], self.last[flow])
            k += 1
        self.count[flow] = k

    def unmatched(self) -> list[str]:
        return [f"rank {flow[1] if side == 'SEND' else flow[2]} {a}" for (flow, side), ops in self.posted.items()
                for a, _ in ops[self.count.get(flow, 0):]]


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
                    need = [a for a in _needs(item, S, set()) if a.kind.startswith("RECV")]
                    times = [streams.matched.get(a) for a in need]
                    if any(t is None for t in times):
                        break
                    c = cost.get((item.kind, item.stage), cost[item.kind])
                    clock[r] = max([clock[r], *times]) + c
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


def split_layers(cfg, stages: int, counts: str = "") -> list[list[int]]:
    """The layers of each stage: `counts` ("10,11,11") as given, or balanced by compute: a layer costs its
    FLOPs per token, the last stage's head (and loss) counts too, so it gets fewer layers where the
    vocabulary is large (the embedding is a lookup: no FLOPs)."""
    L = cfg.num_layers
    if counts:
        sizes = [int(c) for c in counts.split(",")]
    else:
        per_layer = cfg.param_counts()["active_per_layer"]
        head = cfg.vocab_size * cfg.hidden_size / per_layer  # in layers
        # The smallest last stage whose head plus layers does not exceed the others' even share.
        sizes = None
        for last in range(L // stages, -1, -1):
            rest = L - last
            if last + head <= -(-rest // (stages - 1)) + 1e-9 or last == 0:
                base, extra = divmod(rest, stages - 1)
                sizes = [base + (1 if i < extra else 0) for i in range(stages - 1)] + [last]
                break
        if not sizes or min(sizes) == 0:
            base, extra = divmod(L, stages)
            sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]
