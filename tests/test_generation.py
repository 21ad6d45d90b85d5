"""The fast decode path (shardlm.inference.Engine): a static KV cache of slots, a compiled decode step,
mixed-length and continuous batching, per-request sampling, stops, and `shardlm generate --input`."""
import dataclasses
import json
import re
import warnings

import pytest
import torch

import dist_fns
from helpers import cli_here, cli_proc, run_cli, save_hf
from shardlm.config import load_config
from shardlm.inference import Engine, Request, SamplingParams, generate_ids, generate_many
from shardlm.inference.sampler import sample
from shardlm.model import build_model


def tiny(arch="llama", **changes):
    # A larger init than the default's 0.02 keeps random logits away from ties that rounding could flip.
    cfg = dataclasses.replace(load_config("tiny").model, arch=arch, init_std=0.2, **changes)
    return build_model(cfg, seed=3).eval()


def prompts_of(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy_full_forward(model, prompt, n):
    """Greedy decoding the slowest way: the whole sequence through the model for every new token."""
    ids = torch.tensor([prompt])
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


CASES = {"llama_gqa": dict(num_kv_heads=2), "gpt2": dict(arch="gpt2"), "mistral_window": dict(sliding_window=6)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_static_cache_decode_equals_the_full_forward(case):
    """The compiled step (torch.compile on the CPU; CUDA graphs on a GPU) over the static cache, token for
    token; prompts shorter and longer than Mistral's window, decoding past it."""
    model = tiny(**CASES[case])
    prompts = prompts_of((3, 11, 7))
    want = [greedy_full_forward(model, p, 14) for p in prompts]
    engine = Engine(model, max_batch=2, max_len=32, compile=True, sync_every=4)
    got = engine.run([Request(p, 14) for p in prompts])
    assert [r.tokens for r in got] == want


@pytest.mark.parametrize("what,options", [("prefill", dict(compile=False, compile_prefill=True)),
                                          ("the decode step", dict(compile=True, compile_prefill=False))])
def test_what_the_compiler_cannot_take_runs_eagerly_with_a_warning(monkeypatch, what, options):
    from torch._dynamo.exc import Unsupported
    model = tiny(**CASES["llama_gqa"])
    prompts = prompts_of((3, 11, 7))
    want = [greedy_full_forward(model, p, 6) for p in prompts]

    def failing(*args, **kwargs):
        raise Unsupported("a weight type the compiler does not know")
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: failing)
    engine = Engine(model, max_batch=2, max_len=32, **options)
    with pytest.warns(UserWarning, match=f"{what} runs eagerly: compiling it failed"):
        got = engine.run([Request(p, 6) for p in prompts])
    assert [r.tokens for r in got] == want


def counting_compiles(monkeypatch) -> list:
    """torch.compile made to record each graph the compiler traces (run as traced: no code generated) in the
    list returned, with the dynamic and fullgraph options the caller gave."""
    graphs, real = [], torch.compile

    def counting(fn, **options):
        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward
        return real(fn, backend=backend, dynamic=options.get("dynamic"), fullgraph=options.get("fullgraph", False))
    monkeypatch.setattr(torch, "compile", counting)
    return graphs


def test_a_decode_step_past_dynamos_recompile_limit_runs_eagerly_with_a_warning(monkeypatch):
    """A step shape past Dynamo's recompile limit (fullgraph: FailOnRecompileLimitHit, not a Dynamo error) does
    not fail the step, and so every request in it: the step runs eagerly from then on, with a warning."""
    counting_compiles(monkeypatch)
    torch._dynamo.reset()
    model = tiny(**CASES["llama_gqa"])
    engine = Engine(model, max_batch=2, max_len=48, compile=True, compile_prefill=False)
    # torch's own patch, not monkeypatch: pytest 9.2's undo deletes what a module's __getattr__ gave, which hides
    # a Dynamo config entry for the rest of the process (every later compile then fails on it)
    with torch._dynamo.config.patch(recompile_limit=1):  # room for one shape: one row
        prompts = prompts_of((5, 9))
        want = [greedy_full_forward(model, p, 4) for p in prompts]
        alone = engine.run([Request(prompts[0], 4)])
        with pytest.warns(UserWarning, match="the decode step runs eagerly: compiling it failed"):
            together = engine.run([Request(p, 4) for p in prompts])
    assert [alone[0].tokens] + [r.tokens for r in together] == [want[0]] + want
    torch._dynamo.reset()


@pytest.mark.parametrize("slots,prefill_graphs", [(4, 0), (6, 64)])
def test_after_the_warm_up_serving_compiles_no_prefill_again(slots, prefill_graphs, monkeypatch):
    """worker.warm_up_batches compiles every class of prefill shapes serving meets (one row and several, a first
    chunk and a later one): prompts of other lengths, alone, three and six at a time, chunked or not, then run on
    the graphs it made, and the tokens are eager prefill's. With prefill graphs (padded, uncaptured on a CPU) a
    few prompts prefill one at a time, six in one pass."""
    from shardlm.serve.worker import warm_up_batches
    graphs = counting_compiles(monkeypatch)
    torch._dynamo.reset()  # nothing compiled before (another case's graphs) serves this one
    model = tiny(**CASES["llama_gqa"])
    engine = Engine(model, max_batch=slots, max_len=48, compile=False, compile_prefill=True, prefill_chunk=8,
                    prefill_graphs=prefill_graphs)
    for batch in warm_up_batches(engine):
        engine.run(batch)
    warmed = len(graphs)
    prompts = prompts_of((5, 13, 30, 2, 9, 21))
    got = [r.tokens for r in engine.run([Request(p, 4) for p in prompts[:1]])]
    got += [r.tokens for r in engine.run([Request(p, 4) for p in prompts[1:4]])]
    got += [r.tokens for r in engine.run([Request(p, 4) for p in prompts[4:]])]
    got += [r.tokens for r in engine.run([Request(p, 4) for p in prompts])]
    assert warmed >= 2 and len(graphs) == warmed
    eager = Engine(model, max_batch=3, max_len=48, compile=False, compile_prefill=False, prefill_chunk=8)
    assert got == [r.tokens for r in eager.run([Request(p, 4) for p in prompts + prompts])]


def test_after_the_warm_up_serving_compiles_no_decode_step_again(monkeypatch):
    """warm_up_batches runs the greedy and the sampling decode step over every slot and over the one row a
    request alone in the first slot steps as: requests alone and together, greedy and sampled, then compile
    nothing new, and give eager decoding's tokens."""
    from shardlm.serve.worker import warm_up_batches
    graphs = counting_compiles(monkeypatch)
    torch._dynamo.reset()
    model = tiny(**CASES["llama_gqa"])
    engine = Engine(model, max_batch=3, max_len=48, compile=True, compile_prefill=False, prefill_chunk=8)
    for batch in warm_up_batches(engine):
        engine.run(batch)
    warmed = len(graphs)

    def requests(prompts):
        return [Request(p, 5, SamplingParams(0.8, seed=i) if i % 2 else SamplingParams()) for i, p in enumerate(prompts)]
    prompts = prompts_of((5, 13, 2, 9))
    runs = [prompts[:1], prompts[1:2], prompts[:2], prompts[1:]]
    got = [[r.tokens for r in engine.run(requests(p))] for p in runs]
    assert warmed == 4 and len(graphs) == warmed
    eager = Engine(model, max_batch=3, max_len=48, compile=False)
    assert got == [[r.tokens for r in eager.run(requests(p))] for p in runs]


def test_after_the_warm_up_no_key_bucket_compiles_a_decode_step_again(monkeypatch):
    """warm_up_batches runs the greedy and the sampling step at one row and every slot in every key bucket
    (Engine._keys), so that requests of any length, alone and together, compile nothing new (before, only the
    bucket of its one prompt length); and the key count is dynamic, so that the buckets short of the whole
    cache share their compiles: at most two a step and row count, whatever the context."""
    from shardlm.serve.worker import warm_up_batches
    graphs = counting_compiles(monkeypatch)
    torch._dynamo.reset()
    model = tiny(**CASES["llama_gqa"], max_seq_len=1100)
    engine = Engine(model, max_batch=3, max_len=1100, compile=True, compile_prefill=False, prefill_chunk=64)
    buckets = {engine._keys(2 ** i) for i in range(12)}
    assert buckets == {512, 1024, 1101}
    for batch in warm_up_batches(engine):
        engine.run(batch)
    warmed = len(graphs)
    for n in (5, 700, 1095):
        prompt = prompts_of((n,))[0]
        engine.run([Request(prompt, 3)])
        engine.run([Request(prompt, 3, SamplingParams(0.8, seed=1))])
        engine.run([Request(prompt, 3), Request(prompt[:7], 3)])
        engine.run([Request(prompt, 3, SamplingParams(0.8, seed=1)), Request(prompt[:7], 3)])
    assert warmed <= 8 and len(graphs) == warmed
    torch._dynamo.reset()


def test_replicas_in_one_process_compile_every_decode_shape(monkeypatch):
    """Data-parallel replicas (serve --replicas) are engines of one process whose steps share their code objects,
    and Dynamo counts every engine's graphs against one limit (it does not tell the engines apart by identity):
    two engines' steps in every key bucket, at one row and every slot, all compile, none failing the step
    (with fullgraph, a step past the limit raised FailOnRecompileLimitHit, which is not a compile error the
    engine falls back from) and none falling back to eager."""
    import shardlm.inference.compiled as compiled
    graphs = counting_compiles(monkeypatch)
    # A limit of one graph a code object, and no shapes counted before: the engines' graphs (two each now that the
    # key count is dynamic) compile only as far as CompiledOrEager raises the limit for every engine's shapes.
    monkeypatch.setattr(compiled, "_SHAPES", {})
    limits = {n: 1 for n in ("recompile_limit", "accumulated_recompile_limit") if hasattr(torch._dynamo.config, n)}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**limits), warnings.catch_warnings(record=True) as said:  # as above: not monkeypatch
        engines = [Engine(tiny(**CASES["llama_gqa"], max_seq_len=2048), max_batch=2, max_len=2048, compile=True,
                          compile_prefill=False) for _ in range(2)]
        warnings.simplefilter("always")
        for e in engines:  # prompts whose bursts read 512, 1024, 2048 and all 2049 cached positions
            for n in (5, 600, 1500, 2040):
                prompt = prompts_of((n,))[0]
                e.run([Request(prompt, 3)])
                e.run([Request(prompt, 3), Request(prompt[:9], 3)])
    assert not [w for w in said if "runs eagerly" in str(w.message)], [str(w.message) for w in said]
    assert 2 < len(graphs) <= 2 * 2 * 2
    torch._dynamo.reset()


