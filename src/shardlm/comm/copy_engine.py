"""Collectives by the GPUs' copy engines over symmetric memory, on the GPUs of one node.

`CopyEngineAllReduce` (DDP) takes the SMs out of the traffic: the gradient buckets live in symmetric
memory (every rank maps its peers' buffers), and each rank pulls its slice of every peer's bucket with
peer-to-peer copies, which the copy engines run; sums them in fp32 (one small kernel, whatever
`parallel.reduce_dtype` says: a 16-bit sum accumulates in fp32 anyway); and pulls the peers' summed
slices back. The phases are ordered across GPUs by flags that the GPUs' command processors write and
wait on (`StreamFlags`), so no kernel spins either. NCCL's kernels instead hold an SM per channel while
they run, and cuBLAS's persistent GEMMs, one CTA per SM, wait for those SMs: overlapped with backward,
NCCL's reduction slows it down (bench/README.md has the measurements). PyTorch's "low-contention"
collectives (torch.distributed._symmetric_memory) and nvFuser's CUDA-IPC transport work the same way.
`CopyEngineZero` splits the same transfers into ZeRO's reduce-scatter (during backward) and its
all-gathers of the weights (ZeRO-1/2's of the updated weights during the next forward, ZeRO-3's of each
unit around its use).
"""
from __future__ import annotations

import ctypes
import itertools
import warnings

import torch
import torch.distributed as dist

from ..grad_norm import SliceSquares
from ..kernels import sum_over_ranks


class Done:
    """Work finished by a side stream at `event`: `wait` makes the current stream wait for it (the CPU does not
    block), `is_completed` asks without waiting, as a process group's works do."""

    def __init__(self, event):
        self.event = event

    def wait(self):
        torch.cuda.current_stream().wait_event(self.event)

    def is_completed(self) -> bool:
        return self.event.query()

    @classmethod
    def here(cls) -> "Done":
        """The work queued so far on the current stream."""
        event = torch.cuda.Event()
        event.record()
        return cls(event)


class StreamFlags:
    """Cross-GPU flags set and awaited by the GPUs' command processors, not by kernels: `signal` writes a
    value into every peer's flag slot (cuStreamWriteValue32, fenced so that the stream's earlier writes
    are visible first) and `wait` holds the stream until every peer's slot has reached it
    (cuStreamWaitValue32). A barrier kernel would spin on an SM for as long as the slowest peer lags,
    and a persistent GEMM that wants every SM waits for that one (nvFuser's CUDA-IPC transport syncs the
    same way). Values grow monotonically and compare cyclically, so slots are never reset."""

    WAIT_GEQ = 0x0

    def __init__(self, group, kinds: int, device: torch.device):
        from torch.distributed import _symmetric_memory as symm_mem
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        cuda = ctypes.CDLL("libcuda.so.1")
        self._write, self._wait = cuda.cuStreamWriteValue32_v2, cuda.cuStreamWaitValue32_v2
        for fn in (self._write, self._wait):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        self.slots = symm_mem.empty(kinds * self.world, dtype=torch.int32, device=device)
        self.slots.zero_()
        torch.cuda.synchronize(device)  # zeroed before any peer can signal into it
        self.handle = symm_mem.rendezvous(self.slots, group)  # held: it keeps the peers' slots mapped
        self.ptrs = self.handle.buffer_ptrs

    def _addr(self, owner: int, kind: int, src: int) -> int:
        return self.ptrs[owner] + 4 * (kind * self.world + src)

    def signal(self, stream, kind: int, value: int) -> None:
        for j in range(self.world):
            if j != self.rank:
                self.signal_peer(stream, j, kind, value)

    def wait(self, stream, kind: int, value: int) -> None:
        for j in range(self.world):
            if j != self.rank:
                self.wait_peer(stream, j, kind, value)

    def signal_peer(self, stream, peer: int, kind: int, value: int) -> None:
        """Write `value` into `peer`'s slot for this rank (point-to-point: one peer hears it)."""
        self._check(self._write(stream.cuda_stream, self._addr(peer, kind, self.rank), value, 0), "Write")

    def wait_peer(self, stream, peer: int, kind: int, value: int) -> None:
        """Hold `stream` until `peer` has signalled `kind` up to `value`."""
        self._check(self._wait(stream.cuda_stream, self._addr(self.rank, kind, peer), value, self.WAIT_GEQ), "Wait")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"cuStream{what}Value32 failed with CUresult {rc}")


