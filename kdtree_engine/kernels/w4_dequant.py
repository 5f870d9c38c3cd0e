"""Tile dequantization for the tensor-core W4A16 kernels (w4a16.py, moe_w4a16.py).

`load_dequant` returns the weight tile [BLOCK_N, BLOCK_K] in k order, ready for tl.dot. How the
nibbles become numbers is the constexpr DEQ (W4Config.DEQUANT / MoEConfig.DEQUANT):

  DEQ_FLOAT  per element, fp32: 0x4B000000 | u read as float32 is 2^23 + u, so one OR and one FADD
             give u - 8; times the group scale (broadcast from [BN, BK/g]); cast to the compute dtype.
  DEQ_BF16X2 (bf16 activations only) two elements per instruction, in inline PTX (sm_90): per packed
             word, (w >> 4p) & 0x000F000F | 0x43004300 holds the bf16 pair (128 + u_p, 128 + u_{p+4});
             sub.bf16x2 136 leaves (u - 8) exactly, mul.bf16x2 by the word's group scale rounds once,
             exactly like DEQ_FLOAT's fp32 product cast to bf16 (the product of a 4-bit integer and a
             bf16 scale is exact in fp32), so both give bitwise equal tiles. About 2 instructions per
             element against ~8 for DEQ_FLOAT (SASS of sm_90 builds, bench/kernels_aot.py).
  DEQ_BF16X2_EMU the same numbers and plane order as DEQ_BF16X2 in plain Triton: what TRITON_INTERPRET
             runs in place of the PTX (the interpreter cannot run inline assembly).

Tile column order. DEQ_FLOAT re-interleaves the 8 nibble planes of a packed column into k order with
three levels of tl.join (register-only). The bf16x2 variants keep the PTX's register pairs (plane p,
plane p+4) adjacent instead, so packing the tile for the MMA needs no byte permutes: within each 8
columns the tile holds k = 0 4 1 5 2 6 3 7, and the caller passes its activations with columns in that
same order (`pair_order` on the host, once per call; `pair_pos` for an epilogue that writes the next
GEMM's input), so the activation loads stay contiguous. The dot is a sum over k, so the order only
changes the (fixed, M-independent) reduction order: DEQUANT is part of a config's reduction key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEQ_FLOAT = 0
DEQ_BF16X2 = 1
DEQ_BF16X2_EMU = 2
DEQUANTS = {"float": DEQ_FLOAT, "bf16x2": DEQ_BF16X2}

# one packed word + its group scale (bf16 bits) -> the 8 dequantized bf16 values (bits), output j = nibble j:
# (0x4300 | code) is bf16 128 + code, minus 136 is q = code - 8 exactly, times s rounds once (RN). Also the
# dequant of the fragment-ordered kernels (w4_frag.py)
BF16X2_PTX = """
{
.reg .b32 q0, q1, q2, q3, ss, bias;
mov.b32 ss, {$9, $9};
mov.b32 bias, 0x43084308;
lop3.b32 q0, $8, 0x000F000F, 0x43004300, 0xEA;
shr.u32 q1, $8, 4;
lop3.b32 q1, q1, 0x000F000F, 0x43004300, 0xEA;
shr.u32 q2, $8, 8;
lop3.b32 q2, q2, 0x000F000F, 0x43004300, 0xEA;
shr.u32 q3, $8, 12;
lop3.b32 q3, q3, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 q0, q0, bias;
sub.rn.bf16x2 q1, q1, bias;
sub.rn.bf16x2 q2, q2, bias;
sub.rn.bf16x2 q3, q3, bias;
mul.rn.bf16x2 q0, q0, ss;
mul.rn.bf16x2 q1, q1, ss;
mul.rn.bf16x2 q2, q2, ss;
mul.rn.bf16x2 q3, q3, ss;
mov.b32 {$0, $4}, q0;
mov.b32 {$1, $5}, q1;
mov.b32 {$2, $6}, q2;
mov.b32 {$3, $7}, q3;
}
"""
_BF16X2_ASM = tl.constexpr(BF16X2_PTX)


@triton.jit
def _join8(p0, p1, p2, p3, p4, p5, p6, p7, ROWS: tl.constexpr, COLS8: tl.constexpr):
    """8 planes [ROWS, COLS8] (plane j = element j of each packed column) -> [ROWS, COLS8*8], k order."""
    # the first join pairs (j, j+4), the second (j, j+2), the last (j, j+1): flat index = j
    q = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    return tl.reshape(q, (ROWS, COLS8 * 8))


def pair_order(x: torch.Tensor) -> torch.Tensor:
    """[M, K] -> [M, K] with the columns of each 8 in the order 0 4 1 5 2 6 3 7 (a copy)."""
    M, K = x.shape
    return x.reshape(M, K // 8, 2, 4).transpose(2, 3).reshape(M, K)


@triton.jit
def pair_pos(k, DEQ: tl.constexpr):
    """Where column k lands in `pair_order` (identity for DEQ_FLOAT)."""
    if DEQ == 0:
        return k
    return (k & ~7) | ((k & 3) << 1) | ((k >> 2) & 1)


@triton.jit
def _pair8(p0, p1, p2, p3, p4, p5, p6, p7, ROWS: tl.constexpr, COLS8: tl.constexpr):
    """8 planes [ROWS, COLS8] -> [ROWS, COLS8*8] with columns (per packed column) 0 4 1 5 2 6 3 7."""
    # a join's new axis is the last one, so the innermost join is the most significant bit of the flat
    # index: inner (j, j+2), then (j, j+1), outer (j, j+4)
    q = tl.join(tl.join(tl.join(p0, p2), tl.join(p1, p3)), tl.join(tl.join(p4, p6), tl.join(p5, p7)))
    return tl.reshape(q, (ROWS, COLS8 * 8))


@triton.jit
def _unpack8(w, ROWS: tl.constexpr, COLS8: tl.constexpr):
    """int32 [ROWS, COLS8] packed nibbles -> int32 [ROWS, COLS8*8] values u in [0, 15], k order."""
    return _join8(w & 0xF, (w >> 4) & 0xF, (w >> 8) & 0xF, (w >> 12) & 0xF,
                  (w >> 16) & 0xF, (w >> 20) & 0xF, (w >> 24) & 0xF, (w >> 28) & 0xF, ROWS, COLS8)


@triton.jit
def _plane_bf16(w, s, J: tl.constexpr):
    """Plane J of packed words w as bf16 (u - 8) * s, rounded once (the emulation of the PTX)."""
    f = (((w >> (4 * J)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return (f * s).to(tl.bfloat16)


@triton.jit
def load_dequant(w_ptr, s_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, k_end,
                  G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
                  DEQ: tl.constexpr = 0, EVEN: tl.constexpr = False):
    """Dequantized weight tile [BLOCK_N, BLOCK_K] (DTYPE) for rows offs_n, k in [k0, k0+BLOCK_K).

    w_ptr / s_ptr point at row 0 of this matrix (expert offset already applied). Out-of-range k or n
    give 0 (scale 0). EVEN: the caller guarantees every row and k of the tile is in range (no masks)."""
    BK8: tl.constexpr = BLOCK_K // 8
    # k0 is a multiple of BLOCK_K (every caller steps from a multiple of it): telling the compiler lets
    # the weight and scale tiles go through 16-byte asynchronous copies, pipelined like the rest; without
    # it the scale tile (2-byte elements) is a synchronous load inside the K loop.
    offs_k8 = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, BK8), BK8), BK8)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k8[None, :]
    wmask = n_mask[:, None] & (offs_k8[None, :] * 8 < k_end)
    if EVEN:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs, mask=wmask, other=0, eviction_policy="evict_first")
    # the group scales of the tile, [BN, BK/G], contiguous per row (an asynchronous copy like the weights)
    NG: tl.constexpr = BLOCK_K // G
    offs_g = tl.max_contiguous(tl.multiple_of(k0 // G + tl.arange(0, NG), NG), NG)
    s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :]
    if EVEN:
        sg = tl.load(s_ptrs)
    else:
        sg = tl.load(s_ptrs, mask=n_mask[:, None] & (offs_g[None, :] * G < k_end), other=0.0)
    if DEQ == 0:
        s = tl.reshape(tl.broadcast_to(sg.to(tl.float32)[:, :, None], (BLOCK_N, NG, G)), (BLOCK_N, BLOCK_K))
        q = _unpack8(w, BLOCK_N, BK8)
        # 0x4B000000 | u is the float 2^23 + u; subtracting 2^23 + 8 leaves u - 8 exactly
        f = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        return (f * s).to(DTYPE)
    else:
        # one scale per packed word (its group): the group scales broadcast in registers
        s = tl.reshape(tl.broadcast_to(sg[:, :, None], (BLOCK_N, NG, G // 8)), (BLOCK_N, BK8))
        if DEQ == 1:
            p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
                _BF16X2_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [w, s.to(tl.int16, bitcast=True)],
                dtype=(tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16, tl.int16),
                is_pure=True, pack=1)
            q = _pair8(p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N, BK8)
            return q.to(tl.bfloat16, bitcast=True)
        else:
            sf = s.to(tl.float32)
            return _pair8(_plane_bf16(w, sf, 0), _plane_bf16(w, sf, 1), _plane_bf16(w, sf, 2),
                          _plane_bf16(w, sf, 3), _plane_bf16(w, sf, 4), _plane_bf16(w, sf, 5),
                          _plane_bf16(w, sf, 6), _plane_bf16(w, sf, 7), BLOCK_N, BK8)


__all__ = ["DEQ_FLOAT", "DEQ_BF16X2", "DEQ_BF16X2_EMU", "DEQUANTS", "pair_pos", "pair_order", "load_dequant"]
