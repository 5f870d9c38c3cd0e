"""The generation loop: one loop for ``spec`` = "none", "dflash" and "ddtree", over one round interface.

A request is a prefill (the prompt's forward and its first token) and then rounds until the stop rule ends
it; each round emits the accepted drafts and the bonus token. Two kinds of rounds implement
:class:`Rounds`: host-driven (:mod:`.host_rounds`: host-side bookkeeping, stage timers, any sampling rule,
``budget="auto"``) and device-resident (:mod:`.device_rounds`: replayed from CUDA graphs by :mod:`.graph` or
run eagerly, greedy or sampled, a fixed budget, the host reads only the emitted tokens).
:func:`pick_round_mode` chooses (graphs by default on CUDA) and logs it once.

Stop rule: a round's tokens are emitted in order; the first EOS (unless ``ignore_eos``) or stop
token ends the request and is itself included in ``token_ids`` (finish_reason "stop"); reaching
``max_tokens`` or the context limit ends it with finish_reason "length" (a ``max_tokens`` beyond the context
limit is cut to it, with a warning). Nothing after the stop
point is emitted. ``on_tokens`` receives each round's emitted tokens; when it returns True the request ends
after that round with finish_reason "abort" unless the rule above ended it there too (the server stops a
request this way: a stop string in the text, a client gone).
The context limit is the model's ``max_position_embeddings`` and the latent-cache tokens free in the target's
cache pool (:func:`cache_token_capacity`); a prompt past either is refused (PromptError) before any work. The
request's cache blocks go back to the pool when it ends, whatever way it ends.

Prefill: :meth:`Target.prefill` in chunks of ``prefill_chunk`` tokens (None: the default, model/prefill.py);
stats carry ``prefill_chunks``, ``prefill_chunk`` and ``prefill_peak_bytes``.

Timing: ``prefill_s`` covers the prompt forward that yields the first token; ``decode_s`` the rest;
``tokens_per_s`` = tokens produced after the first / decode_s (decode speed, prefill excluded).
``tau`` = mean accepted length per round, bonus included (1.0 for "none");
``accepted_per_depth[d]`` = rounds whose draft at depth d+1 was accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..errors import PromptError, SpecError
from ..logs import log_once, warn_once
from ..model.target import Target
from ..sampling import SamplingParams
from .config import SPEC_METHODS, RoundShape, SpecConfig, resolve_spec
from .device_rounds import DeviceRounds
from .host_rounds import TREE_IMPLS, HostRounds
from .stats import STAGES, RoundStats, sync
from .tree import DraftTree

__all__ = ["GenerationResult", "OnTokens", "PromptError", "Rounds", "SPEC_METHODS", "SpecConfig", "SpecError",
           "cache_token_capacity", "check_prompt", "context_limit", "generate", "generate_device", "pick_round_mode",
           "resolve_spec"]


# Called with each round's emitted tokens; a True return ends the request after that round.
OnTokens = Callable[[list[int]], "bool | None"]


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "length" | "stop" | "abort" (on_tokens ended it)
    stats: dict[str, Any] = field(default_factory=dict)
    text: str | None = None
    # The last round that drafted (host-driven dflash / ddtree; None otherwise): its tree, the accepted node
    # indices (root first), the bonus token, and per-node draft log-probs (root: None). For display.
    last_tree: DraftTree | None = None
    last_accepted: list[int] | None = None
    last_bonus: int | None = None
    last_draft_logprobs: list[float | None] | None = None


class Rounds(Protocol):
    """One request's rounds. ``ahead``: the next round is launched before the last one is collected."""

    mode: str
    ahead: bool
    stats: RoundStats
    prefill_stats: dict[str, int]  # set by prefill: chunks, chunk size, peak memory

    def prefill(self, prompt_ids: list[int]) -> int: ...

    def launch(self, remaining: int) -> None: ...

    def collect(self) -> list[int]: ...

    def finish(self, stats: dict[str, Any], decode_s: float) -> None: ...

    def release(self) -> None: ...


def cache_token_capacity(target: Target) -> int | None:
    """Tokens of latent cache free in the target's cache pool (made with its defaults on first use: cache.py);
    None for a target without a pool (test doubles)."""
    return target.pool().free_tokens if hasattr(target, "pool") else None


