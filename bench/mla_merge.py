"""The MLA attention's chunk merge alone: its bit-neutral launch variants at decode and verify shapes.

    python bench/mla_merge.py --out bench/results      # writes mla_merge-<gpu>.json / .md

A decode launch ends with the merge of each row's chunk partials (fp32 [rows, chunks, 512] and their
log-sum-exps, in L2 after the chunk kernel): about 8 us of a 57 us N = 8 decode at 128K context (Nsight
Compute). Its summation order is fixed by the chunk count alone (pairwise trees of MERGE_BLOCK_C chunks,
see kdtree_engine/kernels/mla_attention.py), so the column tile (BLOCK_D), the warps and PREFETCH (the next
block's loads issued before the current block's sums) only change how fast it runs; each variant's output
is compared bit for bit with the engine's launch. Partials are random, rows are causal decode rows
(T = 1, N = 8 or 64), a 16-node verify at N = 8 or the rows of a 4-node tree over 4K; timings are medians of CUDA-graph replays of
PER_GRAPH back-to-back launches, per launch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.common import command_line, device_info, gpu_stem, md_table, time_calls, write_results  # noqa: E402
from kdtree_engine.kernels.mla_attention import _mla_merge_kernel, merge_tiles  # noqa: E402

C, CHUNK = 512, 512
PER_GRAPH = 20   # launches per CUDA graph (one launch alone would time the replay's own overhead)
# (label, T, N, context S): rows = T * N causal rows over S + t + 1 keys
SHAPES = [("decode N=8 32K", 1, 8, 32768), ("decode N=8 128K", 1, 8, 131072), ("decode N=8 256K", 1, 8, 262144),
          ("decode N=64 128K", 1, 64, 131072), ("verify N=8 T=16 32K", 16, 8, 32768),
          ("verify N=8 T=16 128K", 16, 8, 131072), ("tree N=64 T=4 4K", 4, 64, 4096), ("tree N=8 T=4 4K", 4, 8, 4096),
          ("decode N=64 4K", 1, 64, 4096), ("tree N=64 T=16 4K", 16, 64, 4096), ("tree N=64 T=64 4K", 64, 64, 4096)]
# (BLOCK_D, num_warps, PREFETCH) without EARLY; None: the engine's launch (merge_tiles), timed first; FLIP_EARLY: the
# engine's launch with the first blocks' loads beside the row's length loads (_mla_merge_kernel's EARLY) the other way
FLIP_EARLY = "flip-early"
VARIANTS = [None, FLIP_EARLY, (32, 2, False), (32, 2, True), (128, 2, False), (16, 2, False), (16, 2, True), (16, 1, True),
            (8, 1, True), (32, 4, True), (64, 4, True), (128, 4, False), (256, 4, False), (256, 4, True), (512, 4, False),
            (512, 8, False)]


def run_shape(T: int, N: int, S: int, reps: int) -> list[dict]:
    rows = T * N
    n_ch = triton.cdiv(S + T, CHUNK)
    gen = torch.Generator(device="cuda").manual_seed(S + rows)
    po = torch.randn(rows, n_ch, C, device="cuda", generator=gen)
    pl = 4 * torch.randn(rows, n_ch, device="cuda", generator=gen)
    nvis = torch.zeros(1, dtype=torch.int32, device="cuda")
    mt = merge_tiles(rows, n_ch, C)
    block_c, lse_block = mt.block_c, mt.lse_block
    recs, ref = [], None
    for variant in VARIANTS:
        if variant in (None, FLIP_EARLY):
            bd, warps, pre, early = mt.block_d, mt.warps, mt.prefetch, mt.early != (variant == FLIP_EARLY)
        else:
            (bd, warps, pre), early = variant, False
        out = torch.empty(T, N, C, device="cuda", dtype=torch.bfloat16)

        def launch(out=out, bd=bd, warps=warps, pre=pre, early=early) -> None:
            _mla_merge_kernel[(rows, triton.cdiv(C, bd))](
                po, pl, nvis, out, nvis, S, N, n_ch, T, po.stride(0), po.stride(1), pl.stride(0),
                out.stride(0), out.stride(1), C=C, BLOCK_D=bd, BLOCK_C=block_c, CHUNK=CHUNK, CAUSAL=True,
                S_DEV=False, LSE_BLOCK=lse_block, PREFETCH=pre, EARLY=early, num_warps=warps)

        launch()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        t = time_calls([launch] * PER_GRAPH, reps=reps, warmup=2)
        recs.append({"engine": variant is None, "BLOCK_D": bd, "num_warps": warps, "PREFETCH": pre, "EARLY": early, "programs": rows * triton.cdiv(C, bd),
                     "us": t["us"], "graph": t["graph"], "same_bits": bool(torch.equal(out, ref))})
    return recs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/mla_merge.py needs a CUDA device", file=sys.stderr)
        return 2
    cases, table = [], []
    for label, T, N, S in SHAPES:
        for rec in run_shape(T, N, S, args.reps):
            rec = {"shape": label, "T": T, "N": N, "S": S, **rec}
            cases.append(rec)
            table.append([label, "engine" if rec["engine"] else "", rec["BLOCK_D"], rec["num_warps"], rec["PREFETCH"],
                          rec["EARLY"], rec["programs"], rec["us"],
                          rec["same_bits"]])
            print(label, rec, flush=True)
    info = device_info()
    gpu = gpu_stem(info["gpu"])
    md = [f"# MLA attention chunk merge on {info['gpu']}", "", f"Command: `{command_line()}`", "",
          "The first row of each shape is the engine's launch; same bits = equal to it.", ""]
    md += md_table(["shape", "launch", "BLOCK_D", "warps", "PREFETCH", "EARLY", "programs", "us", "same bits"],
                   table)
    write_results(args.out, f"mla_merge-{gpu}", {"command": command_line(), "device": info, "cases": cases}, md)
    return 0 if all(r["same_bits"] for r in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
