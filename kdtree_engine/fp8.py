"""FP8 block format: ``float8_e4m3fn`` weights with one float32 scale per [bn, bk] block.

Layout (as DeepSeek-V3 / R1 and Kimi-K2-Instruct ship it, ``quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}``), for a linear of shape [N, K]:
  weight            float8_e4m3fn [N, K]
  weight_scale_inv  float32       [ceil(N / bn), ceil(K / bk)]
  w[n, k] = float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]
The last row / column block may be partial (576-row kv_a_proj_with_mqa at bn = 128). Linears without a
scale (lm_head, the router, those the release lists as ignored) stay in their float dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


@dataclass(frozen=True)
class Fp8Block:
    """The block of one scale: ``n`` output rows by ``k`` inputs."""

    n: int
    k: int

    def __post_init__(self) -> None:
        for name, v in (("n", self.n), ("k", self.k)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Fp8Block.{name} must be a positive integer, got {v!r}")

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        """The scale grid [ceil(N / bn), ceil(K / bk)] of an [N, K] weight."""
        return -(-n // self.n), -(-k // self.k)

    def __str__(self) -> str:
        return f"fp8 block {self.n}x{self.k}"


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Fp8Block,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] (float8_e4m3fn), scale_inv [..., ceil(N/bn), ceil(K/bk)] -> [..., N, K] in ``dtype``
    (the product is taken in float32, rounded once)."""
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"FP8 weights must be {FP8_DTYPE}, got {weight.dtype}")
    n, k = weight.shape[-2:]
    want = block.scale_shape(n, k)
    if tuple(scale_inv.shape[-2:]) != want or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise ValueError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected "
                         f"{list(weight.shape[:-2]) + list(want)} for a weight {list(weight.shape)} at {block}")
    s = scale_inv.float().repeat_interleave(block.n, dim=-2)[..., :n, :]
    s = s.repeat_interleave(block.k, dim=-1)[..., :k]  # [..., N, K]
    return (weight.float() * s).to(dtype)


def quantize_fp8(w: torch.Tensor, block: Fp8Block) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8: w [..., N, K] -> (float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn),
    ceil(K/bk)]); scale_inv = absmax(block) / 448 (1 for an all-zero block), weight = w / scale_inv rounded
    to the nearest e4m3 value. For tests and tools; the engine only reads FP8 checkpoints."""
    if not w.dtype.is_floating_point:
        raise TypeError(f"quantize_fp8 needs a floating-point weight, got {w.dtype}")
    n, k = w.shape[-2:]
    bn, bk = block.scale_shape(n, k)
    lead = w.shape[:-2]
    padded = torch.zeros(*lead, bn * block.n, bk * block.k, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = w.float()
    tiles = padded.unflatten(-1, (bk, block.k)).unflatten(-3, (bn, block.n))  # [..., bn, b.n, bk, b.k]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., bn, bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale.to(SCALE_DTYPE)


def dequantized_stream(tensors: Iterable[tuple[str, torch.Tensor]], block: Fp8Block,
                       dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (canonical name, tensor) stream with every FP8 ``<m>.weight`` and its
    ``<m>.weight_scale_inv`` replaced by one dense ``<m>.weight`` in ``dtype``, dequantized on ``device``
    (yielded once both have arrived; the two sit side by side in the released files, so little is held back).
    Other tensors pass through. A half without its partner at the end raises ValueError naming it."""
    pending: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        is_scale = name.endswith(".weight_scale_inv")
        if not is_scale and not (name.endswith(".weight") and t.dtype == FP8_DTYPE):
            yield name, t
            continue
        weight_name = name[: -len("_scale_inv")] if is_scale else name
        partner = weight_name if is_scale else name + "_scale_inv"
        other = pending.pop(partner, None)
        if other is None:
            pending[name] = t
            continue
        w, s = (other, t) if is_scale else (t, other)
        yield weight_name, dequantize_fp8(w.to(device), s.to(device), block, dtype)
    if pending:
        raise ValueError(f"FP8 tensor '{next(iter(pending))}' has no partner (weight / weight_scale_inv)")
