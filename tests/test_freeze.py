"""`train.freeze` (parallel/freeze.py, issue 44 item 5): frozen modules keep their weights, take no optimizer
memory (exactly their fp32 masters and moments less), and train equal to one process at dp 2 (DDP, ZeRO-3)
and at ep 2; a checkpoint of a frozen run resumes; patterns that match nothing, or freeze everything, are
refused."""
import pytest
import torch

import dist_fns
from dp_cases import ATOL, MODES, RTOL, check_against_reference, check_trajectory, equality_case, reference
from shardlm.config import ConfigError, load_config, validate
from shardlm.config.freeze_patterns import matches
from shardlm.parallel.freeze import frozen_names
from shardlm.testing.distributed import run_distributed

MOE = {"model.num_experts": "4", "model.top_k": "2", "train.moe_z_loss_coef": "0.001"}  # `tiny` made mixtral-tiny
CASES = {"moe": {**MOE, "train.freeze": "experts,router"}, "embed": {"train.freeze": "embed"}}


def _model(overrides):
    from shardlm.model import Decoder
    cfg = load_config("tiny", overrides)
    with torch.device("meta"):
        return Decoder(cfg.model)


def test_patterns_match_dotted_suffixes_and_fnmatch():
    assert matches("router", "layers.1.mlp.router") and matches("layers.0", "layers.0")
    assert not matches("layers.1", "layers.10") and not matches("norm", "layers.0.attn_norm")
    assert matches("layers.*.attn", "layers.3.attn") and matches("mlp.experts.up", "layers.0.mlp.experts.up")
    moe = _model(MOE)
    assert frozen_names(moe, "experts,router") == {f"layers.{i}.mlp.{m}.weight" for i in (0, 1)
                                                   for m in ("experts.up", "experts.down", "router")}
    assert frozen_names(moe, "layers.0") == {n for n, _ in moe.named_parameters() if n.startswith("layers.0.")}
    assert frozen_names(_model({}), "embed") == {"embed.weight"}


@pytest.mark.parametrize("spec, why", [("experts", "'experts' matches no parameter"),
                                       ("embed,layers.7", "'layers.7' matches no parameter"),
                                       ("attn.core", "'attn.core' matches no parameter"),  # a module without any
                                       ("*", "freezes every trainable parameter")])
def test_bad_patterns_are_refused(spec, why):
    with pytest.raises(ConfigError, match=why) as refused:
        dist_fns.tiny_trainer(1, {"train.freeze": spec})
    # the modules it lists are patterns that would be taken: none without parameters (Decoder's output, attn.core)
    listed = str(refused.value).partition("its modules: ")[2].partition(";")[0].split(", ")
    assert "output" not in listed and "core" not in listed, listed


def test_an_empty_pattern_is_refused_by_validate():
    with pytest.raises(ConfigError, match="empty pattern"):
        validate(load_config("tiny", {"train.freeze": "embed,,router"}))


@pytest.mark.parametrize("case", ["moe", "embed"])
@pytest.mark.parametrize("precision, tensors", [("fp32", 2), ("bf16", 3)])  # moments (+ fp32 masters in bf16)
def test_frozen_weights_stay_and_take_no_optimizer_memory(case, precision, tensors):
    over = {**CASES[case], "train.steps": "3", "train.precision": precision}
    trainer = dist_fns.tiny_trainer(1, over)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert frozen and all(("experts" in n or "router" in n) if case == "moe" else n == "embed.weight" for n in frozen)
    memory = trainer.engine.memory()
    trainer.run()
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), n
            assert p.grad is None, n
    base = {k: v for k, v in over.items() if k != "train.freeze"}
    full = dist_fns.tiny_trainer(1, base).engine.memory()
    numel = sum(v.numel() for v in frozen.values())
    assert full["optimizer"] - memory["optimizer"] == numel * 4 * tensors
    assert full["grads"] > memory["grads"]


@pytest.mark.parametrize("preset, over", [("gpt2-124m", {"model.num_layers": "2"}),
                                          ("tiny", {"model.qkv_bias": "true", "model.tie_embeddings": "false"}),
                                          ("qwen2-moe-a2.7b", {"model.num_layers": "2"}),
                                          ("mixtral-tiny", {"model.moe_first_dense": "1", "model.num_layers": "3"})])
