"""A function compiled by torch.compile (PyTorch 2's Dynamo and Inductor) that runs eagerly from the first
call the compiler cannot take: a model, a shape or a PyTorch build whose kernels the compiler fails on still
generates and serves, slower, and says so once."""
from __future__ import annotations

import warnings
from typing import Callable

import torch


def compile_errors() -> tuple[type, ...]:
    """What torch.compile raises for a function it cannot take: Dynamo's errors, and Inductor's code
    generation errors (a subclass of them in recent builds, reaching the caller as they are)."""
    import torch._inductor.exc as inductor
    extra = [inductor.InductorError] if hasattr(inductor, "InductorError") else []
    return (torch._dynamo.exc.TorchDynamoException, *extra)


class CompiledOrEager:
    """`fn` compiled with `options`; from a call that fails to compile on, `fn` itself, with a warning naming
    `what`. A failed compile runs none of the function, so that call is simply run again eagerly."""

    def __init__(self, fn: Callable, what: str, **options):
        self.eager, self.what = fn, what
        self.fn = torch.compile(fn, **options)

    def __call__(self, *args):
        if self.fn is self.eager:
            return self.fn(*args)
        try:
            return self.fn(*args)
        except compile_errors() as e:
            warnings.warn(f"{self.what} runs eagerly: compiling it failed ({type(e).__name__}: {str(e)[:200]})")
            self.fn = self.eager
            return self.fn(*args)
