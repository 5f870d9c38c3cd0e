"""Batch-invariant dense GEMM: configuration rules in process, and the Triton kernel under the
interpreter (in a child process, see _interp.py): accuracy against float64 at small odd shapes with
fresh random inputs and NaN-poisoned outputs, and bitwise batch invariance (a row computed alone
equals the same row computed inside launches of M = 2..129)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.gemm import (  # noqa: E402
    FP32_TILES, K2_CONFIGS, TILES_16BIT, TILES_FP32, Reduction, Tile, bi_linear, bi_linear_reference, reduction_for,
    tile_for)

DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error bounds against float64 on the same (rounded) inputs. The interpreter of triton 3.9 casts
# fp32 -> bf16 by truncation (the GPU rounds to nearest), hence the loose bf16 bound.
TOL = {"fp32": 2e-6, "fp16": 2e-3, "bf16": 1.5e-2}

K2_SHAPES = [(2112, 7168), (12288, 1536), (7168, 8192), (4096, 7168), (7168, 2048), (163840, 7168),
             (384, 7168)]


# ---------------------------------------------------------------------------------- in process


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reduction_depends_on_shape_only(dtype):
    for n, k in K2_SHAPES + [(5, 16), (33, 130), (100, 4096)]:
        red = reduction_for(n, k, dtype)
        assert red == reduction_for(n, k, dtype)
        assert red.split_k >= 1 and red.BLOCK_K >= 16 and red.BLOCK_K % 16 == 0
        kps = red.k_per_split(k)
        assert kps % red.BLOCK_K == 0
        # the splits cover K exactly once, none empty
        assert (red.n_splits(k) - 1) * kps < k <= red.n_splits(k) * kps


def test_tiles_are_valid_for_every_m():
    for table in (TILES_16BIT, TILES_FP32, *FP32_TILES.values()):
        assert table[-1][0] >= 1 << 40
        for _, t in table:
            assert t.BLOCK_M >= 16 and t.BLOCK_N >= 16 and t.num_warps in (1, 2, 4, 8, 16)
    for m in (1, 16, 17, 64, 65, 129, 256, 5000):
        assert tile_for(m, torch.bfloat16).BLOCK_M >= 16
    for red, tiles in K2_CONFIGS.values():
        assert isinstance(red, Reduction) and red.split_k >= 1


def test_head_tiles_by_shape():
    """The per-head GEMM takes its shape's bucket up to the bucket's M and the default buckets beyond (and for
    other shapes and float32)."""
    from kdtree_engine.kernels.gemm import HEAD_TILES, head_tile_for

    for (n, k), table in HEAD_TILES.items():
        for max_m, t in table:
            assert t.BLOCK_M >= 16 and t.BLOCK_N >= 16 and t.num_warps in (1, 2, 4, 8)
            assert head_tile_for(max_m, torch.bfloat16, n, k) == t
        last = table[-1][0]
        assert head_tile_for(last + 1, torch.bfloat16, n, k) == tile_for(last + 1, torch.bfloat16)
        assert head_tile_for(1, torch.float32, n, k) == tile_for(1, torch.float32)
    assert head_tile_for(1, torch.bfloat16, 3, 5) == tile_for(1, torch.bfloat16)


def test_rejects_bad_inputs():
    x = torch.randn(2, 16)
    with pytest.raises(TypeError):
        bi_linear(x, torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(TypeError):
        bi_linear(x.double(), torch.randn(4, 16).double())
    with pytest.raises(ValueError):
        bi_linear(x, torch.randn(4, 17))
    with pytest.raises(ValueError):
        bi_linear(x[None], torch.randn(4, 16))


def test_reference_matches_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 33, generator=g), torch.randn(9, 33, generator=g)
    ref = x.double() @ w.double().T
    got = bi_linear_reference(x, w).double()
    assert float((got - ref).norm() / ref.norm()) < 1e-6


# ---------------------------------------------------------------------------------- interpreter

# name: (M, N, K, dtype, options)
CASES: dict[str, tuple] = {}
# every (M, N), (M, K) and (N, K) pair of M in {1, 3, 17, 64}, N in {5, 33, 100}, K in {16, 48, 130}
for _i, _m in enumerate((1, 3, 17, 64)):
    for _j, _n in enumerate((5, 33, 100)):
        _k = (16, 48, 130)[(_i + _j) % 3]
        CASES[f"acc_fp32_m{_m}_n{_n}_k{_k}"] = (_m, _n, _k, "fp32", {})
CASES.update({
    "acc_bf16_m3_n33_k130": (3, 33, 130, "bf16", {}),
    "acc_bf16_m65_n100_k48_bigtile": (65, 100, 48, "bf16", {}),
    "acc_fp16_m17_n100_k130": (17, 100, 130, "fp16", {}),
    "acc_fp32_auto_split": (5, 40, 520, "fp32", {"expect_split": True}),
    "acc_fp32_forced_split3_bk16": (6, 33, 130, "fp32", {"reduction": (16, 3)}),
    "acc_bf16_forced_split5": (17, 20, 200, "bf16", {"reduction": (32, 5)}),
    "acc_fp32_noncontig": (7, 33, 130, "fp32", {"noncontig": True}),
    "acc_fp32_tl_dot": (17, 33, 130, "fp32", {"interp": "dot"}),
    "acc_bf16_tl_dot_split": (3, 33, 300, "bf16", {"interp": "dot", "reduction": (32, 2)}),
    # bitwise: rows alone (M = 1) vs inside launches of M = 2..129
    "inv_fp32_default": (129, 33, 130, "fp32", {"invariance": True}),
    "inv_fp32_split3_any_tile": (129, 50, 200, "fp32", {"invariance": True, "reduction": (32, 3), "tiles": True}),
    "inv_bf16_split2": (129, 33, 200, "bf16", {"invariance": True, "reduction": (32, 2)}),
    # the split partials summed by each tile's last program (arrival counters) == the split_sum launch, bit for bit
    "inv_bf16_split3_serial": (129, 50, 300, "bf16", {"invariance": True, "reduction": (32, 3), "serial": True}),
    "inv_fp32_split5_serial": (129, 33, 200, "fp32", {"invariance": True, "reduction": (16, 5), "serial": True}),
})

# per-head GEMM (bi_head_linear, the MLA absorption): name: (M, N, K, dtype, options with "heads")
CASES.update({
    "head_acc_fp32_m5_b3_n33_k17": (5, 33, 17, "fp32", {"heads": 3}),
    "head_acc_fp32_m17_b2_n7_k130_wt": (17, 7, 130, "fp32", {"heads": 2, "w_transposed": True}),
    "head_acc_bf16_m3_b3_n20_k48_xslice": (3, 20, 48, "bf16", {"heads": 3, "x_slice": True, "w_transposed": True}),
    "head_acc_fp32_split3": (6, 9, 100, "fp32", {"heads": 2, "reduction": (16, 3)}),
    "head_inv_fp32": (129, 19, 33, "fp32", {"heads": 3, "invariance": True, "w_transposed": True,
                                            "x_slice": True}),
    "head_inv_bf16_split2": (129, 12, 40, "bf16", {"heads": 2, "invariance": True, "reduction": (16, 2),
                                                    "serial": True}),
})


def _split_sum_launch(fn):
    """fn() with every split launch summing its partials in the second kernel (no arrival counters)."""
    from kdtree_engine.kernels import split_sum as sums
    keep = sums.SERIAL_TILES
    sums.SERIAL_TILES = 0
    try:
        return fn()
    finally:
        sums.SERIAL_TILES = keep


def _serial_check(opt, y, fn) -> list[str]:
    """The serial sum's output y against the split_sum launch's (opt "serial"), and the counters back at 0."""
    from kdtree_engine.kernels import split_sum as sums
    if not opt.get("serial"):
        return []
    bad = [] if torch.equal(_split_sum_launch(fn), y) else ["the last arrivals' sums differ from split_sum's"]
    if any(int(c.abs().sum()) for c in sums._COUNTERS.values()):
        bad.append("arrival counters not back at 0")
    if not sums._COUNTERS:
        bad.append("no arrival counters were used")
    return bad

_INV_M = (2, 3, 17, 33, 64, 65, 129)
_INV_ROWS = (0, 1, 16, 31, 64, 128)


def _inputs(M, N, K, dt, gen, noncontig=False):
    x = torch.randn(M, 2 * K if noncontig else K, generator=gen).to(DT[dt])
    w = torch.randn(K if noncontig else N, N if noncontig else K, generator=gen).to(DT[dt])
    if noncontig:
        x = x[:, ::2]   # row stride 2K, k stride 2
        w = w.T         # [N, K] with k stride N
    return x, w


def _head_inputs(M, B, N, K, dt, gen, x_slice, w_transposed):
    """x [M, B, K] (optionally the first K of a wider last dim, as q_nope is of q), w [B, N, K]
    (optionally a transposed view of a [B, K, N] tensor, as W_UK is stored)."""
    x = torch.randn(M, B, K + 5 if x_slice else K, generator=gen).to(DT[dt])[..., :K]
    w = torch.randn(B, K, N, generator=gen).to(DT[dt]).transpose(1, 2) if w_transposed else \
        torch.randn(B, N, K, generator=gen).to(DT[dt])
    return x, w


def _run_head(M, N, K, dt, opt, gen, red):
    from kdtree_engine.kernels.gemm import bi_head_linear, head_reduction_for

    B = opt["heads"]
    x, w = _head_inputs(M, B, N, K, dt, gen, opt.get("x_slice", False), opt.get("w_transposed", False))
    y = bi_head_linear(x, w, reduction=red)
    serial = _serial_check(opt, y, lambda: bi_head_linear(x, w, reduction=red))
    ref = torch.einsum("mbk,bnk->mbn", x.double(), w.double())
    rec = {"ok_meta": y.dtype == x.dtype and tuple(y.shape) == (M, B, N) and y.is_contiguous(),
           "nonfinite": int((~torch.isfinite(y)).sum()),
           "rel": float((y.double() - ref).norm() / ref.norm())}
    bad = serial
    # each head equals the plain GEMM of that head with the same reduction, bit for bit
    red_b = red or head_reduction_for(N, K, x.dtype)
    for b in range(B):
        if not torch.equal(y[:, b], bi_linear(x[:, b], w[b], reduction=red_b)):
            bad.append(f"head {b} differs from bi_linear of that head")
    if opt.get("invariance"):
        alone = {i: bi_head_linear(x[i:i + 1], w, reduction=red)[0] for i in _INV_ROWS}
        for j, m in enumerate(_INV_M):
            tile = Tile(16, 16, 2, 2) if j % 2 else None
            ym = bi_head_linear(x[:m], w, reduction=red, tile=tile)
            if not torch.equal(ym, y[:m]):
                bad.append(f"M={m} differs from M={M} on shared rows")
            for i in _INV_ROWS:
                if i < m and not torch.equal(ym[i], alone[i]):
                    bad.append(f"row {i}: M={m} != M=1")
    return rec | {"bad": bad[:10]}


def _run_shared(M, N, K, dt, opt, gen, red):
    """bi_shared_x_partials: one x against B weights, partials [B * S, M, N] left unsummed."""
    from kdtree_engine.kernels.gemm import bi_shared_x_partials

    B = opt["shared"]
    x = torch.randn(M, K, generator=gen).to(DT[dt])
    w = (torch.randn(B, N, K, generator=gen) * K ** -0.5).to(DT[dt])
    part = bi_shared_x_partials(x, w, red)
    S = red.n_splits(K)
    rec = {"ok_meta": part.dtype == torch.float32 and tuple(part.shape) == (B * S, M, N),
           "nonfinite": int((~torch.isfinite(part)).sum()), "rel": 0.0}
    bad = []
    for b in range(B):
        acc = part[b * S].clone()
        for k in range(1, S):
            acc += part[b * S + k]
        ref = x.double() @ w[b].double().T
        rec["rel"] = max(rec["rel"], float((acc.double() - ref).norm() / ref.norm()))
        # head b's partials added in split order are bi_linear's float32 sum of that head (before its rounding)
        if not opt.get("no_head_bits") and not torch.equal(acc.to(x.dtype), bi_linear(x, w[b], reduction=red)):
            bad.append(f"head {b}: its partials' sum differs from bi_linear of that head")
    alone = {i: bi_shared_x_partials(x[i:i + 1], w, red)[:, 0] for i in _INV_ROWS if i < M}
    for m in _INV_M:
        if m <= M:
            pm = bi_shared_x_partials(x[:m], w, red)
            if not torch.equal(pm, part[:, :m]):
                bad.append(f"M={m} differs from M={M} on shared rows")
            bad += [f"row {i}: M={m} != M=1" for i in alone if i < m and not torch.equal(pm[:, i], alone[i])]
    return rec | {"bad": bad[:10]}


def _run_one(name, spec):
    M, N, K, dt, opt = spec
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; reported on failure
    gen = torch.Generator().manual_seed(seed)
    red = Reduction(*opt["reduction"]) if "reduction" in opt else None
    dot = opt.get("interp") == "dot"
    if "heads" in opt:
        return _run_head(M, N, K, dt, opt, gen, red) | {"seed": seed}
    if "shared" in opt:
        return _run_shared(M, N, K, dt, opt, gen, red) | {"seed": seed}
    x, w = _inputs(M, N, K, dt, gen, opt.get("noncontig", False))
    if not opt.get("invariance"):
        y = bi_linear(x, w, reduction=red, interp_dot=dot)
        rec = _interp.output_record(y, x.double() @ w.double().T, y.dtype == x.dtype and tuple(y.shape) == (M, N))
        rec["split"] = (red or reduction_for(N, K, x.dtype)).n_splits(K)
        return rec | {"seed": seed}
    # invariance: each sampled row alone, then every launch size; all launches also agree with
    # the largest one on every row they share
    tiles = [None]
    if opt.get("tiles"):
        tiles = [Tile(16, 64, 4, 2), Tile(32, 32, 2, 3), Tile(64, 64, 4, 4), Tile(128, 128, 8, 2)]
    alone = {}
    for i in _INV_ROWS:
        alone[i] = bi_linear(x[i:i + 1], w, reduction=red, tile=tiles[i % len(tiles)])
    big = bi_linear(x, w, reduction=red)
    bad = _serial_check(opt, big, lambda: bi_linear(x, w, reduction=red))
    for j, m in enumerate(_INV_M):
        y = bi_linear(x[:m], w, reduction=red, tile=tiles[j % len(tiles)])
        if not torch.equal(y, big[:m]):
            bad.append(f"M={m} differs from M={M} on shared rows")
        for i in _INV_ROWS:
            if i < m and not torch.equal(y[i], alone[i][0]):
                bad.append(f"row {i}: M={m} != M=1")
    ref = x.double() @ w.double().T
    return {"ok_meta": True, "nonfinite": int((~torch.isfinite(big)).sum()), "bad": bad[:10],
            "rel": float((big.double() - ref).norm() / ref.norm()), "seed": seed}


# one activation against B weights, split partials unsummed (bi_shared_x_partials: the bf16x3 router's launch)
CASES.update({
    "shared_fp16_b3_split3": (70, 20, 300, "fp16", {"shared": 3, "reduction": (32, 3)}),
    "shared_fp16_b2_one_split": (9, 33, 100, "fp16", {"shared": 2, "reduction": (128, 4)}),
    # bf16: accuracy and invariance (the interpreter rounds split_sum's bf16 output its own way, so no bit check
    # against bi_linear there; on CUDA both round to nearest)
    "shared_bf16_b3_split3": (70, 20, 300, "bf16", {"shared": 3, "reduction": (32, 3), "no_head_bits": True}),
})

import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("acc_")])
def test_kernel_accuracy_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.assert_close(rec, TOL[CASES[name][3]])
    if CASES[name][4].get("expect_split"):
        assert rec["split"] > 1


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("inv_")])
def test_kernel_batch_invariant_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["nonfinite"] == 0
    assert rec["rel"] < TOL[CASES[name][3]], f"seed {rec['seed']}"
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("head_")])
def test_head_kernel_interpreted(interp_results, name):
    """Per-head GEMM: accuracy, each head equal to bi_linear of that head, and (inv cases) rows alone
    equal to the same rows inside launches of M = 2..129, bit for bit."""
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["ok_meta"]
    tol = TOL[CASES[name][3]]
    assert rec["rel"] < tol, f"relative error {rec['rel']:.3g} >= {tol} (seed {rec['seed']})"
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("shared_")])
def test_shared_x_partials_interpreted(interp_results, name):
    """One activation against B weights: each head's partials, added in split order, are bi_linear's sum of that head
    (bit for bit after its rounding) and within float32 accuracy of float64; rows alone == rows of M = 2..70."""
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["ok_meta"] and rec["nonfinite"] == 0, f"seed {rec['seed']}"
    assert rec["rel"] < 2e-6, f"relative error {rec['rel']:.3g} (seed {rec['seed']})"
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


def test_shared_x_partials_rejects_bad_inputs():
    from kdtree_engine.kernels.gemm import bi_shared_x_partials

    red = Reduction(128, 2)
    with pytest.raises(ValueError, match="same K"):
        bi_shared_x_partials(torch.randn(2, 16).bfloat16(), torch.randn(3, 4, 17).bfloat16(), red)
    with pytest.raises(TypeError, match="16-bit"):
        bi_shared_x_partials(torch.randn(2, 16), torch.randn(3, 4, 16), red)
    with pytest.raises(TypeError, match="one dtype"):
        bi_shared_x_partials(torch.randn(2, 16).bfloat16(), torch.randn(3, 4, 16).half(), red)


def test_head_rejects_bad_inputs():
    from kdtree_engine.kernels.gemm import bi_head_linear

    with pytest.raises(ValueError):
        bi_head_linear(torch.randn(2, 3, 16), torch.randn(2, 4, 16))       # head counts differ
    with pytest.raises(ValueError):
        bi_head_linear(torch.randn(2, 3, 16), torch.randn(3, 4, 17))       # K differs
    with pytest.raises(TypeError):
        bi_head_linear(torch.randn(2, 3, 16), torch.randn(3, 4, 16).double())
    with pytest.raises(ValueError):
        bi_head_linear(torch.randn(2, 16), torch.randn(3, 4, 16))


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
