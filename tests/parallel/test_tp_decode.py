"""Tensor + expert parallel decoding on 2 and 4 CPU ranks (gloo) against one process and the numpy reference:
greedy tokens (dense and INT4 experts), speculative decoding equal to plain decoding with the same trees on every
rank, and sampling (the same seeded tokens, the rule's distribution)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.parallel.comm import SINGLE, tp_sum, tp_sum_kind
from kdtree_engine.sampling import rule_probs

from ranks import run_ranks
from scenarios import CFG, DIST_DRAWS, DIST_PARAMS, GROUP, STEPS, Case, dist_logits, prompt_of, run

SEED = int(np.random.default_rng().integers(1 << 20))


@pytest.fixture(scope="module")
def one() -> dict:
    print(f"seed={SEED}")
    return run(SINGLE, Case(SEED))


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_ranks(2, run, Case(SEED))


def test_tp2_greedy_equals_tp1_and_reference(one, two) -> None:
    prompt = prompt_of(SEED)
    want = reference.greedy(CFG, reference.random_weights(CFG, SEED), prompt, STEPS)
    assert one["dense"] == want, f"seed={SEED}"
    assert [r["dense"] for r in two] == [want, want], f"seed={SEED}"
    wq = reference.random_weights(CFG, SEED, quantize_experts_group=GROUP)
    want_q = reference.greedy(CFG, wq, prompt, STEPS)
    assert one["int4"] == want_q and [r["int4"] for r in two] == [want_q, want_q], f"seed={SEED}"


def test_tp2_spec_equals_plain_with_the_same_trees_on_every_rank(one, two) -> None:
    assert two[0]["none"] == two[1]["none"] == one["none"], f"seed={SEED}"
    assert two[0]["device-ddtree"] == two[1]["device-ddtree"] == one["none"], f"seed={SEED}"
    for key in ("dflash-None", "ddtree-4", "ddtree-16", "oracle-dflash-None", "oracle-ddtree-8"):
        tokens, per_depth, rounds, trees = two[0][key]
        assert tokens == one["none"], (key, f"seed={SEED}")
        assert two[1][key] == two[0][key], (key, "ranks differ (tokens, accepted lengths or trees)", f"seed={SEED}")
        if "ddtree" in key:
            assert len(trees) >= rounds - 1  # the builder ran every round that drafted
    assert sum(two[0]["oracle-ddtree-8"][1]) > 4  # drafts accepted: multi-node paths were walked


def test_tp2_batched_greedy_requests_keep_their_solo_tokens(one, two) -> None:
    """Several plain greedy requests in one scheduler pick their tokens in one reduction across the vocabulary
    shards: each request's tokens are its solo run's, on every rank."""
    assert one["batch"] == one["batch-solo"], f"seed={SEED}"
    assert two[0]["batch"] == two[1]["batch"] == one["batch-solo"], f"seed={SEED}"


def test_tp2_sampling_draws_tp1_tokens_and_the_rule_distribution(one, two) -> None:
    assert two[0]["sampled"] == two[1]["sampled"] == one["sampled"], f"seed={SEED}"
    assert two[0]["sampled-ddtree"] == two[1]["sampled-ddtree"] == one["sampled-ddtree"], f"seed={SEED}"
    probs = rule_probs(dist_logits(SEED), DIST_PARAMS.temperature, DIST_PARAMS.top_k, DIST_PARAMS.top_p).double()
    for counts in (one["draws"], two[0]["draws"]):
        counts = torch.tensor(counts, dtype=torch.float64)
        assert counts[probs == 0].sum() == 0  # outside the nucleus: never drawn
        keep = probs > 0
        exp = probs[keep] * DIST_DRAWS
        chi2 = float(((counts[keep] - exp) ** 2 / exp).sum())
        dof = int(keep.sum()) - 1
        assert dof >= 8, f"seed={SEED}: the nucleus keeps {dof + 1} tokens, too few to test a distribution"
        assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)  # far above chance only when the rule is wrong
    assert two[0]["draws"] == two[1]["draws"]


@pytest.mark.parametrize("kind", ["all_reduce", "scatter"])
def test_tp4_greedy_equals_tp1_with_other_sums(kind: str) -> None:
    want = run(SINGLE, Case(SEED + 1, full=False))["dense"]
    case = Case(SEED + 1, full=False, tp_sum=kind)
    assert [r["dense"] for r in run_ranks(4, run, case)] == [want] * 4, f"seed={SEED + 1}"


def test_the_policy_picks_the_cross_rank_sum() -> None:
    assert tp_sum_kind(KernelPolicy()) == "gather"
    assert tp_sum_kind(KernelPolicy(batch_invariant=False)) == "all_reduce"
    assert tp_sum_kind(KernelPolicy(tp_sum="all_reduce")) == "all_reduce"
    assert tp_sum_kind(KernelPolicy(batch_invariant=False, tp_sum="gather")) == "gather"
    with pytest.raises(ValueError, match="KernelPolicy.tp_sum"):
        KernelPolicy(tp_sum="ring")
    x = torch.randn(3, 5)
    assert tp_sum(KernelPolicy(), SINGLE, x) is x  # one rank: no collective, the tensor itself


def test_tp2_ties_go_to_the_lowest_id_on_every_rank(one, two) -> None:
    assert two[0]["tie-greedy"] == two[1]["tie-greedy"] == one["tie-greedy"] == [5, 128]
    lp, ids = two[0]["tie-topk"]
    assert two[1]["tie-topk"] == two[0]["tie-topk"]
    assert ids == [[5, 130, 200, 0], [128, 255, 0, 1]]
    want = torch.log_softmax(torch.tensor([[3.0, 3.0, 3.0, 0.0] + [0.0] * 252, [1.0, 1.0] + [0.0] * 254]), -1)
    torch.testing.assert_close(torch.tensor(lp), want[:, :4], rtol=1e-6, atol=1e-6)


def _sums(comm, seed: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(seed * 10 + comm.rank)
    x = (torch.randn(rows, 24, generator=g) * 3).to(torch.bfloat16)
    return {kind: tp_sum(KernelPolicy(tp_sum=kind), comm, x) for kind in ("gather", "scatter")}


@pytest.mark.parametrize("world,rows", [(2, 7), (3, 10), (4, 1)])
def test_scattered_rank_order_sum_has_the_gathered_sums_bits(world: int, rows: int) -> None:
    """The scattered form (all-to-all, rank-order sum of a slice, all-gather; rows not divisible by the ranks padded)
    gives bit for bit the gathered form's sums on every rank, and they are the rank-order float32 sums."""
    out = run_ranks(world, _sums, SEED, rows)
    want = torch.zeros(rows, 24)
    for r in range(world):
        want += (torch.randn(rows, 24, generator=torch.Generator().manual_seed(SEED * 10 + r)) * 3).to(torch.bfloat16).float()
    for o in out:
        assert torch.equal(o["scatter"], o["gather"]), f"seed={SEED}"
        assert torch.equal(o["gather"], want.to(torch.bfloat16)), f"seed={SEED}"


def test_scatter_pays_only_for_large_messages_beyond_two_ranks() -> None:
    from kdtree_engine.parallel.comm import scatter_pays
    row = 7168 * 2
    assert not scatter_pays(2, 4096 * row)   # two ranks: both forms move one message
    assert not scatter_pays(8, 1 * row) and not scatter_pays(8, 16 * row)
    assert scatter_pays(8, 4096 * row)
