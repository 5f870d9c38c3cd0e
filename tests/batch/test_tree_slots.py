"""Device-resident tree rounds in a batch (kdtree_engine/batch/tree_slots.py), run eagerly on the CPU (the arithmetic
a CUDA graph replays): greedy fixed-budget DDTree and DFlash requests through the scheduler's tree slots.

Oracle: each request alone (the host-driven loop over one request, tests/batch_cases.solo): identical tokens, target
logits of every emitted token within float32 rounding. Seeds printed."""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.batch.slot_budget import SlotBudget
from kdtree_engine.batch.tree_slots import MIN_SLOTS, TreeSlots

N = 4   # the tests' scale: several requests, more than the first slots hold
from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.tokenizer import load_tokenizer

from batch_cases import Case, batched, first_difference, make_cases, solo

SHAPES = [("ddtree", 4), ("ddtree", 16), ("dflash", None), ("ddtree", 8), ("dflash", 3)]


def demo():
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    return target, load_drafter(DEMO_DIR / "draft", target)


def test_tree_slots_keep_each_requests_solo_tokens(monkeypatch) -> None:
    """More greedy requests of one shape than the first slots (the slots double), other shapes beside them (a group
    each), arriving at different steps and ending at different lengths (a freed slot taken by a later request): each
    request's tokens == its solo run's, its emitted tokens' logits within 1e-4; every slot and block back."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target, drafter = demo()
    tok = load_tokenizer(DEMO_DIR)
    base = make_cases(tok, 3 * N, seed, max_prompt=80, max_tokens=24, sampled_every=10**6)
    cases = [Case(c.prompt, replace(c.params, max_tokens=max(c.params.max_tokens, 6)),
                  *(SHAPES[0] if i < N + 2 else SHAPES[i % len(SHAPES)]), 0 if i < N + 2 else c.arrives)
             for i, c in enumerate(base)]
    steps, at_close = [], []
    real_step = TreeSlots.step
    monkeypatch.setattr(TreeSlots, "step", lambda self: (steps.append(
        (self.shape.method, self.shape.budget, int(self.active.sum()), self.slots)), real_step(self))[1])
    free = sorted(target.pool().free_ids())
    real_close = Scheduler.close
    monkeypatch.setattr(Scheduler, "close", lambda self: (at_close.extend(
        (len(g.free), g.slots) for g in (self.tree_slots or {}).values()), real_close(self))[1])
    results, logits, _ = batched(target, drafter, cases, 48, token_budget=2048, step_mode="static")
    assert sorted(target.pool().free_ids()) == free
    assert any(active > N for m, b, active, _ in steps if (m, b) == SHAPES[0])   # the slots doubled
    assert len({(m, b) for m, b, _, _ in steps}) > 1 and all(f == n for f, n in at_close)
    for i, (case, res, lg) in enumerate(zip(cases, results, logits)):
        ref, ref_logits = solo(target, drafter, case, 48)
        assert res.token_ids == ref.token_ids, (i, case.method, case.budget,
                                                first_difference(res.token_ids, ref.token_ids))
        torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-4)
        assert res.stats["rounds"] >= 1 and res.stats["device_rounds"] is True


def test_a_cancelled_slotted_request_frees_its_slot_and_blocks() -> None:
    """A request in a tree slot cancelled mid-run ends at the next step, its slot free and its blocks back in the
    pool. Its slot stays empty while its group steps on (the request beside it) and a request of another shape takes
    its blocks (the pool hands them out again first): both keep their solo tokens (the empty slot writes only to the
    trash block), and a later request of the first shape takes the freed slot."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = demo()
    free = sorted(target.pool().free_ids())
    sched = Scheduler(target, drafter, step_mode="static")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 30))] for _ in range(4)]
    a = sched.submit(prompts[0], params, spec="ddtree", budget=8)
    b = sched.submit(prompts[1], replace(params, max_tokens=80), spec="ddtree", budget=8)
    for _ in range(4):
        sched.step()
    sched.cancel(a)
    sched.step()
    assert a.done and a.result.finish_reason == "abort"
    (group,) = sched.tree_slots.values()
    assert int(group.active.sum()) == 1 and len(group.free) == group.slots - 1
    c = sched.submit(a.prompt_ids, params, spec="dflash")   # another group; a's blocks
    while not c.done:
        sched.step()
    d = sched.submit(prompts[3], params, spec="ddtree", budget=8)   # takes the freed slot
    sched.run()
    for seq, method, budget in ((b, "ddtree", 8), (c, "dflash", None), (d, "ddtree", 8)):
        ref, _ = solo(target, drafter, Case(seq.prompt_ids, seq.params, method, budget, 0), None)
        assert seq.result.token_ids == ref.token_ids, (method, first_difference(seq.result.token_ids, ref.token_ids))
    assert len(group.free) == group.slots
    sched.close()
    assert sorted(target.pool().free_ids()) == free


