"""A whole decoding round replayed from a CUDA graph.

:class:`GraphRunner` captures :meth:`DeviceRound.step` once (draft -> tree -> verify -> accept ->
commit, all on the device, static buffers owned by the round) and replays it each round; the host
then reads the round's ``result`` (emitted tokens + count), the one synchronization of a round.

Capture: two warm-up rounds on a side stream (lazy initialisation, Triton compilation, allocator),
the round's state restored, then one capture into a private memory pool. Warm-up rounds write only
past the committed length of the caches (and re-write the drafter's pending context rows with the
same values), so restoring (start, bonus, context rows, count) undoes them.

Rounds are cached per (target, drafter, round shape, capacity, shape of the sampling rule: top-k and
nucleus on/off): a later request with the same settings reuses the captured graph (its prompt is
prefilled into the same buffers; temperature and top-p are set per request). Capacities are rounded up
to a power of two (at least :data:`MIN_CAPACITY`) so requests of similar length share one.
"""

from __future__ import annotations

from typing import Any, Callable

from ..logs import log
from ..model.target import Target
from ..sampling import SamplingParams
from .config import RoundShape
from ..model.capture import CapturedStep, derived_owners, watched
from .device_round import DeviceRound

MIN_CAPACITY = 512


def capacity_bucket(tokens: int) -> int:
    """Power of two >= tokens (and >= MIN_CAPACITY)."""
    cap = MIN_CAPACITY
    while cap < tokens:
        cap *= 2
    return cap


class GraphRunner:
    """Replays one captured round of a :class:`DeviceRound` (CUDA only)."""

    def __init__(self, rnd: DeviceRound) -> None:
        if rnd.target.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the target is on {rnd.target.device}")
        self.rnd = rnd
        self.pool = None
        # the modules caching derived weights, found once (walking every module costs time each round)
        owners = derived_owners([rnd.target] if rnd.drafter is None else [rnd.target, rnd.drafter])

        def save() -> Callable[[], None]:   # the round's state before the warm-up rounds, restored after them
            saved = rnd.snapshot()
            return lambda: rnd.restore(saved)
        self.captured = CapturedStep(rnd.step, rnd.target.device, lambda: watched(rnd.target, owners),
                                     "decoding round", save)

    def step(self) -> None:
        self.pool, captured = self.captured.replay(self.pool)
        if captured:
            rnd = self.rnd
            log.debug("captured a %s round (budget %s, capacity %d)", rnd.method, rnd.budget, rnd.capacity)


class _Registry:
    """DeviceRounds (and their graphs) per target, stored on the target itself so that they go with
    it (a weak-keyed table would be kept alive by the rounds' own reference to the target)."""

    ATTR = "_device_rounds"

    def get(self, target: Target, drafter: Any, shape: RoundShape, tokens: int, graph: bool,
            sampling: SamplingParams | None = None) -> tuple[DeviceRound, GraphRunner | None]:
        rounds = target.__dict__.setdefault(self.ATTR, {})
        cap = capacity_bucket(tokens + max(shape.full_nodes, shape.block_size))
        # the shape of the sampling rule (top-k, nucleus on/off); temperature / top-p values are round inputs
        rule = None if sampling is None or sampling.greedy else (sampling.top_k, sampling.top_p < 1.0)
        key = (id(drafter) if shape.drafts else None, shape, cap, graph, rule)
        entry = rounds.get(key)
        if entry is None or (entry[0].drafter is not None and entry[0].drafter is not drafter):
            rnd = DeviceRound(target, drafter, shape, cap, sampling)
            entry = (rnd, GraphRunner(rnd) if graph else None)
            rounds[key] = entry
        return entry

    def clear(self, target: Target) -> None:
        """Free a target's round buffers and graphs."""
        target.__dict__.pop(self.ATTR, None)


ROUNDS = _Registry()
