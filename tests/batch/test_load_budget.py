"""Load-aware budgets: never predicted worse than plain batched decoding, and smaller trees as the batch grows."""

import itertools
import random

import torch

from kdtree_engine.batch.load_budget import allocate_budgets
from kdtree_engine.speculative.budget import VerifyCostModel, default_candidates


def _expected(rng: random.Random, max_budget: int) -> torch.Tensor:
    """A random concave E[accepted](b): the DDTree surrogate's shape (non-decreasing, shrinking increments)."""
    p = [rng.random() ** 2 for _ in range(max_budget)]
    return torch.tensor(sorted(p, reverse=True), dtype=torch.float64).cumsum(0)


def _rate(expected, budgets, fixed_rows, cost):
    rows = fixed_rows + sum(1 + b for b in budgets)
    return sum(1 + (float(e[b - 1]) if b else 0.0) for e, b in zip(expected, budgets)) / cost(rows)


def test_never_worse_than_plain_and_close_to_the_best():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randint(1, 3)
        cost = VerifyCostModel({1: 1.0, 8: 1.0 + rng.random(), 64: 3 + 10 * rng.random()})
        expected = [_expected(rng, 16) for _ in range(n)]
        fixed = rng.randint(0, 20)
        chosen = allocate_budgets(expected, fixed, cost)
        ladder = (0,) + default_candidates(16)
        assert all(b in ladder for b in chosen)
        plain = _rate(expected, [0] * n, fixed, cost)
        got = _rate(expected, chosen, fixed, cost)
        best = max(_rate(expected, list(bs), fixed, cost) for bs in itertools.product(ladder, repeat=n))
        assert got >= plain - 1e-12
        assert got >= 0.9 * best, (got, best, chosen)  # greedy on a concave surrogate: near the exhaustive best


def test_trees_shrink_as_the_batch_grows():
    rng = random.Random(7)
    cost = VerifyCostModel({1: 1.0, 16: 1.1, 64: 1.6, 256: 4.0, 1024: 16.0})
    e = _expected(rng, 64)
    means = []
    for n in (1, 4, 16, 64):
        chosen = allocate_budgets([e] * n, 0, cost)
        means.append(sum(chosen) / n)
    print("mean budget at 1 / 4 / 16 / 64 requests:", means)
    assert means == sorted(means, reverse=True) and means[0] > means[-1]


def test_no_draft_means_plain():
    cost = VerifyCostModel({1: 1.0, 64: 1.0})
    assert allocate_budgets([torch.zeros(0, dtype=torch.float64)], 3, cost) == [0]
