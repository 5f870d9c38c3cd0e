"""The near-duplicate check of held-out files (kdtree_engine.train.near_dup) and its use by the default prompts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kdtree_engine import bench_spec
from kdtree_engine.engine import load_tokenizer
from kdtree_engine.train.data import is_heldout, list_sources, read_source, split_paths, stdlib_root
from kdtree_engine.train.near_dup import (MAX_CONTAINMENT, SHINGLE_TOKENS, NearDupRule, ShingleIndex,
                                          is_near_duplicate, shingles, train_index)

DEMO = Path(bench_spec.__file__).parent / "assets" / "demo"

TRAIN_TEXT = '''"""Queue helpers."""

import collections


def drain(queue, limit=None):
    """Pop every item of the queue (at most limit) and return them in order."""
    out = []
    while queue and (limit is None or len(out) < limit):
        out.append(queue.popleft())
    return out


class Window:
    def __init__(self, size):
        self.size = size
        self.items = collections.deque(maxlen=size)

    def push(self, item):
        self.items.append(item)
        return len(self.items) == self.size
'''

# the training file with two names changed: a near-copy
NEAR_COPY = TRAIN_TEXT.replace("drain", "flush").replace("Window", "Ring")

UNRELATED = '''def parse_header(line):
    """Split 'Key: value' into a lower-case key and the stripped value."""
    key, sep, value = line.partition(":")
    if not sep:
        raise ValueError(f"not a header line: {line!r}")
    return key.strip().lower(), value.strip()


def parse_headers(lines):
    headers = {}
    for line in lines:
        if not line.strip():
            break
        key, value = parse_header(line)
        headers.setdefault(key, []).append(value)
    return headers
'''


def oracle_containment(held: str, train: str, k: int = SHINGLE_TOKENS) -> float:
    """|H & T| / |H| over sets of k-token tuples: no hashing, no index."""
    def grams(text: str) -> set[tuple[str, ...]]:
        toks = re.findall(r"\w+|[^\w\s]", text)
        return {tuple(toks[i:i + k]) for i in range(len(toks) - k + 1)}
    h = grams(held)
    return len(h & grams(train)) / len(h) if h else 0.0


def paths(heldout: bool, n: int) -> list[str]:
    return [p for p in (f"pkg/mod{i}.py" for i in range(1000)) if is_heldout(p) == heldout][:n]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO)


@pytest.fixture()
def tiny_stdlib(tmp_path: Path) -> tuple[Path, str, str]:
    """A stdlib of one training file and two held-out files: a near-copy of it and an unrelated one."""
    (train,) = paths(False, 1)
    near, other = paths(True, 2)
    for rel, text in ((train, TRAIN_TEXT), (near, NEAR_COPY), (other, UNRELATED)):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")
    assert split_paths(list_sources(tmp_path)) == ([train], sorted([near, other]))
    return tmp_path, near, other


def test_containment_equals_the_set_oracle() -> None:
    index = ShingleIndex([("train.py", TRAIN_TEXT), ("other.py", UNRELATED)])
    for held in (NEAR_COPY, UNRELATED, TRAIN_TEXT[: len(TRAIN_TEXT) // 2]):
        m = index.closest(held)
        best = max(("train.py", "other.py"), key=lambda p: oracle_containment(held, TRAIN_TEXT if p == "train.py"
                                                                           else UNRELATED))
        assert m.train_path == best
        expected = oracle_containment(held, TRAIN_TEXT if best == "train.py" else UNRELATED)
        assert m.containment == pytest.approx(expected)
        assert m.shingles == len(shingles(held))


def test_shingles_ignore_layout_and_need_k_tokens() -> None:
    assert list(shingles("a = f(x,  y)\n")) == list(shingles("a=f(x,y)"))
    assert len(shingles("a b c", k=4)) == 0
    assert len(shingles("a b c d", k=4)) == 1


def test_near_copy_is_excluded_and_unrelated_kept(tiny_stdlib, tokenizer) -> None:
    root, near, other = tiny_stdlib
    index = train_index(root)
    assert is_near_duplicate(index.closest(NEAR_COPY))
    assert index.closest(NEAR_COPY).containment > MAX_CONTAINMENT
    assert not is_near_duplicate(index.closest(UNRELATED))
    picked = [p.source for p in bench_spec.default_prompts(tokenizer, 5, 16, root=root)]
    assert picked == [other]
    # without the check the near-copy is a prompt too: the check is what leaves it out
    unchecked = [p.source for p in bench_spec.default_prompts(tokenizer, 5, 16, root=root, near_dup=None)]
    assert sorted(unchecked) == sorted([near, other])


def test_rule_is_validated() -> None:
    with pytest.raises(ValueError):
        NearDupRule(max_containment=0.0)
    with pytest.raises(ValueError):
        NearDupRule(shingle_tokens=0)


STDLIB = stdlib_root()
HAS_CODECS = all((STDLIB / "encodings" / f).is_file() for f in ("utf_32_be.py", "utf_32_le.py", "utf_16_be.py"))


@pytest.fixture(scope="module")
def stdlib_index() -> ShingleIndex:
    return train_index(STDLIB)


@pytest.mark.skipif(not HAS_CODECS, reason="this interpreter's stdlib lacks the encodings package sources")
def test_real_utf_32_be_is_excluded(stdlib_index, tokenizer) -> None:
    rel = "encodings/utf_32_be.py"
    assert is_heldout(rel) and not is_heldout("encodings/utf_32_le.py")
    m = stdlib_index.closest(read_source(STDLIB, rel))
    assert is_near_duplicate(m), m
    assert m.train_path in {"encodings/utf_32_le.py", "encodings/utf_16_be.py", "encodings/utf_32.py",
                            "encodings/utf_16_le.py"}
    assert m.containment == pytest.approx(oracle_containment(read_source(STDLIB, rel), read_source(STDLIB, m.train_path)))
    # the default prompts of the demo bench: utf_32_be.py is among them without the check, not with it
    with_check = [p.source for p in bench_spec.default_prompts(tokenizer, 8, 64, index=stdlib_index)]
    without = [p.source for p in bench_spec.default_prompts(tokenizer, 8, 64, near_dup=None)]
    assert rel in without and rel not in with_check
    assert len(with_check) == 8
    for src in with_check:
        assert not is_near_duplicate(stdlib_index.closest(read_source(STDLIB, src))), src
    # deterministic: the same prompts on a second call (a fresh index)
    again = [p.source for p in bench_spec.default_prompts(tokenizer, 8, 64)]
    assert again == with_check


def test_report_command_lists_the_near_copy(tiny_stdlib, capsys) -> None:
    from kdtree_engine.train.near_dup import main

    root, near, other = tiny_stdlib
    assert main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    lines = {line.split(" -> ")[0].split()[-1]: line for line in out.splitlines() if " -> " in line}
    assert lines[near].endswith("EXCLUDED") and not lines[other].endswith("EXCLUDED")
    assert "# 1 of 2 held-out files are near-duplicates" in out
