"""Absorbed MLA attention (decode / tree verify) at K2 shapes: our Triton kernel beside torch sdpa on the
same math and the torch reference, against rooflines measured in the same run.

    python bench/mla_attention.py --out bench/results          # ~1-2 min on an H200
    python bench/mla_attention.py --sweep                      # also time alternative kernel configs

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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import (Clock, bf16_matmul_rate, command_line, copy_bandwidth, device_info, l2_bytes,  # noqa: E402
                          md_table, time_calls, write_results)
from kdtree_engine.kernels.mla_attention import MLAConfig, default_config, mla_attention  # noqa: E402
from kdtree_engine.model.mla import mla_attention_reference  # noqa: E402

C, R = 512, 64
SCALE = 0.1352
CONTEXTS = [4096, 32768, 131072]
TREE_NODES = [1, 16, 64]
HEADS = [64, 8]

SWEEP = [  # CHUNK is the split size (fixed, part of the reduction order); V_SPLIT cuts the 512 output
    # columns over programs (each recomputes the scores) to shrink the fp32 accumulator per program.
    # Earlier sweep (CHUNK 128/256, BLOCK_N 16/32, 8 warps): bench/results/mla_attention-sweep-h200.md.
    MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),   # the default
    MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=64, V_SPLIT=2, num_warps=4, num_stages=2),
    MLAConfig(CHUNK=512, BLOCK_M=16, BLOCK_N=64, V_SPLIT=2, num_warps=4, num_stages=2),
    MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=32, V_SPLIT=2, num_warps=4, num_stages=3),
    MLAConfig(CHUNK=512, BLOCK_M=32, BLOCK_N=32, V_SPLIT=4, num_warps=4, num_stages=3),
    MLAConfig(CHUNK=512, BLOCK_M=64, BLOCK_N=32, V_SPLIT=4, num_warps=8, num_stages=2),
    MLAConfig(CHUNK=512, BLOCK_M=64, BLOCK_N=64, V_SPLIT=2, num_warps=8, num_stages=2),
]
SWEEP_SHAPES = [(8, 32768, 1), (8, 131072, 1), (8, 32768, 16), (8, 32768, 64)]


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
    for N in HEADS:
        for S in CONTEXTS:
            for T in TREE_NODES:
                rec = bench_case(N, S, T, bw, mm, peers=not args.no_peers)
                rows.append(rec)
                print(f"N={N:3d} S={S:6d} T={T:3d}  {rec['us']:8.1f} us  x copy {rec['x_copy']:.2f}  "
                      f"x roof {rec['x_roof']:.2f}  sdpa {rec.get('sdpa_us')}  ref {rec.get('ref_us')}  "
                      f"err {rec['rel_err']:.2g}  [{clock():.0f}s]", flush=True)
    sweep = []
    if args.sweep:
        for cfg in SWEEP:
            for N, S, T in SWEEP_SHAPES:
                if clock() > args.budget_s:
                    sweep.append({"N": N, "S": S, "T": T, "config": cfg.as_dict(), "skipped": "time budget"})
                    continue
                try:
                    rec = bench_case(N, S, T, bw, mm, cfg=cfg, peers=False, reps=10)
                except Exception as exc:  # noqa: BLE001 - a failing variant is reported
                    rec = {"N": N, "S": S, "T": T, "config": cfg.as_dict(), "error": str(exc)[:200]}
                sweep.append(rec)
                print("sweep", cfg.as_dict(), N, S, T, f"{rec.get('us', float('nan')):.1f} us",
                      f"x roof {rec.get('x_roof', float('nan')):.2f} err {rec.get('rel_err')}", flush=True)

    info = device_info()
    gpu = "h200" if "H200" in info["gpu"] else info["gpu"].split()[-1].lower()
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
    md += md_table(headers, table)
    errs = {f"{r['N']}/{r['S']}/{r['T']}": r.get("sdpa_error") for r in rows if r.get("sdpa_error")}
    if errs:
        md += ["", "sdpa errors: " + "; ".join(f"{k}: {v}" for k, v in list(errs.items())[:3])]
    if sweep:
        md += ["", "## Config sweep", ""]
        md += md_table(["config", "N", "S", "T", "us", "x roof", "err"],
                       [[" ".join(f"{k}={v}" for k, v in s["config"].items()), s["N"], s["S"], s["T"],
                         s.get("us"), s.get("x_roof"), s.get("rel_err", s.get("error", s.get("skipped")))]
                        for s in sweep])
    jp, mp = write_results(args.out, f"mla_attention-{gpu}", payload, md)
    print(f"wrote {jp} and {mp} in {clock():.0f}s")
    print("\n".join(md_table(headers, table)))
    return payload


if __name__ == "__main__":
    main()
