"""One engine, many clients: a background thread owns the engine and loops its step() while it has work,
sleeping on a condition when it has none (vLLM's engine-core loop, on one thread instead of a process).
Handlers submit from the event loop's thread (the engine queues new requests in a deque, and its checks
raise at once, so a bad request is answered 4xx before it waits); tokens and ends come back through
callbacks on the engine's thread, which the handlers hand to their event loop.

A step that raises fails the requests it held, and the engine serves on: the server outlives any one
request. The counts behind /metrics live here too.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable

import torch

from ..inference import Engine, Request, SamplingParams

log = logging.getLogger("shardlm.serve")
SWITCH_S = 0.0005  # the process's GIL switch interval while a worker runs (sys.setswitchinterval)


def warm_up_batches(engine, token: int = 0) -> list[list[Request]]:
    """Requests that compile (on a GPU: capture) what serving runs before a client waits on it, each batch run
    to its end in turn: the greedy and the sampling decode step (over every slot, and over one row) in every
    key bucket (Engine._keys), and the compiled prefill block (inference/slots.decoder_layer) in each class of
    shapes the compiler tells apart although its sizes are symbolic: one row and several (it specialises a
    size of 1), a prompt's first chunk and a later one, which reads the cache. The sizes differ from the
    cache's: the compiler assumes sizes equal that were equal when it traced, and would compile again the
    first time they differ. Then a prompt alone of each length whose prefill is a CUDA graph
    (Engine.graphed_prompts), capturing it. `token`: the prompts' one id."""
    taken = {*engine.cache.k[0].shape, engine.prefill_chunk}
    # more rows than the engine prefills one at a time (Engine's prefill_split), where its slots allow
    least = max(2, min(getattr(engine, "prefill_split", 0) + 1, len(engine.slots) - 1))
    rows = next((n for n in range(least, len(engine.slots)) if n not in taken), 2)
    tail = next(n for n in range(3, 64) if n not in taken | {rows})  # the second chunk's length
    prompt = [token] * max(1, min(engine.prefill_chunk + tail, engine.max_len - 2))
    # two new tokens run a decode step; a slot of 2 positions (--max-len 2) holds no second, nor decodes
    new = min(2, engine.max_len - len(prompt))
    several = [Request(prompt, new) for _ in range(rows - 1)] + [Request(prompt, new, SamplingParams(1.0, seed=0))]
    # each decode step over every slot and, for a request alone, over one row (Engine._decode_burst)
    steps = [several, [Request(prompt, new), Request(prompt, new)], [Request(prompt, new)],
             [Request(prompt, new, SamplingParams(1.0, seed=0))]]

    def bucket(n: int) -> int:  # the keys (Engine._keys) of the decode burst after a prompt of n tokens
        return engine._keys(n + min(engine.sync_every, engine.max_len - n) + 1)
    # and in every other key bucket, each a graph of its own (where compiled): the shortest prompt whose burst
    # reads it
    seen = {bucket(len(prompt))} if new == 2 else set()
    for n in range(1, engine.max_len - 1) if engine.compile else ():
        if bucket(n) not in seen:
            seen.add(bucket(n))
            p, sampled = [token] * n, SamplingParams(1.0, seed=0)
            steps += [[Request(p, 2)], [Request(p, 2, sampled)]]
            if len(engine.slots) > 1:
                steps += [[Request(p, 2), Request(p, 2)], [Request(p, 2), Request(p, 2, sampled)]]
    return [*steps, *([Request([token] * n, 1)] for n in engine.graphed_prompts())]


class Closed(RuntimeError):
    """The worker takes no more requests."""


