"""The accept walk of a device-resident round and its bookkeeping in one program (one launch).

    tokens, parents [N1] long   the tree in node order (parents[0] = -1, parents[i] < i)
    picks           [N1] long   the target's token at every node
    acc             [M]  long   out: acc[d] = the accepted node at depth d for d < A (root first), 0 past A
    result          [M+1] long  out: result[:A] = the emitted tokens (accepted drafts, then the bonus),
                                result[M] = A; entries A .. M-1 are unspecified
    bonus           []   long   out: the target's pick at the last accepted node

The walk starts at the root and moves to the child whose token is the target's pick at the current node,
while one exists (siblings carry distinct tokens, so at most one matches); each step is a compare over
the nodes in registers. It is the rule of speculative/accept.py, as the torch walk of speculative/walks.py
(``walk_flat``: the CPU path and the oracle with the literal walk, tests/kernels/test_accept_walk.py) computes it in
~25 launches on CUDA. ``M`` = min(block size, N1) bounds A.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(tok_ptr, par_ptr, pick_ptr, acc_ptr, res_ptr, bonus_ptr, N1, M, STEPS,
                   NB: tl.constexpr):
    nodes = tl.arange(0, NB)
    ok = nodes < N1
    tok = tl.load(tok_ptr + nodes, mask=ok, other=-1)
    par = tl.load(par_ptr + nodes, mask=ok, other=-2).to(tl.int32)
    pick = tl.load(pick_ptr + nodes, mask=ok, other=-1)
    cur = tl.zeros((), tl.int32)
    pc = tl.load(pick_ptr)                         # the pick at the current node
    path = tl.zeros((NB,), tl.int32)               # path[d] = the accepted node at depth d
    emit = tl.zeros((NB,), tl.int64)               # emit[d] = the token of the accepted node at depth d+1
    count = tl.full((), 1, tl.int32)
    for _ in range(STEPS):
        hit = ok & (par == cur) & (tok == pc)
        found = tl.max(hit.to(tl.int32), axis=0) > 0
        nxt = tl.sum(tl.where(hit, nodes, 0), axis=0)
        emit = tl.where(found & (nodes == count - 1), pc, emit)
        path = tl.where(found & (nodes == count), nxt, path)
        cur = tl.where(found, nxt, cur)
        pc = tl.where(found, tl.sum(tl.where(nodes == nxt, pick, 0), axis=0), pc)
        count += found.to(tl.int32)
    emit = tl.where(nodes == count - 1, pc, emit)
    out = nodes < M
    tl.store(acc_ptr + nodes, path.to(tl.int64), mask=out)
    tl.store(res_ptr + nodes, emit, mask=out)
    tl.store(res_ptr + M, count.to(tl.int64))
    tl.store(bonus_ptr, pc)


def accept_walk(tokens: torch.Tensor, parents: torch.Tensor, picks: torch.Tensor, m: int, max_depth: int,
                acc: torch.Tensor, result: torch.Tensor, bonus: torch.Tensor) -> None:
    """Triton: the walk over a tree of N1 nodes whose depths are at most ``max_depth``; writes ``acc`` [m],
    ``result`` [m + 1] and ``bonus`` [] (all long, contiguous) in place. See the module docstring."""
    n1 = tokens.shape[0]
    for name, t, shape in (("tokens", tokens, (n1,)), ("parents", parents, (n1,)), ("picks", picks, (n1,)),
                           ("acc", acc, (m,)), ("result", result, (m + 1,)), ("bonus", bonus, ())):
        if t.shape != shape or t.dtype != torch.long or not t.is_contiguous() or t.device != tokens.device:
            raise ValueError(f"accept_walk: {name} must be a contiguous long tensor of shape {shape} on "
                             f"{tokens.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    if not 1 <= m <= n1 or max_depth < 0:
        raise ValueError(f"accept_walk: need 1 <= m <= N1 = {n1} and max_depth >= 0, got m={m}, "
                         f"max_depth={max_depth}")
    nb = max(triton.next_power_of_2(n1), 2)
    _accept_kernel[(1,)](tokens, parents, picks, acc, result, bonus, n1, m, min(max_depth, m - 1), NB=nb,
                         num_warps=1 if nb <= 256 else 4)


__all__ = ["accept_walk"]
