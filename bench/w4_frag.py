"""Fragment-ordered W4A16 kernels (kdtree_engine/kernels/w4_frag.py, moe_frag.py) against the defaults.

    python3 bench/w4_frag.py --out bench/results      # ~3 min on an H200

Dense: one expert's w13 4096 x 7168 and w2 7168 x 2048, the dense layer's w13 36864 x 7168 at
M = 1 / 4 / 8 / 16: the default `w4a16_linear`, torch bf16 matmul on the dequantized weights and each
fragment candidate (the engine's launch, then other stream partitions, token tiles, MMAs and word / scale
orders: w4_frag.DenseLaunch), median us over
CUDA-graph replays of rotating weight copies (> L2), effective TB/s (int4 + scale bytes / time), the ratio
to the copy bandwidth measured in the same run, and the error against x @ W^T in float64 (W the
bf16-rounded dequantized weights).
MoE: the K2 routed experts (384 x [w13 4096 x 7168, w2 7168 x 2048], top-8, random routing) at
T = 1 / 4 / 16 / 64 / 256 / 1024: the default `fused_moe_w4a16` and each `FragMoEConfig` candidate, against the bytes of
the experts touched over the copy bandwidth, and the error against `fused_moe_reference`.
"""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
import math
import sys
from unittest import mock
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import command_line, copy_bandwidth, device_info, gpu_stem, l2_bytes, md_table, time_calls, write_results  # noqa: E402
from bench.kernels import DENSE, E, G, H, I, TOPK, rand_w4, rel, route, w4_bytes  # noqa: E402
from kdtree_engine.kernels import moe_frag as moe_frag_mod  # noqa: E402
from kdtree_engine.kernels.moe_frag import FragMoEConfig, frag_moe_config, fused_moe_frag  # noqa: E402
from kdtree_engine.kernels.moe_w4a16 import fused_moe_reference, fused_moe_w4a16, moe_align  # noqa: E402
from kdtree_engine.kernels.layouts import (ENGINE_ORDER, FRAG_TILE, frag_gpb, frag_repack, frag_tile,  # noqa: E402
                                           scale_tile)
from kdtree_engine.kernels.w4_frag import (DENSE_PARTITION_ROWS, DenseLaunch, _w4_frag_kernel, dense_launch,  # noqa
                                           dense_plan, frag_linear)
from kdtree_engine.kernels.w4a16 import w4a16_linear  # noqa: E402
from kdtree_engine.quant import dequantize  # noqa: E402

DENSE_CANDIDATES = [  # the engine's launch first (None), then DenseLaunch fields replaced (its partition unless given);
    # split: tile-aligned K splits (programs = row tiles x split); per_sm: the stream partition over per_sm programs
    # per SM; tile / stile: 0 for row-major words / scales (the engine's: FRAG_TILE-row tiles);
    # mma / tok: the instruction and tokens per program (the engine's: mma.sync up to 16 tokens, wgmma beyond)
    None, dict(split=2), dict(split=7), dict(per_sm=3), dict(per_sm=5), dict(per_sm=6), dict(per_sm=8),
    dict(tile=0), dict(stile=0), dict(mma="sync", tok=16), dict(mma="wgmma", tok=16), dict(mma="wgmma", tok=32),
    dict(tok=8),
]
MOE_CANDIDATES = [  # the engine's table first (None), then programs per expert block (P13 gate/up, P2 down: the
    # stream partition's), all on the engine's tiled words; the engine's table on row-major words last
    None,
    FragMoEConfig(BLOCK_M=8, P13=64),
    FragMoEConfig(BLOCK_M=8, P2=82),
    FragMoEConfig(BLOCK_M=8),
    FragMoEConfig(BLOCK_M=8, P13=98),
    FragMoEConfig(BLOCK_M=16),
]
COMPACT = "compact"   # --only text of the engine table's launches over only the align's used blocks (_compact_aligns)
MOE_TS = [1, 4, 16, 64, 256, 1024]


def _row(rows, base, fn, ref, timed, nbytes, bw, reps):
    try:
        out = fn()
        err = rel(out, ref) if ref is not None else None
        t = time_calls(timed, reps=reps)["us"]
        rows.append({**base, "us": t, "TBps": nbytes / t / 1e6 if nbytes else None,
                     "x_copy": nbytes / t / 1e6 / (bw / 1e12) if nbytes else None, "err": err})
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is reported, not fatal
        rows.append({**base, "us": None, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    r = rows[-1]
    print(f"{base}: {r.get('us')} us, err {r.get('err', r.get('error'))}", flush=True)


def _wanted(cand, only: str | None) -> bool:
    """The engine's plan / table (cand None) always; the other candidates whose set knobs (a dense dict, a
    FragMoEConfig's fields off their defaults), lower-cased, contain one of the comma-separated texts of `only`
    (None: all)."""
    if cand is None or only is None:
        return True
    knobs = cand if isinstance(cand, dict) else {f.name: getattr(cand, f.name) for f in fields(cand)
                                                  if getattr(cand, f.name) != f.default}
    return any(o in repr(knobs).lower() for o in only.lower().split(","))


def _compiled_regs(fn) -> dict:
    """(registers, spilled bytes) of every compiled variant of a Triton / Gluon kernel, by cache key."""
    out = {}
    for entry in getattr(fn, "device_caches", {}).values():
        for key, k in entry[0].items():
            out[key] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None))
    return out


