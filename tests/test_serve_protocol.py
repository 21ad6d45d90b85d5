"""`shardlm serve` against what OpenAI-compatible clients send and read: chat templates as transformers renders
them, streamed text against the whole answer, and the API's smaller routes and headers. Over real HTTP on
127.0.0.1, against a server in this process (test_serve.serving)."""
import json
import shutil

import pytest
import torch

from test_serve import TIMEOUT, serving, sse
from helpers import save_hf

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_protocol") / "llama"
    save_hf("llama", d)
    return d


def with_template(hf_dir, where, template):
    shutil.copytree(hf_dir, where)
    cfg = json.loads((where / "tokenizer_config.json").read_text())
    (where / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return where


@pytest.mark.timeout(120)
def test_templates_with_loop_controls_and_generation_blocks_are_served_as_transformers_renders_them(hf_dir, tmp_path):
    """{% break %} / {% continue %} and {% generation %} (transformers' environment has them; templates on the Hub
    use them): the template did not parse, and serve refused to start."""
    from transformers import PreTrainedTokenizerFast
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}<|{{ m.role }}|>"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}"
                "{{ m.content }}{% endif %}\n{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    where = with_template(hf_dir, tmp_path / "t", template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"},
                {"role": "assistant", "content": "Or not."}, {"role": "user", "content": "Which?"}]
    theirs = PreTrainedTokenizerFast.from_pretrained(str(where))
    want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with serving(where, max_batch=2) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(s.tok.encode(want))


