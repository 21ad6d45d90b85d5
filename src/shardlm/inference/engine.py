"""Continuous batching over a static KV cache (Yu et al. 2022, "Orca"; vLLM's scheduler without paging): a
fixed number of slots, each holding one request; between bursts of decode steps, waiting requests are
admitted into free slots and their prompts prefilled, a long prompt a chunk at a time so that the others
keep decoding; a request leaves as soon as it has its tokens.

Decode is a different program from training (pytorch-labs gpt-fast): one step over every slot (a request
alone in the first: one row), of fixed shapes, compiled once and on a GPU replayed as a CUDA graph, so that
batch-1 decode is bound by reading the weights rather than by launching kernels. Greedy and sampling steps
are graphs apart (each at one row and at every slot); the host picks one from what it knows of the
requests, never from the device. The host reads the new tokens once per burst of up
to `sync_every` steps (a request never runs past its token budget inside one): stop tokens and stop
strings are checked then, so no step waits for the host.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from ..model import Decoder
from .adapters import AdapterRows, install_adapters
from .compiled import CompiledOrEager
from .one_shot import fused_check, use_one_shot
from .prefill_graphs import PrefillGraphs
from .request import Request, Slot, accept, new_text
from .sampler import greedy, sample
from .slots import WITHOUT_CUDNN_ATTENTION, StaticKVCache, decoder_layer, forward_tokens


class Engine:
    """Generation for many requests on one model. `max_batch` slots of `max_len` positions each (prompt and
    new tokens; default the model's context). `compile` (default: on a GPU) compiles the decode step, with
    CUDA graphs on a GPU, and `compile_prefill` (default: as `compile`) a block of prefill, once for every
    layer and prompt length (a few graphs, by symbolic sizes; serve/worker.warm_up_batches compiles them all);
    either runs eagerly, with a warning, where the compiler fails (compiled.py). A prompt prefills
    `prefill_chunk` tokens at a time, and one prefill pass takes at most `prefill_tokens` tokens, padding
    counted. `prefill_graphs`: passes of up to this many tokens (and `prefill_tokens`), padded, are replayed
    as CUDA graphs (prefill_graphs.py; default 2048 where the prefill is compiled on a GPU, tensor-parallel
    models too, their all-reduces captured in the graphs; else 0: none); a pass of up to `prefill_split` prompts runs as one-row passes where
    those take graphs. `decode`: the tokenizer's ids -> text, for stop strings and `Request.text`. `one_shot`:
    a tensor-parallel model's small all-reduces and logits' all-gather by the one-shot kernel (one_shot.py;
    None: where the GPUs allow it, True: an error where they do not; every rank constructs its engine at once).

    One thread steps the engine (compiled steps and CUDA graphs belong to the thread that made them); any
    other thread may `submit` requests, `cancel` them and read `in_use` and `queued` meanwhile."""

    def __init__(self, model: Decoder, max_batch: int = 16, max_len: int | None = None,
                 compile: bool | None = None, sync_every: int = 8, prefill_chunk: int = 512,
                 prefill_tokens: int = 8192, decode: Callable | None = None, compile_prefill: bool | None = None,
                 prefill_graphs: int | None = None, prefill_split: int = 4, one_shot: bool | None = None,
                 vocab: int | None = None):
        cfg = model.cfg
        # The tokenizer's ids (Tokenizer.vocab_size): the rows past them (a vocabulary padded to a multiple of 64,
        # Qwen's 151936 for 151665 tokens) are never drawn, as vLLM masks them: none decodes to any text.
        self.vocab = vocab if vocab is not None and 0 < vocab < cfg.vocab_size else None
        self.model = model.eval()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.max_len = min(max_len or cfg.max_seq_len, cfg.max_seq_len)
        if max_batch < 1 or self.max_len < 1 or sync_every < 1 or prefill_chunk < 1:
            raise ValueError(f"max_batch ({max_batch}), sync_every ({sync_every}) and prefill_chunk "
                             f"({prefill_chunk}) and max_len ({self.max_len}) must be positive")
        self.sync_every, self.prefill_chunk = sync_every, prefill_chunk
        self.prefill_tokens, self.decode = max(prefill_tokens, prefill_chunk), decode
        # One position past the last usable one: where idle slots and padding write, never read.
        self.scratch = self.max_len
        self.cache = StaticKVCache(model, max_batch, self.max_len + 1, self.device, self.dtype)
        self.rope = None if cfg.arch == "gpt2" else model.rope(0, self.max_len + 1, self.device, self.dtype)
        n, dev = max_batch, self.device
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)  # each slot's last token
        self.pos = torch.full((n,), self.scratch, dtype=torch.long, device=dev)  # and its position
        self.active = torch.zeros(n, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(n, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.top_p = torch.ones(n, device=dev)
        self.seed = torch.zeros(n, dtype=torch.long, device=dev)
        self.out = torch.zeros(n, sync_every, dtype=torch.long, device=dev)
        self._key_space = torch.empty(self.max_len + 1, 0, device=dev)  # _key_count's
        self.slots: list[Slot | None] = [None] * n
        self.adapters: dict[str, int] = {}  # name -> index into the stacked adapters (adapters.py)
        self._adapter_dirs: dict = {}
        self.rows = AdapterRows()
        self.adapter_ids = torch.zeros(n, dtype=torch.long, device=dev)  # each slot's adapter, 0: none
        self.waiting: deque[Request] = deque()
        self.compile = dev.type == "cuda" if compile is None else compile
        self.compile_prefill = self.compile if compile_prefill is None else compile_prefill
        if prefill_graphs is None:
            prefill_graphs = 2048 if self.compile_prefill and dev.type == "cuda" else 0
        self.prefill_graphs, self.prefill_split = prefill_graphs, prefill_split
        self.one_shot = use_one_shot(model, n, one_shot)
        self._check_sums = fused_check(model)
        self._build_steps()

    def _build_steps(self) -> None:
        steps = (self._greedy_step, self._sampling_step)
        if self.compile:
            mode = "reduce-overhead" if self.device.type == "cuda" else None
            # at one row and at every slot: a graph for every key bucket but the whole cache, and one for that
            steps = tuple(CompiledOrEager(f, "the decode step", shapes=4, mode=mode, fullgraph=True, dynamic=False)
                          for f in steps)
        self._steps = steps
        # Prefill's shapes follow the prompts: one graph of a block with symbolic sizes, for every layer.
        self._layer = CompiledOrEager(decoder_layer, "prefill", dynamic=True) if self.compile_prefill else None
        self._prefill_graphs = PrefillGraphs(
            self._prefill_pass, dict(ids=0, positions=self.scratch, slots=0, last=0, adapter=0), self._keys,
            min(self.prefill_graphs, self.prefill_tokens), capture=self.device.type == "cuda",
            prepare=lambda t, fresh: self.model.window_mask(0, t, self.device) if fresh else None)

    def graphed_prompts(self) -> list[int]:
        """Prompt lengths, one for each one-row prefill graph: a server prefills one of each before clients
        come (serve/worker.warm_up_batches), so that none is captured while they wait. [] without graphs."""
        on = self.prefill_graphs and self._prefill_graphs.capture
        return self._prefill_graphs.prompts(min(self.prefill_chunk, self.max_len - 1)) if on else []

    def add_adapter(self, name: str, directory) -> None:
        """Serve the PEFT LoRA adapter in `directory` as `name`, per request (Request.adapter), beside the base
        and the other adapters. Call it before generating: the decode step is compiled again for the new
        shapes."""
        if any(s is not None for s in self.slots):
            raise RuntimeError("adapters are added while no request is running")
        self.adapters = install_adapters(self.model, {**self._adapter_dirs, name: directory}, self.rows)
        self._adapter_dirs[name] = directory
        self._build_steps()

    # ---- the compiled decode step -------------------------------------------------------------------
    def _logits(self, tokens, pos, keys: torch.Tensor):
        return self._drawable(forward_tokens(self.model, self.cache, self.rope, tokens[:, None], pos[:, None],
                                             keys=keys.shape[0]))

    def _drawable(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.vocab is None else logits[..., :self.vocab]

    def _greedy_step(self, tokens, pos, keys: torch.Tensor):
        return greedy(self._logits(tokens, pos, keys))

    def _sampling_step(self, tokens, pos, temperature, top_k, top_p, seed, keys: torch.Tensor):
        return sample(self._logits(tokens, pos, keys), temperature, top_k, top_p, seed, pos + 1)

    # ---- requests -----------------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        """Queue `request` for a slot (or end it at once where max_new_tokens is 0); ValueError where it
        cannot run."""
        self.check(request)
        if request.max_new_tokens == 0:
            request.finish_reason, request.text = "length", "" if self.decode else None
        else:
            self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """`request.cancel()`: it leaves at the next step (serve/tp.py's leader defers this to its steps)."""
        request.cancel()

    def check(self, request: Request) -> None:
        """ValueError where this engine cannot run `request`; nothing changes."""
        if not request.prompt:
            raise ValueError("a request needs at least one prompt token")
        vocab = self.model.cfg.vocab_size
        if not 0 <= min(request.prompt) <= max(request.prompt) < vocab:  # else an IndexError mid-step, every row lost
            raise ValueError(f"prompt token ids must be in [0, {vocab}), the model's vocabulary (a tokenizer with a "
                             f"larger vocabulary than the model's?): got {min(request.prompt)}..{max(request.prompt)}")
        if request.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens ({request.max_new_tokens}) must not be negative")
        if len(request.prompt) + request.max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({len(request.prompt)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                             f"exceeds the {self.max_len} positions a slot holds")
        if request.adapter is not None and request.adapter not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none loaded"
            raise ValueError(f"unknown adapter {request.adapter!r} (known: {known})")

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    @property
    def in_use(self) -> int:
        """Slots holding a request."""
        return sum(s is not None for s in list(self.slots))

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, the cancelled ones not counted."""
        return sum(not r.cancelled for r in list(self.waiting))

    def abort_all(self) -> list[Request]:
        """Take every request out of the engine (those in slots and those waiting) and reset every slot, so
        that stepping can go on after a step raised; the caller ends them. Their tokens so far stay."""
        held = [s.request for s in self.slots if s is not None] + list(self.waiting)
        self.waiting.clear()
        self.slots = [None] * len(self.slots)
        self.pos.fill_(self.scratch)
        self.active.zero_()
        self.adapter_ids.zero_()
        return held

    def run(self, requests: list[Request], progress: Callable | None = None) -> list[Request]:
        """Every request to its end; `progress(n)` is told of each n finished."""
        for r in requests:
            self.submit(r)
            if r.done and progress is not None:
                progress(1)
        while self.busy:
            done = self.step()
            if progress is not None and done:
                progress(len(done))
        return requests

    @torch.no_grad()
    def step(self) -> list[Request]:
        """Admit, prefill one pass, decode one burst; the requests that finished."""
        finished: list[Request] = []
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.request.cancelled:
                self._release(i, finished)
        for r in [r for r in list(self.waiting) if r.cancelled]:  # a snapshot: other threads may append
            self.waiting.remove(r)
            self._end_cancelled(r, finished)
        for i, slot in enumerate(self.slots):
            while slot is None and self.waiting:
                r = self.waiting.popleft()
                if r.cancelled:
                    self._end_cancelled(r, finished)
                else:
                    self._admit(i, r)
                    slot = self.slots[i]
        if any(s is not None and not s.decoding for s in self.slots):
            self._prefill(finished)
        if any(s is not None and s.decoding for s in self.slots):
            self._decode_burst(finished)
        return finished

    def _admit(self, i: int, r: Request) -> None:
        self.slots[i] = Slot(r)
        self.adapter_ids[i] = self.adapters.get(r.adapter, 0)
        s = r.sampling
        self.temperature[i], self.top_k[i], self.top_p[i], self.seed[i] = s.temperature, s.top_k, s.top_p, s.seed

    def _release(self, i: int, finished: list[Request]) -> None:
        r = self.slots[i].request
        if not r.done:
            self._end_cancelled(r, finished)
        else:
            finished.append(r)
        self.slots[i] = None
        self.pos[i], self.active[i] = self.scratch, 0

    def _end_cancelled(self, r: Request, finished: list[Request]) -> None:
        r.finish_reason = "cancelled"
        if self.decode is not None and r.text is None:
            r.text = new_text(r, r.completion, self.decode)
        finished.append(r)

    # ---- prefill ------------------------------------------------------------------------------------
    def _prefill(self, finished: list[Request]) -> None:
        """One pass over prompt chunks: the continued prompts' next chunks (through the cache), else the new
        prompts' first chunks together (SDPA's causal kernels), shortest first within the token budget; a few
        of them, where prefill graphs take one row of each, as one-row passes. Continued prompts go first (as
        vLLM's scheduler runs them before new ones): new ones first starved a long prompt for as long as short
        requests kept arriving in the other slots, each one new."""
        pending = [i for i, s in enumerate(self.slots) if s is not None and not s.decoding]
        continued = [i for i in pending if self.slots[i].prefilled > 0]
        fresh = not continued
        rows = continued or pending
        chunk = {i: min(self.prefill_chunk, len(self.slots[i].request.prompt) - self.slots[i].prefilled)
                 for i in rows}
        rows.sort(key=chunk.get)
        take = 1
        while take < len(rows) and (take + 1) * chunk[rows[take]] <= self.prefill_tokens:
            take += 1
        rows = rows[:take]
        if len(rows) <= self.prefill_split and all(self._prefill_graphs.takes(1, chunk[i]) for i in rows):
            # A pass of its own for each row: one-row graphs (captured at warm-up) replay, where a pass of a few
            # rows would be captured first (or launched layer by layer) while clients wait, and no row is padded
            # to the longest. Beyond a few rows, one pass's single read of the weights wins.
            logits = torch.cat([self._prefill_forward(self._pass_inputs([i], chunk), fresh,
                                                      self.slots[i].prefilled + chunk[i]) for i in rows])
        else:
            logits = self._prefill_forward(self._pass_inputs(rows, chunk), fresh,
                                           max(self.slots[i].prefilled + chunk[i] for i in rows))
        slots = torch.tensor(rows, device=self.device)
        counter = torch.tensor([self.slots[i].prefilled + chunk[i] for i in rows], device=self.device)
        first = sample(self._drawable(logits), self.temperature[slots], self.top_k[slots], self.top_p[slots], self.seed[slots],
                       counter)
        done = [i for i in rows if self.slots[i].prefilled + chunk[i] == len(self.slots[i].request.prompt)]
        for i in rows:
            self.slots[i].prefilled += chunk[i]
        if not done:
            return
        mine = torch.tensor([rows.index(i) for i in done], device=self.device)
        at = torch.tensor(done, device=self.device)
        self.tokens[at] = first[mine]
        self.pos[at] = torch.tensor([len(self.slots[i].request.prompt) for i in done], device=self.device)
        self.active[at] = 1
        for i, token in zip(done, first[mine].tolist()):
            if accept(self.slots[i].request, [token], self.decode):
                self._release(i, finished)

    def _pass_inputs(self, rows: list[int], chunk: dict[int, int]) -> dict[str, torch.Tensor]:
        """A prefill pass's inputs for the next `chunk[i]` prompt tokens of each of the slots `rows`, padded to
        the longest (at the scratch position), and to 2 tokens at least: the compiler specialises a size of 1."""
        t = max(2, *(chunk[i] for i in rows))
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        positions = torch.full((len(rows), t), self.scratch, dtype=torch.long)
        for r, i in enumerate(rows):
            start, n = self.slots[i].prefilled, chunk[i]
            ids[r, :n] = torch.tensor(self.slots[i].request.prompt[start:start + n])
            positions[r, :n] = torch.arange(start, start + n)
        slots = torch.tensor(rows, device=self.device)
        return dict(ids=ids.to(self.device), positions=positions.to(self.device), slots=slots,
                    last=torch.tensor([chunk[i] - 1 for i in rows], device=self.device),
                    adapter=self.adapter_ids[slots])

    def _prefill_forward(self, inputs: dict, fresh: bool, reach: int) -> torch.Tensor:
        return self._prefill_graphs(inputs, fresh, reach)

    def _prefill_pass(self, inputs: dict, fresh: bool, keys: int) -> torch.Tensor:
        self.rows.ids = inputs["adapter"]
        # cuDNN's attention, which SDPA prefers on Hopper, builds an execution plan for every new shape (others
        # measured 42-400 ms a build), and prompts come in every length: kernels without plans instead. (The
        # server's slow prefills were the launches, not this: bench/README.md, twentieth lease.)
        with WITHOUT_CUDNN_ATTENTION:
            return forward_tokens(self.model, self.cache, self.rope, inputs["ids"], inputs["positions"],
                                  inputs["slots"], inputs["last"], fresh, keys, layer=self._layer)

    # ---- decode -------------------------------------------------------------------------------------
    def _decode_burst(self, finished: list[Request]) -> None:
        live = [i for i, s in enumerate(self.slots) if s is not None and s.decoding]
        # Each row's input position (its last token's). A row whose budget ends inside the burst runs on and
        # its extra tokens are dropped: a burst ends at a row's last cache position, not its last token, so
        # requests of mixed lengths do not cut every burst short (each cut is a host round trip).
        pos = [len(self.slots[i].request.prompt) + len(self.slots[i].request.tokens) - 1 for i in live]
        steps = min(self.sync_every, self.max_len - max(pos))
        reach = max(pos) + steps + 1
        keys = self._key_count(self._keys(reach))
        sampling = any(not self.slots[i].request.sampling.greedy for i in live)
        # A request alone in the first slot steps as one row (slots fill from the first): one-row kernels, where
        # all the slots' step ran every linear layer at their rows (int4's at 0.7x bf16's speed, served alone).
        m = 1 if live == [0] else len(self.slots)
        tokens, pos = self.tokens[:m], self.pos[:m]
        self.rows.ids = self.adapter_ids[:m]
        for j in range(steps):
            if sampling:
                nxt = self._steps[1](tokens, pos, self.temperature[:m], self.top_k[:m], self.top_p[:m],
                                     self.seed[:m], keys)
            else:
                nxt = self._steps[0](tokens, pos, keys)
            self.out[:m, j].copy_(nxt)
            tokens.copy_(nxt)
            pos.add_(self.active[:m])
        new = self.out[:m, :steps].tolist()  # the one host sync of the burst
        if self._check_sums is not None:
            self._check_sums()
        for i in live:
            if accept(self.slots[i].request, new[i], self.decode):
                self._release(i, finished)

    def _key_count(self, keys: int) -> torch.Tensor:
        """`keys` as the size of an empty tensor [keys, 0] that the compiler takes as dynamic: one compiled step
        serves every key count short of the whole cache (a CUDA graph is recorded for each, without compiling;
        the whole cache, its size equal to the cache's, is a compile of its own). As a plain int each count was a
        compile of its own, four a bucket (greedy and sampling, one row and every slot), minutes for a 7B model
        at a long context."""
        count = self._key_space[:keys]
        if self.compile:  # the mark is the compiler's: an eager engine need not import it (a second a process)
            torch._dynamo.maybe_mark_dynamic(count, 0)
        return count

    def _keys(self, reach: int) -> int:
        """The cached positions a decode step reads: a power of two (at least 512) covering `reach`, so a
        step over short requests reads little of a long cache (each size a CUDA graph of its own)."""
        keys = 512
        while keys < reach:
            keys *= 2
        return min(keys, self.max_len + 1)
