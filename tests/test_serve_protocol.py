"""`shardlm serve` against what OpenAI-compatible clients send and read: chat templates as transformers renders
them, streamed text against the whole answer, and the API's smaller routes and headers. Over real HTTP on
127.0.0.1, against a server in this process (test_serve.serving)."""
import json
import shutil

import pytest

from test_serve import CHAT_TEMPLATE, TIMEOUT, serving, sse
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
