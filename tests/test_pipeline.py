"""Pipeline parallelism against one process (gloo on CPU, fp32): every schedule at pp 2 and 4 with pp, 2 pp
and an odd number of micro-batches, interleaving with two virtual stages, and the compositions with data,
ZeRO-1, tensor and sequence parallelism up to dp 2 x tp 2 x pp 2 on 8 ranks; per-step losses, gradient
norms and the gathered weights. Then what a schedule holds in memory, fp16 overflow on one stage,
resharding resume, eval, export and generation from a pipeline checkpoint, and bad layouts."""
import functools

import pytest
import torch

import dist_fns
from dp_cases import ATOL, RTOL
from shardlm.schedules import SCHEDULES
from shardlm.testing.distributed import run_distributed
from test_tensor_parallel import ADAM_ATOL, MODELS, OPTIMIZERS, check_equal


def layout(pp, m, schedule="1f1b", v=1, dp=1, tp=1, **extra):
    """One micro-batch of one sample each: m micro-batches per data-parallel rank and step."""
    return {"parallel.pp": str(pp), "parallel.dp": str(dp), "parallel.tp": str(tp), "parallel.pp_schedule": schedule,
            "parallel.virtual_stages": str(v), "model.num_layers": str(max(4, 2 * pp * v)), "train.steps": "3",
            "train.micro_batch_size": "1", "train.global_batch_size": str(m * dp), **extra}


@functools.lru_cache(maxsize=None)
def _reference(items):
    return dist_fns.train_and_capture(0, 1, {**dict(items), "train.device": "cpu"})


def reference_overrides(overrides):
    return {k: v for k, v in overrides.items() if not k.startswith("parallel.")}


def reference(overrides):
    """The one-process run of the same model, batch and optimizer."""
    return _reference(tuple(sorted(reference_overrides(overrides).items())))


def run(overrides, atol=ATOL):
    p = {k: int(overrides.get(f"parallel.{k}", 1)) for k in ("pp", "dp", "tp")}
    results = run_distributed(dist_fns.train_and_capture, p["pp"] * p["dp"] * p["tp"], overrides, timeout=240)
    check_equal(results, reference(overrides), atol=atol)


CASES = [(s, pp, m) for s in SCHEDULES if s != "interleaved" for pp in (2, 4) for m in (pp, 2 * pp, pp + 1)]
CASES += [("interleaved", pp, m) for pp in (2, 4) for m in (pp, 2 * pp)]


@pytest.mark.parametrize("schedule, pp, m", CASES, ids=[f"{s}-pp{pp}-m{m}" for s, pp, m in CASES])
def test_every_schedule_equals_one_process(schedule, pp, m):
    run(layout(pp, m, schedule, v=2 if schedule == "interleaved" else 1))


GPU_CASES = [pytest.param(s, pp, transfer, marks=pytest.mark.skipif(torch.cuda.device_count() < pp,
                                                                    reason=f"needs {pp} GPUs"))
             for transfer in ("process_group", "copy_engine") for pp in (2, 4)
             for s in ("gpipe", "1f1b", "interleaved", "zb-h1")]


@pytest.mark.parametrize("schedule, pp, transfer", GPU_CASES)
def test_every_schedule_on_gpus_equals_one_gpu(schedule, pp, transfer):
    """The engine as a user runs it: NCCL (a communicator per flow) or the copy engines (comm/p2p.py), receives
    posted where the timed lowering puts them, against one process on one GPU (AdamW's tolerance on GPUs, as
    test_dp_equality.py's). Each flow passes 2 pp messages a step, so the copy engines reuse their two
    slots within the first step and across the three."""
    over = layout(pp, 2 * pp, schedule, v=2 if schedule == "interleaved" else 1, **{"parallel.pp_transfer": transfer})
    results = run_distributed(dist_fns.train_and_capture, pp, over, timeout=240, device="cuda")
    check_equal(results, dist_fns.train_and_capture(0, 1, {**reference_overrides(over), "train.device": "cuda"}),
                atol=5e-6)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_pipeline_times_data_parallel_both_by_the_copy_engines_on_gpus():
    """dp 2 x pp 2, ZeRO-1: the data-parallel engine's symmetric-memory rendezvous and the pipeline's, made in
    the same sequence on every rank (comm/p2p.py), and both kinds of copy-engine traffic in one step."""
    over = layout(2, 4, "1f1b", dp=2, **{"parallel.zero_stage": "1", "parallel.reduce_algo": "copy_engine",
                                          "parallel.pp_transfer": "copy_engine"})
    results = run_distributed(dist_fns.train_and_capture, 4, over, timeout=240, device="cuda")
    check_equal(results, dist_fns.train_and_capture(0, 1, {**reference_overrides(over), "train.device": "cuda"}),
                atol=5e-6)


