"""Runs that would lose work, produce wrong numbers silently, or end in a traceback: run directories that
would mix two runs, damaged checkpoints, failed saves, non-finite numbers, and the errors users cause.
Each ends in one clear line and a non-zero status, or in the right outcome."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import cli_proc, run_cli
from shardlm.checkpoint import CheckpointError, complete_checkpoints, load_checkpoint
from shardlm.checkpoint_write import save_checkpoint
from shardlm.config import ConfigError, load_config, validate
from shardlm.rundir import drop_damaged_after
from shardlm.trainer import Trainer, TrainingError

QUIET = ["--train.tensorboard", "false", "--train.log_every", "1"]


def train_cli(*args, check=False):
    return run_cli("train", "tiny", *QUIET, *map(str, args), check=check)


def here(capsys, *args, check=False):
    """`shardlm ...` in this process (cli_proc): what run_cli returns, without starting Python and importing
    torch again, where the test needs no process of its own; `check` as run_cli's."""
    proc = cli_proc(capsys, *args)
    if check and proc.returncode != 0:
        raise AssertionError(f"shardlm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_here(capsys, *args, check=False):
    return here(capsys, "train", "tiny", *QUIET, *args, check=check)


def steps_of(run):
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def no_traceback(proc, status=None):
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("shardlm "), proc.stderr[-2000:]
    if status is not None:
        assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    return lines[-1]


# ---- run directories ----------------------------------------------------------------------------------

def test_a_run_directory_holding_another_runs_checkpoints_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 6, "--train.save_every", 3, "--out", run, check=True)
    before = [p.name for p in complete_checkpoints(run)]
    proc = train_here(capsys, "--train.steps", 2, "--train.seed", 5, "--out", run)
    line = no_traceback(proc, 2)
    assert f"{run} already holds a run's checkpoints (up to step_00000006)" in line
    assert f"--resume {run}" in line and "--overwrite" in line
    assert [p.name for p in complete_checkpoints(run)] == before and steps_of(run) == list(range(1, 7))
    # --overwrite deletes only once the new run has passed its checks: a refused one keeps the old run.
    proc = train_here(capsys, "--train.steps", 2, "--train.freeze", "embed_tokens", "--out", run, "--overwrite")
    assert "train.freeze: 'embed_tokens' matches no parameter" in no_traceback(proc, 2)
    assert [p.name for p in complete_checkpoints(run)] == before and steps_of(run) == list(range(1, 7))
    train_here(capsys, "--train.steps", 2, "--train.seed", 5, "--out", run, "--overwrite", check=True)
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"] and steps_of(run) == [1, 2]


