"""Compile the dense fragment-ordered W4A16 kernel (kernels/w4_frag.py, Gluon) for sm_90 without a GPU, with
Triton's bundled ptxas, as frag_linear launches it (w4_frag.dense_constexprs), and report what the SASS says:
registers, stack (spills), instructions per K block in the main loop and its instruction mix, and for the
warpgroup-MMA programs whether the loop waits for each wgmma group (`WARPGROUP.DEPBAR.LE gsb0, 0x0`).

    python3 bench/frag_aot.py [--out bench/results]     # writes frag-aot-sm90.md

The K2 dense shape's launch: GPB 8 (256 k per block), one 64-row partition tile per 4-warp program, tiled words
and scales, two unrolled segments, dependent launch on. Offline numbers, not timings: bench/w4_frag.py times.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from bench.sass import TARGET, cubin_sass, main_loop, opcode  # noqa: E402
from kdtree_engine.records import command_line, run_metadata, with_metadata  # noqa: E402
from kdtree_engine.kernels import w4_frag  # noqa: E402
from kdtree_engine.kernels.layouts import FRAG_TILE  # noqa: E402

SIG = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32", M="i32", N="i32", stride_xm="i32",
           stride_wn="i32", stride_sn="i32", stride_om="i32", stride_os="i32", iters="i32", work="i32",
           programs="i32")
DIV16 = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "stride_xm", "stride_wn", "stride_sn", "stride_om")

# (label, token tile, MMA): the engine's launches (mma.sync to 16 tokens, synchronous wgmma beyond) and 16-token
# wgmma programs
VARIANTS = [("engine 8", 8, "sync"), ("engine 16", 16, "sync"), ("wgmma 16", 16, "wgmma"),
            ("engine 32", 32, "wgmma"), ("engine 64", 64, "wgmma")]


def compile_dense(tok: int, mma: str, *, gpb: int = 8, segs: int = 2, pdl: bool = True) -> dict:
    """Compile one dense launch offline as frag_linear launches it (tiled words and scales). Returns registers,
    stack bytes, instructions, the main loop's instructions per K block and opcode mix, and its wgmma waits."""
    launch = w4_frag.DenseLaunch(gpb=gpb, programs=1, tok=tok, mma=mma, tile=FRAG_TILE, stile=FRAG_TILE)
    consts = {**w4_frag.dense_constexprs(launch, segs), "PDL": pdl}
    sig = {**SIG, **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIV16}
    k = triton.compile(GluonASTSource(w4_frag._w4_frag_kernel, sig, consts, attrs), target=TARGET,
                       options={"num_warps": consts["num_warps"]})
    regs, stack, ops = cubin_sass(k)
    if regs is None:
        raise RuntimeError("cuobjdump -res-usage printed no REG / STACK for the dense fragment kernel")
    loop = main_loop(ops)
    blocks = 2 if consts["PAIRS"] and not consts["WG"] else 1   # mma.sync 8-token programs: two blocks per trip
    waits = [t for _, t in loop if "WARPGROUP.DEPBAR" in t]
    return {"regs": regs, "stack": stack, "instructions": len(ops),
            "per_block": len(loop) / blocks, "mix": collections.Counter(opcode(t) for _, t in loop),
            "mma": sum(opcode(t) in ("HMMA", "HGMMA") for _, t in loop) / blocks,
            "waits_all": any(w.endswith("0x0") for w in waits)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "bench" / "results"))
    args = ap.parse_args(argv)
    rows = []
    for label, tok, mma in VARIANTS:
        r = compile_dense(tok, mma)
        mix = ", ".join(f"{k} {v}" for k, v in r["mix"].most_common(8))
        wg = "waits for each" if r["waits_all"] else "n/a"
        rows.append(f"| {label} | {tok} | {mma} | {r['regs']} | {r['stack']} | {r['per_block']:g} | {r['mma']:g} | "
                    f"{wg} | {mix} |")
        print(rows[-1], flush=True)
    md = ["# Dense fragment W4A16 kernel compiled offline for sm_90", "",
          f"Command: `python3 bench/frag_aot.py`; triton {triton.__version__} (its bundled ptxas), no GPU.", "",
          "The K2 dense launch (GPB 8, 64-row partition tiles, 4-warp programs, tiled words and scales). "
          "per block: instructions of the main loop per 256-k block and warp; MMA: its HMMA / HGMMA per block; "
          "wgmma waits: whether the loop waits for each warpgroup-MMA group; the mix per trip of the loop (8-token "
          "mma.sync programs: two blocks per trip).", "",
          "| variant | tokens | MMA | registers | stack | per block | MMA | wgmma waits | loop mix |",
          "|---|---|---|---|---|---|---|---|---|", *rows, ""]
    out = Path(args.out) / "frag-aot-sm90.md"
    out.write_text(with_metadata("\n".join(md), run_metadata(command_line(argv, "python3 bench/frag_aot.py"))))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
