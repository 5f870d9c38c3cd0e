"""W4A16 GEMM by nibble planes, an experiment: the dequantized weight tile never touches shared memory.

Measured on the H200 (bench/results/w4-plane-probe-h200.md, `python3 bench/w4_plane_probe.py`): correct,
but about 1.7-1.9x slower than the default "dot" kernel (dense 36864 x 7168, M = 1: 146-157 us against 88),
so the engine does not use it. With the weights as the MMA's B operand (W_AS_B: tokens on the 16 rows of
an mma.sync tile, no wgmma wait) and 1-8 accumulators (N_ACC, against the MMA dependency chain) it is
147-151 us: the loop issues ~2.9 SASS instructions per weight (triton 3.9; ~4.4 measured on triton 3.6
by Nsight Compute, as many as the default) at 1.2 instructions per cycle, 2.5 warps per scheduler. What it showed: Triton does build a wgmma register operand straight from
packed words in shared memory when the dequantization is elementwise (below), and the loop then issues
fewer instructions per weight; but a register-operand wgmma is waited for before the next one
(warp_group_dot_wait 0 after each of the 16 plane GEMMs of an iteration), and with 2-3 blocks per SM
the kernel stalls on that chain, on shared-memory loads (MIO throttle) and barriers (Nsight Compute).

Same weights and result as kdtree_engine/kernels/w4a16.py (packed int32 [N, K/8], element j of each 8 consecutive k in bits
[4j, 4j+3], u = q + 8; scale bf16 [N, K/32]); bf16 activations, group size 32.

Why. The "dot" family dequantizes a [BLOCK_N, BLOCK_K] tile in registers, stores it to shared memory
and reads it back in the MMA's operand layout: 4 bytes of shared-memory traffic per weight against
0.5 bytes from DRAM, and on the H200 that L1/shared pipe is the limit (81% busy at 1.9 TB/s, dense
36864 x 7168, M = 1; Nsight Compute). Here the MMA's A operand (weights, SWAP_AB) is built in
registers straight from the packed words:

    out^T[n, t] = sum_j sum_c  W_j[n, c] * X_j[c, t]          W_j[n, c] = (u_j(w[n, c]) - 8) * s[n, c // 4]

is a sum of 8 GEMMs, one per nibble plane j, each over packed columns c. W_j is an *elementwise*
function of the packed tile, so Triton loads the packed words from shared memory directly in the
wgmma register-operand layout and dequantizes there (its convert-hoisting through elementwise ops:
shared memory holds only the int4 words, cp.async-pipelined). Two adjacent columns c, c+1 form one
bf16x2 register of the operand; the inline PTX builds it from the two words with one PRMT (+ one shift
for odd j), one LOP3 (0x4300 | u: 128 + u as bf16), one sub.bf16x2 (exact u - 8) and one mul.bf16x2
by the group scale (rounded once, the same number as the "dot" family's dequantized tile).

Scales. A group spans 4 packed columns; the scale pair of groups (2i, 2i+1) is one int32 of the scale
row viewed as int32 [N, K/64]. Each iteration's columns are split by group parity (even-group columns
c = 8i + r, odd c = 8i + 4 + r, r < 4), so an operand's scale is the low (even) or high (odd) half of
one word, again elementwise: 2 x 8 plane GEMMs per iteration, BLOCK_C / 2 columns each.

Activations are permuted once per call (`plane_order`) so that the [BLOCK_M, BLOCK_C / 2] operand of
each (iteration, plane, parity) is a contiguous slice, loaded by TMA (a tensor descriptor): pipelined
into shared memory with the weights, rows past M zero-filled. Loading them with pointers instead put 16
register -> shared-memory copies per iteration in the loop (LG and MIO throttle, Nsight Compute).

Reduction order per output element: iteration by iteration over K (BLOCK_C packed columns each), within
an iteration plane 0 even, plane 0 odd, plane 1 even, ..., then split-K partials in split order. It
depends on (BLOCK_C, BLOCK_N, split) only, never on M (batch invariance: W4Config.reduction_key).
Under TRITON_INTERPRET the PTX is replaced by the same numbers in plain Triton (PLANE_EMU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kdtree_engine.kernels.common import interpreting


def _plane_ptx(j: int) -> str:
    """Words $1, $2 (columns c, c+1) -> $0 = bf16x2 (u_j(c) - 8, u_j(c+1) - 8), exact."""
    b = j // 2
    sel = b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12)   # byte b of $1 -> byte 0, of $2 -> byte 2
    shift = "shr.b32 t, t, 4;\n" if j % 2 else ""
    return ("{\n.reg .b32 t, bias;\nmov.b32 bias, 0x43084308;\n"
            f"prmt.b32 t, $1, $2, {hex(sel)};\n{shift}"
            "lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;\n"
            "sub.rn.bf16x2 $0, t, bias;\n}")


_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7 = (tl.constexpr(_plane_ptx(j)) for j in range(8))
_LO = tl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")   # low bf16 halves of two words -> one bf16x2
_HI = tl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")   # high halves


@triton.jit
def _asm2(w, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _plane(w, J: tl.constexpr, EMU: tl.constexpr):
    """Plane J of packed words w as bf16 u - 8 (exact)."""
    if EMU:
        f = (((w >> (4 * J)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        return f.to(tl.bfloat16)
    elif J == 0:
        return _asm2(w, _P0)
    elif J == 1:
        return _asm2(w, _P1)
    elif J == 2:
        return _asm2(w, _P2)
    elif J == 3:
        return _asm2(w, _P3)
    elif J == 4:
        return _asm2(w, _P4)
    elif J == 5:
        return _asm2(w, _P5)
    elif J == 6:
        return _asm2(w, _P6)
    else:
        return _asm2(w, _P7)


@triton.jit
def _scales(s32, EMU: tl.constexpr):
    """int32 words holding the bf16 scales of groups (2i, 2i+1) -> (even, odd) bf16 scales."""
    if EMU:
        lo = (s32 << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)
        hi = (s32 & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
        return lo, hi
    return _asm2(s32, _LO), _asm2(s32, _HI)


@triton.jit
def _rne_bf16(f):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32 (the interpreter's cast truncates)."""
    b = f.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _x_operand(xq, row0, col, offs_m, offs_h, M, stride_xm, X_DESC: tl.constexpr):
    """Activations [BLOCK_M, HC] at plane-ordered column `col` (TMA through the descriptor on the GPU:
    pipelined into shared memory, rows past M zero-filled; plain loads under the interpreter)."""
    if X_DESC:
        x = xq.load([row0, col])
    else:
        rows = tl.minimum(offs_m, M - 1).to(tl.int64)   # rows past M read row M-1, never stored
        x = tl.load(xq + rows[:, None] * stride_xm + col + offs_h[None, :])
    return x


