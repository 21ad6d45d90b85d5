"""A sharded checkpoint's tensors read by name, each assembled from its pieces when it is read (as DCP's and
Megatron's dist_ckpt loaders reshard on load): `LazyMap`, the read-only mapping engines load from, whose
values are computed on access and whose flat ranges may be read alone; `ShardedState`, which maps a
checkpoint's manifest of pieces (parallel/sharded_state.py writes them) onto full tensors, reading only the
pieces that overlap what is asked for.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
import threading
from itertools import islice
from pathlib import Path

import torch
from safetensors import safe_open

from .sharding import TPSharding


class LazyMap(Mapping):
    """A read-only mapping whose values are computed when read (full tensors assembled from pieces).
    `ranged(key, lo, hi)`, where given, reads flat elements [lo, hi) of a value alone (None: it cannot)."""

    def __init__(self, keys, get, ranged=None):
        self._keys, self._get, self._ranged = list(keys), get, ranged
        self._set = set(self._keys)

    def __getitem__(self, key):
        if key not in self._set:
            raise KeyError(key)
        return self._get(key)

    def __iter__(self) -> Iterator:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._set

    def where(self, keep) -> "LazyMap":
        return LazyMap([k for k in self._keys if keep(k)], self._get, self._ranged)

    def mapped(self, fn, keeps_ranges=lambda key: False) -> "LazyMap":
        """The same keys, each value passed through fn(key, value) when read; `keeps_ranges(key)`: fn leaves
        that key's value as it is, so its ranges may still be read alone."""
        ranged = None if self._ranged is None else \
            (lambda k, lo, hi: self._ranged(k, lo, hi) if keeps_ranges(k) else None)
        return LazyMap(self._keys, lambda k: fn(k, self._get(k)), ranged)

    def read_flat(self, key, lo: int, hi: int) -> torch.Tensor:
        """Flat elements [lo, hi) of the value of `key`: only the pieces that overlap them are read where the
        mapping can (a sharded checkpoint's, no tensor-parallel slicing between), else the whole value."""
        if key not in self._set:
            raise KeyError(key)
        got = None if self._ranged is None else self._ranged(key, lo, hi)
        return got if got is not None else self._get(key).reshape(-1)[lo:hi]


def read_flat(mapping: Mapping, key, lo: int, hi: int) -> torch.Tensor:
    """Flat elements [lo, hi) of mapping[key], read alone where the mapping can (a LazyMap)."""
    return mapping.read_flat(key, lo, hi) if isinstance(mapping, LazyMap) else mapping[key].reshape(-1)[lo:hi]


def read_ahead(read: Callable, items: Iterable, threads: int = 4) -> Iterator:
    """read(item) for each item, in order, with up to `threads` reads in flight beside the result the consumer
    holds: reading a checkpoint's pages (safetensors maps its files; the copies out of them release the GIL)
    overlaps itself and what the consumer does with each result. A read's exception is raised at its item."""
    items = iter(items)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardlm-read-ahead") as pool:
        pending = deque(pool.submit(read, item) for item in islice(items, threads))
        while pending:
            result = pending.popleft().result()
            pending.extend(pool.submit(read, item) for item in islice(items, 1))
            yield result


def as_lazy(state: Mapping) -> LazyMap:
    return state if isinstance(state, LazyMap) else LazyMap(state.keys(), state.__getitem__)


