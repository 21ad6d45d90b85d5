"""Failures of a distributed run: a signal to one rank, SIGTERM to torchrun, a dead or stalled peer (on
the CPU and on GPUs), and the watchdog that ends a rank whose peers make no progress."""
import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dist_fns
from dp_cases import gpus_for, read_metrics
from shardlm.testing.distributed import free_port, run_distributed


def test_a_signal_to_one_rank_stops_every_rank_after_that_step_on_a_resumable_checkpoint(tmp_path):
    """SIGTERM reaches rank 1 alone, in the middle of step 3 (ZeRO-2: the state is sharded, so saving it is
    collective). Both ranks finish step 3, stop, and save it; resumed, the run gives the uninterrupted one's
    losses, which it would not if the update of step 3 had been cut short, or saved as step 2's."""
    common = {"train.steps": "5", "train.global_batch_size": "8", "train.micro_batch_size": "2",
              "parallel.dp": "2", "parallel.zero_stage": "2"}
    stopped = run_distributed(dist_fns.signal_mid_step_on_rank_one, 2, common, str(tmp_path / "a"), 3, timeout=240)
    for r in stopped:
        assert r["stopped_by"] == signal.SIGTERM and r["steps"] == [1, 2, 3]
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    resumed = run_distributed(dist_fns.train_and_capture, 2, common, str(tmp_path / "b"), ckpt, timeout=240)
    full = run_distributed(dist_fns.train_and_capture, 2, common, timeout=240)
    assert stopped[0]["losses"] + resumed[0]["losses"] == full[0]["losses"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpus_for(2))])
def test_sigterm_to_torchrun_stops_every_rank_on_one_saved_step(tmp_path, device):
    """torchrun, sent SIGTERM (as a scheduler stops a job), sends it on to its workers and kills them if they
    take longer than 30 s. The ranks finish the step, agree to stop after it (over the default group on
    the CPU; on GPUs over a gloo group beside NCCL's), save it, and exit; the run resumes from it."""
    args = ["tiny", "--train.device", device, "--train.log_every", "1", "--train.tensorboard", "false",
            "--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--parallel.dp", "2",
            "--parallel.zero_stage", "2"]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "shardlm",
           "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*run, "--train.steps", "100000", "--out", str(tmp_path / "a")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "a" / "metrics.jsonl"
    deadline = time.time() + 200
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, log[-3000:]  # the job did not finish
    k = read_metrics(tmp_path / "a")[-1]["step"]
    assert (f"stopped by SIGTERM after step {k} of 100000; to continue: torchrun --nproc-per-node 2 -m shardlm train "
            f"--resume {tmp_path / 'a'}") in log, log[-3000:]
    assert [p.name for p in (tmp_path / "a" / "checkpoints").iterdir()] == [f"step_{k:08d}"]
    done = subprocess.run([*run, "--train.steps", str(k + 2), "--out", str(tmp_path / "a"),
                           "--resume", str(tmp_path / "a")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "a")] == list(range(1, k + 3))


@pytest.mark.parametrize("fate", ["dies", "stalls"])
def test_a_dead_or_stalled_rank_ends_the_others_within_the_timeout(tmp_path, fate):
    """Rank 1 joins the process group, then exits or hangs; rank 0 (a real `shardlm train`, on the CPU like
    its gloo peer, also on a machine with GPUs) must fail. The GPU case: the stalled-peer test below."""
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1"}
    peer = ("import os, sys, time, datetime, torch.distributed as d; "
            "d.init_process_group('gloo', timeout=datetime.timedelta(seconds=5)); "
            + ("os._exit(1)" if fate == "dies" else "time.sleep(120)"))
    p1 = subprocess.Popen([sys.executable, "-c", peer], env={**base, "RANK": "1", "LOCAL_RANK": "1"})
    t0 = time.monotonic()
    try:
        p0 = subprocess.run([sys.executable, "-m", "shardlm", "train", "tiny", "--parallel.dp", "2",
                             "--parallel.timeout_s", "5", "--train.device", "cpu", "--out", tmp_path / "r"],
                            capture_output=True, text=True, env={**base, "RANK": "0", "LOCAL_RANK": "0"}, timeout=90)
    finally:
        p1.kill()
        p1.wait()
    elapsed = time.monotonic() - t0
    assert p0.returncode == 1, p0.stderr[-2000:]
    # The peer here is no shardlm process: it never beats, and is named as never heard from.
    assert "shardlm train: error: a peer rank died or stalled: rank 1 (never heard from)" in p0.stderr, p0.stderr[-2000:]
    assert "parallel.timeout_s = 5 s" in p0.stderr and "Traceback" not in p0.stderr, p0.stderr[-2000:]
    assert elapsed < 60, elapsed


