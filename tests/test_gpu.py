"""GPU-only checks (skipped without CUDA; run on the device machine): the fused Triton kernels against
their PyTorch fallbacks, and a short bf16 training on the GPU."""
import pytest
import torch

from shardlm.kernels import adamw_master_step, sum_of_squares, sum_over_ranks

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
@pytest.mark.parametrize("world", [2, 4])
def test_sum_over_ranks_rounds_the_fp32_sum_once(world):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 5 * 4096 + 3
    spread = torch.logspace(-4, 4, n, device="cuda")  # magnitudes far apart: order and rounding matter
    rows = (torch.randn(world, n, device="cuda", generator=g) * spread).bfloat16()
    for rank in range(world):
        own = (torch.randn(n, device="cuda", generator=g) * spread).bfloat16()
        terms = [own if j == rank else rows[j] for j in range(world)]
        want = torch.stack(terms).float().cpu().sum(0).bfloat16()
        mine = rows.clone()
        mine[rank] = float("nan")  # never read
        sum_over_ranks(mine, own, rank, own)  # in place, as the copy-engine reduction does
        assert torch.equal(own.cpu(), want)


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
def test_a_save_written_by_its_thread_from_the_gpu_holds_the_weights_trained(tmp_path):
    """A synchronous sharded save is written by a thread (runtime/first_rank.py: the main thread answers the
    ranks that finished sooner), which copies each piece off the GPU itself: what it wrote is the weights the
    run ended with, and the optimizer state is there."""
    from shardlm.checkpoint import load_checkpoint
    from shardlm.config import load_config
    from shardlm.trainer import Trainer
    cfg = load_config("tiny", {"train.steps": "3", "train.device": "cuda", "train.sample_tokens": "0"})
    trainer = Trainer(cfg, out_dir=tmp_path, log=lambda *a: None)
    trainer.run()
    saved = load_checkpoint(tmp_path)
    assert saved["state"]["step"] == 3 and len(saved["optimizer"]) > 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(saved["model"][name], p.detach().float().cpu()), name


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


@cuda
def test_one_launch_over_all_buckets_steps_like_bucket_by_bucket(monkeypatch):
    """DDP's ~70 buckets are stepped by one kernel over their joined buffers (a table of where weight decay
    applies); the result must be the per-bucket step's, bit for bit."""
    from shardlm import optim
    from shardlm.config import load_config
    from shardlm.flat import FlatParams
    from shardlm.model import build_model
    from shardlm.optim import MasterWeightOptimizer
    from shardlm.parallel.buckets import reverse_order_buckets
    from shardlm.precision import NoLossScaler
    launches = []
    monkeypatch.setattr(optim, "adamw_master_step", lambda *a, **k: (launches.append(k.get("decay_table") is not None),
                                                                      adamw_master_step(*a, **k)))
    cfg = load_config("tiny", {"train.precision": "bf16", "train.device": "cuda", "train.weight_decay": "0.1"})
    runs = []
    for joined in (True, False):
        model = build_model(cfg.model, torch.device("cuda"), torch.bfloat16, 0)
        flat = FlatParams(model, reverse_order_buckets(model, 0.01), pad_multiple=4)
        assert len(flat.buckets) > 5
        opt = MasterWeightOptimizer(flat, cfg.train, NoLossScaler())
        if not joined:
            opt.decay_table = None  # the bucket-by-bucket path
        g = torch.Generator(device="cuda").manual_seed(1)
        start = opt.master.clone()
        launches.clear()
        for step in range(3):
            for b in flat.buckets:  # small gradients: the clip factor stays exactly 1
                b.grad.copy_(torch.randn(b.numel, device="cuda", generator=g) * 1e-4)
            opt.step(1e-3, step, lambda i: flat.buckets[i].grad, lambda i: flat.buckets[i].data)
        assert launches == ([True] * 3 if joined else [False] * 3 * len(opt.segments))
        assert not torch.equal(opt.master, start)
        runs.append((opt.master.clone(), opt.state["exp_avg_sq"][0].clone(), [b.data.clone() for b in flat.buckets],
                     float(opt.last_norm)))
    (m1, v1, p1, n1), (m2, v2, p2, n2) = runs
    assert torch.equal(m1, m2) and torch.equal(v1, v2) and all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert n1 == pytest.approx(n2, rel=1e-6)


@cuda
@pytest.mark.parametrize("changes", [dict(num_kv_heads=2), dict(sliding_window=6), dict(num_experts=4, top_k=2)],
                         ids=["gqa", "window", "moe"])
def test_prefill_replayed_as_cuda_graphs_gives_the_compiled_prefills_tokens(changes):
    """The engine's prefill passes captured and replayed (a second round of the same prompts replays the
    first's graphs) against the compiled prefill without graphs, no warning on the way; a model whose prefill
    may not be captured (fp32 experts loop over their group sizes) gives the same tokens either way."""
    import dataclasses
    import warnings

    from shardlm.config import load_config
    from shardlm.inference import Engine, Request
    from shardlm.model import build_model
    cfg = dataclasses.replace(load_config("tiny").model, init_std=0.2, **changes)
    model = build_model(cfg, seed=3).cuda().eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 2, 15, 4, 6, 13, 30)]
    runs = []
    for graphs in (0, 256):
        engine = Engine(model, max_batch=3, max_len=48, prefill_chunk=8, prefill_graphs=graphs)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            runs.append([[r.tokens for r in engine.run([Request(p, 6) for p in prompts])] for _ in range(2)])
        if "num_experts" not in changes:
            assert not [w for w in said if "CUDA graphs" in str(w.message)]
    assert runs[1][0] == runs[1][1] == runs[0][0]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,window", [(4, 4, 0), (8, 2, 0), (4, 2, 37)])
