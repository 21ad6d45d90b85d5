"""ZeRO stage 3: parameters sharded too (Rajbhandari et al. 2020), with parameter offload to the CPU as an
option (ZeRO-Offload / ZeRO-Infinity's CPU tier, Ren et al. 2021).

Buckets are units: one per transformer block, one for the input embeddings, one for the final norm and
output head (one root unit holding embeddings, final norm and head when the head is tied to the
embedding), and one for all parameters of at most `parallel.persist_threshold` elements, which stay
whole ("unsharded"). The model says which module is which (`model.parts()`). A block's unit is
all-gathered just before its forward and again before its backward (when the gradient of its output
arrives), its storage freed after each; the next units' all-gathers (`parallel.prefetch_units` of them)
are issued early so they overlap the current block's compute. The embedding unit is freed as soon as the embeddings are looked up (their
backward needs no weights), the head unit after backward.

As in FSDP2, the 16-bit weights are not stored: each gather casts the rank's fp32 master slice, so
parameters cost (2 + K) Phi / N per rank instead of (2 + 2 + K) Phi / N; with parameter offload the
16-bit slice is kept in pinned CPU memory instead, or with `parallel.offload_dir` in a file on a local disk
(ZeRO-Infinity's NVMe tier for parameters, Rajbhandari et al. 2021), read through the page cache. Gradients are reduced as in stage 2 (zero.py), one
unit in flight. By the copy engines, each gather puts the rank's cast slice into one of two small
symmetric slots and pulls the peers' (comm/copy_engine.py), still with no 16-bit weights at rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..flat import FlatParams, alloc_storage, free_storage, trainable
from ..runtime.device import host_empty
from ..sharded_read import as_lazy
from .offload_disk import MappedFiles
from .zero import ZeroEngine
from .zero3_frozen import FrozenShards


def stage3_units(model: nn.Module, persist_threshold: int, names=None) -> list[list[str]]:
    """Units in the order backward completes them: the head, blocks last-to-first, the small unsharded
    parameters, the embeddings (one root unit holding embeddings, final norm and head when they are tied).
    `names`: one parameter group's (None: every trainable parameter)."""
    parts = model.parts()
    named = trainable(model, names)
    name_of = {id(p): n for n, p in named}
    small = [n for n, p in named if p.numel() <= persist_threshold]

    def unit(modules) -> list[str]:
        return [name_of[id(p)] for m in modules for p in m.parameters()
                if id(p) in name_of and name_of[id(p)] not in small]
    blocks = [unit([layer]) for layer in reversed(parts.layers)]
    embed = unit(parts.embeddings)
    head = unit([parts.final_norm] + ([parts.head] if parts.head is not None else []))
    if parts.head is None:  # tied: the embedding is also the head
        head, embed = [], embed + head
    return [u for u in [head, *blocks, small, embed] if u]


@dataclass(frozen=True)
class UnitState:
    """Where one ZeRO-3 unit stands (`Zero3Engine.unit_states`)."""
    kind: str                # "embed", "block", "head" or "unsharded" (the small parameters kept whole)
    block: int | None        # the block's index, for kind "block"
    resident: bool           # its full 16-bit weights occupy memory now
    gather_in_flight: bool   # a gather was issued and not yet waited for (a prefetch)


