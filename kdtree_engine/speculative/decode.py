"""The generation loop: one harness for ``spec`` = "none", "dflash" and "ddtree".

Round (batch 1)::

    drafter(ctx = aux features of the tokens committed last round, block = [bonus, MASK x (B-1)])
      -> draft logits [B-1, V] -> tree (dflash: argmax chain; ddtree: best-first over top-K
      log-probs, ``budget`` non-root nodes) -> one target forward over the tree (ancestor-only mask,
      aux features of the drafter's target layers) -> target picks per node -> accept walk ->
      cache.commit(accepted) -> emit accepted drafts + bonus

``spec="none"`` is the same loop with no drafter: the tree is the root alone, one token a round,
run as a plain causal step.

Stop rule: a round's tokens are emitted in order; the first EOS (unless ``ignore_eos``) or stop
token ends the request and is itself included in ``token_ids`` (finish_reason "stop"); reaching
``max_tokens`` or the context limit ends it with finish_reason "length". Nothing after the stop
point is emitted.

Timing: ``prefill_s`` covers the prompt forward that yields the first token; ``decode_s`` the rest;
``tokens_per_s`` = tokens produced after the first / decode_s (decode speed, prefill excluded).
Stage timers (``draft_s``, ``tree_s``, ``verify_s``, ``commit_s``) synchronize the device around
each stage. ``tau`` = mean accepted length per round, bonus included (1.0 for "none");
``accepted_per_depth[d]`` = rounds whose draft at depth d+1 was accepted.

Two round engines, one contract: this module's loop (``eager=True``: host-side bookkeeping, stage
timers, any sampling rule, ``budget="auto"``) and device-resident rounds (:mod:`.device_round`, replayed
from CUDA graphs by :mod:`.graph`, looped by :mod:`.device_decode`: greedy or sampled, fixed budget, the
host reads only the emitted tokens). :func:`pick_round_mode` chooses (graphs by default on CUDA) and logs it once.

``budget="auto"`` (ddtree): each round's budget is chosen by :mod:`.budget` from the measured
verify cost curve and the drafter's calibrated acceptance; stats then carry ``budget: "auto"``,
``budget_chosen`` ({budget: rounds}) and ``budget_auto`` (the chooser's final state and curve).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from ..errors import PromptError, SpecError
from ..logs import log, log_once
from ..model.target import Target
from ..kernels.policy import KernelPolicy
from ..sampling import SamplingParams, greedy, make_generator, sample, topk_logprobs
from .accept import accept, target_picks
from .budget import AUTO, AutoBudget, auto_budget_for, auto_max_budget
from .tree import DraftTree, build_tree, build_tree_heap, chain_tree

SpecMethod = Literal["none", "dflash", "ddtree"]
SPEC_METHODS: tuple[str, ...] = ("none", "dflash", "ddtree")




@dataclass(frozen=True)
class SpecConfig:
    """How to decode: ``method`` none | dflash | ddtree; ``budget`` = non-root tree nodes.

    ddtree: ``budget`` None means block size - 1 (the chain's node count); ``"auto"`` picks it per
    round (see :mod:`kdtree_engine.speculative.budget`). dflash: ``budget`` is the chain's length (the first
    ``budget`` argmax drafts, at most block size - 1; None: all of them), the chain at the same verify
    width as a tree of that budget.
    """

    method: str = "none"
    budget: int | str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise SpecError(f"spec field 'method' must be one of {', '.join(SPEC_METHODS)}; got {self.method!r}")
        if self.budget is not None:
            if isinstance(self.budget, str):
                if self.budget != AUTO:
                    raise SpecError(f"spec field 'budget' must be a positive integer or {AUTO!r}, got {self.budget!r}")
            elif not isinstance(self.budget, int) or isinstance(self.budget, bool) or self.budget < 1:
                raise SpecError(f"spec field 'budget' must be a positive integer or {AUTO!r}, got {self.budget!r}")
            if self.method == "none":
                raise SpecError("spec field 'budget' applies to --spec ddtree / dflash only (method is 'none')")
            if self.method == "dflash" and self.budget == AUTO:
                raise SpecError(f"spec field 'budget' {AUTO!r} applies to --spec ddtree only; "
                                "--spec dflash takes a chain length")


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "length" | "stop"
    stats: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    # The last round that drafted (dflash / ddtree; None for "none"): its tree, the accepted node
    # indices (root first), the bonus token, and per-node draft log-probs (root: None). For display.
    last_tree: DraftTree | None = None
    last_accepted: list[int] | None = None
    last_bonus: int | None = None
    last_draft_logprobs: list[float | None] | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_prompt(target: Target, prompt_ids: list[int]) -> None:
    cfg = target.cfg
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    if len(prompt_ids) >= cfg.max_position_embeddings:
        raise PromptError(f"prompt has {len(prompt_ids)} tokens; max_position_embeddings is "
                          f"{cfg.max_position_embeddings}")
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})")


class Emitter:
    """Applies the stop rule to a round's tokens and forwards what is emitted."""

    def __init__(self, target: Target, params: SamplingParams, limit: int,
                 on_tokens: Callable[[list[int]], None] | None) -> None:
        self.stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(target.cfg.eos_token_ids))
        self.limit = limit
        self.on_tokens = on_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None

    @property
    def remaining(self) -> int:
        return self.limit - len(self.tokens)

    def push(self, toks: list[int]) -> bool:
        """Emit tokens in order; returns True when the request is finished."""
        out: list[int] = []
        for t in toks:
            if len(self.tokens) + len(out) >= self.limit:
                self.finish_reason = "length"
                break
            out.append(t)
            if t in self.stops:
                self.finish_reason = "stop"
                break
        if len(self.tokens) + len(out) >= self.limit and self.finish_reason is None:
            self.finish_reason = "length"
        self.tokens.extend(out)
        if out and self.on_tokens is not None:
            self.on_tokens(out)
        return self.finish_reason is not None


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, float] = {"draft_s": 0.0, "tree_s": 0.0, "verify_s": 0.0, "commit_s": 0.0}
        self._t = 0.0

    def start(self) -> None:
        _sync(self.device)
        self._t = time.perf_counter()

    def lap(self, key: str) -> None:
        _sync(self.device)
        now = time.perf_counter()
        self.totals[key] += now - self._t
        self._t = now


