"""The fused one-row product and all-reduce of gemv_all_reduce.py by the low-latency (LL) protocol, the
default (GemvAllReduce(protocol="ll")); gemv_all_reduce.py's barrier kernel stays for comparison.

No barrier and no fence: the values travel as in NCCL's LL protocol. Each 8-byte word carries 4 bytes of data
(two 16-bit values or one fp32) beside a 4-byte flag, and a GPU stores an aligned 8-byte word whole, so a reader
that sees this call's flag in a word holds that word's data. The flag is the program's count of calls on that
buffer (a device counter per program: the same on every rank, nothing to reset, so a CUDA graph replays it as
it is); zeroed buffers hold flag 0, below every count. Each program stores its outputs into every peer's buffer
(slot `rank`), then waits only for the same program's values from the peers and sums them in rank order (the
same bits on every rank). A rank refills a buffer's slots two calls later, which it starts only after every
peer has started the call in between, that is, finished this one: two buffers taken in turn are never
overwritten while read. A flag beyond the awaited count (ranks whose calls were miscounted) and a wait past
MAX_SPINS reads are recorded in `status` for `check` rather than waited on forever.

On 2x H200 its 64 products and sums took 701-712 us a token against the barrier kernel's 1,014-1,097 and
the products alone 601-616; tp 2 decoding of llama2-7b ran 1.43-1.47x one GPU against the barrier's 1.30x
(bench/README.md, thirty-fifth lease).
"""
from __future__ import annotations

import torch

from ..kernels import on_device, pdl_launch, triton, wait_for_inputs

