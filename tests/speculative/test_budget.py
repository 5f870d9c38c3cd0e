"""--budget auto: verify cost curve, surrogate prefix sums, calibration, choice, and the auto loop."""

import itertools
import math
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.budget import (AcceptanceCalibration, AutoBudget, VerifyCostModel, auto_max_budget,
                                       default_candidates, expected_accepted_by_budget, set_verify_cost,
                                       verify_cost_for)
from kdtree_engine.speculative.decode import SpecConfig, SpecError, generate
from kdtree_engine.speculative.tree import build_tree_heap
from kdtree_engine.sampling import topk_logprobs

from spec_toys import (PrefixTarget, ToyDrafter, chi_square_pvalue, oracle_proposals, random_proposals,
                       target_chain_proposals)
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)


def _brute_force(lp: torch.Tensor) -> list[float]:
    """All prefixes of the factorized distribution over the top-K lists, by probability, descending."""
    L, K = lp.shape
    probs = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            probs.append(math.exp(sum(float(lp[i, r]) for i, r in enumerate(ranks))))
    return sorted(probs, reverse=True)


@pytest.mark.parametrize("seed", range(40))
def test_prefix_sums_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    L, V = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(2, 6, (1,), generator=g))
    K = int(torch.randint(1, V + 1, (1,), generator=g))
    lp, ids = topk_logprobs(torch.randn(L, V, generator=g) * 2, K, policy=POLICY)
    probs = _brute_force(lp)
    max_budget = len(probs) + 3  # past the number of prefixes: the tail stays flat
    e = expected_accepted_by_budget(lp, max_budget)
    assert e.shape == (max_budget,) and e.dtype == torch.float64
    want = torch.tensor(list(itertools.accumulate(probs)) + [sum(probs)] * 3, dtype=torch.float64)
    torch.testing.assert_close(e, want, rtol=1e-5, atol=1e-6)
    # and it is the surrogate of exactly the tree the builder makes for each budget
    rank = [{int(t): r for r, t in enumerate(row)} for row in ids.tolist()]
    for b in range(1, min(max_budget, 12) + 1):
        tree = build_tree_heap(lp, ids, b, 0, 0)
        surrogate = 0.0
        for i in range(1, tree.num_nodes):
            path = torch.nonzero(tree.mask[i]).squeeze(-1).tolist()[1:]  # root excluded
            surrogate += math.exp(sum(float(lp[d - 1, rank[d - 1][int(tree.tokens[j])]])
                                      for j in path for d in [int(tree.depths[j])]))
        assert surrogate == pytest.approx(float(e[b - 1]), rel=1e-5, abs=1e-6), b


def test_prefix_sums_edge_cases():
    assert expected_accepted_by_budget(torch.empty(0, 4), 3).tolist() == [0.0, 0.0, 0.0]
    lp = torch.log(torch.tensor([[0.5, 0.3], [0.9, 0.1]]))
    # prefixes: a=.5, b=.3, aa=.45, ba=.27, ab=.05, bb=.03 -> .5 .45 .3 .27 .05 .03
    torch.testing.assert_close(expected_accepted_by_budget(lp, 7),
                               torch.tensor([.5, .95, 1.25, 1.52, 1.57, 1.6, 1.6], dtype=torch.float64))
    with pytest.raises(ValueError):
        expected_accepted_by_budget(lp, 0)


def test_cost_model_interpolates_and_extrapolates():
    m = VerifyCostModel({1: 1.0, 4: 4.0, 8: 6.0})
    assert m(1) == 1.0 and m(2) == pytest.approx(2.0) and m(6) == pytest.approx(5.0)
    assert m(0.5) == 1.0  # held below the grid
    assert m(12) == pytest.approx(8.0)  # the last segment's slope continues
    assert m([1, 8]).tolist() == [1.0, 6.0]
    assert VerifyCostModel({1: 2.0, 4: 1.0})(10) == pytest.approx(1.0)  # never extrapolates downward
    with pytest.raises(ValueError):
        VerifyCostModel({})
    with pytest.raises(ValueError):
        VerifyCostModel({0: 1.0})


def _peaked_lp(L=8, K=64, top=0.8):
    """A confident drafter: every depth's top token has probability ``top``."""
    p = torch.full((L, K), (1 - top) / (K - 1))
    p[:, 0] = top
    return p.log()