def test_rotation_never_deletes_a_checkpoint_for_later_steps(tmp_path):
    """A later step's checkpoint is not this run's to rotate out: saving step 5 beside steps 10 and 20
    keeps all three (rotation once deleted the new step 5 in favour of the old, higher steps)."""
    w = {"w": torch.zeros(2)}
    for step in (10, 20, 5):
        save_checkpoint(tmp_path, step, w, {}, {"config": {}, "data": {}}, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000005", "step_00000010", "step_00000020"]


def test_an_earlier_checkpoint_resumed_into_its_own_directory(tmp_path, capsys):
    """Beside later checkpoints it is refused (two futures would mix); with --overwrite the later ones go,
    and metrics.jsonl and TensorBoard keep the history up to the checkpoint, with no step twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000003"
    args = ["tiny", "--train.log_every", "1", "--train.steps", "6", "--train.save_every", "3", "--out", run]
    here(capsys, "train", *args, check=True)
    refused = here(capsys, "train", *args, "--resume", ckpt)
    assert "holds checkpoints after step_00000003 (step_00000006)" in no_traceback(refused, 2)
    here(capsys, "train", *args, "--resume", ckpt, "--overwrite", check=True)
    assert steps_of(run) == list(range(1, 7))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))


def test_overwrite_deletes_only_once_asked_and_only_what_follows_the_resumed_checkpoint(tmp_path):
    """Resuming an earlier checkpoint with --overwrite: the check lets it through and deletes nothing (a check
    after it may still refuse the run); overwrite_run, once all checks are passed, deletes the later ones only.
    Resuming another run's checkpoint, or none, it deletes the run in --out."""
    from shardlm import rundir
    w = {"w": torch.zeros(2)}
    for step in (3, 6, 9):
        save_checkpoint(tmp_path / "run", step, w, {}, {"config": {}, "data": {}}, keep=3)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    names = lambda: [p.name for p in complete_checkpoints(tmp_path / "run")]  # noqa: E731
    with pytest.raises(ConfigError, match="holds checkpoints after step_00000003"):
        rundir.check_resume_into(tmp_path / "run", ckpt, ckpt, overwrite=False, saved_batch=8, batch=8)
    assert rundir.check_resume_into(tmp_path / "run", ckpt, ckpt, overwrite=True, saved_batch=8, batch=8)
    assert names() == ["step_00000003", "step_00000006", "step_00000009"]
    said = []
    rundir.overwrite_run(tmp_path / "run", ckpt, said.append)
    assert names() == ["step_00000003"] and len(said) == 2
    import shutil
    real_rmtree = shutil.rmtree
    with pytest.MonkeyPatch.context() as mp:  # a kill midway through the deletion: nothing is left to resume
        mp.setattr(shutil, "rmtree", lambda p, **k: None if p.name == ".old-checkpoints" else real_rmtree(p, **k))
        rundir.overwrite_run(tmp_path / "run", None, said.append)
    assert names() == [] and "deleted the checkpoints (up to step_00000003)" in said[-1]
    assert not (tmp_path / "run" / "checkpoints").exists() and (tmp_path / "run" / ".old-checkpoints").is_dir()
    from shardlm.checkpoint import remove_partial
    remove_partial(tmp_path / "run")  # the next run in the directory sweeps what was left
    assert not (tmp_path / "run" / ".old-checkpoints").exists()


def test_a_changed_global_batch_is_refused_in_the_same_directory_only(tmp_path, capsys):
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 2, "--out", run, check=True)
    refused = here(capsys, "train", "--resume", run, "--train.global_batch_size", "4", "--train.micro_batch_size", "4",
                   "--train.steps", "6")
    assert "was trained with train.global_batch_size 8" in no_traceback(refused, 2)
    here(capsys, "train", "--resume", run, "--out", tmp_path / "other", "--train.global_batch_size", "4",
         "--train.micro_batch_size", "4", "--train.steps", "6", check=True)
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]


def test_a_resume_with_nothing_to_do_prints_no_header(tmp_path, capsys):
    """A resume at or past train.steps said `nothing to do`, then the header `... 2 steps ... writing r1`, of
    steps that never ran; it now says only the first, and the header of a resume counts the steps left."""
    from helpers import cli_here
    run = tmp_path / "run"
    cli_here(capsys, "train", "tiny", *QUIET, "--train.steps", "2", "--out", run)
    out = cli_here(capsys, "train", "tiny", *QUIET, "--resume", run, "--train.steps", "2", "--out", tmp_path / "r1")
    assert "nothing to do (raise train.steps above 2 to continue)" in out and "shardlm:" not in out, out
    # Below the checkpoint's step: a note of a warmup longer than the schedule came first, of steps not run.
    out = cli_here(capsys, "train", "tiny", *QUIET, "--resume", run, "--train.steps", "1", "--out", tmp_path / "r0")
    assert "is at step 2, train.steps is 1: nothing to do" in out and "warmup" not in out, out
    out = cli_here(capsys, "train", "tiny", *QUIET, "--resume", run, "--train.steps", "3", "--out", tmp_path / "r2")
    assert "1 more step (to 3) of 8 x 32 tokens" in out and "step      3 |" in out, out


def test_a_resume_with_nothing_to_do_says_so_on_the_main_rank_only(tmp_path, capsys):
    """Under torchrun every rank printed `nothing to do`, the copies run together on one line."""
    import dist_fns
    from shardlm.testing.distributed import run_distributed
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 2, "--out", run, check=True)
    said = run_distributed(dist_fns.lines_of_a_resume, 2, {"train.steps": "2"}, str(run), timeout=120)
    assert [sum("nothing to do" in line for line in lines) for lines in said] == [1, 0], said


# ---- checkpoint integrity -----------------------------------------------------------------------------

def damage(path, how):
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bit-flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "empty", "bit-flipped", "missing"])
@pytest.mark.parametrize("fmt, name", [("sharded", "rank00000-0000.safetensors"), ("sharded", "manifest.json"),
                                       ("sharded", "rng.pt"), ("full", "model.safetensors"),
                                       ("full", "optimizer.safetensors")])
