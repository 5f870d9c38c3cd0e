"""Continuous batching at TP-2 (gloo, the embedded demo on two CPU ranks, float32): every rank runs the batch's steps,
and each request's tokens equal its run alone on the same ranks: requests of both methods, greedy and sampled (each
with its seed), arriving at different steps; a request cancelled mid-run and one whose ``on_tokens`` verdict ends it
stop after the same round on every rank (their tokens a prefix of the solo run's, finish reason "abort"); once the
batch closes, the ranks are back in the one-request loop. Random prompts, seed printed."""

from __future__ import annotations

import os
import random

import pytest

from kdtree_engine import LLM, SamplingParams
from kdtree_engine.errors import BadInput


@pytest.fixture(scope="module")
def llm():
    engine = LLM(device="cpu", tp=2, threads=1, budget=8, progress=False)   # the embedded demo, DDTree 8, two ranks
    yield engine
    engine.close()


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 20))] for _ in range(n)]


def test_batch_at_tp2_equals_each_request_alone(llm) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    prompts = _prompts(seed, 5)
    params = [SamplingParams(max_tokens=10 + 2 * i, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=12, temperature=0.8, seed=seed + i, ignore_eos=True) for i in range(5)]
    plain = [i in (1, 4) for i in range(5)]
    solo = [llm.generate(p, sp)[0] if not pl else llm.run(p, sp, plain=True) for p, sp, pl in zip(prompts, params, plain)]

    sched = llm.scheduler(token_budget=64)
    try:
        seqs = [llm.submit(sched, prompts[i], params[i], plain=plain[i]) for i in range(3)]
        for _ in range(3):
            sched.step()
        seqs += [llm.submit(sched, prompts[i], params[i], plain=plain[i]) for i in range(3, 5)]   # arrive later
        sched.run()
    finally:
        sched.close()
    for i, (seq, want) in enumerate(zip(seqs, solo)):
        assert seq.result.token_ids == want.token_ids, f"request {i}: batch at TP-2 differs from its solo run"
        assert seq.result.finish_reason == "length"
    # the ranks left the batch: one request at a time again
    assert llm.generate(prompts[0], params[0])[0].token_ids == solo[0].token_ids


def test_cancel_and_verdict_stop_every_rank_after_the_same_round(llm) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    a, b, c = _prompts(seed, 3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    full_a, full_c = llm.generate(a, params)[0], llm.generate(c, params)[0]
    seen: list[int] = []

    def stop_after_four(tokens: list[int]) -> bool:
        seen.extend(tokens)
        return len(seen) >= 4

    sched = llm.scheduler(token_budget=64)
    try:
        sa = llm.submit(sched, a, params, on_tokens=stop_after_four)
        sb = llm.submit(sched, b, params)
        sc = llm.submit(sched, c, params)
        for _ in range(3):
            sched.step()
        sb.cancel()   # counted when the next step starts, on every rank
        sched.run()
    finally:
        sched.close()
    assert sa.result.finish_reason == "abort" and sa.result.token_ids == full_a.token_ids[:len(seen)] == seen
    assert sb.result.finish_reason == "abort"
    assert sc.result.token_ids == full_c.token_ids   # its batch-mates' ends did not move it
    assert llm.generate(c, params)[0].token_ids == full_c.token_ids   # the ranks are in step


def test_open_batch_refuses_single_requests_and_auto_budgets(llm) -> None:
    sched = llm.scheduler()
    try:
        with pytest.raises(BadInput, match="continuous batch is open"):
            llm.generate([5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(BadInput, match="auto"):
            sched.submit([5, 6, 7], SamplingParams(max_tokens=2), spec="ddtree", budget="auto")
    finally:
        sched.close()
    with pytest.raises(BadInput, match="closed"):
        sched.step()
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3
