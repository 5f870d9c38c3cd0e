"""One decoding round with every piece of bookkeeping on the device (greedy or sampled).

    draft (drafter over the cached context + the block [bonus, MASK x (B-1)])
      -> tree (dflash: argmax chain; ddtree: the best-first builder in one launch (kernels/tree_ops.py)
         on CUDA, the vectorized torch builder on the CPU; none: the root alone)
      -> verify (one target step over the tree, whole-cache attention with a device-side mask)
      -> accept (CUDA: the walk and its bookkeeping in one program, kernels/accept_walk.py; CPU: the
         vectorized torch walk of speculative/walks.py: accepted nodes, emitted tokens, bonus)
      -> commit (KV compaction by device indices, none for a lone root; the drafter's context rows
         gathered by device indices) -> emitted tokens + count

The chains of "none" (the root alone: views of ``bonus`` and ``start``) and "dflash" live in static buffers
(parents, depths and mask fixed; tokens and positions rewritten per round).

The round reads and writes only tensors it owns (``start``, ``bonus``, ``ctx``, ``n_ctx``, the two
caches, ``result``); nothing is read back to the host and every shape is fixed by (method, budget,
block size, capacity). So :meth:`DeviceRound.step` can be captured once in a CUDA graph and replayed
(:mod:`.graph`), or run as is (eager, the same kernels). The host reads ``result`` once per round:
``result[:A]`` are the emitted tokens (accepted drafts then the bonus), ``result[-1]`` = A.

Fixed shapes: the tree always has the full depth B - 1 (drafts past the request's end are verified and
then cut by the host's stop rule, which never changes the tokens before the cut); ``M = min(B, N1)``
rows are compacted and gathered every round, the ones past A land past the new committed length where
no query looks and the next round overwrites them. Capacity must hold start + max(N1, B) slots.

Sampling (temperature > 0): the target's pick at every node is the exponential race
argmax_i p_i / E_i (:func:`kdtree_engine.sampling.race`) over a noise buffer [N1, V] that
:meth:`DeviceRound.draw` refills from the request's generator before each round, outside any graph;
the accept walk is the same as for greedy picks, so the output has the target's distribution. The
rule's temperature and top-p are device scalars set per request (a round serves any of their values);
top-k and whether a nucleus is cut at all set shapes and are part of the round.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..kernels.common import take_rows
from ..kernels.dispatch import accept_backend, accept_walk, build_draft_tree
from ..model.target import Target
from ..sampling import SamplingParams, greedy, race_rule, sample, topk_logprobs
from .config import RoundShape
from .tree import DraftTree, chain_tree
from .walks import walk_flat

DEVICE_ROUND_METHODS = ("none", "dflash", "ddtree")


class DeviceRound:
    """State and step of device-resident rounds for one (target, drafter, round shape, capacity)."""

    def __init__(self, target: Target, drafter: Any, shape: RoundShape, capacity: int,
                 sampling: SamplingParams | None = None) -> None:
        method = shape.method
        if method not in DEVICE_ROUND_METHODS:
            raise ValueError(f"method must be one of {DEVICE_ROUND_METHODS}, got {method!r}")
        if shape.auto:
            raise ValueError("device-resident rounds take a fixed budget, not 'auto'")
        if method != "none" and drafter is None:
            raise ValueError(f"method {method!r} needs a drafter")
        self.target, self.method, self.shape = target, method, shape
        self.drafter = drafter if method != "none" else None
        dev = target.device
        self.B = shape.block_size
        self.budget = shape.budget  # ddtree: the tree's budget; dflash: the chain's length
        self.n1 = shape.full_nodes
        self.m = min(self.B, self.n1)
        self.capacity = capacity
        self.aux_layers = tuple(self.drafter.target_layer_ids) if self.drafter is not None else ()
        self.cache = target.new_cache(capacity)
        self.vocab = getattr(target, "vocab_shard", None)  # tensor parallel: the target's vocabulary slice
        self.dcache = self.drafter.new_cache(capacity) if self.drafter is not None else None
        # rope tables sized once for good: a captured graph reads them in place
        target.rope.ensure(max(capacity + self.n1, target.cfg.max_position_embeddings + self.B))
        feat = len(self.aux_layers) * target.cfg.hidden_size
        # ---- state (updated in place by step) ----
        self.start = torch.zeros((), dtype=torch.long, device=dev)  # committed length = bonus position
        self.bonus = torch.zeros((), dtype=torch.long, device=dev)  # newest token, not yet in the cache
        self.ctx = torch.zeros((self.B, max(feat, 1)), dtype=target.dtype, device=dev)  # drafter context rows
        self.n_ctx = torch.zeros((), dtype=torch.long, device=dev)  # valid rows of ctx
        self.block = (torch.full((self.B,), self.drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
                      if self.drafter is not None else None)  # the drafter's block; entry 0 = the bonus
        self.result = torch.zeros((self.m + 1,), dtype=torch.long, device=dev)  # emitted [M] + count
        # sampling: top-k and nucleus on/off are part of the round; temperature / top-p values and the
        # noise [N1, V] are device buffers refilled per request / per round
        self.sampling = sampling is not None and not sampling.greedy
        self.top_k = sampling.top_k if self.sampling else 0
        self.temperature = torch.ones((), dtype=torch.float32, device=dev) if self.sampling else None
        self.top_p = (torch.ones((), dtype=torch.float32, device=dev)
                      if self.sampling and sampling.top_p < 1.0 else None)
        self.noise = (torch.ones((self.n1, target.cfg.vocab_size), dtype=torch.float32, device=dev)
                      if self.sampling else None)
        # the chain of "none" / "dflash": static parents, depths and mask; tokens and positions rewritten per
        # round (the root alone: views of bonus and start)
        self.chain = None
        if method != "ddtree":
            self.chain = chain_tree(self.bonus, torch.zeros(self.n1 - 1, dtype=torch.long, device=dev), 0)
            if self.n1 == 1:
                self.chain = dataclasses.replace(self.chain, tokens=self.bonus.reshape(1),
                                                 positions=self.start.reshape(1))
        self.acc = torch.zeros((self.m,), dtype=torch.long, device=dev)  # accepted nodes, root first
        # the torch walk's layout of its one tree (speculative/walks.walk_flat)
        self.base = torch.zeros(1, dtype=torch.long, device=dev)
        self.tree_of = torch.zeros(self.n1, dtype=torch.long, device=dev)
        self.prefill_stats: dict[str, int] = {}  # the last prefill's chunks and peak memory

    def draw(self, generator: torch.Generator | None) -> None:
        """Fresh Exp(1) noise for the next round's picks (sampling only; outside the captured step)."""
        if self.noise is not None:
            self.noise.exponential_(generator=generator)

    # ---- host side, between requests ----------------------------------------------------------
    def max_length(self) -> int:
        """Largest committed length at which a round still fits the capacity."""
        return self.capacity - max(self.n1, self.B)

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int], params: SamplingParams | None = None,
                generator: torch.Generator | None = None, chunk: int | None = None) -> torch.Tensor:
        """Eager prompt forward (:meth:`Target.prefill`, in chunks of ``chunk`` tokens) into this round's
        caches; sets the state (and, when the round samples, the rule's temperature / top-p from ``params``)
        and ``prefill_stats``. Returns the first token [] (sampled with ``generator`` when the round samples)."""
        S = len(prompt_ids)
        if S > self.max_length():
            raise ValueError(f"prompt of {S} tokens does not fit a round buffer of capacity {self.capacity}")
        if self.sampling and (params is None or params.greedy or params.top_k != self.top_k
                              or (params.top_p < 1.0) != (self.top_p is not None)):
            raise ValueError(f"this round samples with top_k={self.top_k}, nucleus {self.top_p is not None}; "
                             f"got {params}")
        target = self.target
        self.cache.crop(0)
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=target.device)
        out = target.prefill(ids, self.cache, self.aux_layers, chunk=chunk)
        self.prefill_stats = out.stats()
        if self.sampling:
            self.temperature.fill_(float(params.temperature))
            if self.top_p is not None:
                self.top_p.fill_(float(params.top_p))
            first = sample(out.logits[-1], params, generator, policy=target.policy, vocab=self.vocab)
        else:
            first = greedy(out.logits[-1], policy=target.policy, vocab=self.vocab)
        self.start.fill_(S)
        self.bonus.copy_(first)
        if self.drafter is not None:
            self.dcache.crop(0)
            self.drafter.append_context(out.aux[: S - 1], self.dcache)  # positions 0 .. S-2
            self.ctx[:1].copy_(out.aux[S - 1:S])  # position S-1, fed by the first round
            self.n_ctx.fill_(1)
        return first

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in (self.start, self.bonus, self.ctx, self.n_ctx))

    def restore(self, saved: tuple[torch.Tensor, ...]) -> None:
        for t, s in zip((self.start, self.bonus, self.ctx, self.n_ctx), saved):
            t.copy_(s)

    # ---- the round (device only) ----------------------------------------------------------------
    def make_tree(self) -> DraftTree:
        if self.drafter is None:
            return self.chain  # the root alone: views of bonus and start
        self.block[:1].copy_(self.bonus.reshape(1))  # [bonus, MASK x (B-1)]
        h = self.drafter(self.ctx, self.target.embed(self.block), self.dcache, self.start, self.n_ctx)
        draft_logits = self.target.lm_head(h[1:])  # [B-1, V]
        if self.method == "dflash":
            chain = self.chain
            chain.tokens[:1].copy_(self.bonus.reshape(1))
            chain.tokens[1:].copy_(greedy(draft_logits[: self.budget], policy=self.target.policy,
                                                 vocab=self.vocab))
            torch.add(chain.depths, self.start, out=chain.positions)
            return chain
        lp, ids = topk_logprobs(draft_logits, self.budget, policy=self.target.policy, vocab=self.vocab)  # [B-1, K]
        return build_draft_tree(self.target.policy, lp, ids, self.budget, self.bonus, self.start)

    @torch.no_grad()
    def step(self) -> None:
        """One round, in place. Host-read free; capturable."""
        tree = self.make_tree()
        vout = self.target(tree.tokens, self.cache, tree.positions, tree.mask, self.aux_layers, start=self.start)
        picks = (race_rule(vout.logits, self.temperature, self.top_k, self.top_p, self.noise, self.vocab)
                 if self.sampling else greedy(vout.logits, policy=self.target.policy, vocab=self.vocab))  # [N1]
        acc, count = self.accept(tree, picks)  # [M], [] = A; result and bonus written
        if self.n1 > 1:  # a lone root keeps its slot
            self.cache.compact_static(self.start, acc)
        if self.drafter is not None:
            self.ctx[: self.m].copy_(take_rows(vout.aux, acc))
            self.n_ctx.copy_(count)
        self.start.add_(count)

    def accept(self, tree: DraftTree, picks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The walk: writes ``result`` (emitted tokens + count) and ``bonus``; returns (accepted nodes [M],
        count []). CUDA: one launch (kernels/accept_walk.py); CPU: the vectorized torch walk."""
        if accept_backend(self.target.policy, picks.device) == "triton":
            accept_walk(tree.tokens, tree.parents, picks, self.m, self.B - 1, self.acc, self.result, self.bonus)
            return self.acc, self.result[self.m]
        nodes, count, bonus, emitted = walk_flat(tree.tokens, tree.parents, tree.depths, picks, self.base,
                                                 self.tree_of, self.n1)   # one tree: [1, N1], [1], [1], [1, N1]
        self.result[: self.m].copy_(emitted[0, : self.m])
        self.result[self.m:].copy_(count)
        self.bonus.copy_(bonus.reshape(()))
        return nodes[0, : self.m], count.reshape(())
