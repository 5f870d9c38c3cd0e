"""Fused INT4 MoE: torch reference vs a naive per-token loop, and the Triton kernels under the
interpreter (child process, see _interp.py) vs the reference at small odd shapes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.moe_w4a16 import fused_moe_reference, fused_moe_w4a16  # noqa: E402
from kdtree_engine.quant import dequantize  # noqa: E402
from test_w4a16 import DT, TOL, rand_w4  # noqa: E402


def make_moe(T, H, I, E, k, G, dtype, gen, ids_mode="distinct"):
    w13p, w13s = rand_w4(E, 2 * I, H, group_size=G, gen=gen)
    w2p, w2s = rand_w4(E, H, I, group_size=G, gen=gen)
    x = torch.randn(T, H, generator=gen).to(dtype)
    if ids_mode == "distinct":
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    else:  # with repeats and some -1 (not owned here): those pairs contribute nothing
        ids = torch.randint(-1, E, (T, k), generator=gen)
    tw = torch.rand(T, k, generator=gen)
    return x, w13p, w13s, w2p, w2s, ids, tw


# ---------------------------------------------------------------------------------- in process


def test_reference_matches_per_token_loop():
    gen = torch.Generator().manual_seed(3)
    T, H, I, E, k, G = 4, 64, 32, 6, 3, 32
    x, w13p, w13s, w2p, w2s, ids, tw = make_moe(T, H, I, E, k, G, torch.float32, gen, ids_mode="mixed")
    ref = fused_moe_reference(x, w13p, w13s, w2p, w2s, ids, tw, G).double()
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            w13 = dequantize(w13p[e], w13s[e], G, torch.float64)
            w2 = dequantize(w2p[e], w2s[e], G, torch.float64)
            gu = w13 @ x[t].double()
            want[t] += float(tw[t, j]) * (w2 @ (F.silu(gu[:I]) * gu[I:]))
    assert ((ref - want).norm() / want.norm()).item() < 1e-5


def test_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(4)
    x, w13p, w13s, w2p, w2s, ids, tw = make_moe(2, 64, 32, 4, 2, 32, torch.float32, gen)
    with pytest.raises(ValueError):
        fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids[:, :1], tw, 32)
    with pytest.raises(ValueError):
        fused_moe_w4a16(x, w13p, w13s, w2p[:, :32], w2s[:, :32], ids, tw, 32)
    with pytest.raises(ValueError):
        fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, 64)
    for bad in (torch.zeros(2, 63), torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(64, 2).t()):
        with pytest.raises(ValueError, match="add must be"):
            fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, 32, add=bad)


# ---------------------------------------------------------------------------------- interpreter

CASES = {
    # name: (T, H, I, E, k, group, dtype, ids_mode, config overrides)
    "t1_fp32_e5_k2": (1, 96, 64, 5, 2, 32, "fp32", "distinct", {}),
    "t3_bf16_h160_e7_k3": (3, 160, 64, 7, 3, 32, "bf16", "distinct", {}),
    "t17_fp32_g64_e9_k3": (17, 192, 64, 9, 3, 64, "fp32", "distinct", {}),
    "t17_fp16_e9_k2": (17, 96, 64, 9, 2, 32, "fp16", "distinct", {}),
    "t5_fp32_repeats_and_unowned": (5, 96, 64, 6, 3, 32, "fp32", "mixed", {}),
    "t17_fp32_noswap_bm32": (17, 160, 64, 8, 3, 32, "fp32", "distinct", {"SWAP_AB": False, "BLOCK_M": 32}),
    "t40_fp32_e3_multiblock": (40, 96, 64, 3, 2, 32, "fp32", "distinct", {}),
    "t9_bf16_bn32_bn2_64": (9, 96, 96, 6, 2, 32, "bf16", "distinct", {"BLOCK_N": 32, "BLOCK_N2": 64}),
    # bf16x2 dequant (plain-Triton twin under the interpreter): masked, and EVEN tiles in both GEMMs
    "t5_bf16_x2_mixed_bn32": (5, 96, 64, 6, 3, 32, "bf16", "mixed", {"DEQUANT": "bf16x2", "BLOCK_N": 32,
                                                                     "BLOCK_N2": 64}),
    "t4_bf16_x2_even": (4, 256, 64, 5, 2, 32, "bf16", "distinct", {"DEQUANT": "bf16x2", "BLOCK_K": 64,
                                                                   "BLOCK_N": 32}),
    "t9_bf16_x2_noswap": (9, 96, 96, 6, 2, 32, "bf16", "distinct", {"DEQUANT": "bf16x2", "SWAP_AB": False,
                                                                    "BLOCK_N": 32}),
    # gate/up split over H: fp32 partials + the SwiGLU pass (uneven last split, masked tiles, bf16x2 order)
    "t5_fp32_split2_mixed": (5, 160, 64, 6, 3, 32, "fp32", "mixed", {"SPLIT_K": 2, "BLOCK_K": 64}),
    "t3_bf16_x2_split3": (3, 320, 96, 5, 2, 32, "bf16", "distinct", {"SPLIT_K": 3, "BLOCK_K": 64,
                                                                     "DEQUANT": "bf16x2", "BLOCK_N": 32}),
    # 8-row expert blocks (an expert with more pairs takes several blocks)
    "t11_bf16_x2_bm8_multiblock": (11, 96, 64, 3, 3, 32, "bf16", "distinct", {"BLOCK_M": 8, "DEQUANT": "bf16x2",
                                                                           "BLOCK_N": 32}),
    "t5_fp32_bm8_mixed": (5, 96, 64, 6, 3, 32, "fp32", "mixed", {"BLOCK_M": 8}),
    # down GEMM split over I: per-split router-weighted partials summed by the top-k pass (uneven last
    # split with masked tiles; EVEN splits with the bf16x2 order, together with the gate/up split)
    "t5_fp32_down_split2_mixed": (5, 96, 96, 6, 3, 32, "fp32", "mixed", {"SPLIT_K2": 2, "BLOCK_K": 64}),
    "t3_bf16_x2_down_split3": (3, 128, 192, 5, 2, 32, "bf16", "distinct", {"SPLIT_K2": 3, "SPLIT_K": 2,
                                                                          "BLOCK_K": 64, "DEQUANT": "bf16x2",
                                                                          "BLOCK_N": 32}),
    # plus an addend (the shared expert's output, at a row stride of its own) in the top-k sum
    "t5_fp32_add_down_split2_mixed": (5, 96, 96, 6, 3, 32, "fp32", "mixed", {"SPLIT_K2": 2, "BLOCK_K": 64,
                                                                             "add": True}),
    "t3_bf16_add": (3, 160, 64, 7, 3, 32, "bf16", "distinct", {"add": True}),
}


def _run_one(name, spec):
    from dataclasses import replace

    from kdtree_engine.kernels.moe_w4a16 import moe_config

    T, H, I, E, k, G, dt, ids_mode, over = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    x, w13p, w13s, w2p, w2s, ids, tw = make_moe(T, H, I, E, k, G, DT[dt], gen, ids_mode)
    over = dict(over)
    add = torch.randn(T, H + 5, generator=gen).to(x.dtype)[:, 2:H + 2] if over.pop("add", False) else None
    cfg = replace(moe_config(T * k, E), **over) if over else None
    y = fused_moe_w4a16(x, w13p, w13s, w2p, w2s, ids, tw, G, config=cfg, add=add)
    ref = fused_moe_reference(x, w13p, w13s, w2p, w2s, ids, tw, G)
    if add is not None:
        ref = (ref.float() + add.float()).to(x.dtype)
    return _interp.output_record(y, ref, y.dtype == x.dtype and tuple(y.shape) == (T, H)) | {"seed": seed}


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_fused_moe_interpreted(interp_results, name):
    _interp.assert_close(interp_results[name], TOL[CASES[name][6]])


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])


def test_down_split_is_checked_and_part_of_the_reduction_key():
    """SPLIT_K2 >= 1 (named when refused) and, as it changes how an output is summed, in the reduction key."""
    from kdtree_engine.kernels.moe_w4a16 import MoEConfig

    assert MoEConfig(SPLIT_K2=2).reduction_key() != MoEConfig().reduction_key()
    # 8-token blocks compile to another MMA kind on sm_90 (other bits): never mixed with 16+ in a table
    assert MoEConfig(BLOCK_M=8).reduction_key() != MoEConfig(BLOCK_M=16).reduction_key()
    assert MoEConfig(BLOCK_M=32).reduction_key() == MoEConfig(BLOCK_M=16).reduction_key()
    with pytest.raises(ValueError, match="SPLIT_K2"):
        MoEConfig(SPLIT_K2=0)
