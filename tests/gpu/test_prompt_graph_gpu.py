"""Prompt steps replayed from CUDA graphs per length bucket (model/prompt_graph.py), bit for bit (bfloat16, batch
invariance on): the last token's logits, the drafter's aux rows and the cache latents of every prompt equal the eager
prompt forward's, for prompts of random lengths up to the largest bucket, on the demo target (INT4 experts).

    python3 -m pytest -m gpu tests/gpu/test_prompt_graph_gpu.py -v -s
"""

from __future__ import annotations

import random

import pytest
import torch

from kdtree_engine.engine import DEMO_DIR, load_drafter, load_target
from kdtree_engine.model.prompt_graph import MAX_BUCKET, PromptGraphs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_prompt_graphs_equal_the_eager_prompt_forward_bit_for_bit():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    dev = torch.device("cuda")
    target = load_target(DEMO_DIR, device=dev, dtype=torch.bfloat16, progress=False)
    aux = tuple(load_drafter(DEMO_DIR / "draft", target).target_layer_ids)
    graphs = PromptGraphs(target, capture=True)
    V = target.cfg.vocab_size
    bad = []
    for T in [1, 16, 17, MAX_BUCKET] + [rng.randint(1, MAX_BUCKET) for _ in range(20)]:
        ids = torch.randint(0, V, (T,), device=dev, generator=torch.Generator(device=dev).manual_seed(rng.randrange(1 << 30)))
        a, b = target.new_cache(T + rng.choice([1, 600])), target.new_cache(T + rng.choice([1, 600]))
        target.prompt_graphs = None
        ref = target.prefill(ids, a, aux)
        target.prompt_graphs = graphs
        out = target.prefill(ids, b, aux)
        if not (torch.equal(out.logits, ref.logits) and torch.equal(out.aux, ref.aux)
                and torch.equal(b.kv[:, :T], a.kv[:, :T])):
            bad.append(f"{T} tokens: logits max |diff| {(out.logits - ref.logits).abs().max():.3g}")
        a.release()
        b.release()
    assert len(graphs.buckets) >= 2 and all(s.captured.graph is not None for s in graphs.buckets.values())
    assert not bad, "\n".join(bad)
