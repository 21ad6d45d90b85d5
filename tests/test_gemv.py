"""The one-row 16-bit product (model/gemv.py): its kernel run by Triton's interpreter on the CPU where triton is
installed (tests/test_gpu.py runs it in the engine on a GPU), and where it is not taken."""
import pytest
import torch


def check_kernel_interpreted() -> None:
    """Run under TRITON_INTERPRET=1. In fp16 (the interpreter's bf16 is broken), against the product in fp64: the
    launches `launch` picks and others, on shapes no tile divides and steps larger than the inputs; within fp16's
    rounding of the output, the same bits on a second call; a weight whose rows lie apart (a view of columns)."""
    from shardlm.model import gemv
    g = torch.Generator().manual_seed(0)
    for n, k in ((200, 256), (72, 1540), (40, 96), (4100, 130), (24, 5003)):
        w = (torch.randn(n, k, generator=g) * 0.05).half()
        x = torch.randn(k, generator=g).half()
        want = w.double() @ x.double()
        for bn, bk, warps in {gemv.launch(n, k), (4, 512, 4), (8, 128, 2), (16, 1024, 8)}:
            y = torch.ops.shardlm.gemv(x, w, bn, bk, warps)
            assert y.dtype == torch.float16 and y.shape == (n,)
            err = (y.double() - want).abs()
            assert (err <= want.abs() * 2**-10 + 1e-3).all(), (n, k, bn, bk, warps, err.max().item())
            assert torch.equal(torch.ops.shardlm.gemv(x, w, bn, bk, warps), y)
    wide = (torch.randn(64, 300, generator=g) * 0.05).half()
    x = torch.randn(256, generator=g).half()
    y = torch.ops.shardlm.gemv(x, wide[:, 10:266], 8, 128, 4)
    want = wide[:, 10:266].double() @ x.double()
    assert ((y.double() - want).abs() <= want.abs() * 2**-10 + 1e-3).all()


@pytest.mark.timeout(240)
def test_gemv_kernel_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    run_in_tritons_interpreter("test_gemv", "check_kernel_interpreted")


def test_linear_takes_the_kernel_only_for_one_row_without_autograd_on_a_gpu():
    """On the CPU, several rows or with autograd on, model.gemv.linear is F.linear, bit for bit."""
    from shardlm.model import gemv
    w, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(6, dtype=torch.bfloat16)
    for x in (torch.randn(1, 1, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)):
        with torch.no_grad():
            assert not gemv.one_row(x, w)
            assert torch.equal(gemv.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    if torch.cuda.is_available():
        x = torch.randn(1, 1, 8, dtype=torch.bfloat16, device="cuda")
        assert not gemv.one_row(x, w.cuda().requires_grad_())  # autograd on
        with torch.no_grad():
            assert gemv.one_row(x, w.cuda()) and not gemv.one_row(x.float(), w.cuda().float())
