"""Which rank died or stalled, when a collective fails: every rank writes the time into the job's key-value
store (the TCPStore torchrun's rendezvous serves at MASTER_ADDR:MASTER_PORT) every few seconds from a
thread of its own; the rank whose collective failed reads everyone's last beat. A collective's own error
names at most a peer's address (gloo) or nothing useful (a timeout); torchrun names the rank only in its
summary after every worker has exited. A beat also carries the process's id and host, so that a peer on
the same host whose process has ended (killed: it beat a moment ago) is named at once; and a rank that stops
on an error of its own says so in the store before it exits, so that the others, whose next collective
fails, point at its message instead of reporting a death. A peer that is alive but stalled (its training
thread stuck in a read from a slow filesystem, a deadlock, a different collective) beats on: a beat also
says where that thread is, its innermost frame in shardlm's own source and since when, and when no peer
fell silent the report says where each one was, the odd one out first.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from .store import StoreSilent, store_client

PREFIX = "shardlm/heartbeat/"  # then torchrun's restart count (an attempt's beats are not its restart's) and the rank
BEAT_TIMEOUT_S = 2.0  # a beat's wait for the store: what closing may wait for where the store is unreachable
FAILED = "shardlm/failed/"  # then torchrun's restart count (a key outlives the attempt that set it) and the rank
GAVE_UP = "shardlm/gave-up/"  # likewise: a rank that left because a peer had failed (Peers.gave_up)
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where is told in shardlm's own source
WATCHERS = {os.path.join(PACKAGE, "runtime", f) for f in ("heartbeat.py", "watchdog.py")}  # not in these


class Peers:
    """What the store says of this rank's peers (their beats, their farewells), without beating: a watchdog
    about to end this rank asks it which peer to blame."""

    def __init__(self, rank: int, world: int, host: str, port: int, interval: float = 2.0):
        self.rank, self.world, self.interval = rank, world, interval
        self.host, self.port = host, port
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    @classmethod
    def from_env(cls):
        """One for this process of a torchrun job (None in a single process)."""
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world == 1 or "MASTER_ADDR" not in os.environ:
            return None
        return cls(int(os.environ.get("RANK", 0)), world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def _client(self, seconds: float = 5, probe: bool = False):
        """A client of the store (runtime/store.py: never hung by something else listening at its address)."""
        return store_client(self.host, self.port, self.world, seconds, probe)


    def failed(self) -> list[int]:
        """The peers that stopped on an error of their own (farewell)."""
        try:
            store = self._client()
            return [r for r in range(self.world) if r != self.rank and store.check([f"{FAILED}{self.attempt}/{r}"])]
        except Exception:  # noqa: BLE001
            return []

    def unprinted(self, ranks: list[int]) -> list[str]:
        """The messages that those of `ranks` that failed left with their farewell, not having printed them."""
        try:
            store = self._client()
            return [m for m in (store.get(f"{FAILED}{self.attempt}/{r}").decode() for r in ranks) if m != "1"]
        except Exception:  # noqa: BLE001
            return []

    def _peers(self) -> list[tuple[int, str | None, tuple[float, str] | None]]:
        """(rank, how it fell silent or None, (since when, where) its training thread is or None) of each
        peer; empty when the store cannot be read (its host, rank 0's process or torchrun's agent, is gone)."""
        try:
            store, now = self._client(), time.time()
            out = []
            for r in range(self.world):
                if r == self.rank:
                    continue
                if not store.check([f"{PREFIX}{self.attempt}/{r}"]):
                    out.append((r, "never heard from", None))
                    continue
                beat, _, at = store.get(f"{PREFIX}{self.attempt}/{r}").decode().partition("\t")
                beat = beat.split(" ", 2)
                age, how = now - float(beat[0]), None
                if len(beat) == 3 and beat[2] == socket.gethostname() and _ended(int(beat[1])):
                    how = "its process ended"  # killed: its last beat may be a second old
                elif age > 3 * self.interval:
                    how = f"silent for {age:.0f} s"
                if how and store.check([f"{GAVE_UP}{self.attempt}/{r}"]):
                    how = FOLLOWED  # gone because of another's failure, not its cause
                since, _, where = at.partition(" ")
                out.append((r, how, (float(since), where) if where else None))
            return out
        except Exception:  # noqa: BLE001
            return []

    def silent(self) -> list[tuple[int, str]]:
        """(rank, how) of the peers that fell silent: never heard from, whose process on this host has ended,
        or silent for some seconds; empty when the store cannot be read. Peers that left because another had
        failed are named only when no other one fell silent: with 4 ranks and rank 3 killed, the last rank to
        notice named 'rank 0 (its process ended), rank 2 (...), rank 3 (...)', the two that had left over
        rank 3 as though they had died too."""
        silent = [(r, how) for r, how, _ in self._peers() if how]
        return [(r, how) for r, how in silent if how != FOLLOWED] or silent

    def gave_up(self) -> None:
        """Tell the peers this rank is leaving because a peer failed (its message names that one)."""
        try:
            self._client(2).set(f"{GAVE_UP}{self.attempt}/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: the peers fall back on the beats
            pass

    def report(self) -> str:
        """`rank 1 (silent for 12 s)`-style words for the silent peers; else where each peer was, grouped,
        the odd one out (the smallest group, then the longest in place) first; or what little is known."""
        peers, now = self._peers(), time.time()
        silent = [(r, how) for r, how, _ in peers if how]
        silent = [(r, how) for r, how in silent if how != FOLLOWED] or silent
        if silent:
            return ", ".join(f"rank {r} ({how})" for r, how in silent)
        if not peers:
            return "which one could not be told"
        groups: dict[str | None, list] = {}  # where: [ranks, the longest time one of them has been there]
        for r, _, at in peers:
            group = groups.setdefault(at and at[1], [[], 0.0])
            group[0].append(r)
            group[1] = max(group[1], now - at[0] if at else 0.0)
        out = []
        for where, (ranks, held) in sorted(groups.items(), key=lambda g: (g[0] is None, len(g[1][0]), -g[1][1])):
            who = ranks_named(ranks)
            out.append(f"{who} at {where} (for {held:.0f} s)" if where else f"{who} (alive, where unknown)")
        return "no rank died; where each was: " + "; ".join(out)


FOLLOWED = "it left over a failed peer"


class Heartbeat(Peers):
    """This rank's beat, from a thread of its own, and its farewell."""

    def __init__(self, rank: int, world: int, host: str, port: int, interval: float = 2.0):
        super().__init__(rank, world, host, port, interval)
        self.me = f"{os.getpid()} {socket.gethostname()}"
        # torchrun starts its workers in sessions of their own: killed outright (the OOM killer, a scheduler's
        # SIGKILL after its grace period), it leaves them training on as orphans, holding the run directory.
        self.launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.main = threading.get_ident()  # the training thread, whose place each beat tells
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="shardlm-heartbeat", daemon=True)
        self.thread.start()

    def _where(self) -> str | None:
        """Where the training thread is, as `shardlm/data/loader.py:88 next_batch`: its innermost frame in
        shardlm's own source (None outside it, or when the thread has ended)."""
        frame = sys._current_frames().get(self.main)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            if path.startswith(PACKAGE + os.sep) and path not in WATCHERS:
                where = os.path.relpath(path, os.path.dirname(PACKAGE)).replace(os.sep, "/")
                return f"{where}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return None

    def _beat(self) -> None:
        store, where, since, waiting = None, None, 0.0, None
        while not self.stop.is_set():
            if self.launcher is not None and os.getppid() != self.launcher:
                print(f"shardlm: the launcher (pid {self.launcher}) has gone: stopping after this step, saved",
                      file=sys.stderr, flush=True)
                self.launcher = None
                os.kill(os.getpid(), signal.SIGTERM)  # what torchrun sends on its way out: a stop, saved
            if (here := self._where()) != where:
                where, since = here, time.time()
            try:  # the store may come up after this process, or go with its host: keep trying
                if store is None and (waiting is None or not waiting.is_alive()):  # one unanswered client at most
                    store = self._client(BEAT_TIMEOUT_S, probe=True)
                # After a tab, which no host name holds: since when the training thread is where it is.
                at = f"\t{since!r} {where}" if where else ""
                if store is not None:
                    store.set(f"{PREFIX}{self.attempt}/{self.rank}", f"{time.time()!r} {self.me}{at}")
            except StoreSilent as e:  # its client is left waiting in a thread
                store, waiting = None, e.thread
            except Exception:  # noqa: BLE001
                store = None
            self.stop.wait(self.interval)

    def farewell(self, unprinted: str = "") -> None:
        """Tell the peers this rank is stopping on an error of its own: its message is printed, or is `unprinted`,
        which a peer reporting the failure then prints."""
        try:  # briefly: this rank is on its way out
            self._client(2, probe=True).set(f"{FAILED}{self.attempt}/{self.rank}", unprinted[:1000] or "1")
        except Exception:  # noqa: BLE001 - the store's host is gone: the peers fall back on the beats
            pass

    def close(self, wait: bool = True) -> None:
        """Stop beating; `wait`: until the thread has ended. A beat may be inside the store client's
        constructor, retrying an unreachable store (a launch by hand without torchrun), and that C++ call left
        running at interpreter exit aborts the process (SIGABRT and a C++ trace instead of the exit status)."""
        self.stop.set()
        if wait:
            self.thread.join(timeout=BEAT_TIMEOUT_S + 2 * self.interval)


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


def ranks_named(ranks: list[int]) -> str:
    """`rank 1` or `ranks 1, 3`."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