def test_a_damaged_checkpoint_file_is_named_and_the_run_resumes_from_the_previous_one(tmp_path, how, fmt, name):
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "4", "train.save_every": "2", "train.tensorboard": "false",
                               "train.checkpoint_format": fmt})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    newest = run / "checkpoints" / "step_00000004"
    damage(newest / name, how)
    with pytest.raises(CheckpointError, match=str(newest / name)):
        load_checkpoint(newest)
    said = []
    cfg.train.steps = 5
    resumed = Trainer(cfg, out_dir=run, resume=run, log=said.append)
    assert resumed.step == 2 and resumed.resumed_from.name == "step_00000002"
    assert any("skipping damaged checkpoints" in s and name in s for s in said), said


def test_a_damaged_checkpoint_named_explicitly_points_at_its_run_directory(tmp_path, capsys):
    """--resume RUN/checkpoints/step_N of a damaged checkpoint named the bad file only: that --resume RUN falls
    back on the newest checkpoint that verifies went unsaid."""
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "4", "train.save_every": "2", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    newest = run / "checkpoints" / "step_00000004"
    damage(newest / "rank00000-0000.safetensors", "truncated")
    proc = train_here(capsys, "--train.steps", 5, "--out", run, "--resume", newest)
    line = no_traceback(proc, 1)
    assert f"{newest}/rank00000-0000.safetensors has " in line, line
    assert f"--resume {run} instead takes the newest of its checkpoints that verifies" in line, line
    with pytest.raises(CheckpointError, match=f"the run directory {run} instead"):  # export's, generate's: no --resume
        load_checkpoint(newest)
    shutil.rmtree(run / "checkpoints" / "step_00000002")  # nothing to fall back on: no hint
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(newest)
    assert "instead" not in str(e.value)


def test_a_damaged_checkpoint_skipped_on_resume_does_not_take_a_good_ones_place_in_rotation(tmp_path, capsys):
    """Resuming past a damaged newest checkpoint kept it: it counted towards train.keep_checkpoints, so the
    next save deleted the good checkpoint the run had resumed from and left the damaged one, one good
    checkpoint where two were asked for (and none to fall back on)."""
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 6, "--train.save_every", 2, "--out", run, check=True)
    damage(run / "checkpoints" / "step_00000006" / "rank00000-0000.safetensors", "truncated")
    proc = train_here(capsys, "--train.steps", 7, "--out", run, "--resume", run, check=True)
    assert f"moved the damaged step_00000006 aside to {run}/checkpoints/damaged-step_00000006" in proc.stdout
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000004", "step_00000007"]
    assert (run / "checkpoints" / "damaged-step_00000006" / "state.json").is_file()  # for the user to look at
    for p in complete_checkpoints(run):
        load_checkpoint(p)
    # the same step saved again and found damaged again: the earlier copy set aside stays beside the new one
    shutil.rmtree(run / "checkpoints" / "step_00000007")
    (run / "checkpoints" / "step_00000006").mkdir()
    (run / "checkpoints" / "step_00000006" / "state.json").write_text("{")
    drop_damaged_after(run, run / "checkpoints" / "step_00000004", log=lambda *a: None)
    assert {p.name for p in (run / "checkpoints").glob("damaged-*")} == {"damaged-step_00000006",
                                                                         "damaged-step_00000006.1"}


def test_export_generate_and_eval_of_a_run_whose_newest_checkpoint_is_damaged_say_which_they_use(tmp_path, capsys):
    """They take the newest checkpoint that verifies, as a resume does: that was an older step without a word."""
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "4", "train.save_every": "2", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    damage(run / "checkpoints" / "step_00000004" / "rank00000-0000.safetensors", "truncated")
    (tmp_path / "text.txt").write_text("some text to score " * 20)
    for argv in (["export", "--checkpoint", run, "--out", tmp_path / "hf"],
                 ["generate", "--model", run, "--prompt", "a", "--max-new-tokens", "1"],
                 ["eval", "--model", run, "--data", tmp_path / "text.txt", "--seq-len", "16"]):
        proc = cli_proc(capsys, *argv)
        assert proc.returncode == 0, proc.stderr
        assert (f"note: skipping damaged checkpoints ({run}/checkpoints/step_00000004/rank00000-0000.safetensors "
                f"has ") in proc.stderr and f"using {run}/checkpoints/step_00000002, the newest" in proc.stderr


