"""The scheduler's bookkeeping: cache blocks, cancellation, the row budget, admission and refusal."""

import math
import random

import pytest

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.cache import BLOCK
from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.errors import PromptError, SpecError
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate


def _pair(seed: int, layers: int = 2, pool_tokens: int | None = None):
    cfg = preset("k2-tiny").replace(num_hidden_layers=layers, vocab_size=96)
    target = Target.random(cfg, seed=seed)
    if pool_tokens is not None:
        target.init_cache_pool(tokens=pool_tokens)
    ids = tuple(sorted({0, layers - 1}))
    dcfg = DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=cfg.vocab_size - 1,
                       target_layer_ids=ids, num_target_layers=layers, vocab_size=cfg.vocab_size)
    return target, DFlashDrafter.random(dcfg, seed=seed)


def _prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(2, 95) for _ in range(rng.randint(lo, hi))]


def test_thousand_requests_leave_the_pool_as_it_started():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed, layers=1, pool_tokens=40 * BLOCK)
    pool = target.pool()
    free = sorted(pool.free_ids())
    sched = Scheduler(target, drafter, token_budget=48, prefill_chunk=16)
    methods = [("none", None), ("dflash", None), ("ddtree", 3), ("ddtree", 8)]
    seqs, cancelled = [], 0
    for i in range(1000):
        m, b = methods[i % 4]
        seqs.append(sched.submit(_prompt(rng, 1, 40), SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=True,
                                                                     temperature=rng.choice([0.0, 1.0]), seed=i),
                                 spec=m, budget=b))
        if rng.random() < 0.3:
            sched.step()
        if rng.random() < 0.05:  # a request cancelled wherever it is: waiting, in prefill or mid-decode
            rng.choice(seqs).cancel()
            cancelled += 1
        assert pool.free_blocks + sum(len(s.rounds.cache.blocks) for s in sched.active) == pool.num_blocks
    sched.run()
    assert all(s.done for s in seqs)
    assert sum(s.result.finish_reason == "abort" for s in seqs) <= cancelled
    assert sorted(pool.free_ids()) == free


