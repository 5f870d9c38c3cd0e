"""Draft trees: the DDTree best-first builder and the DFlash chain.

A drafter pass gives per-position distributions q_1..q_L over the vocabulary (L = block size - 1).
Under the factorized surrogate Q(y) = prod_i q_i(y_i), the expected accepted depth of a
prefix-closed tree is the sum of its nodes' prefix probabilities, so the best tree under a budget of
``budget`` non-root nodes is the set of the ``budget`` most probable prefixes. It is found
best-first: every candidate prefix has exactly one generator (its previous sibling, else its
parent), scores never increase along a generator edge, so the pops come out in non-increasing score
order and parents are popped before their children.

Tie-break (shared by every builder here and kernels/tree_ops.py, so they return the identical tree): among
equal scores the candidate pushed first wins. A pop pushes its next sibling first, then its first child. Scores are
accumulated along the path, ``score(child) = score(parent) + lp[depth, rank]``, in float32 in both
builders, so equal inputs give bit-identical scores.

Node order is pop order: node 0 is the root (the bonus token, depth 0), parents precede children. The
drafter's top-k log-probs that the builders take come from sampling.topk_logprobs.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

# Log-probs are clamped from below so that every real candidate has a finite score (a -inf logit
# must not tie with an empty slot of the vectorized pool). 16 such terms stay finite in float32.
LP_FLOOR = -1.0e30


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in node (pop) order; n = number of non-root nodes, N1 = n + 1."""

    tokens: torch.Tensor     # [N1] long; tokens[0] = root (bonus token)
    parents: torch.Tensor    # [N1] long; parents[0] = -1, parents[i] < i
    depths: torch.Tensor     # [N1] long; depths[0] = 0
    positions: torch.Tensor  # [N1] long; start + depth
    mask: torch.Tensor       # [N1, N1] bool; mask[i, j] = j is i or an ancestor of i

    @property
    def num_nodes(self) -> int:
        """Nodes including the root (the verify width)."""
        return int(self.tokens.shape[0])


def tree_size(budget: int, depth: int, k: int) -> int:
    """Nodes a best-first tree gets: min(budget, number of prefixes of length 1..depth over k tokens)."""
    total, level = 0, 1
    for _ in range(depth):
        level *= k
        total += level
        if total >= budget:
            return budget
    return total


def heap_order(lpl: np.ndarray) -> Iterator[tuple[int, int, int, np.float32]]:
    """The best-first heap's nodes in pop order, lazily: (parent index, depth, rank, score).

    lpl [L, K] float32 log-probs (clamped); node i (1-based, the root is 0) is the i-th pop. The order
    does not depend on the budget: the budget-b tree is the first b pops."""
    L, K = lpl.shape if lpl.ndim == 2 else (0, 0)
    if L == 0 or K == 0:
        return
    scores = [np.float32(0.0)]  # numpy float32 scalars: the same float32 additions as the vectorized builder
    s = scores[0] + lpl[0, 0]
    heap: list[tuple[float, int, int, int, int, np.float32]] = [(-float(s), 0, 0, 1, 0, s)]
    counter = 1  # (key, push order, parent, depth, rank, score)
    while heap:
        _, _, par, d, r, s = heapq.heappop(heap)
        idx = len(scores)
        scores.append(s)
        yield par, d, r, s
        if r + 1 < K:
            s2 = scores[par] + lpl[d - 1, r + 1]
            heapq.heappush(heap, (-float(s2), counter, par, d, r + 1, s2))
            counter += 1
        if d < L:
            s3 = s + lpl[d, 0]
            heapq.heappush(heap, (-float(s3), counter, idx, d + 1, 0, s3))
            counter += 1


def clamped_logprobs(lp: torch.Tensor) -> np.ndarray:
    """Draft log-probs as the heap reads them: float32, clamped to LP_FLOOR, on the host."""
    return lp.detach().float().clamp_min(LP_FLOOR).cpu().numpy()


@dataclass(frozen=True)
class HeapAsk:
    """One tree for :func:`build_trees_heap`: top-k log-probs ``lp`` [L, K] (descending per row) and ids [L, K] on the
    device, ``budget`` non-root nodes, the root (bonus) token and its position."""

    lp: torch.Tensor
    ids: torch.Tensor
    budget: int
    root_token: int | torch.Tensor
    start: int | torch.Tensor


