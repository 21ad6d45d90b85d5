"""LoRA (parallel/lora.py) against PEFT on the Hugging Face model (logits and the adapters' gradients), its
PEFT-format export loaded by PeftModel, the merged export, the frozen base, and LoRA under data, ZeRO,
tensor and pipeline parallelism against one process (gloo on CPU, fp32)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

import dist_fns
from dp_cases import RTOL
from helpers import cli_here
from shardlm.config import ConfigError, load_config, validate
from shardlm.model import Decoder
from shardlm.model.hf import write_hf_dir
from shardlm.parallel.lora import apply_lora, is_adapter_key, write_peft_dir
from shardlm.testing.distributed import run_distributed
from test_tensor_parallel import MODELS, OPTIMIZERS, check_equal

peft = pytest.importorskip("peft")

# Some modules of each family left out, so the fused layers also have rows no adapter updates.
TARGETS = {"llama": "q_proj,v_proj,o_proj,gate_proj,down_proj", "gpt2": "c_attn,c_proj"}


def lora_model(arch: str, **lora):
    cfg = load_config("tiny", {**MODELS[arch], "lora.rank": "4", "lora.alpha": "8", "lora.targets": TARGETS[arch],
                               **{f"lora.{k}": str(v) for k, v in lora.items()}})
    validate(cfg)
    model = Decoder(cfg.model)
    apply_lora(model, cfg.lora)
    model.init_weights(0)
    with torch.no_grad():  # B starts at zero: make the update visible
        for name, p in model.named_parameters():
            if ".lora.B." in name:
                p.normal_(0.0, 0.2)
    return cfg, model


def hf_peft(cfg, model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_hf_dir({k: v for k, v in state.items() if not is_adapter_key(k)}, cfg.model, tmp_path / "base")
    write_peft_dir(state, cfg.model, cfg.lora, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)


@pytest.mark.parametrize("arch, rslora", [("llama", False), ("llama", True), ("gpt2", False)])
def test_logits_and_adapter_gradients_equal_peft(tmp_path, arch, rslora):
    cfg, model = lora_model(arch, rslora=rslora)
    theirs = hf_peft(cfg, model, tmp_path)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in model.named_parameters()
                                                                          if is_adapter_key(n)}
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ours_logits, their_logits = model(ids), theirs(input_ids=ids).logits
    torch.testing.assert_close(ours_logits, their_logits, rtol=1e-5, atol=1e-5)
    for logits in (ours_logits, their_logits):
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    from shardlm.parallel.lora import peft_state
    ours = peft_state({n: p.grad for n, p in model.named_parameters() if p.requires_grad}, cfg.model)
    theirs_grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if p.requires_grad}
    assert ours.keys() == theirs_grads.keys()
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_blocks_run_each_adapted_linear_as_one_operator_with_autograds_gradients():
    """Compiled, a frozen linear and its adapters are one operator with a backward of its own
    (model/lora_linear.py): in fp64 its output and gradients equal autograd's through the plain products
    (gradcheck), torch.library.opcheck finds its registration consistent, and a compiled block calls it for
    every adapted linear (the compiled-block cases of test_trainer.py compare those blocks' gradients)."""
    from shardlm.model.lora_linear import lora_linear
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 8, dtype=torch.float64, generator=g), torch.randn(6, 8, dtype=torch.float64, generator=g)
    a, b = torch.randn(3, 8, dtype=torch.float64, generator=g), torch.randn(6, 3, dtype=torch.float64, generator=g)
    x, a, b = (t.requires_grad_() for t in (x, a, b))
    torch.testing.assert_close(lora_linear(x, w, a, b), F.linear(x, w) + F.linear(F.linear(x, a), b), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, a, b: lora_linear(x, w, a, b), (x, a, b))
    torch.library.opcheck(lora_linear, (x, w, a, b))

    cfg, model = lora_model("llama")
    block, ran = model.blocks()[0], []

    def backend(gm, example_inputs):
        ran.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    block.compile(backend=backend)
    model(torch.zeros(1, 4, dtype=torch.long))
    adapted = [m for m in block.modules() if getattr(m, "lora", None) is not None]
    assert ran.count(torch.ops.shardlm.lora_linear.default) == len(adapted) == 4


