"""What the data-parallel engines hold: the ZeRO paper's memory per stage, offload's placement in pinned
host memory, and engines released with their trainer."""
import os

import pytest
import torch

import dist_fns
from dp_cases import MODES
from shardlm.testing.distributed import run_distributed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_per_stage_matches_the_zero_paper(stage):
    """Bytes held per rank, gradients reduced and before the step, at N = 4 with bf16 weights and Adam: (2 + 2 + K) Phi, 2 Phi + 2 Phi +
    K Phi / N, 2 Phi + (2 + K) Phi / N with K = 12 (fp32 master, momentum, variance) for stages 0-2.
    Stage 3 holds no 16-bit weights outside a gather (each gather casts the fp32 master slice, as FSDP2 does):
    (2 + K) Phi / N, below the paper's (2 + 2 + K) Phi / N."""
    world = 4
    over = {"train.steps": "1", "train.precision": "bf16", "parallel.dp": str(world), "train.micro_batch_size": "2",
            "parallel.zero_stage": str(stage), "parallel.reduce_dtype": "compute",
            "parallel.persist_threshold": "0", "parallel.bucket_mb": "0.05"}
    results = run_distributed(dist_fns.train_and_capture, world, over, timeout=240)
    for r in results:
        phi, got = r["numel"], r["bytes"]
        n = world
        want = {0: (2 * phi, 2 * phi, 12 * phi), 1: (2 * phi, 2 * phi, 12 * phi / n),
                2: (2 * phi, 2 * phi / n, 12 * phi / n), 3: (0, 2 * phi / n, 12 * phi / n)}[stage]
        # Padding aside: each bucket is padded to a multiple of N elements.
        for key, expected in zip(("params", "grads", "optimizer"), want):
            slack = 16 * world * 64  # < N elements of padding per bucket, at most 16 bytes each, < 64 buckets
            assert expected <= got[key] <= expected + slack, (stage, key, got[key], expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (pinned host memory needs CUDA)")
def test_offload_keeps_masters_and_optimizer_state_in_pinned_host_memory():
    none, opt, params = (run_distributed(dist_fns.offload_placement, 2, over, timeout=180, device="cuda")[0]
                         for over in ({}, {"parallel.offload": "optimizer"}, {"parallel.offload": "params"}))
    # Without offload, gathers cast the fp32 master slice on the GPU: no 16-bit shard is kept.
    assert none["master"] == {("cuda", False)} and none["shards"] == set()
    for got in (opt, params):
        assert got["master"] == got["host_grad"] == {("cpu", True)}
        assert got["state"] == {("cpu", False)}  # read and written by the CPU step only: no pinning needed
    assert opt["shards"] == {("cuda", False)} and params["shards"] == {("cpu", True)}
    # Per element of the shard: the fp32 master and both Adam moments (12 bytes) leave the GPU; offloading
    # the optimizer keeps a bf16 shard there (2 bytes), offloading the parameters too moves that out.
    # The allocator rounds each tensor up to 512 bytes: the offloaded mode's per-bucket shards may
    # round up where the three flat fp32 buffers did not (measured on 2x H100: 10 n - 64 bytes).
    n, rounding = opt["shard_numel"], 512 * opt["buckets"]
    assert none["gpu_bytes"] - opt["gpu_bytes"] >= 10 * n - rounding, (none, opt)
    assert none["gpu_bytes"] - params["gpu_bytes"] >= 12 * n - rounding, (none, params)


@pytest.mark.parametrize("gpu", [False, True])
def test_offload_threads_default_to_the_rank_share_of_the_cores(monkeypatch, gpu):
    """With a GPU one core of the share stays with the training thread, which launches kernels meanwhile."""
    import torch

    from shardlm.parallel.offload import offload_threads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert offload_threads(3) == 3
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert offload_threads(0) == max(1, cores - gpu)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert offload_threads(0) == 1
    # Bound to 16 of 128 cores (srun --cpus-per-task 16): the rank's share already, not divided by 8 ranks again.
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert offload_threads(0) == 16 - gpu


@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_close_releases_the_engine_before_the_process_group(mode):
    """What holds the process group (the engine; ZeRO-3's hooks hold the engine) is collected in close(),
    not left to interpreter shutdown, where gloo's threads can abort a finished rank."""
    assert run_distributed(dist_fns.engine_released_on_close, 2, MODES[mode], timeout=120) == [(True, False)] * 2


@pytest.mark.parametrize("mode", ["classic", "ddp", "zero1", "zero2", "zero3"])
def test_an_engine_is_freed_with_its_trainer(mode):
    """A sweep or a notebook builds many trainers in one process: each engine, with its gradients and
    optimizer state, must go when its trainer goes (the gradient hooks that parameters keep must not
    hold it)."""
    assert run_distributed(dist_fns.engine_freed_with_its_trainer, 2, MODES[mode], timeout=120) == [True, True]
