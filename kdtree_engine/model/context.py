"""The per-step data of one target forward, built once per step and read by every layer.

What differs between a prompt step, an eager decode or tree-verify step and a device-resident step
(replayed from a CUDA graph) is data, not code: where the new latents go, what each query may see, and
whether the committed length lives on the host or on the device. The layers have one ``forward`` that
reads this object.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

import torch

from ..kernels.dispatch import prompt_tiles
from .prefill import ChunkStep


@dataclass(frozen=True)
class StepContext:
    """T new tokens of one request over its latent cache.

    positions [T] long; cos / sin [T, R/2] rope tables at those positions; slots [T] long: the cache slots
    of the new latents (start + arange(T)); start: the committed length, a host int (eager step: the
    attention launch is sized on the host) or a [] long device tensor (device-resident step: no host
    read, shapes fixed by T and the cache capacity); tree_mask [T, T] bool ancestor-or-self, None for a
    causal step. A device-resident step also carries what its attention derives from (start, tree_mask)
    in every layer: ``visible`` [T, S_cap] for the torch attention or ``gather_index`` for the Triton one.
    ``chunk``: set on the chunks of a prompt longer than one chunk (:mod:`.prefill`): how MLA attends.
    table [W] int32: the request's block table (cache.py); rows [T] long: the pool rows of ``slots`` (every
    layer's pool viewed as [num_blocks * BLOCK, D]), where the new latents are written; capacity: the request's
    slots (a device-resident step attends over all of them).
    """

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    start: int | torch.Tensor
    tree_mask: torch.Tensor | None
    table: torch.Tensor
    rows: torch.Tensor
    visible: torch.Tensor | None = None
    gather_index: tuple[torch.Tensor, torch.Tensor] | None = None
    chunk: ChunkStep | None = None
    capacity: int = 0

    @property
    def device_resident(self) -> bool:
        """The committed length is on the device: nothing in the step may read it back to the host."""
        return isinstance(self.start, torch.Tensor)

    @property
    def prompt(self) -> bool:
        """A causal step over an empty cache: MLA's naive form (the latents up-projected once)."""
        return not self.device_resident and self.start == 0 and self.tree_mask is None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class SlotTensors:
    """The static slots of a batched step (kdtree_engine/batch/graph_step.py) as whole tensors: tables [B, W_t]
    int32 (slot i's block table, the parts' ``table`` rows), starts [B] long (their committed lengths), every slot
    ``capacity`` slots of cache and ``width`` rows a step. Attention may run over all slots in one launch."""

    tables: torch.Tensor
    starts: torch.Tensor
    capacity: int
    width: int


@dataclass(frozen=True)
class BatchContext:
    """The steps of several requests in one forward (continuous batching, kdtree_engine/batch/): their rows
    concatenated in ``parts`` order. Row-wise work (norms, linears, MoE, the latent write through the
    concatenated pool ``rows``) runs once over all rows; attention runs per part over that request's own
    cache and mask, exactly as its solo step would. ``bounds`` [len(parts) + 1]: each part's first row."""

    parts: tuple[StepContext, ...]
    bounds: tuple[int, ...]
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rows: torch.Tensor
    device_resident: bool = False  # every part's committed length on the device (a capturable batch), or none's
    slots: SlotTensors | None = None   # the parts are static slots, one each, these tensors' rows

    @classmethod
    def of(cls, parts: tuple[StepContext, ...], slots: SlotTensors | None = None) -> "BatchContext":
        kinds = {p.device_resident for p in parts}
        if len(kinds) != 1:
            raise ValueError("a batch's steps are all device-resident or all eager")
        bounds = [0]
        for p in parts:
            bounds.append(bounds[-1] + p.num_tokens)
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        if slots is not None and (len(parts) != slots.tables.shape[0] or bounds[-1] != len(parts) * slots.width):
            raise ValueError(f"{len(parts)} parts of {bounds[-1]} rows are not {slots.tables.shape[0]} slots of "
                             f"{slots.width} rows")
        return cls(parts, tuple(bounds), cat("positions"), cat("cos"), cat("sin"), cat("rows"), kinds.pop(), slots)

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1]

    def spans(self) -> Iterator[tuple[StepContext, int, int]]:
        """(part, first row, end row) of each part."""
        return ((p, a, b) for p, a, b in zip(self.parts, self.bounds, self.bounds[1:]))

    @cached_property
    def prompts(self) -> "PromptRows | None":
        """The whole prompts among the parts (two or more), for one attention launch over all of them in every
        layer (built once a forward); None with fewer."""
        spans = [(a, b) for p, a, b in self.spans() if p.prompt and p.chunk is None]
        if len(spans) < 2:
            return None
        dev = self.rows.device
        index = torch.cat([torch.arange(a, b) for a, b in spans]).to(dev)
        return PromptRows(index, torch.cat([p.rows for p in self.parts if p.prompt and p.chunk is None]),
                          [b - a for a, b in spans],
                          [a for a, _ in spans])


@dataclass(frozen=True)
class PromptRows:
    """The whole prompts of a batch: index [n] their rows in the batch, rows [n] their latents' pool rows (slots 0..),
    lengths and first rows in the batch, in part order."""

    index: torch.Tensor
    rows: torch.Tensor
    lengths: list[int]
    firsts: list[int]

    @cached_property
    def tiles(self) -> torch.Tensor:
        """The prefill kernel's programs over these prompts, made once a forward for every layer."""
        return prompt_tiles(self.lengths, self.index.device)


def static_visibility(start: torch.Tensor, tree_mask: torch.Tensor, capacity: int) -> torch.Tensor:
    """visible [T, S_cap]: slot s is seen by query i when s < start (committed) or s = start + j with
    tree_mask[i, j] (its own block entries). Built on the device from the device-side ``start``."""
    T = tree_mask.shape[0]
    rel = torch.arange(capacity, device=tree_mask.device) - start  # [S_cap]
    in_block = (rel >= 0) & (rel < T)
    cols = tree_mask.index_select(1, rel.clamp(0, T - 1))  # [T, S_cap]
    return (rel < 0).unsqueeze(0) | (in_block.unsqueeze(0) & cols)
