"""A row-parallel linear's one-row product and its all-reduce as one kernel (tensor-parallel batch-1 decode).

At tp 2 a decode token all-reduces twice a layer a vector of a few kilobytes, each the sum of the ranks'
partial products of a row-parallel linear (the attention's output projection, the MLP's down projection).
Done apart, that is a GEMV, a copy of its output into symmetric memory and the one-shot all-reduce kernel
(one_shot.py): three launches, two of them waiting on latency. Here one Triton kernel does all of it, as the
GEMV + all-reduce of PyTorch's symmetric-memory recipes (yifuwang/symm-mem-recipes) and TensorRT-LLM's fused
all-reduce do: each program computes a few outputs and stores them straight into every peer's symmetric
buffer (slot `rank`, over NVLink), then waits for the peers' values of the same outputs in its own buffer
and sums them in rank order (the same bits on every rank).

No barrier and no fence: the values travel by NCCL's low-latency (LL) protocol. Each 8-byte word carries 4
bytes of data (two bf16 values or one fp32) beside a 4-byte flag, and a GPU stores an aligned 8-byte word
whole, so a reader that sees this call's flag in a word holds that word's data. The flag is the program's
count of calls on that buffer (a device counter per program: the same on every rank, nothing to reset, so a
CUDA graph replays it as it is); zeroed buffers hold flag 0, below every count. A program waits only for the
same program on the peers, so the sum's cost is about one NVLink store's latency rather than a barrier's
round trips (bench/README.md). A rank refills a buffer's slots two calls later, which it starts only after
every peer has started the call in between, that is, finished this one: two buffers taken in turn (the two
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
    def _pack(part, flag, BN: tl.constexpr, PER: tl.constexpr):
        """BN values as BN // PER words of 8 bytes: PER values' bits low (2 of 16 bits or one of 32), `flag` high."""
        if PER == 2:
            lo, hi = tl.split(tl.reshape(part.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF, [BN // 2, 2]))
            data = lo | (hi << 16)
        else:
            data = part.to(tl.int32, bitcast=True)
        return data.to(tl.uint32, bitcast=True).to(tl.int64) | (flag.to(tl.int64) << 32)

    @triton.jit
    def _unpack(words, dtype: tl.constexpr, BN: tl.constexpr, PER: tl.constexpr):
        data = words.to(tl.uint32)  # the low half
        if PER == 2:
            lo = (data & 0xFFFF).to(tl.uint16).to(dtype, bitcast=True)
            hi = (data >> 16).to(tl.uint16).to(dtype, bitcast=True)
            values = tl.reshape(tl.join(lo, hi), [BN])
        else:
            values = data.to(dtype, bitcast=True)
        return values

    @triton.jit
    def _gemv_all_reduce_kernel(x_ptr, w_ptr, y_ptr, buffers_ptr, epochs_ptr, sw, N: tl.constexpr,
                                K: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, BN: tl.constexpr,
                                BK: tl.constexpr, PER: tl.constexpr, REDUCE: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BN + tl.arange(0, BN)
        # rounded as the unfused product's output is
        part = gemv_tile(x_ptr, w_ptr, n, sw, N, K, BN, BK).to(y_ptr.dtype.element_ty)
        if not REDUCE:  # the product alone (bench/gemv_all_reduce.py: what the reading costs)
            tl.store(y_ptr + n, part, mask=n < N)
            return
        epoch = tl.load(epochs_ptr + pid) + 1
        tl.store(epochs_ptr + pid, epoch)
        NW: tl.constexpr = N // PER  # words a slot
        words = _pack(part, epoch, BN, PER)
        i = pid * (BN // PER) + tl.arange(0, BN // PER)
        for r in tl.static_range(WORLD):
            if r != RANK:
                dst = tl.load(buffers_ptr + r).to(tl.pointer_type(tl.int64))
                tl.store(dst + RANK * NW + i, words, mask=i < NW)
        local = tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int64))
        total = tl.zeros([BN], tl.float32)
        for r in tl.static_range(WORLD):  # in rank order: the same bits on every rank
            if r == RANK:
                total += part.to(tl.float32)
            else:
                # volatile: read again from memory until every word holds this call's flag
                got = tl.load(local + r * NW + i, mask=i < NW, volatile=True)
                while tl.min((((got >> 32).to(tl.int32) == epoch) | (i >= NW)).to(tl.int32), 0) == 0:
                    got = tl.load(local + r * NW + i, mask=i < NW, volatile=True)
                total += _unpack(got, y_ptr.dtype.element_ty, BN, PER).to(tl.float32)
        tl.store(y_ptr + n, total.to(y_ptr.dtype.element_ty), mask=n < N)

    # An opaque custom op (as one_shot.py's): the compiler calls it as it is, inside the CUDA graph. The buffers
    # are reached through their addresses; `epochs` counts this call.
    @torch.library.custom_op("shardlm::gemv_all_reduce", mutates_args=("epochs",))
    def _gemv_all_reduce(x: torch.Tensor, w: torch.Tensor, buffers: torch.Tensor, epochs: torch.Tensor, rank: int,
                         world: int, bn: int, bk: int, warps: int, reduce: bool = True) -> torch.Tensor:
        with on_device(x):
            n, k = w.shape
            y = x.new_empty(n)
            _gemv_all_reduce_kernel[(triton.cdiv(n, bn),)](x, w, y, buffers, epochs, w.stride(0), N=n, K=k,
                                                            RANK=rank, WORLD=world, BN=bn, BK=bk,
                                                            PER=4 // x.element_size(), REDUCE=reduce,
                                                            num_warps=warps)
            return y

    @_gemv_all_reduce.register_fake
    def _(x, w, buffers, epochs, rank, world, bn, bk, warps, reduce=True):
        return x.new_empty(w.shape[0])


class GemvAllReduce:
    """x [..., K] times a row-parallel weight [N, K], summed over `group`, in one kernel for one row (`fits`),
    through one of two symmetric `buffers` of at least 2 x `world` x `max_n` elements (the flags double the
    bytes; one_shot.symmetric_buffers: allocated and exchanged by every rank, outside any CUDA graph), `turn` 0
    or 1 taken in turn by consecutive linears. Every rank must agree to use it (one_shot.use_one_shot decides
    once): a rank that took another path would leave its peers waiting for its values."""

    def __init__(self, buffers: list[torch.Tensor], max_n: int, group, launch=LAUNCH, reduce: bool = True):
        from torch.distributed import _symmetric_memory as symm_mem
        self.launch, self.max_n, self.reduce, self.dtype = launch, max_n, reduce, buffers[0].dtype
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        assert launch[0] % 2 == 0 and all(b.numel() >= 2 * self.world * max_n for b in buffers)
        self.ptrs, self.epochs = [], []
        for buf in buffers:
            handle = symm_mem.rendezvous(buf, group.group_name)  # the exchange's handle, already made
            self.ptrs.append(_static(torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=buf.device)))
            self.epochs.append(_static(torch.zeros(-(-max_n // launch[0]), dtype=torch.int32, device=buf.device)))
            buf.zero_()  # every flag 0, below every call's
        torch.cuda.synchronize(buffers[0].device)
        dist.barrier(group)  # no peer's first values before this rank's zeros
        self.buffers = buffers  # kept alive: the kernel reaches them by their addresses only

    def fits(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        # static shapes only: a decode step's (a prefill pass compiled for any length would be guarded on it),
        # the same on every rank; whole 4-byte words of outputs
        return (all(isinstance(d, int) for d in x.shape) and x.numel() == w.shape[1] and w.shape[0] <= self.max_n
                and x.dtype == w.dtype == self.dtype and w.stride(1) == 1 and w.shape[0] * w.element_size() % 4 == 0)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, turn: int) -> torch.Tensor:
        bn, bk, warps = self.launch
        y = torch.ops.shardlm.gemv_all_reduce(x.reshape(-1).contiguous(), w, self.ptrs[turn], self.epochs[turn],
                                              self.rank, self.world, bn, bk, warps, self.reduce)
        return y.view(*x.shape[:-1], w.shape[0])


def _static(t: torch.Tensor) -> torch.Tensor:
    torch._dynamo.mark_static_address(t)  # a CUDA graph reads it: its address never changes
    return t
