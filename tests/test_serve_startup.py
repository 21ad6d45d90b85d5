"""`shardlm serve` starting and stopping: where replicas are placed, and how a second Ctrl-C ends a server
that is draining (a `python -m shardlm serve` subprocess whose engine steps are slowed)."""
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
