"""Decode launches of MLA attention (one query, or the whole prefix chunks of a small tree) on warpgroup MMAs
with TMA key tiles (Gluon, sm_90, GPU only).

The Triton chunk kernel (mla_attention.py) runs a decode launch of N = 8 heads on 16-row mma.sync tiles:
half of every tile is padding, each warp walks a 36-MMA score chain one dependent MMA at a time, and its
key copies issue an address and a predicate per 16 bytes; one warp per scheduler at ~4 cycles an
instruction is what bounds it (Nsight Compute). Here the keys sit on the MMA's M side:

    s^T [BN keys, NP] = K_lat [BN, C] @ q_lat^T [C, NP]  then  += K_pe [BN, R] @ q_pe^T [R, NP]
    l   [NP]          = l * alpha + (ones [64, BN] @ P^T [BN, NP])[0]
    o^T [DV, NP]      = o^T * alpha + K_lat[:, cols]^T [DV, BN] @ P^T [BN, NP]

(NP = 8, 16 or 32 (query, head) rows per program, the wgmma's N, more rows in more programs; one warpgroup;
the key tiles copied by TMA into a ring of STAGES slots, mbarrier-tracked). Per element this is the chunk
kernel's arithmetic with L_BY_DOT: the same 576-long fp32 score chain (latent, then rope) in k16 steps,
scale, -inf past the row's keys, exp2 against the running max, the row sum of the bf16 P by an MMA (its 64 equal
rows carried as a tile, one taken at the end), the rescaled accumulator as the P @ V MMA's addend, the same
partials (o = acc / l, lse = m + log2 l) for the same merge. The GPU tests hold it to the Triton decode launch bit for bit (tests/gpu/test_mla_attention_gpu.py).

Keys past the row's end inside a block are real cache slots (or the TMA's zero fill past the tensor)
weighted exactly 0, so they must be finite: the engine's latent cache pool is zero-initialised and only ever
holds written keys. The cache is paged (cache.py): a key tile is one page of PAGE = BLOCK_N slots, the tile
of slots p.. at pool row table[p // PAGE] * PAGE.
"""

from __future__ import annotations

import torch
import triton

from kdtree_engine.kernels.pdl import PDL_ASM

try:  # optional: Gluon exists in triton >= 3.5 (the kernels below need it; the launch checks do not)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed in triton 3.7
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # renamed in triton 3.7
    HAVE_GLUON = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

BLOCK_N = 64       # keys per step: one wgmma M tile (the config's BLOCK_N must match: the online-softmax step)


def rows_per_program(rows: int, most: int = 32) -> int:
    """(query, head) rows per program, the wgmma's N: 8, 16 or 32, at most `most` (more rows: more programs)."""
    return min(most, 8 if rows <= 8 else 16 if rows <= 16 else 32)


