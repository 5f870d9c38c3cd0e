"""The fragment-order repack of kdtree_engine/kernels/w4_frag.py (GPU-only Gluon kernels) checked on the CPU."""

import pytest
import torch

from kdtree_engine.kernels.layouts import frag_perm, frag_repack, frag_unrepack
from kdtree_engine.quant import pack_int4, unpack_int4


@pytest.mark.parametrize("gpb", [1, 2, 4, 8])
def test_perm_is_a_permutation_of_each_block(gpb):
    perm = frag_perm(gpb)
    assert sorted(perm.tolist()) == list(range(32 * gpb))


@pytest.mark.parametrize("gpb", [2, 4])
def test_word_holds_one_threads_fragments(gpb):
    """Word t*gpb + g, pair j: the two k of A register j of lane t (k = 16*tile + 8*hi + 2t, +1) in group g."""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    N, K = 5, 64 * gpb
    q = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
    rep = unpack_int4(frag_repack(pack_int4(q), gpb)).reshape(N, K // (32 * gpb), 4, gpb, 8)
    for blk in range(K // (32 * gpb)):
        for t in range(4):
            for grp in range(gpb):
                for j in range(4):
                    k = blk * 32 * gpb + 32 * grp + 16 * (j >> 1) + 8 * (j & 1) + 2 * t
                    assert torch.equal(rep[:, blk, t, grp, j], q[:, k]), f"seed={seed}"  # low half of pair j
                    assert torch.equal(rep[:, blk, t, grp, j + 4], q[:, k + 1]), f"seed={seed}"  # high half


def test_repack_round_trip_and_bad_k():
    seed = int(torch.randint(0, 1 << 30, ()))
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(-2**31, 2**31 - 1, (3, 7, 512 // 8), generator=g, dtype=torch.int32)
    assert torch.equal(frag_unrepack(frag_repack(p, 4), 4), p), f"seed={seed}"
    assert not torch.equal(frag_repack(p, 4), p)
    with pytest.raises(ValueError, match="K=96"):
        frag_repack(p[..., :12], 4)


@pytest.mark.parametrize("gpb", [2, 4, 8])
def test_frag_tile_puts_each_block_of_a_tile_together(gpb):
    """frag_tile: word (row n, block b, thread t, group g) lands at [n // T, b, n % T, j] of the tiled order, with
    j = t * gpb + g up to 4 groups per block and chunk-major j = (g // 4) * 16 + t * 4 + g % 4 beyond (16-byte
    chunks of the 4 threads of a row side by side); the inverse restores row-major; bad shapes are refused by
    name."""
    import torch

    from kdtree_engine.kernels.layouts import frag_tile
    N, K, T = 128, 1024, 64
    w = torch.randint(-2**31, 2**31 - 1, (2, N, K // 8), dtype=torch.int32)
    wt = frag_tile(w, gpb, T)
    nblk = K // (32 * gpb)
    flat = wt[1].reshape(-1)
    for n in (0, 5, 63, 64, 127):
        for b in range(nblk):
            for t in range(4):
                for g in range(gpb):
                    j = (g // 4) * 16 + t * 4 + g % 4 if gpb > 4 else t * gpb + g
                    pos = (((n // T) * nblk + b) * T + n % T) * 4 * gpb + j
                    assert flat[pos] == w[1, n, b * 4 * gpb + t * gpb + g]
    w = w[0]
    wt = wt[0]
    assert torch.equal(frag_tile(wt, gpb, T, inverse=True), w)
    with pytest.raises(ValueError, match="frag_tile"):
        frag_tile(w[:100], gpb, T)


def test_engine_order_round_trip_and_tile_checks():
    """to_engine_order = the repack then 64-row tiles (its inverse restores the checkpoint words, stacked or
    not); tile_unsupported names a tile that does not fit the rows or the programs."""
    import torch

    from kdtree_engine.kernels.layouts import (FRAG_TILE, frag_repack, frag_tile, from_engine_order,
                                               tile_unsupported, to_engine_order)
    w = torch.randint(-2**31, 2**31 - 1, (3, 128, 64), dtype=torch.int32)
    e = to_engine_order(w, 8)
    assert torch.equal(e[1], frag_tile(frag_repack(w[1], 8), 8, FRAG_TILE))
    assert torch.equal(from_engine_order(e, 8), w)
    assert tile_unsupported(4096, 64, 64) is None and tile_unsupported(4096, 64, 128) is None
    assert tile_unsupported(4096, 0, 64) is None
    for rows, tile, bn in ((4096, 96, 64), (4160, 128, 64), (4096, -1, 64), (4096, 48, 64)):
        assert "tile" in (tile_unsupported(rows, tile, bn) or ""), (rows, tile, bn)


@pytest.mark.parametrize("gpb", [2, 8])
def test_scale_tile_puts_each_block_of_a_tile_together(gpb):
    """scale_tile: scale (row n, group b * gpb + g) lands at [n // T, b, n % T, g] of the tiled order (one run of
    T * gpb values per block of a tile); the inverse restores row-major; bad shapes are refused by name."""
    from kdtree_engine.kernels.layouts import scale_tile
    N, K, T = 128, 1024, 64
    s = torch.randn(3, N, K // 32).to(torch.bfloat16)
    st = scale_tile(s, gpb, T)
    nblk = K // (32 * gpb)
    flat = st[2].reshape(-1)
    for n in (0, 9, 63, 64, 127):
        for b in range(nblk):
            for g in range(gpb):
                assert torch.equal(flat[(((n // T) * nblk + b) * T + n % T) * gpb + g], s[2, n, b * gpb + g])
    assert torch.equal(scale_tile(st, gpb, T, inverse=True), s)
    with pytest.raises(ValueError, match="scale_tile"):
        scale_tile(s[:, :100], gpb, T)


def test_engine_int4_pair_round_trip():
    """to_engine_int4 / from_engine_int4: words and scales of input width K into the engine's order at
    frag_gpb(K) and back to the checkpoint's, on fresh random codes."""
    from kdtree_engine.kernels.layouts import (frag_gpb, from_engine_int4, to_engine_int4, to_engine_order,
                                               to_engine_scales)
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    N, K = 128, 768
    w = torch.randint(-2**31, 2**31 - 1, (2, N, K // 8), generator=g, dtype=torch.int32)
    s = torch.rand(2, N, K // 32, generator=g).to(torch.bfloat16)
    ew, es = to_engine_int4(w, s, K)
    assert torch.equal(ew, to_engine_order(w, frag_gpb(K))) and torch.equal(es, to_engine_scales(s, frag_gpb(K)))
    assert not torch.equal(ew, w) and not torch.equal(es, s)
    bw, bs = from_engine_int4(ew, es, K)
    assert torch.equal(bw, w) and torch.equal(bs, s)
