"""Tensor parallelism (Megatron column/row split, vocab-parallel embedding and loss) with and without sequence
parallelism, alone and composed with DDP and ZeRO, against one process (gloo on CPU, fp32): per-step
losses, gradient norms and the gathered weights; initialisation, resharding resume, eval and generation."""
import pytest
import torch

import dist_fns
from shardlm.config import ConfigError, load_config, validate
from dp_cases import ATOL, RTOL
from shardlm.testing.distributed import run_distributed

COMMON = {"train.steps": "3", "train.global_batch_size": "8", "train.micro_batch_size": "2"}
# A row-parallel linear sums each output from tp partial sums, so activations differ from one process's in
# the last bits of fp32 from the first layer on (data parallelism only reorders the final gradient sum).
# AdamW's step lr m / (sqrt(v) + eps) does not depend on the gradient's scale, so where an element's
# gradient nearly cancels, that difference moves the weight by up to a fraction of lr: 1.4e-6 after
# three steps at tp 2, 3.0e-6 on GPT-2 at tp 4 (2026-11-27), and on another CPU (AVX-512 with FP16) 1.35e-5 in
# one element of GPT-2's first up projection at tp 4, the tensor's median 2e-9 (2026-11-28). GPT-2's key bias has an exactly zero
# gradient (softmax ignores a constant added to every score of a query's row), so AdamW moves it by rounding
# noise alone, in any layout: up to 6.8e-6 on GPT-2 at tp 4 with sequence parallelism. SGD, which does not
# amplify any of this, and which shows a gradient off by a constant factor that Adam would hide, keeps the
# data-parallel tolerance.
ADAM_ATOL = {"llama": 5e-6, "gpt2": 3e-5}
OPTIMIZERS = {"adamw": {}, "sgd": {"train.optimizer": "sgd", "train.lr": "1e-2"}}
# GPT-2 with tied embeddings and a vocabulary no degree divides (padded rows); Llama with GQA (2 KV heads
# for 4 query heads: split at tp 2, kept whole on every rank at tp 4).
MODELS = {"llama": {}, "gpt2": {"model.arch": "gpt2", "model.tie_embeddings": "true", "model.num_kv_heads": "0",
                                "model.vocab_size": "509"}}


