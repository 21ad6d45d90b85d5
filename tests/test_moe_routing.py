"""Capacity routing (model.capacity_factor: Switch Transformer, GShard), DeepSeek-V3's auxiliary-loss-free
router bias (model.router_bias_update_rate, parallel/moe_balance.py) and the per-layer MoE statistics the
trainer logs: each layout-free (dp, ep, micro-batching) and equal to one process."""
import dataclasses
import json
import math

import pytest
import torch

import dist_fns
from dp_cases import MODES, RTOL, equality_case, reference
from shardlm.config import load_config
from shardlm.metrics import format_line
from shardlm.model.moe import MoE, capacity_keep
from shardlm.testing.distributed import run_distributed

MOE = {"model.num_experts": "4", "model.top_k": "2", "train.moe_z_loss_coef": "0.001"}
CAPACITY = {**MOE, "model.capacity_factor": "1.0"}
BIAS = {**MOE, "model.router_bias_update_rate": "0.01"}


def layer(seed=0, **changes):
    torch.manual_seed(seed)
    m = MoE(dataclasses.replace(load_config("mixtral-tiny").model, **changes), 0)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m.train()


def test_capacity_keeps_each_sequences_first_copies_by_position():
    """Two sequences of four tokens, top-1, capacity 2: expert 0's third copy in sequence 0 is dropped; in
    sequence 1 every expert is within its capacity (a sequence's queue never borrows another's)."""
    flat = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0])
    keep = capacity_keep(flat, 4, 2, 2)
    assert keep.tolist() == [True, True, False, True, True, True, True, True]


def naive_capacity(m: MoE, x):
    """Token by token in each sequence, in order: an expert past its capacity in this sequence adds nothing."""
    b, s, _ = x.shape
    capacity = math.ceil(m.capacity_factor * s * m.top_k / m.num_experts)
    _, experts, weights = m.route(x.reshape(-1, x.shape[-1]))
    out, dropped = torch.zeros_like(x.reshape(-1, x.shape[-1])), 0
    for seq in range(b):
        taken = [0] * m.num_experts
        for t in range(seq * s, (seq + 1) * s):
            for e, w in zip(experts[t].tolist(), weights[t]):
                if taken[e] >= capacity:
                    dropped += 1
                    continue
                taken[e] += 1
                out[t] += w * _expert(m, e, x.reshape(-1, x.shape[-1])[t])
    return out.view_as(x), dropped


def _expert(m, e, t):
    gate, up = (m.experts.up.weight[e] @ t).chunk(2)
    return m.experts.down.weight[e] @ (torch.nn.functional.silu(gate) * up)


