"""Text tokenizers of a model directory, and their chat templates.

Two formats are read, picked by which file the directory holds (``tokenizer.json`` first, logged once):

* ``tokenizer.json``: the tokenizers library's format (the demo, DeepSeek-V3 checkpoints);
* ``tiktoken.model``: Kimi's format, a tiktoken BPE file (one ``base64(token bytes) rank`` a line), read with the
  tiktoken library under Kimi's split pattern; its special tokens are the ids past the BPE ranks, named by
  ``tokenizer_config.json``'s ``added_tokens_decoder`` (unnamed ones ``<|reserved_token_{id}|>``).

``tokenizer_config.json`` beside either gives the special tokens (``bos_token``, ``eos_token``,
``added_tokens_decoder``) and the chat template (``chat_template``; a ``chat_template.jinja`` file wins, as in
transformers). A file that cannot be read raises :class:`~kdtree_engine.errors.TokenizerError` naming it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import tiktoken

from .chat_template import ChatTemplate, compile_chat_template, one_line, render_chat, template_source
from .errors import TokenizerError
from .logs import log_once

TOKENIZER_JSON = "tokenizer.json"
TIKTOKEN_MODEL = "tiktoken.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Kimi's pre-tokenizer split pattern, as Moonshot's tokenization_kimi.py defines it (TikTokenTokenizer.pat_str):
# runs of Han characters, words (with English contractions), up to 3 digits, punctuation, newlines, spaces.
KIMI_PAT_STR = "|".join((
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))
# tokenization_kimi.py makes ids len(ranks) .. len(ranks) + 257 special tokens (256 reserved + 2), named by
# added_tokens_decoder where it names them, else <|reserved_token_{id}|>.
KIMI_SPECIAL_SLOTS = 256 + 2
# tokenization_kimi.py encodes at most this many characters at a time, and cuts runs of whitespace or of
# non-whitespace longer than MAX_RUN (tiktoken's regex is slow, and may fail, on very long runs).
KIMI_WINDOW = 400_000
KIMI_MAX_RUN = 25_000
RUN = re.compile(r"\s+|\S+")
# the token names the config's bos_token / eos_token / unk_token / pad_token give (templates see them)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@runtime_checkable
class TextTokenizer(Protocol):
    """What the engine and the server use of a tokenizer."""

    name: str                       # "tokenizers" | "tiktoken": the library that reads it
    eos_token_ids: tuple[int, ...]  # the config's eos_token (empty when it names none)
    has_chat_template: bool

    def encode(self, text: str, *, special: bool = False, add_special_tokens: bool = False) -> list[int]:
        """``special``: special-token strings in ``text`` (as chat templates emit) become their ids; else they
        are encoded as plain text. ``add_special_tokens``: also the tokens the tokenizer adds of its own
        (tokenizer.json's post-processor, e.g. DeepSeek-V3's BOS; Kimi's adds none), as for a raw prompt."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The chat template rendered as transformers renders it; ChatTemplateError when it cannot be."""
        ...


@dataclass(frozen=True)
class AddedToken:
    content: str
    special: bool


@dataclass(frozen=True)
class TokenizerConfig:
    """What ``tokenizer_config.json`` (and ``chat_template.jinja``) say; empty when there is none."""

    path: Path | None = None
    added_tokens: Mapping[int, AddedToken] = field(default_factory=dict)   # added_tokens_decoder
    special_tokens: Mapping[str, str] = field(default_factory=dict)        # bos_token, eos_token, ...
    chat_template: str | None = None
    chat_template_origin: str = ""


def read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerError(f"{file}: cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{file}: not valid JSON ({one_line(e)})") from None


def token_content(value: Any, file: Path, key: str) -> str | None:
    """A token as the config gives it: a string, or an AddedToken object ``{"content": ...}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{file}: {key} must be a string or an object with a 'content' string")


def read_added_tokens(value: Any, file: Path) -> dict[int, AddedToken]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TokenizerError(f"{file}: added_tokens_decoder must be an object of id -> token")
    out = {}
    for key, entry in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise TokenizerError(f"{file}: added_tokens_decoder key {key!r} is not a token id") from None
        content = token_content(entry, file, f"added_tokens_decoder[{key}]")
        if content is None or token_id < 0:
            raise TokenizerError(f"{file}: added_tokens_decoder[{key}] needs a non-negative id and a content")
        special = entry.get("special", True) if isinstance(entry, Mapping) else True
        out[token_id] = AddedToken(content, bool(special))
    return out


def read_tokenizer_config(directory: Path) -> TokenizerConfig:
    """``tokenizer_config.json`` and ``chat_template.jinja`` of ``directory`` (an empty config without them)."""
    file = directory / TOKENIZER_CONFIG
    raw = read_json(file) if file.exists() else {}
    if not isinstance(raw, Mapping):
        raise TokenizerError(f"{file}: must hold a JSON object")
    specials = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(raw.get(key), file, key)
        if content is not None:
            specials[key] = content
    template, origin = template_source(raw.get("chat_template"), str(file)), str(file)
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.exists():
        try:
            template, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file}: cannot be read ({one_line(e)})") from None
    return TokenizerConfig(file if file.exists() else None, read_added_tokens(raw.get("added_tokens_decoder"), file),
                           specials, template, origin)


class ConfiguredTokenizer:
    """What both formats share: the config's EOS and chat template; subclasses encode and decode."""

    name: str

    def __init__(self, file: Path, config: TokenizerConfig) -> None:
        self.file = file
        self.config = config
        self.chat_template: ChatTemplate | None = None
        if config.chat_template is not None:
            self.chat_template = compile_chat_template(config.chat_template, config.chat_template_origin,
                                                       config.special_tokens)
        self.eos_token_ids: tuple[int, ...] = ()

    def resolve_special_tokens(self) -> None:
        """Each token the config names (bos_token, eos_token, ...) must be a token here; EOS is kept as an id."""
        for key, content in self.config.special_tokens.items():
            token_id = self.token_id(content)
            if token_id is None:
                raise TokenizerError(f"{self.config.path}: {key} {content!r} is not a token of {self.file}")
            if key == "eos_token":
                self.eos_token_ids = (token_id,)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def token_id(self, content: str) -> int | None:
        raise NotImplementedError

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt)


