"""Fused MoE over INT4 (W4A16) routed experts, compressed-tensors layout read in place.

    out[t] = sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = topk_ids[t, j]

Stacked expert tensors (checkpoint layout, no repack):
  w13_packed int32 [E, 2I, H/8], w13_scale [E, 2I, H/g]   rows 0..I-1 gate_proj, I..2I-1 up_proj
  w2_packed  int32 [E, H, I/8],  w2_scale  [E, H, I/g]

Four launches, no host synchronisation (CUDA-graph capturable):
  1. align (one program per expert, each counting all pairs): pairs (t, j) sorted by expert into blocks
     of BLOCK_M rows; per block: expert id and number of valid rows. Blocks are only emitted for
     experts that are touched, so the GEMM grids below cover exactly the (expert, N-tile) pairs in use
     (plus a few empty programs that exit at once: the grid is a host-side upper bound,
     cdiv(P, BM) + min(E, P)).
  2. gate/up GEMM with the SwiGLU epilogue: each program streams BLOCK_N gate rows and the matching
     BLOCK_N up rows of its expert over all of H; writes silu(g) * u in x.dtype to inter[P, I].
  3. down GEMM: inter rows of the block @ w2[e].T, times the router weight, fp32 to y[P, H].
  4. top-k sum: out[t] = sum_j y[t*k + j] in j order (deterministic; no atomics).
The routed pair (t, j) keeps its own row in inter / y, so the result of a token never depends on
which other tokens share its expert block (batch invariance; see w4a16.py for the reduction rules).
Pairs whose expert id is outside [0, E) (e.g. -1 for experts owned by another rank) contribute 0.

MoEConfig.DEQUANT = "bf16x2" dequantizes two nibbles per instruction in inline PTX (w4_dequant.py): x is
permuted once per call into the tiles' column order and the gate/up epilogue writes inter in that order.

Decode (T = 1..16): a token touches 8 experts; grid = touched blocks x N tiles (w13: 2I/BLOCK_N per
expert, w2: H/BLOCK_N), i.e. 512 / 896 programs at T = 1 on K2 shapes, each streaming whole weight rows
with 16-byte loads. MoEConfig.SPLIT_K > 1 splits the gate/up GEMM over H (more programs in flight, the
way split-K 2 helped the dense GEMM): fp32 partials, then a fifth launch sums them in split order and
applies SwiGLU (`_moe_swiglu_kernel`); the split is part of the reduction key, never chosen from T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kdtree_engine.kernels.common import bucket, interpreting
from kdtree_engine.kernels.pdl import pdl_launch, pdl_wait
from kdtree_engine.kernels.split_sum import Partition, stream_slots
from kdtree_engine.kernels.w4_dequant import DEQ_BF16X2, DEQ_BF16X2_EMU, DEQUANTS, load_dequant, pair_order, pair_pos
from kdtree_engine.kernels.w4a16 import check_w4, deq_code, fp32_stages, k_splits, mma_tile
from kdtree_engine.quant import dequantize

# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class MoEConfig:
    # token rows per expert block (a power of 2 >= 8). With SWAP_AB the tokens are the MMA's N side: on
    # sm_90 8 rows compile to mma.sync (128 registers on gate/up, no wgmma waits), 16 and more to wgmma,
    # which round differently, so 8 is part of the reduction key. Measured slower (the operand reads become
    # scalar shared loads; docs/performance_history.md)
    BLOCK_M: int = 16
    BLOCK_N: int = 64    # weight rows per program (w13: gate rows; up rows come with them)
    BLOCK_K: int = 256
    SWAP_AB: bool = True
    num_warps: int = 4
    num_stages: int = 4
    BLOCK_N2: int | None = None  # down GEMM BLOCK_N (default: BLOCK_N)
    DEQUANT: str = "float"  # "float" or "bf16x2" (PTX, bf16 activations only), see w4_dequant.py
    SPLIT_K: int = 1     # gate/up GEMM split over H: fp32 partials, then a SwiGLU pass sums them in order
    # down GEMM split over I: each split writes its router-weighted fp32 partial, the top-k sum adds them
    # (per pair in split order); 1 in the defaults (measured slower, docs/performance_history.md)
    SPLIT_K2: int = 1

    def __post_init__(self) -> None:
        if self.DEQUANT not in DEQUANTS:
            raise ValueError(f"MoEConfig.DEQUANT must be one of {tuple(DEQUANTS)}, got {self.DEQUANT!r}")
        if self.BLOCK_M < 8 or self.BLOCK_M & (self.BLOCK_M - 1):
            raise ValueError(f"MoEConfig.BLOCK_M must be a power of 2 >= 8, got {self.BLOCK_M}")
        if self.SPLIT_K < 1 or self.SPLIT_K2 < 1:
            raise ValueError(f"MoEConfig.SPLIT_K and SPLIT_K2 must be >= 1, got {self.SPLIT_K} / {self.SPLIT_K2}")

    def reduction_key(self) -> tuple:
        """The fields that fix how one output element is summed (must be equal across T buckets)."""
        return (self.DEQUANT, self.BLOCK_K, self.SWAP_AB, self.SPLIT_K, self.SPLIT_K2, self.BLOCK_M < 16)

    def as_dict(self) -> dict:
        return dict(DEQUANT=self.DEQUANT, BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, BLOCK_K=self.BLOCK_K,
                    SWAP_AB=self.SWAP_AB, num_warps=self.num_warps, num_stages=self.num_stages,
                    BLOCK_N2=self.BLOCK_N2, SPLIT_K=self.SPLIT_K, SPLIT_K2=self.SPLIT_K2)


# (max pairs per expert = cdiv(T * top_k, E), config); first match wins. BLOCK_K and SWAP_AB are shared
# (batch invariance); BLOCK_M only re-tiles (tests/gpu: test_moe_block_rows_same_bits).
MOE_CONFIGS: list[tuple[int, MoEConfig]] = [
    # the K2 layer's fastest (bench/kernels.py sweeps; docs/performance_history.md): bf16x2 with pipelined scales
    # and the gate/up GEMM split in two over H; 16-row expert blocks also the fastest up to 12 pairs per expert
    (12, MoEConfig(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, DEQUANT="bf16x2", SPLIT_K=2)),
    # longer expert lists (prefill): larger blocks read an expert's weights fewer times; not measured
    (48, MoEConfig(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3, DEQUANT="bf16x2", SPLIT_K=2)),
    (1 << 62, MoEConfig(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2, DEQUANT="bf16x2", SPLIT_K=2)),
]
if len({cfg.reduction_key() for _, cfg in MOE_CONFIGS}) != 1:
    raise ValueError("MOE_CONFIGS: all buckets must share DEQUANT, BLOCK_K, SWAP_AB, SPLIT_K, SPLIT_K2 and "
                     "the MMA kind (BLOCK_M 8 or >= 16; batch invariance)")


def moe_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """The config for T * top_k routed pairs over num_experts experts (by pairs per expert)."""
    return bucket(MOE_CONFIGS, -(-num_pairs // max(num_experts, 1)))


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["P", "max_blocks"])  # counts: one variant per length bucket
def _moe_align_kernel(ids_ptr, P, E, sorted_ptr, blk_expert_ptr, blk_rows_ptr, max_blocks,
                      BM: tl.constexpr, E_P2: tl.constexpr, CH: tl.constexpr, BCH: tl.constexpr,
                      PDL: tl.constexpr = False):
    """Program e (one per expert). ids [P] (flattened topk_ids) -> sorted_ptr [max_blocks*BM]: the
    pairs of expert e, ascending, from row blk_start[e] * BM on; blk_expert / blk_rows [max_blocks] for
    e's blocks (program 0 also marks the unused blocks past the last one: rows = 0). PDL: launched
    dependent on the kernel that wrote the ids (pdl.py)."""
    if PDL:
        pdl_wait()
    e = tl.program_id(0)
    offs_e = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, P, CH):                           # counts of every expert (for e's first block)
        offs = c0 + tl.arange(0, CH)
        ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
        counts += tl.histogram(ids, E_P2, mask=(offs < P) & (ids >= 0) & (ids < E))
    nblk = (counts + BM - 1) // BM                       # [E_P2]
    start = tl.sum(tl.where(offs_e < e, nblk, 0), axis=0)
    own = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)

    # e's pairs in pair order: rank = number of e's pairs before it
    running = start * BM
    if own > 0:
        for c0 in range(0, P, CH):
            offs = c0 + tl.arange(0, CH)
            ids = tl.load(ids_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
            hit = ((ids == e) & (offs < P)).to(tl.int32)
            pos = running + tl.cumsum(hit, axis=0) - hit
            tl.store(sorted_ptr + pos, offs, mask=hit != 0)
            running += tl.sum(hit, axis=0)
    for b0 in range(0, (own + BM - 1) // BM, BCH):        # e's blocks
        j = b0 + tl.arange(0, BCH)
        ok = j * BM < own
        tl.store(blk_expert_ptr + start + j, tl.zeros_like(j) + e, mask=ok)
        tl.store(blk_rows_ptr + start + j, tl.minimum(own - j * BM, BM), mask=ok)
    if e == 0:                                           # the unused blocks
        total = tl.sum(nblk, axis=0)
        for b0 in range(total, max_blocks, BCH):
            b = b0 + tl.arange(0, BCH)
            tl.store(blk_expert_ptr + b, tl.zeros_like(b), mask=b < max_blocks)
            tl.store(blk_rows_ptr + b, tl.zeros_like(b), mask=b < max_blocks)


@triton.jit(do_not_specialize=["P", "max_blocks"])  # counts: one variant per length bucket
def _moe_align_one_kernel(ids_ptr, P, E, sorted_ptr, blk_expert_ptr, blk_rows_ptr, max_blocks,
                          BM: tl.constexpr, PP: tl.constexpr, MBP: tl.constexpr, PDL: tl.constexpr = False):
    """One program, P <= PP pairs: the same outputs as _moe_align_kernel in one launch of one program
    (PDL: as there).
    Pair i of expert e: rank r_i = e's pairs before it, c_i = e's pairs; expert e's blocks start at
    start_i = sum of cdiv(c_j, BM) over the first pair j of each expert below e."""
    if PDL:
        pdl_wait()
    i = tl.arange(0, PP)
    ids = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int32)
    ok = (i < P) & (ids >= 0) & (ids < E)
    ids = tl.where(ok, ids, -1)
    same = (ids[:, None] == ids[None, :]) & ok[:, None] & ok[None, :]          # [PP(i), PP(j)]
    cnt = tl.sum(same.to(tl.int32), axis=1)                                        # c_i
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)         # r_i
    first = ok & (rank == 0)
    nb = tl.where(first, (cnt + BM - 1) // BM, 0)                                  # blocks, on first pairs
    below = (ids[None, :] < ids[:, None]) & first[None, :]                         # j's expert below i's
    start = tl.sum(tl.where(below, nb[None, :], 0), axis=1)                        # [PP] start block of i
    tl.store(sorted_ptr + start * BM + rank, i, mask=ok)
    b = tl.arange(0, MBP)
    hit = first[None, :] & (start[None, :] <= b[:, None]) & (b[:, None] < start[None, :] + nb[None, :])
    rows = tl.minimum(cnt[None, :] - (b[:, None] - start[None, :]) * BM, BM)
    tl.store(blk_expert_ptr + b, tl.sum(tl.where(hit, ids[None, :], 0), axis=1), mask=b < max_blocks)
    tl.store(blk_rows_ptr + b, tl.sum(tl.where(hit, rows, 0), axis=1), mask=b < max_blocks)


@triton.jit
def _moe_w13_kernel(x_ptr, w_ptr, s_ptr, inter_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr,
                    H, I, TOPK,
                    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_it,
                    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                    DEQ: tl.constexpr = 0, EVEN: tl.constexpr = False,
                    part_ptr=None, stride_ps=0, stride_pp=0, k_per_split=0, SPLIT: tl.constexpr = 1):
    """SPLIT == 1: silu(gate) * up into inter. SPLIT > 1: split pid_k writes its fp32 gate / up partial
    sums to part[pid_k, pair, 0:I] / part[pid_k, pair, I:2I] (the SwiGLU pass adds them in split order)."""
    pid_b = tl.program_id(0)   # expert block (fastest: blocks of one expert share its weights in L2)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = tl.load(blk_rows_ptr + pid_b)
    if rows == 0:
        return
    e = tl.load(blk_expert_ptr + pid_b).to(tl.int64)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty

    offs_r = tl.arange(0, BLOCK_M)
    r_mask = offs_r < rows
    pair = tl.load(sorted_ptr + pid_b * BLOCK_M + offs_r, mask=r_mask, other=0)
    tok = pair // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    wg_ptr = w_ptr + e * stride_we
    wu_ptr = wg_ptr + I * stride_wn
    sg_ptr = s_ptr + e * stride_se
    su_ptr = sg_ptr + I * stride_sn
    x_rows = x_ptr + tok[:, None].to(tl.int64) * stride_xt
    offs_k = tl.arange(0, BLOCK_K)

    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT == 1:
        k_lo = 0
        k_hi = H
    else:
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(H, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        if EVEN:
            xt = tl.load(x_rows + kk[None, :], mask=r_mask[:, None], other=0.0)
        else:
            xt = tl.load(x_rows + kk[None, :], mask=r_mask[:, None] & (kk[None, :] < k_hi), other=0.0)
        wg = load_dequant(wg_ptr, sg_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, k_hi,
                           G, BLOCK_N, BLOCK_K, DTYPE, DEQ, EVEN)
        wu = load_dequant(wu_ptr, su_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, k_hi,
                           G, BLOCK_N, BLOCK_K, DTYPE, DEQ, EVEN)
        acc_g = mma_tile(acc_g, wg, xt, SWAP_AB, UPCAST, PREC)
        acc_u = mma_tile(acc_u, wu, xt, SWAP_AB, UPCAST, PREC)
    if SWAP_AB:
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
    if SPLIT == 1:
        h = _swiglu(acc_g, acc_u)
        # inter is the down GEMM's activation: its columns in that GEMM's tile order (w4_dequant.py)
        o_ptrs = inter_ptr + pair[:, None].to(tl.int64) * stride_it + pair_pos(offs_n, DEQ)[None, :]
        tl.store(o_ptrs, h.to(inter_ptr.dtype.element_ty), mask=r_mask[:, None] & n_mask[None, :])
    else:
        p_ptrs = part_ptr + pid_k * stride_ps + pair[:, None].to(tl.int64) * stride_pp + offs_n[None, :]
        o_mask = r_mask[:, None] & n_mask[None, :]
        tl.store(p_ptrs, acc_g, mask=o_mask)
        tl.store(p_ptrs + I, acc_u, mask=o_mask)


@triton.jit
def _swiglu(g, u):
    """silu(gate) * up in fp32 (one definition for the fused epilogue and the split-K pass)."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _moe_swiglu_kernel(part_ptr, inter_ptr, ids_ptr, P, I, E, stride_ps, stride_pp, stride_it, rows, iters, work,
                       programs, SPLIT: tl.constexpr, BLOCK: tl.constexpr, DEQ: tl.constexpr, PAIRS: tl.constexpr = 1,
                       PDL: tl.constexpr = False):
    """grid (pairs / PAIRS, I / BLOCK): for each of PAIRS pairs, sum its gate / up partials in slot order (the slots
    column i's row tile has in the gate/up GEMM's partition: split_sum.Partition, rows / iters / work / programs),
    SwiGLU, write inter. Pairs routed outside [0, E) have no partials (no block computed them) and are skipped: an
    expert-parallel rank owns one route of a token's top_k on average, so a program takes several pairs rather than
    the grid holding a program for every pair. Each element's arithmetic is the same for any PAIRS. PDL: launched
    dependent on the gate/up GEMM (pdl.py)."""
    if PDL:
        pdl_wait()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    used = stream_slots(offs, rows, iters, work, programs)
    for j in tl.static_range(PAIRS):
        p = tl.program_id(0) * PAIRS + j
        pv = p + tl.zeros_like(offs)   # broadcast: a vector mask below
        eid = tl.load(ids_ptr + pv, mask=pv < P, other=-1)
        mask = (offs < I) & (eid >= 0) & (eid < E)
        row = part_ptr + p.to(tl.int64) * stride_pp + offs
        g = tl.zeros((BLOCK,), dtype=tl.float32)
        u = tl.zeros((BLOCK,), dtype=tl.float32)
        for sp in tl.static_range(SPLIT):
            more = mask & (sp < used)
            g = tl.where(more, g + tl.load(row + sp * stride_ps, mask=more, other=0.0), g)
            u = tl.where(more, u + tl.load(row + sp * stride_ps + I, mask=more, other=0.0), u)
        h = _swiglu(g, u)
        tl.store(inter_ptr + p.to(tl.int64) * stride_it + pair_pos(offs, DEQ), h.to(inter_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _moe_w2_kernel(a_ptr, w_ptr, s_ptr, y_ptr, tw_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr,
                   H, I,
                   stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt, stride_ys, k_per_split,
                   G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                   DEQ: tl.constexpr = 0, EVEN: tl.constexpr = False):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = tl.load(blk_rows_ptr + pid_b)
    if rows == 0:
        return
    e = tl.load(blk_expert_ptr + pid_b).to(tl.int64)
    DTYPE: tl.constexpr = a_ptr.dtype.element_ty

    offs_r = tl.arange(0, BLOCK_M)
    r_mask = offs_r < rows
    pair = tl.load(sorted_ptr + pid_b * BLOCK_M + offs_r, mask=r_mask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    we_ptr = w_ptr + e * stride_we
    se_ptr = s_ptr + e * stride_se
    a_rows = a_ptr + pair[:, None].to(tl.int64) * stride_at
    offs_k = tl.arange(0, BLOCK_K)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.program_id(2) * k_per_split   # this split's K range (whole BLOCK_K tiles)
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, I), BLOCK_K):
        kk = k0 + offs_k
        if EVEN:
            at = tl.load(a_rows + kk[None, :], mask=r_mask[:, None], other=0.0)
        else:
            at = tl.load(a_rows + kk[None, :], mask=r_mask[:, None] & (kk[None, :] < I), other=0.0)
        wt = load_dequant(we_ptr, se_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, I,
                           G, BLOCK_N, BLOCK_K, DTYPE, DEQ, EVEN)
        acc = mma_tile(acc, wt, at, SWAP_AB, UPCAST, PREC)
    if SWAP_AB:
        acc = tl.trans(acc)
    tw = tl.load(tw_ptr + pair, mask=r_mask, other=0.0).to(tl.float32)
    acc = acc * tw[:, None]
    o_ptrs = y_ptr + tl.program_id(2) * stride_ys + pair[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(o_ptrs, acc, mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def add_rounded(res, other):
    """res + other as torch adds two tensors of res's dtype: both read as float32, the sum rounded once to
    res's dtype (the routed sum plus the shared expert: the same bits as the explicit add after the MoE)."""
    return (res.to(tl.float32) + other.to(tl.float32)).to(res.dtype)


@triton.jit
def _moe_topk_sum_kernel(y_ptr, ids_ptr, out_ptr, add_ptr, H, E, stride_yt, stride_ys, stride_ot, stride_at, rows,
                         iters, work, programs, TOPK: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr = 1,
                         ADD: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t] = sum over j (then over the slots of the down GEMM's partition that column n's row tile has, in
    order: split_sum.Partition) of y[s, t * TOPK + j]; ADD: out[t] = round(round(that) + add[t]) (add_rounded).
    PDL: launched dependent on the down GEMM (pdl.py)."""
    if PDL:
        pdl_wait()
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    used = stream_slots(offs, rows, iters, work, programs)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        eid = tl.load(ids_ptr + p + tl.zeros_like(offs))     # broadcast: a vector mask below
        ok = mask & (eid >= 0) & (eid < E)
        for sp in tl.static_range(SPLIT):
            more = ok & (sp < used)
            acc = tl.where(more, acc + tl.load(y_ptr + sp * stride_ys + p.to(tl.int64) * stride_yt + offs, mask=more,
                                               other=0.0), acc)
    res = acc.to(out_ptr.dtype.element_ty)
    if ADD:
        res = add_rounded(res, tl.load(add_ptr + t.to(tl.int64) * stride_at + offs, mask=mask, other=0.0))
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, res, mask=mask)


def moe_swiglu(part: torch.Tensor, inter: torch.Tensor, ids: torch.Tensor, num_experts: int, slots: int,
               partition: Partition, deq: int, block: int, pdl: bool = False) -> None:
    """inter [P, I] = SwiGLU of the gate / up partials part [slots, P, 2I] (float32) summed in slot order over
    the slots of each column's row tile in `partition`; pairs whose expert is outside [0, E) are skipped."""
    P, I = inter.shape
    _moe_swiglu_kernel[(triton.cdiv(P, SWIGLU_PAIRS), triton.cdiv(I, block))](
        part, inter, ids, P, I, num_experts, part.stride(0), part.stride(1), inter.stride(0), *partition.args(),
        SPLIT=slots, BLOCK=block, DEQ=deq, PAIRS=SWIGLU_PAIRS, num_warps=4, **pdl_launch(pdl))


def moe_topk_sum(y: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, num_experts: int, topk: int, slots: int,
                 partition: Partition, block: int, pdl: bool = False, add: torch.Tensor | None = None) -> None:
    """out [T, H] = sum over j, then over the slots of column n's row tile in `partition`, of the router-weighted
    down partials y [slots, T * topk, H] (float32); pairs whose expert is outside [0, E) add nothing. add [T, H]
    (out's dtype, unit column stride): out = that sum rounded to out's dtype, plus add (add_rounded)."""
    T, H = out.shape
    _moe_topk_sum_kernel[(T, triton.cdiv(H, block))](
        y, ids, out, out if add is None else add, H, num_experts, y.stride(1), y.stride(0), out.stride(0),
        0 if add is None else add.stride(0), *partition.args(), TOPK=topk, BLOCK_H=block, SPLIT=slots,
        ADD=add is not None, num_warps=4, **pdl_launch(pdl))


def check_add(add: torch.Tensor | None, x: torch.Tensor, who: str) -> None:
    """The MoE's `add` operand (the shared expert's output, added in the top-k sum): [T, H] in x's dtype on x's
    device, unit column stride."""
    if add is None:
        return
    if add.shape != x.shape or add.dtype != x.dtype or add.device != x.device or (add.numel() and add.stride(1) != 1):
        raise ValueError(f"{who}: add must be [{x.shape[0]}, {x.shape[1]}] {x.dtype} on {x.device} with unit column "
                         f"stride (x's), got {tuple(add.shape)} {add.dtype} on {add.device}")


# ----------------------------------------------------------------------------------------------
# Python entry points


# Pairs a SwiGLU program takes: with expert parallelism most of a launch's pairs are other ranks' routes, and a
# program a pair spent the launch scheduling programs with nothing to do (any count gives the same bits).
SWIGLU_PAIRS = 8
# Up to this many pairs the align is one program (_moe_align_one_kernel: [P x P] and [blocks x P] masks)
# instead of one per expert (hundreds of programs at K2 for a handful of pairs).
ALIGN_ONE_PROGRAM = 64


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool = False):
    """Group (token, slot) pairs by expert. Returns (sorted_pairs [max_blocks*BM] int32,
    blk_expert [max_blocks] int32, blk_rows [max_blocks] int32); rows = 0 marks an unused block and
    sorted entries past a block's rows are unspecified. pdl: a programmatic dependent launch (pdl.py;
    CUDA sm_90+ only)."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    P = ids.numel()
    max_blocks = triton.cdiv(P, block_m) + min(num_experts, P)
    dev = ids.device
    sorted_pairs = torch.empty(max_blocks * block_m, device=dev, dtype=torch.int32)  # past a block's rows: unread
    blk_expert = torch.empty(max_blocks, device=dev, dtype=torch.int32)
    blk_rows = torch.empty(max_blocks, device=dev, dtype=torch.int32)
    if P <= ALIGN_ONE_PROGRAM:
        _moe_align_one_kernel[(1,)](ids, P, num_experts, sorted_pairs, blk_expert, blk_rows, max_blocks,
                                    BM=block_m, PP=max(16, triton.next_power_of_2(P)),
                                    MBP=max(16, triton.next_power_of_2(max_blocks)), num_warps=4,
                                    **pdl_launch(pdl))
        return sorted_pairs, blk_expert, blk_rows
    e_p2 = triton.next_power_of_2(max(num_experts, 2))
    ch = max(16, min(triton.next_power_of_2(P), 1024))
    _moe_align_kernel[(num_experts,)](ids, P, num_experts, sorted_pairs, blk_expert, blk_rows, max_blocks,
                                      BM=block_m, E_P2=e_p2, CH=ch, BCH=64, num_warps=4,
                                      **pdl_launch(pdl))
    return sorted_pairs, blk_expert, blk_rows


def fused_moe_w4a16(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                    w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, group_size: int,
                    config: MoEConfig | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] (x.dtype): routed experts only; add [T, H] (x.dtype, e.g. the shared expert's output):
    added in the top-k sum, the bits of `fused_moe_w4a16(...) + add`."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x dtype {x.dtype} not supported (bf16, fp16, fp32)")
    T, H = x.shape
    E, two_i, h8 = w13_packed.shape
    I = two_i // 2
    check_w4(w13_packed, w13_scale, group_size, H, "w13")
    check_w4(w2_packed, w2_scale, group_size, I, "w2")
    if two_i != 2 * I or w2_packed.shape[:2] != (E, H):
        raise ValueError(f"w13 {tuple(w13_packed.shape)} / w2 {tuple(w2_packed.shape)} do not match "
                         f"E={E}, H={H}, I={I}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={T}, k]")
    for name, w in (("w13_packed", w13_packed), ("w13_scale", w13_scale), ("w2_packed", w2_packed),
                    ("w2_scale", w2_scale)):
        if w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:
            raise ValueError(f"{name} must be contiguous in its last two dims")
    check_add(add, x, "fused_moe_w4a16")
    topk = topk_ids.shape[1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    x = x.contiguous()
    P = T * topk
    cfg = config or moe_config(P, E)
    block_k = max(cfg.BLOCK_K, group_size)
    bn2 = cfg.BLOCK_N2 or cfg.BLOCK_N
    upcast = interpreting()
    prec = "ieee" if (x.dtype == torch.float32 or upcast) else "tf32"
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).contiguous()

    stages = fp32_stages(cfg.num_stages, x.dtype)
    deq = deq_code(cfg.DEQUANT, x.dtype)
    if deq in (DEQ_BF16X2, DEQ_BF16X2_EMU):
        x = pair_order(x)   # the bf16x2 tiles' column order (w4_dequant.py)
    sorted_pairs, blk_expert, blk_rows = moe_align(ids, E, cfg.BLOCK_M)
    max_blocks = blk_rows.numel()
    inter = torch.empty((P, I), device=x.device, dtype=x.dtype)
    split2, k_per_split2 = k_splits(I, block_k, cfg.SPLIT_K2)
    y = torch.empty((split2, P, H), device=x.device, dtype=torch.float32)

    split, k_per_split = k_splits(H, block_k, cfg.SPLIT_K)
    part = torch.empty((split, P, 2 * I), device=x.device, dtype=torch.float32) if split > 1 else None
    _moe_w13_kernel[(max_blocks, triton.cdiv(I, cfg.BLOCK_N), split)](
        x, w13_packed, w13_scale, inter, sorted_pairs, blk_expert, blk_rows, H, I, topk,
        x.stride(0), w13_packed.stride(0), w13_packed.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        inter.stride(0),
        G=group_size, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k, SWAP_AB=cfg.SWAP_AB,
        UPCAST=upcast, PREC=prec, DEQ=deq, EVEN=H % block_k == 0 and I % cfg.BLOCK_N == 0,
        part_ptr=part, stride_ps=0 if part is None else part.stride(0),
        stride_pp=0 if part is None else part.stride(1), k_per_split=k_per_split, SPLIT=split,
        num_warps=cfg.num_warps, num_stages=stages)
    if part is not None:
        moe_swiglu(part, inter, ids, E, split, Partition.split(I, split), deq, min(1024, triton.next_power_of_2(I)))
    _moe_w2_kernel[(max_blocks, triton.cdiv(H, bn2), split2)](
        inter, w2_packed, w2_scale, y, tw, sorted_pairs, blk_expert, blk_rows, H, I,
        inter.stride(0), w2_packed.stride(0), w2_packed.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        y.stride(1), y.stride(0), k_per_split2,
        G=group_size, BLOCK_M=cfg.BLOCK_M, BLOCK_N=bn2, BLOCK_K=block_k, SWAP_AB=cfg.SWAP_AB,
        UPCAST=upcast, PREC=prec, DEQ=deq, EVEN=I % block_k == 0 and H % bn2 == 0,
        num_warps=cfg.num_warps, num_stages=stages)
    moe_topk_sum(y, out, ids, E, topk, split2, Partition.split(H, split2), 1024, add=add)
    return out


def fused_moe_reference(x: torch.Tensor, w13_packed: torch.Tensor, w13_scale: torch.Tensor,
                        w2_packed: torch.Tensor, w2_scale: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """Plain torch, per touched expert: dequantize, fp32 math throughout; [T, H] in x.dtype."""
    T, H = x.shape
    E = w13_packed.shape[0]
    I = w13_packed.shape[1] // 2
    topk = topk_ids.shape[1]
    xf = x.float()
    out = torch.zeros((T, H), device=x.device, dtype=torch.float32)
    ids = topk_ids.reshape(-1).long()
    tw = topk_weights.reshape(-1).float()
    tok = torch.arange(T * topk, device=x.device) // topk
    valid = (ids >= 0) & (ids < E)
    for e in torch.unique(ids[valid]).tolist():
        sel = torch.nonzero(ids == e).squeeze(1)         # pairs routed to e
        t = tok[sel]
        w13 = dequantize(w13_packed[e], w13_scale[e], group_size, torch.float32)  # [2I, H]
        w2 = dequantize(w2_packed[e], w2_scale[e], group_size, torch.float32)     # [H, I]
        gu = xf[t] @ w13.T                                                          # [n, 2I]
        h = F.silu(gu[:, :I]) * gu[:, I:]
        out.index_add_(0, t, (h @ w2.T) * tw[sel, None])
    return out.to(x.dtype)


__all__ = ["MoEConfig", "MOE_CONFIGS", "moe_config", "moe_align", "fused_moe_w4a16", "fused_moe_reference", "moe_swiglu",
           "moe_topk_sum"]