@pytest.mark.parametrize("n", [6, 72])
def test_decode_attention_kernel_reads_each_rows_keys_like_the_masked_products(dtype, heads, kv, window, n):
    """The flash-decoding kernel against slots.attend_cached's masked products (its CPU path): rows at the
    first key, the last, mid-way across split boundaries, an idle slot's (zeros), with GQA and a sliding
    window, on views of a longer cache as the decode step passes them; 6 rows and 72; 300 keys and 3,000."""
    from shardlm.inference.decode_attention import decode_attention, kernel_ok
    from shardlm.inference.slots import visible, visible_bounds
    g = torch.Generator(device="cuda").manual_seed(0)
    d = 64
    for keys in (300, 3000):  # 3000: more splits than the combine takes at once
        q = torch.randn(n, heads, 1, d, device="cuda", generator=g).to(dtype)
        cache = [torch.randn(n, kv, keys + 77, d, device="cuda", generator=g).to(dtype) for _ in range(2)]
        k, v = (c[:, :, :keys] for c in cache)
        idle = keys + 76  # an idle slot's scratch position: it sees no key, and reads none
        pos = torch.tensor([[0], [keys - 1], [127], [128], [200], [idle]] * (n // 6), device="cuda")
        mask = visible(pos, keys, window, idle)
        assert kernel_ok(q, k)
        scores = torch.einsum("nhd,nhkd->nhk", q[:, :, 0].float(), k.float().repeat_interleave(heads // kv, 1))
        probs = (scores * d ** -0.5).masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num()
        want = torch.einsum("nhk,nhkd->nhd", probs, v.float().repeat_interleave(heads // kv, 1)).reshape(n, 1, -1)
        for bounds in (None, visible_bounds(pos, keys, window, idle)):  # from the mask, and as the decode step does
            got = decode_attention(q, k, v, mask, bounds)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want,
                                       **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,window,rope", [(32, 32, 0, True), (32, 8, 0, True), (8, 2, 37, True),
                                                  (4, 4, 0, False)])
def test_decode_step_kernel_rotates_writes_and_attends_as_the_unfused_step(dtype, heads, kv, window, rope):
    """decode_attention.attention_step (RoPE, cache writes and attention in one kernel) against the unfused
    step (test_decode_attention.unfused) on 64 rows, many heads reading each new key while one writes it: the
    same caches and outputs; then the engine with it, compiled in CUDA graphs, against the same engine without
    it: the same greedy tokens in fp32, scored within bf16's rounding in bf16."""
    from unittest import mock

    from test_decode_attention import unfused

    from shardlm.inference import slots
    from shardlm.inference.decode_attention import SPLIT, attention_step
    g = torch.Generator(device="cuda").manual_seed(0)
    d, keys = 64, 4 * SPLIT
    scratch = keys + 3
    positions = torch.tensor([[0], [keys - 1], [SPLIT - 1], [SPLIT], [100], [scratch], [1], [200]] * 8, device="cuda")
    n = positions.shape[0]
    qkv = torch.randn(n, 1, (heads + 2 * kv) * d, device="cuda", generator=g).to(dtype)
    caches = [torch.randn(n, kv, scratch + 1, d, device="cuda", generator=g).to(dtype) for _ in range(2)]
    angles = None
    if rope:
        turns = positions[:, :, None, None].float() * torch.rand(d // 2, device="cuda", generator=g).repeat(2)
        angles = (turns.cos().to(dtype), turns.sin().to(dtype))
    bounds = slots.visible_bounds(positions, keys, window, scratch)
    want_k, want_v = (c.clone() for c in caches)
    want = unfused(qkv, angles, want_k, want_v, positions, bounds, heads, keys)
    got = attention_step(qkv, angles, *caches, positions, heads, keys, window, scratch)
    active = positions[:, 0] != scratch
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # FMAs or not
    torch.testing.assert_close(caches[0][active], want_k[active], **tol)
    torch.testing.assert_close(caches[1][active], want_v[active], atol=0, rtol=0)
    torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else tol))
    if heads != 8:
        return
    import dataclasses

    from shardlm.config import load_config
    from shardlm.inference import Engine, Request
    from shardlm.model import build_model
    cfg = dataclasses.replace(load_config("tiny").model, init_std=0.2, num_kv_heads=2, sliding_window=6)
    model = build_model(cfg, device="cuda", dtype=dtype, seed=3).eval()
    if dtype == torch.bfloat16:
        decodes_in_cuda_graphs_as_eagerly(model)
        return
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (9, 2, 15)]
    runs = []
    for fused in (True, False):
        with mock.patch.object(slots, "step_kernel_ok", slots.step_kernel_ok if fused else lambda x, k: False):
            runs.append([r.tokens for r in Engine(model, 3, 48, compile=True).run([Request(p, 8) for p in prompts])])
    assert runs[0] == runs[1]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_kernels_are_the_sum_the_rmsnorm_and_swiglu(dtype):
    """step_kernels' add_norm and SwiGLU on a GPU (launched as the decode step's chain, kernels.pdl_launch): the
    sum exactly x + delta's, the norm decoder.RMSNorm's to a rounding, SwiGLU F.silu(gate) * up's, for 1 and 16
    rows of 4,096 and 5,000 values."""
    import torch.nn.functional as F

    from shardlm.inference import step_kernels
    from shardlm.model.decoder import RMSNorm
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, width in ((1, 4096), (16, 5000)):
        norm = RMSNorm(width, 1e-5).cuda().to(dtype)
        norm.weight.data.normal_(generator=g)
        x, delta = (torch.randn(n, 1, width, device="cuda", generator=g).to(dtype) * 3 for _ in range(2))
        assert step_kernels.norm_ok(norm, x)
        with torch.no_grad():
            total, h = step_kernels.add_norm(norm, x, delta)
            torch.testing.assert_close(total, x + delta, atol=0, rtol=0)
            torch.testing.assert_close(h, norm(x + delta), **({} if dtype == torch.float32 else
                                                               dict(atol=2e-2, rtol=1e-2)))
        h = torch.randn(n, 1, 2 * width, device="cuda", generator=g).to(dtype) * 3
        gate, up = h.chunk(2, dim=-1)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)  # exp's forms
        torch.testing.assert_close(torch.ops.shardlm.silu_mul(h), F.silu(gate) * up, **tol)


@cuda
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_int8_kernel_equals_the_dequantised_product(rows):
    """The int8 weight-only product of decode (Triton) against the weight dequantised and multiplied in fp32:
    sizes that fill no tile evenly, several row tiles, narrow and wide layers; and an Int8Linear beside the
    layer it replaced."""
    from shardlm.inference.int8 import WIDE, Int8Linear, int8_linear, kernel_ok
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 300, device="cuda", generator=g).bfloat16()
    assert kernel_ok(x)
    for outputs in (100, WIDE + 100):  # the narrow and the wide layers' launches
        layer = torch.nn.Linear(300, outputs, bias=True).cuda().bfloat16()
        q = Int8Linear(layer)
        want = x.float() @ (q.weight.float() * q.scale.float()[:, None]).t()
        torch.testing.assert_close(int8_linear(x, q.weight, q.scale).float(), want, atol=2e-2, rtol=2e-2)
        near = layer(x).float()
        assert ((q(x).float() - near).abs().max() / near.abs().max()).item() < 0.02


