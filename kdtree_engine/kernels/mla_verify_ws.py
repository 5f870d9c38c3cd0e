"""Prefix launches of MLA tree verify on warpgroup MMAs with warp specialization (Gluon, sm_90, GPU only):
the same programs, grid and bits as mla_verify_wg.py, without a CTA-wide barrier in the key loop.

mla_verify_wg.py splits one 64-row tile between two warpgroups by keys (scores) and by columns (P @ V), so
every key block exchanges P and the row statistics through shared memory under CTA barriers (Nsight Compute:
MIO throttle, 19% issue, bench/results/ncu-h200-srcstall.md). Here each consumer warpgroup owns half of the
output columns and computes the whole score tile itself, so nothing crosses warpgroups but the key ring:

    partition      warps  per key block j (slot j % STAGES)
    consumer 0     4      wait ready;  s [64, BN] = q_lat @ K_lat^T + q_pe @ K_pe^T   (the full tile, in registers)
    consumer 1     4                   online softmax on its own copy of s (row max / sum inside the warpgroup)
                                       l += P [64, BN] (registers) @ ones [BN, 16];  o[:, half] += P @ K_lat[:, half]
                                       arrive free
    producer       4      wait free; refill the slot: TMA tiles (whole prefix chunks) or cp.async row gathers
                          (the tree's own chunks, keys through tree_gather_index's idx), then arrive ready

The score MMAs run twice (once per consumer): 1.5x the tensor work of the split tile, traded for no P
exchange, no cross-warpgroup reductions and the two warpgroups drifting apart so that one's softmax overlaps
the other's MMAs. Per element the arithmetic is mla_verify_wg's (the 576-long fp32 score chain in k16 steps,
scale, exp2 against the running max, the bf16 P's row sum by an MMA, the rescaled accumulator as the P @ V
addend; the instruction's N size and the A operand's source do not change an element's bits), so the
partials equal its partials bit for bit (tests/gpu/test_mla_attention_gpu.py).

Shared memory: q 72 KB + STAGES x 72 KB of key tiles + ones 2 KB (two slots: 218 KB of the 227).
Registers: 12 warps at launch (the producer's 4 rounded up as a warpgroup), 168 a thread, rebalanced by
setmaxnreg to 232 for each consumer warpgroup and 40 for the producer (the default partition).
"""

from __future__ import annotations

import torch
import triton

from kdtree_engine.kernels.mla_decode_wg import BLOCK_N, HAVE_GLUON, kv_descriptors
from kdtree_engine.kernels.pdl import PDL_ASM

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed in triton 3.7
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # renamed in triton 3.7

ROWS = 64          # (query, head) rows per program: one wgmma M tile
WARPS = 4          # the default partition (the producer); the two consumer warpgroups add 4 + 4
MAXNREG = 168      # registers a thread at launch (12 warps); setmaxnreg moves them to the consumers
CONSUMER_REGS = 232   # each consumer warpgroup; the producer (the default partition) keeps the rest: 40


def unsupported(C: int, R: int, dtype: torch.dtype, block_n: int, stages: int) -> str | None:
    """Why a warp-specialized verify launch cannot run here (None: it can)."""
    if not HAVE_GLUON or not hasattr(gl, "warp_specialize"):
        return "triton without Gluon warp specialization"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (bf16 operands)"
    if block_n != BLOCK_N:
        return f"BLOCK_N {block_n} (the warpgroup tile is {BLOCK_N} keys)"
    if C != 512 or R != 64:
        return f"C = {C}, R = {R} (C = 512, R = 64)"
    smem = (ROWS + stages * BLOCK_N) * (C + R) * 2 + 16 * BLOCK_N * 2   # q, keys, ones
    if stages < 1 or smem > 227 * 1024:
        return f"{stages} key slots need {smem // 1024} KB of shared memory"
    return None


