"""Absorbed MLA attention: the Triton kernel under the interpreter (child process, see _interp.py) vs
the torch reference at small odd shapes, causal and random-tree masks; batch invariance bit for bit
(a query alone, T = 1 over its visible set, equals its rows inside the larger launch)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import triton

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.mla_attention import (MLAConfig, mla_attention, mla_attention_device,  # noqa: E402
                                                 tree_gather_index)
from kdtree_engine import logs  # noqa: E402
from kdtree_engine.kernels.reference import mla_attention_reference  # noqa: E402

C, R = 32, 16


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree with parent[i] < i (node 0 the root)."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        if i:
            parent = int(torch.randint(0, i, (1,), generator=gen))
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_inputs(T, N, S, gen, dtype=torch.float32):
    q_lat = torch.randn(T, N, C, generator=gen).to(dtype)
    q_pe = torch.randn(T, N, R, generator=gen).to(dtype)
    kv = torch.randn(S + T, C + R, generator=gen).to(dtype)
    return q_lat, q_pe, kv


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------- in process


def test_tree_gather_index():
    g = torch.Generator().manual_seed(3)
    m = random_tree_mask(9, g)
    idx, nvis = tree_gather_index(m)
    for i in range(9):
        want = torch.nonzero(m[i]).flatten().tolist()
        assert nvis[i] == len(want)
        assert idx[i, : len(want)].tolist() == want
        assert want[-1] == i  # self last: the path order plain decoding commits


def test_rejects_bad_inputs():
    q_lat, q_pe, kv = make_inputs(3, 2, 5, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError):
        mla_attention(q_lat, q_pe, kv[:-1], 5, None, 0.1, C)  # kv rows != S + T
    with pytest.raises(ValueError):
        mla_attention(q_lat, q_pe, kv, 5, None, 0.1, C + 1)
    with pytest.raises(ValueError):
        mla_attention(q_lat, q_pe[:, :, :-1], kv, 5, None, 0.1, C)  # C + R != kv width
    with pytest.raises(ValueError):
        mla_attention(q_lat, q_pe, kv, 5, torch.ones(3, 2, dtype=torch.bool), 0.1, C)
    with pytest.raises(ValueError):
        mla_attention(q_lat, q_pe, kv, 5, torch.ones(3, 3), 0.1, C)  # not bool
    with pytest.raises(ValueError):
        mla_attention(q_lat.transpose(1, 2).contiguous().transpose(1, 2), q_pe, kv, 5, None, 0.1, C)
    with pytest.raises(TypeError):
        mla_attention(q_lat.double(), q_pe, kv, 5, None, 0.1, C)


# ---------------------------------------------------------------------------------- interpreter

# Configs for the interpreter: small chunks so that a few dozen keys cross chunk boundaries (the GPU
# default is CHUNK=512); the interpreter is slow per op, so S = 300 runs with larger blocks.
CONFIGS = {
    "c32": MLAConfig(CHUNK=32, BLOCK_M=16, BLOCK_N=16, num_stages=1),
    "c64": MLAConfig(CHUNK=64, BLOCK_M=16, BLOCK_N=32, num_stages=1),
    "c128": MLAConfig(CHUNK=128, BLOCK_M=16, BLOCK_N=64, num_stages=1),
    "vsplit": MLAConfig(CHUNK=64, BLOCK_M=16, BLOCK_N=32, V_SPLIT=2, num_stages=1),
    "default": None,
    # decode launches re-tiled: 16-row tiles for T = 1, 32-row tiles otherwise (row sums by the MMA)
    "decbm": MLAConfig(CHUNK=32, BLOCK_M=32, BLOCK_N=16, L_BY_DOT=True, DECODE_BLOCK_M=16, num_stages=1),
    "decw": MLAConfig(CHUNK=32, BLOCK_M=32, BLOCK_N=16, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_WARPS=2,
                      num_stages=1),
    # launches of up to 4 queries on the decode tiles (16 rows), column slices sized by DECODE_MIN_PROGRAMS
    "decmaxt": MLAConfig(CHUNK=32, BLOCK_M=32, BLOCK_N=16, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_MAX_T=4,
                         DECODE_MIN_PROGRAMS=64, num_stages=1),
    # ... on the small trees' own tiles (16 rows; the T = 1 launch keeps its 32)
    "smallbm": MLAConfig(CHUNK=32, BLOCK_M=64, BLOCK_N=16, L_BY_DOT=True, DECODE_BLOCK_M=32, DECODE_MAX_T=4,
                         SMALL_BLOCK_M=16, SMALL_WARPS=8, num_stages=1),
}

# name: (kind, N, S, T, mask, config, variant)
CASES: dict[str, tuple] = {}
for _S, _cfg in ((0, "c32"), (1, "c64"), (37, "c32")):
    for _T in (1, 5, 17):
        for _mask in ("causal", "tree"):
            if _T == 1 and _mask == "tree":
                continue
            CASES[f"N3_S{_S}_T{_T}_{_mask}_{_cfg}"] = ("ref", 3, _S, _T, _mask, _cfg, "")
for _T, _mask, _cfg in ((1, "causal", "c128"), (5, "tree", "c128"), (17, "causal", "c128"), (13, "tree", "c128"),
                        (9, "causal", "default"), (5, "tree", "default")):
    CASES[f"N4_S300_T{_T}_{_mask}_{_cfg}"] = ("ref", 4, 300, _T, _mask, _cfg, "")
CASES["N4_S37_T5_tree_c64"] = ("ref", 4, 37, 5, "tree", "c64", "")
CASES["N4_S100_T9_tree_vsplit"] = ("ref", 4, 100, 9, "tree", "vsplit", "")
CASES["N3_S100_T9_causal_vsplit"] = ("ref", 3, 100, 9, "causal", "vsplit", "")
CASES["N3_S37_T5_tree_noncontig"] = ("ref", 3, 37, 5, "tree", "c32", "noncontig")
CASES["N3_S37_T5_tree_bf16"] = ("ref", 3, 37, 5, "tree", "c32", "bf16")
CASES["inv_N4_S70_T13_tree"] = ("inv", 4, 70, 13, "tree", "c32", "")
CASES["inv_N3_S45_T11_tree"] = ("inv", 3, 45, 11, "tree", "c32", "")
CASES["inv_N4_S61_T7_causal"] = ("inv", 4, 61, 7, "causal", "c32", "")
CASES["inv_N20_S50_T6_tree_vsplit"] = ("inv", 20, 50, 6, "tree", "vsplit", "")
CASES["inv_N20_S45_T5_tree_decbm"] = ("inv", 20, 45, 5, "tree", "decbm", "")  # alone: 16-row tiles
CASES["inv_N6_S45_T5_tree_decw"] = ("inv", 6, 45, 5, "tree", "decw", "")
CASES["inv_N20_S45_T7_tree_decmaxt"] = ("inv", 20, 45, 7, "tree", "decmaxt", "")  # alone / first 4: decode tiles
CASES["N20_S45_T4_tree_decmaxt"] = ("ref", 20, 45, 4, "tree", "decmaxt", "")
CASES["inv_N20_S45_T7_tree_smallbm"] = ("inv", 20, 45, 7, "tree", "smallbm", "")

# device-side length: the whole buffer (junk past S + T) and start as a tensor == the host-length launch
CASES["dev_N3_S37_T5_tree_c32"] = ("dev", 3, 37, 5, "tree", "c32", "")
CASES["dev_N4_S64_T9_tree_c32"] = ("dev", 4, 64, 9, "tree", "c32", "")
CASES["dev_N3_S0_T5_tree_c32"] = ("dev", 3, 0, 5, "tree", "c32", "")
CASES["dev_N3_S20_T1_causal_c32"] = ("dev", 3, 20, 1, "causal", "c32", "")
CASES["dev_N4_S100_T9_tree_vsplit"] = ("dev", 4, 100, 9, "tree", "vsplit", "")
CASES["dev_N20_S50_T3_tree_decmaxt"] = ("dev", 20, 50, 3, "tree", "decmaxt", "")
# T = 1 (the root alone) runs the causal launch on the device; the host-length tree launch is the oracle
CASES["dev_N3_S37_T1_tree_c32"] = ("dev", 3, 37, 1, "tree", "c32", "")
CASES["dev_N20_S70_T1_tree_decmaxt"] = ("dev", 20, 70, 1, "tree", "decmaxt", "")
CASES["dev_N4_S20_T1_tree_c64"] = ("dev", 4, 20, 1, "tree", "c64", "")   # one chunk: the direct write

# paged cache: the same launches reading a pool of shuffled, non-contiguous pages through a block table (junk in
# the pages the table does not name) == the contiguous launch bit for bit, host and device length; variant = page
CASES["paged_N3_S37_T5_tree_c32_p16"] = ("paged", 3, 37, 5, "tree", "c32", "16")
CASES["paged_N4_S100_T9_causal_c64_p16"] = ("paged", 4, 100, 9, "causal", "c64", "16")
CASES["paged_N3_S20_T1_causal_c32_p8"] = ("paged", 3, 20, 1, "causal", "c32", "8")
CASES["paged_N20_S45_T4_tree_decmaxt_p16"] = ("paged", 20, 45, 4, "tree", "decmaxt", "16")

# merge tiles are bit-neutral (merge_tiles): per row, random chunk partials; trees of 8..64 chunks and
# 8..32 columns give the same bits for rows whose chunks fit the smaller tree, and the column tile never
# matters; also checked against the float64 merge formula
CASES["merge_tiles"] = ("merge", 0, 0, 0, "", "", "")

# the merge of several requests' slots in one launch (TS queries a slot, each slot its own device length) == each
# slot's own merge launch, bit for bit
CASES["merge_slots"] = ("merge_slots", 2, 0, 2, "", "", "")

TOL = {"fp32": 2e-5, "bf16": 2e-2}


def _run_merge(N, S, T, mask_kind, cfg_name, variant, gen):
    from kdtree_engine.kernels.mla_attention import _mla_merge_kernel
    rows, n_ch, chunk, CC = 6, 40, 4, 24
    po = torch.randn(rows, n_ch, CC, generator=gen)
    pl = 3 * torch.randn(rows, n_ch, generator=gen)
    po[:, 28:] = float("nan")   # chunks no row reaches (at most 27): read only by EARLY's first blocks, masked by where
    pl[:, 28:] = float("nan")
    nvis = torch.zeros(1, dtype=torch.int32)
    # causal rows t = 0..5 with S = 3 and CHUNK 4: L = 4..9 keys -> 1..3 chunks (small); a second launch
    # with S = 100: L = 101..106 -> 26..27 chunks (only the 32- and 64-chunk trees cover them)
    outs = {}
    for S_, blocks in ((3, (4, 8, 16, 32, 64)), (100, (32, 64))):
        for bc in blocks:
            for bd in (8, 16, 32):
                # the next block's loads issued early (pre), the first blocks' loads beside the row's length
                # loads (early): same bits
                for pre, early in ((False, False), (True, False), (False, True), (True, True)):
                    if (pre or early) and bd != 16:
                        continue
                    out = torch.empty(rows, 1, CC)
                    _mla_merge_kernel[(rows, triton.cdiv(CC, bd))](
                        po, pl, nvis, out, nvis, S_, 1, n_ch, rows, po.stride(0), po.stride(1), pl.stride(0),
                        out.stride(0), out.stride(1), C=CC, BLOCK_D=bd, BLOCK_C=bc, CHUNK=chunk, CAUSAL=True,
                        LSE_BLOCK=16, PREFETCH=pre, EARLY=early, num_warps=1)
                    outs[(S_, bc, bd, pre, early)] = out[:, 0]
    equal = all(torch.equal(v, outs[(k[0], 64, 32, False, False)]) for k, v in outs.items())
    worst = 0.0
    for S_ in (3, 100):
        for r in range(rows):
            k = -(-(S_ + r + 1) // chunk)
            w = torch.exp2(pl[r, :k].double() - pl[r, :k].double().max())
            ref = (w[:, None] * po[r, :k].double()).sum(0) / w.sum()
            worst = max(worst, float((outs[(S_, 64, 32, False, False)][r].double() - ref).abs().max()))
    return {"equal": equal, "worst": worst, "nonfinite": sum(int((~torch.isfinite(v)).sum()) for v in outs.values())}


def _run_merge_slots(N, S, T, mask_kind, cfg_name, variant, gen):
    from kdtree_engine.kernels.mla_attention import _merge
    B, n_ch, chunk, CC = 3, 12, 4, 24
    rows = B * T * N
    po = torch.randn(rows, n_ch, CC, generator=gen)
    pl = 3 * torch.randn(rows, n_ch, generator=gen)
    starts = torch.randint(0, n_ch * chunk - T, (B,), generator=gen)
    strides = (po.stride(0), po.stride(1), pl.stride(0))
    whole = torch.empty(B * T, N, CC)
    _merge(po, pl, starts, whole, starts, 0, N, n_ch, strides, CC, chunk, True, True, slots=B)
    equal = True
    for b in range(B):
        r0, r1 = b * T * N, (b + 1) * T * N
        one = torch.empty(T, N, CC)
        _merge(po[r0:r1], pl[r0:r1], starts[b:b + 1], one, starts[b:b + 1], 0, N, n_ch, strides, CC, chunk, True,
               True)
        equal &= torch.equal(one, whole[b * T:(b + 1) * T])
    return {"equal": bool(equal), "nonfinite": int((~torch.isfinite(whole)).sum())}


def _run_dev(N, S, T, mask_kind, cfg_name, variant, gen):
    cfg = CONFIGS[cfg_name]
    q_lat, q_pe, kv = make_inputs(T, N, S, gen)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if mask_kind == "causal" else random_tree_mask(T, gen)
    buf = torch.cat([kv, 1e3 * torch.randn(45, C + R, generator=gen)])  # junk past S + T must not matter
    host = mla_attention(q_lat, q_pe, kv, S, mask, 0.3, C, config=cfg)
    dev = mla_attention_device(q_lat, q_pe, buf, torch.tensor(S), mask, 0.3, C, config=cfg)
    return {"equal": bool(torch.equal(host, dev)), "maxdiff": float((host - dev).abs().max()),
            "nonfinite": int((~torch.isfinite(dev)).sum())}


def _run_paged(N, S, T, mask_kind, cfg_name, variant, gen):
    cfg, page = CONFIGS[cfg_name], int(variant)
    q_lat, q_pe, kv = make_inputs(T, N, S, gen)
    tree = torch.ones(T, T, dtype=torch.bool).tril() if mask_kind == "causal" else random_tree_mask(T, gen)
    mask = None if mask_kind == "causal" else tree
    pages = -(-(S + T) // page)
    pool = 1e3 * torch.randn(pages + 3, page, C + R, generator=gen)  # junk in the pages the table skips
    table = torch.randperm(pages + 3, generator=gen)[:pages].to(torch.int32)
    flat = pool[table.long()].reshape(pages * page, C + R)
    flat[: S + T] = kv
    pool[table.long()] = flat.view(pages, page, C + R)
    host = mla_attention(q_lat, q_pe, kv, S, mask, 0.3, C, config=cfg)
    host_p = mla_attention(q_lat, q_pe, pool, S, mask, 0.3, C, config=cfg, table=table)
    dev = mla_attention_device(q_lat, q_pe, flat, torch.tensor(S), tree, 0.3, C, config=cfg)
    dev_p = mla_attention_device(q_lat, q_pe, pool, torch.tensor(S), tree, 0.3, C, config=cfg, table=table,
                                 capacity=pages * page)
    ref = mla_attention_reference(q_lat.double(), q_pe.double(), kv.double(), S, mask, 0.3, C)
    return {"host_equal": bool(torch.equal(host, host_p)), "dev_equal": bool(torch.equal(dev, dev_p)),
            "rel": rel(host_p, ref), "nonfinite": int((~torch.isfinite(host_p)).sum() + (~torch.isfinite(dev_p)).sum())}


def _run_ref(N, S, T, mask_kind, cfg_name, variant, gen):
    dtype = torch.bfloat16 if variant == "bf16" else torch.float32
    q_lat, q_pe, kv = make_inputs(T, N, S, gen, dtype)
    if variant == "noncontig":  # strided T/N views and a cache slice of a wider buffer
        q_lat = torch.randn(N, T, C, generator=gen).transpose(0, 1)
        big = torch.randn(S + T + 5, C + R, generator=gen)
        kv = big[: S + T]
    mask = None if mask_kind == "causal" else random_tree_mask(T, gen)
    scale = 0.3
    out = mla_attention(q_lat, q_pe, kv, S, mask, scale, C, config=CONFIGS[cfg_name])
    ref = mla_attention_reference(q_lat.double(), q_pe.double(), kv.double(), S, mask, scale, C)
    return {"rel": rel(out, ref), "nonfinite": int((~torch.isfinite(out)).sum()),
            "dtype_ok": out.dtype == dtype and tuple(out.shape) == (T, N, C), "dtype": str(dtype)}


def _run_inv(N, S, T, mask_kind, cfg_name, variant, gen):
    """Every query alone (T = 1 over prefix + its visible new slots, compacted) == its rows in the batch."""
    cfg = CONFIGS[cfg_name]
    q_lat, q_pe, kv = make_inputs(T, N, S, gen)
    mask = torch.ones(T, T, dtype=torch.bool).tril() if mask_kind == "causal" else random_tree_mask(T, gen)
    scale = 0.25
    full = mla_attention(q_lat, q_pe, kv, S, None if mask_kind == "causal" else mask, scale, C, config=cfg)
    bad, worst = [], 0.0
    for i in range(T):
        path = torch.nonzero(mask[i]).flatten()
        kv_i = torch.cat([kv[:S], kv[S + path]])
        one = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv_i, S + len(path) - 1, None, scale, C, config=cfg)
        if not torch.equal(one[0], full[i]):
            bad.append(i)
            worst = max(worst, float((one[0] - full[i]).abs().max()))
    # a sub-batch: the first half of the queries (their masks restricted) equals the full launch too
    h = (T + 1) // 2
    sub = mla_attention(q_lat[:h], q_pe[:h], kv[: S + h], S, None if mask_kind == "causal" else
                        mask[:h, :h].contiguous(), scale, C, config=cfg)
    return {"bad": bad, "worst": worst, "sub_equal": bool(torch.equal(sub, full[:h])),
            "nonfinite": int((~torch.isfinite(full)).sum())}


def _run_one(name, spec):
    kind, N, S, T, mask_kind, cfg_name, variant = spec
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; reported on failure
    gen = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    rec = {"ref": _run_ref, "inv": _run_inv, "dev": _run_dev, "merge": _run_merge, "paged": _run_paged,
           "merge_slots": _run_merge_slots}[kind](
        N, S, T, mask_kind, cfg_name, variant, gen)
    rec["seed"] = seed
    rec["secs"] = round(time.perf_counter() - t0, 2)
    return rec


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == "ref"])
def test_kernel_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["dtype_ok"]
    tol = TOL["bf16" if "bfloat16" in rec["dtype"] else "fp32"]
    assert rec["rel"] < tol, f"relative error {rec['rel']:.3g} >= {tol} (seed {rec['seed']})"


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == "paged"])
def test_paged_equals_contiguous_interpreted(interp_results, name):
    r = interp_results[name]
    assert "error" not in r, r
    print(f"{name}: seed {r['seed']}")
    assert r["host_equal"] and r["dev_equal"] and r["nonfinite"] == 0, r
    assert r["rel"] < TOL["fp32"], r


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == "inv"])
def test_batch_invariant_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["nonfinite"] == 0
    assert not rec["bad"], f"queries {rec['bad']} differ alone vs batched (max {rec['worst']:.3g}, seed {rec['seed']})"
    assert rec["sub_equal"], f"a sub-batch differs from the full launch (seed {rec['seed']})"


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == "dev"])
def test_device_length_equals_host_length_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["nonfinite"] == 0
    assert rec["equal"], f"device-length launch differs (max {rec['maxdiff']:.3g}, seed {rec['seed']})"


def test_merge_tiles_are_bit_neutral_interpreted(interp_results):
    rec = interp_results["merge_tiles"]
    _interp.check_ran(rec)
    assert rec["nonfinite"] == 0
    assert rec["equal"], f"merge tiles changed a row's bits (seed {rec['seed']})"
    assert rec["worst"] < 1e-5, f"merge differs from the float64 formula by {rec['worst']:.3g} (seed {rec['seed']})"


def test_merge_of_slots_equals_their_own_merges_interpreted(interp_results):
    rec = interp_results["merge_slots"]
    _interp.check_ran(rec)
    print(f"merge_slots: seed {rec['seed']}")
    assert rec["nonfinite"] == 0
    assert rec["equal"], f"a slot's merged rows differ from its own merge launch (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])


def test_decode_min_programs_sizes_v_split():
    """DECODE_MIN_PROGRAMS doubles V_SPLIT (to 8 at most) for T = 1 launches with too few programs, on top
    of the config's V_SPLIT; launches of several queries keep their V_SPLIT."""
    cfg = MLAConfig(DECODE_MIN_PROGRAMS=128)
    assert [cfg.v_split(1, p, 512) for p in (8, 16, 33, 64, 100, 128, 4096)] == [8, 8, 4, 2, 2, 1, 1]
    assert cfg.v_split(16, 8, 512) == 1 and cfg.v_split(2, 8, 512) == 1
    assert MLAConfig(DECODE_MIN_PROGRAMS=128, V_SPLIT=4).v_split(1, 64, 512) == 4
    assert MLAConfig().v_split(1, 8) == 1