@triton.jit
def _plane_pair(acc, we, wo, se, so, xq, row0, x_base, offs_m, offs_h, M, stride_xm, J: tl.constexpr,
                HC: tl.constexpr, EMU: tl.constexpr, X_DESC: tl.constexpr, W_AS_B: tl.constexpr):
    """acc [BN, BM] (W_AS_B: [BM, BN]) += plane J's two GEMMs of one iteration (even group columns first)."""
    xe = _x_operand(xq, row0, x_base + (2 * J) * HC, offs_m, offs_h, M, stride_xm, X_DESC)
    xo = _x_operand(xq, row0, x_base + (2 * J + 1) * HC, offs_m, offs_h, M, stride_xm, X_DESC)
    if EMU:  # interpreter: fp32 operands, products of bf16 values (exact) summed in fp32
        ae = _rne_bf16(_plane(we, J, EMU).to(tl.float32) * se.to(tl.float32))
        ao = _rne_bf16(_plane(wo, J, EMU).to(tl.float32) * so.to(tl.float32))
        if W_AS_B:
            acc = tl.dot(xe.to(tl.float32), tl.trans(ae), acc, input_precision="ieee")
            acc = tl.dot(xo.to(tl.float32), tl.trans(ao), acc, input_precision="ieee")
        else:
            acc = tl.dot(ae, tl.trans(xe.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(ao, tl.trans(xo.to(tl.float32)), acc, input_precision="ieee")
    elif W_AS_B:
        acc = tl.dot(xe, tl.trans(_plane(we, J, EMU) * se), acc)
        acc = tl.dot(xo, tl.trans(_plane(wo, J, EMU) * so), acc)
    else:
        acc = tl.dot(_plane(we, J, EMU) * se, tl.trans(xe), acc)
        acc = tl.dot(_plane(wo, J, EMU) * so, tl.trans(xo), acc)
    return acc


@triton.jit
def _w4a16_plane_kernel(xq, w_ptr, s_ptr, out_ptr, M, N, K8, c_per_split,
                        stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                        EMU: tl.constexpr, X_DESC: tl.constexpr, OUT_F32: tl.constexpr,
                        W_AS_B: tl.constexpr = False, N_ACC: tl.constexpr = 1):
    # grid: (m tiles [fastest: tiles sharing a weight tile run together], n tiles, splits)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    HC: tl.constexpr = BLOCK_C // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HC)
    n_ok = offs_n < N
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)   # rows past N read row N-1, never stored: no masks
    rel_e = (offs_h // 4) * 8 + (offs_h % 4)           # even-group columns of an iteration
    c_start = pid_k * c_per_split
    c_end = tl.minimum(K8, c_start + c_per_split)
    w_rows = w_ptr + rows_n[:, None] * stride_wn
    s_rows = s_ptr + rows_n[:, None] * stride_sn
    if W_AS_B:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # N_ACC (1, 2, 4, 8) accumulators, plane j into j % N_ACC, so consecutive MMAs do not wait on each
    # other (an mma.sync chain on one accumulator is latency-bound); summed by a fixed tree after the K loop
    a1 = acc
    a2 = acc
    a3 = acc
    a4 = acc
    a5 = acc
    a6 = acc
    a7 = acc
    row0 = pid_m * BLOCK_M
    for c0 in range(c_start, c_end, BLOCK_C):
        ce = c0 + rel_e
        we = tl.load(w_rows + ce[None, :])
        wo = tl.load(w_rows + (ce + 4)[None, :])
        s32 = tl.load(s_rows + (c0 // 8 + offs_h // 4)[None, :])
        se, so = _scales(s32, EMU)
        xb = (c0 // BLOCK_C) * 16 * HC
        for j in tl.static_range(8):
            if j % N_ACC == 0:
                acc = _plane_pair(acc, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            elif j % N_ACC == 1:
                a1 = _plane_pair(a1, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            elif j % N_ACC == 2:
                a2 = _plane_pair(a2, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            elif j % N_ACC == 3:
                a3 = _plane_pair(a3, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            elif j % N_ACC == 4:
                a4 = _plane_pair(a4, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            elif j % N_ACC == 5:
                a5 = _plane_pair(a5, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            elif j % N_ACC == 6:
                a6 = _plane_pair(a6, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
            else:
                a7 = _plane_pair(a7, we, wo, se, so, xq, row0, xb, offs_m, offs_h, M, stride_xm, j, HC, EMU, X_DESC, W_AS_B)
    if N_ACC == 8:
        acc = ((acc + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    elif N_ACC == 4:
        acc = (acc + a1) + (a2 + a3)
    elif N_ACC == 2:
        acc = acc + a1
    if not W_AS_B:
        acc = tl.trans(acc)
    o_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    o_mask = (offs_m[:, None] < M) & n_ok[None, :]
    if OUT_F32:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


def plane_order(x: torch.Tensor, block_c: int) -> torch.Tensor:
    """x [M, K] -> [M, K]: for each iteration of block_c packed columns, plane j, group parity e, the
    block_c / 2 activations of that operand contiguous (k = 8c + j, c = it*block_c + 8i + 4e + r)."""
    M, K = x.shape
    v = x.reshape(M, K // (8 * block_c), block_c // 8, 2, 4, 8)     # [m, it, i, e, r, j]
    return v.permute(0, 1, 5, 3, 2, 4).reshape(M, K)                # [m, it, j, e, i, r]


def plane_supported(K: int, group_size: int, dtype: torch.dtype, block_c: int) -> str | None:
    """None if the plane family runs this shape, else why not."""
    if dtype != torch.bfloat16:
        return f"activations are {dtype}, the plane kernel takes bf16"
    if group_size != 32:
        return f"group size {group_size}, the plane kernel takes 32"
    if K % (8 * block_c):
        return f"K = {K} is not a multiple of {8 * block_c} (BLOCK_K of the plane kernel)"
    return None


def plane_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block_m: int, block_n: int,
                 block_c: int, c_per_split: int, split: int, target: torch.Tensor,
                 num_warps: int, num_stages: int, w_as_b: bool = False, x_desc: bool = True,
                 n_acc: int = 1) -> torch.Tensor:
    """Launch the plane kernel: x bf16 [M, K], packed [N, K/8], scale bf16 [N, K/32] -> target
    ([M, N] x.dtype when split == 1, else fp32 partials [split, M, N]). w_as_b: the weights are the MMA's
    B operand (tokens on M: 16-row mma.sync tiles, warps split over N) instead of A (wgmma at BLOCK_N 64);
    x_desc: activations by TMA descriptor (else pointer loads); n_acc: accumulators (1, 2, 4, 8), plane j into j % n_acc."""
    M, K = x.shape
    N = packed.shape[0]
    xq = plane_order(x, block_c)
    s32 = scale.view(torch.int32)
    emu = interpreting()
    use_desc = x_desc and not emu
    x_arg = TensorDescriptor.from_tensor(xq, [block_m, block_c // 2]) if use_desc else xq
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)
    _w4a16_plane_kernel[grid](
        x_arg, packed, s32, target, M, N, K // 8, c_per_split,
        xq.stride(0), packed.stride(0), s32.stride(0), N, M * N,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=block_c, EMU=emu, X_DESC=use_desc, OUT_F32=split > 1,
        W_AS_B=w_as_b, N_ACC=n_acc, num_warps=num_warps, num_stages=num_stages)
    return target


__all__ = ["plane_order", "plane_supported", "plane_linear"]
