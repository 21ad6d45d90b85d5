"""Mixed precision and numerical failures as a user meets them through `shardlm train`: what a divergence, an
fp16 overflow or a precision the device lacks leaves on the console and in the run directory."""
import pytest
import torch

from helpers import cli_proc
from shardlm.checkpoint import complete_checkpoints

QUIET = ["--train.tensorboard", "false"]


def train(capsys, *args):
    proc = cli_proc(capsys, "train", "tiny", *QUIET, *args)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_save_after_a_gradient_that_was_not_finite_keeps_the_last_good_checkpoint(tmp_path, capsys, precision):
    """bf16/fp32 learn of a non-finite gradient when the step's numbers are read (every train.log_every steps):
    the saves in between wrote the diverged run's weights under later steps, and with keep_checkpoints 1 the
    last good checkpoint was deleted; the error then named a checkpoint saved after the divergence."""
    run = tmp_path / "run"
    proc = train(capsys, "--out", run, "--train.precision", precision, "--train.lr", "1e3", "--train.steps", 20,
                 "--train.save_every", 2, "--train.log_every", 10, "--train.keep_checkpoints", 1)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "the gradient of step 4 was not finite" in line and "after 3 updates the run diverged" in line, line
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]
    assert line.endswith(f"(the last checkpoint is {run / 'checkpoints' / 'step_00000002'})"), line


def test_an_fp16_nan_loss_before_any_update_names_the_initialisation_not_the_learning_rate(tmp_path, capsys):
    """A first fp16 step whose forward overflows was blamed on train.lr ("the run diverged (lower train.lr")
    though no update had run."""
    proc = train(capsys, "--out", tmp_path / "run", "--train.precision", "fp16", "--model.init_std", 30,
                 "--train.steps", 2)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "train.lr" not in line, line
    assert "step 1: the loss is nan in fp16 before any update" in line and "model.init_std = 30" in line, line
    assert line.endswith("use train.precision bf16 or a smaller model.init_std"), line


def test_fp16_fine_tuning_weights_past_its_range_names_them_and_bf16(tmp_path, capsys):
    """A checkpoint trained in bf16 or fp32 can hold activations past fp16's range: fine-tuning it in fp16
    told the user to lower train.lr."""
    from safetensors.torch import load_file, save_file
    train(capsys, "--out", tmp_path / "base", "--train.steps", 1)
    assert cli_proc(capsys, "export", "--checkpoint", tmp_path / "base", "--out", tmp_path / "hf").returncode == 0
    weights = tmp_path / "hf" / "model.safetensors"
    save_file({k: v if "norm" in k else v * 300 for k, v in load_file(weights).items()}, weights)
    proc = train(capsys, "--out", tmp_path / "run", "--train.precision", "fp16", "--train.init_from", tmp_path / "hf",
                 "--train.steps", 2)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "train.lr" not in line, line
    assert "before any update" in line and line.endswith("with train.init_from's weights: use train.precision bf16")


def test_an_fp16_nan_loss_after_updates_is_divergence(tmp_path, capsys):
    proc = train(capsys, "--out", tmp_path / "run", "--train.precision", "fp16", "--train.lr", "1e3",
                 "--train.steps", 4)
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and line.endswith(
        "step 2: the loss is nan in fp16, which is no loss-scale overflow: the run diverged (lower train.lr, or "
        "train.precision bf16)"), line


