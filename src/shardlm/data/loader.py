"""Read prepared token shards and sample fixed-length windows in a layout-independent order.

Every shard is cut into non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets,
as nanoGPT and Megatron do). The sampler permutes the window indices with a generator seeded by
(seed, epoch) and hands out global sample k; a training step takes the next global_batch_size samples
and each data-parallel rank takes its contiguous slice of them. The global order therefore depends
only on the seed, never on the number of ranks, and the whole position is one integer: the number
of samples consumed, which checkpoints save.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from .prepare import HEADER_BYTES, INDEX, MAGIC

VERIFY_CHUNK = 1 << 24  # tokens scanned at a time when checking a shard


class DataError(ValueError):
    """A prepared data directory is missing, truncated, corrupt or does not fit the model."""


class TokenShards:
    """The memory-mapped shards of one prepared directory, checked against its index and the model."""

    def __init__(self, directory: str | Path, model_vocab: int | None = None, verify: bool = True):
        self.dir = Path(directory)
        index_path = self.dir / INDEX
        if not index_path.is_file():
            raise DataError(f"{self.dir} is not a prepared data directory (no {INDEX}; run `shardlm data prepare`)")
        try:
            self.index = json.loads(index_path.read_text())
            self.dtype = np.dtype(self.index["dtype"])
            shards = self.index["shards"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DataError(f"{index_path} is corrupt ({e})") from None
        self.tokens: list[np.memmap] = []
        for s in shards:
            path = self.dir / s["file"]
            self.tokens.append(self._open(path, s, model_vocab, verify))

    def _open(self, path: Path, entry: dict, model_vocab: int | None, verify: bool) -> np.memmap:
        n = entry["tokens"]
        if not path.is_file():
            raise DataError(f"shard {path} is missing")
        expected = HEADER_BYTES + n * self.dtype.itemsize
        size = path.stat().st_size
        if size != expected:
            raise DataError(f"shard {path} is truncated or corrupt: {size} bytes, expected {expected}")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:len(MAGIC)] != MAGIC or struct.unpack("<Q", header[len(MAGIC):])[0] != n:
            raise DataError(f"shard {path} has a bad header (not a shardlm token shard, or corrupt)")
        if model_vocab is not None and entry["max_id"] >= model_vocab:
            raise DataError(f"shard {path} holds token id {entry['max_id']} >= the model's vocab_size {model_vocab}")
        data = np.memmap(path, dtype=self.dtype, mode="r", offset=HEADER_BYTES, shape=(n,))
        if verify:
            crc, top = 0, -1
            for i in range(0, n, VERIFY_CHUNK):
                chunk = np.asarray(data[i:i + VERIFY_CHUNK])
                crc = zlib.crc32(chunk.tobytes(), crc)
                top = max(top, int(chunk.max()))
            if crc != entry["crc32"] or top != entry["max_id"]:
                raise DataError(f"shard {path} is corrupt: its checksum does not match {self.dir / INDEX}")
        return data


class WindowDataset:
    """Non-overlapping windows of seq_len + 1 tokens over all shards (a window never spans two shards)."""

    def __init__(self, shards: TokenShards, seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (len(t) - 1) // seq_len) for t in shards.tokens]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.starts[-1] == 0:
            raise DataError(f"{shards.dir} holds fewer than {seq_len + 1} tokens: no window of train.seq_len fits")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def window(self, i: int) -> np.ndarray:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        off = (i - int(self.starts[s])) * self.seq_len
        return np.asarray(self.shards.tokens[s][off:off + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))


class GlobalSampler:
    """Global sample k -> window index: a fresh permutation of `num_windows` per epoch, seeded by (seed, epoch)."""

    def __init__(self, num_windows: int, seed: int):
        self.n, self.seed = num_windows, seed
        self._epoch, self._perm = -1, None

    def index(self, k: int) -> int:
        epoch, pos = divmod(k, self.n)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return int(self._perm[pos])

    def indices(self, start: int, count: int) -> list[int]:
        return [self.index(k) for k in range(start, start + count)]


class TrainData:
    """Micro-batches for (step, dp rank, micro-step), eval batches from held-out windows, and the position."""

    def __init__(self, train: WindowDataset, eval_: WindowDataset | None, eval_range: range, train_windows: int,
                 seed: int, global_batch: int, micro_batch: int, dp: int = 1, dp_rank: int = 0):
        self.train, self.eval, self.eval_range = train, eval_, eval_range
        self.sampler = GlobalSampler(train_windows, seed)
        self.global_batch, self.micro_batch, self.dp, self.dp_rank = global_batch, micro_batch, dp, dp_rank
        self.train_windows = train_windows

    def micro_batch_at(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = self.global_batch // self.dp
        start = step * self.global_batch + self.dp_rank * per_rank + micro * self.micro_batch
        w = self.train.batch(self.sampler.indices(start, self.micro_batch))
        return w[:, :-1], w[:, 1:]

    def eval_batches(self, count: int):
        if self.eval is None or not len(self.eval_range):
            return
        ids = list(self.eval_range)
        for i in range(0, min(len(ids), count * self.micro_batch), self.micro_batch):
            w = self.eval.batch(ids[i:i + self.micro_batch])
            yield w[:, :-1], w[:, 1:]

    def state(self, step: int) -> dict:
        return {"consumed_samples": step * self.global_batch, "seed": self.sampler.seed,
                "train_windows": self.train_windows}


def open_train_data(path: str | Path, eval_path: str | Path | None, eval_windows: int, seq_len: int,
                    model_vocab: int, seed: int, global_batch: int, micro_batch: int,
                    dp: int = 1, dp_rank: int = 0) -> TrainData:
    train = WindowDataset(TokenShards(path, model_vocab), seq_len)
    if eval_path:
        ev = WindowDataset(TokenShards(eval_path, model_vocab), seq_len)
        return TrainData(train, ev, range(len(ev)), len(train), seed, global_batch, micro_batch, dp, dp_rank)
    held = min(eval_windows, len(train) // 10)  # never hold out more than a tenth of the data
    n = len(train) - held
    return TrainData(train, train, range(n, len(train)), n, seed, global_batch, micro_batch, dp, dp_rank)
