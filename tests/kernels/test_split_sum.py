"""The fixed-order partial sums under the interpreter (child process, see _interp.py): split_sum / stream_sum
(kernels/split_sum.py) and the MoE's SwiGLU and top-k sums (moe_w4a16.moe_swiglu / moe_topk_sum): plain
splits, and stream partitions (w4_frag.dense_partition, as the fragment kernels cut their work), where a
column adds only the slots its row tile has and the others are never written (NaN-poisoned here, as are the
partials of pairs routed to no expert here, id -1). Oracle: torch float32 sums in slot order over the slots
a brute-force walk of the partition gives each tile; the same bits are expected (the same additions in the
same order), and for SwiGLU the same up to the exponential's last ulp. The top-k sum with an addend (the shared
expert's output) must give the bits of the sum plus the addend (float32 here; bf16 on the GPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

# name: (M, row tiles, rows per tile, K blocks per tile, programs; None: a plain split of `iters` slots);
# moe_*: M is the token count (top-3 of 5 experts, some pairs routed to -1)
CASES = {
    "stream_t5_i7_p9": (3, 5, 4, 7, 9),
    "stream_t6_i4_p17": (2, 6, 8, 4, 17),
    "stream_t3_i2_p5": (5, 3, 64, 2, 5),
    "aligned_t4_i6_p12": (1, 4, 16, 6, 12),
    "plain_split3": (4, 1, 100, 3, None),
    "moe_swiglu_stream_t5_i7_p9": (3, 5, 4, 7, 9),
    "moe_swiglu_split2": (2, 1, 24, 2, None),
    "moe_topk_stream_t6_i4_p17": (4, 6, 8, 4, 17),
    "moe_topk_split1": (2, 1, 40, 1, None),
    "moe_topk_add_stream_t6_i4_p17": (4, 6, 8, 4, 17),
    "moe_topk_add_split1": (3, 1, 40, 1, None),
}
MOE_E, MOE_K = 5, 3


def _slots_per_tile(tiles: int, iters: int, programs: int) -> list[int]:
    """How many programs share each row tile, by listing every block's program."""
    work = tiles * iters
    owners = [set() for _ in range(tiles)]
    for p in range(programs):
        for b in range(p * work // programs, (p + 1) * work // programs):
            owners[b // iters].add(p)
    return [len(o) for o in owners]


def _poisoned_partials(used, slots, lead, rows, gen, cols_offset=(0,)):
    """[slots, lead, N * len(cols_offset)]: random where a tile has the slot (at each column offset), NaN elsewhere."""
    n = len(used) * rows
    parts = torch.full((slots, lead, n * len(cols_offset)), float("nan"))
    for off in cols_offset:
        for t, u in enumerate(used):
            c = off * n + t * rows
            parts[:u, :, c:c + rows] = torch.randn(u, lead, rows, generator=gen)
    return parts


def _in_order(parts, used, rows, acc0=None):
    """sum over s < used[tile] of parts[s] in s order (from acc0 when given, else from slot 0)."""
    out = torch.empty(parts.shape[1:])
    for t, u in enumerate(used):
        cols = slice(t * rows, (t + 1) * rows)
        acc = parts[0, ..., cols].clone() if acc0 is None else acc0[..., cols].clone() + parts[0, ..., cols]
        for s_ in range(1, u):
            acc = acc + parts[s_, ..., cols]
        out[..., cols] = acc
    return out


def _run_moe(name, spec, gen):
    from kdtree_engine.kernels.moe_w4a16 import moe_swiglu, moe_topk_sum
    from kdtree_engine.kernels.split_sum import Partition
    from kdtree_engine.kernels.w4_dequant import DEQ_FLOAT

    T, tiles, rows, iters, programs = spec
    N = tiles * rows
    if programs is None:
        used, part = [iters] * tiles, Partition.split(N, iters)
    else:
        used, part = _slots_per_tile(tiles, iters, programs), Partition(rows, tiles, iters, programs)
    slots = max(used)
    ids = torch.stack([torch.randperm(MOE_E, generator=gen)[:MOE_K] for _ in range(T)]).to(torch.int32)
    ids[::2, 1] = -1                                  # routed to another rank: no partials, nothing added
    flat = ids.reshape(-1)
    P = flat.numel()
    if name.startswith("moe_swiglu"):
        parts = _poisoned_partials(used, slots, P, rows, gen, cols_offset=(0, 1))   # gate | up
        parts[:, flat < 0] = float("nan")
        inter = torch.full((P, N), -7.0)
        moe_swiglu(parts, inter, flat, MOE_E, slots, part, DEQ_FLOAT, 32)
        zero = torch.zeros(P, N)
        g = _in_order(parts[..., :N], used, rows, zero)
        u = _in_order(parts[..., N:], used, rows, zero)
        ref = g / (1.0 + torch.exp(-g)) * u
        ok = flat >= 0
        got, want = inter[ok], ref[ok]
        return {"meta": bool((inter[~ok] == -7.0).all()), "nonfinite": int((~torch.isfinite(got)).sum()),
                "differ": int((~torch.isclose(got, want, rtol=1e-5, atol=1e-6)).sum()), "max_slots": slots}
    y = _poisoned_partials(used, slots, P, rows, gen)
    y[:, flat < 0] = float("nan")
    # _add: plus an addend (the shared expert's output) at a row stride of its own. float32 here: the interpreter
    # rounds float32 -> bf16 otherwise than the GPU (half up), so the bf16 rounding is checked on the GPU
    # (tests/gpu/test_w4_frag_gpu.py); here that the addend's element is the one added
    add = torch.randn(T, N + 3, generator=gen)[:, 1:N + 1] * 4 if "_add" in name else None
    out = torch.full((T, N), -7.0)
    moe_topk_sum(y, out, flat, MOE_E, MOE_K, slots, part, 16, add=add)
    ref = torch.zeros(T, N)
    for t in range(T):
        for j in range(MOE_K):
            p = t * MOE_K + j
            if flat[p] < 0:
                continue
            for c in range(tiles):
                cols = slice(c * rows, (c + 1) * rows)
                for s_ in range(used[c]):
                    ref[t, cols] = ref[t, cols] + y[s_, p, cols]
    if add is not None:
        ref = ref + add
    return {"meta": True, "nonfinite": int((~torch.isfinite(out)).sum()), "differ": int((out != ref).sum()),
            "max_slots": slots}


def _run_one(name, spec):
    from kdtree_engine.kernels.split_sum import Partition, split_sum, stream_sum

    M, tiles, rows, iters, programs = spec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    if name.startswith("moe_"):
        return {**_run_moe(name, spec, gen), "seed": seed}
    N = tiles * rows
    if programs is None:
        used, stream, split = [iters] * tiles, None, iters
    else:
        used = _slots_per_tile(tiles, iters, programs)
        stream, split = Partition(rows, tiles, iters, programs), max(used)
    parts = _poisoned_partials(used, split, M, rows, gen)
    out = torch.empty(M, N)
    if stream is None:
        split_sum(parts, out, split)
    else:
        stream_sum(parts, out, split, stream)
    ref = _in_order(parts, used, rows)
    return {"meta": out.shape == ref.shape, "nonfinite": int((~torch.isfinite(out)).sum()),
            "differ": int((out != ref).sum()), "seed": seed, "max_slots": split}


import _interp  # noqa: E402

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_split_sum_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert rec["meta"], "the launch wrote where it must not (or the shapes differ)"
    assert rec["nonfinite"] == 0, f"{rec['nonfinite']} outputs read a slot the tile does not have (seed {rec['seed']})"
    assert rec["differ"] == 0, f"{rec['differ']} sums differ from the in-order torch sums (seed {rec['seed']})"
    if CASES[name][4] is not None and "stream" in name:
        assert rec["max_slots"] >= 2, "the case does not cut any tile"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
