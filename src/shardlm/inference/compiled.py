"""A function compiled by torch.compile (PyTorch 2's Dynamo and Inductor) that runs eagerly from the first
call the compiler cannot take: a model, a shape or a PyTorch build whose kernels the compiler fails on still
generates and serves, slower, and says so once."""
from __future__ import annotations

import threading
import warnings
from collections import defaultdict
from typing import Callable

import torch


def compile_errors() -> tuple[type, ...]:
    """What torch.compile raises for a function it cannot take: Dynamo's errors, and Inductor's code
    generation errors (a subclass of them in recent builds, reaching the caller as they are), a guard on
    a data-dependent size, and a fullgraph compile past Dynamo's recompile limit (a plain Exception)."""
    import torch._inductor.exc as inductor
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    extra = [inductor.InductorError] if hasattr(inductor, "InductorError") else []
    extra += [e for e in (getattr(torch._dynamo.exc, n, None) for n in ("FailOnRecompileLimitHit",
                                                                     "FailOnCacheLimitHit")) if e is not None]
    # a branch on a value only the run knows (an MoE's expert loop on a GPU without grouped kernels for the
    # dtype) reaches the caller as the shape engine's error, not Dynamo's
    return (torch._dynamo.exc.TorchDynamoException, GuardOnDataDependentSymNode, *extra)


_SHAPES: dict = {}  # a code object -> the compiles its CompiledOrEagers may take, in this process


class CompiledOrEager:
    """`fn` compiled with `options`; from a call that fails to compile on, `fn` itself, with a warning naming
    `what`. A failed compile runs none of the function, so that call is simply run again eagerly. `shapes`: the
    compiles `fn` may take (static shapes, one each). Dynamo counts the compiles of a code object against one
    limit (8 by default, process-wide), every engine's together (data-parallel replicas, engines rebuilt for
    adapters: it does not tell them apart), so the limit is raised to the shapes of every CompiledOrEager of
    `fn`'s code so far: past it a fullgraph compile raises FailOnRecompileLimitHit (then run eagerly)."""

    def __init__(self, fn: Callable, what: str, shapes: int = 0, **options):
        self.eager, self.what = fn, what
        if shapes:
            code = getattr(getattr(fn, "__func__", fn), "__code__", fn)
            _SHAPES[code] = total = _SHAPES.get(code, 0) + shapes
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            for name in (limit, "accumulated_recompile_limit"):
                if hasattr(config, name):
                    setattr(config, name, max(getattr(config, name), total))
        self.graphs = options.get("mode") == "reduce-overhead"
        self.fn = torch.compile(fn, **options)

    def __call__(self, *args):
        if self.fn is self.eager:
            return self.fn(*args)
        if self.graphs:
            cuda_graphs_in_this_thread()
        try:
            return self.fn(*args)
        except compile_errors() as e:
            warnings.warn(f"{self.what} runs eagerly: compiling it failed ({type(e).__name__}: {str(e)[:200]})")
            self.fn = self.eager
            return self.fn(*args)


def cuda_graphs_in_this_thread() -> None:
    """Make CUDA graph trees (torch.compile's mode "reduce-overhead") usable from the calling thread. Before
    PyTorch 2.13 their per-thread state is set up only in the thread that first imported them, and any other
    thread fails an assertion (pytorch#123177): a server's engine thread after a compile in the main thread,
    or the main thread after the engine's."""
    from torch._inductor import cudagraph_trees as trees
    key = "tree_manager_containers"
    if hasattr(trees.local, key) or torch._C._is_key_in_tls(key):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = defaultdict(threading.Lock)
    # stashed as the module does, so that autograd's threads started from this one find them too
    torch._C._stash_obj_in_tls(key, trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)