def heap_tree(lpl: np.ndarray, idl: np.ndarray, budget: int, root: int) -> tuple[list[int], list[int], list[int]]:
    """The best-first tree on the host: (tokens, parents, depths) in pop order from clamped float32 log-probs
    ``lpl`` [L, K] and ids ``idl`` [L, K]."""
    tokens, parents, depths = [root], [-1], [0]
    if budget > 0:
        for par, d, r, _ in heap_order(lpl):
            tokens.append(int(idl[d - 1, r]))
            parents.append(par)
            depths.append(d)
            if len(tokens) - 1 >= budget:
                break
    return tokens, parents, depths


def host_ancestor_mask(parents: list[int]) -> np.ndarray:
    """[N1, N1] bool: row i = row of its parent + itself."""
    n1 = len(parents)
    mask = np.zeros((n1, n1), dtype=bool)
    for i in range(n1):
        if parents[i] >= 0:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def build_trees_heap(asks: list[HeapAsk]) -> list[DraftTree]:
    """Reference builder, for many trees at once: a Python heap on the host (also the fast path on the CPU).

    The inputs of every tree come over in one copy (float64 holds float32 log-probs, token ids and positions
    exactly) and the trees go back in two (their long and bool tensors), whatever the number of trees: a batch of
    requests waits on the device once, not once per request. Each tree's tensors are views of those copies."""
    for a in asks:
        if a.budget < 0:
            raise ValueError(f"budget must be >= 0, got {a.budget}")
    if not asks:
        return []
    device = asks[0].ids.device
    # what lives on the device (the log-probs, the ids, roots and starts given as tensors) in one copy; a handful of
    # launches whatever the number of trees
    scalars = [v for a in asks for v in (a.root_token, a.start) if isinstance(v, torch.Tensor)]
    lp = torch.cat([a.lp.detach().reshape(-1).float() for a in asks]).clamp_min(LP_FLOOR).double()
    ids = torch.cat([a.ids.reshape(-1) for a in asks]).double()
    parts = [lp, ids] + ([torch.stack([v.reshape(()) for v in scalars]).to(device).double()] if scalars else [])
    host = torch.cat(parts).cpu().numpy()
    n = lp.numel()
    lps, idss, held = host[:n].astype(np.float32), host[n:2 * n].astype(np.int64), iter(host[2 * n:].tolist())
    longs: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    at = 0
    for a in asks:
        size = a.lp.numel()
        lpl, idl = lps[at:at + size].reshape(a.lp.shape), idss[at:at + size].reshape(a.ids.shape)
        at += size
        root, start = (int(next(held)) if isinstance(v, torch.Tensor) else int(v) for v in (a.root_token, a.start))
        tokens, parents, depths = heap_tree(lpl, idl, a.budget, root)
        dep = np.asarray(depths, dtype=np.int64)
        longs.append(np.concatenate([np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64), dep,
                                     dep + start]))
        masks.append(host_ancestor_mask(parents).reshape(-1))
    long_dev = torch.from_numpy(np.concatenate(longs)).to(device)
    mask_dev = torch.from_numpy(np.concatenate(masks)).to(device)
    trees, lo, mo = [], 0, 0
    for vals in longs:
        n1 = vals.shape[0] // 4
        block = long_dev[lo:lo + 4 * n1].view(4, n1)
        trees.append(DraftTree(tokens=block[0], parents=block[1], depths=block[2], positions=block[3],
                               mask=mask_dev[mo:mo + n1 * n1].view(n1, n1)))
        lo, mo = lo + 4 * n1, mo + n1 * n1
    return trees


def build_tree_heap(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_token: int | torch.Tensor,
                    start: int | torch.Tensor) -> DraftTree:
    """Reference builder: a Python heap on the host (also the fast path on the CPU).

    lp [L, K] float (descending per row), ids [L, K] long, budget = max non-root nodes (>= 0),
    root_token = the bonus token, start = its position.
    """
    return build_trees_heap([HeapAsk(lp, ids, budget, root_token, start)])[0]


