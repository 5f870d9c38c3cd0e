"""MLA's elementwise tails in one launch each (instead of ~10 torch kernels each):

  rope_heads     q_pe = rope(q[..., P:])                        q [T, N, P+R] (any strides) -> [T, N, R]
  latent_write   kv[slots[t]] = [rmsnorm(kva[t, :C]) | rope(kva[t, C:])]   (the new latent cache rows)

rope is :func:`kdtree_engine.model.layers.apply_rope`: interleaved pairs (x0, x1), (x2, x3), ... rotated
in float32 and written de-interleaved [x1*c - x2*s | x2*c + x1*s], rounded once to the output dtype. The
kernels are compiled with ``enable_fp_fusion=False``, so each product and sum is rounded as torch rounds
it (no FMA): the same bits as the torch path on CUDA. The norm is :mod:`.rmsnorm`'s kernel arithmetic (one
program per row, the same tile width and warps), so a row's result does not depend on the rows sharing
the launch.

CPU: the torch functions here (``*_torch``) are the model's own arithmetic (the CPU path and the oracle).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (tests/kernels/test_rope.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DTYPES
from .pdl import pdl_launch, pdl_supported, pdl_wait
from .rmsnorm import row_warps
from .reference import apply_rope, rms_norm_torch


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, R2, BLOCK_R2: tl.constexpr):
    """out[:R2] = x_even*c - x_odd*s, out[R2:2*R2] = x_odd*c + x_even*s (fp32, rounded once)."""
    i = tl.arange(0, BLOCK_R2)
    m = i < R2
    x1 = tl.load(x_ptr + 2 * i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + i, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + i, mask=m, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + i, (x1 * c - x2 * s).to(ty), mask=m)
    tl.store(out_ptr + R2 + i, (x2 * c + x1 * s).to(ty), mask=m)


@triton.jit
def _rope_heads_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, N, R2, stride_xt, stride_xn, stride_ct,
                       stride_ot, stride_on, BLOCK_R2: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # a dependent launch (pdl.py): wait for the kernel writing q
        pdl_wait()
    pid = tl.program_id(0).to(tl.int64)
    t = pid // N
    n = pid % N
    _rotate(x_ptr + t * stride_xt + n * stride_xn, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct,
            out_ptr + t * stride_ot + n * stride_on, R2, BLOCK_R2)


@triton.jit
def _latent_write_kernel(kva_ptr, w_ptr, cos_ptr, sin_ptr, kv_ptr, slots_ptr, C, R2, eps,
                         stride_at, stride_ct, stride_kv, BLOCK_C: tl.constexpr, BLOCK_R2: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # a dependent launch (pdl.py): wait for the kernel writing kva
        pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    row = kva_ptr + t * stride_at
    dst = kv_ptr + slot * stride_kv
    # rmsnorm of the first C values (as kernels/rmsnorm.py)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < C
    x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / C
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
    y = (x * r).to(kva_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(dst + offs, (w.to(tl.float32) * y.to(tl.float32)).to(kv_ptr.dtype.element_ty), mask=mask)
    # rope of the last 2*R2 values
    _rotate(row + C, cos_ptr + t * stride_ct, sin_ptr + t * stride_ct, dst + C, R2, BLOCK_R2)


def _check_tables(cos: torch.Tensor, sin: torch.Tensor, T: int, R: int, what: str) -> None:
    if R % 2:
        raise ValueError(f"{what}: rope width {R} is odd")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.shape != (T, R // 2) or tab.stride(-1) != 1:
            raise ValueError(f"{what}: {name} must be [T, R/2] = [{T}, {R // 2}] with unit last stride, got "
                             f"{tuple(tab.shape)} strides {tab.stride()}")
    if cos.stride() != sin.stride():
        raise ValueError(f"{what}: cos and sin strides differ ({cos.stride()} vs {sin.stride()})")


def rope_heads(q: torch.Tensor, nope: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton: q [T, N, nope + R] (unit last stride) -> rope(q[..., nope:]) [T, N, R], q's dtype."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"rope_heads: q must be [T, N, P+R] with unit last stride, got {tuple(q.shape)} "
                         f"strides {q.stride()}")
    if q.dtype not in DTYPES:
        raise TypeError(f"rope_heads: dtype {q.dtype} not supported (bf16, fp16, fp32)")
    T, N, W = q.shape
    R = W - nope
    _check_tables(cos, sin, T, R, "rope_heads")
    out = torch.empty((T, N, R), device=q.device, dtype=q.dtype)
    if T and N and R:
        _rope_heads_kernel[(T * N,)](q[..., nope:], cos, sin, out, N, R // 2, q.stride(0), q.stride(1),
                                     cos.stride(0), out.stride(0), out.stride(1),
                                     BLOCK_R2=triton.next_power_of_2(R // 2), num_warps=1,
                                     enable_fp_fusion=False, **pdl_launch(pdl_supported(q.device)))
    return out


def latent_write(kva: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Triton: kv[slots[t]] = [rmsnorm(kva[t, :C]) * w | rope(kva[t, C:])] for kva [T, C+R] (unit last
    stride), norm_weight [C], kv [S, C+R], slots [T] integer (distinct). kva, weight and kv share a dtype."""
    if kva.dim() != 2 or kv.dim() != 2 or kva.shape[1] != kv.shape[1]:
        raise ValueError(f"latent_write: kva [T, C+R] and kv [S, C+R] expected, got {tuple(kva.shape)}, "
                         f"{tuple(kv.shape)}")
    if not (kva.dtype == norm_weight.dtype == kv.dtype) or kva.dtype not in DTYPES:
        raise TypeError(f"latent_write: dtypes must agree and be bf16/fp16/fp32: kva {kva.dtype}, weight "
                        f"{norm_weight.dtype}, kv {kv.dtype}")
    if kva.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("latent_write: kva and kv need a unit last stride")
    T = kva.shape[0]
    C = norm_weight.shape[0]
    R = kva.shape[1] - C
    if norm_weight.dim() != 1 or R <= 0:
        raise ValueError(f"latent_write: weight [C] with C < {kva.shape[1]} expected, got {tuple(norm_weight.shape)}")
    _check_tables(cos, sin, T, R, "latent_write")
    if slots.shape != (T,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"latent_write: slots must be [T] = [{T}] integer, got {slots.dtype} {tuple(slots.shape)}")
    if T == 0:
        return
    block_c = triton.next_power_of_2(C)
    _latent_write_kernel[(T,)](kva, norm_weight.contiguous(), cos, sin, kv, slots.contiguous(), C, R // 2,
                               float(eps), kva.stride(0), cos.stride(0), kv.stride(0), BLOCK_C=block_c,
                               BLOCK_R2=triton.next_power_of_2(R // 2), num_warps=row_warps(block_c),
                               enable_fp_fusion=False, **pdl_launch(pdl_supported(kva.device)))


# ---- torch (CPU path, oracle) ------------------------------------------------------------------

def rope_heads_torch(q: torch.Tensor, nope: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return apply_rope(q[..., nope:], cos, sin)


def latent_write_torch(kva: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    C = norm_weight.shape[0]
    row = torch.cat([rms_norm_torch(kva[:, :C], norm_weight, eps), apply_rope(kva[:, C:], cos, sin)], dim=-1)
    kv.index_copy_(0, slots, row.to(kv.dtype))


__all__ = ["rope_heads", "latent_write", "rope_heads_torch", "latent_write_torch"]