def test_copy_engine_transfers_need_gpus():
    """Without GPUs the copy-engine transfers are refused with a message naming them, on every rank."""
    with pytest.raises(Exception, match="pp_transfer = 'copy_engine' needs CUDA GPUs"):
        run_distributed(dist_fns.train_and_capture, 2, layout(2, 2, "1f1b", **{"parallel.pp_transfer": "copy_engine"}),
                        timeout=120)


def test_copy_engine_transfers_want_their_own_hardware_queues(monkeypatch):
    """A flag wait blocks its stream's hardware queue: with fewer queues than CUDA's default (Megatron-LM's
    users set CUDA_DEVICE_MAX_CONNECTIONS=1) `auto` sends through the process group and an explicit request
    is refused with the reason; with the default, one node's GPUs get the copy engines."""
    from shardlm.comm import p2p
    monkeypatch.setattr(p2p, "copy_engines_reach", lambda group, device: True)  # as on one node's GPUs
    gpu = torch.device("cuda", 0)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert p2p.resolve_pp_transfer("auto", None, gpu) == "copy_engine"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert p2p.resolve_pp_transfer("auto", None, gpu) == "process_group"
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS of 8 or more"):
        p2p.resolve_pp_transfer("copy_engine", None, gpu)
    assert p2p.resolve_pp_transfer("auto", None, torch.device("cpu")) == "process_group"


# With tensor parallelism, SGD: AdamW amplifies the row-parallel sums' rounding (test_tensor_parallel.py) as
# much with stages as without (5.7e-6 after three steps on 8 layers at tp 2, pp 2 or 1).
SGD = OPTIMIZERS["sgd"]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_pipeline_times_tensor_and_sequence_parallel(schedule):
    v = 2 if schedule == "interleaved" else 1
    run(layout(2, 4, schedule, v=v, tp=2, **{"parallel.sp": "true"}, **SGD))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_pipeline_times_tensor_parallel_by_the_copy_engines_on_gpus():
    """pp 2 x tp 2 (sequence parallel): each tensor-parallel line's stages pass their slices on flows of their own."""
    over = layout(2, 4, "1f1b", tp=2, **{"parallel.sp": "true", "parallel.pp_transfer": "copy_engine"}, **SGD)
    results = run_distributed(dist_fns.train_and_capture, 4, over, timeout=240, device="cuda")
    check_equal(results, dist_fns.train_and_capture(0, 1, {**reference_overrides(over), "train.device": "cuda"}),
                atol=1e-5)


@pytest.mark.parametrize("mode, schedule", [("ddp", "1f1b"), ("zero1", "1f1b"), ("classic", "1f1b"), ("ddp", "zb-h1")])
def test_pipeline_times_data_parallel(mode, schedule):
    """Gradients accumulate over the step's micro-batches and are reduced once, after the last (zb-h1: its
    deferred weight gradients land in the data-parallel buckets before that)."""
    engine = {"parallel.zero_stage": "1"} if mode == "zero1" else {"parallel.dp_mode": mode}
    run(layout(2, 3, schedule, dp=2, **engine))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_in_bf16_follows_one_process(schedule):
    """bf16 weights, activations and gradients (fp32 masters): the stages run one process's operations in its
    order (zb-h1's deferred weight gradients included), so they meet the fp32 tolerance (bit-equal on
    2026-11-27)."""
    run(layout(2, 4, schedule, **{"train.precision": "bf16"}))


@pytest.mark.slow
@pytest.mark.parametrize("schedule, extra", [("1f1b", {"parallel.zero_stage": "1"}),
                                             ("zb-h1", {"train.optimizer": "sgd", "train.lr": "1e-2"})])
