"""Fragment-ordered W4A16 GEMM (GPU only): the packed weights are loaded straight into the
registers of an mma.sync A operand, dequantized there, and never pass through shared memory.
Programs of more than 16 tokens use the same registers as the A operand of a warpgroup MMA (wgmma, one
warpgroup per program), with the activations its shared-memory B operand (frag_loop_wg); wgmma and mma.sync
give the same bits.

The default kernel (`kdtree_engine/kernels/w4a16.py`) dequantizes a tile in registers, stores it to shared
memory and reloads it in the MMA's operand layout: ~5 bytes of shared-memory traffic per weight, the limit
Nsight Compute shows (the L1/shared pipe, not DRAM, is the limit). Here the weights are the MMA's A operand
(y^T = W x^T: 16 weight rows per m16n8k16 tile, the tokens are the 8 or 16 columns) and a one-off repack
(`frag_repack`, kernels/layouts.py with the rest of the word order, in plain torch) orders each row's
nibbles so that one 32-bit word holds exactly the 8 codes that one thread's A fragments need for one
quantization group:

    repacked word t*GPB + g of a block of GPB groups (32*GPB k), thread lane = 4*r + t:
      nibble j   (j = 0..3) <- k = 32*g + 16*(j >> 1) + 8*(j & 1) + 2*t
      nibble j+4            <- that k + 1

so that `(w >> 4j) & 0x000F000F` is the bf16x2 pair (k, k+1) of one A register. A thread's GPB words of a
block are contiguous (one 16-byte load for GPB = 4). Dequantization is 2 instructions per weight pair
(lop3 into bf16 128 + code, sub 136, mul by the group scale: the same bf16 rounding as q * s).

Activations (the B operand, [32*GPB, 8 or 16 tokens] per block) read in the mma.sync B layout would cost every
warp one 4-byte load per pair of values; they are loaded 16 bytes per thread instead (x_layout), one block
ahead like the weights, and relabelled into the B layout through shared memory (LDSM reads).

Written in Gluon (triton.experimental.gluon), whose explicit layouts let the dequantized tensor be
relabelled into the MMA operand layout without data movement (checked at compile time:
`convert_layout(..., assert_trivial=True)`). Gluon kernels do not run in the CPU interpreter; the repack
is tested on the CPU (tests/kernels/test_w4_frag_repack.py), the kernels on the GPU
(tests/gpu/test_w4_frag_gpu.py) against the torch reference; `python3 bench/w4_frag.py` times them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kdtree_engine.kernels.pdl import PDL_ASM, pdl_launch, pdl_supported
from kdtree_engine.kernels.split_sum import Partition, stream_sum
from kdtree_engine.kernels.w4_dequant import BF16X2_PTX
from kdtree_engine.kernels.layouts import GROUP, LANES_T, frag_gpb, tile_unsupported
from kdtree_engine.logs import log_once

# the MMAs of a dense program (DenseLaunch.mma): mma.sync, or wgmma with the activations in shared memory
MMAS = ("sync", "wgmma")


# ---------------------------------------------------------------------------------------------- kernel
try:  # optional: Gluon exists in triton >= 3.5; the kernels need it, the word order (layouts.py) does not
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
    from triton.runtime.jit import constexpr_function
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed in triton 3.7
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False




if HAVE_GLUON:
    DEQ_ASM = gl.constexpr(BF16X2_PTX)   # output j = nibble j (w4_dequant.py)
    # the two activation buffers [2, TOK, BK] bf16 of frag_loop_wg (the wgmma B operand, 128-byte swizzle)
    WG_X_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
    WAIT_ASM = gl.constexpr(PDL_ASM)

    @constexpr_function
    def mma_layout(num_warps):
        """The mma.sync accumulator layout: warps stacked over 16-row weight tiles."""
        return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])

    @constexpr_function
    def operand_layout(index, num_warps):
        """Register layout of mma.sync operand `index` (0: weights A, 1: activations B)."""
        return gl.DotOperandLayout(operand_index=index, parent=mma_layout(num_warps), k_width=2)

    @constexpr_function
    def wg_layout(tok, num_warps=4):
        """The wgmma accumulator layout: 64 weight rows x tok tokens (m64 n{tok} k16) per warpgroup, the
        warpgroups (num_warps / 4) stacked over the rows."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, tok, 16])

    @constexpr_function
    def wg_a_layout(tok, num_warps=4):
        """Register layout of the wgmma A operand (the dequantized weights): per warp the mma.sync A fragments
        of its 16 rows."""
        return gl.DotOperandLayout(operand_index=0, parent=wg_layout(tok, num_warps), k_width=2)

    @constexpr_function
    def wg_x_layout(bk, num_warps=4):
        """Load layout of an activation block [TOK, BK] for its shared-memory copy: 8 consecutive k per thread."""
        lanes_k = max(1, min(32, bk // 8))
        return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes_k, lanes_k],
                                warps_per_cta=[num_warps, 1], order=[1, 0])

    @constexpr_function
    def x_layout(bk, num_warps):
        """Load layout of an activation block [BK, TOK]: 8 consecutive k (16 bytes) per thread, a warp's lanes
        along k first, relabelled into the B operand through shared memory (read in the B layout directly,
        every warp would issue one 4-byte load per pair of values)."""
        lanes_k = max(1, min(32, bk // 8))
        return gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[lanes_k, 32 // lanes_k],
                                warps_per_cta=[1, num_warps], order=[0, 1])


def _log2(v: int) -> int:
    assert v > 0 and v & (v - 1) == 0, v
    return v.bit_length() - 1


def word_layout(num_warps: int, gpb: int):
    """Linear layout of the [BN, 4, GPB] word tensor: the rows and lanes of the mma.sync A operand (one 16-row
    MMA tile per warp)."""
    bn = 16 * num_warps
    regs = [[0, 0, 1 << i] for i in range(_log2(gpb))] + [[8, 0, 0]]
    lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warps = [[16 << i, 0, 0] for i in range(_log2(num_warps))]
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [bn, LANES_T, gpb])


if HAVE_GLUON:
    @gluon.jit
    def _dequant_frag(w, s, AL: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
        """words [BN, 4, GPB] int32 + their group scales (bf16, same layout) -> A operand [BN, BK] bf16."""
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            DEQ_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, s],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        p0 = gl.join(o0, o4)                       # [BN, 4, GPB, 2(b)]     pair j = 0: tile 0, low 8 k
        p1 = gl.join(o1, o5)                       # j = 1: tile 0, k + 8
        p2 = gl.join(o2, o6)                       # j = 2: tile 1
        p3 = gl.join(o3, o7)                       # j = 3: tile 1, k + 8
        h0 = gl.join(p0, p1)                       # [BN, 4, GPB, 2(b), 2(hi)]
        h1 = gl.join(p2, p3)
        a = gl.join(h0, h1)                        # [BN, 4, GPB, 2(b), 2(hi), 2(tile)]
        a = gl.permute(a, (0, 2, 5, 4, 1, 3))      # [BN, GPB, tile, hi, t, b]: k = 32g + 16tile + 8hi + 2t + b
        a = gl.reshape(a, [BN, BK])
        return gl.convert_layout(a, AL, assert_trivial=True)   # a relabelling: no data moves

    @gluon.jit
    def word_ptrs(w_ptr, s_ptr, row0, stride_wn, stride_sn, kb0,
                   WL: gl.constexpr, BN: gl.constexpr, GPB: gl.constexpr, TILE: gl.constexpr,
                   STILE: gl.constexpr = 0):
        """Pointers of block kb0 of rows row0 .. row0+BN: words [BN, 4, GPB], scales (same for the 4 t).
        Words row-major [N, K/8] (TILE 0) or in frag_tile's order (each block of TILE rows contiguous, a row's
        words of a block chunk-major where GPB > 4); scales row-major [N, K/32] (STILE 0) or in scale_tile's
        order (each block of STILE rows contiguous, [STILE, GPB])."""
        rn = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, WL)))
        rt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, WL)))
        rg = gl.arange(0, GPB, layout=gl.SliceLayout(0, gl.SliceLayout(1, WL)))
        n3 = gl.expand_dims(gl.expand_dims(rn, 1), 2) + row0
        t3 = gl.expand_dims(gl.expand_dims(rt, 0), 2)
        g3 = gl.expand_dims(gl.expand_dims(rg, 0), 1)
        if STILE == 0:
            s_ptrs = s_ptr + n3 * stride_sn + g3 + t3 * 0 + kb0 * GPB
        else:
            s_ptrs = (s_ptr + (n3 // STILE) * (STILE * stride_sn) + (n3 % STILE) * GPB + g3 + t3 * 0
                      + kb0 * (STILE * GPB))
        if TILE == 0:
            w_ptrs = w_ptr + n3 * stride_wn + t3 * GPB + g3 + kb0 * (4 * GPB)
        else:
            if GPB > 4:   # frag_chunks: a row's words of a block chunk-major, [g // 4][t][g % 4]
                wo = (g3 // 4) * 16 + t3 * 4 + g3 % 4
            else:
                wo = t3 * GPB + g3
            w_ptrs = (w_ptr + (n3 // TILE) * (TILE * stride_wn) + (n3 % TILE) * (4 * GPB) + wo
                      + kb0 * (TILE * 4 * GPB))
        return w_ptrs, s_ptrs

    @gluon.jit
    def pdl_wait_gl():
        """pdl.pdl_wait in Gluon kernels: wait for the previous launch, release the next one."""
        gl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _load_words(w0, s0, w1, s1, TWO: gl.constexpr):
        """One block's words and scales of the A0 operand and, with TWO, of A1 (else A1 aliases A0: unused)."""
        a0 = gl.load(w0)
        c0 = gl.load(s0)
        if TWO:
            a1 = gl.load(w1)
            c1 = gl.load(s1)
        else:
            a1 = a0
            c1 = c0
        return a0, c0, a1, c1

    @gluon.jit
    def frag_loop(acc0, acc1, w0, s0, w1, s1, x_ptrs, x_mask, nblk,
                  TWO: gl.constexpr, AL: gl.constexpr, BL: gl.constexpr,
                  BN: gl.constexpr, GPB: gl.constexpr, WAIT: gl.constexpr, TILE: gl.constexpr,
                  PAIRS: gl.constexpr = False, STILE: gl.constexpr = 0):
        """acc0 (+ acc1 with TWO) += A0 (A1) @ x over nblk blocks of 32*GPB k, in k order. One block of
        words, scales and activations is in flight ahead of the one in use (the activations' load issued after
        the current block's relabel into BL). x_ptrs / x_mask: in x_layout (relabelled through shared memory).
        WAIT: the first block's weights are requested before pdl_wait, the activations after it. TILE: the
        words' order (word_ptrs), which sets the step from one block to the next. PAIRS: two blocks per trip,
        the words in flight alternating between two named register sets instead of being moved into place
        after every block (fewer instructions per block for 8-token programs; 16-token ones would spill)."""
        BK: gl.constexpr = 32 * GPB
        WSTEP: gl.constexpr = 4 * GPB * (TILE if TILE else 1)   # words from one block to the next
        SSTEP: gl.constexpr = GPB * (STILE if STILE else 1)     # scales (word_ptrs)
        a0, c0, a1, c1 = _load_words(w0, s0, w1, s1, TWO)
        if WAIT:
            pdl_wait_gl()
        xr = gl.load(x_ptrs, mask=x_mask, other=0.0)
        if PAIRS:
            for _ in range((nblk - 1) // 2):
                b0, d0, b1, d1 = _load_words(w0 + WSTEP, s0 + SSTEP, w1 + WSTEP, s1 + SSTEP, TWO)
                xb, xr, x_ptrs = _x_step(xr, x_ptrs, x_mask, BK, BL)
                acc0, acc1 = _mma_block(acc0, acc1, a0, c0, a1, c1, xb, TWO, AL, BN, BK)
                w0 += 2 * WSTEP
                s0 += 2 * SSTEP
                w1 += 2 * WSTEP
                s1 += 2 * SSTEP
                a0, c0, a1, c1 = _load_words(w0, s0, w1, s1, TWO)
                xb, xr, x_ptrs = _x_step(xr, x_ptrs, x_mask, BK, BL)
                acc0, acc1 = _mma_block(acc0, acc1, b0, d0, b1, d1, xb, TWO, AL, BN, BK)
        for _ in range((nblk - 1) % 2 if PAIRS else nblk - 1):   # one block per trip (PAIRS: an odd one left)
            w0 += WSTEP
            s0 += SSTEP
            w1 += WSTEP
            s1 += SSTEP
            n_a0, n_c0, n_a1, n_c1 = _load_words(w0, s0, w1, s1, TWO)
            xb, xr, x_ptrs = _x_step(xr, x_ptrs, x_mask, BK, BL)
            acc0, acc1 = _mma_block(acc0, acc1, a0, c0, a1, c1, xb, TWO, AL, BN, BK)
            a0 = n_a0
            c0 = n_c0
            a1 = n_a1
            c1 = n_c1
        xb = gl.convert_layout(xr, BL)
        acc0, acc1 = _mma_block(acc0, acc1, a0, c0, a1, c1, xb, TWO, AL, BN, BK)
        return acc0, acc1

    @gluon.jit
    def _x_step(xr, x_ptrs, x_mask, BK: gl.constexpr, BL: gl.constexpr):
        """The activations of the block in use (xr held them), in BL, the pointers moved on a block and the
        next block's load issued."""
        xb = gl.convert_layout(xr, BL)
        x_ptrs += BK
        xr = gl.load(x_ptrs, mask=x_mask, other=0.0)
        return xb, xr, x_ptrs

    @gluon.jit
    def _mma_block(acc0, acc1, a0, c0, a1, c1, xb, TWO: gl.constexpr, AL: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr):
        """One block's MMAs: acc0 += dequant(a0, c0) @ xb (and acc1 with a1, c1 under TWO)."""
        acc0 = mma_v2(_dequant_frag(a0, c0, AL, BN, BK), xb, acc0)
        if TWO:
            acc1 = mma_v2(_dequant_frag(a1, c1, AL, BN, BK), xb, acc1)
        return acc0, acc1

    @gluon.jit
    def frag_loop_wg(acc0, acc1, w0, s0, w1, s1, x_ptrs, x_mask, nblk, xs,
                      TWO: gl.constexpr, AL: gl.constexpr, BN: gl.constexpr, GPB: gl.constexpr,
                      WAIT: gl.constexpr, TILE: gl.constexpr, STILE: gl.constexpr = 0):
        """acc0 (+ acc1 with TWO) [64, TOK] += A0 (A1) @ x over nblk blocks, by wgmma: the dequantized weights
        are the register A operand (the same fragments as mma.sync's), the activation block [TOK, BK] the
        shared-memory B operand (xs: two buffers), read by the tensor cores for the whole warpgroup. One block
        of words, scales and activations in flight ahead of the one in use. The MMA is synchronous (the
        asynchronous forms measured no faster: docs/performance_history.md)."""
        BK: gl.constexpr = 32 * GPB
        WSTEP: gl.constexpr = 4 * GPB * (TILE if TILE else 1)
        SSTEP: gl.constexpr = GPB * (STILE if STILE else 1)
        a0, c0, a1, c1 = _load_words(w0, s0, w1, s1, TWO)
        if WAIT:
            pdl_wait_gl()
        xr = gl.load(x_ptrs, mask=x_mask, other=0.0)
        for i in range(nblk - 1):
            buf = xs.index(i % 2)
            buf.store(xr)
            w0 += WSTEP
            s0 += SSTEP
            w1 += WSTEP
            s1 += SSTEP
            x_ptrs += BK
            n_a0, n_c0, n_a1, n_c1 = _load_words(w0, s0, w1, s1, TWO)
            xr = gl.load(x_ptrs, mask=x_mask, other=0.0)
            fence_async_shared()
            cta_barrier()
            acc0 = warpgroup_mma(_dequant_frag(a0, c0, AL, BN, BK), buf.permute((1, 0)), acc0)
            a0 = n_a0
            c0 = n_c0
            if TWO:
                acc1 = warpgroup_mma(_dequant_frag(a1, c1, AL, BN, BK), buf.permute((1, 0)), acc1)
                a1 = n_a1
                c1 = n_c1
        buf = xs.index((nblk - 1) % 2)
        buf.store(xr)
        fence_async_shared()
        cta_barrier()
        acc0 = warpgroup_mma(_dequant_frag(a0, c0, AL, BN, BK), buf.permute((1, 0)), acc0)
        if TWO:
            acc1 = warpgroup_mma(_dequant_frag(a1, c1, AL, BN, BK), buf.permute((1, 0)), acc1)
        return acc0, acc1

    @gluon.jit
    def stream_program_gl(block, work, programs):
        """stream_program in the kernel: the program whose range holds global K block `block`."""
        return ((block + 1) * programs - 1) // work

    @gluon.jit
    def _w4_frag_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn,
                        stride_om, stride_os, iters, work, programs,
                        TOK: gl.constexpr, GPB: gl.constexpr, WL: gl.constexpr,
                        PDL: gl.constexpr, TILE: gl.constexpr,
                        PT: gl.constexpr, SEGS: gl.constexpr, num_warps: gl.constexpr,
                        WG: gl.constexpr = False, PAIRS: gl.constexpr = False, STILE: gl.constexpr = 0):
        """grid (cdiv(M, TOK), programs): the stream partition of the work = (N / PT) x iters K blocks, row
        tile major (dense_partition), each PT-row tile in passes of BN rows. Program p takes global blocks
        [p * work // programs, (p + 1) * work // programs); each run of them within one row tile (a segment) is
        one partial, written to out[slot, m, n] with slot its index among the tile's segments (stream_sum adds
        a tile's slots alone). The partition is fixed by the shape, never by M. The token tiles of one weight
        range are adjacent program ids: they run together and the weights are read from DRAM about once.
        PDL: launched dependent on the kernel that wrote x (pdl.py). PAIRS: frag_loop's two blocks per trip
        (mma.sync)."""
        BN: gl.constexpr = 16 * num_warps
        BK: gl.constexpr = 32 * GPB
        MMA: gl.constexpr = wg_layout(TOK, num_warps) if WG else mma_layout(num_warps)
        XW: gl.constexpr = wg_x_layout(BK, num_warps)                # wgmma: activations [TOK, BK] to smem
        AL: gl.constexpr = operand_layout(0, num_warps)              # mma.sync: the A / B operands
        BL: gl.constexpr = operand_layout(1, num_warps)
        XL: gl.constexpr = x_layout(BK, num_warps)                   # mma.sync: activations [BK, TOK]
        m0 = gl.program_id(0) * TOK
        p = gl.program_id(1)
        g = p * work // programs
        end = (p + 1) * work // programs
        if WG:
            xs = gl.allocate_shared_memory(gl.bfloat16, [2, TOK, BK], WG_X_SMEM)
        for _seg in gl.static_range(SEGS):   # unrolled: a loop over segments costs ~30 registers (ptxas)
            if g < end:
                t = g // iters
                b0 = g - t * iters
                nb = gl.minimum(iters - b0, end - g)
                slot = p - stream_program_gl(t * iters, work, programs)
                for h in gl.static_range(PT // BN):   # the partition's row tile in passes of BN rows
                    row0 = t * PT + h * BN
                    w_ptrs, s_ptrs = word_ptrs(w_ptr, s_ptr, row0, stride_wn, stride_sn, b0, WL, BN, GPB, TILE,
                                                STILE)
                    acc = gl.zeros([BN, TOK], gl.float32, layout=MMA)
                    if WG:
                        # activations [TOK, BK] (k contiguous) into shared memory, the wgmma B operand as its
                        # transpose
                        rk = gl.arange(0, BK, layout=gl.SliceLayout(0, XW))
                        rm = m0 + gl.arange(0, TOK, layout=gl.SliceLayout(1, XW))
                        x_ptrs = x_ptr + gl.expand_dims(rm, 1) * stride_xm + gl.expand_dims(rk, 0) + b0 * BK
                        cta_barrier()   # the buffers' last reader (another warpgroup's MMA) is done
                        acc, unused = frag_loop_wg(acc, acc, w_ptrs, s_ptrs, w_ptrs, s_ptrs, x_ptrs,
                                                   gl.expand_dims(rm, 1) < M, nb, xs, False,
                                                   wg_a_layout(TOK, num_warps), BN, GPB, PDL, TILE, STILE)
                    else:
                        # activations as the B operand [BK, TOK] (x^T), tokens >= M read as 0
                        rk = gl.arange(0, BK, layout=gl.SliceLayout(1, XL))
                        rm = m0 + gl.arange(0, TOK, layout=gl.SliceLayout(0, XL))
                        x_ptrs = x_ptr + gl.expand_dims(rm, 0) * stride_xm + gl.expand_dims(rk, 1) + b0 * BK
                        acc, unused = frag_loop(acc, acc, w_ptrs, s_ptrs, w_ptrs, s_ptrs, x_ptrs,
                                                 gl.expand_dims(rm, 0) < M, nb, False, AL, BL, BN, GPB,
                                                 PDL, TILE, PAIRS, STILE)
                    # y[m, n] = acc[n, m]
                    on = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
                    om = m0 + gl.arange(0, TOK, layout=gl.SliceLayout(0, MMA))
                    o_mask = gl.expand_dims(om, 0) < M
                    o_ptrs = out_ptr + gl.expand_dims(om, 0) * stride_om + row0 + gl.expand_dims(on, 1)
                    gl.store(o_ptrs + slot * stride_os, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
                g += nb


DENSE_PARTITION_ROWS = 64      # rows of a partition tile = a program's rows (DENSE_WARPS warps of one 16-row MMA tile)
DENSE_WARPS = DENSE_PARTITION_ROWS // 16
DENSE_WARPS_PER_SM = 16        # stream partition of a dense matrix: one wave of 16 warps per SM (4 programs of the
                               # 16-token tile's 128 registers) ...
DENSE_MIN_BLOCKS = 4           # ... and at least this many 64-row K blocks per program
DENSE_MAX_SEGMENTS = 4         # row tiles one program may touch (its segments are unrolled)


def dense_plan(N: int, K: int, sms: int) -> tuple[int, int]:
    """(gpb, programs) of the dense kernel for an [N, K] weight on a device of `sms` SMs: fixed by the shape and
    the device, never by M (the partition is part of the reduction). A stream partition (dense_partition) of
    DENSE_PARTITION_ROWS-row tiles over one wave of DENSE_WARPS_PER_SM warps per SM with at least
    DENSE_MIN_BLOCKS K blocks per program: tile-aligned K splits left a partial wave (docs/performance_history.md)."""
    gpb = frag_gpb(K)
    return gpb, stream_programs(N // DENSE_PARTITION_ROWS, K // (32 * gpb), sms * DENSE_WARPS_PER_SM // DENSE_WARPS)


def stream_programs(tiles: int, iters: int, wanted: int) -> int:
    """Programs of a stream partition of tiles x iters K blocks: `wanted`, but at least DENSE_MIN_BLOCKS blocks
    each and at most two tiles of blocks each (<= 3 segments), never more than the blocks."""
    work = tiles * iters
    return min(work, max(1, min(wanted, work // DENSE_MIN_BLOCKS), -(-tiles // 2)))


def stream_program(block: int, work: int, programs: int) -> int:
    """The program whose range [p * work // programs, (p + 1) * work // programs) holds global K block `block`
    (the kernels' stream_program_gl)."""
    return ((block + 1) * programs - 1) // work


@functools.lru_cache(maxsize=256)
def dense_partition(tiles: int, iters: int, programs: int) -> tuple[int, int]:
    """(slots, segments) of the stream partition of tiles x iters K blocks (row tile major) over `programs`
    programs, program p taking blocks [p * work // programs, (p + 1) * work // programs), cut at tile ends
    into segments: slots, the most programs that share one tile (each tile's partials are added in program
    order by stream_sum); segments, the most tiles one program touches (the kernel's unrolled segments).
        programs = tiles * s (s | iters)  -> (s, 1): the tile-aligned split of s K ranges per tile"""
    work = tiles * iters
    if not 1 <= programs <= work:
        raise ValueError(f"dense_partition: programs must be in 1..{work} (row tiles x K blocks), got {programs}")
    if work * programs >= 2 ** 31:
        raise ValueError(f"dense_partition: {tiles} tiles x {iters} blocks x {programs} programs overflow int32")
    slots = max(stream_program(t * iters + iters - 1, work, programs) - stream_program(t * iters, work, programs) + 1
                for t in range(tiles))
    segments = max((((p + 1) * work // programs) - 1) // iters - (p * work // programs) // iters + 1
                   for p in range(programs))
    if segments > DENSE_MAX_SEGMENTS:
        raise ValueError(f"dense_partition: {programs} programs over {tiles} tiles x {iters} blocks touch up to "
                         f"{segments} tiles each (at most {DENSE_MAX_SEGMENTS}: the kernel unrolls them)")
    # logged once per partition (this function is cached)
    log_once(f"stream-partition:{tiles}:{iters}:{programs}", f"fragment W4A16 stream partition: {tiles} row tiles x "
             f"{iters} K blocks over {programs} programs (partials per tile: {slots}, segments per program: "
             f"{segments})")
    return slots, segments


def token_tile(M: int) -> int:
    """Token columns per program: 8 or 16 on mma.sync (each warp holds its [32*GPB x tile] activation operand in
    registers: 32 columns spill at GPB 8), 32 or 64 on wgmma (the activations a shared-memory operand of the
    warpgroup); more tokens take more programs, each reading the weights. A column's sum does not depend on the
    tile or the instruction (tests/gpu/test_w4_frag_gpu.py: wgmma and mma.sync give the same bits)."""
    for tok in (8, 16, 32):
        if M <= tok:
            return tok
    return 64


def token_mma(tok: int) -> str:
    """The MMA instruction of a token tile: mma.sync up to 16 tokens (synchronous wgmma does not overlap the
    dequantization), wgmma beyond (16-token mma.sync programs would dequantize each weight once per 16 tokens)."""
    return "sync" if tok <= 16 else "wgmma"


def token_pairs(tok: int) -> bool:
    """Whether the mma.sync loop of a token tile runs two blocks per trip (frag_loop PAIRS): 8-token programs
    (fewer instructions per block; 16-token ones would spill)."""
    return tok == 8


@dataclass(frozen=True)
class DenseLaunch:
    """One launch of the dense fragment kernel: the stream partition (gpb, programs: part of the reduction), the
    token tile and its MMA instruction (re-tiling only: the same bits), and the order of the words / scales
    (tile / stile: 0 row-major, else the rows per tile of frag_tile / scale_tile; the same bits)."""
    gpb: int
    programs: int
    tok: int
    mma: str
    tile: int = 0
    stile: int = 0

    def __post_init__(self) -> None:
        if self.mma not in MMAS:
            raise ValueError(f"DenseLaunch.mma must be one of {MMAS}, got {self.mma!r}")
        if self.tok not in (8, 16, 32, 64) or (self.mma == "sync" and self.tok > 16):
            raise ValueError(f"DenseLaunch: {self.tok} tokens per program on {self.mma} (mma.sync: 8 or 16; wgmma: "
                             "8 / 16 / 32 / 64)")


def dense_launch(M: int, N: int, K: int, sms: int, tile: int = 0, stile: int = 0) -> DenseLaunch:
    """The engine's launch of an [M, K] x [N, K]^T product on a device of `sms` SMs (dense_plan, token_tile,
    token_mma)."""
    gpb, programs = dense_plan(N, K, sms)
    tok = token_tile(M)
    return DenseLaunch(gpb=gpb, programs=programs, tok=tok, mma=token_mma(tok), tile=tile, stile=stile)


def dense_constexprs(launch: DenseLaunch, segs: int) -> dict:
    """The constexpr arguments of one _w4_frag_kernel launch (PDL aside), as frag_linear launches it
    (bench/frag_aot.py compiles the same offline)."""
    return dict(TOK=launch.tok, GPB=launch.gpb, WL=word_layout(DENSE_WARPS, launch.gpb), TILE=launch.tile,
                PT=DENSE_PARTITION_ROWS, SEGS=segs, num_warps=DENSE_WARPS, WG=launch.mma != "sync",
                PAIRS=token_pairs(launch.tok), STILE=launch.stile)


def frag_linear(x: torch.Tensor, wq: torch.Tensor, s: torch.Tensor, *, tile: int = 0, stile: int = 0,
                launch: DenseLaunch | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T, W the fragment-repacked int4 words wq [N, K/8] (frag_repack at frag_gpb(K)) and
    bf16 scales s [N, K/32]; x bfloat16. tile / stile: the words' / scales' order (0 row-major, else the rows per
    tile of frag_tile / scale_tile; the engine's ENGINE_ORDER). launch: instead of the engine's (dense_launch),
    e.g. another partition or token tile in the tests (tile / stile then come from it). Dependent launches of
    the GEMM and its partial sum where the device has them (pdl.py). The bits depend on the partition alone."""
    if not HAVE_GLUON:
        raise RuntimeError("the fragment-ordered W4A16 kernels need triton.experimental.gluon (triton >= 3.5)")
    M, K = x.shape
    N = wq.shape[0]
    if x.dtype != torch.bfloat16:
        raise TypeError(f"frag_linear: bfloat16 activations required, got {x.dtype}")
    if launch is None:
        launch = dense_launch(M, N, K, torch.cuda.get_device_properties(x.device).multi_processor_count, tile, stile)
    pt = bn = DENSE_PARTITION_ROWS
    bk = 32 * launch.gpb
    why = tile_unsupported(N, launch.tile, bn) or tile_unsupported(N, launch.stile, bn)
    if why:
        raise ValueError(f"frag_linear: {why}")
    if N % bn or K % bk or wq.shape[1] * 8 != K or s.shape != (N, K // GROUP):
        raise ValueError(f"frag_linear: N={N} must be a multiple of {bn}, K={K} of {bk}; words "
                         f"{tuple(wq.shape)}, scales {tuple(s.shape)}")
    tiles, iters = N // pt, K // bk
    slots, segs = dense_partition(tiles, iters, launch.programs)
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    x = x.contiguous()
    pdl = pdl_supported(x.device)
    part = y if slots == 1 else torch.empty((slots, M, N), device=x.device, dtype=torch.float32)
    _w4_frag_kernel[(triton.cdiv(M, launch.tok), launch.programs)](
        x, wq, s, part, M, N, x.stride(0), wq.stride(0), s.stride(0), N, M * N, iters, tiles * iters,
        launch.programs, **dense_constexprs(launch, segs), **pdl_launch(pdl))
    if slots > 1:
        stream_sum(part, y, slots, Partition(pt, tiles, iters, launch.programs), pdl=pdl)
    return y
