"""`shardlm serve` under concurrent load, over real HTTP on 127.0.0.1 (test_serve.serving): many clients leaving
at once, a queue of long prompts behind one slot and beside short requests, concurrent sampling with seeds,
/metrics' counts, and SIGTERM with requests queued. Clients that misbehave: test_serve_clients.py."""
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from helpers import save_hf
from test_serve import CHAT_TEMPLATE, TIMEOUT, reference, serving, slowed, sse, wait_for

httpx = pytest.importorskip("httpx")


def templated_llama(d):
    """The tiny random HF Llama in `d`, its tokenizer with test_serve's chat template."""
    save_hf("llama", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return d


def server_fixtures(name: str):
    """A test module's fixtures `hf_dir` (templated_llama, under a directory `name`) and `srv` (a server over it),
    each module its own."""
    @pytest.fixture(scope="module", name="hf_dir")
    def hf_dir(tmp_path_factory):
        return templated_llama(tmp_path_factory.mktemp(name) / "llama")

    @pytest.fixture(scope="module", name="srv")
    def srv(hf_dir):
        with serving(hf_dir) as s:
            yield s
    return hf_dir, srv


hf_dir, srv = server_fixtures("serve_load")


@contextmanager
def no_errors_logged():
    """Fails where uvicorn logged an error (a traceback, a response it had to cut short)."""
    logged, handler = [], logging.Handler()
    handler.emit = logged.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        yield
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not [r.getMessage() for r in logged if r.levelno >= logging.ERROR]


def at_rest(c, metrics_before, finished=None):
    """/metrics once every request has ended: no slot, queue place or HTTP request left, each submitted request
    counted once as finished, cancelled or failed. The engine's thread counts a request just after the step that
    ended it frees its slot, and a client's request leaves flight when its client does: both are waited for."""
    def ended(m):
        return sum(m[k] - metrics_before[k] for k in ("requests_finished", "requests_cancelled", "requests_failed"))

    def settled():
        m = c.get("/metrics").json()
        return m["requests_in_flight"] == 0 and ended(m) >= m["requests_total"] - metrics_before["requests_total"]
    wait_for(settled, "requests stayed in flight or were never counted as ended")
    m = c.get("/metrics").json()
    assert m["slots_in_use"] == m["requests_active"] == m["requests_queued"] == 0, m
    assert ended(m) == m["requests_total"] - metrics_before["requests_total"], m
    if finished is not None:
        assert m["requests_finished"] - metrics_before["requests_finished"] == finished, m
    return m


@pytest.mark.timeout(90)
def test_many_clients_leaving_at_once_streaming_or_queued_free_every_slot(hf_dir, monkeypatch):
    """4 slots, 12 streams: 4 running, 8 queued; all 12 clients leave at once. Every slot and queue place is freed,
    the engine stops generating for them, and the next request gets the reference decoder's answer."""
    with serving(hf_dir, max_batch=4) as s, no_errors_logged():
        slowed(monkeypatch, s.engine, 0.05)
        leave = asyncio.Event()

        async def one(client, i):
            body = {"prompt": "To be", "max_tokens": 120, "temperature": 1.0, "seed": i, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                lines = r.aiter_lines()
                reading = asyncio.ensure_future(anext(lines))
                await asyncio.wait([reading, asyncio.ensure_future(leave.wait())], return_when="FIRST_COMPLETED")
                await leave.wait()
                reading.cancel()

        async def all_of():
            async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as client:
                tasks = [asyncio.ensure_future(one(client, i)) for i in range(12)]
                deadline = time.monotonic() + TIMEOUT
                while (await client.get("/metrics")).json()["requests_total"] < before["requests_total"] + 12:
                    assert time.monotonic() < deadline, "the requests did not queue"
                    await asyncio.sleep(0.02)
                leave.set()
                await asyncio.gather(*tasks)
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            before = c.get("/metrics").json()
            asyncio.run(asyncio.wait_for(all_of(), 3 * TIMEOUT))
            m = at_rest(c, before)
            assert m["requests_total"] - before["requests_total"] == 12
            assert m["tokens_generated"] - before["tokens_generated"] < 12 * 120 / 2
            generated = m["tokens_generated"]
            time.sleep(0.3)
            assert c.get("/metrics").json()["tokens_generated"] == generated  # nothing runs on for them
            ok = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 8, "temperature": 0})
            assert ok.json()["choices"][0]["text"] == s.tok.decode(reference(s, s.tok.encode("To be"), 8))


