"""A generation request, the slot that holds it in the engine (engine.py), and how its new tokens end it: stop
tokens, stop strings in the decoded text, its budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .sampler import SamplingParams


@dataclass
class Request:
    """A prompt (token ids) and how to continue it; the engine fills `tokens` (the new ids, stop token or
    string included), `text` (with `decode`: the completion, cut before a stop string) and `finish_reason`
    ("stop": a stop token or string; "length": max_new_tokens reached)."""
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    tag: object = None
    adapter: str | None = None  # the name of one of the engine's LoRA adapters, applied to this request alone
    on_tokens: Callable | None = None  # called with (request, new ids) as they arrive (on the engine's thread)
    # Whether the new text continues the prompt's (decoded after its last id, the space opening it kept by
    # SentencePiece-style decoders), or opens a text of its own (a chat reply: a message, without it).
    continues: bool = True
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    cancelled: bool = False  # set by cancel(): the engine drops the request at its next step

    def cancel(self) -> None:
        """Stop this request (from any thread): it leaves its slot at the engine's next step, finish_reason
        "cancelled"; tokens it has stay."""
        self.cancelled = True

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion(self) -> list[int]:
        """The new tokens without the stop token that ended them."""
        if self.finish_reason == "stop" and self.tokens and self.tokens[-1] in self.stop_ids:
            return self.tokens[:-1]
        return self.tokens


@dataclass
class Slot:
    request: Request
    prefilled: int = 0  # prompt tokens in the cache so far

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.request.prompt)


# The most byte-level ids one character takes (UTF-8's longest).
CHARACTER_IDS = 4


def accept(r: Request, new: list[int], decode: Callable | None) -> bool:
    """Append `new` to r's tokens up to a stop or its budget; whether r has finished. `decode`: the tokenizer's
    ids -> text, for stop strings and r.text (None: neither)."""
    taken = []
    for token in new:
        taken.append(token)
        r.tokens.append(token)
        if token in r.stop_ids or _stopped_by_string(r, decode):
            r.finish_reason = "stop"
            break
        if len(r.tokens) == r.max_new_tokens:
            r.finish_reason = "length"
            break
    if r.on_tokens is not None and taken:
        r.on_tokens(r, taken)
    if r.done and decode is not None and r.text is None:
        r.text = new_text(r, r.completion, decode)
    return r.done


def new_text(r: Request, ids: list[int], decode: Callable) -> str:
    """The text of r's new `ids`, decoded after the prompt's last token: SentencePiece-style decoders (Llama
    2's, Mistral's) drop the space that opens a text, and the completion's first word ran into the prompt's
    last (a stop string opening with that space went unseen). A prompt of one token opens a document (the
    beginning-of-sequence token of an empty prompt), and a request that does not `continue` its prompt a text
    of its own (a chat reply), whose first word has no space before it."""
    before = prompt_context(r.prompt, decode) if len(r.prompt) > 1 and r.continues else []
    head = decode(before)
    text = decode(before + list(ids))
    return text[len(head):] if text.startswith(head) else decode(ids)


def clean_suffix(ids: list[int], decode: Callable, least: int) -> list[int] | None:
    """The shortest suffix of `ids`, of at least `least` ids and at most CHARACTER_IDS more, that starts on a
    character: its text does not open with a replacement character. A byte-fallback decoder (Llama 2's,
    Mistral's) turns a whole run of byte ids that starts inside a character into replacement characters, the
    valid bytes after it included. None: no such suffix (invalid bytes)."""
    for k in range(least, min(len(ids), least + CHARACTER_IDS) + 1):
        if not decode(ids[-k:]).startswith("\ufffd"):
            return ids[-k:]
    return None


def prompt_context(prompt: list[int], decode: Callable) -> list[int]:
    """The prompt's last ids that a completion's text is decoded after: its last character's (one id, or the
    bytes of one), so that a prompt ending in an emoji does not turn the completion's bytes into U+FFFD."""
    return clean_suffix(prompt, decode, 1) or prompt[-1:]


def _stopped_by_string(r: Request, decode: Callable | None) -> bool:
    """Whether the newest token completed one of r's stop strings. Only the tokens that can hold one are
    decoded (a character takes at most 4 byte-level tokens), not the whole completion each token."""
    if not r.stop or decode is None:
        return False
    n = CHARACTER_IDS * max(map(len, r.stop)) + 1
    # A character whose bytes are still arriving decodes as U+FFFD, which is no text of the answer yet (a stop
    # string holding one matched the first byte of an 'é'); and the tail may start inside a character.
    window = clean_suffix(r.tokens, decode, n) if len(r.tokens) > n else None
    tail = (decode(window) if window is not None else new_text(r, r.tokens, decode)).rstrip("\ufffd")
    if not any(s in tail for s in r.stop):
        return False
    text = new_text(r, r.tokens, decode).rstrip("\ufffd")
    found = [at for at in (text.find(s) for s in r.stop) if at >= 0]
    if not found:
        return False
    r.text = text[:min(found)]
    return True
