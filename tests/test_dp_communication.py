"""What the data-parallel engines communicate, and when: nothing on accumulation micro-steps before the
last, DDP's buckets in backward's order while it runs, ZeRO's reduce-scatters and all-gathers, ZeRO-3's
gathers and prefetches, 16-bit gradients summed in fp32 by every algorithm, the copy engines' choice
and staging ring."""

import pytest
import torch

import dist_fns
from dp_cases import MODES, OFFLOADED, gpus_for, on
from shardlm.testing.distributed import run_distributed


@pytest.mark.parametrize("mode", ["classic", "ddp", "zero1"])
def test_accumulation_micro_steps_communicate_only_on_the_last(mode):
    """DDP, classic DP and ZeRO-1 accumulate gradients locally: the first two of three micro-steps issue
    no collective, the last one reduces. (ZeRO-2/3 reduce-scatter every micro-step, so that no rank
    holds a full gradient.)"""
    overrides = {"train.global_batch_size": "12", "train.micro_batch_size": "2", **MODES[mode]}
    for micro_steps, _ in run_distributed(dist_fns.collectives_per_micro_step, 2, overrides, timeout=120):
        counts = [len(calls) for calls in micro_steps]
        assert counts[0] == counts[1] == counts[3] == counts[4] == 0, counts
        assert counts[2] > 0 and counts[5] > 0, counts


def test_ddp_reduces_buckets_in_reverse_order_while_backward_runs():
    """Buckets of at most `parallel.bucket_mb` (a bigger tensor alone) in reverse registration order, the
    order backward produces gradients; one all-reduce per bucket, in bucket order, each issued as its
    bucket fills: the first after a few gradients, every one before backward ends."""
    mb = 0.02
    calls, buckets, params = run_distributed(dist_fns.ddp_launches_in_backward, 2,
                                             {"parallel.bucket_mb": str(mb)}, timeout=120)[0]
    registered, sizes = [n for n, _ in params], dict(params)
    backward_order = {n: i for i, n in enumerate(registered[::-1])}
    # Consecutive runs of that order (within a bucket the matrices are laid out first).
    assert [n for b in buckets for n in sorted(b, key=backward_order.get)] == registered[::-1]
    for b in buckets:
        assert len(b) == 1 or sum(sizes[n] for n in b) * 4 <= mb * 2**20, b
    assert len(buckets) > 10 and len(calls) == len(buckets), calls
    for (name, numel, _), b in zip(calls, buckets):
        assert name == "all_reduce" and 0 <= numel - sum(sizes[n] for n in b) < 2, (calls, b)  # padded to 2 ranks
    seen = [s for _, _, s in calls]  # gradients produced when each was issued
    assert seen[0] < len(registered) // 4 and seen[-1] < len(registered), seen
    assert all(a < b for a, b in zip(seen, seen[1:])), seen  # each at its own point of backward


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("algo", ["all_to_all", "ring"])
def test_zero_reduce_scatters_gradients_and_all_gathers_weights(stage, algo):
    """Real reduce-scatters (NCCL's, or an all-to-all of 16-bit values summed by each slice's owner) and
    all-gathers: the only all-reduce is the clipping norm's single element, never a gradient."""
    overrides = {"train.global_batch_size": "8", "train.micro_batch_size": "2", "train.precision": "bf16",
                 "parallel.reduce_algo": algo, **MODES[f"zero{stage}"]}
    scatter = {"all_to_all": {"all_to_all_single"}, "ring": {"reduce_scatter_tensor", "reduce_scatter_single"}}[algo]
    for micro_steps, step in run_distributed(dist_fns.collectives_per_micro_step, 2, overrides, timeout=120):
        calls = [c for m in micro_steps for c in m] + step
        names = {name for name, _, _ in calls}
        assert names & scatter and names & {"all_gather_into_tensor", "all_gather_single"}, names
        assert all(numel == 1 for name, numel, _ in calls if name == "all_reduce"), calls


