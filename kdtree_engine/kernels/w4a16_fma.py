"""W4A16 small-M path on the CUDA cores ("fma" kernel family): no tensor cores, no nibble interleave.

Same weights and result as w4a16.py (packed int32 [N, K/8], element j of each 8 consecutive k in bits
[4j, 4j+3], u = q + 8; scale bf16 [N, K/g]). At M <= 16 the GEMM is a stream of packed bytes, and the
cost that limits it is the instructions spent per weight element. This path spends about three:

- the activation is permuted once per call into nibble-plane order and pre-scaled by a power of two
  (exact):  xp[m, j, c] = x[m, 8c + j] * 16^-(j % 4)   (fp32 [M, 8, K/8], `x_planes`),
  so that nibble plane j of the packed column c multiplies a contiguous vector xp[m, j, :];
- plane j of a packed word w is extracted *without a shift* for j < 4 (and from w >> 16 for j >= 4):
  (w & (0xF << 4j)) | 0x4B000000 read as float32 is 2^23 + u * 16^j exactly, and subtracting
  2^23 + 8 * 16^j leaves (u - 8) * 16^j exactly: one LOP3 + one FADD per element, the -8 included;
- per packed column c: t = sum_j plane_j * xp[j, c] (8 FMAs per token), then acc[n, c] += s[n, g] * t
  (one FMA per 8 elements): the group scale is applied per 8 elements, not per element;
- acc [BLOCK_N, BLOCK_K/8] lives in registers over the K loop, is summed over c once at the end.

Batch invariance: a token is one of BLOCK_M (1..4) separate accumulators with identical code; M only
picks how many tokens a program carries and how many programs share a weight tile (grid dim 0), never
the order in which one output element is summed. That order is fixed by BLOCK_N, BLOCK_K, num_warps
(layout of the final sum over c) and the split-K factor, all of which must be shared by every M bucket
of a table (checked by w4a16.check_table). Split-K partials are summed in split order (split_sum.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

# 2^23 + 8 * 16^j: subtracting it from (2^23 + u * 16^j) leaves (u - 8) * 16^j exactly
_B0 = tl.constexpr(8388616.0)
_B1 = tl.constexpr(8388736.0)
_B2 = tl.constexpr(8390656.0)
_B3 = tl.constexpr(8421376.0)


@triton.jit
def _planes(w):
    """int32 packed words [R, C] -> 8 fp32 tensors [R, C]: (u_j - 8) * 16^(j % 4), exact."""
    hi = w >> 16
    f0 = ((w & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - _B0
    f1 = ((w & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - _B1
    f2 = ((w & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - _B2
    f3 = ((w & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - _B3
    f4 = ((hi & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - _B0
    f5 = ((hi & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - _B1
    f6 = ((hi & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - _B2
    f7 = ((hi & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - _B3
    return f0, f1, f2, f3, f4, f5, f6, f7


@triton.jit
def _xload(ptrs, cmask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)[None, :]
    return tl.load(ptrs, mask=cmask, other=0.0)[None, :]


@triton.jit
def _plane_dot(f0, f1, f2, f3, f4, f5, f6, f7, xr, K8, cc, cmask, EVEN: tl.constexpr):
    """t[r, c] = sum_j f_j[r, c] * xp[j, c] for one token; xr points at that token's xp row."""
    t = f0 * _xload(xr + cc, cmask, EVEN)
    t += f1 * _xload(xr + K8 + cc, cmask, EVEN)
    t += f2 * _xload(xr + 2 * K8 + cc, cmask, EVEN)
    t += f3 * _xload(xr + 3 * K8 + cc, cmask, EVEN)
    t += f4 * _xload(xr + 4 * K8 + cc, cmask, EVEN)
    t += f5 * _xload(xr + 5 * K8 + cc, cmask, EVEN)
    t += f6 * _xload(xr + 6 * K8 + cc, cmask, EVEN)
    t += f7 * _xload(xr + 7 * K8 + cc, cmask, EVEN)
    return t


