"""Batch-invariant dense GEMM: y = x @ W.T for a dense weight W [N, K] (bf16 / fp16 / fp32), and the
per-head form y[:, b] = x[:, b] @ W[b].T (``bi_head_linear``: the MLA absorption products) on the same
kernel with the head as a grid dimension.

Why: cuBLAS picks its kernel, tile and split-K from M, so the same token's logits differ by a few ulps
between a 1-token decode step and a 129-token tree verify, and greedy text drifts. Here every output
element y[m, n] is reduced over K in an order fixed by (N, K) alone:

- the K axis is cut into SPLIT contiguous chunks of ``k_per_split`` (a multiple of BLOCK_K); inside a
  chunk the accumulator is one fp32 chain over BLOCK_K steps (each step a tensor-core dot over its
  k16 slices, in k order), so the order depends on BLOCK_K and SPLIT only;
- SPLIT > 1 writes fp32 partials [SPLIT, M, N], summed in split order (deterministic): by the last program of
  each output tile to finish (an arrival counter per tile; it reads every partial, its own included, in split
  order), or, for launches of more tiles than the counters hold, by a second small kernel (split_sum): the
  same additions either way, so the same bits;
- BLOCK_K and SPLIT come from (N, K, dtype) only (``reduction_for``); M picks only the output tiling
  (BLOCK_M, BLOCK_N, warps, stages: ``tile_for``), which changes which program computes an element,
  not how it is summed. SWAP_AB is fixed (always on), so the weight rows are always the MMA's M side.

Batch invariance of the tensor-core path across tilings (wgmma with a different N size, a different
number of warpgroups) is a property of the hardware, checked bit for bit on the GPU by
tests/gpu/test_batch_invariance_gpu.py; fp32 inputs use input_precision="ieee" (FMA chain in k order).

Kernel layout (memory-bound at M <= 16, so the small-M path is about streaming the weight):
- SWAP_AB computes each tile as W_tile [BLOCK_N, BLOCK_K] @ x_tile.T [BLOCK_K, BLOCK_M]: the weight
  rows fill the 64-row side of a Hopper wgmma and the few tokens its N side (16..256);
- grid (m tiles fastest, n tiles, splits): programs that share a weight tile run side by side, so at
  large M the weight is read from HBM about once;
- weight loads use evict_first (streamed once); x is small and stays in L2.

CPU: ``bi_linear_reference`` (fp32 matmul) is the CPU path and the test oracle. Under TRITON_INTERPRET=1
the Triton kernel runs on CPU tensors. There tl.dot is numpy's matmul, whose summation order follows the
tile shape, so by default the interpreted kernel replaces the dot by a k-ordered fp32 sum (products
rounded to fp32, then summed in k order), which keeps the interpreted kernel batch-invariant too;
``bi_linear(interp_dot=True)`` (tests only) keeps tl.dot there, operands upcast to fp32 (triton 3.9's
interpreter computes bf16 tl.dot wrongly), so the GPU's code line also runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import pdl_launch, pdl_supported, pdl_wait
from .split_sum import arrival_counters, last_program_sums, split_sum
from .common import DTYPES, interpreting

_DTYPES = DTYPES


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class Reduction:
    """How one output element is summed over K. A function of (N, K, dtype) only: never of M."""
    BLOCK_K: int
    split_k: int

    def k_per_split(self, K: int) -> int:
        return triton.cdiv(triton.cdiv(K, self.BLOCK_K), self.split_k) * self.BLOCK_K

    def n_splits(self, K: int) -> int:
        """Splits that actually hold k (empty trailing splits dropped)."""
        return max(1, triton.cdiv(K, self.k_per_split(K)))


@dataclass(frozen=True)
class Tile:
    """How the output is tiled. May depend on M (does not change any element's reduction order)."""
    BLOCK_M: int = 16   # tokens per program (>= 16: tl.dot minimum)
    BLOCK_N: int = 64   # weight rows per program (the wgmma M side: 64 or 128)
    num_warps: int = 4
    num_stages: int = 4


# K-step per dtype: 16-bit inputs stream 128 k (256 B per weight row) per step; fp32 runs the FMA
# (ieee) dot, whose register tile grows with BLOCK_K, so it steps by 32.
_BLOCK_K = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 32}

# Programs wanted in flight before splitting K (the H200 has 132 SMs). A constant rather than the
# device's SM count, so the reduction order is the same on every device.
_TARGET_PROGRAMS = 264
_SPLIT_REF_BLOCK_N = 64
_MIN_STEPS_PER_SPLIT = 4
_MAX_SPLIT = 16

