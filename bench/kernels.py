"""W4A16 kernel benchmark at Kimi K2 shapes on one GPU.

    python bench/kernels.py [--out DIR] [--no-sweep | --sweep-only] [--sweep-budget S] [--reps N]

Measures, in one run: device-to-device copy bandwidth and bf16 matmul rate (the rooflines); then for
one expert's w13 [4096 x 7168] and w2 [7168 x 2048] and the dense w13 [36864 x 7168] at M = 1, 4,
16, 64, 256: our Triton W4A16 kernel, torch bf16 F.linear on the dequantized weight, and torch's
tinygemm `_weight_int4pack_mm` (nibble-swapped repack); then a whole MoE layer (384 experts, top-8,
random routing) through fused_moe_w4a16 plus the shared expert as bf16 matmuls; then the candidate
sweep of bench/w4_sweep.py (dense 36864 x 7168 at M = 1, 4, 16 and the MoE layer at T = 1, 4, 16; a
compact table per shape and the best candidate per shape; --sweep-moe-rows: the MoE expert block rows
at T = 32 .. 512 instead). --sweep-only measures the rooflines and
runs only the sweep. Effective TB/s counts the INT4 + scale bytes that must be read (for the MoE: of
the experts actually touched) over the time. Writes <out>/kernels-<gpu>.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (Clock, bf16_matmul_rate, command_line, copy_bandwidth, device_info, gpu_stem,  # noqa: E402
                          l2_bytes, md_table, time_calls, write_results)
from kdtree_engine.kernels.moe_frag import frag_moe_config, fused_moe_frag  # noqa: E402
from kdtree_engine.kernels.layouts import ENGINE_ORDER, to_engine_int4  # noqa: E402
from kdtree_engine.kernels.w4_frag import HAVE_GLUON, dense_plan, frag_linear  # noqa: E402
from kdtree_engine.kernels.moe_w4a16 import (MOE_CONFIGS, MoEConfig, fused_moe_reference, fused_moe_w4a16,  # noqa: E402
                                             moe_align, moe_config)
from kdtree_engine.kernels.w4a16 import (DENSE_CONFIGS, W4Config, dense_config, w4a16_linear,  # noqa: E402
                                         w4a16_linear_reference)
from kdtree_engine.quant import dequantize  # noqa: E402
from bench import w4_sweep  # noqa: E402

G = 32
H, I, E, TOPK = 7168, 2048, 384, 8
MS = [1, 4, 16, 64, 256]
DENSE = {"expert_w13": (4096, 7168), "expert_w2": (7168, 2048), "dense_w13": (36864, 7168)}
SWEEP_BUDGET_S = 200.0   # default: the sweep stops (rest reported as skipped) after this many seconds


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
        wf = ([to_engine_int4(p, s, K) for p, s in ws]
              if HAVE_GLUON else None)
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
            if wf is not None:
                try:
                    row["frag_rel_err"] = rel(frag_linear(x, *wf[0], **ENGINE_ORDER), ref)
                    row["frag_us"] = time_calls([lambda p=p, s=s: frag_linear(x, p, s, **ENGINE_ORDER) for p, s in wf],
                                                reps=reps)["us"]
                    row["frag_plan"] = {**dict(zip(("gpb", "programs"), dense_plan(
                        N, K, torch.cuda.get_device_properties(0).multi_processor_count))), **ENGINE_ORDER}
                except Exception as exc:  # noqa: BLE001
                    row["frag_us"], row["frag_error"] = None, _err(exc)
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
            for k in ("ours", "frag", "tinygemm"):
                if row.get(f"{k}_us"):
                    row[f"{k}_TBps"] = nbytes / (row[f"{k}_us"] * 1e-6) / 1e12
                    row[f"{k}_frac_copy"] = row[f"{k}_TBps"] * 1e12 / copy_bw
            row["bf16_TBps_own_bytes"] = N * K * 2 / (row["bf16_us"] * 1e-6) / 1e12
            if row.get("ours_us"):
                row["speedup_vs_bf16"] = row["bf16_us"] / row["ours_us"]
            if row.get("frag_us"):
                row["frag_speedup_vs_bf16"] = row["bf16_us"] / row["frag_us"]
            rows.append(row)
            log(f"dense {name} M={M}: ours {row.get('ours_us')} us, bf16 {row['bf16_us']:.1f} us, "
                f"tinygemm {row.get('tinygemm_us')}")
        del ws, wb, tg, wf
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
    frag = ((*to_engine_int4(w13p, w13s, H), *to_engine_int4(w2p, w2s, I)) if HAVE_GLUON else None)
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
        cfg = moe_config(T * TOPK, E)
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
        if frag is not None:
            try:
                if T <= 64:
                    ids, tw = sets[0]
                    row["frag_rel_err"] = rel(fused_moe_frag(x, *frag, ids, tw, G, **ENGINE_ORDER),
                                              fused_moe_reference(x, w13p, w13s, w2p, w2s, ids, tw, G))
                row["frag_us"] = time_calls([lambda ids=ids, tw=tw: fused_moe_frag(x, *frag, ids, tw, G, **ENGINE_ORDER)
                                             for ids, tw in sets], reps=reps)["us"]
                row["frag_TBps"] = nbytes / (row["frag_us"] * 1e-6) / 1e12
                row["frag_frac_copy"] = row["frag_TBps"] * 1e12 / copy_bw
                row["frag_config"] = dataclasses.asdict(frag_moe_config(T * TOPK, E))
            except Exception as exc:  # noqa: BLE001
                row["frag_us"], row["frag_error"] = None, _err(exc)
                traceback.print_exc()

        def shared():
            gu = F.linear(x, sh13)
            return F.linear(F.silu(gu[:, :I]) * gu[:, I:], sh2)

        row["shared_bf16_us"] = time_calls([shared], reps=reps)["us"]
        row["ideal_routed_us_at_copy_bw"] = nbytes / copy_bw * 1e6
        if row.get("routed_us"):
            row["layer_us"] = row["routed_us"] + row["shared_bf16_us"]
        if row.get("frag_us"):
            row["frag_layer_us"] = row["frag_us"] + row["shared_bf16_us"]
        rows.append(row)
        log(f"moe T={T}: routed {row.get('routed_us')} us, frag {row.get('frag_us')} us ({touched:.0f} experts), "
            f"shared {row['shared_bf16_us']:.1f} us")
    return rows


def markdown(payload) -> list[str]:
    info = payload["device"]
    lines = [f"# W4A16 kernels on {info['gpu']}", "",
             f"Command: `{payload['command']}`", "",
             f"torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}, {info['sm_count']} SMs.",
             f"Measured rooflines: D2D copy {payload['copy_TBps']:.2f} TB/s (read + write), "
             f"bf16 matmul {payload['bf16_TFLOPs']:.0f} TFLOP/s.",
             f"Effective TB/s = INT4 + bf16 scale bytes (group {G}) / time; the MoE counts only the experts "
             "touched. Times: median of CUDA-graph replays over rotating weight copies (> L2).", ""]
    if payload["dense"]:
        lines += _default_tables(payload)
    if payload.get("sweep"):
        lines += ["", "## Candidate sweep (bench/w4_sweep.py)", "", "```"]
        lines += w4_sweep.report(payload["sweep"])
        lines += ["```"]
    return lines


def _default_tables(payload) -> list[str]:
    lines = ["## Dense W4A16", "",
             "frag: the engine's CUDA path for bfloat16 (fragment-ordered Gluon kernel, kernels/w4_frag.py, "
             "plan fixed per shape); Triton: kernels/w4a16.py (the CUDA path for other dtypes); bf16: torch "
             "matmul on the dequantized weights; tinygemm: torch `_weight_int4pack_mm`.", ""]
    lines += md_table(
        ["matrix", "M", "frag us", "frag TB/s", "x copy", "frag vs bf16", "Triton us", "Triton x copy",
         "Triton vs bf16", "bf16 us", "tinygemm us", "tinygemm TB/s", "frag err", "Triton err"],
        [[r["matrix"], r["M"], r.get("frag_us"), r.get("frag_TBps"), r.get("frag_frac_copy"),
          r.get("frag_speedup_vs_bf16"), r.get("ours_us"), r.get("ours_frac_copy"), r.get("speedup_vs_bf16"),
          r["bf16_us"], r.get("tinygemm_us") if r.get("tinygemm_us") else f"n/a ({r.get('tinygemm_na')})",
          r.get("tinygemm_TBps"), r.get("frag_rel_err", r.get("frag_error")), r.get("ours_rel_err")]
         for r in payload["dense"]])
    lines += ["", "## MoE layer (384 experts, top-8, random routing; shared expert bf16)", "",
              "frag: the engine's CUDA path for bfloat16 (kernels/moe_frag.py); Triton: kernels/moe_w4a16.py.", ""]
    lines += md_table(
        ["T", "experts touched", "frag us", "frag TB/s", "x copy", "Triton us", "Triton x copy", "ideal us",
         "align us", "shared us", "frag layer us", "frag err", "Triton err"],
        [[r["T"], r["touched_experts"], r.get("frag_us"), r.get("frag_TBps"), r.get("frag_frac_copy"),
          r.get("routed_us"), r.get("routed_frac_copy"), r["ideal_routed_us_at_copy_bw"], r.get("align_us"),
          r["shared_bf16_us"], r.get("frag_layer_us"), r.get("frag_rel_err", r.get("frag_error")),
          r.get("rel_err", r.get("error"))] for r in payload["moe"]])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kdtree bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="output folder (default bench/results)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--no-sweep", action="store_true", help="skip the candidate sweep (defaults only)")
    mode.add_argument("--sweep-only", action="store_true",
                      help="rooflines + candidate sweep only (skip the default-config benchmark)")
    ap.add_argument("--sweep-budget", type=float, default=SWEEP_BUDGET_S,
                    help=f"seconds after which remaining sweep candidates are skipped (default {SWEEP_BUDGET_S:.0f})")
    ap.add_argument("--reps", type=int, default=15, help="timed graph replays per measurement")
    ap.add_argument("--sweep-moe-only", action="store_true", help="sweep the MoE candidates only (no dense)")
    ap.add_argument("--sweep-moe-rows", action="store_true",
                    help="sweep the MoE expert block rows (BLOCK_M 16 / 32 / 64) at T = "
                         f"{', '.join(map(str, w4_sweep.MOE_ROWS_SIZES))} instead (no dense)")
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
    payload["dense"] = [] if args.sweep_only else bench_dense(copy_bw, args.reps, log)
    layer = (*rand_w4(E, 2 * I, H), *rand_w4(E, H, I))
    payload["moe"] = [] if args.sweep_only else bench_moe(layer, copy_bw, args.reps, log)
    payload["sweep"] = []
    if not args.no_sweep:
        # dense gets 40% of the budget, the MoE the rest (it compiles two kernels per candidate)
        ctx = w4_sweep.Ctx(copy_bw=copy_bw, reps=max(5, args.reps // 2), time_calls=time_calls, log=log, group=G)
        t0 = time.time()
        if args.sweep_moe_rows:
            ctx.sizes = w4_sweep.MOE_ROWS_SIZES
            payload["sweep"] = w4_sweep.sweep_moe(ctx, layer, route, t0 + args.sweep_budget,
                                                  w4_sweep.MOE_ROWS_CANDIDATES)
        else:
            payload["sweep"] = ([] if args.sweep_moe_only else
                                w4_sweep.sweep_dense(ctx, l2_bytes(), t0 + 0.4 * args.sweep_budget))
            payload["sweep"] += w4_sweep.sweep_moe(ctx, layer, route, t0 + args.sweep_budget)
    payload["elapsed_s"] = clock()
    stem = f"kernels-{gpu_stem(info['gpu']) + ('-sweep' if args.sweep_only else '')}"
    md = markdown(payload)
    jp, mp = write_results(args.out, stem, payload, md)
    start = next(i for i, line in enumerate(md) if line.startswith("Effective TB/s"))
    print("\n".join(md[start + 1:]))
    print(f"\nwrote {jp} and {mp} in {clock():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
