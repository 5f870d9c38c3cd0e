"""Per-row selection over logits in one launch each: the greedy token and the drafter's top-k log-probs.

    argmax_rows(x)           x [L, V] -> [L] int64            torch.argmax(x, dim=-1)
    topk_logprobs_rows(x, k) x [L, V] -> lp [L, k] float32,    the k largest x.float() of a row, best first,
                                         ids [L, k] int64      minus the row's logsumexp; ids their columns

L rows (positions), V columns (vocabulary: 4096 in the demo, 163840 in K2), k picks per row. x is float32,
bfloat16 or float16 with unit last stride and any row stride (a row view of a wider tensor). One program
per row, so a row's result never depends on the rows sharing the launch.

Order: among equal values the lower column first (torch.argmax's result; a stable descending sort's order
for the top k, :func:`topk_logprobs_torch`); -0.0 equals +0.0; NaN counts as larger than every number (as
in torch.argmax and torch.sort), the first NaN of a row winning. A row holding a NaN has a NaN logsumexp,
so all its log-probs are NaN (as torch's).

argmax: the row in chunks of BLOCK columns, four chunks an iteration (their loads issued together), each
lane keeping its running (max, column) (strictly greater replaces, so a lane keeps its first column among
ties), then the lane with the largest value and, among equal ones, the lowest column. BLOCK / warps:
up to 1024 / 8 for V <= 16384, 2048 / 16 beyond (faster than torch.argmax on an H200 at both the
demo's and K2's vocabularies: docs/performance_history.md).

top-k: the row held whole in registers (V <= ``TOPK_MAX_V``; the caller keeps torch beyond), its
logsumexp in float32 (max, then the sum of exp2 of the shifted values), then each element as one int64
key, (its value's bits mapped to an order-preserving int32) << 32 | (2^31 - 1 - column): the larger key is
the larger value and, among equal values, the lower column; its value and column come back out of it
exactly, and the log-prob is value - logsumexp. The k best keys by one of two selections:
  rounds (k <= 16 on rows of 2048+ columns, or k = 1): pick r is the largest key below pick r - 1's, one
         max reduction each (a runtime loop; the tile is never rewritten), scalar stores;
  sort   (otherwise): Triton's bitonic tl.topk for the next power of 2 >= k, the first k stored; its cost
         hardly grows with k.
Both are several times faster than torch.topk + logsumexp in a graph on an H200 (docs/performance_history.md).

Arithmetic against the torch oracle: the values are x's own (exact in float32); the logsumexp sums in
another order, with Triton's exp2 / log2 (approximate on CUDA), so log-probs agree within a few fp32 ulps
and ids exactly.

CPU: :func:`topk_logprobs_torch` is the oracle (and the path for V > ``TOPK_MAX_V``); under
TRITON_INTERPRET=1 the kernels run on CPU tensors (tests/kernels/test_row_select.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DTYPES, interpreting
from .pdl import pdl_launch, pdl_supported, pdl_wait

TOPK_MAX_V = 16384   # top-k rows above this many columns do not fit the register tile: ValueError
TOPK_MAX_K = 128     # the largest k measured and GPU-tested (tests/gpu/test_row_select_gpu.py): a k = 256 sort
                     # of 1024 columns outran a 230 s test cap on the H200; ValueError beyond, the dispatch
                     # (kernels/dispatch.py draft_topk) keeps torch there
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


# ------------------------------------------------------------------------------------------------ argmax

@triton.jit
def _argmax_step(v, c, best, col):
    """One chunk into the lanes' running (max, column): a greater value, or the lane's first NaN, replaces
    (nothing replaces a NaN: NaN > y and NaN == NaN are false)."""
    take = (v > best) | ((v != v) & (best == best))
    return tl.where(take, v, best), tl.where(take, c, col)


@triton.jit
def _argmax_rows_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # a dependent launch (pdl.py): wait for the kernel writing the logits
        pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    col = offs  # a lane whose values are all -inf keeps its first column (>= V only for padding lanes)
    for start in range(0, V, 4 * BLOCK):  # four chunks an iteration, their loads first (in flight together)
        c0 = start + offs
        c1 = c0 + BLOCK
        c2 = c1 + BLOCK
        c3 = c2 + BLOCK
        v0 = tl.load(base + c0, mask=c0 < V, other=float("-inf")).to(tl.float32)
        v1 = tl.load(base + c1, mask=c1 < V, other=float("-inf")).to(tl.float32)
        v2 = tl.load(base + c2, mask=c2 < V, other=float("-inf")).to(tl.float32)
        v3 = tl.load(base + c3, mask=c3 < V, other=float("-inf")).to(tl.float32)
        best, col = _argmax_step(v0, c0, best, col)
        best, col = _argmax_step(v1, c1, best, col)
        best, col = _argmax_step(v2, c2, best, col)
        best, col = _argmax_step(v3, c3, best, col)
    nan = best != best
    any_nan = tl.max(nan.to(tl.int32), axis=0) > 0
    m = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    cand = tl.where(any_nan, nan, best == m)
    pick = tl.min(tl.where(cand, col, 2147483647), axis=0)
    tl.store(out_ptr + row, pick.to(tl.int64))


def _argmax_config(V: int) -> tuple[int, int]:
    """(BLOCK columns per chunk, num_warps), measured on an H200."""
    if V > 16384:
        return 2048, 16
    block = min(max(triton.next_power_of_2(triton.cdiv(V, 4)), 32), 1024)
    return block, min(max(block // 128, 1), 8)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Triton: x [L, V] float32 / bf16 / fp16 (unit last stride) -> [L] int64, torch.argmax(x, dim=-1)."""
    _check_rows("argmax_rows", x)
    L, V = x.shape
    _check_device("argmax_rows", x)
    out = torch.empty((L,), dtype=torch.int64, device=x.device)
    if L:
        block, warps = _argmax_config(V)
        _argmax_rows_kernel[(L,)](x, out, V, x.stride(0), BLOCK=block, num_warps=warps,
                                  **pdl_launch(pdl_supported(x.device)))
    return out