def test_flat_cost_picks_largest_budget():
    cost = VerifyCostModel({1: 1e-3, 512: 1e-3})
    ab = AutoBudget(cost, 64)
    assert ab.candidates == (1, 2, 4, 8, 16, 32, 64)
    assert ab.choose(_peaked_lp()) == 64


def test_steep_cost_picks_small_budget():
    ab = AutoBudget(VerifyCostModel({1: 1e-3, 2: 1.1e-3, 4: 3e-3, 8: 8e-3, 16: 2e-2, 128: 2e-1}), 64)
    b = ab.choose(_peaked_lp())
    assert b <= 4
    # the same drafter under a flat curve uses a much larger tree
    assert AutoBudget(VerifyCostModel({1: 1e-3, 128: 1.05e-3}), 64).choose(_peaked_lp()) > 4 * b


def test_choice_is_the_argmax_of_the_rate():
    cost = VerifyCostModel({1: 1e-3, 2: 1.2e-3, 4: 1.5e-3, 8: 2.5e-3, 16: 5e-3, 32: 1e-2, 65: 2e-2})
    ab = AutoBudget(cost, 64)
    ab.t_draft.update(2e-3)
    ab.t_overhead.update(0.5e-3)
    lp = _peaked_lp(top=0.6)
    e = expected_accepted_by_budget(lp, 64)
    rate = {b: (1 + float(e[b - 1])) / (cost(b + 1) + 2.5e-3) for b in ab.candidates}
    assert ab.choose(lp) == max(rate, key=rate.get)


@pytest.mark.parametrize("seed", range(30))
def test_early_stopping_choice_equals_full_argmax(seed):
    g = torch.Generator().manual_seed(seed)
    L, V = int(torch.randint(1, 8, (1,), generator=g)), int(torch.randint(2, 300, (1,), generator=g))
    max_budget = auto_max_budget(L + 1, V, cap=int(torch.randint(1, 200, (1,), generator=g)))
    lp, _ = topk_logprobs(torch.randn(L, V, generator=g) * float(torch.rand(1, generator=g) * 6), max_budget, policy=POLICY)
    ns = sorted({1, *torch.randint(2, 300, (4,), generator=g).tolist()})
    secs = torch.rand(len(ns), generator=g).sort().values * 1e-2 * float(torch.rand(1, generator=g) * 4)
    ab = AutoBudget(VerifyCostModel(dict(zip(ns, secs.tolist()))), max_budget)
    ab.t_draft.update(float(torch.rand(1, generator=g)) * 5e-3)
    ab.calibration.update(float(torch.rand(1, generator=g)) * 3, 1.0)
    want = ab.candidates[int(torch.argmax(ab.rates(expected_accepted_by_budget(lp, max_budget))))]
    assert ab.choose(lp) == want


def test_fixed_time_costs_favour_bigger_trees():
    cost = VerifyCostModel({1: 1e-3, 2: 1.1e-3, 4: 3e-3, 8: 8e-3, 16: 2e-2, 128: 2e-1})
    cheap, dear = AutoBudget(cost, 64), AutoBudget(cost, 64)
    dear.t_draft.update(0.2)  # a slow drafter: a round is expensive anyway, so verify more
    lp = _peaked_lp()
    assert dear.choose(lp) > cheap.choose(lp)


def test_calibration_moves_toward_observed():
    c = AcceptanceCalibration(alpha=0.2)
    assert c.factor == 1.0
    seen = [c.update(observed=1.0, predicted=2.0) for _ in range(60)]
    assert seen[0] < 1.0 and all(a >= b for a, b in zip(seen, seen[1:]))
    assert seen[-1] == pytest.approx(0.5, abs=0.02)
    for _ in range(60):
        c.update(observed=3.0, predicted=2.0)
    assert c.factor == pytest.approx(1.5, abs=0.05)


def test_overconfident_drafter_shrinks_the_tree():
    cost = VerifyCostModel({1: 1e-3, 2: 1.1e-3, 4: 1.5e-3, 8: 2.5e-3, 16: 5e-3, 32: 1e-2, 65: 2e-2})
    ab = AutoBudget(cost, 64)
    lp = _peaked_lp(top=0.9)
    first = ab.choose(lp)
    for _ in range(50):
        ab.observe(0, draft_s=1e-3, overhead_s=1e-4)  # it predicted a lot; nothing is accepted
        last = ab.choose(lp)
    assert ab.calibration.factor < 0.1 and last < first
    assert last == 1
    assert sum(ab.histogram().values()) == 51


