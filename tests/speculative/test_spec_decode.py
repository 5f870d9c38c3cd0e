"""Greedy losslessness on real (random) K2-shaped targets, oracle tau, stop rules, tree verify."""

import pytest
import torch

from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.model.dflash import DFlashDrafter, DraftMismatchError
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams
from kdtree_engine.speculative.decode import SpecConfig, SpecError, generate
from kdtree_engine.speculative.tree import build_tree
from kdtree_engine.sampling import topk_logprobs

from spec_toys import ToyDrafter, oracle_proposals
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

STATS = ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "tokens_per_s", "rounds", "tau",
         "draft_tokens", "accepted_tokens", "accepted_per_depth", "draft_s", "tree_s", "verify_s", "commit_s")


def _variants():
    base = preset("k2-tiny")
    return [
        ("k2-tiny", base),
        ("2 layers, vocab 64", base.replace(num_hidden_layers=2, vocab_size=64)),
        ("3 layers, vocab 128, 2 dense", base.replace(num_hidden_layers=3, vocab_size=128, first_k_dense_replace=2)),
    ]


def _drafter_cfg(tcfg, block, layers=1, ids=None):
    ids = ids if ids is not None else tuple(sorted({0, tcfg.num_hidden_layers - 1}))
    return DraftConfig(hidden_size=tcfg.hidden_size, intermediate_size=96, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=block,
                       mask_token_id=tcfg.vocab_size - 1, target_layer_ids=ids,
                       num_target_layers=tcfg.num_hidden_layers, vocab_size=tcfg.vocab_size)


def _oracle(target, prompt, ref_tokens, block, miss, seed=0):
    """Knows the greedy future; checks every context row against a fresh full forward."""
    full = prompt + ref_tokens
    ids = tuple(sorted({0, target.cfg.num_hidden_layers - 1}))
    ref_aux = target(torch.tensor(full), target.new_cache(len(full)), aux_layers=ids).aux  # [len, K*H]

    def check_ctx(ctx, lo, hi):
        torch.testing.assert_close(ctx, ref_aux[lo:hi], rtol=1e-3, atol=1e-3)

    return ToyDrafter(block, oracle_proposals(full, target.cfg.vocab_size, seed=seed, miss=miss),
                      target_layer_ids=ids, check_ctx=check_ctx)


@pytest.mark.parametrize("name,cfg", _variants(), ids=[v[0] for v in _variants()])
def test_greedy_spec_equals_plain(name, cfg):
    seed = len(name)
    target = Target.random(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, cfg.vocab_size, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = generate(target, prompt, params)
    assert len(ref.token_ids) == 10 and ref.stats["tau"] == 1.0
    drafter = DFlashDrafter.random(_drafter_cfg(cfg, block=5), seed=seed)
    runs = [("dflash", None, drafter), *[("ddtree", b, drafter) for b in (1, 4, 16, 64)]]
    noisy = _oracle(target, prompt, ref.token_ids, block=5, miss=0.3, seed=seed)
    runs += [("dflash", None, noisy), ("ddtree", 4, noisy), ("ddtree", 16, noisy)]
    for spec, budget, d in runs:
        r = generate(target, prompt, params, spec=spec, drafter=d, budget=budget)
        assert r.token_ids == ref.token_ids, (spec, budget, type(d).__name__)
        assert all(k in r.stats for k in STATS)
        s = r.stats
        assert s["generated_tokens"] == 10 and s["tau"] >= 1.0
        assert s["accepted_tokens"] == sum(s["accepted_per_depth"]) == 9 - s["rounds"]
    # the noisy oracle is right 70% of the time: trees recover misses the chain cannot
    r_chain = generate(target, prompt, params, spec="dflash", drafter=noisy)
    r_tree = generate(target, prompt, params, spec="ddtree", drafter=noisy, budget=16)
    assert r_tree.stats["tau"] >= r_chain.stats["tau"] and r_chain.stats["tau"] > 1.0


def test_oracle_reaches_block_size():
    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=3)
    prompt, B = [5, 9, 13, 2], 4
    params = SamplingParams(max_tokens=1 + 3 * B, ignore_eos=True)  # prefill token + 3 full rounds
    ref = generate(target, prompt, params)
    oracle = _oracle(target, prompt, ref.token_ids, block=B, miss=0.0)
    for spec, budget in (("dflash", None), ("ddtree", B - 1), ("ddtree", 16)):
        r = generate(target, prompt, params, spec=spec, drafter=oracle, budget=budget)
        assert r.token_ids == ref.token_ids
        assert r.stats["rounds"] == 3 and r.stats["tau"] == B, r.stats
        assert r.stats["accepted_per_depth"] == [3] * (B - 1)


