"""The vocabulary split over ranks: embedding lookups, greedy picks, the drafter's top-k and sampling, without
gathering full logits.

Rank r holds ids [start, start + size) of the embedding and lm_head, so its logits are [..., size]. Every
reduction gathers a few values per row from every rank and combines them in rank order on every rank, so every
rank computes the same result with no broadcast (the drafter's tree, the accept walk and the emitted tokens are
identical on all ranks). Ties go to the lowest global id, as on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.dispatch import row_argmax
from ..kernels.policy import KernelPolicy
from ..kernels.reference import ordered_sum_torch
from .comm import Communicator, rank_order_sum, tp_sum


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: ids [start, start + size) of ``total``."""

    comm: Communicator
    start: int
    size: int
    total: int


def vocab_embed(policy: KernelPolicy, vocab: VocabShard, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows [T, H] of global ``ids`` [T]: each rank looks up the ids in its slice (zeros elsewhere),
    summed over the ranks (exact: one rank adds a row, the others add zeros)."""
    local = ids - vocab.start
    mine = (local >= 0) & (local < vocab.size)
    rows = weight.index_select(0, torch.where(mine, local, torch.zeros_like(local)))  # [T, H]
    return tp_sum(policy, vocab.comm, rows.masked_fill(~mine.unsqueeze(-1), 0))


def first_best(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-rank candidates vals / ids [N, ...] (rank order = global id order) -> (value, id) [...] of the largest
    value, ties to the first rank holding it (so to the lowest global id when each rank gives its lowest)."""
    best = vals.max(dim=0).values  # [...]
    first = torch.argmax((vals == best.unsqueeze(0)).to(torch.int32), dim=0)  # the first maximal rank
    return best, ids.gather(0, first.unsqueeze(0)).squeeze(0)


def vocab_argmax(policy: KernelPolicy, vocab: VocabShard, x: torch.Tensor) -> torch.Tensor:
    """Global argmax over the last axis of this rank's slice x [..., size] -> global ids [...] long, ties to
    the lowest id: each rank's max and first argmax, then the first rank holding the global max."""
    idx = row_argmax(policy, x)  # [...]
    val = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    vals = vocab.comm.all_gather(val.float())
    ids = vocab.comm.all_gather(idx + vocab.start)
    return first_best(vals, ids)[1]


def log_normalizer(vocab: VocabShard, x: torch.Tensor) -> torch.Tensor:
    """log sum exp over the whole vocabulary of x [..., size] float32 -> [..., 1]: per-rank max and sum of
    exponentials, combined in rank order."""
    m = x.max(dim=-1, keepdim=True).values  # [..., 1]
    s = torch.exp(x - m).sum(dim=-1, keepdim=True)
    ms, ss = vocab.comm.all_gather(m), vocab.comm.all_gather(s)  # [N, ..., 1]
    top = ms.max(dim=0).values
    return top + torch.log(ordered_sum_torch(ss * torch.exp(ms - top)))


def merge_top(vocab: VocabShard, vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top-k of per-rank candidates vals / ids [..., k'] (global ids): (values, ids) [..., min(k, N k')]
    descending, ties to the lowest id; the same on every rank."""
    av = vocab.comm.all_gather(vals)  # [N, ..., k']
    ai = vocab.comm.all_gather(ids)
    av = torch.movedim(av, 0, -2).flatten(-2)  # [..., N k']
    ai = torch.movedim(ai, 0, -2).flatten(-2)
    order = torch.argsort(ai, dim=-1, stable=True)  # by id, then a stable sort by value keeps ties by id
    av, ai = av.gather(-1, order), ai.gather(-1, order)
    order = torch.argsort(av, dim=-1, descending=True, stable=True)[..., :k]
    return av.gather(-1, order), ai.gather(-1, order)


def vocab_topk_logprobs(vocab: VocabShard, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's per-position top-k log-probs over the whole vocabulary from this rank's slice logits
    [L, size] -> (lp [L, k'] float32 descending, global ids [L, k'] long), k' = min(k, total)."""
    x = logits.float()
    top, ids = merge_top(vocab, *local_top(vocab, x, k), k)
    return top - log_normalizer(vocab, x), ids


def rule_probs_shard(vocab: VocabShard, logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int,
                     top_p: float | torch.Tensor | None) -> torch.Tensor:
    """sampling.rule_probs over the whole vocabulary, this rank's slice [R, size] of it: the k-th largest value
    and the nucleus cut from the ranks' candidates, the softmax normaliser from their max and sum."""
    x = logits.float() / temperature  # [R, size]
    if 0 < top_k < vocab.total:
        kth = merge_top(vocab, *local_top(vocab, x, top_k), top_k)[0][..., -1:]  # [R, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.exp(x - log_normalizer(vocab, x))
    if top_p is None:
        return probs
    # the nucleus is a prefix of the global order (probability descending, id ascending): find its last entry
    cand = probs.shape[-1] if not 0 < top_k < vocab.total else min(top_k, vocab.size)
    sp, si = merge_top(vocab, *local_top(vocab, probs, cand), vocab.total)  # [R, M] global order
    before = torch.cumsum(sp, dim=-1) - sp
    last = (before < top_p).sum(dim=-1, keepdim=True) - 1  # [R, 1] index of the last kept entry
    p_last, i_last = sp.gather(-1, last), si.gather(-1, last)
    gid = torch.arange(vocab.start, vocab.start + vocab.size, device=probs.device)
    keep = (probs > p_last) | ((probs == p_last) & (gid <= i_last))
    probs = probs.masked_fill(~keep, 0.0)
    return probs / rank_order_sum(vocab.comm, probs.sum(dim=-1, keepdim=True))


def local_top(vocab: VocabShard, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k best of x [R, size] (at most its size) with global ids, ties to the lowest id (a stable sort:
    torch.topk may return any of equal values, and the merge needs each rank's lowest)."""
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    k = min(k, vocab.size)
    return vals[..., :k], idx[..., :k] + vocab.start


def vocab_race(vocab: VocabShard, probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """sampling.race over the whole vocabulary: probs [R, size] this rank's slice, noise [R, total] the
    exponential noise of the WHOLE vocabulary (the same on every rank: drawn from the request's generator) ->
    global ids [R]. With the same noise the winner is the one-device race's (up to the normaliser's rounding)."""
    mine = noise[..., vocab.start:vocab.start + vocab.size]
    q = probs / mine.clamp_min(1e-30)
    idx = torch.argmax(q, dim=-1)
    val = q.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
    return first_best(vocab.comm.all_gather(val), vocab.comm.all_gather(idx + vocab.start))[1]
