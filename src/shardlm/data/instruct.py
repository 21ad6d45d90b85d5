"""Instruction data for supervised fine-tuning (`shardlm data prepare` of prompt/completion or chat jsonl):
token shards as for pretraining, plus a loss mask beside them (1 where the token is trained on: the
completion, the assistant's turns and the end-of-text token that closes them; 0 for the prompt), so only
the answers are learned, as in InstructGPT's and Alpaca's supervised fine-tuning.

Each line is {"prompt", "completion"} or {"messages": [{"role", "content"}, ...]}. Chat turns are rendered
with the tokenizer's chat template (chat_template.jinja, else tokenizer_config.json's `chat_template`, through
jinja2 as transformers renders it) when it has one, else as "<|role|>\\ncontent\\n" lines; a turn's tokens are
what rendering the conversation up to it adds to the rendering before it, masked by whether the assistant said
them.

With `pad_to` (the training's seq_len) every example is one window: cut at pad_to tokens, or padded to it
with end-of-text tokens that are not trained on, so no example attends to another (no packing). Without
it, examples follow each other in the stream (packed), and a window may hold the end of one example and
the start of the next.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from ..tokenizer import Tokenizer
from .jsonl import BOM, JSON_KINDS, objects

ROLES = ("system", "user", "assistant")


class InstructError(ValueError):
    """A line that is no instruction example."""


def is_instruct(path: Path, text_field: str = "text") -> bool:
    """A jsonl file whose first record is an instruction example (prompt/completion, or messages). A record with
    a prompt but no completion is one (missing its answer, which the error names) unless it holds the text field
    (`text_field`, --text-field's): prompts to pretrain on are plain text, once refused both ways."""
    if path.suffix.lower() != ".jsonl":
        return False
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    record = json.loads(raw.removeprefix(BOM.encode()))
                except (ValueError, RecursionError):  # read again, and named, as plain text
                    return False
                return isinstance(record, dict) and ("messages" in record or ("prompt" in record and
                                                  ("completion" in record or text_field not in record)))
    return False


def _chat_template(tok: Tokenizer):
    source = getattr(tok, "source", None)
    if not source:
        return None
    # transformers >= 4.47 saves the template as chat_template.jinja, which wins over tokenizer_config.json's
    # chat_template when both are there, as in transformers' from_pretrained.
    file, cfg = Path(source) / "chat_template.jinja", Path(source) / "tokenizer_config.json"
    where = file if file.is_file() else cfg
    template = file.read_text(encoding="utf-8") if file.is_file() else \
        json.loads(cfg.read_text()).get("chat_template") if cfg.is_file() else None
    if isinstance(template, list):  # transformers' named templates: it renders with the one named "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        template)
    if template is None:
        return None
    if not isinstance(template, str):  # once taken for no template: data prepare then used the fallback format
        raise InstructError(f"{where}: chat_template is not a template's text (or a list of named ones with a "
                            "'default'): fix it, or remove it")
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # as transformers renders templates

    def raise_exception(message):  # the helper transformers gives templates, for their own checks
        raise InstructError(message)
    # transformers' environment has {% break %} / {% continue %} and the {% generation %} block (which marks the
    # assistant's tokens for its masks): templates on the Hub use both, and without them did not parse, so
    # serve refused to start and data prepare to run on a model transformers and vLLM render.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _generation_tag()])
    env.globals["raise_exception"] = raise_exception
    # and its tojson (JSON as written: jinja's own escapes <, >, & and ' for HTML, and any non-ASCII character) and
    # strftime_now (Llama 3.2's template dates its system turn today with it, else "26 Jul 2024")
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:  # once a traceback (serve's start, data prepare)
        raise InstructError(f"{where}: the chat template does not parse (line {e.lineno}: {e.message}): fix it, or "
                            "remove it") from None


def _generation_tag():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: its body, as rendered."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()
    return Generation


def chat_prompter(tok: Tokenizer):
    """messages -> the text that opens the assistant's next turn, by the tokenizer's chat template as
    training renders it; None when the tokenizer has no template. The template's own refusals raise
    InstructError, its other failures jinja2.TemplateError."""
    template = _chat_template(tok)
    if template is None:
        return None
    eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else ""
    return lambda messages: _render(template, messages, eos, tok.bos_token, generation_prompt=True)


# _render's plain format as a chat template, which `data prepare` writes into a dataset whose tokenizer has none
# (as TRL's setup_chat_format gives one): the run's export and `serve` then prompt in the format the model learned,
# where /v1/chat/completions and transformers' apply_chat_template otherwise knew no format at all.
PLAIN_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def plain_template(tok: Tokenizer) -> str:
    """PLAIN_TEMPLATE opened as examples() opens a conversation rendered without a template (`bos_ids`)."""
    return ("{{ bos_token }}" if tok.bos_ids else "") + PLAIN_TEMPLATE


def _render(template, messages: list[dict], eos: str, bos: str, generation_prompt: bool = False) -> str:
    """The conversation as text; `generation_prompt` appends what opens the assistant's next turn. A template
    places the beginning-of-sequence token itself (`bos_token`), as transformers' apply_chat_template does."""
    if template is None:
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + \
            ("<|assistant|>\n" if generation_prompt else "")
    return template.render(messages=messages, add_generation_prompt=generation_prompt, eos_token=eos, bos_token=bos)


def _pieces(record: dict, where: str, template, eos: str, bos: str) -> list[tuple[str, bool]]:
    """(text, trained) pieces of one example, in order."""
    import jinja2
    try:
        return _split(record, where, template, eos, bos)
    except InstructError as e:
        raise InstructError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    except jinja2.TemplateError as e:
        raise InstructError(f"{where}: the tokenizer's chat template fails on this conversation: {e}") from None


def _split(record: dict, where: str, template, eos: str, bos: str) -> list[tuple[str, bool]]:
    if "messages" in record:
        messages = record["messages"]
        bad = _bad_message(messages)
        if bad:
            raise InstructError(f"{where}: messages must be a non-empty list of {{role: system|user|assistant, "
                                f"content: string}}: {bad}")
        if not any(m["role"] == "assistant" for m in messages):
            raise InstructError(f"{where}: no assistant message: nothing to train on")
        out, before = [], ""
        for i, m in enumerate(messages):
            text = _render(template, messages[:i + 1], eos, bos)
            if m["role"] == "assistant":  # the header that opens the answer is prompt, not answer
                header = _render(template, messages[:i], eos, bos, generation_prompt=True)
                if not text.startswith(header):
                    header = _answer_opening(template, messages[:i + 1], eos, bos) or header
                out.append((_after(header, before, where, i), False))
                before = header
            out.append((_after(text, before, where, i), m["role"] == "assistant"))
            before = text
        return out
    prompt, completion = record.get("prompt"), record.get("completion")
    if not isinstance(prompt, str) or not isinstance(completion, str):
        # Which field is off, as other tools spell it (response, output, answer) or of another type.
        has = ", ".join(f"{k!r}" + ("" if isinstance(v, str) else f" ({JSON_KINDS.get(type(v), 'a value')})")
                        for k, v in list(record.items())[:8])
        raise InstructError(f"{where}: needs string fields prompt and completion (or messages); has {has or 'none'}"
                           " (for plain text, name its field with --text-field)")
    return [(prompt, False), (completion, True)]


def _bad_message(messages) -> str:
    """What is wrong with the first message that is no {role, content} turn ("" when none is)."""
    if not isinstance(messages, list) or not messages:
        return f"it is {JSON_KINDS.get(type(messages), 'a value')}" + (" and empty" if messages == [] else "")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i + 1} is {JSON_KINDS.get(type(m), 'a value')}"
        if m.get("role") not in ROLES:
            return f"message {i + 1} has role {m.get('role')!r}"
        if not isinstance(m.get("content"), str):  # OpenAI's list of content parts among them
            return f"message {i + 1}'s content is {JSON_KINDS.get(type(m.get('content')), 'a value')}"
    return ""