def test_decode_block_m_is_a_decode_retiling():
    """DECODE_BLOCK_M / DECODE_STAGES apply to T = 1 launches only, and only with the row sums by the
    MMA (L_BY_DOT) on mma.sync tiles; anything else is refused with the field named."""
    import torch
    from kdtree_engine.kernels.mla_attention import _plan

    cfg = MLAConfig(BLOCK_M=32, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_STAGES=3, DECODE_MIN_PROGRAMS=128)
    one, many = cfg.for_launch(1), cfg.for_launch(16)
    assert (one.BLOCK_M, one.num_stages) == (16, 3) and many is cfg
    assert _plan(512, 64, 8, 1, torch.float32, cfg, 8 * 512)[0].BLOCK_M == 16
    assert _plan(512, 64, 8, 2, torch.float32, cfg, 8 * 512)[0].BLOCK_M == 32
    # the decode rule counts the re-tiled launch's programs: N = 64 -> 4 row tiles x 2 chunks x 8 slices
    assert _plan(512, 64, 64, 1, torch.float32, cfg, 2 * 512)[4] == 8
    for bad in (dict(L_BY_DOT=False), dict(BLOCK_M=128), dict(DECODE_BLOCK_M=64)):
        with pytest.raises(ValueError, match="DECODE_BLOCK_M"):
            MLAConfig(**{**dict(BLOCK_M=32, L_BY_DOT=True, DECODE_BLOCK_M=16), **bad})


