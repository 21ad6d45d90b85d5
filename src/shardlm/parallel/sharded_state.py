"""Sharded checkpoints: every rank writes the state it alone owns, in parallel; any layout reads it back.

As PyTorch's distributed checkpoint (DCP) and Megatron's dist_ckpt do, no rank gathers the model. Each rank
writes, for every trainable parameter of its engines, the elements it counts in the global gradient norm
(its ZeRO shard, or under DDP its slice of the replicated buckets; never a tensor-parallel replica's or a
tied copy's elements, which another rank counts), so every element is written exactly once over the
world: the fp32 masters and each optimizer moment, as pieces. A piece is a flat range [lo, hi) of the
rank's local tensor (its pipeline stage's, its tensor-parallel slice), recorded with the local shape and the
tensor-parallel sharding that maps local to full (placement.TPSharding). Pieces are staged into files of
half `train.checkpoint_buffer_mb`, one written while the next is staged, so a save raises a rank's host
memory by that buffer, not by its shard. Frozen parameters (a LoRA base) are written whole (as the model
holds them) by the ranks at data-parallel coordinate 0 (frozen experts split over ep: at edp
coordinate 0, each its block), or where ZeRO-3 shards them, each rank its shard, as the trained ones.

Loading is by name, as before (checkpoint.py's `ShardedState`: each full tensor assembled from its pieces
when it is read, one at a time); the layout that loads takes its own slices of it
(Parallelized.load_full_state). So a checkpoint written at tp 2 x pp 2 loads at ZeRO-3 dp 4, at one process
or at tp 4.
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..runtime.device import host_empty
from ..sharding import TPSharding
from .placement import data_placements, shardings
from .qlora import plain


# ---- writing ---------------------------------------------------------------------------------------

def _owned_ranges(opt, b: int, off: int, numel: int) -> list[tuple[int, int]]:
    """Sub-ranges (bucket coordinates) of parameter [off, off + numel) in bucket b that this rank writes."""
    lo, hi, _ = opt.counted_range(b)
    lo, hi = max(lo, off), min(hi, off + numel)
    if hi <= lo:
        return []
    out = [(lo, hi)]
    for db, d_lo, d_hi in opt.duplicates:  # another rank counts (and writes) these
        if db == b:
            out = [r for a, z in out for r in ((a, min(z, d_lo)), (max(a, d_hi), z)) if r[1] > r[0]]
    return out


def owned_pieces(engine, model, mesh) -> Iterator[tuple[str, str, int, int, tuple, torch.Tensor]]:
    """(name, kind, lo, hi, local shape, values) of every piece this rank writes; kind "master" or a moment.
    No collective: the pieces may be taken and written by another thread, beside the main thread's."""
    frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
    return _owned(engine, model, mesh, frozen, engine.frozen_shard_pieces() if frozen else {})


