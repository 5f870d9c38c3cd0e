"""The batched accept walks (speculative/walks.py) and the batched commit (cache.commit_many).

Oracles: the literal host walk over child maps (accept.accept_reference), tree by tree; for the commit, the kept
entries' values written out from the slots each request held before it. Random trees, picks and pools; seeds
printed."""

from __future__ import annotations

import os

import pytest
import torch

from kdtree_engine.cache import BLOCK, CachePool, LatentCache, commit_many
from kdtree_engine.config import preset
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.sampling import topk_logprobs
from kdtree_engine.speculative.accept import accept_reference
from kdtree_engine.speculative.tree import build_tree_heap, chain_tree
from kdtree_engine.speculative.walks import walk_trees

POLICY = KernelPolicy.from_env()


def seeded() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return seed


def random_tree(gen: torch.Generator, V: int = 12):
    """A DDTree (or a chain, or the root alone) from random drafter logits over a small vocabulary."""
    L = int(torch.randint(0, 8, (1,), generator=gen))
    root, start = torch.tensor(int(torch.randint(0, V, (1,), generator=gen))), 5
    logits = torch.randn(L, V, generator=gen) * 2
    kind = int(torch.randint(0, 3, (1,), generator=gen))
    if kind == 0 or L == 0:
        return chain_tree(root, logits.argmax(-1), start)
    budget = int(torch.randint(1, 40, (1,), generator=gen))
    lp, ids = topk_logprobs(logits, min(budget, V), policy=POLICY)
    return build_tree_heap(lp, ids, budget, root, start)


def likely_picks(tree, gen: torch.Generator, V: int = 12) -> torch.Tensor:
    """A pick per node: mostly one of its children's tokens (long accepted paths), else any token."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    picks = torch.randint(0, V, (len(tokens),), generator=gen)
    for i in range(len(tokens)):
        kids = [tokens[c] for c in range(1, len(tokens)) if parents[c] == i]
        if kids and float(torch.rand((), generator=gen)) < 0.8:
            picks[i] = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
    return picks


@pytest.mark.parametrize("R", [1, 2, 7, 16])
def test_walks_of_many_trees_equal_each_tree_walked_alone(R: int) -> None:
    gen = torch.Generator().manual_seed(seeded())
    for _ in range(20):
        trees = [random_tree(gen) for _ in range(R)]
        picks = [likely_picks(t, gen) for t in trees]
        walks = walk_trees(trees, torch.cat(picks))
        for r, (tree, pk) in enumerate(zip(trees, picks)):
            path, bonus = accept_reference(tree, pk)
            assert walks.counts[r] == len(path)
            assert walks.accepted(r).tolist() == path
            assert int(walks.bonus[r]) == bonus
            assert walks.tokens[r] == [tree.tokens.tolist()[i] for i in path[1:]] + [bonus]
        rows = [torch.randn(t.num_nodes, 3, generator=gen) for t in trees]   # a block of rows per tree, node order
        for r, (got, block) in enumerate(zip(walks.take(rows), rows)):
            assert torch.equal(got, block[accept_reference(trees[r], picks[r])[0]])


def test_walks_refuse_picks_of_another_size() -> None:
    tree = chain_tree(torch.tensor(3), torch.tensor([4, 5]), 0)
    with pytest.raises(ValueError, match="picks has shape"):
        walk_trees([tree], torch.zeros(4, dtype=torch.long))


def test_commit_many_keeps_each_requests_entries() -> None:
    seed = seeded()
    gen = torch.Generator().manual_seed(seed)
    cfg = preset("k2-tiny")
    pool = CachePool(cfg, 40, dtype=torch.float32, device="cpu")
    blocks = [pool.take(1)[0] for _ in range(pool.free_blocks)]   # hand the blocks out in a shuffled order
    for i in torch.randperm(len(blocks), generator=gen).tolist():
        pool.give([blocks[i]])
    caches, before, keeps = [], [], []
    for _ in range(5):
        cap = int(torch.randint(BLOCK, 4 * BLOCK, (1,), generator=gen))
        cache = LatentCache(pool, cap)
        n = int(torch.randint(1, 20, (1,), generator=gen))
        cache.load_slots(torch.randn(cfg.num_hidden_layers, cap, cfg.kv_cache_dim, generator=gen))
        cache.length = int(torch.randint(0, cap - n, (1,), generator=gen))
        cache.reserve(n)
        before.append(cache.kv.clone())
        keep = sorted(torch.randperm(n, generator=gen)[:int(torch.randint(1, n + 1, (1,), generator=gen))].tolist())
        keeps.append(keep)
        caches.append(cache)
    M = max(len(k) for k in keeps)
    rows = torch.zeros(len(caches), M, dtype=torch.long)
    for r, k in enumerate(keeps):
        rows[r, :len(k)] = torch.tensor(k)
    starts = [c.length for c in caches]
    commit_many(caches, rows, [len(k) for k in keeps])
    for cache, old, start, keep in zip(caches, before, starts, keeps):
        assert cache.length == start + len(keep) and cache.pending == 0
        want = torch.cat([old[:, :start], old[:, [start + j for j in keep]]], dim=1)
        assert torch.equal(cache.kv[:, :cache.length], want)
        cache.release()
    assert pool.free_blocks == len(blocks)
