"""``--budget auto``: pick the DDTree budget per round that maximizes expected tokens per second.

On an MoE target a verify over N tokens touches more distinct experts as N grows, so its cost rises
quickly with the tree size, while the drafter's expected accepted length rises ever more slowly.
Each round's choice is

    b* = argmax over candidate budgets b of  (1 + c * E_b) / (t_verify(b + 1) + t_draft + t_overhead)

* ``E_b`` is the DDTree surrogate objective for budget b: the sum of the path probabilities
  (under the drafter's factorized distribution) of the first b nodes of the best-first heap. The
  heap order does not depend on the budget, so one heap run to the largest budget gives ``E_b``
  for every b as prefix sums (:func:`expected_accepted_by_budget`).
* ``c`` calibrates the drafter: the ratio of observed to predicted accepted drafts, as exponential
  moving averages over rounds (:class:`AcceptanceCalibration`). An over-confident drafter gets
  ``c < 1`` and smaller trees.
* ``t_verify(n)`` is the verify cost curve of this model on this device and dtype, measured once
  per process over a small grid of node counts with a dummy cache of about the request's length
  (interleaved passes over the grid, the fastest run of each size: robust to other work on the
  machine), interpolated piecewise linearly (:class:`VerifyCostModel`), and rescaled by the running
  ratio of observed to predicted verify times (the dummy run cannot see the real routing or context).
* ``t_draft`` and ``t_overhead`` (tree build + commit) are running averages of the stage timers.

The choice only changes which tree is verified, never how tokens are accepted, so greedy output
is identical to plain decoding for every budget (and sampling stays lossless).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import weakref
from collections import Counter
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..logs import log_once
from .tree import clamped_logprobs, heap_order, tree_size

log = logging.getLogger("kdtree_engine")

AUTO = "auto"
AUTO_MAX_BUDGET = 256  # largest tree --budget auto considers (verify width 257)
SCALE_MIN, SCALE_MAX = 0.1, 10.0  # bounds of the observed / measured verify time correction


def default_candidates(max_budget: int) -> tuple[int, ...]:
    """Powers of two up to ``max_budget``, and ``max_budget`` itself."""
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    out, b = [], 1
    while b < max_budget:
        out.append(b)
        b *= 2
    out.append(max_budget)
    return tuple(out)


def default_grid(max_nodes: int) -> tuple[int, ...]:
    """Verify widths measured: 1, 2, 4, ... below ``max_nodes``, and ``max_nodes``."""
    return default_candidates(max_nodes)


def auto_max_budget(block_size: int, vocab_size: int, cap: int = AUTO_MAX_BUDGET) -> int:
    """The largest budget worth considering: ``cap``, or fewer when the tree cannot hold that many."""
    return max(1, tree_size(cap, max(block_size - 1, 1), vocab_size))


# ---- expected accepted length per budget -----------------------------------------------------

def heap_probabilities(logprobs_topk: torch.Tensor) -> Iterator[float]:
    """Path probabilities of the DDTree heap's nodes in pop order (non-increasing), lazily.

    Same float32 scores and tie-break as :func:`~kdtree_engine.speculative.tree.build_tree_heap`, so the
    first b values belong to exactly the nodes of the budget-b tree.
    """
    for _, _, _, score in heap_order(clamped_logprobs(logprobs_topk)):
        yield math.exp(float(score))


def expected_accepted_by_budget(logprobs_topk: torch.Tensor, max_budget: int) -> torch.Tensor:
    """E[accepted drafts] under the drafter's factorized distribution, for every budget 1..max_budget.

    ``logprobs_topk`` [L, K] are per-depth top-K log-probabilities, descending per row (as from
    :func:`~kdtree_engine.speculative.tree.topk_logprobs`). Runs the DDTree best-first heap (the same
    float32 scores and tie-break as :func:`~kdtree_engine.speculative.tree.build_tree_heap`) and returns
    float64 [max_budget]: entry b-1 = sum of the path probabilities of the first b popped nodes,
    i.e. the surrogate objective of the budget-b tree. When fewer than ``max_budget`` prefixes
    exist the tail repeats the last value (a bigger budget adds nothing).
    """
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    probs = list(itertools.islice(heap_probabilities(logprobs_topk), max_budget))
    out = torch.zeros(max_budget, dtype=torch.float64)
    if probs:
        cs = torch.tensor(probs, dtype=torch.float64).cumsum(0)
        out[:len(probs)] = cs
        out[len(probs):] = cs[-1]
    return out


# ---- running averages ------------------------------------------------------------------------

class RunningMean:
    """Exponential moving average whose first updates are plain means (weight max(alpha, 1/n)).

    ``prior`` (with ``prior_weight`` pseudo-observations) is the value before any update. The first ``warmup``
    updates are not observations (a timing whose first calls compile kernels).
    """

    def __init__(self, alpha: float = 0.1, prior: float = 0.0, prior_weight: int = 0, warmup: int = 0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value = float(prior)
        self.n = int(prior_weight)
        self.warmup = int(warmup)

    def update(self, x: float) -> float:
        if self.warmup > 0:
            self.warmup -= 1
            return self.value
        self.n += 1
        w = max(self.alpha, 1.0 / self.n)
        self.value += w * (float(x) - self.value)
        return self.value


class RecentMedian:
    """Lower median of the last ``window`` samples: the cost of a host-side stage whose samples are only ever
    inflated (a first call that compiles, a collection pause), so one slow sample neither sets nor lingers in the
    estimate the way it would in a moving average. ``value`` is ``prior`` before any sample; the first ``warmup``
    updates are not samples."""

    def __init__(self, window: int = 8, prior: float = 0.0, warmup: int = 0) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = int(window)
        self.value = float(prior)
        self.n = 0
        self.warmup = int(warmup)
        self._recent: list[float] = []

    def update(self, x: float) -> float:
        if self.warmup > 0:
            self.warmup -= 1
            return self.value
        self.n += 1
        self._recent = (self._recent + [float(x)])[-self.window:]
        self.value = sorted(self._recent)[(len(self._recent) - 1) // 2]
        return self.value


class AcceptanceCalibration:
    """Running factor c = observed / predicted accepted drafts (ratio of two moving averages).

    Starts at ``prior`` (1.0: trust the drafter's probabilities), counted as one round, so the
    first observation moves it half way and later ones by ``alpha``. Clamped to [lo, hi].
    """

    def __init__(self, alpha: float = 0.1, prior: float = 1.0, lo: float = 0.0, hi: float = 10.0) -> None:
        self.observed = RunningMean(alpha, prior=prior, prior_weight=1)
        self.predicted = RunningMean(alpha, prior=1.0, prior_weight=1)
        self.lo, self.hi = lo, hi

    def update(self, observed: float, predicted: float) -> float:
        self.observed.update(observed)
        self.predicted.update(predicted)
        return self.factor

    @property
    def factor(self) -> float:
        p = self.predicted.value
        if p <= 1e-12:
            return 1.0
        return min(max(self.observed.value / p, self.lo), self.hi)


# ---- verify cost curve -----------------------------------------------------------------------

class VerifyCostModel:
    """Seconds for one target verify over n tree nodes (root included), piecewise linear in n.

    Built from measured or injected points ``{n: seconds}``. Below the smallest n the first value
    holds; above the largest the last segment's slope continues (never decreasing).
    """

    def __init__(self, points: Mapping[int, float] | Iterable[tuple[int, float]], *, source: str = "injected",
                 context: int | None = None) -> None:
        items = sorted((int(n), float(t)) for n, t in (points.items() if isinstance(points, Mapping) else points))
        if not items:
            raise ValueError("a verify cost curve needs at least one point")
        if any(n < 1 for n, _ in items) or len({n for n, _ in items}) != len(items):
            raise ValueError(f"verify cost node counts must be distinct and >= 1, got {[n for n, _ in items]}")
        if any(t < 0 for _, t in items):
            raise ValueError("verify cost times must be >= 0")
        self.nodes = np.array([n for n, _ in items], dtype=np.float64)
        self.seconds = np.array([t for _, t in items], dtype=np.float64)
        self.source = source
        self.context = context

    @property
    def max_nodes(self) -> int:
        return int(self.nodes[-1])

    def points(self) -> list[tuple[int, float]]:
        return [(int(n), float(t)) for n, t in zip(self.nodes, self.seconds)]

    def __call__(self, n: int | float | Sequence[float] | np.ndarray) -> Any:
        x = np.asarray(n, dtype=np.float64)
        y = np.interp(x, self.nodes, self.seconds)
        if len(self.nodes) > 1:
            slope = max((self.seconds[-1] - self.seconds[-2]) / (self.nodes[-1] - self.nodes[-2]), 0.0)
            y = np.where(x > self.nodes[-1], self.seconds[-1] + slope * (x - self.nodes[-1]), y)
        return float(y) if y.ndim == 0 else y

    def describe(self) -> str:
        pts = ", ".join(f"{n}: {1e3 * t:.3g}" for n, t in self.points())
        ctx = f", context {self.context}" if self.context is not None else ""
        return f"verify ms by nodes ({self.source}{ctx}) {{{pts}}}"

    @classmethod
    def measure(cls, target: Any, *, context: int, max_nodes: int, grid: Sequence[int] | None = None,
                warmup: int = 1, repeats: int = 5, seed: int = 0) -> "VerifyCostModel":
        """Time ``target`` verifying n random tokens (a chain, ancestor-only mask) after ``context``
        cached tokens, for each n in ``grid`` (default :func:`default_grid`), the device synchronized
        around each call: ``warmup`` untimed passes over the grid, then ``repeats`` timed passes.

        Robust to other work on the machine (a shared CPU, another process on the GPU), whose
        interference only ever adds time: each pass visits every n (forward, then backward on the
        next pass), so a slow phase lands on all sizes instead of on one; each n keeps the fastest of
        its runs; and the curve is made non-decreasing from the right (t(n) = the least time at n or
        above), since more nodes never cost less and a point above a larger one carries noise. (A
        running maximum from the left would spread one slow small-n point over the whole curve, which
        then reads as flat and sends the chooser to the largest tree.)"""
        cfg = target.cfg
        grid = sorted(set(int(n) for n in (grid or default_grid(max_nodes))))
        if warmup < 0 or repeats < 1:
            raise ValueError(f"verify cost measure: warmup must be >= 0 and repeats >= 1, got {warmup}, {repeats}")
        top = grid[-1]
        context = max(1, min(int(context), cfg.max_position_embeddings - top - 1))
        g = torch.Generator().manual_seed(seed)
        cache = target.new_cache(context + top)
        try:
            best = cls._time_grid(target, cache, grid, context, warmup, repeats, g)
        finally:
            if hasattr(cache, "release"):
                cache.release()  # the blocks go back to the target's cache pool
        pts: dict[int, float] = {}
        floor = math.inf
        for n in reversed(grid):
            floor = min(floor, best[n])
            pts[n] = floor
        return cls(pts, source="measured", context=context)

    @staticmethod
    def _time_grid(target: Any, cache: Any, grid: list[int], context: int, warmup: int, repeats: int,
                   g: torch.Generator) -> dict[int, float]:
        """The fastest time of each n in ``grid`` (see :meth:`measure`)."""
        cfg, dev = target.cfg, target.device
        if hasattr(cache, "reserve") and hasattr(cache, "commit_all"):
            cache.reserve(context)  # a dummy prefix (whatever its blocks hold): only its length matters for the cost
            cache.commit_all()
        else:
            target(torch.randint(0, cfg.vocab_size, (context,), generator=g).to(dev), cache)
        calls: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}   # n -> (ids, positions, mask)
        for n in grid:
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=g).to(dev)
            pos = torch.arange(context, context + n, device=dev)
            mask = torch.ones((n, n), dtype=torch.bool, device=dev).tril()
            calls[n] = (ids, pos, mask)
        best = {n: math.inf for n in grid}
        for p in range(warmup + repeats):
            for n in (grid if p % 2 == 0 else grid[::-1]):
                ids, pos, mask = calls[n]
                _sync(dev)
                t0 = time.perf_counter()
                target(ids, cache, positions=pos, tree_mask=mask)
                _sync(dev)
                if p >= warmup:
                    best[n] = min(best[n], time.perf_counter() - t0)
                cache.crop(context)  # drop the pending tree entries
        return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Per target: {(device, dtype): VerifyCostModel}. Weak keys: the entry goes with the model.
_COSTS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], VerifyCostModel]]" = weakref.WeakKeyDictionary()


def _cost_key(target: Any) -> tuple[str, str]:
    return (str(target.device), str(target.dtype).replace("torch.", ""))


def set_verify_cost(target: Any, model: VerifyCostModel | Mapping[int, float] | None) -> None:
    """Inject (or with None forget) the verify cost curve used for ``target`` on its device/dtype."""
    per = _COSTS.setdefault(target, {})
    if model is None:
        per.pop(_cost_key(target), None)
        return
    per[_cost_key(target)] = model if isinstance(model, VerifyCostModel) else VerifyCostModel(model)


def verify_cost_for(target: Any, *, context: int, max_nodes: int, **measure_kw: Any) -> VerifyCostModel:
    """The cached curve for (model, device, dtype); measured on first use and logged once.

    A later request that needs more nodes than were measured extrapolates the last segment.
    """
    per = _COSTS.setdefault(target, {})
    key = _cost_key(target)
    model = per.get(key)
    if model is None:
        t0 = time.perf_counter()
        model = VerifyCostModel.measure(target, context=context, max_nodes=max_nodes, **measure_kw)
        per[key] = model
        log.info("budget auto: measured the verify cost on %s %s in %.2fs", key[0], key[1], time.perf_counter() - t0)
    log_once(f"verify-cost:{id(target)}:{key[0]}:{key[1]}", f"budget auto: {model.describe()}")
    return model


# ---- the per-round chooser -------------------------------------------------------------------

class AutoBudget:
    """Chooses each round's DDTree budget and learns from the round's outcome.

    Per round: ``choose(lp_topk)`` (before building the tree) then ``observe(accepted, draft_s,
    overhead_s, verify_s)`` (after the accept walk). ``lp_topk`` must have at least ``max_budget``
    columns, or all of the vocabulary.
    """

    def __init__(self, cost: VerifyCostModel, max_budget: int, *, candidates: Sequence[int] | None = None,
                 alpha: float = 0.1, calibration_prior: float = 1.0, name: str = "") -> None:
        if max_budget < 1:
            raise ValueError(f"max_budget must be >= 1, got {max_budget}")
        cands = sorted({int(b) for b in (candidates or default_candidates(max_budget)) if 1 <= int(b) <= max_budget})
        if not cands:
            raise ValueError(f"no candidate budget within 1..{max_budget}")
        self.cost = cost
        self.max_budget = max_budget
        self.candidates = tuple(cands)
        self._cand_idx = torch.tensor(self.candidates, dtype=torch.long) - 1
        self._verify_s = torch.from_numpy(np.asarray(cost(np.array(self.candidates, dtype=np.float64) + 1.0)))
        self.calibration = AcceptanceCalibration(alpha, prior=calibration_prior)
        self.t_draft = RunningMean(alpha)
        self.t_overhead = RunningMean(alpha)
        self.verify_scale = RunningMean(alpha, prior=1.0, prior_weight=1)  # observed / curve
        self.chosen: list[int] = []
        self.name = name
        self._pending: tuple[int, float] | None = None  # (budget, predicted accepted drafts)

    def round_seconds(self) -> torch.Tensor:
        """Predicted seconds of a round for each candidate budget."""
        scale = min(max(self.verify_scale.value, SCALE_MIN), SCALE_MAX)
        t = scale * self._verify_s + self.t_draft.value + self.t_overhead.value
        return t.clamp_min(1e-12)

    def rates(self, expected: torch.Tensor) -> torch.Tensor:
        """Expected tokens per second for each candidate, from E_b (``expected`` [>= max_budget])."""
        e = expected.to(torch.float64).index_select(0, self._cand_idx)
        return (1.0 + self.calibration.factor * e) / self.round_seconds()

    def choose(self, lp_topk: torch.Tensor) -> int:
        """The candidate with the highest expected rate (the smallest among ties).

        Equal to ``argmax(rates(expected_accepted_by_budget(lp_topk, max_budget)))``, but the heap
        stops as soon as no larger candidate can win: pops come in non-increasing probability, so
        after k pops with last probability p, E_b <= E_k + (b - k) * p for every b > k.
        """
        c = self.calibration.factor
        secs = self.round_seconds().tolist()
        pops = heap_probabilities(lp_topk)
        k, e, p = 0, 0.0, 1.0
        best_i, best_rate, best_e = 0, -math.inf, 0.0
        for i, b in enumerate(self.candidates):
            while k < b:
                q = next(pops, None)
                if q is None:
                    p = 0.0  # no more prefixes: E stays flat
                    break
                e, p, k = e + q, q, k + 1
            rate = (1.0 + c * e) / secs[i]
            if rate > best_rate:
                best_i, best_rate, best_e = i, rate, e
            if all((1.0 + c * (e + (b2 - k) * p)) / secs[j] <= best_rate
                   for j, b2 in enumerate(self.candidates[i + 1:], start=i + 1)):
                break
        b = self.candidates[best_i]
        self._pending = (b, best_e)
        if not self.chosen:
            log_once(f"budget-first:{self.name}",
                     f"budget auto: first choice {b} (E[accepted] {best_e:.2f}, calibration {c:.2f}; "
                     f"candidates {list(self.candidates)})")
        self.chosen.append(b)
        return b

    def observe(self, accepted: int, draft_s: float, overhead_s: float, verify_s: float | None = None) -> None:
        """The round's accepted drafts (bonus excluded) and stage seconds; ignored without a choice."""
        if self._pending is None:
            return
        b, predicted = self._pending
        self._pending = None
        self.calibration.update(accepted, predicted)
        self.t_draft.update(draft_s)
        self.t_overhead.update(overhead_s)
        if verify_s is not None:
            model_s = float(self.cost(b + 1))
            if model_s > 0:
                self.verify_scale.update(min(max(verify_s / model_s, SCALE_MIN), SCALE_MAX))

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.chosen).items()))

    def stats(self) -> dict[str, Any]:
        return {
            "budget_chosen": self.histogram(),
            "budget_auto": {
                "mean": sum(self.chosen) / len(self.chosen) if self.chosen else None,
                "calibration": self.calibration.factor,
                "verify_scale": self.verify_scale.value,
                "draft_ms": 1e3 * self.t_draft.value,
                "overhead_ms": 1e3 * self.t_overhead.value,
                "candidates": list(self.candidates),
                "verify_ms": [[n, 1e3 * t] for n, t in self.cost.points()],
                "cost_source": self.cost.source,
                "cost_context": self.cost.context,
            },
        }


def auto_budget_for(target: Any, *, block_size: int, context: int, max_budget: int | None = None,
                    **kw: Any) -> AutoBudget:
    """An :class:`AutoBudget` for one request on ``target`` (cost curve cached per model/device/dtype)."""
    mb = max_budget or auto_max_budget(block_size, target.cfg.vocab_size)
    cost = verify_cost_for(target, context=context, max_nodes=mb + 1)
    key = _cost_key(target)
    return AutoBudget(cost, mb, name=f"{id(target)}:{key[0]}:{key[1]}", **kw)