def _ranges_written(spec, shape, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` of a local tensor of `shape` less the elements another tensor-parallel rank writes."""
    for d_lo, d_hi in (spec.duplicates(shape) if spec is not None else []):
        ranges = [r for a, z in ranges for r in ((a, min(z, d_lo)), (max(a, d_hi), z)) if r[1] > r[0]]
    return ranges


def _owned(engine, model, mesh, frozen: list, sharded: dict):
    for e in engine.group_engines():
        opt = e.opt
        if opt is None:
            continue
        flat = e.flat
        kinds = {"master": opt.master_parts, **opt.state}
        for i, name in enumerate(flat.names):
            b, off = flat.where[i]
            _, _, start = opt.counted_range(b)
            for a, z in _owned_ranges(opt, b, off, flat.params[i].numel()):
                for kind, parts in kinds.items():
                    yield name, kind, a - off, z - off, tuple(flat.params[i].shape), parts[b][a - start:z - start]
    if not frozen:
        return
    specs, placements = shardings(model), data_placements(model)
    for name, p in frozen:
        if any(mesh.coord(a) for a in placements[name].copies):
            continue
        shape, spec = tuple(p.shape), specs.get(name)
        if name in sharded:  # ZeRO-3's: each rank of dp x cp its own shard of it
            for lo, hi, values in sharded[name]:
                for a, z in _ranges_written(spec, shape, [(lo, hi)]):
                    yield name, "master", a, z, shape, values[a - lo:z - lo]
            continue
        # Written by the first of its replicas: dp x cp's (dense), edp's (experts split over ep, train.freeze).
        if placements[name].reduce == "dp+cp" and (mesh.coord("dp") or mesh.coord("cp")):
            continue
        if placements[name].reduce != "dp+cp" and any(mesh.coord(a) for a in placements[name].reduce.split("+")):
            continue
        value = plain(p.detach())
        for a, z in _ranges_written(spec, tuple(value.shape), [(0, value.numel())]):
            yield name, "master", a, z, tuple(value.shape), value.reshape(-1)[a:z]


def pieces(engine, model, mesh, buffer_bytes: int) -> Iterator[tuple[dict, torch.Tensor]]:
    """This rank's pieces as (manifest entry, values), none larger than half of `buffer_bytes` (a larger one in
    parts): the file `write_shards` stages each into. Its collective runs in this call (owned_pieces)."""
    return _split(owned_pieces(engine, model, mesh), shardings(model), max(1, buffer_bytes // 8))


def _split(owned, specs: dict, step: int):
    for name, kind, lo, hi, shape, values in owned:
        spec = None if (s := specs.get(name)) is None else _spec_dict(s)
        for at in range(0, hi - lo, step):
            part = values[at:at + step]
            yield ({"name": name, "kind": kind, "key": f"{name}::{kind}::{lo + at}", "lo": lo + at,
                    "hi": lo + at + part.numel(), "shape": list(shape), "tp": spec}, part)


def write_shards(parts, directory: Path, rank: int, buffer_bytes: int, write_file, sync_files,
                 usable=lambda name, value: None, written=None) -> tuple[list, list, Exception | None]:
    """Write `parts` ((entry, values) as `pieces` gives them, none over half of `buffer_bytes`) into files
    `rank{rank:05d}-{n:04d}.safetensors` under `directory`, each holding about half of `buffer_bytes`
    (`write_file(path, tensors)` writes one, unsynced, and returns its record), then flush them all to disk
    (`sync_files(paths)`): while a thread writes one file, the next is staged (copied off the device), so the
    disk never waits for the copies and at most `buffer_bytes` are staged; one flush at the end, not one a
    file, lets the kernel write back in the background meanwhile. Returns the files' records as (name,
    record), the manifest entries, and the first error `usable(name, master)` found (a master not worth
    saving), else None. `written()` is called as each file is written, and flushed."""
    files, entries, staged, size, problem = [], [], {}, 0, None
    writing = None  # the file being written: (name, its future)

    def wait():
        nonlocal writing
        if writing is not None:
            name, future = writing
            writing = None
            files.append((name, future.result()))  # an OSError of the write raises here
            if written is not None:
                written()

    def flush(pool):
        nonlocal staged, size, writing
        wait()
        if staged:
            fname = f"rank{rank:05d}-{len(files):04d}.safetensors"
            for entry in entries[-len(staged):]:
                entry["file"] = fname
            writing = (fname, pool.submit(write_file, directory / fname, staged))
            staged, size = {}, 0

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shards-rank{rank}") as pool:
        try:
            for entry, values in parts:
                value = values.detach().to("cpu", stored_dtype(values)).contiguous()
                if entry["kind"] == "master" and problem is None:
                    problem = usable(entry["name"], value)
                entries.append(entry)
                staged[entry["key"]] = value
                size += value.numel() * value.element_size()
                if 2 * size >= buffer_bytes:
                    flush(pool)
            flush(pool)
        finally:
            wait()
        for name, _ in files:  # one file at a time: each a sign of progress where a flush takes minutes
            pool.submit(sync_files, [directory / name]).result()
            if written is not None:
                written()
    return files, entries, problem


def stored_dtype(values: torch.Tensor) -> torch.dtype:
    """The dtype a piece is written in: a 16-bit one as it is held (a LoRA run's frozen base, bf16 masters and
    moments: fp32 would double their bytes and add nothing), any other in fp32. Readers assemble in fp32."""
    return values.dtype if values.dtype in (torch.bfloat16, torch.float16) else torch.float32


def staged_bytes(values: torch.Tensor) -> int:
    """A piece's bytes in an asynchronous save's staging buffer, rounded up to keep the next one aligned."""
    return -(-values.numel() * stored_dtype(values).itemsize // 16) * 16


def snapshot(parts, pin: bool, staging: torch.Tensor | None = None) -> list[tuple[dict, torch.Tensor]]:
    """The pieces copied into host memory (page-locked where `pin`), so that training may change its own
    buffers while a thread writes these: an asynchronous save's one pass over the state. `staging`: a host
    byte buffer of at least their staged_bytes to copy into (kept from save to save: page-locking tens of GB
    takes seconds), else fresh memory."""
    out, at = [], 0
    for entry, values in parts:
        n, dtype = values.numel(), stored_dtype(values)
        if staging is not None:
            copy = staging[at:at + n * dtype.itemsize].view(dtype)
            at += staged_bytes(values)
        else:
            copy = host_empty(n, dtype, pin)
        copy.copy_(values.detach().reshape(-1), non_blocking=pin)
        out.append((entry, copy))
    if pin:
        torch.cuda.synchronize()
    return out


def _spec_dict(spec: TPSharding) -> dict:
    return {"rank": spec.rank, "degree": spec.degree, "dim": spec.dim, "parts": list(spec.parts),
            "split": list(spec.split), "pad": spec.pad, "axis": spec.axis}
