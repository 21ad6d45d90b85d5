"""Tokenize text into memory-mapped token shards plus an index (`shardlm data prepare`).

The on-disk format follows Megatron-LM's and nanoGPT's flat token files: each shard is a 16-byte
header (magic, token count) followed by uint16 or uint32 token ids, documents separated by the
tokenizer's end-of-text id. `index.json` lists the shards with their token counts, largest id and
CRC32, so a truncated or corrupt shard is caught at load time and named. Inputs are streamed in
bounded chunks, so multi-GB files need little memory.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..tokenizer import Tokenizer, load_tokenizer

MAGIC = b"SHLMTOK1"
HEADER_BYTES = 16
INDEX = "index.json"
CHUNK_CHARS = 1 << 20  # text per tokenizer call: bounds memory, large enough to keep the Rust tokenizer busy


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token arrays to numbered shard files of at most `shard_tokens` tokens each."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int):
        self.out, self.dtype, self.shard_tokens = out, dtype, shard_tokens
        self.shards: list[dict] = []
        self.file = None

    def _open(self):
        name = f"shard_{len(self.shards):05d}.bin"
        self.file = open(self.out / name, "wb")
        self.file.write(MAGIC + struct.pack("<Q", 0))
        self.current = {"file": name, "tokens": 0, "max_id": -1, "crc32": 0}

    def _close(self):
        f, cur = self.file, self.current
        f.seek(len(MAGIC))
        f.write(struct.pack("<Q", cur["tokens"]))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        self.shards.append(cur)
        self.file = None

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self.file is None:
                self._open()
            room = self.shard_tokens - self.current["tokens"]
            part, ids = ids[:room], ids[room:]
            data = part.tobytes()
            self.file.write(data)
            cur = self.current
            cur["tokens"] += len(part)
            cur["max_id"] = max(cur["max_id"], int(part.max()))
            cur["crc32"] = zlib.crc32(data, cur["crc32"])
            if cur["tokens"] >= self.shard_tokens:
                self._close()

    def finish(self) -> list[dict]:
        if self.file is not None:
            self._close()
        return self.shards


def _chunks_of_file(path: Path) -> Iterator[str]:
    """A text file in pieces that end at line boundaries (BPE merges rarely cross a newline)."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        buf: list[str] = []
        size = 0
        for line in f:
            buf.append(line)
            size += len(line)
            if size >= CHUNK_CHARS:
                yield "".join(buf)
                buf, size = [], 0
        if buf:
            yield "".join(buf)


def iter_pieces(path: Path, text_field: str) -> Iterator[tuple[str, bool, int]]:
    """Yield (text, ends_a_document, input bytes consumed) for .txt, .jsonl and .parquet inputs.

    A text file is one document, streamed in pieces; every jsonl line or parquet row is a document.
    """
    suffix = path.suffix.lower()
    if suffix in (".txt", ".text", ".md", ".py", ""):
        pieces = _chunks_of_file(path)
        piece = next(pieces, None)
        while piece is not None:
            following = next(pieces, None)
            yield piece, following is None, len(piece.encode("utf-8", errors="replace"))
            piece = following
    elif suffix == ".jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw)[text_field]
                    if not isinstance(text, str):
                        raise TypeError("not a string")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{lineno}: no {text_field!r} string field ({e})") from None
                yield text, True, len(raw)
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading .parquet needs pyarrow: pip install 'shardlm[parquet]'") from None
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)})")
        per_row = path.stat().st_size // max(1, pf.metadata.num_rows)
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text, True, per_row
    else:
        raise ValueError(f"{path}: unsupported input type {suffix!r} (.txt, .jsonl, .parquet)")


def prepare(inputs: Iterable[str | Path], tokenizer: str | Tokenizer, out: str | Path, *,
            shard_tokens: int = 1 << 27, text_field: str = "text", progress: bool = True) -> dict:
    """Tokenize `inputs` into `out`/shard_*.bin + index.json + tokenizer.json; returns the index."""
    from tqdm import tqdm

    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    inputs = [Path(p) for p in inputs]
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} does not exist")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)  # an index is written last: its presence means complete
    for old in out.glob("shard_*.bin"):
        old.unlink()
    dtype = token_dtype(tok.vocab_size)
    writer = ShardWriter(out, dtype, shard_tokens)
    eos = np.asarray([] if tok.eos_id is None else [tok.eos_id], dtype=np.int64)
    documents = 0
    bar = tqdm(total=sum(p.stat().st_size for p in inputs), unit="B", unit_scale=True, desc="tokenize",
               disable=not progress)
    pending: list[tuple[str, bool]] = []
    pending_chars = 0

    def flush():
        nonlocal pending, pending_chars, documents
        for (_, ends), ids in zip(pending, tok.encode_batch([text for text, _ in pending])):
            writer.write(np.asarray(ids, dtype=np.int64))
            if ends:
                writer.write(eos)
                documents += 1
        pending, pending_chars = [], 0

    for path in inputs:
        for text, ends, nbytes in iter_pieces(path, text_field):
            pending.append((text, ends))
            pending_chars += len(text)
            if pending_chars >= CHUNK_CHARS:
                flush()
            bar.update(nbytes)
    flush()
    bar.close()
    shards = writer.finish()
    if not shards:
        raise ValueError("the inputs hold no text")
    index = {"format": "shardlm-tokens", "version": 1, "dtype": dtype.name, "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": "tokenizer.json", "documents": documents,
             "total_tokens": sum(s["tokens"] for s in shards), "shards": shards}
    tok.save(out)
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, out / INDEX)
    return index