def test_capacity_routing_equals_the_token_by_token_rule_and_counts_the_drops():
    m = layer(capacity_factor=1.0)
    x = torch.randn(3, 16, m.router.weight.shape[1])
    with torch.no_grad():
        y = m(x)
        want, dropped = naive_capacity(m, x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    e = m.num_experts
    routed, kept = m.stats[:e], m.stats[e:2 * e]
    assert dropped > 0 and int((routed - kept).sum()) == dropped
    assert int(routed.sum()) == 3 * 16 * m.top_k


def test_capacity_is_per_sequence_whatever_the_batch():
    """The batch at once equals its sequences one by one (outputs and dropped copies): what makes dp, ep and
    micro-batching drop the same copies."""
    m = layer(capacity_factor=0.75)
    x = torch.randn(4, 16, m.router.weight.shape[1])
    with torch.no_grad():
        whole = m(x)
        stats, m.stats = m.stats, None
        parts = torch.cat([m(x[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(whole, parts, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats, m.stats)


@pytest.mark.parametrize("big", [2.0, 1e30, 1e308])
def test_a_capacity_that_drops_nothing_equals_dropless(big):
    """capacity_factor = E / k: each expert may take every token of a sequence, so nothing is dropped and the
    outputs and every gradient are dropless routing's; so too a factor far beyond it (1e30 once overflowed, 1e308 after)."""
    runs = []
    for factor in (0.0, big):
        m = layer(capacity_factor=factor)
        x = torch.randn(2, 16, m.router.weight.shape[1], generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        y = m(x)
        (y.square().sum() + m.balance_loss).backward()
        runs.append((y.detach(), x.grad, [p.grad for p in m.parameters()], m.stats))
    (y0, gx0, g0, s0), (y1, gx1, g1, s1) = runs
    torch.testing.assert_close(y0, y1, rtol=0, atol=0)
    torch.testing.assert_close(gx0, gx1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(s0, s1, rtol=0, atol=0)


def test_the_bias_chooses_the_experts_and_the_scores_weigh_them():
    """DeepSeek-V3: a large bias on expert 3 puts every token on it, with its unbiased score as the weight."""
    m = layer(router_bias_update_rate=0.01, router_scoring="sigmoid", router_renormalize=False)
    x = torch.randn(8, m.router.weight.shape[1])
    m.router_bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    logits, experts, weights = m.route(x)
    assert (experts == 3).any(-1).all()
    torch.testing.assert_close(weights, logits.sigmoid().gather(-1, experts))


def check_layouts(results, ref):
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=RTOL, atol=0)
        assert len(r["moe"]) == len(ref["moe"])
        for got, want in zip(r["moe"], ref["moe"]):
            assert want and want.keys() <= got.keys()
            for key in got.keys() - want.keys():  # expert parallelism's rank load: between 1 and the expert load's
                assert key.endswith("/ep_max_over_mean"), key
                assert 1.0 - 1e-9 <= got[key] <= got[key.replace("/ep_max", "/max")] + 1e-9, key
            for key, value in want.items():
                if key.endswith("/dropped"):
                    assert got[key] == value, key
                else:
                    assert got[key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize("world, ep, mode", [(2, 1, "ddp"), (2, 2, "ddp"), (4, 2, "zero3")])
def test_capacity_routing_at_dp_2_and_ep_2_equals_one_process(world, ep, mode):
    """Losses, gradient norms and the logged statistics (dropped copies exactly) at dp 2 (ep 1 or 2) and at
    ep 2 x edp 2 (dp 4, ZeRO-3, one sequence a micro-batch)."""
    common = {**equality_case("adamw", world), **CAPACITY}
    if world == 4:
        common["train.micro_batch_size"] = "1"
    results = run_distributed(dist_fns.train_and_capture, world,
                              {**common, **MODES[mode], "parallel.dp": str(world), "parallel.ep": str(ep)}, timeout=300)
    ref = reference(common)
    assert sum(v for r in ref["moe"] for k, v in r.items() if k.endswith("/dropped")) > 0  # capacity bites
    check_layouts(results, ref)


@pytest.mark.parametrize("world, mode", [(2, "ddp"), (4, "zero1")])
def test_the_router_bias_at_ep_2_x_dp_2_equals_one_process_and_resumes_exactly(tmp_path, world, mode):
    """The bias, updated from the global batch's loads after each step, is one process's at ep 2 x dp 2 and at
    ep 2 x edp 2 (dp 4) (losses, norms, statistics, the bias itself, exactly); a checkpoint saved at step 2
    there resumes at one process and continues it: the same losses and the same final bias."""
    over = {**equality_case("adamw", world), **BIAS, "train.save_every": "2", "train.keep_checkpoints": "5"}
    if world == 4:
        over["train.micro_batch_size"] = "1"
    results = run_distributed(dist_fns.train_and_capture, world,
                              {**over, **MODES[mode], "parallel.dp": str(world), "parallel.ep": "2"},
                              str(tmp_path / "a"), timeout=300)
    ref = reference({k: v for k, v in over.items() if not k.startswith("train.save")})
    check_layouts(results, ref)
    bias = ref["router_bias"]
    assert any(any(v) for v in bias.values())
    for r in results:
        assert r["router_bias"] == bias
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    saved = json.loads((ckpt / "state.json").read_text())["router_bias"]
    assert saved.keys() == bias.keys() and saved != bias  # two steps in
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), str(ckpt))
    assert resumed["losses"] == pytest.approx(results[0]["losses"][2:], rel=1e-5)
    assert resumed["router_bias"] == bias


def test_the_trainer_logs_the_statistics_per_layer(tmp_path):
    """metrics.jsonl holds max/mean load, dropped copies and the aux loss per MoE layer; the console line
    sums them up, and TensorBoard holds each of them at each step, under the same name."""
    dist_fns.train_and_capture(0, 1, {**CAPACITY, "train.steps": "2", "train.tensorboard": "true"}, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rec = records[-1]
    for layer in (0, 1):
        for key in ("max_over_mean", "dropped", "aux_loss"):
            assert f"moe/layer{layer}/{key}" in rec
    assert rec["moe/layer0/max_over_mean"] >= 1.0 and rec["moe/layer0/aux_loss"] >= 1.0 - 1e-6
    assert " | moe max/mean " in format_line(rec)
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    names = [k for k in rec if k.startswith("moe/layer")]
    assert set(names) <= set(events.Tags()["scalars"])
    for name in names:
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == [r["step"] for r in records if name in r], name
        assert [e.value for e in scalars] == pytest.approx([r[name] for r in records if name in r], rel=1e-6), name


def test_evaluation_runs_dropless():
    """Capacity is a training device: evaluation and generation route every copy, as the exported model does."""
    capped, dropless = layer(capacity_factor=0.5).eval(), layer().eval()
    x = torch.randn(2, 16, capped.router.weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(capped(x), dropless(x), rtol=0, atol=0)


def test_statistics_are_counted_once_under_recomputation():
    """Full recomputation runs each router twice a step: the logged statistics are those without it."""
    runs = [dist_fns.train_and_capture(0, 1, {**CAPACITY, **BIAS, "train.steps": "2", "train.recompute": mode})
            for mode in ("none", "full")]
    assert runs[0]["moe"] == runs[1]["moe"] and runs[0]["router_bias"] == runs[1]["router_bias"]
    assert runs[0]["moe"][-1]["moe/layer0/dropped"] > 0


def test_capacity_routing_is_the_same_at_any_micro_batching():
    """One micro-batch of 8 sequences or four of 2: the same copies dropped, the same losses and norms (the
    balance loss, a function of each micro-batch's tokens, off: its value would differ by design)."""
    common = {**CAPACITY, "train.steps": "3", "train.global_batch_size": "8", "train.moe_aux_loss_coef": "0",
              "train.moe_z_loss_coef": "0"}
    runs = [dist_fns.train_and_capture(0, 1, {**common, "train.micro_batch_size": micro}) for micro in ("8", "2")]
    torch.testing.assert_close(runs[0]["losses"], runs[1]["losses"], rtol=RTOL, atol=0)
    torch.testing.assert_close(runs[0]["grad_norms"], runs[1]["grad_norms"], rtol=RTOL, atol=0)
    for a, b in zip(runs[0]["moe"], runs[1]["moe"]):
        assert {k: v for k, v in a.items() if k.endswith("/dropped")} == \
            {k: v for k, v in b.items() if k.endswith("/dropped")}
    assert runs[0]["moe"][0]["moe/layer0/dropped"] > 0


def test_a_skipped_step_leaves_the_bias_and_a_taken_one_moves_it_by_the_sign_of_the_load():
    """After a step fp16 skipped the bias is unchanged (as the weights are) and its counts are dropped; after a
    taken step each expert's bias moves by the rate towards the mean load."""
    from shardlm.mesh import DeviceMesh
    from shardlm.model import build_model
    from shardlm.parallel.moe_balance import MoEBalance

    cfg = dataclasses.replace(load_config("mixtral-tiny").model, router_bias_update_rate=0.01)
    model = build_model(cfg, seed=0).train()
    balance = MoEBalance(model, DeviceMesh(), cfg, torch.device("cpu"))
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    model(x, x)
    balance.after_step(skipped=True)
    layers = balance.layers
    assert all(not m.router_bias.any() and not m.step_routed.any() for m in layers)  # the counts dropped
    model(x, x)
    loads = [m.step_routed.float() for m in layers]
    balance.after_step()
    for m, load in zip(layers, loads):
        torch.testing.assert_close(m.router_bias, 0.01 * torch.sign(load.mean() - load))


def test_generate_and_eval_route_with_the_trained_bias_and_export_is_refused(tmp_path):
    """A checkpoint's router bias is loaded with its weights (shardlm generate, eval); an export to Mixtral's
    class, whose router has no bias, is refused rather than written to route differently."""
    from shardlm.config import ConfigError
    from shardlm.hf_config import hf_config_from_model
    from shardlm.inference.load import load_pretrained
    from shardlm.model.moe import moe_layers

    over = {**BIAS, "train.steps": "2", "train.save_every": "2"}
    run = dist_fns.train_and_capture(0, 1, over, str(tmp_path))
    model, _, cfg = load_pretrained(tmp_path / "checkpoints" / "step_00000002")
    layers = moe_layers(model)
    assert layers and all(m.router_bias.tolist() == run["router_bias"][str(m.layer)] for m in layers)
    assert any(m.router_bias.any() for m in layers)
    with pytest.raises(ConfigError, match="router_bias_update_rate"):
        hf_config_from_model(cfg)


def test_a_resume_may_start_or_stop_dropping_tokens(tmp_path):
    """model.capacity_factor chooses the copies training drops (no weight, no state; eval, generate and export
    route dropless): a dropless run resumed with a capacity was refused as 'it changes the model'."""
    dist_fns.train_and_capture(0, 1, {**MOE, "train.steps": "1"}, str(tmp_path / "a"))
    resumed = dist_fns.train_and_capture(0, 1, {**CAPACITY, "train.steps": "2"}, str(tmp_path / "b"), str(tmp_path / "a"))
    assert len(resumed["losses"]) == 1 and sum(v for k, v in resumed["moe"][0].items() if k.endswith("dropped")) > 0