def test_the_planners_parameter_names_are_the_models(preset, over):
    """The planner matches train.freeze against ModelConfig.parameter_shapes (no torch): the Decoder's own."""
    cfg = load_config(preset, over).model
    with torch.device("meta"):
        from shardlm.model import Decoder
        model = Decoder(cfg)
    assert list(cfg.parameter_shapes().items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("case", ["moe", "embed"])
def test_the_planner_charges_frozen_parameters_what_the_engine_does(case):
    """The plan of a frozen run (Layout.from_config, as the pre-launch memory check makes it) holds their
    gradients and optimizer state less by exactly what the engine saves: a freeze that fits was refused."""
    from shardlm.plan import Layout, Workload, estimate_memory
    over = {**CASES[case], "train.precision": "fp32"}
    base = {k: v for k, v in over.items() if k != "train.freeze"}
    engine, plan = {}, {}
    for name, o in (("frozen", over), ("full", base)):
        trainer = dist_fns.tiny_trainer(1, o)
        engine[name], cfg = trainer.engine.memory(), trainer.cfg
        t = cfg.train
        plan[name] = estimate_memory(cfg.model, Workload(t.seq_len, t.micro_batch_size, t.global_batch_size),
                                     Layout.from_config(cfg))
    saved = engine["full"]["optimizer"] - engine["frozen"]["optimizer"]
    assert saved > 0 and plan["full"].optimizer - plan["frozen"].optimizer == saved
    assert plan["full"].grads - plan["frozen"].grads == saved / 2  # fp32 gradients: half the moments' bytes
    assert plan["full"].params == plan["frozen"].params  # frozen weights are held as the trained ones


@pytest.mark.parametrize("case", ["moe", "embed"])
@pytest.mark.parametrize("mode", ["ddp", "zero3"])
def test_dp_2_equals_one_process(case, mode):
    common = {**equality_case("adamw", 2), **CASES[case]}
    results = run_distributed(dist_fns.train_and_capture, 2, {**common, **MODES[mode], "parallel.dp": "2"},
                              timeout=300)
    ref = reference(common)
    check_against_reference(results, ref, 2)
    _check_frozen_kept(ref, common)


def _check_frozen_kept(ref, common):
    """The reference's frozen weights at the end are its initial ones."""
    init = dist_fns.tiny_trainer(1, common)
    for n, p in init.model.named_parameters():
        if not p.requires_grad:
            torch.testing.assert_close(ref["masters"][n], p.detach().float(), rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("spec, mode", [("experts,router", "ddp"), ("experts,router", "zero3"), ("experts", "zero3"),
                                        ("router", "ddp")])
def test_ep_2_equals_one_process(spec, mode):
    """Frozen experts split over ep still send their inputs' gradients back through the all-to-all: the
    attention's updates, and so the losses, are one process's."""
    common = {**equality_case("adamw", 2), **MOE, "train.freeze": spec}
    results = run_distributed(dist_fns.train_and_capture, 2,
                              {**common, **MODES[mode], "parallel.dp": "2", "parallel.ep": "2"}, timeout=300)
    ref = reference(common)
    check_trajectory(results, ref)
    _check_frozen_kept(ref, common)


@pytest.mark.parametrize("case, layout", [
    ("embed", {"parallel.dp": "2", **MODES["zero3"]}),
    ("moe", {"parallel.dp": "2", "parallel.ep": "2", "parallel.zero_stage": "1"}),
    ("moe", {"parallel.dp": "2", "parallel.ep": "2", **MODES["zero3"], "train.checkpoint_format": "full"})])
def test_a_frozen_run_resumes_at_one_process(tmp_path, case, layout):
    """Saved at step 2 at dp 2 (frozen weights written by the first replica: ZeRO-3's gathered, each ep rank's
    block of frozen experts), resumed at one process: the remaining losses and the final weights are the
    uninterrupted run's, the frozen ones their initial values."""
    over = {**CASES[case], "train.steps": "4", "train.save_every": "2", "train.keep_checkpoints": "5"}
    full = run_distributed(dist_fns.train_and_capture, 2, {**over, **layout}, str(tmp_path / "a"), timeout=300)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), ckpt)
    assert resumed["losses"] == pytest.approx(full[0]["losses"][2:], rel=1e-5)
    for name, value in full[0]["masters"].items():
        torch.testing.assert_close(resumed["masters"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    _check_frozen_kept(resumed, over)


def test_pp_2_with_the_first_block_frozen_equals_one_process():
    """Patterns are checked against the whole model: "layers.0" lives on the first stage only, and the second
    stage (which lacks it) trains its own parameters."""
    common = {**equality_case("adamw", 1), "train.freeze": "layers.0"}
    results = run_distributed(dist_fns.train_and_capture, 2, {**common, "parallel.dp": "1", "parallel.pp": "2"},
                              timeout=300)
    ref = reference(common)
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=0)
    masters = results[0]["masters"]
    for name, value in ref["masters"].items():
        torch.testing.assert_close(masters[name], value, rtol=RTOL, atol=ATOL, msg=name)
    _check_frozen_kept(ref, common)


@pytest.mark.parametrize("spec, moves", [("router", False), ("experts", True)])
def test_a_frozen_routers_bias_stops_updating(spec, moves):
    """model.router_bias_update_rate (parallel/moe_balance.py): a frozen router keeps its bias (zero from the
    start); with the router trained it moves."""
    over = {**MOE, "model.router_bias_update_rate": "0.01", "train.freeze": spec, "train.steps": "3"}
    bias = dist_fns.train_and_capture(0, 1, over)["router_bias"]
    assert bias and all((any(v != 0 for v in values)) == moves for values in bias.values())


def test_a_frozen_routers_bias_is_said_and_saved_as_it_started(tmp_path, capsys):
    """`shardlm train mixtral-tiny` with the bias's rate: frozen, the routers' bias is saved as it started (zero)
    and the startup line says it is held with them; trained, it moves."""
    from helpers import cli_here
    from shardlm.checkpoint import read_state
    args = ["train", "mixtral-tiny", "--model.router_bias_update_rate", "0.01", "--train.steps", "3"]
    said = cli_here(capsys, *args, "--train.freeze", "router", "--out", tmp_path / "frozen")
    assert "'router' frozen (0.001M parameters on this rank, and the routing bias of 2 MoE layers)" in said, said
    assert "routing bias" not in cli_here(capsys, *args, "--train.freeze", "embed", "--out", tmp_path / "trained")
    for run, moves in (("frozen", False), ("trained", True)):
        bias = read_state(tmp_path / run)["router_bias"]
        assert len(bias) == 2 and all(any(v != 0 for v in values) == moves for values in bias.values()), (run, bias)


@pytest.mark.parametrize("layout", [{"parallel.dp": "2"}, {"parallel.dp": "2", "parallel.ep": "2"},
                                    {"parallel.dp": "1", "parallel.pp": "2"}], ids=["dp2", "ep2", "pp2"])
def test_a_frozen_routers_bias_stays_at_every_layout(layout):
    """The bias's update reduces the loads over dp x cp x tp and each pipeline stage updates its own layers: a
    frozen router's stays zero at each layout the update runs at, a trained one's moves."""
    for spec, moves in (("router", False), ("experts", True)):
        over = {**MOE, "model.router_bias_update_rate": "0.01", "train.freeze": spec, "train.steps": "3", **layout}
        for r in run_distributed(dist_fns.train_and_capture, 2, over, timeout=300):
            bias = r["router_bias"]
            assert len(bias) == 2 and all(any(v != 0 for v in values) == moves for values in bias.values()), spec


def test_a_resume_that_changes_the_freeze_is_refused(tmp_path):
    """Parameters would enter or leave the optimizer mid-run: refused naming train.freeze, before the model."""
    over = {"train.freeze": "embed", "train.steps": "2"}
    dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    with pytest.raises(ConfigError, match="train.freeze is 'embed' in the checkpoint and ''"):
        dist_fns.tiny_trainer(1, {"train.steps": "4"}, out_dir=str(tmp_path / "b"), resume=ckpt)


def test_freeze_composes_with_lora(tmp_path):
    """LoRA froze the base already; a pattern may freeze adapters too (those of block 0 here), and freezing
    every adapter leaves nothing to train. A run that saves (its checkpoint's size planned) starts."""
    trainer = dist_fns.tiny_trainer(1, {"lora.rank": "4", "train.freeze": "layers.0", "train.steps": "2"},
                                    out_dir=tmp_path / "run")
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith("layers.1.") and ".lora." in n for n in trained)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if n.startswith("layers.0.")}
    trainer.run()
    for n, p in trainer.model.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), n
    with pytest.raises(ConfigError, match="freezes every trainable parameter"):
        dist_fns.tiny_trainer(1, {"lora.rank": "4", "train.freeze": "lora"})


