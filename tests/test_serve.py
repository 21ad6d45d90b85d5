"""`shardlm serve`: the OpenAI-compatible HTTP API over real HTTP on 127.0.0.1, against a server in this
process (uvicorn in a thread) or, for signals, a `python -m shardlm serve` subprocess. Answers are checked
against the eager reference decoder; errors against OpenAI's error object; the server must outlive every
bad request, failed step and departed client."""
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from helpers import make_tokenizer, save_hf
from shardlm.inference import Engine, generate_ids, load_pretrained, until_eos

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TIMEOUT = 20  # seconds, for every network wait
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["To be", "or not to be, that is", "the question", "whether 'tis nobler in the mind", "to suffer",
           "the slings and arrows", "of outrageous fortune", "or to take arms", "against a sea", "of troubles",
           "and by opposing", "end them", "To", "be, or", "not", "that is the question: whether"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random HF Llama whose tokenizer has a chat template."""
    d = tmp_path_factory.mktemp("serve") / "llama"
    save_hf("llama", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return d


@contextmanager
def serving(path, max_batch=16, adapters=None, replicas=1, base="base", **engine_args):
    """A server on a free port of 127.0.0.1 in this process, serving the model as `base`; yields its url, engine,
    worker (a pool of `replicas` workers), tokenizer, model. `engine_args`: more of Engine's arguments."""
    from shardlm.serve.command import build_server
    engines = []
    for _ in range(replicas):
        model, tok, cfg = load_pretrained(path)
        engine = Engine(model, max_batch, cfg.max_seq_len, compile=False, decode=tok.decode, **engine_args)
        for name, directory in (adapters or {}).items():
            engine.add_adapter(name, directory)
        engines.append(engine)
    server, worker = build_server(engines if replicas > 1 else engine, tok, base, adapters or {}, "127.0.0.1", 0,
                                  "warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engine=engine, worker=worker, tok=tok, model=model)
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        worker.close(TIMEOUT)


@pytest.fixture(scope="module")
def srv(hf_dir):
    with serving(hf_dir) as s:
        yield s


def reference(s, ids, n):
    """The eager decoder's greedy tokens for `ids` alone, cut at end-of-text as the server cuts them."""
    new = generate_ids(s.model, torch.tensor([ids]), n, stop_ids=(s.tok.eos_id,))[0].tolist()
    return until_eos(new, s.tok.eos_id)


def sse(lines):
    """The JSON events of a server-sent event stream, and whether it ended with [DONE]."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    return [json.loads(d) for d in data if d != "[DONE]"], bool(data) and data[-1] == "[DONE]"


def test_models_health_and_metrics(srv):
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert c.get("/health").json() == {"status": "ok"}
        models = c.get("/v1/models").json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["base"]
        assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 128
        m = c.get("/metrics").json()
        for key in ("requests_total", "requests_active", "requests_queued", "requests_finished",
                    "requests_cancelled", "requests_failed", "requests_rejected", "tokens_generated",
                    "tokens_per_s", "window_s", "slots_in_use", "slots", "requests_in_flight", "draining"):
            assert key in m, key
        assert m["slots"] == 16 and m["draining"] is False


def test_sixteen_concurrent_streams_each_equal_the_reference_decoder(srv):
    """16 streamed completions at once through one engine of 16 slots: each one's text (streamed deltas
    joined) and token count are those of the eager decoder on that prompt alone."""
    async def one(client, prompt):
        body = {"model": "base", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events, done = sse([line async for line in r.aiter_lines()])
        assert done
        return events

    async def all_of():
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
    before = srv.worker.counts["requests_total"]
    results = asyncio.run(asyncio.wait_for(all_of(), 3 * TIMEOUT))
    assert srv.worker.counts["requests_total"] - before == 16
    for prompt, events in zip(PROMPTS, results):
        want = reference(srv, srv.tok.encode(prompt), 12)
        text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert text == srv.tok.decode(want), prompt
        assert events[-1]["usage"]["completion_tokens"] == len(want) + (len(want) < 12)  # + the stop token
        reasons = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert reasons[-1] == ("length" if len(want) == 12 else "stop") and not any(reasons[:-1])


def test_the_openai_client_completes_and_chats_whole_and_streamed(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="any", timeout=TIMEOUT, max_retries=0)
    prompt = PROMPTS[3]
    want = srv.tok.decode(reference(srv, srv.tok.encode(prompt), 10))
    r = client.completions.create(model="base", prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(srv.tok.encode(prompt))
    chunks = client.completions.create(model="base", prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"}]
    rendered = "<|system|>Be brief.\n<|user|>To be?\n<|assistant|>"  # CHAT_TEMPLATE's rendering
    want = srv.tok.decode(reference(srv, srv.tok.encode(rendered), 10))
    r = client.chat.completions.create(model="base", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="base", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.timeout(60)
def test_a_developer_message_is_the_system_turn(srv):
    """OpenAI's clients send the system turn as role "developer" (its newer name): it was a 400."""
    def ask(role):
        messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "To be?"}]
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0},
                       timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]
    assert ask("developer") == ask("system")


