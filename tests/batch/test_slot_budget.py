"""The load-aware budget of tree slots (kdtree_engine/batch/slot_budget.py) in simulated worlds: each budget's step
costs a known number of seconds at each slot count (with noise) and emits a known mean of tokens a slot; the oracle
is the budget of the highest true tokens per second. Seeds printed."""

from __future__ import annotations

import random

import pytest

from kdtree_engine.batch.slot_budget import BACKOFF_MAX, LADDER, SETTLE, SlotBudget, ladder


def simulate(rng: random.Random, chooser: SlotBudget, seconds, tokens, slots: int, steps: int) -> list[int]:
    """``steps`` steps at ``slots`` slots; seconds(b, n) and tokens(b) the world's truth. Returns the budgets run."""
    ran = []
    for _ in range(steps):
        b = chooser.choose(slots)
        noise = 1.0 + rng.uniform(-0.05, 0.05)
        emitted = 1.0 if b == 0 else max(1.0, rng.gauss(tokens(b), 0.5))
        chooser.record(b, slots, seconds(b, slots) * noise, emitted, captured=rng.random() < 0.01)
        ran.append(b)
    return ran


@pytest.mark.parametrize("world", ["trees-pay", "plain-pays"])
def test_the_chosen_budget_is_the_fastest_and_looking_costs_little(world: str) -> None:
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    plain = rng.uniform(1e-3, 20e-3)                    # a plain step's seconds at one slot
    per_node = rng.uniform(0.002, 0.05) * plain         # what a verified node adds
    draft = rng.uniform(0.1, 0.6) * plain               # a draft pass
    tau = {b: 1.0 + rng.uniform(1.0, 4.0) * (1 - 0.5 ** (b / 4)) for b in LADDER}   # more nodes, more tokens
    if world == "plain-pays":   # a verified node costs enough at this many slots that no tree can pay
        per_node = max(per_node, 0.02 * plain)
    slots = 2 if world == "trees-pay" else 512

    def seconds(b: int, n: int) -> float:
        return plain + n * per_node * (b + 1) + (draft if b else 0.0)

    def rate(b: int) -> float:
        return (tau[b] if b else 1.0) / seconds(b, slots)
    truth = max(ladder(32), key=rate)
    if world == "plain-pays":
        assert truth == 0, "the world's trees should lose at this many slots"
    chooser = SlotBudget(32)
    ran = simulate(rng, chooser, seconds, lambda b: tau[b], slots, 4000)
    late = ran[1000:]
    assert rate(chooser.best(slots)) >= 0.9 * rate(truth)
    # the steps at a budget clearly slower than the best (near-ties are a fair choice either way, within the noise):
    # the tries of the others after their doubling waits
    off = sum(rate(b) < 0.8 * rate(truth) for b in late) / len(late)
    assert off < 0.05, f"{off:.3f} of the steps off the best budget"
    got = sum(rate(b) for b in late) / len(late)
    assert got >= 0.95 * rate(truth), (got, rate(truth))


