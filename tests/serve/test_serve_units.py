"""Stop strings and incremental detokenization against whole-text oracles (no server)."""

from __future__ import annotations

import random

import pytest

from kdtree_engine.engine import DEMO_DIR, load_tokenizer
from kdtree_engine.serve.detok import Detokenizer
from kdtree_engine.serve.stops import StopMatcher


def run_matcher(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces)
    return (out if m.stopped else out + m.flush()), m.stopped


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_stop_strings_cut_at_the_first_to_complete_however_the_text_is_split():
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]   # (end, start)
        expected = text[:min(ends)[1]] if ends else text
        found = bool(ends)
        got, stopped = run_matcher(stops, split_randomly(text, rng))
        assert (got, stopped) == (expected, found), (text, stops)


def test_stop_matcher_holds_back_only_a_possible_start():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == "abc "      # "ST" may start "STOP"
    assert m.push("ONE") == "STONE"        # it did not
    assert m.push("xSTO") == "x"
    assert m.push("P!") == "" and m.stopped


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_DIR)


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1\n", "naïve café — 😀 ünïcödé ✓ 日本語",
                                  "\n\n\t  spaces   and\ttabs"])
def test_detokenizer_deltas_join_to_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)

    def decode(t):
        return tokenizer.decode(t, skip_special=True)

    d = Detokenizer(decode)
    deltas = [d.push(t) for t in ids]
    deltas.append(d.finish())
    assert "".join(deltas) == decode(ids)
    assert not any("\ufffd" in x for x in deltas)   # never a partial character
    assert sum(1 for x in deltas if x) > 1          # incremental, not all at the end
