"""Static batched steps (kdtree_engine/batch/graph_step.py), the arithmetic a CUDA graph replays, run eagerly on the
CPU: the running requests' rows laid into padded slots give each request what the host-driven batched forward gives
it (float32: to rounding), slots are re-used as requests come and go, and the scheduler's requests keep the tokens of
their solo runs."""

import random

import pytest
import torch

from kdtree_engine import logs
from kdtree_engine.batch import graph_step
from kdtree_engine.batch.graph_step import (BatchedSteps, padded_rows, resolve_step_mode, slot_bucket,
                                            width_bucket)
from kdtree_engine.batch.load_budget import allocate_budgets
from kdtree_engine.speculative.budget import default_candidates
from kdtree_engine.config import preset
from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.model.target import BatchPart, Target
from kdtree_engine.tokenizer import load_tokenizer

from batch_cases import batched, first_difference, make_cases, solo


def test_buckets_are_the_smallest_that_fit():
    for n in range(1, 300):
        assert slot_bucket(n) == min(2 ** k for k in range(12) if 2 ** k >= n)
        assert width_bucket(n) == min(w for w in [1, 2] + [1 + 2 ** k for k in range(12)] if w >= n)
        assert padded_rows(n, n) == slot_bucket(n) * width_bucket(n)


def test_step_mode_is_checked():
    assert resolve_step_mode(None, torch.device("cpu")) == "eager"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_step_mode("graph", torch.device("cpu"))
    with pytest.raises(ValueError, match="one of eager, static, graph"):
        resolve_step_mode("fast", torch.device("cpu"))