def test_a_new_slot_count_is_measured_and_the_choice_follows_the_load() -> None:
    """Trees pay at 4 slots and lose at 64: the choice moves to budget 0 as the group grows, and back as it
    shrinks."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)

    def seconds(b: int, n: int) -> float:
        return 1e-3 * (1 + 0.02 * n * (b + 1)) + (0.3e-3 if b else 0.0)

    tau = {b: 1 + 3 * (1 - 0.5 ** (b / 4)) for b in LADDER}
    chooser = SlotBudget(32)
    small = simulate(rng, chooser, seconds, lambda b: tau[b], 4, 600)
    big = simulate(rng, chooser, seconds, lambda b: tau[b], 64, 600)
    again = simulate(rng, chooser, seconds, lambda b: tau[b], 4, 600)
    assert max(set(small[300:]), key=small[300:].count) > 0
    assert max(set(big[300:]), key=big[300:].count) == 0
    assert max(set(again[300:]), key=again[300:].count) > 0


def test_the_ladder_and_the_wait_bound() -> None:
    assert ladder(256) == (0,) + LADDER and ladder(8) == (0, 4, 8) and ladder(3) == (0, 3)
    chooser = SlotBudget(16)
    for _ in range(5000):   # a budget that always loses is still tried, at most BACKOFF_MAX steps apart
        b = chooser.choose(8)
        chooser.record(b, 8, 1.0 if b == 0 else 10.0, 1.0, captured=False)
    assert max(chooser.wait.values()) <= BACKOFF_MAX
    assert chooser.best(8) == 0


def test_no_tree_is_tried_where_plain_won_with_fewer_slots() -> None:
    """Plain steps the best at 8 slots: at 16 and 32 slots the group runs plain steps without trying a tree (each try
    would capture a graph) and prefers plain there; a tree that wins again at 8 lifts the rule."""
    chooser = SlotBudget(32)
    for _ in range(200):
        b = chooser.choose(8)
        chooser.record(b, 8, 1.0 if b == 0 else 4.0, 2.0, captured=False)
    assert chooser.prefers_plain(8)
    ran = []
    for n in (16, 32):
        for _ in range(50):
            ran.append(chooser.choose(n))
            chooser.record(ran[-1], n, 1.0, 1.0, captured=False)
    assert set(ran) == {0} and chooser.prefers_plain(16) and chooser.prefers_plain(32)
    for _ in range(2000):   # trees got cheap at 8: found on their next tries, and allowed at 16 again
        b = chooser.choose(8)
        chooser.record(b, 8, 1.0 if b == 0 else 0.5, 2.0, captured=False)
    assert chooser.best(8) > 0 and not chooser.prefers_plain(16)
    tried = []
    for _ in range(SETTLE + 1):   # settled at 16 again: a tree is tried there
        tried.append(chooser.choose(16))
        chooser.record(tried[-1], 16, 1.0, 1.0, captured=False)
    assert max(tried) > 0, tried


def test_a_burst_through_many_slot_counts_measures_few_budgets_and_finds_the_best() -> None:
    """A group growing 1 -> 64 slots (three steps at every slot count on the way, then many at 64): one budget
    measured at each count passed through (each a captured graph on CUDA), and at every count where it settles the chosen budget's
    true rate is within 10% of the best budget's (the oracle: every budget's true rate, brute force). The world's
    rate along the ladder may dip at budget 4 (a draft pass's price) and still be best at 0 or a bigger tree."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    plain = rng.uniform(1e-3, 10e-3)
    per_node = rng.uniform(0.0005, 0.01) * plain
    draft = rng.uniform(0.1, 0.8) * plain
    tau = {b: 1.0 + rng.uniform(0.5, 4.0) * (1 - 0.5 ** (b / 4)) for b in LADDER}

    def seconds(b: int, n: int) -> float:
        return plain * (1 + 0.01 * n) + n * per_node * (b + 1) + (draft if b else 0.0)

    def rate(b: int, n: int) -> float:
        return (tau[b] if b else 1.0) / seconds(b, n)
    chooser = SlotBudget(32)
    for n in (1, 2, 4, 8, 16, 32):   # passed through: a few steps at each count, the best alone (one capture)
        simulate(rng, chooser, seconds, lambda b: tau[b], n, 3)
        measured = {b for (b, m) in chooser.seconds if m == n}
        assert len(measured) <= 1, (n, sorted(measured))
    n = 64
    simulate(rng, chooser, seconds, lambda b: tau[b], n, BACKOFF_MAX - 1)
    simulate(rng, chooser, seconds, lambda b: tau[b], n, 600)   # past BACKOFF_MAX: the far rungs looked at too
    truth = max(ladder(32), key=lambda b: rate(b, n))
    got = chooser.best(n)
    assert rate(got, n) >= 0.9 * rate(truth, n), (got, truth, {b: rate(b, n) for b in ladder(32)})


def test_a_slot_count_passed_through_tries_nothing_but_the_best() -> None:
    """A burst's tail: the slots halve every few steps as requests end; at each count only the best budget runs (one
    capture a count on CUDA), and once the group stays at a count its other budgets are tried."""
    chooser = SlotBudget(32)
    cost = {0: 1.0, 4: 0.5, 8: 0.45, 16: 0.5, 32: 0.7}
    for _ in range(200):
        b = chooser.choose(64)
        chooser.record(b, 64, cost[b], 2.0, captured=False)
    for n in (32, 16, 8, 4, 2, 1):
        for _ in range(SETTLE):
            b = chooser.choose(n)
            chooser.record(b, n, cost[b], 2.0, captured=False)
        assert {b for (b, m) in chooser.seconds if m == n} == {chooser.best(64)}, n
    ran = []
    for _ in range(4 * SETTLE):
        ran.append(chooser.choose(1))
        chooser.record(ran[-1], 1, cost[ran[-1]], 2.0, captured=False)
    assert len(set(ran)) > 1, ran


def test_plain_is_weighed_beside_a_tree_that_looks_best_among_trees() -> None:
    """Trees of 8 beat trees of 4 and 16 but plain steps beat them all (a dear draft pass): the group finds plain
    though the trees' ladder alone has its top at 8."""
    chooser = SlotBudget(32)
    cost = {0: 1.0, 4: 3.0, 8: 2.2, 16: 2.6, 32: 3.5}
    for _ in range(BACKOFF_MAX - 1):
        b = chooser.choose(2)
        chooser.record(b, 2, cost[b], 2.0, captured=False)
    assert chooser.best(2) == 0 and chooser.prefers_plain(2)
    assert (32, 2) not in chooser.seconds   # not next to the best tree: not measured before BACKOFF_MAX steps


def test_plain_steps_outside_the_slots_set_what_a_tree_must_beat() -> None:
    """The slots' own plain steps wait for their reads and look slow; the plain batched steps outside the slots (run
    ahead of their reads) are what budget 0 stands for once they are measured: a group whose trees beat the slots'
    plain steps but not the outside ones prefers plain, and one whose trees beat both keeps its best tree."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    slots = rng.choice([4, 16, 64])
    plain = rng.uniform(1e-3, 20e-3)
    tau = {b: 1.0 + 0.4 * b ** 0.5 for b in LADDER}

    def seconds(b: int, n: int) -> float:   # a tree step a little dearer than a plain one, and a better rate
        return plain * (1.0 + 0.01 * b)

    outside: dict[int, float] = {}
    chooser = SlotBudget(32, lambda n: outside.get(n))
    simulate(rng, chooser, seconds, lambda b: tau[b], slots, 200)
    best = chooser.best(slots)
    assert best != 0 and not chooser.prefers_plain(slots) and chooser.settled(slots)
    tree_rate = tau[best] / seconds(best, slots)
    outside[slots] = 1.2 * tree_rate             # plain batched steps outside run faster than the best tree
    assert chooser.best(slots) == 0
    simulate(rng, chooser, seconds, lambda b: tau[b], slots, 50)   # the budgets next to plain are weighed too
    assert chooser.best(slots) == 0 and chooser.prefers_plain(slots)
    outside[slots] = 0.8 * tree_rate             # ... or slower: the tree stays
    assert chooser.best(slots) == best and not chooser.prefers_plain(slots)
    assert not chooser.settled(2 * slots)        # another count: not run there
