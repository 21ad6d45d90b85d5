"""Tokenize text into memory-mapped token shards plus an index (`shardlm data prepare`).

The on-disk format follows Megatron-LM's and nanoGPT's flat token files: each shard is a 16-byte
header (magic, token count) followed by uint16 or uint32 token ids, documents separated by the
tokenizer's end-of-text id. `index.json` lists the shards with their token counts, largest id and
CRC32, so a truncated or corrupt shard is caught at load time and named. Inputs (documents.py) are streamed
in bounded pieces, so multi-GB files need little memory.

The dataset is built in a scratch directory beside the output and swapped in only when complete
(swap.py), so a failed or killed run never costs the dataset the output held. Inputs are read strictly
(documents.py): an error names the file and line rather than reaching the shards as U+FFFD or a
tokenizer's type error.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np

from ..runtime.progress import progress as progress_bar
from ..tokenizer import HF_SIDE_FILES, Tokenizer, fingerprint, load_tokenizer, slow_tokenizer_hint
from .documents import PrepareError, check_input_type, expanded, iter_pieces, refuse_repeats
from .swap import SCRATCH, building, remove_leftovers

MAGIC = b"SHLMTOK1"
HEADER_BYTES = 16
INDEX = "index.json"
# Text per tokenizer call and bytes per text-file read: bounds memory, keeps the Rust tokenizer busy.
CHUNK_CHARS = 1 << 20
# Below the floor a typo (1 for 1M) makes a file per token and shards shorter than one training
# window, which the loader never spans; above the ceiling a single shard is terabytes.
MIN_SHARD_TOKENS, MAX_SHARD_TOKENS = 1 << 10, 1 << 40
OWN_FILES = {INDEX, INDEX + ".tmp", "tokenizer.json", *HF_SIDE_FILES}


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


def _output_dir(out: Path) -> Path:
    """The real directory `out` names (the swap renames it, so a symlink is followed to what it points
    at), refused when it holds anything a dataset does not: that would go with the old dataset."""
    final = Path(os.path.realpath(out))
    if os.path.lexists(final) and not final.is_dir():
        raise PrepareError(f"{out} exists and is not a directory")
    if final.is_dir():
        # A killed run's scratch directory inside an empty --out is this command's own leftover, not a foreign file.
        remove_leftovers(final)
        foreign = sorted(n for n in os.listdir(final) if n not in OWN_FILES and not re.fullmatch(r"(shard|mask)_\d+\.bin", n))
        if foreign:
            more = ", ..." if len(foreign) > 3 else ""
            raise PrepareError(f"{out} holds files that are not part of a prepared dataset ({', '.join(foreign[:3])}"
                               f"{more}): the output directory is replaced whole, so give a new or empty one")
        if os.path.ismount(final) and os.listdir(final):
            # A rename cannot swap a mount point (a container's volume) for another directory: it failed with EBUSY
            # once the whole input was tokenized. Only an empty one is filled in place.
            raise PrepareError(f"{out} is a mount point holding a dataset, which a rename cannot replace whole: "
                               "empty it first (the new dataset is then written into it), or give another --out")
    # Inside another dataset it would be a foreign file of that one, which its next preparation refuses.
    above = next((d for d in final.parents if (d / INDEX).is_file()), None)
    if above is not None:
        raise PrepareError(f"{out} is inside the prepared dataset {above}: give an --out outside it")
    return final


def _blank(path: Path) -> bool:
    """Whether `path` holds no text at all (whitespace at most)."""
    with open(path, "rb") as f:
        return not any(line.strip() for line in f)


class _Moving:
    """A progress bar whose updates also call `moved()` (None: nothing more)."""

    def __init__(self, bar, moved):
        self.bar, self.moved = bar, moved

    def update(self, n: int) -> None:
        self.bar.update(n)
        if self.moved is not None:
            self.moved()


def _write(inputs: list[Path], tok: Tokenizer, out: Path, shard_tokens: int, text_field: str,
           progress: bool, moved=None) -> dict:
    dtype = token_dtype(tok.vocab_size)
    writer = ShardWriter(out, dtype, shard_tokens)
    eos = np.asarray([] if tok.eos_id is None else [tok.eos_id], dtype=np.int64)
    bos = np.asarray(tok.bos_ids, dtype=np.int64)  # each document opens as the tokenizer opens a text
    documents = empty = 0
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
        for (text, ends), first, ctx, ids in zip(pending, opens, before, tok.encode_plain_batch(texts)):
            if not first:
                skip = tok.encode_plain_batch([ctx])[0]
                ids = ids[len(skip):] if ids[:len(skip)] == skip else tok.encode_plain_batch([text])[0]
            if starts and documents and not len(eos):
                # Nothing would mark where one document ends and the next begins: training would read them as
                # one text, and the index would still count them apart.
                where = getattr(tok, "source", None) or "the tokenizer"
                raise PrepareError(f"{where} has no end-of-text token to separate the documents with: set "
                                   "tokenizer_config.json's eos_token to the token that ends a text (one of "
                                   "tokenizer.json's), or give a tokenizer that has one")
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
    with progress_bar(sum(p.stat().st_size for p in inputs), "tokenize", "B", progress, scale=True) as shown:
        bar = _Moving(shown, moved)
        try:
            for path in inputs:
                for text, ends, nbytes in iter_pieces(path, text_field, CHUNK_CHARS):
                    if not text and ends and (pending[-1][1] if pending else starts):
                        # An empty jsonl line's or parquet row's text (a third of wikitext's rows) was written as an
                        # end-of-text alone, runs of them trained on and counted as documents; as Megatron does,
                        # it is no document.
                        empty += 1
                        bar.update(nbytes)
                        continue
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
        raise PrepareError(f"--input {' '.join(map(str, inputs))}: no text to tokenize (empty): give files that hold "
                           "text")
    index = {"format": "shardlm-tokens", "version": 1, "dtype": dtype.name, "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": "tokenizer.json", "tokenizer_fingerprint": fingerprint(tok),
             "documents": documents, "empty_documents": empty, "total_tokens": sum(s["tokens"] for s in shards),
             "shards": shards}
    tok.save(out)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def _write_plain_template(out: Path, tok: Tokenizer) -> None:
    """The format conversations were rendered in, as the dataset tokenizer's chat template (data/instruct.py)."""
    from .instruct import plain_template
    path = out / "tokenizer_config.json"
    # A tokenizer without the file (byte, a bare tokenizer.json) gets what export writes for one, which it no
    # longer writes once the file is there: transformers would load it with no end-of-text token.
    settings = json.loads(path.read_text()) if path.is_file() else {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.tok.id_to_token(tok.eos_id),
        **({"bos_token": tok.bos_token} if tok.bos_token else {})}
    path.write_text(json.dumps({**settings, "chat_template": plain_template(tok)}, indent=1) + "\n")


