"""The DDTree best-first builder as one Triton program (the whole tree in one launch).

Same algorithm, tie-break and float32 arithmetic as ``speculative.tree.build_tree`` (its torch reference and
the CPU path) and ``build_tree_heap`` (the host heap): a candidate pool of 2n + 1 slots in push order,
n pops; each pop takes the first maximum (``tl.argmax`` breaks ties to the left = the earliest push),
then pushes its next sibling (slot 2i+1, score parent score + lp[d-1, r+1]) and its first child
(slot 2i+2, score own score + lp[d, 0]). Scores are float32 sums in the same order as the references,
so the trees are identical, not just close.

The pool, the node arrays and, for trees of at most MAX_MASK_NODES nodes, the ancestor-or-self mask
live in registers of the one program (the mask by pointer chasing: max depth + 1 steps, each a
compare-and-sum gather over the node arrays). Larger trees get the mask from ``speculative.tree.ancestor_mask``.
Why: the torch builder is ~25 tiny launches per node; even replayed from a CUDA graph a 64-node tree
costs milliseconds, while one program does it in microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..speculative.tree import LP_FLOOR, DraftTree, ancestor_mask, tree_size

MAX_MASK_NODES = 128  # in-kernel mask: [NB, NB] in registers


@triton.jit
def _ddtree_kernel(lp_ptr, ids_ptr, root_ptr, tok_ptr, par_ptr, dep_ptr, mask_ptr,
                   L, K, n,
                   PB: tl.constexpr, NB: tl.constexpr, MASK: tl.constexpr, MAXD: tl.constexpr):
    offs = tl.arange(0, PB)  # pool slots (push order)
    nodes = tl.arange(0, NB)  # node indices (pop order), 0 = root
    neg_inf = float("-inf")
    last = L * K - 1
    first = tl.load(lp_ptr).to(tl.float32)
    has = n > 0
    score = tl.where((offs == 0) & has, first, neg_inf)
    pscore = tl.zeros((PB,), dtype=tl.float32)
    ppar = tl.zeros((PB,), dtype=tl.int32)
    pdep = tl.where(offs == 0, 1, 0).to(tl.int32)
    prank = tl.zeros((PB,), dtype=tl.int32)
    root = tl.load(root_ptr)
    tok = tl.where(nodes == 0, root, 0).to(tl.int64)
    par = tl.where(nodes == 0, -1, 0).to(tl.int32)
    dep = tl.zeros((NB,), dtype=tl.int32)
    for i in range(0, n):
        j = tl.argmax(score, 0, tie_break_left=True)
        sel = offs == j
        s = tl.sum(tl.where(sel, score, 0.0), 0)
        ps = tl.sum(tl.where(sel, pscore, 0.0), 0)
        p = tl.sum(tl.where(sel, ppar, 0), 0)
        d = tl.sum(tl.where(sel, pdep, 0), 0)
        r = tl.sum(tl.where(sel, prank, 0), 0)
        score = tl.where(sel, neg_inf, score)
        flat = (d - 1) * K + r
        t = tl.load(ids_ptr + flat)
        here = nodes == i + 1
        tok = tl.where(here, t, tok)
        par = tl.where(here, p, par)
        dep = tl.where(here, d, dep)
        sib_lp = tl.load(lp_ptr + tl.minimum(flat + 1, last))
        child_lp = tl.load(lp_ptr + tl.minimum(d * K, last))
        sib = tl.where(r + 1 < K, ps + sib_lp, neg_inf)
        child = tl.where(d < L, s + child_lp, neg_inf)
        a = offs == 2 * i + 1
        b = offs == 2 * i + 2
        score = tl.where(a, sib, tl.where(b, child, score))
        pscore = tl.where(a, ps, tl.where(b, s, pscore))
        ppar = tl.where(a, p, tl.where(b, i + 1, ppar))
        pdep = tl.where(a, d, tl.where(b, d + 1, pdep))
        prank = tl.where(a, r + 1, tl.where(b, 0, prank))
    n1 = n + 1
    ok = nodes < n1
    tl.store(tok_ptr + nodes, tok, mask=ok)
    tl.store(par_ptr + nodes, par.to(tl.int64), mask=ok)
    tl.store(dep_ptr + nodes, dep.to(tl.int64), mask=ok)
    if MASK:
        # row i: the nodes met walking up from i (itself included); the root points to itself
        up = tl.maximum(par, 0)
        cur = nodes
        m = nodes[:, None] == nodes[None, :]
        for _ in range(MAXD):
            cur = tl.sum(tl.where(nodes[None, :] == cur[:, None], up[None, :], 0), 1)  # up[cur]
            m = m | (nodes[None, :] == cur[:, None])
        mp = mask_ptr + nodes[:, None] * n1 + nodes[None, :]
        tl.store(mp, m.to(tl.int8), mask=ok[:, None] & ok[None, :])


def _tree_warps(nb: int) -> int:
    """Warps of the one program: a single warp up to 32 nodes (a pop's reductions stay in warp shuffles,
    no barrier; the [32, 32] mask is 32 registers a lane), more for larger trees (their mask would spill)."""
    return 1 if nb <= 32 else 4 if nb < 64 else 8


def build_tree_triton(lp: torch.Tensor, ids: torch.Tensor, budget: int, root_token: torch.Tensor,
                      start: torch.Tensor | int):
    """The tree of ``speculative.tree.build_tree`` from one launch. lp [L, K], ids [L, K], root_token [] long."""
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    L, K = lp.shape
    n = tree_size(budget, L, K) if K > 0 else 0
    dev = lp.device
    lpf = lp.detach().float().clamp_min(LP_FLOOR).reshape(-1).contiguous()  # [L*K]
    idf = ids.reshape(-1).to(torch.long).contiguous()
    if lpf.numel() == 0:  # no drafts: keep the pointers valid
        lpf = torch.zeros(1, dtype=torch.float32, device=dev)
        idf = torch.zeros(1, dtype=torch.long, device=dev)
    root = root_token.reshape(1).to(device=dev, dtype=torch.long) if isinstance(root_token, torch.Tensor) \
        else torch.full((1,), int(root_token), dtype=torch.long, device=dev)
    n1 = n + 1
    tok = torch.empty(n1, dtype=torch.long, device=dev)
    par = torch.empty(n1, dtype=torch.long, device=dev)
    dep = torch.empty(n1, dtype=torch.long, device=dev)
    nb = max(triton.next_power_of_2(n1), 2)
    in_kernel = nb <= MAX_MASK_NODES
    mask8 = torch.empty((n1, n1) if in_kernel else (1,), dtype=torch.int8, device=dev)
    _ddtree_kernel[(1,)](lpf, idf, root, tok, par, dep, mask8, L, K, n,
                         PB=max(triton.next_power_of_2(2 * n + 1), 2), NB=nb, MASK=in_kernel, MAXD=L,
                         num_warps=_tree_warps(nb))
    mask = mask8.view(torch.bool) if in_kernel else ancestor_mask(par, max_depth=L)
    return DraftTree(tokens=tok, parents=par, depths=dep, positions=dep + start, mask=mask)
