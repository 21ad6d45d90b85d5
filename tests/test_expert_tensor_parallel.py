"""A mixture of experts under tensor parallelism (parallel/moe_tensor.py), with and without sequence and expert
parallelism: attention and the shared expert split over tp, the router replicated, the routed experts whole on
each tp rank, which routes its own slice of every sequence. Each layout trains as one process does in fp32:
losses, gradient norms, gathered weights and the logged per-layer statistics (dropped copies exactly); a
sharded checkpoint saved at tp 2 x ep 2 resumes at one process."""
import collections
import json

import pytest
import torch

import dist_fns
from dp_cases import ATOL, check_trajectory
from shardlm.config import ConfigError, load_config, validate
from shardlm.testing.distributed import run_distributed
from test_expert_composition import one_thread_reference
from test_moe_routing import check_layouts

# `tiny` made mixtral-tiny with Qwen2-MoE's shared expert (split over tp) and both auxiliary losses on. SGD with
# momentum: tensor parallelism sums a weight's gradient over its ranks in another order than one process, which
# AdamW turns into moves of up to a fraction of lr where an element's gradient nearly cancels (6e-6 here after
# three steps; test_tensor_parallel.py); SGD keeps the data-parallel tolerance, so a gradient off by a factor
# (an auxiliary loss counted once per tp rank) cannot hide.
MOE = {"model.num_experts": "4", "model.top_k": "2", "model.shared_expert_ffn_hidden_size": "32",
       "train.moe_aux_loss_coef": "0.01", "train.moe_z_loss_coef": "0.001", "train.steps": "3",
       "train.global_batch_size": "8", "train.micro_batch_size": "2", "train.optimizer": "sgd", "train.lr": "1e-2"}
CAPACITY = {"model.capacity_factor": "1.0"}
TP2 = {"parallel.tp": "2", "parallel.dp": "1"}