MAX_PAD_TO = 1 << 24  # tokens of one --pad-to window (16.8M): beyond any model's context


def _write_instruct(inputs: list[Path], tok: Tokenizer, out: Path, shard_tokens: int, pad_to: int | None,
                    progress: bool, moved=None) -> dict:
    """Instruction examples (data/instruct.py): token shards and loss-mask shards of the same lengths; with
    `pad_to`, one window of pad_to + 1 tokens per example, never split across shards."""
    from .instruct import InstructError, examples, fit
    dtype = token_dtype(tok.vocab_size)
    if pad_to:
        shard_tokens = max(1, shard_tokens // (pad_to + 1)) * (pad_to + 1)
    tokens, masks = ShardWriter(out, dtype, shard_tokens), ShardWriter(out, np.dtype(np.uint8), shard_tokens, "mask")
    count = truncated = trained = inside = untrained = plain_chats = empty = 0
    first_empty = None
    try:
        with progress_bar(sum(p.stat().st_size for p in inputs), "tokenize", "B", progress, scale=True) as shown:
            bar = _Moving(shown, moved)
            for path in inputs:
                for ids, mask, nbytes, plain_chat, empty_at in examples(path, tok):
                    plain_chats += plain_chat
                    empty += empty_at is not None
                    first_empty = first_empty or empty_at
                    inside += bool((ids[:-1] == tok.eos_id).any())  # packing finds examples by this token
                    if pad_to:
                        ids, mask, cut = fit(ids, mask, pad_to + 1, tok.eos_id)
                        truncated += cut
                    tokens.write(ids)
                    masks.write(mask)
                    count += 1
                    trained += int(mask[1:].sum())  # an example's first token is no target
                    untrained += not mask[1:].any()  # an example's first token is no target, packed or not
                    bar.update(nbytes)
    except InstructError as e:
        for w in (tokens, masks):
            if w.file is not None:
                w.file.close()
        raise PrepareError(str(e)) from None
    shards, mask_shards = tokens.finish(), masks.finish()
    if not shards:
        raise PrepareError("the inputs hold no examples")
    if empty == count:  # only the closing end-of-text trained: a model that stops at once, learnt without a word
        raise PrepareError(f"every one of the {count:,} examples has an empty answer (completion, or the assistant's "
                           "content, is \"\" or blank), so training would only teach the model to stop at once: "
                           "fix the data (a conversion that filled the answer from another field?)")
    if untrained == count:
        raise PrepareError(f"no example of the {count:,} has a token to train on"
                           + (f" (prompts as long as --pad-to {pad_to})" if pad_to else "") + ": fix the data")
    index = {"format": "shardlm-tokens", "version": 1, "dtype": dtype.name, "vocab_size": tok.vocab_size,
             "eos_id": tok.eos_id, "tokenizer": "tokenizer.json", "tokenizer_fingerprint": fingerprint(tok),
             "documents": count, "examples": count, "untrained_examples": untrained,
             "empty_answers": empty, "first_empty_answer": first_empty,
             "total_tokens": sum(x["tokens"] for x in shards), "trained_tokens": trained, "shards": shards,
             "loss_mask": mask_shards, "pad_to": pad_to, "truncated": truncated, "eos_inside_examples": inside,
             "plain_chat_examples": plain_chats}
    tok.save(out)
    if plain_chats:
        _write_plain_template(out, tok)
    (out / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def _load_tokenizer(spec: str | Path) -> Tokenizer:
    """--tokenizer, where a name that is no local tokenizer is most often a Hub name as from_pretrained takes it
    (gpt2, meta-llama/Llama-3.1-8B): nothing is fetched, so the error says how to get the files."""
    path = Path(spec)
    if str(spec) == "byte" or (path / "tokenizer.json" if path.is_dir() else path).is_file():
        return load_tokenizer(spec)
    where = f"the directory holds no tokenizer.json{slow_tokenizer_hint(path)}" if path.is_dir() else \
        "no such file or directory"
    raise FileNotFoundError(f"--tokenizer {spec}: {where}; give 'byte', a tokenizer.json, or a directory holding "
                            "one (for a Hub model, download its tokenizer.json and tokenizer_config.json into a "
                            "directory and give that)")


def prepare(inputs: Iterable[str | Path], tokenizer: str | Tokenizer, out: str | Path, *,
            shard_tokens: int = 1 << 27, text_field: str | None = None, progress: bool = True,
            pad_to: int | None = None, moved=None) -> dict:
    """Tokenize `inputs` into `out`/shard_*.bin + index.json + tokenizer.json; returns the index.

    `text_field` (default "text") names the jsonl field or parquet column of plain-text inputs; given where no
    input has one, it is refused. `out` is replaced only by a complete dataset: after any error it holds what it
    held before. `moved()`, where given, is called as the bytes are read: long work's sign of progress to the
    ranks waiting for it (runtime/first_rank.py).
    """
    shard_tokens = check_shard_tokens(shard_tokens, "shard_tokens")
    out = Path(out)
    final = None
    try:
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else _load_tokenizer(tokenizer)
        inputs = [Path(q) for p in inputs for q in expanded(str(p))]
        for p in inputs:
            if p.is_dir():
                raise PrepareError(f"input {p} is a directory, not a file: give its files ({p / '*'})")
            if not p.is_file():  # a shell leaves a pattern that matched nothing as it was written
                if p.exists():  # the shell's <(...): read once, and of no size to stream or check for repeats
                    raise PrepareError(f"input {p} is not a regular file (a pipe, as the shell's <(...) gives, or a "
                                       "device): write it to a file and give that")
                hint = " (a pattern that matched no file)" if any(c in str(p) for c in "*?[") else ""
                raise FileNotFoundError(f"input {p} does not exist{hint}")
            try:  # before any work: the tokenizing bar and then errno's "[Errno 13] Permission denied: 'x'" came first
                open(p, "rb").close()
            except OSError as e:
                raise PrepareError(f"input {p} cannot be read: {e.strerror or e}") from None
        refuse_repeats(inputs)
        from .instruct import is_instruct
        instruct = [is_instruct(p, text_field or "text") for p in inputs]
        if any(instruct) and not all(instruct):
            plain = [f"{p}{' (empty)' if _blank(p) else ''}" for p, i in zip(inputs, instruct) if not i]
            raise PrepareError("instruction examples (prompt/completion or messages jsonl) and plain text cannot be "
                               "prepared into one dataset: instruction examples in "
                               + ", ".join(str(p) for p, i in zip(inputs, instruct) if i)
                               + "; plain text in " + ", ".join(plain))
        for p in inputs:
            check_input_type(p, text_field or "text")
        if pad_to is not None and not all(instruct):
            raise PrepareError("--pad-to applies to instruction examples (prompt/completion or messages jsonl)")
        if pad_to is not None and not 1 <= pad_to <= MAX_PAD_TO:
            # each example is written as a whole window: a typo's 10^11 ended in a MemoryError's traceback
            raise PrepareError(f"--pad-to {pad_to} must be the training's seq_len, a number of tokens from 1 to "
                               f"{MAX_PAD_TO:,}")
        if text_field is not None and all(i or p.suffix.lower() not in (".jsonl", ".parquet")
                                          for p, i in zip(inputs, instruct)):
            raise PrepareError(f"--text-field {text_field} has no effect on these inputs: it names the field of "
                               "plain-text .jsonl and the column of .parquet inputs; leave it out")
        final = _output_dir(out)
        with building(final) as scratch:
            if instruct and all(instruct):
                return _write_instruct(inputs, tok, scratch, shard_tokens, pad_to, progress, moved)
            return _write(inputs, tok, scratch, shard_tokens, text_field or "text", progress, moved)
    except (ValueError, OSError) as e:
        final = final or Path(os.path.realpath(out))
        if (final / INDEX).is_file():
            note = f"; {out} still holds its previous dataset"
        elif os.path.lexists(final):
            note = f"; {out} is unchanged"
        else:
            note = ""
        # A failed write names the scratch directory beside --out (or a parent of it), not what the user gave.
        what, written = str(e), getattr(e, "filename", None)
        if isinstance(e, OSError) and e.strerror and written is not None and \
                (Path(written) in (final, *final.parents) or str(written).startswith(str(final) + SCRATCH)
                 or str(written).startswith(str(final / SCRATCH))):  # built inside an empty --out
            what = f"--out {out} cannot be written: {e.strerror}"
        raise (FileNotFoundError if isinstance(e, FileNotFoundError) else PrepareError)(f"{what}{note}") from e