def test_slots_shrink_after_a_burst_and_keep_solo_tokens() -> None:
    """A burst of requests of one shape grows the slots; as they end (at different lengths) the slots halve while at
    most a quarter hold requests, the held ones moved to the first slots mid-run; a request arriving after the burst
    runs on the small group; a second burst grows the slots again inside the buffers the first one made (same
    addresses: the graphs captured over them stay valid). Every request keeps its solo tokens."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = demo()
    sched = Scheduler(target, drafter, step_mode="static", token_budget=4096)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 24))] for _ in range(6 * N + 2)]
    lengths = [4] * (4 * N - 2) + [40, 48]   # most end early, two run on
    seqs = [sched.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), spec="ddtree", budget=8)
            for p, n in zip(prompts, lengths)]
    sizes = []
    while not sched.idle:
        sched.step()
        sizes += [g.slots for g in sched.tree_slots.values()]
    # one or two requests left: halved while at most a quarter of the slots hold requests (2 or 4 slots)
    assert max(sizes) >= 4 * N and sizes[-1] <= 4
    late = sched.submit(prompts[-1], SamplingParams(max_tokens=12, ignore_eos=True), spec="ddtree", budget=8)
    sched.run()
    (group,) = sched.tree_slots.values()
    assert group.slots == MIN_SLOTS
    room, addresses = group.room, [t.data_ptr() for t in group.buf.values()]
    again = [sched.submit(p, SamplingParams(max_tokens=rng.randint(2, 12), ignore_eos=True), spec="ddtree", budget=8)
             for p in prompts[4 * N + 1:]]
    sizes = []
    while not sched.idle:
        sched.step()
        sizes += [group.slots]
    assert max(sizes) > 2 * N and sched.tree_slots[next(iter(sched.tree_slots))] is group
    assert group.room == room and [t.data_ptr() for t in group.buf.values()] == addresses
    for seq in seqs + [late] + again:
        ref, _ = solo(target, drafter, Case(seq.prompt_ids, seq.params, "ddtree", 8, 0), None)
        assert seq.result.token_ids == ref.token_ids, first_difference(seq.result.token_ids, ref.token_ids)
    sched.close()


def test_an_empty_slot_runs_inside_the_capacity() -> None:
    """A request whose last round left its length within a round of the slots' capacity gives its slot back; the
    slot's later (empty) rounds run at the start of the cache, not past its end, and the request beside it keeps its
    solo tokens."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = demo()
    sched = Scheduler(target, drafter, step_mode="static")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 20))] for _ in range(2)]
    a = sched.submit(prompts[0], params, spec="ddtree", budget=16)
    b = sched.submit(prompts[1], params, spec="ddtree", budget=16)
    sched.step()   # the prompts
    (group,) = sched.tree_slots.values()
    i = a.tree_slot[1]
    group.start[i] = group.capacity - 1   # as a last round may leave it
    sched.cancel(a)
    sched.run()
    assert int(group.start[i]) == 0
    ref, _ = solo(target, drafter, Case(prompts[1], params, "ddtree", 16, 0), None)
    assert b.result.token_ids == ref.token_ids
    sched.close()


