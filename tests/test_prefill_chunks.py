"""Chunked prefill (model/prefill.py, Target.prefill): chunk plans, the key-blocked attention against a dense
softmax, chunks against the one-shot forward, the cost model's choices, peak-memory accounting, and the
context / capacity errors raised before any work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdtree_engine.cli import main
from kdtree_engine.config import preset
from kdtree_engine.errors import PromptError
from kdtree_engine.model.prefill import (KEY_BLOCK, blocked_causal_attention, choose_form, form_costs, plan_chunks,
                                         resolve_chunk, transient_bytes)
from kdtree_engine.model.target import Target
from kdtree_engine.reference import random_weights
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import context_limit, generate
from kdtree_engine.weights import save_checkpoint

CFG = preset("k2-tiny")


def seeded() -> int:
    seed = int(np.random.default_rng().integers(1 << 30))
    print(f"seed={seed}")
    return seed


def test_plan_covers_the_prompt_in_order() -> None:
    assert plan_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert plan_chunks(8, 8) == [(0, 8)]
    assert resolve_chunk(None) > 0 and resolve_chunk(7) == 7
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="prefill chunk"):
            resolve_chunk(bad)


@pytest.mark.parametrize("start,T,block", [(0, 37, 8), (50, 13, 16), (64, 64, 64), (5, 1, 3), (100, 20, 1000)])
def test_blocked_attention_equals_dense_causal_softmax(start: int, T: int, block: int) -> None:
    g = torch.Generator().manual_seed(seeded())
    N, D, Dv = 3, 8, 5
    K = start + T
    q = torch.randn(N, T, D, generator=g)
    k = torch.randn(K, D, generator=g)
    v = torch.randn(K, N, Dv, generator=g)
    dense = torch.einsum("ntd,sd->nts", q.double(), k.double())
    future = torch.arange(K).unsqueeze(0) > torch.arange(start, K).unsqueeze(1)  # [T, K]
    want = torch.einsum("nts,snv->ntv", dense.masked_fill(future, float("-inf")).softmax(-1), v.double())

    def scores(s0: int, s1: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.einsum("ntd,sd->nts", q, k[s0:s1]), v[s0:s1]

    got = blocked_causal_attention(scores, T, start, block, torch.device("cpu"))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_one_chunk_prompt_is_the_unchanged_forward_bitwise() -> None:
    target = Target.random(CFG, seed=seeded() % 1000)
    ids = torch.randint(0, CFG.vocab_size, (40,))
    ref = target(ids, target.new_cache(40), aux_layers=(0, 2))
    out = target.prefill(ids, target.new_cache(40), aux_layers=(0, 2), chunk=40, all_logits=True)
    assert out.chunks == 1 and torch.equal(out.logits, ref.logits) and torch.equal(out.aux, ref.aux)
    last = target.prefill(ids, target.new_cache(40), chunk=64)
    assert torch.equal(last.logits, ref.logits[-1:])


@pytest.mark.parametrize("form", ["naive", "absorbed", "auto"])
def test_chunks_equal_the_one_shot_forward(form: str) -> None:
    seed = seeded()
    target = Target.random(CFG, seed=seed % 1000)
    T = 300
    ids = torch.randint(0, CFG.vocab_size, (T,), generator=torch.Generator().manual_seed(seed))
    one = target.new_cache(T)
    ref = target(ids, one, aux_layers=(1, 3))
    for chunk in (64, 100, T - 1):
        cache = target.new_cache(T + 4)
        out = target.prefill(ids, cache, aux_layers=(1, 3), chunk=chunk, form=form, all_logits=True)
        assert out.chunks == len(plan_chunks(T, chunk)) and cache.length == T
        scale = ref.logits.abs().max()
        assert (out.logits - ref.logits).abs().max() / scale < 1e-5, (form, chunk, seed)
        torch.testing.assert_close(out.aux, ref.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.kv[:, :T], one.kv[:, :T], rtol=1e-5, atol=1e-5)
        last = target.prefill(ids, target.new_cache(T), chunk=chunk, form=form)
        # lm_head of one row against the row of a [T, H] product: equal up to the GEMM's blocking
        assert last.logits.shape == (1, CFG.vocab_size)
        torch.testing.assert_close(last.logits, out.logits[-1:], rtol=1e-6, atol=1e-5)


def test_cost_model_picks_naive_for_long_chunks_and_absorbed_for_few_tokens() -> None:
    k2, cuda = preset("k2"), torch.device("cuda")
    N = k2.num_attention_heads
    assert choose_form(k2, N, 4096, 60000, 2, cuda) == "naive"
    assert choose_form(k2, N, 16, 60000, 2, cuda) == "absorbed"
    assert choose_form(k2, N, 16, 60000, 2, cuda, form="naive") == "naive"
    with pytest.raises(ValueError, match="prefill form"):
        choose_form(k2, N, 16, 0, 2, cuda, form="fast")
    # the formula, term by term, for one case (docs/long_context.md states it)
    c = form_costs(k2, N, 10, 90, 2)
    P, R, V, C, K = 128, 64, 128, 512, 100
    assert c["naive"].flops == 2 * K * C * N * (P + V) + 2 * 10 * K * N * (P + R) + 2 * 10 * K * N * V
    T = 10
    assert c["absorbed"].flops == 2 * T * N * P * C + 2 * T * K * N * (C + R) + 2 * T * K * N * C + 2 * T * N * C * V


def test_peak_is_bounded_by_the_chunk_not_the_prompt() -> None:
    target = Target.random(CFG, seed=1)
    peaks = []
    for T in (2 * KEY_BLOCK, 4 * KEY_BLOCK):
        ids = torch.randint(0, CFG.vocab_size, (T,))
        out = target.prefill(ids, target.new_cache(T), chunk=KEY_BLOCK // 2, form="naive")
        peaks.append(out.peak_bytes)
        assert out.stats() == {"prefill_chunks": T // (KEY_BLOCK // 2), "prefill_chunk": KEY_BLOCK // 2,
                               "prefill_peak_bytes": out.peak_bytes}
    one_shot = transient_bytes(CFG, CFG.num_attention_heads, 4 * KEY_BLOCK, 4 * KEY_BLOCK, "naive", 4)
    assert peaks[0] == peaks[1] < one_shot / 8


def test_generate_reports_prefill_chunks_and_keeps_tokens() -> None:
    target = Target.random(CFG, seed=4)
    prompt = torch.randint(2, CFG.vocab_size, (90,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = generate(target, prompt, params)
    assert ref.stats["prefill_chunks"] == 1 and ref.stats["prefill_peak_bytes"] > 0
    r = generate(target, prompt, params, prefill_chunk=32)
    assert r.stats["prefill_chunks"] == 3 and r.stats["prefill_chunk"] == 32
    assert r.token_ids == ref.token_ids


def test_context_limit_cuts_max_tokens_and_refuses_prompts_that_cannot_fit() -> None:
    assert context_limit(10, 5, 100, None) == 5
    assert context_limit(90, 50, 100, None) == 10  # max_tokens cut to the positions left
    assert context_limit(10, 50, 100, 40, reserve=4) == 26  # ... or to the cache tokens left
    with pytest.raises(PromptError, match="prompt has 100 tokens; max_position_embeddings is 100"):
        context_limit(100, 1, 100, None)
    with pytest.raises(PromptError, match="prompt has 37 tokens; the free device memory holds a latent cache of 40"):
        context_limit(37, 1, 100, 40, reserve=4)


def test_prompt_past_the_context_is_refused_before_any_forward(monkeypatch, capsys, tmp_path) -> None:
    cfg = CFG.replace(max_position_embeddings=32)
    target = Target.random(cfg, seed=0)

    def no_work(*a, **k):
        raise AssertionError("a forward ran for a prompt that cannot fit")

    monkeypatch.setattr(Target, "prefill", no_work)
    monkeypatch.setattr(Target, "forward", no_work)
    with pytest.raises(PromptError, match="prompt has 40 tokens; max_position_embeddings is 32"):
        generate(target, [3] * 40, SamplingParams(max_tokens=4))
    monkeypatch.undo()
    save_checkpoint(tmp_path / "m", cfg, {k: torch.from_numpy(v) for k, v in random_weights(cfg, 0).items()})
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt-ids", ",".join(["3"] * 40)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line and not line.startswith("loading weights")]
    assert err == ["kdtree: error: prompt has 40 tokens; max_position_embeddings is 32"], err


def test_cost_model_with_the_prefill_kernel_prefers_the_naive_form() -> None:
    """With the naive form on the prefill kernel (no scores in memory, tensor cores) and the absorbed form on float32
    torch products, a chunk takes the naive form down to a handful of tokens; one token over a long prefix still
    takes the absorbed one (the expansion of every key costs more than its float32 scores)."""
    k2, cuda = preset("k2"), torch.device("cuda")
    N = k2.num_attention_heads // 8
    assert choose_form(k2, N, 16, 60000, 2, cuda) == "absorbed"
    assert choose_form(k2, N, 16, 60000, 2, cuda, kernel=True) == "naive"
    assert choose_form(k2, N, 1, 60000, 2, cuda, kernel=True) == "absorbed"
    plain, fused = form_costs(k2, N, 4096, 28672, 2), form_costs(k2, N, 4096, 28672, 2, kernel=True)
    assert fused["naive"].bytes == plain["naive"].bytes - 2 * 4 * N * 4096 * (28672 + 4096)
    assert fused["absorbed"].flops == 15.0 * plain["absorbed"].flops