def test_prompts_attend_through_kernels_without_per_shape_plans(monkeypatch):
    """cuDNN's attention (SDPA's choice on Hopper) builds a plan for every new shape, tens to hundreds of
    milliseconds, and prompts come in every length: a prompt's attention runs with it disabled, and only there
    (training keeps SDPA's choice)."""
    real, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    engine = Engine(tiny(), max_batch=2, max_len=32, compile=False)
    engine.run([Request(p, 3) for p in prompts_of((5, 9))])
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    from shardlm.inference.slots import WITHOUT_CUDNN_ATTENTION as off  # engines on threads interleave
    first, second = off, off
    first.__enter__(), second.__enter__()
    first.__exit__(None, None, None)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    second.__exit__(None, None, None)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral_window", "gpt2"])
def test_the_engine_equals_transformers_greedy(kind, tmp_path):
    """Three prompts in one batch, 20 new tokens (past Mistral's window of 8), against HF's generate alone."""
    from shardlm.inference import load_pretrained
    ref = save_hf(kind, tmp_path)
    model, tok, _ = load_pretrained(tmp_path)
    prompts = [tok.encode(t) for t in ("To be", "To be, or not to be, that is the question", "whether")]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    got = Engine(model, 3, 64).run([Request(p, 20) for p in prompts])
    assert [r.tokens for r in got] == want


