"""Fused grouped MoE (BF16 / FP16 / FP8 experts): the Triton kernels under the interpreter (child process,
_interp.py) against the model's torch reference (model/moe.py moe_reference on the same weights), with
repeats, unowned (-1) pairs, several blocks per expert and the shared expert's addend; batch invariance
(a token alone gives the bits it has among all T tokens). The gate/up and down launches split along K (SPLIT_K,
SPLIT_K2): close to the unsplit result and the reference, batch-invariant, the same bits whether the tile's last
program or a second kernel sums the partials, and the arrival counters back at 0."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.config import preset  # noqa: E402
from kdtree_engine.fp8 import Fp8Block, quantize_fp8  # noqa: E402
from kdtree_engine.kernels import split_sum  # noqa: E402
from kdtree_engine.kernels.moe_grouped import GroupedConfig, fused_moe_grouped, fixed_split  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 2e-5, "fp16": 5e-3, "bf16": 2e-2}


def make_experts(H: int, I: int, E: int, dtype: torch.dtype, block: Fp8Block | None, gen: torch.Generator):
    """The model's Experts module (model/moe.py) with random weights: dense in dtype, or FP8."""
    from kdtree_engine.model.moe import Experts

    cfg = preset("k2-tiny").replace(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                    n_group=1, topk_group=1)
    ex = Experts(cfg, dtype=dtype, group_size=block, policy=KernelPolicy(dense="torch", int4="torch"))
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=gen) / I ** 0.5
    with torch.no_grad():
        if block is None:
            ex.w13.copy_(w13.to(dtype))
            ex.w2.copy_(w2.to(dtype))
        else:
            g, gs = quantize_fp8(w13[:, :I], block)
            u, us = quantize_fp8(w13[:, I:], block)
            ex.w13.copy_(torch.cat([g, u], 1))
            ex.w13_scale_inv.copy_(torch.cat([gs, us], 1))
            w, s = quantize_fp8(w2, block)
            ex.w2.copy_(w)
            ex.w2_scale_inv.copy_(s)
    return ex


CASES = {
    # name: (T, H, I, E, k, dtype, block or None, ids mode, add)
    "t1_fp32_dense": (1, 96, 64, 5, 2, "fp32", None, "distinct", False),
    "t5_bf16_dense_mixed_add": (5, 160, 64, 6, 3, "bf16", None, "mixed", True),
    "t20_fp16_dense_multiblock": (20, 64, 48, 3, 2, "fp16", None, "distinct", False),
    "t3_fp32_fp8_b32": (3, 96, 64, 5, 2, "fp32", (32, 32), "distinct", False),
    "t6_bf16_fp8_partial_blocks_add": (6, 80, 48, 4, 2, "bf16", (32, 32), "mixed", True),
    "t18_fp32_fp8_b16x64_multiblock": (18, 128, 32, 3, 2, "fp32", (16, 64), "distinct", False),
}


SPLIT_CASES = {
    # name: (T, H, I, E, k, dtype, block or None, ids mode, SPLIT_K, SPLIT_K2); 32-wide tiles (BLOCK_N, BLOCK_K):
    # several n tiles and K tiles, the last split shorter where H (I) is not a multiple of the split's range
    "split2_t1_fp32_fp8_b32": (1, 96, 64, 5, 2, "fp32", (32, 32), "distinct", 2, 1),
    "split3_t5_bf16_fp8_b32_mixed": (5, 160, 48, 6, 3, "bf16", (32, 32), "mixed", 3, 2),
    "split3_t1_fp16_fp8_b16x32": (1, 96, 64, 4, 3, "fp16", (16, 32), "distinct", 3, 2),
    "split2_t5_fp16_dense": (5, 160, 64, 4, 2, "fp16", None, "distinct", 2, 2),
    "split3_t5_bf16_dense_mixed": (5, 96, 48, 5, 3, "bf16", None, "mixed", 3, 1),
    "down3_t5_bf16_fp8_b32": (5, 96, 96, 4, 2, "bf16", (32, 32), "mixed", 1, 3),
}


def _routing(T, E, k, mode, gen):
    if mode == "distinct":
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    else:
        ids = torch.randint(-1, E, (T, k), generator=gen)
    return ids, torch.rand(T, k, generator=gen)


def _reference(x, ids, tw, ex):
    from kdtree_engine.model.moe import moe_reference

    valid = ids >= 0   # the reference has no unowned pairs: give them weight 0 on expert 0
    return moe_reference(x, torch.where(valid, ids, 0), torch.where(valid, tw, 0.0), ex)


