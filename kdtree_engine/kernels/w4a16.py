"""W4A16 linear: y = x @ W.T with W stored as group-wise INT4 in the compressed-tensors layout.

Weights are consumed exactly as the checkpoint ships them (no repack):
  packed int32 [N, K/8]  element j of each 8 consecutive k in bits [4j, 4j+3], stored u = q + 8
  scale  bf16  [N, K/g]  w[n, k] = (u[n, k] - 8) * scale[n, k // g]

Kernel design (memory-bound at small M, so everything is about streaming the packed bytes):
- each program owns a [BLOCK_N, BLOCK_K] weight tile per K step, loaded as int32 [BLOCK_N, BLOCK_K/8]
  (BLOCK_K/2 contiguous bytes per row, 16-byte vector loads), split into 8 nibble planes with shifts
  and re-interleaved into k order with three levels of tl.join (register-only shuffles);
- nibble -> float without an int->float conversion instruction: (u | 0x4B000000) read as float32 is
  2^23 + u exactly, so one OR and one FADD give u - 8; times the group scale, cast to the compute
  dtype (bf16 / fp16 / fp32 = x.dtype), then a tensor-core dot with fp32 accumulation;
- SWAP_AB (default) computes the tile as W_tile @ x_tile.T, so the weight rows are the MMA's M side
  (64/128, a full Hopper wgmma tile) and the few tokens are its N side (16..256);
- split-K for small N (one expert's w2, etc.) writes fp32 partials and a second small kernel sums them
  in a fixed order (no atomics).

Dequantization (selected per config): W4Config.DEQUANT = "float" (below) or "bf16x2" (w4_dequant.py:
inline PTX, two elements per instruction; bf16 activations, permuted once per call).

Batch invariance: a row's result does not depend on M. The reduction order of an output element is
fixed by BLOCK_K and SPLIT_K only, both chosen from (N, K) alone (see `_split_k`, `REDUCTION_BLOCK_K`);
M selects only BLOCK_M / BLOCK_N / warps / stages, which change how the output is tiled, not how one
element is summed. Partials of a split are summed in split order. The M-bucket configs below must share
`W4Config.reduction_key()` (DEQUANT, BLOCK_K, SWAP_AB, split_k): `check_table` enforces it at import; tests/gpu/test_kernels_gpu.py checks the bits.

CPU: `w4a16_linear_reference` (dequantize, fp32 matmul) is the CPU path and the test oracle. Under
TRITON_INTERPRET=1 the Triton kernel runs on CPU tensors; the interpreter of triton 3.9 computes bf16
tl.dot wrongly, so there (and only there) the dot operands are upcast to fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .split_sum import split_sum
from .common import DTYPES, bucket, interpreting
from .w4_dequant import DEQ_BF16X2, DEQ_BF16X2_EMU, DEQ_FLOAT, DEQUANTS, load_dequant, pair_order

from kdtree_engine.quant import dequantize

# ----------------------------------------------------------------------------------------------
# configuration



@dataclass(frozen=True)
class W4Config:
    BLOCK_M: int = 16   # tokens per program (>= 16, tl.dot minimum)
    BLOCK_N: int = 64   # weight rows per program
    BLOCK_K: int = 256  # k per step (multiple of the group size and of 8)
    SWAP_AB: bool = True
    num_warps: int = 4
    num_stages: int = 4
    split_k: int | None = None  # None: chosen from (N, K) by _split_k
    DEQUANT: str = "float"  # "float" or "bf16x2" (PTX, bf16 x only; same tile bits), w4_dequant.py

    def __post_init__(self) -> None:
        if self.BLOCK_M < 16:
            raise ValueError(f"W4Config.BLOCK_M must be >= 16 (tl.dot), got {self.BLOCK_M}")
        if self.DEQUANT not in DEQUANTS:
            raise ValueError(f"W4Config.DEQUANT must be one of {tuple(DEQUANTS)}, got {self.DEQUANT!r}")

    def reduction_key(self) -> tuple:
        """The fields that fix how one output element is summed (must be equal across M buckets)."""
        if not self.SWAP_AB:
            # tokens are the MMA's M side: BLOCK_M 16 compiles to mma.sync, 64 to wgmma, and on the H200
            # the two sum a row's products differently (tests/gpu/test_kernels_gpu.py, measured)
            return (self.DEQUANT, self.BLOCK_K, self.SWAP_AB, self.split_k, self.BLOCK_M)
        return (self.DEQUANT, self.BLOCK_K, self.SWAP_AB, self.split_k)

    def as_dict(self) -> dict:
        return dict(DEQUANT=self.DEQUANT, BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N,
                    BLOCK_K=self.BLOCK_K, SWAP_AB=self.SWAP_AB, num_warps=self.num_warps,
                    num_stages=self.num_stages, split_k=self.split_k)


# All buckets share BLOCK_K and SWAP_AB (batch invariance, see module docstring).
REDUCTION_BLOCK_K = 256


def check_table(table: list[tuple[int, W4Config]] | list, what: str) -> None:
    """Every bucket of an M-bucket table must sum an output element the same way (batch invariance):
    equal `reduction_key()`; buckets sorted by max M."""
    keys = {cfg.reduction_key() for _, cfg in table}
    if len(keys) != 1:
        raise ValueError(f"{what}: all M buckets must share the reduction fields (batch invariance), "
                         f"got {sorted(map(str, keys))}")
    bounds = [m for m, _ in table]
    if bounds != sorted(bounds):
        raise ValueError(f"{what}: buckets must be sorted by max M, got {bounds}")


# (max M, config): the first bucket with M <= max M is used. Edit here to change the defaults; the
# bench's sweep (bench/kernels.py, bench/w4_sweep.py) prints candidates by name.
DENSE_CONFIGS: list[tuple[int, W4Config]] = [
    # bf16x2 with pipelined scales and split-K 2 (the split comes from _split_k) is the fastest at M = 1..16 on
    # the dense 36864 x 7168 matrix (docs/performance_history.md); fp16 / fp32 activations dequantize as "float"
    # with the same tiles
    (16, W4Config(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3, DEQUANT="bf16x2")),
    (32, W4Config(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3, DEQUANT="bf16x2")),
    (64, W4Config(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, DEQUANT="bf16x2")),
    (1 << 62, W4Config(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2, DEQUANT="bf16x2")),
]
check_table(DENSE_CONFIGS, "DENSE_CONFIGS")
# Shared memory per pipeline stage ~ BLOCK_N*BLOCK_K/2 (int4) + BLOCK_M*BLOCK_K*2 (x) bytes, plus one
# dequantized [BLOCK_N, BLOCK_K] tile when the MMA reads it from shared memory: keep the total under
# ~200 KB (Hopper: 227 KB per block).

# Programs we want in flight before splitting K (the H200 has 132 SMs; 8 per SM measured best, see
# DENSE_CONFIGS). A constant (not the device's SM count) so that the reduction order is the same on
# every device.
_TARGET_PROGRAMS = 1056
_SPLIT_REF_BLOCK_N = 64


def dense_config(M: int) -> W4Config:
    return bucket(DENSE_CONFIGS, M)


def _split_k(N: int, K: int, block_k: int) -> int:
    """Split-K factor from (N, K) only: enough programs for the GPU, at least 4 K-steps per split."""
    n_tiles = triton.cdiv(N, _SPLIT_REF_BLOCK_N)
    k_steps = triton.cdiv(K, block_k)
    split = 1
    while n_tiles * split < _TARGET_PROGRAMS and split * 2 <= 16 and k_steps // (split * 2) >= 4:
        split *= 2
    return split


def k_splits(K: int, block_k: int, want: int) -> tuple[int, int]:
    """(splits, K per split) of a K loop of block_k tiles cut into at most `want` splits of whole tiles;
    splits that would be empty are dropped."""
    k_per_split = triton.cdiv(triton.cdiv(K, block_k), want) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def fp32_stages(num_stages: int, dtype: torch.dtype) -> int:
    """fp32 tiles are twice the bytes (and the fp32 dot reads both operands from shared memory):
    two stages keep the shared memory of the default configs under Hopper's 227 KB."""
    return min(num_stages, 2) if dtype == torch.float32 else num_stages