# Reads of a peer's flag before a program gives up (its output wrong, `status` set for `check`, which the engine
# raises): about ten minutes at half a microsecond a read (a load from L2 and a block-wide minimum), beyond
# any skew between ranks that still agree, such as one rank compiling a new decode graph longer than its
# peer; a give-up is then a rank gone, not a slow one.
MAX_SPINS = 1 << 30

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
    def _gemv_all_reduce_ll_kernel(x_ptr, w_ptr, y_ptr, buffers_ptr, epochs_ptr, status_ptr, sw, N: tl.constexpr,
                                   K: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, BN: tl.constexpr,
                                   BK: tl.constexpr, PER: tl.constexpr, REDUCE: tl.constexpr,
                                   MAX_SPINS: tl.constexpr, STRONG: tl.constexpr, PDL: tl.constexpr = False):
        # Under kernels.pdl_launch the wait comes before anything is read or sent: that this rank has finished its
        # calls before the one a peer's values belong to (above) then still holds.
        wait_for_inputs(PDL)
        pid = tl.program_id(0)
        n = pid * BN + tl.arange(0, BN)
        # rounded as the unfused product's output is
        part = gemv_tile(x_ptr, w_ptr, n, sw, N, K, BN, BK).to(y_ptr.dtype.element_ty)
        if not REDUCE:  # the product alone (bench/gemv_all_reduce.py: what the reading costs)
            tl.store(y_ptr + n, part, mask=n < N)
            return
        epoch = tl.load(epochs_ptr + pid) + 1
        # Every thread loads the count and one stores it: without the barrier a warp that loads after that store
        # takes the next call's count, waits for a flag its peer writes only a call later, and both ranks hang.
        tl.debug_barrier()
        tl.store(epochs_ptr + pid, epoch)
        NW: tl.constexpr = N // PER  # words a slot
        words = _pack(part, epoch, BN, PER)
        i = pid * (BN // PER) + tl.arange(0, BN // PER)
        for r in tl.static_range(WORLD):
            if r != RANK:
                dst = tl.load(buffers_ptr + r).to(tl.pointer_type(tl.int64))
                if STRONG:  # relaxed at system scope, as NCCL's volatile LL stores: a weak store has no promise
                    tl.atomic_xchg(dst + RANK * NW + i, words, mask=i < NW, sem="relaxed", scope="sys")
                else:
                    tl.store(dst + RANK * NW + i, words, mask=i < NW)
        local = tl.load(buffers_ptr + RANK).to(tl.pointer_type(tl.int64))
        total = tl.zeros([BN], tl.float32)
        for r in tl.static_range(WORLD):  # in rank order: the same bits on every rank
            if r == RANK:
                total += part.to(tl.float32)
            else:
                # volatile: read again from memory until every word holds this call's flag or a later one (flags
                # only grow: a peer ahead, its calls miscounted, is reported, not waited for forever)
                got = tl.load(local + r * NW + i, mask=i < NW, volatile=True)
                ahead = tl.where(i < NW, (got >> 32).to(tl.int32) - epoch, 0)
                spins = tl.full([], 0, tl.int32)
                while (tl.min(ahead, 0) < 0) & (spins < MAX_SPINS):
                    got = tl.load(local + r * NW + i, mask=i < NW, volatile=True)
                    ahead = tl.where(i < NW, (got >> 32).to(tl.int32) - epoch, 0)
                    spins += 1
                wrong = tl.where(tl.min(ahead, 0) < 0, 1, tl.where(tl.max(ahead, 0) > 0, 2, 0))
                if wrong != 0:  # GemvAllReduce.check raises: how (1 given up, 2 a peer ahead), where, what came
                    if tl.atomic_cas(status_ptr, 0, wrong) == 0:  # the first program's only
                        tl.store(status_ptr + 1, pid)
                        tl.store(status_ptr + 2, epoch)
                        tl.store(status_ptr + 3, epoch + tl.where(wrong == 1, tl.min(ahead, 0), tl.max(ahead, 0)))
                total += _unpack(got, y_ptr.dtype.element_ty, BN, PER).to(tl.float32)
        tl.store(y_ptr + n, total.to(y_ptr.dtype.element_ty), mask=n < N)

    # An opaque custom op (as one_shot.py's): the compiler calls it as it is, inside the CUDA graph. The buffers
    # are reached through their addresses; `epochs` counts this call.
    @torch.library.custom_op("shardlm::gemv_all_reduce_ll", mutates_args=("epochs", "status"))
    def _gemv_all_reduce_ll(x: torch.Tensor, w: torch.Tensor, buffers: torch.Tensor, epochs: torch.Tensor,
                            status: torch.Tensor, rank: int, world: int, bn: int, bk: int, warps: int,
                            reduce: bool = True, max_spins: int = MAX_SPINS, strong: bool = False) -> torch.Tensor:
        with on_device(x):
            n, k = w.shape
            y = x.new_empty(n)
            _gemv_all_reduce_ll_kernel[(triton.cdiv(n, bn),)](x, w, y, buffers, epochs, status, w.stride(0), N=n,
                                                               K=k, RANK=rank, WORLD=world, BN=bn, BK=bk,
                                                               PER=4 // x.element_size(), REDUCE=reduce,
                                                               MAX_SPINS=max_spins, STRONG=strong, num_warps=warps,
                                                               **pdl_launch(x))
            return y

    @_gemv_all_reduce_ll.register_fake
    def _(x, w, buffers, epochs, status, rank, world, bn, bk, warps, reduce=True, max_spins=MAX_SPINS, strong=False):
        return x.new_empty(w.shape[0])


def check(status: torch.Tensor) -> None:
    """Raise where a program gave up waiting for a peer's values or found a peer a call ahead (the kernel's
    `status`: 0 while none has); either leaves that call's output wrong."""
    wrong, program, awaited, seen = status.tolist()
    if wrong:
        what = "gave up waiting" if wrong == 1 else "found a peer ahead"
        raise RuntimeError(f"the LL all-reduce {what}: program {program} awaited its peer's call {awaited}, the "
                           f"peer's flag said {seen} (0: never written; below: the peer behind; above: ahead)")