# ------------------------------------------------------------------------------------------------- top-k

@triton.jit
def _topk_logprobs_kernel(x_ptr, lp_ptr, ids_ptr, V, K, stride_x, BLOCK_V: tl.constexpr, SORT: tl.constexpr,
                          KP: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # a dependent launch (pdl.py): wait for the kernel writing the logits
        pdl_wait()
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_V)
    valid = i < V
    v = tl.load(x_ptr + row * stride_x + i, mask=valid, other=float("-inf")).to(tl.float32)
    # logsumexp: shifted by the row max (by 0 when that is not finite: all -inf gives -inf, +inf gives +inf,
    # a NaN anywhere gives NaN through the sum, whatever max makes of it)
    m = tl.max(v, axis=0)
    shift = tl.where(tl.abs(m) < float("inf"), m, 0.0)
    s = tl.sum(tl.exp2((v - shift) * _LOG2E), axis=0)
    lse = shift + tl.log2(s) * _LN2
    # order-preserving keys: float bits -> int32 ordered as the floats (+0 for -0, every NaN the largest),
    # then the column, the lower column the larger key; padding below every element
    bits = v.to(tl.int32, bitcast=True)
    hi = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    hi = tl.where(v == 0.0, 0, hi)
    hi = tl.where(v != v, 0x7FFFFFFF, hi)
    key = (hi.to(tl.int64) << 32) | (2147483647 - i).to(tl.int64)
    key = tl.where(valid, key, -9223372036854775807)
    out = row * K
    if SORT:  # bitonic top-KP of the keys (KP = next power of 2 >= K), best first; the first K stored
        top = tl.topk(key, KP)
        j = tl.arange(0, KP)
        h = (top >> 32).to(tl.int32)
        val = (h ^ ((h >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        tl.store(lp_ptr + out + j, val - lse, mask=j < K)
        tl.store(ids_ptr + out + j, 2147483647 - (top & 0xFFFFFFFF), mask=j < K)
    else:  # K rounds: the largest key below the previous pick
        prev = tl.full([], 9223372036854775807, tl.int64)
        for r in range(0, K):
            best = tl.max(tl.where(key < prev, key, -9223372036854775807), axis=0)
            prev = best
            h = (best >> 32).to(tl.int32)
            val = (h ^ ((h >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            tl.store(lp_ptr + out + r, val - lse)
            tl.store(ids_ptr + out + r, 2147483647 - (best & 0xFFFFFFFF))


def _topk_config(V: int, k: int) -> dict:
    """BLOCK_V (the whole row), the selection (k rounds for k <= 16 on rows of 2048 columns and more, else
    the bitonic top-k) and num_warps, measured on an H200."""
    block = max(triton.next_power_of_2(V), 32)
    if k == 1 or (k <= 16 and block >= 2048):
        return {"BLOCK_V": block, "SORT": False, "KP": 1, "num_warps": 4 if block <= 4096 else 8}
    return {"BLOCK_V": block, "SORT": True, "KP": triton.next_power_of_2(k),
            "num_warps": min(max(block // 64, 1), 8) if block <= 4096 else 16}


def topk_logprobs_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: x [L, V] logits float32 / bf16 / fp16 (unit last stride), 1 <= k <= V <= TOPK_MAX_V ->
    (lp [L, k] float32 descending, ids [L, k] int64): speculative/tree.py's topk_logprobs, ties to the lower id."""
    _check_rows("topk_logprobs_rows", x)
    L, V = x.shape
    if V > TOPK_MAX_V:
        raise ValueError(f"topk_logprobs_rows: V={V} columns exceed the register tile's {TOPK_MAX_V}")
    if not 1 <= k <= min(V, TOPK_MAX_K):
        raise ValueError(f"topk_logprobs_rows: k={k} must be in [1, min(V={V}, {TOPK_MAX_K})]")
    _check_device("topk_logprobs_rows", x)
    lp = torch.empty((L, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((L, k), dtype=torch.int64, device=x.device)
    if L:
        _topk_logprobs_kernel[(L,)](x, lp, ids, V, k, x.stride(0), **_topk_config(V, k),
                                    **pdl_launch(pdl_supported(x.device)))
    return lp, ids


def topk_logprobs_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: x [L, V] -> (lp [L, k] float32, ids [L, k] int64) from a stable descending sort of
    x.float() (ties to the lower id, NaN first) minus torch.logsumexp."""
    xf = x.float()
    vals, ids = torch.sort(xf, dim=-1, descending=True, stable=True)
    return vals[:, :k] - torch.logsumexp(xf, dim=-1, keepdim=True), ids[:, :k]


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [L, V], got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name}: x must be bf16/fp16/fp32, got {x.dtype}")
    if x.shape[1] == 0 or x.shape[1] > 2**31 - 1:
        raise ValueError(f"{name}: V={x.shape[1]} columns, need 1 <= V < 2^31")
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError(f"{name}: x must have unit last stride, got strides {x.stride()}")


def _check_device(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name}: x on {x.device}: the kernel runs on CUDA (or under TRITON_INTERPRET=1)")


__all__ = ["TOPK_MAX_K", "TOPK_MAX_V", "argmax_rows", "topk_logprobs_rows", "topk_logprobs_torch"]