def test_a_damaged_checkpoint_skipped_under_tensor_parallelism_is_noted_by_rank_0_only(tmp_path):
    """generate, eval and serve --tp N printed the note once per rank."""
    import dist_fns
    from shardlm.testing.distributed import run_distributed
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "2", "train.save_every": "1", "train.tensorboard": "false"})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    damage(run / "checkpoints" / "step_00000002" / "rank00000-0000.safetensors", "truncated")
    said = run_distributed(dist_fns.notes_of_a_tp_load, 2, str(run), timeout=120)
    assert ["skipping damaged checkpoints" in s for s in said] == [True, False], said


def test_a_resume_whose_state_json_is_cut_short_names_the_file_and_why(tmp_path, capsys):
    """Once 'no state.json under RUN is readable JSON with a config', naming neither the file nor the fault."""
    run = tmp_path / "run"
    Trainer(load_config("tiny", {"train.steps": "1", "train.tensorboard": "false"}), out_dir=run,
            log=lambda *a: None).run()
    state = run / "checkpoints" / "step_00000001" / "state.json"
    state.write_text(state.read_text()[:100])
    proc = cli_proc(capsys, "train", "--resume", run, "--out", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"shardlm train: error: no checkpoint of {run} has a readable state.json: {state} is "
                               "not readable JSON ("), lines


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_state_json_whose_model_does_not_match_its_tensors_is_refused(tmp_path, fmt):
    """state.json's model.hidden_size edited from 64 to 128: the resume trained on, each parameter's first
    64-wide part loaded and the rest left at zero. It is refused naming a tensor and both shapes."""
    from shardlm.checkpoint import read_state
    from shardlm.config import config_from_dict
    run = tmp_path / "run"
    cfg = load_config("tiny", {"train.steps": "1", "train.tensorboard": "false", "train.checkpoint_format": fmt})
    Trainer(cfg, out_dir=run, log=lambda *a: None).run()
    state_json = run / "checkpoints" / "step_00000001" / "state.json"
    state = json.loads(state_json.read_text())
    state["config"]["model"]["hidden_size"] = 128
    state_json.write_text(json.dumps(state))
    cfg = config_from_dict(read_state(run)["config"])
    cfg.train.steps = 2
    with pytest.raises(ConfigError, match=r"embed.weight is saved as \[512, 64\], but the model config in its "
                                          r"state.json makes it \[512, 128\]"):
        Trainer(cfg, out_dir=tmp_path / "resumed", resume=run, log=lambda *a: None)


def test_an_invalid_state_json_is_named(tmp_path):
    w = {"w": torch.zeros(2)}
    path = save_checkpoint(tmp_path, 1, w, {}, {"config": {}, "data": {}})
    (path / "state.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="state.json is not readable JSON"):
        load_checkpoint(path)


def test_unfinished_saves_are_removed_on_the_next_start(tmp_path, capsys):
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 2, "--out", run, check=True)
    partial = run / "checkpoints" / ".tmp-step_00000003-12345"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    proc = here(capsys, "train", "--resume", run, "--train.steps", "3", check=True)
    assert not partial.exists() and "removed 1 unfinished checkpoint save" in proc.stdout


def test_a_save_cut_short_is_named_with_the_checkpoint_the_resume_continues_from(tmp_path, capsys):
    """A run killed while writing step 4 (its temporary directory left): the next start says which step's save
    was lost and which complete checkpoint the run stands at."""
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 2, "--out", run, check=True)
    (run / "checkpoints" / ".tmp-step_00000004-12345").mkdir()
    proc = here(capsys, "train", "--resume", run, "--train.steps", "3", check=True)
    assert "(step 4, cut short by a crash or kill); the newest complete checkpoint is step_00000002" in proc.stdout


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_failed_save_says_so_in_one_line_keeps_the_previous_checkpoint_and_fails(tmp_path, monkeypatch, capsys, fmt):
    """A full disk (ENOSPC) while step 4 is written, in either checkpoint format: the run ends with status 1
    and one line; step 2's checkpoint is there and verifies; no partial directory is left."""
    import shardlm.checkpoint_write as ckpt
    from shardlm.cli import main

    def full_disk(file, mode="r", *args, **kwargs):  # the files a save writes, opened in checkpoint_write.py
        if "step_00000004" in str(file) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return open(file, mode, *args, **kwargs)
    monkeypatch.setattr(ckpt, "open", full_disk, raising=False)
    run = tmp_path / "run"
    status = main(["train", "tiny", *QUIET, "--train.steps", "4", "--train.save_every", "2", "--out", str(run),
                   "--train.checkpoint_format", fmt])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and "saving step 4" in err[-1] and "No space left on device" in err[-1]
    assert "step_00000002 is kept" in err[-1]
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]
    load_checkpoint(run)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


