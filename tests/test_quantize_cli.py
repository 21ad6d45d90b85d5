"""`--quantize int8|int4` through the commands, end to end on the CPU: `generate`, `eval` (the loss task and the
text tasks) and `serve` (over HTTP) on a tiny Llama trained on a text, each answer checked against the library
path on the same quantised model, and eval's perplexity against the README's bounds (int8 within 1% of the
unquantised model's, int4 within 5%)."""
import json
import threading
import time

import pytest
import torch

from helpers import TEXT, cli_here
from shardlm.generation_config import stop_ids_of
from shardlm.inference import Engine, Request, evaluate_ids, generate_many, load_pretrained, prompt_ids
from shardlm.inference.quantize import quantize

KINDS = ["int8", "int4"]  # both shardlm's own kernels and layouts (inference/int8.py, int4.py)
BOUND = {"int8": 0.01, "int4": 0.05}  # README: held-out perplexity within 1% (int8) and 5% (int4)
LINEARS = {"int8": 8, "int4": 8}  # 4 linears in each of 2 blocks (the output head, in int8 for both, not counted)
PROMPTS = ["To be, or not", "whether 'tis nobler", "the slings and arrows of"]
TIMEOUT = 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The `tiny` Llama (byte tokenizer) trained a few seconds on 80% of TEXT, as an HF directory, and the
    other 20% as a text file: a model whose perplexity means something, so that the bounds do too."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    from shardlm.model.hf import write_hf_dir
    from shardlm.tokenizer import load_tokenizer
    cfg, tok = load_config("tiny").model, load_tokenizer("byte")
    text = TEXT[:6000]
    split = int(len(text) * 0.8)
    ids = torch.tensor(tok.encode(text[:split]))
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        batch = torch.stack([ids[s:s + 65] for s in torch.randint(0, len(ids) - 65, (16,), generator=g).tolist()])
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 2.5  # it has learnt something: bytes alone are ln(512) = 6.2
    d = tmp_path_factory.mktemp("quantize_cli")
    write_hf_dir(model.state_dict(), cfg, d / "hf", tok)
    (d / "held.txt").write_text(text[split:])
    return d


@pytest.fixture
def spied(monkeypatch):
    """Every quantize() call a command makes: (kind, how many linears it quantised). A flag the command dropped
    on its way would leave this empty, whatever the output."""
    import shardlm.inference.quantize as module
    calls = []

    def spy(model, kind):
        n = quantize(model, kind)
        calls.append((kind, n))
        return n
    monkeypatch.setattr(module, "quantize", spy)
    return calls


def quantised(path, kind):
    model, tok, cfg = load_pretrained(path)
    assert quantize(model, kind) == LINEARS[kind]
    return model, tok, cfg


def engine_texts(model, tok, prompts, n):
    """The engine's greedy completions, each prompt alone, stopped where the commands stop them."""
    out = []
    for p in prompts:
        (r,) = Engine(model, 1, 64, decode=tok.decode).run([Request(prompt_ids(tok, p), n, stop_ids=stop_ids_of(tok))])
        out.append(r.text)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_generate_quantised_gives_the_engines_tokens_on_the_quantised_model(trained, tmp_path, capsys, spied, kind):
    """`generate --quantize K`: --prompt's completion, and an --input file's, are the engine's greedy ones on the
    model quantised in process (not the unquantised model's: the command quantised what it loaded)."""
    hf = trained / "hf"
    model, tok, _ = quantised(hf, kind)
    want = engine_texts(model, tok, PROMPTS, 16)
    assert all(want)
    got = json.loads(cli_here(capsys, "generate", "--model", hf, "--prompt", PROMPTS[0], "--max-new-tokens", 16,
                              "--quantize", kind, "--json"))["completion"]
    assert got == want[0]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cli_here(capsys, "generate", "--model", hf, "--input", src, "--output", out, "--max-new-tokens", 16,
             "--quantize", kind, "--max-batch", 2)
    assert [json.loads(x)["completion"] for x in out.read_text().splitlines()] == want
    assert spied == [(kind, LINEARS[kind])] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_eval_quantised_perplexity_is_within_the_readmes_bound(trained, capsys, spied, kind):
    """`eval --quantize K` of the held-out text: the perplexity of the library path (evaluate_ids on the model
    quantised in process), within the README's bound of the unquantised command's, and not equal to it."""
    hf, held = trained / "hf", trained / "held.txt"
    args = ["eval", "--model", hf, "--data", held, "--seq-len", 64, "--json"]
    base = json.loads(cli_here(capsys, *args))
    got = json.loads(cli_here(capsys, *args, "--quantize", kind))
    assert spied == [(kind, LINEARS[kind])]  # the unquantised command quantises nothing
    model, tok, _ = quantised(hf, kind)
    lib = evaluate_ids(model, tok.encode_document(held.read_text()), 64)
    assert got["tokens"] == base["tokens"] == lib["tokens"]
    assert got["perplexity"] == pytest.approx(lib["perplexity"], rel=1e-5)
    assert base["perplexity"] < 20  # trained: far below the 512 of a uniform guess
    assert got["perplexity"] != base["perplexity"]
    assert abs(got["perplexity"] / base["perplexity"] - 1) < BOUND[kind], (got, base)