def context_limit(prompt_len: int, max_tokens: int, max_positions: int, cache_tokens: int | None,
                  reserve: int = 0) -> int:
    """The tokens a request may generate: ``max_tokens`` cut to the positions and the cache tokens left after
    the prompt (and ``reserve`` tokens a round writes past the request). A prompt that leaves no room is
    refused with a PromptError naming its length and the limit, before any work."""
    if prompt_len >= max_positions:
        raise PromptError(f"prompt has {prompt_len} tokens; max_position_embeddings is {max_positions}")
    if cache_tokens is not None and prompt_len + reserve >= cache_tokens:
        raise PromptError(f"prompt has {prompt_len} tokens; the free device memory holds a latent cache of "
                          f"{cache_tokens} tokens (free in the cache pool; {reserve} kept for a round)")
    limit = min(max_tokens, max_positions - prompt_len)
    return limit if cache_tokens is None else min(limit, cache_tokens - reserve - prompt_len)


def check_prompt(target: Target, prompt_ids: list[int]) -> None:
    cfg = target.cfg
    if not prompt_ids:
        raise PromptError("the prompt is empty")
    context_limit(len(prompt_ids), 0, cfg.max_position_embeddings, None)
    bad = [t for t in prompt_ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})")


class Emitter:
    """Applies the stop rule to a round's tokens and forwards what is emitted."""

    def __init__(self, target: Target, params: SamplingParams, limit: int,
                 on_tokens: OnTokens | None) -> None:
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
        if out and self.on_tokens is not None and self.on_tokens(out) and self.finish_reason is None:
            self.finish_reason = "abort"
        return self.finish_reason is not None


def generate(target: Target, prompt_ids: list[int], params: SamplingParams, *,
             spec: str | SpecConfig = "none", drafter: Any = None, budget: int | str | None = None,
             on_tokens: OnTokens | None = None, tree_impl: str = "auto",
             eager: bool | None = None, prefill_chunk: int | None = None) -> GenerationResult:
    """Decode one request with plain decoding, DFlash (chain) or DDTree (tree of ``budget`` nodes,
    or ``budget="auto"``: chosen per round).

    ``eager``: True runs host-driven rounds (host-side bookkeeping, stage timers, any sampling rule; the
    debugging path); False replays each round from a CUDA graph (a fixed budget); None picks graphs where
    they apply (see :func:`pick_round_mode`, logged once).

    ``drafter`` is a :class:`kdtree_engine.model.dflash.DFlashDrafter` (or anything with its
    ``propose`` / ``new_cache`` / ``target_layer_ids`` / ``block_size``); it is checked against the
    target (DraftMismatchError) before any work.
    """
    sc = resolve_spec(spec, drafter, budget)
    if tree_impl not in TREE_IMPLS:
        raise SpecError(f"tree builder must be one of {', '.join(TREE_IMPLS)}; got {tree_impl!r}")
    shape = round_shape(sc, target, drafter, prompt_ids)
    mode = pick_round_mode(sc, params, drafter, target, eager, tree_impl)
    if mode == "graph":
        return run_rounds(target, prompt_ids, params, shape, on_tokens, lambda limit: DeviceRounds(
            target, drafter, shape, params, limit, len(prompt_ids), graph=True, prefill_chunk=prefill_chunk), "graph")
    return run_rounds(target, prompt_ids, params, shape, on_tokens, lambda limit: HostRounds(
        target, drafter, shape, params, limit, len(prompt_ids), tree_impl, prefill_chunk), "eager")


def generate_device(target: Target, prompt_ids: list[int], params: SamplingParams, *, method: str,
                    drafter: Any = None, budget: int | None = None, graph: bool,
                    on_tokens: OnTokens | None = None,
                    ahead: bool | None = None, prefill_chunk: int | None = None) -> GenerationResult:
    """:func:`generate` over device-resident rounds, replayed from a CUDA graph (``graph=True``) or run
    eagerly on any device; ``ahead``: None = the device's default order (tests set it to check both)."""
    sc = resolve_spec(method, drafter, budget)
    shape = round_shape(sc, target, drafter, prompt_ids)
    mode = "graph" if graph else "device-eager"
    return run_rounds(target, prompt_ids, params, shape, on_tokens, lambda limit: DeviceRounds(
        target, drafter, shape, params, limit, len(prompt_ids), graph=graph, ahead=ahead,
        prefill_chunk=prefill_chunk), mode)


def round_shape(sc: SpecConfig, target: Target, drafter: Any, prompt_ids: list[int]) -> RoundShape:
    check_prompt(target, prompt_ids)
    if drafter is not None and sc.method != "none" and hasattr(drafter, "check_target"):
        drafter.check_target(target.cfg)
    return sc.resolve(drafter.block_size if sc.method != "none" else 1, target.cfg.vocab_size)


