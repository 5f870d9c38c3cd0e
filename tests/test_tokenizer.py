"""Tokenizers of a model directory: Kimi's tiktoken.model format on a small BPE file built here, and tokenizer.json.

The oracles: tiktoken.Encoding built directly from the same ranks, special tokens and split pattern (written out
here as the format defines it), and the tokenizers library reading the demo's tokenizer.json itself.
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer

from kdtree_engine.errors import BadInput, TokenizerError
from kdtree_engine.tokenizer import TextTokenizer, load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "kdtree_engine" / "assets" / "demo"

# Kimi's split pattern as Moonshot's tokenization_kimi.py writes it (the oracle's copy, kept apart from the code's)
ORACLE_PAT = "|".join([
    r"""[\p{Han}]+""",
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
     r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
     r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""),
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
RESERVED = 258          # ids n .. n + 257 are special in the format
SEED = 20260447

WORDS = ["the", "The", "THE", "don't", "we'll", "I'M", "import", "def", "return", "self", "naïve", "café", "Straße",
         "привет", "мир", "中文", "汉字测试", "日本語", "カタカナ", "한국어", "e\u0301", "😀", "🚀✨", "x", "foo_bar",
         "CamelCase", "snake_case", "3.14", "42", "1234567", "0x1F", "(", ")", "{", "}", "::", "->", "!=", "…"]
SPACES = [" ", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "    "]


def random_text(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            out.append(rng.choice(WORDS))
        elif r < 0.85:
            out.append(rng.choice(SPACES))
        elif r < 0.93:
            out.append(str(rng.randrange(10 ** rng.randrange(1, 9))))
        else:   # any code point but surrogates (a str holding one cannot be UTF-8 encoded)
            cp = rng.randrange(0x20, 0x30000)
            out.append(chr(cp if not 0xD800 <= cp < 0xE000 else 0x41))
    return "".join(out)


def train_bpe(text: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE: the 256 bytes (ranked in a shuffled order) and ``merges`` merges of the most frequent
    adjacent pair in the words of ``text`` (ties broken by the pair's bytes)."""
    rng = random.Random(SEED)
    order = list(range(256))
    rng.shuffle(order)
    ranks = {bytes([b]): r for r, b in enumerate(order)}
    words = Counter(tuple(bytes([b]) for b in w.encode("utf-8")) for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    for extra in (b"12", b"123", b"1234", "中文".encode(), "中文a".encode()):   # tokens the pattern must split
        if extra not in ranks:
            ranks[extra] = len(ranks)
    return ranks


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    print(f"seed {SEED}")
    return train_bpe(random_text(random.Random(SEED), 3000), 300)


def write_model(directory: Path, ranks: dict[bytes, int], *, shift: int = 0, eos: str | None = "[EOS]",
                extra_config: dict | None = None) -> dict[str, int]:
    """tiktoken.model + tokenizer_config.json in ``directory``; returns the named special tokens and their ids."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()]
    (directory / "tiktoken.model").write_text("".join(lines))
    n = len(ranks)
    named = {"[BOS]": n + shift, "[EOS]": n + 1 + shift, "<|im_end|>": n + 3 + shift, "<|im_user|>": n + 4 + shift,
             "<|im_assistant|>": n + 6 + shift, "[PLAIN]": n + 7 + shift}
    decoder = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": c != "[PLAIN]"} for c, i in named.items()}
    config = {"added_tokens_decoder": decoder, "bos_token": "[BOS]", **({"eos_token": eos} if eos else {}),
              **(extra_config or {})}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return named


def oracle(ranks: dict[bytes, int], named: dict[str, int], pat: str = ORACLE_PAT) -> tiktoken.Encoding:
    n = len(ranks)
    specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + RESERVED) if i not in named.values()}
    specials.update(named)
    return tiktoken.Encoding("oracle", pat_str=pat, mergeable_ranks=ranks, special_tokens=specials)


def test_round_trip_and_ids_equal_the_tiktoken_oracle(tmp_path, ranks) -> None:
    named = write_model(tmp_path, ranks)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TextTokenizer) and tok.name == "tiktoken"
    ref = oracle(ranks, named)
    rng = random.Random(SEED + 1)
    print(f"seed {SEED + 1}")
    for _ in range(300):
        text = random_text(rng, rng.randrange(0, 60))
        ids = tok.encode(text)
        assert ids == ref.encode(text, disallowed_special=()), text
        assert tok.decode(ids) == text
        assert tok.encode(text, special=True) == ref.encode(text, allowed_special="all"), text


def test_the_split_pattern_is_applied(tmp_path, ranks) -> None:
    named = write_model(tmp_path, ranks)
    tok = load_tokenizer(tmp_path)
    unsplit = oracle(ranks, named, pat=r"[\s\S]+")
    for text, pieces in (("1234", ["123", "4"]), ("中文a", ["中文", "a"])):
        ids = tok.encode(text)
        assert [tok.decode([i]) for i in ids] == pieces
        assert unsplit.encode(text) != ids   # the file alone (no split) would merge across the pattern's pieces


def test_special_tokens_are_ids_only_with_special(tmp_path, ranks) -> None:
    named = write_model(tmp_path, ranks)
    tok = load_tokenizer(tmp_path)
    n = len(ranks)
    for content, token_id in named.items():
        assert tok.encode(content, special=True) == [token_id]
        plain = tok.encode(content)
        assert all(i < n for i in plain) and tok.decode(plain) == content
    # unnamed ids of the reserved range are <|reserved_token_{id}|>; past the range there are none
    assert tok.encode(f"<|reserved_token_{n + 2}|>", special=True) == [n + 2]
    assert tok.encode(f"<|reserved_token_{n + RESERVED - 1}|>", special=True) == [n + RESERVED - 1]
    assert all(i < n for i in tok.encode(f"<|reserved_token_{n + RESERVED}|>", special=True))
    text = "a<|im_user|>hi<|im_end|>[PLAIN]b"
    ids = tok.encode(text, special=True)
    assert named["<|im_user|>"] in ids and named["<|im_end|>"] in ids and named["[PLAIN]"] in ids
    assert tok.decode(ids) == text
    # skip_special drops the special ones; a token the config marks "special": false stays
    assert tok.decode(ids, skip_special=True) == "ahi[PLAIN]b"
    assert tok.eos_token_ids == (named["[EOS]"],)


def test_ids_are_read_from_the_config(tmp_path, ranks) -> None:
    base = write_model(tmp_path / "a", ranks)
    moved = write_model(tmp_path / "b", ranks, shift=5)
    a, b = load_tokenizer(tmp_path / "a"), load_tokenizer(tmp_path / "b")
    for content in base:
        assert b.encode(content, special=True) == [a.encode(content, special=True)[0] + 5]
    assert b.eos_token_ids == (a.eos_token_ids[0] + 5,)
    assert b.encode(f"<|reserved_token_{len(ranks)}|>", special=True) == [len(ranks)]   # now unnamed
    write_model(tmp_path / "c", ranks, eos=None)
    assert load_tokenizer(tmp_path / "c").eos_token_ids == ()


def kimi_cut(text: str, window: int = 400_000, run: int = 25_000) -> list[str]:
    """The oracle's cut: per window, a character loop that starts a new piece once a run of whitespace or of
    non-whitespace would pass ``run`` characters (the rule tokenization_kimi.py states)."""
    out = []
    for w in (text[i:i + window] for i in range(0, len(text), window)):
        start, length, space = 0, 0, w[:1].isspace()
        for i, ch in enumerate(w):
            if ch.isspace() != space:
                space, length = ch.isspace(), 1
            else:
                length += 1
                if length > run:
                    out.append(w[start:i])
                    start, length = i, 1
        out.append(w[start:])
    return out


def test_long_runs_are_cut_as_the_format_does(tmp_path, ranks) -> None:
    named = write_model(tmp_path, ranks)
    tok = load_tokenizer(tmp_path)
    ref = oracle(ranks, named)
    text = "def f():\n" + " " * 60_123 + "x" * 30_001 + " tail" + "ab" * 13_000
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(kimi_cut(text)) > 3
    assert ids == [i for piece in kimi_cut(text) for i in ref.encode(piece, disallowed_special=())]


@pytest.mark.parametrize("line, what", [
    ("!!!notbase64 7", "line"),
    ("YQ== seven", "line"),
    ("YQ== 7 extra", "line"),
])
def test_a_corrupt_line_names_the_file(tmp_path, ranks, line, what) -> None:
    write_model(tmp_path, ranks)
    file = tmp_path / "tiktoken.model"
    lines = file.read_text().splitlines()
    lines.insert(4, line)
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path)
    msg = str(e.value)
    assert str(file) in msg and "line 5" in msg and "\n" not in msg
    assert isinstance(e.value, BadInput)


@pytest.mark.parametrize("edit, expect", [
    (lambda ranks: {**ranks, b"zz-dup": 3}, "repeated"),                               # a rank given twice
    (lambda ranks: {t: r for t, r in ranks.items() if t != b"A"}, "single bytes"),     # a byte without a rank
])
def test_a_malformed_bpe_file_names_the_file(tmp_path, ranks, edit, expect) -> None:
    write_model(tmp_path, edit(ranks))
    with pytest.raises(TokenizerError, match=expect) as e:
        load_tokenizer(tmp_path)
    assert "tiktoken.model" in str(e.value) and "\n" not in str(e.value)


def test_a_broken_config_names_the_file(tmp_path, ranks) -> None:
    write_model(tmp_path, ranks)
    cfg = tmp_path / "tokenizer_config.json"
    good = cfg.read_text()
    cfg.write_text(good[:-5])
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(tmp_path)
    cfg.write_text(json.dumps({**json.loads(good), "eos_token": "[NOPE]"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token '\[NOPE\]' is not a token"):
        load_tokenizer(tmp_path)
    raw = json.loads(good)
    raw["added_tokens_decoder"]["3"] = {"content": "<|inside|>", "special": True}
    cfg.write_text(json.dumps(raw))
    with pytest.raises(TokenizerError, match="falls among the"):
        load_tokenizer(tmp_path)


def test_decode_rejects_ids_outside_the_vocabulary(tmp_path, ranks) -> None:
    write_model(tmp_path, ranks)
    tok = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="outside"):
        tok.decode([len(ranks) + RESERVED])


# ---- tokenizer.json ----------------------------------------------------------------------------

def test_tokenizer_json_matches_the_tokenizers_library() -> None:
    tok = load_tokenizer(DEMO)
    ref = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    assert isinstance(tok, TextTokenizer) and tok.name == "tokenizers" and tok.has_chat_template
    assert tok.eos_token_ids == (json.loads((DEMO / "config.json").read_text())["eos_token_id"],)
    rng = random.Random(SEED + 2)
    print(f"seed {SEED + 2}")
    for _ in range(200):
        text = random_text(rng, rng.randrange(0, 40))
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("a<|endoftext|>b", special=True) == ref.encode("a<|endoftext|>b").ids
    assert 0 in tok.encode("a<|endoftext|>b", special=True) and 0 not in tok.encode("a<|endoftext|>b")
    ids = tok.encode("a<|endoftext|>b", special=True)
    assert tok.decode(ids) == "a<|endoftext|>b" and tok.decode(ids, skip_special=True) == "ab"


def test_the_reader_is_chosen_by_the_files(tmp_path, ranks) -> None:
    assert load_tokenizer(tmp_path) is None
    write_model(tmp_path, ranks)
    assert load_tokenizer(tmp_path).name == "tiktoken"
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_tokenizer(tmp_path).name == "tokenizers"   # tokenizer.json first


def test_a_broken_tokenizer_json_names_the_file(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(e.value) and "\n" not in str(e.value)


def test_config_tokens_must_agree_with_tokenizer_json(tmp_path) -> None:
    shutil.copy(DEMO / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((DEMO / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {"5": cfg["added_tokens_decoder"]["0"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match=r"added token 5 '<\|endoftext\|>' is id 0 of"):
        load_tokenizer(tmp_path)