def test_stop_strings_end_the_text_before_them_streamed_or_not(srv):
    prompt = PROMPTS[0]
    full = srv.tok.decode(reference(srv, srv.tok.encode(prompt), 16))
    stop = full[3:5]
    assert stop and full.find(stop) > 0
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stop": [stop]}
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]
        events, done = sse(c.post("/v1/completions", json={**body, "stream": True}).text.splitlines())
    assert whole["text"] == full[:full.find(stop)] and whole["finish_reason"] == "stop"
    assert done and "".join(e["choices"][0]["text"] for e in events) == whole["text"]


BAD = [  # (body, status, param); a body with messages goes to /v1/chat/completions
    (b"{not json", 400, None), (b"[1, 2]", 400, None), ({"prompt": 5}, 400, "prompt"),
    # a lone surrogate's escape: valid JSON the tokenizer rejects (once a 500 with a TypeError)
    (b'{"prompt": "a\\ud800", "max_tokens": 2}', 400, "prompt"),
    (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', 400, "messages"),
    ({"prompt": ["a", "b"]}, 400, "prompt"), ({"prompt": [0, 99999]}, 400, "prompt"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"), ({"prompt": "x", "temperature": "hot"}, 400,
                                                                  "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"), ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "x", "n": 2}, 400, "n"), ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"), ({"prompt": "x", "logprobs": 5}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 200}, 400, "max_tokens"), ({"prompt": "To be " * 100}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"), ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, 400, "max_tokens"),
    # "no" is truthy: the usage chunk would come; 0 is falsy but no boolean either
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}}, 400, "stream_options.include_usage"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 0}}, 400, "stream_options.include_usage"),
    # a misspelt or another library's name, and vLLM's sampling extensions: ignored, they would sample at the defaults
    ({"prompt": "x", "temprature": 0}, 400, "temprature"), ({"prompt": "x", "max_new_tokens": 4}, 400, "max_new_tokens"),
    # nested deeper than the JSON decoder recurses: once a 500 with a traceback in the server's log
    (b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ({"prompt": "x", "min_p": 0.1}, 400, "min_p"), ({"prompt": "x", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    # more of vLLM's: a stop string kept, constrained decoding, a template's switches (once ignored: another answer)
    ({"prompt": "x", "include_stop_str_in_output": True}, 400, "include_stop_str_in_output"),
    ({"prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}}, 400,
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400, "continue_final_message"),
]


def test_bad_requests_get_openai_errors_and_the_server_serves_on(srv):
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        rejected = c.get("/metrics").json()["requests_rejected"]
        for body, status, param in BAD:
            path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
            r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], body
            assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
        assert c.get("/metrics").json()["requests_rejected"] == rejected + len(BAD)
        assert c.get("/v1/nothing").status_code == 404
        assert c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 0}).json()["choices"][0]["text"] == ""
        ok = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 4, "temperature": 0, "user": "u",
                                             "client_tag": 1, "min_p": 0.0, "models": ["a", "b"]})
        # others' keys (OpenRouter's fallback "models", near "model" but no answer changed), neutral values: served
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.timeout(60)
def test_neutral_values_written_as_floats_are_served_and_logprobs_0_is_refused(srv):
    """Python clients write a penalty as 0.0, which was refused as unsupported; a completion's logprobs 0 asks for
    the chosen tokens' log probabilities (OpenAI, vLLM) and was served with logprobs null."""
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "best_of": 1.0, "repetition_penalty": 1.0}
        r = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2, **neutral})
        assert r.status_code == 200, r.text
        for body in ({"presence_penalty": 0.5}, {"logprobs": 0}, {"echo": 0}, {"best_of": True}):
            r = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), (body, r.text)


