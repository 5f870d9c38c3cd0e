"""The nibble-plane W4A16 kernel (bench/w4_plane.py, an experiment) against the default dense kernel, at K2 shapes.

    python3 bench/w4_plane_probe.py --out bench/results      # ~2 min on an H200

For each matrix (one expert's w13 4096 x 7168 and w2 7168 x 2048, the dense layer's w13 36864 x 7168)
and M = 1 / 4 / 16: the default `w4a16_linear` and each plane candidate (BLOCK_N, BLOCK_C, warps,
stages, split-K): median us over CUDA-graph replays of rotating weight copies (> L2), effective TB/s
(int4 + scale bytes / time), the ratio to the copy bandwidth measured in the same run, and the error
against x @ W^T in float64 with W the bf16-rounded dequantized weights (the plane kernel's operand:
~1e-6 when right).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import command_line, copy_bandwidth, device_info, l2_bytes, md_table, time_calls, write_results  # noqa: E402
from bench.kernels import DENSE, G, rand_w4, w4_bytes  # noqa: E402
from kdtree_engine.kernels.split_sum import split_sum  # noqa: E402
from kdtree_engine.kernels.w4a16 import w4a16_linear  # noqa: E402
from bench.w4_plane import plane_linear  # noqa: E402
from kdtree_engine.quant import dequantize  # noqa: E402

MS = [1, 4, 16]
# (BLOCK_N, BLOCK_C, num_warps, num_stages, weights as the B operand, activations by TMA descriptor,
# accumulators). Weights as A (BLOCK_N 64, 4 warps) is a wgmma with a register operand, waited for after
# each plane GEMM (measured 1.9x slower than the default); as B the tokens are the 16 rows of an
# mma.sync tile and the warps split the weight rows (no wait chain, no duplicated dequantization,
# ~2.9 SASS instructions per weight element against ~4.0 for the default), but with one accumulator
# the 32 MMAs of an iteration form one dependent chain: 2, 4 or 8 accumulators break it.
CANDIDATES = [(64, 64, 4, 2, False, True, 1), (64, 64, 4, 2, True, True, 1),
              (64, 64, 4, 2, True, True, 2), (64, 64, 4, 2, True, True, 4), (64, 64, 4, 2, True, True, 8),
              (64, 64, 4, 3, True, True, 8), (64, 64, 4, 2, True, False, 8), (64, 128, 4, 2, True, True, 4),
              (32, 64, 2, 2, True, True, 8), (128, 64, 8, 2, True, True, 8), (64, 64, 8, 2, True, True, 4)]
TARGET_PROGRAMS = 1056


def split_for(N: int, K8: int, block_n: int, block_c: int) -> tuple[int, int]:
    iters = K8 // block_c
    tiles = math.ceil(N / block_n)
    split = 1
    for s in range(1, iters + 1):
        if iters % s == 0 and tiles * s <= TARGET_PROGRAMS and iters // s >= 2:
            split = s
    return split, iters // split * block_c


def run_plane(x, p, s, cand, split, cps):
    block_n, block_c, warps, stages, w_as_b, x_desc, n_acc = cand
    M, N = x.shape[0], p.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if split == 1:
        return plane_linear(x, p, s, 16, block_n, block_c, cps, 1, out, warps, stages, w_as_b, x_desc, n_acc)
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    plane_linear(x, p, s, 16, block_n, block_c, cps, split, part, warps, stages, w_as_b, x_desc, n_acc)
    split_sum(part, out, split)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    info = device_info()
    l2 = l2_bytes()
    rows = []
    for name, (N, K) in DENSE.items():
        nbytes = w4_bytes(N, K)
        ws = [rand_w4(N, K) for _ in range(max(1, math.ceil(3 * l2 / nbytes)))]
        wref = dequantize(*ws[0], G, torch.bfloat16).double()
        for M in MS:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wref.T
            t = time_calls([lambda p=p, s=s: w4a16_linear(x, p, s, G) for p, s in ws], reps=args.reps)["us"]
            rows.append({"matrix": name, "M": M, "kernel": "default", "us": t, "TBps": nbytes / t / 1e6,
                         "x_copy": nbytes / t / 1e6 / (bw / 1e12), "err": float((w4a16_linear(x, *ws[0], G).double() - ref).norm() / ref.norm())})
            for cand in CANDIDATES:
                split, cps = split_for(N, K // 8, cand[0], cand[1])
                label = (f"plane n{cand[0]} c{cand[1]} w{cand[2]} s{cand[3]} split{split}"
                         f"{' wB' if cand[4] else ''}{'' if cand[5] else ' xptr'} acc{cand[6]}")
                try:
                    out = run_plane(x, *ws[0], cand, split, cps)
                    err = float((out.double() - ref).norm() / ref.norm())
                    t = time_calls([lambda p=p, s=s: run_plane(x, p, s, cand, split, cps) for p, s in ws], reps=args.reps)["us"]
                    rows.append({"matrix": name, "M": M, "kernel": label, "us": t, "TBps": nbytes / t / 1e6,
                                 "x_copy": nbytes / t / 1e6 / (bw / 1e12), "err": err})
                except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
                    rows.append({"matrix": name, "M": M, "kernel": label, "us": None, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                r = rows[-1]
                print(f"{name} M={M} {label}: {r.get('us')} us, err {r.get('err')}", flush=True)
        del ws
        torch.cuda.empty_cache()
    md = [f"# W4A16 nibble-plane kernel probe on {info.get('gpu', 'GPU')}", "",
          f"Command: `{command_line()}`", "",
          f"torch {info.get('torch')}, triton {info.get('triton')}. Copy bandwidth {bw / 1e12:.2f} TB/s (read + write). "
          "err: against x @ W^T in float64, W the bf16-rounded dequantized weights (output rounded to bf16 for 'default').", ""]
    md += md_table(["matrix", "M", "kernel", "us", "TB/s", "x copy", "err"],
                   [[r["matrix"], r["M"], r["kernel"], r.get("us"), r.get("TBps"), r.get("x_copy"), r.get("err", r.get("error"))]
                    for r in rows])
    write_results(args.out, "w4-plane-probe-h200", {"device": info, "copy_bw": bw, "rows": rows}, md)
    print("\n".join(md[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
