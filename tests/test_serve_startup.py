"""`shardlm serve` starting and stopping: where replicas are placed, and how a second Ctrl-C ends a server
that is draining (a `python -m shardlm serve` subprocess whose engine steps are slowed)."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from helpers import save_hf

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TIMEOUT = 60


@pytest.mark.timeout(30)
def test_replicas_start_at_the_device_given(monkeypatch):
    """--device cuda:1 --replicas 2 put the first replica on cuda:1 and the second on cuda:1 too (the
    others were counted from cuda:0 whatever --device said); they must run on cuda:1 and cuda:2, and a
    range beyond the GPUs visible is refused naming it."""
    from shardlm.config import ConfigError
    from shardlm.serve.command import _replica_devices
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert _replica_devices(2, 1, torch.device("cuda", 1)) == [torch.device("cuda", 1), torch.device("cuda", 2)]
    assert _replica_devices(3, 1, torch.device("cuda")) == [torch.device("cuda", i) for i in range(3)]
    with pytest.raises(ConfigError, match=r"--replicas 3 needs one GPU each from cuda:1 on \(cuda:1 to cuda:3\); "
                                          r"3 are visible"):
        _replica_devices(3, 1, torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"; 1 is visible: "):
        _replica_devices(2, 1, torch.device("cuda"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("device, said", [("auto", "no GPU is visible to this process"),
                                          ("cpu", "this server runs on the CPU (--device cpu)")])
def test_replicas_without_a_gpu_are_refused_before_the_model_loads(device, said, tmp_path, monkeypatch, capsys):
    """--replicas 2 on a host without GPUs (or with --device cpu) loaded two copies of the model on the CPU,
    where they share its cores and serve no faster, without a word; a user expects one replica per GPU."""
    import shardlm.inference as inference
    from shardlm.cli import main
    save_hf("llama", tmp_path / "llama")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(inference, "load_pretrained", lambda *a, **k: pytest.fail("the model loaded"))
    capsys.readouterr()
    status = main(["serve", "--model", str(tmp_path / "llama"), "--port", "0", "--replicas", "2",
                   "--device", device])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err, err
    assert err.startswith("shardlm serve: error: --replicas 2 puts one copy of the model on each GPU, but ") and \
        said in err and "leave --replicas out" in err, err


SLOWED = """import sys, time
import shardlm.inference as inf
step = inf.Engine.step
def slowed(self, *a, **k):  # 0.2 s a step: a 100-token answer is still running at the second signal
    time.sleep(0.2)
    return step(self, *a, **k)
inf.Engine.step = slowed
from shardlm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def started(proc) -> int:
    """The port a `serve --port 0` subprocess names in its start-up line, once it does."""
    for line in proc.stdout:
        found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        if found:
            return int(found.group(1))
    raise AssertionError("the server did not start")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_ctrl_c_while_draining_ends_the_server_with_one_line(tmp_path):
    """Ctrl-C drains; a second, with a request still running, ends the process at once, by that signal, with
    one line. uvicorn re-raised it under asyncio's SIGINT handler, which cancelled every task: the lifespan's
    and the running request's CancelledError tracebacks came first."""
    save_hf("llama", tmp_path / "llama")
    proc = subprocess.Popen([sys.executable, "-c", SLOWED, "serve", "--model", str(tmp_path / "llama"), "--port", "0",
                             "--compile", "off"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = started(proc)
        def ask():  # cut off by the second signal: its disconnection is the expected end
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                           json={"prompt": "To", "max_tokens": 100, "temperature": 0}, timeout=TIMEOUT)
        running = threading.Thread(target=ask, daemon=True)
        running.start()
        time.sleep(2)
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            if "draining 1 request(s)" in line:
                break
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT) == -signal.SIGINT
        rest = proc.stdout.read()
        assert "Traceback" not in rest and "signal 2 again: exiting now, 1 request(s) cut off" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
