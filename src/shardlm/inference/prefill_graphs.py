"""Prefill passes replayed as CUDA graphs, over shapes padded up to a few sizes: the captured batch sizes of
vLLM's and SGLang's decode, applied to prefill's two sizes (prompts and their length).

A prefill's shapes follow the prompts, so the engine runs it through one compiled block with symbolic sizes
(slots.decoder_layer), and its cost on the host is the compiled code's launches, layer by layer: tens of
milliseconds for a 7B model whatever the prompt, more than the GPU spends on a short one (bench/README.md).
Here a pass's token length is rounded up to a multiple of `step` (a power of two below it) and its shape
captured once as a CUDA graph; later passes of that shape copy their inputs into the graph's and replay it,
one launch. Padding adds rows' tail tokens (at the cache's scratch position, never read; causal attention
keeps them from the real ones), so only passes of at most `max_tokens` padded tokens take a graph: beyond,
the GPU's work outlasts the launches and the compiled code runs as it is.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # what each replay reads, padded
    out: torch.Tensor  # what each replay writes
    keep: object  # tensors made outside the graph that it reads (kept alive with it)


class PrefillGraphs:
    """`forward(inputs, fresh, keys)`: the logits [rows, vocab] of a prefill pass, from `inputs`, tensors of
    one row per prompt chunk: "ids" and "positions" [rows, T], the others [rows]. `pad`: each input's padding
    value. `keys_of(reach)`: the cached positions a graph reads for a pass reaching `reach` (one graph serves
    every reach it covers). `prepare(T, fresh)`: what the forward reads that it makes outside the graph (a
    mask it caches), called before capture so that it is not made in the graph's memory. `capture` false
    (a CPU) pads the same way and runs the forward directly: the padding's effect is testable anywhere."""

    def __init__(self, forward: Callable, pad: dict[str, int], keys_of: Callable[[int], int], max_tokens: int,
                 step: int = 64, capture: bool = True, prepare: Callable | None = None):
        self.forward, self.pad, self.keys_of = forward, pad, keys_of
        self.max_tokens, self.step, self.capture, self.prepare = max_tokens, step, capture, prepare
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None
        self.failed: str | None = None

    def length(self, t: int) -> int:
        """`t` rounded up: to a power of two below `step`, else to a multiple of it."""
        if t >= self.step:
            return -(-t // self.step) * self.step
        return 1 << max(0, t - 1).bit_length()

    def prompts(self, up_to: int) -> list[int]:
        """A prompt length (2 to `up_to`) for each one-row graph: prefilling each alone captures them all."""
        longest = {self.length(t): t for t in range(2, up_to + 1) if self.takes(1, t)}
        return sorted(longest.values())

    def takes(self, rows: int, t: int) -> bool:
        return self.failed is None and self.max_tokens > 0 and rows * self.length(t) <= self.max_tokens

    def __call__(self, inputs: dict[str, torch.Tensor], fresh: bool, reach: int) -> torch.Tensor:
        rows, t = inputs["ids"].shape
        if not self.takes(rows, t):
            return self.forward(inputs, fresh, reach)
        length, keys = self.length(t), 0 if fresh else self.keys_of(reach)
        padded = {k: _pad_to(v, length, self.pad[k]) for k, v in inputs.items()}
        if not self.capture:
            return self.forward(padded, fresh, keys)
        key = (rows, length, fresh, keys)
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.graphs[key] = self._capture(padded, fresh, keys)
            except Exception as e:
                # A forward that waits on the GPU (an MoE's expert loop reads its group sizes) cannot be
                # captured: such a model prefills as it would without graphs.
                self.failed = f"{type(e).__name__}: {str(e)[:200]}"
                warnings.warn(f"prefill runs without CUDA graphs: capturing it failed ({self.failed})")
                return self.forward(inputs, fresh, reach)
        for k, v in padded.items():
            g.inputs[k].copy_(v)
        g.graph.replay()
        return g.out.clone()

    def _capture(self, inputs: dict[str, torch.Tensor], fresh: bool, keys: int) -> _Graph:
        static = {k: v.clone() for k, v in inputs.items()}
        keep = None if self.prepare is None else self.prepare(static["ids"].shape[1], fresh)
        # A first run outside the capture compiles what this shape needs (the compiler benchmarks and syncs)
        # and fills the cache's rows as the replay will.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(static, fresh, keys)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' engines (data-parallel replicas) keep using their devices meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.forward(static, fresh, keys)
        return _Graph(graph, static, out, keep)


def _pad_to(x: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if x.dim() < 2 or x.shape[1] == length:
        return x
    return torch.cat([x, x.new_full((x.shape[0], length - x.shape[1]), value)], dim=1)
