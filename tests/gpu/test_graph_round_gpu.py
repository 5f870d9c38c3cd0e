"""CUDA: whole decoding rounds replayed from CUDA graphs.

  * a device-resident round issues no host synchronization (torch sync-debug mode "error" around
    the round; the one read of the emitted tokens comes after it);
  * greedy graph rounds give exactly the tokens of the eager loop and of plain decoding
    (none / dflash / ddtree 4, 16, 64) on a random K2-tiny pair (float32) and on the embedded demo
    pair (float32), a few prompts x 64 tokens, graphs reused across prompts;
  * graph replay equals the same round run eagerly bit for bit (demo, bfloat16: same kernels);
  * sampled rounds: graph == device-eager for one seed, and the target's sequence distribution.
"""

from pathlib import Path

import pytest
import torch

from kdtree_engine.kernels.policy import KernelPolicy

POLICY = KernelPolicy()  # the default policy (batch invariance on, nothing forced)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEMO = Path(__file__).resolve().parents[2] / "kdtree_engine" / "assets" / "demo"
SETTINGS = (("none", None), ("dflash", None), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64))


def _tiny_pair(dtype=torch.float32, policy: KernelPolicy = POLICY):
    from kdtree_engine.config import preset
    from kdtree_engine.draft_config import DraftConfig
    from kdtree_engine.model.dflash import DFlashDrafter
    from kdtree_engine.model.target import Target

    cfg = preset("k2-tiny")
    target = Target.random(cfg, seed=0, dtype=dtype, device="cuda", policy=policy)
    dcfg = DraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, block_size=8, mask_token_id=255, target_layer_ids=(0, 3),
                       num_target_layers=4, vocab_size=256, sliding_windows=(4, None))
    return target, DFlashDrafter.random(dcfg, seed=0, dtype=dtype, device="cuda", policy=policy)


def _demo_pair(dtype):
    from kdtree_engine.engine import load_drafter, load_target
    target = load_target(DEMO, device=torch.device("cuda"), dtype=dtype, progress=False)
    return target, load_drafter(DEMO / "draft", target)


def _demo_prompts(n: int) -> list[list[int]]:
    from kdtree_engine.engine import load_tokenizer
    tok = load_tokenizer(DEMO)
    texts = ["def quicksort(items):\n    ", "class Stack:\n    def __init__(self):\n",
             "import os\n\ndef walk(path):\n", "for i in range(10):\n    print("]
    return [tok.encode(t, special=True, add_special_tokens=True) for t in texts[:n]]


def _check_equal(target, drafter, prompts, max_tokens=64):
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        plain = generate(target, prompt, params, eager=True)
        assert len(plain.token_ids) == max_tokens
        for method, budget in SETTINGS:
            d = drafter if method != "none" else None
            eager = generate(target, prompt, params, spec=method, drafter=d, budget=budget, eager=True)
            graph = generate(target, prompt, params, spec=method, drafter=d, budget=budget, eager=False)
            assert graph.stats["rounds_mode"] == "graph"
            assert eager.token_ids == plain.token_ids, (prompt, method, budget, "eager")
            assert graph.token_ids == plain.token_ids, (prompt, method, budget, "graph")
            assert graph.finish_reason == plain.finish_reason


def test_device_round_has_no_host_sync():
    from kdtree_engine.speculative.config import SpecConfig
    from kdtree_engine.speculative.device_round import DeviceRound

    target, drafter = _tiny_pair()
    for method, budget in (("none", None), ("dflash", None), ("ddtree", 16)):
        shape = SpecConfig(method, budget).resolve(drafter.block_size, target.cfg.vocab_size)
        rnd = DeviceRound(target, drafter if method != "none" else None, shape, 512)
        rnd.prefill([5, 6, 7, 8, 9])
        rnd.step()  # first call: lazy initialisation (cuBLAS handles, kernel caches) may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                rnd.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        vals = rnd.result.tolist()  # the round's one host read
        assert 1 <= vals[-1] <= rnd.m


def test_graph_rounds_equal_plain_tiny_fp32():
    target, drafter = _tiny_pair()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 255, (n,), generator=g).tolist() for n in (4, 11, 23)]
    _check_equal(target, drafter, prompts)


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="embedded demo missing")
def test_graph_rounds_equal_plain_demo_fp32():
    target, drafter = _demo_pair(torch.float32)
    _check_equal(target, drafter, _demo_prompts(3))


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="embedded demo missing")
def test_graph_replay_equals_device_eager_demo_bf16():
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate_device

    target, drafter = _demo_pair(torch.bfloat16)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for prompt in _demo_prompts(2):
        for method, budget in (("dflash", None), ("ddtree", 16)):
            a = generate_device(target, prompt, params, method=method, drafter=drafter, budget=budget, graph=False)
            b = generate_device(target, prompt, params, method=method, drafter=drafter, budget=budget, graph=True)
            assert a.token_ids == b.token_ids, (prompt, method, budget)
            assert a.stats["rounds"] == b.stats["rounds"]


