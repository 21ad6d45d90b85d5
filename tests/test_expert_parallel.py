"""Expert parallelism (parallel/expert.py): `mixtral-tiny` with its experts split over ep ranks trains as one
process does in fp32 (losses, gradient norms, gathered weights, gradients and optimizer state) and in fp16 (as
data parallelism does), checkpoints saved at ep 2 and ep 4 resume at one process on the same trajectory, and an
ep 2 run's export is the one-process run's."""
import pytest
import torch

import dist_fns
from dp_cases import ATOL, MODES, OFFLOADED, RTOL, check_trajectory, equality_case, reference
from shardlm.config import load_config, validate
from shardlm.testing.distributed import run_distributed

MOE = {"model.num_experts": "4", "model.top_k": "2", "train.moe_z_loss_coef": "0.001"}  # `tiny` made mixtral-tiny


def check(results, ref, world, ep):
    """Each rank against one process: an expert's owned slices are of its rank's block of experts, so they
    sit at block (rank's ep coordinate) of the full tensor; together the ranks own every element once
    (sharded) or each of its replicas, edp = world / ep of them, all of it."""
    for r in results:
        assert r["numel"] < ref["numel"]  # each rank holds its block of the experts only
    check_trajectory(results, ref)
    for key in ("grad", "state"):
        covered = {}
        for rank, r in enumerate(results):
            for name, (lo, hi, got) in r[key].items():
                full = ref[key][name][2]
                if ".experts." in name:
                    shift = (rank % ep) * full.numel() // ep  # ep innermost of dp: coordinate rank % ep
                    lo, hi = lo + shift, hi + shift
                torch.testing.assert_close(got, full[lo:hi], rtol=RTOL, atol=ATOL, msg=f"{key} {name}[{lo}:{hi}]")
                covered[name] = covered.get(name, 0) + hi - lo
        for name, (_, _, full) in ref[key].items():
            replicas = world // ep if ".experts." in name else world
            assert covered.get(name, 0) in (full.numel(), replicas * full.numel()), (key, name, covered.get(name))


@pytest.mark.parametrize("world, mode, optimizer", [
    (2, "ddp", "adamw"), (2, "zero1", "adamw"), (2, "zero2", "adamw"), (2, "zero3", "adamw"), (4, "ddp", "adamw"),
    (4, "zero1", "adamw"), (4, "zero3", "adamw"), (2, "zero2-offload", "adamw"), (2, "zero3-offload", "adamw"),
    (4, "zero1-offload", "adamw"), (2, "ddp", "sgd"), (4, "zero3", "sgd")])
def test_expert_parallel_equals_one_process(world, mode, optimizer):
    """ep 2 at dp 2 (each rank its two experts, edp 1) and at dp 4 (edp 2: each block of experts on two
    ranks, reduced over them with dp's divisor); two micro-batches a rank (one at world 4: the batch is 8)."""
    common = {**equality_case(optimizer, world), **MOE}
    if world == 4:
        common["train.micro_batch_size"] = "1"
    results = run_distributed(dist_fns.train_and_capture, world,
                              {**common, **{**MODES, **OFFLOADED}[mode], "parallel.dp": str(world), "parallel.ep": "2"}, timeout=300)
    check(results, reference(common), world, 2)


@pytest.mark.parametrize("world, mode, dispatch", [(4, "ddp", "auto"), (4, "zero3", "padded"), (2, "zero1", "exact")])
def test_each_dispatch_equals_one_process(world, mode, dispatch):
    """ep = dp = world under each `parallel.ep_dispatch`: at ep 4 (one expert a rank, each exchange among four
    ranks) the default sends exact counts, the padded blocks are asked for; at ep 2 the exact form is asked for
    (the padded one, ep 2's default, is every other test's)."""
    common = {**equality_case("adamw", world), **MOE}
    if world == 4:
        common["train.micro_batch_size"] = "1"
    results = run_distributed(dist_fns.train_and_capture, world,
                              {**common, **MODES[mode], "parallel.dp": str(world), "parallel.ep": str(world),
                               "parallel.ep_dispatch": dispatch}, timeout=300)
    check(results, reference(common), world, world)
    if world == 4:  # one expert a rank: the busiest rank's load over the mean is the busiest expert's
        for stats in results[0]["moe"]:
            for key in (k for k in stats if k.endswith("/ep_max_over_mean")):
                assert stats[key] == pytest.approx(stats[key.replace("/ep_max", "/max")], rel=1e-12)
        assert any(k.endswith("/ep_max_over_mean") for k in results[0]["moe"][0])


