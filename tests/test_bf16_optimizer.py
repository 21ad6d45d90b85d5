"""train.optimizer_dtype = "bf16": masters and moments in bf16, each update computed in fp32 and rounded once (HF's
pure-bf16 training, Megatron's precision-aware optimizer): against torch's optimizers on a bf16 model, at dp 2
(DDP, ZeRO-1, ZeRO-3) against one process, config refusals, resume across optimizer dtypes, the planner."""
import math

import pytest
import torch

import dist_fns
from helpers import run_cli
from shardlm.config import ConfigError, load_config
from shardlm.kernels import adamw_master_step, sgd_master_step
from shardlm.model import build_model
from shardlm.parallel.engine import LocalEngine
from shardlm.plan import Layout, Workload, estimate, gpu
from shardlm.precision import NoLossScaler
from shardlm.testing.distributed import run_distributed
from shardlm.trainer import Trainer

BF16 = {"train.precision": "bf16", "train.optimizer_dtype": "bf16"}
ULP = torch.finfo(torch.bfloat16).eps  # a bf16 ulp relative to the value: 2^-7


def within_one_ulp(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Where bf16 `got` is `want` or its neighbour (one rounding the other way), or within `atol`."""
    return (got.float() - want.float()).abs() <= ULP * want.float().abs() + atol


def test_adamw_kernel_on_bf16_state_is_torch_fused_adamw_bit_for_bit():
    """bf16 master and moments read into fp32, updated in fp32, each rounded once: what torch's fused AdamW does
    on bf16 parameters with bf16 states, bit for bit (torch's per-op AdamW rounds after every op instead)."""
    g = torch.Generator().manual_seed(0)
    n = 100_003
    master = torch.randn(n, generator=g).bfloat16()
    m, v = (torch.randn(n, generator=g) * 1e-3).bfloat16(), (torch.rand(n, generator=g) * 1e-5).bfloat16()
    grad = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    ref = [t.clone() for t in (master, m, v)]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    adamw_master_step(master, None, grad, m, v, torch.tensor(1.0), torch.tensor(0), step=3, **kw)
    torch._fused_adamw_([ref[0]], [grad.clone()], [ref[1]], [ref[2]], [], [torch.tensor(3.0)], amsgrad=False,
                        maximize=False, grad_scale=None, found_inf=None, **kw)
    for got, want in zip((master, m, v), ref):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("step", [1, 2])
def test_sgd_kernel_on_bf16_state_rounds_once(step):
    """SGD with momentum on bf16 master and buffer: torch.optim.SGD's formula in fp32, each result rounded once."""
    g = torch.Generator().manual_seed(0)
    n = 70_001
    master, buf = torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16()
    grad, param = (torch.randn(n, generator=g) * 1e-2).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    scale, lr, mom, wd = torch.tensor(0.7), 1e-2, 0.9, 0.1
    d = (grad.float() * scale).add(master.float(), alpha=wd)  # torch.optim.SGD's ops, on fp32 copies
    want_buf = d if step == 1 else buf.float().mul(mom).add(d)
    want = master.float().add(want_buf, alpha=-lr)
    sgd_master_step(master, param, grad, buf, scale, torch.tensor(0), step=step, lr=lr, momentum=mom, weight_decay=wd)
    assert torch.equal(buf, want_buf.bfloat16()) and torch.equal(master, want.bfloat16()) and torch.equal(param, master)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_bf16_optimizer_matches_torch_on_a_bf16_model(optimizer):
    """A bf16 model with torch.optim.AdamW / SGD on its bf16 parameters (bf16 states), weight decay on the same
    matrices, clipped by the same fp32 global norm: the same losses and weights, and no fp32 master kept.
    AdamW's reference is torch's fused kernel, which rounds each result once as ours does; it is handed the clip
    factor as its gradient scale, so the clipped gradient stays fp32 as ours. Losses are equal bit for bit;
    weights but for elements of torch's scalar loop tails, where one fp32 rounding in a different order can flip
    a bf16 rounding (one element of 139,584 here), by one bf16 ulp. torch's SGD rounds after every op (the
    clipped gradient, the decayed gradient, the momentum's multiply and add), ours once: after three steps
    about 1.5% of the weights differ, by at most 2^-12 (the spacing of bf16 around the typical weight, 0.03 to
    0.06; more than their own ulp for weights near 0, where the update and the weight cancel), the losses in the
    fifth digit."""
    cfg = load_config("tiny", {"train.optimizer": optimizer, "train.grad_clip": "0.5", "train.weight_decay": "0.1",
                               **BF16})
    model, ref = (build_model(cfg.model, seed=1).to(torch.bfloat16) for _ in range(2))
    engine = LocalEngine(model, cfg, NoLossScaler())
    assert engine.memory()["optimizer"] == (4 if optimizer == "adamw" else 2) * engine.flat.numel  # no master
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    t = cfg.train
    ref_opt = (torch.optim.AdamW(groups, lr=1e-2, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
               if optimizer == "adamw" else torch.optim.SGD(groups, lr=1e-2, momentum=t.momentum, foreach=False))
    ids = torch.randint(0, 200, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        loss, ref_loss = model(ids[:, :-1], ids[:, 1:]), ref(ids[:, :-1], ids[:, 1:])
        assert loss.item() == ref_loss.item() if optimizer == "adamw" else loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
        loss.backward()
        ref_loss.backward()
        norm = sum(p.grad.float().pow(2).sum() for p in ref.parameters()).sqrt()
        clip = torch.clamp(t.grad_clip / (norm + 1e-6), max=1.0)
        if optimizer == "adamw":
            ref_opt.grad_scale = 1 / clip  # the fused kernel divides the gradient by it, in fp32
        else:
            for p in ref.parameters():
                p.grad.mul_(clip)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.optimizer_step(1e-2, 1)
        assert engine.step_stats(1)[0] == pytest.approx(norm.item(), rel=1e-6 if optimizer == "adamw" else 1e-3)
    differ = total = 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        if optimizer == "adamw":
            assert within_one_ulp(p, q).all(), name
        else:  # at most 2^-12: one bf16 ulp of the typical weight here (|w| in [2^-5, 2^-4))
            torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=2.0**-12, msg=name)
        differ, total = differ + int((p != q).sum()), total + p.numel()
    assert differ <= (2 if optimizer == "adamw" else 0.03 * total), differ


DP_MODES = {"ddp": {}, "zero1": {"parallel.zero_stage": "1"},
            "zero3": {"parallel.zero_stage": "3", "parallel.persist_threshold": "100"}}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_two_ranks_equal_one_process(optimizer):
    """DDP, ZeRO-1 and ZeRO-3 at dp 2 with bf16 masters and moments: the one-process run's losses and gathered
    weights. The gradients are reduced in bf16 (parallel.reduce_dtype compute) so that each rank's sum is the one
    process's accumulation bit for bit (an fp32 reduction keeps the sum unrounded, a better gradient, another
    run). Only the global norm's sum of squares adds in another order, which can move the clip factor by an
    fp32 ulp and so flip a rounding: each weight is the one process's or its bf16 neighbour, in a handful of
    elements. Each rank keeps bf16 state: its moments' shard, and under ZeRO a bf16 master shard."""
    common = {"train.steps": "3", "train.global_batch_size": "4", "train.micro_batch_size": "2",
              "train.optimizer": optimizer, "parallel.reduce_dtype": "compute", **BF16}
    ref = dist_fns.train_and_capture(0, 1, {**common, "train.device": "cpu"})
    states = 2 if optimizer == "adamw" else 1
    assert ref["bytes"]["optimizer"] == 2 * states * ref["numel"]
    for mode, over in DP_MODES.items():
        results = run_distributed(dist_fns.train_and_capture, 2, {**common, **over, "parallel.dp": "2"}, timeout=240)
        masters = next(r["masters"] for r in results if r["masters"] is not None)
        differ = 0
        for name, want in ref["masters"].items():
            # (or, where the step took a weight to about 0, 1e-9: there the weight and its update cancel)
            assert within_one_ulp(masters[name], want, atol=1e-9).all(), (mode, name)
            differ += int((masters[name] != want).sum())
        assert differ <= 8, (mode, differ)
        for r in results:
            assert r["losses"] == ref["losses"], mode
            torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], rtol=1e-5, atol=0)
            # unsharded: the weights are the masters; sharded: a bf16 master shard beside the moments'
            shards = states if mode == "ddp" else (states + 1) / 2
            assert r["bytes"]["optimizer"] == 2 * shards * r["numel"], mode


@pytest.mark.parametrize("key, value, extra, message", [
    ("train.optimizer_dtype", "fp16", {}, "train.optimizer_dtype = 'fp16' is not one of fp32, bf16"),
    ("train.optimizer_dtype", "bf16", {"train.precision": "fp32"}, "needs train.precision = 'bf16' \\(it is 'fp32'\\)"),
    ("train.optimizer_dtype", "bf16", {"train.precision": "fp16"}, "needs train.precision = 'bf16' \\(it is 'fp16'\\)"),
    ("train.optimizer_dtype", "bf16", {"train.precision": "bf16", "parallel.zero_stage": "2", "parallel.dp": "2",
                                       "parallel.offload": "optimizer"}, "with parallel.offload = 'optimizer'"),
    ("train.optimizer_dtype", "bf16", {"train.precision": "bf16", "train.beta2": "0.999"},
     "with train.beta2 = 0.999: bf16 rounds away a moment's change of 0.001 of itself"),
    ("train.optimizer_dtype", "bf16", {"train.precision": "bf16", "train.beta1": "0.998"},
     "with train.beta1 = 0.998"),
])
def test_config_refuses_what_cannot_run(key, value, extra, message):
    from shardlm.config import validate
    cfg = load_config("tiny", {key: value, **extra})
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=cfg.parallel.world)


