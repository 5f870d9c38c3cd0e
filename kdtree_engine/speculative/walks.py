"""The accept walks of many draft trees at once: a fixed handful of device ops over all their nodes, one host read.

The rule is the one of :mod:`.accept` (a node is on its tree's accepted path when it and each of its ancestors
below the root carry the token the target picked at their parent; the pick at the deepest such node is the bonus).
Here the trees are laid end to end (node i of tree r at flat index base[r] + i) and the AND along each ancestor chain
is taken by pointer jumping: ceil(log2 n) doublings for trees of at most n nodes, whatever the number of trees, so a
batch of requests walks in as many launches as one request. A tree's accepted nodes have the distinct depths
0..A-1 and ascend in node order (parents precede children), so one scatter by (tree, depth) lays every path out root
first. Nothing is read back but the one copy of every tree's count and emitted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch

from ..cache import LatentCache, commit_many
from .tree import DraftTree


@dataclass(frozen=True)
class TreeWalks:
    """The walks of ``R`` trees: ``nodes`` [R, M] device long (row r: tree r's accepted nodes root first, then 0s),
    ``bonus`` [R] device long, ``counts`` (A per tree, host) and ``tokens`` (each tree's emitted tokens on the host:
    its accepted drafts, then the bonus)."""

    nodes: torch.Tensor
    bonus: torch.Tensor
    counts: list[int]
    tokens: list[list[int]]

    def accepted(self, r: int) -> torch.Tensor:
        """[A] device long: tree r's accepted nodes, root first (ascending)."""
        return self.nodes[r, :self.counts[r]]

    def take(self, blocks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each tree's accepted rows of its block ``blocks[r]`` [N1_r, ...] (rows in node order), for every tree in one
        gather: a list of [A_r, ...]."""
        R, M = self.nodes.shape
        dev = self.nodes.device
        starts = [0, *accumulate(b.shape[0] for b in blocks)][:R]
        picked = [r * M + j for r, a in enumerate(self.counts) for j in range(a)]
        host = torch.tensor(starts + picked, dtype=torch.long).to(dev)   # one copy
        flat = (host[:R].unsqueeze(1) + self.nodes).reshape(-1).index_select(0, host[R:])
        return list(torch.cat(list(blocks)).index_select(0, flat).split(self.counts))


def walk_trees(trees: Sequence[DraftTree], picks: torch.Tensor) -> TreeWalks:
    """The walks of ``trees`` given the target's pick at every node, ``picks`` [sum of the trees' nodes] long (the
    trees' nodes in order, as their rows were verified)."""
    if not trees:
        raise ValueError("walk_trees needs at least one tree")
    sizes = [t.num_nodes for t in trees]
    R, N, M = len(trees), sum(sizes), max(sizes)
    if picks.shape != (N,):
        raise ValueError(f"picks has shape {tuple(picks.shape)}; the trees have {N} nodes")
    starts = [0, *accumulate(sizes)][:R]
    layout = torch.tensor(starts + [r for r, n in enumerate(sizes) for _ in range(n)], dtype=torch.long)
    layout = layout.to(picks.device)
    tokens, parents = torch.cat([t.tokens for t in trees]), torch.cat([t.parents for t in trees])
    nodes, count, bonus, emitted = walk_flat(tokens, parents, torch.cat([t.depths for t in trees]), picks,
                                             layout[:R], layout[R:], M)
    host = torch.cat([count, emitted.reshape(-1)]).tolist()   # the walk's one read
    counts = host[:R]
    return TreeWalks(nodes, bonus, counts, [host[R + r * M:R + r * M + a] for r, a in enumerate(counts)])


def walk_flat(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, picks: torch.Tensor,
              base: torch.Tensor, tree_of: torch.Tensor, M: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The walks on the device (no host read: capturable): the trees' nodes laid end to end (``tokens``, ``parents``
    local to each tree, ``depths``, ``picks`` [N]), tree r's first node at ``base[r]``, node i in tree
    ``tree_of[i]``, at most ``M`` nodes a tree. Returns (nodes [R, M]: the accepted nodes root first, then 0s;
    count [R]; bonus [R]; emitted [R, M]: the accepted drafts then the bonus, past the count unspecified)."""
    R, N, dev = base.shape[0], tokens.shape[0], tokens.device
    node = torch.arange(N, device=dev)
    mine = base.index_select(0, tree_of)
    root = parents < 0
    up = torch.where(root, node, parents + mine)   # a root is its own parent
    ok = (tokens == picks.index_select(0, up)) | root
    for _ in range((M - 1).bit_length()):   # ok[i]: the AND of match over i and its 2^k - 1 nearest ancestors
        ok = ok & ok.index_select(0, up)
        up = up.index_select(0, up)
    count = torch.zeros(R, dtype=torch.long, device=dev).scatter_add_(0, tree_of, ok.long())
    dst = torch.where(ok, tree_of * M + depths, R * M + node)   # distinct: one path node per (tree, depth)
    nodes = torch.zeros(R * M + N, dtype=torch.long, device=dev).scatter_(0, dst, node - mine)[:R * M].view(R, M)
    flat = base.unsqueeze(1) + nodes   # [R, M] flat indices of the path nodes
    bonus = picks.index_select(0, flat.gather(1, (count - 1).unsqueeze(1)).squeeze(1))
    path = tokens.index_select(0, flat.reshape(-1)).view(R, M)
    j = torch.arange(M, device=dev)
    nxt = path.index_select(1, (j + 1).clamp(max=M - 1))
    emitted = torch.where(j.unsqueeze(0) == (count - 1).unsqueeze(1), bonus.unsqueeze(1), nxt)
    return nodes, count, bonus, emitted


def commit_walks(caches: Sequence, walks: TreeWalks) -> None:
    """Commit each tree's accepted nodes in its request's cache (``caches[r]`` for tree r): latent caches of one pool
    in one copy (:func:`~kdtree_engine.cache.commit_many`); other caches (a test target's) each by its own commit."""
    if all(isinstance(c, LatentCache) for c in caches) and len({id(c.pool) for c in caches}) == 1:
        commit_many(list(caches), walks.nodes, walks.counts)
        return
    for r, cache in enumerate(caches):
        cache.commit(walks.accepted(r))