class JsonTokenizer(ConfiguredTokenizer):
    """``tokenizer.json`` read by the tokenizers library."""

    name = "tokenizers"

    def __init__(self, file: Path, config: TokenizerConfig) -> None:
        from tokenizers import Tokenizer
        super().__init__(file, config)
        try:
            text = file.read_text(encoding="utf-8")
            # two readers, so that neither call flips shared state: one matches special tokens, one does not
            self.matching = Tokenizer.from_str(text)
            self.plain = Tokenizer.from_str(text)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{file}: cannot be read ({one_line(e)})") from None
        except Exception as e:  # the tokenizers library raises a bare Exception on a malformed file
            raise TokenizerError(f"{file}: not a tokenizers tokenizer.json ({one_line(e)})") from None
        self.plain.encode_special_tokens = True
        for token_id, token in config.added_tokens.items():
            found = self.matching.token_to_id(token.content)
            if found != token_id:
                raise TokenizerError(f"{config.path}: added token {token_id} {token.content!r} is "
                                     f"{'not in' if found is None else f'id {found} of'} {file}")
        self.resolve_special_tokens()

    def token_id(self, content: str) -> int | None:
        return self.matching.token_to_id(content)

    def encode(self, text: str, *, special: bool = False, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: also what tokenizer.json's post-processor adds (a BOS for DeepSeek-V3), as
        tokenizers' own ``encode`` does by default; a rendered chat template already holds them."""
        tok = self.matching if special else self.plain
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.matching.decode([int(t) for t in ids], skip_special_tokens=skip_special)


def read_bpe_ranks(file: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: one ``base64(token bytes) rank`` a line (blank lines skipped)."""
    try:
        data = file.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{file}: cannot be read ({e.strerror or e})") from None
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    for lineno, line in enumerate(data.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{file}: line {lineno} is not 'base64-token rank': "
                                 f"{line[:60].decode('utf-8', 'replace')!r}") from None
        if not token or rank < 0 or token in ranks or rank in seen:
            what = "an empty token" if not token else "a negative rank" if rank < 0 else "a repeated token or rank"
            raise TokenizerError(f"{file}: line {lineno} holds {what}")
        ranks[token] = rank
        seen.add(rank)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{file}: {len(missing)} single bytes have no rank (first 0x{missing[0]:02x}); a "
                             "byte-level BPE file ranks all 256")
    return ranks


def kimi_special_tokens(n_ranks: int, config: TokenizerConfig, file: Path) -> dict[str, int]:
    """Kimi's special tokens: ids n_ranks .. n_ranks + KIMI_SPECIAL_SLOTS - 1 and any further ones the config
    names, each named by added_tokens_decoder or ``<|reserved_token_{id}|>``."""
    ids = sorted(set(range(n_ranks, n_ranks + KIMI_SPECIAL_SLOTS)) | set(config.added_tokens))
    if ids[0] < n_ranks:
        raise TokenizerError(f"{config.path}: added token {ids[0]} {config.added_tokens[ids[0]].content!r} "
                             f"falls among the {n_ranks} BPE ranks of {file}")
    out: dict[str, int] = {}
    for token_id in ids:
        token = config.added_tokens.get(token_id)
        content = token.content if token is not None else f"<|reserved_token_{token_id}|>"
        if content in out:
            raise TokenizerError(f"{config.path}: token {content!r} named twice (ids {out[content]} and {token_id})")
        out[content] = token_id
    return out


def kimi_pieces(text: str) -> list[str]:
    """``text`` cut where tokenization_kimi.py cuts it before tiktoken: into KIMI_WINDOW-character windows, and
    inside each at every KIMI_MAX_RUN-th character of a run of whitespace or of non-whitespace."""
    if len(text) <= KIMI_MAX_RUN:
        return [text]
    pieces = []
    for start in range(0, len(text), KIMI_WINDOW):
        window = text[start:start + KIMI_WINDOW]
        cut = 0
        for run in RUN.finditer(window):
            for at in range(run.start() + KIMI_MAX_RUN, run.end(), KIMI_MAX_RUN):
                pieces.append(window[cut:at])
                cut = at
        pieces.append(window[cut:])
    return pieces


class TiktokenTokenizer(ConfiguredTokenizer):
    """Kimi's ``tiktoken.model`` read by the tiktoken library."""

    name = "tiktoken"

    def __init__(self, file: Path, config: TokenizerConfig) -> None:
        super().__init__(file, config)
        ranks = read_bpe_ranks(file)
        specials = kimi_special_tokens(len(ranks), config, file)
        self.encoding = tiktoken.Encoding(file.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=specials)
        self.n_vocab = self.encoding.n_vocab
        # a token the config marks "special": false is kept by decode(skip_special=True)
        self.special_ids = frozenset(i for i in specials.values()
                                     if i not in config.added_tokens or config.added_tokens[i].special)
        self.resolve_special_tokens()

    def token_id(self, content: str) -> int | None:
        try:
            return self.encoding.encode_single_token(content)
        except KeyError:
            return None

    def encode(self, text: str, *, special: bool = False, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens`` is accepted for the same call as ``JsonTokenizer``: Kimi's tokenizer adds
        no token of its own to an encoding."""
        out: list[int] = []
        for piece in kimi_pieces(text):
            if special:
                out.extend(self.encoding.encode(piece, allowed_special="all"))
            else:
                out.extend(self.encoding.encode(piece, disallowed_special=()))
        return out

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        ids = [int(t) for t in ids]
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside {self.file.name}'s vocabulary (0..{self.n_vocab - 1})")
        if skip_special:
            ids = [t for t in ids if t not in self.special_ids]
        return self.encoding.decode(ids, errors="replace")


def load_tokenizer(path: str | Path) -> TextTokenizer | None:
    """The tokenizer of a model directory (tokenizer.json first, else tiktoken.model), None when it has neither."""
    directory = Path(path)
    json_file, bpe_file = directory / TOKENIZER_JSON, directory / TIKTOKEN_MODEL
    if json_file.exists():
        file, reader = json_file, JsonTokenizer
    elif bpe_file.exists():
        file, reader = bpe_file, TiktokenTokenizer
    else:
        return None
    config = read_tokenizer_config(directory)
    tok = reader(file, config)
    log_once(f"tokenizer {directory.resolve()}",
             f"tokenizer: {file} read with {tok.name}"
             + (f", special tokens from {config.path}" if config.path is not None else "")
             + (f", chat template from {config.chat_template_origin}" if tok.has_chat_template else
                ", no chat template"))
    return tok
