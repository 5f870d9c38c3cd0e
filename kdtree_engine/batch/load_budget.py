"""The tree budgets of a batch under load (``budget="auto"`` inside the continuous batch).

With one request a bigger tree costs little (the verify reads the weights either way); with many, every request's
verify rows share one forward, so the forward's time grows with the batch's total rows. Each round the budgets
of the load-aware requests are chosen together to maximize the batch's expected tokens per second:

    maximize  (fixed_tokens + sum_i (1 + E_i(b_i))) / t(fixed_rows + sum_i (1 + b_i))

where E_i(b) is request i's expected accepted drafts with a budget-b tree (the DDTree surrogate, calibrated by its
observed acceptance: speculative/budget.py) and t(rows) the measured cost of a forward of that many rows.
Greedy: every budget starts at 0 (plain decoding, the root alone) and the single step up a candidate ladder that
raises the objective most is taken, until none raises it. Starting from plain and taking only improving steps,
the chosen budgets never predict fewer tokens per second than plain batched decoding; as the batch grows a node
costs more of the shared forward and the trees shrink.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..speculative.budget import default_candidates


def allocate_budgets(expected: Sequence[torch.Tensor], fixed_rows: int, cost: Callable[[float], float],
                     fixed_tokens: float = 0.0) -> list[int]:
    """Budgets (0 = plain) for requests with expected accepted drafts ``expected[i]`` [max_budget_i] (entry b-1:
    budget b; empty: no draft this round), beside ``fixed_rows`` rows (and ``fixed_tokens`` expected tokens) of
    the other requests in the forward; ``cost(rows)`` the seconds of a forward of that many rows."""
    ladders = [(0,) + default_candidates(len(e)) if len(e) else (0,) for e in expected]
    steps = [0] * len(expected)
    values = [[0.0] + [float(e[b - 1]) for b in ladder[1:]] for e, ladder in zip(expected, ladders)]

    def objective(rows: int, tokens: float) -> float:
        return tokens / max(float(cost(rows)), 1e-12)

    rows = fixed_rows + len(expected)
    tokens = fixed_tokens + len(expected)
    best = objective(rows, tokens)
    while True:
        pick, pick_value = -1, best
        for i, ladder in enumerate(ladders):
            k = steps[i]
            if k + 1 >= len(ladder):
                continue
            r = rows + ladder[k + 1] - ladder[k]
            t = tokens + values[i][k + 1] - values[i][k]
            v = objective(r, t)
            if v > pick_value:
                pick, pick_value = i, v
        if pick < 0:
            break
        k = steps[pick]
        rows += ladders[pick][k + 1] - ladders[pick][k]
        tokens += values[pick][k + 1] - values[pick][k]
        steps[pick] = k + 1
        best = pick_value
    return [ladder[k] for ladder, k in zip(ladders, steps)]
