"""Device-resident rounds on the CPU: the pieces against their host-side references (accept walk,
KV compaction, visibility mask, masked attention, the drafter's static pass), and whole requests
against plain decoding (the independent oracle), stop rules included."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kdtree_engine.cache import CachePool, LatentCache
from kdtree_engine.config import preset
from kdtree_engine.draft_config import DraftConfig
from kdtree_engine.model.dflash import DFlashDrafter
from kdtree_engine.kernels.policy import KernelPolicy
from kdtree_engine.kernels.reference import mla_attention_masked, mla_attention_reference
from kdtree_engine.model.context import static_visibility
from kdtree_engine.model.target import Target
from kdtree_engine.sampling import SamplingParams, topk_logprobs
from kdtree_engine.speculative.accept import accept_reference
from kdtree_engine.speculative.decode import SpecConfig, SpecError, generate, generate_device, pick_round_mode
from kdtree_engine.speculative.walks import walk_flat
from kdtree_engine.speculative.tree import build_tree

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

DEMO = Path(__file__).resolve().parents[2] / "kdtree_engine" / "assets" / "demo"


def _random_tree(g: torch.Generator, depth: int, vocab: int, budget: int):
    logits = torch.randn(depth, vocab, generator=g) * 3
    lp, ids = topk_logprobs(logits, budget, policy=POLICY)
    return build_tree(lp, ids, budget, torch.tensor(7), torch.tensor(30))


def _picks_following(tree, g: torch.Generator, vocab: int, follow: float) -> torch.Tensor:
    """Per node: with probability ``follow`` the token of one of its children, else a random token."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    kids: dict[int, list[int]] = {}
    for i in range(1, len(toks)):
        kids.setdefault(pars[i], []).append(toks[i])
    out = []
    for i in range(len(toks)):
        c = kids.get(i, [])
        if c and float(torch.rand((), generator=g)) < follow:
            out.append(c[int(torch.randint(0, len(c), (), generator=g))])
        else:
            out.append(int(torch.randint(0, vocab, (), generator=g)))
    return torch.tensor(out)


@pytest.mark.parametrize("depth,vocab,budget", [(5, 6, 12), (7, 3, 40), (4, 50, 4), (15, 20, 64), (1, 5, 1)])
def test_vectorized_accept_equals_reference_walk(depth, vocab, budget):
    g = torch.Generator().manual_seed(depth * 100 + budget)
    for trial in range(30):
        tree = _random_tree(g, depth, vocab, budget)
        picks = _picks_following(tree, g, vocab, follow=0.8 if trial % 3 else 0.3)
        want_acc, want_bonus = accept_reference(tree, picks)
        n1 = tree.num_nodes
        nodes, count, bonus, em = walk_flat(tree.tokens, tree.parents, tree.depths, picks,
                                            torch.zeros(1, dtype=torch.long), torch.zeros(n1, dtype=torch.long), n1)
        acc = nodes[0]
        assert int(count[0]) == len(want_acc)
        assert acc[: len(want_acc)].tolist() == want_acc and not acc[len(want_acc):].any()
        assert int(bonus[0]) == want_bonus
        want_emit = [int(tree.tokens[i]) for i in want_acc[1:]] + [want_bonus]
        assert em[0, : len(want_acc)].tolist() == want_emit


def test_compact_static_equals_commit():
    cfg = preset("k2-tiny")
    g = torch.Generator().manual_seed(0)
    pool = CachePool(cfg, 4, dtype=torch.float32, device="cpu")
    a = LatentCache(pool, 40)
    a.load_slots(torch.randn(a.kv.shape, generator=g))  # kv: the slots gathered through the block table (a copy)
    b = LatentCache(pool, 40)
    b.load_slots(a.kv)
    a.length = 11
    a.reserve(9)
    keep = torch.tensor([0, 2, 5, 8])
    a.commit(keep)
    acc = torch.tensor([0, 2, 5, 8, 1, 3])  # accepted first, then any other nodes (fixed M = 6)
    b.compact_static(torch.tensor(11), acc)
    assert torch.equal(a.kv[:, :15], b.kv[:, :15])  # committed slots identical; slots past 15 are scratch


