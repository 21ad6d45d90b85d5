"""A run directory is owned by one process group at a time: a second `shardlm train` into it, or a `--resume` of
the run while it goes on, is refused at once naming the owner's pid and host, on every rank; the kernel lets go
of the lock when the owner dies, SIGKILL included."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import run_cli
from shardlm.checkpoint import complete_checkpoints
from shardlm.config import ConfigError
from shardlm.runlock import LOCK_FILE, acquire, owner

QUIET = ["--train.tensorboard", "false", "--train.sample_tokens", "0"]


def _wait_for(what, timeout=60):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_second_run_and_a_resume_of_a_running_run_are_refused_and_a_killed_run_frees_its_directory(tmp_path):
    from helpers import TEXT
    from shardlm.data.prepare import prepare
    (tmp_path / "text.txt").write_text(TEXT * 4)
    prepare([tmp_path / "text.txt"], "byte", tmp_path / "data", progress=False)
    run, data = tmp_path / "run", ["--data.path", str(tmp_path / "data")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the first run leaves a core to the others
    first = subprocess.Popen([sys.executable, "-m", "shardlm", "train", "tiny", *QUIET, *data, "--train.steps", "1000000",
                              "--train.save_every", "2", "--train.log_every", "1000", "--out", str(run)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        _wait_for(lambda: first.poll() is not None or complete_checkpoints(run))
        assert first.poll() is None, first.stderr.read().decode()[-2000:]
        assert owner(run)["pid"] == first.pid
        refused = [subprocess.Popen([sys.executable, "-m", "shardlm", *map(str, argv)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)  # at once: each mostly starts Python
                   for argv in (["train", "tiny", *QUIET, *data, "--train.steps", "2", "--out", run],  # a second run
                                ["train", "tiny", *QUIET, *data, "--out", run, "--overwrite"],  # deleting its work
                                ["train", "--resume", run, "--train.steps", "3"])]  # a resume of the running run
        for proc in refused:
            _, stderr = proc.communicate(timeout=240)
            lines = stderr.strip().splitlines()
            assert proc.returncode == 2 and "Traceback" not in stderr, stderr[-2000:]
            assert lines[-1].startswith(f"shardlm train: error: {run} is in use by pid {first.pid} on host "
                                        f"{socket.gethostname()}"), lines
            assert "wait for that run to end" in lines[-1]
        assert owner(run)["pid"] == first.pid and complete_checkpoints(run)  # the refused runs touched nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The kernel released the lock with the process: the run resumes (from its newest checkpoint).
    newest = complete_checkpoints(run)[-1]
    step = int(newest.name.removeprefix("step_"))
    proc = run_cli("train", "--resume", run, "--train.steps", step + 1, "--train.log_every", "1", check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert complete_checkpoints(run)[-1].name == f"step_{step + 1:08d}"


def test_the_lock_is_shared_within_a_process_and_released_by_its_last_holder(tmp_path):
    held = acquire(tmp_path / "run")
    again = acquire(tmp_path / "run")  # a second Trainer of this process (tests, notebooks)
    probe = [sys.executable, "-c", "import sys; from shardlm.runlock import acquire\n"
             "try:\n    acquire(sys.argv[1])\nexcept Exception as e:\n    print(e); sys.exit(3)", str(tmp_path / "run")]
    refused = subprocess.run(probe, capture_output=True, text=True)
    assert refused.returncode == 3 and f"in use by pid {os.getpid()}" in refused.stdout
    held.release()
    assert subprocess.run(probe, capture_output=True, text=True).returncode == 3
    again.release()
    again.release()  # idempotent
    assert subprocess.run(probe, capture_output=True, text=True).returncode == 0
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] != os.getpid()


def test_every_rank_refuses_a_directory_another_process_owns(tmp_path):
    """Under torchrun the main rank takes the lock; the others get its answer, so all stop with one message
    (none waits in a collective for a rank that left)."""
    import dist_fns
    from shardlm.testing.distributed import run_distributed
    held = acquire(tmp_path / "run")
    try:
        results = run_distributed(dist_fns.train_into, 2, str(tmp_path / "run"), timeout=120)
    finally:
        held.release()
    assert [kind for kind, _ in results] == ["ConfigError", "ConfigError"], results
    assert results[0][1] == results[1][1] and f"is in use by pid {os.getpid()}" in results[0][1]


def test_a_lock_file_left_by_a_dead_run_is_no_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": 0, "command": "x"}))
    acquire(run).release()
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        from shardlm.rundir import claim
        (tmp_path / "file").write_text("")
        claim(tmp_path / "file", True, lambda v: v)


@pytest.mark.timeout(60)
def test_a_run_refused_by_a_full_disk_leaves_no_directory_behind(tmp_path, monkeypatch):
    """The lock file is the first thing a run writes into --out: on a full disk its owner's record failed, the run
    was refused ("cannot be written"), and the directory it had made stayed, with an empty lock file and an fd
    left open on it."""
    import errno

    from shardlm import rundir, runlock

    def full(fd, data, at):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(runlock.os, "pwrite", full)
    with pytest.raises(ConfigError, match="cannot be written: No space left on device"):
        rundir.claim(tmp_path / "run", True, lambda value: value)
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    acquire(tmp_path / "run").release()  # nothing in this process holds it