def test_zero3_frees_each_block_after_use():
    kinds, rest, after_forward, after_backward = run_distributed(dist_fns.zero3_residency, 2, timeout=120)[0]
    assert sorted(set(kinds)) == ["block", "embed", "head", "unsharded"]
    for kind, a, f, b in zip(kinds, rest, after_forward, after_backward):
        assert a == (kind == "unsharded")  # at rest only the small parameters are whole
        # Blocks are freed after their forward and the embeddings after the lookup; the head waits for backward.
        assert f == (kind in ("unsharded", "head")), kind
        assert b == (kind == "unsharded")


def test_zero3_prefetches_the_next_block_while_one_computes():
    forward, backward = run_distributed(dist_fns.zero3_prefetch, 2, timeout=120)[0]
    assert forward == {0: True, 1: True, 2: True, 3: True}
    assert backward == {1: True, 2: True, 3: True}


@pytest.mark.parametrize("algo,world", [("all_to_all", 2), ("ring", 2), ("all_to_all", 4), ("ring", 4),
                                        pytest.param("copy_engine", 2, marks=gpus_for(2)),
                                        pytest.param("copy_engine", 4, marks=gpus_for(4))])
def test_ddp_sums_bf16_gradients_in_fp32(world, algo):
    """The fp32 reduction of 16-bit gradients (an fp32 reduce-scatter, by either algorithm, then a bf16
    all-gather) gives the fp32 sum over ranks rounded once to bf16, on every rank."""
    for rank_result in run_distributed(dist_fns.reduced_bf16_gradients, world, {"parallel.reduce_algo": algo},
                                       timeout=120, device=on(algo)):
        for name, got, expected in rank_result:
            assert torch.equal(got, expected), name


@pytest.mark.parametrize("algo,world", [("all_to_all", 2), ("ring", 2), ("all_to_all", 4),
                                        pytest.param("copy_engine", 2, marks=gpus_for(2)),
                                        pytest.param("copy_engine", 4, marks=gpus_for(4))])
def test_ddp_takes_the_norm_from_its_reduced_slices(world, algo):
    """DDP's gradient sum of squares, each rank's reduce-scatter slices squared as they are reduced and the
    ranks' sums added by the norm's one all-reduce, is that of the reduced gradient (only the order of the
    fp32 additions differs) and the same bits on every rank: clipping then scales every rank's update alike."""
    results = run_distributed(dist_fns.ddp_grad_sumsq, world, {"parallel.reduce_algo": algo}, timeout=120,
                              device=on(algo))
    assert len({bits for bits, _, _ in results}) == 1
    for _, got, want in results:
        assert got == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("stage,algo,world", [(1, "all_to_all", 4), (2, "all_to_all", 4), (2, "ring", 4),
                                              (3, "all_to_all", 4), (2, "all_to_all", 2),
                                              pytest.param(1, "copy_engine", 2, marks=gpus_for(2)),
                                              pytest.param(2, "copy_engine", 2, marks=gpus_for(2)),
                                              pytest.param(3, "copy_engine", 2, marks=gpus_for(2)),
                                              pytest.param(1, "copy_engine", 4, marks=gpus_for(4)),
                                              pytest.param(2, "copy_engine", 4, marks=gpus_for(4)),
                                              pytest.param(3, "copy_engine", 4, marks=gpus_for(4))])
def test_zero_sums_bf16_gradients_in_fp32(stage, algo, world):
    """ZeRO's fp32 gradient shard of bf16 gradients is the rank's slice of the fp32 sum over ranks (no
    16-bit rounding on the way), whichever algorithm moved the data. all_to_all adds the ranks' copies
    with the reference's own op: equal bits, as two terms give by any algorithm. The ring adds them in
    ring order and the copy engines' kernel in rank order, which torch's sum need not follow: at four
    ranks an fp32 sum of terms of far apart magnitudes can then differ in its last bit."""
    over = {"parallel.zero_stage": str(stage), "parallel.reduce_algo": algo}
    tol = 0.0 if algo == "all_to_all" or world == 2 else 2**-22
    for rank_result in run_distributed(dist_fns.reduced_bf16_gradients, world, over, timeout=120, device=on(algo)):
        for name, got, expected in rank_result:
            assert torch.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True), name


