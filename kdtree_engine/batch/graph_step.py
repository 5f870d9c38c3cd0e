"""The running requests' rows of a batched step as one forward over static slots, replayed from a CUDA graph.

A host-driven batched forward launches every kernel from Python each step (thousands of launches for a large
model), so at small batches the host, not the GPU, sets the pace. Here a step's running requests (plain steps and
draft trees; prompt chunks stay eager) are laid into ``B`` slots of ``W`` rows each: ``B`` the next power of two
of the requests, ``W`` the widest round's rows rounded up to 1, 2, 3, 5, 9, 17, ... (a budget-b tree has b + 1 rows and
the budgets the load-aware chooser tries are powers of two). Each slot has its own copy of its request's block
table, its committed length on the device and its tree mask. The forward over the ``B * W`` rows is captured once
per (B, W, table width, aux layers) and replayed.

Why a request's rows are those of its solo step, bit for bit: every kernel is batch-invariant (a row's result does
not depend on the rows beside it or on the launch's width), each slot's attention runs over its own cache and mask,
and the padded rows (a slot's rows past its round, every row of an empty slot) see only themselves: no request's
row sees them, their logits are never read, and their latents land past the request's committed length (rewritten
before anything commits them) or in the pool's trash block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..cache import BLOCK, LatentCache, blocks_for
from ..logs import log, log_once
from ..model.context import BatchContext, SlotTensors
from ..model.target import BatchPart, Target, TargetOutput
from ..model.capture import CapturedStep, derived_owners, watched
from ..speculative.graph import capacity_bucket

STEP_MODES = ("eager", "static", "graph")
MAX_SLOTS = 128  # more running requests than this: the step runs eagerly
MAX_BUCKETS = 32  # slot buckets kept (graphs and buffers; each holds its output rows): the least recently used goes


def slot_bucket(n: int) -> int:
    """Slots of a step with n requests: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def width_bucket(rows: int) -> int:
    """Rows of a slot whose widest round has ``rows`` rows: 1, 2, then 1 + a power of two (3, 5, 9, 17, 33, ...)."""
    return rows if rows <= 2 else 1 + (1 << (rows - 2).bit_length())


def padded_rows(requests: int, widest: int) -> int:
    """The rows a captured step of ``requests`` requests, the widest ``widest`` rows, runs."""
    return slot_bucket(requests) * width_bucket(widest)


def resolve_step_mode(mode: str | None, device: torch.device) -> str:
    """``None``: "graph" on CUDA, "eager" elsewhere (logged once). "static" runs the slots without capture (the
    graph's arithmetic on any device: tests)."""
    if mode is None:
        mode = "graph" if device.type == "cuda" else "eager"
        log_once(f"batch-steps:{device.type}:{mode}", f"batched steps on {device.type}: {mode}"
                 + (" (running requests' rows replayed from CUDA graphs per slot bucket)" if mode == "graph" else ""))
    if mode not in STEP_MODES:
        raise ValueError(f"batched step mode must be one of {', '.join(STEP_MODES)}; got {mode!r}")
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"batched step mode 'graph' needs a CUDA device; the target is on {device}")
    return mode


@dataclass(frozen=True)
class SlotKey:
    slots: int
    width: int
    blocks: int          # block table entries of every slot (capacity = blocks * BLOCK)
    aux_layers: tuple[int, ...]


