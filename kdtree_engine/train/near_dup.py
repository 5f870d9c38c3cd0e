"""Near-duplicate check of held-out files against the training files (the demo's default prompts).

The split rule of :mod:`.data` is per path, so a held-out file can be a near-copy of a training file
(``encodings/utf_32_be.py`` and ``encodings/utf_32_le.py`` differ in two letters); the demo model then
continues it from memory and a benchmark on it measures recall, not drafting. The check:

* tokens: ``\\w+`` runs and single other non-space characters (names, numbers, operators; whitespace
  and layout ignored);
* shingles: every run of :data:`SHINGLE_TOKENS` consecutive tokens, as a set of 64-bit hashes (blake2b of
  each token, combined by a fixed polynomial: the same on every machine and Python version);
* measure: the **containment** of a held-out file in a training file, |H & T| / |H| over their shingle
  sets: the share of the held-out text that also stands in that one training file (unlike Jaccard it
  does not forgive a short file copied into a long one);
* rule: a held-out file whose containment in some training file is at least :data:`MAX_CONTAINMENT` is a
  near-duplicate. ``docs/demo_model.md`` gives the distribution the threshold was read from.

``python -m kdtree_engine.train.near_dup [--root DIR]`` prints every held-out file's closest training file.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .data import is_test_path, list_sources, read_source, split_paths, stdlib_root

SHINGLE_TOKENS = 8
MAX_CONTAINMENT = 0.5
TOKEN = re.compile(r"\w+|[^\w\s]")
POLY = np.uint64(0x100000001B3)  # the 64-bit FNV prime: an odd multiplier that mixes the token hashes


@dataclass(frozen=True)
class NearDupRule:
    """Shingle length (tokens) and the containment at or above which a held-out file is left out."""

    shingle_tokens: int = SHINGLE_TOKENS
    max_containment: float = MAX_CONTAINMENT

    def __post_init__(self) -> None:
        if self.shingle_tokens < 1:
            raise ValueError(f"shingle_tokens must be >= 1, got {self.shingle_tokens}")
        if not 0.0 < self.max_containment <= 1.0:
            raise ValueError(f"max_containment must be in (0, 1], got {self.max_containment}")


@dataclass(frozen=True)
class Match:
    """A held-out text's closest training file by containment (``train_path`` None: no shared shingle)."""

    train_path: str | None
    containment: float
    shared: int      # shingles of the held-out text found in that training file
    shingles: int    # distinct shingles of the held-out text


def shingles(text: str, k: int = SHINGLE_TOKENS, token_hashes: dict[str, int] | None = None) -> np.ndarray:
    """Sorted distinct 64-bit hashes of the text's k-token shingles (empty when it has fewer than k tokens).

    ``token_hashes`` memoizes the per-token hash across calls (a plain dict the caller owns).
    """
    memo = {} if token_hashes is None else token_hashes
    hs = []
    for tok in TOKEN.findall(text):
        h = memo.get(tok)
        if h is None:
            h = int.from_bytes(hashlib.blake2b(tok.encode("utf-8"), digest_size=8).digest(), "little")
            memo[tok] = h
        hs.append(h)
    n = len(hs) - k + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    toks = np.array(hs, dtype=np.uint64)
    out = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the hash
        for j in range(k):
            out = out * POLY + toks[j:j + n]
    return np.unique(out)


class ShingleIndex:
    """The shingle sets of a collection of files, searchable by shingle (built once, read-only after)."""

    def __init__(self, docs: Iterable[tuple[str, str]], k: int = SHINGLE_TOKENS) -> None:
        """``docs``: (path, text) pairs, e.g. the training files."""
        self.k = k
        self._token_hashes: dict[str, int] = {}
        paths, sets = [], []
        for path, text in docs:
            paths.append(path)
            sets.append(shingles(text, k, self._token_hashes))
        self.paths: tuple[str, ...] = tuple(paths)
        sizes = np.array([len(s) for s in sets], dtype=np.int64)
        hashes = np.concatenate(sets) if sets else np.zeros(0, dtype=np.uint64)
        owners = np.repeat(np.arange(len(sets), dtype=np.int64), sizes)
        order = np.argsort(hashes, kind="stable")
        self.hashes, self.owners = hashes[order], owners[order]

    def closest(self, text: str) -> Match:
        """The file of the index that contains the largest share of ``text``'s shingles (ties: first path)."""
        q = shingles(text, self.k, self._token_hashes)
        if len(q) == 0 or not self.paths:
            return Match(None, 0.0, 0, len(q))
        lo = np.searchsorted(self.hashes, q, "left")
        hi = np.searchsorted(self.hashes, q, "right")
        hit = hi > lo
        if not hit.any():
            return Match(None, 0.0, 0, len(q))
        owners = np.concatenate([self.owners[a:b] for a, b in zip(lo[hit], hi[hit])])
        shared = np.bincount(owners, minlength=len(self.paths))
        best = int(np.argmax(shared))
        return Match(self.paths[best], float(shared[best]) / len(q), int(shared[best]), len(q))


def train_index(root: str | Path | None = None, rule: NearDupRule = NearDupRule()) -> ShingleIndex:
    """The index of the training files under the stdlib ``root`` (the split rule of :mod:`.data`)."""
    root = Path(root) if root is not None else stdlib_root()
    train, _ = split_paths(list_sources(root))
    docs = ((rel, text) for rel in train if (text := read_source(root, rel)) is not None)
    return ShingleIndex(docs, rule.shingle_tokens)


def is_near_duplicate(match: Match, rule: NearDupRule = NearDupRule()) -> bool:
    return match.containment >= rule.max_containment


def report(root: Path, rule: NearDupRule) -> list[tuple[str, Match]]:
    """Every readable held-out file under ``root`` with its closest training file, most contained first."""
    index = train_index(root, rule)
    _, held = split_paths(list_sources(root))
    rows = [(rel, index.closest(text)) for rel in held if (text := read_source(root, rel)) is not None]
    return sorted(rows, key=lambda r: (-r[1].containment, r[0]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kdtree_engine.train.near_dup",
                                description="held-out stdlib files and their closest training file")
    p.add_argument("--root", default=None, help="stdlib directory (default: this interpreter's)")
    p.add_argument("--shingle-tokens", type=int, default=SHINGLE_TOKENS)
    p.add_argument("--max-containment", type=float, default=MAX_CONTAINMENT)
    args = p.parse_args(argv)
    rule = NearDupRule(args.shingle_tokens, args.max_containment)
    root = Path(args.root) if args.root else stdlib_root()
    rows = report(root, rule)
    print(f"# {root}: {len(rows)} held-out files, shingles of {rule.shingle_tokens} tokens, "
          f"near-duplicate at containment >= {rule.max_containment}")
    print("containment  shingles  test  held-out file -> closest training file")
    for rel, m in rows:
        flag = "  EXCLUDED" if is_near_duplicate(m, rule) else ""
        print(f"{m.containment:11.3f}  {m.shingles:8d}  {'yes' if is_test_path(rel) else 'no ':>4}  "
              f"{rel} -> {m.train_path}{flag}")
    near = [r for r, m in rows if is_near_duplicate(m, rule)]
    print(f"# {len(near)} of {len(rows)} held-out files are near-duplicates "
          f"({sum(not is_test_path(r) for r in near)} outside test directories)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
