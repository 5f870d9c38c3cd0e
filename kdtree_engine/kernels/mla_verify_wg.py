"""Prefix launches of MLA tree verify with many (query, head) rows on warpgroup MMAs, queries on the M side
(Gluon, sm_90, GPU only).

A tree of T queries at N = 64 heads has T * 64 rows that all read the same prefix keys. The Triton chunk
kernel runs them in 64-row 8-warp tiles (mla_attention.py) at ~20% of the bf16 MMA rate. Here one program of
two warpgroups takes 64 rows and one whole prefix chunk, with q and a ring of key tiles in shared memory (TMA):

    s [64, BN]  = q_lat [64, C] @ K_lat^T [C, BN]  then  += q_pe [64, R] @ K_pe^T [R, BN]   (warpgroup w: keys w)
    l [64]      = l * alpha + max_j (P [64, BN] @ ones [BN, 16])[:, j]
    o [64, C]   = o * alpha + P [64, BN] @ K_lat [BN, C]                                  (warpgroup w: columns w)

(warps [4, 2]: the two warpgroups split the scores' keys and the output's columns; P goes through shared
memory, as the P @ V operand needs every key of a row). Per element this is the chunk kernel's arithmetic
with L_BY_DOT: the same 576-long fp32 score chain (latent, then rope) in k16 steps, scale, exp2 against the
running max, the row sum of the bf16 P by an MMA, the rescaled accumulator as the P @ V MMA's addend, the same
partials (o = acc / l, lse = m + log2 l) for the same merge. The whole prefix chunks, key tiles by TMA; where
N is a multiple of 64 (a row tile is one query's heads) also the tree's own chunks (from S // CHUNK: the
prefix's last keys, then the query's ancestors and itself), each query's keys gathered row by row (cp.async)
through tree_gather_index's idx, masked from the query's length on, as the chunk kernel's gather launch reads
them; those programs come first in the grid. The GPU tests hold it to the chunk kernel bit for bit
(tests/gpu/test_mla_attention_gpu.py).

Shared memory: q 72 KB + STAGES x 72 KB of key tiles + P 8 KB + ones 2 KB (two slots: 226 KB of the 227).
"""

from __future__ import annotations

import torch
import triton

from kdtree_engine.kernels.mla_decode_wg import BLOCK_N, HAVE_GLUON, kv_descriptors
from kdtree_engine.kernels.pdl import PDL_ASM

if HAVE_GLUON:   # optional: the Gluon kernels exist only on a triton with gluon (mla_decode_wg.HAVE_GLUON)
    from kdtree_engine.kernels.mla_decode_wg import key_ring, load_q_rows, tile_row
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed in triton 3.7
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # renamed in triton 3.7

ROWS = 64          # (query, head) rows per program: one wgmma M tile
WARPS = 8          # two warpgroups


def unsupported(C: int, R: int, dtype: torch.dtype, block_n: int, stages: int) -> str | None:
    """Why a verify prefix launch cannot run here (None: it can)."""
    if not HAVE_GLUON:
        return "triton without Gluon"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (bf16 operands)"
    if block_n != BLOCK_N:
        return f"BLOCK_N {block_n} (the warpgroup tile is {BLOCK_N} keys)"
    if C != 512 or R != 64:
        return f"C = {C}, R = {R} (C = 512, R = 64)"
    smem = (ROWS + stages * BLOCK_N) * (C + R) * 2 + ROWS * BLOCK_N * 2 + 16 * BLOCK_N * 2   # q, keys, P, ones
    if stages < 1 or smem > 227 * 1024:
        return f"{stages} key slots need {smem // 1024} KB of shared memory"
    return None