def check_equal(results, ref, rtol=RTOL, atol=ATOL):
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=rtol, atol=0)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=rtol, atol=0)
    main = [r["masters"] for r in results if r["masters"] is not None]
    assert len(main) == 1, "the full state is gathered on the main rank only"
    assert main[0].keys() == ref["masters"].keys()
    for name, value in ref["masters"].items():
        assert main[0][name].shape == value.shape, name
        torch.testing.assert_close(main[0][name], value, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def run(world, overrides):
    ref = dist_fns.train_and_capture(0, 1, {"train.device": "cpu", **COMMON, **overrides,
                                            "parallel.tp": "1", "parallel.dp": "1", "parallel.sp": "false",
                                            "parallel.zero_stage": "0"})
    return run_distributed(dist_fns.train_and_capture, world, {**COMMON, **overrides}, timeout=240), ref


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_tensor_parallel_equals_one_process(model, tp, sp, optimizer):
    results, ref = run(tp, {**MODELS[model], **OPTIMIZERS[optimizer], "parallel.tp": str(tp), "parallel.dp": "1",
                            "parallel.sp": str(sp)})
    check_equal(results, ref, atol=ADAM_ATOL[model] if optimizer == "adamw" else ATOL)


@pytest.mark.parametrize("sp,lora", [(False, False), (True, False), (True, True)])
def test_a_compiled_tensor_parallel_block_has_the_eager_gradients(sp, lora):
    """torch.compile traces the collectives inside a block (the GPUs compile every block): on torch 2.11 a
    sequence-parallel block once compiled to zero weight gradients, with the eager block's outputs. With LoRA
    each adapted linear compiles to one operator (model/lora_linear.py) on its rank's slice."""
    for eager, compiled in run_distributed(dist_fns.compiled_block_gradients, 2, sp, lora, timeout=240):
        assert eager.keys() == compiled.keys() and (not lora or any(".lora." in n for n in eager))
        for name in eager:
            assert compiled[name] is not None and eager[name].norm() > 0, name
            torch.testing.assert_close(compiled[name], eager[name], atol=1e-6, rtol=1e-5, msg=name)


def test_async_tensor_parallel_fuses_each_collective_with_its_matmul():
    """parallel.tp_async: inductor's pass replaces every sequence-parallel all-gather + matmul and matmul +
    reduce-scatter of a compiled block by the fused op (forward and backward), with the eager gradients."""
    for (eager, compiled), calls in run_distributed(dist_fns.async_tp_block_gradients, 2, timeout=400):
        # forward: the gathers before qkv and up, the scatters after out and down; backward: the gradients'
        # gathers before out's and down's input-gradient matmuls, the scatters after qkv's and up's
        assert calls == {"fused_all_gather_matmul": 4, "fused_matmul_reduce_scatter": 4}, calls
        for name in eager:
            assert eager[name].norm() > 0, name
            torch.testing.assert_close(compiled[name], eager[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_data_times_async_tensor_parallel_equals_one_process():
    """The trainer's path (compiled blocks with the fusion pass; DDP compiles block 0 in halves) at dp 2 x tp 2,
    on the CPU: each compiled graph's collectives all fused, and the run equal to one process."""
    over = {**COMMON, "parallel.tp": "2", "parallel.dp": "2", "parallel.sp": "true", "parallel.tp_async": "true",
            "train.compile": "true"}
    results = run_distributed(dist_fns.train_with_async_tp, 4, over, timeout=400)
    for _, fused in results:  # 8 a block: 4 in its forward graph(s), 4 in its backward
        assert fused >= 8 and fused % 8 == 0, fused
    ref = dist_fns.train_and_capture(0, 1, {**COMMON, "train.compile": "true"})
    check_equal([r for r, _ in results], ref, atol=ADAM_ATOL["llama"])


GPU_LAYOUTS = [pytest.param(dp, fused, marks=pytest.mark.skipif(torch.cuda.device_count() < 2 * dp,
                                                              reason=f"needs {2 * dp} GPUs"))
               for dp in (1, 2) for fused in (False, True)]


@pytest.mark.parametrize("dp, fused", GPU_LAYOUTS)
def test_compiled_sequence_parallel_on_gpus_equals_one_gpu(dp, fused):
    """As the GPUs run it: NCCL, compiled blocks, at dp 2 the gradients reduced by the copy engines (symmetric
    memory, like the fused kernels), and with `fused` async tensor parallelism with every pair fused, against
    one process on one GPU (AdamW's tolerance on GPUs, as test_pipeline.py's)."""
    over = {**COMMON, "parallel.tp": "2", "parallel.dp": str(dp), "parallel.sp": "true",
            "parallel.tp_async": str(fused).lower(), "train.compile": "true", "train.device": "cuda"}
    results = run_distributed(dist_fns.train_with_async_tp, 2 * dp, over, timeout=300, device="cuda")
    for _, count in results:
        assert (count >= 8 and count % 8 == 0) if fused else count == 0, count
    ref = dist_fns.train_and_capture(0, 1, {**COMMON, "train.compile": "true", "train.device": "cuda"})
    if not fused:
        check_equal([r for r, _ in results], ref, atol=ADAM_ATOL["llama"])
        return
    # SGD does not amplify rounding as AdamW does: a fused kernel that computes something else fails here.
    sgd = OPTIMIZERS["sgd"]
    sgd_results = run_distributed(dist_fns.train_with_async_tp, 2 * dp, {**over, **sgd}, timeout=300, device="cuda")
    check_equal([r for r, _ in sgd_results],
                dist_fns.train_and_capture(0, 1, {**COMMON, **sgd, "train.compile": "true", "train.device": "cuda"}))
    # On 4x H200 (torch 2.11) the weights after three AdamW steps left the tolerance the unfused run meets, so
    # parallel.tp_async is refused on GPUs (async_tp.NOT_VALIDATED), which this test lifts; once they agree,
    # the refusal must go.
    try:
        check_equal([r for r, _ in results], ref, atol=ADAM_ATOL["llama"])
    except AssertionError as e:
        pytest.xfail(f"async TP on GPUs: AdamW's weights still outside the tolerance: {e}")
    pytest.fail("async TP on GPUs now meets the unfused run's tolerance: lift async_tp.NOT_VALIDATED")


def test_async_tensor_parallel_is_refused_where_it_cannot_fuse():
    with pytest.raises(ConfigError, match="tp_async = True .* needs parallel.sp = True and train.compile = True"):
        validate(load_config("tiny", {"parallel.tp": "2", "parallel.tp_async": "true", "parallel.sp": "true"}), 2)
    with pytest.raises(ConfigError, match="tp_async = True needs CUDA GPUs .train.device is 'cpu'"):
        validate(load_config("tiny", {"parallel.tp": "2", "parallel.tp_async": "true", "parallel.sp": "true",
                                      "train.compile": "true", "train.device": "cpu"}), 2)
    with pytest.raises(Exception, match=r"tp_async = True needs CUDA GPUs \(the device is cpu\)"):
        run_distributed(dist_fns.train_and_capture, 2, {**COMMON, "parallel.tp": "2", "parallel.dp": "1",
                                                        "parallel.sp": "true", "parallel.tp_async": "true",
                                                        "train.compile": "true"}, timeout=120)
    with pytest.raises(ConfigError, match="tp_async = True is not yet validated with pipeline stages"):
        validate(load_config("tiny", {"parallel.tp": "2", "parallel.pp": "2", "parallel.tp_async": "true",
                                      "parallel.sp": "true", "train.compile": "true"}), 4)


def test_async_tensor_parallel_needs_each_tp_group_on_one_nodes_gpus(monkeypatch):
    """Symmetric memory spans one node: with tp innermost, a node must run whole tp groups and see its GPUs."""
    from shardlm.parallel.async_tp import NOT_VALIDATED, unavailable
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # e.g. 2 nodes x 8 GPUs at tp 4: each node holds two whole groups; only the kernels' validation is missing
    assert unavailable(4, gpu) == NOT_VALIDATED
    assert "CUDA GPUs" in unavailable(4, torch.device("cpu"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert "a launch by torchrun" in unavailable(4, gpu)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    assert "multiple of parallel.tp = 4" in unavailable(4, gpu)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU per process (CUDA_VISIBLE_DEVICES)
    assert "to see its node's GPUs" in unavailable(4, gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: False)
    assert "peer access" in unavailable(4, gpu)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero3"])
def test_data_times_tensor_parallel_equals_one_process(model, mode):
    """dp 2 x tp 2 (two micro-batches per rank: accumulation), ZeRO sharding over each tp rank's dp group."""
    layout = {"parallel.tp": "2", "parallel.dp": "2", "parallel.zero_stage": mode[-1] if mode != "ddp" else "0",
              "parallel.persist_threshold": "100", "parallel.sp": str(mode == "zero3")}
    results, ref = run(4, {**MODELS[model], **layout})
    check_equal(results, ref, atol=ADAM_ATOL[model])


@pytest.mark.parametrize("recompute", ["selective", "full", "full-skip-out-down"])
def test_tensor_and_sequence_parallel_with_recomputation(recompute):
    results, ref = run(2, {"parallel.tp": "2", "parallel.dp": "1", "parallel.sp": "true", "train.recompute": recompute,
                           "train.optimizer": "sgd", "train.lr": "1e-2"})
    check_equal(results, ref)


@pytest.mark.parametrize("model", MODELS)
def test_a_tensor_parallel_model_starts_from_the_one_process_weights(model):
    """Each rank draws every full tensor from its (seed, name) generator and keeps its slice: gathered, the
    weights are the one-process model's, bit for bit (padding rows aside)."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    cfg = load_config("tiny", MODELS[model])
    want = build_model(cfg.model, seed=cfg.train.seed).state_dict()
    for tp in (2, 4):
        got = run_distributed(dist_fns.initial_full_state, tp, {**MODELS[model], "parallel.tp": str(tp),
                                                                "parallel.dp": "1"}, timeout=120)[0]
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), (tp, name)


@pytest.mark.parametrize("layout", [{"parallel.tp": "2", "parallel.dp": "1"},
                                    {"parallel.tp": "2", "parallel.dp": "2", "parallel.zero_stage": "1"}])
def test_fp16_overflow_on_one_tensor_parallel_rank_skips_the_step_everywhere(layout):
    world = int(layout["parallel.tp"]) * int(layout["parallel.dp"])
    results = run_distributed(dist_fns.fp16_overflow_on_rank_one, world, layout, timeout=120)
    for skipped, scale, unchanged in results:
        assert skipped == 1 and scale == 2.0**16 and unchanged in (True, None)
    assert any(u is True for _, _, u in results)


@pytest.mark.parametrize("model, tp, sp", [("llama", 2, True), ("llama", 4, False), ("gpt2", 4, True)])
def test_eval_and_generation_under_tensor_parallelism_equal_one_process(model, tp, sp):
    """Evaluation (the vocab-parallel loss, no logits gathered) and greedy generation (only the last
    position's logits gathered) give the one-process results: with sequence parallelism, with KV heads kept
    whole (Llama at tp 4), and with padded vocabulary rows (GPT-2's 509 at tp 4)."""
    one = dist_fns.eval_and_sample(0, 1, {**MODELS[model], "train.device": "cpu", "parallel.dp": "1"})
    for loss, text in run_distributed(dist_fns.eval_and_sample, tp, {**MODELS[model], "parallel.tp": str(tp),
                                                                    "parallel.dp": "1", "parallel.sp": str(sp)},
                                      timeout=120):
        assert loss == pytest.approx(one[0], rel=1e-5) and text == one[1]


def test_tensor_parallel_with_zero3_on_one_data_parallel_rank():
    """tp 2 x dp 1 with ZeRO-3 in fp32: the engine frees parameter storage between uses, so its optimizer
    keeps masters of its own (one data-parallel rank would otherwise alias them to freed storage)."""
    results, ref = run(2, {"parallel.tp": "2", "parallel.dp": "1", "parallel.zero_stage": "3",
                           "parallel.persist_threshold": "100"})
    check_equal(results, ref, atol=ADAM_ATOL["llama"])


RESUME = {"train.steps": "6", "train.global_batch_size": "8", "train.micro_batch_size": "2", "train.save_every": "3",
          "train.keep_checkpoints": "5"}


@pytest.mark.parametrize("target", [
    {"parallel.tp": "1", "parallel.dp": "1"},
    {"parallel.tp": "1", "parallel.dp": "4", "parallel.zero_stage": "3"},
    {"parallel.tp": "4", "parallel.dp": "1", "parallel.sp": "true"},
], ids=["tp1", "dp4-zero3", "tp4-sp"])
def test_a_tp2_dp2_checkpoint_resumes_under_another_layout_on_the_same_trajectory(tmp_path, target):
    full = run_distributed(dist_fns.train_and_capture, 4, {**RESUME, "parallel.tp": "2", "parallel.dp": "2"},
                           str(tmp_path / "a"), timeout=240)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    world = int(target["parallel.tp"]) * int(target["parallel.dp"])
    if world == 1:
        resumed = [dist_fns.train_and_capture(0, 1, {**RESUME, **target, "train.device": "cpu"}, str(tmp_path / "b"),
                                              ckpt)]
    else:
        resumed = run_distributed(dist_fns.train_and_capture, world, {**RESUME, **target}, str(tmp_path / "b"), ckpt,
                                  timeout=240)
    for r in resumed:
        torch.testing.assert_close(r["losses"], full[0]["losses"][3:], rtol=RTOL, atol=0)


def test_export_of_a_tensor_parallel_run_is_the_one_process_runs_hf_directory(tmp_path):
    """`shardlm export` writes full tensors whatever the layout that trained them: the tp 2 x dp 2 run's HF
    directory holds the config and the tensors of the tp 1 run's (equal up to the optimizer tolerance)."""
    from helpers import assert_same_export
    steps = {**RESUME, "train.steps": "3", "train.save_every": "0"}
    run_distributed(dist_fns.train_and_capture, 4, {**steps, "parallel.tp": "2", "parallel.dp": "2"},
                    str(tmp_path / "tp"), timeout=240)
    dist_fns.train_and_capture(0, 1, {**steps, "train.device": "cpu", "parallel.dp": "1"}, str(tmp_path / "one"))
    assert_same_export(tmp_path / "tp", tmp_path / "one", tmp_path / "hf", RTOL, ADAM_ATOL["llama"])


@pytest.mark.parametrize("overrides, world, message", [
    ({"parallel.tp": "3"}, 3, "parallel.tp = 3 does not divide the 4 attention heads"),
    ({"parallel.tp": "3"}, 3, "heads: parallel.tp can be 2, 4 for this model"),  # the values that fit, named
    ({"parallel.tp": "2", "model.ffn_hidden_size": "127"}, 2, "the MLP's 127 hidden features: no parallel.tp above "
                                                              "1 fits it"),
    ({"parallel.tp": "2"}, 4, "parallel.dp (1) x parallel.tp (2) x parallel.pp (1) = 2 != world size 4"),
    ({"parallel.tp": "2"}, 1, "!= world size 1: start 2 processes, e.g. `torchrun --nproc-per-node 2"),
    ({"parallel.sp": "true"}, 1, "parallel.sp = True (sequence parallelism) needs parallel.tp > 1"),
    ({"parallel.tp": "2", "parallel.sp": "true", "train.seq_len": "31"}, 2,
     "train.seq_len = 31 must divide by parallel.tp = 2 for sequence parallelism"),
])
def test_bad_tensor_parallel_layouts_fail_early_naming_the_values(overrides, world, message):
    from shardlm.config import ConfigError, load_config, validate
    with pytest.raises(ConfigError) as e:
        validate(load_config("tiny", overrides), world_size=world)
    assert message in str(e.value)


def test_a_tensor_parallel_group_that_spans_nodes_is_warned_about():
    """tp 2 where each node runs one process: it works, but its per-layer collectives cross the network."""
    seen = run_distributed(dist_fns.warnings_of_a_trainer, 2, {"parallel.tp": "2", "parallel.dp": "1"}, 1, timeout=120)
    assert any("parallel.tp = 2 spans nodes of 1 processes" in w for w in seen[0]), seen[0]
    assert not any("spans nodes" in w for w in run_distributed(dist_fns.warnings_of_a_trainer, 2, {
        "parallel.tp": "2", "parallel.dp": "1"}, 2, timeout=120)[0])