def run_rounds(target: Target, prompt_ids: list[int], params: SamplingParams, shape: RoundShape,
               on_tokens: OnTokens | None, make_rounds: Callable[[int], Rounds],
               mode: str) -> GenerationResult:
    """The one generation loop: prefill, then rounds until the stop rule ends the request.
    ``make_rounds(limit)`` builds the request's rounds for at most ``limit`` new tokens."""
    dev = target.device
    S = len(prompt_ids)
    max_pos, cache_tokens = target.cfg.max_position_embeddings, cache_token_capacity(target)
    limit = context_limit(S, params.max_tokens, max_pos, cache_tokens, shape.max_nodes)
    if limit < params.max_tokens:
        by_cache = limit < min(params.max_tokens, max_pos - S)  # the free memory, not the positions, binds
        held = f", {cache_tokens} tokens free in the latent cache pool" if by_cache else ""
        warn_once(f"length-cap:{params.max_tokens}:{S}:{max_pos}:{by_cache}",
                  f"max_tokens={params.max_tokens} is cut to {limit}: the {S}-token prompt leaves {limit} positions "
                  f"of the model's context (max_position_embeddings {max_pos}{held})")
    emit = Emitter(target, params, limit, on_tokens)
    stats: dict[str, Any] = {"prompt_tokens": S, "spec": shape.method, **shape.stats()}
    if mode != "eager":
        stats["rounds_mode"] = mode
    elif shape.auto:
        stats["budget_chosen"] = {}
    if limit == 0:
        stats.update(RoundStats(shape.block_size).summary(0, 0.0, 0.0))
        stats.update(dict.fromkeys(STAGES, 0.0))
        return GenerationResult([], "length", stats)
    rounds = make_rounds(limit)
    try:
        return _run(rounds, prompt_ids, emit, stats, dev)
    finally:
        rounds.release()  # the cache blocks go back to the pool: at the end, on an error, on a cancel


def _run(rounds: Rounds, prompt_ids: list[int], emit: Emitter, stats: dict[str, Any],
         dev: torch.device) -> GenerationResult:
    """Prefill and the rounds of one request (see :func:`run_rounds`)."""
    sync(dev)
    t0 = time.perf_counter()
    first = rounds.prefill(prompt_ids)
    sync(dev)
    t1 = time.perf_counter()
    stats.update(rounds.prefill_stats)
    done = emit.push([first])
    if not done and rounds.ahead:
        rounds.launch(emit.remaining)
    while not done:
        rounds.launch(emit.remaining)   # ahead: round k+1, queued behind round k and the copy of its tokens
        done = emit.push(rounds.collect())
    sync(dev)                          # a round queued past the end counts in the decode time
    t2 = time.perf_counter()
    stats.update(rounds.stats.summary(len(emit.tokens), t1 - t0, t2 - t1))
    rounds.finish(stats, t2 - t1)
    result = GenerationResult(emit.tokens, emit.finish_reason or "length", stats)
    last = getattr(rounds, "last", None)
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
    """"graph" (each round replayed from a CUDA graph) or "eager" (host-driven rounds).

    Graphs need a CUDA target, a fixed budget, the tree builder left to the round (tree_impl auto /
    vectorized) and, to draft, a drafter with device-resident passes (``DEVICE_RESIDENT``, as DFlashDrafter). ``eager=False`` when one of these fails raises SpecError; ``eager=None`` takes graphs when
    all hold, else host-driven rounds, and logs the choice once.
    """
    if eager is True:
        return "eager"
    dev = getattr(target, "device", torch.device("cpu"))
    why = None
    if dev.type != "cuda":
        why = f"the target is on {dev.type}"
    elif sc.budget == "auto":
        why = "budget auto times each stage on the host"
    elif tree_impl == "heap":
        why = "tree builder 'heap' runs on the host"
    elif sc.method != "none" and not getattr(drafter, "DEVICE_RESIDENT", False):
        why = "the drafter only proposes from the host (no device-resident pass)"
    if why is not None:
        if eager is False:
            raise SpecError(f"CUDA-graph rounds (eager=False) are not possible here: {why}")
        log_once(f"rounds:eager:{why}", f"decoding rounds: eager ({why})")
        return "eager"
    log_once(f"rounds:graph:{dev.type}", f"decoding rounds on {dev.type}: one CUDA graph per round "
             "(--eager for the host-driven loop)")
    return "graph"
