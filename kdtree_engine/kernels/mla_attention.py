"""Absorbed MLA attention (decode, tree verify, chunked prefill over a cached prefix) in Triton.

    o_lat[t, h] = softmax_s(scale * (q_lat[t, h] . c_kv[s] + q_pe[t, h] . k_pe[s])) @ c_kv
    kv = [c_kv | k_pe]  [S + T, C + R]   (one 576-wide latent per slot, shared by all heads: MQA)

Query t sees every committed slot [0, S) and new slot S + j where tree_mask[t, j] (causal when
tree_mask is None). The torch reference (and CPU path, and test oracle) is
`kdtree_engine.model.mla.mla_attention_reference`.

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
rows) are latency-bound with few programs; three knobs address that:
  KEYS_ON_M  keys on the MMA's M side (s^T = K q^T [BN, BM], o^T = V^T P^T [DV, BM]): a 64-key block
             fills a wgmma M tile, and q is a shared-memory operand instead of a register operand that
             every warp of a 16-row mma.sync tile holds whole (16 x 576 bf16 each: the spill source).
  Q_IN_LOOP  re-read q (L1/L2 hits) at every key step instead of holding it live across the loop.
  V_SPLIT    more programs per (tile, chunk), each recomputing the scores for its column slice; it only
             re-tiles, so it may follow T (MLAConfig.V_SPLIT_BY_T).

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
  * BLOCK_M / BLOCK_N / warps / stages / KEYS_ON_M / Q_IN_LOOP / input precision come from the config,
    chosen from (N, dtype) only, never from T; rows (columns under KEYS_ON_M) of an MMA tile are
    independent; V_SPLIT (the only field that may follow the launch: T, and for decode launches the
    program count, DECODE_MIN_PROGRAMS) recomputes the same scores with the same tiles and reduces each
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

import logging
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from .common import DTYPES, bucket, interpreting
from .mla_decode_wg import launch as decode_wg, rows_per_program as wg_rows, unsupported as wg_unsupported
from .mla_verify_wg import ROWS as VWG_ROWS, launch as verify_wg, unsupported as vwg_unsupported
from .pdl import pdl_launch, pdl_supported, pdl_wait
from .streams import side_by_side

log = logging.getLogger(__name__)
_LOGGED: set[str] = set()

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
    a tile sets the order of the softmax row sums. With L_BY_DOT, 64-row wgmma tiles of 4 or 8 warps gave
    the 32-row mma.sync tiles' bits at every verify shape measured, bench/results/mla_attention-wide-sweep-
    h200.md, but no speed: 4 warps 2x slower, 8 warps within -5..+25%; kept fixed), L_BY_DOT,
    KEYS_ON_M (which operand sits on the MMA's M side), num_stages, Q_IN_LOOP (kept fixed too: they
    change the compiled schedule, not the math, but nothing is gained by varying them).
    Exception: with L_BY_DOT, decode launches (T <= DECODE_MAX_T, default 1) may run DECODE_BLOCK_M / DECODE_STAGES
    (mma.sync tiles of another row count: the same arithmetic per row, see :meth:`for_launch`).

    Fields that only re-tile the work: V_SPLIT cuts the 512 output columns over V_SPLIT programs, each
    recomputing the same scores (same tiles, same instructions) and reducing its own columns with the
    same P @ V steps. It MAY follow T: V_SPLIT_BY_T = ((max T, V_SPLIT), ...) (first entry with
    T <= max T; V_SPLIT beyond the last), e.g. more programs for decode (T = 1), where a launch is too
    small to fill the GPU. tests/gpu/test_mla_attention_gpu.py checks a row bit for bit across the
    T buckets and the host/device-length launches.
    """

    CHUNK: int = 512     # keys per split (reduction structure: part of batch invariance)
    BLOCK_M: int = 16    # (query, head) rows per program
    BLOCK_N: int = 32    # keys per inner step (divides CHUNK)
    V_SPLIT: int = 1     # output-column slices per row tile (each recomputes the scores)
    num_warps: int = 4
    num_stages: int = 2
    # keys on the MMA's M side (scores^T = K @ q^T, out^T = V^T @ P^T): a 64-key block fills a wgmma
    # M tile and q is an operand in shared memory instead of registers replicated over the warps
    KEYS_ON_M: bool = False
    Q_IN_LOOP: bool = False  # re-read q (L1/L2 hits) every key step instead of holding it in registers
    V_SPLIT_BY_T: tuple[tuple[int, int], ...] = ()  # (max T, V_SPLIT) buckets; re-tiling only (above)
    # decode launches (T <= DECODE_MAX_T): V_SPLIT doubles (up to 8, slices of >= DECODE_MIN_SLICE columns) until
    # row tiles x chunks x V_SPLIT reaches this many programs (0: off). Re-tiling only, like
    # V_SPLIT_BY_T: at short context a decode launch has 8-64 programs for 132 SMs
    # (bench/results/mla_attention-decode-sweep-h200.md)
    DECODE_MIN_PROGRAMS: int = 0
    # the softmax row sum of a key block as an MMA (P @ ones, the P @ V operand in the P @ V order) instead
    # of a tl.sum across the tile's warps: a row's arithmetic then no longer depends on how the warps
    # split the tile (BLOCK_M), which makes DECODE_BLOCK_M a re-tiling (mma.sync tiles; also beside 64-row wgmma
    # verify tiles, whose bits equal the 32-row mma.sync tiles' at every shape measured and tested)
    L_BY_DOT: bool = False
    # decode launches (T <= DECODE_MAX_T): this BLOCK_M and num_stages instead (0: the config's); needs L_BY_DOT,
    # KEYS_ON_M off and both BLOCK_Ms under 64 (mma.sync: per element the same k-steps for any row count)
    DECODE_BLOCK_M: int = 0
    DECODE_STAGES: int = 0
    # DECODE_STAGES 2 (92 KB of shared memory, two programs per SM) against 3 (164 KB, one): slower at
    # 4K-64K (38.7 against 32.0 us at 64K), even past one wave of programs (58.5 against 56.9 us at 128K,
    # 105 against 104 at 256K; bench/results/mla_attention-stages-sweep-h200.md): a second program per
    # SM does not speed up a decode step; the third stage's prefetch does
    # decode launches (T <= DECODE_MAX_T): this num_warps instead (0: the config's). With L_BY_DOT on mma.sync tiles a
    # row's arithmetic does not depend on the warps' split (each score's 576-long and each output's key
    # reduction stays inside one warp's MMA chain; the row sums are an MMA), so this only re-tiles.
    # Measured at N = 8: 8 warps 26.8 us against 24.2 at 32K, 2 warps 34.5; off in the defaults
    DECODE_WARPS: int = 0
    # decode launches (T = 1): (query, head) rows per program, the rest of the tile masked (0: the whole
    # tile). A row's arithmetic does not depend on the other rows of its tile (row-wise MMA outputs and
    # softmax), so this only re-tiles: more programs on the same chunks, whose repeated key reads hit
    # L2 (N = 8 heads at 32K: 65 programs of 16-row tiles for 132 SMs). Measured slower, so off in the
    # defaults: 4 rows 33.2 us against 28.9 at 32K, 113 against 61 at 128K (before the unmasked key
    # loads); 1 row 69 against 24 us at 32K, 20.1 against 21.5 at 4K (after;
    # bench/results/mla_attention-rows-sweep-h200.md). A decode program is bound by its own
    # instruction stream, not by the SMs it leaves idle.
    DECODE_ROWS: int = 0
    # key tiles of packed launches (decode, causal blocks, a tree's whole prefix chunks) copied by TMA
    # through two tensor descriptors (latent [rows, C], rope [rows, R]) instead of a pointer per 16 bytes:
    # the copy issues no per-element address or predicate arithmetic (about half of the K loop's
    # instructions on sm_90). Same values into the same MMAs, so a load method, not arithmetic: the
    # gather (tree tail) launch keeps pointers and its rows stay bit-equal. Rows past the tensor read as
    # zeros; keys past a block's end are real keys of the launch, weighted exactly 0. Measured 2x slower
    # on triton 3.6 (43.7 against 24.2 us, N = 8 decode at 32K): the transposed key operand of q K^T is
    # read from the TMA tile's shared layout into registers and spills (784 B a thread); off
    K_DESC: bool = False
    # skip the accumulator's online-softmax rescale (BLOCK_M x DV multiplies a key block) when no row's
    # max moved in that block: alpha is then exactly 1 for every row and acc * 1 == acc, so no bit
    # changes, only the instructions ("off", "decode": T = 1 launches, "all"). Measured slower (N = 8
    # decode 27.9 against 24.1 us at 32K; verify 2x: the branch breaks the MMA pipeline); off
    LAZY_RESCALE: str = "off"
    # the latent part of q K^T as QK_SPLIT (1 or 2) independent MMA chains over column halves, summed
    # after (s = (lo + rope) + hi): a 512-long chain is 32 dependent MMAs, latency-bound at one warp per
    # scheduler (the decode tile). Sets a row's arithmetic (fixed per N, like CHUNK); with 2 the P @ V
    # runs in two column halves too (V_SPLIT 1), each output column reduced as before. Measured as the
    # default of both N buckets (bench/results/mla_attention-h200-qsplit2.md): N = 8 verify 2-4% faster
    # (T = 16: 77.2 against 79.6 us at 32K, 226 against 236 at 128K), N = 8 decode at 32K and every
    # N = 64 launch slower (25.3 against 24.8 us; 116 against 112 at 128K): the decode step is not bound
    # by the score chain. Off (1) in the defaults, which the full GPU test set has run on
    QK_SPLIT: int = 1
    # launches of up to this many queries whose verify tiles would make fewer than DECODE_MAX_T_PROGRAMS
    # programs run as decode launches: DECODE_BLOCK_M / DECODE_STAGES / DECODE_WARPS tiles and the
    # DECODE_MIN_PROGRAMS column slices (DECODE_ROWS and LAZY_RESCALE "decode" stay T = 1 only). A re-tiling
    # like the decode launch's own (the same mma.sync arithmetic per row, and the same bits as the 64-row
    # wgmma verify tiles: tests/gpu/test_mla_attention_gpu.py). A 4-node tree at N = 64 over a 4K prefix is
    # 36 programs of 64-row tiles for 132 SMs; on the decode tiles with column slices 144. Where the verify
    # tiles already fill the GPU, more programs cost (python3 bench/mla_attention.py --sweep-only
    # --sweep-small, bench/results/mla_attention-small-sweep-h200.md: N = 8, 8 nodes at 128K 184 against
    # 146 us; N = 64, 8 nodes at 32K 228 against 220), hence the bound on the verify tiles' programs
    DECODE_MAX_T: int = 1
    DECODE_MAX_T_PROGRAMS: int = 132
    # the decode launches of small trees (1 < T, see DECODE_MAX_T) on tiles of this many rows and warps instead
    # of the T = 1 launch's (0: those). mma.sync tiles with the row sums by the MMA: a re-tiling like
    # DECODE_BLOCK_M / DECODE_WARPS (bench/results/mla_attention-warps8-sweep-h200.md: 16-row 8-warp tiles, the
    # default's bits, at N = 64 with 4 nodes over 4K 48.8 against 61.1 us)
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
    # their slices may differ. Each slice recomputes the same scores (the same bits, GPU-tested); N = 8 at 4K / 32K
    # 13.6 / 18.8 against 15.9 / 19.8 us, equal from 64K (bench/results/mla_attention-wg-sweep-h200-slices.md)
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
                self.L_BY_DOT and not self.KEYS_ON_M and self.SMALL_BLOCK_M in (0, 16, 32)
                and self.SMALL_WARPS in (0, 2, 4, 8) and (self.SMALL_BLOCK_M or self.DECODE_BLOCK_M or self.BLOCK_M) < 64):
            raise ValueError("MLAConfig.SMALL_BLOCK_M / SMALL_WARPS need L_BY_DOT, KEYS_ON_M off, tiles of 16 or 32 rows "
                             f"and 2, 4 or 8 warps; got {self}")
        if self.DECODE_BLOCK_M and not (self.L_BY_DOT and not self.KEYS_ON_M and 16 <= self.BLOCK_M <= 64
                                        and 16 <= self.DECODE_BLOCK_M < 64):
            raise ValueError("MLAConfig.DECODE_BLOCK_M needs L_BY_DOT, KEYS_ON_M off, BLOCK_M in [16, 64] and "
                             f"DECODE_BLOCK_M in [16, 64); got {self}")
        if self.DECODE_WARPS and not (self.L_BY_DOT and not self.KEYS_ON_M and self.BLOCK_M <= 64
                                      and (self.DECODE_BLOCK_M or self.BLOCK_M) < 64 and self.DECODE_WARPS in (2, 4, 8)):
            raise ValueError("MLAConfig.DECODE_WARPS needs L_BY_DOT, KEYS_ON_M off, decode tiles under 64 rows and 2, "
                             f"4 or 8 warps; got {self}")
        if not self.KEYS_ON_M and self._wide_tiles_sliced():
            raise ValueError("MLAConfig: 64-row tiles take no output-column slices (V_SPLIT, V_SPLIT_BY_T, "
                             "DECODE_MIN_PROGRAMS): whole they need 224 KB of shared memory, sliced 256-289 KB "
                             f"(over the 227 KB of an H200); got {self}")
        if self.QK_SPLIT not in (1, 2) or (self.QK_SPLIT == 2 and (self.KEYS_ON_M or self.K_DESC)):
            raise ValueError(f"MLAConfig.QK_SPLIT must be 1 or 2 (2 without KEYS_ON_M or K_DESC); got {self}")
        if self.DECODE_WG and not (self.L_BY_DOT and not self.KEYS_ON_M and not self.DECODE_ROWS
                                   and self.LAZY_RESCALE == "off" and self.DECODE_WG in (2, 3)):
            raise ValueError("MLAConfig.DECODE_WG (2 or 3 key slots) needs L_BY_DOT, KEYS_ON_M off, "
                             "DECODE_ROWS 0 and LAZY_RESCALE off (the chunk kernel's arithmetic it reproduces); "
                             f"got {self}")
        if self.VERIFY_WG and not (self.L_BY_DOT and not self.KEYS_ON_M and self.QK_SPLIT == 1
                                   and self.VERIFY_WG in (1, 2)):
            raise ValueError("MLAConfig.VERIFY_WG (1 or 2 key slots) needs L_BY_DOT, KEYS_ON_M off and QK_SPLIT 1 "
                             f"(the chunk kernel's arithmetic it reproduces); got {self}")
        if self.DECODE_WG_ROWS not in (8, 16, 32):
            raise ValueError(f"MLAConfig.DECODE_WG_ROWS must be 8, 16 or 32; got {self.DECODE_WG_ROWS}")
        if self.LAZY_RESCALE not in ("off", "decode", "all"):
            raise ValueError(f"MLAConfig.LAZY_RESCALE must be 'off', 'decode' or 'all'; got {self.LAZY_RESCALE!r}")
        tile = self.DECODE_BLOCK_M or self.BLOCK_M
        if self.DECODE_ROWS and (self.DECODE_ROWS & (self.DECODE_ROWS - 1) or self.DECODE_ROWS > tile):
            raise ValueError(f"MLAConfig.DECODE_ROWS must be a power of 2 <= the decode tile's {tile} rows; "
                             f"got {self.DECODE_ROWS}")

    def _wide_tiles_sliced(self) -> bool:
        """Whether a launch on tiles of >= 64 rows could be cut in column slices: verify tiles by V_SPLIT or a
        V_SPLIT_BY_T bucket beyond T = 1, decode tiles by V_SPLIT, any bucket or DECODE_MIN_PROGRAMS."""
        verify = self.BLOCK_M >= 64 and (self.V_SPLIT > 1 or any(v > 1 and t > 1 for t, v in self.V_SPLIT_BY_T))
        decode = (self.DECODE_BLOCK_M or self.BLOCK_M) >= 64 and (
            self.V_SPLIT > 1 or self.DECODE_MIN_PROGRAMS > 0 or any(v > 1 for _, v in self.V_SPLIT_BY_T))
        return verify or decode

    def lazy(self, T: int) -> bool:
        """Whether a launch of T queries skips the rescale of blocks where no row's max moved."""
        return self.LAZY_RESCALE == "all" or (self.LAZY_RESCALE == "decode" and T == 1)

    def decode(self, T: int, verify_programs: int | None = None) -> bool:
        """Whether a launch of T queries runs as a decode launch: T = 1, or T <= DECODE_MAX_T where the
        verify tiles would make `verify_programs` < DECODE_MAX_T_PROGRAMS programs (None: not bounded)."""
        return T == 1 or (T <= self.DECODE_MAX_T and
                          (verify_programs is None or verify_programs < self.DECODE_MAX_T_PROGRAMS))

    def rows(self, T: int, verify_programs: int | None = None) -> int:
        """(query, head) rows per program of a launch of T queries (of the for_launch(T) config)."""
        if not self.decode(T, verify_programs):
            return self.BLOCK_M
        if T == 1:
            return self.DECODE_ROWS or self.DECODE_BLOCK_M or self.BLOCK_M
        return self.SMALL_BLOCK_M or self.DECODE_BLOCK_M or self.BLOCK_M

    def for_launch(self, T: int, verify_programs: int | None = None) -> "MLAConfig":
        """The config a launch of T queries runs: decode launches (:meth:`decode`) take DECODE_BLOCK_M /
        DECODE_STAGES / DECODE_WARPS, those of small trees SMALL_BLOCK_M / SMALL_WARPS where set."""
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
        `columns` output columns (programs None: the config's own V_SPLIT / V_SPLIT_BY_T, no decode rule)."""
        vs = self.V_SPLIT
        for max_t, v in self.V_SPLIT_BY_T:
            if T <= max_t:
                vs = v
                break
        if self.decode(T, verify_programs) and self.DECODE_MIN_PROGRAMS and programs is not None:
            vs = _double_slices(vs, programs, self.DECODE_MIN_PROGRAMS, lambda v: columns // v >= DECODE_MIN_SLICE)
        return vs

    def as_dict(self) -> dict:
        d = dict(CHUNK=self.CHUNK, BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, V_SPLIT=self.V_SPLIT,
                 num_warps=self.num_warps, num_stages=self.num_stages)
        if self.KEYS_ON_M:
            d["KEYS_ON_M"] = True
        if self.Q_IN_LOOP:
            d["Q_IN_LOOP"] = True
        if self.V_SPLIT_BY_T:
            d["V_SPLIT_BY_T"] = self.V_SPLIT_BY_T
        if self.DECODE_MIN_PROGRAMS:
            d["DECODE_MIN_PROGRAMS"] = self.DECODE_MIN_PROGRAMS
        for k in ("L_BY_DOT", "DECODE_BLOCK_M", "DECODE_STAGES", "DECODE_WARPS", "DECODE_ROWS", "K_DESC",
                  "SMALL_BLOCK_M", "SMALL_WARPS", "DECODE_WG", "DECODE_WG_MIN_PROGRAMS", "VERIFY_WG"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.DECODE_WG_ROWS != 32:
            d["DECODE_WG_ROWS"] = self.DECODE_WG_ROWS
        if self.DECODE_MAX_T != 1:
            d["DECODE_MAX_T"] = self.DECODE_MAX_T
            d["DECODE_MAX_T_PROGRAMS"] = self.DECODE_MAX_T_PROGRAMS
        if self.LAZY_RESCALE != "off":
            d["LAZY_RESCALE"] = self.LAZY_RESCALE
        if self.QK_SPLIT != 1:
            d["QK_SPLIT"] = self.QK_SPLIT
        return d


# Default config per heads-per-rank N (first entry with N <= max N). Fields that set a row's arithmetic
# are fixed per N, never chosen from T, so rows are batch-invariant across T (V_SPLIT_BY_T only
# re-tiles). Chosen from the sweep of bench/mla_attention.py on an H200 (torch 2.11, triton 3.6),
# median us, S=32K (128K) / T:
#   config (CHUNK, BM, BN, warps, stages)  N=8 T=1       T=16   T=64  | N=64 T=1     T=16   T=64
#   512, 32, 64, 4, 2                     56 (90)       92     257   |  57 (147)    425    1522
#   512, 16, 64, 4, 3                     33 (83)      123     383   |   -           647    2411
#   512, 16, 32, 4, 2                     45 (76)      116     367   |  65 (174)    602    2194
#   512, 64, 32, 8, 2                     68 (155)      98     291   |  70 (159)    530    1895
# Tree verify (T = 16..64) is the engine's common step, so BM=32/BN=64 for N <= 16 (64-row 8-warp tiles for
# N > 16: below); for plain decoding at N <= 16, (512, 16, 64, 4, 3) is faster at T = 1. One line per N
# bucket, every field spelled out, so a sweep winner (bench/mla_attention.py --sweep prints it in this form)
# is a one-line edit.
# DECODE_MIN_PROGRAMS=128 (python3 bench/mla_attention.py --sweep-only --sweep-decode): T = 1 at 4K
# context 47 -> 30 us (N = 8) and 44 -> 32 us (N = 64), at 32K N = 8 57 -> 48 us; launches that already
# have >= 128 programs (N = 64 from 32K, N = 8 from 128K: more slices there cost 1.3-8x) keep V_SPLIT 1.
# Row sums by the MMA (L_BY_DOT) in both buckets. N <= 16: decode launches run 16-row, 3-stage tiles with
# one column slice (DECODE_MIN_PROGRAMS off), verify keeps 32-row, 2-stage tiles; the row sums by the MMA
# make the two tilings the same arithmetic (bit for bit on the H200: tests/gpu/test_mla_attention_gpu.py).
# python3 bench/mla_attention.py --sweep-only --sweep-decode, N = 8, T = 1, 4K / 32K / 128K context:
# 29.3 / 45.8 / 92.8 us before -> 26.3 / 32.7 / 84.4 us. With column slices (V_SPLIT > 1) a 3-stage
# 16-row tile runs out of shared memory (233 KB), and 2 stages with slices gave 25.8 / 39.9 / 78.8 us.
# N = 64: 16-row decode tiles are slower from 128K (181-215 vs 153 us), so only L_BY_DOT (60 -> 51 us
# at 32K, 153 -> 144 us at 128K) and the decode V_SPLIT rule.
# N > 16 verify: 64-row tiles in 8 warps (tl.dot on wgmma), the 32-row 4-warp mma.sync tiles kept for decode
# launches (DECODE_BLOCK_M / DECODE_WARPS: the 64-row tiles run out of shared memory there, 240-289 KB).
# python3 bench/mla_attention.py --sweep-only --sweep-wide --sweep-n 64 (bench/results/mla_attention-wide64-
# sweep-h200.md), N = 64, 4K / 32K context: 16 nodes 71.6 / 398 us against 80.4 / 407, 64 nodes 219 / 1416
# against 231 / 1446, the same bits (0 elements differ at every shape; GPU-tested: decode rows == tree rows).
# Trees of up to 8 nodes on the decode tiles where the verify tiles would leave SMs idle (DECODE_MAX_T, bounded
# by DECODE_MAX_T_PROGRAMS; python3 bench/mla_attention.py --sweep-only --sweep-small, bench/results/
# mla_attention-small-sweep-h200.md): N = 8 at 4K, 4 / 8 nodes 39.4 / 39.8 us against 53.3 / 53.7, at 32K 53.1 /
# 72.0 against 71.0 / 73.7; N = 64 at 4K, 2 / 4 / 8 nodes 49.4 / 56.4 / 56.6 against 56.8 / 60.7 / 62.9.
# N <= 16: trees of up to 16 nodes, in 8 warps (SMALL_WARPS; bench/results/mla_attention-small-sweep-h200-tiles.md):
# at 4K 40.0 / 39.7 / 43.3 us at 4 / 8 / 16 nodes against 39.5 / 39.8 / 55.7 (up to 8 nodes, 4 warps), at 32K
# 49.7 / 69.4 against 54.0 / 71.9. N = 64 kept the 32-row 4-warp decode tiles then (the prefix chunks ran on them too):
# 16-row 8-warp tiles won 2 / 4 nodes (44.3 / 48.9 against 50.0 / 56.1 us) but lost 8 (72.3 against 56.8).
# N > 16: a small tree's tail launch (its own keys; the prefix chunks run on the warpgroup kernel, which SMALL_* do not
# touch) in 16-row 8-warp tiles, as N <= 16 has them: the K2 layer's timeline at 4 nodes (bench/results/
# k2_step-h200.md) had the 32-row 4-warp tail at 29-30 us beside a 21 us prefix launch, the merge waiting for it;
# offline (triton 3.6, sm_90) that tile is 255 registers + 472 bytes of stack and 4096 instructions, one warp per
# scheduler; 16 rows in 8 warps 151 registers, no spills, 1712 instructions (the same bits: GPU-tested re-tiling).
# Both buckets: decode launches on the warpgroup kernel with 2 key slots (DECODE_WG; the same bits, GPU-tested;
# python3 bench/mla_attention.py --sweep-only --sweep-rows / --sweep-small, bench/results/mla_attention-wg-sweep-
# h200-both.md and mla_attention-small-sweep-h200-wg.md): N = 8 decode 16.0 / 20.0 / 28.2 / 51.1 / 93.9 us at 4K /
# 32K / 64K / 128K / 256K against 19.9 / 23.6 / 32.2 / 57.5 / 104.2 (3 slots: slower from 64K); N = 64 decode
# 19.4 / 31.0 / 104 at 4K / 32K / 128K against 28.2 / 45.7 / 114; N = 64 trees of 2 / 4 / 8 nodes over 4K 43.5 /
# 48.0 / 53.3 against 50.1 / 58.2 / 57.2; N = 8 trees over 4K as before (41.0 / 41.6 / 44.0 at 4 / 8 / 16 nodes
# against 40.5 / 41.3 / 43.5), over 32K 55.1 / 59.5 / 91.7 against 50.4 / 72.0 / 91.9.
# Small trees' prefix launches sliced like one-query decodes (DECODE_WG_MIN_PROGRAMS), N <= 16 in 16-row warpgroup
# programs (DECODE_WG_ROWS), N = 64 with DECODE_MIN_PROGRAMS 64 (one column slice where 64 programs are reached:
# the 4-node prefix launch leaves SMs to the tree-tail launch beside it); all re-tilings, the same bits (GPU-tested).
# python3 bench/mla_attention.py --sweep-only --sweep-wg (bench/results/mla_attention-wg-sweep-h200-qs2.md), N = 8
# trees of 4 / 8 / 16 nodes over 4K 31.4 / 38.1 / 40.9 us against 39.9 / 40.7 / 42.8 unsliced in 32-row programs,
# 4 nodes over 32K 44.4 against 52.7 (one query: the same launch); N = 64 trees of 2 / 4 nodes over 4K 38.8 / 42.1
# against 42.6 / 46.0 (the host path's per-call tree index included), decode 19.4 / 30.4 us at 4K / 32K against
# 18.9 / 30.8. The score chains split in two (QK_SPLIT 2) measured equal on the warpgroup kernel (19.2 against 19.4
# us at 32K) and are not adopted.
# Trees on the verify tiles (both buckets): their whole prefix chunks on the queries-on-M warpgroup kernel (VERIFY_WG
# 2; at N = 64 the tree's own chunks in the same launch, first), the same bits (GPU-tested). python3
# bench/mla_attention.py --sweep-only --sweep-verify (bench/results/mla_attention-verify-sweep-h200.md), against the
# chunk kernel: N = 64 over 4K 64.2 / 102 / 173 / 318 us at 16 / 32 / 64 / 128 nodes against 71.5 / 130 / 219 / 401,
# over 32K 301 / 1081 at 16 / 64 against 398 / 1420; N = 8 at 64 nodes 55.0 / 179 / 547 us over 4K / 32K / 128K
# against 62.5 / 244 / 775 (one key slot: slower). One layer's attention sublayer at 16 / 32 / 64 nodes 126 / 172 /
# 248 against 143 / 197 / 290 us (bench/results/k2_step-h200-vwg2.md against -vwg0.md).
DEFAULT_CONFIGS: list[tuple[int, MLAConfig]] = [
    (16, MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=64, V_SPLIT=1, num_warps=4, num_stages=2, KEYS_ON_M=False,
                   Q_IN_LOOP=False, V_SPLIT_BY_T=(), DECODE_MIN_PROGRAMS=0, L_BY_DOT=True,
                   DECODE_BLOCK_M=16, DECODE_STAGES=3, QK_SPLIT=1, DECODE_MAX_T=16,
                   SMALL_WARPS=8, DECODE_WG=2, DECODE_WG_MIN_PROGRAMS=128, DECODE_WG_ROWS=16,
                   VERIFY_WG=2)),  # N <= 16 (TP8)
    (1 << 30, MLAConfig(CHUNK=512, BLOCK_M=64, BLOCK_N=64, V_SPLIT=1, num_warps=8, num_stages=2,
                        KEYS_ON_M=False, Q_IN_LOOP=False, V_SPLIT_BY_T=(), DECODE_MIN_PROGRAMS=64, L_BY_DOT=True,
                        DECODE_BLOCK_M=32, DECODE_WARPS=4, QK_SPLIT=1, DECODE_MAX_T=8, DECODE_WG=2,
                        SMALL_BLOCK_M=16, SMALL_WARPS=8, VERIFY_WG=2)),
]


# Merge summation order: pairwise trees of MERGE_BLOCK_C chunks, added in chunk order. A decode merge
# is latency-bound (the partials sit in L2): [16-chunk x 128-column] tiles in 32 programs took 37 us of
# an 88 us decode at 128K (Nsight Compute, bench/ncu_probe.py mla_decode_128k), 64-chunk trees over
# 32 columns in 128 programs 7.7 us; 128-chunk trees were no faster there and slowed the verify merges.
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
    column tile, warps, prefetch and the max's block do not touch the order. From bench/mla_merge.py on
    the H200 (bench/results/mla_merge-h200.md, us per merge back to back): up to 16 rows (a decode at
    N <= 16) 16 columns in one warp with prefetch (N = 8 at 32K / 128K / 256K: 2.82 / 4.09 / 5.87
    against 3.00 / 4.74 / 6.97 for 32 columns in two warps); up to 64 rows 32 columns in two warps (N = 64
    decode at 128K: 11.1, 10.4 for 64 columns in four warps with prefetch); more rows 128 columns in two
    warps (a 16-node verify at N = 8: 7.7 / 22.2 us at 32K / 128K, every other variant slower). The first
    blocks' loads go beside the row's length loads (EARLY; bench/results/mla_merge-h200-early.md, the same bits
    at every shape) except in launches of more than 64 rows and 64 chunks: N = 8 decode 2.49 / 3.82 / 5.60 us at
    32K / 128K / 256K against 2.69 / 4.00 / 5.78, N = 64 decode at 4K / 128K 2.41 / 11.0 against 2.72 / 11.2, a
    4-node tree at N = 64 over 4K 3.26 against 3.48, 16 / 64 nodes at N = 64 over 4K 7.70 / 27.8 against 7.84 /
    27.6, a 16-node verify at N = 8 over 32K 7.54 against 7.71 but over 128K 22.7 against 22.0 (the exception)."""
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
    ql_ptr, qp_ptr, kv_ptr, idx_ptr, nvis_ptr, po_ptr, pl_ptr, out_ptr, s_ptr,
    T, S, N, c_first,
    stride_qlt, stride_qln, stride_qpt, stride_qpn, stride_kv, stride_idx,
    stride_pom, stride_poc, stride_plm, stride_ot, stride_on,
    qk_scale,
    C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, RP: tl.constexpr, DV: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHER: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, S_DEV: tl.constexpr = False,
    KEYS_ON_M: tl.constexpr = False, Q_IN_LOOP: tl.constexpr = False, L_BY_DOT: tl.constexpr = False,
    ROWS: tl.constexpr = 0, klat_desc=None, kpe_desc=None, K_DESC: tl.constexpr = False,
    LAZY: tl.constexpr = False, QS: tl.constexpr = 1, PDL: tl.constexpr = False,
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
    # ROWS (rows per program, <= BLOCK_M; 0: BLOCK_M): the tile's rows past it are masked (re-tiling only)
    RW: tl.constexpr = ROWS if ROWS > 0 else BLOCK_M
    offs_i = tl.arange(0, BLOCK_M)
    if GATHER:
        n_ht = tl.cdiv(N, RW)
        t_q = pid_r // n_ht
        h = (pid_r % n_ht) * RW + offs_i
        row_ok = (h < N) & (offs_i < RW)
        t = tl.zeros((BLOCK_M,), dtype=tl.int32) + t_q
        L_row = S + tl.load(nvis_ptr + t)  # [BM]
        L_max = S + tl.load(nvis_ptr + t_q)
    else:
        rows = pid_r * RW + offs_i
        row_ok = (rows < T * N) & (offs_i < RW)
        t = rows // N
        h = rows % N
        if CAUSAL:
            L_row = S + t + 1
            L_max = S + tl.minimum(T * N - 1, pid_r * RW + RW - 1) // N + 1
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
    # QS == 2: the latent columns as two halves [0, HC) and [HC, CP), each its own MMA chain
    HC: tl.constexpr = CP // QS
    offs_h = tl.arange(0, HC)
    if QS == 2:
        q_row = ql_ptr + t64 * stride_qlt + h64 * stride_qln
        q_lat = tl.load(q_row[:, None] + offs_h[None, :], mask=row_ok[:, None] & (offs_h[None, :] < C), other=0.0)
        q_hi = tl.load(q_row[:, None] + HC + offs_h[None, :], mask=row_ok[:, None] & (HC + offs_h[None, :] < C),
                       other=0.0)
        if UPCAST:
            q_lat = q_lat.to(tl.float32)
            q_hi = q_hi.to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    HALVES: tl.constexpr = QS == 2 and DV == CP   # P @ V in the two halves too
    if KEYS_ON_M:
        acc = tl.zeros((DV, BLOCK_M), dtype=tl.float32)  # transposed: [DV, BM]
    elif HALVES:
        acc = tl.zeros((BLOCK_M, HC), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, DV), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HC), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(p0, p_end, BLOCK_N):
        p = start + offs_n  # virtual positions [BN]
        k_ok = p < p_end
        # keys past p_end read a valid slot instead of a masked load (no per-element predicates in the
        # copy): the packed path its chunk's last key, the gather path slot S (j = 0); their scores are
        # -inf below (p >= p_end >= L_row), so they weigh exactly 0 and the arithmetic is unchanged.
        # Row offsets in 32 bits (_check_offsets): with the clamp, about 30% fewer instructions in the
        # K loop on sm_90 than 64-bit offsets under masks (988 -> 695 per 64-key step, decode tile)
        if K_DESC and not GATHER:  # TMA (DV == CP): rows past the tensor and columns past C / R are zeros
            k_lat = klat_desc.load([start, 0])
            k_pe = kpe_desc.load([start, 0])
            v = k_lat
        else:
            if GATHER:
                j = tl.load(idx_ptr + t_q.to(tl.int64) * stride_idx + (p - S), mask=k_ok & (p >= S), other=0)
                slot = tl.where(p < S, p, S + j)
            else:
                slot = tl.minimum(p, p_end - 1)
            krow = kv_ptr + (slot * stride_kv)[:, None]
            if QS == 2:
                if CP == C:
                    k_lat = tl.load(krow + offs_h[None, :])
                    k_hi = tl.load(krow + HC + offs_h[None, :])
                else:
                    k_lat = tl.load(krow + offs_h[None, :], mask=offs_h[None, :] < C, other=0.0)
                    k_hi = tl.load(krow + HC + offs_h[None, :], mask=HC + offs_h[None, :] < C, other=0.0)
            elif CP == C:
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
        if Q_IN_LOOP and QS == 1:  # re-read q (L1/L2) each step rather than keeping it live in registers
            q_lat = tl.load(ql_ptrs, mask=ql_mask, other=0.0)
            q_pe = tl.load(qp_ptrs, mask=qp_mask, other=0.0)
            if UPCAST:
                q_lat = q_lat.to(tl.float32)
                q_pe = q_pe.to(tl.float32)
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
            v = v.to(tl.float32)
            if QS == 2:
                k_hi = k_hi.to(tl.float32)
        # (no nested @jit helper: the interpreter re-patches builtins on every call of one)
        if KEYS_ON_M:
            # keys on the MMA's M side, (query, head) rows on its N side: s_t [BN, BM], acc [DV, BM]
            if UPCAST:  # interpreter: row-exact broadcast products (see module docstring)
                s_t = (tl.sum(k_lat[:, :, None] * tl.trans(q_lat)[None, :, :], 1)
                       + tl.sum(k_pe[:, :, None] * tl.trans(q_pe)[None, :, :], 1))
            else:
                s_t = tl.dot(k_lat, tl.trans(q_lat), input_precision=PREC)
                s_t = tl.dot(k_pe, tl.trans(q_pe), s_t, input_precision=PREC)
            s_t = s_t * qk_scale
            s_t = tl.where(p[:, None] < L_row[None, :], s_t, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, 0))
            alpha = tl.exp2(m_i - m_new)
            pr_t = tl.exp2(s_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pr_t, 0)
            if UPCAST:
                acc = acc * alpha[None, :] + tl.sum(tl.trans(v)[:, :, None] * pr_t[None, :, :], 1)
            else:
                acc = tl.dot(tl.trans(v), pr_t.to(DT), acc * alpha[None, :], input_precision=PREC)
        else:
            if UPCAST:  # interpreter: row-exact broadcast products (see module docstring)
                s = (tl.sum(q_lat[:, :, None] * tl.trans(k_lat)[None, :, :], 1)
                     + tl.sum(q_pe[:, :, None] * tl.trans(k_pe)[None, :, :], 1))
                if QS == 2:
                    s = s + tl.sum(q_hi[:, :, None] * tl.trans(k_hi)[None, :, :], 1)
            else:
                s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
                s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PREC)
            if QS == 2 and not UPCAST:
                # the upper half as its own chain, scaled before the add (an add of a zero-accumulator
                # dot would be folded back into one chain by the compiler)
                s = s * qk_scale + tl.dot(q_hi, tl.trans(k_hi), input_precision=PREC) * qk_scale
            else:
                s = s * qk_scale
            s = tl.where(p[None, :] < L_row[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(s - m_new[:, None])
            if UPCAST:
                l_i = l_i * alpha + tl.sum(pr, 1)
                acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * v[None, :, :], 1)
                if HALVES:
                    acc_hi = acc_hi * alpha[:, None] + tl.sum(pr[:, :, None] * k_hi[None, :, :], 1)
            else:
                p_op = pr.to(DT)
                if L_BY_DOT:  # row sums of the P @ V operand by the MMA (16 equal columns; max picks one)
                    ones = tl.full((BLOCK_N, 16), 1.0, DT)
                    l_i = l_i * alpha + tl.max(tl.dot(p_op, ones, input_precision=PREC), 1)
                else:
                    l_i = l_i * alpha + tl.sum(pr, 1)
                if LAZY:  # rescale only when some row's max moved (alpha == 1 exactly otherwise: same bits)
                    if tl.min(alpha, 0) < 1.0:
                        acc = acc * alpha[:, None]
                    acc = tl.dot(p_op, v, acc, input_precision=PREC)
                else:
                    acc = tl.dot(p_op, v, acc * alpha[:, None], input_precision=PREC)
                if HALVES:
                    acc_hi = tl.dot(p_op, k_hi, acc_hi * alpha[:, None], input_precision=PREC)
        m_i = m_new

    if KEYS_ON_M:
        acc = tl.trans(acc)
    o = acc / l_i[:, None]
    store_row = row_ok & (p0 < L_row)
    if HALVES:
        offs_v = offs_h
    v_ok = offs_v < C
    if DIRECT:
        o_ptrs = out_ptr + t64[:, None] * stride_ot + h64[:, None] * stride_on + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=store_row[:, None] & v_ok[None, :])
        if HALVES:
            tl.store(o_ptrs + HC, (acc_hi / l_i[:, None]).to(out_ptr.dtype.element_ty),
                     mask=store_row[:, None] & (HC + offs_v[None, :] < C))
    else:
        r64 = t64 * N + h64
        po = po_ptr + r64[:, None] * stride_pom + c * stride_poc + offs_v[None, :]
        tl.store(po, o, mask=store_row[:, None] & v_ok[None, :])
        if HALVES:
            tl.store(po + HC, acc_hi / l_i[:, None], mask=store_row[:, None] & (HC + offs_v[None, :] < C))
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
def _mla_merge_kernel(po_ptr, pl_ptr, nvis_ptr, out_ptr, s_ptr, S, N, NC,
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
    if S_DEV:
        S = tl.load(s_ptr).to(tl.int32)
    t = r // N
    h = r % N
    if CAUSAL:
        L = S + t + 1
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
    if kv.shape[0] != start + T:
        raise ValueError(f"kv has {kv.shape[0]} rows, expected start + T = {start} + {T}")
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


def tree_gather_index(tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible new slots per query, ascending: idx int32 [T, T] (first nvis[t] valid), nvis int32 [T]."""
    T = tree_mask.shape[0]
    nvis = tree_mask.sum(1, dtype=torch.int32)
    # stable sort of (not visible) puts the visible columns first, in ascending order
    idx = torch.sort((~tree_mask).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    return idx.contiguous(), nvis.contiguous()


def _plan(C: int, R: int, N: int, T: int, dtype: torch.dtype, config: MLAConfig | None, n_keys: int
          ) -> tuple[MLAConfig, int, bool, int, int, int, int, bool, str, bool]:
    """Launch constants shared by both launches: (config, rows per program, lazy rescale, CP, RP,
    V_SPLIT, DV, upcast, input precision, decode launch).
    n_keys: the keys the launch's grid covers (its chunks and row tiles size a decode launch's V_SPLIT)."""
    base = config or default_config(N)
    n_ch = triton.cdiv(n_keys, base.CHUNK)
    vp = triton.cdiv(T * N, base.BLOCK_M) * n_ch   # the verify tiles' programs (decode rule for small trees)
    cfg, rows, lazy = base.for_launch(T, vp), base.rows(T, vp), base.lazy(T)
    if cfg.CHUNK % cfg.BLOCK_N:
        raise ValueError(f"CHUNK {cfg.CHUNK} must be a multiple of BLOCK_N {cfg.BLOCK_N}")
    CP = triton.next_power_of_2(C)
    RP = max(16, triton.next_power_of_2(R))
    for vs in {cfg.V_SPLIT, *(v for _, v in cfg.V_SPLIT_BY_T)}:
        if vs < 1 or CP % vs or CP // vs < 16:
            raise ValueError(f"V_SPLIT {vs} must divide {CP} into slices of >= 16 columns")
    if cfg.BLOCK_M < 16 or cfg.BLOCK_N < 16:
        raise ValueError(f"BLOCK_M {cfg.BLOCK_M} and BLOCK_N {cfg.BLOCK_N} must be >= 16 (tl.dot)")
    v_split = base.v_split(T, triton.cdiv(T * N, rows) * n_ch, CP, vp)
    upcast = interpreting()  # fp32 operands and row-exact dots under the interpreter
    prec = "ieee" if (dtype == torch.float32 or upcast) else "tf32"
    return cfg, rows, lazy, CP, RP, v_split, CP // v_split, upcast, prec, base.decode(T, vp)


def _merge(po, pl, nvis, out, s_ptr, S: int, N: int, n_ch: int, strides: tuple[int, int, int], C: int,
           chunk: int, causal: bool, s_dev: bool) -> None:
    """The merge launch of a row's chunk partials into `out` (tiles from merge_tiles)."""
    T = out.shape[0]
    mt = merge_tiles(T * N, n_ch, C)
    _mla_merge_kernel[(T * N, triton.cdiv(C, mt.block_d))](
        po, pl, nvis, out, s_ptr, S, N, n_ch, *strides, out.stride(0), out.stride(1),
        C=C, BLOCK_D=mt.block_d, BLOCK_C=mt.block_c, CHUNK=chunk, CAUSAL=causal, S_DEV=s_dev,
        LSE_BLOCK=mt.lse_block, PREFETCH=mt.prefetch, EARLY=mt.early, num_warps=mt.warps,
        **pdl_launch(pdl_supported(out.device)))


def _log_once(msg: str) -> None:
    """An automatic choice, logged the first time it is made."""
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        log.info("%s", msg)


def _tma_misaligned(kv: torch.Tensor, C: int) -> str | None:
    """Why TMA descriptors of kv's latent [rows, C] / rope parts cannot be made (16-byte alignment), or None."""
    item = kv.element_size()
    if kv.data_ptr() % 16 or (kv.stride(0) * item) % 16 or (C * item) % 16:
        return f"kv not 16-byte aligned (stride {kv.stride(0)}, C = {C})"
    return None


def _kv_descs(kv: torch.Tensor, rows: int, C: int, R: int, CP: int, RP: int, cfg: MLAConfig, VS: int
              ) -> dict:
    """Kernel arguments of the packed launch's key copies: TMA descriptors of the latent [rows, C] and
    rope [rows, R] parts of kv (K_DESC), or none (pointer loads) when the config does not ask for them or
    the cache cannot be described (logged once)."""
    if not cfg.K_DESC:
        return {}
    why = None
    if VS != 1:
        why = f"V_SPLIT {VS} (the descriptor path reads whole rows)"
    elif kv.device.type != "cuda" and not interpreting():
        why = f"kv on {kv.device.type}"
    else:
        why = _tma_misaligned(kv, C)
    if why is not None:
        _log_once(f"MLA attention: key tiles by pointer loads, not TMA: {why}")
        return {}
    from triton.tools.tensor_descriptor import TensorDescriptor

    bn = cfg.BLOCK_N
    lat = TensorDescriptor(kv, [rows, C], [kv.stride(0), 1], [bn, CP])
    pe = TensorDescriptor(kv[:, C:], [rows, R], [kv.stride(0), 1], [bn, RP])
    return dict(klat_desc=lat, kpe_desc=pe, K_DESC=True)


def _wg_device(q_lat: torch.Tensor, kv: torch.Tensor, C: int) -> str | None:
    """Why this device / cache cannot run the warpgroup kernels (wgmma, TMA key tiles), or None."""
    if q_lat.device.type != "cuda" or interpreting():
        return "not on a CUDA device" if q_lat.device.type != "cuda" else "the Triton interpreter"
    why = _tma_misaligned(kv, C)
    if why is None and torch.cuda.get_device_capability(q_lat.device)[0] != 9:
        why = f"sm_{''.join(map(str, torch.cuda.get_device_capability(q_lat.device)))} (wgmma: sm_90)"
    return why


def _decode_wg(cfg: MLAConfig, dec: bool, q_lat: torch.Tensor, kv: torch.Tensor, R: int, VS: int) -> bool:
    """Whether a decode launch (dec: T = 1, or the prefix launch of a small tree) runs on the warpgroup kernel:
    the config asks for it (DECODE_WG) and the launch fits it (otherwise the chunk kernel, the reason logged
    once)."""
    if not (cfg.DECODE_WG and dec):
        return False
    T, N, C = q_lat.shape
    why = (wg_unsupported(T * N, C, R, q_lat.dtype, cfg.BLOCK_N, VS, cfg.DECODE_WG, cfg.DECODE_WG_ROWS)
           or _wg_device(q_lat, kv, C))
    if why is not None:
        _log_once(f"MLA attention: decode launches on the chunk kernel, not the warpgroup kernel: {why}")
        return False
    return True


def _verify_wg(cfg: MLAConfig, dec: bool, q_lat: torch.Tensor, kv: torch.Tensor, R: int) -> bool:
    """Whether a tree's prefix launch on the verify tiles (not dec) runs on the queries-on-M warpgroup kernel: the
    config asks for it (VERIFY_WG) and the launch fits it (otherwise the chunk kernel, the reason logged once)."""
    if not cfg.VERIFY_WG or dec:
        return False
    C = q_lat.shape[2]
    why = vwg_unsupported(C, R, q_lat.dtype, cfg.BLOCK_N, cfg.VERIFY_WG) or _wg_device(q_lat, kv, C)
    if why is not None:
        _log_once(f"MLA attention: tree prefix launches on the chunk kernel, not the warpgroup kernel: {why}")
        return False
    return True


def _wg_slices(cfg: MLAConfig, rows: int, n_ch: int, C: int, VS: int) -> int:
    """Column slices of a warpgroup launch of `rows` (query, head) rows over n_ch chunks
    (MLAConfig.DECODE_WG_MIN_PROGRAMS)."""
    programs = triton.cdiv(rows, wg_rows(rows, cfg.DECODE_WG_ROWS)) * n_ch
    return _double_slices(VS, programs, cfg.DECODE_WG_MIN_PROGRAMS, lambda v: (C // v) % 64 == 0)


def _wg_opts(cfg: MLAConfig) -> dict:
    """The warpgroup launch's rows per program and score chains (MLAConfig.DECODE_WG_ROWS / QK_SPLIT)."""
    return dict(most_rows=cfg.DECODE_WG_ROWS, qk_split=cfg.QK_SPLIT)


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
                  config: MLAConfig | None = None) -> torch.Tensor:
    """Absorbed MLA attention (Triton). q_lat [T, N, C], q_pe [T, N, R], kv [start+T, C+R] -> [T, N, C].

    Query i sees slots [0, start) and start + j where tree_mask[i, j] (causal when None). `config`
    overrides the per-N default (benchmarks; a different config changes the rounding)."""
    if kv_lora_rank is None:
        kv_lora_rank = q_lat.shape[-1]
    T, N, C, R = _check(q_lat, q_pe, kv, start, tree_mask, kv_lora_rank)
    S = start
    out = torch.empty((T, N, C), device=q_lat.device, dtype=q_lat.dtype)
    if T == 0 or N == 0:
        return out
    cfg, rows, lazy, CP, RP, VS, DV, upcast, prec, dec = _plan(C, R, N, T, q_lat.dtype, config, S + T)
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
                  CAUSAL=causal, DIRECT=direct, UPCAST=upcast, PREC=prec,
                  KEYS_ON_M=cfg.KEYS_ON_M, Q_IN_LOOP=cfg.Q_IN_LOOP, L_BY_DOT=cfg.L_BY_DOT, ROWS=rows, LAZY=lazy,
                  QS=cfg.QK_SPLIT, **pdl,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args_tail = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), stride_idx,
                 spom, spoc, splm, out.stride(0), out.stride(1), qk_scale)
    n_tiles = triton.cdiv(T * N, rows)
    descs = _kv_descs(kv, S + T, C, R, CP, RP, cfg, VS)
    wg = _decode_wg(cfg, dec and (T == 1 or not causal), q_lat, kv, R, VS)
    vwg = not causal and _verify_wg(cfg, dec, q_lat, kv, R)
    if causal and wg:
        decode_wg(q_lat, q_pe, kv, S + 1, po, pl, out, nvis, S, (spom, spoc, splm), qk_scale, cfg.CHUNK, n_ch,
                  _wg_slices(cfg, N, n_ch, C, VS), cfg.DECODE_WG, True, direct, False, pdl, **_wg_opts(cfg))
    elif causal:
        grid = (n_tiles * VS, n_ch)
        _mla_chunk_kernel[grid](q_lat, q_pe, kv, idx, nvis, po, pl, out, nvis, T, S, N, 0, *args_tail,
                                GATHER=False, **common, **descs)
    else:
        c_split = S // cfg.CHUNK  # chunks [0, c_split) lie wholly in the committed prefix

        def verify(tail: tuple | None) -> None:   # the verify warpgroup launch (its prefix chunks; tail: its own too)
            verify_wg(q_lat, q_pe, kv, S + T, po, pl, nvis, S, (spom, spoc, splm), qk_scale, cfg.CHUNK, c_split,
                      cfg.VERIFY_WG, False, pdl, tail=tail)

        def prefix() -> None:
            if wg:   # the whole prefix chunks of a small tree: no mask in them
                decode_wg(q_lat, q_pe, kv, S + T, po, pl, out, nvis, S, (spom, spoc, splm), qk_scale, cfg.CHUNK,
                          c_split, _wg_slices(cfg, T * N, c_split, C, VS), cfg.DECODE_WG, False, False, False, pdl,
                          **_wg_opts(cfg))
                return
            if vwg:  # the whole prefix chunks of a larger tree: 64 rows per program, queries on the M side
                verify(None)
                return
            _mla_chunk_kernel[(n_tiles * VS, c_split)](q_lat, q_pe, kv, idx, nvis, po, pl, out, nvis, T, S, N, 0,
                                                       *args_tail, GATHER=False, **common, **descs)

        def tail() -> None:
            _mla_chunk_kernel[(T * triton.cdiv(N, rows) * VS, n_ch - c_split)](
                q_lat, q_pe, kv, idx, nvis, po, pl, out, nvis, T, S, N, c_split, *args_tail, GATHER=True, **common)

        if vwg and N % VWG_ROWS == 0 and not direct:   # one launch: the tree's own chunks first, then the prefix's
            verify((idx, nvis, n_ch - c_split))
        else:
            # the packed (prefix) and gather (tree tail) launches write disjoint chunks: side by side, the
            # gather launch (a few programs, one chunk each) need not wait for the prefix launch to drain
            # (Nsight Compute, 32K / 16 nodes: 50 us + 15 us back to back)
            side_by_side(dev, prefix if c_split > 0 else None, tail)
    if not direct:
        _merge(po, pl, nvis, out, nvis, S, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, causal, False)
    return out


def mla_attention_device(q_lat: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, start: torch.Tensor,
                         tree_mask: torch.Tensor, scale: float, kv_lora_rank: int | None = None,
                         config: MLAConfig | None = None,
                         gather_index: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """:func:`mla_attention` with the committed length on the device (no host read; fixed grid).

    kv [S_cap, C+R] is the whole cache buffer, the T new entries at slots start..start+T-1 (start
    [] or [1] integer tensor, start + T <= S_cap); tree_mask [T, T] bool (tril for a causal block).
    The grid covers all cdiv(S_cap, CHUNK) chunks; programs outside the host split's chunks exit at
    once, so every row is reduced exactly as :func:`mla_attention` reduces it for the same start
    (bit for bit: same chunks, same blocks, same merge order). T = 1 (the root alone: tree_mask [[True]])
    runs the causal decode launch. ``gather_index``: tree_gather_index(tree_mask)
    when the caller already has it (one per step for all layers).
    """
    if kv_lora_rank is None:
        kv_lora_rank = q_lat.shape[-1]
    T, N, C = q_lat.shape
    if tree_mask is None or tree_mask.dtype != torch.bool or tuple(tree_mask.shape) != (T, T):
        raise ValueError(f"tree_mask must be bool [T, T] = [{T}, {T}]")
    cap = kv.shape[0]
    if cap < T:
        raise ValueError(f"kv holds {cap} slots, fewer than the {T} new entries")
    _check(q_lat, q_pe, kv[:T] if cap >= T else kv, 0, tree_mask, kv_lora_rank)
    _check_offsets(kv)
    R = q_pe.shape[2]
    out = torch.empty((T, N, C), device=q_lat.device, dtype=q_lat.dtype)
    if T == 0 or N == 0:
        return out
    cfg, rows, lazy, CP, RP, VS, DV, upcast, prec, dec = _plan(C, R, N, T, q_lat.dtype, config, cap)
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
                  CAUSAL=False, DIRECT=direct, UPCAST=upcast, PREC=prec, S_DEV=True,
                  KEYS_ON_M=cfg.KEYS_ON_M, Q_IN_LOOP=cfg.Q_IN_LOOP, L_BY_DOT=cfg.L_BY_DOT, ROWS=rows, LAZY=lazy,
                  QS=cfg.QK_SPLIT, **pdl,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args_tail = (q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), idx.stride(0),
                 spom, spoc, splm, out.stride(0), out.stride(1), float(scale) * LOG2E)
    n_tiles = triton.cdiv(T * N, rows)
    descs = _kv_descs(kv, cap, C, R, CP, RP, cfg, VS)
    wg = _decode_wg(cfg, dec, q_lat, kv, R, VS)
    vwg = T > 1 and _verify_wg(cfg, dec, q_lat, kv, R)
    if T == 1:
        # one query (a tree of its root alone, the plain decoding step of a device round) sees the prefix and
        # itself, the causal case: one packed launch with the per-row length (chunks past it exit at once),
        # the host-length decode launch's reduction, instead of a prefix launch beside a gather launch
        if wg:
            decode_wg(q_lat, q_pe, kv, cap, po, pl, out, s_dev, 0, (spom, spoc, splm), args_tail[-1], cfg.CHUNK,
                      n_ch, _wg_slices(cfg, N, n_ch, C, VS), cfg.DECODE_WG, True, direct, True, pdl, **_wg_opts(cfg))
        else:
            _mla_chunk_kernel[(n_tiles * VS, n_ch)](q_lat, q_pe, kv, idx, nvis, po, pl, out, s_dev, T, 0, N, 0,
                                                    *args_tail, GATHER=False, **{**common, "CAUSAL": True}, **descs)
        if not direct:
            _merge(po, pl, nvis, out, s_dev, 0, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, True, True)
        return out

    def verify(tail: tuple | None) -> None:   # the verify warpgroup launch (its prefix chunks; tail: its own too)
        verify_wg(q_lat, q_pe, kv, cap, po, pl, s_dev, 0, (spom, spoc, splm), args_tail[-1], cfg.CHUNK, n_ch,
                  cfg.VERIFY_WG, True, pdl, tail=tail)

    def prefix() -> None:   # the two launches keep to disjoint chunks (S_DEV): side by side
        if wg:   # the whole prefix chunks of a small tree (no mask in them); the others exit at once
            decode_wg(q_lat, q_pe, kv, cap, po, pl, out, s_dev, 0, (spom, spoc, splm), args_tail[-1], cfg.CHUNK,
                      n_ch, _wg_slices(cfg, T * N, n_ch, C, VS), cfg.DECODE_WG, False, False, True, pdl,
                      **_wg_opts(cfg))
            return
        if vwg:  # the whole prefix chunks of a larger tree (the others exit at once)
            verify(None)
            return
        _mla_chunk_kernel[(n_tiles * VS, n_ch)](q_lat, q_pe, kv, idx, nvis, po, pl, out, s_dev, T, 0, N, 0,
                                                *args_tail, GATHER=False, **common, **descs)

    def tail() -> None:
        _mla_chunk_kernel[(T * triton.cdiv(N, rows) * VS, n_ch)](
            q_lat, q_pe, kv, idx, nvis, po, pl, out, s_dev, T, 0, N, 0, *args_tail, GATHER=True, **common)

    if vwg and N % VWG_ROWS == 0 and not direct:   # one launch, the tree's own chunks first (1 + cdiv(T - 1, CHUNK))
        verify((idx, nvis, 1 + triton.cdiv(T - 1, cfg.CHUNK)))
    else:
        # disjoint chunks, as above. The prefix launch (on the side stream) is issued first: the tail launch first
        # was slower at 4 and 32 nodes (N = 64 over 4K: the merge done 14 / 12 us later), equal at 8 / 16, 3 us
        # faster at 64 (bench/results/k2_step-h200-tailfirst.md against k2_step-h200-prefixfirst.md, the layers'
        # timelines)
        side_by_side(dev, prefix, tail)
    if not direct:
        _merge(po, pl, nvis, out, s_dev, 0, N, n_ch, (spom, spoc, splm), C, cfg.CHUNK, False, True)
    return out


__all__ = ["MLAConfig", "DEFAULT_CONFIGS", "default_config", "mla_attention", "mla_attention_device",
           "tree_gather_index", "LOG2E"]