@pytest.mark.parametrize("mode,other", [("ddp", "ring"), ("zero2", "ring"),
                                        pytest.param("ddp", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero1", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero2", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero1-offload", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero2-offload", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero3", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero3-offload", "copy_engine", marks=gpus_for(2)),
                                        pytest.param("zero3-offload-params", "copy_engine", marks=gpus_for(2))])
def test_bf16_training_is_the_same_by_either_reduction_algorithm(mode, other):
    """bf16 training with accumulation: summing the gradients in fp32 by all-to-all (16-bit values
    travel), by an fp32 ring reduce-scatter or by copy-engine transfers gives the same run, bit for bit,
    at two ranks (a sum of two fp32 terms does not depend on their order); for ZeRO that also checks the
    copy engines' all-gathers of the weights (ZeRO-1/2's after the step, ZeRO-3's of each unit around its
    use) and ZeRO-2/3's reuse of their staging ring. Small buckets (ten), so that many reductions are in
    flight at once."""
    layout = OFFLOADED.get(mode) or MODES[mode]
    common = {"train.steps": "3", "train.global_batch_size": "8", "train.micro_batch_size": "2",
              "train.precision": "bf16", "parallel.dp": "2", "parallel.bucket_mb": "0.02", **layout}
    runs = [run_distributed(dist_fns.train_and_capture, 2, {**common, "parallel.reduce_algo": algo}, timeout=240,
                            device=on(other)) for algo in ("all_to_all", other)]
    for a, b in zip(*runs):
        assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    masters = [next(r["masters"] for r in run if r["masters"] is not None) for run in runs]
    for name, value in masters[0].items():
        assert torch.equal(value, masters[1][name]), name


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2", "zero3", "zero3-offload-params"])
def test_auto_reduction_takes_the_copy_engines_on_the_gpus_of_one_node(mode):
    gpus = torch.cuda.device_count() >= 2
    over = dict(MODES[mode])
    if gpus:
        over["train.device"] = "cuda"
    want = "copy_engine" if gpus else "all_to_all"
    assert run_distributed(dist_fns.chosen_reduce_algo, 2, over, timeout=120, device="cuda" if gpus else "cpu") \
        == [want, want]


def test_copy_engine_reduction_needs_gpus():
    """Without GPUs the copy-engine reduction is refused with a message naming it, on every rank (the
    harness's CPU ranks see no GPU, on any machine)."""
    with pytest.raises(Exception, match="copy_engine"):
        run_distributed(dist_fns.train_and_capture, 2, {"train.steps": "1", "train.global_batch_size": "4",
                                                         "train.micro_batch_size": "2", "parallel.dp": "2",
                                                         "train.device": "cpu", "parallel.reduce_algo": "copy_engine"},
                        timeout=120)


@pytest.mark.parametrize("window", [1, 2, 5])
def test_the_staging_ring_keeps_any_window_of_consecutive_buckets_apart(window):
    """ZeRO-2/3's copy-engine staging reuses ring ranges: any `window` consecutive buckets (those in use at
    once) must occupy disjoint ranges inside the ring, for buckets of any sizes, and the ring must stay
    smaller than the whole gradient where the window is."""
    from shardlm.comm.copy_engine import ring_offsets
    gen = torch.Generator().manual_seed(window)
    for _ in range(50):
        numels = (torch.randint(1, 40, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen) * 4).tolist()
        offsets, size = ring_offsets(numels, window)
        assert size <= sum(numels)
        assert all(0 <= o and o + n <= size for o, n in zip(offsets, numels))
        for b in range(len(numels)):
            spans = sorted((offsets[c], offsets[c] + numels[c]) for c in range(b, min(b + window, len(numels))))
            assert all(a[1] <= z[0] for a, z in zip(spans, spans[1:])), (numels, window, b)
    assert ring_offsets([10] * 100, 5)[1] == 50  # equal buckets wrap with no tail
    assert ring_offsets([30, 20, 20, 20, 10, 30], 2) == ([0, 30, 0, 20, 40, 0], 50)  # 80 without the search
