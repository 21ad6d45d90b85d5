"""Tokenize text into memory-mapped token shards plus an index (`shardlm data prepare`).

The on-disk format follows Megatron-LM's and nanoGPT's flat token files: each shard is a 16-byte
header (magic, token count) followed by uint16 or uint32 token ids, documents separated by the
tokenizer's end-of-text id. `index.json` lists the shards with their token counts, largest id and
CRC32, so a truncated or corrupt shard is caught at load time and named. Inputs are streamed in
bounded chunks, so multi-GB files need little memory.

The dataset is built in a scratch directory beside the output and swapped in only when complete
(swap.py), so a failed or killed run never costs the dataset the output held. Inputs are read
strictly: bytes that are not UTF-8 text, a jsonl line that is not a JSON object with a string text
field, a parquet column that is missing or not strings, each stop the run with an error naming the
file (and line) rather than reaching the shards as U+FFFD or a tokenizer's type error.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..tokenizer import HF_SIDE_FILES, Tokenizer, fingerprint, load_tokenizer
from .jsonl import JSON_KINDS, objects
from .swap import building

MAGIC = b"SHLMTOK1"
HEADER_BYTES = 16
INDEX = "index.json"
# Text per tokenizer call and bytes per text-file read: bounds memory, keeps the Rust tokenizer busy.
CHUNK_CHARS = 1 << 20
# Below the floor a typo (1 for 1M) makes a file per token and shards shorter than one training
# window, which the loader never spans; above the ceiling a single shard is terabytes.
MIN_SHARD_TOKENS, MAX_SHARD_TOKENS = 1 << 10, 1 << 40
OWN_FILES = {INDEX, INDEX + ".tmp", "tokenizer.json", *HF_SIDE_FILES}


class PrepareError(ValueError):
    """An input that cannot be read as text of its kind, a bad size, or an output that cannot be replaced."""


def check_shard_tokens(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PrepareError(f"{name} must be a whole number of tokens, got {value!r}")
    if not MIN_SHARD_TOKENS <= value <= MAX_SHARD_TOKENS:
        raise PrepareError(f"{name} {value} is out of range: a shard holds {MIN_SHARD_TOKENS:,} to "
                           f"{MAX_SHARD_TOKENS:,} (2^40) tokens")
    return int(value)


def token_count(text: str, flag: str) -> int:
    """A command-line shard size: 134217728, 134_217_728 or 1.5e8, checked against the bounds."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is None or not number.is_integer():
            raise PrepareError(f"{flag} {text!r} is not a whole number of tokens") from None
        value = int(number)
    return check_shard_tokens(value, flag)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token arrays to numbered shard files of at most `shard_tokens` tokens each."""

    def __init__(self, out: Path, dtype: np.dtype, shard_tokens: int, prefix: str = "shard"):
        self.out, self.dtype, self.shard_tokens, self.prefix = out, dtype, shard_tokens, prefix
        self.shards: list[dict] = []
        self.file = None

    def _open(self):
        name = f"{self.prefix}_{len(self.shards):05d}.bin"
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


def _decode(path: Path, data: bytes, offset: int, line: int) -> str:
    """`data` (from byte `offset`, line `line` of `path`) as text; the first byte that is not UTF-8
    text, or is a NUL (binary files decode as UTF-8 often enough), is reported by line and offset."""
    nul = data.find(b"\0")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if nul < 0 or e.start < nul:
            at = e.start
            line += data.count(b"\n", 0, at)
            bom = offset + at == 0 and data[:2] in (b"\xff\xfe", b"\xfe\xff")
            hint = "; it starts with a UTF-16 byte-order mark" if bom else ""
            raise PrepareError(f"{path}: not UTF-8 text (line {line}, byte offset {offset + at}){hint}") from None
    if nul >= 0:
        line += data.count(b"\n", 0, nul)
        raise PrepareError(f"{path}: binary data, not text (a NUL byte at line {line}, byte offset {offset + nul})")
    return text


_LINE_END = re.compile(rb"(?<=\S)\r?\n")  # a line end right after a word


def _cut(data: bytes, at_least: int, long_line: int) -> int:
    """Where a piece of `data` ends, 0 for not yet: just before the first line end that follows a word, from
    `at_least` bytes on; once `long_line` bytes hold none, before the last whitespace that follows a word, else
    at a character boundary, so memory stays bounded on files without either. Tokenizers split words at
    whitespace, and a run of whitespace (an indented line's newline and spaces) stays whole in the next piece,
    so the pieces, encoded each after the character before it (`_write`), give the text's own tokens."""
    if len(data) < at_least:
        return 0
    found = _LINE_END.search(data, at_least - 1)
    if found or len(data) < long_line:
        return found.start() if found else 0
    cut = max(data.rfind(c) for c in (b" ", b"\t", b"\n", b"\r", b"\f", b"\v"))
    while cut > 0 and data[cut - 1:cut].isspace():  # back to the start of that whitespace run
        cut -= 1
    if cut > 0:
        return cut
    cut = len(data) - 1
    while cut > len(data) - 4 and data[cut] & 0xC0 == 0x80:  # back over UTF-8 continuation bytes
        cut -= 1
    return cut


def _text_pieces(path: Path) -> Iterator[tuple[str, int]]:
    """A text file as (text, bytes) pieces of at least CHUNK_CHARS bytes (but the last)."""
    offset, line, data = 0, 1, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK_CHARS)
            data += block
            cut = _cut(data, CHUNK_CHARS, 4 * CHUNK_CHARS) if block else len(data)
            if cut:
                piece, data = data[:cut], data[cut:]
                yield _decode(path, piece, offset, line), len(piece)
                offset, line = offset + len(piece), line + piece.count(b"\n")
            if not block:
                return


