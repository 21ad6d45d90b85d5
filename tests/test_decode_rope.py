"""The decode step's fused rotary embedding and cache append (inference/decode_rope.py) against the model's own
rotation (Attention.project) and the cache writes decoder_layer does without it: by Triton's interpreter on the
CPU where triton is installed; tests/test_gpu.py runs the same check on a GPU."""
import pytest
import torch


def check_rope_append(device: str = "cpu", dtypes=(torch.float16, torch.float32)) -> None:
    """Rows in slots out of order, GQA (4 query heads over 2 key/value heads), positions at a slot's first and
    last places: the queries returned and the keys written rotated as project rotates them (computed in fp32,
    rounded once), the values copied as they are, and nothing else in the caches touched."""
    from shardlm.inference.decode_rope import rope_append
    from shardlm.model.rope import rotate_half
    g = torch.Generator().manual_seed(0)
    heads, kv, d, slots, length = 4, 2, 16, 5, 7
    rows, positions = torch.tensor([4, 0, 2]), torch.tensor([6, 0, 3])
    n = len(rows)
    for dtype in dtypes:
        qkv = torch.randn(n, (heads + 2 * kv) * d, generator=g).to(dtype)
        theta = torch.rand(n, d // 2, generator=g) * 6
        cos, sin = (f(torch.cat([theta, theta], -1)).to(dtype) for f in (torch.cos, torch.sin))
        k_cache, v_cache = (torch.randn(slots, kv, length, d, generator=g).to(dtype) for _ in range(2))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        to = dict(device=device)
        k_dev, v_dev = k_cache.to(**to), v_cache.to(**to)
        q = rope_append(qkv.to(**to), cos.to(**to), sin.to(**to), rows.to(**to), positions.to(**to), k_dev, v_dev,
                        heads).cpu()
        q_in, k_in, v_in = qkv.float().view(n, heads + 2 * kv, d).split([heads, kv, kv], 1)
        c, s = cos.float()[:, None], sin.float()[:, None]
        want_q = (q_in * c + rotate_half(q_in) * s).to(dtype)
        want_k = (k_in * c + rotate_half(k_in) * s).to(dtype)
        assert q.dtype == dtype and q.shape == (n, heads, d)
        tol = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.float16: dict(atol=1e-3, rtol=1e-3),
               torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}[dtype]  # an FMA may round the fp32 sum differently
        torch.testing.assert_close(q, want_q, **tol)
        k_want, v_want = k_before.clone(), v_before.clone()
        k_want[rows, :, positions] = want_k
        v_want[rows, :, positions] = v_in.to(dtype)
        torch.testing.assert_close(k_dev.cpu(), k_want, **tol)
        assert torch.equal(v_dev.cpu(), v_want), dtype


@pytest.mark.timeout(240)
def test_rope_append_in_tritons_interpreter():
    from helpers import run_in_tritons_interpreter
    print(run_in_tritons_interpreter("test_decode_rope", "check_rope_append"))
