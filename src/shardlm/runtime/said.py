"""Long checks said as log lines, not passed in silence: a dataset's CRC32 pass at every start and a resumed
checkpoint's verification read every byte (minutes on hundreds of GB, on every rank, or while the other ranks
wait), which a user took for a hang."""
from __future__ import annotations

import time
from contextlib import contextmanager

SAID_BYTES = 2**30  # what is said: past about a GB, a few seconds a GB on one rank's reads


@contextmanager
def said_check(log, what: str, size: int):
    """`what` said through `log` (None: said nowhere, another rank's) before the check it wraps and its time
    after, where the check reads more than SAID_BYTES (`size`)."""
    said = log is not None and size > SAID_BYTES
    start = time.perf_counter()
    if said:
        log(what)
    yield
    if said:
        log(f"checked in {time.perf_counter() - start:,.0f} s")


def said_progress(log, what: str):
    """checkpoint.verify_checkpoint's `progress`: told the bytes to read, it says `what` (formatted with their
    GB) and returns a callback that says the bytes read every 30 s; below SAID_BYTES, nothing."""
    def start(total: int):
        if total < SAID_BYTES:
            return lambda n: None
        log(what.format(total / 1e9))
        read, said = [0], [time.perf_counter()]

        def update(n: int) -> None:
            read[0] += n
            if time.perf_counter() - said[0] > 30:
                said[0] = time.perf_counter()
                log(f"verified {read[0] / 1e9:,.1f} of {total / 1e9:,.1f} GB")
        return update
    return start


def also_moved(progress, moved):
    """A verification's `progress` (said_progress's, or None) that also calls `moved()` as bytes are read: long
    work's sign of progress to the ranks waiting for it (runtime/first_rank.py)."""
    def start(total: int):
        update = progress(total) if progress is not None else None

        def each(n: int) -> None:
            if update is not None:
                update(n)
            moved()
        return each
    return start