def _jsonl_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    for where, record, nbytes in objects(path, PrepareError, f" with a {text_field!r} field"):
        if text_field not in record:
            keys = ", ".join(map(repr, list(record)[:8])) or "none"
            raise PrepareError(f"{where}: no {text_field!r} field (fields: {keys})")
        text = record[text_field]
        if not isinstance(text, str):
            raise PrepareError(f"{where}: {text_field!r} is {JSON_KINDS.get(type(text), 'a value')}, not a string")
        if not text.isascii():  # a \uD800-style escape makes a lone surrogate, which UTF-8 cannot encode
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PrepareError(f"{where}: {text_field!r} holds an unpaired surrogate "
                                   f"({e.object[e.start]!a}), not Unicode text") from None
        yield text, nbytes


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading .parquet needs pyarrow: pip install 'shardlm[parquet]'") from None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise PrepareError(f"{path}: not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise PrepareError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(text_field).type
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    string_view = getattr(pa.types, "is_string_view", lambda t: False)
    if not (pa.types.is_string(values) or pa.types.is_large_string(values) or string_view(values)):
        raise PrepareError(f"{path}: column {text_field!r} holds {kind}, not strings")
    per_row = path.stat().st_size // max(1, pf.metadata.num_rows)
    try:
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text, per_row
    except pa.ArrowException as e:
        raise PrepareError(f"{path}: unreadable parquet data ({e})") from None


def iter_pieces(path: Path, text_field: str) -> Iterator[tuple[str, bool, int]]:
    """Yield (text, ends_a_document, input bytes consumed) for .txt, .jsonl and .parquet inputs.

    A text file is one document, streamed in pieces; every jsonl line or parquet row is a document.
    """
    suffix = path.suffix.lower()
    if suffix in (".txt", ".text", ".md", ".py", ""):
        pieces = _text_pieces(path)
        piece = next(pieces, None)
        while piece is not None:
            following = next(pieces, None)
            yield piece[0], following is None, piece[1]
            piece = following
    elif suffix == ".jsonl":
        for text, nbytes in _jsonl_documents(path, text_field):
            yield text, True, nbytes
    elif suffix == ".parquet":
        for text, nbytes in _parquet_documents(path, text_field):
            yield text, True, nbytes
    else:
        raise PrepareError(f"{path}: unsupported input type {suffix!r} (.txt, .jsonl, .parquet)")


