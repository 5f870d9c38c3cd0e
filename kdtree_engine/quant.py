"""W4A16 format: symmetric group-wise INT4 in the compressed-tensors ``pack-quantized`` layout.

Layout (as the K2-Thinking / K2.5 / K2.6 checkpoints ship it), for a linear of shape [N, K]:
  weight_packed  int32 [N, K/8]   8 values per int32 along K, element j in bits [4j, 4j+3]
                                  (same bytes as uint8 [N, K/2], even k in the low nibble)
  weight_scale   bf16  [N, K/g]   one scale per g consecutive inputs of a row
  stored nibble u = q + 8, q in [-8, 7];  w[n, k] = (u - 8) * scale[n, k // g]
"""

from __future__ import annotations

import torch

PACK = 8  # int4 values per int32


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int8 [..., K] with values q in [-8, 7]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed INT4 weights must be int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)  # [8]
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., K/8, 8]
    return (nibbles - 8).to(torch.int8).flatten(-2)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group_size: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """packed int32 [..., N, K/8], scale [..., N, K/g] -> dense [..., N, K] (dtype defaults to scale's)."""
    q = unpack_int4(packed)  # [..., N, K]
    k = q.shape[-1]
    if scale.shape[-1] * group_size != k:
        raise ValueError(f"scale has {scale.shape[-1]} groups of {group_size} but the weight has K={k}")
    w = q.float() * scale.float().repeat_interleave(group_size, dim=-1)
    return w.to(dtype or scale.dtype)
