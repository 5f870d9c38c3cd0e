"""Router logits in float32: x [M, K] (bf16 / fp16 / fp32, upcast exactly) @ gate [N, K].T -> [M, N].

    logits[m, n] = sum over splits s (in order) of  sum over the split's k blocks (in order) of
                   tl.sum_k(x[m, k] * w[n, k])  over one [BK] block

The K2 router is a small float32 matrix ([384 x 7168], 11 MB) read at every layer and step: through the
generic batch-invariant GEMM (gemm.py: 16-row FMA-dot tiles, a separate x.float() copy) it took 24-27 us
at M = 1, about a tenth of a decode layer. Here each program holds a [BN x BK] block of the weight and
reduces it against TM token rows with a broadcast product and a sum over k (FMA work is negligible at
these M); the upcast happens in the load.

Batch invariance: BN, BK, TM and the warps are constants and the K split depends on (N, K) only, so
every row is reduced by the same code over the same shapes whatever M is; rows never mix (masked rows
load zeros and are not stored). Splits are summed in order by split_sum. The bits differ from the
generic GEMM's (another summation order), so on CUDA the router always takes this kernel (dispatch.
router_matmul); the torch path stays the CPU path and the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kdtree_engine.kernels.split_sum import split_sum

BN = 16            # weight rows per program
BK = 128           # k per block (one tl.sum)
TM = 4             # token rows per program (re-tiles only)
NUM_WARPS = 4
TARGET_PROGRAMS = 288   # K splits: about this many programs at M <= TM (2+ per SM on an H200)


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, kb_per_split, stride_xm, stride_wn, stride_os,
                        stride_om, BN: tl.constexpr, BK: tl.constexpr, TM: tl.constexpr):
    """grid (cdiv(M, TM), cdiv(N, BN), splits): out[s, m, n] = the split's partial logit."""
    rm = tl.program_id(0) * TM + tl.arange(0, TM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    pid_s = tl.program_id(2)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    x_row = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_row = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([TM, BN], dtype=tl.float32)
    k0 = pid_s * kb_per_split * BK
    for i in range(kb_per_split):
        k = k0 + i * BK + rk
        k_ok = k < K
        w = tl.load(w_row + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_row + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    o = out_ptr + pid_s.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o, acc, mask=m_ok[:, None] & n_ok[None, :])


def router_split(N: int, K: int) -> tuple[int, int]:
    """(k blocks per split, splits) for a [N, K] gate: a function of the shape alone (part of the reduction)."""
    kblocks = triton.cdiv(K, BK)
    splits = max(1, min(kblocks, TARGET_PROGRAMS // triton.cdiv(N, BN)))
    per = triton.cdiv(kblocks, splits)
    return per, triton.cdiv(kblocks, per)


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (float dtype) @ w [N, K] (float32).T -> [M, N] float32, batch-invariant (module docstring)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"router_logits: x [M, K] and w [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if w.dtype != torch.float32 or not x.dtype.is_floating_point:
        raise TypeError(f"router_logits: float32 gate weight and float activations, got w {w.dtype}, x {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"router_logits: x on {x.device}, w on {w.device}")
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=torch.float32)
    if M == 0 or N == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    per, splits = router_split(N, K)
    part = out if splits == 1 else torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    _router_gemm_kernel[(triton.cdiv(M, TM), triton.cdiv(N, BN), splits)](
        x, w, part, M, N, K, per, x.stride(0), w.stride(0), M * N, N, BN=BN, BK=BK, TM=TM, num_warps=NUM_WARPS)
    if splits > 1:
        split_sum(part, out, splits)
    return out


__all__ = ["router_logits", "router_split"]