def test_wide_verify_tiles_keep_narrow_decode_tiles_without_slices():
    """64-row verify tiles (wgmma) may run beside 32-row decode tiles (the N > 16 default); 64-row tiles that a
    launch could cut in column slices are refused by name (they do not fit in shared memory)."""
    from kdtree_engine.kernels.mla_attention import default_config

    cfg = default_config(64)
    assert (cfg.BLOCK_M, cfg.num_warps) == (64, 8)
    assert (cfg.for_launch(1).BLOCK_M, cfg.for_launch(1).num_warps, cfg.for_launch(9).BLOCK_M) == (32, 4, 64)
    wide = dict(BLOCK_M=64, num_warps=8, L_BY_DOT=True, DECODE_BLOCK_M=32, DECODE_WARPS=4)
    MLAConfig(**wide, DECODE_MIN_PROGRAMS=128)      # slices on the decode tiles only
    for bad in (dict(V_SPLIT=2), dict(DECODE_BLOCK_M=0, DECODE_WARPS=0, DECODE_MIN_PROGRAMS=128)):
        with pytest.raises(ValueError, match="column slices"):
            MLAConfig(**{**wide, **bad})


def test_decode_rule_keeps_slices_of_64_columns():
    """The decode rule never cuts the output columns below 64 per slice (C = 64, the demo's latent: one
    slice; C = 512: up to 8), and leaves a config's own V_SPLIT as it is."""
    import torch
    from kdtree_engine.kernels.mla_attention import _plan

    cfg = MLAConfig(DECODE_MIN_PROGRAMS=128)
    assert _plan(64, 32, 4, 1, torch.float32, cfg, 2 * 512)[4] == 1
    assert _plan(256, 64, 8, 1, torch.float32, cfg, 2 * 512)[4] == 4
    assert _plan(512, 64, 8, 1, torch.float32, cfg, 8 * 512)[4] == 8
    assert _plan(512, 64, 8, 16, torch.float32, cfg, 8 * 512)[4] == 1
    assert _plan(64, 32, 4, 1, torch.float32, MLAConfig(DECODE_MIN_PROGRAMS=128, V_SPLIT=2), 2 * 512)[4] == 2


