"""The command line: help for every command, the config flags, export, and torchrun layout checks."""
import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers import cli_here, cli_proc, run_cli
from shardlm.testing.distributed import free_port


@pytest.mark.parametrize("cmd", [[], ["train"], ["eval"], ["generate"], ["data"], ["data", "prepare"], ["export"], ["plan"]])
def test_help(cmd, capsys):
    proc = cli_proc(capsys, *cmd, "--help")  # in this process: eval's and generate's import torch
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc


def test_inductors_note_on_splitting_a_softmax_is_not_shown(capsys):
    """A server's start compiled the sampling step's softmax over the vocabulary at several shapes on a GPU, and
    each printed Inductor's multi-line advice to file a PyTorch issue: nothing a user can act on."""
    import warnings
    cli_proc(capsys, "--help")
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("\nOnline softmax is disabled on the fly since Inductor decides to\nsplit the reduction.",
                      UserWarning)
        warnings.warn("another note", UserWarning)
    assert [str(w.message) for w in seen] == ["another note"]


def test_overrides_without_a_config_name():
    out = run_cli("train", "--train.steps", "50", "--train.log_every=10", "--print-config").stdout
    assert "steps = 50" in out and "log_every = 10" in out and "hidden_size = 256" in out  # the default preset


def test_print_config_and_errors(capsys):
    out = cli_here(capsys, "train", "tiny", "--train.steps", "3", "--print-config")
    assert "[train]" in out and "steps = 3" in out
    bad = cli_proc(capsys, "train", "tiny", "--train.micro_batch_size", "3")
    assert bad.returncode == 2
    assert "train.global_batch_size = 8 is not divisible by train.micro_batch_size (3)" in bad.stderr
    unknown = cli_proc(capsys, "train", "tiny", "--train.bogus", "1")
    assert unknown.returncode == 2 and "train.bogus" in unknown.stderr


@pytest.mark.parametrize("cmd", [["plan", "--model", "tiny", "--search", "--gpus", "8"],
                                 ["train", "tiny", "--print-config"]])
def test_a_reader_that_leaves_ends_the_command_quietly(cmd):
    """`shardlm plan ... | head -1`: the rest of the output went to a closed pipe in BrokenPipeError's traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "shardlm", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    proc.stdout.close()
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 141 and err == "", (proc.returncode, err)


def test_train_export_eval_generate_roundtrip(tmp_path, capsys):
    cli_here(capsys, "train", "tiny", "--train.steps", "3", "--out", tmp_path / "run")
    cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf")
    from transformers import AutoModelForCausalLM
    from shardlm.inference import load_pretrained
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours, tok, _ = load_pretrained(tmp_path / "run")
    ids = torch.tensor([tok.encode("def main():\n    return 1")])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=0, atol=1e-5)
    text = tmp_path / "t.txt"
    text.write_text("import os\nimport sys\n" * 20)
    a = json.loads(cli_here(capsys, "eval", "--model", tmp_path / "run", "--data", text, "--seq-len", 16, "--json"))
    b = json.loads(cli_here(capsys, "eval", "--model", tmp_path / "hf", "--data", text, "--seq-len", 16, "--json"))
    assert a["tokens"] == b["tokens"] == (len(text.read_text()) // 16) * 15
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    g = json.loads(cli_here(capsys, "generate", "--model", tmp_path / "run", "--prompt", "def", "--max-new-tokens", 5,
                            "--json"))
    assert isinstance(g["completion"], str)


def test_torchrun_refuses_a_layout_that_does_not_fill_the_world(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "shardlm", "train", "tiny", "--train.steps", "2", "--out", tmp_path / "r"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode != 0
    # torchrun stops the other worker as soon as one fails, so that one may be gone before it prints (seen
    # on a GPU host); that every rank refuses by itself is the next test.
    said = "parallel.dp (1) x parallel.tp (1) x parallel.pp (1) = 1 != world size 2"
    assert said in proc.stdout + proc.stderr
    # torchrun's summary names the error (each rank's error file), not only its exit status
    assert f"traceback : shardlm train: error: {said}" in proc.stderr


@pytest.mark.parametrize("local_rank", [0, 3])
def test_every_rank_refuses_more_processes_per_node_than_gpus(monkeypatch, local_rank):
    """4 processes on a node with 2 GPUs: every rank (those that have a GPU too) stops with a message
    saying what to do, before the process group; not a CUDA error on rank 2 while ranks 0 and 1 wait."""
    import torch.distributed as dist
    from shardlm.config import ConfigError, load_config
    from shardlm.mesh import init_distributed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set_device reached"))
    for key, value in {"WORLD_SIZE": "4", "RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
                       "LOCAL_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"4 processes on this node need one GPU each, but 2 are visible: "
                                          r"start at most 2 per node \(torchrun --nproc-per-node 2\)"):
        init_distributed(load_config("tiny", {"parallel.dp": "4", "train.micro_batch_size": "2"}))
    assert not dist.is_initialized()


def test_every_rank_refuses_a_bad_layout_before_any_collective(tmp_path):
    """Both ranks of a world of 2, launched as torchrun would but without its supervision, exit with the error;
    a rank that went on into a collective would wait for its peer until the timeout. The node's first rank
    prints it, once for the node, and each writes it to the error file torchrun gives it (its summary then
    names the error as the root cause instead of pointing at torchrun's docs)."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "shardlm", "train", "tiny", "--parallel.dp", "4", "--out", tmp_path / "r"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r),
                                   "TORCHELASTIC_ERROR_FILE": str(tmp_path / f"error{r}.json")}) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    said = "shardlm train: error: parallel.dp (4) x parallel.tp (1) x parallel.pp (1) = 4 != world size 2"
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 2
        assert (said in out + err) == (r == 0), (r, out + err)
        reply = json.loads((tmp_path / f"error{r}.json").read_text())["message"]
        assert said in reply["message"] and said in reply["extraInfo"]["py_callstack"]


