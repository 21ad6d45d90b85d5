"""The NVMe tier of optimizer offload (Rajbhandari et al. 2021, "ZeRO-Infinity"): a rank's fp32 masters and
optimizer moments, and with parameter offload its 16-bit shards (parallel/zero3.py), kept in files under
`parallel.offload_dir` instead of host memory, and streamed through host buffers by direct I/O at each step
(DeepSpeed's async I/O bypasses the page cache the same way).
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..config import ConfigError
from ..kernels import adamw_master_step, sgd_master_step
from .offload import OffloadedOptimizer


class MappedFiles:
    """Tensors kept in files under `parallel.offload_dir` (ZeRO-Infinity's NVMe tier): each file's blocks are
    reserved up front (a full disk is a ConfigError naming the directory, not a SIGBUS when a page is first
    written), mapped as a tensor (torch.from_file, shared), and unlinked at once, so nothing is left behind
    when the process ends; the descriptors close, and the space is freed, when this object goes."""

    def __init__(self, directory: str):
        # "~/nvme" in a TOML file (no shell to expand it) made a directory named "~" here, on another disk, unsaid
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # mkdir says "File exists" of a file, which reads as if the directory were fine
            why = "a file, not a directory" if self.directory.is_file() else e.strerror
            raise ConfigError(f"parallel.offload_dir = {directory!r}: {why}") from None
        self.fds: dict[str, int] = {}
        self.mapped: dict[str, torch.Tensor] = {}
        weakref.finalize(self, _close_all, self.fds)

    def tensor(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        size = n * torch.empty((), dtype=dtype).element_size()
        fd = path = None
        try:
            # A name of its own (O_EXCL): runs in other containers on one host's disk share pids, and a pid-named
            # file was truncated and unlinked by the other run between its creation and its mapping.
            fd, path = tempfile.mkstemp(prefix=f"shardlm-{name}-", suffix=".bin", dir=self.directory)
            # Unlinked at once, the descriptor keeping the data: a process killed while a filesystem without
            # fallocate writes every block (minutes for tens of GB) left the whole file behind for good.
            os.unlink(path)
            if size:
                os.posix_fallocate(fd, 0, size)
            mapped = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=n, dtype=dtype)
        except (OSError, RuntimeError) as e:
            if fd is not None:
                os.close(fd)
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise ConfigError(f"parallel.offload_dir = {str(self.directory)!r}: {why} ({size / 2**30:.2f} GiB "
                              f"for {name})") from None
        self.fds[name] = fd
        self.mapped[name] = mapped
        return mapped

    def release(self) -> None:
        """The files' pages out of this process's memory and out of the page cache, written back first: what
        was written or read through the mappings (a build, a load) would otherwise stay resident until the
        kernel needs the room, and show as this process's memory."""
        for name, t in self.mapped.items():
            os.fsync(self.fds[name])
            _drop_mapped_pages(t)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fds[name], 0, 0, os.POSIX_FADV_DONTNEED)