@cuda
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_kernels_read_every_byte_value_exactly(rows):
    """Each of the 256 int8 values as the weight of one output channel (scale 1), times x of ones over 300
    inputs: every product is an integer (over 256 in the one-row GEMV's f16x2 sums) that fp16 and fp32 hold
    exactly, so both kernels (the one-row GEMV's bytes in a half's mantissa, the tensor-core kernel's conversion)
    must give 300 w rounded once to bf16, bit for bit;
    a weight read off by one would be 300 off."""
    from shardlm.inference.int8 import int8_linear
    w = torch.arange(-128, 128, device="cuda", dtype=torch.int8)[:, None].expand(256, 300).contiguous()
    x = torch.ones(rows, 300, device="cuda", dtype=torch.bfloat16)
    got = int8_linear(x, w, torch.ones(256, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(got, (300.0 * torch.arange(-128, 128, device="cuda")).to(torch.bfloat16).expand(rows, 256))


@cuda
def test_int8_one_row_product_keeps_large_and_small_inputs():
    """The one-row GEMV multiplies in fp16 (its inputs as they are, its weights over 256): inputs from 1e-3 to
    4.5e4 in magnitude (llama2-7b's MLP inputs reach thousands) in one row, against the fp64 product of the
    dequantised weight: within bf16's rounding of the result, 2^-9 of the sum of the products' magnitudes (the
    f16x2 products' and sums' roundings) and 2^-24 of the weights' magnitudes (an input's worst rounding,
    subnormal in fp16), never inf."""
    from shardlm.inference.int8 import Int8Linear, int8_linear
    g = torch.Generator(device="cuda").manual_seed(0)
    for k, n in ((4096, 4096), (11008, 4096), (300, 100)):
        x = torch.randn(1, k, device="cuda", generator=g)
        x *= 10 ** (torch.rand(1, k, device="cuda", generator=g) * 7 - 3)
        x = x.clamp(-6e4, 6e4).bfloat16()
        q = Int8Linear(torch.nn.Linear(k, n, bias=False).cuda().bfloat16())
        w = q.weight.double() * q.scale.double()[:, None]
        want = x.double() @ w.t()
        got = int8_linear(x, q.weight, q.scale).double()
        assert got.isfinite().all()
        bound = want.abs() * 2**-8 + 2**-9 * (x.double().abs() @ w.abs().t()) + 2**-24 * w.abs().sum(1)
        assert ((got - want).abs() <= bound).all(), (k, n, ((got - want).abs() / bound).max().item())


@cuda
def test_int8_prefill_product_is_not_rewritten_to_aten_int8pack():
    """Compiled, the product of many rows (prefill) dequantises and multiplies, giving the fp32 product; it must
    not become aten's _weight_int8pack_mm, whose CUDA kernel made llama2-7b's prefill 1.8 s (bench/README.md)."""
    from torch._inductor.utils import run_and_get_code

    from shardlm.inference.int8 import MAX_ROWS, Int8Linear
    q = Int8Linear(torch.nn.Linear(512, 256, bias=False).cuda().bfloat16())
    x = torch.randn(1, MAX_ROWS + 64, 512, device="cuda").bfloat16()  # as a prompt: [batch, tokens, features]
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(q), x)
    assert "int8pack" not in "".join(code)
    want = x.float() @ (q.weight.float() * q.scale.float()[:, None]).t()
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("rows", [1, 2, 16, 64])
def test_int4_kernels_equal_the_dequantised_product(rows):
    """The int4 weight-only products of decode as the model calls them (Triton: the one-row GEMV; at 2-64 rows int4_mm's
    default form for the rows) against the weight dequantised and multiplied in fp64 (the weight rounded to the
    dtype first where that form rounds it: planes with groups under 128, dequant), in bf16 and fp16: outputs that
    fill no tile evenly, groups of 128, 64 and 32, llama2-7b's shapes; the result within the dtype's rounding of it
    (bf16's one-row GEMV, which sums each word's 8 products in bf16x2 by four roundings, within 2^-6 of the sum of
    the products' magnitudes more, its worst case, and its error's norm within 2^-6 of the result's), the same bits
    on a second call; and every nibble read exactly (scale 1, zero 0, x of ones: integer sums, exact in fp32 and in
    bf16's four-term sums, rounded once; through cuBLAS for dequant, whose sums may round)."""
    import torch.nn.functional as F

    from shardlm.inference import int4
    from shardlm.inference.int4 import Int4Linear, int4_linear, kernel_ok
    from shardlm.inference.int4_format import blocked, dequantize, pack
    g = torch.Generator(device="cuda").manual_seed(0)
    form = "gemv" if rows == 1 else int4.MM_FORM if rows <= int4.MM_PLANES_ROWS else "dequant"
    for dtype, ulp in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11)):
        for k, n in ((256, 200), (384, 200), (320, 72), (96, 136), (4096, 12288), (11008, 4096)):
            x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
            assert kernel_ok(x)
            q = Int4Linear(torch.nn.Linear(k, n, bias=False).cuda().to(dtype))
            exact_weight = form in ("gemv", "tiles") or (form == "planes" and q.group == 128)
            w = dequantize(q.words, q.scale, q.zero, torch.float64 if exact_weight else dtype)
            want = x.double() @ w.double().t()
            got = int4_linear(x, q.words, q.scale, q.zero)
            assert got.dtype == dtype
            err = (got.double() - want).abs()
            packed = form == "gemv" and dtype == torch.bfloat16
            slack = 2**-6 * (x.double().abs() @ w.double().abs().t()) if packed else 0
            assert (err <= want.abs() * ulp + slack + 1e-3).all(), (form, dtype, k, n, err.max().item())
            assert (err.norm() <= 2**-6 * want.norm()), (form, dtype, k, n, (err.norm() / want.norm()).item())
            assert torch.equal(int4_linear(x, q.words, q.scale, q.zero), got)
            levels = torch.randint(0, 16, (n, k), device="cuda", generator=g)
            ones = blocked(torch.ones(n, k // q.group, device="cuda", dtype=dtype))
            exact = int4_linear(torch.ones_like(x), pack(levels), ones, torch.zeros_like(ones, dtype=torch.uint8))
            total = (F.linear(torch.ones_like(x), levels.to(dtype)) if form == "dequant"
                     else levels.sum(1).to(dtype).expand(rows, n))
            assert torch.equal(exact, total), (form, dtype, k, n)


@cuda
@pytest.mark.parametrize("rows", [2, 16, 64])
def test_int4_mm_forms_equal_the_dequantised_product(rows):
    """int4_mm's forms at some of the launches bench/quantized_gemv.py's int4-mm system sweeps, compiled by Triton
    for the GPU: tiles and planes against the product in fp64 of the dequantised weight (planes with groups
    under 128 of the weight rounded to the dtype, as dequantize rounds it), within the dtype's rounding, the
    same bits on a second call; int4_dequant writes dequantize's bits and dequant is F.linear of them; and every
    nibble read exactly (scale 1, zero 0, x of ones: integer sums, exact in fp32, rounded once)."""
    import torch.nn.functional as F

    from shardlm.inference.int4 import Int4Linear, int4_dequant, int4_mm
    from shardlm.inference.int4_format import blocked, dequantize, pack
    g = torch.Generator(device="cuda").manual_seed(0)
    # tiles, planes: (form, bm, bn, warps), the tile up to 64 x 128; dequant: bn rows of words a program. A few
    # launches and shapes: each is a compile, and nine launches over six shapes ran past a GPU call's limit.
    launches = [("tiles", 16, 64, 4), ("tiles", 64, 128, 8), ("planes", 16, 128, 4), ("planes", 64, 64, 4),
                ("dequant", 0, 128, 4)]
    for dtype, ulp in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11)):
        for k, n in ((256, 200), (320, 72), (96, 136), (4096, 12288)):
            x = torch.randn(rows, k, device="cuda", generator=g).to(dtype)
            q = Int4Linear(torch.nn.Linear(k, n, bias=False).cuda().to(dtype))
            rounded = dequantize(q.words, q.scale, q.zero, dtype)
            assert torch.equal(int4_dequant(q.words, q.scale, q.zero, dtype), rounded)
            want = x.double() @ dequantize(q.words, q.scale, q.zero, torch.float64).t()
            want_rounded = x.double() @ rounded.double().t()
            levels = torch.randint(0, 16, (n, k), device="cuda", generator=g)
            ones = blocked(torch.ones(n, k // q.group, device="cuda", dtype=dtype))
            for form, bm, bn, warps in launches:
                got = int4_mm(x, q.words, q.scale, q.zero, form, bm, bn, warps)
                assert got.dtype == dtype and got.shape == (rows, n)
                assert torch.equal(int4_mm(x, q.words, q.scale, q.zero, form, bm, bn, warps), got)
                if form == "dequant":
                    assert torch.equal(got, F.linear(x, rounded)), (dtype, k, n, bn)
                else:
                    ref = want if form == "tiles" or q.group == 128 else want_rounded
                    err = (got.double() - ref).abs()
                    assert (err <= ref.abs() * ulp + 1e-3).all(), (form, bm, bn, warps, dtype, k, n, err.max().item())
                zeros = torch.zeros_like(ones, dtype=torch.uint8)
                exact = int4_mm(torch.ones_like(x), pack(levels), ones, zeros, form, bm, bn, warps)
                # dequant's integer weight through cuBLAS, whose reductions may round (bf16's split K): its bits
                total = (F.linear(torch.ones_like(x), levels.to(dtype)) if form == "dequant"
                         else levels.sum(1).to(dtype).expand(rows, n))
                assert torch.equal(exact, total), (form, bm, bn, dtype, k, n)


@cuda
def test_int4_one_row_product_is_the_same_bits_every_call_and_replay():
    """The one-row kernel sums each output's partials in one fixed order: 200 eager calls on llama2-7b's down
    projection give the same bits; captured in a CUDA graph, every replay gives the eager call's bits, for a
    new x too."""
    from shardlm.inference.int4 import Int4Linear
    q = Int4Linear(torch.nn.Linear(11008, 4096, bias=False).cuda().bfloat16())
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 1, 11008, device="cuda", generator=g).bfloat16()
    first = q(x)
    assert all(torch.equal(q(x), first) for _ in range(200))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q(x)  # warmed up off the capture, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = q(x)
    for _ in range(5):
        graph.replay()
        assert torch.equal(y, first)
    x.copy_(torch.randn(1, 1, 11008, device="cuda", generator=g).bfloat16())
    graph.replay()
    assert torch.equal(y, q(x))


@cuda
def test_int4_one_row_product_of_an_x_at_an_odd_elements_address():
    """bf16x2 reads x as 32-bit pairs: an x one element into its storage (a [1, K] view, contiguous, not copied)
    takes the fp32 form (a misaligned-address fault before, which ends the process's CUDA context): the same
    product as an aligned copy's, within bf16x2's rounding."""
    from shardlm.inference.int4 import Int4Linear
    q = Int4Linear(torch.nn.Linear(256, 64, bias=False).cuda().bfloat16())
    x = torch.randn(1, 257, device="cuda").bfloat16()[:, 1:]
    assert x.is_contiguous() and x.data_ptr() % 4 == 2
    got, aligned = q(x).float(), q(x.clone()).float()
    assert (got - aligned).abs().max() <= 2**-6 * aligned.abs().max(), (got - aligned).abs().max().item()


@cuda
def test_int4_engine_decodes_in_cuda_graphs_as_it_does_eagerly():
    """A tiny Llama in bf16 with int4 weights: the compiled decode step (CUDA graph trees) calls the product
    inside its graphs (no skip) and gives the eager engine's tokens at one row and at three."""
    import dataclasses

    from shardlm.config import load_config
    from shardlm.inference.quantize import quantize
    from shardlm.model import build_model
    cfg = dataclasses.replace(load_config("tiny").model, init_std=0.2)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=3).eval()
    assert quantize(model, "int4") == 8
    decodes_in_cuda_graphs_as_eagerly(model)