def test_static_visibility_and_masked_attention():
    g = torch.Generator().manual_seed(1)
    T, S, cap, C, R, N = 5, 9, 20, 8, 4, 3
    tree = _random_tree(g, 3, 4, T - 1)
    mask = tree.mask
    vis = static_visibility(torch.tensor(S), mask, cap)
    assert vis.shape == (T, cap)
    assert vis[:, :S].all() and not vis[:, S + T:].any()
    assert torch.equal(vis[:, S:S + T], mask)
    q_lat, q_pe = torch.randn(T, N, C, generator=g), torch.randn(T, N, R, generator=g)
    kv = torch.randn(cap, C + R, generator=g)
    got = mla_attention_masked(q_lat, q_pe, kv, vis, 0.3, C)
    want = mla_attention_reference(q_lat, q_pe, kv[: S + T], S, mask, 0.3, C)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _tiny_pair(block: int = 6, policy: KernelPolicy = POLICY):
    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=0, policy=policy)
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=block, mask_token_id=255,
                       target_layer_ids=(0, 3), num_target_layers=4, vocab_size=256, sliding_windows=(3, None))
    return target, DFlashDrafter.random(dcfg, seed=0, policy=policy)


def test_drafter_static_pass_equals_eager():
    target, drafter = _tiny_pair()
    g = torch.Generator().manual_seed(2)
    S, F = 9, 2 * 64
    ctx = torch.randn(S, F, generator=g)
    block = target.embed(torch.tensor([5] + [255] * 5))
    c1 = drafter.new_cache(32)
    want = drafter(ctx, block, c1, S)
    c2 = drafter.new_cache(32)
    drafter.append_context(ctx[: S - 3], c2)  # the rest comes through the static pass: 3 rows + junk
    rows = torch.cat([ctx[S - 3:], torch.randn(3, F, generator=g)])
    got = drafter(rows, block, c2, torch.tensor(S), torch.tensor(3))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c2.k[:, :, :S], c1.k[:, :, :S], rtol=1e-6, atol=1e-6)


def test_device_rounds_equal_plain_decoding_tiny():
    target, drafter = _tiny_pair()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for prompt in ([5, 6, 7, 8], [3, 200, 17, 99, 41, 2, 250]):
        ref = generate(target, prompt, params)
        for method, budget in (("none", None), ("dflash", None), ("dflash", 2), ("ddtree", 3), ("ddtree", 16)):
            for ahead in (False, True):   # True: the next round queued before the last is read (CUDA's loop)
                r = generate_device(target, prompt, params, method=method,
                                    drafter=None if method == "none" else drafter, budget=budget, graph=False,
                                    ahead=ahead)
                assert r.token_ids == ref.token_ids, (prompt, method, budget, ahead)
                assert r.finish_reason == ref.finish_reason
                assert r.stats["rounds_mode"] == "device-eager"


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="embedded demo missing")
def test_device_rounds_equal_plain_decoding_demo_with_stops():
    from kdtree_engine.engine import load_drafter, load_target
    target = load_target(DEMO, device=torch.device("cpu"), dtype=torch.float32, progress=False)
    drafter = load_drafter(DEMO / "draft", target)
    prompt = [int(t) for t in torch.randint(5, 4000, (12,), generator=torch.Generator().manual_seed(3))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = generate(target, prompt, params)
    stop = ref.token_ids[9]  # a stop token mid-way (cuts a round in the middle)
    pstop = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,))
    ref_stop = generate(target, prompt, pstop)
    assert ref_stop.finish_reason == "stop"
    for method, budget in (("dflash", None), ("ddtree", 8)):
        for p, want in ((params, ref), (pstop, ref_stop)):
            eager = generate(target, prompt, p, spec=method, drafter=drafter, budget=budget)
            for ahead in (False, True):
                r = generate_device(target, prompt, p, method=method, drafter=drafter, budget=budget, graph=False,
                                    ahead=ahead)
                assert r.token_ids == want.token_ids and r.finish_reason == want.finish_reason, (method, budget)
                assert r.stats["rounds"] == eager.stats["rounds"]   # the round queued past the end is not counted


def test_round_mode_choice():
    target, drafter = _tiny_pair()
    greedy = SamplingParams(max_tokens=4)
    assert pick_round_mode(SpecConfig("ddtree", 4), greedy, drafter, target, None) == "eager"  # CPU
    assert pick_round_mode(SpecConfig("ddtree", 4), greedy, drafter, target, True) == "eager"
    with pytest.raises(SpecError, match="eager=False"):
        pick_round_mode(SpecConfig("ddtree", 4), greedy, drafter, target, False)
    with pytest.raises(SpecError, match="eager=False"):
        generate(target, [5, 6], greedy, spec="dflash", drafter=drafter, eager=False)