def test_decode_warps_is_a_decode_retiling():
    """DECODE_WARPS sets num_warps of T = 1 launches only, and only where the warps' split cannot touch a
    row's arithmetic (row sums by the MMA, mma.sync tiles); anything else is refused, field named."""
    cfg = MLAConfig(BLOCK_M=32, L_BY_DOT=True, DECODE_BLOCK_M=16, DECODE_STAGES=3, DECODE_WARPS=8)
    assert (cfg.for_launch(1).num_warps, cfg.for_launch(1).BLOCK_M, cfg.for_launch(5).num_warps) == (8, 16, 4)
    for bad in (dict(L_BY_DOT=False), dict(BLOCK_M=64, DECODE_BLOCK_M=0), dict(DECODE_WARPS=3)):
        with pytest.raises(ValueError, match="DECODE_WARPS"):
            MLAConfig(**{**dict(BLOCK_M=32, L_BY_DOT=True, DECODE_WARPS=8), **bad})


def test_decode_max_t_widens_the_decode_launch():
    """DECODE_MAX_T: launches of up to that many queries take the decode tiles and the DECODE_MIN_PROGRAMS
    column slices; larger ones the verify tiles; below 1 is refused by name."""
    import torch
    from kdtree_engine.kernels.mla_attention import _plan

    cfg = MLAConfig(BLOCK_M=64, num_warps=8, L_BY_DOT=True, DECODE_BLOCK_M=32, DECODE_WARPS=4,
                    DECODE_MIN_PROGRAMS=128, DECODE_MAX_T=8)
    assert [(cfg.for_launch(t).BLOCK_M, cfg.for_launch(t).num_warps) for t in (1, 4, 8, 9)] == [
        (32, 4), (32, 4), (32, 4), (64, 8)]
    # N = 64, T = 4 over 4 chunks: 8 row tiles x 4 chunks = 32 programs -> 4 slices; T = 9 keeps one
    assert _plan(512, 64, 64, 4, torch.float32, cfg, 4 * 512)[:2] == (cfg.for_launch(4), 32)
    assert _plan(512, 64, 64, 4, torch.float32, cfg, 4 * 512)[4] == 4
    assert _plan(512, 64, 64, 9, torch.float32, cfg, 4 * 512)[4] == 1
    # ... but where the verify tiles already make >= DECODE_MAX_T_PROGRAMS programs (4 tiles x 33 chunks), they
    # stay; decode (T = 1) launches are not bounded
    assert _plan(512, 64, 64, 4, torch.float32, cfg, 33 * 512)[:2] == (cfg, 64)
    assert _plan(512, 64, 64, 4, torch.float32, cfg, 32 * 512)[:2] == (cfg.for_launch(4), 32)
    assert _plan(512, 64, 64, 1, torch.float32, cfg, 1000 * 512)[1] == 32
    assert cfg.as_dict()["DECODE_MAX_T"] == 8 and "DECODE_MAX_T" not in MLAConfig().as_dict()
    with pytest.raises(ValueError, match="DECODE_MAX_T"):
        MLAConfig(DECODE_MAX_T=0)
    small = MLAConfig(BLOCK_M=64, num_warps=8, L_BY_DOT=True, DECODE_BLOCK_M=32, DECODE_WARPS=4, DECODE_MAX_T=8,
                      SMALL_BLOCK_M=16, SMALL_WARPS=8)
    assert [(small.for_launch(t).BLOCK_M, small.for_launch(t).num_warps) for t in (1, 4, 9)] == [
        (32, 4), (16, 8), (64, 8)]
    for bad in (dict(L_BY_DOT=False), dict(SMALL_BLOCK_M=64), dict(SMALL_WARPS=3)):
        with pytest.raises(ValueError, match="SMALL_BLOCK_M"):
            MLAConfig(**{**dict(BLOCK_M=32, L_BY_DOT=True, SMALL_BLOCK_M=16), **bad})


