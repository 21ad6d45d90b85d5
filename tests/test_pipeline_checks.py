"""A pipeline layout's faults found before any process starts, by the run's check and the planner alike: a stage
left nothing to train, an uneven split's heaviest stage, and refusals whose suggested fix is accepted in turn."""
import re

import pytest
import torch

from helpers import cli_proc
from shardlm import memory_check
from shardlm.config import ConfigError, load_config, validate
from shardlm.plan import Layout, Workload, estimate, estimate_memory, gpu


def _refusal(preset: str, world: int, **overrides) -> str:
    with pytest.raises(ConfigError) as e:
        validate(load_config(preset, {k: str(v) for k, v in overrides.items()}), world)
    return str(e.value)


@pytest.mark.parametrize("preset, overrides, said", [
    ("tiny", {"train.freeze": "embed,layers.0"}, "train.freeze = 'embed,layers.0' freezes every parameter of "
     "pipeline rank 0's layer 0"),
    ("mixtral-tiny", {"model.moe_first_dense": 1, "lora.rank": 4, "lora.targets": "down_proj"},
     "lora.targets = 'down_proj' adapts no linear of pipeline rank 1's layer 1"),
])
def test_a_stage_with_nothing_to_train_is_refused_before_launch(capsys, preset, overrides, said):
    """The engine found it on that stage's ranks only, after the rendezvous, the other stages waiting for them;
    the planner planned it."""
    msg = _refusal(preset, 2, **{"parallel.pp": 2, **overrides})
    assert said in msg and "parallel.pp_layers" in msg, msg
    if "train.freeze" in overrides:  # moe_first_dense is no planner flag
        plan = cli_proc(capsys, "plan", "--model", preset, "--pp", 2, "--freeze", overrides["train.freeze"])
        assert plan.returncode != 0 and "--pp-layers" in plan.stderr and "--freeze" in plan.stderr, plan.stderr


def test_a_stage_keeping_something_to_train_is_accepted():
    validate(load_config("tiny", {"parallel.pp": "2", "train.freeze": "layers.0"}), 2)
    validate(load_config("mixtral-tiny", {"parallel.pp": "2", "model.moe_first_dense": "1", "lora.rank": "4",
                                          "lora.targets": "q_proj"}), 2)


def test_an_uneven_split_is_planned_at_its_heaviest_stage(capsys):
    """Memory was the worse of the first and last ranks' (a balanced split's heaviest), time an even share."""
    cfg = load_config("llama2-7b", {})
    work = Workload(2048, 1, 8)
    even, uneven = Layout(pp=4), Layout(pp=4, pp_layers="1,29,1,1")
    assert estimate_memory(cfg.model, work, uneven).total > 2.5 * estimate_memory(cfg.model, work, even).total
    g = gpu("h100")
    assert estimate(cfg.model, work, uneven, g).tokens_per_s < 0.5 * estimate(cfg.model, work, even, g).tokens_per_s
    out = cli_proc(capsys, "plan", "--model", "llama2-7b", "--pp", 4, "--pp-layers", "1,29,1,1")
    assert out.returncode == 0 and "DOES NOT FIT" in out.stdout, out.stdout
    bad = cli_proc(capsys, "plan", "--model", "llama2-7b", "--pp", 4, "--pp-layers", "1,30")
    assert bad.returncode != 0 and "--pp-layers 1,30 must give 4 positive layer counts" in bad.stderr, bad.stderr


@pytest.mark.parametrize("flags, said", [
    (("--largest", "--pp", 2, "--zero", 3, "--global-batch", 8), "--zero 3 with --pp 2 is not supported"),
    (("--largest", "--cp", 3), "--cp 3 must divide the 32 attention heads"),
    (("--search", "--gpus", 4, "--cp", 0), "--cp 0 must be at least 1"),
    (("--pp", 0), "--pp 0 must be at least 1"),
])
def test_planner_refusals_name_the_layout(capsys, flags, said):
    """--largest said 'no model of this shape fits' for a refused layout; --search --cp 0 divided by zero."""
    out = cli_proc(capsys, "plan", "--model", "llama2-7b", *flags)
    assert out.returncode != 0 and said in out.stderr, out.stderr


def test_a_plan_with_stages_takes_a_batch_they_run(capsys):
    """The default global batch was one micro-batch per dp rank, which every pipeline schedule refuses."""
    for flags in (("--pp", 2), ("--pp", 2, "--pp-schedule", "interleaved", "--virtual-stages", 2),
                  ("--largest", "--pp", 2)):
        out = cli_proc(capsys, "plan", "--model", "tinyllama-1.1b", *flags)
        assert out.returncode == 0, out.stderr


def _apply(hint: str) -> dict:
    return dict(re.findall(r"--([a-z_]+\.[a-z_]+) ([^\s;)]+)", hint))


@pytest.mark.parametrize("preset, world, overrides", [
    ("tiny", 4, {"parallel.pp": 2}),
    ("default", 8, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2,
                    "train.micro_batch_size": 8}),
    ("tiny", 1, {"parallel.tp": 2, "parallel.sp": "true"}),
])
def test_the_world_size_hint_is_a_layout_the_check_accepts(preset, world, overrides):
    """The hint named a dp whose micro-batch count the schedule refused, or left sequence parallelism on at tp 1."""
    msg = _refusal(preset, world, **overrides)
    fix = _apply(msg.split("e.g.")[-1] if "e.g." in msg else msg.split("(", 1)[-1])
    assert fix, msg
    validate(load_config(preset, {**{k: str(v) for k, v in overrides.items()}, **fix}), world)


@pytest.mark.parametrize("global_batch, micro, said", [
    (6, 4, "train.global_batch_size = 6 is not divisible by train.micro_batch_size (4)"),
    (10, 4, "set train.micro_batch_size to 1"),  # interleaved over 2 stages: 5 or 10 micro-batches, 10 runs
])
def test_a_batch_that_does_not_divide_is_named_before_the_schedule(global_batch, micro, said):
    interleaved = {"parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2} if global_batch == 10 else {}
    msg = _refusal("default", 2, **{"parallel.pp": 2, "train.global_batch_size": global_batch,
                                    "train.micro_batch_size": micro, **interleaved})
    assert said in msg and "micro-batches per step" not in msg, msg


def test_the_memory_refusal_under_stages_suggests_what_stages_take(monkeypatch):
    """It said 'parallel.zero_stage 3', which pipelines refuse."""
    monkeypatch.setattr(memory_check, "free_memory", lambda device: 2**20)
    with pytest.raises(ConfigError) as e:
        memory_check.check_memory(load_config("tiny", {"parallel.pp": "2"}), torch.device("cpu"), lambda s: s)
    assert "parallel.zero_stage 1" in str(e.value) and "zero_stage 3" not in str(e.value), str(e.value)
