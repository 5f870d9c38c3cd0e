"""Benchmark: the MoE router's float32 GEMM (x [M, 7168] bf16 @ gate [384, 7168].T, as K2 computes router
logits): the engine's tensor-core router for bf16 activations (router_logits_bf16x3: the gate as three bf16
parts, one launch of partials for the router tail), the float32 FMA router kernel (kernels/router_gemm.py, its
table config and candidates), the generic batch-invariant GEMM on x.float() and cuBLAS on x.float().

    python bench/router.py --out bench/results        # writes router-<gpu>.json and .md

Candidates change BN / KS / warps, which change the rounding (their own bits); TM only re-tiles. Every
point checks the error against float64 and, for the router kernel, that rows computed alone equal the
rows of the M-row call bit for bit. Times: median per call from CUDA-graph replays over weight copies
that miss L2; TB/s on the fp32 weight bytes.
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
from kdtree_engine.kernels.gemm import bi_linear  # noqa: E402
from kdtree_engine.kernels.bf16x3 import split_bf16x3  # noqa: E402
from kdtree_engine.kernels.router_gemm import (RouterGemmConfig, router_config, router_logits,  # noqa: E402
                                                router_logits_bf16x3)

N, K = 384, 7168
MS = (1, 4, 16, 64, 129)
CANDIDATES = {  # name -> router kernel config (BN, KS, warps, TM)
    "b8_k512_w4": RouterGemmConfig(8, 512, 4, 16),
    "b8_k1024_w4": RouterGemmConfig(8, 1024, 4, 16),
    "b4_k512_w1": RouterGemmConfig(4, 512, 1, 16),
    "b2_k1024_w1": RouterGemmConfig(2, 1024, 1, 16),
    "b4_k1024_w1": RouterGemmConfig(4, 1024, 1, 16),
    "b8_k256_w1": RouterGemmConfig(8, 256, 1, 16),
    "b2_k512_w1": RouterGemmConfig(2, 512, 1, 16),
    "b4_k512_w1_tm4": RouterGemmConfig(4, 512, 1, 4),
    "b4_k512_w1_tm64": RouterGemmConfig(4, 512, 1, 64),
}


def _in_order(parts: torch.Tensor) -> torch.Tensor:
    """The logits of partials [S, M, N]: added in index order, as the router tail does."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def _cell(c: dict) -> str:
    if "error" in c:
        return "error: " + c["error"][:40]
    return f"{c['us']:.1f} ({c['rel_err']:.0e})"


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
    cfg = router_config(N, K)
    rows = []
    for M in MS:
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        ref = x.double() @ w.double().T
        y = router_logits(x, w)
        alone = torch.cat([router_logits(x[i:i + 1], w) for i in range(M)])
        parts = [split_bf16x3(c) for c in ws]
        p3 = router_logits_bf16x3(x, parts[0])
        y3 = _in_order(p3)
        alone3 = torch.cat([router_logits_bf16x3(x[i:i + 1], parts[0]) for i in range(M)], 1)
        row = {"M": M,
               "bf16x3_us": time_calls([lambda p=p: router_logits_bf16x3(x, p) for p in parts], reps=args.reps)["us"],
               "bf16x3_rel_err": float((y3.double() - ref).norm() / ref.norm()),
               "bf16x3_invariant": bool(torch.equal(alone3, p3)),
               "cublas_us": time_calls([lambda c=c: F.linear(x.float(), c) for c in ws], reps=args.reps)["us"],
               "generic_us": time_calls([lambda c=c: bi_linear(x.float(), c) for c in ws], reps=args.reps)["us"],
               "router_us": time_calls([lambda c=c: router_logits(x, c) for c in ws], reps=args.reps)["us"],
               "rel_err": float((y.double() - ref).norm() / ref.norm()),
               "invariant": bool(torch.equal(alone, y))}
        for name, c in CANDIDATES.items():
            try:
                yc = router_logits(x, w, config=c)
                row[name] = {"us": time_calls([lambda w_=w_, c=c: router_logits(x, w_, config=c) for w_ in ws],
                                              reps=args.reps)["us"],
                             "rel_err": float((yc.double() - ref).norm() / ref.norm())}
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
                row[name] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
        if args.profile:
            row["profile"] = kernel_profile(lambda: router_logits(x, w))["kernels"]
            print("  " + "; ".join(f"{k['name'][:40]} x{k['calls']:g} {k['us']:.1f} us" for k in row["profile"]))
        rows.append(row)
        print(f"M={M}: bf16x3 {row['bf16x3_us']:.1f} us (invariant {row['bf16x3_invariant']}, rel err "
              f"{row['bf16x3_rel_err']:.1e}), cuBLAS {row['cublas_us']:.1f} us, generic {row['generic_us']:.1f} us, router "
              f"{row['router_us']:.1f} us (invariant {row['invariant']}); "
              + ", ".join(f"{n} {_cell(row[n])}" for n in CANDIDATES), flush=True)
    payload = {"command": command_line(), "device": info, "copy_TBps": copy_bw / 1e12, "N": N, "K": K,
               "router_config": str(cfg), "rows": rows}
    gb = N * K * 4
    md = [f"# Router GEMM (float32, {N} x {K}) on {info['gpu']}", "", f"Command: `{payload['command']}`", "",
          f"Copy bandwidth {copy_bw / 1e12:.2f} TB/s ({gb / copy_bw * 1e6:.1f} us for the weight). bf16 activations; "
          "bf16x3: the engine's tensor-core router (three bf16 parts of the gate, 16.5 MB; its partials, which the "
          "router tail adds); cuBLAS (TF32 off) and the generic batch-invariant GEMM on x.float() (the copy included); "
          "the FMA router kernel "
          f"upcasts in its load, table config {cfg}. us per call (CUDA-graph replays over 8 weight copies); "
          "invariant: rows computed alone == the rows of the M-row call, bit for bit; rel err against float64.", ""]
    md += md_table(["M", "bf16x3 us", "bf16x3 invariant", "bf16x3 rel err", "cuBLAS us", "generic us", "router us",
                    "router TB/s", "invariant", "rel err", *CANDIDATES],
                   [[r["M"], r["bf16x3_us"], "yes" if r["bf16x3_invariant"] else "NO", r["bf16x3_rel_err"],
                     r["cublas_us"], r["generic_us"], r["router_us"], gb / (r["router_us"] * 1e-6) / 1e12,
                     "yes" if r["invariant"] else "NO", r["rel_err"], *[_cell(r[n]) for n in CANDIDATES]]
                    for r in rows])
    jp, mp = write_results(args.out, f"router-{gpu_stem(info['gpu'])}", payload, md)
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
