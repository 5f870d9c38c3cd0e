"""A batch's whole prompts attend in one launch of the prefill kernel (model/mla.py ``MLA._parts``,
kernels/prefill_attention.naive_prefill_prompts): each prompt's logits and cache latents in a batched forward equal,
bit for bit, its forward alone (a launch of its own), run on the CPU through the Triton interpreter with the CUDA
kernel choices (batch-invariant GEMM, the prefill kernel). In a child process: Triton decides at import whether a
kernel is interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent

CHILD = textwrap.dedent('''
    import json, logging, sys, torch
    torch.set_num_threads(1)
    from kdtree_engine import reference
    from kdtree_engine.config import preset
    from kdtree_engine.engine import target_from_weights
    from kdtree_engine.model.target import BatchPart
    seed = int(sys.argv[1])
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    cfg = preset("k2-tiny").replace(num_hidden_layers=2)
    w = reference.random_weights(cfg, seed)
    model = target_from_weights(cfg, {k: torch.from_numpy(v) for k, v in w.items()}, device="cpu",
                                dtype=torch.bfloat16)
    model.init_cache_pool(tokens=1024)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (9, 1, 20)]
    alone = []
    for ids in prompts:
        cache = model.new_cache(64)
        out = model(ids, cache)
        alone.append((out.logits, model.pool().kv[:, cache.table[0], :len(ids)].clone()))   # its latents
        cache.release()
    caches = [model.new_cache(64) for _ in prompts]
    outs = model.forward_batch([BatchPart(ids, c) for ids, c in zip(prompts, caches)])
    same = [bool(torch.equal(o.logits, a[0])) and bool(torch.equal(model.pool().kv[:, c.table[0], :len(ids)], a[1]))
            for o, c, a, ids in zip(outs, caches, alone, prompts)]
    print(json.dumps({"same": same}))
''')


def test_batched_whole_prompts_equal_their_own_forwards_interpreted() -> None:
    seed = int(torch.randint(0, 1 << 30, ()).item())
    print(f"seed {seed}")
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", KDTREE_DENSE_BACKEND="triton", KDTREE_ATTN_BACKEND="triton",
               OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", CHILD, str(seed)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "naive-form attention in one launch for all of them" in r.stderr, r.stderr[-3000:]
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["same"] == [True, True, True], f"seed {seed}: {rec}"
