"""Mixed concurrent requests through the continuous batch against each request's solo run, shared by the CPU test
(tests/batch/) and the GPU test (tests/gpu/test_batch_gpu.py).

The oracle is the request alone: the engine's host-driven generation loop (speculative/decode.run_rounds) over one
request, the same prompt chunking, its own seed. Against it each batched request must give the same tokens and
(compared by the caller: bit for bit on the GPU) the same target logits for every emitted token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.config import resolve_spec
from kdtree_engine.speculative.decode import GenerationResult, round_shape, run_rounds
from kdtree_engine.speculative.host_rounds import HostRounds

# (method, budget): plain, chains, trees of several budgets
METHODS = [("none", None), ("dflash", None), ("ddtree", 4), ("ddtree", 16), ("dflash", 3), ("ddtree", 32)]


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    params: SamplingParams
    method: str
    budget: int | None
    arrives: int  # the scheduler step at which it is submitted


def source_text() -> str:
    """Python source to cut prompts from (the standard library: the demo was trained on Python)."""
    import json
    import textwrap
    return "\n".join(Path(m.__file__).read_text() for m in (json, textwrap, random))


def make_cases(tokenizer, n: int, seed: int, *, max_prompt: int, max_tokens: int, sampled_every: int = 4) -> list[Case]:
    """``n`` requests of different prompt lengths (cut from Python source at random offsets), methods, budgets,
    lengths and arrival steps; every ``sampled_every``-th one sampled with its own seed, the rest greedy."""
    rng = random.Random(seed)
    ids = tokenizer.encode(source_text())
    cases = []
    for i in range(n):
        length = rng.randint(4, max_prompt)
        start = rng.randrange(0, len(ids) - length)
        method, budget = METHODS[i % len(METHODS)]
        sampled = i % sampled_every == sampled_every - 1
        params = SamplingParams(max_tokens=rng.randint(4, max_tokens), ignore_eos=True,
                                temperature=0.8 if sampled else 0.0, seed=1000 + i)
        cases.append(Case(ids[start:start + length], params, method, budget, arrives=rng.choice([0, 0, 1, 2, 3, 5, 8])))
    return cases


def solo(target, drafter, case: Case, chunk: int) -> tuple[GenerationResult, torch.Tensor]:
    """The request alone through the host-driven loop: its result and the target logits [n, V] of its emitted
    tokens (row k: the logits the k-th token was picked from)."""
    d = drafter if case.method != "none" else None
    shape = round_shape(resolve_spec(case.method, d, case.budget), target, d, case.prompt)
    made: list[HostRounds] = []

    def make(limit: int) -> HostRounds:
        r = HostRounds(target, d, shape, case.params, limit, len(case.prompt), "auto", chunk)
        r.emitted_logits = []
        made.append(r)
        return r
    res = run_rounds(target, case.prompt, case.params, shape, None, make, "eager")
    return res, torch.cat(made[0].emitted_logits)[:len(res.token_ids)]


def batched(target, drafter, cases: list[Case], chunk: int, token_budget: int, step_mode: str | None = None,
            auto_slots: bool = False) -> tuple[list[GenerationResult], list[torch.Tensor], Scheduler]:
    """Every case through one scheduler, each submitted at its arrival step; results and emitted-token logits. The
    scheduler is closed at the end (its static steps' graphs and buffers dropped)."""
    sched = Scheduler(target, drafter, token_budget=token_budget, prefill_chunk=chunk, keep_logits=True,
                      step_mode=step_mode, auto_slots=auto_slots)
    seqs: list = [None] * len(cases)
    step = 0
    while step <= max(c.arrives for c in cases) or not sched.idle:
        for i, c in enumerate(cases):
            if c.arrives == step:
                seqs[i] = sched.submit(c.prompt, c.params, spec=c.method, budget=c.budget)
        sched.step()
        step += 1
    logits = [torch.cat(s.rounds.emitted_logits)[:len(s.result.token_ids)] for s in seqs]
    sched.close()
    return [s.result for s in seqs], logits, sched


def first_difference(a: list[int], b: list[int]) -> str:
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {k} of {len(a)} / {len(b)}"
