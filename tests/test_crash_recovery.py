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


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _worker_script(tmp_path: Path, out: str, body: str) -> Path:
    """A worker that runs `body` (the fault), then `shardlm train` with its arguments."""
    script = tmp_path / f"worker-{out}.py"
    script.write_text("import os, signal, sys\nfrom shardlm.cli import main\nfrom shardlm.trainer import Trainer\n"
                      f"{body}\nsys.exit(main(sys.argv[1:]))\n")
    return script


def _torchrun_command(tmp_path: Path, out: str, script: Path, launcher: list, *args: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *launcher,
            str(script), "train", "tiny", "--parallel.dp", "2", "--train.device", "cpu", "--train.tensorboard", "false",
            "--train.sample_tokens", "0", "--data.path", str(_data(tmp_path)), "--out", str(tmp_path / out), *args]


def _torchrun(tmp_path: Path, out: str, body: str, launcher: list, *args: str) -> subprocess.CompletedProcess:
    """torchrun of 2 ranks of `shardlm train tiny` at dp 2 into `out`, `body` run in each worker first (the fault)."""
    command = _torchrun_command(tmp_path, out, _worker_script(tmp_path, out, body), launcher, *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=150, env=ENV)


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


@pytest.mark.timeout(300)
def test_a_group_torchrun_restarts_joins_again_and_resumes_the_checkpoint_its_failed_attempt_saved(tmp_path):
    """torchrun --max-restarts runs the same command again, twice here (rank 1 killed in step 5 by the first two
    attempts), and the run ends as the uninterrupted one does:
    - torch's rendezvous leaves the failed attempt's keys (each rank's address) in torchrun's store, which the
      restart reuses: a restarted rank that read a peer's key before that peer had rewritten it tried the dead
      process's address and gave up ('Gloo connectFullMesh failed ... Connection refused'), or the group waited at
      the rendezvous until its timeout, about half the time. Each attempt now joins under keys of its own.
    - a restart was refused beside the checkpoints its failed attempt had saved ("already holds a run's
      checkpoints"), so every restart was spent on that refusal. It now resumes the newest of them."""
    common = ["--train.steps", "8", "--train.save_every", "2"]
    script = _worker_script(tmp_path, "reference", "")
    reference = subprocess.Popen(_torchrun_command(tmp_path, "reference", script, [], *common), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=ENV)  # beside the run that fails
    done = _torchrun(tmp_path, "r", _killing_rank_1_at(5, attempts=2), ["--max-restarts", "2"], *common,
                     "--parallel.timeout_s", "30")
    reference_err = reference.communicate(timeout=150)[1]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "connectFullMesh" not in done.stderr and "Connection refused" not in done.stderr, done.stderr[-3000:]
    for attempt in (1, 2):
        assert f"torchrun restart {attempt}: resuming the newest checkpoint in {tmp_path / 'r'}, saved by an " \
               "attempt that failed" in done.stdout + done.stderr, done.stderr[-3000:]
    assert "already holds" not in done.stderr
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    assert reference.returncode == 0, reference_err[-3000:]
    assert _losses(tmp_path / "r") == _losses(tmp_path / "reference")


def test_a_restart_resumes_only_what_its_job_saved(tmp_path, monkeypatch):
    """Checkpoints older than the job's first attempt (another run's, which it was refused beside or was to
    --overwrite) are not a restart's to resume; one that an attempt of the job saved is. No other agent's restart
    takes them."""
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
    os.utime(state, (time.time() + 1, time.time() + 1))  # now saved by that attempt (past a coarse clock's tick)
    assert restarted() and not restarted("another job")
    # A first restart that died before saving anything: the second resumes what the first attempt saved (it was
    # refused beside it, "already holds a run's checkpoints", and so was every restart after it).
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    lock, again = rundir.claim(tmp_path / "r", True, lambda value: value)
    assert again
    lock.release()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    lock, again = rundir.claim(tmp_path / "r", True, lambda value: value)
    assert again
    lock.release()
    # A job's first attempt counts from its own start, even where the record before it names the same launcher
    # (torchrun as pid 1 in a container, the default run id): another job's checkpoints are not its to resume.
    from shardlm.runlock import owner
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    acquire(tmp_path / "r").release()
    assert owner(tmp_path / "r")["job_started"] == owner(tmp_path / "r")["started"]


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


# Each call of a save's writes (a tensor, a commit) takes 6 s on the rank named, saying it moves every second.
_SLOWED = """
import time
import shardlm.run_checkpoint as rc
def slowed(f, rank, moving=True):
    def run(*args, **kwargs):
        if os.environ["RANK"] == rank:
            for _ in range(6 if moving else 600):
                time.sleep(1)
                if moving:
                    kwargs["moved"]()
        return f(*args, **kwargs)
    return run
"""


@pytest.mark.timeout(300)
def test_a_save_longer_than_the_group_timeout_completes_while_it_moves(tmp_path):
    """Rank 1 writes its shards while rank 0, done with its own, waits; then rank 0 commits (the state, the old
    checkpoints deleted; a full checkpoint it writes whole, through the same wait) while rank 1 waits: a large
    model on a slow disk outlasted parallel.timeout_s, and the waiting rank's collective ended the run at its
    first save, every time. Here each takes 6 s against a group timeout of 4 s."""
    slow = _SLOWED + 'rc.write_tensors = slowed(rc.write_tensors, "1")\n' \
                     'rc.commit_checkpoint = slowed(rc.commit_checkpoint, "0")\n'
    done = _torchrun(tmp_path, "r", slow, [], "--train.steps", "1", "--parallel.timeout_s", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_00000001"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rank, what", [("1", "writing step 1 on rank 1"), ("0", "rank 0's writes of step 1")])
def test_a_save_that_stops_moving_ends_every_rank_naming_it(tmp_path, rank, what):
    """A write that never returns (a network filesystem that hangs): the ranks waiting for it were kept alive
    by each other's answers, forever. After parallel.timeout_s without progress every rank stops, naming it."""
    function = "write_tensors" if rank == "1" else "commit_checkpoint"
    hung = _SLOWED + f'rc.{function} = slowed(rc.{function}, "{rank}", moving=False)\n'
    done = _torchrun(tmp_path, "r", hung, [], "--train.steps", "1", "--parallel.timeout_s", "4")
    assert done.returncode != 0
    assert f"{what} made no progress for 4 s (parallel.timeout_s)" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "r" / "checkpoints" / "step_00000001").exists()
