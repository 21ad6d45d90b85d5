"""The schedules' compute orders, each built from the order its paper gives (the package's docstring
lists them), checked against the layout and lowered into a table (table.py); and the stages' layers, split
by compute. No torch.
"""
from __future__ import annotations

import itertools

from ..naming import Naming
from .table import Action, ScheduleError, lower, rank_of

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1")


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


def check_layout(name: str, pp: int, v: int, m: int, naming: Naming = Naming()) -> None:
    """A schedule's conditions on its layout, refused with the values named."""
    key, show = naming.key, naming.show
    if name not in ORDERS:
        raise ScheduleError(f"{show('pp_schedule', name)} is not one of {', '.join(SCHEDULES)}")
    if v > 1 and name != "interleaved":
        raise ScheduleError(f"{show('virtual_stages', v)} needs {show('pp_schedule', 'interleaved')} (not {name!r})")
    # The other schedule a refusal offers must itself be accepted: 1f1b needs pp micro-batches, and any schedule
    # but interleaved needs one chunk per rank.
    def instead(other: str) -> str:
        return show('pp_schedule', other) + (f" with {show('virtual_stages', 1)}" if v > 1 else "")
    if name == "interleaved" and m % pp:
        raise ScheduleError(f"the interleaved schedule runs micro-batches in groups of {show('pp', pp)}: "
                            f"{m} micro-batches per step is not a multiple of it: change {key('global_batch')} or "
                            f"{key('micro_batch')} so that it is (or use {instead('1f1b' if m >= pp else 'gpipe')})")
    if name in ("1f1b", "interleaved", "zb-h1") and m < pp:
        raise ScheduleError(f"the {name} schedule needs at least {show('pp', pp)} micro-batches per step to "
                            f"fill the pipeline, not {m}: raise {key('global_batch')} or lower "
                            f"{key('micro_batch')} (or use {instead('gpipe')})")


def schedule(name: str, pp: int, v: int, m: int) -> list[list[Action]]:
    """Each rank's lowered action list for schedule `name` with pp ranks, v chunks per rank, m micro-batches."""
    check_layout(name, pp, v, m)
    return lower(ORDERS[name](pp, v, m), pp, v)


# ---- the stages' layers ----------------------------------------------------------------------------

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
    starts = itertools.accumulate(sizes, initial=0)
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]