def test_default_mode_on_cuda_is_graph_and_stop_rules_cut_mid_round():
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate

    target, drafter = _tiny_pair()
    prompt = [9, 8, 7, 6]
    plain = generate(target, prompt, SamplingParams(max_tokens=40, ignore_eos=True), eager=True)
    stop = plain.token_ids[17]
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,))
    want = generate(target, prompt, params, eager=True)
    got = generate(target, prompt, params, spec="ddtree", drafter=drafter, budget=16)
    assert got.stats["rounds_mode"] == "graph"
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    for n in (1, 5, 13):
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        assert generate(target, prompt, p, spec="dflash", drafter=drafter).token_ids == plain.token_ids[:n]


def test_graph_rounds_with_triton_attention():
    """KDTREE_ATTN_BACKEND=triton: eager steps use the host-length launch, graph rounds the device-length
    launch of the same kernel (same reduction): tokens equal plain decoding with the same backend."""
    target, drafter = _tiny_pair(policy=KernelPolicy(attn="triton"))
    g = torch.Generator().manual_seed(1)
    _check_equal(target, drafter, [torch.randint(2, 255, (n,), generator=g).tolist() for n in (6, 19)])


def test_device_length_attention_bitwise_gpu():
    """The device-length launch equals the host-length launch bit for bit on the GPU (bf16, CHUNK 512,
    prefixes across chunk boundaries, junk past S + T in the buffer)."""
    from kdtree_engine.kernels.mla_attention import mla_attention, mla_attention_device

    g = torch.Generator().manual_seed(0)
    N, C, R, cap = 8, 512, 64, 2048
    for S, T in ((0, 5), (300, 17), (512, 9), (1000, 64), (1500, 33)):
        q_lat = torch.randn(T, N, C, generator=g).to("cuda", torch.bfloat16)
        q_pe = torch.randn(T, N, R, generator=g).to("cuda", torch.bfloat16)
        buf = torch.randn(cap, C + R, generator=g).to("cuda", torch.bfloat16)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)]
        mask = torch.zeros(T, T, dtype=torch.bool)
        for i, p in enumerate(parents):
            mask[i] = mask[p] if p >= 0 else mask[i]
            mask[i, i] = True
        mask = mask.cuda()
        host = mla_attention(q_lat, q_pe, buf[: S + T], S, mask, 0.07, C)
        dev = mla_attention_device(q_lat, q_pe, buf, torch.tensor(S, device="cuda"), mask, 0.07, C)
        assert torch.equal(host, dev), (S, T)


@pytest.mark.parametrize("T,cap", [(1, 40000), (4, 40000), (16, 8192)])
def test_device_length_attention_graph_replay_bitwise_gpu(warpgroup_launches, T, cap):
    """CUDA-graph replays of the device-length attention at K2 widths (latent 512, rope 64, bf16: the warpgroup
    kernel for one query and for the prefix chunks of small trees) equal eager host-length launches bit for
    bit, with fresh queries, cache and committed length written into the captured buffers before each
    replay (lengths across chunk edges and past 32K; a 16-node tree runs as decode launches only over a
    buffer of few chunks)."""
    from kdtree_engine.kernels.mla_attention import mla_attention, mla_attention_device

    g = torch.Generator(device="cuda").manual_seed(T)
    N, C, R, scale = 8, 512, 64, 0.135
    q_lat = torch.randn(T, N, C, device="cuda", generator=g).to(torch.bfloat16)
    q_pe = torch.randn(T, N, R, device="cuda", generator=g).to(torch.bfloat16)
    buf = torch.randn(cap, C + R, device="cuda", generator=g).to(torch.bfloat16)
    s_dev = torch.tensor(100, device="cuda")
    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,))) for i in range(1, T)]
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    mask = mask.cuda()
    mla_attention_device(q_lat, q_pe, buf, s_dev, mask, scale, C)   # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_attention_device(q_lat, q_pe, buf, s_dev, mask, scale, C)
    assert warpgroup_launches, "the warpgroup kernel served no launch of the captured attention"
    for S in [S for S in (0, 511, 512, 4096 + 9, 7000, 33000) if S + T <= cap]:
        q_lat.copy_(torch.randn(T, N, C, device="cuda", generator=g).to(torch.bfloat16))
        q_pe.copy_(torch.randn(T, N, R, device="cuda", generator=g).to(torch.bfloat16))
        buf.copy_(torch.randn(cap, C + R, device="cuda", generator=g).to(torch.bfloat16))
        s_dev.fill_(S)
        out.fill_(float("nan"))
        graph.replay()
        host = mla_attention(q_lat, q_pe, buf[: S + T], S, mask, scale, C)
        assert torch.equal(out, host), (T, S, int((out != host).sum()))


