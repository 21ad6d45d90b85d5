"""Weight-only int8 (inference/int8.py): its one-row GEMV and few-row kernels run by Triton's interpreter on the
CPU where triton is installed (tests/test_gpu.py runs them on a GPU)."""
import pytest
import torch


def check_kernels_interpreted() -> None:
    """Run under TRITON_INTERPRET=1. In fp16 (the interpreter's bf16 is broken), against the product in fp64 of
    the dequantised weight: the one-row GEMV at its default launches and at others (outputs and inputs that no
    tile divides, a step larger than the inputs), its result within fp16's rounding, the same bits on a second
    call; inputs that are no multiple of 4 through the tensor-core kernel; and every byte value read exactly
    (scale 1, x of ones: integer sums, exact in fp32, rounded once to fp16)."""
    from shardlm.inference import int8
    from shardlm.inference.int8 import Int8Linear
    g = torch.Generator().manual_seed(0)
    launches = (None, (8, 128, 2, 1), (16, 512, 4, 3), (32, 256, 4, 2))
    for k, n in ((256, 200), (1540, 72), (96, 40), (130, 24)):
        q = Int8Linear(torch.nn.Linear(k, n, bias=False).half())
        x = torch.randn(1, k, generator=g).half()
        want = x.double() @ (q.weight.double() * q.scale.double()[:, None]).t()
        for launch in launches if k % 4 == 0 else (None,):
            y = (int8.int8_gemv(x, q.weight, q.scale, launch=launch) if launch
                 else torch.ops.shardlm.int8_mm(x, q.weight, q.scale))
            assert y.dtype == torch.float16 and y.shape == (1, n)
            err = (y.double() - want).abs()
            assert (err <= want.abs() * 2**-11 + 1e-3).all(), (k, n, launch, err.max().item())
            again = (int8.int8_gemv(x, q.weight, q.scale, launch=launch) if launch
                     else torch.ops.shardlm.int8_mm(x, q.weight, q.scale))
            assert torch.equal(again, y), (k, n, launch)
        levels = torch.arange(-128, 128).repeat(n, k // 256 + 1)[:, :k].roll(3, 1).to(torch.int8).contiguous()
        ones = torch.ones(n, dtype=torch.float16)
        for launch in launches if k % 4 == 0 else (None,):
            y = (int8.int8_gemv(torch.ones(1, k, dtype=torch.float16), levels, ones, launch=launch) if launch
                 else torch.ops.shardlm.int8_mm(torch.ones(1, k, dtype=torch.float16), levels, ones))
            assert torch.equal(y, levels.float().sum(1).half()[None]), (k, n, launch)


@pytest.mark.timeout(240)
def test_int8_kernels_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    print(run_in_tritons_interpreter("test_int8", "check_kernels_interpreted"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_with_inf_or_nan_is_refused_by_name(bad):
    """int8 and int4 quantisation of a weight holding inf or NaN: one error naming the output (and int4's group)
    rather than scales of inf or NaN that turn the channel's (int4: the group's) every product to NaN; int4's
    bf16 weights of finite values whose range exceeds fp32's too. The other rows would have been fine."""
    from shardlm.config import RunError
    from shardlm.inference.int4_format import quantize_weight
    from shardlm.inference.int8 import Int8Linear
    w = torch.randn(16, 256) * 0.02
    w[11, 200] = bad
    linear = torch.nn.Linear(256, 16, bias=False)
    linear.weight.data = w
    with pytest.raises(RunError, match=r"--quantize int8: the weight \[16, 256\] holds inf or NaN .* output 11:"):
        Int8Linear(linear)
    with pytest.raises(RunError, match=r"--quantize int4: the weight \[16, 256\] holds inf or NaN .* output 11, "
                                       r"group 3:"):
        quantize_weight(w, 64)
    huge = torch.zeros(8, 128, dtype=torch.bfloat16)
    huge[2, :2] = torch.tensor([3e38, -3e38])
    with pytest.raises(RunError, match="output 2, group 0: its scale is inf"):
        quantize_weight(huge, 128)
    w[11, 200] = 0
    Int8Linear(linear)
    quantize_weight(w, 64)
