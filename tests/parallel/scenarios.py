"""What every rank runs in the tensor-parallel tests: the same function at world size 1 (in the test process,
no process group) and on N ranks (spawned, gloo), so the results compare directly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kdtree_engine import reference
from kdtree_engine.batch.scheduler import Scheduler
from kdtree_engine.config import ModelConfig, preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.engine import target_from_weights
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.target import Target
from kdtree_engine.parallel.comm import Communicator
from kdtree_engine.quant import k2_quantization_config
from kdtree_engine.sampling import SamplingParams, sample, topk_logprobs
from kdtree_engine.sampling import greedy as greedy_pick
from kdtree_engine.speculative import host_rounds
from kdtree_engine.speculative.decode import generate, generate_device

CFG = preset("k2-tiny")  # n_group 2 / topk_group 1, a dense first layer, YaRN; heads 4, experts 8, vocab 256
GROUP = 32
STEPS = 32
SPEC_TOKENS = 16
SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
# the distribution check: one row of fixed logits, many draws in one call
DIST_V = CFG.vocab_size
DIST_DRAWS = 20000
DIST_PARAMS = SamplingParams(temperature=0.7, top_p=0.9, seed=5)


@dataclass(frozen=True)
class Case:
    seed: int
    full: bool = True  # False: greedy dense only (the 4-rank run)
    tp_sum: str | None = None  # KernelPolicy.tp_sum (None: by batch invariance, gather)


def prompt_of(seed: int, cfg: ModelConfig = CFG) -> list[int]:
    return np.random.default_rng(seed).integers(2, cfg.vocab_size, 6).tolist()


def drafter_cfg(cfg: ModelConfig, block: int = 5) -> DraftConfig:
    return DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=block, mask_token_id=cfg.vocab_size - 1,
                       target_layer_ids=(0, cfg.num_hidden_layers - 1), num_target_layers=cfg.num_hidden_layers,
                       vocab_size=cfg.vocab_size)


def dist_logits(seed: int) -> torch.Tensor:
    """The same [V] logits on every rank; unit scale, so the nucleus (top-p 0.9 at temperature 0.7) keeps many
    tokens for every seed (at scale 2 about 1 seed in 100 left one token: a distribution test of no degree of
    freedom)."""
    return torch.randn(DIST_V, generator=torch.Generator().manual_seed(seed))


def shard_of(target: Target, logits: torch.Tensor) -> torch.Tensor:
    vs = target.vocab_shard
    return logits if vs is None else logits[..., vs.start:vs.start + vs.size]


class OracleCache:
    def __init__(self) -> None:
        self.length = 0

    def crop(self, n: int) -> None:
        self.length = min(self.length, n)


class ShardedOracle:
    """A drafter that knows the greedy future: it ranks the true next token first (with probability ``miss``
    second), seeded by (start, bonus) so every rank proposes the same; its logits are this rank's vocabulary
    slice, like a drafter through the target's lm_head. Accepts often: the tree paths are exercised."""

    def __init__(self, future: list[int], block_size: int = 5, miss: float = 0.3) -> None:
        self.future, self.block_size, self.miss = future, block_size, miss
        self.target_layer_ids = (0,)

    def new_cache(self, max_tokens: int) -> OracleCache:
        return OracleCache()

    def propose(self, target: Target, ctx: Any, bonus: torch.Tensor, cache: OracleCache, start: int) -> torch.Tensor:
        cache.length = start
        V = target.cfg.vocab_size
        g = torch.Generator().manual_seed(start * 1000 + int(bonus))
        logits = torch.randn(self.block_size - 1, V, generator=g)
        for k in range(1, self.block_size):
            if start + k < len(self.future):
                t = self.future[start + k]
                miss = float(torch.rand((), generator=g)) < self.miss
                logits[k - 1, (t + 1 + int(torch.randint(0, V - 1, (), generator=g))) % V if miss else t] = 12.0
                if miss:
                    logits[k - 1, t] = 11.0
        return shard_of(target, logits)


