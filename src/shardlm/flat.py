"""Flat parameter and gradient buckets: every trainable parameter becomes a view into the contiguous
buffer of its bucket, and its `.grad` a view into the bucket's gradient buffer, which autograd then
accumulates into in place.

This is the memory layout of Megatron-LM's DistributedOptimizer, DeepSpeed's ZeRO and PyTorch DDP's
`gradient_as_bucket_view`: the optimizer, the gradient-norm reduction and the data-parallel collectives
work on a few large contiguous ranges instead of hundreds of tensors. Buckets are listed in the order
their gradients become ready (reverse registration order, as DDP does) so that each can be reduced
while backward goes on. Within a bucket, parameters that take weight decay (matrices) come first and
the rest (norms, biases) after, so each bucket has at most two optimizer segments; each bucket is padded
to a multiple of `pad_multiple` elements, so it splits into equal rank-aligned shards.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import nn


def free_storage(t: torch.Tensor) -> None:
    """Give back a buffer's memory, keeping the tensor (and the views into it) to be refilled later."""
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


@torch.no_grad()
def materialise(t: torch.Tensor, name: str, fill) -> None:
    """Give a tensor without storage (parallelize's parameters) its memory and `fill`'s values for `name`."""
    alloc_storage(t)
    fill(name, t)


def trainable(model: nn.Module, names=None) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters by name, in registration order; only `names` where given."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and (names is None or n in names)]


@dataclass
class Bucket:
    index: int
    params: list[int]            # indices into FlatParams.params
    offsets: list[int]           # each parameter's offset inside the bucket
    numel: int                   # padded to a multiple of pad_multiple
    decay_numel: int             # elements [0, decay_numel) take weight decay
    data: torch.Tensor | None = None
    grad: torch.Tensor | None = None


def split_buckets(names: list[str], sizes: list[int], bucket_numel: int) -> list[list[str]]:
    """Consecutive names grouped into buckets of about bucket_numel elements (a big tensor gets its own)."""
    out, cur, n = [], [], 0
    for name, size in zip(names, sizes):
        if cur and n + size > bucket_numel:
            out.append(cur)
            cur, n = [], 0
        cur.append(name)
        n += size
    if cur:
        out.append(cur)
    return out


