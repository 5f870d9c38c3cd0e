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

from dataclasses import dataclass
from typing import Any

import torch

from ..logs import log, log_once
from ..model.target import BatchPart, Target, TargetOutput
from ..sampling import SamplingParams, greedy, make_generator, sample, topk_logprobs
from ..errors import SpecError
from .accept import AcceptResult, target_picks
from .budget import AutoBudget, auto_budget_for
from .config import RoundShape
from .stats import RoundStats, Timer
from .tree import DraftTree, HeapAsk, build_tree, build_trees_heap, chain_tree
from .walks import TreeWalks, commit_walks, walk_trees

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


@dataclass(frozen=True)
class RoundPlan:
    """A round up to the target's forward: the rows to verify, the draft tree (None: a plain step) and the draft
    logits it was built from (None without drafts)."""

    part: BatchPart
    tree: DraftTree | None
    draft_logits: torch.Tensor | None


class HostRounds:
    """One request's host-driven rounds (the :class:`~.decode.Rounds` interface)."""

    mode = "eager"
    ahead = False

    def __init__(self, target: Target, drafter: Any, shape: RoundShape, params: SamplingParams, limit: int,
                 prompt_len: int, tree_impl: str = "auto", prefill_chunk: int | None = None,
                 round_nodes: int | None = None) -> None:
        """``round_nodes``: the widest verify the cache keeps room for past the request (default the shape's
        widest; a batch's load-aware requests keep less and fit their trees to the room left)."""
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
        self.cache = target.new_cache(prompt_len + limit + (shape.max_nodes if round_nodes is None else round_nodes))
        self.aux_layers = tuple(self.drafter.target_layer_ids) if self.drafter is not None else ()
        self.last: tuple | None = None  # (tree, accept result, draft logits) of the last round that drafted
        self.emitted_logits: list[torch.Tensor] | None = None  # a list: keep_logits collects (tests compare runs)
        self.before: dict[str, float] | None = None
        self._out: list[int] = []

    def prefill(self, prompt_ids: list[int]) -> int:
        target = self.target
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=target.device)
        out = target.prefill(ids, self.cache, self.aux_layers, chunk=self.prefill_chunk)
        self.prefill_stats = out.stats()
        return self.start_decoding(out.logits[-1], out.aux, len(prompt_ids))

    def start_decoding(self, logits: torch.Tensor, aux: torch.Tensor | None, prompt_len: int,
                       dcache: Any = None) -> int:
        """After the prompt's forward: the first token from the last prompt token's logits [V], the drafter's context
        (the prompt's aux features [S, K*D]; ``dcache``: the draft cache to fill, None: a new one of the request's
        size). Returns the first token."""
        self.keep_logits(logits.reshape(1, -1))
        # [] the newest token, not yet fed to the target
        self.bonus = sample(logits, self.params, self.gen, policy=self.target.policy, vocab=self.vocab)
        if self.drafter is not None:
            self.dcache = self.drafter.new_cache(prompt_len + self.limit + 1) if dcache is None else dcache
            self.dcache.length = 0
            # the committed tokens' features [n, K*D] not yet fed to the drafter, in pieces (joined once a draft pass,
            # not once a round); first the prompt's, positions 0..S-1
            self.ctx: list[torch.Tensor] = [] if aux is None else [aux]
            self.start = prompt_len  # position of the bonus token = committed length
        return int(self.bonus)

    def keep_logits(self, rows: torch.Tensor) -> None:
        """With ``emitted_logits`` set (a list): keep the target logits [n, V] of the tokens emitted, in order."""
        if self.emitted_logits is not None:
            self.emitted_logits.append(rows)

    def launch(self, remaining: int) -> None:
        """Run one round; ``remaining`` tokens may still be emitted (drafts past them are never used)."""
        plan = self.plan(remaining)
        if plan.tree is not None:
            self.timer.lap("tree_s")
        out = self.target(plan.part.ids, self.cache, positions=plan.part.positions, tree_mask=plan.part.tree_mask,
                          aux_layers=self.aux_layers if plan.tree is not None else ())
        self.absorb(plan, out)

    def collect(self) -> list[int]:
        return self._out

    def plan(self, remaining: int) -> RoundPlan:
        """The round up to the target's forward: the drafter's pass and the tree (timed as draft_s and, by the caller's
        lap, tree_s); ``part``: the rows the target verifies."""
        found = self.draft(remaining)
        if self.drafter is None:  # plain decoding: the newest token alone
            return self.plan_plain()
        return self.plan_tree(found, self.tree_for(found))

    def plan_plain(self) -> RoundPlan:
        """A plain step: the newest token alone, committed by the forward (with a drafter, its aux row extends the
        drafter's context, as a tree of the root alone would, at a plain step's cost)."""
        return RoundPlan(BatchPart(self.bonus.reshape(1), self.cache), None, None)

    def draft(self, remaining: int) -> torch.Tensor | None:
        """Start a round: the drafter's logits [depth, V] for the drafts this round may use (None: plain decoding, or
        no room left for a draft)."""
        ask = self.draft_request(remaining)
        return None if ask is None else self.drafted(self.drafter.propose(self.target, *ask))

    def draft_request(self, remaining: int) -> tuple[torch.Tensor | None, torch.Tensor, Any, int] | None:
        """Start a round: what the drafter's pass takes (context rows, the newest token, the draft cache, its position),
        or None when the round drafts nothing (plain decoding, or no room left for a draft); the caller runs the pass
        (alone or beside other requests' passes) and hands its logits to :meth:`drafted`."""
        self.before = dict(self.timer.totals) if self.chooser is not None else None
        self.timer.start()
        self._depth = 0
        if self.drafter is None:
            return None
        start = self.start
        self._depth = min(self.shape.chain, remaining - 1, self.target.cfg.max_position_embeddings - 1 - start)
        if self._depth <= 0:
            self.timer.lap("draft_s")
            return None
        ctx = None if not self.ctx else self.ctx[0] if len(self.ctx) == 1 else torch.cat(self.ctx)
        return ctx, self.bonus, self.dcache, start

    def drafted(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits [B-1, V] of this round's pass -> those of the drafts the round may use [depth, V]."""
        self.ctx = []  # fed to the drafter: the next round's context starts after it
        self.timer.lap("draft_s")
        return draft_logits[:self._depth]

    def plan_tree(self, draft_logits: torch.Tensor | None, tree: DraftTree) -> RoundPlan:
        """The round of ``tree`` (built from ``draft_logits``): its rows for the target."""
        return RoundPlan(BatchPart(tree.tokens, self.cache, tree.positions, tree.mask), tree, draft_logits)

    def root_only(self) -> DraftTree:
        """A round without drafts: the newest token alone (its aux row still feeds the drafter later)."""
        return chain_tree(self.bonus, torch.empty(0, dtype=torch.long, device=self.bonus.device), self.start)

    def tree_of_budget(self, lp: torch.Tensor, ids: torch.Tensor, budget: int) -> DraftTree:
        """The DDTree of ``budget`` nodes from top-K log-probs / ids [depth, >= budget] (0: the root alone)."""
        return trees_of([self], [(lp, ids, budget)])[0]

    def absorb(self, plan: RoundPlan, vout: TargetOutput, picked: tuple[torch.Tensor, int] | None = None) -> None:
        """The round after the target's forward ``vout`` over ``plan.part``: picks, accept walk, commit, emitted tokens.
        ``picked``: a plain greedy step's token already picked from its logits (device [], host int), as
        :func:`~kdtree_engine.sampling.greedy` picks it (a batch picks all its plain steps in one launch)."""
        target, timer = self.target, self.timer
        if plan.tree is None:
            logits = vout.logits[-1]
            self.keep_logits(vout.logits[-1:])
            if picked is None:
                self.bonus = sample(logits, self.params, self.gen, policy=target.policy, vocab=self.vocab)
                self._out = [int(self.bonus)]
            else:
                self.bonus, self._out = picked[0], [picked[1]]
            timer.lap("verify_s")
            if self.drafter is not None:   # the committed token's features for the next draft pass
                self.ctx.append(vout.aux)
                self.start += 1
            self.stats.record(1, 0)
            return
        walks = walk_trees([plan.tree], self.tree_picks(vout.logits))
        timer.lap("verify_s")
        commit_walks([self.cache], walks)
        self.absorb_walk(plan, vout, walks, 0)

    def tree_picks(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's pick at every node of a verified tree: logits [N1, V] -> [N1] (the request's rule and
        generator)."""
        return target_picks(logits, self.params, self.gen, policy=self.target.policy, vocab=self.vocab)

    def absorb_walk(self, plan: RoundPlan, vout: TargetOutput, walks: TreeWalks, r: int,
                    aux: torch.Tensor | None = None) -> None:
        """A tree round after its walk (``walks``' tree ``r``, as :func:`~.walks.walk_trees` gives it for a batch of
        requests) and the commit of its accepted nodes: the emitted tokens, the drafter's context (``aux``: the
        accepted nodes' aux rows, where the batch took them together), the stats."""
        tree, timer = plan.tree, self.timer
        accepted, bonus = walks.accepted(r), walks.bonus[r]
        if self.emitted_logits is not None:
            self.keep_logits(vout.logits.index_select(0, accepted))
        # positions start .. start+A-1; a round without a draft pass (no room, or skipped under load) leaves its
        # context for the next one
        self.ctx.append(vout.aux.index_select(0, accepted) if aux is None else aux)
        self._out = walks.tokens[r]
        self.bonus = bonus
        timer.lap("commit_s")
        A = walks.counts[r]
        if self.chooser is not None:
            dt = {k: timer.totals[k] - self.before[k] for k in timer.totals}
            self.chooser.observe(A - 1, dt["draft_s"], dt["tree_s"] + dt["commit_s"], dt["verify_s"])
        self.start += A
        self.stats.record(A, tree.num_nodes - 1)
        if plan.draft_logits is not None and self.vocab is None:  # the display reads the whole vocabulary's logits
            self.last = (tree, AcceptResult(accepted, bonus), plan.draft_logits)

    def tree_for(self, draft_logits: torch.Tensor | None) -> DraftTree:
        """This round's tree from the drafter's logits [depth, V] (None: the root alone): the chain, or the DDTree of
        the fixed budget (or the request's own chooser's)."""
        bonus, shape = self.bonus, self.shape
        if draft_logits is None:  # no room for drafts: the root alone (a plain step)
            return self.root_only()
        if shape.method == "dflash":
            return chain_tree(bonus, greedy(draft_logits, policy=self.target.policy, vocab=self.vocab), self.start)
        return self.tree_of_budget(*self.top_of(draft_logits))

    def top_of(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A DDTree round's top-K log-probs and ids [depth, K] and its budget: the fixed one, or the request's own
        chooser's (one top-K for the largest budget: the budget-b tree only ever uses ranks < b)."""
        k = self.chooser.max_budget if self.chooser is not None else self.shape.budget
        lp, ids = topk_logprobs(draft_logits, k, policy=self.target.policy, vocab=self.vocab)  # [depth, K]
        return lp, ids, self.chooser.choose(lp) if self.chooser is not None else self.shape.budget

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


def trees_of(rounds: list[HostRounds], tops: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[DraftTree]:
    """Each request's DDTree from its top-K log-probs, ids and budget (``tops[i]`` for ``rounds[i]``; budget 0: the
    root alone): the host heap's trees all in one pass (:func:`~.tree.build_trees_heap`: one wait on the device for
    the whole batch), the vectorized builder's each on the device."""
    out: list[DraftTree | None] = [None] * len(rounds)
    heap = [k for k, (r, (_, _, b)) in enumerate(zip(rounds, tops)) if b > 0 and r.impl == "heap"]
    asks = [HeapAsk(tops[k][0][:, :tops[k][2]], tops[k][1][:, :tops[k][2]], tops[k][2], rounds[k].bonus,
                    rounds[k].start) for k in heap]
    for k, tree in zip(heap, build_trees_heap(asks)):
        out[k] = tree
    for k, (r, (lp, ids, b)) in enumerate(zip(rounds, tops)):
        if out[k] is None:
            out[k] = r.root_only() if b == 0 else build_tree(lp[:, :b], ids[:, :b], b, r.bonus, r.start)
    return out
