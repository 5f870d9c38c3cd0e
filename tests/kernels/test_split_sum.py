"""The fixed-order partial sums (kernels/split_sum.py: split_sum, stream_sum) under the interpreter (child process, see _interp.py):
plain splits, and the stream partition of the dense fragment kernel (w4_frag.dense_partition), where a
column adds only the slots its row tile has and the others are never written (NaN-poisoned here). Oracle:
torch float32 sums in slot order over the slots a brute-force walk of the partition gives each tile; the
same bits are expected (the same additions in the same order)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

# name: (M, row tiles, rows per tile, K blocks per tile, programs; None: a plain split of `iters` slots)
CASES = {
    "stream_t5_i7_p9": (3, 5, 4, 7, 9),
    "stream_t6_i4_p17": (2, 6, 8, 4, 17),
    "stream_t3_i2_p5": (5, 3, 64, 2, 5),
    "aligned_t4_i6_p12": (1, 4, 16, 6, 12),
    "plain_split3": (4, 1, 100, 3, None),
}


def _slots_per_tile(tiles: int, iters: int, programs: int) -> list[int]:
    """How many programs share each row tile, by listing every block's program."""
    work = tiles * iters
    owners = [set() for _ in range(tiles)]
    for p in range(programs):
        for b in range(p * work // programs, (p + 1) * work // programs):
            owners[b // iters].add(p)
    return [len(o) for o in owners]


def _run_one(name, spec):
    from kdtree_engine.kernels.split_sum import split_sum, stream_sum

    M, tiles, rows, iters, programs = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    N = tiles * rows
    if programs is None:
        used, stream, split = [iters] * tiles, None, iters
    else:
        used = _slots_per_tile(tiles, iters, programs)
        stream, split = (rows, iters, tiles * iters, programs), max(used)
    parts = torch.empty(split, M, N)                # NaN in the child: slots a tile does not have stay so
    for t, u in enumerate(used):
        parts[:u, :, t * rows:(t + 1) * rows] = torch.randn(u, M, rows, generator=gen)
    out = torch.empty(M, N)
    if stream is None:
        split_sum(parts, out, split)
    else:
        stream_sum(parts, out, split, *stream)
    ref = torch.empty(M, N)
    for t, u in enumerate(used):
        acc = parts[0, :, t * rows:(t + 1) * rows].clone()
        for s in range(1, u):
            acc = acc + parts[s, :, t * rows:(t + 1) * rows]
        ref[:, t * rows:(t + 1) * rows] = acc
    return {"meta": out.shape == ref.shape, "nonfinite": int((~torch.isfinite(out)).sum()),
            "differ": int((out != ref).sum()), "seed": seed, "max_slots": split}


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_split_sum_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["meta"]
    assert rec["differ"] == 0, f"{rec['differ']} sums differ from the in-order torch sums (seed {rec['seed']})"
    if CASES[name][4] is not None and name.startswith("stream"):
        assert rec["max_slots"] >= 2, "the case does not cut any tile"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
