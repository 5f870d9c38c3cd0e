"""Benchmark: batch-invariant dense GEMM (kernels/gemm.py) against cuBLAS (torch F.linear) on the K2
dense shapes, bf16, at M = 1, 4, 16, 64, 129, 256; plus RMSNorm (kernels/rmsnorm.py) against torch, and the
per-head GEMM of the MLA absorption (bi_head_linear) against torch einsum.

    python bench/gemm.py --out bench/results            # writes gemm-<gpu>.json and .md
    python bench/gemm.py --sweep                        # also times candidate tiles / reductions

For every point: median time (triton.testing.do_bench, L2 flushed between runs), effective TB/s on the
weight bytes, the ratio of cuBLAS time to ours (1.0 = parity; >= 0.9 is the cost target), the relative
error of each against an fp32 product, and whether each is batch-invariant at that point (rows computed
alone, M = 1, against the same rows inside the M-row launch, bit for bit). Ceilings measured in the same
run: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate at 8192^3.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import gpu_stem, write_results  # noqa: E402

SHAPES = [  # name, N (out), K (in)
    ("q_a+kv_a", 2112, 7168),
    ("q_b", 12288, 1536),
    ("o_proj", 7168, 8192),
    ("shared_w13", 4096, 7168),
    ("shared_w2", 7168, 2048),
    ("lm_head", 163840, 7168),
]
# one rank of TP8 (8 heads, the shared expert's width / 8, a vocabulary shard; q_a+kv_a is replicated, above)
RANK_SHAPES = [
    ("q_b@tp8", 1536, 1536),
    ("o_proj@tp8", 7168, 1024),
    ("shared_w13@tp8", 512, 7168),
    ("shared_w2@tp8", 7168, 256),
    ("lm_head@tp8", 20480, 7168),
]
# Moonlight-16B-A3B's dense linears (hidden 2048, 16 heads, no query LoRA; the shared experts' 2 x 1408 width)
MOONLIGHT_SHAPES = [
    ("q+kv_a@moonlight", 3648, 2048),
    ("o_proj@moonlight", 2048, 2048),
    ("shared_w13@moonlight", 5632, 2048),
    ("shared_w2@moonlight", 2048, 2816),
    ("lm_head@moonlight", 163840, 2048),
]
MS = [1, 4, 16, 64, 129, 256]


def _bench(fn, rep_ms: float = 20.0) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"))  # ms


def _graph_us(fns, reps: int = 10) -> float:
    """Median time of one call, from replays of a CUDA graph of `reps` rounds over `fns` (one fn per
    weight copy, so that the weights come from HBM rather than L2). Measures GPU time with the launch
    gaps of a captured graph, not Python launch overhead."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    from triton.testing import do_bench

    t = do_bench(g.replay, warmup=5, rep=30, return_mode="median")
    return float(t) * 1e3 / (reps * len(fns))


