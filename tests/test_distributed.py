"""The multi-process harness itself, the device mesh, and the tensor-parallel layers at degree 2 and 4."""
from pathlib import Path

import pytest
import torch

import dist_fns
from shardlm.testing.distributed import DistributedError, run_distributed


@pytest.mark.parametrize("world", [2, 4])
def test_harness_runs_collectives(world):
    assert run_distributed(dist_fns.all_reduce_rank, world) == [world * (world + 1) / 2] * world


def test_harness_cpu_ranks_see_no_gpu(monkeypatch):
    """CPU ranks (the default) must not drift onto a GPU where the machine has one: the tests compare them
    with references computed on the CPU. The caller here asks for GPU 0; its CPU ranks must still see none,
    on any machine."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_distributed(dist_fns.visible_gpus, 2) == [(0, "")] * 2


def test_harness_fails_a_hang_within_its_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 4s"):
        run_distributed(dist_fns.hang_on_rank_one, 2, timeout=4)


def test_harness_reports_a_rank_error():
    with pytest.raises(DistributedError, match="boom on rank 0"):
        run_distributed(dist_fns.raise_on_rank_zero, 2, timeout=60)


@pytest.mark.timeout(60)
def test_peers_wait_for_long_work_past_the_group_timeout_as_long_as_it_moves():
    """A resume or a tensor-parallel load: the first rank picks and verifies the checkpoint (every byte's CRC32,
    many minutes for a large model on a network disk) while the others waited in one broadcast, ended by the
    process group's timeout; a save: each rank writes its shards, the first done waiting for the last. They
    now wait as long as the work, and its error reaches them all; work stuck (a filesystem that hangs), whose
    waits then lasted forever, ends every rank's wait after the stall limit (the group's timeout), named."""
    stuck = "made no progress for 1 s (parallel.timeout_s): a read or write that does not return"
    assert run_distributed(dist_fns.long_work_past_the_timeout, 2, 1.6) == [
        ["picked", "damaged", f"the pick {stuck} (a network filesystem that hangs?)", "all done",
         f"the writes on rank 1 {stuck} (a network filesystem that hangs?)"]] * 2


@pytest.mark.timeout(60)
def test_the_default_corpus_prepared_by_rank_0_is_waited_for_while_it_moves_and_ends_every_rank_if_stuck(tmp_path):
    """The other ranks wait for rank 0's preparation of the default corpus; a preparation stuck (a cache on a
    filesystem that hangs) kept every rank waiting forever, as rank 0's answers kept the group alive. Reads that
    move take longer than parallel.timeout_s and are waited for; stuck, every rank stops, naming it."""
    got = run_distributed(dist_fns.default_corpus_of_rank_0, 2, str(tmp_path / "moving"), False)
    assert got[0] == got[1] and (Path(got[0]) / "index.json").is_file(), got
    said = ("rank 0's preparation of the default corpus made no progress for 2 s (parallel.timeout_s): a read or "
            "write that does not return")
    assert all(r.startswith(said) for r in run_distributed(dist_fns.default_corpus_of_rank_0, 2,
                                                            str(tmp_path / "stuck"), True)), said


def test_mesh_groups_at_world_4():
    results = run_distributed(dist_fns.mesh_groups, 4, 2, 2, 1)
    # grid (pp=1, dp=2, tp=2): tp pairs {0,1},{2,3}; dp pairs {0,2},{1,3}
    coords = [r[0] for r in results]
    assert coords == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    sums = [r[1] for r in results]
    assert [s["tp"] for s in sums] == [1, 1, 5, 5]
    assert [s["dp"] for s in sums] == [2, 4, 2, 4]
    assert [s["pp"] for s in sums] == [0, 1, 2, 3]


def test_expert_view_carves_ep_out_of_dp_and_cp():
    """(pp, dp, cp, tp) = (1, 2, 2, 2) read as (pp, edp, ep, tp) = (1, 2, 2, 2): ep innermost of the dp x cp
    block, so its ranks are tp apart; edp's are ep x tp apart; ep 1 leaves edp the dp x cp group itself."""
    results = run_distributed(dist_fns.mesh_views, 8, 2, 2, 2, 2)
    for rank, (coords, sums) in enumerate(results):
        replica = rank // 2  # the rank's index in the dp x cp block
        assert coords == {"dp": replica // 2, "cp": replica % 2, "tp": rank % 2, "edp": replica // 2,
                          "ep": replica % 2}
        tp_base = rank % 2
        assert sums["dp+cp"] == sum(tp_base + 2 * r for r in range(4))
        assert sums["ep"] == sum(tp_base + 2 * (2 * (replica // 2) + e) for e in range(2))
        assert sums["edp"] == sum(tp_base + 2 * (2 * d + replica % 2) for d in range(2))
    for rank, (coords, sums) in enumerate(run_distributed(dist_fns.mesh_views, 4, 2, 2, 1, 1)):
        assert coords["ep"] == 0 and coords["edp"] == rank
        assert sums["edp"] == sums["dp+cp"] == 6 and sums["ep"] == rank


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_layers_equal_degree_one(world):
    y, x_grad, col_grad, row_grad, emb_grad = dist_fns.tensor_parallel_mlp(0, 1, 0, distributed=False)
    n = 16 // world
    for rank, (y_r, xg, cg, rg, eg) in enumerate(run_distributed(dist_fns.tensor_parallel_mlp, world, 0)):
        torch.testing.assert_close(y_r, y, rtol=1e-5, atol=1e-5)  # partial sums add in another order
        torch.testing.assert_close(xg, x_grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cg, col_grad[rank * n:(rank + 1) * n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rg, row_grad[:, rank * n:(rank + 1) * n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(eg, emb_grad.chunk(world)[rank], rtol=1e-5, atol=1e-5)
