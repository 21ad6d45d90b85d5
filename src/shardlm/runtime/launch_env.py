"""The launcher's variables (torchrun's WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT;
Slurm's) read and checked before any rendezvous: one set wrong by hand, or half set by a job script, is named with
its fix here, where torch would wait for ranks never started, print C++ frames, or raise a KeyError."""
from __future__ import annotations

import os
import re

import torch

from ..config import ConfigError


def _env_int(name: str, default: int, low: int = 0, high: int | None = None,
             fix: str = "unset it to run one process, or start the ranks with torchrun, which sets it") -> int:
    """The launcher's variable `name`, named with `fix` where it is not a number in range (int() would not)."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        span = f"{low} to {high}" if high is not None else f"{low} or more"
        raise ConfigError(f"the environment variable {name} = {value!r} is not a whole number {span}: {fix}")
    return n


def world_from_env() -> tuple[int, int, int]:
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "1")
    if "WORLD_SIZE" not in os.environ and tasks.isdigit() and int(tasks) > 1:
        # `srun -n 2 python -m shardlm train`: Slurm's variables are not torch's, and each task trained alone.
        raise ConfigError(f"this is task {os.environ.get('SLURM_PROCID', '?')} of a Slurm step of {tasks} "
                          "(SLURM_STEP_NUM_TASKS), but torchrun's variables (WORLD_SIZE, RANK, MASTER_ADDR) are not "
                          "set: each task would run alone, as a job of its own. Start one `srun torchrun` task per "
                          "node (examples/slurm.sbatch), or set WORLD_SIZE=1 to run each task as its own job")
    world = _env_int("WORLD_SIZE", 1, low=1)
    # Half of a job script's variables: without RANK every process took rank 0 (C++ frames of the heartbeat's
    # store, then torch's 'environment variable RANK expected'); without WORLD_SIZE a RANK 1 ran alone, unsaid.
    if world > 1 and "RANK" not in os.environ:
        raise ConfigError(f"WORLD_SIZE = {world} but RANK is not set: start the ranks with torchrun (torchrun "
                          f"--nproc-per-node {world} -m shardlm ...), which numbers them, or set RANK to this "
                          f"process's number (0 to {world - 1})")
    if "WORLD_SIZE" not in os.environ and os.environ.get("RANK", "0") != "0":
        raise ConfigError(f"RANK = {os.environ['RANK']!r} but WORLD_SIZE is not set: unset RANK to run one process, or "
                          "start the ranks with torchrun, which sets WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT")
    # A RANK past the world (a job script's RANK=$SLURM_PROCID under WORLD_SIZE=$SLURM_NNODES) joined the
    # rendezvous as a client of a store no rank serves: screens of C++ frames, then 'a peer rank died'.
    rank = _env_int("RANK", 0, high=world - 1,
                    fix=f"the ranks of WORLD_SIZE = {world} are numbered 0 to {world - 1}, one each: start them with "
                        "torchrun, which numbers them, or set RANK to this process's number")
    _env_int("LOCAL_WORLD_SIZE", 1, low=1)  # int() of it elsewhere (memory_check, offload, ...) named no variable
    per_node = [int(n) for n in re.findall(r"\d+(?=\(|,|$)", os.environ.get("SLURM_STEP_TASKS_PER_NODE", ""))]
    if world > 1 and "LOCAL_RANK" not in os.environ and max(per_node, default=1) > 1 and torch.cuda.device_count() > 1:
        # srun's tasks given RANK and WORLD_SIZE by a job script: every task of a node took GPU 0 (NCCL's
        # "Duplicate GPU detected", said as a peer that stalled). A task shown its one GPU (--gpus-per-task 1)
        # or none (a CPU job) is right to take the first.
        raise ConfigError(f"this is task {os.environ.get('SLURM_LOCALID', '?')} on its node of a Slurm step of "
                          f"{os.environ['SLURM_STEP_TASKS_PER_NODE']} tasks per node, and LOCAL_RANK is not set: "
                          "every task of a node would take its first GPU; set LOCAL_RANK=$SLURM_LOCALID and "
                          "LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE in the task's environment, or start one "
                          "`srun torchrun` task per node (examples/slurm.sbatch), which sets them")
    return world, rank, _env_int("LOCAL_RANK", 0)


def check_rendezvous_env(world: int) -> None:
    """Before the env:// rendezvous (and the heartbeat, which reads the same variables): torch's own errors
    give no fix ('environment variable MASTER_ADDR expected, but not set'), or do not name the variable (a
    MASTER_PORT that is not a number: 'invalid literal for int()'), or are a KeyError's traceback."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"WORLD_SIZE = {world} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"set: start the ranks with torchrun (torchrun --nproc-per-node {world} -m shardlm ...), "
                          "which sets them, or set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port")
    port = _env_int("MASTER_PORT", 0, low=1, high=65535, fix="set it to a free port on rank 0's host (MASTER_ADDR)")
    _check_master_addr(os.environ["MASTER_ADDR"], port)
    if _env_int("RANK", 0) == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _check_store_port(port)


def _check_master_addr(host: str, port: int) -> None:
    """A MASTER_ADDR that names no host (a typo, a name only another network resolves): TCPStore's clients retried it
    for all of parallel.timeout_s (600 s), printing screens of C++ warnings, then blamed 'a peer rank died or
    stalled'. Only a name the resolver says does not exist is refused: a resolver that fails for now (EAI_AGAIN) is
    left to the rendezvous, which retries."""
    import socket
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno not in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return
        raise ConfigError(f"MASTER_ADDR = {host!r} does not resolve to an address ({e.strerror}): set it to rank 0's "
                          "host name or IP address, the same on every rank") from None


def _check_store_port(port: int) -> None:
    """Rank 0 started by hand listens on MASTER_PORT for the others (torchrun's agent listens there itself):
    TCPStore's own failure on a port in use is a screen of C++ frames, then 'a peer rank died or stalled'
    (train) or a DistNetworkError traceback (generate --tp). Bound as TCPStore binds it, with SO_REUSEADDR."""
    import errno
    import socket
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # not ours to judge (no IPv4, permissions and the like): the rendezvous says it
        raise ConfigError(f"MASTER_PORT = {port} is in use on this host (another job, or a server, listens "
                          "there), and rank 0 listens on it for the others: set MASTER_PORT to a free port, the "
                          "same on every rank") from None
