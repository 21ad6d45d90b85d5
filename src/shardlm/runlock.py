"""One process group owns a run directory at a time: an advisory flock on RUN/.shardlm.lock.

Two `shardlm train --out DIR` started together (or a `--resume` of a run that is still going) would
interleave their metrics, write each other's config and rotate each other's checkpoints out. The main rank
takes an exclusive flock on the lock file before it writes anything into the directory and keeps it for
the run's life; the second run fails at once, naming the owner's pid, host and start time, which the owner
writes into the file. flock belongs to the open file, so the kernel releases it on any death, SIGKILL
included: a killed run never leaves its directory locked, and the stale pid in the file is only a record.
Under torchrun the record also names the launching agent, which an attempt that torchrun's --max-restarts
starts shares with the one that failed: the restart resumes the run instead of being refused beside it.

flock is per open file, not per process: a second Trainer in the same process (tests, notebooks) would
refuse the first one's directory although nothing runs concurrently. Locks this process holds are therefore
shared by reference count within it. On filesystems without flock (some network mounts answer ENOLCK) the
run goes on unlocked rather than not at all; the message says the directory is not protected.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; runs go unlocked
    fcntl = None

from .config import ConfigError

LOCK_FILE = ".shardlm.lock"

_held: dict[str, "_Lock"] = {}  # lock file path -> the lock this process holds on it


class RunLocked(ConfigError):
    """Another process owns the run directory."""


class _Lock:
    def __init__(self, path: str, fd: int, created: bool, previous: bytes):
        self.path, self.fd, self.refs, self.created, self.previous = path, fd, 0, created, previous


class RunLock:
    """A handle on the lock of one run directory; `release` (idempotent) drops this handle's share."""

    def __init__(self, lock: _Lock):
        self._lock = lock
        lock.refs += 1

    def previous_owner(self) -> dict | None:
        """What the lock file said of the run that held the directory before this one, None if nothing readable."""
        try:
            info = json.loads(self._lock.previous) if self._lock is not None and self._lock.previous else None
        except ValueError:
            return None
        return info if isinstance(info, dict) else None

    def release(self, undo: bool = False) -> None:
        """`undo`: the run was refused before it began, so the directory is left as it was found: removed if
        taking the lock made it, else with its previous owner's record back in the lock file."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        lock.refs -= 1
        if lock.refs:
            return
        _held.pop(lock.path, None)
        try:
            if undo and lock.previous:  # still holding the lock: no other run is in the directory meanwhile
                os.ftruncate(lock.fd, 0)
                os.pwrite(lock.fd, lock.previous, 0)
            elif undo:
                os.unlink(lock.path)
                if lock.created:
                    try:
                        os.rmdir(os.path.dirname(lock.path))
                    except OSError:  # not empty: something else is in it now
                        pass
        finally:
            os.close(lock.fd)  # closing the only fd releases the flock


def owner(run_dir: str | Path) -> dict | None:
    """What the lock file says of the run that holds (or last held) the directory, None if unreadable."""
    try:
        info = json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def describe(info: dict | None) -> str:
    if not info:
        return "another process (its pid is not recorded yet)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')} (started {started}: {info.get('command', '?')})"


def launcher() -> str | None:
    """The torchrun agent that started this process (its run id, host and pid), None outside torchrun: the same
    for every attempt that torchrun's --max-restarts makes of one job, so a restart knows the run it continues."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id is None else f"{run_id} {socket.gethostname()} {os.getppid()}"


def restarted_attempt() -> bool:
    """Whether torchrun's --max-restarts started this process again after a failed attempt of its job."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def acquire(run_dir: str | Path, log=print) -> RunLock:
    """Take the run directory's lock (creating the directory), or raise RunLocked naming its owner."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = os.path.realpath(run_dir / LOCK_FILE)
    if path in _held:
        return RunLock(_held[path])
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise RunLocked(f"{run_dir} is in use by {describe(owner(run_dir))}: wait for that run to end (or stop "
                            f"it), or train into another --out") from None
        log(f"warning: {run_dir} cannot be locked ({e.strerror or e}): nothing stops a second run from writing "
            "into it at the same time")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
            "command": " ".join(["shardlm", *sys.argv[1:]])[:300]}
    previous = os.pread(fd, 1 << 16, 0)
    lock = _held[path] = _Lock(path, fd, created, previous)
    handle = RunLock(lock)
    if (who := launcher()) is not None:
        info["launcher"] = who
        # When the job's first attempt took the directory: a restart resumes what any attempt of the job saved
        # (a second restart follows an attempt that may have died before saving anything of its own).
        before = handle.previous_owner() or {}
        info["job_started"] = before.get("job_started", before.get("started")) \
            if restarted_attempt() and before.get("launcher") == who else info["started"]
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)  # on NFS the record reaches the server, where the other nodes' ranks look for it, only now
    except OSError:  # a full disk: the refused run leaves the directory as it found it, as any refusal does
        handle.release(undo=True)
        raise
    return handle
