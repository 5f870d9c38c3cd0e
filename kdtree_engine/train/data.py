"""Corpus, split rule and tokenizer of the demo model.

Corpus: every ``*.py`` file under the standard library of the interpreter that runs the training
(``sysconfig.get_paths()["stdlib"]``), read as UTF-8 (files that are not valid UTF-8 are skipped
and counted), ``site-packages`` / ``dist-packages`` / ``__pycache__`` excluded. Test directories
(``test``, ``tests``, ``idle_test``) are included when the interpreter ships them: they are real
Python source and roughly double the corpus; some distributions strip them.

Split rule (stable per path, independent of the Python version and of the file set): a file is
held-out iff ``zlib.crc32(relpath.encode("utf-8")) % 20 == 0``, where ``relpath`` is its path
relative to the stdlib directory with ``/`` separators (e.g. ``json/decoder.py``); about 5% of files.

Token stream: each document's ids followed by ``<|endoftext|>``; training samples are random
windows of that stream; held-out evaluation uses consecutive non-overlapping windows.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

HELDOUT_MODULUS = 20
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """The split rule: held-out iff crc32 of the '/'-separated relative path is 0 mod 20."""
    return zlib.crc32(relpath.encode("utf-8")) % HELDOUT_MODULUS == 0


def is_test_path(relpath: str) -> bool:
    return any(part in TEST_DIRS for part in relpath.split("/")[:-1])


def list_sources(root: str | Path, include_tests: bool = True) -> list[str]:
    """Sorted '/'-separated relative paths of the corpus files under ``root``."""
    root = Path(root)
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p in EXCLUDED_DIRS for p in parts[:-1]):
            continue
        if not include_tests and is_test_path(rel):
            continue
        if f.is_file():
            out.append(rel)
    return sorted(out)


def split_paths(relpaths: Iterable[str]) -> tuple[list[str], list[str]]:
    """(train, held-out) by :func:`is_heldout`; order preserved."""
    train, held = [], []
    for p in relpaths:
        (held if is_heldout(p) else train).append(p)
    return train, held


@dataclass
class Corpus:
    root: Path
    train: list[tuple[str, str]]  # (relpath, text)
    heldout: list[tuple[str, str]]
    skipped: list[str] = field(default_factory=list)  # not UTF-8

    def stats(self) -> dict:
        def size(docs: Sequence[tuple[str, str]]) -> int:
            return sum(len(t.encode("utf-8")) for _, t in docs)
        return {"root": str(self.root), "train_files": len(self.train), "heldout_files": len(self.heldout),
                "train_bytes": size(self.train), "heldout_bytes": size(self.heldout),
                "skipped_not_utf8": len(self.skipped)}


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel).read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _capped(paths: list[str], root: Path, max_bytes: int | None) -> tuple[list[tuple[str, str]], list[str]]:
    """Read files; with ``max_bytes``, take them in crc32 order (a fixed shuffle) up to the cap."""
    order = paths if max_bytes is None else sorted(paths, key=lambda p: (zlib.crc32(p.encode("utf-8")), p))
    docs, skipped, total = [], [], 0
    for rel in order:
        text = _read(root, rel)
        if text is None:
            skipped.append(rel)
            continue
        if max_bytes is not None and total >= max_bytes:
            break
        docs.append((rel, text))
        total += len(text.encode("utf-8"))
    if max_bytes is not None:
        docs.sort()
    return docs, skipped


def load_corpus(root: str | Path | None = None, *, include_tests: bool = True,
                max_train_bytes: int | None = None, max_heldout_bytes: int | None = None) -> Corpus:
    root = Path(root) if root is not None else stdlib_root()
    train_paths, held_paths = split_paths(list_sources(root, include_tests))
    train, s1 = _capped(train_paths, root, max_train_bytes)
    held, s2 = _capped(held_paths, root, max_heldout_bytes)
    return Corpus(root=root, train=train, heldout=held, skipped=sorted(s1 + s2))


# ---- tokenizer ---------------------------------------------------------------------------------

def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, *, max_bytes: int | None = 24_000_000):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no normalizer); ids 0/1 = <|endoftext|>/<|mask|>.

    Trained on the texts in the given order until ``max_bytes`` (None: all).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)

    def capped() -> Iterable[str]:
        total = 0
        for t in texts:
            if max_bytes is not None and total >= max_bytes:
                return
            total += len(t)
            yield t

    tok.train_from_iterator(capped(), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def _encode_worker(args: tuple[str, list[str]]) -> list[list[int]]:
    from tokenizers import Tokenizer
    tok_json, texts = args
    tok = Tokenizer.from_str(tok_json)
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def encode_docs(tok, docs: Sequence[tuple[str, str]], workers: int | None = None) -> torch.Tensor:
    """One int64 stream: each document's ids then <|endoftext|> (documents in the given order).

    Large inputs are encoded by ``workers`` forked processes (the tokenizer's own encoding, so ids are
    identical to ``tok.encode``); ``workers`` None = one per CPU, at most 16.
    """
    eos = tok.token_to_id(EOS_TOKEN)
    texts = [t for _, t in docs]
    if workers is None:
        workers = min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    total = sum(len(t) for t in texts)
    if workers <= 1 or total < 2_000_000:
        seqs = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    else:
        # Size-balanced contiguous chunks, several per worker, concatenated back in order.
        n_chunks = workers * 4
        bounds, acc, target = [0], 0, total / n_chunks
        for i, t in enumerate(texts):
            acc += len(t)
            if acc >= target * len(bounds) and i + 1 < len(texts):
                bounds.append(i + 1)
        bounds.append(len(texts))
        tok_json = tok.to_str()
        jobs = [(tok_json, texts[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        with mp.get_context("fork").Pool(workers) as pool:
            seqs = [ids for part in pool.map(_encode_worker, jobs, chunksize=1) for ids in part]
    out: list[int] = []
    for ids in seqs:
        out.extend(ids)
        out.append(eos)
    return torch.tensor(out, dtype=torch.int64)


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] random windows of the token stream (on the generator's device)."""
    hi = stream.numel() - length
    if hi <= 0:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than a window of {length}")
    starts = torch.randint(0, hi + 1, (batch,), generator=gen, device=gen.device)
    idx = starts.unsqueeze(1) + torch.arange(length, device=gen.device)
    return stream.to(gen.device)[idx]


def consecutive_windows(stream: torch.Tensor, length: int, max_windows: int | None = None) -> torch.Tensor:
    """[n, length] non-overlapping windows from the start of the stream (the tail is dropped)."""
    n = stream.numel() // length
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"token stream of {stream.numel()} tokens holds no window of {length}")
    return stream[: n * length].view(n, length)
