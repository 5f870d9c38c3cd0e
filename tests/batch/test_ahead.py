"""Plain greedy steps queued one ahead of the host's read of their tokens (kdtree_engine/batch/ahead.py), on the
static batched steps a CUDA graph replays, run eagerly on the CPU: every request keeps its solo run's tokens and
emitted-token logits (float32, to rounding), requests that arrive, end at different lengths, stop on EOS or are
cancelled mid-run are handled at the right step, and the cache pool ends as it started."""

import random

import pytest
import torch

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.engine import DEMO_DIR, load_target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.tokenizer import load_tokenizer

from batch_cases import Case, batched, first_difference, solo, source_text


@pytest.fixture(scope="module")
def demo():
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    return target, load_tokenizer(DEMO_DIR)


def _plain_cases(tok, n: int, seed: int, eos_every: int = 3) -> list[Case]:
    """Plain greedy requests of different prompt lengths, lengths and arrival steps; every ``eos_every``-th one stops
    at the end-of-sequence token if it emits it."""
    rng = random.Random(seed)
    ids = tok.encode(source_text())
    cases = []
    for i in range(n):
        length = rng.randint(4, 60)
        start = rng.randrange(0, len(ids) - length)
        params = SamplingParams(max_tokens=rng.randint(3, 20), ignore_eos=i % eos_every != 0)
        cases.append(Case(ids[start:start + length], params, "none", None, arrives=rng.choice([0, 0, 0, 2, 9, 15])))
    return cases


def _prompts(tok, n: int) -> list[list[int]]:
    """n prompts of 5-40 tokens cut from Python source at random offsets (printed seed)."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ids = tok.encode(source_text())
    return [ids[s:s + rng.randint(5, 40)] for s in (rng.randrange(0, len(ids) - 60) for _ in range(n))]


def test_steps_ahead_keep_solo_tokens(demo):
    target, tok = demo
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    cases = _plain_cases(tok, 10, seed)
    free = sorted(target.pool().free_ids())
    results, logits, sched = batched(target, None, cases, 48, token_budget=96, step_mode="static")
    assert sched.ahead.steps > 0, "no step went ahead of its read"
    assert sorted(target.pool().free_ids()) == free
    for i, (case, res, lg) in enumerate(zip(cases, results, logits)):
        ref, ref_logits = solo(target, None, case, 48)
        assert res.token_ids == ref.token_ids, (i, first_difference(res.token_ids, ref.token_ids))
        assert res.finish_reason == ref.finish_reason, (i, res.finish_reason, ref.finish_reason)
        torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-4)


def test_a_cancel_or_a_new_request_settles_the_step_ahead(demo):
    """A request cancelled while a step is ahead ends at the next call ("abort", its tokens so far its solo run's
    prefix); a request that arrives meanwhile makes the scheduler read the pending step first, then admit it; drop_all
    drops a pending step; the pool ends as it started."""
    target, tok = demo
    prompts = _prompts(tok, 4)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    free = sorted(target.pool().free_ids())
    sched = Scheduler(target, None, step_mode="static")
    a, b = sched.submit(prompts[0], params), sched.submit(prompts[1], params)
    for _ in range(4):
        sched.step()
    assert sched.ahead.pending is not None
    b.cancel()
    c = sched.submit(prompts[2], params)   # arrives while a step is ahead
    sched.step()
    assert b.done and b.result.finish_reason == "abort" and sched.ahead.pending is None
    sched.run()
    for seq, p in ((a, prompts[0]), (c, prompts[2])):
        want = solo(target, None, Case(p, params, "none", None, 0), 48)[0].token_ids
        assert seq.result.token_ids == want
    assert b.result.token_ids == solo(target, None, Case(prompts[1], params, "none", None, 0), 48)[0].token_ids[
        :len(b.result.token_ids)]
    d = sched.submit(prompts[3], params)
    for _ in range(4):
        sched.step()
    assert sched.ahead.pending is not None
    sched.drop_all()
    assert d.done and d.result.finish_reason == "abort" and sched.ahead.pending is None and sched.idle
    sched.close()
    assert sorted(target.pool().free_ids()) == free


def test_no_row_past_a_known_length(demo):
    """A request whose length the pending step reaches takes no row of the step queued ahead: requests that end by
    length cost exactly the forwards of the step-by-step loop (one prompt forward, then one a token after the first)."""
    target, tok = demo
    ids = tok.encode(source_text())
    sched = Scheduler(target, None, step_mode="static")
    seqs = [sched.submit(ids[100:130], SamplingParams(max_tokens=6, ignore_eos=True)),
            sched.submit(ids[300:317], SamplingParams(max_tokens=9, ignore_eos=True))]
    sched.run()
    assert [len(s.result.token_ids) for s in seqs] == [6, 9]
    assert sched.forwards == 1 + 8 and sched.ahead.steps > 0, (sched.forwards, sched.ahead.steps)
    sched.close()


def test_load_aware_requests_skipping_their_drafts_go_ahead(demo):
    """Greedy load-aware requests whose trees do not pay (the tree host time held huge) skip their draft passes:
    those plain steps go ahead too, their aux rows still feeding the drafter (the probes between them take those rows
    in: a missing one fails the drafter's context check), the skipped rounds counted, the tokens their solo plain
    runs'."""
    from kdtree_engine.engine import load_drafter
    target, tok = demo
    drafter = load_drafter(DEMO_DIR / "draft", target)
    prompts = _prompts(tok, 3)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    sched = Scheduler(target, drafter, step_mode="static")
    sched.tree_slots = None   # the host-driven load-aware rounds (greedy ones otherwise run in tree slots)
    sched.tree_host_s.value = 1e6
    sched.tree_host_s.update = lambda x: sched.tree_host_s.value
    sched._probe_gap = lambda last: 3   # short gaps: every probe takes in the rows of the steps that went ahead
    passes = []
    real = sched._draft
    sched._draft = lambda asks, probe=False: (passes.append(len(asks)), real(asks, probe))[1]
    seqs = [sched.submit(p, params, spec="ddtree", budget="auto") for p in prompts]
    sched.run()
    assert sched.ahead.steps > 0 and len(passes) >= 3, (sched.ahead.steps, passes)
    for seq, p in zip(seqs, prompts):
        want = solo(target, None, Case(p, params, "none", None, 0), 48)[0].token_ids
        assert seq.result.token_ids == want
        assert set(seq.result.stats["budget_chosen"]) == {0}
        assert sum(seq.result.stats["budget_chosen"].values()) == seq.result.stats["rounds"]
    sched.close()


def test_more_requests_than_the_buffers_hold():
    """A step of more requests than the host buffers were made for (past the static slots the step runs eagerly):
    the buffers grow, and a pending step keeps the one its copy went to (fresh random picks, printed seed)."""
    from kdtree_engine.batch.ahead import StepsAhead
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    ahead = StepsAhead(torch.device("cpu"), 2)
    first, second = torch.randint(0, 1000, (2,), generator=g), torch.randint(0, 1000, (5,), generator=g)
    p1 = ahead.pend([None] * 2, [None] * 2, [None] * 2, first)
    p2 = ahead.pend([None] * 5, [None] * 5, [None] * 5, second)
    assert p2.host[:5].tolist() == second.tolist() and ahead.buffers[0].numel() == 5
    assert p1.host[:2].tolist() == first.tolist()
