"""Continuous batching on the GPU, bit for bit (bfloat16, batch invariance on, the default): every request's tokens
and the target logits of every token it emits equal its solo run, for 24 concurrent requests of different prompt
lengths (some cut into prefill chunks), methods (plain, chain, trees of 4 to 32 nodes), greedy or sampled with
their own seeds, arriving at different steps; the demo pair (INT4 experts).

    python3 -m pytest -m gpu tests/gpu/test_batch_gpu.py -v -s
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target, load_tokenizer

from batch_cases import batched, first_difference, make_cases, solo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHUNK = 64


@pytest.mark.parametrize("token_budget,step_mode,auto_slots", [(128, "graph", True), (4096, "graph", False),
                                                                (128, "eager", False)])
def test_demo_batch_bitwise_equals_solo(token_budget, step_mode, auto_slots):
    """step_mode graph (the CUDA default): the running requests' rows replayed from CUDA graphs per slot bucket;
    eager: every part in one host-driven forward. auto_slots: the load-aware requests in tree slots."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}, token budget {token_budget}, batched steps {step_mode}")
    dev = torch.device("cuda")
    target = load_target(DEMO_DIR, device=dev, dtype=torch.bfloat16, progress=False)
    drafter = load_drafter(DEMO_DIR / "draft", target)
    cases = make_cases(load_tokenizer(DEMO_DIR), 24, seed, max_prompt=200, max_tokens=48)
    # every fifth greedy request load-aware (with auto_slots in tree slots at the budget its group picks each step; a
    # sampled one's draws follow its budgets, which follow the load: its tokens keep the distribution, not the solo
    # run's values)
    cases = [replace(c, method="ddtree", budget="auto") if i % 5 == 2 and c.params.greedy else c
             for i, c in enumerate(cases)]
    free = sorted(target.pool().free_ids())
    results, logits, sched = batched(target, drafter, cases, CHUNK, token_budget, step_mode, auto_slots)
    print(f"{sched.forwards} batched forwards, {sched.rows_run} rows, "
          f"{sum(len(r.token_ids) for r in results)} tokens")
    assert sorted(target.pool().free_ids()) == free
    bad = []
    for i, (case, res, lg) in enumerate(zip(cases, results, logits)):
        ref, ref_logits = solo(target, drafter, case, CHUNK)
        if res.token_ids != ref.token_ids:
            bad.append(f"request {i} ({case.method} {case.budget}, prompt {len(case.prompt)}): tokens, "
                       f"{first_difference(res.token_ids, ref.token_ids)}")
        elif not torch.equal(lg, ref_logits):
            rows = (lg != ref_logits).any(1).nonzero().flatten().tolist()
            bad.append(f"request {i} ({case.method} {case.budget}): logits of {len(rows)} emitted tokens differ, "
                       f"first {rows[0]}, max |diff| {(lg - ref_logits).abs().max():.3g}")
    assert not bad, "\n".join(bad)


def test_llm_generate_batch_equals_generate():
    """The Python API on CUDA: a batch (host-driven batched rounds) against each prompt alone (graph rounds)."""
    from kdtree_engine import LLM, SamplingParams
    llm = LLM(device="cuda")
    prompts = ["def f(x):", "class Stack:", "import os\n", "for i in range(10):"]
    params = SamplingParams(max_tokens=64)
    solo = llm.generate(prompts, params)
    batch = llm.generate_batch(prompts, params)
    assert [r.token_ids for r in batch] == [r.token_ids for r in solo]


def test_draft_slots_graph_equals_eager():
    """The batched draft pass over static slots (kdtree_engine/batch/draft_slots.py) replayed from CUDA graphs gives
    the logits of the same pass run eagerly, bit for bit, as requests take slots (past the first slots: a second
    capture), draft in changing subsets, carry whole prompts into their first pass and give their slots back."""
    from kdtree_engine.batch.draft_slots import DraftSlots
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    target = load_target(DEMO_DIR, device=dev, dtype=torch.bfloat16, progress=False)
    drafter = load_drafter(DEMO_DIR / "draft", target)
    B, V = drafter.cfg.block_size, target.cfg.vocab_size
    feat = len(drafter.target_layer_ids) * target.cfg.hidden_size
    graph, eager = DraftSlots(target, drafter, "graph"), DraftSlots(target, drafter, "static")

    def new_request() -> dict:
        prompt, limit = rng.randint(1, 3 * B), rng.randint(8, 40)
        where = [s.take(prompt + limit + 1) for s in (graph, eager)]
        for s, w in zip((graph, eager), where):
            s.cache(w).length = 0
        return {"where": where, "start": prompt, "end": prompt + limit,
                "ctx": torch.randn(prompt, feat, generator=gen, device=dev).to(target.dtype)}

    live = [new_request() for _ in range(4)]
    bad = []
    for step in range(16):
        if step == 4:   # 4 slots full and captured: three more requests make them double
            live += [new_request() for _ in range(3)]
        asked = [r for r in live if rng.random() < 0.7] or live[:1]
        for r in asked:
            r["bonus"] = torch.tensor(rng.randrange(V), device=dev)
        got = [s.propose([(r["where"][k], r["ctx"], r["bonus"], r["start"]) for r in asked])
               for k, s in enumerate((graph, eager))]
        bad += [f"step {step} request {i}" for i, (a, b) in enumerate(zip(*got)) if not torch.equal(a, b)]
        for r in asked:
            accepted = rng.randint(1, B)
            r["start"] += accepted
            r["ctx"] = torch.randn(accepted, feat, generator=gen, device=dev).to(target.dtype)
        for r in [r for r in live if r["start"] + B > r["end"]]:
            for s, w in zip((graph, eager), r["where"]):
                s.give(w)
            live.remove(r)
            live.append(new_request())
    print(f"{graph.captures} captures")
    assert graph.captures >= 2 and not bad, "\n".join(bad)
