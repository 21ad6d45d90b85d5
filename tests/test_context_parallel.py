"""Context parallelism (Ulysses: each sequence split over the cp ranks, attention exchanging heads for it)
alone and composed with data, tensor (and sequence) and pipeline parallelism and ZeRO, against one process
(gloo on CPU, fp32): per-step losses, gradient norms, gathered weights and eval losses; the attention
exchange itself with sliding windows and packed examples; resume across cp; ring attention (`parallel.cp_comm
p2p`) beside Ulysses."""
import pytest
import torch

import dist_fns
from dp_cases import ATOL, RTOL
from shardlm.testing.distributed import run_distributed
from test_tensor_parallel import ADAM_ATOL, MODELS, check_equal

COMMON = {"train.steps": "3", "train.global_batch_size": "8", "train.micro_batch_size": "2",
          "train.eval_every": "3", "train.eval_batches": "2"}


def run(world, overrides):
    one = {**COMMON, **overrides, "parallel.cp": "1", "parallel.tp": "1", "parallel.dp": "1", "parallel.pp": "1",
           "parallel.sp": "false", "parallel.zero_stage": "0", "train.device": "cpu"}
    ref = dist_fns.train_and_capture(0, 1, one)
    return run_distributed(dist_fns.train_and_capture, world, {**COMMON, **overrides}, timeout=240), ref


def check_eval(results, ref):
    for r in results:
        assert r["eval_losses"] and r["eval_losses"] == pytest.approx(ref["eval_losses"], rel=RTOL)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_context_parallel_equals_one_process(model, cp, optimizer, comm):
    """Llama with 4 query and 2 key/value heads (at cp 4 Ulysses repeats the key/value heads before the
    exchange), GPT-2 with learned positions and tied embeddings; Ulysses and ring attention."""
    opt = {"train.optimizer": "sgd", "train.lr": "1e-2"} if optimizer == "sgd" else {}
    results, ref = run(cp, {**MODELS[model], **opt, "parallel.cp": str(cp), "parallel.dp": "1", "parallel.cp_comm": comm})
    check_equal(results, ref, atol=ADAM_ATOL[model] if optimizer == "adamw" else ATOL)
    check_eval(results, ref)


@pytest.mark.parametrize("layout", [
    {"parallel.dp": "2", "parallel.cp": "2"},
    {"parallel.dp": "2", "parallel.cp": "2", "parallel.zero_stage": "3", "parallel.persist_threshold": "100"},
    {"parallel.tp": "2", "parallel.cp": "2", "parallel.sp": "true", "parallel.dp": "1"},
    {"parallel.tp": "2", "parallel.cp": "2", "parallel.dp": "1", "model.num_kv_heads": "1"},
    {"parallel.pp": "2", "parallel.cp": "2", "parallel.dp": "1", "train.micro_batch_size": "1"},
], ids=["dp2-cp2", "dp2-cp2-zero3", "tp2-sp-cp2", "tp2-cp2-kv1", "pp2-cp2"])
@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_context_parallel_composes_with_the_other_axes(layout, comm):
    """With tp 2 and one key/value head, every tensor-parallel rank reads it for each of its query heads
    (tensor.py's QKVParallelLinear) before the exchange (or the ring)."""
    results, ref = run(4, {**layout, "parallel.cp_comm": comm})
    check_equal(results, ref, atol=ADAM_ATOL["llama"])
    check_eval(results, ref)


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_context_parallel_with_recomputation(recompute, comm):
    results, ref = run(2, {"parallel.cp": "2", "parallel.dp": "1", "train.recompute": recompute,
                           "parallel.cp_comm": comm, "train.optimizer": "sgd", "train.lr": "1e-2"})
    check_equal(results, ref)


@pytest.mark.parametrize("comm", ["a2a", "p2p"])
def test_lora_dropout_under_context_parallelism_equals_one_process(comm):
    """Each cp rank drew its adapters' dropout mask over its slice alone: the slices of a sequence dropped the
    same features (positions i and i + T / cp alike), and at cp 2 the step-1 gradient norm was 8.12 where one
    process's is 7.89. Each rank now takes its part of the whole sequence's mask."""
    results, ref = run(2, {"parallel.cp": "2", "parallel.dp": "1", "parallel.cp_comm": comm, "lora.rank": "4",
                           "lora.dropout": "0.1", "train.optimizer": "sgd", "train.lr": "1e-2"})
    check_equal(results, ref)


