"""Router logits on the FMA pipes with per-thread output tiles (Gluon, sm_90, GPU only): the generic
batch-invariant GEMM's float32 arithmetic (gemm.py on x.float(): per split of k_per_split keys one fp32
FMA chain in k order, the splits added in order), bit for bit, without its x.float() copy and at a fraction
of its time.

    part[s, m, n] = fma chain over k in split s of ( x[m, k], w[n, k] )        (x upcast exactly in the load)

The generic GEMM runs this arithmetic as a Triton FMA dot whose layout Triton picks (two or four outputs a
thread, an operand load for every FMA or two: 58 us at M = 64 for the K2 gate, bench/results/router-h200-tiles.md).
Here the layout is explicit (a BlockedLayout accumulator, operands loaded straight into its dot-operand
layouts, KB keys a step):

    tile     tokens x rows   per thread            per KB-step loads / FMAs
    TM = 16  16 x 32         1 x 4  outputs        1 + 4 rows of KB / 4 KB
    TM = 64  64 x 32         4 x 4  outputs        4 + 4 rows of KB / 16 KB

grid (rows / 32, splits, token tiles); the tile only re-tiles: every output is the same chain whatever M
or the tile (the FMA dot lowers to one fma per k, in k order, per output). Keys past a split's end inside the
generic GEMM's last BLOCK_K step are loaded as zeros here too, so the two run the same FMAs. The GPU tests
hold it to the generic GEMM bit for bit (tests/gpu/test_router_gemm_gpu.py).
"""

from __future__ import annotations

import torch
import triton

from .common import DTYPES
from .gemm import reduction_for
from .pdl import PDL_ASM, pdl_launch, pdl_supported
from .split_sum import split_sum

try:  # Gluon exists in triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed in triton 3.7
    HAVE_GLUON = hasattr(gl, "dot_fma")
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
    HAVE_GLUON = False

BN = 32      # weight rows a program
KB = 16      # keys a step (the dot's least K)
KST = 64     # keys a stage of the shared-memory ring (cp.async): KST // KB steps
STAGES = 4   # stages in the ring, STAGES - 1 of them in flight


def tile_rows(M: int) -> int:
    """Tokens a program (speed only: the same bits at any tile)."""
    return 16 if M <= 16 else 64


