"""Router logits in float32: x [M, K] @ gate [N, K].T (float32), two batch-invariant kernels.

bf16 activations (the engine's CUDA path, router_logits_bf16x3): the gate split exactly into three bf16 parts
(split_bf16x3, kernels/bf16x3.py), one tensor-core GEMM launch against the three, its (part, split) partials added by
the router tail.
Other activations (router_logits below): the FMA kernel,

    logits[m, n] = sum over splits s (in order) of  tree_sum_k( x[m, k] * w[n, k] )  over the split's KS keys

The K2 router is a small float32 matrix read at every layer and step; the generic batch-invariant GEMM
(gemm.py, plus a separate x.float() copy) was far from its bytes' time (docs/performance_history.md).

Layout (weights in registers, tokens looped):

    program (n block, k split, token tile):  w [BN, KS] fp32 loaded once, in one go (every load in flight
                                              at once; before the dependent-launch wait: weights are static)
        for each token m of the tile:          x[m, split] [KS] -> s = sum_k(w * x[None, :]) [BN] -> part[s, m]
                                              (token m + 1's activations already in flight)
    one warp per program (the table's K2 shape): the k sum stays inside the warp (shuffles, no barrier)
    splits > 1: part [splits, M, N] summed in split order (split_sum)

Batch invariance: BN, KS and the warps (which fix the per-row summation tree) come from (N, K) alone
(``router_config``); every token runs the same loop body on the same weight registers, so a row's logits
do not depend on M or on the other rows of its tile (TM, the tokens per program, only re-tiles). The bits
differ from the generic GEMM's (another summation order); the torch matmul stays the CPU path and the
oracle. Checked by tests/kernels/test_router_gemm.py (interpreter) and tests/gpu/test_router_gemm_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import DTYPES
from .gemm import Reduction, bi_shared_x_partials
from .pdl import pdl_launch, pdl_supported, pdl_wait
from .split_sum import split_sum


@dataclass(frozen=True)
class RouterGemmConfig:
    """BN weight rows x KS k per program and the warps set a row's rounding (fixed by (N, K)); TM (tokens
    per program) only re-tiles."""
    BN: int = 4
    KS: int = 512
    num_warps: int = 1
    TM: int = 16

    def __post_init__(self) -> None:
        for name in ("BN", "KS", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"RouterGemmConfig.{name} must be a power of 2, got {v}")
        if self.TM < 1:
            raise ValueError(f"RouterGemmConfig.TM must be >= 1, got {self.TM}")


# (N, K) -> config, from bench/router.py on an H200 (docs/performance_history.md): one warp of 4 rows x 512 k keeps
# the k sum in the warp (shuffles, no barrier per token), where warps that split k need two barriers a token.
ROUTER_CONFIGS: dict[tuple[int, int], RouterGemmConfig] = {
    (384, 7168): RouterGemmConfig(BN=4, KS=512, num_warps=1, TM=16),
}


def router_config(N: int, K: int) -> RouterGemmConfig:
    """The config of an [N, K] gate: the K2 table entry, else one warp on 4 rows x min(512, K rounded up to
    a power of 2) k per program, 16 tokens per program; 4 for gates of at most 64 experts, whose few weight
    programs would otherwise walk a verify block's tokens in one or two long chains."""
    if (N, K) in ROUTER_CONFIGS:
        return ROUTER_CONFIGS[(N, K)]
    return RouterGemmConfig(BN=4, KS=min(512, triton.next_power_of_2(max(K, 32))), num_warps=1,
                            TM=4 if N <= 64 else 16)


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, TM, stride_xm, stride_wn, stride_os, stride_om,
                        BN: tl.constexpr, KS: tl.constexpr, PDL: tl.constexpr = False):
    """grid (cdiv(N, BN), splits, cdiv(M, TM)): out[s, m, n] = the split's partial logit of row m."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m0 = tl.program_id(2) * TM
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_s * KS + tl.arange(0, KS)
    k_ok = rk < K
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :],
                mask=(rn < N)[:, None] & k_ok[None, :], other=0.0)           # [BN, KS] fp32
    if PDL:
        pdl_wait()
    m_end = tl.minimum(m0 + TM, M)
    x_ptrs = x_ptr + m0.to(tl.int64) * stride_xm + rk
    o_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + m0.to(tl.int64) * stride_om + rn
    x = tl.load(x_ptrs, mask=k_ok, other=0.0)                                 # [KS], token m0
    left = m_end - m0
    for _ in range(m0, m_end):
        x_ptrs += stride_xm
        left -= 1
        x_next = tl.load(x_ptrs, mask=k_ok & (tl.zeros_like(rk) < left), other=0.0)   # the next token, in flight
        tl.store(o_ptrs, tl.sum(w * x.to(tl.float32)[None, :], axis=1), mask=rn < N)   # [BN]
        o_ptrs += stride_om
        x = x_next


# The bf16x3 router (router_logits_bf16x3): the float32 gate as three bf16 parts, one launch of the batch-invariant
# tensor-core GEMM (kernels/gemm.py's kernel, a part per head) of bf16 activations against the three, K in
# BF16X3_SPLITS splits of BF16X3_BLOCK_K-k MMA steps, every (part, split) partial handed to the router tail, which
# adds them part-major (lo's splits, then mid's, then hi's: the small terms first). Fixed by (N, K) alone (K2
# [384 x 7168]: 3 parts x 6 row tiles x 8 splits = 144 programs at any M); the tile (by M) only re-tiles.
BF16X3_BLOCK_K = 128
BF16X3_SPLITS = 8


def router_logits_bf16x3(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16, parts [3, N, K] bfloat16 (bf16x3.split_bf16x3 of the float32 gate) -> partials [3 * S, M, N]
    float32, S = the splits that hold k: partial p * S + s = x @ parts[p].T over split s's k (fp32 accumulation in
    BF16X3_BLOCK_K steps). Their sum in index order (route's split partials) is the logits. The bf16 products of x
    and each part are exact, so the error is the float32 accumulation's alone (about a float32 GEMM's).
    Batch-invariant: a row's partials do not depend on M."""
    if x.dim() != 2 or parts.dim() != 3 or parts.shape[0] != 3 or x.shape[1] != parts.shape[2]:
        raise ValueError(f"router_logits_bf16x3: x [M, K] and parts [3, N, K] with the same K, got "
                         f"{tuple(x.shape)} and {tuple(parts.shape)}")
    if x.dtype != torch.bfloat16 or parts.dtype != torch.bfloat16:
        raise TypeError(f"router_logits_bf16x3: bfloat16 activations and parts, got x {x.dtype}, parts {parts.dtype}")
    return bi_shared_x_partials(x, parts, Reduction(BLOCK_K=BF16X3_BLOCK_K, split_k=BF16X3_SPLITS))


