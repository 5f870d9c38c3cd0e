"""Absorbed MLA attention (decode, tree verify, chunked prefill over a cached prefix) in Triton.

    o_lat[t, h] = softmax_s(scale * (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s])) @ c_kv
    kv = [c_kv | k_pe]  [S + T, C + R]   (one 576-wide latent per slot, shared by all heads: MQA)

Query t sees every committed slot [0, S) and new slot S + j where tree_mask[t, j] (causal when
tree_mask is None). The torch reference (and CPU path, and test oracle) is
`kdtree_engine.kernels.reference.mla_attention_reference`.

Design
------
Rows. The T*N (query, head) rows share the same keys, so they are packed into the M side of the
tl.dot tiles (BLOCK_M rows per program); per tile the K/V block is loaded once for all its rows.

Virtual key sequence. Each query t reads the sequence  [0, S) + (its visible new slots, ascending)
of length L_t = S + n_t. Position p < S is slot p; position S + k is slot S + idx[t, k], the k-th
visible new slot. For a tree node (ancestor-or-self mask, parent[i] < i) that sequence is the prefix,
its ancestors root first, then itself: exactly the keys, in the same order, that plain decoding reads
at the same token after the accepted path has been committed to slots S, S+1, .... This is what makes
speculative output equal plain decoding bit for bit (below).

Split over the keys (flash-decoding). The virtual sequence is cut into chunks of CHUNK keys at fixed
positions (multiples of CHUNK, a constant of the config; it never depends on T, S or the rows of a
launch). One program computes one chunk for one tile of rows (and one slice of the 512 output
columns, V_SPLIT slices): online softmax in fp32 over BLOCK_N-key blocks, then writes the chunk's
normalised output o_c and its log2-sum-exp. A second kernel merges a row's chunks:
    m = max_c lse_c;  w_c = 2^(lse_c - m);  o = (sum_c w_c o_c) / (sum_c w_c)
summing MERGE_BLOCK_C chunks per step by a fixed pairwise tree, steps in chunk order (a fixed order for a
given chunk count, whatever the column tiling).
A row with one chunk is written directly (bit-identical to merging one chunk: w = 1, the rest 0).

Grid: ((row tiles) * V_SPLIT, chunks) with the V_SPLIT slices of one (tile, chunk) adjacent, so that
they run together and the repeated key reads hit L2. Decode-shaped launches (T = 1, N = 8: 8 valid
rows) are latency-bound with few programs: V_SPLIT gives them more programs per (tile, chunk), each
recomputing the scores for its column slice (a re-tiling); decode launches may also run on the warpgroup
kernel (mla_decode_wg.py) and tree prefixes on mla_verify_wg.py, with the same arithmetic.

Two kinds of program, the same kernel code (only the address of a key differs):
  packed  rows t-major over all T*N rows; keys at their slots. Used for every chunk of the causal
          case (per-row length mask p < L_t; a row with no key in the chunk is not stored) and for
          the chunks that lie wholly in [0, S) in the tree case.
  gather  tree case, chunks from S // CHUNK on: one query per tile (its heads), keys gathered
          through idx[t] (one [BLOCK_N, C+R] row gather), length mask p < L_t.
Cascade vs one pass: this is the cascade's split (shared prefix for all rows, per-query tree part),
but the boundary is a chunk boundary instead of S, so no third partial and no extra merge; the tree
part costs at most one chunk + T keys per query. An in-kernel [T, T] mask over physical slots would
read the same bytes but put the path keys at other positions than plain decoding does, which breaks
bit equality (tile grouping of the max and of the P@V sums).

Batch invariance (a row's result does not depend on T or on which rows share its launch):
  * chunk boundaries are fixed virtual positions (CHUNK is per config, independent of T/S);
  * within a chunk, BLOCK_N blocks start at the chunk start; blocks past a row's length are exact
    no-ops for that row (p = 0, alpha = 1, acc + 0);
  * BLOCK_M / BLOCK_N / warps / stages / input precision come from the config, chosen from (N, dtype)
    only, never from T; rows of an MMA tile are independent; V_SPLIT (the only field that may follow the
    launch: for decode launches the program count, DECODE_MIN_PROGRAMS) recomputes the same scores with the same tiles and reduces each
    output column with the same P @ V steps;
  * with L_BY_DOT the row sum of a key block is an MMA (P @ ones) rather than a sum across the warps
    that split the tile, so on mma.sync tiles (BLOCK_M < 64: per element the same k16 steps for any
    row count) the row count is a re-tiling too: decode launches may take DECODE_BLOCK_M /
    DECODE_STAGES (MLAConfig.for_launch), and so may small trees (DECODE_MAX_T, SMALL_WARPS) where the
    verify tiles would leave SMs idle; a device-length launch of one query runs the causal decode launch;
  * the merge runs in chunk order with the same formula for any number of rows.
Checked bit for bit by tests/kernels/test_mla_attention.py (interpreter, fp32) and
tests/gpu/test_mla_attention_gpu.py (H200, bf16).

Workspace: partial outputs fp32 [T*N, n_chunks, C] + lse [T*N, n_chunks] when more than one chunk,
n_chunks = cdiv(S + T, CHUNK); e.g. T=129, N=8, S=128K, CHUNK=512: 1032 x 258 x 2 KB = 545 MB.

Under TRITON_INTERPRET=1 (CPU) the dot operands are upcast to fp32 (the 3.9 interpreter computes bf16
dots wrongly) and each dot is a broadcast product + sum, whose per-row value does not depend on the
row's position in the tile (numpy's matmul does depend on it; an MMA does not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ..logs import log_once
from .common import DTYPES, bucket, interpreting
from .mla_decode_wg import BLOCK_N as WG_KEYS, launch as decode_wg, rows_per_program as wg_rows
from .mla_decode_wg import unsupported as wg_unsupported
from .mla_verify_wg import ROWS as VWG_ROWS, launch as verify_wg, unsupported as vwg_unsupported
from .paged import contiguous_table
from .pdl import pdl_launch, pdl_supported, pdl_wait
from .streams import side_by_side


LOG2E = 1.4426950408889634


# Narrowest output-column slice the decode rule (MLAConfig.DECODE_MIN_PROGRAMS) may cut: bit equality
# with one slice is checked at 64 columns (C = 512 in 8) by tests/gpu/test_mla_attention_gpu.py;
# narrower P @ V tiles compile to another MMA shape whose rounding differs (seen on the demo model,
# C = 64 cut into 16-column slices: plain decoding left the verify's bits).
DECODE_MIN_SLICE = 64


def _double_slices(vs: int, programs: int, minimum: int, fits: Callable[[int], bool]) -> int:
    """Output-column slices doubled from vs (up to 8) while programs x slices stays under `minimum` and the doubled
    count fits(slices) (the decode rules DECODE_MIN_PROGRAMS and DECODE_WG_MIN_PROGRAMS)."""
    while vs < 8 and programs * vs < minimum and fits(2 * vs):
        vs *= 2
    return vs


@dataclass(frozen=True)
class MLAConfig:
    """Launch config of the chunk kernel.

    Fields that set a row's arithmetic (batch invariance: fixed per heads-per-rank N, never chosen from
    T): CHUNK (split points), BLOCK_N (online-softmax step), BLOCK_M / num_warps (the MMA instruction
    kind: 16/32-row tiles compile to mma.sync, 64-row tiles to wgmma; without L_BY_DOT the warps' split of
    a tile sets the order of the softmax row sums; with L_BY_DOT the 64-row wgmma verify tiles give the
    32-row mma.sync tiles' bits, GPU-tested), L_BY_DOT, num_stages.
    Exception: with L_BY_DOT, decode launches (T <= DECODE_MAX_T, default 1) may run DECODE_BLOCK_M /
    DECODE_STAGES / DECODE_WARPS (mma.sync tiles of another row count: the same arithmetic per row, see
    :meth:`for_launch`).

    Fields that only re-tile the work: V_SPLIT cuts the 512 output columns over V_SPLIT programs, each
    recomputing the same scores (same tiles, same instructions) and reducing its own columns with the
    same P @ V steps; DECODE_MIN_PROGRAMS raises it for decode launches that leave the GPU idle.
    tests/gpu/test_mla_attention_gpu.py checks a row bit for bit across the launches.
    """

    CHUNK: int = 512     # keys per split (reduction structure: part of batch invariance)
    BLOCK_M: int = 16    # (query, head) rows per program
    BLOCK_N: int = 32    # keys per inner step (divides CHUNK)
    V_SPLIT: int = 1     # output-column slices per row tile (each recomputes the scores)
    num_warps: int = 4
    num_stages: int = 2
    # decode launches (T <= DECODE_MAX_T): V_SPLIT doubles (up to 8, slices of >= DECODE_MIN_SLICE columns) until
    # row tiles x chunks x V_SPLIT reaches this many programs (0: off). Re-tiling only: at short context a decode
    # launch has few programs for the GPU's SMs
    DECODE_MIN_PROGRAMS: int = 0
    # the softmax row sum of a key block as an MMA (P @ ones, the P @ V operand in the P @ V order) instead
    # of a tl.sum across the tile's warps: a row's arithmetic then no longer depends on how the warps
    # split the tile (BLOCK_M), which makes DECODE_BLOCK_M a re-tiling (mma.sync tiles; also beside 64-row wgmma
    # verify tiles, whose bits equal the 32-row mma.sync tiles' at every shape tested)
    L_BY_DOT: bool = False
    # decode launches (T <= DECODE_MAX_T): this BLOCK_M and num_stages instead (0: the config's); needs L_BY_DOT
    # and both BLOCK_Ms under 64 (mma.sync: per element the same k-steps for any row count)
    DECODE_BLOCK_M: int = 0
    DECODE_STAGES: int = 0
    # decode launches (T <= DECODE_MAX_T): this num_warps instead (0: the config's). With L_BY_DOT on mma.sync
    # tiles a row's arithmetic does not depend on the warps' split (each score's 576-long and each output's key
    # reduction stays inside one warp's MMA chain; the row sums are an MMA), so this only re-tiles
    DECODE_WARPS: int = 0
    # launches of up to this many queries whose verify tiles would make fewer than DECODE_MAX_T_PROGRAMS
    # programs run as decode launches: DECODE_BLOCK_M / DECODE_STAGES / DECODE_WARPS tiles and the
    # DECODE_MIN_PROGRAMS column slices. A re-tiling like the decode launch's own (the same mma.sync arithmetic
    # per row, and the same bits as the 64-row wgmma verify tiles: tests/gpu/test_mla_attention_gpu.py); where
    # the verify tiles already fill the GPU, more programs cost, hence the bound on their programs
    DECODE_MAX_T: int = 1
    DECODE_MAX_T_PROGRAMS: int = 132
    # the decode launches of small trees (1 < T, see DECODE_MAX_T) on tiles of this many rows and warps instead
    # of the T = 1 launch's (0: those). mma.sync tiles with the row sums by the MMA: a re-tiling like
    # DECODE_BLOCK_M / DECODE_WARPS
    SMALL_BLOCK_M: int = 0
    SMALL_WARPS: int = 0
    # decode launches (T = 1, and the whole prefix chunks of the small trees that DECODE_MAX_T puts on decode
    # launches) on the warpgroup kernel (mla_decode_wg.py: keys on the wgmma's M side, TMA key tiles in a ring
    # of this many slots; 0: the chunk kernel). The chunk kernel's arithmetic with L_BY_DOT (GPU-tested bit for
    # bit against it), so a method, not a rounding choice; CUDA sm_90 only (elsewhere the chunk kernel, logged)
    DECODE_WG: int = 0
    # warpgroup launches (one-query decodes and the prefix launches of small trees): column slices (V_SPLIT doubled
    # up to 8) until row groups x chunks x slices reaches this many programs (0: the launch's V_SPLIT; inert without
    # DECODE_WG or where the launch falls back to the chunk kernel, whose 3-stage 16-row decode tiles have no shared
    # memory for slices). A tree's prefix launch and its tail launch write disjoint chunks, each all columns, so
    # their slices may differ. Each slice recomputes the same scores (the same bits, GPU-tested)
    DECODE_WG_MIN_PROGRAMS: int = 0
    # warpgroup launches: at most this many (query, head) rows per program (the wgmma's N: 8, 16 or 32; fewer rows
    # make more programs, each re-reading the chunk's key tiles); a re-tiling, the same bits (GPU-tested)
    DECODE_WG_ROWS: int = 32
    # the prefix launches of trees on the verify tiles (not decode launches) on the queries-on-M warpgroup kernel
    # (mla_verify_wg.py: 64 rows and one whole prefix chunk per program of two warpgroups, q and a ring of this
    # many TMA key slots in shared memory; 0: the chunk kernel); where N is a multiple of 64 (a row tile is one
    # query's heads) the tree's own chunks too, their keys gathered, in the same launch ahead of the prefix
    # chunks, instead of the chunk kernel's gather launch beside it. The chunk kernel's arithmetic with L_BY_DOT
    # (GPU-tested bit for bit against it), so a method, not a rounding choice; CUDA sm_90 only (elsewhere the
    # chunk kernel, logged)
    VERIFY_WG: int = 0

    def __post_init__(self) -> None:
        if self.DECODE_MAX_T < 1:
            raise ValueError(f"MLAConfig.DECODE_MAX_T must be >= 1; got {self.DECODE_MAX_T}")
        if (self.SMALL_BLOCK_M or self.SMALL_WARPS) and not (
                self.L_BY_DOT and self.SMALL_BLOCK_M in (0, 16, 32)
                and self.SMALL_WARPS in (0, 2, 4, 8) and (self.SMALL_BLOCK_M or self.DECODE_BLOCK_M or self.BLOCK_M) < 64):
            raise ValueError("MLAConfig.SMALL_BLOCK_M / SMALL_WARPS need L_BY_DOT, tiles of 16 or 32 rows "
                             f"and 2, 4 or 8 warps; got {self}")
        if self.DECODE_BLOCK_M and not (self.L_BY_DOT and 16 <= self.BLOCK_M <= 64
                                        and 16 <= self.DECODE_BLOCK_M < 64):
            raise ValueError("MLAConfig.DECODE_BLOCK_M needs L_BY_DOT, BLOCK_M in [16, 64] and "
                             f"DECODE_BLOCK_M in [16, 64); got {self}")
        if self.DECODE_WARPS and not (self.L_BY_DOT and self.BLOCK_M <= 64
                                      and (self.DECODE_BLOCK_M or self.BLOCK_M) < 64 and self.DECODE_WARPS in (2, 4, 8)):
            raise ValueError("MLAConfig.DECODE_WARPS needs L_BY_DOT, decode tiles under 64 rows and 2, "
                             f"4 or 8 warps; got {self}")
        if self._wide_tiles_sliced():
            raise ValueError("MLAConfig: 64-row tiles take no output-column slices (V_SPLIT, "
                             "DECODE_MIN_PROGRAMS): whole they need 224 KB of shared memory, sliced 256-289 KB "
                             f"(over the 227 KB of an H200); got {self}")
        if self.DECODE_WG and not (self.L_BY_DOT and self.DECODE_WG in (2, 3)):
            raise ValueError("MLAConfig.DECODE_WG (2 or 3 key slots) needs L_BY_DOT (the chunk kernel's arithmetic "
                             f"it reproduces); got {self}")
        if self.VERIFY_WG and not (self.L_BY_DOT and self.VERIFY_WG in (1, 2)):
            raise ValueError("MLAConfig.VERIFY_WG (1 or 2 key slots) needs L_BY_DOT (the chunk kernel's arithmetic "
                             f"it reproduces); got {self}")
        if self.DECODE_WG_ROWS not in (8, 16, 32):
            raise ValueError(f"MLAConfig.DECODE_WG_ROWS must be 8, 16 or 32; got {self.DECODE_WG_ROWS}")

    def _wide_tiles_sliced(self) -> bool:
        """Whether a launch on tiles of >= 64 rows could be cut in column slices: verify tiles by V_SPLIT, decode
        tiles by V_SPLIT or DECODE_MIN_PROGRAMS."""
        verify = self.BLOCK_M >= 64 and self.V_SPLIT > 1
        decode = (self.DECODE_BLOCK_M or self.BLOCK_M) >= 64 and (self.V_SPLIT > 1 or self.DECODE_MIN_PROGRAMS > 0)
        return verify or decode

    def decode(self, T: int, verify_programs: int | None = None) -> bool:
        """Whether a launch of T queries runs as a decode launch: T = 1, or T <= DECODE_MAX_T where the
        verify tiles would make `verify_programs` < DECODE_MAX_T_PROGRAMS programs (None: not bounded)."""
        return T == 1 or (T <= self.DECODE_MAX_T and
                          (verify_programs is None or verify_programs < self.DECODE_MAX_T_PROGRAMS))

    def for_launch(self, T: int, verify_programs: int | None = None) -> "MLAConfig":
        """The config a launch of T queries runs: decode launches (:meth:`decode`) take DECODE_BLOCK_M /
        DECODE_STAGES / DECODE_WARPS, those of small trees SMALL_BLOCK_M / SMALL_WARPS where set. Its BLOCK_M is
        the launch's (query, head) rows per program."""
        if not self.decode(T, verify_programs):
            return self
        small = T > 1
        bm = (self.SMALL_BLOCK_M if small else 0) or self.DECODE_BLOCK_M or self.BLOCK_M
        warps = (self.SMALL_WARPS if small else 0) or self.DECODE_WARPS or self.num_warps
        if (bm, warps, self.DECODE_STAGES or self.num_stages) == (self.BLOCK_M, self.num_warps, self.num_stages):
            return self
        return replace(self, BLOCK_M=bm,
                       num_stages=self.DECODE_STAGES or self.num_stages, num_warps=warps)

    def v_split(self, T: int, programs: int | None = None, columns: int = 0,
                verify_programs: int | None = None) -> int:
        """Output-column slices for a launch of T queries with `programs` programs per slice over
        `columns` output columns (programs None: the config's own V_SPLIT, no decode rule)."""
        vs = self.V_SPLIT
        if self.decode(T, verify_programs) and self.DECODE_MIN_PROGRAMS and programs is not None:
            vs = _double_slices(vs, programs, self.DECODE_MIN_PROGRAMS, lambda v: columns // v >= DECODE_MIN_SLICE)
        return vs

    def as_dict(self) -> dict:
        d = dict(CHUNK=self.CHUNK, BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, V_SPLIT=self.V_SPLIT,
                 num_warps=self.num_warps, num_stages=self.num_stages)
        if self.DECODE_MIN_PROGRAMS:
            d["DECODE_MIN_PROGRAMS"] = self.DECODE_MIN_PROGRAMS
        for k in ("L_BY_DOT", "DECODE_BLOCK_M", "DECODE_STAGES", "DECODE_WARPS", "SMALL_BLOCK_M", "SMALL_WARPS",
                  "DECODE_WG", "DECODE_WG_MIN_PROGRAMS", "VERIFY_WG"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.DECODE_WG_ROWS != 32:
            d["DECODE_WG_ROWS"] = self.DECODE_WG_ROWS
        if self.DECODE_MAX_T != 1:
            d["DECODE_MAX_T"] = self.DECODE_MAX_T
            d["DECODE_MAX_T_PROGRAMS"] = self.DECODE_MAX_T_PROGRAMS
        return d


# Default config per heads-per-rank N (first entry with N <= max N). Fields that set a row's arithmetic
# are fixed per N, never chosen from T, so rows are batch-invariant across T. Chosen from the sweeps of
# bench/mla_attention.py on an H200: tree verify (the engine's common step) on 32-row mma.sync tiles for N <= 16
# and 64-row 8-warp wgmma tiles beyond; decode launches and small trees on the decode tiles and the warpgroup
# kernel; tree prefixes on the verify warpgroup kernel (docs/performance_history.md, "MLA attention defaults").
# One line per N bucket, every field spelled out, so a sweep winner is a one-line edit.
DEFAULT_CONFIGS: list[tuple[int, MLAConfig]] = [
    (16, MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=64, V_SPLIT=1, num_warps=4, num_stages=2,
                   DECODE_MIN_PROGRAMS=0, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_STAGES=3, DECODE_MAX_T=16,
                   SMALL_WARPS=8, DECODE_WG=2, DECODE_WG_MIN_PROGRAMS=128, DECODE_WG_ROWS=16,
                   VERIFY_WG=2)),  # N <= 16 (TP8)
    (1 << 30, MLAConfig(CHUNK=512, BLOCK_M=64, BLOCK_N=64, V_SPLIT=1, num_warps=8, num_stages=2,
                        DECODE_MIN_PROGRAMS=64, L_BY_DOT=True,
                        DECODE_BLOCK_M=32, DECODE_WARPS=4, DECODE_MAX_T=8, DECODE_WG=2,
                        SMALL_BLOCK_M=16, SMALL_WARPS=8, VERIFY_WG=2)),
]


# Merge summation order: pairwise trees of MERGE_BLOCK_C chunks, added in chunk order. A decode merge is
# latency-bound (the partials sit in L2): wide chunk trees over narrow column tiles keep many loads in flight;
# 128-chunk trees were no faster and slowed the verify merges (docs/performance_history.md).
MERGE_BLOCK_C = 64   # a power of 2, at most 128 (_pair_tree)


class MergeTiles(NamedTuple):
    block_c: int     # chunks per pairwise tree
    block_d: int     # output columns per program
    lse_block: int   # chunks per step of the max pass
    warps: int
    prefetch: bool   # the next block's loads issued before the current block's sums
    early: bool      # the first blocks' loads issued beside the row's length loads (_mla_merge_kernel EARLY)


def merge_tiles(rows: int, n_ch: int, C: int) -> MergeTiles:
    """The launch of a merge over `rows` rows and n_ch chunks (the grid's).

    Bit-neutral: a row's chunks past its own count weigh exactly 0, so a pairwise tree over any power of
    2 >= n_ch gives the same sum as the canonical MERGE_BLOCK_C tree (the padded pairs add exact zeros);
    a launch whose chunks fit in fewer takes a smaller tree (a 4K-context verify: 9 chunks, 16). The
    column tile, warps, prefetch and the max's block do not touch the order. From bench/mla_merge.py on an
    H200: up to 16 rows (a decode at N <= 16) 16 columns in one warp with prefetch; up to 64 rows 32 columns in
    two warps; more rows 128 columns in two warps. The first blocks' loads go beside the row's length loads
    (EARLY) except in launches of more than 64 rows and 64 chunks, where that was slower
    (docs/performance_history.md)."""
    block_c = min(MERGE_BLOCK_C, max(2, triton.next_power_of_2(n_ch)))
    lse_block = min(256, max(16, triton.next_power_of_2(n_ch)))
    cp = triton.next_power_of_2(C)
    early = rows <= 64 or n_ch <= 64
    if rows <= 16:
        return MergeTiles(block_c, min(cp, 16), lse_block, 1, True, early)
    return MergeTiles(block_c, min(cp, 32 if rows <= 64 else 128), lse_block, 2, False, early)


def default_config(n_heads: int) -> MLAConfig:
    return bucket(DEFAULT_CONFIGS, n_heads)




_DTYPES = DTYPES

# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _mla_chunk_kernel(
    ql_ptr, qp_ptr, kv_ptr, tbl_ptr, idx_ptr, nvis_ptr, po_ptr, pl_ptr, out_ptr, s_ptr,
    T, S, N, c_first,
    stride_qlt, stride_qln, stride_qpt, stride_qpn, stride_kv, stride_idx,
    stride_pom, stride_poc, stride_plm, stride_ot, stride_on,
    qk_scale,
    C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, DV: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr, PAGE: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, S_DEV: tl.constexpr = False, L_BY_DOT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # grid: ((row tiles [packed] or T * head tiles [gather]) * V_SPLIT, chunks); the V_SPLIT programs of
    # one (tile, chunk) are adjacent so that they run together and their repeated key reads hit L2
    # PDL: a dependent launch (pdl.py), waiting first for the kernels writing q, the cache and S
    if PDL:
        pdl_wait()
    VS: tl.constexpr = CP // DV
    pid_r = tl.program_id(0) // VS
    pid_v = tl.program_id(0) % VS
    c = c_first + tl.program_id(1)
    if S_DEV:
        # committed length from the device; the grid covers every chunk of the buffer and each kind of
        # program keeps to the chunks the host split would give it (packed: whole prefix chunks;
        # gather: from S // CHUNK on), so the reduction structure is the host-length launch's
        S = tl.load(s_ptr).to(tl.int32)
        if GATHER:
            if c < S // CHUNK:
                return
        elif not CAUSAL:
            if (c + 1) * CHUNK > S:
                return
    DT: tl.constexpr = kv_ptr.dtype.element_ty
    offs_i = tl.arange(0, BLOCK_M)
    if GATHER:
        n_ht = tl.cdiv(N, BLOCK_M)
        t_q = pid_r // n_ht
        h = (pid_r % n_ht) * BLOCK_M + offs_i
        row_ok = h < N
        t = tl.zeros((BLOCK_M,), dtype=tl.int32) + t_q
        L_row = S + tl.load(nvis_ptr + t)  # [BM]
        L_max = S + tl.load(nvis_ptr + t_q)
    else:
        rows = pid_r * BLOCK_M + offs_i
        row_ok = rows < T * N
        t = rows // N
        h = rows % N
        if CAUSAL:
            L_row = S + t + 1
            L_max = S + tl.minimum(T * N - 1, pid_r * BLOCK_M + BLOCK_M - 1) // N + 1
        else:  # tree case: packed programs cover only whole chunks of [0, S)
            L_row = tl.zeros((BLOCK_M,), dtype=tl.int32) + S
            L_max = S
    p0 = c * CHUNK
    if p0 >= L_max:
        return
    p_end = tl.minimum(p0 + CHUNK, L_max)

    offs_c = tl.arange(0, CP)
    offs_r = tl.arange(0, RP)
    t64 = t.to(tl.int64)
    h64 = h.to(tl.int64)
    ql_ptrs = ql_ptr + t64[:, None] * stride_qlt + h64[:, None] * stride_qln + offs_c[None, :]
    qp_ptrs = qp_ptr + t64[:, None] * stride_qpt + h64[:, None] * stride_qpn + offs_r[None, :]
    ql_mask = row_ok[:, None] & (offs_c[None, :] < C)
    qp_mask = row_ok[:, None] & (offs_r[None, :] < R)
    q_lat = tl.load(ql_ptrs, mask=ql_mask, other=0.0)
    q_pe = tl.load(qp_ptrs, mask=qp_mask, other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    offs_v = pid_v * DV + tl.arange(0, DV)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(p0, p_end, BLOCK_N):
        p = start + offs_n  # virtual positions [BN]
        k_ok = p < p_end
        # keys past p_end read a valid slot instead of a masked load (no per-element predicates in the
        # copy): the packed path its chunk's last key, the gather path slot S (j = 0); their scores are
        # -inf below (p >= p_end >= L_row), so they weigh exactly 0 and the arithmetic is unchanged.
        # Row offsets in 32 bits (_check_offsets): with the clamp, fewer instructions in the K loop than
        # 64-bit offsets under masks
        if GATHER:
            j = tl.load(idx_ptr + t_q.to(tl.int64) * stride_idx + (p - S), mask=k_ok & (p >= S), other=0)
            slot = tl.where(p < S, p, S + j)
        else:
            slot = tl.minimum(p, p_end - 1)
        # paged cache: slot s is row table[s // PAGE] * PAGE + s % PAGE of the pool (every slot read is valid)
        page = tl.load(tbl_ptr + slot // PAGE)
        krow = kv_ptr + ((page * PAGE + slot % PAGE) * stride_kv)[:, None]
        if CP == C:
            k_lat = tl.load(krow + offs_c[None, :])
        else:
            k_lat = tl.load(krow + offs_c[None, :], mask=offs_c[None, :] < C, other=0.0)
        if RP == R:
            k_pe = tl.load(krow + C + offs_r[None, :])
        else:
            k_pe = tl.load(krow + C + offs_r[None, :], mask=offs_r[None, :] < R, other=0.0)
        if DV == CP:
            v = k_lat
        else:
            v = tl.load(krow + offs_v[None, :], mask=offs_v[None, :] < C, other=0.0)
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
            v = v.to(tl.float32)
        # (no nested @jit helper: the interpreter re-patches builtins on every call of one)
        if UPCAST:  # interpreter: row-exact broadcast products (see module docstring)
            s = (tl.sum(q_lat[:, :, None] * tl.trans(k_lat)[None, :, :], 1)
                 + tl.sum(q_pe[:, :, None] * tl.trans(k_pe)[None, :, :], 1))
        else:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PREC)
        s = s * qk_scale
        s = tl.where(p[None, :] < L_row[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        if UPCAST:
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * v[None, :, :], 1)
        else:
            p_op = pr.to(DT)
            if L_BY_DOT:  # row sums of the P @ V operand by the MMA (16 equal columns; max picks one)
                ones = tl.full((BLOCK_N, 16), 1.0, DT)
                l_i = l_i * alpha + tl.max(tl.dot(p_op, ones, input_precision=PREC), 1)
            else:
                l_i = l_i * alpha + tl.sum(pr, 1)
            acc = tl.dot(p_op, v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new

    o = acc / l_i[:, None]
    store_row = row_ok & (p0 < L_row)
    v_ok = offs_v < C
    if DIRECT:
        o_ptrs = out_ptr + t64[:, None] * stride_ot + h64[:, None] * stride_on + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_row[:, None] & v_ok[None, :])
    else:
        r64 = t64 * N + h64
        po = po_ptr + r64[:, None] * stride_pom + c * stride_poc + offs_v[None, :]
        tl.store(po, o, mask=store_row[:, None] & v_ok[None, :])
        if pid_v == 0:
            tl.store(pl_ptr + r64 * stride_plm + c, m_i + tl.log2(l_i), mask=store_row)


@triton.jit
def _halve(x, H: tl.constexpr, D: tl.constexpr):
    """[2H, D] -> [H, D]: row i is x[2i] + x[2i+1]."""
    a, b = tl.split(tl.permute(tl.reshape(x, (H, 2, D)), (0, 2, 1)))
    return a + b


@triton.jit
def _pair_tree(x, B: tl.constexpr, D: tl.constexpr):
    """Sum over axis 0 of x [B, D] (B a power of 2, at most 128) by a fixed pairwise tree:
    ((x0 + x1) + (x2 + x3)) + ... Elementwise adds only, so every element's order is the same for any
    D, layout or num_warps."""
    for i in tl.static_range(7):   # halves of 64, 32, ..., 1 rows, those at most B / 2
        if B >= (128 >> i):
            x = _halve(x, 64 >> i, D)
    return tl.reshape(x, (D,))


@triton.jit
def _merge_block(pl_row, po_row, cc, n_ch, d_ok, stride_poc):
    """Chunks cc of a row: log-sum-exps [BLOCK_C] (-inf past n_ch) and partials [BLOCK_C, BLOCK_D] (0 there)."""
    c_ok = cc < n_ch
    lse = tl.load(pl_row + cc, mask=c_ok, other=float("-inf"))
    o = tl.load(po_row + cc[:, None].to(tl.int64) * stride_poc, mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    return lse, o


@triton.jit
def _merge_add(acc, den, lse, o, m_all, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """One block of chunks added to the weighted sums: weights 2^(lse - max), each sum a fixed pairwise tree."""
    w = tl.exp2(lse - m_all)
    return acc + _pair_tree(w[:, None] * o, BLOCK_C, BLOCK_D), den + _pair_tree(w[:, None], BLOCK_C, 1)


@triton.jit
def _mla_merge_kernel(po_ptr, pl_ptr, nvis_ptr, out_ptr, s_ptr, S, N, NC, TS,
                      stride_pom, stride_poc, stride_plm, stride_ot, stride_on,
                      C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr,
                      CAUSAL: tl.constexpr, S_DEV: tl.constexpr = False, LSE_BLOCK: tl.constexpr = 256,
                      PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    """grid (rows, C / BLOCK_D): merge a row's chunks. PDL: a dependent launch (pdl.py), waiting first.

    Summation order (per output element, the same for any BLOCK_D, layout or warps): chunks in blocks of
    BLOCK_C, each block summed by a fixed pairwise tree, the block sums added in chunk order; the
    weights' sum likewise. It depends on the chunk count only. Chunks past the row's count weigh exactly
    0, so one chunk merges to its own value bit for bit (as the direct write). BLOCK_C chunks per step
    are loaded at once, so a long context keeps many loads in flight (the partials are in L2). PREFETCH
    issues the next block's loads before the current block's sums (a load method: same bits). EARLY issues the
    first max block's and the first chunk block's loads (bounded by the launch's NC chunks) together with the
    row's length loads and masks them once n_ch is known (where: the same values as the masked loads), so their
    latencies overlap instead of following each other (a load method: same bits)."""
    if PDL:
        pdl_wait()
    r = tl.program_id(0)
    d0 = tl.program_id(1) * BLOCK_D
    r64 = r.to(tl.int64)
    offs_l = tl.arange(0, LSE_BLOCK)   # the max is exact in any order
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = d0 + tl.arange(0, BLOCK_D)
    d_ok = offs_d < C
    pl_row = pl_ptr + r64 * stride_plm
    po_row = po_ptr + r64 * stride_pom + offs_d[None, :]
    if EARLY:
        lse_e = tl.load(pl_row + offs_l, mask=offs_l < NC, other=float("-inf"))
        lse_b, o_b = _merge_block(pl_row, po_row, offs_c, NC, d_ok, stride_poc)
    t = r // N
    h = r % N
    if S_DEV:   # TS queries a slot, each slot its own device length (one slot: TS = the launch's queries)
        S = tl.load(s_ptr + t // TS).to(tl.int32)
    if CAUSAL:
        L = S + t % TS + 1
    else:
        L = S + tl.load(nvis_ptr + t)
    n_ch = tl.minimum(tl.cdiv(L, CHUNK), NC)
    m = tl.full((LSE_BLOCK,), float("-inf"), dtype=tl.float32)
    l0 = 0
    if EARLY:
        m = tl.where(offs_l < n_ch, lse_e, float("-inf"))
        l0 = LSE_BLOCK
    for c0 in range(l0, n_ch, LSE_BLOCK):
        cc = c0 + offs_l
        m = tl.maximum(m, tl.load(pl_row + cc, mask=cc < n_ch, other=float("-inf")))
    m_all = tl.max(m, 0)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    den = tl.zeros((1,), dtype=tl.float32)
    if EARLY:   # the first block as the masked loads would give it
        c_ok = offs_c < n_ch
        lse_b = tl.where(c_ok, lse_b, float("-inf"))
        o_b = tl.where(c_ok[:, None] & d_ok[None, :], o_b, 0.0)
    if PREFETCH:
        if EARLY:
            lse_n, o_n = lse_b, o_b
        else:
            lse_n, o_n = _merge_block(pl_row, po_row, offs_c, n_ch, d_ok, stride_poc)
    elif EARLY:
        acc, den = _merge_add(acc, den, lse_b, o_b, m_all, BLOCK_C, BLOCK_D)
    for c0 in range(BLOCK_C if EARLY and not PREFETCH else 0, n_ch, BLOCK_C):
        if PREFETCH:   # this block's loads were issued a step ahead; issue the next block's
            lse, o = lse_n, o_n
            lse_n, o_n = _merge_block(pl_row, po_row, c0 + BLOCK_C + offs_c, n_ch, d_ok, stride_poc)
        else:
            lse, o = _merge_block(pl_row, po_row, c0 + offs_c, n_ch, d_ok, stride_poc)
        acc, den = _merge_add(acc, den, lse, o, m_all, BLOCK_C, BLOCK_D)
    o = acc / den
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h.to(tl.int64) * stride_on + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_ok)


# ----------------------------------------------------------------------------------------------
# Python entry point


def _check_offsets(kv: torch.Tensor) -> None:
    """The kernel addresses key rows with 32-bit element offsets (slot * row stride)."""
    if kv.shape[0] * kv.stride(0) >= 2 ** 31:
        raise ValueError(f"kv of {kv.shape[0]} rows x stride {kv.stride(0)} exceeds the 2^31 elements the "
                         "attention kernel addresses (32-bit key offsets)")


def _check(q_lat, q_pe, kv, start, tree_mask, kv_lora_rank):
    if q_lat.dim() != 3 or q_pe.dim() != 3 or kv.dim() != 2:
        raise ValueError(f"expected q_lat [T, N, C], q_pe [T, N, R], kv [S+T, C+R]; got "
                         f"{tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(kv.shape)}")
    T, N, C = q_lat.shape
    if C != kv_lora_rank:
        raise ValueError(f"q_lat has C={C} but kv_lora_rank={kv_lora_rank}")
    if q_pe.shape[:2] != (T, N):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} does not match q_lat {tuple(q_lat.shape)} in [T, N]")
    R = q_pe.shape[2]
    if kv.shape[1] != C + R:
        raise ValueError(f"kv width {kv.shape[1]} != C + R = {C} + {R}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    _check_offsets(kv)
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("kv", kv)):
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype {x.dtype} not supported (bf16, fp16, fp32)")
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {x.stride()})")
        if x.device != kv.device:
            raise ValueError(f"{name} is on {x.device}, kv on {kv.device}")
    if not (q_lat.dtype == q_pe.dtype == kv.dtype):
        raise TypeError(f"dtypes differ: q_lat {q_lat.dtype}, q_pe {q_pe.dtype}, kv {kv.dtype}")
    if tree_mask is not None:
        if tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (T, T):
            raise ValueError(f"tree_mask must be bool [T, T] = [{T}, {T}], got {tree_mask.dtype} "
                             f"{tuple(tree_mask.shape)}")
    return T, N, C, R


CONTIGUOUS_PAGE = WG_KEYS  # the page of a contiguous buffer's table: a warpgroup key tile


def _pages(kv: torch.Tensor, table: torch.Tensor | None, n_slots: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(key rows [rows, C+R], block table int32, page) of a launch over ``n_slots`` slots: kv contiguous
    [n_slots, C+R] (table None: page i is rows i*PAGE.., :data:`CONTIGUOUS_PAGE`), or a paged pool layer
    [num_blocks, PAGE, C+R] whose slot s is row (table[s // PAGE], s % PAGE)."""
    if table is None:
        if kv.dim() == 2 and kv.shape[0] != n_slots:
            raise ValueError(f"kv has {kv.shape[0]} rows, expected {n_slots} slots")
        return kv, contiguous_table(kv.shape[0], CONTIGUOUS_PAGE, kv.device), CONTIGUOUS_PAGE
    if kv.dim() != 3 or table.dim() != 1 or table.dtype != torch.int32:
        raise ValueError(f"a paged kv is [num_blocks, PAGE, C+R] with an int32 table [W]; got kv "
                         f"{tuple(kv.shape)}, table {table.dtype} {tuple(table.shape)}")
    if table.numel() * kv.shape[1] < n_slots:
        raise ValueError(f"the block table covers {table.numel()} x {kv.shape[1]} slots, fewer than {n_slots}")
    if table.device != kv.device:
        raise ValueError(f"the block table is on {table.device}, kv on {kv.device}")
    return kv.flatten(0, 1), table, kv.shape[1]


def tree_gather_index(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible new slots per query, ascending: idx int32 [T, T] (first nvis[t] valid), nvis int32 [T]."""
    nvis = tree_mask.sum(1, dtype=torch.int32)
    # stable sort of (not visible) puts the visible columns first, in ascending order
    idx = torch.sort((~tree_mask).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    return idx.contiguous(), nvis.contiguous()


def _plan(C: int, R: int, N: int, T: int, dtype: torch.dtype, config: MLAConfig | None, n_keys: int
          ) -> tuple[MLAConfig, int, bool, int, int, int, int, bool, str, bool]:
    """Launch constants shared by both launches: (config, rows per program, CP, RP, V_SPLIT, DV, upcast,
    input precision, decode launch).
    n_keys: the keys the launch's grid covers (its chunks and row tiles size a decode launch's V_SPLIT)."""
    base = config or default_config(N)
    n_ch = triton.cdiv(n_keys, base.CHUNK)
    vp = triton.cdiv(T * N, base.BLOCK_M) * n_ch   # the verify tiles' programs (decode rule for small trees)
    cfg = base.for_launch(T, vp)
    if cfg.CHUNK % cfg.BLOCK_N:
        raise ValueError(f"CHUNK {cfg.CHUNK} must be a multiple of BLOCK_N {cfg.BLOCK_N}")
    CP = triton.next_power_of_2(C)
    RP = max(16, triton.next_power_of_2(R))
    if cfg.V_SPLIT < 1 or CP % cfg.V_SPLIT or CP // cfg.V_SPLIT < 16:
        raise ValueError(f"V_SPLIT {cfg.V_SPLIT} must divide {CP} into slices of >= 16 columns")
    if cfg.BLOCK_M < 16 or cfg.BLOCK_N < 16:
        raise ValueError(f"BLOCK_M {cfg.BLOCK_M} and BLOCK_N {cfg.BLOCK_N} must be >= 16 (tl.dot)")
    v_split = base.v_split(T, triton.cdiv(T * N, cfg.BLOCK_M) * n_ch, CP, vp)
    upcast = interpreting()  # fp32 operands and row-exact dots under the interpreter
    prec = "ieee" if (dtype == torch.float32 or upcast) else "tf32"
    return cfg, cfg.BLOCK_M, CP, RP, v_split, CP // v_split, upcast, prec, base.decode(T, vp)


def _merge(po, pl, nvis, out, s_ptr, S: int, N: int, n_ch: int, strides: tuple[int, int, int], C: int,
           chunk: int, causal: bool, s_dev: bool, slots: int = 1) -> None:
    """The merge launch of a row's chunk partials into `out` (tiles from merge_tiles); ``slots``: out's queries are
    that many requests' in equal numbers, each with its own device length in s_ptr."""
    T = out.shape[0]
    mt = merge_tiles(T * N, n_ch, C)
    _mla_merge_kernel[(T * N, triton.cdiv(C, mt.block_d))](
        po, pl, nvis, out, s_ptr, S, N, n_ch, max(T // slots, 1), *strides, out.stride(0), out.stride(1),
        C=C, BLOCK_D=mt.block_d, BLOCK_C=mt.block_c, CHUNK=chunk, CAUSAL=causal, S_DEV=s_dev,
        LSE_BLOCK=mt.lse_block, PREFETCH=mt.prefetch, EARLY=mt.early, num_warps=mt.warps,
        **pdl_launch(pdl_supported(out.device)))


def _tma_misaligned(kv: torch.Tensor, C: int) -> str | None:
    """Why TMA descriptors of kv's latent [rows, C] / rope parts cannot be made (16-byte alignment), or None."""
    item = kv.element_size()
    if kv.data_ptr() % 16 or (kv.stride(0) * item) % 16 or (C * item) % 16:
        return f"kv not 16-byte aligned (stride {kv.stride(0)}, C = {C})"
    return None


def _wg_device(q_lat: torch.Tensor, kv: torch.Tensor, C: int) -> str | None:
    """Why this device / cache cannot run the warpgroup kernels (wgmma, TMA key tiles), or None."""
    if q_lat.device.type != "cuda" or interpreting():
        return "not on a CUDA device" if q_lat.device.type != "cuda" else "the Triton interpreter"
    why = _tma_misaligned(kv, C)
    if why is None and torch.cuda.get_device_capability(q_lat.device)[0] != 9:
        why = f"sm_{''.join(map(str, torch.cuda.get_device_capability(q_lat.device)))} (wgmma: sm_90)"
    return why


def _wg_page(page: int) -> str | None:
    """Why the cache's page size does not suit the warpgroup kernels (a TMA key tile is one page), or None."""
    return None if page == WG_KEYS else f"cache pages of {page} keys (the warpgroup key tile is {WG_KEYS})"


def _decode_wg(cfg: MLAConfig, dec: bool, q_lat: torch.Tensor, kv: torch.Tensor, R: int, VS: int,
               page: int = CONTIGUOUS_PAGE) -> bool:
    """Whether a decode launch (dec: T = 1, or the prefix launch of a small tree) runs on the warpgroup kernel:
    the config asks for it (DECODE_WG) and the launch fits it (otherwise the chunk kernel, the reason logged
    once)."""
    if not (cfg.DECODE_WG and dec):
        return False
    T, N, C = q_lat.shape
    why = (wg_unsupported(T * N, C, R, q_lat.dtype, cfg.BLOCK_N, VS, cfg.DECODE_WG, cfg.DECODE_WG_ROWS)
           or _wg_device(q_lat, kv, C) or _wg_page(page))
    if why is not None:
        log_once(f"mla-decode-chunk:{why}",
                 f"MLA attention: decode launches on the chunk kernel, not the warpgroup kernel: {why}")
        return False
    return True


def _verify_wg(cfg: MLAConfig, dec: bool, q_lat: torch.Tensor, kv: torch.Tensor, R: int,
               page: int = CONTIGUOUS_PAGE) -> bool:
    """Whether a tree's prefix launch on the verify tiles (not dec) runs on the queries-on-M warpgroup kernel: the
    config asks for it (VERIFY_WG) and the launch fits it (otherwise the chunk kernel, the reason logged once)."""
    if not cfg.VERIFY_WG or dec:
        return False
    C = q_lat.shape[2]
    why = vwg_unsupported(C, R, q_lat.dtype, cfg.BLOCK_N, cfg.VERIFY_WG) or _wg_device(q_lat, kv, C) or _wg_page(page)
    if why is not None:
        log_once(f"mla-tree-chunk:{why}",
                 f"MLA attention: tree prefix launches on the chunk kernel, not the warpgroup kernel: {why}")
        return False
    return True


def _wg_slices(cfg: MLAConfig, rows: int, n_ch: int, C: int, VS: int, slots: int = 1) -> int:
    """Column slices of a warpgroup launch of `rows` (query, head) rows over n_ch chunks, for each of `slots`
    requests (MLAConfig.DECODE_WG_MIN_PROGRAMS)."""
    programs = triton.cdiv(rows, wg_rows(rows, cfg.DECODE_WG_ROWS)) * n_ch * slots
    return _double_slices(VS, programs, cfg.DECODE_WG_MIN_PROGRAMS, lambda v: (C // v) % 64 == 0)


def _wg_opts(cfg: MLAConfig) -> dict:
    """The warpgroup launch's rows per program (MLAConfig.DECODE_WG_ROWS)."""
    return dict(most_rows=cfg.DECODE_WG_ROWS)


def _partials(out: torch.Tensor, n_ch: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Per-chunk fp32 partial outputs [T*N, n_ch, C] and log-sum-exps [T*N, n_ch] with their strides
    (out itself, unused, when one chunk covers everything)."""
    T, N, C = out.shape
    if n_ch == 1:
        return out, out, 0, 0, 0
    po = torch.empty((T * N, n_ch, C), device=out.device, dtype=torch.float32)
    pl = torch.empty((T * N, n_ch), device=out.device, dtype=torch.float32)
    return po, pl, po.stride(0), po.stride(1), pl.stride(0)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: int,
                  tree_mask: torch.Tensor | None, scale: float, kv_lora_rank: int | None = None,
                  config: MLAConfig | None = None, table: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA attention (Triton). q_lat [T, N, C], q_pe [T, N, R], kv [start+T, C+R] -> [T, N, C].

    Query i sees slots [0, start) and start + j where tree_mask[i, j] (causal when None). `config`
    overrides the per-N default (benchmarks; a different config changes the rounding). ``table``: kv is a
    paged pool layer [num_blocks, PAGE, C+R] read through this block table (see :func:`_pages`); the keys are
    cut into the same chunks and blocks by slot whatever the pages, so the result is the contiguous one's."""
    if kv_lora_rank is None:
        kv_lora_rank = q_lat.shape[-1]
    if isinstance(start, int) and start >= 0:
        kv, tbl, page = _pages(kv, table, start + q_lat.shape[0])
    T, N, C, R = _check(q_lat, q_pe, kv, start, tree_mask, kv_lora_rank)
    S = start
    out = torch.empty((T, N, C), device=q_lat.device, dtype=q_lat.dtype)
    if T == 0 or N == 0:
        return out
    cfg, rows, CP, RP, VS, DV, upcast, prec, dec = _plan(C, R, N, T, q_lat.dtype, config, S + T)
    qk_scale = float(scale) * LOG2E
    causal = tree_mask is None
    dev = kv.device
    pdl = pdl_launch(pdl_supported(dev))
    if causal:
        idx = nvis = torch.zeros(1, dtype=torch.int32, device=dev)  # unused
        stride_idx = 0
    else:
        idx, nvis = tree_gather_index(tree_mask.to(dev))
        stride_idx = idx.stride(0)

    n_ch = triton.cdiv(S + T, cfg.CHUNK)
    direct = n_ch == 1
    po, pl, spom, spoc, splm = _partials(out, n_ch)

    common = dict(C=C, R=R, CP=CP, RP=RP, DV=DV, CHUNK=cfg.CHUNK, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                  CAUSAL=causal, DIRECT=direct, UPCAST=upcast, PREC=prec, PAGE=page,
                  L_BY_DOT=cfg.L_BY_DOT, **pdl,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args_tail = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), stride_idx,
                 spom, spoc, splm, out.stride(0), out.stride(1), qk_scale)
    n_tiles = triton.cdiv(T * N, rows)
    wg = _decode_wg(cfg, dec and (T == 1 or not causal), q_lat, kv, R, VS, page)
    vwg = not causal and _verify_wg(cfg, dec, q_lat, kv, R, page)
    if causal and wg:
        decode_wg(q_lat, q_pe, kv, tbl, page, po, pl, out, nvis, S, (spom, spoc, splm), qk_scale, cfg.CHUNK, n_ch,
                  _wg_slices(cfg, N, n_ch, C, VS), cfg.DECODE_WG, True, direct, False, pdl, **_wg_opts(cfg))
    elif causal:
        grid = (n_tiles * VS, n_ch)
        _mla_chunk_kernel[grid](q_lat, q_pe, kv, tbl, idx, nvis, po, pl, out, nvis, T, S, N, 0, *args_tail,
                                GATHER=False, **common)
    else:
        c_split = S // cfg.CHUNK  # chunks [0, c_split) lie wholly in the committed prefix

        def verify(tail: tuple | None) -> None:   # the verify warpgroup launch (its prefix chunks; tail: its own too)
            verify_wg(q_lat, q_pe, kv, tbl, page, po, pl, nvis, S, (spom, spoc, splm), qk_scale, cfg.CHUNK, c_split,
                      cfg.VERIFY_WG, False, pdl, tail=tail)

        def prefix() -> None:
            if wg:   # the whole prefix chunks of a small tree: no mask in them
                decode_wg(q_lat, q_pe, kv, tbl, page, po, pl, out, nvis, S, (spom, spoc, splm), qk_scale, cfg.CHUNK,
                          c_split, _wg_slices(cfg, T * N, c_split, C, VS), cfg.DECODE_WG, False, False, False, pdl,
                          **_wg_opts(cfg))
                return
            if vwg:  # the whole prefix chunks of a larger tree: 64 rows per program, queries on the M side
                verify(None)
                return
            _mla_chunk_kernel[(n_tiles * VS, c_split)](q_lat, q_pe, kv, tbl, idx, nvis, po, pl, out, nvis, T, S, N, 0,
                                                       *args_tail, GATHER=False, **common)

        def tail() -> None:
            _mla_chunk_kernel[(T * triton.cdiv(N, rows) * VS, n_ch - c_split)](
                q_lat, q_pe, kv, tbl, idx, nvis, po, pl, out, nvis, T, S, N, c_split, *args_tail, GATHER=True, **common)

        if vwg and N % VWG_ROWS == 0 and not direct:   # one launch: the tree's own chunks first, then the prefix's
            verify((idx, nvis, n_ch - c_split))
        else:
            # the packed (prefix) and gather (tree tail) launches write disjoint chunks: side by side, the
            # gather launch (a few programs, one chunk each) need not wait for the prefix launch to drain
            side_by_side(dev, prefix if c_split > 0 else None, tail)
    if not direct:
        _merge(po, pl, nvis, out, nvis, S, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, causal, False)
    return out


def mla_attention_device(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: torch.Tensor,
                         tree_mask: torch.Tensor, scale: float, kv_lora_rank: int | None = None,
                         config: MLAConfig | None = None,
                         gather_index: tuple[torch.Tensor, torch.Tensor] | None = None,
                         table: torch.Tensor | None = None, capacity: int | None = None) -> torch.Tensor:
    """:func:`mla_attention` with the committed length on the device (no host read; fixed grid).

    kv [S_cap, C+R] is the whole cache buffer, the T new entries at slots start..start+T-1 (start
    [] or [1] integer tensor, start + T <= S_cap); tree_mask [T, T] bool (tril for a causal block).
    The grid covers all cdiv(S_cap, CHUNK) chunks; programs outside the host split's chunks exit at
    once, so every row is reduced exactly as :func:`mla_attention` reduces it for the same start
    (bit for bit: same chunks, same blocks, same merge order). T = 1 (the root alone: tree_mask [[True]])
    runs the causal decode launch. ``gather_index``: tree_gather_index(tree_mask)
    when the caller already has it (one per step for all layers). ``table``: kv is a paged pool layer read
    through this block table (see :func:`_pages`), the request's ``capacity`` slots in it (S_cap).
    """
    if kv_lora_rank is None:
        kv_lora_rank = q_lat.shape[-1]
    T, N, C = q_lat.shape
    if tree_mask is None or tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (T, T):
        raise ValueError(f"tree_mask must be bool [T, T] = [{T}, {T}]")
    if table is not None and capacity is None:
        raise ValueError("a paged device-length launch needs the request's capacity")
    cap = kv.shape[0] if table is None else capacity
    kv, tbl, page = _pages(kv, table, cap)
    if cap < T:
        raise ValueError(f"kv holds {cap} slots, fewer than the {T} new entries")
    _check(q_lat, q_pe, kv[:T] if cap >= T else kv, 0, tree_mask, kv_lora_rank)
    _check_offsets(kv)
    R = q_pe.shape[2]
    out = torch.empty((T, N, C), device=q_lat.device, dtype=q_lat.dtype)
    if T == 0 or N == 0:
        return out
    cfg, rows, CP, RP, VS, DV, upcast, prec, dec = _plan(C, R, N, T, q_lat.dtype, config, cap)
    dev = kv.device
    pdl = pdl_launch(pdl_supported(dev))
    # the kernels read the length as it is (an int32 or int64 device scalar: no conversion launch per layer)
    s_dev = start.reshape(1)
    if s_dev.device != dev or s_dev.dtype not in (torch.int32, torch.int64):
        s_dev = s_dev.to(device=dev, dtype=torch.int32)
    idx, nvis = gather_index if gather_index is not None else tree_gather_index(tree_mask.to(dev))
    n_ch = triton.cdiv(cap, cfg.CHUNK)
    direct = n_ch == 1
    po, pl, spom, spoc, splm = _partials(out, n_ch)
    common = dict(C=C, R=R, CP=CP, RP=RP, DV=DV, CHUNK=cfg.CHUNK, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N,
                  CAUSAL=False, DIRECT=direct, UPCAST=upcast, PREC=prec, S_DEV=True, PAGE=page,
                  L_BY_DOT=cfg.L_BY_DOT, **pdl,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args_tail = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), idx.stride(0),
                 spom, spoc, splm, out.stride(0), out.stride(1), float(scale) * LOG2E)
    n_tiles = triton.cdiv(T * N, rows)
    wg = _decode_wg(cfg, dec, q_lat, kv, R, VS, page)
    vwg = T > 1 and _verify_wg(cfg, dec, q_lat, kv, R, page)
    if T == 1:
        # one query (a tree of its root alone, the plain decoding step of a device round) sees the prefix and
        # itself, the causal case: one packed launch with the per-row length (chunks past it exit at once),
        # the host-length decode launch's reduction, instead of a prefix launch beside a gather launch
        if wg:
            decode_wg(q_lat, q_pe, kv, tbl, page, po, pl, out, s_dev, 0, (spom, spoc, splm), args_tail[-1], cfg.CHUNK,
                      n_ch, _wg_slices(cfg, N, n_ch, C, VS), cfg.DECODE_WG, True, direct, True, pdl, **_wg_opts(cfg))
        else:
            _mla_chunk_kernel[(n_tiles * VS, n_ch)](q_lat, q_pe, kv, tbl, idx, nvis, po, pl, out, s_dev, T, 0, N, 0,
                                                    *args_tail, GATHER=False, **{**common, "CAUSAL": True})
        if not direct:
            _merge(po, pl, nvis, out, s_dev, 0, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, True, True)
        return out

    def verify(tail: tuple | None) -> None:   # the verify warpgroup launch (its prefix chunks; tail: its own too)
        verify_wg(q_lat, q_pe, kv, tbl, page, po, pl, s_dev, 0, (spom, spoc, splm), args_tail[-1], cfg.CHUNK, n_ch,
                  cfg.VERIFY_WG, True, pdl, tail=tail)

    def prefix() -> None:   # the two launches keep to disjoint chunks (S_DEV): side by side
        if wg:   # the whole prefix chunks of a small tree (no mask in them); the others exit at once
            decode_wg(q_lat, q_pe, kv, tbl, page, po, pl, out, s_dev, 0, (spom, spoc, splm), args_tail[-1], cfg.CHUNK,
                      n_ch, _wg_slices(cfg, T * N, n_ch, C, VS), cfg.DECODE_WG, False, False, True, pdl,
                      **_wg_opts(cfg))
            return
        if vwg:  # the whole prefix chunks of a larger tree (the others exit at once)
            verify(None)
            return
        _mla_chunk_kernel[(n_tiles * VS, n_ch)](q_lat, q_pe, kv, tbl, idx, nvis, po, pl, out, s_dev, T, 0, N, 0,
                                                *args_tail, GATHER=False, **common)

    def tail() -> None:
        _mla_chunk_kernel[(T * triton.cdiv(N, rows) * VS, n_ch)](
            q_lat, q_pe, kv, tbl, idx, nvis, po, pl, out, s_dev, T, 0, N, 0, *args_tail, GATHER=True, **common)

    if vwg and N % VWG_ROWS == 0 and not direct:   # one launch, the tree's own chunks first (1 + cdiv(T - 1, CHUNK))
        verify((idx, nvis, 1 + triton.cdiv(T - 1, cfg.CHUNK)))
    else:
        # disjoint chunks, as above. The prefix launch (on the side stream) is issued first: the tail launch first
        # was slower for most tree sizes (docs/performance_history.md)
        side_by_side(dev, prefix, tail)
    if not direct:
        _merge(po, pl, nvis, out, s_dev, 0, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, False, True)
    return out


def slots_unsupported(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, config: MLAConfig | None = None
                      ) -> str | None:
    """Why one decode query per slot over the paged pool layer kv cannot run as one launch for all slots
    (:func:`mla_attention_slots`), or None: it runs where a slot's own decode launch runs on the warpgroup kernel."""
    B, N, C = q_lat.shape
    R = q_pe.shape[2]
    if kv.dim() != 3:
        return f"a key buffer of {kv.dim()} dimensions (the slots read a paged pool layer)"
    cfg = (config or default_config(N)).for_launch(1)
    if not cfg.DECODE_WG:
        return f"the {N}-head config runs decode launches on the chunk kernel"
    return (wg_unsupported(N, C, R, q_lat.dtype, cfg.BLOCK_N, 1, cfg.DECODE_WG, cfg.DECODE_WG_ROWS)
            or _wg_device(q_lat, kv.flatten(0, 1), C) or _wg_page(kv.shape[1]))


def mla_attention_slots(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                        capacity: int, starts: torch.Tensor, scale: float, kv_lora_rank: int | None = None,
                        config: MLAConfig | None = None) -> torch.Tensor:
    """One decode query for each of B requests in one launch: q_lat [B, N, C], q_pe [B, N, R]; request b reads the
    paged pool layer kv [num_blocks, PAGE, C+R] through tables[b] (int32 [B, W], W * PAGE >= capacity) with its
    committed length starts[b] on the device (its query at slot starts[b]). -> [B, N, C].

    Request b's rows are :func:`mla_attention_device` of its query alone (T = 1, the same capacity) bit for bit: the
    programs of its own launch (the same chunks, key blocks and merge order; the column slices a re-tiling), one
    more grid axis. Warpgroup kernel only (:func:`slots_unsupported` says where it runs)."""
    if kv_lora_rank is None:
        kv_lora_rank = q_lat.shape[-1]
    B, N, C = q_lat.shape
    why = slots_unsupported(q_lat, q_pe, kv, config)
    if why is not None:
        raise ValueError(f"mla_attention_slots: {why}")
    if tables.dim() != 2 or tables.shape[0] != B or tables.dtype != torch.int32 or tables.stride(1) != 1:
        raise ValueError(f"tables must be int32 [B, W] = [{B}, W] with unit column stride; got {tables.dtype} "
                         f"{tuple(tables.shape)}")
    if tables.shape[1] * kv.shape[1] < capacity:
        raise ValueError(f"the block tables cover {tables.shape[1]} x {kv.shape[1]} slots, fewer than {capacity}")
    if starts.shape != (B,) or starts.dtype not in (torch.int32, torch.int64) or starts.device != kv.device:
        raise ValueError(f"starts must be an integer [B] = [{B}] tensor on {kv.device}; got {starts.dtype} "
                         f"{tuple(starts.shape)} on {starts.device}")
    page = kv.shape[1]
    kv = kv.flatten(0, 1)
    _check(q_lat, q_pe, kv, 0, None, kv_lora_rank)
    R = q_pe.shape[2]
    out = torch.empty((B, N, C), device=q_lat.device, dtype=q_lat.dtype)
    if B == 0 or N == 0:
        return out
    cfg, _, _, _, VS, _, _, _, _ = _plan(C, R, N, 1, q_lat.dtype, config, capacity)
    n_ch = triton.cdiv(capacity, cfg.CHUNK)
    direct = n_ch == 1
    po, pl, spom, spoc, splm = _partials(out, n_ch)
    pdl = pdl_launch(pdl_supported(kv.device))
    decode_wg(q_lat, q_pe, kv, tables, page, po, pl, out, starts, 0, (spom, spoc, splm), float(scale) * LOG2E,
              cfg.CHUNK, n_ch, _wg_slices(cfg, N, n_ch, C, VS, B), cfg.DECODE_WG, True, direct, True, pdl,
              slots=B, **_wg_opts(cfg))
    if not direct:
        _merge(po, pl, starts, out, starts, 0, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, True, True, slots=B)
    return out


__all__ = ["MLAConfig", "DEFAULT_CONFIGS", "default_config", "mla_attention", "mla_attention_device",
           "mla_attention_slots", "slots_unsupported", "tree_gather_index", "interpreting", "LOG2E"]
