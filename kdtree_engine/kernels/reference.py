"""Torch reference paths of the kernels: what the dispatch runs where a Triton kernel does not (the CPU, training,
a forced torch backend), and the oracles the kernel tests compare against. (The numpy reference of the whole
model is kdtree_engine/reference.py.)"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..fp8 import Fp8Block, dequantize_fp8


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in torch (HF convention: normalize in float32, round to x.dtype, times the weight)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0,x1),(x2,x3),... of the last dim.

    x: [T, ..., R]; cos/sin: [T, R/2]. The output is written de-interleaved ([rotated evens,
    rotated odds]); q and k get the same treatment, so their dot products are those of the
    interleaved rotation.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = cos.view(shape)
    s = sin.view(shape)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a | b] -> [-b | a] over the last dim (Qwen3's rotate-half rope)."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d]."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * c + rotate_half(x) * s


def mla_attention_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: int,
                            tree_mask: torch.Tensor | None, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed attention in torch. q_lat [T, N, C], q_pe [T, N, R], kv [start+T, C+R] -> [T, N, C].

    Query i sees every committed slot [0, start) and new slot start+j where tree_mask[i, j]
    (causal when tree_mask is None). Softmax in float32.
    """
    T = q_lat.shape[0]
    C = kv_lora_rank
    c_kv, k_pe = kv[:, :C].float(), kv[:, C:].float()  # [S, C], [S, R]
    scores = (torch.einsum("tnc,sc->nts", q_lat.float(), c_kv)
              + torch.einsum("tnr,sr->nts", q_pe.float(), k_pe)) * scale  # [N, T, S]
    if tree_mask is None:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=kv.device).tril()
    visible = torch.cat([torch.ones(T, start, dtype=torch.bool, device=kv.device), tree_mask.to(kv.device)], dim=1)
    scores = scores.masked_fill(~visible, float("-inf"))
    p = scores.softmax(-1)
    return torch.einsum("nts,sc->tnc", p, c_kv).to(q_lat.dtype)


def mla_attention_masked(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor,
                         scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed attention over a whole cache buffer with a device-side visibility mask.

    q_lat [T, N, C], q_pe [T, N, R], kv [S_cap, C+R], visible [T, S_cap] bool (every row has at least
    one visible slot) -> [T, N, C]. The same math as :func:`mla_attention_reference`; slots that are not
    visible get probability exactly 0.
    """
    C = kv_lora_rank
    c_kv, k_pe = kv[:, :C].float(), kv[:, C:].float()  # [S, C], [S, R]
    scores = (torch.einsum("tnc,sc->nts", q_lat.float(), c_kv)
              + torch.einsum("tnr,sr->nts", q_pe.float(), k_pe)) * scale  # [N, T, S]
    scores = scores.masked_fill(~visible.unsqueeze(0), float("-inf"))
    p = scores.softmax(-1)
    return torch.einsum("nts,sc->tnc", p, c_kv).to(q_lat.dtype)


def route_torch(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Router tail in torch (the CPU path and the oracle of kernels/router.py): logits [T, E] float32, or split-K
    partials [S, T, E] added in split order first -> (ids int64 [T, k], weights float32 [T, k]). Stable
    descending sorts, so among equal scores the lower index wins (groups and experts), as in the numpy
    reference; torch.topk does not promise an order among ties."""
    if logits.dim() == 3:
        parts, logits = logits, logits[0]
        for p in parts[1:]:
            logits = logits + p
    scores = logits.sigmoid()  # [T, E]
    choice = scores + bias  # bias only chooses experts
    if cfg.n_group > 1:
        T = logits.shape[0]
        grouped = choice.view(T, cfg.n_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]; values only: ties do not matter
        keep = stable_top(group_scores, cfg.topk_group)  # [T, topk_group]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, -1)
    ids = stable_top(choice, cfg.num_experts_per_tok)  # [T, k]
    w = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


def stable_top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, best first, lower index first among equals."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def topk_logprobs_torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top-k log-probs (kernels/dispatch.py draft_topk) in torch: topk of the float32 logits minus
    their logsumexp. logits [L, V] -> (lp [L, k'] float32 descending, ids [L, k'] long), k' = min(k, V)."""
    x = logits.float()
    k = min(k, x.shape[-1])
    vals, ids = torch.topk(x, k, dim=-1)  # [L, k]
    lp = vals - torch.logsumexp(x, dim=-1, keepdim=True)
    return lp, ids


def w8a16_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                           block: Fp8Block) -> torch.Tensor:
    """FP8 block-quantized linear in torch (the CPU path and the oracle of kernels/w8a16.py): dequantize to
    float32 (fp8.py), x.float() @ w.T, rounded to x's dtype. x [M, K] -> [M, N]."""
    return (x.float() @ dequantize_fp8(weight, scale_inv, block).T).to(x.dtype)
