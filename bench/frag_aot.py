"""Compile the dense fragment-ordered W4A16 kernel (kernels/w4_frag.py, Gluon) for sm_90 without a GPU, with
Triton's bundled ptxas, as frag_linear launches it (w4_frag.dense_constexprs), and report what the SASS says:
registers, stack (spills), instructions per K block in the main loop and its instruction mix, and for the
warpgroup-MMA forms whether the loop keeps a wgmma group in flight (a `WARPGROUP.DEPBAR.LE gsb0, 0x1` wait and
no `0x0` wait inside the loop) or waits for each one, and whether any instruction writes a register A operand of
a group still in flight.

    python3 bench/frag_aot.py [--out bench/results]     # writes frag-aot-sm90.md

The K2 dense shape's launch: GPB 8 (256 k per block), one 64-row partition tile per 4-warp program, tiled words
and scales, two unrolled segments, dependent launch on. Offline numbers, not timings: bench/w4_frag.py times.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from bench.sass import TARGET, cubin_sass, main_loop, opcode  # noqa: E402
from kdtree_engine.records import command_line, run_metadata, with_metadata  # noqa: E402
from kdtree_engine.kernels import w4_frag  # noqa: E402

SIG = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", out_ptr="*fp32", M="i32", N="i32", stride_xm="i32",
           stride_wn="i32", stride_sn="i32", stride_om="i32", stride_os="i32", iters="i32", work="i32",
           programs="i32")
DIV16 = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "stride_xm", "stride_wn", "stride_sn", "stride_om")

# (label, token tile, MMA): the engine's plan (mma.sync to 16 tokens, synchronous wgmma beyond) and the
# asynchronous warpgroup form at every token tile
VARIANTS = [("engine 8", 8, "sync"), ("engine 16", 16, "sync"), ("wgmma 16", 16, "wgmma"),
            ("engine 32", 32, "wgmma"), ("engine 64", 64, "wgmma"), ("wgmma-async 8", 8, "wgmma-async"),
            ("wgmma-async 16", 16, "wgmma-async"), ("wgmma-async 32", 32, "wgmma-async"),
            ("wgmma-async 64", 64, "wgmma-async")]


_NO_DEST = ("ST", "BAR", "BRA", "WARPGROUP", "HGMMA", "MEMBAR", "FENCE", "RED", "EXIT", "NOP", "DEPBAR", "SYNCS",
            "ISETP", "FSETP", "HSETP", "UISETP", "PLOP3")


def _written(t: str) -> set[int]:
    """General registers an instruction writes (its first operand, widened by a vector load's width)."""
    op = opcode(t)
    if op.startswith(_NO_DEST) or op.startswith("U"):
        return set()
    m = re.match(r"^(?:@!?U?P\w+\s+)?(\S+)\s+R(\d+)\b", t)
    if m is None:
        return set()
    mods = m.group(1)
    width = (4 if ".128" in mods or ".X4" in mods.upper() or op == "HMMA" else
             2 if (".64" in mods and op.startswith("LD")) or ".X2" in mods.upper() or ".WIDE" in mods
             or op == "CS2R" else 1)
    return set(range(int(m.group(2)), int(m.group(2)) + width))


def a_operand_hazards(loop: list[tuple[int, str]]) -> list[str]:
    """Writes to a register A operand of a register-operand wgmma (HGMMA ..., R<a>, gdesc[...]: four registers
    from R<a>) before the `WARPGROUP.DEPBAR.LE gsb0, N` that retires its group: undefined results (the hardware
    reads A while the group runs). The loop body is walked twice, so groups in flight across the back edge count."""
    out: list[str] = []
    pending: list[set[int]] = []   # committed groups in flight, oldest first: their A registers
    open_regs: set[int] = set()    # the group being issued
    for a, t in loop + loop:
        if "HGMMA" in t:
            m = re.search(r"HGMMA\S*\s+R\d+,\s+R(\d+),", t)
            if m:
                open_regs |= set(range(int(m.group(1)), int(m.group(1)) + 4))
            if "gsb0" in t:
                pending.append(open_regs)
                open_regs = set()
            continue
        m = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s+0x([0-9a-f]+)", t)
        if m:
            while len(pending) > int(m.group(1), 16):
                pending.pop(0)
            continue
        hit = _written(t) & set().union(open_regs, *pending)
        if hit:
            out.append(f"{a:#x} {t} writes R{sorted(hit)} of a wgmma group in flight")
    return out


def compile_dense(tok: int, mma: str, *, gpb: int = 8, pt: int = 64, num_warps: int = 4, segs: int = 2,
                  maxnreg: int | None = None, pdl: bool = True) -> dict:
    """Compile one dense launch offline (maxnreg None: frag_linear's default for the MMA). Returns registers,
    stack bytes, instructions, the main loop's instructions per K block and opcode mix, and its wgmma waits."""
    consts = w4_frag.dense_constexprs(tok=tok, mt=1, gpb=gpb, num_warps=num_warps, xload="smem-ahead",
                                      tile=w4_frag.FRAG_TILE, pt=pt, segs=segs, mma=mma, pairs=None,
                                      stile=w4_frag.FRAG_TILE)
    consts["PDL"] = pdl
    maxnreg = w4_frag.dense_maxnreg(mma, tok) if maxnreg is None else maxnreg
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {**SIG, **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIV16}
    opts = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    k = triton.compile(GluonASTSource(w4_frag._w4_frag_kernel, sig, consts, attrs), target=TARGET, options=opts)
    regs, stack, ops = cubin_sass(k)
    if regs is None:
        raise RuntimeError("cuobjdump -res-usage printed no REG / STACK for the dense fragment kernel")
    loop = main_loop(ops)
    blocks = 2 if consts["PAIRS"] and not consts["WG"] else 1   # mma.sync 8-token programs: two blocks per trip
    waits = [t for _, t in loop if "WARPGROUP.DEPBAR" in t]
    return {"regs": regs, "stack": stack, "instructions": len(ops),
            "per_block": len(loop) / blocks, "mix": collections.Counter(opcode(t) for _, t in loop),
            "mma": sum(opcode(t) in ("HMMA", "HGMMA") for _, t in loop) / blocks,
            "in_flight": any(w.endswith("0x1") for w in waits), "waits_all": any(w.endswith("0x0") for w in waits),
            "hazards": a_operand_hazards(loop), "maxnreg": maxnreg}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "bench" / "results"))
    args = ap.parse_args(argv)
    rows = []
    for label, tok, mma in VARIANTS:
        r = compile_dense(tok, mma)
        mix = ", ".join(f"{k} {v}" for k, v in r["mix"].most_common(8))
        wg = ("one group in flight" if r["in_flight"] and not r["waits_all"] else
              "waits for each" if r["waits_all"] else "n/a")
        rows.append(f"| {label} | {tok} | {mma} | {r['maxnreg'] or '-'} | {r['regs']} | {r['stack']} | "
                    f"{r['per_block']:g} | {r['mma']:g} | {wg} | {len(r['hazards'])} | {mix} |")
        print(rows[-1], flush=True)
    md = ["# Dense fragment W4A16 kernel compiled offline for sm_90", "",
          f"Command: `python3 bench/frag_aot.py`; triton {triton.__version__} (its bundled ptxas), no GPU.", "",
          "The K2 dense launch (GPB 8, 64-row partition tiles, 4-warp programs, tiled words and scales). "
          "per block: instructions of the main loop per 256-k block and warp; MMA: its HMMA / HGMMA per block; "
          "wgmma waits: whether the loop keeps one warpgroup-MMA group in flight or waits for each; A writes: "
          "instructions writing a register A operand of a wgmma group still in flight (a_operand_hazards; must be "
          "0); the mix per trip of the loop (8-token mma.sync programs: two blocks per trip).", "",
          "| variant | tokens | MMA | maxnreg | registers | stack | per block | MMA | wgmma waits | A writes | loop mix |",
          "|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    out = Path(args.out) / "frag-aot-sm90.md"
    out.write_text(with_metadata("\n".join(md), run_metadata(command_line(argv, "python3 bench/frag_aot.py"))))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