def test_three_dimensional_parallelism_on_eight_ranks(schedule, extra):
    """dp 2 x tp 2 x pp 2 (sequence parallel): every axis of the mesh in one run."""
    run(layout(2, 2, schedule, dp=2, tp=2, **{"parallel.sp": "true", **extra}), atol=ADAM_ATOL["llama"])


@pytest.mark.parametrize("pp, tp, dp, zero", [(2, 1, 1, 0), (4, 1, 1, 0), (2, 2, 1, 0), (2, 1, 2, 1)])
def test_tied_embeddings_across_first_and_last_stage(pp, tp, dp, zero):
    """GPT-2's head reuses the embedding: the first and last stage each hold a copy, whose gradients are
    summed every step, so both stay the one weight (and the gathered state holds it once); with ZeRO-1, in
    its gradient buckets."""
    run(layout(pp, pp, tp=tp, dp=dp, **MODELS["gpt2"], **{"parallel.zero_stage": str(zero)},
               **(SGD if tp > 1 else {})), atol=ADAM_ATOL["gpt2"])


@pytest.mark.parametrize("recompute, schedule", [("full", "1f1b"), ("selective", "zb-h1"), ("full", "zb-h1"),
                                                      ("full-skip-out-down", "1f1b")])
def test_pipeline_with_recomputation(recompute, schedule):
    run(layout(2, 2, schedule, **{"train.recompute": recompute}))


@pytest.mark.parametrize("schedule, tp", [("zb-h1", 1), ("1f1b", 2)])
def test_offloaded_activations_under_pipelines(schedule, tp):
    """Full recomputation with each block's input kept in host memory (parallel.offload_activations) under a
    split backward (zb-h1) and beside tensor and sequence parallelism (with SGD, as the other tensor-parallel
    cases: Adam magnifies the reductions' rounding for gradients near zero): the one-process run's numbers."""
    sp = {"parallel.sp": "true", **SGD} if tp > 1 else {}
    run(layout(2, 2, schedule, tp=tp, **sp, **{"train.recompute": "full", "parallel.offload_activations": "true"}))


def test_an_uneven_explicit_layer_split():
    run(layout(2, 3, **{"model.num_layers": "5", "parallel.pp_layers": "3,2"}))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_deferred_weight_gradient_waits_for_its_w_and_then_equals_autograds(compiled):
    """zb-h1's split backward: while the store defers, backward gives the input's gradient and queues the
    weight's (and bias's); running the queue accumulates what plain autograd would have. Also inside a
    compiled module (aot_eager traces the backward when it compiles the forward, as inductor does)."""
    from shardlm.model.weight_grad import Linear, WeightGradStore
    torch.manual_seed(0)
    deferred, plain = Linear(8, 6), torch.nn.Linear(8, 6)
    plain.load_state_dict(deferred.state_dict())
    store = deferred.weight_grads = WeightGradStore()
    run = torch.nn.Sequential(deferred, torch.nn.ReLU())
    if compiled:
        run.compile(backend="aot_eager")
    x = torch.randn(3, 5, 8)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    for step in range(2):  # the second accumulates onto the first's gradients
        loss = run(x1).square().sum()
        store.deferring = True  # as the I action sets it: after the forward
        loss.backward()
        torch.relu(plain(x2)).square().sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad)
        assert (deferred.weight.grad is None) if step == 0 else not torch.equal(deferred.weight.grad, plain.weight.grad)
        store.deferring = False
        store.run(store.take())
        torch.testing.assert_close(deferred.weight.grad, plain.weight.grad)
        torch.testing.assert_close(deferred.bias.grad, plain.bias.grad)


@pytest.mark.parametrize("schedule, pp, m", [("gpipe", 2, 6), ("1f1b", 2, 6), ("1f1b", 4, 8), ("naive", 2, 6),
                                           ("interleaved", 2, 4), ("zb-h1", 4, 8)])
def test_activations_held_are_the_schedules(schedule, pp, m):
    """Each rank holds at most the micro-batches its table says (the simulator's count: gpipe all m, 1f1b p - r
    on rank r, zb-h1 p on every rank as its deferred weight gradients keep theirs until W), counted from
    the tensors autograd saved; stage outputs are freed once sent."""
    from shardlm.schedules import schedule as table, simulate
    v = 2 if schedule == "interleaved" else 1
    want = simulate(table(schedule, pp, v, m), pp).in_flight
    got = run_distributed(dist_fns.pipeline_in_flight, pp, layout(pp, m, schedule, v=v), timeout=120)
    assert [most for most, _ in got] == want
    assert all(freed for _, freed in got)


