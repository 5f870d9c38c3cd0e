import torch

from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.accept import accept_reference, target_picks
from kdtree_engine.speculative.walks import walk_trees
from kdtree_engine.speculative.tree import build_tree, chain_tree
from kdtree_engine.sampling import topk_logprobs
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)


def test_accept_matches_reference_walk():
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        L, V = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(2, 6, (1,), generator=gen))
        budget = int(torch.randint(0, 25, (1,), generator=gen))
        lp, ids = topk_logprobs(torch.randn(L, V, generator=gen), max(budget, 1), policy=POLICY)
        tree = build_tree(lp, ids, budget, root_token=0, start=3)
        # picks mostly follow the drafter's top-2 at the next depth, so that long paths happen
        nxt = tree.depths.clamp(max=L - 1)  # [N1]
        rank = torch.randint(0, min(2, ids.shape[1]), (tree.num_nodes,), generator=gen)
        picks = torch.where(torch.rand(tree.num_nodes, generator=gen) < 0.8, ids[nxt, rank],
                            torch.randint(0, V, (tree.num_nodes,), generator=gen))
        res = walk_trees([tree], picks)
        acc, bonus = accept_reference(tree, picks)
        assert res.accepted(0).tolist() == acc and int(res.bonus[0]) == bonus


def test_chain_accept_prefix():
    tree = chain_tree(torch.tensor(9), torch.tensor([4, 5, 6]), 0)
    picks = torch.tensor([4, 5, 7, 1])  # agrees with 4, 5, then picks 7 at node 2
    res = walk_trees([tree], picks)
    assert res.accepted(0).tolist() == [0, 1, 2] and int(res.bonus[0]) == 7 and res.counts == [3]
    res = walk_trees([tree], torch.tensor([4, 5, 6, 3]))
    assert res.accepted(0).tolist() == [0, 1, 2, 3] and int(res.bonus[0]) == 3
    res = walk_trees([tree], torch.tensor([8, 5, 6, 3]))
    assert res.accepted(0).tolist() == [0] and int(res.bonus[0]) == 8


def test_target_picks_greedy():
    logits = torch.tensor([[0.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    assert target_picks(logits, SamplingParams(), policy=POLICY).tolist() == [1, 0]