# Per-shape configs for the K2 dense linears (and two of Moonlight-16B's; 16-bit dtypes), measured on an H200 with
# `bench/gemm.py --sweep` (CUDA-graph timing): (N, K) -> (reduction, M-bucket tiles or None for the
# default buckets). The reduction trades small-M streaming (wants more programs: splits) against large-M
# compute (partials cost traffic and a second launch); the tiles only change speed, never bits.
_S = Tile(16, 64, 4, 6)     # M <= 16: weight streaming, deep pipeline
_M32 = Tile(32, 64, 4, 4)
_M64 = Tile(64, 64, 4, 4)
K2_CONFIGS: dict[tuple[int, int], tuple[Reduction, list[tuple[int, Tile]] | None]] = {
    # q_a_proj + kv_a_proj_with_mqa: 33 row tiles only, so split K in 2 to fill the GPU
    (2112, 7168): (Reduction(128, 2), [(16, _S), (32, _M32), (64, _M64), (1 << 62, Tile(128, 64, 4, 4))]),
    # q_b_proj
    (12288, 1536): (Reduction(64, 1), [(16, _S), (32, _M32), (64, _M64), (1 << 62, Tile(256, 128, 8, 3))]),
    # o_proj
    (7168, 8192): (Reduction(128, 1), [(16, _S), (32, _M32), (64, _M64), (1 << 62, Tile(128, 128, 8, 3))]),
    # o_proj at one rank of TP8 (8 heads): 112 row tiles of 8 K steps; whole-K programs beat two splits and their sum
    (7168, 1024): (Reduction(128, 1), [(16, _S), (32, _M32), (64, _M64), (1 << 62, Tile(128, 128, 8, 3))]),
    # shared expert gate+up
    (4096, 7168): (Reduction(128, 1), [(16, _S), (32, _M32), (64, _M64), (192, Tile(64, 128, 4, 4)),
                                       (1 << 62, Tile(128, 64, 4, 4))]),
    # shared expert down
    (7168, 2048): (Reduction(128, 1), [(16, _S), (32, _M32), (64, _M64), (1 << 62, Tile(128, 128, 8, 3))]),
    # lm_head
    (163840, 7168): (Reduction(64, 1), [(16, _S), (32, _M32), (64, Tile(64, 128, 4, 4)),
                                        (1 << 62, Tile(256, 128, 8, 3))]),
    # Moonlight-16B (hidden 2048): q_proj + kv_a_proj_with_mqa, whole-K programs beat the generic two splits
    (3648, 2048): (Reduction(128, 1), [(16, Tile(16, 64, 4, 8)), (32, _M32), (64, _M64),
                                       (1 << 62, Tile(128, 128, 8, 3))]),
    # Moonlight-16B shared experts' gate+up, likewise
    (5632, 2048): (Reduction(64, 1), [(16, Tile(16, 64, 4, 8)), (32, _M32), (64, _M64),
                                      (1 << 62, Tile(128, 128, 8, 3))]),
}

# Per-shape M-bucket tiles of float32 weights (the FMA dot: a tile never changes the bits): the K2 router
# [384 x 7168] on more, smaller programs than the default tiles (measured: docs/performance_history.md).
FP32_TILES: dict[tuple[int, int], list[tuple[int, Tile]]] = {
    (384, 7168): [(4, Tile(16, 16, 1, 8)), (16, Tile(16, 32, 2, 6)), (64, Tile(32, 32, 4, 4)),
                  (1 << 62, Tile(16, 64, 4, 4))],
}

# Per-head (the MLA absorption, bi_head_linear) M-bucket tiles by (N, K), the default buckets beyond the last
# (tiles never change the bits). q_nope x W_UK ([512 x 128] per head, a transposed view of kv_b_proj's rows) is
# one K step per program: the default 6-stage tile holds one program per SM, 2 stages several (faster; o_lat x
# W_UV keeps the default: python3 bench/gemm.py --sweep-heads, docs/performance_history.md).
HEAD_TILES: dict[tuple[int, int], list[tuple[int, Tile]]] = {
    (512, 128): [(16, Tile(16, 64, 4, 2))],
}

# M buckets: (max M, tile). The first bucket with M <= max M is used.
TILES_16BIT: list[tuple[int, Tile]] = [
    (16, Tile(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=6)),
    (32, Tile(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4)),
    (64, Tile(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)),
    (1 << 62, Tile(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)),
]
TILES_FP32: list[tuple[int, Tile]] = [
    (16, Tile(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2)),
    (1 << 62, Tile(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)),
]