@pytest.mark.parametrize("dp", [1, 2])
def test_fp16_overflow_on_the_first_stage_skips_the_step_on_every_rank(dp):
    results = run_distributed(dist_fns.fp16_overflow_on_first_stage, 2 * dp, layout(2, 2, dp=dp), timeout=120)
    for skipped, scale, unchanged in results:
        assert skipped == 1 and scale == 2.0**16 and unchanged in (True, None)
    assert any(u is True for _, _, u in results)


RESUME = {"train.steps": "6", "train.save_every": "3", "train.keep_checkpoints": "5"}


@pytest.mark.slow
def test_a_pp2_tp2_checkpoint_resumes_under_other_layouts_and_theirs_under_it_on_the_same_trajectory(tmp_path):
    """Saved at pp 2 x tp 2 (step 3 of 6), resumed at dp 4 ZeRO-3, pp 4, tp 4 and one process; and back: one
    process's checkpoint of the same run resumed at pp 2 x tp 2. Every resumed run continues the same losses."""
    first = {**layout(2, 4, tp=2), **RESUME, "parallel.persist_threshold": "100"}
    full = run_distributed(dist_fns.train_and_capture, 4, first, str(tmp_path / "a"), timeout=240)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    for i, target in enumerate(({"parallel.pp": "1", "parallel.dp": "4", "parallel.zero_stage": "3"},
                                {"parallel.pp": "4", "parallel.dp": "1", "parallel.tp": "1"},
                                {"parallel.pp": "1", "parallel.dp": "1", "parallel.tp": "4"})):
        resumed = run_distributed(dist_fns.train_and_capture, 4, {**first, "parallel.tp": "1", **target},
                                  str(tmp_path / f"b{i}"), ckpt, timeout=240)
        for r in resumed:
            torch.testing.assert_close(r["losses"], full[0]["losses"][3:], rtol=RTOL, atol=0, msg=str(target))
    one = {**first, "parallel.pp": "1", "parallel.tp": "1", "train.device": "cpu"}
    alone = dist_fns.train_and_capture(0, 1, one, str(tmp_path / "one"), ckpt)
    torch.testing.assert_close(alone["losses"], full[0]["losses"][3:], rtol=RTOL, atol=0)
    theirs = dist_fns.train_and_capture(0, 1, one, str(tmp_path / "c"))
    torch.testing.assert_close(theirs["losses"], full[0]["losses"], rtol=RTOL, atol=0)
    back = run_distributed(dist_fns.train_and_capture, 4, first, str(tmp_path / "d"),
                           str(tmp_path / "c" / "checkpoints" / "step_00000003"), timeout=240)
    for r in back:
        torch.testing.assert_close(r["losses"], full[0]["losses"][3:], rtol=RTOL, atol=0)


def test_eval_export_and_generation_from_a_pipeline_run(tmp_path, capsys):
    """The eval loss under pp 2 x tp 2 is the one process's; its checkpoint exports to the one-process run's
    HF directory, from which `shardlm generate` decodes."""
    from helpers import assert_same_export, cli_here
    steps = {**layout(2, 4, tp=2), "train.save_every": "0"}
    one = dist_fns.evaluated(0, 1, {**reference_overrides(steps), "train.device": "cpu"})
    for loss in run_distributed(dist_fns.evaluated, 4, steps, timeout=120):
        assert loss == pytest.approx(one, rel=1e-5)

    run_distributed(dist_fns.train_and_capture, 4, steps, str(tmp_path / "pp"), timeout=240)
    dist_fns.train_and_capture(0, 1, {**reference_overrides(steps), "train.device": "cpu"}, str(tmp_path / "one"))
    assert_same_export(tmp_path / "pp", tmp_path / "one", tmp_path / "hf", RTOL, ADAM_ATOL["llama"])
    assert cli_here(capsys, "generate", "--model", tmp_path / "pp", "--prompt", "def ", "--max-new-tokens", "8").strip()