@pytest.mark.parametrize("how", ["event", "guard"])
def test_work_that_never_finishes_ends_the_process_with_a_message(how):
    """GPU work waiting on a stalled peer (copy-engine flags in the command stream, or an NCCL collective)
    and host sections waiting on peers have no timeout of their own that ends the process in time; the
    watchdog must exit with a message naming what stalled (a fake event here, and a guarded sleep)."""
    stall = ("w.watch(Never(), 'training step 7')\ntime.sleep(30)\n" if how == "event" else
             "with w.guard('training step 7'):\n    time.sleep(30)\n")
    code = ("import time\nfrom shardlm.runtime.watchdog import Watchdog\n"
            "class Never:\n    def query(self): return False\n"
            "w = Watchdog(0.3)\n" + stall + "print('still alive')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "still alive" not in done.stdout
    assert "training step 7 made no progress for 0.3 s" in done.stderr


def test_a_guarded_section_that_makes_progress_outlasts_the_timeout():
    """A large model's save on a slow disk outlasts parallel.timeout_s without stalling: the watchdog ended the
    run in it, at every save. Progress said inside the section (each file written) moves its deadline on; the
    section ends it where progress stops."""
    code = ("import time\nfrom shardlm.runtime.watchdog import Watchdog\nw = Watchdog(0.5)\n"
            "with w.guard('saving step 7') as alive:\n"
            "    for _ in range(20):\n        time.sleep(0.1)\n        alive()\n"
            "    print('outlasted', flush=True)\n    time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "outlasted\n", (done.stdout, done.stderr)
    assert "saving step 7 made no progress for 0.5 s" in done.stderr


def test_the_watchdog_names_the_stalled_peer_and_where_it_is(tmp_path):
    """On GPUs the watchdog, not a failed collective, ends a rank whose peer stalled: its message said only
    'a peer rank died or stalled'. It now reads the peers' beats as a failed collective's message does: here
    rank 1 is alive, stuck in a read that never comes (a named pipe without a writer)."""
    from datetime import timedelta

    import torch.distributed as dist

    from shardlm.data.instruct import is_instruct
    port, fifo = free_port(), tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    peer = subprocess.Popen([sys.executable, "-c", (
        "from pathlib import Path\nfrom shardlm.data.instruct import is_instruct\n"
        "from shardlm.runtime.heartbeat import Heartbeat\n"
        f"beat = Heartbeat(1, 2, '127.0.0.1', {port}, interval=0.2)\nis_instruct(Path({str(fifo)!r}))\n")])
    try:
        deadline = time.monotonic() + 60
        key = "shardlm/heartbeat/0/1"  # attempt 0 (no torchrun restart), rank 1
        while "is_instruct" not in (store.get(key).decode() if store.check([key]) else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        code = ("import time\nfrom shardlm.runtime.watchdog import Watchdog\nw = Watchdog(0.3)\n"
                "with w.guard('training step 7'):\n    time.sleep(30)\n")
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    finally:
        peer.kill()
        peer.wait()
    lines, first = inspect.getsourcelines(is_instruct)
    read = first + next(i for i, line in enumerate(lines) if "open(path" in line)
    assert done.returncode == 1
    assert re.search(r"training step 7 made no progress for 0\.3 s \(parallel\.timeout_s\): a peer rank died or "
                     rf"stalled: no rank died; where each was: rank 1 at shardlm/data/instruct\.py:{read} is_instruct "
                     r"\(for \d+ s\); exiting", done.stderr), done.stderr


@pytest.mark.parametrize("stall, said", [
    ("tr.engine.step_stats = lambda step: time.sleep(30)", "the metrics of step 1"),
    ("step = tr.forward_backward\ntr.forward_backward = lambda *a: (time.sleep(30) if tr.step == 1 else None) or step(*a)",
     "training step 2"),
], ids=["metrics", "step"])
def test_the_trainer_guards_its_waits_on_peers(stall, said):
    """The trainer's host sections that wait on peers run under its watchdog: one that stalls ends the run with a
    message naming it. Among them the step's forward, backward and update (fp16's overflow check, MoE's exact
    dispatch counts), once left to NCCL's timeout, twice parallel.timeout_s, without a word of which rank; the
    process's first step that computes aside, whose compilation may outlast the timeout. On CPU the trainer has
    no watchdog of its own (gloo times out by itself), so the test gives it one."""
    code = ("import time\nfrom shardlm.config import load_config\nfrom shardlm.trainer import Trainer\n"
            "from shardlm.runtime.watchdog import Watchdog\n"
            "cfg = load_config('tiny', {'train.steps': '3', 'train.log_every': '1', 'train.device': 'cpu',\n"
            "                           'train.tensorboard': 'false'})\n"
            f"tr = Trainer(cfg, log=lambda *a: None)\ntr.watchdog = Watchdog(0.5)\n{stall}\ntr.run()\n"
            "print('still alive')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "still alive" not in done.stdout, done.stderr[-2000:]
    assert f"{said} made no progress for 0.5 s" in done.stderr, done.stderr[-2000:]


def test_finished_work_keeps_the_watchdog_quiet():
    from shardlm.runtime.watchdog import Watchdog

    class Done:
        def query(self):
            return True
    w = Watchdog(0.2)
    w.watch(Done(), "training step 1")
    with w.guard("a quick section"):
        time.sleep(0.05)
    time.sleep(0.6)  # a wrong watchdog would have ended this test's process by now
    w.close()
    assert not w.pending and not w.thread.is_alive()


@gpus_for(2)
@pytest.mark.parametrize("algo,stage", [("copy_engine", 0), ("copy_engine", 1), ("copy_engine", 2), ("copy_engine", 3),
                                        ("all_to_all", 0)])
def test_a_stalled_peer_ends_the_gpu_run_within_the_timeout(tmp_path, algo, stage):
    """On GPUs the copy-engine reduction waits on flags that a stalled peer never sets, and NCCL, at its
    timeout, would abort and let the step finish on wrong data: the trainer's watchdog must end the
    waiting rank with a message within parallel.timeout_s, before any later step completes."""
    script = tmp_path / "stall.py"
    script.write_text(
        "import os, time, torch\n"
        "from shardlm.config import load_config\nfrom shardlm.trainer import Trainer\n"
        "cfg = load_config('tiny', {'parallel.dp': '2', 'train.device': 'cuda', 'train.precision': 'bf16',\n"
        "                           'train.tensorboard': 'false', 'train.compile': 'false', 'parallel.timeout_s': '10',\n"
        f"                           'parallel.reduce_algo': '{algo}', 'parallel.zero_stage': '{stage}'}})\n"
        "tr = Trainer(cfg, log=lambda *a: None)\n"
        f"assert tr.engine.algo == '{algo}', tr.engine.algo\n"
        "tr.train_step(); tr.step += 1; torch.cuda.synchronize()\n"
        "if int(os.environ['RANK']) == 1:\n    time.sleep(300)\n"
        "tr.train_step(); tr.step += 1; torch.cuda.synchronize()\nprint('rank 0 went on')\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=200)
    assert done.returncode != 0 and "rank 0 went on" not in done.stdout
    assert "training step 2 made no progress for 10 s" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - t0 < 150


def test_the_heartbeat_names_the_rank_that_fell_silent():
    while_all, after = run_distributed(dist_fns.heartbeat_names_the_silent_rank, 3, timeout=60)[0]
    assert while_all.startswith("no rank died; where each was: ranks 1, 2 at "), while_all  # everyone beats
    assert after.startswith("rank 1 (silent for ") and "rank 2" not in after, after


def test_the_heartbeat_names_a_killed_peer_at_once_and_a_peer_that_stopped_on_its_own_error():
    """A peer SIGKILLed a moment after its last beat was not yet silent for long: it was reported as 'which
    one could not be told'. Its process has ended on this host, which the report now says at once. A peer
    that stopped on an error it printed says so before exiting (farewell), and is not reported as a death."""
    from datetime import timedelta

    import torch.distributed as dist

    from shardlm.runtime.heartbeat import Heartbeat
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=10),  # noqa: F841 - serves
                          wait_for_workers=False)
    peer = ("import sys, time\nfrom shardlm.runtime.heartbeat import Heartbeat\n"
            f"beat = Heartbeat(1, 2, '127.0.0.1', {port}, interval=60)\n"
            "if sys.argv[1] == 'fails':\n    beat.farewell()\n    print('said', flush=True)\n"
            "time.sleep(120)\n")
    me = Heartbeat(0, 2, "127.0.0.1", port, interval=60)
    try:
        for fate in ("killed", "fails"):
            p1 = subprocess.Popen([sys.executable, "-c", peer, fate], stdout=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 60
                while me.silent() and time.monotonic() < deadline:
                    time.sleep(0.1)  # until its first beat
                if fate == "fails":
                    assert p1.stdout.readline() == "said\n"
                    assert me.failed() == [1]
                    continue
                assert me.failed() == []
                p1.kill()
                p1.wait()
                assert me.report() == "rank 1 (its process ended)"
            finally:
                p1.kill()
                p1.wait()
    finally:
        me.close()


@pytest.mark.timeout(60)
def test_a_farewell_and_a_report_end_where_something_silent_holds_the_store_port():
    """Something at the store's address that accepts connections and never answers (a stopped process of an
    earlier job still holding the port): torch's store client waits there forever whatever its timeout, so a
    rank's farewell on its own error (a bad config, before any rendezvous), its beats and its report of a failed
    collective hung. Each now ends within its own wait."""
    import socket

    from shardlm.runtime.heartbeat import Heartbeat
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes the connections; nothing ever reads or answers them
        me = Heartbeat(1, 2, "127.0.0.1", silent.getsockname()[1], interval=0.2)
        try:
            start = time.monotonic()
            me.farewell("bad config")  # a client's wait of 2 s
            assert me.report() == "which one could not be told"  # 5 s
            assert time.monotonic() - start < 12
        finally:
            me.close()
        assert not me.thread.is_alive()  # its beat did not hang either


def test_the_heartbeat_names_where_each_peer_was_when_none_died(tmp_path):
    """A peer alive but stalled (here in a read from a file that never comes, as on a hung filesystem) beats
    on: the report said 'which one could not be told'. A beat now tells where the rank's training thread is in
    shardlm's source and since when; the report names where each peer was, the odd one out first."""
    from shardlm.data.instruct import is_instruct
    from shardlm.divergence import refuse_nan_loss

    def line_of(fn, text):
        lines, first = inspect.getsourcelines(fn)
        return first + next(i for i, line in enumerate(lines) if text in line)
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    report = run_distributed(dist_fns.heartbeat_names_where_a_stalled_rank_is, 4, str(fifo), timeout=90)[0]
    read, reduce = line_of(is_instruct, "open(path"), line_of(refuse_nan_loss, "dist.all_reduce(")
    assert re.fullmatch(rf"no rank died; where each was: rank 1 at shardlm/data/instruct\.py:{read} is_instruct "
                        rf"\(for \d+ s\); ranks 2, 3 at shardlm/divergence\.py:{reduce} refuse_nan_loss \(for \d+ s\)",
                        report), report


def test_one_rank_failing_on_its_own_stops_the_other_pointing_at_its_message(tmp_path):
    """Rank 1 alone cannot read its data (a node without the dataset): it says so, and rank 0, whose next
    collective fails, said 'a peer rank died or stalled: which one could not be told'. It now points at rank 1's
    message; both stop at once, neither with a traceback."""
    from shardlm.data.prepare import prepare
    (tmp_path / "text.txt").write_text("a few words of text, over and over. " * 2000)
    prepare([str(tmp_path / "text.txt")], "byte", str(tmp_path / "data"))
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import os, sys\nfrom shardlm.cli import main\n"
        f"data = {str(tmp_path / 'not-here')!r} if os.environ['RANK'] == '1' else {str(tmp_path / 'data')!r}\n"
        f"sys.exit(main(['train', 'tiny', '--parallel.dp', '2', '--train.device', 'cpu', '--data.path', data,\n"
        f"               '--out', {str(tmp_path / 'r')!r}]))\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = done.stderr
    assert done.returncode != 0
    assert err.count(f"shardlm train: error: data.path = '{tmp_path / 'not-here'}' does not exist") == 1, err
    # torchrun's summary has rank 1's message, which rank 1 left to it: rank 0 prints it too, as no restart's would
    assert (f"shardlm train: error: stopping: rank 1 stopped on an error: data.path = '{tmp_path / 'not-here'}' does not "
            "exist") in err, err[-3000:]
    assert "died or stalled" not in err and "[rank0]" not in err and "[rank1]" not in err, err[-3000:]
    assert time.monotonic() - t0 < 120


def _torchrun_training(out, ranks: int, extra: list, steps_logged: int):
    """torchrun of `ranks` processes training tiny at dp `ranks` into `out` for good, returned once
    metrics.jsonl holds `steps_logged` steps (or 200 s have passed)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
           "shardlm", "train", "tiny", "--parallel.dp", str(ranks), *extra, "--train.device", "cpu",
           "--train.log_every", "1", "--train.tensorboard", "false", "--train.steps", "100000", "--out", str(out)]
    proc = subprocess.Popen(run, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 200
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < steps_logged):
        time.sleep(0.05)
    return proc


def test_workers_whose_torchrun_was_killed_stop_saved(tmp_path):
    """torchrun SIGKILLed (the OOM killer; a scheduler's kill after its grace period) leaves its workers, each
    in a session of its own, training on as orphans and holding the run directory. They now notice within
    seconds, stop after a step, the same on both, save it and exit."""
    proc = _torchrun_training(tmp_path / "a", 2, [], steps_logged=3)
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid]
    proc.kill()
    try:
        log = proc.communicate(timeout=90)[0]  # the workers hold the pipe until they exit
    finally:
        for pid in workers:  # orphans left by a failure must not outlive the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    k = read_metrics(tmp_path / "a")[-1]["step"]
    assert "the launcher (pid" in log and f"stopped by SIGTERM after step {k} of 100000" in log, log[-3000:]
    assert [p.name for p in (tmp_path / "a" / "checkpoints").iterdir()] == [f"step_{k:08d}"]


def _parent(proc_dir) -> int | None:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _torchrun_with_rank_one(tmp_path, rank_one: dict, rank_zero: dict | None = None):
    """A 2-rank `shardlm train tiny` whose rank 1 is given `rank_one`'s arguments in place of rank 0's."""
    from shardlm.data.prepare import prepare
    for name, text in (("a", "a few words of text, over and over. "), ("b", "other words entirely, again. ")):
        (tmp_path / f"{name}.txt").write_text(text * 2000)
        prepare([str(tmp_path / f"{name}.txt")], "byte", str(tmp_path / name))
    args = {"--data.path": str(tmp_path / "a"), "--out": str(tmp_path / "r"), **(rank_zero or {})}
    script = tmp_path / "ranks.py"
    script.write_text(
        "import os, sys\nfrom shardlm.cli import main\n"
        f"args = {{**{args!r}, **({rank_one!r} if os.environ['RANK'] == '1' else {{}})}}\n"
        "sys.exit(main(['train', 'tiny', '--parallel.dp', '2', '--train.device', 'cpu', '--train.steps', '2',\n"
        "               '--train.tensorboard', 'false', '--train.sample_tokens', '0',\n"
        "               *[x for kv in args.items() for x in kv]]))\n")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("rank_one, said", [
    ({"--train.lr": "0.01"}, "rank 1 has train.lr = 0.01 where rank 0 has 0.003"),  # trained on, diverging
    ({"--model.hidden_size": "128"}, "rank 1 has model.hidden_size = 128 where rank 0 has 64"),  # gloo's abort
    ({"--out": "OTHER"}, "rank 1 has --out = 'OTHER' where rank 0 has 'R'"),  # failed at the first save
], ids=["lr", "model", "out"])
def test_ranks_started_with_other_settings_are_refused_at_once(tmp_path, rank_one, said):
    """One rank given another config (a node left with an old job script) trained on silently with another
    learning rate, aborted in gloo's C++ on another model shape, or failed steps later at the first save on
    another --out. Every rank now stops before the model is built, naming the rank and the key."""
    other = {"--out": str(tmp_path / "other")} if rank_one.get("--out") == "OTHER" else rank_one
    done = _torchrun_with_rank_one(tmp_path, other)
    said = said.replace("OTHER", str(tmp_path / "other")).replace("'R'", repr(str(tmp_path / "r")))
    assert done.returncode != 0, done.stderr[-3000:]
    assert f"shardlm train: error: the ranks were started with different settings: {said}" in done.stderr, \
        done.stderr[-3000:]
    assert "Received data size" not in done.stderr and "[rank" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "r").exists() and not (tmp_path / "other").exists()


def test_ranks_reading_other_data_are_refused(tmp_path):
    """A node's own copy of the data, prepared from other text: each rank trained on what it read. The shards'
    index is compared, not the path: an identical copy elsewhere trains."""
    done = _torchrun_with_rank_one(tmp_path, {"--data.path": str(tmp_path / "b")})
    assert done.returncode != 0, done.stderr[-3000:]
    assert (f"shardlm train: error: rank 1 reads other data than rank 0: its data.path '{tmp_path / 'b'}' holds "
            f"other shards than rank 0's '{tmp_path / 'a'}'") in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "r").exists()
    import shutil
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    done = _torchrun_with_rank_one(tmp_path, {"--data.path": str(tmp_path / "copy")})
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_killed_rank_is_the_only_one_its_peers_name(tmp_path):
    """Rank 3 of 4 SIGKILLed: the first rank to notice named it, then left, and the last to notice named
    'rank 0 (its process ended), rank 2 (its process ended), rank 3 (its process ended)', as though three
    had died. A rank leaving over a failed peer now says so in the store, and every message names rank 3."""
    proc = _torchrun_training(tmp_path / "a", 4, ["--train.micro_batch_size", "2"], steps_logged=2)
    workers = {_rank_of(p): int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == proc.pid}
    try:
        assert sorted(workers) == [0, 1, 2, 3], workers
        os.kill(workers[3], signal.SIGKILL)
        log = proc.communicate(timeout=90)[0]
    finally:
        proc.kill()
        for pid in workers.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    said = [line for line in log.splitlines() if line.startswith("shardlm train: error:")]
    assert said and all("a peer rank died or stalled: rank 3 (its process ended) (" in line for line in said), said


def _rank_of(proc_dir) -> int | None:
    for var in (proc_dir / "environ").read_bytes().split(b"\0"):
        if var.startswith(b"RANK="):
            return int(var[5:])
    return None