class Slots:
    """The static inputs and outputs of one (B, W, table width, aux) step, and its graph."""

    def __init__(self, target: Target, key: SlotKey, trash: int) -> None:
        dev = target.device
        B, W = key.slots, key.width
        self.target, self.key, self.trash = target, key, trash
        self.ids = torch.zeros(B * W, dtype=torch.long, device=dev)
        self.positions = torch.zeros(B * W, dtype=torch.long, device=dev)
        self.masks = torch.eye(W, dtype=torch.bool, device=dev).repeat(B, 1, 1)   # padded rows: themselves only
        self.starts = torch.zeros(B, dtype=torch.long, device=dev)
        self.tables = torch.full((B, key.blocks), trash, dtype=torch.int32, device=dev)
        self.occupant: list[tuple[LatentCache, int] | None] = [None] * B   # (cache, generation) whose table a slot holds
        self.treed = [False] * B                                 # slots whose mask holds a tree now
        self.logits: torch.Tensor | None = None
        self.aux: torch.Tensor | None = None
        self.captured: CapturedStep | None = None   # made by BatchedSteps when it captures
        # a step's host-made inputs (positions, starts, the parts' rows) go over in one copy from a pinned buffer, so
        # laying out a step never waits for the stream (the next step is queued while this one runs: .ahead); two
        # buffers in turn: a buffer is written again two steps later, when its copy has long run (each step's
        # tokens are read, or its successor's, before then)
        n = 3 * B * W + B + B * W * W   # positions, starts, the parts' rows, the trees' rows, the trees' mask entries
        pinned = dev.type == "cuda"
        self.stage_host = [torch.empty(n, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.stage = torch.empty(n, dtype=torch.long, device=dev)
        self.turn = 0

    def run(self) -> None:
        """The forward over every slot's rows (the captured body)."""
        t, key = self.target, self.key
        W, cap = key.width, key.blocks * BLOCK
        ctxs = tuple(t.static_context(self.tables[i], cap, self.positions[i * W:(i + 1) * W], self.masks[i],
                                      self.starts[i]) for i in range(key.slots))
        whole = SlotTensors(self.tables, self.starts, cap, W)
        x, self.aux = t._layers(t.embed(self.ids), BatchContext.of(ctxs, whole), t.pool(), key.aux_layers)
        self.logits = t.lm_head(x)

    def fill(self, parts: Sequence[BatchPart]) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Lay the parts into the slots (reserving their rows in their caches); returns each part's (first row,
        rows) and those rows on the device, in part order."""
        key, dev = self.key, self.target.device
        B, W = key.slots, key.width
        starts = [0] * B
        positions = torch.arange(W, dtype=torch.long).repeat(B, 1)   # [B, W] host: start + j for untouched rows
        spans, dest = [], []
        trees, tree_rows, mask_at = [], [], []   # the tree parts, their rows, their mask entries
        for i in range(B):
            p = parts[i] if i < len(parts) else None
            cache = None if p is None else p.cache
            held = None if cache is None else (cache, cache.generation)
            if self.occupant[i] != held:   # LatentCache compares by identity
                self.tables[i].fill_(self.trash)
                if cache is not None:
                    n = min(cache.table.numel(), key.blocks)
                    self.tables[i, :n].copy_(cache.table[:n])
                self.occupant[i] = held
            if self.treed[i] and (p is None or p.tree_mask is None):
                self.masks[i].copy_(torch.eye(W, dtype=torch.bool, device=dev))
                self.treed[i] = False
            if p is None:
                continue
            T = p.ids.shape[0]
            start = cache.reserve(T)
            starts[i] = start
            positions[i] += start
            if p.tree_mask is not None:
                trees.append(p)
                tree_rows.extend(range(i * W, i * W + T))
                mask_at.append(i * W * W + self.block_entries(T))
                self.treed[i] = True
            spans.append((i * W, T))
            dest.extend(range(i * W, i * W + T))
        BW, nd, nt = B * W, len(dest), len(tree_rows)
        entries = torch.from_numpy(np.concatenate(mask_at)) if trees else torch.zeros(0, dtype=torch.long)
        ne = entries.numel()
        host = self.stage_host[self.turn]
        self.turn ^= 1
        host[:BW].copy_(positions.reshape(-1))
        host[BW:BW + B].copy_(torch.tensor(starts, dtype=torch.long))
        host[BW + B:BW + B + nd].copy_(torch.tensor(dest, dtype=torch.long))
        at = BW + B + nd
        host[at:at + nt].copy_(torch.tensor(tree_rows, dtype=torch.long))
        host[at + nt:at + nt + ne].copy_(entries)
        self.stage[:at + nt + ne].copy_(host[:at + nt + ne], non_blocking=True)
        self.positions.copy_(self.stage[:BW])
        if trees:   # a tree's nodes sit at their depths, not at start + j; its mask fills its slot's top-left block
            self.positions.index_copy_(0, self.stage[at:at + nt], torch.cat([p.positions for p in trees]))
            self.masks.view(-1).index_copy_(0, self.stage[at + nt:at + nt + ne],
                                            torch.cat([p.tree_mask.reshape(-1) for p in trees]))
        self.starts.copy_(self.stage[BW:BW + B])
        rows = self.stage[BW + B:BW + B + nd]
        self.ids.index_copy_(0, rows, torch.cat([p.ids.to(dev) for p in parts]))
        return spans, rows

    def block_entries(self, T: int) -> np.ndarray:
        """Flat entries of a slot's [W, W] mask holding a T-node tree: its top-left T x T block, row-major."""
        W = self.key.width
        return (np.arange(T)[:, None] * W + np.arange(T)[None, :]).reshape(-1)


class BatchedSteps:
    """The running requests' steps of a :class:`~.scheduler.Scheduler`, one forward over static slots each step
    (``mode`` "graph": replayed from a CUDA graph per slot bucket; "static": the same forward run eagerly)."""

    def __init__(self, target: Target, mode: str) -> None:
        self.target, self.mode = target, mode
        self.slots: OrderedDict[SlotKey, Slots] = OrderedDict()   # least recently used first
        self.pool: Any = None                     # one graph memory pool for every bucket (replayed one at a time)
        self.owners = derived_owners([target])
        self.captures = 0

    def fits(self, parts: Sequence[BatchPart]) -> bool:
        """Parts this forward takes: at most MAX_SLOTS, each a tree or a one-row step, none a prompt chunk."""
        return 0 < len(parts) <= MAX_SLOTS and all(
            p.chunk is None and p.start is None and (p.tree_mask is not None or p.ids.shape[0] == 1) for p in parts)

    def key(self, parts: Sequence[BatchPart], aux_layers: tuple[int, ...]) -> SlotKey:
        W = width_bucket(max(p.ids.shape[0] for p in parts))
        need = max(max(p.cache.capacity for p in parts), max(p.cache.length for p in parts) + W)
        return SlotKey(slot_bucket(len(parts)), W, blocks_for(capacity_bucket(need)), tuple(aux_layers))

    def forward(self, parts: Sequence[BatchPart], aux_layers: tuple[int, ...] = ()) -> list[TargetOutput]:
        """Each part's logits (every row of a tree, the one row of a plain step) and aux rows, as
        :meth:`Target.forward_batch` gives them; plain steps are committed, trees stay pending."""
        if not self.fits(parts):
            raise ValueError("batched steps take 1 to %d parts, each a tree or a one-row step" % MAX_SLOTS)
        target = self.target
        key = self.key(parts, aux_layers)
        slots = self.slots.get(key)
        if slots is None:
            if len(self.slots) >= MAX_BUCKETS:
                old, _ = self.slots.popitem(last=False)
                log.debug("batched steps: dropped the least recently used bucket %s", old)
            slots = self.slots[key] = Slots(target, key, target.pool().trash)
            log.debug("batched steps: slots for %s", key)
        self.slots.move_to_end(key)
        target.rope.ensure(key.blocks * BLOCK + 1)
        spans, index = slots.fill(parts)   # index: the parts' rows (read before the next step's inputs land)
        with torch.no_grad():
            self._run(slots)
        logits = slots.logits.index_select(0, index)   # copies: the next replay rewrites the slots' outputs
        aux = None if slots.aux is None else slots.aux.index_select(0, index)
        outs, row = [], 0
        for p, (_, n) in zip(parts, spans):
            outs.append(TargetOutput(logits=logits[row:row + n], aux=None if aux is None else aux[row:row + n]))
            row += n
            if p.tree_mask is None:
                p.cache.commit_all()
        return outs

    def _run(self, slots: Slots) -> None:
        if self.mode != "graph":
            slots.run()
            return
        if slots.captured is None:
            target, owners = self.target, self.owners
            slots.captured = CapturedStep(slots.run, target.device, lambda: watched(target, owners), "batched step")
        self.pool, captured = slots.captured.replay(self.pool)
        if captured:
            self.captures += 1
            log.info("batched steps: captured %d slots x %d rows (table %d blocks)", slots.key.slots,
                     slots.key.width, slots.key.blocks)

    def release(self) -> None:
        """Drop the graphs and their buffers."""
        self.slots.clear()
