"""Sampled requests inside a continuous batch keep the target's exact sequence distribution, each with its own seed.

The statistical test of test_lossless_sampling.py, with every request run by the batch scheduler beside dozens of
others (plain, chain and tree requests mixed in one forward) instead of alone."""

from collections import Counter
from dataclasses import replace

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate

from spec_toys import PrefixTarget, ToyDrafter, chi_square_pvalue, target_chain_proposals
from test_lossless_sampling import MAX_TOKENS, N_TOKENS, P_MIN, PROMPT, V

PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, ignore_eos=True)
METHODS = [("none", None), ("dflash", None), ("ddtree", 4), ("ddtree", 8)]


def _batched(target, drafter, n, per_step):
    sched = Scheduler(target, drafter, token_budget=256)
    seqs = []
    for i in range(n):  # requests arrive while others run: per_step new ones at each round boundary
        spec, budget = METHODS[i % len(METHODS)]
        seqs.append(sched.submit(PROMPT, replace(PARAMS, seed=5000 + i), spec=spec, budget=budget))
        if i % per_step == per_step - 1:
            sched.step()
    sched.run()
    return seqs


def test_batched_sampling_keeps_the_distribution():
    target = PrefixTarget(V, seed=13, scale=1.2)
    drafter = ToyDrafter(4, target_chain_proposals(target), decode_ctx=True)
    exact = target.sequence_distribution(PROMPT, N_TOKENS, PARAMS)
    n = 1200
    seqs = _batched(target, drafter, n, per_step=7)
    counts = Counter(tuple(s.result.token_ids[:N_TOKENS]) for s in seqs)
    accepted = sum(s.result.stats["accepted_tokens"] for s in seqs)
    stat, p = chi_square_pvalue(counts, exact, n)
    print(f"batched: chi2={stat:.1f} p={p:.3g} accepted={accepted}")
    assert accepted > n // 8  # drafts are accepted: the tree paths run inside the batch
    assert p > P_MIN, (stat, p)
    # each request's tokens are its own seed's, whoever shares its forwards: other arrivals, and alone
    other = _batched(target, drafter, n, per_step=40)
    assert [s.result.token_ids for s in other] == [s.result.token_ids for s in seqs]
    for i in range(0, n, 97):
        spec, budget = METHODS[i % len(METHODS)]
        solo = generate(target, PROMPT, replace(PARAMS, seed=5000 + i), spec=spec,
                        drafter=drafter if spec != "none" else None, budget=budget, eager=True)
        assert seqs[i].result.token_ids == solo.token_ids, i
