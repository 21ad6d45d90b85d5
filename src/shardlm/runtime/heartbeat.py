"""Which rank died or stalled, when a collective fails: every rank writes the time into the job's key-value
store (the TCPStore torchrun's rendezvous serves at MASTER_ADDR:MASTER_PORT) every few seconds from a
thread of its own; the rank whose collective failed reads everyone's last beat. A collective's own error
names at most a peer's address (gloo) or nothing useful (a timeout); torchrun names the rank only in its
summary after every worker has exited. A beat also carries the process's id and host, so that a peer on
the same host whose process has ended (killed: it beat a moment ago) is named at once; and a rank that stops
on an error of its own says so in the store before it exits, so that the others, whose next collective
fails, point at its message instead of reporting a death.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

PREFIX = "shardlm/heartbeat/"
FAILED = "shardlm/failed/"  # then torchrun's restart count (a key outlives the attempt that set it) and the rank


class Heartbeat:
    def __init__(self, rank: int, world: int, host: str, port: int, interval: float = 2.0):
        self.rank, self.world, self.interval = rank, world, interval
        self.host, self.port = host, port
        self.me = f"{os.getpid()} {socket.gethostname()}"
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # torchrun starts its workers in sessions of their own: killed outright (the OOM killer, a scheduler's
        # SIGKILL after its grace period), it leaves them training on as orphans, holding the run directory.
        self.launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="shardlm-heartbeat", daemon=True)
        self.thread.start()

    @classmethod
    def from_env(cls) -> Heartbeat | None:
        """One for this process of a torchrun job (None in a single process)."""
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world == 1 or "MASTER_ADDR" not in os.environ:
            return None
        return cls(int(os.environ.get("RANK", 0)), world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def _client(self, seconds: float = 5):
        return dist.TCPStore(self.host, self.port, self.world, is_master=False, timeout=timedelta(seconds=seconds))

    def _beat(self) -> None:
        store = None
        while not self.stop.is_set():
            if self.launcher is not None and os.getppid() != self.launcher:
                print(f"shardlm: the launcher (pid {self.launcher}) has gone: stopping after this step, saved",
                      file=sys.stderr, flush=True)
                self.launcher = None
                os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends on its way out: a stop, saved
            try:  # the store may come up after this process, or go with its host: keep trying
                store = store or self._client()
                store.set(f"{PREFIX}{self.rank}", f"{time.time()!r} {self.me}")
            except Exception:  # noqa: BLE001
                store = None
            self.stop.wait(self.interval)

    def farewell(self) -> None:
        """Tell the peers this rank is stopping on an error of its own (its message is printed)."""
        try:
            self._client(2).set(f"{FAILED}{self.attempt}/{self.rank}", "1")  # briefly: this rank is on its way out
        except Exception:  # noqa: BLE001 - the store's host is gone: the peers fall back on the beats
            pass

    def failed(self) -> list[int]:
        """The peers that stopped on an error of their own (farewell)."""
        try:
            store = self._client()
            return [r for r in range(self.world) if r != self.rank and store.check([f"{FAILED}{self.attempt}/{r}"])]
        except Exception:  # noqa: BLE001
            return []

    def silent(self) -> list[tuple[int, str]]:
        """(rank, how) of the peers that fell silent: never heard from, whose process on this host has ended,
        or silent for some seconds; empty when the store cannot be read (its host, rank 0's process or
        torchrun's agent, is gone)."""
        try:
            store, now = self._client(), time.time()
            out = []
            for r in range(self.world):
                if r == self.rank:
                    continue
                if not store.check([f"{PREFIX}{r}"]):
                    out.append((r, "never heard from"))
                    continue
                beat = store.get(f"{PREFIX}{r}").decode().split(" ", 2)
                age = now - float(beat[0])
                if len(beat) == 3 and beat[2] == socket.gethostname() and _ended(int(beat[1])):
                    out.append((r, "its process ended"))  # killed: its last beat may be a second old
                elif age > 3 * self.interval:
                    out.append((r, f"silent for {age:.0f} s"))
            return out
        except Exception:  # noqa: BLE001
            return []

    def report(self) -> str:
        """`rank 1 (silent for 12 s)`-style words for the silent peers, or what little is known."""
        silent = self.silent()
        if not silent:
            return "which one could not be told"
        return ", ".join(f"rank {r} ({how})" for r, how in silent)

    def close(self) -> None:
        self.stop.set()


def _ended(pid: int) -> bool:
    """Whether process `pid` of this host has ended (a zombie its launcher has not yet reaped has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False
