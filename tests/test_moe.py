"""Mixture of experts (model/moe.py, issue 44's first part): the router's math against a naive loop, the grouped
GEMMs against the loop over experts, the auxiliary losses under accumulation, transformers' Mixtral and
Qwen2-MoE (logits, greedy generation, export), and `mixtral-tiny` training alone and data-parallel."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import dist_fns
from dp_cases import MODES, check_against_reference, equality_case, reference
from helpers import matched_to_transformers
from shardlm.config import ConfigError, load_config
from shardlm.config.checks import validate
from shardlm.model import build_model
from shardlm.model.grouped_mm import grouped_available, grouped_mm
from shardlm.model.moe import MoE, balance_loss, expert_load, z_loss
from shardlm.testing.distributed import run_distributed

MOE = {"model.num_experts": "4", "model.top_k": "2"}  # `tiny` made mixtral-tiny, for dist_fns' trainer


def moe_cfg(**changes):
    return dataclasses.replace(load_config("mixtral-tiny").model, **changes)


def moe_layer(seed=0, **changes):
    torch.manual_seed(seed)
    layer = MoE(moe_cfg(**changes), 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.1)
    return layer


@torch.no_grad()
def naive_moe(layer: MoE, x):
    """Token by token: scores, top-k, (re)normalise, and each chosen expert's SwiGLU, as the papers write it."""
    ys = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = layer.router.weight.double() @ t.double()
        scores = logits.softmax(-1) if layer.scoring == "softmax" else logits.sigmoid()
        chosen = sorted(range(len(scores)), key=lambda e: -scores[e].item())[:layer.top_k]
        w = scores[chosen]
        if layer.renormalize:
            w = w / w.sum()
        y = torch.zeros_like(t, dtype=torch.float64)
        for e, we in zip(chosen, w):
            gate, up = (layer.experts.up.weight[e].double() @ t.double()).chunk(2)
            y += we * (layer.experts.down.weight[e].double() @ (F.silu(gate) * up))
        if layer.shared is not None:
            y += torch.sigmoid(layer.shared_gate.weight.double() @ t.double()) * layer.shared(t.double()[None].float())[0].double()
        ys.append(y)
    return torch.stack(ys).view(x.shape).float()


@pytest.mark.parametrize("scoring, renormalize, shared", [("softmax", True, 0), ("softmax", False, 24),
                                                          ("sigmoid", True, 0)])
def test_router_and_experts_equal_a_naive_loop(scoring, renormalize, shared):
    """Mixtral's renormalised softmax top-k, Qwen2-MoE's raw top-k with its gated shared expert, DeepSeek-V3's
    sigmoid scores with the top-k normalised."""
    layer = moe_layer(router_scoring=scoring, router_renormalize=renormalize, shared_expert_ffn_hidden_size=shared)
    x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(1))
    _, _, weights = layer.route(x.reshape(-1, 64))
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(21))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), naive_moe(layer, x), rtol=1e-5, atol=1e-5)