def test_decode_wg_column_slices():
    """DECODE_WG_MIN_PROGRAMS: a one-query warpgroup launch doubles its column slices (up to 8, slices of a
    multiple of 64 columns) until row groups x chunks x slices reaches the minimum."""
    from dataclasses import replace

    from kdtree_engine.kernels.mla_attention import _wg_slices, default_config

    cfg = MLAConfig(BLOCK_N=64, L_BY_DOT=True, DECODE_WG=2, DECODE_WG_MIN_PROGRAMS=128)
    assert default_config(8).DECODE_WG_MIN_PROGRAMS == 128 and default_config(64).DECODE_WG_MIN_PROGRAMS == 0
    # N = 8: one row group per chunk; 4K + 1 keys = 9 chunks -> 8 slices, 32K + 1 = 65 -> 2, 64K = 128 -> 1
    assert [_wg_slices(cfg, 8, n, 512, 1) for n in (1, 9, 65, 128, 513)] == [8, 8, 2, 1, 1]
    assert [_wg_slices(cfg, 64, n, 512, 1) for n in (9, 33, 64)] == [8, 2, 1]   # 2 groups of 32 rows
    assert _wg_slices(cfg, 8, 9, 128, 1) == 2        # slices stay a multiple of 64 columns
    assert _wg_slices(cfg, 8, 65, 512, 4) == 4       # never fewer than the launch's own
    # one launch for several requests' slots counts every slot's programs: 16 slots x 9 chunks -> 1 slice
    assert [_wg_slices(cfg, 8, 9, 512, 1, s) for s in (1, 4, 16)] == [8, 4, 1]
    assert _wg_slices(replace(cfg, DECODE_WG_MIN_PROGRAMS=0), 8, 9, 512, 1) == 1
    # inert without the warpgroup kernel: the default with DECODE_WG off stays a valid config
    assert replace(default_config(8), DECODE_WG=0).DECODE_WG_MIN_PROGRAMS == 128
    # a tree's prefix launch counts its T x N rows: 4 nodes x 8 heads = one 32-row group, 8 chunks -> 8 slices;
    # 16 nodes = 4 groups -> 4; in 16-row programs (DECODE_WG_ROWS) twice the groups, half the slices
    assert [_wg_slices(cfg, 4 * 8, 8, 512, 1), _wg_slices(cfg, 16 * 8, 8, 512, 1)] == [8, 4]
    assert [_wg_slices(replace(cfg, DECODE_WG_ROWS=r), 4 * 8, 8, 512, 1) for r in (8, 16, 32)] == [4, 8, 8]
    assert _wg_slices(replace(cfg, DECODE_WG_ROWS=16), 16 * 8, 8, 512, 1) == 2