def test_round_mode_needs_a_device_resident_drafter_for_graphs():
    """On CUDA, graphs take a drafter with device-resident passes; one that only proposes from the host
    (the drafter protocol of host-driven rounds) gets host-driven rounds. No GPU needed: only the choice."""
    target, drafter = _tiny_pair()
    on_cuda = SimpleNamespace(device=torch.device("cuda"))
    greedy = SamplingParams(max_tokens=4)
    proposer = SimpleNamespace(block_size=drafter.block_size, target_layer_ids=drafter.target_layer_ids)
    assert pick_round_mode(SpecConfig("ddtree", 4), greedy, drafter, on_cuda, None) == "graph"
    assert pick_round_mode(SpecConfig("ddtree", 4), greedy, proposer, on_cuda, None) == "eager"
    assert pick_round_mode(SpecConfig("none"), greedy, None, on_cuda, None) == "graph"
    with pytest.raises(SpecError, match="device-resident pass"):
        pick_round_mode(SpecConfig("dflash"), greedy, proposer, on_cuda, False)


def test_round_shape_widths():
    assert SpecConfig("none").resolve(6, 100).full_nodes == 1
    assert SpecConfig("dflash").resolve(6, 100).full_nodes == 6
    assert SpecConfig("dflash", 2).resolve(6, 100).full_nodes == 3
    assert SpecConfig("ddtree", 4).resolve(6, 100).full_nodes == 5
    assert SpecConfig("ddtree").resolve(6, 100).budget == 5   # no budget: the drafter's whole chain
    assert SpecConfig("ddtree", 64).resolve(3, 3).full_nodes == 1 + 3 + 9  # only 12 prefixes of depth <= 2 over 3 tokens
    assert SpecConfig("ddtree", "auto").resolve(6, 100).auto
    with pytest.raises(SpecError, match="longer than the drafter's chain"):
        SpecConfig("dflash", 6).resolve(6, 100)


def test_warmup_rounds_then_restore_change_nothing():
    """What graph capture does before capturing (two rounds run, the state restored) leaves the
    following rounds exactly as without it: warm-up writes land past the committed length only."""
    from kdtree_engine.speculative.device_round import DeviceRound

    if (DEMO / "config.json").exists():  # a trained drafter: rounds accept drafts (compaction, context rows)
        from kdtree_engine.engine import load_drafter, load_target
        target = load_target(DEMO, device=torch.device("cpu"), dtype=torch.float32, progress=False)
        drafter = load_drafter(DEMO / "draft", target)
        from kdtree_engine.engine import load_tokenizer
        prompt = load_tokenizer(DEMO).encode("def add(a, b):\n    return")
    else:
        target, drafter = _tiny_pair()
        prompt = [3, 200, 17, 99, 41]
    outs = []
    for warm in (False, True):
        rnd = DeviceRound(target, drafter, SpecConfig("ddtree", 8).resolve(drafter.block_size, target.cfg.vocab_size), 256)
        rnd.prefill(prompt)
        toks = []
        for r in range(12):
            if warm and r in (0, 5):
                saved = rnd.snapshot()
                rnd.step()
                rnd.step()
                rnd.restore(saved)
            rnd.step()
            vals = rnd.result.tolist()
            toks += vals[: vals[-1]]
        outs.append(toks)
    assert outs[0] == outs[1]
    ref = generate(target, prompt, SamplingParams(max_tokens=len(outs[0]) + 1, ignore_eos=True)).token_ids
    assert outs[0] == ref[1:]


def test_graph_runner_needs_cuda_and_capacity_buckets():
    from kdtree_engine.speculative.device_round import DeviceRound
    from kdtree_engine.speculative.graph import ROUNDS, GraphRunner, capacity_bucket

    assert [capacity_bucket(n) for n in (1, 512, 513, 3000)] == [512, 512, 1024, 4096]
    target, drafter = _tiny_pair()
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(DeviceRound(target, drafter, SpecConfig("dflash").resolve(drafter.block_size, 256), 64))
    shape = SpecConfig("ddtree", 4).resolve(drafter.block_size, target.cfg.vocab_size)
    a, _ = ROUNDS.get(target, drafter, shape, 40, graph=False)
    b, _ = ROUNDS.get(target, drafter, shape, 300, graph=False)
    assert a is b and a.capacity == 512  # one buffer (and graph) for requests of similar length
    ROUNDS.clear(target)
    assert ROUNDS.get(target, drafter, shape, 40, graph=False)[0] is not a