def fake_gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    """torch.cuda as a machine with one such GPU shows it, for the checks made before anything runs on it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.version, "hip", None)


def test_bf16_on_a_gpu_without_bf16_is_refused_before_the_run_starts(tmp_path, capsys, monkeypatch):
    """A T4 (7.5) or a V100 (7.0) has no bf16 arithmetic: the bf16 presets (gpt2-124m and up) started there, torch
    emulating what it could, the Triton kernels failing as they were built. Refused before --out is made."""
    fake_gpu(monkeypatch, (7, 5), "Tesla T4")
    proc = train(capsys, "--out", tmp_path / "run", "--train.device", "cuda", "--train.precision", "bf16")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "train.precision = 'bf16' needs a GPU with bf16 arithmetic" in line, line
    assert "Tesla T4 is 7.5: use train.precision fp16" in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_an_attention_kernel_the_cpu_lacks_is_refused_before_the_run_starts(tmp_path, capsys, backend):
    """It ended the first step in SDPA's 'No viable backend' traceback, the run's directory made."""
    proc = train(capsys, "--out", tmp_path / "run", "--train.attention", backend, "--train.device", "cpu")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.endswith(
        f"train.attention = '{backend}' is a CUDA kernel, and this run is on the CPU: use train.attention auto, "
        "flash or math"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_a_16_bit_attention_kernel_in_fp32_on_a_gpu_is_refused(tmp_path, capsys, monkeypatch, backend):
    """FlashAttention's and cuDNN's kernels take fp16 and bf16 only: in fp32 SDPA found no kernel at the first step."""
    fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    proc = train(capsys, "--out", tmp_path / "run", "--train.attention", backend, "--train.device", "cuda")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and line.endswith(
        f"train.attention = '{backend}' takes fp16 and bf16 only, and train.precision is 'fp32': use train.precision "
        "bf16, or train.attention auto or efficient"), line


def diverge(rank, world, overrides: dict):
    """A bf16 run at train.lr 1e3, its numbers read only every 10 steps: the error this rank stops with."""
    from dist_fns import tiny_trainer
    from shardlm.trainer import TrainingError
    trainer = tiny_trainer(world, {"train.precision": "bf16", "train.lr": "1e3", "train.steps": "12",
                                   "train.log_every": "10", **overrides})
    try:
        trainer.run()
    except TrainingError as e:
        return str(e)
    return None


def test_classic_data_parallel_ranks_name_the_same_first_step_that_was_not_finite():
    """Classic DP's ranks without the optimizer read the norm of the step they logged: rank 1 said 'the gradient of
    step 10 was not finite ... after 9 updates' where rank 0 said step 4, and where a later step's gradient was
    finite again it did not stop at all, left waiting for rank 0."""
    from shardlm.testing.distributed import run_distributed
    errors = run_distributed(diverge, 2, {"parallel.dp_mode": "classic"}, timeout=120)
    assert errors[0] == errors[1] and errors[0].startswith("the gradient of step 4 was not finite (its norm: nan): "
                                                           "after 3 updates the run diverged"), errors


def test_the_norm_named_is_the_first_non_finite_steps():
    """The error named the first non-finite step with the norm of the last step run: 'the gradient of step 2 was
    not finite (its norm: 2.93)' where step 3's gradient was finite again."""
    from dist_fns import tiny_trainer
    from shardlm.trainer import TrainingError
    trainer = tiny_trainer(1, {"train.precision": "bf16", "train.steps": "3", "train.log_every": "10"})
    real, calls = trainer.forward_backward.forward, []

    def forward(x, y):  # step 2's micro-batches (two a step) only
        calls.append(1)
        return real(x, y) * (float("nan") if len(calls) in (3, 4) else 1.0)
    trainer.forward_backward.forward = forward
    with pytest.raises(TrainingError,
                       match=r"the gradient of step 2 was not finite \(its norm: nan\): after 1 updates the run"):
        trainer.run()


def test_an_fp16_overflow_at_the_minimum_loss_scale_names_the_checkpoint_to_resume_in_bf16(tmp_path):
    """It said 'use train.precision bf16' and not from where: a run whose later steps all overflow has its last
    update's weights in its last checkpoint, which a resume in bf16 continues."""
    from dist_fns import tiny_trainer
    from shardlm.trainer import TrainingError
    trainer = tiny_trainer(1, {"train.precision": "fp16", "train.steps": "60", "train.log_every": "10",
                               "train.save_every": "5"}, out_dir=tmp_path / "run")
    real, calls = trainer.forward_backward.forward, []

    def forward(x, y):  # every micro-batch from step 6 on overflows
        calls.append(1)
        return real(x, y) * (float("inf") if len(calls) > 10 else 1.0)
    trainer.forward_backward.forward = forward
    with pytest.raises(TrainingError) as e:
        trainer.run()
    assert str(e.value).startswith("fp16 gradients overflow at the minimum loss scale 1.0 (step 23)"), e.value
    assert str(e.value).endswith(f"use train.precision bf16 (the last checkpoint is "
                                 f"{tmp_path / 'run' / 'checkpoints' / 'step_00000020'})"), e.value


def test_the_console_shows_fp16s_loss_scale_beside_the_skipped_steps(tmp_path, capsys):
    """The console said 'skipped 2' and nothing of the scale, which only metrics.jsonl held: a scale backing off
    step after step looked like one settling."""
    proc = train(capsys, "--out", tmp_path / "run", "--train.precision", "fp16", "--model.init_std", 0.3,
                 "--train.steps", 3, "--train.log_every", 1)
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert " | grad-norm inf | " in steps[0] and " | skipped 1 (loss scale 65536)" in steps[0], steps
    assert steps[2].endswith(" | skipped 2 (loss scale 32768)"), steps