@pytest.mark.timeout(90)
def test_long_prompts_queued_behind_one_slot_are_answered_in_order_and_a_leaver_frees_its_place(hf_dir, monkeypatch):
    """--max-batch 1, prompts of 100 tokens prefilled 8 at a time: five queue, each answered in the order it came,
    its answer the reference decoder's; the third's client leaves while it waits, and the rest go on."""
    with serving(hf_dir, max_batch=1, prefill_chunk=8) as s, no_errors_logged(), \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        slowed(monkeypatch, s.engine, 0.02)
        base = s.tok.encode("To be, or not to be, that is the question " * 12)
        prompts = [base[i:i + 100] for i in range(5)]
        before, order, answers = c.get("/metrics").json(), [], {}

        def ask(i):
            try:
                r = httpx.post(s.url + "/v1/completions", json={"prompt": prompts[i], "max_tokens": 6,
                               "temperature": 0}, timeout=0.5 if i == 2 else TIMEOUT)
                answers[i] = r.json()["choices"][0]["text"]
                order.append(i)
            except httpx.ReadTimeout:
                order.append("left")
        threads = []
        for i in range(5):
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            wait_for(lambda: c.get("/metrics").json()["requests_total"] == before["requests_total"] + i + 1,
                     "the request did not arrive")
        for t in threads:
            t.join(3 * TIMEOUT)
        assert order == ["left", 0, 1, 3, 4] or order == [0, "left", 1, 3, 4] or order == [0, 1, "left", 3, 4], order
        for i in (0, 1, 3, 4):
            assert answers[i] == s.tok.decode(reference(s, prompts[i], 6)), i
        m = at_rest(c, before, finished=4)
        assert m["requests_cancelled"] - before["requests_cancelled"] == 1


@pytest.mark.timeout(90)
def test_a_long_prompt_is_not_starved_by_short_requests_arriving_after_it(hf_dir, monkeypatch):
    """Two slots, a 120-token prompt prefilled 8 tokens a step: the new prompts' first chunks went before any
    prompt's later chunks, so while short requests kept arriving (each a new prompt in the other slot) the long
    one waited for all of them, however many came after it."""
    with serving(hf_dir, max_batch=2, prefill_chunk=8) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        gate, step = threading.Event(), s.engine.step
        # every request queued before the first step, in a known order; then 10 ms a step
        monkeypatch.setattr(s.engine, "step", lambda: (gate.wait(TIMEOUT), time.sleep(0.01), step())[-1])
        long = s.tok.encode("To be, or not to be, that is the question " * 12)[:120]
        total, done = c.get("/metrics").json()["requests_total"], []

        async def one(client, tag, prompt, n):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
            assert r.status_code == 200
            done.append(tag)

        async def arrived(client, n):
            while (await client.get("/metrics")).json()["requests_total"] < total + n:
                await asyncio.sleep(0.01)

        async def all_of():
            async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as client:
                first = asyncio.ensure_future(one(client, "long", long, 2))
                await arrived(client, 1)
                shorts = [asyncio.ensure_future(one(client, i, [5 + i, 7], 1)) for i in range(30)]
                await arrived(client, 31)
                gate.set()
                await asyncio.gather(first, *shorts)
        asyncio.run(asyncio.wait_for(all_of(), 3 * TIMEOUT))
        assert done.index("long") < 10, done