@pytest.mark.parametrize("kind", ["llama3", "llama_linear", "qwen2_window", "mistral_window", "gpt2", "mixtral"])
def test_chunks_across_the_window_and_reused_slots_equal_transformers(kind, tmp_path):
    """A prompt that fills the model's context (128 positions) with its new tokens, then short ones in the slot
    it held (its keys past their lengths stale there), prompts prefilled 5 tokens at a time across the window
    of 8: each request's tokens are transformers' generate alone, and one slot gives those of several."""
    from shardlm.inference import load_pretrained
    ref = save_hf(kind, tmp_path)
    model, _, _ = load_pretrained(tmp_path)
    prompts = prompts_of((110, 3, 21, 1), vocab=300, seed=1)
    want = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=18,
                         do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    for slots in (1, 2):
        engine = Engine(model, max_batch=slots, prefill_chunk=5, sync_every=3)
        assert engine.max_len == 128
        assert [r.tokens for r in engine.run([Request(p, 18) for p in prompts])] == want, slots


@pytest.mark.parametrize("case", list(CASES))
def test_a_mixed_length_batch_equals_each_prompt_alone(case):
    model = tiny(**CASES[case])
    prompts = prompts_of((3, 5, 5, 12, 1, 9, 20))
    alone = [generate_ids(model, torch.tensor([p]), 12)[0].tolist() for p in prompts]
    for batch in (1, 3, 8):
        assert generate_many(model, prompts, 12, batch_size=batch) == alone, batch
    # Stopping at a token some rows produce mid-way: those end before it, the others run on.
    eos = alone[3][4]
    cut = [a[:a.index(eos)] if eos in a else a for a in alone]
    assert any(len(c) < 12 for c in cut) and any(len(c) == 12 for c in cut)
    assert generate_many(model, prompts, 12, stop_ids=(eos,), batch_size=3) == cut


def test_continuous_batching_with_requests_arriving_mid_decode():
    """Two slots, long prompts prefilled 4 tokens at a time between the others' decode steps, requests
    submitted while others decode: each request gets the tokens it gets alone, and leaves when done."""
    model = tiny(num_kv_heads=2)
    prompts = prompts_of((9, 2, 15, 4, 6))
    budgets = [10, 3, 8, 12, 5]
    alone = [generate_ids(model, torch.tensor([p]), n)[0].tolist() for p, n in zip(prompts, budgets)]
    engine = Engine(model, max_batch=2, max_len=40, sync_every=2, prefill_chunk=4, prefill_tokens=4)
    requests = [Request(p, n, tag=i) for i, (p, n) in enumerate(zip(prompts, budgets))]
    finished = []
    for r in requests[:2]:
        engine.submit(r)
    while not requests[0].tokens:
        finished += engine.step()
    assert not requests[0].done  # the first is decoding when the others arrive
    for r in requests[2:]:
        engine.submit(r)
    while engine.busy:
        finished += engine.step()
    assert [r.tokens for r in requests] == alone
    assert finished[0].tag == 1  # the short one left first, while the others went on
    assert all(r.finish_reason == "length" for r in requests)


def test_a_cancelled_request_frees_its_slot():
    model = tiny()
    prompts = prompts_of((5, 7, 3))
    alone = [generate_ids(model, torch.tensor([p]), 12)[0].tolist() for p in prompts]
    engine = Engine(model, max_batch=2, max_len=32, sync_every=2)
    a, b, c = (engine.submit(Request(p, 12)) for p in prompts)
    while not a.tokens:
        engine.step()
    a.cancel()
    c.cancel()  # still waiting: it never takes a slot
    finished = engine.step()
    assert a in finished and c in finished and a.finish_reason == c.finish_reason == "cancelled"
    assert a.tokens == alone[0][:len(a.tokens)] and not c.tokens
    d = engine.submit(Request(prompts[2], 12))  # takes the slot a left
    while engine.busy:
        engine.step()
    assert b.tokens == alone[1] and d.tokens == alone[2]
    with pytest.raises(ValueError, match="unknown adapter 'x'"):
        engine.submit(Request(prompts[0], 4, adapter="x"))


def test_a_fault_of_the_fused_all_reduce_stops_the_engine_at_its_next_burst():
    """The one-row product and all-reduce kernel of a tensor-parallel model (inference/one_shot.py gives its
    row-parallel linears one) records a program that gave up waiting for its peer, whose sum is then wrong:
    the engine checks it after each burst's tokens reach the host and raises its report, never passing on
    tokens from a wrong sum. Here a stand-in for the kernel's object reports a fault at the second check."""
    from types import SimpleNamespace
    checks = []

    def check():
        checks.append(1)
        if len(checks) == 2:
            raise RuntimeError("the LL all-reduce gave up waiting: program 3 awaited its peer's call 9")

    model = tiny()
    model.norm.small_all_reduce = SimpleNamespace(fused=SimpleNamespace(check=check))
    engine = Engine(model, max_batch=1, max_len=32, sync_every=2)
    with pytest.raises(RuntimeError, match="gave up waiting: program 3"):
        engine.run([Request(prompts_of((5,))[0], 12)])
    assert len(checks) == 2