class FlatParams:
    def __init__(self, model: nn.Module, buckets: list[list[str]] | None = None, pad_multiple: int = 1,
                 grad_buffers: bool = True, materialize: bool = True, fill=None, names=None,
                 free_grads: bool = False):
        """`fill(name, out)`: the parameters have no storage yet (parallelize); their values are written
        straight into the buckets, so the model never exists twice. `names`: the trainable parameters of
        one parameter group (parallel/groups.py); None: all of them. `free_grads`: each bucket's gradients
        get a buffer of their own, given back at `zero_grad` and taken again, zeroed, when backward brings
        the bucket's first gradient (see `ensure_grads`)."""
        named = dict((n, p) for n, p in trainable(model, names))
        if not named:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in named.values()}
        if len(dtypes) != 1:
            raise ValueError(f"flat buffers need one parameter dtype, found {sorted(map(str, dtypes))}")
        groups = buckets if buckets is not None else [list(named)]
        if sorted(n for g in groups for n in g) != sorted(named):
            raise ValueError("the buckets must list every trainable parameter exactly once")
        self.names: list[str] = []
        self.params: list[nn.Parameter] = []
        self.where: list[tuple[int, int]] = []  # parameter i -> (bucket, offset)
        self.buckets: list[Bucket] = []
        for b, group in enumerate(groups):
            group = sorted(group, key=lambda n: named[n].dim() < 2)  # stable: matrices first
            offsets, off, decay = [], 0, 0
            for name in group:
                offsets.append(off)
                off += named[name].numel()
                decay += named[name].numel() if named[name].dim() >= 2 else 0
            numel = -(-off // pad_multiple) * pad_multiple
            idx = list(range(len(self.params), len(self.params) + len(group)))
            self.buckets.append(Bucket(b, idx, offsets, numel, decay))
            for name, o in zip(group, offsets):
                self.names.append(name)
                self.params.append(named[name])
                self.where.append((b, o))
        self.dtype = next(iter(dtypes))
        self.device = self.params[0].device
        if materialize:
            # One allocation each for all buckets' weights and gradients, buckets back to back: the
            # optimizer then runs over all of them in one kernel launch instead of one per bucket.
            sizes = [b.numel for b in self.buckets]
            starts = [0, *itertools.accumulate(sizes)][:-1]
            data = torch.zeros(sum(sizes), dtype=self.dtype, device=self.device)
            grad = torch.zeros_like(data) if grad_buffers and not free_grads else None
            for bucket, start in zip(self.buckets, starts):
                bucket.data = data[start:start + bucket.numel]
                with torch.no_grad():
                    for i in bucket.params:
                        if fill is None:
                            self.view(bucket.data, i).copy_(self.params[i].detach())
                        else:
                            fill(self.names[i], self.view(bucket.data, i))
                        self.params[i].data = self.view(bucket.data, i)
                if grad_buffers:
                    bucket.grad = grad[start:start + bucket.numel] if grad is not None else torch.empty(
                        bucket.numel, dtype=self.dtype, device=self.device)  # freed below, zeroed when taken
                    for i in bucket.params:
                        self.params[i].grad = self.view(bucket.grad, i)
        self.free_grads = free_grads and grad_buffers and materialize
        if self.free_grads:
            self.zero_grad()
            self._alloc_hooks = [p.register_hook(self._allocating(self.where[i][0]))
                                 for i, p in enumerate(self.params)]

    @torch.no_grad()
    def rehome(self, data: torch.Tensor | None = None, grad: torch.Tensor | None = None) -> None:
        """Move the buckets' weights into `data` and their gradients into `grad` (flat buffers holding the
        buckets back to back, such as symmetric memory the peers map), parameters and .grad following."""
        if grad is not None and self.free_grads:
            raise ValueError("gradients freed between steps (free_grads) have buffers of their own per bucket")
        start = 0
        for bucket in self.buckets:
            span = slice(start, start + bucket.numel)
            start += bucket.numel
            if data is not None:
                data[span].copy_(bucket.data)
                bucket.data = data[span]
                for i in bucket.params:
                    self.params[i].data = self.view(bucket.data, i)
            if grad is not None:
                if bucket.grad is None:
                    grad[span].zero_()
                else:
                    grad[span].copy_(bucket.grad)
                bucket.grad = grad[span]
                for i in bucket.params:
                    self.params[i].grad = self.view(bucket.grad, i)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    def view(self, bucket_buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's slice of a buffer laid out like its bucket (data, grad, or a full master)."""
        _, o = self.where[i]
        return bucket_buf[o:o + self.params[i].numel()].view(self.params[i].shape)

    def bucket_of(self, i: int) -> Bucket:
        return self.buckets[self.where[i][0]]

    def _allocating(self, b: int):
        """A hook that runs before autograd adds a gradient into bucket b, giving the bucket its memory back.
        Weakly bound, as the buckets' readiness hooks are (parallel/buckets.py)."""
        ref = weakref.ref(self)

        def hook(grad):
            flat = ref()
            if flat is not None:
                flat.ensure_grads(b)
        return hook

    def ensure_grads(self, b: int | None = None) -> None:
        """Give bucket b (None: every bucket) its gradient memory back, zeroed, and its parameters' .grad as
        views of it, where `zero_grad` freed it: before backward adds into it, and before anything reads a
        bucket that took no gradient this step."""
        for bucket in self.buckets if b is None else [self.buckets[b]]:
            if bucket.grad is not None and bucket.grad.untyped_storage().size() == 0:
                alloc_storage(bucket.grad)
                bucket.grad.zero_()
                for i in bucket.params:
                    self.params[i].grad = self.view(bucket.grad, i)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if bucket.grad is None:
                continue
            if self.free_grads:  # torch's zero_grad(set_to_none=True): .grad is None until backward's next
                free_storage(bucket.grad)
                for i in bucket.params:
                    self.params[i].grad = None
                continue
            bucket.grad.zero_()
            # A user (or a library) may have replaced .grad; point it back at the bucket.
            for i in bucket.params:
                p = self.params[i]
                if p.grad is None or p.grad.data_ptr() != self.view(bucket.grad, i).data_ptr():
                    p.grad = self.view(bucket.grad, i)
