"""Device-resident tree rounds for a batch: the whole round of every slot in one step, replayed from a CUDA graph.

A host-driven tree round in a batch waits for the device three times a step (the draft logits for the trees, the
picks for the walks, the walks for the commit) and launches each piece from Python. Here the greedy requests with a
fixed budget of one round shape (method, budget, block size) share slots whose whole round lives on the device, as a
single request's device rounds do (speculative/device_round.py), for all slots at once:

    draft pass of every slot (the drafter's device-resident pass, row-wise work over all slots' rows)
      -> top-k of every slot's drafts in one launch -> each slot's tree (DDTree: the one-launch builder; DFlash: the
         argmax chain) -> one target forward over all slots' trees (static contexts: each slot's block table,
         committed length and tree mask) -> greedy picks -> the walks of all trees (speculative/walks.walk_flat)
      -> every slot's accepted nodes compacted in its cache in one copy, their aux rows become its next context

and the host reads one tensor a step: each slot's emitted tokens and count. Every shape is fixed by (slots, method,
budget, block size, capacity), so the step is captured once per slot count and replayed ("graph"), or run as is
("static": the same arithmetic on any device). The tree always has the full depth B - 1: drafts past a request's end
are verified and cut by the host's stop rule (its cache holds the widest round past its limit: admission reserves
it). A slot without a request runs too, on its scratch: its block table points at the pool's trash block and its
draft block at the end of its draft cache, and its state does not advance.

Why a request's tokens are its solo run's: its rows are verified by the target's batch-invariant kernels over its
own cache and mask, the emitted tokens are the target's greedy picks along the accepted path, and those depend only
on the tokens before them (its drafts decide how many are accepted a round, not which).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch

from ..cache import BLOCK, LatentCache, blocks_for
from ..kernels.dispatch import build_draft_tree
from ..logs import log, log_once
from ..model.capture import CapturedStep, derived_owners, watched
from ..model.context import BatchContext, SlotTensors
from ..model.target import Target
from ..sampling import greedy, topk_logprobs
from ..speculative.config import RoundShape
from ..speculative.stats import sync
from ..speculative.walks import walk_flat
from .draft_slots import MIN_SLOTS, draft_logits, move_first, shrunk
from .slot_budget import SlotBudget



class TreeSlots:
    """The device-resident tree rounds of one round shape and capacity (``mode`` "graph" or "static");
    ``keep_logits``: keep the target logits of every emitted token (tests compare them with solo runs);
    ``plain_rate(slots)``: a request's tokens per second from plain batched steps outside the slots at that load
    (None: not measured), what a load-aware group's trees must beat (.slot_budget)."""

    def __init__(self, target: Target, drafter: Any, shape: RoundShape, capacity: int, mode: str,
                 keep_logits: bool = False, plain_rate: Callable[[int], float | None] | None = None) -> None:
        if shape.method not in ("dflash", "ddtree"):
            raise ValueError(f"tree slots take a dflash or ddtree round, not {shape}")
        self.target, self.drafter, self.shape, self.mode = target, drafter, shape, mode
        self.B = shape.block_size
        # budget="auto": a budget a step for the whole group (.slot_budget), budget 0 a plain step
        self.chooser = SlotBudget(shape.budget, plain_rate) if shape.auto else None
        self.budgets = self.chooser.budgets if self.chooser else (shape.budget,)
        self.n1_of = {b: replace(shape, budget=b, auto=False).full_nodes if b else 1 for b in self.budgets}
        self.n1 = max(self.n1_of.values())             # the widest round's verify width
        self.m = min(self.B, self.n1)                   # the most tokens a step emits for a slot
        self.last_budget = self.budgets[-1]
        self.plain_steps = 0   # steps in a row where plain steps were the best budget (the scheduler hands over)
        dev = target.device
        # a chain's (and a plain step's) mask, made once outside the captured bodies
        self.chain_masks = {n1: torch.ones(n1, n1, dtype=torch.bool, device=dev).tril() for n1 in self.n1_of.values()}
        self.blocks = blocks_for(capacity)
        self.capacity = self.blocks * BLOCK             # slots a step's attention addresses (the tables' width)
        self.draft_capacity = self.capacity + self.B    # and a block past them: an empty slot's scratch
        self.aux_layers = tuple(drafter.target_layer_ids)
        self.vocab = getattr(target, "vocab_shard", None)
        self.keep_logits = keep_logits
        self.owners = derived_owners([target, drafter])
        self.graphs: dict[tuple[int, int], CapturedStep] = {}   # by (slot count, budget), over the first slots
        self.pool: Any = None
        self.captures = 0
        self.steps_at: dict[int, int] = {}   # steps run at each budget (what a load-aware group chose)
        self.room = 0                                 # slots the buffers hold
        self.buf: dict[str, torch.Tensor] = {}
        self.dcaches: list[Any] = []
        self.n = 0
        self.free: list[int] = []
        self.kept: torch.Tensor | None = None   # a view of buf["kept"] with keep_logits
        self._resize(MIN_SLOTS, [])
        target.rope.ensure(self.capacity + self.n1 + 1)
        log_once(f"tree-slots:{mode}", "batched tree rounds of greedy fixed-budget requests: device-resident over "
                 "static slots" + (", replayed from CUDA graphs" if mode == "graph" else " (run eagerly)"))

    @property
    def slots(self) -> int:
        return self.n

    # ---- slots ------------------------------------------------------------------------------------
    def _grow(self, room: int) -> None:
        """Buffers for ``room`` slots, every slot's state copied in at its index; the graphs over the old buffers are
        dropped (a step over n slots is captured over the first n rows of the buffers: a slot count seen before and
        after a shrink replays its graph, so a burst after a quiet spell captures nothing new)."""
        target, dev, B = self.target, self.target.device, self.B
        feat = max(len(self.aux_layers) * target.cfg.hidden_size, 1)
        vocab = target.cfg.vocab_size if self.vocab is None else self.vocab.size
        specs = {"start": (0, (), torch.long), "bonus": (0, (), torch.long), "n_ctx": (0, (), torch.long),
                 "active": (False, (), torch.bool), "ctx": (0.0, (B, feat), target.dtype),
                 "tables": (target.pool().trash, (self.blocks,), torch.int32),
                 "block_ids": (self.drafter.cfg.mask_token_id, (B,), torch.long),
                 "result": (0, (self.m + 1,), torch.long)}
        if self.keep_logits:
            specs["kept"] = (0.0, (self.m, vocab), torch.float32)
        old = self.buf
        self.buf = {name: torch.full((room, *shape), fill, dtype=dtype, device=dev)
                    for name, (fill, shape, dtype) in specs.items()}
        for name in specs:
            if name in old:
                self.buf[name][:self.room].copy_(old[name])
        self.dcaches += [self.drafter.new_cache(self.draft_capacity) for _ in range(room - self.room)]
        self.room = room
        self.graphs.clear()
        # a new pool for the graphs over the new buffers: a pool whose graphs are all gone cannot take a capture
        # while a tensor made in it lives on (PyTorch's caching allocator asserts)
        self.pool = None

    def _resize(self, n: int, keep: list[int]) -> None:
        """``n`` slots, slot j < len(keep) taking slot keep[j]'s state and draft cache, the others free."""
        if n > self.room:
            self._grow(n)
        if keep != list(range(len(keep))):   # keep is ascending: slot j's source is at j or later, not yet written
            idx = torch.tensor(keep, dtype=torch.long, device=self.target.device)
            for name in ("start", "bonus", "n_ctx", "active", "ctx", "tables"):
                t = self.buf[name]
                t[:len(keep)].copy_(t.index_select(0, idx))
            move_first(self.dcaches, keep)
        rest = slice(len(keep), n)
        for name, fill in (("start", 0), ("n_ctx", 0), ("active", False), ("tables", self.target.pool().trash)):
            self.buf[name][rest].fill_(fill)
        self.n = n
        for name, t in self.buf.items():   # the step's views: the first n slots
            setattr(self, name, t[:n])
        self.free = list(range(len(keep), n))[::-1]   # the lowest taken first
        log.debug("tree slots: %d of capacity %d (%s, budget %d), %d held", n, self.capacity, self.shape.method,
                  self.shape.budget, len(keep))

    def shrink(self) -> dict[int, int]:
        """When at most a quarter of the slots hold requests: halve the slots (down to MIN_SLOTS) until more do, the
        held ones moved to the first slots (a step runs every slot: after a burst, a few requests must not pay for
        many empty ones). Returns {old slot: new slot} of the held ones ({}: nothing changed)."""
        held = sorted(set(range(self.slots)) - set(self.free))
        n = shrunk(self.slots, len(held))
        if n == self.slots:
            return {}
        self._resize(n, held)
        return {old: new for new, old in enumerate(held)}

    def take(self) -> int:
        """A free slot (the slots double when none is)."""
        if not self.free:
            self._resize(2 * self.slots, list(range(self.slots)))
        return self.free.pop()

    def attach(self, i: int, cache: LatentCache, first: torch.Tensor, prompt_aux: torch.Tensor,
               prompt_len: int) -> None:
        """A request after its prompt into slot ``i`` (from :meth:`take`): its state (committed length, first token,
        the last prompt row as context; the other prompt rows go into the slot's draft cache now) and a copy of its
        block table."""
        dcache = self.dcaches[i]
        dcache.length = 0
        self.drafter.append_context(prompt_aux[:prompt_len - 1], dcache)   # positions 0 .. S-2
        self.ctx[i, :1].copy_(prompt_aux[prompt_len - 1:prompt_len])
        self.n_ctx[i] = 1
        self.start[i] = prompt_len
        self.bonus[i].copy_(first.reshape(()))
        self.active[i] = True
        n = min(cache.table.numel(), self.blocks)
        self.tables[i].fill_(self.target.pool().trash)
        self.tables[i, :n].copy_(cache.table[:n])

    def detach(self, i: int) -> None:
        """Slot ``i`` back: its table to the trash block, its state at the start of the cache and frozen (a request's
        last round may leave its length within a round of the capacity: an empty slot's rounds must stay inside)."""
        self.active[i] = False
        self.start[i] = 0
        self.n_ctx[i] = 0
        self.tables[i].fill_(self.target.pool().trash)
        self.free.append(i)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> tuple[list[list[int]], list[torch.Tensor] | None]:
        """Every slot's round at this step's budget (:attr:`last_budget`): each slot's emitted tokens (an empty
        slot's are meaningless) and, with ``keep_logits``, their target logits [A, V]."""
        budget = self.chooser.choose(self.n) if self.chooser else self.budgets[0]
        self.last_budget = budget
        self.steps_at[budget] = self.steps_at.get(budget, 0) + 1
        if self.chooser:   # the step's seconds are its own, not those of work queued before it
            sync(self.target.device)
        t0 = time.perf_counter()
        captured = False
        with torch.no_grad():
            if self.mode == "graph":
                captured = self._replay(budget)
            else:
                self.run(budget)
        vals = self.result.tolist()   # the step's one read
        tokens = [row[:row[self.m]] for row in vals]
        if self.chooser:
            free = set(self.free)
            held = [len(tokens[i]) for i in range(self.n) if i not in free]
            self.chooser.record(budget, self.n, time.perf_counter() - t0, sum(held) / len(held) if held else None,
                                captured)
        kept = None if self.kept is None else [self.kept[i, :len(t)].clone() for i, t in enumerate(tokens)]
        return tokens, kept

    def run(self, budget: int) -> None:
        """The round of every slot at ``budget``, in place (the captured body)."""
        if budget == 0:
            self._run_plain()
            return
        target, drafter, S, B = self.target, self.drafter, self.slots, self.B
        n1 = self.n1_of[budget]
        m = min(B, n1)
        policy, dev = target.policy, target.device
        d_start, d_rows = self._draft_at()
        self.block_ids[:, 0].copy_(self.bonus)
        drafted = draft_logits(target, drafter, self.ctx, d_rows, self.dcaches[:S], d_start, self.block_ids)
        if self.shape.method == "ddtree":
            lp, ids = topk_logprobs(drafted, budget, policy=policy, vocab=self.vocab)
            trees = [build_draft_tree(policy, lp[i * (B - 1):(i + 1) * (B - 1)], ids[i * (B - 1):(i + 1) * (B - 1)],
                                      budget, self.bonus[i], self.start[i]) for i in range(S)]
            tokens = torch.cat([t.tokens for t in trees])
            parents, depths = torch.cat([t.parents for t in trees]), torch.cat([t.depths for t in trees])
            positions, masks = torch.cat([t.positions for t in trees]), [t.mask for t in trees]
        else:
            drafts = greedy(drafted.view(S, B - 1, -1)[:, :n1 - 1].reshape(S * (n1 - 1), -1), policy=policy,
                            vocab=self.vocab).view(S, n1 - 1)
            tokens = torch.cat([self.bonus.unsqueeze(1), drafts], dim=1).reshape(-1)
            depth = torch.arange(n1, device=dev)
            parents, depths = (depth - 1).repeat(S), depth.repeat(S)
            positions = (self.start.unsqueeze(1) + depths.view(S, n1)).reshape(-1)
            masks = [self.chain_masks[n1]] * S
        # verify: one forward over every slot's tree
        logits, aux = self._verify(tokens, positions, masks, n1)
        picks = greedy(logits, policy=policy, vocab=self.vocab)
        # the trees laid end to end: slot i's nodes at i * n1 (the walks' layout)
        base = torch.arange(S, device=dev) * n1
        nodes, count, bonus, emitted = walk_flat(tokens, parents, depths, picks, base,
                                                 torch.arange(S, device=dev).repeat_interleave(n1), n1)
        acc = nodes[:, :m]   # [S, m]: the accepted nodes first (at most B of them), the rest past the new length
        flat_acc = (base.unsqueeze(1) + acc).reshape(-1)
        # commit: slot start + j takes the entry of slot start + acc[j], every slot through its own table (one copy)
        j = torch.arange(m, device=dev)
        src, dst = self._rows(self.start.unsqueeze(1) + acc), self._rows(self.start.unsqueeze(1) + j)
        # an empty slot copies its (trash) rows onto themselves: rows two of them share get the same value
        dst = torch.where(self.active.repeat_interleave(m), dst, src)
        kv = target.pool().kv
        flat = kv.view(kv.shape[0], -1, kv.shape[-1])
        flat.index_copy_(1, dst, flat.index_select(1, src))
        if self.kept is not None:
            self.kept[:, :m].copy_(logits.index_select(0, flat_acc).view(S, m, -1))
        self._advance(aux.index_select(0, flat_acc).view(S, m, -1), count, bonus, emitted[:, :m])

    def _run_plain(self) -> None:
        """Budget 0: every slot's pending context rows into its draft cache (no draft pass), then a plain step: the
        target's pick after the newest token, whose aux row is the next context."""
        target, S = self.target, self.slots
        d_start, d_rows = self._draft_at()
        self.drafter.feed_batch([(self.ctx[i], self.dcaches[i], d_start[i]) for i in range(S)],
                                [d_rows[i] for i in range(S)])
        logits, aux = self._verify(self.bonus, self.start, [self.chain_masks[1]] * S, 1)
        picks = greedy(logits, policy=target.policy, vocab=self.vocab)
        if self.kept is not None:
            self.kept[:, :1].copy_(logits.unsqueeze(1))
        self._advance(aux.unsqueeze(1), torch.ones_like(self.start), picks, picks.unsqueeze(1))

    def _draft_at(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's draft position and new context rows; an empty slot's: its scratch block, no rows."""
        return (torch.where(self.active, self.start, self.draft_capacity - self.B),
                torch.where(self.active, self.n_ctx, 0))

    def _verify(self, tokens: torch.Tensor, positions: torch.Tensor, masks: list[torch.Tensor],
                n1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every slot's n1 nodes (static contexts): logits and aux rows of every node."""
        target, S, cap = self.target, self.slots, self.capacity
        ctxs = tuple(target.static_context(self.tables[i], cap, positions[i * n1:(i + 1) * n1], masks[i],
                                           self.start[i]) for i in range(S))
        x, aux = target._layers(target.embed(tokens), BatchContext.of(ctxs, SlotTensors(self.tables, self.start, cap,
                                                                                          n1)),
                                target.pool(), self.aux_layers)
        return target.lm_head(x), aux

    def _advance(self, aux: torch.Tensor, count: torch.Tensor, bonus: torch.Tensor, emitted: torch.Tensor) -> None:
        """A held slot's state after its round: the accepted nodes' aux rows [S, k] its next context, its length and
        newest token advanced; the round's emitted tokens [S, k] and count for the host."""
        k = aux.shape[1]
        self.ctx[:, :k].copy_(aux.to(self.ctx.dtype))
        self.n_ctx.copy_(torch.where(self.active, count, self.n_ctx))
        self.start.add_(torch.where(self.active, count, 0))
        self.bonus.copy_(torch.where(self.active, bonus, self.bonus))
        self.result[:, :k].copy_(emitted)
        self.result[:, self.m].copy_(count)

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool rows of each slot's cache slots ``slots`` [S, k] through its table row -> [S * k]."""
        return (self.tables.long().gather(1, slots // BLOCK) * BLOCK + slots % BLOCK).reshape(-1)

    def _replay(self, budget: int) -> bool:
        """Replays the step of this slot count and budget (captured on first use); whether it captured."""
        key = (self.n, budget)
        step = self.graphs.get(key)
        if step is None:
            target, owners = self.target, self.owners
            step = self.graphs[key] = CapturedStep(lambda: self.run(budget), target.device,
                                                   lambda: watched(target, owners), "tree slots", save=self._save)
        self.pool, captured = step.replay(self.pool)
        if captured:
            self.captures += 1
            log.info("tree slots: captured %d slots of %d nodes (%s, budget %d), capacity %d", self.n,
                     self.n1_of[budget], self.shape.method, budget, self.capacity)
        return captured

    def _save(self):
        """What a capture's warm-up runs change and undo: the slots' state (their cache writes land past the
        committed lengths, where the next round writes again)."""
        saved = [t.clone() for t in (self.start, self.bonus, self.ctx, self.n_ctx)]

        def restore() -> None:
            for t, s in zip((self.start, self.bonus, self.ctx, self.n_ctx), saved):
                t.copy_(s)
        return restore
