"""Fused MoE over fragment-ordered INT4 experts (GPU only, Gluon): the routed-expert GEMMs of
`moe_w4a16.fused_moe_w4a16` with the weights loaded straight into mma.sync registers (w4_frag.py).

Stacked expert tensors, repacked once at load by `frag_repack` (same shapes and bytes per row):
  w13 int32 [E, 2I, H/8], scale [E, 2I, H/g]   rows 0..I-1 gate_proj, I..2I-1 up_proj
  w2  int32 [E, H, I/8],  scale [E, H, I/g]

Launches (no host synchronisation; CUDA-graph capturable), the align, SwiGLU and top-k sum kernels
shared with moe_w4a16.py:
  1. align: pairs (t, j) grouped by expert into blocks of BLOCK_M rows (the MMA's token columns);
  2. gate/up (_moe_frag_kernel, GATE_UP): grid (blocks, programs): each expert block's work, 64-row tiles
     (gate rows and the matching up rows) x K blocks over H, cut by the stream partition (moe_plan) into
     equal ranges; each run of a range within one tile is one fp32 gate / up partial;
  3. SwiGLU: a column's partials summed in slot order, silu(g) * u -> inter [P, I] (bf16);
  4. down (the same kernel): the same over H-row tiles x K blocks over I: router weight x partial -> y;
  5. top-k sum: out[t] = sum over j, then the column's slots, of y (fixed order).
Launches of up to FUSE_MAX_PAIRS pairs on mma.sync blocks do 3 and 5 in the GEMMs instead: the last program to
finish a tile (an arrival counter per tile) sums its partials in the same order (fused_epilogues).
A pair's column of an MMA tile is summed over the same k blocks in the same order whatever the other
columns hold, and the partitions are fixed by the expert shape, top-k and the SM count (never by T), so a
token's output does not depend on the batch (batch invariance).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from kdtree_engine.kernels.moe_w4a16 import check_add, moe_align, moe_swiglu, moe_topk_sum
from kdtree_engine.kernels.split_sum import Partition
from kdtree_engine.kernels.w4_dequant import DEQ_FLOAT
from kdtree_engine.kernels.common import bucket
from kdtree_engine.kernels.pdl import pdl_launch, pdl_supported
from kdtree_engine.kernels.layouts import MOE_PARTITION_ROWS, frag_gpb, frag_moe_unsupported, tile_unsupported
from kdtree_engine.kernels.w4_frag import HAVE_GLUON, dense_partition, stream_programs, word_layout

if HAVE_GLUON:   # optional: the Gluon kernels exist only on a triton with gluon (w4_frag.HAVE_GLUON)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from kdtree_engine.kernels.w4_frag import (frag_loop, frag_loop_wg, stream_program_gl, word_ptrs, cta_barrier,
                                               mma_layout, operand_layout, pdl_wait_gl, wg_a_layout, wg_layout,
                                               wg_x_layout, WG_X_SMEM, x_layout)


@dataclass(frozen=True)
class FragMoEConfig:
    BLOCK_M: int = 8       # token rows per expert block = the MMA's token columns (re-tiles only): 8 or 16 on
    #                        mma.sync (32 / 64 would hold a [256 x 32 / 64] activation operand per thread: spills),
    #                        32 or 64 on wgmma (w4_frag.frag_loop_wg: activations in shared memory; one
    #                        warpgroup; the same bits as mma.sync, GPU-tested). Programs are 4 warps of one
    #                        16-row MMA tile each: one 64-row partition tile (MOE_PARTITION_ROWS)
    P13: int | None = None   # gate/up programs per expert block (part of the reduction; None: moe_plan)
    P2: int | None = None    # down programs per expert block (part of the reduction; None: moe_plan)
    GPB: int | None = None       # groups per K block of both matrices (None: frag_gpb(K) of each)

    @property
    def wgmma(self) -> bool:
        """Whether the expert blocks run on wgmma (more than 16 token rows) rather than mma.sync."""
        return self.BLOCK_M > 16

    def __post_init__(self) -> None:
        if self.BLOCK_M not in (8, 16, 32, 64):
            raise ValueError(f"FragMoEConfig.BLOCK_M must be 8, 16, 32 or 64, got {self.BLOCK_M}")
        for name in ("P13", "P2"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"FragMoEConfig.{name} must be None or >= 1 programs per expert block, got {v}")


EPI_BLOCK = 256           # elements per program of the SwiGLU and top-k sum launches (elementwise: any size, the same bits)
MOE_WARPS = 4             # one 16-row MMA tile each: the MOE_PARTITION_ROWS rows of a program (layouts.py)
MOE_GATE_UP_PER_SM = 3    # programs per SM the 8-token gate/up kernel holds: its stream partition fills one wave
#                           with a token's top-k expert blocks
MOE_DOWN_PER_SM = None    # the down GEMM (few K blocks) runs whole row tiles (one partial): its stream partition
#                           measured no faster (docs/performance_history.md)


def moe_plan(rows: int, K: int, gpb: int, sms: int, top_k: int, per_sm: int | None) -> Partition:
    """The partition of one expert block's GEMM over `rows` output rows (64-row tiles) x K (blocks of 32 * gpb):
    per_sm None: one program per row tile over the whole of K; else the stream partition whose programs let a
    token's top_k expert blocks fill one wave of per_sm programs per SM (w4_frag.stream_programs). Fixed by the
    shape, top_k and the device, never by T: it is part of the reduction. Tile-aligned K splits left a partial
    wave at T = 1, which the stream partition fills."""
    tiles, iters = rows // MOE_PARTITION_ROWS, K // (32 * gpb)
    programs = tiles if per_sm is None else stream_programs(tiles, iters, sms * per_sm // max(top_k, 1))
    return Partition(MOE_PARTITION_ROWS, tiles, iters, programs)


# (max pairs per expert = cdiv(T * top_k, E), config); first match wins; all share the reduction (partitions,
# GPB): only BLOCK_M differs (a re-tiling). 8-row blocks up to 8 pairs per expert, 16-row blocks up to 16 (one
# block per expert either way; a 32-column wgmma doubles the MMA work), 32-row wgmma blocks beyond (measured on
# the K2 layer; 64-row blocks measured slower on prefill chunks: docs/performance_history.md).
FRAG_MOE_CONFIGS: list[tuple[int, FragMoEConfig]] = [
    (8, FragMoEConfig(BLOCK_M=8)),
    (16, FragMoEConfig(BLOCK_M=16)),
    (1 << 62, FragMoEConfig(BLOCK_M=32)),
]
# Launches of up to this many (token, expert) pairs do the SwiGLU and the top-k sum in the GEMMs' last programs
# (_moe_frag_kernel FUSE) instead of their own launches: it saves two launches for one token, but in launches of
# several waves every program waits on its arrival atomic before it frees its slot (docs/performance_history.md).
FUSE_MAX_PAIRS = 8


def fused_epilogues(pairs: int, cfg: FragMoEConfig) -> bool:
    """Whether a launch of `pairs` pairs fuses its SwiGLU and top-k sum into the GEMMs (mma.sync blocks only; the
    top-k sum also needs whole-tile down programs). Any choice gives the same bits."""
    return pairs <= FUSE_MAX_PAIRS and not cfg.wgmma


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, n13: int, n2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arrival counters of the fused epilogues (gate/up: per block and row tile; down: per row tile), int32 zeros
    kept per device: each launch's last program of a tile sets its counter back to 0. One MoE launch at a time
    per device (the engine's layers run one after another)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n13 + n2:
        buf = _COUNTERS[device] = torch.zeros(max(n13 + n2, 4096), device=device, dtype=torch.int32)
    return buf[:n13], buf[n13:n13 + n2]


def frag_moe_config(num_pairs: int, num_experts: int) -> FragMoEConfig:
    return bucket(FRAG_MOE_CONFIGS, -(-num_pairs // max(num_experts, 1)))


if HAVE_GLUON:
    @gluon.jit
    def _block_pairs(sorted_ptr, pid_b, rows, TOK: gl.constexpr, layout: gl.constexpr):
        r = gl.arange(0, TOK, layout=layout)
        ok = r < rows
        return gl.load(sorted_ptr + pid_b * TOK + r, mask=ok, other=0), ok

    @gluon.jit
    def _last_arrival(cnt_ptr, n):
        """Whether this program is the last of the n that count at cnt_ptr (the last one zeroes it for the next
        launch). Every thread's stores before it are visible to the last program's loads after it: a CTA barrier,
        then one acquire-release atomic at GPU scope."""
        cta_barrier()
        last = gl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
        if last:
            gl.store(cnt_ptr, 0)
        return last

    @gluon.jit
    def _swiglu_tile(part_ptr, inter_ptr, o_base, i_ptrs, o_mask, up_row, stride_os, n_slots,
                     SLOTS: gl.constexpr, BN: gl.constexpr, TOK: gl.constexpr, MMA: gl.constexpr):
        """moe_w4a16._moe_swiglu_kernel on one [BN, TOK] tile: the gate / up partials summed in slot order (the
        tile's n_slots of at most SLOTS), silu(g) * u into inter: the same operations in the same order."""
        g = gl.zeros([BN, TOK], gl.float32, layout=MMA)
        u = gl.zeros([BN, TOK], gl.float32, layout=MMA)
        for sp in gl.static_range(SLOTS):
            if sp < n_slots:
                g = g + gl.load(o_base + sp * stride_os, mask=o_mask, other=0.0, cache_modifier=".cg")
                u = u + gl.load(o_base + sp * stride_os + up_row, mask=o_mask, other=0.0, cache_modifier=".cg")
        h = g / (1.0 + gl.exp(-g)) * u
        gl.store(i_ptrs, h.to(inter_ptr.dtype.element_ty), mask=o_mask)

    @gluon.jit
    def _topk_sum_tile(y_ptr, ids_ptr, fin_ptr, add_ptr, n0, n_tok, n_experts, stride_ot, stride_ft, stride_at,
                       TOPK: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr, ADD: gl.constexpr):
        """moe_w4a16._moe_topk_sum_kernel on one row tile (one slot: whole-tile down programs): out[t, n0 + i] =
        the router-weighted down rows of t's pairs summed in top-k order (pairs outside [0, E) skipped); ADD: that
        rounded, plus add[t, n0 + i], rounded once (moe_w4a16.add_rounded)."""
        n = n0 + gl.arange(0, BN, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        for t in range(n_tok):
            acc = gl.zeros([BN], gl.float32, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
            for j in gl.static_range(TOPK):
                pj = t * TOPK + j
                eid = gl.load(ids_ptr + pj)
                if (eid >= 0) & (eid < n_experts):
                    acc = acc + gl.load(y_ptr + pj.to(gl.int64) * stride_ot + n, cache_modifier=".cg")
            res = acc.to(fin_ptr.dtype.element_ty)
            if ADD:
                other = gl.load(add_ptr + t.to(gl.int64) * stride_at + n)
                res = (res.to(gl.float32) + other.to(gl.float32)).to(fin_ptr.dtype.element_ty)
            gl.store(fin_ptr + t.to(gl.int64) * stride_ft + n, res)

    @gluon.jit
    def _down_arrival(y_ptr, cnt_ptr, ids_ptr, fin_ptr, add_ptr, tile, n_tok, n_experts, stride_ot, stride_ft,
                      stride_at, TOPK: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr, ADD: gl.constexpr):
        """A whole-tile down program (of any expert block, an empty one too) done with row tile `tile`: the last of
        the launch's blocks to get there writes the tile's top-k sum (_topk_sum_tile)."""
        if _last_arrival(cnt_ptr + tile, gl.num_programs(0)):
            _topk_sum_tile(y_ptr, ids_ptr, fin_ptr, add_ptr, tile * BN, n_tok, n_experts, stride_ot, stride_ft,
                           stride_at, TOPK, BN, num_warps, ADD)

    @gluon.jit(do_not_specialize=["n_tok"])  # the token count bounds masks: one variant per length bucket
    def _moe_frag_kernel(x_ptr, w_ptr, s_ptr, out_ptr, tw_ptr, sorted_ptr, blk_expert_ptr, blk_rows_ptr,
                         UP_ROW, TOPK, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                         stride_os, stride_ot, iters, work, programs,
                         fin_ptr, stride_ft, cnt_ptr, ids_ptr, n_tok, n_experts, add_ptr, stride_at,
                         GATE_UP: gl.constexpr, TOK: gl.constexpr, GPB: gl.constexpr, WL: gl.constexpr,
                         PDL: gl.constexpr, TILE: gl.constexpr,
                         SEGS: gl.constexpr, WHOLE: gl.constexpr, num_warps: gl.constexpr, WG: gl.constexpr = False,
                         FUSE: gl.constexpr = False, SLOTS: gl.constexpr = 1, TOPK_C: gl.constexpr = 8,
                         ADD: gl.constexpr = False, STILE: gl.constexpr = 0):
        """grid (blocks, programs): one expert block's pairs over program p's range of the stream partition of
        (N / BN) row tiles x iters K blocks, row tile major (moe_plan): global blocks
        [p * work // programs, (p + 1) * work // programs), each run of them within one tile (a segment,
        unrolled: SEGS) one partial, written to out[slot, pair, n] with slot its index among the tile's segments.
        STILE: the scales' order (w4_frag.word_ptrs). WHOLE: one program per row tile over all of K (programs =
        N / BN: program p is tile p, one partial; without the division the 8-token down program keeps 9 fewer
        registers).
        GATE_UP: x [T, H] rows pair // TOPK, weight rows n and UP_ROW + n -> out[slot, pair, n] and
        out[slot, pair, UP_ROW + n] (fp32 gate / up partials). Else (down): x = inter [P, I] rows pair ->
        out[slot, pair, n] = router weight x the partial down sum. PDL (pdl.py): launched dependent on the
        align launch (gate/up: waits first) or the SwiGLU launch (down: waits after its first weight loads;
        the blocks are two launches back, complete). WG: wgmma programs (w4_frag.frag_loop_wg, one
        warpgroup).
        FUSE (fused_moe_frag's small launches): the epilogue launches' work done by the last program of each tile
        (_last_arrival on cnt_ptr): gate/up, the SwiGLU of the tile's partials (at most SLOTS) into fin = inter
        [P, I]; down (whole tiles), the top-k sum of the row tile over all blocks into fin = out [n_tok, H] (ids:
        the pairs' experts, TOPK_C per token), plus add [n_tok, H] where ADD. The same operations in the same order
        as those launches."""
        BN: gl.constexpr = 16 * num_warps
        BK: gl.constexpr = 32 * GPB
        MMA: gl.constexpr = wg_layout(TOK, num_warps) if WG else mma_layout(num_warps)
        pid_b = gl.program_id(0)
        if GATE_UP and PDL:
            pdl_wait_gl()
        rows = gl.load(blk_rows_ptr + pid_b)
        if rows == 0:
            if FUSE and not GATE_UP:   # an empty block still counts towards its row tile's sum
                _down_arrival(out_ptr, cnt_ptr, ids_ptr, fin_ptr, add_ptr, gl.program_id(1), n_tok, n_experts,
                              stride_ot, stride_ft, stride_at, TOPK_C, BN, num_warps, ADD)
            return
        e = gl.load(blk_expert_ptr + pid_b).to(gl.int64)
        p = gl.program_id(1)
        g = p * work // programs
        end = (p + 1) * work // programs
        we = w_ptr + e * stride_we
        se = s_ptr + e * stride_se
        if WG:
            xs = gl.allocate_shared_memory(gl.bfloat16, [2, TOK, BK], WG_X_SMEM)
        for _seg in gl.static_range(SEGS):   # unrolled, as in w4_frag._w4_frag_kernel
            if g < end:
                if WHOLE:
                    b0 = 0
                    nb = iters
                    slot = 0
                    n0 = p * BN
                else:
                    t = g // iters
                    b0 = g - t * iters
                    nb = gl.minimum(iters - b0, end - g)
                    slot = p - stream_program_gl(t * iters, work, programs)
                    n0 = t * BN
                w0, s0 = word_ptrs(we, se, n0, stride_wn, stride_sn, b0, WL, BN, GPB, TILE, STILE)
                if GATE_UP:
                    w1, s1 = word_ptrs(we, se, UP_ROW + n0, stride_wn, stride_sn, b0, WL, BN, GPB, TILE, STILE)
                else:
                    w1, s1 = w0, s0
                acc0 = gl.zeros([BN, TOK], gl.float32, layout=MMA)
                acc1 = gl.zeros([BN, TOK], gl.float32, layout=MMA)
                # the activation pointers per segment (a pointer tensor kept across segments costs registers)
                if WG:
                    # the block's activations [TOK, BK] (k contiguous) into shared memory: the wgmma B operand
                    XW: gl.constexpr = wg_x_layout(BK, num_warps)
                    pair, ok = _block_pairs(sorted_ptr, pid_b, rows, TOK, gl.SliceLayout(1, XW))
                    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, XW))
                    xr = (pair // TOPK).to(gl.int64) if GATE_UP else pair.to(gl.int64)
                    x_ptrs = x_ptr + gl.expand_dims(xr, 1) * stride_xt + gl.expand_dims(rk, 0) + b0 * BK
                    cta_barrier()   # the buffers' last reader (the previous segment's MMA) is done
                    acc0, acc1 = frag_loop_wg(acc0, acc1, w0, s0, w1, s1, x_ptrs, gl.expand_dims(ok, 1), nb, xs,
                                               GATE_UP, wg_a_layout(TOK, num_warps), BN, GPB, PDL and not GATE_UP,
                                               TILE, STILE)
                else:
                    AL: gl.constexpr = operand_layout(0, num_warps)
                    BL: gl.constexpr = operand_layout(1, num_warps)
                    XL: gl.constexpr = x_layout(BK, num_warps)
                    pair, ok = _block_pairs(sorted_ptr, pid_b, rows, TOK, gl.SliceLayout(0, XL))
                    rk = gl.arange(0, BK, layout=gl.SliceLayout(1, XL))
                    xr = (pair // TOPK).to(gl.int64) if GATE_UP else pair.to(gl.int64)
                    # the block offset added last: folded into the tensor first it cost the 16-token down 39 registers
                    x_ptrs = x_ptr + gl.expand_dims(xr, 0) * stride_xt + gl.expand_dims(rk, 1) + b0 * BK
                    acc0, acc1 = frag_loop(acc0, acc1, w0, s0, w1, s1, x_ptrs, gl.expand_dims(ok, 0), nb, GATE_UP,
                                           AL, BL, BN, GPB, PDL and not GATE_UP, TILE, STILE=STILE)
                # the output pointers after the K loop (not live through it)
                pair_o, ok_o = _block_pairs(sorted_ptr, pid_b, rows, TOK, gl.SliceLayout(0, MMA))
                if not GATE_UP:
                    tw = gl.load(tw_ptr + pair_o, mask=ok_o, other=0.0).to(gl.float32)
                    acc0 = acc0 * gl.expand_dims(tw, 0)
                on = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
                o_ptrs = (out_ptr + slot * stride_os + gl.expand_dims(pair_o.to(gl.int64), 0) * stride_ot + n0
                          + gl.expand_dims(on, 1))
                o_mask = gl.expand_dims(ok_o, 0)
                gl.store(o_ptrs, acc0, mask=o_mask)
                if GATE_UP:
                    gl.store(o_ptrs + UP_ROW, acc1, mask=o_mask)
                if FUSE:
                    if GATE_UP:
                        if WHOLE:
                            n_slots = 1
                            last = True
                        else:
                            n_slots = (stream_program_gl(t * iters + iters - 1, work, programs)
                                       - stream_program_gl(t * iters, work, programs) + 1)
                            last = _last_arrival(cnt_ptr + pid_b * (work // iters) + t, n_slots)
                        if last:
                            i_ptrs = (fin_ptr + gl.expand_dims(pair_o.to(gl.int64), 0) * stride_ft + n0
                                      + gl.expand_dims(on, 1))
                            _swiglu_tile(out_ptr, fin_ptr, o_ptrs - slot * stride_os, i_ptrs, o_mask, UP_ROW,
                                         stride_os, n_slots, SLOTS, BN, TOK, MMA)
                    else:   # whole tiles: program p is row tile p
                        _down_arrival(out_ptr, cnt_ptr, ids_ptr, fin_ptr, add_ptr, p, n_tok, n_experts, stride_ot,
                                      stride_ft, stride_at, TOPK_C, BN, num_warps, ADD)
                g += nb


def fused_moe_frag(x: torch.Tensor, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor,
                   w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   group_size: int, config: FragMoEConfig | None = None, tile: int = 0,
                   add: torch.Tensor | None = None, stile: int = 0, plan_topk: int | None = None) -> torch.Tensor:
    """x [T, H] bf16 -> [T, H] bf16: routed experts only; w13_q / w2_q in fragment order (frag_repack with
    frag_gpb of each matrix's input width, or config.GPB), row-major (tile 0) or each matrix in frag_tile's
    order of `tile` rows (the same bits); the scales row-major (stile 0) or in scale_tile's order of `stile` rows
    (the same bits). add [T, H] bf16 (e.g. the shared expert's output): added in the top-k
    sum, the bits of `fused_moe_frag(...) + add`. plan_topk: the expert blocks a token is planned to fill the
    device with (default topk_ids' width; an expert-parallel rank serves about top_k / ranks of a token's routes,
    the rest are -1): like the partition it plans, fixed by the model and the device, never by T."""
    if not HAVE_GLUON:
        raise RuntimeError("fused_moe_frag needs triton.experimental.gluon (triton >= 3.5)")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"fused_moe_frag: x must be [T, H] bfloat16, got {tuple(x.shape)} {x.dtype}")
    T, H = x.shape
    check_add(add, x, "fused_moe_frag")
    E, two_i, _ = w13_q.shape
    I = two_i // 2
    topk = topk_ids.shape[1]
    P = T * topk
    cfg = config or frag_moe_config(P, E)
    why = frag_moe_unsupported(H, I, group_size)
    if why:
        raise ValueError(f"fused_moe_frag: {why}")
    for name, q, sc, n, k in (("w13", w13_q, w13_scale, 2 * I, H), ("w2", w2_q, w2_scale, H, I)):
        if (q.dtype != torch.int32 or sc.dtype != torch.bfloat16 or not (q.is_contiguous() and sc.is_contiguous())
                or q.shape != (E, n, k // 8) or sc.shape != (E, n, k // group_size)):
            raise ValueError(f"fused_moe_frag: {name} must be contiguous int32 [{E}, {n}, {k // 8}] words and bf16 "
                             f"[{E}, {n}, {k // group_size}] scales, got {tuple(q.shape)} {q.dtype} / "
                             f"{tuple(sc.shape)} {sc.dtype}")
    g13, g2 = (cfg.GPB, cfg.GPB) if cfg.GPB else (frag_gpb(H), frag_gpb(I))
    bn = MOE_PARTITION_ROWS
    why = (tile_unsupported(2 * I, tile, bn) or tile_unsupported(H, tile, bn) or tile_unsupported(2 * I, stile, bn)
           or tile_unsupported(H, stile, bn))
    if why:
        raise ValueError(f"fused_moe_frag: {why}")
    if H % (32 * g13) or I % (32 * g2):
        raise ValueError(f"fused_moe_frag: H={H} / I={I} are not whole K blocks of {32 * g13} / {32 * g2}")
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    planned = topk if plan_topk is None else plan_topk
    if not 1 <= planned <= topk:
        raise ValueError(f"fused_moe_frag: plan_topk={plan_topk} must be in 1..{topk} (the routes of a token)")
    part13 = moe_plan(I, H, g13, sms, planned, MOE_GATE_UP_PER_SM)
    part2 = moe_plan(H, I, g2, sms, planned, MOE_DOWN_PER_SM)
    if cfg.P13:
        part13 = replace(part13, programs=min(cfg.P13, part13.work))
    if cfg.P2:
        part2 = replace(part2, programs=min(cfg.P2, part2.work))
    slots13, segs13 = dense_partition(part13.tiles, part13.iters, part13.programs)
    slots2, segs2 = dense_partition(part2.tiles, part2.iters, part2.programs)
    out = torch.empty_like(x)
    if T == 0:
        return out
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    tw = topk_weights.reshape(-1).contiguous()
    on = pdl_supported(x.device)   # every launch a programmatic dependent where the device has them (the same bits)
    sorted_pairs, blk_expert, blk_rows = moe_align(ids, E, cfg.BLOCK_M, pdl=on)
    blocks = blk_rows.numel()
    pdl = pdl_launch(on)

    part = torch.empty((slots13, P, 2 * I), device=x.device, dtype=torch.float32)
    inter = torch.empty((P, I), device=x.device, dtype=x.dtype)
    fuse = fused_epilogues(P, cfg)
    fuse2 = fuse and part2.programs == part2.tiles
    cnt13, cnt2 = _counters(x.device, blocks * part13.tiles, part2.tiles) if fuse else (blk_rows, blk_rows)
    _moe_frag_kernel[(blocks, part13.programs)](
        x, w13_q, w13_scale, part, tw, sorted_pairs, blk_expert, blk_rows, I, topk,
        x.stride(0), w13_q.stride(0), w13_q.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        part.stride(0), part.stride(1), part13.iters, part13.work, part13.programs,
        inter, inter.stride(0), cnt13, ids, T, E, inter, 0, FUSE=fuse, SLOTS=slots13, TOPK_C=topk,
        GATE_UP=True, TOK=cfg.BLOCK_M, GPB=g13, WL=word_layout(MOE_WARPS, g13), TILE=tile, SEGS=segs13,
        WHOLE=part13.programs == part13.tiles, num_warps=MOE_WARPS,
        WG=cfg.wgmma, STILE=stile, **pdl)
    if not fuse:
        moe_swiglu(part, inter, ids, E, slots13, part13, DEQ_FLOAT, min(EPI_BLOCK, triton.next_power_of_2(I)),
                   on)
    y = torch.empty((slots2, P, H), device=x.device, dtype=torch.float32)
    _moe_frag_kernel[(blocks, part2.programs)](
        inter, w2_q, w2_scale, y, tw, sorted_pairs, blk_expert, blk_rows, 0, 1,
        inter.stride(0), w2_q.stride(0), w2_q.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        y.stride(0), y.stride(1), part2.iters, part2.work, part2.programs,
        out, out.stride(0), cnt2, ids, T, E, out if add is None else add, 0 if add is None else add.stride(0),
        FUSE=fuse2, SLOTS=slots2, TOPK_C=topk, ADD=fuse2 and add is not None,
        GATE_UP=False, TOK=cfg.BLOCK_M, GPB=g2, WL=word_layout(MOE_WARPS, g2), TILE=tile, SEGS=segs2,
        WHOLE=part2.programs == part2.tiles, num_warps=MOE_WARPS,
        WG=cfg.wgmma, STILE=stile, **pdl)
    if not fuse2:
        moe_topk_sum(y, out, ids, E, topk, slots2, part2, EPI_BLOCK, on, add=add)
    return out


__all__ = ["FUSE_MAX_PAIRS", "FragMoEConfig", "FRAG_MOE_CONFIGS", "fused_epilogues", "frag_moe_config",
           "fused_moe_frag", "moe_plan"]
