"""A mixture of experts under pipeline and context parallelism, with and without expert parallelism: each stage
its own layers' experts and auxiliary losses (parallel/pipeline.py), each cp rank a slice of every sequence
with the routing statistics reduced over the cp group (parallel/context.py's SlicedSequences). Each layout
trains as one process does in fp32: losses, gradient norms, gathered weights and the logged per-layer
statistics (dropped copies exactly)."""
import pytest
import torch

import dist_fns
from dp_cases import ATOL, check_trajectory, reference
from shardlm.testing.distributed import run_distributed
from test_moe_routing import check_layouts

# `tiny` made mixtral-tiny, with both auxiliary losses on (their gradients are what a stage or a slice could
# get wrong); four micro-batches of two sequences a step, at least one per pipeline stage.
MOE = {"model.num_experts": "4", "model.top_k": "2", "train.moe_aux_loss_coef": "0.01",
       "train.moe_z_loss_coef": "0.001", "train.steps": "3", "train.global_batch_size": "8"}
CAPACITY = {"model.capacity_factor": "1.0"}
# Split sequences sum a weight's gradient over the cp ranks and ring attention merges partial softmaxes, in
# another order than one process: test_context_parallel.py's Adam tolerance on the weights.
CP_ATOL = 5e-6


def one_thread_reference(common: dict) -> dict:
    """One process's run on one thread, as each rank runs (testing/distributed.py): the experts' CPU GEMMs
    round differently at other thread counts, which Adam would amplify past the trajectory's tolerance."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference(common)
    finally:
        torch.set_num_threads(threads)


def run(world: int, layout: dict, extra: dict | None = None, micro_batch: int = 2) -> dict:
    """The layout on `world` ranks and one process with the same micro-batches (and `extra`), checked equal."""
    common = {**MOE, "train.micro_batch_size": str(micro_batch), **(extra or {})}
    results = run_distributed(dist_fns.train_and_capture, world, {**common, **layout}, timeout=180)
    ref = one_thread_reference(common)
    check_trajectory(results, ref, CP_ATOL if "parallel.cp" in layout else ATOL)
    check_layouts(results, ref)
    return ref


PP2 = {"parallel.pp": "2", "parallel.dp": "1"}


@pytest.mark.parametrize("extra", [
    {}, CAPACITY, {**CAPACITY, "parallel.pp_schedule": "zb-h1"},
    {"parallel.pp_schedule": "interleaved", "parallel.virtual_stages": "2", "model.num_layers": "4"},
    {"model.moe_first_dense": "1"},
], ids=["1f1b", "capacity", "zero-bubble", "interleaved", "dense-first-stage"])
def test_pipeline_of_two_stages_equals_one_process(extra):
    """pp 2, one MoE layer a stage (two with interleaving, a rank's stages each adding their own; none on the
    first stage when the first layer is dense): each stage's balance and z-losses run backward with its
    output, their weight gradients kept whole under the zero-bubble schedule's split backward."""
    layout = {k: v for k, v in extra.items() if k.startswith("parallel.")}
    run(2, {**PP2, **layout}, {k: v for k, v in extra.items() if k not in layout})


@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_context_parallel_equals_one_process(comm):
    """cp 2, Ulysses and ring attention: each rank routes its half of every sequence; the balance loss's
    shares are the micro-batch's."""
    run(2, {"parallel.cp": "2", "parallel.dp": "1", "parallel.cp_comm": comm})


def test_capacity_routing_under_context_parallelism_equals_one_process():
    """cp 2: an expert's queue in a sequence runs on from the first half's rank into the second's, so the
    copies dropped are one process's."""
    ref = run(2, {"parallel.cp": "2", "parallel.dp": "1"}, CAPACITY)
    assert sum(v for r in ref["moe"] for k, v in r.items() if k.endswith("/dropped")) > 0  # capacity bites


@pytest.mark.parametrize("routing", [{}, CAPACITY], ids=["dropless", "capacity"])
def test_expert_parallel_over_the_context_parallel_ranks_equals_one_process(routing):
    """ep 2 x cp 2 at dp 1: the ep group is the cp group, each rank two experts and half of every sequence."""
    run(2, {"parallel.cp": "2", "parallel.dp": "1", "parallel.ep": "2"}, routing)


def test_expert_parallel_within_each_pipeline_stage_equals_one_process():
    """ep 2 x pp 2 (dp 2, world 4): each stage's experts split over its two data-parallel ranks."""
    run(4, {"parallel.pp": "2", "parallel.dp": "2", "parallel.ep": "2"}, micro_batch=1)


@pytest.mark.parametrize("layout", [
    {"parallel.cp": "2", "parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "1"},
    {"parallel.pp": "2", "parallel.cp": "2", "parallel.dp": "1", "parallel.ep": "2", "parallel.cp_comm": "p2p"},
], ids=["ep2-cp2-dp2-zero1", "ep2-cp2-pp2"])
def test_expert_parallel_over_context_parallel_ranks_at_world_4_equals_one_process(layout):
    """ep 2 over the cp ranks with two replicas of each block of experts (dp 2: edp 2, ZeRO-1), and within
    each of two pipeline stages (ring attention); capacity routing, so the queues cross ranks too."""
    run(4, layout, CAPACITY)


def test_router_bias_under_pipeline_and_context_parallelism_equals_one_process():
    """DeepSeek-V3's bias at pp 2 and cp 2: each stage updates its layers' from the loads over dp x cp."""
    bias = {"model.router_bias_update_rate": "0.01"}
    for world, layout in ((2, PP2), (2, {"parallel.cp": "2", "parallel.dp": "1"})):
        common = {**MOE, "train.micro_batch_size": "2", **bias}
        results = run_distributed(dist_fns.train_and_capture, world, {**common, **layout}, timeout=180)
        ref = one_thread_reference(common)
        check_layouts(results, ref)
        assert any(any(v) for v in ref["router_bias"].values())
        for r in results:
            assert r["router_bias"] == ref["router_bias"]


@pytest.mark.parametrize("layout", [{"parallel.cp": "2", "parallel.dp": "1"},
                                    {"parallel.pp": "2", "parallel.cp": "2", "parallel.dp": "1"}], ids=["cp2", "pp2-cp2"])
def test_instruction_data_under_context_parallelism_equals_one_process(tmp_path, layout):
    """Completion-only targets: a micro-batch's loss weighs by its share of the step's trained targets, each
    slice's by its own; the auxiliary losses, over whole sequences, by the whole micro-batch's share."""
    from test_finetune import sft_data
    run(2 * int(layout.get("parallel.pp", 1)), layout, {"data.path": sft_data(tmp_path), "train.seq_len": "24"})
