"""Sampled speculative output has exactly the target's sequence distribution.

The PrefixTarget's next-token logits depend on the whole prefix, the exact distribution of the
first n emitted tokens is enumerated, and thousands of requests go through the real harness (tree
build, verify with the ancestor mask, accept walk, commit). A biased rule (accept the draft
whatever the target samples) must fail the same test.
"""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative import host_rounds
from kdtree_engine.speculative.walks import TreeWalks
from kdtree_engine.speculative.decode import generate

from spec_toys import PrefixTarget, ToyDrafter, chi_square_pvalue, random_proposals, target_chain_proposals

V = 6
PROMPT = [3, 5]
N_TOKENS = 3  # compared: the joint of the first 3 emitted tokens (216 outcomes)
MAX_TOKENS = 4  # generated: the first round after prefill then drafts 2 deep (depth = remaining - 1)
P_MIN = 1e-4  # deterministic seeds: a fixed draw, not a flaky one


def _run(spec, budget, params, drafter, target, n, tree_impl="auto"):
    counts: Counter = Counter()
    accepted = 0
    for i in range(n):
        r = generate(target, PROMPT, replace(params, seed=1000 + i), spec=spec, drafter=drafter, budget=budget,
                     tree_impl=tree_impl)
        counts[tuple(r.token_ids[:N_TOKENS])] += 1
        accepted += r.stats["accepted_tokens"]
    return counts, accepted


CASES = [
    ("dflash", None, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True), "chain"),
    ("ddtree", 4, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, ignore_eos=True), "chain"),
    ("ddtree", 16, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, top_k=5, ignore_eos=True), "random"),
]


@pytest.mark.parametrize("spec,budget,params,kind", CASES)
def test_sampled_distribution_equals_target(spec, budget, params, kind):
    target = PrefixTarget(V, seed=11, scale=1.2)
    fn = target_chain_proposals(target) if kind == "chain" else random_proposals(V, seed=2, scale=2.0)
    drafter = ToyDrafter(4, fn, decode_ctx=True)
    exact = target.sequence_distribution(PROMPT, N_TOKENS, params)
    n = 1500 if spec == "dflash" else 1000
    counts, accepted = _run(spec, budget, params, drafter, target, n)
    assert accepted > n // 4  # drafts are accepted often: the tree paths are exercised
    stat, p = chi_square_pvalue(counts, exact, n)
    print(f"{spec} budget={budget} chi2={stat:.1f} p={p:.3g} accepted={accepted}")
    assert p > P_MIN, (stat, p)


def _biased_walk(trees, picks):
    """Follows the first child whatever the target picked (a lossy rule), in the form of walks.walk_trees."""
    (tree,) = trees
    par = tree.parents.tolist()
    path, cur = [0], 0
    while True:
        kids = [i for i in range(1, len(par)) if par[i] == cur]
        if not kids:
            break
        cur = kids[0]
        path.append(cur)
    nodes = torch.zeros(1, len(par), dtype=torch.long)
    nodes[0, :len(path)] = torch.tensor(path)
    bonus = picks[cur].reshape(1)
    tokens = [int(tree.tokens[i]) for i in path[1:]] + [int(bonus)]
    return TreeWalks(nodes=nodes, bonus=bonus, counts=[len(path)], tokens=[tokens])


def test_biased_rule_is_detected(monkeypatch):
    monkeypatch.setattr(host_rounds, "walk_trees", _biased_walk)
    spec, budget, params, _ = CASES[0]
    target = PrefixTarget(V, seed=11, scale=1.2)
    drafter = ToyDrafter(4, target_chain_proposals(target), decode_ctx=True)
    exact = target.sequence_distribution(PROMPT, N_TOKENS, params)
    n = 1500
    counts, _ = _run(spec, budget, params, drafter, target, n)
    stat, p = chi_square_pvalue(counts, exact, n)
    print(f"biased: chi2={stat:.1f} p={p:.3g}")
    assert p < 1e-12, (stat, p)


def test_greedy_prefix_target_all_strategies():
    target = PrefixTarget(V, seed=4, scale=2.0)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = generate(target, PROMPT, params).token_ids
    for kind in ("chain", "random"):
        fn = target_chain_proposals(target) if kind == "chain" else random_proposals(V, seed=9)
        for spec, budget in (("dflash", None), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)):
            for impl in ("vectorized", "heap"):
                r = generate(target, PROMPT, params, spec=spec, drafter=ToyDrafter(5, fn, decode_ctx=True),
                             budget=budget, tree_impl=impl)
                assert r.token_ids == ref, (kind, spec, budget, impl)
            if kind == "chain" and spec == "dflash":
                assert r.stats["tau"] > 3.0  # the chain drafter knows the greedy future
