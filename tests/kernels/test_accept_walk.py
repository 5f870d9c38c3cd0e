"""The one-program accept walk (kernels/accept_walk.py, under the interpreter in a child process) against the
torch walk of device rounds (speculative/walks.py walk_flat) and the literal host walk (accept_reference): random DDTrees and chains, the target's picks
drawn to follow a random root path to a random depth (then an off-tree token) or fully random, the root
alone; accepted nodes, emitted tokens, count and bonus must be identical. Also device-resident rounds with
this walk (none / dflash / ddtree, tiny random pair) emit exactly plain decoding's tokens."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.accept_walk import accept_walk  # noqa: E402
from kdtree_engine.speculative.accept import accept_reference  # noqa: E402
from kdtree_engine.speculative.walks import walk_flat  # noqa: E402
from kdtree_engine.speculative.tree import build_tree, chain_tree  # noqa: E402
from kdtree_engine.sampling import topk_logprobs  # noqa: E402

# name: (L = max depth, V, budget (None: a chain of L drafts), trials)
CASES = {
    "tree_L15_V40_b16": (15, 40, 16, 12),
    "tree_L15_V6_b64": (15, 6, 64, 12),
    "tree_L5_V3_b200": (5, 3, 200, 8),
    "tree_L4_V9_b2": (4, 9, 2, 8),
    "chain_L15": (15, 50, None, 8),
    "chain_L3": (3, 50, None, 8),
    "root_alone": (0, 50, None, 3),
    "rounds_tiny_pair": (0, 0, 0, 0),
}


def _picks(tree, V: int, gen: torch.Generator) -> torch.Tensor:
    """Picks that follow a random root path for a random number of steps (or random picks)."""
    n1 = tree.tokens.shape[0]
    picks = torch.randint(0, V + 5, (n1,), generator=gen)   # tokens >= V are never in the tree
    if torch.rand((), generator=gen) < 0.8:
        par = tree.parents.tolist()
        node = int(torch.randint(0, n1, (), generator=gen))
        while node > 0:   # make the parent pick this node's token, up to the root
            picks[par[node]] = tree.tokens[node]
            node = par[node]
    return picks


def _rounds() -> dict:
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate
    from kdtree_engine.speculative.decode import generate_device
    sys.path.insert(0, str(HERE.parents[1] / "speculative"))
    from test_device_round import _tiny_pair

    target, drafter = _tiny_pair(policy=KernelPolicy(tree="triton"))
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    bad = []
    for prompt in ([5, 6, 7, 8], [3, 200, 17, 99, 41, 2, 250]):
        ref = generate(target, prompt, params)
        for method, budget in (("none", None), ("dflash", None), ("dflash", 2), ("ddtree", 3), ("ddtree", 16)):
            r = generate_device(target, prompt, params, method=method, drafter=None if method == "none" else drafter,
                                budget=budget, graph=False, ahead=False)
            if r.token_ids != ref.token_ids:
                bad.append(f"{method}-{budget} {prompt}")
    return {"bad": bad, "seed": 0}


def random_tree(L: int, V: int, budget: int | None, gen: torch.Generator):
    """A DDTree of ``budget`` nodes (None: the argmax chain of L drafts) from random drafter logits; root V + 1."""
    logits = torch.randn(L, V, generator=gen) * 3
    if budget is None:
        return chain_tree(torch.tensor(V + 1), logits.argmax(-1), torch.tensor(12))
    lp, ids = topk_logprobs(logits, budget, policy=POLICY)
    return build_tree(lp, ids, budget, torch.tensor(V + 1), torch.tensor(12))


def walk_mismatches(tree, picks: torch.Tensor, L: int, device: torch.device) -> list[str]:
    """The kernel's walk on ``device`` against the torch walk and the host walk (CPU tensors in): the names
    of the outputs that differ (count, accepted nodes, emitted tokens, bonus)."""
    n1 = tree.tokens.shape[0]
    m = min(L + 1, n1)
    nodes, counts, bonuses, emitted = walk_flat(tree.tokens, tree.parents, tree.depths, picks,
                                                torch.zeros(1, dtype=torch.long), torch.zeros(n1, dtype=torch.long), n1)
    count, acc, emitted, bonus = int(counts[0]), nodes[0, :m], emitted[0, :m], bonuses[0]
    path, ref_bonus = accept_reference(tree, picks)
    a, r, b = (torch.empty(shape, dtype=torch.long, device=device) for shape in ((m,), (m + 1,), ()))
    accept_walk(tree.tokens.to(device), tree.parents.to(device), picks.to(device), m, L, a, r, b)
    checks = {
        "count": int(r[m]) == count == len(path),
        "acc": torch.equal(a.cpu(), acc) and a[:count].tolist() == path,
        "emitted": torch.equal(r[:count].cpu(), emitted[:count]),
        "bonus": int(b) == int(bonus) == ref_bonus,
    }
    return [f"{k} (A={count})" for k, ok in checks.items() if not ok]


def _run_one(name, spec):
    L, V, budget, trials = spec
    if name == "rounds_tiny_pair":
        return _rounds()
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    bad = []
    for t in range(trials):
        tree = random_tree(L, V, budget, gen)
        bad += [f"trial {t}: {k}" for k in walk_mismatches(tree, _picks(tree, V, gen), L, torch.device("cpu"))]
    return {"bad": bad, "seed": seed}


def test_rejects_bad_inputs():
    t = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="picks"):
        accept_walk(t, t, torch.zeros(3, dtype=torch.long), 2, 3, t[:2], t[:3], t[0])
    with pytest.raises(ValueError, match="result"):
        accept_walk(t, t, t, 2, 3, t[:2], t[:2], t[0])
    with pytest.raises(ValueError, match="m="):
        accept_walk(t, t, t, 5, 3, torch.zeros(5, dtype=torch.long), torch.zeros(6, dtype=torch.long), t[0])


import _interp  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_interpreted(interp_results, name):
    rec = interp_results[name]
    assert "error" not in rec, rec["error"]
    assert not rec["bad"], f"{rec['bad']} (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
