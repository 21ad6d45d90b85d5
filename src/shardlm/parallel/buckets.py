"""Gradient buckets in the order backward fills them, and the hooks that launch each bucket's reduction as
soon as it is complete (PyTorch DDP's reducer, Li et al. 2020): what DDP and ZeRO share."""
from __future__ import annotations

import weakref

from torch import nn

from ..flat import FlatParams, split_buckets, trainable


def reverse_order_buckets(model: nn.Module, bucket_mb: float, names=None) -> list[list[str]]:
    """Buckets of about `bucket_mb` of the trainable parameters' dtype in reverse registration order: the
    order backward produces gradients. `names`: one parameter group's (None: every trainable parameter)."""
    named = trainable(model, names)[::-1]
    itemsize = named[0][1].element_size() if named else 1  # (a frozen QLoRA base's first weight is packed bytes)
    return split_buckets([n for n, _ in named], [p.numel() for _, p in named],
                         max(1, int(bucket_mb * 2**20 / itemsize)))


class BucketReadiness:
    """Counts gradients as autograd accumulates them and calls `launch(bucket)` for each bucket whose
    gradients are all in, strictly in bucket order; `flush()` launches the rest (parameters that got no
    gradient this step count as zero), so no rank ever waits for a collective its peers never issue.
    `on_grad(i, param)`, if given, sees each gradient first (ZeRO-2/3 move it out of the parameter)."""

    def __init__(self, flat: FlatParams, launch, on_grad=None):
        self.flat, self.launch, self.on_grad = flat, launch, on_grad
        self.active = False
        self.pending = [0] * len(flat.buckets)
        self.next = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(flat.params)]

    def _hook(self, i: int):
        b = self.flat.where[i][0]
        # Weakly: a parameter keeps its hooks where Python's collector does not look, so a hook holding
        # this object would keep the engine (its gradients, its optimizer state) alive as long as the
        # parameters, cycle or not: every engine built in one process would stay in memory.
        ref = weakref.ref(self)

        def hook(param):
            self = ref()
            if self is None or not self.active:
                return
            if self.on_grad is not None:
                self.on_grad(i, param)
            self.pending[b] -= 1
            while self.next < len(self.pending) and self.pending[self.next] == 0:
                self.launch(self.next)
                self.next += 1
        return hook

    def arm(self) -> None:
        self.active = True
        self.pending = [len(b.params) for b in self.flat.buckets]
        self.next = 0

    def flush(self) -> None:
        if self.active:
            while self.next < len(self.pending):
                self.launch(self.next)
                self.next += 1
        self.active = False