def test_a_rank_started_without_torchrun_prints_its_own_bad_input(tmp_path, monkeypatch, capsys):
    """Bad input is printed by a node's first rank alone: under torchrun the others' reach its summary through
    their error files. A rank started by hand, with no such file, printed nothing of what only it may have
    found (a path missing on its node); it now says it."""
    from shardlm.cli import main
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    said = "shardlm train: error: parallel.dp (4) x parallel.tp (1) x parallel.pp (1) = 4 != world size 1"
    assert main(["train", "tiny", "--parallel.dp", "4", "--out", str(tmp_path / "r")]) == 2
    assert said in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert main(["train", "tiny", "--parallel.dp", "4", "--out", str(tmp_path / "r")]) == 2
    assert said not in capsys.readouterr().err and said in (tmp_path / "error.json").read_text()


def _one_rank_of_two(tmp_path, rank: int, timeout_s: int, port: int | None = None):
    """(the port, the finished process) of `rank` of a world of 2 started by hand, its peer never."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0"}
    return port, subprocess.run([sys.executable, "-m", "shardlm", "train", "tiny", "--parallel.dp", "2",
                                 "--parallel.timeout_s", str(timeout_s), "--out", tmp_path / "r"],
                                capture_output=True, text=True, env=env, timeout=120)


def test_a_rank_whose_peers_never_start_says_what_it_waits_for(tmp_path):
    """Rank 0 of a world of 2 started by hand, rank 1 never: it waited in silence until the timeout. A node's
    first rank now says, once the wait is no longer a start-up's, what it waits for; at the timeout the error
    names the rank never heard from."""
    port, done = _one_rank_of_two(tmp_path, 0, 4)
    assert done.returncode == 1
    assert (f"shardlm: waiting for all 2 ranks to join at 127.0.0.1:{port} (for up to 4 s): each must be started, "
            "with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE") in done.stderr, done.stderr
    assert "shardlm train: error: a peer rank died or stalled: rank 1 (never heard from)" in done.stderr, done.stderr


def test_a_rank_started_before_rank_0_waits_quietly_and_names_the_store_it_could_not_reach(tmp_path):
    """Rank 1 started by hand (or by srun on another node) before rank 0: its heartbeat's store client printed
    screens of C++ frames every 2 s, and with rank 0 never started it ended long after the timeout with 'a
    peer rank died or stalled: which one could not be told'."""
    port, done = _one_rank_of_two(tmp_path, 1, 3)
    assert done.returncode == 1
    assert (f"shardlm train: error: rank 1 could not reach the job's store at 127.0.0.1:{port} within 3 s: rank 0 "
            "serves it") in done.stderr, done.stderr
    # One client's retries (torch's rendezvous, as many as the machine's speed allows), none of a beat's
    assert done.stderr.count("(try=0,") <= 1, done.stderr


