"""The dense fragment-ordered W4A16 GEMM with its words and scales copied by TMA into a ring of shared-memory
slots (Gluon, sm_90, GPU only; mma.sync programs of 4 warps over one 64-row tile of words).

The register kernel (w4_frag._frag_loop) keeps one K block of words in flight per program, in registers: at
16 tokens its 128 registers allow 4 programs per SM, whose bytes in flight bound the stream (Nsight: half the
issue slots idle, DRAM at 50%, bench/results/ncu-h200-notes.md). Here one thread of the program copies each
block's words [64, 4*GPB] and scales [64, GPB] with two TMA loads into slot j % STAGES (an mbarrier per
slot); STAGES blocks are in flight without registers, and the words arrive in whole 8 KB runs. Each warp then
reads its rows' words from the slot in the mma.sync A layout, and the block runs exactly as in _frag_loop:
the same dequantization, the same MMAs in the same order, so the same bits (tests/gpu/test_w4_frag_gpu.py).

Words: frag_tile's 64-row order (FRAG_TILE), seen as a [N * K / (32*GPB), 4*GPB] matrix whose rows
(tile * blocks + block) * 64 .. + 64 are one block of one tile. Scales: row-major [N, K/32].
"""

from __future__ import annotations

import torch

from kdtree_engine.kernels.w4_frag import (FRAG_TILE, HAVE_GLUON, LANES_T, X_LOADS, _log2, pdl_launch,
                                           word_layout)

try:  # Gluon exists in triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from kdtree_engine.kernels.w4_frag import (_dequant_frag, cta_barrier, mma_layout, operand_layout, pdl_wait_gl,
                                               x_layout)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # renamed in triton 3.7
    HAVE_TMA = HAVE_GLUON
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    HAVE_TMA = False

BN = FRAG_TILE     # weight rows per program: one tile of words, 4 warps x 16 rows


def word_layout_2d(gpb: int):
    """word_layout (4 warps, 1 tile per warp) over the [BN, 4*GPB] rows of a slot: column t*GPB + g."""
    regs = [[0, 1 << i] for i in range(_log2(gpb))] + [[8, 0]]
    lanes = [[0, gpb], [0, 2 * gpb], [1, 0], [2, 0], [4, 0]]
    warps = [[16, 0], [32, 0]]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [BN, LANES_T * gpb])


def tma_unsupported(N: int, K: int, gpb: int, tile: int, stages: int, tok: int) -> str | None:
    """Why the TMA-fed kernel cannot run this launch (None: it can)."""
    if not HAVE_TMA:
        return "triton without Gluon TMA"
    if tile != FRAG_TILE:
        return f"words in {tile}-row tiles (the TMA kernel reads {FRAG_TILE}-row tiles)"
    if gpb != 8 or K % 256:
        return f"gpb {gpb}, K = {K} (16-byte scale rows need gpb 8)"
    if N % BN:
        return f"{N} rows not a multiple of {BN}"
    if tok not in (8, 16):
        return f"{tok}-token programs (mma.sync: 8 or 16)"
    if not 2 <= stages <= 8:
        return f"{stages} stages (2 .. 8)"
    return None


