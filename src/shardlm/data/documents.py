"""The documents `shardlm data prepare` reads: a text file (one document, streamed in pieces of about a
megabyte cut at a word's end, so that memory stays bounded and the pieces give the whole text's tokens), each
line of a jsonl file and each row of a parquet file (their text field). Read strictly: bytes that are not UTF-8
text, a line that is not a JSON object with a string field, a column missing or not strings stop the run with an
error naming the file (and line). The inputs themselves: a quoted pattern matched here as a shell would, one file
given twice refused."""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Iterator

from .jsonl import BOM, JSON_KINDS, objects


class PrepareError(ValueError):
    """An input that cannot be read as text of its kind, a bad size, or an output that cannot be replaced."""


TEXT_SUFFIXES = (".txt", ".text", ".md", ".py", "")  # read as one document each
READ_TYPES = ".txt, .text, .md, .py or no suffix (a document each), .jsonl, .parquet (a document a line or row)"


def expanded(pattern: str) -> list[str]:
    """A pattern no shell expanded (quoted, or from a script that runs no shell) as the files it matches, sorted;
    it was refused as "a pattern that matched no file" while it matched some."""
    if os.path.lexists(pattern) or not any(c in pattern for c in "*?["):
        return [pattern]
    return sorted(glob.glob(pattern, recursive=True)) or [pattern]


def refuse_repeats(inputs: list[Path]) -> None:
    """One file given twice (a shell glob beside its name, a path and a link to it) would be trained on twice."""
    seen = {}
    for p in inputs:
        st = p.stat()
        first = seen.setdefault((st.st_dev, st.st_ino), p)
        if first is not p:
            same = "" if str(first) == str(p) else f" (the same file as {first})"
            raise PrepareError(f"--input {p} is given twice{same}: its text would be in the dataset twice; give each "
                               "file once")


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


def _word_before(data: bytes, i: int) -> bool:
    """Whether the character that ends at byte `i` (a character boundary) is not whitespace, Unicode's (a
    no-break space too, as tokenizers' word splits take it)."""
    last = data[max(0, i - 4):i].decode("utf-8", "ignore")[-1:]
    return bool(last) and not last.isspace()


def _cut(data: bytes, at_least: int, long_line: int) -> int:
    """Where a piece of `data` ends, 0 for not yet: just before the first line end that follows a word, from
    `at_least` bytes on; once `long_line` bytes hold none, before the last whitespace that follows a word, else
    at a character boundary, so memory stays bounded on files without either. Tokenizers split words at
    whitespace, and a run of whitespace (an indented line's newline and spaces) stays whole in the next piece,
    so the pieces, encoded each after the character before it (prepare.py), give the text's own tokens."""
    if len(data) < at_least:
        return 0
    for found in _LINE_END.finditer(data, at_least - 1):
        if _word_before(data, found.start()):
            return found.start()
    if len(data) < long_line:
        return 0
    cut = max(data.rfind(c) for c in b" \t\n\r\f\v")
    while cut > 0 and not _word_before(data, cut):  # back to the start of that whitespace run
        cut -= 1
        while cut > 0 and data[cut] & 0xC0 == 0x80:  # to its character's first byte
            cut -= 1
    if cut > 0:
        return cut
    cut = len(data) - 1
    while cut > len(data) - 4 and data[cut] & 0xC0 == 0x80:  # back over UTF-8 continuation bytes
        cut -= 1
    return cut


def _text_pieces(path: Path, chunk: int) -> Iterator[tuple[str, int]]:
    """A text file as (text, bytes) pieces of at least `chunk` bytes (but the last)."""
    offset, line, data = 0, 1, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            data += block
            cut = _cut(data, chunk, 4 * chunk) if block else len(data)
            if cut:
                piece, data = data[:cut], data[cut:]
                text = _decode(path, piece, offset, line)
                yield text.removeprefix(BOM) if offset == 0 else text, len(piece)  # no document opens with a BOM
                offset, line = offset + len(piece), line + piece.count(b"\n")
            if not block:
                return


def _jsonl_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    for where, record, nbytes in objects(path, PrepareError, f" with a {text_field!r} field"):
        if text_field not in record:
            keys = ", ".join(map(repr, list(record)[:8])) or "none"
            # Alpaca's instruction/output or ShareGPT's conversations read as plain text: say what instruction
            # data looks like, since nothing else would.
            raise PrepareError(f"{where}: no {text_field!r} field (fields: {keys}); name the text's field with "
                               "--text-field, or, for instruction data, write each line as {\"prompt\", "
                               "\"completion\"} or {\"messages\": [{\"role\", \"content\"}, ...]}")
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


def pyarrow_modules(path: Path):
    """pyarrow and pyarrow.parquet, to read the parquet input `path`; refused naming the extra where they are not
    installed (an ImportError was a traceback, after the inputs before it had been tokenized), or naming it broken
    where it is installed but fails to import."""
    from ..extras import import_optional
    missing = f"{path}: reading .parquet needs pyarrow: pip install 'shardlm[parquet]'"
    return tuple(import_optional(m, "pyarrow", f"{path}: reading .parquet", missing, PrepareError)
                 for m in ("pyarrow", "pyarrow.parquet"))


def check_input_type(path: Path, text_field: str) -> None:
    """Before any input is tokenized: a suffix that is read, and a parquet file's text column (its schema only),
    refused naming the file (found when its turn came, they ended hours of tokenizing the inputs before)."""
    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES + (".jsonl", ".parquet"):
        raise PrepareError(f"{path}: unsupported input type {suffix!r} ({READ_TYPES})")
    if suffix == ".parquet":
        _parquet_text(path, text_field)


def _parquet_text(path: Path, text_field: str):
    """(pyarrow, the opened ParquetFile) of a parquet input whose column `text_field` holds strings."""
    pa, pq = pyarrow_modules(path)
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
    return pa, pf


def _parquet_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    pa, pf = _parquet_text(path, text_field)
    per_row = path.stat().st_size // max(1, pf.metadata.num_rows)
    row = 0
    try:
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            column = batch.column(0)
            if column.null_count:  # as a jsonl line's null is: dropping it would change the data unseen
                at = row + column.is_null().to_pylist().index(True) + 1
                raise PrepareError(f"{path}: row {at}: {text_field!r} is null, not a string (drop or fill the "
                                   "null rows)")
            for text in column.to_pylist():
                yield text, per_row
            row += len(column)
    except pa.ArrowException as e:
        raise PrepareError(f"{path}: unreadable parquet data ({e})") from None


def iter_pieces(path: Path, text_field: str, chunk: int) -> Iterator[tuple[str, bool, int]]:
    """Yield (text, ends_a_document, input bytes consumed) for .txt, .jsonl and .parquet inputs.

    A text file is one document, streamed in pieces; every jsonl line or parquet row is a document.
    """
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        pieces = _text_pieces(path, chunk)
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
        raise PrepareError(f"{path}: unsupported input type {suffix!r} ({READ_TYPES})")
