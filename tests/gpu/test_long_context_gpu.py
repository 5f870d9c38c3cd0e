"""CUDA: chunked prefill (model/prefill.py) on a random K2-tiny target with a 16K YaRN window.

  * a multi-chunk prefill equals the one-shot forward (float32, relative to the logit scale), both forms;
  * the measured prefill peak (stats["prefill_peak_bytes"]) is bounded by the chunk, not the prompt;
  * greedy graph rounds (dflash, ddtree) after a multi-chunk prefill give exactly plain decoding's tokens
    (bfloat16).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cfg():
    from kdtree_engine.config import YarnConfig, preset

    return preset("k2-tiny").replace(
        max_position_embeddings=16384,
        rope_scaling=YarnConfig(factor=32.0, original_max_position_embeddings=512, beta_fast=32.0, beta_slow=1.0,
                                mscale=1.0, mscale_all_dim=1.0))


def _prompt(cfg, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, cfg.vocab_size - 1, (n,), generator=g)


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_chunks_equal_one_shot_forward_on_cuda(form: str) -> None:
    from kdtree_engine.model.target import Target

    cfg = _cfg()
    target = Target.random(cfg, seed=0, device="cuda")
    ids = _prompt(cfg, 3000).cuda()
    ref = target(ids, target.new_cache(3000), aux_layers=(0, 3))
    out = target.prefill(ids, target.new_cache(3000), aux_layers=(0, 3), chunk=512, form=form, all_logits=True)
    assert out.chunks == 6
    assert float((out.logits - ref.logits).abs().max() / ref.logits.abs().max()) < 1e-4
    torch.testing.assert_close(out.aux, ref.aux, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot_bit_for_bit_in_bf16() -> None:
    """The prompt cut into chunks (naive form) gives every token's logits and aux features bit for bit those of one
    forward over the whole prompt: the prefill attention kernel's rows do not depend on the launch, the GEMMs and the
    MoE are batch-invariant."""
    from kdtree_engine.model.target import Target

    cfg = _cfg()
    target = Target.random(cfg, seed=1, device="cuda", dtype=torch.bfloat16)
    ids = _prompt(cfg, 2500, seed=1).cuda()
    one = target.prefill(ids, target.new_cache(2500), aux_layers=(0, 3), chunk=4096, all_logits=True)
    cut = target.prefill(ids, target.new_cache(2500), aux_layers=(0, 3), chunk=384, form="naive", all_logits=True)
    assert one.chunks == 1 and cut.chunks == 7
    assert torch.equal(cut.aux, one.aux)
    bad = (cut.logits != one.logits).any(-1).nonzero().flatten().tolist()
    assert not bad, f"tokens {bad[:10]} differ"


def test_prefill_peak_is_bounded_by_the_chunk(monkeypatch) -> None:
    """The prefill's peak grows with the chunk, not with the prompt: the attention kernel holds no scores in memory and
    expands the keys through kv_b a bounded range at a time (shrunk here to a few key blocks, so the tiny model's
    ranges are far shorter than its prompts)."""
    import kdtree_engine.kernels.prefill_attention as pa
    from kdtree_engine.model.target import Target

    cfg = _cfg()
    target = Target.random(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    N = target.layers[0].self_attn.n_heads
    monkeypatch.setattr(pa, "EXPANDED_BYTES", 4 * pa.BLOCK_N * N * (cfg.qk_nope_head_dim + cfg.v_head_dim) * 2)
    target.rope.ensure(12288 + 1)   # the rope tables grow once for the longest prompt, outside the measured peaks
    peaks = {}
    for T, chunk in ((4096, 1024), (12288, 1024), (4096, 4096), (12288, 12288)):
        cache = target.new_cache(T)
        peaks[T, chunk] = target.prefill(_prompt(cfg, T).cuda(), cache, chunk=chunk).peak_bytes
    assert peaks[12288, 1024] <= 1.25 * peaks[4096, 1024], peaks
    # one chunk of the whole prompt: the activations grow with T, nothing grows with T^2
    assert peaks[12288, 12288] <= 4 * peaks[4096, 4096], peaks


def test_graph_rounds_after_multi_chunk_prefill_equal_plain() -> None:
    from kdtree_engine.draft_config import DraftConfig
    from kdtree_engine.model.dflash import DFlashDrafter
    from kdtree_engine.model.target import Target
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate

    cfg = _cfg()
    target = Target.random(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=8, mask_token_id=cfg.vocab_size - 1,
                       target_layer_ids=(0, 3), num_target_layers=4, vocab_size=cfg.vocab_size)
    drafter = DFlashDrafter.random(dcfg, seed=0, dtype=torch.bfloat16, device="cuda")
    prompt = _prompt(cfg, 6000).tolist()
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = generate(target, prompt, params, prefill_chunk=1024)
    assert plain.stats["prefill_chunks"] == 6
    for spec, budget in (("dflash", None), ("ddtree", 16)):
        r = generate(target, prompt, params, spec=spec, drafter=drafter, budget=budget, prefill_chunk=1024)
        assert r.token_ids == plain.token_ids, (spec, budget)
        assert r.stats["prefill_chunks"] == 6 and r.stats["rounds_mode"] == "graph"
