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