if HAVE_GLUON:
    WAIT_ASM = gl.constexpr(PDL_ASM)
    ROWS_C = gl.constexpr(ROWS)
    REGS_C = gl.constexpr(CONSUMER_REGS)

    @gluon.jit
    def _consume(ql_s, qp_s, ones_t, kl, kp, ready, free, turn, po_ptr, pl_ptr, row0, TN, c, p0, L, n_blk,
                 stride_pom, stride_poc, stride_plm, qk_scale, COL0: gl.constexpr, C: gl.constexpr,
                 BN: gl.constexpr, STAGES: gl.constexpr):
        """One consumer warpgroup: the whole score tile of every key block, output columns COL0 .. COL0 + C / 2.
        The two consumers take turns to issue their score MMAs (turn[me] / turn[other]), so that one's MMAs run
        while the other is in its softmax."""
        ME: gl.constexpr = 0 if COL0 == 0 else 1
        M: gl.constexpr = ROWS_C
        DV: gl.constexpr = C // 2
        ACC_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        ACC_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
        ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
        P_O: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_O, k_width=2)
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC_L, k_width=2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, ACC_S)
        ROW_O: gl.constexpr = gl.SliceLayout(1, ACC_O)
        m_i = gl.full([M], float("-inf"), gl.float32, layout=ROW_S)
        l_i = gl.zeros([M], gl.float32, layout=ROW_S)
        acc = gl.zeros([M, DV], gl.float32, layout=ACC_O)
        zs = gl.zeros([M, BN], gl.float32, layout=ACC_S)
        zl = gl.zeros([M, 16], gl.float32, layout=ACC_L)
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC_S))
        for j in range(n_blk):
            st = j % STAGES
            mbarrier.wait(ready.index(st), (j // STAGES) & 1)
            kl_st = kl.index(st)
            mbarrier.wait(turn.index(ME), j & 1)
            s = warpgroup_mma(ql_s, kl_st.permute((1, 0)), zs, use_acc=False, is_async=True)
            s = warpgroup_mma(qp_s, kp.index(st).permute((1, 0)), s, is_async=True)
            mbarrier.arrive(turn.index(1 - ME), count=1)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s]) * qk_scale
            s = gl.where((p0 + j * BN + offs_n < L)[None, :], s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 1))
            alpha = gl.exp2(m_i - m_new)
            p16 = gl.exp2(s - m_new[:, None]).to(ql_s.dtype)
            lsum = warpgroup_mma(gl.convert_layout(p16, P_L), ones_t.permute((1, 0)), zl, use_acc=False,
                                 is_async=True)
            alpha_o = gl.convert_layout(alpha, ROW_O)
            pv = warpgroup_mma(gl.convert_layout(p16, P_O), kl_st.slice(COL0, DV, dim=1), acc * alpha_o[:, None],
                               is_async=True)
            lsum, acc = warpgroup_mma_wait(num_outstanding=0, deps=[lsum, pv])
            cta_barrier()   # every warp of this warpgroup is done with the slot
            mbarrier.arrive(free.index(st), count=1)
            l_i = l_i * alpha + gl.convert_layout(gl.max(lsum, 1), ROW_S)
            m_i = m_new
        o = acc / gl.convert_layout(l_i, ROW_O)[:, None]
        r = row0 + gl.arange(0, M, layout=ROW_O)
        d = COL0 + gl.arange(0, DV, layout=gl.SliceLayout(0, ACC_O))
        gl.store(po_ptr + r.to(gl.int64)[:, None] * stride_pom + c * stride_poc + d[None, :], o,
                 mask=(r < TN)[:, None])
        if COL0 == 0:
            rl = row0 + gl.arange(0, M, layout=ROW_S)
            gl.store(pl_ptr + rl.to(gl.int64) * stride_plm + c, m_i + gl.log2(l_i), mask=rl < TN)

    @gluon.jit
    def _consume_lo(a, b, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        _consume(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14],
                 a[15], a[16], a[17], a[18], a[19], 0, C, BN, STAGES)

    @gluon.jit
    def _consume_hi(a, b, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        _consume(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14],
                 a[15], a[16], a[17], a[18], a[19], C // 2, C, BN, STAGES)

    @gluon.jit
    def _produce(a, b, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
        """The producer warpgroup: refills each slot once both consumers freed it (TMA tiles of a whole prefix
        chunk, or the tree tail's keys gathered row by row: position p < S is slot p, S + k the k-th visible new
        slot idx[t_q, k], past p_end slot S, weighted 0 by the mask)."""
        kl = a[3]
        kp = a[4]
        ready = a[5]
        free = a[6]
        p0 = a[13]
        n_blk = a[15]
        lat_desc, pe_desc, kv_ptr, idx_ptr, stride_kv, stride_idx, t_q, S, p_end, tail = b
        if tail:
            GL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            offs = gl.arange(0, BN, layout=gl.SliceLayout(1, GL))
            for j in range(n_blk):
                st = j % STAGES
                mbarrier.wait(free.index(st), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
                pg = p0 + j * BN + offs
                k = gl.load(idx_ptr + t_q.to(gl.int64) * stride_idx + (pg - S), mask=(pg < p_end) & (pg >= S),
                            other=0)
                slot = gl.where(pg < S, pg, S + k)
                row = kv_ptr + (slot.to(gl.int64) * stride_kv)[:, None]
                async_copy.async_copy_global_to_shared(
                    kl.index(st), row + gl.arange(0, C, layout=gl.SliceLayout(0, GL))[None, :])
                async_copy.async_copy_global_to_shared(
                    kp.index(st), row + C + gl.arange(0, R, layout=gl.SliceLayout(0, GL))[None, :])
                async_copy.commit_group()
                async_copy.wait_group(0)
                fence_async_shared()
                cta_barrier()   # every producer warp's rows are in
                mbarrier.arrive(ready.index(st), count=1)
        else:
            NBYTES: gl.constexpr = BN * (C + R) * 2
            for j in range(STAGES, n_blk):   # the first STAGES tiles went out before the partitions forked
                st = j % STAGES
                mbarrier.wait(free.index(st), ((j // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(st), NBYTES)
                tma_load(lat_desc, [p0 + j * BN, 0], ready.index(st), kl.index(st))
                tma_load(pe_desc, [p0 + j * BN, 0], ready.index(st), kp.index(st))

    @gluon.jit
    def _mla_verify_ws_kernel(ql_ptr, qp_ptr, lat_desc, pe_desc, kv_ptr, idx_ptr, nvis_ptr, po_ptr, pl_ptr, s_ptr,
                              S, T, N, stride_qlt, stride_qln, stride_qpt, stride_qpn, stride_kv, stride_idx,
                              stride_pom, stride_poc, stride_plm, qk_scale,
                              C: gl.constexpr, R: gl.constexpr, CHUNK: gl.constexpr, BN: gl.constexpr,
                              STAGES: gl.constexpr, S_DEV: gl.constexpr, N_TAIL: gl.constexpr, PDL: gl.constexpr):
        # grid and programs as mla_verify_wg._mla_verify_wg_kernel: program_id(1) < N_TAIL is the tree tail's chunk
        # S // CHUNK + program_id(1) (keys gathered through idx), the others the whole prefix chunk
        # program_id(1) - N_TAIL of [0, S) (key tiles by TMA)
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

        QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        Q_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        DT: gl.constexpr = lat_desc.dtype
        kl = gl.allocate_shared_memory(DT, [STAGES, BN, C], lat_desc.layout)
        kp = gl.allocate_shared_memory(DT, [STAGES, BN, R], pe_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        mbarrier.arrive(turn.index(0), count=1)   # consumer 0 issues the first score MMAs
        fence_async_shared()
        cta_barrier()
        NBYTES: gl.constexpr = BN * (C + R) * 2
        if not tail:   # the first key tiles in flight before q is read (its load latency overlaps theirs)
            for i in gl.static_range(STAGES):
                if i < CHUNK // BN:
                    mbarrier.expect(ready.index(i), NBYTES)
                    tma_load(lat_desc, [p0 + i * BN, 0], ready.index(i), kl.index(i))
                    tma_load(pe_desc, [p0 + i * BN, 0], ready.index(i), kp.index(i))

        # this tile's 64 (query, head) rows of q (rows past T * N zero) into shared memory in R-wide column slices
        # (the whole [64, 576] tile at once would spill the default partition's registers)
        rw = pid_m * M + gl.arange(0, M, layout=gl.SliceLayout(1, QL))
        r_ok = (rw < T * N)[:, None]
        tq = (rw // N).to(gl.int64)
        hq = (rw % N).to(gl.int64)
        cq = gl.arange(0, R, layout=gl.SliceLayout(0, QL))[None, :]
        ql_s = gl.allocate_shared_memory(DT, [M, C], Q_SL)
        for k in gl.static_range(C // R):
            ql_s.slice(k * R, R, dim=1).store(
                gl.load(ql_ptr + (tq * stride_qlt + hq * stride_qln)[:, None] + (k * R + cq), mask=r_ok, other=0.0))
        qp_s = gl.allocate_shared_memory(DT, [M, R], Q_SL,
                                         gl.load(qp_ptr + (tq * stride_qpt + hq * stride_qpn)[:, None] + cq,
                                                 mask=r_ok, other=0.0))
        ones_t = gl.allocate_shared_memory(DT, [16, BN], Q_SL, gl.full([16, BN], 1.0, DT, layout=QL))
        fence_async_shared()
        cta_barrier()           # q and the ones in shared memory before the partitions fork

        a = (ql_s, qp_s, ones_t, kl, kp, ready, free, turn, po_ptr, pl_ptr, pid_m * M, T * N, c, p0, L, n_blk,
             stride_pom, stride_poc, stride_plm, qk_scale)
        b = (lat_desc, pe_desc, kv_ptr, idx_ptr, stride_kv, stride_idx, t_q, S, p_end, tail)
        gl.warp_specialize([(_produce, (a, b, C, R, BN, STAGES)), (_consume_lo, (a, b, C, R, BN, STAGES)),
                            (_consume_hi, (a, b, C, R, BN, STAGES))], [4, 4], [REGS_C, REGS_C])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(free.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(turn.index(i))


def launch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, rows: int, po: torch.Tensor, pl: torch.Tensor,
           s_ptr: torch.Tensor, S: int, strides: tuple[int, int, int], qk_scale: float, chunk: int, n_ch: int,
           stages: int, s_dev: bool, pdl: dict, tail: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """mla_verify_wg.launch's contract on the warp-specialized kernel."""
    T, N, C = q_lat.shape
    R = q_pe.shape[2]
    idx, nvis, n_tail = tail if tail is not None else (s_ptr, s_ptr, 0)
    if n_tail and N % ROWS:
        raise ValueError(f"mla_verify_ws: a tail chunk needs whole {ROWS}-row tiles per query, N = {N}")
    lat, pe = kv_descriptors(kv, rows, C, R)
    _mla_verify_ws_kernel[(triton.cdiv(T * N, ROWS), n_tail + n_ch)](
        q_lat, q_pe, lat, pe, kv, idx, nvis, po, pl, s_ptr, S, T, N, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0),
        q_pe.stride(1), kv.stride(0), idx.stride(0) if n_tail else 0, *strides, qk_scale, C=C, R=R, CHUNK=chunk,
        BN=BLOCK_N, STAGES=stages, S_DEV=s_dev, N_TAIL=n_tail, num_warps=WARPS, maxnreg=MAXNREG, **pdl)


__all__ = ["ROWS", "launch", "unsupported"]
