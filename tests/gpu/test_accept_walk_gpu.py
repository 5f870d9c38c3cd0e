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

from kdtree_engine.kernels.accept_walk import accept_walk  # noqa: E402
from kdtree_engine.spec.accept import accept_path_mask, accept_reference  # noqa: E402
from kdtree_engine.spec.device_round import accepted_order, emitted_tokens  # noqa: E402
from kdtree_engine.spec.tree import build_tree, chain_tree, topk_logprobs  # noqa: E402
from test_accept_walk import _picks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


@pytest.mark.parametrize("budget", [None, 4, 16, 64, 127])
def test_walk_matches_torch_and_host(budget: int | None) -> None:
    L, V = 15, 30
    gen = torch.Generator().manual_seed(budget or 0)
    for _ in range(20):
        logits = torch.randn(L, V, generator=gen) * 3
        if budget is None:
            tree = chain_tree(torch.tensor(V + 1), logits.argmax(-1), torch.tensor(40))
        else:
            lp, ids = topk_logprobs(logits, budget)
            tree = build_tree(lp, ids, budget, torch.tensor(V + 1), torch.tensor(40))
        n1 = tree.tokens.shape[0]
        m = min(L + 1, n1)
        picks = _picks(tree, V, gen)
        on_path, bonus = accept_path_mask(tree, picks)
        count = int(on_path.sum())
        acc = accepted_order(on_path, tree.depths, m)
        emitted = emitted_tokens(tree.tokens, acc, on_path.sum(), bonus)
        path, ref_bonus = accept_reference(tree, picks)
        a, r, b = (torch.empty(s, dtype=torch.long, device=DEV) for s in ((m,), (m + 1,), ()))
        accept_walk(tree.tokens.to(DEV), tree.parents.to(DEV), picks.to(DEV), m, L, a, r, b)
        assert int(r[m]) == count == len(path)
        assert torch.equal(a.cpu(), acc) and a[:count].tolist() == path
        assert torch.equal(r[:count].cpu(), emitted[:count])
        assert int(b) == int(bonus) == ref_bonus