@pytest.mark.parametrize("kind", KINDS)
def test_eval_text_tasks_quantised_score_the_quantised_models_completions(trained, tmp_path, capsys, spied, kind):
    """`eval --tasks bleu --quantize K`: its completions are generate_many's on the model quantised in process."""
    pytest.importorskip("sacrebleu")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": "that is the question"}) + "\n" for p in PROMPTS))
    r = json.loads(cli_here(capsys, "eval", "--model", trained / "hf", "--tasks", "bleu", "--data", data,
                            "--max-new-tokens", 12, "--quantize", kind, "--json"))
    assert spied == [(kind, LINEARS[kind])]
    model, tok, _ = quantised(trained / "hf", kind)
    new = generate_many(model, [prompt_ids(tok, p) for p in PROMPTS], 12, stop_ids_of(tok))
    assert r["completions"] == [tok.decode(ids) for ids in new] and all(r["completions"])


@pytest.mark.parametrize("kind", KINDS)
def test_serve_quantised_answers_completions_over_http(trained, monkeypatch, spied, kind):
    """`shardlm serve --quantize K` (the command, in this process, on a free port): a greedy completion over HTTP,
    whole and streamed, is the engine's on the model quantised in process. (No capsys: the server's log handlers
    would keep its stream, closed after the test, and a later server's log line would write into it.)"""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from shardlm.cli import main
    from shardlm.serve import command
    built, real = [], command.build_server

    def building(*args, **kwargs):
        server, worker = real(*args, **kwargs)
        built.append(server)
        return server, worker
    monkeypatch.setattr(command, "build_server", building)
    hf = trained / "hf"
    code = []
    thread = threading.Thread(target=lambda: code.append(main(["serve", "--model", str(hf), "--port", "0",
                                                                "--max-batch", "2", "--quantize", kind,
                                                                "--log-level", "warning"])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # loading and quantising first, on a machine shared with other tests
    try:
        while not (built and built[0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{built[0].servers[0].sockets[0].getsockname()[1]}"
        model, tok, _ = quantised(hf, kind)
        want = engine_texts(model, tok, PROMPTS[:2], 12)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[0] != ""
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12,
                                                           "temperature": 0, "stream": True}) as s:
                data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            assert data[-1] == "[DONE]"
            assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]
                           if json.loads(d)["choices"]) == want[1]
    finally:  # a server that started is stopped, whatever failed: none outlives its test
        if built:
            built[0].should_exit = True
        thread.join(60)
    assert code == [0] and spied == [(kind, LINEARS[kind])]


@pytest.mark.parametrize("kind", KINDS)
def test_a_quantised_load_holds_one_block_in_16_bits_at_a_time(trained, monkeypatch, kind):
    """--quantize loaded the whole 16-bit model onto the device, then quantised it: a 70B model that fits a GPU
    in int4 (35 GB, as `plan --inference --quantize int4` says) ran out of memory on the way. Each block is
    quantised as it is filled, the blocks after it not yet made; the model is the one quantised after loading."""
    import shardlm.inference.quantize as module
    from torch import nn
    import shardlm.inference.load as load
    seen, built, quantize_block, decoder = [], [], module.quantize_block, load.Decoder

    def watched(block, kind_, kept):  # the 16-bit linears made so far, per block
        seen.append([sum(isinstance(m, nn.Linear) and m.weight.device.type != "meta" for m in b.modules())
                     for b in built[0].blocks()])
        return quantize_block(block, kind_, kept)

    def remembered(cfg):
        built.append(decoder(cfg))
        return built[-1]
    monkeypatch.setattr(module, "quantize_block", watched)
    monkeypatch.setattr(load, "Decoder", remembered)
    model, tok, _ = load_pretrained(trained / "hf", quantize=kind)
    assert seen == [[4, 0], [0, 4]], seen  # the block being quantised alone in 16 bits, the next not yet made
    ref, _, _ = quantised(trained / "hf", kind)
    ids = torch.tensor([prompt_ids(tok, PROMPTS[0])])
    torch.testing.assert_close(model(ids), ref(ids), rtol=0, atol=0)