def _trainer(tmp_path, name, optimizer_dtype, steps, resume=None, checkpoint_format="sharded"):
    cfg = load_config("tiny", {"train.precision": "bf16", "train.optimizer_dtype": optimizer_dtype,
                               "train.steps": str(steps), "train.tensorboard": "false",
                               "train.checkpoint_format": checkpoint_format})
    return Trainer(cfg, out_dir=tmp_path / name, resume=resume, log=lambda *a: None)


@pytest.mark.parametrize("checkpoint_format", ["sharded", "full"])
@pytest.mark.parametrize("saved, resumed", [("fp32", "bf16"), ("bf16", "fp32")])
def test_resume_across_optimizer_dtypes(tmp_path, saved, resumed, checkpoint_format):
    """Masters and moments are saved by name (sharded: in fp32; full: in the run's dtype) and read in fp32: an
    fp32 run's checkpoint resumes under a bf16 optimizer rounded to nearest, a bf16 run's under an fp32 one
    exactly widened; the step count and the training go on."""
    _trainer(tmp_path, "a", saved, 3, checkpoint_format=checkpoint_format).run()
    same = _trainer(tmp_path, "same", saved, 5, resume=tmp_path / "a")
    other = _trainer(tmp_path, "other", resumed, 5, resume=tmp_path / "a")
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        want, got = same.engine.owned_shards(kind), other.engine.owned_shards(kind)
        assert want.keys() == got.keys()
        for name, (_, _, value) in want.items():
            assert torch.equal(got[name][2], value.bfloat16().float() if resumed == "bf16" else value), (kind, name)
    records = other.run()
    assert [r["step"] for r in records] == [4, 5] and all(math.isfinite(r["loss"]) for r in records)


