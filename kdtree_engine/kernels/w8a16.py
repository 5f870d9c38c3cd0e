"""W8A16 linear: y = x @ W.T with W in the FP8 block format (fp8.py), read as the checkpoint ships it.

  weight     float8_e4m3fn [N, K]
  scale_inv  float32 [ceil(N/bn), ceil(K/bk)]     w[n, k] = weight[n, k] * scale_inv[n // bn, k // bk]

Kernel: each program owns BLOCK_N weight rows and streams them along K in BLOCK_K tiles (BLOCK_K divides bk,
so a tile lies in one scale column). The FP8 tile is converted to the activation dtype in registers (exact:
every e4m3 value is a bf16 / fp16 value), multiplied by the tokens on the tensor cores with fp32 accumulation,
and the tile's partial dot is scaled per row by its block scale before it joins the accumulator (the scale
is constant over the tile, so this is the dequantized product up to fp32 rounding). Weight-only: the
activations stay bf16 / fp16 (no FP8 activation quantization, so no extra error beyond the weights').

Batch invariance: a row's result does not depend on M. BLOCK_K and the split along K are chosen from (N, K,
bk) alone; M selects nothing that changes how one output element is summed (one tile config for every M:
tokens are the MMA's N side, SWAP_AB, as in w4a16.py). Split partials are added in split order
(split_sum.py).

CPU: kernels/reference.py ``w8a16_linear_reference`` is the CPU path and the test oracle. Under
TRITON_INTERPRET=1 the dot operands are upcast to fp32 (the interpreter's bf16 dot is wrong, w4a16.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_DTYPE, Fp8Block
from .common import DTYPES, interpreting
from .split_sum import arrival_counters, last_program_sums, split_sum
from .w4a16 import fp32_stages, k_splits, mma_tile


@dataclass(frozen=True)
class W8Config:
    """One weight shape's kernel config. Every field is a function of the weight's shape, never of M, so a row's
    result does not depend on M (target_programs and BLOCK_N set the split along K)."""
    BLOCK_M: int = 16    # tokens per program (tl.dot minimum; the MMA's N side with SWAP_AB)
    BLOCK_N: int = 64    # weight rows per program
    BLOCK_K: int = 128   # at most; the largest power of two <= this dividing bk is used
    num_warps: int = 4
    num_stages: int = 4
    target_programs: int = 1056   # programs wanted in flight before K is split (a constant, not the SM count)


W8_CONFIG = W8Config()

# Per-shape configs (N, K) -> W8Config, measured on an H200 (bench/moe_formats.py --sweep); other shapes take
# W8_CONFIG.
_N32 = W8Config(BLOCK_N=32)
W8_CONFIGS: dict[tuple[int, int], W8Config] = {
    (1536, 7168): replace(_N32, target_programs=264),    # q_a_proj
    (12288, 1536): replace(_N32, target_programs=264),   # q_b_proj
    (576, 7168): replace(_N32, target_programs=4224),    # kv_a_proj_with_mqa
    (16384, 512): W8Config(target_programs=4224),        # kv_b_proj
    (7168, 8192): W8Config(target_programs=264),         # o_proj
    (18432, 7168): _N32,                                 # dense MLP gate / up
    (7168, 18432): _N32,                                 # dense MLP down
}

# At least this many K tiles per split, at most MAX_SPLIT splits.
MIN_TILES_PER_SPLIT = 4
MAX_SPLIT = 16


def w8_config_for(N: int, K: int) -> W8Config:
    """The kernel config of an [N, K] FP8 weight (a function of the shape only)."""
    return W8_CONFIGS.get((N, K), W8_CONFIG)


def tile_k(block: Fp8Block, want: int) -> int:
    """The K tile: the largest power of two <= want that divides bk (>= 16, the dot's minimum)."""
    t = 1 << (min(want, block.k).bit_length() - 1)
    while block.k % t:
        t //= 2
    if t < 16:
        raise ValueError(f"{block}: bk must have a power-of-two factor >= 16 for the W8A16 tiles")
    return t


def w8_split(N: int, K: int, block_k: int, block_n: int, target: int = W8_CONFIG.target_programs) -> int:
    """Split along K from (N, K) only: enough programs for the GPU, at least MIN_TILES_PER_SPLIT tiles each."""
    n_tiles = triton.cdiv(N, block_n)
    k_tiles = triton.cdiv(K, block_k)
    split = 1
    while (n_tiles * split < target and split * 2 <= MAX_SPLIT
           and k_tiles // (split * 2) >= MIN_TILES_PER_SPLIT):
        split *= 2
    return split


@triton.jit
def fp8_tile(w_rows, offs_k, n_mask, k0, k_hi, DTYPE: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] FP8 tile at k0 (columns past k_hi read as 0) in DTYPE (an exact conversion: every
    e4m3 value is a bf16 / fp16 value; through float32, measured no slower than one conversion step)."""
    kk = k0 + offs_k
    w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk[None, :] < k_hi), other=0.0,
                eviction_policy="evict_first")
    return w.to(tl.float32).to(DTYPE)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                  stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                  BN_Q: tl.constexpr, BK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr, OUT_F32: tl.constexpr,
                  fin_ptr=None, cnt_ptr=None, n_split=1, SERIAL: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // BN_Q) * stride_sn
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        wt = fp8_tile(w_rows, offs_k, n_mask, k0, k_hi, DTYPE)
        kk = k0 + offs_k
        xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < k_hi), other=0.0)
        part = mma_tile(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), wt, xt, True, UPCAST, PREC)
        s = tl.load(s_rows + k0 // BK_Q, mask=n_mask, other=0.0)
        acc += part * s[:, None]
    acc = tl.trans(acc)
    o_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if OUT_F32:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    if SERIAL:
        # the split partials of this output tile summed by the last of its programs to arrive
        tile = pid_m * tl.num_programs(1) + pid_n
        f_ptrs = fin_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        last_program_sums(o_ptrs - pid_k * stride_os, o_mask, stride_os, n_split, f_ptrs, cnt_ptr, tile)


def check_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Fp8Block, what: str = "weight") -> None:
    """weight float8_e4m3fn [..., N, K] and scale_inv float32 [..., ceil(N/bn), ceil(K/bk)], both contiguous
    along K."""
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"{what}: FP8 weights must be {FP8_DTYPE}, got {weight.dtype}")
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"{what}: weight_scale_inv must be float32, got {scale_inv.dtype}")
    n, k = weight.shape[-2:]
    want = list(weight.shape[:-2]) + list(block.scale_shape(n, k))
    if list(scale_inv.shape) != want:
        raise ValueError(f"{what}: weight_scale_inv shape {list(scale_inv.shape)} != {want} ({block})")
    if weight.stride(-1) != 1 or scale_inv.stride(-1) != 1:
        raise ValueError(f"{what}: weight and weight_scale_inv must be contiguous along K")


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: Fp8Block,
                 config: W8Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16; fp32 under the interpreter) @ FP8 weight [N, K] -> [M, N] in x.dtype (Triton)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x dtype {x.dtype} not supported (bf16, fp16, fp32)")
    M, K = x.shape
    N = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight {tuple(weight.shape)} does not take inputs of width K={K}")
    check_fp8(weight, scale_inv, block)
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or w8_config_for(N, K)
    block_k = tile_k(block, cfg.BLOCK_K)
    split, k_per_split = k_splits(K, block_k, w8_split(N, K, block_k, cfg.BLOCK_N, cfg.target_programs))
    upcast = interpreting()
    prec = "ieee" if (x.dtype == torch.float32 or upcast) else "tf32"
    target = out if split == 1 else torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, cfg.BLOCK_M), triton.cdiv(N, cfg.BLOCK_N), split)
    counters = arrival_counters(x.device, grid[0] * grid[1]) if split > 1 else None
    _w8a16_kernel[grid](
        x, weight, scale_inv, target, M, N, K, k_per_split,
        x.stride(0), weight.stride(0), scale_inv.stride(0), N, M * N,
        BN_Q=block.n, BK_Q=block.k, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        UPCAST=upcast, PREC=prec, OUT_F32=split > 1,
        fin_ptr=out, cnt_ptr=counters, n_split=split, SERIAL=counters is not None,
        num_warps=cfg.num_warps, num_stages=fp32_stages(cfg.num_stages, x.dtype))
    if split > 1 and counters is None:
        split_sum(target, out, split)
    return out


__all__ = ["W8Config", "W8_CONFIG", "W8_CONFIGS", "check_fp8", "fp8_tile", "tile_k", "w8_config_for", "w8_split",
           "w8a16_linear"]
