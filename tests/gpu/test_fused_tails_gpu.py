"""The one-launch tails on CUDA (bit for bit where the arithmetic is the same): residual add + RMSNorm
equals torch's add followed by bi_rmsnorm; the router tail picks torch's experts (stable-sort ties) with
weights within a few ulps; SwiGLU is within two ulps of torch's silu * up; the drafter's head norm +
rope is within two ulps (of the row's largest value) of torch's norm then rotate-half rope; all give a
row the same bits alone and inside a block.

    pytest -m gpu tests/gpu/test_fused_tails_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdtree_engine.config import preset
from kdtree_engine.kernels.head_norm_rope import head_norm_rope, head_norm_rope_torch
from kdtree_engine.kernels.rmsnorm import bi_add_rmsnorm, bi_rmsnorm
from kdtree_engine.kernels.router import route_triton
from kdtree_engine.kernels.swiglu import silu_mul
from kdtree_engine.model.dflash import rope_tables
from kdtree_engine.kernels.reference import route_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


@pytest.mark.parametrize("H", [256, 7168, 1000])
@pytest.mark.parametrize("M", [1, 7, 129])
def test_add_rmsnorm_is_add_then_norm(M: int, H: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(M * H)
    h, d = (torch.randn(M, H, generator=g, device=DEV).bfloat16() for _ in range(2))
    w = (torch.rand(H, generator=g, device=DEV) + 0.5).bfloat16()
    s, y = bi_add_rmsnorm(h, d, w, 1e-6)
    assert torch.equal(s, h + d)
    assert torch.equal(y, bi_rmsnorm(h + d, w, 1e-6))
    for i in (0, M - 1):
        a = bi_add_rmsnorm(h[i:i + 1], d[i:i + 1], w, 1e-6)
        assert torch.equal(a[0][0], s[i]) and torch.equal(a[1][0], y[i])


@pytest.mark.parametrize("E,k,G,tg", [(8, 2, 1, 1), (384, 8, 1, 1), (256, 8, 8, 4)])
def test_router_matches_torch_path(E: int, k: int, G: int, tg: int) -> None:
    cfg = preset("k2-tiny").replace(n_routed_experts=E, num_experts_per_tok=k, n_group=G, topk_group=tg)
    g = torch.Generator(device=DEV).manual_seed(E)
    logits = torch.randn(65, E, generator=g, device=DEV) * 2
    bias = torch.randn(E, generator=g, device=DEV) * 0.1
    ids, w = route_triton(logits, bias, k, G, tg, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    rids, rw = route_torch(logits, bias, cfg)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=8 * torch.finfo(torch.float32).eps, atol=0)
    one = route_triton(logits[3:4], bias, k, G, tg, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    assert torch.equal(one[0][0], ids[3]) and torch.equal(one[1][0], w[3])


@pytest.mark.parametrize("T,ranks", [(1, 8), (65, 8), (300, 3)])
def test_moe_owned_routes_are_the_torch_form(T: int, ranks: int) -> None:
    """Expert parallel: the router tail makes each rank's routes its own in its launch (local ids, -1 and weight 0
    for another rank's experts), the bits of the torch form on its global routes, for every rank of the group."""
    from kdtree_engine.parallel.experts import owned_routes
    g = torch.Generator(device=DEV).manual_seed(T * ranks)
    per = -(-384 // ranks)
    logits = torch.randn(T, 384, generator=g, device=DEV) * 2
    bias = torch.randn(384, generator=g, device=DEV) * 0.1
    routes = route_triton(logits, bias, 8, 1, 1, True, 2.5)
    for r in range(ranks):
        owned = range(r * per, min((r + 1) * per, 384))
        tail, want = route_triton(logits, bias, 8, 1, 1, True, 2.5, owned), owned_routes(*routes, owned)
        assert torch.equal(tail[0], want[0]) and torch.equal(tail[1], want[1]), f"rank {r} of {ranks}"


def test_silu_mul_close_to_torch() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    gate, up = (torch.randn(33, 2 * 2048, generator=g, device=DEV) * 3).bfloat16().chunk(2, dim=-1)
    y, ref = silu_mul(gate, up), F.silu(gate) * up
    ulp = torch.finfo(torch.bfloat16).eps * ref.double().abs().clamp_min(1e-30)
    assert float(((y.double() - ref.double()).abs() / ulp).max()) <= 2  # rounded silu may be 1 ulp off
    assert torch.equal(silu_mul(gate[5:6], up[5:6])[0], y[5])


@pytest.mark.parametrize("T,H,d", [(16, 4, 64), (33, 2, 128), (1, 32, 128)])
def test_head_norm_rope_close_to_torch(T: int, H: int, d: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(T * H * d)
    x = (torch.randn(T, 2 * H * d, generator=g, device=DEV) * 3).bfloat16()[:, : H * d].view(T, H, d)  # k of k|v
    w = (torch.rand(d, generator=g, device=DEV) + 0.5).bfloat16()
    cos, sin = rope_tables(torch.randint(0, 32768, (T,), generator=g, device=DEV), d, 1e6, torch.bfloat16)
    y, ref = head_norm_rope(x, w, 1e-6, cos, sin), head_norm_rope_torch(x, w, 1e-6, cos, sin)
    ulp = torch.finfo(torch.bfloat16).eps * ref.double().abs().amax(dim=-1, keepdim=True)
    assert float(((y.double() - ref.double()).abs() / ulp).max()) <= 2
    assert torch.equal(head_norm_rope(x[T - 1:], w, 1e-6, cos[T - 1:], sin[T - 1:])[0], y[T - 1])


def _graph_fresh(make_inputs, fn, label: str) -> None:
    """fn captured in a CUDA graph right after a kernel that writes its inputs (its dependent launch starts
    early and waits, pdl.py), replayed with new values: each replay equals an eager call bit for bit."""
    src = make_inputs()
    bufs = [torch.empty_like(t) for t in src]
    for b, t in zip(bufs, src):
        torch.mul(t, 1, out=b)
    fn(*bufs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b, t in zip(bufs, src):
            torch.mul(t, 1, out=b)      # kernels writing the inputs
        out = fn(*bufs)
    outs = out if isinstance(out, tuple) else (out,)
    for r in range(4):
        for t, n in zip(src, make_inputs()):
            t.copy_(n)
        graph.replay()
        want = fn(*[t.clone() for t in src])
        want = want if isinstance(want, tuple) else (want,)
        assert all(torch.equal(a, b) for a, b in zip(outs, want)), f"{label}: replay {r} differs from eager"


def test_tails_dependent_launches_read_fresh_inputs_in_graphs() -> None:
    from kdtree_engine.kernels.rope import rope_heads
    H = 7168
    w = torch.randn(H, device=DEV).to(torch.bfloat16)
    cos, sin = (torch.randn(5, 32, device=DEV) for _ in range(2))
    bias = torch.randn(384, device=DEV) * 0.1
    bf = lambda *s: torch.randn(*s, device=DEV).to(torch.bfloat16)  # noqa: E731
    _graph_fresh(lambda: [bf(5, H)], lambda x: bi_rmsnorm(x, w, 1e-6), "rmsnorm")
    _graph_fresh(lambda: [bf(5, H), bf(5, H)], lambda h, d: bi_add_rmsnorm(h, d, w, 1e-6), "add_rmsnorm")
    _graph_fresh(lambda: [bf(5, 2048), bf(5, 2048)], silu_mul, "silu_mul")
    _graph_fresh(lambda: [bf(5, 8, 192)], lambda q: rope_heads(q, 128, cos, sin), "rope_heads")
    _graph_fresh(lambda: [torch.randn(5, 384, device=DEV)], lambda lg: route_triton(lg, bias, 8, 1, 1, True, 2.5),
                 "router tail")
