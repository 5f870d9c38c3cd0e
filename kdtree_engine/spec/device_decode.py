"""The generation loop over device-resident rounds (greedy): each round is one replay of a captured
CUDA graph (``graph=True``) or the same round run eagerly (``graph=False``, any device), and the host
reads only the round's emitted tokens and their count.

Same contract as :func:`kdtree_engine.spec.decode.generate` (tokens, finish reason, stop rule applied
on the host to the emitted tokens, cutting mid-round). Stats: the stage timers are not split
(``draft_s`` = ``tree_s`` = ``commit_s`` = 0, ``verify_s`` = whole rounds: a stage boundary would be a
synchronization) and ``rounds_mode`` says "graph" or "device-eager". ``last_tree`` is not recorded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from ..model.target import Target
from ..sampling import SamplingParams
from .graph import ROUNDS

if TYPE_CHECKING:
    from .decode import GenerationResult


def generate_device(target: Target, prompt_ids: list[int], params: SamplingParams, *, method: str,
                    drafter: Any = None, budget: int | None = None, graph: bool,
                    on_tokens: Callable[[list[int]], None] | None = None) -> "GenerationResult":
    from .decode import Emitter, GenerationResult, _finish_stats, _sync, _Timer, check_prompt

    if not params.greedy:
        raise ValueError("device-resident rounds are greedy only (temperature 0)")
    check_prompt(target, prompt_ids)
    if drafter is not None and method != "none" and hasattr(drafter, "check_target"):
        drafter.check_target(target.cfg)
    cfg, dev = target.cfg, target.device
    S = len(prompt_ids)
    limit = min(params.max_tokens, cfg.max_position_embeddings - S)
    emit = Emitter(target, params, limit, on_tokens)
    stats: dict[str, Any] = {"prompt_tokens": S, "spec": method, "rounds_mode": "graph" if graph else "device-eager"}
    if method == "ddtree":
        stats["budget"] = budget or drafter.block_size - 1
    timer = _Timer(dev)
    B = drafter.block_size if method != "none" else 1
    per_depth = [0] * max(B - 1, 0)
    accepted_lens: list[int] = []
    rounds = draft_tokens = 0
    if limit == 0:
        return GenerationResult([], "length", _finish_stats(stats, emit, 0.0, 0.0, 0, [], per_depth, 0, timer))
    rnd, runner = ROUNDS.get(target, drafter, method, budget, S + limit, graph)
    stats["round_capacity"] = rnd.capacity
    _sync(dev)
    t0 = time.perf_counter()
    first = rnd.prefill(prompt_ids)
    tok = int(first)
    t1 = time.perf_counter()
    done = emit.push([tok])
    step = runner.step if runner is not None else rnd.step
    m = rnd.m
    while not done:
        step()
        vals = rnd.result.tolist()  # the one host read of a round
        a = vals[m]
        rounds += 1
        draft_tokens += rnd.n1 - 1
        accepted_lens.append(a)
        for d in range(a - 1):
            per_depth[d] += 1
        done = emit.push(vals[:a])
    t2 = time.perf_counter()
    timer.totals["verify_s"] = t2 - t1
    return GenerationResult(emit.tokens, emit.finish_reason or "length",
                            _finish_stats(stats, emit, t1 - t0, t2 - t1, rounds, accepted_lens, per_depth,
                                          draft_tokens, timer))