@pytest.mark.timeout(120)
def test_templates_read_tojson_and_todays_date_as_transformers_renders_them(hf_dir, tmp_path):
    """jinja's own tojson escapes <, >, & and ' for HTML and every non-ASCII character, which transformers' does
    not; strftime_now (Llama 3.2's template dates its system turn with it) was undefined."""
    from transformers import PreTrainedTokenizerFast
    template = ("{% if strftime_now is defined %}{{ strftime_now('%d %b %Y') }}{% else %}26 Jul 2024{% endif %}\n"
                "{% for m in messages %}{{ m | tojson }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    where = with_template(hf_dir, tmp_path / "t", template)
    messages = [{"role": "user", "content": "<b>caf\u00e9</b> & 'tea'"}]
    want = PreTrainedTokenizerFast.from_pretrained(str(where)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    with serving(where, max_batch=2) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(s.tok.encode(want)), r.text


@pytest.fixture(scope="module")
def sp_dir(hf_dir, tmp_path_factory):
    """The tiny Llama under a tokenizer built as Llama 2's and Mistral's are: Metaspace pieces, byte fallback (a
    character outside the vocabulary as its UTF-8 bytes, one id each), and a decoder that drops the space
    opening a text."""
    from helpers import sentencepiece_style_tokenizer
    d = tmp_path_factory.mktemp("serve_sp") / "llama"
    shutil.copytree(hf_dir, d)
    tok = sentencepiece_style_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return d


def completion(c, body):
    """The whole answer's text, and the streamed one's deltas joined."""
    whole = c.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    events, done = sse(c.post("/v1/completions", json={**body, "stream": True}).text.splitlines())
    assert done
    return whole.json()["choices"][0]["text"], "".join(e["choices"][0]["text"] for e in events)


@pytest.mark.timeout(120)
def test_a_stream_sends_the_whole_answers_text_where_byte_fallback_ids_go_wrong(sp_dir):
    """A run of byte ids whose UTF-8 is invalid decodes (byte fallback, Llama 2's) to replacement characters all,
    the valid bytes before included: a stream had sent those as text, which was then no prefix of the final
    text, and it sent nothing more (2 characters of a whole answer's 6)."""
    with serving(sp_dir, max_batch=4) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        wrong = 0
        for seed in range(12):
            whole, streamed = completion(c, {"prompt": "To be or not to be", "max_tokens": 6, "seed": seed})
            assert streamed == whole, seed
            wrong += "\ufffd" in whole
        assert wrong  # the case at hand: the sampled ids hold invalid UTF-8


@pytest.mark.timeout(120)
def test_a_completion_keeps_the_space_that_opens_it_under_a_sentencepiece_tokenizer(sp_dir):
    """Such a decoder drops the space opening a text: decoded alone, a completion's first word ran into the
    prompt's last ("isParis"), and a stop string opening with that space went unseen."""
    from shardlm.inference import generate_ids
    with serving(sp_dir, max_batch=4) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        def greedy(prompt, n):
            ids = s.tok.encode_document(prompt)
            return ids, generate_ids(s.model, torch.tensor([ids]), n)[0].tolist()
        prompt = next(p for p in (f"To be {w}" for w in ("or", "the", "not", "that", "is", "be", "a", "to", "and"))
                      if s.tok.tok.id_to_token(greedy(p, 1)[1][0]).startswith("\u2581"))
        ids, new = greedy(prompt, 4)
        want = s.tok.decode(ids + new)[len(s.tok.decode(ids)):]
        assert want.startswith(" ")
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        assert completion(c, body) == (want, want)
        first = want.split()[0]
        r = c.post("/v1/completions", json={**body, "stop": " " + first}).json()
        assert r["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}


@pytest.mark.timeout(120)
def test_a_prompt_ending_in_a_byte_fallback_character_leaves_the_completions_text_whole(sp_dir):
    """The completion was decoded after the prompt's last id alone: where the prompt ends in an emoji (four byte
    ids), that id is part of a character, and the byte-fallback decoder turned the completion's own bytes into
    replacement characters ('\ufffd\ufffdeueu' for '4ueueu'), streamed and whole."""
    from shardlm.inference import generate_ids
    with serving(sp_dir, max_batch=2) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        found = 0
        marks = ("\U0001F600", "\u4e16", "\u2713")
        for prompt in (f"{w} {e}" for w in ("be", "To", "or", "not", "the") for e in marks):
            ids = s.tok.encode_document(prompt)
            new = generate_ids(s.model, torch.tensor([ids]), 6)[0].tolist()
            want = s.tok.decode(ids + new)[len(s.tok.decode(ids)):]
            if "\ufffd" in want:  # the model's own bytes are invalid here: no whole text to compare
                continue
            found += s.tok.tok.id_to_token(new[0]).startswith("<0x")
            assert completion(c, {"prompt": prompt, "max_tokens": 6, "temperature": 0}) == (want, want), prompt
        assert found  # the case at hand: a completion opening with a byte id after a prompt's character


def test_a_stop_string_after_byte_fallback_characters_ends_the_request():
    """The engine decoded only the last 4 x len(stop) + 1 ids for a stop string; a window opening inside a
    character of byte ids decoded to replacement characters all, the stop in it unseen: the request ran on to
    max_tokens, finish_reason 'length'."""
    from helpers import sentencepiece_style_tokenizer
    from shardlm.inference.request import Request, accept
    from shardlm.tokenizer import Tokenizer
    sp = Tokenizer(sentencepiece_style_tokenizer(), eos_token="</s>")
    for text, stop, before in (("ok \U0001F389\U0001F600" + "\U0001F389" * 8, "\U0001F600", "ok \U0001F389"),
                               ("\u8c22\u8c22\u3002" + "\u8c22" * 10, "\u3002", "\u8c22\u8c22"),
                               ("Done \u2713\u2713\nNext step", "\n", "Done \u2713\u2713")):
        ids = sp.encode(text)
        r = Request([5, 6], len(ids), stop_ids=(sp.eos_id,), stop=(stop,), continues=False)
        for i, t in enumerate(ids):
            if accept(r, [t], sp.decode):
                break
        assert r.finish_reason == "stop" and r.text == before, (text, r.finish_reason, r.text)
        assert sp.decode(r.tokens).endswith(stop), text  # not a token later


@pytest.mark.timeout(120)
def test_special_tokens_are_left_out_of_the_text_and_stop_where_named(hf_dir, tmp_path):
    """A special token the model emits (a chat template's turn marker) was decoded into the answer's text, where
    transformers' pipelines and vLLM leave it out; named as a stop string, it then could never be seen."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    from shardlm.inference import generate_ids
    with serving(hf_dir, max_batch=2) as s:
        ids = s.tok.encode_document("To be or not")
        new = generate_ids(s.model, torch.tensor([ids]), 6)[0].tolist()
    marker = s.tok.tok.id_to_token(new[2])  # made special below: the model emits it third
    where = tmp_path / "special"
    shutil.copytree(hf_dir, where)
    tok = HFTokenizer.from_file(str(where / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(marker, special=True)])
    assert tok.token_to_id(marker) == new[2]
    tok.save(str(where / "tokenizer.json"))
    with serving(where, max_batch=2) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        body = {"prompt": "To be or not", "max_tokens": 6, "temperature": 0}
        want = s.tok.text(ids + new)[len(s.tok.text(ids)):]
        assert completion(c, body) == (want, want) and marker not in want
        r = c.post("/v1/completions", json={**body, "stop": [marker]}).json()["choices"][0]
        assert r["finish_reason"] == "stop" and r["text"] == s.tok.decode(new[:2]), r
    assert s.tok.decode(new).count(marker) >= 1  # decode keeps it: data and templates need the tokens as they are


@pytest.fixture(scope="module")
def srv(hf_dir):
    with serving(hf_dir, max_batch=2) as s:
        yield s


@pytest.mark.timeout(60)
def test_a_model_is_retrieved_by_its_id_and_a_wrong_method_is_told_the_right_one(srv):
    """OpenAI's GET /v1/models/{model} (the client's models.retrieve) was a 404 for every id; a 405 left out the
    Allow header that HTTP asks of it."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="any", timeout=TIMEOUT, max_retries=0)
    model = client.models.retrieve("base")
    assert model.id == "base" and model.object == "model" and model.owned_by == "shardlm"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert c.get("/v1/models/", follow_redirects=True).json()["data"][0]["id"] == "base"
        r = c.get("/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                     "text/plain;version=0.0.4;q=0.3,*/*;q=0.2")  # what Prometheus 3 scrapes with


@pytest.mark.timeout(60)
def test_metrics_are_prometheus_text_to_a_prometheus_scraper_and_json_to_everyone_else(srv):
    """/metrics answered JSON to Prometheus too, whose scrape failed on it."""
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        assert c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2}).status_code == 200
        scraped = c.get("/metrics", headers={"accept": PROMETHEUS_ACCEPT})
        as_json = c.get("/metrics").json()
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = scraped.text.splitlines()
    samples = dict(line.split(" ") for line in lines if not line.startswith("#"))
    types = {line.split()[2]: line.split()[3] for line in lines if line.startswith("# TYPE ")}
    assert set(samples) == set(types) and len(samples) == len(as_json)
    assert types["shardlm_requests_total"] == "counter" and types["shardlm_tokens_generated_total"] == "counter"
    assert types["shardlm_slots_in_use"] == "gauge" and samples["shardlm_draining"] == "0"
    assert float(samples["shardlm_requests_finished_total"]) == as_json["requests_finished"] >= 1
    assert all(float(v) >= 0 for v in samples.values())


@pytest.mark.timeout(60)
def test_a_forced_tool_call_or_audio_is_refused_and_a_wrong_model_comes_first(srv):
    """tool_choice "required" (or a named function), function_call, and audio output were answered 200 with
    plain text, the client told nothing; their neutral values pass (asked of /v1/completions here, whose checks
    are chat's: this model has no chat template). A completion with a wrong model and a malformed prompt was
    told of the prompt, where a chat is told of the model (404) first. vLLM's stream_options.continuous_usage_stats
    is refused too."""
    chat = {"prompt": "weather?", "max_tokens": 2}
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        for param, value in [("tool_choice", "required"), ("tool_choice", {"type": "function", "function": {
                "name": "get_weather"}}), ("function_call", {"name": "get_weather"}),
                ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"})]:
            r = c.post("/v1/completions", json={**chat, param: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
        for param, value in [("tool_choice", "auto"), ("tool_choice", "none"), ("modalities", ["text"]),
                             ("parallel_tool_calls", False)]:
            assert c.post("/v1/completions", json={**chat, param: value}).status_code == 200, param
        streamed = {**chat, "stream": True}  # vLLM's per-chunk usage, which was streamed without it
        r = c.post("/v1/completions", json={**streamed, "stream_options": {"continuous_usage_stats": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text
        assert c.post("/v1/completions", json={**streamed, "stream_options": {"include_usage": True,
                                                                            "continuous_usage_stats": False}}
                      ).status_code == 200
        for route, body in [("/v1/completions", {"prompt": 5}), ("/v1/chat/completions", {"messages": 5})]:
            r = c.post(route, json={**body, "model": "nope"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", (route, r.text)


NAMED = "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n{% endfor %}"


@pytest.mark.timeout(120)
def test_a_messages_name_reaches_the_template_and_a_tool_call_is_refused(hf_dir, tmp_path):
    """Every message reached the template as its role and content only: a name was dropped and an assistant's
    tool calls became an empty turn, both answered 200. A name is rendered; tool calls are refused, and the empty
    keys the openai SDK echoes with an earlier answer (refusal, tool_calls null) pass."""
    with serving(with_template(hf_dir, tmp_path / "named", NAMED), max_batch=2) as s, \
            httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        def prompt_tokens(messages):
            r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]
        hi = {"role": "user", "content": "hi"}
        assert prompt_tokens([{**hi, "name": "alice"}]) > prompt_tokens([hi])
        echoed = {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": None, "annotations": []}
        assert prompt_tokens([hi, echoed, hi]) == prompt_tokens([hi, {"role": "assistant", "content": "yo"}, hi])
        call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        r = c.post("/v1/chat/completions", json={"messages": [hi, {**echoed, "content": None, "tool_calls": call}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls", r.text
        r = c.post("/v1/chat/completions", json={"messages": [{**hi, "name": 5}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].name", r.text
        # content parts are lines of one message, as vLLM joins them (they ran together into one word)
        parts = [{"type": "text", "text": "To be"}, {"type": "text", "text": "or not"}]
        assert prompt_tokens([{"role": "user", "content": parts}]) == \
            prompt_tokens([{"role": "user", "content": "To be\nor not"}])


@pytest.mark.timeout(120)
def test_a_prompt_the_tokenizer_cannot_encode_is_a_400(hf_dir, tmp_path):
    """A word a WordLevel tokenizer without its unk_token cannot map: the library's bare Exception was a 500 naming
    an internal error, the client's text at fault."""
    from test_data_prepare_audit import _word_level
    where = tmp_path / "m"
    shutil.copytree(hf_dir, where, ignore=shutil.ignore_patterns("tokenizer*"))
    _word_level(tmp_path / "tok", {"a": 0, "hello": 1, "world": 2, "</s>": 3})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "tok" / name, where / name)
    with serving(where, max_batch=2) as s, httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        assert c.post("/v1/completions", json={"prompt": "hello a", "max_tokens": 1}).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hello zebra", "max_tokens": 1})
        assert r.status_code == 400 and "cannot encode this text" in r.json()["error"]["message"], r.text
