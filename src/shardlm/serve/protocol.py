"""The request side of the OpenAI-compatible API: /v1/completions and /v1/chat/completions bodies checked
and turned into what the engine runs, and errors in OpenAI's shape ({"error": {"message", "type", "param",
"code"}}, following OpenAI's API reference). Parameters follow OpenAI's names, defaults and ranges; `top_k`
is an extension (as in vLLM: 0 or -1 is off). A parameter this server cannot honour with a value that would
change the answer is refused, never silently ignored.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from ..data.instruct import completion_stop_ids
from ..inference import SamplingParams, prompt_ids
from ..tokenizer import Tokenizer

_INT64 = 2 ** 63


class APIError(Exception):
    """An error answered as OpenAI answers it: HTTP `status` and the error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Params:
    """One request as the engine runs it."""
    model: str                 # the id it named, echoed in the answer
    adapter: str | None        # the LoRA adapter that id serves, None for the base
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    stop_ids: tuple[int, ...] = ()  # special tokens given as stop strings ("<|im_end|>"), which no text spells


class Models:
    """The served ids: the base model's, and each adapter's under its own name (vLLM's convention)."""

    def __init__(self, base: str, adapters: dict[str, str], max_len: int, tok: Tokenizer, chat=None,
                 model_vocab: int | None = None, adapter_toks: dict[str, Tokenizer] | None = None):
        from ..data.instruct import chat_prompter
        self.base, self.adapters, self.max_len, self.tok, self.chat = base, adapters, max_len, tok, chat
        # An adapter's own tokenizer where the base has no chat template (its export carries its run's): its
        # template renders that adapter's chats, and its end of turn and generation_config.json end its answers
        own = adapter_toks or {}
        self.adapter_chats = {n: chat_prompter(t) for n, t in own.items()}
        self._stops = {n: completion_stop_ids(t) for n, t in own.items()}
        # A token id beyond the embedding would fail the step (on a GPU, a device-side assert ends the
        # process), so prompts of ids are held to what both the tokenizer and the model know.
        self.vocab = min(tok.vocab_size, model_vocab or tok.vocab_size)
        self.stop_ids = completion_stop_ids(tok)
        # The most characters a token stands for (its longest vocabulary entry): a prompt that far beyond the
        # context is refused by its length, untokenized. Tokenizing 20 MB took 18 s on the event loop, every
        # other client waiting; 4x spares a normaliser that drops characters.
        self.max_chars = 4 * max_len * max(map(len, tok.tok.get_vocab(with_added_tokens=True)), default=1)
        # The most bytes a body can hold and still be served: that many characters at JSON's widest escape (12
        # bytes, a surrogate pair's for one character), and a megabyte for the rest. Bodies were read whole,
        # whatever their size, before any of this was checked.
        self.max_body = 12 * self.max_chars + (1 << 20)

    def stops_of(self, adapter: str | None) -> tuple[int, ...]:
        """The ids that end a completion of the base (None) or of an adapter."""
        return self._stops.get(adapter, self.stop_ids)

    def check_length(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_len} tokens. However, the {param} "
                                f"holds {len(text)} characters, far more than that many tokens. Please reduce the "
                                f"length of the {param}.", param, "context_length_exceeded")

    def adapter_of(self, body: dict) -> tuple[str, str | None]:
        model = body.get("model")
        if model is None:  # OpenAI requires it; a curl line without it means the one model served
            return self.base, None
        if not isinstance(model, str):
            raise _wrong_type("model", "a string")
        if model == self.base:
            return model, None
        if model in self.adapters:
            return model, model
        known = ", ".join([self.base, *sorted(self.adapters)])
        raise APIError(404, f"The model `{model}` does not exist (served: {known}).", "model", "model_not_found")


def _wrong_type(param: str, what: str) -> APIError:
    return APIError(400, f"'{param}' must be {what}.", param, "invalid_type")


