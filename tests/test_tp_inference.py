"""Tensor-parallel inference misused or interrupted (`torchrun ... -m shardlm generate|eval|serve --tp N`): a
degree the model does not fit, ranks that never meet, a peer that dies: each rank stops with one line, never a
shape error blamed on the checkpoint, a silent wait or a traceback."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dist_fns
from helpers import make_tokenizer, save_hf


def save_llama(directory: Path, **shape) -> Path:
    """A tiny random HF Llama of `shape` (hidden 64, 4 heads, 2 KV heads, MLP 96 unless given), with a tokenizer."""
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=300, max_position_embeddings=128)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**cfg, **shape})).save_pretrained(directory)
    make_tokenizer(directory)
    return directory


@pytest.mark.timeout(120)
def test_a_tp_degree_that_does_not_divide_the_mlp_is_refused_on_every_rank(tmp_path):
    """`generate --tp 2` of a model with 97 MLP features: rank 0's slice came out a row longer and it stopped on
    'layers.0.mlp.up.weight has shape (98, 64), the config gives (96, 64)', blamed on the checkpoint, while rank
    1 loaded its slice and went on to wait for it. Every rank now refuses the degree before a weight is read."""
    from shardlm.testing.distributed import run_distributed
    model = save_llama(tmp_path / "hf", intermediate_size=97)
    args = ["generate", "--model", model, "--prompt", "To be", "--max-new-tokens", 2, "--tp", 2]
    got = run_distributed(dist_fns.cli_with_rank_one_given, 2, args, [], timeout=90)
    said = "shardlm generate: error: --tp 2 does not divide the model's 97 MLP hidden features: no --tp above 1 fits"
    assert [status for status, _ in got] == [2, 2], got
    assert all(said in err for _, err in got), got


def test_a_tp_degree_that_does_not_divide_the_heads_names_the_degrees_that_do(tmp_path):
    import dataclasses

    from shardlm.config import ConfigError, load_config
    from shardlm.inference.load import check_tp_degree
    cfg = load_config("tiny").model  # 4 heads, 128 MLP features
    with pytest.raises(ConfigError, match=r"^--tp 3 does not divide the model's 4 attention heads: give --tp 2 or 4$"):
        check_tp_degree(cfg, 3)
    moe = load_config("mixtral-tiny").model  # every MLP a mixture of experts, whole on each rank: no MLP to split
    check_tp_degree(dataclasses.replace(moe, ffn_hidden_size=97), 2)



def start_ranks(argv: list, log_dir: Path, world: int = 2, ranks=None, prelude: str = "") -> list:
    """`shardlm ...argv` on the ranks `ranks` (default all) of `world`, started by hand as torchrun would start
    them (its variables, but no agent to stop the others when one fails): each one's Popen, its stdout and
    stderr together in log_dir/rank{r}.log. `prelude`: Python each runs first (a module's setting changed)."""
    from shardlm.testing.distributed import free_port
    port, procs = free_port(), []
    code = f"import sys\n{prelude}\nfrom shardlm.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))"
    for rank in range(world) if ranks is None else ranks:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with open(log_dir / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env))
    return procs


def stopped(procs, timeout: float) -> list:
    """Each process's exit status, or None for one still running after `timeout` seconds (then killed)."""
    end, codes = time.monotonic() + timeout, []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


