"""Absorbed MLA attention (decode / tree verify) at K2 shapes: our Triton kernel beside torch sdpa on the
same math and the torch reference, against rooflines measured in the same run.

    python bench/mla_attention.py --out bench/results          # ~1-2 min on an H200
    python bench/mla_attention.py --sweep                      # also time alternative kernel configs
    python bench/mla_attention.py --sweep-only --no-peers --budget-s 110   # only the sweep (~2 min),
                                                       # written to mla_attention-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-decode --no-peers   # V_SPLIT for decode launches,
                                                       # written to mla_attention-decode-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-chunk --no-peers    # chunk lengths (N = 8, 64),
                                                       # written to mla_attention-chunk-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-rows --no-peers     # decode rows per program (N = 8),
                                                       # written to mla_attention-rows-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-vsplit --no-peers   # column slices of small verifies,
                                                       # written to mla_attention-vsplit-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-small --no-peers    # small trees on the decode tiles,
                                                       # written to mla_attention-small-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-wg --no-peers       # warpgroup launches' score chains, rows,
                                                       # written to mla_attention-wg-sweep-<gpu>.*
    python bench/mla_attention.py --sweep-only --sweep-verify --no-peers   # trees' prefix chunks, queries on M,
                                                       # written to mla_attention-verify-sweep-<gpu>.*

The sweep first compiles every (candidate, launch kind) in a pool of processes (Triton's on-disk cache
is shared), so that the timing loop itself compiles nothing; candidates that fail to compile (e.g. out
of shared memory) are reported as such. At the end it prints the best candidate per shape.

Cases: context S = 4K / 32K / 128K x new tokens T = 1 (decode, causal) / 16 / 64 (random tree,
ancestor-or-self mask) x heads N = 64 (one GPU) and N = 8 (per rank under TP8); C = 512, R = 64, bf16.

Roofline per case: bytes = the latent cache read once, (S+T) * 576 * 2, plus q and the output;
flops = 2 * T * N * S * (576 + 512). Memory time = bytes / copy bandwidth, compute time = flops / bf16
matmul rate (both measured here); "x copy" = memory time / kernel time (the decode target is >= 0.7
from 32K up), "x roof" = max(memory, compute) / kernel time. With N = 64 and T >= 16 the work is
compute-bound (T*N rows share each key: ~1.9 FLOP per byte per row).

Peers: torch sdpa with q = [q_lat | q_pe] (576 wide) against kv as K and c_kv as V (512 wide), MQA
through expanded K/V heads, an explicit bool mask; the torch reference (fp32 einsum + softmax).
Timing: bench/common.py (CUDA-graph replay, median; rotating KV copies larger than L2 at short contexts).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (Clock, bf16_matmul_rate, command_line, copy_bandwidth, device_info,  # noqa: E402
                          gpu_stem, l2_bytes, md_table, time_calls, write_results)
from kdtree_engine.kernels.mla_attention import MLAConfig, default_config, mla_attention  # noqa: E402
from kdtree_engine.kernels.reference import mla_attention_reference  # noqa: E402

C, R = 512, 64
SCALE = 0.1352
CONTEXTS = [4096, 32768, 131072]
TREE_NODES = [1, 16, 64]
HEADS = [64, 8]

def _c(**kw) -> MLAConfig:
    return MLAConfig(**{"CHUNK": 512, "num_warps": 8, **kw})


# Candidates, most informative first (the sweep stops at its time budget). CHUNK / BLOCK_M / BLOCK_N / warps /
# stages set a row's arithmetic: a winner is fixed per N (heads per rank); V_SPLIT only re-tiles.
SWEEP: list[MLAConfig] = [
    MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),     # the verify tiles of N <= 16
    MLAConfig(CHUNK=512, BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=3),     # the decode tiles of N <= 16
    _c(BLOCK_M=16, BLOCK_N=64, num_stages=2),
    _c(BLOCK_M=16, BLOCK_N=64, num_stages=2, V_SPLIT=2),
    _c(CHUNK=256, BLOCK_M=16, BLOCK_N=64, num_stages=2),
    _c(BLOCK_M=32, BLOCK_N=64, num_stages=2),
    _c(BLOCK_M=64, BLOCK_N=64, num_stages=2),                                    # the verify tiles of N > 16
]
# Decode (T = 1) re-tilings: the fields that may follow T (they leave a row's arithmetic as it is):
# V_SPLIT (by T, or sized by DECODE_MIN_PROGRAMS), and with L_BY_DOT (row sums by the MMA) the decode
# launch's BLOCK_M / num_stages. The first two rows: the previous default, and the cost of L_BY_DOT alone.
# `--sweep-decode` times these.
_DEC = dict(CHUNK=512, BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2, DECODE_MIN_PROGRAMS=128)
DECODE_SWEEP: list[MLAConfig] = [
    MLAConfig(**_DEC),
    MLAConfig(**_DEC, L_BY_DOT=True),
    MLAConfig(**_DEC, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_STAGES=2),
    MLAConfig(**{**_DEC, "DECODE_MIN_PROGRAMS": 0}, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_STAGES=3),
]
DECODE_SHAPES = [(8, 4096, 1), (8, 32768, 1), (8, 131072, 1), (64, 4096, 1), (64, 32768, 1), (64, 131072, 1)]
# Re-tilings of the defaults (they leave a row's arithmetic as it is): decode warps (DECODE_WARPS), the warpgroup
# decode kernel's column slices (DECODE_WG_MIN_PROGRAMS). `--sweep-rows` times the ones not measured yet.
_D8, _D64 = default_config(8), default_config(64)
ROWS_FOR_N: dict[int, list[MLAConfig]] = {
    8: [_D8, replace(_D8, DECODE_WG_MIN_PROGRAMS=0)],
    64: [_D64]}
# (what was measured before: docs/performance_history.md)
ROWS_SWEEP: list[MLAConfig] = [c for cs in ROWS_FOR_N.values() for c in cs]
# Chunk length (a reduction field: decode and verify share it; fixed per N). Shorter chunks give a launch
# more programs where it has few (a decode or a small tree over a short prefix), and the decode launches fewer
# column slices (DECODE_MIN_PROGRAMS), so less recomputed q K^T; longer ones fewer partials to merge.
# `--sweep-chunk` times each N's default beside its CHUNK = 256 twin (measured before at N = 8 on an older
# default, bench/results/mla_attention-chunk-sweep-h200.md: no length won everywhere; 1024 there too).
# Measured on the warpgroup decode kernel since (bench/results/mla_attention-chunk-sweep-h200-group.md): CHUNK 256
# at N = 8 no faster at 32K, slower from 64K; consecutive chunks grouped per program (one wave at long contexts;
# commit 0e8507b) the same bits, no faster.
CHUNK_FOR_N: dict[int, list[MLAConfig]] = {8: [_D8, replace(_D8, CHUNK=256)],
                                           64: [_D64, replace(_D64, CHUNK=256)]}
CHUNK_SWEEP: list[MLAConfig] = [c for cs in CHUNK_FOR_N.values() for c in cs]
CHUNK_SHAPES = [(8, 32768, 1), (8, 131072, 1), (8, 4096, 1), (8, 65536, 1), (8, 262144, 1), (8, 4096, 4),
                (8, 32768, 4), (8, 4096, 16), (8, 32768, 16), (8, 4096, 64), (8, 32768, 64), (8, 131072, 16),
                (64, 4096, 1), (64, 4096, 4), (64, 4096, 8), (64, 4096, 16), (64, 4096, 64), (64, 32768, 1),
                (64, 32768, 8), (64, 32768, 64), (64, 131072, 1), (64, 131072, 16)]
# Output-column slices (V_SPLIT: a re-tiling, the same bits; tested by
# tests/gpu/test_mla_attention_gpu.py::test_v_split_bit_equal_bf16): at N = 8 a 4..16-node tree over a 4K prefix is
# 8 prefix programs (one 32-row tile per chunk) for 132 SMs. `--sweep-vsplit` times them (a candidate whose tiles
# do not fit in shared memory is reported, not fatal).
VSPLIT_FOR_N: dict[int, list[MLAConfig]] = {
    8: [_D8] + [replace(_D8, V_SPLIT=v) for v in (2, 4, 8)],
    # N = 64: the slices on the 32-row verify tiles (the default's 64-row tiles take none: MLAConfig)
    64: [_D64] + [replace(_D64, BLOCK_M=32, num_warps=4, V_SPLIT=v) for v in (2, 4)]}
VSPLIT_SWEEP: list[MLAConfig] = [c for cs in VSPLIT_FOR_N.values() for c in cs]
VSPLIT_SHAPES = [(8, 4096, 4), (8, 4096, 16), (8, 32768, 4), (8, 32768, 16), (8, 131072, 16), (64, 4096, 4),
                 (64, 4096, 16), (64, 32768, 16)]
# Verify tiles of 64 rows (tl.dot on wgmma) beside the defaults' 32-row mma.sync tiles: whether they give the
# same bits (bench_case's `diff_vs_default`: elements that differ from the default config's output) and their
# time. `--sweep-wide` times them (at N = 8 decode launches keep their own tiles: verify shapes only; N = 64 has no
# decode tiles of its own, so its decode shapes run the candidates' tiles).
_W8, _W64 = replace(_D8, DECODE_BLOCK_M=0, DECODE_STAGES=0, DECODE_MAX_T=1, SMALL_WARPS=0), _D64
# Also 8 warps on 32 / 16-row tiles (decode launches keep 4: DECODE_WARPS): offline (triton 3.6, sm_90) the
# 32-row 4-warp verify tile spills (255 registers + 360 bytes a thread), 8 warps fit (253, 138 for 16 rows);
# with the row sums by the MMA the warps' split does not touch a row's arithmetic.
WIDE_FOR_N: dict[int, list[MLAConfig]] = {
    8: [_D8, replace(_W8, BLOCK_M=64, num_warps=4), replace(_W8, BLOCK_M=64, num_warps=8),
        replace(_W8, BLOCK_M=64, num_warps=8, BLOCK_N=32),    # with column slices they do not fit (MLAConfig)
        replace(_D8, num_warps=8, DECODE_WARPS=4), replace(_D8, BLOCK_M=16, num_warps=8, DECODE_WARPS=4)],
    # N = 64: the default (64-row tiles in 8 warps) beside the 32-row 4-warp tiles it replaced
    64: [_D64, replace(_W64, BLOCK_M=32, num_warps=4), replace(_W64, BLOCK_M=64, num_warps=4),
         replace(_W64, BLOCK_M=64, num_warps=8, BLOCK_N=32), replace(_W64, BLOCK_M=32, num_warps=8),
         replace(_W64, BLOCK_M=16, num_warps=8)]}
WIDE_SWEEP: list[MLAConfig] = [c for cs in WIDE_FOR_N.values() for c in cs]
WIDE_SHAPES = [(8, 4096, 4), (8, 4096, 16), (8, 4096, 64), (8, 32768, 16), (8, 32768, 64), (8, 131072, 16),
               (64, 4096, 4), (64, 4096, 16), (64, 4096, 64), (64, 32768, 16), (64, 32768, 64), (64, 4096, 1),
               (64, 32768, 1), (64, 131072, 1)]
# Small trees on the decode tiles (DECODE_MAX_T: a re-tiling, the same bits; tested by tests/gpu/
# test_mla_attention_gpu.py::test_small_trees_on_decode_tiles_bit_equal_bf16): at N = 64 a 4-node tree over a 4K
# prefix is 32 programs of 64-row tiles for 132 SMs, on the 32-row decode tiles with column slices 128.
# `--sweep-small` times them.
# (measured first without the bound on the verify tiles' programs, DECODE_MAX_T_PROGRAMS; now the defaults
# beside the verify tiles for every small tree)
# Then the small trees' own tiles (SMALL_BLOCK_M / SMALL_WARPS), and at N = 8 trees of up to 16 nodes.
# Now (the prefix chunks on the warpgroup kernel, a tree's own keys in the tail launch beside it): the tail launch's
# tiles at N = 64 (Nsight Compute, 4 nodes over 4K: 16 programs of 32 rows, one key block each, 12.4 us, 255
# registers) in 16-row 8-warp or 32-row 8-warp tiles, and at N = 8 in 4 warps.
SMALL_FOR_N: dict[int, list[MLAConfig]] = {
    8: [_D8, replace(_D8, SMALL_WARPS=4)],
    64: [_D64, replace(_D64, SMALL_BLOCK_M=16, SMALL_WARPS=8), replace(_D64, SMALL_WARPS=8)]}
# measured before (bench/results/mla_attention-small-sweep-h200-tiles.md): replace(_D8, SMALL_WARPS=8),
# replace(_D8, DECODE_MAX_T=16), replace(_D64, SMALL_BLOCK_M=16, SMALL_WARPS=8) (also with DECODE_MIN_PROGRAMS=0),
# replace(_D64, SMALL_WARPS=8); then (bench/results/mla_attention-small-sweep-h200-wg.md) the prefix chunks of small
# trees on the warpgroup kernel (DECODE_WG) against DECODE_MAX_T 1 / the decode tiles, and DECODE_MAX_T 16 at N = 64;
# then (bench/results/mla_attention-small-sweep-h200-tail.md) the tail launch's tiles: replace(_D8, SMALL_WARPS=4),
# replace(_D64, SMALL_BLOCK_M=16, SMALL_WARPS=8), replace(_D64, SMALL_WARPS=8), none faster; then (bench/results/
# mla_attention-small-sweep-h200-tailvs.md) the tail launch in 2 / 4 / 8 column slices of its own (a TAIL_V_SPLIT
# field, dropped): the same bits, no faster (N = 64, 4 nodes over 4K 43.0-43.7 us against 42.6; N = 8 slower).
SMALL_SWEEP: list[MLAConfig] = [c for cs in SMALL_FOR_N.values() for c in cs]
SMALL_SHAPES = [(64, 4096, 2), (64, 4096, 4), (64, 4096, 8), (64, 4096, 16), (64, 32768, 4), (8, 4096, 4),
                (8, 4096, 8), (8, 4096, 16), (8, 32768, 4), (8, 32768, 8), (8, 32768, 16), (8, 131072, 16)]
# The warpgroup launches' tiling (DECODE_WG_ROWS: 8- or 16-row programs; without DECODE_WG_MIN_PROGRAMS: no slices
# for small trees' prefix launches; at N = 64 DECODE_MIN_PROGRAMS 64: one slice at 4 nodes). `--sweep-wg`
WG_FOR_N: dict[int, list[MLAConfig]] = {
    8: [_D8, replace(_D8, DECODE_WG_MIN_PROGRAMS=0), replace(_D8, DECODE_WG_ROWS=8), replace(_D8, DECODE_WG_ROWS=16)],
    64: [_D64, replace(_D64, DECODE_MIN_PROGRAMS=64),
         replace(_D64, DECODE_WG_ROWS=16, DECODE_MIN_PROGRAMS=64)]}
WG_SWEEP: list[MLAConfig] = [c for cs in WG_FOR_N.values() for c in cs]
WG_SHAPES = [(8, 4096, 1), (8, 32768, 1), (8, 131072, 1), (8, 4096, 4), (8, 4096, 8), (8, 4096, 16), (8, 32768, 4),
             (8, 32768, 16), (64, 4096, 1), (64, 32768, 1), (64, 4096, 2), (64, 4096, 4), (64, 4096, 8),
             (64, 32768, 4)]
# A tree's whole prefix chunks on the queries-on-M warpgroup kernel (VERIFY_WG: 64 rows per program of two
# warpgroups, 2 or 1 TMA key slots; the default, 2) against the chunk kernel's verify tiles (VERIFY_WG 0); at N = 8
# trees whose verify tiles would leave SMs idle stay decode launches. `--sweep-verify` (bench/results/
# mla_attention-verify-sweep-h200.md was measured while the default was still 0)
VERIFY_FOR_N: dict[int, list[MLAConfig]] = {
    8: [_D8, replace(_D8, VERIFY_WG=0)],
    64: [_D64, replace(_D64, VERIFY_WG=0), replace(_D64, VERIFY_WG=1)]}
VERIFY_SWEEP: list[MLAConfig] = [c for cs in VERIFY_FOR_N.values() for c in cs]
VERIFY_SHAPES = [(64, 4096, 16), (64, 4096, 32), (64, 4096, 64), (64, 4096, 128), (64, 32768, 16),
                 (64, 32768, 64), (64, 131072, 16), (8, 4096, 64), (8, 32768, 32), (8, 32768, 64), (8, 131072, 64)]
ROWS_SHAPES = [(8, 4096, 1), (8, 32768, 1), (8, 65536, 1), (8, 131072, 1), (8, 262144, 1), (64, 4096, 1),
               (64, 32768, 1), (64, 131072, 1)]
SWEEP_SHAPES = [(8, 32768, 1), (8, 131072, 1), (8, 32768, 16), (8, 131072, 16), (8, 32768, 64),
                (8, 131072, 64), (64, 32768, 1), (64, 131072, 1), (64, 32768, 16), (64, 131072, 16),
                (64, 32768, 64), (64, 131072, 64)]


def _precompile_job(job: tuple[dict, int, int]) -> str | None:
    """In a pool worker: one launch of a candidate at (N, T) and S = 32K (the same integer
    specialisations as 128K), so the kernel lands in Triton's on-disk cache. The error, if any."""
    cfg_d, N, T = job
    try:
        cfg = MLAConfig(**cfg_d)
        q_lat, q_pe, kvs, mask = make_case(N, 32768, T, 1)
        mla_attention(q_lat, q_pe, kvs[0], 32768, mask, SCALE, C, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - reported per candidate
        return f"{type(exc).__name__}: {exc}"[:200]


def precompile(cfgs: list[MLAConfig], shapes: list[tuple[int, int, int]], workers: int) -> dict:
    """Compile every (config, N, T kind) in parallel processes; {(config, N, T == 1): error or None}."""
    import concurrent.futures as cf
    import multiprocessing as mp

    keys = sorted({(N, T == 1) for N, _, T in shapes})
    jobs = [(cfg.as_dict(), N, 1 if decode else 16) for cfg in cfgs for N, decode in keys]
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        errs = list(ex.map(_precompile_job, jobs))
    return {(MLAConfig(**j[0]), j[1], j[2] == 1): e for j, e in zip(jobs, errs)}


def random_tree_mask(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        if i:
            mask[i] = mask[int(torch.randint(max(0, i - 4), i, (1,), generator=g))]
        mask[i, i] = True
    return mask


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def make_case(N, S, T, n_sets, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_lat = torch.randn(T, N, C, generator=g, device="cuda").bfloat16()
    q_pe = torch.randn(T, N, R, generator=g, device="cuda").bfloat16()
    kvs = [torch.randn(S + T, C + R, generator=g, device="cuda").bfloat16() for _ in range(n_sets)]
    mask = None if T == 1 else random_tree_mask(T, seed).cuda()
    return q_lat, q_pe, kvs, mask


def sdpa_fn(q_lat, q_pe, kv, S, mask):
    import torch.nn.functional as F

    T, N, _ = q_lat.shape
    q = torch.cat([q_lat, q_pe], -1).transpose(0, 1)[None]  # [1, N, T, 576]
    k = kv[None, None].expand(1, N, S + T, C + R)
    v = kv[None, None, :, :C].expand(1, N, S + T, C)
    tm = torch.ones(T, T, dtype=torch.bool, device=kv.device).tril() if mask is None else mask
    am = torch.cat([torch.ones(T, S, dtype=torch.bool, device=kv.device), tm], 1)

    def run():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=am, scale=SCALE)

    return run


def bench_case(N, S, T, bw, mm, cfg=None, peers=True, reps=20):
    kv_bytes = (S + T) * (C + R) * 2
    n_sets = max(1, min(16, math.ceil(3 * l2_bytes() / kv_bytes)))
    q_lat, q_pe, kvs, mask = make_case(N, S, T, n_sets, seed=S + T + N)
    rec = {"N": N, "S": S, "T": T, "config": (cfg or default_config(N)).as_dict()}
    out = mla_attention(q_lat, q_pe, kvs[0], S, mask, SCALE, C, config=cfg)
    ref = mla_attention_reference(q_lat, q_pe, kvs[0], S, mask, SCALE, C)
    rec["rel_err"] = rel(out, ref)
    if cfg is not None:
        rec["diff_vs_default"] = int((out != mla_attention(q_lat, q_pe, kvs[0], S, mask, SCALE, C)).sum())
    t = time_calls([lambda kv=kv: mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C, config=cfg) for kv in kvs],
                   reps=reps)
    rec["us"] = t["us"]
    rec["graph"] = t["graph"]
    nbytes = kv_bytes + T * N * (C + R) * 2 + T * N * C * 2
    flops = 2 * T * N * S * (C + R + C)
    rec["bytes"] = nbytes
    rec["flops"] = flops
    rec["mem_us"] = nbytes / bw * 1e6
    rec["flop_us"] = flops / mm * 1e6
    rec["x_copy"] = rec["mem_us"] / rec["us"]
    rec["x_roof"] = max(rec["mem_us"], rec["flop_us"]) / rec["us"]
    rec["TBps"] = nbytes / (rec["us"] * 1e-6) / 1e12
    rec["TFLOPs"] = flops / (rec["us"] * 1e-6) / 1e12
    if peers:
        for name, mk in (("sdpa", lambda kv: sdpa_fn(q_lat, q_pe, kv, S, mask)),
                         ("ref", lambda kv: (lambda: mla_attention_reference(q_lat, q_pe, kv, S, mask, SCALE, C)))):
            try:
                fns = [mk(kv) for kv in kvs[:2]]
                if name == "sdpa":
                    o = fns[0]()[0].transpose(0, 1)
                    rec["sdpa_rel_err"] = rel(o, ref)
                rec[f"{name}_us"] = time_calls(fns, reps=5, warmup=1, use_graph=False)["us"]
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                rec[f"{name}_us"] = None
                rec[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:160]
            torch.cuda.empty_cache()
    del kvs
    torch.cuda.empty_cache()
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--sweep", action="store_true", help="also time the configs in SWEEP")
    ap.add_argument("--sweep-only", action="store_true", help="time only the configs in SWEEP")
    ap.add_argument("--sweep-decode", action="store_true",
                    help="with --sweep-only: time DECODE_SWEEP (V_SPLIT for T = 1) at DECODE_SHAPES instead")
    ap.add_argument("--sweep-chunk", action="store_true",
                    help="with --sweep-only: time CHUNK_FOR_N (chunk lengths) at CHUNK_SHAPES instead")
    ap.add_argument("--sweep-rows", action="store_true",
                    help="with --sweep-only: time ROWS_SWEEP (decode rows per program, N = 8) at ROWS_SHAPES instead")
    ap.add_argument("--sweep-vsplit", action="store_true",
                    help="with --sweep-only: time VSPLIT_FOR_N (column slices of verify launches up to 16 nodes) "
                         "at VSPLIT_SHAPES instead")
    ap.add_argument("--sweep-n", type=int, default=None, help="with --sweep-only: only the sweep's shapes of these "
                    "heads per rank")
    ap.add_argument("--sweep-wide", action="store_true",
                    help="with --sweep-only: time WIDE_FOR_N (64-row verify tiles) at WIDE_SHAPES instead, with "
                         "their bits against the default's")
    ap.add_argument("--sweep-small", action="store_true",
                    help="with --sweep-only: time SMALL_FOR_N (trees of up to 8 nodes on the decode tiles) at "
                         "SMALL_SHAPES instead, with their bits against the default's")
    ap.add_argument("--sweep-wg", action="store_true",
                    help="with --sweep-only: time WG_FOR_N (the warpgroup launches' score chains, rows per program "
                         "and slices) at WG_SHAPES instead, with their bits against the default's")
    ap.add_argument("--sweep-verify", action="store_true",
                    help="with --sweep-only: time VERIFY_FOR_N (a tree's prefix chunks on the warpgroup kernel) at "
                         "VERIFY_SHAPES instead, with their bits against the default's")
    ap.add_argument("--workers", type=int, default=0, help="compile processes for the sweep (0: CPUs)")
    ap.add_argument("--no-peers", action="store_true", help="skip sdpa and the torch reference")
    ap.add_argument("--budget-s", type=float, default=100.0, help="stop the sweep after this many seconds")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    clock = Clock()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    mm = bf16_matmul_rate()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for N in ([] if args.sweep_only else HEADS):
        for S in CONTEXTS:
            for T in TREE_NODES:
                rec = bench_case(N, S, T, bw, mm, peers=not args.no_peers)
                rows.append(rec)
                print(f"N={N:3d} S={S:6d} T={T:3d}  {rec['us']:8.1f} us  x copy {rec['x_copy']:.2f}  "
                      f"x roof {rec['x_roof']:.2f}  sdpa {rec.get('sdpa_us')}  ref {rec.get('ref_us')}  "
                      f"err {rec['rel_err']:.2g}  [{clock():.0f}s]", flush=True)
    sweep = []
    if args.sweep or args.sweep_only:
        import os

        workers = args.workers or min(16, os.cpu_count() or 1)
        cands, shapes = ((DECODE_SWEEP, DECODE_SHAPES) if args.sweep_decode else
                         (CHUNK_SWEEP, CHUNK_SHAPES) if args.sweep_chunk else
                         (ROWS_SWEEP, ROWS_SHAPES) if args.sweep_rows else
                         (VSPLIT_SWEEP, VSPLIT_SHAPES) if args.sweep_vsplit else
                         (WIDE_SWEEP, WIDE_SHAPES) if args.sweep_wide else
                         (SMALL_SWEEP, SMALL_SHAPES) if args.sweep_small else
                         (WG_SWEEP, WG_SHAPES) if args.sweep_wg else
                         (VERIFY_SWEEP, VERIFY_SHAPES) if args.sweep_verify else (SWEEP, SWEEP_SHAPES))
        shapes = [sh for sh in shapes if args.sweep_n is None or sh[0] == args.sweep_n]
        per_n = (CHUNK_FOR_N if args.sweep_chunk else ROWS_FOR_N if args.sweep_rows else
                 VSPLIT_FOR_N if args.sweep_vsplit else
                 WIDE_FOR_N if args.sweep_wide else SMALL_FOR_N if args.sweep_small else
                 WG_FOR_N if args.sweep_wg else VERIFY_FOR_N if args.sweep_verify else None)
        compile_err = precompile(cands, shapes, workers)
        print(f"compiled {len(compile_err)} (config, N, T kind) in {clock():.0f}s; "
              f"{sum(e is not None for e in compile_err.values())} failed", flush=True)
        for N, S, T in shapes:  # shape-major: a budget cut leaves whole shapes compared
            for cfg in (per_n[N] if per_n else cands):
                base = {"N": N, "S": S, "T": T, "config": cfg.as_dict()}
                err = compile_err.get((cfg, N, T == 1))
                if err is not None:
                    sweep.append({**base, "error": err})
                    continue
                if clock() > args.budget_s:
                    sweep.append({**base, "skipped": "time budget"})
                    continue
                try:
                    rec = bench_case(N, S, T, bw, mm, cfg=cfg, peers=False, reps=10)
                except Exception as exc:  # noqa: BLE001 - a failing variant is reported
                    rec = {**base, "error": str(exc)[:200]}
                sweep.append(rec)
                print("sweep", cfg.as_dict(), N, S, T, f"{rec.get('us', float('nan')):.1f} us",
                      f"x copy {rec.get('x_copy', float('nan')):.3f} x roof {rec.get('x_roof', float('nan')):.3f}"
                      f" err {rec.get('rel_err')} diff {rec.get('diff_vs_default')}", flush=True)

    info = device_info()
    gpu = gpu_stem(info["gpu"])
    payload = {"command": command_line(), "device": info, "copy_Bps": bw, "bf16_flops": mm,
               "cases": rows, "sweep": sweep, "seconds": clock()}
    headers = ["N", "S", "T", "us", "TB/s", "x copy", "TFLOP/s", "x roof", "sdpa us", "ref us", "err"]
    table = [[r["N"], r["S"], r["T"], r["us"], r["TBps"], r["x_copy"], r["TFLOPs"], r["x_roof"],
              r.get("sdpa_us"), r.get("ref_us"), f"{r['rel_err']:.1e}"] for r in rows]
    md = [f"# MLA attention (absorbed, bf16) on {info['gpu']}", "",
          f"Command: `{payload['command']}`", "",
          f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write), bf16 matmul {mm / 1e12:.0f} TFLOP/s, "
          f"torch {info['torch']}, triton {info['triton']}. C=512, R=64; T=1 causal decode, T>1 random tree.",
          "x copy = (KV + q + out bytes / copy bandwidth) / time; x roof = max(that, FLOPs / matmul rate) / time.",
          "sdpa: torch scaled_dot_product_attention on q=[q_lat|q_pe] vs K=kv, V=c_kv with a bool mask.", ""]
    if rows:
        md += md_table(headers, table)
    errs = {f"{r['N']}/{r['S']}/{r['T']}": r.get("sdpa_error") for r in rows if r.get("sdpa_error")}
    if errs:
        md += ["", "sdpa errors: " + "; ".join(f"{k}: {v}" for k, v in list(errs.items())[:3])]
    if sweep:
        md += ["", "## Config sweep", ""]
        md += md_table(["config", "N", "S", "T", "us", "x copy", "x roof", "err", "diff vs default"],
                       [[_cfg_str(s["config"]), s["N"], s["S"], s["T"], s.get("us"), s.get("x_copy"),
                         s.get("x_roof"), s.get("rel_err", s.get("error", s.get("skipped"))),
                         s.get("diff_vs_default")]
                        for s in sweep])
        md += ["", "## Best candidate per shape", ""] + best_per_shape(sweep)
    kind = ("decode-" if args.sweep_decode else "chunk-" if args.sweep_chunk else
            "rows-" if args.sweep_rows else "vsplit-" if args.sweep_vsplit else "wide-" if args.sweep_wide else
            "small-" if args.sweep_small else "wg-" if args.sweep_wg else "verify-" if args.sweep_verify else "")
    stem = (f"mla_attention-{kind}sweep-{gpu}" if args.sweep_only
            else f"mla_attention-{gpu}")
    jp, mp = write_results(args.out, stem, payload, md)
    print(f"wrote {jp} and {mp} in {clock():.0f}s")
    if rows:
        print("\n".join(md_table(headers, table)))
    if sweep:
        print("\n".join(best_per_shape(sweep)))
    return payload


def _cfg_str(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


def best_per_shape(sweep: list[dict]) -> list[str]:
    """Per swept shape: the fastest candidate, its time, x copy / x roof, and the default's time."""
    out = []
    shapes = sorted({(s["N"], s["S"], s["T"]) for s in sweep}, key=lambda k: (-k[0], k[2], k[1]))
    base = SWEEP[0].as_dict()
    for N, S, T in shapes:
        done = [s for s in sweep if (s["N"], s["S"], s["T"]) == (N, S, T) and "us" in s]
        if not done:
            continue
        b = min(done, key=lambda s: s["us"])
        d = next((s["us"] for s in done if s["config"] == base), None)
        out.append([N, S, T, b["us"], b["x_copy"], b["x_roof"], d, _cfg_str(b["config"])])
    return md_table(["N", "S", "T", "best us", "x copy", "x roof", "default us", "config"], out)


if __name__ == "__main__":
    main()