@pytest.mark.timeout(90)
def test_concurrent_requests_with_their_own_sampling_and_seeds_each_get_their_answer_alone(srv):
    """Sampling settings and seeds differing row to row in one batch: each request's text, streamed or not, is the
    one it gets alone, and the same seed gives the same text at once or later."""
    settings = [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2},
                {"temperature": 0.7, "top_k": 5, "seed": 1}, {"temperature": 1.3, "top_p": 0.8, "seed": -7},
                {"temperature": 1.0, "top_k": 1, "seed": 3}, {"temperature": 2.0, "top_p": 0.5, "top_k": 20, "seed": 2**62},
                {"temperature": 1.0, "seed": 1}]
    asks = [(PROMPT, s) for PROMPT in ("To be", "the question") for s in settings]

    async def one(client, prompt, sampling, stream):
        body = {"prompt": prompt, "max_tokens": 12, "stream": stream, **sampling}
        r = await client.post("/v1/completions", json=body)
        if not stream:
            return r.json()["choices"][0]["text"]
        return "".join(e["choices"][0]["text"] for e in sse(r.text.splitlines())[0])

    async def all_of():
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p, s, stream) for p, s in asks for stream in (False, True)))
    together = asyncio.run(asyncio.wait_for(all_of(), 3 * TIMEOUT))
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        alone = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 12, **s}).json()["choices"][0]["text"]
                 for p, s in asks]
    assert together[0::2] == together[1::2] == alone
    assert len(set(alone[1:5])) > 1


@pytest.mark.timeout(90)
def test_metrics_count_every_request_once_under_concurrency(hf_dir):
    """4 slots, 16 requests at once (streamed and whole) and 4 refused: /metrics counts each once, the tokens
    generated are those the answers report, and every gauge returns to 0."""
    with serving(hf_dir, max_batch=4) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        before = c.get("/metrics").json()

        async def one(client, i):
            body = {"prompt": "To be " * (1 + i % 5), "max_tokens": 4 + i, "temperature": 1.0, "seed": i}
            if i >= 16:
                body["temperature"] = -1
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
            r = await client.post("/v1/completions", json=body)
            if i >= 16:
                assert r.status_code == 400
                return 0
            return (sse(r.text.splitlines())[0][-1] if i % 2 else r.json())["usage"]["completion_tokens"]

        async def all_of():
            async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as client:
                return await asyncio.gather(*(one(client, i) for i in range(20)))
        tokens = asyncio.run(asyncio.wait_for(all_of(), 3 * TIMEOUT))
        m = at_rest(c, before, finished=16)
        assert m["requests_total"] - before["requests_total"] == 16
        assert m["requests_rejected"] - before["requests_rejected"] == 4
        assert m["tokens_generated"] - before["tokens_generated"] == sum(tokens)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_with_requests_queued_answers_every_one_then_exits_0(tmp_path):
    """--max-batch 1, three requests (one running, two queued) when SIGTERM comes: all three are answered in
    full, a new one gets 503, and the process exits 0 (the drain the command's help documents)."""
    from test_serve_startup import SLOWED, started
    save_hf("llama", tmp_path / "llama")
    proc = subprocess.Popen([sys.executable, "-c", SLOWED, "serve", "--model", str(tmp_path / "llama"), "--port", "0",
                             "--compile", "off", "--max-batch", "1", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{started(proc)}"
        answers = []

        def ask(prompt):
            try:
                r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                               timeout=60)
                answers.append((r.status_code, r.json().get("usage", {}).get("completion_tokens", r.text)))
            except httpx.HTTPError as e:
                answers.append((repr(e), 0))
        threads = [threading.Thread(target=ask, args=(p,)) for p in ("To be", "or not", "the question")]
        for t in threads:
            t.start()
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            # all three submitted (the first may wait in the queue until the engine's next step), two queued
            wait_for(lambda: (lambda m: m["requests_total"] == 3 and m["requests_queued"] == 2)(
                c.get("/metrics").json()), "the requests did not queue")
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: c.get("/health").status_code == 503, "the server did not start draining")
            refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        for t in threads:
            t.join(60)
        assert len(answers) == 3 and all(a[0] == 200 and isinstance(a[1], int) and a[1] >= 1 for a in answers), answers
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