def decodes_in_cuda_graphs_as_eagerly(model) -> None:
    """The compiled engine (CUDA graph trees, no skip: every product inside the graphs) at one row, at three, and
    at one row of three slots (a request alone) gives greedy tokens that the eager model's forward over prompt
    + tokens scores within bf16's rounding of its best at every step. Not token for token against the eager engine: the compiled norms and attention round
    otherwise, and random weights meet near-ties (a run of 8 tokens once parted at the fourth)."""
    from torch._dynamo.utils import counters

    from shardlm.inference import Engine, Request
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 2, 15)]
    skips = counters["inductor"]["cudagraph_skips"]
    for batch, some in ((1, prompts), (3, prompts), (3, prompts[:1])):
        done = Engine(model, batch, 48, compile=True).run([Request(p, 8) for p in some])
        for p, r in zip(some, done):
            with torch.no_grad():
                logits = model(torch.tensor([p + r.tokens[:-1]], device="cuda"))[0, len(p) - 1:].float()
            best = logits.max(-1).values
            chosen = logits.gather(-1, torch.tensor(r.tokens, device="cuda")[:, None])[:, 0]
            assert (chosen >= best - 2**-5 * logits.abs().amax(-1)).all(), (batch, r.tokens, best - chosen)
    assert counters["inductor"]["cudagraph_skips"] == skips