def test_cancel_mid_round_frees_its_blocks():
    target, drafter = _pair(3)
    pool = target.pool()
    before = pool.free_blocks
    sched = Scheduler(target, drafter)
    a = sched.submit(list(range(2, 40)), SamplingParams(max_tokens=200, ignore_eos=True), spec="ddtree", budget=4)
    b = sched.submit(list(range(5, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(4):
        sched.step()
    held = len(a.rounds.cache.blocks)
    assert held > 0 and not a.done
    a.cancel()
    ended = sched.step()
    assert a in ended and a.result.finish_reason == "abort" and 0 < len(a.result.token_ids) < 200
    assert not a.rounds.cache.blocks and pool.free_blocks == before - len(b.rounds.cache.blocks)
    sched.run()
    assert pool.free_blocks == before
    # the other request never noticed
    assert b.result.token_ids == generate(target, list(range(5, 30)), SamplingParams(max_tokens=20,
                                                                                     ignore_eos=True)).token_ids


def test_rows_per_forward_stay_within_the_budget(monkeypatch):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed)
    rows: list[tuple[int, int]] = []
    real = target.forward_batch

    def counted(parts, aux_layers=()):
        rows.append((sum(p.ids.shape[0] for p in parts), len(parts)))
        return real(parts, aux_layers)
    monkeypatch.setattr(target, "forward_batch", counted)
    budget, chunk = 24, 16
    sched = Scheduler(target, drafter, token_budget=budget, prefill_chunk=chunk)
    for i in range(12):
        sched.submit(_prompt(rng, 1, 60), SamplingParams(max_tokens=8, ignore_eos=True),
                     spec=["none", "ddtree"][i % 2], budget=None if i % 2 == 0 else 4)
    sched.run()
    # a forward over the budget is one prompt chunk alone (a chunk runs when nothing else does)
    assert all(r <= budget or (n == 1 and r <= chunk) for r, n in rows), rows
    assert max(n for _, n in rows) > 1


def test_a_request_waits_for_blocks_and_matches_its_solo_run():
    target, drafter = _pair(5, pool_tokens=4 * BLOCK)
    params = SamplingParams(max_tokens=70, ignore_eos=True)
    prompts = [list(range(2, 60)), list(range(3, 50)), list(range(7, 20))]
    sched = Scheduler(target, drafter)
    seqs = [sched.submit(p, params, spec="ddtree", budget=4) for p in prompts]
    sched.step()
    assert seqs[0].state != "waiting" and seqs[1].state == "waiting" and seqs[2].state == "waiting"
    sched.run()
    for p, s in zip(prompts, seqs):
        assert s.result.token_ids == generate(target, p, params, spec="ddtree", drafter=drafter, budget=4,
                                              eager=True).token_ids
        assert s.result.stats["queued_s"] >= 0


def test_requests_that_can_never_fit_are_refused_at_submit():
    target, drafter = _pair(6, pool_tokens=2 * BLOCK)
    sched = Scheduler(target, drafter)
    with pytest.raises(PromptError, match="prompt has 130 tokens"):
        sched.submit([5] * 130, SamplingParams(max_tokens=4))
    with pytest.raises(PromptError, match="empty"):
        sched.submit([], SamplingParams(max_tokens=4))
    with pytest.raises(SpecError, match="token_budget"):
        Scheduler(target, drafter, token_budget=0)
    with pytest.raises(SpecError, match="needs a drafter"):
        Scheduler(target).submit([3, 4], spec="ddtree")
    assert sched.idle and target.pool().free_blocks == 2


def _auto_batch(requests: int, max_tokens: int, host_s: float | None = None):
    """``requests`` random prompts with the load-aware budget through one scheduler (``host_s``: the tree host time
    held at that value); returns the scheduler and each request's result beside its solo plain decoding."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [_prompt(rng, 3, 30) for _ in range(requests)]
    sched = Scheduler(target, drafter, token_budget=64)
    if host_s is not None:
        sched.tree_host_s.value = host_s
        sched.tree_host_s.update = lambda x: sched.tree_host_s.value   # held there: what the test steers by
    seqs = [sched.submit(p, params, spec="ddtree", budget="auto") for p in prompts]
    sched.run()
    return sched, [(s.result, generate(target, p, params)) for p, s in zip(prompts, seqs)]


def test_load_aware_budget_is_lossless_greedy():
    sched, results = _auto_batch(6, 12)
    for got, solo in results:
        assert got.token_ids == solo.token_ids
        assert sum(got.stats["budget_chosen"].values()) == got.stats["rounds"]
    assert sched.tree_host_s.n > 0 and sched.tree_host_s.value > 0   # the host time a tree adds was measured
    # the forwards are timed for the budgets one in TIME_EVERY (each timing stalls the host on the device), and a
    # shape of forward twice before it counts as measured (its first forward is its capture)
    from kdtree_engine.batch.scheduler import TIME_EVERY
    shapes = len(sched.observed)
    assert 1 <= sched.step_s.n <= sched.forwards // TIME_EVERY + 2 * shapes + 1, (sched.step_s.n, sched.forwards)


def test_load_aware_budget_charges_the_host_time_of_trees():
    """A tree's host time (its top-k, expected gains, tree and walk) is charged like its draft pass: when it dwarfs a
    forward, every load-aware request decodes plainly, and the output is still its solo run's."""
    _, results = _auto_batch(4, 10, host_s=1e6)
    for got, solo in results:
        assert got.token_ids == solo.token_ids
        assert set(got.stats["budget_chosen"]) == {0}, got.stats["budget_chosen"]


def test_drop_all_ends_every_request_and_frees_the_pool():
    target, drafter = _pair(8)
    pool = target.pool()
    free = sorted(pool.free_ids())
    sched = Scheduler(target, drafter, token_budget=8, prefill_chunk=8)
    seqs = [sched.submit(list(range(2, 2 + n)), SamplingParams(max_tokens=30, ignore_eos=True), spec="ddtree",
                         budget=3) for n in (5, 20, 9)]
    sched.step()
    sched.step()
    ended = sched.drop_all()
    assert sorted(s.id for s in ended) == [s.id for s in seqs] and sched.idle
    assert all(s.done and s.result.finish_reason == "abort" for s in seqs)
    assert sorted(pool.free_ids()) == free


def test_a_draft_pass_that_does_not_pay_is_spread_over_enough_plain_rounds():
    """The gap before the next draft pass is at least what keeps an unpaid pass at PROBE_SHARE of the plain rounds
    between passes, and doubles with each further unpaid pass up to MAX_PROBE_GAP (fresh random costs, printed seed)."""
    from kdtree_engine.batch.scheduler import MAX_PROBE_GAP, PROBE_SHARE
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed, layers=1)
    sched = Scheduler(target, drafter)
    for _ in range(100):
        step, draft, host = rng.uniform(1e-5, 1e-2), rng.uniform(1e-5, 1e-1), rng.uniform(0, 1e-3)
        sched.step_s.value, sched.draft_s.value, sched.tree_host_s.value = step, draft, host
        floor = math.ceil((draft + host) / (PROBE_SHARE * step))
        gaps, last = [], 0
        for _ in range(12):
            last = sched._probe_gap(last)
            gaps.append(last)
        assert gaps[0] == min(max(floor, 1), MAX_PROBE_GAP) and gaps[-1] == MAX_PROBE_GAP
        for a, b in zip(gaps, gaps[1:]):
            assert b == min(2 * a, MAX_PROBE_GAP)
        assert (draft + host) <= PROBE_SHARE * step * gaps[0] * (1 + 1e-9) or gaps[0] == MAX_PROBE_GAP
        # a probe pass measured (the first after plain rounds) prices the gap instead of the steady pass
        sched.probe_s.n, sched.probe_s.value = 1, 2 * draft
        assert sched._probe_gap(0) == min(max(math.ceil((2 * draft + host) / (PROBE_SHARE * step)), 1), MAX_PROBE_GAP)
        sched.probe_s.n = 0


def test_a_new_request_starts_from_the_batch_verdict(monkeypatch):
    """After a draft pass that did not pay, a new load-aware request starts with the gap that pass was given: its first
    rounds are plain, with no draft pass of its own (and still its solo run's tokens); after a pass that paid, a new
    request drafts at once."""
    from kdtree_engine.batch import scheduler as sched_mod
    sched, _ = _auto_batch(2, 8, host_s=1e6)   # trees never pay: every pass ends at budget 0
    gap = sched.verdict_gap
    assert gap > 0
    asked = []
    real = sched._draft
    monkeypatch.setattr(sched, "_draft",
                        lambda asks, probe=False: (asked.extend(id(a[2]) for _, a in asks), real(asks, probe))[1])
    rng = random.Random(gap)
    prompt, params = _prompt(rng, 3, 20), SamplingParams(max_tokens=min(gap, 12), ignore_eos=True)
    seq = sched.submit(prompt, params, spec="ddtree", budget="auto")
    sched.run()
    assert id(seq.rounds.dcache) not in asked and set(seq.result.stats["budget_chosen"]) == {0}
    assert seq.result.token_ids == generate(sched.target, prompt, params).token_ids
    # a pass that paid clears the verdict, and the next request drafts in its first round
    monkeypatch.setattr(sched_mod, "allocate_budgets", lambda expected, *a, **k: [min(1, len(e)) for e in expected])
    sched.verdict_gap, sched.verdict_at = 3, sched.forwards
    late = sched.submit(_prompt(rng, 3, 20), SamplingParams(max_tokens=8, ignore_eos=True), spec="ddtree",
                        budget="auto")
    sched.run()   # three plain rounds, then a pass that pays
    assert sched.verdict_gap == 0 and late.result.stats["budget_chosen"].get(0, 0) >= 3
    asked.clear()
    fresh = sched.submit(_prompt(rng, 3, 20), SamplingParams(max_tokens=3, ignore_eos=True), spec="ddtree",
                         budget="auto")
    sched.step()   # its prompt
    sched.step()   # its first round
    assert asked == [id(fresh.rounds.dcache)]
    sched.run()
    # the batch's probe schedule runs on across requests: one arriving after part of the gap waits out the rest only
    for given, elapsed in ((7, 3), (4, 9)):
        sched.verdict_gap, sched.verdict_at = given, sched.forwards - elapsed
        late = sched.submit(_prompt(rng, 3, 20), SamplingParams(max_tokens=2, ignore_eos=True), spec="ddtree",
                            budget="auto")
        sched.step()   # its admission (and prompt)
        assert late.backoff == given and late.skip == max(given - elapsed, 0), (late.skip, given, elapsed)
        sched.run()


def test_a_forward_shape_measured_twice_prices_itself():
    """The budgets price a forward by what that shape (its padded rows) took, its first forward (the capture) not
    counted; an unmeasured shape by the verify cost curve scaled by the forwards so far (fresh random costs)."""
    from kdtree_engine.speculative.budget import RunningMean, VerifyCostModel
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed, layers=1)
    sched = Scheduler(target, drafter)
    a, b, scale, took = (rng.uniform(1e-4, 1e-2) for _ in range(4))
    sched._cost = VerifyCostModel({1: a, 512: a + b})
    sched.forward_scale.value = scale
    sched.observed[4] = RunningMean(0.1, warmup=1)
    sched.observed[4].update(100.0)                      # the capture: not a sample
    assert sched._forward_cost(4) == scale * sched._cost(4)
    sched.observed[4].update(took)
    assert sched._forward_cost(4) == took
    # an unmeasured shape costs no less than a measured one of fewer rows; below every measured shape, the curve's
    assert sched._forward_cost(9) == max(scale * sched._cost(9), took)
    assert sched._forward_cost(3) == scale * sched._cost(3)


