"""The one-program DDTree builder (Triton, under the interpreter in a child process) returns the
identical tree to the host heap builder: random log-probs, ties (coarsely rounded log-probs), -inf
entries, budgets below / at / above the number of prefixes, the in-kernel mask and the torch one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from kdtree_engine.kernels.tree_ops import build_tree_triton  # noqa: E402
from kdtree_engine.speculative.tree import build_tree_heap  # noqa: E402
from kdtree_engine.sampling import topk_logprobs  # noqa: E402

# name: (L, V, budget, kind)
CASES = {
    "L15_V50_b16": (15, 50, 16, "rand"),
    "L15_V50_b64": (15, 50, 64, "rand"),
    "L7_V3_b200": (7, 3, 200, "rand"),        # budget above the number of prefixes (3+9+...)
    "L3_V4_b100": (3, 4, 100, "rand"),
    "L5_V20_b40_ties": (5, 20, 40, "ties"),
    "L6_V30_b24_neginf": (6, 30, 24, "neginf"),
    "L1_V9_b4": (1, 9, 4, "rand"),
    "L4_V10_b1": (4, 10, 1, "rand"),
    "L4_V10_b0": (4, 10, 0, "rand"),
    "L15_V40_b150_torchmask": (15, 40, 150, "rand"),  # > 128 nodes: mask from speculative.tree.ancestor_mask
    "round_demo_ddtree16": (0, 0, 16, "round"),  # device-resident rounds with this builder == plain decoding
}
DEMO = HERE.parents[2] / "kdtree_engine" / "assets" / "demo"


def _run_round(budget):
    from kdtree_engine.engine import load_drafter, load_target, load_tokenizer
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate
    from kdtree_engine.speculative.decode import generate_device

    if not (DEMO / "config.json").exists():
        return {"bad": [], "skipped": "no demo"}
    target = load_target(DEMO, device=torch.device("cpu"), dtype=torch.float32, progress=False,
                         policy=KernelPolicy(tree="triton"))
    drafter = load_drafter(DEMO / "draft", target)
    prompt = load_tokenizer(DEMO).encode("def add(a, b):\n    return", special=True, add_special_tokens=True)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = generate(target, prompt, params, eager=True)
    got = generate_device(target, prompt, params, method="ddtree", drafter=drafter, budget=budget, graph=False)
    return {"bad": [] if got.token_ids == plain.token_ids else ["tokens"], "tau": got.stats["tau"]}


def _run_one(name, spec):
    L, V, budget, kind = spec
    if kind == "round":
        rec = _run_round(budget)
        rec["seed"] = 0
        return rec
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(L, V, generator=gen) * 3
    if kind == "ties":
        logits = (logits * 2).round() / 2  # many equal log-probs
    if kind == "neginf":
        logits[:, V // 2:] = float("-inf")
    lp, ids = topk_logprobs(logits, max(budget, 1), policy=POLICY)
    lp, ids = lp[:, :max(budget, 1)], ids[:, :max(budget, 1)]
    ref = build_tree_heap(lp, ids, budget, 7, 30)
    got = build_tree_triton(lp, ids, budget, torch.tensor(7), torch.tensor(30))
    bad = [f for f in ("tokens", "parents", "depths", "positions", "mask")
           if not torch.equal(getattr(ref, f), getattr(got, f))]
    return {"bad": bad, "nodes": ref.num_nodes, "seed": seed}


import _interp  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

interp_results = _interp.results_fixture(HERE, list(CASES))


@pytest.mark.parametrize("name", list(CASES))
def test_triton_tree_equals_heap_interpreted(interp_results, name):
    rec = interp_results[name]
    _interp.check_ran(rec)
    assert not rec["bad"], f"fields {rec['bad']} differ from the heap's tree (seed {rec['seed']})"


if __name__ == "__main__" and "--interp-cases" in sys.argv:
    from _interp import child_main

    child_main(CASES, _run_one, sys.argv[sys.argv.index("--interp-cases") + 1:])