def resolve_spec(spec: str | SpecConfig, drafter: Any, budget: int | str | None) -> SpecConfig:
    sc = spec if isinstance(spec, SpecConfig) else SpecConfig(method=spec, budget=budget)
    if isinstance(spec, SpecConfig) and budget is not None:
        sc = SpecConfig(method=sc.method, budget=budget)
    if sc.method != "none" and drafter is None:
        raise SpecError(f"--spec {sc.method} needs a drafter (--draft DIR)")
    return sc


def generate(target: Target, prompt_ids: list[int], params: SamplingParams, *,
             spec: str | SpecConfig = "none", drafter: Any = None, budget: int | str | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, tree_impl: str = "auto",
             eager: bool | None = None) -> GenerationResult:
    """Decode one request with plain decoding, DFlash (chain) or DDTree (tree of ``budget`` nodes,
    or ``budget="auto"``: chosen per round).

    ``eager``: True runs this module's round loop (host-side bookkeeping, stage timers, any sampling
    rule; the debugging path); False replays each round from a CUDA graph (:mod:`.graph`, a fixed
    budget); None picks graphs where they apply (see :func:`pick_round_mode`, logged once).

    ``drafter`` is a :class:`kdtree_engine.model.dflash.DFlashDrafter` (or anything with its
    ``propose`` / ``new_cache`` / ``target_layer_ids`` / ``block_size``); it is checked against the
    target (DraftMismatchError) before any work.
    """
    sc = resolve_spec(spec, drafter, budget)
    check_prompt(target, prompt_ids)
    if sc.method == "dflash" and sc.budget is not None and sc.budget > drafter.block_size - 1:
        raise SpecError(f"--budget {sc.budget} for --spec dflash is longer than the drafter's chain "
                        f"(block size {drafter.block_size}: at most {drafter.block_size - 1} drafts)")
    if pick_round_mode(sc, params, drafter, target, eager, tree_impl) == "graph":
        from .device_decode import generate_device
        return generate_device(target, prompt_ids, params, method=sc.method,
                               drafter=drafter if sc.method != "none" else None,
                               budget=sc.budget, graph=True,
                               on_tokens=on_tokens)
    impl = pick_tree_impl(tree_impl, target.device) if sc.method == "ddtree" else "vectorized"
    if drafter is not None and sc.method != "none" and hasattr(drafter, "check_target"):
        drafter.check_target(target.cfg)
    cfg = target.cfg
    dev = target.device
    S = len(prompt_ids)
    limit = min(params.max_tokens, cfg.max_position_embeddings - S)
    emit = Emitter(target, params, limit, on_tokens)
    gen = make_generator(params.seed, dev)
    use_draft = sc.method != "none"
    B = drafter.block_size if use_draft else 1
    auto = sc.method == "ddtree" and sc.budget == AUTO
    max_budget = auto_max_budget(B, cfg.vocab_size) if auto else (sc.budget or B - 1)
    chain = (sc.budget or B - 1) if sc.method == "dflash" else B - 1  # drafts used per round
    tree_nodes = 1 if not use_draft else (1 + chain if sc.method == "dflash" else 1 + max_budget)
    stats: dict[str, Any] = {"prompt_tokens": S, "spec": sc.method}
    if sc.method == "dflash" and sc.budget is not None:
        stats["budget"] = chain
    if sc.method == "ddtree":
        stats["budget"] = AUTO if auto else max_budget
    if auto:
        stats["budget_chosen"] = {}
    timer = _Timer(dev)
    rounds = 0
    accepted_lens: list[int] = []
    per_depth = [0] * max(B - 1, 0)
    draft_tokens = 0
    last: tuple | None = None  # (tree, accept result, draft logits) of the last round that drafted
    if limit == 0:
        return GenerationResult([], "length", _finish_stats(stats, emit, 0.0, 0.0, rounds, accepted_lens,
                                                             per_depth, draft_tokens, timer))
    chooser: AutoBudget | None = None
    if auto:  # the verify cost curve is measured on first use (once per model, device, dtype)
        chooser = auto_budget_for(target, block_size=B, context=S + limit // 2, max_budget=max_budget)
    cache = target.new_cache(S + limit + tree_nodes)
    aux_layers = tuple(drafter.target_layer_ids) if use_draft else ()
    _sync(dev)
    t0 = time.perf_counter()
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
    out = target(ids, cache, aux_layers=aux_layers)
    bonus = sample(out.logits[-1], params, gen, policy=target.policy)  # [] the newest token, not yet fed to the target
    tok = int(bonus)
    _sync(dev)
    t1 = time.perf_counter()
    done = emit.push([tok])

    if not use_draft:
        while not done:
            timer.start()
            logits = target(bonus.reshape(1), cache).logits[-1]
            bonus = sample(logits, params, gen, policy=target.policy)
            tok = int(bonus)
            timer.lap("verify_s")
            rounds += 1
            accepted_lens.append(1)
            done = emit.push([tok])
    else:
        dcache = drafter.new_cache(S + limit + 1)
        ctx = out.aux  # [S, K*D] features of the prompt, positions 0..S-1
        start = S  # position of the bonus token = committed length
        while not done:
            before = dict(timer.totals) if chooser is not None else None
            timer.start()
            # drafts past the request's end or the context limit are never used
            depth = min(chain, emit.remaining - 1, cfg.max_position_embeddings - 1 - start)
            if depth > 0:
                draft_logits = drafter.propose(target, ctx, bonus, dcache, start)[:depth]  # [depth, V]
            timer.lap("draft_s")
            tree = _make_tree(sc, target.policy, draft_logits if depth > 0 else None, bonus, start, B, impl, chooser)
            timer.lap("tree_s")
            vout = target(tree.tokens, cache, positions=tree.positions, tree_mask=tree.mask, aux_layers=aux_layers)
            picks = target_picks(vout.logits, params, gen, policy=target.policy)  # [N1]
            res = accept(tree, picks)
            timer.lap("verify_s")
            cache.commit(res.accepted)
            ctx = vout.aux.index_select(0, res.accepted)  # [A, K*D] positions start .. start+A-1
            new = torch.cat([tree.tokens.index_select(0, res.accepted[1:]), res.bonus.reshape(1)]).tolist()
            bonus = res.bonus
            timer.lap("commit_s")
            A = res.num_accepted
            if chooser is not None:
                dt = {k: timer.totals[k] - before[k] for k in timer.totals}
                chooser.observe(A - 1, dt["draft_s"], dt["tree_s"] + dt["commit_s"], dt["verify_s"])
            start += A
            rounds += 1
            draft_tokens += tree.num_nodes - 1
            accepted_lens.append(A)
            for d in range(A - 1):
                per_depth[d] += 1
            if depth > 0:
                last = (tree, res, draft_logits)
            done = emit.push(new)
        dcache.crop(min(dcache.length, start))
    _sync(dev)
    t2 = time.perf_counter()
    if chooser is not None:
        stats.update(chooser.stats())
        log.debug("budget auto: chosen budgets %s (rounds each)", stats["budget_chosen"])
    result = GenerationResult(emit.tokens, emit.finish_reason or "length",
                              _finish_stats(stats, emit, t1 - t0, t2 - t1, rounds, accepted_lens, per_depth,
                                            draft_tokens, timer))
    if last is not None:
        _set_last_round(result, *last)
    return result


def _set_last_round(result: GenerationResult, tree: DraftTree, res: Any, draft_logits: torch.Tensor) -> None:
    """Record a round for display (after timing): tree, accepted path, bonus, draft log-probs per node."""
    result.last_tree = tree
    result.last_accepted = [int(i) for i in res.accepted.tolist()]
    result.last_bonus = int(res.bonus)
    lp = torch.log_softmax(draft_logits.float(), dim=-1)  # [depth, V]
    depths, tokens = tree.depths.tolist(), tree.tokens.tolist()
    result.last_draft_logprobs = [None if d == 0 else float(lp[d - 1, t]) for d, t in zip(depths, tokens)]


def pick_round_mode(sc: SpecConfig, params: SamplingParams, drafter: Any, target: Any, eager: bool | None,
                    tree_impl: str = "auto") -> str:
    """"graph" (each round replayed from a CUDA graph) or "eager" (the host-driven loop).

    Graphs need a CUDA target with ``forward_static``, a fixed budget, a drafter with
    ``forward_static`` (dflash / ddtree) and the builder left to the round (tree_impl auto /
    vectorized). ``eager=False`` when one of these fails raises SpecError; ``eager=None`` takes graphs
    when all hold, else the eager loop, and logs the choice once.
    """
    if eager is True:
        return "eager"
    dev = getattr(target, "device", torch.device("cpu"))
    why = None
    if dev.type != "cuda":
        why = f"the target is on {dev.type}"
    elif not hasattr(target, "forward_static"):
        why = "the target has no device-resident step"
    elif sc.budget == AUTO:
        why = "budget auto times each stage on the host"
    elif sc.method != "none" and not hasattr(drafter, "forward_static"):
        why = "the drafter has no device-resident pass"
    elif tree_impl == "heap":
        why = "tree builder 'heap' runs on the host"
    if why is not None:
        if eager is False:
            raise SpecError(f"CUDA-graph rounds (eager=False) are not possible here: {why}")
        log_once(f"rounds:eager:{why}", f"decoding rounds: eager ({why})")
        return "eager"
    log_once(f"rounds:graph:{dev.type}", f"decoding rounds on {dev.type}: one CUDA graph per round "
             "(--eager for the host-driven loop)")
    return "graph"


TREE_IMPLS = ("auto", "vectorized", "heap")


def pick_tree_impl(impl: str, device: torch.device) -> str:
    """Which DDTree builder runs; all return the identical tree.

    "auto" = "heap": one device-to-host copy of the top-K log-probs, then a host heap; "vectorized"
    (the sync-free builder, eager) is launch-bound (~25 tiny kernels a node): it is kept for capturing a
    whole round in one graph (docs/performance_history.md has the timings).
    """
    if impl not in TREE_IMPLS:
        raise SpecError(f"tree builder must be one of {', '.join(TREE_IMPLS)}; got {impl!r}")
    chosen = "heap" if impl == "auto" else impl
    log_once(f"tree:{device.type}:{chosen}", f"DDTree builder on {device.type}: {chosen}")
    return chosen


def _make_tree(sc: SpecConfig, policy: KernelPolicy, draft_logits: torch.Tensor | None, bonus: torch.Tensor,
               start: int, B: int, tree_impl: str = "vectorized", chooser: AutoBudget | None = None) -> DraftTree:
    dev = bonus.device
    if draft_logits is None:  # no room for drafts: the root alone (a plain step)
        return chain_tree(bonus, torch.empty(0, dtype=torch.long, device=dev), start)
    if sc.method == "dflash":
        return chain_tree(bonus, greedy(draft_logits, policy=policy), start)
    builder = {"vectorized": build_tree, "heap": build_tree_heap}[tree_impl]
    if chooser is not None:
        # one top-K for the largest budget; the budget-b tree only ever uses ranks < b
        lp, ids = topk_logprobs(draft_logits, chooser.max_budget, policy=policy)  # [depth, K]
        budget = chooser.choose(lp)
        return builder(lp[:, :budget], ids[:, :budget], budget, bonus, start)
    budget = sc.budget or B - 1
    lp, ids = topk_logprobs(draft_logits, budget, policy=policy)  # [depth, K]
    return builder(lp, ids, budget, bonus, start)


def _finish_stats(stats: dict[str, Any], emit: Emitter, prefill_s: float, decode_s: float, rounds: int,
                  accepted_lens: list[int], per_depth: list[int], draft_tokens: int, timer: _Timer) -> dict[str, Any]:
    n = len(emit.tokens)
    stats.update(
        generated_tokens=n, prefill_s=prefill_s, decode_s=decode_s,
        tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        rounds=rounds,
        tau=sum(accepted_lens) / len(accepted_lens) if accepted_lens else 0.0,
        draft_tokens=draft_tokens,
        accepted_tokens=sum(a - 1 for a in accepted_lens),
        accepted_per_depth=per_depth,
        **timer.totals,
    )
    return stats