if HAVE_GLUON:
    WAIT_ASM = gl.constexpr(PDL_ASM)
    ROWS_C = gl.constexpr(ROWS)

    @gluon.jit
    def _step(kl_st, kp_st, ql_s, qp_s, p_s, ones_t, zs, zl, acc, m_i, l_i, pos, L, qk_scale,
              ROW_S: gl.constexpr, ROW_O: gl.constexpr):
        """One key block of the online softmax (keys at positions pos [BN], -inf from L on): the scores' chain,
        P through shared memory, the row sums and P @ V issued together, one wait."""
        s = warpgroup_mma(ql_s, kl_st.permute((1, 0)), zs, use_acc=False, is_async=True)
        s = warpgroup_mma(qp_s, kp_st.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s]) * qk_scale
        s = gl.where((pos < L)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        pr = gl.exp2(s - m_new[:, None])
        p_s.store(pr.to(p_s.dtype))
        fence_async_shared()
        cta_barrier()           # every warp's part of P is in before the warpgroups read it
        lsum = warpgroup_mma(p_s, ones_t.permute((1, 0)), zl, use_acc=False, is_async=True)
        alpha_o = gl.convert_layout(alpha, ROW_O)
        pv = warpgroup_mma(p_s, kl_st, acc * alpha_o[:, None], is_async=True)
        lsum, acc = warpgroup_mma_wait(num_outstanding=0, deps=[lsum, pv])
        l_i = l_i * alpha + gl.convert_layout(gl.max(lsum, 1), ROW_S)
        return acc, m_new, l_i

    @gluon.jit
    def _gather_block(kv_ptr, tbl_ptr, stride_kv, idx_ptr, t_q, stride_idx, pos, S, p_end, kl_st, kp_st,
                      C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, GL: gl.constexpr):
        """The keys at virtual positions pos [BN] of query t_q into one slot (cp.async row gathers: position p < S
        is slot p, S + k the k-th visible new slot idx[t_q, k]; past p_end slot S, weighted 0 by the mask); every
        warp's part in before it returns."""
        pg = gl.convert_layout(pos, gl.SliceLayout(1, GL))
        j = gl.load(idx_ptr + t_q.to(gl.int64) * stride_idx + (pg - S), mask=(pg < p_end) & (pg >= S), other=0)
        slot = gl.where(pg < S, pg, S + j)
        page = gl.load(tbl_ptr + slot // BN)   # paged cache: a page is BN slots
        row = kv_ptr + ((page.to(gl.int64) * BN + slot % BN) * stride_kv)[:, None]
        async_copy.async_copy_global_to_shared(kl_st, row + gl.arange(0, C, layout=gl.SliceLayout(0, GL))[None, :])
        async_copy.async_copy_global_to_shared(kp_st, row + C + gl.arange(0, R, layout=gl.SliceLayout(0, GL))[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        cta_barrier()

    @gluon.jit
    def _mla_verify_wg_kernel(ql_ptr, qp_ptr, lat_desc, pe_desc, kv_ptr, tbl_ptr, idx_ptr, nvis_ptr, po_ptr, pl_ptr,
                              s_ptr,
                              S, T, N, stride_qlt, stride_qln, stride_qpt, stride_qpn, stride_kv, stride_idx,
                              stride_pom, stride_poc, stride_plm, qk_scale,
                              C: gl.constexpr, R: gl.constexpr, CHUNK: gl.constexpr, BN: gl.constexpr,
                              STAGES: gl.constexpr, S_DEV: gl.constexpr, N_TAIL: gl.constexpr, PDL: gl.constexpr):
        # grid (row tiles, N_TAIL + prefix chunks): program_id(1) < N_TAIL is the tree tail's chunk
        # S // CHUNK + program_id(1) (N a multiple of 64: a tile is one query's heads, its keys gathered through
        # idx; first in the grid, so that they take SMs before the prefix programs), the others the whole prefix
        # chunk program_id(1) - N_TAIL of [0, S) (key tiles by TMA)
        if PDL:
            gl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        pid_m = gl.program_id(0)
        jc = gl.program_id(1)
        if S_DEV:
            S = gl.load(s_ptr).to(gl.int32)
        M: gl.constexpr = ROWS_C
        tail = jc < N_TAIL
        t_q = (pid_m * M) // N
        if tail:
            c = S // CHUNK + jc
            L = S + gl.load(nvis_ptr + t_q).to(gl.int32)
            p_end = gl.minimum(c * CHUNK + CHUNK, L)
        else:
            c = jc - N_TAIL
            L = S
            p_end = c * CHUNK + CHUNK
        p0 = c * CHUNK
        if p_end > L:
            return
        if p0 >= p_end:
            return
        n_blk = (p_end - p0 + BN - 1) // BN

        ACC_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
        ACC_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, C // 2, 16])
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 8, 16])
        ROW_S: gl.constexpr = gl.SliceLayout(1, ACC_S)
        ROW_O: gl.constexpr = gl.SliceLayout(1, ACC_O)
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
        GL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        Q_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        DT: gl.constexpr = lat_desc.dtype

        kl, kp, bars = key_ring(lat_desc, pe_desc, STAGES, BN, C, R)
        NBYTES: gl.constexpr = BN * (C + R) * 2
        if not tail:   # the first key tiles in flight before q is read (its load latency overlaps theirs)
            for i in gl.static_range(STAGES):
                if i < CHUNK // BN:
                    row = tile_row(tbl_ptr, p0 + i * BN, BN)
                    mbarrier.expect(bars.index(i), NBYTES)
                    tma_load(lat_desc, [row, 0], bars.index(i), kl.index(i))
                    tma_load(pe_desc, [row, 0], bars.index(i), kp.index(i))

        # this tile's 64 (query, head) rows of q (rows past T * N zero) into shared memory: the A operand
        q_lat, q_pe = load_q_rows(ql_ptr, qp_ptr, pid_m * M, T, N, stride_qlt, stride_qln, stride_qpt, stride_qpn,
                                  M, C, R, QL)
        ql_s = gl.allocate_shared_memory(DT, [M, C], Q_SL, q_lat)
        qp_s = gl.allocate_shared_memory(DT, [M, R], Q_SL, q_pe)
        p_s = gl.allocate_shared_memory(DT, [M, BN], Q_SL)
        ones_t = gl.allocate_shared_memory(DT, [16, BN], Q_SL, gl.full([16, BN], 1.0, DT, layout=QL))
        fence_async_shared()
        cta_barrier()           # q and the ones in shared memory (every warp's part) before the first MMA

        m_i = gl.full([M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.zeros([M], gl.float32, layout=ROW_S)
        acc = gl.zeros([M, C], gl.float32, layout=ACC_O)
        zs = gl.zeros([M, BN], gl.float32, layout=ACC_S)
        zl = gl.zeros([M, 16], gl.float32, layout=ACC_L)
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC_S))
        if tail:
            for j in range(n_blk):
                pos = p0 + j * BN + offs_n
                _gather_block(kv_ptr, tbl_ptr, stride_kv, idx_ptr, t_q, stride_idx, pos, S, p_end, kl.index(0),
                              kp.index(0), C, R, BN, GL)
                acc, m_i, l_i = _step(kl.index(0), kp.index(0), ql_s, qp_s, p_s, ones_t, zs, zl, acc, m_i, l_i, pos,
                                      L, qk_scale, ROW_S, ROW_O)
                cta_barrier()   # every warp is done with the slot and with P before they are rewritten
        else:
            for j in range(CHUNK // BN):
                st = j % STAGES
                mbarrier.wait(bars.index(st), (j // STAGES) & 1)
                acc, m_i, l_i = _step(kl.index(st), kp.index(st), ql_s, qp_s, p_s, ones_t, zs, zl, acc, m_i, l_i,
                                      p0 + j * BN + offs_n, L, qk_scale, ROW_S, ROW_O)
                cta_barrier()   # every warp is done with this slot and with P before they are rewritten
                if j + STAGES < CHUNK // BN:
                    row = tile_row(tbl_ptr, p0 + (j + STAGES) * BN, BN)
                    mbarrier.expect(bars.index(st), NBYTES)
                    tma_load(lat_desc, [row, 0], bars.index(st), kl.index(st))
                    tma_load(pe_desc, [row, 0], bars.index(st), kp.index(st))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        o = acc / gl.convert_layout(l_i, ROW_O)[:, None]
        r = pid_m * M + gl.arange(0, M, layout=ROW_O)
        d = gl.arange(0, C, layout=gl.SliceLayout(0, ACC_O))
        r64 = r.to(gl.int64)
        gl.store(po_ptr + r64[:, None] * stride_pom + c * stride_poc + d[None, :], o, mask=(r < T * N)[:, None])
        rl = pid_m * M + gl.arange(0, M, layout=ROW_S)
        gl.store(pl_ptr + rl.to(gl.int64) * stride_plm + c, m_i + gl.log2(l_i), mask=rl < T * N)


def launch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, page: int,
           po: torch.Tensor, pl: torch.Tensor, s_ptr: torch.Tensor, S: int, strides: tuple[int, int, int], qk_scale: float, chunk: int, n_ch: int,
           stages: int, s_dev: bool, pdl: dict, tail: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """One launch over the whole prefix chunks [0, n_ch) of a tree's T queries (q_lat [T, N, C], q_pe [T, N, R])
    against the request's slots, kv the key rows [rows, C + R] read through the block table (slot s at row
    table[s // page] * page + s % page; page == BLOCK_N); only whole chunks of [0, S) are computed (S from s_ptr when s_dev), their
    partials written to po / pl (strides = (row, chunk, lse row)). tail = (idx, nvis, n_tail): also the tree's own
    chunks S // CHUNK .. + n_tail (keys gathered through tree_gather_index's idx / nvis; N a multiple of 64)."""
    T, N, C = q_lat.shape
    R = q_pe.shape[2]
    idx, nvis, n_tail = tail if tail is not None else (s_ptr, s_ptr, 0)
    if n_tail and N % ROWS:
        raise ValueError(f"mla_verify_wg: a tail chunk needs whole {ROWS}-row tiles per query, N = {N}")
    if page != BLOCK_N:
        raise ValueError(f"mla_verify_wg: a key tile is one page of {BLOCK_N} slots, got pages of {page}")
    lat, pe = kv_descriptors(kv, C, R)
    _mla_verify_wg_kernel[(triton.cdiv(T * N, ROWS), n_tail + n_ch)](
        q_lat, q_pe, lat, pe, kv, table, idx, nvis, po, pl, s_ptr, S, T, N, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0),
        q_pe.stride(1), kv.stride(0), idx.stride(0) if n_tail else 0, *strides, qk_scale, C=C, R=R, CHUNK=chunk,
        BN=BLOCK_N, STAGES=stages, S_DEV=s_dev, N_TAIL=n_tail, num_warps=WARPS, **pdl)


__all__ = ["ROWS", "launch", "unsupported"]