def _random_tree(rng: random.Random, n: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random tree of n nodes (root first, parents before children): ancestor-or-self mask, positions."""
    parent = [-1] + [rng.randrange(j) for j in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
        depth[i] = 0 if i == 0 else depth[parent[i]] + 1
    return mask, start + torch.tensor(depth)


def _parts(target: Target, rng: random.Random, prompts: list[list[int]], caches: list, shapes: list[int]
           ) -> list[BatchPart]:
    """One step per request: 0 a plain step (one row, causal), n > 0 a random tree of n nodes."""
    V = target.cfg.vocab_size
    parts = []
    for cache, n in zip(caches, shapes):
        if n == 0:
            parts.append(BatchPart(torch.tensor([rng.randrange(V)]), cache))
        else:
            mask, pos = _random_tree(rng, n, cache.length)
            parts.append(BatchPart(torch.tensor([rng.randrange(V) for _ in range(n)]), cache, pos, mask))
    return parts


def test_static_steps_equal_the_host_driven_forward(monkeypatch):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cfg = preset("k2-tiny").replace(num_hidden_layers=2, vocab_size=96)
    target = Target.random(cfg, seed=seed)
    free = target.pool().free_blocks
    monkeypatch.setattr(graph_step, "MAX_BUCKETS", 2)   # the third step's bucket drops the least recently used
    steps = BatchedSteps(target, "static")
    prompts = [[rng.randrange(96) for _ in range(rng.randint(3, 90))] for _ in range(6)]
    pairs = []   # (eager cache, static cache) per request: the same prompt in both
    for p in prompts:
        a, b = target.new_cache(len(p) + 200), target.new_cache(len(p) + 200)
        for c in (a, b):
            target.prefill(torch.tensor(p), c)
        pairs.append((a, b))
    # three steps; requests leave and join between them, so slots change hands and some stay empty
    used = set()
    for members in ([0, 1, 2, 3, 4], [0, 2, 4], [5, 1, 3]):
        shapes = [rng.choice([0, 0, 1, 3, 7, 17]) for _ in members]
        state = rng.getstate()
        eager = target.forward_batch(_parts(target, rng, prompts, [pairs[i][0] for i in members], shapes), (0, 1))
        rng.setstate(state)
        parts = _parts(target, rng, prompts, [pairs[i][1] for i in members], shapes)
        used.add(steps.key(parts, (0, 1)))
        static = steps.forward(parts, (0, 1))
        for i, n, e, s in zip(members, shapes, eager, static):
            torch.testing.assert_close(s.logits, e.logits, rtol=1e-5, atol=1e-5, msg=f"request {i}, {n} nodes")
            torch.testing.assert_close(s.aux, e.aux, rtol=1e-5, atol=1e-5)
            a, b = pairs[i]
            if n:   # a tree stays pending: keep its first path, as an accept walk would
                keep = torch.tensor([0])
                a.commit(keep)
                b.commit(keep)
            assert a.length == b.length
            torch.testing.assert_close(b.kv[:, :b.length], a.kv[:, :a.length], rtol=1e-5, atol=1e-5)
    assert len(steps.slots) == min(len(used), 2) and set(steps.slots) <= used
    steps.release()
    for a, b in pairs:
        a.release()
        b.release()
    assert target.pool().free_blocks == free


def test_scheduler_with_static_steps_keeps_solo_tokens():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    drafter, tok = load_drafter(DEMO_DIR / "draft", target), load_tokenizer(DEMO_DIR)
    cases = make_cases(tok, 8, seed, max_prompt=90, max_tokens=16)
    free = sorted(target.pool().free_ids())
    results, logits, sched = batched(target, drafter, cases, 48, token_budget=96, step_mode="static")
    assert sorted(target.pool().free_ids()) == free
    for i, (case, res, lg) in enumerate(zip(cases, results, logits)):
        ref, ref_logits = solo(target, drafter, case, 48)
        assert res.token_ids == ref.token_ids, (i, case.method, first_difference(res.token_ids, ref.token_ids))
        torch.testing.assert_close(lg, ref_logits, rtol=1e-4, atol=1e-4)


def test_padded_budgets_share_the_best_budget():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    for _ in range(50):
        n = int(torch.randint(1, 9, (1,), generator=g))
        expected = [torch.cumsum(torch.rand(int(torch.randint(1, 40, (1,), generator=g)), generator=g) * 0.8, 0)
                    for _ in range(n)]
        others, widest = int(torch.randint(0, 5, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g))
        a, b, d = (float(x) for x in torch.rand(3, generator=g))
        cost = lambda rows: 1 + a + b * rows / 16  # noqa: E731
        got = allocate_budgets(expected, others * widest, cost, fixed_tokens=others, draft_s=d * 0.1,
                               padded=(others, widest, padded_rows))

        def value(budgets: list[int]) -> float:
            tokens = others + sum(1 + (float(e[k - 1]) if k else 0.0) for e, k in zip(expected, budgets))
            rows = padded_rows(others + n, max([widest] + [1 + k for k in budgets]))
            return tokens / (cost(rows) + sum(k > 0 for k in budgets) * d * 0.1)
        ladder = {0} | {k for e in expected for k in default_candidates(len(e))}
        best = max(value([min(k, len(e)) for e in expected]) for k in ladder)
        assert value(got) >= value([0] * n) * (1 - 1e-12)   # never below plain
        assert value(got) >= best * (1 - 1e-12)             # the best budget shared on the ladders
        assert len({k for k, e in zip(got, expected) if k < len(e)}) <= 1   # one budget (or a request's largest)


def test_whole_short_prompts_of_a_step_take_the_prompt_graphs(monkeypatch):
    """With the target's prompt graphs set (the engine does on CUDA), a step's few whole short prompts run from them
    (one replay a prompt); each request still gives its solo run's tokens (float32 on the CPU, without capture)."""
    from kdtree_engine.model.prompt_graph import PromptGraphs
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    drafter, tok = load_drafter(DEMO_DIR / "draft", target), load_tokenizer(DEMO_DIR)
    cases = make_cases(tok, 6, seed, max_prompt=40, max_tokens=8)
    refs = [solo(target, drafter, c, 48) for c in cases]   # eager prompts
    target.prompt_graphs = PromptGraphs(target, capture=False)
    runs = []
    real = target.prompt_graphs.run
    monkeypatch.setattr(target.prompt_graphs, "run", lambda *a: (runs.append(a[0].shape[0]), real(*a))[1])
    results, _, _ = batched(target, drafter, cases, 48, token_budget=96, step_mode="static")
    assert sorted(runs) == sorted(len(c.prompt) for c in cases)   # every prompt from its bucket, once
    for i, (case, res, (ref, _)) in enumerate(zip(cases, results, refs)):
        assert res.token_ids == ref.token_ids, (i, case.method, first_difference(res.token_ids, ref.token_ids))


def test_slot_tensors_must_match_the_parts(caplog, monkeypatch):
    """A batch context's slot tensors name one slot per part of ``width`` rows each; on the CPU the slots' one-query
    steps attend per request (the torch attention), a choice logged once."""
    from kdtree_engine.kernels.dispatch import slot_attention_one_launch
    from kdtree_engine.kernels.policy import KernelPolicy
    from kdtree_engine.model.context import BatchContext, SlotTensors

    target = load_target(DEMO_DIR, device="cpu", dtype=torch.float32)
    target.init_cache_pool(tokens=512)
    caches = [target.new_cache(128) for _ in range(2)]
    ctxs = tuple(target.static_context(c.table, c.capacity, torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool),
                                       torch.tensor(0)) for c in caches)
    tables = torch.stack([c.table for c in caches])
    ok = BatchContext.of(ctxs, SlotTensors(tables, torch.zeros(2, dtype=torch.long), 128, 1))
    assert ok.slots is not None and ok.slots.width == 1
    with pytest.raises(ValueError, match="are not 2 slots of 2 rows"):
        BatchContext.of(ctxs, SlotTensors(tables, torch.zeros(2, dtype=torch.long), 128, 2))
    pool = target.pool().kv[0]
    q = torch.zeros(2, 1, pool.shape[-1] - 1)
    monkeypatch.setattr(logs, "_LOGGED", set())   # nothing logged yet in this test's eyes
    with caplog.at_level("DEBUG", logger="kdtree_engine"):
        assert not slot_attention_one_launch(KernelPolicy(), q, q[..., :1], pool)
        assert not slot_attention_one_launch(KernelPolicy(), q, q[..., :1], pool)
    said = [r.getMessage() for r in caplog.records if "batched one-query steps" in r.getMessage()]
    assert len(said) == 1 and "a launch per request (the torch attention)" in said[0], said
    for c in caches:
        c.release()
