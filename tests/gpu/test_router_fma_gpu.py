"""The FMA router kernel (kernels/router_fma.py) on CUDA: the generic batch-invariant GEMM's bits on x.float()
(bi_linear), bit for bit, at the K2 gate and at odd shapes, for bf16 and float32 activations, with NaN-poisoned
outputs; rows computed alone equal the rows of every M; its partials through the router tail route like the
summed logits; in a CUDA graph after the kernel writing its input (dependent launch) it reads fresh values.

    pytest -m gpu tests/gpu/test_router_fma_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.gemm import bi_linear
from kdtree_engine.kernels.router_fma import router_logits_fma, unsupported

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.fixture
def poisoned_empty(monkeypatch):
    orig = torch.empty

    def empty(*a, **k):
        t = orig(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("N,K", [(384, 7168), (64, 2048), (72, 1040), (256, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_fma_equals_generic_gemm_bitwise(poisoned_empty, N, K, dtype):
    w = _rand(N, K, scale=K ** -0.5)
    assert unsupported(_rand(1, K, dtype=dtype), w) is None
    x = _rand(200, K, dtype=dtype)
    bad = []
    for M in (1, 2, 3, 5, 16, 17, 33, 64, 65, 129, 200):
        y = router_logits_fma(x[:M], w)
        assert torch.isfinite(y).all(), f"M={M}: unwritten (NaN-poisoned) outputs"
        ref = bi_linear(x[:M].float(), w)
        if not torch.equal(y, ref):
            bad.append(f"M={M}: {int((y != ref).sum())} of {y.numel()} differ from the generic GEMM")
        exact = x[:M].double() @ w.double().T
        assert float((y.double() - exact).norm() / exact.norm()) < 2e-6
    assert not bad, "\n".join(bad)


def test_router_fma_batch_invariant_k2(poisoned_empty):
    N, K = 384, 7168
    w = _rand(N, K, scale=K ** -0.5)
    x = _rand(256, K, dtype=torch.bfloat16)
    full = router_logits_fma(x, w)
    rows = (0, 1, 15, 16, 63, 64, 128)
    alone = {i: router_logits_fma(x[i:i + 1], w)[0] for i in rows}
    bad = []
    for m in list(range(2, 130)) + [192]:
        y = router_logits_fma(x[:m], w)
        if not torch.equal(y, full[:m]):
            bad.append(f"M={m} differs from M=256")
        bad += [f"M={m}: row {i} differs from M=1" for i in rows if i < m and not torch.equal(y[i], alone[i])]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("M", [1, 5, 64, 129])
def test_router_fma_partials_route_like_the_logits(M):
    from kdtree_engine.config import preset
    from kdtree_engine.kernels.router import route_triton
    cfg = preset("k2")
    N, K = 384, 7168
    w = _rand(N, K, scale=K ** -0.5)
    x = _rand(M, K, dtype=torch.bfloat16)
    bias = _rand(N, scale=0.05)
    parts = router_logits_fma(x, w, partials=True)
    logits = router_logits_fma(x, w)
    assert parts.dim() == 3 and parts.shape[1:] == (M, N)
    args = (bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    a, b = route_triton(parts, *args), route_triton(logits, *args)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_router_fma_dependent_launch_reads_fresh_input_in_graphs():
    N, K = 384, 7168
    w = _rand(N, K, scale=K ** -0.5)
    for M in (1, 5, 40, 70):
        src = _rand(M, K, dtype=torch.bfloat16)
        xb = torch.empty_like(src)
        torch.mul(src, 1.0, out=xb)
        router_logits_fma(xb, w, partials=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mul(src, 1.0, out=xb)     # a kernel writing the router's input
            y = router_logits_fma(xb, w, partials=True)
        for r in range(6):
            src.copy_(_rand(M, K, dtype=torch.bfloat16))
            graph.replay()
            assert torch.equal(y, router_logits_fma(src.clone(), w, partials=True)), f"M={M} replay {r} differs"


def test_router_fma_refuses_unaligned_rows():
    w = _rand(72, 1000)
    assert "16-byte" in unsupported(_rand(3, 1000, dtype=torch.bfloat16), w)


def test_router_dispatch_fma_mode(monkeypatch):
    from kdtree_engine.kernels import dispatch
    monkeypatch.setattr(dispatch, "_ROUTER_GEMM", "fma")
    w = _rand(384, 7168, scale=7168 ** -0.5)
    x = _rand(7, 7168, dtype=torch.bfloat16)
    assert torch.equal(dispatch.router_matmul(x, w), bi_linear(x.float(), w))
    assert torch.equal(dispatch.router_matmul(x, w, partials=True), router_logits_fma(x, w, partials=True))
