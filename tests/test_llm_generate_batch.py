"""``LLM.generate_batch`` (prompts concurrently through one continuous batch) against ``LLM.generate`` of each
prompt alone, on the demo in float32 on the CPU: identical tokens, text and finish reasons."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kdtree_engine import LLM, SamplingParams
from kdtree_engine.errors import BadInput

from batch_cases import source_text


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", threads=1, progress=False)


def test_batch_equals_solo_runs(llm):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    ids = llm.encode(source_text())
    prompts: list = []
    params = []
    for i in range(10):
        n = rng.randint(3, 90)
        start = rng.randrange(len(ids) - n)
        prompts.append(ids[start:start + n] if i % 2 else llm.decode(ids[start:start + n]))
        sampled = i % 3 == 2
        params.append(SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.9 if sampled else 0.0,
                                     top_p=0.95 if sampled else 1.0, seed=rng.randrange(1 << 30),
                                     ignore_eos=i % 4 != 0))
    free = sorted(llm.target.pool().free_ids())
    for plain in (False, True):
        # a small row budget: the requests' rounds and prompts spread over many shared forwards
        got = llm.generate_batch(prompts, params, plain=plain, token_budget=64)
        for i, (p, sp, res) in enumerate(zip(prompts, params, got)):
            ref = llm.run(llm.encode(p), sp, plain=plain)
            assert res.token_ids == ref.token_ids, (i, plain, sp)
            assert res.finish_reason == ref.finish_reason, (i, plain)
            assert res.text == llm.decode(ref.token_ids)
            assert res.stats["spec"] == ("none" if plain else llm.spec.method)
    assert sorted(llm.target.pool().free_ids()) == free   # every cache block back


def test_one_params_for_all_and_one_prompt(llm):
    params = SamplingParams(max_tokens=12)
    prompts = ["def f(x):", "class Stack:"]
    got = llm.generate_batch(prompts, params)
    assert [r.text for r in got] == [r.text for r in llm.generate(prompts, params)]
    single = llm.generate_batch("def f(x):", params)
    assert len(single) == 1 and single[0].token_ids == got[0].token_ids


def test_refusals_name_the_argument(llm, monkeypatch):
    with pytest.raises(BadInput, match="params has 1 entries for 2 prompts"):
        llm.generate_batch(["a", "b"], [SamplingParams()])
    # at tp > 1 a bad row budget is refused before rank 0 tells the other ranks anything (a stand-in group that has
    # no broadcast: reaching it would fail otherwise)
    monkeypatch.setattr(llm, "comm", SimpleNamespace(world_size=2, rank=0))
    with pytest.raises(BadInput, match="token_budget=0"):
        llm.scheduler(token_budget=0)