def test_a_checkpoint_saved_at_ep_2_resumes_at_one_process(tmp_path):
    """Saved at ep 2 (dp 2, ZeRO-1, sharded: each rank's pieces of its experts with their ep sharding),
    resumed at one process: the remaining steps' losses are the uninterrupted run's."""
    over = {**MOE, "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5"}
    full = run_distributed(dist_fns.train_and_capture, 2,
                           {**over, "parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "1"},
                           str(tmp_path / "a"), timeout=300)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), ckpt)
    assert resumed["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-5)
    # The weights at the end: the run resumed at one process equals the ep 2 run, expert by expert.
    for name, value in full[0]["masters"].items():
        torch.testing.assert_close(resumed["masters"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpoint_saved_at_ep_4_resumes_at_one_process(tmp_path):
    """Saved at ep 4 (dp 4, ZeRO-1, sharded: one expert a rank, each piece with its ep sharding), resumed at
    one process, which joins all four blocks: the remaining steps are an uninterrupted one-process run's."""
    over = {**MOE, "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5",
            "train.micro_batch_size": "1"}
    run_distributed(dist_fns.train_and_capture, 4,
                    {**over, "parallel.dp": "4", "parallel.ep": "4", "parallel.zero_stage": "1"},
                    str(tmp_path / "a"), timeout=300)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    one = {**over, "train.device": "cpu"}
    resumed = dist_fns.train_and_capture(0, 1, one, str(tmp_path / "b"), ckpt)
    ref = reference(one)
    assert resumed["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)
    for name, value in ref["masters"].items():
        torch.testing.assert_close(resumed["masters"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_export_of_an_expert_parallel_run_is_the_one_process_runs_hf_directory(tmp_path):
    """`shardlm export` of an ep 2 run's checkpoint (dp 2, ZeRO-1, sharded: each rank's block of experts)
    writes the whole stacked experts: the one-process run's Mixtral directory, config and tensors."""
    from helpers import assert_same_export
    steps = {**equality_case("adamw", 2), **MOE, "train.save_every": "0"}  # the equality tests' tolerance holds
    run_distributed(dist_fns.train_and_capture, 2,
                    {**steps, "parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "1"},
                    str(tmp_path / "ep"), timeout=300)
    dist_fns.train_and_capture(0, 1, {**steps, "train.device": "cpu"}, str(tmp_path / "one"))
    assert_same_export(tmp_path / "ep", tmp_path / "one", tmp_path / "hf", RTOL, ATOL)


FP16 = {**MOE, "train.steps": "3", "train.global_batch_size": "16", "train.micro_batch_size": "4",
        "train.precision": "fp16", "parallel.dp": "2", "parallel.zero_stage": "1"}


def fp16_deviation(over: dict, ref: dict) -> tuple[float, int]:
    """A dp 2 run's losses and gradient norms checked against one process's `ref` (no step skipped in either:
    the trajectories are comparable); returns its weights' largest difference and how many differ by > 1e-4."""
    results = run_distributed(dist_fns.train_and_capture, 2, over, timeout=300)
    assert all(n < float("inf") for r in [ref, *results] for n in r["grad_norms"])
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-4, atol=0)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=3e-4, atol=0)
    diffs = [(results[0]["masters"][k] - w).abs() for k, w in ref["masters"].items()]
    return max(float(d.max()) for d in diffs), sum(int((d > 1e-4).sum()) for d in diffs)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_expert_parallel_in_fp16_trains_as_one_process(optimizer):
    """fp16 at ep 2 (dp 2, ZeRO-1) against one process in fp16, 16 sequences a step (at 8, the skipped steps
    are the test below's). The experts' matmuls round in fp16 over both ranks' tokens at once,
    one process's per micro-batch: losses and gradient norms agree to 1e-4 and 3e-4, SGD's weights to 3e-5.
    AdamW turns the rounding of a nearly cancelling gradient into up to lr a step (its update is m / sqrt(v),
    about 1 in size whatever the gradient's), as data parallelism's own fp16 roundings do, so its weights are
    held to that: within 3 steps of lr, and under 3% of them beyond 1e-4. Which weights those are depends on
    the data and on the CPU's kernels: dp 2 at ep 1 against one process, the control this test once ran beside
    it, reached 3.9e-3 with 5,993 weights of 288k beyond 1e-4 (2.1%; ep 2: 6,024) when it was written, 9.1e-4
    with 45 (ep 2: 1.3e-3, 459) with the packages of 2026-11-30, and ep 2 3.9e-3 with 6,027 on the machine of
    2026-12-01 (data parallelism's own share there: a bound of 2% failed it)."""
    over = {**FP16, **({"train.optimizer": "sgd", "train.lr": "1e-2"} if optimizer == "sgd" else {})}
    ref = reference({k: v for k, v in over.items() if not k.startswith("parallel.")})
    furthest, far = fp16_deviation({**over, "parallel.ep": "2"}, ref)
    if optimizer == "sgd":
        assert furthest <= 3e-5, furthest
        return
    lr, weights = load_config("tiny").train.lr, sum(w.numel() for w in ref["masters"].values())
    assert furthest <= 3 * lr and far <= 0.03 * weights, (furthest, far, weights)


@pytest.mark.parametrize("layout", [{}, {"parallel.ep": "2"}, {"parallel.zero_stage": "3"},
                                    {"parallel.dp": "1", "parallel.cp": "2"}], ids=["dp2", "ep2", "zero3", "cp2"])
def test_fp16_at_dp_2_and_ep_2_skips_only_the_steps_one_process_skips(layout):
    """At a batch of 8 (4 sequences a rank), each rank's mean over its own tokens made its gradients,
    activations' too, twice one process's per token: dp 2 and ep 2 overflowed at the first loss scale and
    skipped two steps that one process ran. Each rank's loss is now divided by the data replicas before
    backward (Engine.loss_factor, fp16 only): the same steps run, the same loss scales, the same losses and
    gradient norms as one process (ZeRO-3 and context parallelism too, whose divisor is the same)."""
    over = {**FP16, "train.global_batch_size": "8", "train.optimizer": "sgd", "train.lr": "1e-2"}
    ref = reference({k: v for k, v in over.items() if not k.startswith("parallel.")})
    for r in run_distributed(dist_fns.train_and_capture, 2, {**over, **layout}, timeout=300):
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=3e-4), (r["grad_norms"], ref["grad_norms"])
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-4, atol=0)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_checkpoint_saved_at_ep_4_resumes_at_ep_2_x_edp_2(tmp_path, fmt):
    """Saved at ep 4 (dp 4, ZeRO-1: one expert a rank), resumed at ep 2 with two replicas of each block (dp 4,
    ZeRO-3): the remaining steps' losses are the uninterrupted run's."""
    over = {**MOE, "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5",
            "train.micro_batch_size": "1", "parallel.dp": "4", "train.checkpoint_format": fmt}
    full = run_distributed(dist_fns.train_and_capture, 4, {**over, "parallel.ep": "4", "parallel.zero_stage": "1"},
                           str(tmp_path / "a"), timeout=300)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    resumed = run_distributed(dist_fns.train_and_capture, 4,
                              {**over, "parallel.ep": "2", "parallel.zero_stage": "3", **MODES["zero3"]},
                              str(tmp_path / "b"), ckpt, timeout=300)
    assert resumed[0]["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-5)
    for name, value in full[0]["masters"].items():
        torch.testing.assert_close(resumed[0]["masters"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_config_allows_ep_within_data_parallelism_only():
    validate(load_config("mixtral-tiny", {"parallel.dp": "4", "parallel.ep": "2", "train.micro_batch_size": "1"}),
             world_size=4)
    validate(load_config("mixtral-tiny", {"parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "3"}),
             world_size=2)


def test_expert_parallel_with_recomputation_evaluation_and_a_sample():
    """Full recomputation runs the all-to-alls again inside backward; evaluation and the closing sample run
    the dispatch on every rank (each rank the same batches): losses, eval losses and weights equal one
    process's."""
    common = {**equality_case("adamw", 2), **MOE, "train.recompute": "full", "train.eval_every": "2",
              "train.sample_tokens": "4"}
    results = run_distributed(dist_fns.train_and_capture, 2,
                              {**common, "parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "1"},
                              timeout=300)
    ref = reference(common)
    assert ref["eval_losses"] and results[0]["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-5)
    check(results, ref, 2, 2)


@pytest.mark.slow
def test_compiled_blocks_at_ep_2_equal_eager():
    """train.compile: the padded dispatch (ep 2's default) traced into the blocks' graphs equals eager."""
    common = {**equality_case("adamw", 2), **MOE, "train.steps": "2", "parallel.dp": "2", "parallel.ep": "2"}
    eager = run_distributed(dist_fns.train_and_capture, 2, common, timeout=300)
    compiled = run_distributed(dist_fns.train_and_capture, 2, {**common, "train.compile": "true"}, timeout=600)
    torch.testing.assert_close(compiled[0]["losses"], eager[0]["losses"], rtol=RTOL, atol=0)
    for name, value in eager[0]["masters"].items():
        torch.testing.assert_close(compiled[0]["masters"][name], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("routing", ["natural", "one-rank"])
def test_dispatch_equals_one_process_even_when_one_rank_gets_every_token(routing, padded):
    """One MoE layer at ep 2, rows sent by exact counts or in fixed-size blocks: each rank's outputs and input
    gradients, its block of the experts' gradients and the router's (summed) equal one process's on the same
    tokens; with every token routed to rank 0's experts rank 1 receives no rows (its blocks all padding) and
    still takes part in each exchange."""
    ref = dist_fns.expert_parallel_layer(0, 1, routing)  # both ranks' 16 tokens at one process
    results = run_distributed(dist_fns.expert_parallel_layer, 2, routing, padded, timeout=120)
    assert_layer_equals_one_process(results, ref)
    if routing == "one-rank":
        assert not results[1]["up"].any() and not results[1]["down"].any()


def assert_layer_equals_one_process(results: list[dict], ref: dict) -> None:
    """Each rank's outputs and input gradients for its 8 tokens, its block of two experts' gradients and the
    router's (summed) equal one process's."""
    for rank, r in enumerate(results):
        rows = slice(8 * rank, 8 * (rank + 1))
        torch.testing.assert_close(r["y"], ref["y"][rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["x_grad"], ref["x_grad"][rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["router"], ref["router"], rtol=1e-5, atol=1e-6)
        for name in ("up", "down"):
            torch.testing.assert_close(r[name], ref[name][2 * rank:2 * (rank + 1)], rtol=1e-5, atol=1e-6)


def test_exact_dispatch_in_chunks_equals_one_process_when_one_rank_gets_every_token():
    """parallel.ep_load_budget 1.5: rank 0, sent every row (32, twice its 16 token copies), runs its experts
    in chunks of 24 rows, the first cutting through expert 1's, each chunk recomputed in backward; outputs,
    input gradients and the experts' and router's gradients equal one process's. Rank 1 (no rows) runs none."""
    ref = dist_fns.expert_parallel_layer(0, 1, "one-rank")
    results = run_distributed(dist_fns.expert_parallel_layer, 2, "one-rank", False, 1.5, timeout=120)
    assert [r["chunked"] for r in results] == [1, 0]
    assert_layer_equals_one_process(results, ref)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_training_routed_to_one_rank_runs_in_chunks_and_equals_one_process(recompute):
    """Every token routed to rank 0's experts at ep 2, exact dispatch, parallel.ep_load_budget 1.5: losses,
    gradient norms, gathered weights, gradients and optimizer state equal one process's (whose experts take one
    balanced load and never run in chunks); the statistics count rank 0's chunked forwards, every layer's in
    each of its two micro-batches a step, once under full recomputation (whose second forward, inside
    backward, runs the chunks' checkpoints nested in the block's)."""
    common = {**equality_case("adamw", 2), **MOE, "train.recompute": recompute}
    results = run_distributed(dist_fns.train_routed_to_one_rank, 2,
                              {**common, **MODES["zero1"], "parallel.dp": "2", "parallel.ep": "2",
                               "parallel.ep_dispatch": "exact", "parallel.ep_load_budget": "1.5"}, timeout=300)
    check(results, dist_fns.train_routed_to_one_rank(0, 1, common), 2, 2)
    for stats in results[0]["moe"]:
        chunked = {k: v for k, v in stats.items() if k.endswith("/chunked")}
        assert chunked and set(chunked.values()) == {2}, stats