def unsupported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why the FMA router kernel cannot take these operands here (None: it can)."""
    if not HAVE_GLUON:
        return "triton without Gluon's dot_fma"
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] < 9:
        return "not a CUDA device of compute capability 9.0 or later"
    if w.dtype != torch.float32 or x.dtype not in DTYPES:
        return f"w {w.dtype}, x {x.dtype} (a float32 gate, float activations)"
    if any(t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16 or t.stride(1) != 1 for t in (x, w)):
        return "operands whose rows are not 16-byte aligned and contiguous (16-byte copies)"
    if reduction_for(w.shape[0], w.shape[1], torch.float32).BLOCK_K % KB:
        return f"the generic GEMM's BLOCK_K is not a multiple of {KB}"
    return None


if HAVE_GLUON:
    WAIT_ASM = gl.constexpr(PDL_ASM)

    @gluon.jit
    def _router_fma_kernel(x_ptr, w_ptr, part_ptr, M, N, K, KPS, stride_xm, stride_wn, stride_ps, stride_pm,
                           TM: gl.constexpr, BN: gl.constexpr, KB: gl.constexpr, KST: gl.constexpr, BK: gl.constexpr,
                           XV: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
        SPT_M: gl.constexpr = TM // 16
        ACC: gl.constexpr = gl.BlockedLayout([SPT_M, 4], [4, 8], [4, 1], [1, 0])
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=0)
        B_L: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=ACC, k_width=0)
        # B_L's thread mapping (a lane holds 4 weight rows, lanes 8 row groups, the token lanes and warps copies)
        # with the keys innermost in a thread's registers: vector reads along a weight row
        W_L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2]], lane_bases=[[0, 4], [0, 8], [0, 16], [0, 0], [0, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[KB, BN])
        # the copies of a stage (KST keys): 16 bytes a thread, a row's bytes across lanes
        XC: gl.constexpr = gl.BlockedLayout([1, XV], [32 * XV // KST, KST // XV], [4, 1], [1, 0])
        WC: gl.constexpr = gl.BlockedLayout([1, 4], [128 // KST, KST // 4], [4, 1], [1, 0])
        XS: gl.constexpr = gl.SwizzledSharedLayout(vec=XV, per_phase=1, max_phase=8, order=[1, 0])
        WS: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        pid_m = gl.program_id(2)
        k0 = pid_s * KPS
        k_end = gl.minimum(K, k0 + KPS)
        k_pad = k0 + (k_end - k0 + BK - 1) // BK * BK      # the generic GEMM's last BLOCK_K step ends here
        stages = (k_pad - k0 + KST - 1) // KST
        xr = pid_m * TM + gl.arange(0, TM, layout=gl.SliceLayout(1, XC))
        xk = gl.arange(0, KST, layout=gl.SliceLayout(0, XC))
        wr = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WC))
        wk = gl.arange(0, KST, layout=gl.SliceLayout(0, WC))
        x_src = x_ptr + xr.to(gl.int64)[:, None] * stride_xm + (k0 + xk)[None, :]
        w_src = w_ptr + wr.to(gl.int64)[:, None] * stride_wn + (k0 + wk)[None, :]
        x_ok = (xr < M)[:, None]
        w_ok = (wr < N)[:, None]
        x_s = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, TM, KST], XS)
        w_s = gl.allocate_shared_memory(gl.float32, [STAGES, BN, KST], WS)
        for i in gl.static_range(STAGES - 1):   # the first weight stages go out before the dependent-launch wait
            async_copy.async_copy_global_to_shared(w_s.index(i), w_src + i * KST,
                                                   mask=w_ok & ((k0 + i * KST + wk) < k_end)[None, :])
        if PDL:
            gl.inline_asm_elementwise(WAIT_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        for i in gl.static_range(STAGES - 1):
            async_copy.async_copy_global_to_shared(x_s.index(i), x_src + i * KST,
                                                   mask=x_ok & ((k0 + i * KST + xk) < k_end)[None, :])
            async_copy.commit_group()
        acc = gl.zeros([TM, BN], gl.float32, layout=ACC)
        for i in range(stages):
            async_copy.wait_group(STAGES - 2)   # stage i in shared memory (this thread's copies)
            cta_barrier()                       # everyone's copies of stage i in; everyone done with stage i - 1
            j = i + STAGES - 1                  # refill the slot stage i - 1 used with stage j
            kj = k0 + j * KST
            async_copy.async_copy_global_to_shared(x_s.index(j % STAGES), x_src + j * KST,
                                                   mask=x_ok & ((kj + xk) < k_end)[None, :])
            async_copy.async_copy_global_to_shared(w_s.index(j % STAGES), w_src + j * KST,
                                                   mask=w_ok & ((kj + wk) < k_end)[None, :])
            async_copy.commit_group()
            xt = x_s.index(i % STAGES)
            wt = w_s.index(i % STAGES)
            for q in gl.static_range(KST // KB):
                if k0 + i * KST + q * KB < k_pad:
                    xa = xt.slice(q * KB, KB, dim=1).load(A_L).to(gl.float32)
                    wb = gl.convert_layout(wt.slice(q * KB, KB, dim=1).permute((1, 0)).load(W_L), B_L)
                    acc = gl.dot_fma(xa, wb, acc)
        async_copy.wait_group(0)
        om = pid_m * TM + gl.arange(0, TM, layout=gl.SliceLayout(1, ACC))
        on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
        gl.store(part_ptr + pid_s.to(gl.int64) * stride_ps + om.to(gl.int64)[:, None] * stride_pm + on[None, :], acc,
                 mask=(om < M)[:, None] & (on < N)[None, :])


def router_partials(x: torch.Tensor, w: torch.Tensor, pdl: bool) -> torch.Tensor:
    """x [M, K] @ w [N, K].T as the generic GEMM's split partials [S, M, N] (float32; their sum in split order,
    split_sum's, is bi_linear(x.float(), w)). pdl: a dependent launch (pdl.py)."""
    M, K = x.shape
    N = w.shape[0]
    red = reduction_for(N, K, torch.float32)
    kps = red.k_per_split(K)
    splits = red.n_splits(K)
    part = torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
    if M == 0 or N == 0:
        return part
    tm = tile_rows(M)
    _router_fma_kernel[(triton.cdiv(N, BN), splits, triton.cdiv(M, tm))](
        x, w, part, M, N, K, kps, x.stride(0), w.stride(0), M * N, N, TM=tm, BN=BN, KB=KB, BK=red.BLOCK_K,
        KST=KST, XV=16 // x.element_size(), STAGES=STAGES, num_warps=4, **pdl_launch(pdl))
    return part


def router_logits_fma(x: torch.Tensor, w: torch.Tensor, *, partials: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] float32 with the generic GEMM's bits (bi_linear(x.float(), w)); partials:
    the split partials [S, M, N] instead (the router tail adds them in split order). Where `unsupported` is None."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"router_logits_fma: x [M, K] and w [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    pdl = pdl_supported(x.device)
    parts = router_partials(x, w, pdl)
    if partials:
        return parts
    out = torch.empty(parts.shape[1:], device=x.device, dtype=torch.float32)
    split_sum(parts, out, parts.shape[0], pdl=pdl)
    return out


__all__ = ["BN", "KB", "router_logits_fma", "router_partials", "tile_rows", "unsupported"]
