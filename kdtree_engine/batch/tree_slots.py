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

from typing import Any

import torch

from ..cache import BLOCK, LatentCache, blocks_for
from ..kernels.dispatch import build_draft_tree
from ..logs import log, log_once
from ..model.capture import CapturedStep, derived_owners, watched
from ..model.context import BatchContext, SlotTensors
from ..model.target import Target
from ..sampling import greedy, topk_logprobs
from ..speculative.config import RoundShape
from ..speculative.walks import walk_flat
from .draft_slots import MIN_SLOTS, draft_logits, kept_first, shrunk



class TreeSlots:
    """The device-resident tree rounds of one round shape and capacity (``mode`` "graph" or "static");
    ``keep_logits``: keep the target logits of every emitted token (tests compare them with solo runs)."""

    def __init__(self, target: Target, drafter: Any, shape: RoundShape, capacity: int, mode: str,
                 keep_logits: bool = False) -> None:
        if shape.method not in ("dflash", "ddtree") or shape.auto:
            raise ValueError(f"tree slots take a fixed-budget dflash or ddtree round, not {shape}")
        self.target, self.drafter, self.shape, self.mode = target, drafter, shape, mode
        self.B, self.n1 = shape.block_size, shape.full_nodes
        self.m = min(self.B, self.n1)
        self.blocks = blocks_for(capacity)
        self.capacity = self.blocks * BLOCK             # slots a step's attention addresses (the tables' width)
        self.draft_capacity = self.capacity + self.B    # and a block past them: an empty slot's scratch
        self.aux_layers = tuple(drafter.target_layer_ids)
        self.vocab = getattr(target, "vocab_shard", None)
        self.keep_logits = keep_logits
        self.owners = derived_owners([target, drafter])
        self.captured: CapturedStep | None = None
        self.pool: Any = None
        self.captures = 0
        self.dcaches: list[Any] = []
        self.free: list[int] = []
        self._resize(MIN_SLOTS, [])
        target.rope.ensure(self.capacity + self.n1 + 1)
        log_once(f"tree-slots:{mode}", "batched tree rounds of greedy fixed-budget requests: device-resident over "
                 "static slots" + (", replayed from CUDA graphs" if mode == "graph" else " (run eagerly)"))

    @property
    def slots(self) -> int:
        return len(self.dcaches)

    # ---- slots ------------------------------------------------------------------------------------
    def _resize(self, n: int, keep: list[int]) -> None:
        """``n`` slots, slot j < len(keep) taking slot keep[j]'s state and draft cache, the others free (draft caches
        of slots not kept reused, new ones made for the rest); a new graph."""
        target, dev = self.target, self.target.device
        B, n1 = self.B, self.n1
        feat = len(self.aux_layers) * target.cfg.hidden_size
        idx = torch.tensor(keep, dtype=torch.long, device=dev)

        def moved(name: str, fill: float | bool, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            new = torch.full((n, *shape), fill, dtype=dtype, device=dev)
            old = self.__dict__.get(name)
            if old is not None and keep:
                new[:len(keep)].copy_(old.index_select(0, idx))
            return new
        self.start = moved("start", 0, (), torch.long)
        self.bonus = moved("bonus", 0, (), torch.long)
        self.n_ctx = moved("n_ctx", 0, (), torch.long)
        self.active = moved("active", False, (), torch.bool)
        self.ctx = moved("ctx", 0.0, (B, max(feat, 1)), target.dtype)
        self.tables = moved("tables", target.pool().trash, (self.blocks,), torch.int32)
        self.block_ids = torch.full((n, B), self.drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
        self.result = torch.zeros(n, self.m + 1, dtype=torch.long, device=dev)
        self.kept = (torch.zeros(n, self.m, target.cfg.vocab_size if self.vocab is None else self.vocab.size,
                                 dtype=torch.float32, device=dev) if self.keep_logits else None)
        caches = kept_first(self.dcaches, keep, n)
        self.dcaches = caches + [self.drafter.new_cache(self.draft_capacity) for _ in range(n - len(caches))]
        self.free = list(range(len(keep), n))[::-1]   # the lowest taken first
        # the trees laid end to end: slot i's nodes at i * n1 (the walks' layout)
        self.base = torch.arange(n, device=dev) * n1
        self.tree_of = torch.arange(n, device=dev).repeat_interleave(n1)
        depth = torch.arange(n1, device=dev)
        self.chain_parents, self.chain_depths = (depth - 1).repeat(n), depth.repeat(n)
        self.chain_mask = torch.ones(n1, n1, dtype=torch.bool, device=dev).tril()
        self.captured = None
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
        """Every slot's round: each slot's emitted tokens (an empty slot's are meaningless) and, with
        ``keep_logits``, their target logits [A, V]."""
        with torch.no_grad():
            if self.mode == "graph":
                self._replay()
            else:
                self.run()
        vals = self.result.tolist()   # the step's one read
        tokens = [row[:row[self.m]] for row in vals]
        kept = None if self.kept is None else [self.kept[i, :len(t)].clone() for i, t in enumerate(tokens)]
        return tokens, kept

    def run(self) -> None:
        """The round of every slot, in place (the captured body)."""
        target, drafter, S, B, n1, m = self.target, self.drafter, self.slots, self.B, self.n1, self.m
        policy, budget = target.policy, self.shape.budget
        # draft pass: an empty slot drafts on its scratch block, with no context rows
        d_start = torch.where(self.active, self.start, self.draft_capacity - B)
        d_rows = torch.where(self.active, self.n_ctx, 0)
        self.block_ids[:, 0].copy_(self.bonus)
        drafted = draft_logits(target, drafter, self.ctx, d_rows, self.dcaches, d_start, self.block_ids)
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
            parents, depths = self.chain_parents, self.chain_depths
            positions = (self.start.unsqueeze(1) + depths.view(S, n1)).reshape(-1)
            masks = [self.chain_mask] * S
        # verify: one forward over every slot's tree
        cap = self.capacity
        ctxs = tuple(target.static_context(self.tables[i], cap, positions[i * n1:(i + 1) * n1], masks[i],
                                           self.start[i]) for i in range(S))
        x, aux = target._layers(target.embed(tokens), BatchContext.of(ctxs, SlotTensors(self.tables, self.start, cap,
                                                                                          n1)),
                                target.pool(), self.aux_layers)
        logits = target.lm_head(x)
        picks = greedy(logits, policy=policy, vocab=self.vocab)
        nodes, count, bonus, emitted = walk_flat(tokens, parents, depths, picks, self.base, self.tree_of, n1)
        acc = nodes[:, :m]   # [S, m]: the accepted nodes first (at most B of them), the rest past the new length
        flat_acc = (self.base.unsqueeze(1) + acc).reshape(-1)
        # commit: slot start + j takes the entry of slot start + acc[j], every slot through its own table (one copy)
        j = torch.arange(m, device=acc.device)
        src, dst = self._rows(self.start.unsqueeze(1) + acc), self._rows(self.start.unsqueeze(1) + j)
        # an empty slot copies its (trash) rows onto themselves: rows two of them share get the same value
        dst = torch.where(self.active.repeat_interleave(m), dst, src)
        kv = target.pool().kv
        flat = kv.view(kv.shape[0], -1, kv.shape[-1])
        flat.index_copy_(1, dst, flat.index_select(1, src))
        if self.kept is not None:
            self.kept.copy_(logits.index_select(0, flat_acc).view(S, m, -1))
        self.ctx[:, :m].copy_(aux.index_select(0, flat_acc).view(S, m, -1).to(self.ctx.dtype))
        self.n_ctx.copy_(torch.where(self.active, count, self.n_ctx))
        self.start.add_(torch.where(self.active, count, 0))
        self.bonus.copy_(torch.where(self.active, bonus, self.bonus))
        self.result[:, :m].copy_(emitted[:, :m])
        self.result[:, m].copy_(count)

    def _rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool rows of each slot's cache slots ``slots`` [S, k] through its table row -> [S * k]."""
        return (self.tables.long().gather(1, slots // BLOCK) * BLOCK + slots % BLOCK).reshape(-1)

    def _replay(self) -> None:
        if self.captured is None:
            target, owners = self.target, self.owners
            self.captured = CapturedStep(self.run, target.device, lambda: watched(target, owners), "tree slots",
                                         save=self._save)
        self.pool, captured = self.captured.replay(self.pool)
        if captured:
            self.captures += 1
            log.info("tree slots: captured %d slots of %d nodes (%s), capacity %d", self.slots, self.n1,
                     self.shape.method, self.capacity)

    def _save(self):
        """What a capture's warm-up runs change and undo: the slots' state (their cache writes land past the
        committed lengths, where the next round writes again)."""
        saved = [t.clone() for t in (self.start, self.bonus, self.ctx, self.n_ctx)]

        def restore() -> None:
            for t, s in zip((self.start, self.bonus, self.ctx, self.n_ctx), saved):
                t.copy_(s)
        return restore
