"""A multi-process run that goes wrong part-way, launched as users launch it (torchrun, two CPU ranks of `shardlm
train tiny`): what it saved is used, and what went wrong is said."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _data(tmp_path: Path) -> Path:
    from shardlm.data.prepare import prepare
    if not (tmp_path / "data").exists():
        (tmp_path / "text.txt").write_text("a few words of text, over and over. " * 2000)
        prepare([str(tmp_path / "text.txt")], "byte", str(tmp_path / "data"))
    return tmp_path / "data"


def _torchrun(tmp_path: Path, out: str, body: str, launcher: list, *args: str) -> subprocess.CompletedProcess:
    """torchrun of 2 ranks of `shardlm train tiny` at dp 2 into `out`, `body` run in each worker first (the fault)."""
    script = tmp_path / "worker.py"
    script.write_text("import os, signal, sys\nfrom shardlm.cli import main\nfrom shardlm.trainer import Trainer\n"
                      f"{body}\nsys.exit(main(sys.argv[1:]))\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher,
           str(script), "train", "tiny", "--parallel.dp", "2", "--train.device", "cpu", "--train.tensorboard", "false",
           "--train.sample_tokens", "0", "--data.path", str(_data(tmp_path)), "--out", str(tmp_path / out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _losses(run: Path) -> dict:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _killing_rank_1_at(step: int, attempts: int = 1) -> str:
    """Rank 1 of the first `attempts` attempts dies in `step` as a crash ends a process (the OOM killer, a
    segfault): no save."""
    return f"""
step = Trainer.train_step
def dying(self):
    if os.environ["RANK"] == "1" and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < {attempts} and self.step + 1 == {step}:
        os.kill(os.getpid(), signal.SIGKILL)
    return step(self)
Trainer.train_step = dying
"""


@pytest.mark.timeout(200)
def test_a_group_torchrun_restarts_joins_again_and_trains(tmp_path):
    """torch's rendezvous leaves the failed attempt's keys (each rank's address) in torchrun's store, which the
    restart reuses: a restarted rank that read a peer's key before that peer had rewritten it tried the dead
    process's address and gave up ('Gloo connectFullMesh failed ... Connection refused'), or the group waited at
    the rendezvous until its timeout. It went either way about half the time, so two restarts here. Each attempt
    now joins under keys of its own."""
    done = _torchrun(tmp_path, "r", _killing_rank_1_at(2, attempts=2), ["--max-restarts", "2"], "--train.steps", "4",
                     "--parallel.timeout_s", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "connectFullMesh" not in done.stderr and "Connection refused" not in done.stderr, done.stderr[-3000:]
    assert sorted(_losses(tmp_path / "r")) == [1, 2, 3, 4]  # started over: nothing was saved to resume


@pytest.mark.timeout(300)
def test_a_group_torchrun_restarts_resumes_the_checkpoint_its_failed_attempt_saved(tmp_path):
    """torchrun --max-restarts runs the same command again: it was refused beside the checkpoints its failed attempt
    had saved ("already holds a run's checkpoints"), so every restart was spent on that refusal. It now resumes the
    newest of them, and the run ends as the uninterrupted one does."""
    common = ["--train.steps", "8", "--train.save_every", "2"]
    done = _torchrun(tmp_path, "r", _killing_rank_1_at(5), ["--max-restarts", "1"], *common)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"torchrun restart 1: resuming the newest checkpoint in {tmp_path / 'r'}, saved by the attempt that " \
           "failed" in done.stdout + done.stderr, done.stderr[-3000:]
    assert "already holds" not in done.stderr
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    reference = _torchrun(tmp_path, "reference", "", [], *common)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert _losses(tmp_path / "r") == _losses(tmp_path / "reference")


def test_a_restart_resumes_only_what_its_failed_attempt_saved(tmp_path, monkeypatch):
    """Checkpoints older than the failed attempt (another run's, which it was refused beside or was to
    --overwrite) are not the restart's to resume; one that attempt saved is. No other agent's restart takes them."""
    import os
    import time

    from shardlm import rundir
    from shardlm.runlock import acquire
    state = tmp_path / "r" / "checkpoints" / "step_00000002" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text("{}")
    os.utime(state, (time.time() - 60, time.time() - 60))  # saved before the attempt below started
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    acquire(tmp_path / "r").release()  # the attempt that failed

    def restarted(run_id="job") -> bool:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        lock, again = rundir.claim(tmp_path / "r", True, lambda value: value)
        lock.release(undo=True)  # its record back: the failed attempt's, for the next call
        return again
    assert not restarted()
    state.touch()  # now saved by that attempt
    assert restarted() and not restarted("another job")


@pytest.mark.timeout(200)
def test_the_error_that_ended_an_attempt_is_said_when_its_restart_trains(tmp_path):
    """Bad input that one rank alone met (here its node's dataset missing until the restart) was printed by no rank:
    under torchrun a node's first rank alone prints bad input, which is alike on every rank, and the others leave it
    to torchrun's summary, which a restart that then trains never prints. Its peer said only 'rank 1 stopped on an
    error (its message says why)'. That peer now prints the message."""
    missing = "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n" \
              "    sys.argv[sys.argv.index('--data.path') + 1] += '-not-here'\n"
    done = _torchrun(tmp_path, "r", missing, ["--max-restarts", "1"], "--train.steps", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (f"shardlm train: error: stopping: rank 1 stopped on an error: data.path = '{_data(tmp_path)}-not-here' "
            "does not exist") in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(200)
def test_torchruns_summary_names_why_when_one_rank_runs_out_of_memory(tmp_path):
    """Rank 1 runs out of memory mid-run: it printed why, and rank 0, out first, pointed at it, but neither left
    torchrun an error file, so torchrun's summary, the last lines on screen, named rank 0 as the root cause with only
    'To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html'. Both messages are in it now."""
    oom = "step = Trainer.train_step\ndef oom(self):\n" \
          "    if os.environ['RANK'] == '1' and self.step == 2:\n" \
          "        raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')\n" \
          "    return step(self)\nTrainer.train_step = oom\n"
    done = _torchrun(tmp_path, "r", oom, [], "--train.steps", "4")
    assert done.returncode != 0
    summary = done.stderr[done.stderr.index("Root Cause"):]
    assert "To enable traceback" not in done.stderr, done.stderr[-3000:]
    assert "traceback : shardlm train: error: out of memory (CUDA out of memory" in done.stderr, done.stderr[-3000:]
    assert "traceback : shardlm train: error: stopping: rank 1 stopped on an error" in done.stderr, done.stderr[-3000:]
    assert "traceback : shardlm train: error:" in summary, summary