def test_a_lora_run_exports_a_peft_adapter_and_a_merged_model_and_keeps_its_base(tmp_path, capsys):
    """Train with adapters; the base weights in the checkpoint are the initial ones bit for bit; PeftModel
    over the base with the exported adapter, the merged export and `generate --adapter` all agree."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardlm.checkpoint import load_checkpoint
    from shardlm.inference import load_pretrained
    from shardlm.tokenizer import load_tokenizer
    run = tmp_path / "run"
    cli_here(capsys, "train", "tiny", "--train.steps", "4", "--lora.rank", "4", "--lora.targets",
             "q_proj,v_proj,down_proj", "--train.lr", "3e-2", "--out", run)
    cfg = load_config("tiny")
    initial = Decoder(cfg.model)
    initial.init_weights(cfg.train.seed)
    ckpt = load_checkpoint(run, with_optimizer=False)
    state = ckpt["model"]
    for name, want in initial.state_dict().items():
        assert torch.equal(state[name], want), name
    assert any(is_adapter_key(k) and k.endswith("B.q_proj") and state[k].abs().sum() > 0 for k in state)

    write_hf_dir({k: v for k, v in state.items() if not is_adapter_key(k)}, cfg.model, tmp_path / "base",
                 load_tokenizer(ckpt["path"]))
    cli_here(capsys, "export", "--checkpoint", run, "--out", tmp_path / "adapter")
    cli_here(capsys, "export", "--checkpoint", run, "--merge", "--out", tmp_path / "merged")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["r"] == 4 and sorted(conf["target_modules"]) == ["mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj"]
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", torch_dtype=torch.float32).eval()
    ours, _, _ = load_pretrained(run)
    on_base, _, _ = load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        with adapted.disable_adapter():
            assert not torch.allclose(adapted(input_ids=ids).logits, want, atol=1e-3)  # the adapter matters
        for got in (merged(input_ids=ids).logits, ours(ids), on_base(ids)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    g = json.loads(cli_here(capsys, "generate", "--model", tmp_path / "base", "--adapter", tmp_path / "adapter",
                            "--prompt", "To be", "--max-new-tokens", 4, "--json"))
    assert isinstance(g["completion"], str)
    cli_here(capsys, "train", "tiny", "--train.steps", "1", "--out", tmp_path / "plain")
    with pytest.raises(AssertionError, match="not a LoRA run"):
        cli_here(capsys, "export", "--checkpoint", tmp_path / "plain", "--merge", "--out", tmp_path / "x")


def test_bad_lora_settings_fail_naming_the_value():
    for over, words in [({"lora.targets": "q_proj,wq"}, "'wq', which is no llama module"),
                        ({"lora.dropout": "1.5"}, "lora.dropout = 1.5"),
                        ({"lora.rank": "-1"}, "lora.rank = -1"),
                        ({"lora.targets": "all-linear,q_proj"}, "every module is lora.targets = 'all-linear', alone"),
                        ({"lora.targets": "all_linear"}, "'all_linear', which is no llama module.*'all-linear', alone"),
                        ({"model.arch": "gpt2", "model.num_kv_heads": "0", "lora.targets": "q_proj"},
                         "'q_proj', which is no gpt2 module")]:
        with pytest.raises(ConfigError, match=words):
            validate(load_config("tiny", {"lora.rank": "4", **over}))


# SGD: in the first steps many of A's gradients nearly cancel (B starts at zero), and AdamW turns any
# rounding difference in them into a step of +-lr (3e-4 relative in the third step's gradient norm at dp 2).
LORA = {"lora.rank": "4", "lora.alpha": "8", "train.steps": "3", "train.global_batch_size": "8",
        "train.micro_batch_size": "2", **OPTIMIZERS["sgd"]}
LAYOUTS = {
    "dp2-ddp": {"parallel.dp": "2"},
    "dp2-zero1": {"parallel.dp": "2", "parallel.zero_stage": "1"},
    "dp2-zero2": {"parallel.dp": "2", "parallel.zero_stage": "2"},
    "dp2-zero3": {"parallel.dp": "2", "parallel.zero_stage": "3", "parallel.persist_threshold": "100"},
    "dp2-zero3-recompute": {"parallel.dp": "2", "parallel.zero_stage": "3", "parallel.persist_threshold": "100",
                            "train.recompute": "full"},
    "tp2-sp": {"parallel.tp": "2", "parallel.sp": "true", "parallel.dp": "1"},
    "tp2-sp-skip-out-down": {"parallel.tp": "2", "parallel.sp": "true", "parallel.dp": "1",
                             "train.recompute": "full-skip-out-down"},
    "tp4": {"parallel.tp": "4", "parallel.dp": "1"},
    "pp2": {"parallel.pp": "2", "parallel.dp": "1", "model.num_layers": "4", "train.micro_batch_size": "1"},
}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_under_every_layout_equals_one_process(arch, layout):
    """Adapters split like their bases under tensor parallelism (tp 4 keeps Llama's two key/value heads
    whole on every rank, and GPT-2's tied embedding is frozen across pipeline stages)."""
    over = {**MODELS[arch], **LORA, "lora.targets": TARGETS[arch], **LAYOUTS[layout]}
    world = int(over.get("parallel.dp", 1)) * int(over.get("parallel.tp", 1)) * int(over.get("parallel.pp", 1))
    ref = dist_fns.train_and_capture(0, 1, {**over, "train.device": "cpu", "parallel.dp": "1", "parallel.tp": "1",
                                            "parallel.pp": "1", "parallel.sp": "false", "parallel.zero_stage": "0"})
    results = run_distributed(dist_fns.train_and_capture, world, over, timeout=240)
    check_equal(results, ref)
    frozen = [k for k in ref["masters"] if not is_adapter_key(k)]
    assert frozen and ref["numel"] == sum(ref["masters"][k].numel() for k in ref["masters"] if is_adapter_key(k))


@pytest.mark.parametrize("target", [{"parallel.dp": "1"}, {"parallel.tp": "2", "parallel.dp": "1"},
                                    {"parallel.dp": "2", "parallel.zero_stage": "3"}], ids=["one", "tp2", "dp2-zero3"])
def test_a_lora_checkpoint_resumes_under_another_layout_on_the_same_trajectory(tmp_path, target):
    """The checkpoint holds the frozen base beside the adapters and their optimizer state."""
    over = {**LORA, "lora.targets": TARGETS["llama"], "train.steps": "6", "train.save_every": "3",
            "train.keep_checkpoints": "5", "train.device": "cpu"}
    full = dist_fns.train_and_capture(0, 1, {**over, "parallel.dp": "1"}, str(tmp_path / "a"))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    world = int(target.get("parallel.tp", 1)) * int(target["parallel.dp"])
    resumed = run_distributed(dist_fns.train_and_capture, world, {**over, **target}, str(tmp_path / "b"), ckpt,
                              timeout=240) if world > 1 else \
        [dist_fns.train_and_capture(0, 1, {**over, **target}, str(tmp_path / "b"), ckpt)]
    for r in resumed:
        torch.testing.assert_close(r["losses"], full["losses"][3:], rtol=RTOL, atol=0)


def test_a_lora_checkpoint_saved_under_zero3_holds_each_ranks_shard_of_the_base(tmp_path):
    """ZeRO-3 shards the frozen base; its sharded save gathered every unit whole on every rank (a 70B base on
    every GPU at the first save) for the first rank to write. Each rank writes its own shard now, and one
    process resumes from them on the same trajectory."""
    import json

    from shardlm.parallel.lora import is_adapter_key
    over = {**LORA, "lora.targets": TARGETS["llama"], "train.steps": "6", "train.save_every": "3",
            "train.keep_checkpoints": "5", "parallel.persist_threshold": "100"}
    zero3 = {"parallel.dp": "2", "parallel.zero_stage": "3"}
    full = run_distributed(dist_fns.train_and_capture, 2, {**over, **zero3}, str(tmp_path / "a"), timeout=240)[0]
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000003"
    base = [p for p in json.loads((ckpt / "manifest.json").read_text())["pieces"] if not is_adapter_key(p["name"])]
    written = {r: sum(p["hi"] - p["lo"] for p in base if p["file"].startswith(f"rank{r:05d}-")) for r in (0, 1)}
    assert written[0] and written[1] and abs(written[0] - written[1]) < 0.1 * sum(written.values()), written
    resumed = dist_fns.train_and_capture(0, 1, {**over, "train.device": "cpu", "parallel.dp": "1"},
                                         str(tmp_path / "b"), str(ckpt))
    torch.testing.assert_close(resumed["losses"], full["losses"][3:], rtol=RTOL, atol=0)


# ---- QLoRA ---------------------------------------------------------------------------------------------

NF4_HALF_GAP = (1.0 - 0.7229568362236023) / 2  # the widest gap between NF4's levels (Dettmers et al. 2023), halved


def test_nf4_dequantisation_error_is_within_nf4s_bound():
    """Each weight moves by at most half the widest gap between NF4 levels times its block's absmax, plus what
    the int8 quantisation of that absmax (double quantisation) moves it by: at most 1/127 of the largest."""
    from shardlm.config import NF4_BLOCK as BLOCK
    from shardlm.parallel.qlora import plain, to_nf4
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    w[5, 7] = 0.5  # an outlier: its block's scale, not the others', grows
    err = (plain(to_nf4(w)) - w).abs().reshape(-1, BLOCK)
    absmax = w.abs().reshape(-1, BLOCK).amax(1, keepdim=True)
    assert (err <= NF4_HALF_GAP * absmax + absmax.max() / 127).all()
    assert err.mean() < 0.1 * w.abs().mean() * 4  # and it is a 4-bit code, not noise


def test_qlora_computes_as_lora_on_the_dequantised_base_and_takes_a_quarter_of_the_memory():
    from shardlm.parallel.qlora import base_bytes, plain, quantize_base
    cfg, model = lora_model("llama")
    ref = Decoder(cfg.model)
    apply_lora(ref, cfg.lora)
    ref.load_state_dict(model.state_dict())
    quantize_base(model)
    linears = [block.get_submodule(path) for block in model.parts().layers for path in ("attn.qkv", "attn.out",
                                                                                        "mlp.up", "mlp.down")]
    nf4 = sum(base_bytes(linear) for linear in linears)
    bf16 = sum(linear.weight.numel() * 2 for linear in linears)
    assert nf4 <= 0.27 * bf16  # 4 bits, plus an int8 scale per 64 weights and an fp32 one per 256 of those
    with torch.no_grad():
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            q.copy_(plain(p))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    a, b = model(ids[:, :-1], ids[:, 1:]), ref(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    a.backward()
    b.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


QLORA = {**LORA, "lora.quantize": "nf4", "lora.targets": TARGETS["llama"]}


def _compiled_block_saves(block, x) -> tuple[int, torch.Tensor, torch.Tensor, dict]:
    """Bytes the compiled block saves for backward that are not its parameters (nor NF4 weights), its output,
    and the gradients of x and of the adapters."""
    params = {p.data_ptr() for p in block.parameters() if type(p).__name__ != "NF4Tensor"}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        if type(t).__name__ != "NF4Tensor" and t.data_ptr() not in params | seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t
    x = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = torch.compile(block)(x)
    (y ** 2).sum().backward()
    return total, y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters() if p.requires_grad}


@pytest.mark.timeout(240)
def test_a_compiled_qlora_block_keeps_its_base_in_4_bits_for_backward():
    """Compiled, the partitioner kept each NF4 weight's 16-bit form from forward to backward (it does not rerun
    NF4's code lookup): a copy of the base per micro-batch in flight, the memory QLoRA exists to save. The
    compiled QLoRA block saves about what the LoRA block saves, and gives eager's output and gradients."""
    from shardlm.parallel.qlora import quantize_base
    saved = {}
    for quantize in ("none", "nf4"):
        cfg, model = lora_model("llama", quantize=quantize, targets="q_proj,k_proj,v_proj,o_proj,gate_proj,"
                                "up_proj,down_proj")
        if quantize == "nf4":
            quantize_base(model)
        block = model.parts().layers[0]
        x = torch.randn(2, 16, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
        saved[quantize], y, grad_x, grads = _compiled_block_saves(block, x)
    base = 4 * sum(p.numel() for p in block.parameters() if type(p).__name__ == "NF4Tensor")  # in fp32
    assert saved["nf4"] < saved["none"] + base / 4, (saved, base)
    for p in block.parameters():
        p.grad = None
    xe = x.clone().requires_grad_(True)
    ye = block(xe)
    (ye ** 2).sum().backward()
    def close(a, b):  # fp32, the compiled kernels adding in their own order: within 1e-5 of the largest
        return ((a - b).abs().max() / b.abs().max()).item() < 1e-5
    assert close(y, ye.detach()) and close(grad_x, xe.grad)
    assert all(close(grads[name], p.grad) for name, p in block.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("layout", ["dp2-zero1", "dp2-zero3", "pp2", "tp2-sp"])
def test_qlora_under_data_tensor_and_pipeline_parallelism_equals_one_process(layout):
    """Data and pipeline parallelism quantise each weight whole, as one process does: equal. Tensor parallelism
    quantises each rank's shard, whose NF4 block scales are double-quantised in groups of their own: a base
    that differs in the scales' last bits, so the run follows one process's closely, not exactly."""
    # At tp 2 each shard's rows hold whole blocks of 64 (hidden 128): the blocks are one process's
    over = {**QLORA, **LAYOUTS[layout], **({"model.hidden_size": "128"} if layout == "tp2-sp" else {})}
    world = int(over.get("parallel.dp", 1)) * int(over.get("parallel.pp", 1)) * int(over.get("parallel.tp", 1))
    ref = dist_fns.train_and_capture(0, 1, {**over, "train.device": "cpu", "parallel.dp": "1", "parallel.pp": "1",
                                            "parallel.tp": "1", "parallel.sp": "false", "parallel.zero_stage": "0"})
    results = run_distributed(dist_fns.train_and_capture, world, over, timeout=240)
    if layout != "tp2-sp":
        check_equal(results, ref)
        return
    for r in results:  # 9.3e-4 when written (1.3e-2 with shards of half blocks, at hidden 64)
        rel = [abs(a / b - 1) for key in ("losses", "grad_norms") for a, b in zip(r[key], ref[key])]
        assert max(rel) < 2e-3, rel


def test_a_qlora_run_resumes_close_to_its_trajectory_and_exports_merged(tmp_path, capsys):
    """Resuming quantises the saved (dequantised) base again: the same codes, block scales equal up to the
    double quantisation's rounding (parallel/qlora.py), so the losses follow closely, not bit for bit."""
    over = {**QLORA, "train.steps": "6", "train.save_every": "3", "train.keep_checkpoints": "5", "train.device": "cpu",
            "parallel.dp": "1"}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"),
                                         str(tmp_path / "a" / "checkpoints" / "step_00000003"))
    torch.testing.assert_close(resumed["losses"], full["losses"][3:], rtol=1e-3, atol=0)
    cli_here(capsys, "export", "--checkpoint", tmp_path / "a", "--merge", "--out", tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    said = cli_here(capsys, "export", "--checkpoint", tmp_path / "a", "--out", tmp_path / "adapter")
    assert "; fitted to the base quantised to NF4: load the base in 4-bit NF4" in said, said  # not the 16-bit one


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", ["0", "3"])
def test_a_resumed_qlora_run_reads_its_frozen_base_a_tensor_at_a_time(tmp_path, monkeypatch, stage):
    """A resume read every frozen weight of the checkpoint (in fp32) into one dict before quantising the first:
    4x a 16-bit model's bytes of host memory on every rank, the out-of-memory kill of a 70B QLoRA resume. Each
    is read as it is set."""
    import weakref

    import shardlm.resuming
    from shardlm.sharded_read import LazyMap
    over = {**QLORA, "train.steps": "1", "train.device": "cpu", "parallel.zero_stage": stage}
    dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    real, alive, most = shardlm.resuming.load_checkpoint, set(), [0]

    def counted(*args, **kwargs):
        ckpt = real(*args, **kwargs)
        model = ckpt["model"]

        def read(key):
            value = model[key].clone()
            if ".lora." not in key:  # the frozen base's
                alive.add(key)
                weakref.finalize(value, alive.discard, key)
                most[0] = max(most[0], len(alive))
            return value
        ckpt["model"] = LazyMap(list(model), read)
        return ckpt
    monkeypatch.setattr(shardlm.resuming, "load_checkpoint", counted)
    resumed = dist_fns.train_and_capture(0, 1, {**over, "train.steps": "2"}, str(tmp_path / "b"), str(tmp_path / "a"))
    assert len(resumed["losses"]) == 1 and 0 < most[0] <= 2, most


@pytest.mark.timeout(180)
def test_an_asynchronous_qlora_save_dequantises_its_base_a_tensor_at_a_time(tmp_path, monkeypatch):
    """An asynchronous save listed every piece before copying any: each NF4 weight dequantised at once, the
    16-bit base on the GPU beside the 4-bit one (out of memory at the first save of a run QLoRA made fit). Each
    is dequantised as it is copied; the run resumes as the synchronous save's does."""
    import shardlm.parallel.sharded_state as sharded_state
    import shardlm.run_checkpoint as run_checkpoint
    from shardlm.parallel.qlora import is_nf4
    plain, snapshot, made, most = sharded_state.plain, run_checkpoint.snapshot, [], [0]

    def counted(t):
        value = plain(t)
        if is_nf4(t):  # its storage outlives the tensor in the views (pieces) taken of it
            made.append(value.untyped_storage()._weak_ref())
        return value

    def copied(*args, **kwargs):  # the dequantised weights still held once the host copy is made
        out = snapshot(*args, **kwargs)
        most[0] = max(most[0], sum(not torch.UntypedStorage._expired(ref) for ref in made))
        return out
    monkeypatch.setattr(sharded_state, "plain", counted)
    monkeypatch.setattr(run_checkpoint, "snapshot", copied)
    over = {**QLORA, "train.steps": "4", "train.save_every": "2", "train.device": "cpu",
            "train.checkpoint_async": "true"}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    assert made and most[0] <= 1, most
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"),
                                         str(tmp_path / "a" / "checkpoints" / "step_00000002"))
    torch.testing.assert_close(resumed["losses"], full["losses"][2:], rtol=1e-3, atol=0)


@pytest.mark.timeout(180)
def test_a_qlora_resume_at_another_tensor_parallel_size_says_its_base_is_quantised_anew(tmp_path):
    """Each tensor-parallel rank quantises its shard of the base: resumed at another parallel.tp, the base was
    quantised again in other blocks and the adapters went on over a base they were not fitted to, unsaid."""
    over = {**QLORA, **LAYOUTS["tp2-sp"], "model.hidden_size": "128", "train.steps": "1"}
    run_distributed(dist_fns.train_and_capture, 2, over, str(tmp_path / "a"), timeout=150)
    one = {**over, "parallel.tp": "1", "parallel.sp": "false", "train.steps": "2", "train.device": "cpu"}
    said = dist_fns.lines_of_a_resume(0, 1, one, str(tmp_path / "a"))
    assert any(line.startswith("note: lora.quantize = 'nf4' at parallel.tp 1, the checkpoint's 2: each rank "
                               "quantises its shard of the base") for line in said), said
    same = {**one, "train.steps": "1"}
    dist_fns.train_and_capture(0, 1, same, str(tmp_path / "b"))
    said = dist_fns.lines_of_a_resume(0, 1, {**same, "train.steps": "2"}, str(tmp_path / "b"))
    assert not any("lora.quantize" in line for line in said), said  # the same layout: the same blocks


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_adapter_count_and_flops_are_what_the_model_trains(arch):
    """LoRAConfig.adapter_count (the planner's and the MFU's) against the parameters the model trains; the FLOPs per
    token drop the frozen weights' gradient: 4 N + 6 x adapters + attention."""
    cfg, model = lora_model(arch)
    adapters = cfg.lora.adapter_count(cfg.model)
    assert adapters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    full, lora = cfg.model.flops_per_token(32), cfg.lora.flops_per_token(cfg.model, 32)
    attention = 12 * cfg.model.num_layers * cfg.model.num_heads * cfg.model.head_size * 32
    assert lora == (full - attention) // 6 * 4 + 6 * adapters + attention


def test_merging_into_a_bf16_base_keeps_the_update_in_fp32():
    """An update below bf16's spacing at the base's magnitude survives the merge (writers cast after)."""
    from shardlm.parallel.lora import merged
    cfg, model = lora_model("llama")
    state = {k: (v.bfloat16() if not is_adapter_key(k) else v) for k, v in model.state_dict().items()}
    out = merged(state, cfg.model, cfg.lora)
    key = "layers.0.attn.out.weight"
    a, b = state["layers.0.attn.out.lora.A.o_proj"], state["layers.0.attn.out.lora.B.o_proj"]
    assert out[key].dtype == torch.float32
    torch.testing.assert_close(out[key], state[key].float() + cfg.lora.alpha / cfg.lora.rank * (b @ a))


def test_merging_reads_each_base_weight_when_its_merged_weight_is_read():
    """`shardlm export --merge` of a sharded checkpoint holds one full tensor at a time: merging reads no base
    weight until the writer asks for its merged one, and each once."""
    from shardlm.sharded_read import LazyMap
    from shardlm.parallel.lora import merged
    cfg, model = lora_model("llama")
    full, reads = model.state_dict(), []

    def read(key):
        reads.append(key)
        return full[key]
    out = merged(LazyMap(full.keys(), read), cfg.model, cfg.lora)
    assert all(is_adapter_key(k) for k in reads)  # the adapters alone, to plan the merge
    reads.clear()
    key = "layers.0.attn.out.weight"
    a, b = full["layers.0.attn.out.lora.A.o_proj"], full["layers.0.attn.out.lora.B.o_proj"]
    torch.testing.assert_close(out[key], full[key].float() + cfg.lora.alpha / cfg.lora.rank * (b @ a))
    assert reads == [key]


def test_a_peft_adapter_with_settings_this_version_does_not_apply_is_refused(tmp_path):
    from shardlm.parallel.lora import read_peft_dir
    cfg, model = lora_model("llama")
    write_peft_dir(model.state_dict(), cfg.model, cfg.lora, tmp_path)
    conf = json.loads((tmp_path / "adapter_config.json").read_text())
    for extra, words in [({"rank_pattern": {"q_proj": 8}}, "rank_pattern"), ({"use_dora": True}, "use_dora"),
                         ({"bias": "all"}, "bias = 'all'"), ({"r": None}, "lacks r")]:
        (tmp_path / "adapter_config.json").write_text(json.dumps({**conf, **extra}))
        with pytest.raises(ConfigError, match=words):
            read_peft_dir(tmp_path, cfg.model)


def test_an_adapter_of_another_architecture_or_outside_the_blocks_is_refused_naming_it(tmp_path):
    """A GPT-2 adapter given to a Llama model (and back), or a PEFT adapter of lm_head: a ValueError of
    list.index ("'layers' is not in list") named neither the adapter nor the tensor."""
    from safetensors.torch import load_file, save_file

    from shardlm.parallel.lora import read_peft_dir
    for arch, other in (("gpt2", "llama"), ("llama", "gpt2")):
        cfg, model = lora_model(arch)
        write_peft_dir(model.state_dict(), cfg.model, cfg.lora, tmp_path / arch)
        with pytest.raises(ConfigError, match=rf"{arch}.*is no adapter of a linear inside a {other} block"):
            read_peft_dir(tmp_path / arch, lora_model(other)[0].model)
    tensors = load_file(tmp_path / "llama" / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, tmp_path / "llama" / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"lm_head.lora_A.weight is no adapter .*not of lm_head or embed_tokens"):
        read_peft_dir(tmp_path / "llama", lora_model("llama")[0].model)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_zero3_shards_the_frozen_base_too(arch):
    """No rank holds the whole base at rest: each keeps its 1/N of the frozen weights (padded), as of the
    trained ones (the memory FSDP + LoRA users run out of)."""
    for shards, total, resident in run_distributed(dist_fns.lora_zero3_frozen, 2, MODELS[arch], timeout=120):
        assert resident == 0
        assert total / 2 <= shards <= total / 2 + 8


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_lora_in_16_bits_trains_the_adapters_alone(precision):
    """16-bit weights, fp32 masters of the adapters only, the loss scale (fp16) over the adapters' gradients."""
    trainer = dist_fns.tiny_trainer(1, {"lora.rank": "4", "train.precision": precision, "train.steps": "8",
                                        "train.lr": "1e-2", "train.device": "cpu"})
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    losses = [r["loss"] for r in trainer.run()]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if not p.requires_grad)
    masters = [t for kind, t in trainer.engine.held_tensors() if kind == "masters"]
    assert sum(t.numel() for t in masters) == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
