"""A graceful stop on SIGTERM, SIGINT or SIGHUP: finish the step, agree across ranks, save, exit (the scheme of
Megatron-LM's `--exit-signal-handler`).

Schedulers preempting a job (Slurm, Kubernetes), torchrun shutting its workers down and Ctrl-C send
SIGTERM or SIGINT. Acting in the handler would save a step half applied (some buckets updated and not
others, or all of them before the step counter moved, so that a resumed run repeats a batch), and ranks
caught at different steps would enter the collective save out of step. So the handler only records the
signal; after every step the training loop asks whether any rank received one (`agreed`: one integer
all-reduced over a gloo group, on the host, so no GPU sync), and every rank stops after the same step.
A second SIGINT interrupts at once, as Python's default handler does, with nothing saved (torchrun
passes a Ctrl-C on to its workers as SIGTERM, after the terminal's SIGINT: that is one request).
"""
from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

# SIGHUP: the terminal went away (an ssh session dropped), which killed the run with every step since its last save.
SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


class StopSignals:
    """Within `with StopSignals(group):`, SIGTERM and SIGINT only set `received` (the first one's
    number); `agreed()` is the largest number any rank of `group` received (0: none), alike on every
    rank. Handlers are installed only in the main thread, where Python runs them; elsewhere nothing
    changes. `group`: a group that carries CPU tensors (gloo), or None for a single process."""

    def __init__(self, group=None):
        self.group = group
        self.received = 0
        self._seen: set[int] = set()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            # nohup's ignored SIGHUP stays ignored: that run is meant to outlive its terminal.
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS
                              if s in (signal.SIGTERM, signal.SIGINT) or signal.getsignal(s) != signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            # None: the handler was not set from Python (an embedding application's); the default is closest.
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and signum in self._seen:
            raise KeyboardInterrupt  # Ctrl-C twice: the user will not wait for the step to end
        self._seen.add(signum)
        self.received = self.received or signum

    def agreed(self) -> int:
        """A collective over `group`: every rank must call it at the same point of the same step."""
        if self.group is None:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)


def host_group(timeout=None):
    """A group over the whole world for small host-side collectives: the default group where it is gloo
    already, else a gloo group beside it (NCCL carries only GPU tensors, and reading one back would make
    the host wait for the GPU). Collective: every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


class LazyHostGroup:
    """host_group(timeout), made at the first call (code that only steps never needs it) and the same after:
    the first call is collective, so every rank makes it at the same point (a run's start, a save's poll)."""

    def __init__(self, timeout=None):
        self.timeout, self.group, self.made = timeout, None, False

    def __call__(self):
        if not self.made:
            self.group, self.made = host_group(self.timeout), True
        return self.group


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def resume_command(out, world: int) -> str:
    """The command that continues a run saved in `out`, launched as this one was."""
    if world == 1:
        return f"shardlm train --resume {out}"
    nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    launch = f"torchrun --nproc-per-node {world // nodes}" + (f" --nnodes {nodes} ..." if nodes > 1 else "")
    return f"{launch} -m shardlm train --resume {out}"
