"""Per-head RMSNorm + rotate-half rope in one launch (the DFlash drafter's q / k tails, Qwen3 style):

    y   = rmsnorm(x[t, h]) * w                  x [T, H, d] (unit last stride), w [d]
    out = y * cos[t] + rotate_half(y) * sin[t]  rotate_half(y) = [-y[d/2:], y[:d/2]];  cos / sin [T, d]

instead of ~7 torch kernels (norm, neg, cat, two products, sum). The arithmetic is the torch path's,
rounding where torch rounds: the norm as kernels/rmsnorm.py (fp32 statistics, x * r rounded to x's dtype,
times the weight rounded again), then each product and the sum rounded to the dtype (compiled with
``enable_fp_fusion=False``: no FMA). One program per (t, h) row.

CPU: :func:`head_norm_rope_torch` is the drafter's own arithmetic (the CPU path and the oracle); under
TRITON_INTERPRET=1 the kernel runs on CPU tensors (tests/kernels/test_head_norm_rope.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DTYPES
from .reference import apply_rope_half, rms_norm_torch


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, H, D2, eps,
                           stride_xt, stride_xh, stride_ct, stride_ot, stride_oh, BLOCK_D2: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    t = pid // H
    h = pid % H
    i = tl.arange(0, BLOCK_D2)
    m = i < D2
    row = x_ptr + t * stride_xt + h * stride_xh
    ty = x_ptr.dtype.element_ty
    x1 = tl.load(row + i, mask=m, other=0.0).to(tl.float32)          # first half
    x2 = tl.load(row + D2 + i, mask=m, other=0.0).to(tl.float32)     # second half
    ms = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * D2)
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    w1 = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + D2 + i, mask=m, other=0.0).to(tl.float32)
    y1 = (w1 * (x1 * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    y2 = (w2 * (x2 * r).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    c = cos_ptr + t * stride_ct
    s = sin_ptr + t * stride_ct
    c1 = tl.load(c + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c + D2 + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s + D2 + i, mask=m, other=0.0).to(tl.float32)
    o1 = (y1 * c1).to(ty).to(tl.float32) + (-y2 * s1).to(ty).to(tl.float32)
    o2 = (y2 * c2).to(ty).to(tl.float32) + (y1 * s2).to(ty).to(tl.float32)
    dst = out_ptr + t * stride_ot + h * stride_oh
    tl.store(dst + i, o1.to(out_ptr.dtype.element_ty), mask=m)
    tl.store(dst + D2 + i, o2.to(out_ptr.dtype.element_ty), mask=m)


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Triton: x [T, H, d] (unit last stride), weight [d], cos / sin [T, d] -> [T, H, d] contiguous, x's dtype."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"head_norm_rope: x must be [T, H, d] with unit last stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"head_norm_rope: x and weight must share a dtype in bf16/fp16/fp32, got {x.dtype}, "
                        f"{weight.dtype}")
    T, H, d = x.shape
    if d % 2 or weight.shape != (d,):
        raise ValueError(f"head_norm_rope: head dim {d} must be even and weight [{d}], got {tuple(weight.shape)}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.shape != (T, d) or tab.stride(-1) != 1 or tab.dtype != x.dtype:
            raise ValueError(f"head_norm_rope: {name} must be [T, d] = [{T}, {d}] in {x.dtype} with unit last "
                             f"stride, got {tab.dtype} {tuple(tab.shape)} strides {tab.stride()}")
    if cos.stride() != sin.stride():
        raise ValueError(f"head_norm_rope: cos and sin strides differ ({cos.stride()} vs {sin.stride()})")
    out = torch.empty((T, H, d), device=x.device, dtype=x.dtype)
    if T and H:
        _head_norm_rope_kernel[(T * H,)](x, weight.contiguous(), cos, sin, out, H, d // 2, float(eps),
                                         x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                                         BLOCK_D2=triton.next_power_of_2(d // 2), num_warps=1,
                                         enable_fp_fusion=False)
    return out


def head_norm_rope_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor) -> torch.Tensor:
    return apply_rope_half(rms_norm_torch(x, weight, eps), cos, sin)


__all__ = ["head_norm_rope", "head_norm_rope_torch"]