ANSWER_PROBE = "SHARDLMANSWERPROBE"  # content no template changes: where it lands, a finished answer starts


def _answer_opening(template, messages: list[dict], eos: str, bos: str) -> str | None:
    """The text of `messages` before its last (the assistant's) answer, as the template renders a finished turn:
    for templates whose generation prompt opens more than a finished answer does (DeepSeek-R1's adds "<think>\\n"
    to the prompt only). None where the probe's content does not come through."""
    probe = _render(template, messages[:-1] + [{**messages[-1], "content": ANSWER_PROBE}], eos, bos)
    return probe[:probe.index(ANSWER_PROBE)] if ANSWER_PROBE in probe else None


def turn_end_id(tok: Tokenizer) -> int | None:
    """The special token the tokenizer's chat template closes an assistant's turn with (Qwen's <|im_end|>, Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>), where that is not its end-of-text: a base model's template whose
    generation_config.json names only the end-of-text, fine-tuned on chats, answers "...<|im_end|>\\n" and the
    end-of-text after it, the end of turn decoded into the reply. None without a template, where a turn ends in
    plain text, or where the template does not parse or refuses the probe."""
    eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else ""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ANSWER_PROBE}]
    try:
        template = _chat_template(tok)  # one that does not parse is refused where chats are rendered, not here
        text = _render(template, probe, eos, tok.bos_token) if template is not None else ""
    except Exception:  # noqa: BLE001 - a template's own refusals and errors: no end of turn to learn of it
        return None
    after = text[text.index(ANSWER_PROBE) + len(ANSWER_PROBE):] if ANSWER_PROBE in text else ""
    ids = tok.encode(after) if after else []
    special = tok.tok.get_added_tokens_decoder()
    return ids[0] if ids and ids[0] in special and special[ids[0]].special and ids[0] != tok.eos_id else None


