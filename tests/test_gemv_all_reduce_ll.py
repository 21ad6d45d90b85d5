"""The fused one-row product and all-reduce by the LL protocol (inference/gemv_all_reduce_ll.py, opt-in): its
kernel run by Triton's interpreter on the CPU where triton is installed, two ranks as two threads over plain
buffers (on GPUs: bench/gemv_all_reduce.py's fused-ll, bench/generate.py's -ll variant)."""
import threading

import pytest
import torch


def check_kernel_interpreted() -> None:
    """Run under TRITON_INTERPRET=1. Each rank's output is the rank-order sum of the ranks' partial products, each
    rounded to the output's type (fp16: the interpreter's bf16 is broken; fp32), the same bits on both ranks; on
    three calls in turn (each program's count, the flag the peers wait for, advances), with an output count no tile
    divides; the stores to the peer weak or atomic; the product alone without the sum; a rank whose peer never
    comes, and that peer come late."""
    from shardlm.inference import gemv_all_reduce_ll  # noqa: F401 (registers the op)
    g = torch.Generator().manual_seed(0)
    world = 2
    for dtype, strong in ((torch.float16, False), (torch.float32, False), (torch.float16, True)):
        for n, k, bn in ((64, 96, 8), (40, 130, 8), (24, 64, 4)):
            ws = [(torch.randn(n, k, generator=g) * 0.05).to(dtype) for _ in range(world)]
            buffers = [torch.zeros(2 * world * n, dtype=dtype) for _ in range(world)]
            ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
            epochs = [torch.zeros(-(-n // bn), dtype=torch.int32) for _ in range(world)]
            status = torch.zeros(4, dtype=torch.int32)
            for call in range(3):
                xs = [torch.randn(k, generator=g).to(dtype) for _ in range(world)]
                outs = [None] * world

                def rank(r):
                    outs[r] = torch.ops.shardlm.gemv_all_reduce_ll(xs[r], ws[r], ptrs, epochs[r], status, r, world, bn,
                                                                   32, 2, strong=strong)

                threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                assert not any(t.is_alive() for t in threads), "a rank still waits for its peer's values"
                parts = [(w.double() @ x.double()).to(dtype).float() for w, x in zip(ws, xs)]
                want = (parts[0] + parts[1]).to(dtype)
                err = (outs[0].double() - want.double()).abs()
                assert (err <= want.double().abs() * 2**-10 + 1e-3).all(), (dtype, n, k, call, err.max().item())
                assert torch.equal(outs[0], outs[1]), (dtype, n, k, call)
                assert epochs[0].tolist() == [call + 1] * len(epochs[0])
        alone = torch.ops.shardlm.gemv_all_reduce_ll(xs[0], ws[0], ptrs, epochs[0], status, 0, world, bn, 32, 2,
                                                     False)
        assert ((alone.double() - parts[0].double()).abs() <= parts[0].double().abs() * 2**-10 + 1e-3).all()
        assert epochs[0].tolist() == [3] * len(epochs[0])  # no call counted without the sum
        gemv_all_reduce_ll.check(status)
    # A rank whose peer never comes gives up after max_spins reads, says what it awaited, and check raises; its
    # peer, come later, finds that rank a call ahead and says so rather than wait for a count never written.
    statuses = [torch.zeros(4, dtype=torch.int32) for _ in range(world)]
    torch.ops.shardlm.gemv_all_reduce_ll(xs[1], ws[1], ptrs, epochs[1], statuses[1], 1, world, bn, 32, 2, True, 50)
    wrong, program, awaited, seen = statuses[1].tolist()
    assert (wrong, awaited, seen) == (1, 4, 3) and 0 <= program < len(epochs[1])
    with pytest.raises(RuntimeError, match="gave up waiting: program .* awaited its peer's call 4, .* said 3"):
        gemv_all_reduce_ll.check(statuses[1])
    torch.ops.shardlm.gemv_all_reduce_ll(xs[1], ws[1], ptrs, epochs[1], statuses[1], 1, world, bn, 32, 2, True, 50)
    torch.ops.shardlm.gemv_all_reduce_ll(xs[0], ws[0], ptrs, epochs[0], statuses[0], 0, world, bn, 32, 2, True, 50)
    assert [statuses[0][0].item(), *statuses[0][2:].tolist()] == [2, 4, 5]
    with pytest.raises(RuntimeError, match="found a peer ahead: program .* awaited its peer's call 4, .* said 5"):
        gemv_all_reduce_ll.check(statuses[0])


@pytest.mark.timeout(240)
def test_fused_all_reduce_kernel_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    run_in_tritons_interpreter("test_gemv_all_reduce_ll", "check_kernel_interpreted")