def _number(body: dict, param: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(param)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _wrong_type(param, "a number")
    if value < low or value > high or (low_open and value == low):
        side = "(" if low_open else "["
        raise APIError(400, f"'{param}' is {value}, it must lie in {side}{low:g}, {high:g}].", param,
                       "invalid_value")
    return float(value)


def _integer(body: dict, param: str, default, low: int, high: int = _INT64 - 1):
    value = body.get(param)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():  # 16.0 from a client that writes every number so
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type(param, "an integer")
    if not low <= value <= high:
        raise APIError(400, f"'{param}' is {value}, it must lie in [{low}, {high}].", param, "invalid_value")
    return value


def _flag(body: dict, param: str) -> bool:
    value = body.get(param, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _wrong_type(param, "a boolean")
    return value


# Parameters accepted only at the value that leaves the answer as this server gives it. A completion's logprobs 0
# is no such value: it asks for the chosen tokens' log probabilities (OpenAI's API, vLLM), which would come back null.
_NEUTRAL = {"presence_penalty": (0, None), "frequency_penalty": (0, None), "logit_bias": ({}, None),
            "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False, None), "best_of": (1, None),
            "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "response_format": (None,),
            # a forced tool call, or audio, asked for an answer of another kind than this server's text
            "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"),
            "parallel_tool_calls": (None, True, False), "modalities": (None, ["text"]), "audio": (None,),
            # vLLM's sampling extensions, which clients written for it send: ignored, the answer would change unsaid
            "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "length_penalty": (None, 1, 1.0),
            "min_tokens": (None, 0), "ignore_eos": (None, False), "stop_token_ids": (None, []),
            "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
            "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
            "structured_outputs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
            "logits_processors": (None, []), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
            "return_tokens_as_token_ids": (None, False),
            # and its chat extensions, which change the rendered prompt
            "chat_template": (None,), "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
            "continue_final_message": (None, False)}
# What this server reads; any other key is let through unread (as vLLM does: clients add their own), unless it is
# a near miss of one of these ("temprature", "max_new_tokens"): ignored, it would sample at the default unsaid.
_READ = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
         "n", "stop", "stream", "stream_options")
_FOREIGN = ("models",)  # OpenRouter's fallback models, which its clients send: near "model", changes no answer


def _same(value, neutral) -> bool:
    """Whether `value` is the neutral value: 0.0 is 0 (Python's json writes a float penalty so), but a
    boolean is no number (True == 1)."""
    numbers = (int, float)
    if (isinstance(value, numbers) and isinstance(neutral, numbers)
            and not isinstance(value, bool) and not isinstance(neutral, bool)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


NEAR_MISSES = 64  # unknown parameters checked for a misspelling: 70,000 of them took 2.5 s of the event loop


def _refuse_unsupported(body: dict) -> None:
    import difflib
    unknown = (p for p in body if p not in _READ + _FOREIGN and p not in _NEUTRAL)
    for _, param in zip(range(NEAR_MISSES), unknown):
        if near := difflib.get_close_matches(param, _READ, 1, 0.8):
            raise APIError(400, f"'{param}' is not a parameter of this API (it would be ignored): did you mean "
                                f"'{near[0]}'?", param, "unknown_parameter")
    for param, neutral in _NEUTRAL.items():
        if param in body and not any(_same(body[param], v) for v in neutral):
            if param == "response_format" and body[param] == {"type": "text"}:
                continue
            raise APIError(400, f"'{param}' = {body[param]!r} is not supported by this server.", param,
                           "unsupported_parameter")


def _common(body, models: Models, prompt: list[int], default_max_tokens: int | None, prompt_param: str) -> Params:
    model, adapter = models.adapter_of(body)
    _refuse_unsupported(body)
    n = _integer(body, "n", 1, 1, 128)
    if n != 1:
        raise APIError(400, f"'n' is {n}: this server returns one choice per request (n = 1).", "n",
                       "invalid_value")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", 0, -1, 1 << 31)
    seed = _integer(body, "seed", None, -_INT64, _INT64 - 1)
    if seed is None:  # OpenAI's sampling differs call to call unless a seed is given
        seed = secrets.randbits(62)
    room = models.max_len - len(prompt)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, default_max_tokens, 0)
    if max_tokens is None:
        # The rest of the context: where none is left, the answer would be empty, 200, as if the model had
        # nothing to say.
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {models.max_len} tokens. However, the "
                                f"{prompt_param} hold {len(prompt)} tokens, leaving none for the completion. Please "
                                f"reduce the length of the {prompt_param}.", prompt_param, "context_length_exceeded")
        max_tokens = room
    if len(prompt) + max_tokens > models.max_len:
        # a completion's max_tokens left out is 16 (OpenAI's default): a client that never sent one is told so
        default = "" if body.get(key) is not None else f", '{key}' default"
        raise APIError(400, f"This model's maximum context length is {models.max_len} tokens. However, you "
                            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the {prompt_param}, "
                            f"{max_tokens} in the completion{default}). Please reduce the length of the "
                            f"{prompt_param} or the completion.", key if room > 0 else prompt_param,
                       "context_length_exceeded")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise _wrong_type("stop", "a non-empty string or a list of them")
    if len(stop) > MAX_STOP:  # each is looked for after every token: 75,000 slowed the whole batch
        raise APIError(400, f"'stop' holds {len(stop)} sequences; up to {MAX_STOP} are allowed.", "stop",
                       "invalid_value")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise APIError(400, "'stream_options' is an object, allowed only with stream = true.", "stream_options")
    # a flag's type is checked: "no" is truthy, and would send the usage chunk it declines
    include_usage = (options or {}).get("include_usage")
    include_usage = False if include_usage is None else include_usage
    if not isinstance(include_usage, bool):
        raise _wrong_type("stream_options.include_usage", "a boolean")
    for key, value in (options or {}).items():  # vLLM's continuous_usage_stats: true was answered without them
        if key != "include_usage" and value not in (None, False):
            raise APIError(400, f"'stream_options.{key}' is not supported: this server reads include_usage only.",
                           f"stream_options.{key}", "unsupported_parameter")
    strings, stop_ids = models.tok.split_stops(stop)
    return Params(model, adapter, prompt, max_tokens, SamplingParams(temperature, max(top_k, 0), top_p, seed),
                  strings, stream, include_usage, stop_ids)