def router_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T in float32 (torch): the CPU path and the test oracle."""
    return x.float() @ w.float().T


def router_logits(x: torch.Tensor, w: torch.Tensor, *, config: RouterGemmConfig | None = None,
                  partials: bool = False) -> torch.Tensor:
    """x [M, K] (float dtype) @ w [N, K] (float32).T -> [M, N] float32, batch-invariant (module docstring).
    ``config`` overrides the (N, K) table (benchmarks: BN / KS / warps change the rounding). partials: the split-K
    partials [S, M, N] instead (S >= 1; their sum in split order is the logits: the router tail adds them,
    kernels/router.py, saving the split_sum launch)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"router_logits: x [M, K] and w [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if w.dtype != torch.float32 or x.dtype not in DTYPES:
        raise TypeError(f"router_logits: a float32 gate weight and bf16 / fp16 / fp32 activations, got w {w.dtype}, "
                        f"x {x.dtype}")
    if x.device != w.device:
        raise ValueError(f"router_logits: x on {x.device}, w on {w.device}")
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=torch.float32)
    if M == 0 or N == 0 or K == 0:
        out = out.zero_()
        return out[None] if partials else out
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    cfg = config or router_config(N, K)
    splits = triton.cdiv(K, cfg.KS)
    pdl = pdl_supported(x.device)
    part = out if splits == 1 else torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    _router_gemm_kernel[(triton.cdiv(N, cfg.BN), splits, triton.cdiv(M, cfg.TM))](
        x, w, part, M, N, K, cfg.TM, x.stride(0), w.stride(0), M * N, N, BN=cfg.BN, KS=cfg.KS,
        num_warps=cfg.num_warps, **pdl_launch(pdl))
    if splits == 1:
        return out[None] if partials else out
    if partials:
        return part
    split_sum(part, out, splits, pdl=pdl)
    return out


__all__ = ["BF16X3_BLOCK_K", "BF16X3_SPLITS", "ROUTER_CONFIGS", "RouterGemmConfig", "router_config", "router_logits",
           "router_logits_bf16x3", "router_logits_reference"]
