"""The single-process trainer: learning, exact resume, atomic checkpoints, accumulation, precision, recompute."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardlm.checkpoint import complete_checkpoints, resolve_checkpoint
from shardlm.config import load_config
from shardlm.parallel.engine import LocalEngine
from shardlm.precision import DynamicLossScaler, LossScaleError, NoLossScaler
from shardlm.trainer import Trainer


def train(tmp_path, name="run", resume=None, **overrides):
    cfg = load_config("tiny", {k.replace("__", "."): v for k, v in overrides.items()})
    trainer = Trainer(cfg, out_dir=tmp_path / name, resume=resume, log=lambda *a: None)
    return trainer, trainer.run()


def losses(records):
    return [r["loss"] for r in records]


def test_loss_falls_and_metrics_are_written(tmp_path):
    trainer, recs = train(tmp_path, train__steps=30, train__eval_every=10)
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 31))
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_gib"):
        assert key in lines[0], key
    assert "eval_loss" in lines[9] and lines[29]["eval_loss"] < lines[9]["eval_loss"]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "run" / "config.toml").is_file()
    assert len(complete_checkpoints(tmp_path / "run")) == 1


def test_resume_from_a_checkpoint_reproduces_losses_exactly(tmp_path):
    _, full = train(tmp_path, "full", train__steps=10, train__save_every=4, train__keep_checkpoints=5)
    ckpts = complete_checkpoints(tmp_path / "full")
    assert [p.name for p in ckpts] == ["step_00000004", "step_00000008", "step_00000010"]
    trainer, rest = train(tmp_path, "resumed", resume=ckpts[0], train__steps=10)
    assert [r["step"] for r in rest] == list(range(5, 11))
    assert losses(rest) == losses(full)[4:]  # exact, not approximate
    assert [r["grad_norm"] for r in rest] == [r["grad_norm"] for r in full][4:]


def test_resume_allows_more_steps(tmp_path):
    train(tmp_path, "a", train__steps=4, train__lr_schedule="constant", train__warmup_steps=0)
    trainer, more = train(tmp_path, "a", resume=tmp_path / "a", train__steps=6, train__lr_schedule="constant",
                          train__warmup_steps=0)
    assert [r["step"] for r in more] == [5, 6]
    _, ref = train(tmp_path, "ref", train__steps=6, train__lr_schedule="constant", train__warmup_steps=0)
    assert losses(more) == losses(ref)[4:]
    lines = [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3, 4, 5, 6]


@pytest.mark.timeout(120)
def test_a_resume_that_moves_the_learning_rate_says_so(tmp_path):
    """A raised train.steps stretches the cosine: the resumed run's learning rate went back up from the floor the
    checkpoint's run had decayed to, without a word. Resumed on its own schedule, nothing is said."""
    train(tmp_path, "a", train__steps=4, train__save_every=2, train__keep_checkpoints=5, train__tensorboard=False)
    said = []
    cfg = load_config("tiny", {"train.steps": "8", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=tmp_path / "b", resume=tmp_path / "a", log=said.append).close()
    assert ("note: the learning-rate schedule is not the checkpoint's (train.steps 4 -> 8): step 5 runs at lr "
            "2.32e-03, where the checkpoint's schedule continued at 3.00e-04") in said, said
    said.clear()
    cfg = load_config("tiny", {"train.steps": "4", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=tmp_path / "c", resume=tmp_path / "a" / "checkpoints" / "step_00000002",
            log=said.append).close()
    assert not any("learning-rate" in m for m in said), said
    # changed during warmup, the rate at the resumed step is the same, the cosine after it is not
    train(tmp_path, "d", train__steps=4, train__warmup_steps=3, train__save_every=2, train__tensorboard=False)
    said.clear()
    cfg = load_config("tiny", {"train.steps": "8", "train.warmup_steps": "3", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=tmp_path / "e", resume=tmp_path / "d" / "checkpoints" / "step_00000002",
            log=said.append).close()
    assert any("the learning-rate schedule is not the checkpoint's (train.steps 4 -> 8)" in m for m in said), said


def test_resume_refuses_a_different_model(tmp_path):
    train(tmp_path, "a", train__steps=2)
    with pytest.raises(ValueError, match="model.hidden_size is 64 in the checkpoint and 32 in this run"):
        train(tmp_path, "b", resume=tmp_path / "a", model__hidden_size=32)


@pytest.mark.timeout(120)
def test_a_run_resumes_past_a_metrics_line_cut_short(tmp_path):
    """A kill or a full disk while a record is appended leaves metrics.jsonl's last line cut short: resuming the
    run once stopped on it with json's bare "Expecting ',' delimiter"."""
    train(tmp_path, "a", train__steps=2, train__tensorboard=False)
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1')
    _, more = train(tmp_path, "a", resume=tmp_path / "a", train__steps=3, train__tensorboard=False)
    assert [r["step"] for r in more] == [3]
    lines = [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3]


@pytest.mark.timeout(120)
def test_a_copy_of_a_checkpoint_beside_the_others_is_not_a_step_of_the_run(tmp_path):
    """`cp -r step_00000002 step_00000002.bak` in the checkpoints folder: the copy sorted as the newest
    checkpoint, and resuming the run failed with "invalid literal for int() with base 10: '00000002.bak'"."""
    import shutil
    train(tmp_path, "a", train__steps=2, train__tensorboard=False)
    ckpts = tmp_path / "a" / "checkpoints"
    shutil.copytree(ckpts / "step_00000002", ckpts / "step_00000002.bak")
    assert [p.name for p in complete_checkpoints(tmp_path / "a")] == ["step_00000002"]
    _, more = train(tmp_path, "a", resume=tmp_path / "a", train__steps=3, train__tensorboard=False,
                    train__keep_checkpoints=1)
    assert [r["step"] for r in more] == [3]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002.bak", "step_00000003"]  # rotation spares it


@pytest.mark.timeout(120)
def test_a_disk_that_fills_within_a_metrics_record_drops_that_record_and_the_run_goes_on(tmp_path, monkeypatch):
    """The disk filled while step 2's record was appended: the run ended with an OSError traceback, nothing
    saved since its last checkpoint, and metrics.jsonl kept the record cut short, with step 3's glued onto it."""
    import io

    import shardlm.metrics as metrics_module

    class DiskFull(io.FileIO):
        def write(self, data):
            data = bytes(data)
            return super().write(data[:10] if data.startswith(b'{"step": 2,') else data)

    def opened(file, mode="r", *args, **kwargs):
        return DiskFull(file, "a") if mode == "ab" else open(file, mode, *args, **kwargs)
    monkeypatch.setattr(metrics_module, "open", opened, raising=False)
    cfg = load_config("tiny", {"train.steps": "3", "train.tensorboard": "false"})
    said = []
    trainer = Trainer(cfg, out_dir=tmp_path / "a", log=said.append)
    trainer.run()
    trainer.close()
    assert any("metrics.jsonl could not be written" in m and "step 2's metrics" in m for m in said), said
    lines = [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 3]
    assert [p.name for p in complete_checkpoints(tmp_path / "a")] == ["step_00000003"]


@pytest.mark.timeout(120)
def test_a_disk_that_fills_at_tensorboard_turns_it_off_and_the_run_goes_on(tmp_path, monkeypatch):
    """TensorBoard is on by default: a full disk at its event file raised out of the metrics' write (its writer
    thread dead from then on), ending the run with a traceback, only rank 0's, the others left waiting."""
    tensorboard = pytest.importorskip("torch.utils.tensorboard")

    def full(self, tag, value, step, *args, **kwargs):
        if step == 2:
            raise OSError(28, "No space left on device")
    monkeypatch.setattr(tensorboard.SummaryWriter, "add_scalar", full)
    said = []
    trainer = Trainer(load_config("tiny", {"train.steps": "3"}), out_dir=tmp_path / "a", log=said.append)
    trainer.run()
    trainer.close()
    assert any("TensorBoard" in m and "No space left" in m and "step 2" in m for m in said), said
    assert [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [p.name for p in complete_checkpoints(tmp_path / "a")] == ["step_00000003"]


@pytest.mark.timeout(120)
def test_a_checkpoint_whose_rotation_was_killed_midway_is_removed_by_the_next_run(tmp_path, monkeypatch):
    """A kill while rotation deleted step 2 (its state.json gone first) left step_00000002 neither whole nor gone:
    no complete checkpoint, so no later rotation or cleanup removed it, a whole checkpoint's disk for good."""
    import shutil
    train(tmp_path, "a", train__steps=2, train__tensorboard=False)

    def killed(path, *args, **kwargs):
        if Path(path).exists():
            (Path(path) / "state.json").unlink()
            raise KeyboardInterrupt("killed mid-rotation")
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", killed)
        with pytest.raises(KeyboardInterrupt):
            train(tmp_path, "a", resume=tmp_path / "a", train__steps=3, train__keep_checkpoints=1,
                  train__tensorboard=False)
    train(tmp_path, "a", resume=tmp_path / "a", train__steps=4, train__keep_checkpoints=1, train__tensorboard=False)
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_00000004"]


@pytest.mark.timeout(120)
def test_a_run_on_a_relative_data_path_resumes_from_another_directory(tmp_path, monkeypatch):
    """data.path = "data", relative to where the run started: `shardlm train --resume RUN` from another directory
    (a job script's) took the path from the checkpoint and refused with "data.path = 'data' does not exist"."""
    from shardlm.cli import main
    from shardlm.data.prepare import prepare
    (tmp_path / "project").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "project" / "t.txt").write_text("hello world, this is some text\n" * 300)
    monkeypatch.chdir(tmp_path / "project")
    prepare(["t.txt"], "byte", "data")
    common = ["--train.device", "cpu", "--train.sample_tokens", "0", "--train.tensorboard", "false"]
    assert main(["train", "tiny", "--data.path", "data", "--train.steps", "2", "--out", "run", *common]) == 0
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["train", "--resume", str(tmp_path / "project" / "run"), "--train.steps", "3"]) == 0
    assert [p.name for p in complete_checkpoints(tmp_path / "project" / "run")][-1] == "step_00000003"


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    train(tmp_path, "a", train__steps=4, train__save_every=2, train__keep_checkpoints=5)
    import shardlm.checkpoint_write as ck
    calls = []

    def dying_open(file, mode="r", *args, **kwargs):  # the files a save writes, opened in checkpoint_write.py
        if "w" in mode:
            calls.append(str(file))
            if "step_00000006" in str(file):  # step 6's first file
                raise KeyboardInterrupt("killed mid-save")
        return open(file, mode, *args, **kwargs)

    monkeypatch.setattr(ck, "open", dying_open, raising=False)
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path, "a", resume=tmp_path / "a", train__steps=6, train__save_every=2, train__keep_checkpoints=5)
    assert calls, "the save was not attempted"
    assert resolve_checkpoint(tmp_path / "a").name == "step_00000004"
    leftovers = [p.name for p in (tmp_path / "a" / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert leftovers  # the half-written directory is there, and ignored


def test_killed_run_resumes_on_the_same_trajectory(tmp_path):
    """SIGKILL a real training process after a checkpoint, resume it, and compare with an uninterrupted run."""
    args = ["tiny", "--train.steps", "40", "--train.save_every", "3", "--train.log_every", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the uninterrupted run beside the one killed: each mostly starts Python, on a core of its own
    ref = subprocess.Popen([sys.executable, "-m", "shardlm", "train", *args, "--out", tmp_path / "ref"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "train", *args, "--out", tmp_path / "run"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "run" / "checkpoints" / "step_00000006").is_dir():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    try:
        ref_err = ref.communicate(timeout=240)[1]
    finally:
        ref.kill()  # where it timed out
    assert ref.returncode == 0, ref_err
    done = resolve_checkpoint(tmp_path / "run").name
    # The kill landed mid-run: the run had neither finished nor logged its last step.
    logged = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert done != "step_00000040" and len(logged) < 40, (done, len(logged))
    resumed = subprocess.run([sys.executable, "-m", "shardlm", "train", "--resume", tmp_path / "run"],
                             capture_output=True, text=True, env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    read = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    got, want = read(tmp_path / "run"), read(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, 41)), f"resumed from {done}"
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    _, one = train(tmp_path, "one", train__micro_batch_size=8, train__steps=5)
    _, acc = train(tmp_path, "acc", train__micro_batch_size=2, train__steps=5)
    # Same math; only the order of summation over the batch differs.
    torch.testing.assert_close(losses(acc), losses(one), rtol=1e-5, atol=0)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_training(tmp_path, mode):
    _, ref = train(tmp_path, "none", train__steps=4)
    trainer, got = train(tmp_path, mode, train__steps=4, train__recompute=mode)
    torch.testing.assert_close(losses(got), losses(ref), rtol=1e-6, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref], rtol=1e-5, atol=0)


def test_recompute_actually_recomputes():
    from shardlm.model import build_model
    cfg = load_config("tiny").model
    model = build_model(cfg)
    calls = {"n": 0}
    for block in model.blocks():
        orig = block.mlp.forward
        block.mlp.forward = lambda x, orig=orig: (calls.__setitem__("n", calls["n"] + 1), orig(x))[1]
    model.set_recompute("full")
    ids = torch.randint(0, 100, (2, 16))
    model(ids[:, :-1], ids[:, 1:]).backward()
    assert calls["n"] == 2 * cfg.num_layers  # forward, then again in backward


@pytest.mark.parametrize("halves", [False, True])
def test_a_block_compiled_in_halves_hands_over_its_mlp_gradients_first(halves):
    """What data parallelism relies on for block 0 (trainer.py): compiled as two graphs, the block's MLP
    gradients are accumulated before its attention's backward has run; compiled whole, not."""
    from shardlm.model import build_model
    model = build_model(load_config("tiny").model)
    block = model.blocks()[0]
    x = model.embed(torch.randint(0, 100, (2, 16))).detach().requires_grad_()
    rope = model.rope(0, 16, x.device, x.dtype)
    want = torch.autograd.grad(block(x, rope).square().sum(), x)[0]
    if halves:
        block.compile_in_halves(backend="aot_eager")
    else:
        block.compile(backend="aot_eager")
    attn = list(block.attn.parameters())
    before_attention = []
    for p in block.mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: before_attention.append(all(q.grad is None for q in attn)))
    out = block(x, rope).square().sum()
    out.backward()
    torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-7)
    assert before_attention == [halves] * len(list(block.mlp.parameters()))


COMPILED_CASES = {"llama": {}, "gpt2": {"model.arch": "gpt2", "model.num_kv_heads": "4"},
                  "lora": {"lora.rank": "4"}, "selective": {"train.recompute": "selective"},
                  "full": {"train.recompute": "full"}, "window": {"model.sliding_window": "8"},
                  "skip-down": {"train.recompute": "full-skip-down"},
                  "skip-out-down-lora": {"train.recompute": "full-skip-out-down", "lora.rank": "4"}}


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_blocks_have_the_eager_gradients(case):
    """The GPUs compile every block: AOTAutograd (with the eager backend, which decides the gradients) must give
    every trained parameter the eager model's gradient. On torch 2.11 it once gave a block's weights zero
    gradients (test_tensor_parallel.py), with outputs that looked right."""
    import copy

    from helpers import tiny_decoder
    model, cfg = tiny_decoder(COMPILED_CASES[case])
    if cfg.lora.rank:  # B starts at zero: the base's input gradients alone would not tell
        for name, p in model.named_parameters():
            if "lora" in name:
                torch.nn.init.normal_(p.data, std=0.02)
    model.set_recompute(cfg.train.recompute)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for compiled in (False, True):
        run = copy.deepcopy(model)
        if compiled:
            for block in run.blocks():
                block.compile(backend="aot_eager")
        run(ids[:, :-1], ids[:, 1:]).backward()
        grads.append({n: p.grad for n, p in run.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, want in grads[0].items():
        assert want is not None and want.norm() > 0, name
        torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_keeps_fp32_masters(tmp_path, precision):
    trainer, recs = train(tmp_path, train__steps=12, train__precision=precision)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(p.dtype == dtype for p in trainer.model.parameters())
    masters = [t for kind, t in trainer.engine.held_tensors() if kind == "masters"]
    assert masters and all(m.dtype == torch.float32 for m in masters)
    owned = trainer.engine.owned_shards("master")
    for name, p in trainer.model.named_parameters():
        lo, hi, m = owned[name]
        assert (lo, hi) == (0, p.numel())
        assert torch.equal(p.flatten(), m.to(dtype))  # the 16-bit weights are the rounded masters
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5
    if precision == "fp16":
        assert recs[-1]["loss_scale"] == 2.0**16


def test_fp16_overflow_skips_the_step_on_the_scaler_schedule(tmp_path):
    cfg = load_config("tiny", {"train.precision": "fp16"})
    trainer = Trainer(cfg, out_dir=None, log=lambda *a: None)
    before = trainer.engine.owned_shards("master")
    trainer.engine.finish_backward(True)  # a backward that added nothing: every .grad a zero view of its bucket
    next(trainer.model.parameters()).grad[0, 0] = float("inf")
    trainer.engine.optimizer_step(1e-3, 1)
    assert trainer.scaler.skipped_steps == 1
    assert trainer.scaler.scale == 2.0**16  # hysteresis 2: the first overflow does not halve yet
    after = trainer.engine.owned_shards("master")
    assert all(torch.equal(before[n][2], after[n][2]) for n in before)
    assert not any(v.any() for _, _, v in trainer.engine.owned_shards("exp_avg").values())  # no step was taken
    trainer.engine.finish_backward(True)
    next(trainer.model.parameters()).grad.fill_(float("nan"))
    trainer.engine.optimizer_step(1e-3, 2)
    assert trainer.scaler.scale == 2.0**15 and trainer.scaler.skipped_steps == 2


def test_dynamic_loss_scaler_rules():
    s = DynamicLossScaler(growth_interval=3)
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0**17
    s.update(True)
    assert s.scale == 2.0**17
    s.update(True)
    assert s.scale == 2.0**16
    s.update(True)  # hysteresis is only restored by growth
    assert s.scale == 2.0**15 and s.skipped_steps == 3
    low = DynamicLossScaler(scale=2.0, hysteresis=1, hysteresis_left=1)
    low.update(True)
    assert low.scale == 1.0
    with pytest.raises(LossScaleError, match="minimum loss scale"):
        low.update(True)
    with pytest.raises(FloatingPointError, match="diverged"):
        NoLossScaler().update(True, 3)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_optimizer_step_matches_torch_reference(optimizer):
    """Clipping by the global norm and the update equal torch's clip_grad_norm_ + optimizer."""
    from shardlm.model import build_model
    cfg = load_config("tiny", {"train.optimizer": optimizer, "train.grad_clip": 0.5, "train.weight_decay": 0.1})
    model, ref = build_model(cfg.model, seed=1), build_model(cfg.model, seed=1)
    opt = LocalEngine(model, cfg, NoLossScaler())
    decay = [p for p in ref.parameters() if p.dim() >= 2]
    rest = [p for p in ref.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    t = cfg.train
    ref_opt = (torch.optim.AdamW(groups, lr=1e-2, betas=(t.beta1, t.beta2), eps=t.eps) if optimizer == "adamw"
               else torch.optim.SGD(groups, lr=1e-2, momentum=t.momentum))
    ids = torch.randint(0, 200, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model(ids[:, :-1], ids[:, 1:]).backward()
        ref(ids[:, :-1], ids[:, 1:]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.optimizer_step(1e-2, 1)
        norm, skipped = opt.step_stats(1)
        assert skipped == 0
        assert norm == pytest.approx(ref_norm.item(), rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_one_process_frees_its_gradients_between_steps(tmp_path, monkeypatch):
    """train.free_grads (the default on one process): between steps every .grad is None, as after torch's
    zero_grad(set_to_none=True), and reads as zeros through the engine; the run, its gradients taken in many
    buckets, equals one that keeps its gradient buffer (accumulation, clipping)."""
    import shardlm.parallel.engine as engine
    monkeypatch.setattr(engine, "FREE_GRAD_BUCKET_MB", 0.05)  # `tiny` in some ten buckets, not one
    runs = {}
    for free in ("true", "false"):
        trainer, records = train(tmp_path, free, train__free_grads=free, train__micro_batch_size=4, train__steps=4)
        grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
        assert all(g is None for g in grads) if free == "true" else all(g is not None for g in grads)
        assert len(trainer.engine.flat.buckets) > 5 if free == "true" else len(trainer.engine.flat.buckets) == 1
        assert not any(v.any() for _, _, v in trainer.engine.owned_shards("grad").values())
        runs[free] = losses(records), [r["grad_norm"] for r in records], trainer.engine.owned_shards("master")
    (loss, norm, master), (loss_kept, norm_kept, master_kept) = runs["true"], runs["false"]
    torch.testing.assert_close(loss, loss_kept, rtol=1e-6, atol=0)  # the norm sums its buckets in another order
    torch.testing.assert_close(norm, norm_kept, rtol=1e-6, atol=0)
    for name, (_, _, v) in master.items():
        torch.testing.assert_close(v, master_kept[name][2], rtol=1e-5, atol=1e-6, msg=name)


def test_freed_gradients_are_taken_bucket_by_bucket_as_backward_reaches_them():
    """A bucket's memory comes back with the first gradient backward adds into it; a bucket that took none reads
    as zeros at the step, whose update equals torch's."""
    torch.manual_seed(0)
    model, ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4)), torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Linear(5, 4))
    ref.load_state_dict(model.state_dict())
    cfg = load_config("tiny", {"train.optimizer": "sgd", "train.grad_clip": 0.0, "train.weight_decay": 0.0})
    engine = LocalEngine(model, cfg, NoLossScaler(), buckets=[["1.weight", "1.bias"], ["0.weight", "0.bias"]],
                         free_grads=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=cfg.train.momentum)
    x = torch.randn(3, 6)
    for _ in range(2):
        assert all(p.grad is None for p in model.parameters())
        model[1](model[0](x).detach()).square().sum().backward()  # the first layer takes no gradient
        assert model[1].weight.grad is not None and model[0].weight.grad is None
        engine.finish_backward(True)
        assert not model[0].weight.grad.any()
        ref[1](ref[0](x).detach()).square().sum().backward()
        engine.optimizer_step(0.1, 1)
        ref_opt.step()
        ref_opt.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_cpu_adamw_kernel_matches_the_formula():
    """The CPU master-weight step (torch's vectorised fused AdamW) against AdamW written out in torch ops,
    from a scaled 16-bit gradient, writing the rounded 16-bit parameter; a set skip flag changes nothing."""
    import math

    from shardlm.kernels import adamw_master_step
    g = torch.Generator().manual_seed(0)
    n = 10_007
    master, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5
    grad = (torch.randn(n, generator=g) * 1e-2).to(torch.bfloat16)
    param = master.to(torch.bfloat16)
    scale, step, lr, b1, b2, eps, wd = torch.tensor(0.7), 5, 1e-3, 0.9, 0.95, 1e-8, 0.1
    ref_master, ref_m, ref_v = master.clone(), m.clone(), v.clone()
    adamw_master_step(master, param, grad, m, v, scale, torch.tensor(0), step=step, lr=lr, beta1=b1, beta2=b2,
                      eps=eps, weight_decay=wd)
    gs = grad.float() * scale
    ref_m.mul_(b1).add_(gs, alpha=1 - b1)
    ref_v.mul_(b2).addcmul_(gs, gs, value=1 - b2)
    denom = ref_v.sqrt() / math.sqrt(1 - b2**step) + eps
    ref_master.mul_(1 - lr * wd).addcdiv_(ref_m, denom, value=-lr / (1 - b1**step))
    torch.testing.assert_close(master, ref_master, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, ref_m, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v, ref_v, rtol=1e-6, atol=1e-12)
    assert torch.equal(param, master.to(torch.bfloat16))
    before = master.clone()
    adamw_master_step(master, param, grad, m, v, scale, torch.tensor(1), step=step + 1, lr=lr, beta1=b1, beta2=b2,
                      eps=eps, weight_decay=wd)
    assert torch.equal(master, before)


def test_sgd_training_learns(tmp_path):
    _, recs = train(tmp_path, train__steps=6, train__optimizer="sgd", train__lr=0.1)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0


def test_rehomed_buckets_keep_their_values_and_take_backward_gradients():
    """FlatParams.rehome moves weights and gradients into other flat buffers (the copy engines' symmetric
    memory): the values come along, the parameters and their .grad become views of the new buffers, and
    backward accumulates there."""
    from shardlm.flat import FlatParams
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    flat = FlatParams(model, [["1.weight", "1.bias"], ["0.weight", "0.bias"]], pad_multiple=4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.ones(1, 3)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = sum(b.numel for b in flat.buckets)
    data, grad = torch.full((total,), float("nan")), torch.full((total,), float("nan"))
    flat.rehome(data=data, grad=grad)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and torch.equal(p.grad, grads[n])
        assert p.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
    model(torch.ones(1, 3)).sum().backward()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, 2 * grads[n])
    assert torch.equal(grad, torch.cat([b.grad for b in flat.buckets]))


def test_sigterm_stops_after_the_step_saves_it_and_the_resumed_run_continues_exactly(tmp_path):
    """A preempted run (SIGTERM, as Slurm or torchrun send) finishes the step it is in, saves it, says how
    to continue and exits with 128 + 15; resumed, it gives the uninterrupted run's losses. The schedule is
    constant, so that the reference may stop where the signal happened to stop the run."""
    args = ["--train.lr_schedule", "constant", "--train.log_every", "1", "--train.tensorboard", "false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "train", "tiny", "--train.steps", "100000", *args,
                             "--out", tmp_path / "run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    read = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    stopped = read(tmp_path / "run")
    k = stopped[-1]["step"]
    assert [r["step"] for r in stopped] == list(range(1, k + 1))  # the last step is logged too
    assert resolve_checkpoint(tmp_path / "run").name == f"step_{k:08d}"
    assert f"stopped by SIGTERM after step {k} of 100000; to continue: shardlm train --resume {tmp_path / 'run'}" in out
    assert "sample:" not in out
    steps = ["--train.steps", str(k + 3)]
    resumed, ref = (subprocess.Popen([sys.executable, "-m", "shardlm", "train", *argv], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)  # side by side
                    for argv in (["--resume", tmp_path / "run", *steps],
                                 ["tiny", *steps, *args, "--out", tmp_path / "ref"]))
    errors = [p.communicate(timeout=240)[1] for p in (resumed, ref)]
    assert resumed.returncode == 0 and ref.returncode == 0, errors[0][-2000:] + errors[1][-2000:]
    got, want = read(tmp_path / "run"), read(tmp_path / "ref")
    assert [r["step"] for r in got] == list(range(1, k + 4))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]


def test_sigint_waits_for_the_step_but_a_second_one_interrupts_at_once():
    from shardlm.runtime.preemption import StopSignals
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # one SIGINT beside a SIGTERM (torchrun under Ctrl-C): one request
        time.sleep(0.01)  # Python runs handlers between bytecodes
        assert stop.received == signal.SIGTERM and stop.agreed() == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) is before


def test_compiled_cpu_adamw_matches_torch_fused_adamw():
    """cpu_adam.py's one-pass AdamW (built with this machine's C compiler) against torch's fused CPU AdamW:
    masters and moments to one rounding, the 16-bit weight the rounded master; a clipping factor applied
    to the gradient; its sum of squares, in double by fixed blocks, the same bits on 1 or 2 threads."""
    from shardlm import cpu_adam
    lib = cpu_adam.load()
    if lib is None:
        pytest.skip("no C compiler: kernels.adamw_master_step uses torch's fused AdamW")
    g = torch.Generator().manual_seed(0)
    n = 3 * cpu_adam.SQUARES_BLOCK + 5
    master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5
    step, lr, b1, b2, eps, wd, scale = 5, 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.7
    ref = [t.clone() for t in (master, m, v)]
    torch._fused_adamw_([ref[0]], [grad * scale], [ref[1]], [ref[2]], [], [torch.tensor(float(step))], lr=lr,
                        beta1=b1, beta2=b2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=None,
                        found_inf=None)
    out = torch.empty(n, dtype=torch.bfloat16)
    cpu_adam.adamw_step(lib, master, grad, m, v, out, scale=scale, lr=lr, beta1=b1, beta2=b2, eps=eps,
                        weight_decay=wd, bc1=1 - b1**step, bc2=1 - b2**step)
    for got, want in zip((master, m, v), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    assert torch.equal(out, master.to(torch.bfloat16))
    threads = torch.get_num_threads()
    try:
        sums = []
        for t in (1, 2):
            torch.set_num_threads(t)
            sums.append(cpu_adam.sum_squares(lib, grad))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(sums[0], sums[1])
    assert sums[0].item() == pytest.approx((grad.double() ** 2).sum().item(), rel=1e-7)


@pytest.mark.parametrize("every", [2, 0])
def test_python_garbage_collection_runs_on_the_step_schedule_and_is_restored_after(monkeypatch, every):
    """train.gc_every 2: automatic collection off while training, a collection before the first step and after
    every second one; 0: Python's own collector, untouched."""
    import gc

    import dist_fns
    from shardlm.runtime import gc_schedule
    calls = []
    real_collect = gc.collect
    monkeypatch.setattr(gc_schedule.gc, "collect", lambda generation=2: calls.append(generation) or real_collect(generation))
    trainer = dist_fns.tiny_trainer(1, {"train.steps": "4", "train.gc_every": str(every), "train.device": "cpu"})
    real_step, seen = trainer.train_step, []

    def step():
        seen.append((gc.isenabled(), len(calls)))
        return real_step()
    trainer.train_step = step
    assert gc.isenabled()
    trainer.run()
    assert gc.isenabled()
    if every:
        assert seen == [(False, 1), (False, 1), (False, 2), (False, 2)] and calls[:3] == [1, 1, 1]
    else:
        assert seen == [(True, 0)] * 4 and calls == []
    trainer.close()