def unsupported(rows: int, C: int, R: int, dtype: torch.dtype, block_n: int, v_split: int, stages: int,
                most: int = 32) -> str | None:
    """Why a launch of `rows` (query, head) rows cannot run here (None: it can)."""
    if not HAVE_GLUON:
        return "triton without Gluon"
    if dtype != torch.bfloat16:   # the dtype its bit-equality GPU tests cover
        return f"dtype {dtype} (bf16 operands)"
    if block_n != BLOCK_N:
        return f"BLOCK_N {block_n} (the warpgroup tile is {BLOCK_N} keys)"
    if C != 512 or R != 64:       # K2's latent and rope widths, the shapes its GPU tests cover
        return f"C = {C}, R = {R} (C = 512, R = 64)"
    if v_split not in (1, 2, 4, 8) or (C // v_split) % 64:
        return f"V_SPLIT {v_split} (1, 2, 4 or 8 column slices of a multiple of 64)"
    if most not in (8, 16, 32):
        return f"{most} rows per program (8, 16 or 32)"
    np_ = rows_per_program(rows, most)
    smem = stages * BLOCK_N * (C + R) * 2 + np_ * (C + R) * 2 + np_ * BLOCK_N * 2
    if smem > 227 * 1024:
        return f"{stages} key slots with {np_}-row programs need {smem // 1024} KB of shared memory"
    return None


if HAVE_GLUON:
    WAIT_ASM = gl.constexpr(PDL_ASM)

    @gluon.jit
    def _scores(kl_st, kp_st, ql_s, qp_s, zs, qk_scale):
        """Scaled s^T [BN, NP] of one key slot: the latent then the rope MMA chain (the chunk kernel's order)."""
        s = warpgroup_mma(kl_st, ql_s.permute((1, 0)), zs, use_acc=False, is_async=True)
        s = warpgroup_mma(kp_st, qp_s.permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=[s]) * qk_scale

    @gluon.jit
    def key_ring(lat_desc, pe_desc, STAGES: gl.constexpr, BN: gl.constexpr, C: gl.constexpr, R: gl.constexpr):
        """A ring of STAGES key slots (latent [BN, C] and rope [BN, R] tiles in the TMA descriptors' layouts) and
        their mbarriers, initialised and visible to every warp."""
        kl = gl.allocate_shared_memory(lat_desc.dtype, [STAGES, BN, C], lat_desc.layout)
        kp = gl.allocate_shared_memory(pe_desc.dtype, [STAGES, BN, R], pe_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        cta_barrier()
        return kl, kp, bars

    @gluon.jit
    def load_q_rows(ql_ptr, qp_ptr, row0, T, N, stride_qlt, stride_qln, stride_qpt, stride_qpn,
                    ROWS: gl.constexpr, C: gl.constexpr, R: gl.constexpr, QL: gl.constexpr):
        """(query, head) rows row0 .. row0 + ROWS of q (t-major: row = t * N + h) as [ROWS, C] / [ROWS, R] in QL,
        rows past T * N zero."""
        rw = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, QL))
        cq = gl.arange(0, C, layout=gl.SliceLayout(0, QL))
        rq = gl.arange(0, R, layout=gl.SliceLayout(0, QL))
        r_ok = rw < T * N
        tq = (rw // N).to(gl.int64)
        hq = (rw % N).to(gl.int64)
        q_lat = gl.load(ql_ptr + (tq * stride_qlt + hq * stride_qln)[:, None] + cq[None, :], mask=r_ok[:, None],
                        other=0.0)
        q_pe = gl.load(qp_ptr + (tq * stride_qpt + hq * stride_qpn)[:, None] + rq[None, :], mask=r_ok[:, None],
                       other=0.0)
        return q_lat, q_pe

    @gluon.jit
    def _probs(s, m_i, pos, L, p_s):
        """One online-softmax step on the scaled s^T [BN, NP] (keys at positions pos, -inf from L on): P^T into
        p_s, every warp's part in before it returns; (alpha, the new running max)."""
        s = gl.where((pos < L)[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        pr = gl.exp2(s - m_new[None, :])
        p_s.store(gl.permute(pr.to(p_s.dtype), (1, 0)))
        fence_async_shared()
        cta_barrier()           # every warp's part of P is in before the warpgroup reads it
        return alpha, m_new

    @gluon.jit
    def _pv(k_lat, p_s, acc, pid_v, DV: gl.constexpr, VS: gl.constexpr):
        """o^T [DV, NP] = acc + this slice's columns of the latent tile^T @ P^T, issued and not waited for."""
        if VS == 1:
            tok = warpgroup_mma(k_lat.permute((1, 0)), p_s.permute((1, 0)), acc, is_async=True)
        else:
            tok = warpgroup_mma_init(acc)
            for vv in gl.static_range(VS):   # this slice's columns of the latent tile (constant offsets)
                if pid_v == vv:
                    tok = warpgroup_mma(k_lat.slice(vv * DV, DV, dim=1).permute((1, 0)), p_s.permute((1, 0)), tok,
                                        is_async=True)
        return tok

    @gluon.jit
    def tile_row(tbl_ptr, p, BN: gl.constexpr):
        """Pool row of the key tile of slots p .. p + BN - 1 (p a multiple of BN, one page)."""
        return gl.load(tbl_ptr + p // BN) * BN

    @gluon.jit
    def _refill(lat_desc, pe_desc, tbl_ptr, kl, kp, bars, st, p0, nxt, n_blk, BN: gl.constexpr,
                NBYTES: gl.constexpr):
        """Key block nxt (if there is one) into slot st."""
        if nxt < n_blk:
            row = tile_row(tbl_ptr, p0 + nxt * BN, BN)
            mbarrier.expect(bars.index(st), NBYTES)
            tma_load(lat_desc, [row, 0], bars.index(st), kl.index(st))
            tma_load(pe_desc, [row, 0], bars.index(st), kp.index(st))

    @gluon.jit
    def _mla_decode_wg_kernel(ql_ptr, qp_ptr, lat_desc, pe_desc, tbl_ptr, po_ptr, pl_ptr, out_ptr, s_ptr,
                              S, T, N, stride_qlt, stride_qln, stride_qpt, stride_qpn, stride_pom, stride_poc,
                              stride_plm, stride_ot, stride_on, stride_tb, qk_scale,
                              C: gl.constexpr, R: gl.constexpr, NP: gl.constexpr, DV: gl.constexpr,
                              VS: gl.constexpr, CHUNK: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                              CAUSAL: gl.constexpr, DIRECT: gl.constexpr, S_DEV: gl.constexpr,
                              PDL: gl.constexpr):
        # grid (row groups x V_SPLIT, chunks): the slices of one group adjacent (their key tiles hit L2).
        # CAUSAL: one query (T = 1) over [0, S] (itself included); else the whole prefix chunks of a tree's
        # T queries over [0, S) (the tree's own keys are the chunk kernel's gather launch)
        # grid axis 2: the slot of a launch over several requests' slots (one each: its T queries, table row,
        # device length, partial and output rows), the programs of each the ones its own launch would run
        if PDL:
            gl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        b = gl.program_id(2).to(gl.int64)
        ql_ptr += b * T * stride_qlt
        qp_ptr += b * T * stride_qpt
        tbl_ptr += b * stride_tb
        s_ptr += b
        po_ptr += b * T * N * stride_pom
        pl_ptr += b * T * N * stride_plm
        out_ptr += b * T * stride_ot
        pid_g = gl.program_id(0) // VS
        pid_v = gl.program_id(0) % VS
        c = gl.program_id(1)
        if S_DEV:
            S = gl.load(s_ptr).to(gl.int32)
            if not CAUSAL:
                if (c + 1) * CHUNK > S:
                    return
        L = S + 1 if CAUSAL else S
        p0 = c * CHUNK
        if p0 >= L:
            return
        p_end = gl.minimum(p0 + CHUNK, L)
        n_blk = (p_end - p0 + BN - 1) // BN

        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NP, 16])
        ROW: gl.constexpr = gl.SliceLayout(0, ACC)     # [NP]: per head
        KEY: gl.constexpr = gl.SliceLayout(1, ACC)     # [BN] / [DV]: per key / output column
        ONES: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        Q_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        DT: gl.constexpr = lat_desc.dtype

        # the first key tiles in flight before q is read (its load latency overlaps theirs)
        kl, kp, bars = key_ring(lat_desc, pe_desc, STAGES, BN, C, R)
        NBYTES: gl.constexpr = BN * (C + R) * 2
        for i in gl.static_range(STAGES):
            ok = i < n_blk
            row = tile_row(tbl_ptr, gl.minimum(p0 + i * BN, p0 + (n_blk - 1) * BN), BN)  # a page of the request
            mbarrier.expect(bars.index(i), NBYTES, pred=ok)
            tma_load(lat_desc, [row, 0], bars.index(i), kl.index(i), pred=ok)
            tma_load(pe_desc, [row, 0], bars.index(i), kp.index(i), pred=ok)

        # this group's NP (query, head) rows of q [NP, C] / [NP, R] (rows past T * N zero) into shared memory:
        # the MMAs' B operand (K-major, transposed)
        q_lat, q_pe = load_q_rows(ql_ptr, qp_ptr, pid_g * NP, T, N, stride_qlt, stride_qln, stride_qpt, stride_qpn,
                                  NP, C, R, QL)
        ql_s = gl.allocate_shared_memory(DT, [NP, C], Q_SL, q_lat)
        qp_s = gl.allocate_shared_memory(DT, [NP, R], Q_SL, q_pe)
        p_s = gl.allocate_shared_memory(DT, [NP, BN], Q_SL)
        fence_async_shared()
        cta_barrier()           # q in shared memory (every warp's part) before the first MMA reads it

        m_i = gl.full([NP], float("-inf"), gl.float32, layout=ROW)
        # the row sums as the ones-MMA's [64, NP] tile, its 64 rows equal (the same products in the same order);
        # each row carries the chunk kernel's l = l * alpha + rowsum(P) step for step, one row is taken at the end
        # (no cross-warp reduction per block)
        l_t = gl.zeros([64, NP], gl.float32, layout=ACC)
        acc = gl.zeros([DV, NP], gl.float32, layout=ACC)
        ones = gl.full([64, BN], 1.0, DT, layout=ONES)
        zs = gl.zeros([BN, NP], gl.float32, layout=ACC)
        zl = gl.zeros([64, NP], gl.float32, layout=ACC)
        offs_n = gl.arange(0, BN, layout=KEY)
        for j in range(n_blk):
            st = j % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            s = _scores(kl.index(st), kp.index(st), ql_s, qp_s, zs, qk_scale)
            alpha, m_new = _probs(s, m_i, p0 + j * BN + offs_n, L, p_s)
            # the row sums and P @ V issued together, one wait (their results as before: l = l * alpha + rowsum)
            lsum = warpgroup_mma(ones, p_s.permute((1, 0)), zl, use_acc=False, is_async=True)
            pv = _pv(kl.index(st), p_s, acc * alpha[None, :], pid_v, DV, VS)
            lsum, acc = warpgroup_mma_wait(num_outstanding=0, deps=[lsum, pv])
            l_t = l_t * alpha[None, :] + lsum
            m_i = m_new
            cta_barrier()           # every warp is done with this slot and with P before they are rewritten
            _refill(lat_desc, pe_desc, tbl_ptr, kl, kp, bars, st, p0, j + STAGES, n_blk, BN, NBYTES)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        l_i = gl.max(l_t, 0)                            # every row the same: the max picks one
        o = acc / l_i[None, :]                          # [DV, NP]
        r = pid_g * NP + gl.arange(0, NP, layout=ROW)
        d = pid_v * DV + gl.arange(0, DV, layout=KEY)
        ok = (r < T * N)[None, :] & (d < C)[:, None]
        r64 = r.to(gl.int64)
        if DIRECT:
            o_row = (r64 // N) * stride_ot + (r64 % N) * stride_on
            gl.store(out_ptr + o_row[None, :] + d[:, None], o.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            gl.store(po_ptr + r64[None, :] * stride_pom + c * stride_poc + d[:, None], o, mask=ok)
            if pid_v == 0:
                gl.store(pl_ptr + r64 * stride_plm + c, m_i + gl.log2(l_i), mask=r < T * N)


def kv_descriptors(kv: torch.Tensor, C: int, R: int) -> tuple:
    """TMA descriptors of the latent [rows, C] and rope [rows, R] parts of the key rows kv [rows, C + R] (a
    contiguous buffer or a pool layer's pages; keys past its rows read as zeros), in BLOCK_N-key tiles."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    rows, stride = kv.shape[0], kv.stride(0)
    lat = TensorDescriptor(kv, [rows, C], [stride, 1], [BLOCK_N, C], layout)
    pe = TensorDescriptor(kv[:, C:], [rows, R], [stride, 1], [BLOCK_N, R], layout)
    return lat, pe


def launch(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, page: int, po, pl, out,
           s_ptr, S: int,
           strides: tuple[int, int, int], qk_scale: float, chunk: int, n_ch: int, v_split: int, stages: int,
           causal: bool, direct: bool, s_dev: bool, pdl: dict, most_rows: int = 32, slots: int = 1) -> None:
    """One launch over chunks [0, n_ch) of the request's slots, kv the key rows [rows, C + R] read through the block
    table (slot s at row table[s // page] * page + s % page; page == BLOCK_N): q_lat [T, N, C], q_pe [T, N, R] (causal:
    T = 1 over [0, S]; else a tree's T queries over the whole chunks of [0, S)); partials (po, pl with
    `strides` = (row, chunk, lse row)) or, direct, out [T, N, C]. Programs of up to `most_rows` (query, head)
    rows. ``slots`` > 1: that many requests side by side (q_lat / out rows and partial rows in slot order, table
    [slots, W] a row each, s_ptr a device length each), each request's programs those of its own launch."""
    T, N, C = q_lat.shape
    R = q_pe.shape[2]
    if page != BLOCK_N:
        raise ValueError(f"mla_decode_wg: a key tile is one page of {BLOCK_N} slots, got pages of {page}")
    if T % slots or (slots > 1 and (table.dim() != 2 or table.shape[0] != slots)):
        raise ValueError(f"mla_decode_wg: {T} query rows and a table of {tuple(table.shape)} do not make {slots} slots")
    T //= slots
    np_ = rows_per_program(T * N, most_rows)
    lat, pe = kv_descriptors(kv, C, R)
    _mla_decode_wg_kernel[(triton.cdiv(T * N, np_) * v_split, n_ch, slots)](
        q_lat, q_pe, lat, pe, table, po, pl, out, s_ptr, S, T, N, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0),
        q_pe.stride(1), *strides, out.stride(0), out.stride(1), table.stride(0) if slots > 1 else 0, qk_scale,
        C=C, R=R, NP=np_, DV=C // v_split,
        VS=v_split, CHUNK=chunk, BN=BLOCK_N, STAGES=stages, CAUSAL=causal, DIRECT=direct, S_DEV=s_dev, num_warps=4,
        **pdl)


__all__ = ["BLOCK_N", "HAVE_GLUON", "key_ring", "kv_descriptors", "launch", "load_q_rows", "rows_per_program",
           "tile_row", "unsupported"]