@cuda
def test_int4_prefill_product_is_the_dequantised_product_compiled():
    """More than MAX_ROWS rows (a prompt) dequantise the weight and multiply, compiled as prefill is."""
    from shardlm.inference.int4 import MAX_ROWS, Int4Linear
    from shardlm.inference.int4_format import dequantize
    q = Int4Linear(torch.nn.Linear(512, 256, bias=False).cuda().bfloat16())
    x = torch.randn(1, MAX_ROWS + 64, 512, device="cuda").bfloat16()
    torch._dynamo.reset()
    got = torch.compile(q)(x)
    want = x.float() @ dequantize(q.words, q.scale, q.zero, torch.float32).t()
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=2e-2)


@cuda
def test_bf16_optimizer_state_on_the_gpu_matches_torch_fused_adamw():
    """train.optimizer_dtype bf16 through the Triton AdamW (one launch over all buckets, weight decay by its
    table) on a bf16 model against torch's fused AdamW on bf16 parameters and states: the same losses to
    rounding, every weight within one bf16 ulp after the first step (the two kernels' fp32 operations in
    different orders can round a result the other way), all but a few elements close after three, and no fp32
    master kept."""
    from shardlm.config import load_config
    from shardlm.model import build_model
    from shardlm.parallel.engine import LocalEngine
    from shardlm.precision import NoLossScaler
    cfg = load_config("tiny", {"train.precision": "bf16", "train.optimizer_dtype": "bf16", "train.grad_clip": "0.5",
                               "train.weight_decay": "0.1", "train.device": "cuda"})
    model, ref = (build_model(cfg.model, device="cuda", dtype=torch.bfloat16, seed=1) for _ in range(2))
    engine = LocalEngine(model, cfg, NoLossScaler())
    assert engine.memory()["optimizer"] == 4 * engine.flat.numel
    t = cfg.train
    groups = [{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)
    ids = torch.randint(0, 200, (4, 17), generator=torch.Generator().manual_seed(0)).cuda()
    ulp = torch.finfo(torch.bfloat16).eps

    def ulps_apart():
        # in ulps of the weight or of the step (lr): where a step all but cancels a weight, a rounding of the
        # step (of its bf16 moments, in either kernel) can outweigh the weight's own ulp
        return {name: (p.float() - q.float()).abs() / (ulp * q.float().abs().clamp(min=1e-2))
                for (name, p), q in zip(model.named_parameters(), ref.parameters())}

    for step in range(3):
        loss, ref_loss = model(ids[:, :-1], ids[:, 1:]), ref(ids[:, :-1], ids[:, 1:])
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)
        loss.backward()
        ref_loss.backward()
        norm = sum(p.grad.float().pow(2).sum() for p in ref.parameters()).sqrt()
        ref_opt.grad_scale = 1 / torch.clamp(t.grad_clip / (norm + 1e-6), max=1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.optimizer_step(1e-2, 1)
        if step == 0:  # the same gradients: the two kernels' arithmetic alone
            for name, apart in ulps_apart().items():
                assert apart.max() <= 1, (name, apart.max().item())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # Later steps' gradients differ by those ulps, and Adam's normalised update turns a near-zero gradient of
    # the other sign into a step of lr the other way: all but a few of each weight's elements stay close.
    for name, apart in ulps_apart().items():
        assert (apart > 3).float().mean() < 1e-3, (name, (apart > 3).float().mean().item())


@cuda
@pytest.mark.parametrize("recompute", ["none", "full-skip-down"])
def test_compiled_lora_blocks_equal_eager_in_bf16(recompute):
    """Compiled by Inductor on a GPU, each adapted linear is one operator (model/lora_linear.py: cuBLAS
    accumulates the base product onto the adapters' update, forward and backward): the loss and every
    adapter's gradient equal the eager blocks' within bf16's rounding."""
    import copy

    from helpers import tiny_decoder
    model, cfg = tiny_decoder({"lora.rank": "8", "train.recompute": recompute})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model = model.cuda().bfloat16()
    model.set_recompute(recompute)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 129), generator=g).cuda()
    out = []
    for compiled in (False, True):
        run = copy.deepcopy(model)
        if compiled:
            for block in run.blocks():
                block.compile()
        loss = run(ids[:, :-1], ids[:, 1:])
        loss.backward()
        out.append((loss.detach().float(), {n: p.grad.float() for n, p in run.named_parameters() if p.requires_grad}))
    (eager_loss, eager), (loss, grads) = out
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=0)
    assert eager.keys() == grads.keys() and eager
    for name, want in eager.items():
        assert want.norm() > 0, name
        assert (grads[name] - want).norm() <= 0.03 * want.norm(), name


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@two_gpus
@pytest.mark.parametrize("one_shot", [True, False])
def test_tensor_parallel_decode_on_gpus_gives_one_gpus_tokens(one_shot, tmp_path):
    """tp 2 decoding over NCCL, its all-reduces by the one-shot kernel over symmetric memory or by NCCL
    inside the decode step's CUDA graphs: one GPU's greedy tokens, and the kernel asked for is the one run."""
    import dist_fns
    from helpers import save_hf

    from shardlm.inference import Engine, Request, load_pretrained
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    prompts = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6]]
    model, _, _ = load_pretrained(tmp_path / "hf", device="cuda", dtype="fp32")
    want = [r.tokens for r in Engine(model, 2, compile=True).run([Request(p, 12) for p in prompts])]
    got = run_distributed(dist_fns.tp_decode_on_gpus, 2, tmp_path / "hf", prompts, 12, one_shot, timeout=300,
                          device="cuda")
    assert got == [[want, one_shot]] * 2


