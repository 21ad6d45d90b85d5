"""Strict reading of JSON Lines, shared by `data prepare` (text and instruction examples) and `eval`'s
prompt files: every non-blank line one JSON object, anything else stopped with the file and line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

BOM = "\ufeff"
JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def objects(path: Path, error: type[Exception], expected: str = "") -> Iterator[tuple[str, dict, int]]:
    """(where, object, bytes of its line) of every non-blank line of `path`, `where` being "file:line" for the
    caller's own checks. Bytes that are not UTF-8, a line that is not JSON, or JSON that is not an object
    raise `error` naming the line (`expected` says what the object should hold, for that message)."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 text (byte offset {offset + e.start})") from None
            if lineno == 1:  # a byte-order mark (Windows editors write one) failed json.loads: "Unexpected UTF-8 BOM"
                line = line.removeprefix(BOM)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            except RecursionError:  # no ValueError: it was a traceback
                raise error(f"{where}: JSON nested too deeply to read (thousands of levels)") from None
            if not isinstance(record, dict):
                raise error(f"{where}: {JSON_KINDS.get(type(record), 'a value')}, not an object{expected}")
            # Valid UTF-8 holds no lone surrogate, but a \ud800 escape makes one, which tokenizers reject with a
            # TypeError's traceback (generate --input, eval, instruction data): named here, with its field.
            if "\\u" in line and (found := unpaired_surrogate(record)):
                raise error(f"{where}: {found[0]!r} holds an unpaired surrogate ({found[1]!a}), not Unicode text")
            yield where, record, len(raw)


def unpaired_surrogate(value, path: str = "") -> tuple[str, str] | None:
    """(where in `value`, e.g. "messages[0].content", the character) of the first string, key or value,
    holding a lone UTF-16 surrogate, which UTF-8 cannot encode; None where there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path or "the value", e.object[e.start]
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        found = unpaired_surrogate(key, inner) if isinstance(key, str) else None
        if found := found or unpaired_surrogate(item, inner):
            return found
    return None