def build_tree(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_token: torch.Tensor | int,
               start: torch.Tensor | int) -> DraftTree:
    """Vectorized builder on the device of ``lp``: the same tree as :func:`build_tree_heap`.

    No host synchronization: the node count n = :func:`tree_size` follows from shapes alone, and the
    loop runs n fixed iterations over a candidate pool of 2n + 1 slots (slot = push order), each a
    handful of tensor ops (argmax takes the first maximum, which is the earliest push).
    ``root_token`` and ``start`` may be 0-d device tensors.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    device = lp.device
    L, K = lp.shape
    n = tree_size(budget, L, K) if K > 0 else 0
    lpf = lp.detach().float().clamp_min(LP_FLOOR).reshape(-1)  # [L*K]
    idf = ids.reshape(-1)  # [L*K]
    P = 2 * n + 1
    pool_score = torch.full((P,), float("-inf"), dtype=torch.float32, device=device)
    pool_pscore = torch.zeros((P,), dtype=torch.float32, device=device)  # parent's score
    pool_meta = torch.zeros((3, P), dtype=torch.long, device=device)  # parent, depth, rank
    tok = torch.empty((n + 1,), dtype=torch.long, device=device)
    par = torch.empty((n + 1,), dtype=torch.long, device=device)
    dep = torch.empty((n + 1,), dtype=torch.long, device=device)
    # fill_ with Python scalars, never `t[i] = scalar`: that is a host-to-device copy (a sync)
    if isinstance(root_token, torch.Tensor):
        tok[:1] = root_token.reshape(1)
    else:
        tok[:1].fill_(int(root_token))
    par[:1].fill_(-1)
    dep[:1].fill_(0)
    if n > 0:
        pool_score[:1] = lpf[:1]
        pool_meta[1, :1].fill_(1)
    neg_inf = torch.full((1,), float("-inf"), dtype=torch.float32, device=device)
    zero = torch.zeros((1,), dtype=torch.long, device=device)
    last = L * K - 1
    for i in range(n):
        # all per-iteration values are [1]-shaped device tensors: index_select, never Python ints
        j = torch.argmax(pool_score).reshape(1)  # first maximum = earliest push among ties
        s = pool_score.index_select(0, j)  # [1]
        ps = pool_pscore.index_select(0, j)  # [1]
        meta = pool_meta.index_select(1, j)  # [3, 1]
        p, d, r = meta[0], meta[1], meta[2]  # [1] each
        pool_score.index_fill_(0, j, float("-inf"))
        flat = (d - 1) * K + r  # [1]
        tok[i + 1:i + 2] = idf.index_select(0, flat)
        par[i + 1:i + 2] = p
        dep[i + 1:i + 2] = d
        # slot 2i+1: next sibling (same parent, rank r+1); slot 2i+2: first child (depth d+1, rank 0)
        sib_lp = lpf.index_select(0, (flat + 1).clamp(max=last))
        child_lp = lpf.index_select(0, (d * K).clamp(max=last))
        pool_score[2 * i + 1:2 * i + 3] = torch.cat([
            torch.where(r + 1 < K, ps + sib_lp, neg_inf),
            torch.where(d < L, s + child_lp, neg_inf)])
        pool_pscore[2 * i + 1:2 * i + 3] = torch.cat([ps, s])
        pool_meta[:, 2 * i + 1:2 * i + 3] = torch.stack([
            torch.cat([p, zero + (i + 1)]), torch.cat([d, d + 1]), torch.cat([r + 1, zero])])
    return DraftTree(tokens=tok, parents=par, depths=dep, positions=dep + start,
                     mask=ancestor_mask(par, max_depth=L))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self mask [N1, N1] from parents [N1] (parents[0] = -1), by pointer chasing.

    ``max_depth`` bounds the tree depth, so the loop length is static (no host sync).
    """
    n1 = parents.shape[0]
    rows = torch.arange(n1, device=parents.device)
    up = parents.clamp_min(0)  # the root points to itself
    mask = torch.zeros((n1, n1), dtype=torch.bool, device=parents.device)
    true = torch.ones((), dtype=torch.bool, device=parents.device)
    cur = rows
    for _ in range(max_depth + 1):
        mask.index_put_((rows, cur), true)
        cur = up.index_select(0, cur)
    return mask


def chain_tree(root_token: torch.Tensor | int, draft_tokens: torch.Tensor, start: torch.Tensor | int) -> DraftTree:
    """The DFlash chain as a one-branch tree: root -> d_1 -> ... -> d_L.  draft_tokens [L]."""
    device = draft_tokens.device
    L = draft_tokens.shape[0]
    root = root_token if isinstance(root_token, torch.Tensor) else torch.tensor(int(root_token), device=device)
    tokens = torch.cat([root.reshape(1).to(device=device, dtype=torch.long), draft_tokens.long()])  # [L+1]
    dep = torch.arange(L + 1, device=device)
    return DraftTree(tokens=tokens, parents=dep - 1, depths=dep, positions=dep + start,
                     mask=torch.ones((L + 1, L + 1), dtype=torch.bool, device=device).tril())