def _draw(T, H, I, E, k, dt, blk, mode):
    """(seed, its generator, dtype, experts, x, ids, weights, the FP8 kwargs) of a fresh random case."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    dtype = DT[dt]
    block = Fp8Block(*blk) if blk else None
    ex = make_experts(H, I, E, dtype, block, gen)
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids, tw = _routing(T, E, k, mode, gen)
    kw = dict(w13_scale_inv=ex.w13_scale_inv, w2_scale_inv=ex.w2_scale_inv, block=block) if block else {}
    return seed, gen, dtype, ex, x, ids, tw, kw


def _run_one(name, spec):
    if name in SPLIT_CASES:
        return _run_split(spec)
    T, H, I, E, k, dt, blk, mode, with_add = spec
    seed, gen, dtype, ex, x, ids, tw, kw = _draw(T, H, I, E, k, dt, blk, mode)
    add = torch.randn(T, H + 3, generator=gen).to(dtype)[:, 1:H + 1] if with_add else None
    y = fused_moe_grouped(x, ex.w13, ex.w2, ids, tw, add=add, **kw)
    ref = _reference(x, ids, tw, ex)
    if add is not None:
        ref = (ref.float() + add.float()).to(dtype)
    rec = _interp.output_record(y, ref, y.dtype == dtype and tuple(y.shape) == (T, H)) | {"seed": seed}
    rec["row_bits"] = all(
        torch.equal(fused_moe_grouped(x[i:i + 1], ex.w13, ex.w2, ids[i:i + 1], tw[i:i + 1],
                                      add=None if add is None else add[i:i + 1], **kw), y[i:i + 1])
        for i in (0, T - 1))
    return rec


def _run_split(spec):
    T, H, I, E, k, dt, blk, mode, split, split2 = spec
    seed, _, dtype, ex, x, ids, tw, kw = _draw(T, H, I, E, k, dt, blk, mode)
    cfg = GroupedConfig(BLOCK_N=32, BLOCK_K=32, SPLIT_K=split, SPLIT_K2=split2)

    def run(xs, ids_, tw_, c=cfg):
        return fused_moe_grouped(xs, ex.w13, ex.w2, ids_, tw_, config=c, **kw)

    y = run(x, ids, tw)   # a few tiles: the arrival counters' path
    rec = _interp.output_record(y, _reference(x, ids, tw, ex), y.dtype == dtype and tuple(y.shape) == (T, H))
    rec |= {"seed": seed, "splits": (fixed_split(H, 32, split)[0], fixed_split(I, 32, split2)[0])}
    rec["counters_zero"] = all(int(c.abs().sum()) == 0 for c in split_sum._COUNTERS.values())
    y1 = run(x, ids, tw, GroupedConfig(BLOCK_N=32, BLOCK_K=32))
    rec["rel_unsplit"] = _interp.output_record(y, y1, True)["rel"]
    rec["row_bits"] = all(torch.equal(run(x[i:i + 1], ids[i:i + 1], tw[i:i + 1]), y[i:i + 1]) for i in range(T))
    keep = split_sum.SERIAL_TILES
    split_sum.SERIAL_TILES = 0   # no arrival counters: the partials summed by the second kernel
    try:
        rec["launch_sum_bits"] = torch.equal(run(x, ids, tw), y)
    finally:
        split_sum.SERIAL_TILES = keep
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES) + list(SPLIT_CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_grouped_moe_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.assert_close(rec, TOL[CASES[name][5]])
    assert rec["row_bits"], f"a token alone differs from the same token among {CASES[name][0]} (seed {rec['seed']})"


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_grouped_moe_split_k_interpreted(interp_results, name):
    rec = interp_results[name]
    T, dt, split = SPLIT_CASES[name][0], SPLIT_CASES[name][5], tuple(SPLIT_CASES[name][8:10])
    _interp.assert_close(rec, TOL[dt])
    assert tuple(rec["splits"]) == split, f"the case meant {split} splits, H and I give {rec['splits']}"
    assert rec["rel_unsplit"] < TOL[dt], f"relative error {rec['rel_unsplit']:.3g} from SPLIT_K=1 (seed {rec['seed']})"
    assert rec["row_bits"], f"a token alone differs from the same token among {T} (seed {rec['seed']})"
    assert rec["launch_sum_bits"], f"the second kernel's sums differ from the last programs' (seed {rec['seed']})"
    assert rec["counters_zero"], f"arrival counters not back at 0 (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES | SPLIT_CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])


def test_fixed_split_from_h_and_tile_only():
    # K2's gate/up (H = 7168, 56 tiles of 128): whole-tile ranges, the last one shorter where S does not divide
    assert fixed_split(7168, 128, 1) == (1, 7168)
    assert fixed_split(7168, 128, 2) == (2, 3584)
    assert fixed_split(7168, 128, 3) == (3, 2432)
    assert fixed_split(7168, 128, 4) == (4, 1792)
    assert fixed_split(160, 32, 3) == (3, 64)
    # fewer tiles than splits: no program with an empty range
    assert fixed_split(128, 128, 3) == (1, 128)
    assert fixed_split(96, 32, 4) == (3, 32)
    for H, bk, want in [(7168, 128, 3), (160, 32, 3), (96, 32, 4), (1000, 64, 5)]:
        s, ks = fixed_split(H, bk, want)
        assert ks % bk == 0 and (s - 1) * ks < H <= s * ks
    with pytest.raises(ValueError, match="SPLIT_K"):
        fixed_split(7168, 128, 0)


def test_refuses_bad_operands():
    gen = torch.Generator().manual_seed(1)
    ex = make_experts(64, 32, 4, torch.float32, Fp8Block(32, 32), gen)
    x = torch.randn(2, 64)
    ids = torch.tensor([[0, 1], [2, 3]])
    tw = torch.rand(2, 2)
    with pytest.raises(ValueError, match="w13_scale_inv"):
        fused_moe_grouped(x, ex.w13, ex.w2, ids, tw, block=Fp8Block(32, 32))
    with pytest.raises(ValueError, match="must both be"):
        fused_moe_grouped(x, ex.w13, ex.w2, ids[:, :1], tw, w13_scale_inv=ex.w13_scale_inv,
                          w2_scale_inv=ex.w2_scale_inv, block=Fp8Block(32, 32))
    dense = make_experts(64, 32, 4, torch.float32, None, gen)
    with pytest.raises(TypeError, match="x's dtype"):
        fused_moe_grouped(x.to(torch.bfloat16), dense.w13, dense.w2, ids, tw)
