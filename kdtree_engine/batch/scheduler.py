"""Continuous batching: many requests share each target forward, each one's tokens those of its solo run.

Every :meth:`Scheduler.step` is one round boundary and one batched forward (:meth:`Target.forward_batch`; on CUDA
the running requests' rows replay from a CUDA graph per slot bucket, the prompt chunks beside them: .graph_step):

1. requests cancelled since the last step end ("abort") and give their cache blocks back;
2. waiting requests are admitted in arrival order while the pool has the blocks of their whole context (prompt,
   generation limit and the widest verify); the first that does not fit waits, and those behind it wait too (no
   request is overtaken, so none starves). A request that could never fit, even in an empty pool, is refused at
   submit with a PromptError;
3. the forward's rows: every running request's round (its newest token, or its draft tree, root first), then the
   next prompt chunk of requests still in prefill, in arrival order, while the rows stay within ``token_budget``
   (a chunk always runs when nothing else does, so a prompt longer than the budget still advances);
4. after the forward each request takes its own rows: picks, accept walk, commit, stop rule; a request that ends
   gives its blocks back before the next step.

Why each request's output equals its solo run: its rows enter the same row-wise kernels (batch-invariant on the GPU:
a row's result does not depend on the rows beside it), its attention runs over its own cache and mask with the
same shapes as alone (:class:`~kdtree_engine.model.context.BatchContext`), its prompt is cut into the chunks its solo
prefill would run, and its sampling draws from its own generator (its seed). The drafter runs per request.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from ..cache import BLOCK, blocks_for
from ..errors import SpecError
from ..kernels.dispatch import prefill_kernel_on
from ..logs import log, log_once
from ..model.prefill import ChunkStep, choose_form, plan_chunks, resolve_chunk
from ..model.target import BatchPart, Target, TargetOutput
from ..sampling import SamplingParams, greedy, topk_logprobs
from ..speculative.budget import (SCALE_MAX, AcceptanceCalibration, RecentMedian, RunningMean,
                                  expected_accepted_by_budget, verify_cost_for)
from ..speculative.config import resolve_spec
from ..speculative.graph import capacity_bucket
from ..speculative.decode import Emitter, GenerationResult, OnTokens, context_limit, round_shape
from ..speculative.host_rounds import HostRounds, RoundPlan, trees_of
from ..speculative.walks import TreeWalks, commit_walks, walk_trees
from ..speculative.stats import Timer, sync
from .ahead import StepsAhead, steady
from .draft_slots import DraftSlots
from .tree_slots import TreeSlots
from .graph_step import MAX_SLOTS, BatchedSteps, padded_rows, resolve_step_mode, slot_bucket
from .load_budget import allocate_budgets
from .slot_budget import LADDER
from .sequence import DONE, PREFILL, RUNNING, Sequence

DEFAULT_TOKEN_BUDGET = 2048  # rows of one batched forward (decode / verify rows first, then prompt chunks)
PROBE_SHARE = 0.05  # load-aware budgets: a draft pass that did not pay is spread over enough plain rounds that it
# costs at most this share of them, and each further one that does not pay doubles the gap (the probes' share of
# the time halves each time: over a long run, speculation that never pays costs next to nothing)...
MAX_PROBE_GAP = 1024  # ...up to this many plain rounds before the batch drafts again
FORWARD_SCALE_MIN = 0.01  # observed / curve seconds of a forward: replayed batched steps reach a few percent
PROMPT_GRAPHS_PER_STEP = 8  # whole short prompts of one step replayed one by one; more run as one forward
COST_ROWS = 1024  # the verify cost curve is measured up to this many rows, extended linearly past it
# load-aware requests in tree slots go to host-driven rounds after this many steps in a row where plain steps were
# the best of every budget measured at the group's slot count
HAND_OVER_AFTER = 8
TIME_EVERY = 16  # load-aware budgets: one forward in this many is timed (each timing stalls the host on the device)


class Scheduler:
    """The continuous batch of one target (and its drafter, shared by the requests that draft).

    ``token_budget``: the most rows of one forward; ``prefill_chunk``: the prompt chunk size (None: the target's
    default; the same for every request, so each prompt is cut as its solo prefill cuts it); ``tree_impl``: the
    DDTree builder of host-driven rounds; ``keep_logits``: keep the target logits of every emitted token
    (``Sequence.rounds.emitted_logits``, for comparing runs); ``step_mode``: how the running requests' rows run
    (:mod:`.graph_step`: "graph" replays them from CUDA graphs per slot bucket, the CUDA default; "eager" beside
    the prompt chunks in one host-driven forward, the default elsewhere; "static": the graph's slots run eagerly);
    ``auto_slots``: greedy load-aware requests run in tree slots at their group's budget (.slot_budget) rather than
    in host-driven rounds (an option while it is slower than the default on the demo's GPU records)."""

    def __init__(self, target: Target, drafter: Any = None, *, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 prefill_chunk: int | None = None, tree_impl: str = "auto", keep_logits: bool = False,
                 step_mode: str | None = None, auto_slots: bool = False) -> None:
        if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
            raise SpecError(f"token_budget={token_budget!r} must be a positive number of rows per forward")
        self.target, self.drafter = target, drafter
        self.token_budget = token_budget
        self.chunk = resolve_chunk(prefill_chunk)
        self.prefill_chunk = prefill_chunk
        self.tree_impl = tree_impl
        self.keep_logits = keep_logits
        self.auto_slots = auto_slots
        self.pool = target.pool()
        mode = resolve_step_mode(step_mode, target.device)
        self.steps = None if mode == "eager" else BatchedSteps(target, mode)
        # plain greedy steps queued one ahead of the host's read of their tokens (static steps only: .ahead)
        self.ahead = None if self.steps is None else StepsAhead(target.device, MAX_SLOTS)
        # the drafting requests' passes over static slots (graphs with the static steps): a drafter that batches;
        # greedy fixed-budget trees then run whole rounds on the device, a group of slots per round shape (.tree_slots)
        slots = self.steps is not None and hasattr(drafter, "forward_batch")
        self.draft_slots = DraftSlots(target, drafter, mode) if slots else None
        self.tree_slots: dict[tuple, TreeSlots] | None = {} if slots else None
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []   # prefill and running, in admission order
        self._ids = 0
        self.forwards = 0
        self.rows_run = 0
        self._cost = None  # the verify cost curve of load-aware budgets, measured on first use
        self._plan_s: tuple[float, int] | None = None  # this step's tree planning: (host seconds, requests planned)
        # seconds of one request's draft pass, measured each step that drafts (not the first: it compiles kernels); a
        # recent median: a slow pass (a new shape's compile) must not price drafting out for good, since a request
        # that stops drafting stops measuring
        self.draft_s = RecentMedian(warmup=1)
        # host seconds a load-aware request's tree adds to a step: its top-k, expected gains and tree, and the walk
        # of its verified tree (host-driven rounds: on a slow host these outgrow the draft pass); not the first step's
        self.tree_host_s = RecentMedian(warmup=1)
        # seconds of one request's probe pass (its first after plain rounds): what spacing the probes weighs
        self.probe_s = RecentMedian(warmup=1)
        # observed / curve seconds of the batch's forwards: the curve is one request's, a batch launches more
        self.forward_scale = RunningMean(0.1, prior=1.0, prior_weight=1)
        self.step_s = RunningMean(0.1)  # a request's share of a forward's seconds (what a plain round costs it)
        # seconds of a forward of the running requests alone, by the rows it runs (padded rows with static steps): what
        # a step of that shape really costs, where the curve (an eager forward's) scaled by one factor would misjudge
        # a replayed plain step against a replayed tree; a shape's first forward (its capture) is not a sample
        self.observed: dict[int, RunningMean] = {}
        # the gap the last draft pass that did not pay was given (0 after one that paid): a new load-aware request
        # starts with it, so it does not pay a pass of its own to learn what the batch already knows
        self.verdict_gap = 0
        self.verdict_at = 0   # the forward that verdict was given at: the batch's next probe is due gap forwards on
        # observed / predicted accepted drafts over every load-aware request's trees: a new request starts from it
        # (the drafter's own estimates may be far off on this batch's prompts; each request then learns its own)
        self.calibration = AcceptanceCalibration()
        # seconds between the reads of two plain greedy steps run ahead in a row, by slot bucket: what plain batched
        # decoding delivers at that load, the rate a group of tree slots must beat (.slot_budget)
        self.ahead_s: dict[int, RecentMedian] = {}
        self._ahead_read: tuple[int, float] | None = None   # (slot bucket, time) of the last such read
        self.plain_tried: set[int] = set()   # slot counts at which a group of tree slots went to plain steps
        log_once(f"batch:{token_budget}", f"continuous batching: up to {token_budget} rows per forward, prompts in "
                 f"chunks of {self.chunk} tokens")

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *, spec: str = "none",
               budget: int | str | None = None, on_tokens: OnTokens | None = None) -> Sequence:
        """Queue a request (checked now: a bad prompt or spec raises before it is queued). ``spec`` none | dflash |
        ddtree with ``budget`` as for :func:`~kdtree_engine.speculative.decode.generate`; ``budget="auto"``: the
        load-aware budget, chosen per round over the whole batch (:mod:`.load_budget`)."""
        params = params or SamplingParams()
        sc = resolve_spec(spec, self.drafter, budget)
        prompt_ids = [int(t) for t in prompt_ids]
        shape = round_shape(sc, self.target, self.drafter, prompt_ids)
        S, cfg = len(prompt_ids), self.target.cfg
        # the limit its solo run would have in an empty pool: the same stop rule, the same tokens
        limit = context_limit(S, params.max_tokens, cfg.max_position_embeddings, self.pool.total_tokens,
                              shape.max_nodes)
        self._ids += 1
        seq = Sequence(self._ids, prompt_ids, params, shape, limit, Emitter(self.target, params, limit, on_tokens))
        if limit == 0:
            self._end(seq, "length")
            return seq
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancel()

    def drop_all(self) -> list[Sequence]:
        """End every request now (finish reason "abort") and give their cache blocks back: after a failed step,
        whose requests' state is not to be trusted. Returns them."""
        if self.ahead is not None:
            self.ahead.pending = None   # its tokens are not read: its requests end here
        ended = [self._end(s, "abort") for s in list(self.active)]
        ended += [self._end(s, "abort") for s in self.waiting]
        self.waiting.clear()
        return ended

    def close(self) -> None:
        """End every request ("abort") and drop the static steps (their graphs and buffers)."""
        self.drop_all()
        if self.steps is not None:
            self.steps.release()
            self.steps = None
        if self.draft_slots is not None:
            self.draft_slots.release()
            self.draft_slots = None
            self.tree_slots = None

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def run(self) -> None:
        """Step until every submitted request has ended."""
        while not self.idle:
            self.step()

    # ---- one round boundary and one forward ----------------------------------------------------
    def step(self) -> list[Sequence]:
        """One batched forward; returns the requests that ended at this step (cancelled ones included). While every
        running request decodes plainly and greedily over static steps, the forward is queued before the host reads
        the previous step's tokens (:mod:`.ahead`), so those requests end one call later than their last forward."""
        ended = self._drop_cancelled()
        pend = None if self.ahead is None else self.ahead.pending
        if pend is not None:
            running = [s for s in pend.running if s.state == RUNNING]
            others = [s for s in self.active if s not in running]
            if running and not ended and not self.waiting and not others and steady(running):
                return self._step_ahead(running)
            self.ahead.pending = None
            ended += self.ahead.settle(pend, self._end)
        self._ahead_read = None
        self._admit()
        ended += self._step_tree_slots([s for s in self.active if s.state == RUNNING and s.tree_slot is not None])
        running = [s for s in self.active if s.state == RUNNING and s.tree_slot is None]
        plans = self._plan_rounds(running)
        parts: list[BatchPart] = [p.part for p in plans]
        rows = sum(p.ids.shape[0] for p in parts)
        prefilling: list[Sequence] = []
        for seq in (s for s in self.active if s.state == PREFILL):
            a, b, step = seq.chunks[0]
            if rows and rows + (b - a) > self.token_budget:
                break
            last = len(seq.chunks) == 1
            ids = torch.tensor(seq.prompt_ids[a:b], dtype=torch.long)
            parts.append(BatchPart(ids, seq.rounds.cache, chunk=step, logits="last" if last else "none"))
            prefilling.append(seq)
            rows += b - a
        if not parts:
            return ended
        aux = self._aux_layers(running, prefilling)
        shape = None if prefilling or not running else self._shape_rows(parts[:len(running)])
        # the load-aware budgets learn what a forward of the batch really costs, from a sample of the forwards (and
        # every forward of a shape not yet measured)
        timed = self._cost is not None and (self.forwards % TIME_EVERY == 0 or self.step_s.n == 0 or (
            shape is not None and (shape not in self.observed or self.observed[shape].n == 0)))
        if timed:
            sync(self.target.device)
            t0 = time.perf_counter()
        outs = self._forward(parts, len(running), aux)
        if timed:
            sync(self.target.device)
            took = time.perf_counter() - t0
            first = shape is not None and shape not in self.observed   # a shape's first forward captures its graph
            if shape is not None:
                self.observed.setdefault(shape, RunningMean(0.1, warmup=1)).update(took)
            if not first:   # the curve is an eager forward's; replayed steps run far below it
                self.forward_scale.update(min(max(took / max(self._cost(rows), 1e-12), FORWARD_SCALE_MIN), SCALE_MAX))
                self.step_s.update(took / len(parts))
        self.forwards += 1
        self.rows_run += rows
        if (self.ahead is not None and running and not prefilling and not self.waiting and len(running) == len(self.active)
                and all(p.tree is None for p in plans) and steady(running)
                and any(s.emit.remaining > 1 for s in running)):
            # the next step goes ahead of this one's read (.ahead): its tokens are handed on at the next call
            self.ahead.pending = self.ahead.pend(running, plans, outs, self._pick([o.logits[-1:] for o in outs]))
            self.ahead.hand_on(self.ahead.pending)
            return ended
        picked = self._greedy_picks(running, plans, outs)
        treed = [k for k, p in enumerate(plans) if p.tree is not None]
        t_walk = time.perf_counter()
        walks = self._walk([running[k] for k in treed], [plans[k] for k in treed], [outs[k] for k in treed])
        # the accepted nodes' aux rows (the drafter's next context) for every tree in one gather
        aux = walks.take([outs[k].aux for k in treed]) if walks is not None else []
        walk_s = (time.perf_counter() - t_walk) / max(len(treed), 1)   # a tree's share of the batch's walk
        auto_walks = sum(running[k].shape.auto and plans[k].tree.num_nodes > 1 for k in treed)
        walk_of = {k: i for i, k in enumerate(treed)}
        for k, (seq, plan, out) in enumerate(zip(running, plans, outs)):
            if plan.tree is None:
                seq.rounds.absorb(plan, out, picked.get(seq.id))
            else:
                seq.rounds.absorb_walk(plan, out, walks, walk_of[k], aux[walk_of[k]])
            if seq.calibration is not None and plan.tree is not None and plan.tree.num_nodes > 1:
                seq.calibration.update(seq.rounds.stats.accepted_lens[-1] - 1, seq.predicted)
                self.calibration.update(seq.rounds.stats.accepted_lens[-1] - 1, seq.predicted)
            if seq.emit.push(seq.rounds.collect()):
                ended.append(self._end(seq))
        for seq, out in zip(prefilling, outs[len(running):]):
            self._prefilled(seq, out, aux)
            if seq.done:
                ended.append(seq)
        if self._plan_s is not None:
            plan_s, planned = self._plan_s
            self.tree_host_s.update(plan_s / planned + (walk_s if auto_walks else 0.0))
            self._plan_s = None
        if self.draft_slots is not None and (moved := self.draft_slots.shrink()):
            for seq in self.active:   # a moved request's cache was copied to its new slot's
                if seq.draft_slot in moved:
                    seq.draft_slot = moved[seq.draft_slot]
                    seq.rounds.dcache = self.draft_slots.cache(seq.draft_slot)
        return ended

    def _step_ahead(self, running: list[Sequence]) -> list[Sequence]:
        """The next plain greedy step of ``running`` queued, then the pending step's tokens read and handed on; the
        new step's picks become each still running request's next input. A request whose length the pending step
        reaches takes no row of the next one."""
        ahead = self.ahead
        running = [s for s in running if s.emit.remaining > 1]
        if not running:
            pend, ahead.pending = ahead.pending, None
            return ahead.settle(pend, self._end)
        plans = [s.rounds.plan_plain() if s.rounds.drafter is None else skipped_round(s) for s in running]
        outs = self._forward([p.part for p in plans], len(running), self._aux_layers(running, []))
        self.forwards += 1
        self.rows_run += len(plans)
        nxt = ahead.pend(running, plans, outs, self._pick([o.logits[-1:] for o in outs]))
        ahead.steps += 1
        ended = ahead.settle(ahead.pending, self._end)
        now, bucket = time.perf_counter(), slot_bucket(len(running))
        if self._ahead_read is not None and self._ahead_read[0] == bucket:
            self.ahead_s.setdefault(bucket, RecentMedian()).update(now - self._ahead_read[1])
        self._ahead_read = (bucket, now)
        ahead.hand_on(nxt)
        ahead.pending = nxt if any(s.state == RUNNING for s in running) else None
        return ended

    def _forward(self, parts: list[BatchPart], n_running: int, aux: tuple[int, ...]) -> list[TargetOutput]:
        """The step's forward: with static steps, the running requests' rows through :class:`BatchedSteps` and the
        prompt chunks beside them (:meth:`_prompts`; the kernels are batch-invariant: the same bits as one forward);
        else one host-driven forward of every part."""
        running, chunks = parts[:n_running], parts[n_running:]
        if self.steps is None or (running and not self.steps.fits(running)):
            return self.target.forward_batch(parts, aux)
        return (self.steps.forward(running, aux) if running else []) + self._prompts(chunks, aux)

    def _prompts(self, chunks: list[BatchPart], aux: tuple[int, ...]) -> list[TargetOutput]:
        """The step's prompt chunks: a few whole short prompts each from the target's prompt graphs (one replay
        a prompt, model/prompt_graph.py), else all of them in one host-driven forward (one forward beats many
        replays when many prompts arrive together)."""
        graphs = self.target.prompt_graphs
        whole = graphs is not None and 0 < len(chunks) <= PROMPT_GRAPHS_PER_STEP and all(
            p.chunk is None and p.logits == "last" and graphs.takes(p.ids.shape[0], p.cache) for p in chunks)
        if not whole:
            return self.target.forward_batch(chunks, aux) if chunks else []
        log_once("batch:prompt-graphs", f"batched prompts: up to {PROMPT_GRAPHS_PER_STEP} whole prompts a step "
                 "from the prompt graphs, more in one host-driven forward")
        return [TargetOutput(*graphs.run(p.ids, p.cache, aux)) for p in chunks]

    def _greedy_picks(self, running: list[Sequence], plans: list[RoundPlan], outs: list[TargetOutput]
                      ) -> dict[int, tuple[torch.Tensor, int]]:
        """The tokens of this step's plain greedy rounds, picked in one launch and read in one copy (each request
        alone would pick and read its own): {request id: (device token, token)}."""
        ids = [(s.id, o.logits[-1:]) for s, p, o in zip(running, plans, outs) if p.tree is None and s.params.greedy]
        if len(ids) < 2:
            return {}
        picks = self._pick([row for _, row in ids])
        return {i: (picks[k], t) for k, ((i, _), t) in enumerate(zip(ids, picks.tolist()))}

    def _step_tree_slots(self, slotted: list[Sequence]) -> list[Sequence]:
        """The device-resident rounds of the requests in tree slots: one step of each group that holds one (one
        replay, one read); returns those that ended."""
        ended: list[Sequence] = []
        groups: dict[tuple, list[Sequence]] = {}
        for seq in slotted:
            groups.setdefault(seq.tree_slot[0], []).append(seq)
        for key, members in groups.items():
            group = self.tree_slots[key]
            tokens, kept = group.step()
            self.forwards += 1
            n1 = group.n1_of[group.last_budget]
            self.rows_run += group.slots * n1
            for seq in members:
                i = seq.tree_slot[1]
                if kept is not None:
                    seq.rounds.keep_logits(kept[i])
                seq.rounds.stats.record(len(tokens[i]), n1 - 1)
                if seq.emit.push(tokens[i]):
                    ended.append(self._end(seq))
            if group.chooser is not None:
                n = group.slots
                group.plain_steps = group.plain_steps + 1 if group.chooser.prefers_plain(n) else 0
                # a load at which plain batched steps have not run: the group goes to them once, settled, so their
                # rate is measured and the requests that come later at this load take the better of the two
                learn = not self.plain_timed(n) and group.chooser.settled(n) and n not in self.plain_tried
                if group.plain_steps >= HAND_OVER_AFTER or learn:
                    self.plain_tried.add(n)
                    self._hand_over(group, [s for s in members if s.tree_slot is not None])
            moved = group.shrink()
            for seq in members:   # a moved request's state and draft cache were copied to its new slot's
                if seq.tree_slot is not None and moved:
                    seq.tree_slot = (key, moved[seq.tree_slot[1]])
                    seq.rounds.dcache = group.dcaches[seq.tree_slot[1]]
        return ended

    def plain_rate(self, slots: int) -> float | None:
        """Tokens per second a request gets from plain greedy steps run ahead at ``slots`` requests (their slot
        bucket): as measured there, else a lower bound from the loads measured (None where none is). A step of more
        rows takes no less time, so a request's rate at a higher load bounds it from below; and no more than
        proportionally more, so the batch's total at a lower load does too (rate(m) x m / n). A bound never
        overstates plain steps: a group keeps its trees unless even the bound beats them."""
        n = slot_bucket(slots)
        rates = {m: 1.0 / max(seen.value, 1e-9) for m, seen in self.ahead_s.items() if seen.n > 0}
        if n in rates:
            return rates[n]
        bounds = [r if m > n else r * m / n for m, r in rates.items()]
        return max(bounds) if bounds else None

    def plain_timed(self, slots: int) -> bool:
        """Whether plain steps run ahead have been timed at ``slots`` requests' slot bucket itself."""
        seen = self.ahead_s.get(slot_bucket(slots))
        return seen is not None and seen.n > 0

    def _plain_pays(self, key: tuple) -> bool:
        """Whether a load-aware request should stay out of its group's tree slots: plain steps were the best at the
        slot count the group would run at with every running request of its key in it (host-driven plain steps run
        ahead of the host's reads; the slots' plain steps wait for theirs). Judged at the whole load, not the group's
        present count: a burst admitted one request at a time would otherwise fill the slots to where plain pays and
        split the batch into two forwards a step."""
        group = None if self.tree_slots is None or not key[0].auto else self.tree_slots.get(key)
        if group is None:
            return False
        load = sum(1 for s in self.active if (s.tree_slot[0] == key if s.tree_slot is not None else (
            s.rounds is not None and slotted(s) and slot_key(s) == key)))
        return group.chooser.prefers_plain(max(slot_bucket(load), group.slots if group.free else 2 * group.slots))

    def _hand_over(self, group: TreeSlots, seqs: list[Sequence]) -> None:
        """A group of load-aware requests whose plain steps have been the best for a while: each request to
        host-driven rounds (its length, newest token and pending context rows read in one copy; its draft cache
        copied into a draft slot), its tree slot freed."""
        if not seqs or self.draft_slots is None:
            return
        slots = [s.tree_slot[1] for s in seqs]
        idx = torch.tensor(slots, device=group.start.device)
        state = torch.stack([group.start, group.bonus, group.n_ctx], 1).index_select(0, idx).tolist()
        for seq, i, (start, bonus, n_ctx) in zip(seqs, slots, state):
            r = seq.rounds
            seq.draft_slot = self.draft_slots.take(len(seq.prompt_ids) + seq.limit + 1)
            dcache, src = self.draft_slots.cache(seq.draft_slot), group.dcaches[i]
            fed = start - n_ctx   # the positions already in the draft cache
            dcache.k[:, :, :fed].copy_(src.k[:, :, :fed])
            dcache.v[:, :, :fed].copy_(src.v[:, :, :fed])
            dcache.length = fed
            r.dcache, r.start, r.cache.length = dcache, start, start
            r.bonus = torch.tensor(bonus, dtype=torch.long, device=group.start.device)
            r.ctx = [group.ctx[i, :n_ctx].clone()] if n_ctx else []
            group.detach(i)
            seq.tree_slot = None
            seq.stats["handed_over"] = True
            # plain steps were the better (or are to be timed): a probe gap of plain rounds before a draft pass, so
            # they run ahead of their reads at once
            seq.backoff = seq.skip = self._probe_gap(max(seq.backoff, HAND_OVER_AFTER))
        group.plain_steps = 0
        log.debug("tree slots: %d load-aware requests to host-driven rounds (plain steps pay)", len(seqs))

    def _walk(self, seqs: list[Sequence], plans: list[RoundPlan], outs: list[TargetOutput]) -> TreeWalks | None:
        """The accept walks of this step's trees, all in one pass (.walks): the greedy requests' picks in one launch,
        a sampled request's from its own generator; then every accepted node committed in one copy."""
        if not seqs:
            return None
        picks: list[torch.Tensor | None] = [None] * len(seqs)
        greedy_at = [k for k, s in enumerate(seqs) if s.params.greedy]
        if greedy_at:
            together = self._pick([outs[k].logits for k in greedy_at])
            for k, rows in zip(greedy_at, together.split([outs[k].logits.shape[0] for k in greedy_at])):
                picks[k] = rows
        for k, (seq, out) in enumerate(zip(seqs, outs)):
            if picks[k] is None:
                picks[k] = seq.rounds.tree_picks(out.logits)
        walks = walk_trees([p.tree for p in plans], torch.cat(picks))
        commit_walks([s.rounds.cache for s in seqs], walks)
        return walks

    def _pick(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """Greedy picks of blocks of logits rows [n_i, V] in one launch -> [sum n_i] device tokens; a vocabulary split
        over ranks: one max / index reduction for all the rows (row-wise, as each alone)."""
        return greedy(torch.cat(rows), policy=self.target.policy, vocab=getattr(self.target, "vocab_shard", None))

    def _aux_layers(self, running: list[Sequence], prefilling: list[Sequence]) -> tuple[int, ...]:
        """The drafter's target layers when a request in this forward drafts (aux rows are per row: computing them
        for every row changes no request's logits)."""
        drafts = any(s.rounds.drafter is not None for s in running + prefilling)
        return tuple(self.drafter.target_layer_ids) if drafts else ()

    def _plan_rounds(self, running: list[Sequence]) -> list[RoundPlan]:
        """Each running request's round up to the forward: one batched draft pass for every request that drafts
        this round, then the trees (requests with the load-aware budget get theirs together, :meth:`_plan_auto`)."""
        plans: dict[int, RoundPlan] = {}
        asks: list[tuple[Sequence, tuple]] = []
        auto: list[tuple[Sequence, torch.Tensor | None]] = []
        for seq in running:
            r = seq.rounds
            if r.drafter is None:
                plans[seq.id] = r.plan(seq.emit.remaining)
            elif seq.shape.auto and seq.skip > 0:   # speculation did not pay last time: plain rounds, then try again
                plans[seq.id] = skipped_round(seq)
            elif (ask := r.draft_request(seq.emit.remaining)) is not None:
                asks.append((seq, ask))
            elif seq.shape.auto:
                auto.append((seq, None))
            else:
                plans[seq.id] = r.plan_tree(None, r.root_only())
        # a pass of requests back from plain rounds is a probe: it takes in every token since their last pass
        probe = bool(asks) and all(s.shape.auto and s.backoff > 0 for s, _ in asks)
        ddtrees: list[tuple[Sequence, torch.Tensor, tuple]] = []   # fixed-budget DDTrees: built together below
        for seq, logits in zip([s for s, _ in asks], self._draft(asks, probe)):
            draft_logits = seq.rounds.drafted(logits)
            r = seq.rounds
            if seq.shape.auto:
                auto.append((seq, draft_logits))
            elif seq.shape.method == "ddtree":
                ddtrees.append((seq, draft_logits, seq.shape.budget))
            else:
                plans[seq.id] = r.plan_tree(draft_logits, r.tree_for(draft_logits))
        tops = self._tops([(d, b) for _, d, b in ddtrees])
        trees = trees_of([s.rounds for s, _, _ in ddtrees], [(*top, b) for top, (_, _, b) in zip(tops, ddtrees)])
        for (seq, draft_logits, _), tree in zip(ddtrees, trees):
            plans[seq.id] = seq.rounds.plan_tree(draft_logits, tree)
        if auto:
            fixed = [p.part.ids.shape[0] for p in plans.values()]
            plans.update(self._plan_auto(auto, fixed))
        return [plans[s.id] for s in running]

    def _draft(self, asks: list[tuple[Sequence, tuple]], probe: bool = False) -> list[torch.Tensor]:
        """The draft passes of this step (each request's ask: its context rows, newest token, draft cache, position) as
        one batched pass: over the draft slots (.draft_slots), else host-driven (a drafter without one: each alone);
        with a load-aware request among them, their seconds per request feed the load-aware budgets (a timing waits
        for the device)."""
        if not asks:
            return []
        timed = any(s.shape.auto for s, _ in asks)   # only the load-aware budgets read the pass's seconds
        if timed:
            sync(self.target.device)
        t0 = time.perf_counter()
        if self.draft_slots is not None:
            out = self.draft_slots.propose([(s.draft_slot, ctx, bonus, start) for s, (ctx, bonus, _, start) in asks])
        elif hasattr(self.drafter, "propose_batch"):
            out = self.drafter.propose_batch(self.target, [ask for _, ask in asks])
        else:
            out = [self.drafter.propose(self.target, *ask) for _, ask in asks]
        if timed:
            sync(self.target.device)
            (self.probe_s if probe else self.draft_s).update((time.perf_counter() - t0) / len(asks))
        return out

    def _tops(self, asks: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Top-k log-probs and ids of several requests' draft logits [depth_i, V] (k_i each): one launch for the
        requests of each k (the kernel is row-wise: each request's rows as alone)."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(asks)
        vocab = getattr(self.target, "vocab_shard", None)
        for k in sorted({k for _, k in asks}):
            mine = [i for i, (_, kk) in enumerate(asks) if kk == k]
            lp, ids = topk_logprobs(torch.cat([asks[i][0] for i in mine]), k, policy=self.target.policy, vocab=vocab)
            sizes = [asks[i][0].shape[0] for i in mine]
            for i, a, b in zip(mine, lp.split(sizes), ids.split(sizes)):
                out[i] = (a, b)
        return out

    def _plan_auto(self, auto: list[tuple[Sequence, torch.Tensor | None]], fixed: list[int]) -> dict[int, RoundPlan]:
        """Trees for the load-aware requests: budgets from their expected acceptance and the batch's verify cost; each
        request given a tree is charged its draft pass and the host time a tree adds (:attr:`tree_host_s`). ``fixed``:
        the rows of the other running requests' rounds. With static steps every request's rows are padded to the
        widest round, so the load-aware requests share one budget."""
        curve = self._verify_cost()   # the curve is measured on first use: untimed
        t0 = time.perf_counter()
        drafted_at = [k for k, (_, d) in enumerate(auto) if d is not None]
        tops: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(auto)
        for k, top in zip(drafted_at, self._tops([(auto[k][1], auto[k][0].shape.budget) for k in drafted_at])):
            tops[k] = top
        # the expected gains read the log-probs on the host: every request's in one copy
        host = torch.cat([tops[k][0].reshape(-1) for k in drafted_at]).cpu() if drafted_at else None
        expected, at = [], 0
        for (seq, _), top in zip(auto, tops):
            if top is None:
                expected.append(torch.zeros(0, dtype=torch.float64))
                continue
            lp = host[at:at + top[0].numel()].view(top[0].shape)
            at += top[0].numel()
            # no budget past the room the request's cache has left (its tree's nodes go there: _round_nodes)
            cap = min(seq.shape.budget, seq.rounds.cache.capacity - seq.rounds.cache.length - 1)
            expected.append(expected_accepted_by_budget(lp, cap) if cap > 0 else torch.zeros(0, dtype=torch.float64))
        calibrated = [e * seq.calibration.factor for (seq, _), e in zip(auto, expected)]
        fixed_rows = sum(fixed)
        padded = None if self.steps is None else (len(fixed), max(fixed, default=1), padded_rows)
        # plain decoding is what every tree is weighed against: until a plain forward of this batch's shape has been
        # measured (its first one is its capture), the rounds stay plain, and no verdict is drawn from them
        plain = (padded_rows(len(fixed) + len(auto), max(fixed, default=1)) if padded is not None
                 else fixed_rows + len(auto))
        measured = curve is not None and plain in self.observed and self.observed[plain].n > 0
        budgets = (allocate_budgets(calibrated, fixed_rows, self._forward_cost, fixed_tokens=fixed_rows,
                                    draft_s=self.draft_s.value + self.tree_host_s.value, padded=padded)
                   if measured else [0] * len(auto))
        drafted = [(seq, b) for (seq, _), top, b in zip(auto, tops, budgets) if top is not None]
        if measured and drafted:
            # the batch's verdict: a tree that paid clears it; else every request that drafted skips the same gap (the
            # longest any of them is due), so the next probe is one batched pass, not one per request
            paid = any(b > 0 for _, b in drafted)
            gap = 0 if paid else max(self._probe_gap(seq.backoff) for seq, _ in drafted)
            self.verdict_gap, self.verdict_at = gap, self.forwards
        out = {}
        treed = []   # (request, its draft logits, its top-K and budget): the trees built together below
        for (seq, draft_logits), top, b, e in zip(auto, tops, budgets, expected):
            r = seq.rounds
            # a tree not worth its draft pass: skip the drafter for a while (doubling while it stays so)
            if measured:
                seq.backoff = 0 if b > 0 else self.verdict_gap if top is not None else self._probe_gap(seq.backoff)
                seq.skip = seq.backoff
            seq.predicted = float(e[b - 1]) if b > 0 else 0.0   # the drafter's own estimate: what calibration learns
            chose(seq, b)
            # budget 0: a plain step (its aux row still feeds the drafter), as cheap as plain decoding's
            if b:
                treed.append((seq, draft_logits, (top[0], top[1], b)))
            else:
                out[seq.id] = r.plan_plain()
        trees = trees_of([s.rounds for s, _, _ in treed], [top for _, _, top in treed])
        for (seq, draft_logits, _), tree in zip(treed, trees):
            out[seq.id] = seq.rounds.plan_tree(draft_logits, tree)
        planned = sum(top is not None for top in tops)
        if planned:
            self._plan_s = (time.perf_counter() - t0, planned)
        return out

    def _probe_gap(self, last: int) -> int:
        """Plain rounds before a request whose draft pass did not pay drafts again (``last``: the gap it had): twice
        the last gap, and at least as many as make that pass (its probe pass and tree host time) PROBE_SHARE of
        their cost; at most MAX_PROBE_GAP."""
        share = self.step_s.value
        probe = self.probe_s.value if self.probe_s.n else self.draft_s.value
        floor = math.ceil((probe + self.tree_host_s.value) / (PROBE_SHARE * share)) if share > 0 else 1
        return min(max(2 * last, floor, 1), MAX_PROBE_GAP)

    def _shape_rows(self, running: list[BatchPart]) -> int:
        """The rows a forward of these running requests' parts runs: padded to the slots with static steps."""
        if self.steps is not None and self.steps.fits(running):
            return padded_rows(len(running), max(p.ids.shape[0] for p in running))
        return sum(p.ids.shape[0] for p in running)

    def _forward_cost(self, rows: int) -> float:
        """Seconds of a forward of ``rows`` rows (padded rows with static steps): as measured for that shape, else the
        verify cost curve scaled by what the forwards so far took against it."""
        seen = self.observed.get(rows)
        if seen is not None and seen.n > 0:
            return seen.value
        # a forward of more rows costs no less than one measured with fewer (the curve's scale is learned mostly
        # from plain steps, replayed far below it: a wide tree never run must not look nearly free)
        below = max((m.value for r, m in self.observed.items() if r < rows and m.n > 0), default=0.0)
        return max(self.forward_scale.value * self._verify_cost()(rows), below)

    def _verify_cost(self):
        """The verify cost curve (measured on first use over a cache from the pool); None while the running requests
        hold too much of the pool to measure it (the load-aware rounds stay plain until it has room)."""
        if self._cost is None:
            top = min(self.token_budget, COST_ROWS)
            context = min(self.pool.max_context // 2, 2048, self.pool.free_tokens - top - BLOCK)
            if context < BLOCK:
                log_once(f"verify-cost-wait:{id(self)}", "budget auto: no room in the cache pool to measure the verify "
                         "cost yet; load-aware rounds stay plain until there is")
                return None
            self._cost = verify_cost_for(self.target, context=context, max_nodes=top)
        return self._cost

    # ---- admission, prefill, the end ------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            need = blocks_for(len(seq.prompt_ids) + seq.limit + self._round_nodes(seq))
            if need > self.pool.free_blocks:
                return
            self.waiting.popleft()
            self._start(seq)

    def _round_nodes(self, seq: Sequence) -> int:
        """The verify rows a request's cache keeps room for past its limit: its widest round, but for host-driven
        load-aware requests what the blocks of a plain round hold (with ``auto_slots``, of the tree slots' widest
        round): their host-driven trees fit that room (:meth:`_plan_auto`), so speculation under load never takes
        blocks (and concurrency) that plain decoding would have."""
        if seq.shape.auto:
            n = len(seq.prompt_ids) + seq.limit
            widest = 1 + min(seq.shape.budget, LADDER[-1]) if self.auto_slots else 1
            return blocks_for(n + widest) * BLOCK - n
        return seq.shape.max_nodes

    def _start(self, seq: Sequence) -> None:
        """Take the request's cache blocks and plan its prompt chunks as its solo prefill does."""
        target = self.target
        # a load-aware request's rounds get their budgets from the batch (load_budget.py), not a chooser of their own
        shape = replace(seq.shape, auto=False)
        r = HostRounds(target, self.drafter, shape, seq.params, seq.limit, len(seq.prompt_ids), self.tree_impl,
                       self.prefill_chunk, round_nodes=self._round_nodes(seq))
        r.timer = Timer(target.device, synced=False)
        if self.keep_logits:
            r.emitted_logits = []
        seq.rounds = r
        if seq.shape.auto:
            seq.calibration = AcceptanceCalibration(prior=self.calibration.factor)
            # the batch's probe schedule runs on across requests: a new one waits out what is left of the gap (short
            # requests arriving one after another would otherwise each restart it and none ever draft again)
            seq.backoff = self.verdict_gap
            seq.skip = max(self.verdict_gap - (self.forwards - self.verdict_at), 0)
        S = len(seq.prompt_ids)
        if S <= self.chunk:
            seq.chunks = [(0, S, None)]
        else:
            N = target.layers[0].self_attn.n_heads
            kernel = prefill_kernel_on(target.policy, target.device)
            seq.chunks = [(a, b, ChunkStep(choose_form(target.cfg, N, b - a, a, target.dtype.itemsize, target.device,
                                                       kernel=kernel)))
                          for a, b in plan_chunks(S, self.chunk)]
        seq.stats.update(prefill_chunks=len(seq.chunks), prefill_chunk=self.chunk)
        seq.state = PREFILL
        seq.admitted = time.perf_counter()
        self.active.append(seq)

    def _prefilled(self, seq: Sequence, out: TargetOutput, aux: tuple[int, ...]) -> None:
        """One prompt chunk has run; after the last, the first token."""
        seq.chunks.pop(0)
        if out.aux is not None and seq.rounds.drafter is not None:
            seq.prompt_aux.append(out.aux)
        if seq.chunks:
            return
        prompt_aux = torch.cat(seq.prompt_aux) if seq.prompt_aux else None
        seq.prompt_aux = []
        dcache, group = None, None
        key = slot_key(seq)
        if (self.tree_slots is not None and slotted(seq) and (self.auto_slots or not seq.shape.auto)
                and not self._plain_pays(key)):
            group = self.tree_slots.get(key)
            if group is None:
                group = self.tree_slots[key] = TreeSlots(self.target, self.drafter, seq.shape, key[1],
                                                         self.draft_slots.mode, self.keep_logits, self.plain_rate)
            seq.tree_slot = (key, group.take())
            dcache = group.dcaches[seq.tree_slot[1]]
        elif self.draft_slots is not None and seq.rounds.drafter is not None:
            seq.draft_slot = self.draft_slots.take(len(seq.prompt_ids) + seq.limit + 1)
            dcache = self.draft_slots.cache(seq.draft_slot)
        first = seq.rounds.start_decoding(out.logits[-1], prompt_aux, len(seq.prompt_ids), dcache)
        seq.stats["device_rounds"] = group is not None   # whole rounds on the device (tree slots), or host-driven
        if group is not None:
            group.attach(seq.tree_slot[1], seq.rounds.cache, seq.rounds.bonus, prompt_aux, len(seq.prompt_ids))
        seq.first_token = time.perf_counter()
        seq.state = RUNNING
        if seq.emit.push([first]):
            self._end(seq)

    def _drop_cancelled(self) -> list[Sequence]:
        ended = [self._end(s, "abort") for s in list(self.active) if s.cancelled]
        for s in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(s)
            ended.append(self._end(s, "abort"))
        return ended

    def _end(self, seq: Sequence, reason: str | None = None) -> Sequence:
        """The request's result; its cache blocks go back to the pool."""
        now = time.perf_counter()
        if seq.tree_slot is not None:   # its slot's table to the trash block before its blocks go back
            key, i = seq.tree_slot
            if self.tree_slots is not None:
                self.tree_slots[key].detach(i)
            seq.tree_slot = None
        if seq.rounds is not None:
            seq.rounds.release()
        if seq.draft_slot is not None:
            self.draft_slots.give(seq.draft_slot)
            seq.draft_slot = None
        if seq in self.active:
            self.active.remove(seq)
        first = seq.first_token or now
        stats: dict[str, Any] = {"prompt_tokens": len(seq.prompt_ids), "spec": seq.shape.method, **seq.shape.stats()}
        generated = len(seq.emit.tokens)
        if seq.rounds is not None:
            stats.update(seq.rounds.stats.summary(generated, first - (seq.admitted or now), now - first))
        stats.update(seq.stats, queued_s=(seq.admitted or now) - seq.submitted, latency_s=now - seq.submitted,
                     ttft_s=first - seq.submitted)
        seq.result = GenerationResult(list(seq.emit.tokens), reason or seq.emit.finish_reason or "length", stats)
        seq.state = DONE
        return seq


def skipped_round(seq: Sequence) -> RoundPlan:
    """A load-aware request's plain round in place of a draft pass (one of its skip), counted as budget 0."""
    seq.skip -= 1
    chose(seq, 0)
    return seq.rounds.plan_plain()


def chose(seq: Sequence, budget: int) -> None:
    """Count a round's budget in the request's stats (``budget_chosen``: {budget: rounds})."""
    counts = seq.stats.setdefault("budget_chosen", {})
    counts[budget] = counts.get(budget, 0) + 1


def slot_key(seq: Sequence) -> tuple:
    """The tree-slot group a request belongs to: its round shape and its cache's capacity bucket."""
    return seq.shape, capacity_bucket(seq.rounds.cache.capacity)


def slotted(seq: Sequence) -> bool:
    """Whether a request runs device-resident tree rounds in a tree slot (.tree_slots): greedy, a drafting method
    (a fixed budget, or the load-aware one chosen a step for its group: .slot_budget); sampled requests take
    host-driven rounds."""
    return seq.rounds.drafter is not None and seq.shape.method in ("dflash", "ddtree") and seq.params.greedy
