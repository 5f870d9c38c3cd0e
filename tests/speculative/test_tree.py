import itertools

import pytest
import torch

from kdtree_engine.speculative.tree import HeapAsk, build_tree, build_tree_heap, build_trees_heap, chain_tree, tree_size
from kdtree_engine.sampling import topk_logprobs
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)


def _random_logits(L, V, gen, ties=False):
    if ties:  # few distinct values -> many exact score ties (and zero log-probs when peaked)
        return torch.randint(0, 3, (L, V), generator=gen).float() * 2.0
    return torch.randn(L, V, generator=gen) * 2.0


def _paths(tree):
    """rank-free description: the token path of every non-root node."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for i in range(1, len(toks)):
        path, j = [], i
        while j > 0:
            path.append(toks[j])
            j = pars[j]
        out.append(tuple(reversed(path)))
    return out


def _brute_force(lp, ids, budget):
    """All prefixes with scores accumulated in float32 as the builders do; the top `budget`."""
    L, K = lp.shape
    lpf = lp.float()
    cands = []
    for d in range(1, L + 1):
        for ranks in itertools.product(range(K), repeat=d):
            s = torch.zeros((), dtype=torch.float32)
            for i, r in enumerate(ranks):
                s = s + lpf[i, r]
            cands.append((float(s), tuple(int(ids[i, r]) for i, r in enumerate(ranks))))
    cands.sort(key=lambda c: -c[0])
    return cands[:budget]


def _check_structure(tree, start, L):
    n1 = tree.num_nodes
    par, dep = tree.parents.tolist(), tree.depths.tolist()
    assert par[0] == -1 and dep[0] == 0
    for i in range(1, n1):
        assert 0 <= par[i] < i and dep[i] == dep[par[i]] + 1 and 1 <= dep[i] <= L
    assert torch.equal(tree.positions, tree.depths + start)
    m = tree.mask.tolist()
    for i in range(n1):
        anc, j = {i}, i
        while par[j] >= 0:
            j = par[j]
            anc.add(j)
        assert [bool(x) for x in m[i]] == [k in anc for k in range(n1)]
    # siblings have distinct tokens (the accept walk relies on it)
    seen = set()
    for i in range(1, n1):
        key = (par[i], int(tree.tokens[i]))
        assert key not in seen
        seen.add(key)


@pytest.mark.parametrize("ties", [False, True])
def test_heap_matches_brute_force(ties):
    gen = torch.Generator().manual_seed(1 + ties)
    for case in range(150):
        L = int(torch.randint(1, 5, (1,), generator=gen))
        V = int(torch.randint(1, 5, (1,), generator=gen))
        budget = int(torch.randint(0, 30, (1,), generator=gen))
        logits = _random_logits(L, V, gen, ties)
        lp, ids = topk_logprobs(logits, min(max(budget, 1), V), policy=POLICY)
        tree = build_tree_heap(lp, ids, budget, root_token=7, start=5)
        _check_structure(tree, 5, L)
        n = tree_size(budget, L, lp.shape[1])
        assert tree.num_nodes == n + 1
        bf = _brute_force(lp, ids, budget)
        assert len(bf) == n
        paths = _paths(tree)
        # scores: the tree's multiset of scores equals the brute-force top-n (optimal under ties)
        full_lp = torch.log_softmax(logits.float(), -1)
        def score(path):
            s = torch.zeros((), dtype=torch.float32)
            for i, t in enumerate(path):
                s = s + lp[i, (ids[i] == t).nonzero()[0, 0]]
            return float(s)
        assert sorted(score(p) for p in paths) == sorted(c[0] for c in bf)
        if not ties:
            assert set(paths) == {c[1] for c in bf}
            # pop order = non-increasing score
            sc = [score(p) for p in paths]
            assert sc == sorted(sc, reverse=True)
        assert full_lp.shape == logits.shape


@pytest.mark.parametrize("ties", [False, True])
def test_vectorized_identical_to_heap(ties):
    gen = torch.Generator().manual_seed(11 + ties)
    for case in range(60):
        L = int(torch.randint(1, 8, (1,), generator=gen))
        V = int(torch.randint(1, 40, (1,), generator=gen))
        budget = int(torch.randint(0, 70, (1,), generator=gen))
        logits = _random_logits(L, V, gen, ties)
        if case % 7 == 0:
            logits[0, 0] = float("-inf")
        lp, ids = topk_logprobs(logits, max(budget, 1), policy=POLICY)
        start = int(torch.randint(0, 100, (1,), generator=gen))
        ref = build_tree_heap(lp, ids, budget, root_token=3, start=start)
        vec = build_tree(lp, ids, budget, root_token=torch.tensor(3), start=torch.tensor(start))
        for name in ("tokens", "parents", "depths", "positions", "mask"):
            assert torch.equal(getattr(ref, name), getattr(vec, name)), (case, name)
        _check_structure(vec, start, L)


@pytest.mark.parametrize("ties", [False, True])
def test_many_heap_trees_in_one_pass_equal_the_vectorized_builder_tree_by_tree(ties):
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        asks = []
        for _ in range(int(torch.randint(1, 12, (1,), generator=gen))):
            L = int(torch.randint(0, 8, (1,), generator=gen))
            V = int(torch.randint(1, 40, (1,), generator=gen))
            budget = int(torch.randint(0, 70, (1,), generator=gen))
            lp, ids = topk_logprobs(_random_logits(L, V, gen, ties), max(budget, 1), policy=POLICY)
            root = torch.randint(0, 50000, (), generator=gen)   # a device tensor, as a request's bonus token
            start = int(torch.randint(0, 300000, (1,), generator=gen))
            if len(asks) % 3 == 1:   # an int root and a tensor start, as other callers give them
                root, start = int(root), torch.tensor(start)
            asks.append(HeapAsk(lp, ids, budget, root, start))
        for ask, tree in zip(asks, build_trees_heap(asks)):
            vec = build_tree(ask.lp, ask.ids, ask.budget, root_token=torch.as_tensor(ask.root_token),
                             start=torch.as_tensor(ask.start))
            for name in ("tokens", "parents", "depths", "positions", "mask"):
                assert torch.equal(getattr(tree, name), getattr(vec, name)), name


def test_budget_one_and_zero():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    lp, ids = topk_logprobs(logits, 1, policy=POLICY)
    t = build_tree(lp, ids, 1, root_token=2, start=10)
    assert t.tokens.tolist() == [2, 1] and t.positions.tolist() == [10, 11]
    t0 = build_tree(lp, ids, 0, root_token=2, start=10)
    assert t0.tokens.tolist() == [2] and t0.mask.tolist() == [[True]]


def test_heap_prefers_sibling_over_deep_chain():
    # depth-1 distribution is flat over 2 tokens, depth 2 is uncertain: the 2nd root child beats depth 2
    logits = torch.log(torch.tensor([[0.5, 0.5, 1e-6], [0.4, 0.3, 0.3]]))
    lp, ids = topk_logprobs(logits, 2, policy=POLICY)
    t = build_tree_heap(lp, ids, 2, root_token=9, start=0)
    assert t.depths.tolist() == [0, 1, 1]


def test_chain_tree():
    t = chain_tree(torch.tensor(4), torch.tensor([1, 2, 3]), torch.tensor(7))
    assert t.tokens.tolist() == [4, 1, 2, 3]
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert t.positions.tolist() == [7, 8, 9, 10]
    assert torch.equal(t.mask, torch.ones(4, 4, dtype=torch.bool).tril())
