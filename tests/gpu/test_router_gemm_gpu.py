"""Router logits kernel on CUDA (kernels/router_gemm.py) at the K2 gate [384 x 7168]: accuracy against
float64 with NaN-poisoned outputs, bitwise batch invariance (a row computed alone equals the same row
inside calls of M = 2..129 and 256, with any tokens per program), and a CUDA graph whose router launch
depends on the kernel writing its input (programmatic dependent launch) reading fresh values.

    pytest -m gpu tests/gpu/test_router_gemm_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.bf16x3 import split_bf16x3
from kdtree_engine.kernels.router_gemm import RouterGemmConfig, router_config, router_logits, router_logits_bf16x3
from tests.gpu.graph_replay import replays_match_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N, K = 384, 7168


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.fixture
def poisoned_empty(monkeypatch):
    orig = torch.empty

    def empty(*a, **k):
        t = orig(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


# the table config and the other shapes of bench/router.py (each its own rounding, each batch-invariant)
CONFIGS = {"table": None, "b8_k1024_w4": RouterGemmConfig(8, 1024, 4, 16),
           "b4_k512_w1": RouterGemmConfig(4, 512, 1, 16), "b2_k1024_w1": RouterGemmConfig(2, 1024, 1, 16),
           "b4_k1024_w1": RouterGemmConfig(4, 1024, 1, 16)}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_logits_k2_accurate_and_batch_invariant(poisoned_empty, dtype, name):
    w = _rand(N, K, scale=K ** -0.5)
    x = _rand(256, K, dtype=dtype)
    cfg = CONFIGS[name] or router_config(N, K)
    full = router_logits(x, w, config=cfg)
    assert torch.isfinite(full).all(), "unwritten (NaN-poisoned) outputs"
    ref = x.double() @ w.double().T
    assert float((full.double() - ref).norm() / ref.norm()) < 2e-6
    rows = (0, 1, 15, 16, 63, 64, 128)
    alone = {i: router_logits(x[i:i + 1], w, config=cfg)[0] for i in rows}
    bad = []
    for j, m in enumerate(list(range(2, 130)) + [192]):
        tm = RouterGemmConfig(cfg.BN, cfg.KS, cfg.num_warps, (1, 4, 16, 64)[j % 4])
        y = router_logits(x[:m], w, config=tm)
        if not torch.equal(y, full[:m]):
            bad.append(f"M={m} differs from M=256")
        bad += [f"M={m}: row {i} differs from M=1" for i in rows if i < m and not torch.equal(y[i], alone[i])]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_router_logits_dependent_launch_reads_fresh_input_in_graphs(name):
    """The router kernel loads its weight block, then waits for the kernel that wrote x (pdl.py): captured
    after such a kernel and replayed with new values, it equals eager launches bit for bit."""
    w = _rand(N, K, scale=K ** -0.5)
    cfg = CONFIGS[name] or router_config(N, K)
    for M in (1, 5, 40):
        replays_match_eager(lambda x: router_logits(x, w, config=cfg), M, K, 6, name)


@pytest.mark.parametrize("M", [1, 5, 64])
def test_router_partials_route_like_the_logits(M):
    """The router kernel's split-K partials handed to the router tail (kernels/router.py adds them in split order):
    the same experts and weights, bit for bit, as the tail on the summed logits, at the K2 gate."""
    from kdtree_engine.config import preset
    from kdtree_engine.kernels.router import route_triton
    cfg = preset("k2")
    w = _rand(N, K, scale=K ** -0.5)
    x = _rand(M, K, dtype=torch.bfloat16)
    bias = _rand(N, scale=0.05)
    parts = router_logits(x, w, partials=True)
    logits = router_logits(x, w)
    assert parts.shape == (-(-K // router_config(N, K).KS), M, N)
    args = (bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    a, b = route_triton(parts, *args), route_triton(logits, *args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bf16x3_router_k2_accurate_and_batch_invariant(poisoned_empty):
    """The tensor-core router (router_logits_bf16x3, the engine's for bf16 activations) at the K2 gate: its partials
    added in index order within float32 accuracy of float64, every partial written, and a row computed alone equal
    to the same row inside calls of M = 2..129 and 192 (tiles of 16 / 32 / 64 / 128 rows)."""
    w = _rand(N, K, scale=K ** -0.5)
    parts = split_bf16x3(w)
    assert torch.equal((parts[2].float() + parts[1].float()) + parts[0].float(), w)
    x = _rand(256, K, dtype=torch.bfloat16)
    full = router_logits_bf16x3(x, parts)
    assert torch.isfinite(full).all(), "unwritten (NaN-poisoned) partials"
    logits = full[0].clone()
    for p in full[1:]:
        logits += p
    ref = x.double() @ w.double().T
    assert float((logits.double() - ref).norm() / ref.norm()) < 2e-6
    rows = (0, 1, 15, 16, 63, 64, 128)
    alone = {i: router_logits_bf16x3(x[i:i + 1], parts)[:, 0] for i in rows}
    bad = []
    for m in list(range(2, 130)) + [192]:
        y = router_logits_bf16x3(x[:m], parts)
        if not torch.equal(y, full[:, :m]):
            bad.append(f"M={m} differs from M=256")
        bad += [f"M={m}: row {i} differs from M=1" for i in rows if i < m and not torch.equal(y[:, i], alone[i])]
    assert not bad, "\n".join(bad[:20])


def test_bf16x3_router_in_graphs_and_through_the_tail():
    """Captured after a kernel writing its input and replayed with new values, the bf16x3 router equals eager launches
    bit for bit; its partials through the router tail give the experts and weights of their summed logits."""
    from kdtree_engine.config import preset
    from kdtree_engine.kernels.router import route_triton
    cfg = preset("k2")
    w = _rand(N, K, scale=K ** -0.5)
    parts = split_bf16x3(w)
    bias = _rand(N, scale=0.05)
    args = (bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    for M in (1, 5, 64):
        y = replays_match_eager(lambda x: router_logits_bf16x3(x, parts), M, K, 4, "bf16x3")
        logits = y[0].clone()
        for p in y[1:]:
            logits += p
        a, b = route_triton(y, *args), route_triton(logits, *args)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), f"M={M}: the tail on the partials differs"
