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

By module: table.py (the actions, lowering a compute order into a table), orders.py (each schedule's
compute order, its conditions on the layout, the stages' layer split), simulation.py (`validate` checks a
table without running it; `simulate` runs it with per-action costs and reports the time, each rank's busy
time, the bubble and the peak of micro-batches in flight, or the deadlock).
"""
from __future__ import annotations

from .orders import ORDERS, SCHEDULES, check_layout, schedule, split_layers
from .simulation import Simulation, Streams, simulate, validate
from .table import COMPUTE, NOMINAL, SENDS, Action, ScheduleError, batches, counterpart, lower, peer, rank_of

__all__ = ["COMPUTE", "NOMINAL", "ORDERS", "SCHEDULES", "SENDS", "Action", "ScheduleError", "Simulation", "Streams",
           "batches", "check_layout", "counterpart", "lower", "peer", "rank_of", "schedule", "simulate",
           "split_layers", "validate"]