class ShardedState:
    """A sharded checkpoint's tensors by name, each assembled from its pieces when read: `masters()` and
    `optimizer()` are the mappings a full checkpoint's two files were."""
    OPEN_FILES = 64

    def __init__(self, directory: Path, manifest: dict):
        self.directory = directory
        self.steps = manifest["optimizer_steps"]
        self.pieces: dict[tuple[str, str], list[dict]] = {}
        for entry in manifest["pieces"]:
            self.pieces.setdefault((entry["name"], entry["kind"]), []).append(entry)
        self._open: dict[str, object] = {}  # by file name, the least recently read first
        self._lock = threading.Lock()

    def masters(self) -> LazyMap:
        names = [n for n, k in self.pieces if k == "master"]
        return LazyMap(names, lambda n: self.full(n, "master"), lambda n, lo, hi: self.flat_range(n, "master", lo, hi))

    def optimizer(self) -> LazyMap:
        keys = [f"{n}::{k}" for n, k in self.pieces if k != "master"]
        trained = dict.fromkeys(n for n, k in self.pieces if k != "master")
        keys += [f"{n}::step" for n in trained]

        def get(key: str) -> torch.Tensor:
            name, kind = key.rsplit("::", 1)
            return torch.tensor(float(self.steps)) if kind == "step" else self.full(name, kind)

        def ranged(key: str, lo: int, hi: int) -> torch.Tensor | None:
            name, kind = key.rsplit("::", 1)
            return None if kind == "step" else self.flat_range(name, kind, lo, hi)
        return LazyMap(keys, get, ranged)

    def shape(self, name: str, kind: str = "master") -> tuple[int, ...]:
        """The full tensor's shape, from the manifest alone."""
        entry = self.pieces[(name, kind)][0]
        tp = entry["tp"]
        return tuple(entry["shape"]) if tp is None else \
            TPSharding(tp["rank"], tp["degree"], tp["dim"], tuple(tp["parts"]), tuple(tp["split"]),
                       tp["pad"]).full_shape(entry["shape"])

    def _file(self, entry: dict):
        # The most recently read files stay open (a tensor's pieces lie in a few, read in turn); the others
        # are closed, so that a checkpoint of thousands of files stays under the process's open-file limit.
        name = entry["file"]
        with self._lock:  # read_ahead's threads read pieces at once
            f = self._open.pop(name, None)
            if f is None:
                f = safe_open(str(self.directory / name), framework="pt")
                if len(self._open) >= self.OPEN_FILES:
                    self._open.pop(next(iter(self._open)))
            self._open[name] = f
        return f

    def _read(self, entry: dict) -> torch.Tensor:
        return self._file(entry).get_tensor(entry["key"])

    def flat_range(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        """Flat elements [lo, hi) of the full tensor, read from the pieces that overlap them, only as much of
        each as overlaps; None where the pieces are tensor-parallel slices (their flat ranges are not the
        full tensor's: `full` joins them)."""
        pieces = self.pieces[(name, kind)]
        if any(e["tp"] is not None and e["tp"]["dim"] is not None for e in pieces):
            return None
        out = torch.zeros(hi - lo, dtype=torch.float32)
        for e in pieces:
            a, z = max(lo, e["lo"]), min(hi, e["hi"])
            if a < z:
                out[a - lo:z - lo] = self._file(e).get_slice(e["key"])[a - e["lo"]:z - e["lo"]]
        return out

    def full(self, name: str, kind: str) -> torch.Tensor:
        """The full tensor: each tensor-parallel rank's local tensor filled from its pieces, then joined."""
        pieces = self.pieces[(name, kind)]
        locals_by_rank: dict[int, torch.Tensor] = {}
        spec = None
        for entry in pieces:
            tp = entry["tp"]
            spec = TPSharding(tp["rank"], tp["degree"], tp["dim"], tuple(tp["parts"]), tuple(tp["split"]), tp["pad"]) \
                if tp is not None else None
            r = 0 if spec is None else spec.rank
            local = locals_by_rank.get(r)
            if local is None:
                local = locals_by_rank[r] = torch.zeros(entry["shape"], dtype=torch.float32)
            local.view(-1)[entry["lo"]:entry["hi"]] = self._read(entry)
        if spec is None or spec.dim is None:
            return locals_by_rank[0]
        return spec.full([locals_by_rank.get(r, torch.zeros_like(locals_by_rank[0])) for r in range(spec.degree)])