def test_decode_wg_rows_field():
    """DECODE_WG_ROWS caps the warpgroup program's rows at 8, 16 or 32 (anything else refused, naming the field) and
    round-trips through as_dict (the benchmarks' config records)."""
    from kdtree_engine.kernels import mla_decode_wg as W

    assert [W.rows_per_program(r, 16) for r in (4, 8, 9, 16, 17, 512)] == [8, 8, 16, 16, 16, 16]
    assert [W.rows_per_program(r, 8) for r in (1, 9, 512)] == [8, 8, 8]
    for bad in (0, 4, 64):
        with pytest.raises(ValueError, match="DECODE_WG_ROWS"):
            MLAConfig(BLOCK_N=64, L_BY_DOT=True, DECODE_WG=2, DECODE_WG_ROWS=bad)
    cfg = MLAConfig(BLOCK_N=64, L_BY_DOT=True, DECODE_WG=2, DECODE_WG_ROWS=16)
    assert MLAConfig(**cfg.as_dict()) == cfg
    assert "DECODE_WG_ROWS" not in MLAConfig(BLOCK_N=64, L_BY_DOT=True, DECODE_WG=2).as_dict()
    if W.HAVE_GLUON:
        assert "rows per program" in W.unsupported(8, 512, 64, torch.bfloat16, 64, 1, 2, most=64)