@pytest.mark.parametrize("overrides, world, message", [
    ({"parallel.pp": "4"}, 4, "parallel.pp = 4 exceeds the model's 2 layers"),
    ({"parallel.pp": "2", "train.micro_batch_size": "4", "train.global_batch_size": "4"}, 2,
     "the 1f1b schedule needs at least parallel.pp = 2 micro-batches per step to fill the pipeline, not 1"),
    ({"parallel.pp": "4", "model.num_layers": "4", "train.micro_batch_size": "4", "train.global_batch_size": "12"}, 4,
     "needs at least parallel.pp = 4 micro-batches per step"),
    ({"parallel.pp": "2", "model.num_layers": "4", "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": "2",
      "train.micro_batch_size": "1", "train.global_batch_size": "3"}, 2,
     "3 micro-batches per step is not a multiple of it"),
    ({"parallel.pp": "2", "model.num_layers": "4", "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": "2",
      "train.micro_batch_size": "1", "train.global_batch_size": "3"}, 2,
     "not a multiple of it: change train.global_batch_size or train.micro_batch_size so that it is"),
    ({"parallel.pp": "2", "model.num_layers": "4", "parallel.pp_layers": "1,2"}, 2,
     "parallel.pp_layers = '1,2' must give 2 positive layer counts"),
    ({"parallel.pp": "2", "parallel.virtual_stages": "2", "model.num_layers": "4"}, 2,
     "parallel.virtual_stages = 2 needs parallel.pp_schedule = 'interleaved'"),
    ({"parallel.pp": "2", "parallel.dp": "2", "parallel.zero_stage": "2", "train.micro_batch_size": "1"}, 4,
     "parallel.zero_stage = 2 with parallel.pp = 2 is not supported"),
    ({"parallel.pp": "2", "parallel.pp_schedule": "pipedream"}, 2, "is not one of naive, gpipe, 1f1b"),
])
def test_bad_pipeline_layouts_fail_early_naming_the_values(overrides, world, message):
    from shardlm.config import ConfigError, load_config, validate
    with pytest.raises(ConfigError) as e:
        validate(load_config("tiny", overrides), world_size=world)
    assert message in str(e.value)


@pytest.mark.parametrize("extra, cause", [
    ({"parallel.zero_stage": "3", "parallel.offload": "params"}, "parallel.offload = 'params' needs parallel.zero_stage = 3"),
    ({"parallel.zero_stage": "1", "parallel.offload": "params"}, "parallel.offload = 'params' needs parallel.zero_stage = 3"),
    ({"parallel.zero_stage": "2", "parallel.offload": "optimizer", "parallel.delayed_update": "true"},
     "parallel.delayed_update = True needs parallel.zero_stage = 2")])
def test_offloads_that_need_zero_2_or_3_are_refused_under_pipelines_naming_why(extra, cause):
    """ZeRO-3's parameter offload and ZeRO-2's delayed update under stages: the refusal names them, not only the
    ZeRO stage (whose "use zero_stage 1" the offload then refused), and the layout it offers is accepted."""
    from shardlm.config import ConfigError, load_config, validate
    over = {**layout(2, 2, dp=2), **extra}
    with pytest.raises(ConfigError) as e:
        validate(load_config("tiny", over), world_size=4)
    assert cause in str(e.value) and "parallel.zero_stage = 1 and parallel.offload = 'optimizer'" in str(e.value)
    validate(load_config("tiny", {**over, "parallel.zero_stage": "1", "parallel.offload": "optimizer",
                                  "parallel.delayed_update": "false"}), world_size=4)


def test_the_run_header_says_interleaved_at_one_virtual_stage_is_1f1bs_order():
    """`interleaved` at parallel.virtual_stages 1 runs 1F1B's order: the opening line says so, not just its name."""
    from types import SimpleNamespace

    from shardlm.config import load_config
    from shardlm.runtime.run_header import run_header
    trainer = SimpleNamespace(step=0, device="cpu")
    for stages, said in ((1, "(interleaved with one virtual stage a rank, 1F1B's order: parallel.virtual_stages 2 "
                              "interleaves)"), (2, "2 pipeline stages (interleaved)")):
        cfg = load_config("tiny", {"parallel.pp": "2", "parallel.pp_schedule": "interleaved",
                                   "parallel.virtual_stages": str(stages)})
        assert said in run_header(cfg, trainer, "runs/x")
