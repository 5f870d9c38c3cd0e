"""The DFlash drafter's attention in one launch: the block's queries over the cached context and the block.

    q      [B, H, d]        the block's queries (normed, rotated), positions start .. start+B-1
    k_ctx  [Hkv, S, d]      cached context keys, slot j = position j; slots >= start are not read
    v_ctx  [Hkv, S, d]
    kb, vb [B, Hkv, d]      the block's own keys / values (every query sees the whole block)
    start  [] int64         the context length (a device scalar: a captured round reads it in place)
    window                  None, or a sliding window: query i sees keys at positions > start + i - window
    out    [B, H, d]        softmax(q k^T / sqrt(d)) v, q's dtype

One program per query head (GQA: head h reads kv head h // (H / Hkv)); it walks the context in tiles of
BLOCK_N keys up to ``start`` (from the window's first key when there is one), then the block as one last
tile, with the online softmax (fp32 scores and sums, exp2 with the scale folded in; P rounded to the value
dtype for the PV product, as flash attention does). It replaces the torch path's key / value concatenation,
the GQA repeat, the mask and the math attention that a mask forces (~10 launches a layer on CUDA).

The drafter only proposes (the target verifies every token), so this is about time, not bits: it is tested
against the torch path (model/dflash.py ``DraftAttention``) to float tolerance, under TRITON_INTERPRET=1 on the
CPU (tests/kernels/test_draft_attention.py) and on the GPU. Cost grows with ``start`` in one program per
head: fine for the demo's contexts (hundreds to a few thousand keys); a split over the context would be the
next step for long ones.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import DTYPES, interpreting
from .pdl import pdl_launch, pdl_supported, pdl_wait

BLOCK_N = 64  # context keys per tile


@triton.jit
def _online_tile(q, k, v, valid, m_i, l_i, acc, scale_log2e, UPCAST: tl.constexpr):
    """One tile of keys: scores [BB, BN] under ``valid``, the running max / sum / accumulator updated.
    UPCAST: fp32 operands and ieee dots (fp32 inputs; any input under the interpreter, whose bf16 dots
    are wrong in triton 3.9)."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid, s * scale_log2e, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _draft_attention_kernel(q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, out_ptr, start_ptr, B, REP, D, WINDOW,
                            scale_log2e, stride_qt, stride_qh, stride_kch, stride_kcs, stride_vch, stride_vcs,
                            stride_kbt, stride_kbh, stride_vbt, stride_vbh, stride_ot, stride_oh,
                            HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, BLOCK_B: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    h = tl.program_id(0)
    hk = h // REP
    rb = tl.arange(0, BLOCK_B)
    rd = tl.arange(0, BLOCK_D)
    rn = tl.arange(0, BLOCK_N)
    b_ok = rb < B
    d_ok = rd < D
    if PDL:
        pdl_wait()
    q = tl.load(q_ptr + rb[:, None] * stride_qt + h * stride_qh + rd[None, :],
                mask=b_ok[:, None] & d_ok[None, :], other=0.0)                        # [BB, BD]
    start = tl.load(start_ptr).to(tl.int32)
    m_i = tl.full([BLOCK_B], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_B], tl.float32)
    acc = tl.zeros([BLOCK_B, BLOCK_D], tl.float32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(start - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    kc = kc_ptr + hk.to(tl.int64) * stride_kch
    vc = vc_ptr + hk.to(tl.int64) * stride_vch
    for j0 in range(lo, start, BLOCK_N):
        j = j0 + rn
        j_ok = j < start
        k = tl.load(kc + j.to(tl.int64)[:, None] * stride_kcs + rd[None, :], mask=j_ok[:, None] & d_ok[None, :],
                    other=0.0)                                                        # [BN, BD]
        v = tl.load(vc + j.to(tl.int64)[:, None] * stride_vcs + rd[None, :], mask=j_ok[:, None] & d_ok[None, :],
                    other=0.0)
        valid = j_ok[None, :]
        if HAS_WINDOW:   # position j > start + i - window
            valid = valid & (j[None, :] > start + rb[:, None] - WINDOW)
        m_i, l_i, acc = _online_tile(q, k, v, valid, m_i, l_i, acc, scale_log2e, UPCAST)
    # the block's own keys: every query sees all of them (inside the window)
    kbt = tl.load(kb_ptr + rb[:, None] * stride_kbt + hk * stride_kbh + rd[None, :],
                  mask=b_ok[:, None] & d_ok[None, :], other=0.0)                      # [BB, BD]
    vbt = tl.load(vb_ptr + rb[:, None] * stride_vbt + hk * stride_vbh + rd[None, :],
                  mask=b_ok[:, None] & d_ok[None, :], other=0.0)
    valid = b_ok[None, :] & (rb[:, None] >= 0)
    if HAS_WINDOW:
        valid = valid & (rb[None, :] > rb[:, None] - WINDOW)
    m_i, l_i, acc = _online_tile(q, kbt, vbt, valid, m_i, l_i, acc, scale_log2e, UPCAST)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rb[:, None] * stride_ot + h * stride_oh + rd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=b_ok[:, None] & d_ok[None, :])


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if t.dim() != len(shape) or tuple(t.shape[i] for i in range(len(shape)) if shape[i] >= 0) != \
            tuple(s for s in shape if s >= 0) or t.stride(-1) != 1 or t.dtype != dtype:
        want = "x".join("?" if s < 0 else str(s) for s in shape)
        raise ValueError(f"draft_attention: {name} must be [{want}] {dtype} with unit last stride, got "
                         f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")


def draft_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor,
                    start: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Triton: see the module docstring for the shapes. Needs start <= S (not checked on the device)."""
    if q.dim() != 3 or q.dtype not in DTYPES:
        raise ValueError(f"draft_attention: q must be [B, H, d] in bf16/fp16/fp32, got {q.dtype} {tuple(q.shape)}")
    B, H, d = q.shape
    if k_ctx.dim() != 3:
        raise ValueError(f"draft_attention: k_ctx must be [Hkv, S, d], got {tuple(k_ctx.shape)}")
    Hkv = k_ctx.shape[0]
    _check_rows("q", q, (B, H, d), q.dtype)
    _check_rows("k_ctx", k_ctx, (Hkv, -1, d), q.dtype)
    _check_rows("v_ctx", v_ctx, (Hkv, k_ctx.shape[1], d), q.dtype)
    _check_rows("kb", kb, (B, Hkv, d), q.dtype)
    _check_rows("vb", vb, (B, Hkv, d), q.dtype)
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"draft_attention: {H} query heads are not a multiple of {Hkv} kv heads")
    if start.numel() != 1 or start.dtype not in (torch.int32, torch.int64) or start.device != q.device:
        raise ValueError(f"draft_attention: start must be one int32/int64 on {q.device}, got {start.dtype} "
                         f"{tuple(start.shape)} on {start.device}")
    if window is not None and window < 1:
        raise ValueError(f"draft_attention: window must be >= 1, got {window}")
    out = torch.empty((B, H, d), device=q.device, dtype=q.dtype)
    if B == 0 or H == 0:
        return out
    BD = triton.next_power_of_2(max(d, 16))
    _draft_attention_kernel[(H,)](
        q, k_ctx, v_ctx, kb, vb, out, start, B, H // Hkv, d, window or 0, math.log2(math.e) / math.sqrt(d),
        q.stride(0), q.stride(1), k_ctx.stride(0), k_ctx.stride(1), v_ctx.stride(0), v_ctx.stride(1),
        kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), out.stride(0), out.stride(1),
        HAS_WINDOW=window is not None, UPCAST=q.dtype == torch.float32 or interpreting(),
        BLOCK_B=triton.next_power_of_2(max(B, 16)), BLOCK_N=BLOCK_N, BLOCK_D=BD,
        num_warps=4 if BD >= 64 else 2, **pdl_launch(pdl_supported(q.device)))
    return out


__all__ = ["BLOCK_N", "draft_attention"]
