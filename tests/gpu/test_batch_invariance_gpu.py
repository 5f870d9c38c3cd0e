"""Batch invariance on CUDA, bit for bit: a row computed alone (M = 1) equals the same row computed
inside launches of M = 2..129 (and 256), for the dense GEMM at the K2 shapes in bfloat16 (fp16, and
fp32 at the router shape), and for RMSNorm. Also accuracy against fp32 with NaN-poisoned outputs.

    pytest -m gpu tests/gpu/test_batch_invariance_gpu.py -v -s
"""

from __future__ import annotations

import pytest
import torch

from kdtree_engine.kernels.gemm import Tile, bi_linear, reduction_for, tile_for
from kdtree_engine.kernels.rmsnorm import bi_rmsnorm, rmsnorm_reference
from tests.gpu.graph_replay import replays_match_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

K2_SHAPES = {  # name: (N, K)
    "q_a+kv_a": (2112, 7168),
    "q_b": (12288, 1536),
    "o_proj": (7168, 8192),
    "shared_w13": (4096, 7168),
    "shared_w2": (7168, 2048),
    "lm_head": (163840, 7168),
}
MS = list(range(2, 130)) + [192, 256]


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled floats, so an unwritten output element shows up."""
    orig, orig_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        t = orig(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*a, **k):
        t = orig_like(*a, **k)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def _check_invariant(fn, x: torch.Tensor, ms, sample_rows=(0, 1, 7, 15, 16, 17, 63, 64, 127, 128)):
    """fn(x[i:i+1]) == fn(x[:m])[i] for sampled rows i < m, and fn(x[:m]) == fn(x)[:m] for every m."""
    alone = {i: fn(x[i:i + 1])[0] for i in sample_rows if i < x.shape[0]}
    full = fn(x)
    bad = []
    for m in ms:
        y = fn(x[:m])
        if not torch.equal(y, full[:m]):
            rows = (y != full[:m]).any(dim=1).nonzero().flatten().tolist()
            bad.append(f"M={m}: rows {rows[:5]} differ from M={x.shape[0]}")
        for i, a in alone.items():
            if i < m and not torch.equal(y[i], a):
                bad.append(f"M={m}: row {i} differs from M=1 (max diff {(y[i].float() - a.float()).abs().max():.3g})")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("name", list(K2_SHAPES))
def test_bi_linear_bf16_batch_invariant_k2(name):
    N, K = K2_SHAPES[name]
    w = _rand(N, K, dtype=torch.bfloat16, scale=K ** -0.5)
    x = _rand(256, K, dtype=torch.bfloat16)
    ms = MS if N * K < 1 << 28 else [2, 3, 4, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 192]
    _check_invariant(lambda a: bi_linear(a, w), x, ms)


@pytest.mark.parametrize("name", ["q_a+kv_a", "shared_w2"])
def test_bi_linear_any_tile_same_bits(name):
    """Every tiling (MMA N size, BLOCK_N, warps, stages) gives the same bits: only the (N, K) reduction
    decides the rounding. If this fails, the M buckets in gemm.TILES_16BIT must share the failing knob."""
    N, K = K2_SHAPES[name]
    w = _rand(N, K, dtype=torch.bfloat16, scale=K ** -0.5)
    x = _rand(129, K, dtype=torch.bfloat16)
    ref = bi_linear(x, w, tile=Tile(16, 64, 4, 4))
    for t in [Tile(32, 64, 4, 4), Tile(64, 64, 4, 3), Tile(128, 128, 8, 3), Tile(64, 128, 4, 3),
              Tile(16, 128, 8, 4), Tile(128, 256, 8, 3), Tile(256, 128, 8, 3)]:
        try:
            y = bi_linear(x, w, tile=t)
        except Exception as e:  # a tile that does not fit this GPU's shared memory
            if "OutOfResources" in type(e).__name__:
                continue
            raise
        assert torch.equal(y, ref), f"tile {t} differs from 16x64"


@pytest.mark.parametrize("dtype,N,K", [(torch.float16, 4096, 7168), (torch.float32, 384, 7168),
                                       (torch.float32, 2112, 7168)])
def test_bi_linear_other_dtypes_batch_invariant(dtype, N, K):
    w = _rand(N, K, dtype=dtype, scale=K ** -0.5)
    x = _rand(160, K, dtype=dtype)
    _check_invariant(lambda a: bi_linear(a, w), x, [2, 3, 15, 16, 17, 33, 64, 65, 100, 129, 160])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 4, 16, 17, 64, 129, 256])
@pytest.mark.parametrize("name", ["q_a+kv_a", "q_b", "shared_w2"])
def test_bi_linear_accuracy(poisoned_empty, dtype, M, name):
    N, K = K2_SHAPES[name]
    w = _rand(N, K, dtype=dtype, scale=K ** -0.5)
    x = _rand(M, K, dtype=dtype)
    y = bi_linear(x, w)
    assert y.dtype == dtype and y.shape == (M, N)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    ref = x.double() @ w.double().T
    rel = float((y.double() - ref).norm() / ref.norm())
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel
    assert reduction_for(N, K, dtype) == reduction_for(N, K, dtype)
    assert tile_for(M, dtype).BLOCK_M >= 16


@pytest.mark.parametrize("H", [7168, 1536, 512])
def test_bi_rmsnorm_batch_invariant(poisoned_empty, H):
    w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    x = _rand(256, H, dtype=torch.bfloat16, scale=3.0)
    _check_invariant(lambda a: bi_rmsnorm(a, w, 1e-6), x, MS)
    y, ref = bi_rmsnorm(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6)
    assert torch.isfinite(y).all()
    # the same formula; only the mean's summation order and rsqrt rounding differ: <= 2 bf16 ulps
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
    assert ((y.float() - ref.float()).abs() <= 2 * ulp + 1e-30).all()


@pytest.mark.parametrize("H", [7168, 1536, 512])
def test_torch_rmsnorm_invariance_report(H):
    """Records whether torch's own RMSNorm arithmetic (layers.RMSNorm) is batch-invariant on this GPU
    (printed with -s; see kernels/rmsnorm.py). Not an assertion: torch's reduction heuristics may change
    between versions, which is why the model uses bi_rmsnorm on CUDA regardless."""
    w = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    x = _rand(129, H, dtype=torch.bfloat16, scale=3.0)
    full = rmsnorm_reference(x, w, 1e-6)
    diff_rows = [i for i in range(129) if not torch.equal(rmsnorm_reference(x[i:i + 1], w, 1e-6)[0], full[i])]
    print(f"\ntorch RMSNorm H={H} torch {torch.__version__}: {len(diff_rows)}/129 rows differ between M=1 "
          f"and M=129 ({'NOT ' if diff_rows else ''}batch-invariant)")


@pytest.mark.parametrize("heads", [64, 8])
@pytest.mark.parametrize("which", ["q_nope x W_UK", "o_lat x W_UV"])
def test_bi_head_linear_bf16_batch_invariant_k2(poisoned_empty, heads, which):
    """The MLA absorption products at K2 shapes (P = V = 128, C = 512; 64 heads, 8 per rank under TP8),
    with the operands as the model passes them: q_nope a slice of q, W_UK a transposed view."""
    from kdtree_engine.kernels.gemm import bi_head_linear

    if which == "q_nope x W_UK":
        x = _rand(256, heads, 192, dtype=torch.bfloat16)[..., :128]                          # [T, N, P]
        w = _rand(heads, 128, 512, dtype=torch.bfloat16, scale=128 ** -0.5).transpose(1, 2)  # [N, C, P]
    else:
        x = _rand(256, heads, 512, dtype=torch.bfloat16)                                     # [T, N, C]
        w = _rand(heads, 128, 512, dtype=torch.bfloat16, scale=512 ** -0.5)                  # [N, V, C]
    full = bi_head_linear(x, w)
    assert torch.isfinite(full).all(), "unwritten (NaN-poisoned) outputs"
    ref = torch.einsum("tbk,bnk->tbn", x.double(), w.double())
    assert float((full.double() - ref).norm() / ref.norm()) < 1e-2
    alone = {i: bi_head_linear(x[i:i + 1], w)[0] for i in (0, 1, 15, 16, 63, 64, 128)}
    bad = []
    for m in [1, 2, 3, 15, 16, 17, 33, 64, 65, 100, 128, 129, 192]:
        y = bi_head_linear(x[:m], w)
        if not torch.equal(y, full[:m]):
            bad.append(f"M={m} differs from M=256")
        bad += [f"M={m}: row {i} differs from M=1" for i, a in alone.items() if i < m and not torch.equal(y[i], a)]
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("name", ["q_a+kv_a", "o_proj", "shared_w2"])
def test_bi_linear_dependent_launch_reads_fresh_input_in_graphs(name):
    """The GEMM (and its split sum) start before the kernel writing x has finished and wait for it
    (programmatic dependent launch, pdl.py): captured after such a kernel and replayed with new values, it
    equals eager launches bit for bit."""
    N, K = K2_SHAPES[name]
    w = _rand(N, K, dtype=torch.bfloat16, scale=0.02)
    for M in (1, 5):
        replays_match_eager(lambda x: bi_linear(x, w), M, K, 6, name)


RANK_SHAPES = {  # one rank of TP8 / EP8 (the split launches a decode step runs): name: (N, K)
    "q_a+kv_a": (2112, 7168),
    "q_b rank": (1536, 1536),
    "shared_w13 rank": (512, 7168),
}


@pytest.mark.parametrize("name", list(RANK_SHAPES))
def test_serial_split_sums_equal_the_split_sum_launch(name, monkeypatch):
    """A split launch's partials summed by each tile's last program (arrival counters) give the bits of the
    split_sum launch, call after call (the counters go back to 0), replayed from a CUDA graph, and with a second
    split GEMM running at the same time on a side stream (each stream its own counters)."""
    from kdtree_engine.kernels import split_sum as sums
    from kdtree_engine.kernels.streams import side_by_side
    N, K = RANK_SHAPES[name]
    assert reduction_for(N, K, torch.bfloat16).n_splits(K) > 1, "a split shape"
    g = torch.Generator(device="cuda").manual_seed(N * 7 + K)
    w = (torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).bfloat16()
    w2 = (torch.randn(512, 7168, generator=g, device="cuda") * 7168 ** -0.5).bfloat16()
    for M in (1, 4, 16):
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        x2 = torch.randn(M, 7168, generator=g, device="cuda").bfloat16()
        with monkeypatch.context() as m:
            m.setattr(sums, "SERIAL_TILES", 0)
            want, want2 = bi_linear(x, w), bi_linear(x2, w2)
        for r in range(3):
            assert torch.equal(bi_linear(x, w), want), f"{name} M={M} call {r}"
        out = {}
        side_by_side(x.device, lambda: out.__setitem__("side", bi_linear(x2, w2)),
                     lambda: out.__setitem__("here", bi_linear(x, w)))
        torch.cuda.synchronize()
        assert torch.equal(out["here"], want) and torch.equal(out["side"], want2), f"{name} M={M} on two streams"
        replays_match_eager(lambda xb: bi_linear(xb, w), M, K, 3, f"{name} serial sums")
    assert all(int(c.abs().sum()) == 0 for c in sums._COUNTERS.values()), "arrival counters not back at 0"
