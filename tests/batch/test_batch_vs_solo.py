"""Continuous batching on the CPU (float32): every request's tokens equal its solo run, whatever shares its forwards.

The demo target and drafter, 18 requests of different prompt lengths (some cut into prefill chunks), methods
(plain, chain, trees of 4 to 32 nodes), greedy or sampled with their own seeds, arriving at different steps."""

import random

import torch

from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.tokenizer import load_tokenizer

from batch_cases import batched, first_difference, make_cases, solo

CHUNK = 48  # prompts over this many tokens run in chunks, batched beside other requests' rounds


def _demo():
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    return target, load_drafter(DEMO_DIR / "draft", target), load_tokenizer(DEMO_DIR)


def test_batch_tokens_equal_solo_runs():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target, drafter, tok = _demo()
    cases = make_cases(tok, 18, seed, max_prompt=120, max_tokens=24)
    free = sorted(target.pool().free_ids())
    results, logits, sched = batched(target, drafter, cases, CHUNK, token_budget=96)
    assert sched.forwards < sum(len(r.token_ids) for r in results)  # requests did share forwards
    assert sorted(target.pool().free_ids()) == free  # every block back
    for i, (case, res, lg) in enumerate(zip(cases, results, logits)):
        ref, ref_logits = solo(target, drafter, case, CHUNK)
        assert res.token_ids == ref.token_ids, (i, case.method, case.budget, first_difference(res.token_ids,
                                                                                               ref.token_ids))
        assert res.finish_reason == ref.finish_reason
        torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-4)
        if case.method != "none":
            assert res.stats["tau"] == ref.stats["tau"]  # the same trees, the same accepted paths
