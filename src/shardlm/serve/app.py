"""The HTTP routes (FastAPI): /v1/completions, /v1/chat/completions (whole or streamed by server-sent
events), /v1/models, /health and /metrics (JSON, or Prometheus' text format), after OpenAI's API reference
and vLLM's OpenAI-compatible server. Each handler checks its body (protocol.py), submits one engine request
through the worker, and waits on an asyncio queue that the engine's thread feeds with
`loop.call_soon_threadsafe`.

Every HTTP request passes through `Lifecycle`: it counts the requests in flight (a draining server exits
once none is left), refuses new generation with 503 while draining, and cancels the engine requests of
an HTTP request that ended early (its client left, or stopped reading its answer), so their slots are freed.
"""
from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import threading
import time

import anyio

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..data.jsonl import unpaired_surrogate
from ..inference import Request, prompt_context
from ..tokenizer import TokenizerError
from .protocol import APIError, Models, Params, chat_params, completion_params
from .responses import DONE, Answer, TextStream, error_event, prometheus
from .worker import Closed, EngineWorker

_OWNED = "shardlm.requests"  # the scope key under which an HTTP request lists its engine requests
# A body shorter than its Content-Length leaves the server waiting for the rest, which h11 and uvicorn do without
# end; counted in flight, it also kept a draining server from ever exiting. Slow links still send within this.
BODY_TIMEOUT_S = 30.0
# The slowest a body may arrive on the whole: one byte every 29 s (never BODY_TIMEOUT_S apart) held a request, and a
# server told to stop, forever.
BODY_RATE = 64 * 1024
# A client that stops reading its stream fills the socket's buffers, and then each write waits for it: the engine
# runs on, but its HTTP request stayed in flight as long as the connection stayed open, and a draining server never
# exited. A write that cannot go out for this long ends the response and closes the connection.
SEND_TIMEOUT_S = 30.0
log = logging.getLogger("shardlm.serve")
_CUT = contextvars.ContextVar("shardlm_cut", default=False)  # this task's response was cut by SEND_TIMEOUT_S


class _Stalled(Exception):
    pass


class _QuietCut(logging.Filter):
    """Drops uvicorn's error for a response that ended unfinished where this server ended it (the warning logged
    then says why): it reads as a fault of the server's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT.get() and record.getMessage() == "ASGI callable returned without completing response.")


_QUIET_CUT = _QuietCut()


class ServerState:
    """What the routes, the middleware and the process's signal handling share."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0
        self.rejected = 0  # requests answered 4xx

    @property
    def idle(self) -> bool:
        return self.in_flight == 0


class Lifecycle:
    """Pure ASGI middleware (so it also sees a streamed response to its end)."""

    def __init__(self, app, state: ServerState, worker: EngineWorker, max_body: int):
        self.app, self.state, self.worker, self.max_body = app, state, worker, max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":  # only POSTs generate
            return await self.app(scope, receive, send)
        if self.state.draining:
            err = APIError(503, "The server is shutting down and takes no new requests.", code="shutting_down",
                           type="service_unavailable")
            return await JSONResponse(err.body(), status_code=503)(scope, receive, send)
        owned: list[Request] = []
        scope[_OWNED] = owned
        self.state.in_flight += 1
        try:
            body = await self._body(scope, receive, send)
            if body is not None:
                await self.app(scope, _replay(body, receive), _timed(send))
        except _Stalled:
            log.warning("shardlm serve: a client read nothing of its answer for %g s: its connection is closed, and "
                        "its request cancelled where it still ran", SEND_TIMEOUT_S)
            _CUT.set(True)  # read in this task by uvicorn's log call once the app has returned
        finally:
            self.state.in_flight -= 1
            for r in owned:
                if not r.done:
                    self.worker.cancel(r)


    async def _body(self, scope, receive, send) -> bytes | None:
        """The request's whole body; None where its client left, or stalled and was answered 408, or sent more
        than any request can hold and was answered 413. Such a body is read to its end but not kept: a client
        writes all of it before it reads an answer, and a connection closed under it is reset, the answer lost.
        A body with no end is drained only as long as the largest one may take (at BODY_RATE), then answered."""
        chunks, more, size = [], True, 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BODY_TIMEOUT_S + self.max_body / BODY_RATE
        while more:
            left = deadline - loop.time()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(BODY_TIMEOUT_S, left)))
            except asyncio.TimeoutError:
                if size > self.max_body:  # a body with no end (chunked), drained until now: refused, and closed
                    break
                self.state.rejected += 1
                total = BODY_TIMEOUT_S + self.max_body / BODY_RATE
                why = (f"nothing for {BODY_TIMEOUT_S:g} s" if left > BODY_TIMEOUT_S else
                       f"it was still arriving after {total:.0f} s ({BODY_TIMEOUT_S:g} s and the largest body at "
                       f"{BODY_RATE // 1024} KiB/s)")
                err = APIError(408, f"The request body stopped arriving: {why} before its Content-Length was "
                                    "reached. Send the whole body, with a Content-Length that counts its bytes.",
                               code="request_timeout")
                await JSONResponse(err.body(), status_code=408, headers={"connection": "close"})(scope, receive, send)
                return None
            if message["type"] == "http.disconnect":  # no one is left to answer (once a ClientDisconnect traceback)
                return None
            size += len(message.get("body", b""))
            if size <= self.max_body:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if size > self.max_body:
            self.state.rejected += 1
            err = APIError(413, f"The request body is {size}{'+' if more else ''} bytes, beyond the {self.max_body} "
                                "that any request to this model can hold (its context's worth of text).",
                           code="request_too_large")
            await JSONResponse(err.body(), status_code=413, headers={"connection": "close"} if more else None)(
                scope, receive, send)
            return None
        return b"".join(chunks)