def test_triton_tree_builder_equals_heap_gpu():
    """The one-program DDTree builder (compiled) returns the heap's tree, ties and -inf included."""
    from kdtree_engine.kernels.tree_ops import build_tree_triton
    from kdtree_engine.speculative.tree import build_tree_heap
    from kdtree_engine.sampling import topk_logprobs

    g = torch.Generator().manual_seed(0)
    for L, V, budget, kind in ((15, 1000, 16, ""), (15, 1000, 64, ""), (7, 3, 200, ""), (15, 32000, 256, ""),
                               (5, 20, 40, "ties"), (6, 30, 24, "neginf"), (15, 163840, 64, "")):
        logits = torch.randn(L, V, generator=g) * 3
        if kind == "ties":
            logits = (logits * 2).round() / 2
        if kind == "neginf":
            logits[:, V // 2:] = float("-inf")
        lp, ids = topk_logprobs(logits.cuda(), budget, policy=POLICY)
        ref = build_tree_heap(lp.cpu(), ids.cpu(), budget, 5, 100)
        got = build_tree_triton(lp, ids, budget, torch.tensor(5, device="cuda"), torch.tensor(100, device="cuda"))
        for name in ("tokens", "parents", "depths", "positions", "mask"):
            assert torch.equal(getattr(ref, name), getattr(got, name).cpu()), (L, V, budget, kind, name)


@pytest.mark.skipif(not (DEMO / "config.json").exists(), reason="embedded demo missing")
def test_round_bench_tiny_has_graph_columns(tmp_path):
    """bench/round.py --tiny on the GPU: the graph mode runs and reports rates and a kernel profile."""
    import math
    import sys

    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench import round as round_bench

    rep = round_bench.main(["--tiny", "--out", str(tmp_path), "--budgets", "4", "--max-tokens", "24"])
    assert (tmp_path / "round-h200.json").exists() or list(tmp_path.glob("round-*.json"))
    for r in rep["results"]:
        g = r["graph"]
        assert isinstance(g, dict), r["setting"]
        assert math.isfinite(g["rounds_per_s"]) and g["rounds_per_s"] > 0
        assert g["rounds"] == r["eager"]["rounds"] or r["setting"] != "none"
        assert "kernels" in g


def test_sampled_graph_rounds_equal_device_eager_and_follow_the_target():
    """Sampled rounds (temperature > 0): a graph replay equals the same round run eagerly for the same seed
    (same noise, same kernels); the default on CUDA is the graph; and the first tokens have the target's
    distribution (chi-square against the joint enumerated from plain forwards)."""
    from kdtree_engine.sampling import SamplingParams
    from kdtree_engine.speculative.decode import generate
    from kdtree_engine.speculative.decode import generate_device
    from speculative.spec_toys import chi_square_pvalue, first_tokens_distribution

    target, drafter = _tiny_pair()
    prompt = [9, 8, 7, 6]
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, ignore_eos=True, seed=3)
    for method, budget in (("none", None), ("dflash", None), ("ddtree", 16)):
        d = None if method == "none" else drafter
        a = generate_device(target, prompt, params, method=method, drafter=d, budget=budget, graph=False)
        b = generate_device(target, prompt, params, method=method, drafter=d, budget=budget, graph=True)
        c = generate(target, prompt, params, spec=method, drafter=d, budget=budget)
        assert c.stats["rounds_mode"] == "graph"
        assert a.token_ids == b.token_ids == c.token_ids and len(c.token_ids) == 40, (method, budget)
    with torch.no_grad():  # flatter logits (target and drafter share the head): many outcomes, drafts accepted
        target.lm_head_proj.weight.mul_(0.03)
    p3 = SamplingParams(max_tokens=3, temperature=0.3, top_k=3, ignore_eos=True)
    exact = first_tokens_distribution(target, prompt, p3, 3)
    n, counts, accepted = 1500, {}, 0
    for i in range(n):
        r = generate(target, prompt, SamplingParams(max_tokens=3, temperature=0.3, top_k=3, ignore_eos=True, seed=i),
                     spec="ddtree", drafter=drafter, budget=64)
        assert r.stats["rounds_mode"] == "graph"
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        accepted += r.stats["accepted_tokens"]
    assert accepted >= 10
    stat, pval = chi_square_pvalue(counts, exact, n)
    assert pval > 1e-4, (stat, pval)
