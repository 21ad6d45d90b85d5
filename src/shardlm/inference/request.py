"""A generation request and the slot that holds it in the engine (engine.py)."""
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
