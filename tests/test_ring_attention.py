"""Ring attention (parallel/ring_attention.py) block by block: the zig-zag layout (which chunks and positions
each rank holds, the work each ring step gives it), the block kernel each device and dtype takes, the fused
CPU kernel actually run, and the output and gradients against SDPA over the whole sequence (gloo, fp32) with
causal, sliding-window and packed-document masks, with and without grouped-query attention. The trainer's
runs at cp 2 and 4 against one process are tests/test_context_parallel.py's (comm p2p)."""
import pytest
import ring_fns
import torch

from shardlm.parallel.context import ContextParallel, zigzag_layout
from shardlm.parallel.ring_attention import ring_blocks
from shardlm.parallel.ring_kernels import ring_kernel, sdpa_prefers_cudnn
from shardlm.testing.distributed import run_distributed


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_layout_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i(cp):
    T, c = 8 * cp, 4
    ids = torch.arange(T).repeat(2, 1)
    held = []
    for rank in range(cp):
        context = ContextParallel(None, rank, cp, "p2p", zigzag=True)
        assert context.chunks(rank) == (rank, 2 * cp - 1 - rank)
        want = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
        assert torch.equal(context.local(ids), want.repeat(2, 1))  # token ids and labels alike
        assert torch.equal(context.order(T, "cpu"), want)  # the positions RoPE and position embeddings take
        assert torch.equal(context.indices(rank, T), want)
        held.append(want)
    assert torch.equal(torch.cat(held).sort().values, torch.arange(T))  # every token once
    contiguous = ContextParallel(None, 1, cp, "a2a")
    assert contiguous.order(T, "cpu") is None and torch.equal(contiguous.local(ids[0]), torch.arange(8, 16))
    assert zigzag_layout("p2p", 0.0) and not zigzag_layout("a2a", 0.0)
    assert not zigzag_layout("p2p", 1.25)  # capacity's queues run along each rank's contiguous slice


@pytest.mark.parametrize("cp", [2, 4])
def test_every_ring_step_scores_half_a_square_of_causal_blocks_on_every_rank(cp):
    """Zig-zag's load balance: at each step every rank scores the same number of (query, key) pairs, half its
    square (its own chunks causally, an earlier rank's first chunk for all queries, a later rank's pair for its
    second chunk's queries), never a block the causal mask hides; the contiguous layout idles."""
    s = 8
    q = torch.empty(1, 1, s, 1)

    def work(context, holder):
        return sum((qs.stop - qs.start) * (ks.stop - ks.start) / (2 if causal else 1)
                   for qs, ks, causal, _ in ring_blocks(context, holder, None, q))
    for step in range(cp):
        for rank in range(cp):
            context = ContextParallel(None, rank, cp, "p2p", zigzag=True)
            assert work(context, (rank - step) % cp) == s * s / 2
            for qs, ks, causal, _ in ring_blocks(context, (rank - step) % cp, None, q):
                positions = context.indices(rank, cp * s)[qs]
                keys = context.indices((rank - step) % cp, cp * s)[ks]
                assert causal or bool((keys[None, :] < positions[:, None]).all())  # unmasked blocks fully seen
    flat = [work(ContextParallel(None, r, cp, "p2p"), 0) for r in range(cp)]
    assert flat[0] == s * s / 2 and flat[1] == s * s  # contiguous: rank 0 half, the others all or nothing


@pytest.mark.parametrize("window", [2, 5, 16])
def test_the_ring_plan_keeps_the_blocks_a_mask_leaves_visible_and_marks_those_it_cuts(window):
    """ring_plan decides every step's calls at once: a call is kept when its block of the mask shows a key,
    unmasked when it shows all of them, and ring_blocks hands out exactly those blocks."""
    from shardlm.parallel.ring_attention import ring_plan
    cp, T = 2, 16
    i = torch.arange(T)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - window)
    q = torch.empty(1, 1, T // cp, 1)
    for rank in range(cp):
        context = ContextParallel(None, rank, cp, "p2p", zigzag=True)
        plan = ring_plan(context, mask, q)
        for step in range(cp):
            holder = (rank - step) % cp
            block = mask[context.indices(rank, T)][:, context.indices(holder, T)]
            for (qs, ks, causal, masked), (_, _, _, sub) in zip(plan[step], ring_blocks(context, holder, mask, q)):
                assert not causal and bool(block[qs, ks].any()) and masked == (not bool(block[qs, ks].all()))
                assert (sub is None) == (not masked) and (sub is None or torch.equal(sub, block[qs, ks]))
            kept = {(qs.start, ks.start) for qs, ks, *_ in plan[step]}
            for qs, ks, _ in [(a, b, c) for a, b, c, _ in ring_blocks(context, holder, None, q)]:
                assert ((qs.start, ks.start) in kept) == bool(block[qs, ks].any())


def test_a_block_row_the_mask_hides_entirely_comes_out_0_and_adds_nothing_to_the_merged_row():
    from shardlm.parallel.ring_attention import merge
    from shardlm.parallel.ring_kernels import block_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[1] = False  # query row 1 sees no key of this block
    out, lse, _ = block_forward(ring_kernel("cpu", torch.float32, True), q, k, v, False, mask)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 8)) and bool(torch.isneginf(lse[:, :, 1]).all())
    merged, merged_lse = torch.ones(1, 2, 4, 8), torch.zeros(1, 2, 4)
    merge(merged, merged_lse, out, lse)
    assert torch.equal(merged[:, :, 1], torch.ones(1, 2, 8)) and torch.equal(merged_lse[:, :, 1], torch.zeros(1, 2))
    assert torch.isfinite(merged).all()


