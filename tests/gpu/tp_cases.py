"""What every rank runs in the multi-GPU tensor-parallel tests (tests/gpu/test_tp_gpu.py): the same function on one
GPU in the test process and on N ranks (spawned, NCCL, rank r on cuda:r), so the results compare directly."""

from __future__ import annotations

from typing import Any

import torch

from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.target import Target
from kdtree_engine.parallel.batch import RankedScheduler, follow_batch
from kdtree_engine.parallel.broadcast import BatchOpen, recv_message
from kdtree_engine.parallel.comm import Communicator
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate, generate_device
from tests.parallel.scenarios import CFG, drafter_cfg, prompt_of

TOKENS = 32
DEMO_PROMPT = [5, 17, 301, 42, 9, 1200, 77, 3]   # ids of the demo's 4096-token vocabulary


def _build(comm: Communicator, model: str, seed: int, dtype_name: str) -> tuple[Any, Any, list[int], torch.device]:
    """The target (``model`` "demo": the embedded demo and its drafter, each rank reading its slices; "k2-tiny": random
    K2-shaped weights and a random drafter) in ``dtype_name`` on this rank's GPU, its drafter and a prompt."""
    dev = torch.device("cuda", comm.rank if comm.world_size > 1 else 0)
    torch.cuda.set_device(dev)
    dtype = getattr(torch, dtype_name)
    policy = KernelPolicy.from_env(batch_invariant=True)
    if model == "demo":
        target = load_target(DEMO_DIR, device=dev, dtype=dtype, policy=policy, comm=comm, progress=False)
        return target, load_drafter(DEMO_DIR / "draft", target), DEMO_PROMPT, dev
    target = Target.random(CFG, seed, dtype=dtype, device=dev, policy=policy, comm=comm)
    drafter = DFlashDrafter.random(drafter_cfg(CFG), seed, dtype=dtype, device=dev, policy=policy)
    return target, drafter, prompt_of(seed), dev


def decode_case(comm: Communicator, model: str, seed: int, dtype_name: str) -> dict[str, Any]:
    """Greedy tokens of one target (:func:`_build`): plain and DDTree, host-driven and replayed from CUDA graphs (the
    collectives captured in them)."""
    target, drafter, prompt, _ = _build(comm, model, seed, dtype_name)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    out: dict[str, Any] = {"rank": comm.rank, "world": comm.world_size}
    out["plain"] = generate(target, prompt, params, eager=True).token_ids
    out["ddtree"] = generate(target, prompt, params, spec="ddtree", drafter=drafter, budget=8, eager=True).token_ids
    out["graph-plain"] = generate_device(target, prompt, params, method="none", graph=True).token_ids
    out["graph-ddtree"] = generate_device(target, prompt, params, method="ddtree", drafter=drafter, budget=8,
                                          graph=True).token_ids
    return out


def batch_case(comm: Communicator, model: str, seed: int, dtype_name: str) -> dict[str, Any]:
    """Four requests (plain and DDTree 8, prompts of different lengths) each run alone, then together through one
    continuous batch whose steps replay from CUDA graphs (rank 0's RankedScheduler at TP-N, the other ranks following
    it; a Scheduler on one GPU): each one's greedy tokens, alone and in the batch (rank 0's)."""
    target, drafter, prompt, dev = _build(comm, model, seed, dtype_name)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    reqs = [(prompt, "none", None), (prompt, "ddtree", 8), (prompt[:5], "none", None), (prompt[2:], "ddtree", 8)]
    out: dict[str, Any] = {"rank": comm.rank, "world": comm.world_size}
    out["solo"] = [generate(target, p, params, spec=m, drafter=None if m == "none" else drafter, budget=b,
                            eager=True).token_ids for p, m, b in reqs]
    if comm.rank > 0:
        opened = recv_message(comm, dev)
        assert isinstance(opened, BatchOpen), f"rank {comm.rank}: expected a batch, got {opened!r}"
        follow_batch(target, drafter, comm, dev, opened)
        return out
    sched = (RankedScheduler(target, drafter, comm, dev, token_budget=256) if comm.world_size > 1
             else Scheduler(target, drafter, token_budget=256))
    seqs = [sched.submit(p, params, spec=m, budget=b) for p, m, b in reqs]
    sched.run()
    sched.close()
    out["batch"] = [s.result.token_ids for s in seqs]
    return out
