"""GPU-only checks (skipped without CUDA; run on the device machine): the fused Triton kernels against
their PyTorch fallbacks, and a short bf16 training on the GPU."""
import pytest
import torch

from shardlm.kernels import adamw_master_step, sum_of_squares

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_adamw_matches_the_fallback(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 3 * 4096 + 17  # a ragged tail
    master = torch.randn(n, device="cuda", generator=g)
    grad = (torch.randn(n, device="cuda", generator=g) * 1e-2).to(dtype)
    m, v = torch.randn(n, device="cuda", generator=g) * 1e-3, torch.rand(n, device="cuda", generator=g) * 1e-5
    param = master.to(dtype) if dtype != torch.float32 else None
    scale = torch.tensor(0.7, device="cuda")
    no = torch.zeros((), dtype=torch.int32, device="cuda")
    kw = dict(step=5, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ref = [t.cpu().clone() if t is not None else None for t in (master, param, grad, m, v)]
    adamw_master_step(master, param, grad, m, v, scale, no, **kw)
    adamw_master_step(*ref, scale.cpu(), no.cpu(), **kw)
    torch.testing.assert_close(master.cpu(), ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m.cpu(), ref[3], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(v.cpu(), ref[4], rtol=1e-6, atol=1e-12)
    if param is not None:
        assert torch.equal(param, master.to(dtype))
    before = master.clone()
    adamw_master_step(master, param, grad, m, v, scale, torch.ones_like(no), **kw)  # skip flag set
    assert torch.equal(master, before)


@cuda
def test_sum_of_squares_is_exact_enough():
    x = torch.randn(10_000_019, device="cuda").to(torch.bfloat16)
    want = x.double().pow(2).sum().item()
    assert sum_of_squares(x).item() == pytest.approx(want, rel=1e-5)


@cuda
def test_bf16_training_on_gpu(tmp_path):
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    cfg = load_config("tiny", {"train.steps": "30", "train.precision": "bf16", "train.device": "cuda"})
    recs = Trainer(cfg, out_dir=tmp_path, log=lambda *a: None).run()
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0


@cuda
def test_compiled_chunked_loss_matches_eager():
    from shardlm.model.loss import linear_cross_entropy
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(2, 1024, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(5000, 256, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    t = torch.randint(0, 5000, (2, 1024), device="cuda", generator=g)
    out = []
    for compiled in (False, True):
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, t, 512, compiled)
        loss.backward()
        out.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    for a, b in zip(*out):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3)
