"""What every rank runs in the multi-GPU tensor-parallel tests (tests/gpu/test_tp_gpu.py): the same function on one
GPU in the test process and on N ranks (spawned, NCCL, rank r on cuda:r), so the results compare directly."""

from __future__ import annotations

from typing import Any

import torch

from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.target import Target
from kdtree_engine.parallel.comm import Communicator
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate, generate_device
from tests.parallel.scenarios import CFG, drafter_cfg, prompt_of

TOKENS = 32
DEMO_PROMPT = [5, 17, 301, 42, 9, 1200, 77, 3]   # ids of the demo's 4096-token vocabulary


def decode_case(comm: Communicator, model: str, seed: int, dtype_name: str) -> dict[str, Any]:
    """Greedy tokens of one target (``model`` "demo": the embedded demo and its drafter, each rank reading its
    slices; "k2-tiny": random K2-shaped weights and a random drafter) in ``dtype_name``: plain and DDTree,
    host-driven and replayed from CUDA graphs (the collectives captured in them)."""
    dev = torch.device("cuda", comm.rank if comm.world_size > 1 else 0)
    torch.cuda.set_device(dev)
    dtype = getattr(torch, dtype_name)
    policy = KernelPolicy.from_env(batch_invariant=True)
    if model == "demo":
        target = load_target(DEMO_DIR, device=dev, dtype=dtype, policy=policy, comm=comm, progress=False)
        drafter = load_drafter(DEMO_DIR / "draft", target)
        prompt = DEMO_PROMPT
    else:
        target = Target.random(CFG, seed, dtype=dtype, device=dev, policy=policy, comm=comm)
        drafter = DFlashDrafter.random(drafter_cfg(CFG), seed, dtype=dtype, device=dev, policy=policy)
        prompt = prompt_of(seed)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    out: dict[str, Any] = {"rank": comm.rank, "world": comm.world_size}
    out["plain"] = generate(target, prompt, params, eager=True).token_ids
    out["ddtree"] = generate(target, prompt, params, spec="ddtree", drafter=drafter, budget=8, eager=True).token_ids
    out["graph-plain"] = generate_device(target, prompt, params, method="none", graph=True).token_ids
    out["graph-ddtree"] = generate_device(target, prompt, params, method="ddtree", drafter=drafter, budget=8,
                                          graph=True).token_ids
    return out
