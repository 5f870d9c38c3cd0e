"""SwiGLU activation in one launch: silu(gate) * up, elementwise (dense MLP and shared expert).

    a   = (g / (1 + exp(-g))).to(dtype)         g = gate in float32; torch's silu, rounded once
    out = (a * up).to(dtype)                     product in float32, rounded once, as torch's a * up

Each element is computed on its own (no reduction), so the result never depends on the row count.
The exp is Triton's (approximate on CUDA, numpy's in the interpreter) where torch uses its own, so a
rounded silu may differ from torch's in the last bit (tests/kernels/test_swiglu.py bounds it); the
division is IEEE. ``gate`` and ``up`` may be column slices of one [T, 2I] GEMM output (row strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DTYPES
from .pdl import pdl_launch, pdl_supported, pdl_wait

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    if PDL:  # a dependent launch (pdl.py): wait for the kernel writing gate / up
        pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.div_rn(g, 1.0 + tl.exp(-g)).to(out_ptr.dtype.element_ty)
    o = a.to(tl.float32) * u
    tl.store(out_ptr + row * stride_o + offs, o.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., N] (same shape and dtype; last dim contiguous) -> silu(gate) * up [..., N]."""
    if gate.dtype not in DTYPES or gate.dtype != up.dtype:
        raise TypeError(f"silu_mul: dtypes {gate.dtype}, {up.dtype} (need one of bf16, fp16, fp32 for both)")
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.device != up.device:
        raise ValueError(f"silu_mul: gate on {gate.device}, up on {up.device}")
    N = gate.shape[-1]
    lead = gate.shape[:-1]
    g2, u2 = (t.reshape(-1, N) if t.dim() != 2 else t for t in (gate, up))
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    M = g2.shape[0]
    out = torch.empty((M, N), device=gate.device, dtype=gate.dtype)
    if M and N:
        block = min(_BLOCK, triton.next_power_of_2(N))
        _silu_mul_kernel[(M, triton.cdiv(N, block))](g2, u2, out, N, g2.stride(0), u2.stride(0), out.stride(0),
                                                     BLOCK=block, num_warps=max(1, min(4, block // 256)),
                                                     **pdl_launch(pdl_supported(gate.device)))
    return out.reshape(*lead, N)


__all__ = ["silu_mul"]
