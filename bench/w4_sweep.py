"""W4A16 candidate sweep: dense [36864 x 7168] at M = 1, 4, 16 and the K2 MoE layer at T = 1, 4, 16.

Each candidate is one config family (what a batch-invariant table can use for every M: see
kdtree_engine/kernels/w4a16.py `check_table`). The sweep prints, per shape, a compact table
(candidate -> us, TB/s, x copy, x bf16) and at the end the best candidate per shape, the best candidate
over all three sizes (sum of times), and the table line to paste into DENSE_CONFIGS / MOE_CONFIGS.
Candidates run in list order and stop at the time budget (the rest are reported as skipped), so the
most informative ones come first.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from kdtree_engine.kernels.moe_w4a16 import MoEConfig, fused_moe_reference, fused_moe_w4a16
from kdtree_engine.kernels.w4a16 import W4Config, w4a16_linear, w4a16_linear_reference
from kdtree_engine.quant import dequantize

SIZES = (1, 4, 16)
DENSE_NK = (36864, 7168)


def _d(**kw) -> W4Config:
    return W4Config(**{"BLOCK_M": 16, **kw})


X2 = dict(DEQUANT="bf16x2")
# name -> the candidate's config at M = 16
DENSE_CANDIDATES: list[tuple[str, W4Config]] = [
    # The K loop's three tiles (packed weights, scales, activations) are all asynchronous copies since
    # the scale tile got its alignment hints (before, a synchronous 2-byte load stalled every K step; for
    # bf16x2 a per-word gather). bench/w4_aot.py: instructions per weight element in the K loop:
    # dot_float ~7.4, dot_x2 ~4.0. N=36864 gives 576 programs at BLOCK_N 64. A "group" dequant (raw
    # codes into the MMA, scale applied per group of 32 after it) measured 3-4x slower and was dropped.
    ("dot_x2_n64_k256_w4_s4_split2", _d(**X2, split_k=2)),                   # the current default
]
# measured slower than the default (bench/results/kernels-h200-sweep-m64.md): 5 stages, split 4, 8 warps,
# BLOCK_N 128 / 32, BLOCK_K 128 with 6 stages (90.8-175 against 89 us at M = 1), and the tokens on the
# MMA's M side in 64-row wgmma tiles (the dequantized tile as the shared-memory B operand: no LDSM reload,
# one wgmma wait per K step; 155-198 us); earlier sweeps: float dequant, split 1, k128 without split


def _m(**kw) -> MoEConfig:
    return MoEConfig(**{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4, **kw})


MOE_CANDIDATES: list[tuple[str, MoEConfig]] = [
    # the current default (gate/up split in two over H, 3 stages): 198 / 158 registers on sm_90 (triton
    # 3.6, bench/w4_aot.py), so 2 / 3 programs of 4 warps per SM; capped registers give 3 / 4
    ("dot_x2_n64_k256_w4_s3_split2", _m(**X2, num_stages=3, SPLIT_K=2)),
]
# expert block rows at larger T (bench/kernels.py --sweep-only --sweep-moe-rows): the same kernels with
# 16 / 32 / 64 token rows per expert block (BLOCK_M is not in the reduction key: same bits)
MOE_ROWS_SIZES = (32, 64, 128, 256, 512)
MOE_ROWS_CANDIDATES: list[tuple[str, MoEConfig]] = [
    (f"dot_x2_n64_k256_w4_s{st}_split2_bm{bm}", _m(**X2, num_stages=st, SPLIT_K=2, BLOCK_M=bm))
    for bm, st in ((16, 3), (32, 3), (64, 2))
]
# register caps (MAXNREG13 / MAXNREG2 168 / 128 / 128 + 128 at 2-3 stages) measured slower:
# bench/results/kernels-h200-sweep-maxnreg.md; the down GEMM split over I (SPLIT_K2 2 / 4) too:
# bench/results/kernels-h200-sweep-down.md; 8-token expert blocks (mma.sync on sm_90) at 2 / 3 / 4 stages
# too: bench/results/kernels-h200-sweep-bm8.md; the tokens on the MMA's M side in 64-row wgmma tiles
# (BLOCK_N 64 / 128, 3 / 4 stages) 215-234 against 134 us at T = 1: bench/results/kernels-h200-sweep-m64.md
# measured in bench/results/kernels-h200-sweep-splitk.md: split 4, 8 warps, 32-row tiles, BLOCK_K 128,
# BLOCK_N 32, BLOCK_N2 32 (all slower than the default)


def w4_bytes(n: int, k: int, g: int) -> int:
    return n * k // 2 + n * (k // g) * 2


@dataclass
class Ctx:
    copy_bw: float          # B/s (read + write, as bench/common.copy_bandwidth)
    reps: int
    time_calls: Callable    # bench/common.time_calls
    log: Callable
    group: int = 32
    device: str = "cuda"
    dense_nk: tuple[int, int] = DENSE_NK   # smaller in the CPU smoke run
    sizes: tuple[int, ...] = SIZES         # M (dense) / T (MoE) of every candidate


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def _measure(ctx: Ctx, row: dict, deadline: float, run_one: Callable, calls: list, ref: torch.Tensor,
             nbytes: float) -> dict:
    if time.time() > deadline:
        row["skipped"] = "time budget"
        return row
    try:
        row["rel_err"] = _rel(run_one(), ref)
        us = ctx.time_calls(calls, reps=ctx.reps)["us"]
        row.update(us=us, TBps=nbytes / (us * 1e-6) / 1e12)
        row["frac_copy"] = row["TBps"] * 1e12 / ctx.copy_bw
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
        row["error"] = _err(exc)
    return row


def sweep_dense(ctx: Ctx, l2: int, deadline: float) -> list[dict]:
    """Candidates in list order, each at every M (so a candidate's row is complete or skipped)."""
    N, K = ctx.dense_nk
    G = ctx.group
    nbytes = w4_bytes(N, K, G)
    ws = []
    for _ in range(max(1, math.ceil(3 * l2 / nbytes))):
        p = torch.randint(-2**31, 2**31 - 1, (N, K // 8), dtype=torch.int32, device=ctx.device)
        s = (torch.rand((N, K // G), device=ctx.device) * 0.09 + 0.01).to(torch.bfloat16)
        ws.append((p, s))
    wb = dequantize(*ws[0], G, torch.bfloat16)
    xs = {M: torch.randn(M, K, device=ctx.device).to(torch.bfloat16) for M in ctx.sizes}
    refs = {M: w4a16_linear_reference(xs[M], *ws[0], G) for M in ctx.sizes}
    bf16_us = {M: ctx.time_calls([lambda x=xs[M]: F.linear(x, wb)], reps=ctx.reps)["us"] for M in ctx.sizes}
    rows = []
    for name, fam in DENSE_CANDIDATES:
        for M in ctx.sizes:
            cfg, x = fam, xs[M]
            row = {"kernel": "dense", "shape": f"dense {N}x{K}", "size": M, "candidate": name,
                   "config": cfg.as_dict(), "bf16_us": bf16_us[M]}
            _measure(ctx, row, deadline, lambda: w4a16_linear(x, *ws[0], G, config=cfg),
                     [lambda p=p, s=s: w4a16_linear(x, p, s, G, config=cfg) for p, s in ws], refs[M], nbytes)
            if "us" in row:
                row["x_bf16"] = bf16_us[M] / row["us"]
            rows.append(row)
            ctx.log(f"sweep dense M={M} {name}: {row.get('us', row.get('error', row.get('skipped')))}")
    del ws, wb
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def sweep_moe(ctx: Ctx, layer, route: Callable, deadline: float,
              candidates: list[tuple[str, MoEConfig]] = MOE_CANDIDATES) -> list[dict]:
    """route(T, n_sets, generator) -> [(topk_ids [T, k], topk_weights [T, k])] * n_sets."""
    w13p, w13s, w2p, w2s = layer
    E, two_i, h8 = w13p.shape
    H, I = h8 * 8, two_i // 2
    G = ctx.group
    expert_bytes = w4_bytes(2 * I, H, G) + w4_bytes(H, I, G)
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    xs = {T: torch.randn(T, H, device=ctx.device).to(torch.bfloat16) for T in ctx.sizes}
    sets = {T: route(T, 4, gen) for T in ctx.sizes}
    touched = {T: sum(int(torch.unique(ids).numel()) for ids, _ in sets[T]) / len(sets[T]) for T in ctx.sizes}
    refs = {T: fused_moe_reference(xs[T], w13p, w13s, w2p, w2s, *sets[T][0], G) for T in ctx.sizes}
    topk = sets[ctx.sizes[0]][0][0].shape[1]
    rows = []
    for name, cfg in candidates:
        for T in ctx.sizes:
            x, st = xs[T], sets[T]
            row = {"kernel": "moe", "shape": f"moe E={E} top{topk}", "size": T, "candidate": name,
                   "config": cfg.as_dict(), "touched_experts": touched[T]}
            _measure(ctx, row, deadline, lambda: fused_moe_w4a16(x, w13p, w13s, w2p, w2s, *st[0], G, config=cfg),
                     [lambda ids=ids, tw=tw: fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, G, config=cfg)
                      for ids, tw in st], refs[T], touched[T] * expert_bytes)
            rows.append(row)
            ctx.log(f"sweep moe T={T} {name}: {row.get('us', row.get('error', row.get('skipped')))}")
    return rows


# ---------------------------------------------------------------------------------------- report


def _f(v, nd=3) -> str:
    return "n/a" if v is None else (f"{v:.{nd}g}" if abs(v) < 100 else f"{v:.0f}")


def report(rows: list[dict]) -> list[str]:
    """Compact tables per shape + best per shape + best over all sizes + the table line to paste."""
    out: list[str] = []
    for kernel in ("dense", "moe"):
        rs = [r for r in rows if r["kernel"] == kernel]
        if not rs:
            continue
        names = list(dict.fromkeys(r["candidate"] for r in rs))
        sizes = sorted({r["size"] for r in rs})
        by = {(r["candidate"], r["size"]): r for r in rs}
        label = "M" if kernel == "dense" else "T"
        head = f"{kernel} {rs[0]['shape']}: us / TB/s / x copy" + (" / x bf16" if kernel == "dense" else "")
        if kernel == "moe":
            tt = {r["size"]: r.get("touched_experts", float("nan")) for r in rs}
            head += " (experts touched: " + ", ".join(f"T={t}: {v:.1f}" for t, v in tt.items()) + ")"
        out += ["", head, f"{'candidate':34s}" + "".join(f" | {label}={s:<28d}" for s in sizes) + " | err"]
        for n in names:
            cells, errs = [], []
            for s in sizes:
                r = by.get((n, s))
                if r is None or "us" not in r:
                    cells.append(f" | {(r or {}).get('skipped') or (r or {}).get('error', 'n/a')[:30]:30s}")
                    continue
                c = f"{_f(r['us'])} / {_f(r['TBps'])} / {_f(r['frac_copy'], 2)}"
                if kernel == "dense":
                    c += f" / {_f(r['x_bf16'], 2)}"
                cells.append(f" | {c:30s}")
                errs.append(r.get("rel_err", 0.0))
            out.append(f"{n:34s}" + "".join(cells) + f" | {max(errs) if errs else float('nan'):.2g}")
        if kernel == "dense":
            bf = {s: by[(names[0], s)]["bf16_us"] for s in sizes if (names[0], s) in by}
            out.append("bf16 F.linear us: " + ", ".join(f"M={s}: {_f(v)}" for s, v in bf.items()))
    out.append("")
    best_lines = []
    for kernel in ("dense", "moe"):
        rs = [r for r in rows if r["kernel"] == kernel and "us" in r and r.get("rel_err", 1.0) < 2e-2]
        label = "M" if kernel == "dense" else "T"
        sizes = sorted({r["size"] for r in rs})
        for s in sizes:
            cand = [r for r in rs if r["size"] == s]
            if cand:
                b = min(cand, key=lambda r: r["us"])
                best_lines.append(f"{kernel} {label}={s}: {b['candidate']} {_f(b['us'])} us "
                                  f"({_f(b['frac_copy'], 2)} x copy)")
        totals: dict[str, float] = {}
        for n in dict.fromkeys(r["candidate"] for r in rs):
            ts = [r["us"] for r in rs if r["candidate"] == n]
            if len(ts) == len(sizes):
                totals[n] = sum(ts)
        if totals:
            n = min(totals, key=totals.get)
            cfgs = DENSE_CANDIDATES if kernel == "dense" else MOE_CANDIDATES + MOE_ROWS_CANDIDATES
            out.append(f"best {kernel} over {label}={','.join(map(str, sizes))} (sum {_f(totals[n])} us): {n}")
            out.append(f"  apply: {apply_line(kernel, dict(cfgs)[n])}")
    out.append("best per shape: " + "; ".join(best_lines))
    return out


def apply_line(kernel: str, cfg) -> str:
    if kernel == "moe":
        line = (f"MOE_CONFIGS (moe_w4a16.py): first bucket = {cfg!r}; the other buckets take its DEQUANT, "
                f"BLOCK_K and SWAP_AB")
        if not cfg.SWAP_AB:
            line += " (SWAP_AB=False: keep BLOCK_M=16 in every bucket unless test_moe_batch_invariant passes)"
        return line
    line = (f"DENSE_CONFIGS (w4a16.py): (16, {cfg!r}); the larger buckets take its DEQUANT, BLOCK_K, "
            f"SWAP_AB, split_k")
    if not cfg.SWAP_AB:
        line += (" (SWAP_AB=False: BLOCK_M 16 runs mma.sync, 64 wgmma; if tests/gpu "
                 "test_dense_family_batch_invariant[dot_bf16x2_noswap] fails, use BLOCK_M=16 in every bucket)")
    return line


__all__ = ["DENSE_CANDIDATES", "MOE_CANDIDATES", "MOE_ROWS_CANDIDATES", "MOE_ROWS_SIZES", "SIZES", "Ctx",
           "sweep_dense", "sweep_moe", "report"]
