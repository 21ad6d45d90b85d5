"""A console whose reader may go away (`shardlm train | head`, a closed tee or ssh session): what is left to
say goes to stderr, and the caller learns it (`lost`) to stop as a signal would, instead of dying in a
BrokenPipeError with the steps since the last checkpoint. And what it is not shown: notes meant for others.
"""
from __future__ import annotations

import errno
import os
import sys
import warnings


def hide_compiler_notes() -> None:
    """Inductor's note when it splits a softmax's reduction (the sampling step's, over the vocabulary), printed once
    per compiled shape at a server's start, is about its own kernels' speed: nothing a user can act on."""
    warnings.filterwarnings("ignore", message=r"\s*Online softmax is disabled", category=UserWarning)


def silence_stdout(stream=None) -> None:
    """Point stdout (or `stream`) at /dev/null: Python's own flush of it at exit would fail again, with a message
    of its own."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), (stream or sys.stdout).fileno())


class Console:
    """`log(*args)` until its reader goes away, then stderr; `lost` says whether it has."""

    def __init__(self, log=print):
        self.log, self.lost = log, False

    def __call__(self, *args) -> None:
        if not self.lost:
            try:
                return self.log(*args)
            except OSError as e:
                if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:  # EIO: a terminal hung up
                    raise
                silence_stdout()
                self.lost = True
        try:
            print(*args, file=sys.stderr, flush=True)
        except OSError as e:  # `shardlm train 2>&1 | head`, or the terminal: stderr left with stdout; still saved
            if not isinstance(e, BrokenPipeError) and e.errno != errno.EIO:
                raise
            silence_stdout(sys.stderr)