# ---- non-finite numbers -------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("train.lr", "nan"), ("train.weight_decay", "inf"), ("train.eps", "nan"),
                                        ("train.grad_clip", "inf"), ("model.init_std", "nan"),
                                        ("train.min_lr_ratio", "nan"), ("parallel.timeout_s", "inf")])
def test_non_finite_config_values_are_refused(key, value):
    with pytest.raises(ConfigError, match=f"{key} = {value} must be a finite number"):
        validate(load_config("tiny", {key: value}))


@pytest.mark.parametrize("key, value", [("train.beta1", "1"), ("train.beta2", "-0.1"), ("train.momentum", "1.5")])
def test_betas_and_momentum_are_in_the_unit_interval(key, value):
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\)"):
        validate(load_config("tiny", {key: value}))


def test_non_finite_gradients_before_any_update_blame_the_initialisation_not_the_learning_rate(tmp_path, capsys):
    proc = train_here(capsys, "--model.init_std", "1e30", "--out", tmp_path / "run")
    line = no_traceback(proc, 1)
    assert "the gradient of step 1 was not finite" in line and "before any update" in line
    assert "model.init_std" in line and "lower train.lr" not in line


def test_non_finite_gradients_after_updates_say_the_run_diverged(tmp_path, capsys):
    proc = train_here(capsys, "--train.lr", "1e30", "--train.steps", "5", "--out", tmp_path / "run")
    line = no_traceback(proc, 1)
    assert "the gradient of step 2 was not finite" in line and "after 1 updates the run diverged" in line
    assert "lower train.lr" in line


def test_a_nan_loss_in_fp16_is_divergence_not_an_overflow():
    cfg = load_config("tiny", {"train.precision": "fp16", "train.tensorboard": "false"})
    trainer = Trainer(cfg, log=lambda *a: None)
    real = trainer.forward_backward.forward
    trainer.forward_backward.forward = lambda x, y: real(x, y) * float("nan")
    before = trainer.engine.owned_shards("master")
    with pytest.raises(TrainingError, match="the loss is nan in fp16 before any update"):  # step 1: not the lr
        trainer.train_step()
    assert trainer.scaler.skipped_steps == 0  # not counted as an overflow
    after = trainer.engine.owned_shards("master")
    assert all(torch.equal(before[n][2], after[n][2]) for n in before)


def test_weights_beyond_fp16s_range_are_never_saved(tmp_path, capsys):
    """fp16 SGD with an absurd learning rate: the gradients are finite, the updated fp32 masters too, but
    beyond fp16's range (their 16-bit copies are inf). The run ends with an error naming them and no
    checkpoint of them (status 1 through the command)."""
    run = tmp_path / "run"
    proc = train_here(capsys, "--train.precision", "fp16", "--train.optimizer", "sgd", "--train.lr", "1e9",
                      "--train.warmup_steps", "0", "--train.grad_clip", "0", "--train.steps", "1", "--out", run)
    line = no_traceback(proc, 1)
    assert "step 1: the weights of" in line and "are not finite in fp16; not saved (no checkpoint was saved)" in line
    assert complete_checkpoints(run) == []


def test_metrics_stay_strict_json(tmp_path):
    """An fp16 step whose loss overflows is skipped and logged: as null, not as a bare Infinity."""
    cfg = load_config("tiny", {"train.precision": "fp16", "train.steps": "1", "train.tensorboard": "false"})
    trainer = Trainer(cfg, out_dir=tmp_path / "run", log=lambda *a: None)
    real = trainer.forward_backward.forward
    trainer.forward_backward.forward = lambda x, y: real(x, y) * float("inf")
    trainer.run()

    def refuse(token):
        raise ValueError(f"bare {token} in metrics.jsonl")
    records = [json.loads(x, parse_constant=refuse) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] is None and records[0]["skipped_steps"] == 1


# ---- the errors users cause ---------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_train_device_cuda_without_a_gpu(tmp_path, capsys):
    line = no_traceback(train_here(capsys, "--train.device", "cuda", "--out", tmp_path / "run"), 2)
    assert "train.device = 'cuda', but no CUDA device is visible" in line