def _dense_launch(N, K, M, sms, cand) -> DenseLaunch:
    """One dense candidate's launch: the engine's (on its FRAG_TILE-ordered words and scales) with the candidate's
    fields replaced."""
    cand = dict(cand or {})
    launch = dense_launch(M, N, K, sms, FRAG_TILE, FRAG_TILE)
    tiles, iters = N // DENSE_PARTITION_ROWS, K // (32 * launch.gpb)
    if "per_sm" in cand:
        cand["programs"] = max(1, min(sms * cand.pop("per_sm"), tiles * iters))
    if "split" in cand:
        cand["programs"] = tiles * cand.pop("split")
    return replace(launch, **cand)


def bench_dense(ms, bw, reps, only: str | None = None) -> list[dict]:
    rows: list[dict] = []
    l2 = l2_bytes()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (N, K) in DENSE.items():
        nbytes = w4_bytes(N, K)
        ws = [rand_w4(N, K) for _ in range(max(1, math.ceil(3 * l2 / nbytes)))]
        wd = dequantize(*ws[0], G, torch.bfloat16)
        plan = dense_plan(N, K, sms)
        # (gpb, word tile, scale tile) -> the rotating copies in that order
        reps_by_gpb = {(plan[0], 0, 0): [(frag_repack(p, plan[0]), s) for p, s in ws]}
        reps_by_gpb[(plan[0], FRAG_TILE, 0)] = [(frag_tile(q, plan[0], FRAG_TILE), s)
                                                for q, s in reps_by_gpb[(plan[0], 0, 0)]]
        reps_by_gpb[(plan[0], FRAG_TILE, FRAG_TILE)] = [(q, scale_tile(s, plan[0], FRAG_TILE))
                                                        for q, s in reps_by_gpb[(plan[0], FRAG_TILE, 0)]]
        for M in ms:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = x.double() @ wd.double().T
            base = {"matrix": name, "M": M}
            _row(rows, {**base, "kernel": "default"}, lambda: w4a16_linear(x, *ws[0], G), ref,
                 [lambda p=p, s=s: w4a16_linear(x, p, s, G) for p, s in ws], nbytes, bw, reps)
            _row(rows, {**base, "kernel": "torch bf16 (dequantized)"}, lambda: x @ wd.T, ref,
                 [lambda: x @ wd.T], None, bw, reps)
            for cand in [c for c in DENSE_CANDIDATES if _wanted(c, only)]:
                launch = _dense_launch(N, K, M, sms, cand)
                tag = "frag (engine plan)" if cand is None else "frag"
                wr = reps_by_gpb[(launch.gpb, launch.tile, launch.stile)]
                label = (f"{tag} gpb{launch.gpb} programs{launch.programs} tok{launch.tok} {launch.mma}"
                         f"{' tiled ' + str(launch.tile) if launch.tile else ''}"
                         f"{' scales tiled ' + str(launch.stile) if launch.stile else ' row-major scales'}")
                before = _compiled_regs(_w4_frag_kernel)
                _row(rows, {**base, "kernel": label},
                     lambda: frag_linear(x, *wr[0], launch=launch), ref,
                     [lambda p=p, s=s: frag_linear(x, p, s, launch=launch) for p, s in wr], nbytes, bw, reps)
                new = [v for k, v in _compiled_regs(_w4_frag_kernel).items() if k not in before]
                if new:
                    rows[-1]["regs"] = new
                    print(f"  compiled: (registers, spilled bytes) {new}", flush=True)
        del ws, reps_by_gpb, wd
        torch.cuda.empty_cache()
    return rows