@pytest.mark.timeout(120)
def test_a_rank_whose_peer_never_joins_says_what_it_waits_for_and_stops_at_the_timeout(tmp_path):
    """Rank 0 of `generate --tp 2` whose peer had stopped before the rendezvous (its own flags refused, in ranks
    started by hand or on other nodes) waited in silence for torch's default of 30 minutes. It now says what it
    waits for, and at the timeout (here 3 s) stops with one line and status 1, no traceback."""
    save_hf("llama", tmp_path / "hf")
    procs = start_ranks(["generate", "--model", tmp_path / "hf", "--prompt", "To be", "--tp", 2], tmp_path, ranks=[0],
                        prelude="import shardlm.inference.commands as c\nc.TIMEOUT_S = 3.0")
    assert stopped(procs, 40) == [1]
    said = (tmp_path / "rank0.log").read_text()
    assert "shardlm: waiting for all 2 ranks to join at 127.0.0.1:" in said, said
    assert said.strip().splitlines()[-1].startswith("shardlm generate: error: the 2 ranks of --tp 2 did not all "
                                                    "join at 127.0.0.1:"), said
    assert "Traceback" not in said, said


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_generation_stops_the_other_with_one_line(tmp_path):
    """Rank 1 of `generate --tp 2` killed while it decodes: rank 0 printed gloo's traceback of the engine's step
    (every surviving rank did, at higher degrees). It now stops at once with one line and status 1."""
    save_hf("llama", tmp_path / "hf")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"To be {i}"}) + "\n" for i in range(100)))
    out = tmp_path / "out.jsonl"
    procs = start_ranks(["generate", "--model", tmp_path / "hf", "--input", src, "--output", out,
                         "--max-new-tokens", 100, "--max-batch", 1, "--tp", 2], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:  # decoding, past the load
            assert all(p.poll() is None for p in procs), [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        assert stopped(procs, 30) == [1, -signal.SIGKILL]
    finally:
        stopped(procs, 0)
    said = (tmp_path / "rank0.log").read_text()
    assert said.strip().splitlines()[-1].startswith("shardlm generate: error: a peer rank died or stalled "
                                                    "(communication failed: "), said
    assert "Traceback" not in said, said


@pytest.mark.timeout(120)
@pytest.mark.parametrize("killed", [1, 0])
def test_a_rank_killed_mid_request_stops_the_tensor_parallel_server_with_one_line(killed, tmp_path):
    """`serve --tp 2` with a request decoding, one rank killed: the other logged gloo's traceback of the failed
    step, then rank 0 another before it exited and rank 1 a third, its own 'heard no plan' error raised as
    one. The survivor now stops at once with one line and status 1."""
    import contextlib
    import threading

    import httpx

    from shardlm.testing.distributed import free_port
    save_hf("llama", tmp_path / "hf")
    port = free_port()
    procs = start_ranks(["serve", "--model", tmp_path / "hf", "--tp", 2, "--port", port, "--max-batch", 2,
                         "--compile", "off", "--log-level", "warning"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        def ask():  # its answer is cut off with the server
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{url}/v1/completions", json={"prompt": "To be", "max_tokens": 120, "temperature": 0},
                           timeout=60)
        threading.Thread(target=ask, daemon=True).start()
        while httpx.get(f"{url}/metrics", timeout=5).json()["requests_active"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        procs[killed].send_signal(signal.SIGKILL)
        survivor = 1 - killed
        assert stopped([procs[survivor]], 30) == [1]
    finally:
        stopped(procs, 0)
    said = (tmp_path / f"rank{survivor}.log").read_text()
    assert said.strip().splitlines()[-1].startswith(f"shardlm serve: error: rank {survivor} "), said
    assert "Traceback" not in said, said


@pytest.mark.timeout(120)
def test_eval_tasks_at_tp_agree_the_slots_over_the_ranks(tmp_path):
    """`eval --tasks bleu --tp 2` took each rank's own count of slots from its own free memory (generate and serve
    take the fewest of any rank): ranks short of memory unequally batched the prompts differently, and their
    steps' collectives no longer met. Every rank now agrees the count over the tensor-parallel group."""
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    data = tmp_path / "ex.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": "or not"}) + "\n" for p in ("To be", "whether")))
    assert run_distributed(dist_fns.slot_groups_of_eval_tasks, 2, tmp_path / "hf", data, timeout=90) == [[True]] * 2