def test_a_new_request_starts_from_the_batch_calibration():
    """The drafter's own estimates may be far off on a batch's prompts: every tree's observed / predicted accepted
    drafts feed the batch's calibration too, and a new load-aware request starts from it (fresh random rounds)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed, layers=1)
    sched = Scheduler(target, drafter)
    observed = [rng.uniform(0, 3) for _ in range(5)]
    predicted = [rng.uniform(0.5, 6) for _ in range(5)]
    for o, p in zip(observed, predicted):
        sched.calibration.update(o, p)
    seq = sched.submit(_prompt(rng, 3, 20), SamplingParams(max_tokens=2, ignore_eos=True), spec="ddtree",
                       budget="auto")
    sched.step()   # its admission
    assert seq.calibration.factor == sched.calibration.factor != 1.0
    sched.run()


def test_trees_wait_for_a_measured_plain_step(monkeypatch):
    """Every tree is weighed against plain decoding: until a plain forward of the batch's shape has been measured
    (two of them: the first is its capture), a load-aware request's rounds stay plain, however good trees look; then
    the budgets decide (here: always the largest), and the tokens are still the solo run's."""
    from kdtree_engine.batch import scheduler as sched_mod
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed, layers=1)
    sched = Scheduler(target, drafter)
    monkeypatch.setattr(sched_mod, "allocate_budgets", lambda expected, *a, **k: [len(e) for e in expected])
    prompt, params = _prompt(rng, 3, 20), SamplingParams(max_tokens=10, ignore_eos=True)
    order = []
    real_chose = sched_mod.chose
    monkeypatch.setattr(sched_mod, "chose", lambda s, b: (order.append(b), real_chose(s, b)))
    seq = sched.submit(prompt, params, spec="ddtree", budget="auto")
    sched.run()
    assert order[:2] == [0, 0] and order[2] > 0, order   # the plain shape measured, then the trees
    assert seq.result.token_ids == generate(target, prompt, params).token_ids