def start_copy_engine(cls, *args, **kwargs):
    """`cls(...)`, a copy-engine collective, or an error saying what still works where it cannot be set
    up (no symmetric memory in this driver or container)."""
    try:
        return cls(*args, **kwargs)
    except Exception as e:
        raise RuntimeError(f"the copy-engine gradient reduction could not be set up ({e}); "
                           "--parallel.reduce_algo all_to_all reduces through the process group instead") from e


def _ring_place(numels: list[int], size: int) -> list[int]:
    offsets, pos = [], 0
    for n in numels:
        if pos + n > size:
            pos = 0
        offsets.append(pos)
        pos += n
    return offsets


def _windows_disjoint(numels: list[int], offsets: list[int], window: int) -> bool:
    for b in range(len(numels)):
        spans = sorted((offsets[c], offsets[c] + numels[c]) for c in range(b, min(b + window, len(numels))))
        if any(a[1] > z[0] for a, z in zip(spans, spans[1:])):
            return False
    return True


def ring_offsets(numels: list[int], window: int) -> tuple[list[int], int]:
    """Buckets placed one after another in a ring, wrapping to its start where the next one does not fit:
    (offsets, ring size), the ring just large enough that any `window` consecutive buckets occupy disjoint
    ranges. The largest window's sum, plus the largest bucket (room for one wrap's unused tail), always
    is; a smaller size often is too (buckets of equal sizes wrap with no tail), and is taken where it is."""
    widest = max(sum(numels[i:i + window]) for i in range(len(numels)))
    safe = min(sum(numels), widest + max(numels))
    for size in sorted({widest + d for d in (0, *numels)}):
        if size < safe:
            offsets = _ring_place(numels, size)
            if _windows_disjoint(numels, offsets, window):
                return offsets, size
    return _ring_place(numels, safe), safe