@two_gpus
@pytest.mark.parametrize("one_shot", [True, False])
def test_tensor_parallel_prefill_graphs_give_one_gpus_tokens(one_shot, tmp_path):
    """Prefill passes replayed as CUDA graphs over tp 2 (their all-reduces NCCL's inside the graphs, or the
    one-shot kernel's where a pass is small): one GPU's greedy tokens, prompts of 1 to 40 tokens."""
    import dist_fns
    from helpers import save_hf

    from shardlm.inference import Engine, Request, load_pretrained
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    prompts = [[5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(2, 42))]
    model, _, _ = load_pretrained(tmp_path / "hf", device="cuda", dtype="fp32")
    want = [r.tokens for r in Engine(model, 3, compile=True).run([Request(p, 12) for p in prompts])]
    got = run_distributed(dist_fns.tp_decode_on_gpus, 2, tmp_path / "hf", prompts, 12, one_shot, "fp32", 2048,
                          timeout=300, device="cuda")
    assert got == [[want, one_shot]] * 2


@two_gpus
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_one_row_tensor_parallel_decode_fuses_each_product_with_its_all_reduce(dtype, tmp_path):
    """Batch-1 decoding at tp 2: the row-parallel products and their sums as one kernel (gemv_all_reduce.py)
    give the tokens of one GPU (fp32) or of NCCL's all-reduces (bf16, each sum one addition either way), every
    rank the same; NCCL's run never takes the fused kernel."""
    import dist_fns
    from helpers import save_hf

    from shardlm.inference import Engine, Request, load_pretrained
    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    fused, nccl = (run_distributed(dist_fns.tp_decode_on_gpus, 2, tmp_path / "hf", prompts, 16, flag, dtype, None,
                                   True, timeout=300, device="cuda") for flag in (True, False))
    assert [r[1:] for r in fused] == [[True, True]] * 2 and [r[1:] for r in nccl] == [[False, False]] * 2
    if dtype == "fp32":
        model, _, _ = load_pretrained(tmp_path / "hf", device="cuda", dtype="fp32")
        want = [r.tokens for r in Engine(model, 1, compile=True).run([Request(p, 16) for p in prompts])]
    else:
        want = nccl[0][0]
    assert fused[0][0] == fused[1][0] == nccl[1][0] == want


