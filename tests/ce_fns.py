"""Module-level workers for tests/test_cross_entropy.py (spawned ranks import them by name)."""
import torch
import torch.distributed as dist


def problem(seed, shape, hidden, vocab):
    """h, the full (unpadded) head and the targets of one test case, the same in every process. Odd seeds
    leave every third target untrained (-100, F.cross_entropy's default ignore_index: a prompt token)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g)
    t = torch.randint(0, vocab, shape, generator=g)
    if seed % 2:
        t.view(-1)[::3] = -100
    return h, w, t


def shard(w, vocab, world, rank):
    """This rank's rows of the head padded with zero rows to a multiple of `world`, and their first row."""
    rows = -(-vocab // world)
    padded = torch.cat([w, w.new_zeros(rows * world - vocab, w.shape[1])])
    return padded[rank * rows:(rank + 1) * rows].clone(), rank * rows


def vocab_parallel_cases(rank, world, cases):
    """For each (seed, shape, hidden, vocab, chunk): the loss, the partial and the summed grad of h, the
    local weight's grad, and the no-grad loss."""
    from shardlm.parallel.cross_entropy import vocab_parallel_cross_entropy
    from shardlm.parallel.tensor import copy_to_tp
    group = dist.group.WORLD
    out = []
    for seed, shape, hidden, vocab, chunk in cases:
        h, w, t = problem(seed, shape, hidden, vocab)
        w_local, start = shard(w, vocab, world, rank)
        h.requires_grad_()
        w_local.requires_grad_()
        x = copy_to_tp(h, group)  # the caller's side of the contract: sums the partial grads of h
        x.retain_grad()
        loss = vocab_parallel_cross_entropy(x, w_local, t, group, start, vocab, chunk=chunk)
        loss.backward()
        with torch.no_grad():
            eval_loss = vocab_parallel_cross_entropy(h, w_local, t, group, start, vocab, chunk=chunk)
        out.append(dict(loss=loss.detach(), grad_h_partial=x.grad, grad_h=h.grad, grad_w=w_local.grad,
                        eval_loss=eval_loss))
    return out


def vocab_parallel_autocast(rank, world, seed, shape, hidden, vocab, chunk):
    """Under CPU bf16 autocast: the loss (fp32) and the weight's grad, which must come back in fp32."""
    from shardlm.parallel.cross_entropy import vocab_parallel_cross_entropy
    h, w, t = problem(seed, shape, hidden, vocab)
    w_local, start = shard(w, vocab, world, rank)
    w_local.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = vocab_parallel_cross_entropy(h, w_local, t, dist.group.WORLD, start, vocab, chunk=chunk)
    loss.backward()
    return loss.detach(), w_local.grad
