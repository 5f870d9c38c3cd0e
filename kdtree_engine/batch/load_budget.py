"""The tree budgets of a batch under load (``budget="auto"`` inside the continuous batch).

With one request a bigger tree costs little (the verify reads the weights either way); with many, every request's
verify rows share one forward, so the forward's time grows with the batch's total rows. Each round the budgets
of the load-aware requests are chosen together to maximize the batch's expected tokens per second:

    maximize  (fixed_tokens + sum_i (1 + E_i(b_i))) / t(fixed_rows + sum_i (1 + b_i))

where E_i(b) is request i's expected accepted drafts with a budget-b tree (the DDTree surrogate, calibrated by its
observed acceptance: speculative/budget.py) and t(rows) the measured cost of a forward of that many rows.
Each request given a tree also pays its draft pass (``draft_s``) in the denominator. Coordinate ascent: from the better of plain
decoding for all (every budget 0, the root alone) and the best budget shared by all, the one change of one request's budget (to any size on its
candidate ladder, up or down) that raises the objective most is taken, until none raises it. Starting from plain and taking only improving steps,
the chosen budgets never predict fewer tokens per second than plain batched decoding; as the batch grows a node
costs more of the shared forward and the trees shrink. When the forward pads every request's rows to the widest
round (batched steps from CUDA graphs, graph_step.py), the requests share one budget instead (:func:`shared_budget`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..speculative.budget import default_candidates


Padded = tuple[int, int, Callable[[int, int], int]]


def allocate_budgets(expected: Sequence[torch.Tensor], fixed_rows: int, cost: Callable[[float], float],
                     fixed_tokens: float = 0.0, draft_s: float = 0.0, padded: Padded | None = None) -> list[int]:
    """Budgets (0 = plain) for requests with expected accepted drafts ``expected[i]`` [max_budget_i] (entry b-1:
    budget b; empty: no draft this round), beside ``fixed_rows`` rows (and ``fixed_tokens`` expected tokens) of
    the other requests in the forward; ``cost(rows)`` the seconds of a forward of that many rows; ``draft_s``: the
    seconds of one request's draft pass, charged to every request given a tree (a request left at 0 need not
    draft next time, see the scheduler). ``padded`` (others, widest, rows_of): the forward pads every request's rows
    to the widest round (static batched steps, graph_step.py): ``others`` fixed requests whose widest round has
    ``widest`` rows, and ``rows_of(requests, widest)`` the rows it runs; then one budget is shared (a smaller tree
    beside a bigger one saves no rows) and only shared budgets are weighed."""
    if padded is not None:
        return shared_budget(expected, fixed_tokens, cost, draft_s, padded)
    ladders = [(0,) + default_candidates(len(e)) if len(e) else (0,) for e in expected]
    steps = [0] * len(expected)
    values = [[0.0] + [float(e[b - 1]) for b in ladder[1:]] for e, ladder in zip(expected, ladders)]

    def objective(rows: int, tokens: float, drafting: int) -> float:
        return tokens / max(float(cost(rows)) + drafting * draft_s, 1e-12)

    def state(levels: list[int]) -> tuple[int, float, int, float]:
        r = fixed_rows + sum(1 + ladder[k] for ladder, k in zip(ladders, levels))
        t = fixed_tokens + sum(1 + v[k] for v, k in zip(values, levels))
        d = sum(k > 0 for k in levels)
        return r, t, d, objective(r, t, d)

    # the start: plain, or the best budget shared by every request (the requests often look alike)
    for b in sorted({b for ladder in ladders for b in ladder}):
        levels = [max(k for k, x in enumerate(ladder) if x <= b) for ladder in ladders]
        if state(levels)[3] > state(steps)[3]:
            steps = levels
    rows, tokens, drafting, best = state(steps)
    for _ in range(4 * sum(len(ladder) for ladder in ladders)):   # each pass strictly improves: a bound, not a cut
        pick, pick_to, pick_value = -1, 0, best
        for i, ladder in enumerate(ladders):
            k = steps[i]
            for to in range(len(ladder)):
                if to == k:
                    continue
                v = objective(rows + ladder[to] - ladder[k], tokens + values[i][to] - values[i][k],
                              drafting + (to > 0) - (k > 0))
                if v > pick_value * (1 + 1e-12):
                    pick, pick_to, pick_value = i, to, v
        if pick < 0:
            break
        k = steps[pick]
        rows += ladders[pick][pick_to] - ladders[pick][k]
        tokens += values[pick][pick_to] - values[pick][k]
        drafting += (pick_to > 0) - (k > 0)
        steps[pick] = pick_to
        best = pick_value
    return [ladder[k] for ladder, k in zip(ladders, steps)]


def shared_budget(expected: Sequence[torch.Tensor], fixed_tokens: float, cost: Callable[[float], float],
                  draft_s: float, padded: Padded) -> list[int]:
    """One budget for every request that drafts (each capped by its own largest), chosen over the union of their
    ladders against plain (0) with the forward's padded rows."""
    others, widest, rows_of = padded
    n = others + len(expected)
    best_b, best = 0, -1.0
    for b in sorted({0} | {b for e in expected if len(e) for b in default_candidates(len(e))}):
        got = [min(b, len(e)) for e in expected]
        tokens = fixed_tokens + sum(1 + (float(e[g - 1]) if g else 0.0) for e, g in zip(expected, got))
        rows = rows_of(n, max([widest] + [1 + g for g in got]))
        value = tokens / max(float(cost(rows)) + sum(g > 0 for g in got) * draft_s, 1e-12)
        if value > best * (1 + 1e-12):
            best_b, best = b, value
    return [min(best_b, len(e)) for e in expected]
