"""W4A16 kernel benchmark at Kimi K2 shapes on one GPU.

    python bench/kernels.py [--out DIR] [--no-sweep] [--reps N]

Measures, in one run: device-to-device copy bandwidth and bf16 matmul rate (the rooflines); then for
one expert's w13 [4096 x 7168] and w2 [7168 x 2048] and the dense w13 [36864 x 7168] at M = 1, 4,
16, 64, 256: our Triton W4A16 kernel, torch bf16 F.linear on the dequantized weight, and torch's
tinygemm `_weight_int4pack_mm` (nibble-swapped repack); then a whole MoE layer (384 experts, top-8,
random routing) through fused_moe_w4a16 plus the shared expert as bf16 matmuls; then a small sweep of
kernel configs at M = 1 and 16. Effective TB/s counts the INT4 + scale bytes that must be read (for the
MoE: of the experts actually touched) over the time. Writes <out>/kernels-<gpu>.json and .md.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (Clock, bf16_matmul_rate, command_line, copy_bandwidth, device_info,  # noqa: E402
                          l2_bytes, md_table, time_calls, write_results)
from kdtree_engine.kernels.moe_w4a16 import (MOE_CONFIGS, MoEConfig, fused_moe_reference, fused_moe_w4a16,  # noqa: E402
                                             moe_align, moe_config)
from kdtree_engine.kernels.w4a16 import (DENSE_CONFIGS, W4Config, dense_config, w4a16_linear,  # noqa: E402
                                         w4a16_linear_reference)
from kdtree_engine.quant import dequantize  # noqa: E402

G = 32
H, I, E, TOPK = 7168, 2048, 384, 8
MS = [1, 4, 16, 64, 256]
DENSE = {"expert_w13": (4096, 7168), "expert_w2": (7168, 2048), "dense_w13": (36864, 7168)}
SWEEP_BUDGET_S = 120.0   # the sweep stops (rest reported as skipped) past this many seconds of bench


def w4_bytes(n: int, k: int, g: int = G) -> int:
    return n * k // 2 + n * (k // g) * 2


def rand_w4(*shape_nk, g=G):
    *lead, n, k = shape_nk
    p = torch.randint(-2**31, 2**31 - 1, (*lead, n, k // 8), dtype=torch.int32, device="cuda")
    s = (torch.rand((*lead, n, k // g), device="cuda") * 0.09 + 0.01).to(torch.bfloat16)
    return p, s


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def tinygemm_pack(p: torch.Tensor, s: torch.Tensor, inner_k_tiles: int = 8):
    """compressed-tensors int32 [N, K/8] + scale [N, K/g] -> tinygemm operands (even k to HIGH nibble)."""
    b = p.view(torch.uint8)
    b = ((b & 15) << 4) | (b >> 4)
    wp = torch.ops.aten._convert_weight_to_int4pack(b.contiguous(), inner_k_tiles)
    st = s.t().contiguous()
    sz = torch.stack([st, torch.zeros_like(st)], dim=-1).contiguous()  # [K/g, N, 2], zero = 0
    return wp, sz


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]


def bench_dense(copy_bw, reps, log):
    rows = []
    l2 = l2_bytes()
    for name, (N, K) in DENSE.items():
        nbytes = w4_bytes(N, K)
        r4 = max(1, math.ceil(3 * l2 / nbytes))
        r16 = max(1, math.ceil(3 * l2 / (N * K * 2)))
        ws = [rand_w4(N, K) for _ in range(r4)]
        wb = [dequantize(p, s, G, torch.bfloat16) for p, s in ws[:r16]]
        tg, tg_err = None, None
        try:
            tg = [tinygemm_pack(p, s) for p, s in ws]
        except Exception as exc:  # noqa: BLE001
            tg_err = _err(exc)
        for M in MS:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            row = {"matrix": name, "N": N, "K": K, "M": M, "w4_bytes": nbytes, "config": dense_config(M).as_dict()}
            ref = w4a16_linear_reference(x, *ws[0], G)
            try:
                row["ours_rel_err"] = rel(w4a16_linear(x, *ws[0], G), ref)
                t = time_calls([lambda p=p, s=s: w4a16_linear(x, p, s, G) for p, s in ws], reps=reps)
                row["ours_us"] = t["us"]
                row["ours_graph"] = t["graph"]
            except Exception as exc:  # noqa: BLE001
                row["ours_us"] = None
                row["ours_error"] = _err(exc)
            row["bf16_us"] = time_calls([lambda w=w: F.linear(x, w) for w in wb], reps=reps)["us"]
            if tg is not None:
                try:
                    row["tinygemm_rel_err"] = rel(torch.ops.aten._weight_int4pack_mm(x, tg[0][0], G, tg[0][1]), ref)
                    row["tinygemm_us"] = time_calls(
                        [lambda a=a, b=b: torch.ops.aten._weight_int4pack_mm(x, a, G, b) for a, b in tg],
                        reps=reps)["us"]
                except Exception as exc:  # noqa: BLE001
                    row["tinygemm_us"], row["tinygemm_na"] = None, _err(exc)
            else:
                row["tinygemm_us"], row["tinygemm_na"] = None, tg_err
            for k in ("ours", "tinygemm"):
                if row.get(f"{k}_us"):
                    row[f"{k}_TBps"] = nbytes / (row[f"{k}_us"] * 1e-6) / 1e12
                    row[f"{k}_frac_copy"] = row[f"{k}_TBps"] * 1e12 / copy_bw
            row["bf16_TBps_own_bytes"] = N * K * 2 / (row["bf16_us"] * 1e-6) / 1e12
            if row.get("ours_us"):
                row["speedup_vs_bf16"] = row["bf16_us"] / row["ours_us"]
            rows.append(row)
            log(f"dense {name} M={M}: ours {row.get('ours_us')} us, bf16 {row['bf16_us']:.1f} us, "
                f"tinygemm {row.get('tinygemm_us')}")
        del ws, wb, tg
        torch.cuda.empty_cache()
    return rows


def route(T, sets, gen):
    out = []
    for _ in range(sets):
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(TOPK, dim=1).indices
        tw = torch.rand(T, TOPK, device="cuda", generator=gen)
        out.append((ids, tw / tw.sum(1, keepdim=True)))
    return out


def bench_moe(layer, copy_bw, reps, log):
    w13p, w13s, w2p, w2s = layer
    expert_bytes = w4_bytes(2 * I, H) + w4_bytes(H, I)
    sh13 = torch.randn(2 * I, H, device="cuda").to(torch.bfloat16) * 0.02
    sh2 = torch.randn(H, I, device="cuda").to(torch.bfloat16) * 0.02
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in MS:
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        sets = route(T, 4, gen)
        touched = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / len(sets)
        nbytes = touched * expert_bytes
        cfg = moe_config(T * TOPK)
        row = {"T": T, "touched_experts": touched, "touched_bytes": nbytes, "config": cfg.as_dict()}
        try:
            if T <= 64:
                ids, tw = sets[0]
                row["rel_err"] = rel(fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, G),
                                     fused_moe_reference(x, w13p, w13s, w2p, w2s, ids, tw, G))
            t = time_calls([lambda ids=ids, tw=tw: fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, G)
                            for ids, tw in sets], reps=reps)
            row["routed_us"], row["graph"] = t["us"], t["graph"]
            row["routed_TBps"] = nbytes / (t["us"] * 1e-6) / 1e12
            row["routed_frac_copy"] = row["routed_TBps"] * 1e12 / copy_bw
            row["align_us"] = time_calls([lambda ids=ids: moe_align(ids, E, cfg.BLOCK_M) for ids, _ in sets],
                                         reps=reps)["us"]
        except Exception as exc:  # noqa: BLE001
            row["routed_us"], row["error"] = None, _err(exc)
            traceback.print_exc()

        def shared():
            gu = F.linear(x, sh13)
            return F.linear(F.silu(gu[:, :I]) * gu[:, I:], sh2)

        row["shared_bf16_us"] = time_calls([shared], reps=reps)["us"]
        row["ideal_routed_us_at_copy_bw"] = nbytes / copy_bw * 1e6
        if row.get("routed_us"):
            row["layer_us"] = row["routed_us"] + row["shared_bf16_us"]
        rows.append(row)
        log(f"moe T={T}: routed {row.get('routed_us')} us ({touched:.0f} experts), shared {row['shared_bf16_us']:.1f} us")
    return rows


DENSE_BASE = W4Config(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SWAP_AB=True, num_warps=4, num_stages=4)
DENSE_VARIANTS = [
    ("base", {}), ("noswap", dict(SWAP_AB=False)), ("bn32", dict(BLOCK_N=32)), ("bn128", dict(BLOCK_N=128)),
    ("bn128_w8", dict(BLOCK_N=128, num_warps=8)), ("bk128", dict(BLOCK_K=128)), ("bk512", dict(BLOCK_K=512)),
    ("bk512_w8", dict(BLOCK_K=512, num_warps=8)), ("st2", dict(num_stages=2)), ("st3", dict(num_stages=3)),
    ("st5", dict(num_stages=5)), ("w8", dict(num_warps=8)), ("split1", dict(split_k=1)),
    ("split2", dict(split_k=2)), ("split4", dict(split_k=4)), ("split8", dict(split_k=8)),
    ("noswap_bn128_w8", dict(SWAP_AB=False, BLOCK_N=128, num_warps=8)),
]
MOE_BASE = MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SWAP_AB=True, num_warps=4, num_stages=4)
MOE_VARIANTS = [
    ("base", {}), ("noswap", dict(SWAP_AB=False)), ("bn32", dict(BLOCK_N=32)), ("bn128", dict(BLOCK_N=128)),
    ("bn128_w8", dict(BLOCK_N=128, num_warps=8)), ("bk128", dict(BLOCK_K=128)), ("bk512", dict(BLOCK_K=512)),
    ("st2", dict(num_stages=2)), ("st3", dict(num_stages=3)), ("st5", dict(num_stages=5)),
    ("w8", dict(num_warps=8)), ("bn2_128", dict(BLOCK_N2=128)), ("bn32_bn2_64", dict(BLOCK_N=32, BLOCK_N2=64)),
]


def sweep(layer, copy_bw, reps, clock, budget, log):
    rows = []
    l2 = l2_bytes()
    for name in ("dense_w13", "expert_w13"):
        N, K = DENSE[name]
        nbytes = w4_bytes(N, K)
        ws = [rand_w4(N, K) for _ in range(max(1, math.ceil(3 * l2 / nbytes)))]
        for M in (1, 16):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = w4a16_linear_reference(x, *ws[0], G)
            for vname, over in DENSE_VARIANTS:
                cfg = replace(DENSE_BASE, **over)
                row = {"kernel": "dense", "matrix": name, "M": M, "variant": vname, "config": cfg.as_dict()}
                if clock() > budget:
                    row["skipped"] = "time budget"
                    rows.append(row)
                    continue
                try:
                    row["rel_err"] = rel(w4a16_linear(x, *ws[0], G, config=cfg), ref)
                    us = time_calls([lambda p=p, s=s: w4a16_linear(x, p, s, G, config=cfg) for p, s in ws],
                                    reps=reps)["us"]
                    row["us"] = us
                    row["TBps"] = nbytes / (us * 1e-6) / 1e12
                    row["frac_copy"] = row["TBps"] * 1e12 / copy_bw
                except Exception as exc:  # noqa: BLE001
                    row["error"] = _err(exc)
                rows.append(row)
                log(f"sweep dense {name} M={M} {vname}: {row.get('us')} {row.get('error', '')}")
        del ws
    w13p, w13s, w2p, w2s = layer
    expert_bytes = w4_bytes(2 * I, H) + w4_bytes(H, I)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for T in (1, 16):
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        sets = route(T, 4, gen)
        touched = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / len(sets)
        base_out = None
        for vname, over in MOE_VARIANTS:
            cfg = replace(MOE_BASE, **over)
            row = {"kernel": "moe", "T": T, "variant": vname, "config": cfg.as_dict()}
            if clock() > budget:
                row["skipped"] = "time budget"
                rows.append(row)
                continue
            try:
                out = fused_moe_w4a16(x, w13p, w13s, w2p, w2s, *sets[0], G, config=cfg)
                if base_out is None:
                    base_out = fused_moe_reference(x, w13p, w13s, w2p, w2s, *sets[0], G)
                row["rel_err"] = rel(out, base_out)
                us = time_calls([lambda ids=ids, tw=tw: fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, G,
                                                                       config=cfg) for ids, tw in sets],
                                reps=reps)["us"]
                row["us"] = us
                row["TBps"] = touched * expert_bytes / (us * 1e-6) / 1e12
                row["frac_copy"] = row["TBps"] * 1e12 / copy_bw
            except Exception as exc:  # noqa: BLE001
                row["error"] = _err(exc)
            rows.append(row)
            log(f"sweep moe T={T} {vname}: {row.get('us')} {row.get('error', '')}")
    return rows


def gpu_stem(name: str) -> str:
    n = name.lower()
    for key in ("h200", "h100", "b200", "a100", "l40s", "l4"):
        if key in n:
            return key
    return "".join(c if c.isalnum() else "-" for c in n).strip("-") or "gpu"


def markdown(payload) -> list[str]:
    info = payload["device"]
    lines = [f"# W4A16 kernels on {info['gpu']}", "",
             f"Command: `{payload['command']}`", "",
             f"torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, {info['sm_count']} SMs.",
             f"Measured rooflines: D2D copy {payload['copy_TBps']:.2f} TB/s (read + write), "
             f"bf16 matmul {payload['bf16_TFLOPs']:.0f} TFLOP/s.",
             f"Effective TB/s = INT4 + bf16 scale bytes (group {G}) / time; the MoE counts only the experts "
             "touched. Times: median of CUDA-graph replays over rotating weight copies (> L2).", "",
             "## Dense W4A16", ""]
    lines += md_table(
        ["matrix", "M", "ours us", "ours TB/s", "x copy", "bf16 us", "ours vs bf16", "tinygemm us",
         "tinygemm TB/s", "ours err"],
        [[r["matrix"], r["M"], r.get("ours_us"), r.get("ours_TBps"), r.get("ours_frac_copy"), r["bf16_us"],
          r.get("speedup_vs_bf16"), r.get("tinygemm_us") if r.get("tinygemm_us") else f"n/a ({r.get('tinygemm_na')})",
          r.get("tinygemm_TBps"), r.get("ours_rel_err")] for r in payload["dense"]])
    lines += ["", "## MoE layer (384 experts, top-8, random routing; shared expert bf16)", ""]
    lines += md_table(
        ["T", "experts touched", "routed us", "routed TB/s", "x copy", "ideal us", "align us", "shared us",
         "layer us", "err"],
        [[r["T"], r["touched_experts"], r.get("routed_us"), r.get("routed_TBps"), r.get("routed_frac_copy"),
          r["ideal_routed_us_at_copy_bw"], r.get("align_us"), r["shared_bf16_us"], r.get("layer_us"),
          r.get("rel_err", r.get("error"))] for r in payload["moe"]])
    if payload.get("sweep"):
        lines += ["", "## Config sweep", "",
                  f"dense base {DENSE_BASE.as_dict()}; MoE base {MOE_BASE.as_dict()}", ""]
        lines += md_table(
            ["kernel", "shape", "M/T", "variant", "us", "TB/s", "x copy", "err"],
            [[r["kernel"], r.get("matrix", "layer"), r.get("M", r.get("T")), r["variant"], r.get("us"),
              r.get("TBps"), r.get("frac_copy"), r.get("rel_err", r.get("error", r.get("skipped")))]
             for r in payload["sweep"]])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kdtree bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="output folder (default bench/results)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    ap.add_argument("--reps", type=int, default=15, help="timed graph replays per measurement")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    clock = Clock()

    def log(msg):
        print(f"[{clock():6.1f}s] {msg}", flush=True)

    torch.manual_seed(0)
    info = device_info()
    copy_bw = copy_bandwidth()
    mm = bf16_matmul_rate()
    log(f"{info['gpu']}: copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    payload = {"command": command_line(), "device": info, "copy_TBps": copy_bw / 1e12, "bf16_TFLOPs": mm / 1e12,
               "group_size": G, "dense_configs": {str(m): c.as_dict() for m, c in DENSE_CONFIGS},
               "moe_configs": {str(m): c.as_dict() for m, c in MOE_CONFIGS}}
    payload["dense"] = bench_dense(copy_bw, args.reps, log)
    layer = (*rand_w4(E, 2 * I, H), *rand_w4(E, H, I))
    payload["moe"] = bench_moe(layer, copy_bw, args.reps, log)
    payload["sweep"] = [] if args.no_sweep else sweep(layer, copy_bw, max(5, args.reps // 2), clock,
                                                      SWEEP_BUDGET_S + clock(), log)
    payload["elapsed_s"] = clock()
    stem = f"kernels-{gpu_stem(info['gpu'])}"
    md = markdown(payload)
    jp, mp = write_results(args.out, stem, payload, md)
    print("\n".join(md[md.index("## Dense W4A16"):]))
    print(f"\nwrote {jp} and {mp} in {clock():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