_DTYPES = DTYPES

# ----------------------------------------------------------------------------------------------
# Triton building blocks (shared with moe_w4a16.py)


@triton.jit
def mma_tile(acc, w, x, SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """acc += w @ x.T ([BN, BM], SWAP_AB) or x @ w.T ([BM, BN])."""
    if UPCAST:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PREC)
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PREC)
    return acc


# ----------------------------------------------------------------------------------------------
# dense kernel


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr,
                  M, N, K, k_per_split,
                  stride_xm, stride_wn, stride_sn, stride_om, stride_os,
                  G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP_AB: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                  OUT_F32: tl.constexpr, DEQ: tl.constexpr = 0, EVEN: tl.constexpr = False):
    # grid: (m tiles [fastest, so tiles sharing a weight tile run together], n tiles, splits)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty  # compute dtype = x.dtype

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    for k0 in range(k_start, k_end, BLOCK_K):
        wt = load_dequant(w_ptr, s_ptr, offs_n, n_mask, stride_wn, stride_sn, k0, k_end,
                           G, BLOCK_N, BLOCK_K, DTYPE, DEQ, EVEN)
        kk = k0 + offs_k
        if EVEN:
            xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None], other=0.0)
        else:
            xt = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < k_end), other=0.0)
        acc = mma_tile(acc, wt, xt, SWAP_AB, UPCAST, PREC)

    if SWAP_AB:
        acc = tl.trans(acc)
    o_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    if OUT_F32:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