def completion_stop_ids(tok: Tokenizer, generation: dict | None = None) -> tuple[int, ...]:
    """Where everything that generates (generate, eval, serve, a run's sample) ends a completion: stop_ids_of's
    end-of-text ids, and the special token the chat template ends an assistant's turn with (turn_end_id)."""
    from ..generation_config import stop_ids_of
    ids, turn = stop_ids_of(tok, generation), turn_end_id(tok)
    return ids + (turn,) if turn is not None and turn not in ids else ids


def _after(text: str, before: str, where: str, i: int) -> str:
    if not text.startswith(before):
        raise InstructError(f"{where}: the chat template renders turn {i + 1} by rewriting the turns before it, "
                            "so the turns cannot be masked apart")
    return text[len(before):]


def examples(path: Path, tok: Tokenizer):
    """(token ids, loss mask, bytes read, whether it is a conversation rendered without a chat template, its place
    in the file where its answers are all empty, else None) of every example of a jsonl file, each opened as the
    tokenizer opens a text (`bos_ids`; a chat template places them itself, and a chat without one opens with
    the bos_token's text, as the template written for it does) and closed by the end-of-text token
    (trained on where it closes an answer: the model learns to stop; not after a conversation's last turn that
    is not the assistant's)."""
    if tok.eos_id is None:
        where = getattr(tok, "source", None) or "the tokenizer"
        raise InstructError(f"instruction data needs a tokenizer with an end-of-text token, which closes each answer "
                            f"so the model learns to stop; {where} has none: set tokenizer_config.json's eos_token "
                            "to the token the model ends a text with (one of tokenizer.json's)")
    template = _chat_template(tok)
    eos = tok.decode([tok.eos_id])
    for where, record, nbytes in objects(path, InstructError, " with prompt and completion, or messages"):
        plain_chat = template is None and "messages" in record
        pieces = _pieces(record, where, template, eos, tok.bos_token)
        opened = "messages" in record and template is not None  # a chat template places the opening tokens
        if plain_chat and tok.bos_ids and tok.bos_token:
            # Opened by its bos_token's text, as plain_template (written for serving it) renders it: a SentencePiece
            # tokenizer then marks no word start before the first turn, which, encoded alone, it did.
            pieces[0] = (tok.bos_token + pieces[0][0], pieces[0][1])
            opened = True
        ids = [] if opened else list(tok.bos_ids)
        mask = [False] * len(ids)
        answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"] \
            if "messages" in record else [record["completion"]]
        for piece, trained in _encode(tok, pieces):
            ids += piece
            mask += [trained] * len(piece)
        # The end-of-text closing an answer is trained (the model learns to stop); one closing a conversation that
        # ends in another turn (a user's follow-up) only separates examples: trained, it taught the model to end
        # a text after a user's turn.
        answered = "messages" not in record or record["messages"][-1]["role"] == "assistant"
        if not (ids and ids[-1] == tok.eos_id and (mask[-1] or not answered)):  # a template may close it itself
            ids.append(tok.eos_id)
            mask.append(answered)
        yield (np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8), nbytes,
               plain_chat, None if any(a.strip() for a in answers) else where)


def _encode(tok: Tokenizer, pieces: list[tuple[str, bool]]) -> list[tuple[list[int], bool]]:
    """Each (text, trained) piece's tokens as they are inside the whole example's text, as transformers
    tokenizes it (tokenizer(prompt + completion), apply_chat_template): a SentencePiece-style tokenizer (Llama
    2's, Mistral's: a Metaspace pre-tokenizer or a Prepend normalizer) marks a word start (U+2581) before any
    text it is given alone, so an answer encoded alone would train a space before it that the model, served
    the prompt, must not produce. The tokens before each piece must be those of the text before it alone (what
    a prompt ending there is served as); where they are not (a merge across the boundary), each piece is
    encoded on its own."""
    pieces = [(text, trained) for text, trained in pieces if text]
    texts, ends, end = [], [], 0
    for text, _ in pieces:
        end += len(text)
        texts.append(text)
        ends.append(end)
    full = "".join(texts)
    *heads, whole = tok.encode_batch([full[:e] for e in ends[:-1]] + [full]) if pieces else [[]]
    cuts = [0] + [len(h) for h in heads] + [len(whole)]
    if any(whole[:len(h)] != h for h in heads) or cuts != sorted(cuts):
        return [(tok.encode(text), trained) for text, trained in pieces]
    return [(whole[a:b], trained) for (_, trained), a, b in zip(pieces, cuts, cuts[1:])]


def fit(ids: np.ndarray, mask: np.ndarray, pad_to: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """One example as one window of `pad_to` tokens: cut (True when it was), or padded with untrained pad_id."""
    if len(ids) >= pad_to:
        return ids[:pad_to], mask[:pad_to], len(ids) > pad_to
    pad = pad_to - len(ids)
    return (np.concatenate([ids, np.full(pad, pad_id, dtype=ids.dtype)]),
            np.concatenate([mask, np.zeros(pad, dtype=mask.dtype)]), False)
