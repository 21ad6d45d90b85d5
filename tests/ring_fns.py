"""Worker functions of tests/test_ring_attention.py (run on each rank by run_distributed)."""
from collections import Counter

import torch


def ring_model_step(rank, world, case: str, kernel=None):
    """The tiny Llama's loss and gradients for one batch (as dist_fns.context_parallel_step: "causal", "gqa",
    "window", "packed"), each rank holding its zig-zag part of every sequence under ring attention, the
    gradients summed over the ranks; and the block kernels its attention ran (RingCore.kernel_calls over the
    layers). `kernel`: forced, else ring_kernel's choice."""
    import torch.distributed as dist
    from dist_fns import summed_loss_and_grads, tiny_llama_batch

    from shardlm.parallel.context import context_parallel
    model, ids, targets = tiny_llama_batch(case)
    cores = []
    if world > 1:
        context_parallel(model, dist.group.WORLD, "p2p")
        assert model.sequence.zigzag
        cores = [block.attn.core for block in model.parts().layers]
        for core in cores:
            core.kernel = kernel
        ids, targets = model.sequence.local(ids), model.sequence.local(targets)
    loss, grads = summed_loss_and_grads(model, ids, targets, world)
    return loss, grads, dict(sum((core.kernel_calls for core in cores), Counter()))


def ring_versus_sdpa(rank, world, mask_kind: str, kernel, heads=(4, 2), dtype=torch.float32, T: int = 48):
    """Ring attention over random fp32 q, k, v ([2, h, 48, 8]; `heads`: query, key/value) split zig-zag over
    the ranks, causal or under a mask ("window": 7 keys; "documents": three packed examples per row), against
    SDPA over the whole sequence: this rank's output and input gradients, both ways, and on a GPU (dtype: the
    ring's and the first SDPA's; the last SDPA's fp32) the fp32 SDPA's too, all as fp32."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardlm.parallel.context import ContextParallel
    from shardlm.parallel.ring_attention import ring_attention
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    d = 8 if device.type == "cpu" else 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, T, d, generator=g).to(device) for h in (heads[0], heads[1], heads[1]))
    dy = torch.randn(2, heads[0], T, d, generator=g).to(device)
    i = torch.arange(T, device=device)
    mask = None
    if mask_kind == "window":
        mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - 7)
    elif mask_kind == "documents":
        doc = torch.stack([torch.bucketize(i, torch.tensor([T // 5, 3 * T // 5], device=device)),
                           torch.bucketize(i, torch.tensor([T // 9, 6 * T // 7], device=device))])
        mask = ((doc[:, :, None] == doc[:, None, :]) & (i[None] <= i[:, None])).unsqueeze(1)
    context = ContextParallel(dist.group.WORLD, rank, world, "p2p", zigzag=True)

    def part(t):
        return t.index_select(2, context.indices(rank, T, device)).float().cpu()

    def sdpa(dtype):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        y = F.scaled_dot_product_attention(*x, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        y.backward(dy.to(dtype))
        return [part(t) for t in (y.detach(), *(t.grad for t in x))]
    # in the model's layout: heads are a view of [b, s, h, d] (attention.py's transpose), not contiguous
    xs = [t.to(dtype).index_select(2, context.indices(rank, T, device)).transpose(1, 2).contiguous().transpose(1, 2)
          .requires_grad_() for t in (q, k, v)]
    calls = Counter()
    got = ring_attention(*xs, mask, context, kernel, calls)
    got.backward(dy.to(dtype).index_select(2, context.indices(rank, T, device)))
    ring = [t.float().cpu() for t in (got.detach(), *(t.grad for t in xs))]
    return ring, sdpa(dtype), dict(calls), (sdpa(torch.float32) if device.type == "cuda" else None)