# ----------------------------------------------------------------------------------------------
# Python entry points


def check_w4(packed: torch.Tensor, scale: torch.Tensor, group_size: int, K: int, what: str = "weight"):
    if packed.dtype != torch.int32:
        raise TypeError(f"{what}: packed INT4 weights must be int32, got {packed.dtype}")
    if group_size not in (32, 64, 128) or K % group_size:
        raise ValueError(f"{what}: group_size {group_size} must be 32/64/128 and divide K={K}")
    if packed.shape[-1] * 8 != K:
        raise ValueError(f"{what}: packed has {packed.shape[-1]} int32 per row, expected K/8 = {K // 8}")
    if scale.shape[-1] * group_size != K or scale.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} does not match packed "
                         f"{tuple(packed.shape)} with group {group_size}")
    if packed.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError(f"{what}: packed and scale must be contiguous along K")


def deq_code(dequant: str, dtype: torch.dtype) -> int:
    """The kernels' DEQ constexpr for a config's DEQUANT and the activation dtype. "bf16x2" is defined
    for bf16 activations (the tile is bf16); fp16 / fp32 activations always dequantize in fp32, as the
    field's documentation says. Under the interpreter the PTX is replaced by its plain-Triton twin."""
    if dequant == "bf16x2" and dtype == torch.bfloat16:
        return DEQ_BF16X2_EMU if interpreting() else DEQ_BF16X2
    return DEQ_FLOAT


def w4a16_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """Dequantize then x @ W.T with fp32 accumulation; [M, K] -> [M, N] in x.dtype."""
    w = dequantize(packed, scale, group_size, torch.float32)  # [N, K]
    return (x.float() @ w.T).to(x.dtype)


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int,
                 config: W4Config | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32), packed int32 [N, K/8], scale [N, K/g] -> [M, N] in x.dtype (Triton).

    `config` overrides the M-bucket default (benchmarks / sweeps)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x dtype {x.dtype} not supported (bf16, fp16, fp32)")
    M, K = x.shape
    N = packed.shape[0]
    check_w4(packed, scale, group_size, K)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = config or dense_config(M)
    block_k = max(cfg.BLOCK_K, group_size)
    split, k_per_split = k_splits(K, block_k, cfg.split_k if cfg.split_k is not None else _split_k(N, K, block_k))
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    interp = interpreting()
    upcast = interp
    prec = "ieee" if (x.dtype == torch.float32 or upcast) else "tf32"
    target = out if split == 1 else torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, cfg.BLOCK_M), triton.cdiv(N, cfg.BLOCK_N), split)
    even = N % cfg.BLOCK_N == 0 and K % block_k == 0
    deq = deq_code(cfg.DEQUANT, x.dtype)
    if deq in (DEQ_BF16X2, DEQ_BF16X2_EMU):
        x = pair_order(x)   # the bf16x2 tiles' column order (w4_dequant.py)
    _w4a16_kernel[grid](
        x, packed, scale, target, M, N, K, k_per_split,
        x.stride(0), packed.stride(0), scale.stride(0), N, M * N,
        G=group_size, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        SWAP_AB=cfg.SWAP_AB, UPCAST=upcast, PREC=prec, OUT_F32=split > 1,
        DEQ=deq, EVEN=even,
        num_warps=cfg.num_warps, num_stages=fp32_stages(cfg.num_stages, x.dtype))
    if split > 1:
        split_sum(target, out, split)
    return out


__all__ = ["W4Config", "check_table", "deq_code", "DENSE_CONFIGS", "REDUCTION_BLOCK_K",
           "dense_config", "w4a16_linear", "w4a16_linear_reference", "check_w4", "interpreting", "fp32_stages"]