@pytest.mark.timeout(60)
def test_a_chat_that_fills_the_context_is_refused_not_answered_empty(srv):
    """Without max_tokens a chat may take the rest of the context; where none is left it was answered 200 with
    no text (finish_reason "length"), as if the model had nothing to say."""
    def rendered(k):
        return len(srv.tok.encode(f"<|user|>{'To be ' * k}\n<|assistant|>"))
    k = next(k for k in range(1, 128) if rendered(k) >= 128)
    assert rendered(k) == 128  # exactly the context (max_model_len 128)
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "To be " * k}]},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "messages"


@pytest.mark.timeout(60)
def test_a_prompt_far_beyond_the_context_is_refused_untokenized(srv, monkeypatch):
    """A 20 MB prompt was tokenized on the event loop (18 s for the byte tokenizer), every other client waiting."""
    tokenized = []
    encode = srv.tok.encode
    monkeypatch.setattr(srv.tok, "encode", lambda text: tokenized.append(len(text)) or encode(text))
    huge = "To be " * 100_000
    for path, body in (("/v1/completions", {"prompt": huge}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})):
        r = httpx.post(srv.url + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert f"holds {len(huge)} characters, far more than that many tokens" in r.json()["error"]["message"]
    assert not tokenized


def test_a_tokenizer_without_a_chat_template_is_told_so(hf_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(hf_dir, plain)
    make_tokenizer(plain)  # the tokenizer files again, without the template
    with serving(plain, max_batch=2) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def slowed(monkeypatch, engine, seconds):
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(seconds) or step())


def wait_for(check, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_client_that_leaves_a_stream_frees_its_slot(srv, monkeypatch):
    slowed(monkeypatch, srv.engine, 0.05)  # 100 tokens now take over half a second: the client leaves first
    before = srv.worker.metrics()
    body = {"prompt": "To be", "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
            assert c.get("/metrics").json()["slots_in_use"] == 1
        wait_for(lambda: srv.worker.metrics()["requests_cancelled"] == before["requests_cancelled"] + 1,
                 "the departed client's request was not cancelled")
        m = c.get("/metrics").json()
        assert m["slots_in_use"] == 0 and m["requests_active"] == 0
        assert m["tokens_generated"] - before["tokens_generated"] < 100
        ok = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_slot(srv, monkeypatch):
    slowed(monkeypatch, srv.engine, 0.1)  # 100 tokens take over a second; the server looks 4 times a second
    before = srv.worker.metrics()["requests_cancelled"]
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=srv.url, timeout=0.3) as c:
        c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 100, "temperature": 0})
    wait_for(lambda: srv.worker.metrics()["requests_cancelled"] == before + 1,
             "the departed client's request was not cancelled")
    assert srv.worker.metrics()["slots_in_use"] == 0


def test_a_body_shorter_than_its_content_length_gets_408_while_others_are_served(srv, monkeypatch):
    """Such a client waited for ever, counted in flight (a draining server never exited); one that left mid-body
    logged a ClientDisconnect traceback. Now the first gets 408 and its connection closed, the second nothing."""
    import logging

    import shardlm.serve.app as app
    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 3.0)
    logged = []
    handler = logging.Handler()
    handler.emit = logged.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    port = int(srv.url.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "To be", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as short, httpx.Client(
                base_url=srv.url, timeout=TIMEOUT) as c:
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as leaving:
                leaving.sendall(head % (len(body) + 10) + body)
            short.sendall(head % (len(body) + 10) + body)
            wait_for(lambda: c.get("/metrics").json()["requests_in_flight"] == 1, "the short request never arrived")
            ok = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2, "temperature": 0})
            assert ok.status_code == 200
            short.setblocking(False)
            with pytest.raises(BlockingIOError):  # still waiting for its body while the other was served
                short.recv(1)
            short.settimeout(TIMEOUT)
            answer = b""
            while chunk := short.recv(65536):  # to the end: the server closes the connection
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer, answer
            assert c.get("/metrics").json()["requests_in_flight"] == 0
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not [r.getMessage() for r in logged if r.levelno >= logging.ERROR]


