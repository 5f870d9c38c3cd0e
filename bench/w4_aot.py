"""Compile every sweep candidate (bench/w4_sweep.py) for sm_90 without a GPU, with Triton's bundled
ptxas, and report what the SASS says: registers, stack (spills), shared memory, and instructions per
weight element in the K loop (the cost that bounds these kernels at small M).

    python bench/w4_aot.py [NAME ...]  # all candidates (or those whose name contains NAME), bf16 activations

A candidate that fails here would fail in the GPU sweep too; shared memory over 227 KB fails at launch.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from bench.sass import TARGET, cubin_sass, main_loop, opcode  # noqa: E402
from bench.w4_sweep import DENSE_CANDIDATES, MOE_CANDIDATES  # noqa: E402
from kdtree_engine.kernels import moe_w4a16 as moe  # noqa: E402
from kdtree_engine.kernels import w4a16 as dense  # noqa: E402
from kdtree_engine.kernels.w4_dequant import DEQUANTS  # noqa: E402

G = 32


def compile_report(fn, sig: dict, consts: dict, num_warps: int, num_stages: int, div16: tuple[str, ...],
                   elems_per_iter: int) -> str:
    """div16: arguments the launcher would specialize as multiples of 16 (true for K2 shapes)."""
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    r, st, ins = cubin_sass(k)
    regs, stack = ("?", "?") if r is None else (r, st)
    body = [t for _, t in main_loop(ins)]   # the largest backward branch = the K loop
    hist = collections.Counter(opcode(t) for t in body)
    per_thread = elems_per_iter / (num_warps * 32)
    top = " ".join(f"{op}:{n}" for op, n in hist.most_common(6))
    mem = " ".join(f"{op}:{hist[op]}" for op in ("LDG", "LDGSTS", "UTMALDG", "LDS", "LDSM", "STS", "HGMMA", "HMMA",
                                                   "WARPGROUP", "BAR", "SYNCS") if hist[op])
    return (f"regs {regs} stack {stack} smem {k.metadata.shared // 1024} KB | loop {len(body)} instr = "
            f"{len(body) / per_thread:.2f}/element | {top} | {mem}")


def _dense(cfg) -> str:
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
           "K": "i32", "k_per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
           "stride_om": "i32", "stride_os": "i32", "G": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "SWAP_AB": "constexpr", "UPCAST": "constexpr", "PREC": "constexpr",
           "OUT_F32": "constexpr", "DEQ": "constexpr", "EVEN": "constexpr"}
    consts = dict(G=G, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SWAP_AB=cfg.SWAP_AB,
                  UPCAST=False, PREC="tf32", OUT_F32=False, DEQ=DEQUANTS[cfg.DEQUANT], EVEN=True)
    div = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn",
           "stride_om", "stride_os")
    return compile_report(dense._w4a16_kernel, sig, consts, cfg.num_warps, cfg.num_stages, div,
                          cfg.BLOCK_N * cfg.BLOCK_K)


def _moe(cfg) -> tuple[str, str]:
    common = {"w_ptr": "*i32", "s_ptr": "*bf16"}
    consts = dict(G=G, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SWAP_AB=cfg.SWAP_AB,
                  UPCAST=False, PREC="tf32", DEQ=DEQUANTS[cfg.DEQUANT], EVEN=True)
    tail = {"G": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
            "SWAP_AB": "constexpr", "UPCAST": "constexpr", "PREC": "constexpr", "DEQ": "constexpr",
            "EVEN": "constexpr"}
    sig13 = {"x_ptr": "*bf16", **common, "inter_ptr": "*bf16", "sorted_ptr": "*i32", "blk_expert_ptr": "*i32",
             "blk_rows_ptr": "*i32", "H": "i32", "I": "i32", "TOPK": "i32", "stride_xt": "i32", "stride_we": "i32",
             "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_it": "i32", **tail,
             "part_ptr": "*fp32", "stride_ps": "i32", "stride_pp": "i32", "k_per_split": "i32", "SPLIT": "constexpr"}
    div = ("x_ptr", "w_ptr", "s_ptr", "inter_ptr", "a_ptr", "y_ptr", "H", "I", "stride_xt", "stride_we", "stride_wn",
           "stride_se", "stride_sn", "stride_it", "stride_at", "stride_yt")
    r13 = compile_report(moe._moe_w13_kernel, sig13, {**consts, "SPLIT": cfg.SPLIT_K}, cfg.num_warps,
                         cfg.num_stages, tuple(d for d in div if d in sig13) + ("stride_ps", "stride_pp", "k_per_split"),
                         2 * cfg.BLOCK_N * cfg.BLOCK_K)
    sig2 = {"a_ptr": "*bf16", **common, "y_ptr": "*fp32", "tw_ptr": "*fp32", "sorted_ptr": "*i32",
            "blk_expert_ptr": "*i32", "blk_rows_ptr": "*i32", "H": "i32", "I": "i32", "stride_at": "i32",
            "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_yt": "i32",
            "stride_ys": "i32", "k_per_split": "i32", **tail}
    bn2 = cfg.BLOCK_N2 or cfg.BLOCK_N
    r2 = compile_report(moe._moe_w2_kernel, sig2, {**consts, "BLOCK_N": bn2}, cfg.num_warps, cfg.num_stages,
                        tuple(d for d in div if d in sig2) + ("stride_ys", "k_per_split"), bn2 * cfg.BLOCK_K)
    return r13, r2


def main(argv: list[str] | None = None) -> int:
    """argv: optional substrings; only candidates whose name contains one of them are compiled."""
    pick = list(sys.argv[1:] if argv is None else argv)
    bad = 0
    for name, fam in DENSE_CANDIDATES:
        if pick and not any(p in name for p in pick):
            continue
        try:
            print(f"dense {name} BLOCK_M={fam.BLOCK_M}: {_dense(fam)}", flush=True)
        except Exception as exc:  # noqa: BLE001 - report every candidate
            bad += 1
            print(f"dense {name}: FAIL {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    for name, cfg in MOE_CANDIDATES:
        if pick and not any(p in name for p in pick):
            continue
        try:
            r13, r2 = _moe(cfg)
            print(f"moe {name}: w13 {r13}\n    {' ' * len(name)}  w2  {r2}", flush=True)
        except Exception as exc:  # noqa: BLE001
            bad += 1
            print(f"moe {name}: FAIL {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