def test_frozen_experts_at_ep_2_x_edp_2_equal_one_process_and_resume(tmp_path):
    """dp 4, ep 2 (each block of frozen experts on two ranks), ZeRO-3: equal to one process; the sharded
    checkpoint (each block written once, by its edp-coordinate-0 rank) resumes at one process."""
    over = {**equality_case("adamw", 4), **MOE, "train.freeze": "experts", "train.micro_batch_size": "1",
            "train.save_every": "2", "train.keep_checkpoints": "5"}
    results = run_distributed(dist_fns.train_and_capture, 4, {**over, **MODES["zero3"], "parallel.dp": "4",
                                                              "parallel.ep": "2"}, str(tmp_path / "a"), timeout=300)
    ref = reference(over)
    for r in results:
        torch.testing.assert_close(r["losses"], ref["losses"], rtol=RTOL, atol=0)
    for name, value in ref["masters"].items():
        torch.testing.assert_close(results[0]["masters"][name], value, rtol=RTOL, atol=ATOL, msg=name)
    _check_frozen_kept(ref, over)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"), ckpt)
    assert resumed["losses"] == pytest.approx(results[0]["losses"][2:], rel=1e-5)


def test_a_lora_runs_routing_bias_is_said_held_with_its_router(tmp_path, capsys):
    """LoRA freezes the router with the base, and with it the routing bias (model.router_bias_update_rate): the
    bias stayed zero without a word."""
    from helpers import cli_here
    said = cli_here(capsys, "train", "mixtral-tiny", "--model.router_bias_update_rate", "0.01", "--train.steps", "2",
                    "--lora.rank", "4", "--lora.targets", "q_proj,v_proj", "--out", tmp_path / "lora")
    assert "the routing bias of 2 MoE layers held with its router" in said, said
