"""Causal prefill attention of MLA's naive form on tensor cores: T queries at positions start..start+T-1 over keys
0..start+T-1. Per head, the score of a query and a key is q_nope . k_nope (P values, the key's own per-head
expansion through kv_b_proj) + q_pe . k_pe (R values, k_pe shared by the heads), and the value is the key's
per-head V values.

Why: the torch path (model/prefill.py) computes float32 scores on CUDA cores with a dozen elementwise launches per
key block; here one launch per key range runs bf16 dots on tensor cores with an online softmax in registers.

Reduction (what fixes a query's bits): keys are visited in blocks of BLOCK_N aligned to absolute key positions,
in increasing order; within a block the scores and the P . V products are tensor-core dots over the head
dimensions; the running max, sum and accumulator are float32. A block holding no key visible to a query adds
exactly nothing to its row (its scale factor is exp2(0) = 1 and its probabilities are 0), and every row is computed
alone (the dots are row-wise). So a query's output depends on its own row and the keys only: not on T, on the
query tile it falls in, on how the prompt was cut into chunks, or on the key ranges of the calls (multiples of
BLOCK_N; their state carried between calls in float32, exactly). The tile shape is fixed (never chosen by T).

Keys enter in ranges (:func:`naive_prefill`): each range's latents are expanded through kv_b_proj to per-head K / V,
attended, and dropped, so the expanded keys held at once are bounded by ``EXPANDED_BYTES`` whatever the prompt.

CPU: only under TRITON_INTERPRET=1 (tests); the engine's CPU path is the torch one.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ..logs import log_once

BLOCK_M = 128          # queries per program
BLOCK_N = 64           # keys per step: the alignment of the key blocks (part of the reduction)
NUM_WARPS = 8
NUM_STAGES = 2
EXPANDED_BYTES = 256 << 20  # per-head K / V of one key range (model dtype): the bound on the expansion's transient
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["T", "start", "k0", "k1", "kv_base"])
def _prefill_attn_kernel(qn_ptr, qr_ptr, kn_ptr, kr_ptr, v_ptr, m_ptr, l_ptr, acc_ptr, o_ptr, tiles_ptr,
                         T, start, k0, k1, kv_base, scale_log2,
                         s_qn_t, s_qn_h, s_qr_t, s_qr_h, s_kn_t, s_kn_h, s_kr_t, s_v_t, s_v_h, s_o_t, s_o_h,
                         P: tl.constexpr, R: tl.constexpr, V: tl.constexpr,
                         PP: tl.constexpr, RP: tl.constexpr, VP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
                         PREC: tl.constexpr, PROMPTS: tl.constexpr = False):
    # grid (query tiles, heads). Keys [k0, k1) of this call sit at rows key - kv_base of kn / kr / v.
    # PROMPTS: several whole prompts of one key range each, their rows concatenated; tile i of the grid is
    # tiles[i] = (the prompt's first row, its length, the tile within it): the program its own launch would run
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    if PROMPTS:
        row0 = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
        T = tl.load(tiles_ptr + 3 * pid_m + 1)
        pid_m = tl.load(tiles_ptr + 3 * pid_m + 2)
        k1 = T
        qn_ptr += row0 * s_qn_t
        qr_ptr += row0 * s_qr_t
        kn_ptr += row0 * s_kn_t
        kr_ptr += row0 * s_kr_t
        v_ptr += row0 * s_v_t
        o_ptr += row0 * s_o_t
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    q_pos = start + offs_m
    # head dimensions padded to powers of two (>= 16, the dot's minimum) with zeros: they add exact zeros
    offs_p = tl.arange(0, PP)
    offs_r = tl.arange(0, RP)
    offs_v = tl.arange(0, VP)
    p_mask = offs_p < P
    r_mask = offs_r < R
    v_mask = offs_v < V
    rows = offs_m.to(tl.int64)
    qn = tl.load(qn_ptr + rows[:, None] * s_qn_t + h * s_qn_h + offs_p[None, :], mask=m_mask[:, None] & p_mask[None, :],
                 other=0.0)
    qr = tl.load(qr_ptr + rows[:, None] * s_qr_t + h * s_qr_h + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :],
                 other=0.0)
    st = h.to(tl.int64) * T + rows  # state row of (head, query)
    if FIRST:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, VP], tl.float32)
    else:
        m_i = tl.load(m_ptr + st, mask=m_mask, other=0.0)
        l_i = tl.load(l_ptr + st, mask=m_mask, other=1.0)
        acc = tl.load(acc_ptr + st[:, None] * VP + offs_v[None, :], mask=m_mask[:, None], other=0.0)
    # no key past the tile's last query is visible to any of its rows (key 0, in the first block of the first
    # call, is visible to every row, so the running max is finite from the first step on)
    hi = tl.minimum(k1, start + (pid_m + 1) * BLOCK_M)
    for n0 in range(k0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < k1
        rel = (offs_n - kv_base).to(tl.int64)
        kn = tl.load(kn_ptr + rel[:, None] * s_kn_t + h * s_kn_h + offs_p[None, :],
                     mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        kr = tl.load(kr_ptr + rel[:, None] * s_kr_t + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        s = tl.dot(qn, tl.trans(kn), input_precision=PREC)
        s = tl.dot(qr, tl.trans(kr), s, input_precision=PREC)
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + rel[:, None] * s_v_t + h * s_v_h + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :],
                    other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    if LAST:
        out = acc / l_i[:, None]
        tl.store(o_ptr + rows[:, None] * s_o_t + h * s_o_h + offs_v[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & v_mask[None, :])
    else:
        tl.store(m_ptr + st, m_i, mask=m_mask)
        tl.store(l_ptr + st, l_i, mask=m_mask)
        tl.store(acc_ptr + st[:, None] * VP + offs_v[None, :], acc, mask=m_mask[:, None])


def key_range(n_heads: int, width: int, dtype: torch.dtype) -> int:
    """Keys per range: as many whole key blocks as keep the range's per-head K / V (``width`` = P + V values a key
    a head) within EXPANDED_BYTES (at least one block)."""
    per_key = n_heads * width * dtype.itemsize
    return max(1, EXPANDED_BYTES // (per_key * BLOCK_N)) * BLOCK_N


def _check(q_nope: torch.Tensor, q_pe: torch.Tensor) -> None:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"prefill attention wants q_nope [T, N, P] and q_pe [T, N, R], got {tuple(q_nope.shape)} "
                         f"and {tuple(q_pe.shape)}")
    if q_nope.dtype != q_pe.dtype:
        raise TypeError(f"prefill attention: q_nope is {q_nope.dtype}, q_pe {q_pe.dtype}")


def _pad(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def naive_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: Callable[[int, int], torch.Tensor],
                  expand: Callable[[torch.Tensor], torch.Tensor], start: int, scale: float, kv_lora_rank: int,
                  v_head_dim: int) -> torch.Tensor:
    """Causal attention of q_nope [T, N, P], q_pe [T, N, R] (queries at positions start..start+T-1) over keys
    0..start+T-1: ``latents(s0, s1)`` -> [s1 - s0, C+R] (normed c_kv | rotated k_pe), ``expand(c_kv)`` ->
    [keys, N * (P + V)] (kv_b_proj). Keys are taken in ranges of :func:`key_range`. Returns [T, N, V] in q's dtype."""
    _check(q_nope, q_pe)
    T, N, P = q_nope.shape
    R, V, C = q_pe.shape[2], v_head_dim, kv_lora_rank
    q_nope, q_pe = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_nope, q_pe))
    dev, end = q_nope.device, start + T
    out = torch.empty(T, N, V, device=dev, dtype=q_nope.dtype)
    step = key_range(N, P + V, q_nope.dtype)
    log_once(f"prefill-key-range:{N}:{P + V}:{q_nope.dtype}", f"prefill attention: keys expanded {step} at a time "
             f"({N} heads x {P + V} values; at most {EXPANDED_BYTES >> 20} MB of per-head K / V)")
    ranges = [(s0, min(s0 + step, end)) for s0 in range(0, end, step)]
    state = (torch.empty(0, device=dev),) * 3
    if len(ranges) > 1:
        state = (torch.empty(N, T, device=dev, dtype=torch.float32), torch.empty(N, T, device=dev, dtype=torch.float32),
                 torch.empty(N, T, _pad(V), device=dev, dtype=torch.float32))
    prec = "ieee" if q_nope.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(T, BLOCK_M), N)
    for i, (s0, s1) in enumerate(ranges):
        lat = latents(s0, s1)
        lat = lat if lat.stride(-1) == 1 else lat.contiguous()
        kv = expand(lat[:, :C]).view(s1 - s0, N, P + V)
        kn, v, kr = kv[..., :P], kv[..., P:], lat[:, C:]
        _prefill_attn_kernel[grid](
            q_nope, q_pe, kn, kr, v, state[0], state[1], state[2], out, out,
            T, start, s0, s1, s0, scale * LOG2E,
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kn.stride(0), kn.stride(1),
            kr.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            P=P, R=R, V=V, PP=_pad(P), RP=_pad(R), VP=_pad(V), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            FIRST=i == 0, LAST=i == len(ranges) - 1, PREC=prec, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def prompts_fit(n_heads: int, width: int, dtype: torch.dtype, longest: int) -> bool:
    """Whether whole prompts of up to ``longest`` tokens each take one key range (:func:`naive_prefill_prompts`)."""
    return longest <= key_range(n_heads, width, dtype)


def prompt_tiles(lengths: list[int], device: torch.device) -> torch.Tensor:
    """The programs of :func:`naive_prefill_prompts` over prompts of ``lengths`` rows: int32 [tiles, 3] of (the
    prompt's first row, its length, the query tile within it)."""
    tiles, row0 = [], 0
    for n in lengths:
        tiles += [(row0, n, m) for m in range(triton.cdiv(n, BLOCK_M))]
        row0 += n
    return torch.tensor(tiles, dtype=torch.int32).to(device)


def naive_prefill_prompts(q_nope: torch.Tensor, q_pe: torch.Tensor, lat: torch.Tensor,
                          expand: Callable[[torch.Tensor], torch.Tensor], lengths: list[int], scale: float,
                          kv_lora_rank: int, v_head_dim: int, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Several whole prompts (positions 0..) in one launch: their rows concatenated in q_nope [T, N, P], q_pe [T, N, R]
    and their latents lat [T, C+R] (row for row), ``lengths`` the prompts' rows in order (each within one key range:
    :func:`prompts_fit`). Returns [T, N, V]: each prompt's rows those of :func:`naive_prefill` on it alone (its
    programs, one grid for all; the keys' expansion one product over every row, a row-wise one). ``tiles``:
    :func:`prompt_tiles` of ``lengths`` where the caller made it once for many calls."""
    _check(q_nope, q_pe)
    T, N, P = q_nope.shape
    R, V, C = q_pe.shape[2], v_head_dim, kv_lora_rank
    if sum(lengths) != T or lat.shape[0] != T or min(lengths, default=1) < 1:
        raise ValueError(f"prompts of {lengths} rows do not make the {T} query rows and {lat.shape[0]} latents")
    if not prompts_fit(N, P + V, q_nope.dtype, max(lengths)):
        raise ValueError(f"a prompt of {max(lengths)} tokens takes more than one key range")
    q_nope, q_pe, lat = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_nope, q_pe, lat))
    dev = q_nope.device
    tiles_t = prompt_tiles(lengths, dev) if tiles is None else tiles
    out = torch.empty(T, N, V, device=dev, dtype=q_nope.dtype)
    kv = expand(lat[:, :C]).view(T, N, P + V)
    kn, v, kr = kv[..., :P], kv[..., P:], lat[:, C:]
    none = torch.empty(0, device=dev)
    _prefill_attn_kernel[(tiles_t.shape[0], N)](
        q_nope, q_pe, kn, kr, v, none, none, none, out, tiles_t,
        0, 0, 0, 0, 0, scale * LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kn.stride(0), kn.stride(1),
        kr.stride(0), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        P=P, R=R, V=V, PP=_pad(P), RP=_pad(R), VP=_pad(V), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        FIRST=True, LAST=True, PREC="ieee" if q_nope.dtype == torch.float32 else "tf32", PROMPTS=True,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