def test_load_aware_requests_take_a_plain_requests_blocks_and_fit_their_trees_to_them(monkeypatch):
    """Host-driven load-aware requests reserve the blocks of plain decoding (so speculation never admits fewer
    requests than plain decoding would), and every tree they verify fits the room those blocks leave, even when the
    budget chooser takes the largest tree it is offered; the tokens stay their solo plain run's."""
    from kdtree_engine.batch import scheduler as sched_mod
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed, pool_tokens=64 * BLOCK)
    pool = target.pool()
    max_tokens = rng.randint(20, 40)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    # prompt + limit + 1 a whole number of blocks: the room left shrinks to nothing at the end
    prompts = [_prompt(rng, 3, 60) for _ in range(3)] + [[7] * (2 * BLOCK - 1 - max_tokens)]
    monkeypatch.setattr(sched_mod, "allocate_budgets", lambda expected, *a, **k: [len(e) for e in expected])
    sched = Scheduler(target, drafter, token_budget=1024)
    seqs = [sched.submit(p, params, spec="ddtree", budget="auto") for p in prompts]
    plain = [sched.submit(p, params) for p in prompts]
    widest = []
    forward = target.forward_batch

    def watch(parts, aux=()):
        for part in parts:   # a tree's nodes go to its cache's next slots: they must be inside its capacity
            assert part.cache.length + part.ids.shape[0] <= part.cache.capacity
            widest.append(part.ids.shape[0])
        return forward(parts, aux)
    monkeypatch.setattr(target, "forward_batch", watch)
    sched.step()
    for s, p in zip(seqs, plain):   # admitted together: the same blocks as the plain request of the same prompt
        assert len(s.rounds.cache.blocks) == len(p.rounds.cache.blocks)
    sched.run()
    assert max(widest) > BLOCK   # wide trees were verified
    for p, s in zip(prompts, seqs):
        assert s.result.token_ids == generate(target, p, params).token_ids
    assert pool.free_blocks == pool.num_blocks


