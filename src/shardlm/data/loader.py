"""Read prepared token shards and sample fixed-length windows in a layout-independent order.

Every shard is cut into non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets,
as nanoGPT and Megatron do). The sampler permutes the window indices with a generator seeded by
(seed, epoch) and hands out global sample k; a training step takes the next global_batch_size samples
and each data-parallel rank takes its contiguous slice of them. The global order therefore depends
only on the seed, never on the number of ranks, and the whole position is one integer: the number
of samples consumed, which checkpoints save.

Instruction data (data/instruct.py) brings a loss mask shard beside each token shard: targets whose mask is
0 become IGNORE (-100, F.cross_entropy's ignore_index) and take no part in the loss. Prepared with
`--pad-to seq_len`, such data holds one example per window of seq_len + 1 tokens, and the windows follow
each other without overlap.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ..config import IGNORE
from .prepare import HEADER_BYTES, INDEX, MAGIC

VERIFY_CHUNK = 1 << 24  # tokens scanned at a time when checking a shard


class DataError(ValueError):
    """A prepared data directory is missing, truncated, corrupt or does not fit the model."""


def read_index(directory: Path) -> dict:
    """`directory`'s index.json, refused where it is missing, unreadable, or not one `data prepare` wrote."""
    index_path = directory / INDEX
    if not index_path.is_file():
        raise DataError(f"{directory} is not a prepared data directory (no {INDEX}; run `shardlm data prepare`)")
    try:
        index = json.loads(index_path.read_text())
    except ValueError as e:
        raise DataError(f"{index_path} is corrupt ({e})") from None
    if not isinstance(index, dict) or index.get("format") != "shardlm-tokens":
        # LitData's optimize() writes an index.json too: its directory was called corrupt, or asked for a tokenizer.
        raise DataError(f"{index_path} is not the index of a dataset `shardlm data prepare` wrote (another tool's, "
                        "such as LitData's): prepare the text with `shardlm data prepare` and give its --out")
    return index


def data_bytes(directory: str | Path) -> int:
    """The bytes of a prepared directory's token shards and loss masks, by its index (what opening it reads)."""
    index = read_index(Path(directory))
    try:
        itemsize = np.dtype(index["dtype"]).itemsize
        masks = sum(m["tokens"] for m in index.get("loss_mask") or [])  # a byte a token
        return sum(s["tokens"] * itemsize for s in index["shards"]) + masks
    except (KeyError, TypeError):
        return 0  # a corrupt index: TokenShards names what is wrong with it