def test_load_aware_requests_switch_budgets_and_keep_solo_tokens(monkeypatch) -> None:
    """Greedy requests with budget="auto" run in tree slots, one budget a step for the group (.slot_budget); here the
    budget alternates between 0 (a plain step that feeds the drafter's cache) and the group's tree budgets in a random
    order, so requests switch between plain steps and trees of every size mid-run. Each request's tokens == its solo run's,
    its emitted tokens' logits within 1e-4."""
    seed, rng, ran = drawn_budgets(monkeypatch)
    monkeypatch.setattr(SlotBudget, "prefers_plain", lambda self, slots: False)   # every request stays in the slots
    target, drafter = demo()
    base = make_cases(load_tokenizer(DEMO_DIR), N + 2, seed, max_prompt=60, max_tokens=28,
                      sampled_every=10**6)
    cases = [Case(c.prompt, replace(c.params, max_tokens=max(c.params.max_tokens, 16)), "ddtree", "auto", c.arrives)
             for c in base]
    results, logits, _ = batched(target, drafter, cases, 48, token_budget=2048, step_mode="static", auto_slots=True)
    assert 0 in ran and len(set(ran)) >= 3, ran
    assert all(res.stats["device_rounds"] for res in results)
    assert_solo(target, drafter, cases, results, logits)


def drawn_budgets(monkeypatch) -> tuple[int, random.Random, list[int]]:
    """(seed, its random source, the budgets run): every other step plain (budget 0), the steps between them the
    group's tree budgets in a random order, each once before any again."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng, ran, trees = random.Random(seed), [], []

    def choose(self, slots: int) -> int:
        if len(ran) % 2 == 0:
            if not trees:
                trees.extend(rng.sample([b for b in self.budgets if b], len(self.budgets) - 1))
            ran.append(trees.pop())
        else:
            ran.append(0)
        return ran[-1]
    monkeypatch.setattr(SlotBudget, "choose", choose)
    return seed, rng, ran


def assert_solo(target, drafter, cases: list[Case], results: list, logits: list) -> None:
    """Each request's tokens == its solo run's, its emitted tokens' logits within 1e-4."""
    for i, (case, res, lg) in enumerate(zip(cases, results, logits)):
        ref, ref_logits = solo(target, drafter, case, 48)
        assert res.token_ids == ref.token_ids, (i, first_difference(res.token_ids, ref.token_ids))
        torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-4)


def test_load_aware_requests_hand_over_to_host_rounds_when_plain_pays(monkeypatch) -> None:
    """When plain steps are the group's best budget for a while, its load-aware requests go on in host-driven rounds
    (state, pending context rows and draft cache carried over), and later ones stay out of the slots; the budgets
    before alternate between plain steps and trees. Each request's tokens == its solo run's."""
    seed, rng, steps = drawn_budgets(monkeypatch)
    target, drafter = demo()
    base = make_cases(load_tokenizer(DEMO_DIR), N + 3, seed, max_prompt=60, max_tokens=40,
                      sampled_every=10**6)
    cases = [Case(c.prompt, replace(c.params, max_tokens=rng.randint(48, 80)), "ddtree", "auto",
                  0 if i < N else 12 + i) for i, c in enumerate(base)]
    monkeypatch.setattr(SlotBudget, "prefers_plain", lambda self, slots: len(steps) >= 2)   # plain pays from step 2
    results, logits, _ = batched(target, drafter, cases, 48, token_budget=2048, step_mode="static", auto_slots=True)
    handed = [r.stats.get("handed_over", False) for r in results[:N]]
    assert sum(handed) >= 2 and not any(r.stats["device_rounds"] for r in results[N:]), handed
    assert_solo(target, drafter, cases, results, logits)


def test_a_group_goes_to_plain_steps_once_to_learn_their_rate_at_its_load() -> None:
    """With the plain batched steps' rate unknown at its load, a settled group of load-aware requests goes on in
    host-driven rounds once (their plain steps, run ahead of their reads, are then timed at that load); a later
    burst at the same load is placed by the measured rates, with no second try. Each request's tokens == its solo
    run's."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    target, drafter = demo()
    base = make_cases(load_tokenizer(DEMO_DIR), 2 * N, seed, max_prompt=60, max_tokens=40, sampled_every=10**6)
    cases = [Case(c.prompt, replace(c.params, max_tokens=rng.randint(60, 90)), "ddtree", "auto", 0 if i < N else 200)
             for i, c in enumerate(base)]
    results, logits, sched = batched(target, drafter, cases, 48, token_budget=2048, step_mode="static", auto_slots=True)
    handed = [bool(r.stats.get("handed_over")) for r in results]
    assert sched.plain_tried == {N} and all(handed[:N]), (sched.plain_tried, handed)
    assert sched.plain_rate(N) is not None
    assert_solo(target, drafter, cases, results, logits)