def test_dflash_chain_budget_truncates_the_chain():
    """--spec dflash --budget L verifies the first L argmax drafts: a perfect drafter then gives
    tau = L + 1 per round, output equal to plain decoding; longer chains than the block are refused."""
    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=3)
    prompt, B = [5, 9, 13, 2], 5
    params = SamplingParams(max_tokens=1 + 3 * 3, ignore_eos=True)  # prefill token + 3 rounds of 3 tokens
    ref = generate(target, prompt, params)
    oracle = _oracle(target, prompt, ref.token_ids, block=B, miss=0.0)
    r = generate(target, prompt, params, spec="dflash", drafter=oracle, budget=2)
    assert r.token_ids == ref.token_ids
    assert r.stats["rounds"] == 3 and r.stats["tau"] == 3 and r.stats["budget"] == 2, r.stats
    assert r.stats["draft_tokens"] == 6 and r.stats["accepted_per_depth"][:3] == [3, 3, 0]
    with pytest.raises(SpecError, match="longer than the drafter's chain"):
        generate(target, prompt, params, spec="dflash", drafter=oracle, budget=B)
    with pytest.raises(SpecError, match="ddtree only"):
        generate(target, prompt, params, spec="dflash", drafter=oracle, budget="auto")


def _cut_setup():
    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=5)
    prompt, B = [7, 3, 11], 5
    ref = generate(target, prompt, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids
    return cfg, target, prompt, B, ref


def test_stop_token_and_eos_cut_mid_round():
    cfg, target, prompt, B, ref = _cut_setup()
    # a token first seen strictly inside the second round (positions 1 + B .. 2B - 1 are mid-round)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and (i - 1) % B not in (0, B - 1))
    stop = ref[k]
    oracle = _oracle(target, prompt, ref, block=B, miss=0.0)
    for spec, budget in (("none", None), ("dflash", None), ("ddtree", 8)):
        r = generate(target, prompt, SamplingParams(max_tokens=16, stop_token_ids=(stop,)),
                     spec=spec, drafter=oracle, budget=budget)
        assert r.token_ids == ref[:k + 1] and r.finish_reason == "stop", (spec, r.token_ids, k)
    # the same through the model's EOS id (and ignore_eos turns it off)
    t_eos = Target.random(cfg.replace(eos_token_ids=(stop,)), seed=5)
    for spec, budget in (("dflash", None), ("ddtree", 8)):
        r = generate(t_eos, prompt, SamplingParams(max_tokens=16), spec=spec, drafter=oracle, budget=budget)
        assert r.token_ids == ref[:k + 1] and r.finish_reason == "stop"
        r = generate(t_eos, prompt, SamplingParams(max_tokens=16, ignore_eos=True), spec=spec, drafter=oracle,
                     budget=budget)
        assert r.token_ids == ref and r.finish_reason == "length"


def test_max_tokens_cut_mid_round():
    cfg, target, prompt, B, ref = _cut_setup()
    oracle = _oracle(target, prompt, ref, block=B, miss=0.0)
    streamed: list[int] = []
    for n in (1, 2, B + 3):
        for spec, budget in (("dflash", None), ("ddtree", 8)):
            streamed.clear()
            r = generate(target, prompt, SamplingParams(max_tokens=n, ignore_eos=True), spec=spec, drafter=oracle,
                         budget=budget, on_tokens=streamed.extend)
            assert r.token_ids == ref[:n] == streamed and r.finish_reason == "length"
    r = generate(target, prompt, SamplingParams(max_tokens=0), spec="dflash", drafter=oracle)
    assert r.token_ids == [] and r.finish_reason == "length"


def test_tree_verify_logits_match_plain_forward():
    """Every tree node's verify logits equal a plain causal forward of its root path."""
    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=9)
    prompt = [4, 8, 15, 16, 23]
    g = torch.Generator().manual_seed(0)
    lp, ids = topk_logprobs(torch.randn(4, cfg.vocab_size, generator=g) * 3, 3, policy=POLICY)
    tree = build_tree(lp, ids, 12, root_token=42, start=len(prompt))
    cache = target.new_cache(64)
    target(torch.tensor(prompt), cache)
    out = target(tree.tokens, cache, positions=tree.positions, tree_mask=tree.mask, aux_layers=(1,))
    for i in range(tree.num_nodes):
        path = torch.nonzero(tree.mask[i]).squeeze(-1)
        seq = torch.tensor(prompt + tree.tokens[path].tolist())
        plain = target(seq, target.new_cache(64), aux_layers=(1,))
        torch.testing.assert_close(out.logits[i], plain.logits[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out.aux[i], plain.aux[-1], rtol=1e-4, atol=1e-4)


def test_sampled_spec_runs_and_is_seeded():
    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=2)
    drafter = DFlashDrafter.random(_drafter_cfg(cfg, block=4), seed=1)
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    a = generate(target, [3, 4, 5], p, spec="ddtree", drafter=drafter, budget=8)
    b = generate(target, [3, 4, 5], p, spec="ddtree", drafter=drafter, budget=8)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 8


def test_spec_settings_validated():
    cfg = preset("k2-tiny")
    target = Target.random(cfg.replace(num_hidden_layers=2), seed=0)
    with pytest.raises(SpecError, match="method"):
        SpecConfig(method="medusa")
    with pytest.raises(SpecError, match="budget"):
        SpecConfig(method="ddtree", budget=0)
    with pytest.raises(SpecError, match="drafter"):
        generate(target, [1, 2], SamplingParams(max_tokens=2), spec="dflash")
    bad = DFlashDrafter.random(_drafter_cfg(cfg, block=4, ids=(0, 3)), seed=0)  # trained for 4 layers
    with pytest.raises(DraftMismatchError, match="layer"):
        generate(target, [1, 2], SamplingParams(max_tokens=2), spec="dflash", drafter=bad)
