"""A row-parallel linear's one-row product and its all-reduce as one kernel (tensor-parallel batch-1 decode).

At tp 2 a decode token all-reduces twice a layer a vector of a few kilobytes, each the sum of the ranks'
partial products of a row-parallel linear (the attention's output projection, the MLP's down projection).
Done apart, that is cuBLAS's GEMV, a copy of its output into symmetric memory and the one-shot all-reduce
kernel (one_shot.py): three launches, two of them waiting on latency, the sum costing about two-thirds of
what the weights' reading costs on two H200s (bench/README.md). Here one Triton kernel does all of it, as
the GEMV + all-reduce of PyTorch's symmetric-memory recipes (yifuwang/symm-mem-recipes) and TensorRT-LLM's
fused all-reduce do: each program computes a few outputs and stores them straight into every rank's
symmetric buffer (slot `rank`, over NVLink); the last program to finish on a rank (counted on a device
counter, which it sets back to zero: nothing to reset between calls, so a CUDA graph replays it as it is)
meets the peers at a barrier on the buffer's signal pad and sums the slots of its own buffer in rank order.

The barrier is the one torch's one-shot kernel and the recipes use: each rank sets its flag in every peer's
pad (compare-and-swap 0 -> 1, release at system scope) and waits for every peer's flag in its own (1 -> 0,
acquire), so the pad is all zeros again afterwards. A rank refills a buffer's slots only after the next call's
barrier, which the peers reach only after summing the previous call's: two buffers taken in turn (the two
row-parallel linears of a block) are never overwritten while read.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import on_device, triton

# (BN outputs a program, BK inputs a step, warps): from an H200 sweep over llama2-7b's row-parallel shapes
# at tp 2 (bench/README.md).
LAUNCH = (8, 512, 8)

if triton is not None and hasattr(torch.library, "custom_op"):
    import triton.language as tl

    from ..model.gemv import gemv_tile

    @triton.jit
    def _barrier(pads_ptr, RANK: tl.constexpr, WORLD: tl.constexpr):
        """Every rank's stores so far (released at system scope) seen by this program (acquired) once all have
        come: each rank sets its flag in every pad, 0 -> 1, and clears the peers' in its own, 1 -> 0."""
        mine = tl.load(pads_ptr + RANK).to(tl.pointer_type(tl.int32))
        for r in tl.static_range(WORLD):
            pad = tl.load(pads_ptr + r).to(tl.pointer_type(tl.int32))
            old = tl.atomic_cas(pad + RANK, 0, 1, sem="release", scope="sys")
            while old != 0:
                old = tl.atomic_cas(pad + RANK, 0, 1, sem="release", scope="sys")
        for r in tl.static_range(WORLD):
            old = tl.atomic_cas(mine + r, 1, 0, sem="acquire", scope="sys")
            while old != 1:
                old = tl.atomic_cas(mine + r, 1, 0, sem="acquire", scope="sys")
        tl.debug_barrier()  # the acquire before any thread's loads

    @triton.jit
    def _sum_slots(y_ptr, buffers_ptr, RANK: tl.constexpr, WORLD: tl.constexpr, N: tl.constexpr, BR: tl.constexpr):
        """y = the sum of the ranks' partial vectors, pushed into the slots of this rank's buffer, in rank order
        (the same bits on every rank)."""
        local = tl.load(buffers_ptr + RANK).to(tl.pointer_type(y_ptr.dtype.element_ty))
        for i0 in range(0, N, BR):
            i = i0 + tl.arange(0, BR)
            total = tl.zeros([BR], tl.float32)
            for r in tl.static_range(WORLD):
                # .cg: from L2, where the peers' stores land, never a stale line of this SM's L1
                total += tl.load(local + r * N + i, mask=i < N, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(y_ptr + i, total.to(y_ptr.dtype.element_ty), mask=i < N)

    @triton.jit
    def _gemv_all_reduce_kernel(x_ptr, w_ptr, y_ptr, buffers_ptr, pads_ptr, count_ptr, sw, N: tl.constexpr,
                                K: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, BN: tl.constexpr,
                                BK: tl.constexpr, BR: tl.constexpr, REDUCE: tl.constexpr):
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        # rounded as the unfused product's output is
        part = gemv_tile(x_ptr, w_ptr, n, sw, N, K, BN, BK).to(y_ptr.dtype.element_ty)
        if not REDUCE:  # the product alone (bench/gemv_all_reduce.py: what the reading costs)
            tl.store(y_ptr + n, part, mask=n < N)
            return
        for r in tl.static_range(WORLD):  # into slot RANK of rank r's buffer
            dst = tl.load(buffers_ptr + r).to(tl.pointer_type(y_ptr.dtype.element_ty))
            tl.store(dst + RANK * N + n, part, mask=n < N)
        # Every thread's stores before one thread's count, which releases them at system scope (the peers read
        # them) to the last program, which acquires them with it.
        tl.debug_barrier()
        if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
            tl.store(count_ptr, 0)  # every program has counted: ready for the next call
            _barrier(pads_ptr, RANK, WORLD)
            _sum_slots(y_ptr, buffers_ptr, RANK, WORLD, N, BR)

    # An opaque custom op (as one_shot.py's): the compiler calls it as it is, inside the CUDA graph. The buffers
    # and pads are reached through their addresses; `count` is left as it was found.
    @torch.library.custom_op("shardlm::gemv_all_reduce", mutates_args=("count",))
    def _gemv_all_reduce(x: torch.Tensor, w: torch.Tensor, buffers: torch.Tensor, pads: torch.Tensor,
                         count: torch.Tensor, rank: int, world: int, bn: int, bk: int, warps: int,
                         reduce: bool = True) -> torch.Tensor:
        with on_device(x):
            n, k = w.shape
            y = x.new_empty(n)
            _gemv_all_reduce_kernel[(triton.cdiv(n, bn),)](x, w, y, buffers, pads, count, w.stride(0), N=n, K=k,
                                                            RANK=rank, WORLD=world, BN=bn, BK=bk, BR=1024,
                                                            REDUCE=reduce, num_warps=warps)
            return y

    @_gemv_all_reduce.register_fake
    def _(x, w, buffers, pads, count, rank, world, bn, bk, warps, reduce=True):
        return x.new_empty(w.shape[0])


class GemvAllReduce:
    """x [..., K] times a row-parallel weight [N, K], summed over `group`, in one kernel for one row (`fits`),
    through one of two symmetric `buffers` of at least `world` x `max_n` elements (one_shot.symmetric_buffers:
    allocated and exchanged by every rank, outside any CUDA graph), `turn` 0 or 1 taken in turn by consecutive
    linears. Every rank must agree to use it (one_shot.use_one_shot decides once): a rank that took another
    path would leave its peers waiting at the barrier. `protocol` "ll" (the default) or "ll-strong":
    gemv_all_reduce_ll.py's kernel, which needs no barrier (buffers of 2 x `world` x `max_n`); "barrier": this
    module's kernel."""

    def __init__(self, buffers: list[torch.Tensor], max_n: int, group, launch=LAUNCH, reduce: bool = True,
                 protocol: str = "ll"):
        from torch.distributed import _symmetric_memory as symm_mem
        self.launch, self.max_n, self.reduce, self.dtype = launch, max_n, reduce, buffers[0].dtype
        self.group, self.rank, self.world = group, dist.get_rank(group), dist.get_world_size(group)
        self.ptrs, self.pads, self.counts = [], [], []
        for buf in buffers:
            handle = symm_mem.rendezvous(buf, group.group_name)  # the exchange's handle, already made
            device = buf.device
            self.ptrs.append(_static(torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)))
            self.pads.append(_static(torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)))
            self.counts.append(_static(torch.zeros(1, dtype=torch.int32, device=device)))
        self.buffers = buffers  # kept alive: the kernel reaches them by their addresses only
        self.protocol, self.strong = "barrier", False
        if protocol.startswith("ll"):
            self.use_ll(strong=protocol == "ll-strong")

    def use_ll(self, strong: bool = False) -> None:
        """Take the LL protocol from now on (`strong`: its stores to the peers relaxed at system scope, not weak):
        before the first call, on every rank (a collective)."""
        from . import gemv_all_reduce_ll  # noqa: F401 (registers its op)
        assert self.launch[0] % 2 == 0 and all(b.numel() >= 2 * self.world * self.max_n for b in self.buffers)
        device = self.buffers[0].device
        self.epochs = [_static(torch.zeros(-(-self.max_n // self.launch[0]), dtype=torch.int32, device=device))
                       for _ in self.buffers]
        self.status = _static(torch.zeros(4, dtype=torch.int32, device=device))
        for buf in self.buffers:
            buf.zero_()  # every flag 0, below every call's
        torch.cuda.synchronize(device)
        dist.barrier(self.group)  # no peer's first values before this rank's zeros
        self.protocol, self.strong = "ll", strong

    def check(self) -> None:
        """Raise where the LL protocol's kernel gave up waiting for a peer (after the calls: it cannot stop them)."""
        if self.protocol == "ll":
            from .gemv_all_reduce_ll import check
            check(self.status)

    def fits(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        # static shapes only: a decode step's (a prefill pass compiled for any length would be guarded on it),
        # the same on every rank
        return (all(isinstance(d, int) for d in x.shape) and x.numel() == w.shape[1] and w.shape[0] <= self.max_n
                and x.dtype == w.dtype == self.dtype and w.stride(1) == 1 and w.shape[0] * w.element_size() % 4 == 0)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, turn: int) -> torch.Tensor:
        bn, bk, warps = self.launch
        if self.protocol == "ll":
            y = torch.ops.shardlm.gemv_all_reduce_ll(x.reshape(-1).contiguous(), w, self.ptrs[turn], self.epochs[turn],
                                                     self.status, self.rank, self.world, bn, bk, warps, self.reduce,
                                                     strong=self.strong)
            return y.view(*x.shape[:-1], w.shape[0])
        y = torch.ops.shardlm.gemv_all_reduce(x.reshape(-1).contiguous(), w, self.ptrs[turn], self.pads[turn],
                                              self.counts[turn], self.rank, self.world, bn, bk, warps, self.reduce)
        return y.view(*x.shape[:-1], w.shape[0])


def _static(t: torch.Tensor) -> torch.Tensor:
    torch._dynamo.mark_static_address(t)  # a CUDA graph reads it: its address never changes
    return t
