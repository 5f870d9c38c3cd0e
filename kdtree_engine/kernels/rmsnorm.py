"""Batch-invariant RMSNorm: one program per row, fp32 math, HF convention.

    y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)        (as layers.RMSNorm)

The mean is a tl.sum over one [BLOCK_H] tile held by one program (BLOCK_H = next power of two >= H,
num_warps from H), so the order in which a row's squares are added depends on H only, never on how
many rows share the launch. The product with the weight is computed in fp32 and rounded once to the
output dtype, which is what torch does for a bf16 * bf16 (or mixed) elementwise product; the output
dtype is torch's promotion of (weight.dtype, x.dtype), as in layers.RMSNorm.

Is torch's own RMSNorm batch-invariant on CUDA? Measured on an H200 (torch 2.11, bf16, H = 7168,
1536, 512; rows alone vs inside M = 2..256): yes, bit for bit — for a reduction over the last,
contiguous dim torch's reduce kernel keeps one row within one block, and its launch shape does not
change at these sizes. That is torch's heuristic, not a promise (a row that is long relative to the
row count may be split across blocks), so this kernel is optional: the model may keep layers.RMSNorm.
tests/gpu/test_batch_invariance_gpu.py::test_torch_rmsnorm_invariance_report prints the answer for the
machine at hand, and bench/gemm.py records it. The kernel itself does not depend on that answer.

Residual add + RMSNorm (``bi_add_rmsnorm``): s = h + d rounded to the activation dtype (torch's
promotion of the two, computed in fp32 as torch's elementwise add does), written out, then the same
normalization of s as above, in one program per row. On CUDA the pair (s, norm(s)) is bit-identical to
a torch add followed by ``bi_rmsnorm``.

CPU: ``rmsnorm_reference`` is layers.RMSNorm's arithmetic (the oracle). Under TRITON_INTERPRET=1 the
kernel runs on CPU tensors (tests/kernels/test_rmsnorm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DTYPES
from .pdl import pdl_launch, pdl_supported, pdl_wait

_DTYPES = DTYPES
_MAX_H = 65536


@triton.jit
def _row_start(w_ptr, H, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """This program's row, its offsets and mask, and the norm weight [BLOCK_H]. PDL: a dependent launch
    (pdl.py): the weight (static) loads before the wait for the kernel writing the row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if PDL:
        pdl_wait()
    return row, offs, mask, w


@triton.jit
def _norm_store(x, w, H, eps, out_ptrs, mask, XT: tl.constexpr):
    """out = w * (x * rsqrt(mean(x^2) + eps)).to(XT), rounded once to out's dtype; x fp32 [BLOCK_H]."""
    ms = tl.sum(x * x, axis=0) / H
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))  # correctly rounded (IEEE) sqrt and division
    y = (x * r).to(XT)
    o = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, H, stride_xm, stride_om, eps,
                    BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    row, offs, mask, w = _row_start(w_ptr, H, BLOCK_H, PDL)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    _norm_store(x, w, H, eps, out_ptr + row * stride_om + offs, mask, x_ptr.dtype.element_ty)


@triton.jit
def _add_rmsnorm_kernel(h_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, H, stride_hm, stride_dm, stride_sm, stride_om, eps,
                        BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    row, offs, mask, w = _row_start(w_ptr, H, BLOCK_H, PDL)
    a = tl.load(h_ptr + row * stride_hm + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(d_ptr + row * stride_dm + offs, mask=mask, other=0.0).to(tl.float32)
    s = (a + b).to(sum_ptr.dtype.element_ty)  # the residual stream, as torch's h + d
    tl.store(sum_ptr + row * stride_sm + offs, s, mask=mask)
    _norm_store(s.to(tl.float32), w, H, eps, out_ptr + row * stride_om + offs, mask, sum_ptr.dtype.element_ty)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm.forward, as a function (the CPU path and test oracle)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def row_warps(block_h: int) -> int:
    return max(1, min(16, block_h // 512))


def _check(fn: str, rows: dict[str, torch.Tensor], weight: torch.Tensor) -> int:
    """dtypes, weight [H], H within one program, one device; returns H."""
    for name, t in {**rows, "weight": weight}.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} dtype {t.dtype} not supported (bf16, fp16, fp32)")
        if t.device != weight.device:
            raise ValueError(f"{fn}: {name} on {t.device}, weight on {weight.device}")
    H = next(iter(rows.values())).shape[-1]
    if weight.shape != (H,):
        raise ValueError(f"{fn}: weight shape {tuple(weight.shape)} does not match H={H}")
    if H > _MAX_H:
        raise ValueError(f"{fn}: H={H} > {_MAX_H} (one row per program)")
    return H


def _rows(x: torch.Tensor, H: int) -> torch.Tensor:
    x2 = x.reshape(-1, H)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def bi_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim. x [..., H], weight [H] -> [..., H] (Triton).

    Output dtype = torch.promote_types(weight.dtype, x.dtype), as `weight * x_normed.to(x.dtype)`."""
    H = _check("bi_rmsnorm", {"x": x}, weight)
    lead = x.shape[:-1]
    x2 = _rows(x, H)
    weight = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, H), device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    if M and H:
        BLOCK_H = triton.next_power_of_2(H)
        _rmsnorm_kernel[(M,)](x2, weight, out, H, x2.stride(0), out.stride(0), float(eps),
                              BLOCK_H=BLOCK_H, num_warps=row_warps(BLOCK_H), **pdl_launch(pdl_supported(x.device)))
    return out.reshape(*lead, H)


def bi_add_rmsnorm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, bi_rmsnorm(s)) with s = h + d, in one launch. h, d [..., H] (same shape), weight [H].

    s has dtype promote_types(h, d); the normed output promote_types(weight, s), as the separate ops."""
    if h.shape != d.shape:
        raise ValueError(f"bi_add_rmsnorm: h {tuple(h.shape)} and d {tuple(d.shape)} differ in shape")
    H = _check("bi_add_rmsnorm", {"h": h, "d": d}, weight)
    lead = h.shape[:-1]
    h2, d2 = _rows(h, H), _rows(d, H)
    weight = weight.contiguous()
    M = h2.shape[0]
    sdt = torch.promote_types(h.dtype, d.dtype)
    s = torch.empty((M, H), device=h.device, dtype=sdt)
    out = torch.empty((M, H), device=h.device, dtype=torch.promote_types(weight.dtype, sdt))
    if M and H:
        BLOCK_H = triton.next_power_of_2(H)
        _add_rmsnorm_kernel[(M,)](h2, d2, weight, s, out, H, h2.stride(0), d2.stride(0), s.stride(0), out.stride(0),
                                  float(eps), BLOCK_H=BLOCK_H, num_warps=row_warps(BLOCK_H),
                                  **pdl_launch(pdl_supported(h.device)))
    return s.reshape(*lead, H), out.reshape(*lead, H)


__all__ = ["bi_add_rmsnorm", "bi_rmsnorm", "rmsnorm_reference"]
