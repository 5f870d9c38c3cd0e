"""The one-program accept walk on CUDA against the torch walk and the literal host walk (the cases of
tests/kernels/test_accept_walk.py run on the device), DDTrees up to 128 nodes and chains of 15 drafts.

    pytest -m gpu tests/gpu/test_accept_walk_gpu.py -v
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

from test_accept_walk import _picks, random_tree, walk_mismatches  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


@pytest.mark.parametrize("budget", [None, 4, 16, 64, 127])
def test_walk_matches_torch_and_host(budget: int | None) -> None:
    L, V = 15, 30
    gen = torch.Generator().manual_seed(budget or 0)
    for _ in range(20):
        tree = random_tree(L, V, budget, gen)
        assert not walk_mismatches(tree, _picks(tree, V, gen), L, DEV)
