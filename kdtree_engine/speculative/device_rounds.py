"""Device-resident rounds (greedy or sampled): each round is one replay of a captured CUDA graph
(``graph=True``) or the same round run eagerly (``graph=False``, any device), and the host reads only the
round's emitted tokens and their count.

Rounds ahead (``ahead=True``, the default on CUDA): round k+1 is queued before the host reads round k's
tokens. Each round's ``result`` is copied, right behind the round on the stream, into one of two pinned
host buffers, so the next round cannot overwrite it before it is read; the host's per-round work (the
read, the stop rule, streaming) then overlaps the next round on the GPU instead of leaving it idle. The
round queued past the end of the request is discarded: it only advances this round buffer's state,
which the next request's prefill resets, and the capacity keeps room for it (``AHEAD_SLACK``). Its time
is counted: the decode clock stops after the device has finished it. On the CPU every round runs
synchronously, so nothing overlaps and the loop reads each round as it ends (``ahead=False``). Stats: the
stage timers are not split (``draft_s`` = ``tree_s`` = ``commit_s`` = 0, ``verify_s`` = whole rounds: a stage
boundary would be a synchronization) and ``rounds_mode`` says "graph" or "device-eager". ``last_tree`` is
not recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from ..logs import log_once
from ..model.target import Target
from ..sampling import SamplingParams, make_generator
from .config import RoundShape
from .graph import ROUNDS
from .stats import STAGES, RoundStats

# rounds of block size B of capacity kept free past the request for the round queued past its end
AHEAD_SLACK = 1


class ResultReader:
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


def rounds_ahead(device: torch.device) -> bool:
    """Queue the next round before reading the last one: on CUDA (the host and the GPU overlap)."""
    ahead = device.type == "cuda"
    log_once(f"rounds-ahead:{ahead}", "device rounds: the next round is queued before the host reads the last "
             "one (host work overlaps the GPU)" if ahead else "device rounds: each round read as it ends (cpu)")
    return ahead


class DeviceRounds:
    """One request's device-resident rounds (the :class:`~.decode.Rounds` interface). ``ahead``: None =
    :func:`rounds_ahead` of the target's device (tests set it to check both orders)."""

    def __init__(self, target: Target, drafter: Any, shape: RoundShape, params: SamplingParams, limit: int,
                 prompt_len: int, graph: bool, ahead: bool | None = None, prefill_chunk: int | None = None) -> None:
        self.mode = "graph" if graph else "device-eager"
        self.ahead = rounds_ahead(target.device) if ahead is None else ahead
        B = shape.block_size
        self.rnd, runner = ROUNDS.get(target, drafter, shape, prompt_len + limit + (AHEAD_SLACK * B if self.ahead else 0),
                                      graph, params)
        self.rnd.cache.acquire()  # a cached round's blocks went back to the pool when its last request ended
        self.params = params
        self.gen = make_generator(params.seed, target.device) if not params.greedy else None
        self.run = runner.step if runner is not None else self.rnd.step
        self.reader = ResultReader(self.rnd.result, pinned=self.ahead and target.device.type == "cuda")
        self.stats = RoundStats(B)
        self.launched = self.collected = 0
        self.prefill_chunk = prefill_chunk
        self.prefill_stats: dict[str, int] = {}

    def prefill(self, prompt_ids: list[int]) -> int:
        first = int(self.rnd.prefill(prompt_ids, self.params, self.gen, chunk=self.prefill_chunk))
        self.prefill_stats = self.rnd.prefill_stats
        return first

    def launch(self, remaining: int) -> None:
        """Queue one round (the tree always has full depth; the host's stop rule cuts what is past the end)."""
        if not self.params.greedy:
            self.rnd.draw(self.gen)  # the round's noise, drawn outside the graph
        self.run()
        self.reader.queue(self.launched)
        self.launched += 1

    def release(self) -> None:
        """Return the request's latent cache blocks to the target's pool (the round stays cached: the next
        request takes blocks into the same block table, which its graph reads)."""
        self.rnd.cache.release()

    def collect(self) -> list[int]:
        vals = self.reader.read(self.collected)  # the one host read of a round
        self.collected += 1
        a = vals[self.rnd.m]
        self.stats.record(a, self.rnd.n1 - 1)
        return vals[:a]

    def finish(self, stats: dict[str, Any], decode_s: float) -> None:
        stats["round_capacity"] = self.rnd.capacity
        stats.update({k: decode_s if k == "verify_s" else 0.0 for k in STAGES})