def _output_dir(out: Path) -> Path:
    """The real directory `out` names (the swap renames it, so a symlink is followed to what it points
    at), refused when it holds anything a dataset does not: that would go with the old dataset."""
    final = Path(os.path.realpath(out))
    if os.path.lexists(final) and not final.is_dir():
        raise PrepareError(f"{out} exists and is not a directory")
    if final.is_dir():
        foreign = sorted(n for n in os.listdir(final) if n not in OWN_FILES and not re.fullmatch(r"(shard|mask)_\d+\.bin", n))
        if foreign:
            more = ", ..." if len(foreign) > 3 else ""
            raise PrepareError(f"{out} holds files that are not part of a prepared dataset ({', '.join(foreign[:3])}"
                               f"{more}): the output directory is replaced whole, so give a new or empty one")
    return final


def _write(inputs: list[Path], tok: Tokenizer, out: Path, shard_tokens: int, text_field: str,
           progress: bool) -> dict:
    from tqdm import tqdm

    dtype = token_dtype(tok.vocab_size)
    writer = ShardWriter(out, dtype, shard_tokens)
    eos = np.asarray([] if tok.eos_id is None else [tok.eos_id], dtype=np.int64)
    bos = np.asarray(tok.bos_ids, dtype=np.int64)  # each document opens as the tokenizer opens a text
    documents = 0
    pending: list[tuple[str, bool]] = []
    pending_chars = 0
    starts = True  # the next piece opens a document

    tail = ""  # the last character of the piece written last

    def flush():
        nonlocal pending, pending_chars, documents, starts, tail
        # A piece that continues a document (a text file's next megabyte, cut at a word's end) is encoded after
        # the character before it, whose tokens are then dropped: a tokenizer that opens every text with a
        # word-start mark (SentencePiece's, Llama 2's) would otherwise put one where the whole text has none.
        # Where a merge crosses the cut, the context's tokens are not a prefix: the piece is encoded alone.
        before = [tail] + [text[-1:] for text, _ in pending[:-1]]
        opens = [starts] + [ends for _, ends in pending[:-1]]
        texts = [text if first else ctx + text for (text, _), first, ctx in zip(pending, opens, before)]
        for (text, ends), first, ctx, ids in zip(pending, opens, before, tok.encode_batch(texts)):
            if not first:
                skip = tok.encode(ctx)
                ids = ids[len(skip):] if ids[:len(skip)] == skip else tok.encode(text)
            if starts:
                writer.write(bos)
            writer.write(np.asarray(ids, dtype=np.int64))
            if ends:
                writer.write(eos)
                documents += 1
            starts = ends
        tail = pending[-1][0][-1:] if pending else tail
        pending, pending_chars = [], 0

    # Closed before an error propagates, so the error is the last line the command prints.
    with tqdm(total=sum(p.stat().st_size for p in inputs), unit="B", unit_scale=True, desc="tokenize",
              disable=not progress) as bar:
        try:
            for path in inputs:
                for text, ends, nbytes in iter_pieces(path, text_field):
                    pending.append((text, ends))
                    pending_chars += len(text)
                    if pending_chars >= CHUNK_CHARS:
                        flush()
                    bar.update(nbytes)
            flush()
        except BaseException:
            if writer.file is not None:  # the scratch directory is removed: let go of its open shard
                writer.file.close()
            raise
    shards = writer.finish()
    if not shards:
        raise PrepareError("the inputs hold no text")
    index = {"format": "shardlm-tokens", "version": 1, "dtype": dtype.name, "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": "tokenizer.json", "tokenizer_fingerprint": fingerprint(tok),
             "documents": documents, "total_tokens": sum(s["tokens"] for s in shards), "shards": shards}
    tok.save(out)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def _write_instruct(inputs: list[Path], tok: Tokenizer, out: Path, shard_tokens: int, pad_to: int | None,
                    progress: bool) -> dict:
    """Instruction examples (data/instruct.py): token shards and loss-mask shards of the same lengths; with
    `pad_to`, one window of pad_to + 1 tokens per example, never split across shards."""
    from tqdm import tqdm

    from .instruct import InstructError, examples, fit
    dtype = token_dtype(tok.vocab_size)
    if pad_to:
        shard_tokens = max(1, shard_tokens // (pad_to + 1)) * (pad_to + 1)
    tokens, masks = ShardWriter(out, dtype, shard_tokens), ShardWriter(out, np.dtype(np.uint8), shard_tokens, "mask")
    count = truncated = trained = inside = untrained = 0
    try:
        with tqdm(total=sum(p.stat().st_size for p in inputs), unit="B", unit_scale=True, desc="tokenize",
                  disable=not progress) as bar:
            for path in inputs:
                for ids, mask, nbytes in examples(path, tok):
                    inside += bool((ids[:-1] == tok.eos_id).any())  # packing finds examples by this token
                    if pad_to:
                        ids, mask, cut = fit(ids, mask, pad_to + 1, tok.eos_id)
                        truncated += cut
                    tokens.write(ids)
                    masks.write(mask)
                    count += 1
                    trained += int(mask.sum())
                    untrained += not mask[bool(pad_to):].any()  # a window's first token is no target
                    bar.update(nbytes)
    except InstructError as e:
        for w in (tokens, masks):
            if w.file is not None:
                w.file.close()
        raise PrepareError(str(e)) from None
    shards, mask_shards = tokens.finish(), masks.finish()
    if not shards:
        raise PrepareError("the inputs hold no examples")
    if untrained == count:
        raise PrepareError(f"no example of the {count:,} has a token to train on (empty completions"
                           + (f", or prompts as long as --pad-to {pad_to}" if pad_to else "") + "): fix the data")
    index = {"format": "shardlm-tokens", "version": 1, "dtype": dtype.name, "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": "tokenizer.json", "tokenizer_fingerprint": fingerprint(tok),
             "documents": count, "examples": count, "untrained_examples": untrained,
             "total_tokens": sum(x["tokens"] for x in shards), "trained_tokens": trained, "shards": shards,
             "loss_mask": mask_shards, "pad_to": pad_to, "truncated": truncated, "eos_inside_examples": inside}
    tok.save(out)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def prepare(inputs: Iterable[str | Path], tokenizer: str | Tokenizer, out: str | Path, *,
            shard_tokens: int = 1 << 27, text_field: str = "text", progress: bool = True,
            pad_to: int | None = None) -> dict:
    """Tokenize `inputs` into `out`/shard_*.bin + index.json + tokenizer.json; returns the index.

    `out` is replaced only by a complete dataset: after any error it holds what it held before.
    """
    shard_tokens = check_shard_tokens(shard_tokens, "shard_tokens")
    out = Path(out)
    final = None
    try:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        inputs = [Path(p) for p in inputs]
        for p in inputs:
            if p.is_dir():
                raise PrepareError(f"input {p} is a directory, not a file")
            if not p.is_file():
                raise FileNotFoundError(f"input {p} does not exist")
        from .instruct import is_instruct
        instruct = [is_instruct(p) for p in inputs]
        if any(instruct) and not all(instruct):
            raise PrepareError("instruction examples (prompt/completion or messages jsonl) and plain text cannot be "
                               "prepared into one dataset: " + ", ".join(str(p) for p, i in zip(inputs, instruct) if i))
        if pad_to is not None and not all(instruct):
            raise PrepareError("--pad-to applies to instruction examples (prompt/completion or messages jsonl)")
        if pad_to is not None and pad_to < 1:
            raise PrepareError(f"--pad-to {pad_to} must be a positive number of tokens (the training's seq_len)")
        final = _output_dir(out)
        with building(final) as scratch:
            if instruct and all(instruct):
                return _write_instruct(inputs, tok, scratch, shard_tokens, pad_to, progress)
            return _write(inputs, tok, scratch, shard_tokens, text_field, progress)
    except (ValueError, OSError) as e:
        final = final or Path(os.path.realpath(out))
        if (final / INDEX).is_file():
            note = f"; {out} still holds its previous dataset"
        elif os.path.lexists(final):
            note = f"; {out} is unchanged"
        else:
            note = ""
        raise (FileNotFoundError if isinstance(e, FileNotFoundError) else PrepareError)(f"{e}{note}") from e
