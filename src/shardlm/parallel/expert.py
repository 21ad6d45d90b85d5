"""Expert parallelism (`parallel.ep`, carved out of dp x cp): each MoE layer's routed experts split over the
ep group in contiguous blocks, tokens sent to the ranks that hold their experts and back (torchtitan's
`token_dispatcher.py`, Megatron-core's alltoall dispatcher).

`expert_parallel(model, mesh)` runs on the meta model, before the weights are materialised. Each MoE layer
keeps experts [r E/ep, (r + 1) E/ep) of the stacked weights (`mlp.experts.up.weight` [E/ep, 2f, h],
`mlp.experts.down.weight` [E/ep, h, f]), described by a sharding along dim 0 over the "ep" axis
(sharding.TPSharding with axis "ep"), which everything that maps local to full reads: initialisation draws
the full [E, ...] tensor and keeps the block (the values of one process's experts of those ids), sharded
checkpoints record it per piece (any ep degree reassembles the full tensor), `Parallelized.gather_full_state`
gathers the blocks over ep and `load_full_state` takes them. The experts' parameters are placed on the
expert view (`DataPlacement(reduce="edp")`; "edp+tp" under tensor parallelism, whose ranks each route their
own tokens: parallel/moe_tensor.py): their gradients, which already hold the tokens every ep rank sent them,
are summed over that view and divided by dp x cp as the dense ones are. The router and the shared
expert stay dense.

The layer's dispatch becomes an all-to-all one (`ExpertParallelMoE.run_experts`), with these collectives
over the ep group, each inside the step's forward (and again in a recomputed one):
  1. `all_to_all_single` of the per-expert counts [E] (this rank's token copies for every expert, sorted by
     expert already): each rank learns how many rows every peer sends each of its local experts;
  2. `all_to_all_single` of the rows, variable-sized (dispatch), inside `_AllToAll`, whose backward is the
     reverse exchange of the gradients;
  3. the local experts' grouped GEMMs on what arrived, rows regrouped by local expert;
  4. `all_to_all_single` of the outputs back (combine), again inside `_AllToAll`.
`parallel.ep_dispatch` picks how the rows travel. "exact" sends each peer exactly its rows: their counts must
reach the host first (one sync a layer), which under a compiled block is a graph break and an eager island of
small operators; two H200s spent 40% of an ep 2 step idle behind the host that way (bench/README.md).
"padded" (torchtitan's and DeepSpeed's fixed-capacity form, at the dropless capacity) sends every peer a
block of as many rows as this rank has token copies, its rows first and padding after, so that nothing waits
for the host and the whole block compiles (with the grouped GEMM kernel; the loop fallback reads its group
sizes): the same rows reach the same experts, at ep times the rows a balanced load moves and holds (what the
exact form needs under its worst load). It needs as many copies on every rank: dropless routing over
micro-batches of one shape (training's windows, evaluation's shared batches); capacity routing's survivors,
whose count the host knows anyway, go exactly. "auto": padded at ep 2, where that is twice a balanced load,
exact beyond.
Under imbalance the exact form's rows grow with the router's choice, up to ep balanced loads on one rank: past
`parallel.ep_load_budget` balanced loads the local experts run in checkpointed chunks (parallel/expert_chunks.py),
so dropless stays dropless within a stated memory. The padded form needs no chunks (its blocks are ep balanced
loads whatever the routing: the worst case, held always), nor does one process (its experts take its own
token copies, one balanced load).

Routing, the auxiliary losses and the load stay the layer's, on this rank's tokens, as at one process: the
balance loss of a micro-batch is computed on that micro-batch's tokens at every layout (its counts over the cp
group where ep spans context-parallel ranks: parallel/context.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..model.lazy_compiler import eager
from ..model.moe import MoE, in_backward, moe_layers
from ..sharding import TPSharding
from .expert_chunks import budget_rows, run_in_chunks
from .placement import DataPlacement, gather_full, place, tag


def expert_parallel(model: nn.Module, mesh, padded: bool = False, load_budget: float = 0.0) -> None:
    """Split every MoE layer's routed experts over mesh axis "ep" (a no-op at ep 1), their rows sent in
    fixed-size blocks where `padded` (ParallelConfig.ep_padded; the module docstring), else by exact counts,
    run in chunks past `load_budget` balanced loads (parallel.ep_load_budget; 0: never); on the meta model."""
    ep = mesh.size("ep")
    if ep == 1:
        return
    group, rank = mesh.group("ep"), mesh.coord("ep")
    for layer in moe_layers(model):
        if layer.num_experts % ep:
            raise ValueError(f"parallel.ep = {ep} must divide the {layer.num_experts} experts")
        for linear in (layer.experts.up, layer.experts.down):
            full = linear.weight
            block = full.shape[0] // ep
            linear.weight = nn.Parameter(torch.empty(block, *full.shape[1:], dtype=full.dtype, device=full.device),
                                         requires_grad=full.requires_grad)
            tag(linear, {"weight": TPSharding(rank, ep, 0, (full.shape[0],), (True,), axis="ep")})
            place(linear, DataPlacement(reduce=expert_reduce_view(mesh.size("tp"))))
        layer.__class__ = ExpertParallelMoE
        layer.ep_group, layer.ep, layer.ep_rank = group, ep, rank
        layer.padded, layer.load_budget = padded, load_budget


def expert_reduce_view(tp: int) -> str:
    """The mesh view over which routed experts' gradients are summed: their replicas (edp), and under tensor
    parallelism the tp ranks as well, each of which routes its own tokens through its whole experts
    (parallel/moe_tensor.py)."""
    return "edp+tp" if tp > 1 else "edp"


class ExpertParallelMoE(MoE):
    """A MoE layer whose routed experts are this rank's block of E/ep: token copies go to the ranks holding
    their experts and come back by all-to-all (the module docstring's four steps)."""

    ep_group = None
    ep = 1
    ep_rank = 0
    padded = False
    load_budget = 0.0
    chunked = 0  # training forwards whose experts ran in chunks since the last take (MoEBalance.stats)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, copies: int) -> torch.Tensor:
        # Blocks of one size need as many rows on every rank: dropless routing's token copies of micro-batches
        # of one shape, not capacity routing's survivors (whose count the host knows already).
        dropless = not (self.capacity_factor > 0 and self.training)
        return self._padded(rows, counts) if self.padded and dropless else self._exact(rows, counts, copies)

    def _padded(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The four steps over fixed-size blocks: n rows to every peer (n = this rank's token copies), each
        block this rank's rows for that peer and then padding; no host sync."""
        ep, local, (n, h) = self.ep, self.num_experts // self.ep, rows.shape
        # 1. counts exchanged: received[s, e] rows from rank s for local expert e.
        received = funcol.all_to_all_single(counts, None, None, self.ep_group).view(ep, local)
        # 2. dispatch: rows are sorted by expert, so by destination; block r takes rows [start_r, start_r +
        # send_r), padded with a zero row (index n) that also absorbs the padding's gradients.
        send = counts.view(ep, local).sum(1)
        end = send.cumsum(0)
        start = end - send
        j = torch.arange(n, device=rows.device)
        src = torch.where(j < send[:, None], start[:, None] + j, n)
        blocks = torch.cat([rows, rows.new_zeros(1, h)])[src.view(-1)]
        arrived = funcol.all_to_all_single_autograd(blocks, None, None, self.ep_group)  # [ep n, h]
        # Arrived slot (s, j) holds local expert e's row where j falls in e's range of source s's block, or
        # padding (e = local). 3. the local experts on the rows grouped by expert (then source, then j), the
        # padding last, where the grouped GEMMs leave it out (its outputs go back as padding, never read, and
        # take no gradient).
        expert = (j[None, :, None] >= received.cumsum(1)[:, None, :]).sum(-1)  # [ep, n]
        slot = torch.arange(ep * n, device=rows.device)
        order = (expert.view(-1) * (ep * n) + slot).argsort()
        out = self.experts(arrived[order], received.sum(0), self.impl)
        back = torch.empty_like(order).scatter_(0, order, slot)
        # 4. combine: every slot's output back to the block (and place) it came from, and each row out of its
        # block: row i of destination r sits at slot r n + i - start_r.
        returned = funcol.all_to_all_single_autograd(out[back], None, None, self.ep_group)
        dest = (j[:, None] >= end).sum(-1)
        return returned[dest * n + j - start[dest]]

    @eager  # host-side split sizes and collectives: run eagerly between compiled graphs
    def _exact(self, rows: torch.Tensor, counts: torch.Tensor, copies: int) -> torch.Tensor:
        ep, local = self.ep, self.num_experts // self.ep
        # 1. counts exchanged: received[s, e] rows from rank s for local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)
        received = received.view(ep, local)
        # The split sizes and the local experts' rows on the host, one sync for all: rows are sorted by expert,
        # so by destination rank.
        sizes = torch.cat([counts.view(ep, local).sum(1), received.sum(1), received.sum(0)]).tolist()
        send, recv, per_expert = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
        # 2. dispatch: rows arrive ordered by (source rank, local expert); regrouped by local expert (stable:
        # each expert sees its rows in source-rank order) for the grouped GEMMs.
        arrived = _AllToAll.apply(rows, recv, send, self.ep_group)
        expert_of = torch.repeat_interleave(torch.arange(local, device=rows.device).repeat(ep), received.reshape(-1),
                                            output_size=sum(recv))
        order = expert_of.argsort(stable=True)
        # 3. the local experts: in checkpointed chunks past the budget (parallel/expert_chunks.py).
        size = budget_rows(self.load_budget, copies)  # in balanced loads: the copies routed, dropped ones too
        if size and sum(recv) > size:
            out = run_in_chunks(self.experts, arrived[order], per_expert, size, self.impl)
            if self.training and not in_backward():  # a recomputed block's second forward would count it twice
                self.chunked += 1
        else:
            out = self.experts(arrived[order], received.sum(0), self.impl)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        # 4. combine: each output row back to the rank (and place) its token copy came from.
        return _AllToAll.apply(out[back], send, recv, self.ep_group)


class _AllToAll(torch.autograd.Function):
    """Rows [N, d] exchanged over `group` by `all_to_all_single`: `send[r]` rows to rank r, `recv[r]` from
    it; the backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def gather_experts(masters: dict | None, optim: dict | None, specs: dict, mesh, device):
    """Full state (a rank's engines' masters and optimizer state by name, its experts' blocks as it holds
    them) with the experts' blocks joined over ep onto the ep group's first rank (None, None on the others
    and on ranks past the first expert replica, edp coordinate > 0, whose ep groups skip the gather)."""
    if mesh.size("ep") == 1 or masters is None:
        return masters, optim
    if mesh.coord("edp"):
        return None, None
    ep_specs = {n: s for n, s in specs.items() if s.axis == "ep"}
    group = mesh.group("ep")
    masters = gather_full(masters, ep_specs, group, device)
    optim = gather_full(optim, ep_specs, group, device)
    return masters, optim
