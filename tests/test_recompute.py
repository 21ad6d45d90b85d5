"""Partial recomputation (model/recompute.py): full-skip-down and full-skip-out-down train exactly as no
recomputation does, their recomputed forward runs neither skipped projection, and the planner counts what
they keep and what they save. Tensor and pipeline parallelism and compiled blocks: the recompute cases of
test_tensor_parallel.py, test_pipeline.py and test_trainer.py's COMPILED_CASES."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import tiny_decoder
from shardlm.config import load_config
from shardlm.plan import Layout, Workload, estimate, gpu
from shardlm.plan.flops import recompute_flops_per_token
from shardlm.plan.memory import activation_per_layer
from shardlm.trainer import Trainer

PARTIAL = ["full-skip-down", "full-skip-out-down"]
CASES = {"dense": {}, "lora": {"lora.rank": "4", "lora.alpha": "8"}}


def train(tmp_path, name, over):
    cfg = load_config("tiny", {"train.steps": "4", **over})
    trainer = Trainer(cfg, out_dir=tmp_path / name, log=lambda *a: None)
    records = trainer.run()
    return records, {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", PARTIAL)
def test_partial_recomputation_trains_as_without_recomputation(tmp_path, mode, case):
    """fp32: the losses, gradient norms and weights after four steps equal those of no recomputation."""
    ref, ref_weights = train(tmp_path, "none", CASES[case])
    got, weights = train(tmp_path, mode, {**CASES[case], "train.recompute": mode})
    torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-6, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5, atol=0)
    assert weights.keys() == ref_weights.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=1e-5, atol=1e-7)


class Products(TorchDispatchMode):
    """Counts the matrix products that read each named weight (below autograd: products actually run)."""

    def __init__(self, weights: dict):
        super().__init__()
        self.names = {w.untyped_storage().data_ptr(): n for n, w in weights.items()}
        self.count = dict.fromkeys(weights, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            for a in args:
                name = self.names.get(a.untyped_storage().data_ptr()) if isinstance(a, torch.Tensor) else None
                if name:
                    self.count[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["full", *PARTIAL])
def test_the_recomputed_forward_skips_the_out_and_down_projections(mode, case):
    """During backward each frozen or trained linear runs one product reading its weight (the input
    gradient), plus one more if the recomputed forward runs it: qkv and up always, out only under full and
    full-skip-down. The forward hooks of out agree (down's, even under full, is cut short by checkpoint's
    early stop before its product, the adapter's update computed first)."""
    model, cfg = tiny_decoder(CASES[case])
    model.set_recompute(mode)
    block = model.blocks()[1]  # not the first: its input needs a gradient under LoRA too
    weights = {"qkv": block.attn.qkv.weight, "out": block.attn.out.weight, "up": block.mlp.up.weight,
               "down": block.mlp.down.weight}
    ran = {"out": 0, "down": 0}
    for name in ran:
        getattr(block.attn if name == "out" else block.mlp, name).register_forward_hook(
            lambda *_, name=name: ran.__setitem__(name, ran[name] + 1))
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], ids[:, 1:])
    assert ran == {"out": 1, "down": 1}
    with Products(weights) as products:
        loss.backward()
    out = 2 if mode in ("full", "full-skip-down") else 1
    assert products.count == {"qkv": 2, "out": out, "up": 2, "down": 1}
    assert ran == {"out": 1 + (out - 1), "down": 1}


def test_the_planner_counts_what_partial_recomputation_keeps_and_saves():
    """Between full and none, in memory and in recomputed FLOPs; one llama2-7b block by hand: full keeps its
    input (2 bytes x tokens x hidden in bf16), full-skip-out-down also its mid-residual; the recomputed
    forward loses down's 2 x ffn x hidden FLOPs a token, and out's 2 x hidden x hidden."""
    m = load_config("llama2-7b").model
    w, g = Workload(2048, 1, 8), gpu("h200")
    tokens, h, f = 2048, m.hidden_size, m.ffn_size
    act = {r: activation_per_layer(m, w, Layout(recompute=r, precision="bf16"))
           for r in ("none", "full", *PARTIAL)}
    assert act["full"] == 2 * tokens * h
    assert act["full-skip-down"] == act["full"]
    assert act["full-skip-out-down"] == 2 * tokens * h + 2 * tokens * h
    assert act["full"] < act["full-skip-out-down"] < act["none"]
    flops = {r: recompute_flops_per_token(m, 2048, r) for r in ("none", "full", *PARTIAL)}
    assert flops["full"] - flops["full-skip-down"] == 2 * f * h * m.num_layers
    assert flops["full-skip-down"] - flops["full-skip-out-down"] == 2 * h * h * m.num_layers
    assert flops["none"] < flops["full-skip-out-down"] < flops["full-skip-down"] < flops["full"]
    est = {r: estimate(m, w, Layout(recompute=r, precision="bf16"), g) for r in ("none", "full", *PARTIAL)}
    assert est["full"].memory.total < est["full-skip-out-down"].memory.total < est["none"].memory.total
    assert est["full"].step_time_s > est["full-skip-down"].step_time_s > est["full-skip-out-down"].step_time_s > est["none"].step_time_s
