"""The answer side of the OpenAI-compatible API: completion and chat objects, their streamed chunks as
server-sent events ending with `data: [DONE]` (OpenAI's API reference), and the incremental detokenizer
that turns the engine's bursts of ids into text deltas (as vLLM's and transformers' text streamers do:
text is sent only once it can no longer change).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from .protocol import APIError, Params


class TextStream:
    """The text of a growing completion, in deltas whose concatenation is the whole answer's text.

    Ids are decoded one at a time, each in a window of ids (vLLM's prefix and read offsets): the ids that
    completed the previous character as context and those since, the new text being what they add, so a long
    stream costs no more per id than a short one, and the text of a completion does not depend on how its ids
    were batched (a whole answer is this text too). Held back until more ids arrive: a window whose text
    ends in a replacement character (a character whose UTF-8 bytes are still arriving) and a trailing piece
    that could begin a stop string (the text ends before a stop string, so that piece may never be part of
    the answer). `context`: the prompt's last id, the first window's context: SentencePiece-style decoders
    (Llama 2's, Mistral's) drop the space that opens a text, which opens the completion after the prompt."""

    def __init__(self, decode: Callable, stop_ids: tuple[int, ...], stop: tuple[str, ...], context=()):
        self.decode, self.stop_ids, self.stop = decode, stop_ids, stop
        self.ids: list[int] = list(context)
        self.prefix, self.read = 0, len(self.ids)  # ids[prefix:read]: decoded already, the window's context
        self.text = ""  # the text of ids[:read] after the context
        self.sent = ""

    def push(self, ids: list[int]) -> str:
        for t in ids:
            if t in self.stop_ids:  # a stop id only ever ends the stream, and is no part of the text
                continue
            self.ids.append(t)
            new = self._window()
            # One id at a time, whatever the bursts: a byte-fallback decoder (Llama 2's) turns a whole run of
            # byte ids whose UTF-8 is invalid into replacement characters, the valid bytes before included, so
            # text that a burst's window had sent was then no prefix of the whole answer's, and the stream sent
            # nothing more.
            if not new.endswith("\ufffd"):
                self.text += new
                self.prefix, self.read = self.read, len(self.ids)
        text = self._cut(self.text)
        # Only the text not yet sent can be held (what was sent ended before any stop string's start), so prefixes
        # up to its length are tried, not every prefix of a stop string: a client's 400 kB one held the event loop
        # for seconds, every other client waiting.
        unsent = len(text) - len(self.sent)
        hold = max((k for s in self.stop for k in range(1, min(len(s), unsent + 1)) if text.endswith(s[:k])),
                   default=0)
        return self._advance(text[:len(text) - hold])

    def finish(self) -> str:
        """The rest, an unfinished character as the tokenizer decodes it (replacement characters)."""
        return self._advance(self._cut(self.text + self._window()))

    def _window(self) -> str:
        context = self.decode(self.ids[self.prefix:self.read])
        return self.decode(self.ids[self.prefix:])[len(context):]

    def _cut(self, text: str) -> str:
        """`text` up to its first stop string; only what follows the text sent can hold one."""
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        return text[:min((at for at in (text.find(s, start) for s in self.stop) if at >= 0), default=len(text))]

    def _advance(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str | None) -> str:
    # "cancelled" never reaches a client: only a client that left cancels its request.
    return "stop" if reason == "stop" else "length"


class Answer:
    """The objects of one answer, completion or chat, sharing its id and creation time."""

    def __init__(self, chat: bool, params: Params):
        self.chat, self.params = chat, params
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.params.model}

    def whole(self, text: str, reason: str | None, completion_tokens: int) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish_reason(reason))
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(len(self.params.prompt), completion_tokens)}

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False) -> str:
        """One event; `text` None is the final chunk's empty delta, `role` the chat stream's first chunk."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(logprobs=None, finish_reason=None if reason is None else finish_reason(reason))
        return event({**self._head("chat.completion.chunk" if self.chat else "text_completion"),
                      "choices": [choice]})

    def usage_chunk(self, completion_tokens: int) -> str:
        """stream_options.include_usage: the last chunk before [DONE], no choices, the request's usage."""
        return event({**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                      "usage": usage(len(self.params.prompt), completion_tokens)})


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_event(error: APIError) -> str:
    """An error after the stream began (its status is sent already): an event holding the error object, as
    OpenAI's and vLLM's streams report one."""
    return event(error.body())


DONE = "data: [DONE]\n\n"

COUNTERS = ("requests_total", "requests_finished", "requests_cancelled", "requests_failed", "requests_rejected",
            "tokens_generated")


def prometheus(metrics: dict) -> str:
    """/metrics in Prometheus' text exposition format (0.0.4), each under the prefix shardlm_: the counts since
    start as counters (named *_total), the rest as gauges, a flag as 0 or 1."""
    lines = []
    for key, value in metrics.items():
        counter = key in COUNTERS
        name = f"shardlm_{key}" + ("_total" if counter and not key.endswith("_total") else "")
        lines += [f"# TYPE {name} {'counter' if counter else 'gauge'}",
                  f"{name} {value if isinstance(value, float) else int(value)}"]
    return "\n".join(lines) + "\n"
