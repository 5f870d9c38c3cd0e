"""The generation loop over device-resident rounds (greedy or sampled): each round is one replay of a captured
CUDA graph (``graph=True``) or the same round run eagerly (``graph=False``, any device), and the host
reads only the round's emitted tokens and their count.

Same contract as :func:`kdtree_engine.speculative.decode.generate` (tokens, finish reason, stop rule applied
on the host to the emitted tokens, cutting mid-round).

Rounds ahead (``ahead=True``, the default on CUDA): round k+1 is queued before the host reads round k's
tokens. Each round's ``result`` is copied, right behind the round on the stream, into one of two pinned
host buffers, so the next round cannot overwrite it before it is read; the host's per-round work (the
read, the stop rule, streaming) then overlaps the next round on the GPU instead of leaving it idle. The
round queued past the end of the request is discarded: it only advances this round buffer's state,
which the next request's prefill resets, and the capacity keeps room for it (``AHEAD_SLACK``). Its time
is counted: the decode clock stops after the device has finished it. On the CPU every round runs
synchronously, so nothing overlaps and the loop reads each round as it ends (``ahead=False``). Stats: the stage timers are not split
(``draft_s`` = ``tree_s`` = ``commit_s`` = 0, ``verify_s`` = whole rounds: a stage boundary would be a
synchronization) and ``rounds_mode`` says "graph" or "device-eager". ``last_tree`` is not recorded.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..logs import log_once
from ..model.target import Target
from ..sampling import SamplingParams, make_generator
from .graph import ROUNDS

# rounds of block size B of capacity kept free past the request for the round queued past its end
AHEAD_SLACK = 1


class _Reader:
    """Two host buffers for rounds' ``result`` (pinned on CUDA): round k's copy is queued right behind
    round k (:meth:`queue`), so round k+1 may be queued before it is read (:meth:`read`)."""

    def __init__(self, result: torch.Tensor, pinned: bool) -> None:
        self.src = result
        self.pinned = pinned
        self.bufs = [torch.empty(result.shape, dtype=result.dtype, pin_memory=pinned) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]

    def queue(self, k: int) -> None:
        self.bufs[k % 2].copy_(self.src, non_blocking=self.pinned)
        if self.pinned:
            self.events[k % 2].record()

    def read(self, k: int) -> list[int]:
        if self.pinned:
            self.events[k % 2].synchronize()
        return self.bufs[k % 2].tolist()

if TYPE_CHECKING:
    from .decode import GenerationResult


def rounds_ahead(device: torch.device) -> bool:
    """Queue the next round before reading the last one: on CUDA (the host and the GPU overlap)."""
    ahead = device.type == "cuda"
    log_once(f"rounds-ahead:{ahead}", "device rounds: the next round is queued before the host reads the last "
             "one (host work overlaps the GPU)" if ahead else "device rounds: each round read as it ends (cpu)")
    return ahead


def generate_device(target: Target, prompt_ids: list[int], params: SamplingParams, *, method: str,
                    drafter: Any = None, budget: int | None = None, graph: bool,
                    on_tokens: Callable[[list[int]], None] | None = None,
                    ahead: bool | None = None) -> "GenerationResult":
    """``ahead``: None = :func:`rounds_ahead` of the target's device (tests set it to check both loops)."""
    from .decode import Emitter, GenerationResult, _finish_stats, _sync, _Timer, check_prompt

    check_prompt(target, prompt_ids)
    if drafter is not None and method != "none" and hasattr(drafter, "check_target"):
        drafter.check_target(target.cfg)
    cfg, dev = target.cfg, target.device
    S = len(prompt_ids)
    limit = min(params.max_tokens, cfg.max_position_embeddings - S)
    emit = Emitter(target, params, limit, on_tokens)
    stats: dict[str, Any] = {"prompt_tokens": S, "spec": method, "rounds_mode": "graph" if graph else "device-eager"}
    if method == "ddtree" or (method == "dflash" and budget is not None):
        stats["budget"] = budget or drafter.block_size - 1
    timer = _Timer(dev)
    B = drafter.block_size if method != "none" else 1
    per_depth = [0] * max(B - 1, 0)
    accepted_lens: list[int] = []
    rounds = draft_tokens = 0
    if limit == 0:
        return GenerationResult([], "length", _finish_stats(stats, emit, 0.0, 0.0, 0, [], per_depth, 0, timer))
    if ahead is None:
        ahead = rounds_ahead(dev)
    rnd, runner = ROUNDS.get(target, drafter, method, budget, S + limit + (AHEAD_SLACK * B if ahead else 0), graph,
                             params)
    gen = make_generator(params.seed, dev) if not params.greedy else None
    stats["round_capacity"] = rnd.capacity
    _sync(dev)
    t0 = time.perf_counter()
    first = rnd.prefill(prompt_ids, params, gen)
    tok = int(first)
    t1 = time.perf_counter()
    done = emit.push([tok])
    run = runner.step if runner is not None else rnd.step

    def sampled_step() -> None:
        rnd.draw(gen)  # the round's noise, drawn outside the graph
        run()

    step = run if params.greedy else sampled_step
    m = rnd.m
    reader = _Reader(rnd.result, pinned=ahead and dev.type == "cuda")
    k = 0
    if not done and ahead:
        step()
        reader.queue(0)
    while not done:
        step()                   # ahead: round k+1, queued behind round k and the copy of its tokens
        reader.queue(k + 1 if ahead else k)
        vals = reader.read(k)    # the one host read of a round
        a = vals[m]
        rounds += 1
        k += 1
        draft_tokens += rnd.n1 - 1
        accepted_lens.append(a)
        for d in range(a - 1):
            per_depth[d] += 1
        done = emit.push(vals[:a])
    _sync(dev)                   # the round queued past the end counts in the decode time
    t2 = time.perf_counter()
    timer.totals["verify_s"] = t2 - t1
    return GenerationResult(emit.tokens, emit.finish_reason or "length",
                            _finish_stats(stats, emit, t1 - t0, t2 - t1, rounds, accepted_lens, per_depth,
                                          draft_tokens, timer))
