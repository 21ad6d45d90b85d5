"""Which rank died or stalled, when a collective fails: every rank writes the time into the job's key-value
store (the TCPStore torchrun's rendezvous serves at MASTER_ADDR:MASTER_PORT) every few seconds from a
thread of its own; the rank whose collective failed reads everyone's last beat. A collective's own error
names at most a peer's address (gloo) or nothing useful (a timeout); torchrun names the rank only in its
summary after every worker has exited.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

PREFIX = "shardlm/heartbeat/"


class Heartbeat:
    def __init__(self, rank: int, world: int, host: str, port: int, interval: float = 2.0):
        self.rank, self.world, self.interval = rank, world, interval
        self.host, self.port = host, port
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

    def _client(self):
        return dist.TCPStore(self.host, self.port, self.world, is_master=False, timeout=timedelta(seconds=5))

    def _beat(self) -> None:
        store = None
        while not self.stop.is_set():
            try:  # the store may come up after this process, or go with its host: keep trying
                store = store or self._client()
                store.set(f"{PREFIX}{self.rank}", repr(time.time()))
            except Exception:  # noqa: BLE001
                store = None
            self.stop.wait(self.interval)

    def silent(self) -> list[tuple[int, float | None]]:
        """(rank, seconds since its last beat, None if never heard) of the peers that fell silent; empty
        when the store cannot be read (its host, rank 0's process or torchrun's agent, is gone)."""
        try:
            store, now = self._client(), time.time()
            out = []
            for r in range(self.world):
                if r == self.rank:
                    continue
                if not store.check([f"{PREFIX}{r}"]):
                    out.append((r, None))
                    continue
                age = now - float(store.get(f"{PREFIX}{r}").decode())
                if age > 3 * self.interval:
                    out.append((r, age))
            return out
        except Exception:  # noqa: BLE001
            return []

    def report(self) -> str:
        """`rank 1 (silent for 12 s)`-style words for the silent peers, or what little is known."""
        silent = self.silent()
        if not silent:
            return "which one could not be told"
        return ", ".join(f"rank {r} ({'never heard from' if age is None else f'silent for {age:.0f} s'})"
                         for r, age in silent)

    def close(self) -> None:
        self.stop.set()
