"""Tree slots (device-resident batched tree rounds, kdtree_engine/batch/tree_slots.py) at TP-2 (gloo, the embedded demo
on two CPU ranks, float32, static steps: the arithmetic CUDA replays from graphs): every rank runs the same steps over
the same greedy DDTree / DFlash requests (the vocabulary reductions inside the round give every rank the same picks
and trees), and each request's tokens equal its run alone on the same ranks. Random prompts, seed printed."""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate

from ranks import run_ranks

SHAPES = [("ddtree", 8), ("dflash", None), ("ddtree", 8), ("ddtree", 4), ("ddtree", 8), ("ddtree", 8)]


def batch_and_solo(comm: Any, seed: int) -> dict:
    target = load_target(DEMO_DIR, device=torch.device("cpu"), dtype=torch.float32, progress=False, comm=comm)
    drafter = load_drafter(DEMO_DIR / "draft", target)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(3, 30))] for _ in SHAPES]
    params = [SamplingParams(max_tokens=rng.randrange(6, 24), ignore_eos=True) for _ in SHAPES]
    sched = Scheduler(target, drafter, step_mode="static")
    seqs = [sched.submit(p, sp, spec=m, budget=b) for p, sp, (m, b) in zip(prompts[:4], params[:4], SHAPES[:4])]
    sched.step()
    sched.step()
    seqs += [sched.submit(p, sp, spec=m, budget=b) for p, sp, (m, b) in zip(prompts[4:], params[4:], SHAPES[4:])]
    groups = []
    while not sched.idle:
        groups.append(len(sched.tree_slots))
        sched.step()
    sched.close()
    solo = [generate(target, p, sp, spec=m, drafter=drafter, budget=b, eager=True).token_ids
            for p, sp, (m, b) in zip(prompts, params, SHAPES)]
    return {"batch": [s.result.token_ids for s in seqs], "solo": solo, "groups": max(groups)}


def test_tree_slots_at_tp2_equal_each_request_alone() -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    ranks = run_ranks(2, batch_and_solo, seed, timeout_s=120.0)
    assert ranks[0]["groups"] == 3   # ddtree-8, dflash, ddtree-4
    for r, out in enumerate(ranks):
        assert out["batch"] == out["solo"], f"rank {r}: a request's tokens in tree slots differ from its solo run"
    assert ranks[0]["batch"] == ranks[1]["batch"]
