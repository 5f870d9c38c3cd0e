"""Start-up warm-up: the kernel variants a request can launch are compiled before the first request.

Triton compiles a kernel once per set of constexpr values (tiles and blocks chosen from the token count:
kernels/gemm.py's M buckets, the MoE's block and pair buckets) and per specialization of its integer arguments
(a value of 1, a multiple of 16). Row counts that only bound masks are not specialized (``do_not_specialize``
in gemm.py, moe_w4a16.py, moe_frag.py), so what is left depends on the token count T only through its bucket
and through the divisibility by 16 of multiples of T (strides such as T x N): the 2-adic order of T up to 4.
:func:`warmup_lengths` lists prompt lengths that meet every such class below the prefill chunk (every length up
to :data:`DENSE`, then around each power of two and its quarter points the lengths a, a+1, a+2, a+4, a+8,
a+16); longer prompts run as chunks of those lengths. One request of each length runs through the engine's own
request path (prefill, the drafter's context, the first token; with CUDA-graph rounds the round's graph is
captured for its capacity bucket), then one request decodes a few rounds (the verify width of the budget) and
one decodes plainly. Nothing is kept: every request returns its cache blocks to the pool. Last, the objects alive
after start-up are frozen out of Python's garbage collector (``gc.freeze``): a full collection walking the whole
engine took longer than a request's prefill.

What it does not cover: a sampled request (temperature > 0) captures its own round graph on first use, and a
prompt past the largest warmed capacity bucket captures a round graph for its bucket (a capture, no compile).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .cache import BLOCK
from .kernels.loader import compiled_variants
from .logs import log
from .model.prefill import resolve_chunk
from .sampling import SamplingParams

DENSE = 64  # every prompt length up to this one is warmed (the small-T buckets of the kernels lie below it)
ROUND_TOKENS = 24  # tokens decoded by the warm-up's decoding requests: a few rounds of any budget
OFFSETS = (0, 1, 2, 4, 8, 16)  # around an anchor (a multiple of 16): each 2-adic order of T up to 4

# (prompt ids, params, plain) -> the request's result: the engine's own request path (LLM.run)
RunRequest = Callable[[list[int], SamplingParams, bool], Any]


@dataclass(frozen=True)
class WarmUpReport:
    """What the warm-up ran: the prompt lengths, the decoding requests, the kernel variants compiled meanwhile (None
    where Triton's caches are not readable: the CPU) and the seconds it took."""

    lengths: tuple[int, ...]
    decode_requests: int
    compiled: int | None
    seconds: float

    def line(self) -> str:
        compiled = "" if self.compiled is None else f", {self.compiled} kernel variants compiled"
        return (f"warm-up: {len(self.lengths)} prompt lengths (1..{max(self.lengths)}) and {self.decode_requests} "
                f"decoding requests{compiled} in {self.seconds:.2f} s (warm_up=False / --no-warm-up skips it)")


def warmup_lengths(longest: int) -> list[int]:
    """Prompt lengths (ascending, each <= ``longest``) that meet every kernel-variant class of a prompt of 1..longest
    tokens: all of 1..DENSE, then for each power of two p >= DENSE and each anchor a in p, 5p/4, 3p/2, 7p/4 (the
    buckets between powers of two) the lengths a + OFFSETS, and ``longest`` itself."""
    if longest < 1:
        raise ValueError(f"warm-up needs a longest prompt of at least 1 token, got {longest}")
    out = set(range(1, min(DENSE, longest) + 1))
    p = DENSE
    while p <= longest:
        for a in (p, p * 5 // 4, p * 3 // 2, p * 7 // 4):
            out.update(a + d for d in OFFSETS if a + d <= longest)
        p *= 2
    out.add(longest)
    return sorted(out)


def longest_prompt(max_position_embeddings: int, free_tokens: int, chunk: int, round_nodes: int) -> int:
    """The longest warm-up prompt: one prefill chunk, leaving room for the decoding requests' tokens and a round of
    ``round_nodes`` nodes within the positions and half the pool's free tokens (a round's capacity bucket may take up
    to twice the request's tokens)."""
    room = ROUND_TOKENS + 2 * round_nodes + BLOCK
    return max(1, min(chunk, max_position_embeddings - room, free_tokens // 2 - room))


def warm_up(run: RunRequest, *, vocab_size: int, max_position_embeddings: int, free_tokens: int,
            round_nodes: int, device: torch.device, chunk: int | None = None, drafting: bool = True,
            seed: int = 0) -> WarmUpReport:
    """Run the warm-up requests through ``run`` (see the module docstring) and log one INFO line with their count,
    the kernel variants compiled and the seconds. ``round_nodes``: the most nodes a round verifies; ``drafting``:
    the engine drafts (its plain-decoding round is warmed too)."""
    size = resolve_chunk(chunk)
    lengths = warmup_lengths(longest_prompt(max_position_embeddings, free_tokens, size, round_nodes))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (max(lengths),), generator=gen).tolist()
    before = compiled_variants()
    t0 = time.perf_counter()
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    for T in lengths:
        run(ids[:T], first, False)
    rounds = SamplingParams(max_tokens=ROUND_TOKENS, ignore_eos=True)
    run(ids[:DENSE], rounds, False)
    if drafting:
        run(ids[:DENSE], rounds, True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # what start-up made lives as long as the engine: frozen, a full collection does not walk it (one that did
    # took longer than a short prompt's prefill: docs/long_context.md)
    gc.collect()
    gc.freeze()
    after = compiled_variants()
    report = WarmUpReport(lengths=tuple(lengths), decode_requests=2 if drafting else 1,
                          compiled=None if before is None or after is None else after - before,
                          seconds=time.perf_counter() - t0)
    log.info(report.line())
    return report