class TokenShards:
    """The memory-mapped shards of one prepared directory, checked against its index and the model."""

    def __init__(self, directory: str | Path, model_vocab: int | None = None, verify: bool = True):
        self.dir = Path(directory)
        index_path = self.dir / INDEX
        self.index = read_index(self.dir)
        try:
            self.dtype = np.dtype(self.index["dtype"])
            shards = self.index["shards"]
            self.tokens: list[np.memmap] = [self._open(self.dir / s["file"], s, model_vocab, verify) for s in shards]
            # Loss masks of instruction data, one per token shard and of its length (None: every token trains).
            masks = self.index.get("loss_mask")
            self.masks = None if masks is None else [
                self._open(self.dir / m["file"], m, None, verify, np.dtype(np.uint8)) for m in masks]
        except (KeyError, TypeError) as e:  # a shard's entry edited by hand: a KeyError's traceback
            raise DataError(f"{index_path} is corrupt ({type(e).__name__}: {e})") from None
        if self.masks is not None and [len(m) for m in self.masks] != [len(t) for t in self.tokens]:
            raise DataError(f"{index_path}: the loss masks do not match the token shards")
        self.pad_to = self.index.get("pad_to")

    def identity(self) -> dict:
        """The data's size in tokens and a digest of its tokens and loss masks, which a checkpoint keeps so that a
        resume over other tokens (the directory prepared again from other text) is noticed.

        The digest is taken over the CRC32 of every shard (and mask) that the index lists, not over the tokens: the
        CRCs cover every token, and _open checked each against its file when the data was opened, so the digest
        costs no second pass over the data. Hashing the tokens themselves would read a 1 GB dataset once more on
        every rank at every start; a sample of them would miss an edit between the samples."""
        entries = [[s["tokens"], s["crc32"]] for s in [*self.index["shards"], *(self.index.get("loss_mask") or [])]]
        digest = hashlib.sha256(json.dumps([entries, self.pad_to]).encode()).hexdigest()[:16]
        return {"tokens": sum(len(t) for t in self.tokens), "digest": digest}

    def _open(self, path: Path, entry: dict, model_vocab: int | None, verify: bool, dtype=None) -> np.memmap:
        n = entry["tokens"]
        dtype = dtype or self.dtype
        if not path.is_file():
            raise DataError(f"shard {path} is missing")
        expected = HEADER_BYTES + n * dtype.itemsize
        size = path.stat().st_size
        if size != expected:
            raise DataError(f"shard {path} is truncated or corrupt: {size} bytes, expected {expected}")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if header[:len(MAGIC)] != MAGIC or struct.unpack("<Q", header[len(MAGIC):])[0] != n:
            raise DataError(f"shard {path} has a bad header (not a shardlm token shard, or corrupt)")
        if model_vocab is not None and entry["max_id"] >= model_vocab:
            # Most often a preset's vocab_size (tiny's 512) under data of a real tokenizer (GPT-2's 50,257 tokens).
            raise DataError(f"shard {path} holds token id {entry['max_id']} >= the model's vocab_size {model_vocab}: "
                            f"{self.dir} was prepared with a tokenizer of {self.index.get('vocab_size', '?')} tokens; "
                            "prepare it with the model's tokenizer, or (a model trained from scratch) set "
                            "model.vocab_size to at least that (0 takes the data's tokenizer size)")
        data = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))
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
    """Windows of seq_len + 1 tokens over all shards (a window never spans two shards), each sharing its last
    token with the next one's first, or one per example where the data was prepared with --pad-to."""

    def __init__(self, shards: TokenShards, seq_len: int):
        self.shards, self.seq_len = shards, seq_len
        if shards.pad_to is not None and shards.pad_to != seq_len:
            raise DataError(f"{shards.dir} holds one example per window of {shards.pad_to} tokens (--pad-to), "
                            f"but train.seq_len = {seq_len}: prepare it again with --pad-to {seq_len}")
        if shards.masks is not None and not shards.pad_to and shards.index.get("eos_inside_examples"):
            raise DataError(f"{shards.dir}: {shards.index['eos_inside_examples']} examples hold the end-of-text token "
                            "inside them (a chat template that closes every turn with it, or a prompt or answer "
                            "that spells the token out, which tokenizes as the token), so packed examples "
                            f"cannot be told apart: prepare it with --pad-to {seq_len} (one example per window)")
        self.stride = seq_len + 1 if shards.pad_to else seq_len
        counts = [max(0, (len(t) - 1) // seq_len) if not shards.pad_to else len(t) // self.stride
                  for t in shards.tokens]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self.starts[-1] == 0:
            window = f"fewer than the {seq_len + 1} of one window of train.seq_len {seq_len}"
            if len(shards.tokens) > 1:  # a window never spans two shards
                raise DataError(f"{shards.dir}'s shards hold {max(len(t) for t in shards.tokens):,} tokens at most, "
                                f"{window}: prepare it again with a larger --shard-tokens")
            have = sum(len(t) for t in shards.tokens)
            raise DataError(f"{shards.dir} holds {have:,} tokens, {window}: lower train.seq_len (to "
                            f"{max(have - 1, 1)} at most), or prepare more text")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _slice(self, i: int) -> tuple[int, int]:
        s = int(np.searchsorted(self.starts, i, side="right") - 1)
        return s, (i - int(self.starts[s])) * self.stride

    def window(self, i: int) -> np.ndarray:
        s, off = self._slice(i)
        return np.asarray(self.shards.tokens[s][off:off + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))

    def trained(self, indices) -> torch.Tensor | None:
        """Which targets of the windows `indices` are trained on ([n, seq_len] bool), None: all of them. Packed
        examples train no target whose input is the end-of-text closing the one before: that target opens the
        next example, which the closed one's tokens (all its attention sees) cannot predict; where the opening
        token was trained (an empty prompt, no beginning-of-sequence token), the model learnt to guess it."""
        if self.shards.masks is None:
            return None
        eos = self.shards.index.get("eos_id") if not self.shards.pad_to else None
        rows = []
        for i in indices:
            s, off = self._slice(int(i))
            row = np.asarray(self.shards.masks[s][off + 1:off + self.seq_len + 1], dtype=bool)
            if eos is not None:
                row &= np.asarray(self.shards.tokens[s][off:off + self.seq_len]) != eos
            rows.append(row)
        return torch.from_numpy(np.stack(rows))

    def pairs(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the windows `indices`, untrained targets IGNORE."""
        w = self.batch(indices)
        x, y = w[:, :-1], w[:, 1:]
        trained = self.trained(indices)
        return (x, y) if trained is None else (x, y.masked_fill(~trained, IGNORE))


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
        return self.train.pairs(self.sampler.indices(start, self.micro_batch))

    @property
    def packed_eos(self) -> int | None:
        """The end-of-text id closing each of the instruction examples packed into the windows, whose
        attention the model keeps apart (Decoder.documents); None for other data."""
        shards = self.train.shards
        return shards.index.get("eos_id") if shards.masks is not None and not shards.pad_to else None

    def trained_tokens(self, step: int) -> int | None:
        """The targets trained on in step `step`'s whole global batch (every rank's), None where every
        target is: what the step's loss is the mean over."""
        trained = self.train.trained(self.sampler.indices(step * self.global_batch, self.global_batch))
        return None if trained is None else int(trained.sum())

    def eval_batches(self, count: int):
        if self.eval is None or not len(self.eval_range):
            return
        ids = list(self.eval_range)
        for i in range(0, min(len(ids), count * self.micro_batch), self.micro_batch):
            yield self.eval.pairs(ids[i:i + self.micro_batch])

    def state(self, step: int) -> dict:
        return {"consumed_samples": step * self.global_batch, "seed": self.sampler.seed,
                "train_windows": self.train_windows, **self.train.shards.identity()}


def open_train_data(path: str | Path, eval_path: str | Path | None, eval_windows: int, seq_len: int,
                    model_vocab: int, seed: int, global_batch: int, micro_batch: int,
                    dp: int = 1, dp_rank: int = 0) -> TrainData:
    train = WindowDataset(TokenShards(path, model_vocab), seq_len)
    if eval_path:
        ev = WindowDataset(TokenShards(eval_path, model_vocab), seq_len)
        _refuse_shared_shards(train.shards, ev.shards)
        _refuse_other_packing(train.shards, ev.shards)
        return TrainData(train, ev, range(len(ev)), len(train), seed, global_batch, micro_batch, dp, dp_rank)
    held = min(eval_windows, len(train) // 10)  # never hold out more than a tenth of the data
    n = len(train) - held
    return TrainData(train, train, range(n, len(train)), n, seed, global_batch, micro_batch, dp, dp_rank)


def _refuse_other_packing(train: TokenShards, eval_: TokenShards) -> None:
    """Packed instruction examples are kept apart by an attention mask the run takes from data.path: eval data
    packed where the training's is not (padded with --pad-to, or plain text) was scored with each example
    attending to the one before it, its eval loss no example's own."""
    def packed(s):
        return s.masks is not None and not s.pad_to
    if packed(eval_) and not packed(train):
        how = f"with --pad-to {train.pad_to}" if train.pad_to else "as plain text"
        raise DataError(f"data.eval_path {eval_.dir} holds instruction examples packed into windows (prepared without "
                        f"--pad-to), which the run would score attending across examples: data.path {train.dir} was "
                        f"prepared {how}; prepare the eval data alike")


def _refuse_shared_shards(train: TokenShards, eval_: TokenShards) -> None:
    """data.eval_path holding the training tokens (the same directory, a copy of it, or one of its shards): the
    eval loss was the loss on data trained on, reported as held-out. Shards are compared by token count and
    CRC32, which their index lists."""
    def key(s):
        return s["tokens"], s["crc32"]
    trained = {key(s): s["file"] for s in train.index["shards"]}
    shared = next((s for s in eval_.index["shards"] if key(s) in trained), None)
    if shared is not None:
        raise DataError(f"data.eval_path {str(eval_.dir)!r} holds the training data's tokens (its {shared['file']} is "
                        f"{trained[key(shared)]} of data.path {str(train.dir)!r}): the eval loss would be measured on "
                        "text trained on; prepare held-out text into another directory, or leave data.eval_path "
                        "empty to hold out the last data.eval_windows windows of data.path")