def test_streamed_text_never_sends_half_a_character_or_the_start_of_a_stop_string():
    from shardlm.serve.responses import TextStream
    from shardlm.tokenizer import load_tokenizer
    tok = load_tokenizer("byte")  # one id per byte: every multi-byte character arrives in pieces
    text = "naïve café, 1 ✓ 2 ✓ done"
    stream = TextStream(tok.decode, (tok.eos_id,), ())
    deltas = [stream.push([i]) for i in tok.encode(text)]
    assert "".join(deltas) + stream.finish() == text and not any("\ufffd" in d for d in deltas)
    stream = TextStream(tok.decode, (tok.eos_id,), ("✓ 2",))
    sent = "".join(stream.push([i]) for i in tok.encode("naïve café, 1 ✓ 2"))
    assert sent == "naïve café, 1 " and stream.finish() == ""


def test_the_stop_ids_are_the_tokenizers_and_the_generation_configs(hf_dir, tmp_path):
    from shardlm.generation_config import stop_ids_of
    from shardlm.tokenizer import load_tokenizer
    make_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert stop_ids_of(tok) == (tok.eos_id,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_id, 5, 99999]}))
    assert stop_ids_of(load_tokenizer(tmp_path)) == (tok.eos_id, 5)
    # transformers' defaults for the model class (Llama's eos 2) say nothing of this tokenizer
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "_from_model_config": True}))
    assert stop_ids_of(load_tokenizer(tmp_path)) == (tok.eos_id,)


def test_every_step_warm_up_included_runs_on_the_workers_thread(hf_dir):
    """Compiled steps and CUDA graphs belong to the thread that made them: the warm-up runs where serving does,
    telling its progress (serve's bar) batch by batch before start returns."""
    from shardlm.inference import Request
    from shardlm.serve.worker import EngineWorker
    model, tok, _ = load_pretrained(hf_dir)
    engine = Engine(model, 2, 32, compile=False, decode=tok.decode)
    threads, step = [], engine.step
    engine.step = lambda: threads.append(threading.current_thread()) or step()
    warm = [[Request([tok.eos_id], 2)], [Request([tok.eos_id], 2)]]
    warmed = []
    worker = EngineWorker(engine).start(warm, progress=warmed.append)
    assert all(r.done for batch in warm for r in batch) and threads and warmed == [1, 1]
    done = threading.Event()
    worker.submit(Request(tok.encode("To be"), 3), lambda r, error: done.set())
    assert done.wait(TIMEOUT)
    worker.close(TIMEOUT)
    assert set(threads) == {worker._thread} and not worker._thread.is_alive()


def test_a_warm_up_without_a_terminal_is_told_in_lines(hf_dir, capsys, monkeypatch):
    """On a GPU a server compiles and captures every step before it serves (minutes for a 7B model at a long
    context, one batch alone may take one); its progress bar shows on a terminal only, so a server started by a
    service or nohup logged nothing in that time. A line says the warm-up began, and others its progress at a
    fixed interval (30 s; 0.05 s here, each batch's steps slowed to outlast it), while a batch runs."""
    import re

    import shardlm.runtime.progress
    import shardlm.serve.command as command
    from shardlm.inference import Request
    model, tok, _ = load_pretrained(hf_dir)
    engine = Engine(model, 2, 32, compile=False, decode=tok.decode)
    step = engine.step
    engine.step = lambda: time.sleep(0.1) or step()
    monkeypatch.setattr(shardlm.runtime.progress, "LINE_EVERY_S", 0.05)
    warm = lambda e: [[Request([tok.eos_id], 2)] for _ in range(3)]  # noqa: E731
    capsys.readouterr()
    server, worker = command.build_server(engine, tok, "base", {}, "127.0.0.1", 0, "warning", warm)
    worker.close(TIMEOUT)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "shardlm serve: warming up: 3 batches of requests through every step serving runs", lines
    told = [x for x in lines[1:] if "warming up" in x]
    assert len(told) >= 2 and all(
        re.fullmatch(r"shardlm serve: warming up: [0-2] of 3 batches \(\d+%\) in \d+s(, about \d+s left)?", x)
        for x in told[:-1]), lines
    assert any(x.startswith("shardlm serve: warming up: 0 of 3") for x in told), lines  # while the first runs
    assert re.fullmatch(r"shardlm serve: warming up: 3 batches in \d+s", told[-1]), lines  # it ended
    time.sleep(0.2)
    assert "warming up" not in capsys.readouterr().err  # no line after the warm-up


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_len", [2, 3])
def test_the_warm_up_fits_the_shortest_slots(hf_dir, max_len):
    """`serve --max-len 2` (or 3) ended in its warm-up with 'prompt (1 tokens) + max_new_tokens (2) exceeds the 2
    positions a slot holds', about a prompt the user never sent."""
    from shardlm.serve.worker import EngineWorker, warm_up_batches
    model, tok, _ = load_pretrained(hf_dir)
    engine = Engine(model, 2, max_len, compile=False, decode=tok.decode)
    warm = warm_up_batches(engine, tok.eos_id)
    EngineWorker(engine).start(warm).close(TIMEOUT)
    assert all(r.done for batch in warm for r in batch)


