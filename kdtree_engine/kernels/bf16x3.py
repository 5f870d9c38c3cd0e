"""The float32 router gate as three bfloat16 parts: the operand of the tensor-core router kernel
(router_gemm.router_logits_bf16x3), built in plain torch once per gate by its owner (model/moe.py Router)."""

from __future__ import annotations

import torch


def split_bf16x3(w: torch.Tensor) -> torch.Tensor:
    """float32 w [N, K] -> bf16 [3, N, K] = (lo, mid, hi): hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid),
    each difference exact in float32, so hi + mid + lo == w wherever lo stays a normal number, i.e. for |w| >= 2^-100
    (24 significant bits, 8 per part; tests/kernels/test_router_bf16x3.py); below that lo loses its last bits."""
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"split_bf16x3: a float32 [N, K] weight, got {tuple(w.shape)} {w.dtype}")
    hi = w.to(torch.bfloat16)
    r = w - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return torch.stack([lo, mid, hi])


__all__ = ["split_bf16x3"]
