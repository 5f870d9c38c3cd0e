"""The BF16 / FP8 weight formats' kernels on CUDA (run with `-m gpu`): the W8A16 linear (kernels/w8a16.py) and the
fused grouped MoE on BF16 and FP8 experts (kernels/moe_grouped.py) against their torch references in bf16, at K2
shapes and small odd ones; batch invariance (a token's output alone equals its row among 64 tokens, bit for bit);
the grouped MoE captured in a CUDA graph (no host read) replays the eager bits. Seeds are printed."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="GPU tests run compiled kernels"),
]

from kdtree_engine.config import preset  # noqa: E402
from kdtree_engine.fp8 import Fp8Block, quantize_fp8  # noqa: E402
from kdtree_engine.kernels.moe_grouped import fused_moe_grouped  # noqa: E402
from kdtree_engine.kernels.policy import KernelPolicy  # noqa: E402
from kdtree_engine.kernels.reference import w8a16_linear_reference  # noqa: E402
from kdtree_engine.kernels.w8a16 import w8a16_linear  # noqa: E402
from kdtree_engine.model.moe import Experts, moe_reference  # noqa: E402

DEV = "cuda"
BF16_TOL = 1e-2
# K2's expert shape and top-8; 64 experts of its 384 (the kernels tile each expert alike; the GPU tests run side by
# side and 384 BF16 experts alone are 34 GB)
K2 = {"hidden": 7168, "inter": 2048, "experts": 64, "topk": 8}


def new_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    torch.manual_seed(seed)
    return seed


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def fp8_weight(n: int, k: int, block: Fp8Block):
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    return quantize_fp8(w, block)


def experts(H: int, I: int, E: int, block: Fp8Block | None) -> Experts:
    cfg = preset("k2-tiny").replace(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, n_group=1,
                                    topk_group=1)
    with torch.device(DEV):
        ex = Experts(cfg, dtype=torch.bfloat16, group_size=block, policy=KernelPolicy(dense="torch", int4="torch"))
    with torch.no_grad():
        for e in range(E):   # one expert at a time: no float32 copy of all of them
            w13 = torch.randn(2 * I, H, device=DEV) / H ** 0.5
            w2 = torch.randn(H, I, device=DEV) / I ** 0.5
            if block is None:
                ex.w13[e].copy_(w13)
                ex.w2[e].copy_(w2)
                continue
            g, gs = quantize_fp8(w13[:I], block)
            u, us = quantize_fp8(w13[I:], block)
            ex.w13[e].copy_(torch.cat([g, u]))
            ex.w13_scale_inv[e].copy_(torch.cat([gs, us]))
            w, s = quantize_fp8(w2, block)
            ex.w2[e].copy_(w)
            ex.w2_scale_inv[e].copy_(s)
    return ex


def grouped(ex: Experts, x, ids, tw, add=None):
    kw = {}
    if ex.fp8_block is not None:
        kw = dict(w13_scale_inv=ex.w13_scale_inv, w2_scale_inv=ex.w2_scale_inv, block=ex.fp8_block)
    return fused_moe_grouped(x, ex.w13, ex.w2, ids, tw, add=add, **kw)


def routing(T: int, E: int, k: int):
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)])
    return ids, torch.rand(T, k, device=DEV)


# ---- W8A16 linear -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,k", [(1536, 7168), (576, 7168), (16384, 512), (7168, 8192), (18432, 7168), (200, 328)])
@pytest.mark.parametrize("M", [1, 7, 16, 64])
def test_w8a16_matches_reference(n, k, M):
    seed = new_seed()
    block = Fp8Block(128, 128)
    w, s = fp8_weight(n, k, block)
    x = torch.randn(M, k, device=DEV).to(torch.bfloat16)
    got = w8a16_linear(x, w, s, block)
    want = w8a16_linear_reference(x, w, s, block)
    assert rel(got, want) < BF16_TOL, f"seed={seed}"


@pytest.mark.parametrize("n,k", [(1536, 7168), (7168, 8192), (200, 328)])
def test_w8a16_batch_invariant(n, k):
    seed = new_seed()
    block = Fp8Block(128, 128)
    w, s = fp8_weight(n, k, block)
    x = torch.randn(64, k, device=DEV).to(torch.bfloat16)
    full = w8a16_linear(x, w, s, block)
    for i in (0, 17, 63):
        assert torch.equal(w8a16_linear(x[i:i + 1], w, s, block), full[i:i + 1]), f"row {i} seed={seed}"
    assert torch.equal(w8a16_linear(x[:16], w, s, block), full[:16]), f"seed={seed}"


@pytest.mark.parametrize("n,k", [(1536, 7168), (576, 7168), (16384, 512), (7168, 8192)])
def test_w8a16_split_sums_keep_the_bits(n, k, monkeypatch):
    """Split partials summed by a second launch (what a launch past the arrival counters does) instead of each tile's
    last program: the same bits, eager and replayed from a graph."""
    from kdtree_engine.kernels import split_sum
    seed = new_seed()
    block = Fp8Block(128, 128)
    w, s = fp8_weight(n, k, block)
    for M in (1, 4, 16):
        x = torch.randn(M, k, device=DEV).to(torch.bfloat16)
        want = w8a16_linear(x, w, s, block)
        with monkeypatch.context() as m:
            m.setattr(split_sum, "SERIAL_TILES", 0)
            assert torch.equal(w8a16_linear(x, w, s, block), want), f"split_sum launch M={M} seed={seed}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w8a16_linear(x, w, s, block)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want), f"graph replay M={M} seed={seed}"
    assert all(int(c.abs().sum()) == 0 for c in split_sum._COUNTERS.values()), "arrival counters not back at 0"


# ---- grouped MoE ------------------------------------------------------------------------------------

FORMATS = {"bf16": None, "fp8": Fp8Block(128, 128)}


@pytest.fixture(scope="module")
def k2_experts():
    return {name: experts(K2["hidden"], K2["inter"], K2["experts"], block) for name, block in FORMATS.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("T", [1, 4, 16, 64])
def test_grouped_moe_matches_reference_at_k2_shapes(k2_experts, fmt, T):
    seed = new_seed()
    ex = k2_experts[fmt]
    x = torch.randn(T, K2["hidden"], device=DEV).to(torch.bfloat16)
    ids, tw = routing(T, K2["experts"], K2["topk"])
    add = torch.randn(T, K2["hidden"], device=DEV).to(torch.bfloat16)
    got = grouped(ex, x, ids, tw, add)
    want = (moe_reference(x, ids, tw, ex).float() + add.float()).to(torch.bfloat16)
    assert rel(got, want) < BF16_TOL, f"seed={seed}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_grouped_moe_batch_invariant(k2_experts, fmt):
    """A token alone gives the bits it has among 64 tokens, many of which share its experts."""
    seed = new_seed()
    ex = k2_experts[fmt]
    x = torch.randn(64, K2["hidden"], device=DEV).to(torch.bfloat16)
    ids, tw = routing(64, 16, K2["topk"])   # 16 of the 384 experts: every expert block holds many tokens
    full = grouped(ex, x, ids, tw)
    for i in (0, 31, 63):
        alone = grouped(ex, x[i:i + 1], ids[i:i + 1], tw[i:i + 1])
        assert torch.equal(alone, full[i:i + 1]), f"{fmt} token {i} seed={seed}"


@pytest.mark.parametrize("fmt,block", [("bf16", None), ("fp8-partial-blocks", Fp8Block(128, 64))])
def test_grouped_moe_odd_shapes(fmt, block):
    seed = new_seed()
    ex = experts(328, 200, 9, block)
    x = torch.randn(23, 328, device=DEV).to(torch.bfloat16)
    ids = torch.randint(-1, 9, (23, 3), device=DEV)   # repeats and unowned (-1) pairs
    tw = torch.rand(23, 3, device=DEV)
    got = grouped(ex, x, ids, tw)
    valid = ids >= 0
    want = moe_reference(x, torch.where(valid, ids, 0), torch.where(valid, tw, 0.0), ex)
    assert rel(got, want) < BF16_TOL, f"{fmt} seed={seed}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_grouped_moe_graph_replay_equals_eager(k2_experts, fmt):
    """No host read: the launch captures in a CUDA graph, and replays with new inputs give the eager bits."""
    seed = new_seed()
    ex = k2_experts[fmt]
    x = torch.randn(4, K2["hidden"], device=DEV).to(torch.bfloat16)
    ids, tw = routing(4, K2["experts"], K2["topk"])
    grouped(ex, x, ids, tw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped(ex, x, ids, tw)
    for r in range(3):
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
        new_ids, new_tw = routing(4, K2["experts"], K2["topk"])
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        graph.replay()
        assert torch.equal(y, grouped(ex, x.clone(), ids.clone(), tw.clone())), f"replay {r} seed={seed}"


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("serial", [True, False])
def test_grouped_moe_split_k_keeps_invariance(k2_experts, fmt, split, serial, monkeypatch):
    """The gate/up launch split along H and the down launch's along I (GroupedConfig.SPLIT_K / SPLIT_K2): close to
    the reference, a token alone gives the
    bits it has among 64 (the split is fixed by H and the config), the arrival-counter sums and the second-kernel
    sums give the same bits, and the counters are back at 0."""
    from dataclasses import replace as dc_replace
    from kdtree_engine.kernels import moe_grouped, split_sum
    seed = new_seed()
    ex = k2_experts[fmt]
    cfg = dc_replace(moe_grouped.GROUPED_CONFIG, SPLIT_K=split, SPLIT_K2=split // 2)
    if not serial:
        monkeypatch.setattr(split_sum, "SERIAL_TILES", 0)

    def run(x, ids, tw, add=None):
        kw = {}
        if ex.fp8_block is not None:
            kw = dict(w13_scale_inv=ex.w13_scale_inv, w2_scale_inv=ex.w2_scale_inv, block=ex.fp8_block)
        return fused_moe_grouped(x, ex.w13, ex.w2, ids, tw, add=add, config=cfg, **kw)
    x = torch.randn(64, K2["hidden"], device=DEV).to(torch.bfloat16)
    ids, tw = routing(64, 16, K2["topk"])
    full = run(x, ids, tw)
    want = moe_reference(x, ids, tw, ex)
    assert rel(full, want) < BF16_TOL, f"seed={seed}"
    for i in (0, 31, 63):
        alone = run(x[i:i + 1], ids[i:i + 1], tw[i:i + 1])
        assert torch.equal(alone, full[i:i + 1]), f"{fmt} token {i} seed={seed}"
    monkeypatch.undo()
    monkeypatch.setattr(split_sum, "SERIAL_TILES", 0 if serial else split_sum.SERIAL_TILES)
    other = run(x[:1], ids[:1], tw[:1])   # the other way of summing the partials
    assert torch.equal(other, full[:1]), f"{fmt} seed={seed}"
    torch.cuda.synchronize()
    monkeypatch.undo()
    assert int(split_sum.arrival_counters(x.device, 1).abs().sum()) == 0