def test_an_engine_failure_fails_its_requests_with_500_and_the_server_serves_on(srv, monkeypatch):
    prefill, calls = srv.engine._prefill, []

    def failing_prefill(finished):  # the first two prefills raise, inside the engine's step
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("injected")
        return prefill(finished)
    monkeypatch.setattr(srv.engine, "_prefill", failing_prefill)
    body = {"prompt": "To be", "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        events, done = sse(c.post("/v1/completions", json={**body, "stream": True}).text.splitlines())
        assert done and "error" in events[-1]
        assert srv.worker.metrics()["slots_in_use"] == 0
        ok = c.post("/v1/completions", json=body)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == srv.tok.decode(reference(srv, srv.tok.encode("To be"), 5))


def healthy(client) -> bool:
    try:
        return client.get("/health").status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_sigterm_finishes_the_streams_in_flight_refuses_new_requests_and_exits_0(hf_dir, tmp_path):
    """A subprocess server with a 2,048-position model: a long stream runs, SIGTERM arrives, a new request
    gets 503, the stream still ends with all its tokens, and the process exits 0."""
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=2048)
    long_dir = tmp_path / "long"
    tf.LlamaForCausalLM(cfg).save_pretrained(long_dir)
    make_tokenizer(long_dir)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "serve", "--model", str(long_dir), "--port",
                             str(port), "--max-batch", "2", "--log-level", "warning"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            wait_for(lambda: healthy(c) or proc.poll() is not None, "the server did not start", 60)
            assert proc.poll() is None, proc.stdout.read()
            body = {"prompt": "To be", "max_tokens": 1500, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)
                wait_for(lambda: c.get("/health").status_code == 503, "the server did not start draining")
                refused = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
                events, done = sse([first, *lines])
            assert done and events[-1]["usage"]["completion_tokens"] == 1500
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_adapters_and_the_base_in_one_batch_each_give_their_own_tokens(hf_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from helpers import hf_model
    dirs = {}
    for i, name in enumerate(("first", "second")):
        base = hf_model("llama")  # hf_dir's weights (it seeds itself)
        torch.manual_seed(10 + i)  # init_lora_weights=False: random A and B, so the adapter changes the model
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                               init_lora_weights=False)
        peft.get_peft_model(base, lora).save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    prompts = PROMPTS[:6]
    want = {}
    for name, d in {**dirs, "base": None}.items():
        model, tok, _ = load_pretrained(hf_dir, adapter=d)
        want[name] = [tok.decode(until_eos(generate_ids(model, torch.tensor([tok.encode(p)]), 8,
                                                        stop_ids=(tok.eos_id,))[0].tolist(), tok.eos_id))
                      for p in prompts]
    assert want["first"] != want["second"] != want["base"] != want["first"]

    async def all_of(url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            asks = [(name, p) for p in prompts for name in want]  # the base's rows in the batch too
            answers = await asyncio.gather(*(client.post("/v1/completions", json={
                "model": name, "prompt": p, "max_tokens": 8, "temperature": 0}) for name, p in asks))
            return asks, answers
    with serving(hf_dir, adapters=dirs) as s:
        assert [m["id"] for m in httpx.get(s.url + "/v1/models", timeout=TIMEOUT).json()["data"]] == \
            ["base", "first", "second"]
        asks, answers = asyncio.run(asyncio.wait_for(all_of(s.url), 3 * TIMEOUT))
    for (name, p), r in zip(asks, answers):
        assert r.status_code == 200 and r.json()["model"] == name
        assert r.json()["choices"][0]["text"] == want[name][prompts.index(p)], (name, p)


def test_serve_without_fastapi_names_the_extra_to_install(hf_dir, monkeypatch, capsys):
    from shardlm.cli import main
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    assert main(["serve", "--model", str(hf_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'shardlm[serve]'" in err and "\n" not in err


@pytest.mark.parametrize("args,message", [(["--port", "70000"], "--port 70000 is not a port"),
                                          (["--port", "-1"], "--port -1 is not a port"),
                                          (["--max-batch", "0"], "--max-batch 0 must be at least 1"),
                                          (["--served-model-name", ""], "--served-model-name is empty: give the "
                                           "id clients name"),
                                          (["--max-len", "1"], "--max-len 1 leaves no room for a prompt and its "
                                           "completion: give 2 or more"),
                                          (["--port", "taken"], "--port {port} on 127.0.0.1: Address already in use: "
                                           "another process listens there (another shardlm serve?); stop it or pick "
                                           "another --port (0: any free one)"),
                                          (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: "),
                                          (["--host", "192.0.2.1"], "--host 192.0.2.1: Cannot assign requested address: "
                                           "it is not an address of this machine; use 127.0.0.1")])
def test_serve_refuses_settings_it_cannot_serve_with_one_line(hf_dir, capsys, monkeypatch, args, message):
    """Before the model loads: a port out of range or in use, a host that does not resolve, no slots."""
    import shardlm.inference
    from shardlm.cli import main

    def never(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(shardlm.inference, "load_pretrained", never)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [str(port) if x == "taken" else x for x in args]
        assert main(["serve", "--model", str(hf_dir), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message.format(port=port) in err and "\n" not in err, err


def test_a_link_local_host_without_its_interface_names_the_host(hf_dir, monkeypatch, capsys):
    """--host fe80::... (an address `ip addr` shows) without %IFACE fails to bind with EINVAL, which was reported as
    `--port 8123 on fe80::...: Invalid argument`, the wrong flag and no fix."""
    import errno

    import shardlm.inference
    from shardlm.cli import main
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("fe80::1", 0))
    except OSError as e:
        if e.errno != errno.EINVAL:
            pytest.skip(f"binding fe80::1 here fails otherwise: {e}")
    else:
        pytest.skip("fe80::1 binds here")
    monkeypatch.setattr(shardlm.inference, "load_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--model", str(hf_dir), "--host", "fe80::1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--host fe80::1: Invalid argument: a link-local IPv6 address is bound through its interface: give " \
        "fe80::1%IFACE" in err and "\n" not in err, err


def test_serve_counts_its_slots_in_words(hf_dir, monkeypatch, capsys):
    from shardlm.cli import main
    from shardlm.serve import command

    class Stub:  # the server and its worker, built but not run
        def run(self, sockets=None):
            pass

        def close(self, timeout):
            pass
    monkeypatch.setattr(command, "build_server", lambda *args, **kwargs: (Stub(), Stub()))
    assert main(["serve", "--model", str(hf_dir), "--max-batch", "1", "--compile", "off"]) == 0
    assert "(1 slot of " in capsys.readouterr().err


def test_the_port_is_held_while_the_model_loads_and_served_on(hf_dir, monkeypatch, capsys):
    """The port is bound before the model loads and that socket is the one served on: another process could
    take it during a load of minutes, and uvicorn, binding only then, failed with its own log line and status 3
    after the banner had announced the server. The banner names the port (--port 0: the one chosen)."""
    import shardlm.inference
    from shardlm.cli import main
    from shardlm.serve import command
    real, served = shardlm.inference.load_pretrained, []

    def loading(*a, **k):  # another process tries the port meanwhile
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
                other.listen()
        return real(*a, **k)

    class Stub:
        def run(self, sockets=None):
            served.extend(sockets or [])

        def close(self, timeout):
            pass
    from shardlm.testing.distributed import free_port
    port = free_port()
    monkeypatch.setattr(shardlm.inference, "load_pretrained", loading)
    monkeypatch.setattr(command, "build_server", lambda *args, **kwargs: (Stub(), Stub()))
    assert main(["serve", "--model", str(hf_dir), "--port", str(port), "--max-batch", "1", "--compile", "off"]) == 0
    assert [s.getsockname()[1] for s in served] == [port]
    assert f"on http://127.0.0.1:{port}" in capsys.readouterr().err
    served[0].close()


def test_only_rank_0_checks_the_port(hf_dir, monkeypatch):
    """Under torchrun every rank runs the command and only rank 0 serves HTTP: another rank must not test-bind
    the port (two ranks binding it at once would refuse each other)."""
    import shardlm.inference.commands
    from shardlm.cli import main

    def loading(*a, **k):  # where rank 1 would join the process group
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(shardlm.inference.commands, "_tensor_parallel", loading)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(AssertionError, match="the model was loaded"):
            main(["serve", "--model", str(hf_dir), "--port", str(busy.getsockname()[1]), "--tp", "2"])


@pytest.mark.timeout(240)
def test_tensor_parallel_serving_gives_the_tokens_of_one_process_and_sigterm_stops_every_rank(hf_dir, srv):
    """`serve --tp 2` as torchrun starts it (two processes, RANK/WORLD_SIZE/MASTER_* set; gloo on the CPU):
    rank 0 serves HTTP and sends each step's plan to rank 1. Concurrent streamed greedy completions equal
    those of the one-process server; a stream the client leaves early frees its slot on both ranks (the next
    requests still agree); SIGTERM to both ranks (as torchrun forwards it) drains rank 0, which then stops
    rank 1, and both exit 0."""
    from shardlm.testing.distributed import free_port
    port, master = free_port(), free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
        procs.append(subprocess.Popen([sys.executable, "-m", "shardlm", "serve", "--model", str(hf_dir), "--tp", "2", "--served-model-name", "base",
                                       "--port", str(port), "--max-batch", "4", "--log-level", "warning"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))

    async def complete(url, prompts, max_tokens=12):
        async def one(client, prompt):
            body = {"model": "base", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events, done = sse([line async for line in r.aiter_lines()])
            assert done
            return "".join(e["choices"][0]["text"] for e in events if e["choices"])
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            wait_for(lambda: healthy(c) or any(p.poll() is not None for p in procs), "the server did not start", 120)
            assert all(p.poll() is None for p in procs), [p.stdout.read() for p in procs if p.poll() is not None]
            prompts = PROMPTS[:6]  # more than the 4 slots: some wait in the queue
            got = asyncio.run(asyncio.wait_for(complete(url, prompts), 3 * TIMEOUT))
            assert got == asyncio.run(asyncio.wait_for(complete(srv.url, prompts), 3 * TIMEOUT))
            with c.stream("POST", "/v1/completions", json={"prompt": "To be", "max_tokens": 40, "stream": True,
                                                           "temperature": 0}) as r:
                next(line for line in r.iter_lines() if line.startswith("data: "))  # then leave
            wait_for(lambda: c.get("/metrics").json()["requests_cancelled"] >= 1, "the stream was not cancelled")
            again = asyncio.run(asyncio.wait_for(complete(url, PROMPTS[6:10], 8), 3 * TIMEOUT))
            assert again == asyncio.run(asyncio.wait_for(complete(srv.url, PROMPTS[6:10], 8), 3 * TIMEOUT))
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(TIMEOUT) for p in procs]
        assert codes == [0, 0], [p.stdout.read() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_replicas_share_the_requests_and_each_answer_is_the_reference_decoders(hf_dir):
    """`--replicas 2` (here two engines on the CPU): eight streams at once are spread over both replicas, and
    each answer is the eager decoder's on that prompt alone; /metrics adds the replicas' counts."""
    async def one(client, prompt):
        body = {"model": "base", "prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events, done = sse([line async for line in r.aiter_lines()])
        assert done
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])

    with serving(hf_dir, max_batch=4, replicas=2) as s:
        async def all_of():
            async with httpx.AsyncClient(base_url=s.url, timeout=TIMEOUT) as client:
                return await asyncio.gather(*(one(client, p) for p in PROMPTS[:8]))
        got = asyncio.run(asyncio.wait_for(all_of(), 3 * TIMEOUT))
        for prompt, text in zip(PROMPTS[:8], got):
            assert text == s.tok.decode(reference(s, s.tok.encode(prompt), 10)), prompt
        assert all(w.counts["requests_total"] > 0 for w in s.worker.workers)
        metrics = httpx.get(f"{s.url}/metrics", timeout=TIMEOUT).json()
        assert metrics["replicas"] == 2 and metrics["requests_finished"] >= 8 and metrics["slots"] == 8