class Zero3Engine(ZeroEngine):
    def __init__(self, model: nn.Module, cfg, scaler, group, fill=None, names=None, divisor: int | None = None,
                 shard_frozen: bool = True):
        """`fill(name, out)`: the parameters have no storage yet (parallelize), and each unit is materialised
        here from `fill`'s values, sharded and freed before the next: never the whole model on the device."""
        self.frozen = None  # a LoRA run's sharded base (zero3_frozen.py), gathered by the same hooks
        self.ahead = cfg.parallel.prefetch_units  # blocks gathered ahead of the running one
        super().__init__(model, cfg, scaler, group, fill, names, divisor)
        if cfg.parallel.offload == "none":  # no 16-bit shard at rest: each gather casts the fp32 master slice
            self.param_shards = [s if self.unsharded[i] else None for i, s in enumerate(self.param_shards)]
        # A frozen base is sharded by one parameter group's engine (`shard_frozen`): the first.
        if self.world > 1 and shard_frozen and any(not p.requires_grad for p in model.parameters()):
            self.frozen = FrozenShards(model, group, int(cfg.parallel.persist_threshold), self.fill)

    def _frozen(self, op: str, role) -> None:
        if self.frozen is not None:
            getattr(self.frozen, op)(role)

    def _flat_params(self, model: nn.Module) -> FlatParams:
        threshold = int(self.cfg.parallel.persist_threshold)
        flat = FlatParams(model, stage3_units(model, threshold, self.names), pad_multiple=self.world,
                          materialize=False, names=self.names)
        small = {n for n, q in model.named_parameters() if q.numel() <= threshold}
        self.unsharded = [all(flat.names[i] in small for i in b.params) for b in flat.buckets]
        return flat

    def _shard_parameters(self, model: nn.Module) -> list:
        flat = self.flat
        self.offload_params = self.cfg.parallel.offload == "params"
        pin = self.offload_params and torch.cuda.is_available()
        # With parallel.offload_dir the 16-bit shards live in a file (ZeRO-Infinity's NVMe tier for parameters),
        # read through the page cache: host memory holds what the kernel keeps of them, not all of them.
        on_disk = self.offload_params and bool(self.cfg.parallel.offload_dir)
        if on_disk:
            total = sum(b.numel // self.world for b in flat.buckets)
            self.param_file = MappedFiles(self.cfg.parallel.offload_dir)
            disk, at = self.param_file.tensor("params", total, flat.dtype), 0
        # param_shards[b]: this rank's 16-bit slice of unit b where one is kept (None: gathers cast the master)
        self.param_shards: list[torch.Tensor | None] = []
        self.gathered: list[bool] = []
        self.gathers: dict[int, tuple] = {}  # unit -> (its gather in flight, the gather's input)
        self.in_backward = False
        for b in flat.buckets:
            full = torch.zeros(b.numel, dtype=flat.dtype, device=flat.device)
            with torch.no_grad():
                for i in b.params:
                    if self.fill is None:
                        flat.view(full, i).copy_(flat.params[i].detach())
                    else:
                        self.fill(flat.names[i], flat.view(full, i))
                    flat.params[i].data = flat.view(full, i)
            b.data = full
            shard = self._own(full).clone()
            if on_disk:
                self.param_shards.append(disk[at:at + shard.numel()].copy_(shard))
                at += shard.numel()
            else:
                self.param_shards.append(host_empty(shard.numel(), shard.dtype, pin).copy_(shard)
                                         if self.offload_params else shard)
            self.gathered.append(True)
            self._release(b.index)  # at rest, only the small parameters are whole
        self._register_hooks(model)
        return list(self.param_shards)

    def _own(self, full: torch.Tensor) -> torch.Tensor:
        n = full.numel() // self.world
        return full[self.rank * n:(self.rank + 1) * n]

    def _register_hooks(self, model: nn.Module) -> None:
        flat, parts = self.flat, model.parts()
        block_of = {id(q): i for i, layer in enumerate(parts.layers) for q in layer.parameters()}
        embedding = {id(q) for m in parts.embeddings for q in m.parameters()}
        unit_of_block, self.embed_unit, self.head_unit = {}, None, None
        for b in flat.buckets:
            if self.unsharded[b.index]:
                continue
            first = flat.params[b.params[0]]
            if id(first) in block_of:
                unit_of_block[block_of[id(first)]] = b.index
            elif any(id(flat.params[i]) in embedding for i in b.params):
                self.embed_unit = b.index
            else:
                self.head_unit = b.index
        tied = parts.head is None
        if tied:
            self.head_unit = self.embed_unit  # one root unit, kept from forward until after backward
        self.block_units = [unit_of_block.get(i) for i in range(len(parts.layers))]
        for i, block in enumerate(parts.layers):
            block.register_forward_pre_hook(self._block_pre_hook(i))
            block.register_forward_hook(self._block_post_hook(i))
        model.register_forward_pre_hook(self._hook(lambda mod, args: self._gather_role(self.embed_unit, "embed")))
        if not tied:
            # The embeddings' backward needs no weights: free them once the lookup is done.
            parts.layers[0].register_forward_pre_hook(
                self._hook(lambda mod, args: self._release_role(self.embed_unit, "embed")))
            parts.final_norm.register_forward_pre_hook(
                self._hook(lambda mod, args: self._gather_role(self.head_unit, "head")))
        model.register_forward_hook(self._hook(lambda mod, args, out: self._model_post_hook(mod, args, out)))

    def _gather_role(self, b: int | None, role) -> None:
        self._gather(b)
        self._frozen("gather", role)

    def _release_role(self, b: int | None, role) -> None:
        self._release(b)
        self._frozen("release", role)

    def _wait_for_weights_in_forward(self, model: nn.Module) -> None:
        pass  # the unsharded parameters' all-gathers complete inside the step

    def unit_states(self) -> list[UnitState]:
        block = {u: i for i, u in enumerate(self.block_units) if u is not None}
        out = []
        for b in self.flat.buckets:
            u = b.index
            kind = ("unsharded" if self.unsharded[u] else "embed" if u == self.embed_unit
                    else "head" if u == self.head_unit else "block")
            out.append(UnitState(kind, block.get(u), b.data.untyped_storage().size() > 0, u in self.gathers))
        return out

    # ---- gathers around each unit's use --------------------------------------------------------
    def _release(self, b: int | None) -> None:
        if b is None or not self.gathered[b] or self.unsharded[b]:
            return
        work = self.gathers.pop(b, None)  # a prefetch never waited for
        if work is not None and work[0] is not None:
            work[0].wait()  # it may still be writing into the storage freed next
        free_storage(self.flat.buckets[b].data)
        self.gathered[b] = False

    def _issue_gather(self, b: int | None) -> None:
        if b is None or b in self.gathers or self.gathered[b]:
            return
        bucket = self.flat.buckets[b]
        alloc_storage(bucket.data)
        src = self.param_shards[b]
        src = self.opt.master_part(b) if src is None else src  # None: the gather casts the fp32 master slice
        self.gathers[b] = self.transport.gather(src, bucket.data)
        self.gathered[b] = True

    def _gather(self, b: int | None) -> None:
        if b is None:
            return
        self._issue_gather(b)
        work = self.gathers.pop(b, None)
        if work is not None and work[0] is not None:
            work[0].wait()

    def _block_pre_hook(self, i: int):
        def hook(module, args):
            self._gather_role(self.block_units[i], ("block", i))
            if not self.in_backward:  # prefetch what forward needs next: overlaps this block's compute
                n = len(self.block_units)
                for j in range(i + 1, i + 1 + self.ahead):
                    self._issue_gather(self.head_unit if j >= n else self.block_units[j])
                    self._frozen("issue", "head" if j >= n else ("block", j))
                    if j >= n:
                        break
        return self._hook(hook)

    def _block_post_hook(self, i: int):
        def hook(module, args, output):
            if self.in_backward:  # a recomputation inside backward: the unit stays for its gradients
                return output
            self._release_role(self.block_units[i], ("block", i))
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(self._pre_backward(i))
            return output
        return self._hook(hook)

    def _pre_backward(self, i: int):
        def hook(grad):
            self.in_backward = True
            # The gradient of block i's output is that of block i + 1's input: the later block's backward
            # is done with its frozen weights (they get no gradient, so no unit completion says so).
            self._frozen("release", ("block", i + 1))
            self._gather_role(self.block_units[i], ("block", i))
            for j in range(i - 1, max(i - 1 - self.ahead, -1), -1):  # the blocks backward visits next
                self._issue_gather(self.block_units[j])
                self._frozen("issue", ("block", j))
            return grad
        return self._hook(hook)

    def _model_post_hook(self, module, args, output):
        if not torch.is_grad_enabled():  # eval or generation: nothing will need the head again
            self._release(self.head_unit)
            if self.frozen is not None:
                self.frozen.release_all()
        return output

    # ---- ZeroEngine's seams --------------------------------------------------------------------
    def _after_launch(self, b: int) -> None:
        if b != self.head_unit:
            self._release(b)  # this unit's backward is done: its gradients are all in

    def _backward_done(self) -> None:
        self.in_backward = False
        self._release(self.head_unit)
        if self.frozen is not None:
            self.frozen.release_all()

    def _param_shard(self, b: int) -> torch.Tensor | None:
        if self.unsharded[b]:
            return self.opt.shard_of(self.flat.buckets[b].data, b)
        return self.param_shards[b]  # None: the next gather casts the master itself

    def _before_step(self) -> None:
        for work, _ in self.gathers.values():  # a prefetch not waited for yet still reads the masters
            if work is not None:
                work.wait()
        self.gathers.clear()
        if self.offload_params and self.flat.device.type == "cuda":
            # Every upload has been waited for by the compute stream; the CPU is about to write the host
            # shards they read from, so it waits for that stream first.
            torch.cuda.current_stream(self.flat.device).synchronize()

    def load_full_state(self, masters: dict, state: dict) -> None:
        self._before_step()
        super().load_full_state(masters, state)

    def _gather_updated_weights(self) -> None:
        """Only the unsharded units are whole between steps: their updated slices go out now."""
        for b in self.gather_order:
            if not self.unsharded[b]:
                continue
            bucket = self.flat.buckets[b]
            self.param_shards[b].copy_(self.opt.shard_of(bucket.data, b))
            if self.world > 1:
                self.weight_gathers[b] = self.transport.gather(self.param_shards[b], bucket.data)
        self._wait_weight_gathers()

    def _load_bucket(self, bucket, part: torch.Tensor, masters: dict) -> None:
        # No full tensor is read again (a sharded checkpoint's other ranks' pieces): a whole unit is gathered
        # from the shards every rank just loaded, a sharded one released, gathered from them when next used.
        b = bucket.index
        if self.param_shards[b] is not None:
            self.param_shards[b].copy_(part)
        if not self.unsharded[b]:
            self._release(b)
            return
        work, _ = self.transport.gather(self.param_shards[b], bucket.data)
        if work is not None:
            work.wait()

    def frozen_state(self) -> dict[str, torch.Tensor]:
        return {} if self.frozen is None else self.frozen.full_state()

    def frozen_shard_pieces(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        return {} if self.frozen is None else self.frozen.shard_pieces()

    def load_frozen(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.frozen is None:
            return state
        names, state = self.frozen.names(), as_lazy(state)  # read as loaded, not all at once
        self.frozen.load(state.where(lambda n: n in names))
        return state.where(lambda n: n not in names)

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = [("params", b.data) for b in self.flat.buckets if self.unsharded[b.index]]
        out += self.frozen.held_tensors() if self.frozen is not None else []
        out += [("param_shards", s) for b, s in zip(self.flat.buckets, self.param_shards)
                if s is not None and not self.unsharded[b.index]]
        return out + [t for t in super().held_tensors() if t[0] != "params"]

