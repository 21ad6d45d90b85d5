"""Pipeline point-to-point transfers by the GPUs' copy engines, for stages on the GPUs of one node.

A pipeline posts each receive ahead of the computation that reads it, and NCCL's kernel for a posted
send or receive holds SMs from its launch until its peer's arrives. A forward that runs beside a
receive waiting for its sender loses those SMs (cuBLAS's persistent GEMMs want all of them): on 4x H200,
zb-h1's forwards took 14.5-15 ms beside a pending receive against 13.4 ms without (bench/README.md).

`CopyEngineTransfers` moves a pipeline's flows (activations or gradients, one direction, between two
pipeline ranks) with no kernel at all, as comm/copy_engine.py does for the data-parallel reductions.
Each rank stages what it sends in its own symmetric buffer: two slots for activations (its one
forward destination) and two for gradients (its one backward destination). The sender copies message
k of a flow into slot k mod 2 and raises the flow's READY flag to k; the receiver's stream waits for
READY >= k in the GPU's command processor (`StreamFlags`), pulls the slot over the peer-to-peer link
into its tensor (a copy-engine copy) and raises FREED to k; the sender waits for FREED >= k - 2 before
reusing the slot. Each flow has a stream of its own at each end, so a receive posted early waits
without occupying anything, and flows do not wait for each other. The k-th send of a flow meets its
k-th receive, as on a process group, so a table that `schedules.validate` accepts runs alike on both.

The buffers are made once, collectively over the pipeline group: PyTorch's symmetric-memory
rendezvous numbers its exchanges with one counter per process, so every rank must make the same
sequence of them (one per flow, made only by the flow's two ranks, would hang), the data-parallel
engines' before (three each, whatever the stage) included.

A flag wait blocks the hardware queue its stream is mapped to, and CUDA maps streams onto
CUDA_DEVICE_MAX_CONNECTIONS queues (8 by default). Sharing one with the compute stream, a receive posted
a computation early would hold that computation back, and the peer may need its output first: a
deadlock. So the copy engines serve a pipeline only where that setting is left at 8 or more.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .collectives import copy_engines_reach
from .copy_engine import Done, PeerBuckets, StreamFlags

SLOTS = 2  # a sender stages up to two messages its receiver has not pulled yet
KINDS = ("F", "B")  # activations forward, gradients backward: a rank sends each kind to one peer
READY, FREED = 0, len(KINDS)  # flag kinds: READY + kind index, FREED + kind index
QUEUES = 8  # CUDA_DEVICE_MAX_CONNECTIONS needed: CUDA's default, under which the transfers were measured


def resolve_pp_transfer(transfer: str, group, device: torch.device) -> str:
    """`parallel.pp_transfer` here: `auto` is the copy engines where they reach every rank (one node's GPUs
    with peer access) and the hardware queues suffice, else the process group; an explicit `copy_engine`
    that cannot work is refused with the reason. Every rank decides alike."""
    queues = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", QUEUES))
    if transfer == "auto":
        usable = copy_engines_reach(group, device) and queues >= QUEUES
        return "copy_engine" if usable else "process_group"
    if transfer == "copy_engine":
        if device.type != "cuda":
            why = "CUDA GPUs (peer-to-peer copies)"
        elif not copy_engines_reach(group, device):
            why = "every rank of the job on one node's GPUs, with peer access"
        elif queues < QUEUES:
            why = (f"CUDA_DEVICE_MAX_CONNECTIONS of {QUEUES} or more (it is {queues}): a stream waiting for its peer "
                   "must not share a hardware queue with the computations")
        else:
            return transfer
        raise ValueError(f"parallel.pp_transfer = 'copy_engine' needs {why}; process_group sends through the "
                         "process group instead")
    return transfer


class CopyEngineTransfers:
    """This rank's flows over the pipeline `group` (ranks are group ranks): messages of up to `numel`
    elements of `dtype`. Every rank of the group constructs it at the same point (a collective)."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device):
        self.world = dist.get_world_size(group)
        self.numel = numel + (-numel) % self.world  # PeerBuckets: a multiple of the group's size
        self.dtype = dtype
        self.slots = PeerBuckets([self.numel] * (SLOTS * len(KINDS)), dtype, device, group)
        self.flags = StreamFlags(group, 2 * len(KINDS), device)
        self.streams: dict = {}  # flow -> its stream here
        self.count: dict = {}    # flow -> messages so far, alike at both ends
        self.peer_of: dict = {}  # (kind, "to"/"from") -> the one peer this rank sends to / receives from

    def symmetric_bytes(self) -> int:
        """Bytes in symmetric memory, which PyTorch's caching allocator (and its peak) does not count."""
        return self.slots.buffer.numel() * self.slots.buffer.element_size()

    def _next(self, kind: str, way: str, peer: int, tensor: torch.Tensor):
        """The flow's stream, message number and slot for one more message, after checking the message."""
        if tensor.dtype != self.dtype or tensor.numel() > self.numel or not tensor.is_contiguous():
            raise ValueError(f"a pipeline transfer of {tensor.dtype} {tuple(tensor.shape)} does not fit the "
                             f"contiguous slots of {self.numel} {self.dtype} elements")
        if self.peer_of.setdefault((kind, way), peer) != peer:
            raise ValueError(f"rank {self.flags.rank} has {kind} flows {way} two peers; a copy-engine slot serves one")
        flow = (kind, way, peer)
        if flow not in self.streams:
            self.streams[flow] = torch.cuda.Stream(self.slots.buffer.device)
        k = self.count[flow] = self.count.get(flow, 0) + 1
        stream = self.streams[flow]
        stream.wait_stream(torch.cuda.current_stream())  # the tensor: produced, or (a receive's) last used, there
        return stream, k, SLOTS * KINDS.index(kind) + k % SLOTS

    def send(self, kind: str, dst: int, tensor: torch.Tensor) -> Done:
        """Queue `tensor` to `dst`; keep it alive until the transfer completes."""
        stream, k, slot = self._next(kind, "to", dst, tensor)
        with torch.cuda.stream(stream):
            if k > SLOTS:  # the receiver has pulled the slot's last message
                self.flags.wait_peer(stream, dst, FREED + KINDS.index(kind), k - SLOTS)
            self.slots.bucket(slot)[:tensor.numel()].copy_(tensor.view(-1))
            self.flags.signal_peer(stream, dst, READY + KINDS.index(kind), k)
            return Done.here()

    def recv(self, kind: str, src: int, out: torch.Tensor) -> Done:
        """Queue `src`'s next message of `kind` into `out` (allocated on the current stream, read after
        `wait`)."""
        stream, k, slot = self._next(kind, "from", src, out)
        with torch.cuda.stream(stream):
            self.flags.wait_peer(stream, src, READY + KINDS.index(kind), k)
            out.view(-1).copy_(self.slots.peer_bucket(src, slot)[:out.numel()])
            self.flags.signal_peer(stream, src, FREED + KINDS.index(kind), k)
            return Done.here()
