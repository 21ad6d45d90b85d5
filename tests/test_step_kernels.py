"""A decode step's elementwise kernels (inference/step_kernels.py): the residual add with its RMSNorm against the
sum and decoder.RMSNorm, SwiGLU against F.silu(gate) * up; run by Triton's interpreter on the CPU where triton
is installed (tests/test_gpu.py runs them on a GPU and in the engine)."""
import pytest
import torch
import torch.nn.functional as F


def check_kernels_interpreted() -> None:
    """Run under TRITON_INTERPRET=1, in fp16 (the interpreter's bf16 is broken): rows of widths a power of two
    and not, one row and several; the sum exactly x + delta's, the norm within a rounding of decoder.RMSNorm's;
    SwiGLU exactly the eager ops'."""
    from shardlm.inference import step_kernels
    from shardlm.model.decoder import RMSNorm
    g = torch.Generator().manual_seed(0)
    for n, width in ((1, 256), (5, 200), (3, 1030)):
        norm = RMSNorm(width, 1e-5)
        norm.weight.data = torch.randn(width, generator=g).half()
        x, delta = (torch.randn(n, 1, width, generator=g).half() * 4 for _ in range(2))
        total, h = torch.ops.shardlm.add_rms_norm(x, delta, norm.weight, norm.eps)
        assert torch.equal(total, x + delta)
        with torch.no_grad():
            torch.testing.assert_close(h, norm(x + delta), atol=4e-3, rtol=2e-3)
        h = torch.randn(n, 1, 2 * width, generator=g).half() * 3
        gate, up = h.chunk(2, dim=-1)
        assert torch.equal(torch.ops.shardlm.silu_mul(h), F.silu(gate) * up)
    assert not step_kernels.norm_ok(norm, x)  # the interpreter's tensors are on the CPU


@pytest.mark.timeout(240)
def test_step_kernels_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    run_in_tritons_interpreter("test_step_kernels", "check_kernels_interpreted")


def test_on_the_cpu_the_step_is_the_models_ops():
    """On the CPU add_norm is the sum and the norm and mlp the block's MLP, bit for bit."""
    from shardlm.config import load_config
    from shardlm.inference import step_kernels
    from shardlm.model.decoder import MLP, RMSNorm
    x, delta = torch.randn(2, 1, 64, dtype=torch.bfloat16), torch.randn(2, 1, 64, dtype=torch.bfloat16)
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    mlp = MLP(load_config("tiny").model).to(torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_()
    with torch.no_grad():
        total, h = step_kernels.add_norm(norm, x, delta)
        assert torch.equal(total, x + delta) and torch.equal(h, norm(x + delta))
        same, h = step_kernels.add_norm(norm, x, None)
        assert same is x and torch.equal(h, norm(x))
        h = torch.randn(2, 1, mlp.up.in_features, dtype=torch.bfloat16)
        assert torch.equal(step_kernels.mlp(mlp, h), mlp(h))
