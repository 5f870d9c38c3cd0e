"""Absorbed MLA attention on CUDA at K2 shapes (C = 512, R = 64; N = 64 heads, and 8 per rank under
TP8): bf16 against the torch reference, and batch invariance bit for bit in bf16 (a tree node alone,
T = 1 over the prefix + its compacted path, equals its rows inside the tree launch)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kdtree_engine.kernels.mla_attention import MLAConfig, default_config, mla_attention, mla_attention_device
from kdtree_engine.kernels.reference import mla_attention_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

C, R = 512, 64
SCALE = 0.1352  # about K2's softmax scale (192 ** -0.5 with YaRN mscale^2)


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree, parent[i] < i, biased towards deep paths."""
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        if i:
            lo = max(0, i - 4)
            parent = int(torch.randint(lo, i, (1,), generator=gen))
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def inputs(T, N, S, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_lat = torch.randn(T, N, C, generator=g, device="cuda").to(dtype)
    q_pe = torch.randn(T, N, R, generator=g, device="cuda").to(dtype)
    kv = torch.randn(S + T, C + R, generator=g, device="cuda").to(dtype)
    return q_lat, q_pe, kv


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free cached blocks with NaN so that an unwritten output element shows up."""
    x = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del x


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_vs_reference(N: int, S: int, T: int) -> None:
    """The default config on fresh inputs (a random tree for T > 1, outputs NaN-poisoned) against the float
    reference."""
    seed = int(torch.randint(1 << 30, (1,)))
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    mask = None if T == 1 else random_tree_mask(T, torch.Generator().manual_seed(seed)).cuda()
    poison_allocator()
    out = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C)
    torch.cuda.synchronize()
    ref = mla_attention_reference(q_lat.float(), q_pe.float(), kv.float(), S, mask, SCALE, C)
    assert out.dtype == torch.bfloat16 and out.shape == (T, N, C)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    e = rel(out, ref)
    assert e < 1e-2, f"relative error {e:.3g} (seed {seed})"


@pytest.mark.parametrize("N", [64, 8])
@pytest.mark.parametrize("S", [4096, 32768])
@pytest.mark.parametrize("T", [1, 16, 64, 129])
def test_bf16_vs_reference(N, S, T):
    check_vs_reference(N, S, T)


@pytest.mark.parametrize("N", [8, 64])
@pytest.mark.parametrize("S,T", [(4096 + 5, 1), (32768, 1), (4096 - 3, 4), (4096 + 700, 8)])
def test_decode_warpgroup_default_vs_reference(warpgroup_launches, N, S, T):
    """The default config at K2 widths: one-query decodes and the prefix chunks of small trees run on the
    warpgroup kernel (its launches counted) and match the float reference on fresh inputs. (Small trees run
    as decode launches only while their verify tiles would leave SMs idle: 8 nodes over 32K do not.)"""
    check_vs_reference(N, S, T)
    assert warpgroup_launches, "the default config did not run this decode launch on the warpgroup kernel"


@pytest.mark.parametrize("N,S,T", [(8, 0, 2048), (64, 1000, 300), (8, 4096 + 17, 16), (64, 511, 2)])
def test_bf16_causal_chunks(N, S, T):
    """Causal blocks: a prefill chunk with no prefix, chunks over a prefix, a chunk-boundary start."""
    seed = int(torch.randint(1 << 30, (1,)))
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    poison_allocator()
    out = mla_attention(q_lat, q_pe, kv, S, None, SCALE, C)
    ref = mla_attention_reference(q_lat.float(), q_pe.float(), kv.float(), S, None, SCALE, C)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-2, f"seed {seed}"


def test_fp32_vs_reference():
    seed = int(torch.randint(1 << 30, (1,)))
    q_lat, q_pe, kv = inputs(33, 8, 3000, seed, torch.float32)
    mask = random_tree_mask(33, torch.Generator().manual_seed(seed)).cuda()
    out = mla_attention(q_lat, q_pe, kv, 3000, mask, SCALE, C)
    ref = mla_attention_reference(q_lat.double(), q_pe.double(), kv.double(), 3000, mask, SCALE, C)
    assert out.dtype == torch.float32
    assert rel(out, ref) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("N", [8, 64])
@pytest.mark.parametrize("S,T", [(4096 - 20, 64), (32768 + 3, 129)])
def test_tree_batch_invariant_bf16(N, S, T):
    """Each node alone (its path committed at S.., T = 1) == its rows in the tree launch, bit for bit."""
    seed = int(torch.randint(1 << 30, (1,)))
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    mask = random_tree_mask(T, torch.Generator().manual_seed(seed))
    full = mla_attention(q_lat, q_pe, kv, S, mask.cuda(), SCALE, C)
    bad = []
    for i in range(T):
        path = torch.nonzero(mask[i]).flatten().cuda()
        kv_i = torch.cat([kv[:S], kv[S + path]])
        one = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv_i, S + len(path) - 1, None, SCALE, C)
        if not torch.equal(one[0], full[i]):
            bad.append((i, float((one[0].float() - full[i].float()).abs().max())))
    assert not bad, f"nodes differ alone vs in the tree: {bad[:8]} (seed {seed}, config {default_config(N)})"


@pytest.mark.parametrize("N", [8, 64])
def test_causal_batch_invariant_bf16(N):
    """Decode (T = 1) equals the same row inside a causal block of 16 and a prefill-sized block."""
    S, T = 5000, 40
    seed = int(torch.randint(1 << 30, (1,)))
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    full = mla_attention(q_lat, q_pe, kv, S, None, SCALE, C)
    part = mla_attention(q_lat[:16], q_pe[:16], kv[: S + 16], S, None, SCALE, C)
    assert torch.equal(part, full[:16])
    for i in (0, 7, 15, 39):
        one = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv[: S + i + 1], S + i, None, SCALE, C)
        assert torch.equal(one[0], full[i]), f"row {i} (seed {seed})"


@pytest.mark.parametrize("N,S,T", [(8, 32768 + 5, 1), (8, 4096 - 3, 16), (64, 32768 + 5, 1), (64, 4096 - 3, 16)])
def test_bf16_default_vs_reference(N, S, T):
    seed = int(torch.randint(1 << 30, (1,)))
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    mask = None if T == 1 else random_tree_mask(T, torch.Generator().manual_seed(seed)).cuda()
    poison_allocator()
    out = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C, config=default_config(N))
    ref = mla_attention_reference(q_lat.float(), q_pe.float(), kv.float(), S, mask, SCALE, C)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    assert rel(out, ref) < 1e-2, f"seed {seed}"


@pytest.mark.parametrize("N", [8, 64])
def test_v_split_bit_equal_bf16(N):
    """Output-column slices only re-tile: a row is the same bits in a decode launch (4 slices; 8 under
    DECODE_MIN_PROGRAMS), a 16-row block (2), a 40-row block and a 64-node tree (1 and 2), through the host-length
    and the device-length launch."""
    S, T = 5000, 40
    seed = int(torch.randint(1 << 30, (1,)))
    # (small trees on the verify tiles: 2 slices of a 16-row 3-stage decode tile need 233 KB)
    base: MLAConfig = replace(default_config(N), V_SPLIT=1, DECODE_MIN_PROGRAMS=0, DECODE_MAX_T=1, SMALL_WARPS=0)
    if base.BLOCK_M >= 64:   # 64-row row tiles take no slices (MLAConfig): the 32-row tiles they replaced, which do
        base = replace(base, BLOCK_M=32, num_warps=4)
    v2, v4 = replace(base, V_SPLIT=2), replace(base, V_SPLIT=4)
    auto = replace(base, DECODE_MIN_PROGRAMS=128)  # decode launches here: 10 chunks x 1-2 tiles -> 8 slices
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    full = mla_attention(q_lat, q_pe, kv, S, None, SCALE, C, config=base)  # 1 slice
    assert torch.equal(full, mla_attention(q_lat, q_pe, kv, S, None, SCALE, C, config=v2))
    part = mla_attention(q_lat[:16], q_pe[:16], kv[: S + 16], S, None, SCALE, C, config=v2)  # 2 slices
    assert torch.equal(part, full[:16]), f"T=16 block (seed {seed})"
    cap = torch.cat([kv, torch.randn(300, C + R, device="cuda").bfloat16()])
    tril = torch.ones(16, 16, dtype=torch.bool, device="cuda").tril()
    dev16 = mla_attention_device(q_lat[:16], q_pe[:16], cap, torch.tensor(S), tril, SCALE, C, config=v2)
    assert torch.equal(dev16, full[:16]), f"device-length T=16 (seed {seed})"
    for i in (0, 7, 15, 39):  # 4 slices
        one = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv[: S + i + 1], S + i, None, SCALE, C, config=v4)
        assert torch.equal(one[0], full[i]), f"decode row {i} (seed {seed})"
        one8 = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv[: S + i + 1], S + i, None, SCALE, C, config=auto)
        assert torch.equal(one8[0], full[i]), f"decode row {i}, 8 slices (seed {seed})"
        buf = torch.cat([kv[: S + i], kv[S + i:S + i + 1], cap[S + T:]])  # slot S + i at its place, junk after
        one_dev = mla_attention_device(q_lat[i:i + 1], q_pe[i:i + 1], buf, torch.tensor(S + i),
                                       torch.ones(1, 1, dtype=torch.bool, device="cuda"), SCALE, C, config=v4)
        assert torch.equal(one_dev[0], full[i]), f"device-length decode row {i} (seed {seed})"
    # a 64-node tree (1 and 2 slices) vs each node alone (4 slices)
    Tt = 64
    q_lat, q_pe, kv = inputs(Tt, N, S, seed + 1)
    mask = random_tree_mask(Tt, torch.Generator().manual_seed(seed))
    tree = mla_attention(q_lat, q_pe, kv, S, mask.cuda(), SCALE, C, config=base)
    assert torch.equal(tree, mla_attention(q_lat, q_pe, kv, S, mask.cuda(), SCALE, C, config=v2))
    for i in (0, 5, 31, 63):
        path = torch.nonzero(mask[i]).flatten().cuda()
        kv_i = torch.cat([kv[:S], kv[S + path]])
        one = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv_i, S + len(path) - 1, None, SCALE, C, config=v4)
        assert torch.equal(one[0], tree[i]), f"tree node {i} alone vs in the tree (seed {seed})"


RETILES = {"warps8": dict(DECODE_WARPS=8), "warps2": dict(DECODE_WARPS=2), "stages2": dict(DECODE_STAGES=2),
           "stages3": dict(DECODE_STAGES=3)}


@pytest.mark.parametrize("retile", list(RETILES))
@pytest.mark.parametrize("N", [8, 64])
def test_decode_retiles_bit_equal_bf16(N, retile):
    """DECODE_WARPS / DECODE_STAGES leave a row's bits: a decode row run by another warp count or pipeline depth
    is the same bits as the default config's decode and as its row in a causal block (default config), host- and
    device-length."""
    S, T = 32768 + 5, 40
    seed = int(torch.randint(1 << 30, (1,)))
    base = default_config(N)
    cfg = replace(base, DECODE_WG=0, **RETILES[retile])   # re-tilings of the chunk kernel's decode launch
    q_lat, q_pe, kv = inputs(T, N, S, seed)
    full = mla_attention(q_lat, q_pe, kv, S, None, SCALE, C, config=base)
    assert torch.equal(mla_attention(q_lat, q_pe, kv, S, None, SCALE, C, config=cfg), full), f"block (seed {seed})"
    check_decode_rows(q_lat, q_pe, kv, S, full, (0, 17, 39), cfg, f"{retile} (seed {seed})")


def check_decode_rows(q_lat, q_pe, kv, S, full, rows, cfg, what):
    """Query i of a causal block over [0, S) decoded alone (over [0, S + i], host- and device-length, the
    device-length buffer with other keys past the row) == its row `full[i]` in the block, bit for bit."""
    T = q_lat.shape[0]
    cap = torch.cat([kv, torch.randn(300, C + R, device="cuda").bfloat16()])
    for i in rows:
        poison_allocator()
        one = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv[: S + i + 1], S + i, None, SCALE, C, config=cfg)
        assert torch.equal(one[0], full[i]), f"decode row {i} at S = {S}, {what}"
        buf = torch.cat([kv[: S + i + 1], cap[S + T:]])
        one_dev = mla_attention_device(q_lat[i:i + 1], q_pe[i:i + 1], buf, torch.tensor(S + i),
                                       torch.ones(1, 1, dtype=torch.bool, device="cuda"), SCALE, C, config=cfg)
        assert torch.equal(one_dev[0], full[i]), f"device-length decode row {i} at S = {S}, {what}"


WG = {"wg2": dict(DECODE_WG=2), "wg3": dict(DECODE_WG=3), "wg2slices": dict(DECODE_WG=2, DECODE_MIN_PROGRAMS=128),
      "wg2wgslices": dict(DECODE_WG=2, DECODE_WG_MIN_PROGRAMS=128),
      "wg2rows16": dict(DECODE_WG=2, DECODE_WG_ROWS=16),
      "wg2rows8": dict(DECODE_WG=2, DECODE_WG_ROWS=8, DECODE_WG_MIN_PROGRAMS=128)}


@pytest.mark.parametrize("N,wg", [(8, "wg2"), (8, "wg3"), (8, "wg2slices"), (16, "wg2"), (16, "wg2slices"),
                                  (5, "wg3"), (64, "wg2"), (8, "wg2wgslices"), (64, "wg2rows16"), (16, "wg2rows8")])
def test_decode_warpgroup_bit_equal_bf16(N, wg):
    """The warpgroup decode kernel (keys on the wgmma's M side, TMA key tiles; DECODE_WG) is the chunk kernel's
    arithmetic: a decode row equals the default config's decode and its row in a causal block, bit for bit,
    host- and device-length, over one chunk (direct write), chunk edges and a long prefix, with column slices,
    at N = 64 in two programs of 32 rows per chunk (or four of 16)."""
    from kdtree_engine.kernels.mla_attention import _decode_wg
    from kdtree_engine.kernels.mla_decode_wg import unsupported

    base = default_config(N)   # the chunk kernel's arithmetic
    cfg = replace(base, **WG[wg])
    assert unsupported(N, C, R, torch.bfloat16, cfg.BLOCK_N, 1, cfg.DECODE_WG) is None
    for S, T in ((100, 8), (512 - 3, 6), (32768 + 5, 40)):
        seed = int(torch.randint(1 << 30, (1,)))
        q_lat, q_pe, kv = inputs(T, N, S, seed)
        assert _decode_wg(cfg, True, q_lat[:1], kv, R, 1), "the warpgroup kernel does not take this launch"
        full = mla_attention(q_lat, q_pe, kv, S, None, SCALE, C, config=base)
        check_decode_rows(q_lat, q_pe, kv, S, full, (0, T // 2 + 1, T - 1), cfg, f"{wg} (seed {seed})")


SMALL_TILES = {"default": {}, "w8": dict(SMALL_WARPS=8), "bm16w8": dict(SMALL_BLOCK_M=16, SMALL_WARPS=8),
               "t16w8": dict(DECODE_MAX_T=16, SMALL_WARPS=8), "wg2": dict(DECODE_WG=2),
               "t16wg2": dict(DECODE_MAX_T=16, SMALL_WARPS=8, DECODE_WG=2),
               "wg2slices": dict(DECODE_WG=2, DECODE_WG_MIN_PROGRAMS=128),
               "t16wg2rows16": dict(DECODE_MAX_T=16, SMALL_WARPS=8, DECODE_WG=2, DECODE_WG_ROWS=16,
                                    DECODE_WG_MIN_PROGRAMS=128),
               "wg2rows8": dict(DECODE_WG=2, DECODE_WG_ROWS=8)}


@pytest.mark.parametrize("tiles", list(SMALL_TILES))
@pytest.mark.parametrize("N", [8, 64])
def test_small_trees_on_decode_tiles_bit_equal_bf16(N, tiles):
    """DECODE_MAX_T = 8 (trees of up to 8 nodes on the decode tiles and their column slices) leaves a row's
    bits: the first T nodes of a 64-node tree (a tree themselves: parent[i] < i) give the rows of the default
    config's 64-node launch, host- and device-length, at T = 2, 4, 8, 16; also on the small trees' own tiles
    (SMALL_BLOCK_M / SMALL_WARPS), with DECODE_MAX_T = 16 and with the prefix chunks on the warpgroup kernel
    (DECODE_WG), also in column slices and in 8- or 16-row programs."""
    S, Tt = 4096 + 37, 64
    seed = int(torch.randint(1 << 30, (1,)))
    base = default_config(N)
    cfg = replace(base, **{"DECODE_MAX_T": 8, **SMALL_TILES[tiles]})
    q_lat, q_pe, kv = inputs(Tt, N, S, seed)
    mask = random_tree_mask(Tt, torch.Generator().manual_seed(seed)).cuda()
    full = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C, config=base)
    cap = torch.cat([kv, torch.randn(300, C + R, device="cuda").bfloat16()])
    for T in (2, 4, 8, 16):
        poison_allocator()
        sub = mla_attention(q_lat[:T], q_pe[:T], kv[: S + T], S, mask[:T, :T].contiguous(), SCALE, C, config=cfg)
        assert torch.equal(sub, full[:T]), f"T = {T} on decode tiles (seed {seed})"
        buf = torch.cat([kv[: S + T], cap[S + Tt:]])
        dev = mla_attention_device(q_lat[:T], q_pe[:T], buf, torch.tensor(S), mask[:T, :T].contiguous(), SCALE, C,
                                   config=cfg)
        assert torch.equal(dev, full[:T]), f"device-length T = {T} (seed {seed})"


@pytest.mark.parametrize("N,stages", [(64, 2), (64, 1), (8, 2), (16, 2)])
def test_verify_warpgroup_bit_equal_bf16(N, stages):
    """The queries-on-M warpgroup kernel for a tree's whole prefix chunks (VERIFY_WG; at N = 64 also the tree's
    own chunks, keys gathered, in the same launch) is the chunk kernel's arithmetic: a tree launch equals the chunk
    kernel's (VERIFY_WG 0) bit for bit, host- and device-length, on and off the chunk grid, over no whole prefix
    chunk, one and many, a tree whose paths cross a chunk edge, rows past T * N in the last tile."""
    from kdtree_engine.kernels.mla_attention import _verify_wg

    base = replace(default_config(N), VERIFY_WG=0, DECODE_MAX_T=1)
    cfg = replace(base, VERIFY_WG=stages)
    for S, T in ((4096, 64), (4096 - 96, 16), (512 + 3, 24), (1024 - 6, 40), (300, 20), (32768 + 5, 33)):
        seed = int(torch.randint(1 << 30, (1,)))
        q_lat, q_pe, kv = inputs(T, N, S, seed)
        assert _verify_wg(cfg, False, q_lat, kv, R), "the warpgroup kernel does not take this launch"
        mask = random_tree_mask(T, torch.Generator().manual_seed(seed)).cuda()
        ref = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C, config=base)
        poison_allocator()
        out = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C, config=cfg)
        assert torch.equal(out, ref), f"host-length S = {S}, T = {T}: {int((out != ref).sum())} differ (seed {seed})"
        buf = torch.cat([kv, torch.randn(700, C + R, device="cuda").bfloat16()])
        poison_allocator()
        dev = mla_attention_device(q_lat, q_pe, buf, torch.tensor(S, device="cuda"), mask, SCALE, C, config=cfg)
        assert torch.equal(dev, ref), f"device-length S = {S}, T = {T} (seed {seed})"


@pytest.mark.parametrize("N", [64, 8])
def test_merge_early_loads_bit_equal_bf16(N, monkeypatch):
    """The merge's first blocks loaded beside the row's length loads (MergeTiles.early, the engine's choice) give
    the bits of the merge without it: decodes and trees, host- and device-length (the length read on the device,
    the tree's visible counts), on and off the chunk grid, short and long contexts."""
    import kdtree_engine.kernels.mla_attention as mla

    tiles = mla.merge_tiles
    for S, T in ((4096, 1), (4096, 4), (4096, 64), (4000, 16), (32768, 1), (32768 + 5, 16), (131072, 1)):
        seed = int(torch.randint(1 << 30, (1,)))
        q_lat, q_pe, kv = inputs(T, N, S, seed)
        mask = None if T == 1 else random_tree_mask(T, torch.Generator().manual_seed(seed)).cuda()
        buf = torch.cat([kv, torch.randn(700, C + R, device="cuda").bfloat16()])
        outs = {}
        for early in (False, None):   # None: the engine's merge_tiles
            monkeypatch.setattr(mla, "merge_tiles", tiles if early is None else
                                (lambda *a: tiles(*a)._replace(early=False)))
            poison_allocator()
            host = mla_attention(q_lat, q_pe, kv, S, mask, SCALE, C)
            poison_allocator()
            dev = mla_attention_device(q_lat, q_pe, buf, torch.tensor(S, device="cuda"),
                                       torch.ones(1, 1, dtype=torch.bool, device="cuda") if mask is None else mask,
                                       SCALE, C)
            outs[early] = (host, dev)
        for i, what in enumerate(("host", "device")):
            a, b = outs[None][i], outs[False][i]
            assert torch.isfinite(a).all(), f"{what}-length S = {S}, T = {T}: unwritten outputs (seed {seed})"
            assert torch.equal(a, b), f"{what}-length S = {S}, T = {T}: {int((a != b).sum())} differ (seed {seed})"
    assert tiles(8, 65, 512).early and tiles(4096, 9, 512).early and not tiles(128, 257, 512).early