def run(world: int, layout: dict, extra: dict | None = None) -> dict:
    """The layout on `world` ranks and one process with the same micro-batches, checked equal."""
    common = {**MOE, **(extra or {})}
    results = run_distributed(dist_fns.train_and_capture, world, {**common, **layout}, timeout=240)
    ref = one_thread_reference(common)
    check_trajectory(results, ref, ATOL)
    check_layouts(results, ref)
    for r in results:
        assert r["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-5)
    return ref


@pytest.mark.parametrize("routing", [{}, CAPACITY], ids=["dropless", "capacity"])
@pytest.mark.parametrize("sp", ["true", "false"], ids=["sp", "no-sp"])
def test_tensor_parallel_equals_one_process(sp, routing):
    """tp 2: with sp each rank routes its half of every sequence as it holds it; without, each takes its half
    of the tokens both hold and the outputs are joined. Capacity's queues run on from the first half's rank."""
    ref = run(2, {**TP2, "parallel.sp": sp}, routing)
    if routing:
        assert sum(v for r in ref["moe"] for k, v in r.items() if k.endswith("/dropped")) > 0  # capacity bites


@pytest.mark.parametrize("sp", ["true", "false"], ids=["sp", "no-sp"])
def test_expert_and_tensor_parallel_with_zero_1_equals_one_process(sp):
    """ep 2 x tp 2 (dp 2, world 4, ZeRO-1): each tp rank's ep group exchanges its own tokens' copies; the
    experts' gradients are summed over tp (edp 1) and their optimizer state sharded over it. Full recomputation
    runs the exchanges and the tp split again inside backward; evaluation and the closing sample route every
    token on every tp rank (the plain tensor-parallel path)."""
    ref = run(4, {"parallel.tp": "2", "parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "1",
                  "parallel.sp": sp}, {**CAPACITY, "train.recompute": "full", "train.eval_every": "2",
                                       "train.sample_tokens": "4"})
    assert ref["eval_losses"]


@pytest.mark.parametrize("sp", ["true", "false"], ids=["sp", "no-sp"])
def test_context_expert_and_tensor_parallel_equals_one_process(sp):
    """cp 2 x tp 2 with ep 2 over the cp ranks (world 4), capacity routing: each sequence in four slices, cp-
    major (slice c tp + t), an expert's queue running on through all of them."""
    run(4, {"parallel.tp": "2", "parallel.cp": "2", "parallel.dp": "1", "parallel.ep": "2", "parallel.sp": sp},
        CAPACITY)


def test_pipeline_and_tensor_parallel_equals_one_process():
    """pp 2 x tp 2 (sp, world 4): each stage's MoE layer split over its tp ranks, its auxiliary losses run
    backward with the stage's output."""
    run(4, {"parallel.tp": "2", "parallel.pp": "2", "parallel.dp": "1", "parallel.sp": "true"})


def test_tensor_and_data_parallel_with_zero_3_equals_one_process():
    """tp 2 x dp 2 at ep 1 (ZeRO-3, no sp): the whole experts reduce and shard over all four ranks."""
    run(4, {"parallel.tp": "2", "parallel.dp": "2", "parallel.zero_stage": "3", "parallel.persist_threshold": "100"})


def test_router_bias_under_tensor_parallelism_equals_one_process():
    """DeepSeek-V3's bias at tp 2 (sp): the loads the update reads are summed over the tp ranks' slices."""
    common = {**MOE, "model.router_bias_update_rate": "0.01"}
    results = run_distributed(dist_fns.train_and_capture, 2, {**common, **TP2, "parallel.sp": "true"}, timeout=240)
    ref = one_thread_reference(common)
    check_layouts(results, ref)
    assert any(any(v) for v in ref["router_bias"].values())
    for r in results:
        assert r["router_bias"] == ref["router_bias"]


def test_a_checkpoint_saved_at_tp_2_x_ep_2_resumes_at_one_process(tmp_path):
    """Saved at tp 2 x ep 2 (dp 2, ZeRO-1, sharded: every element written once though each expert is on two tp
    ranks), resumed at one process: the remaining steps' losses and the final weights are the uninterrupted
    run's."""
    over = {**MOE, "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5"}
    full = run_distributed(dist_fns.train_and_capture, 4,
                           {**over, "parallel.tp": "2", "parallel.dp": "2", "parallel.ep": "2",
                            "parallel.zero_stage": "1"}, str(tmp_path / "a"), timeout=240)
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    # Every element of every master and moment written once over the world, the experts' too (each of their
    # blocks on two tp ranks, counted by one of the four ranks of its edp+tp group).
    written = collections.Counter()
    for entry in json.loads((ckpt / "manifest.json").read_text())["pieces"]:
        written[entry["name"], entry["kind"]] += entry["hi"] - entry["lo"]
    assert {name for name, _ in written} == set(full[0]["masters"])
    for (name, kind), count in written.items():
        assert count == full[0]["masters"][name].numel(), (name, kind, count)
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), str(ckpt))
    assert resumed["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-5)
    for name, value in full[0]["masters"].items():
        torch.testing.assert_close(resumed["masters"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_config_allows_tensor_parallel_experts_and_refuses_what_cannot_split():
    validate(load_config("mixtral-tiny", {"parallel.tp": "2", "parallel.dp": "2", "parallel.ep": "2",
                                          "train.micro_batch_size": "2"}), world_size=4)
    with pytest.raises(ConfigError, match="routes its slice of every sequence"):
        validate(load_config("mixtral-tiny", {"parallel.tp": "2", "parallel.dp": "1", "train.seq_len": "31"}),
                 world_size=2)
    with pytest.raises(ConfigError, match="shared expert"):
        validate(load_config("mixtral-tiny", {"parallel.tp": "2", "parallel.dp": "1",
                                              "model.shared_expert_ffn_hidden_size": "33"}), world_size=2)
