"""The dense fragment kernel's stream partition (kernels/w4_frag.py: dense_plan, dense_partition), on the CPU.

The kernel walks program p's blocks [p * work // programs, (p + 1) * work // programs) of the row-tile-major
work, cuts them at row-tile ends and writes each run to slot (p - the tile's first program), the tile's first
program zeroing the slots its tile leaves unused. Checked here against a brute-force walk of the same ranges."""

import random

import pytest

from kdtree_engine.kernels.w4_frag import (DENSE_MAX_SEGMENTS, DENSE_MIN_BLOCKS, DENSE_PARTITION_ROWS,
                                           dense_partition, dense_plan, stream_program)


def _walk(tiles: int, iters: int, programs: int) -> dict[int, list[tuple[int, int, int]]]:
    """tile -> its segments (program, first block, blocks), in program order, by listing every block."""
    work = tiles * iters
    owner = [None] * work
    for p in range(programs):
        for b in range(p * work // programs, (p + 1) * work // programs):
            assert owner[b] is None, "ranges overlap"
            owner[b] = p
    assert None not in owner, "a block belongs to no program"
    segs: dict[int, list[tuple[int, int, int]]] = {t: [] for t in range(tiles)}
    for b, p in enumerate(owner):
        t, k = divmod(b, iters)
        if segs[t] and segs[t][-1][0] == p:
            q, k0, n = segs[t][-1]
            segs[t][-1] = (q, k0, n + 1)
        else:
            segs[t].append((p, k, 1))
    return segs


@pytest.mark.parametrize("case", range(40))
def test_partition_slots_and_owner_formula(case):
    rng = random.Random(1000 + case)
    tiles, iters = rng.randint(1, 40), rng.randint(1, 30)
    programs = rng.randint(1, tiles * iters)
    segs = _walk(tiles, iters, programs)
    work = tiles * iters
    owner = lambda b: stream_program(b, work, programs)  # noqa: E731 - the kernels' closed form
    for t, ss in segs.items():
        first = owner(t * iters)
        assert [p for p, _, _ in ss] == list(range(first, first + len(ss))), (tiles, iters, programs, t)
        assert owner(t * iters + iters - 1) - first + 1 == len(ss)
        assert sum(n for _, _, n in ss) == iters and ss[0][1] == 0
        for (p, k0, n), nxt in zip(ss, ss[1:] + [None]):
            assert nxt is None or nxt[1] == k0 + n, "segments of a tile are not contiguous in k"
    touched = [len({b // iters for b in range(p * work // programs, (p + 1) * work // programs)})
               for p in range(programs)]
    if max(touched) > DENSE_MAX_SEGMENTS:
        with pytest.raises(ValueError, match="the kernel unrolls them"):
            dense_partition(tiles, iters, programs)
    else:
        assert dense_partition(tiles, iters, programs) == (max(len(ss) for ss in segs.values()), max(touched))


@pytest.mark.parametrize("tiles,iters,split", [(288, 28, 2), (16, 28, 4), (3, 2, 1), (5, 12, 6)])
def test_split_is_the_aligned_partition(tiles, iters, split):
    """programs = tiles x s: every tile cut into s equal K ranges, slot i holding range i."""
    segs = _walk(tiles, iters, tiles * split)
    assert dense_partition(tiles, iters, tiles * split) == (split, 1)
    for t, ss in segs.items():
        assert [(p - t * split, k0, n) for p, k0, n in ss] == [(i, i * iters // split, iters // split)
                                                            for i in range(split)]


def test_partition_refuses_bad_counts():
    with pytest.raises(ValueError, match="programs must be in 1..12"):
        dense_partition(3, 4, 13)
    with pytest.raises(ValueError, match="programs must be in"):
        dense_partition(3, 4, 0)
    with pytest.raises(ValueError, match="overflow int32"):
        dense_partition(1 << 12, 1 << 10, 1 << 10)


def test_dense_plan_k2_shapes():
    """One wave of 4 programs per SM where the matrix has the blocks (132 SMs), else >= 4 blocks each."""
    blocks = lambda n, k: (n // 64) * (k // 256)  # noqa: E731 - 64-row K blocks of 256
    assert dense_plan(36864, 7168, 132) == (8, 4 * 132)
    assert dense_plan(4096, 7168, 132) == (8, blocks(4096, 7168) // DENSE_MIN_BLOCKS)
    assert dense_plan(7168, 2048, 132) == (8, blocks(7168, 2048) // DENSE_MIN_BLOCKS)
    assert dense_plan(36864, 7168, 78) == (8, 4 * 78)
    assert dense_plan(64, 256, 132) == (8, 1)
    assert DENSE_PARTITION_ROWS == 64
    assert dense_plan(131072, 256, 132) == (8, 1024)   # 2048 row tiles of one block: at most 2 per program
    for n, k, sms in ((36864, 7168, 132), (4096, 7168, 132), (7168, 2048, 132), (131072, 256, 132), (192, 512, 8)):
        pt = DENSE_PARTITION_ROWS
        assert dense_partition(n // pt, k // 256, dense_plan(n, k, sms)[1])[1] <= 3
