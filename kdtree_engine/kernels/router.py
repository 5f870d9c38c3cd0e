"""The noaux_tc router tail in one launch: router logits (or the router GEMM's split-K partials, summed in split
order first) -> (expert ids, routing weights).

One program per token row (so a row's result never depends on how many rows share the launch):

    score  = sigmoid(logit)                                   # [E] float32, 1 / (1 + exp(-logit))
    choice = score + e_score_correction_bias                  # the bias only chooses experts
    n_group > 1: a group scores the sum of its two best choices; the best topk_group groups stay
                 eligible, the other groups' choices become -inf
    ids    = the k best choices, best first
    w      = score[ids]; w / (sum(w) + 1e-20) if norm_topk_prob; w * routed_scaling_factor

Ties (groups and experts): the lower index first among equal values, which is what a stable descending
sort gives (model/moe.py :func:`route_torch`, the numpy reference's ``argsort(kind="stable")``). The k
picks are k rounds of (max, lowest index holding it); the weight sum adds the picks in slot order.

Arithmetic against the torch path: the bias add, the selection, the gather, the division and the
scaling are the same IEEE operations; the exp inside the sigmoid is Triton's (approximate on CUDA,
numpy's in the interpreter) and the k-term sum is sequential where torch's order is its own (the same
bits for k <= 2), so weights may differ from torch's in the last bits and ids only on near-ties within
those bits. Speculative and plain decoding both run this kernel on CUDA, so they agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_supported, pdl_wait

_MAX_E = 4096


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, stride_l, stride_s, G, EG, scale,
                   K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr = 1,
                   PDL: tl.constexpr = False, own_start=0, own_count=0, OWNED: tl.constexpr = False):
    if PDL:  # a dependent launch (pdl.py): wait for the kernel writing the logits
        pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, BLOCK_G)  # [BG]
    ji = tl.arange(0, BLOCK_EG)  # [BEG]
    valid = (gi[:, None] < G) & (ji[None, :] < EG)  # [BG, BEG]
    e = gi[:, None] * EG + ji[None, :]  # expert index (padding lanes alias real ones: mask with valid)
    big = BLOCK_G * BLOCK_EG  # larger than every expert index
    logit = tl.load(logits_ptr + row * stride_l + e, mask=valid, other=0.0)
    for sp in tl.static_range(1, SPLITS):   # split-K partials, added in split order (split_sum's sums)
        logit += tl.load(logits_ptr + sp * stride_s + row * stride_l + e, mask=valid, other=0.0)
    score = tl.div_rn(1.0, 1.0 + tl.exp(-logit))  # sigmoid, IEEE division
    choice = score + tl.load(bias_ptr + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        # group score: its best choice + its second best (the best removed by index, ties kept)
        m1 = tl.max(choice, axis=1)  # [BG]
        first = tl.min(tl.where(choice == m1[:, None], ji[None, :], BLOCK_EG), axis=1)  # [BG]
        m2 = tl.max(tl.where(ji[None, :] == first[:, None], float("-inf"), choice), axis=1)  # [BG]
        gscore = m1 + m2
        gvalid = gi < G
        keep = gi < 0  # all False, [BG]
        for _ in tl.static_range(TOPK_GROUP):
            cand = gvalid & ~keep
            m = tl.max(tl.where(cand, gscore, float("-inf")), axis=0)
            pick = tl.min(tl.where(cand & (gscore == m), gi, BLOCK_G), axis=0)
            keep = keep | (gi == pick)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    ko = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    taken = e < 0  # all False, [BG, BEG]
    total = 0.0
    for s in tl.static_range(K):
        cand = valid & ~taken
        m = tl.max(tl.max(tl.where(cand, choice, float("-inf")), axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(cand & (choice == m), e, big), axis=1), axis=0)
        hit = valid & (e == pick)
        taken = taken | hit
        ws = tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=1), axis=0)  # exactly score[pick]
        ids = tl.where(ko == s, pick.to(tl.int64), ids)
        w = tl.where(ko == s, ws, w)
        total = total + ws
    if NORM:
        w = tl.div_rn(w, total + 1e-20)
    w = w * scale
    if OWNED:   # expert parallel: the rank's own routes, as parallel/experts.py owned_routes makes them
        local = ids - own_start
        mine = (local >= 0) & (local < own_count)
        ids = tl.where(mine, local, -1)
        w = tl.where(mine, w, 0.0)
    kmask = ko < K
    tl.store(ids_ptr + row * K + ko, ids, mask=kmask)
    tl.store(w_ptr + row * K + ko, w, mask=kmask)


def route_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, owned: range | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32, or split-K partials [S, T, E] summed in split order first (the bits of
    split_sum), bias [E] float32 -> (ids int64 [T, k], weights float32 [T, k]). owned (expert parallel): the
    experts this rank holds; the routes come out as parallel/experts.py owned_routes makes them (local ids, -1
    with weight 0 for another rank's experts), in the same launch."""
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise TypeError(f"route_triton: logits {logits.dtype} and bias {bias.dtype} must be float32")
    if logits.dim() not in (2, 3) or (logits.dim() == 3 and logits.shape[0] < 1):
        raise ValueError(f"route_triton: logits must be [T, E] or [S >= 1, T, E], got {tuple(logits.shape)}")
    parts = logits if logits.dim() == 3 else logits[None]
    S, T, E = parts.shape
    if bias.shape != (E,):
        raise ValueError(f"route_triton: bias shape {tuple(bias.shape)} does not match E={E}")
    if E > _MAX_E or E % n_group or not 1 <= top_k <= E or not 1 <= topk_group <= n_group:
        raise ValueError(f"route_triton: E={E}, n_group={n_group}, topk_group={topk_group}, k={top_k} "
                         f"(need E <= {_MAX_E}, E % n_group == 0, 1 <= k <= E, 1 <= topk_group <= n_group)")
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"route_triton: groups of {E // n_group} expert(s); a group scores its top-2")
    if parts.stride(-1) != 1:
        parts = parts.contiguous()
    bias = bias.contiguous()
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    w = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    if T:
        EG = E // n_group
        _router_kernel[(T,)](parts, bias, ids, w, parts.stride(1), parts.stride(0), n_group, EG,
                             float(routed_scaling_factor), K=top_k, TOPK_GROUP=topk_group, GROUPED=n_group > 1,
                             NORM=bool(norm_topk_prob), BLOCK_G=triton.next_power_of_2(n_group),
                             BLOCK_EG=triton.next_power_of_2(EG), BLOCK_K=triton.next_power_of_2(top_k), SPLITS=S,
                             num_warps=1 if E <= 128 else 4, **pdl_launch(pdl_supported(logits.device)),
                             own_start=0 if owned is None else owned.start,
                             own_count=0 if owned is None else len(owned), OWNED=owned is not None)
    return ids, w


__all__ = ["route_triton"]
