"""Data-parallel serving: where the model fits one GPU, one engine per GPU behind the one HTTP server, each
owned by its own worker thread (so the replicas' steps overlap on their devices), and each request sent to
the replica with the fewest requests in flight (vLLM's data-parallel engines behind one API server, here as
threads of one process). The pool answers what the app asks of a worker: submit, cancel, metrics, close.
"""
from __future__ import annotations

import threading
from typing import Callable

from .worker import EngineWorker


class ReplicaPool:
    def __init__(self, workers: list[EngineWorker]):
        self.workers = workers
        self._lock = threading.Lock()
        self._where: dict[int, EngineWorker] = {}  # id(request) -> the replica running it

    def submit(self, request, on_done: Callable) -> None:
        with self._lock:
            worker = min(self.workers, key=lambda w: w.in_flight())
            self._where[id(request)] = worker

        def done(r, error):
            with self._lock:
                self._where.pop(id(r), None)
            on_done(r, error)
        try:
            worker.submit(request, done)
        except Exception:
            with self._lock:
                self._where.pop(id(request), None)
            raise

    def cancel(self, request) -> None:
        with self._lock:
            worker = self._where.get(id(request))
        if worker is not None:
            worker.cancel(request)

    def close(self, timeout: float | None = None) -> None:
        for worker in self.workers:
            worker.close(timeout)

    def metrics(self) -> dict:
        """The replicas' counts and rates added up (the window is theirs), and how many there are."""
        each = [w.metrics() for w in self.workers]
        out = {k: (sum(m[k] for m in each) if k != "window_s" else v) for k, v in each[0].items()}
        return {**out, "replicas": len(each)}
