"""Fused grouped MoE over BF16 / FP16 routed experts, or FP8 block-quantized ones (fp8.py).

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j]

Stacked expert tensors (model/moe.py):
  w13 [E, 2I, H]  rows 0..I-1 gate_proj, I..2I-1 up_proj;  w2 [E, H, I]
  FP8: float8_e4m3fn, with w13_scale_inv [E, 2 ceil(I/bn), ceil(H/bk)] (gate's row blocks, then up's) and
  w2_scale_inv [E, ceil(H/bn), ceil(I/bk)], float32.

Four launches, no host synchronisation (CUDA-graph capturable), the INT4 path's pipeline (moe_w4a16.py):
  1. moe_align: pairs (t, j) sorted by expert into blocks of BLOCK_M rows (moe_w4a16.moe_align);
  2. gate/up GEMM with the SwiGLU epilogue: each program streams BLOCK_N gate rows and the matching up rows
     of its expert over all of H (or over its K range of a fixed split, GroupedConfig.SPLIT_K), writes
     silu(g) * u in x's dtype to inter[P, I];
  3. down GEMM: inter rows @ w2[e].T times the routing weight, fp32 to y[S2, P, H] (S2 > 1: a fixed split of I,
     GroupedConfig.SPLIT_K2, partial s to y[s]);
  4. the top-k sum in slot order, then over the down split's partials in split order (moe_w4a16.moe_topk_sum),
     plus the optional addend.
FP8 tiles are converted in registers (exact) and each tile's partial dot is scaled by its block scale
(BLOCK_K divides bk: one scale column per tile), as in w8a16.py.

Split K (gate/up only, SPLIT_K = S > 1: more programs streaming the weights at one token): program s of an
output tile covers the K range [s KS, min((s+1) KS, H)), KS = cdiv(cdiv(H, S), BLOCK_K) BLOCK_K (whole tiles, so
an FP8 tile keeps one scale column), and writes its float32 gate and up partials to a workspace parts[S, P, 2I];
the last program of the tile to arrive (split_sum.last_to_arrive's arrival counters) sums them in split order
and applies the SwiGLU. A launch of more tiles than split_sum.SERIAL_TILES sums them in a second kernel, the
same additions. The workspace is S * P * 2I float32 (at large T, many times inter's bytes).

Batch invariance: every pair keeps its own row of inter / y, a block's rows never mix, and the tiles
(BLOCK_M, BLOCK_N, BLOCK_K, warps) are the same for every T. The split along K of the gate/up launch is a fixed
one: its count and K ranges depend on H, BLOCK_K and the config only (never on T), and its partials are summed
in split order (s = 0, 1, ...) by the tile's last program or the second kernel, the same additions; the down
launch's split (SPLIT_K2) likewise depends on I and the config only, its partials summed by the top-k sum. So a
token's result does not depend on how many tokens share its expert. Pairs routed outside [0, E) contribute 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fp8 import Fp8Block
from .common import DTYPES, interpreting
from .moe_w4a16 import check_add, moe_align, moe_topk_sum
from .split_sum import Partition, arrival_counters, last_to_arrive
from .w4a16 import fp32_stages, k_splits, mma_tile
from .w8a16 import check_fp8, fp8_tile, tile_k


@dataclass(frozen=True)
class GroupedConfig:
    BLOCK_M: int = 16    # pair rows per expert block (the MMA's N side, SWAP_AB); fixed for every T
    BLOCK_N: int = 64    # weight rows per program (gate/up: gate rows, the up rows come with them)
    BLOCK_K: int = 128   # at most (FP8: the largest power of two dividing bk)
    num_warps: int = 4
    num_stages: int = 3
    SPLIT_K: int = 1     # fixed split of the gate/up launch along H (1: none; fixed_split)
    SPLIT_K2: int = 1    # fixed split of the down launch along I, its partials summed by the top-k sum


# One config a weight format, for every shape and T (so batch-invariant): the best of bench/moe_formats.py --sweep
# (bench/results/moe_formats_sweep-h200.md) at Moonlight's BF16 shape and at K2's FP8 one, where the gate/up split
# in two is faster at one token and the best by the sum over T. Its workspace is 2 x P x 2I float32 (at prefill
# chunk sizes several times inter's bytes, held for the length of the launch).
GROUPED_CONFIG = GroupedConfig()
FP8_GROUPED_CONFIG = GroupedConfig(SPLIT_K=2)


@triton.jit
def _weight_tile(w_rows, offs_k, n_mask, k0, k_hi, DTYPE: tl.constexpr, FP8: tl.constexpr):
    # one return: an early one inside the constexpr branch makes the compiler type both (bf16 vs fp8)
    if FP8:
        w = fp8_tile(w_rows, offs_k, n_mask, k0, k_hi, DTYPE)
    else:
        kk = k0 + offs_k
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & (kk[None, :] < k_hi), other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, x, s_rows, n_mask, k0, BK_Q: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr,
                PREC: tl.constexpr):
    """acc [BN, BM] += w @ x.T; FP8: the tile's dot times the rows' block scale of column block k0 // bk."""
    if FP8:
        part = mma_tile(tl.zeros(acc.shape, dtype=tl.float32), w, x, True, UPCAST, PREC)
        s = tl.load(s_rows + k0 // BK_Q, mask=n_mask, other=0.0)
        return acc + part * s[:, None]
    return mma_tile(acc, w, x, True, UPCAST, PREC)


@triton.jit
def _block(sorted_ptr, blk_expert_ptr, pid_b, rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Expert block pid_b (of `rows` pairs) and this program's BLOCK_N output columns of N: (expert, row mask,
    pair ids, column offsets, column mask)."""
    e = tl.load(blk_expert_ptr + pid_b).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    r_mask = offs_r < rows
    pair = tl.load(sorted_ptr + pid_b * BLOCK_M + offs_r, mask=r_mask, other=0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, r_mask, pair, offs_n, offs_n < N


@triton.jit
def _gate_up(x_rows, r_mask, wg_rows, wu_rows, sg_rows, su_rows, n_mask, k_lo, k_hi, DTYPE: tl.constexpr,
             FP8: tl.constexpr, BK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """The pairs' gate and up [BM, BN] (float32) over the K range [k_lo, k_hi) (k_lo a multiple of BLOCK_K)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        xt = tl.load(x_rows + kk[None, :], mask=r_mask[:, None] & (kk[None, :] < k_hi), other=0.0)
        wg = _weight_tile(wg_rows, offs_k, n_mask, k0, k_hi, DTYPE, FP8)
        wu = _weight_tile(wu_rows, offs_k, n_mask, k0, k_hi, DTYPE, FP8)
        acc_g = _accumulate(acc_g, wg, xt, sg_rows, n_mask, k0, BK_Q, FP8, UPCAST, PREC)
        acc_u = _accumulate(acc_u, wu, xt, su_rows, n_mask, k0, BK_Q, FP8, UPCAST, PREC)
    return tl.trans(acc_g), tl.trans(acc_u)


@triton.jit
def _swiglu_store(g, u, o_ptrs, o_mask):
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(o_ptrs, h.to(o_ptrs.dtype.element_ty), mask=o_mask)


@triton.jit
def _split_sums_swiglu(p_ptrs, o_mask, stride_ps, I, o_ptrs, SPLIT: tl.constexpr):
    """The SwiGLU of one tile's split partials (p_ptrs: split 0's gate partials, up's I columns on, the splits
    stride_ps apart), each summed in split order from split 0's, stored at o_ptrs."""
    g = tl.load(p_ptrs, mask=o_mask, other=0.0, cache_modifier=".cg")
    u = tl.load(p_ptrs + I, mask=o_mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        q_ptrs = p_ptrs + s * stride_ps.to(tl.int64)
        g += tl.load(q_ptrs, mask=o_mask, other=0.0, cache_modifier=".cg")
        u += tl.load(q_ptrs + I, mask=o_mask, other=0.0, cache_modifier=".cg")
    _swiglu_store(g, u, o_ptrs, o_mask)


@triton.jit
def _grouped_w13_kernel(x_ptr, w_ptr, s_ptr, inter_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, H, I, TOPK,
                        up_blocks, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_it,
                        FP8: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, PREC: tl.constexpr, part_ptr=None, cnt_ptr=None, k_split=0,
                        stride_ps=0, stride_pp=0, SPLIT: tl.constexpr = 1, SERIAL: tl.constexpr = False):
    """grid (blocks, cdiv(I, BLOCK_N), SPLIT). SPLIT > 1: program s writes its K range's float32 partials to
    part[s] (rows: pairs; gate columns, then up's I on); SERIAL: the tile's last program sums them into inter."""
    pid_b = tl.program_id(0)
    rows = tl.load(blk_rows_ptr + pid_b)
    if rows == 0:
        return
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    e, r_mask, pair, offs_n, n_mask = _block(sorted_ptr, blk_expert_ptr, pid_b, rows, I, BLOCK_M, BLOCK_N)
    tok = pair // TOPK
    wg_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    wu_rows = wg_rows + I * stride_wn
    sg_rows = s_ptr + e * stride_se + (offs_n // BN_Q) * stride_sn
    su_rows = sg_rows + up_blocks * stride_sn
    x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    o_mask = r_mask[:, None] & n_mask[None, :]
    o_ptrs = inter_ptr + pair[:, None].to(tl.int64) * stride_it + offs_n[None, :]
    if SPLIT == 1:
        g, u = _gate_up(x_rows, r_mask, wg_rows, wu_rows, sg_rows, su_rows, n_mask, 0, H, DTYPE, FP8, BK_Q,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PREC)
        _swiglu_store(g, u, o_ptrs, o_mask)
    else:
        pid_s = tl.program_id(2)
        k_lo = pid_s * k_split
        g, u = _gate_up(x_rows, r_mask, wg_rows, wu_rows, sg_rows, su_rows, n_mask, k_lo,
                        tl.minimum(H, k_lo + k_split), DTYPE, FP8, BK_Q, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PREC)
        p_ptrs = part_ptr + pair[:, None].to(tl.int64) * stride_pp + offs_n[None, :]
        q_ptrs = p_ptrs + pid_s.to(tl.int64) * stride_ps
        tl.store(q_ptrs, g, mask=o_mask)
        tl.store(q_ptrs + I, u, mask=o_mask)
        if SERIAL:
            tile = pid_b * tl.num_programs(1) + tl.program_id(1)
            if last_to_arrive(cnt_ptr, tile, SPLIT):
                _split_sums_swiglu(p_ptrs, o_mask, stride_ps, I, o_ptrs, SPLIT)
                tl.store(cnt_ptr + tile, 0)


@triton.jit
def _grouped_w13_sum_kernel(part_ptr, inter_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, I, stride_ps,
                            stride_pp, stride_it, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """_grouped_w13_kernel's split partials summed into inter without arrival counters (grid (blocks,
    cdiv(I, BLOCK_N))): the last program's additions, the same bits."""
    pid_b = tl.program_id(0)
    rows = tl.load(blk_rows_ptr + pid_b)
    if rows == 0:
        return
    _, r_mask, pair, offs_n, n_mask = _block(sorted_ptr, blk_expert_ptr, pid_b, rows, I, BLOCK_M, BLOCK_N)
    p_ptrs = part_ptr + pair[:, None].to(tl.int64) * stride_pp + offs_n[None, :]
    o_ptrs = inter_ptr + pair[:, None].to(tl.int64) * stride_it + offs_n[None, :]
    _split_sums_swiglu(p_ptrs, r_mask[:, None] & n_mask[None, :], stride_ps, I, o_ptrs, SPLIT)


@triton.jit
def _grouped_w2_kernel(a_ptr, w_ptr, s_ptr, y_ptr, tw_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr, H, I, k_split,
                       stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt, stride_ys,
                       FP8: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr, PREC: tl.constexpr):
    pid_b = tl.program_id(0)
    rows = tl.load(blk_rows_ptr + pid_b)
    if rows == 0:
        return
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty
    e, r_mask, pair, offs_n, n_mask = _block(sorted_ptr, blk_expert_ptr, pid_b, rows, H, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + e * stride_se + (offs_n // BN_Q) * stride_sn
    a_rows = a_ptr + pair[:, None].to(tl.int64) * stride_at
    # grid axis 2: the fixed split of I (GroupedConfig.SPLIT_K2), partial s to y[s]; the top-k sum adds them
    pid_s = tl.program_id(2)
    k_lo = pid_s * k_split
    k_hi = tl.minimum(I, k_lo + k_split)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        at = tl.load(a_rows + kk[None, :], mask=r_mask[:, None] & (kk[None, :] < k_hi), other=0.0)
        wt = _weight_tile(w_rows, offs_k, n_mask, k0, k_hi, DTYPE, FP8)
        acc = _accumulate(acc, wt, at, s_rows, n_mask, k0, BK_Q, FP8, UPCAST, PREC)
    acc = tl.trans(acc)
    tw = tl.load(tw_ptr + pair, mask=r_mask, other=0.0).to(tl.float32)
    acc = acc * tw[:, None]
    o_ptrs = y_ptr + pid_s.to(tl.int64) * stride_ys + pair[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=r_mask[:, None] & n_mask[None, :])


def _check_dense(w: torch.Tensor, x: torch.Tensor, what: str) -> None:
    if w.dtype != x.dtype:
        raise TypeError(f"{what}: dense experts must have x's dtype {x.dtype}, got {w.dtype}")
    if w.stride(-1) != 1:
        raise ValueError(f"{what}: must be contiguous along K")


def fixed_split(K: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(S, KS) of a launch's split along K (GroupedConfig.SPLIT_K / SPLIT_K2 = split_k): program s covers
    [s KS, min((s+1) KS, K)), KS = cdiv(cdiv(K, split_k), block_k) block_k whole tiles; S = cdiv(K, KS) (below
    split_k only where K has too few tiles: no program with an empty range). From (K, block_k, split_k) only."""
    if split_k < 1:
        raise ValueError(f"SPLIT_K must be >= 1, got {split_k}")
    return k_splits(K, block_k, split_k)   # the INT4 kernels' split of a K loop into whole tiles


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, *, add: torch.Tensor | None = None,
                      w13_scale_inv: torch.Tensor | None = None, w2_scale_inv: torch.Tensor | None = None,
                      block: Fp8Block | None = None, config: GroupedConfig | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] (x.dtype): the routed experts (w13 [E, 2I, H], w2 [E, H, I] in x's dtype, or FP8 with
    their scales and ``block``); add [T, H] (x.dtype): added in the top-k sum (the bits of ``out + add``)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x dtype {x.dtype} not supported (bf16, fp16, fp32)")
    T, H = x.shape
    E, two_i, h = w13.shape
    I = two_i // 2
    if h != H or two_i != 2 * I or tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match E={E}, H={H}, I={I}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={T}, k]")
    fp8 = block is not None
    if fp8:
        if w13_scale_inv is None or w2_scale_inv is None:
            raise ValueError("FP8 experts need w13_scale_inv and w2_scale_inv")
        gate_rows = block.scale_shape(I, H)[0]
        check_fp8(w13[:, :I], w13_scale_inv[:, :gate_rows], block, "w13 (gate)")
        if tuple(w13_scale_inv.shape[1:]) != (2 * gate_rows, block.scale_shape(I, H)[1]):
            raise ValueError(f"w13_scale_inv {list(w13_scale_inv.shape)} must hold gate's then up's row blocks")
        check_fp8(w2, w2_scale_inv, block, "w2")
    else:
        _check_dense(w13, x, "w13")
        _check_dense(w2, x, "w2")
        gate_rows = 0
    check_add(add, x, "fused_moe_grouped")
    topk = topk_ids.shape[1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    x = x.contiguous()
    cfg = config or (FP8_GROUPED_CONFIG if fp8 else GROUPED_CONFIG)
    block_k = tile_k(block, cfg.BLOCK_K) if fp8 else cfg.BLOCK_K
    upcast = interpreting()
    prec = "ieee" if (x.dtype == torch.float32 or upcast) else "tf32"
    stages = fp32_stages(cfg.num_stages, x.dtype)
    P = T * topk
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    sorted_pairs, blk_expert, blk_rows = moe_align(ids, E, cfg.BLOCK_M)
    max_blocks = blk_rows.numel()
    inter = torch.empty((P, I), device=x.device, dtype=x.dtype)
    split2, k_split2 = fixed_split(I, block_k, cfg.SPLIT_K2)
    y = torch.empty((split2, P, H), device=x.device, dtype=torch.float32)
    s13 = w13_scale_inv if fp8 else w13
    s2 = w2_scale_inv if fp8 else w2
    bn_q, bk_q = (block.n, block.k) if fp8 else (1, 1)
    split, k_split = fixed_split(H, block_k, cfg.SPLIT_K)
    grid = (max_blocks, triton.cdiv(I, cfg.BLOCK_N), split)
    split_kw, counters = {}, None
    if split > 1:
        parts = torch.empty((split, P, 2 * I), device=x.device, dtype=torch.float32)
        counters = arrival_counters(x.device, grid[0] * grid[1])
        split_kw = dict(part_ptr=parts, cnt_ptr=counters, k_split=k_split, stride_ps=parts.stride(0),
                        stride_pp=parts.stride(1), SPLIT=split, SERIAL=counters is not None)
    _grouped_w13_kernel[grid](
        x, w13, s13, inter, sorted_pairs, blk_expert, blk_rows, H, I, topk, gate_rows,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), inter.stride(0),
        FP8=fp8, BN_Q=bn_q, BK_Q=bk_q, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        UPCAST=upcast, PREC=prec, num_warps=cfg.num_warps, num_stages=stages, **split_kw)
    if split > 1 and counters is None:
        _grouped_w13_sum_kernel[grid[:2]](
            parts, inter, sorted_pairs, blk_expert, blk_rows, I, parts.stride(0), parts.stride(1), inter.stride(0),
            SPLIT=split, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, num_warps=cfg.num_warps)
    _grouped_w2_kernel[(max_blocks, triton.cdiv(H, cfg.BLOCK_N), split2)](
        inter, w2, s2, y, tw, sorted_pairs, blk_expert, blk_rows, H, I, k_split2,
        inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(1), y.stride(0),
        FP8=fp8, BN_Q=bn_q, BK_Q=bk_q, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        UPCAST=upcast, PREC=prec, num_warps=cfg.num_warps, num_stages=stages)
    moe_topk_sum(y, out, ids, E, topk, split2, Partition.split(H, split2), 1024, add=add)
    return out


__all__ = ["GroupedConfig", "GROUPED_CONFIG", "FP8_GROUPED_CONFIG", "fused_moe_grouped", "fixed_split"]