class EngineWorker:
    """`engine`: an Engine, or serve/tp.py's Leader over one (whose `idle()` this thread calls at least every
    `idle_s` seconds while it has no work, so that the follower ranks hear from it)."""

    def __init__(self, engine: Engine, window_s: float = 10.0):
        self.engine, self.window_s = engine, window_s
        self.idle_s = getattr(engine, "idle_s", None)
        self._cv = threading.Condition()
        self._done: dict[int, Callable] = {}  # id(request) -> its end callback
        self._closing = False
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent bursts, for tokens/s
        self._lock = threading.Lock()
        self.counts = {"requests_total": 0, "requests_finished": 0, "requests_cancelled": 0,
                       "requests_failed": 0, "tokens_generated": 0}
        self._thread = threading.Thread(target=self._loop, name="shardlm-engine", daemon=True)

    def start(self, warm: list[list[Request]] = (), progress: Callable | None = None) -> "EngineWorker":
        """Start the thread, and return once it has run `warm` (batches of requests that compile the steps
        before a client waits on them, warm_up_batches) on it, `progress(1)` after each: compiled steps and CUDA
        graphs belong to the thread that made them, so every step runs on this one."""
        self._warm, self._ready, self._failed = list(warm), threading.Event(), None
        self._warmed = progress or (lambda n: None)
        # The event loop's thread holds the GIL up to the switch interval (5 ms) before the engine's thread,
        # back from a step, gets it to launch the next: a stall of up to a whole decode step each time.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_S))
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed
        return self

    def submit(self, request: Request, on_done: Callable) -> None:
        """Queue `request`; `on_done(request, error)` is called once it ends (error: None, or the exception
        that failed it), on the engine's thread, or here when it ends at once (max_new_tokens 0). The
        engine's ValueError for a request it cannot run propagates."""
        on_tokens = request.on_tokens

        def counted(r, ids):
            with self._lock:
                self.counts["tokens_generated"] += len(ids)
                self._recent.append((time.monotonic(), len(ids)))
                self._forget_old()
            if on_tokens is not None:
                _quietly(on_tokens, r, ids)
        request.on_tokens = counted
        with self._cv:
            if self._closing:
                raise Closed("the server is shutting down")
            self.engine.submit(request)
            self.counts["requests_total"] += 1
            if request.done:
                self.counts["requests_finished"] += 1
            else:
                self._done[id(request)] = on_done
                self._cv.notify()
        if request.done:
            on_done(request, None)

    def in_flight(self) -> int:
        """Requests submitted and not yet ended (a replica pool's load measure)."""
        with self._cv:
            return len(self._done)

    def cancel(self, request: Request) -> None:
        """Free the request's slot (or its place in the queue) at the engine's next step."""
        self.engine.cancel(request)
        with self._cv:
            self._cv.notify()

    def close(self, timeout: float | None = None) -> None:
        """Finish what the engine holds, then stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- the engine's thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            for batch in self._warm:
                engine.run(batch)
                self._warmed(1)
        except Exception as e:
            self._failed = e
            return
        finally:
            self._ready.set()
        while True:
            with self._cv:
                if not engine.busy and not self._closing:
                    self._cv.wait(self.idle_s)
                busy, closing = engine.busy, self._closing
            if not busy:
                if closing:
                    return
                if self.idle_s is not None:
                    engine.idle()
                continue
            try:
                finished = engine.step()
            except Exception as e:  # the requests that held slots fail; the others wait their turn
                log.error("engine step failed:\n%s", traceback.format_exc())
                for r in engine.abort_all():
                    self._end(r, e)
                continue
            for r in finished:
                self._end(r, None)

    def _end(self, r: Request, error: Exception | None) -> None:
        with self._cv:
            on_done = self._done.pop(id(r), None)
            key = "requests_failed" if error else "requests_cancelled" if r.finish_reason == "cancelled" \
                else "requests_finished"
            self.counts[key] += 1
        if on_done is not None:
            _quietly(on_done, r, error)

    # ---- /metrics -----------------------------------------------------------------------------------
    def _forget_old(self) -> None:
        since = time.monotonic() - self.window_s
        while self._recent and self._recent[0][0] < since:
            self._recent.popleft()

    def metrics(self) -> dict:
        with self._lock:
            self._forget_old()
            recent = sum(n for _, n in self._recent)
            counts = dict(self.counts)
        in_use = self.engine.in_use
        out = {**counts, "requests_active": in_use, "requests_queued": self.engine.queued,
               "tokens_per_s": round(recent / self.window_s, 3), "window_s": self.window_s,
               "slots_in_use": in_use, "slots": len(self.engine.slots)}
        if self.engine.device.type == "cuda":  # what this process holds on its GPU: weights, cache, graphs' pools
            out.update(memory_bytes=torch.cuda.memory_allocated(self.engine.device),
                       memory_peak_bytes=torch.cuda.max_memory_allocated(self.engine.device))
        return out


def _quietly(callback: Callable, *args) -> None:
    """A callback's failure (a client's event loop closed under it) must not reach the engine's step."""
    try:
        callback(*args)
    except Exception:
        log.debug("a request's callback failed:\n%s", traceback.format_exc())