def random_adapter(base, out, rank, targets, seed):
    """A PEFT adapter directory for the HF model in `base`, every A and B drawn at random (B is zero at init)."""
    from shardlm.config import LoRAConfig
    from shardlm.inference import load_pretrained
    from shardlm.parallel.lora import apply_lora, write_peft_dir
    model, _, cfg = load_pretrained(base)
    lora = LoRAConfig(rank=rank, alpha=2 * rank, targets=targets)
    apply_lora(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    write_peft_dir(model.state_dict(), cfg, lora, out)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_padded_for_graphs_gives_the_tokens_of_each_prompt_alone(case):
    """Prefill passes padded to their graphs' lengths (on a CPU the padded shapes run without capture):
    first chunks and later ones through the cache, a window shorter than the prompts; a few rows as one-row
    passes (3 slots), more in one pass (6); each request gets the tokens it gets alone, unpadded. Passes over
    the limit run as they are."""
    model = tiny(**CASES[case])
    prompts = prompts_of((9, 2, 15, 4, 6, 13))
    alone = [generate_ids(model, torch.tensor([p]), 7)[0].tolist() for p in prompts]
    for limit, slots in ((64, 3), (64, 6), (12, 6)):
        engine = Engine(model, max_batch=slots, max_len=40, sync_every=3, prefill_chunk=5, prefill_graphs=limit)
        assert [r.tokens for r in engine.run([Request(p, 7) for p in prompts])] == alone, (limit, slots)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_adapters_per_row_equal_each_merged_alone(kind, tmp_path):
    """Two PEFT adapters (other ranks and targets) served over one base, rows of one batch each with its own
    or none: each gives the tokens of its adapter merged into the base, decoded alone."""
    from shardlm.inference import load_pretrained
    save_hf(kind, tmp_path / "base")
    targets = "all-linear" if kind == "llama" else "c_attn,c_fc"
    dirs = {"wide": random_adapter(tmp_path / "base", tmp_path / "a", 4, targets, 1),
            "narrow": random_adapter(tmp_path / "base", tmp_path / "b", 8, "q_proj,v_proj" if kind == "llama"
                                     else "c_proj", 2)}
    prompts = prompts_of((6, 3, 9, 4), vocab=300)
    model, _, _ = load_pretrained(tmp_path / "base")
    engine = Engine(model, max_batch=4, max_len=32)
    for name, d in dirs.items():
        engine.add_adapter(name, d)
    choice = ["wide", "narrow", None, "wide"]
    got = engine.run([Request(p, 10, adapter=a) for p, a in zip(prompts, choice)])
    for p, a, r in zip(prompts, choice, got):
        ref, _, _ = load_pretrained(tmp_path / "base", adapter=dirs[a] if a else None)
        assert r.tokens == generate_ids(ref, torch.tensor([p]), 10)[0].tolist(), a
    assert got[0].tokens != got[2].tokens  # the adapters change the model


def test_sampling_is_reproducible_per_request_whatever_the_batch():
    model = tiny(num_kv_heads=2)
    prompts = prompts_of((4, 9, 2, 6))
    settings = [SamplingParams(1.0, 20, 0.9, seed=11), SamplingParams(0.7, 0, 1.0, seed=5),
                SamplingParams(0.0), SamplingParams(1.3, 5, 1.0, seed=11)]

    def run(order, slots):
        engine = Engine(model, max_batch=slots, max_len=32)
        reqs = {i: Request(prompts[i], 10, settings[i]) for i in order}
        engine.run([reqs[i] for i in order])
        return {i: r.tokens for i, r in reqs.items()}

    alone = {i: run([i], 1)[i] for i in range(4)}
    assert run([0, 1, 2, 3], 4) == alone
    assert run([3, 1, 0, 2], 2) == alone
    assert alone[2] == generate_ids(model, torch.tensor([prompts[2]]), 10)[0].tolist()  # temperature 0: greedy
    other = run([0], 1) | run([1], 1)
    assert other == {0: alone[0], 1: alone[1]}
    reseeded = Engine(model, max_batch=1, max_len=32).run([Request(prompts[0], 10, SamplingParams(1.0, 20, 0.9, 12))])
    assert reseeded[0].tokens != alone[0]
    with torch.no_grad():  # request 3 draws from its top 5 at every step
        logits = model(torch.tensor([prompts[3] + alone[3]]))[0, len(prompts[3]) - 1:-1]
    assert all(t in row for t, row in zip(alone[3], logits.topk(5, -1).indices.tolist()))


def test_the_sampler_draws_from_the_softmax():
    """Gumbel-max over hashed noise: 40,000 draws (one per position) against softmax(logits / T) after
    top-k and top-p, within four standard errors."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40_000
    rows = logits.expand(n, -1)
    counter = torch.arange(n)

    def freq(t, k, p):
        full = lambda v, dtype=torch.float32: torch.full((n,), v, dtype=dtype)
        got = sample(rows, full(t), full(k, torch.long), full(p), full(7, torch.long), counter)
        return torch.bincount(got, minlength=6).double() / n

    want = (logits / 0.8).softmax(-1).double()
    assert torch.allclose(freq(0.8, 0, 1.0), want, atol=4 * (0.25 / n) ** 0.5)
    top3 = torch.zeros(6, dtype=torch.double)
    top3[:3] = (logits[:3] / 0.8).softmax(-1)
    assert torch.allclose(freq(0.8, 3, 1.0), top3, atol=4 * (0.25 / n) ** 0.5)
    # top-p 0.8 of softmax(logits) = 0.56, 0.21, 0.13, ...: the smallest prefix reaching 0.8 has three
    probs = logits.softmax(-1).double()
    nucleus = torch.zeros(6, dtype=torch.double)
    nucleus[:3] = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq(1.0, 0, 0.8), nucleus, atol=4 * (0.25 / n) ** 0.5)
    assert torch.equal(freq(1.0, 0, 1e-6), torch.tensor([1.0, 0, 0, 0, 0, 0], dtype=torch.double))


@pytest.mark.parametrize("compile", [False, True])
def test_the_engine_never_draws_a_row_past_the_tokenizers_vocabulary(compile):
    """A model's vocabulary padded past its tokenizer's (Qwen2.5: 151936 rows for 151665 tokens) drew those rows
    like any other, tokens that decode to nothing; given the tokenizer's size, the engine draws only its ids, at
    temperature 0 and above, in prefill and decode."""
    model = tiny()
    vocab = model.cfg.vocab_size - 16
    with torch.no_grad():
        model.head_weight[vocab:] = model.head_weight[:vocab].abs().mean() * 50  # the padding rows' logits lead
    requests = [Request([5, 6, 7], 6, SamplingParams(t, 0, 1.0, 1)) for t in (0.0, 1.0)]
    Engine(model, max_batch=2, max_len=32, compile=compile).run(requests)
    assert all(max(r.completion) >= vocab for r in requests)  # as they were drawn without a limit
    requests = [Request([5, 6, 7], 6, SamplingParams(t, 0, 1.0, 1)) for t in (0.0, 1.0)]
    Engine(model, max_batch=2, max_len=32, compile=compile, vocab=vocab).run(requests)
    assert all(len(r.completion) == 6 and max(r.completion) < vocab for r in requests), [r.completion for r in requests]


def test_the_sampler_never_draws_a_token_top_k_removed():
    """The hashed uniform of 24 bits reached exactly 1.0 at its top value (float32 rounds 2^24 - 0.5 up): that
    token's Gumbel noise was +inf, and it was drawn over any logit and through top-k's and top-p's masks
    (-inf + inf is NaN, which argmax picks), one draw in 2^24 per vocabulary id, 0.8% at 128k. Seed 1234 at
    position 25 hashed id 7611 there."""
    from shardlm.inference.sampler import uniform
    vocab = 1 << 17
    logits = torch.zeros(1, vocab)
    logits[0, 3] = 30.0
    one = lambda v, dtype=torch.float32: torch.tensor([v], dtype=dtype)  # noqa: E731
    for top_k, top_p in ((1, 1.0), (0, 0.5), (0, 1.0)):
        got = sample(logits, one(1.0), one(top_k, torch.long), one(top_p), one(1234, torch.long), one(25, torch.long))
        assert got.item() == 3, (top_k, top_p, got)
    u = uniform(torch.tensor([1234]), torch.tensor([25]), torch.arange(vocab)[None])
    assert 0 < u.min() and u.max() < 1


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000, 32000])
def test_the_nucleus_prefix_sums_are_cumsums_in_two_short_scans(n):
    from shardlm.inference.sampler import prefix_sums
    x = torch.rand(3, n, generator=torch.Generator().manual_seed(n)).softmax(-1)
    torch.testing.assert_close(prefix_sums(x), x.cumsum(-1), rtol=1e-5, atol=1e-6)


def test_stop_tokens_and_strings():
    model = tiny()
    prompt = prompts_of((5,))[0]
    alone = generate_ids(model, torch.tensor([prompt]), 16)[0].tolist()
    text = lambda ids: "".join(f"<{i}>" for i in ids)  # one piece per token
    engine = Engine(model, max_batch=2, max_len=32, decode=text)
    by_id, by_string, plain = engine.run([Request(prompt, 16, stop_ids=(alone[6],)),
                                          Request(prompt, 16, stop=(f"<{alone[3]}><{alone[4]}>",)),
                                          Request(prompt, 16)])
    first = alone.index(alone[6])
    assert by_id.tokens == alone[:first + 1] and by_id.completion == alone[:first] and by_id.finish_reason == "stop"
    assert by_string.finish_reason == "stop" and by_string.text == text(alone[:3])
    assert plain.tokens == alone and plain.finish_reason == "length" and plain.text == text(alone)
    with pytest.raises(ValueError, match="exceeds the 32 positions"):
        engine.submit(Request(prompt, 28))
    vocab = model.cfg.vocab_size
    for outside in (vocab, -1):  # a larger tokenizer's id: refused, not an IndexError that ends every row
        with pytest.raises(ValueError, match=rf"must be in \[0, {vocab}\)"):
            engine.submit(Request([*prompt, outside], 4))
    assert not engine.busy


def test_a_stop_string_never_matches_half_a_character():
    """A character's bytes arrive one token at a time, and until the last the text ends in U+FFFD: a stop string
    holding one ended an answer 'é...' at its first byte, with nothing said. It matches only a real one."""
    model = tiny()
    prompt = prompts_of((5,))[0]
    alone = generate_ids(model, torch.tensor([prompt]), 8)[0].tolist()
    assert alone[0] != alone[1]
    byte = {alone[0]: 0xC3, alone[1]: 0xA9}  # 'é' in two tokens; every other token 'b'
    text = lambda ids: bytes(byte.get(i, 0x62) for i in ids).decode("utf-8", errors="replace")  # noqa: E731
    engine = Engine(model, max_batch=1, max_len=32, decode=text)
    [r] = engine.run([Request(prompt, 8, stop=("\ufffd",))])
    assert r.text.startswith("é"), r.text
    assert r.finish_reason == ("stop" if "\ufffd" in text(alone) else "length")


def test_generate_a_jsonl_file(tmp_path, capsys):
    """`generate --input/--output`: one line out per line in, in order, with per-line settings; an existing
    output is kept unless --overwrite."""
    save_hf("llama", tmp_path / "hf")
    lines = [{"prompt": "To be", "id": "a"}, {"prompt": "or not to be, that is", "max_new_tokens": 3},
             {"prompt": "whether", "temperature": 0.9, "seed": 4, "stop": ["e"]}, {"prompt": "x", "max_new_tokens": 0}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    cli_here(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", out, "--max-new-tokens", 6,
             "--max-batch", 2)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [x["prompt"] for x in lines] and rows[0]["id"] == "a"
    assert [r["completion_tokens"] for r in rows][:2] == [6, 3] and rows[3]["completion"] == ""
    for r in rows[:2]:  # greedy lines equal --prompt alone
        alone = cli_here(capsys, "generate", "--model", tmp_path / "hf", "--prompt", r["prompt"], "--json",
                         "--max-new-tokens", r["completion_tokens"])
        assert json.loads(alone)["completion"] == r["completion"]
    assert "e" not in rows[2]["completion"]
    before = out.read_text()
    proc = cli_proc(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", out)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr and out.read_text() == before
    import shardlm.inference.engine as engine
    with pytest.MonkeyPatch.context() as mp:  # a crash midway through --overwrite leaves the old output whole
        mp.setattr(engine.Engine, "run", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        cut = cli_proc(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", out, "--overwrite")
    assert cut.returncode == 130 and out.read_text() == before
    cli_here(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", out, "--overwrite",
             "--max-new-tokens", 6, "--max-batch", 2)
    assert out.read_text() == before and not (tmp_path / ".out.jsonl.partial").exists()  # greedy lines again
    src.write_text('{"prompt": "a", "top_p": 0}\n')
    proc = cli_proc(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", tmp_path / "o2.jsonl")
    assert proc.returncode == 2 and f"{src}:1: " in proc.stderr and "top_p" in proc.stderr


def test_generate_a_jsonl_file_of_chats_renders_them_by_the_chat_template(tmp_path, capsys):
    """A chat fine-tune's held-out lines ({"messages"}) were refused ("needs a string field prompt"): rendered by
    the model's chat template (a final assistant answer left out), each equals its rendering given as a prompt."""
    save_hf("llama", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]"
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    turns = [{"role": "user", "content": "To be"}, {"role": "assistant", "content": "or not"}]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": turns}) + "\n" + json.dumps({"prompt": "[user]To be[assistant]"}) + "\n")
    cli_here(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", tmp_path / "out.jsonl",
             "--max-new-tokens", 6)
    chat, plain = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert chat["messages"] == turns[:1] and chat["completion"] == plain["completion"]
    assert chat["prompt_tokens"] == plain["prompt_tokens"]
    src.write_text(json.dumps({"messages": turns[1:]}) + "\n")  # nothing asked before the answer
    proc = cli_proc(capsys, "generate", "--model", tmp_path / "hf", "--input", src, "--output", tmp_path / "o2.jsonl")
    assert proc.returncode == 2 and "in.jsonl:1: messages must be a list of {role, content: string} turns" in proc.stderr


def test_generate_and_eval_stop_at_the_generation_configs_end_of_turn(tmp_path, capsys):
    """An end of turn that only generation_config.json names (Llama 3 Instruct's <|eot_id|>) ends `generate`'s
    and `eval --tasks`' completions, as it ends serve's: one function gives every command its stop ids."""
    from shardlm.generation_config import stop_ids_of
    from shardlm.inference import load_pretrained, prompt_ids
    save_hf("llama", tmp_path / "hf")
    model, tok, _ = load_pretrained(tmp_path / "hf")
    prompt = "To be"
    alone = generate_ids(model, torch.tensor([prompt_ids(tok, prompt)]), 12)[0].tolist()
    # a token greedy emits, not at its first step, whose first appearance is where the stop must come
    k = next(i for i in range(2, len(alone)) if alone[i] not in alone[:i] and alone[i] != tok.eos_id)
    turn = alone[k]
    args = ["--model", tmp_path / "hf", "--max-new-tokens", 12, "--compile", "off"]
    plain = json.loads(cli_here(capsys, "generate", *args, "--prompt", prompt, "--json"))["completion"]
    assert plain == tok.decode(alone)  # transformers' own generation_config.json (made from the class) adds nothing
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                                         "eos_token_id": [tok.eos_id, turn]}))
    assert stop_ids_of(load_pretrained(tmp_path / "hf")[1]) == (tok.eos_id, turn)
    got = json.loads(cli_here(capsys, "generate", *args, "--prompt", prompt, "--json"))["completion"]
    assert got == tok.decode(alone[:k])
    data = tmp_path / "ref.jsonl"
    data.write_text(json.dumps({"prompt": prompt, "completion": "x"}) + "\n")
    scored = json.loads(cli_here(capsys, "eval", *args, "--tasks", "bleu", "--data", data, "--json"))
    assert scored["completions"] == [tok.decode(alone[:k])]