def test_decode_wg_config_and_fit(caplog, monkeypatch):
    """DECODE_WG needs the chunk kernel arithmetic it reproduces; a launch it cannot take says why (logged once) and
    runs on the chunk kernel."""
    from kdtree_engine.kernels import mla_decode_wg as W
    from kdtree_engine.kernels.mla_attention import _decode_wg

    monkeypatch.setattr(logs, "_LOGGED", set())   # nothing logged yet in this test's eyes

    ok = MLAConfig(BLOCK_N=64, L_BY_DOT=True, DECODE_WG=2)
    for bad in (dict(L_BY_DOT=False), dict(DECODE_WG=4)):
        with pytest.raises(ValueError, match="DECODE_WG"):
            MLAConfig(**{**ok.as_dict(), **bad})
    assert W.rows_per_program(8) == 8 and W.rows_per_program(9) == 16 and W.rows_per_program(512) == 32
    if W.HAVE_GLUON:
        assert W.unsupported(64, 512, 64, torch.bfloat16, 64, 1, 2) is None
        assert W.unsupported(8, 512, 64, torch.bfloat16, 64, 1, 3) is None
    assert "dtype" in W.unsupported(8, 512, 64, torch.float32, 64, 1, 2) or not W.HAVE_GLUON
    if W.HAVE_GLUON:
        assert "BLOCK_N" in W.unsupported(8, 512, 64, torch.bfloat16, 32, 1, 2)
        assert "R = 32" in W.unsupported(8, 512, 32, torch.bfloat16, 64, 1, 2)
        assert "C = 256" in W.unsupported(8, 256, 64, torch.bfloat16, 64, 1, 2)
        assert "float16" in W.unsupported(8, 512, 64, torch.float16, 64, 1, 2)
        assert "V_SPLIT 16" in W.unsupported(8, 512, 64, torch.bfloat16, 64, 16, 2)
        assert "shared memory" in W.unsupported(64, 512, 64, torch.bfloat16, 64, 1, 3)
    q = torch.zeros(1, 8, 512, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    assert not _decode_wg(MLAConfig(BLOCK_N=64, L_BY_DOT=True), True, q, kv, 64, 1)   # not asked for
    with caplog.at_level("DEBUG", logger="kdtree_engine"):
        assert not _decode_wg(ok, True, q, kv, 64, 1)    # asked for, but on the CPU
        assert not _decode_wg(ok, True, q, kv, 64, 1)
    said = [r.getMessage() for r in caplog.records if "warpgroup kernel" in r.getMessage()]
    assert len(said) == 1 and "not on a CUDA device" in said[0], said
    assert not _decode_wg(ok, False, q, kv, 64, 1)  # not a decode launch
    # one launch for many slots runs where the slots' own decode launches run on the warpgroup kernel
    from kdtree_engine.kernels.mla_attention import mla_attention_slots, slots_unsupported
    pool = torch.zeros(3, 64, 576, dtype=torch.bfloat16)
    assert "not on a CUDA device" in slots_unsupported(q, q[..., :64], pool)
    assert "dimensions" in slots_unsupported(q, q[..., :64], kv)
    assert "chunk kernel" in slots_unsupported(q, q[..., :64], pool, MLAConfig(BLOCK_N=64))
    with pytest.raises(ValueError, match="mla_attention_slots: not on a CUDA device"):
        mla_attention_slots(q, q[..., :64], pool, torch.zeros(1, 3, dtype=torch.int32), 192, torch.zeros(1), 0.1)


def test_verify_wg_config_and_fit(caplog, monkeypatch):
    """VERIFY_WG needs the chunk kernel arithmetic it reproduces; a launch it cannot take says why
    (logged once) and runs on the chunk kernel; decode launches never take it; a tail chunk needs whole 64-row tiles
    per query."""
    from kdtree_engine.kernels import mla_verify_wg as V
    from kdtree_engine.kernels.mla_attention import _verify_wg, default_config

    monkeypatch.setattr(logs, "_LOGGED", set())
    ok = MLAConfig(BLOCK_N=64, L_BY_DOT=True, VERIFY_WG=2)
    for bad in (dict(L_BY_DOT=False), dict(VERIFY_WG=3)):
        with pytest.raises(ValueError, match="VERIFY_WG"):
            MLAConfig(**{**ok.as_dict(), **bad})
    assert MLAConfig(**ok.as_dict()) == ok
    assert all(default_config(n).VERIFY_WG == 2 for n in (8, 64))
    if V.HAVE_GLUON:
        assert V.unsupported(512, 64, torch.bfloat16, 64, 2) is None
        assert "dtype" in V.unsupported(512, 64, torch.float32, 64, 2)
        assert "BLOCK_N" in V.unsupported(512, 64, torch.bfloat16, 32, 2)
        assert "C = 256" in V.unsupported(256, 64, torch.bfloat16, 64, 2)
        assert "shared memory" in V.unsupported(512, 64, torch.bfloat16, 64, 3)
    else:
        assert "Gluon" in V.unsupported(512, 64, torch.bfloat16, 64, 2)
    q = torch.zeros(16, 8, 512, dtype=torch.bfloat16)
    kv = torch.zeros(40, 576, dtype=torch.bfloat16)
    assert not _verify_wg(MLAConfig(BLOCK_N=64, L_BY_DOT=True), False, q, kv, 64)   # not asked for
    assert not _verify_wg(ok, True, q, kv, 64)                                       # a decode launch
    with caplog.at_level("DEBUG", logger="kdtree_engine"):
        assert not _verify_wg(ok, False, q, kv, 64)      # asked for, but not here
        assert not _verify_wg(ok, False, q, kv, 64)
    said = [r.getMessage() for r in caplog.records if "tree prefix launches" in r.getMessage()]
    assert len(said) == 1 and ("CUDA" in said[0] or "Gluon" in said[0]), said
    with pytest.raises(ValueError, match="64-row tiles"):
        V.launch(q, q[..., :64], kv, kv, 64, kv, kv, kv, 8, (0, 0, 0), 1.0, 512, 1, 2, False, {},
                 tail=(kv, kv, 1))


def test_merge_tiles_early_loads_rule():
    """The merge launches issue their first blocks' loads early (EARLY) except those of more than 64 rows and 64
    chunks (long verifies, where it measured slower); the other fields keep their rule."""
    from kdtree_engine.kernels.mla_attention import merge_tiles

    assert merge_tiles(8, 257, 512).early and merge_tiles(64, 257, 512).early      # decodes at N = 8 / 64, 128K
    assert merge_tiles(4096, 9, 512).early and merge_tiles(128, 64, 512).early     # trees over 4K, a verify at 32K
    assert not merge_tiles(128, 257, 512).early and not merge_tiles(65, 65, 512).early
    t = merge_tiles(8, 65, 512)
    assert (t.block_d, t.warps, t.prefetch) == (16, 1, True)