if HAVE_TMA:
    ROWS = gl.constexpr(BN)

    @gluon.jit
    def _w4_frag_tma_kernel(x_ptr, w_desc, s_desc, out_ptr, M, stride_xm, stride_om, stride_os, kb_per_split, nblk_all,
                            TOK: gl.constexpr, GPB: gl.constexpr, W2L: gl.constexpr, WL: gl.constexpr,
                            X_SMEM: gl.constexpr, X_AHEAD: gl.constexpr, PDL: gl.constexpr, STAGES: gl.constexpr):
        """grid (cdiv(M, TOK), N / ROWS, splits): out[split, m, n] = sum over the split's k of x[m, k] W[n, k]."""
        BK: gl.constexpr = 32 * GPB
        MMA: gl.constexpr = mma_layout(4)
        AL: gl.constexpr = operand_layout(0, 4)
        BL: gl.constexpr = operand_layout(1, 4)
        XL: gl.constexpr = x_layout(BK, TOK, 4, X_SMEM)
        NBYTES: gl.constexpr = ROWS * GPB * 4 * 4 + ROWS * GPB * 2
        m0 = gl.program_id(0) * TOK
        tile = gl.program_id(1)
        n0 = tile * ROWS
        kb0 = gl.program_id(2) * kb_per_split
        wrow = (tile * nblk_all + kb0) * ROWS          # this program's first block in the [blocks * ROWS, 4*GPB] view
        nblk = kb_per_split

        ws = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 4 * GPB], w_desc.layout)
        ss = gl.allocate_shared_memory(gl.bfloat16, [STAGES, ROWS, GPB], s_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        cta_barrier()
        for i in gl.static_range(STAGES):   # the weights do not depend on the previous launch: before its wait
            ok = i < nblk
            mbarrier.expect(bars.index(i), NBYTES, pred=ok)
            tma_load(w_desc, [wrow + i * ROWS, 0], bars.index(i), ws.index(i), pred=ok)
            tma_load(s_desc, [n0, (kb0 + i) * GPB], bars.index(i), ss.index(i), pred=ok)
        if PDL:
            pdl_wait_gl()

        # activations as the B operand [BK, TOK] (x^T), tokens >= M read as 0 (as _w4_frag_kernel)
        rk = gl.arange(0, BK, layout=gl.SliceLayout(1, XL))
        rm = m0 + gl.arange(0, TOK, layout=gl.SliceLayout(0, XL))
        x_ptrs = x_ptr + gl.expand_dims(rm, 0) * stride_xm + gl.expand_dims(rk, 1) + kb0 * BK
        x_mask = gl.expand_dims(rm, 0) < M
        if X_AHEAD:
            xr = gl.load(x_ptrs, mask=x_mask, other=0.0)
        acc = gl.zeros([ROWS, TOK], gl.float32, layout=MMA)
        for j in range(nblk):
            st = j % STAGES
            mbarrier.wait(bars.index(st), (j // STAGES) & 1)
            a = ws.index(st).load(W2L)
            c = ss.index(st).load(gl.SliceLayout(1, WL))
            cta_barrier()                    # every warp has its words and scales of slot st in registers
            nxt = j + STAGES
            if nxt < nblk:
                mbarrier.expect(bars.index(st), NBYTES)
                tma_load(w_desc, [wrow + nxt * ROWS, 0], bars.index(st), ws.index(st))
                tma_load(s_desc, [n0, (kb0 + nxt) * GPB], bars.index(st), ss.index(st))
            a = gl.convert_layout(gl.reshape(a, [ROWS, 4, GPB]), WL, assert_trivial=True)
            a, c = gl.broadcast(a, gl.expand_dims(c, 1))
            if X_AHEAD:
                xb = gl.convert_layout(xr, BL)
                x_ptrs += BK
                if j + 1 < nblk:
                    xr = gl.load(x_ptrs, mask=x_mask, other=0.0)
            else:
                xb = gl.convert_layout(gl.load(x_ptrs, mask=x_mask, other=0.0), BL)
                x_ptrs += BK
            acc = mma_v2(_dequant_frag(a, c, AL, ROWS, BK), xb, acc)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        on = gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        om = m0 + gl.arange(0, TOK, layout=gl.SliceLayout(0, MMA))
        o_ptrs = out_ptr + gl.program_id(2) * stride_os + gl.expand_dims(om, 0) * stride_om + n0 + gl.expand_dims(on, 1)
        gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(om, 0) < M)


def descriptors(wq: torch.Tensor, s: torch.Tensor, gpb: int) -> tuple:
    """TMA descriptors of tiled words wq [N, K/8] (as [N * blocks, 4*GPB], one block of one tile per BN rows)
    and scales s [N, K/32] (blocks [BN, GPB])."""
    N, kw = wq.shape
    rows = N * (kw // (4 * gpb))
    wl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    wd = TensorDescriptor(wq, [rows, 4 * gpb], [4 * gpb, 1], [BN, 4 * gpb], wl)
    sd = TensorDescriptor(s, list(s.shape), [s.stride(0), 1], [BN, gpb], sl)
    return wd, sd


def launch(x: torch.Tensor, wq: torch.Tensor, s: torch.Tensor, part: torch.Tensor, tok: int, gpb: int, split: int,
           stages: int, xload: str, pdl: bool) -> None:
    """part [split, M, N] (or y [M, N] for split 1) = the split's partial x @ W^T (frag_linear's checks done)."""
    M, K = x.shape
    N = wq.shape[0]
    nblk = K // (32 * gpb)
    wd, sd = descriptors(wq, s, gpb)
    _w4_frag_tma_kernel[((M + tok - 1) // tok, N // BN, split)](
        x, wd, sd, part, M, x.stride(0), N, M * N, nblk // split, nblk,
        TOK=tok, GPB=gpb, W2L=word_layout_2d(gpb), WL=word_layout(4, 1, gpb), X_SMEM=X_LOADS[xload][0],
        X_AHEAD=X_LOADS[xload][1], STAGES=stages, num_warps=4, **pdl_launch(pdl))


__all__ = ["BN", "HAVE_TMA", "descriptors", "launch", "tma_unsupported", "word_layout_2d"]