class PeerBuckets:
    """Buckets in one symmetric buffer (back to back, or at given `offsets` within `size` elements, which may
    overlap: a ring whose ranges are reused): every rank of `group` maps its peers' copies, so the copy
    engines can pull a peer's slice of a bucket straight into local memory. Each bucket's numel is a
    multiple of the world size; slice r of a bucket is rank r's (the one it sums, or the one it updates)."""

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device, group,
                 offsets: list[int] | None = None, size: int | None = None):
        from torch.distributed import _symmetric_memory as symm_mem
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.offsets = offsets if offsets is not None else [0, *itertools.accumulate(numels)][:-1]
        self.numels, self.dtype = numels, dtype
        self.buffer = symm_mem.empty(size if size is not None else sum(numels), dtype=dtype, device=device)
        self.buffer.zero_()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():  # deprecated (unneeded) from torch 2.9; torch 2.8 needs it
                warnings.simplefilter("ignore")
                enable(group.group_name)
        self.handle = symm_mem.rendezvous(self.buffer, group)  # held: it keeps the peers' buffers mapped
        # Ranks start at different peers, spreading the load over the links.
        self.peers = [(self.rank + k) % self.world for k in range(1, self.world)]

    def bucket(self, b: int) -> torch.Tensor:
        return self.buffer[self.offsets[b]:self.offsets[b] + self.numels[b]]

    def slice(self, b: int, j: int) -> torch.Tensor:
        """Slice j of this rank's bucket b."""
        n = self.numels[b] // self.world
        return self.bucket(b)[j * n:(j + 1) * n]

    def _peer_slice(self, j: int, b: int, k: int) -> torch.Tensor:
        """Slice k of peer j's bucket b, read over the peer-to-peer link."""
        n = self.numels[b] // self.world
        return self.handle.get_buffer(j, (n,), self.dtype, self.offsets[b] + k * n)

    def peer_bucket(self, j: int, b: int) -> torch.Tensor:
        """Peer j's whole bucket b, read over the peer-to-peer link."""
        return self.handle.get_buffer(j, (self.numels[b],), self.dtype, self.offsets[b])

    def pull_own_slices(self, b: int) -> torch.Tensor:
        """The reduce-scatter's transfers: a (world, n) tensor whose row j is peer j's copy of this rank's
        slice of bucket b (row `rank` is left unset: this rank's own copy stays in place)."""
        rows = torch.empty(self.world, self.numels[b] // self.world, dtype=self.dtype, device=self.buffer.device)
        for j in self.peers:
            rows[j].copy_(self._peer_slice(j, b, self.rank))
        return rows

    def pull_peer_slices(self, b: int) -> None:
        """The all-gather's transfers: every peer's own slice of bucket b into its place here."""
        for j in self.peers:
            self.slice(b, j).copy_(self._peer_slice(j, b, j))


class _CopyEngineCollective:
    """Flags shared by the copy-engine collectives: `_all(kind)` holds `stream` until every rank has
    reached point `kind` of the current launch (`seq`, which every rank advances alike)."""

    def __init__(self, group, kinds: int, device: torch.device, stream):
        if device.type != "cuda":
            raise ValueError("parallel.reduce_algo = 'copy_engine' needs CUDA GPUs (peer-to-peer copies)")
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.stream = stream
        self.flags = StreamFlags(group, kinds, device)
        self.seq = 0

    def symmetric_bytes(self) -> int:
        """Bytes in symmetric memory, which PyTorch's caching allocator (and its peak) does not count."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in vars(self).values() if isinstance(b, PeerBuckets))

    def _all(self, kind: int) -> None:
        self.flags.signal(self.stream, kind, self.seq)
        self.flags.wait(self.stream, kind, self.seq)


class CopyEngineAllReduce(_CopyEngineCollective):
    """Bucketed all-reduce over symmetric memory with copy-engine transfers (see the module docstring).
    `grads` holds the gradient buckets (the engine's gradients live there); `launch(b)` queues bucket b's
    reduction on `stream` after the current stream's work and returns a waitable. Buckets must be
    launched in the same order on every rank, the last one last. A peer that never signals leaves the
    stream waiting for ever: whoever runs the steps watches them (the trainer's `Watchdog`)."""

    READY, SUMMED, DONE = range(3)  # flag kinds

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device, group, stream):
        super().__init__(group, 3, device, stream)
        self.grads = PeerBuckets(numels, dtype, device, group)
        self.last = len(numels) - 1
        # The squares of this rank's summed slices (see SliceSquares), valid once the last bucket's launch
        # completes; the optimizer adds the ranks' (optim.py). `squares = None` leaves them to the optimizer
        # (for measuring what this is worth).
        self.squares = SliceSquares([self.grads.slice(b, self.rank) for b in range(len(numels))])
        self.sumsq = torch.zeros((), dtype=torch.float32, device=device)

    def launch(self, b: int):
        self.seq += 1
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._all(self.READY)  # every rank's bucket b is complete
            rows = self.grads.pull_own_slices(b)
            # Only this rank reads its own slice, so the sum may overwrite it now.
            own = self.grads.slice(b, self.rank)
            sum_over_ranks(rows, own, self.rank, own)
            if self.squares is not None:
                self.squares.add(b)
                if b == self.last:
                    self.squares.rank_total(out=self.sumsq)
            self._all(self.SUMMED)  # every summed slice is in place, and every peer is done reading ours
            self.grads.pull_peer_slices(b)
            if b == self.last:
                # Peers read our summed slices until here; the buffers may change (zero_grad) only after.
                self._all(self.DONE)
            return Done.here()


class CopyEngineZero(_CopyEngineCollective):
    """ZeRO's collectives by the copy engines, as DDP's all-reduce above is made of them. During backward
    each gradient bucket is reduce-scattered as soon as it is complete (`reduce_scatter`): this rank pulls
    its slice of every peer's bucket and sums them in fp32 into its gradient shard. The SMs stay with
    forward and backward, which NCCL's kernels would slow (see the module docstring).

    Stages 1, 2: after the optimizer has updated this rank's slices of the 16-bit weights (`params`, whole
    buckets in symmetric memory), `all_gather` pulls every peer's updated slices, bucket by bucket in the
    order given (the order the next forward reads them), and leaves them in flight. Stage 1 keeps every
    gradient bucket in symmetric memory (`grads`, the whole gradient).

    Stage 2 (`window`: how many consecutive buckets may be in use at once) stages a bucket's gradients in
    symmetric memory only while it is reduced, in a ring (`ring_offsets`): the ranks then also agree that
    every peer is done reading a bucket before its range may be reused, so gradient memory stays at the
    shard plus the ring. Stage 3 reduces its units the same way.

    Stage 3 (`gather_slots`): `gather` assembles a unit whenever forward or backward needs it, on a stream
    of its own. Each rank puts its 16-bit slice (cast from wherever it lives: the fp32 master, a 16-bit
    shard, the CPU) into the next of a few small symmetric slots, and every rank pulls the peers' slots.
    No 16-bit copy of the weights is kept at rest (as FSDP2 keeps none): gathers in flight are bounded by
    the slots, and a slot is refilled only once every peer has read it."""

    READY, REDUCED, UPDATED, GATHERED = range(4)  # flag kinds

    def __init__(self, numels: list[int], dtype: torch.dtype, device: torch.device, group, stream,
                 window: int | None = None, gather_slots: int = 0):
        super().__init__(group, 4, device, stream)
        ring = ring_offsets(numels, window) if window is not None else (None, None)
        self.grads = PeerBuckets(numels, dtype, device, group, *ring)
        if gather_slots:
            self.slots = PeerBuckets([max(numels) // self.world] * gather_slots, dtype, device, group)
            self.gather_stream = torch.cuda.Stream(device)
            self.gathers = 0  # issued so far, alike on every rank: gather k uses slot k % gather_slots
        else:
            self.params = PeerBuckets(numels, dtype, device, group)
        self.staged = window is not None
        self.last = len(numels) - 1

    def reduce_scatter(self, b: int, out: torch.Tensor) -> Done:
        """Queue bucket b's reduction into `out` (this rank's slice, any float dtype; it may be that slice
        of the bucket itself) after the current stream's work; buckets in the same order on every rank."""
        self.seq += 1
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._all(self.READY)  # every rank's bucket b is complete
            rows = self.grads.pull_own_slices(b)
            sum_over_ranks(rows, self.grads.slice(b, self.rank), self.rank, out)
            if self.staged or b == self.last:
                # Peers are done reading our bucket: its range may be reused (stage 2) or zeroed (stage 1).
                self._all(self.REDUCED)
            return Done.here()

    def all_gather(self, order: list[int]) -> dict[int, Done]:
        """Stages 1, 2: queue the all-gather of every bucket's updated slices, in `order`, after the
        current stream's work (the optimizer's); returns a waitable per bucket."""
        self.seq += 1
        self.stream.wait_stream(torch.cuda.current_stream())
        done = {}
        with torch.cuda.stream(self.stream):
            self._all(self.UPDATED)  # every rank's slices hold this step's weights
            for b in order:
                self.params.pull_peer_slices(b)
                done[b] = Done.here()
            # Peers read our slices until here: the next step's optimizer may overwrite them only after.
            self._all(self.GATHERED)
            done[order[-1]] = Done.here()
        return done

    def gather(self, src: torch.Tensor, out: torch.Tensor) -> Done:
        """Stage 3: queue the all-gather of a unit into `out` (a local buffer, rank r's slice at r), this
        rank's slice read from `src` (any dtype, any device) after the current stream's work; every rank
        gathers the same units in the same order. Returns a waitable."""
        self.gathers += 1
        k, slots = self.gathers, len(self.slots.numels)
        slot, n = k % slots, out.numel() // self.world
        stream = self.gather_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if k > slots:
                self.flags.wait(stream, self.GATHERED, k - slots)  # every peer has read the slot's last unit
            mine = self.slots.bucket(slot)[:n]
            mine.copy_(src)
            self.flags.signal(stream, self.UPDATED, k)
            self.flags.wait(stream, self.UPDATED, k)  # every peer's slice is in its slot
            rows = out.view(self.world, n)
            rows[self.rank].copy_(mine)
            for j in self.slots.peers:
                rows[j].copy_(self.slots.peer_bucket(j, slot)[:n])
            self.flags.signal(stream, self.GATHERED, k)
            return Done.here()
