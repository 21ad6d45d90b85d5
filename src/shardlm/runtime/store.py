"""A client of the job's store that cannot hang: torch's TCPStore, which rank 0 (or torchrun's agent) serves at
MASTER_ADDR:MASTER_PORT for the rendezvous, the heartbeats and the farewells.

torch's client connects, then waits for the store's answer to a ping with no limit, whatever its timeout: where
something else accepts connections at that address and never answers (a stopped or hung process of an earlier
job still holding the port, another service), every rank but the first waited there forever, in silence. The
client is made in a thread here and given up after its own timeout (torch's c10d, 2.11-2.13). The thread is left
blocked in its read (a daemon, which the process's exit ends; a listener that resets the connection while this
process exits may make the exit an abort instead)."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

ANSWER_S = 30.0  # a live store answers a connected client in milliseconds


class StoreSilent(RuntimeError):
    """Something accepts connections at the store's address but does not answer as torch's store; `thread` is
    the client's, still waiting for the answer."""

    def __init__(self, message: str, thread: threading.Thread):
        super().__init__(message)
        self.thread = thread


def store_client(host: str, port: int, world: int, seconds: float, probe: bool = False):
    """torch's TCPStore client of the store at host:port, `seconds` its timeout (connecting and each request);
    StoreSilent where the client is not made within it. `probe`: refused at once where nothing listens yet (a
    rank started before rank 0), where torch's client retries to its timeout, printing C++ warnings at each try."""
    if probe:
        socket.create_connection((host, port), timeout=seconds).close()
    made: dict = {}

    def make() -> None:
        try:
            made["store"] = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=seconds))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            made["error"] = e

    thread = threading.Thread(target=make, name="shardlm-store-client", daemon=True)
    thread.start()
    thread.join(seconds + 1.0)  # left blocked where it hangs: a daemon, which the process's exit ends
    if thread.is_alive():
        raise StoreSilent(f"{host}:{port} accepts connections but did not answer as torch's store within "
                          f"{seconds:.0f} s", thread)
    if "error" in made:
        raise made["error"]
    return made["store"]


def store_answers(host: str, port: int, world: int, timeout: float) -> bool:
    """Before a rank other than the first joins the rendezvous: whether something listens at host:port within
    `timeout` (rank 0 may start later); what listens must then answer as a store within ANSWER_S, StoreSilent
    otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout)).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)
    store_client(host, port, world, min(ANSWER_S, max(1.0, deadline - time.monotonic())))
    return True