def test_the_plain_rate_at_an_untimed_load_is_a_lower_bound_from_the_timed_ones():
    """Plain steps run ahead, timed at a few loads of a random world whose step time grows with the rows (no faster
    per row, never more than proportionally): at a timed load the rate is the one measured, at another a bound from
    the timed ones that never exceeds the world's true rate there, and None before anything is timed."""
    from kdtree_engine.batch.graph_step import slot_bucket
    from kdtree_engine.speculative.budget import RecentMedian
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = _pair(seed)
    sched = Scheduler(target, drafter)
    assert sched.plain_rate(8) is None and not sched.plain_timed(8)
    fixed, per_row = rng.uniform(1e-4, 1e-2), rng.uniform(1e-6, 1e-3)   # a step's seconds: fixed + per_row x rows

    def period(n: int) -> float:
        return fixed + per_row * n
    buckets = sorted({slot_bucket(2 ** k) for k in range(8)})
    timed = rng.sample(buckets, rng.randint(1, 3))
    for m in timed:
        sched.ahead_s[m] = RecentMedian()
        sched.ahead_s[m].update(period(m))
    for n in buckets:
        got = sched.plain_rate(n)
        assert sched.plain_timed(n) == (n in timed)
        if n in timed:
            assert got == pytest.approx(1.0 / period(n))
        else:
            assert 0 < got <= 1.0 / period(n) * (1 + 1e-12), (n, got, 1.0 / period(n))
