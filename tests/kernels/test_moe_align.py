"""The MoE align kernel (pairs grouped by expert into BLOCK_M-row blocks) under the interpreter against a
torch oracle: a stable sort of the pair ids by expert, cut into blocks per expert. Fresh random ids per
run (repeats, -1 and ids >= E for experts owned elsewhere); the child poisons every buffer it allocates
(-77777), so an unwritten block-table entry or row shows up."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import _interp  # noqa: E402

CASES = {
    # name: (pairs P, experts E, BLOCK_M, ids mode)
    # up to ALIGN_ONE_PROGRAM (64) pairs: the one-program kernel; more: one program per expert
    "p1_e5_bm16": (1, 5, 16, "valid"),
    "p8_e384_bm8": (8, 384, 8, "valid"),
    "p64_e4_bm8_unowned": (64, 4, 8, "unowned"),
    "p50_e3_bm16_skewed": (50, 3, 16, "skewed"),
    "p24_e384_bm16": (24, 384, 16, "valid"),
    "p40_e3_bm8_multiblock": (40, 3, 8, "valid"),
    "p77_e9_bm16_unowned": (77, 9, 16, "unowned"),
    "p300_e6_bm32_skewed": (300, 6, 32, "skewed"),
    "p1500_e17_bm16_chunks": (1500, 17, 16, "unowned"),  # more pairs than one CH chunk
    "p64_e8_bm16_all_unowned": (64, 8, 16, "none"),
}


def random_ids(P: int, E: int, mode: str, gen: torch.Generator) -> torch.Tensor:
    if mode == "valid":
        return torch.randint(0, E, (P,), generator=gen)
    if mode == "unowned":  # -1 and ids past E belong to other ranks
        return torch.randint(-1, E + 3, (P,), generator=gen)
    if mode == "skewed":  # one expert takes most pairs: several blocks of it
        ids = torch.randint(0, E, (P,), generator=gen)
        return torch.where(torch.rand(P, generator=gen) < 0.7, torch.zeros_like(ids), ids)
    return torch.full((P,), -1, dtype=torch.int64)


def align_oracle(ids: torch.Tensor, E: int, bm: int) -> tuple[list[list[int]], list[int], list[int]]:
    """(pairs of each used block, expert of each used block, rows of each used block), in block order."""
    blocks, experts, rows = [], [], []
    for e in range(E):
        pairs = (ids == e).nonzero().flatten().tolist()  # ascending pair index: a stable grouping
        for b0 in range(0, len(pairs), bm):
            blocks.append(pairs[b0:b0 + bm])
            experts.append(e)
            rows.append(len(pairs[b0:b0 + bm]))
    return blocks, experts, rows


def _run_one(name, spec):
    from kdtree_engine.kernels.moe_w4a16 import moe_align

    P, E, bm, mode = spec
    seed = int.from_bytes(os.urandom(4), "little")
    ids = random_ids(P, E, mode, torch.Generator().manual_seed(seed))
    sorted_pairs, blk_expert, blk_rows = moe_align(ids.view(-1, 1), E, bm)
    blocks, experts, rows = align_oracle(ids, E, bm)
    n = len(blocks)
    got_blocks = [sorted_pairs[b * bm:b * bm + int(blk_rows[b])].tolist() for b in range(min(n, blk_rows.numel()))]
    return {"seed": seed, "max_blocks": blk_rows.numel(), "n_used": n,
            "blocks_ok": got_blocks == blocks,
            "experts_ok": blk_expert[:n].tolist() == experts,
            "rows_ok": blk_rows[:n].tolist() == rows,
            # unused blocks: rows 0 (the GEMMs skip them) and a valid expert id (never read past E)
            "tail_ok": bool((blk_rows[n:] == 0).all()) and bool((blk_expert[n:] == 0).all())}


interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_moe_align_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    P, E, bm, _ = CASES[name]
    assert rec["max_blocks"] >= rec["n_used"], f"block table too short (seed {rec['seed']})"
    for key in ("blocks_ok", "experts_ok", "rows_ok", "tail_ok"):
        assert rec[key], f"{key} failed (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
