import pytest
import torch

from kdtree_engine.sampling import (SamplingError, SamplingParams, greedy, make_generator,
                                    probs_from_logits, race, rule_probs, sample)
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)


def test_params_validation_names_field():
    for kwargs, name in [({"max_tokens": -1}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
                         ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
                         ({"seed": 1.5}, "seed"), ({"stop_token_ids": (-1,)}, "stop_token_ids")]:
        with pytest.raises(SamplingError, match=name):
            SamplingParams(**kwargs)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_greedy_ties_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0]])
    assert greedy(logits, policy=POLICY).tolist() == [1, 0]
    assert sample(logits, SamplingParams(), policy=POLICY).tolist() == [1, 0]
    p = probs_from_logits(logits, SamplingParams(), policy=POLICY)
    assert p.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_topk_topp_probs():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0), policy=POLICY)
    torch.testing.assert_close(p, torch.tensor([0.1, 0.4, 0.2, 0.3]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2), policy=POLICY)
    torch.testing.assert_close(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    # nucleus 0.6: 0.4 then 0.3 (mass before 0.3 is 0.4 < 0.6) -> keep {1, 3}
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6), policy=POLICY)
    torch.testing.assert_close(p, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.3), policy=POLICY)
    torch.testing.assert_close(p, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    p = probs_from_logits(logits, SamplingParams(temperature=2.0), policy=POLICY)
    q = torch.sqrt(torch.tensor([0.1, 0.4, 0.2, 0.3]))
    torch.testing.assert_close(p, q / q.sum())


def test_sample_seeded_and_distribution():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3])).expand(20000, 4)
    params = SamplingParams(temperature=1.0, seed=7)
    a = sample(logits, params, make_generator(7), policy=POLICY)
    b = sample(logits, params, make_generator(7), policy=POLICY)
    assert torch.equal(a, b) and a.shape == (20000,)
    freq = torch.bincount(a, minlength=4).float() / a.numel()
    assert (freq - torch.tensor([0.1, 0.4, 0.2, 0.3])).abs().max() < 0.02
    one = sample(logits[0], params, make_generator(1), policy=POLICY)
    assert one.shape == () and one.dtype == torch.long


def test_race_has_the_rule_distribution():
    """The exponential race over drawn noise samples each row from the rule's probabilities (chi-square
    per row against probs_from_logits; filtered tokens never win, zero noise included), and the rule
    with tensor temperature / top-p (what a CUDA graph reads) gives the same probabilities."""
    from speculative.spec_toys import chi_square_pvalue

    g = torch.Generator().manual_seed(3)
    rows, V, n = 3, 7, 20000
    logits = torch.randn(rows, V, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    probs = probs_from_logits(logits, params, policy=POLICY)  # [rows, V], zeros outside top-k / top-p
    as_tensors = rule_probs(logits, torch.tensor(0.8), 5, torch.tensor(0.9))
    torch.testing.assert_close(as_tensors, probs, rtol=1e-6, atol=1e-7)
    assert torch.equal(as_tensors > 0, probs > 0)
    noise = torch.empty(n, rows, V).exponential_(generator=make_generator(11))
    toks = race(probs.expand(n, rows, V), noise)  # [n, rows]
    for r in range(rows):
        counts = {(int(k),): int(c) for k, c in enumerate(torch.bincount(toks[:, r], minlength=V)) if c}
        exact = {(k,): float(probs[r, k]) for k in range(V) if probs[r, k] > 0}
        stat, pval = chi_square_pvalue(counts, exact, n)
        assert pval > 1e-4, (r, stat, pval)
    zero = torch.zeros(rows, V)  # u = 0 draws: no 0 / 0, the winner stays in the support
    pick = race(probs, zero)
    assert bool((probs.gather(1, pick[:, None]) > 0).all())
