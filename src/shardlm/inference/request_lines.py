"""`generate --input`'s file: one JSON object a line, a prompt and the settings that override the flags for it
(max_new_tokens, sampling, seed, stop strings), each line checked and named by its number before a model loads;
and the checks of what generate and eval read and write around it (prompts' token ids, --output)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

from ..config import ConfigError
from ..config.input_files import input_file

INT64 = 1 << 63  # seeds and top_k as the engine holds them (int64)


# The keys of a --input line; eval's files (prompt and completion or reference) are taken as they are.
LINE_KEYS = ("prompt", "messages", "id", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop")
UNUSED_KEYS = ("completion", "reference")
# OpenAI's names, which a line written for the server would carry.
KEY_NAMED_HERE = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


def _unknown_keys(where: str, obj: dict) -> None:
    unknown = [k for k in obj if k not in LINE_KEYS and k not in UNUSED_KEYS]
    if not unknown:
        return
    hints = [f"the key here is {KEY_NAMED_HERE[k]}" for k in unknown if k in KEY_NAMED_HERE]
    raise ConfigError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                      f"{f' ({hints[0]})' if hints else ''}; a line holds {', '.join(LINE_KEYS)}")


def _line_integer(where: str, obj: dict, key: str, default: int, low: int = 0) -> int:
    """obj[key] (default where absent or null) as an int: a float only where it is integral (3.0, from a
    writer that makes every number a float), never a boolean or a string; within int64, as the engine holds it."""
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {key} = {json.dumps(value)} must be an integer")
    if value < low:
        raise ConfigError(f"{where}: {key} = {value} must not be negative")
    if not -INT64 <= value < INT64:
        raise ConfigError(f"{where}: {key} = {value} does not fit in 64 bits")
    return value


def _line_number(where: str, obj: dict, key: str, default: float) -> float:
    value = obj.get(key)
    if value is None:
        return default
    try:  # an integer of 400 digits overflows a float: math.isfinite raised OverflowError
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise ConfigError(f"{where}: {key} = {json.dumps(value)} must be a number within a double's range")
    return float(value)


def read_requests(path: Path, a) -> list[dict]:
    """The lines of a --input file, checked before the model loads: each a dict of prompt and settings."""
    from ..data.jsonl import JSON_KINDS, objects
    from .sampler import MAX_TEMPERATURE, SamplingParams
    input_file(path, "--input")
    rows = []
    for where, obj, _ in objects(path, ConfigError, " with a prompt"):
        turns = obj.get("messages") if "prompt" not in obj else None
        if turns is not None:  # a chat, as training reads it: its last turn, an assistant's answer, is not asked
            turns = turns[:-1] if isinstance(turns, list) and turns and isinstance(turns[-1], dict) and \
                turns[-1].get("role") == "assistant" else turns
            if not (isinstance(turns, list) and turns and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                              and isinstance(m.get("content"), str) for m in turns)):
                raise ConfigError(f"{where}: messages must be a list of {{role, content: string}} turns, one at "
                                  "least before any final assistant answer")
        elif "prompt" not in obj:
            raise ConfigError(f"{where}: needs a string field prompt (or messages), has "
                              f"{', '.join(sorted(obj)) or 'none'}")
        elif not isinstance(obj["prompt"], str):
            kind = JSON_KINDS.get(type(obj["prompt"]), "a value")
            raise ConfigError(f"{where}: prompt must be a string, not {kind}")
        _unknown_keys(where, obj)
        stop = obj.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"{where}: stop must be a non-empty string or a list of them")
        max_new = _line_integer(where, obj, "max_new_tokens", a.max_new_tokens)
        temperature = _line_number(where, obj, "temperature", a.temperature)
        top_p = _line_number(where, obj, "top_p", a.top_p)
        # Each named alone: SamplingParams' own message lists every setting, the valid ones too.
        if temperature < 0:
            raise ConfigError(f"{where}: temperature = {temperature:g} must not be negative (0 is greedy)")
        if temperature > MAX_TEMPERATURE:  # the engine holds it in float32
            raise ConfigError(f"{where}: temperature = {temperature:g} exceeds {MAX_TEMPERATURE:.4g}, float32's largest")
        if not 0 < top_p <= 1:
            raise ConfigError(f"{where}: top_p = {top_p:g} must be in (0, 1] (1: no nucleus cut)")
        top_k = _line_integer(where, obj, "top_k", a.top_k)
        if temperature == 0:  # greedy: a line's own top_k/top_p would be ignored without a word
            for key, default in (("top_k", 0), ("top_p", 1.0)):
                if obj.get(key) is not None and obj[key] != default:
                    raise ConfigError(f"{where}: {key} = {json.dumps(obj[key])} has no effect at temperature 0 "
                                      "(the line's or --temperature's), which decodes greedily: give the line a "
                                      "temperature above 0 to sample, or leave it out")
        if obj.get("seed") is None and a.seed + len(rows) >= INT64:  # line i's seed is --seed + i
            raise ConfigError(f"{where}: its seed, --seed {a.seed} + {len(rows)}, does not fit in 64 bits: give a "
                              "lower --seed, or the line a seed")
        sampling = SamplingParams(temperature, top_k, top_p,
                                  _line_integer(where, obj, "seed", a.seed + len(rows), low=-INT64))
        # where a prompt too long for the model is named: the line, and the line's key or the flag it took
        source = "max_new_tokens" if obj.get("max_new_tokens") is not None else "--max-new-tokens"
        rows.append({"prompt": obj.get("prompt") if turns is None else None, "messages": turns,
                     "id": obj.get("id"), "sampling": sampling, "max_new": max_new,
                     "stop": tuple(stop), "where": where, "max_new_from": source})
    if not rows:
        raise ConfigError(f"--input {path}: no prompts (expected one JSON object per line)")
    return rows


def check_vocab(ids: list[int], vocab: int, where: str) -> None:
    """Token ids the model has no embedding for (a tokenizer not the model's: a larger vocabulary) refused naming
    where they came from; the embedding raised IndexError (a device-side assert on a GPU) mid-forward."""
    top = max(ids, default=-1)
    if top >= vocab:
        raise ConfigError(f"{where}: token id {top} is beyond the model's vocabulary of {vocab}: the tokenizer "
                          "is not the model's (its vocabulary is larger); give --model a directory with the "
                          "tokenizer it was trained with")


def check_room(prompt: list[int], new: int, new_from: str, limit: int, where: str) -> None:
    """Refuse a prompt whose `new` tokens (`new_from`: the flag or key that asked for them) would run past the
    model's `limit` positions, saying what to lower."""
    room = limit - len(prompt)
    if new > room:
        fix = (f"lower {new_from} to {room} at most, or shorten the prompt" if room > 0 else
               f"shorten the prompt to fewer than {limit} tokens, leaving room for the new ones")
        n = len(prompt)
        raise ConfigError(f"{where}: a prompt of {n} token{'s' if n != 1 else ''} + {new_from} {new} exceeds the "
                          f"model's max_seq_len {limit}: {fix}")


def written_in_place(out: Path) -> bool:
    """A device, a pipe or a descriptor (/dev/null, a fifo, /dev/stdout, /dev/fd/N): written where it is and appended
    to, never replaced by a file. /dev/stdout redirected to a file (`> log`) resolves to that regular file."""
    return (out.exists() and not out.is_file()) or str(out.absolute()).startswith(
        ("/dev/stdout", "/dev/stderr", "/dev/fd/", "/proc/"))


def check_output(out: Path, src: Path, overwrite: bool) -> None:
    """--output before anything runs: a file to be (re)written, in a directory that exists, and not --input."""
    if out.is_dir():
        raise ConfigError(f"--output {out} is a directory: name a file (in it or elsewhere)")
    if out.exists() and out.samefile(src):
        raise ConfigError(f"--output {out} is the --input file: the completions would replace the prompts; name "
                          "another file")
    if written_in_place(out):
        if out.exists() and not os.access(out, os.W_OK):
            raise ConfigError(f"--output {out} cannot be written: permission denied")
        return
    real = Path(os.path.realpath(out))  # through a link, the file it names is the one replaced
    parent = real.parent
    if not parent.is_dir():
        raise ConfigError(f"--output {out}: its directory {parent} "
                          f"{'is not a directory' if parent.exists() else 'does not exist'}")
    if out.exists() and out.stat().st_size and not overwrite:
        raise ConfigError(f"--output {out} exists: pass --overwrite to replace it, or name another file")
    # A read-only directory or file fails here, not when the first completion is written, after the model has
    # loaded and the prompts have been decoding. Probed with a file of its own beside `out`, never `out`
    # itself: every rank of `--tp` checks at once, and one rank's probe must not be another's `out`.
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{real.name}.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--output {out} cannot be written: {e.strerror or e}") from None
    if out.exists() and not os.access(out, os.W_OK):
        raise ConfigError(f"--output {out} cannot be written: permission denied")


def check_same_read(read, source: str) -> None:
    """Refuse tensor-parallel ranks that read other contents from `source` (a node's own copy of the file at the
    same path, another version of it): each decoded its own prompts, its slices summed with the others' over
    other tokens, and rank 0 wrote wrong completions without a word (or gloo aborted where the lengths
    differed). The arguments are compared at the rendezvous; what they name, here, once read (as train
    compares its data's index)."""
    from ..mesh import every_rank
    # eval's text hashed as it is: as JSON, escaped, a large file's copy would take up to 6x its size
    data = read if isinstance(read, str) else json.dumps(read, sort_keys=True, default=repr)
    every = every_rank(hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest())
    other = next((rank for rank, theirs in enumerate(every) if theirs != every[0]), None)
    if other is not None:
        raise ConfigError(f"rank {other} read other contents than rank 0 from {source}: every rank must read the same "
                          "file (a node's own copy of it differs?)")