class DiskOffloadedOptimizer(OffloadedOptimizer):
    """ZeRO-Infinity's NVMe tier (Rajbhandari et al. 2021): this rank's fp32 masters and optimizer moments live
    in files under `parallel.offload_dir` (MappedFiles), not in host memory. A step streams them through two
    sets of segment-sized host buffers: while one segment is updated, a pool of `IO_THREADS` threads reads the
    next one and writes the previous one back (double buffering). The streaming bypasses the page cache
    (O_DIRECT, as DeepSpeed's async I/O does): buffered, a host with room would keep every file in its page
    cache, so the host memory the tier exists to save would be spent after all and the rate logged would be
    memory's, not the disk's. Where the filesystem refuses direct I/O (a read of one block at the start says
    so), it is buffered and `direct_io` is False. The build and checkpointing read and write the files'
    mappings like any other tensor, never while a step's I/O is in flight; after the build and a load the
    mapped pages are written back and dropped (MappedFiles.release), so that they hold no host memory.
    `disk_bytes_per_s`: the last step's I/O rate."""

    IO_THREADS = 4

    def __init__(self, *args, directory: str, **kwargs):
        self.files = MappedFiles(directory)  # the files' space is freed with the optimizer
        self.fds = self.files.fds
        self.io = ThreadPoolExecutor(self.IO_THREADS, thread_name_prefix="shardlm-offload-io")
        self.disk_bytes_per_s = 0.0
        super().__init__(*args, **kwargs)
        self.files.release()  # the masters written through the mappings: the steps reach the files directly
        self.direct = {k: _open_direct(fd) for k, fd in self.fds.items()}
        self.direct_io = all(fd is not None for fd in self.direct.values())
        weakref.finalize(self, _close_all, {k: fd for k, fd in self.direct.items() if fd is not None})
        big = max(seg.hi - seg.lo for seg in self.segments) if self.segments else 0
        # A block more than the largest segment: each segment's view starts where its file offset's alignment
        # puts it (_aligned), so that its whole blocks move by direct I/O straight from the buffer.
        self.work = [{k: torch.empty(big + DIRECT_BLOCK // 4, dtype=torch.float32) for k in self.fds}
                     for _ in range(2)]

    def _state_buffer(self, name: str, n: int, home: torch.device) -> torch.Tensor:
        return self.files.tensor(name, n, torch.float32)

    def _zeroed_state_buffer(self, name: str, n: int, home: torch.device) -> torch.Tensor:
        return self._state_buffer(name, n, home)  # a file's reserved blocks read as zeros: none written

    def load(self, masters: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        super().load(masters, state)
        # The 16-bit shards made in host memory before the files' pages are dropped (taken lazily on the device,
        # each bucket would read its masters back from disk after).
        weights = [m.to(self.flat.dtype) for m in self.master_parts]
        self.files.release()
        return weights

    def _segment(self, slot: dict, seg) -> tuple[int, dict[str, torch.Tensor]]:
        """Where `seg` lies in the files (its byte offset), and its view of each of `slot`'s buffers."""
        offset = (self.master_off[seg.bucket] + seg.lo) * 4
        return offset, {k: _aligned(buf, offset, seg.hi - seg.lo) for k, buf in slot.items()}

    def _io(self, write: bool, slot: dict, seg) -> list:
        """Read (or write) one segment of every file into (from) `slot`'s buffers, a task per file."""
        offset, views = self._segment(slot, seg)
        return [self.io.submit(_segment_io, write, fd, self.direct[k], memoryview(views[k].numpy()).cast("B"),
                               offset) for k, fd in self.fds.items()]

    def _update_on_host(self, lr: float, grads: list, staged: list, scale: torch.Tensor, skip: torch.Tensor,
                        landed=None) -> None:
        start, moved = time.perf_counter(), 0
        segs = self.segments
        reads = {0: self._io(False, self.work[0], segs[0])} if segs else {}
        writes: dict[int, list] = {}
        submitted = list(reads.get(0, []))
        try:
            for i, seg in enumerate(segs):
                slot = self.work[i % 2]
                for f in reads.pop(i):
                    f.result()
                if i + 1 < len(segs):  # the other slot is free once the segment before this one is written
                    for f in writes.pop(i - 1, []):
                        f.result()
                    reads[i + 1] = self._io(False, self.work[(i + 1) % 2], segs[i + 1])
                    submitted += reads[i + 1]
                self._update(lr, seg, self._segment(slot, seg)[1], grads, staged, scale, skip)
                if landed is not None and (i + 1 == len(segs) or segs[i + 1].bucket != seg.bucket):
                    landed(seg.bucket)
                writes[i] = self._io(True, slot, seg)
                submitted += writes[i]
                moved += 2 * (seg.hi - seg.lo) * 4 * len(self.fds)
        finally:  # no transfer outlives the step, also when one failed: the buffers and descriptors stay theirs
            errors = [f.exception() for f in submitted]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        self.disk_bytes_per_s = moved / max(time.perf_counter() - start, 1e-9)

    def _update(self, lr, seg, views, host, staged, scale, skip) -> None:
        """The optimizer on one segment, held in `views` (_segment's)."""
        cfg, b = self.cfg, seg.bucket
        sl = slice(seg.lo, seg.hi)
        out = None if staged[b] is None else staged[b][sl]
        args = (views["master"], out, host[b][sl])
        if cfg.optimizer == "adamw":
            adamw_master_step(*args, views["exp_avg"], views["exp_avg_sq"], scale, skip,
                              step=self.steps_taken, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                              weight_decay=seg.weight_decay, consume_grad=True, host_kernel=True)
        else:
            sgd_master_step(*args, views["momentum_buffer"], scale, skip, step=self.steps_taken, lr=lr,
                            momentum=cfg.momentum, weight_decay=seg.weight_decay)


# Direct I/O moves whole blocks from and to block-aligned memory: 4 KiB serves disks of 512-byte and 4K sectors.
# At least a page: where a page holds several blocks, a segment's edge block (written through the page cache)
# and its neighbour's whole blocks (written past it) would share one page, which the direct write could not
# invalidate while the buffered one dirties it.
DIRECT_BLOCK = max(4096, mmap.PAGESIZE)


def _open_direct(fd: int) -> int | None:
    """A second descriptor of `fd`'s file (unlinked already: reopened through /proc) that bypasses the page
    cache, or None where the OS or the filesystem has no direct I/O: some filesystems refuse the open, others
    accept it and refuse the transfers, so one aligned block is read to find out."""
    if not hasattr(os, "O_DIRECT") or os.fstat(fd).st_size < DIRECT_BLOCK:
        return None
    try:
        direct = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_DIRECT)
    except OSError:
        return None
    with mmap.mmap(-1, DIRECT_BLOCK) as block:  # an anonymous mapping: page-aligned memory
        try:
            os.preadv(direct, [block], 0)
        except OSError:
            os.close(direct)
            return None
    return direct


def _aligned(buf: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """The n elements of `buf` (a block longer than n) whose address is congruent to the file `offset` modulo
    DIRECT_BLOCK: every whole block of the segment then starts at an aligned address too."""
    skip = (offset - buf.data_ptr()) % DIRECT_BLOCK // buf.element_size()
    return buf[skip:skip + n]


def _segment_io(write: bool, fd: int, direct: int | None, buf: memoryview, offset: int) -> None:
    """Read (or write) `buf` at `offset`: its whole blocks through the direct descriptor, the partial blocks at
    either end (shared with the neighbouring segments, so never written whole) through the page cache."""
    end = offset + len(buf)
    lo, hi = -(-offset // DIRECT_BLOCK) * DIRECT_BLOCK, end // DIRECT_BLOCK * DIRECT_BLOCK
    if direct is None or hi <= lo:
        lo = hi = end
    _whole_io(write, fd, buf[:lo - offset], offset)
    _whole_io(write, direct, buf[lo - offset:hi - offset], lo)
    _whole_io(write, fd, buf[hi - offset:], hi)


MADV_DONTNEED = 4  # Linux's and the BSDs' value (sys/mman.h)


def _drop_mapped_pages(t: torch.Tensor) -> None:
    """madvise(MADV_DONTNEED) over a shared file mapping's tensor: its pages leave this process (the data stays
    in the file and the page cache, and faults back in when read). Skipped where libc has no madvise."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    size = -(-t.numel() * t.element_size() // mmap.PAGESIZE) * mmap.PAGESIZE
    if size and madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(size), MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) of an offload file's mapping failed")


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


def _whole_io(write: bool, fd: int, buf: memoryview, offset: int) -> None:
    """pwritev / preadv of all of `buf`: one call moves at most about 2 GiB."""
    done = 0
    while done < len(buf):
        n = (os.pwritev if write else os.preadv)(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f"offload file: {'write' if write else 'read'} stopped at byte {offset + done}")
        done += n
