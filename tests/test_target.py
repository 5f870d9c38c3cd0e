"""The torch target against independent oracles: HF transformers and the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import preset
from kdtree_engine.engine import load_target, target_from_weights
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate
from kdtree_engine.weights import save_checkpoint

from hf_oracle import hf_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


VARIANTS = {
    "k2-tiny": {},  # YaRN on, n_group 2, one dense layer
    "two-dense": {"first_k_dense_replace": 2},
    "groups4": {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3},
    "no-yarn-no-qlora": {"rope_scaling": None, "q_lora_rank": None},
}


def tiny(variant: str):
    return preset("k2-tiny").replace(**VARIANTS[variant])


def torch_weights(w: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in w.items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hf_parity_prefill_and_cached_decode(variant: str) -> None:
    cfg = tiny(variant)
    seed = int(np.random.default_rng().integers(1 << 30))
    weights = reference.random_weights(cfg, seed)
    rng = np.random.default_rng(seed)
    T = 24
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, T))
    hf = hf_model(cfg, weights)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    model = target_from_weights(cfg, torch_weights(weights), device="cpu", dtype=torch.float32)
    out = model(ids, model.new_cache(T)).logits
    assert rel(out, ref) < 1e-4, f"prefill seed={seed}"
    # Token by token through the latent cache (absorbed MLA), after a short prefill.
    cache = model.new_cache(T)
    parts = [model(ids[:3], cache).logits] + [model(ids[t:t + 1], cache).logits for t in range(3, T)]
    assert rel(torch.cat(parts), ref) < 1e-4, f"decode seed={seed}"
    # A multi-token chunk over a cached prefix (absorbed path with causal block).
    cache = model.new_cache(T)
    chunked = torch.cat([model(ids[:10], cache).logits, model(ids[10:], cache).logits])
    assert rel(chunked, ref) < 1e-4, f"chunk seed={seed}"


def test_aux_hidden_states_match_hf_hidden_states() -> None:
    cfg = tiny("two-dense")
    weights = reference.random_weights(cfg, 3)
    ids = torch.from_numpy(np.random.default_rng().integers(0, cfg.vocab_size, 9))
    hf = hf_model(cfg, weights)
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states
    model = target_from_weights(cfg, torch_weights(weights), device="cpu", dtype=torch.float32)
    # HF's last entry is taken after the final norm, so the check stops one layer short of it.
    layers = (2, 0, 1)
    aux = model(ids, model.new_cache(16), aux_layers=layers).aux
    H = cfg.hidden_size
    for j, L in enumerate(layers):
        assert rel(aux[:, j * H:(j + 1) * H], hs[L + 1][0]) < 1e-5, f"aux layer {L} must be HF hidden_states[{L + 1}]"


@pytest.mark.parametrize("variant", ["k2-tiny", "groups4"])
def test_numpy_reference_logits_and_greedy_64(variant: str) -> None:
    cfg = tiny(variant)
    seed = int(np.random.default_rng().integers(1 << 30))
    weights = reference.random_weights(cfg, seed)
    prompt = np.random.default_rng(seed).integers(0, cfg.vocab_size, 7).tolist()
    model = target_from_weights(cfg, torch_weights(weights), device="cpu", dtype=torch.float32)
    ref_logits = torch.from_numpy(reference.forward(cfg, weights, np.array(prompt)))
    assert rel(model(torch.tensor(prompt), model.new_cache(8)).logits, ref_logits) < 1e-4
    want = reference.greedy(cfg, weights, prompt, 64)
    got = generate(model, prompt, SamplingParams(max_tokens=64, ignore_eos=True)).token_ids
    assert got == want, f"seed={seed}"


def test_tree_mask_equals_causal_for_a_chain() -> None:
    """A verify block whose mask is a chain computes what causal decoding computes."""
    cfg = tiny("k2-tiny")
    model = Target.random(cfg, seed=5)
    ids = torch.randint(0, cfg.vocab_size, (12,))
    c1 = model.new_cache(16)
    model(ids[:6], c1)
    causal = model(ids[6:], c1).logits
    c2 = model.new_cache(16)
    model(ids[:6], c2)
    tree = model(ids[6:], c2, tree_mask=torch.ones(6, 6, dtype=torch.bool).tril()).logits
    assert rel(tree, causal) < 1e-6
    assert c2.length == 6 and c2.pending == 6
    c2.commit(torch.arange(6))
    assert torch.equal(c1.kv[:, :12], c2.kv[:, :12])


def test_k26_layout_gives_the_same_tokens(tmp_path) -> None:
    cfg = tiny("k2-tiny")
    weights = torch_weights(reference.random_weights(cfg, 11))
    save_checkpoint(tmp_path / "k2", cfg, weights, layout="k2")
    save_checkpoint(tmp_path / "k26", cfg, weights, layout="k25", shard_bytes=200_000,
                    extra={"vision_tower.patch_embed.weight": torch.randn(4, 4)})
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = []
    for d in ("k2", "k26"):
        model = load_target(tmp_path / d, device=torch.device("cpu"), dtype=torch.float32, progress=False)
        outs.append(generate(model, prompt, params).token_ids)
    assert outs[0] == outs[1]
    assert len(list((tmp_path / "k26").glob("*.safetensors"))) > 1


def test_bfloat16_matches_robust_golden_tokens() -> None:
    """In bfloat16 on the CPU the engine reproduces a golden bundle's float64 reference tokens."""
    from kdtree_engine.bundle import make_bundle

    seed = int(np.random.default_rng().integers(1 << 20))
    b = make_bundle(preset("k2-tiny"), seed=seed, n_tokens=24, prompt_len=8)
    w = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.weights.items()}
    model = target_from_weights(b.cfg, w, device="cpu", dtype=torch.bfloat16)
    got = generate(model, [int(t) for t in b.prompt_ids], SamplingParams(max_tokens=24, ignore_eos=True)).token_ids
    assert got == [int(t) for t in b.golden_tokens], f"seed={seed} robust={b.meta['robust']}"