IMPLS = ["loop"] + (["grouped"] if grouped_available(torch.ones(1, 64), torch.ones(1, 64, 64)) else [])


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_gemm_paths_equal_the_loop_forward_and_backward(impl):
    """torch._grouped_mm (where this build runs it on the CPU: int32 offsets, 16-byte strides) and the loop give
    the same outputs and gradients; an expert without tokens and a gradient of stride 0 (from .sum()) included."""
    torch.manual_seed(0)
    w = torch.randn(4, 48, 32, requires_grad=True)
    x = torch.randn(10, 32, requires_grad=True)
    counts = torch.tensor([3, 0, 6, 1])
    ref = torch.cat([x[:3] @ w[0].T, x[3:9] @ w[2].T, x[9:] @ w[3].T])
    y = grouped_mm(x, w, counts, impl)
    torch.testing.assert_close(y, ref)
    y.sum().backward()  # a stride-0 gradient, which _grouped_mm's own backward refuses
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref.sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    layer = moe_layer()
    inp = torch.randn(2, 9, 64, requires_grad=True)
    outs = []
    for mode in ("loop", impl):
        layer.impl = mode
        inp.grad = None
        layer.zero_grad()
        out = layer(inp)
        (out * torch.arange(64.0)).sum().backward()
        outs.append((out.detach(), inp.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2], outs[1][2]):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_grouped_gemm_on_the_gpu_equals_the_loop():
    """bf16 on a GPU: auto picks torch._grouped_mm on Hopper; it equals the loop within bf16's rounding."""
    layer = moe_layer().cuda().to(torch.bfloat16)
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if torch.cuda.get_device_capability() >= (9, 0):
        assert grouped_available(x.reshape(-1, 64), layer.experts.up.weight)
    outs = []
    for mode in ("loop", "auto"):
        layer.impl, x.grad = mode, None
        layer.zero_grad()
        out = layer(x)
        out.float().square().sum().backward()
        outs.append([out.detach().float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_balance_and_z_losses():
    """Switch's loss is 1 at a uniform load with uniform probabilities and E when one expert takes every token
    with certainty; the z-loss is the mean squared logsumexp."""
    e, t = 4, 8
    assert balance_loss(torch.zeros(t, e), torch.full((e,), t * 2 // e), 2).item() == pytest.approx(1.0)
    certain = torch.full((t, e), -1e4)
    certain[:, 0] = 0
    assert balance_loss(certain, torch.tensor([t, 0, 0, 0]), 1).item() == pytest.approx(e)
    logits = torch.randn(t, e)
    assert z_loss(logits).item() == pytest.approx((torch.logsumexp(logits, -1) ** 2).mean().item())


class _Engine:  # one process: nothing to synchronise around backward, nothing to divide
    def prepare_backward(self, last): pass
    def finish_backward(self, last): pass
    def loss_factor(self): return 1.0


class _Scaler:
    scale = 1.0


def step(model, batches, coefs):
    """ForwardBackward's step over `batches` (each micro-batch's mean loss divided by their number)."""
    from shardlm.parallel.forward_backward import ForwardBackward
    return ForwardBackward(model, _Engine(), _Scaler(), coefs)(iter(batches), len(batches), torch.device("cpu"))


def test_aux_loss_is_trained_scaled_like_its_micro_batch_and_not_reported():
    """The step's gradient is that of mean(LM loss + coef x aux) over its micro-batches; the loss it reports is
    the LM loss alone."""
    from shardlm.model.moe import moe_layers

    cfg = moe_cfg()
    model = build_model(cfg, seed=1)
    batches = [(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(i)),) * 2 for i in range(2)]
    total = step(model, batches, (0.1, 0.01))
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want_loss = 0.0
    for x, y in batches:
        lm = model(x, y)
        aux = sum(0.1 * m.balance_loss + 0.01 * m.z_loss for m in moe_layers(model))
        ((lm + aux) / 2).backward()
        want_loss += lm.item() / 2
    assert total.item() == pytest.approx(want_loss, rel=1e-6)
    for a, (name, p) in zip(got, model.named_parameters()):
        torch.testing.assert_close(a, p.grad, msg=name)


def test_full_recomputation_trains_the_same_and_counts_the_load_once():
    """Recomputed blocks run the router twice: the gradients (auxiliary losses included) equal those without
    recomputation, and the tokens per expert are counted once. The grouped GEMMs' first use (a probe of this
    build's CPU kernel) inside the checkpointed forward must not upset the recomputation either."""
    from shardlm.model import grouped_mm as kernels

    cfg = moe_cfg()
    batches = [(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(i)),) * 2 for i in range(2)]
    grads, loads = [], []
    for mode in ("none", "full"):
        kernels._PROBED.clear()
        model = build_model(cfg, seed=2)
        model.set_recompute(mode)
        model.train()
        step(model, batches, (0.1, 0.01))
        grads.append([p.grad for p in model.parameters()])
        loads.append(expert_load(model))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    assert loads[0] == loads[1]
    assert sorted(loads[0]) == [0, 1] and sum(loads[0][0]["tokens"]) == 2 * (2 * 16 * 2)
    assert expert_load(model) == {}  # taken


@pytest.mark.slow
def test_compiled_blocks_equal_eager():
    """torch.compile'd blocks (train.compile): on the CPU the grouped GEMM runs eagerly between graphs, since
    the compiler checks _grouped_mm's shapes by the GPU kernel's rules (bf16 only). Taking the load between
    forwards (the logs do, every few steps) compiles nothing again."""
    cfg = moe_cfg()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        model = build_model(cfg, seed=4)
        if compiled:
            for block in model.blocks():
                block.compile()
        loss = model(ids, ids)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
    model(ids, ids)  # the accumulators now hold a sum
    assert expert_load(model)  # and are reset
    with torch._dynamo.config.patch(error_on_recompile=True):
        model(ids, ids).backward()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_routing_and_its_counts_compile_into_one_graph_unless_recomputed(recompute):
    """The router, the dispatch, the combine and the counts are one graph when the block is not recomputed (on a
    GPU the grouped GEMMs join it; here a stand-in runs the experts). Under recomputation whether a forward is
    the first run is known only as it runs, which breaks the graph. Taking the load and the router bias's
    counts compiles nothing again, and the counts stay exact."""
    model = build_model(moe_cfg(router_bias_update_rate=0.01), seed=0).train()
    model.set_recompute(recompute)
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    layer.run_experts = lambda rows, counts, copies: 2 * rows
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(layer, backend=backend)
    x = torch.randn(2, 16, layer.router.weight.shape[1], requires_grad=True)
    compiled(x).sum().backward()
    assert len(graphs) == 1 if recompute == "none" else len(graphs) > 1
    compiled(x)
    assert layer.take_load().sum() == 2 * (2 * 16 * layer.top_k)
    assert layer.take_load() is None
    assert layer.take_routed().sum() == 2 * (2 * 16 * layer.top_k)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(x)
    assert layer.take_load().sum() == layer.take_routed().sum() == 2 * 16 * layer.top_k


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_top_1_renormalised_routing_that_the_loss_cannot_train_is_noted(scoring):
    """top_k 1 with the chosen weight renormalised: the weight is 1 whatever the router says, so the loss gave
    the router no gradient (it trained on the balance loss alone); the run says so where the router trains (a note,
    not a refusal: a pretrained model may be so configured, and a run started so must resume), pointing a
    pretrained model's run at freezing the router rather than at changing what the model computes."""
    grads = {}
    for renormalize in (True, False):
        layer = moe_layer(top_k=1, router_scoring=scoring, router_renormalize=renormalize).train()
        layer(torch.randn(2, 8, layer.router.in_features, generator=torch.Generator().manual_seed(0))).square().sum().backward()
        grads[renormalize] = layer.router.weight.grad.norm().item()
    assert grads[True] < 1e-4 * grads[False]  # why it is noted
    from shardlm.config.expert_checks import untrained_router_note
    over = {**MOE, "model.top_k": "1", "model.router_scoring": scoring}
    validate(load_config("tiny", over))
    note = untrained_router_note(load_config("tiny", over))
    assert "the loss trains the router not at all" in note and "router_renormalize = False" in note
    pretrained = untrained_router_note(load_config("tiny", {**over, "train.init_from": "somewhere"}))
    assert "train.freeze = 'router'" in pretrained and "router_renormalize = False" not in pretrained
    for fine in ({"model.router_renormalize": "false"}, {"train.freeze": "router"}, {"train.freeze": "router.weight"},
                 {"train.freeze": "layers.*.mlp.router.weight"}, {"lora.rank": "4"}, {"model.top_k": "2"}):
        assert untrained_router_note(load_config("tiny", {**over, **fine})) is None, fine
    # One expert: neither renormalising less (a softmax of one logit is 1) nor the balance loss trains it
    for one in ({}, {"model.router_renormalize": "false", "model.router_scoring": "softmax"}):
        note = untrained_router_note(load_config("tiny", {**over, "model.num_experts": "1", **one}))
        assert "model.num_experts = 1" in note and "router_renormalize = False" not in note


def test_config_checks_and_counts():
    cfg = load_config("mixtral-tiny")
    validate(cfg)
    for over in ({"parallel.pp": "2"}, {"parallel.cp": "2"}, {"parallel.cp": "2", "parallel.ep": "2"},
                 {"parallel.tp": "2"}, {"parallel.tp": "2", "parallel.sp": "true"}):
        composed = load_config("mixtral-tiny", over)  # pipelines, context and tensor parallelism compose with experts
        validate(composed, world_size=composed.parallel.world)
    for over, message in (({"parallel.tp": 2, "train.seq_len": 31}, "train.seq_len = 31 must divide by parallel.tp = 2"),
                          ({"parallel.ep": 2}, "parallel.ep = 2 must divide the 4 experts and parallel.dp"),
                          ({"model.router_scoring": "topk"}, "model.router_scoring = 'topk' is not one of"),
                          ({"model.moe_first_dense": 2}, "leave none of the 2 layers")):
        bad = load_config("mixtral-tiny")
        for key, value in over.items():
            section, name = key.split(".")
            setattr(getattr(bad, section), name, value)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            validate(bad, world_size=bad.parallel.world)
    m = load_config("mixtral-8x7b").model
    c = m.param_counts()
    assert m.num_params() == pytest.approx(46.7e9, rel=2e-3)
    assert m.num_params() - c["layers"] + c["active_layers"] == pytest.approx(12.9e9, rel=2e-3)
    q = load_config("qwen2-moe-a2.7b").model
    assert q.num_params() == pytest.approx(14.3e9, rel=2e-3)
    assert q.num_params() - q.param_counts()["layers"] + q.param_counts()["active_layers"] == pytest.approx(2.7e9, rel=1e-2)
    one = load_config("moe-1b").model
    assert one.num_params() == pytest.approx(1.22e9, rel=3e-3)
    # Every parameter the model allocates is counted, dense first layers and a shared expert included.
    small = moe_cfg(num_layers=3, moe_first_dense=1, shared_expert_ffn_hidden_size=24, moe_ffn_hidden_size=32)
    model = build_model(small, init=False)
    assert [type(b.mlp).__name__ for b in model.blocks()] == ["MLP", "MoE", "MoE"]
    assert sum(p.numel() for p in model.parameters()) == small.num_params()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_logits_and_greedy_generation_match_transformers_and_export_roundtrips(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardlm.inference import Engine, Request, generate_ids
    from shardlm.model.hf import read_hf_dir, write_hf_dir

    ref, ours, cfg, state, ids, expected = matched_to_transformers(kind, tmp_path)
    assert cfg.num_experts == 4 and [cfg.is_moe_layer(i) for i in range(2)] == ([True, True] if kind == "mixtral"
                                                                                 else [False, True])
    prompts = [ids[0, :5].tolist(), ids[1, :9].tolist()]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert generate_ids(ours, torch.tensor(prompts[:1]), 12)[0].tolist() == want[0]
    # The engine batches both (static cache of slots, mixed lengths): each token is routed on its own.
    assert [r.tokens for r in Engine(ours, 2, 64).run([Request(p, 12) for p in prompts])] == want

    write_hf_dir(ours.state_dict(), cfg, tmp_path / "export")
    cfg2, state2 = read_hf_dir(tmp_path / "export")
    assert cfg2 == cfg and state2.keys() == state.keys()
    for k in state:
        assert torch.equal(state2[k], state[k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(reloaded).__name__ == type(ref).__name__
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-5)


def test_mixtrals_router_jitter_noise_is_read_for_inference_and_refused_for_training(tmp_path, capsys):
    """transformers jitters a Mixtral layer's input in training only: a config.json with router_jitter_noise
    once refused generate and eval too. They now compute what they compute without it; fine-tuning from it,
    which would train without the jitter, is refused naming the key."""
    import json

    from helpers import cli_here, hf_model, make_tokenizer
    from shardlm.hf_config import with_init_from
    d = tmp_path / "hf"
    hf_model("mixtral").save_pretrained(d)
    make_tokenizer(d)
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question. " * 8)
    commands = (["generate", "--model", d, "--prompt", "To be", "--max-new-tokens", "6", "--json"],
                ["eval", "--model", d, "--data", tmp_path / "text.txt", "--seq-len", "16", "--json"])
    plain = [cli_here(capsys, *c) for c in commands]
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.1}))
    assert [cli_here(capsys, *c) for c in commands] == plain
    with pytest.raises(ConfigError, match="router_jitter_noise = 0.1 multiplies each expert layer's input by noise "
                                          "in training"):
        with_init_from(load_config("tiny", {"train.init_from": str(d)}))


def test_the_compiled_decode_step_of_experts_without_grouped_kernels_runs_eagerly(monkeypatch):
    """Where the experts' GEMMs loop over experts (no grouped kernel for the device and dtype: fp32 on a
    GPU), the loop's group sizes are data the compiler cannot branch on: the engine's compiled decode step
    says so and decodes eagerly, the tokens of the uncompiled engine, rather than failing the request."""
    import shardlm.model.grouped_mm as grouped
    from shardlm.inference import Engine, Request
    monkeypatch.setattr(grouped, "grouped_available", lambda x, weight: False)
    model = build_model(moe_cfg(init_std=0.2), seed=3).eval()
    prompts = [[1, 2, 3], [5, 6]]
    want = [r.tokens for r in Engine(model, 2, 32, compile=False).run([Request(p, 4) for p in prompts])]
    with pytest.warns(UserWarning, match="the decode step runs eagerly"):
        got = Engine(model, 2, 32, compile=True).run([Request(p, 4) for p in prompts])
    assert [r.tokens for r in got] == want


def test_mixtral_tiny_trains():
    """A few steps through the Trainer: finite losses that fall, and every expert gets tokens."""
    trainer = dist_fns.tiny_trainer(1, {**MOE, "train.steps": "6", "train.log_every": "1"})
    records = trainer.run()
    losses = [r["loss"] for r in records]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero3"])
def test_data_parallel_equals_one_process(mode):
    """dp 2, two micro-batches a rank: losses, gradient norms, gathered weights, gradients and optimizer state
    equal one process's (each micro-batch's auxiliary loss scaled like its loss)."""
    common = {**equality_case("adamw", 2), **MOE, "train.moe_z_loss_coef": "0.001"}
    results = run_distributed(dist_fns.train_and_capture, 2, {**common, **MODES[mode], "parallel.dp": "2"},
                              timeout=240)
    check_against_reference(results, reference(common), 2)