def _timed(send):
    """`send` that raises _Stalled where a write waits SEND_TIMEOUT_S for its client to read."""
    async def timed(message):
        with anyio.move_on_after(SEND_TIMEOUT_S) as scope:
            await send(message)
        if scope.cancelled_caught:
            raise _Stalled
    return timed


def _replay(body: bytes, receive):
    """`receive` for the app: the body read already, then the connection's own (a client leaving mid-stream)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()
    return replayed


class Handoff:
    """What the engine's thread hands to one event loop's queues, delivered by one callback per batch rather
    than one per item: each `call_soon_threadsafe` writes to the loop's wake-up pipe and wakes its thread,
    and a decode burst ends with tokens for every stream at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self._items, self._lock, self._due = loop, [], threading.Lock(), False

    def put(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((queue, item))
            if self._due:
                return
            self._due = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._due = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


def create_app(worker: EngineWorker, models: Models, state: ServerState | None = None) -> FastAPI:
    """The app serving `worker`'s engine under the ids of `models`."""
    state = state or ServerState()
    app = FastAPI(title="shardlm", docs_url=None, redoc_url=None)
    app.state.serve = state
    app.add_middleware(Lifecycle, state=state, worker=worker, max_body=models.max_body)
    logging.getLogger("uvicorn.error").addFilter(_QUIET_CUT)  # once: a filter already there is not added again
    tok = models.tok
    started = int(time.time())
    handoffs: dict[asyncio.AbstractEventLoop, Handoff] = {}

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        state.rejected += e.status < 500
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        # its headers too: a 405 names the methods the path takes (Allow), as HTTP asks of it
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(TokenizerError)
    async def untokenizable(_, e: TokenizerError):  # a chat's rendered text: a prompt's is refused as the prompt
        return await api_error(_, APIError(400, f"The request's text cannot be tokenized: {e}"))

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    async def body_of(http: HTTPRequest):
        text = await http.body()
        try:
            body = json.loads(text)
            # A "\ud800" escape parses to a lone surrogate, which the tokenizer rejects: a 400 naming it, not a 500.
            found = unpaired_surrogate(body)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "We could not parse the JSON body of your request. (HINT: This likely means you "
                                "aren't using your HTTP library correctly.)") from None
        except RecursionError:  # arrays in arrays thousands deep: once a 500, and a traceback in the log
            raise APIError(400, "The JSON body of your request nests too deeply to be read.") from None
        if found:
            raise APIError(400, f"'{found[0]}' holds an unpaired surrogate ({found[1]!a}), which is not Unicode "
                                "text.", found[0].split(".")[0].split("[")[0], "invalid_value")
        return body

    def start(http: HTTPRequest, params: Params, chat: bool) -> tuple[Request, asyncio.Queue]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        handoff = handoffs.get(loop) or handoffs.setdefault(loop, Handoff(loop))

        def put(item):  # the engine's thread: hand over to the loop
            handoff.put(queue, item)
        # A whole answer waits for the end alone, so its queue stays empty until then and it can look
        # for a departed client in between.
        on_tokens = (lambda r, ids: put(("tokens", list(ids)))) if params.stream else None
        # the engine looks for stop strings in the text a client is sent (text_of's, a chat reply's its own)
        request = Request(params.prompt, params.max_tokens, params.sampling,
                          models.stops_of(params.adapter) + params.stop_ids, params.stop, adapter=params.adapter,
                          on_tokens=on_tokens, continues=not chat)
        try:
            worker.submit(request, lambda r, error: put(("done", error)))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except Closed as e:
            raise APIError(503, str(e), code="shutting_down", type="service_unavailable") from None
        http.scope.setdefault(_OWNED, []).append(request)
        return request, queue

    def failure(error: Exception) -> APIError:
        return APIError(500, f"The engine failed on this request ({type(error).__name__}: {error}); the "
                             "server is still up: retry it.")

    def text_of(answer: Answer) -> TextStream:
        # A completion continues its prompt's text, the space that opens it included (as request.new_text
        # decodes it); a chat template places the space between turns itself (Llama 2's "[/INST] " + content),
        # so a message's content has none.
        prompt = answer.params.prompt
        context = prompt_context(prompt, tok.text) if not answer.chat and len(prompt) > 1 else ()
        return TextStream(tok.text, models.stops_of(answer.params.adapter) + answer.params.stop_ids,
                          answer.params.stop, context=context)

    async def generate(http: HTTPRequest, params: Params, chat: bool):
        request, queue = start(http, params, chat)
        answer = Answer(chat, params)
        if params.stream:
            return StreamingResponse(stream(request, queue, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while True:
            try:
                kind, value = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await http.is_disconnected():  # the middleware then cancels the request
                    return JSONResponse({}, status_code=499)
                continue
            if kind == "done":
                if value is not None:
                    raise failure(value)
                # the text a stream of this request would send: the same decoder, so the same text
                text = text_of(answer)
                return answer.whole(text.push(request.tokens) + text.finish(), request.finish_reason,
                                    len(request.tokens))

    async def stream(request: Request, queue: asyncio.Queue, answer: Answer):
        text = text_of(answer)
        if answer.chat:
            yield answer.chunk(None, role=True)
        while True:
            kind, value = await queue.get()
            if kind == "tokens":
                delta = text.push(value)
                if delta:
                    yield answer.chunk(delta)
                continue
            if value is not None:
                yield error_event(failure(value))
                break
            delta = text.finish()
            if delta:
                yield answer.chunk(delta)
            yield answer.chunk(None, request.finish_reason)
            if answer.params.include_usage:
                yield answer.usage_chunk(len(request.tokens))
            break
        yield DONE

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await generate(http, completion_params(await body_of(http), models), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await generate(http, chat_params(await body_of(http), models), chat=True)

    def cards() -> list[dict]:
        def card(model_id, parent, root):
            return {"id": model_id, "object": "model", "created": started, "owned_by": "shardlm", "root": root,
                    "parent": parent, "max_model_len": models.max_len}
        return [card(models.base, None, models.base)] + [card(name, models.base, str(path))
                                                           for name, path in sorted(models.adapters.items())]

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": cards()}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve); an id may hold slashes
    async def retrieve_model(model: str):
        if not model:  # "/v1/models/", which this route would take from the list's (a redirect to it before)
            return await list_models()
        found = [c for c in cards() if c["id"] == model]
        if not found:
            models.adapter_of({"model": model})  # the 404 a request naming it gets
        return found[0]

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(http: HTTPRequest):
        """JSON: counts since start, and tokens/s over the last window_s; Prometheus' text format to a client that
        asks for it rather than JSON, as Prometheus' scraper does (it took the JSON for a failed scrape)."""
        values = {**worker.metrics(), "requests_rejected": state.rejected, "requests_in_flight": state.in_flight,
                  "draining": state.draining}
        accept = http.headers.get("accept", "")
        if "application/json" not in accept and ("text/plain" in accept or "openmetrics" in accept):
            return Response(prometheus(values), media_type="text/plain; version=0.0.4; charset=utf-8")
        return values

    return app