def recording_trees(fn: Any, trees: list) -> Any:
    """A builder of many trees that records the trees it builds (tokens and parents)."""
    def build(*a: Any, **k: Any) -> Any:
        built = fn(*a, **k)
        trees.extend((tree.tokens.tolist(), tree.parents.tolist()) for tree in built)
        return built
    return build


def run(comm: Communicator, case: Case) -> dict[str, Any]:
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    prompt = prompt_of(case.seed)
    target = Target.random(CFG, seed=case.seed, comm=comm, policy=KernelPolicy(tp_sum=case.tp_sum))
    greedy = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    out["dense"] = generate(target, prompt, greedy).token_ids
    if not case.full:
        return out
    wq = {k: torch.from_numpy(np.ascontiguousarray(v))
          for k, v in reference.random_weights(CFG, case.seed, quantize_experts_group=GROUP).items()}
    qcfg = CFG.replace(quantization=k2_quantization_config(GROUP))
    qtarget = target_from_weights(qcfg, wq, device="cpu", dtype=torch.float32, comm=comm)
    out["int4"] = generate(qtarget, prompt, greedy).token_ids
    drafter = DFlashDrafter.random(drafter_cfg(CFG), seed=case.seed)
    short = SamplingParams(max_tokens=SPEC_TOKENS, ignore_eos=True)
    out["none"] = generate(target, prompt, short).token_ids
    trees: list = []
    saved = host_rounds.build_trees_heap
    host_rounds.build_trees_heap = recording_trees(saved, trees)
    try:
        for spec, budget in (("dflash", None), ("ddtree", 4), ("ddtree", 16)):
            trees.clear()
            r = generate(target, prompt, short, spec=spec, drafter=drafter, budget=budget)
            out[f"{spec}-{budget}"] = (r.token_ids, r.stats["accepted_per_depth"], r.stats["rounds"], list(trees))
        oracle = ShardedOracle(prompt + out["none"])
        for spec, budget in (("dflash", None), ("ddtree", 8)):
            trees.clear()
            r = generate(target, prompt, short, spec=spec, drafter=oracle, budget=budget)
            out[f"oracle-{spec}-{budget}"] = (r.token_ids, r.stats["accepted_per_depth"], r.stats["rounds"],
                                              list(trees))
        # device-resident rounds (the CUDA-graph round, run eagerly here): the same tokens
        out["device-ddtree"] = generate_device(target, prompt, short, method="ddtree", drafter=drafter, budget=4,
                                               graph=False).token_ids
        r = generate(target, prompt, SAMPLED, spec="ddtree", drafter=drafter, budget=8)
        out["sampled-ddtree"] = r.token_ids
    finally:
        host_rounds.build_trees_heap = saved
    out["sampled"] = generate(target, prompt, SAMPLED).token_ids
    # a batch of plain greedy requests: their picks in one reduction over the vocabulary shards
    prompts = [prompt_of(case.seed + k) for k in range(1, 4)]
    batch_params = SamplingParams(max_tokens=8, ignore_eos=True)
    sched = Scheduler(target, None)
    seqs = [sched.submit(p, batch_params) for p in prompts]
    sched.run()
    sched.close()
    out["batch"] = [s.result.token_ids for s in seqs]
    out["batch-solo"] = [generate(target, p, batch_params).token_ids for p in prompts]
    tie = torch.zeros(2, CFG.vocab_size)  # ties across the two halves of the vocabulary
    tie[0, [200, 5, 130]] = 3.0
    tie[1, [255, 128]] = 1.0
    vs, pol = target.vocab_shard, target.policy
    out["tie-greedy"] = greedy_pick(shard_of(target, tie), policy=pol, vocab=vs).tolist()
    lp, ids = topk_logprobs(shard_of(target, tie), 4, policy=pol, vocab=vs)
    out["tie-topk"] = (lp.tolist(), ids.tolist())
    g = torch.Generator().manual_seed(DIST_PARAMS.seed)
    rows = shard_of(target, dist_logits(case.seed)).expand(DIST_DRAWS, -1)
    out["draws"] = torch.bincount(sample(rows, DIST_PARAMS, g, policy=target.policy, vocab=target.vocab_shard),
                                  minlength=DIST_V).tolist()
    return out