@two_gpus
def test_one_shot_and_nccl_collectives_give_the_same_bf16_tokens(tmp_path):
    """In bf16, as users serve: at tp 2 each sum is one addition either way and the gathered logits are copies,
    so the tokens are the same; the one-token prompt's prefill all-reduces fit the buffers and take the one-shot
    kernel too, in the prefill's compiled block (dynamic shapes)."""
    import dist_fns
    from helpers import save_hf

    from shardlm.testing.distributed import run_distributed
    save_hf("llama", tmp_path / "hf")
    prompts = [[5], [3, 1, 4, 1, 5, 9, 2, 6]]
    one_shot, nccl = (run_distributed(dist_fns.tp_decode_on_gpus, 2, tmp_path / "hf", prompts, 12, flag, "bf16",
                                      timeout=300, device="cuda") for flag in (True, False))
    assert one_shot[0][0] == one_shot[1][0] == nccl[0][0] == nccl[1][0]
    assert [r[1] for r in one_shot] == [True, True] and [r[1] for r in nccl] == [False, False]


@two_gpus
@pytest.mark.parametrize("protocol", ["ll", "ll-strong", "barrier"])
def test_fused_product_and_all_reduce_sums_every_call_of_many_replays(protocol):
    """The one-row product and all-reduce kernel, 64 of llama2-7b's products at tp 2 in a CUDA graph replayed
    300 times (19,456 calls with the warm-up): every sum within bf16's rounding of NCCL's, the same bits every
    replay, no program given up or finding its peer ahead. The LL protocol's kernel once let a warp take the
    next call's count and hung both ranks a few thousand calls in."""
    import dist_fns

    from shardlm.testing.distributed import run_distributed
    got = run_distributed(dist_fns.fused_all_reduce_replays, 2, protocol, 300, timeout=240, device="cuda")
    for err, same, fault in got:
        assert fault is None and same and err < 2**-7, (err, same, fault)