def test_an_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    line = no_traceback(train_here(capsys, "--out", tmp_path / "file"), 2)
    assert "--out " in line and "is a file" in line


def test_a_cache_directory_that_cannot_be_written_is_named_with_the_fix(tmp_path, capsys, monkeypatch):
    """The default corpus is tokenized into $XDG_CACHE_HOME/shardlm: where that cannot be written (here: a file
    in its way) the error named a scratch path and no fix."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    proc = here(capsys, "train", "tiny", "--out", tmp_path / "run")
    line = no_traceback(proc, 2)
    assert f"cannot be cached in {tmp_path / 'file' / 'shardlm'}: Not a directory" in line
    assert "set XDG_CACHE_HOME to a writable directory" in line and "--data.path" in line
    assert not (tmp_path / "run").exists()


def test_missing_rope_scaling_keys(tmp_path, capsys):
    proc = train_here(capsys, "--model.rope_scaling", '{"rope_type": "llama3", "factor": 8.0}', "--out", tmp_path / "run")
    assert "lacks low_freq_factor, high_freq_factor, original_max_position_embeddings" in no_traceback(proc, 2)


def test_a_model_larger_than_free_memory_is_refused_before_allocating(tmp_path):
    proc = train_cli("--model.hidden_size", "200000", "--out", tmp_path / "run")
    line = no_traceback(proc, 2)
    assert "needs at least" in line and "GiB free" in line


def test_offload_beyond_the_hosts_memory_is_refused_before_allocating(tmp_path):
    """A model whose weights fit (a third of the available memory) but whose offloaded optimizer (nine times
    that) does not: refused with both figures, nothing allocated."""
    with open("/proc/meminfo") as f:
        avail = int(dict(line.split(":", 1) for line in f)["MemAvailable"].split()[0]) * 1024
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 4096  # a hidden 1024, ffn 4096 llama block's weights
    layers = max(1, int(avail / 3 / 2 / per_layer))
    proc = train_cli("--model.hidden_size", 1024, "--model.num_heads", 8, "--model.num_kv_heads", 8,
                     "--model.ffn_hidden_size", 4096, "--model.num_layers", layers, "--parallel.zero_stage", 2,
                     "--parallel.offload", "optimizer", "--train.device", "cpu", "--out", tmp_path / "run")
    line = no_traceback(proc, 2)
    assert "keeps" in line and "GiB per rank in host memory" in line and "GiB available" in line
    assert line.endswith("or keep the optimizer state on a local disk (parallel.offload_dir)")


def test_an_unusable_offload_dir_is_named(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    proc = train_here(capsys, "--parallel.zero_stage", 2, "--parallel.offload", "optimizer", "--parallel.offload_dir",
                      tmp_path / "file" / "x", "--out", tmp_path / "run")
    assert "parallel.offload_dir" in no_traceback(proc, 2)


def test_an_offload_dir_that_is_a_file_says_so(tmp_path, capsys):
    (tmp_path / "nvme").write_text("")
    proc = train_here(capsys, "--parallel.zero_stage", 1, "--parallel.offload", "optimizer", "--parallel.offload_dir",
                      tmp_path / "nvme", "--out", tmp_path / "run")
    assert "a file, not a directory" in no_traceback(proc, 2)


def test_an_offload_dir_under_home_from_a_config_file_is_there(tmp_path, capsys, monkeypatch):
    """A TOML file's "~/nvme" has no shell to expand it: the state went to a directory named "~" in the
    working directory (another disk than the one named) without a word."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    train_here(capsys, "--train.steps", 1, "--parallel.zero_stage", 1, "--parallel.offload", "optimizer",
               "--parallel.offload_dir", "~/nvme", "--out", tmp_path / "run", check=True)
    assert (tmp_path / "home" / "nvme").is_dir() and not (tmp_path / "~").exists()


def test_a_data_parallel_checkpoint_resumed_in_one_process_says_how(tmp_path, capsys):
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 2, "--out", run, check=True)
    cfg = json.loads((run / "checkpoints" / "step_00000002" / "state.json").read_text())
    cfg["config"]["parallel"]["dp"] = 2  # as a dp 2 run saved it
    (run / "checkpoints" / "step_00000002" / "state.json").write_text(json.dumps(cfg))
    line = no_traceback(here(capsys, "train", "--resume", run, "--train.steps", "4"), 2)
    assert "torchrun --nproc-per-node 2" in line and "--parallel.dp 1" in line