def test_rounds_ahead_up_to_the_position_limit():
    """The round queued past the end still fits when the request runs to the model's last position, and
    the next request on the same round buffer is unaffected by it."""
    target, drafter = _tiny_pair()
    max_pos = target.cfg.max_position_embeddings
    prompt = [int(t) for t in torch.randint(3, 250, (max_pos - 9,), generator=torch.Generator().manual_seed(5))]
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    ref = generate(target, prompt, params)
    assert ref.finish_reason == "length" and len(ref.token_ids) == 9
    for method, budget in (("dflash", None), ("ddtree", 4)):
        for _ in range(2):
            r = generate_device(target, prompt, params, method=method, drafter=drafter, budget=budget, graph=False,
                                ahead=True)
            assert r.token_ids == ref.token_ids, (method, budget)
        short = generate(target, prompt[:5], SamplingParams(max_tokens=12, ignore_eos=True))
        r = generate_device(target, prompt[:5], SamplingParams(max_tokens=12, ignore_eos=True), method=method,
                            drafter=drafter, budget=budget, graph=False, ahead=True)
        assert r.token_ids == short.token_ids


def test_device_rounds_sampled_distribution_equals_target():
    """Sampled device rounds (the exponential race over drawn noise, the vectorized accept walk) emit
    the target's sequence distribution: first 3 tokens against the enumerated exact joint."""
    from spec_toys import chi_square_pvalue, first_tokens_distribution

    target, drafter = _tiny_pair(block=4)
    with torch.no_grad():  # flatter logits (target and drafter share the head): many outcomes, drafts accepted
        target.lm_head_proj.weight.mul_(0.03)
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=3, temperature=0.3, top_k=3, ignore_eos=True)
    exact = first_tokens_distribution(target, prompt, params, 3)
    n, counts, accepted = 400, {}, 0
    for i in range(n):
        r = generate_device(target, prompt, SamplingParams(max_tokens=3, temperature=0.3, top_k=3, ignore_eos=True,
                                                           seed=100 + i),
                            method="ddtree", drafter=drafter, budget=64, graph=False, ahead=bool(i % 2))
        key = tuple(r.token_ids)
        counts[key] = counts.get(key, 0) + 1
        accepted += r.stats["accepted_tokens"]
    assert accepted >= 10  # drafts accepted (25 with these seeds): the tree paths are exercised
    stat, pval = chi_square_pvalue(counts, exact, n)
    assert pval > 1e-4, (stat, pval)
    # seeded: the same request twice gives the same tokens
    p = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9, ignore_eos=True, seed=5)
    a = generate_device(target, prompt, p, method="ddtree", drafter=drafter, budget=8, graph=False)
    b = generate_device(target, prompt, p, method="ddtree", drafter=drafter, budget=8, graph=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


def test_sampled_rounds_share_a_round_across_temperatures():
    """Temperature and top-p are per-request values of one round (no new round, no new graph, per value);
    top-k and nucleus on/off select the round."""
    from kdtree_engine.speculative.graph import ROUNDS

    target, drafter = _tiny_pair(block=4)
    prompt = [5, 6, 7, 8]
    ROUNDS.clear(target)
    outs = []
    for temp, top_p in ((0.7, 0.9), (1.3, 0.5), (0.7, 0.9)):
        p = SamplingParams(max_tokens=10, temperature=temp, top_p=top_p, ignore_eos=True, seed=4)
        outs.append(generate_device(target, prompt, p, method="ddtree", drafter=drafter, budget=8, graph=False).token_ids)
    assert len(target.__dict__[ROUNDS.ATTR]) == 1
    assert outs[0] == outs[2]  # the round's scalars were set back for the third request
    generate_device(target, prompt, SamplingParams(max_tokens=4, temperature=0.7, top_k=5, ignore_eos=True, seed=4),
                    method="ddtree", drafter=drafter, budget=8, graph=False)
    assert len(target.__dict__[ROUNDS.ATTR]) == 2
