"""Long context: chunked prefill at positions past YaRN's original window against transformers' DeepseekV3,
greedy decoding continued after it, and speculative decoding after it equal to plain decoding.

Models: random tiny K2-shaped targets (2 layers: one dense, one MoE; hidden 64, 2 heads) with YaRN and a
16K-32K position window. Logits are compared as max |ours - HF| / max |HF| (relative to the logit scale):
transformers computes the rope angles in float32, so at position p its cos / sin carry an error of order
p * 2^-24 (ours are float64 tables rounded once), which a max-abs bound of 1e-4 would charge to the
engine. The rope tables themselves are checked against the float64 numpy reference at every position of
the window.

Sizes: one HF forward over 16K tokens does not fit the test budget on two cores (its [T, T] scores; see
docs/long_context.md), so the prompt past the original window is 5K tokens long (positions up to 10x the
original window, 5 chunks), and positions past 16K are reached by a 2K-token prompt placed at positions
16K-32K (HF's position_ids, our ``positions``): the same rope rows a 32K prompt would use, over a shorter
causal span.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine import reference
from kdtree_engine.config import ModelConfig, YarnConfig, preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.engine import target_from_weights
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.model.layers import Rope
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import generate, generate_device

from hf_oracle import hf_model
from speculative.spec_toys import ToyDrafter, oracle_proposals


def long_cfg(factor: float, original: int, max_positions: int) -> ModelConfig:
    # both layers dense: what is under test is attention and YaRN at long positions; a router's near-tie (two experts
    # within float32 noise of each other, which a 5000-token prompt meets for some seeds) would flip an expert
    # between two correct float32 computations and move the logits far more than the tolerance
    return preset("k2-tiny").replace(
        num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=2, vocab_size=128,
        max_position_embeddings=max_positions,
        rope_scaling=YarnConfig(factor=factor, original_max_position_embeddings=original, beta_fast=32.0,
                                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))


def seeded() -> int:
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    return seed


def models(cfg: ModelConfig, seed: int) -> tuple[Target, torch.nn.Module]:
    w = reference.random_weights(cfg, seed % (1 << 20))
    target = target_from_weights(cfg, {k: torch.from_numpy(v) for k, v in w.items()}, device="cpu",
                                 dtype=torch.float32)
    return target, hf_model(cfg, w)


def rel_to_scale(ours: torch.Tensor, hf: torch.Tensor) -> float:
    return float((ours.double() - hf.double()).abs().max() / hf.double().abs().max())


def test_rope_tables_match_float64_reference_over_the_window() -> None:
    for cfg in (long_cfg(32.0, 512, 16384), long_cfg(16.0, 2048, 32768), long_cfg(40.0, 4096, 32768)):
        pos = torch.arange(cfg.max_position_embeddings)
        cos, sin = Rope(cfg).tables(pos)
        rc, rs = reference.rope_cos_sin(cfg, pos.numpy())
        assert np.abs(cos.numpy() - rc).max() < 1e-6 and np.abs(sin.numpy() - rs).max() < 1e-6


def test_multi_chunk_prefill_past_the_original_window_matches_hf() -> None:
    cfg = long_cfg(32.0, 512, 16384)
    seed = seeded()
    target, hf = models(cfg, seed)
    T = 5000  # 5 chunks of 1024 (the last one 904), positions up to ~10x original_max_position_embeddings
    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, cfg.vocab_size, T))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    out = target.prefill(ids, target.new_cache(T), chunk=1024, all_logits=True)
    assert out.chunks == 5
    assert rel_to_scale(out.logits, ref) < 1e-4, f"seed={seed}"
    assert rel_to_scale(out.logits[-1024:], ref[-1024:]) < 1e-4, f"last chunk, seed={seed}"


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_chunks_at_positions_past_16k_match_hf(form: str) -> None:
    cfg = long_cfg(16.0, 2048, 32768)
    seed = seeded()
    target, hf = models(cfg, seed)
    rng = np.random.default_rng(seed)
    T = 2048
    first = int(rng.integers(16384, cfg.max_position_embeddings - T))
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, T))
    pos = torch.arange(first, first + T)
    with torch.no_grad():
        ref = hf(ids[None], position_ids=pos[None]).logits[0].float()
    out = target.prefill(ids, target.new_cache(T), chunk=512, form=form, all_logits=True, positions=pos)
    assert out.chunks == 4
    assert rel_to_scale(out.logits, ref) < 1e-4, f"positions {first}.., seed={seed}"


def test_greedy_after_multi_chunk_prefill_matches_hf_greedy() -> None:
    cfg = long_cfg(8.0, 512, 4096)
    seed = seeded()
    target, hf = models(cfg, seed)
    T, steps = 3000, 5
    prompt = np.random.default_rng(seed).integers(2, cfg.vocab_size, T).tolist()
    got = generate(target, prompt, SamplingParams(max_tokens=steps, ignore_eos=True), prefill_chunk=512)
    assert got.stats["prefill_chunks"] == 6
    want = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(steps):
            want.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[want[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    assert got.token_ids == want, f"seed={seed}"


def test_speculative_after_multi_chunk_prefill_equals_plain() -> None:
    cfg = long_cfg(8.0, 512, 4096)
    seed = seeded()
    target = Target.random(cfg, seed=seed % (1 << 20))
    prompt = np.random.default_rng(seed).integers(2, cfg.vocab_size - 1, 1500).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    chunk = 256
    plain = generate(target, prompt, params, prefill_chunk=chunk)
    assert plain.stats["prefill_chunks"] == 6
    dcfg = DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4,
                       mask_token_id=cfg.vocab_size - 1, target_layer_ids=(0, 1), num_target_layers=2,
                       vocab_size=cfg.vocab_size)
    drafter = DFlashDrafter.random(dcfg, seed=seed % 1000)
    # an oracle drafter that knows the plain tokens (70% of the time) and checks every context row it is
    # given (the prompt's rows come from the chunked prefill) against one forward over the whole sequence
    full = prompt + plain.token_ids
    ref_aux = target(torch.tensor(full), target.new_cache(len(full)), aux_layers=(0, 1)).aux

    def check_ctx(ctx: torch.Tensor, lo: int, hi: int) -> None:
        torch.testing.assert_close(ctx, ref_aux[lo:hi], rtol=1e-4, atol=1e-4)

    oracle = ToyDrafter(4, oracle_proposals(full, cfg.vocab_size, seed=seed % 1000, miss=0.3),
                        target_layer_ids=(0, 1), check_ctx=check_ctx)
    for spec, budget, d in (("dflash", None, drafter), ("ddtree", 8, drafter), ("ddtree", 8, oracle),
                            ("dflash", None, oracle)):
        r = generate(target, prompt, params, spec=spec, drafter=d, budget=budget, prefill_chunk=chunk)
        assert r.token_ids == plain.token_ids, (spec, budget, type(d).__name__, f"seed={seed}")
        assert r.stats["prefill_chunks"] == 6 and (d is not oracle or r.stats["tau"] > 1.0), r.stats
    r = generate_device(target, prompt, params, method="ddtree", drafter=drafter, budget=8, graph=False,
                        prefill_chunk=chunk)
    assert r.token_ids == plain.token_ids and r.stats["prefill_chunks"] == 6, f"seed={seed}"