@cuda
def test_one_row_gemv_is_the_product_to_rounding_in_and_out_of_cuda_graphs():
    """model/gemv.py on llama2-7b's one-row shapes against cuBLAS's bf16 product (within bf16's rounding of the
    output), the same bits every call; a tiny bf16 Llama's compiled engine (the kernel inside its CUDA graphs,
    no skip) gives the eager engine's tokens at one row and at three; a one-token forward's logits equal
    cuBLAS's within bf16's rounding through the layers (greedy tokens of random weights may differ at a near
    tie)."""
    import dataclasses
    from unittest import mock

    from shardlm.config import load_config
    from shardlm.model import build_model, gemv
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((12288, 4096), (4096, 11008), (16000, 4096), (100, 72)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            y = gemv.linear(x, w)
            want = x.double() @ w.double().t()
            assert y.shape == (1, 1, n) and torch.equal(gemv.linear(x, w), y)
        assert ((y.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all(), (n, k)
    cfg = dataclasses.replace(load_config("tiny").model, init_std=0.2)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=3).eval()
    decodes_in_cuda_graphs_as_eagerly(model)
    ids = torch.tensor([[17]], device="cuda")  # one row of one token: every product by the kernel
    with torch.no_grad():
        kernel = model(ids).float()
        with mock.patch.object(gemv, "one_row", lambda x, w: False):
            plain = model(ids).float()
    torch.testing.assert_close(kernel, plain, rtol=0, atol=0.05 * plain.abs().max().item())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_triton_products_launch_on_their_tensors_gpu_not_the_current_one():
    """With cuda:0 current, the one-row GEMV, int8's and int4's products and decode attention (and its fused
    step's cache writes) on cuda:1's tensors give what they give on cuda:0 (Triton launches on the current
    device unless told)."""
    from shardlm.inference.decode_attention import attention_step, decode_attention
    from shardlm.inference.int4 import Int4Linear
    from shardlm.inference.int8 import Int8Linear
    from shardlm.model import gemv

    def outputs(device):
        torch.manual_seed(0)
        lin = torch.nn.Linear(256, 64, bias=False).to(device, torch.bfloat16)
        x = torch.randn(1, 1, 256, device=device, dtype=torch.bfloat16)
        q = torch.randn(1, 4, 1, 64, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 4, 40, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
        bounds = (torch.zeros(1, dtype=torch.int32, device=device), torch.full((1,), 40, dtype=torch.int32,
                                                                                device=device))
        qkv = torch.randn(1, 1, 12 * 64, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            return [gemv.linear(x, lin.weight), Int8Linear(lin)(x), Int4Linear(lin)(x),
                    decode_attention(q, k, v, None, bounds),
                    attention_step(qkv, None, k, v, torch.full((1, 1), 39, device=device), 4, 40, 0, 40), k, v]

    torch.cuda.set_device(0)
    for got, want in zip(outputs("cuda:1"), outputs("cuda:0")):
        assert got.device == torch.device("cuda:1")
        assert torch.equal(got.cpu(), want.cpu())


@cuda
def test_server_metrics_report_its_gpu_memory(tmp_path):
    """/metrics' memory keys are the serving process's own allocator counts: at least the weights and the
    cache it holds, the peak at least the current."""
    import threading

    from helpers import save_hf

    from shardlm.inference import Engine, Request, load_pretrained
    from shardlm.serve.worker import EngineWorker
    save_hf("llama", tmp_path / "hf")
    model, _, _ = load_pretrained(tmp_path / "hf", device="cuda", dtype="fp32")
    engine = Engine(model, 2, compile=False)
    worker = EngineWorker(engine).start()
    try:
        done = threading.Event()
        worker.submit(Request([5, 9, 2], 4), lambda r, error: done.set())
        assert done.wait(60)
        m = worker.metrics()
    finally:
        worker.close(60)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for t in (*engine.cache.k, *engine.cache.v))
    assert m["memory_peak_bytes"] >= m["memory_bytes"] >= held > 0


@cuda
def test_an_asynchronous_save_of_16_bit_state_resumes_on_the_gpu(tmp_path):
    """An asynchronous save's page-locked staging holds each piece in the dtype it is written in (a LoRA run's
    bf16 base beside its fp32 adapters' masters and moments): the run resumes on its trajectory."""
    import dist_fns
    over = {"lora.rank": "4", "train.precision": "bf16", "train.steps": "4", "train.save_every": "2",
            "train.device": "cuda", "train.checkpoint_async": "true", "parallel.dp": "1"}
    full = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "a"))
    resumed = dist_fns.train_and_capture(0, 1, over, str(tmp_path / "b"),
                                         str(tmp_path / "a" / "checkpoints" / "step_00000002"))
    assert resumed["losses"] == full["losses"][2:]


@cuda
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_model_quantised_as_it_loads_on_the_gpu_is_the_one_quantised_after(tmp_path, kind):
    """generate/serve --quantize quantise each block as it is filled on the device: the same weights as the
    whole model loaded and then quantised, and the peak no higher."""
    import dataclasses

    from shardlm.config import load_config
    from shardlm.inference import load_pretrained
    from shardlm.inference.quantize import quantize
    from shardlm.model import build_model
    from shardlm.model.hf import write_hf_dir
    cfg = dataclasses.replace(load_config("tiny").model, init_std=0.2)
    from shardlm.tokenizer import load_tokenizer
    write_hf_dir(build_model(cfg, seed=3).state_dict(), cfg, tmp_path / "hf", load_tokenizer("byte"))
    torch.cuda.reset_peak_memory_stats()
    model, _, _ = load_pretrained(tmp_path / "hf", device="cuda", dtype="bf16", quantize=kind)
    by_block = torch.cuda.max_memory_allocated()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ref, _, _ = load_pretrained(tmp_path / "hf", device="cuda", dtype="bf16")
    quantize(ref, kind)
    assert torch.cuda.max_memory_allocated() >= by_block
    ids = torch.randint(0, cfg.vocab_size, (1, 16), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
