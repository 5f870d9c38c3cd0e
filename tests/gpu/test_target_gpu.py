"""The target on CUDA: HF parity in float32, golden tokens in float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.engine import greedy_from_weights, target_from_weights

from hf_oracle import hf_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


@pytest.mark.parametrize("variant", [{}, {"first_k_dense_replace": 2, "n_routed_experts": 16, "n_group": 4,
                                          "topk_group": 2, "num_experts_per_tok": 3}])
def test_hf_parity_on_cuda_float32(variant: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = preset("k2-tiny").replace(**variant)
    seed = int(np.random.default_rng().integers(1 << 30))
    w = reference.random_weights(cfg, seed)
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, cfg.vocab_size, 20))
    with torch.no_grad():
        ref = hf_model(cfg, w)(ids[None]).logits[0]
    model = target_from_weights(cfg, {k: torch.from_numpy(v) for k, v in w.items()}, device="cuda",
                                dtype=torch.float32)
    out = model(ids.cuda(), model.new_cache(20)).logits
    assert rel(out, ref) < 1e-4
    cache = model.new_cache(20)
    parts = [model(ids[:4].cuda(), cache).logits] + [model(ids[t:t + 1].cuda(), cache).logits for t in range(4, 20)]
    assert rel(torch.cat(parts), ref) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", [None, "w4a16"])
def test_golden_tokens_on_cuda(dtype: torch.dtype, quant: str | None) -> None:
    from kdtree_engine.bundle import make_bundle

    b = make_bundle(preset("k2-tiny"), seed=7, n_tokens=64, prompt_len=8, quant=quant)
    weights = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.weights.items()}
    got = greedy_from_weights(b.cfg, weights, [int(t) for t in b.prompt_ids], len(b.golden_tokens), "cuda", dtype)
    assert got == [int(t) for t in b.golden_tokens]