def bench_moe(ts, bw, reps, only: str | None = None) -> list[dict]:
    rows: list[dict] = []
    w13p, w13s = rand_w4(E, 2 * I, H)
    w2p, w2s = rand_w4(E, H, I)
    frag = (frag_repack(w13p, frag_gpb(H)), frag_repack(w2p, frag_gpb(I)))
    tiled = (frag_tile(frag[0], frag_gpb(H), FRAG_TILE), frag_tile(frag[1], frag_gpb(I), FRAG_TILE))
    stiled = (scale_tile(w13s, frag_gpb(H), FRAG_TILE), scale_tile(w2s, frag_gpb(I), FRAG_TILE))
    expert_bytes = w4_bytes(2 * I, H) + w4_bytes(H, I)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T in ts:
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        sets = route(T, 4, gen)
        touched = sum(int(torch.unique(ids).numel()) for ids, _ in sets) / len(sets)
        nbytes = touched * expert_bytes
        ids0, tw0 = sets[0]
        ref = fused_moe_reference(x, w13p, w13s, w2p, w2s, ids0, tw0, G)
        base = {"matrix": f"K2 MoE ({touched:.0f} experts)", "M": T}
        _row(rows, {**base, "kernel": "default"}, lambda: fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids0, tw0, G),
             ref, [lambda i=i, w=w: fused_moe_w4a16(x, w13p, w13s, w2p, w2s, i, w, G) for i, w in sets],
             nbytes, bw, reps)
        # the engine's order (tiled words and scales) for every candidate; then the engine's table on row-major
        # scales beside tiled words, and on both row-major
        for cand, tile, stile in ([(c, FRAG_TILE, FRAG_TILE) for c in MOE_CANDIDATES if _wanted(c, only)]
                                  + [(None, FRAG_TILE, 0), (None, 0, 0)]):
            q13, q2 = tiled if tile else frag
            s13, s2 = stiled if stile else (w13s, w2s)
            cfg = cand or frag_moe_config(T * TOPK, E)
            label = (f"frag{' (engine table)' if cand is None else ''} bm{cfg.BLOCK_M} "
                     f"programs {cfg.P13 or 'plan'}/{cfg.P2 or 'plan'}"
                     f"{f' tiled {tile}' if tile else ' row-major'}"
                     f"{f' scales tiled {stile}' if stile else ' row-major scales'}{' wgmma' if cfg.wgmma else ''}")
            _row(rows, {**base, "kernel": label},
                 lambda: fused_moe_frag(x, q13, s13, q2, s2, ids0, tw0, G, cfg, tile=tile, stile=stile), ref,
                 [lambda i=i, w=w: fused_moe_frag(x, q13, s13, q2, s2, i, w, G, cfg, tile=tile, stile=stile)
                  for i, w in sets], nbytes, bw, reps)
        if only is not None and COMPACT in only.lower().split(","):
            cfg = frag_moe_config(T * TOPK, E)
            cut = _compact_aligns(sets, cfg.BLOCK_M)
            q13, q2 = tiled
            s13, s2 = stiled
            with mock.patch.object(moe_frag_mod, "moe_align", lambda ids, *a, **k: cut[ids.data_ptr()]):
                _row(rows, {**base, "kernel": f"frag (engine table) bm{cfg.BLOCK_M} over the used blocks only "
                                              f"(host-synced align, a measurement aid)"},
                     lambda: fused_moe_frag(x, q13, s13, q2, s2, ids0, tw0, G, cfg, **ENGINE_ORDER), ref,
                     [lambda i=i, w=w: fused_moe_frag(x, q13, s13, q2, s2, i, w, G, cfg, **ENGINE_ORDER)
                      for i, w in sets], nbytes, bw, reps)
    return rows


def _compact_aligns(sets, bm: int) -> dict:
    """A measurement aid: per routing set (keyed by its ids' storage), the align's outputs cut to the blocks that
    hold pairs (found with a host sync before timing). The engine's launches keep every block the routing could
    need (moe_align's max_blocks); their difference is what the unused blocks' programs cost."""
    out = {}
    for ids, _ in sets:
        sp, be, br = moe_align(ids.reshape(-1), E, bm)
        keep = (br > 0).nonzero().flatten()
        out[ids.data_ptr()] = (sp.view(-1, bm)[keep].reshape(-1).contiguous(), be[keep].contiguous(),
                               br[keep].contiguous())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ms", default="1,4,8,16", help="dense M values")
    ap.add_argument("--ts", default=",".join(map(str, MOE_TS)), help="MoE token counts")
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--only", default=None, help="besides the engine's plan / table, only the candidates whose "
                    "repr contains this text or one of these comma-separated texts (e.g. 'wgmma', 'per_sm,wgmma')")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/w4_frag.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bw = copy_bandwidth()
    info = device_info()
    rows = [] if args.no_dense else bench_dense([int(v) for v in args.ms.split(",")], bw, args.reps, args.only)
    rows += [] if args.no_moe else bench_moe([int(v) for v in args.ts.split(",")], bw, args.reps, args.only)
    md = [f"# Fragment-ordered W4A16 (Gluon, mma.sync A operand from registers) on {info.get('gpu', 'GPU')}", "",
          f"Command: `{command_line()}`", "",
          f"torch {info.get('torch')}, triton {info.get('triton')}. Copy bandwidth {bw / 1e12:.2f} TB/s (read + write). "
          "us: median over CUDA-graph replays (dense: rotating weight copies > L2; MoE: 4 routings). "
          "TB/s: int4 + scale bytes of the matrix (MoE: of the experts touched) / time. err: relative, against "
          "x @ W^T in float64 (dense; W the bf16-rounded dequantized weights) or `fused_moe_reference` (MoE).", ""]
    md += md_table(["matrix", "M / T", "kernel", "us", "TB/s", "x copy", "err", "registers (new compiles)"],
                   [[r["matrix"], r["M"], r["kernel"], r.get("us"), r.get("TBps"), r.get("x_copy"),
                     r.get("err", r.get("error")), " ".join(f"{a}/{b}" for a, b in r.get("regs", []))] for r in rows])
    write_results(args.out, f"w4-frag-{gpu_stem(info['gpu'])}", {"device": info, "copy_bw": bw, "rows": rows}, md)
    print("\n".join(md[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
