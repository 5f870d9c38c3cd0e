"""A short prompt's forward replayed from a CUDA graph per length bucket (time to first token).

A prompt of a few hundred tokens is launch-bound: its eager forward costs the Python launches of every layer, far
more than the GPU's work. Prompts of at most :data:`MAX_BUCKET` tokens into an empty cache take the smallest bucket
B >= T (powers of two from :data:`MIN_BUCKET`): their ids are copied into the bucket's static buffer (zeros after
them), the request's block table into the bucket's table (the pool's trash block past the request's blocks), and
the bucket's captured forward (MLA's naive form, the drafter's aux layers, the final norm, the lm_head of the last
real row picked on the device) is replayed. The padded rows come after the real ones, so no real query sees them
(causal attention), and every other kernel is batch-invariant: the real rows' logits and aux rows are those of the
eager forward bit for bit (``tests/gpu/test_prompt_graph_gpu.py``). Longer prompts, and prompts after a committed
prefix, run eagerly. On the CPU the same buffers run without capture (``capture=False``: tests).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import BLOCK, LatentCache, blocks_for
from ..kernels.common import take_rows
from ..kernels.paged import page_rows
from ..logs import log
from .capture import CapturedStep, derived_owners, watched
from .context import StepContext

MIN_BUCKET = 16
MAX_BUCKET = 512  # longer prompts are compute-bound: a graph saves them little and would hold their activations


def bucket_of(tokens: int) -> int:
    """The bucket of a prompt of ``tokens`` tokens: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(tokens - 1, 0).bit_length())


class PromptBucket:
    """The static buffers of one (bucket, aux layers) prompt step, its body and its graph."""

    def __init__(self, target: Any, B: int, aux_layers: tuple[int, ...]) -> None:
        dev = target.device
        self.target, self.B, self.aux_layers = target, B, aux_layers
        self.ids = torch.zeros(B, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)   # the last real row
        self.positions = torch.arange(B, device=dev)
        # a prompt's positions are 0..B-1 whatever it holds: their rope rows copied once, so the graph reads no rope
        # table (a longer round grows and moves the tables; a row's bits do not change with the table's size)
        self.cos, self.sin = target.rope.tables(self.positions)
        self.table = torch.full((blocks_for(B),), target.pool().trash, dtype=torch.int32, device=dev)
        self.captured: CapturedStep | None = None   # made by PromptGraphs when it captures
        self.logits: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None

    def body(self) -> None:
        t, pos = self.target, self.positions
        ctx = StepContext(pos, self.cos, self.sin, pos, 0, None, self.table, page_rows(self.table, pos, BLOCK))
        x, self.aux = t._layers(t.embed(self.ids), ctx, t.pool(), self.aux_layers)
        self.logits = t.lm_head(take_rows(x, self.last))

    def fill(self, ids: torch.Tensor, cache: LatentCache) -> None:
        T = ids.shape[0]
        self.ids.zero_()
        self.ids[:T].copy_(ids)
        self.last.fill_(T - 1)
        n = min(cache.table.numel(), self.table.numel())
        self.table.fill_(self.target.pool().trash)
        self.table[:n].copy_(cache.table[:n])


class PromptGraphs:
    """The prompt steps of one target, per (bucket, aux layers); ``capture``: replay from CUDA graphs (else run the
    same buffers eagerly)."""

    def __init__(self, target: Any, capture: bool) -> None:
        if capture and target.device.type != "cuda":
            raise ValueError(f"prompt graphs need a CUDA device; the target is on {target.device}")
        self.target, self.capture = target, capture
        self.buckets: dict[tuple[int, tuple[int, ...]], PromptBucket] = {}
        self.pool: Any = None   # one graph memory pool for every bucket (replayed one at a time)
        self.owners = derived_owners([target]) if capture else []

    def takes(self, tokens: int, cache: LatentCache) -> bool:
        """A prompt this path runs: 1..MAX_BUCKET tokens into an empty cache."""
        return 0 < tokens <= MAX_BUCKET and cache.length == 0

    @torch.no_grad()
    def run(self, ids: torch.Tensor, cache: LatentCache, aux_layers: tuple[int, ...]
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The prompt ids [T] into the empty ``cache`` (committed) -> (the last token's logits [1, V], the aux rows
        [T, K] or None), as the eager forward gives them."""
        T = ids.shape[0]
        if not self.takes(T, cache):
            raise ValueError(f"a prompt graph takes 1..{MAX_BUCKET} tokens into an empty cache; got {T} tokens "
                             f"after {cache.length}")
        t = self.target
        B = bucket_of(T)
        step = self.buckets.get((B, aux_layers))
        if step is None:
            step = self.buckets[(B, aux_layers)] = PromptBucket(t, B, aux_layers)
        cache.reserve(T)
        step.fill(ids.to(t.device), cache)
        if not self.capture:
            step.body()
        else:
            if step.captured is None:
                owners = self.owners
                step.captured = CapturedStep(step.body, t.device, lambda: watched(t, owners, rope=False), "prompt")
            self.pool, captured = step.captured.replay(self.pool)
            if captured:
                log.debug("captured the prompt step of bucket %d", B)
        cache.commit_all()
        # copies: the next replay rewrites the bucket's outputs
        return step.logits.clone(), None if step.aux is None else step.aux[:T].clone()
