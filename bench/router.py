"""Benchmark: the MoE router's float32 GEMM (x [M, 7168] @ gate [384, 7168].T, as K2 computes router
logits) through the batch-invariant GEMM, with its default tile and candidate tiles, against cuBLAS.

    python bench/router.py --out bench/results        # writes router-<gpu>.json and .md

Tiles only re-tile the output (the reduction, BLOCK_K and split, is fixed by the weight's shape), so every
candidate must give the default's bits: checked per point. Times: median per call from CUDA-graph
replays over weight copies that miss L2; TB/s on the fp32 weight bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (command_line, copy_bandwidth, device_info, gpu_stem, kernel_profile, md_table,  # noqa: E402
                          time_calls, write_results)
from kdtree_engine.kernels.gemm import Tile, bi_linear, reduction_for, tile_for  # noqa: E402

N, K = 384, 7168
MS = (1, 4, 16, 64, 129)
CANDIDATES = {  # name -> tile (BLOCK_M, BLOCK_N, num_warps, num_stages)
    "m16_n64_w4_s4": Tile(16, 64, 4, 4),
    "m16_n32_w4_s4": Tile(16, 32, 4, 4),
    "m16_n32_w2_s6": Tile(16, 32, 2, 6),
    "m16_n16_w2_s6": Tile(16, 16, 2, 6),
    "m16_n16_w1_s8": Tile(16, 16, 1, 8),
    "m32_n32_w4_s4": Tile(32, 32, 4, 4),
}


def _cell(c: dict) -> str:
    if "error" in c:
        return "error: " + c["error"][:40]
    return f"{c['us']:.1f}" + ("" if c["same_bits"] else "*")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also list the kernels of one default call per M")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench router needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    info = device_info()
    copy_bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", generator=gen) * K ** -0.5
    ws = [w] + [w.clone() for _ in range(7)]              # 8 x 11 MB: beyond the 60 MB L2
    red = reduction_for(N, K, torch.float32)
    rows = []
    for M in MS:
        x = torch.randn(M, K, device="cuda", generator=gen)
        ref = x.double() @ w.double().T
        base = bi_linear(x, w)
        default = tile_for(M, torch.float32, N, K)
        row = {"M": M, "default_tile": str(default),
               "cublas_us": time_calls([lambda c=c: F.linear(x, c) for c in ws], reps=args.reps)["us"],
               "default_us": time_calls([lambda c=c: bi_linear(x, c) for c in ws], reps=args.reps)["us"],
               "rel_err": float((base.double() - ref).norm() / ref.norm())}
        for name, t in CANDIDATES.items():
            try:
                y = bi_linear(x, w, tile=t)
                row[name] = {"us": time_calls([lambda c=c, t=t: bi_linear(x, c, tile=t) for c in ws],
                                              reps=args.reps)["us"], "same_bits": bool(torch.equal(y, base))}
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        if args.profile:
            row["profile"] = kernel_profile(lambda: bi_linear(x, w))["kernels"]
            print("  " + "; ".join(f"{k['name'][:40]} x{k['calls']:g} {k['us']:.1f} us" for k in row["profile"]))
        rows.append(row)
        print(f"M={M}: cuBLAS {row['cublas_us']:.1f} us, default {row['default_us']:.1f} us; "
              + ", ".join(f"{n} {_cell(row[n])}" for n in CANDIDATES), flush=True)
    payload = {"command": command_line(), "device": info, "copy_TBps": copy_bw / 1e12, "N": N, "K": K,
               "reduction": str(red), "rows": rows}
    gb = N * K * 4
    md = [f"# Router GEMM (float32, {N} x {K}) on {info['gpu']}", "", f"Command: `{payload['command']}`", "",
          f"Copy bandwidth {copy_bw / 1e12:.2f} TB/s; reduction {red} (fixed by the shape); cuBLAS with TF32 off. "
          "us per call (CUDA-graph replays over 8 weight copies); `*` marks a tile whose bits differ from the "
          "default's.", ""]
    md += md_table(["M", "cuBLAS us", "default us", "default TB/s", "default tile", *CANDIDATES, "rel err"],
                   [[r["M"], r["cublas_us"], r["default_us"], gb / (r["default_us"] * 1e-6) / 1e12, r["default_tile"],
                     *[_cell(r[n]) for n in CANDIDATES], r["rel_err"]]
                    for r in rows])
    jp, mp = write_results(args.out, f"router-{gpu_stem(info['gpu'])}", payload, md)
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
