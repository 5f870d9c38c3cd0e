"""Host-driven rounds: the bookkeeping on the host, stage timers, any sampling rule, ``budget="auto"``.

Round (batch 1)::

    drafter(ctx = aux features of the tokens committed last round, block = [bonus, MASK x (B-1)])
      -> draft logits [B-1, V] -> tree (dflash: argmax chain; ddtree: best-first over top-K
      log-probs, ``budget`` non-root nodes) -> one target forward over the tree (ancestor-only mask,
      aux features of the drafter's target layers) -> target picks per node -> accept walk ->
      cache.commit(accepted) -> emit accepted drafts + bonus

"none" runs the root alone as a plain causal step, one token a round. Stage timers (``draft_s``,
``tree_s``, ``verify_s``, ``commit_s``) synchronize the device around each stage. ``budget="auto"``
(ddtree): each round's budget is chosen by :mod:`.budget` from the measured verify cost curve and the
drafter's calibrated acceptance; stats then carry ``budget_chosen`` ({budget: rounds}) and ``budget_auto``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..logs import log, log_once
from ..model.target import Target
from ..sampling import SamplingParams, greedy, make_generator, sample, topk_logprobs
from ..errors import SpecError
from .accept import accept, target_picks
from .budget import AutoBudget, auto_budget_for
from .config import RoundShape
from .stats import RoundStats, Timer
from .tree import DraftTree, build_tree, build_tree_heap, chain_tree

TREE_IMPLS = ("auto", "vectorized", "heap")


def pick_tree_impl(impl: str, device: torch.device) -> str:
    """Which DDTree builder the host-driven rounds run; both return the identical tree. "auto" = "heap": one
    device-to-host copy of the top-K log-probs, then a host heap (the vectorized builder is launch-bound
    on its own; device-resident rounds use the one-launch builder instead)."""
    if impl not in TREE_IMPLS:
        raise SpecError(f"tree builder must be one of {', '.join(TREE_IMPLS)}; got {impl!r}")
    chosen = "heap" if impl == "auto" else impl
    log_once(f"tree:{device.type}:{chosen}", f"DDTree builder on {device.type}: {chosen}")
    return chosen


class HostRounds:
    """One request's host-driven rounds (the :class:`~.decode.Rounds` interface)."""

    mode = "eager"
    ahead = False

    def __init__(self, target: Target, drafter: Any, shape: RoundShape, params: SamplingParams, limit: int,
                 prompt_len: int, tree_impl: str = "auto", prefill_chunk: int | None = None) -> None:
        self.target, self.shape, self.params = target, shape, params
        self.prefill_chunk = prefill_chunk  # None: the target's default chunk (model/prefill.py)
        self.prefill_stats: dict[str, int] = {}
        self.drafter = drafter if shape.drafts else None
        self.impl = pick_tree_impl(tree_impl, target.device) if shape.method == "ddtree" else "vectorized"
        self.limit, self.prompt_len = limit, prompt_len
        self.vocab = getattr(target, "vocab_shard", None)  # tensor parallel: the target's vocabulary slice
        if self.vocab is not None and shape.auto:
            raise SpecError("budget 'auto' times each round on the host, which differs between tensor-parallel "
                            "ranks: give a fixed budget")
        self.gen = make_generator(params.seed, target.device)
        self.timer = Timer(target.device)
        self.stats = RoundStats(shape.block_size)
        self.chooser: AutoBudget | None = None
        if shape.auto:  # the verify cost curve is measured on first use (once per model, device, dtype)
            self.chooser = auto_budget_for(target, block_size=shape.block_size, context=prompt_len + limit // 2,
                                           max_budget=shape.budget)
        self.cache = target.new_cache(prompt_len + limit + shape.max_nodes)
        self.aux_layers = tuple(self.drafter.target_layer_ids) if self.drafter is not None else ()
        self.last: tuple | None = None  # (tree, accept result, draft logits) of the last round that drafted
        self._out: list[int] = []

    def prefill(self, prompt_ids: list[int]) -> int:
        target = self.target
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=target.device)
        out = target.prefill(ids, self.cache, self.aux_layers, chunk=self.prefill_chunk)
        self.prefill_stats = out.stats()
        # [] the newest token, not yet fed to the target
        self.bonus = sample(out.logits[-1], self.params, self.gen, policy=target.policy, vocab=self.vocab)
        if self.drafter is not None:
            S = len(prompt_ids)
            self.dcache = self.drafter.new_cache(S + self.limit + 1)
            self.ctx = out.aux  # [S, K*D] features of the prompt, positions 0..S-1
            self.start = S  # position of the bonus token = committed length
        return int(self.bonus)

    def launch(self, remaining: int) -> None:
        """Run one round; ``remaining`` tokens may still be emitted (drafts past them are never used)."""
        if self.drafter is None:
            self._plain()
        else:
            self._spec(remaining)

    def collect(self) -> list[int]:
        return self._out

    def _plain(self) -> None:
        timer = self.timer
        timer.start()
        logits = self.target(self.bonus.reshape(1), self.cache).logits[-1]
        self.bonus = sample(logits, self.params, self.gen, policy=self.target.policy, vocab=self.vocab)
        self._out = [int(self.bonus)]
        timer.lap("verify_s")
        self.stats.record(1, 0)

    def _spec(self, remaining: int) -> None:
        target, shape, timer, chooser = self.target, self.shape, self.timer, self.chooser
        before = dict(timer.totals) if chooser is not None else None
        timer.start()
        start = self.start
        depth = min(shape.chain, remaining - 1, target.cfg.max_position_embeddings - 1 - start)
        draft_logits = None
        if depth > 0:
            draft_logits = self.drafter.propose(target, self.ctx, self.bonus, self.dcache, start)[:depth]  # [depth, V]
        timer.lap("draft_s")
        tree = self._tree(draft_logits, start)
        timer.lap("tree_s")
        vout = target(tree.tokens, self.cache, positions=tree.positions, tree_mask=tree.mask,
                      aux_layers=self.aux_layers)
        picks = target_picks(vout.logits, self.params, self.gen, policy=target.policy, vocab=self.vocab)  # [N1]
        res = accept(tree, picks)
        timer.lap("verify_s")
        self.cache.commit(res.accepted)
        self.ctx = vout.aux.index_select(0, res.accepted)  # [A, K*D] positions start .. start+A-1
        self._out = torch.cat([tree.tokens.index_select(0, res.accepted[1:]), res.bonus.reshape(1)]).tolist()
        self.bonus = res.bonus
        timer.lap("commit_s")
        A = res.num_accepted
        if chooser is not None:
            dt = {k: timer.totals[k] - before[k] for k in timer.totals}
            chooser.observe(A - 1, dt["draft_s"], dt["tree_s"] + dt["commit_s"], dt["verify_s"])
        self.start += A
        self.stats.record(A, tree.num_nodes - 1)
        if depth > 0 and self.vocab is None:  # the display reads the draft logits of the whole vocabulary
            self.last = (tree, res, draft_logits)

    def _tree(self, draft_logits: torch.Tensor | None, start: int) -> DraftTree:
        bonus, shape = self.bonus, self.shape
        if draft_logits is None:  # no room for drafts: the root alone (a plain step)
            return chain_tree(bonus, torch.empty(0, dtype=torch.long, device=bonus.device), start)
        if shape.method == "dflash":
            return chain_tree(bonus, greedy(draft_logits, policy=self.target.policy, vocab=self.vocab), start)
        builder = build_tree_heap if self.impl == "heap" else build_tree
        if self.chooser is not None:
            # one top-K for the largest budget; the budget-b tree only ever uses ranks < b
            lp, ids = topk_logprobs(draft_logits, self.chooser.max_budget, policy=self.target.policy,
                                    vocab=self.vocab)  # [depth, K]
            budget = self.chooser.choose(lp)
            return builder(lp[:, :budget], ids[:, :budget], budget, bonus, start)
        lp, ids = topk_logprobs(draft_logits, shape.budget, policy=self.target.policy, vocab=self.vocab)  # [depth, K]
        return builder(lp, ids, shape.budget, bonus, start)

    def release(self) -> None:
        """Return the request's latent cache blocks to the target's pool (a test double's cache has no pool)."""
        if hasattr(self.cache, "release"):
            self.cache.release()

    def finish(self, stats: dict[str, Any], decode_s: float) -> None:
        if self.drafter is not None:
            self.dcache.crop(min(self.dcache.length, self.start))
        stats.update(self.timer.totals)
        if self.chooser is not None:
            stats.update(self.chooser.stats())
            log.debug("budget auto: chosen budgets %s (rounds each)", stats["budget_chosen"])
