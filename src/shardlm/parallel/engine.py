"""The engine interface: what the trainer asks of a data-parallel strategy, declared once.

An engine owns the model's trainable parameters laid out in flat buckets (flat.py), the optimizer with
its fp32 masters (optim.py), and whatever communication its strategy needs. A training step calls, in
this order:

    for each micro-batch:  forward; engine.prepare_backward(last); backward; engine.finish_backward(last)
    engine.optimizer_step(lr, step)

and the trainer reads `step_stats` only when it logs (it waits for the device). Strategies:
`LocalEngine` (one process, here), `ClassicEngine` (classic.py), `DDPEngine` (ddp.py), `ZeroEngine`
(ZeRO-1/2, zero.py), `Zero3Engine` (zero3.py); optimizer offload is optimizer placement (offload.py).
Every engine keeps its state layout-free on the outside: `gather_full_state` and `load_full_state`
speak full tensors by parameter name, so a checkpoint does not depend on the layout that wrote it.
The inspection calls (`owned_shards`, `held_tensors`, `memory`) are what tests and tools read.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import FREE_GRAD_BUCKET_MB
from ..flat import FlatParams
from ..optim import MasterWeightOptimizer


class Engine:
    flat: FlatParams
    opt: MasterWeightOptimizer | None  # None on a rank that holds no optimizer state (classic DP)
    algo: str | None = None            # how gradients are summed over the ranks (None: they are not)
    divisor: int = 1                   # data replicas whose summed gradients make the mean (groups.py)

    # ---- one step ---------------------------------------------------------------------------------
    def prepare_backward(self, last: bool) -> None:
        """Before a micro-batch's backward (`last`: the step's last micro-batch): arm the gradient hooks that
        reduce buckets as backward completes them, and make sure the weights backward reads are in place."""

    def finish_backward(self, last: bool) -> None:
        """After a micro-batch's backward: launch what the hooks did not, and make the compute stream wait for
        every gradient reduction of this micro-batch."""

    def optimizer_step(self, lr: float, step: int) -> None:
        """Clip by the global gradient norm and update (skipped everywhere if fp16 overflowed anywhere)."""
        raise NotImplementedError

    def step_stats(self, step: int) -> tuple[float, int]:
        """Host view of the last optimizer step: (its gradient norm, steps skipped so far). Waits for the
        device; raises if a bf16/fp32 step diverged."""
        return self.opt.sync(step)

    def wait_for_weights(self) -> None:
        """Complete the weight transfers still in flight (ZeRO-1/2 leave the updated weights' all-gathers to
        overlap the next forward): call before reading the weights outside a step."""

    def metrics(self) -> dict:
        """What the engine measured of its last step, for the logs: the disk tier's read and write rate."""
        disk = getattr(self.opt, "disk_bytes_per_s", None)  # parallel.offload_dir's optimizer only
        return {} if disk is None else {"disk_gb_s": disk / 1e9}

    def close(self) -> None:
        """End what is still in flight: an update running beside the next step (parallel.overlap_update)
        lands, or says why it could not."""
        if getattr(self.opt, "landings", None):
            self.opt.wait_for_update()

    def group_engines(self) -> list["Engine"]:
        """The engine of each parameter group (groups.py): this one alone unless it groups several."""
        return [self]

    # ---- layout-free state ------------------------------------------------------------------------
    def gather_full_state(self) -> tuple[dict | None, dict | None]:
        """(fp32 masters, optimizer state) as full tensors by parameter name (`name::key` for the state); a
        collective when the state is sharded. (None, None) on ranks that hold no optimizer."""
        return self.opt.master_state(), self.opt.state_by_name()

    def load_full_state(self, masters: dict, state: dict) -> None:
        """Take this rank's part of full per-name masters and optimizer state, and the weights from them."""
        raise NotImplementedError

    def frozen_state(self) -> dict[str, torch.Tensor]:
        """Frozen parameters this engine shards (ZeRO-3), whole by name (a collective); the model holds the rest."""
        return {}

    def frozen_shard_pieces(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        """This rank's shard of each frozen parameter it shards (ZeRO-3): (lo, hi, values) flat ranges by
        name, no collective."""
        return {}

    def load_frozen(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take this rank's part of the frozen parameters it shards from full `state`; returns the others."""
        return state

    # ---- inspection -------------------------------------------------------------------------------
    def grad_shard(self, b: int) -> torch.Tensor:
        """Bucket b's reduced gradient owned by this rank: the sum over the data-parallel ranks (times the
        loss scale), valid from the last micro-batch's finish_backward until optimizer_step."""
        raise NotImplementedError

    # fp16's loss scaling: each micro-batch's loss divided by the data replicas before backward (prescale).
    prescaled = False

    def loss_factor(self) -> float:
        """Besides the loss scale, what each micro-batch's loss is multiplied by before backward. Prescaled,
        1 / divisor: every rank's gradients, its activations' too, are then its share of the global batch's
        mean, the size one process's are, so that fp16 overflows at the loss scale one process does (each
        rank's mean over its own tokens is divisor times that per token, and skipped steps one process ran).
        Otherwise 1: grad_factor divides the reduced sum."""
        return 1.0 / self.divisor if self.prescaled else 1.0

    def grad_factor(self) -> float:
        """What turns grad_shard's sum into the mean over the global batch: over every data-parallel
        replica of the model, even where this group's gradients are summed over fewer ranks (experts);
        prescaled, the sum is that mean already."""
        return 1.0 if self.prescaled else 1.0 / self.divisor

    def grad_sumsq(self) -> torch.Tensor | None:
        """The squares of this rank's shard or replica slice where the reduction took them; None: the
        optimizer takes them."""
        return None

    def owned_sumsq(self) -> torch.Tensor:
        """The squares of the gradient elements this rank alone counts (GroupedEngine adds its groups')."""
        return self.opt.owned_sumsq([self.grad_shard(b.index) for b in self.flat.buckets], self.grad_sumsq())

    def owned_shards(self, which: str) -> dict[str, tuple[int, int, torch.Tensor]]:
        """This rank's owned elements of every parameter as {name: (lo, hi, fp32 values on the CPU)}, lo:hi in
        the parameter's flattened coordinates. `which`: "grad" (the mean gradient about to be applied,
        loss scale included, before clipping), "master", or an optimizer state ("exp_avg", "exp_avg_sq",
        "momentum_buffer"). Empty on a rank that holds no optimizer state."""
        flat, opt = self.flat, self.opt
        if opt is None:
            return {}
        out = {}
        for b in flat.buckets:
            n = opt.shard_len[b.index]
            lo_b = opt.rank * n
            if which == "grad":
                buf = self.grad_shard(b.index).float() * self.grad_factor()
            elif which == "master":
                buf = opt.master_parts[b.index].float()
            else:
                buf = opt.state[which][b.index].float()
            for i in b.params:
                off, size = flat.where[i][1], flat.params[i].numel()
                lo, hi = max(off, lo_b), min(off + size, lo_b + n)
                if hi > lo:
                    out[flat.names[i]] = (lo - off, hi - off, buf[lo - lo_b:hi - lo_b].detach().cpu().clone())
        return out

    def held_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor this rank holds for the model's training state, each with its kind: "params" (16-bit
        or fp32 weights kept whole), "param_shards" (ZeRO-3's 16-bit slices), "grads" (at their size in a step,
        also where one process frees them between steps), "masters",
        "optimizer" (the moments) and "host_grads" (offload's staging buffer)."""
        out = [("params", b.data) for b in self.flat.buckets]
        out += [("grads", b.grad) for b in self.flat.buckets if b.grad is not None]
        return out + self._optimizer_tensors()

    def _optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        opt = self.opt
        if opt is None:
            return []
        out = [("masters", opt.master)] if opt.master is not None else []
        out += [("optimizer", t) for parts in opt.state.values() for t in parts]
        return out + ([("host_grads", opt.host_grad)] if getattr(opt, "host_grad", None) is not None else [])

    def symmetric_bytes(self) -> int:
        """Bytes in symmetric memory (the copy engines' buffers), which PyTorch's allocator statistics miss."""
        transport = getattr(self, "transport", None)
        return transport.symmetric_bytes() if transport is not None else 0

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer state (masters included)."""
        kinds = {"params": "params", "param_shards": "params", "grads": "grads", "masters": "optimizer",
                 "optimizer": "optimizer"}
        out = {"params": 0, "grads": 0, "optimizer": 0}
        seen = set()
        for kind, t in self.held_tensors():
            if kind in kinds and id(t) not in seen:
                seen.add(id(t))
                out[kinds[kind]] += t.numel() * t.element_size()
        return out


class LocalEngine(Engine):
    """One data-parallel rank: flat buckets and the optimizer, nothing to communicate. `free_grads` (one
    process alone): the gradients' memory lives from the first gradient a bucket takes in backward to the
    step, as torch's own zero_grad(set_to_none=True) leaves it: at the start of backward, where the
    activations peak, no step's worth of gradients waits beside them."""

    def __init__(self, model: nn.Module, cfg, scaler, buckets=None, pad_multiple: int = 1, fill=None,
                 names=None, divisor: int = 1, free_grads: bool = False):
        self.cfg, self.divisor = cfg, divisor
        if free_grads and buckets is None:
            from .buckets import reverse_order_buckets
            buckets = reverse_order_buckets(model, FREE_GRAD_BUCKET_MB, names)
        self.flat = FlatParams(model, buckets, pad_multiple=pad_multiple, fill=fill, names=names,
                               free_grads=free_grads)
        self.opt = MasterWeightOptimizer(self.flat, cfg.train, scaler)

    def grad_shard(self, b: int) -> torch.Tensor:
        self.flat.ensure_grads(b)  # freed between steps (free_grads): read as the zeros it stands for
        return self.flat.buckets[b].grad  # the whole bucket: the optimizer is not sharded

    def finish_backward(self, last: bool) -> None:
        if last:  # a bucket that took no gradient this step reads as zeros
            self.flat.ensure_grads()

    def optimizer_step(self, lr: float, step: int) -> None:
        self.opt.step(lr, step, self.grad_shard, lambda b: self.flat.buckets[b].data, self.grad_factor(),
                      sumsq=self.grad_sumsq())
        self.flat.zero_grad()

    @torch.no_grad()
    def load_full_state(self, masters: dict, state: dict) -> None:
        shards = self.opt.load(masters, state)
        for b, part in zip(self.flat.buckets, shards):
            b.data.copy_(part)
