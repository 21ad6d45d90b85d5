"""Run a function on N processes as one process group, for tests: gloo on CPU, NCCL with CUDA.

The CPU is the default everywhere: its workers see no GPU (CUDA_VISIBLE_DEVICES is emptied before
anything touches CUDA), so code that picks its device itself (`train.device auto`) stays on the CPU and
a test checked against a CPU reference means the same on a GPU machine. `device="cuda"` gives each
rank its own GPU and NCCL.

CPU workers fork from a server process that imported torch and shardlm once (multiprocessing's
forkserver; importing torch does not start CUDA) and the modules they would import lazily, so no worker
pays for those imports again (bench/README.md has what it saves). GPU workers are fresh interpreters
(spawn), so that CUDA starts in no process they fork from. Every worker takes the caller's environment
as it is at the call, joins a TCP rendezvous on a free local port, calls `fn(rank, world_size, *args)`
and sends back its return value or its traceback. The parent waits at most `timeout` seconds in total:
a rank that hangs (say, in a collective its peers never join) makes the whole call fail with a
TimeoutError after every worker is killed, so a hang fails the test instead of blocking CI.
"""
from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, backend, fn, args, results, pg_timeout, env):
    os.environ.clear()  # a forked worker holds the server's environment, from the first call
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA first initialises, which nothing has yet
    torch.set_num_threads(1)  # N workers share the machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, world, *args)
        # Tensors go back by value: torch's shared-memory handles die with this process.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedError(RuntimeError):
    """One or more ranks raised; the message holds each rank's traceback."""


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, device: str = "cpu") -> list:
    """`fn(rank, world_size, *args)` on `world_size` ranks, on the CPU (gloo) or one GPU each
    (`device="cuda"`, NCCL); returns the per-rank results in rank order.

    `fn` must be importable (a module-level function), as spawned workers import it by name.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} ranks on GPUs need {world_size} GPUs; {torch.cuda.device_count()} visible")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        # Once, when the server starts, with what workers would otherwise import each time, lazily: sympy
        # (materialising a model built on the meta device) and torch._dynamo (a second a rank, for the first
        # call of any compiler-disabled function: ring attention, MoE's probes, compiled blocks).
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes",
                                    "torch._dynamo", "shardlm.trainer", "shardlm.parallel.zero3",
                                    "shardlm.parallel.ddp", "shardlm.parallel.classic"])
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, results, timeout, env),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict[int, tuple[str, object]] = {}
    grace = 2.0  # seconds the ranks get to exit once the call is decided
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                grace = 0.0  # the ranks still running are the hung ones: nothing to wait for
                missing = sorted(set(range(world_size)) - set(got))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                                   f"(a hang, or a peer that died)" + _errors(got))
            try:
                rank, status, out = results.get(timeout=min(left, 0.5))
                got[rank] = (status, out)
                if status == "error":
                    # Give the others a moment to report their own errors, then stop waiting for them.
                    deadline = min(deadline, time.monotonic() + 5.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise DistributedError(f"ranks {dead} died without reporting (exit codes "
                                           f"{[procs[r].exitcode for r in dead]})" + _errors(got))
    finally:
        end = time.monotonic() + grace  # one grace period for all the ranks to exit, then they are killed
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    errors = _errors(got)
    if errors:
        raise DistributedError(errors)
    return [torch.load(io.BytesIO(got[r][1]), weights_only=False) for r in range(world_size)]


def _errors(got: dict) -> str:
    return "".join(f"\n--- rank {r} ---\n{out}" for r, (status, out) in sorted(got.items()) if status == "error")