def _generic_split(N: int, K: int, block_k: int) -> int:
    """Split-K from (N, K) only: enough programs for the GPU, at least 4 K-steps per split."""
    n_tiles = triton.cdiv(N, _SPLIT_REF_BLOCK_N)
    k_steps = triton.cdiv(K, block_k)
    split = 1
    while (n_tiles * split < _TARGET_PROGRAMS and split * 2 <= _MAX_SPLIT
           and k_steps // (split * 2) >= _MIN_STEPS_PER_SPLIT):
        split *= 2
    return split


def reduction_for(N: int, K: int, dtype: torch.dtype) -> Reduction:
    """The fixed reduction of an [N, K] weight: the only knobs that decide a row's rounding."""
    if dtype != torch.float32 and (N, K) in K2_CONFIGS:
        return K2_CONFIGS[(N, K)][0]
    bk = _BLOCK_K[dtype]
    return Reduction(BLOCK_K=bk, split_k=_generic_split(N, K, bk))


def tile_for(M: int, dtype: torch.dtype, N: int | None = None, K: int | None = None) -> Tile:
    """Output tiling for M rows (speed only: any tile gives the same bits)."""
    if dtype == torch.float32:
        table = FP32_TILES.get((N, K), TILES_FP32)
    else:
        table = K2_CONFIGS.get((N, K), (None, None))[1] or TILES_16BIT
    return _bucket(table, M) or table[-1][1]


def _bucket(table: list[tuple[int, Tile]], M: int) -> Tile | None:
    """The tile of the first (max M, tile) bucket with M <= max M (None past the last)."""
    for max_m, t in table:
        if M <= max_m:
            return t
    return None


# ----------------------------------------------------------------------------------------------
# kernels


# M (the row count) only bounds masks: not specializing on its value (1, a multiple of 16) keeps one compiled
# variant per tile for every prompt length (start-up warm-up, kdtree_engine/warmup.py); the bits do not change.
@triton.jit(do_not_specialize=["M"])
def _bi_gemm_kernel(x_ptr, w_ptr, out_ptr,
                    M, N, K, k_per_split, n_split,
                    stride_xb, stride_xm, stride_xk, stride_wb, stride_wn, stride_wk,
                    stride_ob, stride_om, stride_on, stride_os,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, INTERP_SUM: tl.constexpr, PREC: tl.constexpr,
                    OUT_F32: tl.constexpr, PDL: tl.constexpr = False, fin_ptr=None, cnt_ptr=None,
                    SERIAL: tl.constexpr = False):
    # grid: (m tiles [fastest, so programs sharing a weight tile run together], n tiles,
    #        batches x splits [split fastest]); the batch (head) only moves the three base pointers.
    # PDL: launched dependent on the previous kernel (pdl.py), waiting for it first
    if PDL:
        pdl_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2) // n_split
    pid_k = tl.program_id(2) % n_split
    x_ptr += pid_b.to(tl.int64) * stride_xb
    w_ptr += pid_b.to(tl.int64) * stride_wb
    out_ptr += pid_b.to(tl.int64) * stride_ob

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm      # [BM, 1]
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn      # [BN, 1]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)           # swapped: weight rows x tokens
    for k0 in range(k_start, k_end, BLOCK_K):
        if INTERP_SUM:
            # interpreter only: a k-ordered sum per element (numpy's matmul picks its summation order
            # from the tile shape, which would make the interpreted kernel depend on BLOCK_M); 16 k at
            # a time to stay under the interpreter's tensor size limit; slices wholly past the end are
            # skipped (they add exact zeros; the skip depends on K only)
            for s in tl.static_range(0, BLOCK_K, 16):
                if k0 + s < k_end:
                    kk = k0 + s + tl.arange(0, 16)
                    k_mask = kk < k_end
                    w = tl.load(w_rows + kk[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :],
                                other=0.0)
                    x = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :],
                                other=0.0)
                    prod = w.to(tl.float32)[:, :, None] * tl.trans(x.to(tl.float32))[None, :, :]  # [BN, 16, BM]
                    acc += tl.sum(prod, axis=1)
        else:
            kk = k0 + offs_k
            k_mask = kk < k_end
            w = tl.load(w_rows + kk[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")              # [BN, BK]
            x = tl.load(x_rows + kk[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)  # [BN, BM]

    acc = tl.trans(acc)                                             # [BM, BN]
    o_ptrs = (out_ptr + pid_k.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om
              + offs_n[None, :].to(tl.int64) * stride_on)
    o_mask = m_mask[:, None] & n_mask[None, :]
    if OUT_F32:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    if SERIAL:
        # the split partials of this output tile summed by the last of its n_split programs to arrive
        tile = (pid_b * tl.num_programs(0) + pid_m) * tl.num_programs(1) + pid_n
        f_ptrs = (fin_ptr + pid_b.to(tl.int64) * stride_ob + offs_m[:, None].to(tl.int64) * stride_om
                  + offs_n[None, :].to(tl.int64) * stride_on)
        last_program_sums(o_ptrs - pid_k.to(tl.int64) * stride_os, o_mask, stride_os, n_split, f_ptrs, cnt_ptr, tile)


# ----------------------------------------------------------------------------------------------
# Python entry points


def bi_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T with fp32 math, result in x.dtype (the CPU path and test oracle)."""
    return (x.float() @ w.float().T).to(x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"bi_linear wants x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"bi_linear: dtype {x.dtype} not supported (bf16, fp16, fp32)")
    if w.dtype != x.dtype:
        raise TypeError(f"bi_linear: x is {x.dtype} but w is {w.dtype}; they must match")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"bi_linear: x has K={x.shape[1]} but w has K={w.shape[1]}")
    if x.device != w.device:
        raise ValueError(f"bi_linear: x on {x.device}, w on {w.device}")


def bi_linear(x: torch.Tensor, w: torch.Tensor, *, tile: Tile | None = None,
              reduction: Reduction | None = None, interp_dot: bool = False) -> torch.Tensor:
    """Batch-invariant x [M, K] @ w [N, K].T -> [M, N] in x.dtype (Triton; fp32 accumulation).

    Row m of the result is bit-identical whatever M is (for a given device, N, K, dtype). ``tile``
    overrides the M-bucket tiling (benchmarks / sweeps; any tile keeps the invariance);
    ``reduction`` overrides the (N, K) reduction (sweeps only: it changes the rounding); ``interp_dot``
    (tests only) keeps tl.dot under the interpreter instead of the k-ordered sum (no effect on a GPU)."""
    _check(x, w)
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    t = tile or tile_for(M, x.dtype, N, K)
    red = reduction or reduction_for(N, K, x.dtype)
    return _launch(x, w, out, M, N, K, 1, (0, x.stride(0), x.stride(1)), (0, w.stride(0), w.stride(1)),
                   (0, N, 1), t, red, interp_dot)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, M: int, N: int, K: int, heads: int,
            x_strides: tuple[int, int, int], w_strides: tuple[int, int, int], out_strides: tuple[int, int, int],
            t: Tile, red: Reduction, interp_dot: bool = False) -> torch.Tensor:
    """One launch of _bi_gemm_kernel over (M tiles, N tiles, heads x splits); strides are (head, row, k)
    for x, (head, n, k) for w and (head, row, n) for out; splits summed in order by split_sum. interp_dot:
    tl.dot under the interpreter (bi_linear)."""
    interp = interpreting()
    kps = red.k_per_split(K)
    split = red.n_splits(K)
    if heads * split > 65535:
        raise ValueError(f"{heads} heads x {split} splits exceed the grid's third dimension")
    prec = "ieee" if (x.dtype == torch.float32 or interp) else "tf32"  # (tf32 is ignored for 16-bit)
    pdl = pdl_supported(x.device)
    target = out if split == 1 else torch.empty((split,) + tuple(out.shape), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, t.BLOCK_M), triton.cdiv(N, t.BLOCK_N), heads * split)
    counters = arrival_counters(x.device, grid[0] * grid[1] * heads) if split > 1 else None
    _bi_gemm_kernel[grid](
        x, w, target, M, N, K, kps, split, *x_strides, *w_strides, *out_strides, out.numel(),
        BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, BLOCK_K=red.BLOCK_K,
        UPCAST=interp, INTERP_SUM=interp and not interp_dot, PREC=prec, OUT_F32=split > 1,
        num_warps=t.num_warps, num_stages=t.num_stages, fin_ptr=out, cnt_ptr=counters, SERIAL=counters is not None,
        **pdl_launch(pdl))
    if split > 1 and counters is None:
        split_sum(target, out, split, pdl=pdl)
    return out


def bi_shared_x_partials(x: torch.Tensor, w: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """Split partials of one activation against B weights: x [M, K], w [B, N, K] (16-bit, the same dtype) -> float32
    [B * S, M, N], partial b * S + s = x @ w[b].T over split s's k (S = reduction.n_splits(K)), left unsummed for the
    caller to add in its own order. Batch-invariant like bi_linear: a row's partials do not depend on M."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"bi_shared_x_partials: x [M, K] and w [B, N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"bi_shared_x_partials: 16-bit activations and weights of one dtype, got x {x.dtype}, "
                        f"w {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"bi_shared_x_partials: x on {x.device}, w on {w.device}")
    M, K = x.shape
    B, N = w.shape[0], w.shape[1]
    S = reduction.n_splits(K) if K else 1
    out = torch.empty((B * S, M, N), device=x.device, dtype=torch.float32)
    if M == 0 or N == 0 or B == 0:
        return out
    if K == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w.contiguous()
    t = tile_for(M, x.dtype)
    interp = interpreting()
    # partial (b, s) at out[b * S + s]: head stride S * M * N, split stride M * N
    _bi_gemm_kernel[(triton.cdiv(M, t.BLOCK_M), triton.cdiv(N, t.BLOCK_N), B * S)](
        x, w, out, M, N, K, reduction.k_per_split(K), S, 0, x.stride(0), 1, N * K, K, 1, S * M * N, N, 1, M * N,
        BLOCK_M=t.BLOCK_M, BLOCK_N=t.BLOCK_N, BLOCK_K=reduction.BLOCK_K, UPCAST=interp,
        INTERP_SUM=interp, PREC="ieee" if interp else "tf32", OUT_F32=True,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_launch(pdl_supported(x.device)))
    return out


def head_tile_for(M: int, dtype: torch.dtype, N: int, K: int) -> Tile:
    """Output tiling of a per-head GEMM of M rows over [N, K] heads (HEAD_TILES, else tile_for's)."""
    own = _bucket(HEAD_TILES.get((N, K), []), M) if dtype != torch.float32 else None
    return own or tile_for(M, dtype)


def head_reduction_for(N: int, K: int, dtype: torch.dtype) -> Reduction:
    """The fixed reduction of a per-head GEMM ([B, N, K] weights): one split (the heads already give
    the GPU B times the programs, and K is small: 128 / 512 at K2 shapes)."""
    return Reduction(BLOCK_K=_BLOCK_K[dtype], split_k=1)


def bi_head_linear_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, B, K], w [B, N, K] -> [M, B, N] with fp32 math, result in x.dtype (test oracle)."""
    return torch.einsum("mbk,bnk->mbn", x.float(), w.float()).to(x.dtype)


def bi_head_linear(x: torch.Tensor, w: torch.Tensor, *, tile: Tile | None = None,
                   reduction: Reduction | None = None) -> torch.Tensor:
    """Batch-invariant per-head product: out[m, b] = x[m, b] @ w[b].T, x [M, B, K], w [B, N, K] -> [M, B, N].

    The MLA absorption (q_nope x W_UK, o_lat x W_UV) in one launch: the GEMM kernel above with the head
    as a grid dimension. Head b of the result is bit-identical to ``bi_linear(x[:, b], w[b],
    reduction=head_reduction_for(N, K, dtype))``, so row m does not depend on M either. Any strides (a
    transposed view of the weight is fine); output contiguous in x.dtype."""
    if x.dim() != 3 or w.dim() != 3:
        raise ValueError(f"bi_head_linear wants x [M, B, K] and w [B, N, K], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"bi_head_linear: x has B={x.shape[1]} heads but w has {w.shape[0]}")
    if x.shape[1]:
        _check(x[:, 0], w[0])  # dtype, K and device rules of bi_linear, per head
    M, B, K = x.shape
    N = w.shape[1]
    out = torch.empty((M, B, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0 or B == 0:
        return out
    if K == 0:
        return out.zero_()
    t = tile or head_tile_for(M, x.dtype, N, K)
    red = reduction or head_reduction_for(N, K, x.dtype)
    return _launch(x, w, out, M, N, K, B, (x.stride(1), x.stride(0), x.stride(2)),
                   (w.stride(0), w.stride(1), w.stride(2)), (N, B * N, 1), t, red)


__all__ = ["Reduction", "Tile", "K2_CONFIGS", "TILES_16BIT", "TILES_FP32", "reduction_for", "tile_for",
           "HEAD_TILES", "head_tile_for", "head_reduction_for", "bi_linear", "bi_linear_reference", "bi_head_linear",
           "bi_head_linear_reference", "bi_shared_x_partials"]