def test_block_kernel_choice():
    assert ring_kernel("cpu", torch.float32, False) == ring_kernel("cpu", torch.bfloat16, True) == "flash_cpu"
    assert ring_kernel("cuda", torch.bfloat16, False) == ring_kernel("cuda", torch.float16, False) == "flash"
    assert ring_kernel("cuda", torch.float32, False) == ring_kernel("cuda", torch.bfloat16, True) == "efficient"
    assert ring_kernel("mps", torch.float32, False) == "math"
    # where SDPA itself would take cuDNN's attention (Hopper), 16-bit blocks take it, masked or not
    assert ring_kernel("cuda", torch.bfloat16, False, cudnn=True) == ring_kernel("cuda", torch.float16, True, True) \
        == "cudnn"
    assert ring_kernel("cuda", torch.float32, True, cudnn=True) == "efficient"
    assert not sdpa_prefers_cudnn(torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 4, 8))


@pytest.mark.parametrize("mask", ["causal", "window", "documents"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("kernel", [None, "math"], ids=["fused", "math"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_sdpa_over_the_whole_sequence(cp, kernel, heads, mask):
    for got, want, calls, _ in run_distributed(ring_fns.ring_versus_sdpa, cp, mask, kernel, heads, timeout=60):
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
        assert set(calls) == {kernel or "flash_cpu"} and calls[kernel or "flash_cpu"] > 0


@pytest.mark.parametrize("case", ["mha", "gqa", "window", "packed"])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_model_under_ring_attention_runs_the_fused_cpu_kernel_and_equals_one_process(cp, case):
    """The tiny Llama, with 4 query heads over 4 key/value heads or 8 over 2 (mha, gqa), a sliding window and packed
    examples: every block through aten's fused CPU flash kernel, the loss and every gradient one process's."""
    one = ring_fns.ring_model_step(0, 1, case)
    for loss, grads, calls in run_distributed(ring_fns.ring_model_step, cp, case, timeout=120):
        assert set(calls) == {"flash_cpu"} and calls["flash_cpu"] > 0
        assert loss == pytest.approx(one[0], rel=1e-6)
        for name, want in one[1].items():
            torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mask", ["causal", "window", "documents"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_ring_attention_on_gpus_is_as_close_to_fp32_as_sdpa(dtype, heads, mask):
    """NCCL, cp 2: bf16 blocks through cuDNN's attention where SDPA would take it (Hopper), else FlashAttention's
    for causal blocks and the efficient kernel for masked ones; fp32 blocks through the efficient kernel; the
    output and gradients within a few times SDPA's own error (in the same dtype) of fp32 SDPA."""
    def local(h):  # a rank's queries or keys as ring_versus_sdpa hands them over: [2, h, 256, 64] of [b, s, h, d]
        return torch.zeros(2, 256, h, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    cudnn = sdpa_prefers_cudnn(local(heads[0]), local(heads[1]))
    kernels = {"efficient"} if dtype == torch.float32 else {"cudnn"} if cudnn else {"flash", "efficient"}
    for got, low, calls, fp32 in run_distributed(ring_fns.ring_versus_sdpa, 2, mask, None, heads, dtype, 512,
                                                 timeout=180, device="cuda"):
        assert set(calls) <= kernels and calls, calls
        errors = {name: ((g - want).abs().max().item(), (lo - want).abs().max().item())
                  for name, g, lo, want in zip(("out", "dq", "dk", "dv"), got, low, fp32)}
        tolerance = 1e-3 if dtype == torch.bfloat16 else 1e-4
        assert all(err <= 4 * base + tolerance for err, base in errors.values()), (calls, errors)