def test_more_tensor_parallel_ranks_than_gpus_are_refused_on_every_rank(tmp_path, monkeypatch, capsys):
    """`torchrun --nproc-per-node 2 ... --tp 2` on a node with one GPU: rank 1 stopped on CUDA's 'invalid device
    ordinal' traceback (torch.cuda.set_device) while rank 0 went on to the rendezvous. Every rank now
    refuses the launch first, naming the count to start (here rank 0, whose own GPU exists)."""
    import torch

    from helpers import cli_proc
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    save_hf("llama", tmp_path / "hf")
    done = cli_proc(capsys, "generate", "--model", tmp_path / "hf", "--prompt", "To be", "--tp", 2, "--device", "cuda")
    assert done.returncode == 2, done
    assert done.stderr.strip() == ("shardlm generate: error: 2 processes on this node need one GPU each, but 1 is visible: "
                                   "start at most 1 per node (torchrun --nproc-per-node 1, --tp to match), or run on "
                                   "the CPU (--device cpu)"), done


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["generate", "eval"])
def test_ranks_that_read_other_contents_at_the_same_path_are_refused(command, tmp_path):
    """`generate --tp 2 --input F` where rank 1's F held another prompt (a node's own copy of the file): the
    arguments agreed, each rank decoded its own prompt with its slices summed with the other's, and rank 0 wrote
    a completion of neither without a word (eval's --data text likewise). Every rank now stops once the files
    are read, naming the flag."""
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    if command == "generate":
        src, other = tmp_path / "in.jsonl", tmp_path / "other.jsonl"
        src.write_text(json.dumps({"prompt": "To be"}) + "\n")
        other.write_text(json.dumps({"prompt": "To do"}) + "\n")
        args = ["generate", "--input", src, "--output", tmp_path / "out.jsonl", "--max-new-tokens", 4]
    else:
        src, other = tmp_path / "text.txt", tmp_path / "other.txt"
        src.write_text("To be, or not to be, that is the question. " * 4)
        other.write_text("To do, or not to do, that is the question. " * 4)
        args = ["eval", "--data", src, "--seq-len", 16]
    got = run_distributed(dist_fns.cli_with_rank_one_reading, 2, [*args, "--model", tmp_path / "hf", "--tp", 2], other,
                          timeout=90)
    assert [status for status, _ in got] == [2, 2], got
    flag = "--input" if command == "generate" else "--data"
    said = f"shardlm {command}: error: rank 1 read other contents than rank 0 from {flag} {src}: every rank must read"
    assert all(said in err for _, err in got), got


def test_a_max_len_beyond_the_context_is_noted_by_rank_0_alone(tmp_path, monkeypatch, capsys):
    """`serve --tp 2 --max-len 1000` on a model of 128 positions printed its note once per rank."""
    import torch

    import shardlm.inference.commands as commands
    import shardlm.serve.command as command
    from helpers import cli_proc
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    # rank 1 of two as far as the note goes (no group: the model whole, no plans), stopped before it serves
    monkeypatch.setattr(commands, "_tensor_parallel", lambda a: (torch.device("cpu"), None, False))

    def built(*args, **kwargs):
        raise ValueError("built")
    monkeypatch.setattr(command, "build_server", built)
    save_hf("llama", tmp_path / "hf")
    done = cli_proc(capsys, "serve", "--model", tmp_path / "hf", "--tp", 2, "--max-len", 1000, "--compile", "off")
    assert done.returncode == 2 and "built" in done.stderr, done
    assert "is beyond the model's context" not in done.stderr, done


def test_serve_tp_with_an_adapter_is_refused_with_advice_that_works(tmp_path, monkeypatch, capsys):
    """`serve --tp 2 --adapter a=DIR` said to serve the merged model '(shardlm export --merge)', which merges a
    LoRA run's own adapters and refuses a PEFT directory, the only kind --adapter takes. It names PEFT's merge."""
    from helpers import cli_proc
    from test_generation import random_adapter
    for name, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    save_hf("llama", tmp_path / "hf")
    random_adapter(tmp_path / "hf", tmp_path / "ad", 2, "all-linear", 0)
    done = cli_proc(capsys, "serve", "--model", tmp_path / "hf", "--tp", 2, "--adapter", f"a={tmp_path / 'ad'}")
    assert done.returncode == 2, done
    assert done.stderr.strip() == ("shardlm serve: error: --adapter with --tp: adapters are not sliced for tensor "
                                   "parallelism yet; serve the base with the adapter merged into it instead (PEFT's "
                                   "merge_and_unload and save_pretrained; a shardlm LoRA run's own: shardlm export "
                                   "--merge)"), done