def test_vocab_size_comes_from_the_data(tmp_path, capsys):
    from helpers import make_tokenizer
    make_tokenizer(tmp_path / "tok", vocab_size=300)
    (tmp_path / "text.txt").write_text("to be or not to be " * 400)
    here(capsys, "data", "prepare", "--input", tmp_path / "text.txt", "--tokenizer", tmp_path / "tok", "--out", tmp_path / "d",
         check=True)
    cfg = load_config("tiny", {"model.vocab_size": "0", "data.path": str(tmp_path / "d"), "train.steps": "1",
                               "train.tensorboard": "false", "data.eval_windows": "2"})
    trainer = Trainer(cfg, log=lambda *a: None)
    assert trainer.cfg.model.vocab_size == 300 and trainer.model.embed.weight.shape[0] == 300


def test_version_and_the_first_log_line_at_step_one(tmp_path, capsys):
    from shardlm import __version__
    assert here(capsys, "--version", check=True).stdout.strip() == f"shardlm {__version__}"
    out = here(capsys, "train", "tiny", "--train.steps", "3", "--train.log_every", "50", "--train.tensorboard", "false",
                  "--out", tmp_path / "run", check=True).stdout
    assert "step      1 | loss" in out  # the initial loss, long before log_every


def test_a_console_without_the_progress_bar_shows_the_time_left(tmp_path, capsys):
    """Output to a file or pipe (a scheduler's log) has no tqdm bar: the step lines carry the ETA instead, from
    the second logged step (the first's time includes the start-up) to the one before the last."""
    import re

    from helpers import cli_here
    out = cli_here(capsys, "train", "tiny", *QUIET, "--train.steps", "4", "--out", tmp_path / "run")
    lines = [x for x in out.splitlines() if x.startswith("step  ")]
    assert [bool(re.search(r" \| eta (\d+h\d\dm|\d+m\d\ds|\d+s)$", x)) for x in lines] == [False, True, True, False]


def _console_gone_at_step_2(run, stderr):
    """`shardlm train` of tiny into `run` whose stdout's reader leaves once step 2 is printed (`stderr`: a pipe of
    its own, or stdout's: `2>&1 | head`)."""
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", "train", "tiny", *QUIET, "--train.steps", "100000",
                             "--out", str(run)], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("step      2 |"):
            break
    proc.stdout.close()
    return proc


def test_a_console_that_goes_away_stops_the_run_saved(tmp_path):
    """`shardlm train | head`: stdout's reader leaves. The run ended in a BrokenPipeError's traceback, the steps
    since its last checkpoint lost; it now stops after the next step as a signal does, saved, with SIGPIPE's
    status and the way to continue on stderr."""
    run = tmp_path / "run"
    proc = _console_gone_at_step_2(run, subprocess.PIPE)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGPIPE and "Traceback" not in err, (proc.returncode, err[-2000:])
    step = steps_of(run)[-1]
    assert [p.name for p in complete_checkpoints(run)] == [f"step_{step:08d}"]
    assert f"stopped by SIGPIPE after step {step} of 100000; to continue: shardlm train --resume {run}" in err


@pytest.mark.timeout(120)
def test_a_console_that_goes_away_with_stderr_stops_the_run_saved(tmp_path):
    """`shardlm train 2>&1 | head`: stderr is the same closed pipe, so the lines meant for it once stdout's reader
    left raised BrokenPipeError too, and the run ended (status 141) with nothing saved since its last checkpoint."""
    run = tmp_path / "run"
    proc = _console_gone_at_step_2(run, subprocess.STDOUT)
    proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE
    step = steps_of(run)[-1]
    assert step >= 2 and [p.name for p in complete_checkpoints(run)] == [f"step_{step:08d}"]