def _copies(N: int, K: int, w: torch.Tensor) -> list[torch.Tensor]:
    """Enough weight copies to exceed the L2 several times (>= 256 MB in all, at most 8)."""
    n = min(8, max(1, -(-(256 << 20) // (N * K * 2))))
    return [w] + [w.clone() for _ in range(n - 1)]


def ceilings() -> dict:
    n = 1 << 29  # 1 GiB of bf16
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    t = _bench(lambda: b.copy_(a), 20)
    copy_tbs = 2 * a.numel() * 2 / (t * 1e-3) / 1e12
    del a, b
    s = 8192
    x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
    t = _bench(lambda: x @ y, 50)
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": 2 * s ** 3 / (t * 1e-3) / 1e12}


def _rows_alone_equal(fn, x: torch.Tensor, y: torch.Tensor, rows) -> tuple[bool, float]:
    """Are rows of y = fn(x) equal bitwise to fn(x[i:i+1])? Also the max abs difference."""
    worst = 0.0
    for i in rows:
        d = (fn(x[i:i + 1])[0].float() - y[i].float()).abs().max().item()
        worst = max(worst, d)
    return worst == 0.0, worst


def bench_gemm(shapes, ms, rep_ms: float) -> list[dict]:
    from kdtree_engine.kernels.gemm import bi_linear, reduction_for, tile_for

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K in shapes:
        w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
        xs = torch.randn(max(ms), K, device="cuda", generator=g).to(torch.bfloat16)
        wbytes = N * K * 2
        ws = _copies(N, K, w)
        red = reduction_for(N, K, torch.bfloat16)
        for M in ms:
            x = xs[:M]
            ref = x.float() @ w.float().T
            y_cb = F.linear(x, w)
            y_bi = bi_linear(x, w)
            rows = sorted({0, M // 2, M - 1})
            cb_inv, cb_diff = _rows_alone_equal(lambda a: F.linear(a, w), x, y_cb, rows)
            bi_inv, bi_diff = _rows_alone_equal(lambda a: bi_linear(a, w), x, y_bi, rows)
            e_cb = _bench(lambda: F.linear(x, w), rep_ms) * 1e3
            e_bi = _bench(lambda: bi_linear(x, w), rep_ms) * 1e3
            t_cb = _graph_us([lambda c=c: F.linear(x, c) for c in ws])
            t_bi = _graph_us([lambda c=c: bi_linear(x, c) for c in ws])
            tile = tile_for(M, torch.bfloat16, N, K)
            rec = {
                "shape": name, "N": N, "K": K, "M": M,
                "cublas_us": t_cb, "bi_us": t_bi, "cublas_eager_us": e_cb, "bi_eager_us": e_bi,
                "cublas_TBps": wbytes / (t_cb * 1e-6) / 1e12, "bi_TBps": wbytes / (t_bi * 1e-6) / 1e12,
                "bi_TFLOPs": 2 * M * N * K / (t_bi * 1e-6) / 1e12,
                "speed_vs_cublas": t_cb / t_bi,
                "cublas_rel_err": float((y_cb.float() - ref).norm() / ref.norm()),
                "bi_rel_err": float((y_bi.float() - ref).norm() / ref.norm()),
                "cublas_invariant": cb_inv, "cublas_max_row_diff": cb_diff,
                "bi_invariant": bi_inv, "bi_max_row_diff": bi_diff,
                "BLOCK_K": red.BLOCK_K, "split_k": red.n_splits(K),
                "tile": f"{tile.BLOCK_M}x{tile.BLOCK_N} w{tile.num_warps} s{tile.num_stages}",
            }
            out.append(rec)
            print(f"{name:11s} M={M:4d}  cublas {t_cb:8.1f} us  bi {t_bi:8.1f} us  (eager {e_cb:.1f} / {e_bi:.1f})  "
                  f"ratio {rec['speed_vs_cublas']:.3f}  bi {rec['bi_TBps']:.2f} TB/s  "
                  f"inv cublas={cb_inv} bi={bi_inv}", flush=True)
        del w, xs, ws
        torch.cuda.empty_cache()
    return out


def bench_rmsnorm(ms, rep_ms: float) -> list[dict]:
    from kdtree_engine.kernels.rmsnorm import bi_rmsnorm, rmsnorm_reference

    out = []
    for H in (7168, 1536, 512):
        w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
        xs = torch.randn(max(ms), H, device="cuda").to(torch.bfloat16)
        for M in ms:
            x = xs[:M]
            rows = sorted({0, M // 2, M - 1})
            y_t = rmsnorm_reference(x, w, 1e-6)
            y_b = bi_rmsnorm(x, w, 1e-6)
            t_inv, t_diff = _rows_alone_equal(lambda a: rmsnorm_reference(a, w, 1e-6), x, y_t, rows)
            b_inv, b_diff = _rows_alone_equal(lambda a: bi_rmsnorm(a, w, 1e-6), x, y_b, rows)
            rec = {"H": H, "M": M,
                   "torch_us": _graph_us([lambda: rmsnorm_reference(x, w, 1e-6)], 20),
                   "bi_us": _graph_us([lambda: bi_rmsnorm(x, w, 1e-6)], 20),
                   "torch_invariant": t_inv, "torch_max_row_diff": t_diff,
                   "bi_invariant": b_inv, "bi_max_row_diff": b_diff,
                   "max_abs_diff_vs_torch": (y_b.float() - y_t.float()).abs().max().item()}
            out.append(rec)
        print(f"rmsnorm H={H}: torch invariant at all M: {all(r['torch_invariant'] for r in out if r['H'] == H)}",
              flush=True)
    return out


HEAD_SHAPES = [  # name, heads, N (out), K (in), weight passed as a transposed view (as W_UK)
    ("q_nope x W_UK", 64, 512, 128, True),
    ("o_lat x W_UV", 64, 128, 512, False),
    ("q_nope x W_UK", 8, 512, 128, True),
    ("o_lat x W_UV", 8, 128, 512, False),
]


def _head_weights(B: int, N: int, K: int, transposed: bool, g: torch.Generator) -> tuple[torch.Tensor, list]:
    """Per-head bf16 weights [B, N, K] (a transposed view of [B, K, N] where `transposed`, as W_UK) and enough
    copies of them (up to 16, 256 MB in all) for graph replays to read them from HBM rather than L2."""
    if transposed:
        w = (torch.randn(B, K, N, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16).transpose(1, 2)
    else:
        w = (torch.randn(B, N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
    return w, [w] + [w.clone() for _ in range(min(16, max(1, -(-(256 << 20) // (B * N * K * 2)))) - 1)]


def bench_heads(ms, rep_ms: float) -> list[dict]:
    """The MLA absorption products (per-head GEMM, kernels/gemm.py bi_head_linear) against torch einsum
    (cuBLAS batched GEMM), operands laid out as the model passes them."""
    from kdtree_engine.kernels.gemm import bi_head_linear

    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, B, N, K, transposed in HEAD_SHAPES:
        w, ws = _head_weights(B, N, K, transposed, g)
        xs = torch.randn(max(ms), B, K + (64 if transposed else 0), device="cuda", generator=g).to(torch.bfloat16)
        for M in ms:
            x = xs[:M, :, :K]
            ref = torch.einsum("tbk,bnk->tbn", x.float(), w.float())
            y_t = torch.einsum("tbk,bnk->tbn", x, w)
            y_b = bi_head_linear(x, w)
            rows = sorted({0, M // 2, M - 1})
            t_inv, _ = _rows_alone_equal(lambda a: torch.einsum("tbk,bnk->tbn", a, w), x, y_t, rows)
            b_inv, _ = _rows_alone_equal(lambda a: bi_head_linear(a, w), x, y_b, rows)
            t_t = _graph_us([lambda c=c: torch.einsum("tbk,bnk->tbn", x, c) for c in ws])
            t_b = _graph_us([lambda c=c: bi_head_linear(x, c) for c in ws])
            rec = {"shape": name, "heads": B, "N": N, "K": K, "M": M, "torch_us": t_t, "bi_us": t_b,
                   "torch_eager_us": _bench(lambda: torch.einsum("tbk,bnk->tbn", x, w), rep_ms) * 1e3,
                   "bi_eager_us": _bench(lambda: bi_head_linear(x, w), rep_ms) * 1e3,
                   "speed_vs_torch": t_t / t_b, "bi_TBps": B * N * K * 2 / (t_b * 1e-6) / 1e12,
                   "torch_rel_err": float((y_t.float() - ref).norm() / ref.norm()),
                   "bi_rel_err": float((y_b.float() - ref).norm() / ref.norm()),
                   "torch_invariant": t_inv, "bi_invariant": b_inv}
            out.append(rec)
            print(f"{name} x{B:2d} M={M:4d}  torch {t_t:7.1f} us  bi {t_b:7.1f} us  ratio {rec['speed_vs_torch']:.3f}  "
                  f"inv torch={t_inv} bi={b_inv}", flush=True)
        del w, ws, xs
        torch.cuda.empty_cache()
    return out


def sweep(shapes, ms, seconds: float = 260.0) -> list[dict]:
    """Graph-times candidate reductions (BLOCK_K, split) x tiles for at most ``seconds``; prints the best per
    (shape, M)."""
    from kdtree_engine.kernels.gemm import Reduction, Tile, bi_linear

    tiles_small = [Tile(16, 32, 2, 6), Tile(16, 64, 4, 4), Tile(16, 64, 4, 6), Tile(16, 64, 4, 8),
                   Tile(16, 128, 8, 4)]
    tiles_mid = [Tile(64, 64, 4, 4), Tile(64, 128, 4, 4), Tile(32, 128, 4, 4)]
    tiles_big = [Tile(128, 128, 8, 4), Tile(128, 128, 8, 3), Tile(128, 64, 4, 4), Tile(64, 128, 4, 4),
                 Tile(64, 256, 8, 3), Tile(256, 128, 8, 3)]
    out = []
    g = torch.Generator(device="cuda").manual_seed(1)
    t_end = time.time() + seconds  # keep the whole sweep bounded
    for name, N, K in shapes:
        w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
        ws = _copies(N, K, w)
        xs = torch.randn(max(ms), K, device="cuda", generator=g).to(torch.bfloat16)
        reds = [Reduction(bk, s) for bk, s in ((64, 1), (128, 1), (64, 2), (128, 2), (64, 4), (128, 4), (64, 8),
                                                (128, 8), (64, 16))
                if (K + bk - 1) // bk >= 4 * s]
        for M in ms:
            if time.time() > t_end:
                print("sweep: time budget spent", flush=True)
                return out
            x = xs[:M]
            t_cb = _graph_us([lambda c=c: F.linear(x, c) for c in ws])
            tiles = tiles_small if M <= 16 else tiles_mid if M <= 64 else tiles_big
            res = []
            for red in reds:
                for tile in tiles:
                    if (tile.BLOCK_N + tile.BLOCK_M) * red.BLOCK_K * 2 * tile.num_stages > 220 * 1024:
                        continue
                    try:
                        t = _graph_us([lambda c=c: bi_linear(x, c, tile=tile, reduction=red) for c in ws])
                    except Exception as e:  # out of shared memory etc.
                        print(f"  skip {red} {tile}: {type(e).__name__}", flush=True)
                        continue
                    res.append((t, red, tile))
                    out.append({"shape": name, "M": M, "BLOCK_K": red.BLOCK_K, "split": red.split_k, "us": t,
                                "cublas_us": t_cb, "ratio": t_cb / t,
                                "tile": [tile.BLOCK_M, tile.BLOCK_N, tile.num_warps, tile.num_stages]})
            res.sort(key=lambda r: r[0])
            per_red = {}
            for t, red, tile in res:
                per_red.setdefault((red.BLOCK_K, red.split_k), (t, tile))
            print(f"sweep {name:11s} M={M:4d} cublas {t_cb:7.1f} us | " + " | ".join(
                f"bk{bk}s{sp} {t:6.1f} ({t_cb / t:.2f}) {tl.BLOCK_M}x{tl.BLOCK_N}w{tl.num_warps}s{tl.num_stages}"
                for (bk, sp), (t, tl) in sorted(per_red.items())), flush=True)
        del w, xs, ws
        torch.cuda.empty_cache()
    return out


# Per-head tiles: the absorption products have K = 128 (W_UK: one K step, 512 programs of 64 rows) or 512 (W_UV), so
# the default 6-stage tile's shared memory (one program per SM) only serializes the programs. Any tile gives the
# same bits (the reduction is head_reduction_for's). W_UK is timed both as the engine passes it (a transposed view
# of kv_b_proj's rows: k strided) and contiguous [N, K] (whether a copy in that layout would pay).
HEAD_SWEEP_TILES = [(16, 64, 4, 6), (16, 64, 4, 1), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 1), (16, 128, 4, 2),
                    (16, 128, 8, 1), (16, 128, 8, 2), (16, 256, 8, 1)]
HEAD_SWEEP_SHAPES = [("q_nope x W_UK (view)", 64, 512, 128, True), ("q_nope x W_UK", 64, 512, 128, False),
                     ("o_lat x W_UV", 64, 128, 512, False), ("q_nope x W_UK", 8, 512, 128, False),
                     ("o_lat x W_UV", 8, 128, 512, False)]


def sweep_heads(ms) -> list[dict]:
    """Graph-times the per-head GEMM's candidate tiles (HEAD_SWEEP_TILES) at each M; prints the best per shape."""
    from kdtree_engine.kernels.gemm import Tile, bi_head_linear

    out = []
    g = torch.Generator(device="cuda").manual_seed(2)
    for name, B, N, K, transposed in HEAD_SWEEP_SHAPES:
        w, ws = _head_weights(B, N, K, transposed, g)
        xs = torch.randn(max(ms), B, K, device="cuda", generator=g).to(torch.bfloat16)
        for M in ms:
            x = xs[:M]
            base = bi_head_linear(x, w)
            res = []
            for t in HEAD_SWEEP_TILES:
                tile = Tile(*t)
                same = bool(torch.equal(bi_head_linear(x, w, tile=tile), base))
                us = _graph_us([lambda c=c: bi_head_linear(x, c, tile=tile) for c in ws])
                res.append((us, t, same))
                out.append({"shape": name, "heads": B, "N": N, "K": K, "M": M, "tile": list(t), "us": us,
                            "same_bits": same, "TBps": B * N * K * 2 / (us * 1e-6) / 1e12})
            print(f"heads {name:22s} x{B:2d} M={M:3d} | " + " | ".join(
                f"{t[0]}x{t[1]}w{t[2]}s{t[3]} {us:5.1f}{'' if same else ' DIFF'}" for us, t, same in res), flush=True)
        del w, ws, xs
        torch.cuda.empty_cache()
    return out


def markdown(res: dict) -> list[str]:
    c = res["ceilings"]
    lines = [f"# Batch-invariant GEMM vs cuBLAS — {res['gpu']}", "",
             f"torch {res['torch']}, triton {res['triton']}. Ceilings measured in the same run: copy "
             f"{c['copy_TBps']:.2f} TB/s (read+write), bf16 matmul {c['bf16_matmul_TFLOPs']:.0f} TFLOP/s.",
             "Times: median per call from CUDA-graph replays over enough weight copies to miss L2 (GPU time); "
             "eager = triton.testing.do_bench of the Python call (includes launch overhead when it exceeds "
             "the L2 flush). ratio = cuBLAS time / bi_linear time, graph times (>= 0.90 meets the cost "
             "target). inv = rows computed alone equal the rows inside the M-row launch, bit for bit.", "",
             "| shape | N x K | M | cuBLAS us | bi us | ratio | bi TB/s (weights) | bi TFLOP/s | eager cuBLAS / bi us | "
             "cuBLAS inv | bi inv | split | tile |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["gemm"]:
        lines.append(f"| {r['shape']} | {r['N']}x{r['K']} | {r['M']} | {r['cublas_us']:.1f} | {r['bi_us']:.1f} | "
                     f"{r['speed_vs_cublas']:.3f} | {r['bi_TBps']:.2f} | {r['bi_TFLOPs']:.0f} | "
                     f"{r['cublas_eager_us']:.1f} / {r['bi_eager_us']:.1f} | "
                     f"{'yes' if r['cublas_invariant'] else 'NO'} | {'yes' if r['bi_invariant'] else 'NO'} | "
                     f"{r['split_k']} | {r['tile']} |")
    if res.get("rmsnorm"):
        lines += ["", "## RMSNorm (bf16)", "", "| H | M | torch us | bi us | torch inv | bi inv | max diff vs torch |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["rmsnorm"]:
            lines.append(f"| {r['H']} | {r['M']} | {r['torch_us']:.1f} | {r['bi_us']:.1f} | "
                         f"{'yes' if r['torch_invariant'] else 'NO'} | {'yes' if r['bi_invariant'] else 'NO'} | "
                         f"{r['max_abs_diff_vs_torch']:.3g} |")
    if res.get("heads"):
        lines += ["", "## Per-head GEMM: MLA absorption (bf16), bi_head_linear vs torch einsum (cuBLAS batched)", "",
                  "| product | heads | N x K | M | torch us | bi us | ratio | eager torch / bi us | torch inv | bi inv |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["heads"]:
            lines.append(f"| {r['shape']} | {r['heads']} | {r['N']}x{r['K']} | {r['M']} | {r['torch_us']:.1f} | "
                         f"{r['bi_us']:.1f} | {r['speed_vs_torch']:.3f} | {r['torch_eager_us']:.1f} / "
                         f"{r['bi_eager_us']:.1f} | {'yes' if r['torch_invariant'] else 'NO'} | "
                         f"{'yes' if r['bi_invariant'] else 'NO'} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for gemm-<gpu>.json/.md")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated M values")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: the K2 shapes; names "
                    "ending @tp8 are one rank's of TP8, 'rank' all of those; 'moonlight' Moonlight-16B's)")
    ap.add_argument("--sweep-seconds", type=float, default=260.0, help="time budget of the sweep")
    ap.add_argument("--rep-ms", type=float, default=20.0, help="do_bench repetition time per point")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tiles / reductions")
    ap.add_argument("--sweep-ms", default="1,16,64,129,256", help="M values of the sweep")
    ap.add_argument("--sweep-heads", action="store_true", help="also time the per-head GEMM's candidate tiles")
    ap.add_argument("--no-rmsnorm", action="store_true")
    ap.add_argument("--no-heads", action="store_true", help="skip the per-head (MLA absorption) GEMM")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemm.py needs a CUDA device")
    import triton

    t0 = time.time()
    ms = [int(m) for m in args.ms.split(",") if m]
    names = [s for s in args.shapes.split(",") if s]
    known = {n for n, _, _ in SHAPES + RANK_SHAPES + MOONLIGHT_SHAPES} | {"rank", "moonlight"}
    if [n for n in names if n not in known]:
        ap.error(f"--shapes: unknown {[n for n in names if n not in known][0]!r} (known: {', '.join(sorted(known))})")
    if "rank" in names:
        names += [n for n, _, _ in RANK_SHAPES] + ["q_a+kv_a"]
    if "moonlight" in names:
        names += [n for n, _, _ in MOONLIGHT_SHAPES]
    shapes = [s for s in SHAPES + RANK_SHAPES + MOONLIGHT_SHAPES if (not names and s in SHAPES) or s[0] in names]
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "ceilings": ceilings()}
    print(f"ceilings: {res['ceilings']}", flush=True)
    res["gemm"] = bench_gemm(shapes, ms, args.rep_ms)
    if not args.no_rmsnorm:
        res["rmsnorm"] = bench_rmsnorm(ms, args.rep_ms)
    if not args.no_heads:
        res["heads"] = bench_heads(ms, args.rep_ms)
    if args.sweep:
        res["sweep"] = sweep(shapes, [int(m) for m in args.sweep_ms.split(",") if m], args.sweep_seconds)
    if args.sweep_heads:
        res["sweep_heads"] = sweep_heads([m for m in ms if m <= 16] or [1])
    res["wall_s"] = time.time() - t0
    jp, mp = write_results(args.out, f"gemm-{gpu_stem(torch.cuda.get_device_name())}", res, markdown(res))
    print(f"\n(CUDA-graph times) {'shape':11s} {'M':>4s} {'cuBLAS us':>9s} {'bi us':>8s} {'ratio':>6s} {'TB/s':>5s} inv(cb,bi)")
    for r in res["gemm"]:
        print(f"{r['shape']:11s} {r['M']:4d} {r['cublas_us']:9.1f} {r['bi_us']:8.1f} {r['speed_vs_cublas']:6.3f} "
              f"{r['bi_TBps']:5.2f} {int(r['cublas_invariant'])}{int(r['bi_invariant'])}")
    print(f"wrote {jp} and {mp} in {res['wall_s']:.0f} s")
    return res


if __name__ == "__main__":
    main()
