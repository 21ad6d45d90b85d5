"""Progress of long work (generate and eval over a file, export, a checkpoint's verification, data preparation, a
server's warm-up): tqdm's bar on a terminal; where stderr is a file or a pipe (a Slurm or nohup log, `| tee`),
where a bar can only redraw, a line every LINE_EVERY_S seconds with the count, the share, the time so far and the
time left, said from a thread of its own, as one unit of work (a compile, a large tensor) may take minutes. Work
done within the interval says nothing there."""
from __future__ import annotations

import sys
import threading
import time

LINE_EVERY_S = 30.0


def duration(seconds: float) -> str:
    """1h02m, 3m05s or 45s."""
    s = round(seconds)
    h, m, sec = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def progress(total: int, what: str, unit: str = "it", shown: bool = True, scale: bool = False,
             opening: str | None = None):
    """A bar (update(n), close(), a context manager that closes) for `total` units of work called `what`, on
    stderr; silent where not `shown` (another rank's). `unit` names a unit as a line counts them ("requests"),
    `scale` in k, M, G (1.2GB, 6.74G parameters); `opening` is said first off a terminal, where the work may say
    nothing for long."""
    if shown and sys.stderr.isatty():
        from tqdm import tqdm
        return tqdm(total=total, desc=what, unit=unit, unit_scale=scale, file=sys.stderr)
    return _Lines(total, what, unit, scale, opening, LINE_EVERY_S if shown else None, sys.stderr)


class _Lines:
    """The lines off a terminal; with `every` None, nothing at all."""

    def __init__(self, total, what, unit, scale, opening, every, stream):
        self.total, self.what, self.unit, self.scale, self.stream = total, what, unit, scale, stream
        self.done, self.told, self.start = 0, False, time.perf_counter()
        self.stop, self.teller = threading.Event(), None
        if every is None:
            return
        if opening:
            self.say(opening)
        self.teller = threading.Thread(target=self.tell, args=(every,), name=f"{what} progress", daemon=True)
        self.teller.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        if self.teller is None or self.stop.is_set():
            return
        self.stop.set()
        self.teller.join()
        if self.told:  # a long job's last line says it ended, and in what time
            self.say(f"{self.what}: {self.count(self.done)} in {duration(time.perf_counter() - self.start)}")

    def tell(self, every: float) -> None:
        while not self.stop.wait(every):
            elapsed, done = time.perf_counter() - self.start, self.done
            share = f" ({100 * done / self.total:.0f}%)" if self.total else ""
            left = f", about {duration(elapsed / done * (self.total - done))} left" if 0 < done < self.total else ""
            self.say(f"{self.what}: {self.count(done, self.unit == 'B')} of {self.count(self.total)}{share} in "
                     f"{duration(elapsed)}{left}")
            self.told = True

    def count(self, n: int, unit: bool = True) -> str:
        """1,234 requests; with `scale` 1.23GB, 6.74G parameters."""
        if not self.scale:
            return f"{n:,} {self.unit}" if unit else f"{n:,}"
        from tqdm import tqdm
        return tqdm.format_sizeof(n) + (("B" if self.unit == "B" else f" {self.unit}") if unit else "")

    def say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