def test_bf16_second_moment_decays_at_the_largest_beta2_allowed():
    """After a gradient spike, steps of small gradients bring Adam's bf16 second moment down with fp32's at the
    largest beta2 the config allows with bf16 state (0.99): it stops within 1.6x of fp32's, where a change of 1%
    falls under half a bf16 spacing; at 0.999 (refused) it stays at the spike's size."""
    load_config("tiny", {**BF16, "train.beta2": "0.99"})
    for beta2, bound in ((0.99, 1.64), (0.999, None)):
        state = {dtype: [torch.zeros(8, dtype=dtype) for _ in range(3)] for dtype in (torch.bfloat16, torch.float32)}
        for step in range(1, 1201):
            g = torch.full((8,), 10.0 if step == 1 else 0.01)
            for dtype, (w, m, v) in state.items():
                adamw_master_step(w, None, g.to(dtype), m, v, torch.tensor(1.0), torch.tensor(0), step=step, lr=1e-4,
                                  beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0)
        ratio = (state[torch.bfloat16][2].float() / state[torch.float32][2]).max().item()
        if bound:
            assert 1 <= ratio <= bound, ratio
        else:
            assert ratio > 3 and state[torch.bfloat16][2].float().min() > 0.09  # 100 (1 - 0.999): the spike's


def test_planner_counts_bf16_state():
    """Per parameter: 12 bytes of fp32 master and moments; bf16 moments alone (4) where the weights are their own
    masters, bf16 master and moments (6) where ZeRO shards them; the CLI flag reaches the same figure."""
    m, w, g = load_config("tinyllama-1.1b").model, Workload(2048, 4, 16), gpu("h200")
    phi = m.num_params()
    for zero, bf16_bytes in ((0, 4), (1, 6), (3, 6)):
        dp = 1 if zero == 0 else 4
        fp32 = estimate(m, w, Layout(dp=dp, zero_stage=zero), g)
        bf16 = estimate(m, w, Layout(dp=dp, zero_stage=zero, optimizer_dtype="bf16"), g)
        assert fp32.memory.optimizer == pytest.approx(12 * phi / dp)
        assert bf16.memory.optimizer == pytest.approx(bf16_bytes * phi / dp)
        assert bf16.memory.total < fp32.memory.total and bf16.step_time_s < fp32.step_time_s
    one = estimate(m, w, Layout(zero_stage=1, optimizer_dtype="bf16"), g)  # ZeRO over one rank shards nothing
    assert one.memory.optimizer == pytest.approx(4 * phi)
    from shardlm.plan.layout import PlanError
    with pytest.raises(PlanError, match="--optimizer-dtype bf16 needs --precision bf16"):
        estimate(m, w, Layout(precision="fp16", optimizer_dtype="bf16"), g)
    for extra in (("--params", "7e9"), ("--model", "tiny", "--inference")):
        proc = run_cli("plan", *extra, "--optimizer-dtype", "bf16", "--precision", "bf16", check=False)
        assert proc.returncode == 2 and "--optimizer-dtype bf16 sizes a training's optimizer state" in proc.stderr