def completion_params(body, models: Models) -> Params:
    """/v1/completions: `prompt` is a string, a list of token ids, or a list of one of either."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    models.adapter_of(body)  # an unknown model is a 404, whatever else is wrong with the request
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        models.check_length(prompt, "prompt")
        try:
            ids = prompt_ids(models.tok, prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = models.vocab
        if not all(0 <= t < vocab for t in prompt):
            raise APIError(400, f"'prompt' holds token ids outside the vocabulary [0, {vocab}).", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, "'prompt' holds several prompts: this server takes one per request.", "prompt")
    else:
        raise _wrong_type("prompt", "a string, a list of token ids, or a list of one of either")
    return _common(body, models, ids, 16, "prompt")


ROLES = ("system", "developer", "user", "assistant")
MAX_STOP = 4  # OpenAI's limit
# What a message holds that the chat template is given; OpenAI's other keys are refused where they carry something
# (a tool call rendered as an empty turn), and let be where empty (the SDK echoes an answer's "refusal": null).
MESSAGE_KEYS = ("role", "content", "name")


def _content(m: dict, i: int) -> str:
    """A message's text: a string, or OpenAI's list of content parts, all of type text, one a line (as vLLM and
    TensorRT-LLM join them: ["To be", "or not"] read as the one word "To beor not")."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts.",
                   f"messages[{i}].content", "invalid_type")


def chat_params(body, models: Models) -> Params:
    """/v1/chat/completions: `messages` rendered by the tokenizer's chat template, as training renders them."""
    import jinja2

    from ..data.instruct import InstructError
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    _, adapter = models.adapter_of(body)  # an unknown model is a 404, whatever else is wrong with the request
    chat = models.adapter_chats.get(adapter, models.chat)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _wrong_type("messages", "a non-empty list of {role, content} objects")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}.",
                           f"messages[{i}].role", "invalid_value")
        # OpenAI's newer name for the system turn, which its clients send: chat templates know only "system"
        role = "system" if m["role"] == "developer" else m["role"]
        for key, value in m.items():
            if key not in MESSAGE_KEYS and value not in (None, [], {}, ""):
                raise APIError(400, f"messages[{i}].{key} is not supported: this server renders a message's role, "
                                    "content and name only (no tool calls).", f"messages[{i}].{key}",
                               "unsupported_parameter")
        if not isinstance(m.get("name", ""), str):
            raise _wrong_type(f"messages[{i}].name", "a string")
        turns.append({"role": role, "content": _content(m, i), **({"name": m["name"]} if m.get("name") else {})})
    models.check_length("".join(t["content"] for t in turns), "messages")
    if chat is None:
        raise APIError(400, "The served model's tokenizer has no chat template (chat_template.jinja or "
                            "tokenizer_config.json's chat_template), so it cannot render messages: use "
                            "/v1/completions with a prompt.",
                       "messages", "no_chat_template")
    try:
        text = chat(turns)
    except (InstructError, jinja2.TemplateError) as e:
        raise APIError(400, f"The model's chat template refuses these messages: {e}", "messages") from None
    models.check_length(text, "messages")  # the contents were short, but the template adds to each message
    return _common(body, models, prompt_ids(models.tok, text, opened=True), None, "messages")