@pytest.mark.parametrize("case,comm,query_rows", [(case, comm, 0) for comm in ("a2a", "p2p")
                                                   for case in ("causal", "window", "packed", "gqa")]
                         + [("heads2", "p2p", 0), ("window", "p2p", 3)])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_attention_exchange_gives_one_process_logits_and_gradients(case, comm, query_rows, cp):
    """The model alone, each rank holding its slice of the sequence: the loss and every parameter's
    gradient equal one process's, with a sliding window shorter than the sequence, with packed examples
    that must not attend to each other (their document masks come from the whole sequence), with key/value
    heads that cp does not divide (Ulysses repeats them before the exchange), and with ring attention
    (`comm` p2p) also where cp does not divide the heads, and over its queries a few at a time."""
    one = dist_fns.context_parallel_step(0, 1, case)
    for loss, grads in run_distributed(dist_fns.context_parallel_step, cp, case, comm, query_rows, timeout=120):
        assert loss == pytest.approx(one[0], rel=1e-6)
        assert grads.keys() == one[1].keys()
        for name, want in one[1].items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_ring_attention_in_bf16_is_as_close_to_fp32_as_sdpa_in_bf16():
    """bf16 inputs, as on GPUs: the products in bf16, the softmax and the travelling sums in fp32. The output
    and the three gradients (grouped-query: the key/value gradients summed over 4 query heads, and over the
    ranks as they travel) stay within a few times SDPA's own bf16 error of the fp32 result."""
    for ring, bf16, fp32 in run_distributed(dist_fns.ring_attention_bf16, 4, timeout=120):
        for name, got, low, want in zip(("out", "dq", "dk", "dv"), ring, bf16, fp32):
            err, base = (got - want).abs().max().item(), (low - want).abs().max().item()
            assert err <= 4 * base + 1e-3, (name, err, base)


@pytest.mark.parametrize("cp", [1, 4])
def test_a_cp2_checkpoint_resumes_under_another_cp_on_the_same_trajectory(tmp_path, cp):
    steps = {"train.steps": "6", "train.global_batch_size": "8", "train.micro_batch_size": "2",
             "train.save_every": "3", "train.keep_checkpoints": "5"}
    full = run_distributed(dist_fns.train_and_capture, 2, {**steps, "parallel.cp": "2", "parallel.dp": "1"},
                           str(tmp_path / "a"), timeout=240)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    if cp == 1:
        resumed = [dist_fns.train_and_capture(0, 1, {**steps, "train.device": "cpu", "parallel.dp": "1"},
                                              str(tmp_path / "b"), ckpt)]
    else:
        resumed = run_distributed(dist_fns.train_and_capture, cp, {**steps, "parallel.cp": str(cp), "parallel.dp": "1"},
                                  str(tmp_path / "b"), ckpt, timeout=240)
    for r in resumed:
        torch.testing.assert_close(r["losses"], full[0]["losses"][3:], rtol=RTOL, atol=0)


def test_fp16_overflow_on_one_context_parallel_rank_skips_the_step_everywhere():
    results = run_distributed(dist_fns.fp16_overflow_on_rank_one, 2, {"parallel.cp": "2", "parallel.dp": "1"},
                              timeout=120)
    for skipped, scale, unchanged in results:
        assert skipped == 1 and scale == 2.0**16 and unchanged in (True, None)
    assert any(u is True for _, _, u in results)


GPU_LAYOUTS = [pytest.param(layout, marks=pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs"))
               for layout in ({"parallel.cp": "4", "parallel.dp": "1"},
                              {"parallel.cp": "2", "parallel.tp": "2", "parallel.sp": "true", "parallel.dp": "1"},
                              {"parallel.cp": "4", "parallel.dp": "1", "parallel.cp_comm": "p2p"})]


@pytest.mark.parametrize("layout", GPU_LAYOUTS, ids=["cp4", "cp2-tp2-sp", "cp4-ring"])
def test_compiled_context_parallel_on_gpus_equals_one_gpu(layout):
    """As the GPUs run it: NCCL's all-to-alls (or ring attention's sends) inside compiled blocks (in fp32, so
    that the CPU cases' tolerance applies), against one process on one GPU. With SGD: after three AdamW steps one element of
    layers.1.mlp.up.weight, (33, 20), was 6.7e-6 and 8.5e-6 off one GPU's at cp 4 and cp 2 x tp 2 on 4x
    H200, the losses and gradient norms equal, and the same element left AdamW's tolerance under async TP:
    its gradient nearly cancels, and AdamW's step, which does not depend on the gradient's scale, turns the
    summation order's rounding there into a fraction of lr. The CPU cases check AdamW."""
    sgd = {"train.optimizer": "sgd", "train.lr": "1e-2"}
    over = {**COMMON, **sgd, **layout, "train.compile": "true", "train.device": "cuda"}
    results = run_distributed(dist_fns.train_and_capture, 4, over, timeout=300, device="cuda")
    ref = dist_fns.train_and_capture(0, 1, {**COMMON, **sgd, "train.compile": "true", "train.device": "cuda"})
    check_equal(results, ref)
    check_eval(results, ref)


@pytest.mark.parametrize("cp", [2, 4])
def test_eval_and_generation_under_context_parallelism_equal_one_process(cp):
    """Evaluation scores each rank's slice and sums them; greedy generation runs the whole sequence on every
    rank (its KV cache bypasses the exchange): both as one process gives."""
    one = dist_fns.eval_and_sample(0, 1, {"train.device": "cpu", "parallel.dp": "1"})
    for loss, text in run_distributed(dist_fns.eval_and_sample, cp, {"parallel.cp": str(cp), "parallel.dp": "1"},
                                      timeout=120):
        assert loss == pytest.approx(one[0], rel=1e-5) and text == one[1]
