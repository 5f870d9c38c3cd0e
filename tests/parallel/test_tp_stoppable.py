"""A request that rank 0 may end after any round (the server's: a stop string, a client gone) ends on every rank
after the same round at TP-2: its tokens are the uninterrupted run's up to that round, and the ranks stay in step
(the next request gives the uninterrupted tokens again). Without ``stoppable`` the callback's verdict is not acted on
at tp > 1 (the ranks could not follow it)."""

from __future__ import annotations

import pytest

from kdtree_engine import LLM, SamplingParams

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(spec="none", device="cpu", tp=2, threads=1, progress=False)   # the embedded demo, two ranks
    yield engine
    engine.close()


def test_stoppable_request_ends_on_every_rank_after_the_same_round(llm) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    full = llm.generate(PROMPT, params)[0]
    assert len(full.token_ids) == 12
    seen: list[int] = []

    def stop_after_three(tokens: list[int]) -> bool:
        seen.extend(tokens)
        return len(seen) >= 3

    cut = llm.generate(PROMPT, params, on_tokens=stop_after_three, stoppable=True)[0]
    assert cut.finish_reason == "abort"
    assert cut.token_ids == full.token_ids[:3] == seen
    assert llm.generate(PROMPT, params)[0].token_ids == full.token_ids   # the other rank left after the same round


def test_without_stoppable_the_verdict_is_not_acted_on(llm) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    rounds: list[list[int]] = []
    res = llm.generate(PROMPT, params, on_tokens=lambda t: rounds.append(t) or True)[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 6
    assert sum(rounds, []) == res.token_ids