def test_verify_scale_tracks_observed_verify_time():
    ab = AutoBudget(VerifyCostModel({1: 1e-3, 65: 1e-3}), 64)
    for _ in range(40):
        ab.choose(_peaked_lp())
        ab.observe(3, draft_s=0.0, overhead_s=0.0, verify_s=2e-3)
    assert ab.verify_scale.value == pytest.approx(2.0, abs=0.05)
    ab.observe(3, 0.0, 0.0)  # no pending choice: ignored
    assert len(ab.chosen) == 40


def test_candidates_and_max_budget():
    assert default_candidates(1) == (1,)
    assert default_candidates(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert auto_max_budget(16, 163840) == 256
    assert auto_max_budget(3, 3) == 3 + 9  # a 2-deep tree over 3 tokens holds 12 nodes
    assert AutoBudget(VerifyCostModel({1: 1.0}), 10, candidates=[3, 50, 0]).candidates == (3,)


def test_measured_curve_is_cached_per_model_device_dtype():
    target = Target.random(preset("k2-tiny").replace(num_hidden_layers=2), seed=0)
    m = verify_cost_for(target, context=16, max_nodes=9, warmup=1, repeats=2)
    assert m.source == "measured" and [n for n, _ in m.points()] == [1, 2, 4, 8, 9]
    assert all(t > 0 for _, t in m.points())
    assert verify_cost_for(target, context=500, max_nodes=300) is m  # measured once
    set_verify_cost(target, {1: 1.0, 2: 2.0})
    assert verify_cost_for(target, context=16, max_nodes=9).source == "injected"
    set_verify_cost(target, None)
    # the toy target (no reservable cache) is measured through a dummy prefill
    toy = PrefixTarget(vocab=8)
    assert VerifyCostModel.measure(toy, context=4, max_nodes=4, repeats=1).max_nodes == 4


class _Clock:
    """A fake time.perf_counter: seconds pass only when the timed target runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _TimedCache:
    def __init__(self) -> None:
        self.length = 0

    def reserve(self, n: int) -> None:
        self.length += n

    def commit_all(self) -> None:
        pass

    def crop(self, n: int) -> None:
        self.length = n


class _TimedTarget:
    """A target whose verify of n tokens takes cost(n) seconds of the fake clock, plus what ``extra`` (call
    index -> seconds) adds: the interference of other work on the machine, which only ever adds time."""

    def __init__(self, clock: _Clock, cost, extra) -> None:
        self.cfg = preset("k2-tiny")
        self.device = torch.device("cpu")
        self.clock, self.cost, self.extra = clock, cost, extra
        self.sizes: list[int] = []

    def new_cache(self, capacity: int) -> _TimedCache:
        return _TimedCache()

    def __call__(self, ids, cache, positions=None, tree_mask=None):
        n = len(ids)
        assert tree_mask.shape == (n, n) and positions[0].item() == cache.length
        self.clock.now += self.cost(n) + self.extra(len(self.sizes))
        self.sizes.append(n)


def _measure_timed(monkeypatch, cost, extra, repeats=5, max_nodes=257):
    from kdtree_engine.speculative import budget
    clock = _Clock()
    monkeypatch.setattr(budget, "time", clock)
    target = _TimedTarget(clock, cost, extra)
    return VerifyCostModel.measure(target, context=40, max_nodes=max_nodes, warmup=1, repeats=repeats), target


@pytest.mark.parametrize("seed", range(6))
def test_measured_curve_survives_a_slow_phase(monkeypatch, seed):
    """A slow phase of the machine (fresh random start, length and size) covering up to a whole pass of the grid,
    plus random spikes that leave each size at least one clean run, costs the curve nothing: each size keeps its
    fastest run of interleaved passes. Under the earlier estimator (all repeats of one size in a row, their median,
    then a running maximum) the same phase over the small sizes made the curve flat and the chooser took the
    largest tree."""
    g = torch.Generator().manual_seed(seed)
    grid = default_candidates(257)
    cost = lambda n: 5e-3 + 2e-4 * n  # noqa: E731  seconds: steep, so the best budget is small
    calls = (1 + 5) * len(grid)
    start = int(torch.randint(len(grid), calls - 2 * len(grid), (1,), generator=g))   # within the timed passes
    slow = set(range(start, start + int(torch.randint(1, len(grid) + 1, (1,), generator=g))))
    spikes = set(torch.randint(0, calls, (4,), generator=g).tolist())
    level = float(torch.empty(()).uniform_(0.5, 5.0, generator=g))   # seconds: far above every true cost

    def extra(i):
        return level if i in slow or i in spikes else 0.0

    m, target = _measure_timed(monkeypatch, cost, extra)
    assert sorted(Counter(target.sizes).items()) == [(n, 6) for n in grid]   # 1 warm-up + 5 timed passes each
    assert target.sizes[:2 * len(grid)] == list(grid) + list(grid)[::-1]     # passes alternate direction
    clean = {n for n in grid if any(extra(i) == 0.0 for i, s in enumerate(target.sizes) if s == n and
                                    i >= len(grid))}
    assert clean == set(grid)   # the setting leaves every size a clean timed run
    assert [n for n, _ in m.points()] == list(grid)
    assert [t for _, t in m.points()] == pytest.approx([cost(n) for n in grid], rel=1e-9)
    true = AutoBudget(VerifyCostModel({n: cost(n) for n in grid}), 256)
    assert AutoBudget(m, 256).choose(_peaked_lp()) == true.choose(_peaked_lp()) < 16


def test_measured_curve_is_non_decreasing_from_the_right(monkeypatch):
    """A size slowed in every one of its runs cannot cost more than a larger size: the curve takes the least
    time at that size or above (the true cost never falls as the tree grows)."""
    m, target = _measure_timed(monkeypatch, lambda n: 1e-3 * n + (1.0 if n == 2 else 0.0), lambda i: 0.0,
                               repeats=3, max_nodes=8)
    assert [n for n, _ in m.points()] == [1, 2, 4, 8]
    assert [t for _, t in m.points()] == pytest.approx([1e-3, 4e-3, 4e-3, 8e-3], rel=1e-9)
    with pytest.raises(ValueError, match="repeats"):
        VerifyCostModel.measure(target, context=40, max_nodes=8, repeats=0)


def test_spec_config_accepts_auto():
    assert SpecConfig(method="ddtree", budget="auto").budget == "auto"
    with pytest.raises(SpecError, match="budget="):
        SpecConfig(method="ddtree", budget="fast")
    with pytest.raises(SpecError, match="budget="):
        SpecConfig(method="dflash", budget="auto")
    with pytest.raises(SpecError, match="budget="):
        SpecConfig(method="ddtree", budget=1.5)


def _drafter_cfg(tcfg, block):
    ids = tuple(sorted({0, tcfg.num_hidden_layers - 1}))
    return DraftConfig(hidden_size=tcfg.hidden_size, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=block,
                       mask_token_id=tcfg.vocab_size - 1, target_layer_ids=ids,
                       num_target_layers=tcfg.num_hidden_layers, vocab_size=tcfg.vocab_size)


@pytest.mark.parametrize("curve", ["measured", "flat", "steep"])
def test_auto_greedy_equals_plain(curve):
    cfg = preset("k2-tiny").replace(num_hidden_layers=2)
    target = Target.random(cfg, seed=4)
    if curve == "flat":
        set_verify_cost(target, {1: 1e-3, 512: 1e-3})
    elif curve == "steep":
        set_verify_cost(target, {1: 1e-3, 2: 5e-3, 8: 1e-1, 512: 10.0})
    prompt = [5, 17, 3, 9, 11]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    ref = generate(target, prompt, params)
    drafter = DFlashDrafter.random(_drafter_cfg(cfg, block=5), seed=2)
    oracle = ToyDrafter(5, oracle_proposals(prompt + ref.token_ids, cfg.vocab_size, seed=1, miss=0.3),
                        target_layer_ids=(0, 1))
    for d in (drafter, oracle):
        r = generate(target, prompt, params, spec="ddtree", drafter=d, budget="auto")
        assert r.token_ids == ref.token_ids, (curve, type(d).__name__)
        s = r.stats
        assert s["budget"] == "auto" and sum(s["budget_chosen"].values()) >= 1
        assert set(s["budget_chosen"]) <= set(s["budget_auto"]["candidates"])
        assert s["accepted_tokens"] == sum(s["accepted_per_depth"])
    if curve == "flat":  # free verify: the largest tree every round
        assert set(r.stats["budget_chosen"]) == {r.stats["budget_auto"]["candidates"][-1]}
    if curve == "steep":
        assert max(r.stats["budget_chosen"]) <= 2
    set_verify_cost(target, None)


def test_auto_sampling_runs():
    target = PrefixTarget(vocab=6, seed=3)
    set_verify_cost(target, {1: 1e-4, 64: 1e-3})
    d = ToyDrafter(4, random_proposals(6, seed=1), target_layer_ids=(0,))
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    # the tree shape follows measured stage times, so a seed fixes the distribution, not the tokens
    a = generate(target, [1, 2], p, spec=SpecConfig("ddtree", "auto"), drafter=d)
    assert len(a.token_ids) == 12 and a.stats["budget_auto"]["cost_source"] == "injected"
    # max_tokens 0 still reports the auto fields
    z = generate(target, [1, 2], SamplingParams(max_tokens=0), spec="ddtree", drafter=d, budget="auto")
    assert z.stats["budget"] == "auto" and z.stats["budget_chosen"] == {}


def test_auto_sampled_distribution_equals_target():
    """Whatever budgets are chosen, sampled output keeps the target's exact distribution."""
    V, prompt, n_tokens = 6, [3, 5], 3
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    target = PrefixTarget(V, seed=11, scale=1.2)
    set_verify_cost(target, {1: 1e-4, 2: 1.2e-4, 4: 2e-4, 8: 6e-4, 64: 1e-2})  # mid-size trees win
    drafter = ToyDrafter(4, target_chain_proposals(target), decode_ctx=True)
    exact = target.sequence_distribution(prompt, n_tokens, params)
    counts: Counter = Counter()
    chosen: Counter = Counter()
    n = 1000
    for i in range(n):
        r = generate(target, prompt, replace(params, seed=1000 + i), spec="ddtree", drafter=drafter, budget="auto")
        counts[tuple(r.token_ids[:n_tokens])] += 1
        chosen.update(r.stats["budget_chosen"])
    assert len(chosen) >= 2  # the choice does vary with the drafter's distributions
    stat, p = chi_square_pvalue(counts, exact, n)
    print(f"auto chi2={stat:.1f} p={p:.3g} chosen={dict(chosen)}")
    assert p > 1e-4, (stat, p, chosen)


def test_running_mean_skips_its_warmup_updates():
    """A timing's first calls compile kernels: the warm-up updates are not observations, the rest average as usual
    (plain means first, then the moving average)."""
    from kdtree_engine.speculative.budget import RunningMean
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    xs = [rng.uniform(0.5, 2.0) for _ in range(30)]
    m = RunningMean(0.1, warmup=2)
    m.update(100.0)
    m.update(50.0)
    assert m.value == 0.0 and m.n == 0
    plain = RunningMean(0.1)
    for x in xs:
        m.update(x)
        plain.update(x)
    assert m.value == plain.value and m.n == plain.n == 30
    assert abs(RunningMean(1.0).update(3.0) - 3.0) < 1e-12


def test_recent_median_is_the_lower_median_of_the_last_samples():
    """The host stages' cost: the lower median of the last ``window`` samples after the warm-up (oracle: statistics'
    median_low over the same window), so one slow sample among fast ones never becomes the estimate."""
    import statistics
    from kdtree_engine.speculative.budget import RecentMedian
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    window = rng.randint(1, 9)
    m = RecentMedian(window, prior=0.25, warmup=1)
    assert m.update(1e3) == 0.25 and m.n == 0   # the warm-up: not a sample
    xs = []
    for _ in range(40):
        xs.append(rng.uniform(1e-4, 1e-2) if rng.random() > 0.2 else rng.uniform(1.0, 10.0))
        got = m.update(xs[-1])
        assert got == m.value == statistics.median_low(xs[-window:]) and m.n == len(xs)
    heal = RecentMedian(8)
    heal.update(5.0)                      # one slow pass...
    for x in (1e-3, 2e-3, 1.5e-3):        # ...and the next fast ones outvote it
        heal.update(x)
    assert heal.value == 1.5e-3
    with pytest.raises(ValueError, match="window"):
        RecentMedian(0)