@pytest.mark.timeout(120)
def test_a_terminal_that_hangs_up_stops_the_run_saved(tmp_path):
    """An ssh session that drops hangs up the run's terminal: SIGHUP killed the run, every step since its last save
    lost (all of them at the default train.save_every 0). It now stops after the step as SIGTERM does, saved; the
    writes to the hung-up terminal (EIO) go nowhere, as a closed pipe's do."""
    pty = pytest.importorskip("pty")
    import select
    run = tmp_path / "run"
    pid, fd = pty.fork()
    if pid == 0:  # a session of its own, with the pty as its controlling terminal
        os.execvp(sys.executable, [sys.executable, "-m", "shardlm", "train", "tiny", *QUIET, "--train.steps", "100000",
                                   "--out", str(run)])
    seen, start = b"", time.time()
    while b"step      2 |" not in seen and time.time() - start < 90:
        if select.select([fd], [], [], 1)[0]:
            seen += os.read(fd, 4096)
    os.close(fd)  # the terminal goes away: the kernel sends its session SIGHUP
    status = os.waitpid(pid, 0)[1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGHUP, (status, seen[-2000:])
    step = steps_of(run)[-1]
    assert step >= 2 and [p.name for p in complete_checkpoints(run)] == [f"step_{step:08d}"]


def test_a_run_under_nohup_outlives_its_terminal():
    """SIGHUP stops a run saved, except where it was ignored when the run started (nohup): there the run trains on."""
    from shardlm.runtime.preemption import StopSignals
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)  # Python runs handlers between bytecodes
            assert stop.agreed() == 0
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            assert stop.agreed() == signal.SIGHUP
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_signal_during_the_last_step_ends_a_complete_run(tmp_path, monkeypatch, capsys):
    """SIGTERM while the last step runs: the run said `stopped by SIGTERM after step 3 of 3; to continue: ...`
    and exited 143, though every step was done. It is complete: saved, status 0, no advice to continue, and
    the sample it leaves out is said to be skipped."""
    from shardlm.cli import main
    step = Trainer.train_step

    def signalled(self):
        if self.step == self.cfg.train.steps - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self)
    monkeypatch.setattr(Trainer, "train_step", signalled)
    run = tmp_path / "run"
    status = main(["train", "tiny", *QUIET, "--train.steps", "3", "--train.sample_tokens", "8", "--out", str(run)])
    out = capsys.readouterr().out
    assert status == 0 and "to continue" not in out and "sample:" not in out, out
    assert "SIGTERM received during the last step: the run is complete (3 of 3 steps); the end-of-run sample " \
           "was skipped" in out
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000003"]


def test_a_save_that_fails_on_rank_zero_stops_every_rank(tmp_path):
    """Rank 0 alone writes checkpoints: when its save fails, rank 1 must not go on into the next collective
    and wait there; both stop, rank 1 saying rank 0 could not save."""
    import dist_fns
    from shardlm.testing.distributed import run_distributed
    (kind0, msg0), (kind1, msg1) = run_distributed(dist_fns.save_fails_on_rank_zero, 2, str(tmp_path / "run"),
                                                   timeout=120)
    assert kind0 == "CheckpointError" and "No space left on device" in msg0
    assert kind1 == "TrainingError" and "rank 0 could not save step 2" in msg1



def test_a_non_finite_gradient_under_optimizer_offload_leaves_every_weight_as_it_was():
    """bf16 with the update on the host: a nan loss stops the run with its message, and neither the fp32
    masters nor the 16-bit weights the model computes with were touched by the skipped update."""
    cfg = load_config("tiny", {"train.precision": "bf16", "train.tensorboard": "false", "parallel.zero_stage": "2",
                               "parallel.offload": "optimizer", "train.steps": "1", "train.log_every": "1"})
    trainer = Trainer(cfg, log=lambda *a: None)
    real = trainer.forward_backward.forward
    trainer.forward_backward.forward = lambda x, y: real(x, y) * float("nan")
    masters = trainer.engine.owned_shards("master")
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(TrainingError, match="not finite"):
        trainer.run()
    after = trainer.engine.owned_shards("master")
    assert all(torch.equal(masters[n][2], after[n][2]) for n in masters)
    assert all(torch.equal(weights[n], p) for n, p in trainer.model.named_parameters())


def test_a_large_checkpoints_verification_before_a_resume_is_said(tmp_path, capsys, monkeypatch):
    """The main rank reads every file of the checkpoint it resumes (CRC32s) while the others wait: minutes on a
    large run, which passed without a word. Past SAID_BYTES (runtime/said.py) it says how many it reads."""
    import shardlm.runtime.said as said_module
    run = tmp_path / "run"
    train_here(capsys, "--train.steps", 2, "--out", run, check=True)
    monkeypatch.setattr(said_module, "SAID_BYTES", 0)
    resumed = here(capsys, "train", "--resume", run, "--train.steps", 3, check=True)
    assert "verifying the checkpoint's" in resumed.stdout + resumed.stderr, resumed.stdout + resumed.stderr