def test_generate_counts_in_words(tmp_path, capsys):
    from shardlm.cli import main
    save_hf("llama", tmp_path / "hf")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "To be", "max_new_tokens": 1}) + "\n")
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "hf"), "--input", str(src), "--output",
                 str(tmp_path / "out.jsonl"), "--compile", "off"]) == 0
    said = capsys.readouterr().err
    assert re.search(rf"1 completion, 1 new token in \d+s \([\d,]+ tokens/s\) -> {re.escape(str(tmp_path))}/out.jsonl",
                     said), said


def test_a_model_loads_in_the_dtype_asked(tmp_path):
    from shardlm.inference import load_pretrained
    save_hf("qwen2", tmp_path)
    model, _, _ = load_pretrained(tmp_path, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref, _, _ = load_pretrained(tmp_path)
    assert {p.dtype for p in ref.parameters()} == {torch.float32}  # auto on the CPU
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_the_planner_predicts_the_measured_decode():
    """`plan --inference` against the engine's rows in bench/results.jsonl (one H200) since its decode step's
    kernels launch as one chain: memory within 10% of the measured peak, tokens/s within 15%."""
    from pathlib import Path

    from shardlm.config import load_config
    from shardlm.plan import CUDA_CONTEXT, HEADROOM, gpu
    from shardlm.plan.inference import plan_inference
    rows = [json.loads(x) for x in (Path(__file__).parents[1] / "bench" / "results.jsonl").read_text().splitlines()]
    start = next(i for i, r in enumerate(rows) if r.get("commit") == "7cd7714")  # the chain's first rows
    measured = [r for r in rows[start:] if r["bench"] == "generate" and r["system"] == "shardlm"
                and "H200" in r["card"]]
    assert {1, 16} <= {r["batch"] for r in measured}
    for r in measured:
        e = plan_inference(load_config(r["model"]).model, gpu("h200"), r["batch"], r["prompt"] + r["new_tokens"],
                           2, HEADROOM, CUDA_CONTEXT)
        assert abs(e.total / 2**30 / r["peak_mem_gib"] - 1) < 0.10, (r["batch"], e.total / 2**30, r["peak_mem_gib"])
        assert abs(e.tokens_per_s / r["tok_s"] - 1) < 0.15, (r["batch"], e.tokens_per_s, r["tok_s"])


def test_plan_inference_cli():
    proc = run_cli("plan", "--model", "llama2-7b", "--inference", "--gpu", "h200", "--batch", 16, "--context", 384,
                   "--json")
    e = json.loads(proc.stdout)
    assert e["fits"] and e["slots"] > 16 and e["kv_cache"] == 16 * 385 * 2 * 32 * 32 * 128 * 2
    proc = run_cli("plan", "--model", "llama2-7b", "--inference", "--context", 9000, check=False)
    assert proc.returncode == 2 and "max_seq_len 4096" in proc.stderr


def test_quantised_perplexity_stays_within_its_bound():
    """int8 (per channel) and int4 (per group) weights of a tiny Llama trained on a text: the held-out
    perplexity within 1% and 5% of the unquantised model's, the greedy decode through the engine unchanged
    for its first tokens."""
    import copy

    from helpers import TEXT
    from shardlm.inference import evaluate_ids
    from shardlm.inference.quantize import quantize
    from shardlm.tokenizer import load_tokenizer
    ids = torch.tensor(load_tokenizer("byte").encode(TEXT[:6000]))
    split = int(len(ids) * 0.8)
    model = build_model(load_config("tiny").model, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(80):
        batch = torch.stack([ids[s:s + 65] for s in torch.randint(0, split - 65, (16,), generator=g).tolist()])
        loss = model(batch[:, :-1], targets=batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    held = ids[split:].tolist()
    base = evaluate_ids(model, held, 64)["perplexity"]
    want = Engine(model, 1, 40).run([Request(held[:16], 6)])[0].tokens
    for kind, bound in (("int8", 0.01), ("int4", 0.05)):
        q = copy.deepcopy(model)
        assert quantize(q, kind) == 8  # 4 linears in each of 2 blocks (the head, in int8 for both, not counted)
        assert evaluate_ids(q, held, 64)["perplexity"] / base - 1 < bound, kind
        assert Engine(q, 1, 40).run([Request(held[:16], 6)])[0].tokens == want, kind


def test_the_int8_head_over_many_rows_multiplies_a_slab_of_the_vocabulary_at_a_time():
    """More rows than the kernels take (eval's windows) go through the int8 head slab by slab (no whole 16-bit
    copy of the weight): the logits those give, a last slab shorter than the others among them, are the
    few-row path's, and within int8's rounding of the 16-bit head's."""
    from shardlm.inference.int8 import MAX_ROWS
    from shardlm.inference.quantize import QuantizedHead
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(350, 32, generator=g)
    h = torch.randn(2, MAX_ROWS, 32, generator=g)
    head = QuantizedHead(weight, slab=100)
    many = head(h)
    assert many.shape == (2, MAX_ROWS, 350)
    torch.testing.assert_close(many, torch.cat([head(h[:, i:i + 1]) for i in range(MAX_ROWS)], 1))
    exact = h @ weight.t()
    assert (many - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("window", [0, 5, 40])
def test_the_decode_steps_bounds_are_the_masks(window):
    """visible_bounds, which every layer's decode kernel reads, are the first visible cached position and one past
    the last of visible's mask: at the first key, the last, past a window, and an idle row's none."""
    from shardlm.inference.slots import visible, visible_bounds
    keys, idle = 32, 40
    pos = torch.tensor([[0], [3], [12], [31], [idle]])
    mask = visible(pos, keys, window, idle)[:, 0]
    lo, hi = visible_bounds(pos, keys, window, idle)
    assert lo.dtype == hi.dtype == torch.int32
    assert lo.tolist() == [int(m.int().argmax()) if m.any() else 0 for m in mask]
    assert (hi - lo).tolist() == mask.sum(-1).tolist()


def test_slots_fit_the_hosts_memory_on_a_cpu():
    """On a CPU the slots are bounded by the host's free memory, not only by what was asked (a --max-batch of
    millions was taken as given, then killed for memory)."""
    from shardlm.inference import slots_that_fit
    fit = slots_that_fit(tiny(), 64, 10**12)
    assert 1 <= fit < 10**12


def test_quantising_what_cannot_be_is_refused():
    """int4 on a model whose layers' inputs no group divides: a ConfigError that says why."""
    from shardlm.config import ConfigError
    from shardlm.inference.quantize import quantize
    odd = tiny(hidden_size=40, ffn_hidden_size=72, num_heads=2, num_kv_heads=2)
    with pytest.raises(ConfigError, match="int4 needs an input size that a group of 128, 64, 32 divides"):
        quantize(odd, "int4")
    assert quantize(odd, "int8") == 8


def test_quantised_mixture_of_experts_keeps_its_routing():
    """int8 and int4 weights on a mixture of experts: the router stays as it is (route() reads its weight, in
    fp32), so the tokens go to the experts they went to and the logits stay near the unquantised model's."""
    import copy

    from shardlm.inference.quantize import quantize
    model = build_model(load_config("mixtral-tiny").model, seed=0).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    for kind, bound in (("int8", 0.02), ("int4", 0.15)):  # int8 with the router quantised: 0.07
        q = copy.deepcopy(model)
        assert quantize(q, kind) > 0
        for block, kept in zip(model.blocks(), q.blocks()):
            assert type(kept.mlp.router) is type(block.mlp.router)
            assert torch.equal(kept.mlp.router.weight, block.mlp.router.weight), kind
        with torch.no_grad():
            base, got = model(ids), q(ids)
        assert ((got - base).abs().max() / base.abs().max()).item() < bound, kind


@pytest.mark.parametrize("kind,tp", [("qwen2", 2), ("gpt2", 2), pytest.param("llama", 4, marks=pytest.mark.slow)])
def test_tensor_parallel_generation_equals_one_process(kind, tp, tmp_path, capsys):
    """`generate --tp N` on N ranks (gloo): the training's tensor-parallel layers, each rank holding its slice
    (llama at tp 4: its 2 key/value heads kept whole on every rank), the same completions as one process;
    `eval` of the loss likewise."""
    from shardlm.testing.distributed import run_distributed
    save_hf(kind, tmp_path / "hf")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("To be", "or not to be, that is", "whether")))
    args = ["generate", "--model", tmp_path / "hf", "--input", src, "--max-new-tokens", 10, "--max-batch", 2]
    cli_here(capsys, *args, "--output", tmp_path / "one.jsonl")
    assert run_distributed(dist_fns.cli_at_rank, tp, [*args, "--output", tmp_path / "tp.jsonl", "--tp", tp],
                           timeout=240) == [0] * tp
    assert (tmp_path / "tp.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    from shardlm.inference import evaluate_ids, load_pretrained
    text = "To be, or not to be, that is the question " * 10
    model, tok, _ = load_pretrained(tmp_path / "hf")
    want = evaluate_ids(model, tok.encode(text), 16)["loss"]
    got = run_distributed(dist_fns.loss_at_tp, tp, tmp_path / "hf", text, 16, timeout=240)
    assert got == pytest.approx([want] * tp, rel=1e-5)


@pytest.mark.timeout(120)
def test_tensor_parallel_ranks_given_other_arguments_are_refused(tmp_path):
    """Rank 1 of `generate --tp 2` given another prompt aborted in gloo's C++ ('Received data size doesn't
    match expected size'), with tracebacks; given another --temperature it decoded on without a word. Both
    ranks now stop before the model loads, naming the flag."""
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    args = ["generate", "--model", tmp_path / "hf", "--prompt", "To be", "--max-new-tokens", 2, "--tp", 2]
    for extra, said in ((["--prompt", "or not to be, that is"], "rank 1 has --prompt = 'or not to be, that is' where "
                                                                 "rank 0 has 'To be'"),
                        (["--temperature", "1"], "rank 1 has --temperature = 1.0 where rank 0 has 0.0")):
        got = run_distributed(dist_fns.cli_with_rank_one_given, 2, args, extra, timeout=90)
        assert [status for status, _ in got] == [2, 2], got
        assert f"shardlm generate: error: the ranks were started with different settings: {said}" in got[0][1], got


def test_a_tensor_parallel_model_loads_in_the_dtype_asked(tmp_path):
    """The parallel layers tensor_parallel puts in are made in the default dtype: load_pretrained casts after
    them, so `--tp 2 --dtype bf16` holds bf16 weights everywhere (it once ran the parallel linears in fp32)."""
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    assert run_distributed(dist_fns.dtypes_at_tp, 2, tmp_path / "hf", "bf16", timeout=120) == [["torch.bfloat16"]] * 2


def test_one_shot_all_reduces_asked_of_a_model_without_tensor_parallelism_are_refused():
    """`Engine(one_shot=True)` insists on the one-shot kernel: a model it cannot serve says why instead of
    running NCCL's all-reduce (or nothing) silently; None and False simply go without."""
    from shardlm.inference import Engine
    model = build_model(load_config("tiny").model, seed=0)
    with pytest.raises(RuntimeError, match="not tensor-parallel"):
        Engine(model, 2, compile=False, one_shot=True)
    assert not Engine(model, 2, compile=False).one_shot and not Engine(model, 2, compile=False, one_shot=False).one_shot


def test_a_chat_templates_end_of_turn_token_ends_a_completion(tmp_path, capsys):
    """A base model's template that closes an assistant's turn with a special token its generation_config.json
    does not name (Qwen2.5's base: <|im_end|>, eos <|endoftext|>): fine-tuned on chats, the model answers
    "...<|im_end|>" then the end-of-text, and every reply (serve's, generate's, eval's) carried the end of turn
    as text. That token ends a completion too; a turn closed by the end-of-text or by plain text adds none."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer

    from shardlm.data.instruct import completion_stop_ids
    from shardlm.inference import load_pretrained, prompt_ids
    from shardlm.tokenizer import load_tokenizer
    save_hf("llama", tmp_path / "hf")
    model, tok, _ = load_pretrained(tmp_path / "hf")
    render = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}CLOSE" \
        "{% else %}END{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    prompt = prompt_ids(tok, "<user>hiEND<assistant>", opened=True)
    alone = generate_ids(model, torch.tensor([prompt]), 12)[0].tolist()
    k = next(i for i in range(2, len(alone)) if alone[i] not in alone[:i] and alone[i] != tok.eos_id)
    turn = tok.tok.id_to_token(alone[k])  # made the template's end of turn: where greedy decoding first emits it
    hf = HFTokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    hf.add_special_tokens([AddedToken(turn, special=True)])
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    settings = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    for closing, stops in (("END", (tok.eos_id,)), ("{{ eos_token }}", (tok.eos_id,)), (turn, (tok.eos_id, alone[k]))):
        (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(
            {**settings, "chat_template": render.replace("CLOSE", closing)}))
        assert completion_stop_ids(load_tokenizer(tmp_path / "hf")) == stops, closing
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cli_here(capsys, "generate", "--model", tmp_path / "hf", "--input", tmp_path / "in.jsonl", "--output",
             tmp_path / "out.jsonl", "--max-new-tokens", 12, "--compile", "off")
    got = json.loads((tmp_path / "out.jsonl").read_text())
    assert got["finish_reason"] == "stop" and got["completion"] == load_tokenizer(tmp_path / "hf").decode(alone[:k])
