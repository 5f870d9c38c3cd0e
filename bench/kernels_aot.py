"""Compile the W4A16 / MoE kernels for sm_90 without a GPU (Triton's bundled ptxas) and report shared
memory, MMA instructions (wgmma vs mma.sync) and cp.async pipelining per config.

    python bench/kernels_aot.py            # default configs
    python bench/kernels_aot.py ptx        # instruction histogram of the default dense kernel
"""
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from kdtree_engine.kernels import w4a16 as d, moe_w4a16 as m

TARGET = GPUTarget("cuda", 90, 32)

def comp(fn, sig, consts, num_warps, num_stages, label):
    src = ASTSource(fn, sig, consts)
    try:
        k = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:
        print(f"{label}: FAIL {type(e).__name__}: {str(e)[:400]}"); return None
    ptx = k.asm["ptx"]; sass = None
    md = k.metadata
    n_wgmma = ptx.count("wgmma.mma_async"); n_mma = ptx.count("mma.sync")
    n_cpasync = ptx.count("cp.async"); n_ld128 = len(re.findall(r"ld\.global[^\n]*v4\.b32", ptx))
    n_tma = ptx.count("cp.async.bulk")
    print(f"{label}: shared={md.shared} regs?={getattr(md,'num_regs',None)} wgmma={n_wgmma} mma.sync={n_mma} cp.async={n_cpasync} tma={n_tma} ld.v4={n_ld128} spills?={getattr(md,'n_spills',None)}")
    return k

def dense(dtype, cfg, split):
    sig = {"x_ptr": f"*{dtype}", "w_ptr": "*i32", "s_ptr": "*bf16", "out_ptr": ("*fp32" if split else f"*{dtype}"),
           "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
           "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_om": "i32", "stride_os": "i32",
           "G": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
           "SWAP_AB": "constexpr", "UPCAST": "constexpr", "PREC": "constexpr", "OUT_F32": "constexpr",
           "DEQ": "constexpr", "EVEN": "constexpr"}
    consts = dict(G=32, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SWAP_AB=cfg.SWAP_AB,
                  UPCAST=False, PREC="ieee" if dtype=="fp32" else "tf32", OUT_F32=split,
                  DEQ=d.deq_code(cfg.DEQUANT, {"bf16": torch.bfloat16}.get(dtype, torch.float32)), EVEN=False)
    return comp(d._w4a16_kernel, sig, consts, cfg.num_warps, cfg.num_stages, f"dense {dtype} {cfg.as_dict()} split={split}")

def moe(dtype, cfg):
    sig13 = {"x_ptr": f"*{dtype}", "w_ptr": "*i32", "s_ptr": "*bf16", "inter_ptr": f"*{dtype}", "sorted_ptr": "*i32",
             "blk_expert_ptr": "*i32", "blk_rows_ptr": "*i32", "H": "i32", "I": "i32", "TOPK": "i32",
             "stride_xt": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_it": "i32",
             "G": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
             "SWAP_AB": "constexpr", "UPCAST": "constexpr", "PREC": "constexpr", "DEQ": "constexpr", "EVEN": "constexpr",
             "part_ptr": "*fp32", "stride_ps": "i32", "stride_pp": "i32", "k_per_split": "i32", "SPLIT": "constexpr"}
    consts = dict(G=32, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SWAP_AB=cfg.SWAP_AB,
                  UPCAST=False, PREC="ieee" if dtype=="fp32" else "tf32",
                  DEQ=d.deq_code(cfg.DEQUANT, {"bf16": torch.bfloat16}.get(dtype, torch.float32)), EVEN=False)
    comp(m._moe_w13_kernel, sig13, {**consts, "SPLIT": cfg.SPLIT_K}, cfg.num_warps, cfg.num_stages,
         f"moe_w13 {dtype} {cfg.as_dict()}")
    sig2 = {"a_ptr": f"*{dtype}", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": "*fp32", "tw_ptr": "*fp32", "sorted_ptr": "*i32",
            "blk_expert_ptr": "*i32", "blk_rows_ptr": "*i32", "H": "i32", "I": "i32",
            "stride_at": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32", "stride_yt": "i32",
            "stride_ys": "i32", "k_per_split": "i32",
            "G": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
            "SWAP_AB": "constexpr", "UPCAST": "constexpr", "PREC": "constexpr", "DEQ": "constexpr", "EVEN": "constexpr"}
    consts["BLOCK_N"] = cfg.BLOCK_N2 or cfg.BLOCK_N
    comp(m._moe_w2_kernel, sig2, consts, cfg.num_warps, cfg.num_stages, f"moe_w2 {dtype} {cfg.as_dict()}")

from dataclasses import replace
which = sys.argv[1] if len(sys.argv) > 1 else "defaults"
if which == "defaults":
    for _, c in d.DENSE_CONFIGS:
        dense("bf16", c, False)
    dense("bf16", d.DENSE_CONFIGS[0][1], True)
    dense("fp32", d.DENSE_CONFIGS[0][1], False)
    dense("fp16", d.DENSE_CONFIGS[0][1], False)
    for _, c in m.MOE_CONFIGS:
        moe("bf16", c)
    moe("fp32", m.MOE_CONFIGS[0][1])
    comp(m._moe_align_kernel, {"ids_ptr": "*i64", "P": "i32", "E": "i32", "sorted_ptr": "*i32", "blk_expert_ptr": "*i32",
         "blk_rows_ptr": "*i32", "max_blocks": "i32", "BM": "constexpr", "E_P2": "constexpr", "CH": "constexpr", "BCH": "constexpr"},
         dict(BM=16, E_P2=512, CH=32, BCH=16), 8, 1, "align")
    comp(m._moe_topk_sum_kernel, {"y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16", "H": "i32", "E": "i32",
         "stride_yt": "i32", "stride_ys": "i32", "stride_ot": "i32", "TOPK": "constexpr", "BLOCK_H": "constexpr",
         "SPLIT": "constexpr"}, dict(TOPK=8, BLOCK_H=1024, SPLIT=1), 4, 1, "topk_sum")
    from kdtree_engine.kernels.split_sum import _split_sum_kernel
    comp(_split_sum_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "MN": "i32", "SPLIT": "constexpr", "BLOCK": "constexpr"},
         dict(SPLIT=4, BLOCK=1024), 4, 1, "split_sum")
if which == "ptx":
    k = dense("bf16", d.DENSE_CONFIGS[0][1], False)
    ptx = k.asm["ptx"]
    import collections
    c = collections.Counter(re.findall(r"^\s*((?:cvt|cp\.async|wgmma|st\.shared|ld\.shared|lop3|shr|and|or|sub|fma|mul|add|prmt|ld\.global|stmatrix|ldmatrix)[\w\.]*)", ptx, re.M))
    for kk, v in sorted(c.items(), key=lambda t: -t[1])[:40]: print(v, kk)
    print([l for l in ptx.splitlines() if "wgmma.mma_async" in l][:2])
    sass = k.asm.get("sass")
