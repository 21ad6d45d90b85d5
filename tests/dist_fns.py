"""Module-level functions that the spawned test workers import by name."""
import time

import torch
import torch.distributed as dist


def all_reduce_rank(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def hang_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a peer that never comes
    return t.item()


def raise_on_rank_zero(rank, world):
    if rank == 0:
        raise RuntimeError("boom on rank 0")
    return rank


def mesh_groups(rank, world, dp, tp, pp):
    from shardlm.mesh import build_mesh
    m = build_mesh(dp, tp, pp)
    members = {}
    for axis in ("dp", "tp", "pp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=getattr(m, f"{axis}_group"))
        members[axis] = t.item()
    return (m.dp_rank, m.tp_rank, m.pp_rank), members


def tensor_parallel_mlp(rank, world, seed, distributed=True):
    """Embedding -> column -> row MLP with the vocabulary and features split over `world` ranks (or, with
    distributed=False, the degree-1 layers on the full weights); returns the output and the local grads."""
    from shardlm.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    g = torch.Generator().manual_seed(seed)
    w1, b1, w2, b2 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    emb = torch.randn(12, 8, generator=g)
    ids = torch.randint(0, 12, (3, 5), generator=g)
    group = dist.group.WORLD if distributed else None
    e = VocabParallelEmbedding(12, 8, group=group)
    col = ColumnParallelLinear(8, 16, bias=True, group=group)
    row = RowParallelLinear(16, 8, bias=True, group=group)
    n = 16 // world
    with torch.no_grad():
        e.weight.copy_(emb.chunk(world)[rank])
        col.weight.copy_(w1[rank * n:(rank + 1) * n])
        col.bias.copy_(b1[rank * n:(rank + 1) * n])
        row.weight.copy_(w2[:, rank * n:(rank + 1) * n])
        row.bias.copy_(b2)
    x = e(ids)
    x.retain_grad()
    y = row(torch.relu(col(x)))
    y.square().sum().backward()
    return y.detach(), x.grad, col.weight.grad, row.weight.grad, e.weight.grad
