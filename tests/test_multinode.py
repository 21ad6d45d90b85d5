"""examples/multinode.sh on one machine as two "nodes": two torchrun launches (--nnodes 2, --node-rank 0 and 1)
meeting at a c10d rendezvous on 127.0.0.1, one gloo rank each, train `tiny` data-parallel into one run directory;
launched again, the same command resumes it."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import TEXT
from shardlm.checkpoint import complete_checkpoints
from shardlm.testing.distributed import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "multinode.sh"


def _two_nodes(run, data, steps, port):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NNODES": "2", "GPUS_PER_NODE": "1",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "RUN_ID": f"test-{port}", "CUDA_VISIBLE_DEVICES": ""}
    args = ["tiny", "--parallel.dp", "2", "--train.device", "cpu", "--train.steps", str(steps), "--data.path", str(data),
            "--train.tensorboard", "false", "--train.sample_tokens", "0", "--out", str(run)]
    nodes = [subprocess.Popen(["bash", str(SCRIPT), *args], env={**env, "NODE_RANK": str(rank)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outs = []
    for node in nodes:
        try:
            outs.append(node.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.kill()
            raise
    for node, out in zip(nodes, outs):
        assert node.returncode == 0, out[-3000:]
    return outs


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_two_nodes_over_localhost_train_and_resume(tmp_path):
    from shardlm.data.prepare import prepare
    (tmp_path / "text.txt").write_text(TEXT * 4)
    prepare([tmp_path / "text.txt"], "byte", tmp_path / "data", progress=False)
    run = tmp_path / "run"
    outs = _two_nodes(run, tmp_path / "data", 2, free_port())
    assert any("DDP over 2 ranks" in out for out in outs), outs
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]
    _two_nodes(run, tmp_path / "data", 3, free_port())  # the script resumes a directory that holds a checkpoint
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