@triton.jit
def _load_ws(w_rows, s_rows, cc, n_mask, c_end, G8_LOG: tl.constexpr, EVEN: tl.constexpr):
    """Packed words [R, C] and their group scales (fp32, one per word: group = c >> G8_LOG) for
    columns cc. Masked words load as 0 with scale 0, so they add 0 * finite."""
    if EVEN:
        w = tl.load(w_rows + cc[None, :], eviction_policy="evict_first")
        s = tl.load(s_rows + (cc >> G8_LOG)[None, :])
    else:
        m2 = n_mask[:, None] & (cc[None, :] < c_end)
        w = tl.load(w_rows + cc[None, :], mask=m2, other=0, eviction_policy="evict_first")
        s = tl.load(s_rows + (cc >> G8_LOG)[None, :], mask=m2, other=0.0)
    return w, s.to(tl.float32)


@triton.jit
def _x_planes_kernel(x_ptr, xp_ptr, K8, stride_xm, stride_pm, BLOCK_C: tl.constexpr):
    """xp[m, j, c] = x[m, 8c + j] * 16^-(j % 4) in fp32 (exact)."""
    m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < K8
    xr = x_ptr + m * stride_xm + 8 * c
    pr = xp_ptr + m * stride_pm + c
    f = 1.0
    for j in tl.static_range(4):
        lo = tl.load(xr + j, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(xr + j + 4, mask=mask, other=0.0).to(tl.float32)
        tl.store(pr + j * K8, lo * f, mask=mask)
        tl.store(pr + (j + 4) * K8, hi * f, mask=mask)
        f = f * 0.0625


@triton.jit
def _w4a16_fma_kernel(xp_ptr, w_ptr, s_ptr, out_ptr,
                      M, N, K8, c_per_split,
                      stride_pm, stride_wn, stride_sn, stride_om, stride_os,
                      G8_LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                      EVEN: tl.constexpr, OUT_F32: tl.constexpr):
    # grid: (token chunks [fastest: chunks sharing a weight tile run together], n tiles, splits)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_c = tl.arange(0, BLOCK_C)
    c_start = pid_k * c_per_split
    c_end = tl.minimum(K8, c_start + c_per_split)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn
    # token rows past M read row M-1 (valid memory, never stored): no masks on the x loads
    x0 = xp_ptr + m0.to(tl.int64) * stride_pm
    x1 = xp_ptr + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_pm
    x2 = xp_ptr + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_pm
    x3 = xp_ptr + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_pm
    mn = offs_n * 0 + m0   # a vector: scalar & vector masks confuse the interpreter

    acc0 = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
    for c0 in range(c_start, c_end, BLOCK_C):
        cc = c0 + offs_c
        w, s = _load_ws(w_rows, s_rows, cc, n_mask, c_end, G8_LOG, EVEN)
        cmask = cc < c_end
        f0, f1, f2, f3, f4, f5, f6, f7 = _planes(w)
        acc0 += s * _plane_dot(f0, f1, f2, f3, f4, f5, f6, f7, x0, K8, cc, cmask, EVEN)
        if BLOCK_M > 1:
            acc1 += s * _plane_dot(f0, f1, f2, f3, f4, f5, f6, f7, x1, K8, cc, cmask, EVEN)
        if BLOCK_M > 2:
            acc2 += s * _plane_dot(f0, f1, f2, f3, f4, f5, f6, f7, x2, K8, cc, cmask, EVEN)
            acc3 += s * _plane_dot(f0, f1, f2, f3, f4, f5, f6, f7, x3, K8, cc, cmask, EVEN)

    o_row = out_ptr + pid_k * stride_os + m0.to(tl.int64) * stride_om + offs_n
    _store_row(o_row, tl.sum(acc0, axis=1), n_mask, OUT_F32)
    if BLOCK_M > 1:
        _store_row(o_row + stride_om, tl.sum(acc1, axis=1), n_mask & (mn + 1 < M), OUT_F32)
    if BLOCK_M > 2:
        _store_row(o_row + 2 * stride_om, tl.sum(acc2, axis=1), n_mask & (mn + 2 < M), OUT_F32)
        _store_row(o_row + 3 * stride_om, tl.sum(acc3, axis=1), n_mask & (mn + 3 < M), OUT_F32)


@triton.jit
def _store_row(ptrs, v, mask, OUT_F32: tl.constexpr):
    if OUT_F32:
        tl.store(ptrs, v, mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


FMA_BLOCK_M = (1, 2, 4)   # tokens per program this family supports


__all__ = ["_planes", "_plane_dot", "_load_ws", "_x_planes_kernel", "_w4a16_fma_kernel", "FMA_BLOCK_M"]
