"""Kernel choice for W4A16 weights: one place, chosen by device, logged once.

CUDA tensors use the Triton kernels; CPU tensors use their torch references (dequantize, then
matmul in float32). ``KDTREE_INT4_BACKEND=torch|triton`` forces one (tests use ``triton`` with
``TRITON_INTERPRET=1`` on the CPU).
"""

from __future__ import annotations

import os

import torch

from ..model.layers import log_once
from ..quant import dequantize

_FORCED = os.environ.get("KDTREE_INT4_BACKEND")
if _FORCED not in (None, "", "torch", "triton"):
    raise ValueError(f"KDTREE_INT4_BACKEND must be 'torch' or 'triton', got {_FORCED!r}")


def int4_backend(device: torch.device) -> str:
    backend = _FORCED or ("triton" if device.type == "cuda" else "torch")
    log_once(f"int4:{device.type}:{backend}", f"W4A16 kernels on {device.type}: {backend}")
    return backend


def w4a16_matmul_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/8], scale [N, K/g]).T -> [M, N], float32 accumulate."""
    w = dequantize(packed, scale, group_size, torch.float32)  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    if int4_backend(x.device) == "triton":
        from .w4a16 import w4a16_linear
        return w4a16_linear(x, packed, scale, group_size)
    return w4a16_matmul_reference(x, packed, scale, group_size)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: int,
                  tree_mask: torch.Tensor | None, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache + the new block; see mla_attention_reference."""
    from ..model.mla import mla_attention_reference
    log_once(f"mla:{kv.device.type}", f"MLA attention on {kv.device.type}: torch")
    return mla_attention_reference(q_lat, q_pe, kv, start, tree_mask, scale, kv_lora_rank)
