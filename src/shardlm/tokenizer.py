"""Tokenizers through Hugging Face's `tokenizers` library: any tokenizer.json, or the built-in byte-level one.

The byte tokenizer is itself a tokenizer.json (a byte-level BPE with no merges whose id for byte b is b,
plus an end-of-text token 256), so byte-level runs export to HF directories like any other model.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "<eos>")
BYTE_EOS = "<|endoftext|>"
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback: one UTF-8 byte of a character
HF_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",  # transformers >= 4.47's
                 "generation_config.json")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer() -> HFTokenizer:
    from tokenizers import decoders, models, pre_tokenizers
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[BYTE_EOS] = 256
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS])
    return tok


class TokenizerError(ValueError):
    """A text the tokenizer cannot encode: the tokenizers library raises a bare Exception (a WordLevel model without
    its unk_token: "Missing [UNK] token from the vocabulary"), a traceback in every command and a 500 in serve."""


def _encoding(fn, what: str = "the tokenizer cannot encode this text"):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the library's own errors are bare Exceptions, nothing more specific
        if type(e) is not Exception:
            raise
        raise TokenizerError(f"{what} ({e}): a tokenizer that cannot encode every text (no unk_token, no byte "
                             "fallback) is not one to train or serve with") from None


class Tokenizer:
    """encode / decode / eos_id / bos_ids / vocab_size / save over one `tokenizers.Tokenizer`.

    `bos_ids`: the tokens Hugging Face's tokenizer(text) puts before a text (Llama's <s>, Llama 3's
    <|begin_of_text|>; none for GPT-2, Qwen2 or the byte tokenizer). A model pretrained with them at the start
    of every sequence needs them there when it is fine-tuned and prompted: `encode_document` and
    inference.prompt_ids add them, `encode` gives a text's own tokens. `bos_token`: the text a chat template
    renders for `bos_token`."""

    def __init__(self, tok: HFTokenizer, source: Path | None = None, eos_token: str | None = None,
                 bos_token: str | None = None):
        self.tok = tok
        self.source = source  # the directory or file it came from, for copying side files on save
        eos = eos_token if eos_token is not None else next(
            (t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        self.eos_id = tok.token_to_id(eos) if eos else None
        # As transformers 5 reads them, from tokenizer.json's post-processor (tokenizer_config.json's
        # add_bos_token does not change them there).
        self.bos_ids = _encoding(lambda: _prefix(tok), f"{source or 'the tokenizer'} cannot encode even the text 'a'")
        if bos_token is None and self.bos_ids:
            bos_token = tok.id_to_token(self.bos_ids[0])
        self.bos_token = bos_token or ""
        self._plain: HFTokenizer | None = None  # encode_plain_batch's copy, made on first use
        self._hidden: frozenset[int] | None = None  # the ids text() leaves out, found on first use
        self._special: dict[str, int] | None = None  # special_ids(), kept for each request's stop strings
        # The ids a model needs rows for: a tokenizer.json's ids may leave gaps (an added token numbered past the
        # vocabulary), where the count of tokens is below the largest id, which would then wrap in uint16 shards.
        self._vocab_size = max(tok.get_vocab_size(with_added_tokens=True),
                               1 + max(tok.get_vocab(with_added_tokens=True).values(), default=-1))

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return _encoding(lambda: self.tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return _encoding(lambda: [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)])

    def encode_plain_batch(self, texts: list[str]) -> list[list[int]]:
        """Documents' text, a special token's spelling in it encoded as the text it is (nanoGPT's
        encode_ordinary, Megatron's GPT-2 preprocessing): a page quoting "<|endoftext|>" ends no document."""
        if self._plain is None:
            self._plain = HFTokenizer.from_str(self.tok.to_str())
            self._plain.encode_special_tokens = True
        return _encoding(lambda: [e.ids for e in self._plain.encode_batch(texts, add_special_tokens=False)])

    def encode_document(self, text: str) -> list[int]:
        """`text` as the start of a sequence: after the tokens the tokenizer puts first (`bos_ids`)."""
        return self.bos_ids + self.encode(text)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def text(self, ids) -> str:
        """`ids` as the text a reader is given: special tokens (an end-of-text, a chat template's turn markers)
        left out, as transformers' pipelines and vLLM return generated text."""
        if self._hidden is None:
            self._special = self._special or self.special_ids()
            self._hidden = frozenset(self._special.values())
        return self.tok.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False)

    def split_stops(self, stops) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Stop strings as (those looked for in the text, the ids of those that are a special token's text): the
        text leaves special tokens out (text()), so such a string could never be seen; it stops as its token."""
        if self._special is None:
            self._special = self.special_ids()
        special = self._special
        return tuple(s for s in stops if s not in special), tuple(special[s] for s in stops if s in special)

    def special_ids(self) -> dict[str, int]:
        """Each special token's text and id; not byte-fallback pieces ("<0x0A>"), which some tokenizer.json files
        mark special and which are text (a character's UTF-8 bytes)."""
        return {t.content: i for i, t in self.tok.get_added_tokens_decoder().items()
                if t.special and not BYTE_PIECE.fullmatch(t.content)}

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # Written here, not by the tokenizers library, whose failed write (a full disk) is a bare Exception
        # rather than an OSError: a checkpoint's save would end in a traceback instead of its error.
        (directory / "tokenizer.json").write_text(self.tok.to_str(pretty=True), encoding="utf-8")
        if self.source is not None and self.source.is_dir():
            for name in HF_SIDE_FILES:  # not generation_config.json: the model's (generation_config.py)
                if (self.source / name).is_file() and name != "generation_config.json":
                    shutil.copy(self.source / name, directory / name)


def _prefix(tok: HFTokenizer) -> list[int]:
    """The special tokens the tokenizer's post-processor puts before a text (what add_special_tokens adds in
    front; an end-of-text it may append is the data's to place)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    return full[:starts[0]] if starts else []


def fingerprint(tok: Tokenizer) -> str:
    """What the token ids mean, as a short hash of the vocabulary (added tokens included): two tokenizers with
    the same fingerprint give every id the same token, whatever else their files say."""
    vocab = sorted(tok.tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def slow_tokenizer_hint(directory: Path) -> str:
    """How to get the tokenizer.json a directory lacks from the slow tokenizer's files it holds (Llama's
    SentencePiece tokenizer.model, GPT-2's vocab.json and merges.txt); "" where it holds none."""
    slow = [n for n in ("tokenizer.model", "vocab.json", "merges.txt") if (directory / n).is_file()]
    return (f": it holds {' and '.join(slow)}, a slow tokenizer's files, which shardlm does not read; transformers "
            "writes their tokenizer.json: `AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)`") if slow else ""


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`byte`, a tokenizer.json file, or a directory holding one (an HF checkpoint, a run, a data dir)."""
    if str(spec) == "byte":
        return Tokenizer(byte_tokenizer(), eos_token=BYTE_EOS)
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        how = (slow_tokenizer_hint(path) or "; copy the tokenizer's files (tokenizer.json, tokenizer_config.json) "
               "from where the model came from into it") if path.is_dir() else ""
        raise FileNotFoundError(f"no tokenizer.json at {path}{how}")
    settings, named_in = {}, {}  # named_in: a key's file, where not tokenizer_config.json
    cfg = file.parent / "tokenizer_config.json"
    if cfg.is_file():
        try:
            settings = json.loads(cfg.read_text())
        except ValueError as e:  # json's own message names neither the file nor what it is
            raise ValueError(f"{cfg} is not valid JSON ({e}): fetch or write it again") from None
    if not isinstance(settings, dict):  # `[]` once ended in an AttributeError's traceback
        raise ValueError(f"{cfg} holds {type(settings).__name__}, not a JSON object: fetch or write it again")
    # Older Hub checkpoints name their special tokens in special_tokens_map.json, which transformers reads over
    # tokenizer_config.json's where that config predates added_tokens_decoder (transformers 4.34): an eos guessed
    # from the usual names (or the config's) stopped elsewhere than theirs.
    mapped = file.parent / "special_tokens_map.json"
    if mapped.is_file() and "added_tokens_decoder" not in settings:
        try:
            extra = json.loads(mapped.read_text())
        except ValueError as e:
            raise ValueError(f"{mapped} is not valid JSON ({e}): fetch or write it again") from None
        if isinstance(extra, dict):
            taken = {k: extra[k] for k in ("eos_token", "bos_token") if extra.get(k) is not None}
            settings, named_in = {**settings, **taken}, dict.fromkeys(taken, mapped)
    eos, bos = (v.get("content") if isinstance(v, dict) else v for v in (settings.get("eos_token"),
                                                                          settings.get("bos_token")))
    for key, value in (("eos_token", eos), ("bos_token", bos)):
        if value is not None and not isinstance(value, str):  # an id where the token's text belongs
            raise ValueError(f"{named_in.get(key, cfg)}: {key} is {value!r}, not the token's text (e.g. \"</s>\"): "
                             "fix it there")
    try:
        tok = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception ("expected value at line 1 column 1")
        raise ValueError(f"{file} is not a tokenizer.json the tokenizers library can read ({e}): give a "
                         "Hugging Face tokenizer.json, a directory holding one, or 'byte'") from None
    if eos and tok.token_to_id(eos) is None:
        # Silently no end-of-text otherwise: documents packed with nothing between them, generation that never
        # stops on it.
        raise ValueError(f"{named_in.get('eos_token', cfg)}: eos_token {eos!r} is no token of {file}: name one it "
                         "holds there")
    return Tokenizer(tok, source=file.parent, eos_token=eos, bos_token=bos)