def test_a_rank_whose_store_port_holds_a_silent_listener_stops_at_the_timeout_naming_it(tmp_path):
    """Something else at MASTER_PORT that accepts connections and never answers (a stopped process of an earlier
    job still holding the port): torch's store client waits on it forever, whatever parallel.timeout_s, and rank
    1 waited in silence (its rendezvous, its heartbeat, and its farewell on a config error). It now stops at the
    timeout with one line naming the address."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes the connections; nothing ever reads or answers them
        start = time.monotonic()
        port, done = _one_rank_of_two(tmp_path, 1, 3, silent.getsockname()[1])
        took = time.monotonic() - start
    assert done.returncode == 1
    assert (f"shardlm train: error: rank 1: 127.0.0.1:{port} accepts connections but did not answer as torch's "
            "store within 3 s") in done.stderr, done.stderr
    assert took < 60, took


def test_ctrl_c_outside_the_training_loop_is_one_line_and_leaves_no_output(tmp_path, monkeypatch, capsys):
    """Ctrl-C while `data prepare` tokenizes (or eval scores, or a model loads) ended in a KeyboardInterrupt
    traceback; now one line and the shell's status for SIGINT, the output directory never made."""
    import shardlm.data.prepare as prepare
    from shardlm.cli import main

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare, "_write", ctrl_c)
    text = tmp_path / "t.txt"
    text.write_text("some text to tokenize\n" * 10)
    capsys.readouterr()
    status = main(["data", "prepare", "--input", str(text), "--tokenizer", "byte", "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip()
    assert status == 130 and err == "shardlm data: interrupted (Ctrl-C)", (status, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.txt"]


def test_ctrl_c_while_the_command_imports_is_one_line(monkeypatch, capsys):
    """Ctrl-C in the tenths of a second the `shardlm` command spends importing its CLI, before main() could catch
    it, printed a traceback through the config's modules."""
    import sys
    import types

    from shardlm.__main__ import run

    class Importing(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt
    monkeypatch.setitem(sys.modules, "shardlm.cli", Importing("shardlm.cli"))
    capsys.readouterr()
    assert run() == 130
    assert capsys.readouterr().err.strip() == "shardlm: interrupted (Ctrl-C)"


def test_export_shows_its_progress_on_a_terminal(tmp_path, monkeypatch, capsys):
    """A 7B export is minutes of checksumming the checkpoint, then of writing: it ran without a word until
    'exported'. On a terminal each phase has its bar, one at a time, each ending at its total; a file or a pipe
    gets none."""
    from helpers import TEXT
    (tmp_path / "t.txt").write_text(TEXT)
    cli_here(capsys, "data", "prepare", "--input", tmp_path / "t.txt", "--tokenizer", "byte", "--out", tmp_path / "d")
    cli_here(capsys, "train", "tiny", "--train.steps", "1", "--train.tensorboard", "false", "--train.sample_tokens", "0",
             "--data.path", tmp_path / "d", "--out", tmp_path / "run")

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cli_here(None, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf")
    monkeypatch.undo()
    shown = [line.strip() for line in terminal.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    phases = [line.split(":")[0] for line in shown]
    assert phases == ["verify"] * phases.count("verify") + ["export"] * phases.count("export"), shown
    assert any(line.startswith("verify: 100%") for line in shown), shown
    assert shown[-1].startswith("export: 100%") and "140k/140k" in shown[-1], shown  # tiny's 139,584 parameters
    out = cli_here(capsys, "export", "--checkpoint", tmp_path / "run", "--out", tmp_path / "hf", "--overwrite")
    assert "exported" in out and "verify" not in capsys.readouterr().err  # not a terminal: no bar


def test_long_work_off_a_terminal_is_told_in_lines(monkeypatch, capsys):
    """generate and eval over a file, export's verification and writing, data preparation: their bars show on a
    terminal only, so in a scheduler's log a 7B export or 10,000 prompts said nothing for minutes. Off a
    terminal a line says the count, the share and the time left every 30 s (0.05 here), and one the end; work
    shorter than that says nothing, and another rank's nothing at all."""
    import re
    import time

    import shardlm.runtime.progress as progress_module
    from shardlm.runtime.progress import progress
    with progress(10, "generate", "requests"):
        pass
    assert capsys.readouterr().err == ""  # within the interval
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.05)
    with progress(10, "generate", "requests", shown=False) as bar:
        bar.update(3)
        time.sleep(0.2)
    assert capsys.readouterr().err == ""
    with progress(10, "generate", "requests") as bar:
        bar.update(3)
        time.sleep(0.2)
        bar.update(7)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(x == "generate: 3 of 10 requests (30%) in 0s, about 0s left" for x in lines[:-1]), lines
    assert re.fullmatch(r"generate: 10 requests in 0s", lines[-1]), lines
    with progress(3 * 2**30, "verify", "B", scale=True, opening="verifying the checkpoint") as bar:
        bar.update(2**30)
        time.sleep(0.2)
        bar.update(2 * 2**30)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "verifying the checkpoint" and lines[1] == "verify: 1.07GB of 3.22GB (33%) in 0s, about 0s left"
    assert lines[-1] == "verify: 3.22GB in 0s", lines


def test_the_header_says_one_step_and_lora_keys_that_rank_0_leaves_unused(tmp_path, capsys):
    """`--lora.alpha` without `--lora.rank` trains every weight, as rank 0 means: the header says so rather than
    leaving a user to find that their fine-tune was not a LoRA one; and it counts one step in the singular."""
    out = cli_here(capsys, "train", "tiny", "--train.steps", "1", "--lora.alpha", "32", "--out", tmp_path / "run")
    header = next(line for line in out.splitlines() if line.startswith("shardlm:"))
    assert " 1 step of " in header and "lora.rank 0: no adapters, every weight trains" in header


@pytest.mark.timeout(60)
def test_train_help_names_every_config_section(capsys):
    """`shardlm train --help` listed the sections as model, data, train, parallel: [lora] (lora.rank, ...) was
    left out, though --lora.* overrides and a TOML file's [lora] work."""
    from shardlm.config import SECTIONS
    out = cli_proc(capsys, "train", "--help").stdout
    assert f"(sections: {', '.join(SECTIONS)})" in " ".join(out.split()) and "lora" in SECTIONS
